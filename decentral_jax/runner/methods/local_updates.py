"""Local-update methods: Local SGD, DiLoCo, decentralized DiLoCo, Streaming
DiLoCo (:mod:`decentral_jax.optim.local_sgd_sync`,
:mod:`~decentral_jax.optim.diloco_sync`, :mod:`~decentral_jax.optim.streaming_sync`).

Every worker takes ``sync_every = H`` inner steps (AdamW on its own
gradient) between synchronisations:

* ``local_sgd`` (Lin et al., ICLR 2020): the parameters are averaged every
  ``H`` steps;
* ``diloco`` (Douillard et al. 2023, arXiv 2311.08105): the pseudo-gradient
  ``theta - mean_i x_i`` is averaged and the outer optimizer (SGD with
  Nesterov momentum, or Adam) steps ``theta``; with ``outer_overlap`` a
  delayed or eager outer step (Kale et al. 2025, arXiv 2502.12996);
* ``decentralized_diloco``: one gossip round of ``config.topology`` (the
  mixing matrix of the k-th outer step) instead of the all-reduce;
* ``streaming_diloco`` (Douillard et al. 2025, arXiv 2501.18512):
  ``num_fragments`` fragments synchronised in turn, each merged
  ``overlap_steps`` steps after it is sent, with merge weight
  ``merge_alpha``.

With ``config.compression`` the pseudo-gradients (Local SGD: the
differences to the last average) are sent compressed with error feedback;
with ``config.faults`` Local SGD and DiLoCo average over the live workers
(:mod:`decentral_jax.optim.elastic`). Priced as the runtime model's
``local_sgd:H=..``, ``diloco:H=..[,topology=..]`` and
``streaming_diloco:H=..,P=..,tau=..``
(:mod:`decentral_jax.runtime_model.local_methods`).
"""

from __future__ import annotations

import optax

from decentral_jax.optim import diloco_sync
from decentral_jax.optim import elastic
from decentral_jax.optim import local_sgd_sync
from decentral_jax.optim import outer_timing
from decentral_jax.optim import reductions
from decentral_jax.optim import streaming_sync
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry
from decentral_jax.topology import schedules as topology_lib

OUTER_OPTIMIZERS = ("sgd", "adam")
# config.compression: compressed pseudo-gradients.
_PSEUDO_FIELDS = ("compression.format", "compression.block",
                  "compression.fraction", "compression.error_feedback",
                  "compression.error_decay")
_OUTER_FIELDS = ("sync_every", "outer_optimizer.name", "outer_optimizer.lr",
                 "outer_optimizer.momentum", "outer_optimizer.nesterov")
# The DiLoCo methods' overlapped outer step (outer_latency and
# trickle_reduction are read only with outer_overlap != "none").
_OVERLAP_FIELDS = ("outer_overlap", "outer_latency", "trickle_reduction")


# -- Builders -------------------------------------------------------------


def _reduction(config, topology, axis_name) -> reductions.Reduction:
  """The pseudo-gradient reduction of a local-update transform: compressed
  (``config.compression``), else a gossip round over ``topology``, a
  ``comm_dtype`` mean or the exact mean."""
  comp = parts.compressor(config)
  if comp is not None:
    c = config.compression
    return reductions.compressed(comp, bool(c.error_feedback),
                                 float(c.error_decay), axis_name)
  return reductions.uncompressed(topology=topology,
                                 comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
                                 axis_name=axis_name,
                                 bucket_bytes=int(config.bucket_bytes))


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
    return elastic.elastic_local_sgd(parts.inner(config, schedule),
                                     int(config.sync_every),
                                     axis_name=axis_name, **_faults(config))
  return local_sgd_sync.local_sgd(
      parts.inner(config, schedule), int(config.sync_every),
      reduction=_reduction(config, None, axis_name))


def _diloco(config, schedule, topology, axis_name):
  """DiLoCo, or decentralized DiLoCo when ``topology`` is given (the
  pseudo-gradients, or with a topology the parameters, sent in
  ``comm_dtype``); with ``outer_overlap`` its delayed or eager outer step;
  with ``config.faults`` over the live workers (:mod:`optim.elastic`)."""
  if _faults(config) is not None and topology is None:
    return elastic.elastic_diloco(parts.inner(config, schedule),
                                  int(config.sync_every), outer=_outer(config),
                                  axis_name=axis_name, **_faults(config))
  return diloco_with(parts.inner(config, schedule), config, topology,
                     axis_name)


def diloco_with(inner, config, topology, axis_name):
  """DiLoCo of ``config`` (sync period, outer optimizer, pseudo-gradient
  reduction, outer-step timing) around the worker-local ``inner``
  transform; decentralized with a ``topology``."""
  return diloco_sync.diloco(inner, int(config.sync_every),
                            outer=_outer(config),
                            reduction=_reduction(config, topology, axis_name),
                            timing=_timing(config))


def _timing(config):
  """The outer-step timing of a DiLoCo transform (``config.outer_overlap``
  with ``outer_latency`` and ``trickle_reduction``)."""
  if config.outer_overlap == "none":
    return outer_timing.Plain()
  return outer_timing.named(config.outer_overlap, int(config.outer_latency),
                            bool(config.trickle_reduction))


def _streaming_diloco(config, schedule, topology, axis_name):
  """Streaming DiLoCo (fragments, overlap, merge alpha, wire dtype; with
  ``outer_overlap`` a delayed or eager outer step per fragment)."""
  del topology
  return streaming_diloco_with(parts.inner(config, schedule), config,
                               axis_name)


def streaming_diloco_with(inner, config, axis_name):
  """Streaming DiLoCo of ``config`` (fragments, overlap, merge alpha,
  outer optimizer, reduction, timing) around the worker-local ``inner``."""
  return streaming_sync.streaming_diloco(
      inner, int(config.sync_every),
      num_fragments=int(config.num_fragments),
      overlap_steps=int(config.overlap_steps),
      merge_alpha=float(config.merge_alpha), outer=_outer(config),
      reduction=_reduction(config, None, axis_name), timing=_timing(config))


def theta(params, opt_state):
  """The evaluated parameters of the DiLoCo methods: ``theta``."""
  del params
  return streaming_sync.global_params(opt_state)


# -- Checks ---------------------------------------------------------------


def check_fragments(c) -> None:
  """Streaming DiLoCo's fragments and overlap within the sync period."""
  h, p, tau = int(c.sync_every), int(c.num_fragments), int(c.overlap_steps)
  if p > h:
    raise ValueError(
        f"config.num_fragments={p} exceeds config.sync_every={h}: each "
        f"fragment needs its own step in the sync period; use at most {h}.")
  if tau * p >= h:
    raise ValueError(
        f"config.overlap_steps={tau} with config.num_fragments={p} needs "
        f"overlap_steps * num_fragments < sync_every={h} (a fragment is "
        f"merged before the next is sent); use overlap_steps <= "
        f"{max((h - 1) // p, 0)}.")


def _check_outer_overlap(c) -> None:
  """outer_overlap against the other sync fields (who reads it: see
  :func:`decentral_jax.runner.validation.unread_reason`)."""
  if c.outer_overlap == "none":
    return
  if c.algorithm == "streaming_diloco" and c.overlap_steps:
    raise ValueError(
        f"config.overlap_steps={c.overlap_steps} and config.outer_overlap="
        f"{c.outer_overlap!r} both hide the reduction behind inner steps; "
        "set --config.overlap_steps=0 (or --config.outer_overlap=none).")
  if "faults" in c and c.faults.enabled:
    raise ValueError(
        f"config.outer_overlap={c.outer_overlap!r} and config.faults.enabled="
        "True: the elastic sync has no overlapped outer step; set "
        "--config.outer_overlap=none or --config.faults.enabled=False.")
  fragments = int(c.num_fragments) if c.algorithm == "streaming_diloco" \
      else 1
  held = int(c.outer_latency) * int(c.sync_every) * fragments
  if held > outer_timing.MAX_IN_FLIGHT_SLICES:
    what = " x config.num_fragments" if fragments > 1 else ""
    raise ValueError(
        f"config.outer_latency={c.outer_latency} x config.sync_every="
        f"{c.sync_every}{what} = {held} in-flight slices, above "
        f"{outer_timing.MAX_IN_FLIGHT_SLICES} (2**26; the overlapped outer "
        "step holds a slice per step and round in flight); lower "
        "config.outer_latency or config.sync_every.")
  if c.trickle_reduction and c.algorithm == "decentralized_diloco":
    rounds = len(topology_lib.make(c.topology, int(c.n_workers),
                                   int(c.workers_per_node)).distinct_rounds)
    if rounds > 1:
      raise ValueError(
          f"config.trickle_reduction=True needs a topology with one distinct "
          f"round, but config.topology={c.topology} has {rounds} (picked "
          "inside the step by a conditional around the collectives, which "
          "XLA cannot overlap); set --config.trickle_reduction=False or a "
          "static topology (complete, exponential, torus, static_ring).")


def check_diloco(c) -> None:
  """Checks of the DiLoCo methods: Streaming DiLoCo's fragments, the
  decentralized round picked in the step, the overlapped outer step, and
  no global average (theta, the evaluated model, is not averaged)."""
  if c.algorithm == "streaming_diloco":
    check_fragments(c)
  if c.algorithm == "decentralized_diloco" and c.gossip_rounds == "static":
    raise ValueError(
        "config.algorithm=decentralized_diloco picks its gossip round (the "
        "outer step) inside the step; set --config.gossip_rounds=switch.")
  _check_outer_overlap(c)
  if c.global_avg_interval:
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} would average "
        f"the workers' parameters but not theta, the model "
        f"config.algorithm={c.algorithm} evaluates; it synchronises every "
        "config.sync_every steps: set --config.global_avg_interval=0.")


def check_compression(c, fmt: str) -> None:
  """Compressed pseudo-gradients: no overlapped outer step, and (Local SGD)
  no global average."""
  if c.outer_overlap != "none":
    raise ValueError(
        f"{fmt} with config.outer_overlap={c.outer_overlap!r}: the "
        "overlapped outer step has no compressed reduction; set "
        "--config.outer_overlap=none or --config.compression.format=none.")
  if c.algorithm == "local_sgd" and c.global_avg_interval:
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} with {fmt}: "
        "compressed Local SGD keeps theta (the last average), which a "
        "global average would bypass; set --config.global_avg_interval=0.")


def check_faults(c) -> None:
  """The elastic sync (Local SGD, DiLoCo) sends float32."""
  if c.comm_dtype:
    raise ValueError(
        f"config.comm_dtype={c.comm_dtype!r} has no effect with "
        f"config.faults.enabled=True and config.algorithm={c.algorithm!r} "
        "(the elastic sync sends float32); set --config.comm_dtype=''.")


def diloco_warnings(c) -> list[str]:
  """``steps`` not a multiple of ``sync_every``: theta misses the last
  steps; Streaming DiLoCo's ``merge_alpha = 1``: the workers never take
  theta; a delayed outer step whose latency is not shorter than the run's
  rounds: theta never moves."""
  out = []
  if c.steps % c.sync_every:
    out.append(f"config.steps={c.steps} is not a multiple of "
               f"config.sync_every={c.sync_every}: eval/loss reports theta, "
               f"which does not include the last {c.steps % c.sync_every} "
               "steps.")
  if c.algorithm == "streaming_diloco" and c.merge_alpha == 1:
    out.append("config.merge_alpha=1: every worker keeps its own fragment "
               "and never takes the synced theta, so the workers train "
               "independently; use a value below 1.")
  rounds = c.steps // c.sync_every
  if c.outer_overlap == "delayed" and c.outer_latency >= rounds:
    out.append(f"config.outer_latency={c.outer_latency} >= the run's "
               f"{rounds} rounds (config.steps // config.sync_every): a "
               "delayed outer step lands outer_latency rounds after its "
               "round, so theta never changes and the workers restart from "
               "it every round; lower config.outer_latency.")
  return out


# -- Runtime-model specs --------------------------------------------------


def _spec(fields, template: str, overlap: bool = False):
  """runtime_spec(config): ``template`` filled in, message settings added
  (with ``overlap``: DiLoCo's trickled outer step, ``overlap=..``)."""
  def runtime_spec(config) -> str:
    spec = template.format(h=config.sync_every, p=config.num_fragments,
                           tau=config.overlap_steps, topology=config.topology)
    extra = parts.message_settings(config, fields)
    if overlap and config.outer_overlap != "none" and \
        config.trickle_reduction:
      # Priced with the reduction hidden behind the next round; one-shot
      # (trickle_reduction=False), decentralized and per-fragment overlap
      # are priced as the blocking sync they are or as plain (Streaming)
      # DiLoCo.
      extra.append(f"overlap={config.outer_overlap}")
    return parts.with_settings(spec, extra)
  return runtime_spec


def _method(name, build, fields, template, **kwargs) -> registry.Method:
  return registry.register(registry.Method(
      name, build, fields=fields, runtime_spec=_spec(
          fields, template, kwargs.pop("overlap", False)),
      label=name, **kwargs))


_DILOCO = dict(eval_params=theta, checks=check_diloco,
               warnings=diloco_warnings)
LOCAL_SGD = _method(
    "local_sgd", _local_sgd,
    ("sync_every", "comm_dtype", "global_avg_interval", *_PSEUDO_FIELDS),
    "local_sgd:H={h}", compression_checks=check_compression,
    faults=check_faults)
DILOCO = _method(
    "diloco", _diloco,
    (*_OUTER_FIELDS, "comm_dtype", *_OVERLAP_FIELDS, *_PSEUDO_FIELDS),
    "diloco:H={h}", overlap=True, compression_checks=check_compression,
    faults=check_faults, **_DILOCO)
# Gossips once per outer step, picked inside the step (gossip_rounds
# "switch" only); its thetas are not averaged.
DECENTRALIZED_DILOCO = _method(
    "decentralized_diloco", _diloco,
    ("topology", "comm_dtype", "bucket_bytes", *_OUTER_FIELDS,
     *_OVERLAP_FIELDS),
    "diloco:H={h},topology={topology}", uses_topology=True, **_DILOCO)
STREAMING_DILOCO = _method(
    "streaming_diloco", _streaming_diloco,
    (*_OUTER_FIELDS, "comm_dtype", "num_fragments", "overlap_steps",
     "merge_alpha", *_OVERLAP_FIELDS, *_PSEUDO_FIELDS),
    "streaming_diloco:H={h},P={p},tau={tau}",
    compression_checks=check_compression, **_DILOCO)
