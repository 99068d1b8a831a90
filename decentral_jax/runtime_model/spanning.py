"""Workers that span devices, and per-method messages (dtype, compression, buckets).

:func:`effective` turns a method, a cluster and a workload into the
worker-level cluster and workload the estimators price, so that every
estimator (simulator, closed form, bytes) sees the same thing:

* ``Method.bucket_bytes`` replaces the workload's bucket size (bucketed
  gossip, ``config.bucket_bytes``);
* ``Method.comm_dtype`` on a gossip method sets the dtype of the parameters
  on the wire (low-precision gossip, ``config.comm_dtype``: bfloat16 halves
  the bytes);
* ``Method.compress`` (:mod:`~decentral_jax.runtime_model.compression`):
  on a gossip method the parameter count is scaled so that the message
  (``Workload.param_bytes``) is the payload of the ``N`` parameters; on
  any method the codec time per step (quantize and dequantize, device
  work serial with the compute) is added to the optimizer time, like the
  collectives inside a worker below, and so counted as communication;
* a worker of ``D = Workload.devices_per_worker`` devices
  (``config.devices_per_worker``, :mod:`decentral_jax.parallel.layouts`):

  - ``"fsdp"``: each of its devices holds ``1/D`` of the parameters and
    exchanges only that shard with the same device of the peer worker: ``D``
    flows of ``M/D`` at once. For the alpha-beta costs this is one flow of
    ``M`` over links ``D`` times as fast inside the node (``D`` links) and
    ``D`` times the per-flow cap; the node's NICs are shared as before. Each
    step also all-gathers the parameters and reduce-scatters the gradients
    inside the worker (ring over its ``D`` devices):
    ``(D-1)/D (M_x + M_g) / b_intra + (D-1) a_intra`` per bucket of each;
  - ``"data"``: every device holds all parameters and sends the full ``M``:
    ``D`` flows of ``M`` per worker, so the node's NICs carry ``D`` times
    the bytes (NIC rate / ``D`` for one worker-level flow). Each step
    all-reduces the gradients inside the worker:
    ``2(D-1)/D M_g / b_intra + 2(D-1) a_intra`` per bucket.

  The collectives inside the worker are in every step's critical path (the
  forward needs the gathered parameters, the update the reduced gradients)
  and are charged as exposed time after the backward (added to the
  optimizer time), for every method alike. They share the devices' links
  with the gossip; that contention is not modelled.

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses
import math

from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.workload import Workload


def inner_collective_s(c: Cluster, w: Workload) -> float:
  """Seconds per step of the collectives inside one worker of ``D`` devices.

  0 for ``D = 1``. ``fsdp``: ring all-gather of the parameters and ring
  reduce-scatter of the gradients; ``data``: ring all-reduce of the
  gradients; over the worker's devices at ``c.intra_bandwidth_Bps`` each,
  one latency per hop and bucket.
  """
  d = w.devices_per_worker
  if d <= 1:
    return 0.0
  nb_x = max(1, math.ceil(w.param_bytes / w.bucket_bytes))
  nb_g = max(1, math.ceil(w.grad_bytes / w.bucket_bytes))
  a, b = c.intra_latency_s, c.intra_bandwidth_Bps
  if w.worker_layout == "fsdp":
    return ((d - 1) / d * (w.param_bytes + w.grad_bytes) / b
            + (d - 1) * a * (nb_x + nb_g))
  return 2 * (d - 1) / d * w.grad_bytes / b + 2 * (d - 1) * a * nb_g


def inner_bytes(w: Workload) -> float:
  """Bytes per step one worker's devices send to each other (all ``D``)."""
  d = w.devices_per_worker
  if d <= 1:
    return 0.0
  if w.worker_layout == "fsdp":
    return (d - 1) * (w.param_bytes + w.grad_bytes)
  return 2 * (d - 1) * w.grad_bytes


def codec_s_per_step(method, c: Cluster, w: Workload) -> float:
  """Seconds per step of quantizing and dequantizing ``method``'s messages.

  0 without ``compress`` or with one worker. Gossip: per step the mean over
  the topology's rounds of ``N (2 + T_r)`` values (``T_r`` terms received
  in round ``r``); local-update methods: ``N (3 + 1/n)`` values per sync
  (top-k: ``N (1 + n)``), spread over the ``H`` steps of a period; at
  ``c.codec_Bps`` float32 bytes per second
  (:mod:`~decentral_jax.runtime_model.compression`).
  """
  fmt = getattr(method, "compress", None)
  if fmt is None or c.n_workers <= 1:
    return 0.0
  n_values = float(w.param_count)
  if method.kind == "gossip":
    terms = [len(r.terms) for r in method.topology.rounds]
    values = compression.gossip_codec_values(n_values,
                                             sum(terms) / len(terms))
    return compression.codec_seconds(values, c.codec_Bps)
  values = compression.sync_codec_values(fmt, n_values, c.n_workers)
  return compression.codec_seconds(values, c.codec_Bps) / method.period


def _compressed_gossip(method, w: Workload) -> Workload:
  """``w`` with ``param_bytes`` equal to the payload of its parameters."""
  payload = compression.payload_bytes(method.compress, w.param_count,
                                      method.compress_block,
                                      method.compress_fraction)
  itemsize = w.param_bytes / max(float(w.param_count), 1e-300)
  return dataclasses.replace(w, param_count=payload / itemsize)


def effective(method, c: Cluster, w: Workload) -> tuple[Cluster, Workload]:
  """The worker-level ``(cluster, workload)`` that ``method`` is priced on.

  Args:
    method: a :class:`~decentral_jax.runtime_model.method.Method` (its
      ``kind``, ``comm_dtype`` and ``bucket_bytes`` are read).
    c, w: the cluster (``local_size`` counts workers) and the workload.

  Returns:
    ``(c, w)`` unchanged for one device per worker and no per-method
    message settings; else the transformed pair (module docstring), with
    ``devices_per_worker = 1`` (applied) and the inner collectives and the
    codec time added to ``optimizer_s``.
  """
  bucket = getattr(method, "bucket_bytes", None)
  if bucket is not None:
    w = dataclasses.replace(w, bucket_bytes=float(bucket), bucket_shares=None,
                            bucket_ready=None)
  if method.kind == "gossip" and method.comm_dtype is not None:
    w = dataclasses.replace(w, param_dtype=method.comm_dtype)
  inner = inner_collective_s(c, w) + codec_s_per_step(method, c, w)
  if method.kind == "gossip" and getattr(method, "compress", None):
    w = _compressed_gossip(method, w)
  d = w.devices_per_worker
  if d <= 1:
    if inner <= 0:
      return c, w
    return c, dataclasses.replace(w, optimizer_s=w.optimizer_s + inner)
  if w.worker_layout == "fsdp":
    flow = c.flow_bandwidth_Bps
    c = dataclasses.replace(c, intra_bandwidth_Bps=c.intra_bandwidth_Bps * d,
                            flow_bandwidth_Bps=None if flow is None
                            else flow * d)
  else:
    wan = c.wan_bandwidth_Bps
    c = dataclasses.replace(c, nic_bandwidth_Bps=c.nic_bandwidth_Bps / d,
                            wan_bandwidth_Bps=None if wan is None else wan / d)
  return c, dataclasses.replace(w, optimizer_s=w.optimizer_s + inner,
                                devices_per_worker=1)
