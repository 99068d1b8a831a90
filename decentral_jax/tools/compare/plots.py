"""The main job's loss curves: validation loss per step and per CPU second."""

from __future__ import annotations

import io
import os
import sys

from decentral_jax import records
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import tmpfile
from decentral_jax.tools.compare import runs as runs_lib


CPU_PLOT = "cpu_loss_vs_time_this_machine.png"


def save_png(fig, path: str) -> None:
  """Writes ``fig`` as a PNG to ``path`` through ``path + ".tmp"``
  (:func:`decentral_jax.runner.tmpfile.replace`): what is left at the
  ``.tmp`` name (a symbolic link, a FIFO) is removed, never followed nor
  opened, and the file is created anew and renamed over ``path`` (a link at
  ``path`` is replaced, not followed).

  Raises:
    ValueError: a directory sits at ``path`` or ``path + ".tmp"`` (naming
      it and the fix).
    OSError: the file cannot be written (naming ``path``; no ``.tmp`` file
      is left).
  """
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=120)
  tmpfile.replace(path, buf.getvalue())


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
    save_png(fig, out)
    plt.close(fig)
    paths.append(out)
  return paths
