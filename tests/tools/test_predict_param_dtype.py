"""``predict`` refuses ``--param-dtype`` exactly where no printed number
reads it.

The oracle is the output itself: with the dependency checks switched off,
``predict`` runs with and without ``--param-dtype``; the flag must be
accepted where a number changes (the table, or a compressed method's
break-even line, whose uncompressed baseline sends the parameters) and
refused, in one ``error:`` line, where none does.
"""

import contextlib
import io

import pytest

from decentral_jax.runtime_model import cluster_file
from decentral_jax.tools.runtime_model_cli import main as runtime_main
from decentral_jax.tools.runtime_model_cli import predict

FAMILIES = ("one_peer_exp", "aer", "dadam:topology=static_ring",
            "accum_adam", "local_sgd:H=4", "diloco:H=10",
            "streaming_diloco:H=10,P=2")
# sgp and gradient_tracking take no compress; all_reduce is in every line.
PLAIN_ONLY = ("sgp", "gradient_tracking")


def _spec(family: str, compressed: bool) -> str:
  if not compressed:
    return family
  return family + ("," if ":" in family else ":") + "compress=int8"


def _predict(argv, monkeypatch=None):
  """``(exit code, printed lines but the workload and methods lines,
  stderr)``; with ``monkeypatch``, the dependency checks are off."""
  if monkeypatch is not None:
    monkeypatch.setattr(predict, "NEEDS", ())
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = runtime_main.main(["predict", "--n-workers", "16", "--steps",
                                "40", *argv])
    except SystemExit as e:
      code = e.code
  if monkeypatch is not None:
    monkeypatch.undo()
  lines = [x for x in out.getvalue().splitlines()
           if not x.startswith(("workload:", "methods:"))]
  return code, lines, err.getvalue()


def _check(spec: str, dtype: str, monkeypatch) -> bool:
  """Asserts the verdict on ``--param-dtype dtype`` with ``spec`` matches
  the output; returns whether the output changed."""
  argv = ["--methods", "all_reduce," + spec]
  code, plain, err = _predict(argv, monkeypatch)
  assert code == 0, err
  code, with_dtype, err = _predict(argv + ["--param-dtype", dtype],
                                   monkeypatch)
  assert code == 0, err
  changes = plain != with_dtype
  code, _, err = _predict(argv + ["--param-dtype", dtype])
  if changes:
    assert code == 0, (spec, dtype, err)
  else:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1, (spec, dtype, err)
    assert lines[0].startswith("error: --param-dtype has no effect"), err
  return changes


def test_compressed_gossip_break_even_reads_the_parameter_dtype(monkeypatch):
  # int8 gossip is priced against uncompressed one_peer_exp, which sends
  # the parameters: bfloat16 halves its message, so the break-even rate
  # moves (the flag was refused as having no effect).
  assert _check("one_peer_exp:compress=int8", "bfloat16", monkeypatch)
  code, lines, err = _predict(["--methods", "one_peer_exp:compress=int8",
                               "--param-dtype", "bfloat16"])
  assert code == 0, err
  assert any("break-even:" in x for x in lines), lines


CASES = [(_spec(f, c), d) for f in FAMILIES + PLAIN_ONLY
         for c in (False, True) if not (c and f in PLAIN_ONLY)
         for d in ("bfloat16", "float64")]


@pytest.mark.slow
@pytest.mark.parametrize("spec, dtype", CASES)
def test_every_family_refused_exactly_where_nothing_changes(
    spec, dtype, monkeypatch):
  _check(spec, dtype, monkeypatch)


@pytest.mark.slow
def test_the_sweep_sees_both_verdicts(monkeypatch):
  # both sides are exercised: aer's compressed gossip is priced against
  # uncompressed aer and its break-even line stays put, DiLoCo's global
  # copy goes as float32 at least; one_peer_exp's compressed line moves.
  assert not _check("aer:compress=int8", "bfloat16", monkeypatch)
  assert not _check("diloco:H=10", "bfloat16", monkeypatch)
  assert _check("dadam:topology=static_ring,compress=int8", "bfloat16",
                monkeypatch)


def _cluster_file(tmp_path, param_dtype):
  """A cluster file of 16 workers, 4 per node, whose workload (None: no
  workload) has ``param_dtype`` parameters."""
  sizes = [1e6, 4e6, 16e6]
  meas = {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": 4,
          "intra_pair_s": [5e-6 + m / 20e9 for m in sizes],
          "inter_pair_s": [1e-5 + m / 3e9 for m in sizes],
          "inter_concurrent_s": [1e-5 + 4 * m / 6e9 for m in sizes],
          "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}
  w = None if param_dtype is None else {
      "param_count": 65e6, "forward_s": 0.03, "backward_s": 0.06,
      "grad_dtype": "float32", "param_dtype": param_dtype}
  path = str(tmp_path / f"cluster_{param_dtype}.json")
  cluster_file.write(path, {"cluster": cluster_file.fit_links(meas, 16, 4),
                            "workload": w, "measurements": meas,
                            "meta": {"devices": 16}})
  return path


@pytest.mark.parametrize("file_dtype, flag, changes", [
    # DiLoCo's global copy goes as max(float32, parameters): by hand, 4
    # bytes both ways in the first three, 4 vs 8 in the last two.
    ("float32", "bfloat16", False), ("bfloat16", "float32", False),
    (None, "bfloat16", False), ("float64", "float32", True),
    ("float32", "float64", True)])
def test_a_cluster_file_refuses_the_flag_where_nothing_changes(
    tmp_path, file_dtype, flag, changes, monkeypatch):
  argv = ["--cluster", _cluster_file(tmp_path, file_dtype), "--methods",
          "all_reduce,diloco:H=10"]
  code, plain, err = _predict(argv, monkeypatch)
  assert code == 0, err
  code, with_flag, err = _predict(argv + ["--param-dtype", flag], monkeypatch)
  assert code == 0, err
  assert (plain != with_flag) == changes  # the hand verdict, seen
  _accepted_exactly_if(changes, argv + ["--param-dtype", flag])


@pytest.mark.parametrize("methods, note", [
    ("all_reduce,diloco:H=10", True), ("all_reduce,one_peer_exp", False),
    ("all_reduce,diloco:H=10,comm_dtype=bfloat16", False)])
def test_the_workload_line_names_diloco_s_float32_sync(tmp_path, capsys,
                                                      methods, note):
  """bfloat16 parameters from the file: gossip sends them as they are,
  a sync of DiLoCo's global copy at float32; the line says which."""
  code = runtime_main.main(["predict", "--cluster",
                            _cluster_file(tmp_path, "bfloat16"), "--steps",
                            "40", "--methods", methods])
  out = capsys.readouterr().out
  assert code == 0
  line = [x for x in out.splitlines() if x.startswith("workload:")][0]
  assert "bfloat16 parameters on the wire" in line, line
  assert (", float32 in a sync of DiLoCo's global copy)" in line) == note, line


@pytest.mark.parametrize("file_dtype, flag, changes", [
    # the uncompressed static ring the break-even line prices sends the
    # parameters: by hand 2 vs 4 bytes and 8 vs 4 bytes move the line; the
    # file's own dtype again moves nothing
    ("bfloat16", "float32", True), ("float64", "float32", True),
    ("float32", "float32", False), ("bfloat16", "bfloat16", False)])
def test_a_break_even_line_is_compared_with_the_file_s_dtype(
    tmp_path, file_dtype, flag, changes, monkeypatch):
  """The flag replaces the file's dtype, not the default float32: float32
  over a bfloat16 file was refused although the line moved."""
  argv = ["--cluster", _cluster_file(tmp_path, file_dtype), "--methods",
          "all_reduce,dadam:topology=static_ring,compress=int8"]
  code, plain, err = _predict(argv, monkeypatch)
  assert code == 0, err
  code, with_flag, err = _predict(argv + ["--param-dtype", flag], monkeypatch)
  assert code == 0, err
  moved = [x for x in with_flag if "break-even:" in x]
  assert (moved != [x for x in plain if "break-even:" in x]) == changes
  _accepted_exactly_if(changes, argv + ["--param-dtype", flag])


def _accepted_exactly_if(changes: bool, argv) -> None:
  """``predict argv`` with the no-effect rules on: accepted where the flag
  changes a number, else one refusal naming --param-dtype."""
  code, _, err = _predict(argv)
  if changes:
    assert code == 0, err
  else:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --param-dtype has no effect"), err
