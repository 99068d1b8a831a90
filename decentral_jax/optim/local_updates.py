"""Local-update methods as optax transforms: Local SGD, DiLoCo, Streaming DiLoCo.

Each wraps a worker-local inner optax transform (e.g. ``optax.adamw``) that
steps every iteration; every ``sync_every = H`` steps the workers
synchronise. Everything runs per worker inside ``jax.shard_map`` over the
worker axis (one worker per device); only the synchronisation communicates,
inside a ``lax.cond`` that is taken on sync steps only. Like the gossip
transforms of :mod:`decentral_jax.optim`, each returns ``x_{k+1} - x_k`` as
its update, so ``optax.apply_updates`` stays the only place parameters
change, and all state (inner and outer optimizer states, the global
parameters ``theta``, pending fragments, counters) lives in the optax state
and hence in checkpoints.

With ``t`` the number of inner steps taken (1-based, after this update):

* Local SGD: ``x_i <- x_i + inner(g_i)``; if ``t % H == 0``:
  ``x_i <- (1/n) sum_j x_j``. The inner state is kept.
* DiLoCo (Douillard et al. 2023, arXiv 2311.08105): ``x_i <- x_i +
  inner(g_i)``; if ``t % H == 0``: pseudo-gradient ``Delta = theta - (1/n)
  sum_j x_j``, ``theta <- theta + outer(Delta)``, ``x_i <- theta``.
  Decentralized DiLoCo replaces the exact mean by the ``k``-th gossip round
  (``k`` = outer steps so far): ``Delta_i = theta_i - sum_j W_k[i, j] x_j``
  with ``theta_i`` and the outer state per worker; on ``complete`` it is
  DiLoCo.
* Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): the leaves
  are split into ``P`` fragments; fragment ``p`` synchronises when
  ``t % H == (p H // P) % H``, with its own outer state; with overlap
  ``tau >= 1`` the outer result is merged ``tau`` inner steps later,
  ``x_p <- alpha x_p + (1 - alpha) theta_p``, from the pseudo-gradient of
  the parameters at the sync step (held in the state; its all-reduce
  depends only on the state, so XLA can run it during the merge step's
  forward/backward). With ``P = 1, tau = 0, alpha = 0`` it is DiLoCo.

``theta`` is kept in float32 (float64 for float64 parameters).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import compress
from decentral_jax.comm import gossip
from decentral_jax.optim import outer_overlap
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms
from decentral_jax.topology import schedules as topology_lib

PyTree = Any


def default_outer_optimizer() -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def _check_common(inner, sync_every, outer=None) -> int:
  """Checks the arguments every method takes; returns ``H`` as an int."""
  arguments.check_transform("inner", inner)
  if outer is not None:
    arguments.check_transform("outer", outer)
  return checks.check_int("sync_every", sync_every, minimum=1)


def _global_dtype(x) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _inner_step(inner, grads, inner_state, params, name):
  if params is None:
    raise ValueError(arguments.NO_PARAMS.format(name))
  gossip.check_float_leaves(params, name)
  local, inner_state = inner.update(grads, inner_state, params)
  return optax.apply_updates(params, local), inner_state


def _delta(new, params):
  return jax.tree.map(lambda t, p: (t - p).astype(p.dtype), new, params)


# --------------------------------------------------------------------------
# Local SGD.
# --------------------------------------------------------------------------


class LocalSGDState(NamedTuple):
  """State of :func:`local_sgd` (worker-local)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState


def local_sgd(inner: optax.GradientTransformation, sync_every: int,
              axis_name: gossip.AxisName = "workers", *,
              comm_dtype=None, compressor: compress.Compressor | None = None,
              error_feedback: bool = False, error_decay: float = 1.0
              ) -> optax.GradientTransformation:
  """Local SGD: inner steps, exact parameter average every ``H`` steps.

  Recursion: ``x_i <- x_i + inner(g_i; x_i)``; if ``t % H == 0``,
  ``x_i <- (1/n) sum_j x_j`` (one all-reduce of the parameters). The inner
  state is never reset. Equals :func:`diloco` with outer ``optax.sgd(1.0)``.

  With ``comm_dtype`` the parameters are sent in that dtype and summed in
  float32 (float64 for float64 parameters): ``x_i <- c(sum_j c(x_j) / n)``
  with ``c`` the rounding to ``comm_dtype`` (an all-to-all of ``1/n``
  chunks, the sum, an all-gather of the mean in ``comm_dtype``: the bytes
  of an all-reduce in ``comm_dtype``). Every worker holds the same rounded
  mean afterwards. (:func:`diloco` sends pseudo-gradients instead, which
  lose less to a narrow dtype.)

  Args:
    inner: worker-local optax transform.
    sync_every: the sync period ``H >= 1`` in steps.
    axis_name: worker mesh axis (or ``("nodes", "local")``).
    comm_dtype: optional floating dtype of the parameters on the wire
      (None: their own dtype, an exact mean).
    compressor, error_feedback, error_decay: send compressed differences
      instead (not with ``comm_dtype``): Local SGD is then run as
      :func:`diloco` with outer ``optax.sgd(1.0)`` and these arguments
      (``theta``, the last average, kept in float32, each worker sending
      ``Q(theta - x_i)``; state :class:`CompressedDiLoCoState`). The
      identity compressor changes nothing.

  Returns:
    An ``optax.GradientTransformation`` with :class:`LocalSGDState`;
    ``update`` needs ``params`` and runs inside ``shard_map``. Updates have
    the params' shapes and dtypes.

  Raises:
    ValueError: ``inner`` not an optax transform, ``sync_every`` not an
      integer >= 1, ``comm_dtype`` not None or a floating dtype, bad
      compression arguments or a compressor with ``comm_dtype`` (see
      :func:`check_compression`; at construction); an integer or bool
      parameter leaf (in ``init`` and ``update``: only floating leaves can
      be averaged); ``params`` not passed to ``update``.
  """
  period = _check_common(inner, sync_every)
  comm_dtype = checks.check_float_dtype("comm_dtype", comm_dtype)
  coding = check_compression(compressor, error_feedback, error_decay)
  if coding is not None:
    _refuse_with_compression(comm_dtype=comm_dtype)
    return _compressed_diloco(inner, period, optax.sgd(1.0), coding,
                              axis_name)

  def average(y):
    if comm_dtype is None:
      return gossip.mean(y, axis_name)
    leaves, treedef = jax.tree.flatten(y)
    means = _mean_low_precision(leaves, comm_dtype, axis_name)
    return treedef.unflatten([m.astype(a.dtype)
                              for m, a in zip(means, leaves)])

  def init_fn(params):
    gossip.check_float_leaves(params, "local_sgd")
    return LocalSGDState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "local_sgd")
    count = optax.safe_increment(state.count)
    x = gossip.every(period, count % period == 0, average, lambda y: y, x)
    return _delta(x, params), LocalSGDState(count, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------
# DiLoCo and decentralized DiLoCo.
# --------------------------------------------------------------------------


class DiLoCoState(NamedTuple):
  """State of :func:`diloco` (``theta``/``outer_state`` equal on all workers
  unless a topology is given)."""
  count: jax.Array  # int32 []: inner steps taken t.
  outer_count: jax.Array  # int32 []: outer steps taken k (gossip round).
  inner_state: optax.OptState
  theta: optax.Params  # global parameters, float32 (float64) like params.
  outer_state: optax.OptState


class OverlapDiLoCoState(NamedTuple):
  """State of :func:`diloco` with ``overlap`` ``"delayed"`` or ``"eager"``.

  :class:`DiLoCoState`'s fields, then the pseudo-gradients in flight. With
  ``"eager"`` ``theta`` and ``outer_state`` are per worker.
  """
  count: jax.Array  # int32 []: inner steps taken t.
  outer_count: jax.Array  # int32 []: outer steps taken k.
  inner_state: optax.OptState
  theta: optax.Params  # float32 (float64) like params.
  outer_state: optax.OptState
  in_flight: outer_overlap.OverlapBuffers


def diloco(inner: optax.GradientTransformation, sync_every: int, *,
           outer: optax.GradientTransformation | None = None,
           topology: topology_lib.Topology | None = None,
           axis_name: gossip.AxisName = "workers",
           bucket_bytes: int | None = None, comm_dtype=None,
           overlap: str = "none", latency: int = 1,
           trickle: bool | None = None,
           compressor: compress.Compressor | None = None,
           error_feedback: bool = False, error_decay: float = 1.0
           ) -> optax.GradientTransformation:
  r"""DiLoCo: inner steps; every ``H`` steps an outer step on the pseudo-gradient.

  .. math::
    x_i &\leftarrow x_i + \mathrm{inner}(g_i; x_i) \\
    \text{if } t \bmod H = 0:&\ \Delta = \theta - \tfrac1n \textstyle\sum_j x_j,
      \ \theta \leftarrow \theta + \mathrm{outer}(\Delta; \theta),
      \ x_i \leftarrow \theta

  ``theta`` starts at the initial parameters. With ``topology``
  (decentralized DiLoCo) the mean is the ``k``-th gossip round,
  ``Delta_i = theta_i - sum_j W_k[i, j] x_j``, and ``theta_i`` and the outer
  state are per worker; ``complete`` gives DiLoCo exactly.

  ``comm_dtype`` (a narrow wire dtype): without ``topology`` each worker
  sends its pseudo-gradient ``theta - x_i`` in that dtype, the sum is
  formed in float32 (float64 for float64 parameters) and the mean comes
  back in ``comm_dtype`` (an all-to-all of ``1/n`` chunks and an
  all-gather: the bytes of an all-reduce in ``comm_dtype``), as Streaming
  DiLoCo does with one fragment: ``Delta = c(sum_j c(theta - x_j) / n)``
  with ``c`` the rounding to ``comm_dtype``; ``theta`` stays equal on all
  workers. With ``topology`` the parameters are gossiped in
  ``comm_dtype`` (each worker's own term exact, weighted sums in float32;
  :func:`decentral_jax.comm.gossip.mix`); the thetas differ, so there is
  no common pseudo-gradient to send.

  ``overlap="delayed"`` or ``"eager"`` hides the reduction of the
  pseudo-gradients behind the next round (or ``latency = d`` rounds):
  delayed steps on ``Delta^(k-d)``, eager on ``Delta^(k-d) + (1/n)
  (Delta_i^(k) - Delta_i^(k-d))`` with per-worker ``theta_i`` (the
  evaluated model is their mean); with ``trickle`` the reduction is spread
  over the ``H`` inner steps of the round, one slice per step, outside any
  conditional (see :mod:`decentral_jax.optim.outer_overlap`). With a
  topology the workers' pseudo-gradients ``theta_i - x_i`` are gossiped
  (``Delta_i = sum_j W[i, j] (theta_j - x_j)``, the own weight ``W[i, i]``
  replacing ``1/n`` in eager), in ``comm_dtype`` if given; without one,
  ``comm_dtype`` sends them as above (each slice with trickle).

  ``compressor`` (without ``topology``, ``comm_dtype`` and overlap): the
  pseudo-gradients are sent compressed (:func:`compressed_mean`), with
  optional error feedback; see :func:`compressed_pseudo_gradient`. The
  identity compressor (``format="none"``) is plain DiLoCo, bit for bit.

  Args:
    inner: worker-local optax transform (AdamW in the paper).
    sync_every: the sync period ``H >= 1`` in inner steps.
    outer: the outer optax transform applied to ``Delta`` as a gradient
      (default :func:`default_outer_optimizer`, Nesterov lr 0.7 momentum
      0.9); ``optax.sgd(1.0)`` gives Local SGD.
    topology: gossip schedule for decentralized DiLoCo (doubly stochastic),
      or None for the exact mean.
    axis_name: worker mesh axis (or ``("nodes", "local")``).
    bucket_bytes: largest gossip bucket in bytes with ``topology``; None:
      the default (one collective per leaf), 0: one per leaf (bit-identical; see
      :func:`decentral_jax.comm.gossip.check_bucket_bytes`).
    comm_dtype: optional floating dtype on the wire (see above; None: the
      float32 (float64) theta dtype, an exact mean).
    overlap: ``"none"`` (plain DiLoCo: wait for the reduction),
      ``"delayed"`` or ``"eager"``.
    latency: ``d >= 1``, rounds between a sync and the outer step that
      uses its reduction (1 without overlap).
    trickle: spread the reduction over the next round's inner steps (None:
      yes, unless a time-varying topology picks its round with a
      conditional, where it is refused).
    compressor: optional :class:`~decentral_jax.comm.compress.Compressor`
      of the pseudo-gradients (None: uncompressed).
    error_feedback: keep each worker's compression residual and add it to
      its next pseudo-gradient (needs a compressor that is not the
      identity).
    error_decay: ``beta`` in (0, 1] of the residual (SparseLoCo's 0.95;
      1: classic error feedback).

  Returns:
    An ``optax.GradientTransformation`` with :class:`DiLoCoState`
    (:class:`OverlapDiLoCoState` with overlap, :class:`CompressedDiLoCoState`
    with a compressor other than the identity).

  Raises:
    ValueError: ``inner`` or ``outer`` not an optax transform,
      ``sync_every`` not an integer >= 1, ``topology`` not None or a
      Topology, a bad ``bucket_bytes``, ``comm_dtype`` not None or a
      floating dtype, a bad ``overlap``, ``latency`` or ``trickle`` (see
      :func:`decentral_jax.optim.outer_overlap.check_overlap`; at
      construction), a compressor with ``topology``, ``comm_dtype`` or
      overlap, a bad ``compressor``, ``error_feedback`` or ``error_decay``
      (see :func:`check_compression`); an integer or bool parameter leaf
      (in ``init`` and ``update``); ``params`` not passed to ``update``.

  References:
    Douillard et al., DiLoCo: Distributed Low-Communication Training of
    Language Models, arXiv 2311.08105 (Alg. 1); Kale, Douillard, Donchev,
    Eager Updates for Overlapped Communication and Computation in DiLoCo,
    arXiv 2502.12996; Sarfi et al., SparseLoCo, arXiv 2508.15706.
  """
  period = _check_common(inner, sync_every, outer)
  if topology is not None:
    gossip.check_topology(topology)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)
  comm_dtype = checks.check_float_dtype("comm_dtype", comm_dtype)
  outer = default_outer_optimizer() if outer is None else outer
  coding = check_compression(compressor, error_feedback, error_decay)
  if coding is not None:
    _refuse_with_compression(topology=topology, comm_dtype=comm_dtype,
                             overlap=overlap)
    return _compressed_diloco(inner, period, outer, coding, axis_name)
  overlap, latency, trickle = outer_overlap.check_overlap(
      overlap, latency, trickle,
      one_round=topology is None or len(topology.distinct_rounds) == 1)
  if overlap != "none":
    if topology is not None:
      reduction = outer_overlap.gossip_reduction(topology, axis_name,
                                                 comm_dtype=comm_dtype)
    elif comm_dtype is not None:
      reduction = _low_precision_reduction(comm_dtype, axis_name)
    else:
      reduction = outer_overlap.mean_reduction(axis_name)
    return _overlapped_diloco(inner, outer, outer_overlap.OuterOverlap(
        overlap, latency, trickle, period, outer, *reduction))

  def init_fn(params):
    gossip.check_float_leaves(params, "diloco")
    theta = jax.tree.map(lambda p: jnp.asarray(p, _global_dtype(p)), params)
    zero = jnp.zeros([], jnp.int32)
    return DiLoCoState(zero, zero, inner.init(params), theta,
                       outer.init(theta))

  def reduce(x, k):
    if topology is None:
      return gossip.mean(x, axis_name)
    return gossip.mix(x, topology, k, axis_name, comm_dtype=comm_dtype,
                      bucket_bytes=bucket_bytes)

  def pseudo_gradient(x, theta, k):
    x = jax.tree.map(lambda a, t: a.astype(t.dtype), x, theta)
    if topology is None and comm_dtype is not None:
      leaves, treedef = jax.tree.flatten(
          jax.tree.map(lambda t, a: t - a, theta, x))
      return treedef.unflatten(
          _mean_low_precision(leaves, comm_dtype, axis_name))
    return jax.tree.map(lambda t, m: t - m, theta, reduce(x, k))

  def sync(operand):
    x, theta, outer_state, k = operand
    pseudo_grad = pseudo_gradient(x, theta, k)
    step, outer_state = outer.update(pseudo_grad, outer_state, theta)
    theta = optax.apply_updates(theta, step)
    x = jax.tree.map(lambda t, a: t.astype(a.dtype), theta, x)
    return x, theta, outer_state, optax.safe_increment(k)

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "diloco")
    count = optax.safe_increment(state.count)
    x, theta, outer_state, k = gossip.every(
        period, count % period == 0, sync, lambda o: o,
        (x, state.theta, state.outer_state, state.outer_count))
    return _delta(x, params), DiLoCoState(count, k, inner_state, theta,
                                          outer_state)

  return optax.GradientTransformation(init_fn, update_fn)


def _overlapped_diloco(inner, outer, engine: outer_overlap.OuterOverlap
                       ) -> optax.GradientTransformation:
  """:func:`diloco` with a delayed or eager outer step (``engine``)."""

  def init_fn(params):
    gossip.check_float_leaves(params, "diloco")
    theta = jax.tree.map(lambda p: jnp.asarray(p, _global_dtype(p)), params)
    zero = jnp.zeros([], jnp.int32)
    return OverlapDiLoCoState(zero, zero, inner.init(params), theta,
                              outer.init(theta), engine.init(theta))

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "diloco")
    count = optax.safe_increment(state.count)
    x, theta, outer_state, k, in_flight = engine.step(
        count, x, state.theta, state.outer_state, state.outer_count,
        state.in_flight)
    return _delta(x, params), OverlapDiLoCoState(
        count, k, inner_state, theta, outer_state, in_flight)

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------
# Compressed pseudo-gradients (DiLoCo, Local SGD, Streaming DiLoCo).
# --------------------------------------------------------------------------


class Coding(NamedTuple):
  """How pseudo-gradients are sent: see :func:`check_compression`."""
  compressor: compress.Compressor
  error_feedback: bool
  error_decay: float

  def feedback(self, v: PyTree, error: PyTree) -> tuple[PyTree, PyTree]:
    """``(target, new_error)``: ``target = beta e + v``, the new residual
    ``target - deQ(Q(target))``; without error feedback ``(v, error)``."""
    if not self.error_feedback:
      return v, error
    target = jax.tree.map(lambda a, e: self.error_decay * e + a, v, error)
    residual = jax.tree.map(
        lambda t: t - self.compressor.roundtrip(t), target)
    return target, residual

  def init_error(self, theta: PyTree) -> PyTree:
    """Zero residuals like ``theta`` (``()`` without error feedback)."""
    return optax.tree.zeros_like(theta) if self.error_feedback else ()


def check_compression(compressor, error_feedback, error_decay
                      ) -> Coding | None:
  """Validates the compression arguments of the local-update methods.

  Returns:
    None for no compressor or the identity (``format="none"``, the
    uncompressed method bit for bit: its residual would stay exactly zero),
    else the :class:`Coding`.

  Raises:
    ValueError: ``compressor`` not None or a
      :class:`~decentral_jax.comm.compress.Compressor`, ``error_feedback``
      not a bool, or True without a compressor, ``error_decay`` outside
      (0, 1].
  """
  if not isinstance(error_feedback, (bool, np.bool_)):
    raise ValueError(f"error_feedback must be True or False, got "
                     f"{error_feedback!r}.")
  decay = checks.check_float("error_decay", error_decay, minimum=0.0,
                             maximum=1.0, open_min=True)
  if compressor is None:
    if error_feedback:
      raise ValueError("error_feedback=True needs a compressor (the residual "
                       "of what? pass compressor=Compressor('int8'), ...).")
    return None
  compress.check_compressor(compressor)
  if compressor.is_identity:
    return None
  return Coding(compressor, bool(error_feedback), decay)


def _refuse_with_compression(**settings) -> None:
  """Raises if a setting that has no compressed form is not at its default."""
  defaults = {"topology": None, "comm_dtype": None, "overlap": "none",
              "overlap_steps": 0}
  for name, value in settings.items():
    default = defaults[name]
    if (value is not None) if default is None else value != default:
      raise ValueError(
          f"{name}={value!r} has no compressed form: a compressor sends the "
          f"pseudo-gradients of the exact mean; leave {name} at its default "
          f"({defaults[name]!r}) or pass compressor=None.")


def compressed_mean(leaves: Sequence[jax.Array],
                    compressor: compress.Compressor,
                    axis_name) -> list[jax.Array]:
  """The worker mean of ``leaves`` sent with ``compressor``.

  ``topk``: every worker's indices and values are all-gathered and the
  decoded sparse vectors summed in float32 (SparseLoCo's aggregation,
  :func:`decentral_jax.comm.compress.gather_mean_compressed`, ``(n - 1) x
  payload`` bytes per worker). Scaled formats: a reduce-scatter of the
  codes, float32 sums, an all-gather of the re-quantized mean
  (:func:`decentral_jax.comm.compress.mean_compressed`, ``2 (n - 1) / n x
  payload``). Equal on every worker.
  """
  mean = (compress.gather_mean_compressed if compressor.format == "topk"
          else compress.mean_compressed)
  return mean(list(leaves), axis_name, compressor=compressor)


def compressed_pseudo_gradient(coding: Coding, v: PyTree, error: PyTree,
                               axis_name) -> tuple[PyTree, PyTree]:
  r"""``(Delta, new_error)`` of this worker's pseudo-gradient ``v``.

  .. math::
    u_i = \beta e_i + v_i, \quad
    \Delta = \mathrm{mean}_j\, \mathrm{deQ}(Q(u_j)), \quad
    e_i \leftarrow u_i - \mathrm{deQ}(Q(u_i))

  (``u_i = v_i`` and no residual without error feedback; ``beta`` =
  ``coding.error_decay``; the mean by :func:`compressed_mean`, which for
  the scaled formats re-quantizes the mean once more). With ``beta = 1``
  the sum of what a worker sent over its syncs differs from the sum of its
  pseudo-gradients by exactly its residual (Karimireddy et al. 2019); with
  ``beta < 1`` and top-k it is SparseLoCo's error-feedback accumulator
  (Sarfi et al., arXiv 2508.15706, Alg. 1).
  """
  target, error = coding.feedback(v, error)
  leaves, treedef = jax.tree.flatten(target)
  return treedef.unflatten(
      compressed_mean(leaves, coding.compressor, axis_name)), error


class CompressedDiLoCoState(NamedTuple):
  """State of :func:`diloco` with a compressor (``theta`` equal on all
  workers; ``error`` per worker)."""
  count: jax.Array  # int32 []: inner steps taken t.
  outer_count: jax.Array  # int32 []: outer steps taken k.
  inner_state: optax.OptState
  theta: optax.Params  # float32 (float64) like params.
  outer_state: optax.OptState
  error: PyTree  # residuals e_i like theta, or () without error feedback.


def _compressed_diloco(inner, period: int, outer, coding: Coding, axis_name
                       ) -> optax.GradientTransformation:
  """:func:`diloco` sending ``Q(theta - x_i)`` (see
  :func:`compressed_pseudo_gradient`)."""

  def init_fn(params):
    gossip.check_float_leaves(params, "diloco")
    theta = jax.tree.map(lambda p: jnp.asarray(p, _global_dtype(p)), params)
    zero = jnp.zeros([], jnp.int32)
    return CompressedDiLoCoState(zero, zero, inner.init(params), theta,
                                 outer.init(theta), coding.init_error(theta))

  def sync(operand):
    x, theta, outer_state, k, error = operand
    v = jax.tree.map(lambda t, a: t - a.astype(t.dtype), theta, x)
    pseudo_grad, error = compressed_pseudo_gradient(coding, v, error,
                                                    axis_name)
    step, outer_state = outer.update(pseudo_grad, outer_state, theta)
    theta = optax.apply_updates(theta, step)
    x = jax.tree.map(lambda t, a: t.astype(a.dtype), theta, x)
    return x, theta, outer_state, optax.safe_increment(k), error

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "diloco")
    count = optax.safe_increment(state.count)
    x, theta, outer_state, k, error = gossip.every(
        period, count % period == 0, sync, lambda o: o,
        (x, state.theta, state.outer_state, state.outer_count, state.error))
    return _delta(x, params), CompressedDiLoCoState(
        count, k, inner_state, theta, outer_state, error)

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------
# Streaming DiLoCo.
# --------------------------------------------------------------------------


def default_fragments(params: PyTree, num_fragments: int) -> PyTree:
  """Fragment id of every leaf: consecutive leaves, balanced by size.

  Leaves are taken in ``jax.tree.leaves`` order (for Flax models: by module
  name, so roughly by layer) and cut into ``num_fragments`` contiguous runs
  of about equal parameter count; each run has at least one leaf.

  Returns:
    A pytree of Python ints in ``[0, num_fragments)`` like ``params``.

  Raises:
    ValueError: ``num_fragments`` not an int, or more fragments than leaves.
  """
  leaves, treedef = jax.tree.flatten(params)
  p = checks.check_int("num_fragments", num_fragments, minimum=1)
  if p > len(leaves):
    raise ValueError(f"num_fragments={num_fragments} must be in [1, "
                     f"{len(leaves)}] (the number of parameter leaves).")
  sizes = np.array([max(int(np.prod(np.shape(x))), 1) for x in leaves], float)
  cum = np.cumsum(sizes)
  ids, start = [], 0
  for frag in range(p):
    if frag == p - 1:
      end = len(leaves)
    else:  # up to the leaf that reaches (frag + 1) / P of the parameters
      end = int(np.searchsorted(cum, (frag + 1) * cum[-1] / p)) + 1
      end = min(max(end, start + 1), len(leaves) - (p - 1 - frag))
    ids += [frag] * (end - start)
    start = end
  return jax.tree.unflatten(treedef, ids)


def check_fragments(fragments: PyTree, params: PyTree,
                    num_fragments: int) -> list[int]:
  """Validates a fragment assignment; returns the flat list of ids.

  Raises:
    ValueError: the structure differs from ``params``, an id is not an int
      in ``[0, num_fragments)`` (the message names its leaf), or a fragment
      has no leaf.
  """
  num_fragments = checks.check_int("num_fragments", num_fragments, minimum=1)
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  try:
    ids = treedef.flatten_up_to(fragments)
  except (ValueError, TypeError) as e:
    raise ValueError(f"fragments must have the structure of the parameters "
                     f"(one int per leaf): {e}") from None
  ids = [checks.check_int(f"fragments{jax.tree_util.keystr(path)}", i,
                          minimum=0, maximum=num_fragments - 1)
         for (path, _), i in zip(paths, ids)]
  empty = sorted(set(range(num_fragments)) - set(ids))
  if empty:
    raise ValueError(f"fragments {empty} have no parameter leaf; every "
                     "fragment needs at least one (lower num_fragments).")
  return ids


class StreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco` (all equal on every worker except
  ``inner_state``)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  theta: optax.Params  # global parameters (float32), every fragment.
  outer_states: tuple  # one outer state per fragment (over its leaves).
  # Per fragment, what was sent and awaits its merge: the parameters x (or,
  # with comm_dtype, the pseudo-gradients theta - x), like theta.
  snapshot: optax.Params


def streaming_diloco(inner: optax.GradientTransformation, sync_every: int, *,
                     num_fragments: int = 1, fragments: PyTree = None,
                     overlap_steps: int = 0, merge_alpha: float = 0.0,
                     outer: optax.GradientTransformation | None = None,
                     comm_dtype=None,
                     axis_name: str = "workers",
                     overlap: str = "none", latency: int = 1,
                     trickle: bool | None = None,
                     compressor: compress.Compressor | None = None,
                     error_feedback: bool = False, error_decay: float = 1.0
                     ) -> optax.GradientTransformation:
  r"""Streaming DiLoCo: fragments synchronised in turn, overlapped, merged.

  Fragment ``p`` (offset ``o_p = p H // P``) is sent at the steps with
  ``t % H == o_p % H`` (``t >= 1``) and merged ``tau`` steps later:

  .. math::
    \text{send } (t):&\ s_{i,p} = x_{i,p} \quad (\text{kept in the state}) \\
    \text{merge } (t + \tau):&\ \Delta_p = \theta_p - \tfrac1n \textstyle\sum_j s_{j,p},
      \ \theta_p \leftarrow \theta_p + \mathrm{outer}_p(\Delta_p),
      \ x_{i,p} \leftarrow \alpha x_{i,p} + (1-\alpha)\theta_p

  where ``x_{i,p}`` at the merge already includes the ``tau`` inner steps
  since the send. The mean of the pseudo-gradients is one all-reduce per
  merge; with ``comm_dtype`` the state holds the pseudo-gradient
  ``theta_p - x_{i,p}`` instead (small values, better suited to a narrow
  dtype), which is sent in that dtype and summed in float32 (an all-to-all of ``1/n`` chunks, a float32 sum, and an
  all-gather of the result in ``comm_dtype``: the bytes of an all-reduce in
  ``comm_dtype``).

  ``overlap="delayed"`` or ``"eager"`` (with ``tau = 0``) gives each
  fragment the outer step of :func:`diloco` with that overlap, on its own
  rounds (sync ``k`` of fragment ``p`` at ``t = o_p + k H``, or ``k H``
  for ``o_p = 0``), merged with ``alpha``; with ``trickle`` every inner
  step reduces one ``1/H`` slice of every fragment's pending
  pseudo-gradients (see :mod:`decentral_jax.optim.outer_overlap`).

  ``compressor`` (not with ``comm_dtype`` or overlap): the state holds the
  pseudo-gradient ``theta_p - x_{i,p}`` (plus ``beta`` times the residual
  with error feedback, the residual updated at the send), and the merge
  averages it with :func:`compressed_mean`, as :func:`diloco` does
  (:func:`compressed_pseudo_gradient`); state
  :class:`CompressedStreamingDiLoCoState`. The identity compressor changes
  nothing.

  Args:
    inner: worker-local optax transform.
    sync_every: ``H >= 1``, the sync period of every fragment.
    num_fragments: ``P``, with ``1 <= P <= H`` and at most the number of
      leaves.
    fragments: optional pytree of ints (fragment id per leaf); default
      :func:`default_fragments`.
    overlap_steps: ``tau``, with ``0 <= tau`` and ``tau * P < H``.
    merge_alpha: ``alpha`` in ``[0, 1]`` (0: take the outer result).
    outer: outer optax transform per fragment (default Nesterov, lr 0.7,
      momentum 0.9).
    comm_dtype: optional floating dtype of the pseudo-gradients on the wire.
    axis_name: the worker mesh axis (a single name).
    overlap, latency, trickle: as for :func:`diloco`, per fragment.
    compressor, error_feedback, error_decay: as for :func:`diloco`, per
      fragment.

  Returns:
    An ``optax.GradientTransformation`` with :class:`StreamingDiLoCoState`
    (:class:`OverlapStreamingDiLoCoState` with overlap).

  Raises:
    ValueError: at construction, any argument outside the ranges above
      (``num_fragments`` or ``overlap_steps`` not an int, e.g. 2.5;
      ``merge_alpha`` an array: under ``optax.inject_hyperparams`` it must
      be listed in ``static_args``), ``inner`` or ``outer`` not an optax
      transform, ``comm_dtype`` not None or floating, ``overlap_steps > 0``
      with overlap, bad compression arguments or a compressor with
      ``comm_dtype`` or overlap (see :func:`check_compression`); in ``init`` and ``update``, a fragment assignment that
      misses a fragment or a leaf, an integer or bool parameter leaf,
      ``params`` not passed.

  References:
    Douillard et al., Streaming DiLoCo with overlapping communication,
    arXiv 2501.18512 (Alg. 1, 2).
  """
  period = _check_common(inner, sync_every, outer)
  p_count, tau, alpha = _check_streaming(period, num_fragments, overlap_steps,
                                         merge_alpha)
  checks.check_float_dtype("comm_dtype", comm_dtype)
  coding = check_compression(compressor, error_feedback, error_decay)
  if coding is not None:
    _refuse_with_compression(comm_dtype=comm_dtype, overlap=overlap)
  outer = default_outer_optimizer() if outer is None else outer
  offsets = [(p * period // p_count) % period for p in range(p_count)]

  def ids_of(params):
    frag = (default_fragments(params, p_count) if fragments is None
            else fragments)
    return check_fragments(frag, params, p_count)

  overlap, latency, trickle = outer_overlap.check_overlap(overlap, latency,
                                                          trickle)
  if overlap != "none":
    if tau:
      raise ValueError(
          f"overlap_steps={tau} and overlap={overlap!r} both hide the "
          "reduction behind inner steps; use one (overlap_steps=0).")
    reduction = (outer_overlap.mean_reduction(axis_name) if comm_dtype is None
                 else _low_precision_reduction(comm_dtype, axis_name))
    engine = outer_overlap.OuterOverlap(overlap, latency, trickle, period,
                                        outer, *reduction, merge_alpha=alpha)
    return _overlapped_streaming(inner, outer, engine, ids_of, offsets)

  def init_fn(params):
    gossip.check_float_leaves(params, "streaming_diloco")
    ids = ids_of(params)
    theta = jax.tree.map(lambda p: jnp.asarray(p, _global_dtype(p)), params)
    flat = jax.tree.leaves(theta)
    outer_states = tuple(
        outer.init([x for x, i in zip(flat, ids) if i == p])
        for p in range(p_count))
    snapshot = optax.tree.zeros_like(theta)
    if coding is not None:
      return CompressedStreamingDiLoCoState(
          jnp.zeros([], jnp.int32), inner.init(params), theta, outer_states,
          snapshot, coding.init_error(theta))
    return StreamingDiLoCoState(jnp.zeros([], jnp.int32), inner.init(params),
                                theta, outer_states, snapshot)

  def pseudo_gradient(ts, ss):
    if coding is not None:  # ss holds beta e + theta - x, sent compressed
      return compressed_mean(ss, coding.compressor, axis_name)
    if comm_dtype is None:  # ss holds parameters: theta - mean(x)
      return [t - m for t, m in zip(ts, gossip.mean(ss, axis_name))]
    return _mean_low_precision(ss, comm_dtype, axis_name)

  fragment = _FragmentSync(period, tau, alpha, comm_dtype, outer,
                           pseudo_gradient, coding)

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "streaming_diloco")
    ids = ids_of(params)
    count = optax.safe_increment(state.count)
    x_flat, treedef = jax.tree.flatten(x)
    theta = jax.tree.leaves(state.theta)
    snap = jax.tree.leaves(state.snapshot)
    feedback = coding is not None and coding.error_feedback
    err = jax.tree.leaves(state.error) if feedback else None
    outer_states = list(state.outer_states)
    for p in range(p_count):
      idx = [j for j, i in enumerate(ids) if i == p]
      xs, ts, ss, outer_states[p], es = fragment.step(
          count, offsets[p], [x_flat[j] for j in idx], [theta[j] for j in idx],
          [snap[j] for j in idx], outer_states[p],
          [err[j] for j in idx] if feedback else ())
      for j, a, t, s in zip(idx, xs, ts, ss):
        x_flat[j], theta[j], snap[j] = a, t, s
      for j, e in zip(idx, es):
        err[j] = e
    fields = (count, inner_state, jax.tree.unflatten(treedef, theta),
              tuple(outer_states), jax.tree.unflatten(treedef, snap))
    if coding is None:
      new_state = StreamingDiLoCoState(*fields)
    else:
      new_state = CompressedStreamingDiLoCoState(
          *fields, jax.tree.unflatten(treedef, err) if feedback else ())
    return _delta(jax.tree.unflatten(treedef, x_flat), params), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _check_streaming(period: int, num_fragments, overlap_steps,
                     merge_alpha) -> tuple[int, int, float]:
  """``(P, tau, alpha)`` of :func:`streaming_diloco`, checked against ``H``."""
  p_count = checks.check_int("num_fragments", num_fragments, minimum=1)
  tau = checks.check_int("overlap_steps", overlap_steps, minimum=0)
  if tau * p_count >= period:
    raise ValueError(
        f"overlap_steps={overlap_steps!r} must be an integer with 0 <= tau "
        f"and tau * num_fragments < sync_every ({p_count} * tau < {period}), "
        "so a fragment is merged before the next one is sent.")
  if p_count > period:
    raise ValueError(f"num_fragments={num_fragments!r} must be in [1, "
                     f"sync_every={period}].")
  return p_count, tau, checks.check_probability("merge_alpha", merge_alpha)


class _FragmentSync(NamedTuple):
  """Send and merge of one Streaming DiLoCo fragment (see :func:`streaming_diloco`)."""
  period: int
  tau: int
  alpha: float
  comm_dtype: Any
  outer: optax.GradientTransformation
  pseudo_gradient: Any  # (theta leaves, sent leaves) -> Delta leaves
  coding: Any = None  # Coding of a compressed send, or None

  def step(self, count, offset, xs, ts, ss, o_state, es=()):
    """One inner step's send (at ``t % H == o_p``) and merge (``tau`` later).

    Returns the fragment's ``(x, theta, snapshot, outer state, residuals)``
    leaves (residuals ``es``: error feedback's, updated at the send).
    """
    period, tau, alpha = self.period, self.tau, self.alpha
    sent = (count % period == offset) & (count >= max(offset, 1))
    merged = (count % period == (offset + tau) % period) & (
        count >= max(offset, 1) + tau)
    if self.comm_dtype is None and self.coding is None:
      kept = [a.astype(t.dtype) for t, a in zip(ts, xs)]
    else:
      kept = [t - a.astype(t.dtype) for t, a in zip(ts, xs)]
    if self.coding is not None and self.coding.error_feedback:
      kept, new_es = self.coding.feedback(kept, es)
      es = lax.cond(sent, lambda new, old: new, lambda new, old: old,
                    new_es, es)
    # Send: keep what this worker sends (no communication yet).
    ss = lax.cond(sent, lambda new, old: new, lambda new, old: old, kept, ss)

    def merge(operand):
      xs, ts, ss, o_state = operand
      step, o_state = self.outer.update(self.pseudo_gradient(ts, ss), o_state,
                                        ts)
      ts = optax.apply_updates(ts, step)
      xs = [(alpha * a.astype(t.dtype) + (1.0 - alpha) * t).astype(a.dtype)
            for a, t in zip(xs, ts)]
      return xs, ts, ss, o_state

    return (*gossip.every(period, merged, merge, lambda o: o,
                          (xs, ts, ss, o_state)), es)


class CompressedStreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco` with a compressor: the fields of
  :class:`StreamingDiLoCoState` (``snapshot`` holding what is sent,
  ``beta e + theta - x``), then the residuals (``()`` without error
  feedback)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  theta: optax.Params
  outer_states: tuple
  snapshot: optax.Params
  error: PyTree  # e_i like theta, or ()


class OverlapStreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco` with ``overlap`` ``"delayed"`` or
  ``"eager"`` (per fragment: outer state, outer steps taken, pseudo-gradients
  in flight; ``theta`` per worker with ``"eager"``)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  theta: optax.Params  # float32 (float64) like params, every fragment.
  outer_states: tuple  # per fragment.
  outer_counts: tuple  # per fragment, int32 []: its outer steps taken.
  in_flight: tuple  # per fragment, outer_overlap.OverlapBuffers.


def _overlapped_streaming(inner, outer, engine: outer_overlap.OuterOverlap,
                          ids_of, offsets) -> optax.GradientTransformation:
  """:func:`streaming_diloco` with a delayed or eager outer step per fragment.

  Fragment ``p`` runs ``engine`` on its leaves with its own step count
  ``t - o_p`` (``+ H`` for ``o_p > 0``), so that its syncs fall at ``t %
  H == o_p`` from ``t = o_p`` on, as without overlap.
  """
  period = engine.period

  def parts(flat, ids):
    return [[flat[j] for j, i in enumerate(ids) if i == p]
            for p in range(len(offsets))]

  def init_fn(params):
    gossip.check_float_leaves(params, "streaming_diloco")
    theta = jax.tree.map(lambda p: jnp.asarray(p, _global_dtype(p)), params)
    frags = parts(jax.tree.leaves(theta), ids_of(params))
    zero = jnp.zeros([], jnp.int32)
    return OverlapStreamingDiLoCoState(
        zero, inner.init(params), theta, tuple(outer.init(t) for t in frags),
        (zero,) * len(offsets), tuple(engine.init(t) for t in frags))

  def update_fn(updates, state, params=None):
    x, inner_state = _inner_step(inner, updates, state.inner_state, params,
                                 "streaming_diloco")
    ids = ids_of(params)
    count = optax.safe_increment(state.count)
    x_flat, treedef = jax.tree.flatten(x)
    theta = jax.tree.leaves(state.theta)
    outer_states, counts = list(state.outer_states), list(state.outer_counts)
    in_flight = list(state.in_flight)
    for p, (xs, ts) in enumerate(zip(parts(x_flat, ids), parts(theta, ids))):
      local = count - offsets[p] + (period if offsets[p] else 0)
      xs, ts, outer_states[p], counts[p], in_flight[p] = engine.step(
          local, xs, ts, outer_states[p], counts[p], in_flight[p])
      for j, a, t in zip([j for j, i in enumerate(ids) if i == p], xs, ts):
        x_flat[j], theta[j] = a, t
    new_state = OverlapStreamingDiLoCoState(
        count, inner_state, jax.tree.unflatten(treedef, theta),
        tuple(outer_states), tuple(counts), tuple(in_flight))
    return _delta(jax.tree.unflatten(treedef, x_flat), params), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _low_precision_reduction(comm_dtype, axis_name):
  """``(reduce, own_weight)`` of the mean with ``comm_dtype`` on the wire."""

  def reduce(a, j):
    del j
    return _mean_low_precision([a], comm_dtype, axis_name)[0]

  return reduce, outer_overlap.mean_reduction(axis_name)[1]


def _mean_low_precision(leaves: Sequence[jax.Array], comm_dtype,
                        axis_name: str) -> list[jax.Array]:
  """Mean over workers with ``comm_dtype`` on the wire, summed in float32.

  A reduce-scatter written as an all-to-all of ``1/n`` chunks (each worker
  sums its chunk of everyone's values in the accumulation dtype), then an
  all-gather of the averaged chunks in ``comm_dtype``.
  """
  n = collectives.size(axis_name)
  out = []
  for x in leaves:
    acc = _global_dtype(x)
    flat = x.reshape(-1)
    pad = (-flat.size) % n
    if pad:
      flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    chunks = flat.astype(comm_dtype).reshape(n, -1)
    mine = collectives.all_to_all(chunks, axis_name)
    part = jnp.sum(mine.astype(acc), axis=0) / n
    full = collectives.all_gather(part.astype(comm_dtype),
                                  axis_name).reshape(-1)
    full = full[:x.size].astype(acc).reshape(x.shape)
    out.append(gossip.match_varying(full, x))
  return out


def global_params(opt_state: optax.OptState) -> PyTree | None:
  """``theta`` of the first DiLoCo-style state found in ``opt_state``, else None.

  The parameters to evaluate as "the averaged model" of a DiLoCo run (with
  eager overlap, this worker's ``theta_i``: the model is their mean).
  """
  found = transforms.find_states(opt_state, (DiLoCoState, OverlapDiLoCoState,
                                        CompressedDiLoCoState,
                                        StreamingDiLoCoState,
                                        CompressedStreamingDiLoCoState,
                                        OverlapStreamingDiLoCoState))
  return found[0].theta if found else None
