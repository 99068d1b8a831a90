"""Display names of methods: the one table every command prints.

One naming scheme for tables, charts and legends (``predict``, ``fig6``,
``validate``, the main job ``compare`` and the runner's method registry):
the method, then in brackets the topology a gossip method mixes over, by
Wang et al. (2025)'s short names where they have one (``Exp`` for
``one_peer_exp``, ``AER`` for ``alternating_exp_ring``), e.g.
``"All-Reduce"``, ``"DAdam (Exp)"``, ``"SGP (Exp)"``, ``"AccumAdamW
(AER)"``, ``"DAdam (ring)"``, ``"DiLoCo"``. Keys are the runtime model's
bare spec names (``all_reduce``, ``sgp``, a topology name meaning
Decent-DP's overlapped DAdam gossip, ``dadam``, ``diloco`` ...) and the run
config's ``algorithm`` values; a spec with parameters (``diloco:H=10``) is
its own name (it spells out what it prices). NumPy-only: ``predict``
imports no JAX.
"""

from __future__ import annotations

from decentral_jax.topology import schedules as topology_lib

#: Method (not topology) names: runtime-model spec names and the
#: ``config.algorithm`` values (``decentralized`` is DAdam, or AccumAdamW
#: with ``optimizer.name = "accum_adamw"``).
METHOD_NAMES = {
    "all_reduce": "All-Reduce", "allreduce": "All-Reduce", "ar": "All-Reduce",
    "dadam": "DAdam", "decentralized": "DAdam", "accum_adam": "AccumAdamW",
    "accum_adamw": "AccumAdamW", "sgp": "SGP", "local_sgd": "Local SGD",
    "diloco": "DiLoCo", "decentralized_diloco": "Decentralized DiLoCo",
    "streaming_diloco": "Streaming DiLoCo", "local_dsgd": "Local DAdam",
    "local_dadam": "Local DAdam", "desloc": "DES-LOC",
    "desloc_adam": "DES-LOC",
}
#: Topologies by their short names in tables (Wang et al. 2025, Figure 6);
#: the others by their canonical name.
TOPOLOGY_NAMES = {"one_peer_exp": "Exp", "alternating_exp_ring": "AER"}
#: The topology a bare runtime-model name gossips over (``sgp``: push-sum on
#: the directed one-peer exponential graph).
DEFAULT_TOPOLOGIES = {"sgp": "one_peer_exp"}


def display_name(method: str, topology: str | None = None) -> str:
  """``"<method> (<topology>)"``: a method's name in tables and charts.

  Args:
    method: a key of :data:`METHOD_NAMES` (else printed as given).
    topology: the topology it gossips over (any alias; printed by its
      short or canonical name), or None for none.

  Returns:
    e.g. ``display_name("dadam", "alternating_exp_ring") == "DAdam (AER)"``.
  """
  name = METHOD_NAMES.get(method, method)
  if topology is None:
    return name
  try:
    topology = topology_lib.canonical_name(topology)
  except ValueError:
    pass
  return f"{name} ({TOPOLOGY_NAMES.get(topology, topology)})"


def label(key: str) -> str:
  """The display name of a runtime-model method key (a spec as given).

  A bare method name gives :func:`display_name` (``sgp`` with its
  topology); a bare topology name is overlapped DAdam gossip on it
  (``"one_peer_exp"`` -> ``"DAdam (Exp)"``); anything else (a spec
  with parameters) is printed as it is.
  """
  bare = str(key).strip().lower().replace("-", "_")
  if bare in METHOD_NAMES:
    return display_name(bare, DEFAULT_TOPOLOGIES.get(bare))
  try:
    return display_name("dadam", topology_lib.canonical_name(bare))
  except ValueError:
    return key
