"""Benchmark scripts read their own results files back (a report, the
runs a study keeps): a damaged or foreign file is one ``error:`` line
naming the flag, the file and the key (exit code 2), never a traceback;
an empty output path typed over a default one is refused before any
work."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402  pylint: disable=wrong-import-position

FIELDS = {"case": "str", "n": "int", "loss": "real", "acc": "number?",
          "mem": {"used": "number"}}
GOOD = {"case": "a", "n": 2, "loss": float("nan"), "acc": None,
        "mem": {"used": 1.5}}


def _refused(capsys, read) -> str:
  with pytest.raises(SystemExit) as e:
    read()
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  return err[0]


def test_good_rows_read_back_and_a_missing_file_is_no_rows(tmp_path):
  f = tmp_path / "r.jsonl"
  f.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "n": 3})
               + "\n")
  rows = _common.read_rows(str(f), "--out", FIELDS)
  assert [r["n"] for r in rows] == [2, 3]
  assert _common.read_rows(str(tmp_path / "none.jsonl"), "--out",
                           FIELDS) == []


@pytest.mark.parametrize("text, says", [
    ("garbage\n", "line 1: not a JSON record (not JSON: Expecting value"),
    ('{"a": 1}\n', "line 1: misses 'case' (the keys it must have: ['case', "
     "'n', 'loss', 'acc', 'mem'])"),
    (json.dumps({**GOOD, "n": "2"}) + "\n", "line 1: n must be an integer, "
     "got '2'"),
    (json.dumps({**GOOD, "loss": "x"}) + "\n", "line 1: loss must be a "
     "number, got 'x'"),
    (json.dumps({**GOOD, "mem": {}}) + "\n", "line 1: mem misses 'used'"),
    (json.dumps({**GOOD, "mem": 3}) + "\n", "line 1: mem must be an object, "
     "got 3"),
    # a last line without its newline: the next append would join it
    (json.dumps(GOOD) + "\ngarbage", "line 2: not a JSON record (cut short, "
     "without its newline); remove that line")])
def test_a_damaged_row_is_one_line_naming_flag_file_and_key(
    capsys, tmp_path, text, says):
  f = tmp_path / "r.jsonl"
  f.write_text(text)
  err = _refused(capsys, lambda: _common.read_rows(str(f), "--out", FIELDS))
  assert err.startswith(f"error: --out {f}: {says}"), err
  assert err.endswith("give the results file this script wrote, or another "
                      "--out path."), err


@pytest.mark.parametrize("doc, says", [
    ("garbage", "is not JSON"),
    ('{"a": 1}', "misses 'machine'"),
    ("[1]", "must be a JSON object with ['machine', 'args', 'rows']"),
    ('{"machine": {}, "args": {}, "rows": []}', "args misses 'global_batch'"),
    ('{"machine": {}, "args": {"global_batch": 4}, "rows": []}',
     "rows must be a non-empty list"),
    ('{"machine": {}, "args": {"global_batch": 4}, "rows": [{"m": 1}]}',
     "rows[0] misses 'm2'")])
def test_a_damaged_document_is_one_line_naming_flag_file_and_key(
    capsys, tmp_path, doc, says):
  f = tmp_path / "r.json"
  f.write_text(doc)
  err = _refused(capsys, lambda: _common.read_document(
      str(f), "--report", {"machine": "object", "args": {
          "global_batch": "int"}, "rows": "list"}, {"m": "int", "m2": "str"}))
  assert err.startswith(f"error: --report {f}: "), err
  assert says in err, err


def test_a_good_document_reads_back(tmp_path):
  f = tmp_path / "r.json"
  doc = {"machine": {}, "args": {"global_batch": 4}, "rows": [{"m": 1}]}
  f.write_text(json.dumps(doc))
  assert _common.read_document(str(f), "--report", {"rows": "list"},
                               {"m": "int"}) == doc


def _parser():
  ap = argparse.ArgumentParser(prog="bench")
  ap.add_argument("--out", default="/tmp/x.jsonl")
  ap.add_argument("--cache_dir", default="/tmp/cache")
  ap.add_argument("--json", default=None)  # None: not given
  return ap


@pytest.mark.parametrize("argv, says", [
    (["--out", ""], "error: --out is empty; give a file name."),
    (["--out", " "], "error: --out is empty; give a file name."),
    (["--cache_dir", ""], "error: --cache_dir is empty; give a directory.")])
def test_an_empty_output_path_over_a_default_is_refused(capsys, argv, says):
  ap = _parser()
  args = ap.parse_args(argv)
  with pytest.raises(SystemExit) as e:
    _common.check_flags(ap, args, outputs=("--out", "--json"),
                        dirs=("--cache_dir",))
  assert e.value.code == 2
  assert says in capsys.readouterr().err


def test_a_left_out_output_is_not_given_and_an_empty_one_is_refused(
    tmp_path, capsys):
  # "" ran the whole benchmark and wrote nothing, without a word.
  ap = _parser()
  good = ["--out", str(tmp_path / "o.jsonl"), "--cache_dir",
          str(tmp_path / "c")]
  _common.check_flags(ap, ap.parse_args(good), outputs=("--out", "--json"),
                      dirs=("--cache_dir",))
  with pytest.raises(SystemExit) as e:
    _common.check_flags(ap, ap.parse_args(["--json", "", *good]),
                        outputs=("--out", "--json"), dirs=("--cache_dir",))
  assert e.value.code == 2
  assert "error: --json is empty; give a file name." in (
      capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.parametrize("script, argv, says", [
    ("bench_step_time", ["--report", "OTHER"], "error: --report OTHER: "
     "misses 'machine'"),
    ("bench_step_time", ["--report", "GARBAGE"], "error: --report GARBAGE: "
     "is not JSON"),
    ("bench_evidence", ["--report", "--out", "OTHER"], "error: --out OTHER: "
     "line 1: misses 'part'"),
    ("bench_convergence", ["--report", "--out", "OTHER"], "error: --out "
     "OTHER: line 1: misses 'family'"),
    # run mode: the kept runs are read before any training
    ("bench_convergence", ["--out", "GARBAGE", "--steps", "2"], "error: "
     "--out GARBAGE: line 1: not a JSON record (cut short"),
    ("bench_overlap_at_scale", ["--table", "--out", "OTHER"], "error: --out "
     "OTHER: line 1: misses 'case'"),
    ("bench_convergence", ["--out", ""], "error: --out is empty"),
    ("bench_step_time", ["--json", ""], "error: --json is empty"),
    ("bench_evidence", ["--part", "main", "--out", ""],
     "error: --out is empty")])
def test_the_scripts_refuse_a_damaged_results_file(tmp_path, script, argv,
                                                   says):
  paths = {"OTHER": tmp_path / "other.jsonl", "GARBAGE": tmp_path / "g.json"}
  paths["OTHER"].write_text('{"a": 1}\n')
  paths["GARBAGE"].write_text("garbage")
  argv = [str(paths.get(a, a)) for a in argv]
  says = says.replace("OTHER", str(paths["OTHER"])).replace(
      "GARBAGE", str(paths["GARBAGE"]))
  r = subprocess.run([sys.executable, os.path.join(
      ROOT, "benchmarks", f"{script}.py"), *argv], capture_output=True,
                     text=True, timeout=300, check=False,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                     cwd=tmp_path)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith(says), r.stderr[-2000:]
  assert paths["GARBAGE"].read_text() == "garbage"
