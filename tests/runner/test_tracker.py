"""The optional Weights & Biases tracker (config.tracker="wandb") logs the
records of metrics.jsonl: a run in offline mode is read back from its
``.wandb`` file (LevelDB-log framed protobuf records, parsed here) and
compared with metrics.jsonl record by record."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from conftest import require_devices
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import train
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def _wandb_rows(path: str) -> dict[int, dict]:
  """``{step: {key: value}}`` of the history records of a ``.wandb`` file.

  The file is a 7-byte header, then LevelDB log blocks of 32 KiB: records
  of a 7-byte header (crc32, length uint16, type: 1 full, 2 first, 3
  middle, 4 last) and a payload, a serialized ``wandb_internal_pb2.Record``.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  raw = open(path, "rb").read()
  assert raw[:4] == b":W&B", raw[:7]
  pos, block, parts, payloads = 7, 32768, b"", []
  while pos + 7 <= len(raw):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
    data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
    if kind == 0:
      break
    parts = data if kind in (1, 2) else parts + data
    if kind in (1, 4):
      payloads.append(parts)
  rows = {}
  for payload in payloads:
    record = wandb_internal_pb2.Record()
    record.ParseFromString(payload)
    if record.WhichOneof("record_type") != "history":
      continue
    row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
           for i in record.history.item}
    rows[int(row["_step"])] = row
  return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_records(tmp_path, monkeypatch):
  require_devices(4)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_DIR", raising=False)
  c = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"), (
      "n_workers=4", "global_batch=8", "model.n_layer=1", "model.n_embd=16",
      "model.n_head=2", "model.block_size=8", "steps=6", "log_interval=2",
      "eval_interval=3", "eval_batches=1", "tracker=wandb"))
  validation.check_config(c)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  records = [json.loads(s) for s in open(os.path.join(workdir,
                                                      "metrics.jsonl"))]
  (path,) = glob.glob(os.path.join(workdir, "wandb", "offline-run-*",
                                   "run-*.wandb"))
  run_id = open(os.path.join(workdir, "wandb_run_id")).read().strip()
  assert path.endswith(f"run-{run_id}.wandb")
  rows = _wandb_rows(path)
  assert sorted(rows) == sorted({r["step"] for r in records})
  checked = 0
  for record in records:
    row = rows[record["step"]]
    for key, value in record.items():
      if key == "step" or value is None:
        continue
      assert row[key] == pytest.approx(value, rel=1e-12), (key, record)
      checked += 1
  assert checked > 20 and any("eval/loss" in r for r in records)


def test_tracker_names_its_choices():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                             ("tracker=mlflow",))
  with pytest.raises(ValueError, match=r"unknown config.tracker='mlflow'; "
                     r"use '' \(none\) or 'wandb'"):
    validation.check_config(c)


def test_a_tracker_wandb_refuses_to_start_is_one_line(tmp_path, monkeypatch):
  """wandb.init refusing (a key with whitespace, a bogus key, no key for
  mode=online) is one ValueError naming config.tracker, W&B's own message
  and the fixes, not W&B's traceback; the metrics file is closed."""
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import metrics  # pylint: disable=import-outside-toplevel

  class AuthenticationError(Exception):
    pass

  def init(**kwargs):
    raise AuthenticationError(
        "WANDB_API_KEY invalid: API key must have 40+\ncharacters, has 5.")

  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  with pytest.raises(ValueError) as e:
    metrics.MetricsWriter(str(tmp_path), tracker="wandb")
  text = str(e.value)
  assert "\n" not in text and text.startswith("config.tracker='wandb'"), text
  assert ("AuthenticationError: WANDB_API_KEY invalid: API key must have "
          "40+ characters, has 5.") in text, text
  for fix in ("wandb login", "WANDB_MODE=offline", "--config.tracker=''"):
    assert fix in text, text


@pytest.mark.parametrize("content, why", [
    (b"\xff\xfe\n", "is not UTF-8 text (byte 0xff at offset 0)"),
    (b"", "is empty"),  # a run stopped between the open and the write
    (b"ab/c d\n", "holds 'ab/c d', not a W&B run id"),
    (b"x" * 65, "not a W&B run id (1 to 64"),
    # Unicode and ASCII-control spaces are not stripped: not one id
    ("abc123\u00a0\n".encode(), r"holds 'abc123\xa0', not a W&B run id"),
    ("\u3000abc123".encode(), "not a W&B run id"),
    (b"abc123\x1c\n", "not a W&B run id"),
    (b"\x0babc123", "not a W&B run id"),
])
def test_a_damaged_wandb_run_id_is_one_line_naming_it(tmp_path, content,
                                                      why):
  from decentral_jax.runner import metrics  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.WANDB_ID_FILE
  path.write_bytes(content)
  with pytest.raises(ValueError) as e:
    metrics.wandb_run_id(str(tmp_path))
  text = str(e.value)
  assert "\n" not in text and text.startswith(f"{path} ") and why in text, \
      text
  assert text.endswith("; move it away (a new W&B run is started) and run "
                       "again."), text
  assert path.read_bytes() == content  # nothing is rewritten


def test_the_wandb_run_id_is_kept_and_reread(tmp_path):
  from decentral_jax.runner import metrics  # pylint: disable=import-outside-toplevel
  run_id = metrics.wandb_run_id(str(tmp_path))
  assert len(run_id) == 12 and set(run_id) <= set("0123456789abcdef")
  assert sorted(os.listdir(tmp_path)) == [metrics.WANDB_ID_FILE]  # no .tmp
  assert (tmp_path / metrics.WANDB_ID_FILE).read_text() == run_id + "\n"
  assert metrics.wandb_run_id(str(tmp_path)) == run_id
  (tmp_path / metrics.WANDB_ID_FILE).write_text("Run_1-a\n")
  assert metrics.wandb_run_id(str(tmp_path)) == "Run_1-a"
  (tmp_path / metrics.WANDB_ID_FILE).write_bytes(b" \tRun_2\r\n")
  assert metrics.wandb_run_id(str(tmp_path)) == "Run_2"
