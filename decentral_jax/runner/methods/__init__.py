"""One home per method family; the registry derived from them.

A family's home (``all_reduce``, ``decentralized``, ``local_updates``,
``sgp``, ``desloc``) holds, for each of its methods, how it is built from
the run config, which config fields it reads, its checks and its
runtime-model spec, and registers it (:func:`register`). Importing this
package registers the library's methods in this order: ``all_reduce``,
``decentralized``, ``local_sgd``, ``diloco``, ``decentralized_diloco``,
``streaming_diloco``, ``sgp``, ``desloc_adam``. Adding a method is its home
(or an entry in one), its tests and one docs line.
"""

from decentral_jax.runner.methods.registry import ALGORITHMS
from decentral_jax.runner.methods.registry import METHOD_FIELDS
from decentral_jax.runner.methods.registry import Method
from decentral_jax.runner.methods.registry import display_name
from decentral_jax.runner.methods.registry import lookup
from decentral_jax.runner.methods.registry import register
from decentral_jax.runner.methods.registry import unregister
from decentral_jax.runner.methods import all_reduce  # noqa: F401
from decentral_jax.runner.methods import decentralized  # noqa: F401
from decentral_jax.runner.methods import local_updates  # noqa: F401
from decentral_jax.runner.methods import sgp  # noqa: F401
from decentral_jax.runner.methods import desloc  # noqa: F401
from decentral_jax.runner.methods import gradient_tracking  # noqa: F401

__all__ = ["ALGORITHMS", "METHOD_FIELDS", "Method", "display_name", "lookup",
           "register", "unregister"]
