"""The main job's runs priced on clusters with the runtime model: which method?

The main job measures each method's validation loss per step on a small proxy
model. This module predicts the time of one step of each method on a
cluster with the runtime model (:mod:`decentral_jax.runtime_model`), for a
workload the user names, and puts the two together:

* :func:`parse_clusters`: ``--clusters`` entries (every preset of
  :data:`decentral_jax.runtime_model.presets.CLUSTERS`, or cluster JSON
  files written by ``python -m decentral_jax.runtime_model measure``) as
  :class:`PricingCluster`;
* :func:`check_workload`: the ``--workload`` name (a key of
  ``presets.WORKLOADS``, ``figure6``: the Figure 6 clusters' fitted
  Transformer-base, ``own``: each cluster with a workload measured or
  fitted on its own GPUs, :meth:`PricingCluster.workload_of`, or a
  workload file read from a compiled step (:func:`is_workload_file`),
  :mod:`decentral_jax.runtime_model.workload_file`);
* :func:`workload_label`: the workload a cluster is priced with, in the
  few words its panel title and recommendation line carry;
* :func:`priced_workers`: the GPU count each cluster is priced at (the
  smallest multiple of ``config.n_workers`` the cluster holds that, on a
  preset of several nodes, spans at least two nodes, so that its
  inter-node links are priced);
* :func:`predicted_ms`: a run config's predicted ms/iteration on each
  cluster (``step_time.simulate``, as ``predict`` does);
* :func:`step_to_target`, :func:`time_to_target`: where a validation-loss
  curve first reaches a target loss (linear interpolation between
  evaluations), in steps and in seconds;
* :func:`pricing_columns`, :func:`pricing_text`: the predicted-ms columns
  of the details table with their footnotes, and the paragraph that says
  what the predictions are.

Units: ms per iteration in the table, seconds everywhere else.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from decentral_jax import checks
from decentral_jax import records
from decentral_jax.runner import builders
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.tools.runtime_model_cli import inputs as cli_inputs
from decentral_jax.runtime_model import workload_file
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import presets

SIM_STEPS = 300  # predict's default --steps; the first fifth is warm-up
SIM_SEED = 0
# --workload values, shared with `predict --workload` (figure6: each Figure 6
# cluster's own fitted Transformer-base, on the presets FIGURE6_PRESETS).
FIGURE6 = presets.FIGURE6
FIGURE6_PRESETS = presets.FIGURE6_PRESETS
# --workload=own: each cluster priced with a workload of its own GPUs: the
# Figure 6 presets with their fitted compute (figure6), the H100 presets with
# gpt2_small (an H100's compute), cluster files with their measured one.
OWN = "own"
OWN_H100_WORKLOAD = "gpt2_small"
WORKLOAD_NAMES = (*presets.WORKLOAD_NAMES, OWN)
# The GPU each named workload's compute time was estimated for.
_COMPUTE_GPU = {"gpt2_small": "H100", "1b": "H100"}
# Largest multiple of config.n_workers tried by priced_workers.
_MAX_SCALE = 64
_HOW = ("give comma-separated preset names ({}) or paths of cluster JSON "
        "files written by `python -m decentral_jax.runtime_model measure`")
_WORKLOAD_WORDS = {
    "gpt2_small": "GPT-2 small: 124M parameters, 30.9 ms of compute per "
                  "step (16 x 1024 tokens per GPU at 40% of an H100 SXM5's "
                  "bf16 peak)",
    "1b": "1e9 parameters, 100 ms of compute per step (Kale et al. 2025, "
          "Table 5, H100 GPUs)"}


def is_workload_file(name: str) -> bool:
  """Whether ``--workload`` names a workload file: any value that is not
  one of :data:`WORKLOAD_NAMES` and ends in ``.json`` or is an existing
  path (whatever its suffix)."""
  return name not in WORKLOAD_NAMES and (name.endswith(".json")
                                         or os.path.exists(name))


def check_workload(name: str) -> str:
  """``--workload``: a key of ``presets.WORKLOADS``, ``figure6``, ``own``
  or a workload file read from a compiled step
  (:func:`is_workload_file`, :mod:`decentral_jax.runtime_model.
  workload_file`).

  Raises:
    ValueError: any other name (names the flag, the choices and the file
      form), or a bad file (names it: a directory, a missing or malformed
      file).
  """
  if is_workload_file(name):
    try:
      workload_file.read_workload(name)
    except ValueError as e:
      raise ValueError(f"--workload: {e}") from None
    return name
  if name not in WORKLOAD_NAMES:
    raise ValueError(f"--workload={name!r} is neither a workload name nor an "
                     f"existing file; use one of {', '.join(WORKLOAD_NAMES)}"
                     " or the path of a workload file (written by "
                     "benchmarks/gpu_check.py --deviceless TARGET "
                     "--workload FILE).")
  return name


@dataclasses.dataclass(frozen=True, eq=False)
class PricingCluster:
  """One ``--clusters`` entry.

  Attributes:
    label: its name in the tables and plots: the preset name, or the
      file's basename (the path as given when two files share a basename).
    preset: a key of ``presets.CLUSTERS``, or None for a file.
    path: the cluster file as given, or None for a preset.
    data: the file's contents (``cluster_file.read``), or None.
  """

  label: str
  preset: str | None = None
  path: str | None = None
  data: dict | None = None

  def workload_of(self, workload: str) -> str | None:
    """The workload this cluster is priced with under ``--workload``.

    ``own``: ``figure6`` on a Figure 6 preset (T4, A40, A100: compute
    fitted to its own bars), ``gpt2_small`` on the others (H100 GPUs, the
    GPU its compute was estimated for). A cluster file: None (its own
    measured workload, whatever ``workload``).
    """
    if is_workload_file(workload):  # used on every cluster
      return workload
    if self.preset is None:
      return None
    if workload == OWN:
      return FIGURE6 if self.preset in FIGURE6_PRESETS else OWN_H100_WORKLOAD
    return workload

  def setup(self, n: int, workload: str = FIGURE6,
            workload_fields: dict | None = None
            ) -> tuple[Cluster, Workload]:
    """The cluster and its workload at ``n`` workers (one per GPU).

    Preset: ``presets.setup`` with ``workload`` (``figure6``: the paper's
    Transformer-base fitted to Figure 6, only on ``T4``, ``A40``,
    ``A100``). File: its links for ``n`` workers and its own measured
    workload (``workload`` does not apply, but for a workload file
    read from a compiled step, used everywhere). ``workload_fields``
    (``devices_per_worker``, ``worker_layout``, from
    ``builders.spec_for_config``) replace the workload's.

    Raises:
      ValueError: ``n`` does not fit the cluster (names its constraint), or
        a preset without a Figure 6 workload under ``figure6``.
    """
    fields = dict(workload_fields or {})
    if is_workload_file(workload):  # read from a compiled step
      c = (presets.cluster(self.preset, int(n)) if self.preset is not None
           else cluster_file.cluster(self.data, int(n)))
      return c, dataclasses.replace(workload_file.read_workload(workload),
                                    **fields)
    workload = self.workload_of(workload)
    if self.preset is not None:
      c, w = presets.setup(self.preset, int(n),
                           None if workload == FIGURE6 else workload)
      return c, dataclasses.replace(w, **fields)
    return (cluster_file.cluster(self.data, int(n)),
            cluster_file.workload(self.data, **fields))

  def fits(self, n: int) -> str | None:
    """None if the cluster holds ``n`` workers, else why not."""
    try:
      if self.preset is not None:
        presets.cluster(self.preset, int(n))
      else:
        cluster_file.cluster(self.data, int(n))
    except ValueError as e:
      return str(e)
    return None

  def nodes(self, n: int) -> int:
    """Nodes the cluster's ``n`` workers span (``n`` must fit)."""
    if self.preset is not None:
      c = presets.cluster(self.preset, int(n))
    else:
      c = cluster_file.cluster(self.data, int(n))
    return int(c.n_workers) // int(c.local_size)

  def describe(self, n: int, workload: str = FIGURE6) -> str:
    """This cluster at ``n`` GPUs and its workload, in words."""
    if self.preset is not None:
      text = f"{self.label}: {presets.CLUSTERS[self.preset].words}"
      try:
        _, w = self.setup(n, workload)
        text += f", at {n} GPUs ({1e3 * w.compute_mean_s:.1f} ms of compute"
        text += f" per step), {workload_label(self, workload)}"
      except ValueError:
        text += f", at {n} GPUs"
      fitted = paper.FIG6_MS.get(self.preset, {}).get("n", ())
      if self.workload_of(workload) == FIGURE6 and fitted and not min(fitted) <= n <= max(
          fitted):
        text += (f"; Figure 6 measured {', '.join(map(str, fitted))} GPUs, "
                 f"so at {n} the compute fit is extrapolated")
      return text
    meta, c = self.data.get("meta"), self.data["cluster"]
    meta = meta if isinstance(meta, dict) else {}
    w = self.data["workload"]
    return (f"{self.label}: the cluster measured in {self.path} "
            f"({meta.get('devices', c['n_workers'])} "
            f"{meta.get('device_kind', '')} devices, {c['local_size']} per "
            f"node) at {n} GPUs with its own measured workload ("
            f"{float(w['param_count']):,.0f} parameters, forward "
            f"{1e3 * w['forward_s']:.3g} ms, backward "
            f"{1e3 * w['backward_s']:.3g} ms per worker)")


def parse_clusters(spec: str, workload: str = FIGURE6
                   ) -> tuple[PricingCluster, ...]:
  """The clusters of ``--clusters``: comma-separated presets or files.

  An entry equal (ignoring case) to a key of ``presets.CLUSTERS`` is that
  preset; any other entry is a path to a cluster JSON file written by
  ``python -m decentral_jax.runtime_model measure``, with a measured
  workload. An empty (or blank) ``spec`` gives no clusters (no pricing).

  Args:
    spec: the flag's value.
    workload: ``--workload`` (checked: ``figure6`` prices only the Figure 6
      presets).

  Raises:
    ValueError: an empty entry, one that is neither a preset nor an
      existing file, a file that cannot be read, is not a valid cluster
      file or has no measured workload, a cluster given twice, or a preset without a
      Figure 6 workload under ``--workload=figure6``; the message names
      the flag and says what to give instead.
  """
  how = _HOW.format(", ".join(presets.CLUSTERS))
  names = {k.lower(): k for k in presets.CLUSTERS}
  out, seen = [], set()
  for entry in checks.comma_entries(
      "--clusters", spec, "clusters",
      "--clusters=A40,h100_node (--clusters= alone turns the pricing off)"):
    if entry.lower() in names:
      name = names[entry.lower()]
      if workload == FIGURE6 and name not in FIGURE6_PRESETS:
        raise ValueError(
            f"--clusters entry {name!r} has no Figure 6 workload "
            f"(--workload={FIGURE6} has one only for "
            f"{', '.join(FIGURE6_PRESETS)}); use --workload="
            f"{' or '.join(presets.WORKLOADS)}.")
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


def priced_workers(cluster: PricingCluster, n: int) -> int | str:
  """The GPU count ``cluster`` is priced at for runs of ``n`` workers.

  The smallest multiple ``k n`` (``k`` <= 64) that the cluster holds and,
  for a preset that holds two nodes or more, that spans at least two
  nodes, so its inter-node links (InfiniBand, Ethernet, the wide-area
  link) are priced: at ``n = 8``, ``h100_ib`` and ``T4`` (8 GPUs per node)
  16, ``A40`` (4 per node) 8, ``cross_region_2dc`` 16 (two datacenters of
  one node), ``h100_node`` (one node) 8. A cluster file is priced at the
  smallest multiple it holds. The loss curves stay those of the
  ``n``-worker proxy runs.

  Returns:
    The count, or why no multiple fits (str).
  """
  why, first = cluster.fits(n), None
  for k in range(1, _MAX_SCALE + 1):
    why_k = cluster.fits(k * n)
    if why_k is not None:
      continue
    if cluster.preset is None or cluster.nodes(k * n) >= 2:
      return k * n
    first = first or k * n
  return first or why or why_k


def predicted_ms(config, clusters, workload: str = FIGURE6,
                 steps: int = SIM_STEPS, seed: int = SIM_SEED
                 ) -> dict[str, float | str]:
  """Predicted ms/iteration of a run config on each cluster.

  The method is ``builders.spec_for_config(config)``, built on each cluster
  at :func:`priced_workers` GPUs (topologies for the cluster's own workers
  per node) and priced with ``step_time.simulate`` for
  ``cli_inputs.simulated_steps(method, steps)`` iterations, the first
  ``steps // 5`` discarded, compute draws of ``seed``: what ``python -m
  decentral_jax.runtime_model predict`` does.

  Args:
    config: a run config (``decentral_jax.runner.config``).
    clusters: :class:`PricingCluster` s.
    workload: ``--workload`` (see :meth:`PricingCluster.setup`).
    steps: simulated iterations (300: ``predict``'s default).
    seed: seed of the compute draws.

  Returns:
    ``{cluster label: ms per iteration (float)}``; where the run cannot be
    priced (a ``ValueError``: e.g. no worker count fits the cluster, or a
    topology that does not fit it), the value is the reason (str) instead.
  """
  try:
    spec, fields = builders.spec_for_config(config)
  except ValueError as e:
    return {cl.label: str(e) for cl in clusters}
  out = {}
  for cl in clusters:
    n = priced_workers(cl, int(config.n_workers))
    if isinstance(n, str):
      out[cl.label] = n
      continue
    try:
      c, w = cl.setup(n, workload, fields)
      m = make_method(spec, c)
      out[cl.label] = 1e3 * float(simulate(
          m, c, w, steps=cli_inputs.simulated_steps(m, steps),
          warmup=steps // 5, seed=seed))
    except ValueError as e:
      out[cl.label] = str(e)
  return out


def eval_curve(path: str) -> tuple[np.ndarray, np.ndarray]:
  """``(steps, eval/loss)`` of a run's metrics.jsonl (:func:`metrics.
  read_curve`), empty if the file is missing.

  Raises:
    ValueError: the file is damaged (one line naming it, the line or the
      step and the key).
  """
  got = metrics_lib.read_curve(path)
  if isinstance(got, records.Damaged):
    if got.missing:
      return np.zeros(0), np.zeros(0)
    raise got.error()
  return got


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
  """Seconds in a human unit, to 3 significant figures: ``"250 ms"``,
  ``"4.00 s"``, ``"12.3 s"``, ``"4.50 min"``, ``"2.50 h"``, ``"1230 h"``
  (``"0 s"`` for zero; ``"n/a"`` for NaN, infinite or negative seconds,
  which are no duration)."""
  seconds = float(seconds)
  if not math.isfinite(seconds) or seconds < 0:
    return "n/a"
  seconds = float(f"{seconds:.3g}")  # 59.99 s is "1.00 min"
  if seconds == 0:
    return "0 s"
  for limit, scale, unit in ((1, 1e-3, "ms"), (60, 1, "s"),
                             (7200, 60, "min")):
    if seconds < limit:
      break
  else:
    scale, unit = 3600, "h"
  value = seconds / scale
  text = f"{value:#.3g}"
  if "e" in text:  # 1000 or more of the unit: 3 figures, then zeros
    text = f"{float(f'{value:.3g}'):.0f}"
  return f"{text.rstrip('.')} {unit}"


def pricing_columns(finals, prices: dict, clusters
                    ) -> tuple[list[str], dict[str, list[str]], list[str]]:
  """The predicted-ms columns of the details table, with their footnotes.

  Args:
    finals: ``[(run, final metrics or None if it diverged)]``.
    prices: ``{run.name: predicted_ms(...)}`` of the finished runs.
    clusters: :class:`PricingCluster` s.

  Returns:
    ``(headers, {run.name: cells}, notes)``: one header "predicted ms/step,
    <label>" per cluster; the cells (ms with one decimal, or "-" where the
    run diverged or cannot be priced); one markdown line per reason a cell
    is "-".
  """
  headers = [f"predicted ms/step, {cl.label}" for cl in clusters]
  cells, unpriced = {}, {}
  for run, m in finals:
    row = []
    for cl in clusters:
      ms = prices.get(run.name, {}).get(cl.label) if m is not None else None
      if isinstance(ms, str):
        unpriced.setdefault((cl.label, ms), []).append(run.label)
      row.append(f"{ms:.1f}" if isinstance(ms, numbers.Real) else "-")
    cells[run.name] = row
  notes = [f"Not priced on {label} ('-'): {', '.join(runs)}: {reason}"
           for (label, reason), runs in unpriced.items()]
  return headers, cells, notes


def workload_label(cluster: PricingCluster, workload: str) -> str:
  """The workload ``cluster`` is priced with, in a few words: whose compute
  on which links (for its panel title and recommendation line)."""
  name = cluster.workload_of(workload)
  if name is None:
    return "its own measured workload"
  if is_workload_file(name):
    return f"{name}: read from a compiled step (its GPU's compute)"
  if name == FIGURE6:
    return f"figure6: the {cluster.preset} GPUs' own fitted compute"
  gpu = _COMPUTE_GPU.get(name)
  words = presets.CLUSTERS[cluster.preset].words.lower()
  if gpu and gpu.lower() not in words:
    return f"{name}: {gpu} compute on {cluster.preset} links"
  return f"{name}: {gpu} compute" if gpu else name


def workload_words(workload: str) -> str:
  """``--workload`` in words (for the table header)."""
  if workload == OWN:
    return ("own: each cluster with a workload of its own GPUs (figure6 on "
            "the Figure 6 clusters, gpt2_small on H100 clusters)")
  if workload == FIGURE6:
    return ("figure6: the paper's Transformer-base (65M parameters) with "
            "compute fitted to each cluster's Figure 6 bars")
  if is_workload_file(workload):
    w = workload_file.read_workload(workload)
    return (f"{workload}: read from a compiled step, "
            f"{w.param_count / 1e6:.4g}M parameters, "
            f"{1e3 * w.compute_mean_s:.3g} ms of compute per step")
  return f"{workload}: {_WORKLOAD_WORDS.get(workload, workload)}"


def _compute_caveat(clusters, workload: str) -> str:
  """Whose compute each preset cluster is priced with, in one sentence."""
  mismatched = [f"{cl.label} ({workload_label(cl, workload)})"
                for cl in clusters if " compute on " in
                workload_label(cl, workload)]
  if mismatched:
    return ("Its compute time is used as given on every preset cluster, "
            "including those with slower GPUs than the one it was estimated "
            f"for: {', '.join(mismatched)}, where communication is a larger "
            "share than it would be with their own compute.")
  return ("Each cluster is priced with compute of its own GPUs: "
          + "; ".join(f"{cl.label}: {workload_label(cl, workload)}"
                      for cl in clusters) + ".")


def pricing_text(clusters, n: int, workload: str, run_specs: dict[str, str],
                 model: str) -> str:
  """The paragraph that says what the predictions are.

  Args:
    clusters: :class:`PricingCluster` s.
    n: workers per proxy run (``config.n_workers``).
    workload: ``--workload``.
    run_specs: ``{run label: runtime-model spec}``.
    model: the proxy's model, in words (e.g. "gpt").
  """
  if not clusters:
    return ""
  at = {cl.label: priced_workers(cl, n) for cl in clusters}
  files = [cl.label for cl in clusters if cl.preset is None
           and not is_workload_file(workload)]  # a file's workload is used
  named = {cl.workload_of(workload) for cl in clusters} - {None}
  shown = named.pop() if workload == OWN and len(named) == 1 else workload
  return (
      f"**Workload (time per step): {workload_words(shown)}**"
      + (f" (cluster files {', '.join(files)}: their own measured workload)"
         if files else "")
      + ". " + _compute_caveat(clusters, workload) + " Predicted times are a what-if, not a measurement: the runtime model "
      "(decentral_jax/runtime_model, `step_time.simulate`: "
      f"{SIM_STEPS} simulated iterations, more for local-update methods to "
      f"cover two sync schedules, the first {SIM_STEPS // 5} discarded, "
      f"seed {SIM_SEED}, as `python -m decentral_jax.runtime_model predict`)"
      " prices each run's method on each cluster: "
      + "; ".join(cl.describe(at[cl.label], workload)
                  if isinstance(at[cl.label], int) else
                  f"{cl.label}: not priced ({at[cl.label]})"
                  for cl in clusters)
      + ". Each run's method is the runtime-model spec of its config ("
      + "; ".join(f"{k}: `{v}`" for k, v in run_specs.items())
      + "), its topology built for the cluster's own GPUs per node. The "
      f"loss per step is measured here on the {n}-worker proxy ({model}); "
      "the predicted wall-clock to a loss is the step at which the proxy "
      "reaches it times the predicted seconds per step: it assumes the "
      "named workload would follow the proxy's loss-per-step curves (and, "
      f"where a cluster is priced at more than {n} GPUs, that the proxy's "
      "curve holds there too).\n\n")
