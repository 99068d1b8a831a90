"""The main job's answer: which method reaches a loss first on each cluster.

Inputs are the proxy runs' validation-loss curves (one per method and seed)
and each method's predicted seconds per step on each cluster
(``pricing.predicted_ms``). The answer is built from:

* :func:`common_targets`: a few loss targets that every run (every method,
  every seed) reaches: the floor (the highest of the runs' lowest losses)
  plus 2%, 5% and 10% of the drop from the initial loss to it, rounded up
  to 0.001, so that no run's lowest (usually final) loss is itself a
  target; a target that every run already meets at its first
  evaluation (no run got below the initial loss) is left out, as it tells
  the methods apart by nothing;
* :func:`rank`: per cluster and target, the methods ordered by their mean
  predicted wall-clock to the target (step at which the curve first reaches
  it, linearly interpolated between evaluations, times the predicted
  seconds per step), with the spread over seeds;
* :func:`verdict`: the one-line recommendation per cluster at the hardest
  target: the workload whose compute is priced, the first method and its
  margin over the runner-up (their mean times' ratio, with the number of
  seeds behind it), or "no clear winner" when the two overlap within the
  seeds' spread (min to max); with one seed the spread is unknown and the
  line says so;
* :func:`answer_markdown`, :func:`plot_frontier`: the answer's tables and
  ``loss_vs_predicted_time.png`` (loss against predicted wall-clock, one
  panel per cluster, the y axis zoomed on the targets and final losses).

Units: seconds, losses in nats per token (per sample for classifiers).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from decentral_jax.tools.compare import plots
from decentral_jax.tools.compare import pricing

PLOT_NAME = "loss_vs_predicted_time.png"
# Targets above the floor, as fractions of the drop from the initial loss
# to it (easiest first); the hardest is not the floor itself, which is some
# run's lowest loss.
TARGET_STEPS = (0.10, 0.05, 0.02)


def common_targets(curves: dict, steps=TARGET_STEPS) -> list[float]:
  """Loss targets every curve reaches, easiest (highest) first.

  The floor is the highest of the curves' lowest finite losses, which
  every curve reaches; the drop is from the lowest of the curves' first
  finite losses (the initial loss) to the floor. The targets are the floor
  plus each fraction of ``steps`` of the drop, rounded up to 0.001 (still
  reached). A target that every curve's first finite loss already meets
  is dropped: every run would reach it at its first evaluation, which
  ranks nothing (:func:`no_target_reason` says why none is left).

  Args:
    curves: ``{method: [(eval steps, eval losses) per seed]}``.
    steps: fractions of the drop above the floor.

  Returns:
    The distinct targets, highest first; empty if some curve has no finite
    loss or no run gets below the initial loss.
  """
  lows, firsts = [], []
  for runs in curves.values():
    for _, losses in runs:
      finite = [float(x) for x in losses if math.isfinite(float(x))]
      if not finite:
        return []
      lows.append(min(finite))
      firsts.append(finite[0])
  if not lows:
    return []
  floor = max(lows)
  drop = max(min(firsts) - floor, 0.0)
  out = [math.ceil(round(1000 * (floor + f * drop), 6)) / 1000 for f in steps]
  return sorted({t for t in out if t < max(firsts)}, reverse=True)


def no_target_reason(curves: dict) -> str:
  """Why :func:`common_targets` is empty, in words (for the answer)."""
  for runs in curves.values():
    for _, losses in runs:
      if not any(math.isfinite(float(x)) for x in losses):
        return ("no loss target that every run reaches (a run has no finite "
                "loss)")
  return ("no common loss target below the initial loss (some run never "
          "got below it), so no method is named")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One method's predicted wall-clock to a target on one cluster.

  Attributes:
    name: the method.
    mean_s: mean over its seeds (s).
    low_s, high_s: smallest and largest over its seeds (s).
    seeds: how many seeds.
  """

  name: str
  mean_s: float
  low_s: float
  high_s: float
  seeds: int


def rank(curves: dict, ms: dict, target: float) -> list[Entry]:
  """The methods by predicted wall-clock to ``target``, fastest first.

  Args:
    curves: ``{method: [(eval steps, eval losses) per seed]}``.
    ms: ``{method: predicted ms/step (float) or why unpriced (str)}`` on
      one cluster.
    target: the loss to reach.

  Returns:
    :class:`Entry` s of the methods priced on the cluster whose every seed
    reaches ``target`` (ties keep ``curves``' order).
  """
  out = []
  for name, runs in curves.items():
    price = ms.get(name)
    if not isinstance(price, numbers.Real) or not runs:
      continue
    times = [pricing.time_to_target(s, l, target, price)
             for s, l in runs]
    if any(t is None for t in times):
      continue
    out.append(Entry(name, float(np.mean(times)), min(times), max(times),
                     len(times)))
  return sorted(out, key=lambda e: e.mean_s)


def verdict(cluster: str, ranking: list[Entry], target: float,
            labels: dict, workload: str = "") -> str:
  """The recommendation for one cluster, one line.

  ``ranking`` is :func:`rank` at ``target``; ``workload`` (words from
  :func:`pricing.workload_label`) follows the cluster's name. With several
  seeds the first method wins clearly when its slowest seed is faster than
  the runner-up's fastest; otherwise "no clear winner". The margin says
  how many seeds it is the mean of; with one seed the spread is said to be
  unknown.
  """
  cluster = f"{cluster}: priced for {workload}," if workload else \
      f"{cluster}:"
  if not ranking:
    return f"{cluster} no method could be priced here."
  best = ranking[0]
  took = pricing.format_duration
  head = (f"{cluster} **{labels[best.name]}**, first to loss {target:.3f} "
          f"in {took(best.mean_s)}")
  if len(ranking) == 1:
    return head + " (the only method priced here)."
  second = ranking[1]
  if _tie(best, second):
    return (f"{cluster} no clear winner (tie): {labels[best.name]} and "
            f"{labels[second.name]} reach loss {target:.3f} in "
            f"{took(best.mean_s)} each.")
  versus = (f"{_margin(best, second)} before {labels[second.name]} "
            f"({took(second.mean_s)})")
  if best.seeds < 2 or second.seeds < 2:
    return (f"{head}, {versus}; one seed, so the spread over seeds is "
            "unknown (--seeds=0,1,2 measures it).")
  if best.high_s < second.low_s:
    return (f"{head} (seeds {took(best.low_s)} to {took(best.high_s)}), "
            f"{versus}; clear: outside the {best.seeds} seeds' spread.")
  return (f"{cluster} no clear winner: {labels[best.name]} "
          f"({took(best.low_s)} to {took(best.high_s)}) and "
          f"{labels[second.name]} ({took(second.low_s)} to "
          f"{took(second.high_s)}) reach loss {target:.3f} within the "
          "seeds' spread.")


def _tie(best: Entry, second: Entry) -> bool:
  """Equal mean times (to rounding): neither method is first."""
  return math.isclose(best.mean_s, second.mean_s, rel_tol=1e-9, abs_tol=0.0)


def _margin(best: Entry, second: Entry) -> str:
  """``"1.23x"``: the runner-up's mean time over the first's."""
  if best.mean_s > 0:
    return f"{second.mean_s / best.mean_s:.2f}x"
  return "at its first evaluation,"  # the runner-up later: no ratio


def _cell(ranking: list[Entry], name: str) -> str:
  took = pricing.format_duration
  for k, e in enumerate(ranking):
    if e.name == name:
      text = took(e.mean_s)
      if e.seeds > 1:
        text += f" ({took(e.low_s)}-{took(e.high_s)})"
      # Bold: the first, and every method tied with it (else none is
      # marked as faster than an equal one).
      return f"**{text}**" if k == 0 or _tie(ranking[0], e) else text
  return "not priced"


def cluster_table(cluster: str, curves: dict, ms: dict, targets: list[float],
                  finals: dict, labels: dict) -> str:
  """One cluster's markdown table: a row per method, the predicted ms/step,
  the wall-clock to each target (the first in bold, and every method tied
  with it) and the final loss.

  ``finals``: ``{method: [final losses per seed]}``.
  """
  seeds = max((len(v) for v in finals.values() if v), default=1)
  head = ("| method | predicted ms/step | "
          + " | ".join(f"to loss <= {t:.3f}" for t in targets)
          + (" | final loss (mean of seeds) |" if seeds > 1 else
             " | final loss |") + "\n|" + "---|" * (3 + len(targets))
          + "\n")
  ranks = [rank(curves, ms, t) for t in targets]
  rows = []
  for name in curves:
    price = ms.get(name)
    cost = f"{price:.1f}" if isinstance(price, numbers.Real) else "-"
    final = finals.get(name) or []
    loss = f"{np.mean(final):.4f}" if final else "-"
    rows.append(f"| {labels[name]} | {cost} | "
                + " | ".join(_cell(r, name) for r in ranks) + f" | {loss} |")
  return head + "\n".join(rows) + "\n"


def _ends_lowest(curves: dict, ms: dict, finals: dict, labels: dict,
                 ranking: list[Entry]) -> str:
  """" <method> ends lowest (<loss> after <time>)." when the method with
  the lowest mean final loss is not the first to the floor target."""
  means = {k: float(np.mean(v)) for k, v in finals.items()
           if v and k in curves and isinstance(ms.get(k), numbers.Real)}
  if not means or not ranking:
    return ""
  low = min(means, key=means.get)
  if low == ranking[0].name:
    return ""
  end = max(float(np.max(s)) for s, _ in curves[low]) * ms[low] / 1e3
  return (f" {labels[low]} ends lowest ({means[low]:.4f} after "
          f"{pricing.format_duration(end)}).")


def answer_markdown(clusters, curves: dict, prices: dict, finals: dict,
                    labels: dict, at: dict | None = None,
                    workload: str = "") -> tuple[str, list[str]]:
  """The answer section of results.md, and the recommendation lines.

  Args:
    clusters: ``pricing.PricingCluster`` s.
    curves: ``{method: [(eval steps, eval losses) per seed]}`` of the runs
      that finished.
    prices: ``{method: {cluster label: ms or reason}}``.
    finals: ``{method: [final validation losses per seed]}``.
    labels: ``{method: label}``.
    at: ``{cluster label: GPUs it is priced at}`` (for the headings).
    workload: ``--workload`` (for the headings).

  Returns:
    ``(markdown, [one recommendation line per cluster])``.
  """
  targets = common_targets(curves)
  if not clusters:
    return "", []
  if not targets:
    line = no_target_reason(curves)
    return f"## The answer\n\nNone: {line}.\n\n", [line]
  seeds = max((len(r) for r in curves.values()), default=0)
  out = ["## The answer: which method reaches a loss first, per cluster\n",
         f"Targets: validation loss {', '.join(f'{t:.3f}' for t in targets)}"
         f"; every run reaches them (the highest of the runs' lowest losses "
         "plus 2%, 5% and 10% of the drop to it from the initial loss, "
         "rounded up, so that no run's lowest loss is a target). "
         "Cells: predicted wall-clock to the target (bold: first, "
         "or all tied for first"
         + ("; in brackets the range over seeds" if seeds > 1 else
            "; one seed per method") + "), the step at which the proxy's "
         "curve first reaches it times the predicted seconds per step.\n"]
  lines = []
  for cl in clusters:
    ms = {name: prices.get(name, {}).get(cl.label) for name in curves}
    priced = pricing.workload_label(cl, workload) if workload else ""
    line = verdict(cl.label, rank(curves, ms, targets[-1]), targets[-1],
                   labels, priced) + _ends_lowest(
                       curves, ms, finals, labels,
                       rank(curves, ms, targets[-1]))
    lines.append(line)
    where = [f"{at[cl.label]} GPUs" if isinstance((at or {}).get(cl.label),
                                                   int) else ""]
    if workload:
      where.append(f"time per step for {priced}")
    where = ", ".join(x for x in where if x)
    out.append(f"### {cl.label}" + (f" ({where})" if where else "") + "\n")
    out.append(cluster_table(cl.label, curves, ms, targets, finals, labels))
    out.append(f"Recommendation: {line}\n")
  return "\n".join(out) + "\n", lines


def _mean_curve(runs) -> tuple[np.ndarray, np.ndarray]:
  """The seeds' mean loss at the evaluation steps they share."""
  common = set.intersection(*(set(map(float, s)) for s, _ in runs))
  steps = np.array(sorted(common))
  ys = [np.interp(steps, np.asarray(s, float), np.asarray(l, float))
        for s, l in runs]
  return steps, np.mean(ys, axis=0)


def short_verdict(ranking: list[Entry], target: float, labels: dict) -> str:
  """The verdict in a few words, for a plot title."""
  if not ranking:
    return "no method priced"
  if len(ranking) == 1:
    return f"first to {target:.3f}: {labels[ranking[0].name]}"
  best, second = ranking[:2]
  if _tie(best, second):
    return f"to {target:.3f}: no clear winner (tie)"
  if best.seeds > 1 and second.seeds > 1 and best.high_s >= second.low_s:
    return f"to {target:.3f}: no clear winner (within the seeds' spread)"
  return (f"first to {target:.3f}: {labels[best.name]}, "
          f"{_margin(best, second)} before {labels[second.name]}")


def plot_frontier(clusters, curves: dict, prices: dict, labels: dict,
                  at: dict, outdir: str, workload: str = "") -> str:
  """``loss_vs_predicted_time.png``: loss against predicted wall-clock.

  One panel per cluster; x: step x the method's predicted seconds per
  step there (log scale, step 0 left out), y: validation loss (mean over
  seeds), zoomed from the lowest loss to a little above the easiest of
  :func:`common_targets` (dashed lines); the title carries the cluster, its
  GPU count (``at``: ``{label: GPUs}``), the workload whose compute is
  priced (``workload``: ``--workload``, :func:`pricing.workload_label`)
  and :func:`short_verdict`.

  Returns:
    The PNG path.

  Raises:
    OSError: the file could not be written.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  targets = common_targets(curves)
  cols = min(len(clusters), 3)
  rows_n = -(-len(clusters) // cols)
  fig, axes = plt.subplots(rows_n, cols, figsize=(5.8 * cols, 4.6 * rows_n),
                           squeeze=False)
  for ax in axes.flat[len(clusters):]:
    ax.axis("off")
  for ax, cl in zip(axes.flat, clusters):
    ms = {name: prices.get(name, {}).get(cl.label) for name in curves}
    lows = []
    for name, runs in curves.items():
      if not isinstance(ms[name], numbers.Real) or not runs:
        continue
      steps, losses = _mean_curve(runs)
      keep = (steps > 0) & np.isfinite(losses)
      ax.plot(steps[keep] * ms[name] / 1e3, losses[keep], marker="o",
              markersize=3, label=labels[name])
      lows.extend(losses[keep].tolist())
    for t in targets:
      ax.axhline(t, linestyle="--", color="gray", linewidth=0.8)
    if lows and targets:
      lo, top = min(lows), targets[0]
      pad = 0.15 * max(top - lo, 1e-3)
      ax.set_ylim(lo - pad, top + 2 * pad)
    ax.set_xscale("log")
    verdict_words = (short_verdict(rank(curves, ms, targets[-1]), targets[-1],
                                   labels) if targets else
                     "no common target below the initial loss")
    priced = (f"; {pricing.workload_label(cl, workload)}" if workload
              else "")
    ax.set_title(f"{cl.label}, {at.get(cl.label, '?')} GPUs (predicted"
                 f"{priced})\n{verdict_words}", fontsize=8)
    ax.set_xlabel("predicted wall-clock (s, log): step x predicted s/step")
    ax.set_ylabel("validation loss, zoomed (nats)")
    ax.grid(alpha=0.3, which="both")
    if lows:
      ax.legend(fontsize=7)
  fig.tight_layout()
  out = os.path.join(outdir, PLOT_NAME)
  plots.save_png(fig, out)
  plt.close(fig)
  return out
