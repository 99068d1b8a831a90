"""Sync messages of the local-update methods and what one sync costs.

The message side of :mod:`decentral_jax.runtime_model.local_methods`
(Local SGD, DiLoCo, Streaming DiLoCo, decentralized DiLoCo, Local D-SGD and
the trickled reduction of delayed / eager outer updates): the bytes of one
sync ``M`` (parameter dtype, the float32-or-wider ``theta`` copy of DiLoCo,
``comm_dtype``, or a compressed payload of
:mod:`~decentral_jax.runtime_model.compression`), its messages (one latency
per bucket), and the alpha-beta time of an exact sync of one fragment
(``M / P`` bytes), of one slice of a trickled reduction (``M / H`` bytes)
or of each gossip round, as :mod:`~decentral_jax.runtime_model.costs`
prices them. A measured time (``Method.measured_s``) replaces the
alpha-beta one. The simulator and the closed form of
:mod:`~decentral_jax.runtime_model.local_methods` take their sync times
from here.

Units: seconds, bytes. References: Douillard et al., arXiv 2311.08105
(DiLoCo) and 2501.18512 (Streaming DiLoCo); Kale et al., arXiv 2502.12996
(eager updates).
"""

from __future__ import annotations

import math

import numpy as np

from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import RoundCost
from decentral_jax.runtime_model.costs import all_gather_cost
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.workload import Workload


def wire_itemsize(m: Method, w: Workload) -> int:
  """Bytes per parameter on the wire for ``m``'s sync (uncompressed)."""
  if m.comm_dtype is not None:
    return np.dtype(m.comm_dtype).itemsize
  size = np.dtype(w.param_dtype).itemsize
  return max(size, 4) if m.message == "theta" else size


def message_bytes(m: Method, w: Workload, n_workers: int = 1) -> float:
  """Bytes of one whole sync message (all fragments) per worker.

  Uncompressed: the parameter count x the wire itemsize x
  ``m.sync_share`` (DES-LOC: the moments' share, spread over the syncs).

  Compressed (``m.compress``): the payload one worker contributes
  (:func:`~decentral_jax.runtime_model.compression.sync_payload`): for the
  scaled formats that of the parameter count padded as the compressed
  all-reduce over ``n_workers`` pads it, all-reduced; for top-k that of
  the parameter count, all-gathered (:func:`sync_cost`; a lower bound:
  the library pads every leaf, see
  :func:`~decentral_jax.runtime_model.compression.topk_leaf_padding_bytes`).
  """
  if m.compress is not None:
    return compression.sync_payload(
        m.compress, w.param_count, n_workers, m.compress_block,
        m.compress_fraction)
  return float(w.param_count) * wire_itemsize(m, w) * m.sync_share


def sync_cost(m: Method, c: Cluster) -> RoundCost:
  """The collective of an exact sync, per byte of :func:`message_bytes`.

  An all-gather for a top-k sync (every worker's indices and values), an
  all-reduce otherwise.
  """
  if m.compress is not None and compression.gathers(m.compress):
    return all_gather_cost(c)
  return all_reduce_cost(c)


def n_messages(w: Workload, nbytes: float, fragments: int = 1) -> int:
  """Messages (one latency each) of a ``nbytes`` sync: its buckets."""
  if w.bucket_shares is None and w.bucket_ready is None:
    return max(1, math.ceil(nbytes / w.bucket_bytes))
  nb = len(w.bucket_shares if w.bucket_shares is not None else w.bucket_ready)
  return max(1, math.ceil(nb / fragments))


def fragment_sync_s(m: Method, c: Cluster, w: Workload) -> float:
  """Seconds of one fragment's exact sync (``M / P`` bytes; :func:`sync_cost`)."""
  if m.measured_s is not None:
    return float(m.measured_s[0]) / m.fragments
  nbytes = message_bytes(m, w, c.n_workers) / m.fragments
  rc = sync_cost(m, c)
  return float(rc.time(nbytes, n_messages(w, nbytes, m.fragments))[0])


def slice_sync_s(m: Method, c: Cluster, w: Workload) -> float:
  """Seconds of one slice of a trickled reduction (``M / H`` bytes).

  ``M / H`` is all-reduced in every inner step, one latency per
  ``bucket_bytes`` message of the slice (at least one); a measured time of
  the whole all-reduce is split in ``H`` (``Method.outer_overlap``).
  """
  if m.measured_s is not None:
    return float(m.measured_s[0]) / m.period
  nbytes = message_bytes(m, w, c.n_workers) / m.period
  return float(sync_cost(m, c).time(nbytes, n_messages(w, nbytes))[0])


def round_costs(m: Method, c: Cluster, w: Workload):
  """Per topology round: (members int [n, k], seconds float64 [n])."""
  nbytes = message_bytes(m, w, c.n_workers)
  out = []
  for r, rnd in enumerate(m.topology.rounds):
    rc = round_cost(c, rnd)
    t = (np.full(c.n_workers, float(m.measured_s[r])) if m.measured_s
         is not None else rc.time(nbytes, n_messages(w, nbytes)))
    out.append((rc.members, t))
  return out


def schedule_period(m: Method) -> int:
  """Steps after which ``m``'s schedule repeats (``H``, or ``H`` x rounds)."""
  return m.period * (1 if m.topology is None else m.topology.period)


def fragment_offsets(m: Method) -> list[int]:
  """Steps ``t % H`` at which fragments ``0 .. P-1`` are sent (``p H // P``)."""
  h, p = m.period, m.fragments
  return [(q * h // p) % h for q in range(p)]
