"""Checkpoints of stacked per-worker training state with Orbax.

A checkpoint holds the whole pytree it is given (every worker's parameters
and optimizer state, stacked ``[n_workers, ...]`` and sharded over the worker
axis, plus step and RNG leaves) and a small JSON document (step, data
position, run facts such as the number of workers) under
``<directory>/<step>/``.

Atomicity: Orbax writes a checkpoint into a temporary directory
``<step>.orbax-checkpoint-tmp...`` and renames it to ``<step>`` only after
every file has been written, so an interrupted save (crash, kill, full disk)
leaves at most a temporary directory, which :meth:`Checkpointer.latest_step`
ignores; the last complete checkpoint stays the one that is restored. Old
checkpoints are deleted only after a newer one has been committed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

PyTree = Any


class _BelowWarningFromOrbax(logging.Filter):
  """Drops Orbax's INFO/DEBUG records (it logs every save phase)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return (record.levelno >= logging.WARNING
            or f"{os.sep}orbax{os.sep}" not in record.pathname)


def quiet_orbax_logs() -> None:
  """Hides Orbax's INFO messages on the ``absl`` logger (warnings stay)."""
  logger = logging.getLogger("absl")
  if not any(isinstance(f, _BelowWarningFromOrbax) for f in logger.filters):
    logger.addFilter(_BelowWarningFromOrbax())


def abstract_like(tree: PyTree) -> PyTree:
  """``jax.ShapeDtypeStruct`` (with sharding) for every array in ``tree``."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      tree)


class Checkpointer:
  """Saves and restores ``(state, meta)`` pairs in one directory.

  Saves are asynchronous: :meth:`save` returns once the arrays have been
  copied off the devices (so the caller may donate or overwrite them) and
  writes files in the background; :meth:`wait` / :meth:`close` block until
  the files are committed.

  Attributes:
    directory: absolute path of the checkpoint directory.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2,
               async_save: bool = True):
    """Opens (creating if needed) a checkpoint directory.

    Args:
      directory: where the ``<step>/`` subdirectories live.
      max_to_keep: number of most recent checkpoints kept (>= 1).
      async_save: write files in a background thread.

    Raises:
      ValueError: ``max_to_keep < 1``.
    """
    if max_to_keep < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {max_to_keep}.")
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or None if there is none."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of all complete checkpoints, ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: PyTree, meta: dict) -> None:
    """Starts saving ``state`` and the JSON-serialisable ``meta`` as ``step``.

    Args:
      step: checkpoint number (completed training steps), int >= 0.
      state: pytree of jax arrays (sharded arrays are saved shard by shard).
      meta: JSON-serialisable dict.
    """
    self._manager.save(
        int(step), force=True,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict]:
    """Restores checkpoint ``step`` into the structure and shardings of ``like``.

    Args:
      step: a step listed by :meth:`all_steps`.
      like: a pytree with the saved structure; its leaves may be arrays or
        ``jax.ShapeDtypeStruct`` with ``sharding`` set.

    Returns:
      ``(state, meta)``: arrays with the shapes, dtypes and shardings of
      ``like``, and the saved JSON dict.

    Raises:
      ValueError: no checkpoint ``step`` in the directory.
    """
    if step not in self.all_steps():
      raise ValueError(f"no complete checkpoint for step {step} in "
                       f"{self.directory} (have {self.all_steps()}).")
    restored = self._manager.restore(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_like(like)),
            meta=ocp.args.JsonRestore()))
    return restored.state, dict(restored.meta)

  def restore_meta(self, step: int) -> dict:
    """Only the JSON document of checkpoint ``step``."""
    restored = self._manager.restore(
        int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored.meta)

  def wait(self) -> None:
    """Blocks until a save in progress has been committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self._manager.wait_until_finished()
    self._manager.close()
