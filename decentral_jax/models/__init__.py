"""Models (Flax linen, parameters as plain pytrees) and their losses.

* :mod:`decentral_jax.models.gpt`: nanoGPT-style causal language model.
* :mod:`decentral_jax.models.cnn`: small CNN for Fashion-MNIST.
* :mod:`decentral_jax.models.losses`: ``lm_loss`` and
  ``classification_loss``.
"""

from decentral_jax.models.cnn import CNN
from decentral_jax.models.gpt import GPT, GPTConfig
from decentral_jax.models.losses import classification_loss, lm_loss

__all__ = ["CNN", "GPT", "GPTConfig", "classification_loss", "lm_loss"]
