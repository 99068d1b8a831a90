"""Communication per train step, read from the compiled HLO.

For the ``gpt_tiny`` model (byte-level GPT, 2 layers, width 128, 4 heads,
context 64; 434,816 float32 parameters = 1,739,264 bytes per worker) and 8
workers on simulated CPU devices, compiles the train step ``grad ->
tx.update -> apply_updates`` (``benchmarks/_common.gpt_step``) of each method
and topology and lists, with :func:`decentral_jax.analysis.communication`,
every collective of the optimized HLO and the bytes the busiest worker sends
per step, divided by the parameter bytes. Steps whose topology has several
rounds compile a ``lax.switch``; each branch (round) is one scenario, and
the table gives the ratio of every branch. The column "leaving the node"
counts only the bytes a worker sends to another node when workers ``2v,
2v+1`` share node ``v`` (group collectives counted as rings in device
order). Nothing is executed.

  python benchmarks/bench_communication.py [--n_workers 8] [--json FILE]

``--n_workers`` is a power of two in [2, 4096] (``one_peer_exp`` and the
rows of 2 workers per node need one).
"""

from __future__ import annotations

import collections
import json

import _common  # benchmarks/_common.py, next to this script


def cases(n):
  """(label, method, topology name, local_size, comm_dtype, expected)."""
  import math
  ar = 2 * (n - 1) / n
  return [
      ("All-Reduce AdamW", "allreduce", None, 1, None, f"{ar:.2f} = 2(n-1)/n"),
      ("DAdam", "dadam", "one_peer_exp", 1, None, "1.00 every round"),
      ("AccumAdamW (T=4)", "accum", "one_peer_exp", 1, None,
       "1.00 every round"),
      ("AccumAdamW (T=4), bf16 gossip", "accum", "one_peer_exp", 1,
       "bfloat16", "0.50 requested"),
      ("DAdam", "dadam", "ring", 1, None, "1.00 every round"),
      ("AccumAdamW (T=4)", "accum", "alternating_exp_ring", 1, None,
       "<= 1.00 (1-D mesh)"),
      ("AccumAdamW (T=4)", "accum", "alternating_exp_ring", 2, None,
       "node-aware mesh"),
      ("AccumAdamW (T=4)", "accum", "complete", 1, None,
       f"{ar:.2f} (pmean)"),
      ("DAdam", "dadam", "exponential", 1, None,
       f"{math.log2(n):.2f} = log2(n)"),
  ]


def build(n, method, topo_name, local_size, comm_dtype):
  import jax
  import jax.numpy as jnp
  import optax
  from decentral_jax import optim
  from decentral_jax import parallel
  from decentral_jax import topology
  from decentral_jax.models import gpt
  cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                      n_embd=128, bias=False, dropout=0.0, dtype=jnp.float32)
  mesh = parallel.make_mesh(n, local_size, node_aware=local_size > 1)
  axis = parallel.worker_axis(mesh)
  if method == "allreduce":
    tx = optax.chain(optim.all_reduce_gradients(axis),
                     optax.adamw(3e-3, b2=0.95, weight_decay=0.1))
  else:
    tx = optim.decentralized_adamw(
        3e-3, topology.make(topo_name, n, local_size), b2=0.95,
        weight_decay=0.1, accum_steps=4 if method == "accum" else 1,
        axis_name=axis, comm_dtype=getattr(jnp, comm_dtype) if comm_dtype
        else None)
  step = _common.gpt_step(cfg, tx, mesh)
  p1 = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
  sharding = parallel.worker_sharding(mesh)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (n,) + x.shape, x.dtype, sharding=sharding), p1)
  state = jax.eval_shape(parallel.per_worker(tx.init, mesh), params)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding), state)
  tokens = jax.ShapeDtypeStruct((n, 8, 65), jnp.int32, sharding=sharding)
  return step.lower(params, state, tokens), p1


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line)."""
  from decentral_jax.tools import flag_types  # one error: line
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  # Rows of one_peer_exp, and of 2 workers per node: a power of two >= 2.
  ap.add_argument("--n_workers", type=flag_types.power_of_two(2, 4096),
                  default=8, help="workers, a power of two in [2, 4096]")
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  _common.check_flags(ap, args, outputs=("--json",))
  return args


def main(argv=None):
  args = parse_args(argv)
  _common.set_cpu_devices(args.n_workers,
                          source=f"--n_workers={args.n_workers}")
  from decentral_jax import analysis
  print("machine:", json.dumps(_common.machine_info()), flush=True)
  n = args.n_workers
  rows, records = [], []
  for label, method, topo_name, local, comm, expected in cases(n):
    lowered, p1 = build(n, method, topo_name, local, comm)
    pb = analysis.tree_bytes(p1)
    rep = analysis.communication(lowered.compile())
    ratios = rep.ratios(pb)
    kinds = collections.Counter(c.kind for c in rep.collectives)
    dtypes = sorted({d for c in rep.collectives for d in c.dtypes})
    row = {
        "method": label,
        "topology": (topo_name or "-") + (f" (L={local})" if local > 1
                                          else ""),
        "collectives in HLO": ", ".join(f"{v} {k}" for k, v in
                                        sorted(kinds.items())),
        "dtypes": ",".join(dtypes),
        "rounds": len(rep.scenarios),
        "bytes sent / param bytes, per round": " / ".join(
            f"{r:.2f}" for r in ratios),
        "max": f"{max(ratios):.2f}",
        "leaving the node, 2 workers/node": " / ".join(
            f"{b / pb:.2f}" for b in rep.inter_node_bytes_per_step(2)),
        "expected": expected,
    }
    if comm:
      asked = analysis.communication(lowered, stage="unoptimized").ratios(pb)
      row["bytes sent / param bytes, per round"] += (
          " (requested by the program: " + " / ".join(
              f"{r:.2f}" for r in asked) + ")")
    rows.append(row)
    records.append({**row, "param_bytes": pb, "ratios": list(ratios),
                    "bytes_per_step": list(rep.bytes_per_step)})
    print(json.dumps(records[-1]), flush=True)
  print(f"\nparameter bytes per worker: {pb:,}\n")
  print(_common.format_table(rows, list(rows[0])))
  if args.json:
    _common.write_output(args.json, "--json",
                         lambda f: json.dump(records, f, indent=1),
                         kept="the records were printed above")


if __name__ == "__main__":
  main()
