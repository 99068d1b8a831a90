"""DES-LOC-Adam (optim/desloc.py): the worked example of the issue, an
independent NumPy re-implementation over many steps, and its argument checks.

M = 4 workers, f_i(x) = 0.5 |x - c_i|^2 (gradient x - c_i), all starting at
x = 0, no noise, float64; the workers are a ``jax.vmap`` with an axis name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decentral_jax.optim import desloc

C = np.array([[1.0, 0.0], [3.0, 1.0], [-1.0, 2.0], [0.0, -3.0]])
AXIS = "workers"


def _run(tx, steps, c=C):
  """``steps`` steps of ``tx`` on the 4 quadratics; x [steps + 1, 4, 2]."""
  c = jnp.asarray(c)
  x = jnp.zeros_like(c)

  def one(p, s, ci):
    u, s = tx.update(p - ci, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.vmap(one, axis_name=AXIS))
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  out = [np.asarray(x)]
  for _ in range(steps):
    x, state = step(x, state, c)
    out.append(np.asarray(x))
  return np.stack(out)


def _oracle(steps, lr, kx, ku, kv, b1=0.9, b2=0.99, eps=1e-8, bias=False,
            wd=0.0, c=C):
  """The recursion of the issue in NumPy (float64), step by step."""
  x = np.zeros_like(c)
  u = np.zeros_like(c)
  v = np.zeros_like(c)
  out = [x.copy()]
  for t in range(steps):
    g = x - c
    if t % ku == 0:
      u = np.broadcast_to(u.mean(0), u.shape)
    if t % kv == 0:
      v = np.broadcast_to(v.mean(0), v.shape)
    u = b1 * u + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    uh, vh = u, v
    if bias:
      uh, vh = u / (1 - b1**(t + 1)), v / (1 - b2**(t + 1))
    d = lr * uh / np.sqrt(vh + eps * eps) + lr * wd * x
    xb = np.broadcast_to(x.mean(0), x.shape) if t % kx == 0 else x
    x = xb - d
    out.append(x.copy())
  return np.stack(out)


def test_the_worked_example(x64):
  del x64
  tx = desloc.desloc_adam(0.1, 2, 4, 8, b1=0.9, b2=0.99, eps=1e-8,
                          axis_name=AXIS)
  xs = _run(tx, 1)
  assert xs.dtype == np.float64
  np.testing.assert_allclose(
      xs[1], [[0.1, 0.0], [0.1, 0.1], [-0.1, 0.1], [0.0, -0.1]],
      rtol=0, atol=1e-9)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_numpy_over_twenty_steps(x64, bias):
  del x64
  tx = desloc.desloc_adam(0.1, 2, 4, 8, bias_correction=bias, axis_name=AXIS)
  got = _run(tx, 20)
  want = _oracle(20, 0.1, 2, 4, 8, bias=bias)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  # The parameters are averaged at t = 0, 2, 4, ... before the step: after
  # an odd number of steps the workers differ, and they move together.
  assert np.ptp(got[-1], axis=0).max() > 1e-3


def test_periods_and_weight_decay_with_a_schedule(x64):
  del x64
  def sched(t):  # a decaying rate, float64 in and out of the step
    return 0.2 / (1.0 + jnp.asarray(t, jnp.float64))

  tx = desloc.desloc_adam(sched, 3, 5, 7, b1=0.8, b2=0.95, eps=1e-3,
                          weight_decay=0.1, axis_name=AXIS)
  got = _run(tx, 25)
  # The oracle with the schedule's rate of step t.
  x = np.zeros_like(C)
  u = np.zeros_like(C)
  v = np.zeros_like(C)
  for t in range(25):
    g = x - C
    u = u.mean(0) + 0 * u if t % 5 == 0 else u
    v = v.mean(0) + 0 * v if t % 7 == 0 else v
    u = 0.8 * u + 0.2 * g
    v = 0.95 * v + 0.05 * g * g
    lr = 0.2 / (1.0 + t)
    d = lr * u / np.sqrt(v + 1e-6) + lr * 0.1 * x
    x = (x.mean(0) + 0 * x if t % 3 == 0 else x) - d
    np.testing.assert_allclose(got[t + 1], x, rtol=0, atol=1e-12)


def test_state_and_updates_keep_the_params_dtypes():
  tx = desloc.desloc_adam(0.1, 1, 1, 1, axis_name=AXIS)
  x = jnp.zeros((4, 3), jnp.bfloat16)
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  assert state.u.dtype == jnp.bfloat16 and state.count.dtype == jnp.int32
  u, state = jax.vmap(tx.update, axis_name=AXIS)(x + 1, state, x)
  assert u.dtype == jnp.bfloat16 and int(state.count[0]) == 1


@pytest.mark.parametrize("kwargs,words", [
    (dict(sync_x=0), "sync_x must be an int >= 1 and <= 2147483647"),
    (dict(sync_u=2.0), "sync_u must be an int"),
    (dict(sync_v=2**31), "sync_v must be an int >= 1 and <= 2147483647"),
    (dict(sync_x=True), "sync_x must be an int"),
    (dict(b1=1.0), "b1 must be a number in"),
    (dict(b2=-0.1), "b2 must be a number in"),
    (dict(eps=float("nan")), "eps must be a finite number"),
    (dict(learning_rate=-1.0), "learning_rate must be a finite number"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number"),
    (dict(bias_correction=1), "bias_correction must be"),
    (dict(mask="all"), "mask must be callable"),
])
def test_bad_arguments_are_refused_by_name(kwargs, words):
  args = dict(learning_rate=0.1, sync_x=2, sync_u=4, sync_v=8)
  args.update(kwargs)
  with pytest.raises(ValueError, match=words):
    desloc.desloc_adam(**args)


def test_update_needs_params_and_float_leaves():
  tx = desloc.desloc_adam(0.1, 2, 4, 8)
  with pytest.raises(ValueError, match="desloc_adam needs the current "
                     "parameters"):
    tx.update(jnp.zeros(2), tx.init(jnp.zeros(2)))
  with pytest.raises(ValueError, match="desloc_adam"):
    tx.init(jnp.zeros(2, jnp.int32))
