"""A :class:`~decentral_jax.runtime_model.workload.Workload` from a JSON file
read from a compiled step (NumPy only).

The file is what :func:`decentral_jax.analysis.compiled_workload.
workload_from_compiled` writes (``format`` ``decentral_jax.
compiled_workload.v1``): ``param_count``, ``param_dtype``, ``compute_s``
(``forward``, ``backward``, ``optimizer`` seconds of one step on its
profile's clock) and ``gossip_in_flight`` (``forward``, ``backward``
fractions); its ``matmul_flops``, ``activation_bytes`` and ``clock`` are
kept for the reader but do not enter the model. ``predict --workload-file
FILE`` and the main job's ``--workload_file FILE`` price with it.
"""

from __future__ import annotations

from decentral_jax import records
from decentral_jax.runtime_model.workload import MAX_PARAMS
from decentral_jax.runtime_model.workload import MAX_SECONDS
from decentral_jax.runtime_model.workload import Workload

FORMAT = "decentral_jax.compiled_workload.v1"
MAX_FILE_BYTES = 16 * 2**20  # a workload file is a few hundred bytes
_DAY_S = MAX_SECONDS  # a day
_SECONDS = ("number", 0.0, _DAY_S, False)
_FRACTION = ("number", 0.0, 1.0, False)
#: The keys the runtime model reads (others, e.g. ``matmul_flops``, are
#: kept for the reader and not checked).
SCHEMA = {
    "format": ("str", None, None, False),
    "param_count": ("whole", 1.0, MAX_PARAMS, False),
    "compute_s": (records.Obj({"forward": _SECONDS, "backward": _SECONDS,
                               "optimizer": _SECONDS},
                              ("forward", "backward", "optimizer"),
                              extra=True), None, None, False),
    "gossip_in_flight": (records.Obj({"forward": _FRACTION,
                                      "backward": _FRACTION},
                                     ("forward", "backward"), extra=True),
                         None, None, False),
    "param_dtype": ("str", None, None, False),
}
REQUIRED = tuple(SCHEMA)


def read_workload(path: str, *, compute_cv: float = 0.05,
                  in_flight: bool = True) -> Workload:
  """The workload of a compiled-step JSON file.

  Args:
    path: the file.
    compute_cv: the compute's coefficient of variation (the file has one
      program, not its variability; 0.05 as the typed presets).
    in_flight: take the file's ``gossip_in_flight`` (False: the runtime
      model's default, the gossip behind the whole next forward and
      backward).

  Raises:
    ValueError: an unreadable file, another format, or a missing or bad
      field (:data:`SCHEMA`: finite seconds up to a day, fractions in
      [0, 1], at most ``MAX_PARAMS`` parameters in at most ``MAX_BUCKETS``
      buckets of :class:`Workload`'s default 25 MiB; one line ``workload
      file FILE: ...`` naming the field).
  """
  got = records.read_json(path, max_bytes=MAX_FILE_BYTES)
  if isinstance(got, records.Damaged):
    raise ValueError(f"workload file {path!r}: not readable JSON "
                     f"({got.reason}).")
  if not isinstance(got, dict) or got.get("format") != FORMAT:
    raise ValueError(f"workload file {path!r}: format must be {FORMAT!r} "
                     "(written by analysis.compiled_workload).")
  bad = records.object_error(got, "", SCHEMA, REQUIRED, extra=True)
  if bad:
    raise ValueError(f"workload file {path!r}: missing or bad field "
                     f"{bad[0].split('.')[0]!r}: {bad[1]}.")
  comp, fractions = got["compute_s"], got["gossip_in_flight"]
  try:
    return Workload(
        float(got["param_count"]), float(comp["forward"]),
        float(comp["backward"]), optimizer_s=float(comp["optimizer"]),
        compute_cv=compute_cv, param_dtype=str(got["param_dtype"]),
        gossip_in_flight=((float(fractions["forward"]),
                           float(fractions["backward"])) if in_flight
                          else None))
  except ValueError as e:
    raise ValueError(f"workload file {path!r}: {e}") from None


__all__ = ("FORMAT", "read_workload")
