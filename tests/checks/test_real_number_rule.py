"""One rule for a real-number argument: a value ``float()`` cannot hold, or a
NumPy/JAX value of a dtype that is not real and signed, is refused in one
line naming the argument, never accepted with a dropped imaginary part and
never a traceback from deeper down.

Expected messages are written by hand from the docstrings of
``checks.check_float`` and ``optim.check_hyperparameter``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decentral_jax import checks
from decentral_jax import optim
from decentral_jax.comm import compress
from decentral_jax.comm.fault_schedule import FaultSchedule
from decentral_jax.runtime_model import Cluster

BIG = 10**400  # > float64's largest value, about 1.8e308


@pytest.mark.parametrize("call, message", [
    (lambda: checks.check_float("x", BIG),
     "x must be a finite number, got an int of 401 digits."),
    (lambda: checks.check_float("x", -BIG, minimum=0),
     "x must be a finite number >= 0, got a negative int of 401 digits."),
    (lambda: checks.check_probability("p", BIG),
     "p must be a finite number >= 0.0 and <= 1.0, got an int of 401 "
     "digits."),
    (lambda: FaultSchedule.from_rates(4, 10, failure_rate=BIG),
     "failure_rate must be a finite number >= 0.0 and <= 1.0, got an int "
     "of 401 digits."),
    (lambda: compress.Compressor("topk", 4, BIG),
     "fraction must be a finite number > 0.0 and <= 1.0, got an int of 401 "
     "digits."),
    (lambda: Cluster(8, local_size=4, nic_bandwidth_Bps=BIG),
     "nic_bandwidth_Bps must be a finite number > 0, got an int of 401 "
     "digits."),
    (lambda: optim.scale_by_accum_adam(b1=BIG),
     "b1 must be a number in [0, 1), got an int of 401 digits."),
    (lambda: optim.scale_by_accum_adam(eps=-BIG),
     "eps must be a finite number >= 0, got a negative int of 401 digits."),
])
def test_int_beyond_float64_is_one_line(call, message):
  with pytest.raises(ValueError) as info:
    call()
  assert str(info.value) == message


def test_largest_float64_int_is_still_a_number():
  top = int(np.finfo(np.float64).max)  # exactly representable
  assert checks.check_float("x", top) == float(np.finfo(np.float64).max)
  assert checks.is_number(top) and not checks.is_number(top * 2)
  assert optim.concrete_float(BIG) == float("inf")
  assert optim.concrete_float(-BIG) == float("-inf")


@pytest.mark.parametrize("name, value, dtype", [
    ("b1", np.complex128(0.5 + 1j), "complex128"),
    ("b1", jnp.array(0.5 + 2j), "complex64"),
    ("eps", np.array(True), "bool"),
    ("eps", jnp.array(True), "bool"),
    ("b2", np.uint8(0), "uint8"),
    ("b1", np.array(0.5, dtype=object), "object"),
])
def test_hyperparameter_needs_a_real_signed_dtype(name, value, dtype):
  interval = "a number in [0, 1)" if name != "eps" else "a finite number >= 0"
  with pytest.raises(ValueError) as info:
    optim.scale_by_accum_adam(**{name: value})
  assert str(info.value) == (
      f"{name} must be {interval} of a floating or signed integer dtype, "
      f"got a {dtype} value; pass a Python float.")


def test_unsigned_learning_rate_is_refused_not_negated():
  # optax negates the learning rate: -uint8(3) overflowed inside optax.
  with pytest.raises(ValueError) as info:
    optim.check_learning_rate(np.uint8(3))
  assert str(info.value).startswith(
      "learning_rate must be a finite number >= 0 of a floating or signed "
      "integer dtype, got a uint8 value")


def test_traced_complex_hyperparameter_is_refused_by_dtype():
  def build(b1):
    optim.scale_by_accum_adam(b1=b1)
    return b1
  with pytest.raises(ValueError, match="b1 must be a number in .0, 1. of a "
                     "floating or signed integer dtype, got a complex64"):
    jax.jit(build)(jnp.array(0.5 + 1j))


@pytest.mark.parametrize("value", [0.5, 0, np.float32(0.5), np.int64(0),
                                   jnp.float32(0.5), jnp.array(0.25)])
def test_real_hyperparameters_still_accepted(value):
  optim.scale_by_accum_adam(b1=value)
