"""The parameter range every method keeps finite: |x| <= float32's largest / 2.

An optax update is a difference of parameters (``W x - x`` for gossip,
``theta - x_i`` for a pseudo-gradient), so it fits float32 while any two
parameters differ by at most float32's largest value: parameters within
``+-F32_MAX / 2`` of each sign. Expected values are NumPy float64
re-implementations (the mixing matrix's product; DiLoCo's outer step by
hand); the bounds are the codecs' stated relative errors.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.comm import compress
from decentral_jax.optim import reductions

F32_MAX = float(np.finfo(np.float32).max)
EDGE = 0.49 * F32_MAX  # inside the stated range, opposite signs
N = 4


def _steps(tx, x0, grads, steps):
  require_devices(N)
  mesh = parallel.make_mesh(N)

  def one(x, s, g):
    d, s = tx.update(g, s, x)
    return optax.apply_updates(x, d), s

  step = jax.jit(parallel.per_worker(one, mesh))
  x = parallel.shard(x0, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  g = parallel.shard(grads, mesh)
  for _ in range(steps):
    x, s = step(x, s, g)
  return np.asarray(x, np.float64)


def _alternating():
  x = np.full((N, 6), EDGE, np.float32)
  x[::2] *= -1
  return x


def test_plain_gossip_of_opposite_signs_at_the_edge_is_the_matrix_product():
  topo = topology.make("static_ring", N)
  x = _alternating()
  got = _steps(optim.decentralized(optax.sgd(0.0), topo, "workers"), x,
               np.zeros_like(x), 1)
  want = topo.mixing_matrix(0) @ x.astype(np.float64)
  assert np.all(np.isfinite(got)), got
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=4 * np.finfo(np.float32).eps * F32_MAX)


@pytest.mark.parametrize("fmt", ["none", "int8", "fp8"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_choco_at_the_edge_stays_finite_and_keeps_the_mean(fmt, pipelined):
  x = _alternating()
  tx = optax.chain(optax.sgd(0.0), optim.choco_gossip(
      topology.make("static_ring", N), compress.Compressor(fmt, block=2),
      0.5, "workers", pipelined=pipelined))
  got = _steps(tx, x, np.zeros_like(x), 3)
  assert np.all(np.isfinite(got)), got
  # The mean (0) is kept to float32 rounding of values of size F32_MAX.
  assert np.max(np.abs(got.mean(0))) <= 8 * np.finfo(np.float32).eps * F32_MAX


@pytest.mark.parametrize("fmt", ["none", "int8", "fp8", "topk"])
def test_compressed_diloco_whose_learners_cross_zero_at_the_edge(fmt):
  """theta = +EDGE; one inner SGD step (lr 1) takes the even workers to
  -EDGE: pseudo-gradients 2 EDGE and 0, their mean EDGE, so the outer SGD
  step (lr 1) lands on theta = 0, within two quantization steps of the
  largest pseudo-gradient."""
  x = np.full((N, 8), EDGE, np.float32)
  g = np.zeros_like(x)
  g[::2] = 2 * EDGE
  c = None if fmt == "none" else compress.Compressor(
      fmt, block=8, **({"fraction": 1.0} if fmt == "topk" else {}))
  tx = optim.diloco(optax.sgd(1.0), 1, outer=optax.sgd(1.0),
                    reduction=reductions.compressed(c, axis_name="workers"))
  got = _steps(tx, x, g, 1)
  assert np.all(np.isfinite(got)), got
  bound = 0.0 if c is None or fmt == "topk" else (
      compress.relative_error_bound(c))
  tol = 2 * bound * 2 * EDGE + 4 * np.finfo(np.float32).eps * F32_MAX
  assert np.max(np.abs(got)) <= tol, got
