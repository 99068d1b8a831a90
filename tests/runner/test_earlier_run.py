"""A fresh start (no checkpoint to resume) keeps an earlier run's records.

A finished run whose checkpoints were deleted (``compare`` deletes them
once the outcome is recorded) left ``metrics.jsonl`` and ``config.json``;
``train`` of another config replaced both without a word.
"""

from __future__ import annotations

import json
import os

import pytest

from decentral_jax.runner import config as config_lib
from decentral_jax.runner import earlier_run
from decentral_jax.runner import metrics
from decentral_jax.runner import presets
from decentral_jax.runner import run_meta

LOG = b'{"step": 0, "eval/loss": 2.5}\n{"step": 12, "eval/loss": 2.1}\n'


def _config(*overrides: str):
  return presets.load_named_or_file("gpt_tiny", list(overrides))


def _earlier(tmp_path, config=None, log: bytes | None = LOG) -> tuple:
  """A work directory with ``config``'s config.json (12 steps by default)
  and ``log``; the bytes of each."""
  config = config or _config("--config.steps=12")
  stored = config.to_json(indent=2).encode()
  (tmp_path / "config.json").write_bytes(stored)
  if log is not None:
    (tmp_path / metrics.METRICS_FILE).write_bytes(log)
  return stored, log


def _entries(tmp_path) -> list[str]:
  return sorted(os.listdir(tmp_path))


def test_another_config_s_finished_run_is_moved_aside_not_replaced(
    tmp_path, capsys):
  """steps 12 -> 4 (a field a resume may change, but the 12-step log is
  not this run's): both files move to ``.earlier`` byte for byte, with one
  warning: line naming each path and where it went."""
  stored, log = _earlier(tmp_path)
  moved = earlier_run.keep_earlier_records(_config("--config.steps=4"),
                                           str(tmp_path))
  d = str(tmp_path)
  assert moved == [(f"{d}/metrics.jsonl", f"{d}/metrics.jsonl.earlier"),
                   (f"{d}/config.json", f"{d}/config.json.earlier")]
  assert _entries(tmp_path) == ["config.json.earlier", "metrics.jsonl.earlier"]
  assert (tmp_path / "metrics.jsonl.earlier").read_bytes() == log
  assert (tmp_path / "config.json.earlier").read_bytes() == stored
  (line,) = capsys.readouterr().err.splitlines()
  assert line.startswith(f"warning: {d}: its config.json records another "
                         "run (config.steps=12, this run has 4)"), line
  assert (f"moved {d}/metrics.jsonl to {d}/metrics.jsonl.earlier and "
          f"{d}/config.json to {d}/config.json.earlier") in line, line


def test_an_earlier_aside_file_is_never_overwritten(tmp_path, capsys):
  (tmp_path / "metrics.jsonl.earlier").write_bytes(b"first\n")
  (tmp_path / "config.json.earlier-2").write_bytes(b"second\n")
  _, log = _earlier(tmp_path, _config("--config.seed=5"))
  earlier_run.keep_earlier_records(_config(), str(tmp_path))
  assert (tmp_path / "metrics.jsonl.earlier").read_bytes() == b"first\n"
  assert (tmp_path / "config.json.earlier-2").read_bytes() == b"second\n"
  assert (tmp_path / "metrics.jsonl.earlier-3").read_bytes() == log
  assert json.loads((tmp_path / "config.json.earlier-3").read_text())[
      "seed"] == 5
  assert "config.seed=5, this run has 0" in capsys.readouterr().err


def test_another_config_by_the_resume_rule_moves_a_config_json_alone(
    tmp_path, capsys):
  """No log: config.json of a run another seed's run cannot resume is
  moved aside; one a resume would accept (only ``steps`` differs) is
  replaced, nothing was trained."""
  _earlier(tmp_path, _config("--config.seed=7"), log=None)
  earlier_run.keep_earlier_records(_config(), str(tmp_path))
  assert _entries(tmp_path) == ["config.json.earlier"]
  assert "config.seed=7, this run has 0" in capsys.readouterr().err
  for f in tmp_path.iterdir():
    f.unlink()
  _earlier(tmp_path, _config("--config.steps=99"), log=b"\n \n")
  assert earlier_run.keep_earlier_records(_config(), str(tmp_path)) == []
  assert _entries(tmp_path) == ["config.json", "metrics.jsonl"]
  assert capsys.readouterr().err == ""


def test_the_same_config_s_own_log_is_redone(tmp_path, capsys):
  """config.json of exactly this config: the log is this run's own (the
  same config gives the same records), redone from step 0 as before."""
  config = _config("--config.steps=12")
  _earlier(tmp_path, config)
  assert earlier_run.earlier_reason(config, str(tmp_path)) is None
  assert earlier_run.keep_earlier_records(config, str(tmp_path)) == []
  assert _entries(tmp_path) == ["config.json", "metrics.jsonl"]
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize("config_json", [None, b"{not json", b"[1, 2]"])
def test_a_log_without_a_readable_config_json_is_kept(tmp_path, capsys,
                                                      config_json):
  if config_json is not None:
    (tmp_path / "config.json").write_bytes(config_json)
  (tmp_path / metrics.METRICS_FILE).write_bytes(LOG)
  earlier_run.keep_earlier_records(_config(), str(tmp_path))
  assert (tmp_path / "metrics.jsonl.earlier").read_bytes() == LOG
  if config_json is not None:
    assert (tmp_path / "config.json.earlier").read_bytes() == config_json
  assert "config.json is missing or unreadable" in capsys.readouterr().err


def test_a_fifo_log_is_not_opened(tmp_path):
  os.mkfifo(tmp_path / metrics.METRICS_FILE)  # an open would block
  assert not earlier_run.holds_records(str(tmp_path / metrics.METRICS_FILE))
  assert earlier_run.earlier_reason(_config(), str(tmp_path)) is None


def test_config_change_compares_as_a_resume_does():
  """``steps`` and ``log_interval`` are free (RESUME_FREE, by the docs),
  ``optimizer.b1`` is not; a field config.json lacks counts as
  ``base_config``'s value."""
  config = _config()
  stored = json.loads(config.to_json())
  assert run_meta.config_change(config, stored) is None
  for field, value in (("steps", 3), ("log_interval", 7)):
    changed = json.loads(config.to_json())
    changed[field] = value
    assert run_meta.config_change(config, changed) is None
  changed = json.loads(config.to_json())
  changed["optimizer"]["b1"] = 0.5
  assert run_meta.config_change(config, changed) == (
      "optimizer.b1", 0.5, config.optimizer.b1)
  base = config_lib.base_config("gpt")
  lacking = json.loads(config.to_json())
  del lacking["grad_clip"]  # counts as base_config's
  want = (None if config.grad_clip == base.grad_clip
          else ("grad_clip", base.grad_clip, config.grad_clip))
  assert run_meta.config_change(config, lacking) == want
  with pytest.raises(TypeError, match="stored must be a dict"):
    run_meta.config_change(config, [])


@pytest.mark.slow  # two tiny training runs
def test_train_keeps_a_finished_run_whose_checkpoints_were_deleted(
    tmp_path, capsys):
  """End to end: a 6-step run, its checkpoints deleted, then a 2-step run
  of another seed in the same directory: the 6-step log and config stay
  whole as ``.earlier``; the new run writes its own."""
  import shutil  # pylint: disable=import-outside-toplevel
  from conftest import require_devices  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  require_devices(2)
  tiny = ("--config.n_workers=2", "--config.model.n_layer=1",
          "--config.model.n_embd=32", "--config.model.n_head=2",
          "--config.model.block_size=16", "--config.global_batch=4",
          "--config.eval_batches=1", "--config.log_interval=2",
          "--config.eval_interval=2")
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(_config(*tiny, "--config.steps=6"), workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  log = (tmp_path / "run" / "metrics.jsonl").read_bytes()
  stored = (tmp_path / "run" / "config.json").read_bytes()
  capsys.readouterr()
  train.train_and_evaluate(
      _config(*tiny, "--config.steps=2", "--config.seed=1"), workdir)
  assert (tmp_path / "run" / "metrics.jsonl.earlier").read_bytes() == log
  assert (tmp_path / "run" / "config.json.earlier").read_bytes() == stored
  assert [r["step"] for r in metrics.read_jsonl(
      os.path.join(workdir, "metrics.jsonl"))] == [0, 2]
  assert json.loads((tmp_path / "run" / "config.json").read_text())[
      "seed"] == 1
  err = [x for x in capsys.readouterr().err.splitlines()
         if x.startswith("warning:")]
  assert len(err) == 1 and "config.seed=0, this run has 1" in err[0], err
