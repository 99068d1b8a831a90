"""Learners that train a runner config: its model, loss, data shards, inner
optimizer and validation split.

``decentral-jax learners --config configs/gpt_tiny.py --learners K
--config.FIELD=VALUE ...`` loads the config exactly as ``decentral-jax
train`` does (:func:`decentral_jax.runner.presets.load_named_or_file`, then
:func:`decentral_jax.runner.validation.check_config`) with ``n_workers = K``
and ``algorithm = diloco``, and builds from it, through the runner's public
functions:

* the task (:func:`decentral_jax.runner.tasks.make_task`: any registered
  model or ``module:attr`` extension): learner ``i`` reads worker ``i``'s
  shard of ``n_workers = K``, its batch at inner step ``t`` is row ``i`` of
  ``task.host_batch(t)``, the rows the runner feeds worker ``i`` at step
  ``t``; ``global_batch / K`` sequences (images) per inner step;
* the initial parameters and dropout keys of the run
  (:func:`decentral_jax.runner.experiment.run_keys`; worker ``i``'s key of
  step ``t`` is ``fold_in(fold_in(dropout_key, t), i)`` as in
  :func:`decentral_jax.runner.step.train_step`; micro-batches as
  :func:`~decentral_jax.runner.step.loss_and_grad`);
* DiLoCo's inner optimizer of the config
  (:func:`decentral_jax.runner.methods.parts.inner`: gradient clip and
  AdamW / AccumAdamW / your own, on the config's learning-rate schedule,
  counted in inner steps), and the outer Nesterov SGD's ``lr`` and
  ``momentum`` (``config.outer_optimizer``), the sync period
  (``config.sync_every``) and the pseudo-gradients' compression
  (``config.compression``) for the :class:`~decentral_jax.tools.learners.
  spec.RunSpec`;
* the evaluation of ``theta`` on the config's validation split
  (``eval/loss``, and ``eval/accuracy`` for classifiers).

Fields that have no meaning for learners are refused by name
(:func:`check_learner_fields`): another algorithm (a gossip topology, SGP,
...), an outer Adam or plain momentum, ``outer_overlap``, simulated
``faults`` (learners fail for real), a ``tracker`` or ``tensorboard``
(learners write ``metrics.jsonl`` only), ``comm_dtype``, a global average,
``distributed.enabled`` (learners are Ray actors), several devices per
worker, non-float32 parameters, top-k compression or compression without
error feedback; so is ``steps`` not a multiple of ``sync_every``
(:func:`check_whole_periods`). An override of a field learners do not read
(:data:`NO_EFFECT`: ``checkpoint_interval``, ``keep_checkpoints``,
``log_interval``, ``consensus_at``, ``workdir``) is refused too, as is one
of the evaluation's ``eval_interval`` or ``eval_batches`` without
``--workdir`` (:func:`check_evaluation_overrides`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from ml_collections import config_dict

from decentral_jax.runner import builders
from decentral_jax.runner import experiment
from decentral_jax.runner import presets
from decentral_jax.runner import step as step_lib
from decentral_jax.runner import tasks
from decentral_jax.runner import validation
from decentral_jax.runner.methods import parts

PyTree = Any
ALGORITHM = "diloco"
# Compression formats a RunSpec carries (top-k needs its fraction too).
COMPRESSORS = ("none", "int8", "fp8", "int4", "fp4")


# Runner fields learners do not read (a config file may set them for
# ``train``; an override of one on the learners' command line is refused):
# field -> what learners do instead.
NO_EFFECT = {
    "checkpoint_interval": "the synchronizer saves a checkpoint after every "
                           "merge (the newest 2 kept)",
    "keep_checkpoints": "the synchronizer keeps its newest 2 checkpoints",
    "log_interval": "learners write one metrics record per merged period",
    "consensus_at": "learners have no per-step program; theta is the "
                    "synchronizer's, evaluated in --workdir's metrics.jsonl",
    "workdir": "the learners' run directory is --workdir DIR",
}

# Runner fields learners read only for their evaluation, which goes into
# --workdir's metrics.jsonl (every --eval-every merged periods when given).
EVAL_FIELDS = ("eval_interval", "eval_batches")


def override_key(override: str) -> str:
  """The field of ``"--config.FIELD=VALUE"`` (or ``"FIELD=VALUE"``)."""
  if override.startswith("--config."):
    override = override[len("--config."):]
  return override.partition("=")[0].strip()


def check_evaluation_overrides(overrides, workdir: bool, eval_every: bool
                               ) -> None:
  """Refuses an override of :data:`EVAL_FIELDS` that the run would not
  read: any without ``--workdir`` (no evaluation is run), and
  ``eval_interval`` with ``--eval-every`` (which sets the period).

  Raises:
    ValueError: naming the override and the flag, with the fix.
  """
  for o in overrides:
    key = override_key(o)
    if key in EVAL_FIELDS and not workdir:
      raise ValueError(f"{o} has no effect for learners without --workdir "
                       "(theta is evaluated only into --workdir's "
                       "metrics.jsonl); add --workdir DIR or drop it.")
    if key == "eval_interval" and eval_every:
      raise ValueError(f"{o} has no effect with --eval-every (it sets the "
                       "merged periods between evaluations); drop one of "
                       "them.")


def load(config: str, overrides=(), learners: int = 2
         ) -> config_dict.ConfigDict:
  """The validated runner config of ``K = learners`` learners.

  Args:
    config: a preset name or ``FILE.py[:ARG]`` (as ``decentral-jax train
      --config``).
    overrides: ``"field=value"`` or ``"--config.field=value"`` strings.
    learners: ``K``; sets ``config.n_workers`` (an override giving it
      another value is refused, as is one of a field of :data:`NO_EFFECT`).

  Raises:
    ValueError: a bad file or override (the runner's one-line messages), a
      field the runner refuses, or one :func:`check_learner_fields` refuses.
  """
  overrides = [o if o.startswith("--") else f"--config.{o}"
               for o in overrides]
  for o in overrides:
    key, value = override_key(o), o.partition("=")[2]
    if key in NO_EFFECT:
      raise ValueError(f"{o} has no effect for learners: "
                       f"{NO_EFFECT[key]}; drop it.")
    if key == "n_workers" and value.strip() != str(learners):
      raise ValueError(f"{o}: learners set config.n_workers to --learners="
                       f"{learners}; drop the override.")
  c = presets.load_named_or_file(
      config, [*overrides, f"--config.n_workers={learners}"])
  check_learner_fields(c)
  validation.check_config(c)
  check_whole_periods(c)
  return c


def check_whole_periods(c: config_dict.ConfigDict) -> None:
  """Refuses ``config.steps`` not a multiple of ``config.sync_every``:
  learners run whole sync periods (``periods = steps / sync_every``) and
  the schedule decays over ``steps`` inner steps.

  Raises:
    ValueError: naming both fields, the nearest multiples of
      ``sync_every`` and the divisor of ``steps`` nearest ``sync_every``.
  """
  steps, h = int(c.steps), int(c.sync_every)
  if steps % h == 0:
    return
  near = [n for n in (steps // h * h, steps // h * h + h) if n > 0]
  divisors = {d for i in range(1, math.isqrt(steps) + 1) if steps % i == 0
              for d in (i, steps // i)}
  divisor = min(sorted(divisors), key=lambda d: abs(d - h))
  raise ValueError(
      f"config.steps={steps} is not a multiple of config.sync_every={h}: "
      "learners run whole sync periods; set "
      + " or ".join(f"--config.steps={n}" for n in near)
      + f", or --config.sync_every={divisor}.")


def without_n_workers(overrides) -> tuple[str, ...]:
  """``overrides`` less those of ``config.n_workers`` (the learner count,
  which ``--learners`` sets: a run may resume with another)."""
  return tuple(o for o in overrides if override_key(o) != "n_workers")


def config_difference(saved_args, ours_args, learners: int
                      ) -> tuple[str, Any, Any] | None:
  """Whether two runs' ``problem_args`` (``config``, ``overrides``) give
  the same runner config: None if they do (overrides reordered, repeated,
  spelled as the default or as another literal of the same value), else
  the first differing field ``("config.FIELD", saved, ours)``;
  ``config.n_workers`` is the learner count and not compared (its
  overrides are dropped from both sides before loading, so a run started
  with ``--config.n_workers=K --learners K`` resumes with other learners).

  Raises:
    ValueError: either config does not load (its one-line error).
  """
  def values(args):
    args = dict(args)
    c = load(args.get("config", ""),
             without_n_workers(args.get("overrides", ())), learners)
    got = traverse_util.flatten_dict(c.to_dict(), sep=".")
    got.pop("n_workers", None)
    return got
  a, b = values(saved_args), values(ours_args)
  for key in sorted(set(a) | set(b)):
    if a.get(key, "<missing>") != b.get(key, "<missing>"):
      return f"config.{key}", a.get(key, "<missing>"), b.get(key, "<missing>")
  return None


def _refusals(c) -> list[tuple[str, Any, bool, str]]:
  """``(field, value, refused, fix)`` of the fields learners cannot honour."""
  model = c.model
  comp = c.compression
  o = c.outer_optimizer
  return [
      ("algorithm", c.algorithm, c.algorithm != ALGORITHM,
       "learners run DiLoCo through the synchronizer (no gossip topology, "
       f"no other method); set --config.algorithm={ALGORITHM}"
       + (" and give Streaming DiLoCo's fragments and overlap as "
          "--fragments P --overlap-steps TAU"
          if c.algorithm == "streaming_diloco" else "")),
      ("outer_optimizer.name", o.name, o.name != "sgd",
       "the synchronizer's outer optimizer is SGD with Nesterov momentum"),
      ("outer_optimizer.nesterov", o.nesterov, not o.nesterov,
       "the synchronizer's outer optimizer is SGD with Nesterov momentum"),
      ("outer_overlap", c.outer_overlap, c.outer_overlap != "none",
       "the synchronizer's merge is its own overlap; set it to none"),
      ("faults.enabled", c.faults.enabled, bool(c.faults.enabled),
       "learners fail for real (docs/learners.md); set it to False"),
      ("tracker", c.tracker, bool(c.tracker),
       "learners write metrics.jsonl only; set it to ''"),
      ("tensorboard", c.tensorboard, bool(c.tensorboard),
       "learners write metrics.jsonl only; set it to False"),
      ("comm_dtype", c.comm_dtype, bool(c.comm_dtype),
       "pseudo-gradients travel in float32 or in config.compression"),
      ("distributed.enabled", c.distributed.enabled,
       bool(c.distributed.enabled),
       "learners are Ray actors, not processes of one multi-process job "
       "(--address attaches to a Ray cluster); set it to False"),
      ("global_avg_interval", c.global_avg_interval,
       int(c.global_avg_interval) != 0, "set it to 0"),
      ("workers_per_device", c.get("workers_per_device", 1),
       int(c.get("workers_per_device", 1)) != 1,
       "a learner is one process on its own devices; set it to 1"),
      ("devices_per_worker", c.devices_per_worker,
       int(c.devices_per_worker) != 1,
       "a learner is one process on its own devices; set it to 1"),
      ("model.param_dtype", model.get("param_dtype", "float32"),
       model.get("param_dtype", "float32") != "float32",
       "theta is held in float32; set it to float32"),
      ("compression.format", comp.format, comp.format not in COMPRESSORS,
       f"learners send one of {COMPRESSORS}"),
      ("compression.error_feedback", comp.error_feedback,
       comp.format != "none" and not comp.error_feedback,
       "learners keep the full residual; set error_feedback=True"),
      ("compression.error_decay", comp.error_decay,
       comp.format != "none" and float(comp.error_decay) != 1.0,
       "learners keep the full residual; set error_decay=1"),
  ]


def check_learner_fields(c: config_dict.ConfigDict) -> None:
  """Refuses a field learners cannot honour.

  Raises:
    ValueError: ``config.<field>=<value> has no meaning for learners: <fix>``
      for the first such field.
  """
  for field, value, refused, fix in _refusals(c):
    if refused:
      raise ValueError(f"config.{field}={value!r} has no meaning for "
                       f"learners: {fix}.")


def schedule_text(c: config_dict.ConfigDict) -> str:
  """``config.schedule`` in words, as :func:`decentral_jax.runner.builders.
  make_schedule` steps it (``peak_lr`` is ``RunSpec.inner_lr``):
  ``"constant"``, ``"inverse_sqrt, warmup W"`` or ``"warmup_cosine,
  warmup W, to FINAL at step STEPS"`` (steps counted in inner steps)."""
  s = c.schedule
  if s.name == "constant":
    return "constant"
  if s.name == "inverse_sqrt":
    return f"inverse_sqrt, warmup {int(s.warmup_steps)}"
  return (f"{s.name}, warmup {int(s.warmup_steps)}, to {float(s.final_lr):g} "
          f"at step {max(int(c.steps), int(s.warmup_steps) + 1)}")


def spec_fields(c: config_dict.ConfigDict) -> dict:
  """The :class:`~decentral_jax.tools.learners.spec.RunSpec` fields the
  config sets, the one description of the run its learners train (the
  command's summary and ``--json`` print it): ``shards`` (``n_workers``),
  ``sync_every``, ``periods`` (``steps / sync_every``), the inner
  optimizer the learners build (:meth:`RunnerTask.inner`: ``inner`` =
  ``optimizer.name``, ``inner_lr`` = ``schedule.peak_lr``,
  ``inner_schedule`` = :func:`schedule_text`), ``outer_lr``,
  ``outer_momentum``, ``compressor`` and ``block``."""
  comp = c.compression
  return {"shards": int(c.n_workers), "sync_every": int(c.sync_every),
          "periods": int(c.steps) // int(c.sync_every),
          "inner": str(c.optimizer.name),
          "inner_lr": float(c.schedule.peak_lr),
          "inner_schedule": schedule_text(c),
          "outer_lr": float(c.outer_optimizer.lr),
          "outer_momentum": float(c.outer_optimizer.momentum),
          "compressor": str(comp.format), "block": int(comp.block)}


def flat(tree) -> dict:
  """Nested parameter dicts as one dict of float32 NumPy leaves keyed by
  ``/``-joined paths.

  Raises:
    ValueError: a parameter tree that is not nested dicts of arrays.
  """
  if not isinstance(tree, dict):
    raise ValueError(f"the model's parameters are a {type(tree).__name__}; "
                     "learners need nested dicts (Flax's params).")
  return {k: np.asarray(v, np.float32)
          for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def nested(params: dict) -> dict:
  """The inverse of :func:`flat`."""
  return traverse_util.unflatten_dict(params, sep="/")


class RunnerTask:
  """The task, keys and losses of a config for ``K`` learners.

  Attributes:
    config: the validated config.
    task: the runner's :class:`~decentral_jax.runner.tasks.Task` built for
      ``n_workers = K`` workers of ``global_batch / K`` rows.
    dropout: the loss takes a per-step, per-learner dropout key.
    micro_batches: ``config.micro_batches``.
  """

  def __init__(self, c: config_dict.ConfigDict):
    self.config = c
    n = int(c.n_workers)
    self.task = tasks.make_task(c, n, int(c.global_batch) // n)
    self.init_key, dropout_key = experiment.run_keys(c)
    self.dropout = tasks.uses_dropout(c)
    self.micro_batches = int(c.micro_batches)
    self._key = jax.jit(lambda t, i: jax.random.key_data(jax.random.fold_in(
        jax.random.fold_in(dropout_key, t), i)))
    self._eval = jax.jit(lambda p, batch: self.task.loss(nested(p), batch,
                                                         None))

  def init_params(self) -> dict:
    """The run's initial parameters, flat (:func:`flat`)."""
    return flat(jax.device_get(self.task.init_params(self.init_key)))

  def batch(self, shard: int, t: int) -> tuple:
    """Worker ``shard``'s rows of inner step ``t``, and (with dropout) its
    uint32 [2] key data."""
    rows = tuple(np.asarray(x[0])
                 for x in self.task.host_batch(int(t), [int(shard)]))
    if self.dropout:
      rows += (np.asarray(self._key(int(t), int(shard))),)
    return rows

  def loss(self, params: dict, batch: tuple) -> jax.Array:
    """The training loss of flat ``params`` on :meth:`batch`'s output: the
    mean of the micro-batches' losses (float32 scalar)."""
    key = None
    if self.dropout:
      batch, key = batch[:-1], jax.random.wrap_key_data(batch[-1])
    p, k = nested(params), self.micro_batches
    if k == 1:
      return self.task.loss(p, batch, key)[0]
    micro = step_lib.micro_batch_split(batch, k)
    total = jnp.zeros([], jnp.float32)
    for j in range(k):
      sub = None if key is None else jax.random.fold_in(key, j)
      total += self.task.loss(p, tuple(x[j] for x in micro), sub)[0]
    return total / k

  def inner(self):
    """DiLoCo's inner optimizer of the config, on its schedule."""
    return parts.inner(self.config, builders.make_schedule(self.config))

  def evaluate(self, params: dict) -> dict:
    """``eval/loss`` (and ``eval/accuracy``) of flat ``params`` on the
    config's validation split: the mean over its ``eval_batches`` batches
    of ``global_batch`` rows (nats)."""
    losses, accs = [], []
    for b in range(len(self.task.eval_set[0])):
      value, aux = self._eval(params, tuple(x[b] for x in self.task.eval_set))
      losses.append(float(value))
      if "accuracy" in aux:
        accs.append(float(aux["accuracy"]))
    out = {"eval/loss": float(np.mean(losses))}
    if accs:
      out["eval/accuracy"] = float(np.mean(accs))
    return out

  def train_loss(self, params: dict, shards, t: int) -> float:
    """Mean over ``shards`` of the loss of ``params`` on their batches of
    inner step ``t`` (no dropout): with ``t = kH`` and ``theta_k`` what
    every worker starts period ``k`` from, the loss the runner logs for
    step ``kH + 1``."""
    losses = []
    for s in shards:
      rows = tuple(np.asarray(x[0])
                   for x in self.task.host_batch(int(t), [int(s)]))
      losses.append(float(self._eval(params, rows)[0]))
    return float(np.mean(losses))

  def learning_rate(self, step: int) -> float:
    """The inner learning rate of step ``step`` (1-based), as the runner's
    records give it."""
    return float(builders.make_schedule(self.config)(max(int(step) - 1, 0)))
