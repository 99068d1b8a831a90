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

from decentral_jax.runner import config as config_lib

VARIANTS = ("decentralized", "all_reduce")


def get_config(variant: str = "decentralized") -> config_dict.ConfigDict:
  """Returns the configuration of the given variant (see module docstring).

  Fields not set here keep the defaults of
  ``decentral_jax.runner.config.base_config``; every field is described by
  its group's builder in ``decentral_jax.runner.config_groups``.
  """
  if variant not in VARIANTS:
    raise ValueError(f"unknown gpt2_small_owt variant {variant!r}; use "
                     f"configs/gpt2_small_owt.py:decentralized or :all_reduce.")
  decentralized = variant == "decentralized"
  c = config_lib.base_config("gpt")
  # "decentralized" or "all_reduce", as the variant.
  c.algorithm = variant
  c.n_workers = 16
  if decentralized:  # All-Reduce neither gossips nor groups nodes
    # 4 nodes of 4 GPUs; AER alternates intra-node and two-node averages.
    c.topology = "alternating_exp_ring"
    c.workers_per_node = 4
    # One compile per distinct round: no conditional around the
    # collectives, so XLA can overlap the gossip with the forward/backward
    # (the paper's overlap).
    c.gossip_rounds = "static"
  # The paper's decentralized run averages exactly at every evaluation.
  c.global_avg_interval = 1000 if decentralized else 0
  # Run length, batch (30 sequences per worker x 16), seed, evaluation.
  c.steps = 600_000
  c.global_batch = 480
  c.seed = 42
  c.eval_interval = 1000
  c.eval_batches = 20
  c.checkpoint_interval = 5000
  # AccumAdamW with b2 0.98 for decentralized training, AdamW b2 0.95.
  c.optimizer.name = "accum_adamw" if decentralized else "adamw"
  c.optimizer.b2 = 0.98 if decentralized else 0.95
  c.optimizer.accum_steps = 8 if decentralized else 1
  # Linear warmup over 2000 steps, cosine from 6e-4 to 6e-5.
  c.schedule.peak_lr = 6e-4
  c.schedule.warmup_steps = 2000
  c.schedule.final_lr = 6e-5
  # nanoGPT GPT-2 small: 50257 token ids padded to a multiple of 64.
  c.model.vocab_size = 50304
  # Context 1024; 12 blocks, 12 heads, width 768; bfloat16 compute.
  c.model.block_size = 1024
  c.model.n_layer = 12
  c.model.n_head = 12
  c.model.n_embd = 768
  c.model.dtype = "bfloat16"
  # nanoGPT train.bin / val.bin in data.path (required); the validation
  # split is val.bin.
  c.data.source = "token_bins"
  c.data.val_fraction = 0.0
  return c
