"""``decentral-jax learners``: a synchronizer and ``K`` learners on Ray.

::

  decentral-jax learners --learners 4 --periods 20 --mode decoupled \\
    --problem gpt --quorum 3 --grace 1.0 --sleep 0,0,0,0.05

starts Ray on this machine (bound to 127.0.0.1) or, with ``--address
HOST:PORT``, attaches to a cluster started by ``ray start --head``; runs
the synchronizer and one learner per data shard as actors; prints one
progress line per ``--every`` seconds (merged periods, and for each learner
its version, inner steps, tokens and longest sync wait) and a summary.
``--kill-every N`` SIGKILLs one learner (round robin) every ``N`` merged
periods, to watch Ray restart it and the run go on. ``--json FILE`` writes
the synchronizer's log and the learners' counters.

With ``--config configs/gpt_tiny.py[:ARG]`` (a preset name or a config
file, and ``--config.FIELD=VALUE`` overrides, as ``decentral-jax train``
reads them) the learners train the runner's config: its model, data shards
(``n_workers = --learners``), inner optimizer and schedule, sync period,
outer step and compression
(:mod:`decentral_jax.tools.learners.runner_problem`); ``--workdir DIR``
then holds the runner's ``metrics.jsonl`` and ``config.json``,
``learners.json`` and the synchronizer's checkpoints (``DIR/checkpoints``,
resumed, also with another ``--learners``)
(:mod:`decentral_jax.tools.learners.records`).

Output paths (``--json``, ``--workdir``, ``--checkpoint-dir``; ``--json``
none of the files the run reads or keeps), and flags that would change
nothing (``--eval-every`` without ``--workdir``, ``--dynamic-updates`` with
``--learners 1``, ``--grace`` in sync mode or with ``--quorum`` equal to ``--learners``,
``--drop-state`` with ``--inner sgd`` and no ``--config``,
``--connect-timeout`` without ``--address``,
``--delay-buffer`` with ``--outer nesterov``, ``--outer delayed_nesterov``
without ``--delay-buffer`` above 1, ``--kill-every`` not below the run's
periods) are refused before Ray starts.

Exit codes: 0; 1 for Ray missing, an unreachable ``--address``, a run
that did not finish within ``--timeout`` or one whose learners all stopped
with an error (one ``error:`` line); 2 for bad flags, a problem or a
resume the synchronizer would refuse, or damaged records (checked before
Ray starts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from decentral_jax import checks
from decentral_jax.runner import config as config_lib
from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib

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
  p = flag_types.Parser(prog=prog, description=__doc__.split("\n")[0])
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
                 help="with --workdir: evaluate theta every N merged "
                 "periods (default: config.eval_interval // sync_every)")
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
  """Each numeric flag finite and in its range, and ``--outer
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
  return run


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


def preflight(run: spec_lib.RunSpec, checkpoint_dir: str | None,
              workdir: str | None, config_steps: int | None = None) -> None:
  """What the synchronizer and the run directory would refuse, checked
  before Ray starts: the problem builds and fits ``fragments``, the
  checkpoint to resume was written by the same run
  (:func:`~decentral_jax.tools.learners.synchronizer.check_run`), and the
  run directory's records read back; records of merged periods without a
  checkpoint to resume them from are refused (the run would restart from
  period 0 under them). A fresh run (nothing to resume) whose ``--periods``
  runs past an explicit ``--config.steps`` (``config_steps``; None: not
  given) is refused too: ``periods * sync_every`` may not exceed it (fewer
  stops the run early, to be resumed; a resume may extend a run past its
  steps with ``--periods``).

  Raises:
    ValueError, OSError: naming the field, flag, checkpoint or file.
  """
  from decentral_jax.tools.learners import records as records_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import synchronizer  # pylint: disable=import-outside-toplevel
  recorded = 0 if workdir is None else records_lib.check_workdir(workdir)
  fresh = synchronizer.check_run(run, checkpoint_dir) is None
  if fresh and recorded:
    raise ValueError(
        f"--workdir {workdir} records merged periods (up to inner step "
        f"{recorded}) but {checkpoint_dir} holds no checkpoint to resume "
        "them from (the checkpoints are gone); start a new --workdir.")
  h = run.sync_every
  if fresh and config_steps is not None and run.periods * h > config_steps:
    raise ValueError(
        f"--periods {run.periods} runs {run.periods} * config.sync_every "
        f"{h} = {run.periods * h} inner steps, past --config.steps="
        f"{config_steps} (the steps the schedule runs over); drop --periods "
        f"(then {config_steps // h} periods), give at most "
        f"{config_steps // h} to stop early, or raise --config.steps.")


def progress_line(status: dict, learners: dict, seen=None) -> str:
  """One line: merged periods and each learner's state (None: not
  answering: ``starting``, or ``restarting`` once it was in ``seen``, the
  ids that answered before; without ``seen`` every one had; :data:`DEAD`:
  its process died and Ray will not restart it)."""
  parts = [f"period {status['version']}/{status['periods']}"]
  for i, s in sorted(learners.items()):
    if s is DEAD:
      parts.append(f"L{i} dead")
      continue
    if s is None:
      was = seen is None or i in seen
      parts.append(f"L{i} {'restarting' if was else 'starting'}")
      continue
    wait = max(s["waits"], default=0.0)
    parts.append(f"L{i} v{s['version']} steps {s['steps']} tokens "
                 f"{s['tokens']} max wait {wait:.2f}s"
                 + (f" error {s['error']}" if s["error"] else ""))
  return " | ".join(parts)


# A learner whose actor died for good (its Ray restarts used up).
DEAD = "dead"


class Stalled(RuntimeError):
  """A run that cannot progress: every learner stopped with an error."""


def stalled(learners: dict) -> str | None:
  """Why the run cannot progress (None: it may): every learner stopped
  with an error (a learner's thread ends on its error; Ray restarts only a
  dead process) or died for good (:data:`DEAD`), naming each one's."""
  if not learners or any(s is None or (s is not DEAD and not s.get("error"))
                         for s in learners.values()):
    return None
  errors = "; ".join(
      f"learner {i}: " + ("its process died and Ray will not restart it"
                          if s is DEAD else s["error"])
      for i, s in sorted(learners.items()))
  return f"every learner stopped with an error, the run cannot progress ({errors})"


def _learner_states(c) -> dict:
  out = {}
  for i, handle in c.learners.items():
    try:
      out[i] = c._ray.get(handle.status.remote(), timeout=1.0)  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-exception-caught
      out[i] = DEAD if type(e).__name__ == "ActorDiedError" else None
  return out


def _drive(c, args, records=None) -> dict:
  """Polls until the run ends, printing progress, killing on schedule,
  writing the run directory's records (``records``: a
  :class:`~decentral_jax.tools.learners.records.RunRecords`)."""
  last, kills, seen = 0.0, 0, set()
  deadline = time.monotonic() + args.timeout
  while True:
    status = c.status()
    if records is not None:
      records.update(status, lambda: _theta(c), c.status)
    if time.monotonic() - last >= args.every or status["done"]:
      states = _learner_states(c)
      print(progress_line(status, states, seen), flush=True)
      seen |= {i for i, s in states.items() if s is not None}
      last = time.monotonic()
      why = None if status["done"] else stalled(states)
      if why:
        raise Stalled(why)
    if status["done"]:
      return status
    if (args.kill_every and status["version"] >= (kills + 1) * args.kill_every
        and status["version"] < status["periods"]):
      pid = c.kill(kills % args.learners)
      print(f"killed learner {kills % args.learners} (pid {pid})", flush=True)
      kills += 1
    if time.monotonic() > deadline:
      raise TimeoutError(f"{status['version']} of {status['periods']} "
                         f"periods merged within --timeout {args.timeout:g} s")
    time.sleep(0.05)


def _theta(c) -> tuple[int, dict]:
  params = c.params()
  return params["version"], params["theta"]


def _resume(c, run, args) -> dict:
  """A synchronizer resumed from its checkpoint: learners of a former,
  larger ``K`` leave its active set; ``periods`` is this invocation's when
  given (``--periods``, or ``--config``'s). Returns its status."""
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  if args.periods is not None or args.config is not None:
    c.set_periods(run.periods)
  status = c.status()
  ray = cluster.require_ray()
  for w in status["active"]:
    if w >= run.shards:  # a resume with fewer learners
      ray.get(c.synchronizer.leave.remote(w))
  return status


def _open_records(c, run, args, overrides):
  """The run directory of ``--workdir`` (None without), from the
  synchronizer's restored period on."""
  status = _resume(c, run, args)
  if args.workdir is None:
    return None
  from decentral_jax.tools.learners import records as records_lib  # pylint: disable=import-outside-toplevel
  task = problems.build(run.problem, run.shards, run.problem_args).runner
  every = args.eval_every or max(1, int(task.config.eval_interval)
                                 // run.sync_every)
  records = records_lib.RunRecords(args.workdir, task, run, args.config,
                                   overrides, every)
  seg = records.begin(status["version"], _theta(c)[1])
  print(f"{args.workdir}: period {status['version']}, {run.shards} "
        f"learners; sharding {seg['sharding']}", flush=True)
  return records


def describe(run: spec_lib.RunSpec) -> str:
  """One line naming the run's method from its fields (with ``--config``
  the config's, :func:`~decentral_jax.tools.learners.runner_problem.
  spec_fields`): the mode, the learners and sync period, the inner
  optimizer and its learning rate (a schedule's peak and the schedule),
  the outer optimizer, fragments and compression."""
  outer = (f"delayed Nesterov (buffer {run.delay_buffer})"
           if run.outer == "delayed_nesterov" else "Nesterov")
  inner = f"inner {run.inner} lr {run.inner_lr:g}"
  if run.inner_schedule != "constant":
    inner = (f"inner {run.inner} peak lr {run.inner_lr:g} "
             f"({run.inner_schedule})")
  parts = [f"{run.mode}, {run.shards} learners, H={run.sync_every}", inner,
           f"outer {outer} lr {run.outer_lr:g} momentum "
           f"{run.outer_momentum:g}"]
  if run.streaming:  # Streaming DiLoCo's schedule, one fragment included
    parts.append(f"Streaming: {run.fragments} fragment"
                 f"{'s' * (run.fragments > 1)} (tau={run.overlap_steps}, "
                 f"alpha={run.merge_alpha:g})")
  if run.compressor != "none":
    parts.append(f"{run.compressor} pseudo-gradients")
  return "run: " + ", ".join(parts)


def distance_to_optimum(run: spec_lib.RunSpec, theta: dict) -> float | None:
  """``||theta - x*||`` (float64 over every leaf) for a problem whose
  minimizer ``x*`` of the mean loss is known (the quadratic: ``mean_i
  b_i``), else None."""
  if run.problem != "quadratic":
    return None
  best = problems.build(run.problem, run.shards, run.problem_args).optimum
  return float(np.sqrt(sum(np.sum((np.asarray(theta[k], np.float64)
                                   - best[k]) ** 2) for k in best)))


def _summary(status, seconds, learners, args, run, theta) -> None:
  tokens = sum(sum(t.values()) for t in status["log"]["tokens"])
  print(describe(run))
  dist = distance_to_optimum(run, theta)
  if dist is not None:
    print(f"distance to the optimum ||theta - mean_i b_i||: {dist:.4g}")
  print(f"{status['version']} periods merged in {seconds:.1f} s; "
        f"{tokens} tokens merged ({tokens / seconds:.1f} tokens/s); "
        f"{len(status['log']['rejected'])} pseudo-gradients rejected")
  if args.json:
    flag_types.write_output(args.json, "--json", lambda f: json.dump(
        {"run": run.trajectory(), "status": status, "learners": learners,
         "seconds": seconds, "distance_to_optimum": dist}, f, indent=1,
        default=str), kept="the summary above was printed" + (
            f" and the run's records are in --workdir {args.workdir}"
            if args.workdir else ""))


def main(argv=None, prog: str | None = None) -> int:
  """Runs the command; returns its exit code."""
  argv = sys.argv[1:] if argv is None else list(argv)
  rest, overrides = config_lib.split_overrides(["learners", *argv])
  p = parser(prog)
  args = p.parse_args(rest[1:])
  try:
    flag_types.check_needs(NEEDS, flag_types.given_flags(p, rest[1:]), args)
    check_outputs(args)
    run = run_spec(args, overrides)
    from decentral_jax.tools.learners import records as records_lib  # pylint: disable=import-outside-toplevel
    records_lib.check_json_output(args.json, args.config, getattr(
        args, "data_path", None), args.workdir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  checkpoint_dir = args.checkpoint_dir
  if checkpoint_dir is None and args.workdir is not None:
    checkpoint_dir = os.path.join(args.workdir, "checkpoints")
  try:
    preflight(run, checkpoint_dir, args.workdir,
              getattr(args, "config_steps", None))
  except (ValueError, OSError) as e:
    why = str(e)
    if isinstance(e, ValueError) and why.startswith("RunSpec."):
      why = spec_lib.flag_words(why, args.config is not None)
    print(f"error: {why}", file=sys.stderr)
    return 2
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  try:
    cluster.start(args.address, timeout_s=args.connect_timeout)
    c = cluster.Cluster(run, checkpoint_dir)
  except (ImportError, ConnectionError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  start, records = time.monotonic(), None
  try:
    records = _open_records(c, run, args, overrides)
    for i in range(args.learners):
      c.add(i)
    status = _drive(c, args, records)
    learners = c.learner_status()
    theta = _theta(c)[1]
  except (TimeoutError, Stalled) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  finally:
    c.close()
    if records is not None:
      records.close()
  _summary(status, time.monotonic() - start, learners, args, run, theta)
  return 0
