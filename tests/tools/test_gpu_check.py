"""benchmarks/gpu_check.py's flags: checked before anything is compiled,
named as typed, in the units typed; bad input exits with code 2."""

import json
import os
import sys

import pytest

from helpers import ROOT, benchmark_module, load_gpu_check


def _script():
  return load_gpu_check("gpu_check_under_test")


def _flags():
  return benchmark_module("_gpu_check_flags")


@pytest.mark.parametrize("argv, message", [
    (["--compute_ms", "-1", "--cluster", "A40"],
     "--compute_ms must be the step's compute time in milliseconds, a finite "
     "number > 0, got -1."),
    (["--compute_ms", "inf", "--collective_us", "5"], "got inf."),
    (["--compute_ms", "100"],
     "--compute_ms rescales the transfer times of --cluster or "
     "--collective_us; give one of them too."),
    (["--cluster", "A40", "--collective_us", "5"],
     "--cluster and --collective_us both give the transfer times; give one "
     "of them."),
    (["--collective_us", "1e300"],
     "--collective_us must be a transfer time in microseconds in (0, 1e+09], "
     "got 1e+300."),
    (["--collective_us", "0"], "got 0."),
    (["--collective_us", "nan"], "got nan."),
    (["--cluster", "b40"], "--cluster 'b40' is not a runtime-model preset; "
     "use one of T4, A40, "),
    (["--roofline", "--gemm_efficiency", "0"],
     "--gemm_efficiency must be a share of the peak in (0, 1], got 0."),
    (["--roofline", "--memory_efficiency", "1.5"], "got 1.5."),
    (["--roofline", "--cluster", "A40", "--compute_ms", "100"],
     "--roofline puts every time on the GPU's clock; --compute_ms"),
])
def test_bad_profile_flags_exit_2_naming_the_flag(argv, message, capsys):
  flags = _flags()
  with pytest.raises(SystemExit) as e:
    flags.parse_args(["--deviceless", "h200", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert message in err, err
  # The library's argument names (compute_s, collective_us in seconds or
  # "give collective_us or cluster") are not what was typed.
  assert "compute_s " not in err and "give collective_us" not in err


def test_profile_flags_need_deviceless(capsys):
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(["--cluster", "A40", "--compute_ms", "100"])
  assert e.value.code == 2
  assert ("--cluster and --compute_ms apply to --deviceless compiles only"
          in capsys.readouterr().err)


def test_cluster_preset_spelled_in_any_case():
  # As experiments/compare.py --clusters: the preset's own spelling.
  flags = _flags()
  for typed, preset in (("a40", "A40"), ("A40", "A40"), ("H100_IB", "h100_ib"),
                        (" t4 ", "T4")):
    args = flags.parse_args(["--deviceless", "h200", "--cluster", typed,
                             "--compute_ms", "122.3"])
    assert (args.cluster, args.compute_ms) == (preset, 122.3)
  args = flags.parse_args(["--deviceless", "h200"])
  assert (args.cluster, args.collective_us, args.compute_ms) == (
      None, None, None)
  args = flags.parse_args(["--deviceless", "h200", "--collective_us",
                           "1e9"])
  assert args.collective_us == 1e9


def test_library_errors_exit_2(capsys):
  # An unknown target is refused at the flag; a config error from the
  # library (before any compile) is one line and exit code 2 as well.
  gpu_check = _script()
  with pytest.raises(SystemExit) as e:
    gpu_check.main(["--deviceless", "h999"])
  assert e.value.code == 2
  assert "--deviceless 'h999' is not a GPU target" in capsys.readouterr().err
  for bad, says, by in (
      # refused while parsing (check_config loads the config), or by the run
      (["--set", "nosuch=1"], "unknown config field 'nosuch'", "error: "),
      (["--set", "n_workers=0"], "n_workers", "gpu_check: error: ")):
    with pytest.raises(SystemExit) as e:
      gpu_check.main(["--deviceless", "h200", *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(by) and says in err, err
    # The config is checked before the default topology is sized by it.
    assert "1x1x0" not in err, err
  # The default topology (1x1xN, N the config's devices) is bounded too.
  with pytest.raises(SystemExit) as e:
    gpu_check.main(["--deviceless", "h200", "--set", "n_workers=8192",
                    "--set", "global_batch=8192"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "the config needs 8192 GPUs" in err and "4096" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--min_fraction", "1.5"], "--min_fraction must be a finite number >= "
     "0.0 and <= 1.0, got 1.5."),
    (["--min_fraction", "nan"], "--min_fraction must be a finite number"),
    (["--min_fraction", "-0.1"], "got -0.1."),
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--repeats", "0"], "--repeats must be an int >= 1"),
    (["--repeats", "100001"], "--repeats must be an int >= 1 and <= 10000"),
    (["--batch", "-1"], "--batch must be an int >= 1"),
    (["--warmup", "-1"], "--warmup must be an int >= 0"),
    (["--warm_steps", "0"], "--warm_steps must be an int >= 1"),
    (["--timed_steps", "0"], "--timed_steps must be an int >= 1"),
    (["--child_timeout", "0"], "--child_timeout must be an int >= 1"),
    (["--child_timeout", "10000000"], "--child_timeout must be an int"),
    (["--peak_flops", "-1"], "--peak_flops must be 0 (the GPU's own peak) "
     "or a finite FLOP/s in (0, 1e+18], got -1."),
    (["--peak_flops", "inf"], "got inf."),
    (["--peak_flops", "nan"], "got nan."),
    (["--programs", ","], "--programs ',': entry 1 is empty"),
    (["--programs", "0:none,,0:input"], "entry 2 is empty"),
    (["--programs", "x:input"], "round 'x', not an int"),
    # str.isdigit() takes "²", int() does not; int() reads "٣" as 3.
    (["--programs", "\u00b2:input"], "round '\u00b2', not an int"),
    (["--programs", "\u0663:input"], "round '\u0663', not an int"),
    (["--programs", "0:none,0:none"], "--programs '0:none,0:none': entry 2 "
     "repeats entry 1"),
    # The mode's default filled in: 1 and 1:none are one program.
    (["--programs", "0:input,1,1:none"], "entry 3 repeats entry 2"),
    (["--programs", ":input,None:input"], "entry 2 repeats entry 1"),
    (["--topology", "1x1"], "--topology '1x1' must be SLICESxHOSTSxGPUS, "
     "three positive ints"),
    (["--topology", "0x1x8"], "--topology '0x1x8' must be"),
    (["--topology", "1x1x-8"], "--topology '1x1x-8' must be"),
    (["--topology", "1xax8"], "--topology '1xax8' must be"),
    # Unicode digits: str.isdigit takes them, int() or XLA does not.
    (["--topology", "1x1x\u00b2"], "--topology '1x1x\u00b2' must be "
     "SLICESxHOSTSxGPUS, three positive ints"),
    (["--topology", "\u0661x1x8"], "--topology '\u0661x1x8' must be"),
    (["--topology", "1x1x8\n"], "must be SLICESxHOSTSxGPUS"),
    # XLA's mock topology builds every GPU: at most 4096 in all.
    (["--topology", "1x1x99999999"], "--topology '1x1x99999999' describes "
     "more than 4096 GPUs (SLICES*HOSTS*GPUS); give at most 4096"),
    (["--topology", "2x64x33"], "describes more than 4096 GPUs"),  # 4224
    (["--topology", "1x1x" + "9" * 5000], "describes more than 4096 GPUs"),
])
def test_bad_numbers_programs_and_topology_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(["--deviceless", "h200", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert "Traceback" not in err and "INTERNAL" not in err
  assert "(None, 'none')" not in err  # no internal tuples


def test_good_numbers_programs_and_topology_pass():
  flags = _flags()
  args = flags.parse_args([
      "--deviceless", "h200", "--min_fraction", "0", "--topology", "2x1x4",
      "--programs", "0:none,:input,None:none"])
  assert (args.min_fraction, args.topology) == (0.0, "2x1x4")
  # the timing part's numbers (refused with --deviceless: no part runs)
  timing = flags.parse_args(["--part", "timing", "--batch", "1",
                             "--warmup", "0", "--peak_flops", "0"])
  assert (timing.batch, timing.warmup, timing.peak_flops) == (1, 0, 0.0)
  for edge in ("1x1x4096", "2x2x1024", "0004x1x1024"):  # product 4096
    assert flags.parse_args(["--deviceless", "h200", "--topology",
                             edge]).topology == edge
  assert flags.parse_programs(args.programs) == [
      (0, "none"), (None, "input"), (None, "none")]
  assert flags.parse_args(["--min_fraction", "1", "--peak_flops",
                           "9.89e14"]).peak_flops == 9.89e14


def test_json_into_a_missing_folder_is_refused_before_compiling(
    tmp_path, capsys):
  missing = tmp_path / "no_such_dir" / "out.json"
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(["--deviceless", "h200", "--json", str(missing)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--json {str(missing)!r}" in err and "does not exist" in err, err
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(["--deviceless", "h200", "--json", str(tmp_path)])
  assert "is a directory" in capsys.readouterr().err
  ok = _flags().parse_args(["--deviceless", "h200", "--json",
                             str(tmp_path / "out.json")])
  assert ok.json == str(tmp_path / "out.json")


@pytest.mark.parametrize("argv, flag", [
    (["--smoke", "--part", "timing", "--json", ""], "--json"),
    (["--deviceless", "h200", "--json="], "--json"),
    (["--deviceless", "h200", "--workload", ""], "--workload")])
def test_an_empty_output_path_is_refused(argv, flag, capsys):
  """An empty path wrote nothing and exited 0."""
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(argv)
  assert e.value.code == 2
  assert f"error: {flag} is empty; give a file name" in \
      capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--deviceless", ""], "--deviceless is empty, which reads as "
     "--deviceless left out; give a GPU target (h200, h100_sxm, "
     "a100_sxm_80) or a .txtpb file or drop --deviceless."),
    (["--deviceless=", "--part", "timing"], "--deviceless is empty"),
    (["--deviceless", "h200", "--topology", ""], "--topology is empty, "
     "which reads as --topology left out; give SLICESxHOSTSxGPUS (e.g. "
     "1x2x4) or drop --topology.")])
def test_an_empty_flag_that_would_read_as_left_out_is_refused(
    argv, says, capsys):
  """``--deviceless ''`` ran on this machine's devices, ``--topology ''``
  compiled at the default topology."""
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(argv)
  assert e.value.code == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith(f"error: {says}"), err


def test_every_flag_whose_empty_value_is_absent_says_what_to_give():
  flags = _flags()
  ap = flags.build_parser()
  empty = {a.option_strings[-1] for a in ap._actions  # pylint: disable=protected-access
           if a.option_strings and a.default == ""}
  assert empty == set(flags.EMPTY_MEANS_ABSENT) == {"--deviceless",
                                                    "--topology"}


def test_help_describes_the_script_by_its_docstring():
  assert _flags().build_parser().description == (
      _script().__doc__.split("\n")[0])


def test_one_profile_flag_without_deviceless_says_applies(capsys):
  with pytest.raises(SystemExit) as e:
    _flags().parse_args(["--cluster", "A40"])
  assert e.value.code == 2
  assert ("error: --cluster applies to --deviceless compiles only"
          in capsys.readouterr().err)


@pytest.mark.slow
def test_cpu_smoke_run_says_it_did_not_run_on_a_gpu(tmp_path):
  """The documented command's CPU path (benchmarks/gpu_check.sh without a
  GPU): every part runs on 8 simulated devices, with and without gossip
  and pipelined, and the result says it was not run on a GPU."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  out = tmp_path / "smoke.json"
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  r = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "gpu_check.py"),
       "--smoke", "--programs", "none", "--warm_steps", "2",
       "--timed_steps", "2", "--repeats", "1", "--steps", "1",
       "--json", str(out)],
      env=env, capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "NOT RUN ON A GPU" in r.stdout
  got = json.loads(out.read_text())
  assert got["ran_on_gpu"] is False and "not a GPU" in got["note"]
  assert {"timing", "schedule", "gossip_timing"} <= set(got)
  g = got["gossip_timing"]
  assert g["n_devices"] == 8
  for key in ("gossip_ms_per_step", "no_gossip_ms_per_step",
              "pipelined_ms_per_step"):
    assert g[key] > 0, g


def test_json_on_a_full_device_is_one_line_after_the_printed_result(
    monkeypatch, capsys):
  """/dev/full passes the check (a device is left alone); the write after
  the run fails: one error line, the result printed before it."""
  script = _script()
  monkeypatch.setattr(script, "_run", lambda args: {"least": 0.25})
  with pytest.raises(SystemExit) as e:
    script.main(["--deviceless", "h200", "--json", "/dev/full",
                 "--json_only"])
  assert e.value.code == 2
  out, err = capsys.readouterr()
  assert out.strip().splitlines() == ['{"least": 0.25}']
  assert err.strip().splitlines() == [
      "error: --json '/dev/full' could not be written (No space left on "
      "device); the results were printed above; give another --json."]


@pytest.mark.parametrize("batch, expected", [(1, 1), (64, 64), (None, 4)])
def test_smoke_timing_uses_the_batch_flag(batch, expected):
  """--smoke --batch 1 and --batch 64 both timed 4 sequences per step."""
  gpu_check = _script()
  args = _flags().parse_args(["--part", "timing", "--smoke"] + (
      [] if batch is None else ["--batch", str(batch)]))
  cfg, _, sequences = gpu_check._gpt_cfg(args)
  assert (sequences, cfg.n_layer) == (expected, 2)


def test_one_gpu_whose_mock_topology_gives_one_device_says_so(monkeypatch):
  """On one GPU the schedule part compiles in a child on XLA's mock 8-GPU
  topology; a jax that ignores the mock (one H100, jax 0.11.2: still one
  device) made that child start another child until the timeout. The
  child now says the mock gave one device and starts nothing."""
  import jax  # pylint: disable=import-outside-toplevel
  schedule = benchmark_module("_gpu_check_schedule")

  class OneGpu:
    device_kind = "NVIDIA H100 80GB HBM3"

  def no_child(*unused):
    raise AssertionError("a child process was started")

  monkeypatch.setenv("JAX_MOCK_GPU_TOPOLOGY", "1x8x1")
  monkeypatch.setattr(jax, "devices", lambda: [OneGpu()])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(schedule, "_child", no_child)
  got = schedule.part_schedule(_flags().parse_args(["--part", "schedule"]))
  assert got["result"].startswith(
      "XLA's mock GPU topology 1x8x1 gave 1 device"), got


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--batch", "0"], "--batch"),  # 0 sequences: no default
    (["--config", "no_such_config.py"], "no_such_config.py"),
    (["--set", "nosuchfield=1"], "nosuchfield"),
    (["--deviceless", "h200", "--set", "nosuchfield=1"], "nosuchfield")])
def test_a_bad_batch_config_or_set_is_refused_before_any_part(
    capsys, argv, message):
  with pytest.raises(SystemExit) as e:  # the parts run after parse_args
    _flags().parse_args(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].split(": error: ")[-1].count(message), err
