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

import numpy as np

import importlib.util
import netrc
import os
import urllib.parse

from decentral_jax import wire_format
from decentral_jax.comm import compress
from decentral_jax.comm import fault_schedule
from decentral_jax.optim import elastic
from decentral_jax.optim import outer_timing
from decentral_jax.optim.accum_adam import BETA_CONVENTIONS
from decentral_jax.runner import extensions
from decentral_jax.runner import field_checks
from decentral_jax.runner import methods
from decentral_jax.runner.config import COMPUTE_DTYPES
from decentral_jax.runner.config import CONSENSUS_AT
from decentral_jax.runner.config import DATA_SOURCES
from decentral_jax.runner.config import GOSSIP_ROUNDS
from decentral_jax.runner.config import OPTIMIZERS
from decentral_jax.runner.config import REMAT_MODES
from decentral_jax.runner.config import SCHEDULES
from decentral_jax.runner.config import SEED_MAX
from decentral_jax.runner.config import TRACKERS
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


def check_fields(config, names, group: str) -> None:
  """Refuses a config (group) that lacks any of the fields ``names``."""
  missing = [n for n in names if n not in config]
  if missing:
    raise ValueError(
        f"config.{group} lacks {', '.join(missing)}; build the config from "
        "decentral_jax.runner.config.base_config() (see configs/gpt_tiny.py).")


def _builder(kind: str, built_in=()):
  """A built-in name, a registered one or an importable ``module:attr``
  (:func:`decentral_jax.runner.extensions.resolve`)."""
  def check(name, value):
    if value in built_in:
      return
    if not (extensions.is_reference(value) or
            value in extensions.registered(kind)):
      extra = f"{', '.join(built_in)}, " if built_in else ""
      raise ValueError(
          f"unknown config.{name}={value!r}; use {extra}a name given to "
          f"register_{kind} (registered: {list(extensions.registered(kind))})"
          f" or 'package.module:attribute' (docs/extending.md).")
    extensions.resolve(kind, value)
  return check


def wandb_can_log() -> bool:
  """Whether W&B can start a run without asking for a key (read from its
  environment and files, without importing it): ``WANDB_MODE`` offline,
  dryrun or disabled, ``WANDB_DISABLED``, ``WANDB_API_KEY`` or
  ``WANDB_IDENTITY_TOKEN_FILE`` set, a ``.netrc`` entry of the W&B host
  (``wandb login``), or a W&B settings file naming a key or a mode."""
  env = os.environ
  if env.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
    return True
  if env.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes") or \
      env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
    return True
  host = urllib.parse.urlparse(env.get("WANDB_BASE_URL") or
                               "https://api.wandb.ai").hostname
  paths = [env["NETRC"]] if env.get("NETRC") else ["~/.netrc", "~/_netrc"]
  for path in paths:
    try:
      if netrc.netrc(os.path.expanduser(path)).authenticators(host):
        return True
    except (OSError, netrc.NetrcParseError):
      pass
  config_dir = env.get("WANDB_CONFIG_DIR") or os.path.expanduser(
      "~/.config/wandb")
  for path in (os.path.join(config_dir, "settings"),
               os.path.join(env.get("WANDB_DIR") or ".", "wandb", "settings")):
    try:
      with open(path, encoding="utf-8") as f:
        if any(line.split("=")[0].strip() in ("api_key", "mode")
               for line in f):
          return True
    except (OSError, UnicodeDecodeError):
      pass
  return False


def _tracker(name, value):
  """``""`` or ``"wandb"``, whose package must be installed and which must
  be able to log (:func:`wandb_can_log`)."""
  if value not in TRACKERS:
    raise ValueError(f"unknown config.{name}={value!r}; use '' (none) or "
                     f"'wandb' (--config.{name}=wandb).")
  if value == "wandb" and importlib.util.find_spec("wandb") is None:
    raise ValueError(f"config.{name}='wandb' needs the wandb package: `pip "
                     "install -r requirements-extras.txt`, or set "
                     f"--config.{name}='' (metrics.jsonl is always written).")
  if value == "wandb" and not wandb_can_log():
    raise ValueError(f"config.{name}='wandb' has no W&B API key (no "
                     "WANDB_API_KEY, no `wandb login` entry in ~/.netrc): run "
                     "`wandb login`, or set WANDB_MODE=offline to log to "
                     f"local files, or set --config.{name}=''.")


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
      and 1 <= f <= field_checks.INT_MAX for f in value)
  if not ok:
    raise ValueError(f"config.{name} must be 1 to 4 positive integers (conv "
                     f"channels; each layer halves the 28x28 image), got "
                     f"{value!r}; set e.g. --config.{name}='(32, 64)'.")


# Every field of base_config() outside `model`, `data.source` and
# `distributed` (see check_distributed), checked in this order.
#: Upper bound of the learning rates and the weight decay (see
#: :data:`field_checks.MAX_LR`).
MAX_LR = field_checks.MAX_LR

RULES = {
    "algorithm": lambda name, value: field_checks.choice(
        value, name, tuple(methods.ALGORITHMS)),
    "topology": _topology,
    "n_workers": field_checks.integer(1),
    "workers_per_node": field_checks.integer(1),
    "devices_per_worker": field_checks.integer(1),
    "workers_per_device": field_checks.integer(1),
    "worker_layout": field_checks.one_of(WORKER_LAYOUTS),
    "comm_dtype": field_checks.one_of(parts.COMM_DTYPES),
    "bucket_bytes": field_checks.integer(0, note=" (0 = one collective per leaf)"),
    "gossip_rounds": field_checks.one_of(GOSSIP_ROUNDS),
    "global_avg_interval": field_checks.integer(0, note=" (0 = never)"),
    "gossip_every": field_checks.integer(1),
    "sync_every": field_checks.integer(1),
    "outer_optimizer.name": field_checks.one_of(local_updates.OUTER_OPTIMIZERS),
    "outer_optimizer.lr": field_checks.real(0.0, MAX_LR, lo_open=True,
                                            hi_closed=True),
    "outer_optimizer.momentum": field_checks.real(0.0, 1.0),
    "outer_optimizer.nesterov": field_checks.boolean,
    "num_fragments": field_checks.integer(1),
    "overlap_steps": field_checks.integer(0),
    "merge_alpha": lambda name, value: (
        field_checks.real(0.0)(name, value) if value == 1 else
        field_checks.real(0.0, 1.0, note=" or exactly 1")(name, value)),
    "outer_overlap": field_checks.one_of(outer_timing.TIMINGS),
    "outer_latency": field_checks.integer(1, note=" (rounds)"),
    "trickle_reduction": field_checks.boolean,
    "compression.format": field_checks.one_of(wire_format.FORMATS),
    "compression.block": field_checks.integer(2, compress.MAX_BLOCK,
                                  note=" (values per scale or chunk)"),
    "compression.fraction": field_checks.real(0.0, 1.0, lo_open=True,
                                  note=" or exactly 1"),
    "compression.error_feedback": field_checks.boolean,
    "compression.error_decay": field_checks.real(0.0, 1.0, lo_open=True,
                                     note=" or exactly 1"),
    "compression.consensus_step": field_checks.real(0.0, 1.0, lo_open=True,
                                        note=" or exactly 1"),
    "steps": field_checks.integer(1),
    "global_batch": field_checks.integer(1),
    "micro_batches": field_checks.integer(1),
    "seed": field_checks.integer(0, SEED_MAX),
    "grad_clip": field_checks.real(0.0, note=" (0 disables clipping)"),
    "eval_interval": field_checks.integer(0, note=" (0 = only at the end)"),
    "eval_batches": field_checks.integer(1),
    "log_interval": field_checks.integer(1),
    "consensus_at": field_checks.one_of(CONSENSUS_AT),
    "checkpoint_interval": field_checks.integer(0, note=" (0 = only at the end)"),
    "keep_checkpoints": field_checks.integer(1),
    "tensorboard": field_checks.boolean,
    "tracker": _tracker,
    "workdir": field_checks.optional_text,
    "optimizer.name": _builder("optimizer", OPTIMIZERS),
    "optimizer.b1": field_checks.real(0.0, 1.0),
    "optimizer.b2": field_checks.real(0.0, 1.0),
    "optimizer.eps": field_checks.real(0.0, 1.0, hi_closed=True),
    "optimizer.weight_decay": field_checks.real(0.0, MAX_LR,
                                                hi_closed=True),
    "optimizer.accum_steps": field_checks.integer(1),
    "optimizer.beta_convention": field_checks.one_of(BETA_CONVENTIONS),
    "schedule.name": field_checks.one_of(SCHEDULES),
    "schedule.peak_lr": field_checks.real(0.0, MAX_LR, lo_open=True,
                                          hi_closed=True),
    "schedule.warmup_steps": field_checks.integer(0),
    "schedule.final_lr": field_checks.real(0.0, MAX_LR, hi_closed=True),
}
MODEL_RULES = {
    "gpt": {
        # Bounds well above any model trained (GPT-3: 96 layers of 12288,
        # a 50257 vocabulary); 100000 layers compiled for many minutes
        # before training or failing.
        "model.vocab_size": field_checks.integer(1, 2**24),
        "model.block_size": field_checks.integer(1, 2**20),
        "model.n_layer": field_checks.integer(1, 1024),
        "model.n_head": field_checks.integer(1, 2**16),
        "model.n_embd": field_checks.integer(1, 2**17),
        "model.bias": field_checks.boolean,
        "model.dropout": field_checks.real(0.0, 1.0),
        "model.dtype": field_checks.one_of(COMPUTE_DTYPES),
        "model.param_dtype": field_checks.one_of(COMPUTE_DTYPES),
        "model.remat": field_checks.one_of(REMAT_MODES),
        "data.source": field_checks.one_of(DATA_SOURCES["gpt"]),
        "data.path": field_checks.optional_text,
        "data.val_fraction": field_checks.real(0.0, 1.0),
    },
    "cnn": {
        "model.features": _features,
        "model.dense": field_checks.integer(1),
        "model.num_classes": field_checks.integer(2),
        "data.source": field_checks.one_of(DATA_SOURCES["cnn"]),
        "data.path": field_checks.optional_text,
        "data.val_fraction": field_checks.real(0.0, 1.0),
    },
    # Your own model and data (runner.extensions): the names must resolve.
    "custom": {
        "model.name": _builder("model"),
        "model.needs_key": field_checks.boolean,
        "data.source": _builder("data"),
    },
}
# Real fields in (0, 1] (their rule says [.., 1) "or exactly 1").
UP_TO_ONE = ("compression.fraction", "compression.error_decay",
              "compression.consensus_step")

# The `faults` group (checked only if the config has one, so that configs
# saved before it existed still load).
FAULT_RULES = {
    "faults.enabled": field_checks.boolean,
    "faults.failure_rate": field_checks.real(0.0, 1.0, note=" or exactly 1"),
    "faults.mean_downtime": field_checks.real(1.0),
    "faults.slow_fraction": field_checks.real(0.0, 1.0, note=" or exactly 1"),
    "faults.slow_speed": field_checks.real(0.0, 1.0, lo_open=True, note=" or exactly 1"),
    "faults.trace": field_checks.optional_text,
    "faults.seed": field_checks.integer(0, SEED_MAX),
    "faults.stragglers": field_checks.one_of(fault_schedule.STRAGGLER_MODES),
    "faults.min_quorum": field_checks.integer(1),
    "faults.on_failure": field_checks.one_of(elastic.ON_FAILURE),
    "faults.rejoin": field_checks.one_of(elastic.REJOIN),
}
# Fault fields in [0, 1) "or exactly 1" (their rule says [.., 1)).
FAULT_UP_TO_ONE = ("faults.failure_rate", "faults.slow_fraction",
                   "faults.slow_speed")
