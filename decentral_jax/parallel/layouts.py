"""Workers that span several devices: placement of their state and data.

A mesh from ``parallel.make_mesh(n, ..., devices_per_worker=D)`` with ``D >
1`` has the worker axes (``"workers"`` or ``("nodes", "local")``, manual
inside :func:`decentral_jax.parallel.per_worker`) and a last axis
``"inner"`` of size ``D`` (``Auto``): worker ``i`` owns devices ``i*D ..
i*D+D-1`` of the mesh. The per-worker step is the same one-worker code as
with one device per worker; gossip and All-Reduce collectives run over the
worker axes, and the compiler splits the rest over ``"inner"`` following
the shardings of the step's inputs and outputs, which this module chooses:

* ``"fsdp"``: every floating leaf of the parameters, gradients and
  optimizer state ``[n, *shape]`` is split over ``"inner"`` along one
  dimension of ``shape`` divisible by ``D`` (:func:`inner_dim`: the first
  such dimension by default), so each device holds ``1/D`` of its worker's
  state; leaves with no such dimension (and integer leaves, e.g. step
  counters) are replicated on the worker's devices and listed by
  :func:`unsplit_leaves` (:func:`check_params` warns naming them, or
  refuses). The batch ``[n, B, ...]`` is split over ``"inner"`` along
  ``B``; the compiler gathers parameters for the forward/backward pass as
  it needs (ZeRO-3 style). A gossip round then sends each device's shard
  only: one device of a one-peer round sends ``param_bytes / D``.
* ``"data"``: parameters and optimizer state are replicated on the
  worker's devices, the batch is split over them along ``B``, and the
  gradient is averaged over them by the compiler (an all-reduce over
  ``"inner"``). Every device of a worker then sends the full parameters in
  a gossip round (``D`` copies per worker).

Byte accounting: :func:`decentral_jax.analysis.communication` counts bytes
per *device*; :func:`decentral_jax.analysis.traffic` adds them up per worker
and separates what leaves a worker (gossip, All-Reduce) from what stays
inside it.

Gossip buckets (``gossip.mix(..., bucket_bytes > 0)``) concatenate leaves
into 1-D buffers; with ``"fsdp"`` the compiler reshards each bucket inside
the worker (extra all-gathers and permutes over ``"inner"``; the bytes sent
to other workers stay ``param_bytes / D``). ``bucket_bytes=0`` avoids this.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decentral_jax import checks
from decentral_jax.layout_modes import FSDP
from decentral_jax.layout_modes import MODES
from decentral_jax.parallel import mesh as mesh_lib

PyTree = Any

#: Which divisible dimension :func:`inner_dim` picks.
SPLIT_RULES = ("first", "largest")


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
  """How one worker's state and batch lie on its ``devices_per_worker`` devices.

  Attributes:
    devices_per_worker: ``D >= 1``; 1 is one worker per device (the mode
      is then irrelevant and nothing changes).
    mode: ``"fsdp"`` or ``"data"`` (module docstring).
    split: ``"first"`` (default) or ``"largest"``: which dimension
      divisible by ``D`` a leaf is split along in ``"fsdp"``. ``"first"``
      keeps each shard a contiguous slice of the flattened leaf, which is
      what gossip buckets flatten to.

  Raises:
    ValueError: (at construction) ``devices_per_worker`` not an integer >=
      1, unknown ``mode`` or ``split``.
  """
  devices_per_worker: int = 1
  mode: str = FSDP
  split: str = "first"

  def __post_init__(self):
    checks.check_int("devices_per_worker", self.devices_per_worker,
                     minimum=1)
    checks.check_choice("worker layout mode", self.mode, MODES)
    checks.check_choice("split", self.split, SPLIT_RULES)

  @property
  def sharded_state(self) -> bool:
    """True if parameters and optimizer state are split over devices."""
    return self.devices_per_worker > 1 and self.mode == FSDP


def inner_dim(shape: Sequence[int], dtype, devices_per_worker: int,
              split: str = "first") -> int | None:
  """The dimension of a one-worker leaf that ``"fsdp"`` splits, or None.

  Args:
    shape: the leaf's shape *without* the worker axis.
    dtype: its dtype; only floating leaves are split.
    devices_per_worker: ``D``; with ``D = 1`` nothing is split.
    split: ``"first"`` or ``"largest"`` dimension among those divisible by
      ``D`` (ties go to the first).

  Returns:
    An index into ``shape``, or None (replicated on the worker's devices).

  Raises:
    ValueError: ``devices_per_worker`` not an integer >= 1, ``split`` not
      one of :data:`SPLIT_RULES`.
  """
  d = checks.check_int("devices_per_worker", devices_per_worker, minimum=1)
  checks.check_choice("split", split, SPLIT_RULES)
  if d <= 1 or not jnp.issubdtype(dtype, jnp.floating):
    return None
  dims = [k for k, s in enumerate(shape) if s >= d and s % d == 0]
  if not dims:
    return None
  if split == "largest":
    return max(dims, key=lambda k: (shape[k], -k))
  return dims[0]


def _leaf_spec(x, mesh: Mesh, layout: WorkerLayout, stacked: bool) -> P:
  shape = tuple(jnp.shape(x))
  worker = mesh_lib.worker_axis(mesh)
  if stacked:
    rest = [None] * (len(shape) - 1)
    k = inner_dim(shape[1:], jnp.result_type(x), layout.devices_per_worker,
                  layout.split) if layout.sharded_state else None
    if k is not None:
      rest[k] = mesh_lib.INNER
    return P(worker, *rest)
  k = inner_dim(shape, jnp.result_type(x), layout.devices_per_worker,
                layout.split) if layout.sharded_state else None
  if k is None:
    return P()
  return P(*([None] * k), mesh_lib.INNER)


def _check_mesh(mesh: Mesh, layout: WorkerLayout) -> None:
  mesh_lib.check_mesh(mesh)
  if not isinstance(layout, WorkerLayout):
    raise ValueError(f"layout must be a layouts.WorkerLayout, got "
                     f"{type(layout).__name__}.")
  if mesh_lib.devices_per_worker(mesh) != layout.devices_per_worker:
    raise ValueError(
        f"the mesh has {mesh_lib.devices_per_worker(mesh)} device(s) per "
        f"worker but the layout has devices_per_worker="
        f"{layout.devices_per_worker}; build the mesh with parallel."
        "make_mesh(..., devices_per_worker=layout.devices_per_worker).")


def state_specs(tree: PyTree, mesh: Mesh, layout: WorkerLayout, *,
                stacked: bool = True) -> PyTree:
  """``PartitionSpec`` per leaf of per-worker state (parameters, moments).

  Args:
    tree: arrays or ``jax.ShapeDtypeStruct``; with ``stacked`` (default)
      leaves are ``[n, *shape]``, else one worker's ``shape``.
    mesh: from ``parallel.make_mesh(..., devices_per_worker=D)``.
    layout: the :class:`WorkerLayout` (``D`` must match the mesh).

  Returns:
    A pytree of specs: stacked leaves ``P(worker_axis, ..., "inner" at
    1 + inner_dim, ...)`` (``P(worker_axis, None, ...)`` when replicated on
    the worker's devices, as :func:`decentral_jax.parallel.shard` places
    them); unstacked leaves the same without the worker entry.

  Raises:
    ValueError: ``mesh`` not from ``parallel.make_mesh``, ``layout`` not a
      :class:`WorkerLayout`, or ``layout.devices_per_worker`` differs from
      the mesh's.
  """
  _check_mesh(mesh, layout)
  return jax.tree.map(lambda x: _leaf_spec(x, mesh, layout, stacked), tree)


def state_shardings(tree: PyTree, mesh: Mesh, layout: WorkerLayout
                    ) -> PyTree:
  """``NamedSharding`` per leaf of stacked ``[n, ...]`` state (see :func:`state_specs`).

  Use it as the ``out_shardings`` of jitted steps that return the state, so
  that the layout stays fixed from step to step.
  """
  return jax.tree.map(lambda s: NamedSharding(mesh, s),
                      state_specs(tree, mesh, layout))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a batch ``[n, B, ...]``: workers on axis 0, ``B`` over ``"inner"``.

  Equal to ``parallel.worker_sharding(mesh)`` on a one-device-per-worker
  mesh. ``B`` must be divisible by the devices per worker.
  """
  if mesh_lib.INNER not in mesh_lib.device_mesh(mesh).axis_names:
    return mesh_lib.worker_sharding(mesh)
  return NamedSharding(mesh, P(mesh_lib.worker_axis(mesh), mesh_lib.INNER))


def place(tree: PyTree, mesh: Mesh, layout: WorkerLayout) -> PyTree:
  """Puts stacked ``[n, ...]`` state on ``mesh`` with the layout's shardings."""
  return jax.tree.map(jax.device_put, tree,
                      state_shardings(tree, mesh, layout))


def place_batch(tree: PyTree, mesh: Mesh) -> PyTree:
  """Puts a stacked batch ``[n, B, ...]`` with :func:`batch_sharding`.

  Raises:
    ValueError: a leaf whose ``B`` is not divisible by the devices per
      worker (the message names the leaf).
  """
  check_batch(tree, mesh_lib.devices_per_worker(mesh))
  return jax.device_put(tree, batch_sharding(mesh))


def check_batch(tree: PyTree, devices_per_worker: int) -> None:
  """Raises ``ValueError`` unless every ``[n, B, ...]`` leaf has ``B % D == 0``.

  Also when ``devices_per_worker`` is not an integer >= 1.
  """
  d = checks.check_int("devices_per_worker", devices_per_worker, minimum=1)
  if d <= 1:
    return
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    shape = tuple(jnp.shape(x))
    if len(shape) < 2 or shape[1] % d:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path)!r} has shape {shape}; a "
          f"worker of {d} devices splits its local batch (axis 1) over them, "
          f"so it must be divisible by {d}.")


def unsplit_leaves(params: PyTree, layout: WorkerLayout) -> list[str]:
  """Key paths of one worker's floating leaves that ``"fsdp"`` replicates.

  Args:
    params: one worker's parameters (no worker axis), arrays or
      ``jax.ShapeDtypeStruct``.
    layout: the layout.

  Returns:
    ``jax.tree_util.keystr`` of every floating leaf with no dimension
    divisible by ``layout.devices_per_worker`` (empty unless
    ``layout.sharded_state``).
  """
  if not layout.sharded_state:
    return []
  return [jax.tree_util.keystr(path)
          for path, x in jax.tree_util.tree_leaves_with_path(params)
          if jnp.issubdtype(jnp.result_type(x), jnp.floating)
          and inner_dim(jnp.shape(x), jnp.result_type(x),
                        layout.devices_per_worker) is None]


def check_params(params: PyTree, layout: WorkerLayout, *,
                 unsplit: str = "warn", what: str = "") -> list[str]:
  """Reports parameter leaves that cannot be split over a worker's devices.

  Args:
    params: one worker's parameters (no worker axis).
    layout: the layout; nothing is reported unless ``layout.sharded_state``.
    unsplit: ``"warn"`` (``UserWarning`` naming the leaves, which stay
      replicated on the worker's devices), ``"error"`` (``ValueError``) or
      ``"ignore"``.
    what: prefix of the message (e.g. the config fields involved).

  Returns:
    :func:`unsplit_leaves`.

  Raises:
    ValueError: ``unsplit="error"`` and some leaf cannot be split, or an
      unknown ``unsplit``.
  """
  checks.check_choice("unsplit", unsplit, ("warn", "error", "ignore"))
  names = unsplit_leaves(params, layout)
  if names and unsplit != "ignore":
    d = layout.devices_per_worker
    shapes = {jax.tree_util.keystr(p): tuple(jnp.shape(x))
              for p, x in jax.tree_util.tree_leaves_with_path(params)}
    listed = ", ".join(f"{k} {shapes[k]}" for k in names)
    msg = (f"{what}{len(names)} parameter leaf(s) have no dimension "
           f"divisible by devices_per_worker={d} and are replicated on each "
           f"worker's {d} devices instead of split: {listed}.")
    if unsplit == "error":
      raise ValueError(msg)
    warnings.warn(msg, UserWarning, stacklevel=2)
  return names


__all__: Sequence[str] = (
    "WorkerLayout", "batch_sharding", "check_batch", "check_params",
    "inner_dim", "place", "place_batch", "state_shardings", "state_specs",
    "unsplit_leaves")
