"""``predict`` refuses, before it simulates, what it could not finish.

The simulated work is workers x simulated steps summed over the methods
and worker counts (a local-update method simulates at least two whole
sync periods past the warmup); each case is one ``error:`` line, exit 2.
"""

import contextlib
import io
import time

import pytest

from decentral_jax.tools.runtime_model_cli import simulated_work
from decentral_jax.tools.runtime_model_cli import main as runtime_main


def _predict(*argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = runtime_main.main(["predict", *argv])
    except SystemExit as e:
      code = e.code
  return code, out.getvalue(), err.getvalue()


def test_workers_times_steps_is_bounded_before_any_work():
  t = time.perf_counter()
  code, out, err = _predict("--n-workers", "4096", "--compute-cv", "0.1",
                            "--steps", "100000")
  assert time.perf_counter() - t < 30  # refused, not simulated (hours)
  # 65e6 float32 parameters in 25 MiB buckets: ceil(2.6e8 / 26214400) = 10
  # buckets; 4096 x 100000 x 10 x 3 default methods = 1.2288e10 (by hand)
  assert code == 2 and out == "", err
  assert err.strip().splitlines() == [
      "error: --n-workers 4096 x --steps 100000 x the buckets of 3 methods: "
      "all_reduce, one_peer_exp and aer (--methods, --params / --bucket-MiB) simulate 1.23e+10 "
      "worker-step-buckets, more than 1e+08 (minutes and GBs beyond); lower "
      "--steps, --n-workers or the number of methods, or raise --bucket-MiB."]


def test_the_bound_names_the_reference_predict_adds(monkeypatch):
  # one method given: predict adds the all_reduce reference; the refusal
  # names both (2 methods, not "2" of one given) and does not ask for fewer
  # methods (one cannot give fewer than one).
  monkeypatch.setattr(simulated_work, "MAX_SIMULATED", 100)
  code, out, err = _predict("--n-workers", "16", "--steps", "20",
                            "--methods", "diloco:H=10")
  assert code == 2 and out == "", err
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert ("x the buckets of 2 methods: diloco:H=10 and the all_reduce "
          "reference (--methods" in lines[0]), err
  assert "number of methods" not in lines[0], err


@pytest.mark.parametrize("limit, code", [(3680, 0), (3679, 2)])
def test_the_bound_counts_every_method_s_steps_and_buckets(monkeypatch, limit,
                                                           code):
  # all_reduce: 16 workers x 20 steps x 10 buckets = 3200; diloco:H=10
  # (its sync whole) with warmup 20 // 5 = 4 starts at step 10 and needs two
  # periods, 30 steps: 16 x 30 = 480. In all 3680.
  monkeypatch.setattr(simulated_work, "MAX_SIMULATED", limit)
  got, _, err = _predict("--n-workers", "16", "--steps", "20", "--methods",
                         "all_reduce,diloco:H=10")
  assert got == code, err
  if code:
    assert "simulate 3.68e+03 worker-step-buckets, more than 3.68e+03" in err
  # a larger bucket: one bucket of the all-reduce, 320 + 480 = 800
  got, _, err = _predict("--n-workers", "16", "--steps", "20", "--methods",
                         "all_reduce,diloco:H=10", "--bucket-MiB", "1000")
  assert got == 0, err


def _cluster_file(tmp_path, samples) -> str:
  import dataclasses
  import json
  from decentral_jax.runtime_model import cluster_file, paper
  c, _ = paper.setup("A40", 8)
  path = tmp_path / "c.json"
  path.write_text(json.dumps({
      "schema": cluster_file.SCHEMA, "cluster": dataclasses.asdict(c),
      "workload": {"param_count": 1e6, "forward_s": 0.01, "backward_s": 0.02,
                   "compute_samples_s": samples},
      "measurements": {"sizes_bytes": [1e6, 2e6], "repeats": 3},
      "meta": {}}))
  return str(path)


@pytest.mark.parametrize("samples", [[0.0, 0.0], [0.0, 0.03]])
def test_compute_samples_must_be_positive_naming_file_and_key(tmp_path,
                                                              samples):
  # The samples are divided by their mean (a step's multiplier): a zero
  # one is no step time, a zero mean no number at all.
  from decentral_jax.tools.compare import pricing
  path = _cluster_file(tmp_path, samples)
  code, out, err = _predict("--cluster", path)
  assert code == 2 and out == "", err
  assert err.startswith(f"error: --cluster {path!r}: workload."
                        "compute_samples_s must be >= 2 finite times > 0"), err
  # compare reads the same file while it parses --clusters, before training
  with pytest.raises(ValueError, match="workload.compute_samples_s must be"):
    pricing.parse_clusters(path)
  text = ",".join(str(1e3 * x) for x in samples)
  code, _, err = _predict("--n-workers", "16", "--compute-samples-ms", text)
  assert code == 2 and (
      f"argument --compute-samples-ms: entry 1 of {text!r} must be a finite "
      "number in (0, 1e+06] (ms), got '0.0'") in err, err


@pytest.mark.parametrize("text, says", [
    ("0,5", "entry 1 of '0,5' must be a finite number in (0, 1e+06] (ms), "
     "got '0'"),
    ("90,0,5", "entry 2 of '90,0,5' must be a finite number in (0, 1e+06] "
     "(ms), got '0'"),
    ("5,1000001", "entry 2 of '5,1000001' must be a finite number in (0, "
     "1e+06] (ms), got '1000001'"),
    ("5", "--compute-samples-ms needs at least 2 samples (their spread is "
     "the compute's), got 1 (5.0)"),
])
def test_compute_samples_name_the_bad_entry_as_the_help_states_the_rule(
    text, says):
  """The help said "each 0 to 1e+06" while a 0 entry was refused as too
  few samples: the help, the rule and the message now agree."""
  code, out, err = _predict("--compute-samples-ms", text)
  assert code == 2 and out == "" and says in err, err
  assert len(err.strip().splitlines()) == 1, err
  help_text = io.StringIO()
  with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
    runtime_main.main(["predict", "--help"])
  assert "at least 2, each above 0 to 1e+06" in " ".join(
      help_text.getvalue().split())
  code, out, err = _predict("--compute-samples-ms", "1e-9,1e6", "--n-workers",
                            "8", "--methods", "all_reduce", "--steps", "20")
  assert code == 0, err


def test_positive_compute_samples_are_priced(tmp_path):
  code, out, err = _predict("--cluster", _cluster_file(tmp_path,
                                                       [0.02, 0.04]))
  assert code == 0 and "compute 30.0 ms per step" in out, err


# 1e-320 MiB (subnormal) passed "> 0" and overflowed the bucket count.
@pytest.mark.parametrize("value", ["1e30", "1e308", "0", "-1", "nan",
                                   "1e-320", "1e-7"])
def test_a_spec_s_bucket_mib_has_the_flag_s_bounds(value):
  spec = f"one_peer_exp:bucket_MiB={value}"
  code, _, err = _predict("--n-workers", "16", "--methods", spec)
  assert code == 2 and err.strip().splitlines() == [
      f"error: --methods {spec} at --n-workers 16: {spec!r}: "
      f"bucket_MiB={value!r} must be a number in [9.53674e-07, 1e+09] "
      "(MiB: one byte to 1e9 MiB)."], err
  code, _, err = _predict("--bucket-MiB", value)
  assert code == 2 and "--bucket-MiB" in err and "[9.53674e-07, 1e+09]" in err, \
      err


def test_a_spec_s_bucket_count_names_the_spec_key():
  # 1e6 float32 parameters in 0.001 MiB (1048.576 bytes) buckets:
  # ceil(4e6 / 1048.576) = 3815 <= 4096; 0.0009 MiB: ceil(4e6 / 943.7184)
  # = 4239 > 4096 (by hand).
  ok = "one_peer_exp:bucket_MiB=0.001"
  code, _, err = _predict("--n-workers", "16", "--params", "1e6",
                          "--steps", "20", "--methods", ok)
  assert code == 0, err
  bad = "one_peer_exp:bucket_MiB=0.0009"
  code, _, err = _predict("--n-workers", "16", "--params", "1e6",
                          "--methods", bad)
  assert code == 2 and err.strip().splitlines() == [
      f"error: --methods {bad} at --n-workers 16: bucket_MiB=0.0009 cuts "
      "1e+06 4-byte values into 4239 buckets, more than the 4096 the model "
      "handles; raise bucket_MiB."], err


def test_in_flight_fractions_file_of_any_name_is_read(tmp_path, monkeypatch):
  import json
  from decentral_jax.runtime_model import in_flight
  monkeypatch.chdir(tmp_path)
  (tmp_path / "fractions.txt").write_text(json.dumps(
      {"in_flight_fractions": {"forward": 0.2, "backward": 0.5}}))
  assert in_flight.read_in_flight("fractions.txt") == (0.2, 0.5)
  # a name that is fractions stays fractions, even if such a file exists
  (tmp_path / "0.5").write_text("{}")
  assert in_flight.read_in_flight("0.5") == (0.5, 0.5)
  with pytest.raises(ValueError, match=r"--gossip-in-flight 'nosuch.txt': "
                     r"give a fraction, FORWARD,BACKWARD fractions or an "
                     r"existing JSON file \(no file of that name\)\."):
    in_flight.read_in_flight("nosuch.txt")


@pytest.mark.parametrize("flag", ["--cluster", "--workload-file"])
def test_an_empty_input_path_is_refused_not_taken_as_left_out(flag):
  code, out, err = _predict("--n-workers", "16", flag, "")
  assert code == 2 and out == "" and err == (
      f"error: {flag} is empty; give a JSON file's path or drop {flag}.\n")


@pytest.mark.parametrize("command", ["predict", "utilisation"])
@pytest.mark.parametrize("params", ["1e300", "1e308", "1.0000001e15"])
def test_params_bound_fires_before_the_bucket_count(command, params):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = runtime_main.main([command, "--params", params])
  assert code == 2 and err.getvalue() == (
      f"error: --params must be a finite number in [1, 1e+15], got "
      f"{float(params)!r}.\n"), err.getvalue()


@pytest.mark.parametrize("steps", ["2", "19"])
def test_too_few_steps_for_the_warm_up_are_refused(steps):
  # at 2 steps the warm-up (2 // 5 = 0) is empty and DAdam (Exp)'s mean
  # was its first step's compute, 15 ms (5 + 10), 2.97x "faster" than
  # All-Reduce where the steady state is 91.5 ms, 0.49x.
  code, out, err = _predict("--forward-ms", "5", "--backward-ms", "10",
                            "--n-workers", "64", "--steps", steps)
  assert code == 2 and out == "", err
  assert err.strip().splitlines() == [
      f"error: --steps must be in [20, 100000], got {steps}: the first fifth "
      "is warm-up and the mean needs steady steps after it; give --steps 20 "
      "or more (default 300)."]
  code, out, err = _predict("--forward-ms", "5", "--backward-ms", "10",
                            "--n-workers", "64", "--steps", "20")
  assert code == 0, err


def _one_node_file(tmp_path, n_workers, local_size):
  import json
  from decentral_jax.runtime_model import cluster_file
  sizes = [1e6, 4e6, 16e6]
  meas = {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": 4,
          "intra_pair_s": [5e-6 + m / 20e9 for m in sizes],
          "inter_pair_s": None, "inter_concurrent_s": None,
          "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}
  path = tmp_path / f"{n_workers}.json"
  path.write_text(json.dumps({
      "schema": cluster_file.SCHEMA,
      "cluster": cluster_file.fit_links(meas, n_workers, local_size),
      "workload": {"param_count": 1e6, "forward_s": 0.01,
                   "backward_s": 0.02}, "measurements": meas, "meta": {}}))
  return str(path)


def test_a_one_node_file_prices_part_of_its_node(tmp_path):
  # as the one-node preset (h100_node --n-workers 4: 1 node x 4)
  path = _one_node_file(tmp_path, 4, 4)
  code, out, err = _predict("--cluster", path, "--n-workers", "2",
                            "--steps", "20", "--methods", "all_reduce")
  assert code == 0, err
  assert "n=2 workers (1 node x 2)" in out, out


@pytest.mark.parametrize("argv, line", [
    # 6 workers, 4 per node: next multiple 8; largest divisor of 6 <= 4: 3
    (["--n-workers", "6", "--local-size", "4"],
     "--n-workers 6 is not a multiple of --local-size 4 (workers per node); "
     "give --n-workers a multiple of 4 (e.g. 8) or --local-size 3."),
    # 12 workers, 8 per node: 16; divisors of 12 up to 8: 6
    (["--n-workers", "12", "--local-size", "8"],
     "--n-workers 12 is not a multiple of --local-size 8 (workers per node); "
     "give --n-workers a multiple of 8 (e.g. 16) or --local-size 6."),
    # 12 workers, 4 x 2 datacenters per 8: 16; 6 per datacenter: 3
    (["--n-workers", "12", "--local-size", "4", "--datacenters", "2",
      "--wan-Gbps", "10"],
     "--n-workers 12 is not a multiple of --local-size 4 x --datacenters 2 "
     "(workers per datacenter); give --n-workers a multiple of 8 (e.g. 16) "
     "or --local-size 3."),
])
def test_workers_not_a_multiple_of_the_node_name_both_fixes(argv, line):
  code, out, err = _predict(*argv, "--steps", "20")
  assert code == 2 and out == "", err
  assert err.strip().splitlines() == [f"error: {line}"]


def test_a_file_of_several_nodes_names_both_fixes(tmp_path):
  path = _one_node_file(tmp_path, 8, 4)  # two nodes of 4 (by its fields)
  code, _, err = _predict("--cluster", path, "--n-workers", "6",
                          "--steps", "20", "--nic-Gbps", "100",
                          "--inter-latency-us", "5")
  assert code == 2, err
  assert err.strip().splitlines() == [
      "error: --n-workers 6 is not a multiple of the cluster file's 4 "
      "workers per node; give --n-workers a multiple of 4 (e.g. 8) or "
      "--local-size 3."]


def _one_device_per_node_file(tmp_path):
  """A file as ``measure --local-size 1`` writes it: two nodes of one
  device, intra_pair_s null, the intra link at the Cluster defaults
  (15.75 GB/s, 5 us)."""
  import json
  from decentral_jax.runtime_model import cluster_file
  sizes = [1e6, 4e6, 16e6]
  meas = {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": 1,
          "intra_pair_s": None,
          "inter_pair_s": [1e-5 + m / 3e9 for m in sizes],
          "inter_concurrent_s": [1e-5 + m / 3e9 for m in sizes],
          "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}
  path = tmp_path / "one_device.json"
  path.write_text(json.dumps({
      "schema": cluster_file.SCHEMA,
      "cluster": cluster_file.fit_links(meas, 2, 1),
      "workload": {"param_count": 1e6, "forward_s": 0.01,
                   "backward_s": 0.02}, "measurements": meas, "meta": {}}))
  return str(path)


@pytest.mark.parametrize("argv, missing", [
    # two workers on a node: an intra-node hop (rate and latency)
    (["--local-size", "2", "--n-workers", "4"],
     "--intra-GBps and --intra-latency-us"),
    (["--local-size", "2", "--n-workers", "4", "--intra-GBps", "10"],
     "--intra-latency-us"),
    # one per node, 4 per datacenter: the ring reads the intra rate only
    (["--n-workers", "4"], "--intra-GBps")])
def test_an_intra_node_link_the_file_did_not_measure_needs_its_flags(
    tmp_path, argv, missing):
  path = _one_device_per_node_file(tmp_path)
  code, out, err = _predict("--cluster", path, "--steps", "20", *argv)
  assert code == 2 and out == "", err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"error: --cluster {path!r} measured no intra-node link "
      "(measurements.intra_pair_s is null"), lines
  assert f"; give {missing} for that link" in lines[0], lines


def test_an_intra_node_link_the_file_did_not_measure_is_labelled(tmp_path):
  path = _one_device_per_node_file(tmp_path)
  code, out, err = _predict("--cluster", path, "--steps", "20",
                            "--methods", "all_reduce")  # its own 2 x 1
  assert code == 0, err
  assert ("intra 15.8 GB/s (a default: the file measured no intra-node "
          "link)") in out, out
  code, out, err = _predict("--cluster", path, "--steps", "20",
                            "--methods", "all_reduce", "--local-size", "2",
                            "--n-workers", "4", "--intra-GBps", "10",
                            "--intra-latency-us", "3")
  assert code == 0, err
  assert ("intra 10 GB/s (by --intra-GBps; the file measured no intra-node "
          "link)") in out, out


def test_a_one_node_file_past_its_node_names_the_fixes_that_work(tmp_path):
  # 6 workers of a 4-device one-node file: a multiple of 4 or --local-size
  # 3 spans nodes, which the file's unmeasured inter-node link refuses too.
  path = _one_node_file(tmp_path, 4, 4)
  code, _, err = _predict("--cluster", path, "--n-workers", "6",
                          "--steps", "20")
  assert code == 2, err
  assert err.strip().splitlines() == [
      "error: --n-workers 6 is not a multiple of the cluster file's 4 "
      "workers per node; give --n-workers a multiple of 4 (e.g. 8) or "
      "--local-size 3, with --nic-Gbps and --inter-latency-us (the file "
      "measured one node, no inter-node link); or at most 4 workers, on "
      "its node."]
