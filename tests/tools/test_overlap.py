"""The overlap report of scheduled HLO, and the runner's GPU programs.

Part 1 reads a hand-written scheduled module whose expected report is
worked out by hand below. Part 2 reads the scheduled HLO of the runner's
own train steps compiled for 8 x H200 and 8 x A100 on a machine without a
GPU (``tests/fixtures/gpu_overlap/``, written by
``benchmarks/bench_gpu_overlap.py --fixtures``; stripped to what the
report reads): before (round chosen by ``lax.switch``, consensus distance
in a ``lax.cond``) the gossip sits in conditionals with nothing in flight;
after (the GPU defaults) every parameter-sized collective is asynchronous,
outside conditionals, with backward work in flight. Part 3 (marked
``integration``; needs ``requirements-gpu-compile.txt``) compiles the
default step deviceless and checks the same live.
"""

import glob
import gzip
import json
import os

import pytest

from decentral_jax import analysis
from decentral_jax.analysis import overlap

from conftest import FIXTURES

_FWD = 'metadata={op_name="jit(step)/shard_map/jvp(GPT)/h_0/mlp"}'
_BWD = 'metadata={op_name="jit(step)/shard_map/transpose(jvp(GPT))/h_0/mlp"}'
_SYNC = 'backend_config={"collective_backend_config":{"is_sync":true}}'

_HLO = f"""\
HloModule m, is_scheduled=true, num_partitions=4

%fused (p: f32[8]) -> f32[8] {{
  ROOT %p = f32[8]{{0}} parameter(0)
}}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%gemm (ga: f32[2,4], gb: f32[4,8]) -> f32[2,8] {{
  %ga = f32[2,4]{{1,0}} parameter(0)
  %gb = f32[4,8]{{1,0}} parameter(1)
  ROOT %gd = f32[2,8]{{1,0}} dot(%ga, %gb), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (w: f32[8]) -> f32[8] {{
  %w = f32[8]{{0}} parameter(0)
  %w1 = f32[8]{{0}} fusion(%w), kind=kLoop, calls=%fused, {_BWD}
  ROOT %w2 = f32[2,8]{{1,0}} fusion(%w1, %w1), kind=kCustom, calls=%gemm, {_BWD}
}}

%cond (c: f32[8]) -> pred[] {{
  %c = f32[8]{{0}} parameter(0)
  ROOT %t = pred[] constant(true)
}}

%branch0 (q: f32[8]) -> f32[8] {{
  %q = f32[8]{{0}} parameter(0)
  %bs = (f32[8]{{0}}, f32[8]{{0}}) collective-permute-start(%q), channel_id=5, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}
  %bf = f32[8]{{0}} fusion(%q), kind=kLoop, calls=%fused, {_BWD}
  %bd = f32[8]{{0}} collective-permute-done(%bs)
  ROOT %br = f32[8]{{0}} add(%bd, %bf)
}}

%branch1 (r: f32[8]) -> f32[8] {{
  ROOT %r = f32[8]{{0}} parameter(0)
}}

%rs_wrapped (v: f32[8]) -> f32[2] {{
  %v = f32[8]{{0}} parameter(0)
  ROOT %rs = f32[2]{{0}} reduce-scatter(%v), channel_id=6, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, to_apply=%add
}}

ENTRY %main (x: f32[8], k: s32[], m: f32[2,4], mm: f32[4,8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %k = s32[] parameter(1)
  %m = f32[2,4]{{1,0}} parameter(2)
  %mm = f32[4,8]{{1,0}} parameter(3)
  %ps = (f32[8]{{0}}, f32[8]{{0}}) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}},{{2,3}},{{3,2}}}}, metadata={{op_name="jit(step)/shard_map/ppermute"}}
  %f1 = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused, {_FWD}
  %gte = f32[8]{{0}} get-tuple-element(%ps), index=0
  %f2 = f32[8]{{0}} fusion(%f1), kind=kLoop, calls=%fused, {_BWD}
  %loop = f32[8]{{0}} while(%f2), condition=%cond, body=%body
  %f3 = f32[8]{{0}} fusion(%loop), kind=kLoop, calls=%fused
  %dt = f32[2,8]{{1,0}} dot(%m, %mm), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_FWD}
  %pd = f32[8]{{0}} collective-permute-done(%ps)
  %as = f32[8]{{0}} all-reduce-start(%pd), channel_id=2, replica_groups={{}}, to_apply=%add, {_SYNC}
  %ad = f32[8]{{0}} all-reduce-done(%as)
  %rss = ((f32[8]{{0}}), f32[2]{{0}}) async-start(%ad), calls=%rs_wrapped
  %f4 = f32[8]{{0}} fusion(%ad), kind=kLoop, calls=%fused, {_BWD}
  %rsd = f32[2]{{0}} async-done(%rss)
  %ag = f32[8]{{0}} all-gather(%rsd), channel_id=3, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
  %sel = f32[8]{{0}} conditional(%k, %ag, %ag), branch_computations={{%branch0, %branch1}}
  ROOT %o = f32[8]{{0}} add(%sel, %f4)
}}
"""


def _by_name(report):
  return {c.name: c for c in report.collectives}


def test_hand_worked_schedule():
  rep = overlap.overlap_report(_HLO)
  assert rep.scheduled
  got = _by_name(rep)
  assert sorted(got) == ["ag", "as", "bs", "ps", "rss"]
  # Permute in ENTRY: f1 (forward), f2 (backward), the loop body's two
  # backward fusions, f3 (no op_name: other), dt (forward); get-tuple-
  # element is not compute. 8 floats = 32 bytes. Matmuls: dt and the
  # body's gemm fusion, each [2,4] x [4,8]: 2 * 16 * 4 = 128 FLOPs; the
  # program has no other.
  ps = got["ps"]
  assert (ps.kind, ps.bytes, ps.is_async, ps.in_conditional) == (
      "collective-permute", 32.0, True, False)
  assert (ps.forward, ps.backward, ps.other) == (2, 3, 1)
  assert ps.flops == 256.0 and rep.total_flops == 256.0
  assert rep.flops_fraction(ps) == 1.0 and rep.flops_in_flight == 256.0
  # By phase: dt is forward, the body's gemm fusion backward, both in
  # flight during the permute.
  assert (rep.forward_flops, rep.backward_flops) == (128.0, 128.0)
  assert (rep.forward_flops_in_flight, rep.backward_flops_in_flight) == (
      128.0, 128.0)
  assert rep.in_flight_fractions() == (1.0, 1.0)
  assert ps.overlapped and ps.op_name == "jit(step)/shard_map/ppermute"
  # all-reduce marked is_sync: synchronous, nothing counted.
  assert not got["as"].is_async and got["as"].between == 0
  assert not got["as"].overlapped
  # reduce-scatter wrapped in async-start, one backward fusion in flight
  # but no matrix multiply, in a program that has some: exposed.
  rs = got["rss"]
  assert (rs.kind, rs.is_async, rs.backward, rs.flops, rs.overlapped) == (
      "reduce-scatter", True, 1, 0.0, False)
  # A plain all-gather is synchronous.
  assert got["ag"].kind == "all-gather" and not got["ag"].is_async
  # In a branch: async with backward work in flight, but that work is the
  # branch's own: not overlap with the step's forward/backward.
  bs = got["bs"]
  assert bs.in_conditional and bs.is_async and bs.backward == 1
  assert not bs.overlapped
  # Text order: the branch comes before ENTRY. The all-gather sends 8 B.
  assert [c.name for c in rep.exposed()] == ["bs", "as", "rss", "ag"]
  assert [c.name for c in rep.exposed(min_bytes=20)] == ["bs", "as", "rss"]


def test_without_matmuls_forward_or_backward_work_counts():
  # The same schedule without its two matrix multiplies: the reduce-scatter
  # with one backward fusion in flight is overlapped.
  hlo = _HLO.replace("dot(%ga, %gb)", "add(%ga, %gb)").replace(
      "dot(%m, %mm)", "add(%m, %mm)")
  rep = overlap.overlap_report(hlo)
  assert rep.total_flops == 0.0
  assert _by_name(rep)["rss"].overlapped and _by_name(rep)["ps"].overlapped
  assert [c.name for c in rep.exposed()] == ["bs", "as", "ag"]


def test_flops_in_flight_count_each_instruction_once():
  # Two permutes in flight over the same [2,4] x [4,8] dot (128 FLOPs):
  # each sees 128, the program 128 in flight, not 256.
  hlo = f"""\
HloModule two, is_scheduled=true, num_partitions=2

ENTRY %main (m: f32[2,4], mm: f32[4,8]) -> f32[2,8] {{
  %m = f32[2,4]{{1,0}} parameter(0)
  %mm = f32[4,8]{{1,0}} parameter(1)
  %a = (f32[2,4]{{1,0}}, f32[2,4]{{1,0}}) collective-permute-start(%m), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
  %b = (f32[4,8]{{1,0}}, f32[4,8]{{1,0}}) collective-permute-start(%mm), channel_id=2, source_target_pairs={{{{0,1}},{{1,0}}}}
  %d = f32[2,8]{{1,0}} dot(%m, %mm), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_BWD}
  %ad = f32[2,4]{{1,0}} collective-permute-done(%a)
  %bd = f32[4,8]{{1,0}} collective-permute-done(%b)
  ROOT %e = f32[2,8]{{1,0}} dot(%ad, %bd), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
  rep = overlap.overlap_report(hlo)
  assert [c.flops for c in rep.collectives] == [128.0, 128.0]
  assert rep.total_flops == 256.0 and rep.flops_in_flight == 128.0
  # d is backward and in flight; e (no op_name) is neither pass; no
  # forward matmul at all.
  assert (rep.forward_flops, rep.backward_flops) == (0.0, 128.0)
  assert rep.in_flight_fractions() == (0.0, 1.0)
  assert [c.bytes for c in rep.collectives] == [32.0, 128.0]


_WORKERS_HLO = f"""\
HloModule w, is_scheduled=true, num_partitions=4

ENTRY %main (m: f32[2,4], mm: f32[4,8]) -> f32[2,8] {{
  %m = f32[2,4]{{1,0}} parameter(0)
  %mm = f32[4,8]{{1,0}} parameter(1)
  %g = (f32[2,4]{{1,0}}, f32[2,4]{{1,0}}) collective-permute-start(%m), channel_id=1, source_target_pairs={{{{0,2}},{{2,0}},{{1,3}},{{3,1}}}}
  %d1 = f32[2,8]{{1,0}} dot(%m, %mm), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_BWD}
  %gd = f32[2,4]{{1,0}} collective-permute-done(%g)
  %f = (f32[2,4]{{1,0}}, f32[4,4]{{1,0}}) all-gather-start(%gd), channel_id=2, replica_groups={{{{0,1}},{{2,3}}}}, dimensions={{0}}
  %d2 = f32[2,8]{{1,0}} dot(%m, %mm), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_FWD}
  %fd = f32[4,4]{{1,0}} all-gather-done(%f)
  ROOT %e = f32[2,8]{{1,0}} add(%d1, %d2)
}}
"""


def test_gossip_across_workers_told_from_fsdp_inside_one():
  # 2 workers of 2 devices (devices 0, 1 are worker 0's): the permute pairs
  # 0<->2, 1<->3 cross workers (the gossip); the all-gather's groups {0,1},
  # {2,3} stay inside each (fsdp). Each has one [2,4] x [4,8] dot (128
  # FLOPs) in flight: the gossip a backward one, the all-gather a forward.
  from decentral_jax.analysis import accounting
  colls = {c.name: c for c in accounting.communication(
      _WORKERS_HLO).collectives}
  assert overlap.crosses_workers(colls["g"], 2)
  assert not overlap.crosses_workers(colls["f"], 2)
  # One device per worker: both cross; one worker of 4: neither.
  assert overlap.crosses_workers(colls["f"], 1)
  assert not overlap.crosses_workers(colls["g"], 4)
  with pytest.raises(ValueError, match="devices_per_worker must be >= 1"):
    overlap.crosses_workers(colls["g"], 0)
  every = overlap.overlap_report(_WORKERS_HLO)
  assert every.flops_in_flight == 256.0
  assert every.in_flight_fractions() == (1.0, 1.0)
  gossip = overlap.overlap_report(_WORKERS_HLO, only=lambda nm: nm == "g")
  assert gossip.flops_in_flight == 128.0
  assert gossip.in_flight_fractions() == (0.0, 1.0)
  assert gossip.collectives == every.collectives  # rows unchanged


def test_summary_and_json_name_the_verdicts():
  rep = overlap.overlap_report(_HLO)
  text = rep.summary()
  assert "overlapped" in text and "EXPOSED" in text
  assert text.count("\n") == len(rep.collectives) + 1
  assert '"overlapped": true' in rep.to_json()
  assert json.loads(rep.to_json())["in_flight_fractions"] == {
      "forward": 1.0, "backward": 1.0}
  assert analysis.overlap_report is overlap.overlap_report


def test_unscheduled_text_and_bad_input():
  rep = overlap.overlap_report(_HLO.replace("is_scheduled=true, ", ""))
  assert not rep.scheduled and "not scheduled" in rep.summary()
  with pytest.raises(ValueError, match="ENTRY"):
    overlap.overlap_report("HloModule m\n")
  with pytest.raises(ValueError, match="Compiled"):
    overlap.overlap_report(3)


# ---------------------------------------------------------------------------
# Part 2: the runner's programs compiled for GPUs (committed fixtures).
# ---------------------------------------------------------------------------

_GPU = os.path.join(FIXTURES, "gpu_overlap")
# gpt_tiny's parameters (float32): per layer c_attn 128x384, c_proj 128x128,
# c_fc 128x512, mlp c_proj 512x128, two LayerNorm scales of 128; plus ln_f
# (128), wpe (64x128) and wte (256x128):
# 2 * 196,864 + 41,088 = 434,816 parameters = 1,739,264 bytes.
_PARAM_BYTES = 4 * (2 * (128 * 384 + 128 * 128 + 128 * 512 + 512 * 128 +
                         2 * 128) + 128 + 64 * 128 + 256 * 128)


def _fixture(name: str):
  path = os.path.join(_GPU, name)
  assert os.path.exists(path), (
      f"missing fixture {path}: run benchmarks/bench_gpu_overlap.py "
      "--fixtures tests/fixtures/gpu_overlap")
  with gzip.open(path, "rt") as f:
    return overlap.overlap_report(f.read())


def _names(pattern: str) -> list[str]:
  return sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(_GPU, pattern)))


def test_param_bytes_of_gpt_tiny():
  assert _PARAM_BYTES == 1_739_264


def test_before_the_gossip_sits_in_conditionals_with_nothing_in_flight():
  # One program for every round (lax.switch): one permute per round, each
  # in its own branch; the consensus distance's All-Reduce in the log-step
  # conditional, synchronous.
  rep = _fixture("gpt_tiny_before_h200_rNone_logged.hlo.gz")
  big = rep.select(min_bytes=_PARAM_BYTES)
  kinds = sorted(c.kind for c in big)
  assert kinds == ["all-reduce"] + ["collective-permute"] * 3
  assert all(c.in_conditional and not c.overlapped for c in big)
  assert all(c.forward + c.backward == 0 for c in big)
  assert [c.is_async for c in big if c.kind == "all-reduce"] == [False]
  # AER on 2 hosts of 4 and 2 devices x 4 virtual workers, and on A100s:
  # the same.
  for name, count in (("gpt_tiny", 4), ("aer", 3), ("virtual", 2)):
    for target in ("h200", "a100_sxm_80"):
      big = _fixture(f"{name}_before_{target}_rNone_logged.hlo.gz").select(
          min_bytes=_PARAM_BYTES)
      assert len(big) == count, (name, target)
      assert all(c.in_conditional and not c.overlapped for c in big), name


def test_after_every_parameter_sized_collective_overlaps_backward():
  names = _names("*_after_*.hlo.gz")
  # Every distinct round, with and without the consensus measurement, on
  # 8 x H200 and 8 x A100: one_peer_exp (3 rounds), AER (2 distinct
  # rounds) on 2 hosts of 4, 2 devices x 4 virtual workers (3 rounds).
  expected = {f"{case}_after_{target}_r{r}_{mode}.hlo.gz"
              for case, rounds in (("gpt_tiny", 3), ("aer", 2),
                                   ("virtual", 3))
              for target in ("h200", "a100_sxm_80")
              for r in range(rounds) for mode in ("none", "input")}
  assert expected <= set(names), sorted(expected - set(names))
  for name in names:
    rep = _fixture(name)
    assert rep.scheduled, name
    if name.startswith("virtual_after_") and name.endswith(
        ("_r0_none.hlo.gz", "_r1_none.hlo.gz")):
      # Rounds 0 and 1 pair workers 2^k apart (k = 0, 1): each pair lies
      # on one device of 4 workers, so nothing crosses devices.
      assert rep.collectives == (), name
      continue
    big = rep.select(min_bytes=_PARAM_BYTES / 4)
    assert big, name
    for c in big:
      assert c.is_async and not c.in_conditional, (name, c)
      assert c.overlapped and c.backward > 0 and c.flops > 0, (name, c)
    if name.endswith("_input.hlo.gz"):  # the consensus distance's mean
      assert any(c.kind == "all-reduce" for c in big), name


def test_virtual_workers_gossip_overlaps_the_consensus_all_reduce():
  # 2 devices x 4 virtual workers, round 2 (the pairs span the devices),
  # in the step that measures the consensus distance. Without the
  # optimization barrier in the step, XLA fused the gather of the
  # LayerNorm scales sent by the permute with the consensus reduction that
  # reads the All-Reduce's result, so the permute could start only after
  # the All-Reduce's done: nothing of the backward pass in flight on A100
  # (docs/gpu_overlap.md). Now the two are in flight together.
  for target in ("h200", "a100_sxm_80"):
    name = f"virtual_after_{target}_r2_input.hlo.gz"
    rep = _fixture(name)
    with gzip.open(os.path.join(_GPU, name), "rt") as f:
      entry = f.read().split("\nENTRY ", 1)[1].split("\n")
    big = rep.select(min_bytes=_PARAM_BYTES)
    # The permute carries the 4 workers of a device: 4 x the parameters.
    [perm] = [c for c in big if c.kind == "collective-permute"]
    [red] = [c for c in big if c.kind == "all-reduce"]
    assert perm.bytes == 4 * _PARAM_BYTES and red.bytes == _PARAM_BYTES
    assert perm.overlapped and perm.backward > 0 and perm.flops > 0, name
    assert red.overlapped and red.backward > 0, name
    # Both in flight at once: in ENTRY's scheduled order each one's start
    # comes before the other's done.
    def line_of(pattern):
      [i] = [i for i, line in enumerate(entry) if pattern in line]
      return i
    p0, p1 = line_of(f"%{perm.name} = "), line_of(f"-done(%{perm.name})")
    r0, r1 = line_of(f"%{red.name} = "), line_of(f"-done(%{red.name})")
    assert p0 < p1 and r0 < r1, name
    assert p0 < r1 and r0 < p1, name


# ---------------------------------------------------------------------------
# Part 3: compiled here (requirements-gpu-compile.txt; pytest -m integration).
# ---------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("overrides, topology, programs, target", [
    ((), "1x1x8", [(0, "none"), (0, "input")], "h200"),
    (("topology=alternating_exp_ring", "workers_per_node=4"), "2x1x4",
     [(0, "none")], "h200"),
    # Round 2: the one whose pairs span the 2 devices of 4 workers.
    (("workers_per_device=4",), "1x1x2", [(2, "none")], "h200"),
    # The same round with the consensus measurement on A100 (XLA's fallback
    # cost model): the program whose permute once waited for the All-Reduce.
    (("workers_per_device=4",), "1x1x2", [(2, "input")], "a100_sxm_80")])
def test_deviceless_compile_of_the_default_steps(overrides, topology,
                                                 programs, target):
  from decentral_jax.runner import config as config_lib
  from decentral_jax.tools import gpu_compile
  config = config_lib.load_config(
      os.path.join(os.path.dirname(FIXTURES), "..", "configs", "gpt_tiny.py"),
      overrides)
  exp, steps = gpu_compile.compile_steps(config, target=target,
                                        topology=topology, programs=programs)
  assert (exp.programs.gossip_rounds, exp.programs.consensus_at) == (
      "static", "next_step")
  assert set(programs) <= set(exp.programs.keys())
  assert len(steps) == len(programs)
  for s in steps:
    big = s.report.select(min_bytes=_PARAM_BYTES / 4)
    assert big and all(c.overlapped and c.backward > 0 and c.flops > 0
                       for c in big), s.report.summary()


@pytest.mark.integration
def test_gpu_check_deviceless_mode(tmp_path):
  # benchmarks/gpu_check.py --deviceless: one program of the default step
  # for 8 x H200, its report as JSON, readable by the runtime model.
  import subprocess
  import sys
  from decentral_jax.runtime_model import in_flight
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "overlap.json"
  env = dict(os.environ, PYTHONPATH=root)
  r = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "gpu_check.py"),
       "--deviceless", "h200", "--programs", "1:none", "--json", str(out)],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "round 1, consensus none" in r.stdout and "overlapped" in r.stdout
  got = json.loads(out.read_text())
  assert (got["target"], got["topology"]) == ("h200", "1x1x8")
  assert got["param_bytes"] == _PARAM_BYTES
  [prog] = got["programs"]
  assert (prog["round"], prog["consensus"]) == (1, "none")
  # One permute of the whole parameters, overlapped with backward work.
  assert (prog["collectives"], prog["async"], prog["in_conditional"],
          prog["overlapped"]) == (1, 1, 0, 1)
  assert prog["fwd_bwd_ops_in_flight"][0][1] > 0
  frac = prog["in_flight_fractions"]
  assert got["in_flight_fractions"] == frac and 0 < frac["backward"] <= 1
  assert in_flight.read_in_flight(str(out)) == (
      frac["forward"], frac["backward"])
