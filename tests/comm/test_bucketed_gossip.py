"""Bucketed gossip (``bucket_bytes``) is bit-identical to one collective per leaf.

Each case compiles one program that mixes the same tree with every bucket
size (one compile per topology, rounds chosen in-graph), so the whole file
stays fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import sync_args
from decentral_jax import analysis
from decentral_jax.comm import gossip
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax.optim import push_sum
from decentral_jax import topology

# 0: per leaf; 1: smaller than every (non-empty) leaf; 10**9: the whole tree.
SIZES = (0, 1, 40, 10**9)


def _tree(n, seed=0):
  """Mixed dtypes, a per-worker scalar, an empty leaf, sizes below and above
  the local axis size (node-aware rounds shard only leaves of >= L
  elements)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.normal(size=(n,) + s)
  return {"emb": f(33, 8).astype(np.float32), "w": f(8, 8).astype(np.float32),
          "b": f(8).astype(np.float32), "s": f().astype(np.float32),
          "one": f(1).astype(np.float32), "h": f(5).astype(jnp.bfloat16),
          "g": f(3, 3).astype(np.float16), "e": np.zeros((n, 0), np.float32)}


def _all_sizes_fn(topo, mesh, comm_dtype=None):
  axis = parallel.worker_axis(mesh)

  def one(tree, step):
    return tuple(gossip.mix(tree, topo, step, axis, comm_dtype=comm_dtype,
                            bucket_bytes=b) for b in SIZES)

  return jax.jit(parallel.per_worker(one, mesh, replicated_argnums=(1,)))


def _assert_bit_identical(outs, x):
  ref = outs[0]
  for size, out in zip(SIZES[1:], outs[1:]):
    for k in x:
      a, b = np.asarray(ref[k]), np.asarray(out[k])
      assert a.dtype == b.dtype == x[k].dtype and a.shape == b.shape == x[k].shape
      assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (size, k)


def _local(name):
  return 2 if name == "alternating_exp_ring" else 1


# (topology, workers per node, node-aware mesh, comm_dtype)
CASES = ([(name, _local(name), False, None) for name in topology.NAMES] + [
    ("torus", 1, False, jnp.bfloat16), ("static_ring", 1, False, jnp.bfloat16),
    ("complete", 1, False, jnp.bfloat16),
    ("alternating_exp_ring", 2, True, jnp.bfloat16),
    ("complete", 2, True, jnp.float16)])


@pytest.mark.parametrize("name,local,node_aware,comm_dtype", [
    c if c == ("one_peer_exp", 1, False, None)
    else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_bucketed_equals_per_leaf_bit_for_bit(name, local, node_aware,
                                              comm_dtype):
  require_devices(8)
  topo = topology.make(name, 8, local)
  mesh = parallel.make_mesh(8, local, node_aware=node_aware)
  x = _tree(8)
  xs = parallel.shard(x, mesh)
  fn = _all_sizes_fn(topo, mesh, comm_dtype)
  for step in range(topo.period):
    _assert_bit_identical(fn(xs, jnp.int32(step)), x)


@pytest.mark.slow
def test_mean_bucketed_equals_per_leaf():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  x = _tree(8, seed=2)

  def one(tree):
    return tuple(gossip.mean(tree, "workers", bucket_bytes=b) for b in SIZES)

  _assert_bit_identical(jax.jit(parallel.per_worker(one, mesh))(
      parallel.shard(x, mesh)), x)


def test_empty_tree_and_bad_bucket_bytes():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  topo = topology.make("ring", 8)
  fn = jax.jit(parallel.per_worker(
      lambda t: gossip.mix(t, topo, 0, "workers", bucket_bytes=10**9), mesh))
  assert fn({}) == {}
  for bad in (-1, 1.5, True, "25MB"):
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
      gossip.check_bucket_bytes(bad)
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
      optim.decentralized(optax.sgd(0.1), topo, bucket_bytes=bad)
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
      push_sum.sgp(0.1, topo, bucket_bytes=bad)
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
      optim.diloco(optax.sgd(0.1), 2, **sync_args(topology=topo,
          bucket_bytes=bad))
  with pytest.raises(ValueError, match="static_args"):
    optim.decentralized(optax.sgd(0.1), topo, bucket_bytes=jnp.int32(4))
  assert gossip.check_bucket_bytes(None) == gossip.DEFAULT_BUCKET_BYTES
  got = gossip.check_bucket_bytes(np.int64(4096))
  assert got == 4096 and type(got) is int  # pylint: disable=unidiomatic-typecheck


@pytest.mark.slow
def test_hlo_one_permute_per_bucket_same_bytes():
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)  # one permute term per round
  mesh = parallel.make_mesh(8)
  x = _tree(8)
  xs = parallel.shard(x, mesh)
  leaves = jax.tree.leaves(x)
  reports = {}
  for b in (0, 300, 10**9):
    fn = jax.jit(parallel.per_worker(
        lambda t, b=b: gossip.mix(t, topo, 0, "workers", bucket_bytes=b), mesh))
    reports[b] = analysis.communication(fn.lower(xs).compile())
  permutes = {b: [c for c in r.collectives if c.kind == "collective-permute"]
              for b, r in reports.items()}
  # Per leaf: one permute per non-empty leaf (XLA drops the empty one); one
  # bucket per dtype (f32, bf16, f16) with 10**9; with 300 bytes the f32
  # leaves (sorted keys) are b+e (32 B), emb (1056 B) and one+s+w (264 B),
  # plus bf16 and f16.
  assert len(permutes[0]) == sum(a.size > 0 for a in leaves) == 7
  assert len(permutes[10**9]) == 3
  assert len(permutes[300]) == 5
  assert all(len(r.collectives) == len(permutes[b])
             for b, r in reports.items())
  assert reports[0].max_bytes_per_step == reports[300].max_bytes_per_step \
      == reports[10**9].max_bytes_per_step > 0


def test_decentralized_optimizer_bucketed_equals_per_leaf():
  require_devices(8)
  topo = topology.make("static_ring", 8)  # weights 1/3: rounding shows
  mesh = parallel.make_mesh(8)
  x = _tree(8, seed=3)
  del x["h"], x["g"]  # optax.sgd on float32 leaves
  txs = [optim.decentralized(optax.sgd(0.1, momentum=0.9), topo,
                             bucket_bytes=b) for b in (0, 10**9)]

  def one(params, grads):
    outs = []
    for tx in txs:
      p, s = params, tx.init(params)
      for _ in range(2):
        u, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, u)
      outs.append(p)
    return tuple(outs)

  g = jax.tree.map(lambda a: np.cos(a).astype(a.dtype), x)
  per_leaf, bucketed = jax.jit(parallel.per_worker(one, mesh))(
      parallel.shard(x, mesh), parallel.shard(g, mesh))
  for k in x:
    a, b = np.asarray(per_leaf[k]), np.asarray(bucketed[k])
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), k
