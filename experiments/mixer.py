"""A user's own model and data, outside the package: an MLP-Mixer on
striped images stored as ArrayRecord files and read through Grain.

Nothing here is part of decentral_jax; ``experiments/own_model.py`` names
these builders in a run config (``"mixer:make_mixer"``,
``"mixer:stripes_data"``) and the runner trains them like its own tasks.

* :func:`write_stripes`: writes ``train.array_record`` and
  ``eval.array_record``: uint8 images ``[size, size]`` of stripes at one of
  ``classes`` angles plus noise, one record per example (the image bytes,
  then the label byte).
* :func:`stripes_data`: the two files as ``grain.MapDataset`` sources of
  ``(image uint8 [size, size], label int32 [])`` examples.
* :func:`make_mixer`: an MLP-Mixer (Tolstikhin et al., 2021,
  arXiv 2105.01601) in Flax Linen with its cross-entropy loss and accuracy.

Needs the ``grain`` package (``pip install -r requirements-extras.txt``).
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decentral_jax.runner import extensions

FILES = ("train.array_record", "eval.array_record")


def write_stripes(directory: str, n_train: int = 2048, n_eval: int = 256,
                  size: int = 16, classes: int = 4, seed: int = 0) -> None:
  """Writes the two ArrayRecord files into ``directory`` (made if missing).

  Image ``k`` of class ``c``: ``128 + 80 sin(2 pi (x cos a + y sin a) / 6 +
  phase) + noise`` with ``a = pi c / classes``, clipped to uint8.
  """
  # pylint: disable-next=import-outside-toplevel
  from array_record.python.array_record_module import ArrayRecordWriter
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:size, 0:size].astype(np.float64)
  for name, count in zip(FILES, (n_train, n_eval)):
    labels = rng.integers(0, classes, count)
    writer = ArrayRecordWriter(os.path.join(directory, name), "group_size:1")
    for label in labels:
      angle = np.pi * label / classes
      wave = np.sin(2 * np.pi * (x * np.cos(angle) + y * np.sin(angle)) / 6
                    + rng.uniform(0, 2 * np.pi))
      image = 128 + 80 * wave + rng.normal(0, 40, (size, size))
      pixels = np.clip(image, 0, 255).astype(np.uint8)
      writer.write(pixels.tobytes() + bytes([int(label)]))
    writer.close()


def stripes_data(path: str, size: int = 16) -> extensions.Data:
  """The striped images of ``path`` (:func:`write_stripes`) through Grain.

  Returns:
    ``extensions.Data`` whose ``train`` and ``eval`` are
    ``grain.MapDataset``\\ s of ``(uint8 [size, size], int32 [])``.
  """
  import grain  # pylint: disable=import-outside-toplevel

  def decode(record: bytes):
    raw = np.frombuffer(record, np.uint8)
    return raw[:-1].reshape(size, size), np.int32(raw[-1])

  train, evaluation = (
      grain.MapDataset.source(grain.sources.ArrayRecordDataSource(
          [os.path.join(path, name)])).map(decode) for name in FILES)
  return extensions.Data(train=train, eval=evaluation, unit="samples")


class MixerBlock(nn.Module):
  """Token mixing then channel mixing, each a residual two-layer MLP."""
  tokens_hidden: int
  channels_hidden: int

  @nn.compact
  def __call__(self, x):  # [B, tokens, channels]
    y = nn.LayerNorm()(x).swapaxes(1, 2)
    y = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(self.tokens_hidden)(y)))
    x = x + y.swapaxes(1, 2)
    y = nn.LayerNorm()(x)
    return x + nn.Dense(x.shape[2])(
        nn.gelu(nn.Dense(self.channels_hidden)(y)))


class Mixer(nn.Module):
  """MLP-Mixer for uint8 grey images ``[B, H, W]`` -> logits ``[B, C]``."""
  patch: int
  width: int
  depth: int
  classes: int

  @nn.compact
  def __call__(self, pixels):
    x = pixels.astype(jnp.float32)[..., None] / 255.0 - 0.5
    x = nn.Conv(self.width, (self.patch, self.patch),
                strides=(self.patch, self.patch))(x)
    x = x.reshape(x.shape[0], -1, self.width)
    for _ in range(self.depth):
      x = MixerBlock(2 * x.shape[1], 2 * self.width)(x)
    return nn.Dense(self.classes)(nn.LayerNorm()(x).mean(axis=1))


def _cross_entropy(logits, batch):
  labels = batch[1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  loss = -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()
  accuracy = (logits.argmax(-1) == labels).mean(dtype=jnp.float32)
  return loss, {"accuracy": accuracy}


def make_mixer(patch: int = 4, width: int = 32, depth: int = 2,
               classes: int = 4) -> extensions.Model:
  """The MLP-Mixer and its loss as an ``extensions.Model`` (Linen)."""
  return extensions.linen_model(Mixer(patch, width, depth, classes),
                                _cross_entropy)
