"""Dummy token files (zeros) of ``overlap --data_dir`` and
``bench_overlap_at_scale.py --bins``: written where absent, kept where
already exactly the dummy, and a user's token file never replaced."""

from __future__ import annotations

import os

import numpy as np
import pytest

from decentral_jax.tools import dummy_bins
from decentral_jax.tools import overlap

TOKENS = {"train.bin": 1000, "val.bin": 10}


def test_absent_files_are_written_as_zero_tokens(tmp_path):
  d = tmp_path / "new" / "bins"
  assert dummy_bins.write_dummy_bins(str(d), TOKENS, "--bins") == str(d)
  assert sorted(os.listdir(d)) == ["train.bin", "val.bin"]
  assert (d / "train.bin").read_bytes() == b"\0" * 2000  # 2 bytes a token
  assert (d / "val.bin").read_bytes() == b"\0" * 20


def test_the_dummy_already_there_is_kept(tmp_path):
  (tmp_path / "train.bin").write_bytes(b"\0" * 2000)
  before = os.stat(tmp_path / "train.bin").st_mtime_ns
  dummy_bins.write_dummy_bins(str(tmp_path), TOKENS, "--bins")
  assert os.stat(tmp_path / "train.bin").st_mtime_ns == before
  assert (tmp_path / "val.bin").read_bytes() == b"\0" * 20


@pytest.mark.parametrize("content, what", [
    (np.arange(1000, dtype=np.uint16).tobytes(), "2000 bytes, not"),
    (b"\0" * 1998, "1998 bytes, not"),  # zeros of another size
    (b"\0" * 1999 + b"\1", "2000 bytes, not"),  # one token byte not zero
])
def test_a_token_file_that_is_not_the_dummy_is_refused(tmp_path, content,
                                                       what):
  (tmp_path / "train.bin").write_bytes(content)
  with pytest.raises(ValueError) as e:
    dummy_bins.write_dummy_bins(str(tmp_path), TOKENS, "--bins")
  assert str(e.value) == (
      f"--bins '{tmp_path}' already holds train.bin ({what} the 2000 bytes "
      "of zeros this command writes), which it would replace; give --bins "
      "an empty or new directory.")
  assert (tmp_path / "train.bin").read_bytes() == content
  assert not (tmp_path / "val.bin").exists()  # nothing written


def test_a_link_or_directory_at_a_token_file_is_refused(tmp_path):
  (tmp_path / "zeros").write_bytes(b"\0" * 20)
  os.symlink(tmp_path / "zeros", tmp_path / "val.bin")  # anyone's file
  os.mkdir(tmp_path / "train.bin")
  with pytest.raises(ValueError, match=r"holds train.bin \(not a regular "
                     r"file, nor the 2000 bytes"):
    dummy_bins.check_dummy_bins(str(tmp_path), TOKENS, "--bins")
  os.rmdir(tmp_path / "train.bin")
  with pytest.raises(ValueError, match=r"holds val.bin \(not a regular"):
    dummy_bins.check_dummy_bins(str(tmp_path), TOKENS, "--bins")


def test_overlap_refuses_a_data_dir_of_real_tokens_before_compiling(
    tmp_path, monkeypatch, capsys):
  def compiles(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(overlap, "run_case", compiles)
  tokens = np.arange(300_000, dtype=np.uint16).tobytes()
  (tmp_path / "train.bin").write_bytes(tokens)
  rc = overlap.main(["--cases", "gpt2_small", "--data_dir", str(tmp_path),
                     "--out", str(tmp_path / "o.jsonl")])
  assert rc == 2
  assert capsys.readouterr().err.splitlines() == [
      f"error: --data_dir '{tmp_path}' already holds train.bin (600000 "
      "bytes, not the 600000 bytes of zeros this command writes), which it "
      "would replace; give --data_dir an empty or new directory."]
  assert (tmp_path / "train.bin").read_bytes() == tokens
  assert sorted(os.listdir(tmp_path)) == ["train.bin"]


def test_a_directory_that_cannot_be_made_is_one_line(tmp_path):
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ValueError) as e:
    dummy_bins.write_dummy_bins(str(tmp_path / "afile" / "d"), TOKENS,
                                "--data_dir")
  assert str(e.value) == (
      f"--data_dir '{tmp_path / 'afile' / 'd'}': cannot write the dummy "
      "token files (Not a directory); give a writable directory.")
