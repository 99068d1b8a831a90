"""The main job: training methods side by side on the same model and data.

Trains the config's model (default ``configs/gpt_tiny.py``) from the same
initial parameters and data order, for the same number of steps, once per
method of ``--methods``. The default answers "which method, and what
quality": All-Reduce AdamW, the decentralized Adams, two local-update
methods and one gossip + local-steps method:

* ``all_reduce``: All-Reduce AdamW;
* ``dadam``: DAdam on ``one_peer_exp``;
* ``accum_adamw``: AccumAdamW on ``one_peer_exp`` in its best measured
  setting: window T = config.optimizer.accum_steps (4), horizon-matched
  betas (``optimizer.beta_convention="per_step"``: b1**T, b2**T per window);
* ``diloco``: DiLoCo, inner AdamW, outer Nesterov (lr 0.3, momentum 0.9),
  sync every 10 steps;
* ``local_sgd``: Local SGD with inner AdamW, sync every 10 steps;
* ``local_dadam``: DAdam gossiping every 5 steps on ``one_peer_exp``;

and, by name or with ``--methods=all``:

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
chosen for gpt_tiny by the project's tuning protocol,
``decentral_jax.runner.tuning``; BENCHMARKS.md, section 10), one seed (the
config's); the 3-seed means +- 2 sigma are in BENCHMARKS.md. The results go to
``--outdir`` (default ``results/compare``): ``results.md`` (the table: final
validation loss of the averaged model, the workers' own validation losses,
final consensus distance, the bytes each worker sends per step averaged
over a sync period, read from the compiled step's HLO, ms/step, tokens/s),
``<run>/metrics.jsonl`` per run, and ``loss_vs_step.png`` /
``loss_vs_time.png``. On simulated CPU devices "communication" is a memory
copy, so the timings show compute overheads only, not network savings.

Which method for my cluster? For every cluster of ``--clusters`` (default
``A40,T4``: Figure 6's 4 x A40 / 25 Gbit/s Ethernet and 8 x T4 / 100 Gbit/s
InfiniBand clusters with the paper's Transformer-base workload; or cluster
JSON files written by ``python -m decentral_jax.runtime_model measure``,
with their measured workload) the table also gives each finished run's
runtime-model prediction (``experiments/compare_pricing.py``): "predicted
ms/it, <cluster>" (``core.simulate`` of the run's
``builders.spec_for_config`` at ``config.n_workers`` workers; "-" with a
footnote where the model cannot price it, e.g. ``n`` not a multiple of the
cluster's GPUs per node) and "time to AR loss, <cluster>" (the first step,
interpolated between evaluations, at which the run's validation loss
reaches All-Reduce's final one, times that prediction; "not reached" if
never; "-" without an All-Reduce run). ``loss_vs_predicted_time.png`` plots
the validation loss against that predicted time, one subplot per cluster.
The loss per step is measured here, the time per step predicted for the
cluster's own workload: a what-if, not a measurement. ``--clusters=``
(empty) turns the pricing off.

  python experiments/compare.py       # ~10 min on an idle 2-core CPU (17 CPU-minutes)
  python experiments/compare.py --methods=all_reduce,diloco,sgp
  python experiments/compare.py --config.steps=100 --outdir /tmp/cmp
  python experiments/compare.py --clusters=A40,cluster.json

``--config.<field>=value`` overrides apply to every run (the fields a method
sets, e.g. its algorithm, optimizer name, topology, sync period, are set
per run; a method field its algorithm does not read, e.g. comm_dtype for
all_reduce, keeps its default there, with a note).

Interrupted and repeated invocations: each run's subdirectory of
``--outdir`` records its outcome (``compare_result.json``) and its
checkpoints. The same command again keeps every run that finished with the
same config (its metrics and timings as recorded), resumes an interrupted
run from its last checkpoint (SIGTERM or Ctrl-C saves one; the message
says so) and trains the others; a subdirectory of another config is
replaced (one holding anything a run does not write is refused). Each
subdirectory is locked while its run trains, so a second invocation on the
same ``--outdir`` is refused, not interleaved. ``--fresh`` trains every
run from step 0.

Bad input (a missing or broken config file, an unknown field, a bad value in
any run's config, an ``--outdir`` that is a file or cannot be created, a
``--clusters`` entry that is neither a preset nor a valid cluster file) is one
``error: ...`` line on stderr and exit code 2, before anything trains. A run
that diverges is marked in the table and the other runs go on; then one
``error:`` line names the diverged runs and the exit code is 3.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import signal
import sys
import time

from absl import app
from absl import flags
import jax

from decentral_jax.runner import builders
from decentral_jax.runner import checkpoint
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
import compare_pricing  # noqa: E402  pylint: disable=wrong-import-position

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "gpt_tiny.py")
_CONFIG = flags.DEFINE_string(
    "config", _DEFAULT_CONFIG, "Base config for all runs (FILE.py or "
    "FILE.py:ARG); override its fields with --config.<field>=value.")
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
# The methods of a plain `python experiments/compare.py` (see RUNS).
DEFAULT_METHODS = ("all_reduce", "dadam", "accum_adamw", "diloco",
                   "local_sgd", "local_dadam")
_METHODS = flags.DEFINE_string(
    "methods", ",".join(DEFAULT_METHODS),
    "Comma-separated methods to run, in this order, or 'all'; see the "
    "module docstring for the list.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Simulated CPU devices; 0 = config.n_workers x "
    "config.devices_per_worker / config.workers_per_device.",
    lower_bound=0)
_CLUSTERS = flags.DEFINE_string(
    "clusters", "A40,T4",
    "Comma-separated clusters to price every run on with the runtime "
    "model: presets of Figure 6 (A40, T4; the paper's Transformer-base "
    "workload) or cluster JSON files written by `python -m "
    "decentral_jax.runtime_model measure`; empty: no pricing.")
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


def plot(rows: list[tuple[Run, str]], outdir: str) -> list[str]:
  """Validation loss vs step and vs training time; returns the PNG paths."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  paths = []
  for x_key, x_label, name in (
      ("step", "step", "loss_vs_step.png"),
      ("train_time_s", "training time (s; compile and evaluation excluded)",
       "loss_vs_time.png")):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run, path in rows:
      if not os.path.exists(path):  # a run that diverged before logging
        continue
      records = metrics_lib.read_jsonl(path)
      xs, ys = metrics_lib.series(records, "eval/loss", x=x_key)
      ax.plot(xs, ys, marker="o", markersize=3, label=run.label)
    ax.set_xlabel(x_label)
    ax.set_ylabel("validation loss of the averaged model (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
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


def run_arm(run: Run, config, workdir: str, fresh: bool = False):
  """Trains one arm in ``workdir``, or takes what an earlier invocation left.

  See :func:`arm_status` (``fresh``: always start at step 0). A finished
  run keeps its recorded metrics, timings included; a resumed run's
  ms/step and tokens/s are those of the steps after its checkpoint.

  The work directory is locked (``run.lock``) before anything in it is
  read or removed, so two invocations on the same ``--outdir`` cannot
  clobber each other; a directory to be replaced must hold only what a
  run writes (:data:`RUN_ENTRIES`), anything else is refused.

  Returns:
    ``(final metrics or None, why it diverged or None)``; the outcome is
    recorded in ``workdir/`` :data:`RESULT_FILE`.

  Raises:
    ValueError: bad data or work directory (another run holds it, or it is
      not a run directory), or an unreadable checkpoint.
    train.Preempted: stopped by SIGTERM / SIGINT after saving a checkpoint.
  """
  with workdir_lib.hold(workdir):  # train_and_evaluate re-enters it
    return _run_arm_held(run, config, workdir, fresh)


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


def write_results(finals, logs, diverged, outdir: str, base, accum: int,
                  per_method_lr: bool, start: float, load_before: float,
                  clusters=(), prices: dict | None = None,
                  run_specs: dict[str, str] | None = None):
  """Writes results.md and the plots.

  Args:
    finals: ``[(run, final metrics or None if it diverged)]``.
    logs: ``[(run, metrics.jsonl path)]``.
    diverged: ``[(run, reason)]``.
    outdir, base, accum, per_method_lr: as in ``main``.
    start, load_before: ``time.perf_counter()`` and the load average when
      the runs started.
    clusters: ``compare_pricing.PricingCluster`` s to price the runs on.
    prices: ``{run.name: compare_pricing.predicted_ms(...)}``.
    run_specs: ``{run label: runtime-model spec}`` for the text.

  Returns:
    ``(table with its notes, png paths, total seconds)``.

  Raises:
    OSError: a file could not be written.
  """
  unit = "tokens" if base.model.name == "gpt" else "samples"
  n = int(base.n_workers)
  extra, notes, pricing, curves, target = None, [], "", {}, None
  if clusters:
    prices = prices or {}
    curves = {run.name: compare_pricing.eval_curve(p) for run, p in logs}
    target, why_no_target = compare_pricing.ar_target(finals)
    heads, cells, notes = compare_pricing.pricing_columns(
        finals, curves, prices, clusters, target, why_no_target)
    extra = (heads, cells)
    pricing = compare_pricing.pricing_text(
        clusters, n, run_specs or {}, base.model.name, target, why_no_target)
  table = results_table(finals, unit, extra)
  if notes:
    table += "\n" + "\n".join(f"- {x}" for x in notes) + "\n"
  total = time.perf_counter() - start
  with open(os.path.join(outdir, "results.md"), "w", encoding="utf-8") as f:
    f.write(
        f"# Decentralized vs All-Reduce: {base.model.name}, {n} workers, "
        f"{int(base.steps)} steps\n\n"
        f"Same initial parameters and data order (seed {int(base.seed)}); "
        f"global batch {int(base.global_batch)}; AccumAdamW accum_steps "
        f"{accum}; peak learning rates "
        + (", ".join(f"{run.name} {TUNED_PEAK_LR[run.name]:g}"
                     for run, _ in finals)
           + " (each chosen by the tuning protocol in this setting, "
           "BENCHMARKS.md section 10; one seed here, 3-seed means +- 2 "
           "sigma there)"
           if per_method_lr else
           f"{float(base.schedule.peak_lr):g} for all runs")
        + ", cosine to a tenth of the peak. At the last step: validation loss "
        "(nats per "
        f"{unit[:-1]}) of "
        "the exact average x_bar of the workers' parameters; the extra loss "
        "of each worker's own parameters over x_bar on the same validation "
        "subset (1/n of it); consensus distance (1/n) sum_i ||x_i - "
        "x_bar||^2; the bytes the busiest worker sends per step, averaged "
        "over a sync period and divided by one worker's parameter bytes "
        "(read from the step's HLO: with one device per worker the HLO the "
        "program hands to XLA, i.e. what it asks for, e.g. comm_dtype bytes; "
        "with several devices per worker the compiled HLO, in which XLA:CPU "
        "widens bfloat16 collectives to float32; the consensus-distance "
        "diagnostic of logging steps left out). Timings on "
        f"{jax.devices()[0].platform.upper()} devices "
        f"({len(jax.devices())} simulated on one host: communication is a "
        "memory copy, so they show compute overheads, not network savings); "
        "the first (compiling) step and evaluation are not timed.\n\n")
    f.write(pricing)
    f.write(table)
    for run, reason in diverged:
      f.write(f"\n{run.label} diverged: {reason}\n")
    f.write(f"\nTotal time of this invocation for the {len(finals)} runs "
            "(a run kept from an earlier one adds nothing to it): "
            f"{total:.0f} s on "
            f"{os.cpu_count()} CPU cores (1-minute load average "
            f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
            "end; other processes on the machine slow the runs and add noise "
            "to the timings).\n")
  pngs = plot(logs, outdir)
  if clusters:
    finished = [(run, *curves[run.name]) for run, m in finals
                if m is not None and run.name in curves]
    pngs.append(compare_pricing.plot_predicted_time(
        finished, prices, clusters, target, n, outdir))
  return table, pngs, total


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  checkpoint.quiet_orbax_logs()
  per_method_lr = _PER_METHOD_LR.value
  explicit_lr = [a for a in _OVERRIDES if a.startswith(
      ("--config.schedule.peak_lr", "--config.schedule.final_lr"))]
  if per_method_lr and explicit_lr:
    # An explicit learning rate wins over the tuned per-method table.
    print(f"note: {explicit_lr[0]} given, so every run uses the config's "
          "learning rates (--per_method_lr ignored)", flush=True)
    per_method_lr = False
  try:
    # Every arm's config, the device count and --outdir are checked before
    # JAX starts and the first run trains.
    base = config_lib.load_config(_CONFIG.value, _OVERRIDES)
    accum = base.optimizer.accum_steps  # a bad type is named by arm_configs
    if (isinstance(accum, numbers.Integral) and accum <= 1 and
        isinstance(base.n_workers, numbers.Integral)):
      accum = max(int(base.n_workers) // 2, 2)
    arms = arm_configs(base, accum, per_method_lr,
                       select_runs(_METHODS.value))
    clusters = compare_pricing.parse_clusters(_CLUSTERS.value)
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
  for line in overridden_fields(_OVERRIDES, [run for run, _ in arms]):
    print(f"note: {line}", file=sys.stderr)
  for line in dict.fromkeys(w for _, c in arms
                            for w in validation.config_warnings(c)):
    print(f"warning: {line}", file=sys.stderr)
  finals, logs, diverged = [], [], []
  start = time.perf_counter()
  load_before = os.getloadavg()[0]
  runs = [run for run, _ in arms]
  for i, (run, config) in enumerate(arms):
    workdir = os.path.join(outdir, run.name)
    try:
      final, reason = run_arm(run, config, workdir, _FRESH.value)
    except ValueError as e:  # bad data or work directory: all runs share it
      _fail(f"run {run.name!r} ({run.label}): {e}")
    except train.Preempted as e:  # SIGTERM/SIGINT: stop, 128 + signum
      print("preempted: " + preempted_message(
          e, run, runs[:i], runs[i + 1:], _FRESH.value), file=sys.stderr)
      sys.exit(e.exit_code)
    if reason is not None:
      diverged.append((run, reason))
    finals.append((run, final))
    logs.append((run, os.path.join(workdir, metrics_lib.METRICS_FILE)))
  # Runtime-model pricing of the finished runs (no training, milliseconds).
  prices = {run.name: compare_pricing.predicted_ms(config, clusters)
            for (run, config), (_, final) in zip(arms, finals)
            if final is not None}
  run_specs = {run.label: compare_pricing.method_spec(config)
               for run, config in arms}
  try:
    table, pngs, total = write_results(finals, logs, diverged, outdir, base,
                                       accum, per_method_lr, start,
                                       load_before, clusters, prices,
                                       run_specs)
  except OSError as e:
    _fail(f"cannot write the results to --outdir {outdir!r}: "
          f"{e.strerror or e} ({e.filename or outdir}).")
  print(table)
  print(f"table: {os.path.join(outdir, 'results.md')}")
  print(f"plots: {', '.join(pngs)}")
  print(f"logs:  {', '.join(path for _, path in logs)}")
  print(f"total: {total:.0f} s")
  if diverged:
    _fail(f"{len(diverged)} of {len(arms)} runs diverged: "
          + "; ".join(f"{run.name!r} ({run.label}): {reason}"
                      for run, reason in diverged)
          + "; the other runs' results are in "
          + os.path.join(outdir, "results.md") + ".", code=3)


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
