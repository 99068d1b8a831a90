"""Optimizer state carried the ways a JAX user carries it inside shard_map.

Inside ``jax.shard_map`` an array's type names the worker axes it varies
over, and ``lax.cond`` branches and ``lax.fori_loop`` carries must agree on
it (``optim.arguments.per_worker_state`` states the rule). Every public
transform of ``optim`` that keeps per-worker state (and the ones in
``optim.muloco`` and ``optim.noloco``) takes ``STEPS`` steps three ways in
one program,

- ``init`` and ``STEPS`` updates in one trace (unrolled),
- ``init`` in the trace, the state carried through ``lax.fori_loop``,
- the state of a separately jitted ``init`` carried through
  ``lax.fori_loop``,

and each must give the parameters and state of the same steps taken with a
separately jitted ``init`` and a separately jitted one-step ``update``
(state leaving and re-entering ``shard_map`` between steps), bit for bit.
Each runs with one worker per device and with two vmapped workers per
device. The default tier runs one case of each failure the fix removed
(``FAST``), the slow tier all of them.
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
from decentral_jax.comm import compress
from decentral_jax.optim import muloco
from decentral_jax.optim import noloco
from decentral_jax.topology import pairings

N = 4
STEPS = 3
H = 2  # sync period: a sync inside the STEPS steps


def _topo(name="one_peer_exp"):
  return topology.make(name, N)


def _int8():
  return compress.Compressor("int8", block=4)


SGD = optax.sgd(0.1)


def _mean(ax):
  return optim.ExactMean(ax)


# name -> (worker axis -> transform). FIXED: the ones whose state type
# needed the fix (init and update in one trace or a fori_loop carry failed).
FIXED = {
    "diloco_delayed": lambda ax: optim.diloco(
        SGD, H, reduction=_mean(ax), timing=optim.Delayed(1)),
    "diloco_eager": lambda ax: optim.diloco(
        SGD, H, reduction=_mean(ax), timing=optim.Eager(1)),
    "elastic_diloco": lambda ax: optim.elastic_diloco(SGD, H, axis_name=ax),
    "elastic_local_sgd": lambda ax: optim.elastic_local_sgd(
        SGD, H, axis_name=ax),
    "sgp": lambda ax: optim.sgp(0.1, optim.one_peer_directed_exp(N),
                                axis_name=ax),
}
OTHERS = {
    "diloco_plain": lambda ax: optim.diloco(SGD, H, reduction=_mean(ax)),
    "diloco_delayed_trickle": lambda ax: optim.diloco(
        SGD, H, reduction=_mean(ax), timing=optim.Delayed(1, trickle=True)),
    "diloco_compressed": lambda ax: optim.diloco(
        SGD, H, reduction=optim.compressed(_int8(), axis_name=ax)),
    "diloco_gossip": lambda ax: optim.diloco(
        SGD, H, reduction=optim.GossipRound(_topo(), ax)),
    "local_sgd": lambda ax: optim.local_sgd(SGD, H, reduction=_mean(ax)),
    "streaming_diloco": lambda ax: optim.streaming_diloco(
        SGD, H, num_fragments=2, reduction=_mean(ax)),
    "elastic_diloco_rollback": lambda ax: optim.elastic_diloco(
        SGD, H, on_failure="rollback", axis_name=ax),
    "sgp_momentum": lambda ax: optim.sgp(
        0.1, optim.one_peer_directed_exp(N), momentum=0.9, axis_name=ax),
    "decentralized": lambda ax: optim.decentralized(
        optax.sgd(0.1, momentum=0.9), _topo(), ax),
    "decentralized_adamw_T2": lambda ax: optim.decentralized_adamw(
        0.1, _topo(), accum_steps=2, axis_name=ax),
    "gossip_mixing": lambda ax: optax.chain(
        SGD, optim.gossip_mixing(_topo(), ax)),
    "all_reduce_gradients": lambda ax: optax.chain(
        optim.all_reduce_gradients(ax), optax.adamw(0.1)),
    "scale_by_accum_adam_T2": lambda ax: optim.scale_by_accum_adam(
        accum_steps=2),
    "local_adamw_T2": lambda ax: optim.local_adamw(0.1, accum_steps=2),
    "choco": lambda ax: optax.chain(SGD, optim.choco_gossip(
        _topo("static_ring"), _int8(), 0.5, ax)),
    "choco_pipelined": lambda ax: optax.chain(SGD, optim.choco_gossip(
        _topo("static_ring"), _int8(), 0.5, ax, pipelined=True)),
    "desloc_adam": lambda ax: optim.desloc_adam(0.1, 1, 2, 3, axis_name=ax),
    "pipelined_gossip": lambda ax: optim.pipelined_gossip(SGD, _topo(), ax),
    "pipelined_adamw": lambda ax: optim.pipelined_adamw(
        0.1, _topo(), axis_name=ax),
    "gradient_tracking_sgd": lambda ax: optim.gradient_tracking_sgd(
        0.1, _topo(), axis_name=ax),
    "gradient_tracking_adamw_atc": lambda ax: optim.gradient_tracking_adamw(
        0.1, _topo(), form="atc", axis_name=ax),
    "tracked_decentralized": lambda ax: optim.tracked_decentralized(
        SGD, _topo(), ax),
    "muloco": lambda ax: optim.diloco(muloco.muon_inner(0.05), H,
                                      reduction=_mean(ax)),
    "noloco": lambda ax: noloco.noloco(
        SGD, H, pairings.pair_schedule([[(0, 1), (2, 3)]], N), axis_name=ax),
}
ALL = {**FIXED, **OTHERS}
# XLA compiles these one step at a time and as one program with different
# fusions, whose float rounding differs (by < 1 eps of a leaf's largest
# value here; the same without shard_map, e.g. scale_by_accum_adam with
# accum_steps=2 in a fori_loop): Adam's division by a square root, Muon's
# Newton-Schulz, CHOCO's block scales. Their integer and bool state is
# still compared bit for bit, their floats to ROUNDING eps.
REARRANGED = {"all_reduce_gradients", "choco", "choco_pipelined",
              "decentralized_adamw_T2", "desloc_adam",
              "gradient_tracking_adamw_atc", "local_adamw_T2", "muloco",
              "pipelined_adamw", "scale_by_accum_adam_T2"}
ROUNDING = 2


def _inputs(mesh):
  """Params ``[N, ...]`` and grads ``[N, STEPS, ...]``, distinct per worker."""
  rng = np.random.default_rng(0)
  shapes = {"kernel": (3, 2), "bias": (2,)}
  params = {k: rng.normal(size=(N,) + s).astype(np.float32)
            for k, s in shapes.items()}
  grads = {k: rng.normal(size=(N, STEPS) + s).astype(np.float32)
           for k, s in shapes.items()}
  return parallel.shard(params, mesh), parallel.shard(grads, mesh)


def _step(tx, p, s, g):
  u, s = tx.update(g, s, p)
  return optax.apply_updates(p, u), s


def _at(gs, t):
  return jax.tree.map(lambda a: a[t], gs)


def _three_ways(tx):
  """One worker's program: the three ways of carrying the state."""

  def loop(p, s, gs):
    return jax.lax.fori_loop(
        0, STEPS, lambda t, c: _step(tx, *c, _at(gs, t)), (p, s))

  def run(p, s0, gs):
    p1, s1 = p, tx.init(p)
    for t in range(STEPS):
      p1, s1 = _step(tx, p1, s1, _at(gs, t))
    return (p1, s1), loop(p, tx.init(p), gs), loop(p, s0, gs)

  return run


def _assert_same(got, want, way, exact):
  """Bit for bit; with ``exact=False`` float leaves within ``ROUNDING``."""
  assert jax.tree.structure(got) == jax.tree.structure(want), way
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got)):
    where = f"{way}: {jax.tree_util.keystr(path)}"
    g = np.asarray(g)
    assert g.dtype == w.dtype and g.shape == w.shape, where
    if exact or w.dtype.kind != "f":
      np.testing.assert_array_equal(g, w, err_msg=where)
    else:
      tol = ROUNDING * float(np.finfo(w.dtype).eps) * float(np.max(np.abs(w)))
      np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=where)


def _check(name, mesh):
  tx = ALL[name](parallel.worker_axis(mesh))
  params, grads = _inputs(mesh)
  s0 = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  step = jax.jit(parallel.per_worker(
      lambda p, s, g: _step(tx, p, s, g), mesh))
  p, s = params, s0
  for t in range(STEPS):
    p, s = step(p, s, jax.tree.map(lambda a, t=t: a[:, t], grads))
  want = jax.tree.map(np.asarray, (p, s))
  assert not np.array_equal(want[0]["kernel"], np.asarray(params["kernel"]))
  got = jax.jit(parallel.per_worker(_three_ways(tx), mesh))(params, s0, grads)
  for way, result in zip(("one trace", "init in fori_loop",
                          "fori_loop from jitted init"), got):
    _assert_same(result, want, way, exact=name not in REARRANGED)


FAST = {("diloco_delayed", 1), ("sgp", 1)}  # one case of each failure


@pytest.mark.parametrize("name,per_device", [
    pytest.param(name, k, marks=() if (name, k) in FAST else pytest.mark.slow)
    for k in (1, 2) for name in sorted(ALL)])
def test_state_carried_in_one_program(name, per_device):
  """``per_device`` workers per device (2: vmapped workers)."""
  require_devices(N // per_device)
  _check(name, parallel.make_mesh(N, workers_per_device=per_device))
