"""The package's layering and sizes, read from every module's source (AST).

Bottom up: ``checks`` (and the shared facts ``layout_modes``, ``scopes``
and ``wire_format``) <- ``topology`` <- ``comm`` <- {``optim``,
``parallel``} <- ``runner`` <- ``tools``; ``analysis``, ``models`` and
``data`` sit beside the runner's inputs; the runtime model (NumPy only)
uses ``topology`` and sits below the runner and the tools. ``tools`` (the
command lines and the main job) is the top floor and may import every
part; nothing imports it. Every function has at most
:data:`MAX_FUNCTION_LINES` code lines and every module at most
:data:`MAX_MODULE_LINES` lines, but for the few listed by name.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "decentral_jax")

_LIBRARY = {"checks", "layout_modes", "scopes", "wire_format", "topology",
            "comm", "optim", "parallel", "analysis", "models", "data",
            "records"}
# part -> the other parts it may import (a part may always import itself).
ALLOWED = {
    "checks": set(),
    "scopes": set(),
    "wire_format": set(),
    "layout_modes": set(),
    # The one validating reader of the files a run keeps (no JAX).
    "records": {"checks"},
    "topology": {"checks"},
    "comm": {"checks", "records", "scopes", "topology", "wire_format"},
    "optim": {"checks", "topology", "comm"},
    "parallel": {"checks", "layout_modes", "topology", "comm"},
    "analysis": {"checks", "scopes"},
    "models": {"checks"},
    "data": {"checks"},
    # Display names of methods: one table for every command (NumPy only).
    "method_names": {"checks", "topology"},
    "runtime_model": {"checks", "layout_modes", "topology", "method_names",
                      "records", "wire_format"},
    "runner": _LIBRARY | {"method_names"},
    # The top floor: the command lines, the main job, GPU-target compiles.
    "tools": _LIBRARY | {"method_names", "runtime_model", "runner"},
    "__init__": {"topology", "comm", "optim", "parallel"},
}

#: Code lines (not blank, not comments, not the docstring) of a function.
MAX_FUNCTION_LINES = 60
#: Lines of a module.
MAX_MODULE_LINES = 600
# Functions over MAX_FUNCTION_LINES, as "path::name". A declarative table
# may stay; the others are known offenders, to be split and removed here.
LONG_FUNCTIONS: set[str] = set()
# Modules over MAX_MODULE_LINES: known offenders, to be split.
LONG_MODULES: set[str] = set()


def _part(dotted: str) -> str:
  """'decentral_jax.runner.config' -> 'runner'; the top module's face is
  '__init__'."""
  parts = dotted.split(".")[1:]
  return parts[0] if parts else "__init__"


def _modules():
  for dirpath, _, files in os.walk(PKG):
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        yield rel.removesuffix(".__init__"), path


def _imports(path: str, module: str):
  """(line, imported dotted name, [names]) of every decentral_jax import."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("decentral_jax"):
          yield node.lineno, a.name, []
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) -
                                          node.level + 1] + [base]).rstrip(".")
      if base.startswith("decentral_jax"):
        names = [a.name for a in node.names]
        if base == "decentral_jax":  # from decentral_jax import topology
          for n in names:
            yield node.lineno, f"decentral_jax.{n}", []
        else:
          yield node.lineno, base, names


def test_the_modules_exist():
  mods = dict(_modules())
  assert len(mods) > 40
  for part in ALLOWED:
    if part != "__init__":
      assert any(_part(m) == part for m in mods), part


def test_every_import_points_down_the_layers():
  bad = []
  for module, path in _modules():
    src = _part(module)
    for line, target, _ in _imports(path, module):
      dst = _part(target)
      if dst != src and dst not in ALLOWED[src]:
        bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {src} -> {dst} "
                   f"({target})")
  assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_module_boundary():
  bad = []
  for module, path in _modules():
    tree = ast.parse(open(path, encoding="utf-8").read())
    aliases = set()
    for line, target, names in _imports(path, module):
      bad += [f"{os.path.relpath(path, ROOT)}:{line}: imports {target}.{n}"
              for n in names if n.startswith("_") and n != "__all__"]
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (
          node.module or "").startswith("decentral_jax"):
        aliases |= {a.asname or a.name for a in node.names}
      elif isinstance(node, ast.Import):
        aliases |= {(a.asname or a.name).split(".")[0] for a in node.names
                    if a.name.startswith("decentral_jax")}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__")
          and isinstance(node.value, ast.Name) and node.value.id in aliases):
        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: "
                   f"{node.value.id}.{node.attr}")
  assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _code_lines(lines: list[str], node) -> int:
  """Lines of ``node`` that are not blank, a comment or its docstring."""
  doc = set()
  first = node.body[0] if node.body else None
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    doc = set(range(first.lineno, first.end_lineno + 1))
  return sum(1 for i in range(node.lineno, node.end_lineno + 1)
             if i not in doc and lines[i - 1].strip()
             and not lines[i - 1].strip().startswith("#"))


def test_functions_and_modules_stay_short():
  long_functions, long_modules, still_long = [], [], set()
  for _, path in _modules():
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    with open(path, encoding="utf-8") as f:
      text = f.read()
    lines = text.splitlines()
    if len(lines) > MAX_MODULE_LINES:
      still_long.add(rel)
      if rel not in LONG_MODULES:
        long_modules.append(f"{rel}: {len(lines)} lines")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _code_lines(lines, node)
        if n > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in (
            LONG_FUNCTIONS):
          long_functions.append(f"{rel}:{node.lineno}: {node.name}, {n} "
                                "code lines")
  assert not long_functions, (
      f"functions over {MAX_FUNCTION_LINES} code lines (split them):\n"
      + "\n".join(long_functions))
  assert not long_modules, (
      f"modules over {MAX_MODULE_LINES} lines (split them by concept):\n"
      + "\n".join(long_modules))
  # A known offender that was split leaves the list, so it cannot regrow.
  assert LONG_MODULES <= still_long, (
      f"no longer over {MAX_MODULE_LINES} lines, remove from LONG_MODULES: "
      f"{sorted(LONG_MODULES - still_long)}")


def test_no_module_defines_a_top_level_name_twice():
  """A second ``def`` of a name silently replaces the first for every
  caller (a resume rule once shadowed compare's row rule of the same
  name): each module-level function or class name appears once."""
  twice = []
  for _, path in _modules():
    with open(path, encoding="utf-8") as f:
      body = ast.parse(f.read()).body
    names = [n.name for n in body if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    twice += [f"{os.path.relpath(path, ROOT)}: {n}"
              for n in sorted({n for n in names if names.count(n) > 1})]
  assert not twice, "defined twice:\n" + "\n".join(twice)


def _python(code: str) -> subprocess.CompletedProcess:
  """Runs ``python -c code`` in a fresh interpreter at the repository root."""
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_import_decentral_jax_loads_the_library_only():
  code = ("import sys, decentral_jax; "
          "decentral_jax.comm, decentral_jax.optim, decentral_jax.parallel; "
          "print(sorted(m for m in sys.modules if m.startswith("
          "('decentral_jax', 'flax', 'orbax', 'ml_collections', 'scipy', "
          "'matplotlib'))))")
  out = _python(code)
  loaded = eval(out.stdout)  # pylint: disable=eval-used
  ours = {m for m in loaded if m.startswith("decentral_jax")}
  assert {"decentral_jax.topology", "decentral_jax.comm.gossip",
          "decentral_jax.optim", "decentral_jax.parallel"} <= ours
  for prefix in ("decentral_jax.runner", "decentral_jax.runtime_model",
                 "decentral_jax.analysis", "decentral_jax.models",
                 "decentral_jax.data", "flax", "orbax", "ml_collections",
                 "matplotlib"):
    assert not any(m == prefix or m.startswith(prefix + ".")
                   for m in loaded), (prefix, sorted(loaded))


def test_the_runtime_model_command_line_never_imports_jax():
  # The runtime model is NumPy only: pricing a cluster needs no JAX (and
  # none of the log lines a CUDA plugin prints when JAX is imported).
  code = ("import sys, runpy; sys.argv = ['predict', '--help']\n"
          "try:\n  runpy.run_module('decentral_jax.runtime_model', "
          "run_name='__main__')\nexcept SystemExit:\n  pass\n"
          "print(sorted(m for m in sys.modules "
          "if m.split('.')[0] in ('jax', 'jaxlib', 'optax', 'flax')))")
  out = _python(code)
  assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_a_bare_import_loads_nothing_but_names_every_layer():
  code = ("import sys, decentral_jax; print(sorted(m for m in sys.modules "
          "if m.split('.')[0] in ('decentral_jax', 'jax')), "
          "sorted(dir(decentral_jax)))")
  out = _python(code)
  assert out.stdout.startswith("['decentral_jax'] "), out.stdout
  for name in ("comm", "optim", "parallel", "topology"):
    assert f"'{name}'" in out.stdout, (name, out.stdout)


@pytest.mark.parametrize("name", ["analysis", "runtime_model"])
def test_analysis_and_the_runtime_model_load_on_first_use(name):
  code = (f"import sys, decentral_jax; m = decentral_jax.{name}; "
          f"print(m.__name__, 'decentral_jax.runner' in sys.modules)")
  out = _python(code)
  assert out.stdout.split() == [f"decentral_jax.{name}", "False"]


def test_test_modules_share_helpers_without_importing_each_other():
  tests = os.path.join(ROOT, "tests")
  crossing, found = [], []
  for dirpath, dirs, files in os.walk(tests):
    dirs[:] = sorted(d for d in dirs if d != "fixtures")
    found += [os.path.relpath(os.path.join(dirpath, f), tests)
              for f in sorted(files) if f.endswith(".py")]
  # One folder per subpackage, plus the shared files at the top.
  assert {f.split(os.sep)[0] for f in found if os.sep in f} >= {
      "topology", "comm", "optim", "parallel", "runtime_model", "runner",
      "tools"}
  for f in found:
    tree = ast.parse(open(os.path.join(tests, f), encoding="utf-8").read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom)
               else [])
      crossing += [f"tests/{f}:{node.lineno}: {n}" for n in names
                   if n.split(".")[0].startswith("test_")]
  assert not crossing, "import shared code from tests/helpers.py:\n" + \
      "\n".join(crossing)
