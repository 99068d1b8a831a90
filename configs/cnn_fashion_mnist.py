"""cnn_fashion_mnist: a small CNN on Fashion-MNIST with 8 workers.

Data: the standard Fashion-MNIST IDX files (``train-images-idx3-ubyte.gz``,
``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
``t10k-labels-idx1-ubyte.gz``; uncompressed names work too) in ``data.path``,
by default ``/usr/share/datasets/fashion-mnist``. On Debian/Ubuntu install
them with ``apt-get install dataset-fashion-mnist``; otherwise download the
four files from https://github.com/zalandoresearch/fashion-mnist and pass
``--config.data.path=DIR``. Validation uses the 10k test images.

Run::

  python experiments/train.py --config configs/cnn_fashion_mnist.py --workdir /tmp/fmnist
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import config as config_lib


def get_config() -> config_dict.ConfigDict:
  """Returns the cnn_fashion_mnist configuration.

  Fields not set here keep the defaults of
  ``decentral_jax.runner.config.base_config``; every field is described by
  its group's builder in ``decentral_jax.runner.config_groups``.
  """
  c = config_lib.base_config("cnn")
  # 500 steps x 256 images ~ 2 epochs; 32 images per worker.
  c.steps = 500
  c.global_batch = 256
  # No gradient clipping.
  c.grad_clip = 0.0
  # Evaluate every 100 steps on 8 x 256 test images; log, checkpoint.
  c.eval_interval = 100
  c.eval_batches = 8
  c.log_interval = 20
  c.checkpoint_interval = 250
  # Adam's default b2, light weight decay.
  c.optimizer.b2 = 0.999
  c.optimizer.weight_decay = 1e-4
  # Warmup over 25 steps, cosine from 2e-3 to 1e-4.
  c.schedule.peak_lr = 2e-3
  c.schedule.warmup_steps = 25
  c.schedule.final_lr = 1e-4
  # Data: the IDX files in data.path (unset: /usr/share/datasets/
  # fashion-mnist); validation is the test set, so no held-out fraction.
  c.data.val_fraction = 0.0
  return c
