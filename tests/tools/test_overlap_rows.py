"""``decentral-jax overlap --render``: one validating reader of the rows.

Each damaged row (a field of the writer's of the wrong kind or range, more
matmul FLOPs in flight than in the program, a collective that is not an
object or whose bytes are NaN, a round the transfer table's topology does
not have) is refused in one ``error:`` line naming the file, the line and
the key, exit 2; never a traceback, never a table that reads it wrong. In
process, no compile.
"""

from __future__ import annotations

import copy
import json

import pytest

from decentral_jax.tools import overlap

_COLL = {"kind": "collective-permute", "name": "cp-start", "computation":
         "main", "op_name": "jit(step)/ppermute", "bytes": 4e8,
         "is_async": True, "in_conditional": False, "in_loop": False,
         "forward": 3, "backward": 10, "other": 2, "between": 15,
         "flops": 2e12, "overlapped": True}
# A gpt2_small program (the transfer table's case) as overlap --out writes
# it: round 1 of the two distinct rounds of AER on 8 workers, 4 per node.
ROW = {"case": "gpt2_small", "mode": "after", "target": "h200",
       "topology": "2x1x4", "overrides": ["n_workers=8"],
       "gossip_rounds": "static", "consensus_at": "next_step",
       "distinct_round": 1, "consensus": "none", "param_bytes": 4.97e8,
       "compile_s": 40.0, "compiler_options": "runner's GPU_COMPILER_OPTIONS",
       "network_gbps": 25.0, "total_flops": 2.6e13, "flops_in_flight": 8e12,
       "collectives": [_COLL]}


def _render(tmp_path, capsys, row):
  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps(row) + "\n")
  rc = overlap.main(["--render", str(path)])
  out = capsys.readouterr()
  return rc, out, str(path)


def _edit(key, value):
  row = copy.deepcopy(ROW)
  row[key] = value
  return row


def _edit_collective(key, value):
  row = copy.deepcopy(ROW)
  row["collectives"][0][key] = value
  return row


@pytest.mark.parametrize("row, says", [
    (_edit("flops_in_flight", 3 * 2.6e13),
     "flops_in_flight (7.8e+13) is more than total_flops (2.6e+13)"),
    (_edit("total_flops", 0.0),
     "flops_in_flight (8e+12) is more than total_flops (0)"),
    (_edit_collective("bytes", float("nan")),
     "collectives[0].bytes must be a finite number >= 0, got nan"),
    (_edit_collective("bytes", -1.0),
     "collectives[0].bytes must be a finite number >= 0, got -1.0"),
    (_edit_collective("flops", 3e13),
     "collectives[0].flops (3e+13) is more than the program's total_flops "
     "(2.6e+13)"),
    (_edit_collective("is_async", "yes"),
     "collectives[0].is_async must be true or false, got 'yes'"),
    (_edit("collectives", [1]), '"collectives[0]" must be an object'),
    (_edit("collectives", [{"kind": "all-reduce"}]),
     "\"collectives[0]\" misses ['bytes',"),
    (_edit("distinct_round", 99),
     "distinct_round must be in [0, 1] (the distinct rounds of "
     "alternating_exp_ring on 8 workers), got 99"),
    (_edit("network_gbps", "25"),
     "network_gbps must be a finite number in [0, 1e+06], got '25'"),
    (_edit("mode", "later"), "mode must be one of before, after, got 'later'"),
    (_edit("consensus", "always"),
     "consensus must be one of logged, input, none, got 'always'"),
    (_edit("compile_s", -3), "compile_s must be a finite number >= 0"),
    (_edit("overrides", "n_workers=8"), "overrides must be a list of strings"),
    (_edit("compiler_options", 7),
     "compiler_options must be an object or a string, got 7"),
    (_edit("gossip_rounds", "bogus"),
     "gossip_rounds must be one of switch, static, got 'bogus'"),
    (_edit("consensus_at", "auto"),
     "consensus_at must be one of log_step, next_step, got 'auto'"),
    (_edit("param_bytes", 0.0), "param_bytes must be in (0, 1125899906842624]"),
    (_edit("gossip_rounds", "switch"),
     "distinct_round must be null with gossip_rounds switch"),
    ({**_edit("case", "gpt_tiny"), "distinct_round": 8},
     "distinct_round must be below the row's 8 workers"),
    ({**_edit("case", "virtual"), "overrides": ["workers_per_device=4"],
      "topology": "1x1x2", "distinct_round": 8},
     "distinct_round must be below the row's 8 workers"),
    (_edit("param_bytes", 1e308),
     "param_bytes must be in (0, 1125899906842624]"),
    # str.isdigit() takes "²" and "³", which int() refuses; "08" would
    # be a second spelling of 8.
    (_edit("overrides", ["n_workers=\u00b2"]),
     'overrides: "n_workers=\u00b2" must be a whole number >= 1 in ASCII '
     "digits without a leading zero"),
    (_edit("overrides", ["n_workers=08"]), 'overrides: "n_workers=08" must'),
    (_edit("overrides", ["n_workers=0"]), 'overrides: "n_workers=0" must'),
    ({**_edit("overrides", ["workers_per_device=\u00b3"]),
      "topology": "1x1x2"},
     'overrides: "workers_per_device=\u00b3" must be a whole number'),
    (_edit("topology", "\u00b2x8"),
     "topology must be slices x hosts x devices, whole numbers >= 1 in "
     "ASCII digits (e.g. 2x1x4), got '\u00b2x8'"),
])
def test_a_damaged_row_is_refused_naming_file_line_and_key(
    tmp_path, capsys, row, says):
  rc, out, path = _render(tmp_path, capsys, row)
  assert rc == 2 and "Traceback" not in out.err and out.out == ""
  lines = out.err.strip().splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"error: --render {path}: line 1: {says}"), (
      lines)


def test_the_good_row_renders_both_tables(tmp_path, capsys):
  rc, out, _ = _render(tmp_path, capsys, ROW)
  assert rc == 0 and out.err == ""
  # 8e12 of 2.6e13 FLOPs in flight: 31 % (by hand), in both tables.
  assert out.out.count("| 31% |") == 2, out.out
  assert "after + 25 Gbit/s model" in out.out


def test_a_program_without_matmuls_has_no_in_flight_share(tmp_path, capsys):
  """total_flops 0 (and so nothing in flight): the transfer table says
  "-" for the share instead of dividing by zero."""
  row = _edit("total_flops", 0.0)
  row["flops_in_flight"] = 0.0
  row["collectives"][0]["flops"] = 0.0
  rc, out, _ = _render(tmp_path, capsys, row)
  assert rc == 0 and out.err == "", out.err
  transfer = out.out.split("| program | mode | matmul GFLOP/step |")[1]
  assert "| round 1, none | after + 25 Gbit/s model | 0 | - |" in transfer


def test_the_row_schema_names_the_writers_values():
  """The consensus modes a row may hold are the runner's; the keys of a
  collective are those the overlap report writes."""
  import dataclasses
  from decentral_jax.analysis import overlap as report_lib
  from decentral_jax.runner import step
  from decentral_jax.tools import overlap_rows
  assert overlap_rows.CONSENSUS_MODES == step.CONSENSUS_MODES
  from decentral_jax.runner import config as config_lib
  assert set(overlap_rows.GOSSIP_ROUNDS) | {"auto"} == set(
      config_lib.GOSSIP_ROUNDS)
  assert set(overlap_rows.CONSENSUS_AT) | {"auto"} == set(
      config_lib.CONSENSUS_AT)
  fields = {f.name for f in dataclasses.fields(report_lib.CollectiveOverlap)}
  assert set(overlap_rows.COLLECTIVE_SCHEMA) == fields | {"between"}
