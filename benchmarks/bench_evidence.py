"""Evidence study: where decentralized Adam matches All-Reduce, and what it costs.

Every method is tuned by the project's protocol (``decentral_jax.runner.tuning``):
the same peak-lr grid (1.5e-3, 3e-3, 6e-3, 1.2e-2, extended by factors of 2
while the best is at an end) at seed 0, then seeds 0, 1, 2 at the chosen lr,
reported as mean +- 2 sample standard deviations. The score is the final
validation loss of the exact average of the workers' parameters
(``eval/loss``; for the CNN also its test accuracy). Runs go through the
project's runner (``train.train_and_evaluate``), as ``experiments/
compare.py`` does, in a scratch work directory.

Parts (``--part``; each appends one JSON line per finished run to ``--out``
and skips runs already there, so an interrupted study resumes):

* ``main``: compare.py's setting (configs/gpt_tiny.py: 8 workers, 300 steps
  of 64 x 64 tokens) for every method of compare.py plus AccumAdamW
  variants (window T, per-window vs horizon-matched betas).
* ``scale``: n in {8, 16, 32, 64} workers on 8 simulated devices (virtual
  workers), the same global batch of 64 sequences (local batch 64 / n), a
  narrower GPT (width 64) for ``--scale_steps`` steps.
* ``cnn``: configs/cnn_fashion_mnist.py (8 workers), test accuracy.
* ``long``: ``--long_steps`` on the ``scale`` model at 16 workers, each
  method at its lr chosen at ``--scale_steps``.
* ``overlap``: compare.py's setting, DiLoCo plain vs delayed vs eager
  outer steps (arXiv 2502.12996; the reduction trickled, one round of
  latency) at ``H`` in ``--overlap_h`` (default 10 and 30), all with
  compare.py's outer Nesterov lr 0.3, each tuned by the protocol. Plain
  DiLoCo at ``H = 10`` is ``main``'s run (the same config): its records are
  reused where ``--out`` has them. One-factor variant: delayed and eager
  with outer lr 0.1 at their chosen lr, seed 0.

``main`` also runs one-factor variants at the chosen lr of the method they
vary (seed 0): AccumAdamW T = 8, DAdam on the complete graph, DAdam with
an exact average every 50 steps, DAdam with b2 0.999.

  python benchmarks/bench_evidence.py --part main      # runs, then its report
  python benchmarks/bench_evidence.py --report         # every part, from --out

The report (``--report``, or no ``--part``) reads only ``--out``; a run flag
given with it is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import _common  # benchmarks/_common.py, next to this script

_common.set_cpu_devices(8)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The main job's methods.
from decentral_jax.tools.compare import runs as compare  # noqa: E402
from decentral_jax.runner import methods  # noqa: E402
from decentral_jax.runner import tuning  # noqa: E402

GPT_TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")
CNN = os.path.join(_ROOT, "configs", "cnn_fashion_mnist.py")
OUT = os.path.join(_ROOT, "benchmarks", "results", "evidence.jsonl")
Run = compare.Run


def accum_run(t: int, convention: str) -> Run:
  """AccumAdamW on one_peer_exp with window ``t`` and a beta convention."""
  tag = "hm" if convention == "per_step" else "pw"
  return Run(f"accum_adamw_t{t}_{tag}", "decentralized", "accum_adamw",
             "one_peer_exp", fields=(("optimizer.accum_steps", t),
                                     ("optimizer.beta_convention",
                                      convention)))


def variant(run: Run, suffix: str, *fields) -> Run:
  """``run`` with further config fields, named ``<run>_<suffix>`` (its label
  names them)."""
  return Run(f"{run.name}_{suffix}", run.algorithm, run.optimizer,
             run.topology, run.workers_per_node, run.fields + tuple(fields))


AR, DADAM = compare.METHODS["all_reduce"], compare.METHODS["dadam"]
# Tuned by the protocol in compare.py's setting.
MAIN_TUNED = (AR, DADAM, accum_run(4, "per_window"), accum_run(4, "per_step"),
              compare.METHODS["local_sgd"], compare.METHODS["diloco"],
              compare.METHODS["local_dadam"],
              # The arms the later method homes declare (Method.arms).
              *(compare.METHODS[arm.name]
                for method in methods.ALGORITHMS.values()
                for arm in method.arms))
# One-factor variants, seed 0 at the chosen lr of the method they vary.
MAIN_VARIANTS = (
    (accum_run(4, "per_step"), accum_run(8, "per_step")),
    (DADAM, Run("dadam_complete", "decentralized", "adamw", "complete")),
    (DADAM, variant(DADAM, "avg50", ("global_avg_interval", 50))),
    (DADAM, variant(DADAM, "b2_0.999", ("optimizer.b2", 0.999))),
)
SCALE_MODEL = ("model.n_embd=64",)
SCALE_BATCH = 64  # the scale setting's global batch, split across --workers


def overlap_runs(h: int) -> tuple[Run, ...]:
  """DiLoCo plain, delayed and eager at sync period ``h``."""
  plain = compare.METHODS["diloco"]
  runs = []
  for mode in ("none", "delayed", "eager"):
    name = "diloco" if mode == "none" else f"diloco_{mode}"
    fields = tuple((k, h if k == "sync_every" else v) for k, v in plain.fields)
    runs.append(Run(f"{name}_h{h}", plain.algorithm,
                    plain.optimizer, plain.topology,
                    fields=fields + ((("outer_overlap", mode),)
                                     if mode != "none" else ())))
  return tuple(runs)


def part_setting(part: str, n: int = 16, steps: int = 600) -> tuple:
  """``(config file, overrides)`` of a part's setting."""
  common = ("checkpoint_interval=0",)
  if part == "main":
    return GPT_TINY, common
  if part == "cnn":
    return CNN, common + ("eval_interval=100",)
  k = max(n // 8, 1)
  return GPT_TINY, common + SCALE_MODEL + (
      f"n_workers={n}", f"workers_per_device={k}",
      f"global_batch={SCALE_BATCH}",
      f"steps={steps}", f"eval_interval={max(steps // 10, 10)}",
      f"schedule.warmup_steps={max(steps // 10, 30)}")


def record_key(r: dict) -> tuple:
  return (r["part"], r["setting"], r["method"], float(r["lr"]), r["seed"])


#: The fields of a row of ``--out`` the cache and the report read
#: (``_common.read_rows``; ``eval_loss`` null for a run that diverged).
ROW_FIELDS = {"part": "str", "setting": "str", "method": "str",
              "label": "str", "lr": "number", "seed": "int",
              "overrides": "strs", "n_workers": "int", "steps": "int",
              "global_batch": "int", "eval_loss": "real?",
              "wall_s": "number", "date_utc": "str", "load_1min": "number"}


def load(path: str) -> list[dict]:
  """The runs of ``--out`` (none if it does not exist); a damaged file is
  one ``error:`` line naming ``--out`` and the key (exit code 2)."""
  return _common.read_rows(path, "--out", ROW_FIELDS)


def train_one(part, setting_name, cfg_file, overrides, run: Run, lr, seed,
              accum_default: int = 4) -> dict:
  """Trains one (method, lr, seed) with the runner; returns its record."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import experiment  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import train
  from decentral_jax.runner import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  base = config_lib.load_config(cfg_file, list(overrides) + [f"seed={seed}"])
  config = compare.run_config(base, run, accum_default)
  with config.unlocked():
    config.schedule.peak_lr = float(lr)
    config.schedule.final_lr = float(lr) / 10
  workdir = tempfile.mkdtemp(prefix="evidence_")
  t0 = time.perf_counter()
  rec = {"part": part, "setting": setting_name, "method": run.name,
         "label": run.label, "lr": float(lr), "seed": int(seed),
         "overrides": list(overrides), "n_workers": int(config.n_workers),
         "steps": int(config.steps), "global_batch": int(config.global_batch)}
  try:
    final = train.train_and_evaluate(config, workdir,
                                     experiment=experiment.Experiment(config))
    records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    xs, ys = metrics_lib.series(records, "eval/loss")
    rec.update(eval_loss=final["eval/loss"], curve=[[int(x), float(y)] for x, y
                                                   in zip(xs, ys)],
               worker_excess_mean=final.get("eval/worker_excess_mean"),
               consensus_distance=final.get("consensus_distance"))
    if "eval/accuracy" in final:
      accs = metrics_lib.series(records, "eval/accuracy")[1]
      rec.update(accuracy=final["eval/accuracy"],
                 accuracy_curve=[float(a) for a in accs])
  except FloatingPointError as e:
    rec.update(eval_loss=None, diverged=str(e)[:200])
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  rec.update(wall_s=round(time.perf_counter() - t0, 1),
             date_utc=_common.machine_info()["date_utc"],
             load_1min=round(os.getloadavg()[0], 2))
  return rec


class Study:
  """Runs (cached in ``out``) and the protocol over them."""

  def __init__(self, out: str):
    self.out = out
    self.done = {record_key(r): r for r in load(out)}

  def get(self, part, setting, cfg, overrides, run, lr, seed, accum=4,
          parent: str = ""):
    """One run's record (trained now unless ``out`` has it).

    ``parent``: the method whose chosen lr this untuned variant runs at.
    """
    key = (part, setting, run.name, float(lr), seed)
    if key not in self.done:
      print(f"[{time.strftime('%H:%M:%S')}] {part}/{setting} {run.name} "
            f"lr={lr:g} seed={seed} ...", flush=True)
      rec = train_one(part, setting, cfg, overrides, run, lr, seed, accum)
      if parent:
        rec["at_lr_of"] = parent
      _common.write_output(self.out, "--out",
                           lambda f: f.write(json.dumps(rec) + "\n"),
                           mode="a", kept="the runs before this one are in it")
      self.done[key] = rec
      loss = rec["eval_loss"]
      print(f"    val loss {'diverged' if loss is None else f'{loss:.4f}'}"
            + (f", acc {rec['accuracy']:.4f}" if "accuracy" in rec else "")
            + f", {rec['wall_s']} s", flush=True)
    return self.done[key]

  def reuse(self, part, setting, method, new_part, new_setting, run):
    """Records of ``(part, setting, method)`` filed again as ``run`` of
    ``(new_part, new_setting)`` (the same config under another name)."""
    for key, rec in list(self.done.items()):
      if key[:3] != (part, setting, method):
        continue
      new = dict(rec, part=new_part, setting=new_setting, method=run.name,
                 label=run.label, same_run_as=f"{part}/{setting}/{method}")
      if record_key(new) not in self.done:
        _common.write_output(self.out, "--out", lambda f, new=new: f.write(
            json.dumps(new) + "\n"), mode="a")
        self.done[record_key(new)] = new

  def tune(self, part, setting, cfg, overrides, run, grid=tuning.LR_GRID,
           seeds=tuning.SEEDS, accum=4):
    """The protocol for one method: grid at seed 0, then the seeds."""
    losses = {}
    while True:
      todo = tuning.next_lrs(losses, grid)
      if not todo:
        break
      for lr in todo:
        losses[lr] = self.get(part, setting, cfg, overrides, run, lr, 0,
                              accum)["eval_loss"]
    choice = tuning.choose(losses)
    for seed in seeds:
      self.get(part, setting, cfg, overrides, run, choice.lr, seed, accum)
    return choice


def run_part(args, study: Study) -> None:
  if args.part == "main":
    cfg, ov = part_setting("main")
    chosen = {}
    for run in MAIN_TUNED:
      if args.methods and run.name not in args.methods.split(","):
        continue
      # The paper's per-window convention is a reference row: seed 0 only.
      seeds = (0,) if run.name == "accum_adamw_t4_pw" else tuning.SEEDS
      chosen[run.name] = study.tune("main", "gpt_tiny_n8_300", cfg, ov,
                                    run, seeds=seeds).lr
    for parent, run in MAIN_VARIANTS:
      if parent.name in chosen and not args.methods:
        study.get("main", "gpt_tiny_n8_300", cfg, ov, run, chosen[parent.name],
                  0, parent=parent.name)
  elif args.part == "scale":
    hm4 = accum_run(4, "per_step")
    for n in args.workers:
      cfg, ov = part_setting("scale", n, args.scale_steps)
      setting = f"gpt64_n{n}_{args.scale_steps}"
      chosen = {}
      for run in (AR, DADAM, hm4):
        chosen[run.name] = study.tune("scale", setting, cfg, ov, run,
                                      grid=args.scale_grid,
                                      seeds=args.scale_seeds).lr
      if n in (16, 64):  # T = n / 2 and the paper's betas, at T = 4's lr
        for run in (accum_run(n // 2, "per_step"),
                    accum_run(4, "per_window")):
          study.get("scale", setting, cfg, ov, run, chosen[hm4.name], 0,
                    parent=hm4.name)
  elif args.part == "cnn":
    cfg, ov = part_setting("cnn")
    for run in (AR, DADAM, accum_run(4, "per_step")):
      study.tune("cnn", "cnn_n8_500", cfg, ov, run, grid=args.cnn_grid,
                 seeds=args.scale_seeds)
  elif args.part == "long":
    # 16 workers, --long_steps steps, each method at its lr chosen at
    # --scale_steps (tuned there now if it is not in --out yet), seed 0.
    n = 16
    short = part_setting("scale", n, args.scale_steps)
    cfg, ov = part_setting("scale", n, args.long_steps)
    setting = f"gpt64_n{n}_{args.long_steps}"
    hm4 = accum_run(4, "per_step")
    for run in (AR, DADAM, hm4):
      parent = AR if run is AR else hm4 if run is hm4 else DADAM
      lr = study.tune("scale", f"gpt64_n{n}_{args.scale_steps}", *short,
                      parent, grid=args.scale_grid,
                      seeds=args.scale_seeds).lr
      study.get("long", setting, cfg, ov, run, lr, 0,
                parent=f"{parent.name} at {args.scale_steps} steps")
  elif args.part == "overlap":
    cfg, ov = part_setting("main")
    for h in args.overlap_h:
      setting = f"gpt_tiny_n8_300_H{h}"
      for run in overlap_runs(h):
        if run.name == "diloco_h10":
          study.reuse("main", "gpt_tiny_n8_300", "diloco", "overlap", setting,
                      run)
        lr = study.tune("overlap", setting, cfg, ov, run).lr
        if run.name != f"diloco_h{h}":  # the paper lowers delayed's outer lr
          study.get("overlap", setting, cfg, ov,
                    variant(run, "outer0.1", "outer lr 0.1",
                            ("outer_optimizer.lr", 0.1)), lr, 0,
                    parent=run.name)
  else:
    raise SystemExit(f"--part {args.part!r} is not implemented yet.")


def _lr(x: float) -> str:
  return f"{x:g}"


def _method_rows(rs: list[dict]) -> list[tuple]:
  """``(method, label, seed-0 losses by lr, chosen, runs at it, parent)``."""
  rows = []
  for m in dict.fromkeys(r["method"] for r in rs):
    mine = [r for r in rs if r["method"] == m]
    seed0 = {r["lr"]: r["eval_loss"] for r in mine if r["seed"] == 0}
    parent = next((r["at_lr_of"] for r in mine if r.get("at_lr_of")), "")
    try:
      ch = tuning.choose(seed0)
    except ValueError:
      ch = None
    at = [r for r in mine if ch is not None and r["lr"] == ch.lr]
    rows.append((m, mine[0]["label"], seed0, ch, at, parent))
  return rows


def report(records: list[dict]) -> str:
  """Markdown tables per (part, setting): seed-0 grid, chosen lr, seeds."""
  out = []
  groups = {}
  for r in records:
    groups.setdefault((r["part"], r["setting"]), []).append(r)
  for (part, setting), rs in groups.items():
    lrs = sorted({r["lr"] for r in rs})
    r0 = rs[0]
    dates = sorted(r["date_utc"] for r in rs)
    loads = [r["load_1min"] for r in rs]
    out.append(f"### {part}: {setting}\n\n{r0['n_workers']} workers, "
               f"{r0['steps']} steps, global batch {r0['global_batch']}; "
               f"config overrides {' '.join(r0['overrides'])}; {len(rs)} "
               f"runs, {dates[0]} to {dates[-1]} UTC, 1-min load "
               f"{min(loads):.1f} to {max(loads):.1f}, "
               f"{sum(r['wall_s'] for r in rs) / 60:.0f} min in all.\n")
    has_acc = any("accuracy" in r for r in rs)
    rows = _method_rows(rs)
    ar = next((at for m, _, _, _, at, _ in rows if m == AR.name and at),
              None)
    ar_mean = (tuning.summarize([r["eval_loss"] for r in ar])[0]
               if ar else None)
    if ar_mean is not None and ar_mean == float("inf"):
      ar_mean = None  # an All-Reduce seed diverged: no baseline
    out.append("| method | " + " | ".join(f"lr {_lr(lr)}" for lr in lrs)
               + " | chosen lr | val loss at it, mean +- 2 sigma | vs "
               "All-Reduce |" + (" test accuracy |" if has_acc else "")
               + "\n|---|" + "---|" * (len(lrs) + 3 + has_acc))
    for _, label, seed0, ch, at, parent in rows:
      cells = ["" if lr not in seed0 else "div." if seed0[lr] is None
               else f"{seed0[lr]:.4f}" for lr in lrs]
      if ch is None:
        chosen, loss, diff, acc = "-", "all diverged", "-", "-"
      else:
        chosen = (f"{_lr(ch.lr)} (lr of {parent}, not tuned)" if parent
                  else _lr(ch.lr) + (f" ({ch.edge} edge of the grid)"
                                     if ch.edge else ""))
        losses = [r["eval_loss"] for r in at]
        loss = tuning.format_mean_2sigma(losses)
        mean = tuning.summarize(losses)[0]
        if ar_mean is None:
          diff = "-"
        elif at is ar:
          diff = "0"
        else:
          diff = f"{mean - ar_mean:+.4f}"
        accs = [r.get("accuracy") for r in at]
        acc = (tuning.format_mean_2sigma(accs) if accs and
               all(a is not None for a in accs) else "-")
      out.append(f"| {label} | " + " | ".join(cells) + f" | {chosen} | "
                 f"{loss} | {diff} |" + (f" {acc} |" if has_acc else ""))
    out.append("")
  return "\n".join(out)


def parse_args(argv=None):
  """The flags, each checked before any training (one ``error:`` line):
  ``--out`` is appended to by ``--part`` (else only read, if it exists),
  ``--methods`` names methods of the main part."""
  from decentral_jax.tools import flag_types  # one error: line
  count, real = flag_types.integer, flag_types.real  # bounded flag types
  p = flag_types.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--part", choices=("main", "scale", "cnn", "long",
                                    "overlap"))
  p.add_argument("--methods", default="", help="main: only these methods")
  p.add_argument("--out", default=OUT)
  p.add_argument("--report", action="store_true")
  p.add_argument("--workers", type=count(1, 4096),
                 nargs="+", default=[8, 16, 32, 64])
  p.add_argument("--scale_steps", type=count(1, 10**7), default=600)
  p.add_argument("--long_steps", type=count(1, 10**7), default=3000)
  p.add_argument("--cnn_grid", type=real(0, 10, open_lo=True), nargs="+",
                 default=[5e-4, 1e-3, 2e-3, 4e-3])
  p.add_argument("--scale_grid", type=real(0, 10, open_lo=True), nargs="+",
                 default=[3e-3, 6e-3, 1.2e-2])
  p.add_argument("--scale_seeds", type=count(0, 2**32 - 1),
                 nargs="+", default=[0])
  p.add_argument("--overlap_h", type=count(1, 2**31 - 1),
                 nargs="+", default=[10, 30])
  args = p.parse_args(argv)
  writes = bool(args.part) and not args.report
  if not writes:
    _common.check_report_flags(
        p, argv, mode="with --report" if args.report else "without --part",
        reads=("--out", "--report"))
  _common.check_flags(
      p, args, outputs=("--out",) if writes else (),
      inputs=("--out",) if not writes and (
          not args.out.strip() or os.path.lexists(args.out)) else (),
      rules=(_check_methods, _check_workers))
  return args


def _check_workers(args) -> None:
  """``--part scale``: each of ``--workers`` divides the setting's global
  batch of SCALE_BATCH sequences (split evenly across the workers)."""
  bad = [n for n in args.workers if SCALE_BATCH % n]
  if args.part == "scale" and bad:
    fits = [d for d in range(1, SCALE_BATCH + 1) if SCALE_BATCH % d == 0]
    raise ValueError(f"--workers {bad[0]}: --part scale splits its global "
                     f"batch of {SCALE_BATCH} sequences evenly across the "
                     "workers; give worker counts that divide it "
                     f"({', '.join(map(str, fits))}).")


def _check_methods(args) -> None:
  """``--methods`` names methods of :data:`MAIN_TUNED`."""
  known = [r.name for r in MAIN_TUNED]
  for name in filter(None, args.methods.split(",")):
    if name not in known:
      raise ValueError(f"--methods: unknown method {name!r}; give some of "
                       f"{','.join(known)}.")


def main(argv=None) -> None:
  args = parse_args(argv)
  study = Study(args.out)
  if args.part and not args.report:
    _common.check_cpu_devices(8, "bench_evidence.py", flag=False)
    run_part(args, study)
  print(report(list(study.done.values())))


if __name__ == "__main__":
  main()
