"""``SHA256SUMS`` checksum manifests of directories.

:func:`write_sums` lists every file of a directory with its SHA-256 in
``sha256sum``'s format (``sha256sum -c`` reads it too);
:func:`check_sums` checks a directory against its manifest (a file the
writer never writes, present beside intact listed ones, is its own
outcome, ``"extra"``, not damage).
:mod:`decentral_jax.runner.checkpoint` writes one into every checkpoint.
Listed files are hashed only when they are regular files, opened without
following links and without blocking: anything else is damage.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import stat
from typing import Callable, Iterable

from decentral_jax import records
from decentral_jax.runner import tmpfile

SUMS_FILE = "SHA256SUMS"
#: The largest manifest read: a line per file (~100 bytes), far more
#: than the files a checkpoint holds; a larger one is damage, unread.
MAX_SUMS_BYTES = 64 * 2**20
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _sha256(path: str) -> str | None:
  """The SHA-256 of the regular file ``path``, or None for anything else.

  Opened without following a symbolic link and without blocking
  (``O_NOFOLLOW | O_NONBLOCK``), then checked a regular file with
  ``fstat``: a listed file replaced by a link (to ``/proc/kmsg``, say), a
  FIFO or a device would otherwise be read for ever.
  """
  try:
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | os.O_NONBLOCK)
  except OSError:
    return None
  h = hashlib.sha256()
  with open(fd, "rb") as f:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      return None
    while chunk := f.read(1 << 20):
      h.update(chunk)  # releases the GIL: files are hashed in parallel
  return h.hexdigest()


def _hash_all(root: str, rels: list[str]) -> list[str | None]:
  workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda r: _sha256(os.path.join(root, r)), rels))


def write_sums(root: str, skip: Iterable[str] = ()) -> None:
  """Writes ``<root>/SHA256SUMS``: every file under ``root`` but ``skip``.

  Files are hashed in parallel threads; the manifest is written to a
  temporary name, flushed to disk and renamed.
  """
  skip = {SUMS_FILE, SUMS_FILE + ".tmp", *skip}  # the .tmp is replaced
  rels = sorted(os.path.relpath(os.path.join(here, name), root)
                for here, _, names in os.walk(root) for name in names)
  rels = [r for r in rels if r not in skip]
  digests = _hash_all(root, rels)
  if None in digests:
    bad = rels[digests.index(None)]
    raise OSError(f"{os.path.join(root, bad)} is not a regular file")
  lines = "".join(f"{h}  {r}\n" for h, r in zip(digests, rels))
  tmpfile.replace(os.path.join(root, SUMS_FILE), lines, fsync=True)


def _outside(rel: str) -> bool:
  """True if a manifest path leaves its directory (absolute, or ``..``)."""
  return (not rel or os.path.isabs(rel)
          or ".." in rel.replace("\\", "/").split("/"))


def _unlisted_files(root: str, listed: set, exempt: Iterable[str]
                    ) -> list[str]:
  """The files under ``root`` (sorted walk) neither in ``listed`` nor
  ``exempt`` nor the manifest itself."""
  exempt = {os.path.normpath(r) for r in (SUMS_FILE, *exempt)}
  out = []
  for here, dirs, names in os.walk(root):
    dirs.sort()
    for name in sorted(names):
      rel = os.path.normpath(os.path.relpath(os.path.join(here, name), root))
      if rel not in listed and rel not in exempt:
        out.append(rel)
  return out


def _named(rels: list[str]) -> str:
  """``"a is"``, ``"a and b are"``, ``"a, b, c and 2 more are"``."""
  if len(rels) == 1:
    return f"{rels[0]} is"
  if len(rels) <= 3:
    return ", ".join(rels[:-1]) + f" and {rels[-1]} are"
  return ", ".join(rels[:3]) + f" and {len(rels) - 3} more are"


_SUMS_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def _parse_sums(text: str) -> list[tuple[str, str]] | str:
  """The ``(sha256, path)`` entries of a manifest in ``sha256sum``'s
  format (text `` `` or binary ``*`` mode; an identical line repeated
  counts once), or why it is malformed (naming the line)."""
  entries, seen = [], {}
  for k, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    m = _SUMS_LINE.fullmatch(line)
    if m is None or _outside(m.group(2)):
      return (f"line {k} {line!r:.80} is not a 64-digit hex SHA-256, a "
              "space, a space or '*', and a path inside the directory")
    digest, rel = m.group(1).lower(), m.group(2)
    if seen.get(os.path.normpath(rel), digest) != digest:
      return f"line {k} lists {rel!r:.80} again with another checksum"
    if os.path.normpath(rel) not in seen:
      seen[os.path.normpath(rel)] = digest
      entries.append((digest, rel))
  return entries or "it lists no file"


def check_sums(root: str, required: tuple[str, ...] = (),
               complete_except: Iterable[str] | None = None,
               foreign: Callable[[str], bool] | None = None
               ) -> tuple[str, str]:
  """Checks the files of ``root`` against ``<root>/SHA256SUMS``.

  Args:
    root: the directory.
    required: paths (relative to ``root``) the manifest must list when
      they exist: a manifest that leaves one out would let it be edited
      unchecked.
    complete_except: if given, EVERY file under ``root`` but these paths
      (and the manifest) must be listed: a file present but unlisted is
      damage (a manifest written by :func:`write_sums` lists them all),
      unless ``foreign`` says it is no file the writer writes.
    foreign: with ``complete_except``, ``foreign(rel) -> bool`` for an
      unlisted path: True where the writer never writes such a file (a
      stray file added by hand, e.g. ``.DS_Store``), so it is reported as
      ``"extra"``, not damage.

  Returns:
    ``("ok", "")``; ``("unverified", why)`` if ``root`` has no manifest;
    ``("corrupt", why)`` naming the first missing or changed file, a
    listed file that is not a regular file (a link, a FIFO, a device:
    never followed nor read), a
    manifest that is not a regular file (a FIFO: refused unopened) or is
    larger than :data:`MAX_SUMS_BYTES` (not read), a
    ``required`` file (or with ``complete_except``, any file not
    ``foreign``) the manifest leaves out, or a malformed manifest (a
    line that is not ``<sha256>  <path>`` or ``<sha256> *<path>``, a path
    outside ``root``, which is never read, or one path with two
    checksums); or ``("extra", why)`` where every listed file verifies but
    ``foreign`` files are present: ``why`` is ``"every file SHA256SUMS
    lists verifies, but FILE is not the run's"`` (up to 3 named).
  """
  sums = os.path.join(root, SUMS_FILE)
  why = tmpfile.not_regular_error(sums)
  if why:  # a FIFO would block the read for ever
    return "corrupt", f"{SUMS_FILE} {why}"
  raw = records.read_bytes(sums, MAX_SUMS_BYTES)  # larger: damage
  if isinstance(raw, records.Damaged) and raw.missing:
    if not os.path.isdir(root):
      return "corrupt", "the directory is missing"
    if not os.listdir(root):
      return "corrupt", "the directory is empty"
    return "unverified", f"no {SUMS_FILE} (written by an older version?)"
  if isinstance(raw, records.Damaged):
    return "corrupt", f"{SUMS_FILE} {raw.reason}"
  try:
    entries = _parse_sums(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    return "corrupt", f"{SUMS_FILE} unreadable: {e}"
  if isinstance(entries, str):
    return "corrupt", f"{SUMS_FILE} is malformed ({entries})"
  listed = {os.path.normpath(r) for _, r in entries}
  unlisted = [r for r in required if os.path.normpath(r) not in listed
              and os.path.lexists(os.path.join(root, r))]
  extra = []
  if not unlisted and complete_except is not None:
    for rel in _unlisted_files(root, listed, complete_except):
      (extra if foreign is not None and foreign(rel) else unlisted).append(rel)
  if unlisted:
    return "corrupt", f"{SUMS_FILE} does not list {unlisted[0]}"
  why = _listed_files_error(root, entries)
  if why:
    return "corrupt", why
  if extra:
    return "extra", (f"every file {SUMS_FILE} lists verifies, but "
                     f"{_named(extra)} not the run's")
  return "ok", ""


def _listed_files_error(root: str, entries: list[tuple[str, str]]
                        ) -> str | None:
  """Why the files ``entries`` lists are not as listed (the first missing,
  not a regular file, or changed), or None."""
  missing = [r for _, r in entries if not os.path.isfile(os.path.join(root, r))]
  if missing:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return f"missing {missing[0]}{more}"
  for (want, rel), got in zip(entries, _hash_all(root, [r for _, r in entries])):
    if got is None:
      return (f"{rel} is not a regular file (a symbolic link, a FIFO or a "
              "device), not the run's own file")
    if got != want:
      return f"{rel} does not match its checksum"
  return None
