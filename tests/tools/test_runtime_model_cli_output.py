"""What the runtime model's command line tells a new user: the workload it
priced, the methods it compared (local-update methods by default across
datacenters), the worker count it chose, the Figure 6 rows beyond the
acceptance's tolerance, and what the measured-vs-model All-Reduce check of a
cluster file means. Expected values are worked out by hand (formulas in the
comments) or come from the stored inputs (fitted constants), never from
the printed output itself."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re

import pytest


from decentral_jax.tools.runtime_model_cli import cluster_header
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import parser as cli_parser
from decentral_jax.tools.runtime_model_cli import tables
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import recommend
from decentral_jax.tools.compare import pricing

LOCAL = ("local_sgd:H=10", "diloco:H=10", "streaming_diloco:H=10,P=2,tau=0")


def _run(capsys, *argv) -> tuple[int, str, str]:
  rc = cli.main(["predict", "--steps", "20", *argv])
  out = capsys.readouterr()
  return rc, out.out, out.err


def _line(out: str, start: str) -> str:
  lines = [l for l in out.splitlines() if l.startswith(start)]
  assert len(lines) == 1, (start, out)
  return lines[0]


def _rows(out: str) -> list[str]:
  """The method names of the tables, in order (first column)."""
  return [l.split()[0] for l in out.splitlines()
          if l.startswith("  ") and not l.startswith(("  method", "  MB/it",
                                                      "  recommendation",
                                                      "  local-update"))]


# --- 1a: the workload header -------------------------------------------------


def test_the_header_names_the_default_workload_and_how_to_change_it(capsys):
  rc, out, _ = _run(capsys, "--preset", "cross_region_2dc", "--n-workers",
                    "16,32")
  assert rc == 0
  head = _line(out, "workload:")
  # The flags' defaults: 65e6 parameters, forward 30 + backward 60 ms.
  assert "65M parameters (float32 gradients, float32 parameters" in head
  assert "compute 90.0 ms per step" in head
  assert "the workload flags' defaults" in head
  assert "--workload gpt2_small|1b|figure6" in head and "--params" in head
  assert out.index("workload:") < out.index("n=16 workers")


def test_the_header_names_a_named_or_fitted_workload(capsys):
  rc, out, _ = _run(capsys, "--preset", "h100_ib", "--workload", "1b",
                    "--params", "2e9", "--n-workers", "16")
  assert rc == 0
  head = _line(out, "workload:")
  # 1b's 100 ms of compute; --params overrides its parameter count.
  assert "2B parameters" in head and "compute 100.0 ms per step" in head
  assert "from --workload 1b" in head and "(--params as given)" in head
  # Figure 6's A40: compute a + b/n of the stored fit, per worker count.
  rc, out, _ = _run(capsys, "--preset", "A40", "--n-workers", "16,32")
  assert rc == 0
  fit = paper.FITTED["A40"]
  ms = [1e3 * (fit["a_s"] + fit["b_s"] / n) for n in (16, 32)]
  head = _line(out, "workload:")
  assert f"compute {ms[0]:.1f} ms at n=16, {ms[1]:.1f} ms at n=32" in head
  assert "--preset A40's own workload (--workload figure6)" in head


def test_the_header_names_a_measured_workload(tmp_path, capsys):
  from decentral_jax.runtime_model import cluster_file
  path = str(tmp_path / "c.json")
  c = Cluster(n_workers=4, local_size=4)
  cluster_file.write(path, {
      "cluster": dataclasses.asdict(c),
      "workload": {"param_count": 7e6, "forward_s": 0.01,
                   "backward_s": 0.02, "compute_cv": 0.0},
      "measurements": {}, "meta": {}})
  rc, out, _ = _run(capsys, "--cluster", path, "--methods", "all_reduce")
  assert rc == 0
  head = _line(out, "workload:")
  assert "7M parameters" in head and "compute 30.0 ms per step" in head
  assert f"from --cluster {path}, measured by `measure`" in head


# --- 1b: the methods compared ------------------------------------------------


def test_local_update_methods_are_compared_by_default_across_datacenters(
    capsys):
  rc, out, _ = _run(capsys, "--preset", "cross_region_2dc", "--n-workers",
                    "16")
  assert rc == 0
  assert _rows(out) == ["All-Reduce", "DAdam", "DAdam", *LOCAL]
  line = _line(out, "methods:")
  assert line.startswith("methods: all_reduce,one_peer_exp,aer,"
                         "local_sgd:H=10,diloco:H=10,"
                         "streaming_diloco:H=10,P=2 (the default across "
                         "datacenters")
  # The same list given explicitly prices the same table.
  rc, given, _ = _run(capsys, "--preset", "cross_region_2dc", "--n-workers",
                      "16", "--methods", line.split()[1])
  assert rc == 0
  assert given[given.index("n=16"):] == out[out.index("n=16"):]
  assert "(as given by --methods)" in _line(given, "methods:")


def test_all_reduce_added_to_the_given_methods_is_named_the_baseline(
    capsys):
  rc, out, _ = _run(capsys, "--n-workers", "8", "--methods",
                    "one_peer_exp,diloco:H=10")
  assert rc == 0
  assert _rows(out)[0] == "All-Reduce"
  assert _line(out, "methods:") == (
      "methods: all_reduce,one_peer_exp,diloco:H=10 (--methods, with "
      "all_reduce added: the baseline every speedup refers to)")


def test_one_datacenter_keeps_the_papers_comparison(capsys):
  rc, out, _ = _run(capsys, "--preset", "h100_ib", "--n-workers", "16")
  assert rc == 0
  assert _rows(out) == ["All-Reduce", "DAdam", "DAdam"]
  line = _line(out, "methods:")
  assert "(the default within one datacenter" in line
  assert "diloco:H=10" in line  # how to add them
  # Explicit methods are what is compared, with All-Reduce as baseline.
  rc, out, _ = _run(capsys, "--preset", "cross_region_2dc", "--n-workers",
                    "16", "--methods", "aer")
  assert rc == 0 and _rows(out) == ["All-Reduce", "DAdam"]


# --- 2: one list of workload names -------------------------------------------


def test_predict_and_compare_accept_the_same_workload_names():
  assert presets.WORKLOAD_NAMES == ("gpt2_small", "1b", "figure6")
  parser = cli_parser.build_parser()
  for name in presets.WORKLOAD_NAMES:
    assert parser.parse_args(["predict", "--workload", name]).workload == name
  with pytest.raises(SystemExit):
    parser.parse_args(["predict", "--workload", "figure7"])
  # The main job adds "own": each cluster with its own GPUs' workload.
  assert pricing.WORKLOAD_NAMES == (*presets.WORKLOAD_NAMES, "own")
  assert pricing.FIGURE6_PRESETS == ("T4", "A40", "A100")
  for name in pricing.WORKLOAD_NAMES:
    assert pricing.check_workload(name) == name


def test_workload_figure6_is_the_figure6_presets_own(capsys):
  rc, fitted, _ = _run(capsys, "--preset", "A40", "--workload", "figure6",
                       "--n-workers", "16")
  assert rc == 0
  rc, default, _ = _run(capsys, "--preset", "A40", "--n-workers", "16")
  assert rc == 0
  assert fitted[fitted.index("n=16"):] == default[default.index("n=16"):]
  # Elsewhere it does not exist: one error line, nothing printed.
  for argv in (["--preset", "h100_ib"], [], ["--n-workers", "8"]):
    rc, out, err = _run(capsys, "--workload", "figure6", *argv)
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and "--workload figure6" in err
    assert "--preset T4 or A40 or A100" in err
  with pytest.raises(ValueError, match="fitted to Figure 6's clusters"):
    presets.setup("cross_region_2dc", 16, "figure6")
  with pytest.raises(ValueError, match="use it with the preset"):
    presets.workload("figure6")


# --- 3: the default worker count ---------------------------------------------


@pytest.mark.parametrize("name, preferred, expected", [
    # 16 where the preset holds it (a multiple of its GPUs per node x
    # datacenters), else the next such multiple, else all its GPUs.
    ("cross_region_2dc", 16, 16), ("cross_region_4dc", 16, 32),
    ("h100_node", 16, 8), ("h100_ib", 16, 16), ("T4", 16, 16),
    ("A40", 16, 16), ("A100", 16, 16), ("h100_ib", 20, 24),
    ("T4", 20, 24), ("A40", 20, 20), ("cross_region_4dc", 40, 64),
    ("h100_node", 4, 4)])
def test_default_workers_is_the_first_count_a_preset_holds(name, preferred,
                                                           expected):
  assert presets.default_workers(name, preferred) == expected
  presets.cluster(name, expected)  # holds it
  if presets.CLUSTERS[name].max_workers is None:
    for n in range(preferred, expected):
      with pytest.raises(ValueError):
        presets.cluster(name, n)


def test_predict_without_n_workers_takes_a_count_the_preset_holds(capsys):
  rc, out, _ = _run(capsys, "--preset", "cross_region_4dc", "--workload",
                    "gpt2_small", "--methods", "all_reduce")
  assert rc == 0
  assert "n=32 workers (4 datacenters x 1 node x 8" in out
  assert _line(out, "workers:").startswith(
      "workers: 32 (--n-workers not given: the smallest count from 16 on "
      "that --preset cross_region_4dc holds")
  rc, out, _ = _run(capsys, "--preset", "h100_node", "--methods",
                    "all_reduce", "--params", "1e8")
  assert rc == 0 and "n=8 workers (1 node x 8)" in out
  assert ("from the workload flags (--params as given, the rest at their "
          "defaults)") in _line(out, "workload:")
  assert "all GPUs of --preset h100_node" in _line(out, "workers:")
  # Given explicitly, a count the preset does not hold is still refused.
  rc, out, err = _run(capsys, "--preset", "cross_region_4dc",
                      "--n-workers", "16")
  assert (rc, out) == (2, "") and "multiple of 32" in err
  rc, out, _ = _run(capsys, "--preset", "cross_region_4dc", "--n-workers",
                    "64", "--methods", "all_reduce")
  assert rc == 0 and "workers:" not in out


# --- 4: Figure 6 rows beyond the tolerance -----------------------------------


def _bar(method, error, measured=100.0):
  return dict(cluster="A40", n=8, method=method, measured_ms=measured,
              simulated_ms=measured * (1 + error),
              closed_form_ms=measured * (1 + error), error=error)


def test_rows_beyond_the_tolerance_are_marked():
  table = [_bar("aer", 0.25), _bar("sgp", 0.25), _bar("sgp", -0.21),
           _bar("one_peer_exp", 0.19), _bar("all_reduce", 0.2)]
  lines = tables.rows_text(table, judged=("one_peer_exp", "aer")).splitlines()
  assert [l[-1] for l in lines[1:6]] == ["!", "~", "~", "%", "%"]
  assert lines[1].endswith("+25.0% !") and lines[3].endswith("-21.0% ~")
  assert lines[6].startswith("! error beyond +-20%")
  assert lines[7].startswith("~ error beyond +-20% in a bar the acceptance "
                             "does not judge: SGP (Exp) is reported, not "
                             "judged")
  assert "blocking push-sum" in lines[7] and len(lines) == 8
  # Nothing beyond the tolerance: no mark, no footnote.
  quiet = tables.rows_text([_bar("sgp", 0.1)], judged=("aer",)).splitlines()
  assert len(quiet) == 2 and quiet[1].endswith("+10.0%")


def test_validate_marks_the_sgp_rows_it_does_not_judge(capsys):
  assert cli.main(["validate"]) == 0
  out = capsys.readouterr().out
  table = out[:out.index("acceptance (")]
  rows = [l for l in table.splitlines() if re.match(r"(T4|A100|A40) ", l)]
  assert len(rows) == 36
  for l in rows:
    measured, sim = (float(x) for x in l[29:46].split())
    beyond = abs(sim / measured - 1) > 0.2 + 1e-3  # printed to 0.1 ms
    assert l.endswith(("!", "~")) == beyond, l
    if beyond:
      assert l.endswith("~") == ("SGP" in l), l
  # By hand from Figure 6: A100 SGP at 8 GPUs measured 69.4 ms; T4's
  # SGP bars are within 13%.
  assert re.search(r"A100 +8  SGP \(Exp\) +69\.4 .* ~$", table, re.M)
  assert not re.search(r"T4 .*SGP.*[~!]$", table, re.M)
  assert "SGP (Exp) is reported, not judged" in table


# --- 5: the measured All-Reduce check ----------------------------------------


def _file(measured_s: float, backend: str) -> dict:
  # 4 workers in one node, 1 ms per message, 1 GB/s: a ring All-Reduce of
  # 4 MB takes 2 (n-1)/n M / B + 2 (n-1) alpha = 6 + 6 = 12 ms.
  c = Cluster(n_workers=4, local_size=4, intra_latency_s=1e-3,
                   intra_bandwidth_Bps=1e9)
  return {"cluster": dataclasses.asdict(c), "meta": {"backend": backend},
          "measurements": {"all_reduce_bytes": 4e6,
                           "all_reduce_s": measured_s}}


def test_the_all_reduce_check_says_what_the_model_number_is():
  text = cluster_header.describe_cluster_file("c.json", _file(2.4e-3, "cpu"))
  measured, check = text.splitlines()[1:]
  assert "2.4 ms (model: 12 ms)" in measured
  assert check.startswith("  model: the model's All-Reduce of that size on "
                          "the links fitted from this file's pair exchanges"
                          ", 5x the measured; beyond 2x")
  assert "simulated CPU devices" in check
  near = cluster_header.describe_cluster_file("c.json", _file(8e-3, "gpu"))
  assert near.splitlines()[2].endswith(
      "1.5x the measured; within 2x, so the fitted links describe this "
      "collective")
  far = cluster_header.describe_cluster_file("c.json", _file(30e-3, "gpu"))
  assert "0.4x the measured; beyond 2x" in far
  assert "CPU" not in far


def test_a_recommendation_other_than_all_reduce_carries_the_quality_caveat():
  # Worked by hand: All-Reduce needs no caveat; any other method is priced
  # by speed alone and must say so, citing the local-batch measurement.
  assert recommend.quality_caveat(
      "All-Reduce (no decentralized method is >5% faster)") == ""
  caveat = recommend.quality_caveat(
      "DAdam (AER): 422.9 ms/iteration, 2.00x faster than All-Reduce")
  assert "speed only" in caveat and "section 15" in caveat


# --- 6: flags out of range, and the non-finite backstop ----------------------


def test_a_table_the_model_cannot_price_is_one_error_line(monkeypatch,
                                                          capsys):
  # The flag's bound refuses 1e300 ms; with it lifted Workload's own bound
  # (a day) refuses it. A NIC rate of 1e-310 Gbit/s (its bound lifted)
  # overflows the model's arithmetic (nan in the table, which predict
  # printed with a recommendation and exit status 0), and the backstop
  # refuses the table, naming the flags as given.
  rc, out, err = _run(capsys, "--n-workers", "8", "--forward-ms", "1e300")
  assert (rc, out) == (2, "") and "--forward-ms must be" in err
  monkeypatch.setitem(inputs.FLAG_BOUNDS, "--forward-ms", (0, False, None))
  rc, out, err = _run(capsys, "--n-workers", "8", "--forward-ms", "1e300")
  assert (rc, out) == (2, "")
  assert err.startswith("error: forward_s must be a finite number >= 0 and "
                        "<= 86400") and len(err.strip().splitlines()) == 1
  monkeypatch.setitem(inputs.FLAG_BOUNDS, "--nic-Gbps", (0, True, None))
  rc, out, err = _run(capsys, "--n-workers", "8", "--local-size", "4",
                      "--nic-Gbps", "1e-310")
  assert (rc, out) == (2, "")
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("error: the model's times at --n-workers 8 are "
                             "not finite numbers with --local-size 4, "
                             "--nic-Gbps 1e-310")


def test_flag_bounds_admit_the_ends_of_their_ranges(capsys):
  # Every rate at its low end, every time at its high end: finite tables
  # (two nodes of 4, so the inter-node flags are priced too).
  rc, out, _ = _run(capsys, "--n-workers", "8", "--local-size", "4",
                    "--methods", "all_reduce,aer",
                    "--nic-Gbps", "1e-3", "--intra-GBps", "1e-3",
                    "--forward-ms", "1e6", "--backward-ms", "1e6",
                    "--inter-latency-us", "1e9", "--compute-cv", "10")
  assert rc == 0 and "nan" not in out and "inf" not in out
  assert "recommendation:" in out


# --- measure and calibrate: --out and --config checked before measuring ------


def test_measure_refuses_an_empty_out_before_measuring(monkeypatch, capsys):
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  def measured(*a, **k):
    raise AssertionError("measured")
  monkeypatch.setattr(measure, "measure", measured)
  assert cli.main(["measure", "--config", "gpt_tiny", "--out", ""]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --out is empty; give a file name."], err


def test_measure_and_calibrate_take_a_preset_name(monkeypatch, capsys,
                                                  tmp_path):
  from decentral_jax.runner import devices  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  seen = []
  def measured(config, **k):
    seen.append((int(config.model.n_embd), int(config.n_workers)))
    raise ValueError("stop here")
  monkeypatch.setattr(measure, "measure", measured)
  def simulated(n, where):
    seen.append(n)
    raise ValueError("stop here")
  monkeypatch.setattr(devices, "check_simulated_devices", simulated)
  assert cli.main(["measure", "--config", "gpt_quick", "--set",
                   "n_workers=2", "--out", str(tmp_path / "c.json")]) == 2
  assert cli.main(["calibrate", "--config", "gpt_tiny", "--set",
                   "n_workers=4"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  # gpt_quick's width is 64 (runner/presets.py), measured on 2 workers.
  assert seen == [(64, 2), 4], (seen, err)
  assert err == ["error: stop here"] * 2, err


_NOT_READ = ("(it times one worker's forward and backward at the local batch "
             "and the links; the run's length, schedule, method and records "
             "are no part of it)")


@pytest.mark.parametrize("command, item, says", [
    ("measure", "workdir=/tmp/elsewhere",
     "--set workdir=/tmp/elsewhere: measure does not read config.workdir "
     + _NOT_READ),
    ("measure", "steps=5", "--set steps=5: measure does not read "
     "config.steps " + _NOT_READ),
    ("measure", "checkpoint_interval=3", "config.checkpoint_interval"),
    ("measure", "schedule.peak_lr=0.5", "config.schedule.peak_lr"),
    # calibrate times all_reduce and one_peer_exp whatever these say.
    ("calibrate", "topology=ring", "--set topology=ring: calibrate does not "
     "read config.topology"),
    ("calibrate", "algorithm=diloco", "config.algorithm"),
    ("calibrate", "steps=5", "config.steps"),
    # Spelled as this command line takes them, not as --config.FIELD.
    ("measure", "bogus", "error: --set 'bogus' is not FIELD=VALUE; give "
     "e.g. --set n_workers=4."),
    ("calibrate", "n_workers=nan", "error: the gpt_tiny preset: --set "
     "n_workers=nan: "),
    ("measure", "model.bogus=1", "--set model.bogus"),
])
def test_a_set_of_a_field_the_command_does_not_read_is_refused(
    command, item, says, monkeypatch, capsys, tmp_path):
  """Such an override was only copied into meta.overrides, or (calibrate's
  topology and algorithm) replaced by the command's own, with no word."""
  from decentral_jax.runner import devices  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import calibrate, measure  # pylint: disable=import-outside-toplevel
  def ran(*a, **k):
    raise AssertionError("ran")
  monkeypatch.setattr(measure, "measure", ran)
  monkeypatch.setattr(calibrate, "calibrate", ran)
  monkeypatch.setattr(devices, "check_simulated_devices", lambda *a: None)
  out = ["--out", str(tmp_path / "c.json")] if command == "measure" else []
  assert cli.main([command, "--config", "gpt_tiny", *out, "--set", item]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0] and "--config." not in err[0], err


@pytest.mark.parametrize("argv, flag", [
    (["predict", "--png", ""], "--png"),
    (["utilisation", "--png="], "--png"),
    (["utilisation", "--table", ""], "--table"),
    (["fig6", "--png", ""], "--png")])
def test_an_empty_output_path_is_refused_by_name(argv, flag, capsys):
  """An empty path was taken for "no file": exit 0, nothing written."""
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {flag} is empty; give a file name."], err


@pytest.mark.parametrize("argv, message", [
    (["--n-workers", "16,32,16"], "error: argument --n-workers: '16,32,16': "
     "entry 3 repeats entry 1 (16); give each value once"),
    (["--methods", "all_reduce,aer,all_reduce"], "error: --methods "
     "'all_reduce,aer,all_reduce': entry 3 repeats entry 1 ('all_reduce')"),
    (["--methods", "diloco:H=10,P=1,diloco:H=10,P=1"],
     "entry 2 repeats entry 1 ('diloco:h=10,p=1')"),
    (["--methods", "all_reduce,aer,All-Reduce"],
     "entry 3 repeats entry 1 ('all_reduce')"),
    (["--methods", "diloco:H=10,P=2,diloco:p=2,h=10"],
     "entry 2 repeats entry 1 ('diloco:h=10,p=2')")])
def test_a_list_flag_refuses_a_repeated_entry(argv, message, capsys):
  """A repeat printed the same table twice (exit 0)."""
  with pytest.raises(SystemExit) if argv[0] == "--n-workers" else \
      contextlib.nullcontext():
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
  err = capsys.readouterr().err if argv[0] == "--n-workers" else err
  assert message in err, err


@pytest.mark.parametrize("methods, k, j", [
    ("ring,dadam:topology=ring", 2, 1),  # a bare topology is DAdam's gossip
    ("diloco:H=10,diloco:H=10,overlap=none", 2, 1),  # overlap=none: default
    ("aer,alternating_exp_ring", 2, 1),  # an alias
    ("all_reduce,ring,aer:workers_per_node=8,aer", 4, 3),  # 8: one node
    ("accum_adam:topology=ring,accum_adamw:T=4,topology=ring", 2, 1),
    # A default that stands for the workload's value, spelled out: the
    # float32 parameters on the wire, 25 MiB buckets (--bucket-MiB).
    ("diloco:H=10,comm_dtype=float32,diloco:H=10", 2, 1),
    ("all_reduce:bucket_MiB=25,all_reduce", 2, 1),
    ("streaming_diloco,streaming_diloco:comm_dtype=float32", 2, 1),
    ("local_sgd:comm_dtype=float32,local_sgd", 2, 1),
    ("dadam,dadam:comm_dtype=float32", 2, 1),
    ("gradient_tracking,gradient_tracking:comm_dtype=float32", 2, 1),
    ("sgp:comm_dtype=float32,sgp", 2, 1),
    ("sgp:comm_dtype=f4,sgp", 2, 1),  # numpy's other name of float32
    ("ring:bucket_MiB=25,ring", 2, 1)])
def test_one_method_in_two_spellings_is_refused(methods, k, j, capsys):
  """Each spelling made its own row, the same numbers twice (exit 0)."""
  specs = inputs.split_methods(methods)
  rc, out, err = _run(capsys, "--n-workers", "16",
                      "--methods", methods)
  assert rc == 2 and out == "", out
  assert err.strip().splitlines() == [
      f"error: --methods: entry {k} ({specs[k - 1]}) is entry {j} "
      f"({specs[j - 1]}) again (the same method, spelled otherwise); give "
      "each method once."], err


@pytest.mark.parametrize("methods, same", [
    # bfloat16 parameters: gossip sends them as they are (2 bytes), DiLoCo
    # its global copy promoted to float32 (4 bytes).
    ("dadam,dadam:comm_dtype=bfloat16", True),
    ("diloco:H=10,diloco:H=10,comm_dtype=float32", True),
    ("dadam,dadam:comm_dtype=float32", False),
    # (with a gossip method, which reads --param-dtype: without one the
    # flag has no effect and is refused)
    ("diloco:H=10,diloco:H=10,comm_dtype=bfloat16,one_peer_exp", False),
    ("local_sgd,local_sgd:comm_dtype=bfloat16", True)])
def test_the_wire_dtype_default_follows_the_parameters(methods, same, capsys):
  rc, out, err = _run(capsys, "--n-workers", "16", "--param-dtype",
                      "bfloat16", "--methods", methods)
  assert rc == (2 if same else 0), err
  assert ("(the same method, spelled otherwise)" in err) == same, err


def test_methods_of_one_row_each_stay_apart_and_ar_is_the_baseline(capsys):
  # AccumAdam at T=4 and DAdam cost the same but are two optimizers; a
  # bucket size, T, a topology's workers per node change the method.
  rc, out, err = _run(capsys, "--n-workers", "16",
                      "--methods", "AR,ring,dadam:topology=aer,accum_adam:"
                      "topology=aer,accum_adam:T=2,topology=aer,"
                      "aer:workers_per_node=4,all_reduce:bucket_MiB=5")
  assert rc == 0, err
  rows = [r for r in _rows(out) if r != "*"]
  assert len(rows) == 7, out  # AR is the baseline: no all_reduce added
  assert rows.count("All-Reduce") == 1, rows
  assert _line(out, "  All-Reduce ").split()[3] == "1.00x"


def test_a_fault_table_of_huge_times_keeps_its_columns(capsys):
  """16 workers each up 1 / (1 + 0.1 * 10) = half the time: a step that
  waits for all of them takes sim ms / 0.5**16 (6.1e6 ms), which ran into
  the mode column (``wait6106987.8``)."""
  rc, out, _ = _run(capsys, "--methods", "all_reduce", "--failure-rate",
                    "0.1")
  assert rc == 0
  main, row = [l for l in out.splitlines() if l.startswith("  All-Reduce ")]
  sim_ms = float(main.split()[1])
  name, mode, step, work, useful, per_useful = row.split()
  assert (name, mode, work, useful) == ("All-Reduce", "wait", "100.0",
                                        "100.0")
  for cell in (step, per_useful):
    assert cell == f"{sim_ms / 0.5**16:.3g}", (cell, sim_ms)


def test_a_faster_starred_method_is_named_in_the_recommendation(capsys):
  """Pipelined CHOCO on the exponential graph prices 1.15x faster than
  All-Reduce (docs/pipelined_gossip.md) but is starred (slow mixing): the
  line says why it is not the recommendation; without it, the plain one."""
  specs = ("dadam:compress=int8,topology=exponential,"
           "dadam:compress=int8,topology=exponential,pipelined=1")
  rc, out, _ = _run(capsys, "--preset", "A40", "--workload", "gpt2_small",
                    "--n-workers", "8", "--methods", specs)
  assert rc == 0
  assert _line(out, "  recommendation:") == (
      "  recommendation: All-Reduce (no decentralized method is >5% faster; "
      "the faster ones marked * or ^ are not recommended: see their notes)")
  rc, out, _ = _run(capsys, "--preset", "A40", "--workload", "gpt2_small",
                    "--n-workers", "8", "--methods", "all_reduce")
  assert _line(out, "  recommendation:") == (
      "  recommendation: All-Reduce (no decentralized method is >5% faster)")


def test_cluster_file_header_names_the_links_flags_replaced(tmp_path):
  # The header describes the cluster priced: 31.5 GB/s inside a node and
  # 59 Gbit/s NICs from the file, replaced by --intra-GBps 0.01 and
  # --nic-Gbps 1 (the printed values are the flags', each naming the file's).
  c = Cluster(n_workers=8, local_size=4, intra_bandwidth_Bps=31.5e9,
              nic_bandwidth_Bps=59e9 / 8)
  keys = [k for k in cluster_file.CLUSTER_SCHEMA
          if k not in cluster_file.OPTIONAL_CLUSTER_KEYS]
  doc = {"schema": cluster_file.SCHEMA,
         "cluster": {k: getattr(c, k) for k in keys},
         "workload": {"param_count": 434816, "forward_s": 0.06,
                      "backward_s": 0.12},
         "measurements": {"sizes_bytes": [262144, 1048576], "repeats": 2,
                          "intra_pair_s": [0.001, 0.003]}, "meta": {}}
  path = tmp_path / "c.json"
  path.write_text(json.dumps(doc))
  heads = []
  for extra in ([], ["--intra-GBps", "0.01", "--nic-Gbps", "1"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      assert cli.main(["predict", "--cluster", str(path), *extra]) == 0
    heads.append(out.getvalue().splitlines()[0])
  assert heads[0].endswith("intra 31.5 GB/s, node NIC 59 Gbit/s"), heads[0]
  assert heads[1].endswith(
      "intra 0.01 GB/s (by --intra-GBps; the file's 31.5), node NIC 1 Gbit/s"
      " (by --nic-Gbps; the file's 59)"), heads[1]
