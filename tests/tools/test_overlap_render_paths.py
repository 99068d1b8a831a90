"""``overlap --render``: its example file is shipped, the default ``--out``
is not one of the shipped rows (a run leaves them as they are), and one
file named twice is refused (not printed twice)."""

import os
import re

import pytest

from decentral_jax.tools import overlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "benchmarks", "results", "gpu_overlap",
                    "main.jsonl")


def test_the_render_example_is_shipped_and_the_default_out_is_not():
  with pytest.raises(ValueError) as e:
    overlap.render([])
  example = re.search(r"e\.g\. --render (\S+)\.$", str(e.value)).group(1)
  assert os.path.isfile(os.path.join(ROOT, example)), example
  out = overlap.build_parser("overlap").parse_args([]).out
  shipped = os.path.join(ROOT, "benchmarks", "results", "gpu_overlap")
  assert os.path.dirname(out) != shipped and not os.path.isdir(out), out
  with open(os.path.join(ROOT, "docs", "gpu_overlap.md"),
            encoding="utf-8") as f:
    doc = f.read()
  named = re.search(r"Its rows are appended to `([^`]+)` \(the default "
                    r"`--out`.*?e\.g\. `([^`]+)`, which `--render` prints",
                    doc)
  assert os.path.join(ROOT, named.group(1)) == out
  assert os.path.isfile(os.path.join(shipped, named.group(2)))


def test_one_file_named_twice_is_refused(tmp_path, capsys):
  link = tmp_path / "link.jsonl"
  link.symlink_to(MAIN)
  rel = os.path.relpath(MAIN)
  for second in ("./" + rel, str(link)):
    with pytest.raises(ValueError, match=r"^--render: entry 2 .* is the "
                       r"file of entry 1 .*; give each file once\.$"):
      overlap.render([rel, second])
  assert capsys.readouterr().out == ""  # refused before any table
