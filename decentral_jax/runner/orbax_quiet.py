"""Orbax's log noise: its INFO records and its echoes of errors raised here.

Orbax logs a failed save's traceback (``absl``, ``asyncio`` "exception was
never retrieved") and TensorStore prints it again as "ignored" exceptions
through ``sys.unraisablehook``, while :mod:`decentral_jax.runner.checkpoint`
raises the same error to the caller in one line. :class:`EchoFilter`
drops those echoes while a
:class:`~decentral_jax.runner.checkpoint.Checkpointer` is open and
restores the loggers and the hook afterwards, as well as Orbax's reports
of a step directory's damaged metadata (the checkpoint's verification
names that damage in its one fallback warning); :func:`quiet_orbax_logs`
also hides Orbax's INFO records, for the rest of the process (the
command-line programs call it). Other warnings stay.
"""

from __future__ import annotations

import logging
import sys


#: Orbax's records about a step directory's damaged or missing metadata:
#: the checkpoint's own verification reports the same damage in one
#: warning (and falls back), or tolerates a missing file.
_METADATA_ECHOES = ("Metadata file does not exist",
                    "Failed to json parse Metadata file")


class OrbaxNoise(logging.Filter):
  """Drops Orbax's INFO records, its tracebacks of errors raised here, and
  its reports of a step's damaged metadata (:data:`_METADATA_ECHOES`)."""

  def __init__(self, quiet_info: bool):
    super().__init__()
    self.quiet_info = quiet_info

  def filter(self, record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if not ("orbax" in record.pathname or "orbax" in msg or "OCDBT" in msg
            or _raised_in_orbax(record.exc_info)):
      return True
    if record.exc_info or "exception was never retrieved" in msg:
      return False  # the same error is raised to the caller, in one line
    if msg.startswith(_METADATA_ECHOES):
      return False  # the checkpoint's verification names it, once
    return record.levelno >= logging.WARNING or not self.quiet_info


def _raised_in_orbax(exc_info) -> bool:
  tb = exc_info[2] if exc_info else None
  while tb is not None:
    if "orbax" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _orbax_unraisable(unraisable) -> bool:
  """Echoes of a failed Orbax save or read printed as "ignored" exceptions
  (TensorStore callbacks into Orbax's closed event loop, its coroutines)."""
  exc, tb = unraisable.exc_value, unraisable.exc_traceback
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    while tb is not None and tb.tb_frame.f_code.co_name != \
        "call_soon_threadsafe":
      tb = tb.tb_next
    return tb is not None
  return "orbax" in repr(unraisable.object) or _raised_in_orbax(
      (None, None, tb))


_NOISY_LOGGERS = ("absl", "asyncio")


def _echo_hook(chained):
  """An unraisable hook that drops Orbax's echoes and passes the rest on."""
  def filtered(unraisable):
    if not (filtered.active and _orbax_unraisable(unraisable)):
      chained(unraisable)
  filtered.active, filtered.chained = True, chained
  return filtered


class EchoFilter:
  """Orbax's echoes of errors raised here, dropped while installed.

  :meth:`install` adds an :class:`OrbaxNoise` filter to the ``absl`` and
  ``asyncio`` loggers and an unraisable hook chained to the current one;
  :meth:`remove` takes them off again. If another hook was installed over
  this one in between, this one stays in the chain but stops filtering, and
  is unlinked when the hook over it is removed, so any order of removals
  leaves ``sys.unraisablehook`` as it was.
  """

  def __init__(self):
    self._filters = []
    self._hook = None

  def install(self) -> None:
    for name in _NOISY_LOGGERS:
      logger, noise = logging.getLogger(name), OrbaxNoise(quiet_info=False)
      logger.addFilter(noise)
      self._filters.append((logger, noise))
    self._hook = _echo_hook(sys.unraisablehook)
    sys.unraisablehook = self._hook

  def remove(self) -> None:
    for logger, noise in self._filters:
      logger.removeFilter(noise)
    self._filters = []
    hook, self._hook = self._hook, None
    if hook is None:
      return
    hook.active = False
    if sys.unraisablehook is hook:
      previous = hook.chained
      while getattr(previous, "active", True) is False:  # removed before
        previous = previous.chained
      sys.unraisablehook = previous


_quieted = []  # the filters of quiet_orbax_logs, once installed


def quiet_orbax_logs() -> None:
  """Hides Orbax's INFO messages and its echoes of errors raised here.

  For command-line programs: installs, for the rest of the process, a
  filter on the ``absl`` and ``asyncio`` loggers (warnings stay) and an
  unraisable hook dropping Orbax's "ignored" exceptions. A
  :class:`Checkpointer` drops the echoes by itself while it is open.
  """
  if _quieted:
    return
  for name in _NOISY_LOGGERS:
    noise = OrbaxNoise(quiet_info=True)
    logging.getLogger(name).addFilter(noise)
    _quieted.append(noise)
  sys.unraisablehook = _echo_hook(sys.unraisablehook)
