"""Compressed pseudo-gradients of the local-update methods against NumPy.

DiLoCo with top-k (SparseLoCo: all-gathered indices and values, error
feedback with decay) and with int8 (reduce-scatter of codes, re-quantized
mean) is re-implemented in NumPy and compared step by step; the identity
compressor gives the uncompressed methods bit for bit; Streaming DiLoCo with
one fragment and no overlap equals DiLoCo with the same compressor; the
all-gathered mean's bytes read from the HLO equal a hand count.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import sync_args
from decentral_jax import analysis
from decentral_jax import parallel
from decentral_jax.comm import compress
from decentral_jax.comm import compressed_mean
from decentral_jax import optim

N = 4
SHAPES = {"b": (5,), "w": (37,)}  # 37 values: 5 chunks of 8, the last padded
INNER_LR, OUTER_LR, H, STEPS = 0.1, 0.8, 3, 12


def _problem():
  rng = np.random.default_rng(11)
  x0 = {k: np.repeat(rng.normal(size=(1, *s)), N, 0).astype(np.float32)
        for k, s in SHAPES.items()}  # equal on every worker (theta_0)
  targets = {k: rng.normal(size=(N, *s)).astype(np.float32) * 3
             for k, s in SHAPES.items()}
  return x0, targets


def _run(tx, steps=STEPS):
  """``steps`` inner steps of f_i(x) = |x - c_i|^2 / 2 on N workers."""
  require_devices(N)
  mesh = parallel.make_mesh(N)
  x0, targets = _problem()

  def run(x, c):
    state = tx.init(x)

    def body(_, carry):
      x, state = carry
      g = jax.tree.map(lambda a, b: a - b, x, c)
      upd, state = tx.update(g, state, x)
      return optax.apply_updates(x, upd), state

    return jax.lax.fori_loop(0, steps, body, (x, state))

  return jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(x0, mesh), parallel.shard(targets, mesh))


# -- NumPy re-implementations of the formats (float32, as sent) ------------


def _np_topk(u, block, k):
  """Keep the k largest magnitudes of every chunk (zero-padded)."""
  flat = u.reshape(-1)
  pad = (-flat.size) % block
  b = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, block)
  out = np.zeros_like(b)
  for r in range(b.shape[0]):
    keep = np.argsort(-np.abs(b[r]), kind="stable")[:k]
    out[r, keep] = b[r, keep]
  return out.reshape(-1)[:flat.size].reshape(u.shape)


def _np_int8(u, block):
  """deQ(Q(u)) of int8 with a float32 scale per block (blocks of the flat
  zero-padded vector)."""
  flat = u.reshape(-1)
  pad = (-flat.size) % block
  b = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, block)
  amax = np.abs(b).max(axis=1)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(
      np.float32)
  codes = np.clip(np.round(b / scale[:, None]), -127, 127)
  return (codes.astype(np.float32) * scale[:, None]).reshape(-1)[
      :flat.size].reshape(u.shape)


def _join(tree):
  """Leaves in tree order (sorted keys), flattened and concatenated."""
  return np.concatenate([tree[k].reshape(-1) for k in sorted(tree)])


def _split(flat):
  out, offset = {}, 0
  for k in sorted(SHAPES):
    size = int(np.prod(SHAPES[k]))
    out[k] = flat[offset:offset + size].reshape(SHAPES[k])
    offset += size
  return out


def _np_diloco(send, mean, decay, feedback, bucket=False):
  """DiLoCo with inner and outer SGD; ``send`` = deQ(Q(.)), ``mean`` of
  the sent values over workers, per leaf, or with ``bucket`` on each
  worker's leaves concatenated into one vector (the scaled formats' one
  buffer). Returns theta and the residuals."""
  x0, targets = _problem()
  theta = {k: v[0].copy() for k, v in x0.items()}
  x = {k: v.copy() for k, v in x0.items()}
  err = {k: np.zeros_like(v) for k, v in x0.items()}
  for t in range(1, STEPS + 1):
    for k in x:
      x[k] = (x[k] - np.float32(INNER_LR) * (x[k] - targets[k])).astype(
          np.float32)
    if t % H:
      continue
    u = {k: theta[k][None] - x[k] for k in x}
    if feedback:
      u = {k: np.float32(decay) * err[k] + u[k] for k in x}
    if bucket:
      flat = np.stack([send(_join({k: u[k][i] for k in u}))
                       for i in range(N)])
      rows = [_split(f) for f in flat]
      sent = {k: np.stack([r[k] for r in rows]) for k in u}
      delta = _split(mean(flat))
    else:
      sent = {k: np.stack([send(u[k][i]) for i in range(N)]) for k in u}
      delta = {k: mean(sent[k]) for k in u}
    if feedback:
      err = {k: u[k] - sent[k] for k in u}
    for k in x:
      theta[k] = theta[k] - np.float32(OUTER_LR) * delta[k]
      x[k] = np.repeat(theta[k][None], N, 0)
  return theta, err


def _gather_mean(sent):
  total = np.zeros_like(sent[0])
  for j in range(N):  # float32, in worker order
    total = total + sent[j]
  return total / np.float32(N)


def _requantized_mean(block):
  def mean(sent):  # shards are whole blocks: re-quantize block by block
    return _np_int8(_gather_mean(sent), block)
  return mean


def _diloco(compressor, **kw):
  return optim.diloco(optax.sgd(INNER_LR), H, outer=optax.sgd(OUTER_LR),
                      **sync_args(compressor=compressor, **kw))


@pytest.mark.parametrize("decay", [
    1.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_sparse_diloco_with_error_feedback_matches_numpy(decay):
  c = compress.Compressor("topk", block=8, fraction=0.25)  # 2 of 8 kept
  _, state = _run(_diloco(c, error_feedback=True, error_decay=decay))
  theta, err = _np_diloco(lambda u: _np_topk(u, 8, 2), _gather_mean, decay,
                          True)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.theta[k])[0], theta[k],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.reduction.error[k]), err[k],
                               rtol=1e-5, atol=1e-6)
    # theta equal on all workers; every residual holds what top-k dropped.
    assert np.all(np.asarray(state.theta[k]) == np.asarray(state.theta[k])[0])
    assert np.abs(err[k]).max() > 0.1


@pytest.mark.slow  # two compiled runs
def test_sparse_diloco_error_feedback_changes_the_run():
  c = compress.Compressor("topk", block=8, fraction=0.25)
  _, with_ef = _run(_diloco(c, error_feedback=True))
  _, without = _run(_diloco(c))
  theta, _ = _np_diloco(lambda u: _np_topk(u, 8, 2), _gather_mean, 1.0, False)
  assert without.reduction == ()
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(without.theta[k])[0], theta[k],
                               rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(with_ef.theta["w"]),
                         np.asarray(without.theta["w"]))


def test_int8_diloco_matches_numpy():
  c = compress.Compressor("int8", block=4)
  _, state = _run(_diloco(c, error_feedback=True))
  # One buffer: b's 5 values then w's 37 (blocks of 4 span both leaves).
  theta, err = _np_diloco(lambda u: _np_int8(u, 4), _requantized_mean(4),
                          1.0, True, bucket=True)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.theta[k])[0], theta[k],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.reduction.error[k]), err[k],
                               rtol=1e-4, atol=1e-6)


def test_buckets_by_hand():
  # 4 bytes a value: 5 + 37 values fill 168 bytes; 10 opens a new bucket,
  # 1 joins it; a leaf larger than the cap is a bucket of its own.
  assert optim.reductions.flat_buckets([5, 37, 10, 1], 168) == [[0, 1],
                                                                [2, 3]]
  assert optim.reductions.flat_buckets([50, 3, 2], 40) == [[0], [1, 2]]
  assert optim.reductions.flat_buckets([], 40) == []


def test_one_bucket_per_leaf_is_the_per_leaf_oracle(monkeypatch):
  # A cap of 20 bytes: b (5 values) fills a bucket, w (37) is its own, so
  # every leaf is quantized and padded alone, as the per-leaf oracle does.
  monkeypatch.setattr(optim.reductions, "COMPRESSED_BUCKET_BYTES", 20)
  c = compress.Compressor("int8", block=4)
  _, state = _run(_diloco(c, error_feedback=True))
  theta, err = _np_diloco(lambda u: _np_int8(u, 4), _requantized_mean(4),
                          1.0, True)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.theta[k])[0], theta[k],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.reduction.error[k]), err[k],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cap,values", [
    (None, [48]), pytest.param(20, [16, 48], marks=pytest.mark.slow)])
def test_compressed_mean_bytes_from_the_hlo_equal_the_hand_count(
    monkeypatch, cap, values):
  """int8, blocks of 4, 4 workers (padding unit 16): b (5) and w (37) in
  one buffer of 42 values padded to 48, or (cap 20 bytes) each padded
  alone, to 16 and 48; the all-to-all and the all-gather send 3/4 of the
  payload each, a block being 4 code bytes and a float32 scale."""
  if cap is not None:
    monkeypatch.setattr(optim.reductions, "COMPRESSED_BUCKET_BYTES", cap)
  require_devices(N)
  mesh = parallel.make_mesh(N)
  axis = parallel.worker_axis(mesh)
  c = compress.Compressor("int8", block=4)
  x, _ = _problem()
  rep = _report(lambda t: optim.compressed_mean(
      jax.tree.leaves(t), c, axis), x, mesh)
  hand = 2 * 3 / 4 * sum(v // 4 * (4 + 4) for v in values)
  assert rep.mean_bytes_per_step == pytest.approx(hand, rel=1e-12)
  assert optim.compressed_mean_bytes(
      {k: v[0] for k, v in x.items()}, N, c) == pytest.approx(hand)


@pytest.mark.parametrize("make", [
    pytest.param(lambda **kw: optim.diloco(
        optax.sgd(INNER_LR), H, outer=optax.sgd(OUTER_LR),
        **sync_args(**kw)), id="diloco"),
    pytest.param(lambda **kw: optim.local_sgd(
        optax.sgd(INNER_LR), H, **sync_args(timing=False, **kw)),
                 id="local_sgd", marks=pytest.mark.slow),
    pytest.param(lambda **kw: optim.streaming_diloco(
        optax.sgd(INNER_LR), 4, num_fragments=2, overlap_steps=1,
        merge_alpha=0.5, outer=optax.sgd(OUTER_LR), **sync_args(**kw)),
                 id="streaming_diloco", marks=pytest.mark.slow)])
def test_identity_compressor_is_the_uncompressed_method_bit_for_bit(make):
  ident = compress.Compressor("none")
  x_c, s_c = _run(make(compressor=ident, error_feedback=True))
  x_p, s_p = _run(make())
  assert type(s_c) is type(s_p)
  for a, b in zip(jax.tree.leaves((x_c, s_c)), jax.tree.leaves((x_p, s_p))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_streaming_with_one_fragment_is_compressed_diloco():
  c = compress.Compressor("int4", block=8)
  _, s_d = _run(_diloco(c, error_feedback=True, error_decay=0.9))
  _, s_s = _run(optim.streaming_diloco(optax.sgd(INNER_LR), H,
                                       outer=optax.sgd(OUTER_LR),
                                           **sync_args(compressor=c,
                                               error_feedback=True,
                                                   error_decay=0.9)))
  assert isinstance(s_s, optim.StreamingDiLoCoState)
  assert isinstance(s_s.reduction, optim.ErrorFeedback)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(s_s.theta[k]),
                               np.asarray(s_d.theta[k]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(s_s.reduction.error[k]),
                               np.asarray(s_d.reduction.error[k]),
                               rtol=1e-6, atol=1e-7)
  assert np.abs(np.asarray(s_d.reduction.error["w"])).max() > 0


@pytest.mark.slow
def test_compressed_local_sgd_is_diloco_with_outer_lr_one():
  c = compress.Compressor("fp8", block=8)
  x_l, s_l = _run(optim.local_sgd(optax.sgd(INNER_LR), H,
                                  **sync_args(compressor=c, timing=False)))
  x_d, _ = _run(optim.diloco(optax.sgd(INNER_LR), H, outer=optax.sgd(1.0),
                             **sync_args(compressor=c)))
  for a, b in zip(jax.tree.leaves(x_l), jax.tree.leaves(x_d)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # After a sync every worker holds theta, the (compressed) mean (up to the
  # rounding of x + (theta - x) in optax.apply_updates).
  x_sync, s_sync = _run(optim.local_sgd(optax.sgd(INNER_LR), H,
                                        **sync_args(compressor=c,
                                            timing=False)), steps=2 * H)
  np.testing.assert_allclose(np.asarray(x_sync["w"]),
                             np.asarray(s_sync.theta["w"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(error_feedback=True), "needs a compressor"),
    (dict(compressor="int8"), "compressor"),
    (dict(compressor=compress.Compressor("int8"), error_decay=0.0),
     "error_decay"),
    (dict(compressor=compress.Compressor("int8"), overlap="eager"),
     "overlap"),
])
def test_bad_compression_arguments_are_refused_in_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as info:
    optim.diloco(optax.sgd(0.1), 3, **sync_args(**kw))
  assert "\n" not in str(info.value)


def test_gathered_mean_bytes_equal_the_hand_count():
  require_devices(8)
  mesh = parallel.make_mesh(8)
  c = compress.Compressor("topk", block=64, fraction=0.125)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda t: compressed_mean.gather_mean_compressed(t, axis, compressor=c), mesh))
  x = {"w": np.ones((8, 300), np.float32)}
  rep = analysis.communication(fn.lower(parallel.shard(x, mesh)).compile())
  # 5 chunks of 64 keep 8 float32 values + 8 int16 indices each; the
  # all-gather sends them to 7 others.
  assert rep.mean_bytes_per_step == 7 * 5 * 8 * (4 + 2)
  assert compressed_mean.gather_payload_bytes({"w": np.ones(300)}, 8, c) == \
      7 * 5 * 8 * 6


def _report(fn, x, mesh):
  return analysis.communication(
      jax.jit(parallel.per_worker(fn, mesh)).lower(
          parallel.shard(x, mesh)).compile())


def test_report_splits_codes_scales_and_indices_by_element_type():
  """The parts of each message, counted by hand: 300 values in blocks of 64
  (5 blocks, the last padded); 8 workers."""
  require_devices(8)
  mesh = parallel.make_mesh(8)
  axis = parallel.worker_axis(mesh)
  x = {"w": np.ones((8, 300), np.float32)}
  topk = compress.Compressor("topk", block=64, fraction=0.125)
  rep = _report(lambda t: compressed_mean.gather_mean_compressed(
      t, axis, compressor=topk), x, mesh)
  # all-gather to 7 others: 5 chunks x 8 float32 values and int16 indices.
  assert rep.mean_bytes_by_dtype() == {"f32": 7 * 5 * 8 * 4,
                                       "s16": 7 * 5 * 8 * 2}
  assert "by element type: f32 1,120 B, s16 560 B" in rep.summary()
  int4 = compress.Compressor("int4", block=64)
  rep = _report(lambda t: compressed_mean.mean_compressed(t, axis, compressor=int4),
                x, mesh)
  # 300 values padded to 512 = 8 blocks: 32 code bytes + a scale each;
  # all-to-all and all-gather send 7/8 of it each.
  assert rep.mean_bytes_by_dtype() == pytest.approx(
      {"u8": 2 * 7 / 8 * 8 * 32, "f32": 2 * 7 / 8 * 8 * 4}, rel=1e-12)
  assert sum(rep.mean_bytes_by_dtype().values()) == pytest.approx(
      rep.mean_bytes_per_step, rel=1e-12)


@pytest.mark.parametrize("fmt", [
    f if f == "int8" else pytest.param(f, marks=pytest.mark.slow)
    for f in ("fp8", "int8", "int4", "fp4")])
def test_compressed_diloco_stays_finite_for_pseudo_gradients_near_zero(fmt):
  """Parameters 0 and targets 1e-35: every pseudo-gradient block's max is
  far below qmax x float32's smallest normal. Its scale takes that floor
  (no 0 scale, no NaN), and the workers move towards the targets."""
  require_devices(8)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  mesh = parallel.make_mesh(8)
  tx = optim.diloco(
      optax.sgd(0.1), 2, outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
      reduction=optim.reductions.compressed(compress.Compressor(fmt)))

  def step(p, s, c):
    u, s = tx.update(jax.tree.map(lambda x: x - c, p), s, p)
    return optax.apply_updates(p, u), s

  stepf = jax.jit(parallel.per_worker(step, mesh))
  p = parallel.replicate({"x": jnp.zeros((5,), jnp.float32)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  c = parallel.shard(jnp.full((8, 5), 1e-35, jnp.float32), mesh)
  for _ in range(6):
    p, s = stepf(p, s, c)
  x = np.asarray(p["x"])
  assert np.all(np.isfinite(x)) and np.all(x >= 0) and np.all(x <= 2e-35), x
