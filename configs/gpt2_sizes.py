"""gpt2_sizes: the paper's GPT-2 recipe at three model sizes.

The run of ``configs/gpt2_small_owt.py:decentralized`` (AccumAdamW on the
alternating exponential ring, bfloat16 compute, float32 parameters, 30
sequences of 1024 tokens per worker, nanoGPT token bins in ``data.path``)
with the model of one of (select with ``--config
configs/gpt2_sizes.py:VARIANT``):

* ``124m``: GPT-2 small, 12 layers x 768 wide, 12 heads (124.4M
  parameters);
* ``350m``: GPT-2 medium, 24 layers x 1024 wide, 16 heads (354.8M);
* ``1.3b``: GPT-3 XL's shape (Brown et al. 2020, Table 2.1: 24 layers x
  2048 wide, 16 heads) at GPT-2's context of 1024 and vocabulary 50304
  (1.31B; GPT-2 XL, 48 x 1600 and 1.56B, is the other common choice).

Parameters (tied embeddings, no biases): ``12 L d^2 + 50304 d + 1024 d``
plus ``(2 L + 1) d`` LayerNorm scales; at 40% MFU on an H100 (989 TFLOP/s
bfloat16) a step of 30 x 1024 tokens takes about 66 ms (124M), 189 ms
(350M) and 658 ms (1.3B) of compute per worker (matmul FLOPs: ``6 N`` per
token plus ``12 L T d`` for attention). docs/gpu_overlap.md and
benchmarks/studies/19_overlap_at_scale.md compile them for 8 x H100 (one
node) and 2 x 8 (two nodes) without a GPU and say which fit in 80 GB.
"""

from __future__ import annotations

import importlib.util
import os

from ml_collections import config_dict

#: Variant -> (layers, width, heads).
SIZES = {"124m": (12, 768, 12), "350m": (24, 1024, 16),
         "1.3b": (24, 2048, 16)}


def _small_owt():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "gpt2_small_owt.py")
  spec = importlib.util.spec_from_file_location("gpt2_small_owt", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(variant: str = "124m") -> config_dict.ConfigDict:
  """The ``decentralized`` GPT-2 small run with the model of ``variant``.

  Raises:
    ValueError: an unknown variant (the message lists them).
  """
  if variant not in SIZES:
    raise ValueError(f"unknown gpt2_sizes variant {variant!r}; use one of "
                     f"{', '.join('configs/gpt2_sizes.py:' + v for v in SIZES)}.")
  c = _small_owt().get_config("decentralized")
  c.model.n_layer, c.model.n_embd, c.model.n_head = SIZES[variant]
  return c
