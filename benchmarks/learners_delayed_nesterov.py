"""Delayed Nesterov against Nesterov SGD at the synchronizer of decoupled
learners with a slow learner.

4 learners of the noisy quadratic (``decentral_jax.tools.learners.problems``,
``quadratic``: ``f_i(x) = ||x - b_i - e||^2 / 2``, noise 0.1), inner SGD lr
0.05, H = 8, decoupled merges with quorum 1 and no grace window (each
merge takes whatever has arrived: often one learner's pseudo-gradient, of
a ``theta`` up to ``max_staleness`` merges old), learner 3 sleeping 4x
longer per inner step, optionally Dynamic Local Updates; 60 merges. The
outer optimizer (lr 0.7, momentum 0.9) is Nesterov SGD or Delayed Nesterov
with buffer N = 2, 4 (:mod:`decentral_jax.tools.learners.outer`).
Reported per run: the distance ``||theta - mean_i b_i||`` (the minimizer of
the mean objective) after the last merge, and wall-seconds. The
synchronizer and learners run in threads of one process (no Ray): the
merge timing, and hence the result, moves from run to run.

  nice python benchmarks/learners_delayed_nesterov.py \\
    --out benchmarks/results/learners_delayed_nesterov.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import learner as learner_lib
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib


def run_once(outer: str, buffer: int, dylu: bool, seed: int,
             periods: int) -> dict:
  """One decoupled run; returns its distance to the optimum and seconds."""
  run = spec_lib.RunSpec(
      shards=4, mode="decoupled", quorum=1, grace_s=0.0, sync_every=8,
      periods=periods, inner_lr=0.05, outer=outer, delay_buffer=buffer,
      dynamic_updates=dylu, sleep_s=(0.001, 0.001, 0.001, 0.004),
      problem_args=(("seed", seed),))
  start = time.monotonic()
  sync = sync_lib.Synchronizer(run)
  link = learner_lib.Link(lambda name, *args: getattr(sync, name)(*args))
  learners = [learner_lib.Learner(run, i, link) for i in range(4)]
  deadline = time.monotonic() + 300
  while sync.version < periods and time.monotonic() < deadline:
    time.sleep(0.01)
  for lrn in learners:
    lrn.stop()
  sync.close()
  _, b = problems.quadratic_targets(4, seed)
  dist = float(np.sqrt(sum(np.sum((sync.theta[k] - b[k].mean(0)) ** 2)
                           for k in b)))
  return {"outer": outer, "buffer": buffer, "dynamic_updates": dylu,
          "seed": seed, "merges": sync.version, "distance": dist,
          "seconds": time.monotonic() - start,
          "load": os.getloadavg()[0]}


#: Bounds of --seeds (runs per variant) and --periods (merges per run).
MAX_SEEDS, MAX_PERIODS = 1000, 100_000


def parse_args(argv=None):
  """The flags; a bad one exits with code 2 after one ``error:`` line
  (a count below 1 would run nothing and print a table of NaN)."""
  p = flag_types.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="JSON lines written here")
  p.add_argument("--seeds", type=flag_types.integer(1, MAX_SEEDS),
                 default=3, help="seeds per variant (default 3)")
  p.add_argument("--periods", type=flag_types.integer(1, MAX_PERIODS),
                 default=60, help="merges per run (default 60)")
  args = p.parse_args(argv)
  try:
    flag_types.check_output_file(args.out, "--out")
  except ValueError as e:
    p.error(str(e))
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  rows = []
  for dylu in (False, True):
    for outer, buffer in (("nesterov", 1), ("delayed_nesterov", 2),
                          ("delayed_nesterov", 4)):
      for seed in range(args.seeds):  # variants interleaved per seed
        rows.append(run_once(outer, buffer, dylu, seed, args.periods))
        print(json.dumps(rows[-1]), flush=True)
  print("| outer | N | Dynamic Local Updates | distance to optimum (median,"
        " per seed) |")
  print("|---|---|---|---|")
  for dylu in (False, True):
    for outer, buffer in (("nesterov", 1), ("delayed_nesterov", 2),
                          ("delayed_nesterov", 4)):
      d = [r["distance"] for r in rows if r["outer"] == outer
           and r["buffer"] == buffer and r["dynamic_updates"] == dylu]
      print(f"| {outer} | {buffer} | {'on' if dylu else 'off'} | "
            f"{np.median(d):.3g} ({', '.join(f'{x:.3g}' for x in d)}) |")
  if args.out:
    flag_types.write_output(args.out, "--out", lambda f: f.writelines(
        json.dumps(r) + "\n" for r in rows),
                         kept="the table was printed above")


if __name__ == "__main__":
  main(sys.argv[1:])
