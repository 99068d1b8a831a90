"""The parameter range every method keeps finite: |x| <= float32's largest / 2.

An optax update is a difference of parameters (``W x - x`` for gossip,
``theta - x_i`` for a pseudo-gradient), so it fits float32 while any two
parameters differ by at most float32's largest value: parameters within
``+-F32_MAX / 2`` of each sign, with an outer SGD without momentum. The
default outer optimizer (Nesterov SGD, momentum ``mu = 0.9``) forms
``(1 + mu) Delta`` at the first sync, so its bound is ``F32_MAX / (2 (1 +
mu))`` (docs/optax.md). Expected values are NumPy float64
re-implementations (the mixing matrix's product; DiLoCo's outer step by
hand); the bounds are the codecs' stated relative errors.
"""

from __future__ import annotations

import os

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


def _steps(tx, x0, grads, steps, n=N):
  require_devices(n)
  mesh = parallel.make_mesh(n)

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


# The default outer optimizer (optim.diloco without ``outer``), by hand.
OUTER_LR, MU = 0.7, 0.9
NESTEROV_EDGE = F32_MAX / (2 * (1 + MU))  # 8.95e37


def _default_outer_sync(theta, x):
  """Two workers, one DiLoCo sync (inner SGD lr 1 to ``x``) with the default
  outer optimizer: the result and, in float64, the exact one."""
  theta = np.asarray(theta, np.float32)
  g = (theta[None] - np.asarray(x, np.float32)).astype(np.float32)
  tx = optim.diloco(optax.sgd(1.0), 1, reduction=reductions.uncompressed(
      axis_name="workers"))
  got = _steps(tx, np.stack([theta, theta]), g, 1, n=2)
  x32 = (theta[None] - g).astype(np.float64)  # the inner step, in float32
  delta = theta.astype(np.float64) - x32.mean(0)
  # optax's Nesterov trace: m = Delta; update = Delta + mu m.
  return got, theta - OUTER_LR * (1 + MU) * delta


def test_default_outer_optimizer_is_finite_within_its_stated_bound():
  """Random parameters within +-0.99999 of the Nesterov bound, with the
  extreme pairs (theta = +-P, both workers at -+P, Delta = +-2 P): the
  sync is finite and equals the float64 outer step."""
  p = (1 - 1e-5) * NESTEROV_EDGE
  rng = np.random.default_rng(0)
  theta = rng.uniform(-p, p, 64)
  x = rng.uniform(-p, p, (2, 64))
  theta[:3], x[:, :3] = [p, -p, p], [[-p, p, -p], [-p, p, p]]
  got, want = _default_outer_sync(theta, x)
  assert np.all(np.isfinite(got)), got
  np.testing.assert_allclose(got, np.stack([want, want]), rtol=0,
                             atol=16 * np.finfo(np.float32).eps * F32_MAX)


def test_default_outer_optimizer_overflows_just_beyond_its_bound():
  """theta = +1.001 P_edge, both workers at -1.001 P_edge (inside the
  +-F32_MAX / 2 that an outer SGD without momentum keeps finite): optax's
  (1 + mu) Delta passes F32_MAX and the sync returns -inf, where the exact
  result, theta - 0.7 * 1.9 * 2 theta = -1.66 theta, is finite."""
  p = 1.001 * NESTEROV_EDGE
  assert p < F32_MAX / 2
  got, want = _default_outer_sync(np.full(4, p), np.full((2, 4), -p))
  np.testing.assert_allclose(want, -1.66 * p, rtol=1e-6)  # p in float32
  assert np.all(np.abs(want) < F32_MAX)
  assert np.all(np.isneginf(got)), got


def test_docs_state_the_default_outer_optimizers_bound():
  """docs/optax.md gives the Nesterov bound for the default outer optimizer
  (F32_MAX / 3.8 = 8.95e37), not F32_MAX / 2 for every method."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  with open(os.path.join(root, "docs", "optax.md"), encoding="utf-8") as f:
    text = " ".join(f.read().split())
  mantissa, exponent = f"{NESTEROV_EDGE:.2e}".split("e+")
  assert f"`{mantissa}e{exponent}` for the default outer optimizer" in text
  assert "every method's result is finite" not in text
