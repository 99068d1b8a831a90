"""Every numeric flag of every command refuses a value it cannot use.

The sweep finds the numeric flags by looking at each command's parser (so a
flag added later is swept too) and feeds each one NaN, inf, a negative and
two huge values; each must exit with code 2 and one ``error:`` line that
names the flag, before any work starts. The parsers run in this process.
"""

import argparse
import contextlib
import io
import os
import sys

import pytest

from decentral_jax.tools import flag_types
from decentral_jax.tools import overlap
from decentral_jax.tools import train
from decentral_jax.tools.compare import flags as compare_flags
from decentral_jax.tools.compare import runs
from decentral_jax.tools.runtime_model_cli import main as runtime_main
from decentral_jax.tools.runtime_model_cli import parser as parser_lib

from helpers import ROOT, benchmark_module

BAD = ("nan", "inf", "-1e30", "1e30", "99999999999999999999")
MISSING_CONFIG = os.path.join(ROOT, "no_such_config_here.py")


def _subparsers(parser):
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(getattr(action, "choices", None), dict):
      return action.choices
  return {}


def _numeric(action) -> bool:
  t = action.type
  return (t in (int, float) or flag_types.is_numeric_type(t)
          or getattr(t, "__qualname__", "").startswith("comma_list"))


def _numeric_flags(parser) -> list[str]:
  return [a.option_strings[-1] for a in parser._actions  # pylint: disable=protected-access
          if a.option_strings and _numeric(a)]


def _runtime_cases():
  subs = _subparsers(parser_lib.build_parser("decentral-jax"))
  out = [(name, flag) for name, sub in subs.items()
         for flag in _numeric_flags(sub)]
  return out + [("predict", "--gossip-in-flight")]


RUNTIME_CASES = _runtime_cases()
# Arguments a subcommand requires; the config does not exist, so a value
# let through fails on the config, not on the flag, and the test says so.
REQUIRED = {"measure": ["--config", MISSING_CONFIG, "--out", "OUT"],
            "calibrate": ["--config", MISSING_CONFIG]}


def _run(fn, *args):
  """``(exit code, stderr)`` of ``fn(*args)``; SystemExit is a code."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), \
      contextlib.redirect_stdout(io.StringIO()):
    try:
      code = fn(*args)
    except SystemExit as e:
      code = e.code
  return code, err.getvalue()


def _one_error_naming(err: str, flag: str) -> None:
  lines = [line for line in err.splitlines() if "error:" in line]
  assert len(lines) == 1, err
  assert flag in lines[0], err
  assert "Traceback" not in err, err


def test_the_sweep_finds_every_subcommand_and_the_flags_the_issue_names():
  subs = {name for name, _ in RUNTIME_CASES}
  assert {"predict", "measure", "calibrate", "utilisation"} <= subs
  for case in (("measure", "--sizes-MB"), ("measure", "--repeats"),
               ("measure", "--local-size"), ("calibrate", "--steps"),
               ("predict", "--n-workers"), ("predict", "--seed"),
               ("predict", "--slow-speed"), ("utilisation", "--H")):
    assert case in RUNTIME_CASES, case
  assert len(RUNTIME_CASES) >= 35


@pytest.mark.parametrize("command, flag", RUNTIME_CASES)
def test_runtime_model_numeric_flags_refuse_unusable_values(
    command, flag, tmp_path):
  required = [str(tmp_path / "out.json") if a == "OUT" else a
              for a in REQUIRED.get(command, [])]
  for value in BAD:
    code, err = _run(runtime_main.main,
                     [command, *required, f"{flag}={value}"], "decentral-jax")
    assert code == 2, (flag, value, err)
    _one_error_naming(err, flag)


@pytest.mark.parametrize("value, says", [
    ("nan,1", "entry 1 of 'nan,1' must be a finite number"),
    ("1e9,2e9", "in [4e-06, 65536] MB, got '1e9'"),
    ("inf,1", "got 'inf'"),
    ("1,-2", "entry 2 of '1,-2'"),
])
def test_measure_sizes_named_and_bounded(value, says, tmp_path):
  code, err = _run(runtime_main.main, [
      "measure", "--config", MISSING_CONFIG, "--out",
      str(tmp_path / "c.json"), f"--sizes-MB={value}"], "decentral-jax")
  assert code == 2
  assert "argument --sizes-MB: " in err and says in err, err


def test_measure_repeats_bounded_so_it_ends(tmp_path):
  code, err = _run(runtime_main.main, [
      "measure", "--config", MISSING_CONFIG, "--out",
      str(tmp_path / "c.json"), "--repeats", "99999999999"], "decentral-jax")
  assert code == 2
  assert ("argument --repeats: must be an integer in [2, 1000], got "
          "'99999999999'") in err, err


@pytest.mark.parametrize("flag", _numeric_flags(overlap.build_parser("x")))
def test_overlap_numeric_flags_refuse_unusable_values(flag):
  assert flag in ("--overlap_limit", "--network_gbps", "--gpus_per_node")
  for value in BAD:
    code, err = _run(overlap.build_parser("overlap").parse_args,
                     [f"{flag}={value}"])
    assert code == 2, (flag, value)
    _one_error_naming(err, flag)


def _absl_numeric(registry) -> list[str]:
  return sorted(name for name in registry
                if isinstance(registry[name].default, (int, float))
                and not isinstance(registry[name].default, bool))


@pytest.mark.parametrize("parse, registry", [
    (compare_flags.parse, compare_flags.FLAGS), (train.parse, train.FLAGS)],
    ids=["compare", "train"])
def test_absl_commands_numeric_flags_refuse_unusable_values(parse, registry):
  names = _absl_numeric(registry)
  assert "cpu_devices" in names
  for name in names:
    for value in BAD:
      with pytest.raises(ValueError) as e:
        parse([f"--{name}={value}"])
      assert f"--{name}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e30",
                                   "99999999999999999999", "4294967296",
                                   # str.isdigit() takes these; int() refuses
                                   # "²" or reads "٣" as 3, "07" as 7.
                                   "\u00b2", "\u0663", "07"])
def test_compare_seeds_refuse_unusable_values(value):
  with pytest.raises(ValueError, match="--seeds"):
    runs.parse_seeds(f"0,{value}")


def test_gpu_check_numeric_flags_refuse_unusable_values():
  gpu_flags = benchmark_module("_gpu_check_flags")
  flags = _numeric_flags(gpu_flags.build_parser())
  assert {"--repeats", "--compute_ms", "--collective_us"} <= set(flags)
  for flag in flags:
    for value in BAD:
      code, err = _run(gpu_flags.parse_args,
                       ["--deviceless", "h200", f"{flag}={value}"])
      assert code == 2, (flag, value, err)
      _one_error_naming(err, flag)


@pytest.mark.parametrize("typ, text", [
    (flag_types.integer(0, 10), "11"), (flag_types.integer(0, 10), "2.5"),
    (flag_types.integer(0, 10), "-1"), (flag_types.integer(0, 10), "1e400"),
    (flag_types.real(0, 1), "nan"), (flag_types.real(0, 1), "-inf"),
    (flag_types.real(0, 1, open_lo=True), "0"),
    (flag_types.real(0, 1), "0x10"),
    (flag_types.number_list(flag_types.real(0, 1)), "0.5,,0.5"),
    (flag_types.number_list(flag_types.integer(0, 9), max_items=2), "1,2,3"),
    (flag_types.number_list(flag_types.real(0, 9), unique=True), "1,2,1.0"),
    (flag_types.power_of_two(2, 64), "1"), (flag_types.power_of_two(2, 64), "6"),
    (flag_types.power_of_two(2, 64), "128"),
    (flag_types.power_of_two(2, 64), "2.5"),
])
def test_types_refuse(typ, text):
  with pytest.raises(argparse.ArgumentTypeError):
    typ(text)


def test_types_accept_their_range():
  assert flag_types.integer(0, 10)("1e1") == 10
  assert flag_types.integer(0, 10)(" 7 ") == 7
  assert flag_types.real(0, 1, open_lo=True)("1") == 1.0
  assert flag_types.number_list(flag_types.real(0, 4))("0.5, 4") == [0.5, 4.0]
  # Repeats stay allowed where they are samples, not settings.
  assert flag_types.number_list(flag_types.real(0, 4))("1,1") == [1.0, 1.0]
  assert [flag_types.power_of_two(2, 64)(t) for t in ("2", "8", "64")] == [
      2, 8, 64]


# Library integer arguments: a period or count the compiled program cannot
# hold (its step counter is int32) is refused when the transform is built,
# naming the argument, not when the first step is traced.
def _library_cases():
  import optax
  from decentral_jax import optim
  from decentral_jax import topology
  from decentral_jax.optim import accum_adam
  from decentral_jax.optim import outer_timing
  ring = topology.make("ring", 4)
  return [
      ("accum_steps", lambda v: accum_adam.scale_by_accum_adam(
          accum_steps=v)),
      ("accum_steps", lambda v: accum_adam.horizon_matched_betas(
          0.9, 0.999, v)),
      ("gossip_every", lambda v: optim.decentralized(
          optax.sgd(0.1), ring, gossip_every=v)),
      ("latency", lambda v: outer_timing.named("delayed", latency=v)),
  ]  # (muon_inner's ns_steps is bounded by MAX_NS_STEPS: test_muloco.py)


def test_library_periods_bounded_by_what_the_program_holds():
  from decentral_jax import checks
  assert checks.INT32_MAX == np_int32_max()
  for name, build in _library_cases():
    build(checks.INT32_MAX)  # the largest a step counter holds: accepted
    for bad in (checks.INT32_MAX + 1, 2**40):
      with pytest.raises(ValueError) as e:
        build(bad)
      assert str(e.value).startswith(f"{name} must be an int >= 1 and <= "
                                     f"{checks.INT32_MAX}, got {bad}"), e


def np_int32_max() -> int:
  import numpy as np
  return int(np.iinfo(np.int32).max)


def test_largest_accepted_period_runs_and_the_next_cannot():
  # The bound is what a jitted step holds: INT32_MAX runs, INT32_MAX + 1
  # overflows inside JAX (why it is refused at construction).
  import jax
  import jax.numpy as jnp
  from decentral_jax import checks
  from decentral_jax.optim import accum_adam
  p = {"w": jnp.zeros(3)}
  tx = accum_adam.scale_by_accum_adam(accum_steps=checks.INT32_MAX)
  u, _ = jax.jit(tx.update)(p, tx.init(p), p)
  assert jnp.all(jnp.isfinite(u["w"]))
  with pytest.raises(OverflowError):
    jax.jit(lambda c, k: c % k)(jnp.int32(1), checks.INT32_MAX + 1)


BENCHMARKS = ("bench_bucketed_gossip", "bench_communication",
              "bench_convergence", "bench_evidence", "bench_step_time",
              "bench_topology_scale")
# Run in a child process: the scripts set XLA_FLAGS when imported (not in
# the child: one JAX serves them all). Each parser is caught at parse_args
# (nothing runs), then every numeric flag is parsed with each value of BAD.
_SWEEP_CHILD = r"""
import argparse, contextlib, importlib.util, io, json, os, sys
bench = sys.argv[1]
sys.path.insert(0, bench)
import _common
_common.set_cpu_devices = lambda *a, **k: None  # several scripts, one JAX
class Stop(Exception):
  pass
parse = argparse.ArgumentParser.parse_args
out = {}
for name in sys.argv[2].split(","):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(bench, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  caught = []
  def grab(self, *a, **k):
    caught.append(self)
    raise Stop
  argparse.ArgumentParser.parse_args = grab
  try:
    module.main()
  except Stop:
    pass
  finally:
    argparse.ArgumentParser.parse_args = parse
  rows = []
  for action in caught[0]._actions:
    if not action.option_strings or action.type in (None, str):
      continue
    for value in json.loads(sys.argv[3]):
      err = io.StringIO()
      with contextlib.redirect_stderr(err):
        try:
          caught[0].parse_args([action.option_strings[-1] + "=" + value])
          code = 0
        except SystemExit as e:
          code = e.code
      rows.append((action.option_strings[-1], value, code, err.getvalue()))
  out[name] = rows
print(json.dumps(out))
"""


@pytest.mark.integration
def test_benchmark_scripts_numeric_flags_refuse_unusable_values():
  import json
  import subprocess
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  out = subprocess.run(
      [sys.executable, "-c", _SWEEP_CHILD, os.path.join(ROOT, "benchmarks"),
       ",".join(BENCHMARKS), json.dumps(BAD)],
      capture_output=True, text=True, timeout=300, env=env, check=True)
  results = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(results) == set(BENCHMARKS)
  for name, rows in results.items():
    assert rows, name  # every script has numeric flags
    for flag, value, code, err in rows:
      assert code == 2, (name, flag, value)
      assert f"argument {flag}: " in err, (name, flag, value, err)


class _Device:
  def __init__(self, limit=None):
    self.limit = limit

  def memory_stats(self):
    return None if self.limit is None else {"bytes_limit": self.limit}


def test_measure_sizes_must_fit_what_a_device_holds():
  from decentral_jax.tools.runtime_model_cli import measure
  # An accelerator: a message and its copy within the device's memory.
  gpu = [_Device(limit=10e9)] * 2
  measure.check_sizes_fit([1e6, 4.9e9], gpu)
  with pytest.raises(ValueError) as e:
    measure.check_sizes_fit([1e6, 5.1e9], gpu)
  assert str(e.value).startswith("--sizes-MB 5100 needs 10.2 GB per device")
  assert "at most 5000 MB" in str(e.value)
  # CPU devices share the host's memory.
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  cpu = [_Device()] * 8
  measure.check_sizes_fit([4, 0.99 * host / 16], cpu)
  with pytest.raises(ValueError, match=r"^--sizes-MB .* this host's"):
    measure.check_sizes_fit([4, 1.01 * host / 16], cpu)
  for bad in (float("nan"), float("inf"), 3):
    with pytest.raises(ValueError, match="^--sizes-MB needs finite sizes"):
      measure.check_sizes_fit([1e6, bad], cpu)


def test_learners_numeric_flags_refuse_unusable_values():
  from decentral_jax.tools.learners import main as learners  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import flags as learners_flags  # pylint: disable=import-outside-toplevel
  flags = _numeric_flags(learners_flags.parser("learners"))
  assert {"--learners", "--periods", "--grace", "--fragments",
          "--merge-alpha", "--delay-buffer"} <= set(flags)
  for flag in flags:
    for value in BAD:
      code, err = _run(learners.main, [f"{flag}={value}"], "learners")
      assert code == 2, (flag, value, err)
      _one_error_naming(err, flag)


@pytest.mark.parametrize("flag", ["--grad-dtype", "--param-dtype"])
@pytest.mark.parametrize("value", [",,", "float128", "int8", "(", "a b"])
def test_dtype_flags_refuse_what_is_not_a_wire_float(flag, value):
  code, err = _run(runtime_main.main, ["predict", f"{flag}={value}"],
                   "decentral-jax")
  assert code == 2, err
  _one_error_naming(err, flag)
  assert "is not a floating dtype name" in err, err


@pytest.mark.parametrize("flag", ["--grad-dtype", "--param-dtype"])
@pytest.mark.parametrize("value, words", [
    (">f4", "byte order; use 'float32'"), ("float8_e4m3fn", "compress=fp8"),
    ("float8_e5m2", "block scales")])
def test_dtype_flags_refuse_what_the_library_does_not_send(flag, value, words):
  """The library's wire rule (checks.check_comm_dtype): native byte order,
  16 bits or wider."""
  code, err = _run(runtime_main.main, ["predict", f"{flag}={value}"],
                   "decentral-jax")
  assert code == 2, err
  _one_error_naming(err, flag)
  assert words in err, err
