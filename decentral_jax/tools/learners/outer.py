"""The synchronizer's outer optimizers: DiLoCo's Nesterov SGD and Delayed
Nesterov (Async Local-SGD).

Delayed Nesterov (Liu et al., Asynchronous Local-SGD Training for Language
Modeling, arXiv 2401.09135, Alg. "DN"): with merged pseudo-gradients
``Delta_1, Delta_2, ...`` (one per merge), buffer size ``N``, outer
learning rate ``eta`` and momentum ``beta``, ``m_0 = d_0 = 0``; at merge
``k``

    d_k = d_{k-1} + Delta_k
    if k % N == 0:  m_k = beta m_{k-1} + d_k / N,
                    theta_k = theta_{k-1} - eta (beta m_k + Delta_k / N),
                    d_k <- 0
    else:           m_k = m_{k-1},
                    theta_k = theta_{k-1} - eta Delta_k / N.

The momentum moves once per ``N`` merges, on the mean of the buffered
pseudo-gradients, and the merges in between are plain SGD steps of
``eta / N``: stale pseudo-gradients of decoupled learners are not amplified
by momentum at every merge. With ``N = 1`` it is Nesterov SGD
(``optax.sgd(eta, beta, nesterov=True)``), DiLoCo's outer optimizer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks

NAMES = ("nesterov", "delayed_nesterov")


class DelayedNesterovState(NamedTuple):
  """State of :func:`delayed_nesterov` (leaves like the parameters)."""
  count: jax.Array  # int32 []: merges taken k.
  momentum: optax.Updates  # m_k.
  buffer: optax.Updates  # d_k: pseudo-gradients since the last momentum step.


def _check_numbers(learning_rate, momentum) -> None:
  """``eta`` finite and > 0, ``beta`` in ``[0, 1)``, else a ValueError."""
  checks.check_float("outer learning_rate", learning_rate, minimum=0.0,
                     open_min=True)
  checks.check_float("outer momentum", momentum, minimum=0.0, maximum=1.0,
                     open_max=True)


def delayed_nesterov(learning_rate: float, momentum: float, buffer: int
                     ) -> optax.GradientTransformation:
  """Delayed Nesterov with buffer ``N = buffer`` (the recursion above).

  Args:
    learning_rate: ``eta``.
    momentum: ``beta``.
    buffer: ``N >= 1``.

  Returns:
    An ``optax.GradientTransformation`` taking the pseudo-gradient as its
    gradient (updates ``theta_k - theta_{k-1}``, float32 like it).

  Raises:
    ValueError: ``buffer`` not an int >= 1; ``learning_rate`` or
      ``momentum`` as in :func:`make`.
  """
  _check_numbers(learning_rate, momentum)
  if not isinstance(buffer, int) or isinstance(buffer, bool) or buffer < 1:
    raise ValueError(f"delay buffer must be an int >= 1, got {buffer!r}.")
  n = float(buffer)

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update_fn(delta, state, params=None):
    del params
    count = state.count + 1
    full = jax.tree.map(jnp.add, state.buffer, delta)
    now = count % buffer == 0
    mom = jax.tree.map(lambda m, d: jnp.where(now, momentum * m + d / n, m),
                       state.momentum, full)
    step = jax.tree.map(
        lambda m, g: jnp.where(now, -learning_rate * (momentum * m + g / n),
                               -learning_rate * g / n), mom, delta)
    kept = jax.tree.map(lambda d: jnp.where(now, jnp.zeros_like(d), d), full)
    return step, DelayedNesterovState(count, mom, kept)

  return optax.GradientTransformation(init_fn, update_fn)


def make(name: str, learning_rate: float, momentum: float, buffer: int = 1
         ) -> optax.GradientTransformation:
  """The outer optimizer ``name`` (:data:`NAMES`).

  Args:
    name: one of :data:`NAMES`.
    learning_rate: ``eta``, a finite number > 0.
    momentum: ``beta``, in ``[0, 1)``.
    buffer: ``N >= 1`` (Delayed Nesterov only).

  Raises:
    ValueError: an unknown name, a learning rate that is not finite and
      > 0, a momentum outside ``[0, 1)``, or a bad buffer (naming it).
  """
  _check_numbers(learning_rate, momentum)
  if name == "nesterov":
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)
  if name == "delayed_nesterov":
    return delayed_nesterov(learning_rate, momentum, buffer)
  raise ValueError(f"outer must be one of {NAMES}, got {name!r}.")
