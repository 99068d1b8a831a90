"""CPU time of ONE worker's step, decentral_jax vs PyTorch, on a shared machine.

The bound on the side-by-side benchmark
(``benchmarks/bench_vs_decentdp.py``): when both libraries run 8
single-threaded workers on the same cores, their tokens/s ratio cannot
exceed the ratio of the CPU time one worker's step takes. This script
measures that ratio directly, with the two libraries alternating in the
same process so that both see the same machine load:

* decentral_jax on one CPU device, ``--xla_cpu_multi_thread_eigen=false``:
  the jitted per-worker step (value_and_grad of the side-by-side GPT, then
  AccumAdamW with ``accum_steps`` 4; no communication);
* PyTorch with one thread (``torch.set_num_threads(1)``): forward, backward
  and decent-dp's ``AccumAdamW.step`` on the same model
  (``benchmarks/decentdp_side_by_side.TinyGPT``).

Each round times ``--calls`` steps of each library (JAX first in even
rounds, PyTorch first in odd ones) and records wall ms and CPU ms (this
process's user + system time; the JAX runtime's worker threads included)
per step, and the JAX step's CPU ms by thread name (XLA's pool threads are
``tf_XLAEigen``). ``--pool1`` gives XLA's CPU thread pool one thread instead
of one per core (XLA takes the size from the CPU affinity when its backend
starts; the process is pinned to one core for that moment only). Prints one JSON line per round and a summary with medians and the
1-minute load average. Needs ``pip install torch==2.13.0 decent-dp loguru``.

  python benchmarks/studies/one_worker_cpu.py --rounds 5 [--pool1]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

# benchmarks/, for _common and decentdp_side_by_side
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402


def thread_cpu_ms() -> dict[str, float]:
  """CPU ms (user + system) used so far by this process's threads, by name."""
  tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
  out: dict[str, float] = {}
  for path in glob.glob("/proc/self/task/*/stat"):
    try:
      with open(path) as f:
        stat = f.read()
    except OSError:  # the thread ended
      continue
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) \
        * tick_ms
  return out


def _measure(fn, calls: int) -> tuple[float, float]:
  """(wall ms, CPU ms) per call of ``fn`` over ``calls`` calls."""
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(calls):
    fn()
  return (1e3 * (time.perf_counter() - t0) / calls,
          1e3 * (time.process_time() - c0) / calls)


def jax_step():
  """A zero-argument function running one blocking decentral_jax step."""
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
  tx = optax.chain(optim.scale_by_accum_adam(0.9, 0.95, accum_steps=4),
                   optax.add_decayed_weights(0.1),
                   optax.scale_by_learning_rate(3e-3))

  def loss_fn(p, t):
    return models.lm_loss(model.apply({"params": p}, t[:, :-1]), t[:, 1:])

  def step(p, s, t):
    loss, g = jax.value_and_grad(loss_fn)(p, t)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  box = {"p": gpt.init_params(cfg, jax.random.key(0))}
  box["s"] = tx.init(box["p"])
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 65)),
                    jnp.int32)

  def run():
    box["p"], box["s"], loss = step(box["p"], box["s"], tok)
    loss.block_until_ready()

  return run


def torch_step():
  """A zero-argument function running one PyTorch + decent-dp step."""
  import torch
  import torch.nn.functional as F
  from decent_dp.optim import AccumAdamW
  from decentdp_side_by_side import TinyGPT
  torch.set_num_threads(1)
  torch.manual_seed(0)
  m = TinyGPT()
  opt = AccumAdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95),
                   weight_decay=0.1, accum_iter=4)
  x = torch.randint(0, 256, (8, 65))

  def run():
    F.cross_entropy(m(x[:, :-1]).reshape(-1, 256),
                    x[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()

  return run


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--calls", type=int, default=40)
  ap.add_argument("--pool1", action="store_true",
                  help="give XLA's CPU thread pool one thread (the process "
                       "is pinned to one core while the JAX backend starts, "
                       "then unpinned)")
  ap.add_argument("--sync", action="store_true",
                  help="jax_cpu_enable_async_dispatch=False (the JAX step "
                       "runs on the calling thread)")
  args = ap.parse_args()
  _common.require_decent_dp()
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false"
                             " --xla_force_host_platform_device_count=1"
                             ).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  cpus = os.sched_getaffinity(0)
  if args.pool1:  # XLA sizes its thread pool by the usable cores
    os.sched_setaffinity(0, {min(cpus)})
  import jax
  if args.sync:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  jax.devices()  # the CPU backend and its thread pool start here
  os.sched_setaffinity(0, cpus)
  steps = {"jax": jax_step(), "torch": torch_step()}
  for fn in steps.values():  # compile, warm up
    for _ in range(5):
      fn()
  rows = []
  for r in range(args.rounds):
    order = ("jax", "torch") if r % 2 == 0 else ("torch", "jax")
    row = {"round": r, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name in order:
      before = thread_cpu_ms()
      row[f"{name}_wall_ms"], row[f"{name}_cpu_ms"] = (
          round(v, 2) for v in _measure(steps[name], args.calls))
      after = thread_cpu_ms()
      if name == "jax":  # which threads did the JAX step's work
        row["jax_cpu_ms_by_thread"] = {
            k: round((v - before.get(k, 0.0)) / args.calls, 1)
            for k, v in after.items() if v - before.get(k, 0.0) > 0}
    rows.append(row)
    print(json.dumps(row), flush=True)
  med = {k: round(statistics.median(r[k] for r in rows), 2)
         for k in rows[0] if k.endswith("_ms")}
  med["torch_cpu / jax_cpu"] = round(med["torch_cpu_ms"] / med["jax_cpu_ms"],
                                     2)
  med["jax_sync_dispatch"] = args.sync
  med["xla_pool_one_thread"] = args.pool1
  med["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
  print("medians:", json.dumps(med), flush=True)


if __name__ == "__main__":
  main()
