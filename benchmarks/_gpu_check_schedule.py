"""The runner's train-step programs of ``benchmarks/gpu_check.py``: their
overlap reports, compiled deviceless for a GPU target (``--deviceless``,
:func:`run_deviceless`) or for the GPUs present (the ``schedule`` part,
:func:`part_schedule`, against the same programs compiled deviceless in a
child process, :func:`compare`), and their printed tables
(:func:`print_reports`). JAX and the library are imported where used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import _gpu_check_flags as gpu_flags  # benchmarks/_gpu_check_flags.py

#: The script a child process runs: gpu_check.py, next to this module.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "gpu_check.py")

# Deviceless target of a device kind (substring, first match wins).
TARGET_OF_KIND = (("H200", "h200"), ("H100", "h100_sxm"),
                  ("A100", "a100_sxm_80"))


def devices_needed(c) -> int:
  return (int(c.n_workers) * int(c.devices_per_worker)
          // int(c.workers_per_device))


def _program_names(programs) -> str:
  return ", ".join(f"{r}:{mode}" for r, mode in programs)


def _programs(spec: str):
  """``programs`` argument of ``gpu_compile.compile_programs`` from
  ``--programs`` (``all``, ``none`` (the ordinary steps) or ``R:MODE,..``,
  :func:`_gpu_check_flags.parse_programs`)."""
  def pick(exp):
    if spec == "all":
      return exp.programs.keys()
    if spec == "none":
      return [p for p in exp.programs.keys() if p[1] != "input"]
    out = gpu_flags.parse_programs(spec)
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
  c = gpu_flags.run_config(args)
  validation.check_config(c)  # before the default topology is sized by it
  needed = devices_needed(c)
  if not args.topology and needed > gpu_flags.MAX_TOPOLOGY_GPUS:
    raise ValueError(
        f"the config needs {needed} GPUs (n_workers * devices_per_worker / "
        f"workers_per_device), more than the {gpu_flags.MAX_TOPOLOGY_GPUS} a "
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


def print_reports(title: str, result: dict) -> None:
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
    res = _child([sys.executable, SCRIPT, "--part",
                  "schedule", "--json_only"] + _common_flags(args, 8), env,
                 args.child_timeout)
    res.setdefault("note", "one physical GPU: compiled for XLA's mock 8-GPU "
                   "topology (GPU compiler with autotuning, no execution)")
    return res
  n = len(devices)
  c = gpu_flags.run_config(args, [f"n_workers={n}"])
  exp = experiment.Experiment(c, devices=devices[:devices_needed(c)])
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
    cmd = ([sys.executable, SCRIPT, "--deviceless", target,
            "--topology", f"1x1x{devices_needed(c)}", "--json", path,
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
