"""Tests of decentral_jax.runtime_model: costs, estimators, Figure 6, CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax import topology
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.costs import pair_exchange_time
from decentral_jax.runtime_model.costs import ring_all_reduce_time
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import expected_max_normal
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import per_step_methods

M = 100e6  # bytes


def _no_comm_cluster(n, local_size=1):
  return Cluster(n, local_size, 0.0, 1e18, 0.0, 1e18)


# -- alpha-beta costs ---------------------------------------------------------


def test_ring_units_100MB_at_10GBps_over_8_workers():
  assert ring_all_reduce_time(8, 100e6, 0.0, 10e9) == pytest.approx(
      2 * 7 / 8 * 0.01, rel=1e-12)
  assert ring_all_reduce_time(8, 100e6, 3e-6, 10e9) == pytest.approx(
      0.0175 + 14 * 3e-6, rel=1e-12)
  c = Cluster(8, 8, intra_latency_s=3e-6, intra_bandwidth_Bps=10e9)
  t = all_reduce_cost(c).time(100e6)
  np.testing.assert_allclose(t, 0.0175 + 14 * 3e-6, rtol=1e-12)
  assert pair_exchange_time(100e6, 1e-6, 10e9) == pytest.approx(0.010001)


def test_zero_communication_for_one_worker():
  c = Cluster(1)
  w = Workload(65e6, 0.01, 0.02, optimizer_s=0.003, compute_cv=0.0)
  assert all_reduce_cost(c).time(M)[0] == 0.0
  for meth in ("all_reduce", "one_peer_exp", "aer", "complete", "sgp"):
    assert simulate(meth, c, w, steps=20, warmup=5) == pytest.approx(0.033)
    est = closed_form(meth, c, w)
    assert est.iteration_s == pytest.approx(0.033)
    assert est.exposed_comm_s == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("multi_node", ["ring", "tree"])
@pytest.mark.parametrize("local_size", [1, 4, 8])
def test_costs_never_decrease_with_size_or_workers(multi_node, local_size):
  prev_n = 0.0
  for n in (8, 16, 32, 64):
    c = Cluster(n, local_size, 5e-6, 15e9, 20e-6, 3e9,
                     multi_node=multi_node)
    t = all_reduce_cost(c).time(M)[0]
    assert t >= prev_n
    prev_n = t
    sizes = [all_reduce_cost(c).time(b)[0] for b in (1e3, 1e6, 1e8, 1e9)]
    assert np.all(np.diff(sizes) >= 0)
    for name in ("one_peer_exp", "aer", "ring"):
      if name == "aer" and local_size == 1:
        continue
      rounds = [round_cost(c, r) for r in topology.make(
          name, n, local_size).rounds]
      per_size = [max(r.time(b).max() for r in rounds) for b in (1e3, 1e6, 1e9)]
      assert np.all(np.diff(per_size) >= 0)
  for p in range(1, 40):
    assert (ring_all_reduce_time(p + 1, M, 1e-6, 1e10)
            >= ring_all_reduce_time(p, M, 1e-6, 1e10))


def test_simulated_time_never_decreases_with_message_size():
  c = Cluster(16, 4, 5e-6, 30e9, 30e-6, 3e9)
  for meth in ("all_reduce", "one_peer_exp", "aer", "complete", "sgp"):
    times = [simulate(meth, c, Workload(p, 0.02, 0.04),
                           steps=30, warmup=10) for p in (1e5, 1e7, 1e8, 5e8)]
    assert np.all(np.diff(times) >= -1e-12), (meth, times)


def test_round_costs_match_hand_formulas():
  a_in, b_in, a_out, nic = 2e-6, 20e9, 30e-6, 3e9
  c = Cluster(16, 4, a_in, b_in, a_out, nic, multi_node="ring")
  exp = topology.make("one_peer_exp", 16, 4)
  # XOR 1: on-node pairs; XOR 4: all 4 workers of a node cross its NIC.
  np.testing.assert_allclose(round_cost(c, exp.rounds[0]).time(M),
                             a_in + M / b_in)
  np.testing.assert_allclose(round_cost(c, exp.rounds[2]).time(M),
                             a_out + 4 * M / nic)
  aer = topology.make("aer", 16, 4)
  rc = round_cost(c, aer.rounds[0])  # nodes 0,1 alone; 2,3 together
  intra = 6 * a_in + 1.5 * M / b_in
  ring8 = 14 * a_out + 2 * 7 / 8 * M / nic
  np.testing.assert_allclose(rc.time(M), [intra] * 8 + [ring8] * 8)
  assert rc.crosses.tolist() == [False] * 8 + [True] * 8
  tree = Cluster(16, 4, a_in, b_in, a_out, nic, multi_node="tree")
  t = round_cost(tree, aer.rounds[0]).time(M)[8]
  assert t == pytest.approx(6 * a_in + 2 * a_out
                            + max(1.5 * M / b_in, M / nic))
  # A per-connection cap limits a lone flow; sharing splits the NIC.
  capped = Cluster(16, 4, a_in, b_in, a_out, 8e9, flow_bandwidth_Bps=3e9)
  assert capped.inter_flow_Bps(1) == 3e9 and capped.inter_flow_Bps(4) == 2e9


def test_measured_times_override_formulas():
  c = Cluster(8, 4)
  w = Workload(10e6, 0.0, 0.0, bucket_shares=(1.0,))
  ar = Method("all_reduce", "all_reduce", measured_s=(0.123,))
  assert simulate(ar, c, w, steps=10, warmup=2) == pytest.approx(0.123)
  topo = topology.make("one_peer_exp", 8, 4)
  gossip = Method("exp", "gossip", topo, measured_s=(0.01, 0.02, 0.09))
  assert simulate(gossip, c, w, steps=30, warmup=3) == pytest.approx(0.04)


# -- estimators ---------------------------------------------------------------


def _reference_simulation(method, c, w, steps, warmup, seed):
  """Plain-loop max-plus recursion, written independently of ``simulate``."""
  n = c.n_workers
  fwd_m, bwd_m = method_lib.split_compute(w)
  fac = w.compute_factors(steps, n, seed)
  sizes, ready = w.buckets(w.param_bytes)
  nb = len(sizes)
  opt_b = [w.optimizer_s * s / sum(sizes) for s in sizes]
  if method.kind == "all_reduce":
    taus, rdy = per_step_methods.all_reduce_bucket_times(method, c, w)
    total = 0.0
    for k in range(warmup, steps):
      f, b = fwd_m * fac[k], bwd_m * fac[k]
      e = 0.0
      for j in range(len(taus)):
        e = max(e, max(f[i] + rdy[j] * b[i] for i in range(n))) + taus[j]
      total += max(e, max(f + b)) + w.optimizer_s
    return total / (steps - warmup)
  rounds = method.topology.rounds
  costs = method.round_costs(c, w)
  period = len(rounds)
  s = [0.0] * n
  wait = [[-math.inf] * nb for _ in range(n)]
  start = None
  for k in range(steps):
    if k == warmup:
      start = list(s)
    post = [[0.0] * nb for _ in range(n)]
    for i in range(n):
      t = s[i] + fwd_m * fac[k, i]
      for j in range(nb):
        t += bwd_m * fac[k, i] * (ready[j] - (ready[j - 1] if j else 0.0))
        t = max(t, wait[i][j]) + opt_b[j]
        post[i][j] = t
    s = [post[i][-1] for i in range(n)]
    r = (k + 1) % period
    groups = [[j for j in range(n) if rounds[r].matrix[i, j] > 0] + [i]
              for i in range(n)]
    # One in-order stream per worker; before this round's first bucket it
    # ran the last bucket of the round it waited for in this step.
    stream = [wait[i][-1] for i in range(n)]
    new = [[0.0] * nb for _ in range(n)]
    for j in range(nb):
      can_start = [max(post[i][j], stream[i]) for i in range(n)]
      for i in range(n):
        new[i][j] = (max(can_start[g] for g in groups[i])
                     + costs[r].latency_s[i] + costs[r].s_per_byte[i] * sizes[j])
      stream = [new[i][j] for i in range(n)]
    wait = new
  return float(np.mean(np.subtract(s, start)) / (steps - warmup))


@pytest.mark.parametrize("name", ["all_reduce", "one_peer_exp", "aer",
                                  "complete", "ring", "exponential"])
def test_vectorized_simulator_matches_plain_loops(name):
  c = Cluster(8, 2, 5e-6, 20e9, 20e-6, 2e9)
  w = Workload(20e6, 0.01, 0.02, optimizer_s=0.002, compute_cv=0.2,
                    bucket_bytes=20e6)
  m = make_method(name, c)
  ref = _reference_simulation(m, c, w, steps=40, warmup=8, seed=3)
  assert simulate(m, c, w, steps=40, warmup=8, seed=3) == pytest.approx(
      ref, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("buckets", ["one", "25MiB"])
@pytest.mark.parametrize("name", ["all_reduce", "one_peer_exp", "aer",
                                  "complete", "sgp"])
def test_simulator_matches_closed_form_over_compute_and_cluster_grid(
    name, buckets):
  """Zero-compute, comm-bound and compute-bound cases on an A40-like cluster.

  Without variance the closed form is the simulator's steady state (agree to
  1e-6); with CV 0.1 within 5%. 60 steps are a whole number of periods of
  every topology here (1, 2, 3, 5, 6 or 10 rounds).
  """
  for comp_ms in (0.0, 1.0, 3.0, 30.0, 300.0):  # forward + backward
    for n in (8, 32):
      for local_size in (1, 4):
        c = Cluster(n, local_size, 5e-6, 30e9, 30e-6, 3.125e9,
                         multi_node="tree")
        for cv, rel in ((0.0, 1e-6), (0.1, 0.05)):
          w = Workload(
              65e6, comp_ms / 3e3, 2 * comp_ms / 3e3, compute_cv=cv,
              optimizer_s=0.002 if comp_ms else 0.0,
              bucket_shares=(1.0,) if buckets == "one" else None)
          sim = simulate(name, c, w, steps=80, warmup=20)
          assert closed_form(name, c, w).iteration_s == pytest.approx(
              sim, rel=rel), (comp_ms, n, local_size, cv)


@pytest.mark.parametrize("local_size", [1, 4, 8])
def test_zero_compute_prices_bytes_and_links_only(local_size):
  # Without compute nothing hides communication: each worker's stream runs
  # its period's rounds back to back, so decentralized training is never free
  # and its speedup over All-Reduce is a ratio of link-limited times.
  c = Cluster(16, local_size, 5e-6, 15.75e9, 10e-6, 12.5e9,
                   multi_node="tree")
  w = Workload(65e6, 0.0, 0.0)
  nb = len(w.buckets(w.param_bytes)[0])
  assert nb == 10
  ar = simulate("all_reduce", c, w, steps=80, warmup=20)
  assert ar == pytest.approx(all_reduce_cost(c).time(w.grad_bytes, nb)[0])
  for name in ("one_peer_exp", "aer", "complete", "ring"):
    m = make_method(name, c)
    busy = sum(rc.time(w.param_bytes, nb) for rc in m.round_costs(c, w))
    per_step = busy.max() / m.topology.period
    assert simulate(m, c, w, steps=80, warmup=20) == pytest.approx(
        per_step, rel=1e-9), name
    assert closed_form(m, c, w).iteration_s == pytest.approx(
        per_step, rel=1e-9), name


def test_round_after_a_two_node_round_waits_for_the_shared_links():
  # 2 nodes x 4 GPUs: AER alternates the intra-node mean with the two-node
  # mean, which is a reduce-scatter in the node, one exchange across and an
  # all-gather in the node. With a fast NIC both are limited by the
  # intra-node links, so a period takes at least the sum of the two rounds.
  c = Cluster(8, 4, 5e-6, 15.75e9, 10e-6, 100e9, multi_node="tree")
  m = make_method("aer", c)
  w = Workload(65e6, 0.0005, 0.001)  # comm-bound, 10 buckets
  nb = len(w.buckets(w.param_bytes)[0])
  intra, joint = (rc.time(w.param_bytes, nb)[0] for rc in m.round_costs(c, w))
  assert [rc.crosses.all() for rc in m.round_costs(c, w)] == [False, True]
  # The two-node mean moves each worker's intra-node share (1.5 M) and its
  # quarter of the node's flow to the NIC (0.25 M) over its PCIe link.
  m_x = w.param_bytes
  assert intra == pytest.approx(nb * 6 * 5e-6 + 1.5 * m_x / 15.75e9)
  assert joint == pytest.approx(nb * (6 * 5e-6 + 2 * 10e-6)
                                + 1.75 * m_x / 15.75e9)
  period_s = 2 * simulate(m, c, w, steps=80, warmup=20)
  assert period_s >= (intra + joint) * (1 - 1e-12)
  assert period_s == pytest.approx(intra + joint, rel=1e-9)
  # The same with measured round times (seconds) and no compute.
  timed = Method("aer", "gossip", m.topology, measured_s=(0.01, 0.03))
  idle = Workload(65e6, 0.0, 0.0)
  assert simulate(timed, c, idle, steps=80, warmup=20) == pytest.approx(
      0.02, rel=1e-9)


def test_cli_zero_compute_does_not_recommend_aer(capsys):
  # 2 nodes x 8: AER's rounds move as many bytes over the same links as the
  # All-Reduce, so with nothing to hide behind there is no speedup.
  assert cli.main(["predict", "--forward-ms", "0", "--backward-ms", "0",
                   "--steps", "60"]) == 0
  out = capsys.readouterr().out
  assert "recommendation: All-Reduce" in out
  # Per iteration, every worker's PCIe link carries (tree, 8 per node):
  # All-Reduce 2*7/8 M in the node + 1/8 of the node's M to the NIC =
  # 1.875 M; AER alternates 1.75 M (node mean) and 1.875 M (two-node mean).
  aer = next(line for line in out.splitlines() if "DAdam (AER)" in line)
  speedup = float(aer.split()[4].rstrip("x"))
  assert speedup == pytest.approx(1.875 / ((1.75 + 1.875) / 2), abs=0.01)


def test_bucket_pipelining_closed_form_close_to_simulator():
  c = Cluster(64, 8, multi_node="tree")
  w = Workload(65e6, 0.04, 0.08, compute_cv=0.1)
  for name in ("all_reduce", "one_peer_exp", "aer", "complete"):
    assert simulate(name, c, w) == pytest.approx(
        closed_form(name, c, w).iteration_s, rel=0.05)


def _expected_max_of_normals(n: int) -> float:
  """``E[max of n i.i.d. N(0,1)] = int x n phi(x) Phi(x)^(n-1) dx`` (quad)."""
  from scipy import integrate, stats  # pylint: disable=import-outside-toplevel
  value, _ = integrate.quad(
      lambda x: x * n * stats.norm.pdf(x) * stats.norm.cdf(x)**(n - 1),
      -np.inf, np.inf, epsabs=1e-13, epsrel=1e-13)
  return value


def test_all_reduce_straggler_excess_is_the_expected_maximum():
  n, cv, comp = 64, 0.1, 0.3
  c = _no_comm_cluster(n)
  w = Workload(1e3, comp / 3, 2 * comp / 3, compute_cv=cv)
  sigma = cv * comp
  e_max = _expected_max_of_normals(n)  # 2.3437 (sqrt(2 ln 64) = 2.884)
  # Without communication All-Reduce waits each step for the slowest of n
  # workers: the excess over the mean compute is sigma E[max of n N(0,1)].
  # Over 4000 steps the standard error of the mean maximum is 0.45 sigma /
  # sqrt(4000), 0.3% of E[max]: 1% is 3 standard errors.
  ar = simulate("all_reduce", c, w, steps=4100, warmup=100, seed=1)
  excess_ar = ar - comp
  assert excess_ar == pytest.approx(sigma * e_max, rel=0.01)
  exp = simulate("one_peer_exp", c, w, steps=600, warmup=100, seed=1)
  assert 0 <= exp - comp < 0.5 * excess_ar
  # The closed form uses the exact Gaussian maximum: a numerical integral
  # (quad) and a Monte Carlo reference.
  assert expected_max_normal(n) == pytest.approx(e_max, rel=1e-9)
  assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi),
                                                      rel=1e-9)
  mc = np.random.default_rng(0).standard_normal((50_000, 64)).max(1).mean()
  assert expected_max_normal(64) == pytest.approx(mc, abs=0.01)
  assert closed_form("all_reduce", c, w).iteration_s == pytest.approx(
      comp + sigma * e_max, rel=1e-9)
  assert closed_form("all_reduce", c, w).iteration_s == pytest.approx(
      ar, rel=0.01)


# -- Figure 6 -------------------------------------------------------------------


def test_figure6_reproduction_within_20_percent_and_ordered():
  table = paper.rows()
  assert paper.failures(table) == []
  assert len(table) == 24
  # The check itself rejects a wrong prediction and a wrong order.
  broken = [dict(r) for r in table]
  for r in broken:
    if (r["cluster"], r["n"], r["method"]) == ("A40", 32, "aer"):
      r["simulated_ms"] = 0.75 * r["measured_ms"]
      r["error"] = -0.25
    if (r["cluster"], r["n"], r["method"]) == ("T4", 64, "one_peer_exp"):
      r["simulated_ms"] = 170.0
  msgs = paper.failures(broken)
  assert any("A40 n=32 aer" in s for s in msgs)
  assert any("T4 n=64: order" in s for s in msgs)


@pytest.mark.slow
def test_figure6_fit_reproduces_stored_constants():
  t4 = paper.fit_fig6("T4")
  a40 = paper.fit_fig6("A40", compute_cv=t4["compute_cv"])
  for name, got in (("T4", t4), ("A40", a40)):
    for key, want in paper.FITTED[name].items():
      assert got[key] == pytest.approx(want, rel=0.03), (name, key)
  assert 0 < t4["compute_cv"] < 0.5
  # A40's aggregate NIC rate is at least one 25 Gbit/s connection.
  assert a40["nic_bandwidth_Bps"] >= 25e9 / 8


# -- validation and CLI -------------------------------------------------------------


@pytest.mark.parametrize("make, field", [
    (lambda: Cluster(6, 4), "local_size"),
    (lambda: Cluster(0), "n_workers"),
    (lambda: Cluster(8, nic_bandwidth_Bps=0.0), "nic_bandwidth_Bps"),
    (lambda: Cluster(8, multi_node="star"), "multi_node"),
    (lambda: Workload(1e6, -0.1, 0.1), "forward_s"),
    (lambda: Workload(1e6, 0.1, 0.1, bucket_shares=(0.5, 0.2)),
     "bucket_shares"),
    (lambda: make_method("hypercube", Cluster(8)), "topology"),
    (lambda: make_method(topology.make("ring", 4), Cluster(8)),
     "n_workers"),
    (lambda: simulate("ring", Cluster(4),
                           Workload(1, 1, 1), steps=5, warmup=5),
     "warmup"),
])
def test_bad_input_raises_value_error_naming_the_field(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_cli_predict_prints_table_and_recommendation(capsys, tmp_path):
  png = tmp_path / "bars.png"
  rc = cli.main(["predict", "--n-workers", "8,16", "--local-size", "4",
                 "--nic-Gbps", "25", "--intra-GBps", "31.5", "--params",
                 "65e6", "--forward-ms", "20", "--backward-ms", "40",
                 "--methods", "all_reduce,one_peer_exp,aer,ring", "--steps",
                 "40", "--png", str(png)])
  out = capsys.readouterr().out
  assert rc == 0 and png.stat().st_size > 1000
  assert out.count("recommendation: DAdam (AER)") == 2
  assert "DAdam (ring)*" in out and "All-Reduce" in out


def test_cli_help_and_fig6(capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  assert "predict" in capsys.readouterr().out
  png = tmp_path / "fig6.png"
  assert cli.main(["fig6", "--png", str(png)]) == 0
  out = capsys.readouterr().out
  assert "PASS" in out and png.exists()
  assert cli.main(["predict", "--n-workers", "6", "--local-size", "4"]) == 2


# -- calibrate helpers (the end-to-end run is too slow for unit tests) ----------


def test_calibrate_alpha_beta_fit_and_config_overrides(tmp_path):
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import calibrate  # pylint: disable=import-outside-toplevel
  n, a, b = 8, 7e-6, 3e9
  sizes = [1e6, 8e6]
  times = [ring_all_reduce_time(n, s, a, b) for s in sizes]
  assert calibrate.fit_ring_alpha_beta(n, sizes, times) == pytest.approx((a, b))
  assert calibrate.fit_ring_alpha_beta(1, sizes, times) == (0.0, 1e18)
  cfg = config_lib.load_config("configs/gpt_tiny.py", [
      "n_workers=4", "model.n_layer=1", "comm_dtype=bfloat16",
      "model.bias=true"])
  assert (cfg.n_workers, cfg.model.n_layer, cfg.comm_dtype, cfg.model.bias) == (
      4, 1, "bfloat16", True)
  with pytest.raises(ValueError, match="model.depth"):
    config_lib.load_config("configs/gpt_tiny.py", ["model.depth=3"])
  with pytest.raises(ValueError, match="does not exist"):
    config_lib.load_config(str(tmp_path / "missing.py"))
