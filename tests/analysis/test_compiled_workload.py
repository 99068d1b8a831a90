"""A runtime-model workload read from a compiled step (analysis.
compiled_workload) and read back by the NumPy runtime model
(runtime_model.workload_file); predict and the main job's pricing take it.

Expected FLOPs are hand counts of the model's matrix multiplies per token:
forward ``24 L d^2`` (attention projections and MLP) ``+ 2 d V`` (the
output layer) ``+ 4 T d L`` (scores and their weighted sum, all ``T``
keys), backward twice the forward."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from conftest import FIXTURES
from decentral_jax.analysis import compiled_workload
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import workload_file
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.runtime_model_cli import main as cli

_TINY = os.path.join(FIXTURES, "gpu_overlap",
                     "gpt_tiny_after_h200_r0_none.hlo.gz")
_GPT2 = os.path.join(FIXTURES, "compiled_workload", "gpt2_small_h200.json")


def _forward_per_token(n_layer, d, vocab, t):
  return 24 * n_layer * d * d + 2 * d * vocab + 4 * t * d * n_layer


def _tiny(tmp_path):
  with gzip.open(_TINY, "rt") as f:
    work = compiled_workload.workload_from_compiled(
        f.read(), param_count=434_816, source="gpt_tiny fixture")
  path = str(tmp_path / "tiny.json")
  compiled_workload.write_workload(path, work)
  return work, path


def test_gpt_tiny_flops_and_the_file_round_trip(tmp_path):
  work, path = _tiny(tmp_path)
  # gpt_tiny: L 2, d 128, V 256, T 64; 8 sequences of 64 tokens a worker.
  fwd = 8 * 64 * _forward_per_token(2, 128, 256, 64)
  assert work["matmul_flops"]["forward"] == fwd
  assert work["matmul_flops"]["backward"] == 2 * fwd
  assert work["param_bytes"] == 4 * 434_816
  assert work["activation_bytes"] is None  # text: no memory analysis
  assert work["compute_s"]["forward"] > 0 and "fallback" in work["clock"]
  w = workload_file.read_workload(path)
  assert (w.param_count, w.forward_s, w.backward_s, w.optimizer_s) == (
      434_816, work["compute_s"]["forward"], work["compute_s"]["backward"],
      work["compute_s"]["optimizer"])
  f = work["gossip_in_flight"]
  assert w.gossip_in_flight == (f["forward"], f["backward"])
  assert workload_file.read_workload(path, in_flight=False
                                     ).gossip_in_flight is None


def test_bad_files_name_the_file_and_field(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{")
  with pytest.raises(ValueError, match="bad.json.*not readable JSON"):
    workload_file.read_workload(str(bad))
  bad.write_text(json.dumps({"format": "other"}))
  with pytest.raises(ValueError, match="format must be"):
    workload_file.read_workload(str(bad))
  bad.write_text(json.dumps({"format": workload_file.FORMAT,
                             "param_count": 1}))
  with pytest.raises(ValueError, match="missing or bad field 'compute_s'"):
    workload_file.read_workload(str(bad))
  with pytest.raises(ValueError, match="param_count=0"):
    compiled_workload.workload_from_compiled("", param_count=0)


def test_predict_and_compare_price_with_it(tmp_path, capsys):
  _, path = _tiny(tmp_path)
  w = workload_file.read_workload(path)
  assert cli.main(["predict", "--workload-file", path, "--preset",
                   "h100_ib", "--n-workers", "16", "--methods",
                   "dadam,dadam:pipelined=1"]) == 0
  out = capsys.readouterr().out
  assert f"--workload-file {path}, read from a compiled" in out
  assert f"{1e3 * w.compute_mean_s:.1f} ms per step" in out
  assert pricing.check_workload(path) == path
  c, w2 = pricing.PricingCluster("h100_ib", preset="h100_ib").setup(16, path)
  assert (w2.param_count, w2.forward_s) == (w.param_count, w.forward_s)
  assert "read from a compiled step" in pricing.workload_words(path)
  assert cli.main(["predict", "--workload-file", path, "--workload",
                   "1b"]) == 2
  assert "give one of them" in capsys.readouterr().err


def test_hand_typed_gpt2_small_against_its_compile():
  """``presets.WORKLOADS["gpt2_small"]`` prices ``6 N`` FLOPs per token
  (N = 124,439,808 parameters). The compiled GPT-2 small step (12 layers,
  width 768, vocabulary 50304, context 1024, 30 sequences a worker) has
  ``3 x forward`` per token: 6 N plus the attention scores' ``12 L T d``
  less the position embedding and norms counted in N: 14.5% more.
  Fixture: ``benchmarks/gpu_check.py --deviceless h200 --config
  configs/gpt2_small_owt.py:decentralized --set n_workers=8 --set
  global_batch=240 --set eval_batches=1 --set data.path=DIR --topology
  2x1x4 --programs 0:none --workload FILE`` (511 s of compile here)."""
  with open(_GPT2, encoding="utf-8") as f:
    work = json.load(f)
  tokens = 30 * 1024
  per_token = (work["matmul_flops"]["forward"]
               + work["matmul_flops"]["backward"]) / tokens
  assert work["matmul_flops"]["forward"] == tokens * _forward_per_token(
      12, 768, 50304, 1024)
  n = presets.WORKLOADS["gpt2_small"]["param_count"]
  # gpt2_small_owt's model has 66,048 parameters fewer than the typed
  # count (nanoGPT's GPT-2 with biases): 0.05%.
  assert n - work["param_count"] == 66_048
  assert per_token / (6 * n) == pytest.approx(1.145, abs=0.005)
  # The typed compute time is 6 N x 16 x 1024 FLOPs at 40% of 989.4
  # TFLOP/s; at the same rate the compiled FLOPs take 14.5% longer.
  typed = presets.WORKLOADS["gpt2_small"]
  typed_s = typed["forward_s"] + typed["backward_s"]
  compiled_s = per_token * 16 * 1024 / (0.4 * 989.4e12)
  assert compiled_s / typed_s == pytest.approx(1.145, abs=0.005)
