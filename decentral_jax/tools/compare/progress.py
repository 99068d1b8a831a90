"""One progress bar over every training step of the main job."""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import tqdm
from tqdm import contrib as tqdm_contrib

from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.tools.compare import runs as runs_lib


class JobProgress:
  """One ``tqdm`` bar over every training step of the job, with an ETA.

  While :meth:`attach` is active, the per-run bar of
  ``train.train_and_evaluate`` (``metrics_lib.progress_bar``) forwards its
  steps to this bar, and ``print`` goes through ``tqdm.write`` so log
  lines do not break the bar. The rate, and so the ETA, counts only the
  time in training steps: the time before each run's first step
  (building, compiling, restoring) is left out of the bar's clock, and
  steps an earlier invocation did (kept or resumed runs) move the bar
  without counting as fast steps.
  """

  def __init__(self, arms: list[runs_lib.Arm]):
    self._n = len(arms)
    self._ends = np.cumsum([int(a.config.steps) for a in arms]).tolist()
    first = f" ({arms[0].run.name})" if arms else ""
    self.bar = tqdm.tqdm(total=sum(int(a.config.steps) for a in arms),
                         unit="step", dynamic_ncols=True, mininterval=1.0,
                         desc=f"run 1 of {self._n}{first}", leave=True)

  def start(self, k: int, arm: runs_lib.Arm) -> None:
    """Run ``k`` (1-based) is next."""
    self.bar.set_description(f"run {k} of {self._n} ({arm.run.name})")

  def skip(self, steps: int) -> None:
    """Steps done by an earlier invocation (or never run: a diverged
    run's rest): the bar moves, its rate does not."""
    steps = int(steps)
    if steps <= 0:
      return
    if self.bar.disable:
      self.bar.n += steps
      return
    self.bar.n += steps
    self.bar.last_print_n += steps
    self.bar.initial += steps  # the rate before any smoothing: (n - initial)
    self.bar.refresh()

  def finish(self, k: int) -> None:
    """Runs 1 to ``k`` are done (kept, trained or diverged)."""
    self.skip(max(self._ends[k - 1] - self.bar.n, 0))

  def _run_bar(self, total, initial=0, desc="", disable=None):
    del total, desc, disable
    self.skip(initial)
    return _Forward(self.bar)

  def attach(self):
    """Context: per-run bars forward here, stdout goes via tqdm.write."""
    stack = contextlib.ExitStack()
    saved = metrics_lib.progress_bar
    metrics_lib.progress_bar = self._run_bar
    stack.callback(setattr, metrics_lib, "progress_bar", saved)
    stack.enter_context(contextlib.redirect_stdout(
        tqdm_contrib.DummyTqdmFile(sys.stdout)))
    return stack

  def close(self) -> None:
    self.bar.close()


class _Forward:
  """A run's bar: steps and nothing else go to the job's bar; the time
  before its first step (compile) is left out of the job bar's clock."""

  def __init__(self, bar):
    self._bar = bar
    self._started = False

  def update(self, n: int = 1) -> None:
    if not self._started:  # compile and the first step: not a step's time
      self._started = True
      self._bar.unpause()
    self._bar.update(n)

  def set_postfix(self, *args, **kwargs) -> None:
    del args, kwargs

  def close(self) -> None:
    pass
