"""Compressed communication priced: bytes on the wire and codec time.

The formats of :mod:`decentral_jax.comm.compress`, whose bytes both the
codec and this model count with :func:`decentral_jax.wire_format.
payload_bytes` (the table of bytes per format is in
:mod:`decentral_jax.wire_format`). ``N`` values, ``B`` values per block
(per float32 scale, or per top-k chunk), ``nb = ceil(N / B)`` blocks, the
last one zero-padded and sent.

Where it is sent:

* **gossip** (CHOCO-gossip, :mod:`decentral_jax.optim.choco`): every round
  is realised with its point-to-point ``ppermute`` terms (a group mean of
  ``g`` workers as ``g - 1`` terms), each carrying the payload of the
  ``N``-value difference ``x - x_hat``; its message needs the step's
  update, so the gossip is not overlapped with compute, except pipelined
  CHOCO-gossip's (``pipelined=1``), the round of the step's input
  parameters, overlapped as plain gossip's;
* **local-update syncs, scaled formats** (``int8``, ``fp8``, ``int4``,
  ``fp4``; :func:`decentral_jax.comm.compressed_mean.mean_compressed`): each value
  padded to a multiple of ``n B``, a reduce-scatter of the codes
  (all-to-all of shards, float32 sums) and an all-gather of the
  re-quantized mean, ``2 (n-1)/n x payload`` per worker, priced as an
  all-reduce of the payload;
* **local-update syncs, top-k** (:func:`decentral_jax.comm.compress.
  gather_mean_compressed`, SparseLoCo's aggregation): every worker's
  indices and values all-gathered (a sum of sparse vectors is not sparse,
  so there is nothing to reduce-scatter) and the ``n`` decoded vectors
  summed in float32, ``(n-1) x payload`` per worker, priced as an
  all-gather (:func:`decentral_jax.runtime_model.costs.all_gather_cost`).
  The library encodes every leaf on its own (its last chunk padded to
  ``B``); the model, which knows no leaf sizes, prices the ``N`` values
  as one buffer padded to a multiple of ``B``, a lower bound short of what
  is sent by at most one chunk per leaf after the first
  (:func:`topk_leaf_padding_bytes`; the tests' tiny GPT, 9 leaves at ``B =
  256``: 29 chunks priced, 32 sent, +10 %; ``configs/gpt_tiny.py``:
  +0.12 %; GPT-2 small, every leaf a multiple of 256 values: exact).

Codec time: quantizing or dequantizing is device work, serial with the
compute. It is priced from :attr:`~decentral_jax.runtime_model.costs.Cluster.
codec_Bps`, the float32 bytes one device quantizes or dequantizes per second
(default 100 GB/s, an assumption; docs/runtime_model.md): per gossip step
``N`` values quantized and ``1 + T`` payloads of ``N`` values dequantized
(its own and one per term received); per scaled-format sync ``(1 + 1/n) N``
quantized (its values, then its mean shard) and ``2 N`` dequantized (the
``n`` contributions to its shard, then the gathered shards); per top-k
sync ``N`` encoded and ``n N`` decoded (each gathered payload scattered
into ``N`` zeros and added).

Units: bytes, seconds, bytes per second.

References:
  Koloskova, Stich, Jaggi, Decentralized Stochastic Optimization and Gossip
  Algorithms with Compressed Communication, ICML 2019 (CHOCO). Dettmers et
  al., 8-bit Optimizers via Block-wise Quantization, ICLR 2022 (block
  scales). Douillard et al., Streaming DiLoCo with overlapping
  communication, arXiv 2501.18512 (4-bit pseudo-gradients). Sarfi et al.,
  SparseLoCo, arXiv 2508.15706 (all-gathered top-k pseudo-gradients).
"""

from __future__ import annotations

import math

from decentral_jax import checks
from decentral_jax import wire_format
from decentral_jax.wire_format import COMPRESSED
from decentral_jax.wire_format import DEFAULT_BLOCK
from decentral_jax.wire_format import DEFAULT_FRACTION
from decentral_jax.wire_format import FOUR_BIT

#: Formats whose local-update sync is an all-gather of every worker's
#: payload (the rest: reduce-scatter of codes, all-gather of the mean).
GATHERED = ("topk",)
VALUE_BYTES = 4  # the codec reads / writes float32 values


def check(fmt: str, block, fraction, where: str) -> None:
  """Checks a format and its block and fraction.

  Raises:
    ValueError: naming ``where``: an unknown format, a block that is not an
      integer in ``[2, wire_format.MAX_BLOCK]`` (even for the 4-bit
      formats; the codec's bound), a fraction outside (0, 1].
  """
  if fmt not in COMPRESSED:
    raise ValueError(f"{where}: compress={fmt!r} is not a format; use one of "
                     f"{', '.join(COMPRESSED)}.")
  if not checks.is_int(block) or not 2 <= block <= wire_format.MAX_BLOCK:
    raise ValueError(f"{where}: block={block!r} must be an integer in [2, "
                     f"{wire_format.MAX_BLOCK}] (values per scale or per "
                     "top-k chunk; the codec's bound).")
  if fmt in FOUR_BIT and block % 2:
    raise ValueError(f"{where}: block={block} must be even for {fmt} (two "
                     "values per byte).")
  if not checks.is_number(fraction) or not 0 < fraction <= 1:
    raise ValueError(f"{where}: fraction={fraction!r} must be in (0, 1] (the "
                     "share of each chunk top-k keeps).")


def payload_bytes(fmt: str, n_values: float, block: int = DEFAULT_BLOCK,
                  fraction: float = DEFAULT_FRACTION) -> float:
  """Bytes one worker sends for ``n_values`` values (module table), a float.

  Args:
    fmt: one of :data:`decentral_jax.wire_format.COMPRESSED`.
    n_values: ``N`` (rounded up to an integer).
    block: ``B``.
    fraction: top-k only.
  """
  return float(wire_format.payload_bytes(fmt, math.ceil(n_values), block,
                                         fraction))


def padded_values(n_values: float, n_workers: int, block: int) -> int:
  """``N`` padded as the compressed all-reduce pads it: a multiple of ``n B``
  (0 for no values: an empty leaf sends nothing)."""
  unit = n_workers * block
  return math.ceil(math.ceil(n_values) / unit) * unit


def all_reduce_payload(fmt: str, n_values: float, n_workers: int,
                       block: int = DEFAULT_BLOCK,
                       fraction: float = DEFAULT_FRACTION) -> float:
  """The payload ``P`` whose all-reduce moves ``2 (n-1)/n P`` per worker."""
  return payload_bytes(fmt, padded_values(n_values, n_workers, block), block,
                       fraction)


def gossip_codec_values(n_values: float, received: float) -> float:
  """Values a worker quantizes and dequantizes per compressed gossip step."""
  return n_values * (2.0 + received)


def all_reduce_codec_values(n_values: float, n_workers: int) -> float:
  """Values a worker quantizes and dequantizes per compressed all-reduce."""
  return n_values * (3.0 + 1.0 / n_workers)


def gather_codec_values(n_values: float, n_workers: int) -> float:
  """Values a worker encodes and decodes per top-k all-gather: ``(1 + n) N``."""
  return n_values * (1.0 + n_workers)


def gathers(fmt: str) -> bool:
  """Whether a local-update sync in ``fmt`` is an all-gather (:data:`GATHERED`)."""
  return fmt in GATHERED


def sync_payload(fmt: str, n_values: float, n_workers: int,
                 block: int = DEFAULT_BLOCK,
                 fraction: float = DEFAULT_FRACTION) -> float:
  """Payload ``P`` of one worker in a local-update sync of ``n_values`` values.

  Top-k (all-gathered): :func:`payload_bytes` of ``N`` (padded to a
  multiple of ``B``), each worker sending ``(n-1) P``: a lower bound, since
  the library pads every leaf's last chunk (at most
  :func:`topk_leaf_padding_bytes` more). Scaled formats
  (reduce-scatter and all-gather): :func:`all_reduce_payload` (``N``
  padded to a multiple of ``n B``), ``2 (n-1)/n P`` each.
  """
  if gathers(fmt):
    return payload_bytes(fmt, n_values, block, fraction)
  return all_reduce_payload(fmt, n_values, n_workers, block, fraction)


def topk_leaf_padding_bytes(n_leaves: int, block: int = DEFAULT_BLOCK,
                            fraction: float = DEFAULT_FRACTION) -> float:
  """Most bytes per-leaf top-k adds to the priced :func:`sync_payload`.

  The library encodes and all-gathers top-k leaf by leaf
  (:func:`decentral_jax.comm.compressed_mean.gather_mean_compressed`):
  leaves of ``n_1 .. n_L`` values send ``sum_l ceil(n_l / B)`` chunks of
  ``k (4 + idx)`` bytes, where the model prices ``ceil(N / B)`` for ``N =
  sum_l n_l``. Each ceiling adds less than one chunk, so the leaves send
  at most ``L - 1`` chunks more: ``(L - 1) k (4 + idx)`` bytes (0 when
  every leaf but one holds a multiple of ``B`` values); what one
  worker sends per sync lies in ``[P, P + this]`` times ``n - 1``.

  Raises:
    ValueError: ``n_leaves`` not an int >= 1, or a bad block or fraction.
  """
  leaves = checks.check_int("n_leaves", n_leaves, minimum=1)
  check("topk", block, fraction, "topk_leaf_padding_bytes")
  return payload_bytes("topk", (leaves - 1) * block, block, fraction)


def sync_codec_values(fmt: str, n_values: float, n_workers: int) -> float:
  """Values a worker encodes and decodes per local-update sync in ``fmt``."""
  if gathers(fmt):
    return gather_codec_values(n_values, n_workers)
  return all_reduce_codec_values(n_values, n_workers)


def codec_seconds(values: float, codec_Bps: float) -> float:
  """Seconds to quantize or dequantize ``values`` float32 values."""
  return VALUE_BYTES * values / codec_Bps


def parse(spec, given: dict) -> tuple[str | None, int, float]:
  """``(format or None, block, fraction)`` of a spec's ``compress`` keys.

  ``given``: the spec's ``KEY=VALUE`` parameters. ``compress=none`` (or no
  ``compress``) is no compression; ``block`` needs a format and
  ``fraction`` the ``topk`` format.

  Raises:
    ValueError: quoting the spec: a bad format, block or fraction, or
      ``block`` / ``fraction`` without a format that uses them.
  """
  fmt = given.get("compress", "none").strip().lower()
  fmt = None if fmt == "none" else fmt
  if fmt is None and ("block" in given or "fraction" in given):
    raise ValueError(f"{spec!r}: block and fraction need compress=<format>, "
                     "e.g. compress=int8,block=128.")
  if "fraction" in given and fmt != "topk":
    raise ValueError(f"{spec!r}: fraction applies to compress=topk only.")
  block = given.get("block", str(DEFAULT_BLOCK)).strip()
  block = int(block) if block.isdigit() else block
  try:
    fraction = float(given.get("fraction", DEFAULT_FRACTION))
  except ValueError:
    fraction = given["fraction"]
  if fmt is not None:
    check(fmt, block, fraction, repr(spec))
  return fmt, block, fraction


def name_parts(fmt: str, block: int, fraction: float) -> list[str]:
  """A method name's parts for a format: ``compress``, ``block`` [, ``fraction``]."""
  parts = [f"compress={fmt}", f"block={block}"]
  if fmt == "topk":
    parts.append(f"fraction={fraction:g}")
  return parts
