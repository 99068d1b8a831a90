"""How many collectives truly run at once (runtime_model.links): the overlap
limit read off the cluster description. Expected values are worked by hand
from the links each worker's collectives use (module docstring of
decentral_jax.runtime_model.links): NVLink ("intra") and the rail's NICs
("nic") are separate; PCIe carries both; buckets of one collective class
always share."""

from __future__ import annotations

import pytest

from decentral_jax import topology
from decentral_jax.runtime_model import links
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.topology.rounds import Round


def _nvlink(n=16, local=8, nics=8):
  return Cluster(n_workers=n, local_size=local, intra_link="nvlink",
                 nics_per_node=nics, intra_bandwidth_Bps=450e9,
                 nic_bandwidth_Bps=50e9)


def _pairs(n, shift):
  """Round of pairs ``i <-> i + shift`` (groups of 2)."""
  return Round(groups=[(i, i + shift) for i in range(n)
                       if (i // shift) % 2 == 0])


def test_one_pcie_link_runs_one_collective_at_a_time():
  # A40 preset (4 per node on PCIe, one 25 Gbit/s NIC): intra-node and NIC
  # traffic both cross the GPU's PCIe link, so even a round whose terms go
  # both inside and across nodes, or fsdp beside it, is serial.
  c = presets.cluster("A40", 8)
  rounds = topology.make("exponential", 8).distinct_rounds
  assert [links.parallel_collectives(c, r) for r in rounds] == [1]
  assert links.parallel_collectives(c, rounds[0], devices_per_worker=2) == 1
  for r in topology.make("one_peer_exp", 8).distinct_rounds:
    assert links.parallel_collectives(c, r, devices_per_worker=2) == 1
  classes = links.worker_link_classes(c, _pairs(8, 4))
  assert classes[0] == [frozenset({"pcie"})]


def test_one_node_of_h100_is_all_nvlink():
  # h100_node: every peer on the NVSwitch; gossip and fsdp share NVLink.
  c = presets.cluster("h100_node", 8)
  for r in topology.make("one_peer_exp", 8).distinct_rounds:
    assert links.parallel_collectives(c, r) == 1
    assert links.parallel_collectives(c, r, devices_per_worker=2) == 1


def test_h100_ib_gossip_across_nodes_beside_fsdp_on_nvlink():
  c = presets.cluster("h100_ib", 16)
  across = _pairs(16, 8)  # i <-> i+8: every pair crosses the two nodes
  classes = links.worker_link_classes(c, across, devices_per_worker=2)
  assert classes[3] == [frozenset({"nic"}), frozenset({"intra"})]
  assert links.parallel_collectives(c, across) == 1  # buckets share a NIC
  assert links.parallel_collectives(c, across, devices_per_worker=2) == 2
  # Pairs inside a node: the gossip is on NVLink with the fsdp collectives.
  assert links.parallel_collectives(c, _pairs(16, 1),
                                    devices_per_worker=2) == 1
  # An All-Reduce over everyone uses both links: nothing beside it.
  assert links.parallel_collectives(c, across, devices_per_worker=2,
                                    all_reduce=True) == 1


def test_group_means_over_nodes_of_several_members_use_both_links():
  # Groups {i, i+1, i+8, i+9}: two members per node in two nodes (a tree
  # reduces inside the node, then across), so fsdp has no link of its own.
  c = _nvlink()
  rnd = Round(groups=[(i, i + 1, i + 8, i + 9) for i in range(0, 8, 2)])
  assert links.worker_link_classes(c, rnd)[0] == [frozenset({"intra",
                                                             "nic"})]
  assert links.parallel_collectives(c, rnd, devices_per_worker=4) == 1


def test_a_term_is_one_collective_with_its_send_and_receive():
  # Ring shift +1 on 2 nodes of 8 as ppermute terms: worker 0 sends to 1
  # (NVLink) but receives from 15 (NIC); worker 3 uses NVLink only. Plus
  # the shift +8 term (NIC only): worker 3 can run the two terms at once,
  # worker 0 cannot (its shift +1 term uses both links), and the program is
  # the same on both: 1.
  c = _nvlink()
  rnd = topology.make("exponential", 16, 8).distinct_rounds[0]
  shifts = sorted({(d - s) % 16 for t in rnd.terms for s, d in t.perm})
  assert shifts == [1, 2, 4, 8]
  classes = links.worker_link_classes(c, rnd)
  assert frozenset({"intra", "nic"}) in classes[0]
  assert frozenset({"intra"}) in classes[3]
  assert links.parallel_collectives(c, rnd) == 1
  # fsdp on NVLink changes nothing: worker 0's shift +1 term still shares.
  assert links.parallel_collectives(c, rnd, devices_per_worker=2) == 1
  # Only the shift +8 term (as compressed gossip of the pairs i <-> i+8
  # would send it) beside fsdp: 2.
  assert links.parallel_collectives(c, _pairs(16, 8), permutes=True,
                                    devices_per_worker=2) == 2


def test_one_nic_per_node_serialises_the_gossip_not_nvlink():
  # One NIC for 8 NVLink GPUs: the 8 flows of pairs i <-> i+8 share it,
  # and each worker's buckets are serial on it (1); fsdp's collectives are
  # on NVLink, not on the NIC, so they can still run beside the gossip.
  c = _nvlink(nics=1)
  assert c.rails == 1
  assert links.parallel_collectives(c, _pairs(16, 8)) == 1
  assert links.parallel_collectives(c, _pairs(16, 8),
                                    devices_per_worker=8) == 2


def test_several_nics_on_a_rail_still_serve_one_flow_at_a_time():
  # Two NICs per GPU (16 per node of 8): one flow already spreads over both
  # (costs.Cluster.inter_flow_Bps), so two buckets still share them.
  c = _nvlink(nics=16)
  assert links.parallel_collectives(c, _pairs(16, 8)) == 1


def test_nothing_sent_and_compressed_partitions():
  c = _nvlink()
  alone = Round(groups=[(i,) for i in range(16)])
  assert links.worker_link_classes(c, alone) == [[] for _ in range(16)]
  assert links.parallel_collectives(c, alone) == 1
  assert links.parallel_collectives(c, None, devices_per_worker=2) == 1
  # Compressed gossip sends a partition's ppermute terms: {i, i+8} is one
  # term across the nodes, as the group mean.
  assert links.worker_link_classes(c, _pairs(16, 8), permutes=True)[0] == [
      frozenset({"nic"})]


def test_bad_inputs_name_the_argument():
  c = _nvlink()
  with pytest.raises(ValueError, match="round has 8 workers but the "
                     "cluster has n_workers=16"):
    links.parallel_collectives(c, _pairs(8, 4))
  with pytest.raises(ValueError, match="devices_per_worker must be >= 1"):
    links.parallel_collectives(c, None, devices_per_worker=0)


def test_workers_of_two_devices_sit_four_to_a_node():
  # 8 workers of 2 H100s on 2 nodes of 8 GPUs: workers 0-3 on node 0 and
  # 4-7 on node 1, each with 8 / 2 = 4 NICs per node. One-peer rounds of
  # offsets 1, 2, 4: only offset 4 crosses the nodes (gossip on the NIC
  # beside fsdp on NVLink: 2); offsets 1 and 2 share NVLink with fsdp (1).
  c = presets.device_slice("h100_ib", 8, 2)
  assert (c.n_workers, c.local_size, c.nics_per_node) == (8, 4, 4)
  rounds = topology.make("one_peer_exp", 8).distinct_rounds
  assert [links.parallel_collectives(c, r, devices_per_worker=2)
          for r in rounds] == [1, 1, 2]
  # One GPU per worker would put all 8 workers on one node: all NVLink.
  assert [links.parallel_collectives(presets.cluster("h100_ib", 8), r,
                                     devices_per_worker=2)
          for r in rounds] == [1, 1, 1]
  # Fits one node: every worker on it; one device per worker: the preset.
  assert presets.device_slice("h100_node", 4, 2).local_size == 4
  assert presets.device_slice("h100_ib", 16, 1) == presets.cluster(
      "h100_ib", 16)


@pytest.mark.parametrize("name, n, d, says", [
    ("A40", 4, 2, "preset 'A40' has no per-device description"),
    ("h100_ib", 8, 0, "devices_per_worker must be >= 1"),
    ("h100_node", 8, 2, "has 8 GPUs; use at most 8 workers"),
])
def test_device_slice_refuses_by_name(name, n, d, says):
  with pytest.raises(ValueError, match=says):
    presets.device_slice(name, n, d)
