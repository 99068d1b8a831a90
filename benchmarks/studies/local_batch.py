"""The local-batch boundary: where decentralized Adam catches All-Reduce.

In compare.py's setting (configs/gpt_tiny.py, 8 workers, 8 sequences per
worker and step) DAdam trails All-Reduce AdamW by 0.24 in validation loss
(BENCHMARKS.md section 10), most of it because each worker's Adam moments
come from its own 8 sequences. This study varies the local batch ``b``
(sequences per worker and step; global batch ``8 b``) at 8 workers and
asks at which ``b`` DAdam (one_peer_exp) and AccumAdamW (T = 4,
horizon-matched betas, compare.py's arm) come within 2 sigma of
All-Reduce AdamW.

Setting: configs/gpt_tiny.py as compare.py runs it (2-layer byte-level
GPT, 64 tokens per sequence, b1 0.9, b2 0.95, weight decay 0.1, clip 1.0)
but narrower (width ``--width``, default 64, as section 10's ``scale``
part) and short (``--steps``, default 40; warmup a tenth of them, at least
5, then cosine to peak / 10), the 8 workers vmapped on one simulated CPU
device (``--workers_per_device 8``), all to fit a 2-core machine. Every
run is scored on the same 512 validation sequences (``eval_batches = 512 /
global batch``): the final validation loss of the exact average of the
workers' parameters.

Protocol (``decentral_jax.runner.tuning``, as BENCHMARKS.md section 10):
seed 0 at every peak lr of ``--grid``; while the best is at an end, one
more factor of 2 past it (at most ``--max_extensions`` times); then, only
where the seed-0 gap to All-Reduce is below ``--close`` (default 0.15,
the differences one seed cannot settle here), seeds 1 and 2 at the chosen
lr for that method and for All-Reduce. Result: mean +- 2 sample standard
deviations. "Within 2 sigma" means the two intervals overlap (the
protocol's "not distinguished"); the report also gives 2 sigma of the
difference.

Budgets (``--budget``): ``steps``, every ``b`` for ``--steps`` steps;
``tokens``, every ``b`` sees the tokens of ``--token_ref`` sequences per
worker at ``--steps`` steps (steps = ``--steps * token_ref / b``).

Each finished run is one JSON line of ``--out`` (setting, method, lr,
seed, final and per-evaluation losses, wall and CPU seconds of the
process, 1-minute load, UTC date); runs already there are skipped, so an
interrupted study resumes with the same command. ``--report`` prints the
tables from ``--out`` alone.

  python benchmarks/studies/local_batch.py --local_batches 8 32 --seeds
  python benchmarks/studies/local_batch.py            # 8, 16, 32, 64
  python benchmarks/studies/local_batch.py --budget tokens --local_batches 8 \
      --methods all_reduce,dadam --seeds
  python benchmarks/studies/local_batch.py --report

The first line is the grid at seed 0 only (an empty ``--seeds``); the
second runs the rest of the same-steps study (``BENCHMARKS.md`` section
15); ``--report`` also writes the summary rows to ``--summary_json``
(``benchmarks/results/local_batch.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, os.path.dirname(_HERE))  # benchmarks/: bench_evidence
import bench_evidence as ev  # noqa: E402  (sets 8 CPU devices, imports compare)
from decentral_jax.runner import tuning  # noqa: E402

OUT = os.path.join(_ROOT, "benchmarks", "results", "local_batch.jsonl")
SUMMARY = os.path.join(_ROOT, "benchmarks", "results", "local_batch.json")
PART = "local_batch"
N_WORKERS = 8
EVAL_SEQUENCES = 512  # the same validation windows for every local batch
AR = ev.compare.METHODS["all_reduce"]
METHODS = (AR, ev.compare.METHODS["dadam"], ev.compare.METHODS["accum_adamw"])


def steps_for(b: int, args) -> int:
  """Steps at local batch ``b`` under ``args.budget``."""
  if args.budget == "steps":
    return args.steps
  return max(round(args.steps * args.token_ref / b), 1)


def setting(b: int, args) -> tuple[str, tuple[str, ...]]:
  """``(setting name, config overrides)`` at local batch ``b``."""
  steps = steps_for(b, args)
  gb = N_WORKERS * b
  if EVAL_SEQUENCES % gb:
    raise SystemExit(f"--local_batches: {b} does not divide "
                     f"{EVAL_SEQUENCES // N_WORKERS}.")
  name = (f"gpt{args.width}_n{N_WORKERS}_b{b}_{steps}"
          + ("" if args.workers_per_device == 1
             else f"_wpd{args.workers_per_device}")
          + ("" if args.budget == "steps" else f"_tokens_of_b{args.token_ref}"))
  return name, ("checkpoint_interval=0", f"model.n_embd={args.width}",
                f"n_workers={N_WORKERS}", f"global_batch={gb}",
                f"workers_per_device={args.workers_per_device}",
                f"steps={steps}", f"eval_interval={max(steps // 4, 1)}",
                f"eval_batches={EVAL_SEQUENCES // gb}",
                f"schedule.warmup_steps={max(steps // 10, 5)}")


class Study(ev.Study):
  """bench_evidence's cache of runs, recording each run's CPU time too."""

  def get(self, part, setting_name, cfg, overrides, run, lr, seed, accum=4,
          parent: str = ""):
    key = (part, setting_name, run.name, float(lr), seed)
    if key in self.done:
      return self.done[key]
    print(f"[{time.strftime('%H:%M:%S')}] {setting_name} {run.name} "
          f"lr={lr:g} seed={seed} ...", flush=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    rec = ev.train_one(part, setting_name, cfg, overrides, run, lr, seed,
                       accum)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rec["cpu_s"] = round(usage.ru_utime + usage.ru_stime - cpu0, 1)
    with open(self.out, "a", encoding="utf-8") as f:
      f.write(json.dumps(rec) + "\n")
    self.done[key] = rec
    loss = rec["eval_loss"]
    print(f"    val loss {'diverged' if loss is None else f'{loss:.4f}'}, "
          f"{rec['wall_s']} s wall, {rec['cpu_s']} CPU-s, load "
          f"{rec['load_1min']}", flush=True)
    return rec


def tune_seed0(study, name, ov, run, args) -> tuning.Choice:
  """The protocol's grid at seed 0 (with its edge extensions)."""
  losses = {}
  while True:
    todo = tuning.next_lrs(losses, args.grid, args.max_extensions)
    if not todo:
      return tuning.choose(losses)
    for lr in todo:
      losses[lr] = study.get(PART, name, ev.GPT_TINY, ov, run, lr,
                             0)["eval_loss"]


def run_setting(study, b: int, args) -> None:
  """Every method at local batch ``b``: grid, then seeds where close."""
  name, ov = setting(b, args)
  chosen = {run.name: tune_seed0(study, name, ov, run, args)
            for run in METHODS if run.name in args.methods}
  if AR.name not in chosen or not args.seeds:
    return
  ar0 = chosen[AR.name].loss
  close = [r for r in METHODS if r.name in chosen and r is not AR
           and chosen[r.name].loss - ar0 < args.close]
  for run in ((AR, *close) if close else ()):
    for seed in args.seeds:
      study.get(PART, name, ev.GPT_TINY, ov, run, chosen[run.name].lr, seed)


def _at_chosen(rs: list[dict], method: str):
  """``(choice, losses of the runs at it)`` of one method, or ``None``."""
  seed0 = {r["lr"]: r["eval_loss"] for r in rs
           if r["method"] == method and r["seed"] == 0}
  if not seed0:
    return None
  try:
    ch = tuning.choose(seed0)
  except ValueError:
    return None
  return ch, [r["eval_loss"] for r in rs
              if r["method"] == method and r["lr"] == ch.lr]


def _gap(ar_losses, losses) -> dict:
  """Mean gap to All-Reduce, 2 sigma of the difference (sqrt of the sum of
  the two variances, times 2) and whether the two mean +- 2 sigma
  intervals overlap (``None`` with one seed on either side)."""
  ma, sa, na = tuning.summarize(ar_losses)
  mb, sb, nb = tuning.summarize(losses)
  if math.isinf(ma) or math.isinf(mb):
    return {"gap": None, "two_sigma_diff": None, "within": None}
  if na < 2 or nb < 2:
    return {"gap": mb - ma, "two_sigma_diff": None, "within": None}
  return {"gap": mb - ma, "two_sigma_diff": math.sqrt(sa ** 2 + sb ** 2),
          "within": abs(mb - ma) <= sa + sb}


def boundary(records: list[dict]) -> list[dict]:
  """One row per setting: each method's chosen lr, mean +- 2 sigma over
  the seeds at it, and (not All-Reduce) its gap to All-Reduce."""
  groups = {}
  for r in records:
    if r["part"] == PART:
      groups.setdefault(r["setting"], []).append(r)
  rows = []
  for name, rs in groups.items():
    r0 = rs[0]
    b = r0["global_batch"] // r0["n_workers"]
    row = {"setting": name, "local_batch": b, "steps": r0["steps"],
           "budget": "tokens" if "_tokens_of_" in name else "steps",
           "tokens_per_worker": r0["steps"] * b * 64,
           "cpu_min": round(sum(x.get("cpu_s", 0.0) for x in rs) / 60, 1),
           "load_1min": [min(x["load_1min"] for x in rs),
                         max(x["load_1min"] for x in rs)],
           "methods": {}}
    ar = _at_chosen(rs, AR.name)
    for run in METHODS:
      got = _at_chosen(rs, run.name)
      if got is None:
        continue
      ch, losses = got
      mean, two_sigma, n = tuning.summarize(losses)
      m = {"lr": ch.lr, "edge": ch.edge, "losses": losses, "mean": mean,
           "two_sigma": None if math.isnan(two_sigma) else two_sigma,
           "seeds": n}
      if run is not AR and ar is not None:
        m.update(_gap(ar[1], losses))
      row["methods"][run.name] = m
    rows.append(row)
  return sorted(rows, key=lambda r: (r["budget"], r["local_batch"]))


def _cell(m: dict | None, is_ar: bool) -> str:
  if m is None:
    return "not run"
  cell = (f"{m['lr']:g}" + (f" ({m['edge']} edge)" if m["edge"] else "")
          + f", {tuning.format_mean_2sigma(m['losses'])}")
  if is_ar or m.get("gap") is None:
    return cell
  if m["within"] is None:
    return cell + f", {m['gap']:+.4f} (1 seed)"
  return (cell + f", {m['gap']:+.4f} (2 sigma of the difference "
          f"{m['two_sigma_diff']:.4f}; "
          + ("within" if m["within"] else "apart") + ")")


def summary(rows: list[dict]) -> str:
  """The markdown table of :func:`boundary`'s rows."""
  head = ("| budget | local batch | steps | tokens per worker | "
          + " | ".join(f"{r.label}: lr, val loss" + ("" if r is AR else
                                                      ", vs All-Reduce")
                       for r in METHODS) + " | CPU-min | 1-min load |")
  out = [head, "|---" * (head.count("|") - 1) + "|"]
  for row in rows:
    cells = [_cell(row["methods"].get(r.name), r is AR) for r in METHODS]
    lo, hi = row["load_1min"]
    out.append(f"| same {row['budget']} | {row['local_batch']} | "
               f"{row['steps']} | {row['tokens_per_worker']:,} | "
               + " | ".join(cells) + f" | {row['cpu_min']:.1f} | "
               f"{lo:.1f} to {hi:.1f} |")
  return "\n".join(out)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--local_batches", type=int, nargs="+",
                 default=[8, 16, 32, 64])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--budget", choices=("steps", "tokens"), default="steps")
  p.add_argument("--token_ref", type=int, default=64,
                 help="tokens budget: that of this local batch at --steps")
  p.add_argument("--width", type=int, default=64, help="model.n_embd")
  p.add_argument("--workers_per_device", type=int, default=8,
                 help="vmapped workers per simulated CPU device")
  p.add_argument("--grid", type=float, nargs="+",
                 default=[3e-3, 6e-3, 1.2e-2])
  p.add_argument("--max_extensions", type=int, default=1)
  p.add_argument("--seeds", type=int, nargs="*", default=[1, 2],
                 help="further seeds where the seed-0 gap is below --close")
  p.add_argument("--close", type=float, default=0.15)
  p.add_argument("--methods", default=",".join(r.name for r in METHODS))
  p.add_argument("--out", default=OUT)
  p.add_argument("--report", action="store_true")
  p.add_argument("--summary_json", default=SUMMARY,
                 help="write the summary rows here ('' = do not)")
  args = p.parse_args()
  args.methods = args.methods.split(",")
  study = Study(args.out)
  if not args.report:
    for b in args.local_batches:
      run_setting(study, b, args)
  records = [r for r in study.done.values() if r["part"] == PART]
  print(ev.report(records))
  rows = boundary(records)
  print(summary(rows))
  if args.summary_json:
    with open(args.summary_json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main()
