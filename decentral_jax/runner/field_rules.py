"""Field rules of a run config: each checks one value of one field.

A rule ``rule(name, value)`` raises a one-line ``ValueError`` naming the
field, the rule, the value and the ``--config.<field>=`` override that fixes
it. :data:`RULES` holds the rule of every field of
:func:`decentral_jax.runner.config.base_config` outside ``model``,
``data.source``, ``distributed`` and ``faults``; :data:`MODEL_RULES` those
of each model; :data:`FAULT_RULES` those of the ``faults`` group. Relations
between fields are checked by :mod:`decentral_jax.runner.validation`.
"""

from __future__ import annotations

import math

import numpy as np

from decentral_jax import wire_format
from decentral_jax.comm import compress
from decentral_jax.comm import fault_schedule
from decentral_jax.optim import elastic
from decentral_jax.optim import outer_timing
from decentral_jax.optim.accum_adam import BETA_CONVENTIONS
from decentral_jax.runner import methods
from decentral_jax.runner.config import COMPUTE_DTYPES
from decentral_jax.runner.config import CONSENSUS_AT
from decentral_jax.runner.config import DATA_SOURCES
from decentral_jax.runner.config import GOSSIP_ROUNDS
from decentral_jax.runner.config import INT_MAX
from decentral_jax.runner.config import OPTIMIZERS
from decentral_jax.runner.config import REMAT_MODES
from decentral_jax.runner.config import SCHEDULES
from decentral_jax.runner.config import SEED_MAX
from decentral_jax.runner.config import WORKER_LAYOUTS
from decentral_jax.runner.methods import local_updates
from decentral_jax.runner.methods import parts
from decentral_jax.topology import schedules as topology_lib


def field(config, name: str):
  """The value of the dotted field ``name`` of ``config``."""
  value = config
  for part in name.split("."):
    value = value[part]
  return value


def choice(value, name: str, allowed) -> str:
  """``value`` if it is one of ``allowed``, else a ValueError naming both."""
  if value not in allowed:
    raise ValueError(f"unknown config.{name}={value!r}; use one of "
                     f"{', '.join(map(str, allowed))} (--config.{name}=...).")
  return value


def check_fields(config, names, group: str) -> None:
  """Refuses a config (group) that lacks any of the fields ``names``."""
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
  return lambda name, value: choice(value, name, allowed)


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
RULES = {
    "algorithm": lambda name, value: choice(value, name,
                                             tuple(methods.ALGORITHMS)),
    "topology": _topology,
    "n_workers": _integer(1),
    "workers_per_node": _integer(1),
    "devices_per_worker": _integer(1),
    "workers_per_device": _integer(1),
    "worker_layout": _one_of(WORKER_LAYOUTS),
    "comm_dtype": _one_of(parts.COMM_DTYPES),
    "bucket_bytes": _integer(0, note=" (0 = one collective per leaf)"),
    "gossip_rounds": _one_of(GOSSIP_ROUNDS),
    "global_avg_interval": _integer(0, note=" (0 = never)"),
    "gossip_every": _integer(1),
    "sync_every": _integer(1),
    "sync_every_u": _integer(1),
    "sync_every_v": _integer(1),
    "outer_optimizer.name": _one_of(local_updates.OUTER_OPTIMIZERS),
    "outer_optimizer.lr": _real(0.0, lo_open=True),
    "outer_optimizer.momentum": _real(0.0, 1.0),
    "outer_optimizer.nesterov": _boolean,
    "num_fragments": _integer(1),
    "overlap_steps": _integer(0),
    "merge_alpha": lambda name, value: (
        _real(0.0)(name, value) if value == 1 else
        _real(0.0, 1.0, note=" or exactly 1")(name, value)),
    "outer_overlap": _one_of(outer_timing.TIMINGS),
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
    "micro_batches": _integer(1),
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
MODEL_RULES = {
    "gpt": {
        "model.vocab_size": _integer(1),
        "model.block_size": _integer(1),
        "model.n_layer": _integer(1),
        "model.n_head": _integer(1),
        "model.n_embd": _integer(1),
        "model.bias": _boolean,
        "model.dropout": _real(0.0, 1.0),
        "model.dtype": _one_of(COMPUTE_DTYPES),
        "model.param_dtype": _one_of(COMPUTE_DTYPES),
        "model.remat": _one_of(REMAT_MODES),
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
UP_TO_ONE = ("compression.fraction", "compression.error_decay",
              "compression.consensus_step")

# The `faults` group (checked only if the config has one, so that configs
# saved before it existed still load).
FAULT_RULES = {
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
