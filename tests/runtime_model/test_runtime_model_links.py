"""Link model of decentral_jax.runtime_model: NIC ports and rails, flow caps,
efficiency, duplex, PCIe vs NVLink. Expected values are worked by hand
(message M = 260 MB, the float32 Transformer base of Figure 6)."""

from __future__ import annotations

import pytest

from decentral_jax import topology
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import parser as cli_parser
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.costs import group_round_cost
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import traffic

M = 260e6
PORT = 3.125e9  # 25 Gbit/s


def _cluster(**kw):
  base = dict(n_workers=16, local_size=4, intra_latency_s=0.0,
              intra_bandwidth_Bps=31.5e9, inter_latency_s=0.0,
              nic_bandwidth_Bps=PORT, multi_node="tree")
  base.update(kw)
  return Cluster(**base)


@pytest.mark.parametrize("nics, flows_per_port", [(1, 4), (2, 2), (4, 1),
                                                   (8, 0.5)])
def test_exp_crossing_round_spreads_over_the_rails(nics, flows_per_port):
  # XOR-4 round on 4 nodes x 4: every GPU exchanges M with the same GPU of
  # another node. With k ports, GPU j uses port j*k/4: 4/k flows per port
  # (8 ports: each GPU has two).
  c = _cluster(nics_per_node=nics)
  rnd = topology.make("one_peer_exp", 16, 4).rounds[2]
  t = round_cost(c, rnd).time(M)
  assert t == pytest.approx([flows_per_port * M / PORT] * 16)


def test_one_collective_uses_every_nic_unless_a_flow_is_capped():
  # All-Reduce over 4 nodes x 4 (tree): the node's flow carries 2*3/4 M.
  ib = _cluster(nics_per_node=2, intra_bandwidth_Bps=300e9,
                intra_link="nvlink")
  t_ib = all_reduce_cost(ib).time(M)[0]
  assert t_ib == pytest.approx(1.5 * M / (2 * PORT))  # both ports
  tcp = _cluster(nics_per_node=2, intra_bandwidth_Bps=300e9,
                 intra_link="nvlink", flow_bandwidth_Bps=PORT)
  assert all_reduce_cost(tcp).time(M)[0] == pytest.approx(
      1.5 * M / PORT)  # one TCP flow stays on one port


def test_efficiency_and_half_duplex_scale_the_nic_term():
  rnd = topology.make("one_peer_exp", 16, 4).rounds[2]
  base = 4 * M / PORT
  eff = _cluster(nic_efficiency=0.94)
  assert round_cost(eff, rnd).time(M)[0] == pytest.approx(base / 0.94)
  half = _cluster(full_duplex=False)
  assert round_cost(half, rnd).time(M)[0] == pytest.approx(2 * base)
  # Inside the node nothing changes: XOR-1 is an on-node pair exchange.
  on_node = topology.make("one_peer_exp", 16, 4).rounds[0]
  assert round_cost(half, on_node).time(M)[0] == pytest.approx(
      M / 31.5e9)


def test_pcie_link_carries_the_nic_share_nvlink_does_not():
  # Two-node mean of 8 workers (AER's inter round on 2 nodes x 4) with a
  # fast NIC: per byte of M a worker's link carries 2*3/4 in the node and,
  # on PCIe, its quarter of the node's flow 1 * M / 4 to the NIC.
  kw = dict(n_workers=8, nic_bandwidth_Bps=100e9, intra_bandwidth_Bps=15.75e9)
  groups = [tuple(range(8))]
  pcie = group_round_cost(_cluster(**kw), groups).time(M)[0]
  nvl = group_round_cost(_cluster(intra_link="nvlink", **kw),
                              groups).time(M)[0]
  assert pcie == pytest.approx(1.75 * M / 15.75e9)
  assert nvl == pytest.approx(1.5 * M / 15.75e9)
  # Bytes on the wire depend on the algorithm, not on the links.
  w = Workload(M / 4, 0.0, 0.0)
  a = traffic.bytes_per_iteration("aer", _cluster(**kw), w)
  b = traffic.bytes_per_iteration("aer", _cluster(intra_link="nvlink",
                                                  nics_per_node=4, **kw), w)
  assert a == b


@pytest.mark.parametrize("nics", [1, 2, 4])
def test_no_method_beats_the_node_capacity(nics):
  """Zero compute: time/iteration >= node bytes / (ports x rate x efficiency)."""
  for name in ("all_reduce", "one_peer_exp", "aer", "sgp", "diloco:H=2"):
    c = _cluster(n_workers=32, nics_per_node=nics, nic_efficiency=0.9,
                 intra_bandwidth_Bps=300e9, intra_link="nvlink")
    w = Workload(65e6, 0.0, 0.0)
    t = simulate(name, c, w, steps=64, warmup=8)
    node = traffic.bytes_per_iteration(name, c, w).node_bytes
    assert t >= node / (nics * PORT * 0.9) * (1 - 1e-9), (name, nics)


def test_cli_link_flags_reach_the_cluster():
  args = cli_parser.build_parser().parse_args([
      "predict", "--local-size", "4", "--nic-Gbps", "25", "--nics-per-node",
      "4", "--nic-efficiency", "0.94", "--half-duplex", "--intra-link",
      "nvlink", "--flow-Gbps", "20"])
  c = inputs.cluster_from_args(args, 8)
  assert (c.nics_per_node, c.nic_efficiency, c.full_duplex, c.intra_link) == (
      4, 0.94, False, "nvlink")
  assert c.flow_bandwidth_Bps == pytest.approx(2.5e9)
  # 4 ports x 3.125 GB/s x 0.94, halved (half duplex).
  assert c.nic_capacity_Bps() == pytest.approx(4 * PORT * 0.94 / 2)
  assert c.nic_capacity_Bps(rail=True) == pytest.approx(PORT * 0.94 / 2)


@pytest.mark.parametrize("make, field", [
    (lambda: _cluster(nics_per_node=0), "nics_per_node"),
    (lambda: _cluster(nic_efficiency=1.2), "nic_efficiency"),
    (lambda: _cluster(full_duplex="yes"), "full_duplex"),
    (lambda: _cluster(intra_link="infinity-fabric"), "intra_link"),
])
def test_bad_link_inputs_raise_naming_the_field(make, field):
  with pytest.raises(ValueError, match=field):
    make()
