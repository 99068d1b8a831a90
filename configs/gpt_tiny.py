"""gpt_tiny: a 2-layer byte-level GPT on bundled English text (the quick job).

The run is the package's preset :func:`decentral_jax.runner.presets.gpt_tiny`
(what the main job trains under ``--full``).

Data: nothing to download. The corpus is the English documentation text that
ships with CPython (``pydoc_data.topics``, about 0.9 MB), read as bytes
(vocabulary 256); the last 10% is the validation split. To train on your own
text instead: ``--config.data.source=text_file --config.data.path=FILE``.

Default run: 8 workers (simulated CPU devices if needed), AccumAdamW
(``accum_steps`` 4) on the one-peer exponential graph, 300 steps of 64
sequences x 64 tokens; a few minutes on a 2-core CPU::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/gpt_tiny

All-Reduce AdamW baseline on the same model and data::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/ar \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.schedule.peak_lr=6e-3 \\
    --config.schedule.final_lr=6e-4
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import presets


def get_config() -> config_dict.ConfigDict:
  """Returns the gpt_tiny configuration: ``presets.gpt_tiny()``.

  Every field, with its meaning, is defined in
  ``decentral_jax.runner.config.base_config``; the preset changes two, to
  AccumAdamW's best measured setting for this model (see
  :func:`decentral_jax.runner.presets.gpt_tiny`).
  """
  return presets.gpt_tiny()
