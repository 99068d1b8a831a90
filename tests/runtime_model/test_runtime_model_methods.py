"""Every method of the library is priced: gossip specs (DAdam, AccumAdam,
low-precision and bucketed gossip), workers that span devices (fsdp, data),
and the mapping from a run config to a spec. Expected values are worked by
hand from the alpha-beta formulas in docs/runtime_model.md."""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import methods
from decentral_jax import topology
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import local_sync
from decentral_jax.runtime_model import method_messages
from decentral_jax.runtime_model import traffic

M = 100e6  # bytes: 25e6 float32 parameters


def _zero_latency(n, local_size, intra=10e9, nic=1e9):
  return Cluster(n, local_size, 0.0, intra, 0.0, nic, multi_node="tree")


def test_dadam_and_accum_adam_cost_the_same_gossip():
  c = Cluster(16, 4, 5e-6, 31.5e9, 30e-6, 3.125e9, multi_node="tree")
  w = Workload(65e6, 0.02, 0.04, compute_cv=0.1)
  m = make_method("accum_adam:T=8,topology=aer", c)
  assert (m.kind, m.topology.name, m.name) == (
      "gossip", "alternating_exp_ring",
      "accum_adam:T=8,topology=alternating_exp_ring")
  base = simulate("aer", c, w, steps=60, warmup=12)
  for spec in ("accum_adam:topology=aer", "dadam:topology=aer",
               "accum_adamw:T=2,topology=alternating_exp_ring"):
    assert simulate(spec, c, w, steps=60, warmup=12) == base, spec
    assert traffic.bytes_per_iteration(spec, c, w) == \
        traffic.bytes_per_iteration("aer", c, w)
  assert make_method("dadam", c).topology.name == "one_peer_exp"


def test_bfloat16_gossip_halves_the_bytes_and_the_link_time():
  c = _zero_latency(16, 4, intra=31.5e9, nic=3.125e9)
  w = Workload(65e6, 0.0, 0.0)
  fp32 = traffic.bytes_per_iteration("aer", c, w)
  bf16 = traffic.bytes_per_iteration("aer:comm_dtype=bfloat16", c, w)
  # AER on 4 nodes x 4 (tree): a node sends M = 260 MB every other step.
  assert fp32.node_bytes == pytest.approx(130e6)
  assert bf16.node_bytes == pytest.approx(65e6)
  assert bf16.worker_bytes == pytest.approx(fp32.worker_bytes / 2)
  t32 = simulate("aer", c, w, steps=40, warmup=8)
  t16 = simulate("aer:comm_dtype=bfloat16", c, w, steps=40, warmup=8)
  assert t16 == pytest.approx(t32 / 2, rel=1e-9)  # no latency: bytes only


def test_bucket_size_sets_the_number_of_latencies():
  a_in, a_out = 5e-6, 30e-6
  c = Cluster(16, 4, a_in, 31.5e9, a_out, 3.125e9, multi_node="tree")
  w = Workload(65e6, 0.0, 0.0)  # 260 MB of float32 gradients
  small = simulate("all_reduce:bucket_MiB=1", c, w, steps=20, warmup=4)
  large = simulate("all_reduce:bucket_MiB=100", c, w, steps=20, warmup=4)
  nb_small, nb_large = math.ceil(260e6 / 2**20), math.ceil(260e6 / 100 / 2**20)
  assert (nb_small, nb_large) == (248, 3)
  # Tree over 4 nodes x 4: 2(L-1) a_in + 2(q-1) a_out per bucket.
  assert small - large == pytest.approx((nb_small - nb_large)
                                        * (6 * a_in + 6 * a_out))


@pytest.mark.parametrize("layout, inner_ms, gossip_ms, worker_mb", [
    # fsdp: all-gather + reduce-scatter of M each, (D-1)/D M / b = 5 ms
    # each; gossip: each device sends its M/2 over its own link: 5 ms.
    ("fsdp", 10.0, 5.0, 100.0),
    # data: all-reduce 2(D-1)/D M / b = 10 ms; each device sends all M.
    ("data", 10.0, 10.0, 200.0),
])
def test_workers_of_two_devices_in_one_node(layout, inner_ms, gossip_ms,
                                            worker_mb):
  c = _zero_latency(2, 2)
  w = Workload(25e6, 0.0, 0.0, devices_per_worker=2, worker_layout=layout,
                    bucket_bytes=1e12)
  # Zero compute: the wait for the gossip, then the inner collectives.
  for method in ("complete", "all_reduce"):
    t = simulate(method, c, w, steps=20, warmup=4)
    assert t == pytest.approx((inner_ms + gossip_ms) * 1e-3), method
    est = closed_form(method, c, w)
    assert est.iteration_s == pytest.approx(t)
    assert est.exposed_comm_s == pytest.approx(t)  # all of it is comm
  b = traffic.bytes_per_iteration("complete", c, w)
  assert b.worker_bytes == pytest.approx(worker_mb * 1e6)
  assert b.inner_bytes == pytest.approx(200e6)  # (D-1)(Mx+Mg) or 2(D-1)Mg


def test_data_layout_puts_every_device_on_the_nic():
  # 2 workers on 2 nodes, 2 devices each, 1 GB/s NIC: the pair exchange
  # sends 2 x M (data) or 2 x M/2 (fsdp) through each node's NIC.
  c = _zero_latency(2, 1, intra=1e12, nic=1e9)
  for layout, want in (("data", 2 * M / 1e9), ("fsdp", M / 1e9)):
    w = Workload(25e6, 0.0, 0.0, devices_per_worker=2,
                      worker_layout=layout, bucket_bytes=1e12)
    m = make_method("complete", c)
    c_eff, _ = method_messages.effective(m, c, w)
    assert round_cost(c_eff, m.topology.rounds[0]).time(M)[0] == \
        pytest.approx(want), layout
    # Zero compute: that exchange plus the inner collectives at 1 TB/s:
    # data 2(D-1)/D Mg, fsdp (D-1)/D (Mx + Mg), both M / 1e12 = 0.1 ms.
    assert simulate(m, c, w, steps=20, warmup=4) == pytest.approx(
        want + M / 1e12)


# Priced by hand below: 16 workers on 16 nodes (every flow crosses a node,
# each node's one NIC carries one flow per direction: 1 GB/s, no latency),
# M = 100 MB of float32 parameters and gradients in one bucket, forward 20 ms
# + backward 40 ms, no variability.
_C_S = 0.06
_PAIR_S = M / 1e9  # a pair exchange or a ppermute term: 0.1 s
_RING_S = 2 * 15 / 16 * M / 1e9  # ring all-reduce over 16 nodes: 0.1875 s


def _hand_gossip_s(topo) -> float:
  """Overlapped gossip, one bucket, no variance: a step takes max(C, round).

  The round of step r is posted at the end of step r-1 and awaited at the
  end of step r's backward (one bucket: nothing is mixed earlier), so the
  step takes ``max(C, tau_r)``; a worker's round costs nothing alone, a
  pair exchange for a group of 2, a ring all-reduce for a larger group, one
  message per ppermute term. The slowest worker sets the pace.
  """
  per_worker = np.zeros(topo.n_workers)
  for rnd in topo.rounds:
    tau = np.full(topo.n_workers, len(rnd.terms) * _PAIR_S)
    for g in rnd.groups or ():
      p = len(g)
      tau[list(g)] = 0.0 if p == 1 else _PAIR_S if p == 2 else (
          2 * (p - 1) / p * M / 1e9)
    per_worker += np.maximum(_C_S, tau)
  return float(per_worker.max()) / topo.period


def test_every_library_algorithm_and_topology_is_priced():
  c = _zero_latency(16, 1, intra=10e9, nic=1e9)
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,))
  h = 10  # base_config's sync_every
  want = {
      # The bucket's ring all-reduce after the backward.
      "all_reduce": _C_S + _RING_S,
      # AccumAdam on one_peer_exp: pair exchanges of 0.1 s > C.
      "decentralized": _PAIR_S,
      # An exact all-reduce of M every H steps, not overlapped.
      "local_sgd": _C_S + _RING_S / h,
      "diloco": _C_S + _RING_S / h,
      "streaming_diloco": _C_S + _RING_S / h,  # P = 1, tau = 0
      # One one_peer_exp round (a pair exchange) every H steps.
      "decentralized_diloco": _C_S + _PAIR_S / h,
      # SGP: a blocking ppermute (0.1 s) after every step.
      "sgp": _C_S + _PAIR_S,
      # DES-LOC: all-reduces of x every H, u every 3H and v every 6H steps
      # (sync_every_u = 30, sync_every_v = 60), not overlapped.
      "desloc_adam": _C_S + _RING_S * (1 / h + 1 / 30 + 1 / 60),
  }
  # Every registered method is priced (those of later homes checked against
  # their hand counts in their own tests); the library's first ones here.
  assert set(want) <= set(methods.ALGORITHMS)
  for algo in methods.ALGORITHMS:
    cfg = config_lib.base_config("gpt")
    cfg.algorithm = algo
    assert int(cfg.sync_every) == h
    spec, fields = builders.spec_for_config(cfg)
    m = make_method(spec, c)
    # 160 steps: NoLoCo's schedule repeats after 8 pairings x H = 80 steps.
    t = simulate(m, c, Workload(25e6, 0.02, 0.04,
                                          bucket_shares=(1.0,), **fields),
                      steps=160, warmup=16)
    assert closed_form(m, c, w).iteration_s == pytest.approx(
        t, rel=1e-9), (algo, spec)
    if algo in want:
      assert t == pytest.approx(want[algo], rel=1e-9), (algo, spec, t)
  # Streaming DiLoCo with P = 2 fragments of M/2, each overlapped with
  # tau = 1 step: (a/2 - C) of each is exposed once per H steps.
  cfg = config_lib.base_config("gpt")
  cfg.algorithm, cfg.num_fragments, cfg.overlap_steps = "streaming_diloco", 2, 1
  spec, _ = builders.spec_for_config(cfg)
  assert simulate(spec, c, w, steps=80, warmup=16) == pytest.approx(
      _C_S + 2 * (_RING_S / 2 - _C_S) / h, rel=1e-9)
  for name in topology.NAMES:
    m = make_method(name, c)
    assert simulate(m, c, w, steps=80, warmup=16) == pytest.approx(
        _hand_gossip_s(m.topology), rel=1e-9), name
  # DiLoCo's overlapped outer step is priced as such only where the library
  # hides the reduction (trickled); one-shot is the blocking sync.
  cfg = config_lib.base_config("gpt")
  cfg.algorithm, cfg.outer_overlap = "diloco", "eager"
  assert builders.spec_for_config(cfg)[0] == "diloco:H=10,overlap=eager"
  cfg.trickle_reduction = False
  assert builders.spec_for_config(cfg)[0] == "diloco:H=10"
  cfg = config_lib.base_config("gpt")
  cfg.comm_dtype, cfg.bucket_bytes = "bfloat16", 25 * 2**20
  cfg.devices_per_worker, cfg.worker_layout = 2, "data"
  assert builders.spec_for_config(cfg) == (
      "accum_adam:T=4,topology=one_peer_exp,comm_dtype=bfloat16,"
      "bucket_MiB=25", {"devices_per_worker": 2, "worker_layout": "data"})
  cfg.gossip_every = 4
  assert builders.spec_for_config(cfg)[0] == (
      "local_dsgd:H=4,topology=one_peer_exp,comm_dtype=bfloat16")
  # The local-update methods send comm_dtype too: their syncs cost half.
  for algo, spec in (("local_sgd", "local_sgd:H=10"),
                     ("diloco", "diloco:H=10"),
                     ("decentralized_diloco",
                      "diloco:H=10,topology=one_peer_exp")):
    cfg = config_lib.base_config("gpt")
    cfg.algorithm, cfg.comm_dtype = algo, "bfloat16"
    assert builders.spec_for_config(cfg)[0] == spec + ",comm_dtype=bfloat16"
    low = make_method(spec + ",comm_dtype=bfloat16", c)
    assert local_sync.message_bytes(low, w) == pytest.approx(
        local_sync.message_bytes(make_method(spec, c), w) / 2)


@pytest.mark.parametrize("spec, match", [
    ("accum_adam:H=3", "no parameter 'H'"),
    ("aer:comm_dtype=int8", "not a floating dtype"),
    ("aer:comm_dtype=>f4", "comm_dtype '>f4' is not in this machine's byte"),
    ("diloco:H=4,comm_dtype=float8_e4m3fn", "8-bit float.*compress=fp8"),
    ("all_reduce:comm_dtype=bfloat16", "no parameter 'comm_dtype'"),
    ("dadam:topology=hypercube", "not a topology"),
    ("aer:bucket_MiB=-1", "bucket_MiB"),
    ("accum_adam:T=0", "T="),
    # An alias is named as written; a digit that is not 0-9 is refused.
    ("accum_adam:accum_steps=0", r"'accum_adam:accum_steps=0': "
     r"accum_steps='0' must be an integer >= 1 \(T, accum_steps\)"),
    ("accum_adam:T=\u00b2", "T='\u00b2' must be an integer >= 1"),
    ("ring:workers_per_node=\u00b2", "workers_per_node='\u00b2' must be an "
     "integer dividing"),
    ("aer:comm_dtype", "not KEY=VALUE"),
])
def test_bad_specs_name_the_bad_part(spec, match):
  with pytest.raises(ValueError, match=match):
    make_method(spec, Cluster(16, 4))


def test_cli_prints_every_method_with_bytes_and_inner_collectives(capsys):
  assert cli.main([
      "predict", "--n-workers", "16", "--local-size", "4", "--steps", "40",
      "--devices-per-worker", "2", "--worker-layout", "data", "--methods",
      "all_reduce,aer,aer:comm_dtype=bfloat16,accum_adam:T=4,topology=aer,"
      "sgp,diloco:H=10,streaming_diloco:H=10,P=2,tau=1"]) == 0
  out = capsys.readouterr().out
  assert "n=16 workers of 2 devices (data)" in out
  for name in ("All-Reduce", "DAdam (AER)",
               "alternating_exp_ring:comm_dtype=bfloat16",
               "accum_adam:T=4,topology=alternating_exp_ring", "SGP (Exp)",
               "diloco:H=10", "streaming_diloco:H=10,P=2,tau=1"):
    assert any(line.strip().startswith(name) for line in out.splitlines()), \
        name
  assert "inside each worker (every method)" in out
  assert "recommendation:" in out
