"""gpt_tiny: a 2-layer byte-level GPT on bundled English text (the quick job).

Data: nothing to download. The corpus is the English documentation text that
ships with CPython (``pydoc_data.topics``, about 0.9 MB), read as bytes
(vocabulary 256); the last 10% is the validation split. To train on your own
text instead: ``--config.data.source=text_file --config.data.path=FILE``.

Default run: 8 workers (simulated CPU devices if needed), AccumAdamW
(``accum_steps`` 4) on the one-peer exponential graph, 300 steps of 64
sequences x 64 tokens; a few minutes on a 2-core CPU::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/gpt_tiny

All-Reduce AdamW baseline on the same model and data::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/ar \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.schedule.peak_lr=3e-3 \\
    --config.schedule.final_lr=3e-4
"""

from __future__ import annotations

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  """Returns the gpt_tiny configuration."""
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
  # dtype in which gossiped parameters are sent: "" (their own dtype) or
  # "bfloat16".
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
  # Sequences per step over all workers; split evenly (must be divisible by
  # n_workers).
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
  # "adamw" (DAdam when decentralized) or "accum_adamw" (AccumAdamW).
  c.optimizer.name = "accum_adamw"
  # Adam first- and second-moment decays.
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
  # Peak learning rate: tuned on a shared grid for this model (BENCHMARKS.md,
  # section 3): 1.5e-3 for AccumAdamW, 3e-3 for AdamW (All-Reduce and DAdam).
  c.schedule.peak_lr = 1.5e-3
  # Linear-warmup length in steps.
  c.schedule.warmup_steps = 30
  # Learning rate reached at the last step (warmup_cosine only).
  c.schedule.final_lr = 1.5e-4

  # --- Model ----------------------------------------------------------------
  c.model = config_dict.ConfigDict()
  # "gpt" (decentral_jax.models.gpt) or "cnn".
  c.model.name = "gpt"
  # Vocabulary size V (256 for byte-level text).
  c.model.vocab_size = 256
  # Context length T in tokens.
  c.model.block_size = 64
  # Transformer blocks, attention heads (must divide n_embd), width.
  c.model.n_layer = 2
  c.model.n_head = 4
  c.model.n_embd = 128
  # Biases in Dense and LayerNorm layers.
  c.model.bias = False
  # Dropout rate (0 = none; dropout keys differ per worker and per step).
  c.model.dropout = 0.0
  # Compute dtype: "float32" or "bfloat16" (parameters stay float32).
  c.model.dtype = "float32"

  # --- Data -----------------------------------------------------------------
  c.data = config_dict.ConfigDict()
  # "pydoc" (bundled text), "text_file" (bytes of `path`), "token_bins"
  # (nanoGPT train.bin/val.bin in directory `path`) or "fashion_mnist".
  c.data.source = "pydoc"
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
  return c
