"""Every key of a gossip or All-Reduce spec changes the price, or is refused.

For each method of :mod:`decentral_jax.runtime_model.specs` and each key it
declares (``spec_keys``), in each context the key can meet (a plain spec, a
node-aware topology, compressed and pipelined gossip), the spec with the key
(a value other than its default) is priced against the spec without it: the
prices (simulated and closed-form seconds per iteration, bytes sent) must
differ, or the spec must be refused naming the key. The one documented
exception is AccumAdam's ``T``: accumulation is local, so it names the
optimizer run and costs what DAdam costs.
"""

from __future__ import annotations

import numpy as np
import pytest

from decentral_jax import topology
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import specs
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.workload import Workload

# 32 workers, 8 per node, two datacenters of 16: every group size (4, 8,
# datacenter = 16) is a distinct aer; 100 MB of float32 parameters, 4
# buckets of the default 25 MiB, 10 of 10 MiB.
C = Cluster(32, 8, 5e-6, 31.5e9, 30e-6, 3.125e9, multi_node="tree",
            datacenters=2, wan_bandwidth_Bps=1e9, wan_latency_s=5e-3)
W = Workload(25e6, 0.02, 0.04)
# Uncompressed pipelined gossip differs from plain gossip where the round
# must end inside its step (in_flight.py): the default model already lets
# the round run on through the next step.
W_IN_FLIGHT = Workload(25e6, 0.02, 0.04, gossip_in_flight=(1.0, 1.0))
VALUES = {"comm_dtype": "bfloat16", "bucket_MiB": "10", "topology": "ring",
          "T": "2", "compress": "int8", "block": "64", "fraction": "0.1",
          "workers_per_node": "4", "pipelined": "1"}
# A key that needs another to mean anything is priced with it on both sides.
NEEDS = {"block": "compress=int8", "fraction": "compress=topk"}


def _names():
  return (*specs.ALL_REDUCE[:1], "sgp", *topology.NAMES, "dadam",
          "accum_adam", specs.GRADIENT_TRACKING)


def _contexts(name: str, key: str):
  """The settings the key is tried beside (besides the ones it needs)."""
  keys = specs.spec_keys(name)
  out = [[]]
  if "topology" in keys and key != "topology":
    out.append(["topology=alternating_exp_ring"])
  if "compress" in keys and key not in ("compress", "pipelined"):
    out.append(["compress=int8"])
    if "pipelined" in keys:
      out.append(["compress=int8", "pipelined=1"])
  if "pipelined" in keys and key == "pipelined":
    out.append(["compress=int8"])
  return out


def _cases():
  for name in _names():
    for key in specs.spec_keys(name):
      for ctx in _contexts(name, key):
        need = NEEDS.get(key)
        if need and not any(x.startswith("compress=") for x in ctx):
          ctx = [need, *ctx]
        if key == "fraction":  # top-k's share: with compress=topk only
          ctx = ["compress=topk" if x.startswith("compress=") else x
                 for x in ctx]
        yield name, key, ctx


def _spec(name: str, parts) -> str:
  return name + (":" + ",".join(parts) if parts else "")


def _price(spec: str, w: Workload):
  m = specs.make_method(spec, C)
  p = recommend.predict(spec, m, C, w, steps=16, warmup=4, seed=0)
  s = p.sent
  return np.array([p.simulated_s, p.estimate.iteration_s, s.worker_bytes,
                   s.node_bytes, s.dc_bytes])


CASES = list(_cases())


@pytest.mark.parametrize("name, key, base", CASES,
                         ids=[f"{n}:{k}[{','.join(b)}]" for n, k, b in CASES])
def test_each_spec_key_changes_the_price_or_is_refused(name, key, base):
  with_key = _spec(name, [*base, f"{key}={VALUES[key]}"])
  w = W_IN_FLIGHT if key == "pipelined" else W
  try:
    priced = _price(with_key, w)
  except ValueError as e:
    said = str(e)
    assert (f"{key} has no effect" in said or key in ("comm_dtype", "compress")
            and "give compress or comm_dtype, not both" in said), said
    return
  plain = _price(_spec(name, base), w)
  if key == "T":  # documented: local accumulation, no bytes, no time
    np.testing.assert_array_equal(priced, plain)
    return
  assert not np.array_equal(priced, plain), (with_key, priced)


def test_the_node_aware_topologies_are_the_ones_whose_matrices_read_the_group():
  """:data:`specs.NODE_AWARE` checked against the mixing matrices: built at
  16 workers with 4 and with 2 workers per node, a topology's matrices
  differ exactly when it is node-aware."""
  for name in topology.NAMES:
    a, b = (topology.make(name, 16, g) for g in (4, 2))
    same = a.period == b.period and all(
        np.array_equal(a.mixing_matrix(k), b.mixing_matrix(k))
        for k in range(a.period))
    assert same == (name not in specs.NODE_AWARE), name


@pytest.mark.parametrize("spec, words", [
    ("sgp:bucket_MiB=1", "bucket_MiB has no effect here: a blocking gossip"),
    ("dadam:compress=int8,bucket_MiB=1", "bucket_MiB has no effect here"),
    ("ring:workers_per_node=4", "workers_per_node has no effect on topology "
     "'ring'"),
    ("dadam:topology=ring,workers_per_node=datacenter",
     "drop workers_per_node or use topology=aer"),
    ("gradient_tracking:topology=one_peer_exp,workers_per_node=4",
     "workers_per_node has no effect on topology 'one_peer_exp'")])
def test_a_key_that_reads_nothing_is_named_with_the_fix(spec, words):
  with pytest.raises(ValueError) as e:
    specs.make_method(spec, C)
  assert str(e.value).startswith(repr(spec) + ": "), str(e.value)
  assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_unknown_key_lists_only_the_keys_the_method_reads():
  # sgp blocks: it reads comm_dtype and never bucket_MiB (refused with its
  # reason above), so an unknown key's error lists comm_dtype alone.
  with pytest.raises(ValueError) as e:
    specs.make_method("sgp:compress=int8", C)
  assert str(e.value).endswith(
      "sgp has no parameter 'compress'; its parameters are "
      "comm_dtype=<dtype, e.g. bfloat16>."), str(e.value)
  with pytest.raises(ValueError) as e:
    specs.make_method("all_reduce:comm_dtype=bfloat16", C)
  assert str(e.value).endswith(
      "its parameters are bucket_MiB=<MiB in (0, 1e9]>."), str(e.value)
