"""Checks of the values a checkpoint document derives from its own config.

The writer (:func:`decentral_jax.runner.run_meta.checkpoint_meta` and the
recorder) computes ``lr`` and ``metrics_window`` from the run's config and
step; a document whose values disagree with its stored ``config`` is
damaged (:func:`decentral_jax.runner.meta_schema.meta_error` uses these),
never a changed config of the resumed run.
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.runner import builders


def window_steps_error(meta: dict, config) -> str | None:
  """Why ``metrics_window`` contradicts the step and the stored config, or
  None. The window holds one loss per step since the last record: empty
  at a step the writer logs (a multiple of ``log_interval`` or
  ``eval_interval``, or ``steps``), else it holds at least that step's
  loss; ``accs`` is empty or as long as ``losses``. (Its exact length
  depends on ``log_interval`` before the last resume, which a resume may
  change: not checked.) A missing or null window counts as an empty one:
  the writer always writes one, so at a step it does not log that is
  damage (the resumed run's next record would average the later steps
  only)."""
  window, step = meta.get("metrics_window"), meta.get("step")
  if window is None:
    window = {}
  if not isinstance(window, dict) or not isinstance(config, dict) \
      or not step:
    return None
  ints = [config.get(k) for k in ("log_interval", "eval_interval", "steps")]
  if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
    return None
  log, ev, total = ints
  n = len(window.get("losses", []))
  logged = (log > 0 and step % log == 0) or (ev > 0 and step % ev == 0) \
      or step == total
  if logged and n:
    return (f"metrics_window.losses holds {n} values at step {step}, which "
            f"the writer logs (config.log_interval={log}, eval_interval="
            f"{ev}, steps={total}): its window is empty there")
  if not logged and not n:
    what = ("metrics_window.losses is empty" if meta.get("metrics_window")
            else "metrics_window is " + ("null" if "metrics_window" in meta
                                         else "missing"))
    return (f"{what} at step {step}, which the "
            f"writer does not log (config.log_interval={log}, "
            f"eval_interval={ev}, steps={total}): it holds that step's loss")
  accs = len(window.get("accs", []))
  if accs not in (0, n):
    return (f"metrics_window.accs holds {accs} values, losses {n} (one "
            "of each per step, or no accuracy)")
  return None


def lr_error(meta: dict, config) -> str | None:
  """Why the document's ``lr`` is not its stored config's schedule at its
  step (the writer derives one from the other: a disagreement is damage,
  not a changed ``steps`` or ``schedule``), or None (no ``lr`` or no
  ``config``: the older formats)."""
  lr, step = meta.get("lr"), meta.get("step")
  if not isinstance(config, dict) or isinstance(lr, bool) \
      or not isinstance(lr, (int, float)) or not isinstance(step, int):
    return None
  try:
    c = config_dict.ConfigDict({"schedule": dict(config["schedule"]),
                                "steps": config["steps"]})
    written = float(builders.make_schedule(c)(step))
  except (KeyError, TypeError, ValueError, AttributeError):
    return None  # a config the rules refused, or without a schedule
  if abs(lr - written) <= 1e-5 * abs(written) + 1e-12:
    return None
  return (f"lr {lr:.6g} disagrees with config.schedule at step {step} "
          f"({written:.6g}; the writer derives one from the other)")
