"""``train``'s data pre-check words a data path that is not a regular file
(a directory, a FIFO, a device, a token directory that is a file) as the
data modules do: it said "does not exist" for paths that exist."""

import contextlib
import io
import os

import pytest

from decentral_jax.tools import train

FIX_TEXT = ("pass an existing file as --config.data.path or use the bundled "
            "corpus (--config.data.source=pydoc).")
FIX_BINS = ("set --config.data.path= a directory with nanoGPT's train.bin "
            "and val.bin (made by nanoGPT's data/openwebtext/prepare.py).")


@pytest.fixture(autouse=True)
def _defaults_after():
  yield
  train.parse([])


def _errors(tmp_path, source, path):
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    code = train.main(["--config=configs/gpt_tiny.py",
                       f"--workdir={tmp_path / 'w'}",
                       f"--config.data.source={source}",
                       f"--config.data.path={path}"])
  lines = [l for l in err.getvalue().splitlines() if l.startswith("error:")]
  return code, lines


def test_each_kind_of_path_is_named_as_what_it_is(tmp_path):
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "bins" / "train.bin").mkdir(parents=True)
  (tmp_path / "bins" / "val.bin").write_bytes(b"ab")
  (tmp_path / "afile").write_text("hello")
  cases = [
      ("text_file", tmp_path, f"text file '{tmp_path}' is a directory, not a "
       f"file; {FIX_TEXT}"),
      ("text_file", tmp_path / "fifo", f"text file '{tmp_path / 'fifo'}' is "
       f"not a regular file (a FIFO, a socket or a device); {FIX_TEXT}"),
      ("text_file", "/dev/null", "text file '/dev/null' is not a regular "
       f"file (a FIFO, a socket or a device); {FIX_TEXT}"),
      ("text_file", tmp_path / "none", f"text file '{tmp_path / 'none'}' "
       f"does not exist; {FIX_TEXT}"),
      ("token_bins", tmp_path / "bins", "token file "
       f"'{tmp_path / 'bins' / 'train.bin'}' is a directory, not a file; "
       f"{FIX_BINS}"),
      ("token_bins", tmp_path / "afile", "token directory "
       f"'{tmp_path / 'afile'}' is a file, not a directory; {FIX_BINS}"),
  ]
  for source, path, message in cases:
    assert _errors(tmp_path, source, path) == (2, [f"error: {message}"])
