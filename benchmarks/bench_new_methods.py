"""The four newer methods against All-Reduce, DAdam and DiLoCo.

In the main job's setting (gpt_tiny, 8 workers, 300 steps, each arm at its
peak lr chosen by the tuning protocol, ``benchmarks/bench_evidence.py
--part main``): the final validation loss over seeds from
``benchmarks/results/evidence.jsonl``, the bytes the busiest worker sends
per step read from each arm's compiled step (``Experiment.communication``)
and the runtime model's price on the main job's default clusters (each
with its own GPUs' compute, ``--workload=own``). Writes
``benchmarks/results/new_methods.json`` and prints the table of
``benchmarks/studies/19_new_methods.md``.

    PYTHONPATH=. python benchmarks/bench_new_methods.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.set_cpu_devices(8)

import numpy as np  # noqa: E402

from decentral_jax.runner import config as config_lib  # noqa: E402
from decentral_jax.runner import experiment as experiment_lib  # noqa: E402
from decentral_jax.runner import tuning  # noqa: E402
from decentral_jax.tools.compare import pricing  # noqa: E402
from decentral_jax.tools.compare import runs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIDENCE = os.path.join(ROOT, "benchmarks", "results", "evidence.jsonl")
OUT = os.path.join(ROOT, "benchmarks", "results", "new_methods.json")
ARMS = ("all_reduce", "dadam", "diloco", "local_sgd", "desloc_adam",
        "noloco", "gradient_tracking", "muloco", "muloco_int4")
CLUSTERS = "A40,h100_node,cross_region_2dc"
SETTING = "gpt_tiny_n8_300"


def losses(name: str) -> tuple[float | None, list[float]]:
  """The arm's chosen lr and its final losses over seeds at that lr."""
  with open(EVIDENCE, encoding="utf-8") as f:
    recs = [json.loads(line) for line in f if line.strip()]
  mine = [r for r in recs if r["part"] == "main" and r["setting"] == SETTING
          and r["method"] == name]
  grid = {r["lr"]: r["eval_loss"] for r in mine if r["seed"] == 0}
  if not grid:
    return None, []
  lr = tuning.choose(grid).lr
  return lr, [r["eval_loss"] for r in mine if r["lr"] == lr]


def measure(name: str, base, clusters) -> dict:
  """One arm: loss over seeds, HLO bytes per step, price per cluster."""
  config = runs.run_config(base, runs.METHODS[name], 4, per_method_lr=True)
  lr, finals = losses(name)
  exp = experiment_lib.Experiment(config)
  comm = exp.communication(exp.init_state(), exp.get_batch(0))
  return {"arm": name, "label": runs.METHODS[name].label, "lr": lr,
          "finals": finals,
          "loss": tuning.format_mean_2sigma(finals) if finals else "-",
          "bytes_per_step": float(comm["bytes_per_step"]),
          "ratio": float(comm["ratio"]),
          "spec": pricing.method_spec(config),
          "ms": pricing.predicted_ms(config, clusters, pricing.OWN)}


def parse_args(argv=None):
  """No flags (the arms, clusters and output are fixed above); anything
  given is refused in one ``error:`` line before any training."""
  from decentral_jax.tools import flag_types  # one error: line
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  args = ap.parse_args(argv)
  try:
    flag_types.check_output_file(OUT, "the output file")
  except ValueError as e:
    ap.error(str(e))
  return args


def main(argv=None) -> None:
  parse_args(argv)
  _common.check_cpu_devices(8, "bench_new_methods.py", flag=False)
  base = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                ["--config.checkpoint_interval=0"])
  clusters = pricing.parse_clusters(CLUSTERS, pricing.OWN)
  rows = [measure(name, base, clusters) for name in ARMS]
  load = os.getloadavg()[0]
  names = [c.label for c in clusters]
  print("| arm | peak lr | final val loss, mean +- 2 sigma | bytes/step "
        "(x params) | " + " | ".join(f"{n} ms/step" for n in names) + " |")
  print("|" + "---|" * (4 + len(names)))
  for r in rows:
    ms = [r["ms"][n] for n in names]
    cells = [f"{v:.1f}" if isinstance(v, float) else "-" for v in ms]
    print(f"| {r['label']} | {r['lr']:g} | {r['loss']} | "
          f"{r['bytes_per_step']:,.0f} ({r['ratio']:.3f}) | "
          + " | ".join(cells) + " |")
  print(f"load average {os.getloadavg()[0]:.1f}; "
        f"{np.mean([len(r['finals']) for r in rows]):.1f} seeds per arm")
  _common.write_output(OUT, "the output file", lambda f: json.dump(
      {"clusters": CLUSTERS, "workload": pricing.OWN, "load_1min": load,
       "rows": rows}, f, indent=1), kept="the table was printed above")


if __name__ == "__main__":
  main()
