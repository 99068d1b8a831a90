"""``decentral-jax learners``: a synchronizer and ``K`` learners on Ray.

::

  decentral-jax learners --learners 4 --periods 20 --mode decoupled \\
    --problem gpt --quorum 3 --grace 1.0 --sleep 0,0,0,0.05

starts Ray on this machine (bound to 127.0.0.1) or, with ``--address
HOST:PORT``, attaches to a cluster started by ``ray start --head``; runs
the synchronizer and one learner per data shard as actors; prints one
progress line per ``--every`` seconds (merged periods, and for each learner
its version, inner steps, tokens and longest sync wait) and a summary.
``--kill-every N`` SIGKILLs one learner (round robin) at every merged
period ``N, 2N, ...`` below the run's periods (held there by the
synchronizer until killed: :func:`next_kill`), to watch Ray restart it and
the run go on. ``--json FILE`` writes
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
none of the files the run reads or keeps nor in the checkpoint directory,
which is none of those files), and flags that would change
nothing (``--eval-every`` without ``--workdir``, ``--dynamic-updates`` with
``--learners 1`` or a sync period of 1, ``--grace`` in sync mode or with ``--quorum`` equal to ``--learners``,
``--drop-state`` with ``--inner sgd`` and no ``--config``,
``--connect-timeout`` without ``--address``,
``--delay-buffer`` with ``--outer nesterov``, ``--outer delayed_nesterov``
without ``--delay-buffer`` above 1, ``--kill-every`` not below the run's
periods) are refused before Ray starts.

Exit codes: 0; 1 for Ray missing, an unreachable ``--address``, a run
that did not finish within ``--timeout``, one whose learners all stopped
with an error or one that made fewer ``--kill-every`` kills than due (one
``error:`` line); 2 for bad flags, a problem or a
resume the synchronizer would refuse, or damaged records (checked before
Ray starts).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from decentral_jax.runner import config as config_lib
from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import flags as flags_lib
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib

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


def next_kill(c, args, version: int, periods: int) -> int | None:
  """The merged period of ``--kill-every``'s next kill after ``version``
  (the next multiple of ``N`` below ``periods``; None: no more), held
  there by the synchronizer (:meth:`Cluster.hold`) so that no kill is
  skipped however fast periods merge; no kill: the hold is released."""
  n = args.kill_every
  due = (version // n + 1) * n if n else None
  due = due if due is not None and due < periods else None
  if n:
    c.hold(due)
  return due


def _drive(c, args, records=None) -> dict:
  """Polls until the run ends, printing progress, killing on schedule
  (one learner, round robin, at each merged period of :func:`next_kill`),
  writing the run directory's records (``records``: a
  :class:`~decentral_jax.tools.learners.records.RunRecords`). Returns the
  synchronizer's status with ``"kills"``: ``[made, due]``."""
  last, kills, seen = 0.0, 0, set()
  deadline = time.monotonic() + args.timeout
  first = c.status()
  due = next_kill(c, args, first["version"], first["periods"])
  owed = len(range(due, first["periods"], args.kill_every)) if due else 0
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
      return {**status, "kills": [kills, owed]}
    if due is not None and status["version"] >= due:
      pid = c.kill(kills % args.learners)
      print(f"killed learner {kills % args.learners} (pid {pid}) at merged "
            f"period {status['version']}", flush=True)
      kills += 1
      due = next_kill(c, args, status["version"], status["periods"])
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


def never_merged(log: dict, shards: int) -> list[int]:
  """The learners ``0 .. shards-1`` whose pseudo-gradient entered no merge
  of the synchronizer's ``log`` (neither a period's ``merged_with`` nor a
  fragment's merge). A ``--quorum`` below the learners lets merges go on
  without a learner still starting (``sync`` waits only for the active
  ones), so a short run can end before it joins."""
  seen = {int(w) for ws in log.get("merged_with", ()) for w in ws}
  seen |= {int(w) for entry in log.get("fragments", ()) for w in entry[2]}
  return [w for w in range(int(shards)) if w not in seen]


def merge_warning(log: dict, shards: int) -> str | None:
  """One ``warning:`` line naming the learners :func:`never_merged` (the
  merged ``theta`` is of the others only), or None."""
  missing = never_merged(log, shards)
  if not missing:
    return None
  names = ", ".join(map(str, missing))
  merges = len(log.get("merged_with", ()))
  return (f"warning: learner{'s' * (len(missing) > 1)} {names} of {shards} "
          f"never merged (none of its pseudo-gradients entered the {merges} "
          "merges): the result is of the other learners only; leave "
          "--quorum unset (sync: every learner) or run more periods.")


def _summary(status, seconds, learners, args, run, theta) -> None:
  tokens = sum(sum(t.values()) for t in status["log"]["tokens"])
  print(describe(run))
  dist = distance_to_optimum(run, theta)
  if dist is not None:
    print(f"distance to the optimum ||theta - mean_i b_i||: {dist:.4g}")
  print(f"{status['version']} periods merged in {seconds:.1f} s; "
        f"{tokens} tokens merged ({tokens / seconds:.1f} tokens/s); "
        f"{len(status['log']['rejected'])} pseudo-gradients rejected")
  warning = merge_warning(status["log"], run.shards)
  if warning:
    print(warning)
  if args.json:
    flag_types.write_output(args.json, "--json", lambda f: json.dump(
        {"run": run.trajectory(), "status": status, "learners": learners,
         "seconds": seconds, "distance_to_optimum": dist,
         "never_merged": never_merged(status["log"], run.shards)}, f,
        indent=1, default=str), kept="the summary above was printed" + (
            f" and the run's records are in --workdir {args.workdir}"
            if args.workdir else ""))


def _checked_args(argv: list[str], prog: str | None):
  """The parsed flags, the ``--config.*`` overrides, the run spec and the
  checkpoint directory, every flag checked before Ray starts.

  Raises:
    ValueError: a bad flag, override, output or checkpoint (one line).
    OSError: a checkpoint directory that cannot be read.
  """
  rest, overrides = config_lib.split_overrides(["learners", *argv])
  p = flags_lib.parser(prog)
  args = p.parse_args(rest[1:])
  flag_types.check_needs(flags_lib.NEEDS, flag_types.given_flags(
      p, rest[1:]), args)
  flags_lib.check_outputs(args)
  run = flags_lib.run_spec(args, overrides)
  from decentral_jax.tools.learners import records as records_lib  # pylint: disable=import-outside-toplevel
  records_lib.check_json_output(args.json, args.config, getattr(
      args, "data_path", None), args.workdir, args.checkpoint_dir)
  checkpoint_dir = args.checkpoint_dir
  if checkpoint_dir is None and args.workdir is not None:
    checkpoint_dir = os.path.join(args.workdir, "checkpoints")
  try:
    preflight(run, checkpoint_dir, args.workdir,
              getattr(args, "config_steps", None))
  except ValueError as e:
    why = str(e)
    if why.startswith("RunSpec."):
      raise ValueError(spec_lib.flag_words(why, args.config is not None)
                       ) from None
    raise
  return args, overrides, run, checkpoint_dir


def main(argv=None, prog: str | None = None) -> int:
  """Runs the command; returns its exit code."""
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args, overrides, run, checkpoint_dir = _checked_args(argv, prog)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
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
    try:
      records = _open_records(c, run, args, overrides)
    except ValueError as e:  # the workdir's records refused: nothing trained
      print(f"error: {e}", file=sys.stderr)
      return 2
    first = c.status()  # the first kill held before any merge
    next_kill(c, args, first["version"], first["periods"])
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
  if status["kills"][0] < status["kills"][1]:  # a restarted synchronizer
    print(f"error: --kill-every {args.kill_every} killed "
          f"{status['kills'][0]} learners of the {status['kills'][1]} due "
          "(the synchronizer restarted and merged past a kill's period); "
          "the run above is not the fault test asked for.", file=sys.stderr)
    return 1
  return 0
