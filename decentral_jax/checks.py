"""Argument checks shared by every layer: integers, floats, probabilities,
choices, containers, types, dtypes.

Each check either returns the value converted to its Python type or raises
``ValueError`` with one line that names the argument and what it must be, in
the form ``"{name} must be {rule}, got {value!r}."``. Library functions call
them when they are constructed, not at the first traced step, and the config
validation (:mod:`decentral_jax.runner.validation`) uses the same wording.

``bool`` is refused where an integer or a float is expected (``True`` is an
``int`` in Python, never a worker count). NumPy scalars are accepted. A JAX or
NumPy *array* is refused with a hint: under ``optax.inject_hyperparams`` an
argument that must be static has to be listed in ``static_args``.

This module imports nothing else from the library.
"""

from __future__ import annotations

import decimal
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import numpy as np

#: Largest period, count or step a compiled program holds: step counters
#: and periods are int32 on the device (``count % period`` of an int32
#: counter); a larger Python int fails only when the step is traced.
INT32_MAX = 2**31 - 1
#: Most CPU devices the entry points simulate in one process. Start-up grows
#: with the count (on 2 cores: 1024 devices about a minute to the first
#: gossip step; 65536 not started after 2 minutes; 10**6 killed for memory).
MAX_SIMULATED_CPU_DEVICES = 1024


INJECT_HINT = ("under optax.inject_hyperparams list {!r} in static_args "
               "(optax takes callables, dtype classes included, for "
               "schedules)")


def _is_array(value) -> bool:
  """An array-like instance; a scalar type such as ``np.float16`` is not one
  (its class has ``shape`` and ``dtype`` descriptors, it is a dtype)."""
  return isinstance(value, np.ndarray) or (
      not isinstance(value, type)
      and hasattr(value, "shape") and hasattr(value, "dtype")
      and not isinstance(value, np.generic))


def is_int(value: Any) -> bool:
  """Whether ``value`` is a Python or NumPy integer (not ``bool``, not an array).

  The predicate of :func:`check_int`, for checks whose message says more
  than the range (e.g. ``local_size`` must divide ``n_workers``).
  """
  return (isinstance(value, (int, np.integer))
          and not isinstance(value, (bool, np.bool_)))


def whole_number(text: str) -> int | None:
  """``text`` read as a count is typed: ``"16"`` is 16 and ``"1e3"`` (a
  whole float in a count's usual spelling) 1000; None for anything else
  (``"2.5"``, ``"4.000000000000000001"``: the decimal is read exactly, not
  rounded to a float; ``"nan"``, ``"inf"``, a magnitude above 2**63 in any
  spelling, non-ASCII digits such as ``"٣"``, which another reader spells
  differently)."""
  if not isinstance(text, str) or not text.isascii():
    return None
  try:
    value = decimal.Decimal(text.strip())
  except (decimal.InvalidOperation, ValueError):
    return None
  # copy_abs and the comparison are exact (no context rounding or traps).
  if not value.is_finite() or value.copy_abs() > 2**63 or (
      value != value.to_integral_value()):
    return None
  return int(value)


#: A hostname label (RFC 1123, with ``_`` as container names use it).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def host_port(address: Any) -> tuple[str, int] | None:
  """``"host:port"`` as ``(host, port)``, or None. The host (the text
  before the last ``:``) is a hostname (dot-separated labels of ASCII
  letters, digits, ``-`` and ``_``, at most 253 characters), an IPv4
  address, or an IPv6 address in brackets (returned without them, as a
  socket takes it); blanks, a scheme (``http://``) or a path are refused.
  The port is ASCII digits without a leading zero in [1, 65535] (``int``
  would read ``²`` or ``080``)."""
  host, _, port = str(address).rpartition(":")
  if not (port.isascii() and port.isdigit()) or port != str(int(port)) or (
      not 1 <= int(port) <= 65535):
    return None
  if host.startswith("[") and host.endswith("]"):
    try:
      return str(ipaddress.IPv6Address(host[1:-1])), int(port)
    except ValueError:
      return None
  labels = host.removesuffix(".").split(".")
  if not host.isascii() or len(host) > 253 or not all(
      _HOST_LABEL.fullmatch(x) for x in labels):
    return None
  if all(x.isdigit() for x in labels):  # numeric: an IPv4 address or none
    try:
      ipaddress.IPv4Address(host)
    except ValueError:
      return None
  return host, int(port)


def is_number(value: Any) -> bool:
  """Whether ``value`` is a finite real number: a Python or NumPy int or
  float, not ``bool``, NaN, inf or an array. An int is finite when it is
  within float64's range (``10**400`` is not: ``float()`` overflows).

  The predicate of :func:`check_float`.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    return False
  try:
    return math.isfinite(float(value))
  except OverflowError:  # an int beyond float64's range
    return False


def shown(value: Any) -> str:
  """``repr(value)`` for a message; an int of more than 30 digits is
  ``"an int of N digits"`` (``10**400`` would fill the line)."""
  if is_int(value) and len(str(abs(int(value)))) > 30:
    sign = "a negative" if value < 0 else "an"
    return f"{sign} int of {len(str(abs(int(value))))} digits"
  return repr(value)


def _check_kind(name: str, value: Any, rule: str, accepted) -> None:
  """Refuses an array (with :data:`INJECT_HINT`) or a value that the
  predicate ``accepted`` rejects: ``"{name} must be {rule}, got ..."``."""
  if _is_array(value):
    raise ValueError(f"{name} must be {rule}, got an array; "
                     f"{INJECT_HINT.format(name)}.")
  if not accepted(value):
    raise ValueError(f"{name} must be {rule}, got {shown(value)}.")


def _bounds(minimum, maximum, *, open_min=False, open_max=False) -> str:
  lo = None if minimum is None else (">" if open_min else ">=") + f" {minimum}"
  hi = None if maximum is None else ("<" if open_max else "<=") + f" {maximum}"
  return " and ".join(p for p in (lo, hi) if p)


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
  """Returns ``int(value)`` if ``value`` is an integer in ``[minimum, maximum]``.

  Args:
    name: the argument or config field, as the user spells it.
    value: a Python or NumPy integer (not ``bool``, not a float such as 2.0
      or 2.5, not an array).
    minimum, maximum: inclusive bounds; None for none.

  Raises:
    ValueError: ``"{name} must be an int >= {minimum}, got {value!r}."``.
  """
  rule = "an int" + (" " + _bounds(minimum, maximum)
                     if (minimum, maximum) != (None, None) else "")
  _check_kind(name, value, rule, is_int)
  if ((minimum is not None and value < minimum)
      or (maximum is not None and value > maximum)):
    raise ValueError(f"{name} must be {rule}, got {shown(value)}.")
  return int(value)


def check_float(name: str, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, open_min: bool = False,
                open_max: bool = False) -> float:
  """Returns ``float(value)`` if ``value`` is a finite real number in range.

  Args:
    name: the argument or config field.
    value: a Python or NumPy int or float (not ``bool``, not NaN or inf, not
      an int beyond float64's range, not an array).
    minimum, maximum: bounds; None for none. ``open_min`` / ``open_max``
      make them strict.

  Raises:
    ValueError: ``"{name} must be a finite number > 0, got {value!r}."``.
  """
  rule = "a finite number" + (
      " " + _bounds(minimum, maximum, open_min=open_min, open_max=open_max)
      if (minimum, maximum) != (None, None) else "")
  _check_kind(name, value, rule, is_number)
  v = float(value)
  if minimum is not None and (v < minimum or (open_min and v == minimum)):
    raise ValueError(f"{name} must be {rule}, got {shown(value)}.")
  if maximum is not None and (v > maximum or (open_max and v == maximum)):
    raise ValueError(f"{name} must be {rule}, got {shown(value)}.")
  return v


def check_probability(name: str, value: Any, *, open_min: bool = False,
                      open_max: bool = False) -> float:
  """Returns ``float(value)`` if it lies in [0, 1] (ends open if asked).

  Raises:
    ValueError: as :func:`check_float`, naming ``name``.
  """
  return check_float(name, value, minimum=0.0, maximum=1.0,
                     open_min=open_min, open_max=open_max)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
  """Returns ``value`` if it is one of ``choices``.

  Raises:
    ValueError: ``"{name} must be one of a, b, c, got {value!r}."``; an
      array (what ``optax.inject_hyperparams`` passes for a choice not in
      ``static_args``) is refused with :data:`INJECT_HINT` before the
      membership test.
  """
  choices = tuple(choices)
  _check_kind(name, value, f"one of {show_choices(choices)}",
              lambda _: True)
  if isinstance(value, bool) or value not in choices:
    raise ValueError(f"{name} must be one of {show_choices(choices)}, got "
                     f"{value!r}.")
  return value


def check_sequence(name: str, value: Any, rule: str, *,
                   allow_array: bool = True) -> list:
  """Returns ``list(value)`` if ``value`` is a container of entries: a list,
  tuple, other sequence, iterator or an array of one or more dimensions.

  Refused before anything iterates it: a number, None, a string or bytes
  (iterated as characters), a mapping (iterated as its keys) and a 0-d
  array (NumPy and JAX refuse to iterate one).

  Args:
    name: the argument, as the user spells it (``"events"``).
    rule: what it must be, for the message (``"a sequence of (worker,
      start, end, speed) tuples"``).
    allow_array: False refuses every array (for nested entries such as
      ``(perm, weight)`` terms, which no regular array holds).

  Raises:
    ValueError: ``"{name} must be {rule}, got {value!r}."``.
  """
  if _is_array(value) and (not allow_array or np.ndim(value) == 0):
    raise ValueError(f"{name} must be {rule}, got an array of shape "
                     f"{tuple(np.shape(value))}.")
  if isinstance(value, (str, bytes, Mapping)) or not hasattr(value,
                                                              "__iter__"):
    raise ValueError(f"{name} must be {rule}, got {shown(value)}.")
  return list(value)


def check_type(name: str, value: Any, cls: type, what: str) -> Any:
  """Returns ``value`` if it is an instance of ``cls``.

  Args:
    name: the argument, as the user spells it (``"c"``).
    what: ``cls`` as the user knows it, for the message
      (``"a runtime_model.Cluster"``).

  Raises:
    ValueError: ``"{name} must be {what}, got None."`` or ``"... got an
      object of type {type}."``.
  """
  if not isinstance(value, cls):
    got = ("None" if value is None
           else f"an object of type {type(value).__name__}")
    raise ValueError(f"{name} must be {what}, got {got}.")
  return value


def show_choices(choices: Iterable[Any]) -> str:
  """``choices`` joined by ``", "`` for a message; the empty string (an
  unset field) shows as ``'' (unset)`` instead of nothing."""
  return ", ".join("'' (unset)" if isinstance(c, str) and not c else str(c)
                   for c in choices)


def check_bool(name: str, value: Any) -> bool:
  """Returns ``bool(value)`` if ``value`` is a Python or NumPy bool.

  ``0`` and ``1`` are refused: a flag given as a number is usually another
  argument in the wrong position.

  Raises:
    ValueError: ``"{name} must be a bool (True or False), got {value!r}."``.
  """
  if _is_array(value):
    raise ValueError(f"{name} must be a bool (True or False), got an array; "
                     f"{INJECT_HINT.format(name)}.")
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool (True or False), got {value!r}.")
  return bool(value)


def check_float_dtype(name: str, dtype: Any, *,
                      allow_none: bool = True) -> np.dtype | None:
  """Returns ``np.dtype(dtype)`` if it is a floating dtype (or None if allowed).

  Accepts NumPy, ``ml_dtypes`` (``bfloat16``, ``float8_*``) and ``jnp`` dtypes,
  their scalar types (``np.float16``, ``ml_dtypes.bfloat16``) or their names. An array here is what ``optax.inject_hyperparams`` makes
  of a dtype it took for a schedule.

  Raises:
    ValueError: ``"{name} must be a floating dtype or None, got {dtype!r}."``.
  """
  rule = "a floating dtype" + (" or None" if allow_none else "")
  if dtype is None:
    if allow_none:
      return None
    raise ValueError(f"{name} must be {rule}, got None.")
  if _is_array(dtype):
    raise ValueError(f"{name} must be {rule}, got an array; "
                     f"{INJECT_HINT.format(name)}.")
  try:
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    dt = jnp.dtype(dtype)
    ok = bool(jnp.issubdtype(dt, jnp.floating))
  except (TypeError, ValueError, SyntaxError):  # NumPy parses "1,,2" as code
    ok = False
  if not ok:
    raise ValueError(f"{name} must be {rule}, got {dtype!r}.")
  return dt


def check_comm_dtype(comm_dtype: Any, name: str = "comm_dtype"
                     ) -> np.dtype | None:
  """:func:`check_float_dtype` for a wire dtype, which must also be 16 bits
  or wider and in native byte order: an 8-bit float sent without a scale
  (float8 e4m3's largest value is 448) is what a block-scaled compressor
  is for.

  Raises:
    ValueError: not a floating dtype or None, not native, or narrower than
      16 bits (naming ``compression.format=fp8 or fp4`` as the fix).
  """
  dt = check_float_dtype(name, comm_dtype)
  if dt is not None:
    shown = comm_dtype if isinstance(comm_dtype, str) else (
        dt.name if dt.isnative else dt.str)
    check_wire_width_and_order(
        f"{name}={shown!r}", dt,
        "compression.format=fp8 or fp4, a Compressor")
  return dt


def check_wire_width_and_order(label: str, dt: np.dtype,
                               scaled_fix: str) -> None:
  """The wire rule beyond "a floating dtype", shared by the library and the
  runtime model: native byte order and 16 bits or wider.

  Args:
    label: the field or flag and its value as the user wrote them, for the
      message (``"comm_dtype='>f4'"``).
    dt: the parsed floating dtype (NumPy or ``ml_dtypes``).
    scaled_fix: how the caller's user sends 8-bit values with block scales
      (``"compress=fp8 or fp4"``).

  Raises:
    ValueError: byte-swapped (naming the native name) or an 8-bit float
      (naming ``scaled_fix``); float8 e4m3's largest value is 448.
  """
  if not dt.isnative:
    raise ValueError(f"{label} is not in this machine's byte order; "
                     f"use {dt.newbyteorder('=').name!r}.")
  if dt.itemsize < 2:
    raise ValueError(
        f"{label} is an 8-bit float and has no scale (its largest value is "
        f"{float(np.finfo(dt).max):g}): send values of fewer than 16 bits "
        f"with block scales ({scaled_fix}), or use bfloat16.")


def environment_count(variable: str,
                      maximum: int = MAX_SIMULATED_CPU_DEVICES
                      ) -> int | None:
  """The whole number ``>= 1`` (and ``<= maximum``) an environment variable
  holds, or None if it is unset (e.g. ``JAX_NUM_CPU_DEVICES``, which JAX
  reads when it is imported and refuses with a traceback, empty too).

  Raises:
    ValueError: ``"the environment variable {variable}='...' must be a
      whole number in [1, maximum]; fix or unset it."`` (ASCII digits;
      by default :data:`MAX_SIMULATED_CPU_DEVICES`).
  """
  if variable not in os.environ:
    return None
  text = os.environ[variable].strip()
  if not _whole_in(text, maximum):
    bound = f"[1, {maximum}]"
    raise ValueError(f"the environment variable {variable}={text!r} must be "
                     f"a whole number in {bound}; fix or unset it.")
  return int(text)


def _whole_in(text: str, maximum: int) -> bool:
  """Whether ``text`` is ASCII digits (``str.isdigit`` also takes "²" and
  "８", which ``int`` or XLA then refuse) of a number in [1, maximum]."""
  return (re.fullmatch(r"[0-9]+", text) is not None
          and 1 <= int(text) <= maximum)


#: The XLA option that sets the CPU device count (read from ``XLA_FLAGS``).
XLA_DEVICE_COUNT_OPTION = "xla_force_host_platform_device_count"


def xla_flags_device_count(maximum: int = MAX_SIMULATED_CPU_DEVICES
                           ) -> int | None:
  """The CPU device count ``XLA_FLAGS``' ``--xla_force_host_platform_
  device_count=N`` sets (the last one given), or None if it sets none.
  XLA reads it when JAX starts its CPU backend and aborts the process on a
  value that is not a whole number, printing its whole list of flags.

  Raises:
    ValueError: ``"XLA_FLAGS' --xla_force_host_platform_device_count='...'
      must be a whole number in [1, maximum]; fix it or drop it from
      XLA_FLAGS."`` (ASCII digits, by default at most
      :data:`MAX_SIMULATED_CPU_DEVICES`; XLA aborts the process on a value
      that is not an int32).
  """
  count = None
  for token in os.environ.get("XLA_FLAGS", "").split():
    name, eq, text = token.lstrip("-").partition("=")
    if name != XLA_DEVICE_COUNT_OPTION:
      continue
    if not token.startswith("--") or token.startswith("---"):
      raise ValueError(f"XLA_FLAGS' {token.partition('=')[0]!r} is not "
                       "spelled as XLA reads it (it aborts the process); "
                       f"write --{XLA_DEVICE_COUNT_OPTION}=N.")
    if not eq or not _whole_in(text, maximum):
      raise ValueError(f"XLA_FLAGS' --{XLA_DEVICE_COUNT_OPTION}={text!r} "
                       f"must be a whole number in [1, {maximum}]; fix it or "
                       "drop it from XLA_FLAGS.")
    count = int(text)
  return count


def comma_entries(flag: str, spec: Any, what: str,
                  example: str) -> Iterator[str]:
  """Yields the entries of a comma-separated flag value, stripped, in order.

  An empty (or blank) ``spec`` yields none. An empty entry is refused when
  it is reached, so the caller's checks of the entries before it come first.

  Args:
    flag: the flag as the user spells it (``"--seeds"``).
    spec: its value (``str()`` of it is split).
    what: the entries in the plural, for the message (``"seeds"``).
    example: a good value, for the message (``"--seeds=0,1,2"``).

  Raises:
    ValueError: ``"{flag}={spec!r}: entry {k} is empty; separate the {what}
      by single commas, e.g. {example}."`` (``k`` counts from 1).
  """
  if not str(spec).strip():
    return
  for k, entry in enumerate(x.strip() for x in str(spec).split(",")):
    if not entry:
      raise ValueError(f"{flag}={spec!r}: entry {k + 1} is empty; separate "
                       f"the {what} by single commas, e.g. {example}.")
    yield entry
