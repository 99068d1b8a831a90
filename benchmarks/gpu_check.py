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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--deviceless" in sys.argv:  # before anything initialises a backend
  os.environ["JAX_PLATFORMS"] = "cpu"

import _common  # benchmarks/_common.py, next to this script  # noqa: E402

GPT2_SMALL = os.path.join(_ROOT, "configs", "gpt2_small_owt.py")
#: Said in the output and the JSON of every run without a GPU.
NOT_ON_GPU = ("no GPU: these numbers check the script on CPU devices "
              "(synchronous collectives, unscheduled HLO), not a GPU; one "
              "GPU's numbers: benchmarks/studies/05_gpu_check.md.")
TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")
# Deviceless target of a device kind (substring, first match wins).
TARGET_OF_KIND = (("H200", "h200"), ("H100", "h100_sxm"),
                  ("A100", "a100_sxm_80"))

# Largest --collective_us: 1000 s, far beyond any transfer of a step.
MAX_COLLECTIVE_US = 1e9

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


# ---------------------------------------------------------------------------
# The runner's programs: overlap reports (deviceless or on GPUs).
# ---------------------------------------------------------------------------


def _config(args, extra=()):
  from decentral_jax.runner import config as config_lib
  return config_lib.load_config(args.config, list(args.set) + list(extra))


def _devices_needed(c) -> int:
  return (int(c.n_workers) * int(c.devices_per_worker)
          // int(c.workers_per_device))


def parse_programs(spec: str) -> list[tuple[int | None, str]] | None:
  """``--programs`` as ``(round, mode)`` pairs; None for ``all``/``none``.

  ``ROUND:MODE,...``: ``ROUND`` an int, or ``None`` / empty for every
  round; ``MODE`` default ``none``.

  Raises:
    ValueError: an empty entry (e.g. ``--programs ,``), a round that is
      not an int, or a program given twice (``0:none,0``: the mode's
      default filled in), naming the entry.
  """
  if spec in ("all", "none"):
    return None
  out = []
  for k, item in enumerate(spec.split(","), 1):
    if not item.strip():
      raise ValueError(f"--programs {spec!r}: entry {k} is empty; give "
                       "all, none or ROUND:MODE,... (e.g. 0:none,0:input).")
    r, _, mode = item.strip().partition(":")
    # ASCII digits without a leading zero ("²" passes str.isdigit()).
    if r not in ("", "None") and not re.fullmatch(r"-?(0|[1-9][0-9]*)", r):
      raise ValueError(f"--programs {spec!r}: entry {k} ({item!r}) has round "
                       f"{r!r}, not an int; give ROUND:MODE (e.g. 0:input).")
    out.append((None if r in ("", "None") else int(r), mode or "none"))
  for k, pair in enumerate(out):
    if pair in out[:k]:
      raise ValueError(
          f"--programs {spec!r}: entry {k + 1} repeats entry "
          f"{out.index(pair) + 1} (the program of round "
          f"{'every' if pair[0] is None else pair[0]}, mode {pair[1]}; "
          "MODE defaults to none); give each program once, e.g. "
          "0:none,0:input.")
  return out


def _program_names(programs) -> str:
  return ", ".join(f"{r}:{mode}" for r, mode in programs)


def _programs(spec: str):
  """``programs`` argument of ``gpu_compile.compile_programs`` from
  ``--programs`` (``all``, ``none`` (the ordinary steps) or ``R:MODE,..``,
  :func:`parse_programs`)."""
  def pick(exp):
    if spec == "all":
      return exp.programs.keys()
    if spec == "none":
      return [p for p in exp.programs.keys() if p[1] != "input"]
    out = parse_programs(spec)
    bad = [p for p in out if p not in exp.programs.keys()]
    if bad:
      raise ValueError(f"--programs {spec!r}: {_program_names(bad)} not "
                       "among the experiment's programs "
                       f"{_program_names(exp.programs.keys())}.")
    return out
  return pick


def _rows(exp, steps, min_fraction: float) -> dict:
  """JSON-able reports of compiled programs and the least in-flight pair."""
  from decentral_jax import analysis
  p_bytes = analysis.tree_bytes(exp.abstract_params())
  min_bytes = p_bytes * min_fraction
  rows, pairs = [], []
  for s in steps:
    rep = s.report
    big = rep.select(min_bytes)
    fwd, bwd = rep.in_flight_fractions()
    rows.append({
        "round": s.distinct_round, "consensus": s.consensus,
        "compile_s": round(s.compile_s, 1), "scheduled": rep.scheduled,
        "collectives": len(big),
        "async": sum(c.is_async for c in big),
        "in_conditional": sum(c.in_conditional for c in big),
        "overlapped": sum(c.overlapped for c in big),
        "fwd_bwd_ops_in_flight": [[c.forward, c.backward] for c in big],
        "matmul_flops_in_flight": round(
            rep.flops_in_flight / rep.total_flops, 4)
            if rep.total_flops else 0.0,
        "in_flight_fractions": {"forward": fwd, "backward": bwd},
        "summary": rep.summary(min_bytes)})
    if s.unprofiled is not None:  # --cluster / --collective_us
      f0, b0 = s.unprofiled.in_flight_fractions()
      rows[-1]["without_profile"] = {
          "in_flight_fractions": {"forward": f0, "backward": b0},
          "fwd_bwd_ops_in_flight": [[c.forward, c.backward] for c in
                                    s.unprofiled.select(min_bytes)]}
      rows[-1]["profile_us"] = {k: float(f"{v:.4g}")  # not 0.0 if small
                                for k, v in s.profile_us.items()}
      rows[-1]["xla_compute_us"] = s.xla_compute_us
      # --cluster: collectives in flight at once, from the cluster's links.
      rows[-1]["overlap_limit"] = s.overlap_limit
    if s.roofline_costs is not None:  # --roofline
      from decentral_jax.analysis import roofline
      rows[-1]["roofline"] = {
          "classes": s.class_table(),
          "table": roofline.format_class_table(s.class_table()),
          "profiled_busy_us": s.profiled_busy_us}
    if big:
      pairs.append((bwd, fwd))
  least = min(pairs) if pairs else (0.0, 0.0)
  return {"param_bytes": int(p_bytes), "min_bytes": float(min_bytes),
          "gossip_rounds": exp.programs.gossip_rounds,
          "consensus_at": exp.programs.consensus_at, "programs": rows,
          # The least over the programs with a collective of at least
          # min_bytes: what runtime_model --gossip-in-flight reads.
          "in_flight_fractions": {"forward": least[1],
                                  "backward": least[0]}}


def run_deviceless(args) -> dict:
  """``--deviceless TARGET``: compile for a GPU target here, report."""
  from decentral_jax.tools import gpu_compile
  from decentral_jax.runner import validation
  c = _config(args)
  validation.check_config(c)  # before the default topology is sized by it
  needed = _devices_needed(c)
  if not args.topology and needed > MAX_TOPOLOGY_GPUS:
    raise ValueError(
        f"the config needs {needed} GPUs (n_workers * devices_per_worker / "
        f"workers_per_device), more than the {MAX_TOPOLOGY_GPUS} a "
        "--deviceless topology describes; set fewer with --set n_workers=N.")
  topology = args.topology or f"1x1x{needed}"
  exp, steps = gpu_compile.compile_steps(
      c, target=args.deviceless, topology=topology,
      programs=_programs(args.programs),
      collective_us=args.collective_us, cluster=args.cluster,
      compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
      roofline=_roofline(args, args.deviceless))
  if args.workload:
    write_workload(args.workload, exp, steps[0], args)
  return {"target": args.deviceless, "topology": topology,
          "cluster": args.cluster, "collective_us": args.collective_us,
          "compute_ms": args.compute_ms, "roofline": args.roofline,
          **_rows(exp, steps, args.min_fraction)}


def write_workload(path: str, exp, step, args) -> None:
  """``--workload FILE``: the runtime-model workload read from the first
  compiled program (:mod:`decentral_jax.analysis.compiled_workload`; its
  compute on the profile's clock where ``--cluster`` priced it, else the
  stated fallback), for ``predict --workload-file``."""
  import jax
  from decentral_jax.analysis import compiled_workload
  leaves = jax.tree.leaves(exp.abstract_params())
  count = sum(x.size for x in leaves)
  costs = {k: v for k, v in (step.profile_us or {}).items()}
  work = compiled_workload.workload_from_compiled(
      step.compiled, param_count=count, param_dtype=str(leaves[0].dtype),
      costs=costs, source=f"{args.config} {' '.join(args.set)} for "
      f"{args.deviceless}, program {step.distinct_round}:{step.consensus}")
  compiled_workload.write_workload(path, work)


def _roofline(args, target: str | None):
  """``--roofline``: the target's roofline at the flags' efficiencies."""
  if not args.roofline or target is None:
    return None
  from decentral_jax.tools import gpu_compile
  return gpu_compile.target_roofline(target, args.gemm_efficiency,
                                     args.memory_efficiency)


def _print_reports(title: str, result: dict) -> None:
  print(f"{title}: dispatch {result.get('gossip_rounds')}/"
        f"{result.get('consensus_at')}, collectives of at least "
        f"{result.get('min_bytes', 0):,.0f} B")
  for r in result.get("programs", []):
    f = r["in_flight_fractions"]
    print(f"-- round {r['round']}, consensus {r['consensus']} (compiled in "
          f"{r['compile_s']} s): {r['overlapped']} of {r['collectives']} "
          f"overlapped, {r['in_conditional']} in a conditional; in flight: "
          f"{100 * f['forward']:.0f}% of the forward, "
          f"{100 * f['backward']:.0f}% of the backward matmul FLOPs")
    if "without_profile" in r:
      f0 = r["without_profile"]["in_flight_fractions"]
      if r.get("xla_compute_us"):
        print(f"   XLA's estimate of the step's busy time: "
              f"{r['xla_compute_us'] / 1e3:.1f} ms")
      print(f"   latency profile {r['profile_us']} (us); without it: "
            f"{100 * f0['forward']:.0f}% of the forward, "
            f"{100 * f0['backward']:.0f}% of the backward")
    if "roofline" in r:
      print(f"   XLA's estimate per instruction class against the roofline "
            f"(busy {r['xla_compute_us'] / 1e3:.1f} ms before the profile, "
            f"{r['roofline']['profiled_busy_us'] / 1e3:.1f} ms after):")
      print(r["roofline"]["table"])
    print(r["summary"])


def _target_of(kind: str) -> str | None:
  for key, target in TARGET_OF_KIND:
    if key.lower() in kind.lower():
      return target
  return None


def _child(cmd: list[str], env: dict, timeout: int) -> dict:
  try:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                       timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"result": f"child timed out after {timeout} s: {cmd[2:]}"}
  if r.returncode != 0:
    return {"result": f"child failed (exit {r.returncode})",
            "stderr_tail": r.stderr[-1500:]}
  return json.loads(r.stdout.strip().splitlines()[-1])


def _common_flags(args, n: int) -> list[str]:
  flags = ["--config", args.config, "--programs", args.programs,
           "--min_fraction", str(args.min_fraction)]
  if args.roofline:
    flags += ["--roofline", "--gemm_efficiency", str(args.gemm_efficiency),
              "--memory_efficiency", str(args.memory_efficiency)]
  for kv in list(args.set) + [f"n_workers={n}"]:
    flags += ["--set", kv]
  return flags


def part_schedule(args) -> dict:
  """The programs compiled for the GPUs present, against deviceless."""
  import jax
  from decentral_jax.tools import gpu_compile
  from decentral_jax.runner import experiment
  devices = jax.devices()
  kind = devices[0].device_kind
  if len(devices) == 1 and jax.default_backend() == "gpu":
    if os.environ.get("JAX_MOCK_GPU_TOPOLOGY"):  # the child: mock ignored
      return {"result": f"XLA's mock GPU topology "
              f"{os.environ['JAX_MOCK_GPU_TOPOLOGY']} gave 1 device with "
              f"jax {jax.__version__}: no multi-GPU program to compile on "
              "one GPU (run on 2 or more GPUs, or --deviceless TARGET)"}
    env = dict(os.environ, JAX_MOCK_GPU_TOPOLOGY="1x8x1")
    res = _child([sys.executable, os.path.abspath(__file__), "--part",
                  "schedule", "--json_only"] + _common_flags(args, 8), env,
                 args.child_timeout)
    res.setdefault("note", "one physical GPU: compiled for XLA's mock 8-GPU "
                   "topology (GPU compiler with autotuning, no execution)")
    return res
  n = len(devices)
  c = _config(args, [f"n_workers={n}"])
  exp = experiment.Experiment(c, devices=devices[:_devices_needed(c)])
  steps = gpu_compile.compile_programs(
      exp, _programs(args.programs),
      roofline=_roofline(args, _target_of(kind)))
  out = {"backend": jax.default_backend(), "device_kind": kind,
         "n_devices": n, "real": _rows(exp, steps, args.min_fraction)}
  target = _target_of(kind)
  if jax.default_backend() != "gpu" or target is None:
    out["deviceless"] = {"result": f"no deviceless target for {kind!r} on "
                         f"{jax.default_backend()}: not compared"}
    return out
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "deviceless.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_MOCK_GPU_TOPOLOGY", None)
    cmd = ([sys.executable, os.path.abspath(__file__), "--deviceless", target,
            "--topology", f"1x1x{_devices_needed(c)}", "--json", path,
            "--quiet"] + _common_flags(args, n))
    res = _child(cmd + ["--json_only"], env, args.child_timeout)
    out["deviceless"] = res
  out["comparison"] = compare(out["real"], out["deviceless"])
  return out


def compare(real: dict, dless: dict) -> list[dict]:
  """Per program, the real and the deviceless verdicts side by side."""
  if "programs" not in dless:
    return []
  other = {(r["round"], r["consensus"]): r for r in dless["programs"]}
  rows = []
  for r in real.get("programs", []):
    d = other.get((r["round"], r["consensus"]))
    if d is None:
      continue
    keys = ("collectives", "async", "in_conditional", "overlapped")
    rows.append({"round": r["round"], "consensus": r["consensus"],
                 **{k: [r[k], d[k]] for k in keys},
                 "matmul_flops_in_flight": [r["matmul_flops_in_flight"],
                                            d["matmul_flops_in_flight"]],
                 "same_verdicts": all(r[k] == d[k] for k in keys)})
  return rows


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
  if _config(args).algorithm == "decentralized":
    variants.append(("pipelined", ["pipelined_gossip=True"]))
  for label, extra in variants:
    c = _config(args, common + extra)
    exp = experiment.Experiment(c, devices=jax.devices()[:_devices_needed(c)])
    out[f"{label}_ms_per_step"] = round(
        1e3 * _timed_steps(exp, warm, count), 3)
  g, ng = out["gossip_ms_per_step"], out["no_gossip_ms_per_step"]
  out["gossip_exposed_ms"] = round(g - ng, 3)
  if "pipelined_ms_per_step" in out:
    out["pipelined_exposed_ms"] = round(out["pipelined_ms_per_step"] - ng, 3)
  return out


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


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked (:func:`check_flags`; a bad one exits with code 2)."""
  ap = _parser()
  args = ap.parse_args(argv)
  from decentral_jax.tools import flag_types
  args.given = flag_types.given_flags(
      ap, sys.argv[1:] if argv is None else argv)
  try:
    check_not_empty(ap, args)
    check_flags(args)
    check_config(args)
  except ValueError as e:
    ap.error(str(e))
  return args


#: What to give each flag whose default, "", stands for the flag left out.
EMPTY_MEANS_ABSENT = {
    "--deviceless": "a GPU target (h200, h100_sxm, a100_sxm_80) or a "
                    ".txtpb file",
    "--topology": "SLICESxHOSTSxGPUS (e.g. 1x2x4)"}


def check_not_empty(ap: argparse.ArgumentParser, args) -> None:
  """Refuses a flag given (``args.given``) with an empty value where its
  default, ``""``, means the flag left out (``--deviceless ''`` would run
  on this machine's devices instead of compiling for a target).

  Raises:
    ValueError: ``--deviceless is empty; give ... or drop --deviceless.``
  """
  for flag in sorted(args.given):
    dest = flag[2:].replace("-", "_")
    if ap.get_default(dest) == "" and getattr(args, dest, None) == "":
      give = EMPTY_MEANS_ABSENT.get(flag, "a value")
      raise ValueError(f"{flag} is empty, which reads as {flag} left out; "
                       f"give {give} or drop {flag}.")


# (flag, least, most) of the integer flags, in their units (steps,
# repeats, sequences, seconds).
INT_FLAGS = (("--batch", 1, 10**6), ("--warmup", 0, 10**6),
             ("--steps", 1, 10**6), ("--repeats", 1, 10**4),
             ("--warm_steps", 1, 10**6), ("--timed_steps", 1, 10**6),
             ("--child_timeout", 1, 7 * 86400))
MAX_COMPUTE_MS = 1e6  # --compute_ms, as predict's compute times
MAX_PEAK_FLOPS = 1e18  # FLOP/s; an H200 is about 1e15 dense bfloat16


def check_numbers(args: argparse.Namespace) -> None:
  """Checks the numeric flags other than the latency profile's.

  Raises:
    ValueError: ``--min_fraction`` not a finite number in [0, 1]; a flag of
      :data:`INT_FLAGS` outside its range; ``--peak_flops`` not 0 (the
      GPU's own, :func:`peak_flops`) or a finite FLOP/s in (0,
      MAX_PEAK_FLOPS].
  """
  from decentral_jax import checks
  checks.check_float("--min_fraction", args.min_fraction, minimum=0.0,
                     maximum=1.0)
  for flag, low, high in INT_FLAGS:
    if getattr(args, flag[2:]) is not None:  # --batch None: not given
      checks.check_int(flag, getattr(args, flag[2:]), minimum=low,
                       maximum=high)
  flops = args.peak_flops
  if flops != 0 and not 0 < flops <= MAX_PEAK_FLOPS:  # False for NaN too
    raise ValueError(f"--peak_flops must be 0 (the GPU's own peak) or a "
                     f"finite FLOP/s in (0, {MAX_PEAK_FLOPS:g}], got "
                     f"{flops:g}.")


_PARTS = ("timing", "schedule", "gossip_timing")
#: What reads each flag: ``deviceless`` (``--deviceless`` compiles) and the
#: parts run on this machine's devices (:func:`check_needs`). Under
#: ``--deviceless`` the parts' numbers (:data:`INT_FLAGS`, ``--peak_flops``)
#: are checked (:func:`check_numbers`, first) and then refused: no part runs.
FLAG_READERS = {
    "--topology": ("deviceless",), "--workload": ("deviceless",),
    "--quiet": ("deviceless",), "--part": _PARTS,
    "--smoke": ("timing",), "--batch": ("timing",),
    "--warmup": ("timing",), "--steps": ("timing",),
    "--repeats": ("timing",), "--peak_flops": ("timing",),
    "--child_timeout": ("schedule",),
    "--warm_steps": ("gossip_timing",), "--timed_steps": ("gossip_timing",),
    "--programs": ("deviceless", "schedule"),
    "--min_fraction": ("deviceless", "schedule"),
    "--roofline": ("deviceless", "schedule"),
    # The timing part times GPT-2 small's own config, not --config's.
    "--config": ("deviceless", "schedule", "gossip_timing"),
    "--set": ("deviceless", "schedule", "gossip_timing"),
}


def _needs() -> tuple:
  """The rows of :data:`FLAG_READERS` as dependency rules, and
  ``--gemm_efficiency`` / ``--memory_efficiency`` needing ``--roofline``."""
  from decentral_jax.tools import flag_types
  rows = []
  for flag, readers in FLAG_READERS.items():
    parts = [p for p in readers if p != "deviceless"]
    if "deviceless" not in readers:
      read = ("it chooses the parts run on this machine's devices"
              if flag == "--part" else f"it is read by --part "
              f"{' or '.join(parts)} on this machine's devices")
      rows.append(flag_types.Needs(
          flag, lambda a: not a.deviceless, f"with --deviceless ({read})",
          f"drop {flag} or --deviceless"))
    if not parts:
      rows.append(flag_types.Needs(
          flag, lambda a: bool(a.deviceless), "without --deviceless",
          f"add --deviceless TARGET (e.g. h200) or drop {flag}"))
    elif flag != "--part":
      rows.append(flag_types.Needs(
          flag, lambda a, parts=parts: bool(a.deviceless) or a.part in (
              "all", *parts),
          f"without --part {' or '.join(parts)} (or all)"
          + (" or --deviceless" if "deviceless" in readers else ""),
          f"choose that part or drop {flag}"))
  for flag in ("--gemm_efficiency", "--memory_efficiency"):
    rows.append(flag_types.Needs(
        flag, lambda a: a.roofline, "without --roofline",
        f"add --roofline or drop {flag}"))
  return tuple(rows)


def check_needs(args: argparse.Namespace) -> None:
  """Refuses a flag given (``args.given``) where nothing reads it: a
  ``--deviceless`` flag without it, a part's flag with another ``--part``
  (or ``--part`` with ``--deviceless``, or a part's number such as
  ``--steps``, ``--batch``, ``--repeats``), a roofline share without
  ``--roofline``.

  Raises:
    ValueError: ``--topology has no effect without --deviceless; ...``.
  """
  from decentral_jax.tools import flag_types
  given = set(getattr(args, "given", ()))
  flag_types.check_needs(_needs(), given, args)


MAX_TOPOLOGY_GPUS = 4096  # --topology: GPUs in all (and so per factor)


def check_topology(spec: str) -> None:
  """Raises ValueError unless ``spec`` is ``SLICESxHOSTSxGPUS``, three
  positive ints of ASCII digits (e.g. ``1x1x8``; ``str.isdigit`` would
  take ``'²'`` and ``'١'``) whose product (the GPUs the target describes)
  is at most MAX_TOPOLOGY_GPUS, before XLA sees it (XLA's mock topology
  builds every device, so a huge one would not finish)."""
  parts = spec.split("x")
  if len(parts) != 3 or not all(
      re.fullmatch(r"[0-9]+", p) and p.strip("0") for p in parts):
    raise ValueError(f"--topology {spec!r} must be SLICESxHOSTSxGPUS, three "
                     "positive ints such as 1x1x8 or 2x1x4.")
  if (any(len(p.lstrip("0")) > len(str(MAX_TOPOLOGY_GPUS)) for p in parts)
      or math.prod(int(p) for p in parts) > MAX_TOPOLOGY_GPUS):
    raise ValueError(f"--topology {spec!r} describes more than "
                     f"{MAX_TOPOLOGY_GPUS} GPUs (SLICES*HOSTS*GPUS); give "
                     f"at most {MAX_TOPOLOGY_GPUS}, such as 1x1x8 or 2x1x4.")


def check_outputs_are_not_inputs(args: argparse.Namespace) -> None:
  """Raises ValueError when ``--json`` or ``--workload`` names the
  ``--config`` or ``--deviceless`` file, or both name one file
  (:func:`decentral_jax.tools.distinct_paths.check_distinct_paths`)."""
  from decentral_jax.tools import distinct_paths
  txtpb = args.deviceless if (args.deviceless or "").endswith(".txtpb") \
      else None
  distinct_paths.check_distinct_paths(
      [("--json", args.json), ("--workload", args.workload)],
      [("--config", distinct_paths.config_file(args.config)),
       ("--deviceless", txtpb)])


def check_flags(args: argparse.Namespace) -> None:
  """Checks the latency-profile flags, in the units typed; ``--cluster``
  becomes the preset's own spelling (case ignored, as
  ``experiments/compare.py --clusters``).

  Raises:
    ValueError: one of them without ``--deviceless``; ``--deviceless``
      neither a shipped target nor a ``.txtpb`` file; ``--cluster`` not a
      runtime-model preset, or with ``--collective_us``; ``--collective_us``
      outside (0, MAX_COLLECTIVE_US]; ``--compute_ms`` not a finite number
      > 0, or without ``--cluster`` or ``--collective_us``; the numbers of
      :func:`check_numbers`, ``--programs`` (:func:`parse_programs`),
      ``--topology`` (:func:`check_topology`) or ``--json`` (a folder that
      does not exist, not writable) bad; an output naming an input or the
      other output (:func:`check_outputs_are_not_inputs`).
  """
  from decentral_jax.runtime_model import presets
  from decentral_jax.tools.runtime_model_cli import inputs
  check_numbers(args)
  parse_programs(args.programs)
  if args.topology:
    check_topology(args.topology)
  inputs.check_output_path(args.json, "--json")
  inputs.check_output_path(args.workload, "--workload")
  check_outputs_are_not_inputs(args)
  given = [f for f, v in (("--cluster", args.cluster),
                          ("--collective_us", args.collective_us),
                          ("--compute_ms", args.compute_ms)) if v is not None]
  if given and not args.deviceless:
    verb = "applies" if len(given) == 1 else "apply"
    raise ValueError(f"{' and '.join(given)} {verb} to --deviceless "
                     "compiles only; add --deviceless TARGET (e.g. h200).")
  if args.deviceless and not args.deviceless.endswith(".txtpb"):
    from decentral_jax.tools import gpu_compile
    if args.deviceless not in gpu_compile.TARGETS:
      raise ValueError(f"--deviceless {args.deviceless!r} is not a GPU "
                       f"target; use one of {', '.join(gpu_compile.TARGETS)} "
                       "or a .txtpb file.")
  if args.cluster is not None:
    name = presets.cluster_preset_name(args.cluster)
    if name is None:
      raise ValueError(f"--cluster {args.cluster!r} is not a runtime-model "
                       f"preset; use one of {', '.join(presets.CLUSTERS)} "
                       "(case ignored).")
    args.cluster = name
    if args.collective_us is not None:
      raise ValueError("--cluster and --collective_us both give the transfer "
                       "times; give one of them.")
  us = args.collective_us
  if us is not None and not 0 < us <= MAX_COLLECTIVE_US:
    raise ValueError(f"--collective_us must be a transfer time in "
                     f"microseconds in (0, {MAX_COLLECTIVE_US:g}], got {us:g}.")
  for flag in ("gemm_efficiency", "memory_efficiency"):
    e = getattr(args, flag)
    if not 0 < e <= 1:
      raise ValueError(f"--{flag} must be a share of the peak in (0, 1], "
                       f"got {e:g}.")
  check_needs(args)
  if args.roofline and args.compute_ms is not None:
    raise ValueError("--roofline puts every time on the GPU's clock; "
                     "--compute_ms (a rescaling to XLA's clock) does not "
                     "apply with it: drop one.")
  ms = args.compute_ms
  if ms is not None:
    if not (0 < ms and math.isfinite(ms)):
      raise ValueError(f"--compute_ms must be the step's compute time in "
                       f"milliseconds, a finite number > 0, got {ms:g}.")
    if ms > MAX_COMPUTE_MS:
      raise ValueError(f"--compute_ms must be at most {MAX_COMPUTE_MS:g} "
                       f"(ms, about 17 minutes per step), got {ms:g}.")
    if args.cluster is None and us is None:
      raise ValueError("--compute_ms rescales the transfer times of "
                       "--cluster or --collective_us; give one of them too.")


def check_config(args: argparse.Namespace) -> None:
  """Loads ``--config`` with the ``--set`` overrides (no JAX) when
  ``--deviceless`` or a part that reads them (:data:`FLAG_READERS`) will
  run, so a bad one is refused before any part runs (the timing part, the
  first, reads neither).

  Raises:
    ValueError: the config file missing or bad, an unknown ``--set``
      field or value (the message of ``runner.config.load_config``).
  """
  readers = FLAG_READERS["--config"]
  if args.deviceless or args.part == "all" or args.part in readers:
    _config(args)


def _parser() -> argparse.ArgumentParser:
  """The flags; a refusal is one ``error:`` line (``flag_types.Parser``)."""
  from decentral_jax.tools import flag_types
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("all", "timing", "schedule",
                                     "gossip_timing"), default="all")
  ap.add_argument("--deviceless", metavar="TARGET", default="",
                  help="compile for this GPU target here (h200, h100_sxm, "
                  "a100_sxm_80 or a .txtpb file) and print the reports")
  ap.add_argument("--topology", default="",
                  help="deviceless topology SLICESxHOSTSxGPUS, at most "
                  f"{MAX_TOPOLOGY_GPUS} GPUs in all (default 1x1xN, N the "
                  "devices the config needs)")
  ap.add_argument("--config", default=TINY,
                  help="run config for schedule, gossip_timing and "
                  "--deviceless (default configs/gpt_tiny.py)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override (repeatable)")
  ap.add_argument("--programs", default="all",
                  help="all, none (steps without the consensus "
                  "measurement) or ROUND:MODE,... (e.g. 0:none,0:input)")
  ap.add_argument("--cluster", default=None,
                  help="--deviceless: tell XLA's scheduler the runtime "
                  "model's transfer time of each collective on this "
                  "runtime_model preset cluster (e.g. A40) through a "
                  "latency profile (compiles each program twice)")
  ap.add_argument("--collective_us", type=float, default=None,
                  help="--deviceless: the same with one transfer time (us, "
                  f"at most {MAX_COLLECTIVE_US:g}) for every asynchronous "
                  "collective")
  ap.add_argument("--compute_ms", type=float, default=None,
                  help="with --cluster/--collective_us: the step's compute "
                  "time on that cluster (ms); the times are rescaled to "
                  "XLA's own estimate of the program's compute (e.g. 122.3 "
                  "for GPT-2 small on the A40 preset)")
  ap.add_argument("--roofline", action="store_true",
                  help="price every GEMM, fusion and copy at the target's "
                  "roofline in the latency profile too (deviceless and "
                  "real-GPU compiles; docs/gpu_overlap.md)")
  ap.add_argument("--gemm_efficiency", type=float, default=0.5,
                  help="--roofline: share of the bf16 peak a GEMM reaches")
  ap.add_argument("--memory_efficiency", type=float, default=0.7,
                  help="--roofline: share of HBM bandwidth a memory-bound "
                  "kernel reaches")
  ap.add_argument("--min_fraction", type=float, default=1 / 64,
                  help="report collectives of at least this share of one "
                  "worker's parameter bytes (default 1/64)")
  ap.add_argument("--json", default=None, help="write the result here")
  ap.add_argument("--workload", default=None,
                  help="--deviceless: write the runtime-model workload read "
                  "from the first compiled program (JSON) here")
  ap.add_argument("--quiet", action="store_true",
                  help="no per-program tables")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny timing model (CPU check of the script itself)")
  ap.add_argument("--batch", type=int, default=None,
                  help="sequences per step (default: the config's 30, "
                  "4 under --smoke)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="steps per repeat")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--peak_flops", type=float, default=0.0)
  ap.add_argument("--warm_steps", type=int, default=6,
                  help="gossip_timing: untimed steps (compiles)")
  ap.add_argument("--timed_steps", type=int, default=20)
  ap.add_argument("--child_timeout", type=int, default=150)
  ap.add_argument("--json_only", action="store_true")
  return ap


def _run(args) -> dict:
  if args.deviceless:
    result = run_deviceless(args)
    if not (args.quiet or args.json_only):
      _print_reports(f"{args.deviceless} {result['topology']}", result)
      f = result["in_flight_fractions"]
      print(f"\nIN FLIGHT (least over programs): forward {f['forward']:.3f}, "
            f"backward {f['backward']:.3f}")
    return result
  if args.part == "schedule" and args.json_only:
    return part_schedule(args)  # the mock-topology child
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
  for part, fn in (("timing", part_timing), ("schedule", part_schedule),
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
