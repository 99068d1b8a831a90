"""Rules for one value of one run-config field, public for method homes.

A rule ``rule(name, value)`` raises a one-line ``ValueError`` naming the
field (``config.<name>``), the rule, the value and the
``--config.<name>=`` override that fixes it, and returns None otherwise.
:mod:`decentral_jax.runner.field_rules` builds the rules of the base
config from these; a method home declares its own fields with them
(:class:`decentral_jax.runner.methods.ConfigField`).
"""

from __future__ import annotations

import math

import numpy as np

from decentral_jax import checks

# Largest integer field value: step counters and sizes are int32 on device.
INT_MAX = checks.INT32_MAX
#: Upper bound of the learning rates (inner and outer), the weight decay
#: (as the learners' ``--inner-lr``) and the factors that scale a learning
#: rate (Muon's ``consistent_rms``, ``adam_lr_ratio``): a larger value only
#: diverges, so it is refused as a typo before training instead of stopping
#: at a non-finite loss.
MAX_LR = 1e3


def choice(value, name: str, allowed) -> str:
  """``value`` if it is one of ``allowed``, else a ValueError naming both
  (an empty-string choice shown as ``'' (unset)``)."""
  if value not in allowed:
    raise ValueError(f"unknown config.{name}={value!r}; use one of "
                     f"{checks.show_choices(allowed)} (--config.{name}=...).")
  return value


def integer(lo: int, hi: int = INT_MAX, note: str = ""):
  """The rule: an int (not a bool) in ``[lo, hi]``."""
  def check(name, value):
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or not lo <= value <= hi):
      raise ValueError(f"config.{name} must be an integer in [{lo}, {hi}]"
                       f"{note}, got {value!r}; set --config.{name}=<int>.")
  return check


def real(lo: float, hi: float | None = None, *, lo_open: bool = False,
         hi_closed: bool = False, note: str = ""):
  """The rule: a finite int or float (not a bool), ``>= lo`` (``> lo`` if
  ``lo_open``) and, with ``hi``, ``< hi`` (``<= hi`` if ``hi_closed``)."""
  if hi is not None:
    rule = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}"
            f"{']' if hi_closed else ')'}")
  else:
    rule = f"{'>' if lo_open else '>='} {lo:g}"

  def check(name, value):
    ok = (not isinstance(value, bool) and
          isinstance(value, (int, float, np.integer, np.floating)) and
          (isinstance(value, (int, np.integer)) or math.isfinite(value)) and
          (value > lo if lo_open else value >= lo) and
          (hi is None or (value <= hi if hi_closed else value < hi)))
    if not ok:
      raise ValueError(f"config.{name} must be a finite number {rule}{note}, "
                       f"got {value!r}; set --config.{name}=<float>.")
  return check


def boolean(name, value) -> None:
  """The rule: True or False."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"config.{name} must be True or False, got {value!r}; "
                     f"set --config.{name}=True or False.")


def optional_text(name, value) -> None:
  """The rule: a string or unset (None)."""
  if value is not None and not isinstance(value, str):
    raise ValueError(f"config.{name} must be a string (or unset), got "
                     f"{value!r}; set --config.{name}=<text>.")


def one_of(allowed):
  """The rule: one of ``allowed`` (compared with ``in``)."""
  allowed = tuple(allowed)
  return lambda name, value: choice(value, name, allowed)
