"""Per-leaf vs bucketed gossip (``gossip.mix(..., bucket_bytes=B)``) on CPU.

One gossip round of a GPT-like parameter pytree (GPT-2 layout with biases,
12 layers, width 256, vocabulary 4096: 148 float32 leaves, 40 MiB per
worker) on 8 simulated CPU devices in this process, one worker per device.
Each variant is ``jit(shard_map(lambda x, k: gossip.mix(x, topo, k)))``
with the round chosen in-graph (``lax.switch``) and the parameters donated;
``bucket_bytes=0`` is one collective per leaf and permute term (the
library before buckets), the others send one collective per bucket of at
most that many bytes (25 MiB is PyTorch DDP's default ``bucket_cap_mb``).

Variants are interleaved: every repeat runs each of them for ``--rounds``
rounds (order rotated each repeat) and records the median round time, so
slow phases of a shared machine hit every variant alike. The table gives
the median over repeats, the ratio to per-leaf, the collectives per round
read from the compiled HLO (:func:`decentral_jax.analysis.communication`)
and the 1-minute load average before and after the measurement; outputs of
every variant are checked to be bit-identical to per-leaf gossip.

  python benchmarks/bench_bucketed_gossip.py
  python benchmarks/bench_bucketed_gossip.py --topology ring --repeats 9
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import _common


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line)."""
  from decentral_jax.tools import flag_types  # one error: line
  count = flag_types.integer  # a bounded integer flag
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--workers", type=count(1, 4096), default=8)
  ap.add_argument("--topology", default="one_peer_exp")
  ap.add_argument("--bucket_bytes", type=count(0, 2**40), nargs="+",
                  default=[0, 2**16, 2**20, 4 * 2**20, 25 * 2**20, 2**30],
                  help="bucket sizes in bytes (0 = one collective per leaf)")
  ap.add_argument("--repeats", type=count(1, 10000), default=7)
  ap.add_argument("--rounds", type=count(1, 10**6), default=12)
  ap.add_argument("--n_layer", type=count(1, 1024), default=12)
  ap.add_argument("--n_embd", type=count(1, 65536), default=256)
  ap.add_argument("--vocab", type=count(1, 2**24), default=4096)
  ap.add_argument("--comm_dtype", default="", help="e.g. bfloat16")
  args = ap.parse_args(argv)
  _common.check_flags(ap, args, rules=(
      lambda a: _common.check_topology("--topology", a.topology, a.workers,
                                       f"--workers {a.workers}"),
      lambda a: _common.check_comm_dtype("--comm_dtype", a.comm_dtype)))
  return args


def main(argv=None):
  args = parse_args(argv)
  _common.set_cpu_devices(args.workers,
                          source=f"--workers={args.workers}")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from decentral_jax import analysis
  from decentral_jax.comm import gossip
  from decentral_jax import parallel
  from decentral_jax import topology
  from decentral_jax.models import gpt

  cfg = gpt.GPTConfig(vocab_size=args.vocab, block_size=256,
                      n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                      bias=True, dropout=0.0, dtype=jnp.float32)
  p0 = jax.tree.map(np.asarray, gpt.init_params(cfg, jax.random.key(0)))
  leaves = jax.tree.leaves(p0)
  n = args.workers
  topo = topology.make(args.topology, n)
  mesh = parallel.make_mesh(n)
  comm = jnp.dtype(args.comm_dtype) if args.comm_dtype else None
  rng = np.random.default_rng(0)
  stacked = jax.tree.map(
      lambda x: (x[None] + 0.01 * rng.standard_normal((n,) + x.shape)
                 ).astype(x.dtype), p0)

  def make(bb):
    def one(tree, k):
      return gossip.mix(tree, topo, k, "workers", comm_dtype=comm,
                        bucket_bytes=bb)
    return jax.jit(parallel.per_worker(one, mesh, replicated_argnums=(1,)),
                   donate_argnums=(0,))

  fns, info = {}, {}
  ref = None
  for bb in args.bucket_bytes:
    fn = make(bb)
    x = parallel.shard(stacked, mesh)
    compiled = fn.lower(x, jnp.int32(0)).compile()
    rep = analysis.communication(compiled)
    # collectives of one round: the switch's branches hold one round each
    per_round = len(rep.collectives) / max(len(rep.scenarios), 1)
    out = fn(x, jnp.int32(0))
    flat = [np.asarray(a) for a in jax.tree.leaves(out)]
    if ref is None:
      ref = flat
    same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip(flat, ref))
    fns[bb] = fn
    info[bb] = {"collectives": per_round, "mean_bytes": rep.mean_bytes_per_step,
                "identical": same}
  times = {bb: [] for bb in fns}
  load_before = os.getloadavg()
  order = list(fns)
  for r in range(args.repeats):
    k = r % len(order)
    for bb in order[k:] + order[:k]:
      x = parallel.shard(stacked, mesh)
      jax.block_until_ready(x)
      ts = []
      for i in range(args.rounds):
        t0 = time.perf_counter()
        x = fns[bb](x, jnp.int32(i))
        jax.block_until_ready(x)
        ts.append(time.perf_counter() - t0)
      times[bb].append(statistics.median(ts))
  load_after = os.getloadavg()
  base = statistics.median(times[order[0]])
  rows = []
  for bb in order:
    med = statistics.median(times[bb])
    label = "per leaf (0)" if not bb else (
        f"{bb / 2**20:g} MiB" if bb >= 2**20 else f"{bb / 2**10:g} KiB")
    rows.append({
        "bucket_bytes": label,
        "collectives/round": f"{info[bb]['collectives']:.0f}",
        "ms/round (median)": f"{1e3 * med:.2f}",
        "vs per leaf": f"{med / base:.2f}x",
        "repeats (ms)": ", ".join(f"{1e3 * t:.1f}" for t in times[bb]),
        "bit-identical": "yes" if info[bb]["identical"] else "NO",
    })
  mib = sum(x.size * x.dtype.itemsize for x in leaves) / 2**20
  print(f"# gossip.mix, {args.topology}, {n} simulated CPU devices, "
        f"{len(leaves)} float32 leaves ({mib:.1f} MiB per worker), "
        f"comm_dtype={args.comm_dtype or 'none'}; {args.repeats} interleaved "
        f"repeats x {args.rounds} rounds; jax {jax.__version__}; "
        f"{os.cpu_count()} CPUs; load avg (1, 5, 15 min) before "
        f"{tuple(round(v, 2) for v in load_before)}, after "
        f"{tuple(round(v, 2) for v in load_after)}")
  print(_common.format_table(rows, list(rows[0])))
  if not all(v["identical"] for v in info.values()):
    sys.exit("bucketed gossip differs from per-leaf gossip")


if __name__ == "__main__":
  main()
