"""gpt2_small_owt: the paper's GPT-2 small / OpenWebText run (Sec. 5, App. D).

Model: nanoGPT GPT-2 small (12 layers, 12 heads, 768 wide, no bias, dropout
0, vocabulary 50304, context 1024). 16 workers, 4 per node; global batch
480 sequences x 1024 tokens (30 per worker); 600k steps; learning rate 6e-4
with 2000 linear warmup steps and cosine decay to 6e-5; clip 1.0; weight decay
0.1 on parameters with ndim >= 2; seed 42.

Two variants (select with ``--config configs/gpt2_small_owt.py:VARIANT``):

* ``decentralized`` (default): AccumAdamW, b2 0.98, accum_steps 8, on the
  alternating exponential ring (AER), exact global average every 1000 steps.
* ``all_reduce``: All-Reduce AdamW, b2 0.95.

Data: nanoGPT-format ``train.bin`` / ``val.bin`` (uint16 GPT-2 token ids) in
``data.path``. Produce them with nanoGPT's ``data/openwebtext/prepare.py``
(downloads OpenWebText from the Hugging Face hub and tokenises it with
tiktoken's GPT-2 encoding; about 17 GB and 9B tokens), then pass
``--config.data.path=/path/to/openwebtext``. The run needs 16 accelerators
(the paper used 16 A100 80 GB); a smoke test on CPU shrinks everything, e.g.
``--config.model.n_layer=2 --config.model.n_embd=64 --config.model.n_head=2
--config.model.block_size=64 --config.global_batch=32 --config.n_workers=8
--config.workers_per_node=2 --config.steps=20``.
"""

from __future__ import annotations

from ml_collections import config_dict

VARIANTS = ("decentralized", "all_reduce")


def get_config(variant: str = "decentralized") -> config_dict.ConfigDict:
  """Returns the configuration of the given variant (see module docstring)."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown gpt2_small_owt variant {variant!r}; use "
                     f"configs/gpt2_small_owt.py:decentralized or :all_reduce.")
  decentralized = variant == "decentralized"
  c = config_dict.ConfigDict()

  # --- Parallel training ---------------------------------------------------
  # "all_reduce" (exact gradient average, then AdamW; paper Alg. 2) or
  # "decentralized" (gossip over `topology`, DAdam / AccumAdamW; Alg. 1, 4).
  c.algorithm = variant
  # Gossip topology (decentral_jax.topology.NAMES); ignored by all_reduce.
  c.topology = "alternating_exp_ring"
  # Number of workers n (one per device): 4 nodes of 4 GPUs in the paper.
  c.n_workers = 16
  # Workers per node L (AER alternates intra-node and two-node averages).
  c.workers_per_node = 4
  # dtype in which gossiped parameters are sent: "" or "bfloat16".
  c.comm_dtype = ""
  # How the gossip round is chosen: "static" compiles one step per distinct
  # round (chosen on the host), leaving no conditional around the
  # collectives so XLA can overlap the gossip with the forward/backward pass
  # (the paper's overlap); "switch" compiles once and picks it in-graph.
  c.gossip_rounds = "static"
  # Exact global parameter average every this many steps (the paper's
  # decentralized run averages at every evaluation, 1000 steps); 0 = never.
  c.global_avg_interval = 1000 if decentralized else 0

  # --- Run length, batch, regularisation -----------------------------------
  # Number of optimizer steps.
  c.steps = 600_000
  # Sequences per step over all workers (30 per worker x 16).
  c.global_batch = 480
  # Seed of the initial parameters, the data order and dropout.
  c.seed = 42
  # Global-norm clip of each worker's local gradient (of the averaged gradient
  # under all_reduce); 0 disables.
  c.grad_clip = 1.0

  # --- Evaluation, logging, checkpoints ------------------------------------
  # Evaluate the averaged model every this many steps (and at the end).
  c.eval_interval = 1000
  # Validation batches per evaluation, each of global_batch sequences.
  c.eval_batches = 20
  # Write a metrics line every this many steps.
  c.log_interval = 10
  # Save a checkpoint every this many steps (and at the end).
  c.checkpoint_interval = 5000
  # Number of checkpoints kept in <workdir>/checkpoints.
  c.keep_checkpoints = 2
  # Also write TensorBoard event files (needs the tensorboardX package).
  c.tensorboard = False
  # Output directory; the --workdir flag takes precedence.
  c.workdir = config_dict.placeholder(str)

  # --- Optimizer -------------------------------------------------------------
  c.optimizer = config_dict.ConfigDict()
  # "adamw" (All-Reduce AdamW / DAdam) or "accum_adamw" (AccumAdamW).
  c.optimizer.name = "accum_adamw" if decentralized else "adamw"
  # Adam moment decays (b2 0.98 for decentralized training, 0.95 otherwise).
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.98 if decentralized else 0.95
  # Added to the denominator outside the square root.
  c.optimizer.eps = 1e-8
  # Decoupled weight decay on parameters with ndim >= 2.
  c.optimizer.weight_decay = 0.1
  # AccumAdam window T; 1 for adamw.
  c.optimizer.accum_steps = 8 if decentralized else 1

  # --- Learning-rate schedule -----------------------------------------------
  c.schedule = config_dict.ConfigDict()
  # Linear warmup from peak_lr / warmup_steps, then cosine to final_lr.
  c.schedule.name = "warmup_cosine"
  # Peak learning rate.
  c.schedule.peak_lr = 6e-4
  # Linear-warmup length in steps.
  c.schedule.warmup_steps = 2000
  # Learning rate at the last step.
  c.schedule.final_lr = 6e-5

  # --- Model ----------------------------------------------------------------
  c.model = config_dict.ConfigDict()
  # "gpt" (decentral_jax.models.gpt).
  c.model.name = "gpt"
  # GPT-2's 50257 token ids padded to a multiple of 64.
  c.model.vocab_size = 50304
  # Context length T in tokens.
  c.model.block_size = 1024
  # Transformer blocks, attention heads, width.
  c.model.n_layer = 12
  c.model.n_head = 12
  c.model.n_embd = 768
  # No biases (nanoGPT's setting for this run).
  c.model.bias = False
  # Dropout rate.
  c.model.dropout = 0.0
  # Compute dtype: "float32" or "bfloat16" (parameters stay float32).
  c.model.dtype = "bfloat16"

  # --- Data -----------------------------------------------------------------
  c.data = config_dict.ConfigDict()
  # nanoGPT train.bin / val.bin token files.
  c.data.source = "token_bins"
  # Directory holding train.bin and val.bin (required).
  c.data.path = config_dict.placeholder(str)
  # Unused for token_bins (the validation split is val.bin).
  c.data.val_fraction = 0.0

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
