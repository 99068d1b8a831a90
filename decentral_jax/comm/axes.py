"""Worker axis names: what may name the workers' axes, and the check that
the enclosing mesh has them.

The worker axis (``AxisName``) is a mesh axis name (``"workers"``), a
tuple of them (``("nodes", "local")``) or :class:`VirtualAxes` (``K``
workers per device, see :mod:`decentral_jax.comm.collectives`).
:mod:`~decentral_jax.comm.collectives` re-exports every name here.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from decentral_jax import checks

__all__ = ["AxisName", "VirtualAxes", "bound_axes", "check_axis_name",
           "is_virtual", "mesh_axes"]


@dataclasses.dataclass(frozen=True)
class VirtualAxes:
  """``per_device`` workers on every device of the mesh axis ``device``.

  Attributes:
    device: the ``shard_map`` mesh axis over devices (size ``M``).
    per_device: workers per device ``K >= 1`` (a Python or NumPy int,
      kept as ``int``); ``n = M K`` workers, worker ``i`` is slot ``i % K``
      of device ``i // K``.
    virtual: the ``jax.vmap`` axis name over a device's workers.
  """
  device: str
  per_device: int
  virtual: str = "virtual"

  def __post_init__(self):
    """Raises ValueError naming a field that cannot name the layout."""
    for name in ("device", "virtual"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"VirtualAxes.{name} must be a non-empty axis name, "
                         f"got {getattr(self, name)!r}.")
    if self.device == self.virtual:
      raise ValueError(f"VirtualAxes.device and .virtual are both "
                       f"{self.device!r}; name two axes.")
    if not checks.is_int(self.per_device) or self.per_device < 1:
      raise ValueError("VirtualAxes.per_device must be an int >= 1 (workers "
                       f"per device), got {self.per_device!r}.")
    object.__setattr__(self, "per_device", int(self.per_device))


AxisName = str | tuple[str, ...] | VirtualAxes


def is_virtual(axis_name: AxisName) -> bool:
  """True if ``axis_name`` is a :class:`VirtualAxes`."""
  return isinstance(axis_name, VirtualAxes)


def check_axis_name(axis_name, where: str = "") -> AxisName:
  """Returns ``axis_name`` if it can name the workers' axes.

  A mesh axis name (a non-empty ``str``), a non-empty tuple of them (e.g.
  ``("nodes", "local")``) or the :class:`VirtualAxes` of a virtual layout
  (``parallel.worker_axis(mesh)`` gives the right one for a mesh). Whether
  the mesh has those axes is checked when a collective is traced.

  Args:
    axis_name: the value to check.
    where: prefix of the message (e.g. ``"ExactMean: "``).

  Raises:
    ValueError: anything else (None, an int, an empty string or tuple, a
      tuple naming one axis twice).
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if isinstance(axis_name, VirtualAxes) or (
      names and all(isinstance(a, str) and a for a in names)
      and len(set(names)) == len(names)):
    return axis_name
  if names and all(isinstance(a, str) and a for a in names):
    raise ValueError(f"{where}axis_name={axis_name!r} names an axis twice; "
                     "name each mesh axis once.")
  raise ValueError(f"{where}axis_name must be a mesh axis name (a non-empty "
                   "string), a tuple of them or the VirtualAxes of a virtual "
                   f"layout, got {axis_name!r}; pass "
                   "parallel.worker_axis(mesh).")


def mesh_axes(axis_name: AxisName) -> tuple[str, ...]:
  """The ``shard_map`` mesh axes the workers lie on.

  Raises:
    ValueError: ``axis_name`` refused by :func:`check_axis_name`.
  """
  check_axis_name(axis_name)
  if is_virtual(axis_name):
    return (axis_name.device,)
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def bound_axes(axis_name: AxisName) -> tuple[str, ...]:
  """:func:`mesh_axes`, each checked to be an axis of the enclosing mesh.

  Raises:
    ValueError: an axis the trace does not have (a mesh without it, or
      outside ``jax.shard_map``), naming ``axis_name`` and the mesh's axes.
  """
  axes = mesh_axes(axis_name)
  for a in axes:
    try:
      lax.axis_size(a)
    except NameError:
      mesh = jax.sharding.get_abstract_mesh()
      have = tuple(mesh.axis_names)
      mapped = tuple(getattr(mesh, "manual_axes", have))
      where = (f"the mesh's axis {a!r} is not mapped by this shard_map "
               f"(it maps {mapped}: a worker's devices lie on the others)"
               if a in have else
               f"the mesh has no axis {a!r} (its axes: {have}; none: not "
               "inside jax.shard_map)")
      raise ValueError(
          f"axis_name={axis_name!r}: {where}; pass "
          "parallel.worker_axis(mesh) and run inside parallel.per_worker."
      ) from None
  return axes
