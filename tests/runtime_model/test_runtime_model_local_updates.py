"""Runtime model of local-update methods: Local SGD, DiLoCo, Streaming DiLoCo,
decentralized DiLoCo, local D-SGD; expected values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import traffic

# 8 workers on one node: ring all-reduce 2(p-1) a + 2(p-1)/p M / b.
A, B = 4e-6, 20e9
C8 = Cluster(8, 8, intra_latency_s=A, intra_bandwidth_Bps=B)
P = 10e6  # parameters: 40 MB in float32, 2 buckets of 25 MiB.


def ring(nbytes, messages):
  return messages * 14 * A + 2 * 7 / 8 * nbytes / B


def test_parse_specs_and_canonical_names():
  c = Cluster(16, 4)
  m = make_method("streaming_diloco:H=10,P=4,tau=1", c)
  assert (m.kind, m.period, m.fragments, m.overlap_steps, m.message) == (
      "local", 10, 4, 1, "theta")
  assert m.name == "streaming_diloco:H=10,P=4,tau=1"
  alias = make_method("Streaming_DiLoCo:sync_every=10,num_fragments=4,"
                           "overlap_steps=1", c)
  assert alias.name == m.name
  assert make_method("diloco", c).name == "diloco:H=10"  # default H
  # Leading zeros are the same whole number, spelled canonically.
  assert make_method("diloco:H=010", c).name == "diloco:H=10"
  assert make_method("desloc:Kx=08,Ku=+016", c).name == (
      "desloc:Kx=8,Ku=16,Kv=48")
  d = make_method("diloco:h=5,topology=aer", c)
  assert d.topology.n_workers == 16 and d.name == "diloco:H=5,topology=aer"
  ld = make_method("local_dadam:gossip_every=4", c)
  assert ld.name == "local_dadam:H=4,topology=one_peer_exp"
  assert ld.message == "params"
  bf = make_method("streaming_diloco:H=8,P=2,comm_dtype=bfloat16", c)
  assert bf.comm_dtype == "bfloat16"
  assert inputs.split_methods("all_reduce, aer,streaming_diloco:H=10,P=4,tau=1,"
                           "diloco:H=3,topology=ring") == [
      "all_reduce", "aer", "streaming_diloco:H=10,P=4,tau=1",
      "diloco:H=3,topology=ring"]


@pytest.mark.parametrize("spec, words", [
    ("diloco:H=0", ("H='0'", ">= 1")),
    ("diloco:H=2.5", ("H='2.5'", "integer")),
    ("diloco:P=2", ("no parameter 'P'", "H=<steps")),
    ("diloco:H", ("'H' is not KEY=VALUE",)),
    ("diloco:H=4,,topology=ring", ("stray comma",)),
    ("diloco:H=4,H=5", ("given twice",)),
    ("diloko:H=4", ("unknown local-update method 'diloko'", "diloco:H=10")),
    ("streaming_diloco:H=4,P=5", ("P=5", "<= H=4")),
    ("streaming_diloco:H=10,P=4,tau=3", ("tau * P < H",)),
    ("streaming_diloco:H=10,comm_dtype=int8", ("comm_dtype 'int8'",
                                               "floating")),
    ("diloco:H=10,topology=hypercube", ("topology='hypercube'",)),
    # An alias is named as written (it was named H), with what it stands for.
    ("desloc:Kx=0", ("'desloc:Kx=0': Kx='0' must be an integer >= 1 (Kx is "
                     "H: H=<steps >= 1>)",)),
    ("diloco:sync_every=-2", ("sync_every='-2' must be an integer >= 1",)),
    ("streaming_diloco:H=10,num_fragments=x", ("num_fragments='x'",)),
    ("desloc:Kx=4,sync_every_u=0", ("sync_every_u='0'",)),
    ("diloco:H=1e1", ("H='1e1'", "integer")),
])
def test_bad_spec_raises_value_error_naming_the_part(spec, words):
  with pytest.raises(ValueError) as e:
    make_method(spec, Cluster(8))
  for word in words:
    assert word in str(e.value), (word, str(e.value))


def test_bad_method_fields_are_named():
  c = Cluster(8)
  with pytest.raises(ValueError, match="period"):
    make_method(Method("x", "all_reduce", period=4), c)
  with pytest.raises(ValueError, match="fragments"):
    make_method(Method("x", "local", period=4, fragments=5), c)
  with pytest.raises(ValueError, match="topology=None"):
    make_method(Method("x", "local", make_method(
        "ring", c).topology, period=4, fragments=2), c)
  with pytest.raises(ValueError, match="whole period"):
    simulate("diloco:H=50", c, Workload(1e3, 0.01, 0.01),
                  steps=60, warmup=12)


def test_diloco_without_variance_is_compute_plus_allreduce_over_h():
  w = Workload(P, 0.01, 0.02, optimizer_s=0.001)  # C + O = 31 ms
  expect = 0.031 + ring(4 * P, 2) / 10
  for spec in ("diloco:H=10", "local_sgd:H=10",
               "streaming_diloco:H=10,P=1,tau=0"):
    assert simulate(spec, C8, w, steps=100, warmup=20) == pytest.approx(
        expect, rel=1e-12), spec
    est = closed_form(spec, C8, w)
    assert est.iteration_s == pytest.approx(expect, rel=1e-12), spec
    assert est.exposed_comm_s == pytest.approx(ring(4 * P, 2) / 10)
  # DiLoCo sends float32 theta for bfloat16 parameters, Local SGD bfloat16.
  half = Workload(P, 0.01, 0.02, optimizer_s=0.001,
                       param_dtype="bfloat16")
  assert closed_form("diloco:H=10", C8, half).iteration_s == (
      pytest.approx(expect, rel=1e-12))
  assert closed_form("local_sgd:H=10", C8, half).iteration_s == (
      pytest.approx(0.031 + ring(2 * P, 1) / 10, rel=1e-12))


def test_local_sgd_h1_equals_blocking_all_reduce_of_the_same_bytes():
  for cv in (0.0, 0.2):
    w = Workload(P, 0.01, 0.02, optimizer_s=0.001, compute_cv=cv)
    blocking = Method("all_reduce", "all_reduce", overlap=False)
    ar = simulate(blocking, C8, w, steps=60, warmup=10, seed=2)
    assert simulate("local_sgd:H=1", C8, w, steps=60, warmup=10,
                         seed=2) == pytest.approx(ar, rel=1e-12)
    assert closed_form("local_sgd:H=1", C8, w).iteration_s == (
        pytest.approx(closed_form(blocking, C8, w).iteration_s,
                      rel=1e-12))
  assert ar > 0.031 + ring(4 * P, 2)  # the barrier waits for the slowest


def test_local_dsgd_h1_on_sgp_topology_is_sgp():
  # One message (4 MB < 25 MiB); SGP starts its schedule one round later,
  # so with variance the draws meet other rounds (agree to 1%).
  c = Cluster(8, 4, 5e-6, 20e9, 20e-6, 3e9)
  for cv, rel in ((0.0, 1e-12), (0.1, 0.01)):
    w = Workload(1e6, 0.01, 0.02, compute_cv=cv)
    for est in (simulate, lambda *a, **k: closed_form(
        *a).iteration_s):
      kw = {} if est is not simulate else dict(steps=120, warmup=12)
      assert est("local_dsgd:H=1,topology=sgp", c, w, **kw) == pytest.approx(
          est("sgp", c, w, **kw), rel=rel)


def test_streaming_exposes_max_of_zero_and_fragment_minus_overlap():
  w = Workload(P, 0.001, 0.002)  # step 3 ms; fragment 10 MB ~ 0.9 ms
  frag = ring(P, 1)  # 40 MB / 4 fragments, one 25 MiB message
  for tau, exposed in ((0, frag), (1, 0.0)):
    expect = 0.003 + 4 * exposed / 12
    spec = f"streaming_diloco:H=12,P=4,tau={tau}"
    assert simulate(spec, C8, w, steps=96, warmup=12) == pytest.approx(
        expect, rel=1e-12)
    assert closed_form(spec, C8, w).iteration_s == pytest.approx(
        expect, rel=1e-12)
  # Comm-bound: a 10x slower link leaves 9 ms - 2 * 3 ms exposed per fragment.
  slow = Cluster(8, 8, intra_latency_s=0.0, intra_bandwidth_Bps=B / 10)
  frag = 2 * 7 / 8 * P * 10 / B
  spec = "streaming_diloco:H=12,P=4,tau=2"
  expect = 0.003 + 4 * (frag - 2 * 0.003) / 12
  assert simulate(spec, slow, w, steps=96, warmup=12) == pytest.approx(
      expect, rel=1e-12)
  assert closed_form(spec, slow, w).iteration_s == pytest.approx(
      expect, rel=1e-12)
  # bfloat16 pseudo-gradients halve the bytes.
  bf = closed_form("streaming_diloco:H=12,P=4,tau=1,comm_dtype=bfloat16",
                        slow, w)
  assert bf.exposed_comm_s == pytest.approx(4 * (frag / 2 - 0.003) / 12)
  assert closed_form(spec + ",comm_dtype=bfloat16", slow,
                          w).exposed_comm_s == 0.0  # 4.4 ms < 2 x 3 ms


def test_decentralized_diloco_and_local_dsgd_pay_one_round_per_h():
  c = Cluster(8, 1, 0.0, 1e18, 0.0, 2e9)  # one worker per node
  # one_peer_exp on 8 single-worker nodes: 3 rounds of pair exchanges,
  # a + M / b with every flow alone on its NIC.
  for spec, nbytes in (("diloco:H=5,topology=one_peer_exp", 4 * P),
                       ("local_dsgd:H=5,topology=one_peer_exp", 2 * P)):
    half = Workload(P, 0.01, 0.02, param_dtype="bfloat16")
    expect = 0.03 + nbytes / 2e9 / 5
    assert simulate(spec, c, half, steps=60, warmup=15) == pytest.approx(
        expect, rel=1e-12)
    assert closed_form(spec, c, half).iteration_s == pytest.approx(
        expect, rel=1e-12)
  # On complete, decentralized DiLoCo is DiLoCo (a one-group round).
  for cv in (0.0, 0.1):
    wv = Workload(P, 0.01, 0.02, compute_cv=cv)
    a = simulate("diloco:H=5,topology=complete", c, wv, steps=60,
                      warmup=15)
    assert simulate("diloco:H=5", c, wv, steps=60, warmup=15) == (
        pytest.approx(a, rel=1e-12))


def test_barrier_wait_scales_with_sqrt_h():
  """Without communication the sync waits for the slowest sum of H draws:
  sigma sqrt(H) E[max of n N(0,1)] per H steps (NumPy Monte Carlo here)."""
  n, cv, comp = 16, 0.1, 0.03
  c = Cluster(n, 1, 0.0, 1e18, 0.0, 1e18)
  w = Workload(1e3, comp / 3, 2 * comp / 3, compute_cv=cv)
  rng = np.random.default_rng(0)
  e_max = rng.standard_normal((40_000, n)).max(axis=1).mean()
  for h in (1, 4, 16):
    expect = comp + cv * comp * math.sqrt(h) * e_max / h
    assert closed_form(f"diloco:H={h}", c, w).iteration_s == (
        pytest.approx(expect, rel=2e-3))
    sim = simulate(f"diloco:H={h}", c, w, steps=48 * h, warmup=8 * h)
    assert sim == pytest.approx(expect, rel=0.01)


@pytest.mark.parametrize("spec", [
    s if s == "streaming_diloco:H=8,P=4,tau=1"
    else pytest.param(s, marks=pytest.mark.slow) for s in (
        "local_sgd:H=8", "diloco:H=4", "streaming_diloco:H=8,P=4,tau=0",
        "streaming_diloco:H=8,P=4,tau=1", "streaming_diloco:H=12,P=3,tau=2",
        "diloco:H=4,topology=one_peer_exp", "local_dsgd:H=4,topology=aer")])
def test_simulator_matches_closed_form_compute_and_comm_bound(spec):
  # A40-like links, 65M float32 parameters: comm-bound at 3 ms of compute
  # (the all-reduce takes ~150 ms), compute-bound at 300 ms.
  for comp_ms in (0.0, 3.0, 300.0):
    c = Cluster(16, 4, 5e-6, 30e9, 30e-6, 3.125e9, multi_node="tree")
    for cv, rel in ((0.0, 1e-9), (0.1, 0.03)):
      w = Workload(65e6, comp_ms / 3e3, 2 * comp_ms / 3e3,
                        compute_cv=cv, optimizer_s=0.002 if comp_ms else 0.0)
      if cv and not comp_ms:
        continue
      sim = simulate(spec, c, w, steps=288, warmup=48)
      assert closed_form(spec, c, w).iteration_s == pytest.approx(
          sim, rel=rel), (comp_ms, cv)


def test_bytes_per_iteration():
  w = Workload(P, 0.01, 0.02)
  t = traffic.bytes_per_iteration("diloco:H=10", C8, w)
  assert t.worker_bytes == pytest.approx(2 * 7 / 8 / 10 * 4 * P)  # 0.175 x
  assert t.node_bytes == 0.0
  c = Cluster(16, 8, multi_node="tree")
  # Tree over 2 nodes: 2(q-1)/q M = M leaves each node; per worker
  # 2(L-1)/L M + M / L = 2(n-1)/n M.
  ar = traffic.bytes_per_iteration("all_reduce", c, w)
  assert (ar.worker_bytes, ar.node_bytes) == pytest.approx(
      (2 * 15 / 16 * 4 * P, 4 * P))
  s = traffic.bytes_per_iteration(
      "streaming_diloco:H=10,P=4,tau=1,comm_dtype=bfloat16", c, w)
  assert s.worker_bytes == pytest.approx(ar.worker_bytes / 2 / 10)
  # one_peer_exp on 16 = 2 x 8: 4 rounds of pair exchanges; the XOR-8
  # round sends all 8 workers' M across.
  g = traffic.bytes_per_iteration("local_dsgd:H=2,topology=one_peer_exp", c, w)
  assert (g.worker_bytes, g.node_bytes) == pytest.approx(
      (4 * P / 2, 8 * 4 * P / 8))


def test_cli_predict_prints_local_methods(capsys):
  rc = cli.main(["predict", "--n-workers", "8", "--local-size", "4",
                 "--nic-Gbps", "25", "--params", "65e6", "--steps", "60",
                 "--methods", "all_reduce,diloco:H=10,"
                 "streaming_diloco:H=10,P=4,tau=1,local_dsgd:H=4,"
                 "topology=aer"])
  out = capsys.readouterr().out
  assert rc == 0
  rows = {line.split()[0].rstrip("*^"): line.split()
          for line in out.splitlines()
          if line.startswith("  ") and line.split()[0][0].islower()}
  for name in ("diloco:H=10", "streaming_diloco:H=10,P=4,tau=1",
               "local_dsgd:H=4,topology=aer"):
    assert name in rows, out
    assert rows[name][3].endswith("x")
  # 65e6 float32 over 8 workers in 2 nodes (tree): 2(n-1)/n M / H per worker.
  assert float(rows["diloco:H=10"][6]) == pytest.approx(
      2 * 7 / 8 * 260 / 10, abs=0.05)
  # tau=1 is faster, but the library runs tau=0: marked, never recommended.
  assert rows["streaming_diloco:H=10,P=4,tau=1"][0].endswith("^")
  assert "recommendation: diloco:H=10:" in out
  assert cli.main(["predict", "--methods", "diloco:H=0"]) == 2
  assert "H='0'" in capsys.readouterr().err
