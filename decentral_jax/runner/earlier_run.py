"""An earlier run's records found by a fresh start of a work directory.

A run with no checkpoint to resume starts at step 0, writes its own
``config.json`` and empties ``metrics.jsonl``. Where the directory holds
the records of an earlier run (a finished run whose checkpoints were
deleted, e.g. by ``compare``), that would destroy them, so
:func:`keep_earlier_records` moves ``metrics.jsonl`` and ``config.json``
aside first (``<name>.earlier``, ``.earlier-2``, ... : an older one is never
overwritten), with one ``warning:`` line on stderr naming both paths.
"""

from __future__ import annotations

import json
import os
import stat
import sys

from decentral_jax import records
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.runner.meta_schema import config_leaves

CONFIG_FILE = "config.json"
#: The suffix of an earlier run's file moved aside (numbered ``-2``, ...).
SUFFIX = ".earlier"
_CHUNK = 1 << 16


def warn(line: str) -> None:
  """Prints ``warning: <line>`` on stderr (one line)."""
  print(f"warning: {line}", file=sys.stderr, flush=True)


def holds_records(path: str) -> bool:
  """Whether ``path`` is a regular file (not followed if a link; a FIFO
  is not opened) holding anything but whitespace."""
  try:
    if not stat.S_ISREG(os.lstat(path).st_mode):
      return False
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
  except OSError:
    return False
  with os.fdopen(fd, "rb") as f:
    while chunk := f.read(_CHUNK):
      if chunk.strip(b" \t\r\n\0"):
        return True
  return False


def _first_difference(stored: dict, mine: dict) -> tuple | None:
  """``(field, stored value, mine)`` of the first leaf that differs."""
  old, new = config_leaves(stored), config_leaves(mine)
  for field in sorted(set(old) | set(new)):
    if old.get(field, "(none)") != new.get(field, "(none)"):
      return field, old.get(field, "(none)"), new.get(field, "(none)")
  return None


def earlier_reason(config, workdir: str) -> str | None:
  """Why ``workdir`` holds an earlier run's records that a fresh start of
  ``config`` would destroy, or None.

  They are an earlier run's when its ``config.json`` (read if it is a
  regular file of a JSON object) is another config by the resume rule
  (:func:`run_meta.config_change`), or when ``metrics.jsonl`` holds
  records and ``config.json`` is not exactly ``config`` (any field,
  ``steps`` included; missing or unreadable: not known to be this run's).
  A log of exactly this config is this run's own and is redone from step 0
  (the same config gives the same records), as is a ``config.json`` alone
  whose run may resume as ``config`` (nothing was trained).
  """
  stored = records.read_json(os.path.join(workdir, CONFIG_FILE))
  stored = stored if isinstance(stored, dict) else None
  mine = json.loads(config.to_json())
  change = (run_meta.config_change(config, stored) if stored is not None
            else None)
  logged = holds_records(os.path.join(workdir, metrics_lib.METRICS_FILE))
  if change is None and (not logged or stored == mine):
    return None
  if change is None and stored is None:
    return (f"its {metrics_lib.METRICS_FILE} is not empty (records or "
            f"other text) but its {CONFIG_FILE} is missing or unreadable, so "
            "it is not known to be this run's")
  field, theirs, ours = change or _first_difference(stored, mine)
  return (f"its {CONFIG_FILE} records another run (config.{field}="
          f"{theirs!r}, this run has {ours!r})")


def _free_suffix(workdir: str, names) -> str:
  """The first of ``.earlier``, ``.earlier-2``, ... taken by none of
  ``names`` in ``workdir``."""
  n, suffix = 1, SUFFIX
  while any(os.path.lexists(os.path.join(workdir, name + suffix))
            for name in names):
    n += 1
    suffix = f"{SUFFIX}-{n}"
  return suffix


def keep_earlier_records(config, workdir: str) -> list[tuple[str, str]]:
  """Before a fresh start (no checkpoint to resume; process 0, lock held):
  if ``workdir`` holds an earlier run's records (:func:`earlier_reason`),
  moves ``metrics.jsonl`` and ``config.json`` (those that exist, whatever
  they are) to ``<name>.earlier`` (``.earlier-2``, ... where taken) and
  prints one ``warning:`` line naming each path and where it went.

  Returns:
    ``[(path, moved to)]`` (empty: nothing of an earlier run).

  Raises:
    workdir.PathError: an entry cannot be moved (names it).
  """
  why = earlier_reason(config, workdir)
  names = [n for n in (metrics_lib.METRICS_FILE, CONFIG_FILE)
           if os.path.lexists(os.path.join(workdir, n))]
  if why is None or not names:
    return []
  suffix, moved = _free_suffix(workdir, names), []
  for name in names:
    src = os.path.join(workdir, name)
    try:
      os.rename(src, src + suffix)
    except OSError as e:
      raise workdir_lib.path_error("move", src, e) from None
    moved.append((src, src + suffix))
  warn(f"{workdir}: {why}, and there is no checkpoint to resume; this fresh "
       "run moved " + " and ".join(f"{a} to {b}" for a, b in moved)
       + " (nothing of the earlier run is deleted) and starts from step 0.")
  return moved
