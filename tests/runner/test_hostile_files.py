"""Hostile files: every file the project reads is refused in one line.

Cluster files (``predict --cluster``, compare.py ``--clusters``), the
Fashion-MNIST IDX files, token bins and text corpora, config files,
``metrics.jsonl``, checkpoint metadata, the work directory's lock and
checksum manifest: missing keys, wrong types, NaN, infinities, huge and
tiny numbers, booleans where numbers are expected, bytes that are not UTF-8,
deep nesting and truncated files. Each refusal is one ``ValueError`` line
naming the file and the key (on the command line: one ``error:`` line and
exit status 2), never a traceback, a hang or a silently wrong result.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, require_devices
from decentral_jax.data import fashion_mnist
from decentral_jax.data import text
from decentral_jax.runner import checkpoint
from decentral_jax.runner import checkpoint_files
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import metrics
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.runtime_model import cluster_file
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.runtime_model_cli import main as runtime_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEEP = 100_000  # far past Python's recursion limit


def _one_line(error: BaseException, *names: str) -> str:
  text_ = str(error)
  assert "\n" not in text_, text_
  for name in names:
    assert name in text_, (name, text_)
  return text_


# -- cluster files ------------------------------------------------------------


def _good_cluster() -> dict:
  """A valid cluster file: links fitted from hand-made pair timings."""
  sizes = [1e6, 4e6, 16e6]
  meas = {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": 4,
          "intra_pair_s": [5e-6 + m / 20e9 for m in sizes],
          "inter_pair_s": [1e-5 + m / 3e9 for m in sizes],
          "inter_concurrent_s": [1e-5 + 4 * m / 6e9 for m in sizes],
          "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}
  return {"schema": cluster_file.SCHEMA,
          "cluster": cluster_file.fit_links(meas, 16, 4),
          "workload": {"param_count": 65e6, "forward_s": 0.03,
                       "backward_s": 0.06, "compute_cv": 0.09072184232530289,
                       "compute_samples_s": [0.08, 0.09, 0.1],
                       "grad_dtype": "float32", "param_dtype": "float32"},
          "measurements": meas,
          "meta": {"devices": 16, "device_kind": "test", "process_count": 4,
                   "overrides": []}}


def _set(section, key, value):
  def edit(d):
    d[section][key] = value
  return edit


# (edit of the good file, or the file's text, or its bytes; what the
# message must name besides the file)
CLUSTER_CASES = {
    "no_measurements": (lambda d: d.pop("measurements"), "measurements"),
    "no_meta": (lambda d: d.pop("meta"), "meta"),
    "unknown_top_key": (lambda d: d.update(measurment={}), "measurment"),
    "meta_list": (lambda d: d.update(meta=[1, 2]), '"meta"'),
    "measurements_list": (lambda d: d.update(measurements=[]),
                          '"measurements"'),
    "cluster_list": (lambda d: d.update(cluster=[1]), '"cluster"'),
    "workload_string": (lambda d: d.update(workload="fast"), '"workload"'),
    "string_byte_count": (_set("measurements", "all_reduce_bytes", "4e6"),
                          "measurements.all_reduce_bytes"),
    "string_sizes": (_set("measurements", "sizes_bytes", ["1e6", 2]),
                     "measurements.sizes_bytes"),
    "nested_sizes": (_set("measurements", "sizes_bytes", [[1e6], [2e6]]),
                     "measurements.sizes_bytes"),
    "times_per_size": (_set("measurements", "intra_pair_s", [1e-3]),
                       "measurements.intra_pair_s"),
    "all_reduce_without_bytes": (_set("measurements", "all_reduce_bytes",
                                      None), "measurements.all_reduce_bytes"),
    "unknown_meta_key": (_set("meta", "note", "x"), "note"),
    "meta_devices_string": (_set("meta", "devices", "many"), "meta.devices"),
    "meta_overrides_numbers": (_set("meta", "overrides", [1]),
                               "meta.overrides"),
    "nan_latency": (_set("cluster", "intra_latency_s", math.nan),
                    "cluster.intra_latency_s"),
    "nan_forward": (_set("workload", "forward_s", math.nan),
                    "workload.forward_s"),
    "nan_all_reduce": (_set("measurements", "all_reduce_s", math.nan),
                       "measurements.all_reduce_s"),
    "inf_bandwidth": (_set("cluster", "nic_bandwidth_Bps", math.inf),
                      "cluster.nic_bandwidth_Bps"),
    "huge_bandwidth": (_set("cluster", "nic_bandwidth_Bps", 1e300),
                       "cluster.nic_bandwidth_Bps"),
    "tiny_bandwidth": (_set("cluster", "intra_bandwidth_Bps", 1e-300),
                       "cluster.intra_bandwidth_Bps"),
    "huge_latency": (_set("cluster", "inter_latency_s", 1e300),
                     "cluster.inter_latency_s"),
    "huge_param_count": (_set("workload", "param_count", 1e300),
                         "workload.param_count"),
    # The runtime model's bounds (workload.MAX_PARAMS, MAX_BUCKETS), as for
    # predict --params: 1e12 float32 in 25 MiB buckets is 152588 buckets.
    "param_count_above_max": (_set("workload", "param_count", 2e15),
                              "workload.param_count must be a whole number "
                              "in [1, 1e+15]"),
    "param_count_in_too_many_buckets": (
        _set("workload", "param_count", 1e12),
        "workload.param_count 1e+12 of 4-byte values in buckets of 25 MiB "
        "makes 152588 buckets, more than the 4096"),
    "huge_int_workers": (_set("cluster", "n_workers", 10**400),
                         "cluster.n_workers"),
    "huge_sample": (_set("workload", "compute_samples_s", [0.1, 1e300]),
                    "workload.compute_samples_s"),
    "bool_local_size": (_set("cluster", "local_size", True),
                        "cluster.local_size"),
    "bool_samples": (_set("workload", "compute_samples_s", [True, 1.0]),
                     "workload.compute_samples_s"),
    "bool_all_reduce": (_set("measurements", "all_reduce_s", True),
                        "measurements.all_reduce_s"),
    "bool_repeats": (_set("measurements", "repeats", False),
                     "measurements.repeats"),
    "float_workers": (_set("cluster", "n_workers", 16.5), "cluster.n_workers"),
    "fractional_param_count": (_set("workload", "param_count", 65e6 + 0.5),
                               "workload.param_count"),
    "integer_beyond_float": (_set("workload", "param_count", 10 ** 400),
                             "workload.param_count"),
    "zero_param_count": (_set("workload", "param_count", 0),
                         "workload.param_count"),
    "int_grad_dtype": (_set("workload", "grad_dtype", "int8"), "grad_dtype"),
    "complex_param_dtype": (_set("workload", "param_dtype", "complex64"),
                            "param_dtype"),
    "unknown_grad_dtype": (_set("workload", "grad_dtype", "float31"),
                           "grad_dtype"),
    "string_duplex": (_set("cluster", "full_duplex", "yes"),
                      "cluster.full_duplex"),
    "deep_nesting": ("[" * DEEP + "]" * DEEP, "nested too deeply"),
    "deep_value": (None, "cluster.n_workers"),  # filled in below
    "truncated": (None, "is not JSON"),
    "empty": ("", "is not JSON"),
    "non_utf8": (None, "not UTF-8"),
}


def _cluster_text(case: str) -> str | bytes:
  edit, _ = CLUSTER_CASES[case]
  good = json.dumps(_good_cluster())
  if case == "truncated":
    return good[:len(good) // 2]
  if case == "non_utf8":
    raw = good.encode()
    return raw[:40] + b"\xff\xfe" + raw[40:]
  if case == "deep_value":  # nested, but shallow enough to parse
    return good.replace('"n_workers": 16', '"n_workers": ' + "[" * 500
                        + "]" * 500)
  if isinstance(edit, str):
    return edit
  data = copy.deepcopy(_good_cluster())
  edit(data)
  return json.dumps(data)


def _write_cluster(tmp_path, case: str) -> str:
  content = _cluster_text(case)
  path = tmp_path / f"{case}.json"
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content, encoding="utf-8")
  return str(path)


def test_the_good_cluster_file_is_read(tmp_path, capsys):
  path = tmp_path / "good.json"
  path.write_text(json.dumps(_good_cluster()))
  assert cluster_file.read(str(path))["cluster"]["n_workers"] == 16
  assert runtime_cli.main(["predict", "--cluster", str(path), "--steps",
                           "20"]) == 0
  assert f"cluster from {path}: 16 test devices" in capsys.readouterr().out


def test_a_null_workload_key_is_the_key_left_out(tmp_path):
  """The schema allows null: Workload's default (compute_cv 0)."""
  data = _good_cluster()
  data["workload"].update(compute_cv=None, compute_samples_s=None)
  path = tmp_path / "null.json"
  path.write_text(json.dumps(data))
  w = cluster_file.workload(cluster_file.read(str(path)))
  assert (w.compute_cv, w.compute_samples_s) == (0.0, None)


@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_hostile_cluster_files(tmp_path, capsys, case):
  path = _write_cluster(tmp_path, case)
  key = CLUSTER_CASES[case][1]
  with pytest.raises(ValueError) as info:
    cluster_file.read(path)
  _one_line(info.value, f"--cluster {path!r}", key)
  capsys.readouterr()
  assert runtime_cli.main(["predict", "--cluster", path, "--steps", "20"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert path in err[0] and key in err[0], err
  with pytest.raises(ValueError) as info:
    pricing.parse_clusters(f"A40,{path}")
  _one_line(info.value, f"--clusters entry {path!r}", key)


@pytest.mark.integration
def test_predict_cluster_command_line_refuses_deep_json(tmp_path):
  """From the shell: one ``error:`` line, exit status 2, no traceback."""
  path = _write_cluster(tmp_path, "deep_nesting")
  proc = subprocess.run(
      [sys.executable, "-m", "decentral_jax.runtime_model", "predict",
       "--cluster", path], cwd=ROOT, capture_output=True, text=True,
      timeout=240, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --cluster "), lines
  assert path in lines[0]


# -- Fashion-MNIST --------------------------------------------------------------


IMAGES = "train-images-idx3-ubyte"


def _fashion_copy(tmp_path) -> str:
  src = os.path.join(FIXTURES, "fashion_mnist")
  dst = tmp_path / "fmnist"
  dst.mkdir()
  for name in os.listdir(src):
    if name.endswith(".gz"):
      (dst / name).write_bytes(open(os.path.join(src, name), "rb").read())
  return str(dst)


def _gz(raw: bytes) -> bytes:
  return gzip.compress(raw, mtime=0)


def _idx_header(magic: int, *dims: int) -> bytes:
  return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big")
                                             for d in dims)


FASHION_CASES = {
    # Not gzip at all, named .gz: gzip.BadGzipFile before.
    "not_gzip": (lambda raw: b"this is not a gzip stream" * 4, "cannot be read"),
    # The gzip stream cut in half: EOFError before.
    "truncated_gzip": (lambda raw: raw[:len(raw) // 2], "cannot be read"),
    # A byte of the deflate data changed: zlib.error or a CRC error.
    "flipped_byte": (lambda raw: raw[:200] + bytes([raw[200] ^ 0xff])
                     + raw[201:], "cannot be read"),
    # Magic right, header cut: numpy's "buffer is smaller" before.
    "truncated_header": (lambda raw: _gz(_idx_header(2051, 5)), "header"),
    "wrong_magic": (lambda raw: _gz(_idx_header(2049, 3) + b"\0\0\0"),
                    "magic number"),
    "truncated_data": (lambda raw: _gz(_idx_header(2051, 2, 28, 28)
                                       + bytes(100)), "truncated"),
    "empty": (lambda raw: b"", "not an IDX file"),
}


@pytest.mark.parametrize("case", sorted(FASHION_CASES))
def test_hostile_fashion_mnist_files(tmp_path, case):
  directory = _fashion_copy(tmp_path)
  path = os.path.join(directory, IMAGES + ".gz")
  edit, needle = FASHION_CASES[case]
  with open(path, "rb") as f:
    raw = f.read()
  with open(path, "wb") as f:
    f.write(edit(raw))
  with pytest.raises(ValueError) as info:
    fashion_mnist.load(directory)
  _one_line(info.value, path, needle)


@pytest.mark.integration
def test_train_command_line_names_a_corrupt_fashion_mnist_file(tmp_path):
  directory = _fashion_copy(tmp_path)
  path = os.path.join(directory, IMAGES + ".gz")
  with open(path, "wb") as f:
    f.write(b"\x1f\x8b not really gzip")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, "experiments/train.py", "--config",
       "configs/cnn_fashion_mnist.py", "--workdir", str(tmp_path / "w"),
       f"--config.data.path={directory}", "--config.steps=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and path in errors[0], proc.stderr[-3000:]


# -- token bins and text corpora ---------------------------------------------


def test_empty_token_bin_is_named(tmp_path):
  np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
  (tmp_path / "val.bin").write_bytes(b"")
  with pytest.raises(ValueError) as info:
    text.load_token_bins(tmp_path)
  _one_line(info.value, str(tmp_path / "val.bin"), "no bytes")


def test_odd_token_bin_is_named(tmp_path):
  (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03")
  (tmp_path / "val.bin").write_bytes(b"\x01\x02")
  with pytest.raises(ValueError) as info:
    text.load_token_bins(tmp_path)
  _one_line(info.value, str(tmp_path / "train.bin"), "odd number")


def test_empty_text_corpus_is_named(tmp_path):
  (tmp_path / "corpus.txt").write_bytes(b"")
  with pytest.raises(ValueError) as info:
    text.load_text_file(tmp_path / "corpus.txt")
  _one_line(info.value, str(tmp_path / "corpus.txt"), "empty")


def test_non_utf8_text_corpus_is_bytes(tmp_path):
  """Byte-level tokens: any bytes are a corpus (not a decoding error)."""
  raw = bytes(range(256)) * 4
  (tmp_path / "corpus.bin").write_bytes(raw)
  assert text.load_text_file(tmp_path / "corpus.bin") == raw


# -- config files ---------------------------------------------------------------


CONFIG_CASES = {
    # New: sys.exit() while loading ended the program (exit status 0 from
    # experiments/train.py, no message).
    "exits": ("import sys\nsys.exit(0)\n", "sys.exit(0)"),
    "exits_in_get_config": ("def get_config():\n  raise SystemExit(3)\n",
                            "sys.exit(3)"),
    # Already one line before; kept here as the table of config files.
    "raises": ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    "no_get_config": ("x = 1\n", "no get_config()"),
    "returns_dict": ("def get_config():\n  return {'a': 1}\n", "dict"),
    "syntax": ("def get_config(:\n", "SyntaxError"),
    "non_utf8": (b"\xff\xfe = 1\n", "utf-8"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_hostile_config_files(tmp_path, case):
  content, needle = CONFIG_CASES[case]
  path = tmp_path / f"{case}.py"
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)
  with pytest.raises(ValueError) as info:
    config_lib.load_config(str(path))
  _one_line(info.value, str(path), needle)


ARGLESS = "from ml_collections import config_dict\n" \
    "def get_config():\n  return config_dict.ConfigDict({'a': 1})\n"


def test_a_config_arg_its_get_config_does_not_take_is_named(tmp_path):
  """FILE.py:ARG for a get_config() of no parameter (or a bare trailing
  ':') was Python's TypeError; one taking a required ARG given none too."""
  path = tmp_path / "argless.py"
  path.write_text(ARGLESS)
  cases = {
      ":zzz": f"config file '{path}:zzz' takes no ARG (its get_config() has "
              f"no parameter); drop ':zzz' and give {path}.",
      ":": f"config file '{path}:' ends in ':' with no ARG; give "
           f"{path}:ARG or drop the ':'.",
  }
  for suffix, message in cases.items():
    with pytest.raises(ValueError) as info:
      config_lib.load_config(f"{path}{suffix}")
    assert str(info.value) == message
  needs = tmp_path / "needs.py"
  needs.write_text(ARGLESS.replace("get_config()", "get_config(name)"))
  with pytest.raises(ValueError) as info:
    config_lib.load_config(str(needs))
  assert str(info.value) == (
      f"config file '{needs}' needs an ARG (its get_config() has a required "
      f"parameter); give {needs}:ARG.")
  assert config_lib.load_config(f"{needs}:x").a == 1
  assert config_lib.load_config(str(path)).a == 1


@pytest.mark.integration
def test_config_file_that_exits_on_the_command_line(tmp_path):
  path = tmp_path / "exits.py"
  path.write_text("import sys\nsys.exit(0)\n")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, "experiments/train.py", "--config", str(path),
       "--workdir", str(tmp_path / "w")], cwd=ROOT, capture_output=True,
      text=True, timeout=240, env=env)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and str(path) in errors[0], proc.stderr[-2000:]


# -- metrics.jsonl ---------------------------------------------------------------


METRICS_CASES = {
    "string_step": ('{"step": "ten", "lr": 0.1}', '"step"'),
    "no_step": ('{"lr": 0.1}', '"step"'),
    "negative_step": ('{"step": -5}', '"step"'),
    "bool_step": ('{"step": true}', '"step"'),
    "float_step": ('{"step": 5.5}', '"step"'),
    "nested_value": ('{"step": 5, "train/loss": [1, 2]}', "'train/loss'"),
    "not_an_object": ('[1, 2, 3]', "not a JSON record"),
    "non_utf8": (b'{"step": 5, "lr": "\xff"}', "not a JSON record"),
    "truncated_middle": ('{"step": 5, "lr"', "not a JSON record"),
}


@pytest.mark.parametrize("case", sorted(METRICS_CASES))
def test_hostile_metrics_lines(tmp_path, case):
  bad, needle = METRICS_CASES[case]
  bad = bad if isinstance(bad, bytes) else bad.encode()
  path = tmp_path / metrics.METRICS_FILE
  content = b'{"step": 0, "lr": 0.0}\n' + bad + b'\n{"step": 10}\n'
  path.write_bytes(content)
  for read in (lambda: metrics.read_jsonl(str(path)),
               lambda: metrics.truncate_after(str(tmp_path), 5)):
    with pytest.raises(ValueError) as info:
      read()
    _one_line(info.value, f"{path}, line 2", needle)
  assert path.read_bytes() == content  # nothing rewritten


def test_metrics_file_that_is_a_directory(tmp_path):
  (tmp_path / metrics.METRICS_FILE).mkdir()
  for step in (0, 5):
    with pytest.raises(ValueError) as info:
      metrics.truncate_after(str(tmp_path), step)
    _one_line(info.value, str(tmp_path / metrics.METRICS_FILE))


def test_series_names_a_value_that_is_not_a_number(tmp_path):
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0, "eval/loss": 2.5}\n'
                  '{"step": 5, "eval/loss": "low"}\n')
  with pytest.raises(ValueError) as info:
    pricing.eval_curve(str(path))
  _one_line(info.value, "'eval/loss'", "step=5")


# -- checkpoint metadata ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
  """A tiny gpt_tiny experiment and its config (no step is compiled)."""
  from decentral_jax.runner import experiment as experiment_lib  # pylint: disable=g-import-not-at-top
  require_devices(8)
  config = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.model.n_layer=1", "--config.model.n_embd=32",
       "--config.model.n_head=2", "--config.model.block_size=16",
       "--config.global_batch=16", "--config.eval_batches=1",
       "--config.steps=10"))
  exp = experiment_lib.Experiment(config)
  return config, exp, exp.init_state()


def _with(**changes):
  def edit(meta):
    meta.update(changes)
    return meta
  return edit


def _written(exp, step: int) -> dict:
  """The document the loop writes at ``step``, a step gpt_tiny does not log
  (log_interval 10): the run facts and a window of that step's loss."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  return dict(run_meta.checkpoint_meta(exp, step), metrics_window={
      "losses": [2.0], "accs": [], "consensus": None})


def _without(key):
  return lambda meta: {k: v for k, v in meta.items() if k != key}


META_CASES = {
    "no_data_position": (lambda m: {k: v for k, v in m.items()
                                    if k != "data_position"},
                         "data_position"),
    "string_data_position": (_with(data_position="five"), "data_position"),
    "negative_data_position": (_with(data_position=-3), "data_position"),
    # The checkpoint is after 5 steps: the next batch is batch 5, no other.
    "huge_data_position": (_with(data_position=10**12),
                           "data_position must equal step 5"),
    "data_position_behind": (_with(data_position=4),
                             "data_position must equal step 5"),
    "window_losses_nan": (
        _with(metrics_window={"losses": [math.nan] * 3, "accs": [],
                              "consensus": None}), "metrics_window.losses"),
    "window_accs_inf": (
        _with(metrics_window={"losses": [1.0], "accs": [math.inf],
                              "consensus": None}), "metrics_window.accs"),
    "window_consensus_nan": (
        _with(metrics_window={"losses": [], "accs": [],
                              "consensus": math.nan}),
        "metrics_window.consensus"),
    "string_step": (_with(step="x"), "step"),
    "bool_step": (_with(step=True), "step"),
    "nan_train_time": (_with(train_time_s=math.nan), "train_time_s"),
    "string_train_time": (_with(train_time_s="1s"), "train_time_s"),
    "window_list": (_with(metrics_window=[1]), "metrics_window"),
    "window_losses_string": (_with(metrics_window={"losses": "ab"}),
                             "metrics_window.losses"),
    "window_consensus_string": (
        _with(metrics_window={"losses": [], "accs": [], "consensus": "x"}),
        "metrics_window.consensus"),
    "not_an_object": (lambda m: [m], "not an object"),
    "step_not_its_number": (_with(step=4), "its step 4 is not the "
                            "checkpoint's number 5"),
    "huge_step": (_with(step=10**30), "is not the checkpoint's number 5"),
    "nan_topology_round": (_with(topology_round=math.nan), "topology_round"),
    "string_n_workers": (_with(n_workers="8"), "n_workers"),
    # Damaged, not a changed config: each named by its key, never compared.
    "window_negative_loss": (
        _with(metrics_window={"losses": [-5.0], "accs": [], "consensus": None}),
        "metrics_window.losses must be a list of finite numbers >= 0"),
    "window_accuracy_above_one": (
        _with(metrics_window={"losses": [1.0], "accs": [2.0],
                              "consensus": None}),
        "metrics_window.accs must be a list of finite numbers in [0, 1]"),
    "window_negative_consensus": (
        _with(metrics_window={"losses": [], "accs": [], "consensus": -1.0}),
        "metrics_window.consensus must be a finite number >= 0"),
    "window_unknown_key": (
        _with(metrics_window={"losses": [], "accs": [], "consensus": None,
                              "junk": [math.nan]}), "metrics_window has unknown"),
    "window_longer_than_the_run": (  # 6 losses after 5 steps
        _with(metrics_window={"losses": [1.0] * 6, "accs": [],
                              "consensus": None}),
        "metrics_window.losses holds 6 values, more than the 5 steps"),
    "huge_train_time": (_with(train_time_s=1e308),
                        "train_time_s must be a finite number in [0, 1e+09]"),
    "config_list": (_with(config=[]), "config must be an object"),
    # A field deleted inside the stored config would go uncompared.
    "config_without_b1": (
        lambda m: dict(m, config=dict(m["config"], optimizer={
            k: v for k, v in m["config"]["optimizer"].items() if k != "b1"})),
        "config misses ['optimizer.b1']"),
    "config_empty_optimizer": (
        lambda m: dict(m, config=dict(m["config"], optimizer={})),
        "config misses ['optimizer.accum_steps', 'optimizer.b1'"),
    "config_contradicts_n_workers": (
        lambda m: dict(m, config=dict(m["config"], n_workers=4)),
        "n_workers 8 disagrees with config.n_workers 4"),
    "config_contradicts_seed": (
        lambda m: dict(m, config=dict(m["config"], seed=1)),
        "seed 0 disagrees with config.seed 1"),
    "config_without_steps": (
        lambda m: dict(m, config={k: v for k, v in m["config"].items()
                                  if k != "steps"}), "config misses ['steps']"),
    "config_without_model": (
        lambda m: dict(m, config={k: v for k, v in m["config"].items()
                                  if k != "model"}),
        "config misses the group(s) ['model']"),
    "string_seed": (_with(seed="0"), "seed must be a number"),
    "string_compression": (_with(compression="x"),
                           "compression must be an object"),
    "list_model": (_with(model=[]), "model must be an object"),
    "int_topology": (_with(topology=5), "topology must be a string"),
    "string_b1": (
        lambda m: dict(m, config=dict(m["config"], optimizer=dict(
            m["config"]["optimizer"], b1="x"))),
        "config.optimizer.b1 must be a number"),
    "nan_lr": (_with(lr=math.nan), "lr must be a finite number"),
    # A key every writer of the format writes is required: missing, it
    # would leave its field uncompared (a changed global_batch resumed).
    "no_global_batch": (_without("global_batch"),
                        "the document misses ['global_batch']"),
    "no_seed": (_without("seed"), "the document misses ['seed']"),
    "no_topology": (_without("topology"), "the document misses ['topology']"),
    "no_n_workers": (_without("n_workers"), "misses ['n_workers']"),
    "no_compression": (_without("compression"),
                       "the document misses ['compression']"),
    # lr is written since shortly before config: with lr, config is missing.
    "no_config": (_without("config"), "the document misses config"),
    # Float32 values the run computed: none exceeds 3.4028235e38.
    "window_loss_beyond_float32": (
        _with(metrics_window={"losses": [1e300], "accs": [],
                              "consensus": None}),
        "metrics_window.losses holds 1e+300, beyond the largest float32"),
    "window_consensus_beyond_float32": (
        _with(metrics_window={"losses": [], "accs": [], "consensus": 3.5e38}),
        "metrics_window.consensus holds 3.5e+38, beyond the largest float32"),
    "lr_beyond_float32": (_with(lr=1e39), "lr holds 1e+39, beyond"),
    # Well-typed but impossible: damage naming the key, not a mismatch.
    "negative_lr": (_with(lr=-1.0), "lr must be a finite number >= 0, got -1"),
    "zero_n_workers": (_with(n_workers=0), "n_workers must be an integer in "
                       "[1, 2147483647], got 0"),
    "zero_sync_every": (_with(sync_every=0), "sync_every must be an integer "
                        "in [1, 2147483647], got 0"),
    "banana_format": (
        lambda m: dict(m, compression=dict(m["compression"], format="banana")),
        "unknown compression.format='banana'"),
    "banana_format_in_config": (
        lambda m: dict(m, config=dict(m["config"], compression=dict(
            m["config"]["compression"], format="banana"))),
        "unknown config.compression.format='banana'"),
    "faults_enabled_yes": (_with(faults={"enabled": "yes"}),
                           "faults.enabled must be True or False, got 'yes'"),
    # The window holds one loss per step since the last record: empty at a
    # step the writer logs (here log_interval 5 at step 5), else not.
    "window_at_a_logged_step": (
        lambda m: dict(m, config=dict(m["config"], log_interval=5)),
        "metrics_window.losses holds 1 values at step 5, which the writer "
        "logs"),
    "window_at_the_last_step": (
        lambda m: dict(m, config=dict(m["config"], steps=5)),
        "metrics_window.losses holds 1 values at step 5"),
    "empty_window_between_records": (
        _with(metrics_window={"losses": [], "accs": [], "consensus": None}),
        "metrics_window.losses is empty at step 5"),
    # The writer always writes a window: null or missing at a step it does
    # not log, the next record would average the resumed steps only.
    "null_window_between_records": (
        _with(metrics_window=None), "metrics_window is null at step 5, "
        "which the writer does not log"),
    "missing_window_between_records": (
        _without("metrics_window"), "metrics_window is missing at step 5"),
    "accuracies_not_one_per_loss": (
        _with(metrics_window={"losses": [2.0], "accs": [0.5, 0.5],
                              "consensus": None}),
        "metrics_window.accs holds 2 values, losses 1"),
    # The writer derives lr from its config's schedule at its step.
    "lr_not_its_schedule": (_with(lr=0.5), "lr 0.5 disagrees with "
                            "config.schedule at step 5"),
    "string_steps_in_config": (  # a field a resume may change: still checked
        lambda m: dict(m, config=dict(m["config"], steps="x")),
        "config.steps must be an integer in [1, 2147483647], got 'x'"),
    "b1_above_one_in_config": (
        lambda m: dict(m, config=dict(m["config"], optimizer=dict(
            m["config"]["optimizer"], b1=1.5))),
        "config.optimizer.b1 must be a finite number in [0, 1), got 1.5"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_hostile_checkpoint_metadata_on_resume(tmp_path, tiny, case):
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import train  # pylint: disable=g-import-not-at-top
  config, exp, state = tiny
  workdir = str(tmp_path / "run")
  edit, needle = META_CASES[case]
  meta = dict(run_meta.checkpoint_meta(exp, 5), train_time_s=1.0,
              metrics_window={"losses": [2.0], "accs": [], "consensus": None})
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    ckpt.save(5, state, edit(meta))  # checksummed: the file is "intact"
  finally:
    ckpt.close()
  with pytest.raises(ValueError) as info:
    train.train_and_evaluate(config, workdir, experiment=exp)
  _one_line(info.value, os.path.join(workdir, "checkpoints", "5"), needle)
  assert "was written with" not in str(info.value)  # not a changed config
  # Nothing older to fall back to: the damaged checkpoint stays in place.
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["5"]


def test_valid_stored_values_pass_their_rules(tiny):
  """Fields whose rule reads [0, 1) or (0, 1] "or exactly 1" (a kept
  fraction, a failure rate of 1) stored at 1 are intact, not damaged; so
  is the top-level topology "" of a method without one."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, _ = tiny
  meta = dict(run_meta.checkpoint_meta(exp, 5),  # the loop adds its window
              metrics_window={"losses": [2.0], "accs": [], "consensus": None})
  like = copy.deepcopy(meta)
  config = meta["config"]
  config["faults"].update(failure_rate=1, slow_fraction=1.0, slow_speed=1)
  config["compression"].update(fraction=1.0, error_decay=1)
  meta["compression"] = dict(config["compression"])
  assert run_meta.meta_error(meta, 5, like) is None
  # A method without a topology (all_reduce, DiLoCo) stores topology "".
  assert run_meta.meta_error(dict(
      meta, topology="", algorithm="all_reduce",
      config=dict(config, algorithm="all_reduce")), 5, like) is None
  config["faults"]["failure_rate"] = 1.5  # beyond 1: damaged
  assert run_meta.meta_error(meta, 5, like).startswith(
      "config.faults.failure_rate must be a finite number in [0, 1)")


def _top(key, value):
  return lambda m: dict(m, **{key: value})


def _top_in(group, key, value):
  return lambda m: dict(m, **{group: dict(m[group], **{key: value})})


def _in_config(group, key, value):
  def edit(m):
    config = copy.deepcopy(m["config"])
    (config[group] if group else config)[key] = value
    return dict(m, config=config)
  return edit


# Each edit makes the two copies of one field disagree (values valid under
# the field's rule): "<top-level key> ... disagrees with config.<field>".
COPY_CASES = {
    "model.dropout": (_top_in("model", "dropout", 0.1), "config.model.dropout"),
    "model.n_embd": (_top_in("model", "n_embd", 64), "config.model.n_embd"),
    "compression.format": (_top_in("compression", "format", "int8"),
                           "config.compression.format"),
    "compression.block": (_top_in("compression", "block", 128),
                          "config.compression.block"),
    "outer_optimizer.lr": (_top_in("outer_optimizer", "lr", 0.5),
                           "config.outer_optimizer.lr"),
    # gpt_tiny: accum_adamw, 4 steps per window, per_step betas.
    "beta_convention": (_top("beta_convention", "per_window"),
                        "config.optimizer.beta_convention"),
    "topology_config_copy": (_in_config("", "topology", "ring"),
                             "config.topology"),
    "topology_top": (_top("topology", "ring"), "config.topology"),
    # "" is what a method without a topology stores; this one gossips.
    "topology_top_empty": (_top("topology", ""), "config.topology"),
    "faults": (_in_config("faults", "enabled", True), "config.faults"),
    "sync_every_u": (_top("sync_every_u", 31), "config.sync_every_u"),
    "noloco.alpha": (_top("noloco.alpha", 0.25), "config.noloco.alpha"),
    "pipelined_gossip": (_top("pipelined_gossip", True),
                         "config.pipelined_gossip"),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_the_two_copies_of_a_field_must_agree(tiny, case):
  """Every top-level key that is also a config field or group is a copy
  of the stored ``config``'s value (or derived from it): a document whose
  copies disagree is damaged, whichever copy was edited."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, _ = tiny
  meta = _written(exp, 5)
  like = copy.deepcopy(meta)
  assert run_meta.meta_error(copy.deepcopy(meta), 5, like) is None
  edit, field = COPY_CASES[case]
  why = run_meta.meta_error(edit(copy.deepcopy(meta)), 5, like)
  assert why is not None and " disagrees with " + field in why, why


def test_damaged_metadata_falls_back_to_the_older_checkpoint(
    tmp_path, tiny, caplog):
  """The newest checkpoint's checksums match but its document is damaged
  (as if re-signed after an edit): it is moved to ``<step>.corrupt`` with
  one warning naming the file and key, and the older one is selected."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, state = tiny
  like = run_meta.checkpoint_meta(exp, 0)
  root = str(tmp_path / "checkpoints")
  with checkpoint.Checkpointer(root) as ckpt:
    for step in (3, 5):
      meta = _written(exp, step)
      ckpt.save(step, state, dict(meta, seed="0") if step == 5 else meta)
  caplog.set_level("WARNING")
  caplog.clear()  # only the restore's lines (a save may log a wait)
  with checkpoint.Checkpointer(root) as ckpt:
    got = ckpt.select_restore_step(
        lambda s: run_meta.meta_file_error(ckpt.step_dir(s), s, like))
  assert got == 3
  assert sorted(os.listdir(root)) == ["3", "5.corrupt"]
  assert os.path.join(root, "5", "meta", "metadata") + ": seed must be a " \
      "number" in caplog.text


def test_damaged_step_entries_fall_back_with_one_warning_each(
    tmp_path, tiny, caplog):
  """A step entry that is a regular file, an empty directory, or one whose
  Orbax metadata is cut short is damage found before Orbax reads it: each
  is moved aside with the one warning naming it (no Orbax log line about
  it), and the older intact checkpoint is selected."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, state = tiny
  root = tmp_path / "checkpoints"
  with checkpoint.Checkpointer(str(root), max_to_keep=3) as ckpt:
    for step in (1, 3, 5):
      ckpt.save(step, state, _written(exp, step))
  (root / "5" / "_CHECKPOINT_METADATA").write_text("{")
  shutil.rmtree(root / "3")
  (root / "3").write_text("x")
  (root / "7").mkdir()
  caplog.set_level("WARNING")  # Orbax's own (W/E) lines are counted too
  caplog.clear()  # only the restore's lines (a save may log a wait)
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() == 1
  assert sorted(os.listdir(root)) == ["1", "3.corrupt", "5.corrupt",
                                      "7.corrupt"]
  lines = [r.getMessage() for r in caplog.records
           if r.levelno >= logging.WARNING]
  assert len(lines) == 3, lines
  for step, why in ((7, "the directory is empty"),
                    (5, "_CHECKPOINT_METADATA unreadable"),
                    (3, "it is not a directory")):
    assert any(line.startswith(f"checkpoint {step} (") and why in line
               for line in lines), (step, lines)


@pytest.mark.parametrize("name, text", [
    ("_CHECKPOINT_METADATA", "[1, 2]"),  # not summed: Orbax reads it first
    (os.path.join("state", "_sharding"), "[]"),  # summed: re-signed
    (os.path.join("state", "_METADATA"), "7"),
])
def test_a_checkpoint_json_file_that_is_not_an_object_is_damage(
    tmp_path, tiny, caplog, name, text):
  """Valid JSON of the wrong top-level type in a file Orbax reads (Orbax
  stopped with "Metadata dict must be a dictionary, but got list", naming
  no file): the checkpoint is moved aside with one warning naming the
  file, and the older one is selected; listing the steps before that is
  one line naming the checkpoint."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, state = tiny
  root = tmp_path / "checkpoints"
  with checkpoint.Checkpointer(str(root)) as ckpt:
    for step in (3, 5):
      ckpt.save(step, state, _written(exp, step))
  (root / "5" / name).write_text(text)
  if name != "_CHECKPOINT_METADATA":
    workdir_lib.write_sums(str(root / "5"), skip=checkpoint_files.UNSUMMED)
  assert checkpoint_files.check_checkpoint(str(root / "5"))[0] == "corrupt"
  if name == "_CHECKPOINT_METADATA":
    with checkpoint.Checkpointer(str(root)) as ckpt:
      with pytest.raises(checkpoint.CheckpointError) as info:
        ckpt.all_steps()
    _one_line(info.value, f"checkpoint 5 ({root / '5'}) is corrupt: {name}")
  caplog.set_level("WARNING")
  caplog.clear()  # only the restore's lines (a save may log a wait)
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() == 3
    assert ckpt.all_steps() == [3]
  assert sorted(os.listdir(root)) == ["3", "5.corrupt"]
  lines = [r.getMessage() for r in caplog.records
           if r.levelno >= logging.WARNING]
  assert len(lines) == 1, lines
  assert lines[0].startswith("checkpoint 5 (") and f"{name} holds a JSON " \
      "" in lines[0] and "not an object" in lines[0], lines


@pytest.mark.parametrize("field, value, kind", [
    ("item_handlers", 5, "a JSON integer, not an object or a string"),
    ("commit_timestamp_nsecs", "x", "a JSON string, not an integer"),
    ("custom_metadata", "x", "a JSON string, not an object"),
    ("metrics", [1], "a JSON array, not an object"),
    ("performance_metrics", 1.5, "a JSON number, not an object"),
])
def test_orbax_step_metadata_with_a_field_of_another_type_is_damage(
    tmp_path, tiny, caplog, field, value, kind):
  """``_CHECKPOINT_METADATA`` (not summed) a JSON object whose field Orbax
  reads is of another type (Orbax stopped with "Object must be of type
  <class 'dict'>, got <class 'list'>", naming no file, no fallback): the
  checkpoint is moved aside with one warning naming the file and field,
  and the older one is selected."""
  _, exp, state = tiny
  root = tmp_path / "checkpoints"
  with checkpoint.Checkpointer(str(root)) as ckpt:
    for step in (3, 5):
      ckpt.save(step, state, _written(exp, step))
  path = root / "5" / "_CHECKPOINT_METADATA"
  doc = json.loads(path.read_text())
  assert doc.get(field) is None or isinstance(doc[field], (dict, int, str))
  path.write_text(json.dumps(dict(doc, **{field: value})))
  caplog.set_level("WARNING")
  caplog.clear()  # only the restore's lines (a save may log a wait)
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() == 3
  assert sorted(os.listdir(root)) == ["3", "5.corrupt"]
  lines = [r.getMessage() for r in caplog.records
           if r.levelno >= logging.WARNING]
  assert len(lines) == 1, lines
  assert lines[0].startswith("checkpoint 5 (") and (
      f"_CHECKPOINT_METADATA: field '{field}' holds {kind}") in lines[0], lines


def test_the_document_lr_is_its_own_schedule_at_its_step(tiny):
  """``lr`` is what the stored schedule gives at the stored step (linear
  warmup from peak/W, by hand): another value is damage naming both, not
  a changed schedule; a changed schedule inside ``config`` moves both."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, _ = tiny
  meta = _written(exp, 5)
  like = copy.deepcopy(meta)
  sched = meta["config"]["schedule"]
  peak, warm = sched["peak_lr"], sched["warmup_steps"]
  assert sched["name"] == "warmup_cosine" and warm > 5
  by_hand = peak / warm + (peak - peak / warm) * 5 / warm
  assert meta["lr"] == pytest.approx(by_hand, rel=1e-6)
  assert run_meta.meta_error(meta, 5, like) is None
  why = run_meta.meta_error(dict(meta, lr=by_hand * 1.01), 5, like)
  assert why == (f"lr {by_hand * 1.01:.6g} disagrees with config.schedule "
                 f"at step 5 ({by_hand:.6g}; the writer derives one from "
                 "the other)"), why
  doubled = copy.deepcopy(meta)  # both copies changed together: intact
  doubled["config"]["schedule"]["peak_lr"] = 2 * peak
  doubled["lr"] = 2 * by_hand
  assert run_meta.meta_error(doubled, 5, like) is None


def test_a_changed_model_field_at_its_default_is_shown_resolved(tiny):
  """``model.param_dtype`` at its default is left out of the stored model
  group; a mismatch shows it as float32, not None."""
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  _, exp, _ = tiny
  meta = run_meta.checkpoint_meta(exp, 5)
  assert "param_dtype" not in meta["model"]  # this run: the default
  meta["model"] = dict(meta["model"], param_dtype="bfloat16")
  with pytest.raises(ValueError) as info:
    run_meta.check_resumable(exp, meta, "ckpt")
  assert ("config.model.param_dtype='bfloat16' but this run has float32 "
          "(the default)") in str(info.value), info.value


def test_a_field_missing_inside_the_stored_config_is_its_default(tiny):
  """A field the stored ``config`` lacks (added since the checkpoint) ran
  at its default: AdamW's b1 = 0.9 (Kingma & Ba's value, the base
  config's). A run with b1 = 0.8 is refused, not resumed uncompared; an
  emptied group is read the same way."""
  from decentral_jax.runner import experiment as experiment_lib  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import run_meta  # pylint: disable=g-import-not-at-top
  config, exp, _ = tiny
  meta = run_meta.checkpoint_meta(exp, 5)
  optimizer = {k: v for k, v in meta["config"]["optimizer"].items()
               if k != "b1"}
  run_meta.check_resumable(  # this run has b1 = 0.9: the same
      exp, dict(meta, config=dict(meta["config"], optimizer=optimizer)), "c")
  changed = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.model.n_layer=1", "--config.model.n_embd=32",
       "--config.model.n_head=2", "--config.model.block_size=16",
       "--config.global_batch=16", "--config.eval_batches=1",
       "--config.steps=10", "--config.optimizer.b1=0.8"))
  other = experiment_lib.Experiment(changed)
  for group in (optimizer, {}):
    stored = dict(meta, config=dict(meta["config"], optimizer=group))
    with pytest.raises(ValueError) as info:
      run_meta.check_resumable(other, stored, "ckpt")
    assert ("written with config.optimizer.b1=0.9 but this run has 0.8"
            in str(info.value)), info.value


# -- the work directory's lock and checksums -----------------------------------


def test_deeply_nested_orbax_step_metadata_is_corrupt(tmp_path):
  """``_CHECKPOINT_METADATA`` is written after the checksums: a torn or
  hostile one (here nested past the recursion limit) marks the checkpoint
  corrupt instead of stopping the resume with a RecursionError."""
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  workdir_lib.write_sums(str(root))
  (root / "_CHECKPOINT_METADATA").write_text("[" * DEEP + "]" * DEEP)
  status, why = checkpoint_files.check_checkpoint(str(root))
  assert status == "corrupt" and "_CHECKPOINT_METADATA" in why, why


def test_lock_record_with_an_impossible_pid_is_taken_over(tmp_path, caplog):
  lock_path = tmp_path / workdir_lib.LOCK_FILE
  lock_path.write_text(json.dumps({"host": socket.gethostname(),
                                   "pid": 10**30}))
  caplog.set_level("WARNING")
  with workdir_lib.WorkdirLock(str(tmp_path)) as lock:
    assert lock.previous["pid"] == 10**30
  assert "taking over the lock" in caplog.text


@pytest.mark.parametrize("entry", ["../outside", "ABSOLUTE", "a/../../x"])
def test_checksum_manifest_paths_stay_inside(tmp_path, entry):
  """A manifest naming a file outside its directory is malformed, even when
  that file's checksum matches (it was read and trusted before)."""
  root = tmp_path / "ckpt"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  outside = tmp_path / "outside"
  outside.write_bytes(b"x")
  if entry == "ABSOLUTE":
    entry = str(outside)
  (tmp_path / "x").write_bytes(b"x")
  digest = hashlib.sha256(b"x").hexdigest()
  (root / workdir_lib.SUMS_FILE).write_text(f"{digest}  {entry}\n")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and "inside the directory" in why, why
