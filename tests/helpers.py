"""Helpers shared by several test modules (test modules never import each other).

* Topology cases: :data:`NS`, :func:`valid`, :func:`local_size`,
  :func:`all_valid`: every built-in topology at every worker count it
  accepts, stated independently of :mod:`decentral_jax.topology`.
* :func:`np_accum_adam`: AccumAdam (Adam for ``T = 1``) directions in NumPy.
* :func:`sync_args`: the ``reduction``/``timing`` strategies of the
  DiLoCo family for a run's settings (as ``runner/builders.py`` builds
  them from a config).
* :data:`TINY_RUN`: config overrides for a tiny GPT run of the runner
  (1 layer, width 16, 12 steps, AdamW, a log point every step).
"""

from __future__ import annotations

import os
from typing import Iterator

import jax
import numpy as np

from decentral_jax import topology
from decentral_jax.optim import outer_timing
from decentral_jax.optim import reductions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny runner config (overrides of configs/gpt_tiny.py) for tests that train.
TINY_RUN = ("--config.model.n_layer=1", "--config.model.n_embd=16",
            "--config.model.n_head=2", "--config.model.block_size=8",
            "--config.global_batch=16", "--config.eval_batches=1",
            "--config.steps=12", "--config.schedule.warmup_steps=2",
            "--config.optimizer.name=adamw",
            "--config.optimizer.accum_steps=1", "--config.log_interval=1")
# Worker counts the topology tests are built at.
NS = (2, 3, 4, 5, 6, 8, 12, 16)


def local_size(name: str, n: int) -> int:
  """Workers per node used for ``name`` at ``n`` workers in the tests."""
  return 2 if name == "alternating_exp_ring" and n % 2 == 0 else 1


def valid(name: str, n: int) -> bool:
  """Independent statement of each topology's constraint on ``n``."""
  if name == "ring":
    return n % 2 == 0
  if name == "one_peer_exp":
    return n in (1, 2, 4, 8, 16, 32)
  if name == "alternating_exp_ring":  # built here with local_size 1 or 2
    nodes = n // local_size(name, n)
    return nodes in (1, 2, 4, 8, 16)
  return True


def all_valid() -> Iterator[tuple[str, int]]:
  """``(name, n)`` for every topology name and every valid ``n`` in NS."""
  for name in topology.NAMES:
    for n in NS:
      if valid(name, n):
        yield name, n


def np_accum_adam(grads, b1: float, b2: float, eps: float, big_t: int):
  """AccumAdam directions in float64 NumPy (paper Alg. 4, App. C).

  With ``t`` the 1-based step and ``c = ceil(t / T)``: ``A += g / T``;
  ``d = m / (sqrt(v) + eps)`` with ``m = (b1 M + (1 - b1) g) / (1 - b1^c)``
  and ``v = (b2 V + (1 - b2) g^2) / (1 - b2^c)``; at the end of a window
  (``t % T == 0``) ``M, V`` take ``A, A^2`` with decays ``b1, b2`` and ``A``
  restarts at 0. ``T = 1`` is Adam.

  Returns:
    The directions, one per gradient, stacked: float64 [steps, ...].
  """
  m = v = a = 0.0
  dirs = []
  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    c = -(-t // big_t)
    a = a + g / big_t
    m_hat = (b1 * m + (1 - b1) * g) / (1 - b1**c)
    v_hat = (b2 * v + (1 - b2) * g * g) / (1 - b2**c)
    dirs.append(m_hat / (np.sqrt(v_hat) + eps))
    if t % big_t == 0:
      m, v, a = b1 * m + (1 - b1) * a, b2 * v + (1 - b2) * a * a, 0.0
  return np.array(dirs)


def sync_args(*, topology=None, axis_name="workers", bucket_bytes=None,
              comm_dtype=None, overlap="none", latency=1, trickle=None,
              compressor=None, error_feedback=False, error_decay=1.0,
              timing=True) -> dict:
  """``{"reduction": ..., "timing": ...}`` for ``diloco`` and
  ``streaming_diloco`` (``timing=False``: the reduction only, for
  ``local_sgd``) from these settings: a compressed reduction with a
  compressor or error feedback, else a gossip round, a low-precision or
  the exact mean; the timing named by ``overlap``."""
  if compressor is not None or error_feedback:
    reduction = reductions.compressed(compressor, error_feedback, error_decay,
                                      axis_name)
  else:
    reduction = reductions.uncompressed(
        topology=topology, comm_dtype=comm_dtype, axis_name=axis_name,
        bucket_bytes=bucket_bytes)
  if not timing:
    return {"reduction": reduction}
  return {"reduction": reduction,
          "timing": outer_timing.named(overlap, latency, trickle)}


def quadratic_problem(n, seed=0):
  """``(x0, b)``: ``n`` workers' equal starting parameters (a tree of three
  leaves, shapes ``[n, 3]``, ``[n, 2, 2]``, ``[n, 1]``) and each worker's
  own target ``b`` of the same shapes (float64, NumPy), for the local-update
  tests' quadratic losses."""
  rng = np.random.default_rng(seed)
  x0 = {"a": np.repeat(rng.normal(size=(1, 3)), n, 0),
        "b": np.repeat(rng.normal(size=(1, 2, 2)), n, 0),
        "c": np.repeat(rng.normal(size=(1,)), n, 0)}
  b = {k: rng.normal(size=v.shape) for k, v in x0.items()}
  return x0, b


def spmd_quadratic(tx, n, steps, seed=0, noise=0.1):
  """``tx`` (a local-update transform) in one SPMD program (under
  shard_map) on the learners' quadratic problem: worker i's target at step
  t is ``problems.quadratic_batch(b, i, t)``. Returns ``(params, state)``
  after ``steps`` steps (device arrays, leading worker axis)."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax import parallel  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import problems  # pylint: disable=import-outside-toplevel
  x0, b = quadratic_problem(n, seed)
  mesh = parallel.make_mesh(n)

  def step(params, state, target):
    grads = jax.tree.map(lambda x, t: x - t, params, target)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(parallel.per_worker(step, mesh))
  params = parallel.shard({k: v.astype(np.float32) for k, v in x0.items()},
                          mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  for t in range(steps):
    target = {k: np.stack([problems.quadratic_batch(b, i, t, seed, noise)[k]
                           for i in range(n)]) for k in b}
    params, state = step(params, state, parallel.shard(target, mesh))
  return params, state


def spmd_diloco(n, h, periods, seed=0, noise=0.1, lr=0.1):
  """DiLoCo (inner SGD ``lr``, default outer) in one SPMD program
  (optim.diloco) on the quadratic problem (:func:`spmd_quadratic`).
  Returns worker 0's parameters after ``h * periods`` steps (= theta)."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax import optim  # pylint: disable=import-outside-toplevel
  params, _ = spmd_quadratic(optim.diloco(optax.sgd(lr), h), n, h * periods,
                             seed, noise)
  return jax.tree.map(lambda v: np.asarray(v)[0], jax.device_get(params))


def load_gpu_check(name: str = "gpu_check_under_test"):
  """``benchmarks/gpu_check.py`` imported as module ``name`` (once)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def benchmark_module(name: str):
  """``benchmarks/NAME.py``, a module the scripts import (``_common``,
  ``_gpu_check_flags``), imported as they import it: with ``benchmarks/``
  on ``sys.path``."""
  import importlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  bench = os.path.join(ROOT, "benchmarks")
  if bench not in sys.path:
    sys.path.insert(0, bench)
  return importlib.import_module(name)


def run_steps(exp, state, start: int, stop: int, losses=None):
  """``exp``'s compiled train step for steps ``start .. stop - 1`` on its own
  batches; each step's mean loss appended to ``losses`` if given."""
  for s in range(start, stop):
    state, m = exp.train_step(state, exp.get_batch(s), s)
    if losses is not None:
      losses.append(float(np.mean(jax.device_get(m["loss"]))))
  return state


def to_host(tree):
  """``tree`` as NumPy arrays on the host (for exact comparisons)."""
  return jax.tree.map(np.asarray, jax.device_get(tree))


def resume_mid_run(exp, directory, at: int, stop: int):
  """``exp`` trained from scratch to step ``at``, checkpointed in
  ``directory`` (Orbax, with its run metadata), restored and trained on to
  ``stop``. Returns ``(state, meta)``: the resumed state and the
  checkpoint's metadata document."""
  from decentral_jax.runner import checkpoint  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  ckpt = checkpoint.Checkpointer(str(directory), async_save=False)
  meta = run_meta.checkpoint_meta(exp, at)
  ckpt.save(at, run_steps(exp, exp.init_state(), 0, at), meta)
  restored, _ = ckpt.restore(at, exp.init_state())
  ckpt.close()
  return run_steps(exp, restored, at, stop), meta


def assert_same_tree(a, b) -> None:
  """Every leaf of ``a`` and ``b`` equal, bit for bit, on the host."""
  for x, y in zip(jax.tree.leaves(to_host(a)), jax.tree.leaves(to_host(b)),
                  strict=True):
    np.testing.assert_array_equal(x, y)


def agreeing_evaluation(loss: float) -> dict:
  """The keys of an evaluation (evaluation.Evaluator.evaluate) whose
  workers all agree: every loss ``loss``, no spread, no excess."""
  return {"eval/loss": loss, "eval/worker_loss_mean": loss,
          "eval/worker_loss_min": loss, "eval/worker_loss_max": loss,
          "eval/worker_loss_std": 0.0, "eval/loss_subset": loss,
          "eval/worker_excess_mean": 0.0, "eval/worker_excess_max": 0.0}
