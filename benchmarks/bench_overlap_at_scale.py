"""The gossip's overlap at GPT-2 124M, 350M and 1.3B, compiled without a GPU.

Compiles (never runs) the runner's train-step programs of
``configs/gpt2_sizes.py`` for 8 x H100 SXM on one node (one-peer
exponential graph, 8 workers) and 2 nodes of 8 (AER, 16 workers), one
device per worker, from abstract shapes only (nothing is placed), each
twice (:func:`decentral_jax.tools.gpu_compile.compile_programs`): with
XLA's own cost model ("XLA alone") and with a latency profile that prices
every GEMM, fusion and copy at its roofline time on the H100 (50% of the
bf16 peak, 70% of HBM bandwidth) and every collective at the runtime
model's link time on the cluster (``h100_node`` one node, ``h100_ib`` two).
Methods: ``plain`` (the config), ``choco`` (CHOCO-gossip of int8 blocks,
DAdam), ``bf16`` (``comm_dtype=bfloat16``). Layouts ``fsdp2`` (4 workers
of 2 devices, one node), ``fsdp4`` and ``fsdp8`` (4 workers of 4, 2
workers of 8, on 2 nodes): the gossip (collectives across workers) is
told from fsdp's collectives inside a worker. Each program is compiled at
the overlap limit the profile cluster's links allow
(:func:`decentral_jax.runtime_model.links.parallel_collectives`), or at
``--overlap_limit``.

Per program one JSON line in ``--out``: compile seconds, the compiled
memory analysis against the H100's 80 GB, the parameter-sized collectives
(at least 1/64 of the parameter bytes: async, in a conditional,
overlapped), the forward / backward matmul FLOPs in flight before and
after the profile, XLA's busy-time estimate before and after, the class
table (XLA vs roofline time), and the MFU up to which the round stays
hidden on the paper's A40 cluster and on H100 InfiniBand: the matmul FLOPs
in flight over the peak times the round's serial transfer time (the
buckets share one NIC). ``--hlo DIR`` keeps each scheduled program
(gzipped) and ``--fixtures DIR`` its stripped form
(:func:`decentral_jax.tools.overlap.strip_hlo`).

  JAX_PLATFORMS=cpu nice python benchmarks/bench_overlap_at_scale.py \\
      --cases 124m:node:plain,124m:2nodes:plain --out overlap_at_scale.jsonl

Cases already in ``--out`` are skipped (the big compiles run one at a
time and can be resumed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import numpy as np  # noqa: E402

import _common  # noqa: E402  benchmarks/_common.py, next to this script

from decentral_jax.analysis import accounting  # noqa: E402
from decentral_jax.analysis import overlap as overlap_lib  # noqa: E402
from decentral_jax.runner import config as config_lib  # noqa: E402
from decentral_jax.runner import programs as programs_lib  # noqa: E402
from decentral_jax.runtime_model import presets  # noqa: E402
from decentral_jax.tools import dummy_bins  # noqa: E402
from decentral_jax.tools import flag_types  # noqa: E402
from decentral_jax.tools import gpu_compile  # noqa: E402
from decentral_jax.tools import latency_profile  # noqa: E402
from decentral_jax.tools import overlap as overlap_tool  # noqa: E402
from decentral_jax.tools import overlap_flags  # noqa: E402

TARGET = "h100_sxm"
#: The dummy token files written in --bins (file name -> zero uint16
#: tokens; compiles read no text).
DUMMY_TOKENS = {"train.bin": 2_000_000, "val.bin": 20_000}
HBM_BYTES = 80e9  # H100 SXM5 80 GB
#: Dense bfloat16 peak of each cluster's GPU (FLOP/s; NVIDIA data sheets:
#: A40 149.7 TFLOP/s, H100 SXM5 989.4 TFLOP/s).
PEAK = {"A40": 149.7e12, "h100_ib": 989.4e12}
#: layout -> (topology, n_workers, GPU topology, profile cluster).
LAYOUTS = {"node": ("one_peer_exp", 8, "1x1x8", "h100_node"),
           "2nodes": ("alternating_exp_ring", 16, "2x1x8", "h100_ib"),
           # 4 workers of 2 devices each (fsdp) on one node.
           "fsdp2": ("one_peer_exp", 4, "1x1x8", "h100_node"),
           # 2 nodes of 8: 4 workers of 4 devices, 2 workers of 8 (one per
           # node).
           "fsdp4": ("one_peer_exp", 4, "2x1x8", "h100_ib"),
           "fsdp8": ("one_peer_exp", 2, "2x1x8", "h100_ib")}
#: layout -> devices per worker (fsdp).
DEVICES = {"fsdp2": 2, "fsdp4": 4, "fsdp8": 8}
METHODS = {
    "plain": (),
    # CHOCO-gossip needs a static topology: the exponential graph.
    "choco": ("optimizer.name=adamw", "optimizer.accum_steps=1",
              "compression.format=int8", "topology=exponential"),
    "bf16": ("comm_dtype=bfloat16",),
    # Pipelined CHOCO: the round of the step's input parameters.
    "choco_pipelined": ("optimizer.name=adamw", "optimizer.accum_steps=1",
                        "compression.format=int8", "topology=exponential",
                        "pipelined_gossip=True"),
}


def config(size: str, layout: str, method: str, bins: str):
  topo, n, gpus, _ = LAYOUTS[layout]
  d = DEVICES.get(layout, 1)
  # Only AER (alternating_exp_ring) groups workers into nodes.
  per_node = 8 // d if topo == "alternating_exp_ring" else 1
  # 30 sequences per worker; 32 where a worker's devices must split it
  # evenly (4 and 8 devices).
  per_worker = 30 if 30 % d == 0 else 32
  over = [f"topology={topo}", f"n_workers={n}",
          f"workers_per_node={per_node}",
          f"global_batch={per_worker * n}", "eval_batches=1",
          f"data.path={bins}", "gossip_rounds=static", *METHODS[method]]
  if d > 1:
    over += [f"devices_per_worker={d}", "worker_layout=fsdp"]
  return config_lib.load_config(
      os.path.join(_ROOT, "configs", f"gpt2_sizes.py:{size}"), over)


def programs_of(exp, layout: str, everything: bool, spec: str = ""):
  """Round 0 (one node) or every distinct round (two nodes) without the
  consensus measurement, and round 0 with it when ``everything``; or the
  ``ROUND:MODE,...`` of ``spec`` (e.g. ``1:none``: AER's round across the
  two nodes)."""
  if spec:
    return [(int(r), m) for r, m in (p.split(":") for p in spec.split(","))]
  keys = list(exp.programs.keys())
  out = [k for k in keys if k[1] == "none"]
  if layout == "node":
    out = out[:1]
  if everything:
    out += [k for k in keys if k[1] != "none"][:1]
  return out


def cluster_of(name: str, layout: str):
  """The cluster whose links price ``layout``'s collectives, or None.

  One device per worker: the preset at the layout's workers. Workers of
  ``D`` devices (fsdp): each device sends its ``1/D`` shard to the same
  device of the peer worker over its own links, so the cluster is one
  device of each worker: ``8 / D`` workers per node with one NIC each
  (``h100_ib``'s NIC per GPU) and the device's NVLink; None where the
  preset has no such slice (the Figure 6 presets, e.g. ``A40``: 4 GPUs
  per node, no H100 workers of 8)."""
  n = LAYOUTS[layout][1]
  try:
    return presets.device_slice(name, n, DEVICES.get(layout, 1))
  except ValueError:  # e.g. h100_ib needs 8 workers per node; A40 and fsdp
    return None


def _round_us(exp, step, layout: str, cluster_name: str, min_bytes: float,
              crossing) -> float:
  cluster = cluster_of(cluster_name, layout)
  if cluster is None:
    return 0.0
  price = latency_profile.cluster_collective_us(exp, cluster)
  return sum(price(c, step.distinct_round)
             for c in step.report.select(min_bytes)
             if c.is_async and crossing.get(c.name, True))


def crossing_of(text: str, devices_per_worker: int) -> dict:
  """``{collective name: moves data between workers}`` of a program."""
  return {c.name: overlap_lib.crosses_workers(c, devices_per_worker)
          for c in accounting.communication(text).collectives}


def _collectives(report, min_bytes: float, crossing=None) -> dict:
  crossing = crossing or {}
  every = report.select(min_bytes)
  big = [c for c in every if crossing.get(c.name, True)]
  inner = [c for c in every if not crossing.get(c.name, True)]
  fwd, bwd = report.in_flight_fractions()
  return {"inner": {"count": len(inner),
                    "async": sum(c.is_async for c in inner),
                    "overlapped": sum(c.overlapped for c in inner),
                    "bytes": sum(c.bytes for c in inner),
                    "kinds": sorted({c.kind for c in inner})},
          "count": len(big), "async": sum(c.is_async for c in big),
          "in_conditional": sum(c.in_conditional for c in big),
          "overlapped": sum(c.overlapped for c in big),
          "with_forward": sum(c.forward > 0 for c in big if c.overlapped),
          "bytes": sum(c.bytes for c in big),
          "kinds": sorted({c.kind for c in big}),
          "forward_in_flight": fwd, "backward_in_flight": bwd,
          "flops_in_flight": report.flops_in_flight,
          "total_flops": report.total_flops}


def row_of(exp, step, case: str) -> dict:
  layout = case.split(":")[1]
  d = DEVICES.get(layout, 1)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      exp.abstract_inputs()[0].params)) // int(exp.config.n_workers)
  # 1/64 of the parameter bytes one device sends (a 1/D shard with fsdp).
  min_bytes = 4 * n_params / 64 / (2 if "bf16" in case else 1) / (
      4 if "choco" in case else 1) / d
  mem = step.compiled.memory_analysis()
  used = (mem.argument_size_in_bytes + mem.output_size_in_bytes
          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  text = step.compiled.as_text()
  crossing = crossing_of(text, d)
  report = step.report if d == 1 else overlap_lib.overlap_report(
      text, only=lambda nm: crossing.get(nm, True))  # the gossip's FLOPs
  after = _collectives(report, min_bytes, crossing)
  hidden = {}
  for name, peak in PEAK.items():
    t_us = _round_us(exp, step, layout, name, min_bytes, crossing)
    hidden[name] = {"round_ms": t_us / 1e3, "mfu_hidden": (
        after["flops_in_flight"] / (peak * t_us * 1e-6) if t_us else None)}
  table = step.class_table()
  return {"case": case, "round": step.distinct_round,
          "consensus": step.consensus, "n_params": n_params,
          "devices_per_worker": d, "overlap_limit": step.overlap_limit,
          "compile_s": step.compile_s,
          "memory": {"argument": mem.argument_size_in_bytes,
                     "output": mem.output_size_in_bytes,
                     "alias": mem.alias_size_in_bytes,
                     "temp": mem.temp_size_in_bytes, "used": used,
                     "hbm": HBM_BYTES, "fits": used <= HBM_BYTES},
          "xla_alone": _collectives(step.unprofiled, min_bytes, crossing),
          "roofline": after, "hidden": hidden,
          "xla_busy_ms": step.xla_compute_us / 1e3,
          "profiled_busy_ms": step.profiled_busy_us / 1e3,
          "classes": table}


def run_case(case: str, args) -> list[dict]:
  size, layout, method, *cluster = case.split(":")
  c = config(size, layout, method, args.bins)
  topo = LAYOUTS[layout][2]
  t0 = time.perf_counter()
  exp, steps = gpu_compile.compile_steps(
      c, target=TARGET, topology=topo,
      compiler_options=dict(programs_lib.GPU_COMPILER_OPTIONS),
      programs=lambda e: programs_of(e, layout, args.everything,
                                     args.programs or ""),
      cluster=cluster_of(cluster[0] if cluster else LAYOUTS[layout][3],
                         layout), roofline=True,
      overlap_limit=args.overlap_limit or "cluster")
  rows = []
  for s in steps:
    row = row_of(exp, s, case)
    row["case_s"] = time.perf_counter() - t0
    rows.append(row)
    stem = f"{case.replace(':', '_')}_r{s.distinct_round}_{s.consensus}"
    text = s.compiled.as_text()
    if args.hlo:
      os.makedirs(args.hlo, exist_ok=True)
      with gzip.open(os.path.join(args.hlo, stem + ".hlo.gz"), "wt") as f:
        f.write(text)
    if args.fixtures:
      os.makedirs(args.fixtures, exist_ok=True)
      with gzip.open(os.path.join(args.fixtures, stem + ".hlo.gz"), "wt",
                     compresslevel=9) as f:
        f.write(overlap_tool.strip_hlo(text))
  return rows


def analyse(row: dict, text: str) -> dict:
  """The per-step gossip of one saved scheduled program (see module)."""
  from decentral_jax import topology as topology_lib
  from decentral_jax.analysis import overlap, roofline
  from decentral_jax.runtime_model.costs import all_reduce_cost, round_cost
  size, layout, method, *_ = row["case"].split(":")
  topo, n = LAYOUTS[layout][:2]
  topo = "exponential" if method.startswith("choco") else topo
  per_param = {"bf16": 2, "choco": 1, "choco_pipelined": 1}.get(method, 4)
  rnd = topology_lib.make(topo, n, 8 if layout == "2nodes" else 1
                          ).distinct_rounds[row["round"] or 0]
  compressed = method.startswith("choco")
  d = DEVICES.get(layout, 1)
  # Workers of several devices: the gossip crosses workers, fsdp's
  # collectives stay inside one (crosses_workers); FLOPs in flight count
  # while a gossip collective is.
  cross = crossing_of(text, d) if d > 1 else {}
  rep = overlap.overlap_report(text, only=lambda nm: cross.get(nm, True))
  big = [c for c in rep.select(per_param * row["n_params"] / 64 / d)
         if not c.in_conditional]
  gossip = [c for c in big if cross.get(c.name, True)]
  inner = [c for c in big if not cross.get(c.name, True)]
  rl = gpu_compile.target_roofline(TARGET)
  costs = roofline.instruction_costs(text, rl)
  windows, union = roofline.in_flight_us(text, {c.name: c.us for c in costs})
  step_us = sum(c.us for c in costs)
  terms = max(1, len(rnd.terms)) if (rnd.groups is None or compressed) else 1
  # The consensus distance's All-Reduce: named so, or any All-Reduce of a
  # round sent by permutes.
  # The round's time: every collective outside conditionals, any size.
  every = [c for c in rep.collectives
           if not c.in_conditional and cross.get(c.name, True)]
  diag = sum(c.bytes for c in every if _is_diag(c, rnd, compressed))
  nbytes = sum(c.bytes for c in every) - diag
  fwd, bwd = rep.in_flight_fractions()
  out = {"gossip": len(gossip), "async": sum(c.is_async for c in gossip),
         "overlapped": sum(c.overlapped for c in gossip),
         "fwd_instr": sum(c.forward > 0 for c in gossip),
         "fwd": fwd, "bwd": bwd, "bytes": nbytes,
         "window_ms": [windows.get(c.name, 0.0) / 1e3 for c in gossip],
         "union_ms": union / 1e3, "step_ms": step_us / 1e3,
         "inner": [len(inner), sum(c.is_async for c in inner),
                   sum(c.overlapped for c in inner)],
         "mfu_rl": rep.total_flops / (rl.peak_flops * step_us * 1e-6)}
  for name, peak in PEAK.items():
    cluster = cluster_of(name, layout) or (
        None if d > 1 else presets.cluster("h100_node", n))
    if cluster is None:  # no such cluster slice (fsdp on A40 nodes)
      out[name], out[name + "_covered"] = None, None
      continue
    cost = round_cost(cluster, rnd, permutes=compressed)
    t = float(np.max(cost.time(nbytes / terms)))
    if diag:  # the consensus distance's All-Reduce, after the round
      t += float(np.max(all_reduce_cost(cluster).time(diag)))
    ar = all_reduce_cost(cluster)
    each = [float(np.max((ar if _is_diag(c, rnd, compressed) else cost).time(
        c.bytes / (1 if _is_diag(c, rnd, compressed) else terms))))
            for c in gossip]
    # Buckets whose window (the roofline clock: H100 at e_f, e_b) is at
    # least their own transfer time on this cluster.
    out[name + "_covered"] = sum(windows.get(c.name, 0.0) >= 1e6 * t_c
                                 for c, t_c in zip(gossip, each))
    out[name] = {"round_ms": 1e3 * t,
                 "mfu_hidden": rep.flops_in_flight / (peak * t) if t else 0}
  return out


def _is_diag(c, rnd, compressed: bool) -> bool:
  """The consensus distance's All-Reduce: named so, or any All-Reduce of a
  round sent by permutes."""
  return "diagnostics" in c.op_name or (
      c.kind == "all-reduce" and (rnd.groups is None or compressed))


def _stem(row: dict) -> str:
  return f"{row['case'].replace(':', '_')}_r{row['round']}_{row['consensus']}"


#: The fields of a row of ``--out`` the cache and ``--table`` read
#: (``_common.read_rows``).
ROW_FIELDS = {"case": "str", "round": "int?", "consensus": "str",
              "compile_s": "number", "xla_busy_ms": "number",
              "xla_alone": {"forward_in_flight": "number",
                            "backward_in_flight": "number",
                            "overlapped": "int"},
              "memory": {"used": "number", "fits": "bool"}}


def read_rows(out: str) -> list[dict]:
  """The rows of ``--out`` (none if it does not exist); a damaged file is
  one ``error:`` line naming ``--out`` and the key (exit code 2)."""
  return _common.read_rows(out, "--out", ROW_FIELDS)


def missing_hlo(out: str, hlo_dir: str) -> list[str]:
  """The ``.hlo.gz`` files the rows of ``out`` need that ``hlo_dir`` lacks."""
  rows = read_rows(out)
  return [_stem(r) + ".hlo.gz" for r in rows if not os.path.isfile(
      os.path.join(hlo_dir, _stem(r) + ".hlo.gz"))]


HEADER = (
    "| case | program | buckets (bytes) | async | overlapped | fwd / bwd in "
    "flight | step ms | A40 round ms: hidden to | H100-IB round ms: hidden "
    "to | memory GB | compile s |\n" + "|---" * 11 + "|")


def table(out: str, hlo_dir: str) -> str:
  """A Markdown table (:data:`HEADER`, then a row per program in ``out``
  with its saved HLO)."""
  lines = [HEADER]
  rows = read_rows(out)
  for row in rows:
    with gzip.open(os.path.join(hlo_dir, _stem(row) + ".hlo.gz"),
                   "rt") as f:
      a = analyse(row, f.read())
    xla, mem = row["xla_alone"], row["memory"]
    x_fwd, x_bwd = xla["forward_in_flight"], xla["backward_in_flight"]
    # Workers of several devices: XLA's own schedule is not kept, and its
    # program-wide fractions count fsdp's collectives too: not shown.
    x_pass = ("- " if row.get("devices_per_worker", 1) > 1 else
              f"{100 * x_fwd:.0f} / {100 * x_bwd:.0f} % ")
    limit = ("" if row.get("overlap_limit") is None
             else f" (limit {row['overlap_limit']})")
    fsdp = ("" if not a["inner"][0] else
            f"; fsdp {a['inner'][0]}: {a['inner'][1]} async, "
            f"{a['inner'][2]} overlapped")
    lines.append(
        f"| {row['case']} | {row['round']}, {row['consensus']}{limit} | "
        f"{a['gossip']} ({a['bytes'] / 1e6:,.0f} MB){fsdp} | {a['async']} | "
        f"{xla['overlapped']} / {a['overlapped']} | "
        f"{x_pass}-> "
        f"{100 * a['fwd']:.0f} / {100 * a['bwd']:.0f} % | "
        f"{row['xla_busy_ms']:.1f} -> {a['step_ms']:.1f} "
        f"({a['union_ms']:.1f} in flight) "
        f"({100 * a['mfu_rl']:.0f} % MFU) | "
        f"{_round(a['A40'])} | "
        f"{a['h100_ib']['round_ms']:.2f}: "
        f"{_pct(a['h100_ib']['mfu_hidden'])}, "
        f"{a['h100_ib_covered']} of {a['gossip']} covered | "
        f"{mem['used'] / 1e9:.1f}{'' if mem['fits'] else ' (no)'} | "
        f"{row['compile_s']:.0f} |")
  return "\n".join(lines)


def _round(a) -> str:
  return "n/a" if a is None else (f"{a['round_ms']:.1f}: "
                                  f"{_pct(a['mfu_hidden'])}")


def _pct(x: float) -> str:
  return "any" if x >= 1 else f"{100 * x:.0f} %"


#: The model sizes of ``configs/gpt2_sizes.py`` (its ``SIZES``).
SIZES = ("124m", "350m", "1.3b")


def case_error(case: str) -> str | None:
  """Why ``case`` is not ``SIZE:LAYOUT:METHOD[:CLUSTER]`` of
  :data:`SIZES`, :data:`LAYOUTS`, :data:`METHODS` and the runtime model's
  cluster presets, or None."""
  parts = case.split(":")
  if len(parts) not in (3, 4):
    return f"case {case!r} must be SIZE:LAYOUT:METHOD[:CLUSTER]"
  for what, part, names in (("size", parts[0], SIZES),
                            ("layout", parts[1], tuple(LAYOUTS)),
                            ("method", parts[2], tuple(METHODS)),
                            ("cluster", (parts + [""])[3] or None,
                             tuple(presets.CLUSTERS))):
    if part is not None and part not in names:
      return (f"case {case!r}: unknown {what} {part!r}; one of "
              f"{', '.join(names)}")
  return None


def _programs_spec(text: str) -> str:
  """An argparse ``type``: ``ROUND:MODE,...`` (a round >= 0, a consensus
  mode of :data:`decentral_jax.runner.step.CONSENSUS_MODES`)."""
  from decentral_jax.runner import step as step_lib
  for part in flag_types.comma_parts(text, "1:none"):
    r, _, mode = part.partition(":")
    if not (flag_types.ascii_int(r) is not None
            and mode in step_lib.CONSENSUS_MODES):
      raise argparse.ArgumentTypeError(
          f"entry {part!r} must be ROUND:MODE, a round >= 0 and a mode of "
          f"{', '.join(step_lib.CONSENSUS_MODES)}, e.g. 1:none")
  return text


def _parser() -> argparse.ArgumentParser:
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--table", action="store_true",
                  help="print the study's table from --out and --hlo")
  ap.add_argument("--cases", default=None,
                  type=overlap_flags.name_list("case", case_error,
                                               "124m:node:plain"),
                  help="comma list of SIZE:LAYOUT:METHOD[:CLUSTER] (sizes "
                  "124m, 350m, 1.3b; layouts node, 2nodes; methods plain, "
                  "choco, bf16; the cluster whose link times the profile "
                  "gives, default h100_node / h100_ib)")
  ap.add_argument("--out", required=True, help="JSON lines, appended")
  ap.add_argument("--bins", default="/tmp/gpt2_token_bins",
                  help="where the dummy token files (zeros) are written; a "
                  "train.bin or val.bin already there that is not exactly "
                  "that dummy is refused, never replaced")
  ap.add_argument("--hlo", default="")
  ap.add_argument("--fixtures", default="")
  ap.add_argument("--programs", default=None, type=_programs_spec,
                  help="ROUND:MODE,... instead of the default programs")
  ap.add_argument("--overlap_limit", type=flag_types.integer(
      0, overlap_flags.MAX_OVERLAP_LIMIT), default=0,
                  help="collectives in flight at once (default 0: what the "
                  "profile cluster's links allow, runtime_model.links)")
  ap.add_argument("--everything", action="store_true",
                  help="also the first program with the consensus measurement")
  return ap


def check_paths(args) -> None:
  """Refuses before any compile what would fail after it: no --cases to
  compile, an --out to read (--table) or write that cannot be,
  directories (--bins, --hlo, --fixtures) that cannot be written, and a
  train.bin or val.bin in --bins that is not exactly the dummy of
  :data:`DUMMY_TOKENS` (:func:`decentral_jax.tools.dummy_bins.check_dummy_bins`).

  Raises:
    ValueError: one line naming the flag and the fix.
  """
  if args.table:
    flag_types.check_input_file(args.out, "--out")
    return
  if not args.cases:
    raise ValueError("--cases is needed to compile (e.g. --cases "
                     "124m:node:plain), or --table to print the table of "
                     "--out.")
  flag_types.check_output_file(args.out, "--out")
  flag_types.check_output_dir(args.bins, "--bins")
  dummy_bins.check_dummy_bins(args.bins, DUMMY_TOKENS, "--bins")
  for flag in ("hlo", "fixtures"):
    if getattr(args, flag):
      flag_types.check_output_dir(getattr(args, flag), f"--{flag}")


def parse_args(argv=None):
  """The flags, paths checked (:func:`check_paths`) before any compile."""
  ap = _parser()
  args = ap.parse_args(argv)
  try:
    check_paths(args)
  except ValueError as e:
    ap.error(str(e))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.table:
    missing = missing_hlo(args.out, args.hlo)
    if missing:
      print(f"error: --table needs the scheduled HLO of every row of "
            f"{args.out} under --hlo {args.hlo!r}, written by the compiles "
            f"(--cases ... --hlo DIR); missing {missing[0]!r} and "
            f"{len(missing) - 1} more (the repository keeps the rows and a "
            "few stripped fixtures, not every program).", file=sys.stderr)
      return 2
    print(table(args.out, args.hlo))
    return 0
  done = {r["case"] for r in read_rows(args.out)}
  todo = [case for case in args.cases.split(",") if case not in done]
  if todo:
    try:
      dummy_bins.write_dummy_bins(args.bins, DUMMY_TOKENS, "--bins")
    except ValueError as e:  # a token file put there after the check
      print(f"error: {e}", file=sys.stderr)
      return 2
  for case in todo:
    for row in run_case(case, args):
      flag_types.write_output(args.out, "--out", lambda f, row=row: f.write(
          json.dumps(row) + "\n"), mode="a",
                           kept="the cases before this one are in it")
      print(json.dumps({k: row[k] for k in ("case", "round", "consensus",
                                            "compile_s")}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
