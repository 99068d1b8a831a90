"""``python -m decentral_jax.runtime_model``: see :mod:`decentral_jax.runtime_model.cli.main`."""

import sys

from decentral_jax.runtime_model.cli import main

if __name__ == "__main__":
  sys.exit(main.main())
