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
