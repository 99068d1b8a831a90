"""Helpers shared by the data modules: the per-epoch worker sharding rule,
and what is wrong with a data path (:func:`check_data_path`).

The rule (used by :class:`decentral_jax.data.text.LMSampler` over text
windows and :class:`decentral_jax.data.fashion_mnist.ArraySampler` over
examples): with ``n_items`` items, ``n`` workers and ``B`` items per worker per
step,

* ``steps_per_epoch = n_items // (n * B)``, ``shard = steps_per_epoch * B``;
* epoch ``e = step // steps_per_epoch``; the items are permuted with
  ``np.random.default_rng(SeedSequence([seed, e]))``;
* worker ``w`` owns the contiguous slice ``perm[w * shard:(w + 1) * shard]``
  (shards of different workers are disjoint; the ``n_items - n * shard``
  left-over items are skipped in that epoch, a different set each epoch);
* at step ``s`` worker ``w`` reads items ``(s mod steps_per_epoch) * B`` to
  ``+ B`` of its shard.

Everything is a pure function of ``(seed, step, worker)``, so a resumed run or
a process that serves only some workers sees exactly the same batches.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Iterable

import numpy as np

from decentral_jax import checks


class DataNotFoundError(ValueError, FileNotFoundError):
  """A data file or directory is missing (both a ValueError and a
  FileNotFoundError, so either ``except`` catches it)."""


def path_problem(path: str | os.PathLike, directory: bool = False
                 ) -> str | None:
  """Why ``path`` is not a regular file (``directory``: not a directory),
  as the rest of a sentence naming it; None when it is one. Symbolic links
  are followed; nothing is opened (a FIFO does not block).

  Returns:
    None, or one of ``"does not exist"``, ``"is a symbolic link to a path
    that does not exist"``, ``"is a directory, not a file"``, ``"is a file,
    not a directory"``, ``"is not a regular file (a FIFO, a socket or a
    device)"`` (``"is not a directory (...)"``), ``"does not exist (a
    folder on its path is a file)"`` or ``"cannot be examined: REASON"``.
  """
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return ("is a symbolic link to a path that does not exist"
            if os.path.islink(path) else "does not exist")
  except NotADirectoryError:
    return "does not exist (a folder on its path is a file)"
  except OSError as e:
    return f"cannot be examined: {e.strerror or e}"
  if stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode):
    return None
  if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
    return ("is a file, not a directory" if directory else
            "is a directory, not a file")
  kind = "a directory" if directory else "a regular file"
  return f"is not {kind} (a FIFO, a socket or a device)"


def check_data_path(path: str | os.PathLike, what: str, fix: str,
                    directory: bool = False) -> str:
  """``os.fspath(path)`` if it is a regular file (``directory``: a
  directory).

  Raises:
    DataNotFoundError: one line, ``"{what} {path!r} {problem}; {fix}."``
      (the problem as :func:`path_problem` words it).
  """
  path = os.fspath(path)
  problem = path_problem(path, directory)
  if problem:
    raise DataNotFoundError(f"{what} {path!r} {problem}; {fix}.")
  return path


class EpochSharder:
  """Deterministic per-epoch permutation of ``n_items`` dealt to workers.

  Attributes:
    n_items: number of items (windows or examples).
    n_workers: number of workers ``n``.
    local_batch: items per worker per step ``B``.
    seed: non-negative int seed.
    steps_per_epoch: ``n_items // (n_workers * local_batch)``.
  """

  def __init__(self, n_items: int, n_workers: int, local_batch: int,
               seed: int, *, what: str = "n_items", fix: str = ""):
    """Creates the sharder.

    Args:
      n_items: number of items.
      n_workers: workers ``n >= 1``.
      local_batch: per-worker batch ``B >= 1``.
      seed: int >= 0.
      what: how to name ``n_items`` in the error message.
      fix: a hint appended to the too-few-items error message.

    Raises:
      ValueError: a non-positive size, a negative seed, or fewer than
        ``n_workers * local_batch`` items (one global batch).
    """
    self.n_workers = checks.check_int("n_workers", n_workers, minimum=1)
    self.local_batch = checks.check_int("local_batch", local_batch, minimum=1)
    self.seed = checks.check_int("seed", seed, minimum=0)
    self.n_items = checks.check_int(what, n_items, minimum=0)
    global_batch = self.n_workers * self.local_batch
    if self.n_items < global_batch:
      raise ValueError(
          f"{what}={self.n_items} is smaller than one global batch "
          f"(n_workers * local_batch = {self.n_workers} * {self.local_batch} "
          f"= {global_batch}){'; ' + fix if fix else '.'}")
    self.steps_per_epoch = self.n_items // global_batch
    self._shard = self.steps_per_epoch * self.local_batch
    self._lock = threading.Lock()
    self._cache: tuple[int, np.ndarray] | None = None

  def permutation(self, epoch: int) -> np.ndarray:
    """The item permutation of ``epoch``, int64 [n_items] (cached).

    Raises:
      ValueError: ``epoch`` not an int >= 0.
    """
    epoch = checks.check_int("epoch", epoch, minimum=0)
    with self._lock:
      if self._cache is None or self._cache[0] != epoch:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
        self._cache = (epoch, rng.permutation(self.n_items).astype(np.int64))
      return self._cache[1]

  def workers(self, workers: Iterable[int] | None) -> np.ndarray:
    """Validated worker ids, int64 [W] (default: all workers)."""
    if workers is None:
      return np.arange(self.n_workers, dtype=np.int64)
    ws = np.asarray(list(workers))
    if ws.ndim != 1 or not np.issubdtype(ws.dtype, np.integer) or (
        ws.size and (ws.min() < 0 or ws.max() >= self.n_workers)):
      raise ValueError(f"workers must be ints in [0, n_workers={self.n_workers})"
                       f", got {list(workers)!r}.")
    return ws.astype(np.int64)

  def ids(self, step: int, workers: Iterable[int] | None = None) -> np.ndarray:
    """Item ids of ``workers`` at ``step``.

    Args:
      step: global step >= 0.
      workers: worker ids (default: all, in order).

    Returns:
      int64 [len(workers), local_batch].

    Raises:
      ValueError: negative step or an out-of-range worker.
    """
    step = checks.check_int("step", step, minimum=0)
    ws = self.workers(workers)
    epoch, s = divmod(step, self.steps_per_epoch)
    perm = self.permutation(epoch)
    starts = ws * self._shard + s * self.local_batch
    return perm[starts[:, None] + np.arange(self.local_batch)]
