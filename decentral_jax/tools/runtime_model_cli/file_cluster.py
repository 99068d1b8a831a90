"""A cluster file of ``predict --cluster FILE`` priced with the flags
given beside it (:func:`from_cluster_file`), and the links it did not
measure (:func:`unmeasured`: the inter-node link of a one-node file, the
intra-node link of a file of one device per node) and which of them a
layout uses (:func:`missing_links`, the rule ``compare --clusters`` applies
too).
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.tools.runtime_model_cli import inputs


#: Per link class: the measurement of a cluster file that fits it and the
#: flags that price it where the file did not measure it, with their
#: ``Cluster`` fields.
LINKS = {
    "inter": ("inter_pair_s", (("--nic-Gbps", "nic_bandwidth_Bps"),
                               ("--inter-latency-us", "inter_latency_s"))),
    "intra": ("intra_pair_s", (("--intra-GBps", "intra_bandwidth_Bps"),
                               ("--intra-latency-us", "intra_latency_s")))}


def unmeasured(data: dict, link: str) -> list[str]:
  """The flags of ``LINKS[link]`` (``link``: ``"inter"`` or ``"intra"``)
  where a cluster file holds that link without measuring it, as
  ``measure`` writes one node (no inter-node link) or one device per node
  (no intra-node link): its ``measurements`` key null (not left out) and
  every field at the ``Cluster`` default, as ``cluster_file.fit_links``
  leaves them (a link written by hand, a field differing or no
  measurements, is the file's own); else none."""
  key, flags = LINKS[link]
  meas = data["measurements"]
  if key not in meas or meas[key] is not None or any(
      data["cluster"][field] != getattr(Cluster, field)
      for _, field in flags):
    return []
  return [flag for flag, _ in flags]


def missing_links(data: dict, c: Cluster, devices_per_worker: int,
                  given=frozenset()) -> tuple[str, list[str]] | None:
  """The first link class (``"inter"``, then ``"intra"``) that ``c``,
  priced from the cluster file ``data``, uses without the file measuring
  it (:func:`unmeasured`), with the flags of ``LINKS`` that would price it
  and are not in ``given``; None when every link used is measured or given.
  One rule per link class, the uses ``predict_needs.NEEDS`` reads: the
  node NIC where workers span nodes, ``--inter-latency-us`` where a
  datacenter holds several nodes (between datacenters the wide-area
  latency replaces it); ``--intra-latency-us`` where a node holds two
  workers or a worker several devices, ``--intra-GBps`` there and where a
  datacenter holds more than two workers (a ring over nodes runs at the
  slower of the intra-node link and the flow)."""
  n, per_node = c.n_workers, c.local_size
  hops = min(n, per_node) > 1 or devices_per_worker > 1
  uses = {"--nic-Gbps": n > per_node,
          "--inter-latency-us": c.dc_size > per_node,
          "--intra-latency-us": hops,
          "--intra-GBps": hops or c.dc_size > 2}
  for link in ("inter", "intra"):
    missing = [f for f in unmeasured(data, link) if f not in given
               and uses[f]]
    if missing:
      return link, missing
  return None


def _check_links_measured(data: dict, args, c: Cluster,
                          devices_per_worker: int) -> None:
  """Refuses to price ``c`` from a cluster file with a link it never
  measured that ``c`` uses, unless the flags give it
  (:func:`missing_links`).

  Raises:
    ValueError: naming ``--cluster``, the layout and the missing flags.
  """
  n, per_node = c.n_workers, c.local_size
  hops = min(n, per_node) > 1 or devices_per_worker > 1
  got = missing_links(data, c, devices_per_worker,
                      inputs.explicit_flags(args))
  if got is None:
    return
  link, missing = got
  if link == "inter":
    raise ValueError(
        f"--cluster {args.cluster!r} measured no inter-node link "
        "(measurements.inter_pair_s is null: one node; its NIC rate and "
        f"latency are the defaults), but --n-workers {n} "
        f"at {per_node} per node spans {-(-n // per_node)} nodes; give "
        f"{' and '.join(missing)} for that link, or at most {per_node} "
        "workers.")
  use, fix = ((f"{per_node} workers per node of {devices_per_worker} "
               "device(s) each hop inside a node", "--local-size 1 and "
               "--devices-per-worker 1") if hops else (
                   f"{c.dc_size} workers per datacenter ring through each "
                   "worker's intra-node link", "at most 2 workers"))
  raise ValueError(
      f"--cluster {args.cluster!r} measured no intra-node link "
      "(measurements.intra_pair_s is null: one device per node; its rate "
      f"and latency are the defaults), but with --n-workers {n}, {use}; give "
      f"{' and '.join(missing)} for that link, or {fix}.")


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
      (:func:`not_a_multiple`), a
      workload the file lacks (see :func:`cluster_file.workload`), or a
      link the file did not measure that the layout uses without the flags
      that price it (:func:`_check_links_measured`).
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
    why = inputs.not_a_multiple(
        n, kw["local_size"], 1,
        f"the cluster file's {kw['local_size']} workers per node")
    if data["cluster"].get("n_workers", n) <= kw["local_size"] and not (
        {"--nic-Gbps", "--inter-latency-us"} <= given):
      why = (f"{why[:-1]}, with --nic-Gbps and --inter-latency-us (the "
             "file measured one node, no inter-node link); or at most "
             f"{data['cluster'].get('n_workers', n)} workers, on its node.")
    raise ValueError(why)
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
  w = cluster_file.workload(data, **over)
  _check_links_measured(data, args, c, w.devices_per_worker)
  return c, w
