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

With ``RunSpec.fragments = P > 1`` (or an overlap or merge weight) the
parameters are Streaming DiLoCo's fragments (Douillard et al., arXiv
2501.18512; :mod:`decentral_jax.tools.learners.fragments`): learners push
each fragment's pseudo-gradient ``Delta_{w,p} = theta_p^(b) - x_{w,p}`` on
its own schedule, and fragment ``p`` is merged by the rules above on its
own (quorum, grace window and version ``v_p`` per fragment) and stepped by
its own outer state. ``version`` is then ``min_p v_p`` (the periods every
fragment has merged) and the run ends when every fragment has merged
``periods`` times. The outer optimizer is DiLoCo's Nesterov SGD or Delayed
Nesterov (:mod:`decentral_jax.tools.learners.outer`).

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
from decentral_jax.tools.learners import fragments as fragments_lib
from decentral_jax.tools.learners import outer as outer_lib
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


def initial_theta(run: spec_lib.RunSpec):
  """``(theta, fragments)``: the problem's initial parameters (float32 NumPy
  leaves) and their fragments' keys.

  Raises:
    ValueError: the problem does not build (its one-line error) or has
      fewer leaves than ``run.fragments``.
  """
  params = problems.build(run.problem, run.shards, run.problem_args).params
  theta = {k: np.asarray(v, np.float32) for k, v in params.items()}
  return theta, fragments_lib.fragment_keys(theta, run.fragments)


def check_resume_meta(run: spec_lib.RunSpec, meta: dict, where: str) -> None:
  """Refuses a checkpoint's metadata ``meta`` written by another run
  (:func:`~decentral_jax.tools.learners.spec.check_resume`); one written
  before runs were recorded is accepted with a warning.

  Raises:
    ValueError: the first field of the trajectory that differs.
  """
  if "run" not in meta:
    print(f"warning: {where} does not record its run (an older "
          "checkpoint); resuming it unchecked.", file=sys.stderr, flush=True)
    return
  spec_lib.check_resume(_same_config(run, _inner_of_config(run, meta["run"]),
                                     where), run.trajectory(), where)


def _inner_of_config(run: spec_lib.RunSpec, saved):
  """``saved`` of a runner config written before its inner optimizer was
  recorded (no ``inner_schedule``: ``inner`` and ``inner_lr`` held unused
  defaults) with ours in their place: the config it records set them."""
  if (run.problem != "runner" or not isinstance(saved, dict)
      or saved.get("problem") != "runner" or "inner_schedule" in saved):
    return saved
  ours = run.trajectory()
  return {**saved, **{k: ours[k] for k in ("inner", "inner_lr",
                                            "inner_schedule")}}


def _same_config(run: spec_lib.RunSpec, saved, where: str):
  """``saved`` with its runner config's ``problem_args`` taken as ours
  when both load to the same config (overrides compared by value, not as
  strings); a config that differs is refused naming its first field."""
  if (run.problem != "runner" or not isinstance(saved, dict)
      or saved.get("problem") != "runner"
      or saved.get("problem_args") == run.trajectory()["problem_args"]):
    return saved
  from decentral_jax.tools.learners import runner_problem  # pylint: disable=import-outside-toplevel
  try:
    diff = runner_problem.config_difference(
        saved.get("problem_args") or (), run.problem_args, run.shards)
  except (TypeError, ValueError):  # the saved config no longer loads
    return saved
  if diff is not None:
    name, a, b = diff
    raise ValueError(
        f"{where} was written by a run with {name}={a!r}, this run has "
        f"{b!r}; resume it with the same config or start a new checkpoint "
        "directory (--checkpoint-dir, or a new --workdir).")
  return {**saved, "problem_args": run.trajectory()["problem_args"]}


def check_run(run: spec_lib.RunSpec, checkpoint_dir: str | None
              ) -> int | None:
  """What a :class:`Synchronizer` of ``run`` would refuse, checked before
  starting one (the command calls it before Ray starts): the problem
  builds, its leaves fit ``run.fragments``, and the newest checkpoint in
  ``checkpoint_dir`` (when one exists) was written by the same run.
  Returns that checkpoint's step (None: no checkpoint to resume).

  Raises:
    ValueError: naming the field, file or checkpoint, and the fix.
  """
  initial_theta(run)
  if checkpoint_dir is None or not os.path.isdir(checkpoint_dir):
    return None
  from decentral_jax.runner import checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = checkpoint.Checkpointer(checkpoint_dir, max_to_keep=2,
                                 async_save=False)
  try:
    step = ckpt.select_restore_step()
    if step is not None:
      check_resume_meta(run, ckpt.restore_meta(step),
                        f"checkpoint {ckpt.step_dir(step)}")
  finally:
    ckpt.close()
  return step


class Synchronizer:
  """Holds ``theta`` (float32 NumPy leaves), the outer optax state (one per
  fragment) and the number of merges of each fragment (the versions of
  ``theta``; ``version`` is their minimum, setting it sets them all).

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
    self._outer = outer_lib.make(run.outer, run.outer_lr,
                                 run.outer_momentum, run.delay_buffer)
    self._step = jax.jit(lambda d, s, t: local_steps.outer_step(
        self._outer, d, s, t))
    self.theta, self.fragments = initial_theta(run)
    self._opt_state = tuple(
        self._outer.init({k: jnp.asarray(self.theta[k]) for k in keys})
        for keys in self.fragments)
    for keys, state in zip(self.fragments, self._opt_state):
      zeros = {k: jnp.zeros_like(self.theta[k]) for k in keys}
      self._step(zeros, state, zeros)  # compiled before any merge
    self.versions = [0] * run.fragments
    self.log = {"merged_with": [], "tokens": [], "merge_time": [],
                "rejected": [], "dropped": [], "joins": [], "leaves": [],
                "fragments": []}
    self._active: set[int] = set()
    self._pending: dict = {}  # (learner, fragment, base) -> (delta, tokens)
    self._quorum_at: dict[int, float] = {}
    self._speed: dict[int, float] = {}
    self._merging: set[tuple[int, int]] = set()  # (learner, fragment)
    self._kept: dict[int, dict] = {}  # learner -> {base: its state}
    self._refused: dict = {}  # (learner, fragment, base) -> why
    self.periods = run.periods
    self._hold: int | None = None  # merge no fragment past this version
    self._ckpt = None
    self.resumed = False
    if checkpoint_dir is not None:
      try:
        self._open_checkpoint(checkpoint_dir)
      except BaseException:
        if self._ckpt is not None:
          self._ckpt.close()
        raise
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._merge_loop, args=(tick_s,),
                                    daemon=True)
    self._thread.start()

  @property
  def version(self) -> int:
    """Periods every fragment has merged: ``min_p v_p``."""
    return min(self.versions)

  @version.setter
  def version(self, value: int) -> None:
    self.versions = [int(value)] * len(self.versions)

  # ---------------------------------------------------------- checkpoints
  def _open_checkpoint(self, directory: str) -> None:
    from decentral_jax.runner import checkpoint  # pylint: disable=import-outside-toplevel
    self._ckpt = checkpoint.Checkpointer(directory, max_to_keep=2,
                                         async_save=False)
    step = self._ckpt.select_restore_step()
    if step is None:
      return
    check_resume_meta(self.run, self._ckpt.restore_meta(step),
                      f"checkpoint {self._ckpt.step_dir(step)}")
    state, meta = self._ckpt.restore(step, self._state_tree())
    self._load_state(state)
    self.versions = [int(v) for v in meta.get(
        "versions", [meta["version"]] * self.run.fragments)]
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
    again) and returns :meth:`latest`'s answer with ``"kept"``: the state
    it sent with :meth:`keep` before its pseudo-gradient of version
    ``version - 1`` (sync mode: the state it had when it started the
    current period), else its newest, else None.

    Raises:
      spec_lib.JoinRefused: a different model, method or data sharding
        (naming the field), or an id outside ``[0, shards)``.
    """
    spec_lib.check_join(learner, self.run.fingerprint(), fingerprint,
                        self.run.shards)
    with self._lock:
      self._active.add(learner)
      self.log["joins"].append([learner, self.version, time.time()])
      kept = self._kept.get(learner, {})
      state = kept.get(self.version - 1) if self.run.mode == "sync" else None
      if state is None and kept:
        state = kept[max(kept)]
    return {**self.latest(learner, -1), "kept": state}

  def keep(self, learner: int, base: int, state) -> None:
    """Holds learner ``learner``'s state (inner optimizer leaves, error
    feedback residual: opaque here) sent before its pseudo-gradient of
    version ``base``; the two newest per learner are kept, in memory only
    (a restarted synchronizer has none)."""
    with self._lock:
      kept = self._kept.setdefault(learner, {})
      kept[base] = state
      for old in sorted(kept)[:-2]:
        del kept[old]

  def leave(self, learner: int) -> None:
    """Removes ``learner`` from the active set; its pending pseudo-gradients
    are dropped (between periods nothing is lost)."""
    with self._lock:
      self._active.discard(learner)
      self._pending = {key: v for key, v in self._pending.items()
                       if key[0] != learner}
      self.log["leaves"].append([learner, self.version])

  def push(self, learner: int, base: int, delta: dict, tokens: int,
           speed: float = 0.0, fragment: int = 0) -> str:
    """Offers learner ``learner``'s pseudo-gradient of fragment
    ``fragment`` (0: the whole ``theta`` when ``fragments = 1``), computed
    from that fragment's version ``base`` after ``tokens`` tokens
    (``speed``: its inner steps per second). Decoupled mode: a further push
    of the same ``(learner, fragment, base)`` (the learner's progress since
    its previous push) is added to the one held, pseudo-gradients and
    tokens; sync mode: it replaces it (the same period sent again after a
    restart).

    Returns:
      ``"accepted"``, ``"rejected: <why>"`` (logged, never merged),
      ``"stale"`` (dropped) or ``"unknown"`` (not an active learner: join
      again).
    """
    why = None
    if not (isinstance(fragment, (int, np.integer))
            and 0 <= fragment < len(self.fragments)):
      why = f"fragment {fragment!r} is not in 0..{len(self.fragments) - 1}"
    else:
      like = {k: self.theta[k] for k in self.fragments[fragment]}
      delta, why = self._decode(delta, like)
      if why is None:
        why = check_pseudo_gradient(delta, like)
    if why is None and not (isinstance(tokens, (int, np.integer))
                            and tokens > 0):
      why = f"tokens must be a positive int, got {tokens!r}"
    with self._lock:
      if learner not in self._active:
        return "unknown"
      if why is None:  # its merge was refused: sent again, refused again
        why = self._refused.get((learner, int(fragment), base))
      if why is not None:
        self.log["rejected"].append([learner, base, why])
        print(f"synchronizer: rejected the pseudo-gradient of learner "
              f"{learner} (version {base}): {why}", file=sys.stderr,
              flush=True)
        return f"rejected: {why}"
      current = self.versions[fragment]
      oldest = current - (self.run.max_staleness
                          if self.run.mode == "decoupled" else 0)
      if base > current or base < oldest:
        self.log["dropped"].append([learner, base, current])
        return "stale"
      key, tokens = (learner, int(fragment), base), int(tokens)
      if self.run.mode == "decoupled" and key in self._pending:
        held, n = self._pending[key]
        delta = {k: held[k] + delta[k] for k in delta}
        tokens += n
      self._pending[key] = (delta, tokens)
      self._speed[learner] = float(speed)
    return "accepted"

  def _decode(self, delta, like):
    """``(Delta, None)`` from what a learner sent, or ``(None, why)``."""
    if self.run.compressor == "none":
      return delta, None
    if not isinstance(delta, dict) or sorted(delta) != sorted(like):
      return delta, None  # check_pseudo_gradient names the leaves
    out = {}
    for k, payload in delta.items():
      try:
        out[k] = np.asarray(self._codec.decode(
            {n: jnp.asarray(v) for n, v in payload.items()},
            jnp.zeros(like[k].shape, jnp.float32)))
      except Exception as e:  # pylint: disable=broad-exception-caught
        return None, (f"leaf {k!r}: not a {self.run.compressor} payload "
                      f"({type(e).__name__}: {e})")
    return out, None

  def latest(self, learner: int, have: int) -> dict:
    """``{"version", "versions", "theta" (None when ``have`` is current),
    "v_max", "done", "known", "pending"}`` for learner ``learner`` holding
    version ``have`` (``pending``: its pseudo-gradient of ``have`` is held
    or being merged; False after a synchronizer restart lost it: send it
    again; ``versions``: each fragment's)."""
    with self._lock:
      speeds = [v for w, v in self._speed.items() if w in self._active]
      return {"version": self.version, "versions": list(self.versions),
              "theta": None if have == self.version else dict(self.theta),
              "v_max": max(speeds, default=0.0),
              "done": self.version >= self.periods,
              "known": learner in self._active,
              "pending": ((learner, 0, have) in self._pending
                          or (learner, 0) in self._merging)}

  def latest_fragment(self, learner: int, fragment: int, have: int) -> dict:
    """As :meth:`latest` for one fragment: ``"version"`` is ``v_p`` and
    ``"theta"`` holds the fragment's leaves (None when ``have == v_p``)."""
    with self._lock:
      current = self.versions[fragment]
      theta = {k: self.theta[k] for k in self.fragments[fragment]}
      return {"version": current, "versions": list(self.versions),
              "theta": None if have == current else theta,
              "done": self.version >= self.periods,
              "known": learner in self._active,
              "pending": ((learner, fragment, have) in self._pending
                          or (learner, fragment) in self._merging)}

  def status(self) -> dict:
    """Version (and each fragment's), active learners, pending count and
    the run's log."""
    with self._lock:
      return {"version": self.version, "versions": list(self.versions),
              "active": sorted(self._active),
              "pending": len(self._pending), "resumed": self.resumed,
              "done": self.version >= self.periods, "pid": os.getpid(),
              "periods": self.periods,
              "log": {k: list(v) for k, v in self.log.items()}}

  def set_periods(self, periods: int) -> None:
    """Ends the run after ``periods`` merged periods (raised or lowered
    live; the spec's ``periods`` is the start value)."""
    with self._lock:
      self.periods = int(periods)

  def hold(self, version: int | None) -> None:
    """Merges no fragment past ``version`` (each stops at it) until the
    next call (None: merge freely), so a caller acts at an exact version
    (``learners --kill-every``). Not checkpointed: a restarted
    synchronizer merges freely."""
    with self._lock:
      self._hold = None if version is None else int(version)

  def params(self) -> dict:
    """``theta`` (float32 NumPy leaves) and the outer state's leaves."""
    with self._lock:
      return {"theta": dict(self.theta), "version": self.version,
              "outer": [np.asarray(x)
                        for x in jax.tree.leaves(self._opt_state)]}

  # --------------------------------------------------------------- merges
  def _ready(self, fragment: int, now: float) -> bool:
    stop = self.periods if self._hold is None else min(self.periods,
                                                       self._hold)
    if self.versions[fragment] >= stop:
      return False
    keys = [(w, b) for (w, p, b) in self._pending if p == fragment]
    current = {w for (w, b) in keys if b == self.versions[fragment]}
    arrived = {w for (w, _) in keys}
    if self.run.mode == "sync":
      return (len(self._active) >= self.run.quorum
              and self._active <= current)
    if len(arrived) < self.run.quorum:
      self._quorum_at.pop(fragment, None)
      return False
    since = self._quorum_at.setdefault(fragment, now)
    return self._active <= arrived or now - since >= self.run.grace_s

  def _take(self):
    """``(fragment, its pending pseudo-gradients)`` of the first fragment
    ready to merge (removed from the pending ones), else None."""
    now = time.monotonic()
    for p in range(len(self.fragments)):
      if not self._ready(p, now):
        continue
      take = {k: v for k, v in self._pending.items() if k[1] == p
              and (self.run.mode == "decoupled" or k[2] == self.versions[p])}
      self._pending = {k: v for k, v in self._pending.items() if k[1] != p}
      self._merging = {(w, p) for w, _, _ in take}
      self._quorum_at.pop(p, None)
      return p, take
    return None

  def _merge_loop(self, tick_s: float) -> None:
    while not self._stop.is_set():
      with self._lock:
        ready = self._take()
        if ready:
          p = ready[0]
          theta = {k: self.theta[k] for k in self.fragments[p]}
          args = (self.versions[p], theta, self._opt_state[p])
      if ready:
        self._merge(*ready, *args)
      else:
        time.sleep(tick_s)

  def _merge(self, fragment: int, take: dict, version: int, theta,
             opt_state) -> None:
    keys = sorted(take)
    deltas = [take[k][0] for k in keys]
    tokens = [take[k][1] for k in keys]
    mean = token_weighted_mean(deltas, tokens)
    new_theta, new_state = self._step(
        jax.tree.map(jnp.asarray, mean), opt_state,
        jax.tree.map(jnp.asarray, theta))
    new_theta = {k: np.asarray(v, np.float32) for k, v in new_theta.items()}
    if not all(np.all(np.isfinite(v)) for v in new_theta.values()):
      self._refuse(fragment, keys)
      return
    per_learner: dict[str, int] = {}
    for (w, _, _), n in zip(keys, tokens):
      per_learner[str(w)] = per_learner.get(str(w), 0) + n
    learners = sorted({w for w, _, _ in keys})
    with self._lock:
      if fragment == 0:  # the period's entry (fragment 0 closes a period)
        self.log["merged_with"].append(learners)
        self.log["tokens"].append(per_learner)
        self.log["merge_time"].append(time.time())
      if len(self.fragments) > 1:
        self.log["fragments"].append([fragment, version + 1, learners,
                                      per_learner])
      theta_all = {**self.theta, **new_theta}
      states = list(self._opt_state)
      states[fragment] = new_state
      versions = list(self.versions)
      versions[fragment] = version + 1
      log = {k: list(v) for k, v in self.log.items()}
      active = sorted(self._active)
    if self._ckpt is not None:
      self._ckpt.save(sum(versions), {"theta": theta_all, "outer": {
          str(i): np.asarray(x)
          for i, x in enumerate(jax.tree.leaves(tuple(states)))}},
                      {"version": min(versions), "versions": versions,
                       "log": log, "active": active, "periods": self.periods,
                       "run": self.run.trajectory()})
    with self._lock:
      self.theta, self._opt_state = theta_all, tuple(states)
      self.versions, self._merging = versions, set()

  def _refuse(self, fragment: int, keys) -> None:
    """A merge whose new ``theta`` is not finite (finite but huge
    pseudo-gradients): ``theta`` and the outer state stay; each learner's
    pseudo-gradient is logged as rejected, and refused when sent again."""
    why = (f"the merged theta of fragment {fragment} holds NaN or inf; "
           "theta was kept")
    with self._lock:
      for w, p, base in keys:
        self.log["rejected"].append([w, base, why])
        self._refused[(w, p, base)] = why
      self._merging = set()
    print(f"synchronizer: refused the merge of learners "
          f"{sorted({w for w, _, _ in keys})} (fragment {fragment}): {why}",
          file=sys.stderr, flush=True)

  def close(self) -> None:
    """Stops the merge thread and closes the checkpoint directory."""
    self._stop.set()
    self._thread.join(timeout=5)
    if self._ckpt is not None:
      self._ckpt.close()
