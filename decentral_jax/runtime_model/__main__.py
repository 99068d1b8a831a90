"""``python -m decentral_jax.runtime_model``: runs the runtime model's command
line, :func:`decentral_jax.tools.runtime_model_cli.main.main`.

The command line sits on the tools floor above the runtime model; it is
looked up by name when run, so the NumPy model imports nothing above it.
"""

import importlib
import sys

if __name__ == "__main__":
  sys.exit(importlib.import_module(
      "decentral_jax.tools.runtime_model_cli.main").main())
