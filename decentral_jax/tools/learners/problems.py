"""What a learner trains: initial parameters, the loss, and its data shard.

A problem is named by a string and a tuple of ``(key, value)`` arguments so
that a learner started by Ray in another process rebuilds the same one
(:func:`build`). Learner ``i`` of ``shards`` reads shard ``i`` only; its
batch at sync period ``k``, inner step ``s`` depends on ``(i, k * H + s)``
only, so a learner that redoes a period after a restart sees the same data,
in the order worker ``i`` of the one-program method sees it.

* ``quadratic``: ``f_i(x) = ||x - b_i - e_{i,t}||^2 / 2`` on the three-leaf
  tree of the local-update tests (``e`` Gaussian noise of scale ``noise``
  drawn from ``(seed, i, t)``); one "token" per inner step.
* ``gpt``: a small byte-level GPT (:mod:`decentral_jax.models.gpt`) on the
  pydoc corpus, windows dealt by :class:`decentral_jax.data.text.LMSampler`
  (worker ``i`` of ``shards``); tokens = local batch * context length.
* ``runner``: a runner config (``config``: a preset or ``FILE.py[:ARG]``,
  ``overrides``: ``field=value`` strings) with ``n_workers = shards``: its
  model, loss, data shards, inner optimizer and validation split
  (:mod:`decentral_jax.tools.learners.runner_problem`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

PyTree = Any
NAMES = ("quadratic", "gpt", "runner")


@dataclasses.dataclass
class Problem:
  """A built problem.

  Attributes:
    params: the initial parameters, a flat dict of float32 NumPy leaves
      (nested modules joined by ``/``; equal on every learner).
    loss: ``loss(params, batch) -> float32 []`` (JAX-traceable).
    batch: ``batch(shard, step) -> batch`` of learner ``shard`` at inner
      step ``step`` (NumPy).
    tokens_per_step: tokens one inner step of one learner processes.
    inner: the inner optax transform, or None for ``RunSpec.inner`` and
      ``inner_lr`` (``runner``: the config's).
    runner: ``runner``: the :class:`~decentral_jax.tools.learners.
      runner_problem.RunnerTask` (evaluation, learning rate), else None.
    optimum: the minimizer of the mean loss (flat dict like ``params``,
      float64) where it is known (the quadratic: ``mean_i b_i``), else None.
  """
  params: PyTree
  loss: Callable
  batch: Callable
  tokens_per_step: int
  inner: Any = None
  runner: Any = None
  optimum: Any = None


def quadratic_targets(shards: int, seed: int = 0):
  """``(x0, b)`` with leaves ``[shards, ...]`` (float64): the start (equal
  rows) and each shard's target, as the local-update tests draw them."""
  rng = np.random.default_rng(seed)
  x0 = {"a": np.repeat(rng.normal(size=(1, 3)), shards, 0),
        "b": np.repeat(rng.normal(size=(1, 2, 2)), shards, 0),
        "c": np.repeat(rng.normal(size=(1,)), shards, 0)}
  b = {k: rng.normal(size=v.shape) for k, v in x0.items()}
  return x0, b


def quadratic_batch(b, shard: int, step: int, seed: int, noise: float):
  """Target of shard ``shard`` at inner step ``step``: ``b_i + e_{i,t}``
  (float32)."""
  rng = np.random.default_rng([seed, shard, step])
  return {k: (v[shard] + noise * rng.normal(size=v.shape[1:])
              ).astype(np.float32) for k, v in sorted(b.items())}


def _quadratic(shards: int, seed: int = 0, noise: float = 0.1) -> Problem:
  x0, b = quadratic_targets(shards, seed)

  def loss(params, target):
    return sum(0.5 * jnp.sum((params[k] - target[k]) ** 2) for k in params)

  return Problem({k: v[0].astype(np.float32) for k, v in x0.items()}, loss,
                 lambda shard, step: quadratic_batch(b, shard, step, seed,
                                                     noise), 1,
                 optimum={k: v.mean(0) for k, v in b.items()})


def _gpt(shards: int, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
         n_head: int = 2, context: int = 64, batch: int = 4) -> Problem:
  from decentral_jax.data import text  # pylint: disable=import-outside-toplevel
  from decentral_jax.models import gpt  # pylint: disable=import-outside-toplevel
  from decentral_jax.models import losses  # pylint: disable=import-outside-toplevel
  cfg = gpt.GPTConfig(vocab_size=256, block_size=context, n_layer=n_layer,
                      n_head=n_head, n_embd=n_embd)
  train, _ = text.byte_splits(text.pydoc_corpus())
  sampler = text.LMSampler(train, context, shards, batch, seed)
  model = gpt.GPT(cfg)
  params = traverse_util.flatten_dict(jax.tree.map(
      np.asarray, gpt.init_params(cfg, jax.random.PRNGKey(seed))), sep="/")

  def loss(p, xy):
    p = traverse_util.unflatten_dict(p, sep="/")
    return losses.lm_loss(model.apply({"params": p}, xy[0]), xy[1])

  def get(shard, step):
    x, y = sampler.batch(step, [shard])
    return x[0], y[0]

  return Problem(params, loss, get, batch * context)


def _runner(shards: int, config: str = "", overrides: tuple = ()) -> Problem:
  from decentral_jax.tools.learners import runner_problem  # pylint: disable=import-outside-toplevel
  if not config:
    raise ValueError("problem 'runner' needs problem_args (('config', "
                     "'configs/gpt_tiny.py'), ...): pass --config.")
  task = runner_problem.RunnerTask(
      runner_problem.load(config, tuple(overrides), shards))
  return Problem(task.init_params(), task.loss, task.batch,
                 task.task.units_per_step // shards, inner=task.inner(),
                 runner=task)


def build(name: str, shards: int, args: tuple = ()) -> Problem:
  """The problem ``name`` for ``shards`` data shards.

  Args:
    name: one of :data:`NAMES`.
    shards: number of data shards (learner ``i`` reads shard ``i``).
    args: ``(key, value)`` pairs passed to the problem (``seed``, ``noise``
      for ``quadratic``; ``seed``, ``n_layer``, ``n_embd``, ``n_head``,
      ``context``, ``batch`` for ``gpt``; ``config``, ``overrides`` for
      ``runner``).

  Raises:
    ValueError: an unknown name or argument.
  """
  makers = {"quadratic": _quadratic, "gpt": _gpt, "runner": _runner}
  if name not in makers:
    raise ValueError(f"problem must be one of {NAMES}, got {name!r}.")
  try:
    return makers[name](shards, **dict(args))
  except TypeError as e:
    raise ValueError(f"bad problem_args {args!r} for problem {name!r}: "
                     f"{e}") from None
