"""Specs of All-Reduce and the gossip methods: ``NAME[:KEY=VALUE,...]``.

Names (``make_method`` and ``predict --methods``; defaults in brackets):

* ``all_reduce`` (``allreduce``, ``ar``): ``bucket_MiB`` [the workload's].
* ``sgp`` (push-sum on the directed one-peer exponential graph, blocking):
  ``comm_dtype`` [the parameters'] (``bucket_MiB`` is refused, below).
* a topology of :mod:`decentral_jax.topology` (``complete``, ``ring``,
  ``one_peer_exp`` / ``exp``, ``alternating_exp_ring`` / ``aer``,
  ``exponential``, ``torus``, ``static_ring``): overlapped gossip
  (Decent-DP), ``comm_dtype``, ``bucket_MiB``.
* ``dadam``, ``accum_adam``, ``accum_adamw`` (``config.algorithm =
  "decentralized"`` with ``optimizer.name = "adamw"`` or
  ``"accum_adamw"``): the same gossip, ``topology`` [one_peer_exp],
  ``comm_dtype``, ``bucket_MiB``, and for AccumAdam ``T``
  (``accum_steps``) [4, the paper's Transformer config]. Accumulation is
  local (a buffer per parameter, no bytes), so ``T`` changes neither time
  nor bytes; DAdam and AccumAdam cost the same on the same topology.
  ``pipelined`` [0]: 1 for pipelined gossip (``config.pipelined_gossip``,
  :mod:`decentral_jax.optim.pipelined`); with ``compress``, pipelined
  CHOCO-gossip, overlapped like plain gossip (below).

* ``gradient_tracking`` (``config.algorithm = "gradient_tracking"``:
  DAdam, AccumAdamW or D-SGD with a gradient tracker,
  :mod:`decentral_jax.optim.gradient_tracking`): the same overlapped
  gossip of the parameters plus one of the tracker in the same round, so
  twice the bytes and messages of a round (``Method.sync_share = 2``);
  ``topology`` [one_peer_exp], ``comm_dtype``, ``bucket_MiB``,
  ``workers_per_node``; no compression.

``comm_dtype`` is a floating dtype name (``bfloat16`` halves float32's
bytes); ``bucket_MiB`` in MiB (2**20 bytes, ``config.bucket_bytes``).

Gossip specs (topology names, ``dadam``, ``accum_adam``) also take:

* ``compress`` [none] (``int8``, ``fp8``, ``int4``, ``fp4``, ``topk``),
  ``block`` [256] and ``fraction`` [0.01, top-k]: CHOCO-gossip
  (:mod:`decentral_jax.optim.choco`) sending the compressed difference
  ``x - x_hat``; every round as ``ppermute`` terms, blocking (its
  message needs the step's update), or with ``pipelined=1`` the round of
  the step's input parameters, overlapped with the forward and backward
  as plain gossip is (``config.pipelined_gossip`` with compression); bytes
  and codec time in
  :mod:`decentral_jax.runtime_model.compression`. E.g.
  ``dadam:topology=static_ring,compress=int8``.
* ``workers_per_node`` [the cluster's ``local_size``]: the group size the
  topology is built for (``config.workers_per_node``): an integer dividing
  ``n``, or ``datacenter`` for the workers of one datacenter, so that
  ``aer:workers_per_node=datacenter`` alternates means inside each
  datacenter with means across datacenters. Node-aware topologies keep
  most traffic inside a group of that size; only they
  (:data:`NODE_AWARE`) read it, and it is refused with any other topology.

``bucket_MiB`` is read where the round is sent bucket by bucket (All-Reduce,
overlapped gossip); a blocking gossip round (``sgp``, CHOCO without
``pipelined=1``) is priced as one message, so there it is refused.

Raises ``ValueError`` quoting the spec and naming the bad part.

:func:`make_method` turns any spec (these, the local-update specs of
:func:`decentral_jax.runtime_model.local_methods.parse_spec`, a
``Topology`` or a ``Method``) into a checked
:class:`~decentral_jax.runtime_model.method.Method`.
"""

from __future__ import annotations

import re

from decentral_jax.topology import schedules as topology_lib
from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model import local_methods
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.method import check_method
from decentral_jax.runtime_model.method import floating_dtype_name
from decentral_jax.runtime_model.method import parse_parameters
from decentral_jax.runtime_model.method import sgp_topology
from decentral_jax.runtime_model import workload as workload_lib

ALL_REDUCE = ("all_reduce", "allreduce", "ar")
OPTIMIZER_NAMES = {"dadam": "dadam", "accum_adam": "accum_adam",
                   "accum_adamw": "accum_adam"}
_KEYS_HELP = {"comm_dtype": "comm_dtype=<dtype, e.g. bfloat16>",
              "bucket_MiB": "bucket_MiB=<MiB in (0, 1e9]>",
              "topology": "topology=<name, e.g. aer>",
              "T": "T=<accum_steps >= 1>",
              "compress": "compress=<int8|fp8|int4|fp4|topk>",
              "block": "block=<values per scale, >= 2>",
              "fraction": "fraction=<top-k share, (0, 1]>",
              "workers_per_node": "workers_per_node=<int or datacenter>",
              "pipelined": "pipelined=<0 or 1>"}
_ALIASES = {"bucket_mib": "bucket_MiB", "t": "T", "accum_steps": "T",
            "compress": "compress", "block": "block", "fraction": "fraction",
            "workers_per_node": "workers_per_node"}
_GOSSIP_EXTRA = ("compress", "block", "fraction", "workers_per_node")
#: The topologies whose mixing matrices depend on the group size they are
#: built for (``workers_per_node``, ``local_size``): the node-aware ones.
#: Every other topology of :data:`decentral_jax.topology.NAMES` builds the
#: same matrices at any group size, so ``workers_per_node`` is refused there.
NODE_AWARE = ("alternating_exp_ring",)
# Keys a method reads in no context, taken only to be refused with the
# reason (sgp blocks: one message of the whole parameters, no buckets).
_REFUSED_KEYS = {"sgp": ("bucket_MiB",)}
DEFAULT_ACCUM_STEPS = 4
#: Gradient tracking: the parameters and the tracker, one copy each a round.
GRADIENT_TRACKING = "gradient_tracking"
TRACKING_SHARE = 2.0


def _topology_name(key: str) -> str | None:
  try:
    return topology_lib.canonical_name(key)
  except ValueError:
    return None


def is_gossip_spec(key: str) -> bool:
  """True if ``key`` (lower case) is handled here (see the module docstring)."""
  name, colon, _ = key.strip().partition(":")
  name = name.strip()
  if name in OPTIMIZER_NAMES or name == GRADIENT_TRACKING:
    return True
  if not colon:
    return False
  return name in ALL_REDUCE or name == "sgp" or _topology_name(name) is not None


def spec_keys(name: str) -> tuple[str, ...]:
  """The keys the spec of method ``name`` (lower case, a name of the module
  docstring) reads in some context, the ones an unknown key's error lists;
  a key given in one context where it reads nothing (a bucket size of a
  blocking round, a group size of a topology that is not
  :data:`NODE_AWARE`) is refused by :func:`parse`, and so is ``sgp``'s
  ``bucket_MiB`` (read in no context, :data:`_REFUSED_KEYS`)."""
  if name in ALL_REDUCE:
    return ("bucket_MiB",)
  if name in OPTIMIZER_NAMES:
    extra = ("T",) if OPTIMIZER_NAMES[name] == "accum_adam" else ()
    return (("topology", "comm_dtype", "bucket_MiB") + extra + _GOSSIP_EXTRA
            + ("pipelined",))
  if name == "sgp":
    return ("comm_dtype",)
  if name == GRADIENT_TRACKING:
    return ("topology", "comm_dtype", "bucket_MiB", "workers_per_node")
  return ("comm_dtype", "bucket_MiB") + _GOSSIP_EXTRA


def parse(spec: str, c: Cluster) -> Method:
  """The ``Method`` of ``spec`` on cluster ``c`` (a checked one).

  Syntax and defaults in the module docstring; the returned method's
  ``name`` spells out every parameter given (and a DAdam or AccumAdam
  topology), e.g. ``accum_adam:T=4,topology=one_peer_exp``.

  Raises:
    ValueError: unknown key, a part that is not ``KEY=VALUE``, a repeated
      key, a bad value, an unknown topology or dtype.
  """
  text = str(spec).strip()
  head, _, rest = text.partition(":")
  name = head.strip().lower().replace("-", "_")
  given = parse_parameters(spec, name, rest, spec_keys(name), _KEYS_HELP,
                           _ALIASES, refused=_REFUSED_KEYS.get(name, ()))
  bucket = _bucket_bytes(spec, given)
  comm = (floating_dtype_name(given["comm_dtype"], repr(spec))
          if "comm_dtype" in given else None)
  parts = []
  share = 1.0
  if name in ALL_REDUCE:
    label, kind, topo, overlap = "all_reduce", "all_reduce", None, True
  elif name == "sgp":
    label, kind, overlap = "sgp", "gossip", False
    topo = sgp_topology(c.n_workers, c.local_size)
  else:
    if name in OPTIMIZER_NAMES or name == GRADIENT_TRACKING:
      label = OPTIMIZER_NAMES.get(name, name)
      canon, parts = _optimizer_parts(spec, label, given)
      share = TRACKING_SHARE if name == GRADIENT_TRACKING else 1.0
    else:
      canon = _topology_name(name)
      label = canon
    kind, overlap = "gossip", True
    group = _workers_per_node(spec, given, c)
    _check_node_aware(spec, name, canon, given)
    try:
      topo = topology_lib.make(canon, c.n_workers, group)
    except ValueError as e:
      raise ValueError(f"{spec!r}: {e}") from None
    if "workers_per_node" in given:
      parts.append(f"workers_per_node={given['workers_per_node'].lower()}")
  if comm is not None:
    parts.append(f"comm_dtype={comm}")
  if bucket is not None:
    parts.append(f"bucket_MiB={bucket / 2**20:g}")
  fmt, block, fraction = compression.parse(spec, given)
  if fmt is not None:
    parts += compression.name_parts(fmt, block, fraction)
  piped = _pipelined(spec, given)
  if fmt is not None:
    # CHOCO sends Q(x + u - x_hat): the round needs the step's update and
    # is not overlapped; pipelined CHOCO sends the round of the step's
    # input parameters, overlapped as plain gossip's (and, like it, needed
    # by the update: Method.pipelined stays False).
    overlap, piped_round = piped, False
  else:
    piped_round = piped
  if bucket is not None and kind == "gossip" and not overlap:
    raise ValueError(
        f"{spec!r}: bucket_MiB has no effect here: a blocking gossip round "
        "(sgp, or compress= without pipelined=1) is priced as one message "
        "of the whole parameters, whatever the bucket size; drop "
        "bucket_MiB.")
  if piped:
    parts.append("pipelined=1")
  full = label + (":" + ",".join(parts) if parts else "")
  return check_method(Method(full, kind, topo, overlap=overlap,
                             comm_dtype=comm, bucket_bytes=bucket,
                             compress=fmt, compress_block=block,
                             compress_fraction=fraction, sync_share=share,
                             pipelined=piped_round), c)


def _check_node_aware(spec, name: str, canon: str, given: dict) -> None:
  """``workers_per_node`` only with a :data:`NODE_AWARE` topology."""
  if "workers_per_node" not in given or canon in NODE_AWARE:
    return
  fix = ("topology=aer" if name in OPTIMIZER_NAMES or name == GRADIENT_TRACKING
         else "aer")
  raise ValueError(
      f"{spec!r}: workers_per_node has no effect on topology {canon!r}: its "
      "mixing matrices are the same at any group size (only "
      f"{', '.join(NODE_AWARE)} is built for one); drop workers_per_node "
      f"or use {fix}.")


def _pipelined(spec, given: dict) -> bool:
  """``pipelined=0|1`` (default 0)."""
  raw = given.get("pipelined", "0")
  if raw not in ("0", "1"):
    raise ValueError(f"{spec!r}: pipelined={raw!r} must be 0 or 1.")
  return raw == "1"


def _workers_per_node(spec, given: dict, c: Cluster) -> int:
  """The ``local_size`` the topology is built for (``workers_per_node``)."""
  raw = given.get("workers_per_node")
  if raw is None:
    return c.local_size
  if raw.lower() in ("datacenter", "dc"):
    return c.dc_size
  if (not re.fullmatch("[0-9]+", raw) or int(raw) < 1
      or c.n_workers % int(raw)):
    raise ValueError(f"{spec!r}: workers_per_node={raw!r} must be an integer "
                     f"dividing n_workers={c.n_workers}, or datacenter.")
  return int(raw)


def _bucket_bytes(spec, given: dict) -> float | None:
  """``bucket_MiB`` in bytes (None if not given); refuses a value outside
  ``[MIN_BUCKET_MIB, MAX_BUCKET_MIB]`` (the bounds of ``--bucket-MiB``)."""
  if "bucket_MiB" not in given:
    return None
  try:
    mib = float(given["bucket_MiB"])
  except ValueError:
    mib = -1.0
  if not workload_lib.MIN_BUCKET_MIB <= mib <= workload_lib.MAX_BUCKET_MIB:
    raise ValueError(f"{spec!r}: bucket_MiB={given['bucket_MiB']!r} must "
                     f"be a number in [{workload_lib.MIN_BUCKET_MIB:g}, "
                     f"{workload_lib.MAX_BUCKET_MIB:g}] (MiB: one byte to "
                     "1e9 MiB).")
  return mib * 2**20


def _optimizer_parts(spec, label: str, given: dict) -> tuple[str, list[str]]:
  """DAdam / AccumAdam: the canonical topology and the name's parameters."""
  parts = []
  topo_key = given.get("topology", "one_peer_exp").lower().replace("-", "_")
  canon = _topology_name(topo_key)
  if canon is None:
    raise ValueError(f"{spec!r}: topology={given.get('topology')!r} is "
                     "not a topology; use one of "
                     f"{', '.join(topology_lib.NAMES)}.")
  if label == "accum_adam":
    t = given.get("T", str(DEFAULT_ACCUM_STEPS))
    if not re.fullmatch("[0-9]+", t) or int(t) < 1:
      key = getattr(given, "written", {}).get("T", "T")  # as written
      raise ValueError(f"{spec!r}: {key}={t!r} must be an integer >= 1 "
                       "(T, accum_steps).")
    parts.append(f"T={int(t)}")
  parts.append(f"topology={canon}")
  return canon, parts


def make_method(spec, c: Cluster) -> Method:
  """A :class:`Method` from a name, a ``Topology`` or a ``Method``.

  Args:
    spec: "all_reduce", "sgp" (non-overlapped gossip on :func:`sgp_topology`),
      a topology name accepted by :func:`decentral_jax.topology.make` (e.g.
      "one_peer_exp", "aer"; overlapped gossip), a gossip spec such as
      "aer:comm_dtype=bfloat16" or "dadam:topology=ring" (syntax in the
      module docstring), a local-update spec such as
      "diloco:H=10" or "streaming_diloco:H=10,P=4,tau=1" (syntax in
      :func:`decentral_jax.runtime_model.local_methods.parse_spec`), a
      ``Topology`` or a ``Method`` (returned as is after checks).
    c: the cluster; topologies are built for ``c.n_workers``, ``c.local_size``.

  Raises:
    ValueError: ``c`` not a ``Cluster``, an unknown name, a bad
      local-update spec or field (naming the bad part), or a topology
      built for another ``n``.
  """
  workload_lib.check_model_arguments(c=c)
  if isinstance(spec, Method):
    return check_method(spec, c)
  if isinstance(spec, topology_lib.Topology):
    return check_method(Method(spec.name, "gossip", spec), c)
  key = str(spec).strip().lower().replace("-", "_")
  if is_gossip_spec(key):
    return parse(str(spec), c)
  if local_methods.is_local_spec(key):
    return check_method(local_methods.parse_spec(str(spec), c), c)
  if key in ALL_REDUCE:
    return check_method(Method("all_reduce", "all_reduce"), c)
  if key == "sgp":
    return check_method(Method("sgp", "gossip",
                               sgp_topology(c.n_workers, c.local_size),
                               overlap=False), c)
  try:
    name = topology_lib.canonical_name(key)
  except ValueError as e:
    raise ValueError(
        f"unknown method {str(spec)!r}: not all_reduce, sgp, a gossip "
        f"optimizer ({', '.join(OPTIMIZER_NAMES)}, {GRADIENT_TRACKING}:"
        "topology=..), a "
        f"local-update spec ({local_methods.SYNTAX}), nor a topology ({e})"
        ) from None
  topo = topology_lib.make(key, c.n_workers, c.local_size)
  return check_method(Method(name, "gossip", topo), c)
