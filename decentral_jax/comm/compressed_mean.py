"""Compressed worker means: reduce-scattered codes and gathered payloads.

Two ways to average ``n`` workers' values sent with a
:class:`~decentral_jax.comm.compress.Compressor`, each with its hand count
of the bytes one worker sends:

* :func:`mean_compressed`: the scaled formats' all-reduce of codes (an
  all-to-all of each worker's quantized shards, a float32 sum per shard,
  an all-gather of the re-quantized mean), ``2 (n - 1) / n`` of the
  payload (:func:`mean_payload_bytes`);
* :func:`gather_mean_compressed`: every worker's payload all-gathered and
  decoded (SparseLoCo's aggregation of top-k vectors, Sarfi et al., arXiv
  2508.15706), ``(n - 1)`` payloads (:func:`gather_payload_bytes`).

Both must run inside ``jax.shard_map`` over the worker axis and end with
the same values on every worker. Imports :mod:`decentral_jax.comm.compress`
(the codecs) and :mod:`decentral_jax.comm.collectives`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import compress
from decentral_jax.comm import gossip

PyTree = Any


def _rows(payload: compress.Payload, n: int) -> compress.Payload:
  """Payload arrays ``[n * r, ...]`` viewed as ``[n, r, ...]`` (a row per worker)."""
  return {k: a.reshape((n, -1) + a.shape[1:]) for k, a in payload.items()}


def _encode_mean(total, recv, n, compressor, shard) -> compress.Payload:
  """``Q(total / n)``, or ``Q(sum_j deQ_j / n)`` (the sum of the shares)
  where ``total`` overflowed float32 (finite codes: that mean is finite).

  Both are computed and the payload selected, without a branch (no host
  synchronization on GPUs); the shares are decoded again behind an
  ``optimization_barrier`` so the common path is ``Q(total / n)`` as XLA
  simplifies it alone (bit for bit the DiLoCo family's fixtures)."""
  again = jax.lax.optimization_barrier(recv)
  scaled = jnp.zeros_like(shard)
  for j in range(n):
    scaled = scaled + compressor.decode(
        {k: a[j] for k, a in again.items()}, shard) / n
  ok = jnp.all(jnp.isfinite(total))
  mine, shares = compressor.encode(total / n), compressor.encode(scaled)
  return {k: jnp.where(ok, mine[k], shares[k]) for k in mine}


def _mean_leaf(x, axis_name, compressor: compress.Compressor):
  """Compressed mean of one leaf: codes reduce-scattered, summed, gathered."""
  if x.size == 0:  # nothing to send: the mean of no values
    return x
  n = collectives.size(axis_name)
  acc = _sum_dtype(x, compressor)
  flat = (compress.to_float32(x.reshape(-1)) if acc == jnp.float32
          else x.reshape(-1).astype(acc))
  unit = n * compressor.block
  padded = -(-flat.size // unit) * unit
  flat = jnp.concatenate([flat, jnp.zeros((padded - flat.size,), acc)])
  shard = jnp.zeros((padded // n,), acc)  # shape of one row
  sent = _rows(compressor.encode(flat), n)  # row j: my values of shard j
  recv = {k: collectives.all_to_all(a, axis_name) for k, a in sent.items()}
  total = jnp.zeros_like(shard)
  for j in range(n):  # float32 sum of every worker's shard, in worker order
    total = total + compressor.decode({k: a[j] for k, a in recv.items()}, shard)
  mine = _encode_mean(total, recv, n, compressor, shard)
  gathered = {k: collectives.all_gather(a, axis_name) for k, a in mine.items()}
  rows = [compressor.decode({k: a[j] for k, a in gathered.items()}, shard)
          for j in range(n)]
  out = jnp.concatenate(rows)[:x.size].reshape(x.shape).astype(x.dtype)
  return collectives.match_varying(out, x)


def _sum_dtype(x, compressor: compress.Compressor):
  """float32, or for ``none`` (values sent as they are) the leaf's own
  dtype if wider (float64 is summed in float64, as sent)."""
  if compressor.is_identity:
    return jnp.promote_types(jnp.result_type(x), jnp.float32)
  return jnp.dtype(jnp.float32)


def mean_compressed(tree: PyTree, axis_name="workers", *,
                    compressor: compress.Compressor) -> PyTree:
  """The worker mean ``(1/n) sum_j x_j`` sent compressed, summed in float32.

  Per leaf (flattened, zero-padded to a multiple of ``n x block``, split
  into ``n`` shards): every worker sends ``Q`` of shard ``j`` to worker
  ``j`` (``all_to_all`` of the payload), worker ``j`` decodes the ``n``
  contributions and sums them in float32, re-quantizes its mean shard, and
  the shards are all-gathered and decoded. Every worker ends with the same
  values: ``deQ(Q(sum_j deQ(Q(x_j)) / n))`` (where that sum overflows
  float32, ``sum_j (deQ(Q(x_j)) / n)``, so a mean within float32's range
  stays finite). Bytes each worker sends, in the accounting's
  conventions: ``(n - 1) / n`` of the full payload for the all-to-all plus
  ``(n - 1)`` shard payloads for the all-gather, i.e. ``2 (n - 1) / n x
  payload_bytes(padded size)``, the ring figure of an all-reduce of the
  codes; an empty leaf is returned as it is and sends nothing.

  Must run inside ``jax.shard_map`` over ``axis_name``. With
  ``Compressor("none")`` the values are exact (sent and summed in the
  leaf's dtype, float32 at least) but summed in another order than
  ``pmean``; use :func:`decentral_jax.comm.gossip.mean` for the exact
  mean.

  Args:
    tree: pytree of floating arrays (this worker's values).
    axis_name: the worker axis.
    compressor: the :class:`compress.Compressor`.

  Returns:
    A pytree of the same structure, shapes and dtypes, equal on every
    worker.

  Raises:
    ValueError: a non-floating leaf or a compressor of the wrong type.
  """
  return _map_checked(tree, compressor,
                      lambda x: _mean_leaf(x, axis_name, compressor))


def _map_checked(tree: PyTree, compressor: compress.Compressor, leaf) -> PyTree:
  """``leaf`` over the leaves of ``tree`` after the compressed means' checks."""
  compress.check_compressor(compressor)
  gossip.check_float_leaves(tree, "compressed mean", compressed=True)
  return jax.tree.map(leaf, tree)


def mean_payload_bytes(tree: PyTree, n_workers: int,
                       compressor: compress.Compressor) -> float:
  """Hand count: bytes one worker sends in :func:`mean_compressed` of ``tree``.

  Raises:
    ValueError: ``n_workers`` not an int >= 1, or ``compressor`` not a
      :class:`compress.Compressor`.
  """
  n = checks.check_int("n_workers", n_workers, minimum=1)
  compress.check_compressor(compressor)
  unit = n * compressor.block
  total = 0.0
  for x in jax.tree.leaves(tree):
    size = int(np.prod(np.shape(x)))
    padded = -(-size // unit) * unit  # an empty leaf sends nothing
    itemsize = jnp.dtype(_sum_dtype(x, compressor)).itemsize
    total += 2 * (n - 1) / n * compressor.payload_bytes(padded, itemsize)
  return total


# ---------------------------------------------------------------------------
# Sparse mean: every worker's payload gathered (SparseLoCo's all-gather).
# ---------------------------------------------------------------------------


def _gather_mean_leaf(x, axis_name, compressor: compress.Compressor):
  """Mean of one leaf from every worker's gathered payload (float32 sum)."""
  n = collectives.size(axis_name)
  acc = jnp.promote_types(x.dtype, jnp.float32)
  gathered = collectives.all_gather(compressor.encode(x), axis_name)
  total = jnp.zeros(x.shape, acc)
  for j in range(n):  # in worker order, as a NumPy reference would
    total = total + compressor.decode({k: a[j] for k, a in gathered.items()},
                                      x).astype(acc)
  # Where the sum overflows, the sum of the shares (decoded again behind a
  # barrier; top-k's common path is unchanged bit for bit, the scaled
  # formats' may round differently where XLA fuses the two).
  again = jax.lax.optimization_barrier(gathered)
  scaled = jnp.zeros(x.shape, acc)
  for j in range(n):
    scaled = scaled + compressor.decode(
        {k: a[j] for k, a in again.items()}, x).astype(acc) / n
  mean = jnp.where(jnp.isfinite(total), total / n, scaled)
  return collectives.match_varying(mean.astype(x.dtype), x)


def gather_mean_compressed(tree: PyTree, axis_name="workers", *,
                           compressor: compress.Compressor) -> PyTree:
  """The worker mean ``(1/n) sum_j deQ(Q(x_j))`` from gathered payloads.

  Every worker all-gathers every worker's payload (for ``topk`` its
  indices and values), decodes the ``n`` of them and sums them in float32
  in worker order (where that sum overflows, the sum of the shares
  ``deQ_j / n``), so the mean of what was sent is exact to float32
  rounding and equal on all workers (no second quantization, unlike
  :func:`mean_compressed`); this
  is how SparseLoCo aggregates its sparse pseudo-gradients (Sarfi et al.,
  arXiv 2508.15706), since a sum of sparse vectors is not sparse. Bytes
  each worker sends, in the accounting's conventions: ``(n - 1) x
  payload_bytes(N)`` per leaf of ``N`` values (:func:`gather_payload_bytes`).
  Must run inside ``jax.shard_map`` over ``axis_name``.

  Args:
    tree, axis_name, compressor: as for :func:`mean_compressed` (any
      format; top-k is the one it is for).

  Returns:
    The decoded payloads' mean, a pytree of ``tree``'s structure, shapes
    and dtypes, equal on every worker.

  Raises:
    ValueError: a non-floating leaf or a compressor of the wrong type.
  """
  return _map_checked(tree, compressor,
                      lambda x: _gather_mean_leaf(x, axis_name, compressor))


def gather_payload_bytes(tree: PyTree, n_workers: int,
                         compressor: compress.Compressor) -> int:
  """Hand count: bytes one worker sends in :func:`gather_mean_compressed`."""
  n = checks.check_int("n_workers", n_workers, minimum=1)
  return (n - 1) * sum(
      compressor.payload_bytes(int(np.prod(np.shape(x))),
                               jnp.dtype(jnp.result_type(x)).itemsize)
      for x in jax.tree.leaves(tree))
