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


def _row(out: str, name: str) -> list[str]:
  return next(l.split() for l in out.splitlines()
              if l.startswith(f"  {name} "))


def test_sub_tenth_ms_times_keep_their_digits_beside_the_ratio(capsys):
  """With no compute and 1 parameter a gossip step takes a few
  microseconds: it printed 0.0 ms beside 14.40x (and a recommendation of
  "0.0 ms/iteration, 14.40x faster"), a ratio of zeros to the eye."""
  rc, out, err = _run(capsys, "--params", "1", "--forward-ms", "0",
                      "--backward-ms", "0", "--n-workers", "16",
                      "--methods", "all_reduce,one_peer_exp")
  assert rc == 0, err
  ar, exp = _row(out, "All-Reduce"), _row(out, "DAdam")
  exp_ms = float(exp[2])  # ["DAdam", "(Exp)", sim ms, closed ms, vs AR, ..]
  assert 0 < exp_ms < 0.05 and len(exp[2].lstrip("0.")) == 2, exp
  # The printed ratio is the printed times' (All-Reduce's to 0.05 ms).
  ratio = float(exp[4].rstrip("x"))
  assert abs(ratio * exp_ms - float(ar[1])) <= 0.05 + ratio * exp_ms * 0.01
  rec = next(l for l in out.splitlines() if "recommendation:" in l)
  assert f"DAdam (Exp): {exp[2]} ms/iteration, {exp[4]} faster" in rec, rec
  assert ar[3] == "1.00x" and exp[6] == "0.0"  # var ms: an exact 0


def test_one_worker_with_no_compute_is_refused_by_name(capsys):
  """Every time 0: the ratios divided by zero (a ZeroDivisionError)."""
  rc, out, err = _run(capsys, "--forward-ms", "0", "--backward-ms", "0",
                      "--n-workers", "1", "--local-size", "1")
  assert rc == 2 and not out
  assert err.strip() == (
      "error: --n-workers 1 with no compute (--forward-ms, --backward-ms "
      "and --optimizer-ms all 0): one worker sends nothing, so every method "
      "takes 0 ms per iteration and none is faster than another; give a "
      "compute time > 0 or --n-workers >= 2.")
  # An optimizer step alone is a time: 1 ms for every method, 1.00x.
  rc, out, err = _run(capsys, "--forward-ms", "0", "--backward-ms", "0",
                      "--optimizer-ms", "1", "--n-workers", "1",
                      "--local-size", "1", "--methods", "all_reduce,ring")
  assert rc == 0, err
  assert _row(out, "All-Reduce")[1:5] == ["1.0", "1.0", "1.00x", "0.0"]
