"""gpt_quick: the quick main job's proxy, a narrower and shorter gpt_tiny.

The model and data of ``configs/gpt_tiny.py`` (a 2-layer byte-level GPT on
the English text bundled with CPython, 8 workers, 64 sequences x 64 tokens
per step), at width 64 instead of 128 (about 0.1M parameters instead of
0.4M), for 200 steps instead of 300, evaluated every 20 steps on 2
validation batches. ``experiments/compare.py`` trains it once per method
(each at its gpt_tiny-tuned learning rate, not re-tuned here)::

  python experiments/compare.py --outdir results/compare

One run alone::

  python experiments/train.py --config configs/gpt_quick.py --workdir /tmp/q
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import config as config_lib


def get_config() -> config_dict.ConfigDict:
  """Returns the gpt_quick configuration (fields: ``config.base_config``)."""
  c = config_lib.base_config("gpt")
  c.optimizer.beta_convention = "per_step"  # as gpt_tiny
  c.schedule.peak_lr = 3e-3
  c.schedule.final_lr = 3e-4
  c.model.n_embd = 64
  c.steps = 200
  c.schedule.warmup_steps = 20
  c.eval_interval = 20
  c.eval_batches = 2
  c.log_interval = 20
  return c
