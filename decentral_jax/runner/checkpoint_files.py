"""The files of a committed checkpoint step directory, and its check.

Orbax writes the items' directories (``state/``, ``meta/``) and, after
the run's ``SHA256SUMS`` (which lists every file then present), the
top-level :data:`UNSUMMED` files. :func:`check_checkpoint` tells damage
(a listed file missing or changed, an unlisted file inside an item's
directory) from files that are only not the run's (:func:`not_orbax`).
"""

from __future__ import annotations

import os

from decentral_jax.runner import checkpoint_json
from decentral_jax.runner import workdir as workdir_lib

# Top-level files Orbax writes after SUMS_FILE (commit time, commit marker).
UNSUMMED = ("_CHECKPOINT_METADATA", "commit_success.txt")
# Files a checkpoint's SHA256SUMS must list (the JSON document it resumes by).
SUMMED = (os.path.join("meta", "metadata"),)


def not_orbax(rel: str) -> bool:
  """Whether Orbax never writes the file ``rel`` of a step directory: one
  at its top (Orbax writes only its items' directories there, besides
  ``UNSUMMED``) or a hidden one (``.DS_Store``, an editor's ``.x.swp``)."""
  parts = rel.split(os.sep)
  return len(parts) == 1 or any(p.startswith(".") for p in parts)


def check_checkpoint(root: str) -> tuple[str, str]:
  """Checks a committed checkpoint directory against its ``SHA256SUMS``.

  Returns:
    ``("ok", "")``; ``("unverified", why)`` without a ``SHA256SUMS``;
    ``("corrupt", why)`` naming the first bad file (missing, changed,
    present inside an item's directory but not listed in ``SHA256SUMS``,
    or one of the JSON files Orbax reads damaged:
    :func:`checkpoint_json.json_files_error`, checked with or without
    ``SHA256SUMS``, since Orbax's step metadata is not summed); or
    ``("extra", why)``: every listed file verifies, but files Orbax never
    writes (unlisted at the top of the directory, or hidden, such as
    ``.DS_Store``) are present, ``why`` naming them: the trained state is
    intact, they only need moving away.
  """
  if os.path.lexists(root) and not os.path.isdir(root):
    return "corrupt", "it is not a directory"
  status, why = workdir_lib.check_sums(root, required=SUMMED,
                                       complete_except=UNSUMMED,
                                       foreign=not_orbax)
  if status == "corrupt":
    return status, why
  json_why = checkpoint_json.json_files_error(root)
  if json_why:
    return "corrupt", json_why
  return status, why
