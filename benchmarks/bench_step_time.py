"""Step time of the gpt_tiny train step: decentralized vs All-Reduce, on CPU.

``configs/gpt_tiny.py`` (byte-level GPT, 2 layers, width 128, 4 heads,
context 64; global batch 64 sequences = 4,096 tokens per step, 8 per worker)
on 8 simulated CPU devices, one process. Methods: All-Reduce AdamW; DAdam and
AccumAdamW (accum_steps 4) on one_peer_exp, ring, alternating_exp_ring (2
workers per node, node-aware mesh) and complete. The step is
``decentral_jax.runner.experiment.Experiment.train_step`` (forward, backward, clip,
optimizer with gossip or all-reduce, finiteness check), with logging-step
diagnostics off (``log_interval`` beyond the run).

Protocol: every method is built and compiled first (compile excluded), then
``--warmup`` steps each; then ``--repeats`` rounds, each timing ``--steps``
consecutive steps of every method in a rotated order (interleaved, so load
drift hits all methods alike), at most two steps in flight. Reported: the
median over rounds of ms/step, tokens/s, and the ratio to All-Reduce AdamW's
median (target <= 1.05 on CPU, where communication is memory copies), and
the ratio of the fastest rounds (interference from other jobs on a shared
machine only adds time, so the minimum is the least disturbed estimate).
``--report FILE`` prints the table of a saved run again (and refuses the
run's flags, which it does not read). The recorded runs
are ``benchmarks/results/step_time.{json,log}`` and
``step_time_run2.{json,log}`` (the logs hold each round's load average).

  python benchmarks/bench_step_time.py [--repeats 7 --steps 10]
"""

from __future__ import annotations

import json
import os
import statistics
import time

import _common  # benchmarks/_common.py, next to this script

_common.set_cpu_devices(8)

import jax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")

METHODS = [  # label, algorithm, optimizer, accum, topology, workers per node
    ("All-Reduce AdamW", "all_reduce", "adamw", 1, "-", 1),
    ("DAdam", "decentralized", "adamw", 1, "one_peer_exp", 1),
    ("DAdam", "decentralized", "adamw", 1, "ring", 1),
    ("DAdam", "decentralized", "adamw", 1, "alternating_exp_ring", 2),
    ("DAdam", "decentralized", "adamw", 1, "complete", 1),
    ("AccumAdamW", "decentralized", "accum_adamw", 4, "one_peer_exp", 1),
    ("AccumAdamW", "decentralized", "accum_adamw", 4, "ring", 1),
    ("AccumAdamW", "decentralized", "accum_adamw", 4,
     "alternating_exp_ring", 2),
    ("AccumAdamW", "decentralized", "accum_adamw", 4, "complete", 1),
]


PROTOTYPE = [  # rows re-run with the bucketed-gossip prototype
    ("DAdam", "decentralized", "adamw", 1, "one_peer_exp", 1),
    ("AccumAdamW", "decentralized", "accum_adamw", 4, "one_peer_exp", 1),
]


TABLE_COLS = ["method", "topology", "ms/step (median)",
              "min..max over rounds", "tokens/s (median)",
              "ratio to All-Reduce (medians)", "ratio to All-Reduce (minima)"]


#: The fields of a row of ``--json`` a report reads (``_common.read_document``;
#: ``tokens_per_step`` is absent in files of older versions).
ROW_FIELDS = {"method": "str", "topology": "str", "times_s": "series"}


def _table(records):
  """Table rows from ``{"method", "topology", "tokens_per_step", "times_s"}``.

  The first record is the All-Reduce baseline. The ratio of minima compares
  each method's fastest round with the baseline's fastest round (other jobs
  on a shared machine only ever add time).
  """
  base = records[0]["times_s"]
  rows = []
  for r in records:
    t = r["times_s"]
    med = statistics.median(t)
    rows.append({
        "method": r["method"], "topology": r["topology"],
        "ms/step (median)": f"{1e3 * med:.1f}",
        "min..max over rounds": f"{1e3 * min(t):.0f}..{1e3 * max(t):.0f}",
        "tokens/s (median)": f"{r['tokens_per_step'] / med:,.0f}",
        "ratio to All-Reduce (medians)":
            f"{med / statistics.median(base):.3f}",
        "ratio to All-Reduce (minima)": f"{min(t) / min(base):.3f}",
    })
  return rows


def make(method, args):
  """The ``Experiment`` of one row of ``METHODS`` on ``configs/gpt_tiny.py``."""
  from decentral_jax.runner import config  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import experiment
  _, algorithm, opt, accum, topo, local = method
  c = config.load_config(GPT_TINY, [
      f"algorithm={algorithm}",
      f"topology={topo if topo != '-' else 'one_peer_exp'}",
      f"workers_per_node={local}", f"optimizer.name={opt}",
      f"optimizer.accum_steps={accum}", f"global_batch={args.global_batch}",
      f"steps={10**6}", f"log_interval={10**7}"])
  return experiment.Experiment(c)


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line):
  ``--report`` is read, ``--json`` written (unless ``--report``)."""
  from decentral_jax.tools import flag_types  # one error: line
  count = flag_types.integer  # a bounded integer flag
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=count(1, 10000), default=7)
  ap.add_argument("--steps", type=count(1, 10**6), default=10)
  ap.add_argument("--warmup", type=count(0, 10**6), default=3)
  ap.add_argument("--global_batch", type=count(1, 10**7), default=64)
  ap.add_argument("--no_prototype", action="store_true",
                  help="skip the rows with the bucketed-gossip prototype "
                       "(benchmarks/bench_vs_decentdp.py:_bucketed_mix)")
  ap.add_argument("--json", default=os.path.join(
      _ROOT, "benchmarks", "results", "step_time.json"))
  ap.add_argument("--report", default=None,
                  help="only print the table of a JSON file written before")
  args = ap.parse_args(argv)
  if args.report:
    _common.check_report_flags(ap, argv, mode="with --report",
                               reads=("--report",))
  _common.check_flags(ap, args, inputs=("--report",),
                      outputs=() if args.report else ("--json",))
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.report:
    saved = _common.read_document(
        args.report, "--report", {"machine": "object", "args": {
            "global_batch": "int"}, "rows": "list"}, ROW_FIELDS)
    print("machine:", json.dumps(saved["machine"]))
    for r in saved["rows"]:  # context 64 tokens (configs/gpt_tiny.py)
      r.setdefault("tokens_per_step", saved["args"]["global_batch"] * 64)
    print(_common.format_table(_table(saved["rows"]), TABLE_COLS))
    return
  _common.check_cpu_devices(8, "bench_step_time.py", flag=False)
  info = _common.machine_info()
  print("machine:", json.dumps(info), flush=True)
  import bench_vs_decentdp  # pylint: disable=import-outside-toplevel
  from decentral_jax.comm import gossip  # pylint: disable=import-outside-toplevel
  original_mix = gossip.mix
  todo = [(m, False) for m in METHODS]
  if not args.no_prototype:
    todo += [(m, True) for m in PROTOTYPE]
  runs = []
  for m, proto in todo:
    # Steps are traced on their first call below, so the patch only reaches
    # the prototype rows.
    gossip.mix = (bench_vs_decentdp._bucketed_mix(original_mix) if proto  # pylint: disable=protected-access
                  else original_mix)
    exp = make(m, args)
    state = exp.init_state()
    batches = [exp.get_batch(s) for s in range(4)]
    t0 = time.perf_counter()
    for i in range(args.warmup):
      state, metrics = exp.train_step(state, batches[i % 4])
      jax.block_until_ready(metrics)
    print(f"built {m[0]} {m[4]}: first {args.warmup} steps (compile "
          f"included) {time.perf_counter() - t0:.1f} s", flush=True)
    runs.append({"method": m, "exp": exp, "state": state, "batches": batches,
                 "times": [], "prototype": proto})
  gossip.mix = original_mix
  for rep in range(args.repeats):
    k = rep % len(runs)
    for r in runs[k:] + runs[:k]:
      exp, state = r["exp"], r["state"]
      prev = None
      t0 = time.perf_counter()
      for s in range(args.steps):
        state, metrics = exp.train_step(state, r["batches"][s % 4])
        if prev is not None:
          jax.block_until_ready(prev)
        prev = metrics
      jax.block_until_ready(prev)
      r["times"].append((time.perf_counter() - t0) / args.steps)
      r["state"] = state
    print(f"round {rep}: " + ", ".join(
        f"{r['method'][0]}/{r['method'][4]} {1e3 * r['times'][-1]:.0f}"
        for r in runs) + f" ms (load {os.getloadavg()[0]:.1f})", flush=True)
  records = []
  for r in runs:
    label, _, _, _, topo, local = r["method"]
    records.append({
        "method": label + (" + bucketed gossip (prototype)"
                           if r["prototype"] else ""),
        "topology": topo + (f" (L={local})" if local > 1 else ""),
        "tokens_per_step": r["exp"].tokens_per_step,
        "times_s": r["times"]})
  print()
  print(_common.format_table(_table(records), TABLE_COLS))
  _common.make_parent_dir(args.json)
  _common.write_output(args.json, "--json", lambda f: json.dump(
      {"machine": info, "args": vars(args), "rows": records}, f, indent=1),
                       kept="the table was printed above")


if __name__ == "__main__":
  main()
