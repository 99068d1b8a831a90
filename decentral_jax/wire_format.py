"""What a compressed payload costs on the wire: formats and bytes per payload.

One worker sends ``N`` values in one of :data:`FORMATS`. ``B`` values share
one float32 scale (scaled formats) or form one top-k chunk,
``nb = ceil(N / B)`` blocks, the last one zero-padded and sent:

==========  ==========================  ====================================
format      bytes sent                  per value
==========  ==========================  ====================================
``none``    ``N itemsize``              the value in its own dtype
``int8``    ``nb (B + 4)``              1 byte + 4 bytes of scale per block
``fp8``     ``nb (B + 4)``              (e4m3) as int8
``int4``    ``nb (B/2 + 4)``            half a byte (two per byte) + scale
``fp4``     ``nb (B/2 + 4)``            (e2m1) as int4
``topk``    ``nb k (4 + idx)``          ``k = max(1, round(fraction B))``
                                        float32 values of each chunk and
                                        their indices: ``idx`` = 2 bytes
                                        (int16) for ``B <= 32768``, else 4
==========  ==========================  ====================================

The codec (:mod:`decentral_jax.comm.compress`) and the runtime model
(:mod:`decentral_jax.runtime_model.compression`) both count bytes with
:func:`payload_bytes`. Pure Python: it imports nothing else from the
library, and no JAX.

Units: bytes.

References:
  Dettmers et al., 8-bit Optimizers via Block-wise Quantization, ICLR 2022
  (block scales). Micikevicius et al., FP8 Formats for Deep Learning, 2022
  (e4m3). OCP Microscaling Formats (MX) v1.0, 2023 (e2m1).
"""

from __future__ import annotations

#: The compressed formats (what the runtime model prices).
COMPRESSED = ("int8", "fp8", "int4", "fp4", "topk")
#: Every format a compressor accepts; ``none`` sends the values as they are.
FORMATS = ("none",) + COMPRESSED
#: Formats of two values per byte (their block must be even).
FOUR_BIT = ("int4", "fp4")
#: Values per float32 scale or per top-k chunk when none is given.
DEFAULT_BLOCK = 256
#: Largest ``block`` the codec and the runtime model accept: every leaf is
#: padded to at least one block (and a compressed mean to ``n`` blocks), so
#: a larger one only costs memory.
MAX_BLOCK = 2 ** 20
#: ``topk``'s fraction of each chunk when none is given.
DEFAULT_FRACTION = 0.01
#: Bytes of one block's float32 scale, and of one top-k value.
SCALE_BYTES = 4


def kept(block: int, fraction: float) -> int:
  """Top-k: values kept per chunk of ``block``, ``max(1, round(fraction B))``
  and at most ``B``."""
  return max(1, min(block, int(round(fraction * block))))


def index_bytes(block: int) -> int:
  """Bytes of one top-k index: 2 (int16) for ``block <= 32768``, else 4."""
  return 2 if block <= 32768 else 4


def payload_bytes(fmt: str, n_values: int, block: int = DEFAULT_BLOCK,
                  fraction: float = DEFAULT_FRACTION,
                  itemsize: int = 4) -> int:
  """Bytes one worker sends for ``n_values`` values (the module table).

  Args:
    fmt: one of :data:`FORMATS`.
    n_values: ``N``, an int >= 0.
    block: ``B``, an int >= 2 (even for :data:`FOUR_BIT`).
    fraction: ``topk`` only, in (0, 1].
    itemsize: ``none`` only, bytes per value of the uncompressed dtype.

  Returns:
    int bytes. The arguments are not checked here: the codec and the
    runtime model check them where they are given.
  """
  if fmt == "none":
    return n_values * itemsize
  blocks = -(-n_values // block)
  if fmt in ("int8", "fp8"):
    return blocks * (block + SCALE_BYTES)
  if fmt in FOUR_BIT:
    return blocks * (block // 2 + SCALE_BYTES)
  return blocks * kept(block, fraction) * (SCALE_BYTES + index_bytes(block))
