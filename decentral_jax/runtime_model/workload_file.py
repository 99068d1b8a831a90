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

import json

from decentral_jax.runtime_model.workload import Workload

FORMAT = "decentral_jax.compiled_workload.v1"


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
      field (one line naming the file and the field).
  """
  try:
    with open(path, encoding="utf-8") as f:
      got = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"workload file {path!r}: not readable JSON ({e}).") \
        from None
  if not isinstance(got, dict) or got.get("format") != FORMAT:
    raise ValueError(f"workload file {path!r}: format must be {FORMAT!r} "
                     "(written by analysis.compiled_workload).")
  try:
    comp = got["compute_s"]
    fractions = got["gossip_in_flight"]
    return Workload(
        float(got["param_count"]), float(comp["forward"]),
        float(comp["backward"]), optimizer_s=float(comp["optimizer"]),
        compute_cv=compute_cv, param_dtype=str(got["param_dtype"]),
        gossip_in_flight=((float(fractions["forward"]),
                           float(fractions["backward"])) if in_flight
                          else None))
  except (KeyError, TypeError) as e:
    raise ValueError(f"workload file {path!r}: missing or bad field {e}."
                     ) from None
  except ValueError as e:
    raise ValueError(f"workload file {path!r}: {e}") from None


__all__ = ("FORMAT", "read_workload")
