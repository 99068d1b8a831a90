"""Pipelined CHOCO-gossip in GPT-2 small's train step compiled for 8 H100s.

Reads a committed fixture (``tests/fixtures/overlap_at_scale/
124m_node_choco_pipelined_A40_rNone_none.hlo.gz``: the scheduled HLO of
``configs/gpt2_sizes.py:124m`` with DAdam, int8 CHOCO-gossip on the static
exponential graph of 8 and ``pipelined_gossip=True``, compiled without a
GPU for 8 x H100 SXM with every instruction priced at its roofline and
every collective at the A40 cluster's link time; written by
``benchmarks/bench_overlap_at_scale.py --cases 124m:node:choco_pipelined:A40
--fixtures``). Its counterpart without pipelining
(``124m_node_choco_rNone_none``, test_overlap_at_scale.py) has no matmul in
flight. Marked ``integration`` (parsing one program, about a second).
"""

import gzip
import os

import pytest

from decentral_jax.analysis import overlap

from conftest import FIXTURES

pytestmark = pytest.mark.integration

_NAME = "124m_node_choco_pipelined_A40_rNone_none.hlo.gz"
# GPT-2 small's parameters (test_overlap_at_scale.py counts them by hand).
_PARAMS = 124_373_760


def test_pipelined_choco_permutes_run_beside_the_backward():
  # The message Q(x_k - x_hat) reads only the step's inputs: every permute
  # (three terms of the exponential graph x 4 buckets) is asynchronous,
  # outside conditionals, and has matmuls of the backward in flight.
  path = os.path.join(FIXTURES, "overlap_at_scale", _NAME)
  assert os.path.exists(path), f"missing fixture {path}"
  with gzip.open(path, "rt") as f:
    rep = overlap.overlap_report(f.read())
  step = [c for c in rep.collectives if not c.in_conditional]
  assert len(step) == 12 and {c.kind for c in step} == {"collective-permute"}
  assert all(c.is_async for c in step)
  # int8 codes of every parameter plus a float32 scale per 256 values,
  # per term (padding per leaf or bucket: at most 1 % more).
  per_term = sum(c.bytes for c in step) / 3
  assert _PARAMS * (1 + 4 / 256) <= per_term <= _PARAMS * (1 + 4 / 256) * 1.01
  assert all(c.flops > 0 for c in step)
  fwd, bwd = rep.in_flight_fractions()
  assert bwd > 0.8 and fwd == 0.0  # the forward is not reached (study 19)
