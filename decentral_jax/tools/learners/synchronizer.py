"""The synchronizer: the global parameters ``theta``, the outer optimizer and
the merge of the learners' pseudo-gradients.

Learner ``w`` sends ``Delta_w = theta^(b) - x_w`` (float32, the shapes of
``theta``) computed from the version ``b`` of ``theta`` it started from,
with the tokens ``n_w`` it processed since. A merge takes every accepted
pending pseudo-gradient and steps

.. math::
  \\Delta = \\sum_w \\frac{n_w}{\\sum_v n_v} \\Delta_w, \\qquad
  \\theta \\leftarrow \\theta + \\mathrm{outer}(\\Delta; \\theta)

(the token-weighted merge of Decoupled DiLoCo; with equal tokens the exact
mean of DiLoCo). When:

* ``sync``: once every active learner, and at least ``quorum`` of them,
  has sent its pseudo-gradient of the current version (DiLoCo, Douillard
  et al., arXiv 2311.08105; ``quorum = shards`` waits for every learner to
  have joined before the first merge);
* ``decoupled``: once ``quorum`` have arrived and then either all active
  learners have, or ``grace_s`` seconds have passed since the quorum
  (Decoupled DiLoCo, arXiv 2604.21428). Pseudo-gradients of older versions
  are merged while at most ``max_staleness`` merges old, dropped after.

Nobody waits on the synchronizer: a merge is computed in its own thread,
checkpointed through Orbax (when a directory is given) and only then
published, so a restarted synchronizer resumes at the last published
version. A pseudo-gradient of the wrong structure, shape or dtype, or with
NaN/inf, is rejected, logged with the learner's id and never merged.
With a compressor the learners send payloads of
:class:`decentral_jax.comm.compress.Compressor` (with error feedback at the
learner); the synchronizer decodes them before these checks.

This class knows nothing of Ray (:mod:`decentral_jax.tools.learners.cluster`
turns it into an actor); it is thread-safe.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax.optim import local_steps
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib

PyTree = Any


def check_pseudo_gradient(delta, theta) -> str | None:
  """Why ``delta`` cannot be merged into ``theta`` (None: it can).

  Checks the tree structure (dict keys), every leaf's shape and dtype
  (those of ``theta``) and that every value is finite.
  """
  if not isinstance(delta, dict) or sorted(delta) != sorted(theta):
    keys = sorted(delta) if isinstance(delta, dict) else type(delta).__name__
    return f"leaves {keys} differ from theta's {sorted(theta)}"
  for k in sorted(theta):
    d, t = delta[k], theta[k]
    if isinstance(d, np.generic):
      d = np.asarray(d)
    if not isinstance(d, np.ndarray) or d.shape != t.shape:
      return (f"leaf {k!r} has shape {np.shape(d)}, expected "
              f"{tuple(t.shape)}")
    if d.dtype != t.dtype:
      return f"leaf {k!r} has dtype {d.dtype}, expected {t.dtype}"
    if not np.all(np.isfinite(d)):
      return f"leaf {k!r} holds NaN or inf"
  return None


def token_weighted_mean(deltas, tokens) -> PyTree:
  """``sum_w n_w Delta_w / sum_w n_w`` (accumulated in float64, returned in
  float32)."""
  total = float(sum(tokens))
  return {k: (sum(np.float64(n) * d[k].astype(np.float64)
                  for d, n in zip(deltas, tokens)) / total).astype(np.float32)
          for k in deltas[0]}


class Synchronizer:
  """Holds ``theta`` (float32 NumPy leaves), the outer optax state and the
  number of merged periods (the version of ``theta``).

  Args:
    run: the :class:`~decentral_jax.tools.learners.spec.RunSpec`.
    checkpoint_dir: where merges are saved through Orbax (None: no
      checkpoints); an existing checkpoint there is resumed.
    tick_s: how often the merge thread checks the merge condition.
  """

  def __init__(self, run: spec_lib.RunSpec, checkpoint_dir: str | None = None,
               tick_s: float = 0.005):
    self.run = run
    self._lock = threading.Lock()
    self._codec = run.codec()
    self._outer = optax.sgd(run.outer_lr, momentum=run.outer_momentum,
                            nesterov=True)
    self._step = jax.jit(lambda d, s, t: local_steps.outer_step(
        self._outer, d, s, t))
    params = problems.build(run.problem, run.shards, run.problem_args).params
    self.theta = {k: np.asarray(v, np.float32) for k, v in params.items()}
    self._opt_state = self._outer.init(jax.tree.map(jnp.asarray, self.theta))
    zeros = jax.tree.map(jnp.zeros_like, self.theta)
    self._step(zeros, self._opt_state, zeros)  # compiled before any merge
    self.version = 0
    self.log = {"merged_with": [], "tokens": [], "merge_time": [],
                "rejected": [], "dropped": [], "joins": [], "leaves": []}
    self._active: set[int] = set()
    self._pending: dict = {}  # (learner, base) -> (delta, tokens)
    self._quorum_at = None
    self._speed: dict[int, float] = {}
    self._merging: set[int] = set()
    self.periods = run.periods
    self._ckpt = None
    self.resumed = False
    if checkpoint_dir is not None:
      self._open_checkpoint(checkpoint_dir)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._merge_loop, args=(tick_s,),
                                    daemon=True)
    self._thread.start()

  # ---------------------------------------------------------- checkpoints
  def _open_checkpoint(self, directory: str) -> None:
    from decentral_jax.runner import checkpoint  # pylint: disable=import-outside-toplevel
    self._ckpt = checkpoint.Checkpointer(directory, max_to_keep=2,
                                         async_save=False)
    step = self._ckpt.select_restore_step()
    if step is None:
      return
    state, meta = self._ckpt.restore(step, self._state_tree())
    self._load_state(state)
    self.version = int(meta["version"])
    self.log.update(meta["log"])
    self._active = set(meta["active"])
    self.periods = int(meta["periods"])
    self.resumed = True

  def _state_tree(self):
    leaves = jax.tree.leaves(self._opt_state)
    return {"theta": self.theta,
            "outer": {str(i): np.asarray(x) for i, x in enumerate(leaves)}}

  def _load_state(self, state) -> None:
    self.theta = {k: np.asarray(v, np.float32)
                  for k, v in state["theta"].items()}
    leaves = [jnp.asarray(state["outer"][str(i)])
              for i in range(len(state["outer"]))]
    self._opt_state = jax.tree.unflatten(
        jax.tree.structure(self._opt_state), leaves)

  # ------------------------------------------------------------ learners
  def join(self, learner: int, fingerprint: dict) -> dict:
    """Admits learner ``learner`` (idempotent: a restarted learner joins
    again) and returns :meth:`latest`'s answer.

    Raises:
      spec_lib.JoinRefused: a different model, method or data sharding
        (naming the field), or an id outside ``[0, shards)``.
    """
    spec_lib.check_join(learner, self.run.fingerprint(), fingerprint,
                        self.run.shards)
    with self._lock:
      self._active.add(learner)
      self.log["joins"].append([learner, self.version, time.time()])
    return self.latest(learner, -1)

  def leave(self, learner: int) -> None:
    """Removes ``learner`` from the active set; its pending pseudo-gradients
    are dropped (between periods nothing is lost)."""
    with self._lock:
      self._active.discard(learner)
      self._pending = {key: v for key, v in self._pending.items()
                       if key[0] != learner}
      self.log["leaves"].append([learner, self.version])

  def push(self, learner: int, base: int, delta: dict, tokens: int,
           speed: float = 0.0) -> str:
    """Offers learner ``learner``'s pseudo-gradient computed from version
    ``base`` after ``tokens`` tokens (``speed``: its inner steps per
    second). Decoupled mode: a further push of the same ``(learner,
    base)`` (the learner's progress since its previous push) is added to
    the one held, pseudo-gradients and tokens; sync mode: it replaces it
    (the same period sent again after a restart).

    Returns:
      ``"accepted"``, ``"rejected: <why>"`` (logged, never merged),
      ``"stale"`` (dropped) or ``"unknown"`` (not an active learner: join
      again).
    """
    delta, why = self._decode(delta)
    if why is None:
      why = check_pseudo_gradient(delta, self.theta)
    if why is None and not (isinstance(tokens, (int, np.integer))
                            and tokens > 0):
      why = f"tokens must be a positive int, got {tokens!r}"
    with self._lock:
      if learner not in self._active:
        return "unknown"
      if why is not None:
        self.log["rejected"].append([learner, base, why])
        print(f"synchronizer: rejected the pseudo-gradient of learner "
              f"{learner} (version {base}): {why}", file=sys.stderr,
              flush=True)
        return f"rejected: {why}"
      oldest = self.version - (self.run.max_staleness
                               if self.run.mode == "decoupled" else 0)
      if base > self.version or base < oldest:
        self.log["dropped"].append([learner, base, self.version])
        return "stale"
      key, tokens = (learner, base), int(tokens)
      if self.run.mode == "decoupled" and key in self._pending:
        held, n = self._pending[key]
        delta = {k: held[k] + delta[k] for k in delta}
        tokens += n
      self._pending[key] = (delta, tokens)
      self._speed[learner] = float(speed)
    return "accepted"

  def _decode(self, delta):
    """``(Delta, None)`` from what a learner sent, or ``(None, why)``."""
    if self.run.compressor == "none":
      return delta, None
    if not isinstance(delta, dict) or sorted(delta) != sorted(self.theta):
      return delta, None  # check_pseudo_gradient names the leaves
    out = {}
    for k, payload in delta.items():
      try:
        out[k] = np.asarray(self._codec.decode(
            {n: jnp.asarray(v) for n, v in payload.items()},
            jnp.zeros(self.theta[k].shape, jnp.float32)))
      except Exception as e:  # pylint: disable=broad-exception-caught
        return None, (f"leaf {k!r}: not a {self.run.compressor} payload "
                      f"({type(e).__name__}: {e})")
    return out, None

  def latest(self, learner: int, have: int) -> dict:
    """``{"version", "theta" (None when ``have`` is current), "v_max",
    "done", "known", "pending"}`` for learner ``learner`` holding version
    ``have`` (``pending``: its pseudo-gradient of ``have`` is held or being
    merged; False after a synchronizer restart lost it: send it again)."""
    with self._lock:
      speeds = [v for w, v in self._speed.items() if w in self._active]
      return {"version": self.version,
              "theta": None if have == self.version else dict(self.theta),
              "v_max": max(speeds, default=0.0),
              "done": self.version >= self.periods,
              "known": learner in self._active,
              "pending": ((learner, have) in self._pending
                          or learner in self._merging)}

  def status(self) -> dict:
    """Version, active learners, pending count and the run's log."""
    with self._lock:
      return {"version": self.version, "active": sorted(self._active),
              "pending": len(self._pending), "resumed": self.resumed,
              "done": self.version >= self.periods, "pid": os.getpid(),
              "periods": self.periods,
              "log": {k: list(v) for k, v in self.log.items()}}

  def set_periods(self, periods: int) -> None:
    """Ends the run after ``periods`` merged periods (raised or lowered
    live; the spec's ``periods`` is the start value)."""
    with self._lock:
      self.periods = int(periods)

  def params(self) -> dict:
    """``theta`` (float32 NumPy leaves) and the outer state's leaves."""
    with self._lock:
      return {"theta": dict(self.theta), "version": self.version,
              "outer": [np.asarray(x)
                        for x in jax.tree.leaves(self._opt_state)]}

  # --------------------------------------------------------------- merges
  def _ready(self, now: float) -> bool:
    current = {w for (w, b) in self._pending if b == self.version}
    arrived = {w for (w, _) in self._pending}
    if self.run.mode == "sync":
      return (len(self._active) >= self.run.quorum
              and self._active <= current)
    if len(arrived) < self.run.quorum:
      self._quorum_at = None
      return False
    if self._quorum_at is None:
      self._quorum_at = now
    return (self._active <= arrived
            or now - self._quorum_at >= self.run.grace_s)

  def _merge_loop(self, tick_s: float) -> None:
    while not self._stop.is_set():
      with self._lock:
        take = None
        if self.version < self.periods and self._ready(time.monotonic()):
          take, self._pending = self._pending, {}
          if self.run.mode == "sync":  # only the current version's
            take = {k: v for k, v in take.items() if k[1] == self.version}
          self._merging = {w for w, _ in take}
          self._quorum_at = None
          version, theta, opt_state = self.version, self.theta, self._opt_state
      if take:
        self._merge(take, version, theta, opt_state)
      else:
        time.sleep(tick_s)

  def _merge(self, take: dict, version: int, theta, opt_state) -> None:
    keys = sorted(take)
    deltas = [take[k][0] for k in keys]
    tokens = [take[k][1] for k in keys]
    mean = token_weighted_mean(deltas, tokens)
    new_theta, new_state = self._step(
        jax.tree.map(jnp.asarray, mean), opt_state,
        jax.tree.map(jnp.asarray, theta))
    new_theta = {k: np.asarray(v, np.float32) for k, v in new_theta.items()}
    per_learner: dict[str, int] = {}
    for (w, _), n in zip(keys, tokens):
      per_learner[str(w)] = per_learner.get(str(w), 0) + n
    with self._lock:
      self.log["merged_with"].append(sorted({w for w, _ in keys}))
      self.log["tokens"].append(per_learner)
      self.log["merge_time"].append(time.time())
      log = {k: list(v) for k, v in self.log.items()}
      active = sorted(self._active)
    if self._ckpt is not None:
      self._ckpt.save(version + 1, {"theta": new_theta, "outer": {
          str(i): np.asarray(x)
          for i, x in enumerate(jax.tree.leaves(new_state))}},
                      {"version": version + 1, "log": log, "active": active,
                       "periods": self.periods})
    with self._lock:
      self.theta, self._opt_state = new_theta, new_state
      self.version, self._merging = version + 1, set()

  def close(self) -> None:
    """Stops the merge thread and closes the checkpoint directory."""
    self._stop.set()
    self._thread.join(timeout=5)
    if self._ckpt is not None:
      self._ckpt.close()
