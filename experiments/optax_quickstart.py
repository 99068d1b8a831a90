"""The optax composition of README.md as a complete, runnable script.

Eight simulated CPU workers fit a linear model to their own data with
AccumAdamW on a gossip topology (or the All-Reduce baseline)::

  python experiments/optax_quickstart.py --topology alternating_exp_ring --local_size 4
  python experiments/optax_quickstart.py --all_reduce

``--topology`` and ``--local_size`` are refused with ``--all_reduce``,
which reads neither (it averages over all workers on any mesh); an empty
``--topology ''`` is refused, not read as left out.
"""

from __future__ import annotations

import argparse
import os
import sys

from decentral_jax import checks  # NumPy only: before JAX reads XLA_FLAGS
from decentral_jax.tools import flag_types  # no JAX

N_WORKERS = 8
DEFAULT_TOPOLOGY = "one_peer_exp"


def _simulate_devices() -> None:
  """Asks XLA for ``N_WORKERS`` simulated CPU devices unless the
  environment sets a count (``XLA_FLAGS`` or ``JAX_NUM_CPU_DEVICES``); a
  count that is not a whole number >= 1 is one ``error:`` line and exit 2
  (XLA aborts the process on it)."""
  try:
    count = checks.xla_flags_device_count()
    env = checks.environment_count("JAX_NUM_CPU_DEVICES")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  if count is None and env is None:  # an empty XLA_FLAGS too
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} "
        f"--{checks.XLA_DEVICE_COUNT_OPTION}={N_WORKERS}").strip()


_simulate_devices()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import decentral_jax as dj  # noqa: E402


def _checked_setup(p: argparse.ArgumentParser, args, n: int):
  """The topology (None with ``--all_reduce``) and mesh of the flags; a bad
  flag, or one the chosen mode does not read (``--topology`` or
  ``--local_size`` with ``--all_reduce``), is ``p.error`` (exit 2) and too
  few devices one
  ``error:`` line (exit 2), before any compile."""
  if args.steps < 1:
    p.error(f"--steps={args.steps} must be a whole number >= 1.")
  if args.steps > checks.INT32_MAX:  # the runner's bound of config.steps
    p.error(f"--steps={args.steps} must be at most {checks.INT32_MAX}.")
  for flag in ("topology", "local_size") if args.all_reduce else ():
    if getattr(args, flag) is not None:  # given, even as its default
      p.error(f"--{flag}={getattr(args, flag)!r} is not read with "
              "--all_reduce (the gradients are averaged over all workers); "
              f"drop --{flag} or --all_reduce.")
  if args.topology == "":
    p.error("--topology='' is empty; give a topology name (e.g. "
            f"{DEFAULT_TOPOLOGY}) or leave --topology out.")
  args.local_size = 1 if args.local_size is None else args.local_size
  if args.local_size < 1 or n % args.local_size:
    p.error(f"--local_size={args.local_size} must divide the {n} workers "
            "(1, 2, 4 or 8).")
  topo = None
  if not args.all_reduce:
    if args.topology is None:
      args.topology = DEFAULT_TOPOLOGY
    try:
      topo = dj.topology.make(args.topology, n, args.local_size)
    except ValueError as e:
      p.error(f"--topology={args.topology!r}: {e}")
  if jax.device_count() < n:
    print(f"error: this script runs {n} workers, one per device, but JAX "
          f"sees {jax.device_count()} ({jax.default_backend()}); on CPU set "
          f"XLA_FLAGS=--{checks.XLA_DEVICE_COUNT_OPTION}={n} (or leave it "
          "and JAX_NUM_CPU_DEVICES unset).", file=sys.stderr)
    raise SystemExit(2)
  # A (nodes, local) mesh lets node-aware rounds use fast intra-node means.
  mesh = dj.parallel.make_mesh(n, args.local_size,
                               node_aware=args.local_size > 1)
  return topo, mesh


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default=None,
                 help=f"gossip topology (default {DEFAULT_TOPOLOGY}; not "
                      "with --all_reduce)")
  p.add_argument("--local_size", type=int, default=None,
                 help="workers per node (default 1; not with --all_reduce)")
  p.add_argument("--all_reduce", action="store_true")
  p.add_argument("--steps", type=int, default=100)
  why = flag_types.repeated_flag(p, sys.argv[1:] if argv is None else argv)
  if why:  # argparse keeps the last value of a flag given twice
    p.error(why)
  args = p.parse_args(argv)
  n = N_WORKERS
  topo, mesh = _checked_setup(p, args, n)
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
