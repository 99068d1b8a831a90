"""The wire-dtype rule is one rule: the library's ``checks.check_comm_dtype``
(fields, transforms) and the runtime model's ``workload.wire_dtype`` (cluster
and workload files, ``predict`` flags) accept and refuse the same dtype names.

The expected verdicts are written by hand from the rule's statement: a
floating dtype of 16 to 64 bits in native byte order.
"""
import sys

import pytest

from decentral_jax import checks
from decentral_jax.runtime_model import workload

_SWAPPED = ">" if sys.byteorder == "little" else "<"
_NATIVE = "<" if sys.byteorder == "little" else ">"

# name -> sent as-is (True) or refused (False).
VERDICTS = {
    "float16": True, "bfloat16": True, "float32": True, "float64": True,
    f"{_NATIVE}f4": True, f"{_NATIVE}f8": True,
    f"{_SWAPPED}f4": False, f"{_SWAPPED}f2": False, f"{_SWAPPED}f8": False,
    "float8_e4m3fn": False, "float8_e5m2": False,
    "int8": False, "int32": False, "uint16": False, "complex64": False,
    "bool": False,
}


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_both_readers_give_the_rules_verdict(name):
  verdicts = []
  for check in (lambda: checks.check_comm_dtype(name),
                lambda: workload.wire_dtype("comm_dtype", name)):
    try:
      check()
      verdicts.append(True)
    except ValueError as e:
      assert "comm_dtype" in str(e) and "\n" not in str(e), e
      verdicts.append(False)
  assert verdicts == [VERDICTS[name]] * 2, (name, verdicts)


@pytest.mark.parametrize("name, words", [
    (f"{_SWAPPED}f4", "byte order; use 'float32'"),
    ("float8_e4m3fn", "has no scale (its largest value is 448)")])
def test_both_readers_give_the_same_reason(name, words):
  for check in (lambda: checks.check_comm_dtype(name),
                lambda: workload.wire_dtype("comm_dtype", name)):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")
                       .replace(")", r"\)")):
      check()


@pytest.mark.parametrize("name", ["1,,2", "1e-320", "(", "f4,f4"])
def test_names_numpy_reads_as_code_or_records_are_one_line(name):
  """check_comm_dtype passed NumPy's own parser errors through (a
  SyntaxError traceback for "1,,2")."""
  with pytest.raises(ValueError, match=r"comm_dtype must be a floating "
                     r"dtype or None, got"):
    checks.check_comm_dtype(name)
