"""Optimizers with bfloat16 and float16 params and grads.

References are independent of the code under test: ``optax.adamw`` run on
the same low-precision params and grads, closed forms (the first Adam step is
``sign(g)``), NumPy AccumAdam and dense-matrix D-PSGD in float64.
Multi-worker cases run under ``jax.shard_map`` on simulated CPU devices.
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
from decentral_jax import topology
from helpers import np_accum_adam

LOW = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                              ids=["bfloat16", "float16"])
STEPS = 10
LR, WD, B1, B2, EPS = 0.05, 0.1, 0.9, 0.999, 1e-8  # b2 = 0.999 is 1 in bf16


def _eps(dtype) -> float:
  return float(jnp.finfo(dtype).eps)


def _tol(dtype) -> float:
  """Absolute tolerance on params of magnitude <= ~2.5 after 10 steps.

  A few ulps: optax.adamw rounds its moments and direction to the low dtype
  at every operation, ours rounds once per stored value.
  """
  return 3 * _eps(dtype)


def _f64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _data(dtype, n_workers=None, seed=0, same_grads=True):
  """Params {"w": [4, 3], "b": [3]} and STEPS gradients in ``dtype``.

  Gradient entries have magnitude in [0.5, 1.5) and one sign per entry,
  flipped at steps 2 and 6, so Adam moves every parameter by many ulps in
  one direction (a sign change tests the moments; float16's moments
  stay in its normal range). With ``n_workers`` the leaves get a leading
  worker axis: identical params; identical grads if ``same_grads``, else
  per-worker magnitudes with a common sign (so the mean is >= 0.5 too).
  """
  rng = np.random.default_rng(seed)
  shapes = {"w": (4, 3), "b": (3,)}
  params = {k: rng.normal(size=s) for k, s in shapes.items()}
  lead = () if n_workers is None or same_grads else (n_workers,)
  sign = {k: np.sign(rng.normal(size=s)) for k, s in shapes.items()}

  def one_grad(k, s, step):
    flip = -1.0 if step in (2, 6) else 1.0
    return sign[k] * flip * (0.5 + rng.random(lead + s))

  grads = [{k: one_grad(k, s, step) for k, s in shapes.items()}
           for step in range(STEPS)]
  if n_workers is not None:
    params = {k: np.broadcast_to(v, (n_workers,) + v.shape)
              for k, v in params.items()}
    if same_grads:
      grads = [{k: np.broadcast_to(v, (n_workers,) + v.shape)
                for k, v in g.items()} for g in grads]

  def cast(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)

  return cast(params), [cast(g) for g in grads]


def _run_local(tx, params, grads):
  """Params after each step (float64 NumPy); updates keep the params' dtype."""

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  state = tx.init(params)
  step = jax.jit(step)
  hist = []
  for g in grads:
    params, state, u = step(params, state, g)
    for k in params:
      assert u[k].dtype == params[k].dtype, (k, u[k].dtype)
    hist.append(_f64(params))
  return hist


def _run_workers(tx, n, params, grads, dtype):
  """Like _run_local for stacked [n, ...] state, one worker per device."""
  require_devices(n)
  mesh = parallel.make_mesh(n)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  stepf = jax.jit(parallel.per_worker(step, mesh))
  p = parallel.shard(params, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  hist = []
  for g in grads:
    p, s, u = stepf(p, s, parallel.shard(g, mesh))
    for k in p:
      assert p[k].dtype == dtype and u[k].dtype == dtype, (k, p[k].dtype)
    hist.append(_f64(p))
  return hist


def _assert_trajectory(got, want, p0, dtype, extra_atol=lambda k: 0.0):
  """Each step within a few ulps (+ ``extra_atol(step)``) of ``want``.

  Also checks that every parameter of the reference moved by more than twice
  the tolerance, so parameters stuck at ``p0`` could not pass.
  """
  for k, (g, w) in enumerate(zip(got, want)):
    for name in w:
      assert np.all(np.isfinite(g[name])), (k, name)
      np.testing.assert_allclose(g[name], w[name], rtol=0,
                                 atol=_tol(dtype) + extra_atol(k),
                                 err_msg=f"step {k}, leaf {name}")
  p0 = _f64(p0)
  last = _tol(dtype) + extra_atol(len(want) - 1)
  for name in p0:
    assert np.min(np.abs(want[-1][name] - p0[name])) > 2 * last, name


_ADAMW_HIST = {}


def _optax_adamw_hist(params, grads):
  """optax.adamw's trajectory (cached: several tests share the data)."""
  key = tuple(np.asarray(x, np.float64).tobytes()
              for x in jax.tree.leaves((params, grads)))
  if key not in _ADAMW_HIST:
    _ADAMW_HIST[key] = _run_local(
        optax.adamw(LR, B1, B2, EPS, weight_decay=WD), params, grads)
  return _ADAMW_HIST[key]


# --------------------------------------------------------------------------
# scale_by_accum_adam.
# --------------------------------------------------------------------------


@LOW
@pytest.mark.parametrize("accum_steps", [1, 4])
def test_first_steps_are_sign_of_gradient(dtype, accum_steps):
  """Bias corrections must not vanish: in bf16, 0.999 rounds to 1.

  For t <= T the stored moments are still zero, so m_hat = g and
  v_hat = g^2 exactly and d = g / (|g| + eps) = sign(g) (|g| >= 0.5).
  """
  tx = optim.scale_by_accum_adam(B1, B2, EPS, accum_steps=accum_steps)
  params, grads = _data(dtype)
  state = tx.init(params)
  for g in grads[:accum_steps]:
    d, state = jax.jit(tx.update)(g, state)
    for k in g:
      assert d[k].dtype == dtype
      np.testing.assert_array_equal(np.asarray(d[k], np.float64),
                                    np.sign(np.asarray(g[k], np.float64)))


@pytest.mark.slow
@LOW
def test_accum_adam_steps_equal_optax_adamw(dtype):
  params, grads = _data(dtype)
  ours = optax.chain(optim.scale_by_accum_adam(B1, B2, EPS),
                     optax.add_decayed_weights(WD),
                     optax.scale_by_learning_rate(LR))
  _assert_trajectory(_run_local(ours, params, grads),
                     _optax_adamw_hist(params, grads), params, dtype)


@pytest.mark.parametrize("dtype,accum_steps,moments", [
    pytest.param(d, t, m, id=f"{m}-{t}-{jnp.dtype(d).name}",
                 marks=() if (d, t, m) == (jnp.bfloat16, 4, "low")
                 else pytest.mark.slow)
    for d in (jnp.bfloat16, jnp.float16) for t in (1, 4)
    for m in ("low", "float32")])
def test_accum_adam_directions_against_numpy(dtype, accum_steps, moments):
  """Low-precision moments cost a few ulps; float32 moments half an ulp.

  Directions are O(1). With float32 ``mu_dtype``/``nu_dtype`` the only
  rounding left is that of the returned direction (relative eps / 2).
  """
  f32 = jnp.float32 if moments == "float32" else None
  tx = optim.scale_by_accum_adam(B1, B2, EPS, accum_steps=accum_steps,
                                 mu_dtype=f32, nu_dtype=f32)
  _, grads = _data(dtype, seed=1)
  grads = [g["w"] for g in grads]
  want = np_accum_adam(grads, B1, B2, EPS, accum_steps)
  state = tx.init(grads[0])
  update = jax.jit(tx.update)
  if f32:
    rtol, atol = _eps(dtype) / 2 + 1e-6, 1e-6
  else:
    rtol, atol = 0.0, 4 * _eps(dtype)
  for k, (g, w) in enumerate(zip(grads, want)):
    d, state = update(g, state)
    assert d.dtype == dtype
    np.testing.assert_allclose(np.asarray(d, np.float64), w, rtol=rtol,
                               atol=atol, err_msg=f"step {k}")


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 3])
def test_float32_moments_with_bfloat16_params(accum_steps):
  params, grads = _data(jnp.bfloat16)
  tx = optim.scale_by_accum_adam(B1, B2, EPS, accum_steps=accum_steps,
                                 mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads[:4]:
    d, state = update(g, state, params)
    for k in params:
      assert d[k].dtype == jnp.bfloat16
      assert state.mu[k].dtype == jnp.float32
      assert state.nu[k].dtype == jnp.float32
      assert state.acc[k].dtype == jnp.float32
  assert state.count.dtype == jnp.int32
  # And through decentralized_adamw (one worker: no communication).
  tx = optim.decentralized_adamw(LR, topology.make("ring", 1),
                                 mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  state = tx.init(params)
  u, state = jax.jit(tx.update)(grads[0], state, params)
  adam_state = state.inner_state[0]
  assert {k: u[k].dtype for k in u} == {"w": jnp.bfloat16, "b": jnp.bfloat16}
  assert {adam_state.mu[k].dtype for k in params} == {jnp.dtype(jnp.float32)}
  assert {adam_state.nu[k].dtype for k in params} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_float32_moments_match_optax_adam_in_float32():
  """bf16 grads, f32 moments: optax.scale_by_adam on f32 copies, rounded."""
  _, grads = _data(jnp.bfloat16, seed=3)
  ours = optim.scale_by_accum_adam(B1, B2, EPS, mu_dtype=jnp.float32,
                                   nu_dtype=jnp.float32)
  ref = optax.scale_by_adam(B1, B2, EPS)
  s1 = ours.init(grads[0])
  s2 = ref.init(jax.tree.map(lambda x: x.astype(jnp.float32), grads[0]))
  for g in grads:
    d, s1 = jax.jit(ours.update)(g, s1)
    r, s2 = jax.jit(ref.update)(
        jax.tree.map(lambda x: x.astype(jnp.float32), g), s2)
    for k in g:
      np.testing.assert_allclose(np.asarray(d[k], np.float64),
                                 np.asarray(r[k], np.float64),
                                 rtol=_eps(jnp.bfloat16) / 2 + 1e-6)


# --------------------------------------------------------------------------
# Decentralized transforms (shard_map on simulated CPU devices).
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype,topo_name,n", [
    (jnp.bfloat16, "ring", 1), (jnp.float16, "ring", 1),
    (jnp.bfloat16, "one_peer_exp", 4), (jnp.float16, "one_peer_exp", 4),
    (jnp.bfloat16, "complete", 4)], ids=lambda v: getattr(v, "__name__", v))
def test_decentralized_adamw_with_identity_mixing_is_adamw(dtype, topo_name,
                                                           n):
  """1 worker, or all workers identical: W x = x, so DAdamW = AdamW."""
  params, grads = _data(dtype, n_workers=n)
  tx = optim.decentralized_adamw(LR, topology.make(topo_name, n), b1=B1, b2=B2,
                                 eps=EPS, weight_decay=WD, mask=None)
  got = _run_workers(tx, n, params, grads, dtype)
  one = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
  want = _optax_adamw_hist(one(params), [one(g) for g in grads])
  for w in range(n):
    _assert_trajectory([jax.tree.map(lambda x, w=w: x[w], h) for h in got],
                       want, one(params), dtype)


@pytest.mark.slow
@LOW
def test_all_reduce_adamw_is_adamw_on_the_mean_gradient(dtype):
  n = 4
  params, grads = _data(dtype, n_workers=n, same_grads=False)
  tx = optax.chain(optim.all_reduce_gradients("workers"),
                   optax.adamw(LR, B1, B2, EPS, weight_decay=WD))
  got = _run_workers(tx, n, params, grads, dtype)
  mean = [jax.tree.map(lambda x: jnp.asarray(
      np.asarray(x, np.float64).mean(0), dtype), g) for g in grads]
  p0 = jax.tree.map(lambda x: x[0], params)
  want = _optax_adamw_hist(p0, mean)
  for w in range(n):
    _assert_trajectory([jax.tree.map(lambda x, w=w: x[w], h) for h in got],
                       want, p0, dtype)


@pytest.mark.parametrize("dtype,form", [
    pytest.param(d, f, id=f"{f}-{jnp.dtype(d).name}",
                 marks=() if (d, f) == (jnp.bfloat16, "decentralized")
                 else pytest.mark.slow)
    for d in (jnp.bfloat16, jnp.float16)
    for f in ("gossip_mixing", "decentralized", "decentralized_mix_after")])
def test_dpsgd_against_dense_float64_oracle(dtype, form):
  """Distinct workers on one_peer_exp (weights 1/2, exact in any dtype).

  x_{k+1} = W_k x_k - lr g_k, or W_k (x_k - lr g_k) when mixing after the
  update, in float64 from the same low-precision start and gradients.
  """
  n, lr = 4, 0.1
  topo = topology.make("one_peer_exp", n)
  params, grads = _data(dtype, n_workers=n, same_grads=False)
  rng = np.random.default_rng(7)
  params = jax.tree.map(
      lambda x: jnp.asarray(np.asarray(x, np.float64) +
                            rng.normal(size=x.shape), dtype), params)
  if form == "gossip_mixing":
    tx = optax.chain(optax.sgd(lr), optim.gossip_mixing(topo))
  else:
    tx = optim.decentralized(optax.sgd(lr), topo,
                             mix_after_update=form.endswith("after"))
  got = _run_workers(tx, n, params, grads, dtype)
  x = _f64(params)
  for k, g in enumerate(grads):
    w = topo.mixing_matrix(k)
    mix = lambda a, w=w: np.einsum("ij,j...->i...", w, a)  # noqa: E731
    if form == "decentralized_mix_after":
      x = {m: mix(x[m] - lr * np.asarray(g[m], np.float64)) for m in x}
    else:
      x = {m: mix(x[m]) - lr * np.asarray(g[m], np.float64) for m in x}
    for m in x:
      # |x| < 4: the mean, the sgd step and apply_updates each round by at
      # most one ulp there (2 eps); mixing keeps the errors from growing.
      np.testing.assert_allclose(got[k][m], x[m], rtol=0, atol=8 * _eps(dtype),
                                 err_msg=f"step {k}, leaf {m}")
  p0 = _f64(params)
  for m in x:  # the oracle moved far beyond the tolerance (mixing is O(1))
    assert np.max(np.abs(x[m] - p0[m])) > 20 * 8 * _eps(dtype), m


@pytest.mark.slow
def test_decentralized_adamw_float16_params_comm_dtype_bfloat16():
  """Identical float16 workers sending bf16 stay near optax.adamw's path.

  float16 params lose bits on the wire: each step the received half of a
  pairwise mean is off by up to half a bf16 ulp (relative 2^-9), i.e.
  |x| 2^-10 after the 1/2 weight; at |x| < 2.5 that accumulates to at most
  (k + 1) 2.5 2^-10 by step k. (bf16 params are sent exactly: the
  identity-mixing test above covers them.)
  """
  n, dtype = 4, jnp.float16
  params, grads = _data(dtype, n_workers=n)
  tx = optim.decentralized_adamw(LR, topology.make("one_peer_exp", n), b1=B1,
                                 b2=B2, eps=EPS, weight_decay=WD, mask=None,
                                 comm_dtype=jnp.bfloat16)
  got = _run_workers(tx, n, params, grads, dtype)
  one = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
  want = _optax_adamw_hist(one(params), [one(g) for g in grads])
  wire = lambda k: (k + 1) * 2.5 * 2.0**-10  # noqa: E731
  for w in range(n):
    _assert_trajectory([jax.tree.map(lambda x, w=w: x[w], h) for h in got],
                       want, one(params), dtype, extra_atol=wire)


# --------------------------------------------------------------------------
# Hyperparameter validation.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,name", [
    ({"eps": float("nan")}, "eps"), ({"eps": float("inf")}, "eps"),
    ({"eps": -1e-8}, "eps"), ({"b1": float("nan")}, "b1"),
    ({"b2": float("nan")}, "b2"), ({"b2": float("inf")}, "b2"),
    ({"b1": jnp.asarray(0.9, jnp.float32) * jnp.nan}, "b1"),
    ({"b2": jnp.asarray(0.999, jnp.bfloat16)}, "b2"),
    ({"eps": jnp.asarray(1e-8, jnp.float16)}, "eps"),
    ({"mu_dtype": jnp.int32}, "mu_dtype"),
    ({"nu_dtype": jnp.bool_}, "nu_dtype"),
    ({"accum_steps": jnp.asarray(0, jnp.int32)}, "accum_steps"),
])
def test_bad_hyperparameters_are_rejected(kwargs, name):
  with pytest.raises(ValueError, match=f"^{name} "):
    optim.scale_by_accum_adam(**kwargs)
  with pytest.raises(ValueError, match=f"^{name} "):
    optim.decentralized_adamw(0.1, topology.make("ring", 2), **kwargs)


def test_good_hyperparameters_are_accepted():
  # The edges b1 = b2 = eps = 0: M = g and V = g^2 of the last step alone,
  # so every direction is sign(g) exactly (powers of two: no rounding). A
  # b1 or b2 > 0 would remember the first step's large gradients of the
  # other sign; the default eps would turn 2^-30 into about 0.09.
  tx = optim.scale_by_accum_adam(0.0, 0.0, 0.0)
  tiny = 2.0**-30
  grads = [np.array([4.0, -2.0, tiny, -tiny], np.float32),
           np.array([-tiny, tiny, -8.0, 0.5], np.float32)]
  state = tx.init(jnp.zeros(4, jnp.float32))
  for g in grads:
    d, state = tx.update(jnp.asarray(g), state)
    np.testing.assert_array_equal(np.asarray(d), np.sign(g))
  # float32 arrays as hyperparameters (not the defaults), a dtype given by
  # name: the moments are stored in the dtypes asked for, and the
  # directions are those of b1 = 0.5, b2 = 0.75, eps = 0.1 (float64
  # NumPy), up to the bfloat16 rounding of M and A (half a bfloat16 ulp of
  # a direction of magnitude <= 1; the defaults 0.9, 0.999, 1e-8 are 0.08
  # to 0.46 away).
  b1, b2, eps = 0.5, 0.75, 0.1
  tx = optim.scale_by_accum_adam(jnp.asarray(b1), jnp.asarray(b2, jnp.float32),
                                 jnp.asarray(eps), accum_steps=2,
                                 mu_dtype=jnp.bfloat16, nu_dtype="float32")
  _, grads = _data(jnp.float32, seed=2)
  grads = [g["w"] for g in grads]
  want = np_accum_adam(grads, b1, b2, eps, 2)
  state = tx.init(grads[0])
  assert (state.mu.dtype, state.acc.dtype, state.nu.dtype) == (
      jnp.bfloat16, jnp.bfloat16, jnp.float32)
  update = jax.jit(tx.update)
  for k, (g, w) in enumerate(zip(grads, want)):
    d, state = update(g, state)
    assert d.dtype == jnp.float32 and state.mu.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(d, np.float64), w, rtol=0,
                               atol=_eps(jnp.bfloat16) / 2, err_msg=f"step {k}")


def test_inject_hyperparams_with_bfloat16_params_needs_float32_hyperparams():
  """optax casts hyperparameters to the params' dtype unless told otherwise."""
  params, grads = _data(jnp.bfloat16)
  bad = optax.inject_hyperparams(optim.scale_by_accum_adam)(b1=B1, b2=B2)
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    bad.init(params)
  good = optax.inject_hyperparams(optim.scale_by_accum_adam,
                                  hyperparam_dtype=jnp.float32)(b1=B1, b2=B2)
  state = good.init(params)
  d, state = jax.jit(good.update)(grads[0], state, params)
  for k in params:  # the first step is sign(g), as without injection
    assert d[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(d[k], np.float64),
                                  np.sign(np.asarray(grads[0][k], np.float64)))
