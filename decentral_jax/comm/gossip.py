"""Gossip: applying a topology's mixing matrix to per-worker pytrees.

Every function here must be traced inside ``jax.shard_map`` over the worker
axis ``axis_name``, with exactly one worker per device along that axis: each
device holds its worker's arrays (no leading worker dimension). The worker
axis is either one mesh axis name (``"workers"``) or a pair
``("nodes", "local")``; with a pair, worker ``i`` is ``node * L + local`` and
node-aware rounds (intra-node means, two-node means, as in AER) are realised
hierarchically with ``pmean`` over ``"local"`` plus one ``ppermute`` over
``"nodes"``.

Buckets: with ``bucket_bytes > 0`` :func:`mix` does not send one collective
per leaf. Leaves of one dtype are flattened and concatenated, in tree
order, into buckets of at most ``bucket_bytes`` bytes (PyTorch DDP's
default ``bucket_cap_mb`` is 25 MB); each bucket is sent with one
collective per permute term and split back into the leaves. Every
operation of a round is elementwise in the leaf, so the result is bit for
bit that of one collective per leaf (``bucket_bytes=0``; see :func:`mix`).

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025, Sec. 3 (gossip ``x_i <- sum_j W_ij x_j``).
  Li et al., `PyTorch Distributed: Experiences on Accelerating Data Parallel
  Training <https://arxiv.org/abs/2006.15704>`_, VLDB 2020, Sec. 3.2.3
  (gradient bucketing in PyTorch DDP).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from decentral_jax import checks
from decentral_jax.scopes import PERIOD_SCOPE
from decentral_jax.comm import collectives
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.topology.rounds import Round

PyTree = Any
AxisName = collectives.AxisName

#: Default bucket size of :func:`mix` in bytes: 0, one collective per leaf.
#: On XLA:CPU (8 simulated devices, 148 leaves) 25 MiB buckets made a round
#: 2.5x slower (benchmarks/bench_bucketed_gossip.py); measure on GPUs.
DEFAULT_BUCKET_BYTES = 0


def _axes(axis_name: AxisName) -> tuple[str, ...]:
  return collectives.mesh_axes(axis_name)


_varying_axes = collectives.varying_axes
#: Re-exported: :func:`decentral_jax.comm.collectives.match_varying`.
match_varying = collectives.match_varying
_axis_size = collectives.size


def check_axis(topology: topology_lib.Topology, axis_name: AxisName) -> None:
  """Raises ``ValueError`` unless the worker axis has ``n_workers`` devices.

  Must be called inside ``shard_map`` (it reads the mesh axis sizes).
  """
  size = _axis_size(axis_name)  # ValueError naming a missing mesh axis
  if size != topology.n_workers:
    raise ValueError(
        f"topology {topology.name!r} has n_workers={topology.n_workers} but "
        f"the worker axis {axis_name!r} has {size} workers; build the "
        "topology for the mesh's number of workers.")
  axes = _axes(axis_name)
  if len(axes) == 2 and lax.axis_size(axes[1]) != topology.local_size \
      and topology.local_size > 1:
    raise ValueError(
        f"topology {topology.name!r} has local_size={topology.local_size} but "
        f"the mesh's local axis {axes[1]!r} has {lax.axis_size(axes[1])} "
        "devices; make the (nodes, local) mesh match workers per node.")


def check_topology(topology, name: str = "topology") -> None:
  """Raises ``ValueError`` unless ``topology`` is a :class:`~decentral_jax.topology.Topology`."""
  if not isinstance(topology, topology_lib.Topology):
    raise ValueError(f"{name} must be a decentral_jax.topology.Topology "
                     f"(e.g. topology.make('ring', n)), got "
                     f"{type(topology).__name__}.")


def check_float_leaves(tree, where: str, *, compressed: bool = False) -> None:
  """Raises ``ValueError`` naming the first leaf of ``tree`` that is not floating.

  Gossip and worker means average leaves; an integer or bool leaf (a step
  counter, a mask) cannot be averaged and must stay out of the tree.

  Args:
    tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``).
    where: the function, for the message (e.g. ``"gossip.mix"``).
    compressed: the leaves are to be sent compressed
      (:mod:`decentral_jax.comm.compress`): real floating leaves only,
      complex ones refused too.

  Raises:
    ValueError: a leaf that is not an array (a string, an object) or not
      of a floating dtype, naming the leaf's path.
  """
  kind = jnp.floating if compressed else jnp.inexact
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    try:  # a string would be read as a dtype name
      dtype = None if isinstance(x, (str, bytes)) else jnp.result_type(x)
    except TypeError:
      dtype = None
    if dtype is None:
      raise ValueError(f"{where}: leaf {jax.tree_util.keystr(path)!r} is a "
                       f"{type(x).__name__}, not an array; pass arrays of a "
                       "floating dtype.")
    if jnp.issubdtype(dtype, kind):
      continue
    rule = ("only floating-point leaves can be sent compressed." if compressed
            else "integer and bool leaves cannot be averaged, only "
            "floating-point ones (keep integer/bool state out of the averaged "
            "pytree).")
    raise ValueError(f"{where}: leaf {jax.tree_util.keystr(path)!r} has dtype "
                     f"{jnp.result_type(x)}; {rule}")


def _acc_dtype(x):
  """Dtype of weights and sums: float32 for 16-bit leaves, else the leaf's.

  In bfloat16, 1/3 rounds to 0.333984 and a row of three such weights sums
  to 1.00195, so the network average would drift every round; weights and
  the weighted sum are kept in float32 and rounded to the leaf dtype once.
  """
  return jnp.promote_types(x.dtype, jnp.float32)


def _bucket_groups(leaves, bucket_bytes, key=None) -> list[list[int]]:
  """Leaf indices in buckets: same dtype (and ``key``), at most ``bucket_bytes``.

  Leaves are taken in order within each group (dtype, varying mesh axes,
  ``key(leaf)``); a bucket is closed when the next leaf would take it past
  ``bucket_bytes`` (a larger leaf is a bucket of its own). ``bucket_bytes``
  0 or None gives one bucket per leaf.
  """
  if not bucket_bytes:
    return [[i] for i in range(len(leaves))]
  open_buckets: dict = {}  # group -> [indices, bytes] of its open bucket
  buckets = []
  for i, x in enumerate(leaves):
    group = (jnp.dtype(x.dtype), _varying_axes(x),
             None if key is None else key(x))
    size = x.size * jnp.dtype(x.dtype).itemsize
    cur = open_buckets.get(group)
    if cur is None or cur[1] + size > bucket_bytes:
      cur = open_buckets[group] = [[], 0]
      buckets.append(cur[0])
    cur[0].append(i)
    cur[1] += size
  return buckets


def _map_buckets(fn, leaves, bucket_bytes, key=None) -> list:
  """``fn(x, k)`` on each bucket of ``leaves``, split back into the leaves.

  A bucket of several leaves is their flattened concatenation (1-D), a
  bucket of one leaf the leaf itself; ``fn`` must act elementwise and keep
  the shape and dtype. ``k`` is ``key`` of the bucket's leaves (None
  without ``key``).
  """
  out = [None] * len(leaves)
  for idx in _bucket_groups(leaves, bucket_bytes, key):
    k = None if key is None else key(leaves[idx[0]])
    if len(idx) == 1:
      out[idx[0]] = fn(leaves[idx[0]], k)
      continue
    res = fn(jnp.concatenate([leaves[i].reshape(-1) for i in idx]), k)
    offset = 0
    for i in idx:
      x = leaves[i]
      out[i] = res[offset:offset + x.size].reshape(x.shape)
      offset += x.size
  return out


def _zero(index, dtype):
  """A zero XLA cannot fold away (a float from ``axis_index``, times 0).

  XLA:CPU and GPU contract ``a * b + c`` into FMAs. In ``w0 x + w1 r``
  either product may be contracted, and which one depends on the fused
  kernel (a leaf alone or a slice of a bucket); ``(0 + w0 x) + w1 r`` has
  one product per add, so every kernel rounds the same way. Exact: the
  zero is finite and adds nothing (``-0`` may come out as ``+0``).
  """
  return index.astype(dtype) * 0


def _mix_leaf_terms(x, rnd: Round, axis_name, me, comm_dtype):
  acc = _acc_dtype(x)
  send = x if comm_dtype is None else x.astype(comm_dtype)
  out = (_zero(me, acc) +
         jnp.asarray(rnd.self_weights, acc)[me] * x.astype(acc))
  for term in rnd.terms:
    recv = collectives.permute(send, axis_name, term.perm).astype(acc)
    out = out + jnp.asarray(term.weights, acc)[me] * recv
  return out.astype(x.dtype)


def _pmean(x, axis, comm_dtype):
  """Group mean; with ``comm_dtype`` the own term is kept in ``x.dtype``.

  Without ``comm_dtype`` the reduction runs in the leaf dtype (sending
  16-bit leaves as float32 would double the bytes). The mean ends in an add
  of :func:`_zero`: a bare ``psum * (1/n)`` could be contracted into a later
  add when unconditioned but not from inside ``lax.cond``
  (:func:`every`), so the two would round differently.
  """
  if comm_dtype is None:
    return mean(x, axis) + _zero(collectives.index(axis), x.dtype)
  acc = _acc_dtype(x)
  sent = x.astype(comm_dtype)
  size = _axis_size(axis)
  # Replace this worker's rounded contribution by its exact value (a
  # division by a power of 2 becomes a product: see _zero).
  out = ((collectives.pmean(sent, axis).astype(acc)
          + _zero(collectives.index(axis), acc))
         + (x.astype(acc) - sent.astype(acc)) / size)
  return out.astype(x.dtype)


def _mix_leaf_nodes(x, partners: Sequence[int], axes, comm_dtype,
                    whole: bool | None = None):
  """Node-aware round on a (nodes, local) mesh: node mean, then pair mean.

  Intra-node rounds are one ``pmean`` over the local axis. For two-node
  means the node mean is reduce-scattered over the ``L`` local devices, each
  device exchanges only its ``1/L`` shard with the same device of the
  partner node (so each node sends the parameters across its NIC once, not
  ``L`` times), and the averaged shards are all-gathered within the node.
  With ``whole`` (default: ``x.size < L``; buckets of small leaves pass
  True) the whole node mean is exchanged instead.
  """
  node_axis, local_axis = axes
  pairs = [(v, p) for v, p in enumerate(partners) if p >= 0]
  if not pairs:
    return _pmean(x, local_axis, comm_dtype)
  paired = jnp.asarray([p >= 0 for p in partners])[lax.axis_index(node_axis)]
  big_l = lax.axis_size(local_axis)
  wire = x.dtype if comm_dtype is None else comm_dtype
  acc = _acc_dtype(x)
  if (x.size < big_l) if whole is None else whole:
    # Too small to shard: exchange the whole node mean.
    x_node = _pmean(x, local_axis, comm_dtype)
    recv = lax.ppermute(x_node.astype(wire), node_axis, pairs).astype(acc)
    x_node = x_node.astype(acc)
    return jnp.where(paired, 0.5 * (x_node + recv), x_node).astype(x.dtype)
  flat = x.reshape(-1)
  pad = (-flat.size) % big_l
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  shard = lax.psum_scatter(flat.astype(wire), local_axis, tiled=True)
  shard = shard.astype(acc) / big_l  # this device's slice of the node mean
  recv = lax.ppermute(shard.astype(wire), node_axis, pairs).astype(acc)
  shard = jnp.where(paired, 0.5 * (shard + recv), shard)
  full = lax.all_gather(shard.astype(wire), local_axis, tiled=True)
  return full[:x.size].astype(x.dtype).reshape(x.shape)


def _mix_round(tree: PyTree, rnd: Round, topology, axis_name,
               comm_dtype, bucket_bytes) -> PyTree:
  axes = _axes(axis_name)
  if rnd.is_identity:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  key = None
  if rnd.is_global_mean:
    fn = lambda x, _: _pmean(x, axis_name, comm_dtype)
  else:
    partners = (rnd.node_partners(topology.local_size)
                if len(axes) == 2 and not collectives.is_virtual(axis_name)
                else None)
    if partners is not None and topology.local_size > 1:
      if any(p >= 0 for p in partners):
        big_l = lax.axis_size(axes[1])
        key = lambda x: x.size < big_l  # exchanged whole, not sharded
      fn = lambda x, k: _mix_leaf_nodes(x, partners, axes, comm_dtype, k)
    elif (collectives.is_virtual(axis_name) and rnd.groups is not None
          and comm_dtype is None
          and collectives.has_group_plan(axis_name, rnd.groups)):
      # Several workers per device: partial sums per device, then one
      # exchange per device pair, instead of one row per group member.
      fn = lambda x, _: collectives.group_mean(x, axis_name, rnd.groups)
    else:
      me = collectives.index(axis_name)
      fn = lambda x, _: _mix_leaf_terms(x, rnd, axis_name, me, comm_dtype)
  out = _map_buckets(fn, leaves, bucket_bytes, key)
  return treedef.unflatten([match_varying(y, x) for y, x in zip(out, leaves)])


def check_bucket_bytes(bucket_bytes) -> int:
  """The gossip bucket size in bytes: None -> :data:`DEFAULT_BUCKET_BYTES`.

  Gossip sends same-dtype parameter leaves in buckets of at most this many
  bytes, one collective per bucket and permute term (:func:`mix`, after
  PyTorch DDP's gradient buckets, Li et al., VLDB 2020); 0 sends one
  collective per leaf. The transforms of :mod:`decentral_jax.optim` default
  to None rather than the number so that ``optax.inject_hyperparams`` does
  not turn it into a traced hyperparameter (pass an explicit value in
  ``static_args``).

  Returns:
    ``bucket_bytes`` as a Python int.

  Raises:
    ValueError: not None or an integer >= 0 (a float, a bool, or an array:
      what ``optax.inject_hyperparams`` makes of an int not in
      ``static_args``).
  """
  if bucket_bytes is None:
    return DEFAULT_BUCKET_BYTES
  return checks.check_int("bucket_bytes", bucket_bytes, minimum=0)


def mix(tree: PyTree, topology: topology_lib.Topology, step,
        axis_name: AxisName = "workers", *, comm_dtype=None,
        column_stochastic: bool = False,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES) -> PyTree:
  """Applies ``W_step`` of ``topology`` to a pytree of per-worker arrays.

  Computes ``x_i <- sum_j W_step[i, j] x_j`` for every leaf, where ``x_j`` is
  worker ``j``'s value of that leaf. Off-diagonal entries are realised with
  ``lax.ppermute`` (one per :class:`~decentral_jax.topology.PermuteTerm`),
  ``W = J`` with ``lax.pmean``, and, when ``axis_name`` is a ``(nodes,
  local)`` pair, node-aligned group means with ``pmean`` over ``local`` plus
  one ``ppermute`` over ``nodes``.

  Leaves are sent in buckets, as PyTorch DDP buckets gradients (Li et al.,
  "PyTorch Distributed", VLDB 2020): leaves of one dtype are flattened and
  concatenated in tree order into 1-D buckets of at most ``bucket_bytes``
  bytes (counted in the leaves' own dtype; a larger leaf is a bucket of its
  own, leaves are never split), each bucket is mixed with one collective
  per permute term (or one ``pmean``), and the result is split back into
  the leaves' shapes. In node-aware two-node rounds, leaves with fewer
  than ``L`` elements (exchanged whole rather than sharded) are bucketed
  apart from the others. Every operation of a round acts elementwise, and
  weighted sums are written so that XLA's FMA contraction rounds them the
  same way in any kernel (``0 + w_ii x_i`` first, then one product per
  add), so the result is bit-identical to ``bucket_bytes=0``: tested on
  XLA:CPU for every topology; on GPUs an all-reduce's summation order may
  depend on the buffer's size, which could change the last bit of
  ``pmean`` rounds. Buckets cost a copy of the parameters into and out of
  them per round.

  Args:
    tree: pytree of arrays (any shape/dtype, float), worker-local values.
    topology: a :class:`~decentral_jax.topology.Topology` with ``n_workers``
      equal to the size of the worker axis.
    step: Python ``int`` (only that round is compiled) or a traced integer
      scalar (the round is chosen with ``lax.switch`` on ``step % period``
      among the distinct rounds, so a time-varying schedule compiles once).
      A traced ``step`` must be equal on all workers.
    axis_name: worker mesh axis name, or ``(node_axis, local_axis)``.
    comm_dtype: optional floating dtype of 16 bits or more (e.g.
      ``jnp.bfloat16``) in which values are sent; each worker's own term
      stays exact (for ``pmean`` rounds the mean is reduced in
      ``comm_dtype`` and the own term corrected afterwards; in node-aware
      two-node rounds the node mean is exchanged in ``comm_dtype``). A
      value beyond its range is sent as +-inf (float16: 65504), as any
      cast; so is a sum reduced in ``comm_dtype`` (a float16 ``pmean`` of
      ``n`` values above ``65504 / n``): visible, never a finite value. Weights and weighted sums are formed in
      the leaf dtype, or float32 for 16-bit leaves, so that weights such as
      1/3 stay exact and the network average is preserved; the result is
      rounded to the leaf dtype once per round.
    column_stochastic: accept a topology that is only column stochastic
      (``topology.doubly_stochastic`` False), as push-sum does
      (:mod:`decentral_jax.optim.push_sum`); plain gossip with one does not
      converge to the average, so it is refused otherwise.
    bucket_bytes: largest bucket in bytes (default
      :data:`DEFAULT_BUCKET_BYTES`, 0); 0 or None sends one collective
      per leaf.

  Returns:
    A pytree with the structure, shapes and dtypes of ``tree``.

  Raises:
    ValueError: ``topology`` not a Topology, called outside ``shard_map``
      over ``axis_name``, the axis size differs from ``topology.n_workers``,
      a non-floating leaf, a non-floating ``comm_dtype``, ``bucket_bytes``
      not None or an integer >= 0, a ``step`` that is not an int or an
      integer scalar (:func:`check_step`), or a topology that is not
      doubly stochastic without ``column_stochastic=True``.
  """
  check_topology(topology)
  if not checks.check_bool("column_stochastic", column_stochastic) and \
      not topology.doubly_stochastic:
    raise ValueError(
        f"topology {topology.name!r} is column stochastic but not doubly "
        "stochastic: plain gossip with it drives the workers to unequal "
        "multiples of the average (its Perron vector), not to the average; "
        "use it with decentral_jax.optim.push_sum.push_sum (SGP), whose weights "
        "correct this.")
  check_float_leaves(tree, "gossip.mix")
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = 0 if bucket_bytes is None else check_bucket_bytes(
      bucket_bytes)
  check_step(step)
  if topology.n_workers == 1:
    collectives.check_axis_name(axis_name)
    try:  # a one-worker topology on a larger mesh would silently not mix
      size = _axis_size(axis_name)
    except ValueError:
      return tree  # not inside shard_map: nothing to communicate
    if size != 1:
      check_axis(topology, axis_name)
    return tree
  check_axis(topology, axis_name)
  return map_round(
      lambda rnd, t: _mix_round(t, rnd, topology, axis_name, comm_dtype,
                                bucket_bytes), topology, step, tree)


def check_step(step) -> None:
  """Raises ValueError unless ``step`` (a round index) is a Python or NumPy
  int, or an integer scalar array, possibly traced (not a bool, a string,
  None, a float or a non-scalar array)."""
  if checks.is_int(step):
    return
  if isinstance(step, (np.ndarray, jax.Array)):
    if jnp.issubdtype(step.dtype, jnp.integer) and step.ndim == 0:
      return
    got = f"a {step.dtype} array of shape {tuple(step.shape)}"
  else:
    got = repr(step)
  raise ValueError(
      f"step must be an int or a traced integer scalar, got {got}; pass the "
      "round index, e.g. 0 or jnp.int32(k).")


def map_round(fn, topology: topology_lib.Topology, step, *operands):
  """``fn(round, *operands)`` for the round of ``step``: static or ``lax.switch``.

  A Python ``int`` step (or a topology with one distinct round) traces only
  that round; a traced step chooses among the distinct rounds with
  ``lax.switch`` on ``step % period`` (one compile for a time-varying
  schedule). Used by :func:`mix` and the compressed gossip of
  :mod:`decentral_jax.comm.compress`.

  Args:
    fn: ``(Round, *operands) -> pytree``.
    topology: the schedule.
    step: Python int, or a traced integer scalar equal on all workers.

  Raises:
    ValueError: ``step`` neither an int nor an integer scalar.
  """
  check_step(step)
  if checks.is_int(step):
    return fn(topology.round(int(step)), *operands)
  if len(topology.distinct_rounds) == 1:
    return fn(topology.distinct_rounds[0], *operands)
  step = jnp.asarray(step)
  table = jnp.asarray(topology.round_to_distinct, jnp.int32)
  index = collectives.uniform(table[step.astype(jnp.int32) % topology.period])
  branches = [lambda *ops, r=r: fn(r, *ops) for r in topology.distinct_rounds]
  return lax.switch(index, branches, *operands)


def mean(tree: PyTree, axis_name: AxisName = "workers", *,
         varying: bool = True, bucket_bytes: int | None = None) -> PyTree:
  """Exact average over all workers: ``x_bar = (1/n) sum_i x_i`` (``pmean``).

  The one place the library forms an exact worker mean (All-Reduce of
  gradients, periodic global averaging, evaluation of the averaged model,
  consensus distance, ``W = J`` rounds without ``comm_dtype``). Must be
  traced inside ``jax.shard_map`` over ``axis_name``.

  Args:
    tree: pytree of worker-local arrays (any shape and dtype).
    axis_name: worker mesh axis, or ``("nodes", "local")``.
    varying: keep each leaf's varying-axes type (see :func:`match_varying`),
      so the mean can replace per-worker state (parameters, gradients);
      False gives ``pmean``'s invariant type (a metric equal everywhere).
    bucket_bytes: if > 0, one ``pmean`` per bucket of at most this many
      bytes of same-dtype leaves, as in :func:`mix` (bit-identical on
      XLA:CPU); default None: one ``pmean`` per leaf (XLA's all-reduce
      combiner may merge them anyway).

  Returns:
    A pytree of the same structure, shapes and dtypes, equal on every
    worker.

  Raises:
    ValueError: ``bucket_bytes`` not None or an integer >= 0.
  """
  bucket_bytes = 0 if bucket_bytes is None else check_bucket_bytes(
      bucket_bytes)
  cast = match_varying if varying else (lambda y, x: y)
  if not bucket_bytes:  # leaves may be Python scalars here
    return jax.tree.map(
        lambda x: cast(collectives.pmean(x, axis_name), x), tree)
  leaves, treedef = jax.tree.flatten(tree)
  out = _map_buckets(lambda b, _: collectives.pmean(b, axis_name), leaves,
                     bucket_bytes)
  return treedef.unflatten([cast(y, x) for y, x in zip(out, leaves)])


def every(period, taken, true_fn, false_fn, *operands):
  """``lax.cond(taken, true_fn, false_fn, *operands)`` for a periodic event.

  Use it for communication that happens on one step out of every
  ``period`` (a DiLoCo sync, a gossip round every ``tau`` steps): the
  conditional is traced under the name scope ``comm_every_<period>``, which
  the HLO accounting (:func:`decentral_jax.analysis.communication`) reads to
  weigh the taken branch by ``1 / period`` and the other by ``1 - 1 /
  period`` when it averages bytes over a sync period. Values are exactly
  those of ``lax.cond``.

  Args:
    period: steps between two taken branches, a Python int >= 1; anything
      else (e.g. a traced value) gives a plain unmarked ``lax.cond``.
    taken: boolean scalar, True on the steps that communicate.
    true_fn, false_fn, operands: as for ``lax.cond``.

  Returns:
    What the chosen branch returns.
  """
  taken = collectives.uniform(taken)  # equal on all workers
  # Fresh branch functions: lax.cond caches a branch's trace by function,
  # and a trace under the vmap over a device's workers holds that trace's
  # worker slot (collectives.virtual_slot), which must not leak into
  # another trace of the same function (a later jit, a fori_loop body).
  true_fn, false_fn = _fresh(true_fn), _fresh(false_fn)
  if checks.is_int(period) and period >= 1:
    with jax.named_scope(f"{PERIOD_SCOPE}{int(period)}"):
      return lax.cond(taken, true_fn, false_fn, *operands)
  return lax.cond(taken, true_fn, false_fn, *operands)


def _fresh(fn):
  return lambda *args: fn(*args)


def consensus_distance(tree: PyTree, axis_name: AxisName = "workers"):
  """``(1/n) sum_i ||x_i - x_bar||^2``, summed over all leaves.

  Args:
    tree: pytree of per-worker float arrays.
    axis_name: worker mesh axis (or axes).

  Returns:
    A float32 scalar (float64 if the leaves are), equal on all workers.
    Its floor is the rounding of ``x_bar`` (one All-Reduce mean in the
    leaves' dtype): workers holding identical values give up to about
    ``eps^2 * (1/n) sum_i ||x_i||^2`` (eps = 2^-23 in float32, ~1e-14
    relative), not exactly 0; e.g. an all_reduce run of gpt_tiny logs
    ~3e-17. Exactness would cost a second full-parameter collective.
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  dtype = jnp.result_type(jnp.float32, *[x.dtype for x in leaves])
  total = jnp.zeros((), dtype)
  for x in leaves:
    x = x.astype(dtype)
    total = total + jnp.sum(jnp.square(x - mean(x, axis_name)))
  return mean(total, axis_name, varying=False)
