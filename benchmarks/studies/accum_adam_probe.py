"""Step size of AccumAdam vs Adam on the same gradient stream (gpt_tiny).

Trains one run with the runner (``decentral_jax.runner.experiment.Experiment``; 8
workers, 32 sequences x 64 tokens per step, ``--follow`` selects the
optimizer that moves the parameters) and, at every step, feeds the *same*
gradients to side copies ("probes") of Adam (``optax.scale_by_adam``) and
AccumAdam (``decentral_jax.optim.scale_by_accum_adam``, T = 2 and 4), all
with b1 0.9, b2 0.95, eps 1e-8. Probes never move the parameters. Two
gradient streams: ``global`` (the exact worker average, clipped to norm 1:
what All-Reduce optimizers see) and ``local`` (each worker's own gradient
of 4 sequences, clipped: what DAdam / decentralized AccumAdamW see).

Per step and probe it records the RMS of the direction ``d`` (the update
before learning rate and weight decay), its cosine with Adam's direction on
the same stream, and the cosine of the previous step's ``d`` with this
step's global gradient (a proxy for how well the direction points
downhill). For AccumAdam T = 4 it also records the geometric mean over
coordinates of sqrt(V_hat_accum / nu_hat_adam), the ratio of the two
second-moment denominators (bias-corrected; V from completed windows).
The final validation loss printed is that of the followed run on the
gpt_tiny default of 4 validation batches (``bench_convergence.py`` uses 8).
Results are appended to ``benchmarks/studies/results/accum_adam_probe.jsonl``.

``--toy`` instead evaluates the same recursions on i.i.d. synthetic
gradients g = mu + sigma * xi per coordinate, at several signal-to-noise
ratios, in NumPy.

  python benchmarks/studies/accum_adam_probe.py --follow adamw --lr 3e-3
  python benchmarks/studies/accum_adam_probe.py --follow accum4 --lr 1.5e-3
  python benchmarks/studies/accum_adam_probe.py --toy
  python benchmarks/studies/accum_adam_probe.py --report   # summaries
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

B1, B2, EPS = 0.9, 0.95, 1e-8
PROBES = ("adam", "accum2", "accum4")


def _probe_tx(name):
  from decentral_jax import optim  # pylint: disable=import-outside-toplevel
  if name == "adam":
    return optax.scale_by_adam(B1, B2, EPS)
  return optim.scale_by_accum_adam(B1, B2, EPS, accum_steps=int(name[5:]))


def _flat(tree):
  return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def _cos(a, b):
  return jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b) + 1e-30)


def run_probe(args) -> dict:
  """Follows one run and returns per-step probe metrics (worker means)."""
  from decentral_jax.runner import config  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import experiment
  from decentral_jax import optim
  from decentral_jax import parallel
  adamw = args.follow == "adamw"
  c = config.load_config(GPT_TINY, [
      "algorithm=all_reduce", "n_workers=8",
      f"optimizer.name={'adamw' if adamw else 'accum_adamw'}",
      f"optimizer.accum_steps={1 if adamw else 4}",
      f"optimizer.b1={B1!r}", f"optimizer.b2={B2!r}", f"optimizer.eps={EPS!r}",
      f"schedule.peak_lr={args.lr!r}", f"schedule.final_lr={args.lr / 10!r}",
      f"steps={args.steps}", "global_batch=32", "seed=0", "eval_interval=0",
      f"log_interval={10**9}"])
  exp = experiment.Experiment(c)
  axis, mesh = exp.axis_name, exp.mesh
  clip = optax.clip_by_global_norm(float(c.grad_clip))
  mean = optim.all_reduce_gradients(axis)
  streams = ("global", "local")
  txs = {p: _probe_tx(p) for p in PROBES}

  def init(params, opt_state):
    probes = {(s, p): txs[p].init(params) for s in streams for p in PROBES}
    prev = {(s, p): jax.tree.map(jnp.zeros_like, params)
            for s in streams for p in PROBES}
    return params, opt_state, probes, prev

  def step(params, opt_state, probes, prev, batch):
    (loss, _), g = jax.value_and_grad(exp.task.loss, has_aux=True)(
        params, batch, None)
    upd, opt_state = exp.tx.update(g, opt_state, params)
    new_params = optax.apply_updates(params, upd)
    g_glob, _ = clip.update(mean.update(g, optax.EmptyState())[0],
                            optax.EmptyState())
    g_loc, _ = clip.update(g, optax.EmptyState())
    gg = _flat(g_glob)
    out = {"loss": loss}
    new_probes, new_prev, flat_d = {}, {}, {}
    for s, gs in (("global", g_glob), ("local", g_loc)):
      for p in PROBES:
        d, new_probes[(s, p)] = txs[p].update(gs, probes[(s, p)])
        new_prev[(s, p)] = d
        flat_d[(s, p)] = fd = _flat(d)
        out[f"{s}/{p}/rms"] = jnp.sqrt(jnp.mean(fd * fd))
        out[f"{s}/{p}/cos_next_g"] = _cos(_flat(prev[(s, p)]), gg)
      for p in PROBES[1:]:
        out[f"{s}/{p}/cos_adam"] = _cos(flat_d[(s, p)], flat_d[(s, "adam")])
      st_a, st_c = new_probes[(s, "adam")], new_probes[(s, "accum4")]
      nu_a = _flat(st_a.nu) / (1 - B2 ** st_a.count.astype(jnp.float32))
      done = (st_c.count // 4).astype(jnp.float32)
      nu_c = _flat(st_c.nu) / (1 - B2 ** jnp.maximum(done, 1.0))
      ratio = jnp.exp(0.5 * jnp.mean(jnp.log((nu_c + 1e-30) /
                                             (nu_a + 1e-30))))
      out[f"{s}/accum4/denom_ratio"] = jnp.where(done >= 1, ratio, jnp.nan)
    return new_params, opt_state, new_probes, new_prev, out

  state = exp.init_state()
  f_init = jax.jit(parallel.per_worker(init, mesh))
  f_step = jax.jit(parallel.per_worker(step, mesh),
                   donate_argnums=(0, 1, 2, 3))
  params, opt_state, probes, prev = f_init(state.params, state.opt_state)
  rows, pending = [], None
  t0 = time.perf_counter()
  for s in range(c.steps):
    params, opt_state, probes, prev, out = f_step(
        params, opt_state, probes, prev, exp.get_batch(s))
    if pending is not None:
      rows.append({k: float(np.mean(v)) for k, v in
                   jax.device_get(pending).items()})
    pending = out
  rows.append({k: float(np.mean(v)) for k, v in
               jax.device_get(pending).items()})
  st = exp.init_state().replace(params=params)
  ev = exp.evaluate(st)["eval/loss"]
  return {"follow": args.follow, "lr": args.lr, "steps": c.steps,
          "eval_loss": ev, "rows": rows,
          "wall_s": round(time.perf_counter() - t0, 1),
          "date_utc": _common.machine_info()["date_utc"]}


def summarize(res, spans=((1, 30), (31, 100), (101, 200))) -> str:
  rows = res["rows"]

  def avg(key, a, b):
    v = np.array([r[key] for r in rows[a - 1:b]])
    v = v[np.isfinite(v)]
    return float(np.mean(v)) if v.size else float("nan")

  lines = [f"follow={res['follow']} lr={res['lr']:g} steps={res['steps']} "
           f"final val loss {res['eval_loss']:.4f} ({res['date_utc']} UTC, "
           f"{res['wall_s']} s)", "",
           "| stream | steps | RMS d adam | RMS d accum2 / adam | "
           "RMS d accum4 / adam | cos(accum4, adam) | cos(d_{t-1}, g_t) "
           "adam / accum2 / accum4 | sqrt(V_accum4 / nu_adam) |",
           "|---|---|---|---|---|---|---|---|"]
  for s in ("global", "local"):
    for a, b in spans:
      if a > len(rows):
        continue
      b = min(b, len(rows))
      ra = avg(f"{s}/adam/rms", a, b)
      r2 = avg(f"{s}/accum2/rms", a, b) / ra
      r4 = avg(f"{s}/accum4/rms", a, b) / ra
      cn = " / ".join(f"{avg(f'{s}/{p}/cos_next_g', max(a, 2), b):.4f}"
                      for p in PROBES)
      lines.append(
          f"| {s} | {a}-{b} | {ra:.4f} | {r2:.3f} | {r4:.3f} | "
          f"{avg(f'{s}/accum4/cos_adam', a, b):.3f} | {cn} | "
          f"{avg(f'{s}/accum4/denom_ratio', a, b):.3f} |")
  # Path length: sum_t lr_t * RMS(d_t), as a ratio to Adam's (schedule of
  # the followed run; the peak lr cancels).
  from decentral_jax.runner import builders  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import config
  c = config.load_config(GPT_TINY, [f"steps={res['steps']}",
                                    "schedule.peak_lr=1.0",
                                    "schedule.final_lr=0.1"])
  sched = builders.make_schedule(c)
  w = np.array([float(sched(t)) for t in range(len(rows))])
  lines.append("")
  for s in ("global", "local"):
    a = np.array([r[f"{s}/adam/rms"] for r in rows])
    parts = []
    for p in PROBES[1:]:
      b = np.array([r[f"{s}/{p}/rms"] for r in rows])
      parts.append(f"{p} / adam {np.sum(w * b) / np.sum(w * a):.3f}")
    lines.append(f"{s} stream, lr-weighted sum of RMS d over all steps: "
                 + ", ".join(parts))
  return "\n".join(lines)


def toy(n_coord=20000, steps=2000, seed=0) -> str:
  """Adam vs AccumAdam on i.i.d. g = mu + sigma*xi, in NumPy (no JAX)."""
  rng = np.random.default_rng(seed)
  lines = ["| |mu|/sigma | RMS d adam | RMS d accum2 / adam | "
           "RMS d accum4 / adam | sqrt(v_hat accum4 / v_hat adam) |",
           "|---|---|---|---|---|"]
  for snr in (0.0, 0.1, 0.3, 1.0, 3.0):
    g_all = snr + rng.standard_normal((steps, n_coord))
    res = {}
    for big_t in (1, 2, 4):
      m = np.zeros(n_coord)
      v = np.zeros(n_coord)
      a = np.zeros(n_coord)
      rms, den = [], []
      for t in range(1, steps + 1):
        g = g_all[t - 1]
        k = (t + big_t - 1) // big_t
        a += g / big_t
        mh = (B1 * m + (1 - B1) * g) / (1 - B1 ** k)
        vh = (B2 * v + (1 - B2) * g * g) / (1 - B2 ** k)
        if t > steps // 2:
          rms.append(np.sqrt(np.mean((mh / (np.sqrt(vh) + EPS)) ** 2)))
          den.append(np.sqrt(vh))
        if t % big_t == 0:
          m = B1 * m + (1 - B1) * a
          v = B2 * v + (1 - B2) * a * a
          a[:] = 0
      res[big_t] = (np.mean(rms), np.mean(den, axis=0))
    dr = np.exp(np.mean(np.log(res[4][1] / res[1][1])))
    lines.append(f"| {snr:g} | {res[1][0]:.4f} | {res[2][0] / res[1][0]:.3f} "
                 f"| {res[4][0] / res[1][0]:.3f} | {dr:.3f} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--follow", choices=("adamw", "accum4"), default="adamw")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--toy", action="store_true")
  ap.add_argument("--out", default=os.path.join(
      _HERE, "results", "accum_adam_probe.jsonl"))
  ap.add_argument("--report", action="store_true",
                  help="print the summaries of every run in --out")
  args = ap.parse_args()
  if args.report:
    with open(args.out) as f:
      for line in f:
        if line.strip():
          print(summarize(json.loads(line)) + "\n")
    return
  if args.toy:
    print("i.i.d. toy, b1 0.9, b2 0.95, second half of 2000 steps, "
          "20000 coordinates:")
    print(toy())
    return
  jax.config.update("jax_compilation_cache_dir",
                    "/tmp/decentral_jax_bench_cache")
  res = run_probe(args)
  with open(args.out, "a") as f:
    f.write(json.dumps(res) + "\n")
  print(summarize(res))


if __name__ == "__main__":
  main()
