"""Gossip hidden only behind the part of the step the compiled program
overlaps (``Workload.gossip_in_flight``). Expected values are worked out by
hand: a one-peer round of 4e8 bytes over 1.25e9 B/s NICs with 1e-4 s of
latency takes tau = 0.3201 s."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from decentral_jax.runtime_model import in_flight
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.tools.runtime_model_cli import main as cli

A, B, N = 1e-4, 1.25e9, 1e8  # s per message, bytes/s per NIC, parameters
TAU = A + 4 * N / B  # 0.3201 s: one pair exchange of the float32 parameters


def _setup(n=4, in_flight=None, cv=0.0, optimizer_s=0.0):
  c = Cluster(n, 1, inter_latency_s=A, nic_bandwidth_Bps=B,
                   multi_node="ring")
  w = Workload(N, 0.1, 0.2, optimizer_s=optimizer_s, compute_cv=cv,
                    bucket_bytes=1e15, gossip_in_flight=in_flight)
  return c, w


@pytest.mark.parametrize("in_flight, expected", [
    # window f_F * 0.1 + f_B * 0.2 s; step = 0.3 + max(0, TAU - window).
    ((0.0, 0.5), 0.3 + TAU - 0.1),
    ((0.0, 0.0), 0.3 + TAU),
    ((1.0, 1.0), 0.3 + TAU - 0.3),
    ((0.5, 1.0), 0.3 + TAU - 0.25)])
def test_exposed_part_is_the_transfer_beyond_the_window(in_flight, expected):
  c, w = _setup(in_flight=in_flight, optimizer_s=0.01)
  est = closed_form("one_peer_exp", c, w)
  assert est.iteration_s == pytest.approx(expected + 0.01, abs=1e-12)
  assert est.exposed_comm_s == pytest.approx(expected - 0.3, abs=1e-12)
  assert simulate("one_peer_exp", c, w, steps=20, warmup=4) == (
      pytest.approx(expected + 0.01, abs=1e-9))


def test_hidden_round_costs_nothing_and_default_unchanged():
  c = Cluster(4, 1, inter_latency_s=A, nic_bandwidth_Bps=B * 4,
                   multi_node="ring")  # tau = 1e-4 + 0.08 < 0.1 window
  w = Workload(N, 0.1, 0.2, bucket_bytes=1e15,
                    gossip_in_flight=(0.0, 0.5))
  assert closed_form("one_peer_exp", c, w).iteration_s == (
      pytest.approx(0.3))
  # Without the field: Decent-DP's pipeline, the round posted in the
  # previous step hides behind the whole next pass: 0.3201 s here.
  c, w = _setup()
  assert closed_form("one_peer_exp", c, w).iteration_s == (
      pytest.approx(TAU, abs=1e-12))
  # SGP does not overlap either way: C + tau.
  _, w2 = _setup(in_flight=(1.0, 1.0))
  assert closed_form("sgp", c, w2).iteration_s == pytest.approx(
      closed_form("sgp", c, w).iteration_s)


def test_simulated_group_waits_for_its_last_member():
  # Two workers, one step: worker 0 computes 0.1 + 0.2, worker 1 0.2 + 0.2;
  # with (0, 0.5) they issue at 0.2 and 0.3, the pair exchange ends at
  # 0.3 + tau for both; tau 0.05 s: steps end at max(0.3, 0.35) + 0.01
  # and max(0.4, 0.35) + 0.01: mean 0.385 s.
  c = Cluster(2, 1, inter_latency_s=0.0, nic_bandwidth_Bps=8 * N,
                   multi_node="ring")  # 4e8 bytes / 8e8 B/s = 0.5 s ...
  w = Workload(N / 10, 0.1, 0.2, optimizer_s=0.01, bucket_bytes=1e15,
                    gossip_in_flight=(0.0, 0.5))  # ... / 10 = 0.05 s
  m = make_method("one_peer_exp", c)
  got = in_flight.simulate(m, c, w, np.array([[0.1, 0.2]]),
                                  np.array([[0.2, 0.2]]), 0)
  assert got == pytest.approx(0.385)


@pytest.mark.parametrize("nic", [B, 4 * B])  # round exposed / hidden
def test_variance_adds_the_group_wait(nic):
  # The closed form takes one step's expectation (no carry-over of delays
  # between steps): below the simulation, within a few percent at cv 0.1.
  c, w = _setup(in_flight=(0.0, 0.5), cv=0.1)
  c = dataclasses.replace(c, nic_bandwidth_Bps=nic)
  det = closed_form("one_peer_exp", c, dataclasses.replace(
      w, compute_cv=0.0)).iteration_s
  est = closed_form("one_peer_exp", c, w)
  assert est.variability_s > 0 and est.iteration_s > det
  sim = simulate("one_peer_exp", c, w, steps=1000, warmup=100)
  assert est.iteration_s <= sim <= 1.05 * est.iteration_s


def test_read_in_flight(tmp_path):
  assert in_flight.read_in_flight("0.36") == (0.36, 0.36)
  assert in_flight.read_in_flight("0,0.55") == (0.0, 0.55)
  path = tmp_path / "report.json"
  path.write_text(json.dumps({"in_flight_fractions": {"forward": 0.0,
                                                      "backward": 0.5}}))
  assert in_flight.read_in_flight(str(path)) == (0.0, 0.5)
  for bad in ("x", "1.5", "0.1,0.2,0.3", "-0.1", str(tmp_path / "no.json")):
    with pytest.raises(ValueError, match="gossip-in-flight|gossip_in_flight"):
      in_flight.read_in_flight(bad)
  path.write_text("{}")
  with pytest.raises(ValueError, match="in_flight_fractions"):
    in_flight.read_in_flight(str(path))
  with pytest.raises(ValueError, match="gossip_in_flight"):
    Workload(N, 0.1, 0.2, gossip_in_flight=(0.5,))


def test_command_line_flag(capsys):
  base = ["predict", "--n-workers", "4", "--methods", "one_peer_exp",
          "--params", str(N), "--forward-ms", "100", "--backward-ms", "200",
          "--inter-latency-us", "100", "--nic-Gbps", "10", "--local-size",
          "1", "--bucket-MiB", "1e9"]
  cli.main(base)
  plain = capsys.readouterr().out
  cli.main(base + ["--gossip-in-flight", "0,0.5"])
  out = capsys.readouterr().out
  # 320.1 ms pipelined, 300 + 320.1 - 100 ms inside the step.
  assert "320.1" in plain and "520.1" in out


@pytest.mark.parametrize("in_flight, expected, plain", [
    # Pipelined: the optimizer (0.05 s) joins the window: step = 0.3 + 0.05
    # + max(0, TAU - window - 0.05); plain: 0.3 + 0.05 + max(0, TAU -
    # window).
    ((0.0, 0.5), 0.35 + TAU - 0.1 - 0.05, 0.35 + TAU - 0.1),
    ((0.0, 0.0), 0.35 + TAU - 0.05, 0.35 + TAU),
    ((1.0, 1.0), 0.35, 0.35 + TAU - 0.3)])  # TAU < 0.35: hidden
def test_pipelined_round_also_hides_behind_the_update(in_flight, expected,
                                                      plain):
  c, w = _setup(in_flight=in_flight, optimizer_s=0.05)
  est = closed_form("dadam:pipelined=1", c, w)
  assert est.iteration_s == pytest.approx(expected, abs=1e-12)
  assert closed_form("dadam", c, w).iteration_s == pytest.approx(
      plain, abs=1e-12)
  assert simulate("dadam:pipelined=1", c, w, steps=24, warmup=6) == (
      pytest.approx(expected, abs=1e-9))


def test_pipelined_round_fully_hidden_and_spec_checks():
  # tau = 1e-4 + 0.32 / 4 = 0.0801 s < 0.3 + 0.05: nothing exposed.
  c = Cluster(4, 1, inter_latency_s=A, nic_bandwidth_Bps=B * 4,
              multi_node="ring")
  w = Workload(N, 0.1, 0.2, optimizer_s=0.05, bucket_bytes=1e15,
               gossip_in_flight=(1.0, 1.0))
  assert closed_form("dadam:pipelined=1", c, w).iteration_s == (
      pytest.approx(0.35, abs=1e-12))
  c, w = _setup(in_flight=(0.0, 0.5))
  with pytest.raises(ValueError, match="pipelined='2' must be 0 or 1"):
    make_method("dadam:pipelined=2", c)
  with pytest.raises(ValueError, match="pipelined applies to overlapped"):
    method_lib.check_method(dataclasses.replace(
        make_method("dadam:pipelined=1", c), overlap=False), c)
  # With compression, pipelined=1 is pipelined CHOCO: overlapped gossip
  # whose round the update waits for (not the one-step-late mix).
  piped = make_method("dadam:compress=int8,pipelined=1", c)
  assert (piped.overlap, piped.pipelined) == (True, False)


def test_pipelined_simulation_uses_round_floor_k_over_2():
  # Measured round times: round 0 0.5 s, round 1 0 s; window (0, 0): the
  # round is issued when the 0.3 s of compute end, O = 0. A step of round
  # 0 ends 0.3 + 0.5 = 0.8 s after it starts, one of round 1 0.3 s later.
  # Pipelined, steps 0..3 send rounds 0, 0, 1, 1: (0.8 + 0.8 + 0.3 + 0.3)
  # / 4 = 0.55; over steps 0, 1 alone 0.8, where plain gossip (rounds 0,
  # 1) takes (0.8 + 0.3) / 2 = 0.55.
  c, w = _setup(in_flight=(0.0, 0.0))
  m = dataclasses.replace(make_method("dadam:pipelined=1", c),
                          measured_s=(0.5, 0.0))
  fwd = np.full((4, 4), 0.1)
  bwd = np.full((4, 4), 0.2)
  assert in_flight.simulate(m, c, w, fwd, bwd, 0) == pytest.approx(0.55)
  assert in_flight.simulate(m, c, w, fwd[:2], bwd[:2], 0) == (
      pytest.approx(0.8))
  plain = dataclasses.replace(m, pipelined=False)
  assert in_flight.simulate(plain, c, w, fwd[:2], bwd[:2], 0) == (
      pytest.approx(0.55))
