"""Optimizers: reference trajectories of decent-dp, AccumAdam, compositions."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import FIXTURES, require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from helpers import np_accum_adam


# --------------------------------------------------------------------------
# Golden trajectories recorded from the authors' library (float64).
# --------------------------------------------------------------------------


def _least_squares(p, x, y):
  pred = x @ p["weight"].T + p["bias"]
  return 0.5 * jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


def _run_reference(ref, topo, axis_mesh=None):
  n = int(ref["n_workers"])
  mesh = axis_mesh or parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  tx = optim.decentralized_adamw(
      float(ref["lr"]), topo, b1=float(ref["b1"]), b2=float(ref["b2"]),
      eps=float(ref["eps"]), weight_decay=float(ref["weight_decay"]),
      accum_steps=int(ref["accum_steps"]), axis_name=axis)

  def step(p, s, x, y):
    g = jax.grad(_least_squares)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(parallel.per_worker(step, mesh))
  p = parallel.replicate({"weight": jnp.asarray(ref["init_weight"]),
                          "bias": jnp.asarray(ref["init_bias"])}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  first = int(ref["first_step"])
  n_rec = ref["weight_after_step"].shape[0]
  worst = 0.0
  for k in range(ref["inputs"].shape[0]):
    p, s = step(p, s, parallel.shard(jnp.asarray(ref["inputs"][k]), mesh),
                parallel.shard(jnp.asarray(ref["targets"][k]), mesh))
    j = k - first
    if 0 <= j < n_rec:
      w, b = np.asarray(p["weight"]), np.asarray(p["bias"])
      assert w.dtype == np.float64
      worst = max(worst, np.abs(w - ref["weight_after_step"][j]).max(),
                  np.abs(b - ref["bias_after_step"][j]).max())
  return worst


REFERENCE_FILES = sorted(glob.glob(os.path.join(FIXTURES, "*.npz")))


def test_reference_files_present():
  assert len(REFERENCE_FILES) == 5, REFERENCE_FILES


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=os.path.basename)
def test_reproduces_decent_dp_trajectory(path, x64):
  del x64
  ref = np.load(path)
  require_devices(int(ref["n_workers"]))
  # The recorded schedule, step by step (mixing[0] = I, then the library's
  # round order), as a custom topology.
  topo = topology.from_matrices(list(ref["mixing"]))
  assert _run_reference(ref, topo) <= 1e-10


def test_aer_reference_on_node_aware_mesh(x64):
  """The hierarchical (nodes, local) realisation matches the reference too."""
  del x64
  ref = np.load(os.path.join(FIXTURES, "n8_alternating-exp-ring_lws2_accumadamw.npz"))
  require_devices(8)
  topo = topology.from_matrices(list(ref["mixing"]), local_size=2)
  mesh = parallel.make_mesh(8, 2, node_aware=True)
  assert _run_reference(ref, topo, mesh) <= 1e-10


# --------------------------------------------------------------------------
# AccumAdam.
# --------------------------------------------------------------------------


def _run_scalar(tx, grads, x0=0.0):
  params = jnp.array(x0, jnp.float32)
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = update(jnp.array(g, jnp.float32), state, params)
    params = optax.apply_updates(params, u)
    out.append(float(params))
  return out


def test_accum_adam_worked_example():
  grads = [1.0, -2.0, 0.5, 3.0]
  lr = 0.1
  accum = optax.chain(optim.scale_by_accum_adam(accum_steps=2),
                      optax.scale_by_learning_rate(lr))
  np.testing.assert_allclose(_run_scalar(accum, grads),
                             [-0.1, 0.0, -0.005263, -0.067655], atol=1e-6)
  one = optax.chain(optim.scale_by_accum_adam(accum_steps=1),
                    optax.scale_by_learning_rate(lr))
  np.testing.assert_allclose(_run_scalar(one, grads),
                             _run_scalar(optax.adam(lr), grads), atol=1e-7)


def test_accum_steps_1_equals_optax_scale_by_adam():
  rng = np.random.default_rng(0)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
  ours, theirs = optim.scale_by_accum_adam(0.8, 0.95, 1e-6), optax.scale_by_adam(0.8, 0.95, 1e-6)
  s1, s2 = ours.init(params), theirs.init(params)
  u1f, u2f = jax.jit(ours.update), jax.jit(theirs.update)
  for _ in range(6):
    g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    u1, s1 = u1f(g, s1)
    u2, s2 = u2f(g, s2)
    for k in params:
      np.testing.assert_allclose(np.asarray(u1[k]), np.asarray(u2[k]), rtol=1e-7, atol=1e-7)


def test_accum_adam_against_numpy(x64):
  del x64
  rng = np.random.default_rng(1)
  grads = rng.normal(size=(11, 5))
  tx = optim.scale_by_accum_adam(0.9, 0.98, 1e-8, accum_steps=3)
  state = tx.init(jnp.zeros(5, jnp.float64))
  out = []
  for g in grads:
    d, state = tx.update(jnp.asarray(g), state)
    out.append(np.asarray(d))
  np.testing.assert_allclose(np.array(out), np_accum_adam(grads, 0.9, 0.98, 1e-8, 3),
                             rtol=1e-12, atol=1e-14)
  assert int(state.count) == 11


def test_horizon_matched_betas_worked_example():
  # T = 4: 0.9**4 = 0.6561, 0.95**4 = 0.81450625 (by hand).
  b1, b2 = optim.horizon_matched_betas(0.9, 0.95, 4)
  assert b1 == pytest.approx(0.6561, abs=1e-15)
  assert b2 == pytest.approx(0.81450625, abs=1e-15)
  assert optim.horizon_matched_betas(0.9, 0.95, 1) == (0.9, 0.95)
  for bad in (0, 2.7, True):
    with pytest.raises(ValueError, match="accum_steps"):
      optim.horizon_matched_betas(0.9, 0.95, bad)


def test_accum_adam_per_step_betas_against_numpy(x64):
  del x64
  rng = np.random.default_rng(3)
  grads = rng.normal(size=(13, 5))
  tx = optim.scale_by_accum_adam(0.9, 0.95, 1e-8, accum_steps=4,
                                 beta_convention="per_step")
  state = tx.init(jnp.zeros(5, jnp.float64))
  out = []
  for g in grads:
    d, state = tx.update(jnp.asarray(g), state)
    out.append(np.asarray(d))
  # The per-window recursion with the hand-computed decays b**4.
  want = np_accum_adam(grads, 0.6561, 0.81450625, 1e-8, 4)
  np.testing.assert_allclose(np.array(out), want, rtol=1e-12, atol=1e-14)
  per_window = np_accum_adam(grads, 0.9, 0.95, 1e-8, 4)
  assert np.max(np.abs(np.array(out) - per_window)) > 1e-3  # not a no-op


def test_accum_adam_per_step_betas_with_t1_is_adam():
  rng = np.random.default_rng(4)
  ours = optim.scale_by_accum_adam(0.8, 0.95, 1e-6, beta_convention="per_step")
  theirs = optax.scale_by_adam(0.8, 0.95, 1e-6)
  s1, s2 = ours.init(jnp.zeros(3)), theirs.init(jnp.zeros(3))
  for _ in range(4):
    g = jnp.asarray(rng.normal(size=3), jnp.float32)
    u1, s1 = ours.update(g, s1)
    u2, s2 = theirs.update(g, s2)
    # Bit for bit: with T = 1 the betas are not raised to a power at all.
    np.testing.assert_array_equal(np.asarray(u1), np.asarray(u2))


@pytest.mark.parametrize("convention", ["per_window", "per_step"])
def test_accum_adam_window_at_int32_max(convention):
  """T = 2**31 - 1 (the top of the accepted range): every step is in window 1.

  The window index ceil(t / T) must not wrap the int32 counter (t + T - 1
  does from t = 2), which made the direction NaN or 0 from step 2.
  """
  big_t = 2**31 - 1
  grads = np.array([[1.5, -2.0], [-0.25, 3.0], [0.5, 0.75]])
  tx = optim.scale_by_accum_adam(0.9, 0.999, 1e-8, accum_steps=big_t,
                                 beta_convention=convention)
  state = tx.init(jnp.zeros(2, jnp.float32))
  update = jax.jit(tx.update)
  out = []
  for g in grads:
    d, state = update(jnp.asarray(g, jnp.float32), state)
    out.append(np.asarray(d))
  # In window 1 with M = V = 0 (no window ends): m_hat = g, v_hat = g**2,
  # so d = g / (|g| + eps) whatever the decays (by hand; per_step's
  # 0.9**T is 0 in float32 and still gives m_hat = g); float32 rounding of
  # the decays keeps it within 1e-5 of that.
  np.testing.assert_allclose(np.array(out), grads / (np.abs(grads) + 1e-8),
                             rtol=1e-4)
  np.testing.assert_allclose(np.array(out),
                             np_accum_adam(grads, 0.9, 0.999, 1e-8, big_t),
                             rtol=1e-4)
  assert int(state.count) == 3


def test_accum_adam_bad_beta_convention():
  with pytest.raises(ValueError, match="beta_convention must be one of"):
    optim.scale_by_accum_adam(accum_steps=2, beta_convention="per_epoch")


@pytest.mark.parametrize("kwargs,match", [
    ({"accum_steps": 0}, "accum_steps"), ({"accum_steps": 2.0}, "accum_steps"),
    ({"b1": 1.0}, "b1"), ({"b2": -0.1}, "b2"), ({"eps": -1.0}, "eps")])
def test_accum_adam_bad_hyperparameters(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optim.scale_by_accum_adam(**kwargs)


# --------------------------------------------------------------------------
# Decentralized compositions vs dense NumPy oracles.
# --------------------------------------------------------------------------


def _quadratic_setup(n, seed=0):
  rng = np.random.default_rng(seed)
  targets = rng.normal(size=(n, 4)).astype(np.float32)
  x0 = rng.normal(size=(4,)).astype(np.float32)
  return targets, x0


def _grad(x, c):  # loss_i = 0.5 ||x - c_i||^2 (+ a matrix leaf for decay)
  return x - c


def _run_chain(tx, n, steps, targets, x0, mesh=None):
  mesh = mesh or parallel.make_mesh(n)

  def step(p, s, c):
    g = jax.tree.map(lambda x: _grad(x, c), p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  traces = []

  def counted(*a):
    traces.append(1)
    return step(*a)

  stepf = jax.jit(parallel.per_worker(counted, mesh), donate_argnums=(0, 1))
  p = parallel.replicate({"x": jnp.asarray(x0)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  c = parallel.shard(jnp.asarray(targets), mesh)
  hist = []
  for _ in range(steps):
    p, s = stepf(p, s, c)
    hist.append(np.asarray(p["x"]))
  return np.array(hist), len(traces), s


def test_dsgd_chain_equals_dense_oracle():
  n = 8
  require_devices(n)
  topo = topology.make("ring", n)
  targets, x0 = _quadratic_setup(n)
  lr, mom = 0.1, 0.9
  tx = optax.chain(optax.sgd(lr, momentum=mom), optim.gossip_mixing(topo))
  hist, n_traces, _ = _run_chain(tx, n, 6, targets, x0)
  assert n_traces == 1
  x = np.broadcast_to(x0, (n, 4)).astype(np.float64)
  m = np.zeros_like(x)
  for k in range(6):
    g = x - targets
    m = g + mom * m
    x = topo.mixing_matrix(k) @ x - lr * m
    np.testing.assert_allclose(hist[k], x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mix_after_update", [False, True])
def test_dadam_equals_dense_oracle(mix_after_update):
  n = 6
  require_devices(n)
  topo = topology.make("ring", n)
  targets, x0 = _quadratic_setup(n, seed=2)
  lr, wd = 0.05, 0.1
  tx = optim.decentralized_adamw(lr, topo, b1=0.9, b2=0.99, weight_decay=wd,
                                 mask=lambda p: jax.tree.map(lambda _: True, p),
                                 accum_steps=2, mix_after_update=mix_after_update)
  hist, n_traces, state = _run_chain(tx, n, 6, targets, x0)
  assert n_traces == 1  # period-2 schedule, 6 steps, one trace
  np.testing.assert_array_equal(np.asarray(optim.round_count(state)), np.full(n, 6))
  x = np.broadcast_to(x0, (n, 4)).astype(np.float64)
  grads = []
  for k in range(6):
    grads.append(x - targets)
    d = np.stack([np_accum_adam(np.array(grads)[:, i], 0.9, 0.99, 1e-8, 2)[-1]
                  for i in range(n)])
    w = topo.mixing_matrix(k)
    if mix_after_update:
      x = w @ ((1 - lr * wd) * x - lr * d)
    else:
      x = (1 - lr * wd) * (w @ x) - lr * d
    np.testing.assert_allclose(hist[k], x, rtol=2e-5, atol=2e-5)


def test_accum_adamw_per_step_betas_equals_dense_oracle():
  n = 4
  require_devices(n)
  topo = topology.make("ring", n)
  targets, x0 = _quadratic_setup(n, seed=6)
  lr = 0.05
  tx = optim.decentralized_adamw(lr, topo, b1=0.9, b2=0.99, weight_decay=0.0,
                                 accum_steps=2, beta_convention="per_step")
  hist, _, _ = _run_chain(tx, n, 5, targets, x0)
  x = np.broadcast_to(x0, (n, 4)).astype(np.float64)
  grads = []
  for k in range(5):
    grads.append(x - targets)
    # Decays per window of 2 steps: 0.9**2 = 0.81, 0.99**2 = 0.9801.
    d = np.stack([np_accum_adam(np.array(grads)[:, i], 0.81, 0.9801, 1e-8,
                                 2)[-1] for i in range(n)])
    x = topo.mixing_matrix(k) @ x - lr * d
    np.testing.assert_allclose(hist[k], x, rtol=2e-5, atol=2e-5)


def test_single_worker_dadam_is_adamw():
  require_devices(1)
  targets, x0 = _quadratic_setup(1, seed=5)
  lr = 0.01
  ours = optim.decentralized_adamw(lr, topology.make("one_peer_exp", 1),
                                   weight_decay=0.1, mask=None, b2=0.95)
  hist, _, _ = _run_chain(ours, 1, 5, targets, x0)
  ref_tx = optax.adamw(lr, b2=0.95, weight_decay=0.1)
  x = jnp.asarray(x0)
  s = ref_tx.init(x)
  for k in range(5):
    u, s = ref_tx.update(x - targets[0], s, x)
    x = optax.apply_updates(x, u)
    np.testing.assert_allclose(hist[k][0], np.asarray(x), rtol=1e-6, atol=1e-7)


def test_all_reduce_baseline_keeps_replicas_identical():
  n = 4
  require_devices(n)
  targets, x0 = _quadratic_setup(n, seed=6)
  tx = optax.chain(optim.all_reduce_gradients("workers"), optax.adam(0.1))
  hist, _, _ = _run_chain(tx, n, 4, targets, x0)
  ref = optax.adam(0.1)
  x = jnp.asarray(x0)
  s = ref.init(x)
  for k in range(4):
    u, s = ref.update(jnp.asarray((x - targets).mean(0)), s)
    x = optax.apply_updates(x, u)
    np.testing.assert_allclose(hist[k], np.broadcast_to(np.asarray(x), (n, 4)),
                               rtol=1e-6, atol=1e-6)


def test_composes_with_schedule_clip_and_inject_hyperparams():
  n = 4
  require_devices(n)
  topo = topology.make("one_peer_exp", n)
  targets, x0 = _quadratic_setup(n, seed=7)
  schedule = optax.linear_schedule(0.1, 0.0, 4)
  tx = optax.chain(
      optax.clip_by_global_norm(0.5),
      optax.inject_hyperparams(optim.decentralized_adamw)(
          learning_rate=schedule, topology=topo, weight_decay=0.0))
  hist, n_traces, state = _run_chain(tx, n, 4, targets, x0)
  assert n_traces == 1
  lrs = np.asarray(state[1].hyperparams["learning_rate"])
  # The injected value is the one the 4th step used: schedule(3) = 0.025.
  np.testing.assert_allclose(lrs, np.full(n, 0.025), atol=1e-7)
  # Oracle: clipping applies to each worker's own gradient.
  x = np.broadcast_to(x0, (n, 4)).astype(np.float64)
  grads = []
  for k in range(4):
    g = x - targets
    norm = np.linalg.norm(g, axis=1, keepdims=True)
    g = g * np.minimum(1.0, 0.5 / norm)
    grads.append(g)
    d = np.stack([np_accum_adam(np.array(grads)[:, i], 0.9, 0.999, 1e-8, 1)[-1]
                  for i in range(n)])
    x = topo.mixing_matrix(k) @ x - (0.1 - 0.025 * k) * d
    np.testing.assert_allclose(hist[k], x, rtol=1e-5, atol=1e-5)


def test_missing_params_is_a_clear_error():
  topo = topology.make("ring", 4)
  for tx in (optim.decentralized_adamw(0.1, topo), optim.gossip_mixing(topo)):
    params = {"x": jnp.zeros(3)}
    with pytest.raises(ValueError, match="needs the current parameters"):
      tx.update(params, tx.init(params))


def test_default_mask_decays_only_matrices():
  mask = optim.default_weight_decay_mask({"w": jnp.zeros((2, 2)), "b": jnp.zeros(2),
                                          "s": jnp.zeros(())})
  assert mask == {"w": True, "b": False, "s": False}


_MASK_PARAMS = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}


@pytest.mark.parametrize("mask, at_init, message", [
    # Read by truthiness before: 0 turned decay off, nan and 2.0 decayed all.
    (0, False, "mask=0: pass None (decay all), 'ndim>=2', a pytree of bools"),
    (float("nan"), False, "mask=nan: pass None"),
    (np.array(2.0), False, "mask=array(2.): pass None"),
    (np.array([True, False]), False, "mask=array([ True, False]): pass"),
    ({"w": 0.0, "b": 1.0}, False,
     "mask has 1.0 (float) at ['b'], not True or False; pass None"),
    ({"w": True, "b": np.array([True, True])}, False,
     "mask has array([ True, True]) (ndarray) at ['b'], not True or False"),
    # A multi-line JAX pytree error at the first update before.
    ([True, False], True, "mask has [0], which the parameters lack"),
    ({"w": True}, True, "mask has no entry for the parameter ['b']"),
    (lambda p: {"w": 1, "b": 0}, True,
     "mask (its result) has 0 (int) at ['b'], not True or False"),
])
def test_a_weight_decay_mask_other_than_bools_is_refused(mask, at_init,
                                                         message):
  def build_and_init():
    tx = optim.local_adamw(0.1, weight_decay=0.5, mask=mask)
    return tx.init(_MASK_PARAMS)
  if at_init:
    tx = optim.local_adamw(0.1, weight_decay=0.5, mask=mask)  # accepted
    build_and_init = lambda: tx.init(_MASK_PARAMS)  # noqa: E731
  with pytest.raises(ValueError) as info:
    build_and_init()
  assert str(info.value).startswith(message), str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("mask, decays", [
    ({"w": True, "b": np.bool_(False)}, {"w": True, "b": False}),
    ({"w": np.array(False), "b": jnp.array(True)}, {"w": False, "b": True}),
    (None, {"w": True, "b": True}),
    ("ndim>=2", {"w": True, "b": False}),
    (lambda p: {"w": False, "b": True}, {"w": False, "b": True}),
])
def test_a_weight_decay_mask_of_bools_decays_the_leaves_it_marks(mask,
                                                                 decays):
  """Zero gradients: the update is -lr * wd * p = -0.05 on decayed leaves."""
  tx = optim.local_adamw(0.1, weight_decay=0.5, mask=mask)
  zeros = jax.tree.map(jnp.zeros_like, _MASK_PARAMS)
  updates, _ = tx.update(zeros, tx.init(_MASK_PARAMS), _MASK_PARAMS)
  for k, decayed in decays.items():
    np.testing.assert_allclose(updates[k], -0.05 if decayed else 0.0,
                               rtol=1e-6)


def test_a_weight_decay_mask_may_be_a_prefix_of_the_parameters():
  params = {"enc": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)},
            "head": jnp.ones((2, 2))}
  tx = optim.local_adamw(0.1, weight_decay=0.5,
                         mask={"enc": True, "head": False})
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(updates["enc"]["b"], -0.05, rtol=1e-6)
  np.testing.assert_allclose(updates["head"], 0.0)


def test_static_round_index_matches_switch_and_has_no_conditional():
  n = 8
  require_devices(n)
  topo = topology.make("one_peer_exp", n)
  mesh = parallel.make_mesh(n)
  targets, x0 = _quadratic_setup(n, seed=8)
  tx = optim.decentralized_adamw(0.05, topo, accum_steps=2)

  def step(p, s, c, round_index=None):
    g = jax.tree.map(lambda x: _grad(x, c), p)
    u, s = tx.update(g, s, p, round_index=round_index)
    return optax.apply_updates(p, u), s

  switch = jax.jit(parallel.per_worker(step, mesh))
  static = {r: jax.jit(parallel.per_worker(
      lambda p, s, c, r=r: step(p, s, c, round_index=r), mesh))
            for r in range(topo.period)}
  p0 = parallel.replicate({"x": jnp.asarray(x0)}, mesh)
  s0 = jax.jit(parallel.per_worker(tx.init, mesh))(p0)
  c = parallel.shard(jnp.asarray(targets), mesh)
  assert " conditional(" in switch.lower(p0, s0, c).compile().as_text()
  assert " conditional(" not in static[1].lower(p0, s0, c).compile().as_text()
  pa, sa, pb, sb = p0, s0, p0, s0
  for k in range(5):
    pa, sa = switch(pa, sa, c)
    pb, sb = static[k % topo.period](pb, sb, c)
    np.testing.assert_array_equal(np.asarray(pa["x"]), np.asarray(pb["x"]))
  with pytest.raises(ValueError, match="round_index must be a Python int"):
    jax.jit(parallel.per_worker(lambda p, s, c: step(p, s, c, jnp.int32(1)),
                                mesh))(p0, s0, c)


def test_state_dtypes_survive_bf16_params_with_f32_grads():
  params = {"w": jnp.zeros((3, 2), jnp.bfloat16)}
  for tx in (optim.scale_by_accum_adam(), optim.scale_by_accum_adam(accum_steps=3)):
    state = tx.init(params)
    grads = {"w": jnp.ones((3, 2), jnp.float32)}
    _, new_state = tx.update(grads, state, params)
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(
        lambda a: a.dtype, state)
