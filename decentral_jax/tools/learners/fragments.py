"""Streaming DiLoCo's fragment schedule as the learners and the synchronizer
see it.

The partition and the offsets are those of the one-program method
(:func:`decentral_jax.optim.streaming_sync.default_fragments` and
:func:`~decentral_jax.optim.streaming_sync.fragment_offsets`): the leaves of
``theta`` (a flat dict, taken in sorted key order, as ``jax.tree.leaves``
takes it) are cut into ``P`` contiguous runs of about equal size; fragment
``p`` has offset ``o_p = (p H // P) % H``. Its ``k``-th send (``k >= 1``)
falls after inner step

    t_{p,k} = o_p + (k - 1) H   (o_p > 0),      t_{p,k} = k H   (o_p = 0),

and its ``k``-th merge is taken ``tau`` (``RunSpec.overlap_steps``) inner
steps later.
"""

from __future__ import annotations

from decentral_jax.optim import streaming_sync


def fragment_keys(theta: dict, num_fragments: int) -> list[list[str]]:
  """The leaf names of each fragment of the flat dict ``theta``.

  Raises:
    ValueError: more fragments than leaves (naming ``RunSpec.fragments``).
  """
  names = sorted(theta)
  if num_fragments > len(names):
    raise ValueError(f"RunSpec.fragments={num_fragments} exceeds the "
                     f"{len(names)} parameter leaves of the problem; use "
                     f"fragments <= {len(names)}, or a problem "
                     "with more leaves (--problem gpt, or --config).")
  ids = streaming_sync.default_fragments({k: theta[k] for k in names},
                                         num_fragments)
  return [[k for k in names if ids[k] == p] for p in range(num_fragments)]


def offsets(sync_every: int, num_fragments: int) -> list[int]:
  """``o_p`` of each fragment (the one-program method's offsets)."""
  return streaming_sync.fragment_offsets(sync_every, num_fragments)


def is_send(t: int, offset: int, sync_every: int) -> bool:
  """Whether a fragment of offset ``offset`` is sent after inner step
  ``t`` (``t % H == o_p`` and ``t >= max(o_p, 1)``)."""
  return t % sync_every == offset and t >= max(offset, 1)


def send_step(k: int, offset: int, sync_every: int) -> int:
  """``t_{p,k}``: the inner step after which the ``k``-th send falls."""
  return offset + (k - 1) * sync_every if offset else k * sync_every


def start_step(versions, offs, sync_every: int, tau: int) -> int:
  """The inner step a learner joining at fragment versions ``versions``
  starts counting from: ``min(M, min_p t_{p, v_p + 1} - 1)`` with ``M`` the
  step of the newest merge (0 before any), so that its first send of every
  fragment is that of the version the synchronizer holds (0 for a fresh
  run)."""
  merged = [send_step(v, o, sync_every) + tau
            for v, o in zip(versions, offs) if v > 0]
  nxt = min(send_step(v + 1, o, sync_every) - 1
            for v, o in zip(versions, offs))
  return min(max(merged, default=0), nxt)
