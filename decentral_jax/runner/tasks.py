"""Tasks: a model, its loss and its data, built from a validated config.

A :class:`Task` is everything the runner needs to know about *what* is
trained, and nothing about *how* (workers, gossip, optimizer): the initial
parameters, a per-example-batch loss, deterministic per-worker training
batches on the host, and a fixed evaluation set. Two tasks exist: byte- or
token-level language modelling with the GPT of :mod:`decentral_jax.models`
(:func:`lm_task`) and Fashion-MNIST classification with the CNN
(:func:`image_task`); :func:`make_task` picks one from ``config.model.name``,
or builds the task of your own model and data source
(:mod:`decentral_jax.runner.custom_task`, named as in
:mod:`decentral_jax.runner.extensions`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from ml_collections import config_dict

from decentral_jax.runner import config as config_lib
from decentral_jax.runner import custom_task
from decentral_jax import models
from decentral_jax.data import fashion_mnist
from decentral_jax.data import text

#: Most tokens of the GPT's evaluation set (2**28 int32: 1 GiB).
MAX_EVAL_TOKENS = 2**28

PyTree = Any


class Task(NamedTuple):
  """Model, loss and data of one experiment (host side).

  Attributes:
    init_params: ``key -> params`` of one worker (float32 leaves).
    loss: ``loss(params, batch, dropout_key or None) -> (loss, aux)``: the
      mean loss over the batch (float32 scalar, nats) and a dict of float32
      scalars (``{"accuracy": ...}`` for classifiers, else empty). A
      ``None`` key means deterministic (evaluation, or no dropout).
    host_batch: ``host_batch(step, workers or None) -> arrays`` of shape
      ``[len(workers), local_batch, ...]`` (all workers if None): the
      training batch of ``step`` (0-based), deterministic in
      ``(config.seed, step)``, each worker's rows disjoint within an epoch.
    eval_set: arrays ``[eval_batches, global_batch, ...]``.
    unit: ``"tokens"`` or ``"samples"``.
    units_per_step: tokens (samples) per training step over all workers.
    has_accuracy: the loss's aux holds ``"accuracy"`` (evaluated as
      ``eval/accuracy``); None: exactly when ``unit == "samples"`` (the
      built-in tasks).
  """
  init_params: Callable[[jax.Array], PyTree]
  loss: Callable[..., tuple[jax.Array, dict]]
  host_batch: Callable[..., tuple[np.ndarray, ...]]
  eval_set: tuple[np.ndarray, ...]
  unit: str
  units_per_step: int
  has_accuracy: bool | None = None


def _byte_corpus(d: config_dict.ConfigDict):
  if d.source == "pydoc":
    corpus = text.pydoc_corpus()
  elif not d.path:
    raise ValueError("config.data.path is not set; data.source=text_file "
                     "needs --config.data.path=FILE.")
  else:
    corpus = text.load_text_file(d.path)
  try:
    return text.byte_splits(corpus, float(d.val_fraction))
  except ValueError as e:
    raise ValueError(f"data.source={d.source}, config.data.path={d.path!r}"
                     f", config.data.val_fraction={d.val_fraction}: {e}"
                     ) from None


# Token files up to this size are scanned whole for ids >= vocab_size when
# the task is built (on 2 cores about 0.2 s per GB from the page cache, 2 s
# per GB from disk); larger ones are checked batch by batch as they are read.
SCAN_TOKEN_BYTES = 2**31


def _check_ids(tokens, top: int, vocab: int, where: str) -> None:
  """Raises ValueError naming the file if a token id ``top >= vocab``."""
  if top >= vocab:
    name = getattr(tokens, "filename", None) or "the token array"
    where = f" {where}" if where else ""
    raise ValueError(
        f"token file {name!r} holds token id {top}{where}, but config.model."
        f"vocab_size={vocab} (ids must be < vocab_size): set --config.model."
        f"vocab_size={top + 1} or more, or check that the file holds uint16 "
        f"ids of this model's tokenizer (GPT-2: < {config_lib.GPT2_VOCAB}).")


def _check_token_bins(tokens, vocab: int):
  """Checks the training tokens now, or returns a per-batch check.

  Files up to ``SCAN_TOKEN_BYTES`` are scanned whole (None is returned);
  for larger ones the result wraps ``host_batch`` so that every batch read
  is checked before it reaches the model.
  """
  if tokens.nbytes <= SCAN_TOKEN_BYTES:
    _check_ids(tokens, text.max_token_id(tokens), vocab, "")
    return None

  def wrap(host_batch):
    def checked(step, workers=None):
      inputs, targets = host_batch(step, workers)
      top = max(int(inputs.max(initial=0)), int(targets.max(initial=0)))
      _check_ids(tokens, top, vocab, f"in the batch of step {step}")
      return inputs, targets
    return checked

  return wrap


def _lm_tokens(d: config_dict.ConfigDict, vocab_size: int):
  """(training tokens, validation tokens) of ``config.data``; their ids fit
  a vocabulary of at least 256 (bytes) or the GPT-2 tokenizer's."""
  if d.source in ("pydoc", "text_file"):
    train_tokens, val_tokens = _byte_corpus(d)
  else:
    if not d.path:
      raise ValueError(
          "config.data.path is not set; data.source=token_bins needs "
          "--config.data.path=DIR holding nanoGPT's train.bin and val.bin "
          "(made by nanoGPT's data/openwebtext/prepare.py).")
    train_tokens, val_tokens = text.load_token_bins(d.path)
  vocab_needed = 256 if d.source != "token_bins" else config_lib.GPT2_VOCAB
  if vocab_size < vocab_needed:
    raise ValueError(f"config.model.vocab_size={vocab_size} is smaller than "
                     f"the {vocab_needed} token ids of data.source="
                     f"{d.source}; set --config.model.vocab_size="
                     f"{vocab_needed} or more.")
  return train_tokens, val_tokens


def _lm_batches(c: config_dict.ConfigDict, train_tokens, val_tokens,
                n: int, local_batch: int):
  """(``host_batch``, eval set) of :class:`Task` over the token splits.

  Token bins' ids are checked against ``config.model.vocab_size``: the
  training file whole or per batch (:func:`_check_token_bins`), the
  validation file in the windows the evaluation reads.
  """
  d, t, vocab = c.data, int(c.model.block_size), int(c.model.vocab_size)
  lazy_check = None
  if d.source == "token_bins":
    lazy_check = _check_token_bins(train_tokens, vocab)
  for split, tokens, need in (
      ("training", train_tokens, n * local_batch * t + 1),
      ("validation", val_tokens, t + 1)):
    if len(tokens) < need:
      raise ValueError(
          f"the {split} split of data.source={d.source} has {len(tokens)} "
          f"tokens, fewer than the {need} needed with config.model."
          f"block_size={t} (and global_batch={c.global_batch}); lower "
          "--config.model.block_size or --config.global_batch, or use a "
          "longer corpus.")
  sampler = text.LMSampler(train_tokens, t, n, local_batch, int(c.seed))
  evals = text.eval_batches(val_tokens, t, int(c.global_batch),
                            int(c.eval_batches))
  eval_set = tuple(np.stack([b[i] for b in evals]) for i in range(2))
  if d.source == "token_bins":
    # The validation windows are all the evaluation ever reads of val.bin.
    _check_ids(val_tokens, max(int(x.max()) for x in eval_set), vocab,
               "in its evaluation windows")
  if lazy_check is not None:
    return lazy_check(sampler.batch), eval_set
  return sampler.batch, eval_set


def check_eval_size(c: config_dict.ConfigDict) -> None:
  """Raises a one-line ValueError naming ``config.eval_batches`` if the
  GPT's evaluation set, ``eval_batches * global_batch`` windows of
  ``block_size + 1`` tokens (int32, held in host memory), has more than
  :data:`MAX_EVAL_TOKENS` tokens; checked before any data is read."""
  nb, b = int(c.eval_batches), int(c.global_batch)
  per_batch = b * (int(c.model.block_size) + 1)
  if nb * per_batch > MAX_EVAL_TOKENS:
    fix = (f"set --config.eval_batches={MAX_EVAL_TOKENS // per_batch} or "
           "fewer" if per_batch <= MAX_EVAL_TOKENS else
           "one batch is already too many: lower --config.global_batch or "
           "--config.model.block_size")
    raise ValueError(
        f"config.eval_batches={nb} gives an evaluation set of "
        f"{nb * per_batch} tokens (eval_batches * global_batch={b} * "
        f"(model.block_size + 1)), more than the {MAX_EVAL_TOKENS} (2**28, "
        f"1 GiB of int32) an evaluation may hold; {fix}.")


def lm_task(config: config_dict.ConfigDict, n_workers: int,
            local_batch: int) -> Task:
  """Next-token prediction with the GPT on a byte corpus or token bins.

  Batches are ``(inputs, targets)``, int32 ``[.., B, T]`` with ``T =
  config.model.block_size``; the loss is the mean token cross-entropy.

  Raises:
    ValueError: an evaluation set over :data:`MAX_EVAL_TOKENS` tokens
      (:func:`check_eval_size`), a missing ``data.path``, a vocabulary
      smaller than the data's
      token ids (for token bins: any id >= ``vocab_size``, named with its
      file; ``train.bin`` files above ``SCAN_TOKEN_BYTES`` are checked per
      batch, so :attr:`Task.host_batch` raises it), or a split too short
      for ``block_size`` and the batch.
  """
  c, m = config, config.model
  t = int(m.block_size)
  check_eval_size(c)
  train_tokens, val_tokens = _lm_tokens(c.data, int(m.vocab_size))
  host_batch, eval_set = _lm_batches(c, train_tokens, val_tokens, n_workers,
                                     local_batch)
  gpt_cfg = models.GPTConfig(
      vocab_size=int(m.vocab_size), block_size=t, n_layer=int(m.n_layer),
      n_head=int(m.n_head), n_embd=int(m.n_embd), bias=bool(m.bias),
      dropout=float(m.dropout), dtype=config_lib.COMPUTE_DTYPES[m.dtype],
      param_dtype=config_lib.COMPUTE_DTYPES[m.param_dtype], remat=m.remat)
  model = models.GPT(gpt_cfg)

  def loss(params, batch, key):
    inputs, targets = batch
    rngs = {"dropout": key} if key is not None else None
    logits = model.apply({"params": params}, inputs,
                         deterministic=key is None, rngs=rngs)
    return models.lm_loss(logits, targets), {}

  return Task(lambda key: models.gpt.init_params(gpt_cfg, key), loss,
              host_batch, eval_set, "tokens", int(c.global_batch) * t)


def image_task(config: config_dict.ConfigDict, n_workers: int,
               local_batch: int) -> Task:
  """Fashion-MNIST classification with the CNN.

  Batches are ``(images, labels)``: uint8 ``[.., B, 28, 28]`` and int32
  ``[.., B]``; the loss is the mean cross-entropy, with ``accuracy`` in aux.
  Validation uses the first ``eval_batches * global_batch`` test images.

  Raises:
    FileNotFoundError: the IDX files are missing (see
      :mod:`decentral_jax.data.fashion_mnist`).
    ValueError: labels >= ``model.num_classes``, or more evaluation images
      asked for than the test set has.
  """
  c, m = config, config.model
  data_dir = config.data.path or fashion_mnist.DEFAULT_DIR
  data = fashion_mnist.load(data_dir)
  images, labels = data["train_images"], data["train_labels"].astype(np.int32)
  top = max(int(data["train_labels"].max(initial=0)),
            int(data["test_labels"].max(initial=0)))
  if top >= int(m.num_classes):
    raise ValueError(
        f"the Fashion-MNIST labels in {data_dir!r} go up to {top} but config."
        f"model.num_classes={m.num_classes}; set --config.model.num_classes="
        f"{top + 1} or more.")
  sampler = fashion_mnist.ArraySampler(len(images), n_workers, local_batch,
                                       int(c.seed))
  n_eval = int(c.eval_batches) * int(c.global_batch)
  if n_eval > len(data["test_images"]):
    raise ValueError(
        f"config.eval_batches * config.global_batch = {n_eval} exceeds the "
        f"{len(data['test_images'])} Fashion-MNIST test images; lower "
        "--config.eval_batches.")
  shape = (int(c.eval_batches), int(c.global_batch))
  eval_set = (data["test_images"][:n_eval].reshape(shape + (28, 28)),
              data["test_labels"][:n_eval].astype(np.int32).reshape(shape))
  model = models.CNN(num_classes=int(m.num_classes),
                     features=tuple(int(f) for f in m.features),
                     dense=int(m.dense))

  def host_batch(step, workers=None):
    idx = sampler.batch_indices(step, workers)
    return images[idx], labels[idx]

  def loss(params, batch, key):
    del key  # the CNN has no dropout
    pixels, y = batch
    value, accuracy = models.classification_loss(
        model.apply({"params": params}, fashion_mnist.to_float(pixels)), y)
    return value, {"accuracy": accuracy}

  return Task(lambda key: models.cnn.init_params(model, key), loss,
              host_batch, eval_set, "samples", int(c.global_batch))


_TASKS = {"gpt": lm_task, "cnn": image_task}


def make_task(config: config_dict.ConfigDict, n_workers: int,
              local_batch: int) -> Task:
  """The task of ``config.model.name``: ``"gpt"``, ``"cnn"``, or your own
  model (a registered name or ``module:attribute``) with its
  ``config.data.source`` (:func:`decentral_jax.runner.custom_task.custom_task`).

  Raises:
    ValueError: bad or missing data (a missing file is reported with
      ``config.data.path``), see :func:`lm_task` and :func:`image_task`;
      for your own model and data, one line naming the model or the source
      and what was expected, before anything is compiled.
  """
  if config.model.name not in _TASKS:
    return custom_task.custom_task(config, n_workers, local_batch, Task)
  try:
    return _TASKS[config.model.name](config, n_workers, local_batch)
  except FileNotFoundError as e:  # includes data.DataNotFoundError
    raise ValueError(f"config.data.path={config.data.path!r} "
                     f"(data.source={config.data.source}): {e}") from None


def uses_dropout(config: config_dict.ConfigDict) -> bool:
  """True if the task's loss needs a dropout key during training (the GPT
  with dropout; your own model with ``config.model.needs_key``)."""
  if config.model.name not in _TASKS:
    return bool(config.model.needs_key)
  return config.model.name == "gpt" and float(config.model.dropout) > 0
