"""GPU check: GPT-2 small step speed (tokens/s, MFU) and async gossip in HLO.

Part ``timing``: the ``configs/gpt2_small_owt.py`` model (12 layers, 12 heads,
width 768, context 1024, vocabulary 50304, bfloat16 compute, float32
parameters) and its per-worker batch (global_batch / n_workers = 30
sequences), one train step (forward, backward, global-norm clip, AccumAdamW
with the config's hyperparameters) on ONE device with synthetic random
tokens, for timing only. Reports ms/step, tokens/s and model FLOPs
utilisation

  MFU = tokens/s x (6 N + 12 L T C) / peak,

with ``N`` the parameters used in matmuls (all parameters minus the position
embedding; the token embedding counts because it is the tied output head),
``L`` layers, ``T`` context, ``C`` width (the attention term of Chowdhery et
al. 2022, App. B, as in nanoGPT's ``estimate_mfu``), and ``peak`` the dense
bfloat16 FLOP/s of the detected GPU (table below; ``--peak_flops``
overrides).

Part ``async``: compiles (does not run) a one-peer-exponential
decentralized AccumAdamW step of a GPT with the same width/heads/context (but
``--async_layers`` layers, to keep compiles short) over 8 workers, both with
the round chosen in-graph (``lax.switch``) and with one round compiled alone
(``round_index=0``), and reports,
from the optimized HLO, whether the gossip ``collective-permute`` is
asynchronous (``collective-permute-start`` / ``-done``) with compute between
start and done, whether the starts sit inside the ``lax.switch`` branches,
and the bytes per step (float32 and bfloat16 gossip). Devices: 8 real devices
if present; on a single GPU, a child process with XLA's mock GPU topology
(``jax_mock_gpu_topology=1x8x1``, compile only, no execution); on CPU, 8
simulated CPU devices (XLA:CPU has no async collectives, so it reports
synchronous permutes).

Run ``benchmarks/gpu_check.sh`` (< 5 minutes on one H100/H200); on a CPU
``--smoke`` shrinks everything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _common  # benchmarks/_common.py, next to this script

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_SMALL = os.path.join(_ROOT, "configs", "gpt2_small_owt.py")

# Dense (no sparsity) bfloat16 tensor-core peak FLOP/s by device-kind
# substring, first match wins (vendor data sheets).
PEAK_BF16 = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
)


def peak_flops(device_kind: str) -> float | None:
  for key, value in PEAK_BF16:
    if key.lower() in device_kind.lower():
      return value
  return None


def _gpt_cfg(args, n_layer=None):
  """(GPTConfig, run config, sequences per step) of the decentralized run."""
  from decentral_jax.runner import config
  from decentral_jax.models import gpt
  import jax.numpy as jnp
  c = config.load_config(GPT2_SMALL + ":decentralized")
  m = c.model
  if args.smoke:
    return gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=n_layer or 2,
                         n_head=4, n_embd=128, bias=False, dropout=0.0,
                         dtype=jnp.float32), c, 4
  return gpt.GPTConfig(
      vocab_size=m.vocab_size, block_size=m.block_size,
      n_layer=n_layer or m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
      bias=m.bias, dropout=m.dropout, dtype=getattr(jnp, m.dtype)), c, (
          args.batch or c.global_batch // c.n_workers)


def _tx(c, topo, accum_steps, comm_dtype=None):
  from decentral_jax import optim
  o = c.optimizer
  return optim.decentralized_adamw(
      c.schedule.peak_lr, topo, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, accum_steps=accum_steps,
      comm_dtype=comm_dtype)


def part_timing(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from decentral_jax import parallel
  from decentral_jax import topology
  from decentral_jax.models import gpt

  cfg, c, batch = _gpt_cfg(args)
  mesh = parallel.make_mesh(1)
  tx = _tx(c, topology.make("one_peer_exp", 1), c.optimizer.accum_steps)
  step = _common.gpt_step(cfg, tx, mesh, clip=c.grad_clip)
  params0 = gpt.init_params(cfg, jax.random.key(0))
  n_params = gpt.num_params(params0)
  n_matmul = n_params - int(np.prod(params0["wpe"]["embedding"].shape))
  params = parallel.replicate(params0, mesh)
  del params0
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  t = cfg.block_size
  rng = np.random.default_rng(0)
  tokens = parallel.shard(jnp.asarray(rng.integers(
      0, cfg.vocab_size, (1, batch, t + 1)), jnp.int32), mesh)
  t0 = time.perf_counter()
  params, state, loss = step(params, state, tokens)
  loss.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(args.warmup):
    params, state, loss = step(params, state, tokens)
  loss.block_until_ready()
  per_step = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    for _ in range(args.steps):
      params, state, loss = step(params, state, tokens)
    loss.block_until_ready()
    per_step.append((time.perf_counter() - t0) / args.steps)
  sec = _common.median(per_step)
  tokens_per_step = batch * t
  flops_per_token = 6 * n_matmul + 12 * cfg.n_layer * t * cfg.n_embd
  kind = jax.devices()[0].device_kind
  peak = args.peak_flops or peak_flops(kind)
  out = {
      "device_kind": kind, "n_params": n_params, "n_matmul_params": n_matmul,
      "batch_sequences": batch, "context": t, "tokens_per_step": tokens_per_step,
      "compile_plus_first_step_s": round(compile_s, 2),
      "ms_per_step_median": round(sec * 1e3, 3),
      "ms_per_step_all": [round(x * 1e3, 3) for x in per_step],
      "tokens_per_s": round(tokens_per_step / sec, 1),
      "flops_per_token": flops_per_token,
      "achieved_tflops": round(tokens_per_step / sec * flops_per_token / 1e12,
                               2),
      "peak_bf16_tflops": peak and peak / 1e12,
      "mfu": round(tokens_per_step / sec * flops_per_token / peak, 4)
             if peak else None,
      "final_loss": float(np.asarray(loss)[0]),
  }
  if peak is None:
    out["note"] = (f"no peak FLOP/s known for {kind!r}; pass --peak_flops to "
                   "get MFU.")
  return out


def _abstract_inputs(cfg, tx, mesh, batch):
  """ShapeDtypeStructs (with shardings) of params, opt state and tokens."""
  import jax
  import jax.numpy as jnp
  from decentral_jax import parallel
  from decentral_jax.models import gpt
  n = parallel.n_workers_of(mesh)
  sharding = parallel.worker_sharding(mesh)
  p1 = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (n,) + x.shape, x.dtype, sharding=sharding), p1)
  state = jax.eval_shape(parallel.per_worker(tx.init, mesh), params)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding), state)
  tokens = jax.ShapeDtypeStruct((n, batch, cfg.block_size + 1), jnp.int32,
                                sharding=sharding)
  return p1, params, state, tokens


def part_async(args) -> dict:
  import jax
  from decentral_jax import analysis
  from decentral_jax import parallel
  from decentral_jax import topology
  import jax.numpy as jnp

  devices = jax.devices()
  n = 8 if len(devices) >= 8 else (4 if len(devices) >= 4 else
                                   (2 if len(devices) >= 2 else 1))
  out = {"backend": jax.default_backend(), "n_devices_seen": len(devices),
         "device_kind": devices[0].device_kind,
         "mock_gpu_topology": os.environ.get("JAX_MOCK_GPU_TOPOLOGY", "")}
  if n < 2:
    out["result"] = ("only one device is present: a multi-device GPU compile "
                     "is not possible here, so the async check was not done")
    return out
  cfg, c, batch = _gpt_cfg(args, n_layer=args.async_layers)
  mesh = parallel.make_mesh(n, devices=devices[:n])
  out["n_workers"] = n
  out["model"] = (f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} "
                  f"n_head={cfg.n_head} T={cfg.block_size} "
                  f"V={cfg.vocab_size} batch={batch}/worker")
  # (topology, comm dtype, round_index): None = lax.switch over rounds,
  # an int = that round compiled alone (no conditional).
  variants = [("one_peer_exp", None, None), ("one_peer_exp", None, 0),
              ("one_peer_exp", jnp.bfloat16, None), ("exponential", None, None)]
  rows = []
  for name, comm, round_index in variants:
    tx = _tx(c, topology.make(name, n), c.optimizer.accum_steps, comm)
    step = _common.gpt_step(cfg, tx, mesh, clip=c.grad_clip,
                            round_index=round_index)
    p1, params, state, tokens = _abstract_inputs(cfg, tx, mesh, batch)
    t0 = time.perf_counter()
    compiled = step.lower(params, state, tokens).compile()
    rep = analysis.communication(compiled)
    perm = [c for c in analysis.overlap_report(compiled).collectives
            if c.kind == "collective-permute"]
    pb = analysis.tree_bytes(p1)
    rows.append({
        "topology": name,
        "comm_dtype": str(jnp.dtype(comm)) if comm else "float32",
        "round_index": round_index,
        "compile_s": round(time.perf_counter() - t0, 1),
        "bytes_ratio_per_branch": [round(r, 4) for r in rep.ratios(pb)],
        "permute_async": sum(c.is_async for c in perm),
        "permute_sync": sum(not c.is_async for c in perm),
        "overlapped": sum(c.overlapped for c in perm),
        "backward_in_flight": [c.backward for c in perm],
        "permutes_inside_conditionals": sum(c.in_conditional for c in perm),
        "async": any(c.is_async for c in perm),
    })
  out["variants"] = rows
  return out


def _mock_child(args) -> dict:
  """Re-runs the async part in a child with a mock 8-GPU topology."""
  env = dict(os.environ, JAX_MOCK_GPU_TOPOLOGY="1x8x1")
  cmd = [sys.executable, os.path.abspath(__file__), "--part", "async",
         "--async_layers", str(args.async_layers), "--json_only"]
  if args.smoke:
    cmd.append("--smoke")
  try:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                       timeout=args.mock_timeout)
  except subprocess.TimeoutExpired:
    return {"result": f"mock GPU topology child timed out after "
                      f"{args.mock_timeout} s"}
  if r.returncode != 0:
    return {"result": "mock GPU topology compile failed (exit "
                      f"{r.returncode}); only one device is present, so no "
                      "multi-device GPU HLO could be inspected",
            "stderr_tail": r.stderr[-1500:]}
  return json.loads(r.stdout.strip().splitlines()[-1])


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("all", "timing", "async"), default="all")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny model (CPU check of the script itself)")
  ap.add_argument("--batch", type=int, default=0,
                  help="sequences per step (default: the config's 30)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="steps per repeat")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--peak_flops", type=float, default=0.0)
  ap.add_argument("--async_layers", type=int, default=2)
  ap.add_argument("--mock_timeout", type=int, default=150)
  ap.add_argument("--json_only", action="store_true")
  args = ap.parse_args()

  import jax
  result = {}
  if not args.json_only:
    result["machine"] = _common.machine_info()
    print("machine:", json.dumps(result["machine"]), flush=True)
  if args.part in ("all", "timing"):
    result["timing"] = part_timing(args)
    if not args.json_only:
      print("timing:", json.dumps(result["timing"]), flush=True)
  if args.part in ("all", "async"):
    if (len(jax.devices()) == 1 and jax.default_backend() == "gpu"
        and not os.environ.get("JAX_MOCK_GPU_TOPOLOGY")):
      res = _mock_child(args)
      res.setdefault("note", "one physical GPU: compiled for a mock 8-GPU "
                     "topology (XLA GPU compiler, no execution)")
      result["async"] = res
    else:
      result["async"] = part_async(args)
    if not args.json_only:
      print("async:", json.dumps(result["async"]), flush=True)
  if args.json_only:
    print(json.dumps(result.get("async", result)))
  else:
    _summary(result)


def _summary(result):
  t = result.get("timing")
  if t:
    mfu = f"{100 * t['mfu']:.1f}%" if t.get("mfu") is not None else "n/a"
    print(f"\nSTEP  {t['device_kind']}: {t['ms_per_step_median']} ms/step, "
          f"{t['tokens_per_s']:,} tokens/s, {t['achieved_tflops']} TFLOP/s, "
          f"MFU {mfu}")
  a = result.get("async")
  if a:
    if "variants" not in a:
      print(f"ASYNC {a.get('result')}")
    for v in a.get("variants", []):
      rnd = "switch" if v["round_index"] is None else f"round={v['round_index']}"
      print(f"ASYNC {v['topology']:<13} {v['comm_dtype']:<8} {rnd:<7} async="
            f"{v['permute_async']} sync={v['permute_sync']} "
            f"overlapped={v['overlapped']} "
            f"backward_in_flight={v['backward_in_flight']} "
            f"in_conditionals={v['permutes_inside_conditionals']} "
            f"bytes/param_bytes={v['bytes_ratio_per_branch']}")


if __name__ == "__main__":
  main()
