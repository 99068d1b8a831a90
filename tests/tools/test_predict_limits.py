"""``predict`` refuses, before it simulates, what it could not finish.

The simulated work is workers x simulated steps summed over the methods
and worker counts (a local-update method simulates at least two whole
sync periods past the warmup); each case is one ``error:`` line, exit 2.
"""

import contextlib
import io
import time

import pytest

from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import main as runtime_main


def _predict(*argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = runtime_main.main(["predict", *argv])
    except SystemExit as e:
      code = e.code
  return code, out.getvalue(), err.getvalue()


def test_workers_times_steps_is_bounded_before_any_work():
  t = time.perf_counter()
  code, out, err = _predict("--n-workers", "4096", "--compute-cv", "0.1",
                            "--steps", "100000")
  assert time.perf_counter() - t < 30  # refused, not simulated (minutes)
  # 4096 x 100000 x 3 default methods = 1.2288e9 (by hand)
  assert code == 2 and out == "", err
  assert err.strip().splitlines() == [
      "error: --n-workers 4096 x --steps 100000 x 3 methods (--methods) "
      "simulate 1.23e+09 worker-steps, more than 2e+07 (about a minute and "
      "4 GB); lower --steps, --n-workers or the number of methods."]


@pytest.mark.parametrize("limit, code", [(640, 0), (639, 2)])
def test_the_bound_counts_every_method_s_simulated_steps(monkeypatch, limit,
                                                         code):
  # all_reduce: 16 x 10; diloco:H=10 with warmup 10 // 5 = 2 starts at
  # step 10 and needs two periods, 30 steps: 16 x 30. In all 640.
  monkeypatch.setattr(inputs, "MAX_WORKER_STEPS", limit)
  got, _, err = _predict("--n-workers", "16", "--steps", "10", "--methods",
                         "all_reduce,diloco:H=10")
  assert got == code, err
  if code:
    assert "simulate 640 worker-steps, more than 639" in err, err
