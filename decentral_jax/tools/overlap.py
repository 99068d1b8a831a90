"""Overlap of the train step's collectives with compute, compiled for GPUs.

Compiles (never runs) the runner's own train-step programs for a GPU target
on this machine, without a GPU (:mod:`decentral_jax.tools.gpu_compile`:
needs ``pip install -r requirements-gpu-compile.txt``), and reads from each
program's scheduled HLO, for every collective: bytes, asynchronous or not,
inside a conditional or not, and the forward / backward / other compute
instructions XLA scheduled between its start and done
(:func:`decentral_jax.analysis.overlap.overlap_report`).

Each case is compiled in two modes:

* ``before``: ``gossip_rounds=switch`` and ``consensus_at=log_step``, what
  every run did before ``"auto"`` existed (the round chosen in-graph by
  ``lax.switch``; the consensus distance in a ``lax.cond`` on log steps);
* ``after``: the defaults (``"auto"``; on a GPU ``static`` rounds chosen on
  the host where the method allows it, and ``next_step`` consensus).

Programs: ``before`` has one program per case with ``switch`` (one per
distinct round otherwise); ``after`` compiles every distinct round without
the consensus measurement and the first distinct round with it
(``--all_programs``: every round with it too).

Output: one JSON line per program in ``--out`` (default
``benchmarks/results/gpu_overlap.jsonl`` of the checkout, created by the
first run; the shipped rows are under ``benchmarks/results/gpu_overlap/``),
and a Markdown table on stdout.
``--timeline`` also draws each case's step on each target as a timeline
(:mod:`decentral_jax.analysis.timeline`: forward, backward, optimizer and
each collective from start to done, on the profile's clock where
``--profile FILE`` prices instructions, else a stated fallback) to a PNG
next to ``--out`` (``<out>_<case>_<target>.png``): the first program of
each mode, a before/after pair by default.
``--fixtures DIR`` also writes the scheduled HLO of the programs of
``--fixture_cases`` (at least one of them in ``--cases``), stripped to
what the overlap report reads and gzipped (the fixtures of
``tests/tools/test_overlap.py``). Every output path and ``--profile`` is
tried before the first compile (an empty one is refused, not read as "not
given"; the profile is read then, once, each cost a finite number of
microseconds >= 0), and ``--out`` naming a file the command reads is
refused.

  decentral-jax overlap --cases gpt_tiny,aer,virtual \\
      --targets h200,a100_sxm_80

(in a clone also ``python benchmarks/bench_gpu_overlap.py``). The cases'
configs are files of a source checkout (``configs/``), beside the imported
package; JAX runs on the CPU (``JAX_PLATFORMS=cpu`` unless set). Exit codes:
0; 2 after one ``error:`` line for a bad flag, case or config.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import time
import types

from decentral_jax import records
from decentral_jax.tools import distinct_paths
from decentral_jax.tools import dummy_bins
from decentral_jax.tools import flag_types
from decentral_jax.tools.overlap_cases import CASES, GPT2_SMALL
# The flags (re-exported: the command's parser and checks).
from decentral_jax.tools.overlap_flags import (  # noqa: F401
    DUMMY_TOKENS, MAX_GPUS_PER_NODE, MAX_NETWORK_GBPS, MAX_OVERLAP_LIMIT,
    NEEDS, OVERLAP_LIMIT_OPTION, SHIPPED_ROWS, build_parser, check_needs,
    check_paths, xla_options, xla_refusal)
# The rows read back (re-exported: --render's reader and its schema).
from decentral_jax.tools.overlap_rows import (  # noqa: F401
    ROW_SCHEMA, row_error, transfer_topology)

# The checkout that holds the imported package (tools/ is 2 deep).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Overrides of the mode "before" (what main did): the round chosen in-graph
# unless the config asks for static rounds (gpt2_small_owt does).
BEFORE = {"gpt2_small": ("consensus_at=log_step",)}
_BEFORE = ("gossip_rounds=switch", "consensus_at=log_step")
_LIMIT = OVERLAP_LIMIT_OPTION
# XLA's defaults of the options the runner now sets on GPUs.
XLA_DEFAULTS = {"xla_gpu_enable_latency_hiding_scheduler": False,
                _LIMIT: 1}


def network_flag(gbps: float, gpus_per_node: int) -> str:
  """XLA flag describing the cluster's network to its latency estimator.

  XLA's analytical ("speed of light") latency estimator, used by default
  for Hopper targets, prices a collective from these parameters; with the
  real inter-node rate it sees that a gossip round takes long and starts
  it earlier. Only ``nic_speed_gbps`` and ``gpus_per_node`` describe the
  cluster; the other values are fixed placeholders (not tuned). Must be in
  ``XLA_FLAGS`` before JAX starts (a map-valued option cannot be passed
  per compile in jaxlib 0.10.2).
  """
  return ("--xla_gpu_analytical_latency_estimator_options="
          f"nccl_op_launch_us=55,nic_speed_gbps={gbps:g},chunk_prep_us=1,"
          f"rtt_us=68,gpus_per_node={gpus_per_node},"
          "chunk_size_bytes=4194304")


def _overrides(case: str, mode: str, data_dir: str) -> list[str]:
  out = list(CASES[case][1])
  if mode == "before":
    out += BEFORE.get(case, _BEFORE)
  if CASES[case][0] == GPT2_SMALL:
    out.append(f"data.path={data_dir}")
  return out


def strip_hlo(text: str) -> str:
  """Scheduled HLO cut to what the overlap report reads (for fixtures).

  Keeps the module header's ``is_scheduled`` / partition fields and every
  computation except fused and reduction ones; of each instruction keeps
  its shape, opcode, operands and attributes except ``backend_config``
  (replaced by ``{"is_sync":true}`` where it says so) and ``metadata``
  (replaced by its ``op_name``).
  """
  from decentral_jax.analysis import hlo
  comps, entry, _ = hlo.parse_module(text)
  keep, todo = set(), [entry]
  while todo:
    comp = todo.pop()
    if comp in keep or comp not in comps:
      continue
    keep.add(comp)
    for ins in comps[comp]:
      for key, subs in hlo.called_computations(ins).items():
        if (ins.opcode == "fusion" and not _has_dot(subs, comps)) or (
            key == "to_apply" and ins.opcode != "call"):
          continue
        todo.extend(subs)
  head = text.split("\n", 1)[0]
  fields = re.findall(r"(is_scheduled=\w+|num_partitions=\d+|"
                      r"replica_count=\d+)", head)
  out = [f"HloModule {head.split()[1].rstrip(',')}, " + ", ".join(fields), ""]
  current = None
  for line in text.splitlines()[1:]:
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      current = name if name in keep else None
      if current:
        out.append(line)
    elif current and line.strip() == "}":
      out.extend(["}", ""])
      current = None
    elif current:
      out.append(_strip_line(line))
  return "\n".join(out) + "\n"


def _has_dot(subs, comps, seen=None) -> bool:
  """Whether computations ``subs`` (or fusions they call) hold a ``dot``."""
  from decentral_jax.analysis import hlo
  seen = set() if seen is None else seen
  for sub in subs:
    if sub in seen or sub not in comps:
      continue
    seen.add(sub)
    for ins in comps[sub]:
      if ins.opcode == "dot" or (ins.opcode == "fusion" and _has_dot(
          hlo.called_computations(ins).get("calls", []), comps, seen)):
        return True
  return False


def _strip_line(line: str) -> str:
  from decentral_jax.analysis import hlo
  sync = re.search(r'"is_sync"\s*:\s*true', line) is not None
  name = re.search(r'op_name="([^"]*)"', line)
  keys = ("metadata", "frontend_attributes")
  if "__cublas" not in line:  # a GEMM call keeps its dot dimensions
    keys += ("backend_config",)
  for key in keys:
    value = hlo.attribute(line, key)
    if value is not None:
      line = line.replace(f", {key}={value}", "")
  if name:
    line += f', metadata={{op_name="{name.group(1)}"}}'
  if sync:
    line += ', backend_config={"is_sync":true}'
  return line


def _programs(exp, mode: str, all_programs: bool):
  """The (distinct round, consensus mode) programs compiled for a case."""
  progs = exp.programs.keys()
  if mode == "before" or all_programs:
    return progs
  first = progs[0][0]
  return [(d, m) for d, m in progs if m != "input" or d == first]


def run_case(case: str, mode: str, target: str, args,
             timelines: dict | None = None) -> list[dict]:
  """Compiles one case in one mode for one target; one row per program
  (with ``timelines``, ``timelines[mode]`` is its first program's
  :class:`~decentral_jax.analysis.timeline.Timeline`)."""
  from decentral_jax.runner import config as config_lib
  from decentral_jax.tools import gpu_compile
  path, _, topology = CASES[case]
  overrides = _overrides(case, mode, args.data_dir)
  config = config_lib.load_config(os.path.join(_ROOT, path), overrides)
  # "after": the runner's own GPU options (programs.GPU_COMPILER_OPTIONS);
  # "before": XLA's defaults, as main compiled.
  options = dict(XLA_DEFAULTS) if mode == "before" else {}
  if args.overlap_limit:
    options[_LIMIT] = args.overlap_limit
  options.update(xla_options(args.xla))
  exp, steps = gpu_compile.compile_steps(
      config, target=target, topology=topology, compiler_options=options,
      programs=lambda e: _programs(e, mode, args.all_programs))
  import jax
  param_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(exp.abstract_params()))
  rows = []
  if timelines is not None and steps:
    from decentral_jax.analysis import timeline
    timelines[mode] = timeline.step_timeline(
        steps[0].compiled.as_text(), args.profile_costs)
  for s in steps:
    rows.append({
        "case": case, "mode": mode, "target": target, "topology": topology,
        "overrides": [o for o in overrides if not o.startswith("data.")],
        "gossip_rounds": exp.programs.gossip_rounds,
        "consensus_at": exp.programs.consensus_at,
        "distinct_round": s.distinct_round, "consensus": s.consensus,
        "param_bytes": param_bytes, "compile_s": round(s.compile_s, 1),
        "compiler_options": options or "runner's GPU_COMPILER_OPTIONS",
        "network_gbps": args.network_gbps or None,
        "total_flops": s.report.total_flops,
        "flops_in_flight": s.report.flops_in_flight,
        "collectives": json.loads(s.report.to_json())["collectives"]})
    if args.fixtures and case in args.fixture_cases.split(","):
      name = (f"{case}_{mode}_{target}_r{s.distinct_round}_{s.consensus}"
              ".hlo.gz")
      text = strip_hlo(s.compiled.as_text())
      from decentral_jax.analysis import overlap
      assert overlap.overlap_report(text) == s.report, name
      os.makedirs(args.fixtures, exist_ok=True)
      flag_types.write_output(
          os.path.join(args.fixtures, name), "--fixtures",
          lambda f, t=text: f.write(gzip.compress(t.encode(), 9)), mode="wb")
  return rows


def write_timeline(args, case: str, target: str, timelines: dict) -> str:
  """The PNG of a case's programs (one per mode) next to ``--out``."""
  from decentral_jax.tools import timeline_plot
  path = f"{os.path.splitext(args.out)[0]}_{case}_{target}.png"
  param = max((c.bytes for t in timelines.values() for c in t.collectives),
              default=0.0)
  timeline_plot.save_png(path, list(timelines.values()),
                         [f"{case}, {target}, {m}" for m in timelines],
                         min_bytes=param / 64)
  return path


def verdict(row: dict) -> dict:
  """Summary of one program: its collectives of >= 1/4 of the parameters
  (the gossip, whole or in buckets, and the consensus distance's mean;
  with many buckets per round, as for gpt2_small, >= 1/64)."""
  from decentral_jax.analysis import overlap
  frac = 64 if row["case"] == "gpt2_small" else 4
  big = [c for c in row["collectives"]
         if c["bytes"] >= row["param_bytes"] / frac]
  # The verdict of the current overlap_report (rows of older runs too).
  ok = [overlap.overlaps(types.SimpleNamespace(**c), row["total_flops"] > 0)
        for c in big]
  return {"n": len(big), "async": sum(c["is_async"] for c in big),
          "in_cond": sum(c["in_conditional"] for c in big),
          "bwd": [c["backward"] for c in big],
          "fwd": [c["forward"] for c in big],
          "overlapped": sum(ok)}


# A40 (the paper's second cluster): dense bfloat16 tensor peak, data sheet.
A40_PEAK_BF16 = 149.7e12
ASSUMED_MFU = 0.4


def transfer_table(rows: list[dict]) -> str:
  """In-flight compute against the runtime model's transfer time (A40).

  For each program: matmul FLOPs per worker and step, the share scheduled
  while a collective is in flight, that share's time on an A40 at
  :data:`ASSUMED_MFU`, the time the runtime model gives for moving the
  program's gossip round (and, in the programs that measure it, the
  consensus All-Reduce) on the paper's A40
  cluster (4 GPUs per node on PCIe 4.0, 25 Gbit/s Ethernet), and the MFU
  up to which the in-flight compute lasts longer than the transfer.
  """
  from decentral_jax.runtime_model.costs import all_reduce_cost
  from decentral_jax.runtime_model.costs import round_cost
  from decentral_jax.runtime_model import paper
  out = ["| program | mode | matmul GFLOP/step | in flight | in-flight time "
         f"at {ASSUMED_MFU:.0%} MFU (ms) | transfer, A40 cluster (ms) | "
         "hidden up to MFU |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    cluster, _ = paper.setup("A40", 8)
    topo = transfer_topology()
    rnds = (topo.distinct_rounds if r["distinct_round"] is None
            else [topo.distinct_rounds[r["distinct_round"]]])
    transfer = max(float(round_cost(cluster, rnd).time(
        r["param_bytes"]).max()) for rnd in rnds)
    if r["consensus"] == "input":  # ("logged": in a conditional, apart)
      transfer += float(all_reduce_cost(cluster).time(
          r["param_bytes"]).max())
    flight_s = r["flops_in_flight"] / (A40_PEAK_BF16 * ASSUMED_MFU)
    limit = r["flops_in_flight"] / (A40_PEAK_BF16 * transfer)
    prog = ("all rounds" if r["distinct_round"] is None
            else f"round {r['distinct_round']}") + f", {r['consensus']}"
    out.append(f"| {prog} | {_mode(r)} | {r['total_flops'] / 1e9:,.0f} | "
               f"{_share(r['flops_in_flight'], r['total_flops'])} | "
               f"{1e3 * flight_s:,.0f} | {1e3 * transfer:,.0f} | "
               f"{limit:.0%} |")
  return "\n".join(out)


def _share(part: float, total: float) -> str:
  """``part / total`` as a percentage; ``-`` for a program without matmuls."""
  return f"{part / total:.0%}" if total else "-"


def _mode(r: dict) -> str:
  """The mode of a row with its extra network model and XLA options."""
  out = r["mode"]
  if r.get("network_gbps"):
    out += f" + {r['network_gbps']:g} Gbit/s model"
  options = r.get("compiler_options")
  if isinstance(options, dict):
    extra = {k: v for k, v in options.items() if XLA_DEFAULTS.get(k) != v}
    out += "".join(f" + {k.removeprefix('xla_gpu_')}={v}"
                   for k, v in extra.items())
  return out


def table(rows: list[dict]) -> str:
  """Markdown: one line per program."""
  out = ["| case | target | mode | dispatch | program | param-sized "
         "collectives | async | in a conditional | fwd / bwd ops in flight "
         "| overlapped | matmul FLOPs in flight |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    v = verdict(r)
    prog = ("all rounds" if r["distinct_round"] is None
            else f"round {r['distinct_round']}") + f", {r['consensus']}"
    flight = ", ".join(f"{f}/{b}" for f, b in zip(v["fwd"], v["bwd"]))
    if len(v["bwd"]) > 6:  # many buckets: a summary
      busy = sum(f + b > 0 for f, b in zip(v["fwd"], v["bwd"]))
      flight = (f"{busy} of {len(v['bwd'])} with some; most "
                f"{max(v['fwd'])}/{max(v['bwd'])}")
    out.append(f"| {r['case']} | {r['target']} | {_mode(r)} | "
               f"{r['gossip_rounds']}/{r['consensus_at']} | {prog} | {v['n']} "
               f"| {v['async']} | {v['in_cond']} | {flight or '-'} | "
               f"{v['overlapped']} of {v['n']} | "
               f"{r['flops_in_flight'] / max(r['total_flops'], 1):.0%} |")
  return "\n".join(out)


def render(paths: list[str]) -> None:
  """Prints the tables of earlier runs (``--out`` files).

  Raises:
    ValueError: no file given, one file given twice, a file missing, a
      directory, or damaged (a
      line not a JSON object, or a row :func:`~decentral_jax.tools.
      overlap_rows.row_error` refuses: a key of :data:`ROW_SCHEMA` missing,
      any written key or collective of the wrong kind or range, more FLOPs
      in flight than in all), named in one line with the line and key; a file whose
      only line is not JSON and has no newline (no readable record); a
      file without a record (empty, or blank lines only). A last line
      cut short after good rows is left out with a note on stderr.
  """
  if not paths:
    raise ValueError("--render needs the JSON-lines files of earlier runs "
                     f"(their --out), e.g. --render {SHIPPED_ROWS}.")
  distinct_paths.check_each_once("--render", paths)
  rows = []
  for path in paths:
    if os.path.isdir(path):
      raise ValueError(f"--render {path!r} is a directory; give the "
                       "JSON-lines files of earlier runs (their --out).")
    got = records.read_jsonl(path, row_error)
    if isinstance(got, records.Damaged):
      raise got.error("--render ")
    if got.torn is not None:  # a last line without newline, not JSON
      if not got.records:
        raise ValueError(f"--render {path}: no readable record (line "
                         f"{got.torn}, its only one, is not JSON); give the "
                         "--out file of an earlier run.")
      print(f"note: --render {path}: line {got.torn} (the last, without "
            "its newline) is not JSON, a write cut short; left out.",
            file=sys.stderr)
    if not got.records:  # an empty table said nothing was read
      raise ValueError(f"--render {path}: no record (the file is empty or "
                       "only blank lines); give the --out file of an "
                       "earlier run.")
    rows += got.records
  print(table(rows))
  gpt2 = [r for r in rows if r["case"] == "gpt2_small"]
  if gpt2:
    print("\n" + transfer_table(gpt2))


def _run(args) -> None:
  """Compiles every case, target and mode; rows to ``--out``, tables."""
  rows = []
  t0 = time.time()
  for case in args.cases.split(","):
    for target in args.targets.split(","):
      timelines = {} if args.timeline else None
      for mode in args.modes.split(","):
        new = run_case(case, mode, target, args, timelines)
        rows += new
        # Progress: each case's rows as it compiles (the header once),
        # printed before the append, so a failed one loses nothing.
        print(table(new) if len(rows) == len(new)
              else table(new).split("\n", 2)[-1], flush=True)
        flag_types.write_output(
            args.out, "--out", lambda f, new=new: f.writelines(
                json.dumps(r) + "\n" for r in new), mode="a",
            kept="the rows of the table above were compiled")
      if timelines:
        print(f"timeline: {write_timeline(args, case, target, timelines)}")
  print(f"\n{len(rows)} programs in {time.time() - t0:.0f} s; rows "
        f"appended to {args.out}")
  gpt2 = [r for r in rows if r["case"] == "gpt2_small"]
  if gpt2:
    print("\n" + transfer_table(gpt2))


def main(argv: list[str] | None = None,
         prog: str = "decentral-jax overlap") -> int:
  """Runs the command line ``argv`` (no program name; default
  ``sys.argv[1:]``); returns the exit code (argparse exits with 2 itself
  on a bad flag, and with 0 after ``--help``)."""
  ap = build_parser(prog)
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  try:
    xla_options(args.xla)  # the form; XLA checks names and types below
    check_needs(args, flag_types.given_flags(ap, argv))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.render is not None:
    try:
      render(args.render)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  try:  # before any compile
    check_paths(args)
    if "gpt2_small" in args.cases:  # compiles read no text: zeros
      dummy_bins.write_dummy_bins(args.data_dir, DUMMY_TOKENS, "--data_dir")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts
  if args.network_gbps:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                               network_flag(args.network_gbps,
                                            args.gpus_per_node)).strip()
  from decentral_jax.tools import gpu_compile  # JAX starts here
  try:  # XLA's own word on each --xla option, before the slow compiles
    gpu_compile.check_compiler_options(xla_options(args.xla))
  except ValueError as e:
    print(f"error: {xla_refusal(args.xla, str(e))}", file=sys.stderr)
    return 2
  try:
    _run(args)
  except ValueError as e:  # a missing config or a bad override: one line
    print(f"error: {e}", file=sys.stderr)
    return 2
  except RuntimeError as e:  # XLA refusing an --xla option by name
    if "compile option" not in str(e):
      raise
    print(f"error: --xla: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  return 0
