"""Gradient tracking (optim/gradient_tracking.py): the worked example of the
issue in both forms, independent NumPy re-implementations over many steps
(D-SGD and Adam), the tracker's mean, convergence to the exact optimum where
D-SGD stalls at its heterogeneity floor, and the argument checks.

M = 4 workers, f_i(x) = 0.5 |x - c_i|^2 (gradient x - c_i), all starting at
x = 0, no noise, float64; the workers are a ``jax.vmap`` with an axis name
(one test runs ``jax.shard_map`` over simulated devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax.optim import gradient_tracking as gt
from decentral_jax.optim import transforms
from decentral_jax.topology import schedules as topology_lib

C = np.array([[1.0, 0.0], [3.0, 1.0], [-1.0, 2.0], [0.0, -3.0]])
AXIS = "workers"
RING = topology_lib.make("static_ring", 4)  # 1/3 self and each neighbour
# The ring's mixing matrix written out by hand (not read from the topology).
W_RING = np.array([[1, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1],
                   [1, 0, 1, 1]]) / 3.0


def _run(tx, steps, c=C, round_index=False):
  """``steps`` steps of ``tx``; x [steps + 1, 4, 2] and y [steps, 4, 2]."""
  c = jnp.asarray(c)
  x = jnp.zeros_like(c)

  def one(p, s, ci, r):
    u, s = tx.update(p - ci, s, p, **({"round_index": r} if round_index
                                      else {}))
    return optax.apply_updates(p, u), s

  steps_of = {}
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  xs, ys = [np.asarray(x)], []
  for k in range(steps):
    r = k % 2 if round_index else None
    if r not in steps_of:
      steps_of[r] = jax.jit(jax.vmap(lambda p, s, ci, r=r: one(p, s, ci, r),
                                     axis_name=AXIS))
    x, state = steps_of[r](x, state, c)
    xs.append(np.asarray(x))
    ys.append(np.asarray(transforms.find_states(
        state, gt.GradientTrackingState)[0].tracker))
  return np.stack(xs), np.stack(ys)


def _oracle(steps, lr, form, mats=(W_RING,), c=C):
  """DIGing (cta) / Koloskova et al. Alg. 1 (atc) in NumPy, float64."""
  x = np.zeros_like(c)
  y = np.zeros_like(c)
  g_prev = np.zeros_like(c)
  xs, ys = [x.copy()], []
  for k in range(steps):
    w = mats[k % len(mats)]
    g = x - c
    y = w @ y + g - g_prev
    g_prev = g
    x = w @ x - lr * y if form == "cta" else w @ (x - lr * y)
    xs.append(x.copy())
    ys.append(y.copy())
  return np.stack(xs), np.stack(ys)


@pytest.mark.parametrize("form,want", [
    ("cta", [[0.1, 0.0], [0.3, 0.1], [-0.1, 0.2], [0.0, -0.3]]),
    ("atc", [[0.4 / 3, -0.2 / 3], [0.1, 0.1], [0.2 / 3, 0.0],
             [0.0, -0.1 / 3]])])
def test_the_worked_example(x64, form, want):
  del x64
  xs, ys = _run(gt.gradient_tracking_sgd(0.1, RING, form=form,
                                         axis_name=AXIS), 1)
  assert xs.dtype == np.float64
  np.testing.assert_allclose(xs[1], want, rtol=0, atol=1e-15)
  np.testing.assert_allclose(ys[0], -C, rtol=0, atol=0)  # y_0 = g(x_0)


@pytest.mark.parametrize("form", gt.TRACKING_FORMS)
def test_matches_numpy_and_tracks_the_mean_gradient(x64, form):
  del x64
  xs, ys = _run(gt.gradient_tracking_sgd(0.1, RING, form=form,
                                         axis_name=AXIS), 200)
  want_x, want_y = _oracle(200, 0.1, form)
  np.testing.assert_allclose(xs, want_x, rtol=0, atol=1e-12)
  np.testing.assert_allclose(ys, want_y, rtol=0, atol=1e-12)
  # The mean of y is the mean of the gradients g(x_k) at every step.
  grads = xs[:-1] - C
  np.testing.assert_allclose(ys.mean(1), grads.mean(1), rtol=0, atol=1e-14)
  # Every worker reaches the mean of c, the minimiser of sum_i f_i.
  err = np.abs(xs[-1] - C.mean(0)).max()
  assert err < 1e-9, err
  assert np.abs(xs[20] - C.mean(0)).max() > 1e-3  # it is still moving


@pytest.mark.parametrize("form", gt.TRACKING_FORMS)
def test_the_convergence_of_the_issue(x64, form):
  """The worked example's error after 200 steps, 5.29e-10: the largest
  distance of a worker from the mean of c, in both forms."""
  del x64
  xs, _ = _run(gt.gradient_tracking_sgd(0.1, RING, form=form,
                                        axis_name=AXIS), 200)
  err = np.linalg.norm(xs[-1] - C.mean(0), axis=1).max()
  np.testing.assert_allclose(err, 5.29e-10, rtol=5e-3)


def test_d_sgd_stalls_at_its_floor_and_tracking_does_not(x64):
  """Constant lr, distinct c_i: D-SGD ``x+ = W x - lr (x - c)`` converges
  to ``lr ((1 + lr) I - W)^{-1} c``, which is not the optimum (the spread
  of the c_i leaves a consensus error); gradient tracking reaches it."""
  del x64
  lr = 0.1
  dsgd = optax.chain(optax.sgd(lr), transforms.gossip_mixing(RING, AXIS))
  xs_d, _ = _run_plain(dsgd, 400)
  floor = lr * np.linalg.solve((1 + lr) * np.eye(4) - W_RING, C)
  np.testing.assert_allclose(xs_d[-1], floor, rtol=0, atol=1e-10)
  stuck = np.abs(xs_d[-1] - C.mean(0)).max()
  assert stuck > 0.1, stuck
  xs_t, _ = _run(gt.gradient_tracking_sgd(lr, RING, axis_name=AXIS), 400)
  assert np.abs(xs_t[-1] - C.mean(0)).max() < 1e-12


def _run_plain(tx, steps):
  """``_run`` for a transform without a tracker (D-SGD)."""
  c = jnp.asarray(C)
  x = jnp.zeros_like(c)

  def one(p, s, ci):
    u, s = tx.update(p - ci, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.vmap(one, axis_name=AXIS))
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  xs = [np.asarray(x)]
  for _ in range(steps):
    x, state = step(x, state, c)
    xs.append(np.asarray(x))
  return np.stack(xs), None


def _adam_oracle(steps, lr, form, b1, b2, eps, wd, mats=(W_RING,)):
  """Adam on the tracker (bias-corrected, eps outside the root, decoupled
  decay of the point Adam steps from), mixed cta or atc, in NumPy."""
  x = np.zeros_like(C)
  y = np.zeros_like(C)
  g_prev = np.zeros_like(C)
  m = np.zeros_like(C)
  v = np.zeros_like(C)
  xs = [x.copy()]
  for k in range(steps):
    w = mats[k % len(mats)]
    g = x - C
    y = w @ y + g - g_prev
    g_prev = g
    m = b1 * m + (1 - b1) * y
    v = b2 * v + (1 - b2) * y * y
    d = (m / (1 - b1**(k + 1))) / (np.sqrt(v / (1 - b2**(k + 1))) + eps)
    base = w @ x if form == "cta" else x
    stepped = base - lr * (d + wd * base)
    x = stepped if form == "cta" else w @ stepped
    xs.append(x.copy())
  return np.stack(xs)


@pytest.mark.parametrize("form", gt.TRACKING_FORMS)
def test_adam_on_the_tracker_matches_numpy(x64, form):
  """DAdam with tracking on a time-varying schedule (one-peer exponential
  at n = 4: two rounds), with weight decay on every leaf."""
  del x64
  topo = topology_lib.make("one_peer_exp", 4)
  # Round r pairs worker i with i XOR 2**r, weights 1/2.
  mats = [0.5 * (np.eye(4) + np.eye(4)[[i ^ s for i in range(4)]])
          for s in (1, 2)]
  for k, w in enumerate(mats):  # the hand-written rounds are the schedule's
    np.testing.assert_allclose(topo.mixing_matrix(k), w, rtol=0, atol=0)
  tx = gt.gradient_tracking_adamw(0.05, topo, form=form, b1=0.8, b2=0.95,
                                  eps=1e-6, weight_decay=0.1, mask=None,
                                  axis_name=AXIS)
  xs, _ = _run(tx, 30)
  want = _adam_oracle(30, 0.05, form, 0.8, 0.95, 1e-6, 0.1, mats)
  np.testing.assert_allclose(xs, want, rtol=0, atol=1e-12)


def test_static_rounds_give_the_in_graph_trajectory(x64):
  """``round_index`` (compiled per round) against the in-graph round:
  equal up to XLA's fusion of the switch under vmap (an ulp)."""
  del x64
  topo = topology_lib.make("one_peer_exp", 4)
  mats = [0.5 * (np.eye(4) + np.eye(4)[[i ^ s for i in range(4)]])
          for s in (1, 2)]
  tx = gt.gradient_tracking_sgd(0.1, topo, axis_name=AXIS)
  a, ya = _run(tx, 8)
  b, yb = _run(tx, 8, round_index=True)
  want_x, want_y = _oracle(8, 0.1, "cta", mats)
  for x, y in ((a, ya), (b, yb)):
    np.testing.assert_allclose(x, want_x, rtol=0, atol=1e-14)
    np.testing.assert_allclose(y, want_y, rtol=0, atol=1e-14)


def test_shard_map_with_buckets_follows_vmap(x64):
  """On 4 simulated devices, bucketed gossip of two leaves: the same
  trajectory as the per-leaf vmap run."""
  del x64
  require_devices(4)
  mesh = parallel.make_mesh(4)
  axis = parallel.worker_axis(mesh)
  tx = gt.gradient_tracking_sgd(0.1, RING, form="atc", axis_name=axis,
                                bucket_bytes=1 << 20)
  c = parallel.shard({"a": jnp.asarray(C),
                      "b": jnp.asarray(C[:, :1] * 2.0)}, mesh)

  def one(p, s, ci):
    u, s = tx.update(jax.tree.map(jnp.subtract, p, ci), s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(parallel.per_worker(one, mesh))
  x = parallel.shard(jax.tree.map(jnp.zeros_like, c), mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  for _ in range(12):
    x, state = step(x, state, c)
  want, _ = _oracle(12, 0.1, "atc")
  np.testing.assert_allclose(np.asarray(x["a"]), want[-1], rtol=0,
                             atol=1e-13)
  want_b, _ = _oracle(12, 0.1, "atc", c=C[:, :1] * 2.0)
  np.testing.assert_allclose(np.asarray(x["b"]), want_b[-1], rtol=0,
                             atol=1e-13)


def test_state_and_updates_keep_the_dtypes():
  tx = gt.gradient_tracking(RING, AXIS)
  g = jnp.ones((4, 3), jnp.bfloat16)
  state = jax.vmap(tx.init, axis_name=AXIS)(g)
  assert state.tracker.dtype == jnp.bfloat16 and state.count.dtype == jnp.int32
  y, state = jax.vmap(tx.update, axis_name=AXIS)(g, state)
  assert y.dtype == jnp.bfloat16 and int(state.count[0]) == 1
  np.testing.assert_array_equal(np.asarray(y, np.float32), 1.0)


@pytest.mark.parametrize("kwargs,words", [
    (dict(form="both"), "form must be one of cta, atc, got 'both'"),
    (dict(topology="ring"), "topology"),
    (dict(comm_dtype=jnp.int8), "comm_dtype"),
    (dict(bucket_bytes=-1), "bucket_bytes must be an int >= 0"),
    (dict(learning_rate=-0.1), "learning_rate must be a finite number"),
])
def test_bad_arguments_are_refused_by_name(kwargs, words):
  args = dict(learning_rate=0.1, topology=RING)
  args.update(kwargs)
  with pytest.raises(ValueError, match=words):
    gt.gradient_tracking_sgd(**args)


def test_faults_and_integer_leaves_are_refused():
  tx = gt.gradient_tracking(RING, AXIS)
  with pytest.raises(ValueError, match="gradient_tracking: leaf"):
    tx.init(jnp.zeros(2, jnp.int32))
  state = jax.vmap(tx.init, axis_name=AXIS)(jnp.zeros((4, 2)))
  with pytest.raises(ValueError, match="gradient_tracking does not run over "
                     "slow or failing workers"):
    jax.vmap(lambda g, s: tx.update(g, s, alive=jnp.ones(4, bool)),
             axis_name=AXIS)(jnp.zeros((4, 2)), state)
  with pytest.raises(ValueError, match="form must be one of cta, atc"):
    gt.gradient_tracking_adamw(0.1, RING, form="CTA")
