"""The data files' fingerprint in a checkpoint: stored, checked when read
back, and compared on resume (other data refused, a moved copy resumed)."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest

from conftest import require_devices
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import data_files
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20
TINY = ("--config.n_workers=2", "--config.global_batch=4",
        "--config.model.n_layer=1", "--config.model.n_embd=16",
        "--config.model.n_head=1", "--config.model.block_size=8",
        "--config.eval_batches=1", "--config.steps=10",
        "--config.schedule.warmup_steps=2")


def _config(*extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY, *extra))


def _sha(b: bytes) -> str:
  return hashlib.sha256(b).hexdigest()


def test_the_fingerprint_is_the_size_and_the_sha256_of_both_ends(tmp_path):
  big = np.random.default_rng(0).integers(0, 256, 3 * MIB + 5, np.uint8)
  (tmp_path / "big").write_bytes(big.tobytes())
  raw = big.tobytes()
  assert data_files.file_fingerprint(str(tmp_path / "big")) == {
      "bytes": 3 * MIB + 5, "head_sha256": _sha(raw[:MIB]),
      "tail_sha256": _sha(raw[-MIB:])}
  (tmp_path / "small").write_bytes(b"abc")
  assert data_files.file_fingerprint(str(tmp_path / "small")) == {
      "bytes": 3, "head_sha256": _sha(b"abc"), "tail_sha256": _sha(b"abc")}
  with pytest.raises(ValueError, match=r"^data file '.*nope' \(config\.data"
                     r"\.path\) cannot be read: "):
    data_files.file_fingerprint(str(tmp_path / "nope"))


def test_the_files_of_each_built_in_source(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"x" * 100)
  assert data_files.source_files(_config(
      "--config.data.source=text_file",
      f"--config.data.path={tmp_path / 'a.txt'}")) == {
          "text": str(tmp_path / "a.txt")}
  assert data_files.source_files(_config(
      "--config.data.source=token_bins", f"--config.data.path={tmp_path}")
  ) == {"train.bin": str(tmp_path / "train.bin"),
        "val.bin": str(tmp_path / "val.bin")}
  assert data_files.source_files(_config()) == {}  # pydoc: no file
  names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte",
           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
  for name in names:
    (tmp_path / name).write_bytes(b"")
  cnn = config_lib.load_config(
      os.path.join(ROOT, "configs", "cnn_fashion_mnist.py"),
      (f"--config.data.path={tmp_path}",))
  assert data_files.source_files(cnn) == {n: str(tmp_path / n) for n in names}


def test_token_bins_compare_each_file(tmp_path):
  for d, val in (("a", b"\x01\x00" * 9), ("b", b"\x01\x00" * 8 + b"\x02\x00")):
    os.makedirs(tmp_path / d)
    (tmp_path / d / "train.bin").write_bytes(b"\x05\x00" * 50)
    (tmp_path / d / "val.bin").write_bytes(val)
  a, b = (data_files.fingerprint(_config(
      "--config.data.source=token_bins", f"--config.data.path={tmp_path / d}"))
      for d in "ab")
  assert a["train.bin"] == b["train.bin"]
  why = data_files.resume_mismatch(a, b)
  head = _sha(b"\x01\x00" * 9)[:12]
  assert why.startswith(
      f"val.bin: 18 bytes, SHA-256 of the first MiB {head} and of the last "
      f"{head} in the checkpoint's run, 18 bytes, SHA-256 of the first MiB ")
  assert data_files.resume_mismatch(None, b) is None  # an older checkpoint


def test_a_resume_on_other_data_is_refused_and_a_moved_copy_resumes(
    tmp_path):
  require_devices(2)
  words = np.random.default_rng(1).choice([b"alpha ", b"beta ", b"gamma "],
                                          4000)
  (tmp_path / "A.txt").write_bytes(b"".join(words))
  (tmp_path / "B.txt").write_bytes(b"".join(words[::-1]))  # same size
  os.makedirs(tmp_path / "moved")
  shutil.copy(tmp_path / "A.txt", tmp_path / "moved" / "C.txt")

  def exp_on(name):
    return experiment_lib.Experiment(_config(
        "--config.data.source=text_file",
        f"--config.data.path={tmp_path / name}"))

  exp_a = exp_on("A.txt")
  meta = run_meta.checkpoint_meta(exp_a, 10)  # a logged step
  size = (tmp_path / "A.txt").stat().st_size
  assert meta["data_files"] == {"text": {
      "bytes": size, "head_sha256": _sha((tmp_path / "A.txt").read_bytes()),
      "tail_sha256": _sha((tmp_path / "A.txt").read_bytes())}}
  run_meta.check_resumable(exp_on("moved/C.txt"), dict(meta), "ckpt")
  exp_b = exp_on("B.txt")
  with pytest.raises(ValueError) as info:
    run_meta.check_resumable(exp_b, dict(meta), "ckpt")
  message = str(info.value)
  assert message.startswith(
      "the checkpoint in ckpt was trained on other data than this run's "
      f"config.data.path={str(tmp_path / 'B.txt')!r} (text: {size} bytes, ")
  assert message.endswith("resume with the original data (a moved copy of "
                          "it resumes) or use a fresh --workdir.")
  assert "\n" not in message
  # A checkpoint written before the fingerprint was stored resumes.
  older = {k: v for k, v in meta.items() if k != "data_files"}
  run_meta.check_resumable(exp_b, older, "ckpt")
  like = run_meta.checkpoint_meta(exp_b, 0)
  assert run_meta.meta_error(older, 10, like) is None
  assert run_meta.meta_error(meta, 10, like) is None


@pytest.mark.parametrize("stored, why", [
    ("x", "data_files must be an object, got 'x'"),
    ({"text": {"bytes": 3}}, "data_files.text must be an object of bytes, "
     "head_sha256, tail_sha256, got {'bytes': 3}"),
    ({"text": {"bytes": -1, "head_sha256": "0" * 64,
               "tail_sha256": "0" * 64}}, "data_files.text.bytes"),
    ({"text": {"bytes": 1, "head_sha256": "0" * 63,
               "tail_sha256": "0" * 64}},
     "data_files.text.head_sha256 must be 64 lowercase hex digits (a "
     "SHA-256), got '0000"),
])
def test_a_damaged_fingerprint_is_a_damaged_document(stored, why):
  got = data_files.stored_error(stored)
  assert got is not None and got.startswith(why)
  meta = {"step": 0, "data_position": 0, "data_files": stored}
  assert run_meta.meta_error(meta, 0).startswith(why)


def _text_run(path):
  return _config("--config.data.source=text_file",
                 f"--config.data.path={path}")


@pytest.mark.parametrize("entry", ["config.json", "metrics.jsonl",
                                   "run.lock", "metrics.jsonl.corrupt-2",
                                   "config.json.earlier"])
def test_a_data_file_the_run_writes_is_refused_before_anything_is_written(
    tmp_path, entry):
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  work = tmp_path / "w"
  work.mkdir()
  corpus = b"the user's corpus\n" * 100
  (work / entry).write_bytes(corpus)
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(_text_run(work / entry), str(work))
  assert str(e.value) == (
      f"--config.data.path '{work / entry}' is or lies in '{entry}' of "
      f"--workdir '{work}', which the run writes, moves aside or removes: "
      "the data would be lost; give --config.data.path a path outside the "
      "run's own files, or --workdir another directory.")
  assert (work / entry).read_bytes() == corpus
  assert sorted(os.listdir(work)) == [entry]  # no run.lock, no config.json


def test_token_bins_under_the_checkpoints_or_linked_there_are_refused(
    tmp_path):
  work = tmp_path / "w"
  (work / "checkpoints" / "bins").mkdir(parents=True)
  entries = ("config.json", "checkpoints", "run.lock")
  bins = _config("--config.data.source=token_bins",
                 f"--config.data.path={work / 'checkpoints' / 'bins'}")
  with pytest.raises(ValueError, match=(
      r"^--config.data.path '.*/w/checkpoints/bins' \(its file "
      r"'.*/w/checkpoints/bins/train.bin'\) is or lies in 'checkpoints' of "
      r"--outdir '.*/w', ")):
    data_files.check_not_written(bins, str(work), entries, "--outdir")
  outside = tmp_path / "corpus.txt"
  outside.write_bytes(b"abc\n")
  os.symlink(work / "config.json", tmp_path / "link.txt")  # not there yet
  with pytest.raises(ValueError, match="is or lies in 'config.json' of"):
    data_files.check_not_written(_text_run(tmp_path / "link.txt"), str(work),
                                 entries)
  os.link(outside, work / "run.lock")  # a hard link: one file
  with pytest.raises(ValueError, match="is or lies in 'run.lock' of"):
    data_files.check_not_written(_text_run(outside), str(work), entries)


def test_data_elsewhere_in_the_work_directory_is_read_as_anywhere(tmp_path):
  work = tmp_path / "w"
  (work / "data").mkdir(parents=True)
  for path in (work / "data" / "config.json", work / "corpus.txt",
               tmp_path / "config.json"):
    path.write_bytes(b"abc\n")
    data_files.check_not_written(_text_run(path), str(work),
                                 ("config.json", "checkpoints", "run.lock"))
  data_files.check_not_written(_text_run(tmp_path / "config.json"),
                               str(tmp_path / "new"), ("config.json",))


@pytest.mark.parametrize("name", ["config.json.tmp", "wandb_run_id.tmp",
                                  "loss_vs_step.png.tmp"])
def test_data_at_a_written_file_s_tmp_sibling_is_refused(tmp_path, name):
  """Whole-file writes go through ``<name>.tmp``, removed first."""
  work = tmp_path / "w"
  work.mkdir()
  path = work / name
  path.write_bytes(b"abc\n")
  with pytest.raises(ValueError, match=f"is or lies in '{name}' of"):
    data_files.check_not_written(
        _text_run(path), str(work),
        ("config.json", "wandb_run_id", "loss_vs_step.png"))
  assert path.read_bytes() == b"abc\n"
