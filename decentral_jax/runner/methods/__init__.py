"""One home per method family; the registry derived from them.

A family's home (``all_reduce``, ``decentralized``, ``local_updates``,
``sgp``, ``desloc`` ...) holds, for each of its methods, how it is built
from the run config, which config fields it reads and which it declares
(``Method.config_fields``), its checks, its runtime-model spec and its
arms in the main job, and registers it (:func:`register`). Importing this
package registers the library's methods: first ``all_reduce``,
``decentralized``, ``local_sgd``, ``diloco``, ``decentralized_diloco``,
``streaming_diloco``, ``sgp``, ``desloc_adam`` (:data:`FIRST_HOMES`), then
every other module of this folder in name order. Adding a method is a new
home in this folder, its tests and one docs line.
"""

import importlib
import pkgutil

from decentral_jax.runner.methods.registry import ALGORITHMS
from decentral_jax.runner.methods.registry import METHOD_FIELDS
from decentral_jax.runner.methods.registry import Arm
from decentral_jax.runner.methods.registry import ConfigField
from decentral_jax.runner.methods.registry import Method
from decentral_jax.runner.methods.registry import add_declared_fields
from decentral_jax.runner.methods.registry import declared_fields
from decentral_jax.runner.methods.registry import display_name
from decentral_jax.runner.methods.registry import lookup
from decentral_jax.runner.methods.registry import method_fields
from decentral_jax.runner.methods.registry import register
from decentral_jax.runner.methods.registry import unregister

#: Homes imported first, in this order (the order of the method tables).
FIRST_HOMES = ("all_reduce", "decentralized", "local_updates", "sgp",
               "desloc")
# Modules of this folder that are not homes.
_NOT_HOMES = ("registry", "parts")


def _import_homes() -> None:
  later = sorted(m.name for m in pkgutil.iter_modules(__path__)
                 if m.name not in FIRST_HOMES + _NOT_HOMES)
  for name in (*FIRST_HOMES, *later):
    importlib.import_module(f"{__name__}.{name}")


_import_homes()

__all__ = ["ALGORITHMS", "FIRST_HOMES", "METHOD_FIELDS", "Arm", "ConfigField",
           "Method", "add_declared_fields", "declared_fields", "display_name",
           "lookup", "method_fields", "register", "unregister"]
