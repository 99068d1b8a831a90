"""A cluster file of ``predict --cluster FILE`` priced with the flags
given beside it (:func:`from_cluster_file`), and the inter-node link a
one-node file did not measure (:func:`unmeasured_inter_node`).
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.tools.runtime_model_cli import inputs


#: The flags that price the inter-node link a one-node cluster file lacks,
#: with their ``Cluster`` fields.
INTER_NODE_LINK_FLAGS = (("--nic-Gbps", "nic_bandwidth_Bps"),
                         ("--inter-latency-us", "inter_latency_s"))


def unmeasured_inter_node(data: dict) -> list[str]:
  """The flags of :data:`INTER_NODE_LINK_FLAGS` where a cluster file holds
  the inter-node link without measuring it, as ``measure`` writes one
  node: ``measurements.inter_pair_s`` null (not left out) and every field
  at the ``Cluster`` default, as ``cluster_file.fit_links`` leaves them (a
  link written by hand, a field differing or no measurements, is the
  file's own); else none."""
  meas = data["measurements"]
  if "inter_pair_s" not in meas or meas["inter_pair_s"] is not None or any(
      data["cluster"][field] != getattr(Cluster, field)
      for _, field in INTER_NODE_LINK_FLAGS):
    return []
  return [flag for flag, _ in INTER_NODE_LINK_FLAGS]


def _check_inter_node_measured(data: dict, args, n: int, per_node: int,
                               datacenters: int) -> None:
  """Refuses ``n`` workers over several nodes of a cluster file whose
  inter-node link is a default it never measured
  (:func:`unmeasured_inter_node`), unless the flags give it
  (``--inter-latency-us`` only where a datacenter holds several nodes:
  between datacenters the wide-area latency replaces it).

  Raises:
    ValueError: naming ``--cluster``, the count and the missing flags.
  """
  if n <= per_node:
    return
  given = inputs.explicit_flags(args)
  missing = [f for f in unmeasured_inter_node(data) if f not in given and (
      f == "--nic-Gbps" or n // datacenters > per_node)]
  if missing:
    raise ValueError(
        f"--cluster {args.cluster!r} measured no inter-node link "
        "(measurements.inter_pair_s is null: one node; its NIC rate and "
        f"latency are the defaults), but --n-workers {n} "
        f"at {per_node} per node spans {-(-n // per_node)} nodes; give "
        f"{' and '.join(missing)} for that link, or at most {per_node} "
        "workers.")


def from_cluster_file(data: dict, args, n: int):
  """Cluster and workload of ``predict --cluster FILE`` for ``n`` workers.

  The file's fields, with every cluster or workload flag given on the
  command line taking precedence (converted as
  :func:`inputs.cluster_from_args` and :func:`inputs.workload_from_args`
  do). Flags for the compute mean or CV drop
  the file's compute samples. A file measured on one node (its
  ``n_workers`` at most its ``local_size``) prices fewer workers as part
  of that node, as the one-node preset ``h100_node`` does.

  Raises:
    ValueError: ``n`` not a multiple of the workers per node
      (:func:`not_a_multiple`), or a
      workload the file lacks (see :func:`cluster_file.workload`).
  """
  given = inputs.explicit_flags(args)
  flags_c = inputs.cluster_fields(args)
  kw = dict(data["cluster"], n_workers=n)
  kw.update({f: flags_c[f] for flag, f in inputs.CLUSTER_FIELDS.items()
             if flag in given})
  if "--datacenters" in given:  # the wide-area link of the flags
    kw.setdefault("wan_bandwidth_Bps", flags_c["wan_bandwidth_Bps"])
    kw.setdefault("wan_latency_s", flags_c["wan_latency_s"])
  if n < kw["local_size"] and "--local-size" not in given and \
      data["cluster"].get("n_workers", n) <= kw["local_size"]:
    kw["local_size"] = n  # measured on one node: part of it, as a preset
  if n % kw["local_size"]:
    raise ValueError(inputs.not_a_multiple(
        n, kw["local_size"], 1,
        f"the cluster file's {kw['local_size']} workers per node"))
  _check_inter_node_measured(data, args, n, kw["local_size"],
                             kw.get("datacenters") or 1)
  c = Cluster(**kw)
  flags_w = dataclasses.asdict(inputs.workload_from_args(args))
  over = {f: flags_w[f] for flag, f in inputs.WORKLOAD_FIELDS.items()
          if flag in given}
  if given & {"--forward-ms", "--backward-ms", "--compute-cv"} and \
      "--compute-samples-ms" not in given:
    over["compute_samples_s"] = None
  if data.get("workload") is None:  # nothing measured: the flags' workload
    over = {**flags_w, **over}
  over.setdefault("bucket_bytes", flags_w["bucket_bytes"])
  return c, cluster_file.workload(data, **over)
