"""Learners and a synchronizer as Ray actors (Ray: ``pip install
'.[ray]'`` from a clone; imported only here, only when used).

:class:`Cluster` starts the synchronizer actor (restarted by Ray up to
``sync_restarts`` times; it resumes from its Orbax checkpoint) and one
actor per learner (restarted up to ``learner_restarts`` times; a restarted
learner joins again with the current ``theta``). Pseudo-gradients and
``theta`` travel as NumPy arrays through Ray's object store.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import learner as learner_lib
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib

RAY_MISSING = ("Ray is not installed; install the learners' extra: "
               "pip install -r requirements-ray.txt (or pip install '.[ray]' "
               "from a clone).")


def require_ray():
  """The ``ray`` module.

  Raises:
    ImportError: Ray is not installed (one line naming the extra).
  """
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(RAY_MISSING) from None
  return ray


def start(address: str | None = None, *, num_cpus: int | None = None,
          timeout_s: float = 10.0) -> None:
  """Starts Ray on this machine (``address`` None: bound to 127.0.0.1, no
  dashboard) or attaches to the cluster at ``host:port`` (a ``ray start
  --head`` node), probed first for at most ``timeout_s`` seconds.

  Raises:
    ImportError: Ray is missing.
    ValueError: ``address`` not HOST:PORT (:func:`flag_types.host_port`;
      the flag check refuses it first).
    ConnectionError: ``address`` cannot be reached within ``timeout_s``
      (one line naming it and the fix).
  """
  if address is not None:
    probe(address, timeout_s)
  ray = require_ray()
  if ray.is_initialized():
    return
  if address is None:
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=True,
             configure_logging=False)
    return
  ray.init(address=address, log_to_driver=True, configure_logging=False)


def probe(address: str, timeout_s: float) -> None:
  """Checks that ``host:port`` accepts a TCP connection within
  ``timeout_s`` seconds.

  Raises:
    ValueError: a malformed address (:func:`flag_types.host_port`).
    ConnectionError: nothing answers in time.
  """
  host, port = flag_types.host_port(address, "--address")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=timeout_s):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConnectionError(
            f"cannot reach the synchronizer's Ray cluster at {address} "
            f"within {timeout_s:g} s ({e.strerror or e}); start it with "
            "`ray start --head` there or pass the right --address.") from None
      time.sleep(0.2)


def ray_link(handle, timeout_s: float = 30.0) -> learner_lib.Link:
  """A :class:`~decentral_jax.tools.learners.learner.Link` calling the
  synchronizer actor ``handle``; a dead, restarting or silent actor is a
  ``ConnectionError``."""
  ray = require_ray()
  lost = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
          ray.exceptions.ActorUnavailableError)

  def call(name, *args):
    try:
      return ray.get(getattr(handle, name).remote(*args), timeout=timeout_s)
    except lost as e:
      raise ConnectionError(f"synchronizer unreachable: {type(e).__name__}"
                            ) from None

  return learner_lib.Link(call)


class SynchronizerActor(sync_lib.Synchronizer):
  """The synchronizer as an actor: also reports its process id."""

  def pid(self) -> int:
    return os.getpid()


class LearnerActor:
  """A learner as an actor: trains in a thread started at construction
  (so a restarted actor resumes by itself)."""

  def __init__(self, run, learner, handle, retry_s):
    self.core = learner_lib.Learner(run, learner, ray_link(handle),
                                    retry_s=retry_s)

  def status(self) -> dict:
    return self.core.status()

  def stop(self) -> dict:
    return self.core.stop()

  def pid(self) -> int:
    return os.getpid()


class Cluster:
  """A synchronizer and its learners on the Ray cluster :func:`start`
  attached to.

  Args:
    run: the run spec.
    checkpoint_dir: the synchronizer's Orbax directory (None: no
      checkpoints, a killed synchronizer loses everything).
    learner_restarts: Ray restarts of a killed learner.
    sync_restarts: Ray restarts of a killed synchronizer.
    retry_s: how long a learner retries an unreachable synchronizer.
  """

  def __init__(self, run: spec_lib.RunSpec, checkpoint_dir: str | None = None,
               *, learner_restarts: int = 3, sync_restarts: int = 3,
               retry_s: float = 60.0):
    self._ray = require_ray()
    self.run, self._retry_s = run, retry_s
    self._learner_restarts = learner_restarts
    actor = self._ray.remote(SynchronizerActor).options(
        num_cpus=0, max_restarts=sync_restarts, max_task_retries=-1,
        max_concurrency=4)
    self.synchronizer = actor.remote(run, checkpoint_dir)
    self.learners: dict[int, object] = {}

  def add(self, learner: int, run: spec_lib.RunSpec | None = None):
    """Starts learner ``learner`` (with ``run``, default the cluster's: a
    different one is refused at join); returns its actor handle."""
    actor = self._ray.remote(LearnerActor).options(
        num_cpus=0, max_restarts=self._learner_restarts, max_task_retries=-1)
    self.learners[learner] = actor.remote(run or self.run, learner,
                                          self.synchronizer, self._retry_s)
    return self.learners[learner]

  def remove(self, learner: int) -> dict:
    """Learner ``learner`` leaves: stops after its period, then leaves
    the synchronizer's active set; returns its last status."""
    handle = self.learners.pop(learner)
    status = self._ray.get(handle.stop.remote())
    self._ray.get(self.synchronizer.leave.remote(learner))
    self._ray.kill(handle, no_restart=True)
    return status

  def kill(self, learner: int | None = None) -> int:
    """SIGKILLs the process of learner ``learner`` (None: the
    synchronizer's); Ray restarts it. Returns the killed process id."""
    handle = (self.synchronizer if learner is None
              else self.learners[learner])
    pid = self._ray.get(handle.pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid

  def status(self) -> dict:
    """The synchronizer's :meth:`~decentral_jax.tools.learners.
    synchronizer.Synchronizer.status`."""
    return self._ray.get(self.synchronizer.status.remote())

  def learner_status(self, timeout_s: float = 30.0) -> dict:
    """``{id: status}`` of every learner (a restarting one answers once
    it is back)."""
    refs = {i: h.status.remote() for i, h in self.learners.items()}
    return {i: self._ray.get(r, timeout=timeout_s) for i, r in refs.items()}

  def wait(self, version: int | None = None, timeout_s: float = 120.0,
           every_s: float = 0.05, progress=None) -> dict:
    """Waits until ``version`` merged periods (default: the run's end);
    ``progress(status)`` is called on every poll. Returns the status.

    Raises:
      TimeoutError: not reached within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
      status = self.status()
      if progress is not None:
        progress(status)
      want = status["periods"] if version is None else version
      if status["version"] >= want:
        return status
      if time.monotonic() > deadline:
        raise TimeoutError(f"{status['version']} of {want} periods merged "
                           f"after {timeout_s:g} s (active learners "
                           f"{status['active']}).")
      time.sleep(every_s)

  def hold(self, version: int | None) -> None:
    """The synchronizer merges no period past ``version`` (None: freely);
    see :meth:`~decentral_jax.tools.learners.synchronizer.Synchronizer.hold`."""
    self._ray.get(self.synchronizer.hold.remote(version))

  def set_periods(self, periods: int) -> None:
    """Ends the run after ``periods`` merged periods."""
    self._ray.get(self.synchronizer.set_periods.remote(periods))

  def params(self) -> dict:
    """The synchronizer's ``theta``, version and outer state leaves."""
    return self._ray.get(self.synchronizer.params.remote())

  def close(self) -> None:
    """Stops and removes every actor."""
    for handle in self.learners.values():
      self._ray.kill(handle, no_restart=True)
    self.learners = {}
    self._ray.kill(self.synchronizer, no_restart=True)
