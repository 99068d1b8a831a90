"""Specs of All-Reduce and the gossip methods: ``NAME[:KEY=VALUE,...]``.

Names (``make_method`` and ``predict --methods``; defaults in brackets):

* ``all_reduce`` (``allreduce``, ``ar``): ``bucket_MiB`` [the workload's].
* ``sgp`` (push-sum on the directed one-peer exponential graph, blocking):
  ``comm_dtype`` [the parameters'], ``bucket_MiB``.
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

``comm_dtype`` is a floating dtype name (``bfloat16`` halves float32's
bytes); ``bucket_MiB`` in MiB (2**20 bytes, ``config.bucket_bytes``).

Raises ``ValueError`` quoting the spec and naming the bad part.
"""

from __future__ import annotations

from decentral_jax.topology import schedules as topology_lib
from decentral_jax.runtime_model import core
from decentral_jax.runtime_model import local_methods

ALL_REDUCE = ("all_reduce", "allreduce", "ar")
OPTIMIZER_NAMES = {"dadam": "dadam", "accum_adam": "accum_adam",
                   "accum_adamw": "accum_adam"}
_KEYS_HELP = {"comm_dtype": "comm_dtype=<dtype, e.g. bfloat16>",
              "bucket_MiB": "bucket_MiB=<MiB > 0>",
              "topology": "topology=<name, e.g. aer>",
              "T": "T=<accum_steps >= 1>"}
DEFAULT_ACCUM_STEPS = 4


def _topology_name(key: str) -> str | None:
  try:
    return topology_lib.canonical_name(key)
  except ValueError:
    return None


def is_gossip_spec(key: str) -> bool:
  """True if ``key`` (lower case) is handled here (see the module docstring)."""
  name, colon, _ = key.strip().partition(":")
  name = name.strip()
  if name in OPTIMIZER_NAMES:
    return True
  if not colon:
    return False
  return name in ALL_REDUCE or name == "sgp" or _topology_name(name) is not None


def _keys(name: str) -> tuple[str, ...]:
  if name in ALL_REDUCE:
    return ("bucket_MiB",)
  if name in OPTIMIZER_NAMES:
    extra = ("T",) if OPTIMIZER_NAMES[name] == "accum_adam" else ()
    return ("topology", "comm_dtype", "bucket_MiB") + extra
  return ("comm_dtype", "bucket_MiB")


def parse(spec: str, c: core.Cluster) -> core.Method:
  """The :class:`~core.Method` of ``spec`` on cluster ``c`` (module docstring).

  Raises:
    ValueError: unknown key, a part that is not ``KEY=VALUE``, a repeated
      key, a bad value, an unknown topology or dtype.
  """
  text = str(spec).strip()
  head, _, rest = text.partition(":")
  name = head.strip().lower().replace("-", "_")
  allowed = _keys(name)
  given = {}
  for part in rest.split(",") if rest.strip() else []:
    key, eq, value = part.partition("=")
    k = {"bucket_mib": "bucket_MiB", "t": "T", "accum_steps": "T"}.get(
        key.strip().lower(), key.strip())
    if not eq or not value.strip():
      raise ValueError(f"{spec!r}: {part.strip()!r} is not KEY=VALUE; write "
                       f"e.g. {name}:" + ",".join(_KEYS_HELP[a] for a in allowed)
                       + ".")
    if k not in allowed:
      raise ValueError(f"{spec!r}: {name} has no parameter {key.strip()!r}; "
                       "its parameters are "
                       + ", ".join(_KEYS_HELP[a] for a in allowed) + ".")
    if k in given:
      raise ValueError(f"{spec!r}: {k} is given twice; give it once.")
    given[k] = value.strip()
  bucket = None
  if "bucket_MiB" in given:
    try:
      bucket = float(given["bucket_MiB"]) * 2**20
    except ValueError:
      bucket = -1.0
    if not bucket > 0 or bucket == float("inf"):
      raise ValueError(f"{spec!r}: bucket_MiB={given['bucket_MiB']!r} must "
                       "be a number > 0 (MiB).")
  comm = (local_methods._floating(given["comm_dtype"], repr(spec))  # pylint: disable=protected-access
          if "comm_dtype" in given else None)
  parts = []
  if name in ALL_REDUCE:
    label, kind, topo, overlap = "all_reduce", "all_reduce", None, True
  elif name == "sgp":
    label, kind, overlap = "sgp", "gossip", False
    topo = core.sgp_topology(c.n_workers, c.local_size)
  else:
    if name in OPTIMIZER_NAMES:
      label = OPTIMIZER_NAMES[name]
      topo_key = given.get("topology", "one_peer_exp").lower().replace("-",
                                                                       "_")
      canon = _topology_name(topo_key)
      if canon is None:
        raise ValueError(f"{spec!r}: topology={given.get('topology')!r} is "
                         "not a topology; use one of "
                         f"{', '.join(topology_lib.NAMES)}.")
      if label == "accum_adam":
        t = given.get("T", str(DEFAULT_ACCUM_STEPS))
        if not t.isdigit() or int(t) < 1:
          raise ValueError(f"{spec!r}: T={t!r} must be an integer >= 1 "
                           "(accum_steps).")
        parts.append(f"T={int(t)}")
      parts.append(f"topology={canon}")
    else:
      canon = _topology_name(name)
      label = canon
    kind, overlap = "gossip", True
    try:
      topo = topology_lib.make(canon, c.n_workers, c.local_size)
    except ValueError as e:
      raise ValueError(f"{spec!r}: {e}") from None
  if comm is not None:
    parts.append(f"comm_dtype={comm}")
  if bucket is not None:
    parts.append(f"bucket_MiB={bucket / 2**20:g}")
  full = label + (":" + ",".join(parts) if parts else "")
  return core.make_method(core.Method(full, kind, topo, overlap=overlap,
                                      comm_dtype=comm, bucket_bytes=bucket), c)


# config.algorithm (decentral_jax.runner.builders.ALGORITHMS) -> spec template.
LIBRARY_SPECS = {
    "all_reduce": "all_reduce",
    "decentralized": "{optimizer}:topology={topology}",
    "local_sgd": "local_sgd:H={sync_every}",
    "diloco": "diloco:H={sync_every}",
    "decentralized_diloco": "diloco:H={sync_every},topology={topology}",
    "streaming_diloco": ("streaming_diloco:H={sync_every},P={num_fragments},"
                         "tau={overlap_steps}"),
    "sgp": "sgp",
}


def spec_for_config(config) -> tuple[str, dict]:
  """The spec and workload fields that price a run config of this library.

  Args:
    config: a run config (``decentral_jax.runner.config``): ``algorithm``,
      ``topology``, ``optimizer.name`` and ``accum_steps``,
      ``gossip_every``, ``sync_every``, ``num_fragments``,
      ``overlap_steps``, ``comm_dtype``, ``bucket_bytes``,
      ``devices_per_worker`` and ``worker_layout`` are read.

  Returns:
    ``(spec, workload_fields)``: a spec for :func:`core.make_method` and
    ``{"devices_per_worker", "worker_layout"}`` for the
    :class:`~decentral_jax.runtime_model.workload.Workload`. Decentralized
    training with ``gossip_every = H > 1`` is ``local_dsgd:H=..``.
    ``bucket_bytes = 0`` (one collective per leaf) keeps the workload's
    buckets.

  Raises:
    ValueError: an algorithm without a spec (naming it).
  """
  algo = str(config.algorithm)
  if algo not in LIBRARY_SPECS:
    raise ValueError(f"config.algorithm={algo!r} has no runtime-model spec; "
                     f"priced algorithms: {', '.join(LIBRARY_SPECS)}.")
  opt = str(config.optimizer.name)
  optimizer = ("dadam" if opt == "adamw" else
               f"accum_adam:T={int(config.optimizer.accum_steps)},")
  fields = dict(optimizer=optimizer.rstrip(","), topology=config.topology,
                sync_every=config.sync_every,
                num_fragments=config.num_fragments,
                overlap_steps=config.overlap_steps)
  spec = LIBRARY_SPECS[algo]
  if algo == "decentralized":
    if int(config.gossip_every) > 1:
      spec = f"local_dsgd:H={int(config.gossip_every)},topology={{topology}}"
    elif opt != "adamw":
      spec = "accum_adam:T={accum},topology={topology}"
      fields["accum"] = int(config.optimizer.accum_steps)
  spec = spec.format(**fields)
  extra = []
  if config.comm_dtype and algo != "all_reduce":  # all_reduce refuses it
    extra.append(f"comm_dtype={config.comm_dtype}")
  if int(config.bucket_bytes) > 0 and algo in ("decentralized", "sgp",
                                               "all_reduce"):
    extra.append(f"bucket_MiB={int(config.bucket_bytes) / 2**20:g}")
  if extra and not spec.startswith("local_dsgd"):
    spec += ("," if ":" in spec else ":") + ",".join(extra)
  elif extra:
    spec += "," + ",".join(e for e in extra if e.startswith("comm_dtype"))
  return spec, {"devices_per_worker": int(config.devices_per_worker),
                "worker_layout": str(config.worker_layout)}
