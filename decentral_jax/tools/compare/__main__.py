"""``python -m decentral_jax.tools.compare``: the main job (see the package)."""

import sys

from decentral_jax.tools.compare import command

if __name__ == "__main__":
  sys.exit(command.main(sys.argv[1:]))
