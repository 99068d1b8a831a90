"""Gossip over live workers: a round's mixing matrix restricted to a live mask.

With live mask ``a`` (bool [n], equal on all workers) and round ``W``, the
round actually applied is

.. math::
  w'_{ij} = w_{ij} a_i a_j \\ (i \\ne j), \\qquad
  w'_{ii} = 1 - \\textstyle\\sum_{j \\ne i} w'_{ij} \\ (a_i = 1), \\qquad
  w'_{i\\cdot} = e_i \\ (a_i = 0):

a live worker keeps for itself the weight of its dead neighbours, a dead
worker's row is the identity (its parameters, and with :func:`freeze` its
optimizer state, stay bit for bit). For a symmetric ``W`` (every built-in
topology but ``exponential`` with ``n >= 4``) ``W'`` is symmetric and
doubly stochastic on the live set, so the mean over live workers is
preserved. For a directed ``W`` (``exponential``) a live worker's column
loses the weight it would send to dead receivers but keeps none of it, so
``W'`` is only row stochastic and the live mean may drift until the dead
workers return.

:func:`live_mix` realises ``W'`` with the collectives of the round itself
(:func:`decentral_jax.comm.gossip.mix`, whatever the mesh: flat ``ppermute``
terms, ``pmean``, node-aware or several workers per device) and no
conditional: a dead worker sends zeros, so each receiver's term from a dead
sender vanishes (the sender's liveness is in the replicated mask), each live
receiver adds ``d_i x_i`` with ``d_i = sum_{j != i} w_ij (1 - a_j)`` (its
dropped weight, read from the round's sparse rows and the mask), and a dead
receiver keeps ``x_i``. With every worker alive both corrections are
skipped by selects, so the same products are summed in the same order as
in :func:`gossip.mix`; the result agrees with it to within the rounding of
those products (see :func:`live_mix`), not always bit for bit.

The fault and straggler schedule that gives the masks is
:class:`decentral_jax.comm.fault_schedule.FaultSchedule`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.topology.rounds import Round

PyTree = Any


def check_mask(mask, n: int, name: str) -> jax.Array:
  """``mask`` as a bool [n] array.

  Raises:
    ValueError: another shape or dtype, or not an array at all (naming
      ``name``).
  """
  try:
    if mask is None:
      raise TypeError
    m = jnp.asarray(mask)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a bool array of shape ({n},) (one "
                     f"entry per worker, equal on all workers), got "
                     f"{type(mask).__name__} {str(mask)[:40]}.") from None
  if m.shape != (n,) or m.dtype != jnp.bool_:
    raise ValueError(f"{name} must be a bool array of shape ({n},) (one "
                     f"entry per worker, equal on all workers), got "
                     f"{m.dtype}{list(m.shape)}.")
  return m


def _neighbour_table(rnd: Round):
  """``(cols, vals)`` int32/float64 [n, K]: each row's off-diagonal entries.

  Padded with column ``i`` and weight 0; ``K`` is the largest off-diagonal
  count of a row (at least 1).
  """
  csr = rnd.sparse_matrix()
  n = rnd.n_workers
  rows = np.repeat(np.arange(n), np.diff(csr.indptr))
  off = rows != csr.indices
  rows, cols, vals = rows[off], csr.indices[off], csr.data[off]
  counts = np.bincount(rows, minlength=n)
  k = max(int(counts.max(initial=0)), 1)
  slot = np.arange(rows.size) - np.repeat(
      np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
  table_c = np.tile(np.arange(n)[:, None], (1, k)).astype(np.int32)
  table_v = np.zeros((n, k))
  table_c[rows, slot] = cols
  table_v[rows, slot] = vals
  return table_c, table_v


def _off_weight(rnd: Round, send: jax.Array, me, dtype):
  """``sum_{j != me} W[me, j] send_j`` for a bool [n] ``send`` (scalar).

  Group means use the group's size and count (O(n), no [n, n] table);
  other rounds a padded table of each row's off-diagonal entries.
  """
  part = rnd.partition
  if part is not None:  # group means: entries 1/|G| within 1e-15
    labels = jnp.asarray(part.labels(), jnp.int32)
    size = jnp.asarray(part.sizes[part.labels()], dtype)[me]
    others = (labels == labels[me]) & send & (jnp.arange(send.size) != me)
    return jnp.sum(others).astype(dtype) / size
  cols, vals = _neighbour_table(rnd)
  row_c = jnp.asarray(cols)[me]
  row_v = jnp.asarray(vals, dtype)[me]
  return jnp.sum(jnp.where(send[row_c], row_v, jnp.zeros_like(row_v)))


def _per_round(topology, step, fn):
  """``fn(round)`` for round ``step`` (int, or traced: ``lax.switch``)."""
  if isinstance(step, (int, np.integer)):
    return fn(topology.round(int(step)))
  if len(topology.distinct_rounds) == 1:
    return fn(topology.distinct_rounds[0])
  table = jnp.asarray(topology.round_to_distinct, jnp.int32)
  index = collectives.uniform(
      table[jnp.asarray(step).astype(jnp.int32) % topology.period])
  return lax.switch(index, [lambda r=r: fn(r)
                            for r in topology.distinct_rounds])


def _weight_dtype(tree) -> jnp.dtype:
  leaves = jax.tree.leaves(tree)
  return jnp.result_type(jnp.float32, *[jnp.result_type(x) for x in leaves])


def dropped_weight(topology: topology_lib.Topology, step, alive,
                   axis_name: gossip.AxisName = "workers", dtype=jnp.float32):
  """This worker's dropped weight ``d_i = sum_{j != i} w_ij (1 - a_j)``.

  Must run inside ``shard_map`` over ``axis_name``; ``alive`` is bool [n],
  equal on all workers; ``step`` an int or a traced integer scalar. Returns
  a scalar of ``dtype`` (0 exactly when every neighbour is alive).
  """
  gossip.check_topology(topology)
  a = check_mask(alive, topology.n_workers, "alive")
  me = collectives.index(axis_name)

  return _per_round(topology, step,
                    lambda rnd: _off_weight(rnd, ~a, me, dtype))


def live_mix(tree: PyTree, topology: topology_lib.Topology, step, alive,
             axis_name: gossip.AxisName = "workers", *, comm_dtype=None,
             bucket_bytes: int | None = gossip.DEFAULT_BUCKET_BYTES
             ) -> PyTree:
  """Applies the round restricted to the live workers, ``x <- W'_step x``.

  ``W'`` is defined in the module docstring: ``w'_ij = w_ij a_i a_j``
  (``i != j``), ``w'_ii = 1 - sum_{j != i} w'_ij`` for a live ``i``,
  identity rows for dead workers. Computed as ``y = W (a * x)`` with the
  round's own collectives, then ``x'_i = y_i + d_i x_i`` for a live ``i``
  (``d_i``: :func:`dropped_weight`; skipped where ``d_i = 0``) and
  ``x'_i = x_i`` for a dead one. In exact arithmetic ``y_i + d_i x_i`` is
  ``sum_j w'_ij x_j``; in floating point the dropped weight is added to
  ``x_i``'s term as a second product (for 16-bit leaves ``y_i`` is rounded
  to the leaf dtype before it).

  With every worker alive the selects pass ``x`` and ``y`` through, so the
  program sums the products of :func:`gossip.mix` in its order, but not
  always in the same kernel: XLA fuses the selects on the (uniform) mask
  with the sum, and the compiled kernel may then contract a product into
  its sum (an FMA) where :func:`gossip.mix`'s kernel rounds it apart, or
  the reverse (XLA:CPU, ``static_ring`` and ``torus``: about one value in
  twenty differs by one ulp). The guarantee is the sum's own rounding
  error: per element ``|live_mix - gossip.mix| <= 2 k u sum_j |w_ij
  x_j|`` with ``k`` the terms of row ``i`` and ``u`` the unit roundoff of
  the weights' dtype (float32 for 16-bit leaves, which may then also
  round one ulp of the leaf dtype apart). Making it exact would take a
  conditional around the collectives; the runner instead runs a step in
  which everyone is alive without masks, bit for bit.

  Args:
    tree: pytree of worker-local float arrays (as :func:`gossip.mix`).
    topology: the gossip schedule (doubly stochastic).
    step: Python int or traced integer scalar, equal on all workers.
    alive: bool [n], the live mask, equal on all workers (a traced array:
      one compiled step serves every mask).
    axis_name, comm_dtype, bucket_bytes: as for :func:`gossip.mix`.

  Returns:
    A pytree like ``tree``; dead workers' leaves are their inputs bit for
    bit, and with every worker alive the result is
    ``gossip.mix(tree, topology, step, ...)`` to within the bound above.

  Raises:
    ValueError: ``alive`` not bool of shape ``(n,)``, or anything
      :func:`gossip.mix` refuses.
  """
  gossip.check_topology(topology)
  a = check_mask(alive, topology.n_workers, "alive")
  if topology.n_workers == 1:
    return gossip.mix(tree, topology, step, axis_name, comm_dtype=comm_dtype,
                      bucket_bytes=bucket_bytes)
  mine = a[collectives.index(axis_name)]
  sent = jax.tree.map(lambda x: jnp.where(mine, x, jnp.zeros_like(x)), tree)
  mixed = gossip.mix(sent, topology, step, axis_name, comm_dtype=comm_dtype,
                     bucket_bytes=bucket_bytes)
  d = dropped_weight(topology, step, a, axis_name, _weight_dtype(tree))

  def fix(y, x):
    acc = jnp.promote_types(x.dtype, jnp.float32)
    kept = (y.astype(acc) + d.astype(acc) * x.astype(acc)).astype(x.dtype)
    return jnp.where(mine, jnp.where(d == 0, y, kept), x)

  return jax.tree.map(fix, mixed, tree)


def freeze(new: PyTree, old: PyTree, alive,
           axis_name: gossip.AxisName = "workers") -> PyTree:
  """``new`` on live workers, ``old`` on dead ones (any leaf dtype).

  For optimizer states and parameters of a dead worker: its row of ``W'``
  is the identity and its state must not move either.

  Args:
    new, old: pytrees of one structure (worker-local arrays).
    alive: bool [n], equal on all workers (``n`` the size of the axis).
    axis_name: the worker axis (inside ``shard_map``).

  Raises:
    ValueError: ``alive`` not bool of shape ``(n,)``, or ``new`` and
      ``old`` of different structures.
  """
  a = check_mask(alive, collectives.size(axis_name), "alive")
  _check_same_structure(new, old, "freeze")
  mine = a[collectives.index(axis_name)]
  return jax.tree.map(lambda y, x: jnp.where(mine, y, x), new, old)


def _check_same_structure(new, old, where: str) -> None:
  s_new, s_old = jax.tree.structure(new), jax.tree.structure(old)
  if s_new != s_old:
    raise ValueError(f"{where}: new and old must be pytrees of one structure, "
                     f"got {s_new} and {s_old}.")


def _check_rejoining(alive, rejoining, a, r) -> jax.Array:
  """``r & a``; refused if the masks as given name a dead rejoining worker.

  ``alive`` and ``rejoining`` are the arguments as given (inside ``jit``
  their checked arrays ``a`` and ``r`` are traced even for constants).
  """
  if not any(isinstance(m, jax.core.Tracer) for m in (alive, rejoining)):
    bad = np.flatnonzero(np.asarray(rejoining) & ~np.asarray(alive))
    if bad.size:
      raise ValueError(f"rejoining names worker {int(bad[0])}, which is not "
                       "alive; a rejoining worker must be alive (rejoining "
                       "is alive now and dead at the previous step).")
  return r & a


def neighbour_mean(tree: PyTree, topology: topology_lib.Topology, step,
                   alive, rejoining, axis_name: gossip.AxisName = "workers"
                   ) -> PyTree:
  """A rejoining worker's parameters from the mean of its live neighbours.

  For a worker with ``rejoining_i``: ``x_i <- sum_{j != i} w_ij s_j x_j /
  sum_{j != i} w_ij s_j`` with senders ``s = alive & ~rejoining`` (workers
  with current parameters) and ``W`` round ``step``; kept stale if no
  neighbour of this round is a sender. Every other worker keeps ``x_i``.
  The exchange is one :func:`gossip.mix`, inside a conditional on
  ``any(rejoining)`` (equal on all workers), so steps without a rejoin
  communicate nothing.

  Args:
    tree: pytree of worker-local float arrays.
    topology, step: the gossip schedule and step (int or traced).
    alive, rejoining: bool [n], equal on all workers; every rejoining
      worker is alive (a traced ``rejoining`` is restricted to ``alive``).
    axis_name: the worker axis.

  Returns:
    A pytree like ``tree``.

  Raises:
    ValueError: ``topology`` not a Topology, a mask not bool of shape
      ``(n,)``, a concrete ``rejoining`` naming a dead worker, or anything
      :func:`gossip.mix` refuses.
  """
  gossip.check_topology(topology)
  n = topology.n_workers
  a = check_mask(alive, n, "alive")
  r = _check_rejoining(alive, rejoining, a,
                       check_mask(rejoining, n, "rejoining"))
  senders = a & ~r
  me = collectives.index(axis_name)

  def rejoin(t):
    sent = jax.tree.map(
        lambda x: jnp.where(senders[me], x, jnp.zeros_like(x)), t)
    mixed = gossip.mix(sent, topology, step, axis_name)
    dtype = _weight_dtype(t)
    w = _per_round(topology, step,
                   lambda rnd: _off_weight(rnd, senders, me, dtype))
    take = r[me] & (w > 0)
    safe = jnp.where(take, w, jnp.ones_like(w))
    return jax.tree.map(
        lambda y, x: jnp.where(take, (y.astype(dtype) / safe).astype(x.dtype),
                               x), mixed, t)

  return gossip.every(None, jnp.any(r), rejoin, lambda t: t, tree)


def from_worker(tree: PyTree, worker, axis_name: gossip.AxisName = "workers",
                *, only_int: bool = False) -> PyTree:
  """Each leaf as worker ``worker`` holds it, on every worker (one ``psum``).

  For a rejoining worker's optimizer state: its counters (and with
  ``only_int=False`` everything else) from a live worker, never its own
  stale ones. ``bool`` leaves, and with ``only_int`` every non-integer
  leaf, are kept as they are.

  Args:
    tree: pytree of worker-local arrays.
    worker: an int in ``[0, n)`` or an integer scalar array, equal on all
      workers (e.g. the first live one). A traced index cannot be checked:
      one outside ``[0, n)`` gives zeros.
    axis_name: the worker axis (inside ``shard_map``).
    only_int: copy the integer leaves only.

  Raises:
    ValueError: ``worker`` a bool, a float, an int outside ``[0, n)``, or
      an array that is not an integer scalar.
  """
  worker = _check_worker(worker, collectives.size(axis_name))
  me = collectives.index(axis_name)

  def one(x):
    x = jnp.asarray(x)
    integer = jnp.issubdtype(x.dtype, jnp.integer)
    if x.dtype == jnp.bool_ or (only_int and not integer):
      return x
    got = collectives.psum(jnp.where(me == worker, x, jnp.zeros_like(x)),
                           axis_name)
    return gossip.match_varying(got.astype(x.dtype), x)

  return jax.tree.map(one, tree)


def _check_worker(worker, n: int):
  """``worker`` as an int in ``[0, n)`` or an integer scalar array."""
  if isinstance(worker, (jax.Array, np.ndarray)) and not isinstance(
      worker, np.generic):
    if worker.shape != () or not jnp.issubdtype(worker.dtype, jnp.integer):
      raise ValueError(f"worker must be an int in [0, {n}) or an integer "
                       f"scalar array, got {worker.dtype}{list(worker.shape)}.")
    if isinstance(worker, jax.core.Tracer):
      return worker
    worker = worker.item()
  return checks.check_int("worker", worker, minimum=0, maximum=n - 1)
