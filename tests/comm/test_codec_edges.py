"""Codecs and wires at the edges of their range, against hand-derived bounds.

Sums that overflow float32 although every value fits; 16-bit leaves (the decoded value's cast to the leaf's dtype); fp8's
subnormal codes; top-k chunks with more non-finite values than ``k``; and
8-bit floats refused as an unscaled wire dtype. Expected values are NumPy
means of the inputs and the bounds stated in ``comm.compress``'s docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.comm import compress
from decentral_jax.comm import compressed_mean
from decentral_jax.comm import gossip
from decentral_jax.optim import reductions

F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)
SCALED = ("int8", "fp8", "int4", "fp4")


def _per_worker(fn, x):
  n = x.shape[0]
  require_devices(n)
  mesh = parallel.make_mesh(n)
  ax = parallel.worker_axis(mesh)
  return np.asarray(jax.jit(parallel.per_worker(
      lambda v: fn(v, ax), mesh))(parallel.shard(x, mesh)))


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("topk", *SCALED)])
def test_a_gathered_mean_whose_sum_overflows_is_the_mean(fmt):
  """Four workers at +-0.6..0.9 x float32's largest value, one sign per
  column: the float32 sum overflows, the mean (within the codec's error)
  does not."""
  rng = np.random.default_rng(1)
  x = (rng.choice([-1.0, 1.0], size=(1, 8))
       * rng.uniform(0.6, 0.9, size=(4, 8)) * F32_MAX).astype(np.float32)
  c = compress.Compressor(fmt, block=8, **(
      {"fraction": 1.0} if fmt == "topk" else {}))
  got = _per_worker(lambda v, ax: compressed_mean.gather_mean_compressed(
      v, ax, compressor=c), x)
  want = x.astype(np.float64).mean(0)
  assert np.all(np.isfinite(got)), got
  bound = 0.0 if fmt == "topk" else compress.relative_error_bound(c)
  # top-k with fraction 1 sends every value: float32 rounding only.
  tol = bound * F32_MAX + 4 * np.finfo(np.float32).eps * F32_MAX
  assert np.max(np.abs(got - want)) <= tol, (got - want)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_an_unscaled_eight_bit_wire_is_refused_naming_the_fix(dtype):
  with pytest.raises(ValueError, match=r"comm_dtype=.*has no scale.*"
                     r"compression\.format=fp8"):
    reductions.LowPrecisionMean(getattr(ml_dtypes, dtype))
  with pytest.raises(ValueError, match="has no scale"):
    gossip.mix({"w": jnp.zeros(2)}, topology.make("static_ring", 4), 0,
               comm_dtype=dtype)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in SCALED])
@pytest.mark.parametrize("dtype, u", [
    (jnp.bfloat16, 2.0 ** -8),
    pytest.param(jnp.float16, 2.0 ** -11, marks=pytest.mark.slow)])
def test_sixteen_bit_leaves_within_the_bound_plus_their_cast(fmt, dtype, u):
  """|deQ(Q(v)) - v| <= bound x max_b |v| + u |deQ(Q(v))| (+ the dtype's
  smallest subnormal and float32's floor), over random blocks of 4 at
  every decade the dtype holds."""
  c = compress.Compressor(fmt, block=4)
  bound = compress.relative_error_bound(c)
  rng = np.random.default_rng(3)
  hi = 4 if dtype == jnp.float16 else 37
  exps = rng.integers(-6, hi, size=(400, 1))
  v = np.asarray(jnp.asarray(rng.uniform(-1, 1, (400, 4)) * 10.0 ** exps,
                             dtype)).astype(np.float64)
  got = np.asarray(c.roundtrip(jnp.asarray(v.reshape(-1), dtype)),
                   np.float64).reshape(v.shape)
  amax = np.abs(v).max(axis=1, keepdims=True)
  slack = float(jnp.finfo(dtype).smallest_subnormal) + TINY
  err = np.abs(got - v)
  assert np.all(err <= bound * amax + u * np.abs(got) + slack), (
      (err - bound * amax).max())


def test_fp8_small_values_within_half_a_subnormal_gap():
  """Values below 2^-6 s_b fall on e4m3's subnormals (spaced 2^-9 s_b):
  the error is at most max(2^-4 |v|, 2^-10 s_b), worked by hand for
  [448, 0.001, 1, -0.01] (s_b = 1: 0.001 -> 2^-9 = 0.001953125)."""
  c = compress.Compressor("fp8", block=4)
  got = np.asarray(c.roundtrip([448.0, 0.001, 1.0, -0.01]), np.float64)
  np.testing.assert_array_equal(got, [448.0, 2.0 ** -9, 1.0, -5 * 2.0 ** -9])
  rng = np.random.default_rng(5)
  v = rng.uniform(-1, 1, (500, 4)) * 10.0 ** rng.integers(-4, 1, (500, 4))
  v[:, 0] = 448.0 * np.sign(v[:, 0])  # s_b = 1 in every block
  v = v.astype(np.float32).astype(np.float64)
  got = np.asarray(c.roundtrip(v.reshape(-1).astype(np.float32)),
                   np.float64).reshape(v.shape)
  assert np.all(np.abs(got - v) <= np.maximum(2.0 ** -4 * np.abs(v),
                                              2.0 ** -10) + TINY)


def test_a_topk_chunk_with_more_non_finite_values_than_k_is_not_finite():
  c = compress.Compressor("topk", block=4, fraction=0.25)  # k = 1
  got = np.asarray(c.roundtrip([np.inf, np.nan, 1.0, 2.0,
                                5.0, -np.inf, np.nan, np.inf]))
  for chunk in (got[:4], got[4:]):
    assert not np.all(np.isfinite(chunk)), got
  sent = got[~np.isfinite(got) | (got != 0)]
  assert sent.size == 2  # k = 1 value per chunk, the others arrive as 0


@pytest.mark.parametrize("leaf", ["abc", "float32", b"x", object(), None])
def test_a_leaf_that_is_not_an_array_is_named(leaf):
  """A string was read as a dtype name ("float32" got past the check)."""
  c = compress.Compressor("int8", block=4)
  for call in (c.encode, c.roundtrip):
    with pytest.raises(ValueError, match=r"leaf '' is a \w+, not an array|"
                       r"the value is None"):
      call(leaf)


def test_an_empty_leaf_sends_nothing_and_is_counted_as_nothing():
  """The hand count of an empty leaf is 0 bytes, and the compiled program
  holds no collective for it (counted in the HLO text), while a 1-value
  leaf sends one padded unit of n x block values."""
  n, c = 8, compress.Compressor("int8", block=256)
  require_devices(n)
  mesh = parallel.make_mesh(n)
  ax = parallel.worker_axis(mesh)
  f = jax.jit(parallel.per_worker(
      lambda v: compressed_mean.mean_compressed(v, ax, compressor=c), mesh))
  x = parallel.shard(np.zeros((n, 0), np.float32), mesh)
  hlo = f.lower(x).compile().as_text()
  assert not any(op in hlo for op in ("all-to-all", "all-gather")), hlo
  assert jax.eval_shape(f, x).shape == (n, 0)
  assert compressed_mean.mean_payload_bytes(jnp.zeros((0,)), n, c) == 0.0
  # One value: n x block = 2048 int8 codes plus 8 float32 scales (one per
  # block of 256), 2 (n - 1) / n of them on the wire.
  assert compressed_mean.mean_payload_bytes(jnp.zeros((1,)), n, c) == (
      2 * 7 / 8 * (2048 + 8 * 4))
