"""Static two-level plans of collectives over ``M x K`` virtual workers.

When ``K`` workers share each of ``M`` devices
(:class:`decentral_jax.comm.collectives.VirtualAxes`, worker ``i = device
* K + slot``), a collective over the ``n = M K`` workers runs in two
levels: a gather along a device's stack of its ``K`` workers, and
``ppermute`` over the device axis for what crosses devices. The plans here
say, from the static worker pattern alone, which rows each device sends
in each ``ppermute`` and where each slot finds its result; they are NumPy
(no tracing) and cached per pattern.

* :func:`permute_plan`: a worker-level partial permutation as one
  ``ppermute`` per device offset (:func:`~decentral_jax.comm.collectives.
  permute`).
* :func:`group_plan`: group means as on-device partial sums plus ``|S| -
  1`` rotations of one row per device for a group on ``|S|`` devices
  (:func:`~decentral_jax.comm.collectives.group_mean`).

Indices are int32 slot indices into a device's stack; errors: none (the
callers check the pattern first).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Hop:
  """One ``ppermute`` over devices: rows ``send[d]`` of device ``d``'s stack."""
  pairs: tuple[tuple[int, int], ...]  # (source device, destination device)
  send: np.ndarray  # [M, rows] int32 slot indices (padded with 0)


@functools.lru_cache(maxsize=256)
def permute_plan(perm: tuple[tuple[int, int], ...], m: int, k: int):
  """Static plan for a worker-level partial permutation on ``M x K`` workers.

  Returns ``(hops, take)``: ``hops`` one per device offset ``(src - dst)
  mod M`` that some edge crosses; ``take`` ``[M, K]`` int32 indices into
  ``concat([stack, recv_1, ..., recv_H, zeros[1]])`` giving each slot's
  received row (the zero row where a worker receives nothing, as
  ``lax.ppermute`` gives zeros).
  """
  local = {}
  remote: dict[int, dict[int, list[tuple[int, int]]]] = {}
  for src, dst in perm:
    ds, ks = divmod(src, k)
    dd, kd = divmod(dst, k)
    if ds == dd:
      local[dst] = ks
    else:
      remote.setdefault((ds - dd) % m, {}).setdefault(dd, []).append((ks, kd))
  hops, offset = [], k
  take = np.full((m, k), -1, np.int64)
  for dd in range(m):
    for kd in range(k):
      if dd * k + kd in local:
        take[dd, kd] = local[dd * k + kd]
  for off in sorted(remote):
    by_dst = remote[off]
    rows = max(len(v) for v in by_dst.values())
    send = np.zeros((m, rows), np.int32)
    pairs = []
    for dd, edges in sorted(by_dst.items()):
      ds = (dd + off) % m
      pairs.append((ds, dd))
      for r, (ks, kd) in enumerate(edges):
        send[ds, r] = ks
        take[dd, kd] = offset + r
    hops.append(Hop(tuple(pairs), send))
    offset += rows
  take[take < 0] = offset  # the zero row
  return tuple(hops), take.astype(np.int32)


@functools.lru_cache(maxsize=256)
def group_plan(groups: tuple[tuple[int, ...], ...], m: int, k: int):
  """Static plan of group means on ``M x K`` workers, or None.

  Returns ``(local, rotations, rep, inside, weight)``: ``local`` ``[J, M,
  K]`` slot indices (``K`` = a zero row) whose sum is the sum of a slot's
  group members on its device; ``rotations`` device pairs, one
  ``ppermute`` each, over which a device's partial sum of its
  multi-device group travels (``|S| - 1`` rotations for a group on ``|S|``
  devices); ``rep`` ``[M]`` a slot of that group on each device;
  ``inside`` ``[M, K]`` bool, the slots in it; ``weight`` ``[n]``
  ``1/|G|``. None if a device holds members of two multi-device groups.
  """
  n = m * k
  group_of = np.empty(n, np.int64)
  for g, members in enumerate(groups):
    group_of[list(members)] = g
  spans = [sorted({w // k for w in members}) for members in groups]
  multi = np.full(m, -1, np.int64)
  for g, devs in enumerate(spans):
    if len(devs) > 1:
      for d in devs:
        if multi[d] >= 0:
          return None
        multi[d] = g
  local_members = [[[s for s in range(k) if group_of[d * k + s]
                     == group_of[d * k + t]] for t in range(k)]
                   for d in range(m)]
  depth = max(len(v) for row in local_members for v in row)
  local = np.full((depth, m, k), k, np.int32)
  for d in range(m):
    for t in range(k):
      for j, s in enumerate(local_members[d][t]):
        local[j, d, t] = s
  rotations = []
  for r in range(1, max(len(v) for v in spans)):
    pairs = []
    for devs in spans:
      if len(devs) > r:
        pairs += [(devs[(a + r) % len(devs)], d) for a, d in enumerate(devs)]
    rotations.append(tuple(pairs))
  rep = np.zeros(m, np.int32)
  inside = np.zeros((m, k), bool)
  for d in range(m):
    if multi[d] >= 0:
      slots = [s for s in range(k) if group_of[d * k + s] == multi[d]]
      rep[d] = slots[0]
      inside[d, slots] = True
  weight = np.array([1.0 / len(groups[g]) for g in group_of])
  return local, tuple(rotations), rep, inside, weight
