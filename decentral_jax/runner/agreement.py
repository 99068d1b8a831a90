"""Start-up agreement of the processes of a multi-process job.

Every process must train the same run: :func:`check_same_config` compares
the processes' configs field by field (all but :data:`PER_PROCESS_FIELDS`)
and :func:`check_same_start` their initial parameters (float64 sums per
leaf, :data:`INIT_RTOL`), and every process refuses together, naming the
fields or leaves that differ, so nothing is left waiting in a collective.
Both are collectives (``process_allgather``): all processes call them in
the same order; they do nothing in a single-process run.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from ml_collections import config_dict

from decentral_jax.parallel import multiprocess

PyTree = Any

# Fields that may differ between the processes of one job: how each process
# joins (its process_id, timeouts, auto-detection on some hosts only), and
# config.workdir, which --workdir overrides and whose mount point may differ
# per host (that all hosts share the directory is not checked here).
PER_PROCESS_FIELDS = ("distributed", "workdir")
# Initial parameters agree if their sums and absolute sums (float64) differ
# by at most this fraction of the absolute sum: hosts whose CPUs round a
# transcendental function differently still agree, another seed does not.
INIT_RTOL = 1e-6
_MAX_LISTED = 6


def config_fields(config: config_dict.ConfigDict) -> dict[str, str]:
  """The compared fields of a config: dotted name -> canonical JSON value.

  Groups are flattened (``"schedule.peak_lr"``); the fields of
  :data:`PER_PROCESS_FIELDS` are left out.
  """
  tree = json.loads(config.to_json_best_effort(sort_keys=True))
  out = {}

  def walk(prefix, node):
    for key, value in node.items():
      name = f"{prefix}{key}"
      if isinstance(value, dict) and value:
        walk(name + ".", value)
      else:
        out[name] = json.dumps(value, sort_keys=True)

  walk("", {k: v for k, v in tree.items() if k not in PER_PROCESS_FIELDS})
  return out


def _short(value: str | None) -> str:
  if value is None:
    return "<missing>"
  return value if len(value) <= 40 else value[:37] + "..."


def _listed(items: list[str]) -> str:
  more = len(items) - _MAX_LISTED
  return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0
                                           else "")


def config_differences(fields: list[dict[str, str]]) -> str:
  """Names the fields that differ between processes; "" if none do.

  Args:
    fields: :func:`config_fields` of every process, in process order.

  Returns:
    A one-line description: each differing field with process 0's value and
    the first differing process's value, e.g.
    ``seed (process 0: 0, process 1: 1)``.
  """
  names = sorted(set().union(*fields))
  parts = []
  for name in names:
    values = [f.get(name) for f in fields]
    others = [p for p, v in enumerate(values) if v != values[0]]
    if others:
      p = others[0]
      more = (f"; {len(others)} processes differ from process 0"
              if len(others) > 1 else "")
      parts.append(f"{name} (process 0: {_short(values[0])}, process {p}: "
                   f"{_short(values[p])}{more})")
  return _listed(parts)


def init_fingerprint(params: PyTree) -> dict[str, list]:
  """Leaf path -> ``[dtype, shape, sum, sum of |x|]`` (sums in float64)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    x = np.asarray(leaf)
    out[jax.tree_util.keystr(path)] = [
        str(x.dtype), list(x.shape), float(x.sum(dtype=np.float64)),
        float(np.abs(x).sum(dtype=np.float64))]
  return out


def init_differences(prints: list[dict[str, list]]) -> str:
  """Names the parameter leaves whose fingerprints differ; "" if none do.

  Args:
    prints: :func:`init_fingerprint` of every process, in process order.

  Returns:
    A one-line description, e.g. ``process 1 differs from process 0 in 2
    of 9 leaves: ['wpe']['embedding'], ['wte']['embedding']``.
  """
  def same(a, b):
    if a is None or b is None or a[:2] != b[:2]:
      return False
    tol = INIT_RTOL * max(a[3], b[3])
    return abs(a[2] - b[2]) <= tol and abs(a[3] - b[3]) <= tol

  names = sorted(set().union(*prints))
  for p, fp in enumerate(prints[1:], start=1):
    bad = [n for n in names if not same(fp.get(n), prints[0].get(n))]
    if bad:
      return (f"process {p} differs from process 0 in {len(bad)} of "
              f"{len(names)} leaves: {_listed(bad)}")
  return ""


def _allgather_json(obj) -> list:
  """``obj`` of every process (JSON-serialisable), in process order.

  A collective: every process must call it, in the same order.

  Raises:
    ValueError: the processes have different numbers of devices (the
      exchange needs the same number on each).
  """
  counts = multiprocess.device_counts()
  if len(set(counts.values())) > 1:
    raise ValueError(
        f"the processes of this job have different numbers of devices "
        f"{counts} (process: devices); every process must drive as many "
        "devices as the others (the same GPUs per host, or the same "
        "--cpu_devices).")
  data = json.dumps(obj, sort_keys=True).encode()
  lengths = multihost_utils.process_allgather(
      np.array([len(data)], np.int32))
  # Whole 4 KiB blocks: the same shape (one compiled gather) for most calls.
  size = -(-int(np.max(lengths)) // 4096) * 4096
  buf = np.zeros(size, np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  rows = multihost_utils.process_allgather(buf.view(np.int32))
  return [json.loads(np.asarray(row, np.int32).tobytes()[:int(n)])
          for row, n in zip(rows, np.asarray(lengths).reshape(-1))]


def check_same_config(config: config_dict.ConfigDict) -> None:
  """Refuses to start a job whose processes were given different configs.

  A collective: every process of a multi-process job calls it (the
  :class:`~decentral_jax.runner.experiment.Experiment` does, before validating the
  config) and every process raises the same error, so none is left waiting
  in a collective. Does nothing in a single-process run. The fields of
  :data:`PER_PROCESS_FIELDS` are not compared.

  Raises:
    ValueError: some field differs between processes (named, with process
      0's and the differing process's values).
  """
  if jax.process_count() == 1:
    return
  diff = config_differences(_allgather_json(config_fields(config)))
  if diff:
    raise ValueError(
        f"the {jax.process_count()} processes of this job have different "
        f"configs: {diff}; start every process with the same config file and"
        " --config overrides (only config.distributed and --workdir may "
        "differ).")


def check_same_start(params: PyTree | None,
                     error: BaseException | None = None) -> None:
  """Refuses to train when a process failed to start or params differ.

  A collective, called by every process of a multi-process job once its
  task and initial parameters are built (or building them failed with
  ``error``): the processes exchange their error, if any, or a fingerprint
  of their initial parameters (:func:`init_fingerprint`), and all of them
  raise if one failed or if the fingerprints differ (to within
  :data:`INIT_RTOL`). Does nothing in a single-process run except
  re-raising ``error``.

  Args:
    params: this process's host copy of the initial parameters (None if
      ``error``).
    error: the exception that building them raised on this process.

  Raises:
    BaseException: ``error`` itself, on the process where it happened.
    ValueError: on the other processes, naming the process that failed and
      its message; on every process, when the initial parameters differ
      (the leaves are named).
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  mine = ({"error": f"{type(error).__name__}: {error}".splitlines()[0]}
          if error is not None else
          {"params": init_fingerprint(params), "jax": jax.__version__})
  everyone = _allgather_json(mine)
  if error is not None:
    raise error
  failed = [p for p, m in enumerate(everyone) if "error" in m]
  if failed:
    raise ValueError(
        f"process {failed[0]} of this job could not start "
        f"({everyone[failed[0]]['error']})"
        + (f"; {len(failed)} processes failed" if len(failed) > 1 else "")
        + "; fix it on that host and restart every process.")
  diff = init_differences([m["params"] for m in everyone])
  if diff:
    versions = sorted({m["jax"] for m in everyone})
    raise ValueError(
        "the processes of this job computed different initial parameters "
        f"from the same config ({diff}); every host must run the same JAX and "
        "decentral_jax versions with the same PRNG settings "
        "(jax_default_prng_impl, jax_threefry_partitionable); JAX versions "
        f"in this job: {', '.join(versions)}.")

