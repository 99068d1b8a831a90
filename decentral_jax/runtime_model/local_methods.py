"""Runtime model of local-update methods: Local SGD, DiLoCo, Streaming DiLoCo.

Prices the methods of :mod:`decentral_jax.optim.local_updates` and the local steps
of :func:`decentral_jax.optim.decentralized` (``gossip_every``) as
:class:`~decentral_jax.runtime_model.method.Method` objects of kind
``"local"``. Every worker takes ``H - 1`` purely local steps, then, on the
sync step, after its inner update, a synchronisation that is not overlapped
with compute (it sits in a ``lax.cond`` after the update):

* **Local SGD** (``local_sgd:H=..``): exact all-reduce of the parameters
  (``Workload.param_dtype``); a barrier over all ``n`` workers.
* **DiLoCo** (``diloco:H=..``; Douillard et al. 2023, arXiv 2311.08105):
  exact all-reduce of the float32 (or wider) ``theta``-dtype copy; a
  barrier over all ``n`` workers. Local SGD and (decentralized) DiLoCo
  take an optional ``comm_dtype`` too (bytes scale with its itemsize).
* **Streaming DiLoCo** (``streaming_diloco:H=..,P=..,tau=..``; Douillard et
  al. 2025, arXiv 2501.18512): ``P`` fragments of ``M / P`` bytes;
  fragment ``p`` is sent at the steps ``t`` with ``t % H == (p H // P) %
  H`` and merged ``tau`` steps later; its all-reduce runs during those
  ``tau`` inner steps. Optional ``comm_dtype`` (bytes scale with its
  itemsize).
* **Decentralized DiLoCo** (``diloco:H=..,topology=T``): one round of ``T``
  (the ``k``-th at the ``k``-th sync) instead of the all-reduce; each
  worker waits only for its group (the workers it receives from).
* **Local D-SGD / DAdam** (``local_dsgd:H=..,topology=T``, alias
  ``local_dadam``; ``gossip_every = H``): one round of ``T`` every ``H``
  steps in the parameter dtype (or ``comm_dtype``), not overlapped. ``H =
  1`` on the SGP topology is SGP.
* **DES-LOC-Adam** (``desloc:Kx=..,Ku=..,Kv=..``; Iacob et al., arXiv
  2505.22549): the parameters and Adam's two moments all-reduced every
  ``Kx``, ``Ku``, ``Kv`` steps, priced as one blocking sync every ``Kx``
  steps of ``1 + Kx / Ku + Kx / Kv`` parameter copies.
* **NoLoCo** (``noloco:H=..,seed=..``; Kolehmainen et al., arXiv
  2506.10911): decentralized DiLoCo over a seeded cycle of random pairs
  (:func:`decentral_jax.topology.pairings.random_pairs`): every ``H``
  steps one float32 exchange with the round's partner, no all-reduce.
* **Delayed and eager outer updates** (``diloco:H=..,overlap=eager`` or
  ``overlap=delayed``; Kale et al. 2025, arXiv 2502.12996) with a
  **trickled reduction**: the pseudo-gradient of a round is reduced in
  ``H`` slices of ``M / H`` bytes, one in each inner step of the next
  round, beside that step's compute; the outer step never waits. Both
  variants send and wait alike, so they cost the same.
* **Compressed syncs** (``compress=int8|fp8|int4|fp4|topk``, with
  ``block`` and ``fraction``; Local SGD, DiLoCo and Streaming DiLoCo, as
  :func:`decentral_jax.optim.local_updates.compressed_mean` sends them):
  the scaled formats as the compressed all-reduce of
  :mod:`~decentral_jax.runtime_model.compression` (its payload instead of
  ``M``), top-k as an all-gather of every worker's payload
  (:func:`~decentral_jax.runtime_model.costs.all_gather_cost`, ``a`` below
  its time); the codec time is device compute, spread over the ``H`` steps
  of a period.

Recursions (per worker ``i``, step ``k``, ``t = k + 1`` the count after the
step; ``x_i^k = (F + B)_i^k + O`` seconds; ``s_i`` the start of the step;
``pre_i = s_i + x_i^k``):

* exact, ``P`` fragments, overlap ``tau`` (Local SGD, DiLoCo: ``P = 1,
  tau = 0``): if fragment ``p`` is sent at ``t``: ``e_p = max(max_j pre_j,
  free) + a``, ``free = e_p`` (one in-order stream; the collective needs
  every worker); if fragment ``q`` is merged at ``t``: ``s_i' = max(pre_i,
  e_q)``, else ``s_i' = pre_i``. ``a`` is the alpha-beta all-reduce time of
  ``M / P`` bytes (:func:`decentral_jax.runtime_model.costs.all_reduce_cost`;
  top-k: the all-gather of :func:`~decentral_jax.runtime_model.costs.
  all_gather_cost`), one latency per ``bucket_bytes`` message.
* gossip: at a sync step ``s_i' = max_{j in G_i(r)} pre_j + tau_{r,i}``,
  with round ``r`` = the number of syncs so far modulo the topology's
  period; else ``s_i' = pre_i``.
* trickled (delayed / eager): from the first sync on, every step carries a
  slice, launched by each worker when it starts the step and finished
  ``a_s`` (the all-reduce of ``M / H`` bytes) after the last worker has
  started it: ``s_i' = max(s_i + x_i, max_j s_j + a_s)``.

Closed form (mean compute ``x = C + O``, std ``sigma`` of ``F + B``):

* exact: ``T = x + (1/H) sum_p [max(0, a - tau x) + d_p]``, where ``d_p`` is
  the expected wait caused by compute variability at fragment ``p``'s merge
  beyond the deterministic exposure: with ``g_p`` the steps between the
  previous fragment's merge and this send, ``d_p = E[(sigma sqrt(g_p) U +
  (a - tau x) - sigma sqrt(tau) V)^+] - max(0, a - tau x)``, ``U = max_{j}
  Z_j - Z_i`` over ``n`` i.i.d. normals (so the std of a sum of ``g``
  draws, ``sqrt(g) sigma``, sets the spread) and ``V`` a standard normal
  (the spread of the ``tau`` overlapped steps). For ``tau = 0`` (Local SGD,
  DiLoCo) it is the barrier's ``sigma sqrt(H) E[max of n N(0,1)]`` once per
  ``H`` steps. It assumes the workers are aligned after each merge (exact
  when ``a >= tau x``). When the all-reduce is hidden (slack ``W = tau x -
  a > 0``) they are not: a worker more than ``W`` ahead of the slowest one
  waits at the merge, which holds every worker within ``W`` of the
  slowest. That costs about ``kappa_n sigma^2 / W`` per step (for ``n =
  2`` exactly ``sigma^2 / (2W)``: the two workers' difference is a random
  walk reflected at ``+-W``; ``kappa_n = (sqrt(pi)/2) E[max of n
  N(0,1)]`` interpolates to larger ``n``, within about 10% of the
  simulator for ``n <= 32``), combined harmonically with the ``tau = 0``
  barrier cost as its ceiling; the larger of the two estimates is used.
  For empirical compute samples the sum of ``g > 1`` draws is taken as
  Gaussian.
* gossip: ``T = max_i mean_r [H x + tau_{r,i} + sigma sqrt(H)
  coupling_excess(|G_i|, 0)] / H`` (SGP's closed form, one round per ``H``
  steps).
* trickled: ``T = max(x, a_s) + v``: with ``Delta = a_s - x >= 0`` (the
  slices set the pace) ``v = sigma E[(Z_(n) - Delta / sigma)^+]``, the
  slowest worker's compute beyond the slice; with slack ``W = x - a_s >
  0`` the held-back drift ``kappa_n sigma^2 / W`` combined harmonically
  with the barrier ``sigma E[Z_(n)]`` (as for Streaming DiLoCo).

Sync messages and their times (bytes, buckets, alpha-beta or measured
seconds): :mod:`~decentral_jax.runtime_model.local_sync`.

Units: seconds, bytes. Errors: :class:`ValueError` for a bad spec or
``Method`` field (naming it, with the fix), or a simulation too short for a
whole period.

References:
  Douillard et al., DiLoCo: Distributed Low-Communication Training of
  Language Models, arXiv 2311.08105. Douillard et al., Streaming DiLoCo
  with overlapping communication, arXiv 2501.18512. Kale, Douillard,
  Donchev, Eager Updates For Overlapped Communication and Computation in
  DiLoCo, arXiv 2502.12996. Assran et al.,
  Stochastic Gradient Push for Distributed Deep Learning, ICML 2019.
  Lin et al., Don't Use Large Mini-Batches, Use Local SGD, ICLR 2020.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
from scipy import special

from decentral_jax.topology import pairings
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model import local_sync
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.method import floating_dtype_name
from decentral_jax.runtime_model.method import parse_parameters
from decentral_jax.runtime_model.method import sgp_topology
from decentral_jax.runtime_model.method import split_compute
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import coupling_excess
from decentral_jax.runtime_model.workload import expected_max_normal

# kappa_n / E[max of n N(0,1)] of the held-back drift ``kappa_n sigma^2 /
# slack`` per step: sqrt(pi)/2 makes it exact for n = 2.
REFLECTION = math.sqrt(math.pi) / 2
# name -> (allowed keys, synchronised message, default topology).
_COMPRESS_KEYS = ("compress", "block", "fraction")
_METHODS = {
    "local_sgd": (("H", "comm_dtype") + _COMPRESS_KEYS, "params", None),
    "diloco": (("H", "topology", "comm_dtype", "overlap") + _COMPRESS_KEYS,
               "theta", None),
    "streaming_diloco": (("H", "P", "tau", "comm_dtype") + _COMPRESS_KEYS,
                         "theta", None),
    "local_dsgd": (("H", "topology", "comm_dtype"), "params", "one_peer_exp"),
    "local_dadam": (("H", "topology", "comm_dtype"), "params", "one_peer_exp"),
    "desloc": (("H", "Ku", "Kv"), "params", None),
    "noloco": (("H", "seed", "rounds"), "theta", None),
}
LOCAL_METHODS = tuple(_METHODS)
DEFAULT_PERIOD = 10  # H (steps) when a spec does not give one.
_ALIASES = {"h": "H", "sync_every": "H", "gossip_every": "H", "p": "P",
            "num_fragments": "P", "overlap_steps": "tau", "tau": "tau",
            "topology": "topology", "comm_dtype": "comm_dtype",
            "overlap": "overlap", "compress": "compress", "block": "block",
            "fraction": "fraction", "kx": "H", "ku": "Ku", "kv": "Kv",
            "sync_every_u": "Ku", "sync_every_v": "Kv", "seed": "seed",
            "pairing_seed": "seed", "rounds": "rounds",
            "pairing_rounds": "rounds"}
_KEY_HELP = {"H": "H=<steps >= 1>", "P": "P=<fragments, 1..H>",
             "tau": "tau=<overlap steps, tau*P < H>",
             "topology": "topology=<name, e.g. ring>",
             "comm_dtype": "comm_dtype=<dtype, e.g. bfloat16>",
             "overlap": "overlap=<none|delayed|eager>",
             "compress": "compress=<int8|fp8|int4|fp4|topk>",
             "block": "block=<values per scale, >= 2>",
             "fraction": "fraction=<top-k share, (0, 1]>",
             "Ku": "Ku=<first-moment period, steps >= 1>",
             "Kv": "Kv=<second-moment period, steps >= 1>",
             "seed": "seed=<pairing seed, >= 0>",
             "rounds": "rounds=<distinct pairings, 1..1024>"}
SYNTAX = ("NAME[:KEY=VALUE,...] with NAME one of " + ", ".join(LOCAL_METHODS)
          + "; e.g. diloco:H=10, streaming_diloco:H=10,P=4,tau=1, "
          "diloco:H=10,topology=ring, diloco:H=30,overlap=eager,compress=fp4, "
          "local_dsgd:H=4,topology=one_peer_exp, desloc:Kx=16,Ku=48,Kv=96, "
          "noloco:H=50,seed=0,rounds=8")


def is_local_spec(key: str) -> bool:
  """True if ``key`` (lower case) names a local-update spec (or has ``:``)."""
  return ":" in key or key.strip() in _METHODS


def _int(spec, given, key: str, low: int, default: int) -> int:
  """``given[key]`` (``default`` when absent) as an int ``>= low`` in
  decimal digits (``010`` is 10); else a ValueError naming the key as the
  spec wrote it (an alias such as ``Kx`` for ``H`` too)."""
  if key not in given:
    return default
  value = given[key]
  if re.fullmatch(r"\+?[0-9]+", value) and int(value) >= low:
    return int(value)
  written = getattr(given, "written", {}).get(key, key)
  what = _KEY_HELP[key] if written.lower() == key.lower() else (
      f"{written} is {key}: {_KEY_HELP[key]}")
  raise ValueError(f"{spec!r}: {written}={value!r} must be an integer >= "
                   f"{low} ({what}).")


def parse_spec(spec: str, c: Cluster) -> Method:
  """A local-update ``Method`` from ``NAME[:KEY=VALUE,...]``.

  Names and keys (defaults in brackets; units in steps):

  * ``local_sgd``: ``H`` [10], ``comm_dtype`` [none: param dtype],
    ``compress``, ``block``, ``fraction`` (as DiLoCo: compressed Local SGD
    sends the differences to the last average).
  * ``diloco``: ``H`` [10], ``topology`` [none: exact all-reduce; a name
    for :func:`decentral_jax.topology.make` gives decentralized DiLoCo],
    ``comm_dtype`` [none: float32], ``overlap`` [none; ``delayed`` or
    ``eager``: trickled reduction, exact all-reduce only], ``compress``
    [none; a format of
    :data:`~decentral_jax.wire_format.COMPRESSED`, exact
    all-reduce only], ``block`` [256], ``fraction`` [0.01, top-k].
  * ``streaming_diloco``: ``H`` [10], ``P`` [1] fragments, ``tau`` [0]
    overlap steps (``1 <= P <= H``, ``tau * P < H``), ``comm_dtype``
    [none: float32 theta] dtype of the pseudo-gradients on the wire,
    ``compress``, ``block``, ``fraction`` (as DiLoCo).
  * ``local_dsgd`` / ``local_dadam``: ``H`` [10] (``gossip_every``),
    ``topology`` [one_peer_exp], ``comm_dtype`` [none: param dtype].
  * ``desloc`` (DES-LOC-Adam, arXiv 2505.22549): ``Kx`` (alias ``H``)
    [10], ``Ku`` [3 Kx], ``Kv`` [6 Kx]: the parameters, first and second
    moments all-reduced in the parameter dtype every ``Kx``, ``Ku``,
    ``Kv`` steps; priced as a blocking sync every ``Kx`` steps of
    ``1 + Kx / Ku + Kx / Kv`` parameter copies (``Method.sync_share``),
    the moments' bytes spread evenly over the parameters' syncs: the
    bytes per step ``|x| / Kx + |u| / Ku + |v| / Kv`` are exact, the
    moments' syncs are not priced as bursts of their own.
  * ``noloco`` (arXiv 2506.10911): ``H`` [10], ``seed`` [0], ``rounds``
    [8]: one round of :func:`decentral_jax.topology.pairings.random_pairs`
    (seeded, on the cluster's workers) every ``H`` steps, a pair exchange of one float32
    ``theta``-sized message (:func:`decentral_jax.optim.noloco.noloco`
    sends ``beta Delta + gamma phi``), each worker waiting for its
    partner only; priced as decentralized DiLoCo over that schedule.

  Keys also accept the library's argument names (``sync_every``,
  ``gossip_every``, ``num_fragments``, ``overlap_steps``); ``H`` and ``P``
  are case-insensitive; an error names the key as written. Whole numbers
  are decimal digits (``H=010`` is ``H=10``). The returned method's ``name`` is the canonical
  spec with every parameter spelled out (e.g. ``streaming_diloco:H=10,P=4,
  tau=1``).

  Raises:
    ValueError: unknown name or key, a part that is not ``key=value``, a
      repeated key, a value out of range, an unknown topology or dtype; the
      message quotes the spec, names the bad part and shows the syntax.
  """
  text = str(spec).strip()
  name, _, rest = text.partition(":")
  name = name.strip().lower().replace("-", "_")
  if name not in _METHODS:
    raise ValueError(f"{spec!r}: unknown local-update method {name!r}; "
                     f"write {SYNTAX}.")
  allowed, message, default_topo = _METHODS[name]
  given = parse_parameters(spec, name, rest, allowed, _KEY_HELP, _ALIASES,
                           syntax=SYNTAX)
  if name == "desloc":
    return _desloc(spec, given)
  if name == "noloco":
    return _noloco(spec, given, c)
  period, frags, tau = _schedule(spec, given)
  comm = (floating_dtype_name(given["comm_dtype"], repr(spec))
          if "comm_dtype" in given else None)
  raw_topo = given.get("topology", default_topo)
  topo = topo_name = None
  if raw_topo is not None:
    topo_name = raw_topo.lower().replace("-", "_")
    topo = _topology(spec, raw_topo, topo_name, c)
  parts = [f"H={period}"]
  if name == "streaming_diloco":
    parts += [f"P={frags}", f"tau={tau}"]
  if topo is not None:
    parts.append(f"topology={topo_name}")
  if comm is not None:
    parts.append(f"comm_dtype={comm}")
  outer = given.get("overlap", "none").lower()
  if outer not in ("none", "delayed", "eager"):
    raise ValueError(f"{spec!r}: overlap={given['overlap']!r} must be none, "
                     "delayed or eager.")
  if outer != "none":
    parts.append(f"overlap={outer}")
  fmt, block, fraction = compression.parse(spec, given)
  if fmt is not None:
    parts += compression.name_parts(fmt, block, fraction)
  return Method(f"{name}:" + ",".join(parts), "local", topo,
                overlap=False, period=period, fragments=frags,
                overlap_steps=tau, message=message, comm_dtype=comm,
                compress=fmt, compress_block=block,
                compress_fraction=fraction, outer_overlap=outer)


def _desloc(spec, given: dict) -> Method:
  """DES-LOC's method: a sync every ``Kx`` steps carrying the moments'
  share ``1 + Kx / Ku + Kx / Kv`` of parameter copies."""
  kx = _int(spec, given, "H", 1, DEFAULT_PERIOD)
  ku = _int(spec, given, "Ku", 1, 3 * kx)
  kv = _int(spec, given, "Kv", 1, 6 * kx)
  return Method(f"desloc:Kx={kx},Ku={ku},Kv={kv}", "local", None,
                overlap=False, period=kx, message="params",
                sync_share=1 + kx / ku + kx / kv)


def _noloco(spec, given: dict, c: Cluster) -> Method:
  """NoLoCo's method: decentralized DiLoCo over seeded random pairs."""
  period = _int(spec, given, "H", 1, DEFAULT_PERIOD)
  seed = _int(spec, given, "seed", 0, 0)
  rounds = _int(spec, given, "rounds", 1, pairings.DEFAULT_ROUNDS)
  try:
    topo = pairings.random_pairs(c.n_workers, seed=seed, rounds=rounds,
                                 local_size=c.local_size)
  except ValueError as e:
    raise ValueError(f"{spec!r}: {e}") from None
  return Method(f"noloco:H={period},seed={seed},rounds={rounds}", "local",
                topo, overlap=False, period=period, message="theta")


def _schedule(spec, given: dict) -> tuple[int, int, int]:
  """``(H, P, tau)`` of a spec's parameters, checked against each other."""
  period = _int(spec, given, "H", 1, DEFAULT_PERIOD)
  frags = _int(spec, given, "P", 1, 1)
  tau = _int(spec, given, "tau", 0, 0)
  if frags > period:
    raise ValueError(f"{spec!r}: P={frags} must be <= H={period} (each "
                     "fragment syncs once per period); lower P or raise H.")
  if tau * frags >= period:
    raise ValueError(f"{spec!r}: tau={tau} needs tau * P < H ({tau} * "
                     f"{frags} >= {period}) so a fragment is merged before "
                     "the next is sent; lower tau or P, or raise H.")
  return period, frags, tau


def _topology(spec, raw: str, key: str, c: Cluster) -> topology_lib.Topology:
  """Topology ``key`` (``raw``, lower case) on ``c``; errors quote ``raw``."""
  try:
    return (sgp_topology(c.n_workers, c.local_size) if key == "sgp"
            else topology_lib.make(key, c.n_workers, c.local_size))
  except ValueError as e:
    raise ValueError(f"{spec!r}: topology={raw!r}: {e}") from None


# ---------------------------------------------------------------------------
# Simulator.
# ---------------------------------------------------------------------------


def simulate(m: Method, c: Cluster, w: Workload,
             fac: np.ndarray, warmup: int) -> float:
  """Mean seconds per iteration of a kind-"local" method (max-plus recursion).

  Args:
    m: a checked kind-"local" method.
    c, w: cluster and workload.
    fac: compute multipliers float64 [steps, n] (``Workload.compute_factors``).
    warmup: steps discarded; the mean is over whole schedule periods
      (:func:`~decentral_jax.runtime_model.local_sync.schedule_period`)
      from the first period boundary at or after ``warmup`` to the last one
      at or before ``steps``.

  Returns:
    Seconds per iteration.

  Raises:
    ValueError: no whole period fits between ``warmup`` and ``steps``.
  """
  steps = fac.shape[0]
  period = local_sync.schedule_period(m)
  start = -(-warmup // period) * period
  whole = (steps - start) // period
  if whole < 1:
    raise ValueError(f"steps={steps} with warmup={warmup} holds no whole "
                     f"period of {period} steps of {m.name!r}; use steps >= "
                     f"{start + period}.")
  end = start + whole * period
  fwd_m, bwd_m = split_compute(w)
  x = (fwd_m + bwd_m) * fac[:end] + w.optimizer_s
  if m.outer_overlap != "none":
    s, mark = _simulate_trickled(m, c, w, x, start)
  elif m.topology is None:
    s, mark = _simulate_exact(m, c, w, x, start)
  else:
    s, mark = _simulate_gossip(m, c, w, x, start)
  return float(np.mean(s - mark) / (end - start))


def _simulate_exact(m: Method, c: Cluster, w: Workload, x: np.ndarray,
                    start: int) -> tuple[np.ndarray, np.ndarray]:
  """Exact all-reduce syncs of ``P`` fragments, each overlapped ``tau`` steps.

  ``x``: seconds of each step's compute, float64 [steps, n]. Returns the
  step start times after the last step and at step ``start``, float64 [n].
  """
  h = m.period
  a, tau = local_sync.fragment_sync_s(m, c, w), m.overlap_steps
  offs = local_sync.fragment_offsets(m)
  send = {o: q for q, o in enumerate(offs)}
  merge = {(o + tau) % h: q for q, o in enumerate(offs)}
  ends = [0.0] * len(offs)
  free = -math.inf

  def step(k, s):
    nonlocal free
    t = k + 1
    s = s + x[k]
    q = send.get(t % h)
    if q is not None and t >= max(offs[q], 1):
      ends[q] = free = max(float(s.max()), free) + a
    q = merge.get(t % h)
    if q is not None and t >= max(offs[q], 1) + tau:
      s = np.maximum(s, ends[q])
    return s

  return _run_steps(x, start, step)


def _run_steps(x: np.ndarray, start: int,
               step) -> tuple[np.ndarray, np.ndarray]:
  """Step starts ``s`` float64 [n] from 0 through ``s = step(k, s)``, k < steps.

  Returns ``s`` after the last step and as it was at step ``start``.
  """
  s = np.zeros(x.shape[1])
  mark = s
  for k in range(x.shape[0]):
    if k == start:
      mark = s.copy()
    s = step(k, s)
  return s, mark


def _simulate_trickled(m: Method, c: Cluster, w: Workload, x: np.ndarray,
                       start: int) -> tuple[np.ndarray, np.ndarray]:
  """Trickled reduction: one slice per step from the first sync on (as ``_simulate_exact``)."""
  h = m.period
  a = local_sync.slice_sync_s(m, c, w)
  # Steps k >= H carry a slice of the pseudo-gradient of the last sync.
  return _run_steps(x, start, lambda k, s: (
      np.maximum(s + x[k], s.max() + a) if k >= h else s + x[k]))


def _simulate_gossip(m: Method, c: Cluster, w: Workload, x: np.ndarray,
                     start: int) -> tuple[np.ndarray, np.ndarray]:
  """One blocking gossip round every ``H`` steps (as ``_simulate_exact``)."""
  h = m.period
  costs = local_sync.round_costs(m, c, w)

  def step(k, s):
    t = k + 1
    s = s + x[k]
    if t % h == 0:
      members, tau_r = costs[(t // h - 1) % len(costs)]
      s = s[members].max(axis=1) + tau_r
    return s

  return _run_steps(x, start, step)


# ---------------------------------------------------------------------------
# Closed form.
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def expected_wait(n: int, spread: float, overlap: float, delta: float) -> float:
  """``E[(spread U + delta - overlap V)^+]`` in units of the compute std.

  ``U = max(Z_1..Z_n) - Z_1`` for i.i.d. standard normals (the lag of a
  worker behind the slowest of ``n``; 0 for ``n = 1``), ``V`` an
  independent standard normal. Evaluated as ``g(delta) + spread
  int_0^inf Phi((spread u + delta) / overlap) (1 - F_U(u)) du`` with
  ``g(mu) = E[(mu - overlap V)^+]`` (integration by parts).
  """
  spread, overlap, delta = (round(float(v), 4) for v in (spread, overlap,
                                                         delta))
  if overlap > 0:
    z = delta / overlap
    g0 = delta * special.ndtr(z) + overlap * math.exp(-0.5 * z * z) / math.sqrt(
        2 * math.pi)
  else:
    g0 = max(delta, 0.0)
  if n <= 1 or spread <= 0:
    return float(g0)
  x = np.linspace(-8.0, 8.0, 321)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  u = np.linspace(0.0, 12.0, 481)
  cdf_u = np.trapezoid(pdf * special.ndtr(x[None, :] + u[:, None])**(n - 1),
                       x, axis=1)
  mu = spread * u + delta
  step = (special.ndtr(mu / overlap) if overlap > 0 else (mu >= 0).astype(float))
  return float(g0 + spread * np.trapezoid(step * (1.0 - cdf_u), u))


def _barrier_excess(w: Workload, n: int, g: int) -> float:
  """``E[max of n sums of g compute draws] - g mean`` (seconds)."""
  if w.compute_samples_s is not None and g == 1:
    return w.expected_max_excess(n)
  return math.sqrt(g) * w.compute_std_s * expected_max_normal(n)


def closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """Closed-form per-iteration time of a kind-"local" method (module doc).

  Returns:
    A :class:`~decentral_jax.runtime_model.method.Estimate`: ``compute_s =
    C + O``, ``exposed_comm_s`` the deterministic sync time per iteration,
    ``variability_s`` the expected waits for slower workers per iteration.
  """
  if m.outer_overlap != "none":
    return _trickled_closed_form(m, c, w)
  if m.topology is None:
    return _exact_closed_form(m, c, w)
  return _gossip_closed_form(m, c, w)


def expected_excess_of_max(n: int, s: float) -> float:
  """``E[(max(Z_1..Z_n) - s)^+]`` for i.i.d. standard normals (0 for ``n < 2``)."""
  if n < 2:
    return 0.0
  z = np.linspace(s, max(s, 0.0) + 12.0, 2401)
  return float(np.trapezoid(1.0 - special.ndtr(z)**n, z))


def _trickled_closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """One slice per step beside the compute: ``max(x, a_s)`` plus waits (module doc)."""
  n = c.n_workers
  base = w.compute_mean_s + w.optimizer_s
  sigma = w.compute_std_s
  delta = local_sync.slice_sync_s(m, c, w) - base
  var = 0.0
  if n > 1 and sigma > 0:
    barrier = sigma * expected_max_normal(n)
    if delta >= 0:
      var = sigma * expected_excess_of_max(n, delta / sigma)
    else:
      drift = REFLECTION * expected_max_normal(n) * sigma**2 / -delta
      var = 1.0 / (1.0 / drift + 1.0 / barrier)
  det = base + max(delta, 0.0)
  return Estimate(m.name, det + var, base, det - base, var)


def _exact_closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """Exact all-reduce syncs: exposed fragments plus waits (module doc)."""
  n, h = c.n_workers, m.period
  base = w.compute_mean_s + w.optimizer_s
  sigma = w.compute_std_s
  a, tau = local_sync.fragment_sync_s(m, c, w), m.overlap_steps
  offs = local_sync.fragment_offsets(m)
  delta = a - tau * base  # exposed (> 0) or slack (< 0) per fragment
  exposed = len(offs) * max(0.0, delta)
  var, barrier = 0.0, 0.0
  if n > 1 and sigma > 0:
    for q, o in enumerate(offs):
      gap = (o - offs[q - 1]) % h or h  # steps since the last send
      g = gap - tau  # steps since the last merge
      barrier += _barrier_excess(w, n, gap)
      if tau == 0:
        var += _barrier_excess(w, n, g)
      else:
        var += sigma * expected_wait(n, math.sqrt(g), math.sqrt(tau),
                                     delta / sigma) - max(delta, 0.0)
    if tau > 0 and delta < 0:
      # Held-back workers: reflection at the slack -delta (module doc).
      drift = h * REFLECTION * expected_max_normal(n) * sigma**2 / -delta
      var = max(var, 1.0 / (1.0 / drift + 1.0 / barrier))
  det = base + exposed / h
  return Estimate(m.name, det + var / h, base, det - base, var / h)


def _gossip_closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """One blocking gossip round per ``H`` steps: SGP's closed form."""
  n, h = c.n_workers, m.period
  base = w.compute_mean_s + w.optimizer_s
  sigma = w.compute_std_s
  costs = local_sync.round_costs(m, c, w)
  det = np.zeros(n)
  tot = np.zeros(n)
  for members, tau_r in costs:
    size = [len(set(row)) for row in members.tolist()]
    d = np.array([math.sqrt(h) * sigma * coupling_excess(k, 0.0)
                  if sigma > 0 else 0.0 for k in size])
    det += h * base + tau_r
    tot += h * base + tau_r + d
  det_s, tot_s = det.max() / (h * len(costs)), tot.max() / (h * len(costs))
  return Estimate(m.name, float(tot_s), base, float(det_s - base),
                  float(tot_s - det_s))
