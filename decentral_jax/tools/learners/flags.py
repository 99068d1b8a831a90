"""The flags of ``decentral-jax learners`` and the run they describe.

:func:`parser` reads the command line; :data:`NEEDS` names the flags read
only with others; :func:`run_spec` turns the parsed flags (and ``--config``
with its ``--config.FIELD=VALUE`` overrides) into the
:class:`~decentral_jax.tools.learners.spec.RunSpec` both the synchronizer
and the learners run, refusing flags that would change nothing or that a
config sets instead (ValueError naming the flag, before Ray starts).
Used by :mod:`decentral_jax.tools.learners.main`.
"""

from __future__ import annotations

import argparse
import math
import os

from decentral_jax import checks
from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib

#: The command's one-line description (its ``--help``).
DESCRIPTION = ("``decentral-jax learners``: a synchronizer and ``K`` learners "
               "on Ray.")

# Bounds of the numeric flags (a value outside is refused at parsing).
_COUNT = flag_types.integer(1, 1024)
_PERIODS = flag_types.integer(1, flag_types.INT32_MAX)
_PERIODS_OR_0 = flag_types.integer(0, flag_types.INT32_MAX)
_STEPS = flag_types.integer(1, 1_000_000)
_STEPS_OR_0 = flag_types.integer(0, 1_000_000)
_SECONDS = flag_types.real(0, 86400, " s", open_lo=True)
_SECONDS_OR_0 = flag_types.real(0, 86400, " s")
_SLEEP = flag_types.real(0, spec_lib.MAX_SLEEP_S, " s")
_RUN_SECONDS = flag_types.real(0, 30 * 86400, " s", open_lo=True)
_LR = flag_types.real(0, 1e3, open_lo=True)
_FRACTION = flag_types.real(0, 1)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
  """The command's flags."""
  p = flag_types.Parser(prog=prog, description=DESCRIPTION)
  p.add_argument("--learners", type=_COUNT, default=2,
                 help="number of learners K (= data shards; default %(default)s)")
  p.add_argument("--periods", type=_PERIODS, default=None,
                 help="merged periods (outer steps) to run (default 10; "
                 "with --config: config.steps / config.sync_every; a fresh run "
                 "refuses one past --config.steps)")
  p.add_argument("--mode", choices=spec_lib.MODES, default="sync",
                 help="sync: merge when every active learner sent the "
                 "current version (DiLoCo); decoupled: merge once --quorum "
                 "arrived, learners keep stepping (default %(default)s)")
  p.add_argument("--config", default=None,
                 help="a runner config (preset or FILE.py[:ARG]) the "
                 "learners train, with --config.FIELD=VALUE overrides")
  p.add_argument("--workdir", default=None,
                 help="with --config: metrics.jsonl, config.json, "
                 "learners.json and checkpoints (resumed)")
  p.add_argument("--eval-every", type=_PERIODS, default=None,
                 help="with --workdir: evaluate seen periods N after the "
                 "last evaluated, and the last (default eval_interval // H)")
  p.add_argument("--problem", default=None,
                 choices=[n for n in problems.NAMES if n != "runner"],
                 help="without --config (default quadratic)")
  p.add_argument("--sync-every", type=_STEPS, default=None,
                 help="H inner steps (default 8; with --config: "
                 "config.sync_every)")
  p.add_argument("--inner", choices=spec_lib.INNER, default=None,
                 help="without --config (default sgd)")
  p.add_argument("--inner-lr", type=_LR, default=None,
                 help="without --config (default 0.1)")
  p.add_argument("--quorum", type=_COUNT, default=None,
                 help="pseudo-gradients needed per merge (default: all K "
                 "in sync mode, 1 in decoupled mode)")
  p.add_argument("--grace", type=_SECONDS_OR_0, default=0.5,
                 help="decoupled mode: seconds the synchronizer waits after "
                 "the quorum for the other active learners before it "
                 "merges (default %(default)s)")
  p.add_argument("--dynamic-updates", action="store_true",
                 help="H_w = floor(v_w / v_max * H) per learner")
  p.add_argument("--sleep", default="", help="comma-separated seconds "
                 "per inner step per learner (each in [0, 86400])")
  p.add_argument("--address", default=None,
                 help="HOST:PORT of a `ray start --head` node")
  p.add_argument("--connect-timeout", type=_SECONDS, default=10.0,
                 help="with --address: seconds to wait for the Ray head "
                 "node to accept a connection (default %(default)s)")
  p.add_argument("--checkpoint-dir", default=None,
                 help="the synchronizer's Orbax checkpoints (resumed)")
  p.add_argument("--kill-every", type=_PERIODS_OR_0, default=0,
                 help="SIGKILL a learner every N merged periods (0: never)")
  p.add_argument("--every", type=_SECONDS, default=1.0,
                 help="seconds between progress lines (default "
                 "%(default)s)")
  p.add_argument("--timeout", type=_RUN_SECONDS, default=3600.0,
                 help="seconds the whole run may take before it stops "
                 "with an error (default %(default)s)")
  p.add_argument("--json", default=None, help="write the run's log here")
  _outer_flags(p)
  return p


def _outer_flags(p: argparse.ArgumentParser) -> None:
  """Streaming DiLoCo fragments, the outer optimizer, the kept state."""
  p.add_argument("--fragments", type=_COUNT, default=1,
                 help="Streaming DiLoCo fragments P (each merged on its own)")
  p.add_argument("--overlap-steps", type=_STEPS_OR_0, default=0,
                 help="Streaming DiLoCo: inner steps between a fragment's "
                 "send and its merge")
  p.add_argument("--merge-alpha", type=_FRACTION, default=0.0,
                 help="Streaming DiLoCo: x_p <- alpha x_p + (1-alpha) theta_p")
  p.add_argument("--outer", choices=spec_lib.OUTER, default="nesterov",
                 help="outer optimizer (delayed_nesterov: Async Local-SGD)")
  p.add_argument("--delay-buffer", type=_STEPS, default=None,
                 help="Delayed Nesterov's buffer N > 1: merges per momentum "
                 "step (only and always with --outer delayed_nesterov)")
  p.add_argument("--drop-state", action="store_true",
                 help="learners do not send their inner optimizer state and "
                 "error feedback residual (a restarted learner starts them "
                 "afresh; saves their bytes each period)")


#: Flags read only with others (:func:`flag_types.check_needs`).
NEEDS = (
    flag_types.Needs("--eval-every", lambda a: a.workdir is not None,
                     "without --workdir (it evaluates into DIR/metrics."
                     "jsonl)", "add --workdir DIR or drop --eval-every"),
    flag_types.Needs("--grace", lambda a: a.mode == "decoupled",
                     "in --mode sync (a merge waits for every active "
                     "learner)", "use --mode decoupled or drop --grace"),
    flag_types.Needs("--grace", lambda a: (a.quorum or 1) != a.learners,
                     "with --quorum equal to --learners (the default "
                     "quorum 1 with --learners 1): a merge needs every "
                     "learner's pseudo-gradient, so it never waits", "give "
                     "--quorum below --learners or drop --grace"),
    flag_types.Needs("--dynamic-updates", lambda a: a.learners > 1,
                     "with --learners 1 (H_w = floor(v_w / v_max * H) is H "
                     "when the one learner is the fastest)", "give "
                     "--learners 2 or more or drop --dynamic-updates"),
    flag_types.Needs("--connect-timeout", lambda a: a.address is not None,
                     "without --address (the Ray started on this machine "
                     "is not waited for)", "add --address HOST:PORT or drop "
                     "--connect-timeout"),
    flag_types.Needs("--delay-buffer", lambda a: a.outer == "delayed_nesterov",
                     "with --outer nesterov (Nesterov SGD steps at every "
                     "merge, it has no buffer)", "add --outer "
                     "delayed_nesterov or drop --delay-buffer"),
    flag_types.Needs("--drop-state", lambda a: a.config is not None or (
        a.inner or "sgd") != "sgd", "with --inner sgd and no --config (SGD "
                     "keeps no state and there is no compressor residual: "
                     "nothing is sent either way)", "use --inner adamw or "
                     "drop --drop-state"),
)


def check_outputs(args) -> None:
  """``--json`` a writable file, ``--workdir`` and ``--checkpoint-dir``
  usable directories (checked before Ray starts; ValueError names the
  flag)."""
  flag_types.check_output_file(args.json, "--json")
  flag_types.check_output_dir(args.workdir, "--workdir")
  flag_types.check_output_dir(args.checkpoint_dir, "--checkpoint-dir")


def _check_flags(args) -> None:
  """Each numeric flag finite and in its range, ``--address`` HOST:PORT
  (:func:`flag_types.host_port`), and ``--outer
  delayed_nesterov`` with a buffer above 1 (ValueError names the flag)."""
  ranges = (("--inner-lr", args.inner_lr, 0.0, True),
            ("--grace", args.grace, 0.0, False),
            ("--connect-timeout", args.connect_timeout, 0.0, True),
            ("--every", args.every, 0.0, True),
            ("--timeout", args.timeout, 0.0, True),
            ("--kill-every", args.kill_every, 0, False))
  for flag, value, lo, open_lo in ranges:
    if not (math.isfinite(value) and (value > lo if open_lo else value >= lo)):
      raise ValueError(f"{flag}={value!r} must be a finite number "
                       f"{'>' if open_lo else '>='} {lo} (e.g. {flag}=1).")
  if args.outer == "delayed_nesterov" and (args.delay_buffer or 1) == 1:
    raise ValueError(
        "--outer delayed_nesterov with --delay-buffer 1 (the default) is "
        "Nesterov SGD, the default --outer nesterov (the momentum steps at "
        "every merge); give --delay-buffer N > 1 (merges per momentum step, "
        "e.g. --delay-buffer 4) or drop --outer delayed_nesterov.")
  if args.address is not None:
    flag_types.host_port(args.address, "--address")
  if args.quorum is not None and args.quorum < 1:
    raise ValueError(f"--quorum={args.quorum} must be >= 1 (learners whose "
                     "pseudo-gradients a merge needs); leave it unset for "
                     "the mode's default.")


def _sleep(args) -> tuple[float, ...]:
  """``--sleep``: one number of seconds in ``[0, MAX_SLEEP_S]`` per learner
  (:data:`~decentral_jax.tools.learners.spec.MAX_SLEEP_S`), or none (an
  empty value); an empty entry (a stray comma) is refused by its position
  (:func:`decentral_jax.checks.comma_entries`)."""
  k = args.learners
  example = ("--sleep=" + ",".join(["0"] * (k - 1) + ["0.05"]) if k <= 4
             else f"--sleep=0,0,...,0.05 ({k} values)")
  sleep = []
  for i, entry in enumerate(checks.comma_entries(
      "--sleep", args.sleep, "seconds (one per learner)", example)):
    try:
      sleep.append(_SLEEP(entry))
    except argparse.ArgumentTypeError as e:
      raise ValueError(f"--sleep={args.sleep!r}: entry {i + 1} {e}; give "
                       f"seconds per inner step, e.g. {example}.") from None
  if sleep and len(sleep) != args.learners:
    raise ValueError(f"--sleep has {len(sleep)} values for --learners="
                     f"{args.learners}; give one per learner, e.g. "
                     f"{example}.")
  return tuple(sleep)


def _check_data_not_written(c, args) -> None:
  """``config.data.path`` is no file the run writes in ``--workdir``
  (the runner's run files and ``learners.json``) or ``--checkpoint-dir``
  (any entry: the synchronizer's Orbax directory); ValueError names the
  flag (:func:`decentral_jax.runner.data_files.check_not_written`)."""
  from decentral_jax.runner import data_files  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import records  # pylint: disable=import-outside-toplevel
  if args.workdir is not None:
    data_files.check_not_written(
        c, args.workdir, (*train.RUN_FILES, records.META_FILE + "*"),
        "--workdir")
  if args.checkpoint_dir is not None:
    data_files.check_not_written(c, args.checkpoint_dir, ("*",),
                                 "--checkpoint-dir")


# Flags a runner config sets instead (--config): flag -> config field.
CONFIG_SETS = {"problem": "", "sync_every": "sync_every", "inner":
               "optimizer.name", "inner_lr": "schedule.peak_lr"}


def _config_fields(args, overrides) -> dict:
  """The RunSpec fields of ``--config`` and its overrides (ValueError: a
  flag the config sets instead, or the config's own one-line errors)."""
  if args.config is None:
    if overrides:
      raise ValueError(f"{overrides[0]} needs --config (a runner config to "
                       "override).")
    if args.workdir is not None:
      raise ValueError("--workdir needs --config (the runner's records of a "
                       "runner config).")
    return {"problem": args.problem or "quadratic",
            "sync_every": args.sync_every or 8, "inner": args.inner or "sgd",
            "inner_lr": 0.1 if args.inner_lr is None else args.inner_lr,
            "periods": args.periods or 10}
  if args.eval_every is not None and args.eval_every < 1:
    raise ValueError(f"--eval-every={args.eval_every} must be >= 1 (merged "
                     "periods between evaluations).")
  for flag, field in CONFIG_SETS.items():
    if getattr(args, flag) is not None:
      fix = f"set --config.{field}" if field else "drop it"
      raise ValueError(f"--{flag.replace('_', '-')} does not apply with "
                       f"--config (the config sets it): {fix}.")
  from decentral_jax.tools.learners import runner_problem  # pylint: disable=import-outside-toplevel
  runner_problem.check_evaluation_overrides(
      overrides, args.workdir is not None, args.eval_every is not None)
  source = config_source(args.config)
  c = runner_problem.load(source, overrides, args.learners)
  _check_data_not_written(c, args)
  fields = runner_problem.spec_fields(c)
  del fields["shards"]
  args.data_path = c.data.get("path")  # an input --json may not replace
  args.config_steps = int(c.steps) if any(  # preflight: --periods' match
      o[len("--config."):].partition("=")[0].strip() == "steps"
      for o in overrides) else None
  if args.periods is not None:
    fields["periods"] = args.periods
  return {"problem": "runner", "problem_args": (
      ("config", source), ("overrides", tuple(overrides))), **fields}


def config_source(config: str) -> str:
  """``--config`` with a file path made absolute (learners started by Ray
  elsewhere read the same file); a preset name as given."""
  path, sep, arg = config.partition(":")
  return os.path.abspath(path) + sep + arg if os.path.isfile(path) else config


def run_spec(args, overrides=()) -> spec_lib.RunSpec:
  """The :class:`RunSpec` of the parsed flags and ``--config.FIELD=VALUE``
  overrides (ValueError names a field or flag)."""
  fields = _config_fields(args, list(overrides))
  if args.inner_lr is None:
    args.inner_lr = fields.get("inner_lr", 0.1)
  _check_flags(args)
  sleep = _sleep(args)
  try:
    run = spec_lib.RunSpec(
        shards=args.learners, mode=args.mode, grace_s=args.grace,
        quorum=args.quorum or (args.learners if args.mode == "sync" else 1),
        dynamic_updates=args.dynamic_updates, sleep_s=sleep,
        fragments=args.fragments, overlap_steps=args.overlap_steps,
        merge_alpha=args.merge_alpha, outer=args.outer,
        delay_buffer=1 if args.delay_buffer is None else args.delay_buffer,
        keep_state=not args.drop_state, **fields)
  except ValueError as e:
    raise ValueError(spec_lib.flag_words(
        str(e), args.config is not None)) from None
  _check_kill_every(args, run)
  _check_dynamic_updates(args, run)
  return run


def _check_dynamic_updates(args, run: spec_lib.RunSpec) -> None:
  """``--dynamic-updates`` with a sync period ``H = 1`` (from
  ``--sync-every`` or ``config.sync_every``) is refused as the flag with
  ``--learners 1`` is: ``H_w = max(1, floor(v_w / v_max * H))`` is 1 for
  every learner, so it changes nothing (ValueError, one line)."""
  if not args.dynamic_updates or run.sync_every != 1:
    return
  given = ("config.sync_every = 1" if args.config is not None
           else "--sync-every 1")
  fix = ("set --config.sync_every=2 or more" if args.config is not None
         else "give --sync-every 2 or more")
  raise ValueError(flag_types.Needs(
      "--dynamic-updates", lambda a: False,
      f"with {given} (H_w = max(1, floor(v_w / v_max * H)) is 1 for every "
      "learner when H = 1)", f"{fix} or drop --dynamic-updates").message())


def _check_kill_every(args, run: spec_lib.RunSpec) -> None:
  """``--kill-every N`` kills a learner at merged periods ``N, 2N, ...``
  before the last: ``N >= periods`` never does (ValueError names both)."""
  if not args.kill_every or args.kill_every < run.periods:
    return
  given = (f"--periods {run.periods}" if args.periods is not None else
           f"--periods' default {run.periods}" + (
               ", config.steps / config.sync_every" if args.config else ""))
  raise ValueError(
      f"--kill-every {args.kill_every} never kills a learner: the run ends "
      f"after {run.periods} merged periods ({given}); use --kill-every "
      f"below {run.periods}, more --periods, or drop --kill-every.")


