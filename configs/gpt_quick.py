"""gpt_quick: the quick main job's proxy, a narrower and shorter gpt_tiny.

The run is the package's preset :func:`decentral_jax.runner.presets.gpt_quick`
(what the main job trains by default, also without a checkout). The model
and data of ``configs/gpt_tiny.py`` (a 2-layer byte-level GPT on the English
text bundled with CPython, 8 workers, 64 sequences x 64 tokens per step), at
width 64 instead of 128 (about 0.1M parameters instead of 0.4M), for 200
steps instead of 300, evaluated every 20 steps on 2 validation batches.
``experiments/compare.py`` trains it once per method (each at its
gpt_tiny-tuned learning rate, not re-tuned here)::

  python experiments/compare.py --outdir results/compare

One run alone::

  python experiments/train.py --config configs/gpt_quick.py --workdir /tmp/q
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import presets


def get_config() -> config_dict.ConfigDict:
  """Returns the gpt_quick configuration: ``presets.gpt_quick()`` (each
  field it changes is documented there; the others: ``config.base_config``).
  """
  return presets.gpt_quick()
