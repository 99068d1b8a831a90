"""Side by side with the authors' library: decentral_jax vs decent-dp on CPU.

Same tiny causal LM on both sides (byte vocabulary 256, 2 layers, width 128,
4 heads, context 64, no biases, tied head; 434,816 parameters), local batch 8
sequences per worker, AccumAdamW with ``accum_steps`` 4 on the one-peer
exponential graph, 8 workers, random windows of the bundled CPython
documentation text:

* decent-dp 0.2.3 on PyTorch CPU: 8 gloo processes launched by ``torchrun``
  with ``OMP_NUM_THREADS=1`` (``benchmarks/decentdp_side_by_side.py``);
* decentral_jax: one process, 8 simulated CPU devices
  (``--xla_force_host_platform_device_count=8``), the step
  ``jit(shard_map(grad -> decentralized_adamw(accum_steps=4)))`` with
  parameters and optimizer state donated; with XLA's default flags, and with
  ``--xla_cpu_multi_thread_eigen=false`` (each device's matmuls on one
  thread, the counterpart of the PyTorch side's ``OMP_NUM_THREADS=1``).

Each side runs ``--warmup`` steps (compilation and decent-dp's first two
special iterations included there) and then ``--steps`` timed steps; tokens/s
counts all workers' tokens. Runs alternate between the sides (A B, B A, ...)
``--repeats`` times, each in a fresh process; the table reports medians and
the ratio decentral_jax / decent-dp of the medians. Because the machine may
be shared, each side also reports tokens per CPU-second (user + system time
of all its processes and threads during the timed steps), which does not
depend on how many cores other programs leave free.

Optional dependency, not used by CI: ``pip install torch==2.13.0 decent-dp
loguru``.

  python benchmarks/bench_vs_decentdp.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)


def _bucketed_mix(mix):
  """``gossip.mix`` that sends each dtype's leaves as ONE buffer per round.

  A prototype of a proposed change (not the shipped library): leaves of a
  dtype are concatenated, mixed with one collective per permute term, and
  split again, like decent-dp's contiguous buckets.
  """
  import jax
  import jax.numpy as jnp

  def bucketed(tree, topology, step, axis_name="workers", *, comm_dtype=None):
    leaves, treedef = jax.tree.flatten(tree)
    groups = {}
    for i, x in enumerate(leaves):
      groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    out = list(leaves)
    for idx in groups.values():
      flat = jnp.concatenate([leaves[i].ravel() for i in idx])
      mixed = mix(flat, topology, step, axis_name, comm_dtype=comm_dtype)
      offset = 0
      for i in idx:
        size = leaves[i].size
        out[i] = mixed[offset:offset + size].reshape(leaves[i].shape)
        offset += size
    return treedef.unflatten(out)

  return bucketed


def jax_side(args) -> dict:
  """Runs the decentral_jax side in this process; returns its measurements.

  Layouts: ``tree`` (parameters as the model's pytree: the plain library
  usage), ``flat`` (one float32 vector of all parameters, made with
  ``jax.flatten_util.ravel_pytree``, unravelled inside the loss; same
  optimizer, weight decay masked per element), ``bucketed`` (pytree, with
  the gossip prototype :func:`_bucketed_mix`).
  """
  from benchmarks import _common
  _common.set_cpu_devices(args.workers, single_thread_eigen=args.one_thread)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.flatten_util import ravel_pytree
  from decentral_jax import gossip, models, optim, parallel, topology
  from decentral_jax.data import text
  from decentral_jax.models import gpt

  n, b, t = args.workers, args.local_batch, args.context
  cfg = gpt.GPTConfig(vocab_size=256, block_size=t, n_layer=2, n_head=4,
                      n_embd=128, bias=False, dropout=0.0, dtype=jnp.float32)
  mesh = parallel.make_mesh(n)
  topo = topology.make("one_peer_exp", n)
  p0 = gpt.init_params(cfg, jax.random.key(0))
  if args.layout == "bucketed":
    gossip.mix = _bucketed_mix(gossip.mix)
  if args.layout == "flat":
    flat0, unravel = ravel_pytree(p0)
    decay = ravel_pytree(jax.tree.map(
        lambda x: jnp.full(x.shape, float(x.ndim >= 2)), p0))[0]
    tx = optim.decentralized_adamw(
        args.lr, topo, b1=0.9, b2=0.95, weight_decay=0.1 * decay, mask=None,
        accum_steps=args.accum_steps)
    model = models.GPT(cfg)

    def loss_fn(flat, tokens):
      logits = model.apply({"params": unravel(flat)}, tokens[:, :-1])
      return models.lm_loss(logits, tokens[:, 1:])

    def one(flat, s, tokens):
      loss, g = jax.value_and_grad(loss_fn)(flat, tokens)
      u, s = tx.update(g, s, flat)
      return optax.apply_updates(flat, u), s, loss

    step = jax.jit(parallel.per_worker(one, mesh), donate_argnums=(0, 1))
    params = parallel.replicate(flat0, mesh)
  else:
    tx = optim.decentralized_adamw(
        args.lr, topo, b1=0.9, b2=0.95, weight_decay=0.1,
        accum_steps=args.accum_steps)
    step = _common.gpt_step(cfg, tx, mesh)
    params = parallel.replicate(p0, mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  data = np.frombuffer(text.pydoc_corpus(), np.uint8).astype(np.int32)
  rng = np.random.default_rng(1234)
  sharding = parallel.worker_sharding(mesh)

  def batch():
    starts = rng.integers(0, len(data) - t - 1, size=n * b)
    windows = data[starts[:, None] + np.arange(t + 1)[None]]
    return jax.device_put(windows.reshape(n, b, t + 1), sharding)

  loss = None
  t_compile = time.perf_counter()
  for i in range(args.warmup):
    params, state, loss = step(params, state, batch())
    loss.block_until_ready()
    if i == 0:
      t_compile = time.perf_counter() - t_compile
  t0 = time.perf_counter()
  c0 = time.process_time()  # all threads of this process
  prev = None
  for _ in range(args.steps):
    params, state, loss = step(params, state, batch())
    if prev is not None:  # at most two steps in flight
      prev.block_until_ready()
    prev = loss
  loss.block_until_ready()
  elapsed = time.perf_counter() - t0
  cpu = time.process_time() - c0
  return {"side": f"decentral_jax-{args.layout}"
                  + ("-1thread" if args.one_thread else ""),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "tokens_per_s": n * b * t * args.steps / elapsed,
          "ms_per_step": 1e3 * elapsed / args.steps, "steps": args.steps,
          "cpu_s_per_step": cpu / args.steps,
          "tokens_per_cpu_s": n * b * t * args.steps / cpu,
          "world_size": n, "final_loss_worker0": float(np.asarray(loss)[0]),
          "compile_plus_first_step_s": round(t_compile, 2),
          "jax": jax.__version__, "params": gpt.num_params(p0)}


def _last_json(stdout: str) -> dict:
  for line in reversed(stdout.strip().splitlines()):
    line = line.strip()
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError("no JSON result in the output:\n" + stdout[-2000:])


def run_side(side: str, args) -> dict:
  common = ["--steps", str(args.steps), "--warmup", str(args.warmup),
            "--local_batch", str(args.local_batch), "--context",
            str(args.context), "--accum_steps", str(args.accum_steps),
            "--lr", str(args.lr)]
  if side.startswith("jax"):
    cmd = [sys.executable, os.path.abspath(__file__), "--child_jax",
           "--workers", str(args.workers), "--layout", side.split(":")[1]
           ] + common + (["--one_thread"] if side.endswith(":1t") else [])
    env = dict(os.environ)
  else:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(args.workers),
           os.path.join(_ROOT, "benchmarks", "decentdp_side_by_side.py")
           ] + common
    env = dict(os.environ, OMP_NUM_THREADS="1")
  r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                     timeout=args.timeout, cwd=_ROOT)
  if r.returncode != 0:
    raise RuntimeError(f"{side} side failed (exit {r.returncode}):\n"
                       f"{r.stderr[-3000:]}")
  return _last_json(r.stdout)


NAMES = {
    "torch": "decent-dp 0.2.3 (PyTorch CPU, 8 gloo processes, 1 thread each)",
    "jax:tree": "decentral_jax, pytree parameters, default XLA flags",
    "jax:flat": "decentral_jax, flat parameter vector, default XLA flags",
    "jax:bucketed": "decentral_jax, pytree + bucketed-gossip prototype",
}
for _k in list(NAMES):
  if _k.startswith("jax:"):
    NAMES[_k + ":1t"] = NAMES[_k].replace(
        "default XLA flags", "single-threaded Eigen").replace(
            "prototype", "prototype, single-threaded Eigen")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--workers", type=int, default=8)
  ap.add_argument("--local_batch", type=int, default=8)
  ap.add_argument("--context", type=int, default=64)
  ap.add_argument("--accum_steps", type=int, default=4)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--jax_sides", nargs="+",
                  default=["tree", "tree:1t", "flat:1t"],
                  help="decentral_jax variants: LAYOUT or LAYOUT:1t with "
                       "LAYOUT in tree, flat, bucketed (see jax_side); ':1t' "
                       "adds --xla_cpu_multi_thread_eigen=false")
  ap.add_argument("--one_thread", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--layout", default="tree", help=argparse.SUPPRESS)
  ap.add_argument("--timeout", type=int, default=600)
  ap.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                "vs_decentdp.jsonl"))
  ap.add_argument("--child_jax", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child_jax:
    print(json.dumps(jax_side(args)), flush=True)
    return

  import statistics
  from benchmarks import _common
  try:
    import decent_dp  # noqa: F401
    import torch  # noqa: F401
  except ImportError:
    sys.exit("decent-dp is not installed: pip install torch==2.13.0 "
             "decent-dp loguru")
  print("machine:", json.dumps(_common.machine_info()), flush=True)
  sides = ["torch"] + [f"jax:{v}" for v in args.jax_sides]
  results = {side: [] for side in sides}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  for rep in range(args.repeats):
    k = rep % len(sides)
    for side in sides[k:] + sides[:k]:  # rotate the order every repeat
      res = run_side(side, args)
      info = _common.machine_info()
      res.update(repeat=rep, date_utc=info["date_utc"],
                 load_avg_1m=info.get("load_avg_1m"))
      results[side].append(res)
      with open(args.out, "a") as f:
        f.write(json.dumps(res) + "\n")
      print(f"repeat {rep} {side:<13} {res['tokens_per_s']:>10,.0f} "
            f"tokens/s  {res['ms_per_step']:.1f} ms/step  (load "
            f"{res['load_avg_1m']})", flush=True)
  med = {k: statistics.median(r["tokens_per_s"] for r in v)
         for k, v in results.items()}
  rows = []
  for side in sides:
    rows.append({
        "library": NAMES[side],
        "tokens/s (median)": f"{med[side]:,.0f}",
        "ms/step (median)": f"{statistics.median(r['ms_per_step'] for r in results[side]):.1f}",
        "vs decent-dp": f"{med[side] / med['torch']:.2f}x",
        "tokens per CPU-second (median)": f"{statistics.median(r['tokens_per_cpu_s'] for r in results[side]):,.0f}",
        "CPU-s/step (median)": f"{statistics.median(r['cpu_s_per_step'] for r in results[side]):.3f}",
        "runs (tokens/s)": ", ".join(f"{r['tokens_per_s']:,.0f}"
                                     for r in results[side]),
    })
  print()
  print(_common.format_table(rows, list(rows[0])))


if __name__ == "__main__":
  main()
