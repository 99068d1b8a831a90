"""The header ``predict`` and ``measure`` print for a cluster file.

:func:`describe_cluster_file` says where the file was measured, the links
priced (a flag given beside ``--cluster`` replaces the file's value, and
the line names it) and the file's All-Reduce check against the model
(:func:`all_reduce_check`). Units: GB/s (1e9 bytes/s) and Gbit/s. No JAX.
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.tools.runtime_model_cli import file_cluster
from decentral_jax.tools.runtime_model_cli import inputs

# The links the header prints: (field, label, scale to the unit, unit).
_SHOWN = (("intra_bandwidth_Bps", "intra", 1e-9, "GB/s"),
          ("nic_bandwidth_Bps", "node NIC", 8e-9, "Gbit/s"),
          ("flow_bandwidth_Bps", "one flow", 8e-9, "Gbit/s"))


def _links(c: dict, priced: dict, unmeasured=(), given=()) -> str:
  """The links of ``priced`` (Cluster fields), each one a flag replaced
  naming the flag and the file's value ``c[field]``; a link the file did
  not measure (its rate field in ``unmeasured``) is named a default or
  the flag's (a flag in ``given``, or a value other than the file's)."""
  flag_of = {f: flag for flag, f in inputs.CLUSTER_FIELDS.items()}
  out = []
  for field, label, scale, unit in _SHOWN:
    value, was = priced[field], c[field]
    if value is None:
      continue
    text = f"{label} {value * scale:.3g} {unit}"
    if field in unmeasured:
      node = "inter" if field == "nic_bandwidth_Bps" else "intra"
      text += (f" (by {flag_of[field]}; the file measured no {node}-node "
               "link)" if value != was or flag_of[field] in given
               else f" (a default: the file measured no {node}-node link)")
    elif value != was:
      text += (f" (by {flag_of[field]}; the file's "
               + (f"{was * scale:.3g})" if was else "none)"))
    out.append(text)
  return ", ".join(out)


def _unmeasured_rates(data: dict) -> set[str]:
  """The rate fields of the links ``data`` did not measure
  (:func:`file_cluster.unmeasured`)."""
  return {file_cluster.LINKS[link][1][0][1] for link in file_cluster.LINKS
          if file_cluster.unmeasured(data, link)}


def describe_cluster_file(path: str, data: dict,
                          priced: Cluster | None = None, given=()) -> str:
  """Two lines or more: where the file was measured and the links priced,
  and the file's All-Reduce check.

  Args:
    path: the file's path, as given.
    data: its contents (:func:`~decentral_jax.runtime_model.cluster_file.
      read`).
    priced: the cluster priced (the file's with the flags given beside it,
      :func:`file_cluster.from_cluster_file`); None: the file's own. Each link
      it prints that differs from the file's names its flag and the file's
      value, and any other field a flag replaced is listed by its flag.
    given: the flags given (a node NIC or intra-node link the file did not
      measure is named the flag's where ``--nic-Gbps`` / ``--intra-GBps``
      is among them, else a default).
  """
  meta, c, meas = data.get("meta", {}), data["cluster"], data["measurements"]
  fields = {**c, **(dataclasses.asdict(priced) if priced else {}),
            "n_workers": c["n_workers"]}
  shown = {f for f, _, _, _ in _SHOWN} | {"local_size"}
  by = ("--local-size" if "--local-size" in given else
        f"--n-workers {fields['local_size']}, part of the node")
  per_node = str(fields["local_size"]) + (
      f" (by {by}; the file's {c['local_size']})"
      if fields["local_size"] != c["local_size"] else "")
  other = [flag for flag, f in inputs.CLUSTER_FIELDS.items()
           if f not in shown and f in c and fields[f] != c[f]]
  kind, procs = meta.get("device_kind"), meta.get("process_count")
  lines = [
      f"cluster from {path}: {c['n_workers']} "  # meta.devices, if given
      + (f"{kind} " if kind else "") + f"devices, {per_node} "
      "per node" + (f", {procs} process(es)" if procs is not None else "")
      + "; " + _links(c, fields, _unmeasured_rates(data), given)
      + (f"; also replaced by flags: {', '.join(other)}" if other else "")]
  if meas.get("all_reduce_s"):
    cl = Cluster(**c)
    model = all_reduce_cost(cl).time(meas["all_reduce_bytes"])[0]
    lines.append(f"  measured All-Reduce of {meas['all_reduce_bytes'] / 1e6:.3g}"
                 f" MB on {c['n_workers']} workers: "
                 f"{1e3 * meas['all_reduce_s']:.3g} ms (model: "
                 f"{1e3 * model:.3g} ms)")
    lines.append(all_reduce_check(meas["all_reduce_s"], model,
                                  meta.get("backend")))
  return "\n".join(lines)


# Ratio of the model's All-Reduce to the measured one beyond which (either
# way) describe_cluster_file says the fitted links do not describe it.
CHECK_RATIO = 2.0


def all_reduce_check(measured_s: float, model_s: float,
                     backend: str | None) -> str:
  """One line: what the model's All-Reduce beside the measured one is, and
  what their gap means.

  The model's number is the alpha-beta All-Reduce (``costs.all_reduce_cost``)
  of the same bytes on the links fitted from the file's pair exchanges
  (``cluster_file.fit_links``), not a preset's. Within a factor
  :data:`CHECK_RATIO` either way the fitted links describe the collective;
  beyond it predictions from the file are off by about as much, which on
  ``backend == "cpu"`` (simulated devices in one process, whose exchanges
  are memory copies) is expected.
  """
  ratio = model_s / max(measured_s, 1e-300)
  head = (f"  model: the model's All-Reduce of that size on the links "
          f"fitted from this file's pair exchanges, {ratio:.2g}x the "
          "measured; ")
  if 1 / CHECK_RATIO <= ratio <= CHECK_RATIO:
    return head + (f"within {CHECK_RATIO:g}x, so the fitted links describe "
                   "this collective")
  return head + (f"beyond {CHECK_RATIO:g}x the pair exchanges do not predict "
                 "this collective, so predictions from this file may be off "
                 "by as much" + (
                     " (expected here: simulated CPU devices exchange by "
                     "memory copies in one process, not over network links)"
                     if backend == "cpu" else ""))
