"""What a method sends, priced: dtype, compression and buckets of its messages.

:func:`effective` turns a method, a cluster and a workload into the
worker-level cluster and workload the estimators price, so that every
estimator (simulator, closed form, bytes) sees the same thing:

* ``Method.bucket_bytes`` replaces the workload's bucket size (bucketed
  gossip, ``config.bucket_bytes``);
* ``Method.comm_dtype`` on a gossip method sets the dtype of the parameters
  on the wire (low-precision gossip, ``config.comm_dtype``: bfloat16 halves
  the bytes);
* ``Method.sync_share`` on a gossip method scales the message of a round
  (gradient tracking sends the parameters and the tracker: 2);
* ``Method.compress`` (:mod:`~decentral_jax.runtime_model.compression`):
  on a gossip method the parameter count is scaled so that the message
  (``Workload.param_bytes``) is the payload of the ``N`` parameters; on
  any method the codec time per step (quantize and dequantize, device
  work serial with the compute) is added to the optimizer time, like the
  collectives inside a worker below, and so counted as communication;
* a worker of ``D`` devices is priced as one device
  (:mod:`~decentral_jax.runtime_model.worker_devices`).

:func:`filled_in` spells out the defaults these fields stand for, so that
two methods that send the same thing compare equal.

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model import worker_devices
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import wire_dtype


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
  inner = (worker_devices.inner_collective_s(c, w)
           + codec_s_per_step(method, c, w))
  if method.kind == "gossip" and getattr(method, "compress", None):
    w = _compressed_gossip(method, w)
  share = getattr(method, "sync_share", 1.0)
  if method.kind == "gossip" and share != 1:
    w = dataclasses.replace(w, param_count=w.param_count * share)
  return worker_devices.one_device_per_worker(c, w, inner)


def filled_in(method, w: Workload):
  """``method`` with the defaults its ``None`` fields stand for on ``w``
  spelled out, so that two specs that send the same messages build equal
  methods (``diloco:H=10`` is ``diloco:H=10,comm_dtype=float32``).

  * ``comm_dtype`` (uncompressed gossip or local sync): the dtype on the
    wire without it, by its numpy name: the parameters'
    (``Workload.param_dtype``), for a local sync of ``message="theta"``
    (DiLoCo's global copy) promoted to at least float32 (4 bytes, as
    :func:`~decentral_jax.runtime_model.local_sync.wire_itemsize`); a
    given one is canonicalised (``"f4"`` -> ``"float32"``);
  * ``bucket_bytes``: ``Workload.bucket_bytes`` when the workload has no
    measured buckets (``bucket_shares`` and ``bucket_ready`` None; a given
    size replaces those, so it is then another method).

  Args:
    method: a :class:`~decentral_jax.runtime_model.method.Method`.
    w: the workload it is priced on.

  Returns:
    A copy (``dataclasses.replace``); other fields as they are.
  """
  out = {}
  if method.kind in ("gossip", "local") and method.compress is None:
    if method.comm_dtype is not None:
      out["comm_dtype"] = wire_dtype("comm_dtype", method.comm_dtype).name
    else:
      dt = wire_dtype("Workload.param_dtype", w.param_dtype)
      theta = method.kind == "local" and method.message == "theta"
      out["comm_dtype"] = ("float32" if theta and dt.itemsize < 4
                           else dt.name)
  if (method.bucket_bytes is None and w.bucket_shares is None
      and w.bucket_ready is None):
    out["bucket_bytes"] = float(w.bucket_bytes)
  elif method.bucket_bytes is not None:
    out["bucket_bytes"] = float(method.bucket_bytes)
  return dataclasses.replace(method, **out)
