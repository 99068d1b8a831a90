"""Compressed communication: block-scaled quantizers, top-k, error feedback.

A :class:`Compressor` turns a floating array ``v`` (any shape) into the
*payload* actually sent, a dict of flat arrays, and back:
``deQ(Q(v)) = decode(encode(v), v)``. Formats (``B`` = ``block`` values per
float32 scale, ``N`` values, ``nb = ceil(N / B)`` blocks; the bytes are
:func:`decentral_jax.wire_format.payload_bytes`):

==========  ========================================================  ===========================
format      code of one value (scale ``s_b = max_b |v| / qmax``)        bytes sent
==========  ========================================================  ===========================
``none``    the value itself, in its own dtype (bit-exact)              ``N * itemsize``
``int8``    ``round(v / s_b)`` in [-127, 127], int8                     ``nb * (B + 4)``
``fp8``     ``v / s_b`` rounded to float8 e4m3 (qmax 448)              ``nb * (B + 4)``
``int4``    ``round(v / s_b)`` in [-7, 7], two per byte                 ``nb * (B / 2 + 4)``
``fp4``     ``v / s_b`` rounded to e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6}      ``nb * (B / 2 + 4)``
            (qmax 6) with a sign bit, two per byte
``topk``    per chunk of ``B`` values, the ``k = max(1, round(           ``nc * k * (4 + idx)``
            fraction * B))`` largest magnitudes (float32) and their
            indices (int16 if ``B <= 32768``, else int32)
==========  ========================================================  ===========================

The last block (chunk) is zero-padded, and the padding is sent; an empty
array has no block and sends nothing (``nb = 0``). Rounding is
to nearest, so the round-trip error of one value is at most ``s_b / 2`` for
int8/int4, ``max(2^-4 |v|, 2^-10 s_b)`` for fp8 (3 mantissa bits; values
below ``2^-6 s_b`` fall on e4m3's subnormals, spaced ``2^-9 s_b``), and
half the gap between neighbouring e2m1 values times ``s_b`` for fp4; top-k
drops the other values entirely; the float32 rounding of the scale, of
``v / s_b`` and of ``code * s_b`` adds at most ``2^-22 max_b |v|``
(:func:`relative_error_bound`). The decoded value is cast to the leaf's
dtype: a bfloat16 or float16 leaf adds that cast's rounding, up to
``u |deQ(Q(v))|`` (``u`` = 2^-8 for bfloat16, 2^-11 for float16). A block whose ``max_b |v| / qmax`` is
below float32's smallest normal number (about 1.18e-38, i.e. ``max_b |v|``
below about 5.3e-36 for fp8, 1.5e-36 for int8) takes that number as its
scale (:data:`SCALE_FLOOR`): its error is then at most the format's bound
times ``qmax * SCALE_FLOOR`` instead of times ``max_b |v|`` (a floor), and
never NaN. Subnormal inputs (below 1.18e-38) may be flushed to zero (XLA:CPU
and GPUs do): any value's error may be ``SCALE_FLOOR`` more. A finite value
never decodes to +-inf (scales are at most :func:`largest_scale`). float64
values beyond float32's range saturate to +-3.4e38 (the codecs compute in
float32): their error is ``|v| - 3.4e38``, not bounded; the bounds hold for
values within float32's range. A block of zeros has scale 1 and decodes to
zeros. A block with NaN or +-inf has scale NaN and decodes to NaN, all of
it; top-k ranks NaN and +-inf above every finite value, so a chunk with
non-finite values sends ``min(k, their count)`` of them as they were (the
others, like any unsent value, arrive as 0): a chunk with a non-finite
value never arrives all finite.

Error feedback (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes
SignSGD", ICML 2019): each worker keeps ``e`` and sends
``Q(v + e)``, then ``e <- v + e - deQ(Q(v + e))``, so that the sum of what
was sent tracks the sum of the ``v`` within one quantization error. The
residual is a float32 sum like any other: with top-k it accumulates the
unsent values, so values near float32's largest overflow it to +-inf
within a few syncs.

:func:`mix_compressed` applies one gossip round ``W`` to quantized values:
``x_i <- w_ii x_i + sum_{j != i} w_ij deQ(Q(x_j))`` (the own term exact),
sending only the payload with one ``ppermute`` per permute term and payload
array, so the bytes of the compiled program are the payload bytes above.

References:
  Koloskova, Stich, Jaggi, `Decentralized Stochastic Optimization and Gossip
  Algorithms with Compressed Communication
  <https://arxiv.org/abs/1902.00340>`_, ICML 2019 (CHOCO; compression
  operators). Dettmers et al., `8-bit Optimizers via Block-wise
  Quantization <https://arxiv.org/abs/2110.02861>`_, ICLR 2022 (block
  scales). Micikevicius et al., `FP8 Formats for Deep Learning
  <https://arxiv.org/abs/2209.05433>`_, 2022 (e4m3). OCP Microscaling
  Formats (MX) v1.0, 2023 (e2m1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from decentral_jax import checks
from decentral_jax import wire_format
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.topology import schedules as topology_lib

PyTree = Any
Payload = dict

#: Largest code magnitude of each scaled format.
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "fp4": 6.0}
#: The non-negative values of e2m1 (fp4), in code order 0..7.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest ``block`` (:data:`decentral_jax.wire_format.MAX_BLOCK`).
MAX_BLOCK = wire_format.MAX_BLOCK


@dataclasses.dataclass(frozen=True)
class Compressor:
  """A compression format for what one worker sends.

  Attributes:
    format: one of :data:`decentral_jax.wire_format.FORMATS`.
    block: values per float32 scale (scaled formats) or per top-k chunk;
      an int in ``[2, MAX_BLOCK]`` (even for the 4-bit formats).
    fraction: ``topk`` only, the fraction of each chunk kept, in (0, 1]
      (None: :data:`decentral_jax.wire_format.DEFAULT_FRACTION`); None for
      the other formats.

  Raises:
    ValueError: an unknown format, a block outside ``[2, MAX_BLOCK]`` (odd
      for 4-bit formats), a fraction outside (0, 1], or a fraction given
      with a format other than ``topk``, naming the argument.
  """
  format: str = "none"
  block: int = wire_format.DEFAULT_BLOCK
  fraction: float | None = None

  def __post_init__(self):
    checks.check_choice("format", self.format, wire_format.FORMATS)
    checks.check_int("block", self.block, minimum=2, maximum=MAX_BLOCK)
    if self.format in ("int4", "fp4") and self.block % 2:
      raise ValueError(f"block must be even for {self.format} (two values "
                       f"per byte), got {self.block}.")
    if self.format != "topk":
      if self.fraction is not None:
        raise ValueError(f"fraction applies to format 'topk' only, got "
                         f"fraction={self.fraction!r} with format "
                         f"{self.format!r}; leave it out.")
      return
    fraction = (wire_format.DEFAULT_FRACTION if self.fraction is None
                else self.fraction)
    object.__setattr__(self, "fraction", checks.check_probability(
        "fraction", fraction, open_min=True))

  @property
  def is_identity(self) -> bool:
    return self.format == "none"

  def kept(self) -> int:
    """``topk``: values kept per chunk of ``block``."""
    return wire_format.kept(self.block, self.fraction)

  def payload_bytes(self, n_values: int, itemsize: int = 4) -> int:
    """Bytes one worker sends for ``n_values`` values (the table above).

    Args:
      n_values: number of values ``N`` (int >= 0).
      itemsize: bytes per value of the uncompressed dtype (int >= 1;
        ``none`` only).

    Raises:
      ValueError: ``n_values`` or ``itemsize`` out of range.
    """
    n = checks.check_int("n_values", n_values, minimum=0)
    itemsize = checks.check_int("itemsize", itemsize, minimum=1)
    return wire_format.payload_bytes(self.format, n, self.block,
                                     self.fraction, itemsize)

  def encode(self, v: jax.Array) -> Payload:
    """The payload of ``v`` (float, any shape): a dict of flat arrays.

    Raises:
      ValueError: ``v`` not of a floating dtype.
    """
    _check_value(v)
    if self.format == "none":
      return {"values": v}
    blocks = _blocks(v, self.block)
    if self.format == "topk":
      return _topk_encode(blocks, self.kept())
    scale = _scales(blocks, QMAX[self.format])
    y = blocks / scale[:, None]
    if self.format == "int8":
      codes = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    elif self.format == "fp8":
      codes = lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
    elif self.format == "int4":
      codes = _pack4((jnp.clip(jnp.round(y), -7, 7) + 8).astype(jnp.uint8))
    else:
      codes = _pack4(_e2m1_codes(y))
    return {"codes": codes, "scales": scale}

  def decode(self, payload: Payload, like: jax.Array) -> jax.Array:
    """``deQ``: the values a payload stands for, shaped and typed as ``like``."""
    if self.format == "none":
      return payload["values"]
    if self.format == "topk":
      blocks = _topk_decode(payload, self.block)
    else:
      codes, scale = payload["codes"], payload["scales"]
      if self.format == "int8":
        y = codes.astype(jnp.float32)
      elif self.format == "fp8":
        y = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(
            jnp.float32)
      elif self.format == "int4":
        y = _unpack4(codes).astype(jnp.float32) - 8.0
      else:
        y = _e2m1_values(_unpack4(codes))
      blocks = y * scale[:, None]
    flat = blocks.reshape(-1)[:like.size]
    return flat.reshape(like.shape).astype(like.dtype)

  def roundtrip(self, v: jax.Array) -> jax.Array:
    """``deQ(Q(v))`` (``v`` any floating array-like, e.g. a list).

    Raises:
      ValueError: ``v`` not of a floating dtype (a string named as such),
        a dict, or a ragged list.
    """
    _check_value(v)
    v = jnp.asarray(v)
    return self.decode(self.encode(v), v)


def _check_value(v) -> None:
  """A ValueError unless ``v`` is one floating array (or array-like)."""
  if v is None:
    raise ValueError("Compressor.encode: the value is None; pass a floating "
                     "array.")
  if isinstance(v, dict):
    raise ValueError("Compressor.encode: the value is a dict (a pytree); "
                     "pass one floating array (jax.tree.map over the leaves "
                     "for a pytree).")
  if isinstance(v, (list, tuple)):
    try:
      np.asarray(v, dtype=np.float64)
    except (ValueError, TypeError):
      raise ValueError("Compressor.encode: the value is a list that is not "
                       "a rectangular array of numbers (ragged or nested "
                       "objects); pass one floating array.") from None
  gossip.check_float_leaves(v, "Compressor.encode", compressed=True)


def to_float32(x) -> jax.Array:
  """``x`` as float32, finite values beyond its range (float64 leaves)
  saturated to ``+-F32_MAX``, not inf; NaN and +-inf kept."""
  x = jnp.asarray(x)
  if (jnp.issubdtype(x.dtype, jnp.floating)
      and float(jnp.finfo(x.dtype).max) > F32_MAX):
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -F32_MAX, F32_MAX), x)
  return x.astype(jnp.float32)


def _blocks(v, block: int) -> jax.Array:
  """``v`` flattened to float32 (:func:`to_float32`), zero-padded to
  ``[nb, block]``, ``nb = ceil(N / B)``: ``[0, block]`` for an empty ``v``
  (nothing is sent, as :meth:`Compressor.payload_bytes` counts)."""
  flat = to_float32(jnp.asarray(v).reshape(-1))
  pad = (-flat.size) % block
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), jnp.float32)])
  return flat.reshape(flat.size // block, block)


#: float32's largest finite value: what a finite value decodes to at most.
F32_MAX = float(np.finfo(np.float32).max)
#: Smallest scale: float32's smallest normal number (a smaller quotient
#: would be flushed to 0 on XLA:CPU, and ``v / 0`` is inf).
SCALE_FLOOR = float(np.finfo(np.float32).tiny)


def largest_scale(qmax: float) -> float:
  """The largest float32 ``s`` with ``qmax * s`` finite: a finite block's
  largest scale (``amax / qmax`` near float32's largest value rounds up)."""
  q = np.float32(qmax)
  s = np.float32(F32_MAX / float(qmax))
  with np.errstate(over="ignore"):
    while not np.isfinite(q * s):
      s = np.nextafter(s, np.float32(0))
  return float(s)


def _scales(blocks, qmax: float) -> jax.Array:
  """``max_b |v| / qmax`` within ``[SCALE_FLOOR, largest_scale(qmax)]``; 1
  for a block of zeros, NaN for one with NaN or inf."""
  amax = jnp.max(jnp.abs(blocks), axis=1)
  finite = jnp.where(jnp.isfinite(amax),
                     jnp.clip(amax / qmax, SCALE_FLOOR, largest_scale(qmax)),
                     jnp.nan)
  return jnp.where(amax == 0, 1.0, finite).astype(jnp.float32)


def _pack4(codes_u8) -> jax.Array:
  """Two 4-bit codes per byte: ``low | high << 4`` ([nb, B] -> [nb, B/2])."""
  return codes_u8[:, 0::2] | (codes_u8[:, 1::2] << 4)


def _unpack4(packed) -> jax.Array:
  low, high = packed & 0xF, packed >> 4
  return jnp.stack([low, high], axis=-1).reshape(packed.shape[0],
                                                 2 * packed.shape[1])


def _e2m1_codes(y) -> jax.Array:
  """Nearest e2m1 value of ``y`` (|y| <= 6): sign << 3 | magnitude index."""
  grid = jnp.asarray(E2M1, jnp.float32)
  idx = jnp.argmin(jnp.abs(jnp.abs(y)[..., None] - grid), axis=-1)
  sign = (y < 0).astype(jnp.uint8)
  return (sign << 3) | idx.astype(jnp.uint8)


def _e2m1_values(codes) -> jax.Array:
  grid = jnp.asarray(E2M1, jnp.float32)
  mag = grid[(codes & 7).astype(jnp.int32)]
  return jnp.where((codes >> 3) == 1, -mag, mag)


def _topk_encode(blocks, k: int) -> Payload:
  mag = jnp.abs(blocks)
  _, idx = lax.top_k(jnp.where(jnp.isnan(mag), jnp.inf, mag), k)
  values = jnp.take_along_axis(blocks, idx, axis=1)
  idx_dtype = jnp.int16 if blocks.shape[1] <= 32768 else jnp.int32
  # int16 holds 0..32767; chunk index 32767 is the largest for block 32768.
  return {"values": values, "indices": idx.astype(idx_dtype)}


def _topk_decode(payload: Payload, block: int) -> jax.Array:
  values, idx = payload["values"], payload["indices"].astype(jnp.int32)
  rows = jnp.arange(values.shape[0])[:, None]
  return jnp.zeros((values.shape[0], block), jnp.float32).at[rows, idx].set(
      values)


# ---------------------------------------------------------------------------
# Error feedback.
# ---------------------------------------------------------------------------


def compress_with_feedback(compressor: Compressor, v: jax.Array,
                           error: jax.Array):
  """One error-feedback step: send ``Q(v + e)``, keep ``v + e - deQ(Q(v + e))``.

  Args:
    compressor: the format.
    v: float array, what this worker wants to send this step.
    error: float array of ``v``'s shape, the residual kept from the last
      step (zeros at the start).

  Returns:
    ``(payload, sent, new_error)``: the payload of ``v + error`` (summed in
    their promoted dtype), ``deQ(payload)`` in ``v``'s dtype (what the
    receivers will decode), and the new residual ``v + error - sent`` in
    ``error``'s dtype (so a loop carry keeps its type), each of ``v``'s
    shape.

  Raises:
    ValueError: ``v`` or ``error`` not of a floating dtype, or ``error``
      not of ``v``'s shape (it was broadcast).
  """
  gossip.check_float_leaves((v, error), "compress_with_feedback",
                            compressed=True)
  if jnp.shape(error) != jnp.shape(v):
    raise ValueError(f"compress_with_feedback: error has shape "
                     f"{tuple(jnp.shape(error))}, but it must have v's "
                     f"{tuple(jnp.shape(v))} (the residual of the same "
                     "message; zeros at the start).")
  v, error = jnp.asarray(v), jnp.asarray(error)
  target = v + error
  payload = compressor.encode(target)
  sent = compressor.decode(payload, target).astype(v.dtype)
  return payload, sent, (target - sent).astype(error.dtype)


# ---------------------------------------------------------------------------
# Compressed gossip.
# ---------------------------------------------------------------------------


def send_payload(payload: Payload, axis_name, perm) -> Payload:
  """Each payload array sent along one permute term (``ppermute`` each)."""
  return {k: collectives.permute(a, axis_name, perm)
          for k, a in payload.items()}


def mix_payload(own: jax.Array, payload: Payload, like: jax.Array, rnd,
                axis_name, me, compressor: Compressor) -> jax.Array:
  """One round of ``W`` over compressed messages, for one leaf.

  Computes ``w_ii own + sum_s w_s deQ(recv_s)``: ``payload`` (this worker's
  message) is sent along each permute term ``s`` of ``rnd`` (one
  ``ppermute`` per term and payload array) and what arrives is decoded in
  ``like``'s shape and dtype, then summed in ``own``'s dtype (the
  accumulation dtype, float32 for 16-bit leaves). Used by
  :func:`mix_compressed` (``own = x``) and CHOCO-gossip
  (:mod:`decentral_jax.optim.choco`, ``own = deQ(Q(x - x_hat))``).

  Args:
    own: this worker's own term, float array in the accumulation dtype.
    payload: ``compressor.encode`` of this worker's message.
    like: an array of the message's shape and dtype.
    rnd: the round (:class:`~decentral_jax.topology.Round`).
    axis_name: the worker axis; ``me``: this worker's index on it.
    compressor: the :class:`Compressor` that made ``payload``.

  Returns:
    ``own``'s shape and dtype. Must be traced inside ``jax.shard_map`` over
    ``axis_name``.
  """
  acc = own.dtype
  out = jnp.asarray(rnd.self_weights, acc)[me] * own
  for term in rnd.terms:
    recv = compressor.decode(send_payload(payload, axis_name, term.perm),
                             like).astype(acc)
    out = out + jnp.asarray(term.weights, acc)[me] * recv
  return out


def _mix_leaf(x, rnd, axis_name, me, compressor: Compressor):
  """``w_ii x_i + sum_s w_s deQ(recv_s)`` for one leaf and one round."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  return mix_payload(x.astype(acc), compressor.encode(x), x, rnd, axis_name,
                     me, compressor).astype(x.dtype)


def check_compressor(compressor) -> None:
  """Raises ``ValueError`` unless ``compressor`` is a :class:`Compressor`."""
  if not isinstance(compressor, Compressor):
    raise ValueError(f"compressor must be a decentral_jax.comm.compress."
                     f"Compressor, got {type(compressor).__name__}.")


def mix_compressed(tree: PyTree, topology: topology_lib.Topology, step,
                   axis_name="workers", *, compressor: Compressor) -> PyTree:
  """One gossip round with quantized or sparsified messages.

  Computes ``x_i <- w_ii x_i + sum_{j != i} w_ij deQ(Q(x_j))`` per leaf
  (``W = W_step`` of ``topology``; weights and sums in float32 for 16-bit
  leaves), sending each worker's payload once per permute term of the round.
  Must be traced inside ``jax.shard_map`` over ``axis_name`` (as
  :func:`decentral_jax.comm.gossip.mix`). With ``Compressor("none")`` the
  values sent are exact, but a round of group means is realised with
  permutes rather than ``pmean``; use ``gossip.mix`` for uncompressed
  gossip.

  Args:
    tree: pytree of floating arrays, this worker's values.
    topology: doubly stochastic :class:`~decentral_jax.topology.Topology`.
    step: Python int (that round only) or a traced integer scalar, equal on
      all workers (the round is chosen with ``lax.switch`` on
      ``step % period``).
    axis_name: the worker axis (as for ``gossip.mix``).
    compressor: the :class:`Compressor`.

  Returns:
    The mixed pytree (same structure, shapes, dtypes).

  Raises:
    ValueError: a non-floating leaf, a compressor or topology of the wrong
      type, a non-integer ``step``, called outside ``shard_map`` over
      ``axis_name``, or ``topology.n_workers`` other than the axis size.
  """
  check_compressor(compressor)
  gossip.check_topology(topology)
  gossip.check_float_leaves(tree, "compressed gossip", compressed=True)
  gossip.check_step(step)
  gossip.check_axis(topology, axis_name)
  return gossip.map_round(
      lambda rnd, t: jax.tree.map(
          lambda x: _mix_leaf(x, rnd, axis_name,
                              collectives.index(axis_name), compressor),
          t),
      topology, step, tree)


def payload_bytes_per_round(tree: PyTree, topology: topology_lib.Topology,
                            step: int, compressor: Compressor) -> int:
  """Hand count: bytes one worker sends in round ``step`` of :func:`mix_compressed`.

  ``(number of permute terms in which this worker sends) x payload bytes``
  summed over leaves; the busiest worker's count (every worker of a
  built-in topology sends in each term).
  """
  rnd = topology.round(int(step))
  n_terms = len(rnd.terms)
  return n_terms * sum(
      compressor.payload_bytes(int(np.prod(np.shape(x))),
                               jnp.dtype(jnp.result_type(x)).itemsize)
      for x in jax.tree.leaves(tree))


def relative_error_bound(compressor: Compressor) -> float:
  """Largest ``|deQ(Q(v)) - v| / max_b |v|`` of one value, for scaled formats.

  int8: ``1 / (2 * 127)``; int4: ``1 / 14``; fp8 e4m3: ``2^-4`` (half an
  ulp of 3 mantissa bits, relative to the value, which is <= the block
  max); fp4 e2m1: ``1 / 6`` (half the largest gap, 2 between 4 and 6,
  over qmax 6); for a block with ``max_b |v| < qmax * SCALE_FLOOR`` the
  bound holds relative to ``qmax * SCALE_FLOOR`` instead (the floor of the
  module docstring), and any value may be off by ``SCALE_FLOOR`` more (a
  subnormal input flushed to zero); a bfloat16 or float16 leaf adds the
  cast of the decoded value to its dtype (``u |deQ(Q(v))|``, ``u`` its
  unit roundoff); for float64 leaves the bound holds for blocks within
  float32's range (a value beyond it saturates to ``F32_MAX``). Each bound
  carries ``2^-22`` of slack (four float32 unit roundoffs ``u = 2^-24``):
  the scale ``max_b |v| / qmax``, the quotient ``v / s_b`` and the decoded
  ``code * s_b`` are each rounded to float32, which adds at most about
  ``2u max_b |v|`` to the half step (e.g. int8 ``[4.3447204, 4.2591944,
  -4.2591944, 0.5101005]`` is off by ``1/254 + 1.5u`` of its block max).
  Raises ValueError for ``none`` and ``topk``, and for a ``compressor``
  that is not a :class:`Compressor`.
  """
  check_compressor(compressor)
  bounds = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 2.0 ** -4, "fp4": 1 / 6}
  if compressor.format not in bounds:
    raise ValueError(f"format {compressor.format!r} has no relative error "
                     "bound (none is exact; topk drops values).")
  return bounds[compressor.format] + 2.0 ** -22
