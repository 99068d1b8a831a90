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
