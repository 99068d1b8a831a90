"""Tests for decentral_jax.analysis: collectives and bytes read from HLO.

Two kinds of checks:
* hand-written HLO modules whose expected bytes are worked out by hand in the
  test (parser, byte conventions, branches, loops, async forms);
* compiled train steps of a tiny linear model on 8 simulated CPU devices,
  whose per-step bytes must equal the parameter bytes times the figure the
  algorithm needs (independently computed from the shapes here).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import sync_args
from decentral_jax import analysis
from decentral_jax.analysis import run_communication
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology

N = 8
D_IN, D_OUT = 16, 32
# One worker's parameters: w [16, 32] f32 + b [32] f32.
PARAM_BYTES = (D_IN * D_OUT + D_OUT) * 4


# ---------------------------------------------------------------------------
# Hand-written HLO.
# ---------------------------------------------------------------------------

_HLO_BRANCHES = """\
HloModule m, num_partitions=4

%b0 (p0: f32[10]) -> f32[10] {
  %p0 = f32[10]{0} parameter(0)
  ROOT %cp0 = f32[10]{0} collective-permute(%p0), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
}

%b1 (p1: f32[10]) -> f32[10] {
  %p1 = f32[10]{0} parameter(0)
  %cp1 = f32[10]{0} collective-permute(%p1), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %cp2 = f32[10]{0} collective-permute(%cp1), channel_id=3, source_target_pairs={{0,2},{1,3},{2,0},{3,1}}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], bf16[6])) -> (s32[], bf16[6]) {
  %t = (s32[], bf16[6]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[6]{0} get-tuple-element(%t), index=1
  %ag = bf16[12]{0} all-gather(%v), channel_id=5, replica_groups=[2,2]<=[4], dimensions={0}
  %sl = bf16[6]{0} slice(%ag), slice={[0:6]}
  ROOT %o = (s32[], bf16[6]{0}) tuple(%i, %sl)
}

%cond (t2: (s32[], bf16[6])) -> pred[] {
  %t2 = (s32[], bf16[6]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[10], k: s32[], y: bf16[6], z: f32[8,3]) -> f32[10] {
  %x = f32[10]{0} parameter(0)
  %k = s32[] parameter(1)
  %y = bf16[6]{0} parameter(2)
  %z = f32[8,3]{1,0} parameter(3)
  %ar = (f32[10]{0}, f32[8,3]{1,0}) all-reduce(%x, %z), channel_id=4, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %x2 = f32[10]{0} get-tuple-element(%ar), index=0
  %init = (s32[], bf16[6]{0}) tuple(%k, %y)
  %w = (s32[], bf16[6]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[10]{0} conditional(%k, %x2, %x2), branch_computations={%b0, %b1}
}
"""


def test_hand_written_module_bytes_per_branch():
  rep = analysis.communication(_HLO_BRANCHES)
  assert rep.n_devices == 4
  kinds = sorted(c.kind for c in rep.collectives)
  assert kinds == ["all-gather", "all-reduce", "collective-permute",
                   "collective-permute", "collective-permute"]
  ar = next(c for c in rep.collectives if c.kind == "all-reduce")
  assert ar.operand_bytes == 10 * 4 + 8 * 3 * 4  # tuple of two operands
  assert ar.replica_groups == ((0, 1, 2, 3),)
  ag = next(c for c in rep.collectives if c.kind == "all-gather")
  assert ag.replica_groups == ((0, 1), (2, 3))
  assert ag.operand_bytes == 6 * 2  # bf16 operand, not the gathered result
  # Fixed part: all-reduce 2*(4-1)/4 * 136 B = 204 B; all-gather over pairs:
  # (2-1) * 12 B per trip, 3 trips = 36 B. Branch 0 adds 40 B, branch 1 80 B.
  fixed = 2 * 3 / 4 * 136 + 3 * 12
  assert len(rep.scenarios) == 2
  np.testing.assert_allclose(rep.bytes_per_step, [fixed + 40, fixed + 80])
  assert rep.max_bytes_per_step == pytest.approx(fixed + 80)
  assert rep.mean_bytes_per_step == pytest.approx(fixed + 60)
  assert not rep.unknown_trip_count
  np.testing.assert_allclose(rep.ratios(fixed + 40)[0], 1.0)
  # Two devices per node ({0,1}, {2,3}): branch 0's pairs stay in a node,
  # branch 1's ring sends 0->1, 1->2, 2->3, 3->0 then 0->2, 1->3, ... The
  # all-reduce ring 0->1->2->3->0 leaves the node from devices 1 and 3; the
  # all-gather groups {0,1}, {2,3} stay inside nodes.
  inter = rep.inter_node_bytes_per_step(2)
  np.testing.assert_allclose(inter, [2 * 3 / 4 * 136,
                                     2 * 3 / 4 * 136 + 40 + 40])
  with pytest.raises(ValueError, match="local_size"):
    rep.inter_node_bytes_per_step(3)
  d = json.loads(analysis.report_to_json(rep, fixed + 40))
  np.testing.assert_allclose(d["ratios"], [1.0, (fixed + 80) / (fixed + 40)])
  assert len(d["collectives"]) == 5
  assert "step r=1 (weight 0.5): busiest worker sends 320 B" in rep.summary(
      fixed + 40)


_HLO_ASYNC = """\
HloModule m2, num_partitions=2

ENTRY %main (x: f32[4,4], y: bf16[5]) -> f32[4,4] {
  %x = f32[4,4]{1,0} parameter(0)
  %y = bf16[5]{0} parameter(1)
  %s = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %f = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fc
  %d = f32[4,4]{1,0} collective-permute-done(%s)
  %s2 = bf16[5]{0} collective-permute-start(%y), channel_id=2, source_target_pairs={{0,0},{1,0}}
  %d2 = bf16[5]{0} collective-permute-done(%s2)
  %a = f32[4,4]{1,0} all-reduce-start(%d), channel_id=3, replica_groups={}, to_apply=%fc
  %ad = f32[4,4]{1,0} all-reduce-done(%a)
  ROOT %o = f32[4,4]{1,0} add(%ad, %f)
}

%fc (p: f32[4,4]) -> f32[4,4] {
  ROOT %p = f32[4,4]{1,0} parameter(0)
}
"""


def test_async_forms_counted_once_and_overlap_detected():
  rep = analysis.communication(_HLO_ASYNC)
  opcodes = sorted(c.opcode for c in rep.collectives)
  assert opcodes == ["all-reduce-start", "collective-permute-start",
                     "collective-permute-start"]
  assert all(c.is_async for c in rep.collectives)
  # Device 0: 64 B (permute) + 0 (self pair) + all-reduce 2*(1/2)*64 = 128.
  # Device 1: 64 B + 10 B (bf16[5] to device 0) + 64 B = 138.
  np.testing.assert_allclose(rep.scenarios[0].sent_bytes, [128.0, 138.0])
  assert rep.bytes_per_step == (138.0,)
  ov = analysis.overlap_report(_HLO_ASYNC)
  permutes = [c for c in ov.collectives if c.kind == "collective-permute"]
  assert len(permutes) == 2 and all(c.is_async for c in permutes)
  assert [c.between for c in permutes] == [1, 0]
  # The one fusion in flight has no forward/backward op_name: not overlap
  # with the model's compute.
  assert [c.other for c in permutes] == [1, 0]
  assert not any(c.overlapped or c.in_conditional for c in ov.collectives)


def test_two_conditionals_cross_product_or_aligned():
  # A second 2-branch conditional after the first: branch a sends 4 B
  # (f32[1]) around a ring, branch b sends nothing.
  extra = """
%c0 (q0: f32[1]) -> f32[1] {
  %q0 = f32[1]{0} parameter(0)
  ROOT %cq = f32[1]{0} collective-permute(%q0), channel_id=7, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
}

%c1 (q1: f32[1]) -> f32[1] {
  ROOT %q1 = f32[1]{0} parameter(0)
}
"""
  hlo = _HLO_BRANCHES.replace("ENTRY", extra + "\nENTRY").replace(
      "  ROOT %r = f32[10]{0} conditional(%k, %x2, %x2), "
      "branch_computations={%b0, %b1}",
      "  %r = f32[10]{0} conditional(%k, %x2, %x2), "
      "branch_computations={%b0, %b1}\n"
      "  %one = f32[1]{0} slice(%r), slice={[0:1]}\n"
      "  ROOT %r2 = f32[1]{0} conditional(%k, %one, %one), "
      "branch_computations={%c0, %c1}")
  fixed = 2 * 3 / 4 * 136 + 3 * 12
  rep = analysis.communication(hlo)
  # Every combination: (40 | 80) + (4 | 0).
  np.testing.assert_allclose(sorted(rep.bytes_per_step),
                             sorted([fixed + 44, fixed + 40, fixed + 84,
                                     fixed + 80]))
  aligned = analysis.communication(hlo, align_conditionals=True)
  np.testing.assert_allclose(aligned.bytes_per_step,
                             [fixed + 44, fixed + 80])


_PERIODIC_HLO_HEAD = (
    "HloModule m, num_partitions=4\n\n"
    "%add (a: f32[], b: f32[]) -> f32[] {\n"
    "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
    "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
    "%skip (p: f32[10]) -> f32[10] {\n"
    "  ROOT %p = f32[10]{0} parameter(0)\n}\n\n"
    "%sync (q: f32[10]) -> f32[10] {\n"
    "  %q = f32[10]{0} parameter(0)\n"
    "  ROOT %ar = f32[10]{0} all-reduce(%q), replica_groups={}, "
    "to_apply=%add\n}\n\n")


def test_periodic_conditional_weighs_its_branches_by_the_period():
  # Branch 1 of a conditional traced under comm_every_4 all-reduces 40 B
  # over 4 devices (2*3/4*40 = 60 B), branch 0 sends nothing: 60/4 = 15 B
  # per step on average. A second, unmarked 2-branch switch permutes 8 B in
  # one branch only: weights 1/2, so 15 + 4 = 19 B per step.
  hlo = _PERIODIC_HLO_HEAD + (
      "%quiet (u: f32[2]) -> f32[2] {\n"
      "  ROOT %u = f32[2]{0} parameter(0)\n}\n\n"
      "%talk (v: f32[2]) -> f32[2] {\n"
      "  %v = f32[2]{0} parameter(0)\n"
      "  ROOT %cp = f32[2]{0} collective-permute(%v), channel_id=1, "
      "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n}\n\n"
      "ENTRY %main (x: f32[10], k: s32[], y: f32[2]) -> f32[10] {\n"
      "  %x = f32[10]{0} parameter(0)\n  %k = s32[] parameter(1)\n"
      "  %y = f32[2]{0} parameter(2)\n"
      "  %c = f32[10]{0} conditional(%k, %x, %x), branch_computations="
      "{%skip, %sync}, metadata={op_name=\"jit(step)/shard_map/"
      "comm_every_4/cond\"}\n"
      "  %d = f32[2]{0} conditional(%k, %y, %y), branch_computations="
      "{%quiet, %talk}, metadata={op_name=\"jit(step)/switch\"}\n"
      "  ROOT %r = f32[10]{0} add(%c, %c)\n}\n")
  rep = analysis.communication(hlo)
  # Zipping needs equal weights: a periodic cond is not zipped with the
  # unmarked 2-branch switch, so aligning changes nothing here.
  aligned = analysis.communication(hlo, align_conditionals=True)
  assert aligned.mean_bytes_per_step == pytest.approx(19.0)
  assert len(aligned.scenarios) == 4
  by_label = {s.label: (s.weight, s.busiest_bytes) for s in rep.scenarios}
  expected = {
      "c=0/d=0": (0.75 * 0.5, 0.0), "c=0/d=1": (0.75 * 0.5, 8.0),
      "c=1/d=0": (0.25 * 0.5, 60.0), "c=1/d=1": (0.25 * 0.5, 68.0)}
  assert sorted(by_label) == sorted(expected)
  for label, (weight, busiest) in expected.items():
    assert by_label[label] == pytest.approx((weight, busiest)), label
  assert rep.mean_bytes_per_step == pytest.approx(19.0)
  assert rep.max_bytes_per_step == pytest.approx(68.0)


def test_pred_form_periodic_conditional_weighs_the_true_branch():
  # conditional(pred, ...) lists true_computation first: the taken (true)
  # branch all-reduces 40 B (60 B sent) once every 10 steps: 6 B per step.
  hlo = _PERIODIC_HLO_HEAD + (
      "ENTRY %main (x: f32[10], k: pred[]) -> f32[10] {\n"
      "  %x = f32[10]{0} parameter(0)\n  %k = pred[] parameter(1)\n"
      "  ROOT %c = f32[10]{0} conditional(%k, %x, %x), true_computation="
      "%sync, false_computation=%skip, metadata={op_name=\"comm_every_10/"
      "cond\"}\n}\n")
  rep = analysis.communication(hlo)
  assert rep.mean_bytes_per_step == pytest.approx(6.0)


def test_many_periodic_conditionals_keep_the_exact_mean():
  # 13 fragments, each all-reducing 40 B (60 B sent) once every 10 steps:
  # 2^13 branch combinations exceed the cap; the mean is 13 * 6 = 78 B.
  body = "".join(
      f"  %c{i} = f32[10]{{0}} conditional(%k, %x, %x), branch_computations="
      f"{{%skip, %sync}}, metadata={{op_name=\"comm_every_10/cond\"}}\n"
      for i in range(13))
  hlo = _PERIODIC_HLO_HEAD + (
      "ENTRY %main (x: f32[10], k: s32[]) -> f32[10] {\n"
      "  %x = f32[10]{0} parameter(0)\n  %k = s32[] parameter(1)\n"
      + body + "  ROOT %r = f32[10]{0} add(%c0, %c12)\n}\n")
  rep = analysis.communication(hlo)
  assert rep.mean_bytes_per_step == pytest.approx(78.0)
  assert sum(s.weight for s in rep.scenarios) == pytest.approx(1.0)


def test_operands_after_index_comments_are_counted():
  # XLA prints /*index=5*/ before the 6th element of long operand lists.
  ops = ", ".join(("/*index=5*/" if i == 5 else "") + f"%p{i}"
                  for i in range(7))
  params = "\n".join(f"  %p{i} = f32[{i + 1}]{{0}} parameter({i})"
                      for i in range(7))
  shape = ", ".join(("/*index=5*/" if i == 5 else "") + f"f32[{i + 1}]{{0}}"
                    for i in range(7))
  hlo = (f"HloModule m4, num_partitions=2\n\nENTRY %e () -> f32[] {{\n"
         f"{params}\n  ROOT %ar = ({shape}) all-reduce({ops}), "
         "replica_groups={{0,1}}, to_apply=%e\n}\n")
  (c,) = analysis.communication(hlo).collectives
  assert len(c.operand_shapes) == 7
  assert c.operand_bytes == 4 * sum(range(1, 8))


def test_iota_replica_groups_with_transpose():
  hlo = """\
HloModule m3, replica_count=1, num_partitions=8

ENTRY %e (x: f32[3]) -> f32[3] {
  %x = f32[3]{0} parameter(0)
  ROOT %r = f32[3]{0} reduce-scatter(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%e
}
"""
  rep = analysis.communication(hlo)
  (c,) = rep.collectives
  # iota 0..7 as [4,2], transposed to [2,4], rows are the groups.
  assert c.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  np.testing.assert_allclose(rep.scenarios[0].sent_bytes, [3 / 4 * 12] * 8)


def test_bad_inputs_raise_value_error():
  with pytest.raises(ValueError, match="Compiled"):
    analysis.communication(42)
  with pytest.raises(ValueError, match="ENTRY"):
    analysis.communication("HloModule empty\n")
  with pytest.raises(ValueError, match="stage"):
    analysis.communication(_HLO_ASYNC, stage="final")
  with pytest.raises(ValueError, match="param_bytes"):
    analysis.communication(_HLO_ASYNC).ratios(0)
  with pytest.raises(ValueError, match="element type"):
    analysis.communication(_HLO_ASYNC.replace("bf16[5]", "zz9[5]"))


def _round_hlo(elements: int, pairs: str) -> str:
  """4 devices: a permute of f32[elements] over ``pairs`` and, under the
  diagnostics scope, an all-reduce of f32[2] (8 B) over all of them."""
  return (
      "HloModule r, num_partitions=4\n\n"
      "%add (a: f32[], b: f32[]) -> f32[] {\n"
      "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
      "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
      f"ENTRY %main (x: f32[{elements}], y: f32[2]) -> f32[{elements}] {{\n"
      f"  %x = f32[{elements}]{{0}} parameter(0)\n"
      "  %y = f32[2]{0} parameter(1)\n"
      "  %d = f32[2]{0} all-reduce(%y), channel_id=2, "
      "replica_groups={{0,1,2,3}}, to_apply=%add, "
      'metadata={op_name="jit(step)/diagnostics/reduce_sum"}\n'
      f"  ROOT %p = f32[{elements}]{{0}} collective-permute(%x), channel_id=1, "
      f"source_target_pairs={pairs}\n}}\n")


# Round A: pairs inside {0,1} and {2,3}, 40 B from every device; round B: a
# ring 0->1->2->3->0 of 80 B. Period: A, A, B. Diagnostics: a ring
# all-reduce of 8 B, 2 * 3/4 * 8 = 12 B from every device.
_ROUND_A = _round_hlo(10, "{{0,1},{1,0},{2,3},{3,2}}")
_ROUND_B = _round_hlo(20, "{{0,1},{1,2},{2,3},{3,0}}")


def test_step_bytes_weighs_the_rounds_of_a_period():
  got = analysis.step_bytes([(_ROUND_A, 2), (_ROUND_B, 1)], n_workers=4,
                            param_bytes=40, diagnostics_scope="diagnostics")
  # (2 * 40 + 80) / 3 per step; the diagnostics add 12 B to every round.
  assert got == {"bytes_per_step": pytest.approx(160 / 3),
                 "diagnostics_bytes_per_step": pytest.approx(12.0),
                 "param_bytes": 40, "ratio": pytest.approx(4 / 3),
                 "stage": "unoptimized"}


def test_step_bytes_of_workers_of_two_devices():
  # Workers {0,1} and {2,3}: round A stays inside the workers (80 B per
  # worker); in round B devices 1 and 3 send 80 B to the other worker, and
  # each worker's other device 80 B inside it. The diagnostics ring leaves
  # each worker from one device (1 -> 2, 3 -> 0): 12 B.
  got = analysis.step_bytes([(_ROUND_A, 2), (_ROUND_B, 1)], n_workers=2,
                            param_bytes=40, diagnostics_scope="diagnostics",
                            devices_per_worker=2)
  assert got == {"bytes_per_step": pytest.approx(80 / 3),
                 "diagnostics_bytes_per_step": pytest.approx(12.0),
                 "param_bytes": 40, "ratio": pytest.approx(2 / 3),
                 "stage": "unoptimized", "devices_per_worker": 2,
                 "device_bytes_per_step": pytest.approx(80 / 3),
                 "intra_worker_bytes_per_step": pytest.approx(
                     (2 * 80 + 80) / 3)}


def test_step_bytes_of_two_workers_per_device():
  # 8 workers on the 4 devices: a worker sends half its device's bytes.
  got = analysis.step_bytes([(_ROUND_A, 2), (_ROUND_B, 1)], n_workers=8,
                            param_bytes=40, diagnostics_scope="diagnostics",
                            workers_per_device=2)
  assert got == {"bytes_per_step": pytest.approx((2 * 20 + 40) / 3),
                 "diagnostics_bytes_per_step": pytest.approx(6.0),
                 "param_bytes": 40, "ratio": pytest.approx(2 / 3),
                 "stage": "unoptimized", "workers_per_device": 2,
                 "device_bytes_per_step": pytest.approx((2 * 40 + 80) / 3)}


def test_run_bytes_counts_the_measuring_steps_once_every_log_interval():
  rounds = [(_ROUND_A, 2), (_ROUND_B, 1)]
  args = dict(n_workers=4, param_bytes=40, diagnostics_scope="diagnostics")
  # Diagnostics inside every step: the figure of step_bytes.
  assert run_communication.run_bytes(rounds, **args) == analysis.step_bytes(
      rounds, **args)
  # Measuring variants (here the same programs, 160/3 + 12 B) run once every
  # 5 steps instead of the plain ones: they add (160/3 + 12 - 160/3) / 5.
  got = run_communication.run_bytes(rounds, measuring_steps=rounds,
                                    measure_every=5, **args)
  assert got == {"bytes_per_step": pytest.approx(160 / 3),
                 "diagnostics_bytes_per_step": pytest.approx(12 / 5),
                 "param_bytes": 40, "ratio": pytest.approx(4 / 3),
                 "stage": "unoptimized"}
  # Workers of two devices: only the compiled HLO shows what each sends.
  assert run_communication.run_bytes(
      [(_ROUND_A, 1)], devices_per_worker=2,
      **dict(args, n_workers=2))["stage"] == "optimized"
  with pytest.raises(ValueError, match="measure_every"):
    run_communication.run_bytes(rounds, measuring_steps=rounds,
                                measure_every=0, **args)


def test_step_bytes_bad_arguments():
  good = dict(n_workers=4, param_bytes=40, diagnostics_scope="diagnostics")
  for steps, kwargs, match in (
      ([], {}, "steps is empty"),
      ([(_ROUND_A, 0)], {}, "count must be an int >= 1"),
      ([(_ROUND_A, 1)], {"param_bytes": 0}, "param_bytes"),
      ([(_ROUND_A, 1)], {"stage": "final"}, "stage must be one of"),
      ([(_ROUND_A, 1)], {"diagnostics_scope": ""}, "diagnostics_scope"),
      ([(_ROUND_A, 1)], {"devices_per_worker": 2, "workers_per_device": 2},
       "one of them must be 1"),
      ([(_ROUND_A, 1)], {"workers_per_device": 3}, "must divide n_workers"),
      ([(_ROUND_A, 1)], {"n_workers": 2.0}, "n_workers must be an int")):
    with pytest.raises(ValueError, match=match):
      analysis.step_bytes(steps, **{**good, **kwargs})


def test_tree_bytes():
  tree = {"a": jnp.zeros((3, 5), jnp.float32), "b": jnp.zeros((7,),
                                                              jnp.bfloat16)}
  assert analysis.tree_bytes(tree) == 3 * 5 * 4 + 7 * 2
  stacked = {"a": jnp.zeros((4, 5)), "b": jnp.zeros((4, 2), jnp.int8)}
  assert analysis.tree_bytes(stacked, stacked=True) == 5 * 4 + 2
  with pytest.raises(ValueError, match="leading worker axis"):
    analysis.tree_bytes({"a": jnp.zeros((4, 5)), "b": jnp.zeros((3,))},
                        stacked=True)


# ---------------------------------------------------------------------------
# Compiled train steps of a linear model on 8 workers.
# ---------------------------------------------------------------------------


def _loss(p, batch):
  x, y = batch
  return jnp.mean(jnp.square(x @ p["w"] + p["b"] - y))


def _lowered_step(tx, mesh):
  def step(p, s, batch):
    g = jax.grad(_loss)(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  params0 = {"w": jnp.zeros((D_IN, D_OUT)), "b": jnp.zeros((D_OUT,))}
  params = parallel.replicate(params0, mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  batch = parallel.shard((jnp.zeros((N, 4, D_IN)), jnp.zeros((N, 4, D_OUT))),
                         mesh)
  fn = jax.jit(parallel.per_worker(step, mesh), donate_argnums=(0, 1))
  return fn.lower(params, state, batch), params0


@pytest.fixture(scope="module")
def mesh():
  return parallel.make_mesh(N, devices=require_devices(N))


def _only_params_sent(rep):
  """Every collective moves exactly one float parameter leaf."""
  leaf_shapes = {f"f32[{D_IN},{D_OUT}]", f"f32[{D_OUT}]"}
  for c in rep.collectives:
    assert len(c.operand_shapes) in (1, 2)
    for s in c.operand_shapes:
      assert s in leaf_shapes, (c, "only parameters may be communicated")


@pytest.mark.parametrize("name, accum, expected_branches", [
    ("one_peer_exp", 4, 3),  # period log2(8) = 3, every round one peer
    pytest.param("ring", 1, 2, marks=pytest.mark.slow),
])
def test_one_peer_topologies_send_exactly_the_parameters(
    mesh, name, accum, expected_branches):
  tx = optim.decentralized_adamw(1e-3, topology.make(name, N),
                                 accum_steps=accum, weight_decay=0.1)
  lowered, params0 = _lowered_step(tx, mesh)
  assert analysis.tree_bytes(params0) == PARAM_BYTES
  rep = analysis.communication(lowered.compile())
  assert len(rep.scenarios) == expected_branches
  assert rep.ratios(PARAM_BYTES) == (1.0,) * expected_branches
  # Not only the busiest worker: every worker sends its parameters once.
  for s in rep.scenarios:
    np.testing.assert_array_equal(s.sent_bytes, np.full(N, PARAM_BYTES))
  # No step counter, moment or accumulator: only the two parameter leaves.
  _only_params_sent(rep)
  assert all(c.kind == "collective-permute" for c in rep.collectives)
  assert all(c.dtypes == ("f32",) for c in rep.collectives)


@pytest.mark.slow
def test_static_exponential_sends_log2_n_copies(mesh):
  tx = optim.decentralized_adamw(1e-3, topology.make("exponential", N))
  rep = analysis.communication(_lowered_step(tx, mesh)[0])
  assert rep.ratios(PARAM_BYTES) == (float(np.log2(N)),)  # 3.00
  _only_params_sent(rep)


def test_all_reduce_of_gradients_is_the_ring_figure(mesh):
  tx = optax.chain(optim.all_reduce_gradients("workers"), optax.adamw(1e-3))
  rep = analysis.communication(_lowered_step(tx, mesh)[0].compile())
  assert rep.ratios(PARAM_BYTES) == (2 * (N - 1) / N,)  # 1.75
  assert {c.kind for c in rep.collectives} == {"all-reduce"}
  for c in rep.collectives:
    assert sorted(d for g in c.replica_groups for d in g) == list(range(N))
  _only_params_sent(rep)


@pytest.mark.slow
def test_complete_gossip_is_an_all_reduce_of_parameters(mesh):
  tx = optim.decentralized_adamw(1e-3, topology.make("complete", N),
                                 accum_steps=2)
  rep = analysis.communication(_lowered_step(tx, mesh)[0])
  assert rep.ratios(PARAM_BYTES) == (2 * (N - 1) / N,)
  assert {c.kind for c in rep.collectives} == {"all-reduce"}
  _only_params_sent(rep)


@pytest.mark.slow
def test_bfloat16_gossip_halves_the_bytes_requested(mesh):
  tx = optim.decentralized_adamw(1e-3, topology.make("one_peer_exp", N),
                                 accum_steps=4, comm_dtype=jnp.bfloat16)
  lowered, _ = _lowered_step(tx, mesh)
  asked = analysis.communication(lowered, stage="unoptimized")
  assert asked.ratios(PARAM_BYTES) == (0.5, 0.5, 0.5)
  assert all(c.dtypes == ("bf16",) for c in asked.collectives)
  ran = analysis.communication(lowered.compile())
  if jax.default_backend() == "cpu":
    # XLA:CPU has no bfloat16 collectives: float-normalization-bf16 widens
    # the permute to float32 (values are still rounded to bfloat16 first).
    assert ran.ratios(PARAM_BYTES) == (1.0, 1.0, 1.0)
    assert all(c.dtypes == ("f32",) for c in ran.collectives)
  else:
    assert ran.ratios(PARAM_BYTES) == (0.5, 0.5, 0.5)


# ---------------------------------------------------------------------------
# Local-update methods: bytes averaged over a sync period.
# ---------------------------------------------------------------------------

AR = 2 * (N - 1) / N  # ring all-reduce figure, 1.75


def _local_update_methods():
  from decentral_jax.optim import push_sum
  inner = optax.adamw(1e-3)
  ring = topology.make("ring", N)
  return {
      # name: (transform, sync-step ratio, expected period mean ratio)
      "local_sgd_h10": (optim.local_sgd(inner, 10), AR, AR / 10),
      "diloco_h10": (optim.diloco(inner, 10), AR, AR / 10),
      "diloco_h4": (optim.diloco(inner, 4), AR, AR / 4),
      # Two fragments (w, b) each all-reduced once per H = 10 steps.
      "streaming_p2_h10": (optim.streaming_diloco(
          inner, 10, num_fragments=2, overlap_steps=1), None, AR / 10),
      # Decentralized DiLoCo on the ring (two one-peer rounds, alternating):
      # one round per H = 5 steps.
      "decentralized_diloco_ring_h5": (optim.diloco(inner, 5,
          **sync_args(topology=ring)), 1.0, 1.0 / 5),
      # Local DAdam: a one-peer round every 4 steps.
      "dadam_tau4": (optim.decentralized_adamw(
          1e-3, topology.make("one_peer_exp", N), gossip_every=4),
          1.0, 1.0 / 4),
      # SGP: a directed one-peer round every step (x and the weight).
      "sgp": (push_sum.sgp(1e-3, push_sum.one_peer_directed_exp(N)),
              None, None),
  }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_local_update_methods()))
def test_local_update_bytes_per_step_over_a_sync_period(mesh, name):
  tx, sync_ratio, mean_ratio = _local_update_methods()[name]
  rep = analysis.communication(_lowered_step(tx, mesh)[0].compile())
  weights = [s.weight for s in rep.scenarios]
  assert sum(weights) == pytest.approx(1.0)
  if name == "sgp":
    # Parameters plus the scalar push-sum weight, once per step.
    assert rep.mean_bytes_per_step == pytest.approx(PARAM_BYTES + 4)
    return
  if sync_ratio is not None:
    # A local step sends nothing, a sync step (any round) sends the figure.
    ratios = rep.ratios(PARAM_BYTES)
    assert min(ratios) == 0.0
    assert [r for r in ratios if r] == pytest.approx(
        [sync_ratio] * (len(ratios) - 1))
  assert rep.mean_bytes_per_step / PARAM_BYTES == pytest.approx(mean_ratio)
  _only_params_sent(rep)


@pytest.mark.slow
def test_diloco_n8_h10_is_0175_of_the_parameters(mesh):
  tx = optim.diloco(optax.sgd(0.1), 10)
  lowered = _lowered_step(tx, mesh)[0]
  for stage in ("unoptimized", "optimized"):
    rep = analysis.communication(lowered, stage=stage)
    assert rep.mean_bytes_per_step / PARAM_BYTES == pytest.approx(0.175)
  assert "mean over a period" in rep.summary(PARAM_BYTES)
  assert json.loads(analysis.report_to_json(rep))["mean_bytes_per_step"] == \
      pytest.approx(0.175 * PARAM_BYTES)


def test_communication_of_a_text_whose_fusion_body_was_left_out():
  # Stripped fixtures keep the collectives and drop fusion bodies: a call
  # to a computation missing from the text sends nothing, and the
  # permute after it is counted once (8 floats to the one peer).
  from decentral_jax.analysis import accounting
  text = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%gone
  ROOT %p = f32[8]{0} collective-permute(%f), channel_id=1, source_target_pairs={{0,1},{1,0}}
}
"""
  rep = accounting.communication(text)
  assert [c.name for c in rep.collectives] == ["p"]
  assert rep.collectives[0].source_target_pairs == ((0, 1), (1, 0))
  assert [s.busiest_bytes for s in rep.scenarios] == [32.0]
