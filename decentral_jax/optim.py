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

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax import gossip
from decentral_jax import topology as topology_lib

PyTree = Any
_NO_PARAMS = ("{} needs the current parameters: call tx.update(grads, state, "
              "params) with params.")


def _compute_dtype(*dtypes) -> jnp.dtype:
  """float32, or the widest of ``dtypes`` when wider (float64 stays float64)."""
  return jnp.result_type(jnp.float32, *dtypes)


def _as_dtype(x, dtype):
  """A hyperparameter for arithmetic in ``dtype``.

  Python numbers stay weakly typed (rounded to the dtype they meet, with
  ``1 - b`` formed exactly in Python first), so float32 arithmetic is the
  same as with a literal; arrays (e.g. from ``optax.inject_hyperparams``) are
  cast to ``dtype``.
  """
  if isinstance(x, (int, float)) and not isinstance(x, bool):
    return x
  return jnp.asarray(x, dtype)


def _concrete_float(x) -> float | None:
  """``float(x)``, or None if ``x`` is traced (checked when it is known)."""
  try:
    return float(x)
  except TypeError:  # includes jax.errors.ConcretizationTypeError
    return None


def _check_hyperparameter(name: str, value, *, below_one: bool) -> None:
  """Raises ValueError unless ``value`` is finite, >= 0 (and < 1 if asked).

  Traced values are only checked for their dtype: a floating array with
  fewer than 32 bits is rejected, since ``b2 = 0.999`` rounds to 1.0 in
  bfloat16 (a zero bias correction) and ``eps = 1e-8`` to 0 in float16.
  """
  dtype = getattr(value, "dtype", None)
  if (dtype is not None and jnp.issubdtype(dtype, jnp.floating) and
      jnp.finfo(dtype).bits < 32):
    raise ValueError(
        f"{name} is a {jnp.dtype(dtype).name} array; hyperparameters must be "
        "Python floats or float32/float64 arrays (under "
        "optax.inject_hyperparams with low-precision params pass "
        "hyperparam_dtype=jnp.float32).")
  v = _concrete_float(value)
  if v is None:
    return
  if not math.isfinite(v) or v < 0 or (below_one and v >= 1):
    interval = "[0, 1)" if below_one else "finite and >= 0"
    raise ValueError(f"{name} must be {interval}, got {value!r}.")


_INJECT_HINT = ("under optax.inject_hyperparams list {!r} in static_args "
                "(optax takes callables, dtype classes included, for "
                "schedules)")


def check_float_dtype(name: str, dtype) -> None:
  """Raises ValueError unless ``dtype`` is None or a floating dtype.

  An array here is what ``optax.inject_hyperparams`` makes of a dtype class
  or callable it took for a schedule.
  """
  if dtype is None:
    return
  if isinstance(dtype, (jax.Array, np.ndarray)):
    raise ValueError(f"{name} must be a floating dtype or None, got an "
                     f"array; {_INJECT_HINT.format(name)}.")
  try:
    ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{name} must be a floating dtype or None, got "
                     f"{dtype!r}.")


def check_bucket_bytes(bucket_bytes) -> int:
  """The gossip bucket size of a transform: None -> the library default.

  Gossip sends same-dtype parameter leaves in buckets of at most this many
  bytes, one collective per bucket and permute term
  (:func:`decentral_jax.gossip.mix`, after PyTorch DDP's gradient buckets,
  Li et al., VLDB 2020); 0 sends one collective per leaf. The default is
  None rather than the number so that ``optax.inject_hyperparams`` does not
  turn it into a traced hyperparameter (pass an explicit value in
  ``static_args``).

  Returns:
    ``bucket_bytes`` as an int (``gossip.DEFAULT_BUCKET_BYTES`` for None).

  Raises:
    ValueError: not None or an integer >= 0 (an array: what
      ``optax.inject_hyperparams`` makes of an int not in ``static_args``).
  """
  if bucket_bytes is None:
    return gossip.DEFAULT_BUCKET_BYTES
  if isinstance(bucket_bytes, (jax.Array, np.ndarray)):
    raise ValueError("bucket_bytes must be an integer >= 0 or None, got an "
                     f"array; {_INJECT_HINT.format('bucket_bytes')}.")
  gossip.check_bucket_bytes(bucket_bytes)
  return int(bucket_bytes)


def _moment_dtype(name: str, dtype):
  """Canonical ``dtype`` (float64 -> float32 without x64), or None."""
  check_float_dtype(name, dtype)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


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
                        mu_dtype=None, nu_dtype=None
                        ) -> optax.GradientTransformation:
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

  Precision: per leaf, all of the above is computed in float32, or in the
  widest of the gradient/moment dtypes when that is wider (float64 stays
  float64), including the bias corrections (in bfloat16 ``0.999`` rounds to
  1 and ``1 - b2**c`` to 0). ``M``, ``V`` and ``A`` are then stored in their
  own dtypes and ``d`` is returned in the gradient dtype.

  Args:
    b1: first-moment decay, in [0, 1).
    b2: second-moment decay, in [0, 1).
    eps: added to the denominator outside the square root; finite, >= 0.
    accum_steps: window length ``T >= 1`` (``accum_iter`` in ``decent-dp``);
      may be a traced integer (``optax.inject_hyperparams``).
    mu_dtype: optional floating dtype of ``M`` and ``A`` (default: the param
      dtype).
    nu_dtype: optional floating dtype of ``V`` (default: the param dtype).
      With float16 parameters pass ``jnp.float32``: ``(1 - b2) g^2`` of
      small gradients underflows float16's range (about 6e-8), and the
      direction drifts from float32's without any non-finite value.

  Returns:
    An ``optax.GradientTransformation`` with state
    :class:`ScaleByAccumAdamState` (leaves shaped like params, dtypes fixed
    at ``init``). Applied leaf-wise over any pytree; updates have the grads'
    shapes and dtypes.

  Raises:
    ValueError: ``accum_steps`` not a positive integer; ``b1``/``b2`` not in
      [0, 1) or ``eps`` negative, NaN or infinite (checked when the values
      are known); ``b1``/``b2``/``eps`` given as arrays of fewer than 32
      bits; ``mu_dtype``/``nu_dtype`` not floating.

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
  known_t = None if static_t else _concrete_float(accum_steps)
  if not static_t and (not jnp.issubdtype(accum_steps.dtype, jnp.integer) or
                       (known_t is not None and known_t < 1)):
    raise ValueError(f"accum_steps must be an integer >= 1, got "
                     f"{accum_steps!r}.")
  _check_hyperparameter("b1", b1, below_one=True)
  _check_hyperparameter("b2", b2, below_one=True)
  _check_hyperparameter("eps", eps, below_one=False)
  mu_dtype = _moment_dtype("mu_dtype", mu_dtype)
  nu_dtype = _moment_dtype("nu_dtype", nu_dtype)
  # A traced accum_steps (e.g. under optax.inject_hyperparams) is allowed.
  plain_adam = static_t and int(accum_steps) == 1

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = optax.tree.zeros_like(params, dtype=nu_dtype)
    acc = optax.tree.zeros_like(params, dtype=mu_dtype)
    return ScaleByAccumAdamState(jnp.zeros([], jnp.int32), mu, nu, acc)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    big_t = (int(accum_steps) if static_t
             else jnp.asarray(accum_steps).astype(jnp.int32))
    window = (count + big_t - 1) // big_t  # c = ceil(t / T)
    commit = count % big_t == 0

    def leaf(g, m, v, a):
      # One compute dtype per leaf; in float32/float64 the operations below
      # are exactly the plain-dtype ones (the casts are no-ops).
      dt = _compute_dtype(g.dtype, m.dtype, v.dtype)
      beta1, beta2, epsilon = (_as_dtype(b1, dt), _as_dtype(b2, dt),
                               _as_dtype(eps, dt))
      gc, mc, vc = g.astype(dt), m.astype(dt), v.astype(dt)
      bc1 = 1 - jnp.asarray(beta1, dt) ** window.astype(dt)
      bc2 = 1 - jnp.asarray(beta2, dt) ** window.astype(dt)
      m_num = beta1 * mc + (1 - beta1) * gc
      v_num = beta2 * vc + (1 - beta2) * jnp.square(gc)
      direction = ((m_num / bc1) / (jnp.sqrt(v_num / bc2) + epsilon)
                   ).astype(g.dtype)
      if plain_adam:
        # A == g: identical to Adam, no accumulator arithmetic.
        return direction, m_num.astype(m.dtype), v_num.astype(v.dtype), a
      ac = a.astype(dt) + gc / jnp.asarray(big_t, dt)
      new_m = jnp.where(commit, (beta1 * mc + (1 - beta1) * ac).astype(m.dtype),
                        m)
      new_v = jnp.where(commit,
                        (beta2 * vc + (1 - beta2) * jnp.square(ac)
                         ).astype(v.dtype), v)
      new_a = jnp.where(commit, jnp.zeros_like(a), ac.astype(a.dtype))
      return direction, new_m, new_v, new_a

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
      :func:`check_bucket_bytes`); results are bit-identical.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`GossipMixingState`; must be updated inside ``jax.shard_map`` over
    ``axis_name`` with ``params`` given. Applied leaf-wise over any pytree of
    floating leaves: ``u + (W x - x)`` is formed in float32 (float64 stays
    float64) and returned with the shapes and dtypes of ``updates``.

  Raises:
    ValueError: ``comm_dtype`` not None or a floating dtype, or
      ``bucket_bytes`` not None or an integer >= 0 (at construction);
      ``params`` not passed to ``update``; errors of
      :func:`decentral_jax.gossip.mix` (mesh axis size, non-floating leaves).
  """
  check_float_dtype("comm_dtype", comm_dtype)
  bucket_bytes = check_bucket_bytes(bucket_bytes)

  def init_fn(params):
    del params
    return GossipMixingState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, round_index=None, **unused):
    del unused
    if params is None:
      raise ValueError(_NO_PARAMS.format("gossip_mixing"))
    mixed = gossip.mix(params, topology, round_step(state, round_index), axis_name,
                       comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    updates = jax.tree.map(_add_correction, updates, mixed, params)
    return updates, GossipMixingState(optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _add_correction(u, m, p):
  """``u + (m - p)`` in float32 (or wider), returned in ``u``'s dtype.

  For float32/float64 leaves these are the plain-dtype operations; for
  bfloat16/float16 the sum is rounded once instead of twice.
  """
  dt = _compute_dtype(u.dtype, m.dtype, p.dtype)
  return (u.astype(dt) + (m.astype(dt) - p.astype(dt))).astype(u.dtype)


def round_step(state, round_index):
  """The step that picks a gossip round: static ``round_index`` or ``state.count``.

  Raises:
    ValueError: ``round_index`` given but not a Python int.
  """
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
  then sits in a ``lax.cond`` and the round is chosen in-graph
  (``round_index`` is not supported).

  Round selection: by default round ``count % period`` is chosen in-graph
  with ``lax.switch`` (one compile for the whole schedule). Passing the extra
  argument ``round_index=r`` (a Python int, e.g. a ``static_argnames`` of the
  jitted step, usually ``step % period``) compiles that round alone, without
  a conditional, which lets XLA's scheduler overlap the collective with the
  forward/backward pass on accelerators (one compile per distinct round).
  ``optax.chain`` forwards ``round_index`` to every element.

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
      :data:`decentral_jax.gossip.DEFAULT_BUCKET_BYTES` (0: per leaf,
      faster on XLA:CPU), 0 for one collective per leaf (see :func:`check_bucket_bytes`).
      Results are bit-identical either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`DecentralizedState`; ``update`` must run inside
    ``jax.shard_map`` over ``axis_name``. Applied leaf-wise over any pytree
    of floating leaves; updates have the shapes and dtypes of ``params``.

  Raises:
    ValueError: ``comm_dtype`` not None or a floating dtype,
      ``gossip_every`` not an integer >= 1, or ``bucket_bytes`` not None or
      an integer >= 0 (at construction); ``params`` not passed to
      ``update``; ``round_index`` with ``gossip_every > 1``; errors
      of :func:`decentral_jax.gossip.mix` (mesh axis size, non-floating
      leaves).
  """
  check_float_dtype("comm_dtype", comm_dtype)
  bucket_bytes = check_bucket_bytes(bucket_bytes)
  # A traced gossip_every (optax.inject_hyperparams) is allowed; it always
  # takes the conditional path.
  static_tau = not isinstance(gossip_every, jax.Array)
  if static_tau and (isinstance(gossip_every, bool) or not isinstance(
      gossip_every, (int, np.integer)) or gossip_every < 1):
    raise ValueError(f"gossip_every must be an integer >= 1 (the gossip "
                     f"period in steps), got {gossip_every!r}.")
  tau = (int(gossip_every) if static_tau
         else jnp.asarray(gossip_every).astype(jnp.int32))

  def mix(tree, state, round_index):
    if static_tau and tau == 1:
      return gossip.mix(tree, topology, round_step(state, round_index), axis_name,
                        comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    if round_index is not None:
      raise ValueError("decentralized(gossip_every>1) picks its round "
                       "in-graph; do not pass round_index (use "
                       "config.gossip_rounds='switch').")
    return gossip.every(
        tau, state.count % tau == 0,
        lambda t: gossip.mix(t, topology, state.count // tau, axis_name,
                             comm_dtype=comm_dtype, bucket_bytes=bucket_bytes),
        lambda t: t, tree)

  def init_fn(params):
    return DecentralizedState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None, *, round_index=None,
                **extra_args):
    if params is None:
      raise ValueError(_NO_PARAMS.format("decentralized"))
    extra = extra_args if extra_args else {}
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
    # target has the param dtype (apply_updates casts to it). The difference
    # of two values of one dtype is correctly rounded in that dtype (forming
    # it in float32 and casting gives the same bits), and exact when
    # t/2 <= p <= 2t (Sterbenz), so apply_updates(params, new_updates)
    # returns target there; elsewhere (a sign change, |t - p| ~ |p|) it is
    # off by at most half an ulp of the difference.
    new_updates = jax.tree.map(lambda t, p: (t - p).astype(p.dtype),
                               target, params)
    return new_updates, DecentralizedState(optax.safe_increment(state.count),
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
  if isinstance(mask, (bool, np.bool_, jax.Array)):
    # What optax.inject_hyperparams passes for a callable mask it took for a
    # schedule (the mask of the step count: False), which would silently
    # turn decay off. A bare bool is never needed: True is None, and False
    # is weight_decay=0.
    raise ValueError(f"mask={mask!r}: pass None (decay all), 'ndim>=2', a "
                     "pytree of bools or a callable (not a bare bool or "
                     "array); " + _INJECT_HINT.format("mask") + ".")
  return mask


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
                        bucket_bytes: int | None = None
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
      of bools, or a callable ``params -> bools``. The default is a string so
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
      collective per leaf (bit-identical; see :func:`check_bucket_bytes`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`DecentralizedState` to update inside ``jax.shard_map``; updates
    have the shapes and dtypes of ``params``.

  Raises:
    ValueError: invalid ``accum_steps``, ``b1``, ``b2``, ``eps``, ``mask``
      (including a bare bool or array: what ``optax.inject_hyperparams``
      passes for a callable mask without ``static_args``), ``mu_dtype``,
      ``nu_dtype``, ``comm_dtype`` or ``bucket_bytes`` (see
      :func:`scale_by_accum_adam`, :func:`decentralized`).

  References:
    Wang et al. 2025 (arXiv 2410.11998), Alg. 1 and Alg. 4.
  """
  inner = optax.chain(
      scale_by_accum_adam(b1=b1, b2=b2, eps=eps, accum_steps=accum_steps,
                          mu_dtype=mu_dtype, nu_dtype=nu_dtype),
      optax.add_decayed_weights(weight_decay, _resolve_mask(mask)),
      optax.scale_by_learning_rate(learning_rate),
  )
  return decentralized(_in_compute_dtype(inner), topology, axis_name,
                       mix_after_update=mix_after_update, comm_dtype=comm_dtype,
                       gossip_every=gossip_every, bucket_bytes=bucket_bytes)


def _in_compute_dtype(inner: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on float32 copies of low-precision updates and params.

  Leaves of float32 or wider are passed unchanged (no-op casts), so float32
  and float64 results are those of ``inner`` itself. ``inner``'s state must
  keep its own dtypes (as :func:`scale_by_accum_adam` and optax's stateless
  transforms do); its outputs are float32 for low-precision inputs.
  """

  def cast(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, _compute_dtype(x.dtype)),
                        tree)

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
