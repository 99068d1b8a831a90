"""Where ``predict --param-dtype`` reaches the messages of a method.

``Workload.param_dtype`` is the dtype of the parameters: gossip and local
sync without their own ``comm_dtype`` send them in it, but a sync of
DiLoCo's global copy (``message="theta"``) sends at least float32 (4
bytes, :func:`decentral_jax.runtime_model.local_sync.wire_itemsize`), so
there the flag has an effect only where it moves ``max(float32,
param_dtype)`` away from the workload's without it (a preset's, a cluster
or workload file's, or the default float32). No JAX.
"""

from __future__ import annotations

import copy

import numpy as np

from decentral_jax.runtime_model import workload as workload_lib
from decentral_jax.tools.runtime_model_cli import inputs


def sends_params(m, theta_moves: bool) -> bool:
  """Whether uncompressed method ``m``'s messages are its parameters in
  ``Workload.param_dtype``: gossip or local sync without ``comm_dtype``,
  but DiLoCo's global copy only where ``--param-dtype`` moves its wire
  dtype (``theta_moves``, :func:`theta_dtype_moves`)."""
  return (m.kind in ("gossip", "local") and m.comm_dtype is None and not (
      m.kind == "local" and m.message == "theta" and not theta_moves))


def theta_note(methods, w) -> str:
  """``", float32 in a sync of DiLoCo's global copy"`` for the workload
  line where such a sync (uncompressed, no ``comm_dtype``) among
  ``methods`` sends wider values than ``w``'s parameters; else ``""``."""
  if np.dtype(w.param_dtype).itemsize >= 4 or not any(
      m.kind == "local" and m.message == "theta" and m.comm_dtype is None
      and m.compress is None for m in methods):
    return ""
  return ", float32 in a sync of DiLoCo's global copy"


def _theta_itemsize(dtype) -> int:
  """Bytes per value of a sync of DiLoCo's global copy: at least 4."""
  return max(np.dtype(dtype).itemsize, 4)


def plain_workloads(args, counts, measured, build) -> list:
  """The workloads ``predict`` builds without ``--param-dtype``, the ones
  the flag replaces (a preset's, a cluster or workload file's, or the
  default float32 parameters).

  Args:
    args: ``predict``'s parsed flags (``--param-dtype`` among those given).
    counts: the worker counts.
    measured: the ``--cluster`` file's contents, or None.
    build: ``build(args, n, measured) -> (Cluster, Workload)``, the way
      ``predict`` builds them.

  Returns:
    One ``Workload`` per count, None where it cannot be built without the
    flag.
  """
  plain = copy.copy(args)
  plain.explicit_flags = inputs.explicit_flags(args) - {"--param-dtype"}
  plain.param_dtype = workload_lib.Workload.param_dtype
  out = []
  for n in counts:
    try:
      out.append(build(plain, n, measured)[1])
    except ValueError:
      out.append(None)
  return out


def theta_dtype_moves(args, workloads, measured, build) -> bool:
  """Whether ``--param-dtype`` changes the wire dtype of a sync of DiLoCo's
  global copy at some worker count.

  Args:
    args, measured, build: as :func:`plain_workloads`.
    workloads: ``[(n, Workload)]`` as built with the flags.

  Returns:
    True where the workload built without the flag sends that sync in
    another dtype, or cannot be built without it.
  """
  bases = plain_workloads(args, [n for n, _ in workloads], measured, build)
  return any(base is None or _theta_itemsize(w.param_dtype)
             != _theta_itemsize(base.param_dtype)
             for (_, w), base in zip(workloads, bases))
