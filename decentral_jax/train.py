"""Experiment runner: configs -> mesh, model, data, optimizer, train loop.

:class:`Experiment` turns an ``ml_collections`` config (see ``configs/``) into
the pieces of a run, without touching the file system: a device mesh with one
worker per device, the topology, the model and its loss, deterministic
per-worker data samplers, the optax transform and the jitted per-device train
and eval steps. :func:`train_and_evaluate` runs the loop in a work directory
with metrics, checkpoints, resumption and a non-finite-loss guard.

Multi-host: after :func:`initialize_distributed` (JAX's multi-controller
runtime, one process per host) the mesh spans every process's devices in
the order of ``decentral_jax.distributed.ordered_devices`` (worker ``i`` on
process ``i // local_device_count``; for node-aware topologies a node is a
process), each process feeds only its own workers' data, and only process 0
writes metrics and logs.

State layout (``TrainState``): every leaf has a leading worker axis
``[n_workers, ...]`` sharded over the mesh's worker axis (``"workers"``, or
``("nodes", "local")`` for node-aware topologies), so each device holds one
worker's parameters, optimizer state, step and RNG key. All workers start
from the same parameters. One train step, per device (``jax.shard_map``):

1. forward/backward of the worker's own batch at ``x_k``;
2. the optax update: All-Reduce (``pmean`` of gradients, then AdamW /
   AccumAdamW) or decentralized (``clip`` then DAdam / AccumAdamW, whose
   gossip ``W_k x_k`` happens inside the transform, paper Alg. 1 and 4);
3. optionally an exact global parameter average every
   ``global_avg_interval`` steps; the consensus distance
   ``(1/n) sum_i ||x_i - x_bar||^2`` on logged steps.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Sec. 5 and App. D for the experiment settings).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags

from decentral_jax import checkpoint as checkpoint_lib
from decentral_jax import distributed as distributed_lib
from decentral_jax import gossip
from decentral_jax import metrics as metrics_lib
from decentral_jax import models
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology as topology_lib
from decentral_jax.data import fashion_mnist
from decentral_jax.data import text

PyTree = Any
Batch = tuple[jax.Array, ...]

ALGORITHMS = ("all_reduce", "decentralized")
OPTIMIZERS = ("adamw", "accum_adamw")
GOSSIP_ROUNDS = ("switch", "static")
SCHEDULES = ("warmup_cosine", "inverse_sqrt", "constant")
DATA_SOURCES = {"gpt": ("pydoc", "text_file", "token_bins"),
                "cnn": ("fashion_mnist",)}
COMM_DTYPES = {"": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
               "float32": jnp.float32}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
GPT2_VOCAB = 50257  # token ids in nanoGPT's train.bin / val.bin


@flax.struct.dataclass
class TrainState:
  """Per-worker training state; every leaf is stacked ``[n_workers, ...]``.

  Attributes:
    step: int32 [n]: completed steps (equal on all workers).
    params: model parameters, float32 [n, ...] per leaf.
    opt_state: the optax state (moments, accumulators, gossip round
      counter), [n, ...] per leaf.
    rng: uint32 [n, 2]: raw data of the base dropout key (equal on all
      workers; per-step, per-worker keys are derived from it).
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  rng: jax.Array


# ----------------------------------------------------------------------------
# Config checks and builders.
# ----------------------------------------------------------------------------


def _int_field(config, name: str, minimum: int) -> int:
  value = config
  for part in name.split("."):
    value = value[part]
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


def check_config(config: config_dict.ConfigDict) -> None:
  """Validates a run config; raises a one-line ``ValueError`` naming the field.

  Checks the choices (algorithm, topology, optimizer, schedule, model, data
  source), integer ranges, that ``global_batch`` is divisible by
  ``n_workers``, that ``workers_per_node`` divides ``n_workers`` and that
  ``optimizer.accum_steps`` is 1 for ``adamw``. Device counts, data files
  and corpus lengths are checked when :class:`Experiment` is built.

  Raises:
    ValueError: the first problem found; the message names the config field
      and how to fix it.
  """
  c = config
  _choice(c.algorithm, "algorithm", ALGORITHMS)
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
  _choice(c.comm_dtype, "comm_dtype", tuple(COMM_DTYPES))
  _choice(c.get("gossip_rounds", "switch"), "gossip_rounds", GOSSIP_ROUNDS)
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
  _choice(c.model.name, "model.name", tuple(DATA_SOURCES))
  _choice(c.data.source, "data.source", DATA_SOURCES[c.model.name])
  if c.model.name == "gpt":
    _choice(c.model.dtype, "model.dtype", tuple(COMPUTE_DTYPES))
  _check_distributed(c)


def _check_distributed(c: config_dict.ConfigDict) -> None:
  """Checks the ``config.distributed`` group (types and ranges only)."""
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


def initialize_distributed(config: config_dict.ConfigDict) -> bool:
  """Joins a multi-process job as ``config.distributed`` asks, if it asks.

  Must run before anything touches JAX devices (``experiments/train.py``
  calls it first). With ``config.distributed.enabled`` and
  ``coordinator_address``, ``num_processes`` and ``process_id`` set, this
  process joins that job; with the three left empty (``""``, 0, -1) they
  are detected from SLURM (``srun``; with one task per node each process
  uses all GPUs of its node, otherwise JAX gives each task one GPU). A job
  step started by ``srun`` with more than one task also joins automatically
  when ``enabled`` is False (every task would otherwise train alone). On CPU
  (``JAX_PLATFORMS=cpu``) JAX's gloo collectives are used, so several
  processes on one machine form one job.

  Args:
    config: a run config; reads ``config.distributed``.

  Returns:
    True if this process joined a multi-process job, False for a
    single-process run.

  Raises:
    ValueError: a bad ``config.distributed`` field, an incomplete explicit
      set-up, or ``enabled`` without coordinator fields outside SLURM.
  """
  _check_distributed(config)
  d = config.distributed
  explicit = bool(d.coordinator_address) or int(d.num_processes) > 0 or \
      int(d.process_id) >= 0
  auto = distributed_lib.cluster_env_detected() and \
      int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1
  if not (d.enabled or auto):
    return False
  if d.enabled and not explicit and not distributed_lib.cluster_env_detected():
    raise ValueError(
        "config.distributed.enabled=True but no SLURM job with several tasks "
        "was found to detect the set-up from; set --config.distributed."
        "coordinator_address=HOST:PORT, --config.distributed.num_processes=N "
        "and --config.distributed.process_id=I (0 on the coordinator's host).")
  try:
    joined = distributed_lib.initialize(
        coordinator_address=str(d.coordinator_address),
        num_processes=int(d.num_processes), process_id=int(d.process_id),
        heartbeat_timeout_seconds=int(d.heartbeat_timeout_seconds))
  except ValueError as e:
    raise ValueError(f"config.distributed: {e}") from None
  if joined and not explicit and _slurm_one_task_per_node():
    # JAX's SLURM detection shows each process only the GPU numbered
    # SLURM_LOCALID (its one-process-per-GPU convention); with one task per
    # node the process drives every GPU of its node.
    jax.config.update("jax_cuda_visible_devices", "all")
    jax.config.update("jax_rocm_visible_devices", "all")
  return joined


def _slurm_one_task_per_node() -> bool:
  """True if SLURM runs one task on every node of this step (or job)."""
  spec = (os.environ.get("SLURM_STEP_TASKS_PER_NODE")
          or os.environ.get("SLURM_TASKS_PER_NODE") or "")
  counts = [part.split("(")[0] for part in spec.split(",") if part]
  return bool(counts) and all(c.strip() == "1" for c in counts)


def load_config(path: str, overrides=()) -> config_dict.ConfigDict:
  """Loads a config file with overrides, parsed exactly as on the command line.

  Args:
    path: a config file with ``get_config()``, optionally with its argument
      (``"configs/gpt2_small_owt.py:all_reduce"``).
    overrides: strings ``"field=value"`` or ``"--config.field=value"``
      (``"optimizer.accum_steps=8"``), typed and checked by
      ``ml_collections.config_flags`` as ``experiments/train.py`` does.

  Returns:
    The locked ``ConfigDict``.

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

  * ``decentralized``: ``chain(clip_by_global_norm(c), decentralized_adamw)``:
    each worker clips its own gradient, then DAdam (``adamw``) or AccumAdamW
    (``accum_adamw``) steps from the gossip-mixed point ``W_k x_k``.
  * ``all_reduce``: ``chain(all_reduce_gradients, clip_by_global_norm(c),
    adamw)`` (clip acts on the averaged gradient), or AccumAdamW after the
    all-reduce.

  Weight decay applies to leaves with ``ndim >= 2``. ``c = 0`` drops the clip.
  """
  o = config.optimizer
  mask = models.decay_mask
  clip = float(config.grad_clip)
  accum = int(o.accum_steps) if o.name == "accum_adamw" else 1
  if config.algorithm == "decentralized":
    tx = optim.decentralized_adamw(
        schedule, topology, b1=o.b1, b2=o.b2, eps=o.eps,
        weight_decay=o.weight_decay, mask=mask, accum_steps=accum,
        axis_name=axis_name, comm_dtype=COMM_DTYPES[config.comm_dtype])
    return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx
  parts = [optim.all_reduce_gradients(axis_name)]
  if clip:
    parts.append(optax.clip_by_global_norm(clip))
  if o.name == "adamw":
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=mask))
  else:
    parts += [optim.scale_by_accum_adam(o.b1, o.b2, o.eps, accum_steps=accum),
              optax.add_decayed_weights(o.weight_decay, mask),
              optax.scale_by_learning_rate(schedule)]
  return optax.chain(*parts)


def _node_aware(topo: topology_lib.Topology, local_size: int) -> bool:
  """True if every communicating round is a set of node-aligned group means."""
  if local_size <= 1:
    return False
  rounds = [r for r in topo.distinct_rounds
            if not r.is_identity and not r.is_global_mean]
  return bool(rounds) and all(r.node_partners(local_size) is not None
                              for r in rounds)


def _check_multi_process(c, n: int, n_devices: int, node_aware: bool) -> None:
  """Layout checks of a multi-process job (one worker on every device)."""
  procs = jax.process_count()
  if n != jax.device_count() or n_devices != n:
    total = jax.device_count()
    raise ValueError(
        f"config.n_workers={n} but this {procs}-process job has {total} "
        f"devices ({jax.local_device_count()} per process); a multi-process "
        f"run puts one worker on every device: set --config.n_workers={total}"
        " (and a config.global_batch divisible by it).")
  if node_aware:
    try:
      distributed_lib.check_node_layout(n, int(c.workers_per_node))
    except ValueError as e:
      raise ValueError(f"config.topology={c.topology!r} is node-aware: "
                       f"config.{e}") from None


def _local_workers(mesh) -> np.ndarray:
  """This process's workers (int64 [k]); contiguous in a multi-process job."""
  me = jax.process_index()
  workers = np.array([i for i, d in enumerate(mesh.devices.flat)
                      if d.process_index == me], np.int64)
  if jax.process_count() > 1 and (
      workers.size == 0 or
      np.any(workers != np.arange(workers[0], workers[0] + workers.size))):
    raise ValueError(
        "each process's workers must be consecutive (worker i on process "
        "i // local_device_count); pass devices=None to use "
        "decentral_jax.distributed.ordered_devices().")
  return workers


def _put_global(tree: PyTree, sharding: NamedSharding) -> PyTree:
  """Places host values that are equal on every process with ``sharding``.

  Single process: ``jax.device_put``. Multi-process: each process fills its
  own devices' shards from its copy (no cross-process traffic, no equality
  check).
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(one, tree)


def _to_host(tree: PyTree) -> PyTree:
  """NumPy values of (possibly multi-process) arrays; every process calls it.

  In a multi-process job the arrays are not fully addressable: replicated
  ones are read from a local device, others are gathered with
  ``multihost_utils.process_allgather`` (a collective, so all processes must
  call this in the same order).
  """
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def one(x):
    if x.sharding.is_fully_replicated:  # e.g. the train step's metrics
      return np.asarray(x.addressable_data(0))
    return multihost_utils.process_allgather(x, tiled=True)

  return jax.tree.map(one, tree)


class _Task(NamedTuple):
  """Model, loss and data of one experiment (host side)."""
  init_params: Callable[[jax.Array], PyTree]
  # loss(params, batch, dropout_key or None) -> (scalar loss, dict of aux)
  loss: Callable[..., tuple[jax.Array, dict]]
  # host_batch(step, workers or None) -> arrays [len(workers), B, ...]
  host_batch: Callable[..., tuple[np.ndarray, ...]]
  eval_set: tuple[np.ndarray, ...]  # arrays [eval_batches, global_batch, ...]
  unit: str  # "tokens" or "samples"
  units_per_step: int


def _lm_task(config, n: int, local_batch: int) -> _Task:
  c, m, d = config, config.model, config.data
  t = int(m.block_size)
  if d.source in ("pydoc", "text_file"):
    if d.source == "pydoc":
      corpus = text.pydoc_corpus()
    elif not d.path:
      raise ValueError("config.data.path is not set; data.source=text_file "
                       "needs --config.data.path=FILE.")
    else:
      corpus = text.load_text_file(d.path)
    try:
      train_tokens, val_tokens = text.byte_splits(corpus,
                                                  float(d.val_fraction))
    except ValueError as e:
      raise ValueError(f"data.source={d.source}, config.data.path={d.path!r}"
                       f", config.data.val_fraction={d.val_fraction}: {e}"
                       ) from None
  else:
    if not d.path:
      raise ValueError(
          "config.data.path is not set; data.source=token_bins needs "
          "--config.data.path=DIR holding nanoGPT's train.bin and val.bin "
          "(made by nanoGPT's data/openwebtext/prepare.py).")
    train_tokens, val_tokens = text.load_token_bins(d.path)
  vocab_needed = 256 if d.source != "token_bins" else GPT2_VOCAB
  if int(m.vocab_size) < vocab_needed:
    raise ValueError(f"config.model.vocab_size={m.vocab_size} is smaller than "
                     f"the {vocab_needed} token ids of data.source="
                     f"{d.source}; set --config.model.vocab_size="
                     f"{vocab_needed} or more.")
  for split, tokens, need in (
      ("training", train_tokens, n * local_batch * t + 1),
      ("validation", val_tokens, t + 1)):
    if len(tokens) < need:
      raise ValueError(
          f"the {split} split of data.source={d.source} has {len(tokens)} "
          f"tokens, fewer than the {need} needed with config.model."
          f"block_size={t} (and global_batch={c.global_batch}); lower "
          "--config.model.block_size or --config.global_batch, or use a "
          "longer corpus.")
  sampler = text.LMSampler(train_tokens, t, n, local_batch, int(c.seed))
  evals = text.eval_batches(val_tokens, t, int(c.global_batch),
                            int(c.eval_batches))
  eval_set = tuple(np.stack([b[i] for b in evals]) for i in range(2))
  gpt_cfg = models.GPTConfig(
      vocab_size=int(m.vocab_size), block_size=t, n_layer=int(m.n_layer),
      n_head=int(m.n_head), n_embd=int(m.n_embd), bias=bool(m.bias),
      dropout=float(m.dropout), dtype=COMPUTE_DTYPES[m.dtype])
  model = models.GPT(gpt_cfg)

  def loss(params, batch, key):
    inputs, targets = batch
    rngs = {"dropout": key} if key is not None else None
    logits = model.apply({"params": params}, inputs,
                         deterministic=key is None, rngs=rngs)
    return models.lm_loss(logits, targets), {}

  return _Task(lambda key: models.gpt.init_params(gpt_cfg, key), loss,
               sampler.batch, eval_set, "tokens", int(c.global_batch) * t)


def _image_task(config, n: int, local_batch: int) -> _Task:
  c, m = config, config.model
  data = fashion_mnist.load(config.data.path or fashion_mnist.DEFAULT_DIR)
  images, labels = data["train_images"], data["train_labels"].astype(np.int32)
  sampler = fashion_mnist.ArraySampler(len(images), n, local_batch,
                                       int(c.seed))
  n_eval = int(c.eval_batches) * int(c.global_batch)
  if n_eval > len(data["test_images"]):
    raise ValueError(
        f"config.eval_batches * config.global_batch = {n_eval} exceeds the "
        f"{len(data['test_images'])} Fashion-MNIST test images; lower "
        "--config.eval_batches.")
  shape = (int(c.eval_batches), int(c.global_batch))
  eval_set = (data["test_images"][:n_eval].reshape(shape + (28, 28)),
              data["test_labels"][:n_eval].astype(np.int32).reshape(shape))
  model = models.CNN(num_classes=int(m.num_classes),
                     features=tuple(int(f) for f in m.features),
                     dense=int(m.dense))

  def host_batch(step, workers=None):
    idx = sampler.batch_indices(step, workers)
    return images[idx], labels[idx]

  def loss(params, batch, key):
    del key  # the CNN has no dropout
    pixels, y = batch
    x = pixels.astype(jnp.float32)[..., None] / 255.0
    value, accuracy = models.classification_loss(
        model.apply({"params": params}, x), y)
    return value, {"accuracy": accuracy}

  return _Task(lambda key: models.cnn.init_params(model, key), loss,
               host_batch, eval_set, "samples", int(c.global_batch))


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------


class Experiment:
  """Everything a run needs except the file system, built from a config.

  Attributes:
    config: the (validated) config.
    mesh: ``jax.sharding.Mesh`` with one worker per device.
    axis_name: the worker axis (``"workers"`` or ``("nodes", "local")``).
    topology: the gossip :class:`~decentral_jax.topology.Topology`, or None
      for ``all_reduce``.
    schedule: learning-rate schedule ``step -> lr``.
    tx: the per-worker optax transform.
    n_workers: number of workers ``n``.
    local_batch: sequences (or images) per worker per step.
    param_count: parameters of one worker's model.
    unit: ``"tokens"`` or ``"samples"``.
    tokens_per_step: tokens (LM) or samples (images) per step, all workers.
    local_workers: int64 [k]: the workers whose devices belong to this
      process (all workers in a single-process run). In a multi-process job
      (:func:`initialize_distributed`) worker ``i`` lives on process
      ``i // k``, and each process reads only its own workers' data.
  """

  def __init__(self, config: config_dict.ConfigDict, *,
               devices: list | None = None):
    """Builds mesh, topology, model, data, optimizer and the jitted steps.

    Args:
      config: a run config (see ``configs/gpt_tiny.py``).
      devices: devices to place workers on, in worker order (default: every
        device of the job ordered by process, then device id).

    Raises:
      ValueError: an invalid config field, more workers than devices (the
        message says how to simulate CPU devices), missing data files, or a
        corpus too short for the context length; in a multi-process job,
        ``n_workers`` differing from the job's device count, or a
        node-aware topology whose ``workers_per_node`` is not the number
        of devices per process.
    """
    check_config(config)
    c = self.config = config
    if c.distributed.enabled and not jax.distributed.is_initialized():
      raise ValueError(
          "config.distributed.enabled=True but this process has not joined "
          "a multi-process job; call decentral_jax.train.initialize_"
          "distributed(config) before JAX touches devices (experiments/"
          "train.py does), or set --config.distributed.enabled=False.")
    if devices is None:
      devices = distributed_lib.ordered_devices()
    self.n_workers = n = int(c.n_workers)
    self.local_batch = int(c.global_batch) // n
    local_size = int(c.workers_per_node)
    self.topology = None
    node_aware = False
    if c.algorithm == "decentralized":
      try:
        self.topology = topology_lib.make(c.topology, n, local_size)
      except ValueError as e:
        raise ValueError(f"config.topology={c.topology!r} with config."
                         f"n_workers={n}, workers_per_node={local_size}: {e}"
                         ) from None
      node_aware = _node_aware(self.topology, local_size)
    if jax.process_count() > 1:
      _check_multi_process(c, n, len(devices), node_aware)
    try:
      self.mesh = parallel.make_mesh(n, local_size, node_aware=node_aware,
                                     devices=devices)
    except ValueError as e:
      raise ValueError(f"config.n_workers={n}: {e} experiments/train.py "
                       "sets this by itself on CPU; otherwise lower "
                       "--config.n_workers.") from None
    self.local_workers = _local_workers(self.mesh)
    self.axis_name = parallel.worker_axis(self.mesh)
    self._sharding = parallel.worker_sharding(self.mesh)
    try:
      if c.model.name == "gpt":
        self._task = _lm_task(c, n, self.local_batch)
      else:
        self._task = _image_task(c, n, self.local_batch)
    except FileNotFoundError as e:  # includes data.DataNotFoundError
      raise ValueError(f"config.data.path={c.data.path!r} "
                       f"(data.source={c.data.source}): {e}") from None
    self.unit = self._task.unit
    self.tokens_per_step = self._task.units_per_step
    self.schedule = make_schedule(c)
    self.tx = make_optimizer(c, self.schedule, self.topology, self.axis_name)
    self._batch_workers = (None if jax.process_count() == 1
                           else self.local_workers)
    root = jax.random.key(int(c.seed))
    self._init_key, self._dropout_key = jax.random.split(root)
    self._params0 = None
    self.param_count = sum(
        int(np.prod(x.shape)) for x in
        jax.tree.leaves(jax.eval_shape(self._task.init_params,
                                       self._init_key)))
    self._eval_rows, self._eval_common = self._place_eval_set()
    self._init_fn = jax.jit(parallel.per_worker(
        self._init_worker, self.mesh, replicated_argnums=(0, 1)))
    # Gossip round dispatch: "switch" compiles the whole schedule once (the
    # round is picked in-graph with lax.switch); "static" compiles one step
    # per distinct round (the host picks it from the step number), so the
    # collective sits outside any conditional and XLA can overlap it with
    # the forward/backward pass on accelerators.
    self.gossip_rounds = c.get("gossip_rounds", "switch")
    distinct = (self.topology.distinct_rounds if self.topology is not None
                else ())
    self._static_rounds = (self.gossip_rounds == "static" and
                           len(distinct) > 1)
    if self._static_rounds:
      first = {}
      for r, d in enumerate(self.topology.round_to_distinct):
        first.setdefault(d, r)
      self._round_steps = {
          d: jax.jit(self._step_fn(r), donate_argnums=(0,))
          for d, r in first.items()}
      self._train_step = None
    else:
      self._train_step = jax.jit(self._step_fn(None), donate_argnums=(0,))
    self._eval_step = jax.jit(
        parallel.per_worker(self._eval_worker, self.mesh,
                            replicated_argnums=(2,)))

  # -- state and data --------------------------------------------------------

  def init_state(self) -> TrainState:
    """Initial state: identical parameters on every worker, zero moments.

    Returns:
      A :class:`TrainState` whose leaves are ``[n_workers, ...]`` arrays
      sharded over the worker axis (``step`` is 0).
    """
    if self._params0 is None:
      self._params0 = self._task.init_params(self._init_key)
    everywhere = NamedSharding(self.mesh, P())
    params, rng = _put_global(
        (self._params0, jax.random.key_data(self._dropout_key)), everywhere)
    return self._init_fn(params, rng)

  def _init_worker(self, params, rng):
    return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                      opt_state=self.tx.init(params), rng=rng)

  def get_batch(self, step: int) -> Batch:
    """The training batch of ``step`` (0-based) for all workers, on device.

    Returns:
      A tuple of arrays ``[n_workers, local_batch, ...]`` (LM: int32 inputs
      and targets ``[n, B, T]``; images: uint8 ``[n, B, 28, 28]`` and int32
      labels ``[n, B]``) sharded over the worker axis. Deterministic in
      ``(seed, step)``; worker ``w`` gets its own shard of the data. In a
      multi-process job each process reads only the rows of its
      :attr:`local_workers` and the global array is assembled from them
      (``jax.make_array_from_process_local_data``).
    """
    rows = self._task.host_batch(int(step), self._batch_workers)
    if self._batch_workers is None:
      return jax.device_put(tuple(rows), self._sharding)
    return tuple(
        jax.make_array_from_process_local_data(
            self._sharding, x, (self.n_workers,) + x.shape[1:])
        for x in rows)

  def _place_eval_set(self):
    """Eval rows per worker ``[n, E, B, ...]`` and a common subset ``[E, B, ...]``.

    Worker ``w`` holds rows ``w*B .. w*B+B-1`` of every eval batch (for the
    averaged model); the common subset is every ``n``-th row (spread over the
    whole validation set), the same for all workers.
    """
    n, b = self.n_workers, self.local_batch
    rows, common = [], []
    for x in self._task.eval_set:
      e = x.shape[0]
      per = x.reshape((e, n, b) + x.shape[2:]).swapaxes(0, 1)
      rows.append(np.ascontiguousarray(per))
      common.append(np.ascontiguousarray(x[:, ::n]))
    return (_put_global(tuple(rows), self._sharding),
            _put_global(tuple(common), NamedSharding(self.mesh, P())))

  # -- steps -------------------------------------------------------------------

  def _is_log_step(self, step):
    c = self.config
    return (step % int(c.log_interval) == 0) | (step == int(c.steps))

  def _step_fn(self, round_index):
    """The (unjitted) step over all workers; ``round_index`` static or None."""
    worker = functools.partial(self._step_worker, round_index=round_index)
    if jax.process_count() == 1:
      return parallel.per_worker(worker, self.mesh)
    return self._gathering_step(worker)

  def _step_worker(self, state: TrainState, batch: Batch,
                   round_index: int | None = None):
    """One training step of one worker (inside ``shard_map``)."""
    c, axis = self.config, self.axis_name
    key = None
    if c.model.name == "gpt" and float(c.model.dropout) > 0:
      key = jax.random.wrap_key_data(state.rng)
      key = jax.random.fold_in(jax.random.fold_in(key, state.step),
                               lax.axis_index(axis))
    grad_fn = jax.value_and_grad(self._task.loss, has_aux=True)
    (loss, aux), grads = grad_fn(state.params, batch, key)
    extra = {} if round_index is None else {"round_index": round_index}
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params,
                                        **extra)
    params = optax.apply_updates(state.params, updates)
    step = state.step + 1
    interval = int(c.global_avg_interval)
    if interval:
      params = lax.cond(step % interval == 0, self._exact_mean,
                        lambda p: p, params)
    consensus = lax.cond(
        self._is_log_step(step),
        lambda p: gossip.consensus_distance(p, axis).astype(jnp.float32),
        lambda p: jnp.full([], jnp.nan, jnp.float32), params)
    finite = jnp.isfinite(loss)
    for leaf in jax.tree.leaves(params):
      finite = finite & jnp.all(jnp.isfinite(leaf))
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "finite": finite, "consensus_distance": consensus, **aux}
    new_state = state.replace(step=step, params=params, opt_state=opt_state)
    return new_state, metrics

  def _gathering_step(self, worker):
    """The multi-process step: metrics all-gathered in the step, replicated.

    Every process can then read all workers' metrics from its own devices
    without another collective, so the host still reads step ``t-1`` while
    step ``t`` runs (a separate gather would queue behind step ``t``).
    """
    spec = parallel.worker_spec(self.mesh)

    def body(state, batch):
      state, batch = jax.tree.map(lambda x: x[0], (state, batch))
      state, metrics = worker(state, batch)
      metrics = jax.tree.map(
          lambda x: lax.all_gather(gossip._match_varying(x, state.step),  # pylint: disable=protected-access
                                   self.axis_name, to="invarying"), metrics)
      return jax.tree.map(lambda x: x[None], state), metrics

    return jax.shard_map(body, mesh=self.mesh, in_specs=(spec, spec),
                         out_specs=(spec, P()))

  def _exact_mean(self, params):
    return jax.tree.map(
        lambda x: gossip._match_varying(lax.pmean(x, self.axis_name), x),  # pylint: disable=protected-access
        params)

  def train_step(self, state: TrainState, batch: Batch,
                 step: int | None = None) -> tuple[TrainState, dict]:
    """One step on every worker. ``state`` is donated (do not reuse it).

    Args:
      state: stacked state from :meth:`init_state` or a previous step.
      batch: from :meth:`get_batch`.
      step: the number of completed steps in ``state`` (host int). Only
        used with ``config.gossip_rounds="static"``, to pick the compiled
        round without reading ``state.step`` from the device (which would
        wait for the previous step); read from the device if omitted.

    Returns:
      ``(new_state, metrics)``; metrics are device arrays ``[n_workers]``:
      ``loss`` (each worker's training loss before the update, nats),
      ``grad_norm`` (its local gradient's global norm before clipping),
      ``finite`` (bool: loss and updated parameters finite),
      ``consensus_distance`` (``(1/n) sum_i ||x_i - x_bar||^2`` after the
      update; computed on log steps only, NaN otherwise), and ``accuracy``
      for classifiers. The step is compiled once. In a multi-process job
      the metrics are gathered inside the step and replicated on every
      device, so each process reads all ``n_workers`` values locally.
    """
    if not self._static_rounds:
      return self._train_step(state, batch)
    if step is None:
      step = int(np.asarray(jax.device_get(
          state.step.addressable_shards[0].data)).reshape(-1)[0])
    topo = self.topology
    fn = self._round_steps[topo.round_to_distinct[int(step) % topo.period]]
    return fn(state, batch)

  def _eval_worker(self, params, rows: Batch, common: Batch):
    """Eval of one worker: averaged model on its rows, own model on common."""
    axis, loss_fn = self.axis_name, self._task.loss
    avg = jax.tree.map(lambda x: lax.pmean(x, axis), params)

    def run(p, data):
      def one(batch):
        value, aux = loss_fn(p, batch, None)
        return value, aux.get("accuracy", jnp.zeros([], jnp.float32))
      losses, accs = lax.map(one, data)
      return jnp.mean(losses), jnp.mean(accs)

    avg_loss, avg_acc = run(avg, rows)
    own_loss, _ = run(params, common)
    subset_loss, _ = run(avg, common)
    return {"avg_loss": lax.pmean(avg_loss, axis),
            "avg_accuracy": lax.pmean(avg_acc, axis),
            "own_loss": own_loss,
            "avg_subset_loss": subset_loss,
            "consensus_distance": gossip.consensus_distance(params, axis)}

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Validation metrics; ``state`` is read only (training is unaffected).

    The averaged model is ``x_bar = (1/n) sum_i x_i`` (exact ``pmean``,
    computed on the fly, never written back); it is evaluated on all
    ``eval_batches * global_batch`` validation sequences (images), split
    over the workers. Each worker's own parameters, and the averaged model
    again, are evaluated on a common subset (every ``n_workers``-th row of
    every eval batch, i.e. ``1/n`` of the validation set spread over all of
    it), so own-model and averaged-model losses compare on the same data.

    Returns:
      Floats: ``eval/loss`` (averaged model, whole eval set, nats);
      ``eval/worker_loss_mean``, ``_min``, ``_max``, ``_std`` (the workers'
      own models on the subset); ``eval/loss_subset`` (averaged model on the
      subset); ``eval/worker_excess_mean`` and ``_max`` (own-model loss minus
      ``eval/loss_subset``: what the workers lose by not being averaged);
      ``consensus_distance``; and ``eval/accuracy`` for classifiers.
    """
    out = _to_host(self._eval_step(state.params, self._eval_rows,
                                   self._eval_common))
    own = np.asarray(out["own_loss"], np.float64)
    subset = float(out["avg_subset_loss"][0])
    result = {
        "eval/loss": float(out["avg_loss"][0]),
        "eval/worker_loss_mean": float(own.mean()),
        "eval/worker_loss_min": float(own.min()),
        "eval/worker_loss_max": float(own.max()),
        "eval/worker_loss_std": float(own.std()),
        "eval/loss_subset": subset,
        "eval/worker_excess_mean": float(own.mean() - subset),
        "eval/worker_excess_max": float(own.max() - subset),
        "consensus_distance": float(out["consensus_distance"][0]),
    }
    if self.unit == "samples":
      result["eval/accuracy"] = float(out["avg_accuracy"][0])
    return result

  def learning_rate(self, step: int) -> float:
    """Learning rate used by the update of step ``step`` (1-based)."""
    return float(self.schedule(max(int(step) - 1, 0)))

  def checkpoint_meta(self, step: int) -> dict:
    """JSON facts stored with a checkpoint taken after ``step`` steps."""
    c = self.config
    return {
        "step": int(step),
        "data_position": int(step),  # the next batch is get_batch(step)
        "seed": int(c.seed),
        "n_workers": self.n_workers,
        "workers_per_node": int(c.workers_per_node),
        "algorithm": c.algorithm,
        "topology": self.topology.name if self.topology else "",
        "topology_round": (int(step) % self.topology.period
                           if self.topology else 0),
        "optimizer": c.optimizer.name,
        "accum_steps": int(c.optimizer.accum_steps),
        "global_batch": int(c.global_batch),
        "model": json.loads(c.model.to_json()),
    }

  def check_resumable(self, meta: dict, directory: str) -> None:
    """Raises ValueError if a checkpoint was written by an incompatible run."""
    mine = self.checkpoint_meta(meta.get("step", 0))
    fields = {"n_workers": "n_workers", "workers_per_node": "workers_per_node",
              "algorithm": "algorithm", "topology": "topology",
              "optimizer": "optimizer.name",
              "accum_steps": "optimizer.accum_steps", "model": "model",
              "seed": "seed", "global_batch": "global_batch"}
    for key, field in fields.items():
      if key in meta and meta[key] != mine[key]:
        raise ValueError(
            f"the checkpoint in {directory} was written with config.{field}="
            f"{meta[key]!r} but this run has {mine[key]!r}; resume with the "
            "same value or use a fresh --workdir.")


# ----------------------------------------------------------------------------
# The training loop.
# ----------------------------------------------------------------------------


class _Window:
  """Accumulates host-side training metrics between two log records."""

  def __init__(self):
    self.losses, self.times, self.accs = [], [], []
    self.consensus = None

  def add(self, metrics: dict, seconds: float | None) -> None:
    self.losses.append(float(np.mean(metrics["loss"])))
    if "accuracy" in metrics:
      self.accs.append(float(np.mean(metrics["accuracy"])))
    if seconds is not None:
      self.times.append(seconds)
    cd = float(np.asarray(metrics["consensus_distance"]).reshape(-1)[0])
    if np.isfinite(cd):
      self.consensus = cd

  def summary(self, units_per_step: int, unit: str) -> dict:
    out = {}
    if self.losses:
      out["train/loss"] = float(np.mean(self.losses))
    if self.accs:
      out["train/accuracy"] = float(np.mean(self.accs))
    if self.consensus is not None:
      out["consensus_distance"] = self.consensus
    if self.times:
      sec = float(np.mean(self.times))
      out["step_time_ms"] = 1e3 * sec
      out[f"{unit}_per_sec"] = units_per_step / sec
    return out


def _non_finite_error(step: int, metrics: dict, last_good: int | None,
                      directory: str) -> FloatingPointError:
  loss = np.asarray(metrics["loss"], np.float64)
  bad = np.flatnonzero(~np.asarray(metrics["finite"]) | ~np.isfinite(loss))
  where = (f"the last good checkpoint (step {last_good}) is kept in "
           f"{directory}" if last_good is not None else
           "no checkpoint had been written yet")
  return FloatingPointError(
      f"non-finite training loss or parameters at step {step} on worker(s) "
      f"{bad.tolist()} (losses {np.round(loss[bad], 4).tolist()}); stopping, "
      f"{where}. Lower config.schedule.peak_lr or enable config.grad_clip.")


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str, *,
                       experiment: Experiment | None = None) -> dict:
  """Trains ``config`` in ``workdir``, resuming from its last checkpoint.

  Writes ``metrics.jsonl`` (one record per log or eval point), ``config.json``
  and ``checkpoints/<step>/`` (every worker's parameters and optimizer state,
  the step, the data position and RNG keys; every ``checkpoint_interval``
  steps and at the end). A resumed run continues bit-exactly: same batches,
  same dropout keys, same gossip round.

  In a multi-process job (:func:`initialize_distributed`) every process
  calls this with the same config and work directory (shared by all hosts):
  all processes train, evaluate and write their shards of each checkpoint
  (Orbax), while ``metrics.jsonl``, ``config.json``, logging and the
  progress bar come from process 0 only. A checkpoint is restored by a job
  with the same number of processes and devices per process.

  Args:
    config: a run config (``configs/*.py``).
    workdir: output directory (created if missing).
    experiment: an :class:`Experiment` already built from ``config`` to
      reuse (its compiled steps); built here if None.

  Returns:
    Final metrics (floats): ``step``, ``train/loss``, ``eval/loss``,
    ``eval/worker_loss_*``, ``consensus_distance``, ``step_time_ms`` (mean
    over the timed steps of this invocation; the first step, which compiles,
    is not timed, and evaluation and checkpoint time is excluded),
    ``tokens_per_sec`` (or ``samples_per_sec``), ``train_time_s`` and
    ``param_count``.

  Raises:
    ValueError: bad config or data (see :class:`Experiment`), or a
      checkpoint in ``workdir`` from an incompatible config.
    FloatingPointError: a non-finite loss or parameter; names the step and
      workers; the last good checkpoint stays in place.
  """
  c = config
  exp = experiment if experiment is not None else Experiment(c)
  if exp.config is not c and exp.config.to_dict() != c.to_dict():
    raise ValueError("train_and_evaluate: `experiment` was built from a "
                     "different config; pass experiment=None.")
  total = int(c.steps)
  main = distributed_lib.is_main_process()
  os.makedirs(workdir, exist_ok=True)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  ckpt = checkpoint_lib.Checkpointer(ckpt_dir,
                                     max_to_keep=int(c.keep_checkpoints))
  state = exp.init_state()
  start = last_saved = ckpt.latest_step()
  time_offset = 0.0  # training seconds of earlier invocations
  if start is not None:
    exp.check_resumable(ckpt.restore_meta(start), ckpt_dir)
    try:
      state, meta = ckpt.restore(start, state)
    except ValueError as e:  # e.g. a different optimizer-state structure
      raise ValueError(
          f"cannot resume from {ckpt_dir} (step {start}): its state does not "
          f"match this config (a changed grad_clip, optimizer or model "
          f"field?); resume with the original config or use a fresh "
          f"--workdir. Orbax: {str(e).splitlines()[0]}") from None
    start = int(meta["data_position"])
    time_offset = float(meta.get("train_time_s", 0.0))
    if main:
      logging.info("resumed from %s at step %d", ckpt_dir, start)
  else:
    start = 0
  if main:
    # Written only once the run is known to be valid (a rejected resume must
    # not overwrite the record of the original run).
    with open(os.path.join(workdir, "config.json"), "w",
              encoding="utf-8") as f:
      f.write(c.to_json(indent=2))
    # Records logged after the restored checkpoint are about to be redone.
    metrics_lib.truncate_after(workdir, start)
  writer = (metrics_lib.MetricsWriter(workdir, tensorboard=bool(c.tensorboard))
            if main else None)
  if main:
    logging.info("%s: %d workers on %d process(es), %s params/worker, %d "
                 "%s/step, mesh %s", c.algorithm, exp.n_workers,
                 jax.process_count(), f"{exp.param_count:,}",
                 exp.tokens_per_step, exp.unit, dict(exp.mesh.shape))

  unit_key = f"{exp.unit}_per_sec"
  eval_every, ckpt_every = int(c.eval_interval), int(c.checkpoint_interval)
  log_every = int(c.log_interval)
  window, timed = _Window(), []
  last = {"step": start}
  t_prev = None
  bar = metrics_lib.progress_bar(total, initial=start,
                                 disable=None if main else True)

  def handle(done: int, device_metrics: dict) -> None:
    nonlocal t_prev
    m = _to_host(device_metrics)  # waits for step `done`
    now = time.perf_counter()
    seconds = None if t_prev is None else now - t_prev
    t_prev = now
    if not np.all(m["finite"]) or not np.all(np.isfinite(m["loss"])):
      raise _non_finite_error(done, m, last_saved, ckpt_dir)
    if seconds is not None:
      timed.append(seconds)
    window.add(m, seconds)
    bar.update(1)

  def record(done: int, extra: dict | None = None) -> None:
    nonlocal window
    rec = {"step": done, "lr": exp.learning_rate(max(done, 1)),
           **window.summary(exp.tokens_per_step, exp.unit), **(extra or {})}
    rec["train_time_s"] = time_offset + float(np.sum(timed))
    last.update(rec)
    window = _Window()
    if not main:
      return
    writer.write(rec)
    bar.set_postfix({k: f"{rec[k]:.4g}" for k in
                     ("train/loss", "eval/loss", "consensus_distance")
                     if k in rec})
    logging.info("step %d: %s", done, ", ".join(
        f"{k}={v:.5g}" for k, v in rec.items()
        if k != "step" and isinstance(v, float)))

  try:
    if start == 0 and eval_every:  # the common starting point of all runs
      record(0, exp.evaluate(state))
    pending = None
    batch = exp.get_batch(start) if start < total else None
    for s in range(start, total):
      state, device_metrics = exp.train_step(state, batch, s)
      done = s + 1
      if pending is not None:  # read step s-1 while step s runs
        handle(*pending)
        if pending[0] % log_every == 0:
          record(pending[0])
      pending = (done, device_metrics)
      if done < total:
        batch = exp.get_batch(done)  # host prepares the next batch
      do_eval = done == total or (eval_every and done % eval_every == 0)
      do_ckpt = done == total or (ckpt_every and done % ckpt_every == 0)
      if do_eval or do_ckpt:
        handle(*pending)
        pending = None
        if do_eval:
          record(done, exp.evaluate(state))
        elif done % log_every == 0:
          record(done)
        if do_ckpt:
          meta = exp.checkpoint_meta(done)
          meta["train_time_s"] = time_offset + float(np.sum(timed))
          ckpt.save(done, state, meta)
          last_saved = done
        t_prev = time.perf_counter()
    if start >= total:  # nothing left to train: report the final evaluation
      last.update(exp.evaluate(state))
  finally:
    bar.close()
    if writer is not None:
      writer.close()
    ckpt.close()
  if timed:
    sec = float(np.mean(timed))
    last["step_time_ms"] = 1e3 * sec
    last[unit_key] = exp.tokens_per_step / sec
  last["train_time_s"] = time_offset + float(np.sum(timed))
  last["param_count"] = exp.param_count
  return last
