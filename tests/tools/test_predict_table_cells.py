"""``predict``'s tables keep a space between every two cells whatever the
numbers: a column is as wide as its longest cell (values at the flags'
bounds overflow any fixed width). Expected values are worked out by hand."""

from __future__ import annotations

from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.tools.runtime_model_cli import tables


def _run(capsys, *argv) -> tuple[int, str, str]:
  rc = cli.main(["predict", "--steps", "20", *argv])
  out = capsys.readouterr()
  return rc, out.out, out.err


def test_table_cells_stay_apart_at_the_flags_bounds(capsys):
  # --params 1e15 (its bound) over --nic-Gbps / --wan-Gbps 1e-3 (theirs):
  # 13-digit milliseconds and 10-digit MB, wider than any fixed column.
  # All-Reduce of 64 workers, one per node: 2 (n-1)/n x 4e15 bytes = 7.875e9
  # MB per worker and node; DiLoCo syncs every H = 10 steps: 7.875e8. Half
  # the workers at speed 1e-3 under a quorum: (32 + 32 x 0.001) / 64 =
  # 50.05% of the work done.
  rc, out, err = _run(
      capsys, "--params", "1e15", "--bucket-MiB", "1e6", "--nic-Gbps",
      "1e-3", "--wan-Gbps", "1e-3", "--datacenters", "2", "--n-workers",
      "64", "--local-size", "1", "--methods", "all_reduce,diloco:H=10",
      "--slow-fraction", "0.5", "--slow-speed", "1e-3")
  assert rc == 0, err
  lines = out.splitlines()
  at = next(i for i, l in enumerate(lines) if l.startswith("  method "))
  header = ["method", "sim ms", "closed ms", "vs AR", "comm ms", "var ms",
            "MB/it", "node MB/it", "WAN MB/it"]
  assert lines[at].split() == " ".join(header).split()
  rows = [lines[at + 1].split(), lines[at + 2].split()]
  for row in rows:  # a label, then one number per header cell
    assert len(row) == len(header), row
    for cell in row[1:]:
      float(cell.rstrip("x"))
  assert rows[0][0] == "All-Reduce" and rows[1][0] == "diloco:H=10"
  assert rows[0][6:8] == ["7875000000.0", "7875000000.0"]
  assert rows[1][6:8] == ["787500000.0", "787500000.0"]
  at = next(i for i, l in enumerate(lines) if "mode" in l and "ms/step" in l)
  faults = [lines[at + 1].split(), lines[at + 2].split()]
  for row in faults:  # method, mode, ms/step, work %, useful %, ms/useful
    assert len(row) == 6, row
    for cell in (row[2], row[3], row[4], row[5]):
      float(cell)
  assert faults[1][1:2] + faults[1][3:4] == ["quorum", "50.0"]


def test_aligned_widens_a_column_to_its_longest_cell():
  # Column 1: 4 wide, but "123456" needs 6 + 1 for the space before it.
  assert tables.aligned([["m", "a"], ["x", "123456"]], [3, 4]) == [
      "  m        a", "  x   123456"]
  assert tables.aligned([["m", "a"], ["x", "12"]], [3, 4]) == [
      "  m     a", "  x    12"]
