"""A nanoGPT-style decoder-only transformer language model in Flax linen.

Architecture (GPT-2): learned token and position embeddings, ``n_layer``
pre-LayerNorm blocks of causal multi-head self-attention and a 4x GELU MLP,
a final LayerNorm, and an output head tied to the token embedding
(``logits = h @ wte.T`` via :meth:`flax.linen.Embed.attend`). Weights are
initialised as in GPT-2: normal(0.02) for every matrix and embedding, zeros for
biases, and normal(0.02 / sqrt(2 * n_layer)) for the two residual projections
of each block.

Parameters are an ordinary pytree (``{"wte", "wpe", "h_0", ..., "ln_f"}``),
so they can be stacked per worker and passed through ``jax.shard_map``.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners", 2019
  (GPT-2). Karpathy, nanoGPT ``model.py`` (the configuration used for the
  paper's GPT-2 small / OpenWebText runs: 12 layers, 12 heads, 768 wide,
  no bias, dropout 0, vocab 50304, context 1024).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decentral_jax import checks

PyTree = Any
#: Values of :attr:`GPTConfig.remat`.
REMAT_MODES = ("none", "block", "block_dots")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Hyperparameters of :class:`GPT` (defaults: GPT-2 small as in the paper).

  Attributes:
    vocab_size: number of token ids ``V`` (50304 = GPT-2's 50257 padded to a
      multiple of 64; 256 for byte-level text).
    block_size: maximum context length ``T`` in tokens (size of the position
      embedding).
    n_layer: number of transformer blocks.
    n_head: attention heads per block; must divide ``n_embd``.
    n_embd: model width ``C``.
    bias: whether Dense and LayerNorm layers have biases.
    dropout: dropout rate on attention weights and residual branches; with
      0.0 no ``"dropout"`` RNG is ever needed.
    dtype: compute dtype of activations (logits are returned as float32).
    param_dtype: dtype of the parameters (float32, or bfloat16 for half
      their bytes and those of their gradients and of an optimizer state
      kept in their dtype).
    remat: activation checkpointing of each block (:data:`REMAT_MODES`):
      ``"none"`` keeps every activation for the backward pass;
      ``"block"`` keeps only each block's input and recomputes the block
      during the backward pass (``flax.linen.remat``); ``"block_dots"``
      also keeps the outputs of matmuls without batch dimensions (the
      Dense layers; policy
      ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``), so
      only attention scores, softmax, GELU and LayerNorm are recomputed.
      The values are those of ``"none"`` (up to the compiler's rounding);
      parameter names are unchanged.
  """
  vocab_size: int = 50304
  block_size: int = 1024
  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  bias: bool = False
  dropout: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: str = "none"

  def __post_init__(self):
    """Checks the fields.

    Raises:
      ValueError: a size not an int >= 1, ``n_head`` not dividing
        ``n_embd``, ``bias`` not a bool, ``dropout`` not a number in [0,
        1), ``dtype`` or ``param_dtype`` not a floating dtype, ``remat``
      not one of :data:`REMAT_MODES`.
    """
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
      checks.check_int(f"GPTConfig.{name}", getattr(self, name), minimum=1)
    if self.n_embd % self.n_head:
      raise ValueError(f"GPTConfig.n_head={self.n_head} must divide n_embd="
                       f"{self.n_embd}; choose n_embd as a multiple of n_head.")
    checks.check_bool("GPTConfig.bias", self.bias)
    checks.check_float("GPTConfig.dropout", self.dropout, minimum=0.0,
                       maximum=1.0, open_max=True)
    checks.check_float_dtype("GPTConfig.dtype", self.dtype, allow_none=False)
    checks.check_float_dtype("GPTConfig.param_dtype", self.param_dtype,
                             allow_none=False)
    checks.check_choice("GPTConfig.remat", self.remat, REMAT_MODES)


def _normal(std: float):
  return nn.initializers.normal(stddev=std)


def _residual_out(cfg: GPTConfig, y: jax.Array, width: int,
                  deterministic: bool) -> jax.Array:
  """The ``c_proj`` projection to ``width`` and the residual dropout.

  GPT-2's scaled init for projections onto the residual stream: std
  ``0.02 / sqrt(2 n_layer)``. Called inside a module's ``nn.compact``
  method, whose layers (``c_proj``, ``Dropout_*``) they become.
  """
  resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
  y = nn.Dense(width, use_bias=cfg.bias, dtype=cfg.dtype,
               param_dtype=cfg.param_dtype, kernel_init=_normal(resid_std), name="c_proj")(y)
  return nn.Dropout(cfg.dropout)(y, deterministic=deterministic)


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position t attends to positions <= t."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    """Maps ``x`` [B, T, C] to [B, T, C] (compute dtype ``config.dtype``)."""
    cfg = self.config
    b, t, c = x.shape
    h = cfg.n_head
    qkv = nn.Dense(3 * c, use_bias=cfg.bias, dtype=cfg.dtype,
                   param_dtype=cfg.param_dtype, kernel_init=_normal(0.02), name="c_attn")(x)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    # [B, T, C] -> [B, H, T, C/H].
    q, k, v = (z.reshape(b, t, h, c // h).transpose(0, 2, 1, 3)
               for z in (q, k, v))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(c // h)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32),
                       jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
    weights = nn.Dropout(cfg.dropout)(weights, deterministic=deterministic)
    y = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
    y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
    return _residual_out(cfg, y, c, deterministic)


class MLP(nn.Module):
  """Position-wise ``C -> 4C -> C`` feed-forward block with GELU."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    """Maps ``x`` [B, T, C] to [B, T, C]."""
    cfg = self.config
    x = nn.Dense(4 * cfg.n_embd, use_bias=cfg.bias, dtype=cfg.dtype,
                 param_dtype=cfg.param_dtype, kernel_init=_normal(0.02), name="c_fc")(x)
    x = nn.gelu(x, approximate=True)
    return _residual_out(cfg, x, cfg.n_embd, deterministic)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, ``x + mlp(ln(x))``."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    cfg = self.config

    def ln(name):
      return nn.LayerNorm(epsilon=1e-5, use_bias=cfg.bias, dtype=cfg.dtype,
                          param_dtype=cfg.param_dtype, name=name)

    x = x + CausalSelfAttention(cfg, name="attn")(ln("ln_1")(x), deterministic)
    x = x + MLP(cfg, name="mlp")(ln("ln_2")(x), deterministic)
    return x


def _block_class(remat: str):
  """:class:`Block`, or it under ``nn.remat`` with the policy of ``remat``
  (``deterministic``, argument 2 counting the module, is static)."""
  if remat == "none":
    return Block
  policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            if remat == "block_dots" else None)
  return nn.remat(Block, static_argnums=(2,), policy=policy)


class GPT(nn.Module):
  """GPT-2-style causal language model.

  Usage::

    logits = GPT(cfg).apply({"params": params}, idx)  # dropout off
    logits = GPT(cfg).apply({"params": params}, idx, deterministic=False,
                            rngs={"dropout": key})   # only if cfg.dropout > 0
  """
  config: GPTConfig

  @nn.compact
  def __call__(self, idx: jax.Array, deterministic: bool = True) -> jax.Array:
    """Next-token logits.

    Args:
      idx: token ids, int [B, T] with ``T <= config.block_size`` and values in
        ``[0, vocab_size)``.
      deterministic: if False, apply dropout (needs a ``"dropout"`` RNG when
        ``config.dropout > 0``).

    Returns:
      Logits float32 [B, T, vocab_size]; position t depends only on
      ``idx[:, :t+1]``.

    Raises:
      ValueError: ``idx`` not 2-D integer, or ``T > block_size``.
    """
    cfg = self.config
    if idx.ndim != 2 or not jnp.issubdtype(idx.dtype, jnp.integer):
      raise ValueError(f"GPT input idx must be an int array [B, T], got dtype "
                       f"{idx.dtype} shape {idx.shape}.")
    t = idx.shape[1]
    if t > cfg.block_size:
      raise ValueError(f"sequence length {t} exceeds GPTConfig.block_size="
                       f"{cfg.block_size}; use context_len <= block_size.")
    wte = nn.Embed(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype,
                   param_dtype=cfg.param_dtype, embedding_init=_normal(0.02), name="wte")
    wpe = nn.Embed(cfg.block_size, cfg.n_embd, dtype=cfg.dtype,
                   param_dtype=cfg.param_dtype, embedding_init=_normal(0.02), name="wpe")
    x = wte(idx) + wpe(jnp.arange(t))[None]
    x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
    block = _block_class(cfg.remat)
    for i in range(cfg.n_layer):
      x = block(cfg, name=f"h_{i}")(x, deterministic)
    x = nn.LayerNorm(epsilon=1e-5, use_bias=cfg.bias, dtype=cfg.dtype,
                     param_dtype=cfg.param_dtype, name="ln_f")(x)
    return wte.attend(x).astype(jnp.float32)


def init_params(cfg: GPTConfig, rng: jax.Array) -> PyTree:
  """Initial parameters of ``GPT(cfg)`` (pytree of ``cfg.param_dtype``).

  Args:
    cfg: model configuration.
    rng: a JAX PRNG key.

  Returns:
    The ``"params"`` collection: ``{"wte": {"embedding": [V, C]},
    "wpe": {"embedding": [block_size, C]}, "h_0": ..., "ln_f": ...}``.

  Raises:
    ValueError: ``cfg`` not a :class:`GPTConfig`.
  """
  if not isinstance(cfg, GPTConfig):
    raise ValueError(f"cfg must be a GPTConfig, got {type(cfg).__name__}.")
  dummy = jnp.zeros((1, 1), jnp.int32)
  return jax.jit(GPT(cfg).init)(rng, dummy)["params"]


def num_params(params: PyTree) -> int:
  """Total number of scalars in ``params`` (tied head counted once)."""
  return int(sum(np.prod(np.shape(x), dtype=np.int64)
                 for x in jax.tree.leaves(params)))
