"""Where eager DiLoCo and trickled reduction equal their plain forms bit
for bit, and where only to within an ulp.

The recursions are equal in exact arithmetic: eager with one worker steps
on ``Delta^(k) + (Delta^(k-d) - Delta^(k-d))`` (plain DiLoCo's
``Delta^(k)``), and a trickled reduction sums the same elements as the
one-shot one. With one compiled step per call (the runner's case) or the
steps in a ``lax.fori_loop`` each program holds one step and the float32
results are equal bit for bit; with several steps unrolled in one jitted
program XLA fuses across the steps and the results may differ by an ulp
(measured: 1 element of 21 by 1 ulp over 6 steps). Random data, one
worker, inner SGD, Nesterov outer step, H = 2.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax.optim import outer_timing

H, STEPS = 2, 6


def _txs():
  return {"plain": optim.diloco(optax.sgd(0.05), H),
          "eager": optim.diloco(optax.sgd(0.05), H,
                                timing=outer_timing.Eager(1)),
          "eager_one_shot": optim.diloco(
              optax.sgd(0.05), H, timing=outer_timing.Eager(1,
                                                            trickle=False))}


def _data():
  rng = np.random.default_rng(1)
  x0 = rng.standard_normal((1, 7, 3)).astype(np.float32)
  gs = rng.standard_normal((1, STEPS, 7, 3)).astype(np.float32)
  return x0, gs


def _step(tx, x, s, g):
  u, s = tx.update(g, s, x)
  return optax.apply_updates(x, u), s


def _unrolled(tx, mesh, x0, gs):
  def f(x, g):
    s = tx.init(x)
    for k in range(STEPS):  # one program, STEPS steps unrolled
      x, s = _step(tx, x, s, g[k])
    return x
  return np.asarray(jax.jit(parallel.per_worker(f, mesh))(x0, gs))


def _fori(tx, mesh, x0, gs):
  def f(x, g):
    body = lambda k, c: _step(tx, *c, g[k])
    return jax.lax.fori_loop(0, STEPS, body, (x, tx.init(x)))[0]
  return np.asarray(jax.jit(parallel.per_worker(f, mesh))(x0, gs))


def _per_call(tx, mesh, x0, gs):
  init = jax.jit(parallel.per_worker(tx.init, mesh))
  step = jax.jit(parallel.per_worker(lambda x, s, g: _step(tx, x, s, g),
                                     mesh))
  x, s = parallel.shard(x0, mesh), None
  s = init(x)
  for k in range(STEPS):
    x, s = step(x, s, parallel.shard(gs[:, k], mesh))
  return np.asarray(x)


@pytest.mark.slow  # per-call, fori_loop and unrolled programs of its own
def test_one_step_per_program_is_bit_for_bit_unrolled_within_an_ulp():
  mesh = parallel.make_mesh(1)
  x0, gs = _data()
  for run in (_per_call, _fori, _unrolled):
    got = {name: run(tx, mesh, parallel.shard(x0, mesh),
                     parallel.shard(gs, mesh)) if run is not _per_call
           else run(tx, mesh, x0, gs) for name, tx in _txs().items()}
    assert np.all(np.isfinite(got["plain"]))
    for name in ("eager", "eager_one_shot"):
      if run is _unrolled:  # at most 2 ulps of each element
        ulp = np.spacing(np.abs(got["plain"]))
        np.testing.assert_array_less(np.abs(got[name] - got["plain"]),
                                     2 * ulp + np.finfo(np.float32).tiny)
      else:
        np.testing.assert_array_equal(got[name], got["plain"])
