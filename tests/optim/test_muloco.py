"""MuLoCo's inner optimizer (optim/muloco.py): the split of the parameters,
Muon's step against an independent NumPy Newton-Schulz, two workers'
DiLoCo + Muon (exact and 4-bit with error feedback) against a NumPy oracle
of the whole recursion, and the argument checks.

The workers run under ``shard_map`` (one simulated CPU device each); worker ``i`` minimises
``0.5 |p - c_i|^2`` per leaf (gradient ``p - c_i``).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib as optax_contrib

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax.comm import compress
from decentral_jax.optim import diloco_sync
from decentral_jax.optim import muloco
from decentral_jax.optim import reductions

AXIS = "workers"
# optax's quintic Newton-Schulz coefficients, read from its public default.
COEFFS = inspect.signature(
    optax_contrib.scale_by_muon).parameters["ns_coeffs"].default


def test_coefficients_are_the_published_ones():
  np.testing.assert_allclose(COEFFS, (3.4445, -4.7750, 2.0315))


def _params(rng, dtype=np.float64):
  """A wide and a tall matrix (Muon), an embedding and a vector (AdamW)."""
  return {"wide": rng.normal(size=(3, 5)).astype(dtype),
          "tall": {"kernel": rng.normal(size=(6, 2)).astype(dtype)},
          "wte": {"embedding": rng.normal(size=(4, 3)).astype(dtype)},
          "b": rng.normal(size=(5,)).astype(dtype)}


def test_labels_send_matrices_to_muon_and_the_rest_to_adam():
  p = _params(np.random.default_rng(0))
  assert muloco.muon_labels(p) == {
      "wide": "muon", "tall": {"kernel": "muon"},
      "wte": {"embedding": "adam"}, "b": "adam"}
  # optax's own rule: every 2-D leaf to Muon.
  assert muloco.muon_labels(p, ())["wte"] == {"embedding": "muon"}
  # The default names no leaf of a model without embedding tables: all Muon.
  assert muloco.muon_labels({"k": p["wide"]}) == {"k": "muon"}


@pytest.mark.parametrize("names, words", [
    (("embeding",), "embeddings names 'embeding', which is no leaf's name "
     "(nearest: 'embedding'); a leaf's name is the last key of its path, "
     "here one of: b, embedding, kernel, wide."),
    (("embedding", "wte"), "embeddings names 'wte', which is no leaf's name;"),
])
def test_an_embedding_name_that_is_no_leaf_is_refused(names, words):
  """A typo would send the embedding table to Muon: refused by name, when
  the labels are made (muon_labels, or tx.init of muon_inner)."""
  p = _params(np.random.default_rng(0))
  with pytest.raises(ValueError) as info:
    muloco.muon_labels(p, names)
  assert words in str(info.value) and "\n" not in str(info.value)
  tx = muloco.muon_inner(0.1, embeddings=names)
  with pytest.raises(ValueError, match="embeddings names"):
    tx.init(p)


# -- NumPy re-implementation ----------------------------------------------


def np_newton_schulz(x, steps, eps=1e-8):
  """Quintic Newton-Schulz on the wide orientation of ``x`` (NumPy)."""
  a, b, c = COEFFS
  tall = x.shape[0] > x.shape[1]
  y = x.T if tall else x
  y = y / (np.sqrt(np.sum(y * y)) + eps)
  for _ in range(steps):
    g = y @ y.T
    y = a * y + (b * g + c * g @ g) @ y
  return y.T if tall else y


class NpMuonAdamW:
  """Muon (Nesterov, bias-corrected, consistent RMS) on 2-D non-embedding
  leaves, AdamW elsewhere, decay on 2-D leaves; leaves keyed by path."""

  def __init__(self, labels, lr, ns_steps=5, beta=0.95, rms=0.2, ratio=1.0,
               b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    self.labels, self.lr, self.ns, self.beta, self.rms = (labels, lr,
                                                          ns_steps, beta, rms)
    self.ratio, self.b1, self.b2, self.eps, self.wd = ratio, b1, b2, eps, wd
    self.m, self.v, self.t = {}, {}, 0

  def step(self, p, g):
    """Updated copy of the dict ``p`` (flat keys) for gradients ``g``."""
    self.t += 1
    t, out = self.t, {}
    for k in p:
      m = self.m.get(k, 0.0)
      if self.labels[k] == "muon":
        be = self.beta
        m = be * m + (1 - be) * g[k]
        hat = be * m / (1 - be**(t + 1)) + (1 - be) * g[k] / (1 - be**t)
        o = np_newton_schulz(hat, self.ns)
        scale = self.rms * np.sqrt(max(p[k].shape))
        out[k] = p[k] - self.lr * (scale * o + self.wd * p[k])
      else:
        v = self.v.get(k, 0.0)
        m = self.b1 * m + (1 - self.b1) * g[k]
        v = self.b2 * v + (1 - self.b2) * g[k] ** 2
        self.v[k] = v
        d = (m / (1 - self.b1**t)) / (np.sqrt(v / (1 - self.b2**t))
                                      + self.eps)
        decay = self.wd * p[k] if p[k].ndim >= 2 else 0.0
        out[k] = p[k] - self.lr * self.ratio * (d + decay)
      self.m[k] = m
    return out


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_muon_steps_equal_numpy_newton_schulz(x64):
  rng = np.random.default_rng(1)
  p0, target = _params(rng), _params(rng)
  tx = muloco.muon_inner(0.05, ns_steps=4, beta=0.9, adam_lr_ratio=0.5,
                         weight_decay=0.1)
  oracle = NpMuonAdamW(_flat(muloco.muon_labels(p0)), 0.05, ns_steps=4,
                       beta=0.9, ratio=0.5, wd=0.1)
  p, state = jax.tree.map(jnp.asarray, p0), tx.init(p0)
  want = _flat(p0)
  step = jax.jit(lambda p, s: tx.update(
      jax.tree.map(lambda a, c: a - c, p, target), s, p))
  for _ in range(4):
    u, state = step(p, state)
    p = optax.apply_updates(p, u)
    want = oracle.step(want, {k: want[k] - v
                              for k, v in _flat(target).items()})
  got = _flat(p)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12,
                               err_msg=k)
  # Muon moved the matrices: its step differs from AdamW's.
  assert not np.allclose(got["['wide']"], p0["wide"], atol=1e-3)


@pytest.mark.slow
def test_the_other_branch_is_injectable():
  """``adam``: called with ``adam_lr_ratio * lr``; here plain SGD, so the
  non-matrix leaves step by exactly ``-0.5 * 0.1 * g``."""
  rng = np.random.default_rng(4)
  p, g = _params(rng), _params(rng)
  tx = muloco.muon_inner(0.1, adam_lr_ratio=0.5, adam=optax.sgd)
  u, _ = tx.update(g, tx.init(p), p)
  np.testing.assert_allclose(u["b"], -0.05 * g["b"], rtol=1e-6)
  np.testing.assert_allclose(u["wte"]["embedding"],
                             -0.05 * g["wte"]["embedding"], rtol=1e-6)
  # First step: mu_hat is a positive multiple of G, removed by the norm.
  o = np_newton_schulz(g["wide"], 5)
  np.testing.assert_allclose(u["wide"], -0.1 * 0.2 * np.sqrt(5) * o,
                             rtol=2e-5, atol=1e-7)


# -- DiLoCo + Muon over two workers -----------------------------------------

H, ROUNDS, LR, OUTER_LR, MOM = 3, 3, 0.02, 0.7, 0.9


def _np_q4(u, block):
  """deQ(Q(u)) of int4: a float32 scale max|v| / 7 per block of the flat
  zero-padded vector, codes round(v / s) in [-7, 7]."""
  flat = u.reshape(-1).astype(np.float32)
  pad = (-flat.size) % block
  b = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, block)
  amax = np.abs(b).max(axis=1)
  scale = np.where(amax > 0, amax / np.float32(7), np.float32(1)).astype(
      np.float32)
  codes = np.clip(np.round(b / scale[:, None]), -7, 7)
  return (codes.astype(np.float32) * scale[:, None]).reshape(-1)[
      :flat.size].reshape(u.shape)


def _np_q4_sync(theta, x, err, block):
  """Delta of the int4 sync with error feedback (``err`` updated in place):
  each worker's pseudo-gradients, leaves concatenated in ``theta``'s (tree)
  order, quantized as one vector; the mean re-quantized."""
  keys, n = list(theta), len(x)
  u = [{k: err[i][k] + (theta[k] - x[i][k]) for k in keys} for i in range(n)]
  flat = [np.concatenate([ui[k].reshape(-1) for k in keys]) for ui in u]
  sent = [_np_q4(f, block) for f in flat]
  mean = _np_q4((sent[0] + sent[1]) / np.float32(n), block)
  out, offset = {}, 0
  for k in keys:
    size = theta[k].size
    for i in range(n):
      err[i][k] = u[i][k] - sent[i][offset:offset + size].reshape(
          theta[k].shape)
    out[k] = mean[offset:offset + size].reshape(theta[k].shape)
    offset += size
  return out


def _np_muloco(p0, targets, labels, block=None):
  """DiLoCo with the NumPy Muon/AdamW inner step and Nesterov outer SGD;
  with ``block`` the pseudo-gradients are sent in int4 with error feedback
  and the mean re-quantized. Returns theta (flat keys)."""
  n = len(targets)
  dt = np.float32 if block else np.float64
  inner = [NpMuonAdamW(labels, LR) for _ in range(n)]
  theta = {k: v.astype(dt) for k, v in p0.items()}
  x = [dict(theta) for _ in range(n)]
  buf = {k: np.zeros_like(v) for k, v in theta.items()}
  err = [{k: np.zeros_like(v) for k, v in theta.items()} for _ in range(n)]
  for t in range(1, H * ROUNDS + 1):
    x = [{k: v.astype(dt) for k, v in inner[i].step(
        x[i], {k: x[i][k] - targets[i][k] for k in x[i]}).items()}
         for i in range(n)]
    if t % H:
      continue
    if block:  # one buffer: the leaves concatenated in tree order
      deltas = _np_q4_sync(theta, x, err, block)
    for k in theta:
      if block:
        delta = deltas[k]
      else:
        delta = theta[k] - sum(xi[k] for xi in x) / n
      buf[k] = delta + MOM * buf[k]
      theta[k] = (theta[k] - OUTER_LR * (delta + MOM * buf[k])).astype(dt)
    x = [dict(theta) for _ in range(n)]
  return theta


def _run_muloco(p0, targets, reduction):
  """``H * ROUNDS`` steps of DiLoCo + Muon under ``shard_map`` over one
  simulated device per worker; theta (flat keys) of worker 0."""
  tx = diloco_sync.diloco(
      muloco.muon_inner(LR), H, reduction=reduction,
      outer=optax.sgd(OUTER_LR, momentum=MOM, nesterov=True))
  n = len(targets)
  mesh = parallel.make_mesh(n, devices=require_devices(n))
  x = jax.tree.map(lambda a: np.stack([a] * n), p0)
  c = jax.tree.map(lambda *a: np.stack(a), *targets)

  def run(x, c):
    def body(_, carry):
      x, s = carry
      u, s = tx.update(jax.tree.map(lambda a, b: a - b, x, c), s, x)
      return optax.apply_updates(x, u), s
    _, state = jax.lax.fori_loop(0, H * ROUNDS, body, (x, tx.init(x)))
    return state.theta

  theta = jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(x, mesh), parallel.shard(c, mesh))
  return _flat(jax.tree.map(lambda a: np.asarray(a)[0], theta))


def test_two_workers_diloco_muon_equal_the_numpy_oracle(x64):
  rng = np.random.default_rng(2)
  p0, targets = _params(rng), [_params(rng), _params(rng)]
  got = _run_muloco(p0, targets, reductions.ExactMean(AXIS))
  labels = _flat(muloco.muon_labels(p0))
  want = _np_muloco(_flat(p0), [_flat(t) for t in targets], labels)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12,
                               err_msg=k)
  assert not np.allclose(got["['wide']"], p0["wide"], atol=1e-2)


@pytest.mark.slow  # a compiled run of its own
def test_two_workers_int4_error_feedback_equal_the_numpy_codec():
  """float32 throughout; the pseudo-gradients sent as int4 (blocks of 8)
  with error feedback, their mean re-quantized (the reduce-scatter /
  all-gather of the scaled formats)."""
  rng = np.random.default_rng(3)
  p0 = _params(rng, np.float32)
  targets = [_params(rng, np.float32), _params(rng, np.float32)]
  red = reductions.compressed(compress.Compressor("int4", block=8), True,
                              1.0, AXIS)
  got = _run_muloco(p0, targets, red)
  want = _np_muloco(_flat(p0), [_flat(t) for t in targets],
                    _flat(muloco.muon_labels(p0)), block=8)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6,
                               err_msg=k)
  exact = _np_muloco(_flat(p0), [_flat(t) for t in targets],
                     _flat(muloco.muon_labels(p0)))
  # 4 bits moved theta away from the exact run (the codec is exercised).
  assert max(np.max(np.abs(want[k] - exact[k])) for k in want) > 1e-3


@pytest.mark.parametrize("kwargs, words", [
    (dict(ns_steps=0), "ns_steps must be an int >= 1 and <= 100"),
    (dict(ns_steps=10**9), "ns_steps must be an int >= 1 and <= 100"),
    (dict(ns_steps=2.0), "ns_steps must be an int"),
    # The default AdamW branch's arguments (NaN, negative or >= 1 updates
    # were returned without a word).
    (dict(weight_decay=-1.0), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite"),
    (dict(b1=1.5), "b1 must be a number in \\[0, 1\\)"),
    (dict(b2=float("nan")), "b2 must be a number in \\[0, 1\\)"),
    (dict(eps=-1.0), "eps must be a finite number >= 0"),
    (dict(beta=1.0), "beta must be a finite number >= 0.0 and < 1.0"),
    (dict(consistent_rms=-0.1), "consistent_rms must be a finite number >= 0"),
    (dict(adam_lr_ratio=0.0), "adam_lr_ratio must be a finite number > 0"),
    (dict(embeddings="embedding"), "embeddings='embedding' must be a tuple"),
    (dict(embeddings=None), "embeddings=None must be a tuple of leaf names"),
    (dict(adam=lambda lr: 5), "adam\\(lr\\) must be an "
     "optax.GradientTransformation .*got int"),
    (dict(adam=optax.sgd(0.1)), "adam=.* must be a function lr -> optax "
     "transform"),
])
def test_bad_arguments_are_refused_by_name(kwargs, words):
  with pytest.raises(ValueError, match=words):
    muloco.muon_inner(1e-3, **kwargs)


@pytest.mark.parametrize("lr", [float("nan"), -0.1, float("inf")])
def test_a_bad_learning_rate_is_refused(lr):
  with pytest.raises(ValueError, match="learning_rate must be a finite "
                     "number >= 0"):
    muloco.muon_inner(lr)
