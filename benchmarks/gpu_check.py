"""GPU check: step speed, and the gossip overlap of the compiled train step.

Two ways to run it.

**Deviceless (any machine, no GPU)**: ``--deviceless TARGET`` compiles the
runner's own train-step programs of ``--config`` (default
``configs/gpt_tiny.py``; ``--set KEY=VALUE`` overrides) for a GPU target
(``h200``, ``h100_sxm``, ``a100_sxm_80``; ``--topology``, default one host
of as many GPUs as the config needs, at most 4096 GPUs) on this machine
(:mod:`decentral_jax.tools.gpu_compile`; ``pip install -r
requirements-gpu-compile.txt``; ``JAX_PLATFORMS=cpu`` is set here), and
prints each program's overlap report
(:func:`decentral_jax.analysis.overlap_report`): per collective its bytes,
asynchronous or not, inside a conditional or not, the forward / backward
work in flight, and the share of the forward and backward matmul FLOPs
that run while a collective is in flight. ``--json FILE`` writes the
reports and ``in_flight_fractions`` (the least over the programs with a
parameter-sized collective), which ``python -m decentral_jax.runtime_model
predict --gossip-in-flight FILE`` reads.
``--cluster A40`` (a runtime-model preset, case ignored) or
``--collective_us US`` also compiles each program with a latency profile
that tells XLA's scheduler the transfer time of each collective on that
cluster, ``--compute_ms`` the step's compute time there (to rescale the
times to XLA's own estimate), and prints the report before and after
(docs/gpu_overlap.md; BENCHMARKS.md section 11.6); with ``--cluster`` the
number of collectives in flight at once follows the cluster's links
(``runtime_model.links``; ``overlap_limit`` in the JSON). ``--roofline`` also
prices every GEMM, fusion and copy at the target's roofline
(``--gemm_efficiency``, default 0.5 of the bf16 peak;
``--memory_efficiency``, 0.7 of HBM bandwidth), in deviceless compiles and
in the ``schedule`` part on GPUs, and prints XLA's estimate per
instruction class against it (study 16). Bad flags or config
exit with code 2 and one line naming the flag or field.

**On GPUs** (the default when JAX sees a GPU; ``bash
benchmarks/gpu_check.sh``, under 5 minutes):

* ``timing``: the ``configs/gpt2_small_owt.py`` model (12 layers, 12 heads,
  width 768, context 1024, vocabulary 50304, bfloat16 compute, float32
  parameters) and its per-worker batch (30 sequences), one train step
  (forward, backward, global-norm clip, AccumAdamW) on ONE device with
  synthetic tokens. Reports ms/step, tokens/s and model FLOPs utilisation
  ``MFU = tokens/s x (6 N + 12 L T C) / peak`` (``N`` the matmul
  parameters, ``L`` layers, ``T`` context, ``C`` width; Chowdhery et al.
  2022, App. B; ``peak`` the dense bfloat16 FLOP/s of the GPU below,
  ``--peak_flops`` overrides).
* ``schedule``: the runner's train-step programs of ``--config`` compiled
  for the GPUs present (``n_workers`` set to their count; with one GPU, in
  a child process on XLA's mock 8-GPU topology, compile only), with kernel
  autotuning, against the same programs compiled deviceless for the
  matching target in a child process: the two overlap reports side by
  side (deviceless compiles skip autotuning and may schedule differently).
* ``gossip_timing`` (2 or more GPUs): ms per train step of ``--config``
  with its gossip and with ``gossip_every`` set beyond the timed steps
  (the same compute and optimizer, no gossip), on the config's own
  data: the paper's claim is that the two are
  close when the gossip hides behind the forward and backward pass. For
  ``algorithm=decentralized`` also with pipelined gossip
  (``pipelined_gossip=True``: the round mixed one step later).

Every run without a GPU says so (``NOT RUN ON A GPU`` and ``"ran_on_gpu":
false`` in the JSON). On one H100 the timing part has run (study 5); the
schedule comparison and the gossip timing need 2 or more GPUs with the
jax of that run (its mock GPU topology gave one device). ``--deviceless TARGET --workload FILE`` also writes the runtime-model
workload read from the first compiled program
(:mod:`decentral_jax.analysis.compiled_workload`), which ``predict
--workload-file`` reads.

On a CPU without ``--deviceless``, ``--smoke`` shrinks the timing model
(4 sequences per step unless ``--batch`` says otherwise) and runs ``schedule`` and ``gossip_timing`` on 8 simulated CPU devices
(XLA:CPU's collectives are synchronous and its HLO is not scheduled: a
check of the script, not of overlap).

The flags and their checks are in ``_gpu_check_flags.py``; the programs'
overlap reports (``--deviceless`` and the ``schedule`` part) in
``_gpu_check_schedule.py``, both next to this script.
"""

from __future__ import annotations

import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--deviceless" in sys.argv:  # before anything initialises a backend
  os.environ["JAX_PLATFORMS"] = "cpu"

import _common  # benchmarks/_common.py, next to this script  # noqa: E402
import _gpu_check_flags as gpu_flags  # noqa: E402
import _gpu_check_schedule as gpu_schedule  # noqa: E402

GPT2_SMALL = os.path.join(_ROOT, "configs", "gpt2_small_owt.py")
#: Said in the output and the JSON of every run without a GPU.
NOT_ON_GPU = ("no GPU: these numbers check the script on CPU devices "
              "(synchronous collectives, unscheduled HLO), not a GPU; one "
              "GPU's numbers: benchmarks/studies/05_gpu_check.md.")

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


SMOKE_BATCH = 4  # --smoke: sequences per step when --batch is not given


def _gpt_cfg(args, n_layer=None):
  """(GPTConfig, run config, sequences per step) of the decentralized run;
  the sequences per step are ``--batch`` when given (> 0), else the
  config's per-worker batch (SMOKE_BATCH under ``--smoke``)."""
  from decentral_jax.runner import config
  from decentral_jax.models import gpt
  import jax.numpy as jnp
  c = config.load_config(GPT2_SMALL + ":decentralized")
  m = c.model
  if args.smoke:
    return gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=n_layer or 2,
                         n_head=4, n_embd=128, bias=False, dropout=0.0,
                         dtype=jnp.float32), c, args.batch or SMOKE_BATCH
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


def _timed_steps(exp, first: int, count: int):
  import jax
  state = exp.init_state()
  for k in range(first):  # compiles every program of the period
    state, m = exp.train_step(state, exp.get_batch(k), k)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for k in range(first, first + count):
    state, m = exp.train_step(state, exp.get_batch(k), k)
  jax.block_until_ready(m)
  return (time.perf_counter() - t0) / count


def part_gossip_timing(args) -> dict:
  """ms per step of ``--config`` with and without its gossip (>= 2 devices)."""
  import jax
  from decentral_jax.runner import experiment
  n = len(jax.devices())
  if n < 2:
    return {"result": "one device: no gossip to time (needs 2 or more)"}
  out = {"n_devices": n}
  warm, count = args.warm_steps, args.timed_steps
  horizon = warm + count + 1
  # log_interval beyond the timed steps: no consensus measurement.
  common = [f"n_workers={n}", f"steps={max(horizon, 2)}",
            f"log_interval={horizon}", f"eval_interval={horizon}"]
  variants = [("gossip", []), ("no_gossip", [f"gossip_every={horizon}",
                                             "gossip_rounds=switch"])]
  if gpu_flags.run_config(args).algorithm == "decentralized":
    variants.append(("pipelined", ["pipelined_gossip=True"]))
  for label, extra in variants:
    c = gpu_flags.run_config(args, common + extra)
    exp = experiment.Experiment(
        c, devices=jax.devices()[:gpu_schedule.devices_needed(c)])
    out[f"{label}_ms_per_step"] = round(
        1e3 * _timed_steps(exp, warm, count), 3)
  g, ng = out["gossip_ms_per_step"], out["no_gossip_ms_per_step"]
  out["gossip_exposed_ms"] = round(g - ng, 3)
  if "pipelined_ms_per_step" in out:
    out["pipelined_exposed_ms"] = round(out["pipelined_ms_per_step"] - ng, 3)
  return out


def parse_args(argv=None):
  """The script's flags, read and checked (every benchmark script has
  one; the rules are :mod:`_gpu_check_flags`'s)."""
  return gpu_flags.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    result = _run(args)
  except ValueError as e:  # bad input (config, target, programs): one line
    print(f"gpu_check: error: {e}", file=sys.stderr)
    sys.exit(2)
  if args.json_only:  # before the write: a failed one loses nothing
    print(json.dumps(result), flush=True)
  if args.json:
    from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
    flag_types.write_output(
        args.json, "--json", lambda f: json.dump(result, f, indent=1),
        kept="the results were printed above")


def _run(args) -> dict:
  if args.deviceless:
    result = gpu_schedule.run_deviceless(args)
    if not (args.quiet or args.json_only):
      gpu_schedule.print_reports(f"{args.deviceless} {result['topology']}",
                                 result)
      f = result["in_flight_fractions"]
      print(f"\nIN FLIGHT (least over programs): forward {f['forward']:.3f}, "
            f"backward {f['backward']:.3f}")
    return result
  if args.part == "schedule" and args.json_only:
    return gpu_schedule.part_schedule(args)  # the mock-topology child
  import jax
  result = {"ran_on_gpu": jax.default_backend() == "gpu"}
  if not result["ran_on_gpu"] and not args.smoke and args.part in (
      "all", "timing"):
    raise ValueError(
        f"the timing part times GPT-2 small at a GPU's batch, which this "
        f"{jax.default_backend()} backend cannot hold; add --smoke (a tiny "
        "model, the CPU check of this script), choose --part schedule or "
        "gossip_timing, or compile for a GPU with --deviceless TARGET.")
  if not result["ran_on_gpu"]:
    result["note"] = NOT_ON_GPU
  if not args.json_only:
    result["machine"] = _common.machine_info()
    print("machine:", json.dumps(result["machine"]), flush=True)
  for part, fn in (("timing", part_timing),
                   ("schedule", gpu_schedule.part_schedule),
                   ("gossip_timing", part_gossip_timing)):
    if args.part in ("all", part):
      result[part] = fn(args)
      if not args.json_only:
        print(f"{part}:", json.dumps(_brief(result[part])), flush=True)
  if not args.json_only:
    _summary(result)
  return result


def _brief(res: dict) -> dict:
  """``res`` without the per-program text tables (printed separately)."""
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if k != "summary"}
    if isinstance(x, list):
      return [strip(v) for v in x]
    return x
  return strip(res)


def _summary(result):
  if not result.get("ran_on_gpu", True):
    print(f"\nNOT RUN ON A GPU: {NOT_ON_GPU}")
  t = result.get("timing")
  if t:
    mfu = f"{100 * t['mfu']:.1f}%" if t.get("mfu") is not None else "n/a"
    print(f"\nSTEP  {t['device_kind']}: {t['ms_per_step_median']} ms/step, "
          f"{t['tokens_per_s']:,} tokens/s, {t['achieved_tflops']} TFLOP/s, "
          f"MFU {mfu}")
  s = result.get("schedule") or {}
  for row in s.get("comparison", []):
    print(f"SCHEDULE round {row['round']} {row['consensus']}: real vs "
          f"deviceless collectives {row['collectives']} async {row['async']} "
          f"in_conditional {row['in_conditional']} overlapped "
          f"{row['overlapped']} matmul in flight "
          f"{row['matmul_flops_in_flight']} same={row['same_verdicts']}")
  if s and not s.get("comparison"):
    print(f"SCHEDULE {s.get('result') or s.get('deviceless', {}).get('result', 'no comparison')}")
  g = result.get("gossip_timing") or {}
  if "gossip_ms_per_step" in g:
    print(f"GOSSIP {g['n_devices']} devices: {g['gossip_ms_per_step']} "
          f"ms/step with gossip, {g['no_gossip_ms_per_step']} without "
          f"(exposed {g['gossip_exposed_ms']} ms)")
  elif g:
    print(f"GOSSIP {g.get('result')}")
  if "pipelined_ms_per_step" in g:
    print(f"GOSSIP pipelined: {g['pipelined_ms_per_step']} ms/step "
          f"(exposed {g['pipelined_exposed_ms']} ms)")


if __name__ == "__main__":
  main()
