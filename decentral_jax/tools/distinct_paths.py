"""A command's output paths are neither its input files nor each other.

An output that names an input file (``measure --config my.py --out my.py``)
would replace the input by the result after the work, and two outputs
naming one file (``--json F --workload F``) would keep only the second
write. :func:`check_distinct_paths` refuses both before any work, naming
the two flags, links resolved (:func:`check_each_once`: one input file
named twice in a list flag). Output directories (a checkpoint or fixture
directory) take the paths under them: no output file may lie in one, and
none may be a file the command reads or writes. It refuses an output ending in ``.py`` (or a
link to such a file) too: a config file may import Python modules (a helper
next to it, or one it puts on ``sys.path``), none of them named on the
command line, and no command writes Python source. No JAX.
"""

from __future__ import annotations

import os


def _same_file(a: str, b: str) -> bool:
  """True when ``a`` and ``b`` are one file: equal after
  :func:`os.path.realpath` (links and ``..`` resolved, so for files that do
  not exist yet too), or :func:`os.path.samefile` (hard links)."""
  if os.path.realpath(a) == os.path.realpath(b):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:  # one of them does not exist yet: not the same file
    return False


def config_file(config: str | None, presets=()) -> str | None:
  """The file a ``--config FILE.py[:ARG]`` value reads, or None for a
  preset name in ``presets`` or a path that is not an existing file."""
  if not config or config in presets:
    return None
  path = str(config).split(":", 1)[0]
  return path if os.path.isfile(path) else None


def _under(path: str, directory: str) -> bool:
  """True when ``path`` is ``directory`` or lies under it, both resolved
  with :func:`os.path.realpath` (so for paths that do not exist yet too)."""
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return path == directory or path.startswith(directory.rstrip(os.sep)
                                              + os.sep)


def check_distinct_paths(outputs, inputs=(), dirs=()) -> None:
  """Refuses an output path equal to an input file or to another output.

  Args:
    outputs: ``(flag, path)`` pairs of the files the command writes; a
      None or empty path (the flag not given) is skipped.
    inputs: ``(flag, path)`` pairs of the files it reads, the same way.
    dirs: ``(flag, path)`` pairs of the directories it creates and writes
      (``--checkpoint-dir``), the same way: each output file equal to one
      or under it, and each input file equal to one, is refused.

  An output ending in ``.py``, or a symbolic link whose target
  (:func:`os.path.realpath`) does, is refused as well (after the clashes):
  it may be a module the ``--config`` file imports, which is not among
  ``inputs``, and no output is Python source. Clashes compare resolved
  paths too, so a link to an input is that input.

  Raises:
    ValueError: ``--out 'my.py' is the file --config reads; give --out
      another path`` (or ``... is also --json's file``), the first clash
      in the order given; ``--json 'D/x' lies in the directory 'D' of
      --checkpoint-dir ...`` or ``--checkpoint-dir 'F' is the file --config
      reads ...`` (a directory clash, checked first); or ``--out
      'helper.py' ends in .py ...``.
  """
  outs = [(f, p) for f, p in outputs if p]
  ins = [(f, p) for f, p in inputs if p]
  _check_dirs([(f, p) for f, p in dirs if p], outs, ins)
  for i, (flag, path) in enumerate(outs):
    for in_flag, in_path in ins:
      if _same_file(path, in_path):
        raise ValueError(f"{flag} {path!r} is the file {in_flag} reads "
                         f"({in_path!r}): writing it would replace that "
                         f"input; give {flag} another path.")
    for other_flag, other in outs[:i]:
      if _same_file(path, other):
        raise ValueError(f"{flag} {path!r} is also {other_flag}'s file "
                         f"({other!r}): the second write would replace "
                         f"the first; give {flag} another path.")
  for flag, path in outs:
    target = os.path.realpath(path)  # a link is written through
    if str(path).endswith(".py") or target.endswith(".py"):
      what = (f"{flag} {path!r} ends in .py" if str(path).endswith(".py")
              else f"{flag} {path!r} is a link to {target!r}, which ends "
              "in .py")
      raise ValueError(
          f"{what}: it may be a Python module the config file imports, "
          "which the output would replace (no output of this command is "
          f"Python source); give {flag} a path not ending in .py.")


def _check_dirs(dirs, outs, ins) -> None:
  """The directory clashes of :func:`check_distinct_paths` (ValueError)."""
  for dir_flag, directory in dirs:
    for flag, path in outs:
      if _under(path, directory):
        raise ValueError(
            f"{flag} {path!r} lies in the directory {directory!r} of "
            f"{dir_flag}, which the command creates and fills; give {flag} "
            "a path outside it.")
    for in_flag, in_path in ins:
      if _same_file(directory, in_path):
        raise ValueError(
            f"{dir_flag} {directory!r} is the file {in_flag} reads or "
            f"writes ({in_path!r}): the directory would take its place; "
            f"give {dir_flag} another path.")


def check_each_once(flag: str, paths) -> None:
  """Refuses a file named twice among the inputs ``paths`` of a list flag
  ``flag`` (``--render F ./F``): read twice, its rows would print twice.
  One file is as in :func:`check_distinct_paths` (links, ``..`` and hard
  links resolved).

  Raises:
    ValueError: ``--render: entry 2 './F' is the file of entry 1 'F';
      give each file once.``
  """
  paths = list(paths)
  for k, path in enumerate(paths):
    for j, other in enumerate(paths[:k]):
      if _same_file(path, other):
        raise ValueError(f"{flag}: entry {k + 1} {path!r} is the file of "
                         f"entry {j + 1} {other!r}; give each file once.")


def data_inputs(path, flag: str) -> list:
  """The ``(flag, file)`` pairs of a config's ``data.path`` (``path``;
  None or empty: none): the file itself, or for a directory (token bins,
  an image set) the files directly in it, each one an input a command's
  output may not replace."""
  if not path:
    return []
  path = str(path)
  if not os.path.isdir(path):
    return [(flag, path)]
  return [(flag, os.path.join(path, name)) for name in sorted(os.listdir(path))
          if os.path.isfile(os.path.join(path, name))]
