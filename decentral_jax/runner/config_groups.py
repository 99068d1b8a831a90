"""The groups of a run config: one builder per group of fields, each field
with its one-line comment.

:func:`decentral_jax.runner.config.base_config` composes them into the
schema of every run config (the method and its workers, the local-update
fields, compression, faults, run length and batch, evaluation and records,
the optimizer, its schedule, the model, its data, the multi-host job).
Each builder returns a fresh ``ConfigDict`` (or adds its fields to one);
none reads any other state.
"""

from __future__ import annotations

from ml_collections import config_dict


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
  # Compute dtype of the activations: "float32" or "bfloat16".
  m.dtype = "float32"
  # dtype of the parameters, hence of their gradients and of the optimizer
  # state that follows them (Adam's moments): "float32" or "bfloat16"
  # (half the bytes of each; updates are rounded to bfloat16).
  m.param_dtype = "float32"
  # Activation checkpointing per transformer block: "none" (keep every
  # activation for the backward pass), "block" (keep each block's input
  # only; recompute the block in the backward pass) or "block_dots" (keep
  # also the outputs of its matmuls without batch dimensions, the Dense
  # layers: jax.checkpoint_policies.dots_with_no_batch_dims_saveable).
  m.remat = "none"
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


def custom_model(name: str = "") -> config_dict.ConfigDict:
  """The ``model`` group of your own model (docs/extending.md).

  Args:
    name: a name given to ``extensions.register_model`` or
      ``"package.module:attribute"`` (its builder returns an
      ``extensions.Model``).
  """
  m = config_dict.ConfigDict()
  # Registered name or "package.module:attribute" of the model's builder.
  m.name = name
  # Keyword arguments of the builder (add fields in the config file).
  m.options = config_dict.ConfigDict()
  # The loss takes a fresh PRNG key per worker and step in training
  # (dropout); False: it is called with key None.
  m.needs_key = False
  return m


MODELS = {"gpt": gpt_model, "cnn": cnn_model}


def model_group(model: str) -> config_dict.ConfigDict:
  """The ``model`` group of ``"gpt"``, ``"cnn"`` or your own model (any
  other name: :func:`custom_model`)."""
  return MODELS[model]() if model in MODELS else custom_model(model)


def add_parallel_fields(c: config_dict.ConfigDict) -> None:
  """The method, the workers and how they communicate (top-level fields)."""
  # "all_reduce" (exact gradient average, then AdamW; paper Alg. 2),
  # "decentralized" (gossip over `topology`, DAdam / AccumAdamW; Alg. 1, 4),
  # or a local-update method: "local_sgd", "diloco", "decentralized_diloco",
  # "streaming_diloco", "sgp" (see runner.methods and the fields below).
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
  # Devices per worker D: each worker spans D devices (mesh axis "inner",
  # single-process runs only); the run needs n_workers * D devices and a
  # local batch global_batch / n_workers divisible by D.
  c.devices_per_worker = 1
  # Workers per device K: K workers share each device (vmapped; gossip
  # between two of them is a copy), so n_workers / K devices simulate
  # n_workers workers. Divides n_workers; devices_per_worker must then be 1.
  c.workers_per_device = 1
  # How a worker of D > 1 devices holds its state (decentral_jax.parallel.layouts):
  # "fsdp" (parameters, gradients and optimizer state split over its
  # devices; leaves with no dimension divisible by D stay replicated, with
  # a warning naming them) or "data" (replicated; only the batch is split).
  c.worker_layout = "fsdp"
  # dtype on the wire of the synchronisation: "" (the values' own dtype),
  # "bfloat16", "float16" or "float32": gossiped parameters (decentralized,
  # decentralized_diloco, sgp), Local SGD's averaged parameters and
  # (Streaming) DiLoCo's pseudo-gradients (summed in float32). all_reduce
  # does not read it.
  c.comm_dtype = ""
  # Gossip bucket size in bytes: same-dtype parameters are sent in buckets
  # of at most this size, one collective each (as PyTorch DDP, 25 MB); 0 =
  # one per leaf (faster on CPU). Bit-identical results either way.
  c.bucket_bytes = 0
  # How the gossip round is chosen: "switch" (one compile; lax.switch on
  # step % period inside the step) or "static" (one compile per distinct
  # round, chosen on the host: no conditional around the collectives, so
  # XLA can overlap them with the forward/backward on GPUs; see
  # docs/gpu_overlap.md). "auto": "static" on accelerators when the method
  # allows it (decentralized with gossip_every 1, sgp), else "switch"
  # (XLA:CPU runs collectives synchronously: nothing to overlap there).
  c.gossip_rounds = "auto"
  # Exact global parameter average (pmean) every this many steps; 0 = never.
  c.global_avg_interval = 0
  # decentralized: gossip every this many steps, local steps in between
  # (local D-SGD / DAdam); 1 = every step.
  c.gossip_every = 1


def outer_optimizer_group() -> config_dict.ConfigDict:
  """The ``outer_optimizer`` group: the optimizer DiLoCo applies to the
  pseudo-gradient ``theta - mean(x)`` every sync period."""
  g = config_dict.ConfigDict()
  # "sgd" (with momentum / Nesterov) or "adam"; Local SGD is sgd, lr 1.
  # DiLoCo's default: Nesterov SGD, lr 0.7, momentum 0.9.
  g.name = "sgd"
  g.lr = 0.7
  g.momentum = 0.9
  g.nesterov = True
  return g


def add_local_update_fields(c: config_dict.ConfigDict) -> None:
  """The local-update methods' fields (local_sgd, diloco,
  decentralized_diloco, streaming_diloco, desloc_adam): sync periods, outer
  optimizer, fragments and the overlapped outer step."""
  # Sync period H in steps: workers synchronise every H inner steps
  # (desloc_adam: K_x, the period of the parameters' average).
  c.sync_every = 10
  # Outer optimizer applied to the pseudo-gradient theta - mean(x) (DiLoCo).
  c.outer_optimizer = outer_optimizer_group()
  # streaming_diloco: fragments P (each synchronises every H steps, offset
  # p H / P), overlap tau (steps between a fragment's send and its merge;
  # tau * P < H) and the merge weight alpha in [0, 1]:
  # x <- alpha x + (1 - alpha) theta.
  c.num_fragments = 1
  c.overlap_steps = 0
  c.merge_alpha = 0.0
  # diloco, decentralized_diloco, streaming_diloco (per fragment, with
  # overlap_steps=0): the outer step overlapped with the next
  # round (Kale et al., arXiv 2502.12996): "none" (wait for the reduction of
  # the pseudo-gradients), "delayed" (step on the reduction of
  # outer_latency rounds ago) or "eager" (the same, this worker's stale
  # pseudo-gradient replaced by its fresh one; per-worker theta, evaluated
  # as their mean). trickle_reduction spreads each reduction over the next
  # round's inner steps, one slice per step outside any conditional, so that
  # XLA can overlap it with the forward/backward (a time-varying topology
  # needs trickle_reduction=False). Read only with outer_overlap != "none".
  c.outer_overlap = "none"
  c.outer_latency = 1
  c.trickle_reduction = True


def compression_group() -> config_dict.ConfigDict:
  """The ``compression`` group: what is sent and how (docs/running.md,
  "Compressed communication"; :mod:`decentral_jax.comm.compress`)."""
  g = config_dict.ConfigDict()
  # What is sent: "none" (uncompressed: the methods as without this group,
  # bit for bit), "int8", "fp8" (e4m3), "int4", "fp4" (e2m1; two values per
  # byte) with one float32 scale per block, or "topk" (the largest
  # magnitudes of each chunk, float32 values + int16 indices).
  # decentralized: CHOCO-gossip of the parameters (static topologies,
  # gossip_every 1); local_sgd, diloco, streaming_diloco: the
  # pseudo-gradients' all-reduce (topk: an all-gather of indices and
  # values, as SparseLoCo).
  g.format = "none"
  # Values per float32 scale, or per top-k chunk (>= 2; even for 4-bit).
  g.block = 256
  # topk: share of each chunk sent, in (0, 1].
  g.fraction = 0.01
  # local_sgd, diloco, streaming_diloco: keep each worker's compression
  # residual e and send Q(error_decay * e + pseudo-gradient); error_decay in
  # (0, 1] (SparseLoCo: 0.95 with top-k and an outer SGD without momentum).
  g.error_feedback = False
  g.error_decay = 1.0
  # decentralized (CHOCO): consensus step gamma in (0, 1]; smaller for
  # coarser formats.
  g.consensus_step = 0.5
  return g


def faults_group() -> config_dict.ConfigDict:
  """The ``faults`` group: slow and failing workers (docs/faults.md, "Slow
  and failing workers"); local_sgd and diloco only."""
  g = config_dict.ConfigDict()
  # Simulate the schedule below (False: every worker alive at full speed,
  # the methods' plain transforms).
  g.enabled = False
  # Probability that a live worker fails at a step, in [0, 1].
  g.failure_rate = 0.0
  # Mean steps a failed worker stays dead (geometric), >= 1.
  g.mean_downtime = 10.0
  # Fraction of the workers that run slow for the whole run, and their
  # speed in (0, 1] (steps' worth of work per step).
  g.slow_fraction = 0.0
  g.slow_speed = 0.5
  # A JSON trace of dead and slow intervals instead of the rates ("" none).
  g.trace = ""
  # Seed of the schedule (independent of `seed`), in [0, 2**32 - 1].
  g.seed = 0
  # "deadline" (a slow worker completes the steps its speed allows) or
  # "wait" (the others wait for it: every live worker takes every step).
  g.stragglers = "deadline"
  # Least number of live workers that did some work for an outer step.
  g.min_quorum = 1
  # "proceed" (outer step with the quorum) or "rollback" (a round with a
  # failure is not committed; the workers go back to theta).
  g.on_failure = "proceed"
  # A worker that comes back: "copy_theta", "copy_mean" (of the live
  # workers) or "keep" (its stale parameters); counters always from the
  # group.
  g.rejoin = "copy_theta"
  return g


def add_run_fields(c: config_dict.ConfigDict) -> None:
  """Run length, batch, seed and gradient clipping (top-level fields)."""
  # Number of optimizer steps.
  c.steps = 300
  # Sequences (images) per step over all workers; split evenly (must be
  # divisible by n_workers).
  c.global_batch = 64
  # Micro-batches k per step (gradient accumulation inside a step): each
  # worker's local batch is split into k micro-batches whose forward and
  # backward passes run one after another, their gradients averaged (the
  # whole local batch's gradient up to float32 rounding; activation memory
  # / k). k divides the local batch per device, global_batch / (n_workers
  # * devices_per_worker). Not optimizer.accum_steps (AccumAdam's window).
  c.micro_batches = 1
  # Seed of the initial parameters, the data order and dropout, in
  # [0, 2**32 - 1].
  c.seed = 0
  # Global-norm clip of each worker's local gradient (of the averaged gradient
  # under all_reduce); 0 disables.
  c.grad_clip = 1.0


def add_record_fields(c: config_dict.ConfigDict) -> None:
  """Evaluation, logging, checkpoints and the output directory."""
  # Evaluate the averaged model every this many steps (and at the end);
  # 0 = only at the end.
  c.eval_interval = 30
  # Validation batches per evaluation, each of global_batch sequences.
  c.eval_batches = 4
  # Write a metrics line every this many steps (and at the last step).
  c.log_interval = 10
  # When the consensus distance of a log step is measured (the same value
  # either way): "log_step" (in that step, after the update, inside a
  # conditional: its All-Reduce waits for the whole step) or "next_step"
  # (at the top of the following step, from its input: the All-Reduce can
  # run during that step's forward/backward). "auto": "next_step" on
  # accelerators, "log_step" on CPU (one compiled step fewer).
  c.consensus_at = "auto"
  # Save a checkpoint every this many steps (and at the end); 0 = only at the
  # end.
  c.checkpoint_interval = 100
  # Number of checkpoints kept in <workdir>/checkpoints.
  c.keep_checkpoints = 2
  # Also write TensorBoard event files (needs the tensorboardX package).
  c.tensorboard = False
  # Also send every metrics record to an experiment tracker: "" (none) or
  # "wandb" (Weights & Biases; project, mode and directory from its WANDB_*
  # variables, e.g. WANDB_MODE=offline; needs the wandb package).
  c.tracker = ""
  # Output directory; the --workdir flag takes precedence.
  c.workdir = config_dict.placeholder(str)


def optimizer_group() -> config_dict.ConfigDict:
  """The ``optimizer`` group: each worker's AdamW or AccumAdamW."""
  g = config_dict.ConfigDict()
  # "adamw" (All-Reduce AdamW / DAdam when decentralized) or "accum_adamw"
  # (AccumAdamW).
  g.name = "accum_adamw"
  # Adam first- and second-moment decays, in [0, 1).
  g.b1 = 0.9
  g.b2 = 0.95
  # Added to the denominator outside the square root, in [0, 1] (larger
  # turns Adam into a rescaled SGD and is refused as a typo).
  g.eps = 1e-8
  # Decoupled weight decay, applied to parameters with ndim >= 2 only, in
  # [0, 1e3] (multiplied by the learning rate).
  g.weight_decay = 0.1
  # AccumAdam window T (moments refreshed every T steps); must be 1 for adamw.
  g.accum_steps = 4
  # How accum_adamw reads b1 and b2: "per_window" (the paper's and
  # decent-dp's: the moments decay by b once per window of accum_steps
  # steps, a horizon accum_steps times Adam's) or "per_step" (they decay by
  # b**accum_steps per window: Adam's horizon in steps).
  g.beta_convention = "per_window"
  return g


def schedule_group() -> config_dict.ConfigDict:
  """The ``schedule`` group: the learning rate by step."""
  g = config_dict.ConfigDict()
  # "warmup_cosine" (linear warmup from peak_lr / warmup_steps, then cosine to
  # final_lr at `steps`), "inverse_sqrt" (paper Sec. 2.3 Transformer rule) or
  # "constant".
  g.name = "warmup_cosine"
  # Peak learning rate, in (0, 1e3] (as the learners' --inner-lr; a larger
  # one only diverges).
  g.peak_lr = 1.5e-3
  # Linear-warmup length in steps (longer than `steps` is allowed, with a
  # warning: the learning rate then never reaches peak_lr).
  g.warmup_steps = 30
  # Learning rate reached at the last step (warmup_cosine only), in
  # [0, peak_lr] and at most 1e3.
  g.final_lr = 1.5e-4
  return g


def data_group(model: str = "gpt") -> config_dict.ConfigDict:
  """The ``data`` group of a ``"gpt"`` or ``"cnn"`` model (its default
  source differs), or of your own model (any other name: a ``source``
  naming the data builder and its ``options``)."""
  g = config_dict.ConfigDict()
  if model not in MODELS:
    # Registered name or "package.module:attribute" of the data builder
    # (it returns an extensions.Data).
    g.source = ""
    # Keyword arguments of the builder (add fields in the config file).
    g.options = config_dict.ConfigDict()
    return g
  # "pydoc" (bundled text), "text_file" (bytes of `path`), "token_bins"
  # (nanoGPT train.bin/val.bin in directory `path`) or "fashion_mnist".
  g.source = "pydoc" if model == "gpt" else "fashion_mnist"
  # File or directory for text_file / token_bins / fashion_mnist.
  g.path = config_dict.placeholder(str)
  # Fraction of a byte corpus (pydoc, text_file) held out for validation.
  g.val_fraction = 0.1
  return g


def distributed_group() -> config_dict.ConfigDict:
  """The ``distributed`` group: joining a multi-process job (README,
  "Running on a cluster")."""
  g = config_dict.ConfigDict()
  # Join a multi-process job with jax.distributed.initialize (one process per
  # host). Jobs started by `srun` with several tasks join even when False.
  g.enabled = False
  # "host:port" of process 0's coordinator; "" to detect it on SLURM.
  g.coordinator_address = ""
  # Total number of processes; 0 to detect it on SLURM.
  g.num_processes = 0
  # This process's id in [0, num_processes); -1 to detect it on SLURM.
  g.process_id = -1
  # Seconds without a heartbeat after which a process counts as dead and the
  # others stop with an error instead of hanging.
  g.heartbeat_timeout_seconds = 100
  # Seconds every process waits at start-up for all num_processes to join;
  # then it exits with an error naming the coordinator address.
  g.initialization_timeout_seconds = 120
  return g
