"""``decentral-jax overlap``: flags refused before any compile, in one
``error:`` line (exit 2): an unknown ``--fixture_cases`` entry or none of
them run, an ``--xla`` option that a flag of its own sets to another
value, ``--network_gbps`` without a target that reads it, and paths that
cannot be written or read. In process; the compile is replaced by a
function that fails if it is reached."""

from __future__ import annotations

import os

import pytest

from decentral_jax.tools import overlap
from decentral_jax.tools import overlap_flags

_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"


@pytest.fixture(name="no_compile")
def _no_compile(monkeypatch):
  def compile_case(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(overlap, "run_case", compile_case)


def _refused(capsys, tmp_path, argv) -> str:
  argv = [a.replace("DIR", str(tmp_path)) for a in argv]
  if not any(a.startswith("--out") for a in argv):
    argv += ["--out", str(tmp_path / "o.jsonl")]
  try:
    rc = overlap.main(argv)
  except SystemExit as e:  # refused while parsing
    rc = e.code
  assert rc == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  return err[0].replace(str(tmp_path), "DIR")


@pytest.mark.parametrize("argv, says", [
    # An unknown entry, as --cases refuses one.
    (["--cases", "aer", "--fixtures", "DIR/fx", "--fixture_cases", "bogus"],
     "error: argument --fixture_cases: unknown case 'bogus'; one of "
     "gpt_tiny,"),
    # The default --fixture_cases (gpt_tiny,aer,virtual) against diloco.
    (["--cases", "diloco", "--fixtures", "DIR/fx"],
     "error: --fixtures writes the programs of --fixture_cases "
     "(gpt_tiny,aer,virtual), none of which is in --cases (diloco); give "
     "--fixture_cases diloco or drop --fixtures."),
    (["--cases", "aer", "--overlap_limit", "3", "--xla", f"{_LIMIT}=5"],
     f"error: --overlap_limit 3 and --xla {_LIMIT}=5 set the same XLA "
     "option to different values; give one of them."),
    (["--network_gbps", "25", "--xla",
      "xla_gpu_analytical_latency_estimator_options=nic_speed_gbps=1"],
     "error: --network_gbps 25 and --xla xla_gpu_analytical_latency_"
     "estimator_options set the same XLA option; give one of them."),
    (["--targets", "a100_sxm_80", "--network_gbps", "1"],
     "error: --network_gbps has no effect without a Hopper target in "
     "--targets (XLA prices collectives with the analytical latency "
     "estimator it sets only there: h100_sxm, h200); add one or drop "
     "--network_gbps."),
    (["--fixtures", "DIR/afile"], "error: --fixtures 'DIR/afile' is a file, "
     "not a directory"),
    (["--timeline", "--profile", "DIR/none.pbtxt"],
     "error: --profile 'DIR/none.pbtxt' does not exist; give an existing "
     "file."),
    (["--timeline", "--profile", "DIR"], "error: --profile 'DIR' is a "
     "directory; give a file."),
    # An empty path is not "not given": it names the flag.
    (["--fixtures", ""], "error: --fixtures is empty; give a directory."),
    (["--timeline", "--profile", ""], "error: --profile is empty; give a "
     "ProfiledInstructionsProto text file or drop --profile."),
    (["--cases", "gpt2_small", "--data_dir", "DIR/afile"],
     "error: --data_dir 'DIR/afile' is a file, not a directory"),
    (["--cases", "gpt2_small", "--data_dir", "DIR/afile/sub"],
     "error: --data_dir 'DIR/afile/sub' cannot be created: 'DIR/afile' is "
     "a file."),
    (["--cases", "gpt2_small", "--data_dir", ""],
     "error: --data_dir is empty; give a directory."),
    # The directory exists and the permission bits allow it; the file
    # system does not (procfs): the append is tried, not guessed.
    (["--out", "/proc/x.jsonl"], "error: --out '/proc/x.jsonl' cannot be "
     "written (No such file or directory)"),
])
def test_refused_in_one_line_before_compiling(
    capsys, tmp_path, no_compile, argv, says):
  (tmp_path / "afile").write_text("x")
  assert _refused(capsys, tmp_path, argv).startswith(says)
  assert not (tmp_path / "fx").exists() and not (tmp_path / "o.jsonl").exists()



_SHIPPED_H200 = os.path.join(os.path.dirname(overlap_flags.__file__),
                             "gpu_targets", "h200.txtpb")
_TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(overlap_flags.__file__)))), "configs", "gpt_tiny.py")


@pytest.mark.parametrize("argv, out, reads", [
    (["--targets", "DIR/t.txtpb"], "DIR/t.txtpb", "--targets"),
    (["--targets", "h200"], _SHIPPED_H200, "--targets"),
    (["--timeline", "--profile", "DIR/p.txt"], "DIR/p.txt", "--profile"),
    ([], _TINY_CONFIG, "--cases")])
def test_out_naming_an_input_is_refused_before_compiling(
    capsys, tmp_path, no_compile, argv, out, reads):
  import shutil  # pylint: disable=import-outside-toplevel
  shutil.copy(_SHIPPED_H200, tmp_path / "t.txtpb")
  (tmp_path / "p.txt").write_text("x\n")
  path = out.replace("DIR", str(tmp_path))
  before = open(path, "rb").read()
  err = _refused(capsys, tmp_path, ["--cases", "gpt_tiny", *argv, "--out",
                                    path])
  assert err.startswith(f"error: --out '{out}' is the file {reads} reads"), err
  assert open(path, "rb").read() == before


@pytest.mark.parametrize("text, says", [
    # protobuf text format reads nan/inf as doubles: refused, not dropped
    ('costs { name: "fusion.1" cost_us: nan }\n',
     "line 1 (instruction 'fusion.1'): cost_us nan is not a finite number "
     "of microseconds >= 0"),
    ('costs { name: "a" cost_us: 1 }\ncosts { name: "b" cost_us: -inf }\n',
     "line 2 (instruction 'b'): cost_us -inf is not a finite number"),
    ('costs { name: "fusion.1" cost_us: -500 }\n',
     "line 1 (instruction 'fusion.1'): cost_us -500 is not a finite number"),
    ('costs { name: "fusion.1" cost_us: 1e }\n',
     "line 1 (instruction 'fusion.1'): cost_us '1e' is not a number"),
    ("latencies { source: \"a\" target: \"b\" latency_us: 1 }\n",
     "no 'costs"),
    (b"costs \xff", "is not UTF-8 text")])
def test_profile_contents_refused_before_compiling(
    capsys, tmp_path, no_compile, text, says):
  path = tmp_path / "p.pbtxt"
  if isinstance(text, bytes):
    path.write_bytes(text)
  else:
    path.write_text(text)
  err = _refused(capsys, tmp_path, ["--cases", "gpt_tiny", "--timeline",
                                    "--profile", "DIR/p.pbtxt"])
  assert err.startswith("error: --profile DIR/p.pbtxt"), err
  assert says in err, err


def test_profile_read_once_before_compiling(tmp_path):
  path = tmp_path / "p.pbtxt"
  path.write_text('costs { cost_us: 2.5e1 name: "f" }\n'
                  'costs { name: "g" }\n')  # proto3: no cost_us is 0
  args = _args(["--timeline", "--profile", str(path), "--out",
                str(tmp_path / "o.jsonl"), "--cases", "gpt_tiny"])
  overlap_flags.check_paths(args)
  assert args.profile_costs == {"f": 25.0, "g": 0.0}


def _args(argv):
  return overlap.build_parser("overlap").parse_args(argv)


@pytest.mark.parametrize("argv", [
    ["--overlap_limit", "3", "--xla", f"{_LIMIT}=3"],  # the same value
    ["--overlap_limit", "3", "--xla", f"{_LIMIT}=03"],  # written otherwise
    ["--xla", f"{_LIMIT}=5"], ["--overlap_limit", "5"],
    ["--network_gbps", "25", "--xla", f"{_LIMIT}=2"]])
def test_an_xla_option_set_once_or_alike_is_accepted(argv):
  assert overlap_flags.xla_conflict(_args(argv)) is None


def test_fixtures_of_a_case_that_runs_are_accepted():
  argv = ["--cases", "diloco,aer", "--fixtures", "fx", "--fixture_cases",
          "aer,ring"]
  overlap_flags.check_needs(_args(argv), {"--cases", "--fixtures",
                                          "--fixture_cases"})


@pytest.mark.parametrize("major, hopper", [("8", False), ("9", True),
                                           ("10", True)])
def test_a_target_file_is_hopper_from_compute_capability_9(
    tmp_path, major, hopper):
  path = tmp_path / "gpu.txtpb"
  path.write_text("gpu_device_info {\n  cuda_compute_capability {\n"
                  f"    major: {major}\n    minor: 0\n  }}\n}}\n")
  assert overlap_flags.is_hopper(str(path)) is hopper
  argv = ["--targets", str(path), "--network_gbps", "10"]
  rows = {r.flag: r for r in overlap_flags.NEEDS}
  assert rows["--network_gbps"].holds(_args(argv)) is hopper
  assert [overlap_flags.is_hopper(t) for t in
          ("a100_sxm_80", "h100_sxm", "h200")] == [False, True, True]


@pytest.mark.parametrize("value", ["-5", "0", "65", "-0"])
def test_the_xla_spelling_of_the_overlap_limit_takes_its_bounds(
    capsys, tmp_path, no_compile, value):
  """-5 and 0 passed the checks and aborted XLA at the first GPU compile
  (collective_broadcast_overlap_limit <= parallel_collective_overlap_limit
  failed); --overlap_limit itself is bounded."""
  says = _refused(capsys, tmp_path, ["--cases", "gpt_tiny", "--modes",
                                     "after", "--targets", "h200", "--xla",
                                     f"{_LIMIT}={value}"])
  assert says.startswith(f"error: --xla {_LIMIT}=") and (
      "must be an int in [1, 64]") in says, says
  assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("value, n", [("1", 1), ("64", 64), ("08", 8)])
def test_an_xla_overlap_limit_in_bounds_is_kept(value, n):
  given = overlap_flags.xla_options([f"{_LIMIT}={value}"])
  assert int(given[_LIMIT]) == n


def test_out_in_the_fixtures_directory_is_refused_before_compiling(
    capsys, tmp_path, no_compile):
  out = "DIR/fx"
  err = _refused(capsys, tmp_path, [
      "--cases", "gpt_tiny", "--modes", "after", "--fixtures", "DIR/fx",
      "--fixture_cases", "gpt_tiny", "--out", out])
  assert err.startswith(f"error: --out '{out}' lies in the directory "
                        "'DIR/fx' of --fixtures"), err
  assert not (tmp_path / "fx").exists()
