"""The main job: which communication scheme on which cluster, and what quality.

Trains a small proxy model from the same initial parameters and data order,
for the same number of steps, once per method of ``--methods`` (and seed of
``--seeds``), then prices every method on every cluster of ``--clusters``
with the runtime model for the workload ``--workload`` names, and answers:
per cluster, which method first reaches each of a few loss targets that
every run reaches, with a one-line recommendation and its margin
(``experiments/compare_answer.py``).

The quick default (``python experiments/compare.py --outdir
results/compare``, about 2 minutes on an idle 2-core CPU): the proxy of
``configs/gpt_quick.py`` (a 2-layer byte-level GPT of width 64, 8 workers,
200 steps), the methods of :data:`DEFAULT_METHODS`, one seed, the clusters
``A40`` (Figure 6: 4 x A40 per node, 25 Gbit/s Ethernet), ``h100_node``
(one NVLink node of 8 H100) and ``cross_region_2dc`` (two datacenters of
H100 nodes over a 10 Gbit/s, 30 ms wide-area link), workload
``gpt2_small`` (124M parameters, 30.9 ms of compute per step). ``--full``:
the study of BENCHMARKS.md (``configs/gpt_tiny.py``, 300 steps, the six
methods of :data:`FULL_METHODS`, seeds 0, 1, 2, periodic checkpoints);
flags given as well win over both.

Methods (``--methods``, or ``all``):

* ``all_reduce``: All-Reduce AdamW;
* ``dadam``: DAdam on ``one_peer_exp``;
* ``accum_adamw``: AccumAdamW on ``one_peer_exp`` in its best measured
  setting: window T = config.optimizer.accum_steps (4), horizon-matched
  betas (``optimizer.beta_convention="per_step"``: b1**T, b2**T per window);
* ``diloco``: DiLoCo, inner AdamW, outer Nesterov (lr 0.3, momentum 0.9),
  sync every 10 steps;
* ``local_sgd``: Local SGD with inner AdamW, sync every 10 steps;
* ``local_dadam``: DAdam gossiping every 5 steps on ``one_peer_exp``;
* ``accum_adamw_paper``: AccumAdamW with the paper's per-window betas;
* ``accum_adamw_aer``: AccumAdamW (as ``accum_adamw``) on
  ``alternating_exp_ring``, 2 workers per node;
* ``streaming_diloco``: Streaming DiLoCo, 2 fragments, overlap 1 step,
  merge alpha 0.5, sync every 10 steps (outer as ``diloco``);
* ``decentralized_diloco``: DiLoCo whose outer mean is one gossip round on
  ``one_peer_exp``, every 10 steps;
* ``sgp``: SGP (push-sum AdamW) on ``one_peer_exp``;
* ``diloco_delayed``, ``diloco_eager``: ``diloco`` with its outer step
  overlapped with the next round (arXiv 2502.12996): one round stale, or
  eager (each worker's own fresh pseudo-gradient in place of its stale
  one), the reduction trickled over the round's inner steps.

Each method runs at its own tuned peak learning rate (:data:`TUNED_PEAK_LR`,
chosen for gpt_tiny at 300 steps by the project's tuning protocol,
``decentral_jax.runner.tuning``; BENCHMARKS.md, section 10; the quick proxy
reuses them untuned).

Clusters (``--clusters``): every preset of
``decentral_jax.runtime_model.presets`` (T4, A40, A100, h100_node, h100_ib,
cross_region_2dc, cross_region_4dc; sources in docs/runtime_model.md,
"Presets") or cluster JSON files written by ``python -m
decentral_jax.runtime_model measure`` (priced with their own measured
workload). A cluster is priced at the smallest multiple of
``config.n_workers`` GPUs that it holds and that, on a preset of several
nodes, spans at least two nodes, so its inter-node links are priced (at 8
workers: h100_ib and T4 16, A40 and A100 8, cross_region_2dc 16,
cross_region_4dc 32, h100_node, one node, 8); each table header names the
count. Empty entries of ``--clusters`` are refused. Workload
(``--workload``): ``gpt2_small``, ``1b`` or ``figure6`` (the paper's
Transformer-base fitted to each Figure 6 cluster; T4, A40, A100 only).
The loss per step is measured here, the time per step predicted: a what-if,
not a measurement. ``--clusters=`` (empty) turns the pricing off.

Outputs in ``--outdir``: ``results.md`` (the answer: one table per cluster
and the recommendations; then the details: final validation loss of the
averaged model, the workers' own losses, consensus distance, bytes sent per
step read from the compiled step's HLO, predicted ms/step; and the check
against the stored reference, ``experiments/compare_reference.json``),
``loss_vs_predicted_time.png`` (the frontier per cluster),
``loss_vs_step.png``, and ``<run>/metrics.jsonl`` per run. This machine's
CPU timings (ms/step, tokens/s, ``cpu_loss_vs_time_this_machine.png``) are
load-dependent and only written with ``--cpu_timing``; they show compute
overheads of simulated devices, never a ranking. A plot of these names that
an earlier invocation left and this one does not write (the CPU plot
without ``--cpu_timing``, the frontier with ``--clusters=``) is deleted.

  python experiments/compare.py --outdir results/compare     # quick, ~2 min
  python experiments/compare.py --full --outdir results/full  # the study
  python experiments/compare.py --clusters=h100_ib,cross_region_4dc --workload=1b
  python experiments/compare.py --methods=all_reduce,diloco,sgp --seeds=0,1,2

``--config.<field>=value`` overrides apply to every run (the fields a method
sets, e.g. its algorithm, optimizer name, topology, sync period, are set
per run; a method field its algorithm does not read, e.g. comm_dtype for
all_reduce, keeps its default there, with a note).

Interrupted and repeated invocations: each run's subdirectory of
``--outdir`` records its outcome (``compare_result.json``). The same
command again keeps every run that finished with the same config (its
metrics and timings as recorded), resumes an interrupted run from its last
checkpoint (SIGTERM or Ctrl-C saves one; the message says so) and trains
the others; a subdirectory of another config is replaced (one holding
anything a run does not write is refused). The invocation holds a lock on
``--outdir`` itself (``<outdir>/run.lock``) from before the first run to
the last results file, and each subdirectory's own while its run trains, so
a second invocation on the same ``--outdir`` (any methods) is refused, not
interleaved. ``--fresh`` trains every run from step 0. Without
``--checkpoints`` (the quick default) no periodic checkpoints are written
(``config.checkpoint_interval=0``) and a run's final checkpoint is deleted
once its outcome is recorded (about 20 KB per run remain); ``--checkpoints``
(on under ``--full``, or with an explicit ``--config.checkpoint_interval``)
keeps the config's periodic checkpoints, about 74 MB per run (DiLoCo
123 MB).

Bad input (a missing or broken config file, an unknown field, a bad value in
any run's config, an ``--outdir`` that is a file or cannot be created, a
``--clusters`` entry that is neither a preset nor a valid cluster file) is one
``error: ...`` line on stderr and exit code 2, before anything trains. A run
that diverges is marked in the table and the other runs go on; then one
``error:`` line names the diverged runs and the exit code is 3. A malformed
``experiments/compare_reference.json`` is one ``warning:`` line naming the
file and key after training; the results are still written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import shutil
import signal
import sys
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import jax
import numpy as np
import tqdm
from tqdm import contrib as tqdm_contrib

from decentral_jax.runner import builders
from decentral_jax.runner import orbax_quiet
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax import topology as topology_lib
from decentral_jax.runner import train
from decentral_jax.runner import validation
from decentral_jax.runner import workdir as workdir_lib

# compare_pricing sits next to this file (a script, also loaded by path).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
  sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import compare_answer  # noqa: E402  pylint: disable=wrong-import-position
import compare_pricing  # noqa: E402  pylint: disable=wrong-import-position

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The proxy of the quick default and of --full.
QUICK_CONFIG = os.path.join(_ROOT, "configs", "gpt_quick.py")
FULL_CONFIG = os.path.join(_ROOT, "configs", "gpt_tiny.py")
_DEFAULT_CONFIG = QUICK_CONFIG
# Final losses of the default jobs on a reference machine, and the
# tolerance within which another machine should match them.
REFERENCE_FILE = os.path.join(_ROOT, "experiments",
                              "compare_reference.json")
_CONFIG = flags.DEFINE_string(
    "config", _DEFAULT_CONFIG, "Base config for all runs (FILE.py or "
    "FILE.py:ARG); override its fields with --config.<field>=value. "
    "Default: configs/gpt_quick.py (--full: configs/gpt_tiny.py).")
_FULL = flags.DEFINE_bool(
    "full", False, "The full study instead of the quick default: "
    "configs/gpt_tiny.py (300 steps), the methods of FULL_METHODS, seeds "
    "0,1,2, checkpoints on (resumes after an interruption); --config, "
    "--methods, --seeds or --checkpoints given as well win.")
_SEEDS = flags.DEFINE_string(
    "seeds", "", "Comma-separated seeds; every method runs once per seed "
    "(the recommendation then says whether the winner is outside the "
    "seeds' spread). Default: the config's seed (--full: 0,1,2).")
_CHECKPOINTS = flags.DEFINE_bool(
    "checkpoints", False, "Write the config's periodic checkpoints and keep "
    "them (about 74 MB per gpt_tiny run). Default: none but the one SIGTERM "
    "or Ctrl-C saves to resume; a finished run's last checkpoint is "
    "deleted. On under --full.")
_WORKLOAD = flags.DEFINE_string(
    "workload", "gpt2_small", "Workload whose time per step the clusters "
    "are priced for: gpt2_small (124M parameters, 30.9 ms of compute), 1b "
    "(1e9 parameters, 100 ms) or figure6 (the paper's Transformer-base "
    "fitted to Figure 6; T4, A40, A100 only). Cluster files use their own "
    "measured workload.")
_CPU_TIMING = flags.DEFINE_bool(
    "cpu_timing", False, "Also write this machine's CPU timings (ms/step, "
    "tokens/s columns and cpu_loss_vs_time_this_machine.png): "
    "load-dependent, compute overheads of simulated devices, not a "
    "ranking.")
_OUTDIR = flags.DEFINE_string(
    "outdir", "results/compare",
    "Output directory. A run subdirectory left by an earlier invocation with "
    "the same config is reused (a finished run is kept, an interrupted one "
    "resumes from its checkpoint); any other is replaced.")
_FRESH = flags.DEFINE_bool(
    "fresh", False, "Replace every run subdirectory of --outdir: train all "
    "runs from step 0 even where an earlier invocation finished them or "
    "left a checkpoint.")
_PER_METHOD_LR = flags.DEFINE_bool(
    "per_method_lr", True,
    "Use each method's tuned peak lr for gpt_tiny (TUNED_PEAK_LR; "
    "BENCHMARKS.md) instead of config.schedule.peak_lr; an explicit "
    "--config.schedule.peak_lr or final_lr turns this off.")
# The methods of a plain `python experiments/compare.py` (see RUNS) and of
# --full.
DEFAULT_METHODS = ("all_reduce", "dadam", "diloco", "local_sgd")
FULL_METHODS = ("all_reduce", "dadam", "accum_adamw", "diloco",
                "local_sgd", "local_dadam")
_METHODS = flags.DEFINE_string(
    "methods", ",".join(DEFAULT_METHODS),
    "Comma-separated methods to run, in this order, or 'all'; see the "
    "module docstring for the list. Default: DEFAULT_METHODS (--full: "
    "FULL_METHODS).")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Simulated CPU devices; 0 = config.n_workers x "
    "config.devices_per_worker / config.workers_per_device.",
    lower_bound=0)
_CLUSTERS = flags.DEFINE_string(
    "clusters", "A40,h100_node,cross_region_2dc",
    "Comma-separated clusters to price every run on with the runtime "
    "model: presets (T4, A40, A100, h100_node, h100_ib, cross_region_2dc, "
    "cross_region_4dc; docs/runtime_model.md) or cluster JSON files "
    "written by `python -m decentral_jax.runtime_model measure`; empty: no "
    "pricing.")
# The --config.<field>=value arguments, set aside by _parse_or_exit.
_OVERRIDES: list[str] = []


@dataclasses.dataclass(frozen=True)
class Run:
  """One arm of the comparison."""
  name: str  # subdirectory and --methods name
  label: str  # legend / table label
  algorithm: str
  optimizer: str
  topology: str
  workers_per_node: int = 1
  # Further config fields of the method: ((dotted field, value), ...).
  fields: tuple[tuple[str, object], ...] = ()


_H = 10  # sync period of the local-update arms
# Outer Nesterov lr of the DiLoCo arms (momentum 0.9), the best of {0.1,
# 0.3, 0.7} for DiLoCo at H = 10 (BENCHMARKS.md, section 6); the paper's
# 0.7 is for H = 500.
_OUTER_LR = 0.3
RUNS = (
    Run("all_reduce", "All-Reduce AdamW", "all_reduce", "adamw", "complete"),
    Run("dadam", "DAdam, one_peer_exp", "decentralized", "adamw",
        "one_peer_exp"),
    Run("accum_adamw", "AccumAdamW, one_peer_exp, horizon-matched betas",
        "decentralized", "accum_adamw", "one_peer_exp",
        fields=(("optimizer.beta_convention", "per_step"),)),
    Run("accum_adamw_paper", "AccumAdamW, one_peer_exp, per-window betas "
        "(paper)", "decentralized", "accum_adamw", "one_peer_exp",
        fields=(("optimizer.beta_convention", "per_window"),)),
    Run("accum_adamw_aer", "AccumAdamW, alternating_exp_ring (2/node), "
        "horizon-matched betas", "decentralized", "accum_adamw",
        "alternating_exp_ring", 2,
        fields=(("optimizer.beta_convention", "per_step"),)),
    Run("local_sgd", f"Local SGD (AdamW), H={_H}", "local_sgd", "adamw",
        "complete", fields=(("sync_every", _H),)),
    Run("diloco", f"DiLoCo (AdamW; Nesterov lr {_OUTER_LR}), H={_H}",
        "diloco", "adamw", "complete",
        fields=(("sync_every", _H), ("outer_optimizer.lr", _OUTER_LR))),
    Run("streaming_diloco", f"Streaming DiLoCo (Nesterov lr {_OUTER_LR}), "
        f"H={_H}, P=2, tau=1, alpha=0.5", "streaming_diloco", "adamw",
        "complete", fields=(("sync_every", _H), ("num_fragments", 2),
                            ("overlap_steps", 1), ("merge_alpha", 0.5),
                            ("outer_optimizer.lr", _OUTER_LR))),
    Run("decentralized_diloco", f"Decentralized DiLoCo (Nesterov lr "
        f"{_OUTER_LR}), one_peer_exp, H={_H}", "decentralized_diloco",
        "adamw", "one_peer_exp",
        fields=(("sync_every", _H), ("outer_optimizer.lr", _OUTER_LR))),
    Run("diloco_delayed", f"DiLoCo, delayed outer step (Nesterov lr "
        f"{_OUTER_LR}), H={_H}", "diloco", "adamw", "complete",
        fields=(("sync_every", _H), ("outer_optimizer.lr", _OUTER_LR),
                ("outer_overlap", "delayed"))),
    Run("diloco_eager", f"DiLoCo, eager outer step (Nesterov lr "
        f"{_OUTER_LR}), H={_H}", "diloco", "adamw", "complete",
        fields=(("sync_every", _H), ("outer_optimizer.lr", _OUTER_LR),
                ("outer_overlap", "eager"))),
    Run("local_dadam", "Local DAdam, one_peer_exp, gossip every 5",
        "decentralized", "adamw", "one_peer_exp",
        fields=(("gossip_every", 5),)),
    Run("sgp", "SGP (push-sum AdamW), one_peer_exp", "sgp", "adamw",
        "one_peer_exp"),
)
METHODS = {run.name: run for run in RUNS}
# Peak learning rates per method for gpt_tiny (8 workers, 300 steps), each
# chosen by the tuning protocol (decentral_jax.runner.tuning: the grid {1.5e-3,
# 3e-3, 6e-3, 1.2e-2}, extended past an end that wins; seed 0) in this very
# setting: BENCHMARKS.md, section 10. accum_adamw_aer, streaming_diloco,
# decentralized_diloco and sgp were not re-tuned: the first uses
# accum_adamw's lr, the others their best of the earlier grid {1.5e-3,
# 3e-3, 6e-3} (section 6); diloco_delayed and diloco_eager were tuned by
# the same protocol in section 12. The final lr is peak / 10.
# --per_method_lr=false uses the config's lr.
TUNED_PEAK_LR = {"all_reduce": 6e-3, "dadam": 6e-3, "accum_adamw": 3e-3,
                 "accum_adamw_paper": 1.5e-3, "accum_adamw_aer": 3e-3,
                 "local_sgd": 3e-3, "diloco": 3e-3, "streaming_diloco": 3e-3,
                 "decentralized_diloco": 3e-3, "local_dadam": 3e-3,
                 "sgp": 6e-3, "diloco_delayed": 1.5e-3, "diloco_eager": 3e-3}


def select_runs(spec: str) -> tuple[Run, ...]:
  """The runs named by ``--methods`` (comma-separated, or ``all``).

  Raises:
    ValueError: an unknown, repeated or empty name, ``all`` with other
      names, or no name; one line naming ``--methods``.
  """
  spec = str(spec)
  names = [x.strip() for x in spec.split(",")]
  listed = f"'all' or a comma-separated list of {', '.join(METHODS)}"
  if spec.startswith("-"):  # `--methods --outdir=x` takes the next flag
    raise ValueError(f"--methods needs a value, got the flag {spec!r}; give "
                     f"{listed}, e.g. --methods=dadam,sgp.")
  if not any(names):
    raise ValueError(f"--methods={spec!r} names no method; pass {listed}.")
  if "" in names:
    raise ValueError(f"--methods={spec!r}: entry {names.index('') + 1} is "
                     "empty; separate the names by single commas, e.g. "
                     "--methods=dadam,sgp.")
  if names == ["all"]:
    return RUNS
  if "all" in names:
    raise ValueError(f"--methods={spec!r}: 'all' selects every method and "
                     "takes no other names; pass --methods=all or only "
                     "method names.")
  unknown = [x for x in names if x not in METHODS]
  if unknown:
    raise ValueError(f"--methods={spec!r}: unknown method(s) "
                     f"{', '.join(map(repr, unknown))}; use {listed}.")
  repeated = sorted({x for x in names if names.count(x) > 1})
  if repeated:
    raise ValueError(f"--methods={spec!r} names {', '.join(repeated)} more "
                     "than once; list each method once.")
  return tuple(METHODS[x] for x in names)


def run_fields(run: Run, accum_steps: int) -> tuple[tuple[str, object], ...]:
  """``((dotted config field, value), ...)`` that ``run`` sets itself."""
  return (("algorithm", run.algorithm), ("topology", run.topology),
          ("workers_per_node", run.workers_per_node),
          ("optimizer.name", run.optimizer),
          ("optimizer.accum_steps",
           accum_steps if run.optimizer == "accum_adamw" else 1),
          *run.fields)


def unread_fields(run: Run) -> tuple[str, ...]:
  """The method fields (``builders.METHOD_FIELDS``) ``run``'s algorithm
  does not read; its config keeps their defaults."""
  read = builders.ALGORITHMS[run.algorithm].fields
  return tuple(f for f in builders.METHOD_FIELDS if f not in read)


def _set(config, field: str, value) -> None:
  *groups, last = field.split(".")
  node = config
  for g in groups:
    node = node[g]
  node[last] = value


def run_config(base, run: Run, accum_steps: int, per_method_lr: bool = False):
  """A copy of ``base`` set up for ``run``.

  The method fields its algorithm does not read are set to their
  ``base_config`` defaults (``check_config`` refuses any other value), so
  an override that only some methods read applies to those.
  """
  config = base.copy_and_resolve_references()
  model = base.get("model", {}).get("name")
  defaults = config_lib.base_config(
      model if model in config_lib.DATA_SOURCES else "gpt")
  with config.unlocked():
    if per_method_lr:
      config.schedule.peak_lr = TUNED_PEAK_LR[run.name]
      if config.schedule.get("name", "warmup_cosine") == "warmup_cosine":
        config.schedule.final_lr = TUNED_PEAK_LR[run.name] / 10
    for field, value in run_fields(run, accum_steps):
      _set(config, field, value)
    for field in unread_fields(run):
      value = defaults
      for part in field.split("."):
        value = value[part]
      _set(config, field, value)
  return config


def arm_configs(base, accum_steps: int, per_method_lr: bool,
                runs: tuple[Run, ...] = RUNS[:4]):
  """``[(run, config)]`` of every arm, each checked before any run starts.

  Raises:
    ValueError: an arm's config is invalid or its topology does not fit
      ``n_workers`` / ``workers_per_node``; the message names the arm.
  """
  arms = []
  for run in runs:
    config = run_config(base, run, accum_steps, per_method_lr)
    try:
      validation.check_config(config)
      if builders.ALGORITHMS[config.algorithm].uses_topology:
        n, local = int(config.n_workers), int(config.workers_per_node)
        try:
          topology_lib.make(config.topology, n, local)
        except ValueError as e:  # topology and nodes are the method's own
          why = str(e).rstrip(".")
          raise ValueError(f"its topology {config.topology} with {local} "
                           f"worker(s) per node does not fit --config."
                           f"n_workers={n}: {why}; choose another "
                           "--config.n_workers or leave this method out of "
                           "--methods.") from None
    except ValueError as e:
      raise ValueError(f"run {run.name!r} ({run.label}): {e}") from None
    arms.append((run, config))
  return arms


def make_outdir(path: str) -> str:
  """Creates the output directory; ValueError naming it if that fails."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"--outdir {path!r} is a file, not a directory; pass a "
                     "directory (it is created if missing).")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--outdir {path!r} cannot be created: "
                     f"{e.strerror or e}.") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"--outdir {path!r} is not writable.")
  return path


def results_table(rows: list[tuple[Run, dict | None]], unit: str,
                  extra: tuple[list[str], dict[str, list[str]]] | None = None
                  ) -> str:
  """Markdown table of final metrics, one row per run (None: diverged).

  ``extra``: ``(headers, {run.name: cells})`` of further columns (the
  clusters' predictions, ``compare_pricing.pricing_columns``).
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


CPU_PLOT = "cpu_loss_vs_time_this_machine.png"


def plot(rows: list[tuple[Run, str]], outdir: str,
         cpu_timing: bool = False) -> list[str]:
  """Validation loss vs step (and, with ``cpu_timing``, vs this machine's
  training time, ``cpu_loss_vs_time_this_machine.png``); returns the PNG
  paths."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  paths = []
  kinds = [("step", "step", "loss_vs_step.png", None)]
  if cpu_timing:
    kinds.append(("train_time_s", "this machine's CPU training time (s; "
                  "compile and evaluation excluded)",
                  CPU_PLOT,
                  "this machine's load-dependent CPU timing: not a ranking"))
  for x_key, x_label, name, title in kinds:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run, path in rows:
      if not os.path.exists(path):  # a run that diverged before logging
        continue
      records = metrics_lib.read_jsonl(path)
      xs, ys = metrics_lib.series(records, "eval/loss", x=x_key)
      ax.plot(xs, ys, marker="o", markersize=3, label=run.label)
    ax.set_xlabel(x_label)
    ax.set_ylabel("validation loss of the averaged model (nats)")
    if title:
      ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:  # every run diverged before logging: no legend
      ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(outdir, name)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    paths.append(out)
  return paths


def overridden_fields(overrides: list[str], runs) -> list[str]:
  """One line per ``--config.<field>`` override that a run sets itself, and
  one per override of a method field that some runs' algorithms do not
  read (those runs keep its default)."""
  out = []
  for arg in overrides:
    field = arg[len("--config."):].split("=", 1)[0]
    # accum_adamw arms take optimizer.accum_steps from the config.
    mine = [r.name for r in runs if field in dict(run_fields(r, 1))
            and not (field == "optimizer.accum_steps" and
                     r.optimizer == "accum_adamw" and
                     field not in dict(r.fields))]
    if mine:
      out.append(f"{arg} is ignored by {', '.join(mine)}: each method sets "
                 f"config.{field} itself (see compare.py's RUNS); run "
                 "experiments/train.py for other values.")
    unread = [r.name for r in runs if r.name not in mine
              and field in unread_fields(r)]
    if unread:
      out.append(f"{arg} is not read by the algorithm of "
                 f"{', '.join(unread)}: those runs keep its default.")
  return out


def sent_per_step(exp: experiment.Experiment) -> dict[str, float]:
  """``comm/bytes_per_step`` and ``comm/ratio`` of ``exp``'s train step."""
  comm = exp.communication(exp.init_state(), exp.get_batch(0))
  return {"comm/bytes_per_step": comm["bytes_per_step"],
          "comm/ratio": comm["ratio"]}


# A run's outcome in its subdirectory: {"config": its config, "final": its
# final metrics or null, "diverged": why it diverged or null}.
RESULT_FILE = "compare_result.json"
# Everything a run's subdirectory may hold (besides run.lock).
RUN_ENTRIES = (*train.RUN_FILES, RESULT_FILE, RESULT_FILE + ".tmp")


def _read_json(path: str):
  """The JSON value in ``path``, or None if it is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _has_checkpoint(workdir: str) -> bool:
  ckpts = os.path.join(workdir, "checkpoints")
  return os.path.isdir(ckpts) and any(x.isdigit() for x in os.listdir(ckpts))


def arm_status(workdir: str, config) -> tuple[str, dict | None]:
  """What an invocation does with a run's subdirectory ``workdir``.

  Returns:
    ``("finished", record)`` if ``workdir`` holds the outcome of a run of
    this very config (:data:`RESULT_FILE`: its final metrics, or why it
    diverged), which is kept; ``("resume", None)`` if it holds a
    checkpoint of a run of this config (its ``config.json``), which
    ``train_and_evaluate`` resumes; ``("fresh", None)`` otherwise: the
    directory is replaced and the run starts at step 0.
  """
  want = json.loads(config.to_json())
  record = _read_json(os.path.join(workdir, RESULT_FILE))
  if isinstance(record, dict) and record.get("config") == want:
    return "finished", record
  if (_read_json(os.path.join(workdir, "config.json")) == want
      and _has_checkpoint(workdir)):
    return "resume", None
  return "fresh", None


def _record(workdir: str, config, final, reason) -> None:
  path = os.path.join(workdir, RESULT_FILE)
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"config": json.loads(config.to_json()), "final": final,
                 "diverged": reason}, f, indent=1)
    os.replace(path + ".tmp", path)
  except OSError as e:
    raise ValueError(f"cannot write {path}: {e.strerror or e}.") from None


def run_arm(run: Run, config, workdir: str, fresh: bool = False,
            checkpoints: bool = True):
  """Trains one arm in ``workdir``, or takes what an earlier invocation left.

  See :func:`arm_status` (``fresh``: always start at step 0). A finished
  run keeps its recorded metrics, timings included; a resumed run's
  ms/step and tokens/s are those of the steps after its checkpoint.
  Without ``checkpoints`` the run's checkpoints are deleted once its
  outcome is recorded (:func:`drop_checkpoints`), the lock still held.

  The work directory is locked (``run.lock``) before anything in it is
  read or removed, so two invocations on the same ``--outdir`` cannot
  clobber each other; a directory to be replaced must be a directory, not
  a symbolic link, holding only what a run writes (:data:`RUN_ENTRIES`),
  anything else is refused (and keeps no ``run.lock`` of ours).

  Returns:
    ``(final metrics or None, why it diverged or None)``; the outcome is
    recorded in ``workdir/`` :data:`RESULT_FILE`.

  Raises:
    ValueError: bad data or work directory (another run holds it, or it is
      not a run directory), or an unreadable checkpoint.
    train.Preempted: stopped by SIGTERM / SIGINT after saving a checkpoint.
  """
  # train_and_evaluate re-enters the lock; "--outdir" for the in-use error.
  with workdir_lib.hold(workdir, flag="--outdir"):
    outcome = _run_arm_held(run, config, workdir, fresh)
    if not checkpoints:
      drop_checkpoints(workdir)
    return outcome


def _run_arm_held(run: Run, config, workdir: str, fresh: bool):
  """:func:`run_arm` with ``workdir``'s lock held."""
  status, record = ("fresh", None) if fresh else arm_status(workdir, config)
  if status == "finished":
    print(f"== {run.label}: finished by an earlier invocation, kept "
          f"({workdir})", flush=True)
    return record["final"], record["diverged"]
  if status == "fresh":  # refuses a directory this project did not write
    workdir_lib.clear(workdir, RUN_ENTRIES)
  print(f"== {run.label} -> {workdir}" + (
      " (resuming from its checkpoint)" if status == "resume" else ""),
        flush=True)
  t0 = time.perf_counter()
  final = reason = None
  try:
    exp = experiment.Experiment(config)
    final = train.train_and_evaluate(config, workdir, experiment=exp)
    final.update(sent_per_step(exp))
    print(f"   val loss {final['eval/loss']:.4f}, sends "
          f"{final['comm/ratio']:.3f} x params per step, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  except FloatingPointError as e:  # this arm diverged; the others still run
    print(f"   diverged: {e}", flush=True)
    reason = str(e)
  _record(workdir, config, final, reason)
  return final, reason


def preempted_message(e: train.Preempted, run: Run, done, rest,
                      fresh: bool = False) -> str:
  """What was saved when ``run`` stopped, and what the same command does
  next (``done``: the runs before it, ``rest``: those after it)."""
  names = lambda runs: ", ".join(r.name for r in runs)
  again = ("the same command without --fresh" if fresh else
           "the same command")
  return (f"run {run.name!r} stopped by {signal.Signals(e.signum).name} "
          f"after step {e.step}; checkpoint {e.step} is saved in "
          f"{e.directory}. Run {again} again to go on: it keeps the finished "
          f"runs ({names(done) or 'none'}), resumes {run.name!r} from step "
          f"{e.step}" + (f" and then trains {names(rest)}" if rest else "")
          + ".")


def _fail(message, code: int = 2) -> None:
  """One ``error:`` line on stderr, then exit (2: bad input, 3: diverged)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


@dataclasses.dataclass(frozen=True)
class Arm:
  """One training run of the job: a method at a seed.

  Attributes:
    method: the method (:class:`Run`; its ``name`` keys the tables).
    seed: ``config.seed``.
    run: ``method`` renamed for this seed (``<name>_seed<k>``, label ``...,
      seed k``) when the job has several seeds, else ``method``; its
      ``name`` is the run's subdirectory.
    config: the run's config.
  """

  method: Run
  seed: int
  run: Run
  config: object


def parse_seeds(spec: str) -> tuple[int, ...]:
  """``--seeds``: comma-separated distinct integers in [0, 2**32 - 1].

  An empty (or blank) ``spec`` gives ``()``: the config's own seed.

  Raises:
    ValueError: a bad, empty or repeated entry (names the flag).
  """
  out = []
  if not str(spec).strip():
    return ()
  for k, x in enumerate(x.strip() for x in str(spec).split(",")):
    if not x:
      raise ValueError(f"--seeds={spec!r}: entry {k + 1} is empty; "
                       "separate the seeds by single commas, e.g. "
                       "--seeds=0,1,2.")
    if not x.isdigit() or int(x) > config_lib.SEED_MAX:
      raise ValueError(f"--seeds={spec!r}: {x!r} is not a seed; give "
                       "comma-separated integers in [0, "
                       f"{config_lib.SEED_MAX}], e.g. --seeds=0,1,2.")
    if int(x) in out:
      raise ValueError(f"--seeds={spec!r} names {x} more than once; list "
                       "each seed once.")
    out.append(int(x))
  return tuple(out)


def job_arms(arms, seeds: tuple[int, ...], checkpoints: bool) -> list[Arm]:
  """Every (method, seed) run of the job, method by method.

  ``arms``: :func:`arm_configs`' ``[(run, config)]``; ``seeds``: empty for
  the config's own seed. Without ``checkpoints`` the configs write no
  periodic checkpoints (``checkpoint_interval = 0``).
  """
  out = []
  for run, config in arms:
    for seed in seeds or (int(config.seed),):
      c = config.copy_and_resolve_references()
      with c.unlocked():
        c.seed = seed
        if not checkpoints:
          c.checkpoint_interval = 0
      named = run if len(seeds) <= 1 else dataclasses.replace(
          run, name=f"{run.name}_seed{seed}", label=f"{run.label}, seed {seed}")
      out.append(Arm(run, seed, named, c))
  return out


class JobProgress:
  """One ``tqdm`` bar over every training step of the job, with an ETA.

  While :meth:`attach` is active, the per-run bar of
  ``train.train_and_evaluate`` (``metrics_lib.progress_bar``) forwards its
  steps to this bar, and ``print`` goes through ``tqdm.write`` so log
  lines do not break the bar. The rate, and so the ETA, counts only the
  time in training steps: the time before each run's first step
  (building, compiling, restoring) is left out of the bar's clock, and
  steps an earlier invocation did (kept or resumed runs) move the bar
  without counting as fast steps.
  """

  def __init__(self, arms: list[Arm]):
    self._n = len(arms)
    self._ends = np.cumsum([int(a.config.steps) for a in arms]).tolist()
    first = f" ({arms[0].run.name})" if arms else ""
    self.bar = tqdm.tqdm(total=sum(int(a.config.steps) for a in arms),
                         unit="step", dynamic_ncols=True, mininterval=1.0,
                         desc=f"run 1 of {self._n}{first}", leave=True)

  def start(self, k: int, arm: Arm) -> None:
    """Run ``k`` (1-based) is next."""
    self.bar.set_description(f"run {k} of {self._n} ({arm.run.name})")

  def skip(self, steps: int) -> None:
    """Steps done by an earlier invocation (or never run: a diverged
    run's rest): the bar moves, its rate does not."""
    steps = int(steps)
    if steps <= 0:
      return
    if self.bar.disable:
      self.bar.n += steps
      return
    self.bar.n += steps
    self.bar.last_print_n += steps
    self.bar.initial += steps  # the rate before any smoothing: (n - initial)
    self.bar.refresh()

  def finish(self, k: int) -> None:
    """Runs 1 to ``k`` are done (kept, trained or diverged)."""
    self.skip(max(self._ends[k - 1] - self.bar.n, 0))

  def _run_bar(self, total, initial=0, desc="", disable=None):
    del total, desc, disable
    self.skip(initial)
    return _Forward(self.bar)

  def attach(self):
    """Context: per-run bars forward here, stdout goes via tqdm.write."""
    stack = contextlib.ExitStack()
    saved = metrics_lib.progress_bar
    metrics_lib.progress_bar = self._run_bar
    stack.callback(setattr, metrics_lib, "progress_bar", saved)
    stack.enter_context(contextlib.redirect_stdout(
        tqdm_contrib.DummyTqdmFile(sys.stdout)))
    return stack

  def close(self) -> None:
    self.bar.close()


class _Forward:
  """A run's bar: steps and nothing else go to the job's bar; the time
  before its first step (compile) is left out of the job bar's clock."""

  def __init__(self, bar):
    self._bar = bar
    self._started = False

  def update(self, n: int = 1) -> None:
    if not self._started:  # compile and the first step: not a step's time
      self._started = True
      self._bar.unpause()
    self._bar.update(n)

  def set_postfix(self, *args, **kwargs) -> None:
    del args, kwargs

  def close(self) -> None:
    pass


def drop_checkpoints(workdir: str) -> None:
  """Deletes a finished run's checkpoints (its outcome is recorded)."""
  shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)


def reference_check(reference, job: str | None,
                    losses: dict[str, float]) -> str:
  """The job's final losses against the stored reference, one line.

  Args:
    reference: the contents of :data:`REFERENCE_FILE` (``{"tolerance":
      nats, "produced_on": words, "jobs": {job: {"final_loss": {"<method>/
      seed<k>": loss}}}}``), or None if it is missing. Any other shape is
      reported, not raised (:func:`reference_problem`).
    job: ``"quick"`` or ``"full"`` when this invocation is that job's
      default set-up (default config, no ``--config`` overrides, tuned
      learning rates), else None.
    losses: ``{"<method>/seed<k>": final validation loss}`` of this job.

  Returns:
    "matches the reference within X ...", "differs: ...", why there is
    nothing to compare, or "not checked: the reference file ... is
    malformed: key ...".
  """
  if reference is None:
    return f"no reference file ({REFERENCE_FILE})."
  problem = reference_problem(reference)
  if problem:
    return (f"not checked: the reference file {REFERENCE_FILE} is malformed:"
            f" {problem}; fix it or restore it with git.")
  stored = (reference.get("jobs", {}).get(job, {}).get("final_loss", {})
            if job else {})
  common = sorted(set(stored) & set(losses))
  if not common:
    return ("no stored reference for this set-up (the reference covers "
            "the default jobs' runs without --config overrides).")
  tol = float(reference["tolerance"])
  diffs = {k: losses[k] - float(stored[k]) for k in common}
  worst = max(abs(d) for d in diffs.values())
  where = f"reference produced on {reference.get('produced_on', '?')}"
  bad = [k for k in common if not abs(diffs[k]) <= tol]
  if not bad:
    return (f"matches the reference within {tol:g} nats (largest "
            f"difference {worst:.4f} over {len(common)} runs; {where}).")
  return ("differs: " + "; ".join(
      f"{k} {losses[k]:.4f} vs reference {float(stored[k]):.4f}"
      for k in bad) + f" (tolerance {tol:g} nats; {where}). Other "
      "versions of JAX/XLA or a changed library give other numbers.")


def _is_number(x) -> bool:
  """A finite real that is a float64 (a JSON integer may be any size)."""
  if not isinstance(x, numbers.Real) or isinstance(x, bool):
    return False
  try:
    return math.isfinite(float(x))
  except OverflowError:  # e.g. an integer of 400 digits
    return False


def reference_problem(reference) -> str | None:
  """What is wrong with the contents of :data:`REFERENCE_FILE` (naming the
  key, e.g. ``key 'jobs.quick.final_loss.dadam/seed0' is None, not a
  loss``), or None if it has the shape :func:`reference_check` reads."""
  kind = lambda x: f"{type(x).__name__} {x!r:.40}"
  if isinstance(reference, UnreadableReference):
    return f"it is not readable JSON ({reference.why})"
  if not isinstance(reference, dict):
    return f"its top level is a {kind(reference)}, not an object"
  tol = reference.get("tolerance")
  if not _is_number(tol) or tol < 0:
    return f"key 'tolerance' is {kind(tol)}, not a number of nats >= 0"
  jobs = reference.get("jobs", {})
  if not isinstance(jobs, dict):
    return f"key 'jobs' is {kind(jobs)}, not an object"
  for name, record in jobs.items():
    if not isinstance(record, dict):
      return f"key 'jobs.{name}' is {kind(record)}, not an object"
    finals = record.get("final_loss", {})
    if not isinstance(finals, dict):
      return (f"key 'jobs.{name}.final_loss' is {kind(finals)}, not an "
              "object")
    for run, loss in finals.items():
      if not _is_number(loss):
        return (f"key 'jobs.{name}.final_loss.{run}' is {kind(loss)}, not a "
                "loss")
  return None


@dataclasses.dataclass(frozen=True)
class UnreadableReference:
  """A reference file that is not readable JSON, and why."""
  why: str


def load_reference(path: str | None = None):
  """The contents of the reference file, None if there is none, or an
  :class:`UnreadableReference` (which :func:`reference_check` reports).
  ``path``: default :data:`REFERENCE_FILE`."""
  try:
    with open(path or REFERENCE_FILE, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    return UnreadableReference(str(e).splitlines()[0][:120])
  except RecursionError:
    return UnreadableReference("nested too deeply")


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


def _setup_words(base, arms: list[Arm], accum: int, per_method_lr: bool,
                 unit: str) -> str:
  """The proxy runs' set-up, for results.md."""
  methods = list(dict.fromkeys(a.method.name for a in arms))
  seeds = sorted({a.seed for a in arms})
  lrs = (", ".join(f"{m} {TUNED_PEAK_LR[m]:g}" for m in methods)
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


def write_results(arms: list[Arm], finals: list, diverged, outdir: str,
                  base, accum: int, per_method_lr: bool, start: float,
                  load_before: float, clusters=(), workload: str = "",
                  prices: dict | None = None, reference_line: str = "",
                  cpu_timing: bool = False):
  """Writes results.md and the plots.

  Args:
    arms: the job's :class:`Arm` s.
    finals: final metrics per arm (None: it diverged), in ``arms``' order.
    diverged: ``[(run, reason)]``.
    outdir, base, accum, per_method_lr: as in ``main``.
    start, load_before: ``time.perf_counter()`` and the load average when
      the runs started.
    clusters: ``compare_pricing.PricingCluster`` s to price the runs on.
    workload: ``--workload``.
    prices: ``{method name: compare_pricing.predicted_ms(...)}``.
    reference_line: :func:`reference_check`'s line.
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
  curves, losses = {}, {}
  for a, m in zip(arms, finals):
    if m is not None:
      curves.setdefault(a.method.name, []).append(compare_pricing.eval_curve(
          os.path.join(outdir, a.run.name, metrics_lib.METRICS_FILE)))
      losses.setdefault(a.method.name, []).append(float(m["eval/loss"]))
  # A method with a diverged seed is left out of the answer.
  bad = {a.method.name for a, m in zip(arms, finals) if m is None}
  curves = {k: v for k, v in curves.items() if k not in bad}
  at = {cl.label: compare_pricing.priced_workers(cl, n) for cl in clusters}
  answer, lines = compare_answer.answer_markdown(
      clusters, curves, prices, losses, labels, at, workload)
  extra, notes = None, []
  if clusters:
    arm_prices = {a.run.name: prices.get(a.method.name, {}) for a in arms}
    heads, cells, notes = compare_pricing.pricing_columns(rows, arm_prices,
                                                          clusters)
    extra = (heads, cells)
  table = timing_columns(results_table(rows, unit, extra), cpu_timing)
  if notes:
    table += "\n" + "\n".join(f"- {x}" for x in notes) + "\n"
  specs = {a.method.label: compare_pricing.method_spec(a.config)
           for a in arms}
  total = time.perf_counter() - start
  with open(os.path.join(outdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(f"# Which method on which cluster ({base.model.name} proxy, {n} "
            f"workers, {int(base.steps)} steps)\n\n")
    f.write(_setup_words(base, arms, accum, per_method_lr, unit))
    f.write(compare_pricing.pricing_text(clusters, n, workload, specs,
                                         base.model.name))
    f.write(answer)
    if bad:
      f.write(f"Left out of the answer (a seed diverged): "
              f"{', '.join(labels[k] for k in bad)}.\n\n")
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
  pngs = plot(logs, outdir, cpu_timing)
  if clusters:
    pngs.append(compare_answer.plot_frontier(clusters, curves, prices, labels,
                                             at, outdir))
  remove_stale_plots(outdir, pngs)
  return answer, lines, table, pngs, total


# Every plot compare.py writes into --outdir.
PLOT_NAMES = ("loss_vs_step.png", CPU_PLOT, compare_answer.PLOT_NAME)


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


def job_settings() -> tuple[str, str, str, bool, str | None]:
  """``(config path, methods, seeds, checkpoints, job)`` from the flags.

  ``--full`` changes the defaults of ``--config``, ``--methods``,
  ``--seeds`` and ``--checkpoints``; each flag given explicitly wins (an
  explicit ``--config.checkpoint_interval`` turns checkpoints on).
  ``job`` is ``"quick"`` or ``"full"`` when the set-up is that job's
  default one (for the reference check), else None.
  """
  given = lambda name: flags.FLAGS[name].present
  full = _FULL.value
  config = _CONFIG.value if given("config") else (
      FULL_CONFIG if full else QUICK_CONFIG)
  methods = _METHODS.value if given("methods") else ",".join(
      FULL_METHODS if full else DEFAULT_METHODS)
  seeds = _SEEDS.value if given("seeds") else ("0,1,2" if full else "")
  # An explicit --config.checkpoint_interval asks for checkpoints too.
  checkpoints = _CHECKPOINTS.value if given("checkpoints") else (
      full or any(a.startswith("--config.checkpoint_interval")
                  for a in _OVERRIDES))
  job = "full" if full else "quick"
  if (os.path.realpath(config) != os.path.realpath(
      FULL_CONFIG if full else QUICK_CONFIG) or _OVERRIDES
      or not _PER_METHOD_LR.value):
    job = None
  return config, methods, seeds, checkpoints, job


def train_all(arms: list[Arm], outdir: str, checkpoints: bool):
  """Trains (or keeps, or resumes) every arm under one progress bar.

  Returns:
    ``(finals, diverged)``: final metrics or None per arm, and
    ``[(run, reason)]``. Exits (``_fail``, or 128 + signum when stopped by
    SIGTERM/SIGINT) on bad data or work directories.
  """
  finals, diverged = [], []
  runs = [a.run for a in arms]
  progress = JobProgress(arms)
  for k, arm in enumerate(arms):
    workdir = os.path.join(outdir, arm.run.name)
    progress.start(k + 1, arm)
    try:
      with progress.attach():
        final, reason = run_arm(arm.run, arm.config, workdir, _FRESH.value,
                                checkpoints)
    except ValueError as e:  # bad data or work directory: all runs share it
      progress.close()
      _fail(f"run {arm.run.name!r} ({arm.run.label}): {e}")
    except train.Preempted as e:  # SIGTERM/SIGINT: stop, 128 + signum
      progress.close()
      print("preempted: " + preempted_message(
          e, arm.run, runs[:k], runs[k + 1:], _FRESH.value), file=sys.stderr)
      sys.exit(e.exit_code)
    progress.finish(k + 1)
    if reason is not None:
      diverged.append((arm.run, reason))
    finals.append(final)
  progress.close()
  return finals, diverged


def load_job(config_path: str, methods: str, seeds: str, checkpoints: bool,
             per_method_lr: bool):
  """Every arm's config, the clusters, the device count and ``--outdir``,
  checked before JAX starts and the first run trains (bad input: one
  ``error:`` line, exit 2).

  Returns:
    ``(base config, accum_steps, arms, workload, clusters, outdir)``.
  """
  try:
    base = config_lib.load_config(config_path, _OVERRIDES)
    accum = base.optimizer.accum_steps  # a bad type is named by arm_configs
    if (isinstance(accum, numbers.Integral) and accum <= 1 and
        isinstance(base.n_workers, numbers.Integral)):
      accum = max(int(base.n_workers) // 2, 2)
    arms = job_arms(arm_configs(base, accum, per_method_lr,
                                select_runs(methods)),
                    parse_seeds(seeds), checkpoints)
    workload = compare_pricing.check_workload(_WORKLOAD.value)
    clusters = compare_pricing.parse_clusters(_CLUSTERS.value, workload)
    if not os.environ.get("JAX_NUM_CPU_DEVICES"):
      needed, source = validation.devices_needed(base)
      devices = validation.check_simulated_devices(
          _CPU_DEVICES.value or needed,
          f"--cpu_devices={_CPU_DEVICES.value}" if _CPU_DEVICES.value
          else source.replace("config.", "--config."))  # the flags typed
      jax.config.update("jax_num_cpu_devices", devices)
    outdir = make_outdir(_OUTDIR.value)
  except ValueError as e:
    _fail(e)
  return base, accum, arms, workload, clusters, outdir


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  orbax_quiet.quiet_orbax_logs()
  absl_logging.set_verbosity(absl_logging.WARNING)  # no per-step lines
  per_method_lr = _PER_METHOD_LR.value
  explicit_lr = [a for a in _OVERRIDES if a.startswith(
      ("--config.schedule.peak_lr", "--config.schedule.final_lr"))]
  if per_method_lr and explicit_lr:
    # An explicit learning rate wins over the tuned per-method table.
    print(f"note: {explicit_lr[0]} given, so every run uses the config's "
          "learning rates (--per_method_lr ignored)", flush=True)
    per_method_lr = False
  config_path, methods, seeds, checkpoints, job = job_settings()
  base, accum, arms, workload, clusters, outdir = load_job(
      config_path, methods, seeds, checkpoints, per_method_lr)
  methods_once = list({a.method.name: a.method for a in arms}.values())
  for line in overridden_fields(_OVERRIDES, methods_once):
    print(f"note: {line}", file=sys.stderr)
  for line in dict.fromkeys(w for a in arms
                            for w in validation.config_warnings(a.config)):
    print(f"warning: {line}", file=sys.stderr)
  print(f"{len(arms)} runs ({', '.join(m.name for m in methods_once)}; "
        f"{int(base.steps)} steps each) -> {outdir}", flush=True)
  with contextlib.ExitStack() as held:
    try:  # the whole invocation: no other one writes into --outdir
      held.enter_context(workdir_lib.hold(outdir, flag="--outdir"))
    except ValueError as e:  # in use by another invocation, or unwritable
      _fail(f"--outdir {outdir!r}: {e}")
    _run_job(arms, outdir, checkpoints, job, base, accum, per_method_lr,
             clusters, workload)


def _run_job(arms, outdir, checkpoints, job, base, accum, per_method_lr,
             clusters, workload) -> None:
  """:func:`main` once ``--outdir`` is held: trains every arm, writes and
  prints the results; exits 2 (bad data or directory, unwritable results)
  or 3 (diverged runs)."""
  start, load_before = time.perf_counter(), os.getloadavg()[0]
  finals, diverged = train_all(arms, outdir, checkpoints)
  # Runtime-model pricing of the methods (no training, milliseconds).
  prices = {}
  for a in arms:
    if a.method.name not in prices:
      prices[a.method.name] = compare_pricing.predicted_ms(
          a.config, clusters, workload)
  reference_line = reference_check(load_reference(), job, {
      f"{a.method.name}/seed{a.seed}": float(m["eval/loss"])
      for a, m in zip(arms, finals) if m is not None})
  if reference_line.startswith("not checked"):  # the results are still written
    print(f"warning: reference check {reference_line}", file=sys.stderr)
  try:
    answer, lines, table, pngs, total = write_results(
        arms, finals, diverged, outdir, base, accum, per_method_lr, start,
        load_before, clusters, workload, prices, reference_line,
        _CPU_TIMING.value)
  except OSError as e:
    _fail(f"cannot write the results to --outdir {outdir!r}: "
          f"{e.strerror or e} ({e.filename or outdir}).")
  print("\n" + (answer or table))
  if lines:
    print(f"recommendations (predicted, for workload {workload}):")
  for line in lines:
    print(f"  {line.replace('**', '')}")
  print(f"reference check: {reference_line}")
  print(f"table: {os.path.join(outdir, 'results.md')}\nplots: "
        f"{', '.join(pngs)}\ntotal: {total:.0f} s")
  if diverged:
    _fail(diverged_message(diverged, len(arms),
                           os.path.join(outdir, "results.md")), code=3)


def diverged_message(diverged, n_runs: int, results: str) -> str:
  """The exit-3 line: which runs diverged (``[(run, reason)]`` of
  ``n_runs``) and where the results are (``results``: results.md)."""
  why = "; ".join(f"{run.name!r} ({run.label}): {str(reason).rstrip('.')}"
                  for run, reason in diverged)
  if len(diverged) < n_runs:
    return (f"{len(diverged)} of {n_runs} runs diverged: {why}; the other "
            f"runs' results are in {results}.")
  return (f"all {n_runs} runs diverged: {why}; no run finished, so there is "
          f"no answer ({results} lists the divergences).")


def _parse_or_exit(argv):
  """Parses the flags; a bad one is a one-line error (exit 2).

  The ``--config.<field>`` overrides are set aside for ``main``, which loads
  the base config with them (``config.load_config``).
  """
  rest, _OVERRIDES[:] = config_lib.split_overrides(argv)
  try:
    return flags.FLAGS(rest)
  except flags.Error as e:
    _fail(config_lib.config_error_message(e))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_or_exit)
