"""``--flagfile`` of ``train`` and ``compare`` (runner/flagfiles.py).

The lines of readable files are absl's (``read_flags_from_files`` is the
reference); an empty name, a FIFO (also nested: no blocking open), a file
that is not UTF-8 are one ValueError naming ``--flagfile FILE``; a leading
UTF-8 byte order mark is skipped.
"""

import contextlib
import io
import os
import signal

from absl import flags
import pytest

from decentral_jax.runner import flagfiles
from decentral_jax.tools import train
from decentral_jax.tools.compare import flags as compare_flags

PARSERS = [train.parse, compare_flags.parse]


@pytest.fixture(autouse=True)
def _defaults_after():
  """The commands' flags back at their defaults after each test."""
  yield
  train.parse([])
  compare_flags.parse([])


@pytest.fixture
def alarm():
  """A read that blocks (a FIFO without a writer) fails after 5 s."""
  def on_alarm(signum, frame):
    raise TimeoutError("reading the flag file blocked")
  old = signal.signal(signal.SIGALRM, on_alarm)
  signal.setitimer(signal.ITIMER_REAL, 5)
  yield
  signal.setitimer(signal.ITIMER_REAL, 0)
  signal.signal(signal.SIGALRM, old)


def _write(path, data):
  path.write_bytes(data if isinstance(data, bytes) else data.encode())
  return str(path)


def _ours(args):
  return [arg for arg, _ in flagfiles.expand_flagfiles(args)]


def _absl(args):
  return flags.FlagValues().read_flags_from_files(args, force_gnu=False)


def test_readable_files_give_absl_s_arguments(tmp_path, capsys):
  one = _write(tmp_path / "one.ff", b"--a=1\r\n\r\n# c\n// d\n  --b=2  \r"
               b"--c\n\t\n  #e\n--d=x y")
  self_ = tmp_path / "self.ff"
  _write(self_, f"--s=1\n--flagfile={self_}\n--t=2\n")
  a, b = tmp_path / "a.ff", tmp_path / "b.ff"
  _write(a, f"--x=1\n--flagfile={b}\n")
  _write(b, f"--flagfile={a}\n--y=2\n")
  twice = _write(tmp_path / "twice.ff", f"--flagfile={one}\n-flagfile= {one}"
                 " \n--z\n")
  for args in ([f"--flagfile={one}", "--m=1"], ["--flagfile", str(self_)],
               [f"-flagfile={a}"], ["--q", f"--flagfile={twice}"]):
    assert _ours(args) == _absl(args), args
  assert _ours([f"--flagfile={self_}"]) == ["--s=1", "--t=2"]
  assert "circle of flag files" in capsys.readouterr().err


def test_where_names_the_file_and_the_files_that_include_it(tmp_path):
  inner = _write(tmp_path / "inner.ff", "--b=2\n")
  outer = _write(tmp_path / "outer.ff", f"--a=1\n--flagfile={inner}\n")
  assert flagfiles.expand_flagfiles(["--c", "--flagfile", outer, "--",
                                     f"--flagfile={outer}"]) == [
      ("--c", ""), ("--a=1", f" in --flagfile {outer}"),
      ("--b=2", f" in --flagfile {inner}, included by {outer}"), ("--", ""),
      (f"--flagfile={outer}", "")]


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("args", [["--flagfile="], ["--flagfile", ""],
                                  ["--flagfile=  "], ["-flagfile="]])
def test_an_empty_name_is_refused(parse, args):
  with pytest.raises(ValueError) as e:
    parse(args)
  assert str(e.value) == ("--flagfile is empty; give a flag file or drop "
                          "--flagfile.")


@pytest.mark.parametrize("parse", PARSERS)
def test_an_empty_name_inside_a_file_is_refused(parse, tmp_path):
  outer = _write(tmp_path / "outer.ff", "--config.steps=3\n--flagfile=\n")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={outer}"])
  assert str(e.value) == (f"--flagfile in --flagfile {outer} is empty; give "
                          "a flag file or drop --flagfile.")
  last = _write(tmp_path / "last.ff", "--config.steps=3\n--flagfile")
  with pytest.raises(ValueError, match=(
      rf"^--flagfile in --flagfile {last} has no file; give "
      r"--flagfile=FILE\.$")):
    parse([f"--flagfile={last}"])


def test_train_prints_one_error_line_for_an_empty_name():
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    code = train.main(["--config=configs/gpt_tiny.py", "--flagfile="],
                      prog="train")
  assert code == 2
  assert err.getvalue().splitlines() == [
      "error: --flagfile is empty; give a flag file or drop --flagfile. "
      "(see train --help)"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("parse", PARSERS)
def test_a_fifo_is_refused_not_waited_for(parse, tmp_path, alarm):
  fifo = str(tmp_path / "flags.fifo")
  os.mkfifo(fifo)
  reason = ("is not a regular file (a FIFO or a device?); give a text file "
            "of flags, one a line.")
  with pytest.raises(ValueError) as e:
    parse(["--config.steps=2", f"--flagfile={fifo}"])
  assert str(e.value) == f"--flagfile {fifo} {reason}"
  nested = _write(tmp_path / "nested.ff", f"# a FIFO\n--flagfile={fifo}\n")
  with pytest.raises(ValueError) as e:
    parse(["--flagfile", nested])
  assert str(e.value) == f"--flagfile {fifo} in --flagfile {nested} {reason}"
  spaced = _write(tmp_path / "spaced.ff", f"  --flagfile={fifo}\n")
  with pytest.raises(ValueError, match="is not a regular file"):
    parse([f"--flagfile={spaced}"])


@pytest.mark.parametrize("parse", PARSERS)
def test_a_file_that_is_not_utf8_is_named(parse, tmp_path):
  binary = _write(tmp_path / "flags.bin", b"\x1f\x8b\x08\x00binary")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={binary}"])
  assert str(e.value) == (
      f"--flagfile {binary} is not UTF-8 text (byte 0x8b at offset 1); give "
      "a text file of flags, one a line, saved as UTF-8.")
  nul = _write(tmp_path / "nul.ff", b"--a=1\n\x00")
  with pytest.raises(ValueError, match=rf"^--flagfile {nul} holds a NUL "
                     r"byte \(at offset 6\)"):
    parse([f"--flagfile={nul}"])


@pytest.mark.parametrize("parse", PARSERS)
def test_a_byte_order_mark_is_skipped(parse, tmp_path):
  bom = _write(tmp_path / "bom.ff", b"\xef\xbb\xbf--config.steps=4\n")
  assert parse([f"--flagfile={bom}"]) == ([], ["--config.steps=4"])
  bad = _write(tmp_path / "bad.ff", b"\xef\xbb\xbf--a=1\n\xff")  # 3 + 6
  with pytest.raises(ValueError, match=rf"^--flagfile {bad} is not UTF-8 "
                     r"text \(byte 0xff at offset 9\)"):
    parse([f"--flagfile={bad}"])


@pytest.mark.parametrize("parse", PARSERS)
def test_missing_file_and_directory_are_named(parse, tmp_path):
  missing = str(tmp_path / "missing.ff")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={missing}"])
  assert str(e.value) == (f"--flagfile {missing} does not exist; give an "
                          "existing flag file.")
  with pytest.raises(ValueError) as e:
    parse(["--flagfile", str(tmp_path)])
  assert str(e.value) == (f"--flagfile {tmp_path} is a directory; give a "
                          "text file of flags, one a line.")


@pytest.mark.parametrize("parse", PARSERS)
def test_every_refusal_of_a_line_names_its_flag_file(parse, tmp_path):
  """An argument read from a flag file was refused as if typed on the
  command line: no file named, no fix."""
  note = _write(tmp_path / "note.ff", "--config.steps=3\n  # a note\n")
  inner = _write(tmp_path / "inner.ff", "--config.seed=1\n")
  space = _write(tmp_path / "space.ff", f"--flagfile {inner}\n")
  unknown = _write(tmp_path / "unknown.ff", "--no_such_flag=1\n")
  stray = _write(tmp_path / "stray.ff", "stray\n")
  cases = [
      (note, "unexpected argument '# a note' in --flagfile "
       f"{note} (a comment must start the line, no spaces before it); a "
       "flag file holds flags (--name=value), one a line."),
      (stray, f"unexpected argument 'stray' in --flagfile {stray}; a flag "
       "file holds flags (--name=value), one a line."),
      (space, f"Unknown command line flag 'flagfile {inner}' in --flagfile "
       f"{space} (a line is one argument: write --flagfile={inner})"),
      (unknown, "Unknown command line flag 'no_such_flag' in --flagfile "
       f"{unknown}"),
  ]
  for path, message in cases:
    with pytest.raises(ValueError) as e:
      parse([f"--flagfile={path}"])
    assert str(e.value) == message
  assert parse(["stray"]) == (["stray"], [])  # the command judges it


@pytest.mark.parametrize("parse, flag", [(train.parse, "--workdir"),
                                         (compare_flags.parse, "--outdir")])
def test_a_flag_and_value_on_one_line_name_the_file_and_the_fix(
    parse, flag, tmp_path):
  """``--workdir DIR`` (a blank, as typed on a command line) is one
  argument in a flag file: absl calls it an unknown flag ``workdir DIR``;
  the message names the file and says to write ``--workdir=DIR``."""
  path = _write(tmp_path / "run.ff", f"--config.seed=1\n{flag} runs/a\n")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={path}"])
  assert str(e.value) == (
      f"Unknown command line flag '{flag[2:]} runs/a' in --flagfile {path} "
      f"(a line is one argument: write {flag}=runs/a)")
  # A word that names no flag keeps absl's plain "unknown flag".
  other = _write(tmp_path / "other.ff", "--no_such_flag runs/a\n")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={other}"])
  assert str(e.value) == ("Unknown command line flag 'no_such_flag runs/a' "
                          f"in --flagfile {other}")


def test_a_config_override_and_value_on_one_line_name_the_fix(tmp_path):
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  path = _write(tmp_path / "run.ff", "--config.steps 9\n")
  with pytest.raises(ValueError) as e:
    config_lib.load_config("configs/gpt_tiny.py", train.parse(
        [f"--flagfile={path}"])[1])
  assert f"in --flagfile {path} (a line is one argument: write " \
      "--config.steps=9)" in str(e.value), str(e.value)


@pytest.mark.parametrize("parse", PARSERS)
def test_an_override_given_twice_through_files_names_both(parse, tmp_path):
  # A diamond: the user wrote --config.seed once, in d.ff.
  d = _write(tmp_path / "d.ff", "--config.seed=1\n")
  b = _write(tmp_path / "b.ff", f"--flagfile={d}\n")
  c = _write(tmp_path / "c.ff", f"--flagfile={d}\n")
  top = _write(tmp_path / "top.ff", f"--flagfile={b}\n--flagfile={c}\n")
  with pytest.raises(ValueError) as e:
    parse([f"--flagfile={top}"])
  assert str(e.value) == (
      f"--config.seed is given twice (--config.seed=1 in --flagfile {d}, "
      f"included by {b}, included by {top}, then --config.seed=1 in "
      f"--flagfile {d}, included by {c}, included by {top}); give it once.")


def test_a_bad_override_value_from_a_file_names_the_file(tmp_path):
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  path = _write(tmp_path / "o.ff", "--config.steps=5  # five\n"
                "--config.stepz=5\n--config.grad_clip=abc\n")
  _, overrides = train.parse([f"--flagfile={path}"])
  where = f" in --flagfile {path}"
  with pytest.raises(ValueError) as e:
    config_lib.load_config("configs/gpt_tiny.py", overrides[:1])
  assert str(e.value) == (
      f"configs/gpt_tiny.py: --config.steps=5  # five{where} (a comment "
      "must start a line of its own): config.steps must be an integer in "
      "[1, 2147483647], got '5  # five'; set --config.steps=<int>.")
  with pytest.raises(ValueError) as e:
    config_lib.load_config("configs/gpt_tiny.py", overrides[1:2])
  assert str(e.value) == (f"--config.stepz=5{where}: unknown config field "
                          "'stepz' in configs/gpt_tiny.py (did you mean "
                          "steps?).")
  with pytest.raises(ValueError) as e:
    config_lib.load_config("configs/gpt_tiny.py", overrides[2:])
  assert str(e.value).startswith("configs/gpt_tiny.py: ")
  assert str(e.value).endswith(where) and "grad_clip" in str(e.value)
