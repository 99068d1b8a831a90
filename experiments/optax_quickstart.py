"""The optax composition of README.md as a complete, runnable script.

Eight simulated CPU workers fit a linear model to their own data with
AccumAdamW on a gossip topology (or the All-Reduce baseline)::

  python experiments/optax_quickstart.py --topology alternating_exp_ring --local_size 4
  python experiments/optax_quickstart.py --all_reduce
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import decentral_jax as dj  # noqa: E402


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="one_peer_exp")
  p.add_argument("--local_size", type=int, default=1)
  p.add_argument("--all_reduce", action="store_true")
  p.add_argument("--steps", type=int, default=100)
  args = p.parse_args(argv)
  n = 8
  topo = dj.topology.make(args.topology, n, args.local_size)
  # A (nodes, local) mesh lets node-aware rounds use fast intra-node means.
  mesh = dj.parallel.make_mesh(n, args.local_size,
                               node_aware=args.local_size > 1)
  axis = dj.parallel.worker_axis(mesh)  # "workers" or ("nodes", "local")
  if args.all_reduce:
    tx = optax.chain(dj.all_reduce_gradients(axis), optax.adamw(1e-2))
  else:
    tx = optax.chain(optax.clip_by_global_norm(1.0), dj.decentralized_adamw(
        1e-2, topo, weight_decay=1e-4, accum_steps=4, axis_name=axis))

  def loss_fn(params, batch):  # one worker's loss on its own batch
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def train_step(params, opt_state, batch):  # one worker's view
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(dj.parallel.per_worker(train_step, mesh), donate_argnums=(0, 1))
  init = jax.jit(dj.parallel.per_worker(tx.init, mesh))
  distance = jax.jit(dj.parallel.per_worker(
      lambda p: dj.comm.consensus_distance(p, axis), mesh))

  rng = np.random.default_rng(0)
  w_true = rng.normal(size=(4, 1)).astype(np.float32)
  params = dj.parallel.replicate(  # identical start, stacked [n, ...]
      {"w": jnp.zeros((4, 1)), "b": jnp.zeros((1,))}, mesh)
  opt_state = init(params)
  for k in range(args.steps):
    x = rng.normal(size=(n, 16, 4)).astype(np.float32)  # [workers, batch, 4]
    batch = dj.parallel.shard((x, x @ w_true), mesh)
    params, opt_state, loss = step(params, opt_state, batch)
    if k % 16 == 15:  # bound the steps in flight (docs/optax.md)
      jax.block_until_ready(loss)
  out = {"loss": float(np.mean(loss)),
         "consensus_distance": float(np.asarray(distance(params))[0]),
         "worker0_w": dj.parallel.unstack(params, 0)["w"].ravel().tolist()}
  print(out)
  return out


if __name__ == "__main__":
  main()
