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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from decentral_jax import gossip
from decentral_jax import topology as topology_lib

PyTree = Any
_NO_PARAMS = ("{} needs the current parameters: call tx.update(grads, state, "
              "params) with params.")


def _safe_increment(count):
  return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


# --------------------------------------------------------------------------
# AccumAdam.
# --------------------------------------------------------------------------


class ScaleByAccumAdamState(NamedTuple):
  """State of :func:`scale_by_accum_adam` (all worker-local)."""
  count: jax.Array  # shape=(), dtype=int32: steps taken t.
  mu: optax.Updates  # first moment M of completed windows, like params.
  nu: optax.Updates  # second moment V of completed windows, like params.
  acc: optax.Updates  # running window mean A = sum g / T, like params.


def scale_by_accum_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        accum_steps: int = 1, *,
                        mu_dtype=None) -> optax.GradientTransformation:
  r"""Rescales updates by the AccumAdam direction (paper Alg. 4, App. C).

  With ``t`` the 1-based step, ``T = accum_steps``, ``c = ceil(t / T)``:

  .. math::
    A &\leftarrow A + g / T \\
    \hat m &= (\beta_1 M + (1-\beta_1) g) / (1 - \beta_1^c) \\
    \hat v &= (\beta_2 V + (1-\beta_2) g^2) / (1 - \beta_2^c) \\
    d &= \hat m / (\sqrt{\hat v} + \epsilon) \\
    \text{if } t \bmod T = 0:&\ M \leftarrow \beta_1 M + (1-\beta_1) A,\;
      V \leftarrow \beta_2 V + (1-\beta_2) A^2,\; A \leftarrow 0

  The parameters move every step (the returned update is ``d``); only the
  stored moments are refreshed once per window, from the window's mean
  gradient. This is not ``optax.MultiSteps``, which freezes parameters for
  ``T - 1`` steps. With ``accum_steps=1`` it equals ``optax.scale_by_adam``.

  Args:
    b1: first-moment decay, in [0, 1).
    b2: second-moment decay, in [0, 1).
    eps: added to the denominator outside the square root.
    accum_steps: window length ``T >= 1`` (``accum_iter`` in ``decent-dp``).
    mu_dtype: optional dtype of ``M`` and ``A`` (default: the param dtype).

  Returns:
    An ``optax.GradientTransformation`` with state
    :class:`ScaleByAccumAdamState`. Updates have the grads' shapes/dtypes.

  Raises:
    ValueError: ``accum_steps`` not a positive integer, or ``b1``/``b2``
      outside [0, 1), or ``eps`` negative.

  References:
    Wang et al. 2025 (arXiv 2410.11998), App. C; ``decent-dp`` 0.2.3
    ``AccumAdamW`` (beta2 in the second moment, eps outside the sqrt).
  """
  static_t = not isinstance(accum_steps, jax.Array)
  if static_t and (isinstance(accum_steps, bool) or
                   not isinstance(accum_steps, (int, np.integer)) or
                   accum_steps < 1):
    raise ValueError(f"accum_steps must be an integer >= 1, got "
                     f"{accum_steps!r}.")
  for name, b in (("b1", b1), ("b2", b2)):
    if not isinstance(b, jax.Array) and not 0.0 <= float(b) < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {b!r}.")
  if not isinstance(eps, jax.Array) and float(eps) < 0:
    raise ValueError(f"eps must be >= 0, got {eps!r}.")
  # A traced accum_steps (e.g. under optax.inject_hyperparams) is allowed.
  plain_adam = static_t and int(accum_steps) == 1

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = optax.tree.zeros_like(params)
    acc = optax.tree.zeros_like(params, dtype=mu_dtype)
    return ScaleByAccumAdamState(jnp.zeros([], jnp.int32), mu, nu, acc)

  def update_fn(updates, state, params=None):
    del params
    count = _safe_increment(state.count)
    big_t = (int(accum_steps) if static_t
             else jnp.asarray(accum_steps).astype(jnp.int32))
    window = (count + big_t - 1) // big_t  # c = ceil(t / T)
    commit = count % big_t == 0

    def leaf(g, m, v, a):
      dt = g.dtype
      # Bias corrections in the gradient dtype (float64 stays float64).
      bc1 = 1 - jnp.asarray(b1, dt) ** window.astype(dt)
      bc2 = 1 - jnp.asarray(b2, dt) ** window.astype(dt)
      m_hat = (b1 * m.astype(dt) + (1 - b1) * g) / bc1
      v_hat = (b2 * v.astype(dt) + (1 - b2) * jnp.square(g)) / bc2
      direction = m_hat / (jnp.sqrt(v_hat) + eps)
      if plain_adam:
        # A == g: identical to Adam, no accumulator arithmetic.
        new_m = b1 * m + (1 - b1) * g.astype(m.dtype)
        new_v = b2 * v + (1 - b2) * jnp.square(g)
        return direction, new_m.astype(m.dtype), new_v.astype(v.dtype), a
      a = a + (g / jnp.asarray(big_t, g.dtype)).astype(a.dtype)
      new_m = jnp.where(commit, b1 * m + (1 - b1) * a, m)
      new_v = jnp.where(commit, b2 * v + (1 - b2) * jnp.square(a.astype(v.dtype)),
                        v)
      new_a = jnp.where(commit, jnp.zeros_like(a), a)
      return direction, new_m.astype(m.dtype), new_v.astype(v.dtype), new_a

    out = jax.tree.map(leaf, updates, state.mu, state.nu, state.acc)
    treedef = jax.tree.structure(updates)
    flat = treedef.flatten_up_to(out)
    d, m, v, a = (treedef.unflatten([f[i] for f in flat]) for i in range(4))
    return d, ScaleByAccumAdamState(count, m, v, a)

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------
# Mixing.
# --------------------------------------------------------------------------


class GossipMixingState(NamedTuple):
  """State of :func:`gossip_mixing`."""
  count: jax.Array  # shape=(), dtype=int32: step k, selects round k % period.


def gossip_mixing(topology: topology_lib.Topology,
                  axis_name: gossip.AxisName = "workers", *,
                  comm_dtype=None) -> optax.GradientTransformation:
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

  Returns:
    An ``optax.GradientTransformation``; must be updated inside
    ``jax.shard_map`` over ``axis_name`` with ``params`` given.

  Raises:
    ValueError: ``params`` not passed to ``update``.
  """

  def init_fn(params):
    del params
    return GossipMixingState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, round_index=None, **unused):
    del unused
    if params is None:
      raise ValueError(_NO_PARAMS.format("gossip_mixing"))
    mixed = gossip.mix(params, topology, _round(state, round_index), axis_name,
                       comm_dtype=comm_dtype)
    updates = jax.tree.map(lambda u, m, p: (u + (m - p)).astype(u.dtype),
                           updates, mixed, params)
    return updates, GossipMixingState(_safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _round(state, round_index):
  """The step that picks the round: a static Python int if given, else count."""
  if round_index is None:
    return state.count
  if isinstance(round_index, bool) or not isinstance(round_index, int):
    raise ValueError(
        f"round_index must be a Python int (static; jit it with "
        f"static_argnames), got {type(round_index).__name__}.")
  return round_index


class DecentralizedState(NamedTuple):
  """State of :func:`decentralized`."""
  count: jax.Array  # shape=(), dtype=int32: step k, selects round k % period.
  inner_state: optax.OptState  # the local optimizer's state (worker-local).


def decentralized(inner: optax.GradientTransformation,
                  topology: topology_lib.Topology,
                  axis_name: gossip.AxisName = "workers", *,
                  mix_after_update: bool = False,
                  comm_dtype=None) -> optax.GradientTransformation:
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

  Round selection: by default round ``count % period`` is chosen in-graph
  with ``lax.switch`` (one compile for the whole schedule). Passing the extra
  argument ``round_index=r`` (a Python int, e.g. a ``static_argnames`` of the
  jitted step, usually ``step % period``) compiles that round alone, without
  a conditional, which lets XLA's scheduler overlap the collective with the
  forward/backward pass on accelerators (one compile per distinct round).
  ``optax.chain`` forwards ``round_index`` to every element.

  The returned update is ``x_{k+1} - x_k``, so ``optax.apply_updates`` stays
  the only place where parameters change and the wrapper composes with
  ``optax.chain`` (e.g. after ``optax.clip_by_global_norm``).

  Args:
    inner: worker-local optax transform producing the local update.
    topology: mixing schedule; round ``k % period`` at step ``k``.
    axis_name: worker mesh axis (or ``(nodes, local)``).
    mix_after_update: mix after the local update instead of before.
    comm_dtype: optional dtype in which parameters are sent (e.g. bfloat16).

  Returns:
    An ``optax.GradientTransformation`` with :class:`DecentralizedState`;
    ``update`` must run inside ``jax.shard_map`` over ``axis_name``.

  Raises:
    ValueError: ``params`` not passed to ``update``.
  """

  def init_fn(params):
    return DecentralizedState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None, *, round_index=None,
                **extra_args):
    if params is None:
      raise ValueError(_NO_PARAMS.format("decentralized"))
    extra = extra_args if extra_args else {}
    step = _round(state, round_index)
    if mix_after_update:
      local, inner_state = inner.update(updates, state.inner_state, params,
                                        **extra)
      stepped = optax.apply_updates(params, local)
      target = gossip.mix(stepped, topology, step, axis_name,
                          comm_dtype=comm_dtype)
    else:
      mixed = gossip.mix(params, topology, step, axis_name,
                         comm_dtype=comm_dtype)
      local, inner_state = inner.update(updates, state.inner_state, mixed,
                                        **extra)
      target = optax.apply_updates(mixed, local)
    new_updates = jax.tree.map(lambda t, p: (t - p).astype(p.dtype),
                               target, params)
    return new_updates, DecentralizedState(_safe_increment(state.count),
                                           inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def default_weight_decay_mask(params: PyTree) -> PyTree:
  """``True`` for leaves with ``ndim >= 2`` (matrices, kernels), else False."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _resolve_mask(mask):
  if isinstance(mask, str):
    if mask.replace(" ", "") != "ndim>=2":
      raise ValueError(f"mask={mask!r}: the only string mask is 'ndim>=2'; "
                       "pass None (decay all), a pytree of bools or a callable.")
    return default_weight_decay_mask
  return mask


def decentralized_adamw(learning_rate: optax.ScalarOrSchedule,
                        topology: topology_lib.Topology, *,
                        b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        weight_decay: float = 0.0,
                        mask: Any = "ndim>=2",
                        accum_steps: int = 1,
                        axis_name: gossip.AxisName = "workers",
                        mix_after_update: bool = False,
                        comm_dtype=None) -> optax.GradientTransformation:
  r"""DAdam (``accum_steps=1``) / AccumAdamW (``accum_steps>1``).

  .. math::
    x_{k+1} = (1 - \gamma_k \lambda\, \mathrm{mask}) \odot (W_k x_k)
      - \gamma_k\, d_k(g(x_k))

  with ``d_k`` the Adam direction (``accum_steps=1``) or the AccumAdam
  direction of :func:`scale_by_accum_adam`, computed from each worker's own
  gradient and moments. Reproduces ``decent-dp`` 0.2.3 to float64 precision.

  Args:
    learning_rate: float or optax schedule ``step -> lr`` (``gamma_k``).
    topology: mixing schedule (:mod:`decentral_jax.topology`).
    b1, b2, eps: Adam hyperparameters (eps outside the square root).
    weight_decay: decoupled weight decay ``lambda`` on the mixed parameters.
    mask: which leaves are decayed: ``"ndim>=2"`` (default: matrices and
      kernels, never biases or norm scales), ``None`` (all leaves), a pytree
      of bools, or a callable ``params -> bools``. The default is a string so
      that ``optax.inject_hyperparams`` keeps it static (it would treat a
      callable as a schedule).
    accum_steps: AccumAdam window ``T`` (1 = DAdam).
    axis_name: worker mesh axis (or ``(nodes, local)``).
    mix_after_update: adapt-then-combine instead of the paper's order.
    comm_dtype: optional dtype in which parameters are sent.

  Returns:
    An ``optax.GradientTransformation`` to update inside ``jax.shard_map``.

  Raises:
    ValueError: invalid ``accum_steps``, ``b1``, ``b2`` or ``eps``.

  References:
    Wang et al. 2025 (arXiv 2410.11998), Alg. 1 and Alg. 4.
  """
  inner = optax.chain(
      scale_by_accum_adam(b1=b1, b2=b2, eps=eps, accum_steps=accum_steps),
      optax.add_decayed_weights(weight_decay, _resolve_mask(mask)),
      optax.scale_by_learning_rate(learning_rate),
  )
  return decentralized(inner, topology, axis_name,
                       mix_after_update=mix_after_update, comm_dtype=comm_dtype)


def all_reduce_gradients(axis_name: gossip.AxisName = "workers"
                         ) -> optax.GradientTransformation:
  """Averages updates (gradients) over all workers with ``lax.pmean``.

  ``optax.chain(all_reduce_gradients("workers"), optax.adamw(lr))`` is the
  All-Reduce data-parallel baseline (paper Alg. 2). Must be updated inside
  ``jax.shard_map`` over ``axis_name``; output shapes/dtypes = input.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(
        lambda g: gossip._match_varying(lax.pmean(g, axis_name), g),  # pylint: disable=protected-access
        updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def round_count(opt_state: optax.OptState) -> jax.Array | None:
  """The gossip step counter found in ``opt_state`` (first one), or None."""
  found = []

  def visit(s):
    if isinstance(s, (DecentralizedState, GossipMixingState)):
      found.append(s.count)
      return True
    return False

  jax.tree.map(lambda _: None, opt_state, is_leaf=visit)
  return found[0] if found else None
