"""Delayed and eager outer updates (trickled reduction), what the library
cannot run yet, and the utilisation curve of the eager paper's Table 5.
Expected values are worked out by hand from docs/runtime_model.md."""

from __future__ import annotations


import re

import pytest

from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import traffic
from decentral_jax.runtime_model import utilisation

A, B = 1e-4, 1.25e9  # per message (s), per node and direction (bytes/s)
N = 1e8  # parameters: 400 MB of float32 pseudo-gradient


def _cluster(n=4):
  return Cluster(n, 1, inter_latency_s=A, nic_bandwidth_Bps=B,
                      multi_node="ring")


def _workload(step_s, cv=0.0):
  return Workload(N, step_s / 3, 2 * step_s / 3, compute_cv=cv,
                       bucket_bytes=1e15)


@pytest.mark.parametrize("step_s", [0.01, 0.2])
def test_trickled_reduction_by_hand(step_s):
  # A slice of M/H = 4e8/10 bytes each step, flat ring over 4 workers:
  # 2*3 a + 2*3/4 * 4e7 / b = 0.0006 + 0.048 s; the step takes the longer
  # of compute and slice. Plain DiLoCo blocks: x + (6 a + 1.5 * 4e8 / b)/H.
  c, w = _cluster(), _workload(step_s)
  slice_s = 6 * A + 1.5 * 4e7 / B
  assert slice_s == pytest.approx(0.0486)
  for spec in ("diloco:H=10,overlap=eager", "diloco:H=10,overlap=delayed"):
    est = closed_form(spec, c, w)
    assert est.iteration_s == pytest.approx(max(step_s, slice_s))
    assert est.exposed_comm_s == pytest.approx(max(0.0, slice_s - step_s))
    assert simulate(spec, c, w, steps=60, warmup=10) == pytest.approx(
        max(step_s, slice_s))
  plain = closed_form("diloco:H=10", c, w).iteration_s
  assert plain == pytest.approx(step_s + (6 * A + 1.5 * 4e8 / B) / 10)
  # Same bytes as plain DiLoCo, spread over the period.
  sent = traffic.bytes_per_iteration("diloco:H=10,overlap=eager", c, w)
  assert sent.worker_bytes == pytest.approx(1.5 * 4e8 / 10)


@pytest.mark.parametrize("step_s", [0.025, 0.0486, 0.08])
@pytest.mark.parametrize("n", [2, 8])
def test_trickled_closed_form_tracks_the_simulator_with_variability(step_s, n):
  c, w = _cluster(n), _workload(step_s, cv=0.1)
  spec = "diloco:H=10,overlap=eager"
  sim = simulate(spec, c, w, steps=2000, warmup=100)
  closed = closed_form(spec, c, w).iteration_s
  assert closed == pytest.approx(sim, rel=0.03), (sim, closed)
  # Compute variability costs something, but less than a barrier per step.
  det = max(step_s, closed_form(spec, c, _workload(step_s)).iteration_s)
  assert det < sim < det + 0.1 * step_s * 3


def test_overlap_is_refused_where_it_is_not_priced():
  c = _cluster()
  for bad in ("diloco:H=10,overlap=eager,topology=ring",
              "streaming_diloco:H=10,P=2,overlap=eager",
              "local_sgd:H=10,overlap=eager"):
    with pytest.raises(ValueError, match="overlap"):
      make_method(bad, c)
  with pytest.raises(ValueError, match="none, delayed or eager"):
    make_method("diloco:H=10,overlap=soon", c)


def test_what_the_library_cannot_run_is_marked():
  c = _cluster(8)
  gaps = {spec: method_lib.library_gap(make_method(spec, c)) for spec in (
      "all_reduce", "aer", "diloco:H=10", "streaming_diloco:H=10,P=2,tau=0",
      "streaming_diloco:H=10,P=2,tau=1", "diloco:H=10,overlap=eager",
      "diloco:H=10,overlap=delayed", "diloco:H=10,compress=int8",
      "diloco:H=10,overlap=eager,compress=int8",
      "diloco:H=10,overlap=eager,comm_dtype=bfloat16",
      "local_dsgd:H=4,topology=ring")}
  runnable = {k for k, v in gaps.items() if v is None}
  assert runnable == {"all_reduce", "aer", "diloco:H=10",
                      "streaming_diloco:H=10,P=2,tau=0",
                      "diloco:H=10,overlap=eager",
                      "diloco:H=10,overlap=delayed",
                      "diloco:H=10,compress=int8",
                      "diloco:H=10,overlap=eager,comm_dtype=bfloat16",
                      "local_dsgd:H=4,topology=ring"}
  assert "all-reduces in the merge step's conditional" in gaps[
      "streaming_diloco:H=10,P=2,tau=1"]
  assert "eager" in gaps["diloco:H=10,overlap=eager,compress=int8"]


def _prediction(key, seconds, gap=None, slow=False):
  est = Estimate(key, seconds, seconds, 0.0, 0.0)
  return recommend.Prediction(key, seconds, est, traffic.Traffic(0.0, 0.0),
                              slow, False, gap)


def test_recommend_never_picks_what_the_library_cannot_run():
  table = {"all_reduce": _prediction("all_reduce", 1.0),
           "streaming_diloco:H=10,P=4,tau=1": _prediction(
               "streaming_diloco:H=10,P=4,tau=1", 0.2, gap="tau >= 1"),
           "diloco:H=10,overlap=eager": _prediction(
               "diloco:H=10,overlap=eager", 0.3, gap="eager"),
           "diloco:H=10": _prediction("diloco:H=10", 0.5)}
  assert recommend.recommend(table).startswith("diloco:H=10: 500.0 ms")
  del table["diloco:H=10"]
  assert recommend.recommend(table).startswith("All-Reduce")


def test_predict_marks_and_skips_the_readme_example(capsys):
  # The README's 1.3B example: Streaming DiLoCo with tau=1 is the fastest
  # row but not what the library runs (smaller steps to keep this fast).
  assert cli.main([
      "predict", "--n-workers", "32", "--local-size", "8", "--nic-Gbps",
      "25", "--params", "1.3e9", "--forward-ms", "60", "--backward-ms",
      "120", "--compute-cv", "0.05", "--steps", "40", "--methods",
      "all_reduce,diloco:H=10,streaming_diloco:H=10,P=4,tau=1,"
      "comm_dtype=bfloat16,diloco:H=10,topology=aer"]) == 0
  out = capsys.readouterr().out
  assert "streaming_diloco:H=10,P=4,tau=1,comm_dtype=bfloat16^" in out
  assert "^ not in the library yet" in out
  assert "recommendation: diloco:H=10,topology=aer:" in out


# --- utilisation (Kale et al. 2025, Table 5 setting) --------------------------


def test_data_parallel_needs_about_222_gbit_for_95_percent():
  s = utilisation.Setting()
  dp = utilisation.rate_for("all_reduce", s, 0.95)
  assert 111 <= 8 * dp / 1e9 <= 444  # within 2x of the paper's figure


def test_eager_rates_by_hand():
  # 2 workers: the all-reduce of a slice is one exchange of M/H. 95%
  # utilisation needs the slice within 0.1 / 0.95 s.
  s = utilisation.Setting()
  limit = 0.1 / 0.95
  fp32 = 4e9 / 30 / limit
  assert utilisation.rate_for("diloco:H=30,overlap=eager", s, 0.95) == (
      pytest.approx(fp32, rel=1e-9))
  assert 8 * fp32 / 1e9 == pytest.approx(10.13, abs=0.01)
  bf16 = utilisation.rate_for("diloco:H=30,overlap=eager,comm_dtype=bfloat16",
                              s, 0.95)
  assert bf16 == pytest.approx(fp32 / 2, rel=1e-9)
  # fp4: 1e9 / 256 blocks of 132 bytes; codec 3.5 * 4e9 bytes at 100 GB/s
  # per sync (4.67 ms per step, serial with compute): the ceiling is
  # 0.1 / 0.10467 = 95.5%, so 95% is reached, 99% never.
  fp4_spec = "diloco:H=30,overlap=eager,compress=fp4"
  fp4 = 1e9 / 256 * 132 / 30 / limit
  assert utilisation.rate_for(fp4_spec, s, 0.95) == pytest.approx(
      fp4, rel=1e-9)
  assert 8 * fp4 / 1e9 == pytest.approx(1.306, abs=0.001)
  assert utilisation.rate_for(fp4_spec, s, 0.99) is None
  assert utilisation.utilisation(fp4_spec, s, 1e13) == pytest.approx(
      0.1 / (0.1 + 3.5 * 4e9 / 100e9 / 30))


def test_utilisation_command_writes_table_and_png(capsys, tmp_path):
  png, md = tmp_path / "u.png", tmp_path / "u.md"
  assert cli.main(["utilisation", "--png", str(png), "--table", str(md)]) == 0
  out = capsys.readouterr().out
  assert png.stat().st_size > 10_000
  text = md.read_text()
  assert text.strip() in out
  rows = [l for l in text.splitlines() if l.startswith("| ")]
  assert len(rows) == 1 + len(utilisation.METHODS)  # header and methods
  assert rows[1].startswith("| data-parallel (bf16 gradients) | `all_reduce`")
  assert "| eager (fp4) ^ |" in text
  assert "Kale et al. 2025 (Table 5): about 222 Gbit/s" in text
  assert cli.main(["utilisation", "--png", str(tmp_path / "no" / "u.png")]
                  ) == 2


@pytest.mark.parametrize("table, margin, named", [
    ({}, 0.05, "'all_reduce' entry"),
    ({"diloco:H=10": None}, 0.05, "'all_reduce' entry"),
    ({"all_reduce": None}, 0.05, "table['all_reduce'] must be a Prediction"),
    ("all_reduce", 0.05, "must be a dict of Prediction"),
    ("ZERO", 0.05, "table['diloco:H=10'] must be a Prediction with a finite"),
    ("NAN", 0.05, "finite simulated_s > 0"),
    ("OK", -0.1, "margin must be a finite number >= 0"),
    ("OK", float("nan"), "margin must be a finite number >= 0"),
    ("OK", True, "margin must be a finite number >= 0"),
])
def test_recommend_refuses_what_it_cannot_rank(table, margin, named):
  """A zero or non-finite method time would divide the speed-up by zero."""
  ok = {"all_reduce": _prediction("all_reduce", 1.0)}
  table = {"ZERO": {**ok, "diloco:H=10": _prediction("diloco:H=10", 0.0)},
           "NAN": {**ok, "diloco:H=10": _prediction("diloco:H=10",
                                                    float("nan"))},
           "OK": ok}.get(table, table) if isinstance(table, str) else table
  with pytest.raises(ValueError, match=re.escape(named)):
    recommend.recommend(table, margin)
