"""The main job's results: ``results.md``, the tables and the plots.

:func:`write_results` writes ``results.md`` (the answer per cluster, the
recommendations, the set-up, the details table of :func:`results_table`
and the reference check) and the plots (:mod:`.plots`, and the frontier of
:mod:`.answer`), then deletes the plots of :data:`PLOT_NAMES` an earlier
invocation left and this one did not write (:func:`remove_stale_plots`).
"""

from __future__ import annotations

import io
import os
import sys
import time

import jax
import numpy as np

from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import tmpfile
from decentral_jax.tools.compare import answer as answer_lib
from decentral_jax.tools.compare import plots
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.compare import runs as runs_lib


def results_table(rows: list[tuple[runs_lib.Run, dict | None]], unit: str,
                  extra: tuple[list[str], dict[str, list[str]]] | None = None
                  ) -> str:
  """Markdown table of final metrics, one row per run (None: diverged).

  ``extra``: ``(headers, {run.name: cells})`` of further columns (the
  clusters' predictions, ``pricing.pricing_columns``).
  """
  heads, cells = extra or ([], {})
  head = ("| run | val loss, averaged model | workers' own models: extra "
          "loss, mean / max | consensus distance | sent per step, x params "
          f"(MB) | ms/step | {unit}/s |" + "".join(f" {h} |" for h in heads)
          + "\n|" + "---|" * (7 + len(heads)) + "\n")
  def signed(x: float) -> str:
    return f"{round(x, 4) + 0.0:+.4f}"  # no "-0.0000"

  lines = []
  for run, m in rows:
    more = "".join(f" {x} |" for x in cells.get(run.name, ["-"] * len(heads)))
    if m is None:
      lines.append(f"| {run.label} | diverged | - | - | - | - | - |{more}")
      continue
    sent = "-"
    if "comm/ratio" in m:
      sent = (f"{m['comm/ratio']:.3f} "
              f"({m['comm/bytes_per_step'] / 1e6:.2f})")
    lines.append(
        f"| {run.label} | {m['eval/loss']:.4f} | "
        f"{signed(m['eval/worker_excess_mean'])} / "
        f"{signed(m['eval/worker_excess_max'])} | "
        f"{m['consensus_distance']:.3g} | {sent} | "
        f"{m.get('step_time_ms', float('nan')):.1f} | "
        f"{m.get(f'{unit}_per_sec', float('nan')):,.0f} |{more}")
  return head + "\n".join(lines) + "\n"


def timing_columns(table: str, keep: bool) -> str:
  """``results_table``'s table without its CPU timing columns (ms/step,
  tokens/s or samples/s), or (``keep``) with them labelled as this
  machine's load-dependent timing."""
  rows = [[x.strip() for x in line.strip()[1:-1].split("|")]
          for line in table.strip("\n").split("\n")]
  idx = {k for k, h in enumerate(rows[0])
         if h in ("ms/step", "tokens/s", "samples/s")}
  out = []
  for r, row in enumerate(rows):
    if keep:
      row = [f"this CPU's {x} (load-dependent, not a ranking)"
             if r == 0 and k in idx else x for k, x in enumerate(row)]
    else:
      row = [x for k, x in enumerate(row) if k not in idx]
    out.append("| " + " | ".join(row) + " |" if r != 1 else
               "|" + "---|" * len(row))
  return "\n".join(out) + "\n"


def _setup_words(base, arms: list[runs_lib.Arm], accum: int,
                 per_method_lr: bool, unit: str) -> str:
  """The proxy runs' set-up, for results.md."""
  methods = list(dict.fromkeys(a.method.name for a in arms))
  seeds = sorted({a.seed for a in arms})
  peak = float(base.schedule.peak_lr)
  lrs = (", ".join(f"{m} {runs_lib.TUNED_PEAK_LR.get(m, peak):g}"
                   for m in methods)
         + " (each chosen for gpt_tiny at 300 steps by the tuning protocol,"
         " BENCHMARKS.md section 10)" if per_method_lr else
         f"{float(base.schedule.peak_lr):g} for all runs")
  return (
      f"Proxy runs: {base.model.name}, {int(base.n_workers)} workers, "
      f"{int(base.steps)} steps, global batch {int(base.global_batch)}, "
      f"seed{'s' if len(seeds) > 1 else ''} "
      f"{', '.join(map(str, seeds))}; same initial parameters and data "
      "order for every method at a seed; "
      + (f"AccumAdamW accum_steps {accum}; " if any(
          a.method.optimizer == "accum_adamw" for a in arms) else "")
      + f"peak learning rates {lrs}, cosine to a tenth of the peak. Losses: "
      f"validation loss (nats per {unit[:-1]}) of the exact average x_bar of "
      "the workers' parameters.\n\n")


def _details_text(n_devices: int, platform: str) -> str:
  return (
      "Columns: validation loss of x_bar at the last step; the extra loss of "
      "each worker's own parameters over x_bar on the same validation "
      "subset (1/n of it); consensus distance (1/n) sum_i ||x_i - "
      "x_bar||^2; the bytes the busiest worker sends per step, averaged "
      "over a sync period and divided by one worker's parameter bytes "
      "(read from the step's HLO: with one device per worker the HLO the "
      "program hands to XLA, i.e. what it asks for, e.g. comm_dtype bytes; "
      "with several devices per worker the compiled HLO, in which XLA:CPU "
      "widens bfloat16 collectives to float32; the consensus-distance "
      "diagnostic of logging steps left out); the runtime model's "
      f"predicted ms/step on each cluster. The runs used {n_devices} "
      f"simulated {platform} devices on one host.\n\n")


def _curves_and_losses(arms, finals, outdir: str):
  """``(eval curves, final losses, diverged methods, methods without a
  loss curve)`` per method name.

  A method with a diverged seed (its final metrics None), or a seed whose
  metrics.jsonl is missing or damaged (named in a ``warning:`` line), is
  left out of the curves, so out of the answer.
  """
  curves, losses, bad = {}, {}, set()
  for a, m in zip(arms, finals):
    if m is not None:
      try:
        curve = pricing.eval_curve(
            os.path.join(outdir, a.run.name, metrics_lib.METRICS_FILE))
      except ValueError as e:  # damaged since it was kept: named, left out
        print(f"warning: {e}; its loss curve is left out.", file=sys.stderr)
        curve = (np.zeros(0), np.zeros(0))
      curves.setdefault(a.method.name, []).append(curve)
      losses.setdefault(a.method.name, []).append(float(m["eval/loss"]))
      if not len(curve[0]):
        bad.add(a.method.name)
  diverged = {a.method.name for a, m in zip(arms, finals) if m is None}
  curves = {k: v for k, v in curves.items() if k not in bad | diverged}
  return curves, losses, diverged, bad - diverged


def write_results(arms: list[runs_lib.Arm], finals: list, diverged, outdir: str,
                  base, accum: int, per_method_lr: bool, start: float,
                  load_before: float, clusters=(), workload: str = "",
                  prices: dict | None = None, reference_line: str = "",
                  cpu_timing: bool = False):
  """Writes results.md and the plots.

  Args:
    arms: the job's :class:`~.runs.Arm` s.
    finals: final metrics per arm (None: it diverged), in ``arms``' order.
    diverged: ``[(run, reason)]``.
    outdir, base, accum, per_method_lr: as in :func:`.command.load_job`.
    start, load_before: ``time.perf_counter()`` and the load average when
      the runs started.
    clusters: ``pricing.PricingCluster`` s to price the runs on.
    workload: ``--workload``.
    prices: ``{method name: pricing.predicted_ms(...)}``.
    reference_line: :func:`.reference.reference_check`'s line.
    cpu_timing: keep this machine's timing columns and plot.

  Returns:
    ``(answer markdown, recommendation lines, details table, png paths,
    total seconds)``.

  Raises:
    OSError: a file could not be written.
  """
  unit = "tokens" if base.model.name == "gpt" else "samples"
  n = int(base.n_workers)
  prices = prices or {}
  logs = [(a.run, os.path.join(outdir, a.run.name, metrics_lib.METRICS_FILE))
          for a in arms]
  rows = [(a.run, m) for a, m in zip(arms, finals)]
  labels = {a.method.name: a.method.label for a in arms}
  curves, losses, bad, no_curve = _curves_and_losses(arms, finals, outdir)
  at = {cl.label: pricing.priced_workers(cl, n) for cl in clusters}
  answer, lines = answer_lib.answer_markdown(
      clusters, curves, prices, losses, labels, at, workload)
  extra, notes = None, []
  if clusters:
    arm_prices = {a.run.name: prices.get(a.method.name, {}) for a in arms}
    heads, cells, notes = pricing.pricing_columns(rows, arm_prices,
                                                          clusters)
    extra = (heads, cells)
  table = timing_columns(results_table(rows, unit, extra), cpu_timing)
  if notes:
    table += "\n" + "\n".join(f"- {x}" for x in notes) + "\n"
  specs = {a.method.label: pricing.method_spec(a.config)
           for a in arms}
  total = time.perf_counter() - start
  with io.StringIO() as f:  # written whole through results.md.tmp
    f.write(f"# Which method on which cluster ({base.model.name} proxy, {n} "
            f"workers, {int(base.steps)} steps)\n\n")
    f.write(_setup_words(base, arms, accum, per_method_lr, unit))
    f.write(pricing.pricing_text(clusters, n, workload, specs,
                                         base.model.name))
    f.write(answer)
    if bad:
      f.write(f"Left out of the answer (a seed diverged): "
              f"{', '.join(labels[k] for k in bad)}.\n\n")
    if no_curve:
      f.write(f"Left out of the answer (a seed's metrics.jsonl is missing or "
              f"damaged): {', '.join(labels[k] for k in no_curve)}.\n\n")
    f.write(f"Reference check: {reference_line}\n\n## Details\n\n")
    f.write(_details_text(len(jax.devices()),
                          jax.devices()[0].platform.upper()))
    f.write(table)
    for run, reason in diverged:
      f.write(f"\n{run.label} diverged: {reason}\n")
    f.write(f"\nThis invocation took {total:.0f} s for {len(arms)} runs (a "
            "run kept from an earlier invocation adds nothing) on "
            f"{os.cpu_count()} CPU cores, 1-minute load average "
            f"{load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at "
            "the end.\n")
    tmpfile.replace(os.path.join(outdir, "results.md"), f.getvalue())
  pngs = plots.plot(logs, outdir, cpu_timing)
  if clusters:
    pngs.append(answer_lib.plot_frontier(clusters, curves, prices, labels,
                                         at, outdir, workload))
  remove_stale_plots(outdir, pngs)
  return answer, lines, table, pngs, total


# Every plot the main job writes into --outdir.
PLOT_NAMES = ("loss_vs_step.png", plots.CPU_PLOT, answer_lib.PLOT_NAME)


def remove_stale_plots(outdir: str, written: list[str]) -> list[str]:
  """Deletes the plots of :data:`PLOT_NAMES` that an earlier invocation
  left in ``outdir`` and this one did not write (``written``: its PNG
  paths), e.g. the CPU plot after a rerun without ``--cpu_timing``.

  Returns:
    The deleted paths.

  Raises:
    OSError: a stale plot cannot be deleted.
  """
  keep = {os.path.basename(p) for p in written}
  gone = []
  for name in PLOT_NAMES:
    path = os.path.join(outdir, name)
    if name not in keep and os.path.lexists(path) and not os.path.isdir(
        path):
      os.remove(path)
      gone.append(path)
  return gone
