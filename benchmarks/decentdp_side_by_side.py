"""PyTorch + decent-dp side of the side-by-side benchmark (one rank).

Launched by ``benchmarks/bench_vs_decentdp.py`` with ``torchrun`` (8 gloo
processes on CPU, ``OMP_NUM_THREADS=1``); not part of the library and not
run in CI. Needs the optional packages ``torch`` and ``decent-dp`` (0.2.3)
and ``loguru``: ``pip install torch==2.13.0 decent-dp loguru``.

The model mirrors ``decentral_jax.models.gpt.GPT`` at the benchmark size:
byte vocabulary (256), 2 pre-LayerNorm blocks of width 128 with 4 heads,
context 64, GELU (tanh) MLP of width 512, no biases, token embedding tied to
the output head; causal attention uses PyTorch's fused
``scaled_dot_product_attention``. Each rank trains on its own random
windows of the bundled CPython documentation text (byte tokens), local batch
``--local_batch`` sequences, with decent-dp's ``AccumAdamW``
(``accum_iter=4``) on its ``one-peer-exp`` topology, as
``DecentralizedDataParallel`` runs it (gossip overlapped with the backward
pass, one bucket).

Rank 0 prints one JSON line: ``{"side": "decent-dp", "tokens_per_s": ...,
"ms_per_step": ..., "steps": ..., "world_size": ...}``; tokens/s counts the
tokens of all ranks (world_size x local_batch x context per step) over the
wall time of the timed steps (after ``--warmup`` steps; a barrier before
and after); ``tokens_per_cpu_s`` divides by the CPU time (user + system) of
all ranks over the same steps.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import numpy as np

try:
  import torch
  import torch.distributed as dist
  import torch.nn.functional as F
  from torch import nn
except ImportError as e:  # optional, not in requirements.txt
  sys.exit(f"{e}: this script needs the optional packages torch and "
           "decent-dp (pip install torch==2.13.0 decent-dp loguru).")


class Block(nn.Module):
  """Pre-LN transformer block: causal self-attention and a 4x GELU MLP."""

  def __init__(self, width: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln_1 = nn.LayerNorm(width, bias=False)
    self.c_attn = nn.Linear(width, 3 * width, bias=False)
    self.attn_proj = nn.Linear(width, width, bias=False)
    self.ln_2 = nn.LayerNorm(width, bias=False)
    self.c_fc = nn.Linear(width, 4 * width, bias=False)
    self.mlp_proj = nn.Linear(4 * width, width, bias=False)

  def forward(self, x):
    b, t, c = x.shape
    q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
    q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
               for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
    return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)),
                                    approximate="tanh"))


class TinyGPT(nn.Module):
  """Byte-level causal LM with tied input/output embedding."""

  def __init__(self, vocab=256, context=64, layers=2, width=128, heads=4):
    super().__init__()
    self.wte = nn.Embedding(vocab, width)
    self.wpe = nn.Embedding(context, width)
    self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
    self.ln_f = nn.LayerNorm(width, bias=False)
    for name, p in self.named_parameters():
      if p.dim() >= 2:
        std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") \
            else 0.02
        nn.init.normal_(p, std=std)

  def forward(self, idx):
    t = idx.shape[1]
    x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))[None]
    for blk in self.blocks:
      x = blk(x)
    return self.ln_f(x) @ self.wte.weight.t()


def corpus() -> np.ndarray:
  from pydoc_data import topics
  text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def parse_args(argv=None):
  """The flags, bounded before any work (one ``error:`` line)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
  count, real = flag_types.integer, flag_types.real  # bounded flag types
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=count(1, 10**6), default=30)
  ap.add_argument("--warmup", type=count(0, 10**6), default=5)
  ap.add_argument("--local_batch", type=count(1, 10**6), default=8)
  ap.add_argument("--context", type=count(1, 10**6), default=64)
  ap.add_argument("--accum_steps", type=count(1, 10**6), default=4)
  ap.add_argument("--topology", default="one-peer-exp",
                  help="a decent-dp topology name")
  ap.add_argument("--lr", type=real(0, 10, open_lo=True), default=3e-3)
  return ap.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  from decent_dp import ddp as ddp_lib
  from decent_dp import optim as optim_lib
  from decent_dp.utils import initialize_dist

  torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
  rank, world = initialize_dist()
  torch.manual_seed(0)
  model = TinyGPT(context=args.context)
  optim_fn = functools.partial(optim_lib.optim_fn_accum_adamw, lr=args.lr,
                               beta1=0.9, beta2=0.95, weight_decay=0.1,
                               accum_iter=args.accum_steps)
  model = ddp_lib.DecentralizedDataParallel(model, optim_fn,
                                            topology=args.topology)
  data = torch.from_numpy(corpus().astype(np.int64))
  gen = torch.Generator().manual_seed(1234 + rank)
  t = args.context

  def step():
    starts = torch.randint(0, len(data) - t - 1, (args.local_batch,),
                           generator=gen)
    window = torch.stack([data[s:s + t + 1] for s in starts.tolist()])
    logits = model(window[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           window[:, 1:].reshape(-1))
    loss.backward()  # decent-dp's hooks update and gossip here
    return loss

  model.train()
  for _ in range(args.warmup):
    loss = step()
  dist.barrier()
  t0 = time.perf_counter()
  c0 = time.process_time()
  for _ in range(args.steps):
    loss = step()
  cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
  dist.barrier()
  elapsed = time.perf_counter() - t0
  dist.all_reduce(cpu)  # CPU seconds of all ranks during the timed steps
  if rank == 0:
    tokens = world * args.local_batch * t * args.steps
    print(json.dumps({
        "side": "decent-dp", "tokens_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / args.steps, "steps": args.steps,
        "cpu_s_per_step": float(cpu) / args.steps,
        "tokens_per_cpu_s": tokens / float(cpu),
        "world_size": world, "final_loss_rank0": float(loss.detach()),
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
    }), flush=True)
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
