"""How much ``predict`` simulates, bounded before it simulates.

The max-plus simulations cost about workers x simulated steps x buckets
per method (an all-reduce holds float64 ``[steps, n, buckets]`` arrays,
an overlapped gossip loops over the buckets of every step; a local-update
method or a blocking gossip sends its message whole): :func:`work` counts
it, :func:`check` refuses more than :data:`MAX_SIMULATED` in all.
"""

from __future__ import annotations

from decentral_jax.runtime_model import method_messages

# At most this many simulated worker-step-buckets in all (workers x
# simulated steps x buckets of a method, summed; an all-reduce holds
# [steps, n, buckets] arrays). Measured on 2 shared cores (load 5 to 9) at
# 4096 workers, 10 buckets: the default 3 methods at 813 steps (1e8) 67 s
# and 1.2 GB; all_reduce alone at 2441 steps (1e8) 170 s and 2.0 GB; at
# twice that (4880 steps) it ran past 400 s in 3.7 GB.
MAX_SIMULATED = 100_000_000


def work(setups, built) -> list:
  """``[(workers, simulated steps, buckets)]`` of every method and worker
  count: an all-reduce or overlapped gossip simulates each bucket of its
  message (``method_messages.effective``'s workload), the others the
  message whole."""
  out = []
  for (n, c, w), made in zip(setups, built):
    for _, m, steps in made:
      buckets = 1
      if m.kind == "all_reduce" or (m.kind == "gossip" and m.overlap):
        we = method_messages.effective(m, c, w)[1]
        message = we.grad_bytes if m.kind == "all_reduce" else we.param_bytes
        buckets = len(we.buckets(message)[0])
      out.append((n, steps, buckets))
  return out


def check(args, items: list, methods=None, added: bool = False) -> None:
  """Refuses a ``predict`` whose simulation is too large to wait for.

  Args:
    args: the parsed flags (``--n-workers``, ``--steps``, ``--methods``).
    items: per method and worker count, ``(workers, simulated steps,
      buckets)`` (1 bucket for a method that sends its message whole).
    methods: the specs simulated, named in the refusal (None: counted
      only).
    added: ``methods[0]`` is the ``all_reduce`` reference ``predict``
      added (named as such: it is not one of ``--methods``).

  Raises:
    ValueError: the simulated worker-step-buckets (the product, summed)
      exceed :data:`MAX_SIMULATED`, naming the flags, the methods and the
      limit.
  """
  total = sum(n * steps * buckets for n, steps, buckets in items)
  if total > MAX_SIMULATED:
    count = len(items) // len(args.n_workers)
    given = list(methods or [])[1 if added else 0:]
    names = given + ["the all_reduce reference"] * bool(added)
    which = (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1
             else "".join(names))
    which = f": {which}" if methods else ""
    fewer = " or the number of methods" if len(given) > 1 else ""
    raise ValueError(
        f"--n-workers {','.join(map(str, args.n_workers))} x --steps "
        f"{args.steps} x the buckets of {count} methods{which} (--methods, "
        f"--params / --bucket-MiB) simulate {total:.3g} "
        f"worker-step-buckets, more than {MAX_SIMULATED:.3g} (minutes and "
        f"GBs beyond); lower --steps, --n-workers{fewer}, or raise "
        "--bucket-MiB.")
