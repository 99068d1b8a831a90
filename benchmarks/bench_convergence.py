"""Convergence at a fixed step budget: All-Reduce AdamW vs DAdam vs AccumAdamW.

Model and data: ``configs/gpt_tiny.py`` (byte-level GPT, 2 layers, width
128, 4 heads, context 64) on the bundled CPython documentation corpus (last
10% held out), trained by ``decentral_jax.runner.experiment.Experiment`` on
simulated CPU devices, one worker per device. Every run has the same budget
(``--steps`` optimizer steps of ``--global_batch`` sequences, warmup 30
steps then cosine to peak/10, clip 1.0, weight decay 0.1, b1 0.9, b2 0.95).
The reported number is the validation loss (nats/token) of the *averaged* model
``x_bar = mean_i x_i`` after the last step (``Experiment.evaluate``, key
``eval/loss``), over ``--eval_batches x global_batch`` held-out sequences.

Learning rates (same tuning effort for every optimizer): for each of the
three optimizer families (All-Reduce AdamW, DAdam, AccumAdamW) the peak
learning rate is picked from the same grid ``--lr_grid`` by the final
averaged-model validation loss of seed 0 with 8 workers (DAdam and
AccumAdamW tuned on one_peer_exp), and then used for every topology, seed
and worker count of that family.

Runs (``--plan full``): 8 workers: All-Reduce AdamW; DAdam and AccumAdamW
(accum_steps 4) on one_peer_exp, alternating_exp_ring (2 workers per node)
and complete; 16 workers: All-Reduce AdamW and AccumAdamW on one_peer_exp
and alternating_exp_ring (4 workers per node); seeds 0, 1, 2. Each finished
run is appended to ``--out`` (JSON lines) and skipped when the script is run
again, so an interrupted benchmark resumes. ``--report`` prints the tables
(mean +- 2 sample standard deviations over seeds) and refuses the flags it
does not read (``--cache_dir``, ``--eval_batches``).

  python benchmarks/bench_convergence.py            # runs, then the report
  python benchmarks/bench_convergence.py --report   # tables from --out only
"""

from __future__ import annotations

import collections
import json
import math
import os
import time

import _common  # benchmarks/_common.py, next to this script

_common.set_cpu_devices(16)

import jax  # noqa: E402
import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")

FAMILIES = {  # family -> (algorithm, optimizer name, accum_steps)
    "allreduce_adamw": ("all_reduce", "adamw", 1),
    "dadam": ("decentralized", "adamw", 1),
    "accum_adamw": ("decentralized", "accum_adamw", 4),
}
LABELS = {"allreduce_adamw": "All-Reduce AdamW", "dadam": "DAdam",
          "accum_adamw": "AccumAdamW (T=4)"}
TUNE_TOPOLOGY = "one_peer_exp"


def _config(family, topology, n_workers, lr, seed, args):
  """``configs/gpt_tiny.py`` with one run's overrides."""
  from decentral_jax.runner import config  # pylint: disable=import-outside-toplevel
  algorithm, opt, accum = FAMILIES[family]
  # AER is node-aware: 2 workers per node with 8 workers, 4 with 16.
  local = ((2 if n_workers <= 8 else 4)
           if topology == "alternating_exp_ring" else 1)
  return config.load_config(GPT_TINY, [
      f"algorithm={algorithm}",
      "topology=" + (topology if algorithm == "decentralized"
                     else "one_peer_exp"),
      f"n_workers={n_workers}", f"workers_per_node={local}",
      f"optimizer.name={opt}", f"optimizer.accum_steps={accum}",
      f"schedule.peak_lr={lr!r}", f"schedule.final_lr={lr / 10!r}",
      f"steps={args.steps}", f"global_batch={args.global_batch}",
      f"seed={seed}", "eval_interval=0", f"eval_batches={args.eval_batches}",
      f"log_interval={10**9}"])  # no consensus pmean inside the timed loop


def run_one(family, topology, n_workers, lr, seed, args) -> dict:
  """Trains one configuration; returns its final metrics."""
  from decentral_jax.runner import experiment  # pylint: disable=import-outside-toplevel
  c = _config(family, topology, n_workers, lr, seed, args)
  t0 = time.perf_counter()
  exp = experiment.Experiment(c)
  state = exp.init_state()
  pending = None
  losses = []
  for s in range(c.steps):
    state, metrics = exp.train_step(state, exp.get_batch(s))
    if pending is not None:  # at most 2 steps in flight
      m = jax.device_get(pending)
      if not np.all(m["finite"]):
        raise FloatingPointError(f"non-finite at step {s} ({family}, "
                                 f"{topology}, lr={lr}, seed={seed})")
      losses.append(float(np.mean(m["loss"])))
    pending = metrics
  m = jax.device_get(pending)
  losses.append(float(np.mean(m["loss"])))
  ev = exp.evaluate(state)
  return {
      "family": family, "topology": topology if family != "allreduce_adamw"
      else "-", "n_workers": n_workers,
      "workers_per_node": int(c.workers_per_node), "lr": lr, "seed": seed,
      "steps": c.steps, "global_batch": c.global_batch,
      "tokens": c.steps * exp.tokens_per_step,
      "eval_loss": ev["eval/loss"],
      "eval_worker_loss_mean": ev["eval/worker_loss_mean"],
      "consensus_distance": ev["consensus_distance"],
      "train_loss_last10": float(np.mean(losses[-10:])),
      "finite": bool(np.all(m["finite"])) and bool(np.isfinite(ev["eval/loss"])),
      "wall_s": round(time.perf_counter() - t0, 1),
  }


def _key(r):
  return (r["family"], r["topology"], r["n_workers"], float(r["lr"]),
          r["seed"], r["steps"], r["global_batch"])


#: The fields of a row of ``--out`` the cache and the report read
#: (``_common.read_rows``; ``eval_loss`` NaN for a run that diverged).
ROW_FIELDS = {"family": "str", "topology": "str", "n_workers": "int",
              "workers_per_node": "int", "lr": "number", "seed": "int",
              "steps": "int", "global_batch": "int", "eval_loss": "real",
              "consensus_distance": "real", "finite": "bool",
              "wall_s": "number", "date_utc": "str"}


def _load(path):
  """The runs of ``--out`` (none if it does not exist); a damaged file is
  one ``error:`` line naming ``--out`` and the key (exit code 2)."""
  return _common.read_rows(path, "--out", ROW_FIELDS)


def _run_cached(done, family, topology, n, lr, seed, args):
  topo_key = topology if family != "allreduce_adamw" else "-"
  key = (family, topo_key, n, float(lr), seed, args.steps, args.global_batch)
  for r in done:
    if _key(r) == key:
      return r
  print(f"run {family} {topology} n={n} lr={lr:g} seed={seed} ...",
        flush=True)
  r = run_one(family, topology, n, lr, seed, args)
  r["date_utc"] = _common.machine_info()["date_utc"]
  _common.write_output(args.out, "--out",
                       lambda f: f.write(json.dumps(r) + "\n"), mode="a",
                       kept="the runs before this one are in it")
  done.append(r)
  print(f"  eval_loss={r['eval_loss']:.4f} wall={r['wall_s']}s", flush=True)
  return r


def _best_lrs(done, args):
  best = {}
  for fam in FAMILIES:
    topo = "-" if fam == "allreduce_adamw" else TUNE_TOPOLOGY
    cands = [r for r in done if r["family"] == fam and r["topology"] == topo
             and r["n_workers"] == 8 and r["seed"] == 0
             and r["steps"] == args.steps
             and r["global_batch"] == args.global_batch
             and float(r["lr"]) in args.lr_grid]
    cands = [r for r in cands if r["finite"]]
    if cands:
      best[fam] = min(cands, key=lambda r: r["eval_loss"])["lr"]
  return best


def plan(args):
  """(family, topology, n_workers) of the final table."""
  rows = [("allreduce_adamw", "-", 8)]
  for fam in ("dadam", "accum_adamw"):
    for topo in args.topologies:
      rows.append((fam, topo, 8))
  if args.plan == "full":
    rows.append(("allreduce_adamw", "-", 16))
    for topo in args.topologies_16:
      rows.append(("accum_adamw", topo, 16))
  return rows


def run_all(args):
  done = _load(args.out)
  for fam in FAMILIES:  # tuning, seed 0, 8 workers
    topo = "-" if fam == "allreduce_adamw" else TUNE_TOPOLOGY
    for lr in args.lr_grid:
      _run_cached(done, fam, topo, 8, lr, 0, args)
  best = _best_lrs(done, args)
  print("chosen peak learning rates:", best, flush=True)
  for fam, topo, n in plan(args):
    for seed in args.seeds:
      _run_cached(done, fam, topo, n, best[fam], seed, args)


def report(args) -> str:
  done = [r for r in _load(args.out) if r["steps"] == args.steps
          and r["global_batch"] == args.global_batch]
  best = _best_lrs(done, args)
  lines = [f"Budget: {args.steps} steps x {args.global_batch} sequences x 64 "
           f"tokens = {args.steps * args.global_batch * 64:,} tokens; "
           f"LR grid {args.lr_grid}; chosen: "
           + ", ".join(f"{LABELS[f]} {best[f]:g}" for f in best), ""]
  lines.append("Tuning (seed 0, 8 workers, final averaged-model val loss):")
  lines.append("")
  lines.append("| optimizer | topology | " + " | ".join(
      f"lr {lr:g}" for lr in args.lr_grid) + " |")
  lines.append("|---|---|" + "---|" * len(args.lr_grid))
  for fam in FAMILIES:
    topo = "-" if fam == "allreduce_adamw" else TUNE_TOPOLOGY
    cells = []
    for lr in args.lr_grid:
      rs = [r for r in done if r["family"] == fam and r["topology"] == topo
            and r["n_workers"] == 8 and r["seed"] == 0
            and float(r["lr"]) == lr]
      cells.append(f"{rs[0]['eval_loss']:.4f}" if rs else "not run")
    lines.append(f"| {LABELS[fam]} | {topo} | " + " | ".join(cells) + " |")
  lines += ["", "Final averaged-model validation loss (nats/token), mean +- "
            "2 sample std over seeds:", "",
            "| workers | optimizer | topology (workers/node) | lr | seeds | "
            "val loss | per-seed | consensus distance (mean) |",
            "|---|---|---|---|---|---|---|---|"]
  groups = collections.OrderedDict()
  for fam, topo, n in plan(args):
    if fam not in best:
      continue
    rs = [r for r in done if r["family"] == fam and r["topology"] == topo
          and r["n_workers"] == n and float(r["lr"]) == float(best[fam])
          and r["seed"] in args.seeds]
    groups[(fam, topo, n)] = rs
  for (fam, topo, n), rs in groups.items():
    if not rs:
      lines.append(f"| {n} | {LABELS[fam]} | {topo} | {best[fam]:g} | 0 | "
                   "not run | | |")
      continue
    v = np.array([r["eval_loss"] for r in sorted(rs, key=lambda r: r["seed"])])
    w = np.array([r["consensus_distance"] for r in rs])
    sd = 2 * v.std(ddof=1) if len(v) > 1 else float("nan")
    wpn = rs[0]["workers_per_node"]
    topo_s = f"{topo} ({wpn})" if topo == "alternating_exp_ring" else topo
    lines.append(f"| {n} | {LABELS[fam]} | {topo_s} | {best[fam]:g} | "
                 f"{len(v)} | {v.mean():.4f} +- {sd:.4f} | "
                 f"{', '.join(f'{x:.4f}' for x in v)} | {w.mean():.3g} |")
  wall = sum(r["wall_s"] for r in done)
  lines += ["", f"{len(done)} runs, {wall / 60:.1f} min of wall time in total "
            f"(dates {min(r['date_utc'] for r in done)} to "
            f"{max(r['date_utc'] for r in done)} UTC)." if done else ""]
  return "\n".join(lines)


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line): with
  ``--report`` ``--out`` is read, else written (and ``--cache_dir``)."""
  from decentral_jax.tools import flag_types  # one error: line
  count, real = flag_types.integer, flag_types.real  # bounded flag types
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=count(1, 10**7), default=200)
  ap.add_argument("--global_batch", type=count(1, 10**7), default=32)
  ap.add_argument("--eval_batches", type=count(1, 10**6), default=8)
  ap.add_argument("--lr_grid", type=real(0, 10, open_lo=True), nargs="+",
                  default=[7.5e-4, 1.5e-3, 3e-3, 6e-3])
  ap.add_argument("--seeds", type=count(0, 2**32 - 1),
                  nargs="+", default=[0, 1, 2])
  ap.add_argument("--topologies", nargs="+",
                  default=["one_peer_exp", "alternating_exp_ring", "complete"])
  ap.add_argument("--topologies_16", nargs="+",
                  default=["one_peer_exp", "alternating_exp_ring"])
  ap.add_argument("--plan", choices=("full", "8"), default="full")
  ap.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                "convergence.jsonl"))
  ap.add_argument("--report", action="store_true")
  ap.add_argument("--cache_dir", default="/tmp/decentral_jax_bench_cache",
                  help="JAX persistent compilation cache (seeds reuse "
                       "compiled steps)")
  args = ap.parse_args(argv)
  if args.report:  # the report selects runs by the plan's flags
    _common.check_report_flags(ap, argv, mode="with --report", reads=(
        "--report", "--out", "--steps", "--global_batch", "--lr_grid",
        "--seeds", "--topologies", "--topologies_16", "--plan"))
  _common.check_flags(
      ap, args, inputs=("--out",) if args.report else (),
      outputs=() if args.report else ("--out",),
      dirs=() if args.report else ("--cache_dir",),
      rules=(_check_topologies, _check_global_batch))
  return args


def _check_global_batch(args) -> None:
  """``--global_batch`` divides evenly across every worker count of the
  run (8 for the tuning and --plan 8, 16 too with --plan full)."""
  counts = sorted({8} | {n for _, _, n in plan(args)})
  step = math.lcm(*counts)
  if args.global_batch % step:
    lo = max(step, args.global_batch // step * step)
    raise ValueError(
        f"--global_batch {args.global_batch} is not divisible by the worker "
        f"counts of --plan {args.plan} ({', '.join(map(str, counts))}; the "
        f"global batch is split evenly across workers); use e.g. "
        f"--global_batch {lo} or {lo + step}.")


def _check_topologies(args) -> None:
  """Each topology of :func:`plan` builds at its worker count."""
  for fam, topo, n in plan(args):
    if topo != "-":
      flag = "--topologies" if n == 8 else "--topologies_16"
      _common.check_topology(flag, topo, n, f"{n} workers ({fam})")


def main(argv=None):
  args = parse_args(argv)
  if not args.report:
    _common.check_cpu_devices(16, "bench_convergence.py", flag=False)
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    print("machine:", json.dumps(_common.machine_info()), flush=True)
    run_all(args)
  print(report(args))


if __name__ == "__main__":
  main()
