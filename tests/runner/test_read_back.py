"""Files a run reads back (checkpoints, their manifests, ``metrics.jsonl``):
damage is named and set aside, never trusted, raised raw, or hung on."""

from __future__ import annotations

import hashlib
import os

from decentral_jax import records
from decentral_jax.runner import checkpoint
from decentral_jax.runner import workdir as workdir_lib

BIG = "1" + "0" * 5000  # past Python's 4,300-digit int conversion limit


def test_an_integer_too_long_to_convert_is_damage_naming_the_file():
  got = records.parse_json(b'{"step": ' + BIG.encode() + b"}", "f.json")
  assert isinstance(got, records.Damaged), got
  assert got.file == "f.json" and got.reason.startswith("is not JSON"), got


def test_a_checkpoint_with_an_over_long_integer_is_corrupt(tmp_path):
  """Orbax's unsummed step metadata with a 5,001-digit integer: the
  checkpoint is corrupt (so an older one is used), not a raw ValueError."""
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  workdir_lib.write_sums(str(root))
  (root / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": '
                                             + BIG + "}")
  status, why = checkpoint.check_checkpoint(str(root))
  assert status == "corrupt" and "_CHECKPOINT_METADATA" in why, why


def test_a_step_entry_of_non_ascii_digits_is_not_a_checkpoint(tmp_path):
  """"²" passes ``str.isdigit`` but not ``int``: the entry is ignored and
  the directory has no checkpoint (it raised "invalid literal" before)."""
  root = tmp_path / "checkpoints"
  (root / "\u00b2").mkdir(parents=True)
  (root / "\uff18").mkdir()  # fullwidth 8
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() is None
  assert sorted(os.listdir(root)) == ["\u00b2", "\uff18"]


def test_a_listed_file_replaced_by_a_link_is_never_followed(tmp_path):
  """A listed file replaced by a link to a file of the same bytes (whose
  checksum matches): damage naming it; a link to ``/proc/kmsg`` or a FIFO
  would be read for ever."""
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  (root / "b").write_bytes(b"b")
  workdir_lib.write_sums(str(root))
  outside = tmp_path / "outside"
  outside.write_bytes(b"b")
  assert hashlib.sha256(outside.read_bytes()).hexdigest() in (
      root / workdir_lib.SUMS_FILE).read_text()
  os.remove(root / "b")
  os.symlink(outside, root / "b")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and why.startswith("b is not a regular file"), why


def test_a_listed_fifo_is_damage_without_blocking(tmp_path):
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  digest = hashlib.sha256(b"").hexdigest()
  os.mkfifo(root / "f")
  (root / workdir_lib.SUMS_FILE).write_text(
      f"{hashlib.sha256(b'a').hexdigest()}  a\n{digest}  f\n")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and "f" in why, why
