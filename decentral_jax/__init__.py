"""decentral_jax: decentralized data-parallel training in JAX.

Topologies (:mod:`decentral_jax.topology`), gossip over ``ppermute``
(:mod:`decentral_jax.gossip`), and decentralized Adam / AccumAdam as optax
transforms (:mod:`decentral_jax.optim`), after Wang et al., "From Promise to
Practice: Realizing High-performance Decentralized Training", ICLR 2025.

The experiment runner (Flax models, data, Orbax checkpoints) lives in
:mod:`decentral_jax.train` and is imported on demand.
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
