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

Exit codes: 0; 1 for Ray missing, an unreachable ``--address`` or a run
that did not finish within ``--timeout`` (one ``error:`` line); 2 for bad
flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib


def parser(prog: str | None = None) -> argparse.ArgumentParser:
  """The command's flags."""
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
  p.add_argument("--learners", type=int, default=2,
                 help="number of learners K (= data shards)")
  p.add_argument("--periods", type=int, default=10,
                 help="merged periods (outer steps) to run")
  p.add_argument("--mode", choices=spec_lib.MODES, default="sync")
  p.add_argument("--problem", choices=problems.NAMES, default="quadratic")
  p.add_argument("--sync-every", type=int, default=8, help="H inner steps")
  p.add_argument("--inner", choices=spec_lib.INNER, default="sgd")
  p.add_argument("--inner-lr", type=float, default=0.1)
  p.add_argument("--quorum", type=int, default=None,
                 help="pseudo-gradients needed per merge (default: all K "
                 "in sync mode, 1 in decoupled mode)")
  p.add_argument("--grace", type=float, default=0.5, help="seconds")
  p.add_argument("--dynamic-updates", action="store_true",
                 help="H_w = floor(v_w / v_max * H) per learner")
  p.add_argument("--sleep", default="",
                 help="comma-separated seconds per inner step per learner")
  p.add_argument("--address", default=None,
                 help="HOST:PORT of a `ray start --head` node")
  p.add_argument("--connect-timeout", type=float, default=10.0)
  p.add_argument("--checkpoint-dir", default=None,
                 help="the synchronizer's Orbax checkpoints (resumed)")
  p.add_argument("--kill-every", type=int, default=0,
                 help="SIGKILL a learner every N merged periods (0: never)")
  p.add_argument("--every", type=float, default=1.0,
                 help="seconds between progress lines")
  p.add_argument("--timeout", type=float, default=3600.0)
  p.add_argument("--json", default=None, help="write the run's log here")
  p.add_argument("--fragments", type=int, default=1,
                 help="Streaming DiLoCo fragments P (each merged on its own)")
  p.add_argument("--overlap-steps", type=int, default=0,
                 help="Streaming DiLoCo: inner steps between a fragment's "
                 "send and its merge")
  p.add_argument("--merge-alpha", type=float, default=0.0,
                 help="Streaming DiLoCo: x_p <- alpha x_p + (1-alpha) theta_p")
  p.add_argument("--outer", choices=spec_lib.OUTER, default="nesterov",
                 help="outer optimizer (delayed_nesterov: Async Local-SGD)")
  p.add_argument("--delay-buffer", type=int, default=None,
                 help="Delayed Nesterov's buffer N: merges per momentum "
                 "step (default 1; only with --outer delayed_nesterov)")
  p.add_argument("--drop-state", action="store_true",
                 help="learners do not send their inner optimizer state and "
                 "error feedback residual (a restarted learner starts them "
                 "afresh; saves their bytes each period)")
  return p


def _check_flags(args) -> None:
  """Each numeric flag finite and in its range (ValueError names it)."""
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
  if args.quorum is not None and args.quorum < 1:
    raise ValueError(f"--quorum={args.quorum} must be >= 1 (learners whose "
                     "pseudo-gradients a merge needs); leave it unset for "
                     "the mode's default.")


def _sleep(args) -> tuple[float, ...]:
  """``--sleep``: one finite number >= 0 per learner, or none."""
  parts = [s.strip() for s in args.sleep.split(",") if s.strip()]
  try:
    sleep = tuple(float(s) for s in parts)
  except ValueError:
    raise ValueError(f"--sleep={args.sleep!r} must be comma-separated "
                     "seconds, e.g. --sleep=0,0,0.05,0") from None
  if sleep and len(sleep) != args.learners:
    raise ValueError(f"--sleep has {len(sleep)} values for --learners="
                     f"{args.learners}; give one per learner.")
  if not all(math.isfinite(x) and x >= 0 for x in sleep):
    raise ValueError(f"--sleep={args.sleep!r}: each value must be a finite "
                     "number of seconds >= 0.")
  return sleep


def run_spec(args) -> spec_lib.RunSpec:
  """The :class:`RunSpec` of the parsed flags (ValueError names a field)."""
  _check_flags(args)
  sleep = _sleep(args)
  return spec_lib.RunSpec(
      problem=args.problem, shards=args.learners, sync_every=args.sync_every,
      periods=args.periods, inner=args.inner, inner_lr=args.inner_lr,
      mode=args.mode, grace_s=args.grace,
      quorum=args.quorum or (args.learners if args.mode == "sync" else 1),
      dynamic_updates=args.dynamic_updates, sleep_s=sleep,
      fragments=args.fragments, overlap_steps=args.overlap_steps,
      merge_alpha=args.merge_alpha, outer=args.outer,
      delay_buffer=1 if args.delay_buffer is None else args.delay_buffer,
      keep_state=not args.drop_state)


def progress_line(status: dict, learners: dict) -> str:
  """One line: merged periods and each learner's state."""
  parts = [f"period {status['version']}/{status['periods']}"]
  for i, s in sorted(learners.items()):
    if s is None:
      parts.append(f"L{i} restarting")
      continue
    wait = max(s["waits"], default=0.0)
    parts.append(f"L{i} v{s['version']} steps {s['steps']} tokens "
                 f"{s['tokens']} max wait {wait:.2f}s"
                 + (f" error {s['error']}" if s["error"] else ""))
  return " | ".join(parts)


def _learner_states(c) -> dict:
  out = {}
  for i, handle in c.learners.items():
    try:
      out[i] = c._ray.get(handle.status.remote(), timeout=1.0)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-exception-caught
      out[i] = None
  return out


def _drive(c, args) -> dict:
  """Polls until the run ends, printing progress, killing on schedule."""
  last, kills = 0.0, 0
  deadline = time.monotonic() + args.timeout
  while True:
    status = c.status()
    if time.monotonic() - last >= args.every or status["done"]:
      print(progress_line(status, _learner_states(c)), flush=True)
      last = time.monotonic()
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


def main(argv=None, prog: str | None = None) -> int:
  """Runs the command; returns its exit code."""
  args = parser(prog).parse_args(argv)
  try:
    run = run_spec(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  try:
    cluster.start(args.address, timeout_s=args.connect_timeout)
    c = cluster.Cluster(run, args.checkpoint_dir)
  except (ImportError, ConnectionError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  start = time.monotonic()
  try:
    for i in range(args.learners):
      c.add(i)
    status = _drive(c, args)
    learners = c.learner_status()
  except TimeoutError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  finally:
    c.close()
  seconds = time.monotonic() - start
  tokens = sum(sum(t.values()) for t in status["log"]["tokens"])
  print(f"{status['version']} periods merged in {seconds:.1f} s; "
        f"{tokens} tokens merged ({tokens / seconds:.1f} tokens/s); "
        f"{len(status['log']['rejected'])} pseudo-gradients rejected")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"status": status, "learners": learners,
                 "seconds": seconds}, f, indent=1, default=str)
  return 0
