"""Bad input: every config field, data file and command line is refused in one line.

Field rules are checked on configs built in memory (fast); values at the
edges of the rules are accepted and then followed to where the run uses them
(the schedule, the optimizer on 8 devices, the data order, an 11-step run)
and compared with references written from the documentation; the command lines
of experiments/train.py and experiments/compare.py run as subprocesses, all
at once, and stop before JAX starts; the runtime model's CLI is called in
process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax
import pytest
from ml_collections import config_dict

from conftest import FIXTURES, require_devices
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.data import text
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import devices
from decentral_jax.runner import tasks
from decentral_jax.runner import train
from decentral_jax.runner import validation
from decentral_jax.tools import compare
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.runtime_model_cli import main as runtime_cli
from helpers import np_accum_adam

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAN, INF = math.nan, math.inf
BIG = 2**31  # one past the largest integer field value


def make_config(model: str = "gpt", **fields):
  """``base_config(model)`` with dotted fields replaced (types not enforced)."""
  d = config_lib.base_config(model).to_dict()
  for name, value in fields.items():
    node = d
    *groups, leaf = name.split(".")
    for g in groups:
      node = node[g]
    node[leaf] = value
  return config_dict.ConfigDict(d)


def one_line_error(fn, *args) -> str:
  with pytest.raises(ValueError) as info:
    fn(*args)
  message = str(info.value)
  assert "\n" not in message, message
  return message


# (field, bad value, model); the message must name the field and the
# override that fixes it.
BAD_FIELDS = [
    ("schedule.final_lr", -1.0, "gpt"), ("schedule.final_lr", NAN, "gpt"),
    ("schedule.peak_lr", -1e-3, "gpt"),
    ("schedule.peak_lr", INF, "gpt"), ("schedule.peak_lr", NAN, "gpt"),
    ("schedule.warmup_steps", -1, "gpt"), ("schedule.warmup_steps", BIG, "gpt"),
    # Upper bounds: a learning rate or decay above 1e3 (as the learners'
    # --inner-lr), an Adam eps above 1, only diverge.
    ("schedule.peak_lr", 1e30, "gpt"), ("schedule.peak_lr", 1000.5, "gpt"),
    ("schedule.final_lr", 2e3, "gpt"), ("optimizer.weight_decay", 1e30, "gpt"),
    ("optimizer.eps", 1e30, "gpt"), ("optimizer.eps", 2**63, "gpt"),
    ("optimizer.eps", 1.5, "gpt"), ("outer_optimizer.lr", 1e30, "gpt"),
    ("outer_optimizer.lr", 1000.5, "gpt"),
    ("optimizer.eps", NAN, "gpt"), ("optimizer.eps", -1e-8, "gpt"),
    ("optimizer.eps", INF, "gpt"), ("optimizer.weight_decay", -0.1, "gpt"),
    ("optimizer.weight_decay", NAN, "gpt"), ("optimizer.b1", 1.0, "gpt"),
    ("optimizer.b1", -0.1, "gpt"), ("optimizer.b1", NAN, "gpt"),
    ("optimizer.b2", 1.0, "gpt"), ("optimizer.b2", "0.9", "gpt"),
    ("optimizer.accum_steps", 0, "gpt"),
    ("optimizer.beta_convention", "per_epoch", "gpt"),
    ("grad_clip", -1.0, "gpt"),
    ("grad_clip", NAN, "gpt"), ("grad_clip", INF, "gpt"),
    ("grad_clip", True, "gpt"),
    ("steps", BIG, "gpt"), ("steps", 0, "gpt"), ("steps", True, "gpt"),
    ("steps", 1.5, "gpt"), ("seed", 2**32, "gpt"), ("seed", -1, "gpt"),
    ("n_workers", 0, "gpt"), ("n_workers", BIG, "gpt"),
    ("workers_per_node", 0, "gpt"), ("global_batch", BIG, "gpt"),
    ("global_avg_interval", -1, "gpt"), ("eval_interval", -1, "gpt"),
    ("eval_batches", 0, "gpt"), ("log_interval", 0, "gpt"),
    ("checkpoint_interval", BIG, "gpt"), ("keep_checkpoints", 0, "gpt"),
    ("tensorboard", 1, "gpt"), ("workdir", 3, "gpt"), ("data.path", 3, "gpt"),
    ("comm_dtype", "int8", "gpt"), ("gossip_rounds", "dynamic", "gpt"),
    ("bucket_bytes", -1, "gpt"), ("bucket_bytes", 1.5, "gpt"),
    ("bucket_bytes", True, "gpt"), ("bucket_bytes", BIG, "gpt"),
    ("topology", 3, "gpt"), ("data.val_fraction", 1.0, "gpt"),
    ("data.val_fraction", -0.1, "gpt"),
    ("model.dropout", 1.0, "gpt"), ("model.dropout", -0.1, "gpt"),
    ("model.n_layer", 0, "gpt"), ("model.n_embd", 0, "gpt"),
    # Beyond any model trained: 100000 layers compiled for minutes.
    ("model.n_layer", 100000, "gpt"), ("model.n_embd", 2**30, "gpt"),
    ("model.n_head", 2**17, "gpt"), ("model.vocab_size", 2**25, "gpt"),
    ("model.block_size", 2**31 - 1, "gpt"),
    ("model.block_size", 0, "gpt"),
    ("model.vocab_size", BIG, "gpt"), ("model.bias", 1, "gpt"),
    ("model.dtype", "float16", "gpt"),
    ("model.features", (), "cnn"), ("model.features", (32, 0), "cnn"),
    ("model.features", (8,) * 5, "cnn"), ("model.features", (8.0,), "cnn"),
    ("model.dense", 0, "cnn"), ("model.num_classes", 1, "cnn"),
]


def test_the_upper_bounds_are_inclusive():
  """peak_lr and weight_decay of exactly 1e3, eps of exactly 1, pass."""
  validation.check_config(make_config(**{
      "schedule.peak_lr": 1e3, "schedule.final_lr": 0.0,
      "optimizer.weight_decay": 1e3, "optimizer.eps": 1.0}))


def test_a_non_finite_loss_names_the_fields_at_fault_with_their_values():
  from decentral_jax.runner import recorder  # pylint: disable=g-import-not-at-top

  class NoCheckpoint:
    directory = "ckpt"

    def last_good_step(self):
      return None, False

  metrics = {"loss": np.array([2.0, np.nan]), "finite": np.array([True, False])}
  off = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 0.0})
  on = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 2.5})
  text = str(recorder.non_finite_error(2, metrics, NoCheckpoint(), off))
  assert "worker(s) [1]" in text, text
  assert text.endswith("Lower config.schedule.peak_lr (now 0.5) or enable "
                       "config.grad_clip (now 0: off)."), text
  text = str(recorder.non_finite_error(2, metrics, NoCheckpoint(), on))
  assert text.endswith("Lower config.schedule.peak_lr (now 0.5) or lower "
                       "config.grad_clip (now 2.5)."), text
  # A method with an outer optimizer: its learning rate too (1e30 passed
  # validation and the message named only the inner one).
  outer = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 2.5,
                         "algorithm": "diloco", "outer_optimizer.lr": 0.7})
  text = str(recorder.non_finite_error(2, metrics, NoCheckpoint(), outer))
  assert text.endswith("Lower config.schedule.peak_lr (now 0.5), "
                       "config.outer_optimizer.lr (now 0.7), or lower "
                       "config.grad_clip (now 2.5)."), text
  # MuLoCo: Muon's factors of the inner learning rates too.
  muloco = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 2.5,
                          "algorithm": "muloco", "outer_optimizer.lr": 0.7,
                          "muon.consistent_rms": 0.25,
                          "muon.adam_lr_ratio": 3.0})
  text = str(recorder.non_finite_error(2, metrics, NoCheckpoint(), muloco))
  assert text.endswith("Lower config.schedule.peak_lr (now 0.5), "
                       "config.muon.consistent_rms (now 0.25), "
                       "config.muon.adam_lr_ratio (now 3), "
                       "config.outer_optimizer.lr (now 0.7), or lower "
                       "config.grad_clip (now 2.5)."), text


def test_a_non_finite_loss_before_any_update_blames_the_init_or_data():
  """Step 0's evaluation and step 1's training loss are taken at the
  initial parameters: the learning rate cannot be at fault there (the
  message named it); later losses, and step 1's parameters after its
  update, still name it."""
  from decentral_jax.runner import recorder  # pylint: disable=g-import-not-at-top

  class NoCheckpoint:
    directory = "ckpt"

    def last_good_step(self):
      return None, False

  c = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 2.5})
  initial = ("No parameter update had been applied yet (the loss is taken "
             "at the initial parameters), so the learning rate and the "
             "gradient clip play no part: the model's init overflows or "
             "gives NaN/inf parameters, or the data holds NaN/inf (or values "
             "that overflow the loss); check them.")
  lr = "Lower config.schedule.peak_lr (now 0.5) or lower config.grad_clip"
  nan_loss = {"loss": np.array([2.0, np.nan]),
              "finite": np.array([True, False])}
  bad_params = {"loss": np.array([2.0, 2.0]),
                "finite": np.array([True, False])}
  ck = NoCheckpoint()
  assert str(recorder.non_finite_error(1, nan_loss, ck, c)).endswith(initial)
  assert lr in str(recorder.non_finite_error(1, bad_params, ck, c))
  assert lr in str(recorder.non_finite_error(2, nan_loss, ck, c))
  record = recorder.non_finite_record_error
  assert str(record(0, {"eval/loss": np.nan}, ck, c)).endswith(initial)
  assert str(record(1, {"train/loss": np.inf}, ck, c)).endswith(initial)
  assert lr in str(record(1, {"eval/loss": np.nan}, ck, c))
  assert lr in str(record(3, {"train/loss": np.nan}, ck, c))


def test_non_finite_parameters_at_a_resumes_first_step_name_the_checkpoint():
  """A resumed invocation's first step, with a finite loss but non-finite
  parameters (a damaged optimizer state restored from a checkpoint without
  SHA256SUMS): the message names that checkpoint first, as unverified, and
  the learning rate only as the alternative; a later step names the
  learning rate alone."""
  from decentral_jax.runner import recorder  # pylint: disable=g-import-not-at-top

  class Unverified:
    directory = "ckpt"

    def last_good_step(self):
      return 6, False

    def verify(self, step):
      return "unverified", "no checksums"

    def step_dir(self, step):
      return f"ckpt/{step}"

  c = make_config(**{"schedule.peak_lr": 0.5, "grad_clip": 2.5})
  bad_params = {"loss": np.array([2.0, 2.0]),
                "finite": np.array([True, False])}
  text = str(recorder.non_finite_error(7, bad_params, Unverified(), c,
                                       resumed_at=6))
  where = text.index("restored unverified (it has no SHA256SUMS) from "
                     "checkpoint 6 (ckpt/6)")
  assert "optimizer state) are likely damaged" in text, text
  assert text.endswith("If that checkpoint is intact: lower "
                       "config.schedule.peak_lr (now 0.5) or lower "
                       "config.grad_clip (now 2.5)."), text
  assert where < text.index("peak_lr"), text
  later = str(recorder.non_finite_error(8, bad_params, Unverified(), c,
                                        resumed_at=6))
  assert "restored" not in later and later.endswith(
      "Lower config.schedule.peak_lr (now 0.5) or lower config.grad_clip "
      "(now 2.5)."), later


@pytest.mark.parametrize("field, value, model", BAD_FIELDS)
def test_bad_field_is_one_line_naming_it(field, value, model):
  message = one_line_error(validation.check_config,
                           make_config(model, **{field: value}))
  assert (f"config.{field} must be" in message or
          f"unknown config.{field}=" in message), message  # its own rule
  assert f"--config.{field}=" in message, message  # says what to set


def test_an_empty_string_choice_is_shown_as_unset():
  """The empty choice (unset) printed as nothing: 'use one of , bfloat16'."""
  message = one_line_error(validation.check_config,
                           make_config("gpt", comm_dtype="float64"))
  assert message == ("unknown config.comm_dtype='float64'; use one of '' "
                     "(unset), bfloat16, float16, float32 "
                     "(--config.comm_dtype=...)."), message


# Fields valid on their own but not together: (fields, phrases).
BAD_RELATIONS = [
    ({"schedule.final_lr": 1.0}, ("config.schedule.final_lr=1.0 exceeds",
                                  "--config.schedule.final_lr=")),
    ({"schedule.name": "constant", "schedule.peak_lr": 0.0},
     ("config.schedule.peak_lr must be",)),  # no final_lr relation here
    ({"model.n_head": 3}, ("config.model.n_head=3 must divide",
                           "--config.model.n_head=")),
    ({"workers_per_node": 3}, ("config.workers_per_node=3 must divide",
                               "--config.workers_per_node=")),
    ({"global_batch": 60}, ("config.global_batch=60 is not divisible",
                            "--config.global_batch=56")),
    ({"optimizer.name": "adamw"}, ("config.optimizer.accum_steps=4 only",
                                   "--config.optimizer.accum_steps=1")),
    ({"data.val_fraction": 0.0}, ("config.data.val_fraction=0.0 leaves no",
                                  "--config.data.val_fraction=")),
    # Settings the schedule does not read (make_schedule: constant is
    # peak_lr at every step, inverse_sqrt has no final value).
    ({"schedule.name": "constant", "schedule.final_lr": 1e-4},
     ("config.schedule.final_lr=0.0001 has no effect with "
      "config.schedule.name='constant'",
      "--config.schedule.final_lr=0.00015")),
    ({"schedule.name": "inverse_sqrt", "schedule.final_lr": 0.0},
     ("config.schedule.final_lr=0.0 has no effect with "
      "config.schedule.name='inverse_sqrt'",)),
    ({"schedule.name": "constant", "schedule.warmup_steps": 5},
     ("config.schedule.warmup_steps=5 has no effect with "
      "config.schedule.name='constant'",
      "--config.schedule.warmup_steps=30")),
    # A file given without the source that reads it: the bundled text
    # would be trained on instead.
    ({"data.path": "/my/corpus.txt"},
     ("config.data.path='/my/corpus.txt' has no effect with "
      "config.data.source='pydoc'", "--config.data.source=text_file")),
]


@pytest.mark.parametrize("fields, phrases", BAD_RELATIONS)
def test_bad_combination_is_one_line_naming_the_fields(fields, phrases):
  message = one_line_error(validation.check_config, make_config(**fields))
  for phrase in phrases:
    assert phrase in message, message


def test_the_evaluation_set_is_bounded_before_any_data_is_read():
  """64 sequences x (64 + 1) tokens = 4160 a batch: 2**28 // 4160 = 64527
  batches (268432320 tokens) fit, one more (268436480) does not; the
  refusal comes before the data (here a missing file) is read."""
  fields = {"data.source": "token_bins", "data.path": "/nonexistent/dir"}
  for n in (64528, 2**31 - 1):
    message = one_line_error(tasks.lm_task,
                             make_config(eval_batches=n, **fields), 8, 8)
    assert f"config.eval_batches={n} gives an evaluation set of " \
        f"{n * 4160} tokens" in message, message
    assert "--config.eval_batches=64527 or fewer" in message, message
  tasks.check_eval_size(make_config(eval_batches=64527))
  # One batch of 2**20 windows of 2**20 + 1 tokens is over the bound by
  # itself: the line named eval_batches=1, the value already set.
  message = one_line_error(tasks.check_eval_size, make_config(
      eval_batches=1, global_batch=2**20, **{"model.block_size": 2**20}))
  assert message.endswith("one batch is already too many: lower "
                          "--config.global_batch or --config.model.block_size"
                          "."), message


# --- Values at the edges of the rules are accepted, and used as given. ------
# Each probe checks what the run makes of the value against a reference
# written from the documentation (schedule formula, AccumAdam recursion,
# data-order rule), not from the code.


def lr_reference(c, k: int) -> float:
  """The learning rate at count ``k``, as ``make_schedule`` documents it."""
  s = c.schedule
  peak, w = float(s.peak_lr), int(s.warmup_steps)
  if s.name == "constant":
    return peak
  if k < w:  # linear from peak / w to peak
    return peak / w + (peak - peak / w) * k / w
  cos = math.cos(math.pi * (k - w) / (int(c.steps) - w))
  return float(s.final_lr) + (peak - float(s.final_lr)) * (1 + cos) / 2


def schedule_at(*counts):
  """Probe: the run's learning rate at ``counts`` is the documented one."""
  def probe(c):
    lr = builders.make_schedule(c)
    for k in counts:
      # abs: float32 rounding of lr's formula at the scale of peak_lr.
      assert float(lr(k)) == pytest.approx(
          lr_reference(c, k), rel=1e-5, abs=1e-6 * float(c.schedule.peak_lr)), k
  return probe


OPT_STEPS = 6  # one and a half AccumAdam windows of the base config (T = 4)


def opt_problem():
  """Parameters and OPT_STEPS gradients of one worker (float64).

  A matrix (weight-decayed) and a vector with gradients of 1e-7 (where eps
  matters); signs flip at steps 2 and 4 (the moments matter after the first
  window); step 0's gradient has global norm about 50 (clipped by the
  default grad_clip=1, which rescales it against the other steps).
  """
  rng = np.random.default_rng(0)
  params = {"b": rng.normal(size=3), "w": rng.normal(size=(2, 3))}
  grads = []
  for k in range(OPT_STEPS):
    sign = -1.0 if k in (2, 4) else 1.0
    g = {"b": sign * rng.uniform(0.5, 1.5, 3) * np.array([1.0, 1e-7, -1e-7]),
         "w": sign * rng.uniform(0.5, 1.5, (2, 3))}
    grads.append({k_: 20 * v for k_, v in g.items()} if k == 0 else g)
  return params, grads


def dadam_reference(c, params, grads) -> list[dict]:
  """One worker's updates when every worker holds the same parameters and
  gradients: then ``W x = x`` and DAdam / AccumAdamW (``decentralized``) is
  ``x <- (1 - lr_k wd mask) x - lr_k d_k``, ``d_k`` the AccumAdam direction
  of the clipped gradient (global norm at most ``grad_clip``; 0: none),
  ``mask`` the leaves with ``ndim >= 2``."""
  o, clip = c.optimizer, float(c.grad_clip)
  assert c.algorithm == "decentralized" and o.beta_convention == "per_window"
  scale = [min(1.0, clip / np.sqrt(sum(np.sum(v**2) for v in g.values())))
           if clip else 1.0 for g in grads]
  dirs = {k: np_accum_adam([f * g[k] for f, g in zip(scale, grads)],
                           float(o.b1), float(o.b2), float(o.eps),
                           int(o.accum_steps)) for k in params}
  x, out = dict(params), []
  for t in range(len(grads)):
    lr = lr_reference(c, t)
    u = {k: -lr * (float(o.weight_decay) * x[k] * (x[k].ndim >= 2)
                   + dirs[k][t]) for k in x}
    x = {k: x[k] + u[k] for k in x}
    out.append(u)
  return out


def run_optimizer(c, params, grads):
  """The run's optimizer (``make_optimizer``) on ``n_workers`` devices, all
  workers starting from ``params`` with gradients ``grads``.

  Returns:
    (the updates of every step, worker axis first; the compiled step's HLO).
  """
  n = int(c.n_workers)
  require_devices(n)
  mesh = parallel.make_mesh(n)
  tx = builders.make_optimizer(
      c, builders.make_schedule(c),
      topology.make(c.topology, n, int(c.workers_per_node)),
      parallel.worker_axis(mesh))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  def stack(tree):
    return parallel.shard(jax.tree.map(
        lambda v: np.broadcast_to(np.float32(v), (n,) + np.shape(v)), tree),
                          mesh)

  stepf = jax.jit(parallel.per_worker(step, mesh))
  p = stack(params)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  hlo = stepf.lower(p, s, stack(grads[0])).compile().as_text()
  updates = []
  for g in grads:
    p, s, u = stepf(p, s, stack(g))
    updates.append(jax.tree.map(np.asarray, u))
  return updates, hlo


def optimizer_updates(c):
  """Probe: the run's optimizer steps as the reference with these values."""
  params, grads = opt_problem()
  got, hlo = run_optimizer(c, params, grads)
  # An update is the difference of two float32 parameters: a few units in
  # their last place (the values probed move it by 4e-5 or more).
  atol = 4 * float(np.spacing(np.float32(max(np.abs(v).max()
                                               for v in params.values()))))
  for t, (u, want) in enumerate(zip(got, dadam_reference(c, params, grads))):
    for k, w in want.items():
      np.testing.assert_array_equal(u[k], np.broadcast_to(u[k][0], u[k].shape))
      np.testing.assert_allclose(u[k][0], w, rtol=1e-5, atol=atol,
                                 err_msg=f"step {t}, leaf {k}")
  return hlo


def one_collective_per_leaf(c):
  """Probe: bucket_bytes=0 sends each leaf by itself: one_peer_exp over 8
  workers has 3 rounds of one partner each, so each of the 2 leaves is
  permuted once per round (3 branches of the round switch), and nothing is
  concatenated into a bucket."""
  hlo = optimizer_updates(c)
  shapes = [line.split("=", 1)[1].split()[0].split("{")[0]
            for line in hlo.splitlines() if " collective-permute(" in line]
  assert sorted(shapes) == ["f32[2,3]"] * 3 + ["f32[3]"] * 3, shapes


def set_fields(c, **fields):
  """Sets dotted ``fields`` (``model__n_layer`` for ``model.n_layer``)."""
  for name, value in fields.items():
    *groups, leaf = name.split("__")
    node = c
    for g in groups:
      node = node[g]
    node[leaf] = value


# A model small enough to compile in seconds; the probed fields stay as set.
TINY_MODEL = {"model__n_layer": 1, "model__n_embd": 8, "model__n_head": 2,
              "model__block_size": 8}


def no_dropout(c):
  """Probe: rate 0 trains deterministically (a dropout key changes nothing)."""
  assert not tasks.uses_dropout(c)
  set_fields(c, **TINY_MODEL)
  task = tasks.make_task(c, int(c.n_workers), 1)
  params = task.init_params(jax.random.key(0))
  batch = tuple(x[0] for x in task.host_batch(0))
  loss = jax.jit(task.loss)
  assert float(loss(params, batch, jax.random.key(1))[0]) == float(
      loss(params, batch, None)[0])


def data_order_of_seed(c):
  """Probe: the first batch is the one decentral_jax.data.sharding's rule
  gives for this seed: windows of T bytes of the training split, permuted
  by ``default_rng(SeedSequence([seed, epoch]))``, contiguous shards."""
  n = int(c.n_workers)
  b, t = int(c.global_batch) // n, int(c.model.block_size)
  inputs, targets = tasks.make_task(c, n, b).host_batch(0)
  corpus = np.frombuffer(text.pydoc_corpus(), np.uint8)
  train_split = corpus[:len(corpus) - int(len(corpus) * c.data.val_fraction)]
  windows = (len(train_split) - 1) // t
  perm = np.random.default_rng(
      np.random.SeedSequence([int(c.seed), 0])).permutation(windows)
  shard = windows // (n * b) * b
  for w in range(n):
    for i in range(b):
      start = perm[w * shard + i] * t
      np.testing.assert_array_equal(inputs[w, i], train_split[start:start + t])
      np.testing.assert_array_equal(targets[w, i],
                                    train_split[start + 1:start + t + 1])


def logged_steps(c):
  """Probe: an 11-step run logs only its last step (the default interval,
  10, would also log step 10)."""
  set_fields(c, **TINY_MODEL, global_batch=8, eval_batches=1, steps=11,
             eval_interval=0, checkpoint_interval=0, keep_checkpoints=1)
  require_devices(int(c.n_workers))
  with tempfile.TemporaryDirectory() as workdir:
    train.train_and_evaluate(c, workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      assert [json.loads(line)["step"] for line in f] == [11]


def devices_of_a_billion_workers(c):
  """Probe: 2^30 workers of one device each, one sequence per worker."""
  assert devices.devices_needed(c) == (2**30, "config.n_workers=1073741824")
  assert int(c.global_batch) // int(c.n_workers) == 1


GOOD_FIELDS = [
    ({"schedule.final_lr": 0.0}, schedule_at(0, 30, 165, 300)),
    ({"schedule.final_lr": 1.5e-3}, schedule_at(30, 165, 300)),  # = peak_lr
    ({"optimizer.b1": 0.0}, optimizer_updates),
    ({"optimizer.eps": 0.0}, optimizer_updates),
    ({"grad_clip": 0.0}, optimizer_updates),
    ({"optimizer.weight_decay": 0}, optimizer_updates),
    ({"model.dropout": 0.0}, no_dropout),
    ({"seed": 2**32 - 1}, data_order_of_seed),
    ({"steps": BIG - 1}, schedule_at(30, (BIG - 1 + 30) // 2, BIG - 1)),
    ({"log_interval": BIG - 1}, logged_steps),
    ({"bucket_bytes": 0}, one_collective_per_leaf),  # one per leaf
    # > steps: a warning, not an error; the warmup never ends.
    ({"schedule.warmup_steps": 10_000}, schedule_at(0, 150, 300)),
    ({"schedule.name": "constant"}, schedule_at(0, 150, 300)),
    # Node-aware alternating_exp_ring: the only topology that reads nodes.
    ({"n_workers": 2**30, "global_batch": 2**30, "workers_per_node": 2**15,
      "topology": "alternating_exp_ring"}, devices_of_a_billion_workers),
]


@pytest.mark.parametrize("fields, probe", [
    # The probes that compile a model are in the full suite only, and so
    # are the optimizer fields beyond the first (one compiled step each).
    pytest.param(f, p, id=str(f), marks=pytest.mark.slow
                 if "log_interval" in f or "model.dropout" in f
                 or (p is optimizer_updates and "optimizer.b1" not in f)
                 else ())
    for f, p in GOOD_FIELDS])
def test_values_at_the_edges_are_accepted(fields, probe):
  c = make_config(**fields)
  validation.check_config(c)
  assert c.to_dict() == make_config(**fields).to_dict()  # nothing rewritten
  probe(c)


def test_warmup_longer_than_the_run_is_a_warning():
  assert validation.config_warnings(make_config()) == []
  [line] = validation.config_warnings(make_config(
      **{"schedule.warmup_steps": 2000, "steps": 20}))
  assert "config.schedule.warmup_steps=2000" in line and "config.steps=20" in line
  assert validation.config_warnings(make_config(**{
      "schedule.warmup_steps": 2000, "steps": 20,
      "schedule.name": "constant"})) == []


@pytest.mark.parametrize("name, warmup, steps, peak", [
    # warmup_cosine: lr(k) = peak (1/W + (1 - 1/W) k / W) at k = steps - 1.
    ("warmup_cosine", 3, 2, "0.556"), ("warmup_cosine", 30, 6, "0.194"),
    # inverse_sqrt: lr(k) = peak (0.99 (k + 1) / W + 0.01).
    ("inverse_sqrt", 30, 6, "0.208")])
def test_warmup_warning_states_the_largest_lr_of_the_run(name, warmup, steps,
                                                         peak):
  [line] = validation.config_warnings(make_config(**{
      "schedule.name": name, "schedule.warmup_steps": warmup,
      "steps": steps}))
  assert f"peaks at {peak} x peak_lr (step {steps - 1})." in line, line


def test_simulated_device_limit():
  limit = config_lib.MAX_SIMULATED_CPU_DEVICES
  assert devices.check_simulated_devices(limit, "x") == limit
  message = one_line_error(devices.check_simulated_devices, 1048576,
                           "config.n_workers=1048576")
  assert "config.n_workers=1048576" in message and str(limit) in message


def test_train_help_states_the_environment_variables_share_the_limit(
    monkeypatch):
  # train --help once said JAX_NUM_CPU_DEVICES goes beyond the limit; it
  # is refused above it, so the help must not offer it as the way out.
  from decentral_jax.tools import train
  limit = config_lib.MAX_SIMULATED_CPU_DEVICES
  help_text = " ".join(train.__doc__.split())
  assert "go beyond" not in help_text
  assert "the limit of ``JAX_NUM_CPU_DEVICES``" in help_text
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "2048")
  message = one_line_error(devices.environment_cpu_devices)
  assert "JAX_NUM_CPU_DEVICES='2048'" in message and "1024" in message
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", str(limit))
  assert devices.environment_cpu_devices() == 1024


def test_a_cpu_devices_flag_below_the_config_is_named():
  # --cpu_devices=4 with 8 workers: the flag set the limit, so it is named.
  message = one_line_error(devices.check_asked_devices, 4, 4, 8,
                           "--config.n_workers=8")
  assert message == ("--cpu_devices=4 simulates 4 CPU devices in this "
                     "process, but --config.n_workers=8 needs 8; raise "
                     "--cpu_devices to 8 or drop it (0: as many as the "
                     "config needs).")
  devices.check_asked_devices(8, 8, 8, "x")  # enough
  devices.check_asked_devices(16, 16, 8, "x")  # more than enough
  devices.check_asked_devices(0, 4, 8, "x")  # not given: the mesh says it


# -- config files and overrides --------------------------------------------------


@pytest.mark.parametrize("source, expect", [
    (None, "does not exist"),
    ("", "is not a file"),  # a directory
    ("x = (\n", "SyntaxError"),
    ("X = 1\n", "no get_config()"),
    ("def get_config():\n  return 1 / 0\n", "ZeroDivisionError"),
    ("def get_config():\n  return {'a': 1}\n", "not an ml_collections"),
])
def test_broken_config_file_is_named(tmp_path, source, expect):
  path = tmp_path / "cfg.py"
  if source == "":
    path.mkdir()
  elif source is not None:
    path.write_text(source)
  message = one_line_error(config_lib.load_config, str(path))
  assert str(path) in message and expect in message, message


def test_config_variant_and_override_errors():
  owt = os.path.join(ROOT, "configs", "gpt2_small_owt.py")
  message = one_line_error(config_lib.load_config, owt + ":bogus")
  assert "gpt2_small_owt.py:bogus" in message and "bogus" in message
  tiny = os.path.join(ROOT, "configs", "gpt_tiny.py")
  message = one_line_error(config_lib.load_config, tiny, ["steps=abc"])
  assert "--config.steps=abc" in message and "'abc'" in message
  message = one_line_error(config_lib.load_config, tiny, ["optimizer.nope=1"])
  assert "'optimizer.nope'" in message


def test_beta_convention_override_with_adamw_is_refused():
  tiny = os.path.join(ROOT, "configs", "gpt_tiny.py")
  adamw = ["optimizer.name=adamw", "optimizer.accum_steps=1"]
  for value in ("per_step", "per_window"):
    message = one_line_error(config_lib.load_config, tiny,
                             [*adamw, f"optimizer.beta_convention={value}"])
    assert message.startswith(
        f"--config.optimizer.beta_convention={value} has no effect with "
        "config.optimizer.name='adamw'"), message
  # The file's own value (per_step, for its AccumAdamW) is not the user's.
  c = config_lib.load_config(tiny, adamw)
  assert c.optimizer.beta_convention == "per_step"
  validation.check_config(c)
  c = config_lib.load_config(tiny, ["optimizer.beta_convention=per_window"])
  assert c.optimizer.beta_convention == "per_window"  # read by accum_adamw


def test_beta_convention_override_at_one_accumulation_step_is_refused():
  # AccumAdamW at T = accum_steps = 1 is AdamW: b ** T = b, one convention.
  tiny = os.path.join(ROOT, "configs", "gpt_tiny.py")
  one = ["optimizer.name=accum_adamw", "optimizer.accum_steps=1"]
  for value in ("per_step", "per_window"):
    for order in (one + [f"optimizer.beta_convention={value}"],
                  [f"optimizer.beta_convention={value}"] + one[1:]):
      message = one_line_error(config_lib.load_config, tiny, order)
      assert message == (
          f"--config.optimizer.beta_convention={value} has no effect with "
          "config.optimizer.name='accum_adamw' and config.optimizer."
          "accum_steps=1 (one step per window: both conventions are Adam); "
          "drop it, or set --config.optimizer.accum_steps above 1."), message
  # The file's own value stays; T = 2 reads the override.
  validation.check_config(config_lib.load_config(tiny, one))
  c = config_lib.load_config(tiny, ["optimizer.accum_steps=2",
                                    "optimizer.beta_convention=per_window"])
  assert c.optimizer.beta_convention == "per_window"


def test_split_overrides():
  rest, overrides = config_lib.split_overrides([
      "prog", "--config", "c.py", "--config.steps", "3",
      "--config.schedule.final_lr", "-1", "--config.tensorboard",
      "--workdir=w", "--", "--config.x=1"])
  assert rest == ["prog", "--config", "c.py", "--workdir=w", "--",
                  "--config.x=1"]
  assert overrides == ["--config.steps=3", "--config.schedule.final_lr=-1",
                       "--config.tensorboard"]


# -- data --------------------------------------------------------------------------


def _token_config(path, **fields):
  return make_config(**{
      "data.source": "token_bins", "data.path": str(path),
      "model.vocab_size": 50304, "model.block_size": 16, "global_batch": 8,
      "n_workers": 4, "eval_batches": 1, **fields})


def _write_bins(path, train, val):
  path.mkdir(exist_ok=True)
  np.asarray(train, np.uint16).tofile(path / "train.bin")
  np.asarray(val, np.uint16).tofile(path / "val.bin")


def test_token_ids_beyond_the_vocabulary_name_the_file(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  good = rng.integers(0, 50257, 4096)
  _write_bins(tmp_path, good, good[:512])
  task = tasks.make_task(_token_config(tmp_path), 4, 2)  # in range: fine
  assert task.host_batch(0)[0].shape == (4, 2, 16)
  bad = good.copy()
  bad[3000] = 60000
  _write_bins(tmp_path, bad, good[:512])
  message = one_line_error(tasks.make_task, _token_config(tmp_path), 4, 2)
  assert "train.bin" in message and "60000" in message, message
  assert "config.model.vocab_size=50304" in message, message
  _write_bins(tmp_path, good, np.full(512, 50304))
  message = one_line_error(tasks.make_task, _token_config(tmp_path), 4, 2)
  assert "val.bin" in message and "50304" in message, message
  # Files above the scan limit are checked batch by batch instead.
  _write_bins(tmp_path, np.full(4096, 65535), good[:512])
  monkeypatch.setattr(tasks, "SCAN_TOKEN_BYTES", 0)
  task = tasks.make_task(_token_config(tmp_path), 4, 2)
  message = one_line_error(task.host_batch, 5)
  assert "train.bin" in message and "65535" in message, message
  assert "step 5" in message, message


def test_labels_beyond_num_classes():
  config = make_config("cnn", **{
      "data.path": os.path.join(FIXTURES, "fashion_mnist"),
      "model.num_classes": 5, "global_batch": 8, "n_workers": 4,
      "eval_batches": 1})
  message = one_line_error(tasks.make_task, config, 4, 2)
  assert "config.model.num_classes=5" in message and "up to 9" in message


# -- command lines -------------------------------------------------------------------


def _run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
  """Runs the commands concurrently; returns their results by name."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")
         and not k.startswith("SLURM_")}
  env["JAX_PLATFORMS"] = "cpu"
  procs = {name: subprocess.Popen(
      [sys.executable, *argv], cwd=ROOT, env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for name, argv in commands.items()}
  out = {}
  for name, p in procs.items():
    stdout, stderr = p.communicate(timeout=240)
    out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout,
                                            stderr)
  return out


def _assert_one_error_line(proc, *names):
  assert proc.returncode == 2, (proc.args, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, proc.stderr[-3000:]
  for name in names:
    assert name in errors[0], (name, errors[0])


@pytest.mark.integration
def test_command_lines_refuse_bad_input_in_one_line(tmp_path):
  train = ["experiments/train.py", "--config", "configs/gpt_tiny.py",
           "--workdir", str(tmp_path / "w")]
  cmp = ["experiments/compare.py", "--outdir", str(tmp_path / "c")]
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  cases = {
      "final_lr": (train + ["--config.schedule.final_lr=-1.0"],
                   ("config.schedule.final_lr",)),
      "steps": (train + [f"--config.steps={2**31}"], ("config.steps",)),
      "workers": (train + ["--config.n_workers=1048576",
                           "--config.global_batch=1048576"],
                  ("config.n_workers=1048576", "1024")),
      "missing": (["experiments/train.py", "--config", "configs/nope.py",
                   "--workdir", str(tmp_path / "w")], ("configs/nope.py",)),
      "flag": (train + ["--cpu_devices=-1"], ("--cpu_devices",)),
      "cmp_override": (cmp + ["--config.nope=1"], ("'nope'",)),
      "cmp_missing": (cmp + ["--config", "configs/nope.py"],
                      ("configs/nope.py",)),
      "cmp_outdir": (["experiments/compare.py", "--outdir", str(a_file)],
                     (str(a_file), "is a file")),
      "cmp_arm": (cmp + ["--config.n_workers=6", "--config.global_batch=12"],
                  ("'dadam'", "power of two")),
      "cmp_methods": (cmp + ["--methods=diloco,nope"],
                      ("--methods", "'nope'", "diloco")),
  }
  results = _run_all({k: argv for k, (argv, _) in cases.items()})
  for name, (_, expect) in cases.items():
    _assert_one_error_line(results[name], *expect)
  assert not (tmp_path / "w").exists() and not (tmp_path / "c").exists()


def test_compare_names_a_diverged_arm_and_reports_the_others(
    tmp_path, monkeypatch, capsys):
  def fake_train(config, workdir, experiment=None):
    if config.optimizer.name == "adamw" and config.algorithm == "decentralized":
      raise FloatingPointError("non-finite training loss at step 2")
    os.makedirs(workdir, exist_ok=True)  # run_arm holds it (run.lock)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 3, "train_time_s": 1.0,
                          "eval/loss": 2.0}) + "\n")
    return {"eval/loss": 2.0, "eval/worker_excess_mean": 0.0,
            "eval/worker_excess_max": 0.0, "consensus_distance": 0.0}

  monkeypatch.setattr(job_lib.train, "train_and_evaluate", fake_train)
  monkeypatch.setattr(job_lib.experiment, "Experiment", lambda config: None)
  monkeypatch.setattr(job_lib, "sent_per_step", lambda exp: {
      "comm/ratio": 1.0, "comm/bytes_per_step": 1e6})
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # nothing to simulate here
  assert compare.main(
      [f"--outdir={tmp_path}", "--config.steps=3",
       "--methods=all_reduce,dadam,accum_adamw,diloco"]) == 3
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error: ")]
  assert len(errors) == 1 and "1 of 4 runs diverged" in errors[0]
  assert "'dadam'" in errors[0] and "step 2" in errors[0]
  table = (tmp_path / "results.md").read_text()
  assert "| DAdam (Exp) | diverged |" in table
  # The results table (the diverged run's table): the other three at loss 2.
  lines = table.splitlines()
  width = next(l for l in lines if "| diverged |" in l).count("|")
  rows = [l for l in lines if l.startswith("| ") and l.count("|") == width]
  assert sum(l.split("|")[2].strip() == "2.0000" for l in rows) == 3, rows
  assert (tmp_path / "loss_vs_step.png").exists()


def _runtime_cli(argv) -> int:
  try:
    return runtime_cli.main(argv)
  except SystemExit as e:  # argparse's errors
    return e.code


@pytest.mark.parametrize("argv, names", [
    # The 1e15 bound first (1e308 overflowed the bucket count); within it,
    # the buckets of --bucket-MiB.
    (["predict", "--params", "1e30"], ("--params", "1e+15", "got 1e+30")),
    (["predict", "--params", "1e15"], ("--params", "buckets")),
    (["predict", "--n-workers", "1048576"], ("--n-workers 1048576", "4096")),
    (["predict", "--nic-Gbps", "0"], ("--nic-Gbps", "[0.001, 1e+06]",
                                      "got 0.0")),
    (["predict", "--intra-GBps", "nan"], ("--intra-GBps",)),
    (["predict", "--forward-ms", "-1"], ("--forward-ms", "[0, 1e+06]",
                                         "got -1.0")),
    (["predict", "--compute-cv", "inf"], ("--compute-cv",)),
    (["predict", "--grad-dtype", "float33"], ("--grad-dtype", "float33")),
    (["predict", "--param-dtype", "int8"], ("--param-dtype 'int8'",
                                            "floating")),
    (["predict", "--params", "0.5"], ("--params", "whole", "0.5")),
    (["utilisation", "--params", "0.5"], ("--params", "whole", "0.5")),
    (["utilisation", "--n-workers", "1"], ("--n-workers", ">= 2", "got 1")),
    (["utilisation", "--n-workers", "1048576"], ("--n-workers 1048576",
                                                 "256")),
    (["utilisation", "--bucket-MiB", "1e-6"], ("--bucket-MiB", "buckets")),
    (["utilisation", "--bucket-MiB", "0"],
     ("--bucket-MiB", "[9.53674e-07, 1e+09]")),
    (["utilisation", "--grad-dtype", "int8"], ("--grad-dtype 'int8'",
                                               "floating")),
    (["predict", "--steps", "1000000"], ("--steps",)),
    # Messages name the flag typed and its value in the flag's units, not
    # the model's field (gossip_in_flight, forward_s, inter_latency_s, ...)
    # or the value converted to seconds or bytes.
    (["predict", "--gossip-in-flight", "2.5"], ("--gossip-in-flight '2.5'",
                                               "[0, 1]")),
    (["predict", "--gossip-in-flight", "0.2,nan"], ("--gossip-in-flight "
                                                   "'0.2,nan'",)),
    (["utilisation", "--step-ms", "nan"], ("--step-ms", "got nan")),
    (["utilisation", "--step-ms", "0"], ("--step-ms", "(0, 1e+06]")),
    (["utilisation", "--latency-ms", "-1"], ("--latency-ms", "got -1.0")),
    (["utilisation", "--codec-GBps", "0"], ("--codec-GBps", "got 0.0")),
    (["utilisation", "--H", "0"], ("--H must be an integer in [1, 100000]",
                                   "got 0")),
    (["utilisation", "--params", "1e16", "--bucket-MiB", "1e9"],
     ("--params", "1e+15", "1e+16")),
    # Values beyond physical bounds: the model would print nan or
    # 300-digit times (and a recommendation) with exit status 0.
    (["predict", "--forward-ms", "1e300"], ("--forward-ms", "[0, 1e+06]",
                                            "got 1e+300")),
    (["predict", "--nic-Gbps", "1e-300"], ("--nic-Gbps", "got 1e-300")),
    (["predict", "--preset", "cross_region_2dc", "--wan-latency-ms",
      "1e300"], ("--wan-latency-ms", "got 1e+300")),
    (["predict", "--intra-latency-us", "1e300"], ("--intra-latency-us",
                                                  "[0, 1e+09]")),
    (["predict", "--compute-cv", "1e300"], ("--compute-cv", "[0, 10]")),
    (["predict", "--compute-samples-ms", "1e300,1"], ("--compute-samples-ms",
                                                      "(0, 1e+06]")),
    (["predict", "--flow-Gbps", "1e-300"], ("--flow-Gbps", "0 (no cap)",
                                            "got 1e-300")),
    (["predict", "--nic-efficiency", "1e-300"], ("--nic-efficiency",
                                                 "[0.01, 1]")),
    (["predict", "--slow-fraction", "0.5", "--slow-speed", "1e-300"],
     ("--slow-speed", "[0.001, 1]")),
    (["predict", "--failure-rate", "0.1", "--mean-downtime", "1e300"],
     ("--mean-downtime", "[1, 1e+06]")),
    (["predict", "--params", "1e16", "--bucket-MiB", "1e9"],
     ("--params", "1e+15", "got 1e+16")),
    (["predict", "--bucket-MiB", "1e300"],
     ("--bucket-MiB", "[9.53674e-07, 1e+09]")),
    # Empty entries of a comma-separated list are refused, not dropped.
    (["predict", "--n-workers", "16,,"], ("--n-workers", "'16,,'",
                                          "entry 2 is empty")),
    (["predict", "--compute-samples-ms", "80,,90"], ("--compute-samples-ms",
                                                     "entry 2 is empty")),
    (["predict", "--methods", "all_reduce,,aer"], ("--methods",
                                                  "entry 2 is empty")),
    (["predict", "--n-workers", "6", "--preset", "A40"], ("--n-workers 6",)),
    (["predict", "--methods", "hypercube"], ("--methods hypercube",)),
    (["predict", "--n-workers", "x"], ("--n-workers",)),
    (["predict", "--png", "/nonexistent_dir/x.png"],
     ("--png", "/nonexistent_dir")),
    (["fig6", "--png", "/nonexistent_dir/f.png"], ("--png", "/nonexistent_dir")),
    (["calibrate", "--config", "configs/nope.py"], ("configs/nope.py",)),
    (["calibrate", "--config", "configs/gpt_tiny.py", "--set",
      "schedule.final_lr=-1"], ("config.schedule.final_lr",)),
    (["calibrate", "--config", "configs/gpt_tiny.py", "--set",
      "n_workers=4096", "--set", "global_batch=4096"],
     ("config.n_workers=4096", "1024")),
])
def test_runtime_model_cli_names_the_bad_flag(argv, names, capsys):
  assert _runtime_cli(argv) == 2
  out = capsys.readouterr()
  assert out.out == ""  # refused before anything is computed
  errors = out.err.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith("error: "), out.err
  for name in names:
    assert name in errors[0], (name, errors[0])


def test_runtime_model_unwritable_png_is_one_line(capsys):
  # Refused up front, or (as root, who passes access checks) when written.
  rc = _runtime_cli(["predict", "--n-workers", "8", "--steps", "20",
                     "--png", "/proc/x.png"])
  assert rc == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1 and "--png '/proc/x.png'" in errors[0], errors
