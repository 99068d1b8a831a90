"""The data files a run reads, and their fingerprint in each checkpoint.

The built-in data sources read these files (:func:`source_files`):

* ``text_file``: the file ``config.data.path`` (named ``"text"``);
* ``token_bins``: ``train.bin`` and ``val.bin`` in the directory
  ``config.data.path``;
* the CNN's Fashion-MNIST: its four IDX files in ``config.data.path``
  (default ``/usr/share/datasets/fashion-mnist``), each by its file name
  (``train-images-idx3-ubyte.gz``, ...).

The bundled ``pydoc`` text and a data source of your own
(``config.data.source``) read no file this module knows: nothing is
fingerprinted or compared for them.

The fingerprint of a file (:func:`file_fingerprint`) is its size in bytes
and the SHA-256 of its first and of its last MiB (of the whole file when
it is shorter): cheap for files of any size, computed once when the
:class:`~decentral_jax.runner.experiment.Experiment` is built, not per
step. A checkpoint stores the fingerprints of its run's files (key
``data_files``); a resume compares them with its own
(:func:`resume_mismatch`): another size or other bytes at either end are
other data, refused naming ``config.data.path``, while the same files
moved elsewhere (``data.path`` may change) resume. Bytes changed only in
the middle of a file longer than 2 MiB are not seen. A checkpoint written
before the fingerprint was stored resumes without the comparison.

A data file may not lie where the run writes (:func:`check_not_written`):
at an entry of its work directory a run writes, moves aside or removes
(``config.json``, ``metrics.jsonl``, ``checkpoints/...``), where it would
be replaced; elsewhere in the work directory it is read as anywhere else.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re

from ml_collections import config_dict

from decentral_jax import records
from decentral_jax.data import fashion_mnist
from decentral_jax.data import text

#: Bytes hashed at each end of a file.
END_BYTES = 2**20
#: The facts stored per file: size, SHA-256 of the first and last MiB.
KEYS = ("bytes", "head_sha256", "tail_sha256")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def source_files(config: config_dict.ConfigDict) -> dict[str, str]:
  """``{name: path}`` of the files the built-in data source of ``config``
  reads (module docstring); ``{}`` for ``pydoc`` and a source of your own.

  Raises:
    DataNotFoundError: a Fashion-MNIST file is missing (as the task).
  """
  name, d = config.model.get("name", "gpt"), config.data
  if name == "cnn":
    return {os.path.basename(p): p for p in fashion_mnist.files(
        d.path or fashion_mnist.DEFAULT_DIR).values()}
  if name != "gpt" or not d.get("path"):
    return {}
  if d.source == "text_file":
    return {"text": os.fspath(d.path)}
  if d.source == "token_bins":
    return {f: os.path.join(d.path, f) for f in text.TOKEN_BIN_FILES}
  return {}


def file_fingerprint(path: str) -> dict:
  """``{"bytes": int, "head_sha256": hex, "tail_sha256": hex}`` of the file
  at ``path``: its size and the SHA-256 of its first and last
  :data:`END_BYTES` bytes (both of the whole file when it is shorter).

  Raises:
    ValueError: the file cannot be read (one line naming it).
  """
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      head = f.read(END_BYTES)
      f.seek(max(size - END_BYTES, 0))
      tail = f.read(END_BYTES)
  except OSError as e:
    raise ValueError(f"data file {path!r} (config.data.path) cannot be read: "
                     f"{e.strerror or e}.") from None
  return {"bytes": size, "head_sha256": hashlib.sha256(head).hexdigest(),
          "tail_sha256": hashlib.sha256(tail).hexdigest()}


def fingerprint(config: config_dict.ConfigDict) -> dict:
  """``{name: file_fingerprint}`` of every file of :func:`source_files`;
  what a checkpoint stores as ``data_files``.

  Raises:
    ValueError: a file cannot be read (named).
  """
  return {name: file_fingerprint(path)
          for name, path in sorted(source_files(config).items())}


def stored_error(value) -> str | None:
  """Why a checkpoint's stored ``data_files`` is not one :func:`fingerprint`
  writes (naming the key), or None: an object of ``name -> {"bytes": an
  integer >= 0, "head_sha256"/"tail_sha256": 64 lowercase hex digits}``."""
  if not isinstance(value, dict):
    return f"data_files must be an object, got {records.short(value)}"
  for name, facts in sorted(value.items()):
    key = f"data_files.{name}"
    if not isinstance(facts, dict) or sorted(facts) != sorted(KEYS):
      return f"{key} must be an object of {', '.join(KEYS)}, got " \
             f"{records.short(facts)}"
    why = records.value_error(f"{key}.bytes", facts["bytes"], "int", 0)
    if why:
      return why
    for k in KEYS[1:]:
      if not isinstance(facts[k], str) or not _HEX64.fullmatch(facts[k]):
        return (f"{key}.{k} must be 64 lowercase hex digits (a SHA-256), "
                f"got {records.short(facts[k])}")
  return None


def _shown(facts) -> str:
  if not isinstance(facts, dict):
    return "no such file"
  return (f"{facts['bytes']} bytes, SHA-256 of the first MiB "
          f"{facts['head_sha256'][:12]} and of the last "
          f"{facts['tail_sha256'][:12]}")


def resume_mismatch(theirs, mine: dict,
                    where: str = "the checkpoint's run") -> str | None:
  """The first file whose fingerprint in a checkpoint's ``data_files``
  (``theirs``; None: a checkpoint written before it was stored, not
  compared) differs from this run's ``mine`` (:func:`fingerprint`), for a
  message (``"<name>: <theirs> in <where>, <mine> in this one"``; ``where``
  names the stored fingerprint's run), or None."""
  if theirs is None:
    return None
  for name in sorted(set(theirs) | set(mine)):
    a, b = theirs.get(name), mine.get(name)
    if a != b:
      return f"{name}: {_shown(a)} in {where}, {_shown(b)} in this one"
  return None


def _written_entry(path: str, directory: str, entries) -> str | None:
  """The entry of ``directory`` matching ``entries`` (names or shell
  patterns) that is the file ``path`` or holds it, links and ``..``
  resolved (also an entry not created yet), or a hard link to it; None."""
  real, top = os.path.realpath(path), os.path.realpath(directory)
  first = os.path.relpath(real, top).split(os.sep)[0]
  matches = lambda n: any(fnmatch.fnmatchcase(n, e) for e in entries)
  if first not in (os.curdir, os.pardir) and matches(first):
    return first
  try:
    names = sorted(n for n in os.listdir(directory) if matches(n))
  except OSError:  # not there yet (or unreadable): nothing in it yet
    return None
  for name in names:
    entry = os.path.realpath(os.path.join(directory, name))
    if real == entry or real.startswith(entry + os.sep):
      return name
    try:
      if os.path.samefile(path, entry):
        return name
    except OSError:
      continue
  return None


def check_not_written(config: config_dict.ConfigDict, directory: str,
                      entries, flag: str = "--workdir") -> None:
  """Refuses a data file of ``config`` (:func:`source_files`) that lies
  where a run writes in ``directory``: at an entry of it matching one of
  ``entries`` (names or shell patterns of what the run writes, moves
  aside or removes there, e.g. ``train.RUN_FILES`` and ``run.lock``) or
  under such an entry (``checkpoints/...``), links and ``..`` resolved,
  or a hard link to one. The run would replace, move or delete the data.
  Each entry's ``.tmp`` sibling (the whole-file writes go through it)
  counts as written too. Data elsewhere in ``directory``
  (``<workdir>/data/corpus.txt``) is allowed: no run touches it. Sources whose files are not known here (a
  data source of your own, a missing Fashion-MNIST file, which the task
  names) are not checked.

  Args:
    config: a run config.
    directory: the work directory (need not exist).
    entries: names or shell patterns of its entries the run writes.
    flag: the flag naming ``directory`` in the message.

  Raises:
    ValueError: ``--config.data.path 'W/config.json' is 'config.json' in
      --workdir 'W', which the run writes ...``, one line, before anything
      is written.
  """
  try:
    files = source_files(config)
  except ValueError:  # a missing Fashion-MNIST file: the task names it
    return
  # Each file is written whole through its ".tmp" sibling (runner.tmpfile),
  # which a write first removes.
  entries = (*entries, *(e + ".tmp" for e in entries))
  for path in sorted(files.values()):
    entry = _written_entry(path, directory, entries)
    if entry is None:
      continue
    given = os.fspath(config.data.get("path") or path)
    whose = "" if given == path else f" (its file {path!r})"
    raise ValueError(
        f"--config.data.path {given!r}{whose} is or lies in {entry!r} of "
        f"{flag} {directory!r}, which the run writes, moves aside or "
        "removes: the data would be lost; give --config.data.path a path "
        f"outside the run's own files, or {flag} another directory.")
