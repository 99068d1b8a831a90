"""NoLoCo (optim/noloco.py): the worked example of the issue, an independent
NumPy re-implementation over many rounds (even and odd numbers of workers,
injected and random pairings), the stability range against the spectral
radius of the pair map, and the argument checks.

f_i(x) = 0.5 |x - c_i|^2 (gradient x - c_i), all starting at x = 0, no
noise, float64; the workers run under ``jax.shard_map`` over simulated CPU
devices (``parallel.per_worker``: a worker alone in a round sends nothing,
a partial ``ppermute`` that ``jax.vmap`` cannot batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.optim import noloco
from decentral_jax.topology import pairings

C = np.array([[1.0, 0.0], [3.0, 1.0], [-1.0, 2.0], [0.0, -3.0]])
AXIS = "workers"


def _run(tx, steps, c=C, x0=None):
  """``steps`` steps of ``tx`` on the quadratics; x [steps + 1, n, 2]."""
  mesh = parallel.make_mesh(c.shape[0])
  c = parallel.shard(jnp.asarray(c), mesh)
  x = parallel.shard(jnp.zeros_like(c) if x0 is None else jnp.asarray(x0),
                     mesh)

  def one(p, s, ci):
    u, s = tx.update(p - ci, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(parallel.per_worker(one, mesh))
  state = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  out = [np.asarray(x)]
  for _ in range(steps):
    x, state = step(x, state, c)
    out.append(np.asarray(x))
  return np.stack(out), state


def _group_mean(v, groups):
  """Each row of ``v`` replaced by the mean over its group (NumPy)."""
  out = v.copy()
  for g in groups:
    out[list(g)] = v[list(g)].mean(0)
  return out


def _oracle(steps, lr, h, alpha, beta, gamma, rounds, c=C):
  """The recursion of the issue, literally (two group means), in NumPy:
  inner SGD; every ``h`` steps the outer step with pairs ``rounds[k %
  len(rounds)]`` (workers not named are alone)."""
  n = c.shape[0]
  x = np.zeros_like(c)
  phi = x.copy()
  delta = np.zeros_like(c)
  out = [x.copy()]
  k = 0
  for t in range(steps):
    x = x - lr * (x - c)
    if (t + 1) % h == 0:
      named = {w for g in rounds[k % len(rounds)] for w in g}
      groups = list(rounds[k % len(rounds)]) + [
          (w,) for w in range(n) if w not in named]
      big_delta = x - phi
      delta = (alpha * delta + beta * _group_mean(big_delta, groups)
               - gamma * (phi - _group_mean(phi, groups)))
      phi = phi + delta
      x = phi.copy()
      k += 1
    out.append(x.copy())
  return np.stack(out)


def test_the_worked_example(x64):
  del x64
  sched = pairings.pair_schedule([[(0, 1), (2, 3)]], 4)
  tx = noloco.noloco(optax.sgd(0.1), 2, sched, alpha=0.5, beta=0.7,
                     gamma=0.7, axis_name=AXIS)
  xs, state = _run(tx, 2)
  assert xs.dtype == np.float64
  want = [[0.266, 0.0665], [0.266, 0.0665], [-0.0665, -0.0665],
          [-0.0665, -0.0665]]
  np.testing.assert_allclose(xs[2], want, rtol=0, atol=1e-12)
  np.testing.assert_allclose(state.phi, want, rtol=0, atol=1e-12)
  # After one inner step no outer step yet: x = 0.1 c.
  np.testing.assert_allclose(xs[1], 0.1 * C, rtol=0, atol=1e-15)
  assert np.asarray(state.outer.count).tolist() == [1] * 4


@pytest.mark.parametrize("n,seed", [(4, 0), (5, 3)])
def test_matches_numpy_over_ten_rounds_of_random_pairs(x64, n, seed):
  del x64
  c = np.random.default_rng(7).normal(size=(n, 2)) * 2
  sched = pairings.random_pairs(n, seed=seed, rounds=4)
  # The pairs the schedule should draw, formed here from the same stream.
  rng = np.random.default_rng(seed)
  rounds = []
  for _ in range(4):
    p = rng.permutation(n).tolist()
    rounds.append([(p[j], p[j + 1]) for j in range(0, n - 1, 2)])
  tx = noloco.noloco(optax.sgd(0.1), 3, sched, alpha=0.6, beta=0.8,
                     gamma=0.9, axis_name=AXIS)
  got, _ = _run(tx, 30, c)
  want = _oracle(30, 0.1, 3, 0.6, 0.8, 0.9, rounds, c)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  # The pull towards the pair mean matters: gamma = 0.2 differs.
  other = _oracle(30, 0.1, 3, 0.6, 0.8, 0.2, rounds, c)
  assert np.abs(other[-1] - want[-1]).max() > 1e-3


def test_injected_schedule_and_a_worker_alone(x64):
  del x64
  # Three workers: round 0 pairs (0, 2) (1 alone), round 1 pairs (1, 2).
  c = C[:3]
  rounds = [[(0, 2)], [(1, 2)]]
  sched = pairings.pair_schedule(rounds, 3)
  tx = noloco.noloco(optax.sgd(0.2), 2, sched, alpha=0.5, beta=0.7,
                     axis_name=AXIS)
  got, _ = _run(tx, 12, c)
  np.testing.assert_allclose(
      got, _oracle(12, 0.2, 2, 0.5, 0.7, 0.7, rounds, c), rtol=0,
      atol=1e-12)
  # By hand: worker 1 alone in round 0 moves by beta Delta = 0.7 * 0.36 c_1
  # (two SGD steps of lr 0.2 from 0 give 0.36 c).
  np.testing.assert_allclose(got[2, 1], 0.7 * 0.36 * c[1], rtol=0,
                             atol=1e-15)


def test_pair_difference_follows_the_derived_matrix(x64):
  """No inner progress (lr 0): the pair's phi difference is A^k [0, d0]."""
  del x64
  sched = pairings.pair_schedule([[(0, 1)]], 2)
  x0 = np.array([[1.0, -2.0], [0.0, 0.5]])
  for alpha, gamma in [(0.5, 0.7), (0.9, 0.1), (0.0, 1.9), (0.3, 2.5)]:
    tx = noloco.noloco(optax.sgd(0.0), 1, sched, alpha=alpha, beta=0.7,
                       gamma=gamma, axis_name=AXIS)
    got, _ = _run(tx, 15, np.zeros((2, 2)), x0)
    a = noloco.iteration_matrix(alpha, gamma)
    v = np.stack([np.zeros(2), x0[0] - x0[1]])  # [m; d] per coordinate
    for k in range(1, 16):
      v = a @ v
      np.testing.assert_allclose(got[k, 0] - got[k, 1], v[1], rtol=0,
                                 atol=1e-12)
    # The pair mean never moves without inner progress.
    np.testing.assert_allclose(got[-1].mean(0), x0.mean(0), atol=1e-12)


def test_stability_range_matches_the_spectral_radius():
  grid_a = np.linspace(-0.99, 0.99, 67)
  grid_g = np.linspace(-1.0, 4.5, 111)
  checked = 0
  for a in grid_a:
    for g in grid_g:
      rho = max(abs(np.linalg.eigvals(noloco.iteration_matrix(a, g))))
      if abs(rho - 1) < 1e-9:
        continue  # on the boundary
      assert noloco.is_stable(a, g) == (rho < 1), (a, g, rho)
      checked += 1
  assert checked > 7000
  assert noloco.is_stable(0.5, 0.7)  # the paper's defaults
  assert not noloco.is_stable(0.5, 0.0) and not noloco.is_stable(1.0, 0.5)
  assert not noloco.is_stable(0.5, 3.0) and noloco.is_stable(0.5, 2.99)


def test_state_and_updates_keep_the_params_dtypes():
  sched = pairings.random_pairs(4)
  tx = noloco.noloco(optax.sgd(0.1), 1, sched, axis_name=AXIS)
  x = jnp.zeros((4, 3), jnp.bfloat16)
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  assert state.phi.dtype == jnp.float32
  assert state.outer.opt_state.dtype == jnp.float32
  u, state = jax.vmap(tx.update, axis_name=AXIS)(x + 1, state, x)
  assert u.dtype == jnp.bfloat16 and int(state.count[0]) == 1
  assert int(state.outer.count[0]) == 1
  assert noloco.outer_params(optax.chain(optax.identity()).init(x)) is None
  assert noloco.outer_params((state,)) is state.phi


@pytest.mark.parametrize("kwargs,words", [
    (dict(sync_every=0), "sync_every must be an int >= 1"),
    (dict(inner="adam"), "inner must be an optax.GradientTransformation"),
    (dict(alpha=1.0), r"alpha=1.0 must be in \[0, 1\)"),
    (dict(alpha=-0.1), "alpha must be a finite number >= 0"),
    (dict(beta=0.0), "beta=0.0 must be > 0"),
    (dict(gamma=0.0), "gamma=0.0 with alpha=0.5 is outside NoLoCo's "
     "stability range 0 < gamma < 2 \\(1 \\+ alpha\\) = 3"),
    (dict(gamma=3.2), "gamma=3.2 with alpha=0.5 is outside"),
    (dict(alpha=0.0, beta=2.5), "gamma=2.5 with alpha=0.0 is outside"),
    (dict(gamma=float("inf")), "gamma must be a finite number"),
    (dict(pairing=topology.make("static_ring", 4)), "pairing 'static_ring':"
     " round 0 is not a set of group means"),
    (dict(pairing=topology.make("complete", 4)), "round 0 has a group of 4 "
     "workers; at most 2"),
    (dict(pairing="random"), "pairing must be a decentral_jax.topology"),
    (dict(bucket_bytes=-1), "bucket_bytes"),
])
def test_bad_arguments_are_refused_by_name(kwargs, words):
  args = dict(inner=optax.sgd(0.1), sync_every=2,
              pairing=pairings.random_pairs(4))
  args.update(kwargs)
  with pytest.raises(ValueError, match=words):
    noloco.noloco(**args)


def test_update_needs_params_float_leaves_and_the_right_axis():
  tx = noloco.noloco(optax.sgd(0.1), 2, pairings.random_pairs(4))
  with pytest.raises(ValueError, match="noloco needs the current "
                     "parameters"):
    tx.update(jnp.zeros(2), tx.init(jnp.zeros(2)))
  with pytest.raises(ValueError, match="noloco"):
    tx.init(jnp.zeros(2, jnp.int32))
  tx3 = noloco.noloco(optax.sgd(0.1), 1, pairings.random_pairs(3),
                      axis_name=AXIS)
  with pytest.raises(ValueError, match="n_workers=3 but the worker axis"):
    _run(tx3, 1)
  # Under jax.vmap (one worker alone needs shard_map; pairs only here).
  tx4 = noloco.noloco(optax.sgd(0.1), 1, pairings.random_pairs(4),
                      axis_name=AXIS)
  x = jnp.ones((4, 2))
  state = jax.vmap(tx4.init, axis_name=AXIS)(x)
  u, _ = jax.vmap(tx4.update, axis_name=AXIS)(x, state, x)
  assert u.shape == (4, 2)


def test_virtual_workers_match_the_oracle(x64):
  """8 workers, 2 per device (a virtual layout: the pair means of workers
  on one device are local, the others one exchange per device pair)."""
  del x64
  n = 8
  c = np.random.default_rng(2).normal(size=(n, 2))
  sched = pairings.random_pairs(n, seed=4, rounds=3)
  rounds = [r.groups for r in sched.rounds]
  mesh = parallel.make_mesh(n, workers_per_device=2)
  axis = parallel.worker_axis(mesh)
  tx = noloco.noloco(optax.sgd(0.1), 2, sched, axis_name=axis)

  def one(p, s, ci):
    u, s = tx.update(p - ci, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(parallel.per_worker(one, mesh))
  x = parallel.shard(jnp.zeros((n, 2)), mesh)
  cs = parallel.shard(jnp.asarray(c), mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  for _ in range(12):
    x, state = step(x, state, cs)
  want = _oracle(12, 0.1, 2, 0.5, 0.7, 0.7, rounds, c)
  np.testing.assert_allclose(np.asarray(x), want[-1], rtol=0, atol=1e-12)
