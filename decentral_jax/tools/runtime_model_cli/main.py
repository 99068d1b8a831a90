"""The runtime model's command line: ``python -m decentral_jax.runtime_model``.

Subcommands (:data:`~decentral_jax.tools.runtime_model_cli.parser.
SUBCOMMANDS`): ``predict`` (ms/iteration of each method on a cluster and
workload), ``fig6`` and ``validate`` (the paper's Figure 6, Wang et al.,
ICLR 2025), ``utilisation`` (Kale et al. 2025, Table 5), ``measure`` and
``calibrate`` (measurements on this machine, through the runner). Each
subcommand's module is imported only when it runs (:data:`RUNS`), so
``predict``, ``fig6``, ``validate`` and ``utilisation`` import no JAX.
"""

from __future__ import annotations

import importlib
import sys

from decentral_jax.tools import flag_types
from decentral_jax.tools.runtime_model_cli import parser as parser_lib

_HERE = "decentral_jax.tools.runtime_model_cli"
#: Subcommand -> ``(module, function)`` called with the parsed flags.
RUNS = {
    "predict": (f"{_HERE}.predict", "run"),
    "fig6": (f"{_HERE}.paper_checks", "run_fig6"),
    "validate": (f"{_HERE}.paper_checks", "run_validate"),
    "utilisation": (f"{_HERE}.paper_checks", "run_utilisation"),
    "measure": (f"{_HERE}.measure", "run"),
    "calibrate": (f"{_HERE}.calibrate", "run"),
}


def main(argv=None, prog: str = parser_lib.PROG) -> int:
  """Runs one subcommand.

  Args:
    argv: ``[SUBCOMMAND, *FLAGS]`` (default ``sys.argv[1:]``).
    prog: the entry point's name in usage lines and errors, e.g.
      ``decentral-jax`` for the installed command.

  Returns:
    The subcommand's exit code; 2 after one ``error:`` line on stderr for
    bad input (a flag argparse refuses exits with 2 itself).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = parser_lib.build_parser(prog)
  args = parser_lib.parse(parser, argv)
  args.explicit_flags = flag_types.given_flags(parser, argv, args.command)
  module, function = RUNS[args.command]
  try:
    return getattr(importlib.import_module(module), function)(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # an output the checks let through (a full device)
    where = f" {e.filename}" if e.filename else ""
    print(f"error: cannot write{where}: {e.strerror or e}; give another "
          "output path.", file=sys.stderr)
    return 2
