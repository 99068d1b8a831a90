"""muloco_tiny: MuLoCo (DiLoCo with a Muon inner optimizer) on gpt_tiny,
its pseudo-gradients sent in 4 bits with error feedback.

The model, data and run length of ``configs/gpt_tiny.py``
(:func:`decentral_jax.runner.presets.gpt_tiny`): a 2-layer byte-level GPT,
8 workers (simulated CPU devices if needed), 300 steps of 64 sequences x
64 tokens, at MuLoCo's tuned peak learning rate 2.4e-2 (the tuning
protocol in compare's setting; the AdamW methods tune to 3e-3 or 6e-3
here). Each worker takes 10 inner steps with Muon on its hidden matrices
and AdamW on its embeddings (the tied output head included) and LayerNorm
scales (:mod:`decentral_jax.optim.muloco` lists the leaves); the int4
pseudo-gradients (one float32 scale per 256 values: about 7.6x fewer
bytes than float32) are averaged and the outer Nesterov SGD steps theta.

Data: nothing to download (the English documentation text that ships with
CPython, read as bytes; see ``configs/gpt_tiny.py``).

Run::

  python experiments/train.py --config configs/muloco_tiny.py --workdir /tmp/muloco

Streaming MuLoCo (2 fragments, each merged one step after it is sent), or
the exact float32 mean::

  --config.num_fragments=2 --config.overlap_steps=1 --config.merge_alpha=0.5
  --config.compression.format=none --config.compression.error_feedback=False
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import presets


def get_config() -> config_dict.ConfigDict:
  """Returns gpt_tiny (``presets.gpt_tiny()``) set up for MuLoCo.

  Every field, with its meaning, is defined in
  ``decentral_jax.runner.config.base_config``; MuLoCo's own ``muon.*``
  fields in :mod:`decentral_jax.runner.methods.muloco`.
  """
  c = presets.gpt_tiny()
  # DiLoCo with Muon as the inner optimizer (runner/methods/muloco.py).
  c.algorithm = "muloco"
  # The AdamW branch (embeddings, scales): plain AdamW, one micro-batch.
  c.optimizer.name = "adamw"
  c.optimizer.accum_steps = 1
  # DiLoCo's sync period and outer Nesterov lr of the main job's arms
  # (tools/compare: H = 10, lr 0.3, momentum 0.9).
  c.sync_every = 10
  c.outer_optimizer.lr = 0.3
  # The tuning protocol's peak lr for MuLoCo in this setting (see
  # runner/methods/muloco.py), cosine to a tenth.
  c.schedule.peak_lr = 2.4e-2
  c.schedule.final_lr = 2.4e-3
  # 4-bit pseudo-gradients with error feedback (MuLoCo's low-bit setting).
  c.compression.format = "int4"
  c.compression.error_feedback = True
  return c
