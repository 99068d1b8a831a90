"""decentral_jax: decentralized data-parallel training in JAX.

The library, bottom up (each layer imports only from the layers below it):

- :mod:`decentral_jax.topology`: periodic schedules of mixing matrices W_k
  (one-peer exponential graph, AER, ring, torus, ...);
- :mod:`decentral_jax.comm`: collectives over the worker axis and gossip
  (``ppermute`` rounds of W_k);
- :mod:`decentral_jax.optim`: decentralized optax transforms (DAdam,
  AccumAdamW, D-SGD), local-update methods (Local SGD, DiLoCo, Streaming
  DiLoCo) and SGP; :mod:`decentral_jax.parallel`: worker meshes and
  per-worker ``shard_map``;
- beside them, :mod:`decentral_jax.analysis` (collectives and bytes of a
  compiled step) and :mod:`decentral_jax.runtime_model` (alpha-beta costs,
  NumPy only).

Every subpackage is imported on first use (``decentral_jax.comm``,
``decentral_jax.optim``, ...), so the NumPy-only runtime model runs without
importing JAX.

After Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing
High-performance Decentralized Training", ICLR 2025 (arXiv 2410.11998).

``import decentral_jax`` loads this library only: the experiment runner
(:mod:`decentral_jax.runner`: config, tasks, Flax models, the training loop,
checkpoints) is imported explicitly, ``from decentral_jax.runner import ...``.
"""

import importlib

__version__ = "0.1.0"

# Subpackages and the names re-exported here load on first use (PEP 562), so
# that ``python -m decentral_jax.runtime_model`` (NumPy only) never imports
# JAX.
_SUBPACKAGES = ("analysis", "comm", "optim", "parallel", "runtime_model",
                "topology")
_EXPORTS = {
    "all_reduce_gradients": "decentral_jax.optim",
    "decentralized": "decentral_jax.optim",
    "decentralized_adamw": "decentral_jax.optim",
    "gossip_mixing": "decentral_jax.optim",
    "scale_by_accum_adam": "decentral_jax.optim",
}
__all__ = sorted(_SUBPACKAGES + tuple(_EXPORTS))


def __getattr__(name):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"decentral_jax.{name}")
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'decentral_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
