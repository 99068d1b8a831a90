"""A learner: inner steps on its own data shard, pseudo-gradients to the
synchronizer.

Each period learner ``w`` starts from the synchronizer's ``theta`` of
version ``b``, takes ``H_w`` inner steps ``x <- x + inner(g; x)``
(:func:`decentral_jax.optim.local_steps.inner_step`, the step every
local-update method of the library takes) on shard ``w``'s batches, and
sends ``Delta_w = theta^(b) - x`` with the tokens it processed.

* ``sync``: it then waits until the merge of version ``b`` is published
  and restarts from the new ``theta`` (DiLoCo, one learner per worker).
* ``decoupled``: it never waits for a peer: after sending it asks for the
  newest ``theta`` once; if none is newer it keeps stepping from its own
  ``x`` and its next pseudo-gradient, still of version ``b``, is the
  progress since this one, ``x_prev - x``: the synchronizer adds it to
  what it holds of ``(w, b)`` (each step counted once, also when a merge
  took the earlier part). With Dynamic Local Updates (Liu et al., Asynchronous Local-SGD,
  arXiv 2401.09135) ``H_w = max(1, floor(v_w / v_max * H))`` with ``v``
  the measured inner steps per second.

With fragments (``RunSpec.fragments = P``, Streaming DiLoCo, Douillard et
al., arXiv 2501.18512) the learner counts inner steps ``t`` from its join
and, after every step ``t`` with ``t % H == o_p`` (``t >= max(o_p, 1)``,
``o_p = p H // P``), sends fragment ``p``'s pseudo-gradient ``Delta_{w,p} =
theta_p^(b_p) - x_p`` of the fragment version ``b_p`` it holds; ``tau``
(``overlap_steps``) steps later it takes the merged fragment (sync mode:
waits for it; decoupled: asks once) as ``x_p <- alpha x_p + (1 - alpha)
theta_p``, the one-program method's recursion
(:func:`decentral_jax.optim.streaming_sync.streaming_diloco`) with the
learners' token-weighted mean in place of its ``pmean``.

With a compressor (``RunSpec.compressor``) the learner sends
``Q(Delta_w + e_w)`` (:func:`decentral_jax.comm.compress.
compress_with_feedback`) and keeps the residual ``e_w``.

The learner reaches the synchronizer through a :class:`Link` (Ray actor
calls in :mod:`decentral_jax.tools.learners.cluster`, direct calls in
tests). A restarted learner joins again and starts from the current
``theta``. With ``RunSpec.keep_state`` (the default) the learner sends its
inner optimizer state and its error feedback residual to the synchronizer
before each pseudo-gradient (whole, or fragment 0's), and a restarted
learner starts from the ones it sent before the pseudo-gradient of the
version before the current one: in sync mode exactly the state it started
the current period with, so the period it redoes is the one it lost.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax.comm import compress
from decentral_jax.optim import local_steps
from decentral_jax.tools.learners import fragments as fragments_lib
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib


class Link:
  """How a learner calls the synchronizer: ``call(name, *args)`` returns
  the method's result or raises ``ConnectionError`` (the synchronizer is
  down or did not answer in time)."""

  def __init__(self, call: Callable):
    self.call = call


def inner_optimizer(run: spec_lib.RunSpec) -> optax.GradientTransformation:
  """The inner optax transform of ``run`` (``sgd`` or ``adamw``)."""
  return {"sgd": optax.sgd, "adamw": optax.adamw}[run.inner](run.inner_lr)


def local_updates(h: int, v: float, v_max: float) -> int:
  """Dynamic Local Updates: ``max(1, floor(v / v_max * h))`` (``h`` when
  no speed is known yet)."""
  if v <= 0 or v_max <= 0:
    return h
  return max(1, min(h, math.floor(v / v_max * h)))


class Learner:
  """One learner of ``run`` with id ``learner`` (= its data shard).

  Args:
    run: the run spec the synchronizer was started with (a different one
      is refused at join, naming the field).
    learner: the learner id in ``[0, run.shards)``.
    link: the :class:`Link` to the synchronizer.
    retry_s: how long a call to an unreachable synchronizer is retried
      (a restarting synchronizer) before the learner stops with an error.
    start: start the training thread now.
  """

  def __init__(self, run: spec_lib.RunSpec, learner: int, link: Link, *,
               retry_s: float = 60.0, start: bool = True):
    self.run, self.id, self._link, self._retry_s = run, learner, link, retry_s
    self._problem = problems.build(run.problem, run.shards, run.problem_args)
    inner = self._problem.inner or inner_optimizer(run)
    self._inner = inner
    grad = jax.grad(self._problem.loss)

    def step(x, state, batch):
      return local_steps.inner_step(inner, grad(x, batch), state, x,
                                    "learner")

    self._step = jax.jit(step)
    self._codec = run.codec()
    self._feedback = jax.jit(lambda v, e: compress.compress_with_feedback(
        self._codec, v, e))
    self._error: dict = {}  # error feedback residuals (see keep_state)
    self.state = {"learner": learner, "pid": os.getpid(), "version": -1,
                  "steps": 0, "tokens": 0, "periods": 0, "bytes": 0,
                  "state_bytes": 0, "restored": [],
                  "waits": [], "h": [], "joined": [], "error": None,
                  "done": False}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._main, daemon=True)
    if start:
      self._thread.start()

  # ---------------------------------------------------------------- calls
  def _call(self, name: str, *args):
    deadline = time.monotonic() + self._retry_s
    while True:
      try:
        return self._link.call(name, *args)
      except ConnectionError:
        if time.monotonic() > deadline or self._stop.is_set():
          raise
        time.sleep(0.05)

  def _join(self) -> dict:
    info = self._call("join", self.id, self.run.fingerprint())
    self.state["joined"].append(info["version"])
    return info

  # ----------------------------------------------------------------- loop
  def _main(self) -> None:
    try:
      if self.run.streaming:
        self._train_fragments()
      else:
        self._train()
    except Exception as e:  # pylint: disable=broad-exception-caught
      self.state["error"] = f"{type(e).__name__}: {e}"

  def _train(self) -> None:
    info = self._join()
    x = info["theta"]
    base, theta_base, t = info["version"], info["theta"], 0
    inner_state = self._restore(info, self._inner.init(
        jax.tree.map(jnp.asarray, x)))
    tokens, speed, v_max = 0, 0.0, info["v_max"]
    while not info["done"] and not self._stop.is_set():
      h = self.run.sync_every
      if self.run.dynamic_updates:
        h = local_updates(h, speed, v_max)
      x, inner_state, t, speed = self._period(x, inner_state, base, t, h)
      tokens += h * self._problem.tokens_per_step
      delta = self._encode({k: np.asarray(theta_base[k] - np.asarray(x[k]),
                                          np.float32) for k in theta_base})
      self._keep(base, inner_state)
      started = time.monotonic()
      info = self._sync(base, delta, tokens, speed)
      self.state["waits"].append(time.monotonic() - started)
      self.state["periods"] += 1
      v_max = info["v_max"]
      tokens = 0
      if info["theta"] is not None:
        x = theta_base = info["theta"]
        base, t = info["version"], 0
      else:  # decoupled, nothing newer: the next Delta counts from here
        theta_base = {k: np.asarray(v, np.float32) for k, v in x.items()}
      self.state["version"] = base
    self.state["done"] = True

  def _train_fragments(self) -> None:
    """Streaming DiLoCo's schedule: fragment ``p`` sent after the steps
    ``t % H == o_p``, merged ``tau`` steps later."""
    run, info = self.run, self._join()
    keys = fragments_lib.fragment_keys(info["theta"], run.fragments)
    offs = fragments_lib.offsets(run.sync_every, run.fragments)
    x = {k: jnp.asarray(v) for k, v in info["theta"].items()}
    inner_state = self._restore(info, self._inner.init(x))
    base = [{k: info["theta"][k] for k in ks} for ks in keys]
    have = list(info["versions"])
    t = fragments_lib.start_step(have, offs, run.sync_every,
                                 run.overlap_steps)
    last_send, due, done = [t] * len(keys), {}, info["done"]
    while not done and not self._stop.is_set():
      x, inner_state, t, _ = self._period(x, inner_state, 0, t, 1,
                                          count_h=False)
      for p, ks in enumerate(keys):
        if fragments_lib.is_send(t, offs[p], run.sync_every):
          xp = {k: np.asarray(x[k], np.float32) for k in ks}
          delta = self._encode({k: base[p][k] - xp[k] for k in ks})
          tokens = (t - last_send[p]) * self._problem.tokens_per_step
          last_send[p] = t
          if p == 0:
            self._keep(have[0], inner_state)
          self._push(have[p], delta, tokens, 0.0, p)
          due[p], base[p] = (t + run.overlap_steps, have[p], delta,
                             tokens), xp
        if p in due and due[p][0] == t:
          info = self._await_fragment(p, *due.pop(p)[1:])
          done = info["done"]
          if info["theta"] is not None:
            a = np.float32(run.merge_alpha)
            for k in ks:
              x[k] = jnp.asarray(a * np.asarray(x[k]) + np.float32(
                  1.0 - run.merge_alpha) * info["theta"][k])
            base[p], have[p] = info["theta"], info["version"]
          self.state["periods"] += p == 0
          self.state["version"] = min(have)
    self.state["done"] = True

  def _restore(self, info, inner_state):
    """The inner state (and error feedback residual) the synchronizer kept
    for this learner (``info["kept"]``), else ``inner_state``."""
    kept = info.get("kept")
    if kept is None:
      return inner_state
    self._error = {k: np.asarray(v) for k, v in kept["error"].items()}
    self.state["restored"].append(info["version"])
    return jax.tree.unflatten(jax.tree.structure(inner_state),
                              [jnp.asarray(v) for v in kept["inner"]])

  def _keep(self, base, inner_state) -> None:
    """Sends the inner state and residual to the synchronizer (before the
    pseudo-gradient of version ``base``); nothing to send, nothing sent."""
    leaves = [np.asarray(v) for v in jax.tree.leaves(inner_state)]
    if not self.run.keep_state or not (leaves or self._error):
      return
    self.state["state_bytes"] += sum(v.nbytes for v in leaves) + sum(
        v.nbytes for v in self._error.values())
    self._call("keep", self.id, base, {"inner": leaves,
                                       "error": dict(self._error)})

  def _push(self, base, delta, tokens, speed, fragment=0) -> None:
    answer = self._call("push", self.id, base, delta, tokens, speed, fragment)
    if answer == "unknown":
      self._join()
    elif answer.startswith("rejected"):
      raise RuntimeError(f"the synchronizer {answer}")

  def _await_fragment(self, p, version, delta, tokens) -> dict:
    """Sync mode: waits for fragment ``p``'s merge of ``version``;
    decoupled: asks once."""
    started = time.monotonic()
    while True:
      info = self._call("latest_fragment", self.id, p, version)
      if not info["known"]:
        self._join()
        continue
      if (self.run.mode == "decoupled" or info["theta"] is not None
          or info["done"]):
        self.state["waits"].append(time.monotonic() - started)
        return info
      if not info["pending"]:  # a restarted synchronizer lost it
        self._call("push", self.id, version, delta, tokens, 0.0, p)
      time.sleep(0.002)

  def _encode(self, delta: dict) -> dict:
    """``delta``, or with a compressor its payloads ``Q(Delta + e)`` with
    the residual ``e`` kept here (error feedback)."""
    self.state["bytes"] += sum(
        self._codec.payload_bytes(v.size) for v in delta.values())
    if self._codec.is_identity:
      return delta
    out = {}
    for k, v in delta.items():
      error = self._error.get(k, np.zeros_like(v))
      payload, _, error = self._feedback(jnp.asarray(v), jnp.asarray(error))
      self._error[k] = np.asarray(error)
      out[k] = {n: np.asarray(p) for n, p in payload.items()}
    return out

  def _period(self, x, inner_state, base, t, h, count_h=True):
    """``h`` inner steps from ``x`` (batches ``base H + t ...``); returns
    ``(x, state, t, steps/s)``."""
    start = time.monotonic()
    x = jax.tree.map(jnp.asarray, x)
    sleep = self.run.sleep_of(self.id)
    for _ in range(h):
      batch = self._problem.batch(self.id, base * self.run.sync_every + t)
      x, inner_state = self._step(x, inner_state, batch)
      t += 1
      if sleep:
        time.sleep(sleep)
    jax.block_until_ready(x)
    self.state["steps"] += h
    self.state["tokens"] += h * self._problem.tokens_per_step
    if count_h:
      self.state["h"].append(h)
    return x, inner_state, t, h / max(time.monotonic() - start, 1e-9)

  def _sync(self, base, delta, tokens, speed) -> dict:
    """Sends the pseudo-gradient; in sync mode waits for the merge."""
    self._push(base, delta, tokens, speed)
    while True:
      info = self._call("latest", self.id, base)
      if not info["known"]:
        self._join()
        continue
      if (self.run.mode == "decoupled" or info["theta"] is not None
          or info["done"]):
        return info
      if not info["pending"]:  # a restarted synchronizer lost it
        self._call("push", self.id, base, delta, tokens, speed)
      time.sleep(0.002)

  def status(self) -> dict:
    """The learner's counters: version, inner steps, tokens, periods, bytes
    of pseudo-gradients sent, the
    seconds each sync took (``waits``), the ``H_w`` of each period, the
    versions it joined at, an error that stopped it, ``done``."""
    return {k: (list(v) if isinstance(v, list) else v)
            for k, v in self.state.items()}

  def stop(self, timeout: float = 10.0) -> dict:
    """Stops the training thread after the current period; returns
    :meth:`status`."""
    self._stop.set()
    self._thread.join(timeout)
    return self.status()
