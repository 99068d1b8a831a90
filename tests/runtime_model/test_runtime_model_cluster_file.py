"""The cluster JSON of ``measure`` and ``predict --cluster``, in this process.

The link fits are checked on synthetic timings with known answers, the file's
schema on damaged files, and the flags that override a file. A one-process
``measure`` on 4 of this process's CPU devices (one node: no inter-node
exchanges) writes a file that ``predict`` reads. ``python -m
decentral_jax.runtime_model`` is run here with ``runpy``. The 2-process
``measure`` job (two nodes) is in tests/tools/test_runtime_model_measure.py
(integration tier).
"""

from __future__ import annotations

import json
import re
import os
import runpy
import sys

import jax
import pytest

from decentral_jax.tools.runtime_model_cli import file_cluster
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import parser as cli_parser
from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model.costs import Cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _synthetic(a_in=5e-6, b_in=20e9, a_out=1e-5, flow=3e9, cap=6e9, k=4):
  sizes = [1e6, 4e6, 16e6]
  return {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": k,
          "intra_pair_s": [a_in + m / b_in for m in sizes],
          "inter_pair_s": [a_out + m / flow for m in sizes],
          "inter_concurrent_s": [a_out + k * m / cap for m in sizes],
          "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}


def test_fit_links_recovers_known_links():
  got = cluster_file.fit_links(_synthetic(), 16, 4)
  assert got["intra_latency_s"] == pytest.approx(5e-6, rel=1e-6)
  assert got["intra_bandwidth_Bps"] == pytest.approx(20e9, rel=1e-9)
  assert got["inter_latency_s"] == pytest.approx(1e-5, rel=1e-6)
  assert got["nic_bandwidth_Bps"] == pytest.approx(6e9, rel=1e-9)
  assert got["flow_bandwidth_Bps"] == pytest.approx(3e9, rel=1e-9)
  # One flow fills the node: no cap.
  full = cluster_file.fit_links(_synthetic(flow=6e9), 16, 4)
  assert full["flow_bandwidth_Bps"] is None
  # One node measured: inter-node fields are the Cluster defaults.
  one = _synthetic()
  one.update(inter_pair_s=None, inter_concurrent_s=None)
  got = cluster_file.fit_links(one, 4, 4)
  assert got["nic_bandwidth_Bps"] == Cluster.nic_bandwidth_Bps
  with pytest.raises(ValueError, match="2 distinct"):
    cluster_file.fit_alpha_beta([1e6, 1e6], [1.0, 2.0])


def _write(tmp_path, data, workload=True):
  path = str(tmp_path / "c.json")
  w = ({"param_count": 65e6, "forward_s": 0.03, "backward_s": 0.06,
        "compute_cv": 0.09072184232530289,
        "compute_samples_s": [0.08, 0.09, 0.1],
        "grad_dtype": "float32", "param_dtype": "float32"}
       if workload else None)
  cluster_file.write(path, {"cluster": cluster_file.fit_links(data, 16, 4),
                            "workload": w, "measurements": data,
                            "meta": {"devices": 16}})
  return path


def test_predict_cluster_flags_override_the_file(tmp_path, capsys):
  path = _write(tmp_path, _synthetic())
  args = cli_parser.build_parser().parse_args(["predict", "--cluster", path])
  args.explicit_flags = {"--forward-ms", "--nics-per-node"}
  args.forward_ms, args.nics_per_node = 50.0, 2
  c, w = file_cluster.from_cluster_file(cluster_file.read(path), args, 32)
  assert (c.n_workers, c.local_size, c.nics_per_node) == (32, 4, 2)
  assert c.nic_bandwidth_Bps == pytest.approx(6e9)
  assert w.compute_samples_s is None  # an explicit mean drops the samples
  assert (w.forward_s, w.backward_s, w.compute_cv) == (0.05, 0.06, 0.09072184232530289)
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--steps", "20"]) == 0
  assert "n=8 workers (2 nodes x 4)" in capsys.readouterr().out
  assert cli.main(["predict", "--cluster", path, "--n-workers", "6"]) == 2
  # No measured compute: the workload flags are used.
  bare = _write(tmp_path, _synthetic(), workload=False)
  assert cli.main(["predict", "--cluster", bare, "--steps", "20"]) == 0


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d["cluster"].pop("nic_bandwidth_Bps"), "keys"),
    (lambda d: d["cluster"].update(nic_bandwidth_Bps=-1.0),
     "nic_bandwidth_Bps"),
    (lambda d: d["workload"].update(forward_s="fast"), "forward_s"),
    # Accepted before, then a model of non-finite times naming no key, or
    # a measured All-Reduce of 0 bytes compared with the model.
    (lambda d: d["cluster"].update(nic_efficiency=1e-320), "nic_efficiency"),
    (lambda d: d["measurements"].update(all_reduce_bytes=0.5,
                                        all_reduce_s=0.01),
     "all_reduce_bytes"),
    (lambda d: d["measurements"].update(all_reduce_bytes=1e6,
                                        all_reduce_s=0.0), "all_reduce_s"),
])
def test_bad_cluster_files_are_refused_naming_the_problem(tmp_path, edit,
                                                         match):
  path = _write(tmp_path, _synthetic())
  with open(path) as f:
    data = json.load(f)
  edit(data)
  with open(path, "w") as f:
    json.dump(data, f)
  with pytest.raises(ValueError, match=match):
    cluster_file.read(path)
  assert cli.main(["predict", "--cluster", path]) == 2


@pytest.mark.slow
def test_one_process_measure_on_one_node_writes_a_file_predict_reads(
    tmp_path, monkeypatch, capsys):
  """``measure`` on a host of 4 CPU devices: the 4 first of this process's
  16 (``jax.devices`` answers 4, as on such a host)."""
  all_devices = jax.devices()
  monkeypatch.setattr(jax, "devices", lambda *a, **k: all_devices[:4])
  path = str(tmp_path / "cluster.json")
  tiny = ("model.n_layer=1", "model.n_embd=16", "model.n_head=2",
          "model.block_size=8", "global_batch=16", "n_workers=4")
  argv = ["measure", "--config", os.path.join(ROOT, "configs", "gpt_tiny.py"),
          "--out", path, "--sizes-MB", "0.004,0.04", "--repeats", "2"]
  for kv in tiny:
    argv += ["--set", kv]
  assert cli.main(argv) == 0
  monkeypatch.undo()
  assert f"wrote {path}" in capsys.readouterr().out
  data = cluster_file.read(path)  # schema, keys and values checked
  meta, meas, c, w = (data[k] for k in ("meta", "measurements", "cluster",
                                          "workload"))
  assert (meta["process_count"], meta["devices"], meta["backend"]) == (
      1, 4, "cpu")
  assert meta["overrides"] == list(tiny)
  assert (c["n_workers"], c["local_size"]) == (4, 4)  # one node
  assert meas["sizes_bytes"] == [4000, 40000] and meas["repeats"] == 2
  assert len(meas["intra_pair_s"]) == 2 and min(meas["intra_pair_s"]) > 0
  # One node: nothing measured across nodes; those links keep the defaults.
  assert meas["inter_pair_s"] is None and meas["inter_concurrent_s"] is None
  assert meas["concurrent_flows"] is None
  assert c["nic_bandwidth_Bps"] == Cluster.nic_bandwidth_Bps
  assert c["inter_latency_s"] == Cluster.inter_latency_s
  assert c["flow_bandwidth_Bps"] is None
  # The tiny GPT's parameters by hand (bias-free, tied embedding, vocabulary
  # 256, width 16, context 8): token 256*16 + position 8*16 + final norm 16,
  # one block: 2 norms 2*16, attention 16*48 + 16*16, MLP 16*64 + 64*16.
  assert w["param_count"] == 4096 + 128 + 16 + 32 + 1024 + 2048 == 7344
  assert meas["all_reduce_bytes"] == 4 * 7344 and meas["all_reduce_s"] > 0
  assert len(meas["forward_samples_s"]) == 2
  assert w["compute_samples_s"] == meas["forward_backward_samples_s"]
  assert w["forward_s"] > 0 and w["backward_s"] >= 0
  # predict prices 2 such nodes from the one measured, with the inter-node
  # link the file lacks given by flags (refused without them).
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--steps", "20"]) == 2
  assert "measured no inter-node link" in capsys.readouterr().err
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--steps", "20", "--nic-Gbps", "100",
                   "--inter-latency-us", "10"]) == 0
  out = capsys.readouterr().out
  assert "node NIC 100 Gbit/s (by --nic-Gbps; the file measured no " \
      "inter-node link)" in out
  assert f"cluster from {path}: 4 cpu devices, 4 per node, 1 process(es)" \
      in out
  assert "n=8 workers (2 nodes x 4)" in out and "recommendation:" in out


@pytest.mark.parametrize("param_dtype, comm_dtype, grad, wire", [
    ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    # "": the values' own dtype; all_reduce ignores comm_dtype.
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("bfloat16", "", "bfloat16", "bfloat16"),
        ("bfloat16", "float32", "bfloat16", "float32"),
        ("float32", "bfloat16", "float32", "bfloat16"))),
])
def test_measured_workload_has_the_config_s_wire_dtypes(
    param_dtype, comm_dtype, grad, wire, tmp_path, monkeypatch, capsys):
  """The workload ``measure`` writes: gradients in the parameters' dtype
  (the All-Reduce sends them), parameters in ``comm_dtype`` where set."""
  all_devices = jax.devices()
  monkeypatch.setattr(jax, "devices", lambda *a, **k: all_devices[:2])
  path = str(tmp_path / "cluster.json")
  argv = ["measure", "--config", "gpt_tiny", "--out", path,
          "--sizes-MB", "0.004,0.04", "--repeats", "2"]
  for kv in ("model.n_layer=1", "model.n_embd=16", "model.n_head=2",
             "model.block_size=8", "global_batch=4", "n_workers=2",
             f"model.param_dtype={param_dtype}", f"comm_dtype={comm_dtype}"):
    argv += ["--set", kv]
  assert cli.main(argv) == 0, capsys.readouterr().err
  monkeypatch.undo()
  w = cluster_file.read(path)["workload"]
  assert (w["grad_dtype"], w["param_dtype"]) == (grad, wire)
  capsys.readouterr()
  assert cli.main(["predict", "--cluster", path, "--steps", "20"]) == 0
  assert (f"({grad} gradients, {wire} parameters on the wire)"
          in capsys.readouterr().out)


def test_python_m_entry_point_exits_with_the_status_of_main(
    tmp_path, monkeypatch, capsys):
  """``python -m decentral_jax.runtime_model predict --cluster FILE``."""
  path = _write(tmp_path, _synthetic())
  for extra, status in (([], 0), (["--n-workers", "6"], 2)):
    monkeypatch.setattr(sys, "argv", ["runtime_model", "predict", "--cluster",
                                      path, "--steps", "20", *extra])
    with pytest.raises(SystemExit) as info:
      runpy.run_module("decentral_jax.runtime_model", run_name="__main__")
    assert info.value.code == status
    out, err = capsys.readouterr()
    # Refused before anything is printed; else the file's description.
    assert out == "" if status else f"cluster from {path}" in out
    if status:  # 6 workers cannot be nodes of the file's 4
      assert err.startswith("error: ") and err.count("\n") == 1, err
      assert "n_workers=6" in err or "--n-workers 6" in err, err


def test_cluster_file_must_be_a_small_regular_file(tmp_path, capsys):
  # A FIFO without a writer or /dev/zero used to hang the reader.
  fifo = str(tmp_path / "c.fifo")
  os.mkfifo(fifo)
  for path in (fifo, "/dev/zero"):
    with pytest.raises(ValueError, match=r"--cluster .* is not a regular "
                       r"file \(a FIFO or a device\?\)"):
      cluster_file.read(path)
  big = tmp_path / "big.json"
  big.write_bytes(b" " * (16 * 2**20 + 1))
  with pytest.raises(ValueError, match=r"big.json' is larger than 16777216 "
                     "bytes"):
    cluster_file.read(str(big))
  assert cli.main(["predict", "--cluster", fifo]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is not a regular file" in err[0], err


def test_cluster_file_with_more_workers_than_a_cluster_holds(tmp_path,
                                                             capsys):
  # Predicting for 2^20 workers needed 2^40-entry matrices (a
  # MemoryError). A file holds at most Cluster's 4096 workers, the bound
  # of --n-workers: refused when it is read, naming the file and the key.
  path = _write(tmp_path, _synthetic())
  with open(path) as f:
    data = json.load(f)
  data["cluster"].update(n_workers=2**20, local_size=4)
  with open(path, "w") as f:
    json.dump(data, f)
  with pytest.raises(ValueError) as info:
    cluster_file.read(path)
  assert str(info.value) == (f"--cluster {path!r}: cluster.n_workers must "
                             "be an integer in [1, 4096], got 1048576.")
  assert cli.main(["predict", "--cluster", path]) == 2
  out = capsys.readouterr()
  assert out.out == ""  # refused before anything is printed
  err = out.err.strip().splitlines()
  assert len(err) == 1 and "cluster.n_workers must be an integer in [1, " \
      "4096], got 1048576" in err[0], err


def test_flags_and_files_share_the_workload_bounds(tmp_path, capsys):
  """One bound for ``--params`` and a file's ``param_count``: 4096 buckets of
  25 MiB hold 4096 * 26214400 / 4 = 26843545600 float32 parameters."""
  from decentral_jax.runtime_model import workload as workload_lib
  fit = 4096 * 26214400 // 4
  workload_lib.Workload(fit, 0.1, 0.2)
  with pytest.raises(ValueError, match="makes 4097 buckets, more than the "
                     "4096"):
    workload_lib.Workload(fit + 1, 0.1, 0.2)
  assert inputs.MAX_PARAMS == 1e15 and inputs.MAX_BUCKETS == 4096
  base = ["predict", "--methods", "all_reduce", "--steps", "20"]
  assert cli.main(base + ["--params", str(fit + 1)]) == 2
  assert "makes 4097 buckets" in capsys.readouterr().err
  meas = _synthetic()
  for count, code in ((fit, 0), (fit + 1, 2)):
    path = tmp_path / f"{count}.json"
    path.write_text(json.dumps({
        "schema": cluster_file.SCHEMA,
        "cluster": cluster_file.fit_links(meas, 8, 4),
        "workload": {"param_count": count, "forward_s": 0.1,
                     "backward_s": 0.2},
        "measurements": meas, "meta": {}}))
    assert cli.main(["predict", "--cluster", str(path), "--methods",
                     "all_reduce", "--steps", "20"]) == code
    err = capsys.readouterr().err
    assert (code == 0) == ("workload.param_count" not in err), err


def test_a_file_key_without_effect_is_named_in_a_warning(tmp_path, capsys):
  """wan_* on one datacenter and codec_Bps without a compressed method
  price nothing (the equivalent flags are refused): one warning each."""
  meas = _synthetic()
  links = cluster_file.fit_links(meas, 8, 4)
  links.update(wan_latency_s=0.03, wan_bandwidth_Bps=1e9, codec_Bps=1e11)
  path = tmp_path / "c.json"
  path.write_text(json.dumps({
      "schema": cluster_file.SCHEMA, "cluster": links,
      "workload": {"param_count": 1e6, "forward_s": 0.01,
                   "backward_s": 0.02}, "measurements": meas, "meta": {}}))
  argv = ["predict", "--cluster", str(path), "--steps", "20", "--methods"]
  assert cli.main(argv + ["all_reduce"]) == 0
  err = capsys.readouterr().err.splitlines()
  assert [l.split(": ", 2)[2].split(" has no effect")[0] for l in err] == [
      "cluster.wan_latency_s", "cluster.wan_bandwidth_Bps",
      "cluster.codec_Bps"], err
  assert all(l.startswith(f"warning: --cluster {str(path)!r}: ")
             for l in err), err
  assert cli.main(argv + ["all_reduce,dadam:topology=static_ring,"
                          "compress=int8", "--datacenters", "2"]) == 0
  assert capsys.readouterr().err == ""


def test_a_one_node_file_prices_more_nodes_only_with_the_link_flags(
    tmp_path, capsys):
  # A file of one node of 4 (inter_pair_s null) holds the Cluster defaults
  # for the inter-node link (100 Gbit/s = 12.5e9 B/s, 10 us), never
  # measured: 8 workers (2 nodes) or --local-size 2 are refused unless
  # --nic-Gbps and --inter-latency-us give that link; the header says which.
  one = _synthetic()
  one.update(inter_pair_s=None, inter_concurrent_s=None)
  path = str(tmp_path / "one.json")
  cluster_file.write(path, {"cluster": cluster_file.fit_links(one, 4, 4),
                            "workload": None, "measurements": one,
                            "meta": {"devices": 4}})
  assert cli.main(["predict", "--cluster", path, "--steps", "20"]) == 0
  head = capsys.readouterr().out.splitlines()[0]
  assert head.endswith("node NIC 100 Gbit/s (a default: the file measured "
                       "no inter-node link)"), head
  for extra, nodes in ((["--n-workers", "8"], "spans 2 nodes"),
                       (["--local-size", "2"], "spans 2 nodes")):
    assert cli.main(["predict", "--cluster", path, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: --cluster {path!r} measured no inter-node link"), err
    assert nodes in err and "give --nic-Gbps and --inter-latency-us" in err
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--nic-Gbps", "10"]) == 2
  assert "give --inter-latency-us for that link" in capsys.readouterr().err
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--steps", "20", "--nic-Gbps", "10",
                   "--inter-latency-us", "20"]) == 0
  head = capsys.readouterr().out.splitlines()[0]
  assert "node NIC 10 Gbit/s (by --nic-Gbps; the file measured no " \
      "inter-node link); also replaced by flags: --inter-latency-us" in head
  # A link written by hand (a NIC rate other than the default) is the
  # file's own, measured or not: priced on 2 nodes as written.
  doc = json.load(open(path))
  doc["cluster"]["nic_bandwidth_Bps"] = 50e9 / 8
  with open(path, "w") as f:
    json.dump(doc, f)
  assert cli.main(["predict", "--cluster", path, "--n-workers", "8",
                   "--steps", "20"]) == 0
  assert capsys.readouterr().out.splitlines()[0].endswith("node NIC 50 Gbit/s")


@pytest.mark.parametrize("edit, named", [
    ({"forward_s": 0.05}, "forward_s + backward_s (110 ms)"),
    ({"backward_s": 0.01}, "forward_s + backward_s (40 ms)"),
    ({"compute_cv": 0.5}, "workload.compute_cv (0.5)"),
])
def test_times_disagreeing_with_the_samples_are_refused(tmp_path, edit,
                                                        named):
  """The samples replace forward_s + backward_s and compute_cv in pricing:
  a file edited to disagree is refused rather than its edit ignored."""
  path = _write(tmp_path, _synthetic())
  data = json.loads(open(path).read())
  data["workload"].update(edit)
  open(path, "w").write(json.dumps(data))
  with pytest.raises(ValueError, match=re.escape(named)):
    cluster_file.read(path)
  del data["workload"]["compute_samples_s"]  # the fix the line gives
  open(path, "w").write(json.dumps(data))
  assert cluster_file.read(path)["workload"] == data["workload"]


def test_forward_above_the_median_with_no_backward_is_read(tmp_path):
  """measure writes backward_s = max(median(fb) - median(f), 0)."""
  path = _write(tmp_path, _synthetic())
  data = json.loads(open(path).read())
  data["workload"].update(forward_s=0.095, backward_s=0.0)
  open(path, "w").write(json.dumps(data))
  assert cluster_file.read(path)["workload"]["forward_s"] == 0.095


@pytest.mark.parametrize("meta, needle", [
    ({"devices": 3}, "meta.devices is 3, but cluster.n_workers is 16"),
    ({"process_count": 4097}, "meta.process_count is 4097, more than the 16"),
    ({"process_count": 17}, "meta.process_count is 17, more than the 16")])
def test_meta_counts_contradicting_the_cluster_are_refused(tmp_path, meta,
                                                           needle):
  """measure writes ``devices`` = the workers it measured (16 here), and
  each of its processes holds at least one of them."""
  path = _write(tmp_path, _synthetic())
  data = json.load(open(path, encoding="utf-8"))
  data["meta"].update(meta)
  json.dump(data, open(path, "w", encoding="utf-8"))
  with pytest.raises(ValueError) as e:
    cluster_file.read(path)
  text = str(e.value)
  assert text.startswith(f"--cluster {path!r}: {needle}") \
      and "\n" not in text, text
  data["meta"].update(devices=16, process_count=16)  # one device each
  json.dump(data, open(path, "w", encoding="utf-8"))
  assert cluster_file.read(path)["meta"]["devices"] == 16


def test_a_null_meta_field_is_left_out_of_the_header(tmp_path, capsys):
  path = _write(tmp_path, _synthetic())
  data = json.load(open(path, encoding="utf-8"))
  data["meta"] = {"devices": None, "device_kind": None, "process_count": None}
  json.dump(data, open(path, "w", encoding="utf-8"))
  assert cli.main(["predict", "--cluster", path, "--steps", "20"]) == 0
  head = capsys.readouterr().out.splitlines()[0]
  assert head.startswith(f"cluster from {path}: 16 devices, 4 per node; "), \
      head
  assert "None" not in head, head
