"""Configs: loading, command-line overrides, validation errors, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import N_DEVICES
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import presets
from decentral_jax import topology
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = ("gpt_tiny.py", "gpt2_small_owt.py", "gpt2_small_owt.py:all_reduce",
           "cnn_fashion_mnist.py")


def load_config(name: str, *overrides: str):
  """Loads ``configs/<name>`` with command-line style overrides."""
  return config_lib.load_config(os.path.join(ROOT, "configs", name), overrides)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_are_valid_and_documented(name):
  config = load_config(name)
  validation.check_config(config)
  assert topology.canonical_name(config.topology) in topology.NAMES
  with open(os.path.join(ROOT, "configs", name.split(":")[0]),
            encoding="utf-8") as f:
    source = f.read()
  assert source.lstrip().startswith('"""') and "Data:" in source
  _assert_assignments_commented(source, name, ("  c.",))


def test_presets_are_the_config_files_runs_and_documented():
  # configs/gpt_tiny.py and gpt_quick.py return the package's presets (the
  # main job's defaults, which need no checkout).
  for name in presets.PRESETS:
    assert (load_config(f"{name}.py").to_dict()
            == presets.load(name).to_dict()), name
  with open(presets.__file__, encoding="utf-8") as f:
    _assert_assignments_commented(f.read(), "presets.py", ("  c.",))
  quick = presets.load("gpt_quick", ["steps=7"])
  assert (quick.steps, quick.model.n_embd, quick.is_locked) == (7, 64, True)
  with pytest.raises(ValueError) as info:
    presets.load("gpt_huge")
  assert str(info.value) == ("unknown preset 'gpt_huge'; use one of "
                             "gpt_tiny, gpt_quick.")
  # --config of train and compare: a preset by name, else a file.
  named = presets.load_named_or_file("gpt_quick", ["steps=3"])
  from_file = presets.load_named_or_file("configs/gpt_quick.py", ["steps=3"])
  assert named.to_dict() == from_file.to_dict()
  assert named.steps == 3 and named.model.n_embd == 64
  with pytest.raises(ValueError) as info:
    presets.load_named_or_file("gpt_huge")
  assert str(info.value) == ("config 'gpt_huge' is neither a preset (one of "
                             "gpt_tiny, gpt_quick) nor a config file (FILE.py "
                             "or FILE.py:ARG).")
  with pytest.raises(ValueError, match="the preset 'gpt_quick' takes no :ARG"):
    presets.load_named_or_file("gpt_quick:foo")
  with pytest.raises(ValueError, match="does not exist"):
    presets.load_named_or_file("no_such_dir/gpt_huge.py")


def _assert_assignments_commented(source: str, name: str, prefixes) -> None:
  """Every field assignment sits under a comment (a run may share one)."""
  lines = source.splitlines()

  def field(line):
    return line.startswith(prefixes) and "ConfigDict()" not in line

  for i, line in enumerate(lines):
    if field(line):
      j = i - 1
      while field(lines[j]):
        j -= 1
      assert lines[j].strip().startswith("#"), f"{name}:{i + 1} {line!r}"


def test_schema_defines_every_field_once_with_a_comment():
  """base_config() holds every field; the variants only override."""
  for module in ("config.py", "config_groups.py"):
    path = os.path.join(ROOT, "decentral_jax", "runner", module)
    with open(path, encoding="utf-8") as f:
      source = f.read()
    _assert_assignments_commented(source, module, ("  c.", "  m.", "  g."))
  for name in SHIPPED:
    config = load_config(name)
    base = config_lib.base_config(config.model.name)
    # Same fields (and nested groups) as the schema: nothing added or lost.
    assert _keys(config) == _keys(base), name
  # The schema's defaults are gpt_tiny but for AccumAdamW's best measured
  # setting (BENCHMARKS.md section 10): horizon-matched betas at lr 3e-3.
  tiny, base = load_config("gpt_tiny.py"), config_lib.base_config("gpt")
  differ = {k: (tiny[k.split(".")[0]][k.split(".")[1]],
                base[k.split(".")[0]][k.split(".")[1]])
            for k in _keys(base) if "." in k and k.count(".") == 1
            and tiny[k.split(".")[0]][k.split(".")[1]]
            != base[k.split(".")[0]][k.split(".")[1]]}
  assert differ == {"optimizer.beta_convention": ("per_step", "per_window"),
                    "schedule.peak_lr": (3e-3, 1.5e-3),
                    "schedule.final_lr": (3e-4, 1.5e-4)}
  assert all(tiny[k] == base[k] for k in base if not hasattr(base[k], "items"))


def _keys(config, prefix=""):
  out = set()
  for k, v in config.items():
    out.add(prefix + k)
    if hasattr(v, "items"):
      out |= _keys(v, prefix + k + ".")
  return out


def test_overrides_and_lock():
  config = load_config("gpt_tiny.py", "--config.optimizer.accum_steps=8",
                       "--config.topology=ring", "--config.steps=7",
                       "--config.data.path=/some/file",
                       "--config.workdir=/tmp/w")
  assert config.optimizer.accum_steps == 8
  assert (config.topology, config.steps) == ("ring", 7)
  assert config.data.path == "/some/file" and config.workdir == "/tmp/w"
  defaults = load_config("gpt_tiny.py")
  assert defaults.data.path is None and defaults.optimizer.accum_steps == 4
  with pytest.raises(AttributeError):
    config.not_a_field = 1  # locked
  with pytest.raises(Exception, match="no_such_field"):
    load_config("gpt_tiny.py", "--config.no_such_field=1")


def test_gpt2_small_owt_matches_the_paper():
  dec = load_config("gpt2_small_owt.py")
  ar = load_config("gpt2_small_owt.py:all_reduce")
  for c in (dec, ar):
    m = c.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (12, 12, 768, 1024)
    assert c.global_batch == 480 and c.n_workers == 16
    s = c.schedule
    assert (s.name, s.peak_lr, s.warmup_steps, s.final_lr) == (
        "warmup_cosine", 6e-4, 2000, 6e-5)
    assert c.grad_clip == 1.0 and c.optimizer.weight_decay == 0.1
  assert (ar.algorithm, ar.optimizer.name, ar.optimizer.b2) == (
      "all_reduce", "adamw", 0.95)
  assert (dec.algorithm, dec.optimizer.name, dec.optimizer.b2,
          dec.optimizer.accum_steps) == ("decentralized", "accum_adamw", 0.98,
                                         8)
  assert topology.canonical_name(dec.topology) == "alternating_exp_ring"
  assert (dec.workers_per_node, dec.gossip_rounds) == (4, "static")
  assert dec.global_avg_interval == 1000
  # All-Reduce neither gossips nor groups nodes: those fields stay unset.
  assert (ar.topology, ar.workers_per_node, ar.gossip_rounds) == (
      "one_peer_exp", 1, "auto")  # base_config's defaults


def test_schedules_match_formulas():
  c = load_config("gpt_tiny.py", "--config.steps=100",
                  "--config.schedule.peak_lr=1.0",
                  "--config.schedule.warmup_steps=10",
                  "--config.schedule.final_lr=0.1")
  lr = builders.make_schedule(c)
  assert float(lr(0)) == pytest.approx(0.1)  # peak / warmup
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(55)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)
  assert float(lr(100)) == pytest.approx(0.1)
  with c.unlocked():
    c.schedule.name = "inverse_sqrt"
  lr = builders.make_schedule(c)
  assert float(lr(4)) == pytest.approx(0.99 * 5 / 10 + 0.01)
  assert float(lr(39)) == pytest.approx((10 / 40) ** 0.5)


def _error(name, *overrides, match):
  with pytest.raises(ValueError) as info:
    experiment_lib.Experiment(load_config(name, *overrides))
  message = str(info.value)
  assert "\n" not in message
  for m in (match if isinstance(match, tuple) else (match,)):
    assert m in message, message
  return message


def test_unknown_choices():
  _error("gpt_tiny.py", "--config.topology=hypercube",
         match=("config.topology", "one_peer_exp"))
  _error("gpt_tiny.py", "--config.optimizer.name=sgd",
         match=("config.optimizer.name='sgd'", "accum_adamw"))
  _error("gpt_tiny.py", "--config.n_workers=6", "--config.global_batch=12",
         match=("config.topology='one_peer_exp'", "power of two"))
  _error("gpt_tiny.py", "--config.algorithm=gossip",
         match=("config.algorithm", "all_reduce"))
  _error("gpt_tiny.py", "--config.schedule.name=step",
         match="config.schedule.name")
  _error("gpt_tiny.py", "--config.data.source=fashion_mnist",
         match=("config.data.source", "pydoc"))


def test_bad_numbers():
  _error("gpt_tiny.py", "--config.global_batch=60",
         match=("config.global_batch=60", "config.n_workers=8",
                "--config.global_batch=56"))
  _error("gpt_tiny.py", "--config.optimizer.name=adamw",
         match=("config.optimizer.accum_steps=4", "accum_steps=1"))
  _error("gpt_tiny.py", "--config.workers_per_node=3",
         match="config.workers_per_node=3")
  _error("gpt_tiny.py", "--config.steps=0", match="config.steps")
  _error("gpt_tiny.py", "--config.distributed.enabled=True",
         match="config.distributed.enabled")


def test_more_workers_than_devices_says_how_to_simulate():
  n = 2 * N_DEVICES
  _error("gpt_tiny.py", f"--config.n_workers={n}", f"--config.global_batch={n}",
         match=(f"config.n_workers={n}",
                f"xla_force_host_platform_device_count={n}"))


def test_missing_data(tmp_path):
  _error("cnn_fashion_mnist.py", f"--config.data.path={tmp_path}/none",
         match=("config.data.path", "apt-get install dataset-fashion-mnist"))
  _error("gpt_tiny.py", "--config.data.source=text_file",
         match="config.data.path is not set")
  _error("gpt_tiny.py", "--config.data.source=text_file",
         f"--config.data.path={tmp_path}/missing.txt",
         match=("config.data.path", "missing.txt"))
  _error("gpt2_small_owt.py", match=("config.data.path is not set",
                                     "prepare.py"))
  _error("gpt2_small_owt.py", f"--config.data.path={tmp_path}",
         "--config.n_workers=8", "--config.global_batch=16",
         match=("config.data.path", "train.bin"))


def test_corpus_shorter_than_context(tmp_path):
  path = tmp_path / "short.txt"
  path.write_bytes(b"a tiny corpus " * 100)  # 1400 bytes
  _error("gpt_tiny.py", "--config.data.source=text_file",
         f"--config.data.path={path}", "--config.model.block_size=2048",
         "--config.global_batch=8",
         match=("config.model.block_size=2048", "fewer than"))


@pytest.mark.integration
def test_cli_reports_bad_input_in_one_line(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
       "--config", os.path.join(ROOT, "configs", "gpt_tiny.py"),
       "--workdir", str(tmp_path / "w"), "--config.topology=hypercube"],
      capture_output=True, text=True, env=env, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and "config.topology" in errors[0]
  assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_cli_trains_with_simulated_cpu_devices(tmp_path):
  """Out of the box on CPU: 8 workers although no device flags are set."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  workdir = tmp_path / "w"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
       "--config", os.path.join(ROOT, "configs", "gpt_tiny.py"),
       "--workdir", str(workdir), "--config.steps=3",
       "--config.model.n_layer=1", "--config.model.n_embd=16",
       "--config.model.n_head=1", "--config.model.block_size=8",
       "--config.global_batch=8", "--config.eval_batches=1",
       "--config.log_interval=1"],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished: step=3" in proc.stdout
  assert "8 workers" in proc.stderr
  assert (workdir / "metrics.jsonl").exists()
  assert (workdir / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize("variant, shape, params", [
    # 12 L d^2 + (50304 + 1024) d + (2 L + 1) d, counted by hand.
    ("124m", (12, 12, 768), 124_373_760),
    ("350m", (24, 16, 1024), 354_599_936),
    ("1.3b", (24, 16, 2048), 1_313_179_648)])
def test_gpt2_sizes_are_the_paper_run_at_three_sizes(variant, shape,
                                                      params):
  c = load_config(f"gpt2_sizes.py:{variant}")
  validation.check_config(c)
  m = c.model
  assert (m.n_layer, m.n_head, m.n_embd) == shape
  layers, _, width = shape
  assert 12 * layers * width**2 + 51328 * width + (2 * layers + 1) * width \
      == params
  # Everything else is the decentralized GPT-2 small run.
  small = load_config("gpt2_small_owt.py").to_dict()
  got = c.to_dict()
  for key in ("n_layer", "n_head", "n_embd"):
    got["model"].pop(key), small["model"].pop(key)
  assert got == small
  with pytest.raises(ValueError, match="gpt2_sizes.py:124m"):
    load_config("gpt2_sizes.py:2b")
