"""Local DAdam (``gossip_every > 1``) with its rounds chosen on the host.

With ``gossip_rounds="static"`` the runner compiles one program per
distinct round for the gossip steps and one without any collective for the
steps in between (``programs.LOCAL_STEP``), instead of a ``lax.cond``
around the gossip (which keeps it from overlapping the step on GPUs,
docs/gpu_overlap.md). The reference is the in-graph run
(``gossip_rounds="switch"``): the same parameters bit for bit.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import programs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8


def _config(mode: str):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"), (
      "--config.model.n_layer=1", "--config.model.n_embd=32",
      "--config.model.n_head=2", "--config.model.block_size=16",
      "--config.global_batch=16", "--config.steps=6",
      "--config.topology=ring", "--config.optimizer.accum_steps=2",
      "--config.gossip_every=2", f"--config.gossip_rounds={mode}"))


@pytest.mark.slow  # two training runs: the slow tier
def test_static_local_steps_match_switch():
  require_devices(N)
  runs = {}
  for mode in ("switch", "static"):
    exp = experiment_lib.Experiment(_config(mode))
    state = exp.init_state()
    for s in range(6):
      state, _ = exp.train_step(state, exp.get_batch(s), s)
    runs[mode] = (exp, jax.device_get(state.params))
  static = runs["static"][0]
  # Steps 0, 2, 4 gossip with ring rounds 0, 1, 0; steps 1, 3, 5 are local.
  assert [static.programs.key_of(s)[0] for s in range(6)] == [
      0, programs.LOCAL_STEP, 1, programs.LOCAL_STEP, 0,
      programs.LOCAL_STEP]
  assert static.programs.traces == 3  # round 0, round 1, local
  assert runs["switch"][0].programs.traces == 1
  for a, b in zip(jax.tree.leaves(runs["switch"][1]),
                  jax.tree.leaves(runs["static"][1])):
    np.testing.assert_array_equal(a, b)
  # The local program has no collective in its HLO; a gossip program has.
  st, batch = static.abstract_inputs()
  local = static.programs.get(programs.LOCAL_STEP, "logged").trace(
      st, batch).lower().as_text()
  gossip = static.programs.get(0, "logged").trace(st, batch).lower().as_text()
  assert "collective_permute" in gossip or "all_reduce" in gossip
  assert "collective_permute" not in local


# One case in the default run (complete, the pmean round that differed);
# the other 11 are slow.
_ROUND_CASES = [pytest.param(name, tau, after, marks=() if (
    name, tau, after) == ("complete", 2, False) else pytest.mark.slow)
                for name in ("complete", "ring", "exponential")
                for tau in (2, 3) for after in (False, True)]


@pytest.mark.parametrize("name, tau, after", _ROUND_CASES)
def test_static_round_index_is_bit_identical_to_in_graph_round(name, tau,
                                                               after):
  # A global-mean round (complete) once rounded differently by an ulp
  # outside lax.cond: its psum * 1/8 was contracted into the next add.
  require_devices(N)
  topo = topology.make(name, N)
  mesh = parallel.make_mesh(N)
  tx = optim.decentralized_adamw(0.1, topo, weight_decay=0.1,
                                 gossip_every=tau, mix_after_update=after)

  def step(p, s, g, round_index=None):
    u, s = tx.update(g, s, p, round_index=round_index)
    return optax.apply_updates(p, u), s

  cycle = tau * topo.period
  switch = jax.jit(parallel.per_worker(step, mesh))
  static = [jax.jit(parallel.per_worker(
      lambda p, s, g, r=r: step(p, s, g, round_index=r), mesh))
            for r in range(cycle)]
  for seed, shape in ((0, (4, 3)), (1, (7,)), (2, (2, 5, 3))):
    rng = np.random.default_rng(seed)
    p0 = parallel.shard({"w": jnp.asarray(rng.normal(size=(N, *shape)),
                                          jnp.float32)}, mesh)
    s0 = jax.jit(parallel.per_worker(tx.init, mesh))(p0)
    pa, sa, pb, sb = p0, s0, p0, s0
    for k in range(cycle + 2):
      g = parallel.shard({"w": jnp.asarray(rng.normal(size=(N, *shape)),
                                           jnp.float32)}, mesh)
      pa, sa = switch(pa, sa, g)
      pb, sb = static[k % cycle](pb, sb, g)
      np.testing.assert_array_equal(np.asarray(pa["w"]), np.asarray(pb["w"]))
