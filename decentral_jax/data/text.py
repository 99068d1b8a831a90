"""Text corpora and language-model batch samplers (host-side NumPy).

Corpora:

* :func:`pydoc_corpus`: about 0.47 MB of real English technical prose bundled
  with CPython (``pydoc_data.topics``); byte-level tokens (vocab 256). No
  download.
* :func:`load_text_file`: any UTF-8/byte text file, byte-level.
* :func:`load_token_bins`: nanoGPT-style ``train.bin``/``val.bin`` (uint16
  GPT-2 token ids, e.g. OpenWebText from nanoGPT's
  ``data/openwebtext/prepare.py``), memory-mapped.

Sampling: :class:`LMSampler` cuts a token array into non-overlapping windows of
``context_len + 1`` tokens and deals them to workers with the per-epoch rule of
:mod:`decentral_jax.data.sharding`; :func:`eval_batches` picks fixed
validation windows.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from decentral_jax import checks
from decentral_jax.data import sharding

_BINS_HINT = (
    "produce it with nanoGPT's data/openwebtext/prepare.py (a flat array of "
    "uint16 GPT-2 token ids written with np.memmap / ndarray.tofile), or use "
    "the bundled byte-level corpus (--config.data.source=pydoc)")


def pydoc_corpus() -> bytes:
  """The English documentation text bundled with CPython.

  Returns:
    UTF-8 bytes of ``pydoc_data.topics.topics`` values joined by newlines in
    sorted key order (about 466 kB for CPython 3.11).
  """
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  return "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode(
      "utf-8")


def byte_splits(data: bytes, val_fraction: float = 0.1
                ) -> tuple[np.ndarray, np.ndarray]:
  """Splits bytes into train (first part) and validation (last part).

  Args:
    data: the corpus.
    val_fraction: fraction in (0, 1) of the bytes, taken from the end, used for
      validation (``n_val = int(len(data) * val_fraction)``).

  Returns:
    ``(train, val)``: uint8 [N - n_val] and uint8 [n_val] (copies).

  Raises:
    ValueError: ``val_fraction`` not a number in (0, 1) or a split that
      would be empty.
  """
  checks.check_probability("val_fraction", val_fraction, open_min=True,
                           open_max=True)
  arr = np.frombuffer(bytes(data), dtype=np.uint8)
  n_val = int(len(arr) * val_fraction)
  if n_val == 0 or n_val == len(arr):
    raise ValueError(f"val_fraction={val_fraction} of {len(arr)} bytes leaves "
                     "an empty split; use a longer corpus or another fraction.")
  return arr[:-n_val].copy(), arr[-n_val:].copy()


def check_text_file(path: str | os.PathLike) -> str:
  """``os.fspath(path)`` if it is a regular file.

  Raises:
    DataNotFoundError: (a ValueError) one line naming the text file and
      why it is none (:func:`decentral_jax.data.sharding.path_problem`:
      missing, a directory, a FIFO or a device).
  """
  return sharding.check_data_path(
      path, "text file", "pass an existing file as --config.data.path or use "
      "the bundled corpus (--config.data.source=pydoc)")


def load_text_file(path: str | os.PathLike) -> bytes:
  """Reads a text file as raw bytes (byte-level tokens; any encoding).

  Raises:
    DataNotFoundError: (a ValueError) ``path`` is not a regular file
      (:func:`check_text_file`).
    ValueError: ``path`` cannot be read or is empty (named).
  """
  path = check_text_file(path)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"text file {path!r} cannot be read: "
                     f"{e.strerror or e}.") from None
  if not data:
    raise ValueError(f"text file {path!r} is empty; pass a file with the "
                     "training text as --config.data.path.")
  return data


#: The files of a token-bin directory: (training tokens, validation tokens).
TOKEN_BIN_FILES = ("train.bin", "val.bin")

_BINS_FIX = ("set --config.data.path= a directory with nanoGPT's train.bin "
             "and val.bin (made by nanoGPT's data/openwebtext/prepare.py)")


def token_bin_paths(data_dir: str | os.PathLike) -> list[str]:
  """The paths of :data:`TOKEN_BIN_FILES` in ``data_dir``, checked to be
  regular files.

  Raises:
    DataNotFoundError: (a ValueError) one line naming the token directory
      or file and why it is none
      (:func:`decentral_jax.data.sharding.path_problem`).
  """
  data_dir = sharding.check_data_path(data_dir, "token directory",
                                      _BINS_FIX, directory=True)
  return [sharding.check_data_path(os.path.join(data_dir, name),
                                   "token file", _BINS_FIX)
          for name in TOKEN_BIN_FILES]


def load_token_bins(data_dir: str | os.PathLike
                    ) -> tuple[np.memmap, np.memmap]:
  """Memory-maps nanoGPT-style ``train.bin`` and ``val.bin``.

  Args:
    data_dir: directory holding ``train.bin`` and ``val.bin``, flat arrays of
      uint16 token ids (GPT-2 BPE, vocab 50257).

  Returns:
    ``(train, val)``: read-only ``np.memmap`` uint16 [N_train], [N_val]; never
    read whole.

  Raises:
    DataNotFoundError: (a ValueError) the directory or a file is missing or
      not one (:func:`token_bin_paths`).
    ValueError: a file that is empty, has an odd number of bytes or cannot
      be mapped (named).
  """
  out = []
  for path in token_bin_paths(data_dir):
    size = os.path.getsize(path)
    if size == 0 or size % 2:
      raise ValueError(f"{path!r} has {'no' if not size else 'an odd number of'}"
                       f" bytes; it must be a flat uint16 array of token ids "
                       f"({_BINS_HINT}).")
    try:
      out.append(np.memmap(path, dtype=np.uint16, mode="r"))
    except (OSError, ValueError) as e:
      raise ValueError(f"token file {path!r} cannot be mapped: "
                       f"{getattr(e, 'strerror', None) or e}.") from None
  return out[0], out[1]


def max_token_id(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
  """The largest id in a 1-D token array (-1 if empty), read chunk by chunk.

  A memmap is read ``chunk`` tokens at a time, so memory stays bounded
  (on a 2-core machine about 0.07 s per 400 MB of uint16 from the page
  cache, 0.9 s from disk).

  Raises:
    ValueError: ``tokens`` is not a 1-D integer array, ``chunk`` not an int
      >= 1.
  """
  tokens = _check_tokens(tokens)
  chunk = checks.check_int("chunk", chunk, minimum=1)
  top = -1
  for start in range(0, len(tokens), chunk):
    top = max(top, int(tokens[start:start + chunk].max()))
  return top


def _check_tokens(tokens) -> np.ndarray:
  if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not (
      np.issubdtype(tokens.dtype, np.integer)):
    raise ValueError("tokens must be a 1-D integer np.ndarray (uint8 bytes or "
                     f"uint16 token ids), got {type(tokens).__name__} "
                     f"{getattr(tokens, 'dtype', '')} "
                     f"{getattr(tokens, 'shape', '')}.")
  return tokens


class LMSampler:
  """Deterministic per-worker language-model batches from one token array.

  Window ``k`` is ``tokens[k*T : k*T + T + 1]`` (``T = context_len``;
  ``n_windows = (len(tokens) - 1) // T``, non-overlapping inputs); windows are
  dealt to workers per epoch as described in
  :mod:`decentral_jax.data.sharding`.

  Attributes:
    tokens: the 1-D token array (uint8 or uint16; may be a memmap).
    context_len: ``T`` tokens per example.
    n_workers: number of workers.
    local_batch: windows per worker per step ``B``.
    seed: sampling seed.
    n_windows: number of windows.
    steps_per_epoch: ``n_windows // (n_workers * local_batch)``.
  """

  def __init__(self, tokens: np.ndarray, context_len: int, n_workers: int,
               local_batch: int, seed: int):
    """Creates the sampler.

    Raises:
      ValueError: bad sizes, or a corpus shorter than one global batch of
        windows (the message names context_len, the corpus length and fixes).
    """
    self.tokens = _check_tokens(tokens)
    self.context_len = checks.check_int("context_len", context_len, minimum=1)
    self.n_windows = max(len(tokens) - 1, 0) // self.context_len
    n_workers = checks.check_int("n_workers", n_workers, minimum=1)
    local_batch = checks.check_int("local_batch", local_batch, minimum=1)
    if self.n_windows < n_workers * local_batch:
      need = n_workers * local_batch * self.context_len + 1
      raise ValueError(
          f"the corpus has {len(tokens)} tokens, which holds {self.n_windows} "
          f"windows of context_len={self.context_len}, but one global batch "
          f"(n_workers * local_batch = {n_workers} * {local_batch}) needs "
          f"{n_workers * local_batch} windows = {need} tokens; use a smaller "
          "context_len, local_batch or n_workers, or a longer corpus.")
    self._sharder = sharding.EpochSharder(self.n_windows, n_workers,
                                          local_batch, seed, what="n_windows")
    self.n_workers = self._sharder.n_workers
    self.local_batch = self._sharder.local_batch
    self.seed = self._sharder.seed
    self.steps_per_epoch = self._sharder.steps_per_epoch

  def window_ids(self, step: int, worker: int) -> np.ndarray:
    """Window indices of ``worker`` at ``step``: int64 [local_batch]."""
    return self._sharder.ids(step, [worker])[0]

  def batch(self, step: int, workers: Iterable[int] | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets of ``workers`` at ``step``.

    Args:
      step: global step >= 0 (epoch = step // steps_per_epoch).
      workers: worker ids (default ``range(n_workers)``); a process of a
        multi-host job asks only for its own workers.

    Returns:
      ``(inputs, targets)``, both int32 [len(workers), local_batch,
      context_len], with ``targets[..., t] = inputs[..., t + 1]`` along the
      corpus (row ``i`` belongs to ``workers[i]``).

    Raises:
      ValueError: negative step or an out-of-range worker.
    """
    ids = self._sharder.ids(step, workers)
    t = self.context_len
    windows = self.tokens[ids[..., None] * t + np.arange(t + 1)]
    windows = np.asarray(windows, dtype=np.int32)
    return (np.ascontiguousarray(windows[..., :-1]),
            np.ascontiguousarray(windows[..., 1:]))


def eval_batches(tokens: np.ndarray, context_len: int, batch: int,
                 n_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Fixed evaluation batches spread evenly over a (validation) token array.

  The ``batch * n_batches`` windows of ``context_len + 1`` tokens start at
  ``round(linspace(0, len(tokens) - context_len - 1, batch * n_batches))``:
  non-overlapping when the array holds that many windows, overlapping
  otherwise. The result does not depend on any seed or worker.

  Args:
    tokens: 1-D integer token array (may be a memmap).
    context_len: ``T`` tokens per example.
    batch: examples per batch ``B``.
    n_batches: number of batches.

  Returns:
    A list of ``n_batches`` pairs ``(inputs, targets)``, int32 [B, T] each,
    with targets the inputs shifted by one token.

  Raises:
    ValueError: bad sizes or fewer than ``context_len + 1`` tokens.
  """
  tokens = _check_tokens(tokens)
  t = checks.check_int("context_len", context_len, minimum=1)
  b = checks.check_int("batch", batch, minimum=1)
  nb = checks.check_int("n_batches", n_batches, minimum=1)
  if len(tokens) < t + 1:
    raise ValueError(f"the evaluation split has {len(tokens)} tokens, fewer "
                     f"than context_len + 1 = {t + 1}; use a smaller "
                     "context_len or a larger validation split.")
  starts = np.round(np.linspace(0, len(tokens) - t - 1, b * nb)).astype(
      np.int64)
  windows = np.asarray(tokens[starts[:, None] + np.arange(t + 1)],
                       dtype=np.int32).reshape(nb, b, t + 1)
  return [(np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:]))
          for w in windows]
