"""The training state and the pure per-worker train and eval steps.

Everything here is written for *one* worker, as in
``experiments/optax_quickstart.py``: arrays have no leading worker axis and
collectives run over ``axis_name`` inside ``jax.shard_map`` (wrap the
functions with :func:`decentral_jax.parallel.per_worker`). The steps take
all they need as explicit arguments (the task's loss, the optax transform,
intervals), so they can be tested and reused without the runner.

One train step of worker ``i`` at step ``k``:

1. ``(loss, aux), g = value_and_grad(loss_fn)(x_i, batch_i, key_ik)``;
2. ``u, s = tx.update(g, s, x_i)`` (All-Reduce or gossip happen inside the
   transform, see :mod:`decentral_jax.optim`); ``x_i <- x_i + u``;
3. every ``global_avg_interval`` steps ``x_i <- (1/n) sum_j x_j`` (exact);
4. the consensus distance ``(1/n) sum_i ||x_i - x_bar||^2``: by default on
   log steps, of the updated parameters, inside a ``lax.cond``; with
   ``consensus="input"`` (what the runner uses) of the parameters the step
   starts from, with no conditional, so that its All-Reduce can run while
   the forward/backward pass computes (see ``docs/gpu_overlap.md``).
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from jax import lax

from decentral_jax.checks import check_choice
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import elastic

PyTree = Any
Batch = tuple[jax.Array, ...]

#: Name scope of the step's diagnostics (the consensus distance on logging
#: steps), so communication accounting can leave them out.
DIAGNOSTICS_SCOPE = "diagnostics"
LossFn = Callable[..., tuple[jax.Array, dict]]
#: Values of :func:`train_step`'s ``consensus`` argument.
CONSENSUS_MODES = ("logged", "input", "none")

#: The per-step metrics :func:`train_step` writes beside the loss's aux
#: values, and the prefix of the fault counters (``faults/...``): a model's
#: aux dict may not use them (its value would replace the runner's).
STEP_METRICS = ("loss", "grad_norm", "finite", "consensus_distance")
COUNTER_PREFIX = "faults/"


@flax.struct.dataclass
class TrainState:
  """Per-worker training state; in the runner every leaf is ``[n, ...]``.

  Attributes:
    step: int32 scalar: completed steps (equal on all workers).
    params: model parameters (float32 leaves in the shipped configs).
    opt_state: the optax state (moments, accumulators, gossip round
      counter).
    rng: uint32 [2]: raw data of the base dropout key (equal on all
      workers; per-step, per-worker keys are derived from it).
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  rng: jax.Array


def init_state(params: PyTree, rng: jax.Array, *,
               tx: optax.GradientTransformation) -> TrainState:
  """One worker's initial state: ``step`` 0, ``tx.init(params)``.

  Args:
    params: the worker's initial parameters.
    rng: uint32 [2] raw key data (``jax.random.key_data``).
    tx: the worker's optax transform.
  """
  return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                    opt_state=tx.init(params), rng=rng)


def train_step(state: TrainState, batch: Batch, *, loss_fn: LossFn,
               tx: optax.GradientTransformation, axis_name: gossip.AxisName,
               dropout: bool, global_avg_interval: int, log_interval: int,
               total_steps: int, round_index: int | None = None,
               model_params: Callable | None = None,
               global_average: Callable | None = None,
               masks: tuple | None = None,
               consensus: str = "logged",
               micro_batches: int = 1
               ) -> tuple[TrainState, dict]:
  """One training step of one worker (inside ``shard_map`` over the workers).

  Args:
    state: this worker's :class:`TrainState`.
    batch: this worker's batch (arrays ``[local_batch, ...]``).
    loss_fn: ``loss_fn(params, batch, key or None) -> (loss, aux)``.
    tx: the per-worker optax transform.
    axis_name: the worker mesh axis (or ``("nodes", "local")``).
    dropout: derive a dropout key ``fold_in(fold_in(rng, step), worker)``;
      otherwise the loss gets ``None``.
    global_avg_interval: exact parameter average every this many steps
      (0 = never).
    log_interval, total_steps: with ``consensus="logged"`` the consensus
      distance is computed when the new step is a multiple of
      ``log_interval`` or equals ``total_steps`` (NaN otherwise, to save
      the collective).
    round_index: static gossip round passed to ``tx.update`` (one compile
      per round, no conditional around the collectives), or None.
    model_params: ``(params, opt_state) -> model`` when the worker's model
      is not its parameters (SGP: ``z = x / w``); the gradient is taken and
      the consensus distance measured there.
    global_average: ``(params, opt_state, axis_name) -> (params,
      opt_state)`` replacing the exact parameter mean of
      ``global_avg_interval`` (SGP averages numerators and weights).
    masks: ``(alive, working, rejoining)``, bool [n] equal on all
      workers, passed to ``tx.update`` as extra arguments
      (:mod:`decentral_jax.optim.elastic`, ``decentralized``), or None.
    consensus: which consensus distance the metrics carry (a Python str):
      ``"logged"`` (of the updated model, on log steps: a ``lax.cond``
      whose All-Reduce waits for the whole step), ``"input"`` (of the model
      the step starts from, every time: no conditional, the All-Reduce
      depends only on the input and may overlap the forward/backward pass;
      the caller compiles this variant for the steps that follow a log
      step) or ``"none"`` (NaN, no collective).

  Returns:
    ``(new_state, metrics)``: float32 scalars ``loss`` (before the update,
    nats), ``grad_norm`` (global norm of the local gradient before
    clipping), ``consensus_distance`` (see ``consensus``; NaN when not
    computed), bool
    ``finite`` (loss, gradient norm and updated parameters finite), plus
    the task's aux.

  Raises:
    ValueError: ``consensus`` not one of ``"logged"``, ``"input"``,
      ``"none"``.
  """
  check_choice("consensus", consensus, CONSENSUS_MODES)
  key = None
  if dropout:
    key = jax.random.wrap_key_data(state.rng)
    key = jax.random.fold_in(jax.random.fold_in(key, state.step),
                             collectives.index(axis_name))
  def model(params, opt_state):
    return params if model_params is None else model_params(params, opt_state)

  if consensus == "input":
    # The barrier keeps XLA from fusing this reduction with the gossip's
    # gather of the same leaves (virtual workers): such a fusion makes the
    # permute wait for the All-Reduce (docs/gpu_overlap.md). Values unchanged.
    with jax.named_scope(DIAGNOSTICS_SCOPE):
      measured = gossip.consensus_distance(
          lax.optimization_barrier(model(state.params, state.opt_state)),
          axis_name).astype(jnp.float32)
  own = model(state.params, state.opt_state)
  (loss, aux), grads = loss_and_grad(loss_fn, own, batch, key, micro_batches)
  extra = {} if round_index is None else {"round_index": round_index}
  if masks is not None:
    extra.update(alive=masks[0], working=masks[1], rejoining=masks[2])
  updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                 **extra)
  params = optax.apply_updates(state.params, updates)
  step = state.step + 1
  if global_avg_interval and global_average is None:
    params = gossip.every(global_avg_interval, step % global_avg_interval == 0,
                          lambda p: gossip.mean(p, axis_name), lambda p: p,
                          params)
  elif global_avg_interval:
    params, opt_state = gossip.every(
        global_avg_interval, step % global_avg_interval == 0,
        lambda po: global_average(*po, axis_name), lambda po: po,
        (params, opt_state))
  if consensus == "logged":
    is_log = (step % log_interval == 0) | (step == total_steps)
    with jax.named_scope(DIAGNOSTICS_SCOPE):
      measured = gossip.every(
          log_interval, is_log,
          lambda p: gossip.consensus_distance(p, axis_name).astype(
              jnp.float32),
          lambda p: jnp.full([], jnp.nan, jnp.float32),
          model(params, opt_state))
  elif consensus == "none":
    measured = jnp.full([], jnp.nan, jnp.float32)
  grad_norm = optax.tree.norm(grads)
  metrics = {"loss": loss, "grad_norm": grad_norm,
             "finite": _finite(loss, grad_norm, params),
             "consensus_distance": measured, **aux,
             **elastic.counters(opt_state)}
  new_state = state.replace(step=step, params=params, opt_state=opt_state)
  return new_state, metrics


def _finite(loss: jax.Array, grad_norm: jax.Array,
            params: PyTree) -> jax.Array:
  """Bool scalar: the loss, the gradient norm and every parameter finite.
  A gradient norm past float32's range (gradients beyond ~1.8e19) makes
  Adam's second moment and the clip's scale overflow: every update is 0
  while the loss and parameters stay finite."""
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  for leaf in jax.tree.leaves(params):
    finite = finite & jnp.all(jnp.isfinite(leaf))
  return finite


def micro_batch_split(batch: Batch, micro_batches: int) -> Batch:
  """The batch as ``micro_batches`` strided micro-batches.

  Row ``i * k + j`` of each array ``[B, ...]`` becomes row ``i`` of
  micro-batch ``j`` (``k = micro_batches``): arrays ``[k, B / k, ...]``.
  Strided rather than contiguous so that a batch split over a worker's
  ``D`` devices in contiguous blocks (``devices_per_worker``) stays on its
  device when ``k`` divides each block (``B / D``): no data moves.

  Raises:
    ValueError: ``micro_batches`` does not divide a leading dimension.
  """
  k = micro_batches

  def split(x):
    if x.shape[0] % k:
      raise ValueError(f"micro_batches={k} does not divide the local batch "
                       f"of {x.shape[0]} rows; choose a divisor of it.")
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

  return tuple(split(x) for x in batch)


def loss_and_grad(loss_fn: LossFn, params: PyTree, batch: Batch,
                  key: jax.Array | None, micro_batches: int = 1):
  """``((loss, aux), grads)`` of ``loss_fn`` at ``params`` on ``batch``.

  With ``micro_batches = k > 1`` (gradient accumulation inside a step) the
  batch is split into ``k`` micro-batches ``b_j`` (:func:`micro_batch_split`)
  and ``lax.scan`` runs the forward and backward pass of one at a time,
  so the activations kept for the backward pass are those of ``B / k``
  rows::

    loss = sum_j loss_fn(params, b_j) / k,  g = sum_j grad_j / k

  each term divided by ``k`` before the float32 sum (then cast to the
  gradient's dtype), as are the aux values, so that a loss or gradient
  float32 holds never overflows the sum (with ``k`` a power of two this is
  bit for bit the sum divided by ``k``). For a loss that is a mean over
  equally sized rows (the tasks' token and image cross-entropies) this is
  the loss and gradient of the whole batch up to float32 rounding.
  Micro-batch ``j`` gets the dropout key ``fold_in(key, j)``.

  Args:
    loss_fn: ``loss_fn(params, batch, key or None) -> (loss, aux)``.
    params: the model's parameters.
    batch: arrays ``[B, ...]``; ``micro_batches`` divides ``B``.
    key: dropout key or None.
    micro_batches: ``k >= 1``; 1 calls ``jax.value_and_grad`` once, as
      without micro-batches (bit for bit).

  Returns:
    ``((loss, aux), grads)`` as ``jax.value_and_grad(..., has_aux=True)``.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    return grad_fn(params, batch, key)
  k = micro_batches
  part = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) / k, t)
  micro = micro_batch_split(batch, k)
  sub = lambda j: None if key is None else jax.random.fold_in(key, j)
  (loss, aux), grads = grad_fn(params, tuple(x[0] for x in micro), sub(0))
  like = (loss, aux, grads)

  def body(total, xs):
    j, rows = xs
    (loss, aux), grads = grad_fn(params, rows, sub(j))
    return jax.tree.map(jnp.add, total, part((loss, aux, grads))), None

  # The first micro-batch outside the scan gives the sum its start (and
  # the types the scan carries, varying over the workers like the rest);
  # the barrier makes the others wait for it, so that XLA does not run two
  # micro-batches at once (and keep both one's activations).
  first, rest = lax.optimization_barrier(
      (part(like), tuple(x[1:] for x in micro)))
  total, _ = lax.scan(body, first, (jnp.arange(1, k), rest))
  loss, aux, grads = jax.tree.map(lambda t, s: t.astype(s.dtype), total,
                                  like)
  return (loss, aux), grads


def eval_step(params: PyTree, rows: Batch, common: Batch, *, loss_fn: LossFn,
              axis_name: gossip.AxisName, averaged: PyTree = None) -> dict:
  """Evaluation of one worker: the averaged model and its own model.

  Args:
    params: this worker's parameters ``x_i`` (its own model).
    rows: this worker's share of the eval set, arrays ``[E, B, ...]``,
      evaluated with the averaged model ``x_bar`` (exact mean).
    common: a subset ``[E, B', ...]`` equal on all workers, evaluated with
      both ``x_i`` and ``x_bar``.
    loss_fn: as in :func:`train_step` (called with key ``None``).
    axis_name: the worker mesh axis.
    averaged: this worker's share of the averaged model, like ``params``:
      the averaged model is the mean of ``averaged`` over the workers
      (default ``params``; DiLoCo-style methods pass their global
      parameters ``theta``).

  Returns:
    Per eval batch, arrays ``[E]`` of the loss's dtype: ``avg_loss``,
    ``avg_accuracy`` (the averaged model on this worker's rows; accuracy 0
    if the task has none), ``own_loss`` and ``avg_subset_loss`` (``x_i``
    and ``x_bar`` on ``common``); and the float32 scalar
    ``consensus_distance``. The host averages them in float64, so finite
    losses near the float32 limit keep a finite mean.
  """
  avg = gossip.mean(params if averaged is None else averaged, axis_name,
                    varying=False)

  def run(p, data):
    def one(batch):
      value, aux = loss_fn(p, batch, None)
      return value, aux.get("accuracy", jnp.zeros([], jnp.float32))
    return lax.map(one, data)

  avg_loss, avg_acc = run(avg, rows)
  own_loss, _ = run(params, common)
  subset_loss, _ = run(avg, common)
  return {"avg_loss": avg_loss, "avg_accuracy": avg_acc,
          "own_loss": own_loss, "avg_subset_loss": subset_loss,
          "consensus_distance": gossip.consensus_distance(params, axis_name)}
