"""The ``decentral-jax`` command: one entry point for the project's tools.

``decentral-jax COMMAND [ARGS...]`` forwards ``ARGS`` unchanged to the tool
that already implements ``COMMAND`` (installed by ``pip install .`` from
``[project.scripts]``; also ``python -m decentral_jax.cli``):

* ``predict``, ``measure``, ``validate``: the runtime model's subcommands
  (:func:`decentral_jax.tools.runtime_model_cli.main.main`); ``predict`` and
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


_RUNTIME_MODEL = "decentral_jax.tools.runtime_model_cli.main"
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


#: Signals sent to this process that are passed on to a script's process.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Linux si_code of a signal the kernel sent, e.g. Ctrl-C / Ctrl-\ of a tty,
# which goes to the whole foreground process group.
_SI_KERNEL = 0x80
_PR_SET_PDEATHSIG = 1


def reached_child(signum: int, si_code: int, same_group: bool) -> bool:
  """Whether a signal this process got was delivered to its child as well.

  True for a key of the controlling terminal (SIGINT from Ctrl-C, SIGQUIT
  from Ctrl-\\: ``si_code`` is the kernel's ``SI_KERNEL``) when the child
  shares this process's group, since the terminal signals the whole
  foreground group; such a signal is not sent again (a second SIGINT makes
  the runner stop at once, without its checkpoint). False for everything
  else (``kill``, ``timeout``, a scheduler), which is forwarded.
  """
  return (signum in (signal.SIGINT, signal.SIGQUIT)
          and si_code == _SI_KERNEL and same_group)


def _libc_prctl():
  """libc's ``prctl`` on Linux (looked up before fork), else None."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None


def _child_setup(mask):
  """The child's ``preexec_fn``: restore ``mask``; die with this process.

  On Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` sends the child SIGTERM
  when this process (the thread that started it) dies, even by SIGKILL, so
  no script keeps training (and holding its run lock) without a parent.
  """
  prctl, parent = _libc_prctl(), os.getpid()

  def setup():
    if mask is not None:
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if prctl is not None:
      prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
      if os.getppid() != parent:  # died before prctl took effect
        os._exit(128 + signal.SIGTERM)  # pylint: disable=protected-access
  return setup


def _wait_forwarding(child, signals, mask) -> int:
  """Waits for ``child``, sending it each of ``signals`` this process gets.

  ``signals`` and SIGCHLD are blocked (since before the child started) and
  taken with ``sigtimedwait``, so none is lost or handled here; ``mask`` is
  restored on return.
  """
  waited = [*signals, signal.SIGCHLD]
  try:
    while child.poll() is None:
      info = signal.sigtimedwait(waited, 1.0)
      if info is None or info.si_signo == signal.SIGCHLD:
        continue
      try:
        same = os.getpgid(child.pid) == os.getpgrp()
      except ProcessLookupError:
        continue
      if not reached_child(info.si_signo, info.si_code, same):
        child.send_signal(info.si_signo)
    return child.returncode
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _wait_with_handlers(start, signals) -> int:
  """:func:`_wait_forwarding` without ``sigtimedwait`` (not Linux).

  Handlers are installed before the child starts; a signal that comes
  before it exists is sent once it does. SIGINT and SIGQUIT are left to the
  process group (no siginfo tells a key from ``kill`` here).
  """
  child, early, saved = None, [], {}

  def forward(signum, frame):
    del frame
    if child is None:
      early.append(signum)
    else:
      child.send_signal(signum)

  for sig in signals:
    keyboard = sig in (signal.SIGINT, signal.SIGQUIT)
    saved[sig] = signal.signal(
        sig, (lambda signum, frame: None) if keyboard else forward)
  try:
    child = start(None)
    for sig in early:
      child.send_signal(sig)
    return child.wait()
  finally:
    for sig, old in saved.items():
      signal.signal(sig, signal.SIG_DFL if old is None else old)


def run_script(path: str, args: list[str]) -> int:
  """Runs ``path`` as ``python path *args`` would, in a child process.

  The child is this interpreter (``sys.executable``) with this process's
  environment, stdin, stdout and stderr; it imports the same
  ``decentral_jax`` package as this process. While it runs, SIGTERM,
  SIGINT, SIGHUP and SIGQUIT sent to this process are passed on to it
  (once: a Ctrl-C that the terminal already sent to the child's process
  group is not sent again, :func:`reached_child`), so a script that saves a
  checkpoint on SIGTERM or SIGINT still does; forwarding is set up before
  the child starts, so no signal slips between the two. A signal this
  process ignores (SIGHUP under ``nohup``) stays ignored by both, as with
  ``python SCRIPT``. On Linux the child gets SIGTERM if this process dies
  (``PR_SET_PDEATHSIG``). Called outside the main thread, signals are not
  forwarded.

  Returns:
    The script's exit code (0 when it ends without ``sys.exit``); 128 +
    the signal number if a signal ended it.
  """
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  start = lambda mask: subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-c", _BOOT, package_parent, path, *args],
      preexec_fn=_child_setup(mask))
  signals = [s for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN]
  if threading.current_thread() is not threading.main_thread():
    code = start(None).wait()
  elif hasattr(signal, "sigtimedwait"):
    mask = signal.pthread_sigmask(signal.SIG_BLOCK,
                                  [*signals, signal.SIGCHLD])
    try:
      child = start(mask)
    except BaseException:
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)
      raise
    code = _wait_forwarding(child, signals, mask)
  else:
    code = _wait_with_handlers(start, signals)
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
