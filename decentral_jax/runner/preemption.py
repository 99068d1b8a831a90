"""Stopping a run on SIGTERM or SIGINT after a step, with a checkpoint.

:class:`StopRequest` turns the signals into a question the training loop
asks after every step (:func:`decentral_jax.runner.train.train_and_evaluate`
then saves a checkpoint of that step and raises
:class:`~decentral_jax.runner.train.Preempted`). In a single process its
handlers set a flag; in a multi-process job JAX's preemption service
receives SIGTERM and every process stops after the same step.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax
from jax.experimental import multihost_utils

#: The signals that stop a run after its current step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
  """SIGTERM/SIGINT during a run, as a per-step question to the loop.

  Single process: handlers set a flag (a second SIGINT interrupts at once).
  Multi-process: JAX's preemption service owns SIGTERM (a Python handler
  would replace its own), and
  ``multihost_utils.reached_preemption_sync_point`` is true at the same
  step on every process after any of them received it.
  """

  def __init__(self):
    self.signum = None
    self._old = {}
    self._multi = jax.process_count() > 1

  def __enter__(self) -> "StopRequest":
    if not self._multi and \
        threading.current_thread() is threading.main_thread():
      for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:  # e.g. SIGINT under nohup
          old = signal.signal(sig, self._handle)
          self._old[sig] = signal.SIG_DFL if old is None else old
    return self

  def begin(self, step: int) -> None:
    """Registers the first step (multi-process: before the first step, so
    a notice received during start-up still finds a sync point)."""
    if not self._multi:
      return
    try:
      self.requested(step)
    except RuntimeError:  # jax_enable_preemption_service=False
      logging.warning("JAX's preemption service is disabled: SIGTERM stops "
                      "this job without a checkpoint.")
      self._multi = False

  def _handle(self, signum, frame) -> None:
    del frame
    self.signum = signum
    if signum == signal.SIGINT:  # Ctrl-C twice: stop at once
      signal.signal(signum, self._old[signum])

  def __exit__(self, *exc) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)

  def requested(self, step: int) -> bool:
    """True if the run must stop after ``step`` (call it at every step)."""
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signum = signal.SIGTERM
    return self.signum is not None
