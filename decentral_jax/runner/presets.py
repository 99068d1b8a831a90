"""Named run configs shipped with the package: the main job's proxies.

:func:`gpt_tiny` and :func:`gpt_quick` are the runs of the main job
(:mod:`decentral_jax.tools.compare`: ``gpt_quick`` by default, ``gpt_tiny``
under ``--full``), so an installed package runs it without a checkout;
``configs/gpt_tiny.py`` and ``configs/gpt_quick.py`` return them.
:data:`PRESETS` maps each name to its function and :func:`load` applies
command-line style overrides to one, as
:func:`decentral_jax.runner.config.load_config` does to a config file.

Both train a 2-layer byte-level GPT on bundled English text. Data: nothing
to download. The corpus is the English documentation text that ships with
CPython (``pydoc_data.topics``, about 0.9 MB), read as bytes (vocabulary
256); the last 10% is the validation split. To train on your own text
instead: ``--config.data.source=text_file --config.data.path=FILE``. Every
field, with its meaning and unit, is defined in
:func:`decentral_jax.runner.config.base_config`; a preset changes only what
it lists.
"""

from __future__ import annotations

import os
from typing import Callable

from ml_collections import config_dict

from decentral_jax.runner import config as config_lib


def gpt_tiny() -> config_dict.ConfigDict:
  """gpt_tiny: a 2-layer byte-level GPT of width 128 (about 0.4M parameters).

  8 workers (simulated CPU devices if needed), AccumAdamW (``accum_steps``
  4) on the one-peer exponential graph, 300 steps of 64 sequences x 64
  tokens; a few minutes on a 2-core CPU. It changes two fields of
  ``base_config("gpt")``, to AccumAdamW's best measured setting for this
  model (the tuning protocol, BENCHMARKS.md section 10): horizon-matched
  betas (``optimizer.beta_convention="per_step"``) at peak learning rate
  3e-3 (6e-3 is best for All-Reduce AdamW and DAdam in the same setting).

  Returns:
    An unlocked ``ConfigDict`` (the fields of ``base_config("gpt")``).
  """
  c = config_lib.base_config("gpt")
  # AccumAdamW with Adam's horizon in steps: b1**4, b2**4 per window.
  c.optimizer.beta_convention = "per_step"
  # Its best peak lr (the tuning protocol's choice), cosine to a tenth.
  c.schedule.peak_lr = 3e-3
  c.schedule.final_lr = 3e-4
  return c


def gpt_quick() -> config_dict.ConfigDict:
  """gpt_quick: the quick main job's proxy, a narrower and shorter gpt_tiny.

  The model and data of :func:`gpt_tiny` (8 workers, 64 sequences x 64
  tokens per step), at width 64 instead of 128 (about 0.1M parameters
  instead of 0.4M), for 200 steps instead of 300, evaluated every 20 steps
  on 2 validation batches. The main job trains it once per method, each at
  its gpt_tiny-tuned learning rate (not re-tuned here).

  Returns:
    An unlocked ``ConfigDict`` (the fields of ``base_config("gpt")``).
  """
  c = gpt_tiny()
  # Width (embedding size) 64 instead of 128.
  c.model.n_embd = 64
  # 200 training steps instead of 300, 20 of them the linear warm-up.
  c.steps = 200
  c.schedule.warmup_steps = 20
  # Evaluated every 20 steps on 2 validation batches; the training loss
  # logged every 20 steps.
  c.eval_interval = 20
  c.eval_batches = 2
  c.log_interval = 20
  return c


#: The presets by name.
PRESETS: dict[str, Callable[[], config_dict.ConfigDict]] = {
    "gpt_tiny": gpt_tiny, "gpt_quick": gpt_quick}


def load(name: str, overrides=()) -> config_dict.ConfigDict:
  """The preset ``name`` with command-line style ``overrides``.

  Args:
    name: a key of :data:`PRESETS`.
    overrides: strings ``"field=value"`` or ``"--config.field=value"``,
      typed and checked as :func:`~decentral_jax.runner.config.load_config`
      does for a config file.

  Returns:
    The locked ``ConfigDict`` (not yet validated).

  Raises:
    ValueError: an unknown ``name``, or a bad override (one line, naming
      it and the preset).
  """
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; use one of "
                     f"{', '.join(PRESETS)}.")
  return config_lib.with_overrides(PRESETS[name], overrides,
                                   f"the {name} preset")


def load_named_or_file(config: str, overrides=()) -> config_dict.ConfigDict:
  """``--config`` of the command lines: a preset by name, else a file.

  Args:
    config: a key of :data:`PRESETS` (``gpt_quick``), or a config file
      ``FILE.py[:ARG]`` for :func:`~decentral_jax.runner.config.load_config`.
    overrides: as in :func:`load`.

  Returns:
    The locked ``ConfigDict`` (not yet validated).

  Raises:
    ValueError: neither a preset nor a file, a preset given an ``:ARG``,
      a missing or broken file, or a bad override (one line).
  """
  if config in PRESETS:
    return load(config, overrides)
  base = str(config).split(":", 1)[0]
  if base in PRESETS:
    raise ValueError(f"config {config!r}: the preset {base!r} takes no "
                     f":ARG; pass --config={base}.")
  if os.sep not in base and not base.endswith(".py") and \
      not os.path.exists(base):
    raise ValueError(f"config {config!r} is neither a preset (one of "
                     f"{', '.join(PRESETS)}) nor a config file "
                     "(FILE.py or FILE.py:ARG).")
  return config_lib.load_config(config, overrides)
