"""Pipelined gossip (optim.pipelined) against a float64 NumPy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology

N = 8
STEPS = 9


def _problem(seed=0):
  """Worker i's least squares 0.5 ||X_i w + b - Y_i||^2 / rows."""
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(N, 5, 3))
  ys = rng.normal(size=(N, 5, 2))
  w0 = rng.normal(size=(N, 2, 3))  # different start per worker
  b0 = rng.normal(size=(N, 2))
  return xs, ys, {"w": w0, "b": b0}


def _np_grad(p, x, y):
  r = x @ p["w"].T + p["b"] - y
  return {"w": r.T @ x / len(x), "b": r.sum(0) / len(x)}


def _np_mix(w_matrix, tree):
  return {k: np.einsum("ij,j...->i...", w_matrix, v) for k, v in tree.items()}


def _oracle(topo, lr, *, adam, wd=0.0, steps=STEPS):
  """The module's recursion written out: x_{k+1} = s_k + u_k,
  s_{k+1} = W_{k//2} x_k + u_k, s_0 = x_0; u_k = -lr (d_k + wd mask s_k)
  with d_k Adam's direction (b1 0.9, b2 0.999, eps 1e-8) or the gradient."""
  xs, ys, x = _problem()
  s = {k: v.copy() for k, v in x.items()}
  m = {k: np.zeros_like(v) for k, v in x.items()}
  v2 = {k: np.zeros_like(v) for k, v in x.items()}
  out = []
  for k in range(steps):
    g = [_np_grad({kk: x[kk][i] for kk in x}, xs[i], ys[i]) for i in range(N)]
    g = {kk: np.stack([gi[kk] for gi in g]) for kk in x}
    u = {}
    for kk in x:
      if adam:
        m[kk] = 0.9 * m[kk] + 0.1 * g[kk]
        v2[kk] = 0.999 * v2[kk] + 0.001 * g[kk] ** 2
        d = (m[kk] / (1 - 0.9 ** (k + 1))) / (
            np.sqrt(v2[kk] / (1 - 0.999 ** (k + 1))) + 1e-8)
      else:
        d = g[kk]
      decay = wd * s[kk] if x[kk].ndim == 3 else 0.0  # matrices only
      u[kk] = -lr * (d + decay)
    mixed = _np_mix(topo.mixing_matrix(k // 2), x)
    x = {kk: s[kk] + u[kk] for kk in x}
    s = {kk: mixed[kk] + u[kk] for kk in x}
    out.append(x)
  return out


def _run(tx, steps=STEPS, static_period=None, state=None, start=0,
         params=None):
  """``steps`` steps of ``tx`` on the problem from step ``start``; with
  ``static_period`` the round index is the step modulo 2 x period."""
  mesh = parallel.make_mesh(N)
  xs, ys, x0 = _problem()

  def step(p, s, x, y, round_index=None):
    g = jax.grad(lambda q: 0.5 * jnp.sum(
        (x @ q["w"].T + q["b"] - y) ** 2) / x.shape[0])(p)
    extra = {} if round_index is None else {"round_index": round_index}
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s

  p = params if params is not None else parallel.shard(
      jax.tree.map(jnp.asarray, x0), mesh)
  s = state if state is not None else jax.jit(
      parallel.per_worker(tx.init, mesh))(p)
  xs_d, ys_d = parallel.shard(jnp.asarray(xs), mesh), parallel.shard(
      jnp.asarray(ys), mesh)
  jitted = {}
  out = []
  for k in range(start, start + steps):
    r = None if static_period is None else k % (2 * static_period)
    if r not in jitted:
      jitted[r] = jax.jit(parallel.per_worker(
          lambda p, s, x, y, r=r: step(p, s, x, y, r), mesh))
    p, s = jitted[r](p, s, xs_d, ys_d)
    out.append(jax.tree.map(np.asarray, p))
  return out, p, s


def _worst(got, want):
  return max(np.abs(g[k] - w[k]).max()
             for g, w in zip(got, want) for k in ("w", "b"))


@pytest.mark.parametrize("adam", [
    pytest.param(False, id="dsgd"),
    pytest.param(True, id="dadam", marks=pytest.mark.slow)])
def test_matches_numpy_oracle_on_one_peer_exponential(adam, x64):
  del x64
  require_devices(N)
  topo = topology.one_peer_exp(N)
  axis = parallel.worker_axis(parallel.make_mesh(N))
  if adam:
    tx = optim.pipelined_adamw(0.05, topo, axis_name=axis, weight_decay=0.1)
  else:
    tx = optim.pipelined_gossip(optax.sgd(0.1), topo, axis)
  want = _oracle(topo, 0.05 if adam else 0.1, adam=adam,
                 wd=0.1 if adam else 0.0)
  got, _, _ = _run(tx)
  assert got[0]["w"].dtype == np.float64
  assert _worst(got, want) <= 1e-12
  # Static rounds (the step modulo 2 x period, compiled alone): same values.
  got_static, _, _ = _run(tx, static_period=topo.period)
  assert _worst(got_static, want) <= 1e-12


def test_mean_evolves_as_the_sum_of_mean_updates(x64):
  """With a constant update u_k = -lr g_k(x_k), mean(x_{k+1}) = mean(x_k) +
  mean(u_k): checked on the NumPy-independent side (the run's own
  trajectory and its own gradients)."""
  del x64
  require_devices(N)
  topo = topology.one_peer_exp(N)
  axis = parallel.worker_axis(parallel.make_mesh(N))
  got, _, _ = _run(optim.pipelined_gossip(optax.sgd(0.1), topo, axis))
  xs, ys, x0 = _problem()
  prev = x0
  for x in got:
    g = [_np_grad({k: prev[k][i] for k in prev}, xs[i], ys[i])
         for i in range(N)]
    for k in ("w", "b"):
      mean_u = -0.1 * np.mean([gi[k] for gi in g], axis=0)
      np.testing.assert_allclose(x[k].mean(0), prev[k].mean(0) + mean_u,
                                 rtol=0, atol=1e-12)
    prev = x


def test_resume_mid_run_is_bit_exact():
  require_devices(N)
  topo = topology.one_peer_exp(N)
  axis = parallel.worker_axis(parallel.make_mesh(N))
  tx = optim.pipelined_adamw(0.05, topo, axis_name=axis, weight_decay=0.1)
  full, _, _ = _run(tx, steps=8)
  first, p, s = _run(tx, steps=3)
  # Round-trip the state through host memory (as a checkpoint does).
  host = jax.tree.map(np.asarray, (p, s))
  mesh = parallel.make_mesh(N)
  p2, s2 = jax.tree.map(lambda a: parallel.shard(jnp.asarray(a), mesh), host)
  rest, _, _ = _run(tx, steps=5, state=s2, start=3, params=p2)
  for a, b in zip(full, first + rest):
    for k in ("w", "b"):
      np.testing.assert_array_equal(a[k], b[k])


def test_refuses_fault_masks_and_missing_params():
  topo = topology.one_peer_exp(N)
  tx = optim.pipelined_gossip(optax.sgd(0.1), topo)
  p = {"w": jnp.zeros(2)}
  s = tx.init(p)
  with pytest.raises(ValueError, match="needs the current parameters"):
    tx.update(p, s)
  with pytest.raises(ValueError, match="fault masks"):
    tx.update(p, s, p, alive=jnp.ones(N, bool))
  with pytest.raises(ValueError, match="inner"):
    optim.pipelined_gossip("sgd", topo)
