"""AccumAdamW at short budgets: accumulation vs gossip, and the step budget.

Companion of ``bench_convergence.py`` (same model, data, schedule shape and
metric; ``configs/gpt_tiny.py``, 8 workers, 32 sequences x 64 tokens per
step, warmup 30 steps then cosine to peak/10, clip 1.0, weight decay 0.1,
b1 0.9, b2 0.95). Two parts:

* ``--part isolate`` (200 steps, seed 0): AccumAdamW *after an exact
  All-Reduce* (``algorithm=all_reduce``, ``optimizer.name=accum_adamw``;
  every worker sees the same averaged gradient, so this is one optimizer on
  a 32-sequence batch) with T = 4 and T = 2 over the learning-rate grid, next
  to All-Reduce AdamW; All-Reduce AdamW with the per-step betas equivalent to
  AccumAdam's window-level horizons (b1 = 0.9^(1/4), b2 = 0.95^(1/4));
  the decentralized AccumAdamW T = 2 learning-rate grid on one_peer_exp
  (needed to pick its learning rate for the long runs); and AccumAdamW
  T = 4 (All-Reduce and one_peer_exp) at 2.1e-3, AdamW's best 3e-3 divided
  by the step-size ratio 1.4 measured by ``accum_adam_probe.py``.
* ``--part long`` (``--long_steps`` steps, seed 0, averaged model evaluated
  every ``--eval_every`` steps): All-Reduce AdamW, DAdam one_peer_exp,
  AccumAdamW one_peer_exp T = 4 and T = 2, each at the peak learning rate it
  won on the 200-step seed-0 grid {7.5e-4, 1.5e-3, 3e-3, 6e-3} (read from
  ``benchmarks/results/convergence.jsonl`` and from this script's own
  results), plus AccumAdamW T = 4 at 3e-3 as a sensitivity check.

Each finished run is appended to ``--out`` (JSON lines,
``benchmarks/studies/results/accum_budget.jsonl``) and skipped when the
script runs again. ``--report`` prints the tables from ``--out``.

  python benchmarks/studies/bench_accum_budget.py --part isolate
  python benchmarks/studies/bench_accum_budget.py --part long
  python benchmarks/studies/bench_accum_budget.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
GPT_TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")
sys.path.insert(0, os.path.dirname(_HERE))  # benchmarks/, for _common
import _common  # noqa: E402

_common.set_cpu_devices(16)  # as bench_convergence.py

import jax  # noqa: E402
import numpy as np  # noqa: E402

GRID = (7.5e-4, 1.5e-3, 3e-3, 6e-3)
# Per-step decays whose horizons equal AccumAdam's window-level ones at T=4.
SLOW_B1, SLOW_B2 = 0.9 ** 0.25, 0.95 ** 0.25


def _spec(name, algorithm, opt, accum, lr, steps, topology="one_peer_exp",
          b1=0.9, b2=0.95):
  return {"name": name, "algorithm": algorithm, "optimizer": opt,
          "accum_steps": accum, "lr": lr, "steps": steps,
          "topology": topology if algorithm == "decentralized" else "-",
          "b1": round(b1, 6), "b2": round(b2, 6)}


def _config(spec, seed, global_batch, eval_batches):
  """``configs/gpt_tiny.py`` with the overrides of one run."""
  from decentral_jax.runner import config  # pylint: disable=import-outside-toplevel
  return config.load_config(GPT_TINY, [
      f"algorithm={spec['algorithm']}",
      "topology=" + (spec["topology"] if spec["algorithm"] == "decentralized"
                     else "one_peer_exp"),
      "n_workers=8", f"optimizer.name={spec['optimizer']}",
      f"optimizer.accum_steps={spec['accum_steps']}",
      f"optimizer.b1={spec['b1']!r}", f"optimizer.b2={spec['b2']!r}",
      f"schedule.peak_lr={spec['lr']!r}",
      f"schedule.final_lr={spec['lr'] / 10!r}", f"steps={spec['steps']}",
      f"global_batch={global_batch}", f"seed={seed}", "eval_interval=0",
      f"eval_batches={eval_batches}", f"log_interval={10**9}"])


def run_one(spec, seed, args, eval_every=0) -> dict:
  """Trains one run; evaluates the averaged model every ``eval_every``."""
  from decentral_jax.runner import experiment  # pylint: disable=import-outside-toplevel
  c = _config(spec, seed, args.global_batch, args.eval_batches)
  t0 = time.perf_counter()
  load0 = os.getloadavg()[0]
  exp = experiment.Experiment(c)
  state = exp.init_state()
  pending, losses, evals = None, [], []
  for s in range(c.steps):
    state, metrics = exp.train_step(state, exp.get_batch(s))
    if pending is not None:
      m = jax.device_get(pending)
      if not np.all(m["finite"]):
        raise FloatingPointError(f"non-finite at step {s} ({spec})")
      losses.append(float(np.mean(m["loss"])))
    pending = metrics
    done = s + 1
    if eval_every and done % eval_every == 0 and done < c.steps:
      evals.append((done, exp.evaluate(state)["eval/loss"]))
  m = jax.device_get(pending)
  losses.append(float(np.mean(m["loss"])))
  ev = exp.evaluate(state)
  evals.append((c.steps, ev["eval/loss"]))
  return {**spec, "seed": seed, "n_workers": 8,
          "global_batch": args.global_batch,
          "tokens": c.steps * exp.tokens_per_step,
          "eval_loss": ev["eval/loss"], "evals": evals,
          "consensus_distance": ev["consensus_distance"],
          "train_loss_last10": float(np.mean(losses[-10:])),
          "train_loss_every50": [float(np.mean(losses[i:i + 50]))
                                 for i in range(0, len(losses), 50)],
          "finite": bool(np.isfinite(ev["eval/loss"])),
          "wall_s": round(time.perf_counter() - t0, 1),
          "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _key(r):
  return (r["name"], r["algorithm"], r["optimizer"], r["accum_steps"],
          float(r["lr"]), r["steps"], r["topology"], r["b1"], r["b2"],
          r["seed"], r["global_batch"])


def _load(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _run_cached(done, spec, seed, args, eval_every=0):
  key = _key({**spec, "seed": seed, "global_batch": args.global_batch})
  for r in done:
    if _key(r) == key:
      return r
  print(f"run {spec} seed={seed} ...", flush=True)
  r = run_one(spec, seed, args, eval_every)
  r["date_utc"] = _common.machine_info()["date_utc"]
  r["git"] = _common.git_revision()
  with open(args.out, "a") as f:
    f.write(json.dumps(r) + "\n")
  done.append(r)
  print(f"  eval_loss={r['eval_loss']:.4f} evals={r['evals']} "
        f"wall={r['wall_s']}s load={r['load_avg_1m']}", flush=True)
  return r


def isolate_specs(steps=200):
  s = [_spec("allreduce_adamw", "all_reduce", "adamw", 1, 3e-3, steps)]
  s += [_spec("allreduce_accum_t4", "all_reduce", "accum_adamw", 4, lr, steps)
        for lr in GRID[:3]]
  s += [_spec("allreduce_accum_t2", "all_reduce", "accum_adamw", 2, lr, steps)
        for lr in GRID[1:3]]
  s += [_spec("allreduce_adamw_slow_betas", "all_reduce", "adamw", 1, lr,
              steps, b1=SLOW_B1, b2=SLOW_B2) for lr in GRID[1:3]]
  s += [_spec("accum_t2", "decentralized", "accum_adamw", 2, lr, steps)
        for lr in GRID[:3]]
  # AdamW's best lr divided by the step-size ratio measured by
  # accum_adam_probe.py (RMS of AccumAdam T=4 / Adam directions, about 1.4
  # over steps 1-100): does matching the step size close the gap?
  s += [_spec(name, alg, "accum_adamw", 4, 2.1e-3, steps)
        for name, alg in (("allreduce_accum_t4", "all_reduce"),
                          ("accum_t4", "decentralized"))]
  return s


def tuned_lrs(done, args) -> dict:
  """Best 200-step seed-0 grid learning rate per method (8 workers)."""
  conv = _load(args.convergence)
  pick = {}
  fam = {"allreduce_adamw": ("allreduce_adamw", "-"),
         "dadam": ("dadam", "one_peer_exp"),
         "accum_t4": ("accum_adamw", "one_peer_exp")}
  for name, (family, topo) in fam.items():
    rs = [r for r in conv if r["family"] == family and r["topology"] == topo
          and r["n_workers"] == 8 and r["seed"] == 0 and r["steps"] == 200
          and r["global_batch"] == args.global_batch and r["finite"]]
    if rs:
      pick[name] = min(rs, key=lambda r: r["eval_loss"])["lr"]
  rs = [r for r in done if r["name"] == "accum_t2" and r["steps"] == 200
        and r["seed"] == 0 and r["finite"]]
  if rs:
    pick["accum_t2"] = min(rs, key=lambda r: r["eval_loss"])["lr"]
  return pick


def long_specs(done, args):
  lrs = tuned_lrs(done, args)
  missing = {"allreduce_adamw", "dadam", "accum_t4", "accum_t2"} - set(lrs)
  if missing:
    raise ValueError(f"no 200-step tuning results for {sorted(missing)}; run "
                     "--part isolate first (and bench_convergence.py).")
  n = args.long_steps
  return [
      _spec("allreduce_adamw", "all_reduce", "adamw", 1,
            lrs["allreduce_adamw"], n),
      _spec("dadam", "decentralized", "adamw", 1, lrs["dadam"], n),
      _spec("accum_t4", "decentralized", "accum_adamw", 4, lrs["accum_t4"], n),
      _spec("accum_t2", "decentralized", "accum_adamw", 2, lrs["accum_t2"], n),
      _spec("accum_t4", "decentralized", "accum_adamw", 4, 3e-3, n),
  ]


def report(args) -> str:
  done = _load(args.out)
  lines = ["Part 1 (200 steps, seed 0, 8 workers, final averaged-model val "
           "loss):", "", "| run | algorithm | optimizer | T | b1 | b2 | lr | "
           "val loss | wall s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in done:
    if r["steps"] == 200:
      lines.append(f"| {r['name']} | {r['algorithm']} {r['topology']} | "
                   f"{r['optimizer']} | {r['accum_steps']} | {r['b1']:g} | "
                   f"{r['b2']:g} | {r['lr']:g} | {r['eval_loss']:.4f} | "
                   f"{r['wall_s']} |")
  longs = [r for r in done if r["steps"] == args.long_steps]
  if longs:
    steps = [s for s, _ in longs[0]["evals"]]
    lines += ["", f"Part 2 ({args.long_steps} steps, seed 0, averaged-model "
              "val loss at step):", "",
              "| run | T | lr | " + " | ".join(str(s) for s in steps) +
              " | consensus dist. | wall s |",
              "|---|---|---|" + "---|" * len(steps) + "---|---|"]
    for r in longs:
      cells = " | ".join(f"{v:.4f}" for _, v in r["evals"])
      lines.append(f"| {r['name']} {r['topology']} | {r['accum_steps']} | "
                   f"{r['lr']:g} | {cells} | {r['consensus_distance']:.3g} | "
                   f"{r['wall_s']} |")
  if done:
    lines += ["", f"{len(done)} runs, {sum(r['wall_s'] for r in done) / 60:.1f}"
              f" min wall ({min(r['date_utc'] for r in done)} to "
              f"{max(r['date_utc'] for r in done)} UTC)."]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("isolate", "long"))
  ap.add_argument("--long_steps", type=int, default=1000)
  ap.add_argument("--eval_every", type=int, default=200)
  ap.add_argument("--global_batch", type=int, default=32)
  ap.add_argument("--eval_batches", type=int, default=8)
  ap.add_argument("--out", default=os.path.join(_HERE, "results",
                                                "accum_budget.jsonl"))
  ap.add_argument("--convergence", default=os.path.join(
      _ROOT, "benchmarks", "results", "convergence.jsonl"))
  ap.add_argument("--report", action="store_true")
  ap.add_argument("--cache_dir", default="/tmp/decentral_jax_bench_cache")
  args = ap.parse_args()
  if args.part:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    print("machine:", json.dumps(_common.machine_info()), flush=True)
    done = _load(args.out)
    if args.part == "isolate":
      for spec in isolate_specs():
        _run_cached(done, spec, 0, args)
    else:
      print("learning rates from the 200-step grid:", tuned_lrs(done, args),
            flush=True)
      for spec in long_specs(done, args):
        _run_cached(done, spec, 0, args, args.eval_every)
  print(report(args))


if __name__ == "__main__":
  main()
