"""Built-in topologies at cluster scale: construction, memory, spectral gap.

For every built-in topology (``alternating_exp_ring`` with
``local_size=8``) and each ``n`` in ``--ns`` (default 1024, 4096, 16384),
measures on the CPU in this process:

* ``build s``: wall time of ``topology.make(name, n, L)`` (median of
  ``--repeats`` fresh builds);
* ``peak MB``: peak memory traced by ``tracemalloc`` during one build
  (NumPy's buffers included);
* ``gap s``: ``spectral_gap()`` (the closed form of each built-in), median;
* ``ftc s``: ``has_finite_time_consensus()`` (dense for n <= 512, else the
  period applied to 4 random vectors), median;
* ``sparse gap s``: ``spectral_gap(method="sparse")`` once (ARPACK on the
  sparse period operator, the path custom schedules take at n > 512), with
  its difference from the closed form; run for ``n <= --sparse_max_n`` and,
  above, only where the gap is at least 1e-5 (Lanczos needs about
  1/sqrt(gap) iterations: ``ring`` / ``static_ring`` at n = 16384 take
  minutes).

Then checks that tracing one gossip step (``gossip.mix`` under
``shard_map``, traced step) gives a program whose size does not grow with
``n``: the number of StableHLO ops for 8 vs 16 simulated devices (9 vs 16
for ``exponential`` and 9 vs 15 for ``torus``, which have the same number of
permute terms there); the text grows only by the O(n) pair lists and
weight constants.

Prints Markdown tables and the 1-minute load average before and after.

  python benchmarks/bench_topology_scale.py
  python benchmarks/bench_topology_scale.py --ns 1024 4096 --repeats 3

Each ``--ns`` entry must be a worker count every built-in topology builds
(a power of two from 8, with 8 workers per node for
``alternating_exp_ring``, up to ``topology.MAX_WORKERS``), checked before
any work.
"""

from __future__ import annotations

import os
import re
import time
import tracemalloc

import _common


def _load() -> float:
  return round(os.getloadavg()[0], 2)


def _measure(topology, name, n, repeats, sparse_max_n):
  local = _local(name)
  build = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    topo = topology.make(name, n, local)
    build.append(time.perf_counter() - t0)
  tracemalloc.start()
  topology.make(name, n, local)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  gap_t = [_common.timed(topo.spectral_gap) for _ in range(repeats)]
  ftc_t = [_common.timed(topo.has_finite_time_consensus) for _ in range(repeats)]
  gap = topo.spectral_gap()
  row = {"topology": name, "n": n, "period": topo.period,
         "build s": f"{_common.median(build):.3f}",
         "peak MB": f"{peak / 2**20:.1f}",
         "gap": f"{gap:.4g}",
         "gap s": f"{_common.median(gap_t):.1e}",
         "ftc": topo.has_finite_time_consensus(),
         "ftc s": f"{_common.median(ftc_t):.3f}"}
  if n <= sparse_max_n or gap >= 1e-5:
    t0 = time.perf_counter()
    sparse_gap = topo.spectral_gap(method="sparse")
    row["sparse gap s"] = f"{time.perf_counter() - t0:.2f}"
    row["sparse - closed"] = f"{sparse_gap - gap:.1e}"
  else:
    row["sparse gap s"] = "skipped (gap < 1e-5)"
  return row


def _hlo_ops(jax, jnp, np, gossip, parallel, topo, n):
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda t, s: gossip.mix(t, topo, s, axis), mesh, replicated_argnums=(1,)))
  text = fn.lower(parallel.shard({"a": np.zeros((n, 5), np.float32)}, mesh),
                  jnp.int32(0)).as_text()
  return len(re.findall(r"\bstablehlo\.[a-z_]+", text)), len(text)


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line)."""
  from decentral_jax.tools import flag_types  # one error: line
  from decentral_jax.topology import MAX_WORKERS  # NumPy only, no JAX
  count = flag_types.integer  # a bounded integer flag
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--ns", type=count(1, MAX_WORKERS),  # what make() builds
                  nargs="+", default=[1024, 4096, 16384])
  ap.add_argument("--repeats", type=count(1, 10000), default=3)
  ap.add_argument("--sparse_max_n", type=count(1, 2**20), default=4096)
  ap.add_argument("--skip_hlo", action="store_true")
  args = ap.parse_args(argv)
  _common.check_flags(ap, args, rules=(_check_ns,))
  return args


def _local(name: str) -> int:
  return 8 if name == "alternating_exp_ring" else 1


def _check_ns(args) -> None:
  """Every built-in topology builds at each ``--ns`` entry (NumPy only,
  about 3 s in all at 65536): the table has a row for each."""
  from decentral_jax import topology  # pylint: disable=import-outside-toplevel
  for n in dict.fromkeys(args.ns):
    for name in topology.NAMES:
      try:
        topology.make(name, n, _local(name))
      except ValueError as e:
        raise ValueError(f"--ns {n}: every built-in topology is measured "
                         f"at each n, and {e}") from None


def main(argv=None):
  args = parse_args(argv)
  _common.set_cpu_devices(16)
  _common.check_cpu_devices(16, "bench_topology_scale.py", flag=False)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from decentral_jax.comm import gossip
  from decentral_jax import parallel
  from decentral_jax import topology

  info = _common.machine_info()
  print(f"# Topologies at scale ({info['date_utc']} UTC, git "
        f"{_common.git_revision()}, {info.get('cpu', '?')}, "
        f"{info['cpu_cores']} cores)\n")
  load0 = _load()
  rows = [_measure(topology, name, n, args.repeats, args.sparse_max_n)
          for n in args.ns for name in topology.NAMES]
  print(_common.format_table(rows, ["topology", "n", "period", "build s",
                                    "peak MB", "gap", "gap s", "ftc", "ftc s",
                                    "sparse gap s", "sparse - closed"]))
  print(f"\nload average (1 min): {load0} before, {_load()} after; medians "
        f"of {args.repeats} repeats (sparse gap: one run).\n")
  if args.skip_hlo:
    return
  hlo = []
  for name, small, large in [("complete", 8, 16), ("ring", 8, 16),
                             ("static_ring", 8, 16), ("exponential", 9, 16),
                             ("torus", 9, 15)]:
    (a_ops, a_len), (b_ops, b_len) = (
        _hlo_ops(jax, jnp, np, gossip, parallel, topology.make(name, m), m)
        for m in (small, large))
    hlo.append({"topology": name, "n": f"{small} / {large}",
                "StableHLO ops": f"{a_ops} / {b_ops}",
                "text chars": f"{a_len} / {b_len}",
                "same ops": a_ops == b_ops})
  print(_common.format_table(hlo, ["topology", "n", "StableHLO ops",
                                   "text chars", "same ops"]))


if __name__ == "__main__":
  main()
