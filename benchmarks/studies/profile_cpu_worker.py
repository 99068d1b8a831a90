"""Where the CPU time of the side-by-side benchmark goes (per worker step).

Times, on the side-by-side model (byte GPT, 2 layers, width 128, 4 heads,
context 64, 8 sequences per worker), with one thread where the library
allows it:

* decentral_jax on ONE device: the jitted forward, forward+backward, the
  AccumAdamW update, and the whole per-worker step;
* PyTorch in this process (``torch.set_num_threads(1)``): forward,
  forward+backward and decent-dp's ``AccumAdamW.step``;
* decentral_jax on 8 simulated devices in a child process: the whole step
  with no communication (local AccumAdamW only), with All-Reduce, and with
  one-peer-exponential gossip: wall time and the process's CPU time per step.

Best of 5 repeats of 20 calls (8-device rows: median of 4 repeats of 10
steps), in ms. PyTorch rows need ``pip install torch==2.13.0 decent-dp
loguru``; they are skipped with a note otherwise.

  python benchmarks/studies/profile_cpu_worker.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# benchmarks/, for _common and decentdp_side_by_side
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _best(fn, reps=5, calls=20):
  for _ in range(3):
    fn()
  out = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls):
      fn()
    out.append((time.perf_counter() - t0) / calls * 1e3)
  return round(min(out), 2)


def jax_one_device() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from decentral_jax import models
  from decentral_jax import optim
  from decentral_jax.models import gpt
  cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                      n_embd=128, bias=False, dropout=0.0, dtype=jnp.float32)
  model = models.GPT(cfg)
  p = gpt.init_params(cfg, jax.random.key(0))
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 65)),
                    jnp.int32)

  def loss_fn(p, t):
    return models.lm_loss(model.apply({"params": p}, t[:, :-1]), t[:, 1:])

  tx = optax.chain(optim.scale_by_accum_adam(0.9, 0.95, accum_steps=4),
                   optax.add_decayed_weights(0.1),
                   optax.scale_by_learning_rate(3e-3))
  s = tx.init(p)
  fwd = jax.jit(loss_fn)
  fb = jax.jit(jax.value_and_grad(loss_fn))
  upd = jax.jit(tx.update)
  _, g = fb(p, tok)

  def step(p, s, t):
    loss, g = jax.value_and_grad(loss_fn)(p, t)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  stepj = jax.jit(step)
  return {
      "jax 1 device: forward": _best(lambda: fwd(p, tok).block_until_ready()),
      "jax 1 device: forward+backward": _best(
          lambda: jax.block_until_ready(fb(p, tok))),
      "jax 1 device: AccumAdamW update": _best(
          lambda: jax.block_until_ready(upd(g, s, p))),
      "jax 1 device: whole step": _best(
          lambda: jax.block_until_ready(stepj(p, s, tok))),
  }


def torch_one_process() -> dict:
  try:
    import torch
    import torch.nn.functional as F
    from decent_dp.optim import AccumAdamW
  except ImportError:
    return {"torch": "not installed"}
  from decentdp_side_by_side import TinyGPT
  torch.set_num_threads(1)
  m = TinyGPT()
  opt = AccumAdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95),
                   accum_iter=4)
  x = torch.randint(0, 256, (8, 65))

  def fwd():
    with torch.no_grad():
      F.cross_entropy(m(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))

  def fb():
    F.cross_entropy(m(x[:, :-1]).reshape(-1, 256),
                    x[:, 1:].reshape(-1)).backward()

  def whole():
    fb()
    opt.step()
    opt.zero_grad()

  return {"torch 1 thread: forward (no_grad)": _best(fwd),
          "torch 1 thread: forward+backward": _best(fb),
          "torch 1 thread: AccumAdamW.step": _best(opt.step),
          "torch 1 thread: whole step": _best(whole)}


def jax_eight_devices(mode: str) -> dict:
  import _common
  _common.set_cpu_devices(8)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from decentral_jax import optim
  from decentral_jax import parallel
  from decentral_jax import topology
  from decentral_jax.models import gpt
  cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                      n_embd=128, bias=False, dropout=0.0, dtype=jnp.float32)
  mesh = parallel.make_mesh(8)
  inner = optax.chain(optim.scale_by_accum_adam(0.9, 0.95, accum_steps=4),
                      optax.add_decayed_weights(0.1),
                      optax.scale_by_learning_rate(3e-3))
  tx = {"local": inner,
        "all-reduce": optax.chain(optim.all_reduce_gradients(), inner),
        "gossip": optim.decentralized(inner, topology.make("one_peer_exp", 8)),
        }[mode]
  step = _common.gpt_step(cfg, tx, mesh)
  params = parallel.replicate(gpt.init_params(cfg, jax.random.key(0)), mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  tok = jax.device_put(np.random.default_rng(0).integers(
      0, 256, (8, 8, 65)).astype(np.int32), parallel.worker_sharding(mesh))
  for _ in range(3):
    params, state, loss = step(params, state, tok)
    loss.block_until_ready()
  wall, cpu = [], []
  for _ in range(4):
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(10):
      params, state, loss = step(params, state, tok)
      loss.block_until_ready()
    wall.append((time.perf_counter() - t0) / 10 * 1e3)
    cpu.append((time.process_time() - c0) / 10 * 1e3)
  return {f"jax 8 devices, {mode}: wall ms/step": round(
      statistics.median(wall), 1),
          f"jax 8 devices, {mode}: CPU ms/step": round(
              statistics.median(cpu), 1)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--eight", choices=("local", "all-reduce", "gossip"),
                  help=argparse.SUPPRESS)  # the 8-device child
  args = ap.parse_args()
  if args.eight:
    print(json.dumps(jax_eight_devices(args.eight)))
    return
  import _common
  _common.set_cpu_devices(1)
  print("machine:", json.dumps(_common.machine_info()), flush=True)
  rows = {}
  rows.update(jax_one_device())
  rows.update(torch_one_process())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  for mode in ("local", "all-reduce", "gossip"):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--eight",
                        mode], capture_output=True, text=True, check=True,
                       env=env)
    rows.update(json.loads(r.stdout.strip().splitlines()[-1]))
  rows["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
  for k, v in rows.items():
    print(f"| {k} | {v} |")


if __name__ == "__main__":
  main()
