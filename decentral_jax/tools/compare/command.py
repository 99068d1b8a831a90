"""The main job's entry point: flags in, runs trained, results out.

:func:`main` parses the flags (:mod:`.flags`), checks every run's config,
the clusters and ``--outdir`` before anything trains (:func:`load_job`),
holds ``--outdir`` for the whole invocation, trains or keeps every run
(:mod:`.job`), prices the methods on the clusters (:mod:`.pricing`), checks
the losses against the stored reference (:mod:`.reference`) and writes and
prints the results (:mod:`.results`).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import time

from absl import flags as absl_flags
from absl import logging as absl_logging
import jax

from decentral_jax.runner import orbax_quiet
from decentral_jax.runner import devices as devices_lib
from decentral_jax.runner import validation
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools.compare import flags
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.compare import reference
from decentral_jax.tools.compare import results
from decentral_jax.tools.compare import runs as runs_lib


def load_job(config: str, methods: str, seeds: str, checkpoints: bool,
             per_method_lr: bool, overrides=()):
  """Every arm's config, the clusters, the device count and ``--outdir``,
  checked before JAX starts and the first run trains (bad input: one
  ``error:`` line, :class:`~.job.JobExit` 2).

  Returns:
    ``(base config, accum_steps, arms, workload, clusters, outdir)``.
  """
  try:
    base = flags.load_base(config, overrides)
    accum = base.optimizer.accum_steps  # a bad type is named by arm_configs
    if (isinstance(accum, numbers.Integral) and accum <= 1 and
        isinstance(base.n_workers, numbers.Integral)):
      accum = max(int(base.n_workers) // 2, 2)
    arms = runs_lib.job_arms(
        runs_lib.arm_configs(base, accum, per_method_lr,
                             runs_lib.select_runs(methods)),
        runs_lib.parse_seeds(seeds), checkpoints)
    workload = pricing.check_workload(flags.WORKLOAD.value)
    clusters = pricing.parse_clusters(flags.CLUSTERS.value, workload)
    flags.check_needs(clusters)
    flags.check_measured_links(clusters, base)
    # --cpu_devices wins over the environment's count (JAX_NUM_CPU_DEVICES,
    # XLA_FLAGS); without it a count the environment sets is kept.
    env = devices_lib.environment_cpu_devices()
    needed, source = devices_lib.devices_needed(base)
    if not flags.CPU_DEVICES.value and env is not None and \
        jax.default_backend() == "cpu":
      devices_lib.check_environment_devices(
          env, jax.local_device_count(), needed,
          source.replace("config.", "--config."))
    if flags.CPU_DEVICES.value or env is None:
      asked = flags.CPU_DEVICES.value
      devices_lib.check_asked_devices(  # below the config's count: refused
          asked, asked, needed, source.replace("config.", "--config."))
      devices = devices_lib.check_simulated_devices(
          asked or needed, f"--cpu_devices={asked}" if asked
          else source.replace("config.", "--config."))  # the flags typed
      jax.config.update("jax_num_cpu_devices", devices)
    outdir = job_lib.make_outdir(flags.OUTDIR.value)
    job_lib.check_data_files(arms, outdir)  # before run.lock is written
  except ValueError as e:
    job_lib.fail(e)
  return base, accum, arms, workload, clusters, outdir


def main(argv: list[str] | None = None,
         prog: str = "python -m decentral_jax.tools.compare") -> int:
  """Runs the main job on the command line ``argv`` (no program name;
  default ``sys.argv[1:]``); ``prog`` names the command in ``--help``.

  Returns:
    The exit code: 0 (also after ``--help``), 2 (bad input, one ``error:``
    line on stderr, before anything trains; or unwritable results), 3
    (runs diverged; the others' results are written), 128 + signum
    (stopped by SIGTERM/SIGINT after saving a checkpoint).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if flags.wants_help(argv):
    doc = sys.modules["decentral_jax.tools.compare"].__doc__ or ""
    print(flags.help_text(doc, prog), end="")
    return 0
  try:
    try:
      positional, overrides = flags.parse(argv)
    except ValueError as e:  # a flag: its list is in this command's help
      job_lib.fail(f"{e} (see {prog} --help)")
    if positional:
      job_lib.fail(f"unexpected arguments: {' '.join(positional)}")
    _run(overrides)
  except job_lib.JobExit as e:
    return e.code
  return 0


def _run(overrides: list[str]) -> None:
  """:func:`main` once the flags are parsed: loads and checks the job,
  holds ``--outdir`` and runs it."""
  if not absl_flags.FLAGS.is_parsed():  # as absl.app.run leaves them
    absl_flags.FLAGS.mark_as_parsed()
  absl_logging.use_absl_handler()
  orbax_quiet.quiet_orbax_logs()
  absl_logging.set_verbosity(absl_logging.WARNING)  # no per-step lines
  try:  # first: an explicit --per_method_lr with an explicit lr is refused
    config, methods, seeds, checkpoints, job = flags.job_settings(overrides)
  except ValueError as e:  # an override the job would drop
    job_lib.fail(e)
  per_method_lr = flags.PER_METHOD_LR.value
  explicit_lr = [a for a in overrides if a.startswith(
      ("--config.schedule.peak_lr", "--config.schedule.final_lr"))]
  if per_method_lr and explicit_lr:
    # An explicit learning rate wins over the default tuned table.
    print(f"note: {explicit_lr[0]} given, so every run uses the config's "
          "learning rates (--per_method_lr ignored)", flush=True)
    per_method_lr = False
  base, accum, arms, workload, clusters, outdir = load_job(
      config, methods, seeds, checkpoints, per_method_lr, overrides)
  methods_once = list({a.method.name: a.method for a in arms}.values())
  for line in runs_lib.overridden_fields(overrides, methods_once):
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
      job_lib.fail(f"--outdir {outdir!r}: {e}")
    _run_job(arms, outdir, checkpoints, job, base, accum, per_method_lr,
             clusters, workload)


def _run_job(arms, outdir, checkpoints, job, base, accum, per_method_lr,
             clusters, workload) -> None:
  """:func:`_run` once ``--outdir`` is held: trains every arm, writes and
  prints the results; :class:`~.job.JobExit` 2 (bad data or directory,
  unwritable results) or 3 (diverged runs)."""
  start, load_before = time.perf_counter(), os.getloadavg()[0]
  finals, diverged = job_lib.train_all(arms, outdir, checkpoints,
                                       flags.FRESH.value)
  # Runtime-model pricing of the methods (no training, milliseconds).
  prices = {}
  for a in arms:
    if a.method.name not in prices:
      prices[a.method.name] = pricing.predicted_ms(
          a.config, clusters, workload)
  losses = {f"{a.method.name}/seed{a.seed}": float(m["eval/loss"])
            for a, m in zip(arms, finals) if m is not None}
  reference_line = reference.reference_check(reference.load_reference(), job,
                                             losses)
  if reference_line.startswith("not checked"):  # the results are still written
    print(f"warning: reference check {reference_line}", file=sys.stderr)
  try:
    answer, lines, table, pngs, total = results.write_results(
        arms, finals, diverged, outdir, base, accum, per_method_lr, start,
        load_before, clusters, workload, prices, reference_line,
        flags.CPU_TIMING.value)
  except ValueError as e:  # a directory at a temporary name
    job_lib.fail(str(e))
  except OSError as e:
    job_lib.fail(f"cannot write the results to --outdir {outdir!r}: "
         f"{e.strerror or e} ({e.filename or outdir}).")
  print("\n" + (answer or table))
  if lines:
    named = {cl.workload_of(workload) for cl in clusters}
    files = None in named  # a cluster file: its own measured workload
    named.discard(None)
    shown = (named.pop() if len(named) == 1 else
             "of each cluster's own GPUs" if workload == pricing.OWN
             else workload)
    if files:
      shown = (f"{shown}; cluster files: their own measured workload"
               if named or len(clusters) > 1 else "the cluster file's own")
    print(f"recommendations (predicted, for workload {shown}):")
  for line in lines:
    print(f"  {line.replace('**', '')}")
  print(f"reference check: {reference_line}")
  print(f"table: {os.path.join(outdir, 'results.md')}\nplots: "
        f"{', '.join(pngs)}\ntotal: {total:.0f} s")
  if diverged:
    job_lib.fail(job_lib.diverged_message(diverged, len(arms),
                                  os.path.join(outdir, "results.md")), code=3)
