"""Every flag of every benchmark script is checked before any work.

Each script of ``benchmarks/`` has ``parse_args(argv)``: the flags parsed
and checked, nothing run. The sweep reads each script's parser, gives each
numeric flag 0 (where a count must be positive), -1 and NaN, each output
file or directory a path under ``/proc`` (nothing can be created there)
and each input file one that does not exist, and expects exit code 2 with
one ``error:`` line naming the flag. A flag that is neither numeric, a
path of the table below, a switch, a choice nor a free-text flag of the
table fails the sweep: a new flag needs its rule. The parsers run in one
child process (the scripts import JAX with their own XLA flags; no
compile, no Ray).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

BENCH = os.path.join(ROOT, "benchmarks")
# Scripts with their own command (bench_gpu_overlap.py is `overlap`'s).
DELEGATED = {"bench_gpu_overlap"}
# Arguments that every line of a script needs (the rest is defaults).
BASE = {"bench_overlap_at_scale": ["--cases", "124m:node:plain",
                                   "--out", "/tmp/_unused_overlap.jsonl"]}
# Path flags, by hand: "out" a file written, "dir" a directory written,
# "in" a file read; with the flags that make it one (e.g. --report).
PATHS = {
    "bench_communication": {"--json": ("out", [])},
    "bench_convergence": {"--out": ("out", []),
                          "--cache_dir": ("dir", []),
                          "--out ": ("in", ["--report"])},
    "bench_evidence": {"--out": ("out", ["--part", "main"])},
    "bench_memory": {"--json": ("out", [])},
    "bench_overlap_at_scale": {"--out": ("out", []), "--bins": ("dir", []),
                               "--hlo": ("dir", []),
                               "--fixtures": ("dir", [])},
    "bench_step_time": {"--json": ("out", []), "--report": ("in", [])},
    "bench_vs_decentdp": {"--out": ("out", [])},
    "gpu_check": {"--json": ("out", ["--deviceless", "h200"]),
                  "--workload": ("out", ["--deviceless", "h200"])},
    "learners_delayed_nesterov": {"--out": ("out", [])},
    "learners_goodput": {"--out": ("out", []),
                         "--ckpt": ("out", ["--spmd-worker"]),
                         "--progress": ("out", ["--spmd-worker"])},
}
# Text flags and their refused value (checked by a rule of the script).
TEXT = {
    "bench_bucketed_gossip": {"--topology": "bogus", "--comm_dtype": "int8"},
    "bench_convergence": {"--topologies": "bogus",
                          "--topologies_16": "bogus"},
    "bench_evidence": {"--methods": "bogus"},
    "bench_vs_decentdp": {"--jax_sides": "bogus"},
    "learners_goodput": {"--modes": "spmd,bogus"},
}
# Text flags passed on as they are (checked where they are used).
FREE = {("decentdp_side_by_side", "--topology"),  # decent-dp's names
        ("bench_overlap_at_scale", "--cases"),
        ("bench_overlap_at_scale", "--programs"),
        ("gpu_check", "--deviceless"), ("gpu_check", "--topology"),
        ("gpu_check", "--config"), ("gpu_check", "--set"),
        ("gpu_check", "--programs"), ("gpu_check", "--cluster"),
        ("bench_memory", "--target"), ("bench_memory", "--only")}
# Numeric flags where 0 is a value (a count of warm-up steps, a seed, a
# port chosen by the system, an index, 0 = one collective per leaf, no
# sleep, "the default" or "what the links allow", every collective).
ZERO_OK = {("bench_memory", "--only"),
           ("bench_overlap_at_scale", "--overlap_limit"),
           ("gpu_check", "--min_fraction"), ("gpu_check", "--batch"),
           ("gpu_check", "--warmup"), ("gpu_check", "--peak_flops"),
           ("bench_bucketed_gossip", "--bucket_bytes"),
           ("bench_convergence", "--seeds"),
           ("bench_evidence", "--scale_seeds"),
           ("bench_step_time", "--warmup"),
           ("bench_vs_decentdp", "--warmup"),
           ("bench_vs_decentdp", "--process_id"),
           ("bench_vs_decentdp", "--port"),
           ("decentdp_side_by_side", "--warmup"),
           ("learners_goodput", "--slow-sleep")}
UNWRITABLE = {"out": "/proc/no_such_dir/x.json", "dir": "/proc/x_dir",
              "in": "/proc/no_such_file.json"}

_CHILD = r"""
import argparse, contextlib, importlib.util, io, json, os, sys, types
bench, names = sys.argv[1], sys.argv[2].split(",")
plan = json.loads(sys.argv[3])
sys.path.insert(0, bench)
import _common
_common.set_cpu_devices = lambda *a, **k: None  # several scripts, one JAX
try:
  import torch  # noqa: F401
except ImportError:  # decentdp_side_by_side's classes need only the names
  torch = types.ModuleType("torch")
  nn = types.ModuleType("torch.nn")
  nn.Module = object
  nn.functional = types.ModuleType("torch.nn.functional")
  torch.nn, torch.distributed = nn, types.ModuleType("torch.distributed")
  sys.modules.update({"torch": torch, "torch.nn": nn,
                      "torch.nn.functional": nn.functional,
                      "torch.distributed": torch.distributed})
def run(module, argv):
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      module.parse_args(argv)
      code = 0
    except SystemExit as e:
      code = e.code
  return code, err.getvalue()
out = {}
for name in names:
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(bench, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  caught = []
  real = argparse.ArgumentParser.parse_known_args
  def grab(self, *a, **k):
    caught.append(self)
    return real(self, *a, **k)
  argparse.ArgumentParser.parse_known_args = grab
  try:
    run(module, ["--help"])
  finally:
    argparse.ArgumentParser.parse_known_args = real
  flags = []
  for action in caught[0]._actions:
    if not action.option_strings or action.option_strings[0] == "-h":
      continue
    t = action.type
    kind = ("number" if t in (int, float) or hasattr(t, "bounds") else
            "switch" if action.nargs == 0 else
            "choice" if action.choices else "text")
    flags.append((action.option_strings[-1], kind))
  rows = [(argv, run(module, argv)) for argv in plan.get(name, [])]
  out[name] = {"flags": flags, "rows": rows}
print(json.dumps(out))
"""


def _scripts() -> list[str]:
  names = sorted(os.path.basename(p)[:-3]
                 for p in glob.glob(os.path.join(BENCH, "*.py")))
  return [n for n in names if not n.startswith("_") and n not in DELEGATED]


def _child(plan: dict) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  got = subprocess.run(
      [sys.executable, "-c", _CHILD, BENCH, ",".join(_scripts()),
       json.dumps(plan)], capture_output=True, text=True, timeout=300,
      env=env, check=False)
  assert got.returncode == 0, got.stderr[-3000:]
  return json.loads(got.stdout.strip().splitlines()[-1])


def _plan(flags: dict) -> tuple[dict, list]:
  """The command lines to try, and per line ``(script, flag)`` expected
  in its one error line."""
  plan, expect = {}, []
  for name, found in flags.items():
    lines = []
    for flag, kind in found:
      values = []
      if kind == "number":
        values = ["-1", "nan"] + (["0"] if (name, flag) not in ZERO_OK
                                  else [])
        values = [[f"{flag}={v}"] for v in values]
      elif kind == "text" and flag in TEXT.get(name, {}):
        values = [[flag, TEXT[name][flag]]]
      for what, (path_kind, extra) in PATHS.get(name, {}).items():
        if what.strip() == flag:
          values.append(extra + [flag, UNWRITABLE[path_kind]])
      for argv in values:
        base = list(BASE.get(name, []))
        if flag in base:
          k = base.index(flag)
          base = base[:k] + base[k + 2:]
        lines.append(base + argv)
        expect.append((name, flag, base + argv))
    plan[name] = lines
  return plan, expect


@pytest.mark.integration
def test_every_benchmark_flag_is_refused_before_any_work():
  listed = _child({})
  assert set(listed) == set(_scripts())
  unruled = []
  for name, info in listed.items():
    for flag, kind in info["flags"]:
      paths = {f.strip() for f in PATHS.get(name, {})}
      if kind == "text" and flag not in paths and flag not in TEXT.get(
          name, {}) and (name, flag) not in FREE:
        unruled.append((name, flag))
  assert not unruled, f"flags without a rule: {unruled}"
  plan, expect = _plan({n: i["flags"] for n, i in listed.items()})
  results = _child(plan)
  rows = [(n, argv, code, err) for n in results
          for argv, (code, err) in results[n]["rows"]]
  assert len(rows) == len(expect)
  bad = []
  for (name, flag, argv), (_, argv2, code, err) in zip(expect, rows):
    assert argv == argv2
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    if code != 2 or len(lines) != 1 or flag not in lines[0] or (
        "Traceback" in err):
      bad.append((name, argv, code, err[-300:]))
  assert not bad, "\n".join(map(str, bad))
  # the cases are among the lines tried
  tried = {(n, " ".join(a)) for n, a, _, _ in rows}
  assert ("bench_communication", "--json /proc/no_such_dir/x.json") in tried
  assert ("bench_bucketed_gossip", "--topology bogus") in tried
  assert ("learners_goodput", "--periods=0") in tried


# Report modes: each flag the report does not read, with the lines that
# make it a report (the tables of a file written before: nothing runs).
_STEP = ["--report", os.path.join(BENCH, "results", "step_time.json")]
REPORT_UNREAD = {
    "bench_step_time": [_STEP + ["--repeats", "3"], _STEP + ["--steps", "2"],
                        _STEP + ["--warmup", "9"],
                        _STEP + ["--global_batch", "8"],
                        _STEP + ["--no_prototype"],
                        _STEP + ["--json", "/tmp/_unused_step_time.json"]],
    "bench_evidence": [["--report", "--part", "main"],
                       ["--report", "--workers", "8"],
                       ["--report", "--scale_steps", "5"],
                       ["--overlap_h", "3"],  # no --part: the report too
                       ["--methods", "dadam"]],
    "bench_convergence": [["--report", "--cache_dir", "/tmp/_unused_cache"],
                          ["--report", "--eval_batches", "3"]],
}
# What each report mode reads: accepted.
REPORT_READ = {
    "bench_step_time": [_STEP],
    "bench_evidence": [["--report"], []],
    "bench_convergence": [["--report", "--steps", "200", "--plan", "8"]],
}


def _flag_of(argv: list[str]) -> str:
  return [a for a in argv if a.startswith("--") and a != "--report"][-1]


@pytest.mark.slow  # a second process that loads every report script
def test_report_modes_refuse_the_flags_they_do_not_read():
  names = sorted(REPORT_UNREAD)
  plan = {n: REPORT_UNREAD[n] + REPORT_READ[n] for n in names}
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  got = subprocess.run(
      [sys.executable, "-c", _CHILD, BENCH, ",".join(names),
       json.dumps(plan)], capture_output=True, text=True, timeout=300,
      env=env, check=False)
  assert got.returncode == 0, got.stderr[-3000:]
  results = json.loads(got.stdout.strip().splitlines()[-1])
  for name in names:
    rows = results[name]["rows"]
    refused, accepted = rows[:len(REPORT_UNREAD[name])], rows[
        len(REPORT_UNREAD[name]):]
    for argv, (code, err) in refused:
      lines = [x for x in err.splitlines() if x.startswith("error:")]
      assert code == 2 and len(lines) == 1, (name, argv, code, err[-300:])
      assert lines[0].startswith(f"error: {_flag_of(argv)} has no effect "), (
          name, lines)
    for argv, (code, err) in accepted:
      assert code == 0, (name, argv, err[-300:])
