"""The ``decentral-jax`` command: one entry point for the project's tools.

``decentral-jax COMMAND [ARGS...]`` calls the ``main(argv) -> int`` of the
module that implements ``COMMAND`` with ``ARGS``, in this process
(installed by ``pip install .`` from ``[project.scripts]``; also
``python -m decentral_jax.tools.cli``):

* ``train``: :func:`decentral_jax.tools.train.main`;
* ``compare``: the main job, :func:`decentral_jax.tools.compare.main`;
* ``predict``, ``measure``, ``validate``: the runtime model's subcommands
  (:func:`decentral_jax.tools.runtime_model_cli.main.main`); ``predict``
  and ``validate`` never import JAX (``measure`` imports the runner);
* ``overlap``: :func:`decentral_jax.tools.overlap.main`;
* ``learners``: :func:`decentral_jax.tools.learners.main.main` (Ray).

Each command is a :class:`Command` row of :data:`COMMANDS`; its module is
imported only when it runs, so a command loads only what it needs. The
flags, messages and exit codes are the command's own; usage lines name the
command as typed (``decentral-jax predict``). Signals reach the command
directly (``train`` saves a checkpoint on SIGTERM or SIGINT).

Exit codes: the command's own; 2 for a missing or unknown command.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

from decentral_jax import checks

PROG = "decentral-jax"


@dataclasses.dataclass(frozen=True)
class Command:
  """One subcommand: what it does and the module that implements it.

  ``module``'s ``main`` is called as ``main([*args, *ARGS])``, with
  ``prog=prog`` as well when ``prog`` is set (the name its usage lines
  show).
  """
  summary: str  # one line for --help
  module: str
  args: tuple[str, ...] = ()  # leading arguments for ``module``'s main
  prog: str | None = None


_RUNTIME_MODEL = "decentral_jax.tools.runtime_model_cli.main"
COMMANDS = {
    "train": Command(
        "train one configuration (--config FILE --workdir DIR "
        "[--config.FIELD=VALUE ...]); resumes from the workdir's checkpoint",
        "decentral_jax.tools.train", prog=f"{PROG} train"),
    "compare": Command(
        "the main job: train methods side by side on one model and data, "
        "price each run per cluster with the runtime model",
        "decentral_jax.tools.compare", prog=f"{PROG} compare"),
    "predict": Command(
        "predict ms/iteration of each method on a cluster and workload "
        "(runtime model, no JAX)", _RUNTIME_MODEL, ("predict",), PROG),
    "measure": Command(
        "measure this cluster's links and a config's compute into a cluster "
        "JSON for `predict --cluster`", _RUNTIME_MODEL, ("measure",), PROG),
    "validate": Command(
        "leave-one-cluster-out validation of the runtime model on the "
        "paper's Figure 6 clusters", _RUNTIME_MODEL, ("validate",), PROG),
    "learners": Command(
        "train with K learners and a synchronizer on Ray (sync DiLoCo or "
        "decoupled: quorum, grace window); needs the 'ray' extra",
        "decentral_jax.tools.learners.main", prog=f"{PROG} learners"),
    "overlap": Command(
        "compile the train steps for a GPU target without a GPU and report "
        "which collectives overlap compute", "decentral_jax.tools.overlap",
        prog=f"{PROG} overlap"),
}


def help_text() -> str:
  """The ``--help`` text: usage, one line per command."""
  width = max(map(len, COMMANDS))
  rows = "\n".join(f"  {name:<{width}}  {c.summary}"
                   for name, c in COMMANDS.items())
  return (f"usage: {PROG} COMMAND [ARGS...]\n\n"
          "Decentralized data-parallel training in JAX: train, compare "
          "methods, price them on a cluster.\n\n"
          f"commands:\n{rows}\n\n"
          f"`{PROG} COMMAND --help` shows a command's own flags. The runtime "
          "model's other subcommands (fig6, utilisation, calibrate): "
          "python -m decentral_jax.runtime_model. The configs the examples "
          "name (configs/*.py) are files of a source checkout.\n")


def _error(message: str) -> int:
  print(f"error: {message}", file=sys.stderr)
  return 2


def environment_error() -> int | None:
  """2 after one ``error:`` line if ``JAX_NUM_CPU_DEVICES`` is set to
  something JAX refuses when it is imported (with a traceback), or
  ``XLA_FLAGS``' device count to something XLA aborts on when the CPU
  backend starts, else None; call it before anything imports JAX."""
  try:
    checks.environment_count("JAX_NUM_CPU_DEVICES")
    checks.xla_flags_device_count()
  except ValueError as e:
    return _error(str(e).rstrip("."))
  return None


def run_command(command: Command, args: list[str]) -> int:
  """Calls ``command``'s ``main`` with ``args`` in this process.

  Returns:
    Its exit code; a ``SystemExit`` it raises with an int (or None, 0) is
    returned as that code (argparse's ``--help`` and flag errors).
  """
  code = environment_error()
  if code:
    return code
  main_fn = importlib.import_module(command.module).main
  argv = [*command.args, *args]
  try:
    if command.prog is None:
      code = main_fn(argv)
    else:
      code = main_fn(argv, prog=command.prog)
  except SystemExit as e:
    if e.code is not None and not isinstance(e.code, int):
      raise
    code = e.code
  return int(code or 0)


def main(argv: list[str] | None = None) -> int:
  """Dispatches ``argv`` (default ``sys.argv[1:]``) to its command.

  Args:
    argv: ``[COMMAND, *ARGS]``, or ``["--help"]`` (also ``-h``, ``help``)
      / ``["--version"]``.

  Returns:
    The command's exit code; 0 after ``--help`` / ``--version``; 2 (one
    ``error:`` line on stderr) for a missing or unknown command.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("-h", "--help", "help"):
    print(help_text(), end="")
    return 0
  if argv and argv[0] == "--version":
    print(f"{PROG} {importlib.import_module('decentral_jax').__version__}")
    return 0
  choices = ", ".join(COMMANDS)
  if not argv:
    return _error(f"a command is required, one of: {choices} "
                  f"(see {PROG} --help)")
  name, args = argv[0], argv[1:]
  command = COMMANDS.get(name)
  if command is None:
    runs = importlib.import_module(_RUNTIME_MODEL).RUNS
    if name in runs:  # fig6, utilisation, calibrate
      return _error(f"{name!r} is a runtime-model subcommand, not one of "
                    f"{PROG}'s ({choices}); run it as python -m "
                    f"decentral_jax.runtime_model {name} ...")
    return _error(f"unknown command {name!r}; one of: {choices} "
                  f"(see {PROG} --help)")
  return run_command(command, args)


if __name__ == "__main__":
  sys.exit(main())
