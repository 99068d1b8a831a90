"""Every ``$ python -m decentral_jax.runtime_model predict`` block of the
docs shows what that command prints now, line for line ("Every number ...
was printed by the command shown above it"). A ``  ...`` output line stands
for lines left out; ``--methods ...`` repeats the previous command's
``--methods``. A command that reads a measured ``--cluster`` file is not
run (the file is not in the repository)."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.tools.runtime_model_cli import tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = "$ python -m decentral_jax.runtime_model "


def _blocks():
  """``(where, argv, doc output lines)`` of each documented predict run."""
  found = []
  for path in sorted((ROOT / "docs").glob("*.md")):
    lines = path.read_text().splitlines()
    methods = None
    for i, line in enumerate(lines):
      if not line.startswith(PROMPT + "predict"):
        continue
      cmd, j = line, i
      while cmd.endswith("\\"):
        j += 1
        cmd = cmd[:-1] + " " + lines[j].strip()
      argv = shlex.split(cmd[len(PROMPT):])
      if "--methods" in argv:
        k = argv.index("--methods") + 1
        if argv[k] == "...":
          argv[k] = methods
        methods = argv[k]
      out = []
      for row in lines[j + 1:]:
        if row.startswith(("```", "$ ")):
          break
        out.append(row)
      if "--cluster" not in argv:
        found.append((f"{path.name}:{i + 1}", argv, out))
  return found


def _copies():
  """``(where, lines)`` of each fenced block with no prompt that starts with
  predict's ``workload:`` line: a copy of a command's output shown above."""
  found = []
  for path in sorted((ROOT / "docs").glob("*.md")):
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines[:-1]):
      if line == "```" and lines[i + 1].startswith("workload: "):
        end = lines.index("```", i + 1)
        found.append((f"{path.name}:{i + 2}", lines[i + 1:end]))
  return found


BLOCKS = _blocks()


def test_the_docs_hold_the_predict_runs_checked_here():
  # runtime_model.md: 2; runtime_model_wan_compression.md: 4; faults.md: 1.
  assert sorted(w.split(":")[0] for w, _, _ in BLOCKS) == (
      ["faults.md"] + ["runtime_model.md"] * 2
      + ["runtime_model_wan_compression.md"] * 4)


# The first block in the fast tier, the others (2 to 3 s each) in `slow`.
@pytest.mark.parametrize("where,argv,doc", [
    pytest.param(*b, marks=[pytest.mark.slow] if k else [])
    for k, b in enumerate(BLOCKS)], ids=[w for w, _, _ in BLOCKS])
def test_a_documented_predict_table_is_what_the_command_prints(
    where, argv, doc, capsys):
  assert cli.main(argv) == 0, where
  got = capsys.readouterr().out.splitlines()
  if "  ..." not in doc:
    assert got == doc, where
    return
  parts = [[]]  # runs of shown lines between the "  ..." lines
  for line in doc:
    if line == "  ...":
      parts.append([])
    else:
      parts[-1].append(line)
  at = 0  # each run follows the previous one, in order
  for part in filter(None, parts):
    starts = [k for k in range(at, len(got) - len(part) + 1)
              if got[k:k + len(part)] == part]
    assert starts, (where, part)
    at = starts[0] + len(part)


def test_a_copied_predict_output_is_a_checked_commands():
  # runtime_model.md's quick start shows the first command's output again.
  copies = _copies()
  assert [w.split(":")[0] for w, _ in copies] == ["runtime_model.md"]
  for where, lines in copies:
    assert any(lines == doc for _, _, doc in BLOCKS), where


def test_float_rounding_of_a_step_time_is_no_time():
  # 100 ms step: 6.9e-17 s is 6.9e-16 of it (3 float64 eps), below 1e-9;
  # 2.5e-9 s (2.5e-6 ms, a normal tail's expected wait) is 2.5e-8 of it.
  assert tables.part_of_step(6.9e-17, 0.1) == 0.0
  assert tables.part_of_step(-6.9e-17, 0.1) == 0.0
  assert tables.part_of_step(2.5e-9, 0.1) == 2.5e-9
  assert tables.part_of_step(0.0, 0.0) == 0.0
