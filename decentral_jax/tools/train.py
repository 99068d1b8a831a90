"""``decentral-jax train``: trains one configuration, resuming from its workdir.

``decentral-jax train --config CONFIG --workdir DIR`` (in a clone also
``python experiments/train.py ...``). Any config field can be overridden,
e.g.::

  decentral-jax train --config configs/gpt_tiny.py --workdir /tmp/x \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.steps=100

On a CPU-only machine the run needs ``config.n_workers`` x
``config.devices_per_worker`` devices; this command
simulates them (``jax_num_cpu_devices``) before JAX starts its CPU backend,
so the default 8-worker configs work out of the box. ``--cpu_devices=N``
sets the number explicitly, over ``JAX_NUM_CPU_DEVICES`` and ``XLA_FLAGS``'
``--xla_force_host_platform_device_count``; without it the count either of
those sets is kept (the variable's over the option's). Fewer devices than
the run needs is refused naming what set the count, before any compile. At most
``decentral_jax.runner.config.MAX_SIMULATED_CPU_DEVICES`` (1024) devices per
process are simulated, the limit of ``JAX_NUM_CPU_DEVICES`` and
``XLA_FLAGS``' count too; more is refused before JAX starts (put several
workers on one device with ``config.workers_per_device`` > 1, or run on
that many real devices). Re-running with the same
``--workdir`` resumes from the last checkpoint.

Bad input (a missing or broken config file, an unknown field, a value of the
wrong type or out of range, missing data, an unwritable work directory, a
data file at a path the run writes in it such as ``config.json`` or
``checkpoints/``) is one ``error: ...`` line on stderr and exit code 2; a
diverged run exits with 3; SIGTERM or SIGINT saves a checkpoint and exits
with 143 or 130.

Multi-host: run the same command once per host (``srun`` does it on SLURM)
with ``--config.distributed.enabled=True``; on SLURM the coordinator and
process ids are detected, elsewhere also pass
``--config.distributed.coordinator_address=HOST:PORT``,
``--config.distributed.num_processes=N`` and
``--config.distributed.process_id=I``. Every process uses all of its local
devices (``n_workers / N`` simulated CPU devices per process on CPU); only
process 0 prints, logs and writes ``metrics.jsonl``. See
``experiments/slurm_example.sbatch``.

The flags live on a registry of this module alone (:data:`FLAGS`, not
``absl.flags.FLAGS``), so :func:`main` runs in one process with any other
tool that defines flags of the same names (``--config``).
"""

from __future__ import annotations

import os
import sys

from absl import flags
from absl import logging
import jax

from decentral_jax.data import text
from decentral_jax.runner import orbax_quiet
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import devices
from decentral_jax.runner import launch
from decentral_jax.runner import presets
from decentral_jax.runner import train
from decentral_jax.runner import validation
from decentral_jax.tools import flag_types

#: The flags of :func:`main` (a registry of their own).
FLAGS = flags.FlagValues()
CONFIG = flags.DEFINE_string(
    "config", None, "A preset name (gpt_tiny, gpt_quick) or a config file "
    "(configs/*.py, or FILE.py:ARG); override its fields with "
    "--config.<field>=value.", flag_values=FLAGS)
WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (metrics.jsonl, checkpoints); defaults "
    "to config.workdir.", flag_values=FLAGS)
CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Number of simulated CPU devices per process; 0 = "
    "config.n_workers x config.devices_per_worker / "
    "config.workers_per_device / processes (only used "
    "when JAX runs on CPU).",
    lower_bound=0, upper_bound=config_lib.MAX_SIMULATED_CPU_DEVICES,
    flag_values=FLAGS)
#: The arguments that ask for the help text (exit code 0).
HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")


def simulate_cpu_devices(n: int, source: str = "--cpu_devices=N") -> None:
  """Asks JAX for ``n`` CPU devices; must run before any JAX computation.

  The count set here wins over ``JAX_NUM_CPU_DEVICES`` and ``XLA_FLAGS``'
  ``--xla_force_host_platform_device_count``; :func:`main` calls it when
  ``--cpu_devices`` is given, or when neither of those sets a count.

  Raises:
    ValueError: ``n`` above ``config.MAX_SIMULATED_CPU_DEVICES`` (``source``
      names what set it); nothing is simulated then.
  """
  devices.check_simulated_devices(int(n), source)
  jax.config.update("jax_num_cpu_devices", int(n))


def expected_processes(config) -> int:
  """Processes of the job about to start (1 unless it is multi-process)."""
  d = config.distributed
  if int(d.num_processes) > 0:
    return int(d.num_processes)
  srun_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
  if d.enabled or srun_tasks > 1:  # as initialize_from_config decides
    return max(int(os.environ.get("SLURM_NTASKS", "1") or 1), 1)
  return 1


def help_text(prog: str) -> str:
  """The ``--help`` text: usage, this module's description, the flags."""
  return (f"usage: {prog} --config FILE.py [--workdir DIR] "
          f"[--config.FIELD=VALUE ...]\n\n{__doc__.strip()}\n\nflags:\n"
          f"{FLAGS.get_help()}\n")


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
  """Reads ``argv`` (no program name) into :data:`FLAGS`: ``(positional,
  overrides)``, or one-line ValueError
  (:func:`decentral_jax.runner.config.parse_command_line`)."""
  return config_lib.parse_command_line(FLAGS, "train", argv)


def _start_logging() -> None:
  """absl logging as ``absl.app.run`` sets it up: its handler, absl's own
  flags at their defaults, and INFO lines on stderr unless ``--verbosity``
  was set."""
  logging.use_absl_handler()
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["train"], known_only=True)
  if flags.FLAGS["verbosity"].using_default_value:
    flags.FLAGS.verbosity = 0  # as absl.app.run does after parsing


def _check_data_files(config) -> None:
  """The token bins or text file of a GPT run are regular files (a
  DataNotFoundError, one line naming the path and what it is instead:
  :func:`decentral_jax.data.text.token_bin_paths`, ``check_text_file``):
  checked before JAX starts or a process waits for the others (the data
  modules check the contents later)."""
  data = config.data
  if data.get("source") == "token_bins" and data.get("path"):
    text.token_bin_paths(data.path)
  elif data.get("source") == "text_file" and data.get("path"):
    text.check_text_file(data.path)


def _check_one_workdir(overrides: list[str]) -> None:
  """Refuses ``--workdir`` together with a ``--config.workdir`` override:
  one of the two directories would be silently dropped (a config file's
  own ``workdir`` is only the default ``--workdir`` replaces)."""
  given = [a for a in overrides if a.partition("=")[0] == "--config.workdir"]
  if WORKDIR.value is not None and given:
    raise ValueError(f"--workdir={WORKDIR.value} and {given[-1]} both name "
                     "the work directory; give one of them.")


def _prepare(overrides: list[str]):
  """The checked config and workdir; simulated devices; the job joined.

  Raises:
    ValueError: bad config, workdir or device count (one line).
  """
  # Everything about the config is checked before JAX starts.
  _check_one_workdir(overrides)
  config = presets.load_named_or_file(CONFIG.value, overrides)
  validation.check_config(config)
  workdir = WORKDIR.value or config.workdir
  if not workdir:
    raise ValueError("--workdir is required (or set config.workdir).")
  _check_data_files(config)  # before a multi-process job waits to join
  procs = expected_processes(config)
  if procs == 1:  # hosts sharing a file system would race on the probe
    flag_types.check_output_dir(workdir, "--workdir" if WORKDIR.value
                                else "--config.workdir")
  needed, source = devices.devices_needed(config)
  source = source.replace("config.", "--config.")  # the flags typed
  source += f" over {procs} processes" if procs > 1 else ""
  # --cpu_devices wins over the environment's count; without it a count
  # the environment sets is kept.
  env = devices.environment_cpu_devices()
  ours = bool(CPU_DEVICES.value) or env is None
  if ours:
    simulate_cpu_devices(
        CPU_DEVICES.value or max(needed // procs, 1),
        f"--cpu_devices={CPU_DEVICES.value}" if CPU_DEVICES.value else source)
  if launch.initialize_from_config(config) and jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)  # process 0 reports
  if ours and jax.default_backend() == "cpu":  # we set the count
    devices.check_asked_devices(CPU_DEVICES.value, jax.local_device_count(),
                                max(needed // procs, 1), source)
  elif jax.default_backend() == "cpu":  # the environment set it
    devices.check_environment_devices(env, jax.local_device_count(),
                                      max(needed // procs, 1), source)
  if jax.process_index() == 0:
    for line in validation.config_warnings(config):
      print(f"warning: {line}", file=sys.stderr)
  logging.info("JAX %s, %d process(es), devices: %s", jax.__version__,
               jax.process_count(), jax.devices())
  return config, workdir


def _error(message, code: int = 2) -> int:
  print(f"error: {message}", file=sys.stderr)
  return code


def main(argv: list[str] | None = None,
         prog: str = "decentral-jax train") -> int:
  """Trains the configuration the command line ``argv`` names.

  Args:
    argv: the arguments, no program name (default ``sys.argv[1:]``).
    prog: the command's name in the ``--help`` usage line.

  Returns:
    The exit code: 0 (also after ``--help``); 2 after one ``error:`` line
    (bad flags, config, data or workdir); 3 (diverged; the last good
    checkpoint stays); 143 / 130 (SIGTERM / SIGINT: checkpoint saved).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a in HELP_FLAGS for a in argv[:argv.index("--")
                                       if "--" in argv else None]):
    print(help_text(prog), end="")
    return 0
  try:
    positional, overrides = parse(argv)
  except ValueError as e:  # a flag: its list is in this command's help
    return _error(f"{e} (see {prog} --help)")
  if positional:
    return _error(f"unexpected arguments: {' '.join(positional)}")
  if not CONFIG.value:
    return _error("--config is required, e.g. --config configs/gpt_tiny.py")
  _start_logging()
  orbax_quiet.quiet_orbax_logs()
  try:
    config, workdir = _prepare(overrides)
    final = train.train_and_evaluate(config, workdir)
  except ValueError as e:  # bad config or data: one line, no traceback
    return _error(e)
  except FloatingPointError as e:  # diverged; the last good checkpoint stays
    return _error(e, 3)
  except train.Preempted as e:  # SIGTERM/SIGINT: checkpoint saved, 143/130
    print(f"preempted: {e}", file=sys.stderr)
    return e.exit_code
  if jax.process_index() > 0:
    return 0
  summary = ", ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in final.items())
  print(f"finished: {summary}")
  print(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}")
  return 0
