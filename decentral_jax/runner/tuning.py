"""The fair tuning protocol of every comparison in this project.

Each method is tuned the same way, in the setting where it is reported
(model, data, workers, batch, step budget):

1. **Grid.** Train seed 0 at every peak learning rate of one shared grid
   (:data:`LR_GRID`, factors of 2; the final lr is peak / 10). A run that
   diverges scores ``+inf``.
2. **Edges.** If the best lr is at an end of the grid, the grid is
   extended by one factor of 2 past that end (at most
   ``max_extensions`` times), so the chosen value is interior or the
   report says it is not.
3. **Seeds.** At the chosen lr, seeds 0, 1, 2 (:data:`SEEDS`); the result
   is the mean and two sample standard deviations (ddof 1) over seeds,
   ``mean +- 2 sigma``. Two methods whose intervals overlap are not
   distinguished by this evidence.

The functions here are the bookkeeping only (no JAX): which lrs to run
next, which one was chosen, and the seed summary. ``benchmarks/
bench_evidence.py`` runs the protocol; the main job uses its chosen
values (``decentral_jax/tools/compare/runs.py``, ``TUNED_PEAK_LR``).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

__all__ = ["LR_GRID", "SEEDS", "Choice", "choose", "next_lrs", "summarize",
           "format_mean_2sigma"]

# Peak learning rates searched for every method (factors of 2).
LR_GRID = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
SEEDS = (0, 1, 2)


class Choice(NamedTuple):
  """The protocol's pick: the lr, its seed-0 loss, and where it lies.

  ``edge`` is ``"low"`` / ``"high"`` when the best lr is the smallest /
  largest one tried (the optimum may lie beyond it), else ``""``.
  """
  lr: float
  loss: float
  edge: str


def _score(loss) -> float:
  """A loss as a float; NaN, None and non-finite values are ``+inf``."""
  if loss is None:
    return math.inf
  loss = float(loss)
  return loss if math.isfinite(loss) else math.inf


def choose(losses: Mapping[float, float | None]) -> Choice:
  """The lr with the lowest seed-0 loss (ties: the smaller lr).

  Args:
    losses: ``{peak lr: final loss}``; ``None`` / NaN / inf = diverged.

  A single lr tried has no edge (``""``).

  Raises:
    ValueError: no lrs, an lr not finite and > 0, or every run diverged.
  """
  if not losses:
    raise ValueError("no learning rates were tried.")
  lrs = sorted(float(lr) for lr in losses)
  if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
    raise ValueError(f"learning rates must be finite and > 0, got {lrs}.")
  scored = {float(lr): _score(v) for lr, v in losses.items()}
  best = min(lrs, key=lambda lr: (scored[lr], lr))
  if math.isinf(scored[best]):
    raise ValueError(f"every learning rate diverged: {lrs}.")
  edge = ("" if len(lrs) == 1 else "low" if best == lrs[0]
          else "high" if best == lrs[-1] else "")
  return Choice(best, scored[best], edge)


def next_lrs(losses: Mapping[float, float | None],
             grid: Sequence[float] = LR_GRID,
             max_extensions: int = 2) -> list[float]:
  """The lrs still to train at seed 0 under the protocol.

  Every lr of ``grid`` first; then, while the best is at an end and fewer
  than ``max_extensions`` lrs beyond ``grid`` were tried on that side, that
  end times 2 (``"high"``) or divided by 2 (``"low"``). A diverged largest
  lr is an interior bound, not an edge to extend past.

  Returns:
    ``[]`` when the protocol needs no more seed-0 runs (also when every lr
    diverged).
  """
  tried = {float(lr) for lr in losses}
  missing = [float(lr) for lr in grid if float(lr) not in tried]
  if missing:
    return missing
  if all(math.isinf(_score(v)) for v in losses.values()):
    return []  # every lr diverged: nothing to extend (choose raises)
  choice = choose(losses)
  if not choice.edge:
    return []
  lo, hi = min(map(float, grid)), max(map(float, grid))
  if choice.edge == "high":
    beyond = [lr for lr in tried if lr > hi]
    nxt = max(tried) * 2
  else:
    beyond = [lr for lr in tried if lr < lo]
    nxt = min(tried) / 2
  if len(beyond) >= max_extensions:
    return []
  return [nxt]


def summarize(values: Sequence[float]) -> tuple[float, float, int]:
  """``(mean, 2 sigma, count)`` over seeds; sigma is the sample std (ddof 1).

  Non-finite values (diverged seeds) make the mean ``inf``; one value has
  ``2 sigma = nan`` (unknown spread).

  Raises:
    ValueError: no values.
  """
  vals = [_score(v) for v in values]
  if not vals:
    raise ValueError("no values to summarize.")
  n = len(vals)
  if any(math.isinf(v) for v in vals):
    return math.inf, math.nan, n
  mean = sum(vals) / n
  if n == 1:
    return mean, math.nan, 1
  var = sum((v - mean) ** 2 for v in vals) / (n - 1)
  return mean, 2 * math.sqrt(var), n


def format_mean_2sigma(values: Sequence[float], digits: int = 4) -> str:
  """``"1.6563 +- 0.0120 (3 seeds)"``; ``"diverged"``; one seed says so."""
  mean, two_sigma, n = summarize(values)
  if math.isinf(mean):
    return f"diverged ({n} seed{'s' * (n > 1)})"
  if n == 1:
    return f"{mean:.{digits}f} (1 seed)"
  return f"{mean:.{digits}f} +- {two_sigma:.{digits}f} ({n} seeds)"
