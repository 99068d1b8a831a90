"""Dummy nanoGPT token files (all zeros) for compiles that read no text.

``overlap --data_dir`` and ``benchmarks/bench_overlap_at_scale.py --bins``
give a gpt2_small config a ``train.bin`` and ``val.bin`` of zero tokens
(uint16, native byte order as ``np.tofile`` writes): the programs compile
alike on any tokens. The directory a user names may already be a real
token directory; :func:`write_dummy_bins` never replaces one. No JAX.
"""

from __future__ import annotations

import os

import numpy as np

#: Bytes per token (uint16, as nanoGPT's token files).
TOKEN_BYTES = 2
_CHUNK = 2**20


def _is_dummy(path: str, tokens: int) -> bool:
  """Whether ``path`` is a regular file of exactly ``tokens`` zero tokens."""
  if os.path.islink(path) or not os.path.isfile(path):
    return False
  if os.path.getsize(path) != tokens * TOKEN_BYTES:
    return False
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      if chunk.count(0) != len(chunk):
        return False
  return True


def check_dummy_bins(directory: str, tokens: dict, flag: str) -> list[str]:
  """The names of ``tokens`` (``{"train.bin": n, ...}``: file name ->
  number of uint16 tokens) that :func:`write_dummy_bins` must write in
  ``directory``: those absent. A file already there is kept only if it is
  exactly the dummy (``n`` zero tokens, ``2 n`` bytes, a regular file,
  not a symbolic link); anything else may be the user's data.

  Raises:
    ValueError: ``--data_dir 'D' already holds train.bin (2000000 bytes,
      not the 600000 bytes of zeros this command writes); give an empty
      or new directory``, one line naming ``flag``.
  """
  missing = []
  for name, n in tokens.items():
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
      missing.append(name)
      continue
    try:
      if _is_dummy(path, int(n)):
        continue
      what = (f"{os.path.getsize(path)} bytes, not" if os.path.isfile(path)
              and not os.path.islink(path) else "not a regular file, nor")
    except OSError as e:
      what = f"unreadable: {e.strerror or e}; not"
    raise ValueError(
        f"{flag} {directory!r} already holds {name} ({what} the "
        f"{int(n) * TOKEN_BYTES} bytes of zeros this command writes), which "
        f"it would replace; give {flag} an empty or new directory.")
  return missing


def write_dummy_bins(directory: str, tokens: dict, flag: str) -> str:
  """Writes the dummy token files ``tokens`` (``{name: n tokens}``) in
  ``directory`` (created if missing) and returns it: each absent file as
  ``n`` zero uint16 tokens; one that already is exactly that is kept.
  Every file is checked (:func:`check_dummy_bins`) before any is written.

  Raises:
    ValueError: a file there that is not the dummy (nothing written), or
      the directory or a file that cannot be written; one line naming
      ``flag``.
  """
  missing = check_dummy_bins(directory, tokens, flag)
  try:
    os.makedirs(directory, exist_ok=True)
    for name in missing:
      np.zeros(int(tokens[name]), np.uint16).tofile(
          os.path.join(directory, name))
  except OSError as e:
    raise ValueError(f"{flag} {directory!r}: cannot write the dummy token "
                     f"files ({e.strerror or e}); give a writable "
                     "directory.") from None
  return directory
