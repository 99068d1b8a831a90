"""The rows of ``decentral-jax overlap --out`` read back (``--render``).

One validating reader: every field :func:`decentral_jax.tools.overlap.
run_case` writes is checked (its kind and range) before a table reads it,
and so are the relations between them: the matmul FLOPs in flight, of the
program and of each collective, are at most the program's total; a
collective's bytes are a finite number >= 0; ``param_bytes`` is in (0,
1 PiB]; the build modes are the resolved ones; the distinct round a
transfer-table row names is a round of its topology. A damaged row is
refused in one line naming the file, the line and the key. No JAX.
"""

from __future__ import annotations

from decentral_jax import records
from decentral_jax.tools import flag_types
from decentral_jax.tools.overlap_flags import MAX_NETWORK_GBPS, MODES

_COUNT = ("number", 0.0, None, False)
_STR = ("str", None, None, False)
_BOOL = ("bool", None, None, False)
_OPS = ("int", 0, None, False)
#: The consensus modes of a program (``runner.step.CONSENSUS_MODES``).
CONSENSUS_MODES = ("logged", "input", "none")
#: How a program's gossip rounds and consensus were built, as resolved
#: (``runner.config.GOSSIP_ROUNDS`` / ``CONSENSUS_AT`` without ``auto``).
GOSSIP_ROUNDS = ("switch", "static")
CONSENSUS_AT = ("log_step", "next_step")
#: The most parameter bytes a row may hold (1 PiB): a model's size.
MAX_PARAM_BYTES = 2.0 ** 50
#: The keys of an ``--out`` row the tables read (each row must have them).
ROW_SCHEMA = {"case": _STR, "target": _STR, "mode": _STR, "consensus": _STR,
              "distinct_round": ("int", 0, None, True),
              "gossip_rounds": _STR,  # "static", "switch"
              "consensus_at": _STR,  # "log_step", "next_step"
              "param_bytes": _COUNT, "total_flops": _COUNT,
              "flops_in_flight": _COUNT,
              "collectives": ("list", None, None, False)}
#: The other keys the writer writes (rows of older runs may lack them).
MORE_SCHEMA = {"topology": _STR, "overrides": ("strs", None, None, False),
               "compile_s": _COUNT,
               "network_gbps": ("number", 0.0, MAX_NETWORK_GBPS, True)}
#: The keys of one element of a row's ``"collectives"``
#: (:class:`decentral_jax.analysis.overlap.CollectiveOverlap`, ``between``).
COLLECTIVE_SCHEMA = {"kind": _STR, "name": _STR, "computation": _STR,
                     "op_name": _STR, "bytes": _COUNT, "is_async": _BOOL,
                     "in_conditional": _BOOL, "in_loop": _BOOL,
                     "forward": _OPS, "backward": _OPS, "other": _OPS,
                     "between": _OPS, "flops": _COUNT, "overlapped": _BOOL}
#: The keys of a collective the tables read.
COLLECTIVE_READ = ("kind", "bytes", "is_async", "in_conditional", "forward",
                   "backward", "flops")
#: The transfer table's cluster: 8 workers, 4 per node, on this topology.
TRANSFER_TOPOLOGY = ("alternating_exp_ring", 8, 4)


def transfer_topology():
  """The topology the transfer table prices a row's round on."""
  from decentral_jax.topology import schedules
  return schedules.make(*TRANSFER_TOPOLOGY)


def _choice(row: dict, key: str, allowed) -> str | None:
  if row[key] not in allowed:
    return (f"{key} must be one of {', '.join(allowed)}, got "
            f"{records.short(row[key])}")
  return None


def _collective_error(c, k: int, total: float) -> str | None:
  got = records.object_error(c, f"collectives[{k}]", COLLECTIVE_SCHEMA,
                             COLLECTIVE_READ, extra=True)
  if got:
    return got[1]
  if c["flops"] > total:
    return (f"collectives[{k}].flops ({c['flops']:g}) is more than the "
            f"program's total_flops ({total:g})")
  return None


def _param_bytes_error(n: float) -> str | None:
  if not 0 < n <= MAX_PARAM_BYTES:  # the transfer times divide by it
    return (f"param_bytes must be in (0, {MAX_PARAM_BYTES:.0f}] (a model's "
            f"parameter bytes), got {records.short(n)}")
  return None


def row_error(row: dict) -> str | None:
  """Why one ``--out`` row cannot be rendered (one line naming the key),
  or None."""
  got = records.object_error(row, "", {**ROW_SCHEMA, **MORE_SCHEMA},
                             tuple(ROW_SCHEMA), extra=True)
  if got:
    return got[1]
  options = row.get("compiler_options", "")
  why = (_choice(row, "mode", MODES)
         or _choice(row, "consensus", CONSENSUS_MODES)
         or _choice(row, "gossip_rounds", GOSSIP_ROUNDS)
         or _choice(row, "consensus_at", CONSENSUS_AT)
         or _param_bytes_error(row["param_bytes"])
         or (None if isinstance(options, (str, dict)) else
             "compiler_options must be an object or a string, got "
             f"{records.short(options)}"))
  if why:
    return why
  why = _counts_error(row)
  if why:
    return why
  total = row["total_flops"]
  if row["flops_in_flight"] > total:
    return (f"flops_in_flight ({row['flops_in_flight']:g}) is more than "
            f"total_flops ({total:g})")
  for k, c in enumerate(row["collectives"]):
    why = _collective_error(c, k, total)
    if why:
      return why
  return _round_error(row)


def _given(row: dict) -> dict[str, str]:
  """A row's ``key=value`` overrides."""
  return dict(o.split("=", 1) for o in row.get("overrides") or []
              if isinstance(o, str) and "=" in o)


def _counts_error(row: dict) -> str | None:
  """Why the counts :func:`_workers` reads are not whole numbers >= 1 in
  ASCII digits without a leading zero (``str.isdigit()`` also takes
  ``"²"``, which ``int`` refuses), or None: the ``n_workers=`` and
  ``workers_per_device=`` overrides and each part of ``topology``
  (``"slices x hosts x devices"``)."""
  given = _given(row)
  for key in ("n_workers", "workers_per_device"):
    if key in given and not flag_types.ascii_int(given[key]):
      return (f'overrides: "{key}={given[key]}" must be a whole number >= 1 '
              "in ASCII digits without a leading zero")
  topology = row.get("topology")
  if topology and not all(flag_types.ascii_int(p)
                          for p in topology.split("x")):
    return ("topology must be slices x hosts x devices, whole numbers >= 1 "
            f"in ASCII digits (e.g. 2x1x4), got {records.short(topology)}")
  return None


def _workers(row: dict) -> int | None:
  """The workers of a row (its counts checked by :func:`_counts_error`):
  its ``n_workers=`` override, else the GPUs of its target topology
  ``"AxBxC"`` times its ``workers_per_device=`` override (1 if none);
  None if the row does not say."""
  given = _given(row)
  if "n_workers" in given:
    return int(given["n_workers"])
  if not row.get("topology"):
    return None
  n = int(given.get("workers_per_device", "1"))
  for p in row["topology"].split("x"):
    n *= int(p)
  return n


def _round_error(row: dict) -> str | None:
  """A gpt2_small row (the transfer table's) must name a distinct round
  of :data:`TRANSFER_TOPOLOGY`."""
  d = row["distinct_round"]
  if d is not None and row["gossip_rounds"] == "switch":
    return ("distinct_round must be null with gossip_rounds switch (one "
            f"program holds every round), got {d}")
  workers = _workers(row)
  if (d is not None and workers is not None and d >= workers
      and row["case"] != "gpt2_small"):  # its own, tighter bound below
    return (f"distinct_round must be below the row's {workers} workers (a "
            f"schedule has fewer distinct rounds), got {d}")
  if row["case"] != "gpt2_small" or d is None:
    return None
  n = len(transfer_topology().distinct_rounds)
  if d >= n:
    return (f"distinct_round must be in [0, {n - 1}] (the distinct rounds "
            f"of {TRANSFER_TOPOLOGY[0]} on {TRANSFER_TOPOLOGY[1]} "
            f"workers), got {d}")
  return None
