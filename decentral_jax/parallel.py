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
the ``fsdp`` / ``data`` modes: :mod:`decentral_jax.layouts`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from decentral_jax import gossip
from decentral_jax import topology as topology_lib

PyTree = Any

WORKERS = "workers"
NODES = "nodes"
LOCAL = "local"
#: Mesh axis over the devices of one worker (present only if they are > 1).
INNER = "inner"


def device_hint(n: int) -> str:
  return (f"on CPU, simulate devices by setting XLA_FLAGS="
          f"--xla_force_host_platform_device_count={n} (or "
          f"jax.config.update('jax_num_cpu_devices', {n})) before JAX starts")


def make_mesh(n_workers: int, local_size: int = 1, *, node_aware: bool = False,
              devices: Sequence[jax.Device] | None = None,
              devices_per_worker: int = 1) -> Mesh:
  """A mesh of ``n_workers`` workers of ``devices_per_worker`` devices each.

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

  Returns:
    A ``jax.sharding.Mesh``; worker axes are ``Explicit``.

  Raises:
    ValueError: fewer than ``n * D`` devices (the message says how to
      simulate CPU devices), ``local_size`` not dividing ``n_workers``, or
      ``devices_per_worker`` not an integer >= 1.
  """
  devices = list(jax.devices() if devices is None else devices)
  if n_workers < 1:
    raise ValueError(f"n_workers must be >= 1, got {n_workers}.")
  if isinstance(devices_per_worker, bool) or not isinstance(
      devices_per_worker, (int, np.integer)) or devices_per_worker < 1:
    raise ValueError(f"devices_per_worker must be an integer >= 1, got "
                     f"{devices_per_worker!r}.")
  d = int(devices_per_worker)
  need = n_workers * d
  if len(devices) < need:
    what = (f"{n_workers} workers" if d == 1 else
            f"{n_workers} workers of {d} devices each")
    raise ValueError(
        f"{what} need {need} devices but only {len(devices)} are available; "
        f"{device_hint(need)}.")
  if local_size < 1 or n_workers % local_size:
    raise ValueError(f"local_size={local_size} must divide n_workers="
                     f"{n_workers}.")
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


def is_node_aware(topology: topology_lib.Topology, local_size: int) -> bool:
  """True if every communicating round is a set of node-aligned group means.

  Such topologies (AER, or ``complete`` within and across nodes) run on a
  2-D ``("nodes", "local")`` mesh (``make_mesh(..., node_aware=True)``),
  where gossip uses intra-node means and one exchange per node pair.
  """
  if local_size <= 1:
    return False
  rounds = [r for r in topology.distinct_rounds
            if not r.is_identity and not r.is_global_mean]
  return bool(rounds) and all(r.node_partners(local_size) is not None
                              for r in rounds)


def _worker_names(mesh: Mesh) -> tuple[str, ...]:
  return tuple(a for a in mesh.axis_names if a != INNER)


def worker_axis(mesh: Mesh) -> str | tuple[str, ...]:
  """The worker axis name(s) of ``mesh``: ``"workers"`` or ``("nodes","local")``.

  The ``"inner"`` axis of a multi-device worker is never part of it.
  """
  names = _worker_names(mesh)
  return names[0] if len(names) == 1 else names


def worker_spec(mesh: Mesh) -> P:
  """``PartitionSpec`` sharding a leading worker axis over the worker axes."""
  return P(worker_axis(mesh))


def worker_sharding(mesh: Mesh) -> NamedSharding:
  """``NamedSharding`` for arrays with a leading worker axis.

  Replicated over a worker's devices when they are more than one.
  """
  return NamedSharding(mesh, worker_spec(mesh))


def n_workers_of(mesh: Mesh) -> int:
  """Number of workers of ``mesh`` (devices / devices per worker)."""
  return int(np.prod([mesh.shape[a] for a in _worker_names(mesh)]))


def devices_per_worker(mesh: Mesh) -> int:
  """Devices of one worker: the size of the ``"inner"`` axis, else 1."""
  return int(mesh.shape.get(INNER, 1))


def _full_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Worker sharding with the spec padded to ``ndim`` (as shard_map outputs).

  Equal specs keep jitted steps from compiling twice when their outputs are
  fed back as inputs.
  """
  return NamedSharding(mesh, P(worker_axis(mesh), *([None] * (ndim - 1))))


def shard(tree: PyTree, mesh: Mesh) -> PyTree:
  """Places stacked ``[n, ...]`` arrays with the worker sharding."""
  return jax.tree.map(
      lambda x: jax.device_put(x, _full_sharding(mesh, max(jnp.ndim(x), 1))),
      tree)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
  """Stacks ``n`` copies of ``tree`` along a new leading worker axis, sharded.

  Every worker starts from the same values (as after ``decent-dp``'s initial
  broadcast). Leaves become ``[n, *leaf.shape]`` with the leaf dtype.
  """
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
  """
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x))[worker], tree)


def per_worker(fn: Callable, mesh: Mesh, *,
               replicated_argnums: Sequence[int] = (),
               gathered_outputs: Sequence[int] = ()) -> Callable:
  """Wraps a one-worker function to act on stacked per-worker arguments.

  Inside, each worker sees its slice with the leading axis removed; outputs
  get the leading axis back. On a mesh with an ``"inner"`` axis
  (``devices_per_worker > 1``) the ``shard_map`` is manual over the worker
  axes only (``axis_names``): ``fn`` is the same one-worker code, and the
  compiler splits its arrays over the worker's devices as the arguments'
  shardings say (see :mod:`decentral_jax.layouts`). Arguments listed in
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

  Long loops on simulated CPU devices: when many jitted steps with
  collectives are dispatched and none is waited for, XLA's CPU runtime can
  miss a collective's rendezvous and abort the process after 40 s
  ("Termination timeout for collective permute ..."). On 2 cores this
  happened with 40 to 80 steps in flight (2 to 16 devices), never with 32
  or fewer; plain ``jax.shard_map`` with ``lax.ppermute`` does the same.
  Call ``jax.block_until_ready`` on an output (or read a metric) at least
  every 16 steps; ``decentral_jax.train`` keeps at most two in flight.

  Returns:
    A function of stacked ``[n, ...]`` arguments (not jitted).

  Raises:
    ValueError (when called): a stacked argument whose leaves do not have a
      leading worker axis of size ``n`` (the message names the argument).
  """
  spec = worker_spec(mesh)
  axis = worker_axis(mesh)
  replicated = set(replicated_argnums)
  gathered = set(gathered_outputs)
  n = n_workers_of(mesh)

  def stack(x):
    return jnp.asarray(x)[None]

  def gather(x):  # [n, ...], equal on every device
    x = gossip.match_varying(jnp.asarray(x), lax.axis_index(axis))
    return lax.all_gather(x, axis, to="invarying")

  def body(*args):
    args = [a if k in replicated else jax.tree.map(lambda x: x[0], a)
            for k, a in enumerate(args)]
    out = fn(*args)
    if not gathered:
      return jax.tree.map(stack, out)
    if not isinstance(out, tuple) or len(out) != max(gathered) + 1:
      raise ValueError(
          f"per_worker: gathered_outputs={sorted(gathered)} needs fn to "
          f"return a tuple of {max(gathered) + 1} outputs.")
    return tuple(jax.tree.map(gather if k in gathered else stack, o)
                 for k, o in enumerate(out))

  def wrapped(*args):
    for k, a in enumerate(args):
      if k in replicated:
        continue
      for path, x in jax.tree_util.tree_leaves_with_path(a):
        shape = jnp.shape(x)
        if not shape or shape[0] != n:
          raise ValueError(
              f"per_worker: argument {k} leaf {jax.tree_util.keystr(path)!r} "
              f"has shape {tuple(shape)}; stacked per-worker arguments need "
              f"a leading worker axis of size {n} (use parallel.replicate or "
              "parallel.shard), or list the argument in replicated_argnums.")
    in_specs = tuple(P() if k in replicated else spec
                     for k in range(len(args)))
    out_specs = spec
    if gathered:
      out_specs = tuple(P() if k in gathered else spec
                        for k in range(max(gathered) + 1))
    extra = {}
    if INNER in mesh.axis_names:  # manual over the workers only
      extra["axis_names"] = set(_worker_names(mesh))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs, **extra)(*args)

  return wrapped
