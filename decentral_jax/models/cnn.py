"""A small convolutional classifier for 28x28 grey-scale images (Fashion-MNIST).

``conv(3x3, 32) -> ReLU -> avg-pool 2x2 -> conv(3x3, 64) -> ReLU -> avg-pool
2x2 -> dense(128) -> ReLU -> dense(num_classes)``. There is no BatchNorm, so a
worker's whole model state is its parameter pytree (nothing else to gossip or
keep consistent across workers).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from decentral_jax import checks

PyTree = Any


class CNN(nn.Module):
  """Two-conv-layer CNN classifier.

  Attributes:
    num_classes: number of output classes.
    features: output channels of the two 3x3 convolutions.
    dense: width of the hidden dense layer.
  """
  num_classes: int = 10
  features: Sequence[int] = (32, 64)
  dense: int = 128

  def __post_init__(self):
    """Checks the attributes.

    Raises:
      ValueError: ``num_classes`` or ``dense`` not an int >= 1,
        ``features`` not a sequence of ints >= 1.
    """
    checks.check_int("CNN.num_classes", self.num_classes, minimum=1)
    checks.check_int("CNN.dense", self.dense, minimum=1)
    if isinstance(self.features, (str, bytes)) or not hasattr(
        self.features, "__len__"):
      raise ValueError(f"CNN.features must be a sequence of ints >= 1, got "
                       f"{self.features!r}.")
    for k, f in enumerate(self.features):
      checks.check_int(f"CNN.features[{k}]", f, minimum=1)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Class logits.

    Args:
      x: images float [B, H, W, 1] (or [B, H, W]) with values in [0, 1];
        H = W = 28 for Fashion-MNIST.

    Returns:
      Logits float32 [B, num_classes].

    Raises:
      ValueError: integer images (convert uint8 pixels with ``x / 255``, see
        :func:`decentral_jax.data.fashion_mnist.to_float`) or a wrong rank.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"CNN input must be float images in [0, 1], got dtype "
                       f"{x.dtype}; convert uint8 pixels with x / 255.")
    if x.ndim == 3:
      x = x[..., None]
    if x.ndim != 4:
      raise ValueError(f"CNN input must be [B, H, W, C] or [B, H, W], got "
                       f"shape {x.shape}.")
    for f in self.features:
      x = nn.Conv(f, kernel_size=(3, 3))(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.dense)(x))
    return nn.Dense(self.num_classes)(x).astype(jnp.float32)


def init_params(model: CNN, rng: jax.Array,
                image_shape: tuple[int, int, int] = (28, 28, 1)) -> PyTree:
  """Initial parameters of ``model`` for images of shape ``image_shape``.

  Args:
    model: the :class:`CNN`.
    rng: a JAX PRNG key.
    image_shape: (H, W, C) of one image; the first dense layer's size depends
      on it.

  Returns:
    The ``"params"`` collection (float32 pytree).

  Raises:
    ValueError: ``model`` not a :class:`CNN`, ``image_shape`` not three
      ints >= 1.
  """
  if not isinstance(model, CNN):
    raise ValueError(f"model must be a CNN, got {type(model).__name__}.")
  if not isinstance(image_shape, (tuple, list)) or len(image_shape) != 3:
    raise ValueError(f"image_shape must be (H, W, C), three ints >= 1, got "
                     f"{image_shape!r}.")
  image_shape = tuple(checks.check_int(f"image_shape[{k}]", v, minimum=1)
                      for k, v in enumerate(image_shape))
  dummy = jnp.zeros((1, *image_shape), jnp.float32)
  return jax.jit(model.init)(rng, dummy)["params"]
