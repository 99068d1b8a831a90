"""Builders from a validated run config: learning-rate schedule and optimizer.

``make_optimizer`` looks the algorithm up in :data:`ALGORITHMS`: adding a
method is one builder function here (plus its module and config value).
Every builder returns the optax transform of *one* worker, to be updated
inside ``jax.shard_map`` over the worker axis.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import optax
from ml_collections import config_dict

from decentral_jax import gossip
from decentral_jax import models
from decentral_jax import optim
from decentral_jax import topology as topology_lib

# config.comm_dtype -> the dtype gossiped parameters are sent in.
COMM_DTYPES = {"": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
               "float32": jnp.float32}


def make_schedule(config: config_dict.ConfigDict) -> optax.Schedule:
  """The learning-rate schedule ``step -> lr`` of ``config.schedule``.

  * ``warmup_cosine``: linear from ``peak_lr / warmup_steps`` to ``peak_lr``
    over ``warmup_steps`` (PyTorch ``LinearLR(start_factor=1/warmup)``, as in
    the paper's GPT-2 run), then cosine to ``final_lr`` at ``config.steps``.
  * ``inverse_sqrt``: ``peak_lr * (0.99 (k+1)/W + 0.01)`` for ``k < W``, then
    ``peak_lr * sqrt(W) / sqrt(k+1)`` (paper Sec. 2.3, Transformer runs).
  * ``constant``: ``peak_lr``.

  Returns:
    An optax schedule (float32 learning rate for an integer step).
  """
  s = config.schedule
  peak, warmup = float(s.peak_lr), int(s.warmup_steps)
  if s.name == "constant":
    return optax.constant_schedule(peak)
  if s.name == "inverse_sqrt":
    w = max(warmup, 1)

    def inverse_sqrt(count):
      k = jnp.asarray(count, jnp.float32)
      warm = 0.99 * (k + 1.0) / w + 0.01
      return peak * jnp.where(k < w, warm, jnp.sqrt(float(w)) / jnp.sqrt(k + 1.0))

    return inverse_sqrt
  init = peak / warmup if warmup > 0 else peak
  return optax.warmup_cosine_decay_schedule(
      init_value=init, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(int(config.steps), warmup + 1),
      end_value=float(s.final_lr))


def _decentralized(config, schedule, topology, axis_name):
  """``chain(clip_by_global_norm(c), decentralized_adamw)``.

  Each worker clips its own gradient, then DAdam (``adamw``) or AccumAdamW
  (``accum_adamw``) steps from the gossip-mixed point ``W_k x_k``.
  """
  o = config.optimizer
  clip = float(config.grad_clip)
  accum = int(o.accum_steps) if o.name == "accum_adamw" else 1
  tx = optim.decentralized_adamw(
      schedule, topology, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, mask=models.decay_mask, accum_steps=accum,
      axis_name=axis_name, comm_dtype=COMM_DTYPES[config.comm_dtype])
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


def _all_reduce(config, schedule, topology, axis_name):
  """``chain(all_reduce_gradients, clip_by_global_norm(c), adamw)``.

  The clip acts on the averaged gradient; ``accum_adamw`` applies
  AccumAdamW after the all-reduce.
  """
  del topology
  o = config.optimizer
  mask = models.decay_mask
  clip = float(config.grad_clip)
  parts = [optim.all_reduce_gradients(axis_name)]
  if clip:
    parts.append(optax.clip_by_global_norm(clip))
  if o.name == "adamw":
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=mask))
  else:
    parts += [optim.scale_by_accum_adam(o.b1, o.b2, o.eps,
                                        accum_steps=int(o.accum_steps)),
              optax.add_decayed_weights(o.weight_decay, mask),
              optax.scale_by_learning_rate(schedule)]
  return optax.chain(*parts)


class Algorithm(NamedTuple):
  """A ``config.algorithm`` entry."""
  # build(config, schedule, topology or None, axis_name) -> per-worker tx.
  build: Callable[..., optax.GradientTransformation]
  # True if it communicates over config.topology (the runner builds it).
  uses_topology: bool


ALGORITHMS: dict[str, Algorithm] = {
    "all_reduce": Algorithm(_all_reduce, uses_topology=False),
    "decentralized": Algorithm(_decentralized, uses_topology=True),
}


def make_optimizer(config: config_dict.ConfigDict, schedule: optax.Schedule,
                   topology: topology_lib.Topology | None,
                   axis_name: gossip.AxisName) -> optax.GradientTransformation:
  """The optax transform of one worker (to be updated inside ``shard_map``).

  Weight decay applies to leaves with ``ndim >= 2``; ``grad_clip = 0``
  drops the clip. See the builders in :data:`ALGORITHMS`.

  Raises:
    ValueError: an unknown ``config.algorithm``.
  """
  entry = ALGORITHMS.get(config.algorithm)
  if entry is None:
    raise ValueError(f"unknown config.algorithm={config.algorithm!r}; use "
                     f"one of {', '.join(ALGORITHMS)}.")
  return entry.build(config, schedule, topology, axis_name)
