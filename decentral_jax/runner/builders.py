"""Builders from a validated run config: learning-rate schedule and optimizer.

``make_optimizer`` looks the algorithm up in :data:`ALGORITHMS`: adding a
method is one builder function here (plus its module and config value),
with the :data:`METHOD_FIELDS` it reads and the runtime-model spec that
prices it (:func:`spec_for_config`). Every builder returns the optax
transform of *one* worker, to be updated inside ``jax.shard_map`` over the
worker axis.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import optax
from ml_collections import config_dict

from decentral_jax.comm import compress
from decentral_jax.comm import gossip
from decentral_jax.optim import choco
from decentral_jax.optim import elastic
from decentral_jax.optim import local_updates
from decentral_jax.optim import transforms
from decentral_jax.optim import push_sum
from decentral_jax.topology import schedules as topology_lib

PyTree = Any

# config.comm_dtype -> the dtype on the wire of the synchronisation.
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


def _adam(config, schedule) -> list[optax.GradientTransformation]:
  """AdamW (``adamw``) or AccumAdamW (``accum_adamw``) of ``config.optimizer``.

  Weight decay on leaves with ``ndim >= 2``; the learning rate ``schedule``.
  """
  o = config.optimizer
  mask = transforms.default_weight_decay_mask
  if o.name == "adamw":
    return [optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=mask)]
  return [transforms.scale_by_accum_adam(o.b1, o.b2, o.eps,
                                    accum_steps=int(o.accum_steps),
                                    beta_convention=o.beta_convention),
          optax.add_decayed_weights(o.weight_decay, mask),
          optax.scale_by_learning_rate(schedule)]


def _clipped(config, tx: optax.GradientTransformation):
  clip = float(config.grad_clip)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


def compressor(config) -> compress.Compressor | None:
  """``config.compression`` as a Compressor, or None for ``"none"``."""
  c = config.compression
  if c.format == "none":
    return None
  if c.format == "topk":
    return compress.Compressor("topk", block=int(c.block),
                               fraction=float(c.fraction))
  return compress.Compressor(str(c.format), block=int(c.block))


def _coding(config) -> dict:
  """Compression arguments of a local-update transform ({} if off)."""
  comp = compressor(config)
  if comp is None:
    return {}
  c = config.compression
  return {"compressor": comp, "error_feedback": bool(c.error_feedback),
          "error_decay": float(c.error_decay)}


def _decentralized(config, schedule, topology, axis_name):
  """``chain(clip_by_global_norm(c), decentralized_adamw)``.

  Each worker clips its own gradient, then DAdam (``adamw``) or AccumAdamW
  (``accum_adamw``) steps from the gossip-mixed point ``W_k x_k``, mixing
  every ``config.gossip_every`` steps. With ``config.compression``:
  ``chain(clip, AdamW or AccumAdamW, choco_gossip)``, the local step
  ``u_i`` then CHOCO-gossip of ``x_i + u_i`` (:mod:`optim.choco`).
  """
  comp = compressor(config)
  if comp is not None:
    gamma = float(config.compression.consensus_step)
    return _clipped(config, optax.chain(
        *_adam(config, schedule),
        choco.choco_gossip(topology, comp, gamma, axis_name)))
  o = config.optimizer
  accum = int(o.accum_steps) if o.name == "accum_adamw" else 1
  return _clipped(config, transforms.decentralized_adamw(
      schedule, topology, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, mask=transforms.default_weight_decay_mask,
      accum_steps=accum,
      axis_name=axis_name, comm_dtype=COMM_DTYPES[config.comm_dtype],
      gossip_every=int(config.gossip_every),
      bucket_bytes=int(config.bucket_bytes),
      beta_convention=o.beta_convention))


def _all_reduce(config, schedule, topology, axis_name):
  """``chain(all_reduce_gradients, clip_by_global_norm(c), adamw)``.

  The clip acts on the averaged gradient; ``accum_adamw`` applies
  AccumAdamW after the all-reduce.
  """
  del topology
  clip = float(config.grad_clip)
  parts = [transforms.all_reduce_gradients(axis_name)]
  if clip:
    parts.append(optax.clip_by_global_norm(clip))
  return optax.chain(*parts, *_adam(config, schedule))


def _inner(config, schedule) -> optax.GradientTransformation:
  """The worker-local inner optimizer of the local-update methods.

  ``chain(clip_by_global_norm(c), adamw)`` on each worker's own gradient.
  """
  return _clipped(config, optax.chain(*_adam(config, schedule)))


def _outer(config) -> optax.GradientTransformation:
  """``config.outer_optimizer``: SGD (momentum, Nesterov) or Adam."""
  o = config.outer_optimizer
  if o.name == "adam":
    return optax.adam(float(o.lr))
  return optax.sgd(float(o.lr), momentum=float(o.momentum) or None,
                   nesterov=bool(o.nesterov))


def _faults(config) -> dict | None:
  """``elastic`` keyword arguments if ``config.faults.enabled``, else None."""
  f = config.get("faults")
  if f is None or not f.enabled:
    return None
  return dict(min_quorum=int(f.min_quorum), on_failure=str(f.on_failure),
              rejoin=str(f.rejoin))


def _local_sgd(config, schedule, topology, axis_name):
  """Local SGD (inner AdamW; average every ``sync_every`` steps, sent in
  ``comm_dtype``); with ``config.faults`` over the live workers
  (:mod:`optim.elastic`)."""
  del topology
  if _faults(config) is not None:
    return elastic.elastic_local_sgd(_inner(config, schedule),
                                     int(config.sync_every),
                                     axis_name=axis_name, **_faults(config))
  return local_updates.local_sgd(_inner(config, schedule),
                                 int(config.sync_every), axis_name,
                                 comm_dtype=COMM_DTYPES[config.comm_dtype],
                                 **_coding(config))


def _diloco(config, schedule, topology, axis_name):
  """DiLoCo, or decentralized DiLoCo when ``topology`` is given (the
  pseudo-gradients, or with a topology the parameters, sent in
  ``comm_dtype``); with ``outer_overlap`` its delayed or eager outer step;
  with ``config.faults`` over the live workers (:mod:`optim.elastic`)."""
  if _faults(config) is not None and topology is None:
    return elastic.elastic_diloco(_inner(config, schedule),
                                  int(config.sync_every), outer=_outer(config),
                                  axis_name=axis_name, **_faults(config))
  return local_updates.diloco(_inner(config, schedule),
                              int(config.sync_every), outer=_outer(config),
                              topology=topology, axis_name=axis_name,
                              bucket_bytes=int(config.bucket_bytes),
                              comm_dtype=COMM_DTYPES[config.comm_dtype],
                              **_overlap_args(config), **_coding(config))


def _overlap_args(config) -> dict:
  """``overlap``, ``latency`` and ``trickle`` of a DiLoCo transform."""
  if config.outer_overlap == "none":
    return {}
  return {"overlap": config.outer_overlap,
          "latency": int(config.outer_latency),
          "trickle": bool(config.trickle_reduction)}


def _streaming_diloco(config, schedule, topology, axis_name):
  """Streaming DiLoCo (fragments, overlap, merge alpha, wire dtype; with
  ``outer_overlap`` a delayed or eager outer step per fragment)."""
  del topology
  return local_updates.streaming_diloco(
      _inner(config, schedule), int(config.sync_every),
      num_fragments=int(config.num_fragments),
      overlap_steps=int(config.overlap_steps),
      merge_alpha=float(config.merge_alpha), outer=_outer(config),
      comm_dtype=COMM_DTYPES[config.comm_dtype], axis_name=axis_name,
      **_overlap_args(config), **_coding(config))


def _sgp(config, schedule, topology, axis_name):
  """SGP: the inner AdamW on the numerators, push-sum mixing over topology."""
  return push_sum.push_sum(_inner(config, schedule), topology, axis_name,
                           comm_dtype=COMM_DTYPES[config.comm_dtype],
                           bucket_bytes=int(config.bucket_bytes))


def _theta(params, opt_state):
  del params
  return local_updates.global_params(opt_state)


def _numerators(params, opt_state):
  del opt_state
  return params


#: Config fields that only some algorithms read. Each entry of
#: :data:`ALGORITHMS` lists those it reads (``Algorithm.fields``);
#: ``validation.check_config`` refuses a value other than the
#: ``base_config`` default of one that ``config.algorithm`` does not read.
METHOD_FIELDS = ("topology", "comm_dtype", "bucket_bytes", "gossip_rounds",
                 "global_avg_interval", "gossip_every", "sync_every",
                 "outer_optimizer.name", "outer_optimizer.lr",
                 "outer_optimizer.momentum", "outer_optimizer.nesterov",
                 "num_fragments", "overlap_steps", "merge_alpha",
                 "outer_overlap", "outer_latency", "trickle_reduction",
                 "compression.format", "compression.block",
                 "compression.fraction", "compression.error_feedback",
                 "compression.error_decay", "compression.consensus_step")
# config.compression: CHOCO-gossip (decentralized) or compressed
# pseudo-gradients (local_sgd, diloco, streaming_diloco).
_FORMAT_FIELDS = ("compression.format", "compression.block",
                  "compression.fraction")
_CHOCO_FIELDS = (*_FORMAT_FIELDS, "compression.consensus_step")
_PSEUDO_FIELDS = (*_FORMAT_FIELDS, "compression.error_feedback",
                  "compression.error_decay")
_GOSSIP_FIELDS = ("topology", "comm_dtype", "bucket_bytes", "gossip_rounds")
_OUTER_FIELDS = ("sync_every", "outer_optimizer.name", "outer_optimizer.lr",
                 "outer_optimizer.momentum", "outer_optimizer.nesterov")
# The DiLoCo methods' overlapped outer step (outer_latency and
# trickle_reduction are read only with outer_overlap != "none").
_OVERLAP_FIELDS = ("outer_overlap", "outer_latency", "trickle_reduction")


class Algorithm(NamedTuple):
  """A ``config.algorithm`` entry."""
  # build(config, schedule, topology or None, axis_name) -> per-worker tx.
  build: Callable[..., optax.GradientTransformation]
  # True if it communicates over config.topology (the runner builds it).
  uses_topology: bool
  # Template of its runtime-model spec (decentral_jax.runtime_model.specs,
  # local_methods), filled in by spec_for_config.
  runtime_spec: str
  # The METHOD_FIELDS it reads (the others must keep their defaults).
  fields: tuple[str, ...]
  # eval_params(params, opt_state) -> this worker's parameters of "the
  # averaged model" (the evaluation averages them over the workers); None:
  # the worker's model (below).
  eval_params: Callable[..., PyTree] | None = None
  # model_params(params, opt_state) -> the worker's own model, where its
  # gradient is taken and its consensus distance measured (None: params).
  model_params: Callable[..., PyTree] | None = None
  # global_average(params, opt_state, axis_name) -> (params, opt_state) for
  # config.global_avg_interval (None: the exact mean of the parameters).
  global_average: Callable[..., tuple] | None = None


# all_reduce: the workers hold equal parameters (global_avg_interval would
# average equal values) and reduce gradients, not gossiped parameters.
# decentralized_diloco gossips once per outer step, picked inside the step
# (gossip_rounds "switch" only), and its thetas are not averaged.
ALGORITHMS: dict[str, Algorithm] = {
    "all_reduce": Algorithm(_all_reduce, uses_topology=False,
                            runtime_spec="all_reduce", fields=()),
    "decentralized": Algorithm(
        _decentralized, uses_topology=True,
        runtime_spec="{optimizer}:topology={topology}",
        fields=(*_GOSSIP_FIELDS, "global_avg_interval", "gossip_every",
                *_CHOCO_FIELDS)),
    "local_sgd": Algorithm(
        _local_sgd, uses_topology=False,
        runtime_spec="local_sgd:H={sync_every}",
        fields=("sync_every", "comm_dtype", "global_avg_interval",
                *_PSEUDO_FIELDS)),
    "diloco": Algorithm(_diloco, uses_topology=False, eval_params=_theta,
                        runtime_spec="diloco:H={sync_every}",
                        fields=(*_OUTER_FIELDS, "comm_dtype",
                                *_OVERLAP_FIELDS, *_PSEUDO_FIELDS)),
    "decentralized_diloco": Algorithm(
        _diloco, uses_topology=True, eval_params=_theta,
        runtime_spec="diloco:H={sync_every},topology={topology}",
        fields=("topology", "comm_dtype", "bucket_bytes", *_OUTER_FIELDS,
                *_OVERLAP_FIELDS)),
    "streaming_diloco": Algorithm(
        _streaming_diloco, uses_topology=False, eval_params=_theta,
        runtime_spec=("streaming_diloco:H={sync_every},P={num_fragments},"
                      "tau={overlap_steps}"),
        fields=(*_OUTER_FIELDS, "comm_dtype", "num_fragments",
                "overlap_steps", "merge_alpha", *_OVERLAP_FIELDS,
                *_PSEUDO_FIELDS)),
    "sgp": Algorithm(_sgp, uses_topology=True, eval_params=_numerators,
                     fields=(*_GOSSIP_FIELDS, "global_avg_interval"),
                     model_params=push_sum.debiased,
                     global_average=push_sum.global_average,
                     runtime_spec="sgp"),
}
OUTER_OPTIMIZERS = ("sgd", "adam")


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


def spec_for_config(config) -> tuple[str, dict]:
  """The runtime-model spec and workload fields that price a run config.

  The algorithm's :attr:`Algorithm.runtime_spec` filled in from the config,
  with its message settings appended.

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
    :func:`decentral_jax.runtime_model.core.make_method` and
    ``{"devices_per_worker", "worker_layout"}`` for the
    :class:`~decentral_jax.runtime_model.workload.Workload`. Decentralized
    training with ``gossip_every = H > 1`` is ``local_dsgd:H=..``.
    ``bucket_bytes = 0`` (one collective per leaf) keeps the workload's
    buckets.

  Raises:
    ValueError: an unknown ``config.algorithm`` (naming it).
  """
  algo = str(config.algorithm)
  if algo not in ALGORITHMS:
    raise ValueError(f"unknown config.algorithm={algo!r}; use one of "
                     f"{', '.join(ALGORITHMS)}.")
  opt = str(config.optimizer.name)
  optimizer = ("dadam" if opt == "adamw" else
               f"accum_adam:T={int(config.optimizer.accum_steps)},")
  fields = dict(optimizer=optimizer.rstrip(","), topology=config.topology,
                sync_every=config.sync_every,
                num_fragments=config.num_fragments,
                overlap_steps=config.overlap_steps)
  spec = ALGORITHMS[algo].runtime_spec
  if algo == "decentralized":
    if int(config.gossip_every) > 1:
      spec = f"local_dsgd:H={int(config.gossip_every)},topology={{topology}}"
    elif opt != "adamw":
      spec = "accum_adam:T={accum},topology={topology}"
      fields["accum"] = int(config.optimizer.accum_steps)
  spec = spec.format(**fields)
  extra = []
  if config.comm_dtype and "comm_dtype" in ALGORITHMS[algo].fields:
    extra.append(f"comm_dtype={config.comm_dtype}")
  comp = config.compression
  if comp.format != "none" and "compression.format" in ALGORITHMS[algo].fields:
    extra += [f"compress={comp.format}", f"block={int(comp.block)}"]
    if comp.format == "topk":
      extra.append(f"fraction={float(comp.fraction):g}")
  if int(config.bucket_bytes) > 0 and algo in ("decentralized", "sgp",
                                               "all_reduce"):
    extra.append(f"bucket_MiB={int(config.bucket_bytes) / 2**20:g}")
  if algo == "diloco" and config.outer_overlap != "none" and \
      config.trickle_reduction:
    # Priced with the reduction hidden behind the next round; one-shot
    # (trickle_reduction=False), decentralized and per-fragment overlap are
    # priced as the blocking sync they are or as plain (Streaming) DiLoCo.
    extra.append(f"overlap={config.outer_overlap}")
  if extra and not spec.startswith("local_dsgd"):
    spec += ("," if ":" in spec else ":") + ",".join(extra)
  elif extra:
    spec += "," + ",".join(e for e in extra if e.startswith("comm_dtype"))
  return spec, {"devices_per_worker": int(config.devices_per_worker),
                "worker_layout": str(config.worker_layout)}
