"""Latency profiles that tell XLA's GPU scheduler the cluster's transfer time.

Part 1 (no compile): the ``ProfiledInstructionsProto`` text, the costs read
from a hand-written scheduled module, the fingerprint, and the runtime
model's per-collective times on the paper's A40 cluster, checked against
the link formulas worked out by hand. Part 2 (marked ``integration``; needs
``requirements-gpu-compile.txt``): the default gpt_tiny step compiled for
8 x H200 with the A40 cluster's times. Without the profile XLA starts the
round's permute in the second half of the backward pass; with it the
permute of round 2 (the pairs that cross the two nodes: 974 us on 25
Gbit/s) is in flight during the whole forward and backward pass.
"""

import os
import types

import pytest

from decentral_jax import topology as topology_lib
from decentral_jax.analysis import overlap
from decentral_jax.tools import gpu_compile
from decentral_jax.tools import latency_profile
from decentral_jax.runtime_model import presets

from conftest import FIXTURES

_PARAM_BYTES = 1_739_264  # one gpt_tiny worker's parameters (float32)

_SYNC = 'backend_config={"collective_backend_config":{"is_sync":true}}'
_DIAG = 'metadata={op_name="jit(step)/shard_map/diagnostics/psum_invariant"}'
_HLO = f"""\
HloModule m, is_scheduled=true, frontend_attributes={{fingerprint_before_lhs="0a1b2c"}}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %ps = (f32[8]{{0}}, f32[8]{{0}}) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
  %pd = f32[8]{{0}} collective-permute-done(%ps)
  %ds = f32[8]{{0}} all-reduce-start(%pd), channel_id=3, replica_groups={{}}, to_apply=%add, {_DIAG}
  %dd = f32[8]{{0}} all-reduce-done(%ds)
  %as = f32[8]{{0}} all-reduce-start(%dd), channel_id=2, replica_groups={{}}, to_apply=%add, {_SYNC}
  ROOT %ad = f32[8]{{0}} all-reduce-done(%as)
}}
"""


def test_latency_profile_text():
  got = latency_profile.latency_profile({"collective-permute-start": 973.96961,
                                    "all-reduce-start.2": 5})
  assert got == ('costs { name: "collective-permute-start" cost_us: 973.970 }'
                 '\ncosts { name: "all-reduce-start.2" cost_us: 5.000 }\n')
  assert latency_profile.latency_profile({"a": 1.0}, "0a1b") == (
      'costs { name: "0a1b::a" cost_us: 1.000 }\n')
  for bad in ({'a"b': 1.0}, {"": 1.0}, {"a\nb": 1.0}, {"a": -1.0},
              {"a": float("nan")}, {"a": "1"}):
    with pytest.raises(ValueError):
      latency_profile.latency_profile(bad)


def test_collective_costs_price_the_asynchronous_collectives():
  report = overlap.overlap_report(_HLO)
  # The synchronous all-reduce %as cannot overlap anything: left out.
  assert latency_profile.collective_costs(report, 7.5) == {"ps": 7.5, "ds": 7.5}
  seen = []

  def per(c, distinct):
    seen.append((c.name, distinct))
    return 2.0 if c.kind == "collective-permute" else 3.0

  assert latency_profile.collective_costs(report, per, 2) == {"ps": 2.0,
                                                         "ds": 3.0}
  assert seen == [("ps", 2), ("ds", 2)]
  for bad in (0.0, -1.0, float("inf"), lambda c, d: 0.0):
    with pytest.raises(ValueError, match="collective_us"):
      latency_profile.collective_costs(report, bad)
  assert latency_profile.fingerprint(_HLO) == "0a1b2c"
  with pytest.raises(ValueError, match="fingerprint_before_lhs"):
    latency_profile.fingerprint(_HLO.replace("fingerprint_before_lhs", "x"))


def _fake_experiment(n=8):
  # What cluster_collective_us reads of an Experiment.
  return types.SimpleNamespace(
      config=types.SimpleNamespace(n_workers=n),
      topology=topology_lib.make("one_peer_exp", n))


def test_cluster_times_on_the_paper_a40_cluster():
  # A40 preset (runtime_model.paper.PUBLISHED): 4 GPUs per node on PCIe
  # (5 us, 31.5 GB/s), one 25 Gbit/s NIC per node carrying 7.37 GB/s in
  # all, 30 us across nodes. one_peer_exp on 8: round 0 pairs 2i, 2i+1
  # (inside a node: a mean of 2 over PCIe), round 2 pairs i, i+4 (across:
  # the 4 flows of a node share its NIC).
  time_us = latency_profile.cluster_collective_us(_fake_experiment(),
                                             presets.cluster("A40", 8))
  report = overlap.overlap_report(
      _HLO.replace("f32[8]", f"f32[{_PARAM_BYTES // 4}]"))
  ps, ds = report.collectives[0], report.collectives[1]
  assert ps.bytes == ds.bytes == _PARAM_BYTES
  assert time_us(ps, 0) == pytest.approx(5 + _PARAM_BYTES / 31.5e9 * 1e6)
  assert time_us(ps, 2) == pytest.approx(30 + _PARAM_BYTES / (7.37e9 / 4)
                                         * 1e6)
  # The consensus All-Reduce: a full All-Reduce whatever the round, more
  # than the intra-node round, as is the collective of an all-rounds
  # program.
  assert time_us(ds, 0) == time_us(ds, 2) == time_us(ps, None)
  assert time_us(ds, 0) > time_us(ps, 0)
  with pytest.raises(ValueError, match="n_workers=4"):
    latency_profile.cluster_collective_us(_fake_experiment(),
                                     presets.cluster("A40", 4))


# ---------------------------------------------------------------------------
# Part 2: compiled here (requirements-gpu-compile.txt; pytest -m integration).
# ---------------------------------------------------------------------------


@pytest.mark.integration
def test_a40_latency_profile_starts_the_round_across_nodes_at_the_top():
  from decentral_jax.runner import config as config_lib
  config = config_lib.load_config(
      os.path.join(os.path.dirname(FIXTURES), "..", "configs", "gpt_tiny.py"))
  with pytest.raises(ValueError, match="not both"):
    gpu_compile.compile_steps(config, programs=[(2, "none")],
                             collective_us=1.0, cluster="A40")
  _, [s] = gpu_compile.compile_steps(config, target="h200", topology="1x1x8",
                                    programs=[(2, "none")], cluster="A40")
  assert s.profile_us == {"collective-permute-start": pytest.approx(
      30 + _PARAM_BYTES / (7.37e9 / 4) * 1e6)}
  assert s.profile.startswith(
      f'costs {{ name: "{latency_profile.fingerprint(s.compiled)}::'
      'collective-permute-start" cost_us: 973.970 }')
  # Without the profile: nothing of the forward pass in flight.
  before = s.unprofiled.select(_PARAM_BYTES / 4)
  assert len(before) == 1 and before[0].forward <= 3, s.unprofiled.summary()
  assert s.unprofiled.in_flight_fractions()[0] == 0.0
  # With it: the same one permute, asynchronous, outside conditionals,
  # with every matmul of the forward and backward pass in flight.
  [c] = s.report.select(_PARAM_BYTES / 4)
  assert (c.kind, c.is_async, c.in_conditional) == (
      "collective-permute", True, False)
  assert c.forward > before[0].forward and c.backward > before[0].backward
  assert s.report.in_flight_fractions() == (1.0, 1.0)


_SCHEDULE = """\
hlo_module {
  name: "jit_step"
}
computation_schedules {
  computation_id: 7
  instructions {
    id: 1
    start_timestamp_cycles: 1
  }
  scheduler_statistics {
    total_cycles: 40
  }
  cycles_per_microsecond: 1
}
computation_schedules {
  computation_id: 9
  scheduler_statistics {
    all_reduce_wasted_cycles: 600
    total_wasted_cycles: 600.5
    total_cycles: 2000.5
    memory_pressure_peak: 10
  }
  cycles_per_microsecond: 2
}
"""


def test_scheduled_busy_time_from_the_schedule_dump(tmp_path):
  # The longest computation (id 9): (2000.5 - 600.5) cycles at 2 per us;
  # computation 7 has no wasted-cycles field and is shorter anyway.
  (tmp_path / "jit_step.schedule.txt").write_text(_SCHEDULE)
  (tmp_path / "module_0001.jit_step.ptx").write_text("total_cycles: 9e9")
  assert latency_profile.scheduled_busy_us(str(tmp_path)) == 700.0
  (tmp_path / "jit_step.schedule.txt").write_text("hlo_module {}\n")
  with pytest.raises(ValueError, match="no latency-hiding schedule"):
    latency_profile.scheduled_busy_us(str(tmp_path))


# What XLA writes when no instruction waits (the text form omits zero-valued
# fields): no total_wasted_cycles. gpt_quick's step 0 compiled deviceless
# for h200 has this shape (64.7 cycles at 1 per us).
_NO_WAIT = """\
computation_schedules {
  computation_id: 3
  scheduler_statistics {
    total_cycles: 1500
    memory_pressure_peak: 8529317
  }
  cycles_per_microsecond: 3
}
computation_schedules {
  computation_id: 4
  scheduler_statistics {
  }
  cycles_per_microsecond: 3
}
"""


def test_scheduled_busy_time_when_nothing_waits(tmp_path):
  # Missing total_wasted_cycles is 0: 1500 cycles at 3 per us. The empty
  # statistics of computation 4 are 0 cycles, not a reason to fail.
  (tmp_path / "jit_step.schedule.txt").write_text(_NO_WAIT)
  assert latency_profile.scheduled_busy_us(str(tmp_path)) == 500.0
  # No busy cycles at all (every field omitted), or no clock: refused.
  (tmp_path / "jit_step.schedule.txt").write_text(
      "computation_schedules {\n  computation_id: 1\n}\n")
  with pytest.raises(ValueError, match="no busy time .*total_cycles 0"):
    latency_profile.scheduled_busy_us(str(tmp_path))
  (tmp_path / "jit_step.schedule.txt").write_text(
      _NO_WAIT.replace("cycles_per_microsecond: 3", ""))
  with pytest.raises(ValueError, match="cycles_per_microsecond 0"):
    latency_profile.scheduled_busy_us(str(tmp_path))


class _FakeLowered:
  """A lowered program whose compile writes ``schedule`` where XLA dumps
  (``xla_dump_to``) and returns the scheduled module ``_HLO`` as text."""

  def __init__(self, schedule):
    self.schedule, self.options = schedule, []

  def compile(self, options):
    self.options.append(dict(options))
    if "xla_dump_to" in options:
      with open(os.path.join(options["xla_dump_to"], "m.schedule.txt"), "w",
                encoding="utf-8") as f:
        f.write(self.schedule)
    return _HLO  # overlap_report and fingerprint read the text as well


def _fake_program_experiment(lowered):
  exp = _fake_experiment()
  exp.abstract_inputs = lambda: (None, None)
  exp.programs = types.SimpleNamespace(get=lambda distinct, mode: (
      types.SimpleNamespace(trace=lambda state, batch: types.SimpleNamespace(
          lower=lambda: lowered))))
  return exp


def test_compute_time_rescales_by_a_schedule_without_waiting():
  # compile_programs end to end around a fake compile: XLA's busy time 500
  # us (the dump above, without total_wasted_cycles), a step of 0.1 s on
  # the cluster, 400 us per collective: 400 * 500e-6 / 0.1 = 2 us each.
  lowered = _FakeLowered(_NO_WAIT)
  [s] = gpu_compile.compile_programs(_fake_program_experiment(lowered),
                                    [(1, "none")], collective_us=400.0,
                                    compute_s=0.1)
  assert s.xla_compute_us == 500.0
  assert s.profile_us == {"ps": pytest.approx(2.0), "ds": pytest.approx(2.0)}
  assert lowered.options[0]["xla_dump_latency_hiding_schedule"] is True
  assert latency_profile.PROFILE_OPTION in lowered.options[1]


def test_a_schedule_without_busy_time_names_the_program_not_the_dump():
  lowered = _FakeLowered("computation_schedules {\n}\n")
  with pytest.raises(ValueError) as e:
    gpu_compile.compile_programs(_fake_program_experiment(lowered),
                                [(2, "input")], collective_us=400.0,
                                compute_s=0.1)
  msg = str(e.value)
  assert msg.startswith("compute_s needs XLA's busy time of the program of "
                        "round 2, consensus input: "), msg
  # The temporary dump directory is gone by now: not named.
  assert lowered.options[0]["xla_dump_to"] not in msg


def test_compute_time_needs_a_transfer_time():
  exp = _fake_experiment()
  with pytest.raises(ValueError, match="compute_s rescales"):
    gpu_compile.compile_programs(exp, [], compute_s=0.1)
  with pytest.raises(ValueError, match="compute_s"):
    gpu_compile.compile_programs(exp, [], collective_us=5.0, compute_s=0.0)


@pytest.mark.integration
def test_gpu_check_compute_ms_when_nothing_waits(tmp_path):
  # The gpt_quick step of round 0 hides its permute entirely, so XLA's
  # schedule has no total_wasted_cycles: gpu_check --compute_ms rescales
  # by the busy time all the same. --cluster a40 is the A40 preset (case
  # ignored, as compare.py). Round 0 of one_peer_exp on 8 pairs 2i, 2i+1
  # inside an A40 node: 5 us + bytes / 31.5 GB/s, times XLA's busy time
  # over the 100 ms given.
  import json
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "quick.json"
  r = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "gpu_check.py"),
       "--config", os.path.join(root, "configs", "gpt_quick.py"),
       "--programs", "0:none", "--deviceless", "h200", "--cluster", "a40",
       "--compute_ms", "100", "--json", str(out), "--quiet"],
      env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
      timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(out.read_text())
  assert (got["cluster"], got["compute_ms"]) == ("A40", 100.0)
  [prog] = got["programs"]
  xla_us = prog["xla_compute_us"]
  assert 0 < xla_us < 1e6
  link_us = 5 + got["param_bytes"] / 31.5e9 * 1e6
  assert prog["profile_us"] == {"collective-permute-start": pytest.approx(
      link_us * xla_us / 1e5, rel=1e-3)}


def test_overlap_limit_follows_the_cluster_per_program():
  # cluster_overlap_limit (runtime_model.links.parallel_collectives):
  # one_peer_exp on 16 workers, h100_ib (8 per node, NVLink, a NIC per
  # GPU). Round 3 pairs i <-> i+8 (NIC only); round 0 pairs inside a node.
  # Workers of 2 devices (fsdp on NVLink): round 3 runs beside fsdp (2),
  # round 0 shares NVLink with it (1); the consensus All-Reduce over all
  # workers uses both links (1). On the A40 preset (PCIe): 1 everywhere.
  def exp(n, d, fmt="none"):
    return types.SimpleNamespace(
        config=types.SimpleNamespace(
            n_workers=n, devices_per_worker=d, worker_layout="fsdp",
            compression=types.SimpleNamespace(format=fmt)),
        topology=topology_lib.make("one_peer_exp", n))
  limit = gpu_compile.cluster_overlap_limit(exp(16, 2),
                                            presets.cluster("h100_ib", 16))
  assert [limit(r, "none") for r in range(4)] == [1, 1, 1, 2]
  assert limit(3, "input") == 1 and limit(None, "none") == 1
  assert gpu_compile.cluster_overlap_limit(
      exp(16, 1), presets.cluster("h100_ib", 16))(3, "none") == 1
  a40 = gpu_compile.cluster_overlap_limit(exp(8, 2),
                                          presets.cluster("A40", 8))
  assert {a40(r, m) for r in (0, 1, 2, None) for m in ("none", "input")
          } == {1}
  with pytest.raises(ValueError, match="cluster has n_workers=8 but the "
                     "experiment has 16"):
    gpu_compile.cluster_overlap_limit(exp(16, 2), presets.cluster("A40", 8))


def test_compile_options_carry_the_overlap_limit():
  # Each program compiled with its own limit, over the caller's options;
  # both compiles of a profiled program; recorded on the CompiledStep.
  lowered = _FakeLowered(_NO_WAIT)
  steps = gpu_compile.compile_programs(
      _fake_program_experiment(lowered), [(0, "none"), (3, "none")],
      {gpu_compile.OVERLAP_LIMIT_OPTION: 2, "xla_other": 7},
      collective_us=400.0, overlap_limit=lambda d, m: 1 if d == 0 else 3)
  assert [s.overlap_limit for s in steps] == [1, 3]
  assert [o[gpu_compile.OVERLAP_LIMIT_OPTION] for o in lowered.options
          ] == [1, 1, 3, 3]
  assert all(o["xla_other"] == 7 for o in lowered.options)
  lowered = _FakeLowered(_NO_WAIT)
  [s] = gpu_compile.compile_programs(_fake_program_experiment(lowered),
                                    [(0, "none")], {"xla_other": 7})
  assert s.overlap_limit is None
  assert gpu_compile.OVERLAP_LIMIT_OPTION not in lowered.options[0]
  with pytest.raises(ValueError, match="overlap_limit must be"):
    gpu_compile.compile_programs(_fake_program_experiment(lowered),
                                [(0, "none")], overlap_limit=0)
