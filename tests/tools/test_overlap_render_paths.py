"""``overlap --render``: its example file and the default ``--out`` are
shipped files, and one file named twice is refused (not printed twice)."""

import os
import re

import pytest

from decentral_jax.tools import overlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "benchmarks", "results", "gpu_overlap",
                    "main.jsonl")


def test_the_render_example_and_the_default_out_are_shipped():
  with pytest.raises(ValueError) as e:
    overlap.render([])
  example = re.search(r"e\.g\. --render (\S+)\.$", str(e.value)).group(1)
  assert os.path.isfile(os.path.join(ROOT, example)), example
  out = overlap.build_parser("overlap").parse_args([]).out
  assert os.path.isfile(out), out
  with open(os.path.join(ROOT, "docs", "gpu_overlap.md"),
            encoding="utf-8") as f:
    doc = f.read()
  named = re.search(r"Its rows are appended to `([^`]+)` \(the default "
                    r"`--out`", doc).group(1)
  assert os.path.isfile(os.path.join(ROOT, named)), named


def test_one_file_named_twice_is_refused(tmp_path, capsys):
  link = tmp_path / "link.jsonl"
  link.symlink_to(MAIN)
  rel = os.path.relpath(MAIN)
  for second in ("./" + rel, str(link)):
    with pytest.raises(ValueError, match=r"^--render: entry 2 .* is the "
                       r"file of entry 1 .*; give each file once\.$"):
      overlap.render([rel, second])
  assert capsys.readouterr().out == ""  # refused before any table
