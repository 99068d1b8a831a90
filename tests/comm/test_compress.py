"""Compressed communication: formats against NumPy references, error feedback,
CHOCO-gossip's worked example and exact mean, bytes read from the HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import analysis
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax import wire_format
from decentral_jax.comm import compress
from decentral_jax.comm import compressed_mean
from decentral_jax.comm import gossip
from decentral_jax.optim import choco

SCALED = ("int8", "fp8", "int4", "fp4")


def _comp(fmt, block, fraction):
  """A compressor; ``fraction`` is given to ``topk`` only (the others refuse it)."""
  return compress.Compressor(fmt, block,
                             fraction if fmt == "topk" else None)


def _np_blocks(v, block):
  flat = np.asarray(v, np.float64).reshape(-1)
  pad = (-flat.size) % block
  return np.concatenate([flat, np.zeros(pad)]).reshape(-1, block)


def _np_int_codes(v, block, qmax):
  """Independent int8/int4 reference: scale = blockmax / qmax, round half even."""
  b = _np_blocks(v, block).astype(np.float32)
  amax = np.abs(b).max(axis=1)
  scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1))
  return np.clip(np.round(b / scale[:, None]), -qmax, qmax), scale


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_integer_formats_match_a_numpy_reference(fmt, qmax):
  v = np.random.default_rng(0).normal(size=(5, 77)).astype(np.float32)
  c = compress.Compressor(fmt, block=32)
  p = c.encode(jnp.asarray(v))
  codes, scale = _np_int_codes(v, 32, qmax)
  np.testing.assert_allclose(np.asarray(p["scales"]), scale, rtol=2e-7)
  got_codes = np.asarray(p["codes"]).astype(np.int64)
  if fmt == "int4":  # two codes per byte, low nibble first, offset 8
    got_codes = np.stack([got_codes & 15, got_codes >> 4], -1).reshape(
        codes.shape) - 8
  np.testing.assert_array_equal(got_codes, codes)
  ref = (codes * scale[:, None]).reshape(-1)[:v.size].reshape(v.shape)
  np.testing.assert_allclose(np.asarray(c.roundtrip(jnp.asarray(v))), ref,
                             rtol=3e-7)


def test_int8_codes_by_hand():
  # Block [1, -0.5, 0.25, 0]: scale 1/127, codes 127, -64 (-63.5 to even), 32.
  p = compress.Compressor("int8", block=4).encode(
      jnp.asarray([1.0, -0.5, 0.25, 0.0]))
  assert p["codes"].dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(p["codes"]), [[127, -64, 32, 0]])
  np.testing.assert_allclose(np.asarray(p["scales"]), [1 / 127], rtol=1e-7)


def test_fp4_rounds_to_the_e2m1_grid_by_hand():
  # Scale 6/6 = 1: 6 and -3 are on the grid, 0.75 is a tie (lower kept),
  # 0.2 rounds to 0, 2.4 to 2, -5.2 to -6 (nearer than -4).
  v = jnp.asarray([6.0, -3.0, 0.75, 0.2, 2.4, -5.2])
  got = compress.Compressor("fp4", block=6).roundtrip(v)
  np.testing.assert_array_equal(np.asarray(got), [6, -3, 0.5, 0, 2, -6])
  p = compress.Compressor("fp4", block=6).encode(v)
  assert p["codes"].dtype == jnp.uint8 and p["codes"].shape == (1, 3)


def test_fp8_is_float8_e4m3_of_the_scaled_value():
  v = np.random.default_rng(1).normal(size=(64,)).astype(np.float32)
  got = np.asarray(compress.Compressor("fp8", block=64).roundtrip(jnp.asarray(v)))
  scale = np.float32(np.abs(v).max() / 448)
  ref = (v / scale).astype(jnp.float8_e4m3fn).astype(np.float32) * scale
  np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in SCALED])
def test_roundtrip_error_within_the_format_bound(fmt):
  c = compress.Compressor(fmt, block=16)
  v = np.random.default_rng(2).standard_t(3, size=(1000,)).astype(np.float32)
  got = np.asarray(c.roundtrip(jnp.asarray(v)), np.float64)
  blockmax = np.repeat(np.abs(_np_blocks(v, 16)).max(axis=1), 16)[:v.size]
  err = np.abs(got - v) / blockmax
  assert err.max() <= compress.relative_error_bound(c)
  assert err.max() > 0.3 * compress.relative_error_bound(c)  # bound not loose


def test_topk_keeps_the_largest_magnitudes_of_each_chunk():
  v = jnp.asarray([0.1, -5.0, 2.0, 0.3, 4.0, -0.2, 0.0, 1.0])
  got = compress.Compressor("topk", block=4, fraction=0.5).roundtrip(v)
  np.testing.assert_array_equal(np.asarray(got),
                                [0, -5, 2, 0, 4, 0, 0, 1])


@pytest.mark.slow
def test_zeros_empty_and_odd_shapes_roundtrip():
  for fmt in wire_format.FORMATS:
    c = _comp(fmt, 4, 0.5)
    for v in (jnp.zeros((3, 3)), jnp.zeros((0,)), jnp.ones((5,))):
      got = c.roundtrip(v)
      assert got.shape == v.shape and got.dtype == v.dtype
    np.testing.assert_array_equal(np.asarray(c.roundtrip(jnp.zeros((3, 3)))),
                                  0)


def test_payload_bytes_by_hand():
  n = 1000  # 4 blocks of 256 (the last padded)
  assert compress.Compressor("int8").payload_bytes(n) == 4 * (256 + 4)
  assert compress.Compressor("fp4").payload_bytes(n) == 4 * (128 + 4)
  assert compress.Compressor("none").payload_bytes(n, 2) == 2000
  # top-k: 4 chunks of 256 keep 3 (1%, rounded) values + int16 indices.
  assert compress.Compressor("topk").payload_bytes(n) == 4 * 3 * (4 + 2)


def test_bad_arguments_name_the_argument():
  with pytest.raises(ValueError, match="format"):
    compress.Compressor("int3")
  with pytest.raises(ValueError, match="block"):
    compress.Compressor("int8", block=1.5)
  with pytest.raises(ValueError, match="even"):
    compress.Compressor("int4", block=5)
  with pytest.raises(ValueError, match="fraction"):
    compress.Compressor("topk", fraction=0.0)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("int8", "int4", "topk")])
def test_error_feedback_tracks_the_cumulative_sum(fmt):
  c = _comp(fmt, 8, 0.25)
  rng = np.random.default_rng(3)
  e = jnp.zeros((40,))
  total_v = np.zeros(40)
  total_sent = np.zeros(40)
  for _ in range(50):
    v = rng.normal(size=40).astype(np.float32)
    _, sent, e = compress.compress_with_feedback(c, jnp.asarray(v), e)
    total_v += v
    total_sent += np.asarray(sent, np.float64)
  # sum(v) - sum(sent) is exactly the residual e.
  np.testing.assert_allclose(total_v - total_sent, np.asarray(e), atol=1e-4)
  if fmt != "topk":  # within one quantization step of the last message
    bound = compress.relative_error_bound(c)
    assert np.abs(np.asarray(e)).max() <= bound * (np.abs(total_v).max() + 10)


@pytest.mark.parametrize("v_dtype,e_dtype", [
    ("float32", "float32"), ("bfloat16", "float32"), ("float16", "float32"),
    ("float32", "bfloat16"), ("float16", "bfloat16")])
def test_error_feedback_keeps_v_and_residual_dtypes(v_dtype, e_dtype):
  # sent is in v's dtype, the residual in error's (a fori_loop carry), for
  # residuals kept in another float dtype too; values against NumPy.
  c = compress.Compressor("int8", block=4)
  rng = np.random.default_rng(5)
  v = rng.normal(size=7).astype(v_dtype)
  e = (0.01 * rng.normal(size=7)).astype(e_dtype)
  _, sent, new_e = compress.compress_with_feedback(c, jnp.asarray(v),
                                                   jnp.asarray(e))
  assert (sent.dtype, new_e.dtype) == (np.dtype(v_dtype), np.dtype(e_dtype))
  target = v.astype(np.float32) + e.astype(np.float32)  # promoted: float32
  codes, scale = _np_int_codes(target, 4, 127)
  ref = (codes * scale[:, None]).reshape(-1)[:7].astype(np.float32)
  ref_sent = ref.astype(v_dtype)
  np.testing.assert_array_equal(np.asarray(sent), ref_sent)
  np.testing.assert_array_equal(
      np.asarray(new_e),
      (target - ref_sent.astype(np.float32)).astype(e_dtype))
  # the residual's dtype holds from step to step
  _, _, again = compress.compress_with_feedback(c, jnp.asarray(v), new_e)
  assert again.dtype == np.dtype(e_dtype)


def _ring4_example():
  topo = topology.make("static_ring", 4)
  np.testing.assert_allclose(topo.mixing_matrix(0)[0], [1 / 3, 1 / 3, 0, 1 / 3])
  x0 = np.array([[3, 0, 1], [0, 2, 0], [-1, 0, 4], [2, -2, 0]], np.float64)
  return topo, x0


def _choco_rounds(topo, x0, compressor, gamma, rounds, mesh):
  tx = choco.choco_gossip(topo, compressor, gamma,
                          parallel.worker_axis(mesh))

  def run(x):
    state = tx.init(x)

    def body(_, carry):
      x, state = carry
      upd, state = tx.update(jnp.zeros_like(x), state, x)
      return x + upd, state

    return jax.lax.fori_loop(0, rounds, body, (x, state))

  return jax.jit(parallel.per_worker(run, mesh))(parallel.shard(x0, mesh))


def test_choco_worked_example(x64):
  del x64
  require_devices(4)
  topo, x0 = _ring4_example()
  mesh = parallel.make_mesh(4)
  top1 = compress.Compressor("topk", block=3, fraction=1 / 3)
  x1, state = _choco_rounds(topo, x0, top1, 0.5, 1, mesh)
  np.testing.assert_allclose(np.asarray(state.public),
                             [[3, 0, 0], [0, 2, 0], [0, 0, 4], [2, 0, 0]])
  np.testing.assert_allclose(np.asarray(x1), [
      [7 / 3, 1 / 3, 1], [0.5, 4 / 3, 2 / 3], [-2 / 3, 1 / 3, 8 / 3],
      [11 / 6, -2, 2 / 3]], atol=1e-12)
  for rounds in (2, 5):
    xr, _ = _choco_rounds(topo, x0, top1, 0.5, rounds, mesh)
    np.testing.assert_allclose(np.asarray(xr).mean(0), [1, 0, 1.25],
                               atol=1e-12)


@pytest.mark.parametrize("name,n", [
    ("static_ring", 5), pytest.param("torus", 9, marks=pytest.mark.slow),
    pytest.param("exponential", 6, marks=pytest.mark.slow),
    pytest.param("complete", 4, marks=pytest.mark.slow)])
def test_choco_keeps_the_mean_for_1000_rounds(name, n, x64):
  del x64
  require_devices(n)
  topo = topology.make(name, n)
  mesh = parallel.make_mesh(n)
  x0 = np.random.default_rng(4).normal(size=(n, 7))
  xr, _ = _choco_rounds(topo, x0, compress.Compressor("int4", block=4), 0.3,
                        1000, mesh)
  np.testing.assert_allclose(np.asarray(xr).mean(0), x0.mean(0), atol=1e-10)
  # and it does mix: a NumPy run of the same recursion reaches 1e-27
  assert np.var(np.asarray(xr), axis=0).sum() < 1e-20 * np.var(x0, 0).sum()


# docs/running.md: in float32 CHOCO keeps the worker mean within 3e-5
# after 50 rounds of unit-variance data (8 workers), on every static
# topology and format, while the workers converge.
CHOCO_F32_MEAN_BOUND = 3e-5


def _choco_f32_mean_drift(name, fmt, block, gamma, seed=1):
  """Largest |mean after 50 rounds - mean before| of 8 workers' float32
  leaves (37,) and (3, 5), unit normal, pure gossip."""
  require_devices(8)
  mesh = parallel.make_mesh(8)
  tx = choco.choco_gossip(topology.make(name, 8), _comp(fmt, block, 0.25),
                          gamma, parallel.worker_axis(mesh))

  def run(x):
    def body(_, carry):
      x, state = carry
      upd, state = tx.update(jax.tree.map(jnp.zeros_like, x), state, x)
      return jax.tree.map(jnp.add, x, upd), state
    return jax.lax.fori_loop(0, 50, body, (x, tx.init(x)))[0]

  rng = np.random.default_rng(seed)
  x0 = {"a": rng.standard_normal((8, 37)).astype(np.float32),
        "b": rng.standard_normal((8, 3, 5)).astype(np.float32)}
  xr = jax.jit(parallel.per_worker(run, mesh))(parallel.shard(x0, mesh))
  return max(np.abs(np.asarray(xr[k], np.float64).mean(0)
                    - x0[k].astype(np.float64).mean(0)).max() for k in x0)


# complete, int4, block 16, gamma 1 moves the mean by ~1.1e-5 (not "a few
# 1e-6"); static_ring fp4 by less.
@pytest.mark.parametrize("name, fmt", [
    ("complete", "int4"),
    pytest.param("static_ring", "fp4", marks=pytest.mark.slow)])
def test_choco_keeps_the_float32_mean_within_the_stated_bound(name, fmt):
  assert _choco_f32_mean_drift(name, fmt, 16, 1.0) <= CHOCO_F32_MEAN_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exponential", "static_ring", "torus",
                                  "complete"])
def test_choco_keeps_the_float32_mean_on_every_format_and_topology(name):
  for fmt in wire_format.FORMATS:
    for gamma, seed in ((0.5, 0), (1.0, 0), (1.0, 2)):
      drift = _choco_f32_mean_drift(name, fmt, 16, gamma, seed)
      assert drift <= CHOCO_F32_MEAN_BOUND, (fmt, gamma, seed, drift)


@pytest.mark.parametrize("name", ["one_peer_exp", "ring",
                                  "alternating_exp_ring"])
def test_choco_refuses_a_time_varying_schedule(name):
  topo = topology.make(name, 8, 4 if name == "alternating_exp_ring" else 1)
  with pytest.raises(ValueError, match="static mixing matrix"):
    choco.choco_gossip(topo, compress.Compressor("int8"), 0.5)


def test_choco_with_the_identity_and_gamma_one_is_plain_gossip(x64):
  del x64
  require_devices(9)
  topo = topology.make("torus", 9)
  mesh = parallel.make_mesh(9)
  x0 = np.random.default_rng(5).normal(size=(9, 5))
  xr, _ = _choco_rounds(topo, x0, compress.Compressor("none"), 1.0, 2, mesh)
  ref = topo.mixing_matrix(1) @ topo.mixing_matrix(0) @ x0
  np.testing.assert_allclose(np.asarray(xr), ref, atol=1e-13)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in wire_format.FORMATS])
def test_an_empty_leaf_sends_nothing_in_compressed_gossip(fmt):
  """A size-0 leaf encodes to arrays of 0 bytes (no padded block), so the
  bytes of the encoded arrays equal the hand count (int8, block 64: 5
  blocks of 64 codes + 4 scale bytes for 300 values, 0 for the empty leaf),
  and the gossip round returns it empty beside the mixed values (``W x``
  with worker ``i``'s values all ``i``)."""
  require_devices(8)
  c = _comp(fmt, 64, 0.125)
  tree = {"w": np.ones(300, np.float32), "e": np.zeros((3, 0), np.float32)}
  sent = {k: sum(a.size * a.dtype.itemsize for a in c.encode(v).values())
          for k, v in tree.items()}
  assert sent["e"] == 0
  topo = topology.make("ring", 8)  # one permute term per round
  assert compress.payload_bytes_per_round(tree, topo, 0, c) == sum(
      sent.values())
  if fmt == "int8":
    assert sent["w"] == 5 * (64 + 4)
  mesh = parallel.make_mesh(8)
  axis = parallel.worker_axis(mesh)
  x = {"w": np.tile(np.arange(8, dtype=np.float32)[:, None], (1, 300)),
       "e": np.zeros((8, 3, 0), np.float32)}
  out = jax.jit(parallel.per_worker(
      lambda t: compress.mix_compressed(t, topo, 0, axis, compressor=c),
      mesh))(parallel.shard(x, mesh))
  assert out["e"].shape == (8, 3, 0)
  if fmt != "topk":  # a constant block is exact in every scaled format
    np.testing.assert_allclose(  # (code = qmax, scale = the value / qmax)
        np.asarray(out["w"]), topo.mixing_matrix(0) @ x["w"], rtol=1e-6)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in wire_format.FORMATS])
def test_bytes_in_the_compiled_program_equal_the_hand_count(fmt):
  require_devices(8)
  topo = topology.make("ring", 8)  # one permute term per round
  mesh = parallel.make_mesh(8)
  c = _comp(fmt, 64, 0.125)
  x = {"w": np.ones((8, 300), np.float32), "b": np.ones((8, 7), np.float32)}
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda t: compress.mix_compressed(t, topo, 0, axis, compressor=c), mesh))
  rep = analysis.communication(fn.lower(parallel.shard(x, mesh)).compile())
  per_worker_tree = {"w": np.ones(300, np.float32), "b": np.ones(7, np.float32)}
  hand = compress.payload_bytes_per_round(per_worker_tree, topo, 0, c)
  assert len(topo.round(0).terms) == 1
  assert rep.mean_bytes_per_step == hand
  if fmt == "int8":  # 5 blocks of 64 codes + scales, plus 1 block for "b"
    assert hand == 5 * (64 + 4) + (64 + 4)


def test_mix_compressed_none_equals_gossip_mix(x64):
  del x64
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)
  mesh = parallel.make_mesh(8)
  axis = parallel.worker_axis(mesh)
  x = np.random.default_rng(6).normal(size=(8, 11))
  xs = parallel.shard(x, mesh)
  f_c = jax.jit(parallel.per_worker(lambda t, s: compress.mix_compressed(
      t, topo, s, axis, compressor=compress.Compressor("none")), mesh,
      replicated_argnums=(1,)))
  f_g = jax.jit(parallel.per_worker(lambda t, s: gossip.mix(t, topo, s, axis),
                                    mesh, replicated_argnums=(1,)))
  for step in range(3):
    np.testing.assert_allclose(np.asarray(f_c(xs, jnp.int32(step))),
                               np.asarray(f_g(xs, jnp.int32(step))),
                               rtol=0, atol=1e-15)


def test_choco_inside_an_optax_chain_trains_dsgd():
  require_devices(4)
  topo = topology.make("static_ring", 4)
  mesh = parallel.make_mesh(4)
  axis = parallel.worker_axis(mesh)
  tx = optax.chain(optax.sgd(0.1), choco.choco_gossip(
      topo, compress.Compressor("int8", block=8), 0.5, axis))
  targets = np.arange(4.0)[:, None] * np.ones((4, 3), np.float32)

  def run(x, c):
    state = tx.init(x)

    def body(_, carry):
      x, state = carry
      upd, state = tx.update(x - c, state, x)  # grad of |x - c|^2 / 2
      return optax.apply_updates(x, upd), state

    return jax.lax.fori_loop(0, 300, body, (x, state))[0]

  out = jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(np.zeros((4, 3), np.float32), mesh),
      parallel.shard(targets.astype(np.float32), mesh))
  # D-SGD with a constant step reaches a neighbourhood of the mean target 1.5.
  assert np.abs(np.asarray(out).mean(0) - 1.5).max() < 1e-3
  assert np.abs(np.asarray(out) - 1.5).max() < 0.2


def test_choco_refuses_bad_arguments():
  topo = topology.make("static_ring", 4)
  with pytest.raises(ValueError, match="consensus_step"):
    choco.choco_gossip(topo, compress.Compressor("int8"), 1.5)
  with pytest.raises(ValueError, match="compressor"):
    choco.choco_gossip(topo, "int8", 0.5)
  # A topology's name is not a Topology: the message says how to build one.
  with pytest.raises(ValueError, match=(
      r"choco_gossip: topology must be a decentral_jax.topology.Topology, got "
      r"str 'static_ring'; build one with decentral_jax.topology.make\("
      r"'static_ring', n_workers\)")):
    choco.choco_gossip("static_ring", compress.Compressor("int8"), 0.5)
  with pytest.raises(ValueError, match=r"topology must be a .*, got ndarray;"):
    choco.choco_gossip(np.full((4, 4), 0.25), compress.Compressor("int8"), 0.5)


def _mean_fn(mesh, c):
  axis = parallel.worker_axis(mesh)
  return jax.jit(parallel.per_worker(
      lambda t: compressed_mean.mean_compressed(t, axis, compressor=c), mesh))


@pytest.mark.parametrize("fmt", [
    "int8", pytest.param("fp4", marks=pytest.mark.slow),
    pytest.param("topk", marks=pytest.mark.slow)])
def test_compressed_mean_matches_a_numpy_reference(fmt):
  require_devices(4)
  mesh = parallel.make_mesh(4)
  c = _comp(fmt, 8, 0.25)
  x = np.random.default_rng(7).normal(size=(4, 3, 7)).astype(np.float32)
  out = np.asarray(_mean_fn(mesh, c)(parallel.shard(x, mesh)))
  # Reference: deQ(Q(.)) per worker over the padded vector (64 = 4 x 2 x 8
  # values, shards of 16), float32 sum in worker order, /4, deQ(Q(.)) per
  # shard, with this module's round trip for one block at a time.
  pad = np.zeros((4, 64), np.float32)
  pad[:, :21] = x.reshape(4, -1)
  sent = np.stack([np.asarray(c.roundtrip(jnp.asarray(r))) for r in pad])
  total = np.zeros(64, np.float32)
  for j in range(4):
    total = total + sent[j]
  mean = total / np.float32(4)
  ref = np.concatenate([np.asarray(c.roundtrip(jnp.asarray(mean[16 * s:16 * s + 16])))
                        for s in range(4)])[:21].reshape(3, 7)
  for i in range(4):  # every worker holds the same result
    np.testing.assert_allclose(out[i], ref, rtol=1e-6, atol=1e-7)
  if fmt == "int8":
    np.testing.assert_allclose(out[0], x.mean(0), atol=0.05)


def test_compressed_mean_none_keeps_float64(x64):
  """``none`` sends the values as they are: a float64 leaf's mean is the
  float64 sum in worker order over n (was summed in float32: 1e-7)."""
  del x64
  require_devices(8)
  mesh = parallel.make_mesh(8)
  x = np.random.default_rng(11).normal(size=(8, 5, 3))
  c = compress.Compressor("none", block=2)
  out = np.asarray(_mean_fn(mesh, c)(parallel.shard(x, mesh)))
  total = np.zeros((5, 3))
  for j in range(8):
    total = total + x[j]
  assert out.dtype == np.float64
  for i in range(8):
    np.testing.assert_allclose(out[i], total / 8, rtol=0, atol=1e-15)
  assert compressed_mean.mean_payload_bytes({"w": jnp.zeros((5, 3))}, 8, c) \
      == 2 * 7 / 8 * 16 * 8  # 15 values padded to 8 x 2, 8 bytes each


@pytest.mark.parametrize("fmt", [
    "int8", pytest.param("int4", marks=pytest.mark.slow),
    pytest.param("topk", marks=pytest.mark.slow)])
def test_compressed_mean_bytes_equal_the_hand_count(fmt):
  require_devices(8)
  mesh = parallel.make_mesh(8)
  c = _comp(fmt, 16, 0.25)
  x = {"w": np.ones((8, 300), np.float32)}
  rep = analysis.communication(
      _mean_fn(mesh, c).lower(parallel.shard(x, mesh)).compile())
  hand = compressed_mean.mean_payload_bytes({"w": np.ones(300)}, 8, c)
  assert rep.mean_bytes_per_step == pytest.approx(hand, rel=1e-12)
  if fmt == "int8":  # 384 padded values = 24 blocks of 16 codes + 4 scale bytes
    assert hand == pytest.approx(2 * 7 / 8 * 24 * 20)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("int8", "fp8", "int4", "fp4", "topk")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_never_received_as_finite(fmt, bad):
  # Two blocks of 8; block 0 holds one non-finite value among 1..7, block 1
  # is finite. A scaled format's block 0 has scale NaN: all of it decodes to
  # NaN (before, a NaN block took scale 1 and the NaN became a finite
  # code). Top-k sends the non-finite value first, as it is.
  v = np.concatenate([np.arange(1.0, 9.0), np.arange(8.0)]).astype(np.float32)
  v[3] = bad
  c = _comp(fmt, 8, 0.25)
  got = np.asarray(c.roundtrip(jnp.asarray(v)))
  if fmt == "topk":
    if np.isnan(bad):
      assert np.isnan(got[3])
    else:
      assert got[3] == bad
    assert np.all(np.isfinite(np.delete(got, 3)))
  else:
    assert np.all(np.isnan(got[:8])), got
    assert np.all(np.isfinite(got[8:])), got
  # Block 1 is as without the bad value (blocks are independent).
  clean = v.copy()
  clean[3] = 0.0
  np.testing.assert_array_equal(got[8:],
                                np.asarray(c.roundtrip(jnp.asarray(clean)))[8:])


def test_topk_sends_nan_before_a_larger_finite_value():
  # k = 1 of a chunk [1e30, NaN, 2, 3]: the NaN, not the largest finite.
  c = compress.Compressor("topk", block=4, fraction=0.25)
  got = np.asarray(c.roundtrip(jnp.asarray([1e30, np.nan, 2.0, 3.0],
                                           jnp.float32)))
  assert np.isnan(got[1]) and np.all(got[[0, 2, 3]] == 0), got


def test_compressor_arguments_refused_in_one_line():
  # A fraction is for top-k only; top-k without one keeps 1%.
  with pytest.raises(ValueError, match="fraction applies to format 'topk' "
                     "only, got fraction=0.5 with format 'int8'"):
    compress.Compressor("int8", fraction=0.5)
  assert compress.Compressor("topk").fraction == 0.01
  assert compress.Compressor("int8").fraction is None
  # A huge block is refused before anything is allocated.
  with pytest.raises(ValueError, match=r"block must be an int >= 2 and <= "
                     r"1048576, got 1099511627776\."):
    compress.Compressor("int8", block=2 ** 40)
  with pytest.raises(ValueError, match=r"itemsize must be an int >= 1, got -4"):
    compress.Compressor("none").payload_bytes(10, -4)
  with pytest.raises(ValueError, match=r"compressor must be a decentral_jax"
                     r"\.comm\.compress\.Compressor, got str\."):
    compress.relative_error_bound("int8")
  with pytest.raises(ValueError, match="compressor must be a decentral_jax"):
    compressed_mean.mean_payload_bytes({"x": np.zeros(4)}, 2, "int8")
  # Only floating values are compressed (an integer gradient is refused).
  c = compress.Compressor("int8", block=4)
  with pytest.raises(ValueError, match="dtype int32; only floating-point"):
    c.encode(jnp.arange(8, dtype=jnp.int32))
  with pytest.raises(ValueError, match="dtype int32; only floating-point"):
    compress.compress_with_feedback(c, jnp.arange(8, dtype=jnp.int32),
                                    jnp.zeros(8, jnp.int32))


def test_topology_of_another_size_than_the_worker_axis_is_refused():
  # A 4-worker topology on an 8-worker mesh would gossip among 4 workers and
  # give the others clamped weights; both compressed gossips refuse it.
  require_devices(8)
  mesh = parallel.make_mesh(8)
  axis = parallel.worker_axis(mesh)
  topo = topology.make("static_ring", 4)
  x = parallel.shard(np.ones((8, 3), np.float32), mesh)
  c = compress.Compressor("int8", block=4)
  phrase = r"has n_workers=4 but the worker axis .* has 8 workers"
  with pytest.raises(ValueError, match=phrase):
    jax.jit(parallel.per_worker(lambda t: compress.mix_compressed(
        t, topo, 0, axis, compressor=c), mesh))(x)
  tx = choco.choco_gossip(topo, c, 0.5, axis)

  def run(p):
    return tx.update(jnp.zeros_like(p), tx.init(p), p)[0]

  with pytest.raises(ValueError, match=phrase):
    jax.jit(parallel.per_worker(run, mesh))(x)


def test_choco_refuses_integer_parameters():
  tx = choco.choco_gossip(topology.make("static_ring", 4),
                          compress.Compressor("int8"), 0.5)
  with pytest.raises(ValueError, match=r"choco_gossip: leaf \"\['step'\]\" "
                     "has dtype int32"):
    tx.init({"w": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("int8", "fp8", "int4", "fp4")])
def test_every_finite_block_round_trips_finite_within_its_bound_or_floor(fmt):
  """Tiny, huge and mixed magnitudes (blocks of 4): a finite input never
  decodes to NaN or inf, and the error is within the format's bound
  relative to max(max_b |v|, qmax x float32's smallest normal)."""
  comp = compress.Compressor(fmt, block=4)
  bound = compress.relative_error_bound(comp)
  tiny = float(np.finfo(np.float32).tiny)
  rng = np.random.default_rng(0)
  blocks = [[3e-38, -1.5e-38, 0.0, 1e-38], [1e-36, -5e-37, 2e-37, 0.0],
            [5.3e-36, 1e-36, -4e-36, 2e-36], [3e38, -3.4e38, 1.0, 1e-30],
            [1e-20, 1e20, -1e-10, 7.0], [0.0, 0.0, 0.0, 0.0]]
  for exp in range(-45, 39, 3):  # random blocks at every decade
    blocks.append(list(rng.uniform(-1, 1, 4) * 10.0 ** exp))
  v = np.asarray(blocks, np.float32)
  got = np.asarray(comp.roundtrip(jnp.asarray(v.reshape(-1)))).reshape(v.shape)
  assert np.all(np.isfinite(got)), fmt
  # Subnormal inputs may be flushed to zero: the tiny of slack below.
  want = v.astype(np.float64)
  floor = compress.QMAX[fmt] * tiny
  scale = np.maximum(np.abs(want).max(axis=1, keepdims=True), floor)
  err = np.abs(got.astype(np.float64) - want)
  assert np.all(err <= bound * scale + tiny), (fmt, (err / scale).max())
  np.testing.assert_array_equal(got[-1 - 28], 0.0)  # the block of zeros


@pytest.mark.parametrize("block,fmt", [
    (b, f) if (b, f) == (4, "int8") else pytest.param(
        b, f, marks=pytest.mark.slow)
    for b in (2, 4, 8, 16, 256) for f in ("int8", "fp8", "int4", "fp4")])
def test_float32_extremes_decode_finite(fmt, block):
  """Blocks holding float32's largest value (127 x amax / 127 rounds past
  it) decode to it, not inf; the rest within the bound."""
  big = float(np.finfo(np.float32).max)
  v = np.zeros(block, np.float32)
  v[:2] = [big, -big]
  got = np.asarray(compress.Compressor(fmt, block=block).roundtrip(
      jnp.asarray(v)))
  assert np.all(np.isfinite(got)), got
  bound = compress.relative_error_bound(compress.Compressor(fmt, block=block))
  assert np.all(np.abs(got.astype(np.float64) - v) <= bound * big), got


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("int8", "fp8", "int4", "fp4", "topk")])
def test_float64_beyond_float32_saturates_not_nan(fmt, x64):
  """float64 leaves: finite values beyond float32's range arrive as
  +-3.4e38 (the codecs compute in float32), never NaN or inf; NaN and inf
  still arrive non-finite."""
  del x64
  big = float(np.finfo(np.float32).max)
  comp = compress.Compressor(fmt, block=4)
  got = np.asarray(comp.roundtrip(jnp.asarray([1e300, -1e39, 1.0, 0.0],
                                              jnp.float64)))
  assert np.all(np.isfinite(got)) and np.abs(got).max() == pytest.approx(
      big, rel=1e-6), got
  bad = np.asarray(comp.roundtrip(jnp.asarray([np.inf, 1e300, 1.0, 0.0],
                                              jnp.float64)))
  assert not np.isfinite(bad[0]), bad


#: Half step of each scaled format relative to the block max, by hand:
#: int8 0.5 / 127, int4 0.5 / 7, fp8 e4m3 half an ulp of 3 mantissa bits
#: (2^-4 of the value), fp4 e2m1 half the gap between 4 and 6 over qmax 6.
_HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 2.0 ** -4,
              "fp4": 1 / 6}


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in SCALED])
def test_bound_holds_for_a_sweep_of_blocks_and_magnitudes(fmt):
  """Random blocks (sizes 4 and 32, block maxima from 1e-30 to 3e38, some
  values near their block max): the float32 rounding of the scale, of
  v / s and of code * s adds up to four float32 unit roundoffs (2^-22)
  to the half step, and the documented bound is that sum. The int8 blocks
  the bound once missed are in the sweep."""
  want_bound = _HALF_STEP[fmt] + 4 * 2.0 ** -24
  assert compress.relative_error_bound(compress.Compressor(fmt)) == want_bound
  rng = np.random.default_rng(13)
  worst = 0.0
  for block in (4, 32):
    comp = compress.Compressor(fmt, block=block)
    assert compress.relative_error_bound(comp) == want_bound
    n_blocks = 8192 // block
    mag = 10.0 ** rng.uniform(-30, 38.5, size=(n_blocks, 1))
    v = rng.uniform(-1, 1, size=(n_blocks, block)) * mag
    v[::3, 1] = -v[::3, 0] * (1 - rng.uniform(0, 1e-3, n_blocks)[::3])
    v = np.clip(v, -3.4e38, 3.4e38).astype(np.float32)
    if block == 4:
      v[0] = [4.3447204, 4.2591944, -4.2591944, 0.5101005]
      v[1] = [65504., -32752., 0, 0]
    got = np.asarray(comp.roundtrip(jnp.asarray(v.reshape(-1))),
                     np.float64).reshape(v.shape)
    amax = np.abs(v.astype(np.float64)).max(axis=1, keepdims=True)
    ratio = (np.abs(got - v) / amax).max()
    assert ratio <= want_bound, (fmt, block, ratio - _HALF_STEP[fmt])
    worst = max(worst, ratio)
  assert worst > _HALF_STEP[fmt] * 0.5  # the sweep nears the half step


def test_int8_blocks_rounded_past_the_half_step():
  """int8 blocks whose float32 scale and products round past 1/254 of the
  block max (by 1.5 and 0.2 float32 unit roundoffs): within the bound."""
  comp = compress.Compressor("int8", block=4)
  bound = compress.relative_error_bound(comp)
  for v in ([4.3447204, 4.2591944, -4.2591944, 0.5101005],
            [65504., -32752., 0, 0]):
    v = np.asarray(v, np.float32)
    got = np.asarray(comp.roundtrip(jnp.asarray(v)), np.float64)
    ratio = np.abs(got - v).max() / np.abs(v).max()
    assert 1 / 254 < ratio <= bound, ratio


@pytest.mark.parametrize("shape", [(3,), (1,), (2, 4)])
def test_an_error_of_another_shape_than_v_is_named(shape):
  """A residual of shape (1,) or (2, 4) was broadcast against v's (4,)
  (sent and the new residual came back (2, 4)); (3,) gave JAX's
  broadcasting message naming no argument."""
  c = compress.Compressor("int8", block=4)
  with pytest.raises(ValueError, match=r"compress_with_feedback: error has "
                     rf"shape \({shape[0]},"):
    compress.compress_with_feedback(c, jnp.ones((4,), jnp.float32),
                                    jnp.zeros(shape, jnp.float32))


@pytest.mark.parametrize("value, words", [
    ({"a": np.ones(3, np.float32)}, "is a dict"),
    ([[1.0, 2.0], [3.0]], "not a rectangular array")])
def test_roundtrip_names_a_pytree_or_a_ragged_list(value, words):
  with pytest.raises(ValueError, match=words):
    compress.Compressor("int8", block=4).roundtrip(value)
