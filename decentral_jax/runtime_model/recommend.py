"""Which method for a cluster: price methods side by side and recommend one.

What ``python -m decentral_jax.runtime_model predict`` computes for each
worker count (the command line only reads the flags and prints):
:func:`predict` prices one method on one cluster (simulator, closed form,
bytes per iteration) and :func:`recommend` names the fastest method that is
at least :data:`MARGIN` faster than All-Reduce, leaving out topologies
without exact averaging within one period (they mix slowly, so a faster
iteration need not mean a faster loss) and methods the library cannot run
yet (:func:`~decentral_jax.runtime_model.method.library_gap`: priced when
asked for, never recommended). :func:`break_even` finds the link rate below
which a compressed method beats its uncompressed form.

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses
import math

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model import traffic
from decentral_jax.method_names import label

# Relative speed-up over All-Reduce below which All-Reduce is recommended.
MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One method's predicted cost on one cluster and workload.

  Attributes:
    key: the method's name in tables: the spec as given, or for local-update
      methods, DAdam / AccumAdam and specs with parameters the canonical
      spec with every parameter spelled out (``Method.name``).
    simulated_s: mean seconds per iteration from :func:`simulate`.
    estimate: the closed form (:func:`closed_form`).
    sent: bytes per iteration (:func:`traffic.bytes_per_iteration`).
    slow_mixing: the method gossips over a topology without exact
      averaging within one period (no finite-time consensus); never
      recommended.
    local: a local-update method with ``H > 1``: its per-iteration time
      says nothing about its loss per iteration.
    library_gap: why decentral_jax cannot run the method yet
      (:func:`~decentral_jax.runtime_model.method.library_gap`), or None;
      such a method is never recommended.
  """

  key: str
  simulated_s: float
  estimate: Estimate
  sent: traffic.Traffic
  slow_mixing: bool
  local: bool
  library_gap: str | None = None


def table_key(spec: str, m: Method) -> str:
  """The key of :class:`Prediction` for ``spec``, which made ``m``."""
  if m.kind == "local" or ":" in spec or m.name.startswith(
      ("dadam", "accum_adam")):
    return m.name
  return spec


def predict(spec: str, m: Method, c: Cluster, w: Workload, *,
            steps: int, warmup: int, seed: int) -> Prediction:
  """Prices ``m`` (made from ``spec`` by :func:`make_method` on ``c``).

  Args:
    spec: the spec as the user wrote it (names the row).
    m: the checked method.
    c, w: cluster and workload.
    steps, warmup, seed: of :func:`simulate`.

  Raises:
    ValueError: as :func:`simulate` (e.g. no whole period in
      ``steps``).
  """
  slow = m.topology is not None and not m.topology.has_finite_time_consensus()
  est = closed_form(m, c, w)
  sim = simulate(m, c, w, steps=steps, warmup=warmup, seed=seed)
  return Prediction(table_key(spec, m), sim, est,
                    traffic.bytes_per_iteration(m, c, w), slow,
                    m.kind == "local" and m.period > 1,
                    method_lib.library_gap(m))


def recommend(table: dict[str, Prediction], margin: float = MARGIN) -> str:
  """One line: the fastest method and its speedup over All-Reduce.

  Args:
    table: ``{key: Prediction}`` with an ``"all_reduce"`` entry; methods
      with ``slow_mixing`` or a ``library_gap`` are not recommended.
    margin: decentralized methods must be this much faster (relative, by
      simulated time) to be recommended over All-Reduce.

  Returns:
    ``"All-Reduce (no decentralized method is >5% faster)"`` (with a
    clause when a method marked ``*`` (slow mixing) or ``^`` (not in the
    library yet) is faster but not recommended) or
    ``"<label>: <ms> ms/iteration, <x>x faster than All-Reduce"``.

  Raises:
    ValueError: ``table`` is not a dict of :class:`Prediction` with an
      ``"all_reduce"`` entry, a ``simulated_s`` is not a finite time > 0,
      or ``margin`` is not a finite number >= 0 (one line naming it).
  """
  _check_table(table, margin)
  best = min((m for m in table if m == "all_reduce" or not (
      table[m].slow_mixing or table[m].library_gap)),
             key=lambda m: table[m].simulated_s)
  ar = table["all_reduce"].simulated_s
  fastest = table[best].simulated_s
  if best == "all_reduce" or ar / fastest < 1 + margin:
    starred = [m for m in table if m != best and ar / table[m].simulated_s
               >= 1 + margin]
    return ("All-Reduce (no decentralized method is >5% faster"
            + ("; the faster ones marked * or ^ are not recommended: see "
               "their notes)" if starred else ")"))
  ms = 1e3 * fastest
  digits = ".2g" if ms < 0.05 else ".1f"  # not 0.0 beside a speed-up
  return (f"{label(best)}: {ms:{digits}} ms/iteration, "
          f"{ar / fastest:.2f}x faster than All-Reduce")


#: Printed under a recommendation other than All-Reduce: the runtime model
#: prices time per iteration, not the loss a method reaches per step.
#: Measured in BENCHMARKS.md section 15 (docs/clusters.md, "Before
#: decentralizing: the batch per worker").
QUALITY_CAVEAT = (
    "priced by speed only, not by the loss per step. Decentralized Adam "
    "trailed All-Reduce AdamW by 0.15 to 0.24 validation loss at 8 to 64 "
    "sequences per worker (8 workers, BENCHMARKS.md section 15); "
    "local-update methods trail per step too. experiments/compare.py "
    "measures both on a proxy.")


def quality_caveat(recommendation: str) -> str:
  """The caveat to print under ``recommendation`` ("" for All-Reduce)."""
  return "" if recommendation.startswith("All-Reduce") else QUALITY_CAVEAT


# Link rates (bytes/s) scanned by :func:`break_even`: 1 Mbit/s .. 100 Tbit/s,
# 8 points per decade.
BREAK_EVEN_GRID_Bps = tuple(1.25e5 * 10 ** (k / 8) for k in range(8 * 8 + 1))


@dataclasses.dataclass(frozen=True)
class BreakEven:
  """Where a compressed method starts to beat its uncompressed form.

  Attributes:
    link: the rate scaled: ``"wan_bandwidth_Bps"`` (several datacenters),
      ``"nic_bandwidth_Bps"`` (several nodes; a flow cap scales with it) or
      ``"intra_bandwidth_Bps"`` (one node).
    rate_Bps: the cluster's rate of that link now.
    break_even_Bps: the largest rate at which the compressed method is
      faster (closed form), None if it is faster nowhere in
      :data:`BREAK_EVEN_GRID_Bps`, ``inf`` if at every rate there.
    baseline: the uncompressed method's name.
  """

  link: str
  rate_Bps: float
  break_even_Bps: float | None
  baseline: str


def link_to_scale(c: Cluster) -> str:
  """The inter-worker link whose rate :func:`break_even` varies."""
  if c.datacenters > 1:
    return "wan_bandwidth_Bps"
  return "nic_bandwidth_Bps" if c.n_nodes > 1 else "intra_bandwidth_Bps"


def with_link_rate(c: Cluster, rate_Bps: float) -> Cluster:
  """``c`` with its :func:`link_to_scale` rate set to ``rate_Bps``.

  For the NIC, a per-flow cap keeps its ratio to the line rate.
  """
  link = link_to_scale(c)
  kw = {link: rate_Bps}
  if link == "nic_bandwidth_Bps" and c.flow_bandwidth_Bps is not None:
    kw["flow_bandwidth_Bps"] = c.flow_bandwidth_Bps * rate_Bps / (
        c.nic_bandwidth_Bps)
  return dataclasses.replace(c, **kw)


def uncompressed(m: Method, c: Cluster) -> Method:
  """``m`` without compression, as the library runs it.

  Gossip: Decent-DP gossip over the same topology (overlapped with the
  next forward and backward); a local-update method: its uncompressed
  sync. The name drops the ``compress``, ``block`` and ``fraction`` parts.
  """
  head, _, rest = m.name.partition(":")
  parts = [p for p in rest.split(",") if p and not p.startswith(
      ("compress=", "block=", "fraction="))]
  name = head + (":" + ",".join(parts) if parts else "")
  base = dataclasses.replace(m, name=name, compress=None)
  if m.kind == "gossip":
    base = dataclasses.replace(base, overlap=True)
  return make_method(base, c)


def break_even(m: Method, c: Cluster, w: Workload
               ) -> BreakEven:
  """The link rate below which compressed ``m`` beats its uncompressed form.

  Both are priced with :func:`closed_form` at the rates of
  :data:`BREAK_EVEN_GRID_Bps` (the link of :func:`link_to_scale`, all
  other hardware as in ``c``); the largest rate at which the compressed
  method is faster is refined by bisection (40 steps on the log scale)
  against the next grid rate. The uncompressed form of compressed gossip
  is the Decent-DP gossip of the same topology (overlapped); of a
  local-update method, the same method without compression.

  Raises:
    ValueError: ``m`` is not compressed.
  """
  if m.compress is None:
    raise ValueError(f"break_even needs a compressed method, got {m.name!r}.")
  base = uncompressed(m, c)

  def gain(rate: float) -> float:
    cl = with_link_rate(c, rate)
    return (closed_form(base, cl, w).iteration_s
            - closed_form(m, cl, w).iteration_s)

  link = link_to_scale(c)
  grid = BREAK_EVEN_GRID_Bps
  pays = [gain(r) > 0 for r in grid]
  if not any(pays):
    found = None
  elif pays[-1]:
    found = float("inf")
  else:
    k = max(i for i, p in enumerate(pays) if p)
    lo, hi = math.log(grid[k]), math.log(grid[k + 1])
    for _ in range(40):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if gain(math.exp(mid)) > 0 else (lo, mid)
    found = math.exp(lo)
  return BreakEven(link, float(getattr(c, link)), found, base.name)


def break_even_line(key: str, b: BreakEven) -> str:
  """``predict``'s line for one compressed method (rates in Gbit/s)."""
  link = {"wan_bandwidth_Bps": "wide-area link rate",
          "nic_bandwidth_Bps": "NIC line rate",
          "intra_bandwidth_Bps": "intra-node link rate"}[b.link]
  now = f"now {8 * b.rate_Bps / 1e9:.3g} Gbit/s"
  if b.break_even_Bps is None:
    verdict = (f"never pays against {b.baseline} at a {link} from 1 Mbit/s "
               f"to 100 Tbit/s ({now})")
  elif math.isinf(b.break_even_Bps):
    verdict = (f"pays against {b.baseline} at every {link} up to 100 "
               f"Tbit/s ({now})")
  else:
    here = "pays here" if b.rate_Bps < b.break_even_Bps else "does not pay here"
    verdict = (f"pays against {b.baseline} when the {link} is below "
               f"{8 * b.break_even_Bps / 1e9:.3g} Gbit/s ({now}: {here})")
  return f"  break-even: {label(key)} {verdict}"


def _check_table(table, margin) -> None:
  """:func:`recommend`'s argument checks (one ``ValueError`` line)."""
  if not isinstance(table, dict) or "all_reduce" not in table:
    raise ValueError("recommend: table must be a dict of Prediction with an "
                     "'all_reduce' entry (the baseline every speed-up is "
                     f"over), got {type(table).__name__}"
                     + (f" with keys {sorted(table)[:4]}" if isinstance(
                         table, dict) else ""))
  for key, p in table.items():
    t = getattr(p, "simulated_s", None)
    if not isinstance(p, Prediction) or isinstance(t, bool) or not (
        isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
      raise ValueError(f"recommend: table[{key!r}] must be a Prediction "
                       "with a finite simulated_s > 0 (seconds), got "
                       f"{t!r:.40}")
  if isinstance(margin, bool) or not isinstance(margin, (int, float)) or \
      not (math.isfinite(margin) and margin >= 0):
    raise ValueError(f"recommend: margin must be a finite number >= 0 (a "
                     f"relative speed-up, e.g. {MARGIN}), got {margin!r:.40}")
