"""The optax contract, checked for every public transform of ``optim``.

``CASES`` lists each transform in typical configurations; every test below
runs over all of them. A new transform gets a line in ``CASES``. Each case
is updated for ``STEPS`` steps on tiny params (a 2-D kernel and a bias),
under ``jax.jit``, inside ``jax.shard_map`` over ``N`` simulated CPU workers
when it communicates. Checked: update shapes/dtypes equal the params', the
state's tree structure, leaf shapes and dtypes never change, one trace for
all steps, float64 and bfloat16 params, composition in ``optax.chain`` and
``optax.inject_hyperparams``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology

N = 4
STEPS = 3


def _topo(n: int) -> topology.Topology:
  return topology.make("one_peer_exp", n)  # period 2: the round changes


def _kernels_only(params):
  return jax.tree.map(lambda p: p.ndim == 2, params)


_SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)


@dataclasses.dataclass(frozen=True)
class Case:
  """One transform configuration.

  Attributes:
    name: test id.
    make: ``n_workers -> tx``.
    communicates: True if ``update`` needs ``shard_map`` over "workers".
    inject: optional ``(n_workers, hyperparam_dtype) -> tx``, the same
      transform with its numeric hyperparameters (or its inner optimizer's)
      made state by ``optax.inject_hyperparams``; None when it takes none.
    mixes: True if ``optim.round_count`` finds a gossip counter in its state.
  """
  name: str
  make: Callable[[int], optax.GradientTransformation]
  communicates: bool = True
  inject: Optional[Callable[[int, object], optax.GradientTransformation]] = None
  mixes: bool = True


def _inject_sgd(hd):
  # momentum is static: an injected (float32) momentum would turn optax.sgd's
  # bfloat16 trace into float32 (optax's trace has no dtype of its own).
  return optax.inject_hyperparams(optax.sgd, static_args=("momentum",),
                                  hyperparam_dtype=hd)


CASES = [
    Case("scale_by_accum_adam_T1",
         lambda n: optim.scale_by_accum_adam(0.9, 0.99, 1e-8),
         communicates=False, mixes=False,
         inject=lambda n, hd: optax.inject_hyperparams(
             optim.scale_by_accum_adam, hyperparam_dtype=hd)(
                 b1=0.9, b2=0.99, eps=1e-8, accum_steps=1)),
    Case("scale_by_accum_adam_T3",
         lambda n: optim.scale_by_accum_adam(0.9, 0.99, 1e-8, accum_steps=3),
         communicates=False, mixes=False,
         inject=lambda n, hd: optax.inject_hyperparams(
             optim.scale_by_accum_adam, hyperparam_dtype=hd)(
                 b1=0.9, b2=0.99, eps=1e-8, accum_steps=3)),
    Case("decentralized_sgd",
         lambda n: optim.decentralized(optax.sgd(0.1, momentum=0.9), _topo(n)),
         inject=lambda n, hd: optim.decentralized(
             _inject_sgd(hd)(learning_rate=0.1, momentum=0.9), _topo(n))),
    Case("decentralized_sgd_mix_after_update",
         lambda n: optim.decentralized(optax.sgd(0.1, momentum=0.9), _topo(n),
                                       mix_after_update=True),
         inject=lambda n, hd: optim.decentralized(
             _inject_sgd(hd)(learning_rate=0.1, momentum=0.9), _topo(n),
             mix_after_update=True)),
    Case("decentralized_sgd_comm_bfloat16",
         lambda n: optim.decentralized(optax.sgd(0.1), _topo(n),
                                       comm_dtype=jnp.bfloat16),
         inject=lambda n, hd: optim.decentralized(
             _inject_sgd(hd)(learning_rate=0.1), _topo(n),
             comm_dtype=jnp.bfloat16)),
    Case("decentralized_adamw_T1",
         lambda n: optim.decentralized_adamw(0.1, _topo(n), weight_decay=0.1),
         inject=lambda n, hd: optax.inject_hyperparams(
             optim.decentralized_adamw, hyperparam_dtype=hd)(
                 learning_rate=0.1, topology=_topo(n), weight_decay=0.1)),
    Case("decentralized_adamw_T4_schedule_mask_comm",
         lambda n: optim.decentralized_adamw(
             _SCHEDULE, _topo(n), weight_decay=0.1, mask=_kernels_only,
             accum_steps=4, comm_dtype=jnp.bfloat16),
         inject=lambda n, hd: optax.inject_hyperparams(
             optim.decentralized_adamw, static_args=("mask", "comm_dtype"),
             hyperparam_dtype=hd)(
                 learning_rate=_SCHEDULE, topology=_topo(n), weight_decay=0.1,
                 mask=_kernels_only, accum_steps=4, comm_dtype=jnp.bfloat16)),
    Case("gossip_mixing_after_sgd",
         lambda n: optax.chain(optax.sgd(0.1, momentum=0.9),
                               optim.gossip_mixing(_topo(n))),
         inject=lambda n, hd: optax.chain(
             _inject_sgd(hd)(learning_rate=0.1, momentum=0.9),
             optim.gossip_mixing(_topo(n)))),
    # all_reduce_gradients has no hyperparameters; injecting adamw's would
    # test optax (whose adamw turns a bfloat16 mu into float32 when injected).
    Case("all_reduce_gradients_adamw",
         lambda n: optax.chain(optim.all_reduce_gradients("workers"),
                               optax.adamw(0.1, weight_decay=0.1)),
         mixes=False),
]
IDS = [c.name for c in CASES]
DTYPES = pytest.mark.parametrize("dtype", [
    "float32", pytest.param("float64", marks=pytest.mark.slow),
    pytest.param("bfloat16", marks=pytest.mark.slow)])


@pytest.fixture
def dtype_of(request):
  """``name -> jnp dtype``; float64 switches x64 on for the test."""

  def get(name):
    if name == "float64":
      request.getfixturevalue("x64")
    return jnp.dtype(name)

  return get


def _inputs(case, dtype, seed=0, via=None):
  """Params (distinct per worker) and STEPS grads.

  Stacked ``[N, ...]`` for communicating cases, one worker's otherwise.
  With ``via``, the values are first rounded to that dtype.
  """
  rng = np.random.default_rng(seed)
  lead = (N,) if case.communicates else ()
  shapes = {"kernel": lead + (3, 2), "bias": lead + (2,)}

  def make():
    tree = {k: jnp.asarray(jnp.asarray(rng.normal(size=s), via or dtype),
                           dtype) for k, s in shapes.items()}
    if case.communicates:  # one worker's slice per device
      tree = parallel.shard(tree, parallel.make_mesh(N))
    return tree

  require_devices(N)
  return make(), [make() for _ in range(STEPS)]


def _leaf_specs(tree):
  return jax.tree.structure(tree), [(x.shape, x.dtype)
                                    for x in jax.tree.leaves(tree)]


def _jit(case, fn):
  """``jax.jit(fn)``, per worker inside ``shard_map`` if ``case`` talks."""
  if not case.communicates:
    return jax.jit(fn)
  require_devices(N)
  return jax.jit(parallel.per_worker(fn, parallel.make_mesh(N)))


def _check_contract(case, tx, dtype, *, strict_update_dtypes=True, via=None):
  """Runs STEPS jitted steps checking the contract; returns final params.

  Updates must have the params' shapes and dtypes (with
  ``strict_update_dtypes=False`` float32 is accepted too, as optax's own
  transforms return it when given float32 hyperparameters); the state's
  structure, leaf shapes and dtypes must never change; one trace in all.
  """
  traces = []

  def step(p, s, g):
    traces.append(None)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  params, grads = _inputs(case, dtype, via=via)
  step = _jit(case, step)
  state = _jit(case, tx.init)(params)
  want_state, want_params = _leaf_specs(state), _leaf_specs(params)
  p = params
  for k, g in enumerate(grads, start=1):
    p, state, u = step(p, state, g)
    assert _leaf_specs(state) == want_state, f"state changed at step {k}"
    assert _leaf_specs(p) == want_params, f"params changed type at step {k}"
    assert jax.tree.structure(u) == want_params[0]
    for name in params:
      assert u[name].shape == params[name].shape, (k, name)
      allowed = {params[name].dtype}
      if not strict_update_dtypes:
        allowed.add(jnp.dtype(jnp.float32))
      assert u[name].dtype in allowed, (k, name, u[name].dtype)
      leaf = np.asarray(u[name], np.float64)
      assert np.all(np.isfinite(leaf)), (k, name)
      assert np.any(leaf != 0), (k, name)
  assert len(traces) == 1
  count = optim.round_count(state)
  if case.mixes:
    np.testing.assert_array_equal(np.asarray(count), np.full(N, STEPS))
  else:
    assert count is None
  return jax.tree.map(lambda x: np.asarray(x, np.float64), p)


_PLAIN_RUNS = {}


def _plain_run(case, dtype, via=None):
  """``_check_contract`` of ``case.make(N)``, once per (case, dtype, via)."""
  key = (case.name, jnp.dtype(dtype).name, via and jnp.dtype(via).name)
  if key not in _PLAIN_RUNS:
    _PLAIN_RUNS[key] = _check_contract(case, case.make(N), dtype, via=via)
  return _PLAIN_RUNS[key]


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jit_types_and_state_are_stable(case, dtype, dtype_of):
  _PLAIN_RUNS.pop((case.name, dtype, None), None)  # always check here
  _plain_run(case, dtype_of(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bfloat16_tracks_float32(case):
  """bf16 params/grads end within a few bf16 roundings of float32 runs.

  Both runs start from the same (bf16) values. Each step rounds |x| < 4 to
  bf16 a few times (at most 2^-6 each); the float32 run must move much
  further than that (a direction lost to a zero bias correction would not
  be noticed otherwise).
  """
  low = _plain_run(case, jnp.bfloat16)
  ref = _plain_run(case, jnp.float32, via=jnp.bfloat16)
  p0, _ = _inputs(case, jnp.float32, via=jnp.bfloat16)
  tol = STEPS * 2 * 2.0**-6
  moved = max(np.max(np.abs(ref[k] - np.asarray(p0[k], np.float64)))
              for k in ref)
  assert moved > 3 * tol, moved
  for k in ref:
    np.testing.assert_allclose(low[k], ref[k], rtol=0, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inside_chain_after_clipping(case):
  """``chain(clip, tx)``: stable state, one trace, and the result of ``tx``
  fed optax's clipped gradients, bit for bit."""
  clip = optax.clip_by_global_norm(0.5)  # the grads' norms are ~3: clips
  chained = optax.chain(clip, case.make(N))
  tx = case.make(N)
  traces = []

  def both(p1, p2, s_chain, s_tx, g):
    traces.append(None)
    u1, s_chain = chained.update(g, s_chain, p1)
    clipped, _ = clip.update(g, clip.init(p2))  # stateless
    u2, s_tx = tx.update(clipped, s_tx, p2)
    return (optax.apply_updates(p1, u1), optax.apply_updates(p2, u2),
            s_chain, s_tx)

  params, grads = _inputs(case, jnp.float32)
  both = _jit(case, both)
  s_chain, s_tx = _jit(case, chained.init)(params), _jit(case, tx.init)(params)
  want_state = _leaf_specs(s_chain)
  assert _leaf_specs(s_chain[1]) == _leaf_specs(s_tx)
  p1 = p2 = params
  for k, g in enumerate(grads, start=1):
    p1, p2, s_chain, s_tx = both(p1, p2, s_chain, s_tx, g)
    assert _leaf_specs(s_chain) == want_state, f"state changed at step {k}"
    assert _leaf_specs(p1) == _leaf_specs(params)
    for name in params:
      np.testing.assert_array_equal(np.asarray(p1[name]), np.asarray(p2[name]))
      assert not np.array_equal(np.asarray(p1[name]),
                                np.asarray(params[name]))
  assert len(traces) == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in CASES if c.inject],
                         ids=[c.name for c in CASES if c.inject])
def test_under_inject_hyperparams(case, dtype, dtype_of):
  """Injected hyperparameters: same contract, same result as constants.

  Low-precision params need ``hyperparam_dtype=jnp.float32``. Injected
  float32 hyperparameters form ``1 - b`` in float32 where constants form it
  in float64, and a float32 learning rate is not rounded to bfloat16, hence
  a tolerance, small enough to see a change of algorithm (an injected
  ``accum_steps`` is traced: another code path).
  """
  dtype = dtype_of(dtype)
  low = dtype == jnp.bfloat16
  injected = case.inject(N, jnp.float32 if low else None)
  got = _check_contract(case, injected, dtype, strict_update_dtypes=not low)
  want = _plain_run(case, dtype)
  tol = 2 * float(jnp.finfo(jnp.bfloat16).eps) if low else 1e-5
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol)


def test_injected_callables_need_static_args():
  """A callable mask or a dtype class taken for a schedule is an error."""
  case = CASES[0] if CASES[0].communicates else CASES[2]
  params, _ = _inputs(case, jnp.float32)
  for kwargs, name in (({"mask": _kernels_only}, "mask"),
                       ({"comm_dtype": jnp.bfloat16}, "comm_dtype")):
    tx = optax.inject_hyperparams(optim.decentralized_adamw)(
        learning_rate=0.1, topology=_topo(N), weight_decay=0.1, **kwargs)
    with pytest.raises(ValueError, match=f"list '{name}' in static_args"):
      _jit(case, tx.init)(params)
