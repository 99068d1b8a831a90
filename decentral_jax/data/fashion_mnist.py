"""Fashion-MNIST from local IDX files, and a per-worker example sampler.

The data are never downloaded: install the Debian package
``dataset-fashion-mnist`` (files in ``/usr/share/datasets/fashion-mnist``) or
point ``data_dir`` at a directory with the four standard files
(``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``; the
uncompressed names without ``.gz`` are accepted too).

IDX format (LeCun's MNIST page): a big-endian header ``0x00 0x00 <type>
<ndim>`` (type ``0x08`` = uint8, so the magic number is 2051 for 3-D images
and 2049 for 1-D labels), then ``ndim`` big-endian uint32 sizes, then the data
in C order.

References:
  Xiao, Rasul, Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
  Benchmarking Machine Learning Algorithms", arXiv 1708.07747, 2017.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from typing import Iterable

import numpy as np

from decentral_jax.data import sharding

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"

_FILES = {
    "train_images": ("train-images-idx3-ubyte", 2051),
    "train_labels": ("train-labels-idx1-ubyte", 2049),
    "test_images": ("t10k-images-idx3-ubyte", 2051),
    "test_labels": ("t10k-labels-idx1-ubyte", 2049),
}
_INSTALL_HINT = (
    "install it with `apt-get install dataset-fashion-mnist` (Debian package, "
    "installs to /usr/share/datasets/fashion-mnist) or pass "
    "--config.data.path=DIR")


def _read_bytes(path: str) -> bytes:
  """The file's bytes, decompressed if it ends in ``.gz``.

  Raises:
    ValueError: naming the file, if it cannot be read or decompressed
      (not gzip, a corrupt or truncated stream).
  """
  try:
    if path.endswith(".gz"):
      with gzip.open(path, "rb") as f:
        return f.read()
    with open(path, "rb") as f:
      return f.read()
  except (OSError, EOFError, zlib.error) as e:
    reason = (e.strerror if isinstance(e, OSError) and e.strerror
              else " ".join(str(e).split()) or type(e).__name__)
    raise ValueError(
        f"Fashion-MNIST file {path!r} cannot be read ({reason}); it is "
        f"corrupt or truncated: replace it ({_INSTALL_HINT}).") from None


def _read_idx(path: str, magic: int) -> np.ndarray:
  """Parses one IDX file (optionally gzip-compressed) into a uint8 array.

  Raises:
    ValueError: naming the file: unreadable, not gzip where named ``.gz``,
      a wrong magic number, a truncated header or a data size that differs
      from the header's shape.
  """
  raw = _read_bytes(path)
  if len(raw) < 4:
    raise ValueError(f"{path!r} is not an IDX file (only {len(raw)} bytes).")
  got = int.from_bytes(raw[:4], "big")
  if got != magic:
    raise ValueError(f"{path!r} has IDX magic number {got}, expected {magic} "
                     f"(uint8, {magic & 0xff}-D); is it the right file?")
  ndim = magic & 0xff
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise ValueError(f"{path!r} ends inside its IDX header ({len(raw)} bytes, "
                     f"the header has {header}); the file is truncated.")
  shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
  data = np.frombuffer(raw, np.uint8, offset=header)
  if data.size != math.prod(shape):
    raise ValueError(f"{path!r} holds {data.size} values but its IDX header "
                     f"says shape {shape}; the file is truncated or corrupt.")
  return data.reshape(shape).copy()


def files(data_dir: str | os.PathLike = DEFAULT_DIR) -> dict[str, str]:
  """The IDX files :func:`load` reads: ``{"train_images": path, ...}``, each
  ``<name>.gz`` if it exists in ``data_dir``, else ``<name>``.

  Raises:
    DataNotFoundError: the directory or a file is missing (as :func:`load`).
  """
  data_dir = sharding.check_data_path(data_dir, "Fashion-MNIST directory",
                                      _INSTALL_HINT, directory=True)
  out = {}
  for key, (name, _) in _FILES.items():
    for candidate in (name + ".gz", name):
      path = os.path.join(data_dir, candidate)
      if os.path.isfile(path):
        out[key] = path
        break
    else:
      raise sharding.DataNotFoundError(
          f"Fashion-MNIST file {name}.gz (or {name}) is missing in "
          f"{data_dir!r}; {_INSTALL_HINT}.")
  return out


def load(data_dir: str | os.PathLike = DEFAULT_DIR) -> dict[str, np.ndarray]:
  """Loads the four Fashion-MNIST arrays.

  Args:
    data_dir: directory with the IDX files (``.gz`` or uncompressed).

  Returns:
    ``{"train_images": uint8 [60000, 28, 28], "train_labels": uint8 [60000],
    "test_images": uint8 [10000, 28, 28], "test_labels": uint8 [10000]}``
    (pixel values 0..255, labels 0..9; sizes as stored in the files).

  Raises:
    DataNotFoundError: (a ValueError and FileNotFoundError) the directory or a
      file is missing; the message says how to install the data.
    ValueError: a malformed file (named: unreadable, a corrupt or truncated
      gzip stream, a wrong IDX magic number, a truncated header or data) or
      image/label counts that differ.
  """
  data_dir = os.fspath(data_dir)
  out = {key: _read_idx(path, _FILES[key][1])
         for key, path in files(data_dir).items()}
  for split in ("train", "test"):
    n_img, n_lab = len(out[f"{split}_images"]), len(out[f"{split}_labels"])
    if n_img != n_lab:
      raise ValueError(f"Fashion-MNIST {split} split in {data_dir!r} has "
                       f"{n_img} images but {n_lab} labels.")
  return out


def to_float(images):
  """uint8 images [..., H, W] -> float32 [..., H, W, 1] in [0, 1]: ``x / 255``.

  NumPy arrays (or nested lists) give a NumPy array; a JAX array (also
  inside ``jax.jit``, as in the CNN task's loss) gives a JAX array.
  """
  x = images if hasattr(images, "astype") else np.asarray(images)
  return x.astype(np.float32)[..., None] / 255.0


class ArraySampler:
  """Deterministic per-worker example indices (same rule as ``LMSampler``).

  See :mod:`decentral_jax.data.sharding` for the epoch/shard rule.

  Attributes:
    n_examples: dataset size.
    n_workers: number of workers.
    local_batch: examples per worker per step ``B``.
    seed: sampling seed.
    steps_per_epoch: ``n_examples // (n_workers * local_batch)``.
  """

  def __init__(self, n_examples: int, n_workers: int, local_batch: int,
               seed: int):
    """Creates the sampler.

    Raises:
      ValueError: bad sizes or fewer examples than one global batch.
    """
    self._sharder = sharding.EpochSharder(
        n_examples, n_workers, local_batch, seed, what="n_examples",
        fix="use a smaller local_batch or fewer workers.")
    self.n_examples = self._sharder.n_items
    self.n_workers = self._sharder.n_workers
    self.local_batch = self._sharder.local_batch
    self.seed = self._sharder.seed
    self.steps_per_epoch = self._sharder.steps_per_epoch

  def batch_indices(self, step: int, workers: Iterable[int] | None = None
                    ) -> np.ndarray:
    """Example indices of ``workers`` at ``step``.

    Args:
      step: global step >= 0 (epoch = step // steps_per_epoch).
      workers: worker ids (default ``range(n_workers)``).

    Returns:
      int64 [len(workers), local_batch]; row ``i`` belongs to ``workers[i]``.

    Raises:
      ValueError: negative step or an out-of-range worker.
    """
    return self._sharder.ids(step, workers)
