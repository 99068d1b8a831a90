"""Gossip hidden behind the part of the step the compiled program overlaps.

The runtime model's default for overlapped gossip (Decent-DP style,
:mod:`~decentral_jax.runtime_model.per_step_methods`) hides a round behind
the whole forward and backward pass: each bucket is posted during the
previous step's backward and waited for in the next step. The step that
XLA compiles for this library does something narrower
(``docs/gpu_overlap.md``): the gossip of ``x_k`` starts and finishes inside
step ``k``, and its transfer runs while only the part of the compute that
XLA's scheduler placed between the collective's start and done executes
(the end of the backward pass: about half of the backward's matrix
multiplies, none of the forward's, for gpt_tiny on H200).

``Workload.gossip_in_flight = (f_F, f_B)`` states that part: the fractions
of the forward and of the backward pass that run while the gossip is in
flight, as :meth:`decentral_jax.analysis.overlap.OverlapReport.
in_flight_fractions` reads them from the scheduled HLO (the matrix-multiply
FLOPs in flight, taken as a share of time). With it, worker ``i`` of step
``k`` (forward ``F_ik``, backward ``B_ik``, start ``s_ik``) issues round
``r = k mod period`` at

    a_ik = s_ik + F_ik + B_ik - (f_F F_ik + f_B B_ik)

(the in-flight compute is the end of the pass), the round ends
``tau_r,i`` (the round's cost for the whole parameter message, one latency
per bucket) after every member of the worker's group has issued it, and

    s_i,k+1 = max(s_ik + F_ik + B_ik, max_{j in G_r(i)} a_jk + tau_r,i) + O.

Closed form (window ``W = f_F F + f_B B``): per worker ``mean_r [E[max(C_i,
max_{j in G_r(i)} a_j + tau_r,i)] + O]`` for Gaussian compute
(:func:`expected_step`; ``C + O + max(0, tau_r - W)`` without variance),
the slowest worker setting the pace. ``(1, 1)`` is the
whole pass in flight inside the step (no pipelining across steps, unlike
the default model). The model stays NumPy-only: the fractions are a pair of
numbers or a JSON file (:func:`read_in_flight`), never an import of the
analysis package.

Pipelined gossip (``Method.pipelined``, :mod:`decentral_jax.optim.
pipelined`): step ``k``'s update does not wait for its round (the result
is mixed in step ``k + 1``), so the optimizer time ``O`` joins the window
and the step ends at

    s_i,k+1 = max(s_ik + F_ik + B_ik + O, max_{j in G_r(i)} a_jk + tau_r,i)

with round ``r = floor(k / 2) mod period``; deterministic closed form
``C + O + max(0, tau_r - W - O)``. The program still holds the round
inside the step (it must be done when the step's program ends), so the
whole step ``F + B + O`` is the most it can hide behind: ``(f_F, f_B) =
(1, 1)`` when the scheduler starts the round at the top of the step.

Units: seconds, bytes.
"""

from __future__ import annotations

import os

import numpy as np
from scipy import special

from decentral_jax import records
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.method import split_compute
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import check_in_flight


def read_in_flight(value: str) -> tuple[float, float]:
  """``(f_F, f_B)`` from a command-line value.

  Args:
    value: one fraction ``"0.36"`` (the same share of both passes),
      ``"FORWARD,BACKWARD"`` (e.g. ``"0,0.55"``), or the path of a JSON
      file (named ``*.json``, given with a directory, or any existing file
      whose name is not fractions) with ``{"in_flight_fractions": {"forward": .., "backward":
      ..}}`` (``OverlapReport.to_json()``; ``benchmarks/gpu_check.py
      --deviceless ... --json FILE`` writes the least of its programs).

  Raises:
    ValueError: not a fraction, a pair, or a readable JSON file with that
      field (the message names the value).
  """
  text = str(value).strip()
  parts = text.split(",")
  try:
    nums = [float(p) for p in parts]
  except ValueError:
    nums = []
  # A file: named *.json, given with a directory, or any other existing
  # file whose name is not fractions (e.g. ./fractions.txt as fractions.txt).
  if (text.endswith(".json") or os.path.sep in text
      or (not nums and os.path.isfile(text))):
    fraction = ("number", 0.0, 1.0, False)
    got = records.read_json(text, {"in_flight_fractions": (records.Obj(
        {"forward": fraction, "backward": fraction}, ("forward", "backward"),
        extra=True), None, None, False)}, ("in_flight_fractions",),
                            extra=True)
    if isinstance(got, records.Damaged):
      raise ValueError(f"--gossip-in-flight {got}; expected a JSON file with "
                       "in_flight_fractions.forward/.backward.")
    got = got["in_flight_fractions"]
    return check_in_flight((got["forward"], got["backward"]))
  if len(nums) not in (1, 2):
    raise ValueError(f"--gossip-in-flight {text!r}: give a fraction, "
                     "FORWARD,BACKWARD fractions or an existing JSON file "
                     "(no file of that name).")
  return check_in_flight(nums * 2 if len(nums) == 1 else nums)


def _taus(m: Method, c: Cluster, w: Workload) -> list[np.ndarray]:
  sizes, _ = w.buckets(w.param_bytes)
  return [rc.time(w.param_bytes, len(sizes)) for rc in m.round_costs(c, w)]


def expected_step(compute_s: float, window_s: float, sigma_s: float,
                  tau_s: float, group: int) -> float:
  """``E[max(C_0, max_{j in G} a_j + tau)]``: one worker's forward+backward
  plus exposed gossip, for Gaussian compute.

  ``C_j = C (1 + cv Z_j)`` (``cv = sigma / C``, ``Z_j`` i.i.d. standard
  normal), ``a_j = (C - W) (1 + cv Z_j)`` (the in-flight compute scales
  with the pass), ``|G| = group`` members including the worker itself.
  Conditioning on ``Z_0``: ``K = max(C_0, a_0 + tau)`` and ``E[max(K, M +
  tau)] = K + s_a int_{(K - tau - A) / s_a}^inf (1 - Phi(v)^{|G|-1}) dv``
  with ``A = C - W``, ``s_a = cv A``, ``M`` the latest other member;
  integrated on grids (``|Z_0| <= 8``).
  """
  if sigma_s <= 0:
    return compute_s + max(0.0, tau_s - window_s)
  cv, issue = sigma_s / compute_s, compute_s - window_s
  z = np.linspace(-8.0, 8.0, 321)
  pdf = np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
  own = np.maximum(compute_s * (1 + cv * z), issue * (1 + cv * z) + tau_s)
  sd_a = cv * issue
  if group > 1 and sd_a > 0:
    v = np.linspace(-9.0, 9.0, 721)
    tail = 1.0 - special.ndtr(v) ** (group - 1)
    # G(s) = int_s^9 tail dv, by reverse cumulative trapezoid.
    seg = 0.5 * (tail[1:] + tail[:-1]) * np.diff(v)
    g = np.concatenate([np.cumsum(seg[::-1])[::-1], [0.0]])
    s0 = (own - tau_s - issue) / sd_a
    own = own + sd_a * (np.interp(s0, v, g) + np.maximum(0.0, v[0] - s0))
  elif group > 1:
    own = np.maximum(own, issue + tau_s)
  return float(np.trapezoid(pdf * own, z))


def closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """Closed-form per-iteration time (module docstring) of an overlapped
  gossip method ``m`` with ``w.gossip_in_flight`` set.

  Per worker, the mean over the period's rounds of
  :func:`expected_step` plus the optimizer, the slowest worker setting the
  pace; the deterministic part is ``C + O + max(0, tau_r - W)``.
  """
  f_fwd, f_bwd = w.gossip_in_flight
  fwd, bwd = split_compute(w)
  comp = fwd + bwd
  window = f_fwd * fwd + f_bwd * bwd
  sigma = w.compute_std_s
  costs = m.round_costs(c, w)
  det = np.zeros(c.n_workers)
  tot = np.zeros(c.n_workers)
  cache = {}
  # Pipelined: the update runs while the round is in flight, so the round
  # has O more to hide behind: E[max(C + O, a + tau)] = O + E[max(C, a +
  # tau - O)].
  hidden = w.optimizer_s if m.pipelined else 0.0
  for rc, tau in zip(costs, _taus(m, c, w)):
    for i, (row, t) in enumerate(zip(rc.members.tolist(), tau.tolist())):
      key = (len(set(row)), round(t - hidden, 12))
      if key not in cache:
        cache[key] = expected_step(comp, window, sigma, t - hidden, key[0])
      det[i] += comp + max(0.0, t - hidden - window) + w.optimizer_s
      tot[i] += cache[key] + w.optimizer_s
  base = comp + w.optimizer_s
  det_s, tot_s = det.max() / len(costs), tot.max() / len(costs)
  return Estimate(m.name, float(max(tot_s, det_s)), base,
                  float(max(det_s - base, 0.0)),
                  float(max(tot_s - det_s, 0.0)))


def simulate(m: Method, c: Cluster, w: Workload, fwd: np.ndarray,
             bwd: np.ndarray, warmup: int) -> float:
  """Mean seconds per iteration of the recursion in the module docstring.

  Args:
    m, c, w: as :func:`closed_form`.
    fwd, bwd: float64 [steps, n] forward and backward seconds.
    warmup: steps discarded before averaging.
  """
  f_fwd, f_bwd = w.gossip_in_flight
  costs = m.round_costs(c, w)
  taus = _taus(m, c, w)
  s = np.zeros(c.n_workers)
  start = s
  for k in range(fwd.shape[0]):
    if k == warmup:
      start = s.copy()
    done = s + fwd[k] + bwd[k]
    issue = done - (f_fwd * fwd[k] + f_bwd * bwd[k])
    r = (k // 2 if m.pipelined else k) % len(costs)
    end = issue[costs[r].members].max(axis=1) + taus[r]
    if m.pipelined:  # the update does not wait for the round
      s = np.maximum(done + w.optimizer_s, end)
    else:
      s = np.maximum(done, end) + w.optimizer_s
  return float(np.mean(s - start) / (fwd.shape[0] - warmup))


__all__ = ("closed_form", "expected_step", "read_in_flight", "simulate")
