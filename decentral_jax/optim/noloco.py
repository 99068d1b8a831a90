"""NoLoCo: inner steps, then a momentum outer step averaged with one peer.

Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training
Method for Large Models" (arXiv 2506.10911). Like DiLoCo every worker takes
``H = sync_every`` inner steps from its outer parameters ``phi_i``; unlike
DiLoCo there is no all-reduce: at the sync each worker meets the other
member of its group (a pair) of the round's pairing, and its outer step
mixes the pair's mean update with a pull towards the pair's mean
parameters. The pairings are a gossip schedule of group means
(:mod:`decentral_jax.topology.pairings`), so a round is one ``ppermute``.
Runs per worker inside ``jax.shard_map`` (or ``jax.vmap`` with an
``axis_name``) over the worker axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import local_steps
from decentral_jax.optim import transforms
from decentral_jax.topology import pairings as pairings_lib
from decentral_jax.topology import schedules as topology_lib


class NoLoCoState(NamedTuple):
  """State of :func:`noloco` (worker-local; ``outer`` differs per worker)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  # theta: phi_i, this worker's outer parameters (float32, or float64);
  # opt_state: delta_i, its outer momentum (phi's shapes and dtypes);
  # count: outer steps taken k (the pairing round).
  outer: local_steps.OuterState

  @property
  def phi(self):
    """This worker's outer parameters ``phi_i``."""
    return self.outer.theta


def iteration_matrix(alpha: float, gamma: float) -> np.ndarray:
  """The 2x2 map of one outer step on a fixed pair's differences.

  With ``d = phi_0 - phi_1`` and ``m = delta_0 - delta_1`` (the pair mean
  of ``Delta`` is the same on both members and cancels)::

    m' = alpha m - gamma d
    d' = d + m' = alpha m + (1 - gamma) d

  so ``[m', d'] = A [m, d]`` with ``A = [[alpha, -gamma], [alpha, 1 -
  gamma]]`` (float64). The same ``A`` maps a member's deviation from its
  group mean in a group of any size.
  """
  return np.array([[alpha, -gamma], [alpha, 1.0 - gamma]], np.float64)


def is_stable(alpha: float, gamma: float) -> bool:
  """True if ``A`` of :func:`iteration_matrix` has spectral radius < 1.

  ``A`` has trace ``1 + alpha - gamma`` and determinant ``alpha``, so its
  characteristic polynomial is ``z^2 - (1 + alpha - gamma) z + alpha``.
  By the Jury (Schur-Cohn) test both roots lie inside the unit circle iff
  ``|alpha| < 1`` and ``|1 + alpha - gamma| < 1 + alpha``, i.e.::

    -1 < alpha < 1   and   0 < gamma < 2 (1 + alpha)

  (``gamma = 0`` leaves a root at 1: paired workers never approach each
  other; ``gamma = 2 (1 + alpha)`` a root at -1.) This is the stability
  range of the paper's analysis for groups of two (its Eq. 74), derived
  here for the recursion of :func:`noloco`.
  """
  return bool(-1.0 < alpha < 1.0 and 0.0 < gamma < 2.0 * (1.0 + alpha))


def check_outer(alpha, beta, gamma, names=("alpha", "beta", "gamma")
                ) -> tuple[float, float, float]:
  """``(alpha, beta, gamma)`` as floats, checked; ``gamma`` None is ``beta``.

  Args:
    alpha, beta, gamma: the outer step's coefficients.
    names: how to call them in messages (the runner passes its config
      fields).

  Raises:
    ValueError: ``alpha`` not in ``[0, 1)``, ``beta`` not a finite number
      > 0, or ``gamma`` outside the stability range ``0 < gamma < 2 (1 +
      alpha)`` of :func:`is_stable` (each naming its argument).
  """
  gamma = beta if gamma is None else gamma
  for name, value in zip(names, (alpha, beta, gamma)):
    arguments.check_hyperparameter(name, value, below_one=False)
    if arguments.concrete_float(value) is None:
      raise ValueError(f"{name} must be a Python or NumPy number, got a "
                       "traced array.")
  alpha, beta, gamma = float(alpha), float(beta), float(gamma)
  if alpha >= 1:
    raise ValueError(f"{names[0]}={alpha} must be in [0, 1) (the outer "
                     "momentum; 1 or more never forgets a step).")
  if beta <= 0:
    raise ValueError(f"{names[1]}={beta} must be > 0 (the weight of the "
                     "pair's mean update; 0 never moves phi).")
  if not is_stable(alpha, gamma):
    raise ValueError(
        f"{names[2]}={gamma} with {names[0]}={alpha} is outside NoLoCo's "
        f"stability range 0 < {names[2]} < 2 (1 + {names[0]}) = "
        f"{2 * (1 + alpha):g} for groups of two (the paper's Eq. 74): "
        "paired workers' parameters would not approach each other.")
  return alpha, beta, gamma


def noloco(inner: optax.GradientTransformation, sync_every: int,
           pairing: topology_lib.Topology, *, alpha: float = 0.5,
           beta: float = 0.7, gamma: float | None = None,
           axis_name: gossip.AxisName = "workers",
           bucket_bytes: int | None = None) -> optax.GradientTransformation:
  """NoLoCo (Kolehmainen et al., arXiv 2506.10911, Sec. 3.2 and App. A.2).

  Worker ``i`` at step ``t`` (``state.count``, steps taken before this
  one) takes the inner step ``x_i <- x_i + inner(g_i; x_i)``; after it, if
  ``(t + 1) % H == 0``, the ``k``-th outer step (``k`` outer steps so
  far), with ``G`` the group (pair) of ``i`` in round ``k`` of
  ``pairing`` and ``mean_G`` the mean over it::

    Delta_i = x_i - phi_i                       (x_i: the inner result)
    delta_i <- alpha delta_i + beta mean_G(Delta) - gamma (phi_i - mean_G(phi))
    phi_i   <- phi_i + delta_i
    x_i     <- phi_i                            (the next inner phase)

  with ``phi_i`` = the initial parameters and ``delta_i = 0`` at the
  start. Sign: ``Delta = x - phi`` points *along* the inner progress and
  is added (the descent sign of the paper's App. A.2 and the official
  code; its Sec. 3.2 writes the pseudo-gradient ``phi - x`` instead). The
  worked example: ``f_i(x) = |x - c_i|^2 / 2``, ``c = [[1, 0], [3, 1],
  [-1, 2], [0, -3]]``, inner SGD lr 0.1, ``H = 2``, ``alpha = 0.5``,
  ``beta = gamma = 0.7``, pairs (0, 1), (2, 3): two inner steps give
  ``x_i = 0.19 c_i``, so ``Delta_i = 0.19 c_i``, ``mean_G(Delta) = [0.38,
  0.095]`` and ``[-0.095, -0.095]``; ``phi`` is equal, so ``delta_i = 0.7
  mean_G(Delta)``: workers 0, 1 at ``[0.266, 0.0665]``, 2, 3 at
  ``[-0.0665, -0.0665]``. With ``phi_i - Delta`` instead, they would move
  away from the minimisers, to ``[-0.266, -0.0665]``.

  One message per sync: the update is linear in the pair means, so each
  worker sends ``s_i = beta Delta_i + gamma phi_i`` and forms ``delta_i <-
  alpha delta_i - gamma phi_i + mean_G(s)`` (equal to the recursion above
  up to rounding): one parameter-sized exchange (``phi``'s dtype, float32
  for 16-bit parameters) with the partner every ``H`` steps, no
  all-reduce. A worker alone in its round (``n`` odd) takes ``mean_G(s)
  = s_i``: ``delta_i <- alpha delta_i + beta Delta_i``.

  Stability: for a fixed pair the differences of ``phi`` and ``delta``
  follow the linear map :func:`iteration_matrix`, whose eigenvalues lie
  inside the unit circle iff ``0 < gamma < 2 (1 + alpha)`` (``0 <= alpha
  < 1``; :func:`is_stable`); other values are refused.

  Args:
    inner: worker-local optax transform (AdamW in the paper).
    sync_every: ``H``, inner steps per outer step, an int in ``[1, 2**31 -
      1]``.
    pairing: a topology whose rounds are group means of pairs and singles
      (:func:`decentral_jax.topology.pairings.random_pairs`, or
      :func:`~decentral_jax.topology.pairings.pair_schedule` for a given
      one); round ``k % period`` is used at the ``k``-th outer step.
    alpha: outer momentum in ``[0, 1)`` (paper: 0.5).
    beta: weight of the pair's mean update, > 0 (paper: 0.7).
    gamma: pull towards the pair's mean parameters (None: ``beta``, as in
      the paper), within the stability range above.
    axis_name: the worker axis.
    bucket_bytes: gossip buckets (:func:`decentral_jax.comm.gossip.mix`).

  Returns:
    An ``optax.GradientTransformation`` with :class:`NoLoCoState`;
    ``update`` needs ``params``. Updates have the params' shapes and
    dtypes.

  Raises:
    ValueError: ``inner`` not an optax transform, ``sync_every`` out of
      range, ``pairing`` not a schedule of pairs, ``alpha``, ``beta`` or
      ``gamma`` out of range (:func:`check_outer`), a bad ``bucket_bytes``
      (at construction); an integer or bool parameter leaf (``init``,
      ``update``); ``params`` not passed to ``update``; a worker axis whose
      size differs from ``pairing.n_workers`` (``update``).
  """
  collectives.check_axis_name(axis_name)
  period = local_steps.check_common(inner, sync_every)
  pairings_lib.check_groups(pairing, 2, "pairing")
  alpha, beta, gamma = check_outer(alpha, beta, gamma)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)

  def init_fn(params):
    gossip.check_float_leaves(params, "noloco")
    phi = local_steps.global_copy(params)
    return NoLoCoState(jnp.zeros([], jnp.int32), inner.init(params),
                       local_steps.OuterState(
                           phi, jax.tree.map(jnp.zeros_like, phi),
                           jnp.zeros([], jnp.int32)))

  def outer_step(x, outer):
    phi, delta, k = outer
    sent = jax.tree.map(lambda a, p: beta * (a.astype(p.dtype) - p)
                        + gamma * p, x, phi)
    mixed = gossip.mix(sent, pairing, k, axis_name,
                       bucket_bytes=bucket_bytes)
    delta = jax.tree.map(lambda d, p, m: alpha * d - gamma * p + m,
                         delta, phi, mixed)
    phi = jax.tree.map(lambda p, d: p + d, phi, delta)
    return (local_steps.to_params(phi, x),
            local_steps.OuterState(phi, delta, optax.safe_increment(k)))

  def update_fn(updates, state, params=None):
    x, inner_state = local_steps.inner_step(inner, updates, state.inner_state,
                                            params, "noloco")
    count = optax.safe_increment(state.count)
    x, outer = gossip.every(period, count % period == 0, outer_step,
                            lambda a, o: (a, o), x, state.outer)
    return local_steps.param_delta(x, params), NoLoCoState(
        count, inner_state, outer)

  return arguments.per_worker_state(init_fn, update_fn)


def outer_params(opt_state: optax.OptState):
  """``phi_i`` of the first :class:`NoLoCoState` in ``opt_state`` (this
  worker's outer parameters, the model NoLoCo evaluates: their mean over
  the workers), else None."""
  found = transforms.find_states(opt_state, (NoLoCoState,))
  return found[0].outer.theta if found else None
