"""Compressed communication in the runtime model: the byte formula against
the library's compressors, hand-worked sync and gossip times, the
break-even bandwidth, and which compressed methods the library runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax import topology
from decentral_jax.comm import compress
from decentral_jax.optim import choco
from decentral_jax.runtime_model.cli import main as cli
from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model import core
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import traffic

SIZES = (1, 255, 256, 257, 1000, 4096, 100_003, 1_000_000)


@pytest.mark.parametrize("fmt", compression.FORMATS)
@pytest.mark.parametrize("block", [2, 64, 256, 40000])
def test_payload_bytes_equal_the_compressors(fmt, block):
  for fraction in (0.01, 0.3, 1.0):
    comp = compress.Compressor(
        fmt, block, fraction if fmt == "topk" else None)
    for n in SIZES:
      assert compression.payload_bytes(fmt, n, block, fraction) == (
          comp.payload_bytes(n)), (fmt, block, fraction, n)


@pytest.mark.parametrize("fmt", ["int8", "fp4", "topk"])
def test_all_reduce_bytes_equal_the_compressed_mean(fmt):
  # One leaf of N values: the model's 2(n-1)/n x payload(N padded to n B)
  # against comm.compress's hand count of mean_compressed.
  for n_workers in (2, 3, 8):
    for n in (1, 1000, 70_001):
      comp = compress.Compressor(fmt, 128,
                                 0.05 if fmt == "topk" else None)
      want = compress.mean_payload_bytes(
          {"x": np.zeros(n, np.float32)}, n_workers, comp)
      got = 2 * (n_workers - 1) / n_workers * compression.all_reduce_payload(
          fmt, n, n_workers, 128, 0.05)
      assert got == pytest.approx(want, rel=1e-15), (n_workers, n)


def test_hand_worked_payloads():
  # int8, B = 256, N = 1e6: ceil(1e6 / 256) = 3907 blocks of 260 bytes.
  assert compression.payload_bytes("int8", 1e6) == 3907 * 260
  # fp4: 3907 blocks of 128 + 4 bytes.
  assert compression.payload_bytes("fp4", 1e6) == 3907 * 132
  # top-k 1% of 256 = round(2.56) = 3 values of 4 + 2 bytes per chunk.
  assert compression.payload_bytes("topk", 1e6) == 3907 * 3 * 6
  # The all-reduce pads to a multiple of n B = 1024: 977 x 1024 values.
  assert compression.all_reduce_payload("int8", 1e6, 4) == 977 * 4 * 260


N = 1_000_000
A, B_LINK = 5e-6, 1.25e9  # latency (s) and link (bytes/s) per node
CODEC = 20e9  # float32 bytes per second


def _cluster(**kw):
  base = dict(n_workers=4, local_size=1, inter_latency_s=A,
              nic_bandwidth_Bps=B_LINK, multi_node="ring", codec_Bps=CODEC)
  base.update(kw)
  return core.Cluster(**base)


def _workload(step_s=0.01):
  return core.Workload(N, step_s / 3, 2 * step_s / 3, bucket_bytes=1e15)


def test_compressed_diloco_sync_by_hand():
  # 4 workers on 4 nodes, flat ring: 2*3 a + 2*3/4 P / b per all-reduce;
  # P = 977 * 4 * 260 bytes (int8); codec (3 + 1/4) N float32 values.
  c, w = _cluster(), _workload()
  x, h = 0.01, 10
  payload = 977 * 4 * 260
  sync = 6 * A + 1.5 * payload / B_LINK
  codec = 3.25 * N * 4 / CODEC
  want = x + (sync + codec) / h
  spec = "diloco:H=10,compress=int8"
  est = core.closed_form(spec, c, w)
  assert est.iteration_s == pytest.approx(want, rel=1e-12)
  assert est.compute_s == pytest.approx(x)
  assert est.exposed_comm_s == pytest.approx((sync + codec) / h)
  assert core.simulate(spec, c, w, steps=60, warmup=10) == pytest.approx(want)
  sent = traffic.bytes_per_iteration(spec, c, w)
  assert sent.worker_bytes == pytest.approx(1.5 * payload / h)
  # Uncompressed: 4 N float32 bytes.
  plain = core.closed_form("diloco:H=10", c, w).iteration_s
  assert plain == pytest.approx(x + (6 * A + 1.5 * 4 * N / B_LINK) / h)


def test_choco_gossip_by_hand():
  # static_ring on 4 workers: 2 permute terms, each a + P / b (one flow per
  # node and direction), blocking: T = x + codec + 2 (a + P / b), codec =
  # (2 + 2) N float32 values (quantize once, dequantize own and 2 received).
  c, w = _cluster(), _workload()
  payload = 3907 * 260
  codec = 4 * N * 4 / CODEC
  want = 0.01 + codec + 2 * (A + payload / B_LINK)
  spec = "dadam:topology=static_ring,compress=int8"
  m = core.make_method(spec, c)
  assert (m.kind, m.overlap, m.compress) == ("gossip", False, "int8")
  assert core.closed_form(m, c, w).iteration_s == pytest.approx(want)
  assert core.simulate(m, c, w, steps=30, warmup=5) == pytest.approx(want)
  sent = traffic.bytes_per_iteration(m, c, w)
  tree = {"x": np.zeros(N, np.float32)}
  want_bytes = compress.payload_bytes_per_round(
      tree, topology.make("static_ring", 4), 0, compress.Compressor("int8"))
  assert sent.worker_bytes == want_bytes == 2 * payload


def test_group_rounds_are_sent_as_permute_terms():
  # complete on 4 workers: one group mean uncompressed, 3 permute terms of
  # the payload compressed (as comm.compress.mix_compressed sends them).
  c, w = _cluster(), _workload()
  m = core.make_method("complete:compress=fp8,block=128", c)
  payload = compression.payload_bytes("fp8", N, 128)
  rc = m.round_costs(c, w)[0]
  assert rc.time(payload)[0] == pytest.approx(3 * (A + payload / B_LINK))
  sent = traffic.bytes_per_iteration(m, c, w)
  assert sent.worker_bytes == pytest.approx(3 * payload)


def test_break_even_bandwidth_by_hand():
  # DiLoCo without latency or compute variability: T_plain = x + 1.5 * 4N /
  # b / H and T_int8 = x + (1.5 P / b + codec) / H are equal at
  # b* = 1.5 (4N - P) / codec.
  c, w = _cluster(inter_latency_s=0.0), _workload()
  m = core.make_method("diloco:H=10,compress=int8", c)
  payload = 977 * 4 * 260
  codec = 3.25 * N * 4 / CODEC
  b_star = 1.5 * (4 * N - payload) / codec
  be = recommend.break_even(m, c, w)
  assert be.link == "nic_bandwidth_Bps"
  assert be.baseline == "diloco:H=10"
  assert be.break_even_Bps == pytest.approx(b_star, rel=1e-9)
  assert be.rate_Bps == B_LINK
  below = recommend.with_link_rate(c, 0.9 * b_star)
  above = recommend.with_link_rate(c, 1.1 * b_star)
  t = lambda spec, cl: core.closed_form(spec, cl, w).iteration_s
  assert t(m, below) < t("diloco:H=10", below)
  assert t(m, above) > t("diloco:H=10", above)
  line = recommend.break_even_line(m.name, be)
  assert f"below {8 * b_star / 1e9:.3g} Gbit/s" in line
  assert ("pays here" if B_LINK < b_star else "does not pay here") in line


def test_break_even_of_compressed_gossip_is_where_the_times_cross():
  c, w = _cluster(), _workload()
  m = core.make_method("static_ring:compress=int4", c)
  be = recommend.break_even(m, c, w)
  assert be.baseline == "static_ring"
  assert 0 < be.break_even_Bps < math.inf
  at = recommend.with_link_rate(c, be.break_even_Bps)
  plain = core.make_method("static_ring", c)
  assert core.closed_form(m, at, w).iteration_s == pytest.approx(
      core.closed_form(plain, at, w).iteration_s, rel=1e-6)


@pytest.mark.parametrize("name", topology.NAMES)
def test_library_gap_of_compressed_gossip_follows_choco(name):
  # The model calls compressed gossip runnable exactly where
  # optim.choco.choco_gossip accepts the topology.
  c = _cluster(n_workers=8)
  try:
    topo = topology.make(name, 8, 1)
  except ValueError:
    pytest.skip(f"{name} needs another worker count")
  m = core.make_method(f"{name}:compress=int8", c)
  try:
    choco.choco_gossip(topo, compress.Compressor("int8"), 0.5)
    runs = True
  except ValueError:
    runs = False
  assert (method_lib.library_gap(m) is None) == runs, name


def test_compressed_specs_parse_and_refuse():
  c = _cluster()
  m = core.make_method("diloco:H=10,compress=fp4,block=128", c)
  assert (m.name, m.compress, m.compress_block) == (
      "diloco:H=10,compress=fp4,block=128", "fp4", 128)
  assert method_lib.library_gap(m) is not None
  m = core.make_method("streaming_diloco:H=8,P=2,compress=topk,fraction=0.02",
                       c)
  assert m.compress_fraction == 0.02 and m.name.endswith("fraction=0.02")
  m = core.make_method("accum_adam:compress=int8,topology=static_ring", c)
  assert m.name == "accum_adam:T=4,topology=static_ring,compress=int8,block=256"
  for bad, match in (("dadam:compress=int3", "int3"),
                     ("dadam:compress=int4,block=7", "even"),
                     ("dadam:block=64", "need compress"),
                     ("diloco:H=4,compress=int8,topology=ring", "kind 'local'"),
                     ("static_ring:compress=topk,fraction=0", "fraction"),
                     ("diloco:compress=int8,comm_dtype=bfloat16", "not both"),
                     ("sgp:compress=int8", "no parameter 'compress'")):
    with pytest.raises(ValueError, match=match):
      core.make_method(bad, c)


def test_one_worker_pays_no_codec():
  c = _cluster(n_workers=1)
  w = _workload()
  for spec in ("diloco:H=4,compress=int8",
               "dadam:topology=static_ring,compress=int8"):
    assert core.closed_form(spec, c, w).iteration_s == pytest.approx(0.01)


def test_predict_prints_one_break_even_line_per_compressed_method(capsys):
  assert cli.main(["predict", "--n-workers", "8", "--local-size", "4",
                   "--steps", "40", "--methods",
                   "all_reduce,static_ring,static_ring:compress=int8,"
                   "diloco:H=10,compress=fp4"]) == 0
  out = capsys.readouterr().out
  lines = [l for l in out.splitlines() if "break-even:" in l]
  assert len(lines) == 2, out
  assert "static_ring:compress=int8,block=256 pays against static_ring" in (
      lines[0])
  assert "diloco:H=10,compress=fp4,block=256^" in out  # not in the library
