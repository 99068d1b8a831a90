"""The ``decentral-jax`` command: one entry point for the project's tools.

``decentral-jax COMMAND [ARGS...]`` forwards ``ARGS`` unchanged to the tool
that already implements ``COMMAND`` (installed by ``pip install .`` from
``[project.scripts]``; also ``python -m decentral_jax.cli``):

* ``predict``, ``measure``, ``validate``: the runtime model's subcommands
  (:func:`decentral_jax.runtime_model.cli.main.main`); ``predict`` and
  ``validate`` never import JAX (``measure`` imports the runner itself);
* ``train``, ``compare``, ``overlap``: the scripts ``experiments/train.py``,
  ``experiments/compare.py`` and ``benchmarks/bench_gpu_overlap.py`` of a
  source checkout, each run in a child Python process as ``python SCRIPT
  ARGS`` would run it (``__main__``, ``sys.argv = [SCRIPT, *ARGS]``, the
  script's directory first on ``sys.path``, the imported package's
  directory on it too), so their flags, messages and exit codes are theirs,
  and two scripts run from one process (``main(["train", ...])`` then
  ``main(["compare", ...])``) do not share absl's flag registry or JAX's
  backend.

Those scripts, and the configs and data paths they default to
(``configs/gpt_tiny.py``, ``results/``), live in the repository, not in the
installed package. The checkout is the directory holding the imported
package (an editable install, or ``PYTHONPATH`` set to a clone) or else the
current directory or one of its parents (a clone after ``pip install .``):
a directory whose ``pyproject.toml`` names the project ``decentral_jax`` and
that has an ``experiments/`` folder (:func:`find_checkout`). Outside any
checkout these three commands are one ``error:`` line and exit code 2.

Each command is a :class:`Command` row of :data:`COMMANDS`, either a
``module`` whose ``main(argv) -> int`` is called or a checkout ``script``;
when a script's logic moves into the package, its row changes from
``script=...`` to ``module=...`` and nothing else here does.

Exit codes: the tool's own; 2 for a missing or unknown command or a missing
checkout.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import threading
import tomllib

PROG = "decentral-jax"
#: The distribution name a checkout's ``pyproject.toml`` must carry.
PROJECT = "decentral_jax"


@dataclasses.dataclass(frozen=True)
class Command:
  """One subcommand: what it does and where its implementation lives.

  Exactly one of ``module`` (a module of the package with ``main(argv)``,
  called with ``args + ARGS``) and ``script`` (a path relative to the
  checkout root, run as ``__main__`` with ``ARGS``) is set.
  """
  summary: str  # one line for --help
  module: str | None = None
  script: str | None = None
  args: tuple[str, ...] = ()  # leading arguments for ``module``'s main


_RUNTIME_MODEL = "decentral_jax.runtime_model.cli.main"
COMMANDS = {
    "train": Command(
        "train one configuration (--config FILE --workdir DIR "
        "[--config.FIELD=VALUE ...]); resumes from the workdir's checkpoint",
        script="experiments/train.py"),
    "compare": Command(
        "the main job: train methods side by side on one model and data, "
        "price each run per cluster with the runtime model",
        script="experiments/compare.py"),
    "predict": Command(
        "predict ms/iteration of each method on a cluster and workload "
        "(runtime model, no JAX)", module=_RUNTIME_MODEL, args=("predict",)),
    "measure": Command(
        "measure this cluster's links and a config's compute into a cluster "
        "JSON for `predict --cluster`", module=_RUNTIME_MODEL,
        args=("measure",)),
    "validate": Command(
        "leave-one-cluster-out validation of the runtime model on the "
        "paper's Figure 6 clusters", module=_RUNTIME_MODEL,
        args=("validate",)),
    "overlap": Command(
        "compile the train steps for a GPU target without a GPU and report "
        "which collectives overlap compute", script=(
            "benchmarks/bench_gpu_overlap.py")),
}


def help_text() -> str:
  """The ``--help`` text: usage, one line per command, where they live."""
  width = max(map(len, COMMANDS))
  rows = "\n".join(f"  {name:<{width}}  {c.summary}"
                   for name, c in COMMANDS.items())
  scripts = ", ".join(f"{name} ({c.script})" for name, c in COMMANDS.items()
                      if c.script)
  return (f"usage: {PROG} COMMAND [ARGS...]\n\n"
          "Decentralized data-parallel training in JAX: train, compare "
          "methods, price them on a cluster.\n\n"
          f"commands:\n{rows}\n\n"
          f"`{PROG} COMMAND --help` shows a command's own flags. The runtime "
          "model's other subcommands (fig6, utilisation, calibrate): "
          "python -m decentral_jax.runtime_model. Run from a source "
          "checkout (beside the installed package, or the current directory "
          f"or a parent): {scripts}.\n")


def is_checkout(path: str) -> bool:
  """Whether ``path`` is a source checkout of this project.

  True when ``path/pyproject.toml`` parses and names the project
  :data:`PROJECT`, and ``path/experiments`` is a directory.
  """
  try:
    with open(os.path.join(path, "pyproject.toml"), "rb") as f:
      name = tomllib.load(f).get("project", {}).get("name")
  except (OSError, tomllib.TOMLDecodeError):
    return False
  return name == PROJECT and os.path.isdir(os.path.join(path, "experiments"))


def find_checkout(cwd: str | None = None,
                  package_parent: str | None = None) -> str | None:
  """The source checkout the script commands run from, or None.

  Looks at ``package_parent`` (default: the directory holding the imported
  ``decentral_jax`` package), then at ``cwd`` (default: the current
  directory) and each of its parents; returns the first that
  :func:`is_checkout`, as an absolute path.
  """
  if package_parent is None:
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))
  places = [os.path.abspath(package_parent)]
  here = os.path.abspath(cwd or os.getcwd())
  while True:
    places.append(here)
    if os.path.dirname(here) == here:
      break
    here = os.path.dirname(here)
  return next((p for p in places if is_checkout(p)), None)


# The child's start: sys.argv and sys.path[0] as `python SCRIPT ARGS` sets
# them, the directory of the package this process imported on sys.path
# (e.g. a clone found through the current directory), then the script.
_BOOT = (
    "import os, runpy, sys\n"
    "package_parent, path = sys.argv[1], sys.argv[2]\n"
    "sys.argv = sys.argv[2:]\n"
    "sys.path[0] = os.path.dirname(path)\n"
    "if package_parent not in sys.path:\n"
    "  sys.path.insert(1, package_parent)\n"
    "runpy.run_path(path, run_name='__main__')\n")


def run_script(path: str, args: list[str]) -> int:
  """Runs ``path`` as ``python path *args`` would, in a child process.

  The child is this interpreter (``sys.executable``) with this process's
  environment, stdin, stdout and stderr; it imports the same
  ``decentral_jax`` package as this process. While it runs, SIGTERM sent
  to this process is passed on to it and SIGINT is left to it (Ctrl-C
  reaches the whole foreground process group), so a script that saves a
  checkpoint on either still does.

  Returns:
    The script's exit code (0 when it ends without ``sys.exit``); 128 +
    the signal number if a signal ended it.
  """
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  child = subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-c", _BOOT, package_parent, path, *args])
  saved = {}
  if threading.current_thread() is threading.main_thread():
    forward = lambda signum, frame: child.send_signal(signum)
    saved[signal.SIGTERM] = signal.signal(signal.SIGTERM, forward)
    saved[signal.SIGINT] = signal.signal(signal.SIGINT,
                                         lambda signum, frame: None)
  try:
    code = child.wait()
  finally:
    for sig, old in saved.items():
      signal.signal(sig, signal.SIG_DFL if old is None else old)
  return 128 - code if code < 0 else code


def _error(message: str) -> int:
  print(f"error: {message}", file=sys.stderr)
  return 2


def _run_from_checkout(name: str, command: Command, args: list[str],
                       checkout: str | None) -> int:
  root = checkout or find_checkout()
  if root is None:
    return _error(
        f"`{PROG} {name}` runs {command.script} of a {PROJECT} source "
        f"checkout, and none was found beside the installed package or in "
        f"{os.getcwd()} or its parents: run it inside a clone of the "
        "repository (or install the clone with `pip install -e .`)")
  path = os.path.join(root, *command.script.split("/"))
  if not os.path.isfile(path):
    return _error(f"`{PROG} {name}` needs {path}, which this checkout "
                  f"({root}) lacks; update the checkout")
  return run_script(path, args)


def main(argv: list[str] | None = None, checkout: str | None = None) -> int:
  """Dispatches ``argv`` (default ``sys.argv[1:]``) to its command.

  Args:
    argv: ``[COMMAND, *ARGS]``, or ``["--help"]`` (also ``-h``, ``help``)
      / ``["--version"]``.
    checkout: the source checkout for the script commands (default:
      :func:`find_checkout`).

  Returns:
    The command's exit code; 0 after ``--help`` / ``--version``; 2 (one
    ``error:`` line on stderr) for a missing or unknown command or a missing
    checkout.
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
    return _error(f"unknown command {name!r}; one of: {choices} "
                  f"(see {PROG} --help)")
  if command.script is not None:
    return _run_from_checkout(name, command, args, checkout)
  return importlib.import_module(command.module).main(
      [*command.args, *args])


if __name__ == "__main__":
  sys.exit(main())
