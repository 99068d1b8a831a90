"""DES-LOC-Adam: local Adam whose parameters and moments sync on own periods.

Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for
Training Foundation Models" (arXiv 2505.22549, ICLR 2026). Every worker runs
Adam on its own gradient; the parameters ``x``, the first moment ``u`` and
the second moment ``v`` are replaced by their worker mean every ``K_x``,
``K_u`` and ``K_v`` steps (the paper recommends ``K_u = 3 K_x``, ``K_v = 6
K_x``). Like the other local-update methods it runs per worker inside
``jax.shard_map`` (or ``jax.vmap`` with an ``axis_name``) over the worker
axis and returns the change of the parameters as its update.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments

PyTree = Any
#: Largest period: the step counter is int32 on the device.
_MAX_PERIOD = 2**31 - 1


class DesLocState(NamedTuple):
  """State of :func:`desloc_adam` (worker-local)."""
  count: jax.Array  # int32 []: steps taken t.
  u: optax.Updates  # first moment, the params' shapes and dtypes.
  v: optax.Updates  # second moment, the params' shapes and dtypes.


def check_desloc_periods(sync_x, sync_u, sync_v) -> tuple[int, int, int]:
  """``(K_x, K_u, K_v)`` as ints, each checked in ``[1, 2**31 - 1]``.

  Raises:
    ValueError: a period that is not an integer in that range (naming it).
  """
  return tuple(checks.check_int(name, value, minimum=1, maximum=_MAX_PERIOD)
               for name, value in (("sync_x", sync_x), ("sync_u", sync_u),
                                   ("sync_v", sync_v)))


def _synced(period: int, t, tree, axis_name):
  """``E_m[tree]`` if ``t % period == 0``, else ``tree`` (a ``lax.cond``:
  the all-reduce runs on sync steps only)."""
  return gossip.every(period, t % period == 0,
                      lambda y: gossip.mean(y, axis_name), lambda y: y, tree)


def desloc_adam(learning_rate, sync_x: int, sync_u: int, sync_v: int, *,
                b1: float = 0.9, b2: float = 0.99, eps: float = 1e-8,
                bias_correction: bool = False, weight_decay: float = 0.0,
                mask: Callable[[PyTree], PyTree] | None = None,
                axis_name="workers") -> optax.GradientTransformation:
  """DES-LOC-Adam (Iacob et al., arXiv 2505.22549, Algorithms 1 and 2).

  Recursion of worker ``m`` at step ``t = 0, 1, ...`` (``state.count``, the
  steps taken before this one), with ``E_m`` the mean over the workers and
  ``g`` the worker's own gradient, taken at its own (un-averaged) ``x_t``::

    u_t = b1 (E_m[u_{t-1}] if t % K_u == 0 else u_{t-1}) + (1 - b1) g
    v_t = b2 (E_m[v_{t-1}] if t % K_v == 0 else v_{t-1}) + (1 - b2) g*g
    d   = lr_t u_t / sqrt(v_t + eps**2) + lr_t weight_decay x_t
    x_{t+1} = (E_m[x_t] if t % K_x == 0 else x_t) - d

  with ``u_{-1} = v_{-1} = 0``. The states are averaged *before* the local
  update (so the first step averages the zero moments and the equal initial
  parameters). With ``bias_correction`` ``u_t`` and ``v_t`` in ``d`` are
  divided by ``1 - b1**(t+1)`` and ``1 - b2**(t+1)``. ``weight_decay`` is
  decoupled (AdamW), on the leaves ``mask(params)`` marks (None: all).

  Choices of the paper followed: Algorithm 1's independent periods with the
  averaging of each state before the step that uses it; Algorithm 2's
  Adam step without bias correction and with ``eps`` inside the square
  root (``sqrt(v + eps**2)``, Appendix C.2), bias correction being an
  option here; the gradient taken at the worker's un-averaged parameters;
  the moments kept (never reset) between syncs. Gradient clipping is left
  to a preceding ``optax.clip_by_global_norm`` in a chain.

  Each average is a ``gossip.every`` (a ``lax.cond`` marked with its
  period): the all-reduce runs only on its sync steps, and the HLO
  accounting weighs each by ``1 / K``: bytes per step ``|x| / K_x + |u| /
  K_u + |v| / K_v``. ``t % K`` is equal on all workers, so every worker
  takes the same branch.

  Args:
    learning_rate: a number >= 0 or an optax schedule of ``t``.
    sync_x, sync_u, sync_v: the sync periods ``K_x``, ``K_u``, ``K_v`` in
      steps, ints in ``[1, 2**31 - 1]``.
    b1, b2: moment decays in ``[0, 1)``.
    eps: ``>= 0``, in ``sqrt(v + eps**2)``.
    bias_correction: divide the moments by ``1 - b**(t+1)`` in ``d``.
    weight_decay: decoupled weight decay ``>= 0``.
    mask: params -> bool pytree of the leaves that decay, or None (all).
    axis_name: the worker axis of the mean.

  Returns:
    An ``optax.GradientTransformation`` with :class:`DesLocState` (``u``,
    ``v`` in the params' shapes and dtypes); ``update`` needs ``params``.
    The update is ``x_{t+1} - x_t`` in the params' dtypes.

  Raises:
    ValueError: a period not an int in ``[1, 2**31 - 1]``, ``b1``/``b2``
      not in ``[0, 1)``, ``eps``/``weight_decay``/``learning_rate`` not a
      finite number >= 0, ``bias_correction`` not a bool, ``mask`` not
      callable (at construction); an integer or bool parameter leaf
      (``init``, ``update``); ``params`` not passed to ``update``.
  """
  collectives.check_axis_name(axis_name)
  k_x, k_u, k_v = check_desloc_periods(sync_x, sync_u, sync_v)
  arguments.check_learning_rate(learning_rate)
  arguments.check_hyperparameter("b1", b1, below_one=True)
  arguments.check_hyperparameter("b2", b2, below_one=True)
  arguments.check_hyperparameter("eps", eps, below_one=False)
  arguments.check_hyperparameter("weight_decay", weight_decay,
                                 below_one=False)
  checks.check_bool("bias_correction", bias_correction)
  if mask is not None and not callable(mask):
    raise ValueError(f"mask must be callable (params -> bool pytree) or "
                     f"None, got {mask!r}.")

  def init_fn(params):
    gossip.check_float_leaves(params, "desloc_adam")
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DesLocState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format("desloc_adam"))
    gossip.check_float_leaves(params, "desloc_adam")
    t = state.count
    u = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g,
                     _synced(k_u, t, state.u, axis_name), grads)
    v = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g * g,
                     _synced(k_v, t, state.v, axis_name), grads)
    lr = learning_rate(t) if callable(learning_rate) else learning_rate
    d = _step(u, v, t, lr, b1, b2, eps, bias_correction)
    if weight_decay:
      decays = (mask(params) if mask is not None
                else jax.tree.map(lambda _: True, params))
      d = jax.tree.map(lambda s, x, on: s + lr * weight_decay * x if on
                       else s, d, params, decays)
    x_bar = _synced(k_x, t, params, axis_name)
    updates = jax.tree.map(lambda xb, s, x: ((xb - s) - x).astype(x.dtype),
                           x_bar, d, params)
    return updates, DesLocState(optax.safe_increment(t), u, v)

  return arguments.per_worker_state(init_fn, update_fn)


def _step(u, v, t, lr, b1, b2, eps, bias_correction):
  """``d = lr u / sqrt(v + eps**2)`` (moments bias-corrected if asked)."""
  if bias_correction:
    u = jax.tree.map(lambda m: m / (1 - _power(b1, t + 1, m.dtype)), u)
    v = jax.tree.map(lambda m: m / (1 - _power(b2, t + 1, m.dtype)), v)
  return jax.tree.map(lambda m, s: lr * m / jnp.sqrt(s + eps * eps), u, v)


def _power(b, k, dtype):
  """``b**k`` in ``dtype`` (``k`` an int32 step count)."""
  return jnp.asarray(b, dtype) ** k.astype(dtype)
