"""The main job's command-line flags, on a flag registry of its own.

:data:`FLAGS` is an ``absl.flags.FlagValues`` of this module alone (not
``absl.flags.FLAGS``), so the main job runs in the same process as any other
tool that defines flags of the same names (``--config``, ``--outdir``).
:func:`parse` reads an argument list into it and sets the
``--config.<field>=value`` overrides aside; :func:`job_settings` applies
``--full``'s defaults; :func:`help_text` is the ``--help`` text.

The default configs are the package's presets
(:mod:`decentral_jax.runner.presets`): ``gpt_quick`` (the quick job) and
``gpt_tiny`` (``--full``), the runs of ``configs/gpt_quick.py`` and
``configs/gpt_tiny.py``; an installed package needs no checkout.
"""

from __future__ import annotations

import re

from absl import flags as absl_flags

from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import presets
from decentral_jax.runtime_model import cluster_file
from decentral_jax.tools import flag_types
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.compare import runs
from decentral_jax.tools.runtime_model_cli import file_cluster

# The proxy of the quick default and of --full (keys of presets.PRESETS).
QUICK_CONFIG = "gpt_quick"
FULL_CONFIG = "gpt_tiny"
# The --help flags, answered by main (exit code 0).
HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")

FLAGS = absl_flags.FlagValues()
CONFIG = absl_flags.DEFINE_string(
    "config", QUICK_CONFIG, "Base config for all runs: FILE.py, "
    "FILE.py:ARG or a preset of the package (gpt_quick, gpt_tiny: "
    "decentral_jax.runner.presets, as configs/gpt_quick.py and "
    "configs/gpt_tiny.py); override its fields with "
    "--config.<field>=value. Default: gpt_quick (--full: gpt_tiny).",
    flag_values=FLAGS)
FULL = absl_flags.DEFINE_bool(
    "full", False, "The full study instead of the quick default: "
    "gpt_tiny (300 steps), the methods of FULL_METHODS, seeds "
    "0,1,2, checkpoints on (resumes after an interruption); --config, "
    "--methods, --seeds or --checkpoints given as well win.",
    flag_values=FLAGS)
SEEDS = absl_flags.DEFINE_string(
    "seeds", "", "Comma-separated seeds; every method runs once per seed "
    "(the recommendation then says whether the winner is outside the "
    "seeds' spread). Default: the config's seed (--full: 0,1,2).",
    flag_values=FLAGS)
CHECKPOINTS = absl_flags.DEFINE_bool(
    "checkpoints", False, "Write the config's periodic checkpoints and keep "
    "them (about 74 MB per gpt_tiny run). Default: none but the one SIGTERM "
    "or Ctrl-C saves to resume; a finished run's last checkpoint is "
    "deleted. On under --full.",
    flag_values=FLAGS)
WORKLOAD = absl_flags.DEFINE_string(
    "workload", "own", "Workload whose time per step the clusters are "
    "priced for: own (each cluster with compute of its own GPUs: figure6 "
    "on T4, A40, A100, gpt2_small on the H100 clusters), gpt2_small (124M "
    "parameters, 30.9 ms of H100 compute, on every cluster), 1b (1e9 "
    "parameters, 100 ms), figure6 (the paper's Transformer-base fitted "
    "to Figure 6; T4, A40, A100 only) or a workload FILE (an existing path, "
    "or a name ending in .json) read from a compiled train step (benchmarks/gpu_check.py --deviceless TARGET --workload "
    "FILE). Cluster files use their own measured workload unless a "
    "workload FILE is given.",
    flag_values=FLAGS)
CPU_TIMING = absl_flags.DEFINE_bool(
    "cpu_timing", False, "Also write this machine's CPU timings (ms/step, "
    "tokens/s columns and cpu_loss_vs_time_this_machine.png): "
    "load-dependent, compute overheads of simulated devices, not a "
    "ranking.",
    flag_values=FLAGS)
OUTDIR = absl_flags.DEFINE_string(
    "outdir", "results/compare",
    "Output directory. A run subdirectory left by an earlier invocation with "
    "the same config is reused (a finished run is kept, an interrupted one "
    "resumes from its checkpoint); any other is replaced.",
    flag_values=FLAGS)
FRESH = absl_flags.DEFINE_bool(
    "fresh", False, "Replace every run subdirectory of --outdir: train all "
    "runs from step 0 even where an earlier invocation finished them or "
    "left a checkpoint.",
    flag_values=FLAGS)
PER_METHOD_LR = absl_flags.DEFINE_bool(
    "per_method_lr", True,
    "Use each method's tuned peak lr for gpt_tiny (TUNED_PEAK_LR; "
    "BENCHMARKS.md) instead of config.schedule.peak_lr; an explicit "
    "--config.schedule.peak_lr or final_lr turns this default off (given "
    "with an explicit --per_method_lr, it is refused).",
    flag_values=FLAGS)
METHODS = absl_flags.DEFINE_string(
    "methods", ",".join(runs.DEFAULT_METHODS),
    "Comma-separated methods to run, in this order, or 'all'; see the "
    "module docstring for the list. Default: DEFAULT_METHODS (--full: "
    "FULL_METHODS).",
    flag_values=FLAGS)
CPU_DEVICES = absl_flags.DEFINE_integer(
    "cpu_devices", 0, "Simulated CPU devices; 0 = config.n_workers x "
    "config.devices_per_worker / config.workers_per_device.",
    lower_bound=0, upper_bound=config_lib.MAX_SIMULATED_CPU_DEVICES,
    flag_values=FLAGS)
CLUSTERS = absl_flags.DEFINE_string(
    "clusters", "A40,h100_node,cross_region_2dc",
    "Comma-separated clusters to price every run on with the runtime "
    "model: presets (T4, A40, A100, h100_node, h100_ib, cross_region_2dc, "
    "cross_region_4dc; docs/runtime_model.md) or cluster JSON files "
    "written by `python -m decentral_jax.runtime_model measure`; empty: no "
    "pricing.",
    flag_values=FLAGS)


#: The main job's flags that have an effect only with others, checked
#: once the clusters are read (:func:`check_needs`): ``--workload`` prices
#: the runs, so it needs a cluster it applies to (a preset; a cluster file
#: keeps its own measured workload unless ``--workload`` is a FILE.json).
NEEDS = (
    flag_types.Needs(
        "--workload", lambda clusters: bool(clusters),
        "without --clusters (--clusters= turns the pricing off)",
        "give --clusters=A40,h100_node or drop --workload"),
    flag_types.Needs(
        "--workload", lambda clusters: any(
            cl.workload_of(WORKLOAD.value) is not None for cl in clusters),
        "when every --clusters entry is a cluster file (each is priced "
        "with its own measured workload)",
        "add a preset to --clusters, give --workload=FILE.json, or drop "
        "--workload"),
)


def given() -> set:
  """The flags the last :func:`parse` read from the command line, e.g.
  ``{"--workload"}``."""
  return {f"--{name}" for name in FLAGS if FLAGS[name].present}


def check_needs(clusters) -> None:
  """Refuses a flag of :data:`NEEDS` given where it has no effect, with
  the clusters of ``--clusters`` read.

  Raises:
    ValueError: ``--workload has no effect without --clusters; ...``.
  """
  flag_types.check_needs(NEEDS, given(), clusters)


def check_measured_links(clusters, config) -> None:
  """Refuses a cluster file that the runs would be priced on with a link
  it never measured: predict's rule (``file_cluster.missing_links``) at
  :func:`pricing.priced_workers` GPUs. compare has no link flags, so no default
  link is assumed.

  Raises:
    ValueError: naming the ``--clusters`` entry, the link and the fix.
  """
  try:
    fields = builders.spec_for_config(config)[1]
  except ValueError:  # no spec: the runs are not priced (said per run)
    return
  for cl in clusters:
    n = pricing.priced_workers(cl, int(config.n_workers))
    if cl.preset is not None or isinstance(n, str):
      continue
    c = cluster_file.cluster(cl.data, n)
    got = file_cluster.missing_links(cl.data, c,
                                     fields.get("devices_per_worker", 1))
    if got is None:
      continue
    what = ("no inter-node link (measurements.inter_pair_s is null: one "
            f"node of {c.local_size})" if got[0] == "inter" else
            "no intra-node link (measurements.intra_pair_s is null: one "
            "device per node)")
    raise ValueError(
        f"--clusters entry {cl.path!r} measured {what}, but compare prices "
        f"the {config.n_workers}-worker runs at {n} GPUs ({n // c.local_size}"
        " nodes), which use it; measure that link (measure on the GPUs "
        "priced), " + (f"give --config.n_workers={c.local_size} (one node), "
                       if got[0] == "inter" else "") +
        "price a preset, or price an assumed link with `predict "
        f"--cluster {cl.path} {' '.join(f + ' X' for f in got[1])}`.")


def load_base(config: str, overrides=()):
  """The base config of ``--config``: a preset of
  :data:`decentral_jax.runner.presets.PRESETS` by name, else a config file
  (``FILE.py[:ARG]``), with the ``--config.<field>=value`` ``overrides``.

  Raises:
    ValueError: a missing or broken file or a bad override (one line).
  """
  return presets.load_named_or_file(config, overrides)


def _override_value(overrides, field: str) -> tuple[str, str] | None:
  """``(argument, value)`` of the last ``--config.<field>=value`` override,
  or None."""
  got = None
  for arg in overrides:
    name, _, value = arg[len("--config."):].partition("=")
    if name == field:
      got = (arg, value.strip())
  return got


def check_overrides(overrides=()) -> None:
  """Refuses the ``--config.<field>`` overrides the job would drop:
  ``--config.workdir`` (each run's work directory is ``--outdir/<run>``)
  and a nonzero ``--config.checkpoint_interval`` with ``--nocheckpoints``
  (which writes no periodic checkpoints), and ``--config.seed`` with
  ``--seeds`` (or ``--full``'s seeds), which set every run's seed, and an
  explicit ``--config.schedule.peak_lr`` or ``final_lr`` with an explicit
  ``--per_method_lr`` (the tuned per-method table).

  Raises:
    ValueError: one line naming the flags and the fix.
  """
  workdir = _override_value(overrides, "workdir")
  if workdir is not None:
    raise ValueError(f"{workdir[0]}: compare puts each run's work directory "
                     "in --outdir/<run>; drop --config.workdir and give "
                     "--outdir instead.")
  seed = _override_value(overrides, "seed")
  if seed is not None and (FLAGS["seeds"].present or FULL.value):
    seeds = (f"--seeds={SEEDS.value}" if FLAGS["seeds"].present
             else "--full's --seeds=0,1,2")
    raise ValueError(f"{seed[0]}: {seeds} sets every run's seed, so "
                     "config.seed is not used; give the seeds with --seeds "
                     "and drop --config.seed.")
  lr = (_override_value(overrides, "schedule.peak_lr")
        or _override_value(overrides, "schedule.final_lr"))
  if lr is not None and FLAGS["per_method_lr"].present and PER_METHOD_LR.value:
    raise ValueError(f"--per_method_lr runs each method at its tuned peak "
                     f"lr, but {lr[0]} sets every run's; drop one of the "
                     "two (without --per_method_lr the explicit lr wins).")
  interval = _override_value(overrides, "checkpoint_interval")
  if (interval is not None and FLAGS["checkpoints"].present
      and not CHECKPOINTS.value and interval[1] not in ("0", "0.0")):
    raise ValueError(f"--nocheckpoints writes no periodic checkpoints, but "
                     f"{interval[0]} asks for them; drop one of the two "
                     "(--checkpoints keeps the config's checkpoints).")


def job_settings(overrides=()) -> tuple[str, str, str, bool, str | None]:
  """``(config, methods, seeds, checkpoints, job)`` from :data:`FLAGS`
  and the ``--config.<field>=value`` ``overrides``.

  ``--full`` changes the defaults of ``--config``, ``--methods``,
  ``--seeds`` and ``--checkpoints``; each flag given explicitly wins (an
  explicit ``--config.checkpoint_interval`` turns checkpoints on).
  ``job`` is ``"quick"`` or ``"full"`` when the set-up is that job's
  default one (for the reference check), else None.

  Raises:
    ValueError: an override the job would drop (:func:`check_overrides`).
  """
  check_overrides(overrides)
  given = lambda name: FLAGS[name].present
  full = FULL.value
  config = CONFIG.value if given("config") else (
      FULL_CONFIG if full else QUICK_CONFIG)
  methods = METHODS.value if given("methods") else ",".join(
      runs.FULL_METHODS if full else runs.DEFAULT_METHODS)
  seeds = SEEDS.value if given("seeds") else ("0,1,2" if full else "")
  # An explicit --config.checkpoint_interval asks for checkpoints too.
  checkpoints = CHECKPOINTS.value if given("checkpoints") else (
      full or any(a.startswith("--config.checkpoint_interval")
                  for a in overrides))
  job = "full" if full else "quick"
  if (config != (FULL_CONFIG if full else QUICK_CONFIG)
      or overrides or not PER_METHOD_LR.value):
    job = None
  return config, methods, seeds, checkpoints, job


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
  """Reads ``argv`` (no program name) into :data:`FLAGS`: ``(positional,
  overrides)``, or one-line ValueError
  (:func:`decentral_jax.runner.config.parse_command_line`)."""
  return config_lib.parse_command_line(FLAGS, "compare", argv)


def wants_help(argv: list[str]) -> bool:
  """Whether ``argv`` asks for the help text (a flag of :data:`HELP_FLAGS`
  before any ``--``)."""
  for arg in argv:
    if arg == "--":
      return False
    if arg in HELP_FLAGS:
      return True
  return False


def help_text(doc: str, prog: str = "compare") -> str:
  """A usage line naming ``prog``, ``doc`` (the main job's description,
  its reStructuredText roles as plain names) and every flag's help."""
  plain = re.sub(r":[a-z]+:`~?\.?([^`]+)`", r"``\1``", doc.strip())
  return (f"usage: {prog} [--config=PRESET|FILE.py] [--outdir=DIR] "
          f"[--methods=...] [--config.FIELD=VALUE ...]\n\n{plain}\n\n"
          f"flags:\n{FLAGS.get_help()}\n")
