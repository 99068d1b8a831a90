"""Tests for decentral_jax.data: corpora, token bins, samplers, Fashion-MNIST.

All inputs are small arrays, files written to ``tmp_path`` or the committed
Fashion-MNIST subset (``tests/fixtures/fashion_mnist``); expected values come
from slicing the raw arrays or from a NumPy statement of the sharding rule,
never from the code under test.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import os
import struct

import numpy as np
import pytest

from conftest import FIXTURES
from decentral_jax import data
from decentral_jax.data import fashion_mnist
from decentral_jax.data import text


# ---------------------------------------------------------------------------
# Corpora.
# ---------------------------------------------------------------------------


def test_pydoc_corpus_is_real_english_text():
  corpus = text.pydoc_corpus()
  assert isinstance(corpus, bytes)
  assert len(corpus) > 100_000
  words = corpus.decode("utf-8").split()
  assert words.count("the") > 1000
  assert corpus == text.pydoc_corpus()  # deterministic


def test_byte_splits_take_the_tail_for_validation():
  raw = bytes(range(256)) * 4
  train, val = text.byte_splits(raw, val_fraction=0.25)
  assert train.dtype == np.uint8 and val.dtype == np.uint8
  assert len(val) == 256 and len(train) == 768
  assert bytes(train) == raw[:768] and bytes(val) == raw[768:]
  with pytest.raises(ValueError, match="val_fraction"):
    text.byte_splits(raw, val_fraction=1.0)
  with pytest.raises(ValueError, match="empty"):
    text.byte_splits(b"abc", val_fraction=0.1)


def test_load_text_file(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_bytes("héllo wörld\n".encode("utf-8"))
  assert text.load_text_file(path) == "héllo wörld\n".encode("utf-8")
  with pytest.raises(ValueError, match="missing.txt"):
    text.load_text_file(tmp_path / "missing.txt")


def test_load_token_bins_memmaps(tmp_path):
  rng = np.random.default_rng(0)
  train = rng.integers(0, 50257, 5000).astype(np.uint16)
  val = rng.integers(0, 50257, 700).astype(np.uint16)
  train.tofile(tmp_path / "train.bin")
  val.tofile(tmp_path / "val.bin")
  got_train, got_val = text.load_token_bins(tmp_path)
  assert isinstance(got_train, np.memmap) and isinstance(got_val, np.memmap)
  assert got_train.dtype == np.uint16 and got_val.dtype == np.uint16
  np.testing.assert_array_equal(got_train, train)
  np.testing.assert_array_equal(got_val, val)
  # The sampler reads uint16 memmaps directly.
  sampler = text.LMSampler(got_train, context_len=32, n_workers=2,
                           local_batch=3, seed=0)
  inputs, targets = sampler.batch(0)
  k = sampler.window_ids(0, 1)[2]
  np.testing.assert_array_equal(inputs[1, 2], train[k * 32:k * 32 + 32])
  np.testing.assert_array_equal(targets[1, 2], train[k * 32 + 1:k * 32 + 33])
  assert inputs.dtype == np.int32 and inputs.max() > 255


def test_load_token_bins_missing_file(tmp_path):
  np.zeros(10, np.uint16).tofile(tmp_path / "train.bin")
  with pytest.raises(ValueError, match=r"val\.bin.*prepare\.py") as err:
    text.load_token_bins(tmp_path)
  assert isinstance(err.value, FileNotFoundError)


# ---------------------------------------------------------------------------
# LMSampler.
# ---------------------------------------------------------------------------

T, N_WORKERS, B = 8, 4, 3


@pytest.fixture(scope="module")
def tokens():
  # 1000 bytes -> (1000 - 1) // 8 = 124 windows; 124 // 12 = 10 steps/epoch.
  return np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint8)


def _reference_ids(seed, n_windows, step, worker):
  """The documented rule, restated in NumPy."""
  spe = n_windows // (N_WORKERS * B)
  epoch, s = divmod(step, spe)
  perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])
                               ).permutation(n_windows)
  shard = perm[worker * spe * B:(worker + 1) * spe * B]
  return shard[s * B:(s + 1) * B]


def test_lm_sampler_epoch_shards_disjoint_and_cover(tokens):
  sampler = text.LMSampler(tokens, T, N_WORKERS, B, seed=7)
  assert sampler.n_windows == 124 and sampler.steps_per_epoch == 10
  spe = sampler.steps_per_epoch
  for epoch in range(2):
    per_worker = [
        np.concatenate([sampler.window_ids(epoch * spe + s, w)
                        for s in range(spe)]) for w in range(N_WORKERS)]
    for a, b in itertools.combinations(per_worker, 2):
      assert not set(a.tolist()) & set(b.tolist())
    everything = np.concatenate(per_worker)
    assert len(np.unique(everything)) == spe * N_WORKERS * B == 120
    assert everything.min() >= 0 and everything.max() < 124
    for s in (0, 3, spe - 1):
      for w in range(N_WORKERS):
        np.testing.assert_array_equal(
            sampler.window_ids(epoch * spe + s, w),
            _reference_ids(7, 124, epoch * spe + s, w))


def test_lm_sampler_deterministic_and_epochs_differ(tokens):
  a = text.LMSampler(tokens, T, N_WORKERS, B, seed=1)
  b = text.LMSampler(tokens, T, N_WORKERS, B, seed=1)
  c = text.LMSampler(tokens, T, N_WORKERS, B, seed=2)
  for step in (0, 5, 37):
    np.testing.assert_array_equal(a.batch(step)[0], b.batch(step)[0])
    np.testing.assert_array_equal(a.window_ids(step, 3), b.window_ids(step, 3))
  assert not np.array_equal(a.window_ids(0, 0), c.window_ids(0, 0))
  spe = a.steps_per_epoch
  assert not np.array_equal(a.batch(2)[0], a.batch(2 + spe)[0])
  assert not np.array_equal(a.batch(0)[0], a.batch(1)[0])


def test_lm_sampler_worker_subset_and_shifted_targets(tokens):
  n = 6
  sampler = text.LMSampler(tokens, T, n, 2, seed=3)
  full_x, full_y = sampler.batch(13)
  assert full_x.shape == full_y.shape == (n, 2, T)
  assert full_x.dtype == np.int32 and full_y.dtype == np.int32
  sub_x, sub_y = sampler.batch(13, workers=[2, 5])
  assert sub_x.shape == (2, 2, T)
  np.testing.assert_array_equal(sub_x, full_x[[2, 5]])
  np.testing.assert_array_equal(sub_y, full_y[[2, 5]])
  for w in range(n):
    for i, k in enumerate(sampler.window_ids(13, w)):
      np.testing.assert_array_equal(full_x[w, i], tokens[k * T:k * T + T])
      np.testing.assert_array_equal(full_y[w, i],
                                    tokens[k * T + 1:k * T + T + 1])


def test_lm_sampler_errors(tokens):
  with pytest.raises(ValueError, match=r"1000 tokens.*context_len=64"):
    text.LMSampler(tokens, context_len=64, n_workers=4, local_batch=4, seed=0)
  sampler = text.LMSampler(tokens, T, N_WORKERS, B, seed=0)
  with pytest.raises(ValueError, match="workers"):
    sampler.batch(0, workers=[4])
  with pytest.raises(ValueError, match="step"):
    sampler.batch(-1)
  with pytest.raises(ValueError, match="seed"):
    text.LMSampler(tokens, T, N_WORKERS, B, seed=-1)


def test_eval_batches(tokens):
  batches = text.eval_batches(tokens, context_len=T, batch=4, n_batches=3)
  assert len(batches) == 3
  starts = []
  for x, y in batches:
    assert x.shape == y.shape == (4, T) and x.dtype == np.int32
    for row_x, row_y in zip(x, y):
      # Find the window in the raw array and check the one-token shift.
      hits = [s for s in range(len(tokens) - T)
              if np.array_equal(tokens[s:s + T], row_x)]
      assert hits
      np.testing.assert_array_equal(row_y, tokens[hits[0] + 1:hits[0] + T + 1])
      starts.append(hits[0])
  # Spread over the whole split, first at 0, last ending at the final token,
  # non-overlapping here (12 windows in 1000 tokens).
  assert starts[0] == 0 and starts[-1] == len(tokens) - T - 1
  assert np.all(np.diff(starts) >= T + 1)
  again = text.eval_batches(tokens, context_len=T, batch=4, n_batches=3)
  for (x, y), (x2, y2) in zip(batches, again):
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
  with pytest.raises(ValueError, match="context_len"):
    text.eval_batches(tokens[:5], context_len=T, batch=1, n_batches=1)


# ---------------------------------------------------------------------------
# ArraySampler.
# ---------------------------------------------------------------------------


def test_array_sampler_shards():
  sampler = fashion_mnist.ArraySampler(n_examples=100, n_workers=3,
                                       local_batch=4, seed=5)
  assert sampler.steps_per_epoch == 8
  ids = np.stack([sampler.batch_indices(s) for s in range(8)], axis=1)
  assert ids.shape == (3, 8, 4) and ids.dtype == np.int64
  for a, b in itertools.combinations(ids.reshape(3, -1), 2):
    assert not set(a.tolist()) & set(b.tolist())
  assert len(np.unique(ids)) == 96 and ids.max() < 100
  perm = np.random.default_rng(np.random.SeedSequence([5, 1])).permutation(100)
  np.testing.assert_array_equal(sampler.batch_indices(8 + 2, workers=[1])[0],
                                perm[32 + 8:32 + 12])
  np.testing.assert_array_equal(sampler.batch_indices(3, workers=[2, 0]),
                                sampler.batch_indices(3)[[2, 0]])
  with pytest.raises(ValueError, match="n_examples"):
    fashion_mnist.ArraySampler(n_examples=10, n_workers=3, local_batch=4,
                               seed=0)


# ---------------------------------------------------------------------------
# Fashion-MNIST IDX files.
# ---------------------------------------------------------------------------


def _idx_bytes(arr: np.ndarray) -> bytes:
  magic = 0x0800 + arr.ndim  # uint8 type code 0x08, then the rank
  header = struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape)
  return header + arr.astype(np.uint8).tobytes()


def _write_fake(directory, n_train=7, n_test=3, compress=True):
  rng = np.random.default_rng(0)
  arrays = {
      "train_images": rng.integers(0, 256, (n_train, 28, 28)),
      "train_labels": rng.integers(0, 10, n_train),
      "test_images": rng.integers(0, 256, (n_test, 28, 28)),
      "test_labels": rng.integers(0, 10, n_test),
  }
  names = {"train_images": "train-images-idx3-ubyte",
           "train_labels": "train-labels-idx1-ubyte",
           "test_images": "t10k-images-idx3-ubyte",
           "test_labels": "t10k-labels-idx1-ubyte"}
  for key, arr in arrays.items():
    if compress:
      with gzip.open(directory / (names[key] + ".gz"), "wb") as f:
        f.write(_idx_bytes(arr))
    else:
      (directory / names[key]).write_bytes(_idx_bytes(arr))
  return arrays, names


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_idx_round_trip(tmp_path, compress):
  arrays, _ = _write_fake(tmp_path, compress=compress)
  assert struct.unpack(">I", _idx_bytes(arrays["train_images"])[:4])[0] == 2051
  assert struct.unpack(">I", _idx_bytes(arrays["train_labels"])[:4])[0] == 2049
  got = fashion_mnist.load(tmp_path)
  assert set(got) == set(arrays)
  for key, arr in arrays.items():
    assert got[key].dtype == np.uint8
    np.testing.assert_array_equal(got[key], arr)
  x = fashion_mnist.to_float(got["test_images"])
  assert x.shape == (3, 28, 28, 1) and x.dtype == np.float32
  np.testing.assert_allclose(x[..., 0] * 255, arrays["test_images"])


def test_fashion_mnist_missing_and_corrupt(tmp_path):
  hint = ("apt-get install dataset-fashion-mnist` (Debian package, installs "
          "to /usr/share/datasets/fashion-mnist) or pass "
          "--config.data.path=DIR")
  with pytest.raises(ValueError) as err:
    fashion_mnist.load(tmp_path / "nope")
  assert hint in str(err.value) and isinstance(err.value, FileNotFoundError)
  _, names = _write_fake(tmp_path)
  (tmp_path / (names["test_labels"] + ".gz")).unlink()
  with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte") as err:
    fashion_mnist.load(tmp_path)
  assert hint in str(err.value)
  # Labels file holding an image header: wrong magic number.
  with gzip.open(tmp_path / (names["test_labels"] + ".gz"), "wb") as f:
    f.write(_idx_bytes(np.zeros((3, 28, 28))))
  with pytest.raises(ValueError, match="magic"):
    fashion_mnist.load(tmp_path)
  # Truncated data.
  with gzip.open(tmp_path / (names["test_labels"] + ".gz"), "wb") as f:
    f.write(_idx_bytes(np.zeros(3))[:-1])
  with pytest.raises(ValueError, match="truncated"):
    fashion_mnist.load(tmp_path)


def test_fashion_mnist_committed_subset(tmp_path):
  """The committed subset: its README's counts, balanced, real pixels."""
  fixture = os.path.join(FIXTURES, "fashion_mnist")
  got = fashion_mnist.load(fixture)
  for split, n in (("train", 1280), ("test", 320)):
    images, labels = got[f"{split}_images"], got[f"{split}_labels"]
    assert images.shape == (n, 28, 28) and labels.shape == (n,)
    assert images.dtype == np.uint8 and labels.dtype == np.uint8
    assert labels.max() <= 9
    np.testing.assert_array_equal(np.bincount(labels), [n // 10] * 10)
    assert images.min() == 0 and images.max() == 255
  # Evaluation reads the first test images: they mix all classes.
  assert len(np.unique(got["test_labels"][:128])) == 10
  # The script run on the subset itself keeps every image in order (same
  # arrays) and writes gzip streams with mtime 0.
  spec = importlib.util.spec_from_file_location(
      "make_subset", os.path.join(fixture, "make_subset.py"))
  make_subset = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_subset)
  assert make_subset.main(["--source", fixture, "--out", str(tmp_path),
                           "--train", "1280", "--test", "320"]) == 0
  for name in make_subset.FILES.values():
    ours = (tmp_path / name).read_bytes()
    with open(os.path.join(fixture, name), "rb") as f:
      committed = f.read()
    assert ours[4:8] == committed[4:8] == bytes(4)
    assert gzip.decompress(ours) == gzip.decompress(committed)


def test_package_reexports():
  assert data.LMSampler is text.LMSampler
  assert data.ArraySampler is fashion_mnist.ArraySampler
  assert fashion_mnist.DEFAULT_DIR == "/usr/share/datasets/fashion-mnist"


def test_a_text_path_that_is_a_directory_is_named_as_one(tmp_path):
  """A directory was reported as a file that "does not exist"."""
  from decentral_jax.data import text as text_lib  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="is a directory, not a file"):
    text_lib.load_text_file(tmp_path)


def test_path_problem_names_what_a_path_is(tmp_path):
  """One wording for the pre-check and the loaders: a path that exists is
  never said not to exist."""
  from decentral_jax.data import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.data import text as text_lib  # pylint: disable=import-outside-toplevel
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "f").write_bytes(b"ab")
  os.symlink(tmp_path / "gone", tmp_path / "link")
  problem = sharding_lib.path_problem
  assert problem(tmp_path / "f") is None
  assert problem(tmp_path, directory=True) is None
  assert problem(tmp_path) == "is a directory, not a file"
  assert problem(tmp_path / "f", directory=True) == ("is a file, not a "
                                                     "directory")
  device = "is not a regular file (a FIFO, a socket or a device)"
  assert problem(tmp_path / "fifo") == problem("/dev/null") == device
  assert problem(tmp_path / "none") == "does not exist"
  assert problem(tmp_path / "link") == ("is a symbolic link to a path that "
                                        "does not exist")
  assert problem(tmp_path / "f" / "x") == ("does not exist (a folder on its "
                                           "path is a file)")
  with pytest.raises(ValueError, match=r"^text file '/dev/null' is not a "
                     r"regular file \(a FIFO"):
    text_lib.load_text_file("/dev/null")
  with pytest.raises(ValueError, match=r"^token directory '.*/f' is a file, "
                     "not a directory"):
    text_lib.load_token_bins(tmp_path / "f")
