"""decentral_jax: decentralized data-parallel training in JAX.

Topologies (:mod:`decentral_jax.topology`), gossip over ``ppermute``
(:mod:`decentral_jax.gossip`), and decentralized Adam / AccumAdam as optax
transforms (:mod:`decentral_jax.optim`), after Wang et al., "From Promise to
Practice: Realizing High-performance Decentralized Training", ICLR 2025.

The experiment runner is imported on demand, one concept per module:
:mod:`~decentral_jax.config` (the config schema and loading),
:mod:`~decentral_jax.validation` (the config checks),
:mod:`~decentral_jax.builders` (schedule and optimizer from a config),
:mod:`~decentral_jax.tasks` (model, loss and data),
:mod:`~decentral_jax.step` (``TrainState`` and the per-worker steps),
:mod:`~decentral_jax.experiment` (mesh, jitted steps, evaluation) and
:mod:`~decentral_jax.train` (the loop: metrics, checkpoints, resumption).
"""

from decentral_jax import analysis
from decentral_jax import distributed
from decentral_jax import gossip
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import runtime_model
from decentral_jax import topology
from decentral_jax.optim import all_reduce_gradients
from decentral_jax.optim import decentralized
from decentral_jax.optim import decentralized_adamw
from decentral_jax.optim import gossip_mixing
from decentral_jax.optim import scale_by_accum_adam

__version__ = "0.1.0"
