"""Builders from a validated run config: learning-rate schedule, optimizer
and the runtime-model spec.

``make_optimizer`` and ``spec_for_config`` look the algorithm up in the
method registry (:data:`decentral_jax.runner.methods.ALGORITHMS`), filled
by the method homes under :mod:`decentral_jax.runner.methods`. Every
builder returns the optax transform of *one* worker, to be updated inside
``jax.shard_map`` over the worker axis.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from ml_collections import config_dict

from decentral_jax.comm import gossip
from decentral_jax.runner import methods
from decentral_jax.topology import schedules as topology_lib


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


def make_optimizer(config: config_dict.ConfigDict, schedule: optax.Schedule,
                   topology: topology_lib.Topology | None,
                   axis_name: gossip.AxisName) -> optax.GradientTransformation:
  """The optax transform of one worker (to be updated inside ``shard_map``).

  Weight decay applies to leaves with ``ndim >= 2``; ``grad_clip = 0``
  drops the clip. See the method homes (:mod:`decentral_jax.runner.methods`)
  for each ``Method.build``.

  Raises:
    ValueError: an unknown ``config.algorithm``.
  """
  method = methods.lookup(config.algorithm)
  return method.build(config, schedule, topology, axis_name)


def spec_for_config(config) -> tuple[str, dict]:
  """The runtime-model spec and workload fields that price a run config.

  The algorithm's ``Method.runtime_spec(config)``: its runtime-model spec
  filled in from the config, with its message settings appended.

  Args:
    config: a run config (:mod:`decentral_jax.runner.config`):
      ``algorithm``, ``topology``, ``optimizer.name`` and ``accum_steps``,
      ``gossip_every``, ``sync_every``, ``num_fragments``,
      ``overlap_steps``, ``comm_dtype``, ``bucket_bytes``,
      ``compression`` (format, block, fraction: the spec's ``compress``,
      ``block``, ``fraction``), ``devices_per_worker`` and
      ``worker_layout`` are read.

  Returns:
    ``(spec, workload_fields)``: a spec for
    :func:`decentral_jax.runtime_model.specs.make_method` and
    ``{"devices_per_worker", "worker_layout"}`` for the
    :class:`~decentral_jax.runtime_model.workload.Workload`. Decentralized
    training with ``gossip_every = H > 1`` is ``local_dsgd:H=..``.
    ``bucket_bytes = 0`` (one collective per leaf) keeps the workload's
    buckets.

  Raises:
    ValueError: an unknown ``config.algorithm`` (naming it).
  """
  method = methods.lookup(str(config.algorithm))
  return method.runtime_spec(config), {
      "devices_per_worker": int(config.devices_per_worker),
      "worker_layout": str(config.worker_layout)}
