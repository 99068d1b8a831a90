"""Figure 6 of Wang et al. (2025): data, cluster specs, fitted parameters, fit.

Figure 6 measures the per-iteration time (ms) of a Transformer-base (~65M
parameters, fp32 gradients and parameters on the wire) at a fixed global
batch of 25K tokens on two clusters, for All-Reduce, SGP and decentralized
training on the one-peer exponential graph (Exp) and AER. The model is given
the published link speeds and, per cluster, three fitted numbers: the compute
time ``a + b / n`` (seconds; forward : backward = 1 : 2) and one more:

* T4 (8 x T4 per node, 100 Gbit/s InfiniBand): the compute coefficient of
  variation (factor 3; All-Reduce's excess over gossip on this compute-bound
  cluster is a straggler effect).
* A40 (4 x A40 per node, 25 Gbit/s Ethernet): the node's aggregate
  inter-node bandwidth. The published 25 Gbit/s is used as the rate of one
  connection; the measured Exp bars need more than 25 Gbit/s per node in
  total (see ``docs/runtime_model.md``). Its compute CV is the T4 value (same
  model, data and sampler).

:data:`FITTED` stores the result of :func:`fit_fig6`; tests re-run the fit.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload

# Per-iteration time (ms) read from the paper's Figure 6.
FIG6_MS = {
    "T4": {"n": (16, 32, 64),
           "all_reduce": (372.5, 225.5, 167.3),
           "sgp": (425.5, 292.4, 235.5),
           "one_peer_exp": (314.8, 178.8, 123.1),
           "aer": (312.3, 178.8, 122.2)},
    "A40": {"n": (8, 16, 32),
            "all_reduce": (166.1, 195.5, 188.5),
            "sgp": (150.5, 99.9, 112.4),
            "one_peer_exp": (122.8, 97.4, 110.8),
            "aer": (122.0, 78.9, 67.9)},
}
METHODS = ("all_reduce", "sgp", "one_peer_exp", "aer")
VALIDATED = ("all_reduce", "one_peer_exp", "aer")
PARAM_COUNT = 65e6  # Transformer base, "about 65M parameters" (paper).

# Fixed, published (bandwidths) or assumed typical (latencies) hardware.
PUBLISHED = {
    # PCIe 3.0 x16: 15.75 GB/s per direction; InfiniBand EDR: 100 Gbit/s.
    "T4": dict(local_size=8, intra_latency_s=5e-6, intra_bandwidth_Bps=15.75e9,
               inter_latency_s=10e-6, nic_bandwidth_Bps=12.5e9,
               multi_node="tree"),
    # PCIe 4.0 x16: 31.5 GB/s per direction; 25 Gbit/s Ethernet (TCP).
    "A40": dict(local_size=4, intra_latency_s=5e-6, intra_bandwidth_Bps=31.5e9,
                inter_latency_s=30e-6, flow_bandwidth_Bps=25e9 / 8,
                multi_node="tree"),
}

# Output of fit_fig6("T4") and fit_fig6("A40", compute_cv=T4's).
FITTED = {
    "T4": {"a_s": 0.05397, "b_s": 3.888, "compute_cv": 0.1511},
    "A40": {"a_s": 0.04008, "b_s": 0.6575, "nic_bandwidth_Bps": 7.370e9},
}
SIM = dict(steps=160, warmup=32, seed=0)


def setup(name: str, n: int, params: dict | None = None
          ) -> tuple[Cluster, Workload]:
  """Cluster and workload of Figure 6's ``name`` cluster at ``n`` GPUs.

  Args:
    name: "T4" or "A40".
    n: number of GPUs (a multiple of the workers per node).
    params: fitted parameters (default :data:`FITTED`): ``a_s`` and ``b_s``
      (compute ``a + b/n`` seconds), ``compute_cv`` (default: T4's) and
      optionally ``nic_bandwidth_Bps``.

  Raises:
    ValueError: unknown cluster name.
  """
  if name not in PUBLISHED:
    raise ValueError(f"unknown Figure 6 cluster {name!r}; use one of "
                     f"{sorted(PUBLISHED)}.")
  p = dict(FITTED[name] if params is None else params)
  hw = dict(PUBLISHED[name])
  hw["nic_bandwidth_Bps"] = p.get("nic_bandwidth_Bps",
                                  hw.get("nic_bandwidth_Bps"))
  comp = p["a_s"] + p["b_s"] / n
  cv = p.get("compute_cv", FITTED["T4"]["compute_cv"])
  return (Cluster(n_workers=n, **hw),
          Workload(PARAM_COUNT, comp / 3, 2 * comp / 3, compute_cv=cv))


def predict(name: str, params: dict | None = None,
            methods=METHODS, estimator: str = "simulate") -> dict:
  """Predicted ms/iteration: ``{method: (ms at each n of the cluster)}``."""
  out = {}
  for meth in methods:
    row = []
    for n in FIG6_MS[name]["n"]:
      c, w = setup(name, n, params)
      if estimator == "simulate":
        row.append(1e3 * simulate(meth, c, w, **SIM))
      else:
        row.append(1e3 * closed_form(meth, c, w).iteration_s)
    out[meth] = tuple(row)
  return out


def fit_fig6(name: str, compute_cv: float | None = None) -> dict:
  """Least-squares fit of 3 parameters to the All-Reduce, Exp and AER bars.

  Minimises the squared log-ratios predicted/measured (simulator, fixed
  seed) over the 9 bars of the cluster. Free parameters: ``a_s``, ``b_s`` and
  ``compute_cv`` (T4) or ``nic_bandwidth_Bps`` (A40, whose CV is
  ``compute_cv``, default T4's stored value).

  Returns:
    The fitted parameter dict (same keys as :data:`FITTED`).
  """
  meas = np.log(np.concatenate([FIG6_MS[name][m] for m in VALIDATED]))
  if name == "T4":
    keys, x0, lo, hi, scale = ("compute_cv",), [0.05], [0.0], [0.6], [0.01]
    unit = [1.0]
  else:
    keys, x0, lo, hi, scale = ("nic_bandwidth_Bps",), [6.25], [3.125], [50], [1]
    unit = [1e9]
  fixed = {} if name == "T4" else {
      "compute_cv": FITTED["T4"]["compute_cv"] if compute_cv is None
                    else compute_cv}

  def params(x):
    p = {"a_s": x[0] * 1e-3, "b_s": x[1] * 1e-3, **fixed}
    p.update({k: v * u for k, v, u in zip(keys, x[2:], unit)})
    return p

  def resid(x):
    pred = predict(name, params(x), VALIDATED)
    return np.log(np.concatenate([pred[m] for m in VALIDATED])) - meas

  res = optimize.least_squares(
      resid, [20.0, 2000.0] + x0, bounds=([0, 0] + lo, [500, 2e4] + hi),
      x_scale=[10, 100] + scale, diff_step=1e-2, xtol=1e-4)
  return {k: float(v) for k, v in params(res.x).items()}


def rows(params: dict | None = None) -> list[dict]:
  """Measured vs predicted for every bar of Figure 6.

  Args:
    params: ``{cluster: parameter dict}`` (default :data:`FITTED`).

  Returns:
    One dict per bar: ``cluster, n, method, measured_ms, simulated_ms,
    closed_form_ms, error`` (simulated / measured - 1).
  """
  out = []
  for name in FIG6_MS:
    p = None if params is None else params[name]
    sim = predict(name, p)
    cf = predict(name, p, estimator="closed_form")
    for meth in METHODS:
      for k, n in enumerate(FIG6_MS[name]["n"]):
        meas = FIG6_MS[name][meth][k]
        out.append(dict(cluster=name, n=n, method=meth, measured_ms=meas,
                        simulated_ms=sim[meth][k], closed_form_ms=cf[meth][k],
                        error=sim[meth][k] / meas - 1))
  return out


def failures(table: list[dict], tolerance: float = 0.2,
             tie: float = 0.02) -> list[str]:
  """Acceptance check of a :func:`rows` table; returns the violations.

  Every All-Reduce, Exp and AER bar must be within ``tolerance`` (relative)
  of the measurement, and in every group (cluster, n) each pair of these
  methods must be ordered as measured, unless the two measurements differ by
  less than ``tie`` (relative), which counts as a tie.
  """
  bad = []
  groups = {}
  for r in table:
    if r["method"] not in VALIDATED:
      continue
    if abs(r["error"]) > tolerance:
      bad.append(f"{r['cluster']} n={r['n']} {r['method']}: predicted "
                 f"{r['simulated_ms']:.1f} ms vs measured "
                 f"{r['measured_ms']:.1f} ms ({100 * r['error']:+.0f}%)")
    groups.setdefault((r["cluster"], r["n"]), []).append(r)
  for (name, n), g in groups.items():
    for i, a in enumerate(g):
      for b in g[i + 1:]:
        dm = a["measured_ms"] - b["measured_ms"]
        if abs(dm) < tie * max(a["measured_ms"], b["measured_ms"]):
          continue
        if np.sign(a["simulated_ms"] - b["simulated_ms"]) != np.sign(dm):
          bad.append(f"{name} n={n}: order of {a['method']} and "
                     f"{b['method']} differs from the measurement")
  return bad
