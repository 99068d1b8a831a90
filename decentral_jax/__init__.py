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
  NumPy only), both imported on first use.

After Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing
High-performance Decentralized Training", ICLR 2025 (arXiv 2410.11998).

``import decentral_jax`` loads this library only: the experiment runner
(:mod:`decentral_jax.runner`: config, tasks, Flax models, the training loop,
checkpoints) is imported explicitly, ``from decentral_jax.runner import ...``.
"""

import importlib

from decentral_jax import comm
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.comm import gossip
from decentral_jax.optim import all_reduce_gradients
from decentral_jax.optim import decentralized
from decentral_jax.optim import decentralized_adamw
from decentral_jax.optim import gossip_mixing
from decentral_jax.optim import scale_by_accum_adam

__version__ = "0.1.0"

_LAZY = ("analysis", "runtime_model")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"decentral_jax.{name}")
  raise AttributeError(f"module 'decentral_jax' has no attribute {name!r}")
