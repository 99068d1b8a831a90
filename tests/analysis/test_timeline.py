"""The step's timeline (analysis.timeline) and its PNG (tools.timeline_plot).

A hand-written scheduled module with costs worked out by hand, then the
committed GPU fixtures of tests/tools/test_overlap.py: the timeline's
collectives carry exactly the matmul FLOPs the overlap report finds in
flight, and the PNG's lanes are the timeline's bars."""

from __future__ import annotations

import glob
import gzip
import os

import pytest

from conftest import FIXTURES
from decentral_jax.analysis import hlo
from decentral_jax.analysis import overlap
from decentral_jax.analysis import timeline
from decentral_jax.tools import timeline_plot

_FWD = 'metadata={op_name="jit(step)/shard_map/jvp(GPT)/h_0/mlp"}'
_BWD = 'metadata={op_name="jit(step)/shard_map/transpose(jvp(GPT))/h_0/mlp"}'
_OPT = 'metadata={op_name="jit(step)/shard_map/adam"}'

# f0: forward dot 2x4x8 (128 FLOPs); the permute of x (32 bytes) starts
# after it; b0: backward dot (128 FLOPs); pd: its done; o0: optimizer add.
_HLO = f"""\
HloModule m, is_scheduled=true, num_partitions=4

ENTRY %main (x: f32[8], a: f32[2,4], b: f32[4,8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %a = f32[2,4]{{1,0}} parameter(1)
  %b = f32[4,8]{{1,0}} parameter(2)
  %f0 = f32[2,8]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_FWD}
  %ps = (f32[8]{{0}}, f32[8]{{0}}) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
  %b0 = f32[2,8]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_BWD}
  %b1 = f32[8]{{0}} negate(%x), {_BWD}
  %pd = f32[8]{{0}} collective-permute-done(%ps)
  ROOT %o0 = f32[8]{{0}} add(%pd, %x), {_OPT}
}}
"""


def test_hand_written_step_on_the_profile_clock():
  costs = {"f0": 10.0, "b0": 20.0, "b1": 5.0, "o0": 3.0, "ps": 50.0}
  tl = timeline.step_timeline(_HLO, costs)
  # Compute: f0 [0, 10], b0+b1 [10, 35]; the done waits for the transfer
  # issued at 10: 10 + 50 = 60; o0 [60, 63].
  assert [(p.phase, p.start_us, p.end_us, p.flops, p.instructions)
          for p in tl.phases] == [("forward", 0, 10, 128, 1),
                                  ("backward", 10, 35, 128, 2),
                                  ("other", 60, 63, 0, 1)]
  (c,) = tl.collectives
  assert (c.kind, c.bytes, c.start_us, c.done_us, c.transfer_us,
          c.flops_in_flight) == ("collective-permute", 32.0, 10, 60, 50, 128)
  assert tl.total_us == 63 and tl.clock.startswith("profile for 5 ")
  # A short transfer is hidden: the done is issued at 35, the end at 38.
  tl = timeline.step_timeline(_HLO, dict(costs, ps=4.0))
  assert tl.collectives[0].done_us == 35 and tl.total_us == 38
  # The fallback clock: 128 FLOPs at 1 FLOP/us + 1 us per instruction.
  tl = timeline.step_timeline(_HLO, flops_per_us=1.0, us_per_instruction=1.0)
  assert [(p.start_us, p.end_us) for p in tl.phases] == [
      (0, 129), (129, 259), (259, 260)]
  assert tl.collectives[0].transfer_us is None
  assert tl.collectives[0].done_us == 259


def test_profile_text_and_bad_input():
  text = ('costs { name: "f0" cost_us: 10.5 }\ncosts { name: "ps" cost_us: '
          '2e3 }\nlatencies { source: "a" target: "b" latency_us: 1 }')
  assert timeline.read_profile(text) == {"f0": 10.5, "ps": 2000.0}
  with pytest.raises(ValueError, match="no 'costs"):
    timeline.read_profile("nothing")
  with pytest.raises(ValueError, match="not scheduled"):
    timeline.step_timeline(_HLO.replace("is_scheduled=true", ""))


def _fixtures():
  return sorted(glob.glob(os.path.join(FIXTURES, "gpu_overlap",
                                       "gpt_tiny_*_h200_*.hlo.gz")))


def test_fixture_collectives_carry_the_reports_flops(tmp_path):
  paths = _fixtures()
  assert len(paths) == 7, paths
  for path in paths:
    with gzip.open(path, "rt") as f:
      text = f.read()
    rep = overlap.overlap_report(text)
    tl = timeline.step_timeline(text)
    main = hlo.parse_module(text)[1]
    entry = [c for c in rep.collectives if c.computation == main]
    by_name = {c.name: c for c in tl.collectives}
    # Before: every collective in a conditional's branch (none drawn).
    assert bool(entry) == ("_after_" in path), path
    assert {c.name for c in entry} == set(by_name), path
    for c in entry:
      bar = by_name[c.name]
      assert (bar.kind, bar.bytes, bar.is_async) == (c.kind, c.bytes,
                                                     c.is_async), path
      if c.is_async:
        assert bar.flops_in_flight == pytest.approx(c.flops), (path, c.name)
    # Entry compute (loops and branches once) is the program's FLOPs.
    assert sum(p.flops for p in tl.phases) == pytest.approx(
        rep.total_flops), path
  # Before/after pair: the PNG is written and draws the timelines' bars.
  pair = [p for p in paths if "_before_" in p][:1] + [
      p for p in paths if "r0_none" in p][:1]
  tls = []
  for p in pair:
    with gzip.open(p, "rt") as f:
      tls.append(timeline.step_timeline(f.read()))
  out = tmp_path / "step.png"
  drawn = timeline_plot.save_png(str(out), tls, ["before", "after"],
                                 min_bytes=1000)
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for lanes, tl in zip(drawn, tls):
    assert lanes[0][1] == [(p.start_us, p.end_us, timeline_plot.COLORS[
        p.phase], False) for p in tl.phases]
    big = [c for c in tl.collectives if c.bytes >= 1000]
    assert [bars[0][:2] for _, bars in lanes[1:]] == [
        (c.start_us, c.done_us) for c in big]
  with pytest.raises(ValueError, match="one title per timeline"):
    timeline_plot.save_png(str(out), tls, ["only one"])


def test_overlap_command_writes_the_pair_next_to_its_table(tmp_path):
  """``decentral-jax overlap --timeline``'s writer: ``<out>_<case>_<target>
  .png`` with one panel per mode, collectives of >= 1/64 of the largest."""
  import types
  from decentral_jax.tools import overlap as overlap_tool
  tls = {}
  for mode, name in (("before", "before_h200_rNone_logged"),
                     ("after", "after_h200_r0_input")):
    with gzip.open(os.path.join(FIXTURES, "gpu_overlap",
                                f"gpt_tiny_{name}.hlo.gz"), "rt") as f:
      tls[mode] = timeline.step_timeline(f.read())
  args = types.SimpleNamespace(out=str(tmp_path / "overlap.jsonl"))
  path = overlap_tool.write_timeline(args, "gpt_tiny", "h200", tls)
  assert path == str(tmp_path / "overlap_gpt_tiny_h200.png")
  assert open(path, "rb").read(4) == b"\x89PNG"
  assert overlap_tool.build_parser("x").parse_args(
      ["--timeline", "--profile", "p.pbtxt"]).timeline
