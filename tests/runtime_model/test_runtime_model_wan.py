"""Wide-area links (datacenters) and the cluster and workload presets of the
runtime model. Every expected time is worked out by hand from the alpha-beta
formulas in docs/runtime_model.md ("Datacenters over a wide-area link")."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from decentral_jax import topology
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import parser as cli_parser
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import holdout
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import traffic

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime_model.md"
M = 1e9  # bytes
A_IN, A_NODE, A_WAN = 2e-6, 1e-5, 0.03  # latencies (s)
B_IN, B_NIC, B_WAN = 100e9, 12.5e9, 1.25e9  # bytes/s (NVLink, 100G, 10G)


def _wan(**kw):
  """16 workers: 2 datacenters x 2 nodes x 4 GPUs (NVLink, tree)."""
  base = dict(n_workers=16, local_size=4, intra_latency_s=A_IN,
              intra_bandwidth_Bps=B_IN, inter_latency_s=A_NODE,
              nic_bandwidth_Bps=B_NIC, multi_node="tree",
              intra_link="nvlink", datacenters=2, wan_latency_s=A_WAN,
              wan_bandwidth_Bps=B_WAN)
  base.update(kw)
  return Cluster(**base)


# Hierarchical All-Reduce of M over 2 datacenters: the group mean inside
# each datacenter (tree over 2 nodes of 4: 2*3 a_in + 2*1 a_node latency,
# M * max(2*3/4 / b_in, 2*1/2 / b_nic) = M / b_nic), then the 2-datacenter
# all-reduce (2*1 a_wan + 2*1/2 M / b_wan).
ALL_REDUCE_S = (2 * 3 * A_IN + 2 * 1 * A_NODE + M / B_NIC
                + 2 * A_WAN + M / B_WAN)


def test_hierarchical_all_reduce_over_two_datacenters():
  t = all_reduce_cost(_wan()).time(M)
  assert t == pytest.approx([ALL_REDUCE_S] * 16, rel=1e-12)
  assert ALL_REDUCE_S == pytest.approx(0.940032)
  # A flat ring over the 16 workers would pay 2*15 wide-area latencies and
  # move 2*15/16 M over the uplink: 2.4 s.
  assert 2 * 15 * A_WAN + 2 * 15 / 16 * M / B_WAN > 2.5 * ALL_REDUCE_S
  # Four datacenters of one node each: 2*3/4 M through each uplink, 2*3
  # wide-area latencies; inside a datacenter one node of 4 (ring).
  c4 = _wan(datacenters=4)
  want = 2 * 3 * A_IN + 2 * 3 / 4 * M / B_IN + 2 * 3 * A_WAN + 1.5 * M / B_WAN
  assert all_reduce_cost(c4).time(M)[0] == pytest.approx(want, rel=1e-12)


def test_one_datacenter_is_the_two_level_model():
  c1 = _wan(datacenters=1, wan_bandwidth_Bps=None, wan_latency_s=0.0)
  # Tree over 4 nodes of 4: 2*3 a_in + 2*3 a_node, M * 2*3/4 / b_nic.
  want = 2 * 3 * A_IN + 2 * 3 * A_NODE + 1.5 * M / B_NIC
  assert all_reduce_cost(c1).time(M)[0] == pytest.approx(want)
  same = Cluster(16, 4, A_IN, B_IN, A_NODE, B_NIC, multi_node="tree",
                      intra_link="nvlink")
  rnd = topology.make("one_peer_exp", 16, 4).rounds[3]
  np.testing.assert_array_equal(round_cost(c1, rnd).time(M),
                                round_cost(same, rnd).time(M))


def test_pairs_across_datacenters_share_the_uplink():
  # XOR-8 round of one_peer_exp: all 16 workers exchange M with a worker of
  # the other datacenter. Each node's NIC carries 4 flows (12.5/4 GB/s per
  # flow), each uplink 8 flows (1.25/8 GB/s): the uplink is the slowest
  # link of every pair. XOR-4 pairs nodes inside a datacenter: NIC only.
  c = _wan()
  rounds = topology.make("one_peer_exp", 16, 4).rounds
  assert round_cost(c, rounds[3]).time(M) == pytest.approx(
      [A_WAN + M / (B_WAN / 8)] * 16)
  assert round_cost(c, rounds[2]).time(M) == pytest.approx(
      [A_NODE + M / (B_NIC / 4)] * 16)
  t = traffic.round_bytes(c, rounds[3], M, dc=(dc := np.zeros(2)))
  assert dc == pytest.approx([8 * M, 8 * M])
  assert t[1] == pytest.approx([4 * M] * 4)


def test_aer_round_across_datacenters_is_hierarchical():
  # AER on 4 nodes: round 2 averages nodes 1 and 3 (datacenters 0 and 1)
  # and, inside each of nodes 0 and 2, their 4 workers.
  c = _wan()
  rnd = topology.make("aer", 16, 4).rounds[2]
  assert sorted(map(sorted, rnd.groups))[1] == [4, 5, 6, 7, 12, 13, 14, 15]
  t = round_cost(c, rnd).time(M)
  node_mean = 2 * 3 * A_IN + 1.5 * M / B_IN  # ring of 4 on NVLink
  across = node_mean + 2 * A_WAN + M / B_WAN  # + the 2-datacenter stage
  want = [node_mean] * 4 + [across] * 4 + [node_mean] * 4 + [across] * 4
  assert t == pytest.approx(want)


def test_permute_terms_across_datacenters():
  # static_ring: shift +1 and shift -1. Worker 7 sends to 8 (other
  # datacenter) in one term and receives from 8 in the other: a_wan + M /
  # b_wan twice. Worker 5 stays inside its node: a_in + M / b_in twice.
  c = _wan()
  rnd = topology.make("static_ring", 16, 4).rounds[0]
  assert len(rnd.terms) == 2
  t = round_cost(c, rnd).time(M)
  assert t[7] == pytest.approx(2 * (A_WAN + M / B_WAN))
  assert t[5] == pytest.approx(2 * (A_IN + M / B_IN))
  # 11 -> 12 crosses nodes inside datacenter 1: a_node + M / b_nic each way.
  assert t[11] == pytest.approx(2 * (A_NODE + M / B_NIC))


def _workload(n_params=M / 4, step_s=0.03, cv=0.0):
  # One message per sync (bucket larger than any message).
  return Workload(n_params, step_s / 3, 2 * step_s / 3, compute_cv=cv,
                       bucket_bytes=1e15)


def test_diloco_and_streaming_diloco_over_the_wan():
  c, w = _wan(), _workload()  # float32 theta: M bytes
  x = 0.03
  est = closed_form("diloco:H=10", c, w)
  assert est.iteration_s == pytest.approx(x + ALL_REDUCE_S / 10)
  assert simulate("diloco:H=10", c, w, steps=80, warmup=20) == (
      pytest.approx(x + ALL_REDUCE_S / 10))
  # Two fragments of M/2, blocking (tau = 0): two latencies per period.
  frag = (2 * 3 * A_IN + 2 * A_NODE + 2 * A_WAN
          + M / 2 / B_NIC + M / 2 / B_WAN)
  spec = "streaming_diloco:H=10,P=2,tau=0"
  assert closed_form(spec, c, w).iteration_s == pytest.approx(
      x + 2 * frag / 10)
  # Trickled eager: a slice of M/10 every step, longer than the compute.
  sl = 2 * 3 * A_IN + 2 * A_NODE + 2 * A_WAN + M / 10 / B_NIC + M / 10 / B_WAN
  assert sl > x
  for spec in ("diloco:H=10,overlap=eager", "diloco:H=10,overlap=delayed"):
    assert closed_form(spec, c, w).iteration_s == pytest.approx(sl)
    assert simulate(spec, c, w, steps=80, warmup=20) == (
        pytest.approx(sl))


def test_nothing_beats_the_bytes_through_the_busiest_uplink():
  # Zero compute: an iteration is never shorter than the bytes leaving the
  # busiest datacenter (counted by traffic, not by the cost code) over its
  # uplink.
  c = _wan()
  w = Workload(M / 4, 0.0, 0.0, bucket_bytes=25 * 2**20)
  for spec in ("all_reduce", "one_peer_exp", "aer", "complete", "ring",
               "aer:workers_per_node=datacenter", "diloco:H=4",
               "diloco:H=4,overlap=eager", "streaming_diloco:H=4,P=2,tau=1",
               "local_dsgd:H=2,topology=one_peer_exp", "static_ring",
               "dadam:topology=static_ring,compress=int8"):
    sent = traffic.bytes_per_iteration(spec, c, w)
    bound = sent.dc_bytes / B_WAN
    assert bound > 0, spec
    assert simulate(spec, c, w, steps=48, warmup=8) >= bound * (
        1 - 1e-9), spec
    assert closed_form(spec, c, w).iteration_s >= bound * (
        1 - 1e-9), spec
  # All-Reduce: 2*1/2 M of gradients leave each datacenter per iteration.
  assert traffic.bytes_per_iteration("all_reduce", c, w).dc_bytes == (
      pytest.approx(M))


def test_datacenter_aware_aer_keeps_rounds_inside_datacenters():
  # workers_per_node=datacenter: AER over 2 "nodes" of 8: round 0 averages
  # each datacenter, round 1 all 16 workers (hierarchically).
  c = _wan()
  m = make_method("aer:workers_per_node=datacenter", c)
  assert m.topology.local_size == 8 and m.topology.period == 2
  r0, r1 = (round_cost(c, r).time(M) for r in m.topology.rounds)
  inside = 2 * 3 * A_IN + 2 * A_NODE + M / B_NIC  # tree over 2 nodes of 4
  assert r0 == pytest.approx([inside] * 16)
  assert r1 == pytest.approx([ALL_REDUCE_S] * 16)
  with pytest.raises(ValueError, match="workers_per_node='5'"):
    make_method("aer:workers_per_node=5", c)


def test_bad_datacenter_fields_name_the_field():
  with pytest.raises(ValueError, match="datacenters=3"):
    _wan(datacenters=3)
  with pytest.raises(ValueError, match="wan_bandwidth_Bps"):
    _wan(wan_bandwidth_Bps=None)
  with pytest.raises(ValueError, match="wan_latency_s"):
    _wan(wan_latency_s=-1.0)


def test_cli_converts_the_wan_flags():
  args = cli_parser.build_parser().parse_args([
      "predict", "--local-size", "4", "--datacenters", "2", "--wan-Gbps",
      "10", "--wan-latency-ms", "30", "--codec-GBps", "50"])
  c = inputs.cluster_from_args(args, 16)
  assert (c.datacenters, c.dc_size) == (2, 8)
  assert c.wan_bandwidth_Bps == pytest.approx(1.25e9)
  assert c.wan_latency_s == pytest.approx(0.03)
  assert c.codec_Bps == pytest.approx(50e9)
  assert cli.main(["predict", "--n-workers", "12", "--local-size", "4",
                   "--datacenters", "2"]) == 2


# --- presets -----------------------------------------------------------------


def test_preset_hardware_matches_the_published_numbers():
  c = presets.cluster("h100_ib", 32)
  # 400 Gbit/s per GPU = 50 GB/s, 8 ports per node; NVLink 4: 450 GB/s.
  assert (c.local_size, c.nics_per_node, c.n_nodes) == (8, 8, 4)
  assert c.nic_bandwidth_Bps == pytest.approx(50e9)
  assert c.intra_bandwidth_Bps == pytest.approx(450e9)
  assert c.intra_link == "nvlink" and c.datacenters == 1
  one = presets.cluster("h100_node", 8)
  assert (one.n_nodes, one.local_size) == (1, 8)
  with pytest.raises(ValueError, match="at most 8"):
    presets.cluster("h100_node", 16)
  for name, d in (("cross_region_2dc", 2), ("cross_region_4dc", 4)):
    x = presets.cluster(name, 64)
    assert (x.datacenters, x.local_size, x.nic_bandwidth_Bps) == (
        d, 8, pytest.approx(50e9))
    assert x.wan_bandwidth_Bps == pytest.approx(10e9 / 8)
    assert x.wan_latency_s == pytest.approx(0.030)
  with pytest.raises(ValueError, match="multiple of 32"):
    presets.cluster("cross_region_4dc", 48)
  # Figure 6's A100: the in-sample fit of the leave-one-cluster-out module.
  c, w = presets.setup("A100", 16)
  fit = holdout.INSAMPLE["A100"]
  assert c.nics_per_node == fit["nics_per_node"]
  assert w.compute_mean_s == pytest.approx(fit["a_s"] + fit["b_s"] / 16)


def test_workload_presets():
  w = presets.workload("gpt2_small")
  assert w.param_count == 124_439_808
  # 6 N FLOPs per token, 16 x 1024 tokens, 40% of 989.4 TFLOP/s.
  step = 6 * 124_439_808 * 16384 / (0.4 * 989.4e12)
  assert step == pytest.approx(0.0309, abs=1e-4)
  assert (w.forward_s, w.backward_s) == pytest.approx((step / 3,
                                                       2 * step / 3))
  w = presets.workload("1b")
  assert (w.param_count, w.compute_mean_s) == (1e9, pytest.approx(0.1))


def test_every_preset_is_documented_with_its_sources():
  text = DOCS.read_text()
  section = text[text.index("## Presets"):]
  section = section[:section.index("\n## ", 4)]
  for name in (*presets.CLUSTERS, *presets.WORKLOADS):
    rows = [l for l in section.splitlines() if l.startswith(f"| `{name}`")]
    assert len(rows) == 1, name
    cells = [x.strip() for x in rows[0].split("|")]
    assert all(cells[2:-1]), (name, cells)  # what, sources, confidence


def _recommendation(out: str) -> str:
  line = re.search(r"recommendation: (.*)", out).group(1)
  return line.split(": ")[0] if "ms/iteration" in line else "All-Reduce"


def test_predict_presets_answer_differs_across_regimes(capsys):
  methods = "all_reduce,aer,diloco:H=10,streaming_diloco:H=10,P=2,tau=0"
  answers = {}
  for preset in ("h100_ib", "cross_region_2dc"):
    assert cli.main(["predict", "--preset", preset, "--workload", "1b",
                     "--n-workers", "16", "--steps", "40", "--methods",
                     methods]) == 0
    out = capsys.readouterr().out
    answers[preset] = _recommendation(out)
  assert "2 datacenters x 1 node x 8, wide-area 10 Gbit/s, 30 ms" in out
  assert "WAN MB/it" in out
  assert answers["h100_ib"] != answers["cross_region_2dc"], answers
  # A flag given with a preset overrides its field.
  assert cli.main(["predict", "--preset", "cross_region_2dc", "--workload",
                   "1b", "--n-workers", "16", "--steps", "20",
                   "--wan-Gbps", "100", "--methods", "all_reduce"]) == 0
  assert "wide-area 100 Gbit/s" in capsys.readouterr().out


def test_cluster_files_may_describe_datacenters(tmp_path, capsys):
  from decentral_jax.runtime_model import cluster_file
  path = str(tmp_path / "wan.json")
  cluster_file.write(path, {"cluster": dataclasses.asdict(_wan()),
                            "workload": None, "measurements": {},
                            "meta": {}})
  assert cluster_file.cluster(cluster_file.read(path)) == _wan()
  assert cli.main(["predict", "--cluster", path, "--steps", "20",
                   "--methods", "all_reduce"]) == 0
  assert "2 datacenters x 2 nodes x 4, wide-area 10 Gbit/s, 30 ms" in (
      capsys.readouterr().out)
  bad = str(tmp_path / "bad.json")
  cluster_file.write(bad, {"cluster": dict(dataclasses.asdict(_wan()),
                                           wan_jitter_s=0.001),
                           "workload": None, "measurements": {}, "meta": {}})
  with pytest.raises(ValueError, match="unknown .'wan_jitter_s'"):
    cluster_file.read(bad)
