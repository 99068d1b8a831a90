"""Cluster JSON files: what ``measure`` writes and ``predict --cluster`` reads.

Schema ``decentral_jax.runtime_model/cluster/v1`` (units in the key names;
documented in docs/runtime_model.md, "measure"):

* ``cluster``: keyword arguments of :class:`~.costs.Cluster` (``n_workers``,
  ``local_size``, ``intra_latency_s``, ``intra_bandwidth_Bps``,
  ``inter_latency_s``, ``nic_bandwidth_Bps``, ``flow_bandwidth_Bps`` (or
  null), ``nics_per_node``, ``nic_efficiency``, ``full_duplex``,
  ``multi_node``, ``intra_link``), fitted by :func:`fit_links`, and
  optionally the fields ``measure`` does not fit (``datacenters``,
  ``wan_latency_s``, ``wan_bandwidth_Bps``, ``codec_Bps``);
* ``workload``: keyword arguments of :class:`~.workload.Workload`
  (``param_count``, ``forward_s``, ``backward_s``, ``compute_cv``,
  ``compute_samples_s``, ``grad_dtype``, ``param_dtype``), or null when no
  compute was measured;
* ``measurements``: the raw medians the fits come from (``sizes_bytes``
  [k]; ``intra_pair_s``, ``inter_pair_s``, ``inter_concurrent_s`` [k] or
  null; ``concurrent_flows``; ``all_reduce_bytes``, ``all_reduce_s``;
  ``forward_samples_s``, ``forward_backward_samples_s``; ``repeats``);
* ``meta``: provenance (``created``, ``jax_version``, ``backend``,
  ``device_kind``, ``process_count``, ``devices``, ``config``,
  ``overrides``).

This module does not import JAX.
"""

from __future__ import annotations

import json
import math

import numpy as np

from decentral_jax import records
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import workload as workload_lib

SCHEMA = "decentral_jax.runtime_model/cluster/v1"
MAX_FILE_BYTES = 16 * 2**20  # a cluster file is a few kilobytes
MAX_BANDWIDTH_Bps = 1e18  # "no measurable size dependence"


def fit_alpha_beta(nbytes, seconds, flows: int = 1) -> tuple[float, float]:
  """Latency (s) and bandwidth (bytes/s) of ``t = a + flows * M / b``.

  Least squares over the ``(M, t)`` points (>= 2 sizes). ``flows``
  concurrent flows share the bandwidth ``b`` (``flows = 1``: the rate of
  one flow). ``a`` is clipped at 0; a slope <= 0 gives ``b =
  MAX_BANDWIDTH_Bps``.

  Raises:
    ValueError: fewer than 2 distinct sizes, or non-finite times.
  """
  m = np.asarray(nbytes, float)
  t = np.asarray(seconds, float)
  if m.size < 2 or np.unique(m).size < 2 or m.shape != t.shape or \
      not np.all(np.isfinite(t)):
    raise ValueError("need finite times at >= 2 distinct message sizes, got "
                     f"sizes {m.tolist()} and times {t.tolist()}.")
  slope, intercept = np.polyfit(m, t, 1)
  beta = flows / slope if slope > 0 else MAX_BANDWIDTH_Bps
  return max(float(intercept), 0.0), float(min(beta, MAX_BANDWIDTH_Bps))


def fit_links(meas: dict, n_workers: int, local_size: int) -> dict:
  """``Cluster`` keyword arguments from the ``measurements`` of a file.

  Inside the node: one pair exchange (``intra_pair_s``). Across nodes: one
  flow (``inter_pair_s``) gives the flow rate and the latency,
  ``concurrent_flows`` flows at once (``inter_concurrent_s``) the node's
  capacity. The node's NICs are reported as one port of that capacity
  (``nics_per_node = 1``); the one-flow rate becomes ``flow_bandwidth_Bps``
  when it is below 90% of the capacity (one flow cannot fill the node).
  Without inter-node measurements (one node) the inter-node fields are the
  :class:`~.costs.Cluster` defaults.
  """
  sizes = meas["sizes_bytes"]
  out = dict(n_workers=int(n_workers), local_size=int(local_size),
             nics_per_node=1, nic_efficiency=1.0, full_duplex=True,
             multi_node="tree", intra_link="pcie", flow_bandwidth_Bps=None)
  if meas.get("intra_pair_s"):
    out["intra_latency_s"], out["intra_bandwidth_Bps"] = fit_alpha_beta(
        sizes, meas["intra_pair_s"])
  else:
    out["intra_latency_s"] = costs.Cluster.intra_latency_s
    out["intra_bandwidth_Bps"] = costs.Cluster.intra_bandwidth_Bps
  if meas.get("inter_pair_s"):
    a, flow = fit_alpha_beta(sizes, meas["inter_pair_s"])
    k = int(meas.get("concurrent_flows") or 1)
    _, cap = fit_alpha_beta(sizes, meas["inter_concurrent_s"], flows=k)
    cap = max(cap, flow)  # k flows never reach less than one
    out.update(inter_latency_s=a, nic_bandwidth_Bps=cap,
               flow_bandwidth_Bps=flow if flow < 0.9 * cap else None)
  else:
    out["inter_latency_s"] = costs.Cluster.inter_latency_s
    out["nic_bandwidth_Bps"] = costs.Cluster.nic_bandwidth_Bps
  costs.Cluster(**out)  # validates
  return out


def write(path: str, data: dict) -> None:
  """Writes ``data`` (a dict with ``cluster``, ``workload``, ...) as JSON."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"schema": SCHEMA, **data}, f, indent=1, sort_keys=False)
    f.write("\n")


# The file's schema: for each key its kind, bounds and whether null is
# allowed. Bounds are wide (a kilobyte per second to MAX_BANDWIDTH_Bps, a
# day of compute) and only keep numbers the model cannot mean out of it.
_DAY_S = workload_lib.MAX_SECONDS  # a day
_COUNT = 1 << 24  # workers, devices, flows
CLUSTER_SCHEMA = {
    "n_workers": ("int", 1, costs.MAX_WORKERS, False),
    "local_size": ("int", 1, _COUNT, False),
    "intra_latency_s": ("number", 0.0, _DAY_S, False),
    "intra_bandwidth_Bps": ("number", 1e3, MAX_BANDWIDTH_Bps, False),
    "inter_latency_s": ("number", 0.0, _DAY_S, False),
    "nic_bandwidth_Bps": ("number", 1e3, MAX_BANDWIDTH_Bps, False),
    "flow_bandwidth_Bps": ("number", 1e3, MAX_BANDWIDTH_Bps, True),
    "nics_per_node": ("int", 1, _COUNT, False),
    "nic_efficiency": ("number", 0.01, 1.0, False),  # --nic-efficiency's
    "full_duplex": ("bool", None, None, False),
    "multi_node": ("str", None, None, False),
    "intra_link": ("str", None, None, False),
    # Optional: what measure does not fit (datacenters over a wide-area
    # link, the codec rate of compressed communication).
    "datacenters": ("int", 1, _COUNT, False),
    "wan_latency_s": ("number", 0.0, _DAY_S, False),
    "wan_bandwidth_Bps": ("number", 1e3, MAX_BANDWIDTH_Bps, True),
    "codec_Bps": ("number", 1e3, MAX_BANDWIDTH_Bps, False),
}
OPTIONAL_CLUSTER_KEYS = ("datacenters", "wan_latency_s", "wan_bandwidth_Bps",
                         "codec_Bps")
WORKLOAD_SCHEMA = {
    "param_count": ("whole", 1.0, workload_lib.MAX_PARAMS, False),
    "forward_s": ("number", 0.0, _DAY_S, True),
    "backward_s": ("number", 0.0, _DAY_S, True),
    "compute_cv": ("number", 0.0, workload_lib.MAX_COMPUTE_CV, True),
    "compute_samples_s": ("numbers", 0.0, _DAY_S, True),
    "grad_dtype": ("str", None, None, True),
    "param_dtype": ("str", None, None, True),
}
MEASUREMENTS_SCHEMA = {
    "sizes_bytes": ("numbers", 1.0, 1e15, False),
    "repeats": ("int", 1, 1 << 31, False),
    "concurrent_flows": ("int", 1, _COUNT, True),
    "intra_pair_s": ("numbers", 0.0, _DAY_S, True),
    "inter_pair_s": ("numbers", 0.0, _DAY_S, True),
    "inter_concurrent_s": ("numbers", 0.0, _DAY_S, True),
    "all_reduce_bytes": ("whole", 1.0, 1e18, True),  # a measured message
    "all_reduce_s": ("number", 1e-9, _DAY_S, True),  # takes some time
    "forward_samples_s": ("numbers", 0.0, _DAY_S, True),
    "forward_backward_samples_s": ("numbers", 0.0, _DAY_S, True),
}
META_SCHEMA = {
    "created": ("str", None, None, True),
    "jax_version": ("str", None, None, True),
    "backend": ("str", None, None, True),
    "device_kind": ("str", None, None, True),
    "process_count": ("int", 1, _COUNT, True),
    "devices": ("int", 1, _COUNT, True),
    "config": ("str", None, None, True),
    "overrides": ("strs", None, None, True),
}
TOP_KEYS = ("schema", "cluster", "workload", "measurements", "meta")
CLUSTER_KEYS = tuple(k for k in CLUSTER_SCHEMA
                     if k not in OPTIONAL_CLUSTER_KEYS)
WORKLOAD_KEYS = tuple(WORKLOAD_SCHEMA)
# The whole file (records.object_error's schema): every section checked.
DOCUMENT_SCHEMA = {
    "schema": ("str", None, None, False),
    "cluster": (records.Obj(CLUSTER_SCHEMA, CLUSTER_KEYS), None, None, False),
    "workload": (records.Obj(WORKLOAD_SCHEMA, ("param_count",)), None, None,
                 True),
    "measurements": (records.Obj(MEASUREMENTS_SCHEMA), None, None, False),
    "meta": (records.Obj(META_SCHEMA), None, None, False),
}


def _check_measurements(meas: dict) -> None:
  """Lists of times match ``sizes_bytes``; an All-Reduce time has its bytes."""
  for key in ("intra_pair_s", "inter_pair_s", "inter_concurrent_s"):
    if meas.get(key) is not None and len(meas[key]) != len(
        meas.get("sizes_bytes") or ()):
      raise ValueError(f"measurements.{key} must have one time per "
                       "measurements.sizes_bytes entry.")
  if meas.get("all_reduce_s") is not None and \
      meas.get("all_reduce_bytes") is None:
    raise ValueError("measurements.all_reduce_s needs "
                     "measurements.all_reduce_bytes.")


def _check_meta_counts(meta: dict, c: dict) -> None:
  """``meta.devices`` and ``meta.process_count``, where not null, are what
  ``measure`` writes beside ``cluster``: the devices it measured are the
  workers (``devices == cluster.n_workers``), each process holding one or
  more of them (``process_count <= devices``)."""
  n, devices, procs = c["n_workers"], meta.get("devices"), meta.get(
      "process_count")
  if devices is not None and devices != n:
    raise ValueError(
        f"meta.devices is {devices}, but cluster.n_workers is {n} (measure "
        "writes one worker per device measured): correct one of them, or "
        "re-run measure (predict --n-workers prices another count).")
  if procs is not None and procs > n:
    raise ValueError(
        f"meta.process_count is {procs}, more than the {n} devices "
        "measured (cluster.n_workers; each process holds at least one): "
        "correct it, or re-run measure.")


def _load(path: str):
  """The file's JSON value; ValueError naming the problem otherwise."""
  value = records.read_json(path, max_bytes=MAX_FILE_BYTES)
  if isinstance(value, records.Damaged):
    why = value.reason
    if why.startswith("is larger"):
      why += " (not a cluster file: measure writes a few kilobytes)"
    elif why.startswith("is not a regular") or why == "is a directory":
      why += "; give the JSON file that measure wrote"
    raise ValueError(why + ".")
  return value


def read(path: str) -> dict:
  """Reads and checks a cluster file against the schema above.

  Every key is checked: the top-level keys ``TOP_KEYS`` (all present), the
  ``cluster`` keys (all of ``CLUSTER_KEYS`` present, and optionally
  ``OPTIONAL_CLUSTER_KEYS``), ``workload`` (null or keys among
  ``WORKLOAD_SCHEMA`` with ``param_count``), ``measurements`` and ``meta``
  (keys among their schemas, each optional). Numbers must be finite JSON
  numbers (not ``true``/``false``, not NaN or Infinity) within the bounds
  of the tables above; integers must be integers.

  Returns:
    The parsed dict (``schema``, ``cluster``, ``workload``, ``measurements``,
    ``meta``).

  Raises:
    ValueError: one line ``--cluster 'FILE': ...`` naming the key, for an
      unreadable file, a FIFO or device, a file over ``MAX_FILE_BYTES``,
      bytes that are not UTF-8, not JSON (truncated, or
      nested too deeply), another schema, a missing or unknown key, a value
      of the wrong type or out of bounds, or values the model refuses.
  """
  try:
    data = _load(path)
    _check_document(data)
  except ValueError as e:
    sep = " " if str(e).startswith("is ") else ": "
    raise ValueError(f"--cluster {path!r}{sep}{e}") from None
  return data


def _check_document(data) -> None:
  if not isinstance(data, dict) or data.get("schema") != SCHEMA:
    raise ValueError(f"expected \"schema\": \"{SCHEMA}\" (a file written "
                     "by `python -m decentral_jax.runtime_model measure`).")
  got = records.object_error(data, "", DOCUMENT_SCHEMA, TOP_KEYS)
  if got:
    raise ValueError(got[1] + ".")
  _check_measurements(data["measurements"])
  _check_meta_counts(data["meta"], data["cluster"])
  try:
    costs.Cluster(**data["cluster"])
  except (TypeError, ValueError) as e:
    raise ValueError(str(e)) from None
  if data["workload"] is not None:
    kw = _workload_fields(data, {})
    try:
      workload_lib.Workload(**kw)
    except (TypeError, ValueError) as e:  # names a Workload field
      raise ValueError(f"workload.{e}") from None
    _check_samples_agree(data["workload"])


def _check_samples_agree(work: dict) -> None:
  """``forward_s + backward_s`` and ``compute_cv`` are what ``measure``
  writes beside ``compute_samples_s`` (their median, their std / mean):
  the samples replace both in pricing, so a file edited to disagree would
  have its edited times ignored."""
  s = work.get("compute_samples_s")
  if s is None:
    return
  x = np.asarray(s, float)
  f, b = work.get("forward_s"), work.get("backward_s")
  if f is not None and b is not None:
    want = max(float(np.median(x)), f)
    if not math.isclose(f + b, want, rel_tol=1e-6, abs_tol=1e-12):
      raise ValueError(
          f"workload.forward_s + backward_s ({(f + b) * 1e3:.6g} ms) is not "
          f"the median of workload.compute_samples_s ({want * 1e3:.6g} ms) "
          "as measure writes them, and the samples replace them in pricing: "
          "remove compute_samples_s to price the edited times, or re-run "
          "measure.")
  cv = work.get("compute_cv")
  if cv is not None and not math.isclose(
      cv, float(x.std() / x.mean()), rel_tol=1e-6, abs_tol=1e-12):
    raise ValueError(
        f"workload.compute_cv ({cv:.6g}) is not the std / mean of "
        f"workload.compute_samples_s ({x.std() / x.mean():.6g}) as measure "
        "writes them, and the samples replace it in pricing: remove "
        "compute_samples_s to price the edited CV, or re-run measure.")


def cluster(data: dict, n_workers: int | None = None) -> costs.Cluster:
  """The file's :class:`~.costs.Cluster`, optionally for another ``n``."""
  kw = dict(data["cluster"])
  if n_workers is not None:
    kw["n_workers"] = int(n_workers)
  return costs.Cluster(**kw)


def workload(data: dict, **overrides) -> workload_lib.Workload:
  """The file's :class:`~.workload.Workload`; ``overrides`` replace fields.

  Raises:
    ValueError: the file has no workload and ``overrides`` do not give
      ``param_count``, ``forward_s`` and ``backward_s``.
  """
  return workload_lib.Workload(**_workload_fields(data, overrides))


def _workload_fields(data: dict, overrides: dict) -> dict:
  """:func:`workload`'s keyword arguments."""
  # A null value is the key left out: Workload's default (or missing).
  kw = {k: v for k, v in (data.get("workload") or {}).items()
        if v is not None}
  samples = kw.get("compute_samples_s")
  if samples is not None:
    kw["compute_samples_s"] = tuple(float(x) for x in samples)
  kw.update(overrides)
  missing = [k for k in ("param_count", "forward_s", "backward_s")
             if k not in kw or kw[k] is None or (
                 isinstance(kw[k], float) and math.isnan(kw[k]))]
  if missing:
    raise ValueError(f"the cluster file has no measured {', '.join(missing)}"
                     "; give them with --params, --forward-ms, --backward-ms.")
  return kw
