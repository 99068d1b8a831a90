"""``fig6``, ``validate`` and ``utilisation``: the runtime model against papers.

``fig6`` prints the paper's Figure 6 bars (Wang et al., ICLR 2025) measured
against predicted (ms/iteration), ``validate`` the leave-one-cluster-out
validation on the same bars, ``utilisation`` the compute utilisation of
data-parallel, DiLoCo and eager DiLoCo against the link rate (Gbit/s; Kale
et al. 2025, Table 5). Each returns the exit code; bad input raises
``ValueError`` with one line naming the flag. No JAX.
"""

from __future__ import annotations

import numpy as np

from decentral_jax.runtime_model import holdout
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import utilisation
from decentral_jax.tools import distinct_paths
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import tables


def run_fig6(args) -> int:
  inputs.check_output_path(args.png, "--png")
  params = None
  if args.refit:
    t4 = paper.fit_fig6("T4")
    params = {"T4": t4, "A40": paper.fit_fig6("A40", t4["compute_cv"])}
    for name, p in params.items():
      print(f"fitted {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in p.items()))
  table = paper.rows(params)
  print(tables.rows_text(table, paper.VALIDATED))
  bad = paper.failures(table, tables.TOLERANCE)
  print("acceptance (All-Reduce, Exp, AER within 20%, ordering): " +
        ("PASS" if not bad else "FAIL\n  " + "\n  ".join(bad)))
  if args.png:
    panels = []
    for name, spec in paper.FIG6_MS.items():
      groups = []
      for n in spec["n"]:
        sel = [r for r in table if r["cluster"] == name and r["n"] == n]
        groups.append((f"{n} GPUs", {r["method"]: r["simulated_ms"] for r in sel},
                       {r["method"]: r["measured_ms"] for r in sel}))
      panels.append((f"{name} cluster ({paper.PUBLISHED[name]['local_size']}"
                     " GPUs/node)", groups))
    tables.write_chart(panels, args.png)
  return 1 if bad else 0


def run_validate(args) -> int:
  folds, insample = (holdout.refit() if args.refit
                     else (holdout.FOLDS, holdout.INSAMPLE))
  print("leave-one-cluster-out: each cluster's Exp and AER bars predicted "
        "from its published links,\nits compute fitted to its All-Reduce "
        "bars only, and the shared values fitted on the other clusters")
  for name in holdout.CLUSTERS:
    f = folds[name]
    print(f"  {name}: compute a={1e3 * f['compute']['a_s']:.1f} ms, "
          f"b={f['compute']['b_s']:.3f} s*GPU; from the others: compute CV "
          f"{f['shared']['compute_cv']:.3f}, {f['shared']['nics_per_node']} "
          "NIC port(s) per node")
  table = holdout.rows(folds)
  print(tables.rows_text(table, holdout.DECENTRALIZED))
  bad = holdout.failures(table, tables.TOLERANCE)
  known = [b for b in bad if any(b.startswith(k) for k in holdout.DOCUMENTED)]
  print("acceptance (Exp, AER within 20%, ordering): " +
        ("PASS" if not bad else f"{len(bad)} failure(s), "
         f"{len(known)} documented (docs/runtime_model.md)\n  " +
         "\n  ".join(bad)))
  print("\nin-sample (each cluster fitted on its own All-Reduce, Exp and AER "
        "bars; for comparison):")
  print(tables.rows_text(holdout.insample_rows(insample),
                        holdout.DECENTRALIZED))
  new = [b for b in bad if b not in known]
  return 1 if new else 0


def run_utilisation(args) -> int:
  """The ``utilisation`` command: table, check against the paper, PNG."""
  inputs.check_output_path(args.png, "--png")
  inputs.check_output_path(args.table, "--table")
  distinct_paths.check_distinct_paths([("--table", args.table),
                                       ("--png", args.png)])
  inputs.check_utilisation_args(args)
  setting = utilisation.Setting(
      n_workers=args.n_workers, param_count=args.params,
      step_s=args.step_ms * 1e-3, period=args.H,
      latency_s=args.latency_ms * 1e-3, codec_Bps=args.codec_GBps * 1e9,
      grad_dtype=args.grad_dtype, bucket_bytes=args.bucket_MiB * 2**20)
  try:
    setting.cluster(1e9)
    setting.workload()
  except ValueError as e:
    raise ValueError(f"utilisation: {e}") from None
  rows = utilisation.table(setting)
  text = tables.utilisation_table(setting, rows)
  print(text)
  if args.table:
    def write():
      with open(args.table, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    tables.write_output("--table", args.table, write)
    print(f"wrote {args.table}")
  if args.png:
    rates = np.logspace(np.log10(0.1e9 / 8), np.log10(1e12 / 8), 121)
    tables.utilisation_chart(setting, rates, rows, args.png)
  return 0
