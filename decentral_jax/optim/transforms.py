"""Decentralized optimizers as optax transforms: DAdam, AccumAdam(W), D-SGD.

All transforms that communicate must be updated inside ``jax.shard_map`` over
the worker axis (one worker per device), with worker-local ``grads``,
``state`` and ``params`` (no leading worker dimension). Only parameters are
communicated; gradients, moments and accumulators stay local.

Compositions (``lr`` may be an optax schedule)::

  # All-Reduce AdamW (the baseline)
  optax.chain(all_reduce_gradients("workers"), optax.adamw(lr))
  # D-SGD / D-PSGD: x_{k+1} = W_k x_k - lr g(x_k)
  optax.chain(optax.sgd(lr, momentum), gossip_mixing(topo, "workers"))
  # DAdam (accum_steps=1) / AccumAdamW (accum_steps>1)
  decentralized_adamw(lr, topo, accum_steps=8)

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Alg. 1 DAdam, Alg. 4 AccumAdam; ``decent-dp`` 0.2.3,
  ``decent_dp/optim.py`` and ``ddp.py``).
  Lian et al., `Can Decentralized Algorithms Outperform Centralized
  Algorithms? <https://arxiv.org/abs/1705.09056>`_, NeurIPS 2017 (D-PSGD).

Precision: parameters and gradients may be float64, float32, bfloat16 or
float16. Hyperparameters, bias corrections, the learning rate and the
arithmetic of the moments are in float32 (float64 when the inputs are
float64); moments are stored in ``mu_dtype``/``nu_dtype`` (default: the
parameter dtype) and updates come back in the gradient dtype, so
``optax.apply_updates`` keeps the parameter dtype. Under
``optax.inject_hyperparams`` with low-precision parameters pass
``hyperparam_dtype=jnp.float32`` (optax casts hyperparameters to the
parameter dtype otherwise, and ``b2=0.999`` is 1.0 in bfloat16; this module
rejects such hyperparameters), and list callable or dtype arguments
(a callable ``mask``; ``mu_dtype``, ``nu_dtype``, ``comm_dtype`` given as
dtype classes such as ``jnp.bfloat16``) in ``static_args``: optax takes
callables for schedules (this module rejects what it makes of them)::

  optax.inject_hyperparams(decentralized_adamw, static_args=("mask",),
                           hyperparam_dtype=jnp.float32)(
      learning_rate=schedule, topology=topo, mask=my_mask, accum_steps=4)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import faults
from decentral_jax.comm import gossip
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.optim import arguments
from decentral_jax.optim import precision
from decentral_jax.optim.accum_adam import ScaleByAccumAdamState
from decentral_jax.optim.accum_adam import horizon_matched_betas
from decentral_jax.optim.accum_adam import scale_by_accum_adam

__all__ = ["DecentralizedState", "GossipMixingState", "ScaleByAccumAdamState",
           "all_reduce_gradients", "decentralized", "decentralized_adamw", "default_weight_decay_mask",
           "find_states", "gossip_mixing", "horizon_matched_betas",
           "local_adamw", "round_count", "round_step", "scale_by_accum_adam"]

PyTree = Any


# --------------------------------------------------------------------------
# Mixing.
# --------------------------------------------------------------------------


class GossipMixingState(NamedTuple):
  """State of :func:`gossip_mixing`."""
  count: jax.Array  # shape=(), dtype=int32: step k, selects round k % period.


def gossip_mixing(topology: topology_lib.Topology,
                  axis_name: gossip.AxisName = "workers", *,
                  comm_dtype=None,
                  bucket_bytes: int | None = None
                  ) -> optax.GradientTransformation:
  r"""Chain element adding the gossip correction ``W_k x_k - x_k`` to updates.

  Placed last in an ``optax.chain`` whose earlier elements produce a local
  update ``u_k``, the result applied by ``optax.apply_updates`` is

  .. math:: x_{k+1} = W_k x_k + u_k

  i.e. D-PSGD (Lian et al. 2017) when ``u_k = -lr g(x_k)``. The collective
  depends only on ``x_k``, so it can overlap with the forward/backward pass.
  Weight decay in earlier chain elements sees ``x_k``, not ``W_k x_k``; use
  :func:`decentralized` to apply the local step at the mixed point.

  Args:
    topology: mixing schedule; round ``k % period`` at step ``k``.
    axis_name: worker mesh axis (or ``(nodes, local)``).
    comm_dtype: optional dtype in which parameters are sent.
    bucket_bytes: largest gossip bucket in bytes (see
      :func:`decentral_jax.comm.gossip.check_bucket_bytes`); results are bit-identical.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`GossipMixingState`; must be updated inside ``jax.shard_map`` over
    ``axis_name`` with ``params`` given. Applied leaf-wise over any pytree of
    floating leaves: ``u + (W x - x)`` is formed in float32 (float64 stays
    float64) and returned with the shapes and dtypes of ``updates``.

  Raises:
    ValueError: ``topology`` not a Topology, ``comm_dtype`` not None or a
      floating dtype, or ``bucket_bytes`` not None or an integer >= 0 (at
      construction); ``params`` not passed to ``update``; errors of
      :func:`decentral_jax.comm.gossip.mix` (mesh axis size, non-floating leaves).
  """
  collectives.check_axis_name(axis_name)
  gossip.check_topology(topology)
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)

  def init_fn(params):
    del params
    return GossipMixingState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, round_index=None, **unused):
    del unused
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format("gossip_mixing"))
    mixed = gossip.mix(params, topology, round_step(state, round_index), axis_name,
                       comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    updates = jax.tree.map(_add_correction, updates, mixed, params)
    return updates, GossipMixingState(optax.safe_increment(state.count))

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)


def _add_correction(u, m, p):
  """``u + (m - p)`` in float32 (or wider), returned in ``u``'s dtype.

  For float32/float64 leaves these are the plain-dtype operations; for
  bfloat16/float16 the sum is rounded once instead of twice.
  """
  dt = precision.compute_dtype(u.dtype, m.dtype, p.dtype)
  return (u.astype(dt) + (m.astype(dt) - p.astype(dt))).astype(u.dtype)


class DecentralizedState(NamedTuple):
  """State of :func:`decentralized`."""
  count: jax.Array  # shape=(), dtype=int32: step k, selects round k % period.
  inner_state: optax.OptState  # the local optimizer's state (worker-local).


def decentralized(inner: optax.GradientTransformation,
                  topology: topology_lib.Topology,
                  axis_name: gossip.AxisName = "workers", *,
                  mix_after_update: bool = False,
                  comm_dtype=None,
                  gossip_every: int = 1,
                  bucket_bytes: int | None = None
                  ) -> optax.GradientTransformation:
  r"""Wraps a local optimizer so that it steps from the gossip-mixed point.

  Default ("adapt-while-combine", the paper's overlapped form):

  .. math::
    x_{k+1/2} = W_k x_k, \qquad
    x_{k+1} = x_{k+1/2} + \mathrm{inner}(g(x_k);\ \text{params}=x_{k+1/2})

  so parameter-dependent parts of ``inner`` (decoupled weight decay) act on
  ``W_k x_k``, exactly as ``decent-dp``. The gradient is taken at ``x_k`` by
  the caller, and the collective depends only on ``x_k``, so XLA may run it
  concurrently with the forward/backward pass. With
  ``mix_after_update=True`` ("adapt-then-combine"):
  ``x_{k+1} = W_k (x_k + inner(g(x_k); x_k))``.

  Local steps (local D-SGD / DAdam): with ``gossip_every = tau > 1`` the
  workers mix only at steps ``k`` with ``k % tau == 0``, using round
  ``k // tau`` of the schedule, and take plain local steps in between
  (``W = I``); ``tau = 1`` is the recursion above, bit for bit. The mixing
  then sits in a ``lax.cond`` and the round is chosen in-graph, unless
  ``round_index=r`` gives the step statically (any ``r`` equal to the step
  modulo ``tau x period``): steps with ``r % tau != 0`` compile no
  collective, the others round ``r // tau`` alone (the same values).

  Round selection: by default round ``count % period`` is chosen in-graph
  with ``lax.switch`` (one compile for the whole schedule). Passing the extra
  argument ``round_index=r`` (a Python int, e.g. a ``static_argnames`` of the
  jitted step, usually ``step % period``) compiles that round alone, without
  a conditional, which lets XLA's scheduler overlap the collective with the
  forward/backward pass on accelerators (one compile per distinct round).
  ``optax.chain`` forwards ``round_index`` to every element.

  Slow and failing workers: the extra arguments ``alive``, ``working`` and
  ``rejoining`` (bool [n], equal on all workers; from a
  :class:`decentral_jax.comm.fault_schedule.FaultSchedule`) restrict the
  round to the live workers (:func:`decentral_jax.comm.faults.live_mix`:
  ``W'`` with identity rows for the dead), let only working workers take
  the inner step (a dead worker's parameters and inner state stay bit for
  bit, a straggler only mixes), and give a rejoining worker the mean of its
  live neighbours and the group's step counters. Without ``alive`` the
  update is the one above, bit for bit; with every worker alive and
  working it computes the same sums, which XLA may fuse, and so round, a
  little differently (within an ulp or two: run healthy steps without the
  masks, as the runner does, for the exact trajectory).

  The returned update is ``x_{k+1} - x_k``, so ``optax.apply_updates`` stays
  the only place where parameters change and the wrapper composes with
  ``optax.chain`` (e.g. after ``optax.clip_by_global_norm``). It is formed in
  the parameter dtype from ``x_{k+1}`` rounded to that dtype, so with
  bfloat16/float16 parameters ``apply_updates`` gives back that rounded
  ``x_{k+1}`` exactly wherever ``x_k`` and ``x_{k+1}`` are within a factor 2
  of each other (same sign), and to half an ulp of ``x_{k+1} - x_k``
  elsewhere.

  Args:
    inner: worker-local optax transform producing the local update.
    topology: mixing schedule; round ``k % period`` at step ``k``.
    axis_name: worker mesh axis (or ``(nodes, local)``).
    mix_after_update: mix after the local update instead of before.
    comm_dtype: optional dtype in which parameters are sent (e.g. bfloat16).
    gossip_every: the communication period ``tau >= 1`` in steps.
    bucket_bytes: largest gossip bucket in bytes: None (default) for
      :data:`decentral_jax.comm.gossip.DEFAULT_BUCKET_BYTES` (0: per leaf,
      faster on XLA:CPU), 0 for one collective per leaf (see :func:`decentral_jax.comm.gossip.check_bucket_bytes`).
      Results are bit-identical either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`DecentralizedState`; ``update`` must run inside
    ``jax.shard_map`` over ``axis_name``. Applied leaf-wise over any pytree
    of floating leaves; updates have the shapes and dtypes of ``params``.

  Raises:
    ValueError: ``inner`` not an optax transform, ``topology`` not a
      Topology, ``mix_after_update`` not a bool, ``comm_dtype`` not None or
      a floating dtype, ``gossip_every`` not an integer >= 1, or
      ``bucket_bytes`` not None or an integer >= 0 (at construction);
      ``params`` not passed to ``update``; ``round_index`` with a traced
      ``gossip_every``; errors of :func:`decentral_jax.comm.gossip.mix`
      (mesh axis size, non-floating leaves).
  """
  collectives.check_axis_name(axis_name)
  arguments.check_transform("inner", inner)
  gossip.check_topology(topology)
  checks.check_bool("mix_after_update", mix_after_update)
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)
  # A traced gossip_every (optax.inject_hyperparams) is allowed; it always
  # takes the conditional path.
  tau = arguments.check_period("gossip_every", gossip_every)
  if isinstance(tau, jax.Array):
    tau = jnp.asarray(tau).astype(jnp.int32)
  mix = _periodic_mix(topology, axis_name, tau, comm_dtype, bucket_bytes)

  def init_fn(params):
    return DecentralizedState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None, *, round_index=None,
                alive=None, working=None, rejoining=None, **extra_args):
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format("decentralized"))
    extra = extra_args if extra_args else {}
    if alive is not None:
      return _live_update(inner, topology, axis_name, mix, mix_after_update,
                          (updates, state, params, round_index, extra),
                          (alive, working, rejoining))
    if mix_after_update:
      local, inner_state = inner.update(updates, state.inner_state, params,
                                        **extra)
      stepped = optax.apply_updates(params, local)
      target = mix(stepped, state, round_index)
    else:
      mixed = mix(params, state, round_index)
      local, inner_state = inner.update(updates, state.inner_state, mixed,
                                        **extra)
      target = optax.apply_updates(mixed, local)
    return _difference(target, params), DecentralizedState(
        optax.safe_increment(state.count), inner_state)

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)


def _periodic_mix(topology, axis_name, tau, comm_dtype, bucket_bytes):
  """``mix(tree, state, round_index, alive=None)`` of :func:`decentralized`.

  ``tau`` is the gossip period: a Python int (1: every step, round
  ``round_index`` or ``state.count``) or an int32 array (traced under
  ``optax.inject_hyperparams``, always the conditional path). With a live
  mask ``alive`` the round is restricted to the live workers
  (:func:`decentral_jax.comm.faults.live_mix`).
  """
  every_step = isinstance(tau, int) and tau == 1

  def one(tree, step, alive):
    if alive is None:
      return gossip.mix(tree, topology, step, axis_name,
                        comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    return faults.live_mix(tree, topology, step, alive, axis_name,
                           comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)

  def mix(tree, state, round_index, alive=None):
    if every_step:
      return one(tree, round_step(state, round_index), alive)
    if round_index is not None:
      # Static: the step's phase in the cycle of tau * period steps.
      r = round_step(state, round_index)
      if not isinstance(tau, int):
        raise ValueError("decentralized: round_index needs a Python int "
                         "gossip_every, not a traced one.")
      return one(tree, r // tau, alive) if r % tau == 0 else tree
    return gossip.every(
        tau, state.count % tau == 0,
        lambda t: one(t, state.count // tau, alive), lambda t: t, tree)

  return mix


def _live_update(inner, topology, axis_name, mix, mix_after_update, args,
                 masks):
  """:func:`decentralized`'s update over live workers (``alive`` given).

  The round is restricted to the live workers that are not rejoining; a
  worker takes its inner step only if ``working`` (default: alive) and not
  rejoining (its gradient was taken at stale parameters): a dead worker
  keeps its parameters and inner state, a straggler only mixes. A
  rejoining worker then takes the mean of its live neighbours in this
  round (:func:`decentral_jax.comm.faults.neighbour_mean`) and the
  integer leaves of its inner state (step counters) from the first live
  worker.
  """
  updates, state, params, round_index, extra = args
  alive, working, rejoining = masks
  n = topology.n_workers
  alive = faults.check_mask(alive, n, "alive")
  rejoining = (jnp.zeros(n, bool) if rejoining is None
               else faults.check_mask(rejoining, n, "rejoining"))
  working = (alive if working is None
             else faults.check_mask(working, n, "working"))
  live = alive & ~rejoining
  steps = (working & live)[collectives.index(axis_name)]
  x0, s0 = params, state.inner_state
  if mix_after_update:
    local, s1 = inner.update(updates, s0, x0, **extra)
    x0 = _where(steps, optax.apply_updates(x0, local), x0)
    target = mix(x0, state, round_index, live)
  else:
    mixed = mix(x0, state, round_index, live)
    local, s1 = inner.update(updates, s0, mixed, **extra)
    target = _where(steps, optax.apply_updates(mixed, local), mixed)
  inner_state = _where(steps, s1, s0)
  target = faults.neighbour_mean(target, topology,
                                 round_step(state, round_index), alive,
                                 rejoining, axis_name)
  take = jnp.asarray(rejoining)[collectives.index(axis_name)] & jnp.any(live)
  inner_state = gossip.every(
      None, jnp.any(rejoining), lambda s: _where(take, faults.from_worker(
          s, jnp.argmax(live), axis_name, only_int=True), s),
      lambda s: s, inner_state)
  return _difference(target, params), DecentralizedState(
      optax.safe_increment(state.count), inner_state)


def _where(pred, new, old):
  return jax.tree.map(lambda y, x: jnp.where(pred, y, x), new, old)


def _difference(target, params):
  """``target - params`` per leaf, in the parameter dtype.

  ``target`` has the param dtype (``apply_updates`` casts to it). The
  difference of two values of one dtype is correctly rounded in that dtype
  (forming it in float32 and casting gives the same bits), and exact when
  ``t/2 <= p <= 2t`` (Sterbenz), so ``apply_updates(params, difference)``
  returns ``target`` there; elsewhere (a sign change, ``|t - p| ~ |p|``)
  it is off by at most half an ulp of the difference.
  """
  return jax.tree.map(lambda t, p: (t - p).astype(p.dtype), target, params)


def default_weight_decay_mask(params: PyTree) -> PyTree:
  """``True`` for leaves with ``ndim >= 2`` (matrices, kernels), else False.

  Biases, LayerNorm scales and other vectors get no decay, as in nanoGPT
  and the paper's GPT-2 and CNN setups. Pass as ``mask=`` to AdamW (or
  ``mask="ndim>=2"`` to :func:`decentralized_adamw`).

  Returns:
    A pytree of Python bools with the structure of ``params``.
  """
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _resolve_mask(mask):
  """``mask`` of :func:`local_adamw`: ``'ndim>=2'`` or
  :func:`decentral_jax.optim.arguments.weight_decay_mask`'s rule."""
  if isinstance(mask, str):
    if mask.replace(" ", "") != "ndim>=2":
      raise ValueError(f"mask={mask!r}: the only string mask is 'ndim>=2'; "
                       "pass None (decay all), a pytree of bools or a callable.")
    return default_weight_decay_mask
  return arguments.weight_decay_mask(mask)


def decentralized_adamw(learning_rate: optax.ScalarOrSchedule,
                        topology: topology_lib.Topology, *,
                        b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        weight_decay: float = 0.0,
                        mask: Any = "ndim>=2",
                        accum_steps: int = 1,
                        axis_name: gossip.AxisName = "workers",
                        mix_after_update: bool = False,
                        comm_dtype=None, mu_dtype=None,
                        nu_dtype=None,
                        gossip_every: int = 1,
                        bucket_bytes: int | None = None,
                        beta_convention: str = "per_window"
                        ) -> optax.GradientTransformation:
  r"""DAdam (``accum_steps=1``) / AccumAdamW (``accum_steps>1``).

  .. math::
    x_{k+1} = (1 - \gamma_k \lambda\, \mathrm{mask}) \odot (W_k x_k)
      - \gamma_k\, d_k(g(x_k))

  with ``d_k`` the Adam direction (``accum_steps=1``) or the AccumAdam
  direction of :func:`scale_by_accum_adam`, computed from each worker's own
  gradient and moments. Reproduces ``decent-dp`` 0.2.3 to float64 precision.

  The local step (direction, weight decay, learning rate) is computed in
  float32 for bfloat16/float16 parameters (float64 stays float64) and
  rounded once, when added to ``W_k x_k``; moments are stored in
  ``mu_dtype``/``nu_dtype`` (default: the parameter dtype).

  Args:
    learning_rate: float or optax schedule ``step -> lr`` (``gamma_k``).
    topology: mixing schedule (:mod:`decentral_jax.topology`).
    b1, b2, eps: Adam hyperparameters (eps outside the square root).
    weight_decay: decoupled weight decay ``lambda`` on the mixed parameters.
    mask: which leaves are decayed: ``"ndim>=2"`` (default: matrices and
      kernels, never biases or norm scales), ``None`` (all leaves), a pytree
      of bools with the structure of ``params`` (or a prefix of it), or a
      callable ``params -> bools``; numbers and arrays are refused, not read
      as true/false. The default is a string so
      that ``optax.inject_hyperparams`` keeps it static (it would treat a
      callable as a schedule: list a callable mask in ``static_args``).
    accum_steps: AccumAdam window ``T`` (1 = DAdam).
    axis_name: worker mesh axis (or ``(nodes, local)``).
    mix_after_update: adapt-then-combine instead of the paper's order.
    comm_dtype: optional dtype in which parameters are sent.
    mu_dtype: optional floating dtype of the first moment and accumulator.
    nu_dtype: optional floating dtype of the second moment (use float32
      with float16 parameters, see :func:`scale_by_accum_adam`).
    gossip_every: mix every this many steps (local steps in between; see
      :func:`decentralized`).
    bucket_bytes: largest gossip bucket in bytes; None: the default, 0: one
      collective per leaf (bit-identical; see :func:`decentral_jax.comm.gossip.check_bucket_bytes`).
    beta_convention: AccumAdam's ``"per_window"`` (the paper's) or
      ``"per_step"`` (``b1**T, b2**T`` per window: Adam's horizon in steps;
      see :func:`scale_by_accum_adam`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`DecentralizedState` to update inside ``jax.shard_map``; updates
    have the shapes and dtypes of ``params``.

  Raises:
    ValueError: invalid ``learning_rate`` (not a schedule or a finite
      number >= 0), ``weight_decay`` (negative, NaN or infinite; checked when
      known), ``accum_steps``, ``b1``, ``b2``, ``eps``, ``mask``
      (including a bare bool or array: what ``optax.inject_hyperparams``
      passes for a callable mask without ``static_args``; a leaf that is not
      a bool; at ``init``/``update``, a structure other than ``params``'),
      ``mu_dtype``,
      ``nu_dtype``, ``comm_dtype``, ``bucket_bytes`` or ``beta_convention`` (see
      :func:`scale_by_accum_adam`, :func:`decentralized`).

  References:
    Wang et al. 2025 (arXiv 2410.11998), Alg. 1 and Alg. 4.
  """
  inner = local_adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                      weight_decay=weight_decay, mask=mask,
                      accum_steps=accum_steps, mu_dtype=mu_dtype,
                      nu_dtype=nu_dtype, beta_convention=beta_convention)
  return decentralized(inner, topology, axis_name,
                       mix_after_update=mix_after_update, comm_dtype=comm_dtype,
                       gossip_every=gossip_every, bucket_bytes=bucket_bytes)


def local_adamw(learning_rate, *, b1=0.9, b2=0.999, eps=1e-8,
                weight_decay=0.0, mask="ndim>=2", accum_steps=1,
                mu_dtype=None, nu_dtype=None, beta_convention="per_window"
                ) -> optax.GradientTransformationExtraArgs:
  """The local step ``-lr (d_k + lambda mask params)`` of
  :func:`decentralized_adamw` (arguments and errors as there), computed in
  float32 for low-precision inputs; no communication."""
  arguments.check_learning_rate(learning_rate)
  arguments.check_hyperparameter("weight_decay", weight_decay,
                                      below_one=False, wide=False)
  inner = optax.chain(
      scale_by_accum_adam(b1=b1, b2=b2, eps=eps, accum_steps=accum_steps,
                          mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                          beta_convention=beta_convention),
      optax.add_decayed_weights(weight_decay, _resolve_mask(mask)),
      optax.scale_by_learning_rate(learning_rate),
  )
  return _in_compute_dtype(inner)


def _in_compute_dtype(inner: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on float32 copies of low-precision updates and params.

  Leaves of float32 or wider are passed unchanged (no-op casts), so float32
  and float64 results are those of ``inner`` itself. ``inner``'s state must
  keep its own dtypes (as :func:`scale_by_accum_adam` and optax's stateless
  transforms do); its outputs are float32 for low-precision inputs.
  """

  def cast(tree):
    return jax.tree.map(
        lambda x: jnp.asarray(x, precision.compute_dtype(x.dtype)), tree)

  def update_fn(updates, state, params=None, **extra_args):
    return optax.with_extra_args_support(inner).update(
        cast(updates), state, None if params is None else cast(params),
        **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def all_reduce_gradients(axis_name: gossip.AxisName = "workers"
                         ) -> optax.GradientTransformation:
  """Averages updates (gradients) over all workers with ``lax.pmean``.

  ``optax.chain(all_reduce_gradients("workers"), optax.adamw(lr))`` is the
  All-Reduce data-parallel baseline (paper Alg. 2). Must be updated inside
  ``jax.shard_map`` over ``axis_name``; output shapes/dtypes = input (the
  mean of bfloat16/float16 gradients is reduced by the backend in that
  dtype).
  """
  collectives.check_axis_name(axis_name)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return gossip.mean(updates, axis_name), state

  return optax.GradientTransformation(init_fn, update_fn)


def find_states(opt_state: optax.OptState, types) -> list:
  """Every state of the given NamedTuple ``types`` inside ``opt_state``.

  Searches nested states (``optax.chain``, ``inject_hyperparams``, wrappers)
  in tree order; works on stacked ``[n, ...]`` states too.
  """
  found = []

  def visit(s):
    if isinstance(s, types):
      found.append(s)
      return True
    return False

  jax.tree.map(lambda _: None, opt_state, is_leaf=visit)
  return found


def round_count(opt_state: optax.OptState) -> jax.Array | None:
  """The gossip step counter found in ``opt_state`` (first one), or None."""
  found = find_states(opt_state, (DecentralizedState, GossipMixingState))
  return found[0].count if found else None


def round_step(state, round_index):
  """The step that picks a gossip round: static ``round_index`` or ``state.count``.

  Raises:
    ValueError: ``round_index`` given but not an int (a float, a bool, or
      a traced array: it must be static).
  """
  if round_index is None:
    return state.count
  if isinstance(round_index, (jax.Array, np.ndarray)):
    raise ValueError(
        f"round_index must be a Python int (static; jit it with "
        f"static_argnames), got {type(round_index).__name__}.")
  return checks.check_int("round_index", round_index)
