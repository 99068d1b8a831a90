"""metrics.jsonl: reading it back and cutting it at a restored step.

The loop writes and rewrites the file in tests/runner/test_train_loop.py (fast tier)
and tests/runner/test_faults.py (a torn last line, integration tier).
"""

from __future__ import annotations

import pytest

from decentral_jax.runner import metrics


def test_corrupt_metrics_line_in_the_middle_is_an_error(tmp_path):
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0}\n{"step": 5, "lr"\n{"step": 10}\n')
  before = path.read_text()
  with pytest.raises(ValueError) as info:
    metrics.truncate_after(str(tmp_path), 5)
  assert str(info.value).startswith(f"{path}, line 2: not a JSON record")
  assert "fix or delete that line" in str(info.value)
  assert path.read_text() == before  # nothing rewritten
  path.write_text('{"step": 0}\n{"step": 5}')  # complete, newline missing
  assert metrics.truncate_after(str(tmp_path), 5) == 0
  assert path.read_text() == '{"step": 0}\n{"step": 5}\n'


@pytest.mark.parametrize("torn,resumed_after,says", [
    # The checkpoint is at the torn record's step: nothing logs it again.
    ('{"step": 15, "lr": 0.00', 15, "the record of step 15 is lost"),
    ('{"step": 15, "lr": 0.00', 20, "the record of step 15 is lost"),
    # Resumed before it: the run redoes step 15 and logs it.
    ('{"step": 15, "lr": 0.00', 10, "the resumed run logs step 15 again"),
    # Cut inside the step's digits or before: not known.
    ('{"step": 1', 10, "its step cannot be read; if it was after step 10"),
    ('{"st', 10, "its step cannot be read"),
])
def test_torn_last_line_says_whether_its_record_is_lost(
    tmp_path, caplog, torn, resumed_after, says):
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0}\n{"step": 5}\n{"step": 10}\n' + torn)
  caplog.set_level("WARNING")
  metrics.truncate_after(str(tmp_path), resumed_after)
  (line,) = [r.getMessage() for r in caplog.records]
  assert line.startswith(f"{path}: line 4 is incomplete"), line
  assert says in line, line
  assert path.read_text() == '{"step": 0}\n{"step": 5}\n{"step": 10}\n'
