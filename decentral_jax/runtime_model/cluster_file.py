"""Cluster JSON files: what ``measure`` writes and ``predict --cluster`` reads.

Schema ``decentral_jax.runtime_model/cluster/v1`` (units in the key names;
documented in docs/runtime_model.md, "measure"):

* ``cluster``: keyword arguments of :class:`~.costs.Cluster` (``n_workers``,
  ``local_size``, ``intra_latency_s``, ``intra_bandwidth_Bps``,
  ``inter_latency_s``, ``nic_bandwidth_Bps``, ``flow_bandwidth_Bps`` (or
  null), ``nics_per_node``, ``nic_efficiency``, ``full_duplex``,
  ``multi_node``, ``intra_link``), fitted by :func:`fit_links`;
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

from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import workload as workload_lib

SCHEMA = "decentral_jax.runtime_model/cluster/v1"
CLUSTER_KEYS = ("n_workers", "local_size", "intra_latency_s",
                "intra_bandwidth_Bps", "inter_latency_s", "nic_bandwidth_Bps",
                "flow_bandwidth_Bps", "nics_per_node", "nic_efficiency",
                "full_duplex", "multi_node", "intra_link")
WORKLOAD_KEYS = ("param_count", "forward_s", "backward_s", "compute_cv",
                 "compute_samples_s", "grad_dtype", "param_dtype")
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


def read(path: str) -> dict:
  """Reads and checks a cluster file.

  Returns:
    The parsed dict (``schema``, ``cluster``, ``workload``, ``measurements``,
    ``meta``).

  Raises:
    ValueError: unreadable file, not JSON, another schema, missing or
      unknown ``cluster``/``workload`` keys, or values the model refuses
      (naming the file and the key).
  """
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except OSError as e:
    raise ValueError(f"--cluster {path!r}: {e.strerror or e}.") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"--cluster {path!r} is not JSON: {e}.") from None
  if not isinstance(data, dict) or data.get("schema") != SCHEMA:
    raise ValueError(f"--cluster {path!r}: expected \"schema\": \"{SCHEMA}\" "
                     "(a file written by `python -m decentral_jax."
                     "runtime_model measure`).")
  c = data.get("cluster")
  if not isinstance(c, dict) or set(c) != set(CLUSTER_KEYS):
    raise ValueError(f"--cluster {path!r}: \"cluster\" must have exactly the "
                     f"keys {list(CLUSTER_KEYS)}.")
  w = data.get("workload")
  if w is not None and (not isinstance(w, dict) or not set(w) <= set(
      WORKLOAD_KEYS) or "param_count" not in w):
    raise ValueError(f"--cluster {path!r}: \"workload\" must be null or have "
                     f"param_count and keys among {list(WORKLOAD_KEYS)}.")
  try:
    costs.Cluster(**c)
    if w is not None:
      workload(data)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--cluster {path!r}: {e}") from None
  return data


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
  kw = dict(data.get("workload") or {})
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
  return workload_lib.Workload(**kw)
