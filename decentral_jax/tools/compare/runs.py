"""The main job's methods and runs: what each arm of the comparison sets.

* :class:`Run`, :data:`RUNS`, :data:`METHODS`: the method table (name,
  algorithm, optimizer, topology and further config fields; the label is
  the method's display name from its home plus these settings);
  :data:`TUNED_PEAK_LR`: each method's tuned peak learning rate;
  :data:`DEFAULT_METHODS`, :data:`FULL_METHODS`: the quick and full jobs;
* :func:`select_runs`, :func:`parse_seeds`: the ``--methods`` and
  ``--seeds`` values;
* :func:`run_config`, :func:`arm_configs`, :func:`job_arms`: a base config
  set up per method and seed (:class:`Arm`), each checked before any run
  trains; :func:`overridden_fields`: the notes on ``--config`` overrides a
  method sets itself or does not read.
"""

from __future__ import annotations

import dataclasses
import types

from ml_collections import config_dict

from decentral_jax import checks
from decentral_jax import topology as topology_lib
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import methods
from decentral_jax.runner import validation
from decentral_jax.tools import flag_types

# The methods of the quick default job (see RUNS) and of --full.
DEFAULT_METHODS = ("all_reduce", "dadam", "diloco", "local_sgd")
FULL_METHODS = ("all_reduce", "dadam", "accum_adamw", "diloco",
                "local_sgd", "local_dadam")


# How a Run's own setting reads in its label, after the method's display
# name: "DiLoCo, H=10, Nesterov lr 0.3"; another field as "field=value".
_DETAILS = {
    "workers_per_node": "{} workers/node", "optimizer.accum_steps": "T={}",
    "optimizer.b2": "b2 {}", "sync_every": "H={}",
    "global_avg_interval": "exact average every {} steps",
    "gossip_every": "gossip every {}", "num_fragments": "P={}",
    "overlap_steps": "tau={}", "merge_alpha": "alpha={}",
    "outer_optimizer.lr": "Nesterov lr {}", "outer_overlap": "{} outer step",
    "sync_every_u": "K_u={}", "sync_every_v": "K_v={}",
    "compression.format": "{} messages",
    "compression.error_feedback": {True: "error feedback",
                                   False: "no error feedback"},
    "optimizer.beta_convention": {"per_step": "horizon-matched betas",
                                  "per_window": "per-window betas (paper)"},
}


@dataclasses.dataclass(frozen=True)
class Run:
  """One arm of the comparison: a method and the settings it runs with.

  What the method reads, whether it gossips and its display name come
  from its home (:data:`decentral_jax.runner.methods.ALGORITHMS`); a Run
  holds only the values it sets.
  """
  name: str  # subdirectory and --methods name
  algorithm: str
  optimizer: str
  topology: str
  workers_per_node: int = 1
  # Further config fields of the method: ((dotted field, value), ...).
  fields: tuple[tuple[str, object], ...] = ()
  # The seed of a job of several seeds (named in the label), else None.
  seed: int | None = None

  @property
  def label(self) -> str:
    """The legend / table label: the method's display name
    (``methods.display_name``, as ``predict`` prints it), then the run's
    own settings, e.g. ``"DiLoCo, H=10, Nesterov lr 0.3"``,
    ``"AccumAdamW (AER), 2 workers/node, horizon-matched betas"``."""
    config = types.SimpleNamespace(
        algorithm=self.algorithm, topology=self.topology,
        optimizer=types.SimpleNamespace(name=self.optimizer))
    parts = [methods.display_name(config)]
    own = (("workers_per_node", self.workers_per_node),) * (
        self.workers_per_node != 1)
    for field, value in (*own, *self.fields):
      if value == "":  # a field reset to its default (e.g. comm_dtype)
        continue
      form = _DETAILS.get(field, field + "={}")
      parts.append(form[value] if isinstance(form, dict)
                   else form.format(value))
    if self.seed is not None:
      parts.append(f"seed {self.seed}")
    return ", ".join(parts)


_H = 10  # sync period of the local-update arms
# Outer Nesterov lr of the DiLoCo arms (momentum 0.9), the best of {0.1,
# 0.3, 0.7} for DiLoCo at H = 10 (BENCHMARKS.md, section 6); the paper's
# 0.7 is for H = 500.
_OUTER_LR = 0.3
_SYNC = (("sync_every", _H), ("outer_optimizer.lr", _OUTER_LR))
RUNS = (
    Run("all_reduce", "all_reduce", "adamw", "complete"),
    Run("dadam", "decentralized", "adamw", "one_peer_exp"),
    Run("accum_adamw", "decentralized", "accum_adamw", "one_peer_exp",
        fields=(("optimizer.beta_convention", "per_step"),)),
    Run("accum_adamw_paper", "decentralized", "accum_adamw", "one_peer_exp",
        fields=(("optimizer.beta_convention", "per_window"),)),
    Run("accum_adamw_aer", "decentralized", "accum_adamw",
        "alternating_exp_ring", 2,
        fields=(("optimizer.beta_convention", "per_step"),)),
    Run("local_sgd", "local_sgd", "adamw", "complete",
        fields=(("sync_every", _H),)),
    Run("diloco", "diloco", "adamw", "complete", fields=_SYNC),
    Run("streaming_diloco", "streaming_diloco", "adamw", "complete",
        fields=(("sync_every", _H), ("num_fragments", 2),
                ("overlap_steps", 1), ("merge_alpha", 0.5),
                ("outer_optimizer.lr", _OUTER_LR))),
    Run("decentralized_diloco", "decentralized_diloco", "adamw",
        "one_peer_exp", fields=_SYNC),
    Run("diloco_delayed", "diloco", "adamw", "complete",
        fields=(*_SYNC, ("outer_overlap", "delayed"))),
    Run("diloco_eager", "diloco", "adamw", "complete",
        fields=(*_SYNC, ("outer_overlap", "eager"))),
    Run("local_dadam", "decentralized", "adamw", "one_peer_exp",
        fields=(("gossip_every", 5),)),
    Run("sgp", "sgp", "adamw", "one_peer_exp"),
    # Then the arms the other method homes declare (Method.arms).
    *(Run(arm.name, method.name, arm.optimizer, arm.topology,
          arm.workers_per_node, fields=tuple(arm.fields))
      for method in methods.ALGORITHMS.values() for arm in method.arms),
)
METHODS = {run.name: run for run in RUNS}
# Peak learning rates per method for gpt_tiny (8 workers, 300 steps), each
# chosen by the tuning protocol (decentral_jax.runner.tuning: the grid {1.5e-3,
# 3e-3, 6e-3, 1.2e-2}, extended past an end that wins; seed 0) in this very
# setting: BENCHMARKS.md, section 10. accum_adamw_aer, streaming_diloco,
# decentralized_diloco and sgp were not re-tuned: the first uses
# accum_adamw's lr, the others their best of the earlier grid {1.5e-3,
# 3e-3, 6e-3} (section 6); diloco_delayed and diloco_eager were tuned by
# the same protocol in section 12. The final lr is peak / 10.
# --per_method_lr=false uses the config's lr.
TUNED_PEAK_LR = {"all_reduce": 6e-3, "dadam": 6e-3, "accum_adamw": 3e-3,
                 "accum_adamw_paper": 1.5e-3, "accum_adamw_aer": 3e-3,
                 "local_sgd": 3e-3, "diloco": 3e-3, "streaming_diloco": 3e-3,
                 "decentralized_diloco": 3e-3, "local_dadam": 3e-3,
                 "sgp": 6e-3, "diloco_delayed": 1.5e-3, "diloco_eager": 3e-3,
                 **{arm.name: arm.peak_lr
                    for method in methods.ALGORITHMS.values()
                    for arm in method.arms if arm.peak_lr is not None}}


def select_runs(spec: str) -> tuple[Run, ...]:
  """The runs named by ``--methods`` (comma-separated, or ``all``).

  Raises:
    ValueError: an unknown, repeated or empty name, ``all`` with other
      names, or no name; one line naming ``--methods``.
  """
  spec = str(spec)
  names = [x.strip() for x in spec.split(",")]
  listed = f"'all' or a comma-separated list of {', '.join(METHODS)}"
  if spec.startswith("-"):  # `--methods --outdir=x` takes the next flag
    raise ValueError(f"--methods needs a value, got the flag {spec!r}; give "
                     f"{listed}, e.g. --methods=dadam,sgp.")
  if not any(names):
    raise ValueError(f"--methods={spec!r} names no method; pass {listed}.")
  if "" in names:
    raise ValueError(f"--methods={spec!r}: entry {names.index('') + 1} is "
                     "empty; separate the names by single commas, e.g. "
                     "--methods=dadam,sgp.")
  if names == ["all"]:
    return RUNS
  if "all" in names:
    raise ValueError(f"--methods={spec!r}: 'all' selects every method and "
                     "takes no other names; pass --methods=all or only "
                     "method names.")
  unknown = [x for x in names if x not in METHODS]
  if unknown:
    raise ValueError(f"--methods={spec!r}: unknown method(s) "
                     f"{', '.join(map(repr, unknown))}; use {listed}.")
  repeated = sorted({x for x in names if names.count(x) > 1})
  if repeated:
    raise ValueError(f"--methods={spec!r} names {', '.join(repeated)} more "
                     "than once; list each method once.")
  return tuple(METHODS[x] for x in names)


def run_fields(run: Run, accum_steps: int) -> tuple[tuple[str, object], ...]:
  """``((dotted config field, value), ...)`` that ``run`` sets itself."""
  return (("algorithm", run.algorithm), ("topology", run.topology),
          ("workers_per_node", run.workers_per_node),
          ("optimizer.name", run.optimizer),
          ("optimizer.accum_steps",
           accum_steps if run.optimizer == "accum_adamw" else 1),
          *run.fields)


def unread_fields(run: Run) -> tuple[str, ...]:
  """The method fields (``methods.method_fields()``) ``run``'s algorithm
  does not read; its config keeps their defaults."""
  read = methods.ALGORITHMS[run.algorithm].fields
  return tuple(f for f in methods.method_fields() if f not in read)


def _set(config, field: str, value) -> None:
  *groups, last = field.split(".")
  node = config
  for g in groups:
    if g not in node:  # a group a method home declares (noloco.alpha)
      node[g] = config_dict.ConfigDict()
    node = node[g]
  node[last] = value


def run_config(base, run: Run, accum_steps: int, per_method_lr: bool = False):
  """A copy of ``base`` set up for ``run``.

  The method fields its algorithm does not read are set to their
  ``base_config`` defaults (``check_config`` refuses any other value), so
  an override that only some methods read applies to those.
  """
  config = base.copy_and_resolve_references()
  model = base.get("model", {}).get("name")
  defaults = config_lib.base_config(
      model if model in config_lib.DATA_SOURCES else "gpt")
  with config.unlocked():
    lr = TUNED_PEAK_LR.get(run.name) if per_method_lr else None
    if lr is not None:  # an arm without a tuned lr keeps the config's
      config.schedule.peak_lr = lr
      if config.schedule.get("name", "warmup_cosine") == "warmup_cosine":
        config.schedule.final_lr = lr / 10
    for field, value in run_fields(run, accum_steps):
      _set(config, field, value)
    for field in unread_fields(run):
      value = defaults
      for part in field.split("."):
        value = value[part]
      _set(config, field, value)
  return config


def arm_configs(base, accum_steps: int, per_method_lr: bool,
                runs: tuple[Run, ...] = RUNS[:4]):
  """``[(run, config)]`` of every arm, each checked before any run starts.

  Raises:
    ValueError: an arm's config is invalid or its topology does not fit
      ``n_workers`` / ``workers_per_node``; the message names the arm.
  """
  arms = []
  for run in runs:
    config = run_config(base, run, accum_steps, per_method_lr)
    try:
      validation.check_config(config)
      if methods.ALGORITHMS[config.algorithm].uses_topology:
        n, local = int(config.n_workers), int(config.workers_per_node)
        try:
          topology_lib.make(config.topology, n, local)
        except ValueError as e:  # topology and nodes are the method's own
          why = str(e).rstrip(".")
          raise ValueError(f"its topology {config.topology} with {local} "
                           f"worker(s) per node does not fit --config."
                           f"n_workers={n}: {why}; choose another "
                           "--config.n_workers or leave this method out of "
                           "--methods.") from None
    except ValueError as e:
      raise ValueError(f"run {run.name!r} ({run.label}): {e}") from None
    arms.append((run, config))
  return arms


def overridden_fields(overrides: list[str], runs) -> list[str]:
  """One line per ``--config.<field>`` override that a run sets itself, and
  one per override of a method field that some runs' algorithms do not
  read (those runs keep its default)."""
  out = []
  for arg in overrides:
    field = arg[len("--config."):].split("=", 1)[0]
    # accum_adamw arms take optimizer.accum_steps from the config.
    mine = [r.name for r in runs if field in dict(run_fields(r, 1))
            and not (field == "optimizer.accum_steps" and
                     r.optimizer == "accum_adamw" and
                     field not in dict(r.fields))]
    if mine:
      out.append(f"{arg} is ignored by {', '.join(mine)}: each method sets "
                 f"config.{field} itself (see RUNS in "
                 "decentral_jax/tools/compare/runs.py); run "
                 "experiments/train.py for other values.")
    unread = [r.name for r in runs if r.name not in mine
              and field in unread_fields(r)]
    if unread:
      out.append(f"{arg} is not read by the algorithm of "
                 f"{', '.join(unread)}: those runs keep its default.")
  return out


@dataclasses.dataclass(frozen=True)
class Arm:
  """One training run of the job: a method at a seed.

  Attributes:
    method: the method (:class:`Run`; its ``name`` keys the tables).
    seed: ``config.seed``.
    run: ``method`` renamed for this seed (``<name>_seed<k>``, label ``...,
      seed k``) when the job has several seeds, else ``method``; its
      ``name`` is the run's subdirectory.
    config: the run's config.
  """

  method: Run
  seed: int
  run: Run
  config: object


def parse_seeds(spec: str) -> tuple[int, ...]:
  """``--seeds``: comma-separated distinct integers in [0, 2**32 - 1].

  An empty (or blank) ``spec`` gives ``()``: the config's own seed.

  Raises:
    ValueError: a bad, empty or repeated entry (names the flag).
  """
  out = []
  for x in checks.comma_entries("--seeds", spec, "seeds", "--seeds=0,1,2"):
    if flag_types.ascii_int(x) is None or int(x) > config_lib.SEED_MAX:
      raise ValueError(f"--seeds={spec!r}: {x!r} is not a seed; give "
                       "comma-separated integers in [0, "
                       f"{config_lib.SEED_MAX}], e.g. --seeds=0,1,2.")
    if int(x) in out:
      raise ValueError(f"--seeds={spec!r} names {x} more than once; list "
                       "each seed once.")
    out.append(int(x))
  return tuple(out)


def job_arms(arms, seeds: tuple[int, ...], checkpoints: bool) -> list[Arm]:
  """Every (method, seed) run of the job, method by method.

  ``arms``: :func:`arm_configs`' ``[(run, config)]``; ``seeds``: empty for
  the config's own seed. Without ``checkpoints`` the configs write no
  periodic checkpoints (``checkpoint_interval = 0``).
  """
  out = []
  for run, config in arms:
    for seed in seeds or (int(config.seed),):
      c = config.copy_and_resolve_references()
      with c.unlocked():
        c.seed = seed
        if not checkpoints:
          c.checkpoint_interval = 0
      named = run if len(seeds) <= 1 else dataclasses.replace(
          run, name=f"{run.name}_seed{seed}", seed=seed)
      out.append(Arm(run, seed, named, c))
  return out
