"""Host-side (NumPy) datasets and deterministic per-worker samplers.

* :mod:`decentral_jax.data.text`: byte-level pydoc corpus, text files,
  nanoGPT token bins; :class:`~decentral_jax.data.text.LMSampler`.
* :mod:`decentral_jax.data.fashion_mnist`: IDX loader and
  :class:`~decentral_jax.data.fashion_mnist.ArraySampler`.
* :mod:`decentral_jax.data.sharding`: the shared per-epoch worker sharding.
"""

from __future__ import annotations

from decentral_jax.data import fashion_mnist
from decentral_jax.data import sharding
from decentral_jax.data import text
from decentral_jax.data.fashion_mnist import ArraySampler
from decentral_jax.data.sharding import DataNotFoundError
from decentral_jax.data.text import LMSampler
from decentral_jax.data.text import eval_batches
