"""A kept run whose record contradicts its own metrics.jsonl is not kept.

The records are signed again after each edit (as a run signs them), so
the checksums pass and only the rules between the two files can catch
them: a final value other than the last row's, a throughput other than
tokens per step / step time, a divergence at a step the rows go past.
All in process, nothing trains.
"""

from __future__ import annotations

import json
import os

import pytest

from decentral_jax.runner import metrics
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.compare import record as record_lib

# A gpt run of 3 steps, global_batch 16 x block_size 8 = 128 tokens a step
# (by hand).
_CONFIG = {"steps": 3, "seed": 0, "n_workers": 8, "global_batch": 16,
           "model": {"name": "gpt", "param_dtype": "float32",
                     "block_size": 8}}


def _row(step: int, **values) -> dict:
  """A row of metrics.jsonl as the runner writes it: ``lr`` and
  ``train_time_s`` in every record, ``train/loss`` after step 0 (a row
  without one is damage: metrics_rules.missing_error); lr 1e-3 (the
  config sets no schedule), 5 ms a step, a training loss of 2.5, then
  ``values`` (which override them)."""
  row = {"step": step, "lr": 1e-3}
  if step:
    row["train/loss"] = 2.5
  row["train_time_s"] = 0.005 * step
  row.update(values)
  return row


# 128 tokens / 0.004 s = 32000 tokens/s; 128 / 0.005 s = 25600 tokens/s.
_ROWS = [_row(0, **{"eval/loss": 4.0, "consensus_distance": 1e-14}),
         _row(3, **{"train/loss": 2.5, "consensus_distance": 2.26e-13,
                    "step_time_ms": 5.0, "tokens_per_sec": 25600.0,
                    "eval/loss": 2.0})]
_FINAL = {"step": 3, "eval/loss": 2.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 2.26e-13,
          "train/loss": 2.5, "step_time_ms": 4.0, "tokens_per_sec": 32000.0}


class _Config:
  model, data = {}, {}  # no data files

  def __init__(self, config=None):
    self.config = config or _CONFIG

  def to_json(self) -> str:
    return json.dumps(self.config)


def _run(tmp_path, final=None, diverged=None, rows=None, config=None) -> str:
  run_dir = tmp_path / "run"
  run_dir.mkdir(exist_ok=True)
  (run_dir / record_lib.RESULT_FILE).write_text(json.dumps(
      {"config": config or _CONFIG, "final": final, "diverged": diverged,
       "data_files": {}}))
  (run_dir / metrics.METRICS_FILE).write_text(
      "".join(json.dumps(r) + "\n" for r in rows or _ROWS))
  record_lib.sign(str(run_dir))
  return str(run_dir)


def _status(run_dir, capsys, config=None):
  status = job_lib.arm_status(run_dir, _Config(config))[0]
  return status, capsys.readouterr().err


def test_a_consistent_record_is_kept(tmp_path, capsys):
  assert _status(_run(tmp_path, final=dict(_FINAL)), capsys) == (
      "finished", "")


@pytest.mark.parametrize("edit, says", [
    ({"consensus_distance": 5.0}, "final.consensus_distance is 5.0, but the "
     "last row of metrics.jsonl that records it (step 3) has 2.26e-13"),
    ({"train/loss": 9.0}, "final.train/loss is 9.0, but the last row"),
    # consistent with a step time, but not the final's 4 ms
    ({"tokens_per_sec": 1e12}, "final.tokens_per_sec is 1000000000000.0, but 128 "
     "tokens per step (the run's config) / step_time_ms 4.0 ms = 32000"),
    ({"step_time_ms": 1e-6}, "final.tokens_per_sec is 32000.0, but 128"),
])
def test_a_final_value_the_rows_contradict_is_not_kept(tmp_path, capsys,
                                                       edit, says):
  run_dir = _run(tmp_path, final={**_FINAL, **edit})
  status, err = _status(run_dir, capsys)
  path = os.path.join(run_dir, record_lib.RESULT_FILE)
  assert status == "fresh" and err.startswith(f"warning: {path}: ")
  assert says in err, err


def test_a_row_whose_throughput_contradicts_its_step_time_is_not_kept(
    tmp_path, capsys):
  rows = [_ROWS[0], {**_ROWS[1], "tokens_per_sec": 1e12}]
  status, err = _status(_run(tmp_path, final=dict(_FINAL), rows=rows), capsys)
  assert status == "fresh"
  assert ("at step 3: tokens_per_sec is 1000000000000.0, but 128 tokens "
          "per step (the run's config) / step_time_ms 5.0 ms = 25600") in err, err


def test_a_divergence_the_rows_go_past_is_not_kept(tmp_path, capsys):
  # rows at steps 0 and 3: training cannot have stopped at step 2
  run_dir = _run(tmp_path, diverged="non-finite training loss at step 2")
  status, err = _status(run_dir, capsys)
  assert status == "fresh", err
  assert ("diverged says training stopped at step 2, but metrics.jsonl has "
          "rows up to step 3") in err, err
  # stopping after the last row, within the run's 3 steps, agrees with
  # rows that end at step 2 without evaluating there
  rows = [_ROWS[0], _row(2, **{"train/loss": 2.5})]
  run_dir = _run(tmp_path, diverged="non-finite training loss at step 3",
                 rows=rows)
  assert _status(run_dir, capsys) == ("finished", "")


@pytest.mark.parametrize("step, rows, says", [
    # the run has 3 steps: it cannot stop at step 99 (or 0)
    (99, None, "step 99, not a step of the run (1 to config.steps = 3)"),
    (4, None, "step 4, not a step of the run (1 to config.steps = 3)"),
    (0, None, "step 0, not a step of the run"),
    # the final evaluation at step 3 is finite: the run did not stop there
    (3, None, "step 3, but metrics.jsonl holds a finite eval/loss at step 3"),
    (2, [_ROWS[0], _row(2, **{"eval/loss": 3.0})],
     "step 2, but metrics.jsonl holds a finite eval/loss at step 2")])
def test_a_divergence_the_run_contradicts_is_not_kept(tmp_path, capsys, step,
                                                      rows, says):
  run_dir = _run(tmp_path, diverged=f"non-finite training loss at step {step}",
                 rows=rows)
  status, err = _status(run_dir, capsys)
  path = os.path.join(run_dir, record_lib.RESULT_FILE)
  assert status == "fresh" and err.startswith(f"warning: {path}: "), err
  assert f"diverged says training stopped at {says}" in err, err
  assert len(err.strip().splitlines()) == 1, err


def test_a_non_finite_final_value_matches_its_null_row(tmp_path, capsys):
  # metrics.jsonl writes NaN as null; compare_result.json keeps NaN (of a
  # key without a range: a NaN loss is refused by its range already)
  rows = [_ROWS[0], {**_ROWS[1], "faults/goodput": None}]
  final = {**_FINAL, "faults/goodput": float("nan")}
  assert _status(_run(tmp_path, final=final, rows=rows), capsys) == (
      "finished", "")
  final = {**_FINAL, "faults/goodput": 3.0}
  status, err = _status(_run(tmp_path, final=final, rows=rows), capsys)
  assert status == "fresh" and "final.faults/goodput is 3.0, but the " \
      "last row of metrics.jsonl that records it (step 3) has None" in err, err


def test_a_run_whose_log_was_set_aside_is_not_kept(tmp_path, capsys):
  """A resume that met a damaged metrics.jsonl set it aside and wrote a
  fresh one from the resumed step: the results would read a curve that
  starts there (a recommendation flipped). Such a run is trained again;
  its directory, numbered copies included, is one compare may clear."""
  run_dir = _run(tmp_path, final=dict(_FINAL))
  for name in (metrics.CORRUPT_FILE, metrics.CORRUPT_FILE + "-2"):
    (tmp_path / "run" / name).write_text("{}\n")
  status, err = _status(run_dir, capsys)
  assert status == "fresh", err
  assert err == (f"warning: {run_dir}: a damaged log was set aside as "
                 "metrics.jsonl.corrupt, so metrics.jsonl lacks the records "
                 "before its resume; the run is not kept: it is trained "
                 "again from step 0.\n"), err
  from decentral_jax.runner import workdir  # pylint: disable=import-outside-toplevel
  workdir.clear(run_dir, record_lib.RUN_ENTRIES)
  assert os.listdir(run_dir) == []


def test_a_run_to_resume_with_a_damaged_log_starts_again(tmp_path, capsys):
  """Its checkpoint would resume and set the log aside (above): compare
  trains it again from step 0 instead, saying why."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "config.json").write_text(json.dumps(_CONFIG))
  (run_dir / "checkpoints" / "2").mkdir(parents=True)
  (run_dir / metrics.METRICS_FILE).write_text(
      '{"step": 2}\n{"step": 1}\n')  # out of order
  status, err = _status(str(run_dir), capsys)
  assert status == "fresh", err
  assert err.startswith(f"warning: {run_dir}: metrics.jsonl is damaged ("
                        "line 2: \"step\" must increase"), err
  assert err.endswith("the run is not resumed: it is trained again from "
                      "step 0.\n"), err


@pytest.mark.parametrize("model, kept", [("mymodel:make", True),
                                         ("gpt", False)])
def test_a_model_of_your_own_may_log_any_finite_loss_and_accuracy(
    tmp_path, capsys, model, kept):
  """The runner logs a model of your own's loss and "accuracy" aux value as
  they are (docs/extending.md); a kept run of it is not damaged by a
  negative loss or an accuracy of 2, a gpt run is."""
  rows = [_row(0, **{"eval/loss": -1.0, "eval/accuracy": 2.0}),
          {**_ROWS[1], "eval/loss": -3.0, "eval/accuracy": 2.0}]
  final = {**_FINAL, "eval/loss": -3.0, "eval/accuracy": 2.0}
  config = {**_CONFIG, "model": {**_CONFIG["model"], "name": model}}
  run_dir = _run(tmp_path, final=final, rows=rows, config=config)
  with open(os.path.join(run_dir, "config.json"), "w",
            encoding="utf-8") as f:
    json.dump(config, f)  # the runner's copy, as a run writes it
  status, err = _status(run_dir, capsys, config)
  assert (status == "finished") == kept, err
  if not kept:
    assert "eval/loss" in err, err
