"""The wire format's bytes per payload, worked by hand for every format, and
the codec and the runtime model counting with it."""

from __future__ import annotations

import pytest

from decentral_jax import wire_format
from decentral_jax.comm import compress
from decentral_jax.runtime_model import compression


def test_hand_worked_payload_bytes():
  # none: N values of their own itemsize.
  assert wire_format.payload_bytes("none", 1000, itemsize=2) == 2000
  # int8 / fp8, B = 256, N = 257: 2 blocks of 256 codes + a float32 scale.
  assert wire_format.payload_bytes("int8", 257) == 2 * 260
  assert wire_format.payload_bytes("fp8", 256) == 260
  # int4 / fp4: two codes per byte, B = 64, N = 65: 2 blocks of 32 + 4.
  assert wire_format.payload_bytes("int4", 65, 64) == 2 * 36
  assert wire_format.payload_bytes("fp4", 0, 64) == 0
  # top-k 30% of B = 64: round(19.2) = 19 values of 4 + 2 bytes per chunk.
  assert wire_format.payload_bytes("topk", 128, 64, 0.3) == 2 * 19 * 6
  # B > 32768: int32 indices; 1% of 40000 = 400 values of 4 + 4 bytes.
  assert wire_format.payload_bytes("topk", 40000, 40000, 0.01) == 400 * 8


def test_kept_is_at_least_one_and_at_most_the_block():
  assert wire_format.kept(256, 0.01) == 3  # round(2.56)
  assert wire_format.kept(2, 0.01) == 1
  assert wire_format.kept(64, 1.0) == 64
  assert wire_format.index_bytes(32768) == 2
  assert wire_format.index_bytes(32769) == 4


@pytest.mark.parametrize("fmt", wire_format.COMPRESSED)
def test_the_codec_and_the_runtime_model_count_with_it(fmt):
  comp = compress.Compressor(fmt, 64, 0.3 if fmt == "topk" else None)
  want = wire_format.payload_bytes(fmt, 1001, 64, 0.3)
  assert comp.payload_bytes(1001) == want
  # The runtime model rounds a fractional N up.
  assert compression.payload_bytes(fmt, 1000.5, 64, 0.3) == float(want)


def test_the_formats():
  assert wire_format.FORMATS == ("none",) + wire_format.COMPRESSED
  assert set(wire_format.FOUR_BIT) <= set(wire_format.COMPRESSED)
