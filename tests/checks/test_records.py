"""The validating reader: every damaged file is a one-line ``Damaged``.

A table of damaged files (empty, truncated mid-line, wrong JSON type, a key
missing, a string where a number goes, NaN / Infinity where a finite
number is needed, an empty series, binary garbage, a directory, a FIFO)
against one schema; each must come back as ``Damaged`` naming the file and
the key at fault, never an exception, and the good file as its content.
"""

from __future__ import annotations

import json
import os

import pytest

from decentral_jax import records

SCHEMA = {
    "name": ("str", None, None, False),
    "count": ("int", 1, 100, False),
    "loss": ("number", None, None, False),
    "curve": ("series", 0.0, None, False),
    "note": ("str", None, None, True),
    "inner": (records.Obj({"rate": ("number", 0.0, 1.0, False)}, ("rate",)),
              None, None, False),
}
REQUIRED = ("name", "count", "loss", "curve", "inner")
GOOD = {"name": "a", "count": 3, "loss": 2.5, "curve": [1.0, 0.5],
        "note": None, "inner": {"rate": 0.25}}


def _good_text() -> str:
  return json.dumps(GOOD)


def _edit(key, value):
  def edit(d):
    if value is _DROP:
      d.pop(key)
    else:
      d[key] = value
    return json.dumps(d)
  return edit


_DROP = object()

# case -> (the file's text or bytes, or an edit of GOOD; the key named or
# None for the whole file; a word the reason must hold).
CASES = {
    "empty": ("", None, "empty"),
    "blank": ("  \n ", None, "empty"),
    "truncated": (_good_text()[:20], None, "not JSON"),
    "binary": (b"\x00\xff\xfe\x89PNG\r\n", None, "not UTF-8"),
    "binary_utf8": (b"\x00\x01\x02", None, "not JSON"),
    "list_not_object": ("[1, 2, 3]", "(top level)", "must be an object"),
    "string_document": ('"text"', "(top level)", "must be an object"),
    "key_missing": (_edit("loss", _DROP), "loss", "misses ['loss']"),
    "string_for_number": (_edit("loss", "2.5"), "loss", "finite number"),
    "bool_for_int": (_edit("count", True), "count", "integer"),
    "float_for_int": (_edit("count", 2.5), "count", "integer"),
    "int_out_of_bounds": (_edit("count", 1000), "count", "in [1, 100]"),
    "nan": (_good_text().replace("2.5", "NaN"), "loss", "finite number"),
    "infinity": (_good_text().replace("2.5", "-Infinity"), "loss",
                 "finite number"),
    "null_not_allowed": (_edit("loss", None), "loss", "finite number"),
    "empty_series": (_edit("curve", []), "curve", "non-empty list"),
    "series_of_strings": (_edit("curve", ["1"]), "curve", "finite numbers"),
    "series_with_nan": (_good_text().replace("[1.0, 0.5]", "[1.0, NaN]"),
                        "curve", "finite numbers"),
    "negative_in_series": (_edit("curve", [1.0, -1.0]), "curve", ">= 0"),
    "unknown_key": (_edit("extra", 1), "extra", "unknown"),
    "inner_not_object": (_edit("inner", 3), "inner", "must be an object"),
    "inner_key_missing": (_edit("inner", {}), "inner.rate", "misses"),
    "inner_out_of_bounds": (_edit("inner", {"rate": 2.0}), "inner.rate",
                            "in [0, 1]"),
    "deep": ("[" * 100_000, None, "nested too deeply"),
}


def _write(tmp_path, case: str) -> str:
  content, _, _ = CASES[case]
  if callable(content):
    content = content(json.loads(_good_text()))
  path = tmp_path / f"{case}.json"
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content, encoding="utf-8")
  return str(path)


def test_the_good_file_is_its_content(tmp_path):
  path = tmp_path / "good.json"
  path.write_text(_good_text())
  assert records.read_json(str(path), SCHEMA, REQUIRED) == GOOD


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_file_is_named_with_its_key(tmp_path, case):
  path = _write(tmp_path, case)
  _, key, word = CASES[case]
  got = records.read_json(path, SCHEMA, REQUIRED)
  assert isinstance(got, records.Damaged), got
  assert got.file == path and not got.missing
  assert got.key == key, got
  assert word in got.reason, got.reason
  line = str(got)
  assert "\n" not in line and line.startswith(f"{path}: ")
  if key not in (None, "(top level)"):
    assert key.split(".")[-1] in line and key.split(".")[0] in line
  warning = got.warning("treated as missing.")
  assert warning == f"warning: {path}: {got.reason}; treated as missing."
  assert str(got.error("--flag ")) == f"--flag {path}: {got.reason}"


def test_missing_directory_fifo_device_and_size(tmp_path):
  got = records.read_json(str(tmp_path / "nope.json"), SCHEMA)
  assert isinstance(got, records.Damaged) and got.missing
  assert got.reason == "does not exist"
  got = records.read_json(str(tmp_path))
  assert not got.missing and got.reason == "is a directory"
  fifo = tmp_path / "f.fifo"
  os.mkfifo(fifo)  # no writer: a blocking open would hang
  for path in (str(fifo), "/dev/zero"):
    got = records.read_json(path)
    assert "not a regular file" in got.reason, got
  big = tmp_path / "big.json"
  big.write_text("[" + "0," * 600 + "0]")
  assert records.read_json(str(big), max_bytes=1000).reason == (
      "is larger than 1000 bytes")
  assert records.read_json(3).reason.startswith("is not a path")


def test_a_cross_key_check_names_its_key(tmp_path):
  path = tmp_path / "x.json"
  path.write_text(_good_text())
  got = records.read_json(
      str(path), SCHEMA, REQUIRED,
      check=lambda d: ("count", "count must equal len(curve)")
      if d["count"] != len(d["curve"]) else None)
  assert got.key == "count" and got.reason == "count must equal len(curve)"


def _no_step(record):
  return None if isinstance(record.get("step"), int) else "no step"


# JSON lines: bytes -> (records kept, torn line, or the damaged line).
JSONL_CASES = {
    "good": (b'{"step": 0}\n{"step": 1}\n', [0, 1], None, None),
    "torn_last_line": (b'{"step": 0}\n{"st', [0], 2, None),
    "torn_only_line": (b'{"step": 0, "eval', [], 1, None),
    "unterminated_good": (b'{"step": 0}', [0], None, None),
    "empty": (b"", [], None, None),
    "blank_lines": (b'\n\n{"step": 3}\n\n', [3], None, None),
    "middle_line_cut": (b'{"step": 0}\n{"st\n{"step": 2}\n', None, None,
                        "line 2"),
    "middle_not_object": (b'{"step": 0}\n[1]\n{"step": 2}\n', None, None,
                          "line 2"),
    "binary_middle": (b'{"step": 0}\n\xff\xfe\x00\n{"step": 2}\n', None,
                      None, "line 2"),
    "check_refuses": (b'{"step": 0}\n{"loss": 1}\n', None, None, "line 2"),
}


@pytest.mark.parametrize("case", sorted(JSONL_CASES))
def test_json_lines(tmp_path, case):
  data, steps, torn, bad_line = JSONL_CASES[case]
  path = tmp_path / "m.jsonl"
  path.write_bytes(data)
  got = records.read_jsonl(str(path), _no_step)
  if bad_line is None:
    assert isinstance(got, records.Lines), got
    assert [r["step"] for r in got.records] == steps
    assert got.torn == torn
    assert got.dirty == (not data.endswith(b"\n") and data != b"")
  else:
    assert isinstance(got, records.Damaged)
    assert got.key == bad_line and got.reason.startswith(bad_line)
    assert "\n" not in str(got) and str(path) in str(got)


@pytest.mark.parametrize("rows, want", [
    ([{"step": 0, "l": 2.0}, {"step": 5, "l": 1.0}], ([0, 5], [2.0, 1.0])),
    ([{"step": 0, "l": None}, {"step": 5, "l": 1.0}], ([5], [1.0])),
    ([{"l": 3.0}, {"step": 5, "l": 1.0}], ([5], [1.0])),
    ([{"step": 0}], "has no 'l' record"),
    ([], "has no 'l' record"),
    ([{"step": 0, "l": "low"}], "'l' at step=0 must be a finite number"),
    ([{"step": 0, "l": float("nan")}],
     "'l' at step=0 must be a finite number, got nan"),
    ([{"step": "x", "l": 1.0}],
     "'step' of a 'l' record must be a finite number, got 'x'"),
])
def test_finite_series(rows, want):
  got = records.finite_series(rows, "l")
  if isinstance(want, str):
    assert isinstance(got, str) and got.startswith(want), got
  else:
    assert got == want
