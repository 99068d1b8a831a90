"""A flag that has an effect only with another is refused without it.

Table-driven over every command's dependency table: each row has a
command line where the flag is refused (exit 2, one ``error: --x has no
effect ...`` line) and one where it is accepted. For ``predict`` the test
also shows the rule is true, from the tables themselves: with the checks
switched off, the refused flag leaves every number ``predict`` prints
unchanged, and in the accepted setting the same flag changes them.
"""

import contextlib
import io
import re

import pytest

from decentral_jax.tools import flag_types
from decentral_jax.tools import overlap
from decentral_jax.tools.compare import flags as compare_flags
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.runtime_model_cli import main as runtime_main
from decentral_jax.tools.runtime_model_cli import predict

from helpers import benchmark_module, load_gpu_check

_AR_DILOCO = "all_reduce,diloco:H=10"
_COMPRESSED = "all_reduce,dadam:topology=static_ring,compress=int8"
_ONE_NODE, _TWO_NODES = ["--preset", "h100_node"], ["--n-workers", "16"]
# (flag and value, a setting where it has no effect, one where it has one)
PREDICT_CASES = [
    # one node per datacenter: every inter-node hop pays the WAN latency
    (["--inter-latency-us", "900000"],
     ["--preset", "cross_region_2dc", "--n-workers", "16"],
     ["--preset", "cross_region_2dc", "--n-workers", "32"]),
    (["--slow-speed", "0.3"], ["--preset", "A40"],
     ["--preset", "A40", "--slow-fraction", "0.25"]),
    (["--slow-fraction", "0.25"], ["--preset", "A40", "--slow-speed", "1"],
     ["--preset", "A40", "--slow-speed", "0.5"]),
    (["--mean-downtime", "5"], ["--preset", "A40"],
     ["--preset", "A40", "--failure-rate", "0.01"]),
    (["--on-failure", "rollback"], ["--preset", "A40", "--methods",
                                    _AR_DILOCO],
     ["--preset", "A40", "--methods", _AR_DILOCO, "--failure-rate", "0.01"]),
    (["--on-failure", "rollback"],
     ["--preset", "A40", "--failure-rate", "0.01", "--methods",
      "all_reduce,aer,local_dsgd:H=4,topology=aer"],
     ["--preset", "A40", "--failure-rate", "0.01", "--methods", _AR_DILOCO]),
    (["--wan-Gbps", "1"], ["--preset", "A40"],
     ["--preset", "cross_region_2dc"]),
    (["--wan-latency-ms", "100"], ["--n-workers", "16"],
     ["--n-workers", "16", "--datacenters", "2"]),
    (["--nic-Gbps", "1"], _ONE_NODE, _TWO_NODES),
    (["--nics-per-node", "4"], _ONE_NODE, _TWO_NODES),
    (["--nic-efficiency", "0.1"], _ONE_NODE, _TWO_NODES),
    (["--flow-Gbps", "1"], _ONE_NODE, _TWO_NODES),
    (["--inter-latency-us", "1e5"], _ONE_NODE, _TWO_NODES),
    (["--multi-node", "ring"], _ONE_NODE,
     ["--n-workers", "32", "--local-size", "4"]),
    (["--half-duplex"], _ONE_NODE, _TWO_NODES),
    # One worker per node, or one node per datacenter: a group mean over
    # nodes has no intra-node stage, tree and ring are one schedule.
    (["--multi-node", "ring"], ["--n-workers", "4", "--local-size", "1"],
     ["--n-workers", "32", "--local-size", "4"]),
    (["--multi-node", "ring"], ["--n-workers", "16", "--datacenters", "2"],
     ["--n-workers", "32", "--local-size", "4", "--datacenters", "2"]),
    # One worker per node and at most two per datacenter: every message
    # between workers is a NIC pair exchange; with more, the All-Reduce's
    # ring over nodes runs at the slower of the intra link and the flow.
    (["--intra-GBps", "0.01"], ["--n-workers", "2", "--local-size", "1"],
     ["--n-workers", "4", "--local-size", "1"]),
    (["--intra-GBps", "0.01"], ["--n-workers", "4", "--local-size", "1",
                                "--datacenters", "2"],
     ["--n-workers", "8", "--local-size", "1", "--datacenters", "2"]),
    # One worker per node of one device: no intra-node hop (--intra-GBps
    # is not refused: a worker's PCIe link carries its NIC traffic too).
    (["--intra-latency-us", "3000"], ["--preset", "A40", "--local-size", "1"],
     ["--preset", "A40"]),
    (["--intra-link", "nvlink"], ["--n-workers", "16", "--local-size", "1"],
     ["--n-workers", "16"]),
    # On one node no traffic goes to a NIC: the link kind changes nothing.
    (["--intra-link", "nvlink"], ["--n-workers", "8"], ["--n-workers", "16"]),
    # A ring over nodes never reads the link kind; only the tree's
    # intra-node stage charges the NIC share to a PCIe link.
    (["--intra-link", "nvlink"], ["--n-workers", "16", "--multi-node",
                                  "ring"], ["--n-workers", "16"]),
    # Workers of two devices: the tree's NIC stage bounds it, pcie and
    # nvlink price alike.
    (["--intra-link", "nvlink"], ["--n-workers", "16",
                                  "--devices-per-worker", "2"],
     ["--n-workers", "16"]),
    (["--worker-layout", "data"], ["--n-workers", "16"],
     ["--n-workers", "16", "--devices-per-worker", "2"]),
    (["--compute-cv", "0.1"],
     ["--n-workers", "16", "--compute-samples-ms", "80,100"],
     ["--n-workers", "16"]),
    (["--codec-GBps", "1"], ["--n-workers", "16", "--methods", "all_reduce"],
     ["--n-workers", "16", "--methods", _COMPRESSED]),
    (["--gossip-in-flight", "0"],
     ["--n-workers", "16", "--methods", "all_reduce,sgp,diloco:H=10"],
     ["--n-workers", "16", "--methods", "all_reduce,aer"]),
    # Compressed gossip blocks, but its break-even line prices the
    # uncompressed gossip, which overlaps: the flag moves that line.
    (["--gossip-in-flight", "0"],
     ["--n-workers", "16", "--methods", "all_reduce,sgp,diloco:H=10"],
     ["--n-workers", "16", "--methods", _COMPRESSED]),
    (["--seed", "7"], ["--n-workers", "16"],
     ["--n-workers", "16", "--compute-cv", "0.2"]),
    # equal samples have no spread: every draw is 100 ms
    (["--seed", "5"], ["--n-workers", "16", "--compute-samples-ms",
                       "100,100"],
     ["--n-workers", "16", "--compute-samples-ms", "80,100"]),
    # all_reduce sends gradients, DiLoCo's global copy goes as float32
    # at least; local_sgd averages the parameters in their dtype.
    (["--param-dtype", "bfloat16"], ["--n-workers", "16", "--methods",
                                     _AR_DILOCO],
     ["--n-workers", "16", "--methods", "all_reduce,local_sgd:H=4"]),
    (["--param-dtype", "float64"], ["--n-workers", "16", "--methods",
                                    "all_reduce,diloco:H=10,compress=int8"],
     ["--n-workers", "16", "--methods", _AR_DILOCO]),
    # a 50 Gbit/s cap on 10 Gbit/s NICs never binds; on 100 Gbit/s it does
    (["--flow-Gbps", "50"], ["--n-workers", "16", "--nic-Gbps", "10"],
     ["--n-workers", "16"]),
    # A40's own 25 Gbit/s cap binds (NIC capacity 58.96 Gbit/s): 99.9
    # replaces it, so it has an effect; on h100_node (one node) none.
    (["--flow-Gbps", "99.9"], ["--n-workers", "16", "--nic-Gbps", "10"],
     ["--preset", "A40", "--n-workers", "16", "--methods", _AR_DILOCO]),
]


def _predict(argv, checked=True):
  """``(exit code, printed numbers, stderr)``; the numbers are stdout but
  the workload and methods lines and the faults line's on_failure (which
  repeat the flags given)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = runtime_main.main(["predict", "--steps", "40", *argv])
    except SystemExit as e:
      code = e.code
  numbers = [re.sub(r"on_failure=\w+", "", line)
             for line in out.getvalue().splitlines()
             if not line.startswith(("workload:", "methods:"))]
  return code, numbers, err.getvalue()


def test_every_predict_row_has_a_case():
  rows = {(r.flag, r.unless) for r in predict.NEEDS}
  hit = set()
  for flag_args, refused, _ in PREDICT_CASES:
    _, _, err = _predict(refused + flag_args)
    hit |= {(r.flag, r.unless) for r in predict.NEEDS
            if f"error: {r.message()}" in err}
  assert hit == rows, rows - hit


@pytest.mark.parametrize("flag_args, refused, accepted", PREDICT_CASES,
                         ids=[" ".join(c[0]) + f" {k}"
                              for k, c in enumerate(PREDICT_CASES)])
def test_predict_flag_refused_where_it_has_no_effect(
    flag_args, refused, accepted, monkeypatch):
  flag = flag_args[0]
  code, _, err = _predict(refused + flag_args)
  assert code == 2, err
  lines = [x for x in err.splitlines() if "error:" in x]
  assert len(lines) == 1 and lines[0].startswith(
      f"error: {flag} has no effect "), err
  code, with_flag, err = _predict(accepted + flag_args)
  assert code == 0, err
  # The rule is true: with the checks off, the flag changes nothing where
  # it is refused and changes the numbers where it is accepted.
  monkeypatch.setattr(predict, "NEEDS", ())
  code, alone, _ = _predict(refused)
  assert code == 0
  assert _predict(refused + flag_args)[1] == alone
  assert _predict(accepted)[1] != with_flag


def test_intra_link_refused_on_one_node_preset():
  # h100_node is one node of 8 (NVLink): pcie would change no number.
  code, _, err = _predict(["--preset", "h100_node", "--intra-link", "pcie"])
  assert code == 2 and err.startswith(
      "error: --intra-link has no effect on one node"), err


@pytest.mark.slow  # 40 clusters, three predictions each
def test_intra_link_accepted_exactly_where_it_moves_a_number(monkeypatch):
  # Over a sweep of clusters, --intra-link is accepted exactly where a
  # group mean runs the tree over nodes of several workers: with the
  # checks off, there it changes the printed numbers, elsewhere none.
  methods = "all_reduce,one_peer_exp,aer,sgp,diloco:H=10,local_sgd:H=4"
  settings = [["--n-workers", str(n), "--local-size", str(ls),
               "--multi-node", mn, "--datacenters", str(dc),
               "--methods", methods] + extra
              for n, ls in ((8, 8), (16, 8), (16, 4), (16, 1), (32, 2))
              for mn in ("ring", "tree") for dc in (1, 2)
              for extra in ([], ["--devices-per-worker", "2"])]
  accepted = [_predict(s + ["--intra-link", "nvlink"])[0] for s in settings]
  assert set(accepted) == {0, 2}
  monkeypatch.setattr(predict, "NEEDS", ())
  for s, code in zip(settings, accepted):
    moves = _predict(s)[1] != _predict(s + ["--intra-link", "nvlink"])[1]
    # by hand: tree, two or more workers per node, several nodes in a
    # datacenter (n / datacenters workers above --local-size)
    n, ls, dc = int(s[1]), int(s[3]), int(s[7])
    assert (code == 0) == moves, s
    assert not moves or (s[5] == "tree" and 1 < ls < n // dc), s


def test_seed_with_equal_samples_says_they_do_not_vary():
  code, _, err = _predict(["--n-workers", "16", "--compute-samples-ms",
                           "100,100", "--seed", "5"])
  assert code == 2 and err.startswith(
      "error: --seed has no effect with compute samples that do not vary"
  ) and "give samples that differ" in err, err


def test_the_issue_cases_one_line_each():
  for argv, says in (
      (["--preset", "A40", "--slow-speed", "0.3"],
       "error: --slow-speed has no effect without --slow-fraction above 0; "
       "add --slow-fraction F (the share of slow workers) or drop "
       "--slow-speed."),
      (["--preset", "A40", "--mean-downtime", "5"],
       "error: --mean-downtime has no effect without --failure-rate above 0"),
      (["--preset", "A40", "--on-failure", "rollback"],
       "error: --on-failure has no effect without --failure-rate above 0"),
      (["--preset", "A40", "--slow-fraction", "0.25", "--slow-speed", "1"],
       "error: --slow-fraction has no effect with --slow-speed 1"),
      (["--preset", "A40", "--wan-Gbps", "5"],
       "error: --wan-Gbps has no effect without --datacenters above 1"),
      (["--preset", "A40", "--wan-latency-ms", "5"],
       "error: --wan-latency-ms has no effect without --datacenters above 1"),
      # An abbreviation is the flag it stands for.
      (["--preset", "A40", "--slow-sp", "0.3"],
       "error: --slow-speed has no effect")):
    code, _, err = _predict(argv)
    assert code == 2 and says in err, err


def _compare_needs(argv, clusters):
  compare_flags.parse(argv)
  compare_flags.check_needs(clusters)


@pytest.mark.parametrize("argv, clusters, says", [
    (["--clusters=", "--workload=1b"], (),
     "--workload has no effect without --clusters"),
    (["--clusters=c.json", "--workload=gpt2_small"],
     (pricing.PricingCluster("c.json", path="c.json"),),
     "--workload has no effect when every --clusters entry is a cluster "
     "file"),
])
def test_compare_workload_needs_a_cluster_it_prices(argv, clusters, says):
  with pytest.raises(ValueError) as e:
    _compare_needs(argv, clusters)
  assert str(e.value).startswith(says)
  # Accepted: a preset to price, a workload file for cluster files, or
  # --workload not given.
  _compare_needs(["--workload=1b"], (pricing.PricingCluster("A40", "A40"),))
  _compare_needs(["--workload=w.json"],
                 (pricing.PricingCluster("c.json", path="c.json"),))
  _compare_needs(["--clusters="], ())


def test_compare_clusters_empty_with_workload_exits_2(tmp_path, capsys):
  from decentral_jax.tools import compare
  code = compare.main([f"--outdir={tmp_path}", "--clusters=",
                       "--workload=1b"])
  assert code == 2
  err = capsys.readouterr().err
  assert "error: --workload has no effect without --clusters" in err, err


def _gpu_check():
  return load_gpu_check("gpu_check_flags_needs")


def _gpu_flags():
  return benchmark_module("_gpu_check_flags")


_DEVICELESS = ["--deviceless", "h200"]
GPU_CHECK_CASES = [
    (["--topology", "1x1x8"], [], _DEVICELESS, "without --deviceless"),
    (["--quiet"], [], _DEVICELESS, "without --deviceless"),
    (["--part", "timing"], _DEVICELESS, [], "with --deviceless"),
    (["--smoke"], _DEVICELESS, [], "with --deviceless"),
    # no part runs with --deviceless: the parts' numbers are read by none
    (["--steps", "3"], _DEVICELESS, [], "with --deviceless (it is read by "
     "--part timing on this machine's devices)"),
    (["--batch", "4"], _DEVICELESS, ["--part", "timing"], "with --deviceless"),
    (["--repeats", "2"], _DEVICELESS, [], "with --deviceless"),
    (["--peak_flops", "1e15"], _DEVICELESS, [], "with --deviceless"),
    (["--smoke"], ["--part", "schedule"], ["--part", "timing"],
     "without --part timing (or all)"),
    (["--child_timeout", "10"], ["--part", "timing"], ["--part", "schedule"],
     "without --part schedule (or all)"),
    (["--warm_steps", "2"], ["--part", "schedule"],
     ["--part", "gossip_timing"], "without --part gossip_timing (or all)"),
    (["--programs", "none"], ["--part", "timing"], ["--part", "schedule"],
     "without --part schedule (or all) or --deviceless"),
    (["--set", "n_workers=4"], ["--part", "timing"],
     ["--part", "gossip_timing"],
     "without --part schedule or gossip_timing (or all) or --deviceless"),
    (["--gemm_efficiency", "0.4"], _DEVICELESS, _DEVICELESS + ["--roofline"],
     "without --roofline"),
    (["--memory_efficiency", "0.4"], [], ["--roofline"], "without --roofline"),
]


@pytest.mark.parametrize("flag_args, refused, accepted, says",
                         GPU_CHECK_CASES)
def test_gpu_check_flag_refused_where_nothing_reads_it(
    flag_args, refused, accepted, says, capsys):
  gpu_flags = _gpu_flags()
  with pytest.raises(SystemExit) as e:
    gpu_flags.parse_args(refused + flag_args)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"error: {flag_args[0]} has no effect {says}" in err, err
  gpu_flags.parse_args(accepted + flag_args)


def test_gpu_check_timing_on_a_cpu_without_smoke_is_refused_first(capsys):
  # GPT-2 small at a GPU's batch does not fit a CPU host (about 100 GB):
  # refused before anything is built, naming the flag that fixes it.
  import jax
  assert jax.default_backend() == "cpu"
  for argv in (["--part", "timing"], []):
    with pytest.raises(SystemExit) as e:
      _gpu_check().main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "add --smoke" in err, err


def test_gpu_check_reader_table_names_real_flags():
  gpu_flags = _gpu_flags()
  flags = flag_types.given_flags(gpu_flags.build_parser(), [
      f for f in gpu_flags.FLAG_READERS])
  assert flags == set(gpu_flags.FLAG_READERS)


def _overlap_needs(argv):
  ap = overlap.build_parser("overlap")
  overlap.check_needs(ap.parse_args(argv), flag_types.given_flags(ap, argv))


@pytest.mark.parametrize("flag_args, refused, accepted, says", [
    (["--gpus_per_node", "8"], [], ["--network_gbps", "100"],
     "without --network_gbps above 0"),
    (["--profile", "p.txt"], [], ["--timeline"], "without --timeline"),
    (["--fixture_cases", "aer"], [], ["--fixtures", "fx"],
     "without --fixtures"),
    (["--data_dir", "d"], ["--cases", "aer"], ["--cases", "gpt2_small"],
     "without a gpt2_small case in --cases"),
    (["--cases", "aer"], ["--render", "a.jsonl"], [], "with --render"),
    # Mode before compiles every program; --all_programs reads mode after.
    (["--all_programs"], ["--modes", "before"], ["--modes", "before,after"],
     "without mode after in --modes"),
])
def test_overlap_flag_refused_where_nothing_reads_it(
    flag_args, refused, accepted, says):
  with pytest.raises(ValueError) as e:
    _overlap_needs(refused + flag_args)
  assert str(e.value).startswith(f"{flag_args[0]} has no effect {says}")
  _overlap_needs(accepted + flag_args)


@pytest.mark.parametrize("argv, says", [
    (["--cases", "gpt_tiny,gpt_tiny"], "argument --cases: 'gpt_tiny,gpt_tiny'"
     ": entry 2 repeats entry 1 ('gpt_tiny'); give each value once"),
    (["--modes", "after,after"], "argument --modes: 'after,after': entry 2 "
     "repeats entry 1 ('after')"),
    (["--targets", "h200, h200"], "argument --targets: 'h200, h200': entry 2 "
     "repeats entry 1 ('h200')"),
    (["--targets", "h999"], "argument --targets: unknown target 'h999'; one "
     "of a100_sxm_80, h100_sxm, h200 or a .txtpb file"),
    (["--targets", ""], "argument --targets: needs at least one target"),
    (["--targets", "h200,"], "argument --targets: 'h200,': entry 2 is empty"),
    (["--targets", "DIR/none.txtpb"], "argument --targets: target file "
     "'DIR/none.txtpb' does not exist"),
    (["--cases", "nosuch"], "argument --cases: unknown case 'nosuch'; one of "
     "gpt_tiny, dadam"),
    (["--modes", "during"], "argument --modes: unknown mode 'during'; one of "
     "before, after"),
])
def test_overlap_list_flags_refused_at_parse_time(
    monkeypatch, capsys, tmp_path, argv, says):
  def compile_case(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(overlap, "run_case", compile_case)
  argv = [a.replace("DIR", str(tmp_path)) for a in argv]
  with pytest.raises(SystemExit) as e:
    overlap.main([*argv, "--out", str(tmp_path / "o.jsonl")])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: " + says.replace("DIR", str(tmp_path))), err


def test_overlap_list_flags_accept_each_entry_once(tmp_path):
  ap = overlap.build_parser("overlap")
  target = tmp_path / "t.txtpb"
  target.write_text("")
  args = ap.parse_args(["--cases", "gpt_tiny, aer", "--modes", "after",
                        "--targets", f"h200,a100_sxm_80,{target}"])
  assert (args.cases, args.modes, args.targets) == (
      "gpt_tiny,aer", "after", f"h200,a100_sxm_80,{target}")
  # The names the flag accepts are the targets gpu_compile compiles for.
  from decentral_jax.tools import gpu_compile, overlap_flags
  assert sorted(overlap_flags.shipped_targets()) == sorted(gpu_compile.TARGETS)


def test_overlap_refusal_is_one_line_exit_2(capsys):
  assert overlap.main(["--profile", "p.txt"]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1 and "--profile has no effect" in err


@pytest.mark.parametrize("xla", ["garbage", "xla_gpu_x=", "=1", "gpu_x=1"])
def test_overlap_xla_option_must_be_key_value(capsys, tmp_path, xla):
  assert overlap.main(["--xla", xla, "--out", str(tmp_path / "o.md")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == (f"error: --xla {xla!r} must be KEY=VALUE with an XLA "
                     "option name, e.g. --xla xla_gpu_enable_latency_hiding_"
                     "scheduler=true."), err


@pytest.mark.parametrize("xla, says", [
    # XLA's DebugOptions field is a bool: its parser takes True/False only.
    ("xla_gpu_enable_latency_hiding_scheduler=maybe",
     "While setting option xla_gpu_enable_latency_hiding_scheduler, 'maybe' "
     "is not a valid bool value; a bool takes true or false"),
    ("xla_gpu_experimental_parallel_collective_overlap_limit=two",
     "'two' is not a valid int32 value; a bool takes true or false, an int "
     "a whole number."),
    ("xla_no_such_option=1", "No such compile option: 'xla_no_such_option'; "
     "check the name against XLA's DebugOptions."),
    # "true" is handed to XLA as a bool, which XLA quotes as '1': the
    # refusal quotes what was typed.
    ("xla_gpu_experimental_parallel_collective_overlap_limit=true",
     "While setting option xla_gpu_experimental_parallel_collective_overlap_"
     "limit, 'true' is not a valid int32 value; a bool takes true or false, "
     "an int a whole number."),
    ("xla_gpu_experimental_parallel_collective_overlap_limit=FALSE",
     "limit, 'FALSE' is not a valid int32 value"),
    # a map-valued option: no value of --xla sets it, the fix says where
    ("xla_gpu_analytical_latency_estimator_options=nic_speed_gbps=100",
     "'nic_speed_gbps=100' is not a valid message value; --xla sets only "
     "bool, number, string and enum options, and xla_gpu_analytical_"
     "latency_estimator_options takes a message (a map or proto); use "
     "--network_gbps and --gpus_per_node instead."),
    ("xla_gpu_analytical_latency_estimator_options=nic_speed_gbps: 100",
     "is not a valid message value; --xla sets only bool, number, string "
     "and enum options")])
def test_overlap_xla_option_xla_refuses_is_one_line_before_compiling(
    monkeypatch, capsys, tmp_path, xla, says):
  """A value of the wrong type ended the first case's compile in a
  traceback (JaxRuntimeError INVALID_ARGUMENT)."""
  def compile_case(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(overlap, "run_case", compile_case)
  assert overlap.main(["--cases", "gpt_tiny", "--modes", "before", "--xla",
                       xla, "--out", str(tmp_path / "o.jsonl")]) == 2
  err = [l for l in capsys.readouterr().err.strip().splitlines()
         if l.startswith(("error", "Traceback"))]
  assert len(err) == 1 and err[0].startswith(
      "error: --xla: XLA refuses it: ") and says in err[0], err


def test_overlap_xla_message_option_without_a_flag_goes_to_xla_flags():
  from decentral_jax.tools import overlap_flags
  got = overlap_flags.xla_refusal(
      ["xla_backend_extra_options=a"], "While setting option "
      "xla_backend_extra_options, 'a' is not a valid message value.")
  assert got == ("--xla: XLA refuses it: While setting option "
                 "xla_backend_extra_options, 'a' is not a valid message "
                 "value; --xla sets only bool, number, string and enum "
                 "options, and xla_backend_extra_options takes a message (a "
                 "map or proto); set it in XLA_FLAGS "
                 "(--xla_backend_extra_options=...) instead.")


def test_overlap_xla_values_are_spelled_as_xla_parses_them(
    tmp_path, monkeypatch):
  from decentral_jax.tools import gpu_compile, overlap_flags
  monkeypatch.chdir(tmp_path)  # the probe's dump goes to a temporary folder
  got = overlap_flags.xla_options([
      "xla_gpu_enable_latency_hiding_scheduler=true",
      "xla_gpu_enable_highest_priority_async_stream = FALSE",
      "xla_gpu_experimental_parallel_collective_overlap_limit=2",
      "xla_dump_to=3"])
  assert got == {"xla_gpu_enable_latency_hiding_scheduler": True,
                 "xla_gpu_enable_highest_priority_async_stream": False,
                 "xla_gpu_experimental_parallel_collective_overlap_limit":
                 "2", "xla_dump_to": "3"}
  gpu_compile.check_compiler_options(got)  # XLA takes each of them
  assert list(tmp_path.iterdir()) == []  # no dump folder "3" left here
  with pytest.raises(ValueError, match="given twice"):
    overlap_flags.xla_options(["xla_dump_to=a", "xla_dump_to=b"])


@pytest.mark.parametrize("out, says", [
    ("", "--out is empty; give a file name."),
    ("DIR", "--out 'DIR' is a directory; give a file name."),
    ("DIR/no/o.jsonl", "--out 'DIR/no/o.jsonl': 'DIR/no' does not exist")])
def test_overlap_out_is_checked_before_compiling(
    monkeypatch, capsys, tmp_path, out, says):
  def compile_case(*a, **k):
    raise AssertionError("compiled")
  monkeypatch.setattr(overlap, "run_case", compile_case)
  out = out.replace("DIR", str(tmp_path))
  assert overlap.main(["--cases", "aer", f"--out={out}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {says.replace('DIR', str(tmp_path))}"
                 + ("" if "exist" not in says else
                    "; give a file in an existing directory.")], err


def test_pipelined_gossip_without_in_flight_fractions_is_refused(monkeypatch):
  """``dadam:pipelined=1`` differs from ``dadam`` only in hiding the
  optimizer's update inside the in-flight window: without fractions the
  tables are the same, so the key is refused; with them it is read."""
  base = ["--preset", "A40", "--n-workers", "16", "--methods",
          "all_reduce,dadam"]
  piped = ["--preset", "A40", "--n-workers", "16", "--methods",
           "all_reduce,dadam:pipelined=1"]
  code, _, err = _predict(piped)
  assert code == 2 and "pipelined=1 has no effect" in err, err
  assert "--gossip-in-flight" in err
  # The rule switched off: the numbers are those of plain dadam.
  monkeypatch.setattr(predict.predict_needs, "check_pipelined",
                      lambda s: None)
  assert _values(_predict(piped)[1]) == _values(_predict(base)[1])
  monkeypatch.undo()
  fractions = ["--gossip-in-flight", "0.5,0.5"]
  code, numbers, err = _predict(piped + fractions)
  assert code == 0, err
  assert _values(numbers) != _values(_predict(base + fractions)[1])


def test_pipelined_gossip_without_optimizer_time_is_refused(monkeypatch):
  """With in-flight fractions a pipelined round hides the optimizer's
  update too (C + O + max(0, tau - W - O)): with O = 0 and a one-round
  topology (static_ring) nothing is hidden and the rounds run in the same
  order, so the tables equal plain dadam's and the key is refused, naming
  --optimizer-ms; with O > 0 it is read."""
  flags = ["--n-workers", "16", "--gossip-in-flight", "0.1,0.1"]
  base = [*flags, "--methods", "all_reduce,dadam:topology=static_ring"]
  piped = [*flags, "--methods",
           "all_reduce,dadam:topology=static_ring,pipelined=1"]
  code, _, err = _predict(piped)
  assert code == 2 and err.count("\n") == 1, err
  assert "pipelined=1 has no effect with an optimizer time of 0" in err
  assert "give --optimizer-ms above 0 or drop pipelined=1" in err
  monkeypatch.setattr(predict.predict_needs, "check_pipelined",
                      lambda s: None)
  assert _values(_predict(piped)[1]) == _values(_predict(base)[1])
  monkeypatch.undo()
  optimizer = ["--optimizer-ms", "10"]
  code, numbers, err = _predict(piped + optimizer)
  assert code == 0, err
  assert _values(numbers) != _values(_predict(base + optimizer)[1])
  # O = 0 on a ring (two rounds) whose compute varies: the simulation's
  # round order floor(k/2) changes which neighbour a slow step waits for.
  noisy = ["--compute-cv", "0.3", "--methods"]
  code, numbers, err = _predict(
      [*flags, *noisy, "all_reduce,dadam:topology=ring,pipelined=1"])
  assert code == 0, err
  assert _values(numbers) != _values(_predict(
      [*flags, *noisy, "all_reduce,dadam:topology=ring"])[1])


def _values(lines):
  """The words of ``lines`` but the method labels (which spell the spec)."""
  return [t for line in lines for t in line.split() if "dadam" not in t]
