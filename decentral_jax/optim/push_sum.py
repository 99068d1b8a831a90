"""Stochastic gradient push (SGP): push-sum gossip over directed graphs.

Plain gossip (:mod:`decentral_jax.optim`) needs doubly stochastic mixing
matrices, i.e. every worker must *receive* weights summing to 1. On a
directed graph a worker controls only what it *sends*: column ``j`` of
``P_k`` (worker ``j``'s own share plus what it pushes to its out-neighbours)
sums to 1, the rows need not. Push-sum (Kempe et al. 2003) runs the same
column-stochastic mixing on a scalar weight ``w_i`` next to the parameters
and uses the ratio ``z_i = x_i / w_i``, which corrects the bias of the
unequal in-weights.

A train step of worker ``i`` (one worker's view, inside ``shard_map``)::

  tx = push_sum(optax.sgd(lr), topo, "workers")      # or sgp(lr, topo)
  def train_step(x, opt_state, batch):
    z = debiased(x, opt_state)                       # z_i^k = x_i^k / w_i^k
    grads = jax.grad(loss_fn)(z, batch)              # g(z_i^k)
    updates, opt_state = tx.update(grads, opt_state, x)
    return optax.apply_updates(x, updates), opt_state

The parameters the runner holds are the numerators ``x_i``; the model to
evaluate (and to compute gradients at) is ``debiased(x, opt_state)``.

References:
  Assran, Loizou, Ballas, Rabbat, `Stochastic Gradient Push for Distributed
  Deep Learning <https://arxiv.org/abs/1811.10792>`_, ICML 2019 (Alg. 1).
  Kempe, Dobra, Gehrke, Gossip-Based Computation of Aggregate Information,
  FOCS 2003 (push-sum).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.topology.rounds import check_column_sums

PyTree = Any


class PushSumState(NamedTuple):
  """State of :func:`push_sum` (worker-local; stacked ``[n, ...]`` outside)."""
  count: jax.Array  # shape=(), int32: step k, selects round k % period.
  weight: jax.Array  # shape=(), float32 (float64 for float64 params): w_i^k.
  inner_state: optax.OptState  # the local optimizer's state (worker-local).


def weight_dtype(params: PyTree) -> jnp.dtype:
  """Dtype of the push-sum weight: float32, or float64 for float64 params."""
  return jnp.result_type(jnp.float32,
                         *[jnp.result_type(x) for x in jax.tree.leaves(params)])


def check_column_stochastic(topology: topology_lib.Topology) -> None:
  """Raises ``ValueError`` unless every round of ``topology`` is column stochastic.

  Doubly stochastic topologies (every built-in one) pass. Each round is
  checked on its stored entries (:meth:`topology.Round.is_nonnegative_finite`,
  column sums of the sparse plan), O(nnz) time and memory, never a dense
  ``[n, n]`` matrix (2 GiB per round at n = 16384).

  Raises:
    ValueError: ``topology`` not a :class:`topology.Topology`; a round with
      negative or non-finite weights, or a column not summing to 1 within
      1e-9 (the message names the round, column and sum).
  """
  if not isinstance(topology, topology_lib.Topology):
    raise ValueError(f"push_sum needs a decentral_jax.topology.Topology, got "
                     f"{type(topology).__name__}.")
  for k, rnd in enumerate(topology.rounds):
    where = f"push_sum: round {k} of topology {topology.name!r}"
    if not rnd.is_nonnegative_finite():
      raise ValueError(f"{where} has negative or non-finite weights.")
    try:
      check_column_sums(rnd, where)
    except ValueError as e:
      raise ValueError(f"{e} Build directed schedules with topology."
                       "from_matrices(..., column_stochastic=True).") from None


def _divide(params: PyTree, weight) -> PyTree:
  """``x / w`` per leaf, in the wider of the two dtypes, back in ``x``'s.

  A stacked weight ``[n]`` divides stacked leaves ``[n, ...]`` row by row.
  """
  weight = jnp.asarray(weight)

  def leaf(x):
    x = jnp.asarray(x)
    dt = jnp.result_type(x.dtype, weight.dtype)
    w = weight.reshape(weight.shape + (1,) * (x.ndim - weight.ndim))
    return (x.astype(dt) / w.astype(dt)).astype(x.dtype)

  return jax.tree.map(leaf, params)


def push_sum(inner: optax.GradientTransformation,
             topology: topology_lib.Topology,
             axis_name: gossip.AxisName = "workers", *,
             comm_dtype=None,
             bucket_bytes: int | None = None
             ) -> optax.GradientTransformationExtraArgs:
  r"""Stochastic gradient push: a local optimizer with push-sum mixing.

  With ``P_k`` the matrix of round ``k % period`` (rows = receivers, columns
  summing to 1) and ``g_i`` worker ``i``'s stochastic gradient, taken by the
  caller at ``z_i^k = debiased(x_i^k, state)``:

  .. math::
    z_i^k &= x_i^k / w_i^k \\
    u_i^k &= \mathrm{inner}(g_i(z_i^k);\ \text{params}=z_i^k) \\
    x_i^{k+1/2} &= x_i^k + u_i^k \\
    x_i^{k+1} &= \textstyle\sum_j P_k[i, j]\, x_j^{k+1/2}, \qquad
    w_i^{k+1} = \textstyle\sum_j P_k[i, j]\, w_j^k

  with ``w_i^0 = 1`` (Assran et al. 2019, Alg. 1; for SGD ``u = -lr g``).
  Column stochasticity keeps ``sum_i w_i = n`` and changes ``sum_i x_i``
  only by the local updates. With a doubly stochastic ``P_k`` the weights
  stay 1 and this is D-PSGD in adapt-then-combine order,
  ``decentralized(inner, topology, mix_after_update=True)``.

  The returned update is ``x^{k+1} - x^k`` (formed in the parameter dtype),
  so ``optax.apply_updates`` gives the new numerator and the transform
  composes with ``optax.chain`` (e.g. after ``optax.clip_by_global_norm``).
  The round is ``count % period``, chosen with ``lax.switch`` (one compile),
  or the static Python int passed as the extra argument ``round_index``.

  Args:
    inner: worker-local optax transform producing the local update ``u``;
      it sees ``params = z`` (decoupled weight decay acts on ``z``).
    topology: column-stochastic schedule (any doubly stochastic one, or
      ``topology.from_matrices(..., column_stochastic=True)``,
      :func:`one_peer_directed_exp`).
    axis_name: worker mesh axis (or ``(nodes, local)``).
    comm_dtype: optional floating dtype in which numerators are sent; the
      weight is always sent in its own dtype so that mass is conserved.
    bucket_bytes: largest gossip bucket in bytes; None: the default, 0: one
      collective per leaf (bit-identical; see
      :func:`decentral_jax.comm.gossip.check_bucket_bytes`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with :class:`PushSumState`
    (``weight``: shape ``()``, float32, float64 for float64 params; fixed at
    ``init``); ``update(grads, state, params)`` takes the numerators ``x``
    as ``params`` and must run inside ``jax.shard_map`` over ``axis_name``.
    Updates have the shapes and dtypes of ``params``.

  Raises:
    ValueError: ``inner`` not an optax transform, a round of ``topology``
      that is not column stochastic (the message names the round, column
      and sum); ``comm_dtype`` not None or floating, or a bad
      ``bucket_bytes`` (at construction); ``params`` not passed to ``update``;
      errors of :func:`decentral_jax.comm.gossip.mix` (mesh axis size,
      non-floating leaves).

  References:
    Assran et al., ICML 2019 (arXiv 1811.10792), Alg. 1.
  """
  collectives.check_axis_name(axis_name)
  arguments.check_transform("inner", inner)
  check_column_stochastic(topology)
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return PushSumState(jnp.zeros([], jnp.int32),
                        jnp.ones([], weight_dtype(params)), inner.init(params))

  def update_fn(updates, state, params=None, *, round_index=None,
                **extra_args):
    if params is None:
      raise ValueError(
          "push_sum needs the numerators x_i (the parameters): call "
          "tx.update(grads, state, params) with params, and take grads at "
          "debiased(params, state).")
    step = transforms.round_step(state, round_index)
    z = _divide(params, state.weight)
    local, inner_state = inner.update(updates, state.inner_state, z,
                                      **extra_args)
    stepped = optax.apply_updates(params, local)  # x^{k+1/2}, param dtype
    mix = lambda t, dt: gossip.mix(t, topology, step, axis_name,
                                   comm_dtype=dt, column_stochastic=True,
                                   bucket_bytes=bucket_bytes)
    if comm_dtype is None:
      target, weight = mix((stepped, state.weight), None)
    else:
      target, weight = mix(stepped, comm_dtype), mix(state.weight, None)
    new_updates = jax.tree.map(lambda t, p: (t - p).astype(p.dtype),
                               target, params)
    return new_updates, PushSumState(optax.safe_increment(state.count),
                                     weight, inner_state)

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)


def sgp(learning_rate: optax.ScalarOrSchedule,
        topology: topology_lib.Topology, *, momentum: float | None = None,
        nesterov: bool = False, axis_name: gossip.AxisName = "workers",
        comm_dtype=None, bucket_bytes: int | None = None
        ) -> optax.GradientTransformationExtraArgs:
  """SGP with (heavy-ball or Nesterov) SGD: ``push_sum(optax.sgd(...), ...)``.

  See :func:`push_sum` for the recursion, state and errors; the momentum
  buffer is worker-local and fed with ``g(z_i^k)``.

  Raises:
    ValueError: also ``learning_rate`` not a schedule or a finite number
      >= 0, ``momentum`` not None or in [0, 1), ``nesterov`` not a bool.
  """
  arguments.check_learning_rate(learning_rate)
  if momentum is not None:
    arguments.check_hyperparameter("momentum", momentum, below_one=True,
                                        wide=False)
  checks.check_bool("nesterov", nesterov)
  return push_sum(optax.sgd(learning_rate, momentum=momentum,
                            nesterov=nesterov),
                  topology, axis_name, comm_dtype=comm_dtype,
                  bucket_bytes=bucket_bytes)


def _is_state(s) -> bool:
  return isinstance(s, PushSumState)


def find_state(opt_state: optax.OptState) -> PushSumState:
  """The :class:`PushSumState` inside ``opt_state`` (e.g. of an ``optax.chain``).

  Raises:
    ValueError: ``opt_state`` holds no push-sum state, or more than one.
  """
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state)
           if _is_state(s)]
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
        f"opt_state holds {what} PushSumState; pass the state of a "
        "transform containing exactly one push_sum (it holds the weight w).")
  return found[0]


def debiased(params: PyTree, opt_state: optax.OptState) -> PyTree:
  """``z = x / w``: the parameters to evaluate and take gradients at.

  Args:
    params: this worker's numerators ``x_i`` (what ``apply_updates`` keeps),
      or, with the matching stacked ``opt_state``, all workers' ``[n, ...]``
      (outside ``shard_map``, e.g. on a restored checkpoint).
    opt_state: a state holding one :class:`PushSumState`.

  Returns:
    A pytree like ``params`` (same shapes and dtypes); the division is done
    in the wider of the leaf and weight dtypes.

  Raises:
    ValueError: see :func:`find_state`.
  """
  return _divide(params, find_state(opt_state).weight)


def global_average(params: PyTree, opt_state: optax.OptState,
                   axis_name: gossip.AxisName = "workers"
                   ) -> tuple[PyTree, optax.OptState]:
  """Exact all-worker average of numerators and weights (inside shard_map).

  Sets ``x_i <- (1/n) sum_j x_j`` and ``w_i <- (1/n) sum_j w_j`` (= 1 up to
  rounding), a push-sum round with ``P = 11^T/n``: the sums of ``x`` and
  ``w`` are kept, and afterwards ``z_i = x_i / w_i`` is equal on all workers
  (the consensus value ``sum_j x_j / sum_j w_j``). Use it for periodic
  global averaging instead of averaging the parameters alone.

  Returns:
    ``(params, opt_state)`` with the same structure, shapes and dtypes.

  Raises:
    ValueError: see :func:`find_state`.
  """
  find_state(opt_state)
  avg = lambda s: (s._replace(weight=gossip.mean(s.weight, axis_name))
                   if _is_state(s) else s)
  return (gossip.mean(params, axis_name),
          jax.tree.map(avg, opt_state, is_leaf=_is_state))


def one_peer_directed_exp(n_workers: int,
                          local_size: int = 1) -> topology_lib.Topology:
  """Directed one-peer exponential graph of Assran et al. (2019).

  Round ``r`` (period ``ceil(log2 n)``, 1 for ``n <= 2``): worker ``i``
  keeps 1/2 and sends 1/2 to ``(i + 2^r) mod n``, i.e. ``P_r[i, i] = 1/2``,
  ``P_r[(i + 2^r) mod n, i] = 1/2``. Each worker sends and receives one
  message per step; since the shift is a permutation the matrices are in
  fact doubly stochastic, so the push-sum weights stay 1 on this graph.

  Raises:
    ValueError: ``n_workers`` not an integer >= 1 or ``local_size`` not
      dividing it.
  """
  n = topology_lib.check_n_workers(n_workers)
  mats = []
  for r in range(max(1, (n - 1).bit_length())):
    p = np.eye(n) / 2 if n > 1 else np.eye(1)
    for i in range(n if n > 1 else 0):
      p[(i + (1 << r)) % n, i] += 0.5
    mats.append(p)
  return topology_lib.from_matrices(mats, name="one_peer_directed_exp",
                                    local_size=local_size,
                                    column_stochastic=True)
