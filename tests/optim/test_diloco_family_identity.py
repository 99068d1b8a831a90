"""The DiLoCo family's trajectories, bit for bit, against committed hashes.

Every combination of the local-update settings that the runner accepts is
built by the runner's own builder (``builders.make_optimizer``) from a run
config, trained for a few steps on a tiny quadratic problem (per-worker
targets, per-step gradient noise) inside ``shard_map`` over 4 workers, and
hashed: the final parameters, the evaluated parameters (the algorithm's
``eval_params``, e.g. ``theta``) and the optimizer state leaves (as a sorted
multiset of per-leaf digests, so that a state reorganised into other
NamedTuples but holding the same values hashes the same).

Combinations: the union of the products of the axes in :data:`GROUPS`, each
config filtered by ``validation.check_config`` (a config the runner refuses
is skipped by construction, not listed by hand). Fault runs get a fixed
pattern of live/working masks (a straggler, a failure, a rejoin).

``python tests/optim/test_diloco_family_identity.py`` (from the repository root)
rewrites ``tests/fixtures/diloco_family_hashes.json``; do that only for a
change that is meant to alter these trajectories.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sys

if __name__ == "__main__":  # as pytest's conftest does, before JAX starts
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                             "--xla_force_host_platform_device_count=16")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from decentral_jax import parallel  # noqa: E402
from decentral_jax import topology as topology_lib  # noqa: E402
from decentral_jax.runner import builders  # noqa: E402
from decentral_jax.runner import config as config_lib  # noqa: E402
from decentral_jax.runner import methods  # noqa: E402
from decentral_jax.runner import validation  # noqa: E402

FIXTURE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "diloco_family_hashes.json")
N = 4
STEPS = 10

_BASE = {"n_workers": N, "global_batch": 16, "steps": STEPS,
         "optimizer.name": "adamw", "optimizer.accum_steps": 1,
         "schedule.warmup_steps": 2}
_H = {"local_sgd": 3, "diloco": 3, "decentralized_diloco": 3,
      "streaming_diloco": 4}
_OVERLAPS = ({}, {"outer_overlap": "delayed"},
             {"outer_overlap": "delayed", "outer_latency": 2,
              "trickle_reduction": False},
             {"outer_overlap": "eager"},
             {"outer_overlap": "eager", "outer_latency": 2},
             {"outer_overlap": "eager", "trickle_reduction": False})
_COMPRESSION = ({}, {"compression.format": "int8", "compression.block": 8},
                {"compression.format": "int8", "compression.block": 8,
                 "compression.error_feedback": True},
                {"compression.format": "topk", "compression.block": 8,
                 "compression.fraction": 0.25,
                 "compression.error_feedback": True,
                 "compression.error_decay": 0.95},
                {"compression.format": "int4", "compression.block": 8})
# (a failure rate, which the fixed masks replace, makes the runner read
# rejoin and on_failure: without one it refuses them as having no effect)
_FAILING = {"faults.enabled": True, "faults.failure_rate": 0.01}
_FAULTS = ({}, {"faults.enabled": True},
           {**_FAILING, "faults.on_failure": "rollback",
            "faults.min_quorum": 3},
           {**_FAILING, "faults.rejoin": "copy_mean"},
           {**_FAILING, "faults.rejoin": "keep"})
_OUTER = ({}, {"outer_optimizer.name": "adam", "outer_optimizer.lr": 0.1},
          {"outer_optimizer.momentum": 0.0, "outer_optimizer.nesterov": False,
           "outer_optimizer.lr": 1.0})
_STREAMING = ({}, {"num_fragments": 2, "overlap_steps": 1,
                   "merge_alpha": 0.25},
              {"num_fragments": 3, "merge_alpha": 0.5},
              {"num_fragments": 2})
_TOPOLOGY = ({"topology": "ring"}, {"topology": "static_ring"},
             {"topology": "exponential", "bucket_bytes": 64})
_DTYPE = ({}, {"comm_dtype": "bfloat16"})
_VIRTUAL = ({}, {"workers_per_device": 2})
_ALGORITHMS = tuple({"algorithm": a} for a in _H)

#: Axis groups; the combinations are the union of each group's product.
GROUPS = (
    (_ALGORITHMS, _DTYPE, _OVERLAPS, _COMPRESSION, _OUTER[:2]),
    (_ALGORITHMS, _FAULTS, _OUTER[:2]),
    (_ALGORITHMS, _STREAMING, _DTYPE, _OVERLAPS[:4], _COMPRESSION[:3]),
    (_ALGORITHMS, _TOPOLOGY, _DTYPE, _OVERLAPS, _OUTER[:2]),
    (_ALGORITHMS, _VIRTUAL, _OVERLAPS[:4], _TOPOLOGY[1:2]),
    (_ALGORITHMS, _VIRTUAL, _OVERLAPS[:4], _STREAMING[1:3]),
)


def _name(settings: dict) -> str:
  return ",".join(f"{k}={v}" for k, v in sorted(settings.items()))


@functools.cache
def combinations() -> dict[str, dict]:
  """``{name: settings}`` of every grouped combination the runner accepts."""
  out = {}
  for group in GROUPS:
    for parts in itertools.product(*group):
      settings = {}
      for part in parts:
        settings.update(part)
      algo = settings["algorithm"]
      settings.setdefault("sync_every", _H[algo])
      if algo == "decentralized_diloco":
        settings.setdefault("topology", "ring")
      name = _name(settings)
      if name in out:
        continue
      try:
        validation.check_config(_config(settings))
      except ValueError:
        continue
      out[name] = settings
  return out


def _config(settings: dict):
  c = config_lib.base_config()
  for key, value in {**_BASE, **settings}.items():
    node = c
    *groups, last = key.split(".")
    for g in groups:
      node = node[g]
    node[last] = value
  return c


def _masks(step: int):
  """``(alive, working)`` of ``step``: worker 1 slow at steps 1-2, worker 3
  dead at steps 4-6 (rejoins at 7), all well otherwise."""
  alive = np.ones(N, bool)
  working = np.ones(N, bool)
  if step in (1, 2):
    working[1] = False
  if step in (4, 5, 6):
    alive[3] = False
    working[3] = False
  return alive, working


def _digest(a) -> str:
  a = np.asarray(a)
  h = hashlib.sha256(f"{a.dtype}{a.shape}".encode())
  h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def _tree_digest(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(_digest(leaf).encode())
  return h.hexdigest()[:16]


def run(settings: dict) -> dict:
  """Trains ``settings`` for :data:`STEPS` steps; returns its digests."""
  c = _config(settings)
  algo = methods.ALGORITHMS[c.algorithm]
  wpd = int(c.workers_per_device)
  devices = jax.devices()[:N // wpd]
  mesh = parallel.make_mesh(N, devices=devices, workers_per_device=wpd)
  axis = parallel.worker_axis(mesh)
  topo = topology_lib.make(c.topology, N) if algo.uses_topology else None
  tx = builders.make_optimizer(c, builders.make_schedule(c), topo, axis)
  faults = bool(c.faults.enabled)
  rng = np.random.default_rng(0)
  x0 = {"a": rng.normal(size=(N, 3, 5)).astype(np.float32),
        "b": rng.normal(size=(N, 7)).astype(np.float32),
        "c": rng.normal(size=(N, 2, 2)).astype(np.float32)}
  x0 = jax.tree.map(lambda v: np.broadcast_to(v[:1], v.shape).copy(), x0)
  target = jax.tree.map(lambda v: rng.normal(size=v.shape).astype(v.dtype),
                        x0)
  noise = jax.tree.map(
      lambda v: rng.normal(size=(STEPS, *v.shape)).astype(v.dtype), x0)

  def step(params, state, b, e, alive, working):
    grads = jax.tree.map(lambda x, t, z: x - t + 0.1 * z, params, b, e)
    extra = {"alive": alive, "working": working} if faults else {}
    updates, state = tx.update(grads, state, params, **extra)
    params = optax.apply_updates(params, updates)
    evaluated = params if algo.eval_params is None else algo.eval_params(
        params, state)
    return params, state, evaluated

  step = jax.jit(parallel.per_worker(step, mesh, replicated_argnums=(4, 5)))
  params = parallel.shard(x0, mesh)
  b = parallel.shard(target, mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  for t in range(STEPS):
    e = parallel.shard(jax.tree.map(lambda z: z[t], noise), mesh)
    alive, working = (jnp.asarray(m) for m in _masks(t))
    params, state, evaluated = step(params, state, b, e, alive, working)
  params, state, evaluated = jax.device_get((params, state, evaluated))
  return {"params": _tree_digest(params), "eval": _tree_digest(evaluated),
          "state": sorted(_digest(v) for v in jax.tree.leaves(state))}


def _expected() -> dict:
  with open(FIXTURE) as f:
    return json.load(f)


_FAST = ("algorithm=diloco,outer_overlap=eager,sync_every=3",)


def _cases():
  names = sorted(_expected())
  return [n if n in _FAST else pytest.param(n, marks=pytest.mark.slow)
          for n in names]


def test_every_accepted_combination_is_in_the_fixture():
  assert sorted(combinations()) == sorted(_expected())


@pytest.mark.parametrize("name", _cases())
def test_trajectory_matches_fixture(name):
  want = _expected()[name]
  assert name in combinations(), f"{name}: no longer accepted"
  got = run(combinations()[name])
  assert got == want, name


def main() -> None:
  combos = combinations()
  out = {}
  for i, (name, settings) in enumerate(sorted(combos.items())):
    out[name] = run(settings)
    print(f"{i + 1}/{len(combos)} {name}", flush=True)
  with open(FIXTURE, "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
    f.write("\n")


if __name__ == "__main__":
  sys.exit(main())
