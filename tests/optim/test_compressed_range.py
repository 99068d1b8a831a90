"""Compressed DiLoCo at the edge of float32's range, in float32 and float64.

Each worker's pseudo-gradient is finite and within float32's range but
their sum is not: the compressed mean must still be the mean (within the
two quantizations' error), not inf or NaN. Expected values are the NumPy
float64 mean of the targets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax.comm import compress
from decentral_jax.optim import reductions

F32_MAX = float(np.finfo(np.float32).max)
SCALED = ("int8", "int4", "fp8", "fp4")


def _diloco_theta(fmt, targets, dtype):
  """theta after one sync: one SGD step of lr 1 on |x - c_i|^2 / 2 takes
  x_i from 0 to c_i; the outer SGD of lr 1 sets theta to the compressed
  mean of the c_i."""
  n = targets.shape[0]
  require_devices(n)
  mesh = parallel.make_mesh(n)
  tx = optim.diloco(optax.sgd(1.0), 1, outer=optax.sgd(1.0),
                    reduction=reductions.compressed(
                        compress.Compressor(fmt, block=4)))

  def run(x, c):
    state = tx.init(x)
    upd, state = tx.update(jax.tree.map(lambda a, b: a - b, x, c), state, x)
    return optax.apply_updates(x, upd)

  x0 = {"w": np.zeros(targets.shape, dtype)}
  out = jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(x0, mesh), parallel.shard({"w": targets.astype(dtype)},
                                               mesh))
  return np.asarray(out["w"], np.float64)


# The fast tier keeps one case of each sweep (int8, 4 workers).
@pytest.mark.parametrize("fmt,n", [
    (f, n) if (f, n) == ("int8", 4) else pytest.param(
        f, n, marks=pytest.mark.slow) for f in SCALED for n in (3, 4, 8)])
def test_mean_of_values_whose_sum_overflows_float32(fmt, n):
  rng = np.random.default_rng(n)
  # Every worker near float32's largest value, same sign per column: the
  # float32 sum overflows, the mean does not.
  sign = rng.choice([-1.0, 1.0], size=(1, 10))
  targets = sign * rng.uniform(0.5, 0.99, size=(n, 10)) * F32_MAX
  got = _diloco_theta(fmt, targets.astype(np.float32), np.float32)
  want = targets.astype(np.float32).astype(np.float64).mean(0)
  assert np.all(np.isfinite(got)), (fmt, n, got)
  bound = compress.relative_error_bound(compress.Compressor(fmt))
  # Two quantizations (each worker's value, then the mean) of blocks
  # whose largest magnitude is below F32_MAX.
  tol = (2 * bound + bound ** 2) * F32_MAX
  assert np.max(np.abs(got - want)) <= tol, (fmt, n, got - want)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in SCALED])
def test_float64_parameters_beyond_float32_range_saturate(fmt, x64):
  del x64
  n = 4
  targets = np.array([[1e39, -2e38, 1.0, 3e38]] * n) * np.array(
      [[1.0], [0.9], [1.1], [1.0]])
  got = _diloco_theta(fmt, targets, jnp.float64)
  assert got.dtype == np.float64 and np.all(np.isfinite(got)), got
  # The codecs compute in float32: a value beyond its range is sent as
  # +-F32_MAX (module docstring), so the mean is of the saturated values.
  want = np.clip(targets, -F32_MAX, F32_MAX).mean(0)
  bound = compress.relative_error_bound(compress.Compressor(fmt))
  assert np.max(np.abs(got - want)) <= (2 * bound + bound ** 2) * F32_MAX
