"""compare.py's runs priced on clusters with the runtime model: which method?

compare.py measures each method's validation loss per step on the config's
model and data. This module predicts the time of one step of each method on
a cluster with the runtime model (:mod:`decentral_jax.runtime_model`) and
puts the two together:

* :func:`parse_clusters`: ``--clusters`` entries (Figure 6 presets ``A40``
  and ``T4``, or cluster JSON files written by ``python -m
  decentral_jax.runtime_model measure``) as :class:`PricingCluster`;
* :func:`predicted_ms`: a run config's predicted ms/iteration on each
  cluster at ``config.n_workers`` workers (``core.simulate``, as
  ``predict`` does);
* :func:`step_to_target`, :func:`time_to_target`: where a validation-loss
  curve first reaches a target loss (linear interpolation between
  evaluations), in steps and in seconds;
* :func:`pricing_columns`, :func:`pricing_text`,
  :func:`plot_predicted_time`: the table columns with their footnotes, the
  explanation above the table and ``loss_vs_predicted_time.png``.

Units: ms per iteration in the table, seconds everywhere else.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from decentral_jax.runner import builders
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runtime_model.cli import inputs as cli_inputs
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model import core
from decentral_jax.runtime_model import paper

SIM_STEPS = 300  # predict's default --steps; the first fifth is warm-up
SIM_SEED = 0
PLOT_NAME = "loss_vs_predicted_time.png"
# Figure 6's clusters in words (paper.PUBLISHED holds the numbers).
_PRESET_WORDS = {"A40": "4 x A40 per node, 25 Gbit/s Ethernet",
                 "T4": "8 x T4 per node, 100 Gbit/s InfiniBand"}
_HOW = ("give comma-separated preset names ({}) or paths of cluster JSON "
        "files written by `python -m decentral_jax.runtime_model measure`")


@dataclasses.dataclass(frozen=True, eq=False)
class PricingCluster:
  """One ``--clusters`` entry.

  Attributes:
    label: its name in the table and plot: the preset name, or the file's
      basename (the path as given when two files share a basename).
    preset: a key of ``paper.PUBLISHED``, or None for a file.
    path: the cluster file as given, or None for a preset.
    data: the file's contents (``cluster_file.read``), or None.
  """

  label: str
  preset: str | None = None
  path: str | None = None
  data: dict | None = None

  def setup(self, n: int, workload_fields: dict | None = None
            ) -> tuple[core.Cluster, core.Workload]:
    """The cluster and its workload at ``n`` workers.

    Preset: ``paper.setup`` (the paper's Transformer-base, compute fitted to
    Figure 6 at ``n`` GPUs). File: its links for ``n`` workers and its
    measured workload. ``workload_fields`` (``devices_per_worker``,
    ``worker_layout``, from ``builders.spec_for_config``) replace the
    workload's.

    Raises:
      ValueError: ``n`` is not a positive multiple of the cluster's workers
        per node.
    """
    fields = dict(workload_fields or {})
    if self.preset is not None:
      c, w = paper.setup(self.preset, int(n))
      return c, dataclasses.replace(w, **fields)
    return (cluster_file.cluster(self.data, int(n)),
            cluster_file.workload(self.data, **fields))

  def describe(self, n: int) -> str:
    """This cluster and its workload at ``n`` workers, in words."""
    if self.preset is not None:
      hw = _PRESET_WORDS.get(
          self.preset, f"{paper.PUBLISHED[self.preset]['local_size']} GPUs "
          "per node")
      fitted = paper.FIG6_MS.get(self.preset, {}).get("n", ())
      text = (f"{self.label}: Figure 6's {self.preset} cluster ({hw}) with "
              "the paper's workload, Transformer-base (65M parameters, "
              "float32 on the wire unless a spec sets comm_dtype), compute "
              f"fitted to Figure 6 at {n} GPUs")
      try:
        _, w = self.setup(n)
        text += f" ({1e3 * w.compute_mean_s:.0f} ms per iteration)"
      except ValueError:
        pass
      if fitted and not min(fitted) <= n <= max(fitted):
        text += (f"; Figure 6 measured {', '.join(map(str, fitted))} GPUs, "
                 f"so at {n} the fit is extrapolated")
      return text
    meta, c = self.data.get("meta"), self.data["cluster"]
    meta = meta if isinstance(meta, dict) else {}
    w = self.data["workload"]
    return (f"{self.label}: the cluster measured in {self.path} "
            f"({meta.get('devices', c['n_workers'])} "
            f"{meta.get('device_kind', '')} devices, {c['local_size']} per "
            "node) with its measured workload ("
            f"{float(w['param_count']):,.0f} parameters, forward "
            f"{1e3 * w['forward_s']:.3g} ms, backward "
            f"{1e3 * w['backward_s']:.3g} ms per worker)")


def parse_clusters(spec: str) -> tuple[PricingCluster, ...]:
  """The clusters of ``--clusters``: comma-separated presets or files.

  An entry equal (ignoring case) to a key of ``paper.PUBLISHED`` is that
  preset; any other entry is a path to a cluster JSON file written by
  ``python -m decentral_jax.runtime_model measure``, with a measured
  workload. An empty ``spec`` gives no clusters (no pricing).

  Raises:
    ValueError: an entry that is neither a preset nor an existing file, a
      file that cannot be read, is not a valid cluster file or has no
      measured workload, or a cluster given twice; the message names
      ``--clusters`` and says what to give instead.
  """
  how = _HOW.format(", ".join(sorted(paper.PUBLISHED)))
  presets = {k.lower(): k for k in paper.PUBLISHED}
  out, seen = [], set()
  for entry in (x.strip() for x in str(spec).split(",")):
    if not entry:
      continue
    if entry.lower() in presets:
      name = presets[entry.lower()]
      cl, key = PricingCluster(name, preset=name), name
    else:
      cl, key = _file_cluster(entry, how), os.path.realpath(entry)
    if key in seen:
      raise ValueError(f"--clusters={spec!r} names {entry!r} more than once;"
                       " list each cluster once.")
    seen.add(key)
    if cl.label in {o.label for o in out}:
      cl = dataclasses.replace(cl, label=cl.path)
    out.append(cl)
  return tuple(out)


def _file_cluster(path: str, how: str) -> PricingCluster:
  """A cluster file as a :class:`PricingCluster` (ValueError as above)."""
  if not os.path.exists(path):
    raise ValueError(f"--clusters entry {path!r} is neither a preset nor an "
                     f"existing file; {how}.")
  try:
    data = cluster_file.read(path)
  except ValueError as e:
    msg, prefix = str(e), f"--cluster {path!r}"
    msg = msg[len(prefix):] if msg.startswith(prefix) else f": {msg}"
    raise ValueError(f"--clusters entry {path!r}{msg} Fix the file or "
                     f"{how}.") from None
  if data.get("workload") is None:
    raise ValueError(f"--clusters entry {path!r} has no measured workload "
                     "(\"workload\": null), so its step time cannot be "
                     "predicted; measure one with `python -m "
                     "decentral_jax.runtime_model measure --config ...` or "
                     f"{how}.")
  return PricingCluster(os.path.basename(path) or path, path=path, data=data)


def method_spec(config) -> str:
  """The runtime-model spec of a run config, or ``"(none: reason)"``."""
  try:
    return builders.spec_for_config(config)[0]
  except ValueError as e:
    return f"(none: {e})"


def predicted_ms(config, clusters, steps: int = SIM_STEPS,
                 seed: int = SIM_SEED) -> dict[str, float | str]:
  """Predicted ms/iteration of a run config on each cluster.

  The method is ``builders.spec_for_config(config)``, built on each cluster at
  ``n = config.n_workers`` workers (topologies for the cluster's own
  workers per node) and priced with ``core.simulate`` for
  ``cli_inputs.simulated_steps(method, steps)`` iterations, the first
  ``steps // 5`` discarded, compute draws of ``seed``: what ``python -m
  decentral_jax.runtime_model predict`` does.

  Args:
    config: a run config (``decentral_jax.runner.config``).
    clusters: :class:`PricingCluster` s.
    steps: simulated iterations (300: ``predict``'s default).
    seed: seed of the compute draws.

  Returns:
    ``{cluster label: ms per iteration (float)}``; where the run cannot be
    priced (a ``ValueError``: e.g. ``n`` not a multiple of the cluster's
    workers per node, or a topology that does not fit it), the value is
    the reason (str) instead.
  """
  try:
    spec, fields = builders.spec_for_config(config)
  except ValueError as e:
    return {cl.label: str(e) for cl in clusters}
  n = int(config.n_workers)
  out = {}
  for cl in clusters:
    try:
      c, w = cl.setup(n, fields)
      m = core.make_method(spec, c)
      out[cl.label] = 1e3 * float(core.simulate(
          m, c, w, steps=cli_inputs.simulated_steps(m, steps),
          warmup=steps // 5, seed=seed))
    except ValueError as e:
      out[cl.label] = str(e)
  return out


def eval_curve(path: str) -> tuple[np.ndarray, np.ndarray]:
  """``(steps, eval/loss)`` of a run's metrics.jsonl (empty if missing)."""
  if not os.path.exists(path):
    return np.zeros(0), np.zeros(0)
  return metrics_lib.series(metrics_lib.read_jsonl(path), "eval/loss")


def step_to_target(steps, losses, target: float) -> float | None:
  """The first step at which a loss curve reaches ``target`` (loss <= it).

  Linearly interpolated between the two evaluations around the crossing;
  the first evaluation's step if that one already reaches it. Non-finite
  losses are skipped.

  Args:
    steps: evaluation steps, increasing.
    losses: the loss at each of them.
    target: the loss to reach.

  Returns:
    The step (float), or None if the curve never reaches ``target``.

  Raises:
    ValueError: ``steps`` and ``losses`` differ in length.
  """
  steps, losses = list(steps), list(losses)
  if len(steps) != len(losses):
    raise ValueError(f"{len(steps)} steps but {len(losses)} losses.")
  prev = None
  for s, loss in zip(steps, losses):
    s, loss = float(s), float(loss)
    if not math.isfinite(loss):
      continue
    if loss <= target:
      if prev is None:
        return s
      s0, l0 = prev
      return s0 + (l0 - target) / (l0 - loss) * (s - s0)
    prev = (s, loss)
  return None


def time_to_target(steps, losses, target: float,
                   ms_per_step: float) -> float | None:
  """Seconds until a loss curve reaches ``target`` at ``ms_per_step``.

  :func:`step_to_target` times ``ms_per_step / 1000``.

  Returns:
    Seconds, or None if the curve never reaches ``target``.

  Raises:
    ValueError: ``steps`` and ``losses`` differ in length.
  """
  step = step_to_target(steps, losses, target)
  return None if step is None else step * float(ms_per_step) / 1e3


def format_duration(seconds: float) -> str:
  """Seconds in a human unit: ``"12.3 s"``, ``"4.5 min"`` or ``"2.5 h"``."""
  if seconds < 60:
    return f"{seconds:.1f} s"
  if seconds < 7200:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.1f} h"


def ar_target(finals) -> tuple[float | None, str]:
  """All-Reduce's final validation loss, the target of "time to AR loss".

  Args:
    finals: ``[(run, final metrics or None if it diverged)]``.

  Returns:
    ``(loss, "")``, or ``(None, why there is none)``.
  """
  for run, m in finals:
    if run.name == "all_reduce":
      if m is None:
        return None, "All-Reduce diverged"
      return float(m["eval/loss"]), ""
  return None, "All-Reduce (all_reduce) is not among the runs (--methods)"


def pricing_columns(finals, curves: dict, prices: dict, clusters,
                    target: float | None, why_no_target: str = ""
                    ) -> tuple[list[str], dict[str, list[str]], list[str]]:
  """The table columns of the clusters, with their footnotes.

  Args:
    finals: ``[(run, final metrics or None if it diverged)]``.
    curves: ``{run.name: (eval steps, eval losses)}``.
    prices: ``{run.name: predicted_ms(...)}`` of the finished runs.
    clusters: :class:`PricingCluster` s.
    target: All-Reduce's final validation loss, or None.
    why_no_target: why ``target`` is None (for the footnote).

  Returns:
    ``(headers, {run.name: cells}, notes)``: per cluster the headers
    "predicted ms/it, <label>" and "time to AR loss, <label>"; the cells
    (ms with one decimal, a duration, "not reached", or "-" where the run
    diverged, cannot be priced or there is no target); one markdown line
    per note: the fastest run to the target on each cluster, and why cells
    are "-".
  """
  headers = [h for cl in clusters for h in (
      f"predicted ms/it, {cl.label}", f"time to AR loss, {cl.label}")]
  cells, unpriced, best = {}, {}, {}
  for run, m in finals:
    row = []
    for cl in clusters:
      ms = prices.get(run.name, {}).get(cl.label) if m is not None else None
      if isinstance(ms, str):
        unpriced.setdefault((cl.label, ms), []).append(run.label)
      if not isinstance(ms, numbers.Real):
        row += ["-", "-"]
        continue
      cell = "-"
      if target is not None:
        steps, losses = curves.get(run.name, ((), ()))
        t = time_to_target(steps, losses, target, ms)
        cell = "not reached" if t is None else format_duration(t)
        if t is not None and (cl.label not in best or t < best[cl.label][0]):
          best[cl.label] = (t, run.label)
      row += [f"{ms:.1f}", cell]
    cells[run.name] = row
  notes = [f"Fastest to All-Reduce's final loss on {cl.label} (predicted): "
           f"{best[cl.label][1]}, {format_duration(best[cl.label][0])}."
           for cl in clusters if cl.label in best]
  for (label, reason), runs in unpriced.items():
    notes.append(f"Not priced on {label} ('-'): {', '.join(runs)}: {reason}")
  if target is None and clusters:
    notes.append(f"\"time to AR loss\" is '-': {why_no_target}, so there is "
                 "no target loss.")
  return headers, cells, notes


def pricing_text(clusters, n: int, run_specs: dict[str, str],
                 model: str, target: float | None,
                 why_no_target: str = "") -> str:
  """The paragraph above the table that says what the predictions mean.

  Args:
    clusters: :class:`PricingCluster` s.
    n: workers per run (``config.n_workers``).
    run_specs: ``{run label: runtime-model spec}``.
    model: this config's model, in words (e.g. "gpt").
    target: All-Reduce's final validation loss, or None.
    why_no_target: why ``target`` is None.
  """
  if not clusters:
    return ""
  goal = (f"All-Reduce's final validation loss here ({target:.4f})"
          if target is not None else
          f"All-Reduce's final validation loss (none here: {why_no_target})")
  return (
      "Predicted columns (a what-if, not a measurement): \"predicted ms/it, "
      "<cluster>\" is the runtime model's time per iteration "
      "(decentral_jax/runtime_model, `core.simulate`: "
      f"{SIM_STEPS} simulated iterations, more for local-update methods to "
      f"cover two sync schedules, the first {SIM_STEPS // 5} discarded, "
      f"seed {SIM_SEED}, as `python -m decentral_jax.runtime_model predict`)"
      f" of each run's method at {n} workers on each cluster; "
      + "; ".join(cl.describe(n) for cl in clusters)
      + ". Each run's method is the runtime-model spec of its config ("
      + "; ".join(f"{k}: `{v}`" for k, v in run_specs.items())
      + "), its topology built for the cluster's own workers per node. "
      f"The loss per step is measured here, on this config's model and data "
      f"({model}); the time per step is predicted for the cluster's own "
      "workload, not for this model. \"time to AR loss, <cluster>\" is the "
      f"first step at which a run's validation loss reaches {goal}, "
      "linearly interpolated between the two evaluations around the "
      "crossing, times the run's predicted seconds per iteration on that "
      "cluster (\"not reached\": not within these steps). It assumes that "
      "the cluster's model would follow the same loss-per-step curves as "
      "this one: a what-if, not a measurement.\n\n")


def plot_predicted_time(rows, prices: dict, clusters, target: float | None,
                        n: int, outdir: str) -> str:
  """``loss_vs_predicted_time.png``: loss vs predicted time, per cluster.

  One subplot per cluster: x = step x the run's predicted s/iteration on
  that cluster, y = validation loss of the averaged model, one line per run
  that could be priced there; a dashed line at ``target``.

  Args:
    rows: ``[(run, eval steps, eval losses)]``.
    prices: ``{run.name: predicted_ms(...)}``.
    clusters: :class:`PricingCluster` s (at least one).
    target: All-Reduce's final validation loss, or None (no line).
    n: workers per run.
    outdir: directory to write to.

  Returns:
    The PNG path.

  Raises:
    OSError: the file could not be written.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, len(clusters), figsize=(
      5.6 * len(clusters), 4.4), squeeze=False)
  for ax, cl in zip(axes[0], clusters):
    lines = []
    for run, steps, losses in rows:
      ms = prices.get(run.name, {}).get(cl.label)
      if isinstance(ms, numbers.Real) and len(steps):
        lines.append((run.label, np.asarray(steps, float) * ms / 1e3, losses))
    longest = max((float(x.max()) for _, x, _ in lines), default=0.0)
    scale, unit = (60.0, "min") if longest > 120 else (1.0, "s")
    for label, xs, ys in lines:
      ax.plot(xs / scale, ys, marker="o", markersize=3, label=label)
    if target is not None:
      ax.axhline(target, linestyle="--", color="gray", linewidth=1,
                 label=f"All-Reduce's final loss ({target:.4f})")
    if not lines:
      ax.text(0.5, 0.5, "no run could be priced here", ha="center",
              va="center", transform=ax.transAxes)
    ax.set_title(f"{cl.label}, {n} workers (predicted)")
    ax.set_xlabel(f"predicted time ({unit}): step x predicted s/iteration")
    ax.set_ylabel("validation loss of the averaged model (nats)")
    ax.grid(alpha=0.3)
    if lines or target is not None:
      ax.legend(fontsize=7)
  fig.tight_layout()
  out = os.path.join(outdir, PLOT_NAME)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out
