"""Host-side (NumPy) datasets and deterministic per-worker samplers.

* :mod:`decentral_jax.data.text`: byte-level pydoc corpus, text files,
  nanoGPT token bins; :class:`~decentral_jax.data.text.LMSampler`.
* :mod:`decentral_jax.data.fashion_mnist`: IDX loader and
  :class:`~decentral_jax.data.fashion_mnist.ArraySampler`.
* :mod:`decentral_jax.data.sharding`: the shared per-epoch worker sharding.
"""

from decentral_jax.data.fashion_mnist import ArraySampler
from decentral_jax.data.sharding import DataNotFoundError, EpochSharder
from decentral_jax.data.text import LMSampler, eval_batches

__all__ = ["ArraySampler", "DataNotFoundError", "EpochSharder", "LMSampler",
           "eval_batches"]
