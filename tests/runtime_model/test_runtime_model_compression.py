"""Compressed communication in the runtime model: hand-worked payloads, sync
and gossip times, the break-even bandwidth, and which compressed methods the
library runs."""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest

from helpers import sync_args

from decentral_jax import topology
from decentral_jax.comm import compress
from decentral_jax.comm import compressed_mean
from decentral_jax.optim import choco
from decentral_jax import optim
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import traffic


@pytest.mark.parametrize("fmt", ["int8", "fp4"])
def test_all_reduce_bytes_equal_the_compressed_mean(fmt):
  # One leaf of N values: the model's 2(n-1)/n x payload(N padded to n B)
  # against comm.compress's hand count of mean_compressed (the scaled
  # formats' sync; top-k is all-gathered, tested below).
  for n_workers in (2, 3, 8):
    for n in (1, 1000, 70_001):
      comp = compress.Compressor(fmt, 128)
      want = compressed_mean.mean_payload_bytes(
          {"x": np.zeros(n, np.float32)}, n_workers, comp)
      got = 2 * (n_workers - 1) / n_workers * compression.sync_payload(
          fmt, n, n_workers, 128)
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
  return Cluster(**base)


def _workload(step_s=0.01):
  return Workload(N, step_s / 3, 2 * step_s / 3, bucket_bytes=1e15)


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
  est = closed_form(spec, c, w)
  assert est.iteration_s == pytest.approx(want, rel=1e-12)
  assert est.compute_s == pytest.approx(x)
  assert est.exposed_comm_s == pytest.approx((sync + codec) / h)
  assert simulate(spec, c, w, steps=60, warmup=10) == pytest.approx(want)
  sent = traffic.bytes_per_iteration(spec, c, w)
  assert sent.worker_bytes == pytest.approx(1.5 * payload / h)
  # Uncompressed: 4 N float32 bytes.
  plain = closed_form("diloco:H=10", c, w).iteration_s
  assert plain == pytest.approx(x + (6 * A + 1.5 * 4 * N / B_LINK) / h)


def _topk_sent_per_sync(n_values, n_workers, block, fraction):
  """The library's top-k sync counted from its payload arrays (NumPy sizes).

  ``gather_mean_compressed`` all-gathers the arrays of ``Compressor.encode``
  (float32 values and int16/int32 indices, one row per chunk); each worker
  sends them to the ``n - 1`` others.
  """
  comp = compress.Compressor("topk", block, fraction)
  payload = comp.encode(np.zeros(n_values, np.float32))
  return (n_workers - 1) * sum(np.asarray(a).nbytes for a in payload.values())


@pytest.mark.parametrize("n_workers,local_size,datacenters",
                         [(8, 1, 1), (8, 4, 1), (2, 1, 1), (8, 4, 2)])
def test_topk_sync_bytes_equal_the_librarys_count(n_workers, local_size,
                                                  datacenters):
  # Bytes per worker per sync = (n-1) x (k float32 values + k indices) per
  # chunk; the runtime model's traffic against the arrays the library
  # sends and against comm.compress's hand count (checked against the HLO
  # in tests/optim/test_compressed_sync.py).
  c = _cluster(n_workers=n_workers, local_size=local_size,
               datacenters=datacenters,
               wan_bandwidth_Bps=1e9 if datacenters > 1 else None)
  for n, block, fraction in ((1000, 64, 0.125), (100_003, 256, 1 / 32),
                             (70_000, 40_000, 0.001)):
    w = Workload(n, 0.001, 0.002, bucket_bytes=1e15)
    spec = f"diloco:H=5,compress=topk,block={block},fraction={fraction}"
    got = 5 * traffic.bytes_per_iteration(spec, c, w).worker_bytes
    want = _topk_sent_per_sync(n, n_workers, block, fraction)
    assert got == pytest.approx(want, rel=1e-12), (n, block)
    assert want == compressed_mean.gather_payload_bytes(
        {"x": np.zeros(n, np.float32)}, n_workers,
        compress.Compressor("topk", block, fraction))


@pytest.mark.slow  # ~30 encodes of distinct shapes: a compile each
def test_topk_priced_sync_is_short_of_the_per_leaf_payload_by_at_most_a_chunk_per_leaf():
  # The library encodes top-k leaf by leaf; the model prices N as one
  # buffer. The tests' tiny GPT (1 layer, width 16, vocabulary 256, context
  # 8, no biases): wte 256x16, wpe 8x16, ln 16, qkv 16x48, proj 16x16, ln
  # 16, fc 16x64, proj 64x16, ln_f 16. B = 256, fraction 1/8: k = 32
  # values of 4 + 2 bytes per chunk; ceil(7344 / 256) = 29 chunks priced,
  # 16+1+1+3+1+1+4+4+1 = 32 sent.
  leaves = [4096, 128, 16, 768, 256, 16, 1024, 1024, 16]
  assert sum(leaves) == 7344
  chunk = 32 * 6
  priced = compression.sync_payload("topk", 7344, 8, 256, 0.125)
  sent = sum(_topk_sent_per_sync(s, 2, 256, 0.125) for s in leaves)
  assert priced == 29 * chunk == 5568
  assert sent == 32 * chunk == 6144
  assert compression.topk_leaf_padding_bytes(9, 256, 0.125) == 8 * chunk
  assert 7 * sent == compressed_mean.gather_payload_bytes(
      [np.zeros(s, np.float32) for s in leaves], 8,
      compress.Compressor("topk", 256, 0.125))
  rng = np.random.default_rng(0)
  for _ in range(20):
    sizes = [int(v) for v in rng.integers(1, 3000, rng.integers(1, 12))]
    block = int(rng.choice([8, 64, 256]))
    priced = compression.sync_payload("topk", sum(sizes), 4, block, 0.25)
    sent = sum(_topk_sent_per_sync(s, 2, block, 0.25) for s in sizes)
    bound = compression.topk_leaf_padding_bytes(len(sizes), block, 0.25)
    assert priced <= sent <= priced + bound, (sizes, block)
  # The bound is reached (L leaves of one value: L chunks against 1) and
  # is 0 where the leaves hold multiples of B (GPT-2 small at B = 256).
  k_bytes = 64 * 6
  assert sum(_topk_sent_per_sync(1, 2, 256, 0.25) for _ in range(5)) == \
      compression.sync_payload("topk", 5, 2, 256, 0.25) + 4 * k_bytes == \
      compression.sync_payload("topk", 5, 2, 256, 0.25) + \
      compression.topk_leaf_padding_bytes(5, 256, 0.25)
  assert compression.topk_leaf_padding_bytes(1, 256, 0.25) == 0
  with pytest.raises(ValueError, match="n_leaves"):
    compression.topk_leaf_padding_bytes(0, 256, 0.25)


def test_topk_diloco_sync_is_an_all_gather_by_hand():
  # 8 workers on 8 nodes, one link class (flat ring, a, b): N = 1e6, B =
  # 256, fraction 1/32 -> k = 8 per chunk, 3907 chunks, P = 3907 * 8 * (4
  # + 2) bytes per worker. All-gather: 7 a + 7 P / b; codec (1 + 8) N
  # float32 values (encode, then decode the 8 gathered payloads).
  c, w = _cluster(n_workers=8), _workload()
  x, h = 0.01, 10
  payload = 3907 * 8 * 6
  sync = 7 * A + 7 * payload / B_LINK
  codec = 9 * N * 4 / CODEC
  want = x + (sync + codec) / h
  spec = "diloco:H=10,compress=topk,fraction=0.03125"
  est = closed_form(spec, c, w)
  assert est.iteration_s == pytest.approx(want, rel=1e-12)
  assert est.exposed_comm_s == pytest.approx((sync + codec) / h)
  assert simulate(spec, c, w, steps=60, warmup=10) == pytest.approx(want)
  sent = traffic.bytes_per_iteration(spec, c, w)
  assert sent.worker_bytes == pytest.approx(7 * payload / h)
  assert sent.node_bytes == pytest.approx(7 * payload / h)
  # int8 on the same cluster stays a reduce-scatter + all-gather of codes:
  # 1e6 padded to 489 x (8 x 256) values, 3912 blocks of 260 bytes.
  p8 = 3912 * 260
  want8 = x + (14 * A + 1.75 * p8 / B_LINK
               + (3 + 1 / 8) * N * 4 / CODEC) / h
  assert closed_form("diloco:H=10,compress=int8", c, w).iteration_s == (
      pytest.approx(want8, rel=1e-12))
  # Streaming DiLoCo, 2 fragments of P/2 each, one per half period.
  est = closed_form("streaming_diloco:H=10,P=2,compress=topk,"
                         "fraction=0.03125", c, w)
  frag = 7 * A + 7 * payload / 2 / B_LINK
  assert est.iteration_s == pytest.approx(x + (2 * frag + codec) / h,
                                          rel=1e-12)


def test_topk_all_gather_across_datacenters_by_hand():
  # 2 datacenters of one node of 4 workers: the all-gather exchanges each
  # worker's P with its counterpart across the wide-area link (4 flows
  # share the uplink: 4 P / b_wan, one a_wan), then gathers 2 P per worker
  # inside the node on a ring (3 a_i + 6 P / b_i).
  a_i, b_i, a_w, b_w = 2e-6, 50e9, 0.03, 1e9
  c = _cluster(n_workers=8, local_size=4, intra_latency_s=a_i,
               intra_bandwidth_Bps=b_i, nic_bandwidth_Bps=400e9,
               datacenters=2, wan_latency_s=a_w, wan_bandwidth_Bps=b_w)
  rc = costs.all_gather_cost(c)
  p = 1e6
  assert rc.time(p) == pytest.approx(
      np.full(8, 3 * a_i + a_w + 6 * p / b_i + 4 * p / b_w), rel=1e-12)
  w = _workload()
  spec = "diloco:H=10,compress=topk,fraction=0.03125"
  payload = 3907 * 8 * 6
  sent = traffic.bytes_per_iteration(spec, c, w)
  assert sent.worker_bytes == pytest.approx(7 * payload / 10)
  assert sent.dc_bytes == pytest.approx(4 * payload / 10)
  assert sent.node_bytes == pytest.approx(4 * payload / 10)
  codec = 9 * N * 4 / CODEC
  sync = 3 * a_i + a_w + 6 * payload / b_i + 4 * payload / b_w
  assert closed_form(spec, c, w).iteration_s == pytest.approx(
      0.01 + (sync + codec) / 10, rel=1e-12)


def test_all_gather_of_two_workers_is_one_exchange():
  c = _cluster(n_workers=2)
  assert costs.all_gather_cost(c).time(1e6) == pytest.approx(
      np.full(2, A + 1e6 / B_LINK))


def test_break_even_of_topk_by_hand():
  # No latency: T_plain = x + 1.75 * 4N / b / H and T_topk = x + (7 P / b
  # + codec) / H cross at b* = (7 N - 7 P) / codec (8 workers, ring).
  c, w = _cluster(n_workers=8, inter_latency_s=0.0), _workload()
  m = make_method("diloco:H=10,compress=topk,fraction=0.03125", c)
  payload = 3907 * 8 * 6
  codec = 9 * N * 4 / CODEC
  b_star = (1.75 * 4 * N - 7 * payload) / codec
  be = recommend.break_even(m, c, w)
  assert be.baseline == "diloco:H=10"
  assert be.break_even_Bps == pytest.approx(b_star, rel=1e-9)


@pytest.mark.parametrize("overlap", ["none", "delayed", "eager"])
@pytest.mark.parametrize("fmt", ["int8", "topk"])
def test_library_gap_of_compressed_syncs_follows_the_library(overlap, fmt):
  # Marked runnable exactly where optim.diloco accepts the
  # compressor with that outer overlap.
  c = _cluster()
  m = make_method(f"diloco:H=10,overlap={overlap},compress={fmt}", c)
  try:
    optim.diloco(optax.sgd(0.1), 10, **sync_args(overlap=overlap,
        compressor=compress.Compressor(fmt)))
    runs = True
  except ValueError:
    runs = False
  assert (method_lib.library_gap(m) is None) == runs


def test_choco_gossip_by_hand():
  # static_ring on 4 workers: 2 permute terms, each a + P / b (one flow per
  # node and direction), blocking: T = x + codec + 2 (a + P / b), codec =
  # (2 + 2) N float32 values (quantize once, dequantize own and 2 received).
  c, w = _cluster(), _workload()
  payload = 3907 * 260
  codec = 4 * N * 4 / CODEC
  want = 0.01 + codec + 2 * (A + payload / B_LINK)
  spec = "dadam:topology=static_ring,compress=int8"
  m = make_method(spec, c)
  assert (m.kind, m.overlap, m.compress) == ("gossip", False, "int8")
  assert closed_form(m, c, w).iteration_s == pytest.approx(want)
  assert simulate(m, c, w, steps=30, warmup=5) == pytest.approx(want)
  sent = traffic.bytes_per_iteration(m, c, w)
  tree = {"x": np.zeros(N, np.float32)}
  want_bytes = compress.payload_bytes_per_round(
      tree, topology.make("static_ring", 4), 0, compress.Compressor("int8"))
  assert sent.worker_bytes == want_bytes == 2 * payload


def test_group_rounds_are_sent_as_permute_terms():
  # complete on 4 workers: one group mean uncompressed, 3 permute terms of
  # the payload compressed (as comm.compress.mix_compressed sends them).
  c, w = _cluster(), _workload()
  m = make_method("complete:compress=fp8,block=128", c)
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
  m = make_method("diloco:H=10,compress=int8", c)
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
  t = lambda spec, cl: closed_form(spec, cl, w).iteration_s
  assert t(m, below) < t("diloco:H=10", below)
  assert t(m, above) > t("diloco:H=10", above)
  line = recommend.break_even_line(m.name, be)
  assert f"below {8 * b_star / 1e9:.3g} Gbit/s" in line
  assert ("pays here" if B_LINK < b_star else "does not pay here") in line


def test_break_even_of_compressed_gossip_is_where_the_times_cross():
  c, w = _cluster(), _workload()
  m = make_method("static_ring:compress=int4", c)
  be = recommend.break_even(m, c, w)
  assert be.baseline == "static_ring"
  assert 0 < be.break_even_Bps < math.inf
  at = recommend.with_link_rate(c, be.break_even_Bps)
  plain = make_method("static_ring", c)
  assert closed_form(m, at, w).iteration_s == pytest.approx(
      closed_form(plain, at, w).iteration_s, rel=1e-6)


@pytest.mark.parametrize("name", topology.NAMES)
def test_library_gap_of_compressed_gossip_follows_choco(name):
  # The model calls compressed gossip runnable exactly where
  # optim.choco.choco_gossip accepts the topology.
  c = _cluster(n_workers=8)
  try:
    topo = topology.make(name, 8, 1)
  except ValueError:
    pytest.skip(f"{name} needs another worker count")
  m = make_method(f"{name}:compress=int8", c)
  try:
    choco.choco_gossip(topo, compress.Compressor("int8"), 0.5)
    runs = True
  except ValueError:
    runs = False
  assert (method_lib.library_gap(m) is None) == runs, name


def test_compressed_specs_parse_and_refuse():
  c = _cluster()
  m = make_method("diloco:H=10,compress=fp4,block=128", c)
  assert (m.name, m.compress, m.compress_block) == (
      "diloco:H=10,compress=fp4,block=128", "fp4", 128)
  assert method_lib.library_gap(m) is None
  m = make_method("streaming_diloco:H=8,P=2,compress=topk,fraction=0.02",
                       c)
  assert m.compress_fraction == 0.02 and m.name.endswith("fraction=0.02")
  assert method_lib.library_gap(m) is None
  # Compressed Local SGD (the runner's spec for it).
  m = make_method("local_sgd:H=3,compress=int8,block=64", c)
  assert (m.name, m.compress, method_lib.library_gap(m)) == (
      "local_sgd:H=3,compress=int8,block=64", "int8", None)
  m = make_method("accum_adam:compress=int8,topology=static_ring", c)
  assert m.name == "accum_adam:T=4,topology=static_ring,compress=int8,block=256"
  for bad, match in (("dadam:compress=int3", "int3"),
                     ("dadam:compress=int4,block=7", "even"),
                     ("dadam:block=64", "need compress"),
                     ("diloco:H=4,compress=int8,topology=ring", "kind 'local'"),
                     ("static_ring:compress=topk,fraction=0", "fraction"),
                     ("diloco:compress=int8,comm_dtype=bfloat16", "not both"),
                     ("sgp:compress=int8", "no parameter 'compress'")):
    with pytest.raises(ValueError, match=match):
      make_method(bad, c)


@pytest.mark.parametrize("fmt", ["int8", "fp4", "topk"])
def test_the_model_and_the_codec_bound_block_alike(fmt):
  # The codec refuses a block above 2**20 = 1048576 values; a spec the
  # model prices must be one the library runs, so the model refuses the same
  # blocks (and accepts the largest one).
  c = _cluster(n_workers=16)
  for block, ok in ((1_048_576, True), (1_048_578, False),
                    (99_999_999_998, False)):
    spec = f"dadam:topology=ring,compress={fmt},block={block}"
    if ok:
      assert make_method(spec, c).compress_block == block
      compress.Compressor(fmt, block)
      continue
    with pytest.raises(ValueError, match=rf"block={block} .*1048576"):
      make_method(spec, c)
    with pytest.raises(ValueError, match="block"):
      compress.Compressor(fmt, block)
  assert cli.main(["predict", "--n-workers", "16", "--methods",
                   f"all_reduce,dadam:compress={fmt},block=99999999998"]) == 2


def test_one_worker_pays_no_codec():
  c = _cluster(n_workers=1)
  w = _workload()
  for spec in ("diloco:H=4,compress=int8",
               "dadam:topology=static_ring,compress=int8"):
    assert closed_form(spec, c, w).iteration_s == pytest.approx(0.01)


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
  # In the library now: no "^" mark.
  assert "diloco:H=10,compress=fp4,block=256 " in out
  assert "^" not in out
