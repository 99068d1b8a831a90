"""What every local-update method shares: the inner step and the outer state.

Local SGD, DiLoCo, Streaming DiLoCo and their elastic forms run a
worker-local inner optax transform every step and, every ``sync_every = H``
steps, synchronise. This module holds the pieces they have in common: the
checks of the arguments every method takes, the inner step ``x <- x +
inner(g; x)``, the outer state (the global parameters ``theta``, the outer
optimizer's state and the outer steps taken) and the outer step ``theta <-
theta + outer(Delta; theta)`` on a pseudo-gradient ``Delta``.

``theta`` is kept in float32 (float64 for float64 parameters).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms

PyTree = Any


def default_outer_optimizer() -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def check_common(inner, sync_every, outer=None) -> int:
  """Checks the arguments every method takes; returns ``H`` as an int.

  Raises:
    ValueError: ``inner`` (or a given ``outer``) not an optax transform,
      ``sync_every`` not an integer in ``[1, 2**31 - 1]`` (the step counters
      are int32 on the device).
  """
  arguments.check_transform("inner", inner)
  if outer is not None:
    arguments.check_transform("outer", outer)
  return checks.check_int("sync_every", sync_every, minimum=1,
                          maximum=2**31 - 1)


def global_dtype(x) -> jnp.dtype:
  """The dtype ``theta`` keeps for a leaf like ``x``: float32 or wider."""
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def global_copy(params: PyTree) -> PyTree:
  """``theta``: ``params`` in :func:`global_dtype`."""
  return jax.tree.map(lambda p: jnp.asarray(p, global_dtype(p)), params)


def inner_step(inner: optax.GradientTransformation, grads, inner_state,
               params, name: str):
  """``(x + inner(g; x), inner_state)`` of one worker.

  Raises:
    ValueError: ``params`` None, or an integer or bool leaf (naming the
      method ``name``).
  """
  if params is None:
    raise ValueError(arguments.NO_PARAMS.format(name))
  gossip.check_float_leaves(params, name)
  local, inner_state = inner.update(grads, inner_state, params)
  return optax.apply_updates(params, local), inner_state


def param_delta(new: PyTree, params: PyTree) -> PyTree:
  """``new - params`` in the params' dtypes: the update a method returns."""
  return jax.tree.map(lambda t, p: (t - p).astype(p.dtype), new, params)


def to_params(theta: PyTree, x: PyTree) -> PyTree:
  """``theta`` in the dtypes of the parameters ``x``: ``x <- theta``."""
  return jax.tree.map(lambda t, a: t.astype(a.dtype), theta, x)


class OuterState(NamedTuple):
  """The outer optimizer of DiLoCo: ``theta``, its optax state and ``k``.

  With a gossip reduction or eager timing ``theta`` and ``opt_state`` are
  per worker; otherwise equal on all workers.
  """
  theta: optax.Params  # global parameters, float32 (float64) like params.
  opt_state: optax.OptState  # the outer optax transform's state.
  count: jax.Array  # int32 []: outer steps taken k (the gossip round).


def init_outer(outer: optax.GradientTransformation, params: PyTree
               ) -> OuterState:
  """``theta`` = the initial parameters, a fresh outer state, ``k = 0``."""
  theta = global_copy(params)
  return OuterState(theta, outer.init(theta), jnp.zeros([], jnp.int32))


def outer_step(outer: optax.GradientTransformation, pseudo_grad, opt_state,
               theta):
  """``(theta + outer(Delta; theta), new outer state)``."""
  step, opt_state = outer.update(pseudo_grad, opt_state, theta)
  return optax.apply_updates(theta, step), opt_state


def find_theta(opt_state: optax.OptState, types) -> PyTree | None:
  """``theta`` of the first state of ``types`` (each with a ``theta``) in
  ``opt_state``, else None."""
  found = transforms.find_states(opt_state, types)
  return found[0].theta if found else None
