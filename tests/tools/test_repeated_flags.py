"""A flag given twice is refused in one line (not the last value alone).

argparse commands (:class:`flag_types.Parser`), the absl flags of
``train`` / ``compare`` and the ``--config.FIELD`` overrides of ``train``,
``compare`` and ``learners``; a flag that adds to a list may repeat.
Also: an int field's override is read as a count flag reads it.
"""

import argparse
import contextlib
import io

from absl import flags
import pytest

from decentral_jax import checks
from decentral_jax.runner import config as config_lib
from decentral_jax.tools import flag_types
from decentral_jax.tools import cli
from decentral_jax.tools.learners import main as learners_main


def _parser():
  p = flag_types.Parser(prog="tool")
  p.add_argument("--n-workers", type=int)
  p.add_argument("--fresh", action="store_true")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("rest", nargs="*")
  return p


def _run(fn, *args):
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(
      io.StringIO()):
    try:
      code = fn(*args)
    except SystemExit as e:
      code = e.code
  return code, err.getvalue()


@pytest.mark.parametrize("argv, flag, shown", [
    (["--n-workers", "8", "--n-workers", "32"], "--n-workers",
     "--n-workers 8, then --n-workers 32"),
    (["--n-workers=8", "--n-w", "32"], "--n-workers",
     "--n-workers=8, then --n-w 32"),
    (["--fresh", "--fresh"], "--fresh", "--fresh, then --fresh"),
])
def test_a_repeated_flag_is_one_line(argv, flag, shown):
  code, err = _run(_parser().parse_args, argv)
  assert code == 2
  assert err.strip().splitlines() == [
      f"error: {flag} is given twice ({shown}); give it once. (see tool "
      "--help)"]


def test_a_list_flag_repeats_and_after_dashes_nothing_counts():
  args = _parser().parse_args(["--set", "a=1", "--set", "b=2", "--n-workers",
                               "8", "--", "--n-workers"])
  assert args.set == ["a=1", "b=2"] and args.n_workers == 8
  assert args.rest == ["--n-workers"]
  assert flag_types.repeated_flag(_parser(), ["--set", "x", "--set", "y"]) \
      is None


def test_a_subcommand_s_flag_given_twice_names_its_help():
  code, err = _run(cli.main, ["predict", "--n-workers", "8", "--n-workers",
                              "32"])
  assert code == 2
  assert err.strip().splitlines() == [
      "error: --n-workers is given twice (--n-workers 8, then --n-workers "
      "32); give it once. (see decentral-jax predict --help)"]


def test_an_absl_flag_given_twice_is_refused():
  fv = flags.FlagValues()
  flags.DEFINE_string("config", None, "", flag_values=fv)
  flags.DEFINE_bool("fresh", False, "", flag_values=fv)
  flags.DEFINE_multi_string("tag", [], "", flag_values=fv)
  with pytest.raises(ValueError, match=r"^--config is given twice "
                     r"\(--config=gpt_tiny, then --config=gpt_quick\); give "
                     r"it once\.$"):
    config_lib.parse_command_line(fv, "p", ["--config=gpt_tiny",
                                            "--config=gpt_quick"])
  with pytest.raises(ValueError, match="--fresh is given twice"):
    config_lib.parse_command_line(fv, "p", ["--fresh", "--nofresh"])
  config_lib.parse_command_line(fv, "p", ["--tag=a", "--tag=b"])
  assert fv.tag == ["a", "b"]


def test_an_override_given_twice_is_refused():
  with pytest.raises(ValueError, match=r"^--config\.steps is given twice "
                     r"\(--config\.steps=2, then --config\.steps=3\)"):
    config_lib.split_overrides(["train", "--config.steps=2", "--config.steps",
                                "3"])
  code, err = _run(learners_main.main, ["--config", "gpt_quick",
                                        "--config.steps=2",
                                        "--config.steps=3"])
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "--config.steps is given twice" in err


@pytest.mark.parametrize("text, value", [("1e3", 1000), ("2.0", 2),
                                         ("16", 16)])
def test_an_int_override_reads_as_a_count(text, value):
  c = config_lib.with_overrides(config_lib.base_config,
                                [f"--config.steps={text}"])
  assert c.steps == value and type(c.steps) is int


@pytest.mark.parametrize("text", [
    "2.5", "nan", "inf", "٣", "x",
    # 4 + 1e-18 rounds to the float 4.0; a whole number above 2**63.
    "4.000000000000000001", "99999999999999999999"])
def test_a_non_whole_int_override_names_the_field_rule(text):
  with pytest.raises(ValueError) as e:
    config_lib.with_overrides(config_lib.base_config,
                              [f"--config.steps={text}"])
  assert str(e.value) == (
      f"the config: --config.steps={text}: config.steps must be an integer in [1, "
      f"2147483647], got {text!r}; set --config.steps=<int>.")


@pytest.mark.parametrize("text, value", [
    ("4.000000000000000001", None), ("64.00000000000000001", None),
    ("64.000000000000000000", 64), ("6.4e1", 64), ("1_024", 1024),
    (str(2**63), 2**63), (str(2**63 + 1), None), ("-" + str(2**63), -2**63),
    ("9.223372036854775809e18", None), ("1e19", None), ("1e-30", None)])
def test_a_count_is_read_as_an_exact_decimal(text, value):
  assert checks.whole_number(text) == value
  for parse in (flag_types.integer(1, 2**40), flag_types.power_of_two(1, 2**40)):
    if value is None:
      with pytest.raises(argparse.ArgumentTypeError, match=r"must be .* in \[1, \d+\], got"):
        parse(text)
    elif value in (64, 1024):
      assert parse(text) == value


def test_a_flag_repeated_through_a_flagfile_is_refused(tmp_path):
  """absl inserts a --flagfile's lines into the command line; a flag given
  there and on the command line ran with the later value, unsaid."""
  fv = flags.FlagValues()
  flags.DEFINE_string("methods", None, "", flag_values=fv)
  flags.DEFINE_multi_string("tag", [], "", flag_values=fv)
  one = tmp_path / "one.flags"
  one.write_text("--methods=dadam\n")
  with pytest.raises(ValueError, match=(
      r"^--methods is given twice \(--methods=all_reduce, then "
      rf"--methods=dadam in --flagfile {one}\); give it once\.$")):
    config_lib.parse_command_line(fv, "p", ["--methods=all_reduce",
                                            f"--flagfile={one}"])
  two = tmp_path / "two.flags"
  two.write_text("# both in the file\n--methods=a\n--methods=b\n")
  with pytest.raises(ValueError, match="--methods is given twice"):
    config_lib.parse_command_line(fv, "p", ["--flagfile", str(two)])
  tags = tmp_path / "tags.flags"  # a list flag may repeat; overrides split
  tags.write_text("--tag=a\n--config.steps=3\n")
  assert config_lib.parse_command_line(
      fv, "p", [f"--flagfile={tags}", "--tag=b", "--methods=x"]) == (
          [], ["--config.steps=3"])
  assert fv.tag == ["a", "b"] and fv.methods == "x"
