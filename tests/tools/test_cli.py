"""The ``decentral-jax`` command (decentral_jax/tools/cli.py): routing, help,
errors.

The fast tests call :func:`decentral_jax.tools.cli.main` with stand-ins for
the commands' ``main`` functions (each command runs in this process), and
the real ``train`` and ``predict`` on bad input and ``--help``; one
subprocess checks that ``predict`` through the command prints what the
runtime model prints and imports no JAX. The integration tests stop a real
``train`` with SIGTERM through the command, and install the package's
metadata (setuptools' ``egg_info`` from ``pyproject.toml``) beside a copy of
the package outside the checkout and run the ``console_scripts`` entry
point as ``pip install .`` would (the main job's default configs, presets of
the package, load there without a checkout).
"""

import contextlib
import importlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tomllib

import pytest

from decentral_jax.tools import cli
from decentral_jax.tools.runtime_model_cli import main as runtime_model_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the issue asks the command to offer, written out here (not read from
# cli.COMMANDS) so that a dropped command fails.
EXPECTED = ("train", "compare", "predict", "measure", "validate", "overlap")
# The modules whose main(argv) the other commands call.
MODULES = {"train": "decentral_jax.tools.train",
           "compare": "decentral_jax.tools.compare",
           "overlap": "decentral_jax.tools.overlap"}


def test_help_lists_every_command_on_one_line(capsys):
  assert cli.main(["--help"]) == 0
  out, err = capsys.readouterr()
  assert err == ""
  lines = out.splitlines()
  assert lines[0] == "usage: decentral-jax COMMAND [ARGS...]"
  for name in EXPECTED:
    rows = [l for l in lines if l.split()[:1] == [name]]
    assert len(rows) == 1, (name, out)
    assert len(rows[0].split()) > 3, rows  # a description follows the name
  assert "`decentral-jax COMMAND --help` shows a command's own flags" in out
  assert cli.main(["-h"]) == 0
  assert capsys.readouterr().out == out


@pytest.mark.parametrize("argv,start", [
    (["bogus"], "error: unknown command 'bogus'; one of: "),
    (["--frobnicate", "predict"], "error: unknown command '--frobnicate'"),
    ([], "error: a command is required, one of: "),
])
def test_a_missing_or_unknown_command_is_one_error_line(capsys, argv, start):
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert len(err.splitlines()) == 1 and err.startswith(start), err
  for name in EXPECTED:
    assert name in err


@pytest.mark.parametrize("name", ["calibrate", "fig6", "utilisation"])
def test_a_runtime_model_only_subcommand_says_where_it_lives(capsys, name):
  assert cli.main([name, "--config", "configs/gpt_tiny.py"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.splitlines()) == 1, err
  assert err.startswith(f"error: {name!r} is a runtime-model subcommand, "
                        "not one of decentral-jax's ("), err
  assert err.endswith("); run it as python -m decentral_jax.runtime_model "
                      f"{name} ...\n"), err
  for command in EXPECTED:
    assert command in err


def test_version_is_the_package_version(capsys):
  assert cli.main(["--version"]) == 0
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    version = tomllib.load(f)["project"]["version"]
  assert capsys.readouterr().out == f"decentral-jax {version}\n"


@pytest.mark.parametrize("name", ["predict", "measure", "validate"])
def test_runtime_model_commands_forward_their_arguments(monkeypatch, name):
  seen = []
  monkeypatch.setattr(runtime_model_main, "main",
                      lambda argv, prog: seen.append((argv, prog)) or 5)
  args = ["--n-workers", "8,16", "--png", "x y.png", "--help"]
  assert cli.main([name, *args]) == 5
  assert seen == [([name, *args], "decentral-jax")]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_commands_call_their_main_in_this_process(monkeypatch, name):
  module = importlib.import_module(MODULES[name])
  seen = []
  monkeypatch.setattr(module, "main",
                      lambda argv, **kw: seen.append((argv, kw)) or 7)
  argv_before, path_before = sys.argv[:], sys.path[:]
  assert cli.main([name, "--config", "a b.py", "--config.steps=3"]) == 7
  prog = {"prog": f"decentral-jax {name}"}
  assert seen == [(["--config", "a b.py", "--config.steps=3"], prog)]
  assert sys.argv == argv_before and sys.path == path_before


def test_usage_lines_name_the_command_as_typed(capsys):
  # argparse's --help and errors (SystemExit) become the command's code.
  assert cli.main(["predict", "--help"]) == 0
  assert capsys.readouterr().out.startswith("usage: decentral-jax predict ")
  assert cli.main(["predict", "--bogus"]) == 2
  assert capsys.readouterr().err == (
      "error: unrecognized arguments: --bogus (see decentral-jax predict "
      "--help)\n")
  assert cli.main(["predict", "--n-workers", "x"]) == 2
  assert capsys.readouterr().err.startswith(
      "error: argument --n-workers: ")
  assert cli.main(["overlap", "--help"]) == 0
  assert capsys.readouterr().out.startswith("usage: decentral-jax overlap ")
  assert cli.main(["train", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: decentral-jax train --config FILE.py")
  assert "--workdir" in out
  # The runtime model's own entry point keeps its name.
  with pytest.raises(SystemExit):
    runtime_model_main.main(["predict", "--help"])
  assert capsys.readouterr().out.startswith(
      "usage: python -m decentral_jax.runtime_model predict ")


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_an_unknown_flag_points_at_the_commands_own_help(name, capsys):
  # The top-level help lists commands, not flags: the line names the help
  # that lists this command's flags. Refused while parsing, before work.
  argv = [name, "--nope"]
  if name == "measure":
    argv += ["--config", "configs/gpt_tiny.py", "--out", "x.json"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and "nope" in err, err
  assert err.startswith("error: ") and err.rstrip().endswith(
      f"(see decentral-jax {name} --help)"), err


def test_two_commands_with_the_same_flags_run_in_one_process(tmp_path,
                                                             capsys):
  # train and compare both define --config; each parses its own flags, and
  # a second call does not see the first one's.
  missing = str(tmp_path / "a b.py")
  assert cli.main(["train", f"--config={missing}", "--workdir=w"]) == 2
  assert capsys.readouterr().err == (
      f"error: config file {missing!r} does not exist.\n")
  assert cli.main(["compare", "--help"]) == 0
  assert "--outdir" in capsys.readouterr().out
  assert cli.main(["train", "--workdir=w"]) == 2
  assert capsys.readouterr().err == (
      "error: --config is required, e.g. --config configs/gpt_tiny.py\n")
  assert cli.main(["train", "--cpu_devices=-1"]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and "cpu_devices" in err, err


def test_train_names_cpu_devices_when_it_set_too_few(tmp_path, capsys,
                                                     monkeypatch):
  # --cpu_devices=4 with 8 workers: the backend of this process already
  # has its devices, so the four the flag would simulate are mocked here.
  import jax
  from decentral_jax.tools import train
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setattr(train, "simulate_cpu_devices", lambda n, source: None)
  monkeypatch.setattr(jax, "local_device_count", lambda *a: 4)
  workdir = tmp_path / "w"
  assert cli.main(["train", "--config", os.path.join(
      ROOT, "configs", "gpt_tiny.py"), "--config.n_workers=8",
                   "--cpu_devices=4", f"--workdir={workdir}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == ("error: --cpu_devices=4 simulates 4 CPU devices in this "
                     "process, but --config.n_workers=8 needs 8; raise "
                     "--cpu_devices to 8 or drop it (0: as many as the "
                     "config needs)."), err
  assert not workdir.exists()


@pytest.mark.integration
def test_sigterm_to_the_command_stops_train_with_a_checkpoint(tmp_path):
  # Sent to the `decentral-jax` process only (as `timeout` or a scheduler
  # would): train runs in that process and saves before it exits.
  code = ("import sys; from decentral_jax.tools import cli; "
          "sys.exit(cli.main(sys.argv[1:]))")
  proc = subprocess.Popen(
      [sys.executable, "-c", code, "train", "--config",
       os.path.join(ROOT, "configs", "gpt_quick.py"), "--workdir",
       str(tmp_path / "run"), "--config.steps=100000"],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  try:
    for line in proc.stdout:  # the runner announces its layout, then steps
      lines.append(line)
      if "step 0:" in line:
        os.kill(proc.pid, signal.SIGTERM)
        break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, "".join(lines)
  finally:
    if proc.poll() is None:
      proc.kill()
  said = [l for l in lines if l.startswith("preempted: ")]
  assert said and "SIGTERM" in said[0], "".join(lines)


def test_a_missing_relative_config_names_the_current_directory(
    tmp_path, monkeypatch):
  from decentral_jax.runner import config as config_lib
  # Run from outside the checkout that holds the imported package.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError) as info:
    config_lib.load_config("configs/gpt_quick.py")
  assert str(info.value) == (
      "config file 'configs/gpt_quick.py' does not exist (relative to the "
      f"current directory, {tmp_path}; the checkout has "
      f"{os.path.join(ROOT, 'configs', 'gpt_quick.py')}).")
  with pytest.raises(ValueError) as info:
    config_lib.load_config("configs/no_such.py")
  assert str(info.value) == (
      "config file 'configs/no_such.py' does not exist (relative to the "
      f"current directory, {tmp_path}).")
  missing = str(tmp_path / "no_such.py")
  with pytest.raises(ValueError) as info:
    config_lib.load_config(missing)
  assert str(info.value) == f"config file {missing!r} does not exist."


def test_pyproject_installs_the_command():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  module, _, attr = scripts["decentral-jax"].partition(":")
  assert getattr(importlib.import_module(module), attr) is cli.main


@pytest.mark.slow  # a second process
def test_predict_prints_the_runtime_models_table_without_jax():
  args = ["predict", "--preset", "A40", "--n-workers", "8,16", "--steps",
          "60"]
  expected = io.StringIO()
  with contextlib.redirect_stdout(expected):
    assert runtime_model_main.main(args) == 0
  code = ("import sys; from decentral_jax.tools import cli; "
          f"rc = cli.main({args!r}); "
          "print('jax modules:', sorted(m for m in sys.modules "
          "if m.split('.')[0] in ('jax', 'jaxlib', 'optax', 'flax')), rc)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  table, _, tail = out.stdout.rpartition("jax modules: ")
  assert table == expected.getvalue()
  assert tail == "[] 0\n"


@pytest.mark.integration
def test_the_installed_entry_point_outside_and_inside_a_checkout(tmp_path):
  # The metadata pip would install: setuptools' egg_info of a copy of the
  # project (never written into the checkout), the package copied beside it.
  src, site = tmp_path / "src", tmp_path / "site"
  shutil.copytree(os.path.join(ROOT, "decentral_jax"), src / "decentral_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  os.makedirs(site)
  subprocess.run([sys.executable, "-c", "from setuptools import setup; "
                  "setup()", "-q", "egg_info", "--egg-base", str(site)],
                 cwd=src, check=True, capture_output=True)
  shutil.copytree(src / "decentral_jax", site / "decentral_jax")
  # What pip's console script does: load the entry point and exit with it.
  launcher = ("import sys; from importlib import metadata; "
              "(ep,) = metadata.entry_points(group='console_scripts', "
              "name='decentral-jax'); "
              "assert ep.load().__code__.co_filename.startswith(sys.argv[1])"
              "; sys.argv = ['decentral-jax', *sys.argv[2:]]; "
              "sys.exit(ep.load()())")
  env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}

  def run(cwd, *argv):
    return subprocess.run([sys.executable, "-c", launcher, str(site), *argv],
                          cwd=cwd, env=env, capture_output=True, text=True)

  # Outside a checkout: every command runs from the installed package.
  out = run(tmp_path, "predict", "--preset", "A40", "--n-workers", "8")
  assert out.returncode == 0, out.stderr
  assert "All-Reduce" in out.stdout
  out = run(tmp_path, "compare", "--help")
  assert out.returncode == 0, out.stderr
  assert "--outdir" in out.stdout
  # The default job's configs (the quick one and --full's) are presets of
  # the package: they load and every arm is checked without a checkout;
  # the job stops only at the cluster flag, before anything trains.
  for job in ((), ("--full",)):
    out = run(tmp_path, "compare", *job, "--clusters=no_such",
              f"--outdir={tmp_path / 'cmp'}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].startswith(
        "error: --clusters entry 'no_such' is neither a preset nor"), out.stderr
  assert not (tmp_path / "cmp").exists()
  out = run(tmp_path, "overlap", "--help")
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("usage: decentral-jax overlap ")
  # Inside the checkout (a subdirectory): train runs on the installed
  # package and reports the bad config as it does for `python`.
  out = run(os.path.join(ROOT, "docs"), "train", "--config",
            "configs/no_such.py", "--workdir", str(tmp_path / "w"))
  assert out.returncode == 2, out.stderr
  assert out.stderr.splitlines()[-1] == (
      "error: config file 'configs/no_such.py' does not exist (relative to "
      f"the current directory, {os.path.join(ROOT, 'docs')}).")



@pytest.mark.slow  # four interpreters, ~8 s each
@pytest.mark.parametrize("env", [
    {"JAX_NUM_CPU_DEVICES": "8"},
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}])
def test_cpu_devices_wins_over_the_environment_s_count(tmp_path, env):
  """--cpu_devices=4 with 8 devices set by the environment: the flag's 4
  are simulated (so 8 workers are refused naming the flag), for train and
  compare alike, not the environment's 8 silently."""
  base = {k: v for k, v in os.environ.items()
          if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  base.update(env, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  tiny = ["--config.model.n_layer=1", "--config.model.n_embd=16",
          "--config.model.n_head=2", "--config.model.block_size=8",
          "--config.global_batch=16", "--config.steps=1"]
  for argv in (
      ["-m", "decentral_jax.tools.cli", "train", "--config",
       os.path.join(ROOT, "configs", "gpt_tiny.py"), "--cpu_devices=4",
       f"--workdir={tmp_path / 'w'}", *tiny],
      ["-m", "decentral_jax.tools.compare", "--cpu_devices=4",
       "--methods=dadam", f"--outdir={tmp_path / 'out'}", *tiny]):
    proc = subprocess.run([sys.executable, *argv], capture_output=True,
                          text=True, env=base, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --cpu_devices=4 simulates 4 CPU devices"), \
        last
  assert not (tmp_path / "w").exists() and not (tmp_path / "out").exists()


def test_train_names_the_environment_s_count_when_it_set_too_few(
    tmp_path, capsys, monkeypatch):
  """JAX_NUM_CPU_DEVICES=4 (no --cpu_devices) with 8 workers: the hint
  named XLA_FLAGS, which that variable overrides; it names the variable
  and --cpu_devices. (The backend already has its devices: the four are
  mocked.)"""
  import jax
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
  monkeypatch.setattr(jax, "local_device_count", lambda *a: 4)
  workdir = tmp_path / "w"
  assert cli.main(["train", "--config", os.path.join(
      ROOT, "configs", "gpt_tiny.py"), "--config.n_workers=8",
                   f"--workdir={workdir}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == (
      "error: the environment variable JAX_NUM_CPU_DEVICES=4 simulates 4 "
      "CPU devices in this process, but --config.n_workers=8 needs 8; raise "
      "it to 8, unset it, or give --cpu_devices=8 (which wins over it)."), err
  assert not workdir.exists()


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "", "\u00b2",
                                   "\uff18", "2147483648", "1025"])
def test_a_bad_environment_count_is_one_line_before_jax_reads_it(
    capsys, monkeypatch, value):
  """JAX reads JAX_NUM_CPU_DEVICES when it is imported and stopped with a
  traceback ('Invalid value "abc" for JAX flag')."""
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", value)
  assert cli.main(["train", "--config", "x.py"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: the environment variable JAX_NUM_CPU_DEVICES="
                 f"{value!r} must be a whole number in [1, 1024]; fix "
                 "or unset it"], err


def test_train_names_xla_flags_when_its_count_is_too_few(
    tmp_path, capsys, monkeypatch):
  """XLA_FLAGS' device count 4 (no --cpu_devices, no JAX_NUM_CPU_DEVICES)
  with 8 workers: it was overridden to 8 without a word; it is kept, and
  too few is refused naming it and --cpu_devices. (The four are mocked.)"""
  import jax
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false "
                     "--xla_force_host_platform_device_count=4")
  monkeypatch.setattr(jax, "local_device_count", lambda *a: 4)
  workdir = tmp_path / "w"
  assert cli.main(["train", "--config", os.path.join(
      ROOT, "configs", "gpt_tiny.py"), "--config.n_workers=8",
                   f"--workdir={workdir}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == (
      "error: XLA_FLAGS' --xla_force_host_platform_device_count=4 simulates "
      "4 CPU devices in this process, but --config.n_workers=8 needs 8; "
      "raise it to 8, drop it from XLA_FLAGS, or give --cpu_devices=8 "
      "(which wins over it)."), err
  assert not workdir.exists()


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "", "\u00b2",
                                   "\uff18", "2147483648", "1025"])
def test_a_bad_xla_flags_count_is_one_line_before_xla_reads_it(
    capsys, monkeypatch, value):
  """XLA aborted on --xla_force_host_platform_device_count=abc with its
  whole list of flags and "Check failed: tsl::Flags::Parse"."""
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setenv("XLA_FLAGS",
                     f"--xla_force_host_platform_device_count={value}")
  assert cli.main(["train", "--config", "x.py"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: XLA_FLAGS' --xla_force_host_platform_device_count="
                 f"{value!r} must be a whole number in [1, 1024]; fix "
                 "it or drop it from XLA_FLAGS"], err


@pytest.mark.parametrize("token", [
    "xla_force_host_platform_device_count=8",
    "-xla_force_host_platform_device_count=8",
    "---xla_force_host_platform_device_count=8"])
def test_a_misspelled_xla_flags_count_is_named(monkeypatch, token):
  """XLA aborts on an option that is not --name=value ('Unknown flag in
  XLA_FLAGS'); the check read the count as 8 and let it through."""
  from decentral_jax import checks
  monkeypatch.setenv("XLA_FLAGS", token)
  with pytest.raises(ValueError, match="is not spelled as XLA reads it"):
    checks.xla_flags_device_count()


def test_the_xla_flags_device_count_is_read_as_xla_reads_it(monkeypatch):
  """The last occurrence counts; other options and their values are
  passed by; absent, there is none."""
  from decentral_jax import checks
  for flags_, want in [
      ("", None), ("--xla_cpu_enable_fast_math=false", None),
      ("--xla_force_host_platform_device_count=4", 4),
      ("--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/x "
       "--xla_force_host_platform_device_count=16", 16)]:
    monkeypatch.setenv("XLA_FLAGS", flags_)
    assert checks.xla_flags_device_count() == want, flags_
  monkeypatch.delenv("XLA_FLAGS")
  assert checks.xla_flags_device_count() is None


@pytest.mark.parametrize("script", [
    "train.py", pytest.param("compare.py", marks=pytest.mark.slow)])
def test_the_experiment_scripts_check_the_environment_before_jax(script):
  """`python experiments/train.py` imported JAX first: JAX_NUM_CPU_DEVICES
  =abc ended in JAX's import-time traceback."""
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "abc", "PYTHONPATH": ROOT}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", script)],
      capture_output=True, text=True, env=env, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "error: the environment variable JAX_NUM_CPU_DEVICES='abc' must be a "
      "whole number in [1, 1024]; fix or unset it"], proc.stderr
  env = {**os.environ, "PYTHONPATH": ROOT,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=abc"}
  env.pop("JAX_NUM_CPU_DEVICES", None)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", script)],
      capture_output=True, text=True, env=env, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "error: XLA_FLAGS' --xla_force_host_platform_device_count='abc' must "
      "be a whole number in [1, 1024]; fix it or drop it from "
      "XLA_FLAGS"], proc.stderr


def test_a_non_boolean_value_of_a_boolean_flag_names_the_accepted_values():
  # compare's --per_method_lr and a config's boolean field: absl's parser
  # refuses 'maybe'; the line names the flag or field and true / false.
  from decentral_jax.runner import config as config_lib
  from decentral_jax.tools.compare import flags as compare_flags
  with pytest.raises(ValueError) as e:
    compare_flags.parse(["--per_method_lr=maybe"])
  assert str(e.value) == ("flag --per_method_lr=maybe: 'maybe' is not a "
                          "boolean; give true or false (also 1 or 0)")
  with pytest.raises(ValueError) as e:
    config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                           ["distributed.enabled=maybe"])
  said = str(e.value)
  assert "distributed.enabled=maybe: 'maybe' is not a boolean; give true or " \
      "false (also 1 or 0)" in said and "Non-boolean" not in said, said
  # the values the line names are accepted
  assert config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                ["distributed.enabled=1"]).distributed.enabled
  compare_flags.parse([])  # the flags back at their defaults
