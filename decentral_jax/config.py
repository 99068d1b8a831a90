"""The run-config schema: every field defined once, checked once, loaded once.

:func:`base_config` defines every field of a run, with its meaning, units and
default; the files in ``configs/`` are short variants that override what
differs (``configs/gpt_tiny.py``, ``configs/cnn_fashion_mnist.py``,
``configs/gpt2_small_owt.py``). The model group depends on the model:
:func:`gpt_model` or :func:`cnn_model`. :func:`check_config` is the boundary
between the user's config and the runner: past it every field has a valid
type, range and choice, so the runner reads fields without fallbacks.
:func:`load_config` parses a config file with command-line style overrides
exactly as ``experiments/train.py`` does.
"""

from __future__ import annotations

import os

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

  # --- Run length, batch, regularisation -----------------------------------
  # Number of optimizer steps.
  c.steps = 300
  # Sequences (images) per step over all workers; split evenly (must be
  # divisible by n_workers).
  c.global_batch = 64
  # Seed of the initial parameters, the data order and dropout.
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
  # Peak learning rate.
  c.schedule.peak_lr = 1.5e-3
  # Linear-warmup length in steps.
  c.schedule.warmup_steps = 30
  # Learning rate reached at the last step (warmup_cosine only).
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


def check_config(config: config_dict.ConfigDict) -> None:
  """Validates a run config; raises a one-line ``ValueError`` naming the field.

  Checks that every field of :func:`base_config` is present, the choices
  (algorithm, topology, optimizer, schedule, model, data source), integer
  ranges, that ``global_batch`` is divisible by ``n_workers``, that
  ``workers_per_node`` divides ``n_workers`` and that
  ``optimizer.accum_steps`` is 1 for ``adamw``. Device counts, data files
  and corpus lengths are checked when the experiment is built.

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
  for group in ("optimizer", "schedule", "model", "data", "distributed"):
    _check_fields(c[group], list(base[group].keys()), group)
  _choice(c.algorithm, "algorithm", tuple(builders.ALGORITHMS))
  try:
    topology_lib.canonical_name(c.topology)
  except ValueError as e:
    raise ValueError(f"config.topology: {e}") from None
  n = _int_field(c, "n_workers", 1)
  local = _int_field(c, "workers_per_node", 1)
  if n % local:
    raise ValueError(f"config.workers_per_node={local} must divide "
                     f"config.n_workers={n}; use one of "
                     f"{[d for d in range(1, n + 1) if n % d == 0]}.")
  _int_field(c, "steps", 1)
  batch = _int_field(c, "global_batch", 1)
  if batch % n:
    lo = max(n, batch // n * n)
    raise ValueError(
        f"config.global_batch={batch} is not divisible by config.n_workers="
        f"{n} (the global batch is split evenly across workers); use e.g. "
        f"--config.global_batch={lo} or {lo + n}.")
  _int_field(c, "seed", 0)
  for name in ("global_avg_interval", "eval_interval", "checkpoint_interval"):
    _int_field(c, name, 0)
  _int_field(c, "log_interval", 1)
  _int_field(c, "eval_batches", 1)
  _int_field(c, "keep_checkpoints", 1)
  if not float(c.grad_clip) >= 0:
    raise ValueError(f"config.grad_clip must be >= 0 (0 disables clipping), "
                     f"got {c.grad_clip!r}.")
  _choice(c.comm_dtype, "comm_dtype", tuple(builders.COMM_DTYPES))
  _choice(c.gossip_rounds, "gossip_rounds", GOSSIP_ROUNDS)
  o = c.optimizer
  _choice(o.name, "optimizer.name", OPTIMIZERS)
  accum = _int_field(c, "optimizer.accum_steps", 1)
  if o.name == "adamw" and accum != 1:
    raise ValueError(
        f"config.optimizer.accum_steps={accum} only applies to accum_adamw; "
        "set --config.optimizer.name=accum_adamw or "
        "--config.optimizer.accum_steps=1.")
  for name in ("b1", "b2"):
    if not 0.0 <= float(o[name]) < 1.0:
      raise ValueError(f"config.optimizer.{name} must be in [0, 1), got "
                       f"{o[name]!r}.")
  s = c.schedule
  _choice(s.name, "schedule.name", SCHEDULES)
  if not float(s.peak_lr) > 0:
    raise ValueError(f"config.schedule.peak_lr must be > 0, got {s.peak_lr!r}.")
  _int_field(c, "schedule.warmup_steps", 0)
  _choice(c.data.source, "data.source", DATA_SOURCES[model])
  if model == "gpt":
    _choice(c.model.dtype, "model.dtype", tuple(COMPUTE_DTYPES))
  check_distributed(c)


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
    ValueError: a missing file, an unknown field (named, with the closest
      valid one) or a value of the wrong type.
  """
  file_part = path.split(":", 1)[0]
  if not os.path.isfile(file_part):
    raise ValueError(f"config file {file_part!r} does not exist.")
  args = [o if o.startswith("--") else f"--config.{o}" for o in overrides]

  def parse(argv):
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config

  try:
    return parse(["load_config", f"--config={path}", *args])
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    error = e
  base = parse(["load_config", f"--config={path}"])
  for arg in args:  # name the override whose field does not exist
    key = arg[len("--config."):].split("=", 1)[0]
    node = base
    for part in key.split("."):
      if not isinstance(node, config_dict.ConfigDict) or part not in node:
        raise ValueError(f"{arg}: unknown config field {key!r} in {path}.")
      node = node[part]
  raise ValueError(f"{path}: {config_error_message(error)}")


def config_error_message(error: BaseException) -> str:
  """One line from an ml_collections / absl flag-parsing exception."""
  msg = str(error.args[0] if error.args else error)
  msg = msg.replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
  return " ".join(msg.split()).strip("'\" ")
