"""Tests for decentral_jax.models: GPT, CNN and the losses.

References are independent NumPy re-implementations (GPT and CNN forward
passes, cross-entropy) and closed-form parameter counts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decentral_jax import models
from decentral_jax import optim
from decentral_jax.models import cnn
from decentral_jax.models import gpt

SMALL = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
                      n_embd=32, bias=True)


@pytest.fixture(scope="module")
def small_params():
  return gpt.init_params(SMALL, jax.random.key(0))


@pytest.fixture(scope="module")
def small_apply():
  return jax.jit(lambda p, idx: gpt.GPT(SMALL).apply({"params": p}, idx))


# ---------------------------------------------------------------------------
# NumPy reference of the GPT forward pass (float64).
# ---------------------------------------------------------------------------


def _np_layernorm(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + 1e-5) * p["scale"]
  return y + p["bias"] if "bias" in p else y


def _np_dense(x, p):
  y = x @ p["kernel"]
  return y + p["bias"] if "bias" in p else y


def _np_gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_gpt(p, idx, cfg):
  """Logits [B, T, V] of a pre-LN GPT with a tied head, in float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  b, t = idx.shape
  h, d = cfg.n_head, cfg.n_embd // cfg.n_head
  wte = p["wte"]["embedding"]
  x = wte[idx] + p["wpe"]["embedding"][:t][None]
  future = np.triu(np.ones((t, t), bool), k=1)
  for i in range(cfg.n_layer):
    blk = p[f"h_{i}"]
    qkv = _np_dense(_np_layernorm(x, blk["ln_1"]), blk["attn"]["c_attn"])
    q, k, v = (z.reshape(b, t, h, d).transpose(0, 2, 1, 3)
               for z in np.split(qkv, 3, axis=-1))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    s[..., future] = -np.inf
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    y = (a @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
    x = x + _np_dense(y, blk["attn"]["c_proj"])
    m = _np_gelu(_np_dense(_np_layernorm(x, blk["ln_2"]), blk["mlp"]["c_fc"]))
    x = x + _np_dense(m, blk["mlp"]["c_proj"])
  return _np_layernorm(x, p["ln_f"]) @ wte.T


def _gpt_count(v, t, n_layer, c, bias):
  """Closed-form GPT parameter count (tied head: no extra V*C)."""
  ln = 2 * c if bias else c
  attn = c * 3 * c + c * c + (4 * c if bias else 0)
  mlp = c * 4 * c + 4 * c * c + (5 * c if bias else 0)
  return v * c + t * c + n_layer * (2 * ln + attn + mlp) + ln


# ---------------------------------------------------------------------------
# GPT.
# ---------------------------------------------------------------------------


def test_gpt_shapes_and_dtype(small_params, small_apply):
  idx = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 10)),
                    jnp.int32)
  logits = small_apply(small_params, idx)
  assert logits.shape == (3, 10, 64)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))


def test_gpt_matches_numpy_reference(small_params, small_apply):
  # Perturb every leaf so LayerNorm scales/biases and Dense biases matter.
  rng = np.random.default_rng(10)
  params = jax.tree.map(
      lambda x: np.asarray(x) + 0.1 * rng.normal(size=x.shape).astype(
          np.float32), small_params)
  idx = np.random.default_rng(1).integers(0, 64, (2, 16)).astype(np.int32)
  got = np.asarray(small_apply(params, jnp.asarray(idx)))
  want = _np_gpt(params, idx, SMALL)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_gpt_is_causal(small_params, small_apply):
  rng = np.random.default_rng(2)
  idx = rng.integers(0, 64, (2, 16)).astype(np.int32)
  base = np.asarray(small_apply(small_params, jnp.asarray(idx)))
  for t in (0, 5, 14):
    changed = idx.copy()
    changed[:, t + 1:] = (idx[:, t + 1:] + rng.integers(1, 64, (2, 15 - t))
                          ) % 64
    out = np.asarray(small_apply(small_params, jnp.asarray(changed)))
    np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], rtol=0,
                               atol=1e-6)
    # The change is visible from position t+1 on (the check is not vacuous).
    assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-3


def test_gpt_head_is_tied_to_token_embedding(small_params, small_apply):
  paths = {jax.tree_util.keystr(k): v.shape
           for k, v in jax.tree_util.tree_leaves_with_path(small_params)}
  vocab_leaves = [k for k, s in paths.items() if 64 in s]
  assert vocab_leaves == ["['wte']['embedding']"]
  # Changing the embedding row of a token that is not in the input changes
  # only that token's logit column (through the tied head).
  idx = jnp.zeros((1, 4), jnp.int32)
  delta = np.zeros((64, 32), np.float32)
  delta[7] = np.random.default_rng(3).normal(size=32)
  p2 = jax.tree.map(lambda x: x, small_params)
  p2["wte"] = {"embedding": small_params["wte"]["embedding"] + delta}
  diff = np.asarray(small_apply(p2, idx) - small_apply(small_params, idx))
  assert np.abs(np.delete(diff, 7, axis=-1)).max() < 1e-6
  assert np.abs(diff[..., 7]).min() > 1e-4


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_param_count_closed_form(bias):
  cfg = gpt.GPTConfig(vocab_size=50, block_size=12, n_layer=3, n_head=2,
                      n_embd=16, bias=bias)
  shapes = jax.eval_shape(functools.partial(gpt.init_params, cfg),
                          jax.random.key(0))
  assert gpt.num_params(shapes) == _gpt_count(50, 12, 3, 16, bias)


def test_gpt2_small_param_count():
  # nanoGPT GPT-2 small with vocab 50304, no bias: 124,373,760 parameters
  # (123.6M without position embeddings), computed here by hand.
  c, v, t, n = 768, 50304, 1024, 12
  by_hand = v * c + t * c + n * (2 * c + 4 * c * c + 8 * c * c) + c
  assert by_hand == 124_373_760
  shapes = jax.eval_shape(functools.partial(gpt.init_params, gpt.GPTConfig()),
                          jax.random.key(0))
  assert gpt.num_params(shapes) == by_hand


def test_gpt_init_scales(small_params):
  resid = 0.02 / math.sqrt(2 * SMALL.n_layer)
  h = small_params["h_1"]
  for x, std in [(small_params["wte"]["embedding"], 0.02),
                 (small_params["wpe"]["embedding"], 0.02),
                 (h["attn"]["c_attn"]["kernel"], 0.02),
                 (h["mlp"]["c_fc"]["kernel"], 0.02),
                 (h["attn"]["c_proj"]["kernel"], resid),
                 (h["mlp"]["c_proj"]["kernel"], resid)]:
    assert abs(float(np.std(x)) / std - 1) < 0.1
  assert float(np.abs(h["mlp"]["c_fc"]["bias"]).max()) == 0.0
  np.testing.assert_array_equal(h["ln_1"]["scale"], np.ones(32))


def test_untrained_gpt_loss_is_log_vocab(small_params, small_apply):
  tok = np.random.default_rng(4).integers(0, 64, (8, 17)).astype(np.int32)
  logits = small_apply(small_params, jnp.asarray(tok[:, :-1]))
  loss = float(models.lm_loss(logits, jnp.asarray(tok[:, 1:])))
  assert abs(loss - math.log(64)) < 0.3


@pytest.mark.slow
def test_gpt_dropout_needs_rng_only_when_training(small_params, small_apply):
  cfg = dataclasses.replace(SMALL, dropout=0.5)
  idx = jnp.arange(16, dtype=jnp.int32)[None]
  apply = jax.jit(gpt.GPT(cfg).apply, static_argnames="deterministic")
  # deterministic=True (the default) needs no RNG and disables dropout.
  evaluated = apply({"params": small_params}, idx)
  np.testing.assert_allclose(evaluated, small_apply(small_params, idx),
                             rtol=1e-6, atol=1e-6)
  train = apply({"params": small_params}, idx, deterministic=False,
                rngs={"dropout": jax.random.key(0)})
  assert np.abs(np.asarray(train - evaluated)).max() > 1e-3


def test_gpt_bad_inputs():
  with pytest.raises(ValueError, match="n_head"):
    gpt.GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=3, n_embd=16,
                  bias=False)
  with pytest.raises(ValueError, match="dropout"):
    gpt.GPTConfig(dropout=1.0)
  with pytest.raises(ValueError, match="block_size"):
    gpt.GPT(SMALL).init(jax.random.key(0), jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="int"):
    gpt.GPT(SMALL).init(jax.random.key(0), jnp.zeros((1, 4), jnp.float32))


# ---------------------------------------------------------------------------
# CNN.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cnn_model_params():
  model = cnn.CNN()
  return model, cnn.init_params(model, jax.random.key(0))


def test_cnn_shapes_and_param_count(cnn_model_params):
  model, p = cnn_model_params
  apply = jax.jit(model.apply)
  x = jnp.asarray(np.random.default_rng(0).random((5, 28, 28, 1)),
                  jnp.float32)
  logits = apply({"params": p}, x)
  assert logits.shape == (5, 10) and logits.dtype == jnp.float32
  # 3x3 convs 1->32->64, two 2x2 pools (28 -> 14 -> 7), dense 7*7*64 -> 128.
  want = (9 * 1 * 32 + 32) + (9 * 32 * 64 + 64) + (7 * 7 * 64 * 128 + 128) + (
      128 * 10 + 10)
  assert gpt.num_params(p) == want
  # A [B, 28, 28] batch is treated as one channel.
  np.testing.assert_allclose(apply({"params": p}, x[..., 0]), logits,
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="255"):
    model.apply({"params": p}, jnp.zeros((1, 28, 28, 1), jnp.uint8))


def _np_conv3x3_same(x, p):
  """3x3 convolution as deep-learning layers define it (cross-correlation,
  no kernel flip), zero padding 1 ("SAME"), stride 1, plus bias:
  ``y[b, i, j, o] = sum_{di, dj, c} x[b, i+di-1, j+dj-1, c] k[di, dj, c, o]``."""
  h, w = x.shape[1:3]
  xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  y = np.zeros(x.shape[:3] + (p["kernel"].shape[-1],))
  for di in range(3):
    for dj in range(3):
      y += xp[:, di:di + h, dj:dj + w, :] @ p["kernel"][di, dj]
  return y + p["bias"]


def _np_avg_pool2(x):
  """2x2 mean with stride 2; an odd last row or column is dropped."""
  b, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2]
  return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


def _np_cnn(p, images):
  """Logits [B, classes] of conv-ReLU-pool (x2), dense-ReLU, dense, float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(images, np.float64)
  n_conv = len([k for k in p if k.startswith("Conv_")])
  for i in range(n_conv):
    x = _np_avg_pool2(np.maximum(_np_conv3x3_same(x, p[f"Conv_{i}"]), 0))
  x = x.reshape(x.shape[0], -1)  # (row, column, channel) order
  x = np.maximum(_np_dense(x, p["Dense_0"]), 0)
  return _np_dense(x, p["Dense_1"])


@pytest.mark.parametrize("features,dense,classes,side", [
    ((32, 64), 128, 10, 28),  # the Fashion-MNIST model
    # odd sides: 11 -> 5 -> 2 (pooling drops a row)
    pytest.param((3, 5), 7, 4, 11, marks=pytest.mark.slow),
])
def test_cnn_forward_matches_numpy(features, dense, classes, side):
  model = cnn.CNN(num_classes=classes, features=features, dense=dense)
  p = cnn.init_params(model, jax.random.key(3), (side, side, 1))
  rng = np.random.default_rng(4)
  x = rng.random((3, side, side, 1)).astype(np.float32)
  # Larger biases so that every ReLU cuts through both signs.
  p = jax.tree.map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(
      a.dtype) if a.ndim == 1 else a, p)
  got = np.asarray(jax.jit(model.apply)({"params": p}, jnp.asarray(x)))
  want = _np_cnn(p, x)
  assert got.shape == want.shape == (3, classes)
  assert np.abs(want).max() > 0.05  # not a near-zero output
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cnn_sgd_lowers_loss(cnn_model_params):
  model, p = cnn_model_params
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.random((16, 28, 28, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 16), jnp.int32)
  tx = optax.sgd(0.1)

  def loss_fn(params):
    return models.classification_loss(model.apply({"params": params}, x),
                                      y)[0]

  @jax.jit
  def step(params, state):
    loss, g = jax.value_and_grad(loss_fn)(params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state, loss

  state = tx.init(p)
  losses = []
  for _ in range(10):
    p, state, loss = step(p, state)
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0], losses


# ---------------------------------------------------------------------------
# Losses.
# ---------------------------------------------------------------------------


def _np_xent(logits, labels):
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, labels[..., None], -1)[..., 0]


def test_lm_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)) * 3
  targets = rng.integers(0, 7, (2, 5))
  got = models.lm_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
  assert got.shape == () and got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), _np_xent(logits, targets).mean(),
                             rtol=1e-5)
  with pytest.raises(ValueError, match="targets"):
    models.lm_loss(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))


def test_classification_loss_matches_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(9, 4)) * 2
  labels = rng.integers(0, 4, 9)
  loss, acc = models.classification_loss(jnp.asarray(logits, jnp.float32),
                                         jnp.asarray(labels))
  np.testing.assert_allclose(float(loss), _np_xent(logits, labels).mean(),
                             rtol=1e-5)
  assert float(acc) == pytest.approx(np.mean(logits.argmax(-1) == labels))
  assert 0 < float(acc) < 1  # the batch mixes right and wrong predictions
  with pytest.raises(ValueError, match="labels"):
    models.classification_loss(jnp.zeros((9, 4)), jnp.zeros((8,), jnp.int32))


def test_decay_mask_selects_matrices(small_params):
  mask = optim.default_weight_decay_mask(small_params)
  assert mask["wte"]["embedding"] and mask["h_0"]["mlp"]["c_fc"]["kernel"]
  assert not mask["h_0"]["mlp"]["c_fc"]["bias"]
  assert not mask["ln_f"]["scale"]
