"""Roofline prices of a scheduled program's instructions.

Part 1 (no compile): a hand-written scheduled module whose FLOPs, bytes
and times are counted by hand below, and a hand-written scheduler dump.
Part 2 (marked ``integration``; needs ``requirements-gpu-compile.txt``):
the gpt_tiny step compiled for 8 x H100 with every instruction priced:
XLA's scheduler takes the roofline times (its own estimate of each priced
instruction equals the profile's).
"""

import os

import pytest

from decentral_jax.analysis import roofline

from conftest import FIXTURES

_HLO = """\
HloModule m, is_scheduled=true

%gemm (ga: bf16[64,128], gb: bf16[128,256]) -> bf16[64,256] {
  %ga = bf16[64,128]{1,0} parameter(0)
  %gb = bf16[128,256]{1,0} parameter(1)
  ROOT %gd = bf16[64,256]{1,0} dot(%ga, %gb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%addf (p0: f32[1024], p1: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  ROOT %s = f32[1024]{0} add(%p0, %p1)
}

%body (w: f32[256]) -> f32[256] {
  %w = f32[256]{0} parameter(0)
  ROOT %wc = f32[256]{0} copy(%w)
}

%cond (c: f32[256]) -> pred[] {
  %c = f32[256]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], x: f32[1024], v: f32[256]) -> f32[256] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  %x = f32[1024]{0} parameter(2)
  %v = f32[256]{0} parameter(3)
  %ps = (f32[1024]{0}, f32[1024]{0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %g = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %pd = f32[1024]{0} collective-permute-done(%ps)
  %l = f32[1024]{0} fusion(%pd, %pd), kind=kLoop, calls=%addf
  %bc = f32[256]{0} bitcast(%v)
  ROOT %loop = f32[256]{0} while(%bc), condition=%cond, body=%body
}
"""

# Dense peak 1 TFLOP/s, 1 TB/s, both at half efficiency: 0.5e12 per s each.
_RL = roofline.Roofline(1e12, 1e12, 0.5, 0.5)


def test_hand_counted_roofline_times():
  costs = {c.name: c for c in roofline.instruction_costs(_HLO, _RL)}
  # Only compute instructions: no parameter, bitcast, collective, while,
  # constant of the loop condition (control flow is priced by its body).
  assert sorted(costs) == ["g", "l", "wc"]
  g, l, wc = costs["g"], costs["l"], costs["wc"]
  # GEMM: 2 * 64 * 256 * 128 FLOPs; bytes 64x128 + 128x256 + 64x256 bf16.
  assert (g.kind, g.flops) == ("gemm", 2 * 64 * 256 * 128)
  assert g.bytes == 2 * (64 * 128 + 128 * 256 + 64 * 256) == 114_688
  # Compute-bound: 4,194,304 / 0.5e12 s = 8.388608 us (bytes: 0.229 us).
  assert g.us == pytest.approx(8.388608, rel=1e-12)
  # Loop fusion reading one f32[1024] (named twice, read once) and writing
  # one: 8192 bytes / 0.5e12 = 0.016384 us.
  assert (l.kind, l.flops, l.bytes) == ("fusion", 0.0, 8192.0)
  assert l.us == pytest.approx(0.016384, rel=1e-12)
  # The copy in the loop body: 2 x 1024 bytes.
  assert (wc.kind, wc.bytes, wc.computation) == ("other", 2048.0, "body")
  assert wc.us == pytest.approx(0.004096, rel=1e-12)


_SCHEDULE = """\
hlo_module {
  name: "m"
  computations {
    name: "main"
    instructions {
      name: "g"
      opcode: "fusion"
      metadata {
        op_name: "jvp(GPT)/h_0/mlp"
      }
      id: 7
    }
    instructions {
      name: "l"
      opcode: "fusion"
      id: 8
    }
  }
}
computation_schedules {
  computation_id: 1
  instructions {
    id: 7
    start_timestamp_cycles: 2
    end_timestamp_cycles: 12
  }
  instructions {
    id: 8
    end_timestamp_cycles: 3
  }
  cycles_per_microsecond: 2
}
"""


def test_xla_estimates_from_the_schedule_dump_and_the_class_table():
  xla = roofline.xla_instruction_us([_SCHEDULE])
  # (end - start) / cycles_per_microsecond; a missing start is 0.
  assert xla == {"g": 5.0, "l": 1.5}
  table = roofline.class_table(roofline.instruction_costs(_HLO, _RL), xla)
  assert table["gemm"]["count"] == 1 and table["gemm"]["xla_us"] == 5.0
  assert table["fusion"]["xla_us"] == 1.5
  assert table["other"]["xla_found"] == 0
  assert table["total"]["count"] == 3 and table["total"]["xla_found"] == 2
  assert table["total"]["roofline_us"] == pytest.approx(
      8.388608 + 0.016384 + 0.004096, rel=1e-12)
  text = roofline.format_class_table(table)
  assert "gemm" in text and "roofline ms" in text


def test_compute_in_flight_on_the_roofline_clock():
  costs = {c.name: c.us for c in roofline.instruction_costs(_HLO, _RL)}
  windows, union = roofline.in_flight_us(_HLO, costs)
  # Only the GEMM runs between the permute's start and done.
  assert windows == {"ps": pytest.approx(8.388608, rel=1e-12)}
  assert union == pytest.approx(8.388608, rel=1e-12)
  # A loop between them adds its body (the copy) once.
  moved = _HLO.replace(
      "  %pd = f32[1024]{0} collective-permute-done(%ps)\n", "").replace(
      "  ROOT %loop = f32[256]{0} while(%bc), condition=%cond, body=%body",
      "  %loop = f32[256]{0} while(%bc), condition=%cond, body=%body\n"
      "  ROOT %pd = f32[1024]{0} collective-permute-done(%ps)").replace(
      "fusion(%pd, %pd)", "fusion(%x, %x)")
  windows, _ = roofline.in_flight_us(moved, costs)
  assert windows["ps"] == pytest.approx(8.388608 + 0.016384 + 0.004096,
                                        rel=1e-12)


def test_bad_rooflines_name_the_field():
  with pytest.raises(ValueError, match="gemm_efficiency"):
    roofline.Roofline(1e12, 1e12, gemm_efficiency=0.0)
  with pytest.raises(ValueError, match="memory_efficiency"):
    roofline.Roofline(1e12, 1e12, memory_efficiency=1.5)
  with pytest.raises(ValueError, match="peak_flops"):
    roofline.Roofline(-1.0, 1e12)


def test_target_rooflines():
  from decentral_jax.tools import gpu_compile
  h100 = gpu_compile.target_roofline("h100_sxm")
  # NVIDIA's datasheet: 989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3.
  assert h100.peak_flops == 989.4e12
  assert h100.memory_bandwidth == pytest.approx(3.35e12, rel=1e-3)
  assert (h100.gemm_efficiency, h100.memory_efficiency) == (0.5, 0.7)
  assert gpu_compile.target_roofline("h200").memory_bandwidth == (
      pytest.approx(4.8e12, rel=0.02))
  with pytest.raises(ValueError, match="target must be one of"):
    gpu_compile.target_roofline("v100")


# ---------------------------------------------------------------------------
# Part 2: compiled here (requirements-gpu-compile.txt; pytest -m integration).
# ---------------------------------------------------------------------------


@pytest.mark.integration
def test_deviceless_compile_with_every_instruction_priced():
  from decentral_jax.runner import config as config_lib
  from decentral_jax.tools import gpu_compile
  config = config_lib.load_config(
      os.path.join(os.path.dirname(FIXTURES), "..", "configs", "gpt_tiny.py"),
      ("model.dtype=bfloat16",))
  _, [step] = gpu_compile.compile_steps(
      config, target="h100_sxm", topology="1x1x8", programs=[(0, "none")],
      cluster="A40", roofline=True)
  costs = step.roofline_costs
  assert costs and {c.kind for c in costs} >= {"gemm", "fusion"}
  # Every priced instruction is in the profile; XLA's scheduler took the
  # price of nearly all of them (its estimate equals the profile's).
  assert all(f'::{c.name}" cost_us:' in step.profile for c in costs)
  used = [c for c in costs if abs(step.profiled_instruction_us.get(
      c.name, -1.0) - c.us) <= 1e-3 + 1e-6 * c.us]
  assert len(used) >= 0.95 * len(costs), (len(used), len(costs))
  # Its busy time is then the roofline's sum (not its own cost model's).
  total = sum(c.us for c in costs)
  assert step.profiled_busy_us == pytest.approx(total, rel=0.1)
  assert step.xla_compute_us > 2 * step.profiled_busy_us
  table = step.class_table()
  assert table["total"]["count"] == len(costs)
  # The gossip permute stays asynchronous, outside conditionals, with
  # matmuls in flight.
  big = step.report.select(min_bytes=1e5)
  assert big and all(c.overlapped for c in big), step.report.summary()
