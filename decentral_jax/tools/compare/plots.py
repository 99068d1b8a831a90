"""The main job's loss curves: validation loss per step and per CPU second."""

from __future__ import annotations

import os
import sys

from decentral_jax import records
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.tools.compare import runs as runs_lib


CPU_PLOT = "cpu_loss_vs_time_this_machine.png"


def plot(rows: list[tuple[runs_lib.Run, str]], outdir: str,
         cpu_timing: bool = False) -> list[str]:
  """Validation loss vs step (and, with ``cpu_timing``, vs this machine's
  training time, ``cpu_loss_vs_time_this_machine.png``); returns the PNG
  paths."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  paths = []
  kinds = [("step", "step", "loss_vs_step.png", None)]
  if cpu_timing:
    kinds.append(("train_time_s", "this machine's CPU training time (s; "
                  "compile and evaluation excluded)",
                  CPU_PLOT,
                  "this machine's load-dependent CPU timing: not a ranking"))
  for x_key, x_label, name, title in kinds:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run, path in rows:
      got = metrics_lib.read_curve(path, "eval/loss", x=x_key)
      if isinstance(got, records.Damaged):  # missing: diverged before logging
        # A corrupt file is named once; a run without a finite loss is not.
        if not got.missing and got.key != "eval/loss" and x_key == "step":
          print(got.warning("its curve is left out of the plots."),
                file=sys.stderr)
        continue
      xs, ys = got
      ax.plot(xs, ys, marker="o", markersize=3, label=run.label)
    ax.set_xlabel(x_label)
    ax.set_ylabel("validation loss of the averaged model (nats)")
    if title:
      ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:  # every run diverged before logging: no legend
      ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(outdir, name)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    paths.append(out)
  return paths
