"""Workers that span devices: the collectives inside a worker, and the
worker seen as one device.

A worker of ``D = Workload.devices_per_worker`` devices
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

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.workload import MAX_SECONDS
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


def one_device_per_worker(c: Cluster, w: Workload,
                           exposed_s: float) -> tuple[Cluster, Workload]:
  """``(c, w)`` of workers of ``D`` devices priced as one device each.

  Args:
    c, w: the cluster and workload (``w.devices_per_worker = D``).
    exposed_s: seconds per step added to ``w.optimizer_s`` (the inner
      collectives of :func:`inner_collective_s` and any codec time), > 0 or
      0.

  Returns:
    ``(c, w)`` unchanged for ``D = 1`` and ``exposed_s = 0``; else, with
    ``devices_per_worker = 1``, ``fsdp``: intra-node and per-flow bandwidth
    ``D`` times higher; ``data``: NIC and WAN bandwidth ``D`` times lower
    (module docstring).

  Raises:
    ValueError: ``optimizer_s + exposed_s`` above the workload's bound
      :data:`~decentral_jax.runtime_model.workload.MAX_SECONDS` (a day).
  """
  d = w.devices_per_worker
  if w.optimizer_s + exposed_s > MAX_SECONDS:
    raise ValueError(
        f"optimizer_s ({w.optimizer_s:g} s) plus the collectives inside a "
        f"worker of {d} device(s) and the codec time ({exposed_s:g} s per "
        f"step) exceed the runtime model's {MAX_SECONDS:g} s (a day); lower "
        "param_count or raise the cluster's bandwidths or codec_Bps.")
  if d <= 1:
    if exposed_s <= 0:
      return c, w
    return c, dataclasses.replace(w, optimizer_s=w.optimizer_s + exposed_s)
  if w.worker_layout == "fsdp":
    flow = c.flow_bandwidth_Bps
    c = dataclasses.replace(c, intra_bandwidth_Bps=c.intra_bandwidth_Bps * d,
                            flow_bandwidth_Bps=None if flow is None
                            else flow * d)
  else:
    wan = c.wan_bandwidth_Bps
    c = dataclasses.replace(c, nic_bandwidth_Bps=c.nic_bandwidth_Bps / d,
                            wan_bandwidth_Bps=None if wan is None else wan / d)
  return c, dataclasses.replace(w, optimizer_s=w.optimizer_s + exposed_s,
                                devices_per_worker=1)
