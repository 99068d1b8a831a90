"""Which method for a cluster: price methods side by side and recommend one.

What ``python -m decentral_jax.runtime_model predict`` computes for each
worker count (the command line only reads the flags and prints):
:func:`predict` prices one method on one cluster (simulator, closed form,
bytes per iteration) and :func:`recommend` names the fastest method that is
at least :data:`MARGIN` faster than All-Reduce, leaving out topologies
without exact averaging within one period (they mix slowly, so a faster
iteration need not mean a faster loss).

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model import core
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import traffic

# Relative speed-up over All-Reduce below which All-Reduce is recommended.
MARGIN = 0.05


def label(method: str) -> str:
  """The name of ``method`` in tables and charts (Figure 6's, else itself)."""
  return paper.LABELS.get(method, method)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One method's predicted cost on one cluster and workload.

  Attributes:
    key: the method's name in tables: the spec as given, or for local-update
      methods, DAdam / AccumAdam and specs with parameters the canonical
      spec with every parameter spelled out (``Method.name``).
    simulated_s: mean seconds per iteration from :func:`core.simulate`.
    estimate: the closed form (:func:`core.closed_form`).
    sent: bytes per iteration (:func:`traffic.bytes_per_iteration`).
    slow_mixing: the method gossips over a topology without exact
      averaging within one period (no finite-time consensus); never
      recommended.
    local: a local-update method with ``H > 1``: its per-iteration time
      says nothing about its loss per iteration.
  """

  key: str
  simulated_s: float
  estimate: core.Estimate
  sent: traffic.Traffic
  slow_mixing: bool
  local: bool


def table_key(spec: str, m: core.Method) -> str:
  """The key of :class:`Prediction` for ``spec``, which made ``m``."""
  if m.kind == "local" or ":" in spec or m.name.startswith(
      ("dadam", "accum_adam")):
    return m.name
  return spec


def predict(spec: str, m: core.Method, c: core.Cluster, w: core.Workload, *,
            steps: int, warmup: int, seed: int) -> Prediction:
  """Prices ``m`` (made from ``spec`` by :func:`core.make_method` on ``c``).

  Args:
    spec: the spec as the user wrote it (names the row).
    m: the checked method.
    c, w: cluster and workload.
    steps, warmup, seed: of :func:`core.simulate`.

  Raises:
    ValueError: as :func:`core.simulate` (e.g. no whole period in
      ``steps``).
  """
  slow = m.topology is not None and not m.topology.has_finite_time_consensus()
  est = core.closed_form(m, c, w)
  sim = core.simulate(m, c, w, steps=steps, warmup=warmup, seed=seed)
  return Prediction(table_key(spec, m), sim, est,
                    traffic.bytes_per_iteration(m, c, w), slow,
                    m.kind == "local" and m.period > 1)


def recommend(table: dict[str, Prediction], margin: float = MARGIN) -> str:
  """One line: the fastest method and its speedup over All-Reduce.

  Args:
    table: ``{key: Prediction}`` with an ``"all_reduce"`` entry; methods
      with ``slow_mixing`` are not recommended.
    margin: decentralized methods must be this much faster (relative, by
      simulated time) to be recommended over All-Reduce.

  Returns:
    ``"All-Reduce (no decentralized method is >5% faster)"`` or
    ``"<label>: <ms> ms/iteration, <x>x faster than All-Reduce"``.
  """
  best = min((m for m in table
              if not table[m].slow_mixing or m == "all_reduce"),
             key=lambda m: table[m].simulated_s)
  ar = (table["all_reduce"].simulated_s if "all_reduce" in table
        else float("nan"))
  fastest = table[best].simulated_s
  if best == "all_reduce" or ar / fastest < 1 + margin:
    return "All-Reduce (no decentralized method is >5% faster)"
  return (f"{label(best)}: {1e3 * fastest:.1f} ms/iteration, "
          f"{ar / fastest:.2f}x faster than All-Reduce")
