"""The benchmark scripts' flags: a bad one is one ``error:`` line and exit
code 2 (``flag_types.Parser``, no usage block), before any compile or run:
counts below 1 that would run nothing and print NaN, indices and names
outside the script's tables, paths that cannot be read or written."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from helpers import ROOT, benchmark_module


def _script(name: str):
  """``benchmarks/NAME.py`` imported as a module (once)."""
  key = f"{name}_flags_under_test"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        key, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    here = os.path.join(ROOT, "benchmarks")  # a script imports _common
    added = here not in sys.path
    if added:
      sys.path.insert(0, here)
    try:
      spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[key]
      raise
    finally:
      if added:
        sys.path.remove(here)
  return sys.modules[key]


def _one_error(capsys, call) -> str:
  with pytest.raises(SystemExit) as e:
    call()
  assert e.value.code == 2
  err = [line for line in capsys.readouterr().err.splitlines()
         if line.startswith(("error", "usage", " "))]
  assert len(err) == 1, err
  return err[0]


@pytest.mark.parametrize("argv, says", [
    (["--seeds", "0"], "argument --seeds: must be an integer in [1, 1000], "
     "got '0'"),
    (["--seeds", "-1"], "argument --seeds: must be an integer in [1, 1000]"),
    (["--periods", "0"], "argument --periods: must be an integer in "
     "[1, 100000], got '0'"),
    (["--out", "/proc/x.jsonl"], "--out '/proc/x.jsonl' cannot be written"),
])
def test_learners_delayed_nesterov_counts_are_bounded(capsys, argv, says):
  script = _script("learners_delayed_nesterov")
  assert _one_error(capsys, lambda: script.parse_args(argv)).startswith(
      f"error: {says}")
  args = script.parse_args(["--seeds", "1", "--periods", "2"])
  assert (args.seeds, args.periods) == (1, 2)


@pytest.mark.parametrize("argv, says", [
    (["--only", "bogus"], "argument --only: entry 1 of 'bogus' must be an "
     "integer in [0, 7]"),
    (["--only", "999"], "argument --only: entry 1 of '999' must be an "
     "integer in [0, 7]"),
    (["--only", "1,1"], "argument --only: '1,1': entry 2 repeats entry 1"),
    (["--target", "bogus"], "argument --target: unknown target 'bogus'; one "
     "of a100_sxm_80, h100_sxm, h200 or a .txtpb file, or cpu"),
])
def test_bench_memory_flags_name_the_table(capsys, argv, says):
  script = _script("bench_memory")
  assert len(script.COMBOS) == 8  # indices 0 to 7
  assert _one_error(capsys, lambda: script.parse_args(argv)).startswith(
      f"error: {says}")
  args = script.parse_args(["--only", "0,7", "--target", "cpu"])
  assert (args.only, args.target) == ([0, 7], "cpu")
  assert script.parse_args([]).only is None  # every combination


@pytest.mark.parametrize("argv, says", [
    (["--out", "OUT"], "--cases is needed to compile (e.g. --cases "
     "124m:node:plain), or --table"),
    (["--out", "OUT", "--cases", "bogus"], "argument --cases: case 'bogus' "
     "must be SIZE:LAYOUT:METHOD[:CLUSTER]"),
    (["--out", "OUT", "--cases", "2b:node:plain"], "argument --cases: case "
     "'2b:node:plain': unknown size '2b'; one of 124m, 350m, 1.3b"),
    (["--out", "OUT", "--cases", "124m:node:plain:A41"], "argument --cases: "
     "case '124m:node:plain:A41': unknown cluster 'A41'"),
    (["--table", "--out", "DIR/none.jsonl"], "--out 'DIR/none.jsonl' does "
     "not exist"),
    (["--out", "OUT", "--cases", "124m:node:plain", "--bins", "DIR/afile"],
     "--bins 'DIR/afile' is a file, not a directory"),
    (["--out", "OUT", "--cases", "124m:node:plain", "--overlap_limit", "-5"],
     "argument --overlap_limit: must be an integer in [0, 64], got '-5'"),
    (["--out", "OUT", "--cases", "124m:node:plain", "--programs", "1:never"],
     "argument --programs: entry '1:never' must be ROUND:MODE"),
    (["--out", "OUT", "--cases", "124m:node:plain", "--programs",
      "\u00b2:none"],
     "argument --programs: entry '\u00b2:none' must be ROUND:MODE"),
])
def test_bench_overlap_at_scale_refuses_before_compiling(
    capsys, tmp_path, monkeypatch, argv, says):
  script = _script("bench_overlap_at_scale")
  def compiles(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(script, "run_case", compiles)
  (tmp_path / "afile").write_text("x")
  argv = [a.replace("DIR", str(tmp_path)).replace(
      "OUT", str(tmp_path / "o.jsonl")) for a in argv]
  got = _one_error(capsys, lambda: script.main(argv))
  assert got.startswith("error: " + says.replace("DIR", str(tmp_path))), got
  assert not (tmp_path / "o.jsonl").exists()


def test_bench_overlap_at_scale_keeps_a_users_token_bins(
    capsys, tmp_path, monkeypatch):
  script = _script("bench_overlap_at_scale")
  def compiles(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(script, "run_case", compiles)
  tokens = bytes(range(256)) * 16  # 4096 bytes of the user's tokens
  (tmp_path / "val.bin").write_bytes(tokens)
  got = _one_error(capsys, lambda: script.main([
      "--cases", "124m:node:plain", "--bins", str(tmp_path), "--out",
      str(tmp_path / "o.jsonl")]))
  # the dummy val.bin: 20000 zero tokens of 2 bytes
  assert got.startswith(
      f"error: --bins '{tmp_path}' already holds val.bin (4096 "
      "bytes, not the 40000 bytes of zeros this command writes), which it "
      "would replace; give --bins an empty or new directory."), got
  assert (tmp_path / "val.bin").read_bytes() == tokens
  assert sorted(os.listdir(tmp_path)) == ["val.bin"]


def test_bench_overlap_at_scale_sizes_are_the_configs():
  spec = importlib.util.spec_from_file_location(
      "gpt2_sizes_under_test", os.path.join(ROOT, "configs", "gpt2_sizes.py"))
  config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config)
  assert _script("bench_overlap_at_scale").SIZES == tuple(config.SIZES)


def test_gpu_check_refusal_is_one_line(capsys):
  got = _one_error(capsys, lambda: benchmark_module(
      "_gpu_check_flags").parse_args(["--steps", "0"]))
  assert got.startswith("error: --steps must be an int >= 1"), got


@pytest.mark.parametrize("flag", ["--json", "--workload"])
@pytest.mark.parametrize("inside", [False, True])
def test_gpu_check_output_naming_the_config_data_is_refused(
    capsys, tmp_path, flag, inside):
  # data.path a corpus file, or a directory whose files are the inputs.
  data = tmp_path / "data"
  data.mkdir()
  (data / "corpus.txt").write_text("the user's corpus\n" * 100)
  corpus = str(data / "corpus.txt")
  path = str(data) if inside else corpus
  got = _one_error(capsys, lambda: benchmark_module(
      "_gpu_check_flags").parse_args([
          "--deviceless", "h200", "--set", "data.source=text_file",
          "--set", f"data.path={path}", flag, corpus]))
  assert got.startswith(f"error: {flag} '{corpus}' is the file --set "
                        "data.path reads"), got
  assert (data / "corpus.txt").read_text() == "the user's corpus\n" * 100


def _goodput(*argv):
  """``benchmarks/learners_goodput.py ARGV`` (``--reprice`` runs nothing
  but the NumPy runtime model): (exit code, stdout, error lines)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  got = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "learners_goodput.py"),
       *argv], capture_output=True, text=True, timeout=120, check=False,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  return got.returncode, got.stdout, [
      x for x in got.stderr.splitlines() if x.startswith(("error", "Trace"))]


@pytest.mark.slow  # three processes
def test_learners_goodput_reprice_keeps_the_measured_settings(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  recorded = os.path.join(ROOT, "benchmarks", "results",
                          "learners_goodput.json")
  with open(recorded, encoding="utf-8") as f:
    text = f.read()
  saved = json.loads(text)
  out = tmp_path / "goodput.json"
  out.write_text(text)
  # Flags that would contradict the stored runs' settings, or that the
  # reprice does not read: refused by name, the file untouched.
  code, _, err = _goodput("--reprice", "--out", str(out), "--sync-every",
                          "2", "--periods", "64", "--kill-every", "1")
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("error: --kill-every, --periods, --sync-every "
                           "have no effect with --reprice"), err
  code, _, err = _goodput("--reprice", "--out", str(out), "--lr", "5")
  assert code == 2 and err[0].startswith("error: --lr has no effect"), err
  # The hidden worker flag runs a program: refused with --reprice too.
  code, _, err = _goodput("--reprice", "--out", str(out), "--spmd-worker")
  assert code == 2 and len(err) == 1 and err[0].startswith(
      "error: --spmd-worker has no effect with --reprice"), err
  assert out.read_text() == text
  # Repriced at the stored settings: the file's "args" as they were and
  # the prices of the recorded run (made at those settings).
  code, stdout, err = _goodput("--reprice", "--out", str(out))
  assert code == 0 and not err, err
  again = json.loads(out.read_text())
  assert again["args"] == saved["args"]
  assert again["measured"] == saved["measured"]
  assert "runtime model tokens/s: {'spmd': 37, 'sync': 411, " \
      "'decoupled': 4602}" in stdout
  # A run keeping modes from --out at other settings would mix them.
  code, _, err = _goodput("--modes", "sync", "--periods", "8", "--out",
                          str(out))
  assert code == 2 and len(err) == 1 and err[0].startswith(
      f"error: --periods 8: --out '{out}' keeps decoupled,spmd measured at "
      "--periods 16"), err
  # A file this script did not write is named before any work.
  out.write_text("{")
  code, _, err = _goodput("--reprice", "--out", str(out))
  assert code == 2 and len(err) == 1 and err[0].startswith(
      f"error: --out '{out}' cannot be read as results of this script"), err


def _goodput_file(**changes):
  """A results file of learners_goodput.py that agrees with itself (16
  periods, a kill every 4: at most 3 kills, one resume/downtime each),
  with ``changes`` ("args.periods": value) applied."""
  saved = {"args": {"periods": 16, "sync_every": 8, "kill_every": 4,
                    "slow_sleep": 0.03, "lr": 3e-3},
           "measured": {
               "spmd": {"period_s": 1.0, "resume_s": [3.0, 3.0], "kills": 2},
               "sync": {"log": {"merge_time": [1, 2, 3, 4]}, "kills": 0,
                        "downtime_s": []},
               "decoupled": {"kills": 3, "downtime_s": [1.0, None, 2.0]}}}
  for path, value in changes.items():
    *keys, last = path.split(".")
    obj = saved
    for key in keys:
      obj = obj[key]
    if value is KeyError:
      del obj[last]
    else:
      obj[last] = value
  return saved


@pytest.mark.parametrize("changes, says", [
    # wrong types and ranges in "args" (bounded as the flags are)
    ({"args.periods": True}, "args.periods must be an integer in "
     "[1, 10000], got True"),
    ({"args.periods": 16.5}, "args.periods must be an integer"),
    ({"args.periods": "x"}, "args.periods must be an integer"),
    ({"args.periods": -3}, "args.periods must be an integer"),
    ({"args.sync_every": 0}, "args.sync_every must be an integer in "
     "[1, 10000], got 0"),
    ({"args.lr": 0}, "args.lr must be > 0, got 0"),
    # measured values of the wrong shape, missing or disagreeing
    ({"measured.sync": "x"}, "\"measured.sync\" must be an object"),
    ({"measured.spmd.period_s": KeyError}, "\"measured.spmd\" misses "
     "['period_s']"),
    ({"measured.spmd.resume_s": []}, "measured.spmd.resume_s has 0 entries "
     "for measured.spmd.kills 2 (one per kill)"),
    ({"measured.decoupled.downtime_s": [1.0, None]},
     "measured.decoupled.downtime_s has 2 entries for "
     "measured.decoupled.kills 3"),
    # kills at periods 4, 8, 12 only (below 16): 3 at most
    ({"measured.decoupled.kills": 4,
      "measured.decoupled.downtime_s": [1.0] * 4},
     "measured.decoupled.kills is 4, more than the 3 kills"),
    ({"measured.decoupled.downtime_s": [1.0, "x", None]},
     "measured.decoupled.downtime_s[1] must be null or seconds"),
    ({"measured.sync.log.merge_time": [1, 3, 2]},
     "measured.sync.log.merge_time must not decrease"),
    # no period to price: fewer than 2 merges, or a period of 0 s
    ({"measured.sync.log.merge_time": []},
     "measured.sync.log.merge_time has 0 entries; a run merges at least "
     "twice"),
    ({"measured.sync.log.merge_time": [5.0]},
     "measured.sync.log.merge_time has 1 entries"),
    ({"measured.spmd.period_s": 0}, "measured.spmd.period_s must be > 0 "
     "seconds (a median period), got 0"),
    # healthy step = period / 8 - 0.03 s: 0.2 / 8 - 0.03 = -0.005 s
    ({"measured.spmd.period_s": 0.2}, "measured.spmd.period_s gives a "
     "healthy step of -0.005 s"),
    # all merges at one time: median gap 0 s, 0 / 8 - 0.03 = -0.03 s
    ({"measured.sync.log.merge_time": [5.0] * 4},
     "measured.sync.log.merge_time gives a healthy step of -0.03 s"),
    # a sleep of 60 s above either 1 s / 8 period: 0.125 - 60 = -59.875 s
    ({"args.slow_sleep": 60}, "measured.spmd.period_s gives a healthy "
     "step of -59.875 s"),
])
def test_learners_goodput_reprice_refuses_a_damaged_file(
    capsys, monkeypatch, tmp_path, changes, says):
  import json  # pylint: disable=import-outside-toplevel
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # _common
  out = tmp_path / "goodput.json"
  out.write_text(json.dumps(_goodput_file(**changes)))
  text = out.read_text()
  got = _one_error(capsys, lambda: _script("learners_goodput").main(
      ["--reprice", "--out", str(out)]))
  assert got.startswith(f"error: --out '{out}' is not results of this "
                        f"script: {says}"), got
  assert out.read_text() == text


def test_learners_goodput_reprices_a_file_that_agrees(
    capsys, monkeypatch, tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # _common
  out = tmp_path / "goodput.json"
  out.write_text(json.dumps(_goodput_file()))
  _script("learners_goodput").main(["--reprice", "--out", str(out)])
  assert "runtime model tokens/s:" in capsys.readouterr().out
  assert set(json.loads(out.read_text())["measured"]["model"]) == {
      "spmd", "sync", "decoupled"}


@pytest.mark.parametrize("removed, argv, says", [
    (("spmd", "sync", "decoupled"), [], "holds no measured result for "
     "spmd,sync,decoupled (modes asked: spmd,sync,decoupled); run them "
     "first."),
    (("spmd",), [], "holds no measured result for spmd (modes asked: "
     "spmd,sync,decoupled); give --modes sync,decoupled."),
    (("sync",), ["--modes", "decoupled"], "holds no measured result for "
     "sync (modes asked: decoupled; decoupled is priced with the sync "
     "run's step); run them first."),
])
def test_learners_goodput_reprice_refuses_a_mode_not_stored(
    capsys, monkeypatch, tmp_path, removed, argv, says):
  import json  # pylint: disable=import-outside-toplevel
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # _common
  saved = _goodput_file()
  for mode in removed:
    del saved["measured"][mode]
  out = tmp_path / "goodput.json"
  out.write_text(json.dumps(saved))
  text = out.read_text()
  got = _one_error(capsys, lambda: _script("learners_goodput").main(
      ["--reprice", "--out", str(out), *argv]))
  assert got.startswith(f"error: --reprice: --out '{out}' {says}"), got
  assert out.read_text() == text


def test_learners_goodput_reprices_the_modes_asked(
    capsys, monkeypatch, tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # _common
  saved = _goodput_file()
  del saved["measured"]["spmd"]
  saved["measured"]["model"] = {"spmd": {"tokens_per_s": 1.0}}
  out = tmp_path / "goodput.json"
  out.write_text(json.dumps(saved))
  _script("learners_goodput").main(
      ["--reprice", "--out", str(out), "--modes", "sync,decoupled"])
  printed = capsys.readouterr().out
  assert "'sync'" in printed and "'decoupled'" in printed, printed
  assert "'spmd'" not in printed, printed  # not repriced
  model = json.loads(out.read_text())["measured"]["model"]
  assert model["spmd"] == {"tokens_per_s": 1.0}  # the stored price kept
  assert set(model) == {"spmd", "sync", "decoupled"}


@pytest.mark.parametrize("ns, says", [
    # topology.MAX_WORKERS = 2**16, by hand
    ("131072", "argument --ns: must be an integer in [1, 65536], got "
     "'131072'"),
    # 12 is not a power of two (one_peer_exp), 3 is odd (ring), 4 is not
    # a multiple of alternating_exp_ring's 8 workers per node
    ("12", "--ns 12: every built-in topology is measured at each n, and "
     "topology 'one_peer_exp' needs n_workers to be a power of two"),
    ("3", "--ns 3: every built-in topology is measured at each n, and "
     "topology 'ring' needs an even number of workers"),
    ("4", "--ns 4: every built-in topology is measured at each n, and "
     "n_workers=4 is not divisible by local_size=8")])
def test_bench_topology_scale_ns_are_what_every_topology_builds(
    capsys, ns, says):
  script = _script("bench_topology_scale")
  got = _one_error(capsys, lambda: script.parse_args(["--ns", "8", ns]))
  assert got.startswith(f"error: {says}"), got
  assert script.parse_args(["--ns", "8", "1024"]).ns == [8, 1024]


@pytest.mark.parametrize("name, argv, says", [
    ("bench_communication", ["--json", ""], "--json is empty"),
    ("bench_memory", ["--json", " "], "--json is empty"),
    ("learners_goodput", ["--out", ""], "--out is empty"),
])
def test_an_empty_output_or_report_path_is_refused_not_ignored(
    capsys, name, argv, says):
  script = _script(name)
  assert _one_error(capsys, lambda: script.parse_args(argv)).startswith(
      f"error: {says}; give a file name.")
