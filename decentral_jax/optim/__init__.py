"""Optimizers: decentralized optax transforms and local-update methods.

- :mod:`~decentral_jax.optim.transforms`: ``decentralized``,
  ``decentralized_adamw`` (DAdam, AccumAdamW), ``gossip_mixing``,
  ``all_reduce_gradients``; re-exported here.
- :mod:`~decentral_jax.optim.accum_adam`: ``scale_by_accum_adam``.
- :mod:`~decentral_jax.optim.local_updates`: Local SGD, DiLoCo,
  decentralized and Streaming DiLoCo.
- :mod:`~decentral_jax.optim.outer_overlap`: DiLoCo's delayed and eager
  outer steps and the trickled reduction.
- :mod:`~decentral_jax.optim.elastic`: DiLoCo and Local SGD over slow and
  failing workers (quorum, rollback or proceed, rejoin).
- :mod:`~decentral_jax.optim.push_sum`: SGP (push-sum gossip).
- :mod:`~decentral_jax.optim.arguments` and
  :mod:`~decentral_jax.optim.precision`: the transforms' shared argument
  checks and compute dtypes.

Imports :mod:`decentral_jax.comm` and :mod:`decentral_jax.topology`.
"""

from decentral_jax.optim.transforms import *  # noqa: F401,F403
from decentral_jax.optim.transforms import __all__  # noqa: F401
