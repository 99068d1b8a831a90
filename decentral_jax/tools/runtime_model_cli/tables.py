"""Tables and charts the runtime model's command line prints and draws.

``predict``'s table per worker count (:func:`print_table`, times in ms, bytes
in MB = 1e6 bytes) and its faults table (:func:`print_faults`), the
measured-vs-predicted rows of ``fig6`` and ``validate`` (:func:`rows_text`),
the ``utilisation`` table (:func:`utilisation_table`, Gbit/s) and the PNG
charts (:func:`bar_chart`, :func:`utilisation_chart`; matplotlib is imported
only to draw). NumPy only: no JAX.
"""

from __future__ import annotations

import math

from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import worker_devices
from decentral_jax.runtime_model import stragglers
from decentral_jax.runtime_model import utilisation
from decentral_jax.method_names import label

# Relative error of a Figure 6 bar the acceptance allows (fig6, validate).
TOLERANCE = 0.2

# A part of a step (comm ms, var ms) below this fraction of its row's step
# time is float rounding of a difference of step-sized numbers: printed 0.0.
ROUNDING = 1e-9


def bar_chart(panels, path: str, ylabel: str = "ms / iteration") -> None:
  """Grouped bar chart like the paper's Figure 6.

  Args:
    panels: list of ``(title, [(group_label, {method: ms}, {method: ms} or
      None)])``; the first dict is drawn as solid bars, the optional second
      (measured values) as hatched bars beside them.
    path: PNG file to write.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8),
                           squeeze=False)
  colors = plt.get_cmap("tab10").colors
  for ax, (title, groups) in zip(axes[0], panels):
    methods = list(groups[0][1])
    both = groups[0][2] is not None
    width = 0.8 / (len(methods) * (2 if both else 1))
    for k, meth in enumerate(methods):
      for g, (_, pred, meas) in enumerate(groups):
        x0 = g + (k * (2 if both else 1)) * width - 0.4 + width / 2
        ax.bar(x0, pred[meth], width, color=colors[k],
               label=label(meth) + (" (model)" if both else "") if g == 0
               else None)
        if both:
          ax.bar(x0 + width, meas[meth], width, color="white",
                 edgecolor=colors[k], hatch="///",
                 label=label(meth) + " (measured)" if g == 0 else None)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", fontsize=8,
             ncol=min(len(labels), 4), frameon=False)
  fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 3) // 4) + 0.02, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_output(flag: str, path: str, write) -> None:
  """Calls ``write()``, which writes the output file ``path`` of ``flag``
  (``--png``, ``--table``, ``--out``); an OS error (a full device, a
  file system gone read-only) is one line naming both.

  Raises:
    ValueError: ``--table '/dev/full' could not be written (No space
      left on device); give another --table.`` (the form of
      :func:`decentral_jax.tools.flag_types.write_output`).
  """
  try:
    write()
  except OSError as e:
    raise ValueError(f"{flag} {path!r} could not be written "
                     f"({e.strerror or e}); give another {flag}.") from None


def write_chart(panels, path: str) -> None:
  """``bar_chart`` to ``--png path`` (:func:`write_output`)."""
  write_output("--png", path, lambda: bar_chart(panels, path))
  print(f"wrote {path}")


def _shape(c) -> str:
  """``(4 nodes x 8)``, or with datacenters ``(2 datacenters x 2 nodes x 8,
  wide-area 10 Gbit/s, 30 ms)``."""
  def nodes(k):
    return f"{k} node{'' if k == 1 else 's'} x {c.local_size}"
  if c.datacenters == 1:
    return f"({nodes(c.n_nodes)})"
  return (f"({c.datacenters} datacenters x {nodes(c.n_nodes // c.datacenters)}"
          f", wide-area {8 * c.wan_bandwidth_Bps / 1e9:.3g}"
          f" Gbit/s, {1e3 * c.wan_latency_s:.3g} ms)")


def print_table(n: int, c, w, table: dict[str, recommend.Prediction],
                 methods: dict | None = None,
                 break_even=recommend.break_even) -> None:
  """``predict``'s table at ``n`` workers, its footnotes and recommendation.

  ``methods``: ``{key: Method}`` of the table, for the break-even lines of
  compressed methods, found by ``break_even(m, c, w)`` (predict passes
  one that reuses the lines its flag check computed).
  """
  ar = table["all_reduce"].simulated_s if "all_reduce" in table else None
  span = (f" of {w.devices_per_worker} devices ({w.worker_layout})"
          if w.devices_per_worker > 1 else "")
  print(f"n={n} workers{span} {_shape(c)}, "
        f"compute {1e3 * w.compute_mean_s:.1f} ms (CV "
        f"{w.compute_std_s / max(w.compute_mean_s, 1e-300):.2f})")
  width = max([22] + [len(label(k)) + 3 for k in table])
  wan = c.datacenters > 1
  rows = [["method", "sim ms", "closed ms", "vs AR", "comm ms", "var ms",
           "MB/it", "node MB/it"] + (["WAN MB/it"] if wan else [])]
  for key, p in table.items():
    ratio = ar / p.simulated_s if ar else None
    speed = ("-" if ratio is None else f"{ratio:.2f}x" if ratio < 99.995
             else f" {ratio:.0f}x")
    star = ("*" if p.slow_mixing else "") + ("^" if p.library_gap else "")
    step = max(abs(p.simulated_s), abs(p.estimate.iteration_s))
    rows.append([label(key) + star] + [_ms_text(v) for v in (
        p.simulated_s, p.estimate.iteration_s)] + [speed] + [
            _ms_text(part_of_step(v, step)) for v in (
                p.estimate.exposed_comm_s, p.estimate.variability_s)] + [
            f"{v:.1f}" for v in (
                p.sent.worker_bytes / 1e6, p.sent.node_bytes / 1e6)
            + ((p.sent.dc_bytes / 1e6,) if wan else ())])
  print("\n".join(aligned(rows, [width, 9, 10, 7, 9, 8, 9, 11, 10])))
  print("  MB/it: MB (1e6 bytes) the busiest worker sends per iteration; "
        "node MB/it: leaving the busiest node (averaged over a period)"
        + ("; WAN MB/it: leaving the busiest datacenter" if wan else ""))
  if w.devices_per_worker > 1:
    inner = next(iter(table.values())).sent.inner_bytes
    print(f"  inside each worker (every method): "
          f"{1e3 * worker_devices.inner_collective_s(c, w):.1f} ms and "
          f"{inner / 1e6:.1f} MB per iteration between its "
          f"{w.devices_per_worker} devices ({w.worker_layout}), counted "
          "in comm ms")
  if any(p.slow_mixing for p in table.values()):
    print("  * no exact averaging within one period (slower mixing); not "
          "recommended")
  gaps = sorted({p.library_gap for p in table.values() if p.library_gap})
  if gaps:
    print("  ^ not in the library yet (priced as asked; never recommended): "
          + "; ".join(gaps))
  if any(p.local for p in table.values()):
    print("  local-update methods sync every H steps: per-iteration time "
          "only, not the loss per iteration")
  for key, m in (methods or {}).items():
    if m.compress is not None:
      print(recommend.break_even_line(key, break_even(m, c, w)))
  line = recommend.recommend(table)
  print("  recommendation: " + line)
  if recommend.quality_caveat(line):
    print("  recommendation caveat: " + recommend.quality_caveat(line))


def fault_mode(m) -> tuple[str, int]:
  """``(mode, H)`` of a method under faults: All-Reduce waits, gossip does
  not (deadline), DiLoCo / Local SGD over an exact all-reduce use a quorum
  (local D-SGD gossips: deadline)."""
  if m.kind == "all_reduce":
    return "wait", 1
  if m.kind == "local" and m.topology is None:
    return "quorum", int(m.period)
  return "deadline", 1


def faults_line(n: int, faults, on_failure: str) -> str:
  """The faults of ``n`` workers, only the kinds that are set: slow workers
  (``k`` at speed ``s < 1``) and failures (rate, downtime, ``on_failure``)."""
  k, parts = faults.slow_workers(n), []
  if k and faults.slow_speed < 1.0:  # k = 0 is refused (check_slow_workers)
    parts.append(f"{k} of {n} workers at speed {faults.slow_speed:g}")
  if faults.failure_rate:
    parts.append(f"failure rate {faults.failure_rate:g}/step, mean downtime "
                 f"{faults.mean_downtime:g} steps (up "
                 f"{100 * faults.up_fraction:.1f}% of the time); "
                 f"on_failure={on_failure}")
  return "  with faults: " + ", ".join(parts)


def print_faults(n: int, w, table, made, faults, on_failure: str) -> None:
  """The table of what the faults cost each method (``docs/faults.md``)."""
  print(faults_line(n, faults, on_failure))
  width = max([22] + [len(label(key)) + 3 for key in table])
  rows = [["method", "mode", "ms/step", "work %", "useful %", "ms/useful"]]
  for key, p in table.items():
    mode, period = fault_mode(made[key])
    cost = stragglers.straggler_cost(
        mode, n, p.simulated_s, faults, compute_s=w.compute_mean_s,
        compute_std_s=w.compute_std_s, period=period, on_failure=on_failure)
    rows.append([label(key), mode, _ms_text(cost.step_s),
                 f"{100 * cost.work_done:.1f}", f"{100 * cost.useful:.1f}",
                 _ms_text(cost.time_per_useful_step)])
  print("\n".join(aligned(rows, [width, 9, 9, 8, 9, 10])))
  print("  wait: every step waits for the slowest worker and stalls while "
        "any is down; deadline: gossip goes on without them; quorum: "
        "DiLoCo's outer step over the live workers. useful %: worker-steps "
        "that count; ms/useful = ms/step / useful")


def aligned(rows: list[list[str]], widths: list[int]) -> list[str]:
  """``rows`` of cells (the header first) as lines indented by two spaces:
  the first column left-aligned, the others right-aligned, column ``j``
  ``widths[j]`` wide or, where a cell is longer, one more than its longest
  cell, so a space separates every two cells whatever the numbers (a
  column is as wide in every row, header included)."""
  cols = [max(w, 1 + max(len(r[j]) for r in rows))
          for j, w in enumerate(widths[:len(rows[0])])]
  return ["  " + r[0].ljust(cols[0]) + "".join(
      cell.rjust(w) for cell, w in zip(r[1:], cols[1:])) for r in rows]


def part_of_step(seconds: float, step_s: float) -> float:
  """``seconds``, a part of a step of ``step_s`` seconds (its exposed
  communication or its variability), or 0.0 where ``|seconds|`` is below
  :data:`ROUNDING` x ``step_s``: float rounding of a difference of
  step-sized numbers (e.g. 6.9e-17 s in a 0.1 s step), not a time. Seconds
  in, seconds out."""
  return 0.0 if abs(seconds) < ROUNDING * abs(step_s) else seconds


def _ms_text(seconds: float) -> str:
  """``seconds`` in ms: one decimal, or 3 significant digits from 1e6 ms
  on (e.g. ``6.11e+06``: every step waiting for all of 16 workers each up
  half the time), or 2 below 0.05 ms (``0.0072``, not a ``0.0`` beside a
  speed-up of 14x)."""
  ms = 1e3 * seconds
  if 0 < abs(ms) < 0.05:
    return f"{ms:.2g}"
  if abs(ms) < 1e6 or not math.isfinite(ms):
    return f"{ms:.1f}"
  return f"{ms:.3g}"


# Why a method's Figure 6 bars are reported but not judged.
NOT_JUDGED = {
    "sgp": "SGP (Exp) is reported, not judged: the model prices it as "
           "blocking push-sum, while its measured bars on A100 and A40 are "
           "near Exp's, as if its gossip overlapped the compute",
    "all_reduce": "All-Reduce is the bar the compute was fitted to",
}


def rows_text(table, judged, tolerance: float = TOLERANCE) -> str:
  """The measured-vs-predicted table of ``fig6`` and ``validate``.

  Args:
    table: rows of :func:`paper.rows` or :func:`holdout.rows` (``error`` =
      simulated / measured - 1).
    judged: methods the acceptance judges. A row with ``|error| >
      tolerance`` is marked ``!`` if its method is judged, else ``~``; a
      footnote explains each mark shown (:data:`NOT_JUDGED` says why).
    tolerance: the acceptance's relative error.
  """
  lines = [f"{'cluster':<8}{'GPUs':>5}  {'method':<14}{'measured':>9}"
           f"{'sim':>8}{'closed':>8}{'error':>8}"]
  marked = {"!": set(), "~": set()}
  for r in table:
    mark = ""
    if abs(r["error"]) > tolerance:
      mark = "!" if r["method"] in judged else "~"
      marked[mark].add(r["method"])
    lines.append(f"{r['cluster']:<8}{r['n']:>5}  {label(r['method']):<14}"
                 f"{r['measured_ms']:9.1f}{r['simulated_ms']:8.1f}"
                 f"{r['closed_form_ms']:8.1f}{100 * r['error']:+7.1f}% "
                 f"{mark}".rstrip())
  pct = f"{100 * tolerance:.0f}%"
  if marked["!"]:
    lines.append(f"! error beyond +-{pct}, the acceptance's tolerance")
  if marked["~"]:
    lines.append(f"~ error beyond +-{pct} in a bar the acceptance does not "
                 "judge: " + "; ".join(
                     NOT_JUDGED.get(m, f"{label(m)} is not judged")
                     for m in sorted(marked["~"])))
  return "\n".join(lines)


def utilisation_table(setting, rows) -> str:
  """The ``utilisation`` table (Markdown): Gbit/s needed per target."""
  targets = utilisation.TARGETS
  head = ("Compute utilisation against the link rate between workers: "
          f"{setting.n_workers} workers, {setting.param_count:.3g} "
          f"parameters, {1e3 * setting.step_s:.0f} ms of compute per step, "
          f"H = {setting.period}, latency {1e3 * setting.latency_s:.3g} ms, "
          f"codec {setting.codec_Bps / 1e9:.3g} GB/s (closed form, no "
          "compute variability). Gbit/s needed for each utilisation:")
  lines = [head, "", "| method | spec | " + " | ".join(
      f"{100 * t:.0f}%" for t in targets) + " |",
           "|---|---|" + "---|" * len(targets)]
  for r in rows:
    cells = ["not reached" if x is None else f"{8 * x / 1e9:.3g}"
             if x < 125e9 else f"{8 * x / 1e9:.0f}" for x in r["rates_Bps"]]
    mark = " ^" if r["library_gap"] else ""
    lines.append(f"| {r['label']}{mark} | `{r['spec']}` | "
                 + " | ".join(cells) + " |")
  gaps = sorted({r["library_gap"] for r in rows if r["library_gap"]})
  if gaps:
    lines.append("")
    lines.append("^ not in the library yet: " + "; ".join(gaps) + ".")
  dp = rows[0]["rates_Bps"][targets.index(0.95)] if 0.95 in targets else None
  if dp is not None:
    ratio = 8 * dp / 1e9 / utilisation.PAPER_DP_95_GBPS
    lines.append("")
    lines.append(f"data-parallel at 95%: {8 * dp / 1e9:.3g} Gbit/s; Kale et "
                 f"al. 2025 (Table 5): about {utilisation.PAPER_DP_95_GBPS:g}"
                 f" Gbit/s (ratio {ratio:.2f}).")
  return "\n".join(lines)


def utilisation_chart(setting, rates, rows, path: str) -> None:
  """Utilisation (%) against Gbit/s, one line per method; ``path`` a PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  curves = utilisation.curves(setting, rates)
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  gaps = {r["label"] for r in rows if r["library_gap"]}
  for (lab, util), style in zip(curves.items(), ("-", "-", "--", "--", "--")):
    ax.plot(8 * rates / 1e9, 100 * util, style,
            label=lab + (" (not in the library)" if lab in gaps else ""))
  ax.axhline(95, color="grey", lw=0.8, ls=":")
  ax.axvline(utilisation.PAPER_DP_95_GBPS, color="grey", lw=0.8, ls=":")
  ax.text(utilisation.PAPER_DP_95_GBPS * 1.05, 40, "paper: DP 95% at\n222 "
          "Gbit/s", fontsize=7, color="grey")
  ax.set_xscale("log")
  ax.set_ylim(0, 101)
  ax.set_xlabel("bandwidth between workers (Gbit/s per direction)")
  ax.set_ylabel("compute utilisation (%)")
  ax.set_title(f"{setting.param_count:.3g} parameters, "
               f"{1e3 * setting.step_s:.0f} ms per step, H = "
               f"{setting.period}, {setting.n_workers} workers")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  try:
    write_output("--png", path, lambda: fig.savefig(path, dpi=120))
  finally:
    plt.close(fig)
  print(f"wrote {path}")
