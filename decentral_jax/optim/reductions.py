"""Reductions of the pseudo-gradient: the strategies DiLoCo's sync injects.

A reduction says what each worker sends at a sync and how the group's
pseudo-gradient ``Delta`` is formed from it:

* :class:`ExactMean`: the parameters ``x_i`` are sent (in the float32
  ``theta`` dtype), ``Delta = theta - (1/n) sum_j x_j`` (one all-reduce).
* :class:`LowPrecisionMean`: the pseudo-gradients ``theta - x_i`` are sent
  in a narrow ``comm_dtype`` and summed in float32: ``Delta = c(sum_j
  c(theta - x_j) / n)`` with ``c`` the rounding to ``comm_dtype`` (an
  all-to-all of ``1/n`` chunks and an all-gather: the bytes of an
  all-reduce in ``comm_dtype``).
* :class:`CompressedMean`: ``Q(beta e_i + theta - x_i)`` is sent, with
  optional error feedback ``e_i``; scaled formats are reduce-scattered and
  re-quantized (the leaves concatenated into padded buckets), ``topk`` is
  gathered (SparseLoCo's aggregation); see
  :func:`compressed_pseudo_gradient`. Its state is :class:`ErrorFeedback`.
* :class:`GossipRound`: decentralized DiLoCo's ``k``-th gossip round,
  ``Delta_i = theta_i - sum_j W_k[i, j] x_j`` (``theta_i`` per worker).

Every reduction (a :class:`Reduction`) has ``init(theta)`` (its state: ``()`` or
:class:`ErrorFeedback`), ``send(theta, x, state) -> (sent, state)`` (no
communication), ``delta(theta, sent, k)`` (the communication: ``Delta``
like ``theta``), ``reduce(a, j)`` (the reduction of one array of
pseudo-gradients of sync ``j``, used by the delayed and eager timings of
:mod:`decentral_jax.optim.outer_timing`) and ``own_weight(j, dtype)`` (the
weight of a worker's own term in it). Streaming DiLoCo sends a fragment
with ``send`` and merges it with ``delta`` ``tau`` steps later.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import compress
from decentral_jax.comm import compressed_mean as comm_means
from decentral_jax.comm import gossip
from decentral_jax.optim import local_steps
from decentral_jax.topology import schedules as topology_lib

PyTree = Any

#: Largest buffer (in float32 bytes, as the scaled formats quantize) into
#: which the compressed sync concatenates the pseudo-gradient's leaves, as
#: PyTorch DDP buckets gradients (its default ``bucket_cap_mb``, 25 MB).
#: Each buffer is padded once to a multiple of ``n x block``.
COMPRESSED_BUCKET_BYTES = 25 * 2 ** 20


def _pseudo(theta, x):
  """``theta - x`` in the theta dtypes."""
  return jax.tree.map(lambda t, a: t - a.astype(t.dtype), theta, x)


class Reduction:
  """Base of the reductions (module docstring for the methods).

  ``sends_parameters``: whether ``send`` gives the parameters (else the
  pseudo-gradients); ``one_round``: whether ``reduce`` has no conditional
  around its collectives (so that a timing may trickle it).
  """
  sends_parameters = True
  one_round = True

  def __init__(self, axis_name: gossip.AxisName = "workers"):
    self.axis_name = collectives.check_axis_name(
        axis_name, f"{type(self).__name__}: ")

  def __repr__(self):
    return f"{type(self).__name__}(axis_name={self.axis_name!r})"

  def init(self, theta: PyTree):
    """The reduction's state: ``()`` (none)."""
    del theta
    return ()

  def send(self, theta, x, state):
    """``(x in the theta dtypes, state)``."""
    return jax.tree.map(lambda a, t: a.astype(t.dtype), x, theta), state

  def delta(self, theta, sent, k):
    raise NotImplementedError

  def mean(self, tree):
    raise ValueError(f"{type(self).__name__} has no mean of parameters; "
                     "Local SGD needs ExactMean or LowPrecisionMean (a "
                     "CompressedMean runs it as DiLoCo with outer sgd(1.0)).")

  def reduce(self, a, j):
    raise NotImplementedError

  def own_weight(self, j, dtype):
    """``1/n``, the weight of a worker's own term in the mean."""
    del j
    return jnp.asarray(1.0 / collectives.size(self.axis_name), dtype)


class ExactMean(Reduction):
  """The exact worker mean (``pmean``) of the parameters: plain DiLoCo.

  Args:
    axis_name: worker mesh axis (or ``("nodes", "local")``).
  """

  def delta(self, theta, sent, k):
    """``theta - (1/n) sum_j sent_j``."""
    del k
    return jax.tree.map(lambda t, m: t - m, theta,
                        gossip.mean(sent, self.axis_name))

  def mean(self, tree):
    """The worker mean of ``tree`` in its own dtypes (Local SGD's average)."""
    return gossip.mean(tree, self.axis_name)

  def reduce(self, a, j):
    del j
    return gossip.mean(a, self.axis_name)


class LowPrecisionMean(Reduction):
  """The worker mean with ``comm_dtype`` on the wire, summed in float32.

  Args:
    comm_dtype: a floating dtype of 16 bits or more (e.g.
      ``jnp.bfloat16``); a value beyond its range is sent as +-inf
      (float16: 65504), as any cast.
    axis_name: worker mesh axis (or ``("nodes", "local")``).

  Raises:
    ValueError: ``comm_dtype`` not a floating dtype of 16 bits or more.
  """
  sends_parameters = False

  def __init__(self, comm_dtype, axis_name: gossip.AxisName = "workers"):
    super().__init__(axis_name)
    self.comm_dtype = checks.check_comm_dtype(comm_dtype)
    if self.comm_dtype is None:
      raise ValueError("comm_dtype=None: LowPrecisionMean needs a floating "
                       "dtype (use ExactMean for the exact mean).")

  def send(self, theta, x, state):
    """``(theta - x, state)``: the pseudo-gradient is sent."""
    return _pseudo(theta, x), state

  def delta(self, theta, sent, k):
    del theta, k
    leaves, treedef = jax.tree.flatten(sent)
    return treedef.unflatten(
        mean_low_precision(leaves, self.comm_dtype, self.axis_name))

  def mean(self, tree):
    leaves, treedef = jax.tree.flatten(tree)
    means = mean_low_precision(leaves, self.comm_dtype, self.axis_name)
    return treedef.unflatten([m.astype(a.dtype)
                              for m, a in zip(means, leaves)])

  def reduce(self, a, j):
    del j
    return mean_low_precision([a], self.comm_dtype, self.axis_name)[0]


class GossipRound(Reduction):
  """Decentralized DiLoCo: the ``k``-th gossip round over ``topology``.

  ``Delta_i = theta_i - sum_j W_k[i, j] x_j`` with ``k`` the outer steps so
  far; ``theta_i`` and the outer state are per worker. With ``comm_dtype``
  the parameters are gossiped in that dtype (each worker's own term exact,
  weighted sums in float32; :func:`decentral_jax.comm.gossip.mix`); on
  ``complete`` it is DiLoCo.

  Args:
    topology: a doubly stochastic gossip schedule.
    axis_name: worker mesh axis (or ``("nodes", "local")``).
    comm_dtype: optional floating dtype on the wire (None: exact).
    bucket_bytes: largest gossip bucket in bytes (None: the default, one
      collective per leaf; see
      :func:`decentral_jax.comm.gossip.check_bucket_bytes`).

  Raises:
    ValueError: ``topology`` not a Topology, a bad ``comm_dtype`` or
      ``bucket_bytes``.
  """

  def __init__(self, topology: topology_lib.Topology,
               axis_name: gossip.AxisName = "workers", *, comm_dtype=None,
               bucket_bytes: int | None = None):
    super().__init__(axis_name)
    gossip.check_topology(topology)
    self.topology = topology
    self.comm_dtype = checks.check_comm_dtype(comm_dtype)
    self.bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)
    self.one_round = len(topology.distinct_rounds) == 1
    self._self_weights = np.array(
        [r.self_weights for r in topology.rounds], np.float64)

  def delta(self, theta, sent, k):
    mixed = gossip.mix(sent, self.topology, k, self.axis_name,
                       comm_dtype=self.comm_dtype,
                       bucket_bytes=self.bucket_bytes)
    return jax.tree.map(lambda t, m: t - m, theta, mixed)

  def reduce(self, a, j):
    return gossip.mix(a, self.topology, j, self.axis_name,
                      comm_dtype=self.comm_dtype)

  def own_weight(self, j, dtype):
    """``W_j[m, m]`` of this worker ``m``."""
    me = collectives.index(self.axis_name)
    table = self._self_weights
    return jnp.asarray(table, dtype)[jnp.asarray(j) % table.shape[0], me]


# --------------------------------------------------------------------------
# Compressed pseudo-gradients with error feedback.
# --------------------------------------------------------------------------


class ErrorFeedback(NamedTuple):
  """State of :class:`CompressedMean` with error feedback: the residuals."""
  error: PyTree  # e_i like theta (per worker).


class Coding(NamedTuple):
  """How pseudo-gradients are sent: see :func:`check_compression`."""
  compressor: compress.Compressor
  error_feedback: bool
  error_decay: float

  def feedback(self, v: PyTree, error: PyTree) -> tuple[PyTree, PyTree]:
    """``(target, new_error)``: ``target = beta e + v``, the new residual
    ``target - deQ(Q(target))`` (``Q`` on the blocks that are sent: per
    leaf for ``topk``, per bucket of :func:`map_flat_buckets` for the
    scaled formats); without error feedback ``(v, error)``."""
    if not self.error_feedback:
      return v, error
    target = jax.tree.map(lambda a, e: self.error_decay * e + a, v, error)
    leaves, treedef = jax.tree.flatten(target)
    if self.compressor.format == "topk":  # sent per leaf
      sent = [self.compressor.roundtrip(t) for t in leaves]
    else:  # sent per bucket: the blocks of compressed_mean
      sent = map_flat_buckets(self.compressor.roundtrip, leaves)
    return target, treedef.unflatten([t - q for t, q in zip(leaves, sent)])

  def init_error(self, theta: PyTree) -> PyTree:
    """Zero residuals like ``theta`` (``()`` without error feedback)."""
    return optax.tree.zeros_like(theta) if self.error_feedback else ()


def check_compression(compressor, error_feedback, error_decay
                      ) -> Coding | None:
  """Validates the compression arguments of the local-update methods.

  Returns:
    None for no compressor or the identity (``format="none"``, the
    uncompressed method bit for bit: its residual would stay exactly zero),
    else the :class:`Coding`.

  Raises:
    ValueError: ``compressor`` not None or a
      :class:`~decentral_jax.comm.compress.Compressor`, ``error_feedback``
      not a bool, or True without a compressor, ``error_decay`` outside
      (0, 1] or below 1 without ``error_feedback``.
  """
  if not isinstance(error_feedback, (bool, np.bool_)):
    raise ValueError(f"error_feedback must be True or False, got "
                     f"{error_feedback!r}.")
  decay = checks.check_float("error_decay", error_decay, minimum=0.0,
                             maximum=1.0, open_min=True)
  if decay != 1.0 and not error_feedback:
    raise ValueError(f"error_decay={error_decay!r} decays the error-feedback "
                     "residual, which error_feedback=False does not keep; "
                     "set error_feedback=True or leave error_decay=1.0.")
  if compressor is None:
    if error_feedback:
      raise ValueError("error_feedback=True needs a compressor (the residual "
                       "of what? pass compressor=Compressor('int8'), ...).")
    return None
  compress.check_compressor(compressor)
  if compressor.is_identity:
    return None
  return Coding(compressor, bool(error_feedback), decay)


def flat_buckets(sizes: Sequence[int], bucket_bytes: int | None = None
                 ) -> list[list[int]]:
  """Leaf indices in buckets of at most ``bucket_bytes`` float32 bytes.

  Leaves are taken in order (any dtype: each is sent as float32); a bucket
  is closed when the next leaf would take it past ``bucket_bytes``
  (None: :data:`COMPRESSED_BUCKET_BYTES`, read at the call), and a larger
  leaf is a bucket of its own. ``sizes``: each leaf's element count.
  """
  if bucket_bytes is None:
    bucket_bytes = COMPRESSED_BUCKET_BYTES
  buckets, used = [], 0
  for i, size in enumerate(sizes):
    if not buckets or used + 4 * size > bucket_bytes:
      buckets.append([])
      used = 0
    buckets[-1].append(i)
    used += 4 * size
  return buckets


def map_flat_buckets(fn, leaves: Sequence[jax.Array],
                     bucket_bytes: int | None = None) -> list:
  """``fn`` on one flat float32 buffer per bucket, split back into leaves.

  Each bucket (:func:`flat_buckets`) is its leaves flattened, cast to
  float32 and concatenated in order; ``fn`` maps the 1-D buffer to one of
  the same size, which is split and cast back to each leaf's shape and
  dtype. So a compressed sync pads each bucket once (to a multiple of ``n
  x block``) instead of every leaf, and a quantization block may span two
  leaves.
  """
  out = [None] * len(leaves)
  for idx in flat_buckets([int(np.size(x)) for x in leaves], bucket_bytes):
    res = fn(jnp.concatenate(
        [compress.to_float32(jnp.reshape(leaves[i], -1)) for i in idx]))
    offset = 0
    for i in idx:
      x = leaves[i]
      y = res[offset:offset + x.size].reshape(x.shape).astype(x.dtype)
      out[i] = collectives.match_varying(y, x)
      offset += x.size
  return out


def compressed_mean(leaves: Sequence[jax.Array],
                    compressor: compress.Compressor,
                    axis_name) -> list[jax.Array]:
  """The worker mean of ``leaves`` sent with ``compressor``.

  ``topk``: every worker's indices and values are all-gathered per leaf and
  the decoded sparse vectors summed in float32 (SparseLoCo's aggregation,
  :func:`~decentral_jax.comm.compressed_mean.gather_mean_compressed`,
  ``(n - 1) x payload`` bytes per worker). Scaled formats: the leaves are concatenated
  into float32 buckets of at most :data:`COMPRESSED_BUCKET_BYTES`
  (:func:`map_flat_buckets`), each padded once to a multiple of ``n x
  block`` (per leaf, gpt_tiny's 22,624 values would send as 30,720), then a
  reduce-scatter of the codes, float32 sums and an all-gather of the
  re-quantized mean
  (:func:`~decentral_jax.comm.compressed_mean.mean_compressed`, ``2 (n -
  1) / n x payload`` of each padded bucket:
  :func:`compressed_mean_bytes`). Equal on every worker.
  """
  if compressor.format == "topk":
    return comm_means.gather_mean_compressed(list(leaves), axis_name,
                                             compressor=compressor)
  compress.check_compressor(compressor)
  gossip.check_float_leaves(list(leaves), "compressed mean", compressed=True)
  return map_flat_buckets(
      lambda b: comm_means.mean_compressed(b, axis_name, compressor=compressor),
      leaves)


def compressed_mean_bytes(tree: PyTree, n_workers: int,
                          compressor: compress.Compressor) -> float:
  """Hand count: bytes one worker sends in :func:`compressed_mean` of ``tree``.

  Top-k: :func:`~decentral_jax.comm.compressed_mean.gather_payload_bytes`;
  scaled formats:
  :func:`~decentral_jax.comm.compressed_mean.mean_payload_bytes` of each
  bucket's flat buffer.

  Raises:
    ValueError: ``n_workers`` not an int >= 1, or ``compressor`` not a
      :class:`~decentral_jax.comm.compress.Compressor`.
  """
  leaves = jax.tree.leaves(tree)
  if isinstance(compressor, compress.Compressor) and \
      compressor.format == "topk":
    return comm_means.gather_payload_bytes(leaves, n_workers, compressor)
  sizes = [int(np.prod(np.shape(x))) for x in leaves]
  buffers = [jax.ShapeDtypeStruct((sum(sizes[i] for i in idx),), jnp.float32)
             for idx in flat_buckets(sizes)]
  return comm_means.mean_payload_bytes(buffers, n_workers, compressor)


def compressed_pseudo_gradient(coding: Coding, v: PyTree, error: PyTree,
                               axis_name) -> tuple[PyTree, PyTree]:
  r"""``(Delta, new_error)`` of this worker's pseudo-gradient ``v``.

  .. math::
    u_i = \beta e_i + v_i, \quad
    \Delta = \mathrm{mean}_j\, \mathrm{deQ}(Q(u_j)), \quad
    e_i \leftarrow u_i - \mathrm{deQ}(Q(u_i))

  (``u_i = v_i`` and no residual without error feedback; ``beta`` =
  ``coding.error_decay``; the mean by :func:`compressed_mean`, which for
  the scaled formats re-quantizes the mean once more). With ``beta = 1``
  the sum of what a worker sent over its syncs differs from the sum of its
  pseudo-gradients by exactly its residual (Karimireddy et al. 2019); with
  ``beta < 1`` and top-k it is SparseLoCo's error-feedback accumulator
  (Sarfi et al., arXiv 2508.15706, Alg. 1).
  """
  target, error = coding.feedback(v, error)
  leaves, treedef = jax.tree.flatten(target)
  return treedef.unflatten(
      compressed_mean(leaves, coding.compressor, axis_name)), error


class CompressedMean(Reduction):
  """The mean of compressed pseudo-gradients, with optional error feedback.

  Each worker sends ``Q(beta e_i + theta - x_i)`` (see
  :func:`compressed_pseudo_gradient`); ``topk`` is gathered per leaf, the
  scaled formats reduce-scattered as one padded float32 buffer per bucket
  (:func:`compressed_mean`; the error-feedback residual uses the same
  blocks). Build it with :func:`compressed`, which gives
  :class:`ExactMean` for no compressor or the identity.

  Args:
    coding: the checked compression (:func:`check_compression`).
    axis_name: worker mesh axis.
  """
  sends_parameters = False

  def __init__(self, coding: Coding, axis_name: gossip.AxisName = "workers"):
    super().__init__(axis_name)
    self.coding = coding

  def init(self, theta):
    """:class:`ErrorFeedback` of zeros with error feedback, else ``()``."""
    if not self.coding.error_feedback:
      return ()
    return ErrorFeedback(optax.tree.zeros_like(theta))

  def send(self, theta, x, state):
    """``(beta e + theta - x, state with the new residual)``."""
    v = _pseudo(theta, x)
    if not self.coding.error_feedback:
      return v, state
    target, error = self.coding.feedback(v, state.error)
    return target, ErrorFeedback(error)

  def delta(self, theta, sent, k):
    del theta, k
    leaves, treedef = jax.tree.flatten(sent)
    return treedef.unflatten(
        compressed_mean(leaves, self.coding.compressor, self.axis_name))

  def reduce(self, a, j):
    raise ValueError("CompressedMean has no delayed or eager form: the "
                     "overlapped outer step reduces exactly; use timing "
                     "Plain() or an uncompressed reduction.")


def compressed(compressor: compress.Compressor | None,
               error_feedback: bool = False, error_decay: float = 1.0,
               axis_name: gossip.AxisName = "workers") -> Reduction:
  """The reduction that sends pseudo-gradients with ``compressor``.

  Args:
    compressor: a :class:`~decentral_jax.comm.compress.Compressor`, or None.
    error_feedback: keep each worker's compression residual and add it to
      its next pseudo-gradient (needs a compressor that is not the
      identity).
    error_decay: ``beta`` in (0, 1] of the residual (SparseLoCo's 0.95; 1:
      classic error feedback).
    axis_name: worker mesh axis.

  Returns:
    :class:`CompressedMean`, or :class:`ExactMean` for None or the identity
    compressor (``format="none"``: the uncompressed method bit for bit).

  Raises:
    ValueError: see :func:`check_compression`.
  """
  coding = check_compression(compressor, error_feedback, error_decay)
  if coding is None:
    return ExactMean(axis_name)
  return CompressedMean(coding, axis_name)


def mean_low_precision(leaves: Sequence[jax.Array], comm_dtype,
                       axis_name) -> list[jax.Array]:
  """Mean over workers with ``comm_dtype`` on the wire, summed in float32.

  A reduce-scatter written as an all-to-all of ``1/n`` chunks (each worker
  sums its chunk of everyone's values in the accumulation dtype), then an
  all-gather of the averaged chunks in ``comm_dtype``. Returns the means in
  float32 (float64 for float64 leaves), equal on every worker.
  """
  n = collectives.size(axis_name)
  out = []
  for x in leaves:
    acc = local_steps.global_dtype(x)
    flat = x.reshape(-1)
    pad = (-flat.size) % n
    if pad:
      flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    chunks = flat.astype(comm_dtype).reshape(n, -1)
    mine = collectives.all_to_all(chunks, axis_name)
    part = jnp.sum(mine.astype(acc), axis=0) / n
    full = collectives.all_gather(part.astype(comm_dtype),
                                  axis_name).reshape(-1)
    full = full[:x.size].astype(acc).reshape(x.shape)
    out.append(gossip.match_varying(full, x))
  return out


def uncompressed(*, topology: topology_lib.Topology | None = None,
                 comm_dtype=None, axis_name: gossip.AxisName = "workers",
                 bucket_bytes: int | None = None) -> Reduction:
  """The uncompressed reduction of a setting: :class:`GossipRound` with a
  topology, else :class:`LowPrecisionMean` with a ``comm_dtype``, else
  :class:`ExactMean`."""
  if topology is not None:
    return GossipRound(topology, axis_name, comm_dtype=comm_dtype,
                       bucket_bytes=bucket_bytes)
  gossip.check_bucket_bytes(bucket_bytes)
  if checks.check_comm_dtype(comm_dtype) is not None:
    return LowPrecisionMean(comm_dtype, axis_name)
  return ExactMean(axis_name)
