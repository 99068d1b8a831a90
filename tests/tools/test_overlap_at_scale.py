"""GPT-2 small's gossip in its train step compiled for 8 and 2 x 8 H100s.

Reads committed fixtures (``tests/fixtures/overlap_at_scale/``: the
scheduled HLO of ``configs/gpt2_sizes.py:124m`` compiled without a GPU for
8 x H100 SXM on one node, one-peer exponential graph, and for 2 nodes of 8,
AER, and for 2 workers of 8 devices (fsdp, one per node), with a latency
profile pricing every instruction at its roofline and every collective at
the runtime model's H100 link time; written by
``benchmarks/bench_overlap_at_scale.py --fixtures``, stripped to what the
reports read). Expected values are counted by hand from the model's shapes
(below) and from the runtime model's link formulas. Marked ``integration``
(about a minute: parsing and pricing 3 programs).
"""

import gzip
import os

import numpy as np
import pytest

from decentral_jax import topology as topology_lib
from decentral_jax.analysis import overlap
from decentral_jax.analysis import roofline
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model.costs import round_cost

from conftest import FIXTURES

pytestmark = pytest.mark.integration

_DIR = os.path.join(FIXTURES, "overlap_at_scale")
# GPT-2 small (no biases, tied embeddings): per layer c_attn 768x2304,
# attn c_proj 768x768, c_fc 768x3072, mlp c_proj 3072x768, two LayerNorm
# scales; wte 50304x768, wpe 1024x768, ln_f 768.
_LAYER = 768 * 2304 + 768 * 768 + 2 * 768 * 3072 + 2 * 768
_PARAMS = 12 * _LAYER + 50304 * 768 + 1024 * 768 + 768
# Matmul FLOPs of one worker's step (30 x 1024 tokens): the linear layers
# and the tied head 2 T (weights), the attention's two batched matmuls
# 2 x 2 B H T^2 d_head per layer; backward twice the forward.
_T, _B = 30 * 1024, 30
_FWD = (2 * _T * (12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
                  + 50304 * 768) + 12 * 2 * 2 * _B * 12 * 1024 * 1024 * 64)


def _text(name):
  path = os.path.join(_DIR, name)
  assert os.path.exists(path), (
      f"missing fixture {path}: run benchmarks/bench_overlap_at_scale.py "
      "--fixtures tests/fixtures/overlap_at_scale")
  with gzip.open(path, "rt") as f:
    return f.read()


def test_hand_counts():
  assert _PARAMS == 124_373_760
  assert 3 * _FWD == 26_255_000_862_720


@pytest.mark.parametrize("name, rnd", [
    ("124m_node_plain_r0_none.hlo.gz", 0),
    ("124m_2nodes_plain_r0_none.hlo.gz", 0),
    ("124m_2nodes_plain_r1_none.hlo.gz", 1)])
def test_every_gossip_bucket_is_async_outside_conditionals(name, rnd):
  rep = overlap.overlap_report(_text(name))
  assert rep.scheduled
  assert rep.total_flops == 3 * _FWD
  assert rep.forward_flops == _FWD
  step = [c for c in rep.collectives if not c.in_conditional]
  # The round's gossip: every float32 parameter once, in buckets, every
  # one asynchronous (permutes of the one-peer graph, group means of AER).
  assert sum(c.bytes for c in step) == 4 * _PARAMS
  assert all(c.is_async for c in step)
  kinds = {c.kind for c in step}
  assert kinds == ({"collective-permute"} if "node_" in name
                   else {"all-reduce"})
  # The exact global average every 1000 steps sits in its conditional.
  periodic = [c for c in rep.collectives if c.in_conditional]
  assert periodic and sum(c.bytes for c in periodic) == 4 * _PARAMS
  assert not any(c.overlapped for c in periodic)
  # Part of the backward's matmul work has a bucket in flight.
  fwd, bwd = rep.in_flight_fractions()
  assert bwd > 0.4


def test_the_round_across_two_h100_nodes_hides_on_the_roofline_clock():
  # AER round 1: the means over both nodes. On the H100 InfiniBand cluster
  # (400 Gbit/s per GPU) its buckets take about 2 ms together; the
  # compute scheduled while one is in flight, priced at the roofline,
  # is longer.
  text = _text("124m_2nodes_plain_r1_none.hlo.gz")
  rl = roofline.Roofline(989.4e12, 3.35e12, 0.5, 0.7)
  costs = roofline.instruction_costs(text, rl)
  gemm = [c for c in costs if c.kind == "gemm"]
  assert sum(c.flops for c in gemm) == 3 * _FWD
  # A GEMM takes at least its FLOPs at half the peak.
  assert sum(c.us for c in gemm) >= 3 * _FWD / (0.5 * 989.4e12) * 1e6
  _, union = roofline.in_flight_us(text, {c.name: c.us for c in costs})
  rep = overlap.overlap_report(text)
  step = [c for c in rep.collectives if not c.in_conditional]
  rnd = topology_lib.make("alternating_exp_ring", 16, 8).distinct_rounds[1]
  assert rnd.groups is not None and all(len(g) == 16 for g in rnd.groups)
  cost = round_cost(presets.cluster("h100_ib", 16), rnd)
  round_us = 1e6 * float(np.max(cost.time(sum(c.bytes for c in step))))
  assert 1_000 < round_us < 5_000
  assert union > 2 * round_us


def test_choco_int8_gossip_waits_for_the_optimizer_step():
  # CHOCO-compressed DAdam (int8 blocks of 256 with a float32 scale each,
  # static exponential graph of 8: three permute terms). Its message
  # Q(x_{k+1/2} - x_hat) needs this step's optimizer update, so every
  # permute is asynchronous and outside conditionals but starts after the
  # backward pass: no matmul in flight (the recursion, not the scheduler).
  rep = overlap.overlap_report(_text("124m_node_choco_rNone_none.hlo.gz"))
  step = [c for c in rep.collectives if not c.in_conditional]
  assert step and {c.kind for c in step} == {"collective-permute"}
  assert all(c.is_async for c in step)
  # Three terms, each carrying every parameter as int8 plus one float32
  # scale per 256 values (blocks padded per leaf or bucket: at least that).
  per_term = sum(c.bytes for c in step) / 3
  assert _PARAMS * (1 + 4 / 256) <= per_term <= _PARAMS * (1 + 4 / 256) * 1.01
  assert all(c.flops == 0 and c.backward == 0 for c in step)
  assert rep.flops_in_flight == 0.0


def test_fsdp_workers_gossip_told_from_collectives_inside_a_worker():
  # 124m:fsdp8:plain: 2 workers of 8 H100s (one per node, fsdp), one-peer
  # graph of 2 workers = the mean of the pair, profile at h100_ib links.
  # Device j of worker 0 (ids 0..7) averages its 1/8 shard with device j
  # of worker 1 (ids 8..15): All-Reduces over the groups {j, j+8} that
  # cross workers; fsdp's all-gathers, reduce-scatters and all-to-all run
  # over each worker's own 8 devices. 4 sequences per device (32 per
  # worker).
  from decentral_jax.analysis import accounting
  text = _text("124m_fsdp8_plain_rNone_none.hlo.gz")
  colls = {c.name: c for c in accounting.communication(text).collectives}
  rep = overlap.overlap_report(text)
  b = 4
  fwd = (2 * b * 1024 * (12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
                         + 50304 * 768) + 12 * 2 * 2 * b * 12 * 1024 ** 2 * 64)
  assert rep.total_flops == 3 * fwd and rep.forward_flops == fwd
  cross = {n: overlap.crosses_workers(c, 8) for n, c in colls.items()}
  step = [c for c in rep.collectives if not c.in_conditional]
  gossip = [c for c in step if cross[c.name]]
  inner = [c for c in step if not cross[c.name]]
  pairs = tuple((j, j + 8) for j in range(8))
  assert {colls[c.name].replica_groups for c in gossip} == {pairs}
  assert {c.kind for c in gossip} == {"all-reduce"}
  assert all(c.is_async for c in gossip)
  assert sum(c.bytes for c in gossip) == 4 * _PARAMS / 8
  worker = (tuple(range(8)), tuple(range(8, 16)))
  assert {colls[c.name].replica_groups for c in inner} == {worker}
  assert {"all-gather", "reduce-scatter"} <= {c.kind for c in inner}
  # The periodic exact average: the same pair means, in its conditional.
  periodic = [c for c in rep.collectives if c.in_conditional]
  assert all(cross[c.name] for c in periodic)
  assert sum(c.bytes for c in periodic) == 4 * _PARAMS / 8
  # fsdp's all-gathers cover the whole forward; the gossip alone none of
  # it, and part of the backward (study 19.3).
  assert rep.in_flight_fractions()[0] == 1.0
  g_fwd, g_bwd = overlap.overlap_report(
      text, only=lambda nm: cross.get(nm, True)).in_flight_fractions()
  assert g_fwd == 0.0 and 0.1 < g_bwd < 0.2
