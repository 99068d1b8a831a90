"""Worker meshes, stacked per-worker state, and per-worker ``shard_map``.

Conventions: per-worker state is a pytree whose leaves have a leading worker
axis of size ``n_workers`` (``[n, ...]``), sharded over the mesh's worker
axis (or axes). :func:`per_worker` turns a function written for *one*
worker (no leading axis; collectives over ``axis_name``) into a function of
stacked state.

A worker is one device by default. With ``make_mesh(...,
devices_per_worker=D)``, ``D > 1``, each worker spans ``D`` devices: the
mesh gets a last axis ``"inner"`` of size ``D`` (type ``Auto``),
:func:`per_worker` is manual over the worker axes only, and how a worker's
arrays are split over its devices is left to the compiler (placement and
the ``fsdp`` / ``data`` modes: :mod:`decentral_jax.parallel.layouts`).

Many workers on one device: ``make_mesh(n, workers_per_device=K)``, ``K >
1``, returns a :class:`VirtualMesh`, ``n / K`` devices on the ``"workers"``
axis with ``K`` workers each. Stacked state keeps its ``[n, ...]`` layout
(device ``d`` holds rows ``d*K .. d*K+K-1``); :func:`per_worker` runs the
one-worker function under ``jax.vmap`` over a device's ``K`` workers, with
the worker axis a :class:`~decentral_jax.comm.collectives.VirtualAxes`, so the
same gossip, optimizer and step code communicates in two levels (inside a
device a gather, across devices one ``ppermute`` per device offset; see
:mod:`decentral_jax.comm.collectives`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.topology import schedules as topology_lib

PyTree = Any

__all__ = ['VirtualMesh', 'AnyMesh', 'WORKERS', 'NODES', 'LOCAL', 'INNER', 'VIRTUAL', 'device_mesh', 'mesh_shape', 'workers_per_device', 'device_hint', 'make_mesh', 'check_mesh', 'is_node_aware', 'worker_axis', 'worker_spec', 'worker_sharding', 'n_workers_of', 'devices_per_worker', 'shard', 'replicate', 'unstack', 'per_worker']

WORKERS = "workers"
NODES = "nodes"
LOCAL = "local"
#: Mesh axis over the devices of one worker (present only if they are > 1).
INNER = "inner"
#: ``vmap`` axis over the workers of one device (:class:`VirtualMesh`).
VIRTUAL = "virtual"


@dataclasses.dataclass(frozen=True)
class VirtualMesh:
  """``workers_per_device`` workers on every device of a 1-D device mesh.

  Attributes:
    mesh: ``jax.sharding.Mesh`` with one axis ``"workers"`` over ``M``
      devices (``Explicit``).
    workers_per_device: ``K > 1``; ``n = M K`` workers, worker ``i`` on
      device ``i // K``.

  Pass it wherever this module takes a mesh; :func:`device_mesh` gives the
  ``jax`` mesh for shardings.
  """
  mesh: Mesh
  workers_per_device: int

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh) or self.mesh.axis_names != (WORKERS,):
      raise ValueError("VirtualMesh.mesh must be a jax.sharding.Mesh with the "
                       f"one axis {WORKERS!r}; build it with parallel."
                       "make_mesh(n, workers_per_device=K).")
    checks.check_int("workers_per_device", self.workers_per_device,
                     minimum=1)

  @property
  def n_workers(self) -> int:
    return self.mesh.shape[WORKERS] * self.workers_per_device


AnyMesh = Mesh | VirtualMesh


def device_mesh(mesh: AnyMesh) -> Mesh:
  """The ``jax.sharding.Mesh`` of a mesh from :func:`make_mesh`."""
  return mesh.mesh if isinstance(mesh, VirtualMesh) else mesh


def mesh_shape(mesh: AnyMesh) -> dict[str, int]:
  """Axis sizes, with the vmapped workers of a device as ``"virtual"``."""
  shape = dict(device_mesh(mesh).shape)
  if isinstance(mesh, VirtualMesh):
    shape[VIRTUAL] = mesh.workers_per_device
  return shape


def workers_per_device(mesh: AnyMesh) -> int:
  """Workers on one device: ``K`` of a :class:`VirtualMesh`, else 1."""
  return mesh.workers_per_device if isinstance(mesh, VirtualMesh) else 1


def device_hint(n: int) -> str:
  return (f"on CPU, simulate devices by setting XLA_FLAGS="
          f"--xla_force_host_platform_device_count={n} (or "
          f"jax.config.update('jax_num_cpu_devices', {n})) before JAX starts")


def make_mesh(n_workers: int, local_size: int = 1, *, node_aware: bool = False,
              devices: Sequence[jax.Device] | None = None,
              devices_per_worker: int = 1,
              workers_per_device: int = 1) -> AnyMesh:
  """A mesh of ``n_workers`` workers of ``devices_per_worker`` devices each.

  With ``workers_per_device=K > 1`` instead: ``n_workers / K`` devices of
  ``K`` workers each (a :class:`VirtualMesh`).

  Args:
    n_workers: number of workers ``n`` (uses the first ``n * D`` devices,
      ``D = devices_per_worker``; worker ``i`` gets devices ``i*D ..
      i*D+D-1``).
    local_size: workers per node ``L``; must divide ``n``.
    node_aware: if True the worker axes are ``("nodes", "local")`` of shape
      ``(n/L, L)`` (worker ``i = node*L + local``), otherwise ``("workers",)``.
    devices: devices to use (default ``jax.devices()``), in worker order.
    devices_per_worker: ``D >= 1``. ``D = 1`` gives the mesh above (one
      worker per device, axes ``("workers",)`` or ``("nodes", "local")``,
      all ``Explicit``); ``D > 1`` appends an axis ``"inner"`` of size
      ``D`` of type ``Auto``: ``("workers", "inner")`` of shape ``(n, D)``
      or ``("nodes", "local", "inner")`` of shape ``(n/L, L, D)``.
    workers_per_device: ``K >= 1``; ``K > 1`` puts ``K`` workers on each of
      ``n / K`` devices (1-D ``"workers"`` axis over the devices; node-aware
      rounds then run as permutes, with the intra-device part a copy).

  Returns:
    A ``jax.sharding.Mesh`` (worker axes ``Explicit``), or a
    :class:`VirtualMesh` when ``workers_per_device > 1``.

  Raises:
    ValueError: ``n_workers``, ``local_size``, ``devices_per_worker`` or
      ``workers_per_device`` not an integer >= 1, ``node_aware`` not a
      bool, ``devices`` not a sequence of distinct ``jax.Device`` objects,
      fewer than ``n * D`` (or ``n / K``) devices (the message says how to
      simulate CPU devices), ``local_size`` not dividing ``n_workers``,
      ``K`` not dividing ``n_workers``, or both ``D`` and ``K`` above 1.
  """
  devices = _check_devices(jax.devices() if devices is None else devices)
  n_workers = checks.check_int("n_workers", n_workers, minimum=1)
  local_size = checks.check_int("local_size", local_size, minimum=1)
  checks.check_bool("node_aware", node_aware)
  d = checks.check_int("devices_per_worker", devices_per_worker, minimum=1)
  k = checks.check_int("workers_per_device", workers_per_device, minimum=1)
  if n_workers % local_size:
    raise ValueError(f"local_size={local_size} must divide n_workers="
                     f"{n_workers}.")
  if k > 1:
    return _virtual_mesh(n_workers, k, d, node_aware, devices)
  need = n_workers * d
  if len(devices) < need:
    what = (f"{n_workers} workers" if d == 1 else
            f"{n_workers} workers of {d} devices each")
    raise ValueError(
        f"{what} need {need} devices but only {len(devices)} are available; "
        f"{device_hint(need)}.")
  devs = np.array(devices[:need], dtype=object)
  if node_aware:
    shape, names = (n_workers // local_size, local_size), (NODES, LOCAL)
  else:
    shape, names = (n_workers,), (WORKERS,)
  types = (AxisType.Explicit,) * len(names)
  if d > 1:
    shape, names, types = shape + (d,), names + (INNER,), types + (
        AxisType.Auto,)
  return Mesh(devs.reshape(shape), names, axis_types=types)


def _check_devices(devices) -> list:
  """``devices`` as a list of distinct ``jax.Device`` objects, or ValueError."""
  try:
    devices = list(devices)
  except TypeError:
    raise ValueError(f"devices must be a sequence of jax.Device (e.g. "
                     f"jax.devices()), got {type(devices).__name__}.") from None
  seen = {}
  for i, d in enumerate(devices):
    if not isinstance(d, jax.Device):
      raise ValueError(f"devices[{i}] must be a jax.Device (e.g. from "
                       f"jax.devices()), got {type(d).__name__} {d!r:.40}.")
    if d in seen:
      raise ValueError(f"devices[{i}] is {d}, already devices[{seen[d]}]; "
                       "give each device once (a worker per device, or "
                       "workers_per_device for several per device).")
    seen[d] = i
  return devices


def _virtual_mesh(n_workers: int, k: int, d: int, node_aware: bool,
                  devices: list) -> VirtualMesh:
  """``make_mesh`` with ``K = k > 1`` workers per device."""
  if d > 1:
    raise ValueError(
        f"devices_per_worker={d} and workers_per_device={k}: a worker spans "
        "devices or shares one, not both; set one of them to 1.")
  if n_workers % k:
    raise ValueError(f"workers_per_device={k} must divide n_workers="
                     f"{n_workers}.")
  if node_aware:
    raise ValueError(
        "node_aware=True needs one worker per device; with "
        f"workers_per_device={k} node-aware rounds run as permutes on the "
        "1-D mesh (pass node_aware=False).")
  m = n_workers // k
  if len(devices) < m:
    raise ValueError(
        f"{n_workers} workers at {k} per device need {m} devices but only "
        f"{len(devices)} are available; {device_hint(m)}.")
  mesh = Mesh(np.array(devices[:m], dtype=object), (WORKERS,),
              axis_types=(AxisType.Explicit,))
  return VirtualMesh(mesh, k)


def is_node_aware(topology: topology_lib.Topology, local_size: int) -> bool:
  """True if every communicating round is a set of node-aligned group means.

  Such topologies (AER, or ``complete`` within and across nodes) run on a
  2-D ``("nodes", "local")`` mesh (``make_mesh(..., node_aware=True)``),
  where gossip uses intra-node means and one exchange per node pair.

  Raises:
    ValueError: ``local_size`` not an integer >= 1.
  """
  local_size = checks.check_int("local_size", local_size, minimum=1)
  if local_size <= 1:
    return False
  rounds = [r for r in topology.distinct_rounds
            if not r.is_identity and not r.is_global_mean]
  return bool(rounds) and all(r.node_partners(local_size) is not None
                              for r in rounds)


def _worker_names(mesh: AnyMesh) -> tuple[str, ...]:
  return tuple(a for a in device_mesh(mesh).axis_names if a != INNER)


def _device_axis(mesh: AnyMesh) -> str | tuple[str, ...]:
  names = _worker_names(mesh)
  return names[0] if len(names) == 1 else names


def worker_axis(mesh: AnyMesh) -> collectives.AxisName:
  """The worker axis of ``mesh``, as the collectives take it.

  ``"workers"`` or ``("nodes", "local")`` (the ``"inner"`` axis of a
  multi-device worker is never part of it), or a
  :class:`~decentral_jax.comm.collectives.VirtualAxes` for a
  :class:`VirtualMesh`.
  """
  if isinstance(mesh, VirtualMesh):
    return collectives.VirtualAxes(WORKERS, mesh.workers_per_device, VIRTUAL)
  return _device_axis(mesh)


def worker_spec(mesh: AnyMesh) -> P:
  """``PartitionSpec`` sharding a leading worker axis over the worker axes."""
  return P(_device_axis(mesh))


def worker_sharding(mesh: AnyMesh) -> NamedSharding:
  """``NamedSharding`` for arrays with a leading worker axis.

  Replicated over a worker's devices when they are more than one; ``K``
  consecutive rows per device on a :class:`VirtualMesh`.
  """
  return NamedSharding(device_mesh(mesh), worker_spec(mesh))


def n_workers_of(mesh: AnyMesh) -> int:
  """Number of workers of ``mesh`` (devices x workers per device / devices
  per worker)."""
  m = device_mesh(mesh)
  return int(np.prod([m.shape[a] for a in _worker_names(mesh)])
             ) * workers_per_device(mesh)


def devices_per_worker(mesh: AnyMesh) -> int:
  """Devices of one worker: the size of the ``"inner"`` axis, else 1."""
  return int(device_mesh(mesh).shape.get(INNER, 1))


def _full_sharding(mesh: AnyMesh, ndim: int) -> NamedSharding:
  """Worker sharding with the spec padded to ``ndim`` (as shard_map outputs).

  Equal specs keep jitted steps from compiling twice when their outputs are
  fed back as inputs.
  """
  return NamedSharding(device_mesh(mesh),
                       P(_device_axis(mesh), *([None] * (ndim - 1))))


def shard(tree: PyTree, mesh: AnyMesh) -> PyTree:
  """Places stacked ``[n, ...]`` arrays with the worker sharding.

  Raises:
    ValueError: ``mesh`` not from :func:`make_mesh`.
  """
  check_mesh(mesh)
  return jax.tree.map(
      lambda x: jax.device_put(x, _full_sharding(mesh, max(jnp.ndim(x), 1))),
      tree)


def replicate(tree: PyTree, mesh: AnyMesh) -> PyTree:
  """Stacks ``n`` copies of ``tree`` along a new leading worker axis, sharded.

  Every worker starts from the same values (as after ``decent-dp``'s initial
  broadcast). Leaves become ``[n, *leaf.shape]`` with the leaf dtype.

  Raises:
    ValueError: ``mesh`` not from :func:`make_mesh`.
  """
  check_mesh(mesh)
  n = n_workers_of(mesh)

  def put(x):
    x = jnp.asarray(x)
    return jax.jit(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape),
                   out_shardings=_full_sharding(mesh, x.ndim + 1))(x)

  return jax.tree.map(put, tree)


def unstack(tree: PyTree, worker: int) -> PyTree:
  """Worker ``worker``'s slice of stacked state, as host NumPy arrays.

  The arrays are fetched to the host first (indexing an explicitly sharded
  array on device would need an ``out_sharding``). Single-process only: in a
  multi-process job use ``multihost_utils.process_allgather``.

  Raises:
    ValueError: ``worker`` not an int in ``[0, n)`` for a leaf's leading
      size ``n`` (a negative index is refused, not counted from the end).
  """
  worker = checks.check_int("worker", worker, minimum=0)

  def take(x):
    x = np.asarray(jax.device_get(x))
    n = x.shape[0] if x.ndim else 0
    if worker >= n:
      raise ValueError(f"worker must be an int >= 0 and < {n} (the leading "
                       f"worker axis), got {worker}.")
    return x[worker]

  return jax.tree.map(take, tree)


def per_worker(fn: Callable, mesh: AnyMesh, *,
               replicated_argnums: Sequence[int] = (),
               gathered_outputs: Sequence[int] = ()) -> Callable:
  """Wraps a one-worker function to act on stacked per-worker arguments.

  Inside, each worker sees its slice with the leading axis removed; outputs
  get the leading axis back. On a mesh with an ``"inner"`` axis
  (``devices_per_worker > 1``) the ``shard_map`` is manual over the worker
  axes only (``axis_names``): ``fn`` is the same one-worker code, and the
  compiler splits its arrays over the worker's devices as the arguments'
  shardings say (see :mod:`decentral_jax.parallel.layouts`). Arguments listed in
  ``replicated_argnums`` are passed unchanged (``P()``, same on all workers;
  e.g. a step counter).

  Outputs listed in ``gathered_outputs`` (``fn`` then returns a tuple) are
  all-gathered over the workers inside the step and come back replicated on
  every device, still ``[n, ...]``: in a multi-process job each process can
  then read every worker's values (e.g. metrics) from its own devices,
  without another collective queued behind the next step.

  Args:
    fn: ``fn(*args) -> outputs`` for one worker; may use collectives over
      ``worker_axis(mesh)``.
    mesh: mesh from :func:`make_mesh`.
    replicated_argnums: positions of replicated arguments.
    gathered_outputs: positions of outputs to gather (replicated ``P()``);
      ``fn`` must then return a tuple of ``max(gathered_outputs) + 1``
      outputs.

  On a :class:`VirtualMesh` (``K`` workers per device) ``fn`` runs under
  ``jax.vmap`` over each device's ``K`` workers, its ``axis_name`` a
  :class:`~decentral_jax.comm.collectives.VirtualAxes` (``worker_axis(mesh)``):
  collectives must go through :mod:`decentral_jax.comm.collectives` (gossip,
  the optimizers and the step do). Every argument is batched over the
  workers as given; conditionals on values equal on all workers (sync
  steps, gossip rounds) go through
  :func:`decentral_jax.comm.collectives.uniform` so that they stay
  conditionals (``gossip.every`` and ``gossip.mix`` do this).

  Long loops on simulated CPU devices: when many jitted steps with
  collectives are dispatched and none is waited for, XLA's CPU runtime can
  miss a collective's rendezvous and abort the process after 40 s
  ("Termination timeout for collective permute ..."). On 2 cores this
  happened with 40 to 80 steps in flight (2 to 16 devices), never with 32
  or fewer; plain ``jax.shard_map`` with ``lax.ppermute`` does the same.
  Call ``jax.block_until_ready`` on an output (or read a metric) at least
  every 16 steps; ``decentral_jax.runner.train`` keeps at most two in flight.

  Returns:
    A function of stacked ``[n, ...]`` arguments (not jitted).

  Raises:
    ValueError: ``fn`` not callable, ``mesh`` not from :func:`make_mesh`,
      an entry of ``replicated_argnums`` or ``gathered_outputs`` not an int
      >= 0; when called, a stacked argument whose leaves do not have a
      leading worker axis of size ``n``, or are not sharded over the
      worker axis (not placed with :func:`shard`; the message names the
      argument and leaf).
  """
  if not callable(fn):
    raise ValueError(f"fn must be callable, got {type(fn).__name__}.")
  check_mesh(mesh)
  replicated = {checks.check_int(f"replicated_argnums[{j}]", a, minimum=0)
                for j, a in enumerate(replicated_argnums)}
  gathered = {checks.check_int(f"gathered_outputs[{j}]", a, minimum=0)
              for j, a in enumerate(gathered_outputs)}
  spec = worker_spec(mesh)
  axis = worker_axis(mesh)
  k = workers_per_device(mesh)
  body = (_virtual_body(fn, axis, k, replicated, gathered) if k > 1
          else _device_body(fn, axis, replicated, gathered))

  def wrapped(*args):
    for k_, a in enumerate(args):
      if k_ not in replicated:
        _check_stacked(a, k_, mesh)
    in_specs = tuple(P() if k_ in replicated else spec
                     for k_ in range(len(args)))
    out_specs = spec
    if gathered:
      out_specs = tuple(P() if j in gathered else spec
                        for j in range(max(gathered) + 1))
    extra = {}
    if INNER in device_mesh(mesh).axis_names:  # manual over the workers only
      extra["axis_names"] = set(_worker_names(mesh))
    return jax.shard_map(body, mesh=device_mesh(mesh), in_specs=in_specs,
                         out_specs=out_specs, **extra)(*args)

  return wrapped


def check_mesh(mesh) -> None:
  """Raises ``ValueError`` unless ``mesh`` is a ``Mesh`` or :class:`VirtualMesh`."""
  if not isinstance(mesh, (Mesh, VirtualMesh)):
    raise ValueError(f"mesh must be a jax.sharding.Mesh or parallel."
                     f"VirtualMesh from parallel.make_mesh, got "
                     f"{type(mesh).__name__}.")


def _check_stacked(arg, position: int, mesh: AnyMesh) -> None:
  """Raises unless every leaf of ``arg`` is ``[n, ...]`` over the worker axis."""
  n = n_workers_of(mesh)
  want = _device_axis(mesh)
  want = (want,) if isinstance(want, str) else tuple(want)
  for path, x in jax.tree_util.tree_leaves_with_path(arg):
    shape = jnp.shape(x)
    where = f"per_worker: argument {position} leaf {jax.tree_util.keystr(path)!r}"
    if not shape or shape[0] != n:
      raise ValueError(
          f"{where} has shape {tuple(shape)}; stacked per-worker arguments need "
          f"a leading worker axis of size {n} (use parallel.replicate or "
          "parallel.shard), or list the argument in replicated_argnums.")
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None:
      continue
    lead = spec[0] if len(spec) else None
    lead = () if lead is None else (lead,) if isinstance(lead, str) else tuple(lead)
    if lead != want:
      raise ValueError(
          f"{where} is not sharded over the worker axis {want} (its sharding "
          f"is {spec}); place stacked [n, ...] arguments with parallel.shard("
          "tree, mesh) (or parallel.replicate, layouts.place), or list the "
          "argument in replicated_argnums.")


def _check_out(out, gathered) -> None:
  if not isinstance(out, tuple) or len(out) != max(gathered) + 1:
    raise ValueError(
        f"per_worker: gathered_outputs={sorted(gathered)} needs fn to "
        f"return a tuple of {max(gathered) + 1} outputs.")


def _device_body(fn, axis, replicated, gathered) -> Callable:
  """The ``shard_map`` body of :func:`per_worker`, one worker per device."""

  def stack(x):
    return jnp.asarray(x)[None]

  def gather(x):  # [n, ...], equal on every device
    return collectives.all_gather(x, axis)

  def body(*args):
    args = [a if k_ in replicated else jax.tree.map(lambda x: x[0], a)
            for k_, a in enumerate(args)]
    out = fn(*args)
    if not gathered:
      return jax.tree.map(stack, out)
    _check_out(out, gathered)
    return tuple(jax.tree.map(gather if j in gathered else stack, o)
                 for j, o in enumerate(out))

  return body


def _virtual_body(fn, axis, k, replicated, gathered) -> Callable:
  """The ``shard_map`` body of :func:`per_worker` on a :class:`VirtualMesh`:
  ``fn`` under ``jax.vmap`` over the ``k`` workers of a device."""

  def gather(x):  # [n, ...], equal on every device
    return collectives.all_gather(x, axis)

  def body_virtual(*args):
    in_axes = [None if j in replicated else 0 for j in range(len(args))]
    vargs = args

    def one(slot, *a):
      with collectives.virtual_slot(slot):
        out = fn(*a)
      if not gathered:
        return out
      _check_out(out, gathered)
      return tuple(jax.tree.map(gather, o) if j in gathered else o
                   for j, o in enumerate(out))

    out_axes = 0
    if gathered:
      out_axes = tuple(None if j in gathered else 0
                       for j in range(max(gathered) + 1))
    slots = jnp.arange(k, dtype=jnp.int32)
    return jax.vmap(one, in_axes=(0,) + tuple(in_axes), out_axes=out_axes,
                    axis_name=VIRTUAL, axis_size=k)(slots, *vargs)

  return body_virtual
