"""Gradient tracking: decentralized training exact on heterogeneous data.

D-SGD and DAdam step along each worker's own gradient; with a constant
learning rate and workers whose objectives differ (heterogeneous data)
they stop at a consensus error floor of order ``lr * zeta`` (``zeta`` the
spread of the workers' gradients at the optimum). Gradient tracking gives
each worker a tracker ``y`` that gossips like the parameters and follows
the mean of the workers' gradients, so the workers step along an estimate
of the *global* gradient and reach the exact optimum (DIGing: Nedic,
Olshevsky and Shi, "Achieving Geometric Convergence for Distributed
Optimization over Time-Varying Graphs", SIAM J. Optim. 27(4), 2017,
arXiv 1607.03218; Koloskova, Lin and Stich, "An Improved Analysis of
Gradient Tracking for Decentralized Machine Learning", NeurIPS 2021,
Algorithm 1).

:func:`gradient_tracking` is the tracker alone, an optax transform that
turns each worker's gradient into its tracker; placed before
:func:`decentral_jax.optim.transforms.decentralized` in an ``optax.chain``
it makes D-SGD, DAdam or AccumAdamW track (:func:`tracked_decentralized`,
:func:`gradient_tracking_sgd`, :func:`gradient_tracking_adamw`). Like the
other transforms it runs per worker inside ``jax.shard_map`` (or
``jax.vmap`` with an ``axis_name``) over the worker axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import precision
from decentral_jax.optim import transforms
from decentral_jax.topology import schedules as topology_lib

PyTree = Any
#: The two forms of the parameter step: combine-then-adapt ``x+ = W x - lr
#: y`` (DIGing) and adapt-then-combine ``x+ = W (x - lr y)`` (Koloskova et
#: al. 2021, Algorithm 1).
TRACKING_FORMS = ("cta", "atc")


class GradientTrackingState(NamedTuple):
  """State of :func:`gradient_tracking` (worker-local)."""
  count: jax.Array  # int32 []: step k, selects round k % period.
  tracker: optax.Updates  # y_{k-1}, the gradients' shapes and dtypes.
  previous: optax.Updates  # g_{k-1}, the gradient of the previous step.


def check_tracking_form(form) -> str:
  """``form`` if it is one of :data:`TRACKING_FORMS` (``"cta"`` or ``"atc"``).

  Raises:
    ValueError: ``"form must be one of cta, atc, got ..."``.
  """
  return checks.check_choice("form", form, TRACKING_FORMS)


def gradient_tracking(topology: topology_lib.Topology,
                      axis_name: gossip.AxisName = "workers", *,
                      comm_dtype=None, bucket_bytes: int | None = None
                      ) -> optax.GradientTransformationExtraArgs:
  r"""The gradient tracker: replaces each worker's gradient by its tracker.

  At step ``k = 0, 1, ...`` (``state.count``) with the worker's gradient
  ``g_k = g(x_k)`` as ``updates`` and ``W_k`` round ``k % period`` of
  ``topology``:

  .. math:: y_k = W_k\, y_{k-1} + g_k - g_{k-1}, \qquad y_{-1} = g_{-1} = 0

  so ``y_0 = g_0`` (the gossip of the zero tracker at step 0 adds nothing)
  and, ``W_k`` being doubly stochastic, the mean of ``y_k`` over the
  workers equals the mean of ``g_k`` at every step (to rounding). The
  output is ``y_k``; the state keeps ``y_k`` and ``g_k``. Placed before
  :func:`decentral_jax.optim.transforms.decentralized` in a chain, the
  parameter step uses ``y_k`` in place of ``g_k``, with the same round
  ``W_k`` for the parameters (DIGing, Nedic, Olshevsky and Shi 2017,
  arXiv 1607.03218; Koloskova, Lin and Stich, NeurIPS 2021, Algorithm 1).

  Communication: one gossip round of ``y_{k-1}`` per step, through the
  bucketed ``ppermute`` gossip of :func:`decentral_jax.comm.gossip.mix`,
  with no conditional around it; it depends only on the state, so like the
  parameter gossip it may overlap the forward and backward pass. With the
  parameter gossip of the same round a step sends twice the bytes of D-SGD
  or DAdam. ``comm_dtype`` rounds the neighbours' trackers on the wire
  (each worker's own term stays exact), which perturbs the mean of ``y``
  by that rounding every step.

  Static rounds: the extra argument ``round_index=r`` (a Python int, as for
  :func:`~decentral_jax.optim.transforms.decentralized`; ``optax.chain``
  forwards it) compiles round ``r`` alone; by default the round is chosen
  in-graph from ``state.count``.

  Args:
    topology: the mixing schedule (doubly stochastic).
    axis_name: the worker mesh axis (or ``(nodes, local)``).
    comm_dtype: optional floating dtype in which the tracker is sent.
    bucket_bytes: largest gossip bucket in bytes (None: the default of
      :func:`decentral_jax.comm.gossip.check_bucket_bytes`; 0: one
      collective per leaf; the results are bit-identical).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`GradientTrackingState` (tracker and previous gradient in the
    gradients' shapes and dtypes); ``y_k`` is formed in float32 (float64
    stays float64) and returned in the gradients' dtypes.

  Raises:
    ValueError: ``topology`` not a Topology, ``comm_dtype`` not None or a
      floating dtype, ``bucket_bytes`` not None or an integer >= 0 (at
      construction); a non-floating leaf (``init``, ``update``); the fault
      arguments ``alive``/``working``/``rejoining`` (gradient tracking does
      not run over failing workers); errors of :func:`gossip.mix`.
  """
  collectives.check_axis_name(axis_name)
  gossip.check_topology(topology)
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)

  def init_fn(params):
    gossip.check_float_leaves(params, "gradient_tracking")
    zeros = jax.tree.map(jnp.zeros_like, params)
    return GradientTrackingState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update_fn(updates, state, params=None, *, round_index=None,
                alive=None, working=None, rejoining=None, **unused):
    del params, unused
    if any(m is not None for m in (alive, working, rejoining)):
      raise ValueError("gradient_tracking does not run over slow or failing "
                       "workers (alive/working/rejoining given): a dead "
                       "worker's tracker would leave the mean of y; run "
                       "without a fault schedule.")
    gossip.check_float_leaves(updates, "gradient_tracking")
    mixed = gossip.mix(state.tracker, topology,
                       transforms.round_step(state, round_index), axis_name,
                       comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    tracker = jax.tree.map(_track, mixed, updates, state.previous)
    return tracker, GradientTrackingState(
        optax.safe_increment(state.count), tracker, updates)

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)


def _track(wy, g, g_prev):
  """``(W y + g) - g_prev`` in float32 (or wider), in ``g``'s dtype."""
  dt = precision.compute_dtype(wy.dtype, g.dtype, g_prev.dtype)
  return ((wy.astype(dt) + g.astype(dt)) - g_prev.astype(dt)).astype(g.dtype)


def tracked_decentralized(inner: optax.GradientTransformation,
                          topology: topology_lib.Topology,
                          axis_name: gossip.AxisName = "workers", *,
                          form: str = "cta", comm_dtype=None,
                          bucket_bytes: int | None = None
                          ) -> optax.GradientTransformationExtraArgs:
  r"""A local optimizer ``inner`` stepping along the tracked gradient.

  ``chain(gradient_tracking, decentralized(inner))``: with ``y_k`` of
  :func:`gradient_tracking` and ``u(y_k)`` the step ``inner`` makes of it,

  .. math::
    \text{cta: } x_{k+1} = W_k x_k + u(y_k; W_k x_k), \qquad
    \text{atc: } x_{k+1} = W_k (x_k + u(y_k; x_k))

  For ``inner = optax.sgd(lr)`` these are DIGing's ``x+ = W x - lr y``
  (Nedic et al. 2017) and Koloskova et al.'s (2021, Algorithm 1) ``x+ =
  W (x - lr y)``. For Adam the tracked quantity is the gradient fed to
  Adam: Adam's moments are formed from ``y_k`` on each worker, as in GTAdam
  (Carnevale, Farina, Notarnicola and Notarstefano, "GTAdam: Gradient
  Tracking with Adaptive Momentum for Distributed Online Optimization",
  IEEE Trans. Control Netw. Syst., 2023, arXiv 2009.01745).

  Args:
    inner: the worker-local optax transform (its ``params`` are ``W_k x_k``
      for cta, ``x_k`` for atc, as in ``decentralized``).
    topology, axis_name, comm_dtype, bucket_bytes: as in
      :func:`gradient_tracking`, for both gossips (parameters and tracker).
    form: ``"cta"`` (combine-then-adapt) or ``"atc"`` (adapt-then-combine).

  Returns:
    An ``optax.GradientTransformationExtraArgs``: the state is a chain of
    :class:`GradientTrackingState` and
    :class:`~decentral_jax.optim.transforms.DecentralizedState`; the
    update is ``x_{k+1} - x_k`` in the params' dtypes (``params`` needed).

  Raises:
    ValueError: an unknown ``form``, and the errors of
      :func:`gradient_tracking` and ``decentralized``.
  """
  collectives.check_axis_name(axis_name)
  atc = check_tracking_form(form) == "atc"
  return optax.chain(
      gradient_tracking(topology, axis_name, comm_dtype=comm_dtype,
                        bucket_bytes=bucket_bytes),
      transforms.decentralized(inner, topology, axis_name,
                               mix_after_update=atc, comm_dtype=comm_dtype,
                               bucket_bytes=bucket_bytes))


def gradient_tracking_sgd(learning_rate: optax.ScalarOrSchedule,
                          topology: topology_lib.Topology, *,
                          form: str = "cta",
                          axis_name: gossip.AxisName = "workers",
                          comm_dtype=None, bucket_bytes: int | None = None
                          ) -> optax.GradientTransformationExtraArgs:
  r"""D-SGD with gradient tracking: DIGing (cta) or Algorithm 1 of
  Koloskova et al. 2021 (atc).

  .. math::
    y_k = W_k y_{k-1} + g(x_k) - g(x_{k-1}),\ y_0 = g(x_0);\quad
    x_{k+1} = W_k x_k - \gamma_k y_k\ \text{(cta)},\quad
    x_{k+1} = W_k (x_k - \gamma_k y_k)\ \text{(atc)}

  Args:
    learning_rate: ``gamma``: a number >= 0 or an optax schedule.
    topology, form, axis_name, comm_dtype, bucket_bytes: see
      :func:`tracked_decentralized`.

  Returns:
    :func:`tracked_decentralized` of ``optax.sgd(learning_rate)``.

  Raises:
    ValueError: a bad ``learning_rate`` and the errors of
      :func:`tracked_decentralized`.
  """
  arguments.check_learning_rate(learning_rate)
  return tracked_decentralized(optax.sgd(learning_rate), topology, axis_name,
                               form=form, comm_dtype=comm_dtype,
                               bucket_bytes=bucket_bytes)


def gradient_tracking_adamw(learning_rate: optax.ScalarOrSchedule,
                            topology: topology_lib.Topology, *,
                            form: str = "cta", b1: float = 0.9,
                            b2: float = 0.999, eps: float = 1e-8,
                            weight_decay: float = 0.0, mask: Any = "ndim>=2",
                            accum_steps: int = 1,
                            axis_name: gossip.AxisName = "workers",
                            comm_dtype=None, bucket_bytes: int | None = None,
                            beta_convention: str = "per_window"
                            ) -> optax.GradientTransformationExtraArgs:
  r"""DAdam (``accum_steps = 1``) or AccumAdamW with gradient tracking.

  ``chain(gradient_tracking, decentralized_adamw)``: Adam (or AccumAdam)
  takes the tracker ``y_k`` of :func:`gradient_tracking` as its gradient
  (the tracked quantity is the gradient fed to Adam, as in GTAdam,
  Carnevale et al. 2023, arXiv 2009.01745), and the step is made from
  ``W_k x_k`` (cta, DAdam's order) or made and then mixed (atc)::

    cta: x_{k+1} = (1 - lr wd mask) W_k x_k - lr d_k(y_k)
    atc: x_{k+1} = W_k ((1 - lr wd mask) x_k - lr d_k(y_k))

  Args:
    learning_rate, b1, b2, eps, weight_decay, mask, accum_steps,
      beta_convention: as in
      :func:`~decentral_jax.optim.transforms.decentralized_adamw`.
    topology, form, axis_name, comm_dtype, bucket_bytes: see
      :func:`tracked_decentralized`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (state: a chain of
    :class:`GradientTrackingState` and ``DecentralizedState``).

  Raises:
    ValueError: an unknown ``form``, and the errors of
      :func:`gradient_tracking` and ``decentralized_adamw``.
  """
  atc = check_tracking_form(form) == "atc"
  return optax.chain(
      gradient_tracking(topology, axis_name, comm_dtype=comm_dtype,
                        bucket_bytes=bucket_bytes),
      transforms.decentralized_adamw(
          learning_rate, topology, b1=b1, b2=b2, eps=eps,
          weight_decay=weight_decay, mask=mask, accum_steps=accum_steps,
          axis_name=axis_name, mix_after_update=atc, comm_dtype=comm_dtype,
          bucket_bytes=bucket_bytes, beta_convention=beta_convention))
