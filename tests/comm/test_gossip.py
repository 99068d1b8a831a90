"""Gossip inside shard_map equals the dense matrix product W @ x."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax.comm import gossip
from decentral_jax import parallel
from decentral_jax import topology
from helpers import all_valid, local_size


def _mix_fn(topo, mesh, traced=True, comm_dtype=None):
  axis = parallel.worker_axis(mesh)

  def one(tree, step):
    return gossip.mix(tree, topo, step, axis, comm_dtype=comm_dtype)

  if traced:
    return jax.jit(parallel.per_worker(one, mesh, replicated_argnums=(1,)))
  return {r: jax.jit(parallel.per_worker(lambda t, r=r: one(t, r), mesh))
          for r in range(topo.period)}


def _data(n, seed=0):
  rng = np.random.default_rng(seed)
  return {"a": rng.normal(size=(n, 3, 2)).astype(np.float32),
          "b": rng.normal(size=(n,)).astype(np.float32)}


@pytest.mark.parametrize("name,n", [
    c if c[1] == 8 else pytest.param(*c, marks=pytest.mark.slow)
    for c in all_valid() if c[1] >= 3])
def test_mix_equals_dense_product(name, n):
  require_devices(n)
  topo = topology.make(name, n, local_size(name, n))
  mesh = parallel.make_mesh(n)
  x = _data(n)
  xs = parallel.shard(x, mesh)
  mix = _mix_fn(topo, mesh)
  for step in range(topo.period + 1):
    out = mix(xs, jnp.int32(step))
    w = topo.mixing_matrix(step)
    for k in x:
      ref = np.einsum("ij,j...->i...", w, x[k].astype(np.float64))
      np.testing.assert_allclose(np.asarray(out[k]), ref, rtol=1e-5, atol=1e-5)
      assert out[k].dtype == x[k].dtype and out[k].shape == x[k].shape


def test_static_step_compiles_only_that_round():
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)
  mesh = parallel.make_mesh(8)
  x = _data(8)
  xs = parallel.shard(x, mesh)
  fns = _mix_fn(topo, mesh, traced=False)
  for r, fn in fns.items():
    np.testing.assert_allclose(np.asarray(fn(xs)["a"]),
                               np.einsum("ij,j...->i...", topo.mixing_matrix(r),
                                         x["a"]), rtol=1e-6, atol=1e-6)
    hlo = fn.lower(xs).compile().as_text()
    assert " conditional(" not in hlo
    # Round r pairs j with j XOR 2^r: one permute per leaf, no other round's.
    partner = [(j, j ^ (1 << r)) for j in range(8)]
    assert {shape: [sorted(p) for p in perms] for shape, perms in
            _permute_pairs(hlo).items()} == {"f32[3,2]{1,0}": [partner],
                                             "f32[]": [partner]}


def test_direction_matters_for_exponential():
  # On n >= 3 the receive direction is observable: compare with W and W^T.
  require_devices(5)
  topo = topology.make("exponential", 5)
  mesh = parallel.make_mesh(5)
  x = {"a": np.arange(5, dtype=np.float32) ** 2}
  out = np.asarray(_mix_fn(topo, mesh)(parallel.shard(x, mesh), jnp.int32(0))["a"])
  w = topo.mixing_matrix(0)
  np.testing.assert_allclose(out, w @ x["a"], rtol=1e-6)
  assert not np.allclose(out, w.T @ x["a"])


def test_one_peer_exp_exact_average_sequence():
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)
  mesh = parallel.make_mesh(8)
  mix = _mix_fn(topo, mesh)
  x = parallel.shard({"v": jnp.array([0, 0, 0, 0, 0, 0, 0, 8], jnp.float32)}, mesh)
  expected = [[0, 0, 0, 0, 0, 0, 4, 4], [0, 0, 0, 0, 2, 2, 2, 2], [1.0] * 8]
  for step, exp in enumerate(expected):
    x = mix(x, jnp.int32(step))
    np.testing.assert_array_equal(np.asarray(x["v"]), np.array(exp, np.float32))


@pytest.mark.parametrize("node_aware", [False, True])
def test_aer_exact_mean_after_one_period(node_aware):
  require_devices(16)
  topo = topology.make("alternating_exp_ring", 16, 4)
  mesh = parallel.make_mesh(16, 4, node_aware=node_aware)
  x0 = np.random.default_rng(1).normal(size=(16, 5)).astype(np.float32)
  mix = _mix_fn(topo, mesh)
  x = parallel.shard({"v": x0}, mesh)
  for step in range(topo.period):
    x = mix(x, jnp.int32(step))
    ref = np.einsum("ij,jk->ik", topo.mixing_matrix(step), x0.astype(np.float64))
    x0 = ref
    np.testing.assert_allclose(np.asarray(x["v"]), ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(x["v"]),
                             np.broadcast_to(x0.mean(0), (16, 5)), atol=1e-5)


def _permute_pairs(hlo: str) -> dict[str, list[list[tuple[int, int]]]]:
  """The collective-permutes of compiled HLO text: result shape -> the
  ``(source, target)`` pairs of each one."""
  out = {}
  for line in hlo.splitlines():
    if " collective-permute(" not in line:
      continue
    shape = line.split("=", 1)[1].split()[0]
    pairs = line.split("source_target_pairs={{", 1)[1].split("}}", 1)[0]
    out.setdefault(shape, []).append(
        [tuple(int(v) for v in p.split(",")) for p in pairs.split("},{")])
  return out


def test_node_aware_rounds_use_local_pmean_and_one_node_permute():
  require_devices(16)
  topo = topology.make("aer", 16, 4)  # 4 nodes x 4
  mesh = parallel.make_mesh(16, 4, node_aware=True)
  xs = parallel.shard(_data(16), mesh)
  hlo = _mix_fn(topo, mesh, traced=False)[0].lower(xs).compile().as_text()
  # Round 0: nodes 0, 1 intra-node means; nodes 2, 3 one two-node mean. The
  # [3, 2] leaf is reduce-scattered over the 4 local devices (padded to 8),
  # each sends a 2-element shard to the same device of the partner node, then
  # all-gathers; the scalar leaf is small and goes whole.
  assert "reduce-scatter(" in hlo and "all-gather(" in hlo
  permutes = [l for l in hlo.splitlines() if "collective-permute" in l
              and "source_target_pairs" in l]
  pairs = ("source_target_pairs={{8,12},{12,8},{9,13},{13,9},{10,14},{14,10},"
           "{11,15},{15,11}}")
  assert len(permutes) == 2 and all(pairs in l for l in permutes), permutes
  assert sorted(l.split("=")[1].split()[0] for l in permutes) == ["f32[2]{0}", "f32[]"]
  # Flat realisation of the same round: a mean over a group of g workers
  # sent by ppermute needs g - 1 of them (each worker receives the other
  # g - 1 values, one per permute), the groups of 4 riding along in the
  # permutes of the group of 8: 7 per leaf, 14 for the 2 leaves, together
  # delivering every ordered pair within each group exactly once.
  flat = parallel.make_mesh(16)
  hlo_flat = _mix_fn(topo, flat, traced=False)[0].lower(
      parallel.shard(_data(16), flat)).compile().as_text()
  assert "all-reduce" not in hlo_flat
  groups = [range(0, 4), range(4, 8), range(8, 16)]
  expected = sorted((s, d) for g in groups for s in g for d in g if s != d)
  by_leaf = _permute_pairs(hlo_flat)
  assert sorted(by_leaf) == ["f32[3,2]{1,0}", "f32[]"]
  for shape, permutes in by_leaf.items():
    assert len(permutes) == 7, (shape, len(permutes))
    assert sorted(p for perm in permutes for p in perm) == expected, shape


def test_bfloat16_communication():
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)
  mesh = parallel.make_mesh(8)
  x = _data(8, seed=3)
  fn = _mix_fn(topo, mesh, traced=False, comm_dtype=jnp.bfloat16)[0]
  out = np.asarray(fn(parallel.shard(x, mesh))["a"])
  assert out.dtype == np.float32
  # Own half exact, received half rounded to bfloat16.
  recv = x["a"][np.arange(8) ^ 1]
  recv_bf16 = np.asarray(jnp.asarray(recv).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(out, 0.5 * x["a"] + 0.5 * recv_bf16, rtol=1e-6)
  assert not np.allclose(out, 0.5 * (x["a"] + recv), rtol=1e-7, atol=0)
  assert "bf16" in fn.lower(parallel.shard(x, mesh)).compile().as_text()


def test_mean_and_consensus_distance():
  require_devices(6)
  mesh = parallel.make_mesh(6)
  x = _data(6, seed=4)

  def one(tree):
    return gossip.mean(tree, "workers"), gossip.consensus_distance(tree, "workers")

  avg, dist = jax.jit(parallel.per_worker(one, mesh))(parallel.shard(x, mesh))
  for k in x:
    np.testing.assert_allclose(np.asarray(avg[k]),
                               np.broadcast_to(x[k].mean(0), x[k].shape), atol=1e-6)
  ref = sum(np.sum((v - v.mean(0)) ** 2) for v in x.values()) / 6
  np.testing.assert_allclose(np.asarray(dist), np.full(6, ref), rtol=1e-5)


def test_axis_size_mismatch_is_a_clear_error():
  require_devices(8)
  topo = topology.make("one_peer_exp", 4)
  mesh = parallel.make_mesh(8)
  fn = jax.jit(parallel.per_worker(lambda t: gossip.mix(t, topo, 0, "workers"), mesh))
  with pytest.raises(ValueError, match=r"n_workers=4 but the worker axis 'workers' has 8 workers"):
    fn(parallel.shard(_data(8), mesh))


def test_too_many_workers_for_devices():
  with pytest.raises(ValueError, match=r"xla_force_host_platform_device_count"):
    parallel.make_mesh(len(jax.devices()) + 1)


def test_per_worker_rejects_unstacked_arguments():
  require_devices(4)
  mesh = parallel.make_mesh(4)
  fn = parallel.per_worker(lambda t: t, mesh)
  with pytest.raises(ValueError, match=r"argument 0 leaf .*'w'.* shape \(3, 2\).*size 4"):
    fn({"w": jnp.zeros((3, 2))})


def test_non_float_leaves_and_comm_dtype_are_rejected():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  topo = topology.make("ring", 8)
  ints = parallel.shard({"i": jnp.arange(8, dtype=jnp.int32)}, mesh)
  fn = jax.jit(parallel.per_worker(lambda t: gossip.mix(t, topo, 0, "workers"), mesh))
  with pytest.raises(ValueError, match=r"leaf .*'i'.* int32.*floating-point"):
    fn(ints)
  bad = jax.jit(parallel.per_worker(
      lambda t: gossip.mix(t, topo, 0, "workers", comm_dtype=jnp.int8), mesh))
  with pytest.raises(ValueError, match=r"comm_dtype.*floating"):
    bad(parallel.shard(_data(8), mesh))


def test_one_worker_topology_on_a_larger_mesh_is_an_error():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  fn = jax.jit(parallel.per_worker(
      lambda t: gossip.mix(t, topology.make("ring", 1), 0, "workers"), mesh))
  with pytest.raises(ValueError, match=r"n_workers=1 but the worker axis"):
    fn(parallel.shard(_data(8), mesh))


def test_pmean_with_comm_dtype_keeps_own_term_exact():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  x = {"v": (np.arange(8) + 1000.3).astype(np.float32)}
  fn = jax.jit(parallel.per_worker(lambda t: gossip.mix(
      t, topology.make("complete", 8), 0, "workers", comm_dtype=jnp.bfloat16), mesh))
  out = np.asarray(fn(parallel.shard(x, mesh))["v"])
  sent = np.asarray(jnp.asarray(x["v"]).astype(jnp.bfloat16).astype(jnp.float32))
  # Others' values arrive rounded to bfloat16, each worker's own is exact.
  ref = (sent.sum() - sent + x["v"]) / 8
  np.testing.assert_allclose(out, ref, rtol=0, atol=0.02)
  assert np.abs(out - ref).max() < np.abs(sent.mean() - ref).max()


def test_shard_outputs_feed_back_without_recompiling():
  require_devices(4)
  mesh = parallel.make_mesh(4)
  topo = topology.make("ring", 4)
  step = jax.jit(parallel.per_worker(lambda t: gossip.mix(t, topo, 0, "workers"), mesh))
  x = parallel.replicate({"w": jnp.ones((3, 2)), "b": jnp.ones(())}, mesh)
  y = step(step(parallel.shard(_data(4), mesh)))
  x = step(step(x))
  assert step._cache_size() == 2  # one per input structure, none for reuse  # pylint: disable=protected-access
  del x, y


def _rounds_fn(topo, mesh, rounds):
  """``rounds`` gossip rounds in one program (a fori_loop over the step)."""
  axis = parallel.worker_axis(mesh)

  def one(x):
    return jax.lax.fori_loop(
        0, rounds, lambda k, y: gossip.mix(y, topo, k, axis), x)

  return jax.jit(parallel.per_worker(one, mesh))


# (topology, workers, workers per node, node-aware mesh)
_PRESERVE = [("complete", 6, 1, False), ("ring", 6, 1, False),
             ("static_ring", 6, 1, False), ("torus", 9, 1, False),
             ("one_peer_exp", 8, 1, False), ("exponential", 8, 1, False),
             ("alternating_exp_ring", 8, 2, False),
             ("alternating_exp_ring", 8, 2, True)]


@pytest.mark.parametrize("name,n,local,node_aware,dtype", [
    pytest.param(*c, d, id="-".join(map(str, c + (d,))),
                 marks=() if (c[0], d) == ("static_ring", "bfloat16")
                 else pytest.mark.slow)
    for d in ("bfloat16", "float16") for c in _PRESERVE])
def test_1000_rounds_preserve_the_average_in_16_bit(name, n, local,
                                                    node_aware, dtype):
  """The network average survives 1,000 rounds to the leaf's precision.

  Each round rounds every worker's value to the 16-bit dtype once, so the
  average may move by about one rounding per round before consensus and
  not at all after it; weights rounded to 16 bits (1/3 -> 0.333984) would
  drift the average by a constant factor every round instead (+3% in 100
  rounds of static_ring).
  """
  require_devices(n)
  topo = topology.make(name, n, local)
  mesh = parallel.make_mesh(n, local, node_aware=node_aware)
  rng = np.random.default_rng(1)
  x = {"w": (1.0 + rng.random((n, 64))).astype(dtype),
       "b": (1.0 + rng.random((n, 3))).astype(dtype)}
  out = _rounds_fn(topo, mesh, 1000)(parallel.shard(x, mesh))
  eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
  for k in x:
    before = np.asarray(x[k], np.float64).mean(axis=0)
    after = np.asarray(out[k], np.float64)
    assert out[k].dtype == jnp.dtype(dtype)
    # Consensus is reached, and the reached value is the starting average
    # (values lie in [1, 2): eps is one unit in the last place).
    np.testing.assert_allclose(after, np.broadcast_to(before, after.shape),
                               rtol=0, atol=4 * eps)


def test_every_reuses_a_branch_function_across_programs():
  """One branch function in two programs on vmapped workers (2 per device).

  ``lax.cond`` caches a branch's trace by function; that trace holds the
  worker slot of the vmap it was traced in, so a second program (another
  ``jax.jit`` of the same one-worker code, or a ``fori_loop`` body) that
  reused it failed with a leaked tracer. Values: the mean of 0..3 on the
  taken step, the worker's own value on the other.
  """
  require_devices(2)
  mesh = parallel.make_mesh(4, workers_per_device=2)
  axis = parallel.worker_axis(mesh)

  def sync(x):
    return gossip.mean(x, axis)

  def once(x, step):
    return gossip.every(2, step % 2 == 0, sync, lambda y: y, x)

  def twice(x, step):
    return once(once(x, step), step + 1)

  x = parallel.shard(np.arange(4, dtype=np.float32)[:, None], mesh)
  for fn, want in ((once, [1.5] * 4), (twice, [1.5] * 4)):
    got = jax.jit(parallel.per_worker(fn, mesh, replicated_argnums=(1,)))(
        x, jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(got)[:, 0], want)
  got = jax.jit(parallel.per_worker(once, mesh, replicated_argnums=(1,)))(
      x, jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(got)[:, 0], [0, 1, 2, 3])
