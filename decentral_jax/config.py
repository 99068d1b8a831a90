"""The run-config schema: every field defined once, checked once, loaded once.

:func:`base_config` defines every field of a run, with its meaning, units and
default; the files in ``configs/`` are short variants that override what
differs (``configs/gpt_tiny.py``, ``configs/cnn_fashion_mnist.py``,
``configs/gpt2_small_owt.py``). The model group depends on the model:
:func:`gpt_model` or :func:`cnn_model`. :func:`check_config` is the boundary
between the user's config and the runner: past it every field has a valid
type, range and choice, so the runner reads fields without fallbacks.
:func:`load_config` parses a config file with command-line style overrides
exactly as ``experiments/train.py`` does (the entry points take them out of
their command line with :func:`split_overrides`); :func:`config_warnings`
lists accepted but suspicious settings and :func:`check_simulated_devices`
bounds the CPU devices an entry point simulates.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags

from decentral_jax import builders
from decentral_jax import topology as topology_lib

OPTIMIZERS = ("adamw", "accum_adamw")
GOSSIP_ROUNDS = ("switch", "static")
SCHEDULES = ("warmup_cosine", "inverse_sqrt", "constant")
DATA_SOURCES = {"gpt": ("pydoc", "text_file", "token_bins"),
                "cnn": ("fashion_mnist",)}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
GPT2_VOCAB = 50257  # token ids in nanoGPT's train.bin / val.bin
# Largest integer field value: step counters and sizes are int32 on device.
INT_MAX = 2**31 - 1
# Largest seed: jax.random.key keeps 32 bits (2**32 would be seed 0).
SEED_MAX = 2**32 - 1
# Most CPU devices the entry points simulate in one process. Start-up grows
# with the count (on 2 cores: 1024 devices about a minute to the first
# gossip step; 65536 not started after 2 minutes; 10**6 killed for memory).
MAX_SIMULATED_CPU_DEVICES = 1024


def gpt_model() -> config_dict.ConfigDict:
  """The ``model`` group of a GPT (``decentral_jax.models.gpt``)."""
  m = config_dict.ConfigDict()
  # "gpt" (decentral_jax.models.gpt) or "cnn".
  m.name = "gpt"
  # Vocabulary size V (256 for byte-level text).
  m.vocab_size = 256
  # Context length T in tokens.
  m.block_size = 64
  # Transformer blocks, attention heads (must divide n_embd), width.
  m.n_layer = 2
  m.n_head = 4
  m.n_embd = 128
  # Biases in Dense and LayerNorm layers.
  m.bias = False
  # Dropout rate (0 = none; dropout keys differ per worker and per step).
  m.dropout = 0.0
  # Compute dtype: "float32" or "bfloat16" (parameters stay float32).
  m.dtype = "float32"
  return m


def cnn_model() -> config_dict.ConfigDict:
  """The ``model`` group of the image classifier (``models.cnn``)."""
  m = config_dict.ConfigDict()
  # "cnn": conv-pool-conv-pool-dense-dense.
  m.name = "cnn"
  # Output channels of the two 3x3 convolutions.
  m.features = (32, 64)
  # Width of the hidden dense layer.
  m.dense = 128
  # Number of classes.
  m.num_classes = 10
  return m


_MODELS = {"gpt": gpt_model, "cnn": cnn_model}


def base_config(model: str = "gpt") -> config_dict.ConfigDict:
  """Every field of a run config, with its default (the ``gpt_tiny`` run).

  Args:
    model: ``"gpt"`` or ``"cnn"``: which ``model`` group to include.

  Returns:
    An unlocked ``ConfigDict``; a config file overrides what differs and
    returns it (``ml_collections.config_flags`` locks it).

  Raises:
    ValueError: an unknown ``model``.
  """
  if model not in _MODELS:
    raise ValueError(f"unknown model {model!r}; use one of {tuple(_MODELS)}.")
  c = config_dict.ConfigDict()

  # --- Parallel training ---------------------------------------------------
  # "all_reduce" (exact gradient average, then AdamW; paper Alg. 2) or
  # "decentralized" (gossip over `topology`, DAdam / AccumAdamW; Alg. 1, 4).
  c.algorithm = "decentralized"
  # Gossip topology, one of decentral_jax.topology.NAMES (ignored by
  # all_reduce): complete, ring, one_peer_exp, alternating_exp_ring (aer),
  # exponential, torus, static_ring.
  c.topology = "one_peer_exp"
  # Number of workers n (one per device; CPU devices are simulated on demand
  # by experiments/train.py).
  c.n_workers = 8
  # Workers per node L; node-aware topologies (alternating_exp_ring) group
  # workers node by node and the mesh becomes 2-D ("nodes", "local").
  c.workers_per_node = 1
  # dtype in which gossiped parameters are sent: "" (their own dtype),
  # "bfloat16", "float16" or "float32".
  c.comm_dtype = ""
  # How the gossip round is chosen: "switch" (one compile; lax.switch on
  # step % period inside the step) or "static" (one compile per distinct
  # round, chosen on the host: no conditional around the collectives, so
  # XLA can overlap them with the forward/backward on GPUs).
  c.gossip_rounds = "switch"
  # Exact global parameter average (pmean) every this many steps; 0 = never.
  c.global_avg_interval = 0
  # decentralized: gossip every this many steps, local steps in between
  # (local D-SGD / DAdam); 1 = every step.
  c.gossip_every = 1

  # --- Local updates (local_sgd, diloco, decentralized_diloco,
  # streaming_diloco) ----------------------------------------------------
  # Sync period H in steps: workers synchronise every H inner steps.
  c.sync_every = 10
  # Outer optimizer applied to the pseudo-gradient theta - mean(x) (DiLoCo):
  # "sgd" (with momentum / Nesterov) or "adam"; Local SGD is sgd, lr 1.
  c.outer_optimizer = config_dict.ConfigDict()
  # DiLoCo's default: Nesterov SGD, lr 0.7, momentum 0.9.
  c.outer_optimizer.name = "sgd"
  c.outer_optimizer.lr = 0.7
  c.outer_optimizer.momentum = 0.9
  c.outer_optimizer.nesterov = True
  # streaming_diloco: fragments P (each synchronises every H steps, offset
  # p H / P), overlap tau (steps between a fragment's send and its merge;
  # tau * P < H) and the merge weight alpha in [0, 1]:
  # x <- alpha x + (1 - alpha) theta.
  c.num_fragments = 1
  c.overlap_steps = 0
  c.merge_alpha = 0.0

  # --- Run length, batch, regularisation -----------------------------------
  # Number of optimizer steps.
  c.steps = 300
  # Sequences (images) per step over all workers; split evenly (must be
  # divisible by n_workers).
  c.global_batch = 64
  # Seed of the initial parameters, the data order and dropout, in
  # [0, 2**32 - 1].
  c.seed = 0
  # Global-norm clip of each worker's local gradient (of the averaged gradient
  # under all_reduce); 0 disables.
  c.grad_clip = 1.0

  # --- Evaluation, logging, checkpoints ------------------------------------
  # Evaluate the averaged model every this many steps (and at the end);
  # 0 = only at the end.
  c.eval_interval = 30
  # Validation batches per evaluation, each of global_batch sequences.
  c.eval_batches = 4
  # Write a metrics line every this many steps (and at the last step).
  c.log_interval = 10
  # Save a checkpoint every this many steps (and at the end); 0 = only at the
  # end.
  c.checkpoint_interval = 100
  # Number of checkpoints kept in <workdir>/checkpoints.
  c.keep_checkpoints = 2
  # Also write TensorBoard event files (needs the tensorboardX package).
  c.tensorboard = False
  # Output directory; the --workdir flag takes precedence.
  c.workdir = config_dict.placeholder(str)

  # --- Optimizer -------------------------------------------------------------
  c.optimizer = config_dict.ConfigDict()
  # "adamw" (All-Reduce AdamW / DAdam when decentralized) or "accum_adamw"
  # (AccumAdamW).
  c.optimizer.name = "accum_adamw"
  # Adam first- and second-moment decays, in [0, 1).
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  # Added to the denominator outside the square root.
  c.optimizer.eps = 1e-8
  # Decoupled weight decay, applied to parameters with ndim >= 2 only.
  c.optimizer.weight_decay = 0.1
  # AccumAdam window T (moments refreshed every T steps); must be 1 for adamw.
  c.optimizer.accum_steps = 4

  # --- Learning-rate schedule -----------------------------------------------
  c.schedule = config_dict.ConfigDict()
  # "warmup_cosine" (linear warmup from peak_lr / warmup_steps, then cosine to
  # final_lr at `steps`), "inverse_sqrt" (paper Sec. 2.3 Transformer rule) or
  # "constant".
  c.schedule.name = "warmup_cosine"
  # Peak learning rate (finite, > 0).
  c.schedule.peak_lr = 1.5e-3
  # Linear-warmup length in steps (longer than `steps` is allowed, with a
  # warning: the learning rate then never reaches peak_lr).
  c.schedule.warmup_steps = 30
  # Learning rate reached at the last step (warmup_cosine only), in
  # [0, peak_lr].
  c.schedule.final_lr = 1.5e-4

  # --- Model (gpt_model() or cnn_model()) ------------------------------------
  c.model = _MODELS[model]()

  # --- Data -----------------------------------------------------------------
  c.data = config_dict.ConfigDict()
  # "pydoc" (bundled text), "text_file" (bytes of `path`), "token_bins"
  # (nanoGPT train.bin/val.bin in directory `path`) or "fashion_mnist".
  c.data.source = "pydoc" if model == "gpt" else "fashion_mnist"
  # File or directory for text_file / token_bins / fashion_mnist.
  c.data.path = config_dict.placeholder(str)
  # Fraction of a byte corpus (pydoc, text_file) held out for validation.
  c.data.val_fraction = 0.1

  # --- Multi-host (see README, "Running on a cluster") ----------------------
  c.distributed = config_dict.ConfigDict()
  # Join a multi-process job with jax.distributed.initialize (one process per
  # host). Jobs started by `srun` with several tasks join even when False.
  c.distributed.enabled = False
  # "host:port" of process 0's coordinator; "" to detect it on SLURM.
  c.distributed.coordinator_address = ""
  # Total number of processes; 0 to detect it on SLURM.
  c.distributed.num_processes = 0
  # This process's id in [0, num_processes); -1 to detect it on SLURM.
  c.distributed.process_id = -1
  # Seconds without a heartbeat after which a process counts as dead and the
  # others stop with an error instead of hanging.
  c.distributed.heartbeat_timeout_seconds = 100
  # Seconds every process waits at start-up for all num_processes to join;
  # then it exits with an error naming the coordinator address.
  c.distributed.initialization_timeout_seconds = 120
  return c


# ----------------------------------------------------------------------------
# Checks.
# ----------------------------------------------------------------------------


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
        "decentral_jax.config.base_config() (see configs/gpt_tiny.py).")


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
    "comm_dtype": _one_of(builders.COMM_DTYPES),
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
        _real(0.0)(name, value) if value == 1 else _real(0.0, 1.0)(name, value)),
    "steps": _integer(1),
    "global_batch": _integer(1),
    "seed": _integer(0, SEED_MAX),
    "grad_clip": _real(0.0, note=" (0 disables clipping)"),
    "eval_interval": _integer(0, note=" (0 = only at the end)"),
    "eval_batches": _integer(1),
    "log_interval": _integer(1),
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
_BYTE_SOURCES = ("pydoc", "text_file")


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
  divides ``global_batch``; ``optimizer.accum_steps`` is 1 for ``adamw``;
  ``model.n_head`` divides ``model.n_embd``; ``schedule.final_lr <=
  peak_lr`` for ``warmup_cosine`` (a cosine "decay" upwards is refused);
  ``data.val_fraction > 0`` for byte corpora (pydoc, text_file). A warmup
  longer than the run is allowed (see :func:`config_warnings`). Device
  counts, data files, token ids and corpus lengths are checked when the
  experiment is built.

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
                "distributed"):
    _check_fields(c[group], list(base[group].keys()), group)
  for name, rule in {**_RULES, **_MODEL_RULES[model]}.items():
    rule(name, _field(c, name))
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
  check_distributed(c)


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
  if c.gossip_every != 1 and c.algorithm == "decentralized" and \
      c.gossip_rounds == "static":
    raise ValueError(
        f"config.gossip_every={c.gossip_every} picks its gossip round inside "
        "the step; set --config.gossip_rounds=switch (or gossip_every=1).")


def config_warnings(config: config_dict.ConfigDict) -> list[str]:
  """Settings of a valid config that run but are probably not meant.

  Currently: ``schedule.warmup_steps > steps`` (warmup_cosine,
  inverse_sqrt): the learning rate never reaches ``peak_lr``. Allowed
  because short smoke tests of long configs do exactly this.

  Returns:
    One line per finding (empty if none); the entry points print them.
  """
  c, out = config, []
  s = c.schedule
  if s.name != "constant" and s.warmup_steps > c.steps:
    out.append(
        f"config.schedule.warmup_steps={s.warmup_steps} > config.steps="
        f"{c.steps}: the learning rate stays in its linear warmup and peaks "
        f"at {c.steps / s.warmup_steps:.3g} x peak_lr.")
  return out


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


# ----------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------


def load_config(path: str, overrides=()) -> config_dict.ConfigDict:
  """Loads a config file with overrides, parsed exactly as on the command line.

  Args:
    path: a config file with ``get_config()``, optionally with its argument
      (``"configs/gpt2_small_owt.py:all_reduce"``).
    overrides: strings ``"field=value"`` or ``"--config.field=value"``
      (``"optimizer.accum_steps=8"``), typed and checked by
      ``ml_collections.config_flags`` as ``experiments/train.py`` does.

  Returns:
    The locked ``ConfigDict`` (not yet validated: see :func:`check_config`).

  Raises:
    ValueError: a missing, unreadable or broken config file (named, with the
      error of its import or ``get_config``), an unknown field (named) or a
      value of the wrong type (the override named).
  """
  file_part = path.split(":", 1)[0]
  if not os.path.exists(file_part):
    raise ValueError(f"config file {file_part!r} does not exist.")
  if not os.path.isfile(file_part):
    raise ValueError(f"config file {file_part!r} is not a file; pass a "
                     "Python file with get_config(), e.g. configs/gpt_tiny.py.")
  if not os.access(file_part, os.R_OK):
    raise ValueError(f"config file {file_part!r} is not readable.")
  args = [o if o.startswith("--") else f"--config.{o}" for o in overrides]

  def parse(argv):
    # config_flags imports every file as module "config_config" and reuses
    # a loaded one: names of an earlier config file would leak into this one.
    sys.modules.pop("config_config", None)
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config

  try:
    base = parse(["load_config", f"--config={path}"])
  except Exception as e:  # pylint: disable=broad-except
    # The file itself: a syntax error, no get_config(), get_config raising.
    raise ValueError(f"config file {path!r} could not be loaded: "
                     f"{_root_cause(e)}") from None
  if not isinstance(base, config_dict.ConfigDict):
    raise ValueError(f"get_config() of {path!r} returned a "
                     f"{type(base).__name__}, not an ml_collections ConfigDict.")
  if not args:
    return base
  try:
    return parse(["load_config", f"--config={path}", *args])
  except Exception as e:  # pylint: disable=broad-except
    error = e
  for arg in args:  # name the override whose field does not exist
    key = arg[len("--config."):].split("=", 1)[0]
    node = base
    for part in key.split("."):
      if not isinstance(node, config_dict.ConfigDict) or part not in node:
        raise ValueError(f"{arg}: unknown config field {key!r} in {path}.")
      node = node[part]
  raise ValueError(f"{path}: {config_error_message(error)}")


def _root_cause(error: BaseException) -> str:
  """``"Type: message"`` of the innermost exception behind ``error``."""
  seen = {id(error)}
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
    if id(error) in seen:
      break
    seen.add(id(error))
  if isinstance(error, AttributeError) and "get_config" in str(error):
    return "it defines no get_config()"
  return f"{type(error).__name__}: {' '.join(str(error).split())}"


def config_error_message(error: BaseException) -> str:
  """One line from an ml_collections / absl flag-parsing exception."""
  msg = str(error.args[0] if error.args else error)
  msg = msg.replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
  msg = " ".join(msg.split())
  if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":
    msg = msg[1:-1]  # KeyError quotes its message
  return msg


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates ``--config.<field>=value`` overrides from the other arguments.

  Args:
    argv: a command line, program name first. An override's value may also
      be the next argument (``--config.steps 100``); a bare
      ``--config.<field>`` followed by another flag is kept as is (a
      boolean). Arguments after ``--`` are not looked at.

  Returns:
    ``(rest, overrides)``: ``argv`` without the overrides, in order, and the
    overrides as ``"--config.<field>=value"`` strings for
    :func:`load_config`.
  """
  rest, overrides = [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == "--":
      rest += args[i:]
      break
    if arg.startswith("--config."):
      if ("=" not in arg and i + 1 < len(args)
          and not args[i + 1].startswith("--")):
        arg = f"{arg}={args[i + 1]}"
        i += 1
      overrides.append(arg)
    else:
      rest.append(arg)
    i += 1
  return rest, overrides
