"""A training method to price (:class:`Method`), its checks and its estimate.

The bottom of the runtime model's method layer: the estimators of each kind
(:mod:`~decentral_jax.runtime_model.per_step_methods` for "all_reduce" and
"gossip", :mod:`~decentral_jax.runtime_model.local_methods` for "local"), the
spec parsers (:mod:`~decentral_jax.runtime_model.specs` and
``local_methods.parse_spec``) and the dispatch over kinds
(:func:`decentral_jax.runtime_model.specs.make_method`,
:mod:`~decentral_jax.runtime_model.step_time`) all build on this module,
which imports none of them.

Units: seconds (``_s``), bytes. Errors: :class:`ValueError` naming the bad
field or spec part.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from decentral_jax import checks
from decentral_jax import wire_format
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import RoundCost
from decentral_jax.runtime_model.costs import round_cost
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import wire_dtype

METHOD_KINDS = ("all_reduce", "gossip", "local")
OUTER_OVERLAPS = ("none", "delayed", "eager")


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
  """A training method to cost.

  Attributes:
    name: label used in tables ("all_reduce", "sgp", or the topology name).
    kind: "all_reduce" (All-Reduce of gradients, bucketed; the PyTorch DDP
      schedule), "gossip" (mixing of parameters over ``topology``; the
      Decent-DP schedule) or "local" (local updates with a sync every
      ``period`` steps, below).
    topology: the gossip topology (``None`` for all_reduce, and for the
      exact all-reduce of kind "local").
    overlap: True: communication overlaps compute (All-Reduce: bucket by
      bucket with the rest of the backward; gossip: with the next forward and
      backward). False: it runs after the step and is waited for (e.g. SGP,
      Assran et al. 2019, or a runtime without async collectives).
    measured_s: optional measured seconds, overriding the formulas: for
      all_reduce one value (the whole gradient), for gossip one per round
      (the whole parameter message), for local one value for the exact
      all-reduce of the whole sync message (split evenly over fragments)
      or one per topology round.
    period: kind "local" only: the sync period ``H`` in steps (>= 1;
      ``sync_every`` of Local SGD / DiLoCo, ``gossip_every`` of local
      D-SGD / DAdam). Default 1.
    fragments: kind "local", exact all-reduce only: Streaming DiLoCo's
      ``P`` (``num_fragments``), ``1 <= P <= H``. Default 1.
    overlap_steps: kind "local", exact all-reduce only: Streaming DiLoCo's
      ``tau`` (``overlap_steps``), inner steps during which a fragment's
      all-reduce may run; ``tau * P < H``. Default 0 (blocking).
    message: kind "local" only: what is synchronised, which sets the dtype
      on the wire: "params" (the parameters in ``Workload.param_dtype``;
      Local SGD, local D-SGD / DAdam) or "theta" (DiLoCo's global copy,
      ``param_dtype`` promoted to at least float32). Default "params".
    comm_dtype: kinds "local" and "gossip": optional dtype of the message
      on the wire (numpy name, e.g. "bfloat16"; ``config.comm_dtype``),
      overriding ``message``'s (gossip: the parameters') dtype; bytes scale
      with its itemsize. Default None.
    bucket_bytes: optional bucket size (bytes) for this method, replacing
      ``Workload.bucket_bytes`` (``config.bucket_bytes`` of bucketed
      gossip). Default None.
    compress: kinds "gossip" and "local" (exact all-reduce only): optional
      compression format of what is sent, one of
      :data:`~decentral_jax.wire_format.COMPRESSED` (bytes and
      codec time in :mod:`~decentral_jax.runtime_model.compression`); a
      compressed gossip round is realised with ``ppermute`` terms; a
      compressed sync is a reduce-scatter and all-gather of codes (scaled
      formats) or an all-gather of indices and values (``topk``).
      Excludes ``comm_dtype``. Default None.
    compress_block: values per scale or top-k chunk (``B``). Default 256.
    compress_fraction: top-k: share of each chunk sent. Default 0.01.
    outer_overlap: kind "local", DiLoCo only (exact all-reduce, one
      fragment, no ``overlap_steps``): ``"none"`` (the sync blocks),
      ``"delayed"`` or ``"eager"`` (Kale et al. 2025, arXiv 2502.12996:
      the outer step uses the average of the previous round, reduced by a
      trickled reduction, ``1/H`` of the message in each of the next ``H``
      inner steps beside their compute). Default "none".
    sync_share: kind "local", exact uncompressed all-reduce only: bytes of
      the mean sync relative to one copy of the parameters (DES-LOC,
      ``desloc:Kx=..,Ku=..,Kv=..``: ``1 + K_x / K_u + K_x / K_v``, the
      moments' averages spread evenly over the parameters' syncs); kind
      "gossip", uncompressed only: bytes of a round relative to one copy
      of the parameters (gradient tracking,
      ``gradient_tracking:topology=..``: 2, the parameters and the
      tracker, both overlapped). Default 1.0.
    pipelined: kind "gossip", overlapped only: pipelined gossip
      (``config.pipelined_gossip``; the round of step ``k`` mixed in step
      ``k + 1``, round ``floor(k / 2)``). The default schedule already
      hides a round behind the next forward and backward; with
      ``Workload.gossip_in_flight`` the optimizer's update joins the
      in-flight window (:mod:`~decentral_jax.runtime_model.in_flight`).
      Default False.

  Kind "local" (local-update methods: Local SGD, DiLoCo, Streaming DiLoCo,
  decentralized DiLoCo, local D-SGD / DAdam) takes ``H - 1`` purely local
  steps, then a synchronisation that is never overlapped with the step's
  compute (it runs inside a ``lax.cond`` after the inner update): an exact
  all-reduce of the message (``topology`` None) or one round of
  ``topology``; ``overlap`` is ignored. See
  :mod:`decentral_jax.runtime_model.local_methods`.
  """

  name: str
  kind: str
  topology: topology_lib.Topology | None = None
  overlap: bool = True
  measured_s: tuple[float, ...] | None = None
  period: int = 1
  fragments: int = 1
  overlap_steps: int = 0
  message: str = "params"
  comm_dtype: str | None = None
  bucket_bytes: float | None = None
  compress: str | None = None
  compress_block: int = wire_format.DEFAULT_BLOCK
  compress_fraction: float = wire_format.DEFAULT_FRACTION
  outer_overlap: str = "none"
  sync_share: float = 1.0
  pipelined: bool = False

  def round_costs(self, c: Cluster, w: Workload) -> list[RoundCost]:
    """One :class:`RoundCost` per topology round (measured times if given).

    Compressed gossip (``compress``) realises every round with its
    ``ppermute`` terms.
    """
    rounds = list(_topology_round_costs(self.topology, c,
                                        self.compress is not None))
    if self.measured_s is not None:
      if len(self.measured_s) != len(rounds):
        raise ValueError(f"measured_s has {len(self.measured_s)} entries, "
                         f"topology {self.name!r} has {len(rounds)} rounds.")
      rounds = [RoundCost(np.zeros(c.n_workers),
                          np.full(c.n_workers, t / max(w.param_bytes, 1.0)),
                          r.members, r.crosses)
                for t, r in zip(self.measured_s, rounds)]
    return rounds


@functools.lru_cache(maxsize=512)
def _topology_round_costs(topo: topology_lib.Topology, c: Cluster,
                          permutes: bool = False) -> tuple[RoundCost, ...]:
  """Round costs of ``topo`` on ``c`` (cached: both are immutable)."""
  return tuple(round_cost(c, r, permutes) for r in topo.rounds)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Predicted mean per-iteration time and its parts (all seconds).

  Attributes:
    method: method label.
    iteration_s: predicted mean seconds per iteration.
    compute_s: mean forward + backward + optimizer seconds.
    exposed_comm_s: deterministic iteration time minus ``compute_s``
      (communication not hidden by overlap; factors 1 and 2).
    variability_s: ``iteration_s`` minus the deterministic time (factor 3).
  """

  method: str
  iteration_s: float
  compute_s: float
  exposed_comm_s: float
  variability_s: float


def sgp_topology(n: int, local_size: int = 1) -> topology_lib.Topology:
  """Directed one-peer exponential graph: round k receives from ``i - 2^k``."""
  if n == 1:
    return topology_lib.make("complete", 1)
  rounds = []
  for k in range(max(1, (n - 1).bit_length())):
    perm = [(i - (1 << k)) % n for i in range(n)]
    rounds.append([(list(range(n)), 0.5), (perm, 0.5)])
  topo = topology_lib.from_permutations(rounds, name="sgp")
  return topology_lib.Topology("sgp", topo.rounds, local_size)


def split_compute(w: Workload) -> tuple[float, float]:
  """Mean forward and backward seconds of ``w``.

  ``forward_s : backward_s`` split ``Workload.compute_mean_s`` (which
  compute samples, when given, rescale); all backward if both are 0.
  """
  total = w.forward_s + w.backward_s
  mean = w.compute_mean_s
  if total <= 0:
    return 0.0, mean
  return mean * w.forward_s / total, mean * w.backward_s / total


def floating_dtype_name(value, where: str) -> str:
  """The numpy name of the floating dtype ``value`` (e.g. "bfloat16").

  Args:
    value: a dtype or its name (``comm_dtype`` of a spec or ``Method``).
    where: what to name in the error (the spec or the method).

  Raises:
    ValueError: ``value`` is not a dtype the library sends
      (:func:`~decentral_jax.runtime_model.workload.wire_dtype`).
  """
  return wire_dtype(f"{where}: comm_dtype", value).name


class SpecParameters(dict):
  """Canonical key -> value (stripped text) of a spec's ``KEY=VALUE``
  parts, with ``written``: canonical key -> the key as the spec wrote it
  (an alias such as ``Kx`` or ``sync_every`` for ``H``), for errors that
  name the part given."""

  def __init__(self):
    super().__init__()
    self.written: dict[str, str] = {}


def parse_parameters(spec, name: str, rest: str, allowed, key_help: dict,
                     aliases: dict, syntax: str | None = None,
                     refused=()) -> SpecParameters:
  """The ``KEY=VALUE,...`` part of a spec ``NAME:KEY=VALUE,...`` as a dict.

  Args:
    spec: the whole spec (quoted in errors).
    name: the spec's method name (for the example in errors).
    rest: the text after ``NAME:``.
    allowed: the keys this method takes, in the order errors list them.
    key_help: key -> ``KEY=<what>`` shown in errors.
    aliases: lower-case key -> canonical key (other keys are used as
      written).
    syntax: if given, an empty part (a stray comma) is refused with this
      syntax; else it is reported as a part that is not ``KEY=VALUE``.
    refused: keys also taken, never listed in errors (the method reads
      them nowhere; the caller refuses them with its own reason).

  Returns:
    Canonical key -> value (stripped text), the keys as written in its
    ``written`` (:class:`SpecParameters`).

  Raises:
    ValueError: a part that is not ``KEY=VALUE``, a key not in
      ``allowed``, or a key given twice; the message quotes the spec.
  """
  given = SpecParameters()
  for part in rest.split(",") if rest.strip() else []:
    if syntax is not None and not part.strip():
      raise ValueError(f"{spec!r}: empty parameter (stray comma); write "
                       f"{syntax}.")
    key, eq, value = part.partition("=")
    if not eq or not value.strip():
      raise ValueError(f"{spec!r}: {part.strip()!r} is not KEY=VALUE; "
                       f"write e.g. {name}:"
                       + ",".join(key_help[k] for k in allowed) + ".")
    k = aliases.get(key.strip().lower(), key.strip())
    if k not in allowed and k not in refused:
      raise ValueError(f"{spec!r}: {name} has no parameter {key.strip()!r}; "
                       "its parameters are "
                       + ", ".join(key_help[k] for k in allowed) + ".")
    if k in given:
      raise ValueError(f"{spec!r}: {k} is given twice; give it once.")
    given[k] = value.strip()
    given.written[k] = key.strip()
  return given


def check_method(m: Method, c: Cluster) -> Method:
  """Returns ``m`` after checking its fields against each other and ``c``.

  Raises:
    ValueError: naming the bad field: an unknown ``kind``, a topology
      built for another ``n`` than ``c.n_workers``, a gossip method
      without topology, a ``bucket_bytes`` that is not > 0, or a bad
      local-update field (:func:`_check_local_fields`).
  """
  topo = m.topology
  if m.kind not in METHOD_KINDS:
    raise ValueError(f"Method.kind must be one of {METHOD_KINDS}, got "
                     f"{m.kind!r}.")
  if topo is not None and topo.n_workers != c.n_workers:
    raise ValueError(f"topology {topo.name!r} has n_workers={topo.n_workers}"
                     f" but the cluster has n_workers={c.n_workers}; build "
                     "both for the same n.")
  if m.kind == "gossip" and topo is None:
    raise ValueError("a gossip Method needs a topology.")
  if m.bucket_bytes is not None:
    checks.check_float("Method.bucket_bytes", m.bucket_bytes, minimum=0,
                       open_min=True)
  _check_local_fields(m)
  _check_compress(m)
  if m.pipelined and not (m.kind == "gossip" and m.overlap):
    raise ValueError(f"Method {m.name!r}: pipelined applies to overlapped "
                     "gossip only (not to SGP, All-Reduce, local updates or "
                     "compressed gossip).")
  return m


def _check_compress(m: Method) -> None:
  """Validates ``compress`` and its block and fraction.

  Raises:
    ValueError: a format, block or fraction out of range, compression on
      All-Reduce, on a gossip sync of a local-update method, or together
      with ``comm_dtype``.
  """
  if m.compress is None:
    return
  where = f"Method {m.name!r}"
  compression.check(m.compress, m.compress_block, m.compress_fraction, where)
  if m.kind == "all_reduce" or (m.kind == "local" and m.topology is not None):
    raise ValueError(f"{where}: compress applies to gossip and to the exact "
                     "all-reduce of local-update methods (e.g. "
                     "'dadam:compress=int8', 'diloco:H=10,compress=fp4'), not "
                     f"to kind {m.kind!r}" + (" with a topology" if m.topology
                                               is not None else "") + ".")
  if m.comm_dtype is not None:
    raise ValueError(f"{where}: give compress or comm_dtype, not both (the "
                     "format sets the bytes on the wire).")


def library_gap(m: Method) -> str | None:
  """Why decentral_jax cannot run ``m`` yet, or None if it can.

  The runtime model prices such a method when asked for it (the paper's
  schedule), marks it in tables and never recommends it:

  * Streaming DiLoCo with ``overlap_steps >= 1``: the library merges
    ``tau`` steps after the send (the update is the paper's) but
    all-reduces a fragment inside the merge step's conditional, so the
    ``tau`` inner steps do not hide it as the price assumes;
  * compressed syncs of local-update methods with delayed or eager outer
    updates (the library's overlapped outer step has no compressed
    reduction); Local SGD, DiLoCo and Streaming DiLoCo with a blocking
    compressed sync run (:func:`decentral_jax.optim.local_updates.
    compressed_mean`, the runner's ``compression`` group);
  * compressed gossip other than CHOCO-gossip on a static (period-1), doubly
    stochastic topology, blocking or overlapped (pipelined CHOCO)
    (:func:`decentral_jax.optim.choco.choco_gossip`; the runner's
    ``compression`` group with ``config.algorithm = "decentralized"`` and
    ``gossip_every = 1``, ``config.pipelined_gossip`` for the overlapped one).
  """
  if m.kind == "local":
    if m.overlap_steps > 0:
      return ("Streaming DiLoCo with tau >= 1: the library merges tau "
              "steps after the send, but all-reduces in the merge step's "
              "conditional, not hidden behind the tau steps as priced")
    if m.compress is not None and m.outer_overlap != "none":
      return ("compressed pseudo-gradients with delayed or eager outer "
              "updates (the overlapped outer step has no compressed "
              "reduction)")
    return None
  if m.kind == "gossip" and m.compress is not None:
    topo = m.topology
    if topo.period != 1 or not getattr(topo, "doubly_stochastic", False):
      return ("compressed gossip other than CHOCO-gossip (blocking, or "
              "overlapped when pipelined) on a static (period 1) doubly "
              "stochastic topology")
  return None


def _check_local_fields(m: Method) -> None:
  """Validates the local-update fields of ``m`` (any kind).

  Raises:
    ValueError: naming the bad field: ``period``, ``fragments``,
      ``overlap_steps`` out of range, fragments or overlap with a topology,
      an unknown ``message``, a non-floating ``comm_dtype``, or any of them
      set on a kind other than "local".
  """
  if m.kind != "local":
    fields = (("period", 1), ("fragments", 1), ("overlap_steps", 0),
              ("outer_overlap", "none"))
    if m.kind == "all_reduce":
      fields += (("comm_dtype", None), ("sync_share", 1.0))
    else:
      _check_sync_share(m)
      if m.comm_dtype is not None:
        floating_dtype_name(m.comm_dtype, f"Method {m.name!r}")
    odd = [f for f, default in fields if getattr(m, f) != default]
    if odd:
      raise ValueError(f"Method {m.name!r}: {', '.join(odd)} do not apply "
                       f"to kind {m.kind!r} (period, fragments and "
                       "overlap_steps are for kind 'local', e.g. "
                       "'diloco:H=10'; comm_dtype for 'local' and 'gossip').")
    return
  h, p, tau = m.period, m.fragments, m.overlap_steps
  if not checks.is_int(h) or h < 1:
    raise ValueError(f"Method {m.name!r}: period={h!r} must be an integer "
                     ">= 1 (the sync period H in steps).")
  if not checks.is_int(p) or not 1 <= p <= h:
    raise ValueError(f"Method {m.name!r}: fragments={p!r} must be an integer "
                     f"in [1, period={h}].")
  if not checks.is_int(tau) or tau < 0 or tau * p >= h:
    raise ValueError(f"Method {m.name!r}: overlap_steps={tau!r} must be an "
                     f"integer >= 0 with overlap_steps * fragments < period "
                     f"({h}).")
  if m.topology is not None and (p > 1 or tau > 0):
    raise ValueError(f"Method {m.name!r}: fragments and overlap_steps need "
                     "the exact all-reduce (topology=None); gossip syncs are "
                     "one blocking round.")
  if m.message not in ("params", "theta"):
    raise ValueError(f"Method {m.name!r}: message={m.message!r} must be "
                     "'params' or 'theta'.")
  if m.comm_dtype is not None:
    floating_dtype_name(m.comm_dtype, f"Method {m.name!r}")
  if m.measured_s is not None:
    want = 1 if m.topology is None else m.topology.period
    if len(m.measured_s) != want:
      raise ValueError(f"Method {m.name!r}: measured_s has "
                       f"{len(m.measured_s)} entries, needs {want} (one for "
                       "the all-reduce, or one per topology round).")
  _check_outer_overlap(m)
  _check_sync_share(m)


def _check_sync_share(m: Method) -> None:
  """``sync_share`` is a finite number >= 1, other than 1 only with the
  exact uncompressed all-reduce of one fragment or uncompressed gossip."""
  share = m.sync_share
  if (isinstance(share, bool) or not isinstance(share, (int, float))
      or not math.isfinite(share) or share < 1):
    raise ValueError(f"Method {m.name!r}: sync_share={share!r} must be a "
                     "finite number >= 1 (bytes of a sync per parameter "
                     "copy).")
  if share != 1 and m.kind == "gossip" and m.compress is not None:
    raise ValueError(f"Method {m.name!r}: sync_share={share!r} needs "
                     "uncompressed gossip (no compress).")
  if share != 1 and m.kind == "local" and (
      m.topology is not None or m.fragments > 1
      or m.compress is not None or m.outer_overlap != "none"):
    raise ValueError(f"Method {m.name!r}: sync_share={share!r} needs the "
                     "exact uncompressed all-reduce of one fragment (no "
                     "topology, fragments, compress or overlap).")


def _check_outer_overlap(m: Method) -> None:
  """``outer_overlap`` is one of :data:`OUTER_OVERLAPS`, and not "none" only for DiLoCo.

  Raises:
    ValueError: an unknown value, or delayed/eager with a topology, with
      fragments or overlap steps (Streaming DiLoCo), or on the parameters
      of Local SGD (``message="params"``).
  """
  if m.outer_overlap not in OUTER_OVERLAPS:
    raise ValueError(f"Method {m.name!r}: outer_overlap={m.outer_overlap!r} "
                     f"must be one of {OUTER_OVERLAPS}.")
  if m.outer_overlap != "none" and (
      m.topology is not None or m.fragments > 1 or m.overlap_steps > 0
      or m.message != "theta"):
    raise ValueError(f"Method {m.name!r}: outer_overlap={m.outer_overlap!r} "
                     "is priced for DiLoCo with the exact all-reduce (e.g. "
                     "'diloco:H=30,overlap=eager'), not with a topology, "
                     "fragments or overlap steps.")
