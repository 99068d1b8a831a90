"""Checks of a run config: the boundary between the user's config and the runner.

:func:`check_config` validates every field of
:func:`decentral_jax.runner.config.base_config` (type, sign, range, finiteness,
choices, and cross-field rules such as ``global_batch`` divisible by
``n_workers``), raising a one-line ``ValueError`` that names the field and
the override that fixes it; past it the runner reads fields without
fallbacks. :func:`check_distributed` checks the ``distributed`` group alone
(before a multi-process job is joined), :func:`ignored_fields` lists the
fields set to a value the run would not read (:func:`unread_reason`;
:func:`check_config` refuses them), :func:`config_warnings` lists accepted
but suspicious settings and :func:`check_simulated_devices` bounds the CPU
devices an entry point simulates.
"""

from __future__ import annotations

import math

import numpy as np
from ml_collections import config_dict

from decentral_jax import wire_format
from decentral_jax.comm import compress
from decentral_jax.comm import fault_schedule
from decentral_jax.optim import elastic
from decentral_jax.optim import outer_overlap
from decentral_jax.runner import builders
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.optim.accum_adam import BETA_CONVENTIONS
from decentral_jax.runner.config import COMPUTE_DTYPES
from decentral_jax.runner.config import DATA_SOURCES
from decentral_jax.runner.config import CONSENSUS_AT
from decentral_jax.runner.config import GOSSIP_ROUNDS
from decentral_jax.runner.config import INT_MAX
from decentral_jax.runner.config import MAX_SIMULATED_CPU_DEVICES
from decentral_jax.runner.config import OPTIMIZERS
from decentral_jax.runner.config import SCHEDULES
from decentral_jax.runner.config import SEED_MAX
from decentral_jax.runner.config import WORKER_LAYOUTS
from decentral_jax.runner.config import base_config


def _field(config, name: str):
  value = config
  for part in name.split("."):
    value = value[part]
  return value


def _int_field(config, name: str, minimum: int) -> int:
  value = _field(config, name)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < minimum:
    raise ValueError(f"config.{name} must be an integer >= {minimum}, got "
                     f"{value!r}; set --config.{name}=<int>.")
  return int(value)


def _choice(value, name: str, allowed) -> str:
  if value not in allowed:
    raise ValueError(f"unknown config.{name}={value!r}; use one of "
                     f"{', '.join(map(str, allowed))} (--config.{name}=...).")
  return value


def _check_fields(config, names, group: str) -> None:
  missing = [n for n in names if n not in config]
  if missing:
    raise ValueError(
        f"config.{group} lacks {', '.join(missing)}; build the config from "
        "decentral_jax.runner.config.base_config() (see configs/gpt_tiny.py).")


# -- Field rules: each checks one value and raises a one-line ValueError
# -- naming the field, the rule, the value and the override that fixes it.


def _integer(lo: int, hi: int = INT_MAX, note: str = ""):
  """An int (not a bool) in ``[lo, hi]``."""
  def check(name, value):
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or not lo <= value <= hi):
      raise ValueError(f"config.{name} must be an integer in [{lo}, {hi}]"
                       f"{note}, got {value!r}; set --config.{name}=<int>.")
  return check


def _real(lo: float, hi: float | None = None, *, lo_open: bool = False,
          note: str = ""):
  """A finite int or float (not a bool), ``>= lo`` (``> lo``), ``< hi``."""
  if hi is not None:
    rule = f"in {'(' if lo_open else '['}{lo:g}, {hi:g})"
  else:
    rule = f"{'>' if lo_open else '>='} {lo:g}"

  def check(name, value):
    ok = (not isinstance(value, bool) and
          isinstance(value, (int, float, np.integer, np.floating)) and
          (isinstance(value, (int, np.integer)) or math.isfinite(value)) and
          (value > lo if lo_open else value >= lo) and
          (hi is None or value < hi))
    if not ok:
      raise ValueError(f"config.{name} must be a finite number {rule}{note}, "
                       f"got {value!r}; set --config.{name}=<float>.")
  return check


def _boolean(name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"config.{name} must be True or False, got {value!r}; "
                     f"set --config.{name}=True or False.")


def _optional_text(name, value):
  if value is not None and not isinstance(value, str):
    raise ValueError(f"config.{name} must be a string (or unset), got "
                     f"{value!r}; set --config.{name}=<text>.")


def _one_of(allowed):
  allowed = tuple(allowed)
  return lambda name, value: _choice(value, name, allowed)


def _topology(name, value):
  if not isinstance(value, str):
    raise ValueError(f"config.{name} must be a topology name, got {value!r}; "
                     f"set --config.{name}= one of "
                     f"{', '.join(topology_lib.NAMES)}.")
  try:
    topology_lib.canonical_name(value)
  except ValueError as e:
    raise ValueError(f"config.{name}: {e}") from None


def _features(name, value):
  """CNN conv widths: 1 to 4 positive ints (each layer halves 28x28)."""
  ok = isinstance(value, (tuple, list)) and 1 <= len(value) <= 4 and all(
      not isinstance(f, bool) and isinstance(f, (int, np.integer))
      and 1 <= f <= INT_MAX for f in value)
  if not ok:
    raise ValueError(f"config.{name} must be 1 to 4 positive integers (conv "
                     f"channels; each layer halves the 28x28 image), got "
                     f"{value!r}; set e.g. --config.{name}='(32, 64)'.")


# Every field of base_config() outside `model`, `data.source` and
# `distributed` (see check_distributed), checked in this order.
_RULES = {
    "algorithm": _one_of(builders.ALGORITHMS),
    "topology": _topology,
    "n_workers": _integer(1),
    "workers_per_node": _integer(1),
    "devices_per_worker": _integer(1),
    "workers_per_device": _integer(1),
    "worker_layout": _one_of(WORKER_LAYOUTS),
    "comm_dtype": _one_of(builders.COMM_DTYPES),
    "bucket_bytes": _integer(0, note=" (0 = one collective per leaf)"),
    "gossip_rounds": _one_of(GOSSIP_ROUNDS),
    "global_avg_interval": _integer(0, note=" (0 = never)"),
    "gossip_every": _integer(1),
    "sync_every": _integer(1),
    "outer_optimizer.name": _one_of(builders.OUTER_OPTIMIZERS),
    "outer_optimizer.lr": _real(0.0, lo_open=True),
    "outer_optimizer.momentum": _real(0.0, 1.0),
    "outer_optimizer.nesterov": _boolean,
    "num_fragments": _integer(1),
    "overlap_steps": _integer(0),
    "merge_alpha": lambda name, value: (
        _real(0.0)(name, value) if value == 1 else
        _real(0.0, 1.0, note=" or exactly 1")(name, value)),
    "outer_overlap": _one_of(outer_overlap.OVERLAPS),
    "outer_latency": _integer(1, note=" (rounds)"),
    "trickle_reduction": _boolean,
    "compression.format": _one_of(wire_format.FORMATS),
    "compression.block": _integer(2, compress.MAX_BLOCK,
                                  note=" (values per scale or chunk)"),
    "compression.fraction": _real(0.0, 1.0, lo_open=True,
                                  note=" or exactly 1"),
    "compression.error_feedback": _boolean,
    "compression.error_decay": _real(0.0, 1.0, lo_open=True,
                                     note=" or exactly 1"),
    "compression.consensus_step": _real(0.0, 1.0, lo_open=True,
                                        note=" or exactly 1"),
    "steps": _integer(1),
    "global_batch": _integer(1),
    "seed": _integer(0, SEED_MAX),
    "grad_clip": _real(0.0, note=" (0 disables clipping)"),
    "eval_interval": _integer(0, note=" (0 = only at the end)"),
    "eval_batches": _integer(1),
    "log_interval": _integer(1),
    "consensus_at": _one_of(CONSENSUS_AT),
    "checkpoint_interval": _integer(0, note=" (0 = only at the end)"),
    "keep_checkpoints": _integer(1),
    "tensorboard": _boolean,
    "workdir": _optional_text,
    "optimizer.name": _one_of(OPTIMIZERS),
    "optimizer.b1": _real(0.0, 1.0),
    "optimizer.b2": _real(0.0, 1.0),
    "optimizer.eps": _real(0.0),
    "optimizer.weight_decay": _real(0.0),
    "optimizer.accum_steps": _integer(1),
    "optimizer.beta_convention": _one_of(BETA_CONVENTIONS),
    "schedule.name": _one_of(SCHEDULES),
    "schedule.peak_lr": _real(0.0, lo_open=True),
    "schedule.warmup_steps": _integer(0),
    "schedule.final_lr": _real(0.0),
    "data.path": _optional_text,
    "data.val_fraction": _real(0.0, 1.0),
}
_MODEL_RULES = {
    "gpt": {
        "model.vocab_size": _integer(1),
        "model.block_size": _integer(1),
        "model.n_layer": _integer(1),
        "model.n_head": _integer(1),
        "model.n_embd": _integer(1),
        "model.bias": _boolean,
        "model.dropout": _real(0.0, 1.0),
        "model.dtype": _one_of(COMPUTE_DTYPES),
        "data.source": _one_of(DATA_SOURCES["gpt"]),
    },
    "cnn": {
        "model.features": _features,
        "model.dense": _integer(1),
        "model.num_classes": _integer(2),
        "data.source": _one_of(DATA_SOURCES["cnn"]),
    },
}
# Real fields in (0, 1] (their rule says [.., 1) "or exactly 1").
_UP_TO_ONE = ("compression.fraction", "compression.error_decay",
              "compression.consensus_step")
_BYTE_SOURCES = ("pydoc", "text_file")
# Topologies whose rounds depend on config.workers_per_node (node-aware: the
# others build the same rounds for any number of workers per node).
_NODE_TOPOLOGIES = ("alternating_exp_ring",)


def _divisors(n: int, limit: int = 12) -> list[int]:
  """The first ``limit`` divisors of ``n`` (O(sqrt n), for messages)."""
  small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))[:limit]


def check_config(config: config_dict.ConfigDict) -> None:
  """Validates a run config; raises a one-line ``ValueError`` naming the field.

  Checks that every field of :func:`base_config` is present and then each
  field against its rule (``_RULES``, ``_MODEL_RULES``): choices by name;
  integers (never bools) in ``[min, 2**31 - 1]``, the seed in
  ``[0, 2**32 - 1]``; reals finite (no NaN or inf) with a lower bound
  (``schedule.peak_lr > 0``; ``schedule.final_lr``, ``grad_clip``,
  ``optimizer.eps`` and ``optimizer.weight_decay`` >= 0) or in ``[0, 1)``
  (``optimizer.b1``, ``optimizer.b2``, ``model.dropout``,
  ``data.val_fraction``); bools True or False; paths strings or unset.
  Then the relations: ``workers_per_node`` divides ``n_workers``, which
  divides ``global_batch``; ``devices_per_worker`` divides the local batch
  ``global_batch / n_workers``; ``optimizer.accum_steps`` is 1 for ``adamw``;
  ``model.n_head`` divides ``model.n_embd``; ``schedule.final_lr <=
  peak_lr`` for ``warmup_cosine`` (a cosine "decay" upwards is refused);
  ``data.val_fraction > 0`` for byte corpora (pydoc, text_file). A warmup
  longer than the run is allowed (see :func:`config_warnings`). Device
  counts, data files, token ids and corpus lengths are checked when the
  experiment is built. Last, a field set to a value the run would not read
  (:func:`ignored_fields`, e.g. ``comm_dtype`` with ``all_reduce`` or
  ``sync_every`` with ``decentralized``) is refused.

  Raises:
    ValueError: the first problem found; the message names the config field
      and how to fix it.
  """
  c = config
  if "model" in c and "name" in c.model:
    model = _choice(c.model.name, "model.name", tuple(DATA_SOURCES))
  else:
    model = "gpt"
  base = base_config(model)
  _check_fields(c, list(base.keys()), "")
  for group in ("optimizer", "outer_optimizer", "schedule", "model", "data",
                "distributed", "compression"):
    _check_fields(c[group], list(base[group].keys()), group)
  for name, rule in {**_RULES, **_MODEL_RULES[model]}.items():
    value = _field(c, name)
    if name in _UP_TO_ONE and value == 1 and not isinstance(value, bool):
      continue
    rule(name, value)
  _check_workers(c)
  o, s = c.optimizer, c.schedule
  if o.name == "adamw" and o.accum_steps != 1:
    raise ValueError(
        f"config.optimizer.accum_steps={o.accum_steps} only applies to "
        "accum_adamw; set --config.optimizer.name=accum_adamw or "
        "--config.optimizer.accum_steps=1.")
  if s.name == "warmup_cosine" and s.final_lr > s.peak_lr:
    raise ValueError(
        f"config.schedule.final_lr={s.final_lr!r} exceeds config.schedule."
        f"peak_lr={s.peak_lr!r}; the cosine decays from peak_lr to final_lr: "
        f"set --config.schedule.final_lr={s.peak_lr / 10:g} (or lower).")
  if model == "gpt" and c.model.n_embd % c.model.n_head:
    raise ValueError(
        f"config.model.n_head={c.model.n_head} must divide config.model."
        f"n_embd={c.model.n_embd}; set --config.model.n_head= one of "
        f"{_divisors(int(c.model.n_embd))}.")
  if c.data.source in _BYTE_SOURCES and not c.data.val_fraction > 0:
    raise ValueError(
        f"config.data.val_fraction={c.data.val_fraction!r} leaves no "
        f"validation split of data.source={c.data.source}; set "
        "--config.data.val_fraction=0.1 (any value in (0, 1)).")
  _check_local_updates(c)
  ignored = ignored_fields(c)
  if ignored:
    raise ValueError(ignored[0])
  _check_compression(c)
  _check_faults(c)
  check_distributed(c)


def _check_workers(c: config_dict.ConfigDict) -> None:
  """Cross-field checks of workers, nodes, devices and the batch."""
  n, local = int(c.n_workers), int(c.workers_per_node)
  if n % local:
    raise ValueError(f"config.workers_per_node={local} must divide "
                     f"config.n_workers={n}; set --config.workers_per_node= "
                     f"one of {_divisors(n)}.")
  batch = int(c.global_batch)
  if batch % n:
    lo = max(n, batch // n * n)
    raise ValueError(
        f"config.global_batch={batch} is not divisible by config.n_workers="
        f"{n} (the global batch is split evenly across workers); use e.g. "
        f"--config.global_batch={lo} or {lo + n}.")
  dpw = int(c.devices_per_worker)
  if (batch // n) % dpw:
    raise ValueError(
        f"config.global_batch={batch} gives {batch // n} sequences per "
        f"worker (config.n_workers={n}), which a worker of config."
        f"devices_per_worker={dpw} devices cannot split evenly; use a "
        f"global_batch divisible by {n * dpw}.")
  k = int(c.workers_per_device)
  if k > 1 and dpw > 1:
    raise ValueError(
        f"config.workers_per_device={k} and config.devices_per_worker={dpw}:"
        " a worker either spans several devices or shares one with others; "
        "set one of them to 1.")
  if n % k:
    raise ValueError(
        f"config.workers_per_device={k} does not divide config.n_workers="
        f"{n} (each device holds the same number of workers); use one of "
        f"{_divisors(n)}.")


# The `faults` group (checked only if the config has one, so that configs
# saved before it existed still load).
_FAULT_RULES = {
    "faults.enabled": _boolean,
    "faults.failure_rate": _real(0.0, 1.0, note=" or exactly 1"),
    "faults.mean_downtime": _real(1.0),
    "faults.slow_fraction": _real(0.0, 1.0, note=" or exactly 1"),
    "faults.slow_speed": _real(0.0, 1.0, lo_open=True, note=" or exactly 1"),
    "faults.trace": _optional_text,
    "faults.seed": _integer(0, SEED_MAX),
    "faults.stragglers": _one_of(fault_schedule.STRAGGLER_MODES),
    "faults.min_quorum": _integer(1),
    "faults.on_failure": _one_of(elastic.ON_FAILURE),
    "faults.rejoin": _one_of(elastic.REJOIN),
}
#: Algorithms that run with config.faults.enabled.
FAULT_ALGORITHMS = ("local_sgd", "diloco", "decentralized")


def _check_faults(c: config_dict.ConfigDict) -> None:
  """The `faults` group: each field, then its relations to the run."""
  if "faults" not in c:
    return
  _check_fields(c.faults, list(base_config().faults.keys()), "faults")
  for name, rule in _FAULT_RULES.items():
    value = _field(c, name)
    if name in ("faults.failure_rate", "faults.slow_fraction",
                "faults.slow_speed") and value == 1 and \
        not isinstance(value, bool):
      continue
    rule(name, value)
  f = c.faults
  if not f.enabled:
    defaults = base_config().faults
    for key, default in defaults.items():
      if key != "enabled" and f[key] != default:
        raise ValueError(
            f"config.faults.{key}={f[key]!r} has no effect with "
            "config.faults.enabled=False; set --config.faults.enabled=True "
            f"or leave it at its default --config.faults.{key}={default!r}.")
    return
  if c.algorithm not in FAULT_ALGORITHMS:
    raise ValueError(
        f"config.faults.enabled=True needs config.algorithm in "
        f"{', '.join(FAULT_ALGORITHMS)}, got {c.algorithm!r}; set "
        "--config.algorithm=diloco or --config.faults.enabled=False.")
  if c.algorithm in ("local_sgd", "diloco") and c.comm_dtype:
    raise ValueError(
        f"config.comm_dtype={c.comm_dtype!r} has no effect with "
        f"config.faults.enabled=True and config.algorithm={c.algorithm!r} "
        "(the elastic sync sends float32); set --config.comm_dtype=''.")
  if c.algorithm == "decentralized" and f.rejoin != "copy_mean":
    raise ValueError(
        f"config.faults.rejoin={f.rejoin!r}: config.algorithm=decentralized "
        "has no theta and rejoins a worker with the mean of its live "
        "neighbours; set --config.faults.rejoin=copy_mean.")
  if f.min_quorum > c.n_workers:
    raise ValueError(
        f"config.faults.min_quorum={f.min_quorum} exceeds config.n_workers="
        f"{c.n_workers}: no outer step could ever be taken; set "
        f"--config.faults.min_quorum=<1..{c.n_workers}>.")
  _check_unread_faults(c)
  if f.trace:
    fault_schedule.check_trace_path(f.trace)
  if c.global_avg_interval:
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} would average "
        "dead workers' parameters too; with config.faults.enabled set "
        "--config.global_avg_interval=0.")


def _check_compression(c: config_dict.ConfigDict) -> None:
  """config.compression against the method (fields it does not read are
  refused by :func:`ignored_fields` already)."""
  z = c.compression
  if z.format == "none":
    return
  fmt = f"config.compression.format={z.format!r}"
  if z.format in ("int4", "fp4") and z.block % 2:
    raise ValueError(
        f"config.compression.block={z.block} must be even with {fmt} (two "
        f"values per byte); set --config.compression.block={z.block + 1}.")
  if c.comm_dtype:
    raise ValueError(
        f"config.comm_dtype={c.comm_dtype!r} and {fmt} both set what is "
        "sent; set --config.comm_dtype='' (or --config.compression.format="
        "none).")
  if "faults" in c and c.faults.enabled:
    raise ValueError(
        f"{fmt} and config.faults.enabled=True: the elastic sync sends "
        "float32; set --config.compression.format=none or "
        "--config.faults.enabled=False.")
  if c.algorithm == "decentralized":
    _check_choco(c, fmt)
  elif c.outer_overlap != "none":
    raise ValueError(
        f"{fmt} with config.outer_overlap={c.outer_overlap!r}: the "
        "overlapped outer step has no compressed reduction; set "
        "--config.outer_overlap=none or --config.compression.format=none.")
  if c.algorithm == "local_sgd" and c.global_avg_interval:
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} with {fmt}: "
        "compressed Local SGD keeps theta (the last average), which a "
        "global average would bypass; set --config.global_avg_interval=0.")


def _check_choco(c: config_dict.ConfigDict, fmt: str) -> None:
  """CHOCO-gossip needs a static mixing matrix and gossip every step."""
  topo = topology_lib.make(c.topology, int(c.n_workers),
                           int(c.workers_per_node))
  if topo.period != 1:
    raise ValueError(
        f"{fmt} (CHOCO-gossip) needs a static mixing matrix, but config."
        f"topology={c.topology} changes every round (period {topo.period}); "
        "set --config.topology= one of exponential, static_ring, torus, "
        "complete (or --config.compression.format=none).")
  if c.gossip_every != 1:
    raise ValueError(
        f"config.gossip_every={c.gossip_every} with {fmt}: CHOCO-gossip "
        "mixes every step; set --config.gossip_every=1 (or --config."
        "compression.format=none).")


def _unread_fault_reason(c: config_dict.ConfigDict, key: str) -> str | None:
  """Why the enabled fault schedule of ``c`` does not read
  ``config.faults.<key>``, or None if it does."""
  f = c.faults
  if key in ("min_quorum", "on_failure") and c.algorithm == "decentralized":
    return ("config.algorithm='decentralized' (gossip takes no outer step "
            "to hold to a quorum or roll back)")
  rates = ("failure_rate", "mean_downtime", "slow_fraction", "slow_speed",
           "seed")
  if key in rates and f.trace:
    return "config.faults.trace (the trace replaces the rates)"
  if key == "mean_downtime" and not f.failure_rate:
    return "config.faults.failure_rate=0 (no worker fails)"
  if key == "slow_speed" and not f.slow_fraction:
    return "config.faults.slow_fraction=0 (no worker is slow)"
  if key == "seed" and not f.failure_rate and not f.slow_fraction:
    return ("config.faults.failure_rate=0 and slow_fraction=0 (nothing is "
            "drawn)")
  return None


def _check_unread_faults(c: config_dict.ConfigDict) -> None:
  """Refuses a fault setting the enabled schedule would not read, and a
  ``slow_fraction`` that makes no worker slow."""
  f, defaults = c.faults, base_config().faults
  for key, default in defaults.items():
    why = _unread_fault_reason(c, key)
    if why is not None and f[key] != default:
      raise ValueError(
          f"config.faults.{key}={f[key]!r} has no effect with {why}; leave "
          f"it at its default: --config.faults.{key}={_setting(default)}.")
  n = int(c.n_workers)
  if f.slow_fraction and not f.trace:
    if int(round(float(f.slow_fraction) * n)) == 0:  # as from_rates counts
      raise ValueError(
          f"config.faults.slow_fraction={f.slow_fraction!r} makes "
          f"round({f.slow_fraction!r} x config.n_workers={n}) = 0 workers "
          f"slow; set --config.faults.slow_fraction={1 / n:.6g} (one "
          "worker) or more, or 0.")
    if f.slow_speed == 1:
      raise ValueError(
          f"config.faults.slow_fraction={f.slow_fraction!r} with config."
          "faults.slow_speed=1 slows no worker down; set --config.faults."
          "slow_speed below 1, or --config.faults.slow_fraction=0.")


def _check_local_updates(c: config_dict.ConfigDict) -> None:
  """Cross-field checks of the sync and gossip periods."""
  h, p, tau = int(c.sync_every), int(c.num_fragments), int(c.overlap_steps)
  if c.algorithm == "streaming_diloco":
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
  if c.algorithm == "decentralized_diloco" and c.gossip_rounds == "static":
    raise ValueError(
        "config.algorithm=decentralized_diloco picks its gossip round (the "
        "outer step) inside the step; set --config.gossip_rounds=switch.")
  _check_outer_overlap(c)
  if c.global_avg_interval and c.algorithm in (
      "diloco", "decentralized_diloco", "streaming_diloco"):
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} would average "
        f"the workers' parameters but not theta, the model "
        f"config.algorithm={c.algorithm} evaluates; it synchronises every "
        "config.sync_every steps: set --config.global_avg_interval=0.")


def _check_outer_overlap(c: config_dict.ConfigDict) -> None:
  """outer_overlap against the other sync fields (who reads it: see
  :func:`unread_reason`)."""
  if c.outer_overlap == "none" or \
      c.algorithm not in ("diloco", "decentralized_diloco", "streaming_diloco"):
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


def _setting(value) -> str:
  """``value`` as the right-hand side of a ``--config.<field>=`` flag."""
  return repr(value) if isinstance(value, str) else str(value)


def unread_reason(config: config_dict.ConfigDict, field: str) -> str | None:
  """Why ``config`` does not read ``field``, or None if it does.

  Not read: a field of :data:`decentral_jax.runner.builders.METHOD_FIELDS`
  that ``config.algorithm`` does not list (``Algorithm.fields``);
  ``workers_per_node`` unless the algorithm gossips over a node-aware
  topology (``alternating_exp_ring``, the only one whose rounds depend on
  it); ``worker_layout`` with ``devices_per_worker = 1``;
  ``outer_optimizer.momentum`` and ``nesterov`` with
  ``outer_optimizer.name = "adam"``; ``outer_latency`` and
  ``trickle_reduction`` with ``outer_overlap = "none"``;
  ``schedule.final_lr`` unless ``schedule.name = "warmup_cosine"``;
  ``schedule.warmup_steps`` with ``schedule.name = "constant"``; the other
  ``compression`` fields with ``compression.format = "none"``,
  ``compression.fraction`` unless ``topk``, ``compression.error_decay``
  without ``error_feedback``. A group (``"outer_optimizer"``) is not read
  if none of its fields is.

  Returns:
    The setting that ignores it, with why (for a message), or None.
  """
  c = config
  entry = builders.ALGORITHMS[c.algorithm]
  members = [f for f in builders.METHOD_FIELDS if f.startswith(field + ".")]
  if members:
    reasons = [unread_reason(c, f) for f in members]
    return reasons[0] if all(reasons) else None
  if field in builders.METHOD_FIELDS and field not in entry.fields:
    users = [a for a, e in builders.ALGORITHMS.items() if field in e.fields]
    return f"config.algorithm={c.algorithm!r} (read only by {', '.join(users)})"
  if field in ("outer_optimizer.momentum", "outer_optimizer.nesterov") and \
      c.outer_optimizer.name == "adam":
    return "config.outer_optimizer.name='adam' (Adam with its default betas)"
  if field == "workers_per_node" and not (
      entry.uses_topology and
      topology_lib.canonical_name(c.topology) in _NODE_TOPOLOGIES):
    where = (f"config.topology={c.topology!r}" if entry.uses_topology else
             f"config.algorithm={c.algorithm!r}")
    return (f"{where} (only the node-aware {', '.join(_NODE_TOPOLOGIES)} "
            "groups workers into nodes)")
  if field in ("outer_latency", "trickle_reduction") and \
      c.outer_overlap == "none":
    return "config.outer_overlap='none' (plain DiLoCo waits for its reduction)"
  z = c.compression
  if field == "bucket_bytes" and c.algorithm == "decentralized" and \
      z.format != "none":
    return (f"config.compression.format={z.format!r} (CHOCO-gossip sends one "
            "payload per leaf)")
  if field.startswith("compression.") and field != "compression.format":
    if z.format == "none":
      return "config.compression.format='none' (nothing is compressed)"
    if field == "compression.fraction" and z.format != "topk":
      return f"config.compression.format={z.format!r} (read by topk only)"
    if field == "compression.error_decay" and not z.error_feedback:
      return "config.compression.error_feedback=False (no residual to decay)"
  if field == "worker_layout" and int(c.devices_per_worker) == 1:
    return ("config.devices_per_worker=1 (it places a worker's state on its "
            "devices)")
  if field == "schedule.final_lr" and c.schedule.name != "warmup_cosine":
    return (f"config.schedule.name={c.schedule.name!r} (only warmup_cosine "
            "decays to final_lr)")
  if field == "schedule.warmup_steps" and c.schedule.name == "constant":
    return "config.schedule.name='constant' (peak_lr from the first step)"
  return None


def ignored_fields(config: config_dict.ConfigDict) -> list[str]:
  """Fields of a config set to a value that the run would not read.

  Each field :func:`unread_reason` names must keep its
  :func:`base_config` default: another value could not change the run,
  yet it would be recorded in the run's checkpoints. Call it on a config
  whose fields passed their type checks (:func:`check_config` does).

  Returns:
    One line per such field, naming it, the setting that ignores it and
    the override that fixes it (empty if none).
  """
  c = config
  default = base_config(c.model.name if c.model.name in DATA_SOURCES
                        else "gpt")
  out = []
  for name in (*builders.METHOD_FIELDS, "workers_per_node", "worker_layout",
               "schedule.final_lr", "schedule.warmup_steps"):
    value, want = _field(c, name), _field(default, name)
    if name == "topology":
      same = (topology_lib.canonical_name(value) ==
              topology_lib.canonical_name(want))
    else:
      same = value == want
    why = None if same else unread_reason(c, name)
    if why is not None:
      out.append(f"config.{name}={value!r} has no effect with {why}; leave "
                 f"it at its default: --config.{name}={_setting(want)}.")
  return out


def config_warnings(config: config_dict.ConfigDict) -> list[str]:
  """Settings of a valid config that run but are probably not meant.

  Currently: ``steps`` not a multiple of ``sync_every`` for the DiLoCo
  methods (the evaluated theta misses the last steps), and
  ``schedule.warmup_steps > steps`` (warmup_cosine,
  inverse_sqrt): the learning rate never reaches ``peak_lr``. Allowed
  because short smoke tests of long configs do exactly this.

  Returns:
    One line per finding (empty if none); the entry points print them.
  """
  c, out = config, []
  if c.algorithm in ("diloco", "decentralized_diloco", "streaming_diloco") \
      and c.steps % c.sync_every:
    out.append(
        f"config.steps={c.steps} is not a multiple of config.sync_every="
        f"{c.sync_every}: eval/loss reports theta, which does not include "
        f"the last {c.steps % c.sync_every} steps.")
  s = c.schedule
  if s.name != "constant" and s.warmup_steps > c.steps:
    out.append(
        f"config.schedule.warmup_steps={s.warmup_steps} > config.steps="
        f"{c.steps}: the learning rate stays in its linear warmup and peaks "
        f"at {c.steps / s.warmup_steps:.3g} x peak_lr.")
  return out


def devices_needed(c: config_dict.ConfigDict) -> tuple[int, str]:
  """Devices a (validated) config runs on, and the fields that set it.

  ``n_workers x devices_per_worker / workers_per_device`` (all processes
  together).
  """
  n, d, k = (int(c.n_workers), int(c.devices_per_worker),
             int(c.workers_per_device))
  source = f"config.n_workers={n}"
  if d > 1:
    source += f" x config.devices_per_worker={d}"
  if k > 1:
    source += f" / config.workers_per_device={k}"
  return n * d // k, source


def check_simulated_devices(n: int, source: str) -> int:
  """Refuses to simulate more than ``MAX_SIMULATED_CPU_DEVICES`` CPU devices.

  Args:
    n: CPU devices an entry point is about to ask JAX for (per process).
    source: the setting that asks for them, for the message (e.g.
      ``"config.n_workers=2048"``, ``"--cpu_devices=2048"``).

  Returns:
    ``n``.

  Raises:
    ValueError: ``n`` above the limit (says how to lower it or where to
      simulate more devices by hand).
  """
  if n > MAX_SIMULATED_CPU_DEVICES:
    raise ValueError(
        f"{source} asks for {n} simulated CPU devices in this process, more "
        f"than the {MAX_SIMULATED_CPU_DEVICES} the entry points simulate "
        "(start-up time and memory grow with the count); lower it, or set "
        "JAX_NUM_CPU_DEVICES yourself to simulate more.")
  return n


def check_distributed(c: config_dict.ConfigDict) -> None:
  """Checks the ``config.distributed`` group (types and ranges only).

  Raises:
    ValueError: a field of the wrong type or range (named).
  """
  d = c.distributed
  if not isinstance(d.enabled, bool):
    raise ValueError(f"config.distributed.enabled must be True or False, got "
                     f"{d.enabled!r}.")
  if not isinstance(d.coordinator_address, str):
    raise ValueError("config.distributed.coordinator_address must be a "
                     f"'host:port' string, got {d.coordinator_address!r}.")
  _int_field(c, "distributed.num_processes", 0)
  if isinstance(d.process_id, bool) or not isinstance(
      d.process_id, (int, np.integer)) or d.process_id < -1:
    raise ValueError(f"config.distributed.process_id must be an integer >= -1 "
                     f"(-1: auto-detect), got {d.process_id!r}.")
  _int_field(c, "distributed.heartbeat_timeout_seconds", 1)
  _int_field(c, "distributed.initialization_timeout_seconds", 1)
