"""Collectives over the workers, whatever a worker is on the devices.

Every communicating layer (gossip, optimizers, local-update methods, the
step) reaches the other workers through the functions here, traced inside
``jax.shard_map`` over the worker axis. The worker axis (``AxisName``) is:

* a mesh axis name, ``"workers"``: one worker per device (or per group of
  devices, see :mod:`decentral_jax.parallel.layouts`); every function is the
  ``jax.lax`` collective of the same name;
* a pair ``("nodes", "local")`` of mesh axes, worker ``node * L + local``;
* :class:`VirtualAxes`: ``K`` workers on each device of a 1-D mesh axis.
  The one-worker code runs under ``jax.vmap`` over the ``K`` workers of a
  device (axis name ``VirtualAxes.virtual``), worker ``i = device * K +
  slot``. Each function sees the stack ``[K, ...]`` of its device's workers
  (``jax.custom_batching.custom_vmap``) and realises a collective over all
  ``n = M K`` workers in two levels: what stays on the device is a gather
  along the stack, what crosses devices one collective over the device axis
  (for :func:`permute`: one ``ppermute`` per device offset, carrying only
  the rows that cross it). A collective over a tuple of a ``shard_map``
  axis and a ``vmap`` axis is not supported by JAX, and ``psum`` over a
  ``vmap`` axis inside ``shard_map`` fails, hence this plan. The static
  plans (which rows cross which devices) are built by
  :mod:`~decentral_jax.comm.virtual_plans`.

Results are those of the one-worker-per-device collectives: the same
dtypes (``psum`` of ``bool`` gives int32 and ``pmean`` of an integer or
``bool`` a float, as ``lax.pmean`` does), the same pytrees, the same
values and the same refusals (one ``ValueError`` or ``TypeError`` with the
same message, raised at trace time, before any collective). Data movement
(:func:`permute`, :func:`all_gather`, :func:`all_to_all`) and integer sums
are exact; floating-point sums (:func:`psum`, :func:`pmean`) add a
device's ``K`` workers first, then across devices, so they may differ from
the one-collective sum in the last bits (each is within ``(n - 1)`` ulps
of ``sum_j |x_j|`` of the exact sum).

Under :class:`VirtualAxes` the functions must be called inside that
``vmap`` (as :func:`decentral_jax.parallel.per_worker` arranges).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from decentral_jax import checks
from decentral_jax.comm import virtual_plans
from decentral_jax.comm.axes import AxisName
from decentral_jax.comm.axes import VirtualAxes
from decentral_jax.comm.axes import bound_axes
from decentral_jax.comm.axes import check_axis_name
from decentral_jax.comm.axes import is_virtual
from decentral_jax.comm.axes import mesh_axes


def _lax_axis(axis_name):
  axes = bound_axes(axis_name)
  return axes[0] if len(axes) == 1 else axes


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _check_leaves(op: str, x) -> None:
  """Refuses a pytree leaf that is not a numeric or ``bool`` array or scalar.

  The same check (and message) on every worker axis, so that one worker per
  device and several refuse alike.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(x):
    try:
      ok = (isinstance(leaf, _ARRAY_TYPES)
            and np.dtype(jnp.result_type(leaf)).kind in "biufcV")
    except TypeError:
      ok = False
    if not ok:
      where = jax.tree_util.keystr(path) or "x"
      raise TypeError(
          f"collectives.{op}: {where} is {type(leaf).__name__} "
          f"{leaf!r:.60}; collectives take arrays (or pytrees of arrays) of "
          "a numeric or bool dtype.")


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` is typed as varying over (inside ``shard_map``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()))
  return frozenset(getattr(aval, "vma", ()))


def match_varying(out, like):
  """Marks ``out`` as varying over the same mesh axes as ``like``.

  Inside ``jax.shard_map`` a ``pmean`` result is typed invariant across the
  axis; branches of ``lax.switch`` must agree in type, and the output of a
  mixing step is per-worker state. This is a type-level cast
  (``lax.pcast``); values are unchanged.

  Args:
    out: an array traced inside ``shard_map``.
    like: an array whose varying mesh axes ``out`` should get.

  Returns:
    ``out``, varying over at least the axes ``like`` varies over.
  """
  missing = tuple(sorted(varying_axes(like) - varying_axes(out)))
  if missing:
    out = lax.pcast(out, missing, to="varying")
  return out


def tree_varying_axes(tree) -> frozenset:
  """The union of :func:`varying_axes` over the array leaves of ``tree``."""
  axes = frozenset()
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      axes |= varying_axes(x)
  return axes


def vary_over(tree, axes):
  """Marks every array leaf of ``tree`` as varying over at least ``axes``.

  A type-level cast (``lax.pcast``) as :func:`match_varying`: values are
  unchanged, no collective runs. Outside ``shard_map`` (and under the
  ``vmap`` over a device's workers) ``axes`` is empty and ``tree`` is
  returned unchanged.

  Args:
    tree: pytree; leaves that are not JAX arrays are returned as they are.
    axes: mesh axis names (e.g. :func:`tree_varying_axes` of the
      parameters).

  Returns:
    ``tree`` with each array leaf varying over its own axes and ``axes``.
  """
  axes = frozenset(axes)
  if not axes:
    return tree

  def cast(x):
    if not isinstance(x, jax.Array):
      return x
    missing = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def size(axis_name: AxisName) -> int:
  """Number of workers ``n`` (a Python int; reads the mesh axis sizes).

  Raises:
    ValueError: an axis the enclosing mesh lacks, or not inside
      ``shard_map`` (:func:`bound_axes`).
  """
  n = 1
  if not is_virtual(axis_name):
    _check_not_virtual(axis_name)
  for a in bound_axes(axis_name):
    n *= lax.axis_size(a)
  if is_virtual(axis_name):
    n *= axis_name.per_device
  return n


# The batched slot index (0 .. K-1) of the vmap over a device's workers.
# ``lax.axis_index`` of a vmap axis fails inside ``lax.switch`` branches
# traced in ``shard_map`` (jax 0.10), so the slot is passed in as data.
_SLOT = contextvars.ContextVar("decentral_jax_virtual_slot", default=None)


@contextlib.contextmanager
def virtual_slot(slot):
  """Declares ``slot`` (batched int32, ``0..K-1``) for the enclosed trace.

  :func:`decentral_jax.parallel.per_worker` wraps the one-worker function
  in it, inside ``jax.vmap`` over the ``K`` workers of a device, with
  ``slot`` the vmapped ``arange(K)``.
  """
  token = _SLOT.set(slot)
  try:
    yield
  finally:
    _SLOT.reset(token)


def _check_not_virtual(axis_name) -> None:
  """A mesh-axis name inside the vmap over a device's workers is a mistake."""
  if _SLOT.get() is not None:
    raise ValueError(
        f"axis_name={axis_name!r} names mesh axes, but this code runs for "
        "several workers per device (a parallel.VirtualMesh): pass "
        "parallel.worker_axis(mesh) as the axis_name: gossip and the "
        "optimizers take it as axis_name=, the local-update methods through "
        "their reduction (reduction=reductions.uncompressed(axis_name=...) "
        "or reductions.compressed(..., axis_name=...)).")


def uniform(x):
  """``x`` as one value shared by a device's workers (its first worker's).

  For values equal on all workers (step and round counters): under the
  ``vmap`` over a device's workers a ``lax.cond`` or ``lax.switch`` on a
  per-worker value would run every branch, communication included; on
  ``uniform(x)`` it stays a conditional. Outside that ``vmap`` (or under a
  ``vmap`` of the caller's own) ``x`` is returned unchanged.
  """
  slot = _SLOT.get()
  if slot is None:
    return x

  @jax.custom_batching.custom_vmap
  def op(v, s):
    del s
    return v

  @op.def_vmap
  def rule(axis_size, in_batched, v, s):
    del axis_size, s
    if not in_batched[1]:  # another vmap than the workers'
      return v, in_batched[0]
    return (v[0] if in_batched[0] else v), False

  return op(jnp.asarray(x), slot)


def _slot(axis_name: VirtualAxes):
  slot = _SLOT.get()
  if slot is None:
    raise ValueError(
        f"collectives over {axis_name!r} (several workers per device) must "
        "be traced inside parallel.per_worker on a VirtualMesh.")
  return slot


def index(axis_name: AxisName) -> jax.Array:
  """This worker's index ``i`` in ``0 .. n-1`` (int32 scalar)."""
  if is_virtual(axis_name):
    return (lax.axis_index(axis_name.device) * axis_name.per_device
            + _slot(axis_name))
  _check_not_virtual(axis_name)
  return lax.axis_index(_lax_axis(axis_name))


def _batched(x, axis_name: VirtualAxes):
  """``x`` as a value batched over the virtual axis (values unchanged)."""
  x = jnp.asarray(x)
  return jnp.where(_slot(axis_name) >= 0, x, x)


def _on_stack(axis_name: VirtualAxes, fn, x, batched_out: bool):
  """Applies ``fn`` to the ``[K, ...]`` stack of ``x`` over a device's workers.

  ``fn(stack)`` returns a stack (``batched_out``: typed varying over the
  device axis) or one value shared by the device's workers (typed
  invariant). The function is never run unbatched (``x`` is made batched
  first); the unbatched rule only gives the output's type.
  """
  k = axis_name.per_device
  dev = axis_name.device

  def typed(out):
    if batched_out:
      return match_varying(out, lax.axis_index(dev))
    return out

  @jax.custom_batching.custom_vmap
  def op(v, slot):
    del slot
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct((k,) + v.shape, v.dtype))
    return typed(jnp.zeros(out.shape[1:] if batched_out else out.shape,
                           out.dtype))

  @op.def_vmap
  def rule(axis_size, in_batched, v, slot):
    del slot
    # The slot is batched by the vmap over the workers only: a vmap of the
    # caller's own inside the worker function must not be taken for it.
    if axis_size != k or not all(in_batched):
      raise ValueError(
          f"collectives over {axis_name!r} must run inside jax.vmap over "
          f"the {k} workers of a device (parallel.per_worker) and not "
          "inside another jax.vmap of the worker function; got a vmap of "
          f"size {axis_size}.")
    return typed(fn(v)), batched_out

  return op(_batched(x, axis_name), _slot(axis_name))


def psum(x, axis_name: AxisName):
  """``sum_j x_j`` over all workers (invariant type, as ``lax.psum``).

  Args:
    x: an array or a pytree of arrays (numeric or ``bool``; ``bool`` is
      summed as int32, as ``lax.psum`` does).
    axis_name: the worker axis.

  Returns:
    A pytree like ``x``; each leaf in its dtype (int32 for ``bool``).

  Raises:
    TypeError: a leaf that is not a numeric or ``bool`` array.
  """
  if not is_virtual(axis_name):
    return _mesh_reduce("psum", x, axis_name)
  _check_leaves("psum", x)
  dev = axis_name.device

  def local_sum(s):
    # Integers keep their dtype (jnp.sum would widen int8 to int32);
    # 16-bit floats are added in float32 and rounded once.
    exact = jnp.issubdtype(s.dtype, jnp.integer)
    return jnp.sum(s, 0, dtype=s.dtype if exact else None)

  def one(v):
    v = jnp.asarray(v)
    if v.dtype == jnp.bool_:
      v = v.astype(jnp.int32)
    return _on_stack(axis_name, lambda s: lax.psum(local_sum(s), dev), v,
                     batched_out=False)

  return jax.tree.map(one, x)


def pmean(x, axis_name: AxisName):
  """``(1/n) sum_j x_j`` over all workers (as ``lax.pmean``).

  :func:`psum` divided by ``n``: floating leaves keep their dtype, integer
  and ``bool`` leaves give JAX's true division's float (3.5 for the mean
  of int32 ``0 .. 7``).

  Raises:
    TypeError: a leaf that is not a numeric or ``bool`` array.
  """
  if not is_virtual(axis_name):
    return _mesh_reduce("pmean", x, axis_name)
  _check_leaves("pmean", x)
  n = size(axis_name)
  return jax.tree.map(lambda v: v / n, psum(x, axis_name))


def _mesh_reduce(op: str, x, axis_name):
  """``lax.psum`` or ``lax.pmean`` (``op``) over mesh axes, after the checks."""
  _check_leaves(op, x)
  _check_not_virtual(axis_name)
  return getattr(lax, op)(x, _lax_axis(axis_name))


def all_gather(x, axis_name: AxisName) -> jax.Array:
  """Every worker's ``x`` stacked, ``[n, *x.shape]``, equal on all workers.

  ``x`` may be a pytree (each leaf gathered). The result is typed
  invariant over the worker axes (``to="invarying"``).

  Raises:
    TypeError: a leaf that is not a numeric or ``bool`` array.
  """
  _check_leaves("all_gather", x)
  if not is_virtual(axis_name):
    _check_not_virtual(axis_name)
    axis = _lax_axis(axis_name)

    def one(v):
      v = match_varying(jnp.asarray(v), lax.axis_index(axis))
      return lax.all_gather(v, axis, to="invarying")

    return jax.tree.map(one, x)
  dev = axis_name.device

  def gather(s):
    s = match_varying(s, lax.axis_index(dev))
    return lax.all_gather(s, dev, tiled=True, to="invarying")

  return jax.tree.map(
      lambda v: _on_stack(axis_name, gather, v, batched_out=False), x)


def _check_rows(x, n: int) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(x):
    shape = jnp.shape(leaf)
    if not shape or shape[0] != n:
      where = jax.tree_util.keystr(path) or "x"
      raise ValueError(
          f"collectives.all_to_all: {where} has shape {tuple(shape)}; it "
          f"needs a leading axis of size n={n}, one row per worker.")


def all_to_all(x, axis_name: AxisName) -> jax.Array:
  """``out[j] = x_j[i]`` on worker ``i``: row ``i`` of every worker's ``x``.

  Args:
    x: ``[n, ...]``, row ``j`` meant for worker ``j`` (or a pytree of such).

  Returns:
    ``[n, ...]``, row ``j`` from worker ``j`` (``lax.all_to_all`` with
    split and concat axis 0).

  Raises:
    TypeError: a leaf that is not a numeric or ``bool`` array.
    ValueError: a leaf without a leading axis of size ``n``.
  """
  _check_leaves("all_to_all", x)
  _check_rows(x, size(axis_name))
  if not is_virtual(axis_name):
    return lax.all_to_all(x, _lax_axis(axis_name), 0, 0, tiled=False)
  k = axis_name.per_device
  dev = axis_name.device

  def exchange(s):  # [Ks, n, ...] (source slot, destination worker)
    m = s.shape[1] // k
    s = s.reshape((k, m, k) + s.shape[2:])  # [Ks, Md, Kd, ...]
    r = lax.all_to_all(s, dev, 1, 1, tiled=False)  # [Ks, Ms, Kd, ...]
    r = jnp.moveaxis(r, 2, 0)  # [Kd, Ks, Ms, ...]
    r = jnp.swapaxes(r, 1, 2)  # [Kd, Ms, Ks, ...]
    return r.reshape((k, m * k) + s.shape[3:])

  return jax.tree.map(
      lambda v: _on_stack(axis_name, exchange, v, batched_out=True), x)


def _check_perm(perm, n: int) -> tuple[tuple[int, int], ...]:
  """``perm`` as int pairs in ``0 .. n-1``, distinct sources and destinations."""
  try:
    pairs = [tuple(p) for p in perm]
  except TypeError:
    raise ValueError(f"permute: perm must be a sequence of (source, "
                     f"destination) pairs, got {perm!r:.80}.") from None
  out = []
  for i, pair in enumerate(pairs):
    if len(pair) != 2:
      raise ValueError(f"permute: perm[{i}] must be a (source, destination) "
                       f"pair, got {pair!r}.")
    out.append(tuple(checks.check_int(f"permute: perm[{i}][{j}]", v,
                                      minimum=0, maximum=n - 1)
                     for j, v in enumerate(pair)))
  for j, role in enumerate(("sources", "destinations")):
    ends = [p[j] for p in out]
    if len(set(ends)) != len(ends):
      raise ValueError(f"permute: perm {role} must be distinct, got "
                       f"{[p for p in out]!r:.200}.")
  return tuple(out)


def permute(x, axis_name: AxisName, perm: Sequence[tuple[int, int]]):
  """``lax.ppermute`` over workers: worker ``dst`` gets ``x_src``, else 0.

  Args:
    x: this worker's array (or a pytree of arrays).
    axis_name: the worker axis.
    perm: ``(source, destination)`` worker pairs, integers in ``0 .. n-1``;
      distinct sources, distinct destinations.

  Returns:
    A pytree like ``x``: what this worker receives (zeros if nothing).

  Raises:
    TypeError: a leaf that is not a numeric or ``bool`` array.
    ValueError: ``perm`` not pairs of integers in ``0 .. n-1``, or a source
      or destination twice.
  """
  _check_leaves("permute", x)
  pairs = _check_perm(perm, size(axis_name))
  if not is_virtual(axis_name):
    return lax.ppermute(x, _lax_axis(axis_name), list(pairs))
  k = axis_name.per_device
  dev = axis_name.device
  m = size(axis_name) // k
  hops, take = virtual_plans.permute_plan(pairs, m, k)

  def move(s):
    me = lax.axis_index(dev)
    parts = [s]
    for hop in hops:
      rows = jnp.take(s, jnp.asarray(hop.send)[me], axis=0)
      parts.append(lax.ppermute(rows, dev, list(hop.pairs)))
    parts.append(jnp.zeros((1,) + s.shape[1:], s.dtype))
    cand = jnp.concatenate([match_varying(p, me) for p in parts], 0)
    return jnp.take(cand, jnp.asarray(take)[me], axis=0)

  return jax.tree.map(
      lambda v: _on_stack(axis_name, move, v, batched_out=True), x)


def _plan_for(axis_name: VirtualAxes, groups):
  k = axis_name.per_device
  return virtual_plans.group_plan(
      tuple(tuple(int(w) for w in g) for g in groups), size(axis_name) // k, k)


def has_group_plan(axis_name: VirtualAxes, groups) -> bool:
  """True if :func:`group_mean` can realise ``groups`` (inside ``shard_map``)."""
  return _plan_for(axis_name, groups) is not None


def group_mean(x, axis_name: VirtualAxes, groups) -> jax.Array | None:
  """Mean of ``x`` over this worker's group, in two levels, or None.

  A device adds its members of each group (a gather along its stack);
  a group on several devices then exchanges those partial sums, one row
  per device per rotation (``|S| - 1`` ``ppermute`` for a group on ``|S|``
  devices), instead of every member's row. Returns None (use
  :func:`permute` terms instead) when a device holds members of two
  groups that span devices.

  Args:
    x: this worker's array (floating).
    axis_name: a :class:`VirtualAxes`.
    groups: the partition of ``0..n-1`` into groups (tuples of workers).

  Returns:
    ``(1/|G|) sum_{j in G} x_j`` (in ``x.dtype``; weights and sums in
    ``promote_types(x.dtype, float32)``), or None.

  Raises:
    ValueError: ``x`` not floating (a mean would be truncated).
  """
  if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    raise ValueError(
        f"collectives.group_mean: x has dtype {jnp.result_type(x)}; only "
        "floating-point arrays can be averaged in their own dtype.")
  k = axis_name.per_device
  dev = axis_name.device
  plan = _plan_for(axis_name, groups)
  if plan is None:
    return None
  local, rotations, rep, inside, weight = plan
  acc = jnp.promote_types(x.dtype, jnp.float32)

  def reduce(s):
    me = lax.axis_index(dev)
    s = s.astype(acc)
    cand = jnp.concatenate(
        [s, match_varying(jnp.zeros((1,) + s.shape[1:], acc), s)], 0)
    total = jnp.take(cand, jnp.asarray(local[0])[me], axis=0)
    for j in range(1, local.shape[0]):
      total = total + jnp.take(cand, jnp.asarray(local[j])[me], axis=0)
    if rotations:
      mask = jnp.asarray(inside)[me].reshape((k,) + (1,) * (s.ndim - 1))
      part = jnp.take(total, jnp.asarray(rep)[me], axis=0)
      extra = None
      for pairs in rotations:
        recv = lax.ppermute(part, dev, list(pairs))
        extra = recv if extra is None else extra + recv
      total = jnp.where(mask, total + extra[None], total)
    slots = me * k + jnp.arange(k)
    w = jnp.asarray(weight, acc)[slots].reshape((k,) + (1,) * (s.ndim - 1))
    return (total * w).astype(x.dtype)

  return _on_stack(axis_name, reduce, x, batched_out=True)
