"""Named clusters and workloads: the regimes ``predict --preset`` and ``--workload`` know.

Clusters (:data:`CLUSTERS`; sources and confidence in
docs/runtime_model.md, "Presets"):

* ``T4``, ``A40``: Figure 6 of Wang et al. (2025), published links and the
  in-sample fit of :mod:`~decentral_jax.runtime_model.paper` (compute
  ``a + b/n`` of the paper's Transformer base, compute CV, and for A40 the
  aggregate NIC rate);
* ``A100``: Figure 6's A100 cluster (4 x A100 SXM4 per node, NVLink 3,
  100 Gbit/s InfiniBand), links of
  :data:`~decentral_jax.runtime_model.holdout.HARDWARE` with the in-sample
  fit of :data:`~decentral_jax.runtime_model.holdout.INSAMPLE` (compute,
  CV, NIC ports);
* ``h100_node``: one node of 8 H100 SXM5 GPUs on NVLink 4 / NVSwitch
  (at most 8 workers);
* ``h100_ib``: nodes of 8 H100 SXM5, one 400 Gbit/s InfiniBand NDR port
  per GPU (rail-optimised, as DGX H100);
* ``cross_region_2dc``, ``cross_region_4dc``: 2 or 4 datacenters, each an
  ``h100_ib`` cluster, joined by a wide-area uplink per datacenter of
  10 Gbit/s with 30 ms one-way latency (``--wan-Gbps``,
  ``--wan-latency-ms`` move it within the 1-100 Gbit/s, 10-100 ms the
  presets stand for).

The Figure 6 presets carry the paper's workload; the others take the
workload from ``--workload`` or the workload flags. Workloads
(:data:`WORKLOADS`): ``gpt2_small`` (124M parameters) and ``1b`` (1e9
parameters at 0.1 s per step, the setting of Kale et al. 2025, Table 5);
:data:`WORKLOAD_NAMES` adds ``figure6`` (:data:`FIGURE6`), the paper's
Transformer base with the compute fitted to a Figure 6 cluster's bars, so
only on ``T4``, ``A40``, ``A100``. ``predict --workload`` and
``experiments/compare.py --workload`` take these names.

Units: seconds, bytes, bytes per second.
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import holdout
from decentral_jax.runtime_model import paper

# H100 SXM5: NVLink 4, 900 GB/s per GPU in both directions together, 450
# GB/s per direction (NVIDIA H100 datasheet). DGX H100: 8 GPUs, 8 ConnectX-7
# ports of 400 Gbit/s InfiniBand NDR, one per GPU (DGX H100 user guide).
_H100_NODE = dict(local_size=8, intra_latency_s=5e-6, intra_bandwidth_Bps=450e9,
                  intra_link="nvlink", inter_latency_s=10e-6,
                  nic_bandwidth_Bps=400e9 / 8, nics_per_node=8,
                  multi_node="tree")
# Wide-area link of the cross-region presets: 10 Gbit/s per datacenter and
# direction (a middle port speed of dedicated interconnects, which come at
# 1, 10 and 100 Gbit/s), 30 ms one way (about 6000 km of fibre at 5 us/km,
# e.g. across a continent). Assumed, not measured.
WAN_BANDWIDTH_Bps = 10e9 / 8
WAN_LATENCY_S = 0.030


@dataclasses.dataclass(frozen=True)
class ClusterPreset:
  """A named cluster.

  Attributes:
    name: the ``--preset`` name.
    words: one line for tables ("8 x H100 per node, ...").
    fields: :class:`~decentral_jax.runtime_model.costs.Cluster` keyword
      arguments except ``n_workers`` (Figure 6 presets: None, their
      cluster comes with the fitted workload).
    max_workers: largest worker count (one node: its GPUs), or None.
  """

  name: str
  words: str
  fields: dict | None = None
  max_workers: int | None = None


CLUSTERS = {
    "T4": ClusterPreset("T4", "8 x T4 per node (PCIe 3.0), 100 Gbit/s "
                        "InfiniBand; Figure 6 in-sample fit"),
    "A40": ClusterPreset("A40", "4 x A40 per node (PCIe 4.0), 25 Gbit/s "
                         "Ethernet; Figure 6 in-sample fit"),
    "A100": ClusterPreset("A100", "4 x A100 per node (NVLink 3), 100 Gbit/s "
                          "InfiniBand; Figure 6 in-sample fit"),
    "h100_node": ClusterPreset(
        "h100_node", "one node of 8 x H100 SXM5 on NVLink 4 (450 GB/s per "
        "direction per GPU)", dict(_H100_NODE), max_workers=8),
    "h100_ib": ClusterPreset(
        "h100_ib", "8 x H100 SXM5 per node (NVLink 4), one 400 Gbit/s "
        "InfiniBand port per GPU", dict(_H100_NODE)),
    "cross_region_2dc": ClusterPreset(
        "cross_region_2dc", "2 datacenters of h100_ib nodes, 10 Gbit/s and "
        "30 ms between them", dict(_H100_NODE, datacenters=2,
                                   wan_latency_s=WAN_LATENCY_S,
                                   wan_bandwidth_Bps=WAN_BANDWIDTH_Bps)),
    "cross_region_4dc": ClusterPreset(
        "cross_region_4dc", "4 datacenters of h100_ib nodes, 10 Gbit/s and "
        "30 ms between them", dict(_H100_NODE, datacenters=4,
                                   wan_latency_s=WAN_LATENCY_S,
                                   wan_bandwidth_Bps=WAN_BANDWIDTH_Bps)),
}


# GPT-2 small: 124,439,808 parameters (tied embeddings; Radford et al.
# 2019). Compute: 6 N FLOPs per token (Kaplan et al. 2020) for 16 x 1024
# tokens per worker and step at 40% of an H100 SXM5's 989 TFLOP/s (bf16,
# dense): 6 * 124.44e6 * 16384 / (0.4 * 989.4e12) = 30.9 ms, forward :
# backward = 1 : 2. 1B: 1e9 parameters at 0.1 s per step (Kale et al. 2025,
# Table 5). Compute CV 0.05 for both (assumed). float32 on the wire.
_GPT2_SMALL = 124_439_808
_GPT2_SMALL_STEP_S = 6 * _GPT2_SMALL * 16 * 1024 / (0.4 * 989.4e12)
WORKLOADS = {
    "gpt2_small": dict(param_count=_GPT2_SMALL,
                       forward_s=_GPT2_SMALL_STEP_S / 3,
                       backward_s=2 * _GPT2_SMALL_STEP_S / 3,
                       compute_cv=0.05),
    "1b": dict(param_count=1e9, forward_s=0.1 / 3, backward_s=0.2 / 3,
               compute_cv=0.05),
}


# The Figure 6 workload: the paper's Transformer base (65M parameters) with
# compute a + b/n fitted to one cluster's bars, so it exists only on the
# presets fitted to Figure 6 (those without hardware fields).
FIGURE6 = "figure6"
WORKLOAD_NAMES = (*WORKLOADS, FIGURE6)
FIGURE6_PRESETS = tuple(k for k, v in CLUSTERS.items() if v.fields is None)
# Each workload name in words (predict's header, the docs).
WORKLOAD_WORDS = {
    "gpt2_small": "GPT-2 small, 124M parameters, 30.9 ms of compute per step "
                  "(16 x 1024 tokens per GPU at 40% of an H100 SXM5's bf16 "
                  "peak)",
    "1b": "1e9 parameters, 100 ms of compute per step (Kale et al. 2025, "
          "Table 5)",
    FIGURE6: "the paper's 65M-parameter Transformer base with compute "
             "a + b/n fitted to a Figure 6 cluster's bars",
}
# Workers ``predict --preset`` prices when --n-workers is not given, where
# the preset holds that many (see default_workers).
DEFAULT_WORKERS = 16


def default_workers(name: str, preferred: int = DEFAULT_WORKERS) -> int:
  """The worker count ``predict --preset name`` uses without ``--n-workers``.

  ``preferred`` if the preset holds it; else the smallest count above it
  that the preset holds (a multiple of its GPUs per node times its
  datacenters: 32 on ``cross_region_4dc``); on a one-node preset
  (``h100_node``, any count up to its GPUs) at most all of its GPUs.

  Raises:
    ValueError: unknown name.
  """
  if name not in CLUSTERS:
    raise ValueError(f"unknown cluster preset {name!r}; use one of "
                     f"{', '.join(CLUSTERS)}.")
  preset = CLUSTERS[name]
  if preset.max_workers is not None:  # one node: any count up to its GPUs
    return min(preferred, preset.max_workers)
  if preset.fields is None:  # Figure 6's clusters: GPUs per node
    step = holdout.HARDWARE[name]["local_size"]
  else:
    step = preset.fields["local_size"] * preset.fields.get("datacenters", 1)
  return -(-preferred // step) * step


def workload(name: str) -> Workload:
  """The :class:`~decentral_jax.runtime_model.workload.Workload` of ``name``.

  Raises:
    ValueError: unknown name, or ``figure6`` (fitted per cluster: use
      :func:`setup` with a Figure 6 preset).
  """
  if name == FIGURE6:
    raise ValueError(f"workload {FIGURE6!r} is fitted to each Figure 6 "
                     "cluster; use it with the preset "
                     f"{', '.join(FIGURE6_PRESETS)}, or a workload of its "
                     f"own: {', '.join(WORKLOADS)}.")
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload preset {name!r}; use one of "
                     f"{', '.join(WORKLOADS)}.")
  return Workload(**WORKLOADS[name])


def cluster(name: str, n: int) -> Cluster:
  """The cluster of preset ``name`` at ``n`` workers (one per GPU).

  Raises:
    ValueError: unknown name, ``n`` above the preset's GPUs or not a
      multiple of its GPUs per node (and datacenters).
  """
  if name in CLUSTERS and CLUSTERS[name].fields is not None:
    return _hardware(CLUSTERS[name], n)
  return setup(name, n)[0]


def setup(name: str, n: int, workload_name: str | None = None,
          default: Workload | None = None
          ) -> tuple[Cluster, Workload]:
  """Cluster and workload of preset ``name`` at ``n`` workers.

  Args:
    name: a key of :data:`CLUSTERS`.
    n: workers (GPUs).
    workload_name: a name of :data:`WORKLOAD_NAMES`; None: the Figure 6
      workload (``figure6``) for ``T4``, ``A40``, ``A100``, else
      ``default``.
    default: the workload of presets without one (``predict``'s flags).

  Raises:
    ValueError: unknown name, a bad ``n`` (naming the preset's constraint),
      ``figure6`` on a preset not fitted to Figure 6, or no workload.
  """
  if name not in CLUSTERS:
    raise ValueError(f"unknown cluster preset {name!r}; use one of "
                     f"{', '.join(CLUSTERS)}.")
  preset = CLUSTERS[name]
  if name in paper.PUBLISHED:
    c, w = paper.setup(name, n)
  elif name == "A100":
    fit = holdout.INSAMPLE["A100"]
    c = holdout.cluster("A100", n, fit["nics_per_node"])
    w = holdout.workload(n, fit["a_s"], fit["b_s"], fit["compute_cv"])
  else:
    c, w = _hardware(preset, n), default
  if workload_name == FIGURE6 and name not in FIGURE6_PRESETS:
    raise ValueError(f"workload {FIGURE6!r} is fitted to Figure 6's "
                     f"clusters only ({', '.join(FIGURE6_PRESETS)}), not "
                     f"{name!r}; use {' or '.join(WORKLOADS)}.")
  if workload_name not in (None, FIGURE6):
    w = workload(workload_name)
  if w is None:
    raise ValueError(f"preset {name!r} has no workload; give --workload "
                     f"({', '.join(WORKLOADS)}) or the workload flags.")
  return c, w


def _hardware(preset: ClusterPreset, n: int) -> Cluster:
  fields = dict(preset.fields)
  if preset.max_workers is not None:
    if not 1 <= n <= preset.max_workers:
      raise ValueError(f"preset {preset.name!r} has {preset.max_workers} "
                       f"GPUs; use at most {preset.max_workers} workers.")
    fields["local_size"] = n if n < fields["local_size"] else \
        fields["local_size"]
  per = fields["local_size"] * fields.get("datacenters", 1)
  if n % per:
    raise ValueError(f"preset {preset.name!r} needs a multiple of {per} "
                     f"workers ({fields['local_size']} per node"
                     + (f" x {fields['datacenters']} datacenters"
                        if fields.get("datacenters", 1) > 1 else "") + ").")
  return Cluster(n_workers=n, **fields)


def device_slice(name: str, n: int, devices_per_worker: int) -> Cluster:
  """The cluster of preset ``name`` that prices the collectives of ``n``
  workers of ``D = devices_per_worker`` GPUs each.

  ``D = 1``: :func:`cluster`. ``D > 1`` (fsdp or data layouts): each device
  sends its ``1/D`` shard to the same device of the peer worker over its
  own links, so the cluster is one device of each worker: ``local_size / D``
  workers per node (all ``n`` when they fit one node) with
  ``nics_per_node / D`` NICs, each worker on the device's own intra-node
  port.

  Raises:
    ValueError: ``D < 1``; a Figure 6 preset (``T4``, ``A40``, ``A100``:
      no hardware description to slice) with ``D > 1``; ``n * D`` GPUs the
      preset does not hold (as :func:`cluster`).
  """
  d = int(devices_per_worker)
  if d < 1:
    raise ValueError(f"devices_per_worker must be >= 1, got {d}.")
  if d == 1:
    return cluster(name, n)
  preset = CLUSTERS.get(name)
  if preset is None or preset.fields is None:
    raise ValueError(f"preset {name!r} has no per-device description for "
                     f"workers of {d} devices; use one of "
                     f"{sorted(k for k, v in CLUSTERS.items() if v.fields)} "
                     "or pass a Cluster.")
  full = _hardware(preset, n * d)  # checks the GPU count
  per_node = min(n, max(1, full.local_size // d))
  fields = dict(preset.fields, local_size=per_node,
                nics_per_node=max(1, full.nics_per_node // d))
  return Cluster(n_workers=n, **fields)


def cluster_preset_name(name: str) -> str | None:
  """The key of :data:`CLUSTERS` that ``name`` spells, ignoring case and
  surrounding blanks (``"a40"`` is ``"A40"``), or None: the spelling
  ``experiments/compare.py --clusters`` and ``benchmarks/gpu_check.py
  --cluster`` accept."""
  return {k.lower(): k for k in CLUSTERS}.get(str(name).strip().lower())
