"""Training loop: resume bit-exactness, evaluation, NaN guard, end-to-end runs.

Models are tiny (1 layer, width 32, context 16) and compiled experiments are
shared between tests through module-scoped fixtures, so the file runs in well
under two minutes on two CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import metrics
from decentral_jax import models
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax.runner import train
from decentral_jax.data import text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8
TINY_GPT = ("--config.model.n_layer=1", "--config.model.n_embd=32",
            "--config.model.n_head=2", "--config.model.block_size=16",
            "--config.global_batch=16", "--config.eval_batches=1")


def load_config(name: str, *overrides: str):
  """Loads ``configs/<name>`` with command-line style overrides."""
  return config_lib.load_config(os.path.join(ROOT, "configs", name), overrides)


def gpt_config(*extra: str):
  """gpt_tiny, tiny sizes, n=8, one_peer_exp, AccumAdamW T=2, dropout, 20 steps."""
  return load_config(
      "gpt_tiny.py", *TINY_GPT, "--config.topology=one_peer_exp",
      "--config.model.dropout=0.1",
      "--config.optimizer.accum_steps=2", "--config.steps=20",
      "--config.schedule.warmup_steps=3", "--config.log_interval=5",
      "--config.eval_interval=10", "--config.checkpoint_interval=10", *extra)


@pytest.fixture(scope="module")
def gpt_exp():
  require_devices(N)
  return experiment_lib.Experiment(gpt_config())


@pytest.fixture(scope="module")
def gpt_exp_fresh():
  """A second, independently built experiment with the same config."""
  require_devices(N)
  return experiment_lib.Experiment(gpt_config())


def run_steps(exp, state, start: int, stop: int):
  for s in range(start, stop):
    state, m = exp.train_step(state, exp.get_batch(s))
    jax.block_until_ready(m)  # at most one collective step in flight
  return state


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
  la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.slow
def test_resume_is_bit_exact(gpt_exp, gpt_exp_fresh, tmp_path):
  """7 steps straight == 5 steps, save, restore into a new Experiment, 2 more."""
  straight = run_steps(gpt_exp, gpt_exp.init_state(), 0, 7)
  part = run_steps(gpt_exp, gpt_exp.init_state(), 0, 5)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(5, part, run_meta.checkpoint_meta(gpt_exp, 5))
  ckpt.close()
  del part

  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.latest_step() == 5
  restored, meta = ckpt.restore(5, gpt_exp_fresh.init_state())
  ckpt.close()
  assert meta["data_position"] == 5
  period = gpt_exp_fresh.topology.period
  assert period == 3 and meta["topology_round"] == 5 % period
  np.testing.assert_array_equal(
      np.asarray(optim.round_count(restored.opt_state)), np.full(N, 5))
  resumed = run_steps(gpt_exp_fresh, restored, meta["data_position"], 7)

  assert_trees_equal(straight.params, resumed.params)
  assert_trees_equal(straight.opt_state, resumed.opt_state)
  np.testing.assert_array_equal(np.asarray(resumed.step), np.full(N, 7))
  np.testing.assert_array_equal(
      np.asarray(optim.round_count(resumed.opt_state)), np.full(N, 7))
  # Not vacuous: the workers' replicas differ and differ from the start.
  wte = np.asarray(straight.params["wte"]["embedding"])
  assert not np.array_equal(wte[0], wte[1])
  start = np.asarray(gpt_exp.init_state().params["wte"]["embedding"])
  assert not np.array_equal(wte[0], start[0])


@pytest.mark.slow
def test_dropout_keys_differ_per_worker_and_per_step(gpt_exp):
  """Same parameters and batch on every worker: only dropout tells them apart."""
  sharding = parallel.worker_sharding(gpt_exp.mesh)
  same = tuple(jax.device_put(np.repeat(np.asarray(a)[:1], N, axis=0),
                              sharding) for a in gpt_exp.get_batch(0))

  def losses(step):
    state = gpt_exp.init_state()
    state = state.replace(step=state.step + step)
    _, m = gpt_exp.train_step(state, same)
    return np.asarray(m["loss"])

  first = losses(0)
  assert len(set(first.tolist())) == N  # a different key on every worker
  np.testing.assert_array_equal(losses(0), first)  # deterministic
  assert not np.any(losses(1) == first)  # and a different key every step


def _reference_eval(exp, state):
  """NumPy/Flax oracle for Experiment.evaluate on a gpt_tiny config."""
  c = exp.config
  t, g, n = c.model.block_size, c.global_batch, exp.n_workers
  _, val = text.byte_splits(text.pydoc_corpus(), c.data.val_fraction)
  batches = text.eval_batches(val, t, g, c.eval_batches)
  model = models.GPT(models.GPTConfig(
      vocab_size=c.model.vocab_size, block_size=t, n_layer=c.model.n_layer,
      n_head=c.model.n_head, n_embd=c.model.n_embd, bias=c.model.bias))
  apply = jax.jit(lambda p, x, y: models.lm_loss(
      model.apply({"params": p}, x), y))
  params = host(state.params)
  avg = jax.tree.map(lambda x: x.astype(np.float64).mean(0).astype(np.float32),
                     params)
  avg_loss = np.mean([float(apply(avg, x, y)) for x, y in batches])
  own = [np.mean([float(apply(jax.tree.map(lambda a, w=w: a[w], params),
                               x[::n], y[::n])) for x, y in batches])
         for w in range(n)]
  subset = np.mean([float(apply(avg, x[::n], y[::n])) for x, y in batches])
  leaves = [x.astype(np.float64) for x in jax.tree.leaves(params)]
  consensus = sum(np.sum((x - x.mean(0)) ** 2) for x in leaves) / n
  return avg_loss, np.asarray(own), subset, consensus


@pytest.mark.slow
def test_evaluate_matches_oracle_and_does_not_change_training(gpt_exp):
  with_eval = gpt_exp.init_state()
  without = gpt_exp.init_state()
  for s in range(3):
    batch = gpt_exp.get_batch(s)
    gpt_exp.evaluate(with_eval)
    with_eval, _ = gpt_exp.train_step(with_eval, batch)
    jax.block_until_ready(with_eval)
    result = gpt_exp.evaluate(with_eval)
    without, _ = gpt_exp.train_step(without, batch)
    jax.block_until_ready(without)
  assert_trees_equal(with_eval, without)

  avg_loss, own, subset, consensus = _reference_eval(gpt_exp, with_eval)
  np.testing.assert_allclose(result["eval/loss"], avg_loss, rtol=2e-5)
  np.testing.assert_allclose(result["eval/loss_subset"], subset, rtol=2e-5)
  np.testing.assert_allclose(result["eval/worker_excess_max"],
                             own.max() - subset, rtol=1e-3, atol=2e-5)
  np.testing.assert_allclose(result["eval/worker_loss_mean"], own.mean(),
                             rtol=2e-5)
  np.testing.assert_allclose(result["eval/worker_loss_min"], own.min(),
                             rtol=2e-5)
  np.testing.assert_allclose(result["eval/worker_loss_max"], own.max(),
                             rtol=2e-5)
  np.testing.assert_allclose(result["eval/worker_loss_std"], own.std(),
                             rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(result["consensus_distance"], consensus,
                             rtol=1e-4)
  assert consensus > 0 and own.std() > 0


@pytest.mark.integration
def test_loop_end_to_end_resume_and_no_retrace(gpt_exp, gpt_exp_fresh,
                                               tmp_path):
  """gpt_tiny for 20 steps; then resume from step 10 gives the same result."""
  config = gpt_exp.config
  workdir = str(tmp_path / "run")
  final = train.train_and_evaluate(config, workdir, experiment=gpt_exp)
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 5, 10, 15, 20]
  assert records[0]["consensus_distance"] < 1e-9  # identical initial replicas
  assert records[0]["eval/loss"] == pytest.approx(np.log(256), abs=0.1)
  records = records[1:]
  for key in ("train/loss", "lr", "consensus_distance", "step_time_ms",
              "tokens_per_sec"):
    assert all(r[key] is not None for r in records), key
  assert "eval/loss" in records[1] and "eval/loss" in records[3]
  assert records[-1]["train/loss"] < records[0]["train/loss"] - 0.5
  assert final["eval/loss"] < records[1]["eval/loss"] < np.log(256)
  assert final["step"] == 20 and final["param_count"] == gpt_exp.param_count
  np.testing.assert_allclose(final["tokens_per_sec"],
                             16 * 16 / (final["step_time_ms"] / 1e3))
  # The step compiled once, whatever called it.
  assert gpt_exp.programs.traces == 1  # compiled once

  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.all_steps() == [10, 20]
  like = gpt_exp.init_state()
  done20, _ = ckpt.restore(20, like)
  ckpt.close()
  done20 = host(done20)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "20"))

  again = train.train_and_evaluate(config, workdir, experiment=gpt_exp_fresh)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  resumed, meta = ckpt.restore(20, like)
  ckpt.close()
  assert meta["step"] == 20
  assert_trees_equal(done20, resumed)
  assert again["eval/loss"] == final["eval/loss"]
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  # The records after the checkpoint (15, 20) were redone, not duplicated.
  assert [r["step"] for r in records] == [0, 5, 10, 15, 20]
  # Training time continues from the checkpoint instead of restarting.
  assert records[3]["train_time_s"] >= records[2]["train_time_s"] > 0
  assert records[4]["eval/loss"] == final["eval/loss"]


@pytest.mark.integration
def test_non_finite_loss_stops_and_keeps_last_checkpoint(gpt_exp, tmp_path,
                                                         monkeypatch):
  bad_worker, bad_index = 3, 12  # the 13th update (step 13) on worker 3
  clean = gpt_exp.get_batch

  def poisoned(step):
    batch = clean(step)
    if step != bad_index:
      return batch
    inputs = np.array(batch[0])
    inputs[bad_worker, 0, 0] = 10**6  # out-of-range token: NaN embedding
    return (jax.device_put(inputs, batch[0].sharding),) + tuple(batch[1:])

  monkeypatch.setattr(gpt_exp, "get_batch", poisoned)
  workdir = str(tmp_path / "nan")
  with pytest.raises(FloatingPointError) as info:
    train.train_and_evaluate(gpt_exp.config, workdir, experiment=gpt_exp)
  message = str(info.value)
  assert "step 13 " in message and "worker(s) [3]" in message
  assert "last good checkpoint (step 10)" in message

  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.all_steps() == [10]
  state, meta = ckpt.restore(10, gpt_exp.init_state())
  ckpt.close()
  assert meta["data_position"] == 10
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(host(state)))


def test_interrupted_save_never_replaces_last_good(tmp_path, monkeypatch):
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=import-outside-toplevel

  state = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
  directory = str(tmp_path / "ckpt")
  ckpt = checkpoint.Checkpointer(directory)
  ckpt.save(1, state, {"step": 1})
  ckpt.wait()

  async def crash(self, *args, **kwargs):
    raise OSError("simulated crash before the commit rename")

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", crash)
  with pytest.raises(Exception, match="simulated crash"):
    ckpt.save(2, {"w": state["w"] * 0 - 1}, {"step": 2})
    ckpt.wait()
  monkeypatch.undo()
  leftovers = [d for d in os.listdir(directory) if d.startswith("2")]
  assert leftovers and all("tmp" in d for d in leftovers)  # partial write

  ckpt = checkpoint.Checkpointer(directory)
  assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
  restored, meta = ckpt.restore(1, state)
  ckpt.close()
  assert meta == {"step": 1}
  np.testing.assert_array_equal(np.asarray(restored["w"]),
                                np.arange(6.0).reshape(2, 3))


@pytest.mark.slow  # waits out the late-writes window (1 s) and more
def test_failed_save_is_removed_after_its_other_writes_end(tmp_path,
                                                          monkeypatch):
  """Orbax reports the save's first failed item (here the JSON document)
  while another item (the arrays) is still being written, and TensorStore
  recreates the directories it writes into. The arrays are written only
  once the temporary directory has been removed, or after 3 s: close()
  must wait for them before removing it, or they leave it behind."""
  import errno  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint._src.handlers import json_checkpoint_handler  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint._src.serialization import jax_array_handlers  # pylint: disable=import-outside-toplevel

  removed, written = threading.Event(), threading.Event()
  plain_rmtree = shutil.rmtree
  write_arrays = jax_array_handlers._async_serialize_replica_slices  # pylint: disable=protected-access

  def rmtree(path, *args, **kwargs):
    plain_rmtree(path, *args, **kwargs)
    removed.set()
    written.wait(10)  # the late write lands now, if it is still to come

  async def late(*args, **kwargs):
    removed.wait(3)
    try:
      return await write_arrays(*args, **kwargs)
    finally:
      written.set()

  async def full(*args, **kwargs):
    raise OSError(errno.EFBIG, "File too large")

  monkeypatch.setattr(shutil, "rmtree", rmtree)
  monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices",
                      late)
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler,
                      "_save_fn", full)
  directory = str(tmp_path / "ckpt")
  ckpt = checkpoint.Checkpointer(directory)
  with pytest.raises(checkpoint.CheckpointWriteError,
                     match=r"checkpoint 5 could not be saved in .*: File too "
                     r"large \(EFBIG\)"):
    try:
      ckpt.save(5, {"w": jax.numpy.arange(6.0)}, {"step": 5})
      ckpt.wait()
    finally:
      ckpt.close()
  assert written.is_set() and removed.is_set()
  assert os.listdir(directory) == []


def test_checkpointer_filters_orbax_echoes_only_while_open(tmp_path,
                                                          monkeypatch):
  import logging  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  for logger in loggers:  # whatever other tests left installed, put aside
    monkeypatch.setattr(logger, "filters", [])
  filters = [[] for _ in loggers]

  def unchanged():
    return (sys.unraisablehook == seen.append and
            [list(logger.filters) for logger in loggers] == filters)

  class OrbaxThing:
    def __repr__(self):
      return "<orbax.checkpoint future>"

  echo = types.SimpleNamespace(exc_type=RuntimeError,
                               exc_value=RuntimeError("boom"),
                               exc_traceback=None, err_msg=None,
                               object=OrbaxThing())
  other = types.SimpleNamespace(exc_type=RuntimeError,
                                exc_value=RuntimeError("boom"),
                                exc_traceback=None, err_msg=None,
                                object="a user's generator")
  record = logging.LogRecord("absl", logging.ERROR, "orbax/manager.py", 1,
                             "save failed", None,
                             (OSError, OSError("disk"), None))
  with checkpoint.Checkpointer(str(tmp_path / "a")) as ckpt:
    assert not unchanged()
    sys.unraisablehook(echo)
    sys.unraisablehook(other)
    assert seen == [other]  # the Orbax echo is dropped, the rest passes
    assert not loggers[0].filter(record)
    state = {"w": jax.numpy.arange(4.0)}
    ckpt.save(1, state, {"step": 1})
  assert unchanged()
  sys.unraisablehook(echo)
  assert seen == [other, echo]  # after closing, nothing is filtered
  assert loggers[0].filter(record)
  # Two open at once, closed in the order they were opened.
  first = checkpoint.Checkpointer(str(tmp_path / "a"))
  second = checkpoint.Checkpointer(str(tmp_path / "b"))
  first.close()
  assert not unchanged()
  second.close()
  assert unchanged()
  # A directory that cannot be created: nothing is left installed.
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="checkpoint directory"):
    checkpoint.Checkpointer(str(tmp_path / "file" / "ckpt"))
  assert unchanged()


@pytest.mark.slow  # a full training run: the slow tier
def test_all_reduce_matches_single_model_adamw():
  """All-Reduce on 8 workers == one AdamW model on the global batch."""
  require_devices(N)
  exp = experiment_lib.Experiment(gpt_config(
      "--config.model.dropout=0.0",
      "--config.algorithm=all_reduce", "--config.optimizer.name=adamw",
      "--config.optimizer.accum_steps=1", "--config.grad_clip=0.5"))
  c = exp.config
  state = exp.init_state()
  p = jax.tree.map(lambda x: x[0], host(state.params))
  model = models.GPT(models.GPTConfig(
      vocab_size=c.model.vocab_size, block_size=c.model.block_size,
      n_layer=c.model.n_layer, n_head=c.model.n_head, n_embd=c.model.n_embd,
      bias=c.model.bias))
  ref_tx = optax.chain(
      optax.clip_by_global_norm(0.5),
      optax.adamw(exp.schedule, b1=c.optimizer.b1, b2=c.optimizer.b2,
                  eps=c.optimizer.eps, weight_decay=c.optimizer.weight_decay,
                  mask=optim.default_weight_decay_mask))
  ref_state = ref_tx.init(p)

  @jax.jit
  def ref_step(p, s, x, y):
    g = jax.grad(lambda q: models.lm_loss(model.apply({"params": q}, x), y))(p)
    u, s = ref_tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for step in range(3):
    inputs, targets = (np.asarray(a) for a in exp.get_batch(step))
    state, _ = exp.train_step(state, exp.get_batch(step))
    jax.block_until_ready(state)
    p, ref_state = ref_step(p, ref_state, inputs.reshape(-1, inputs.shape[-1]),
                            targets.reshape(-1, targets.shape[-1]))
  got = host(state.params)
  for leaf in jax.tree.leaves(got):  # identical replicas on every worker
    assert all(np.array_equal(leaf[0], leaf[w]) for w in range(N))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(host(p))):
    np.testing.assert_allclose(a[0], b, rtol=1e-4, atol=2e-6)


@pytest.mark.integration  # a subprocess; refused before JAX starts
def test_cli_names_the_override_that_asks_for_too_many_devices(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")
         and not k.startswith("SLURM_")}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'gpt_tiny.py')}",
       f"--workdir={tmp_path / 'run'}", "--config.n_workers=2048",
       "--config.global_batch=2048"],
      env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=240, check=False)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith(
      "error: --config.n_workers=2048 asks for 2048 simulated CPU devices"), \
      proc.stderr[-3000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_cnn_fashion_mnist_end_to_end(tmp_path):
  """Learns on real images: the committed subset in tests/fixtures."""
  require_devices(N)
  fixture = os.path.join(ROOT, "tests", "fixtures", "fashion_mnist")
  config = load_config(
      "cnn_fashion_mnist.py", f"--config.data.path={fixture}",
      "--config.model.features=(8, 16)",
      "--config.model.dense=32", "--config.global_batch=64",
      "--config.steps=20", "--config.eval_batches=2",
      "--config.eval_interval=10", "--config.log_interval=5",
      "--config.schedule.warmup_steps=2", "--config.schedule.peak_lr=1e-2",
      "--config.schedule.final_lr=1e-3")
  final = train.train_and_evaluate(config, str(tmp_path / "cnn"))
  records = metrics.read_jsonl(str(tmp_path / "cnn" / "metrics.jsonl"))
  records = [r for r in records if "train/loss" in r]
  assert records[-1]["train/loss"] < records[0]["train/loss"] - 0.3
  assert final["eval/loss"] < np.log(10) - 0.5
  assert final["eval/accuracy"] > 0.4 and "samples_per_sec" in final


@pytest.mark.integration
def test_gpt2_small_owt_end_to_end_on_token_bins(tmp_path):
  """The paper config (AER, 2-D mesh, AccumAdamW T=8, global averages)."""
  require_devices(N)
  tokens = np.frombuffer(text.pydoc_corpus(), np.uint8).astype(np.uint16)
  data = tmp_path / "owt"
  data.mkdir()
  tokens[:-20_000].tofile(data / "train.bin")
  tokens[-20_000:].tofile(data / "val.bin")
  config = load_config(
      "gpt2_small_owt.py", *TINY_GPT, f"--config.data.path={data}",
      "--config.n_workers=8", "--config.workers_per_node=2",
      # One compile for the 4 AER rounds keeps the test fast; the static
      # per-round dispatch is covered by test_static_gossip_rounds_match_switch.
      "--config.gossip_rounds=switch",
      "--config.steps=20", "--config.global_avg_interval=10",
      "--config.eval_interval=10", "--config.log_interval=5",
      "--config.schedule.warmup_steps=2", "--config.schedule.peak_lr=3e-3")
  exp = experiment_lib.Experiment(config)
  assert dict(exp.mesh.shape) == {"nodes": 4, "local": 2}
  assert exp.topology.name == "alternating_exp_ring"
  final = train.train_and_evaluate(config, str(tmp_path / "run"),
                                   experiment=exp)
  records = metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
  by_step = {r["step"]: r for r in records}
  assert records[-1]["train/loss"] < by_step[5]["train/loss"] - 0.5
  assert final["eval/loss"] < by_step[10]["eval/loss"]
  # Exact global averages at steps 10 and 20: replicas agree to rounding.
  assert by_step[15]["consensus_distance"] > 1e-6
  assert by_step[20]["consensus_distance"] < 1e-9
  with open(tmp_path / "run" / "config.json", encoding="utf-8") as f:
    assert json.load(f)["optimizer"]["accum_steps"] == 8


@pytest.mark.slow
def test_static_gossip_rounds_match_switch(tmp_path):
  """config.gossip_rounds=static: per-round compiles, same trajectory."""
  del tmp_path
  require_devices(N)
  base = ("--config.model.n_layer=1", "--config.model.n_embd=32",
          "--config.model.n_head=2", "--config.model.block_size=16",
          "--config.global_batch=16", "--config.steps=5",
          "--config.topology=ring", "--config.optimizer.accum_steps=2")
  runs = {}
  for mode in ("switch", "static"):
    exp = experiment_lib.Experiment(load_config(
        "gpt_tiny.py", *base, f"--config.gossip_rounds={mode}"))
    state = exp.init_state()
    for s in range(5):
      # Without the host step for the last one: read from the device.
      state, _ = exp.train_step(state, exp.get_batch(s), s if s < 4 else None)
    runs[mode] = (exp, jax.device_get(state.params))
  assert runs["static"][0].programs.traces == 2  # one per distinct round
  assert runs["switch"][0].programs.traces == 1
  for a, b in zip(jax.tree.leaves(runs["switch"][1]),
                  jax.tree.leaves(runs["static"][1])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a full training run: the slow tier
def test_gpu_dispatch_on_cpu_gives_the_same_run(tmp_path):
  """The accelerator defaults (static rounds, consensus in the next step).

  Forced on CPU, they log the same records and end in the same state as the
  CPU defaults (one program, consensus in a conditional of the log step):
  log step 5 is recorded from step 6's measurement, 10 and 20 from the
  evaluation, 15 (a checkpoint, no evaluation) from a separate program.
  """
  require_devices(N)
  runs = {}
  for extra in (("--config.gossip_rounds=auto", "--config.consensus_at=auto"),
                ("--config.gossip_rounds=static",
                 "--config.consensus_at=next_step")):
    config = gpt_config("--config.checkpoint_interval=15", *extra)
    exp = experiment_lib.Experiment(config)
    workdir = str(tmp_path / extra[0][-6:])
    final = train.train_and_evaluate(config, workdir, experiment=exp)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    state, _ = ckpt.restore(20, exp.init_state())
    ckpt.close()
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    key = (exp.programs.gossip_rounds, exp.programs.consensus_at)
    runs[key] = (exp, final, records, host(state))
  cpu, gpu = runs
  assert cpu == ("switch", "log_step") and gpu == ("static", "next_step")
  assert runs[cpu][0].programs.traces == 1
  # 3 distinct rounds x (with, without the measurement).
  assert runs[gpu][0].programs.traces == 6
  assert_trees_equal(runs[cpu][3], runs[gpu][3])
  timing = ("step_time_ms", "tokens_per_sec", "train_time_s")
  for a, b in zip(runs[cpu][2], runs[gpu][2], strict=True):
    assert {k: v for k, v in a.items() if k not in timing} == {
        k: v for k, v in b.items() if k not in timing}
  assert [r["step"] for r in runs[gpu][2]] == [0, 5, 10, 15, 20]
  assert all(r["consensus_distance"] > 0 for r in runs[gpu][2][1:])


def test_resume_rejects_changed_seed_or_batch_and_truncates_metrics(tmp_path):
  require_devices(N)
  exp = experiment_lib.Experiment(load_config("gpt_tiny.py", *TINY_GPT))
  meta = run_meta.checkpoint_meta(exp, 5)
  run_meta.check_resumable(exp, dict(meta), "ckpt")  # same config: accepted
  assert meta["beta_convention"] == "per_step"  # gpt_tiny's AccumAdamW
  for key, value, field in (("seed", meta["seed"] + 1, "config.seed"),
                            ("global_batch", meta["global_batch"] * 2,
                             "config.global_batch"),
                            ("beta_convention", "per_window",
                             "config.optimizer.beta_convention")):
    with pytest.raises(ValueError, match=field):
      run_meta.check_resumable(exp, dict(meta, **{key: value}), "ckpt")
  # A compressed run's state (CHOCO's public copies, error-feedback
  # residuals) is not resumed uncompressed, nor in another format.
  int8 = dict(meta["compression"], format="int8")
  # Named by the member of the group that differs.
  with pytest.raises(ValueError, match="written with config.compression."
                     "format='int8' but this run has 'none'"):
    run_meta.check_resumable(exp, dict(meta, compression=int8), "ckpt")
  # Written before the compression group existed: uncompressed, accepted.
  run_meta.check_resumable(
      exp, {k: v for k, v in meta.items() if k != "compression"}, "ckpt")
  # A checkpoint written before the field existed used the paper's betas.
  old = {k: v for k, v in meta.items() if k != "beta_convention"}
  with pytest.raises(ValueError, match="'per_window' but this run has "
                     "'per_step'"):
    run_meta.check_resumable(exp, old, "ckpt")
  path = tmp_path / metrics.METRICS_FILE
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 5, 10, 15)))
  assert metrics.truncate_after(str(tmp_path), 10) == 1
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [0, 5, 10]
  assert metrics.truncate_after(str(tmp_path), 0) == 3


def test_resume_refuses_every_changed_field_but_the_free_ones():
  """A field outside ``RESUME_FIELDS`` that changes the trajectory (the
  optimizer's betas and decay, the clip, the train split) is refused by
  name; the run's length, intervals, tracker, evaluation batches and the
  data file's place may change."""
  require_devices(N)
  exp = experiment_lib.Experiment(load_config("gpt_tiny.py", *TINY_GPT))
  meta = run_meta.checkpoint_meta(exp, 5)

  def written_with(field, value):  # the checkpoint of a run with field=value
    config = json.loads(json.dumps(meta["config"]))
    *groups, leaf = field.split(".")
    group = config
    for g in groups:
      group = group[g]
    assert leaf in group and group[leaf] != value, field
    group[leaf] = value
    return dict(meta, config=config)

  for field, value in (("optimizer.b1", 0.8), ("optimizer.weight_decay", 0.5),
                       ("grad_clip", 0.01), ("data.val_fraction", 0.3)):
    with pytest.raises(ValueError, match=f"written with config.{field}="
                       f"{value!r} but this run has"):
      run_meta.check_resumable(exp, written_with(field, value), "ckpt")
  for field, value in (("steps", 3), ("eval_interval", 7), ("tracker", "wandb"),
                       ("checkpoint_interval", 1), ("log_interval", 2),
                       ("eval_batches", 9), ("data.path", "moved/data.bin")):
    run_meta.check_resumable(exp, written_with(field, value), "ckpt")
  # Written before the whole config was stored: the named fields only.
  run_meta.check_resumable(
      exp, {k: v for k, v in meta.items() if k != "config"}, "ckpt")


@pytest.mark.slow  # trains two short runs
def test_a_log_of_another_run_is_not_spliced_into_a_resumed_run(
    tmp_path, caplog):
  """Run A (warmup 2) stopped after its step-8 checkpoint; run B's log
  (warmup 30: another lr at step 8, other timings) put in A's directory.
  Resuming A moves that log aside with one warning and writes a fresh one
  from step 9 on; A's own log resumes without a word."""
  require_devices(N)
  common = (*TINY_GPT, "--config.n_workers=4", "--config.steps=12",
            "--config.log_interval=2", "--config.eval_interval=4",
            "--config.checkpoint_interval=4")
  for name, warmup in (("A", 2), ("B", 30)):
    train.train_and_evaluate(load_config(
        "gpt_tiny.py", *common, f"--config.schedule.warmup_steps={warmup}"),
        str(tmp_path / name))
  a = tmp_path / "A"
  own = (a / metrics.METRICS_FILE).read_text()
  shutil.copytree(a, tmp_path / "A2")
  config_a = load_config("gpt_tiny.py", *common,
                         "--config.schedule.warmup_steps=2")
  for run in (a, tmp_path / "A2"):
    shutil.rmtree(run / "checkpoints" / "12")
  shutil.copy(tmp_path / "B" / metrics.METRICS_FILE, a / metrics.METRICS_FILE)
  caplog.set_level("WARNING")
  train.train_and_evaluate(config_a, str(a))
  warned = [r.getMessage() for r in caplog.records
            if "metrics.jsonl" in r.getMessage()]
  assert len(warned) == 1 and "a log of another run?" in warned[0], warned
  assert (a / metrics.CORRUPT_FILE).read_text() == (
      tmp_path / "B" / metrics.METRICS_FILE).read_text()
  assert [r["step"] for r in metrics.read_jsonl(
      str(a / metrics.METRICS_FILE))] == [10, 12]
  caplog.clear()  # A's own log: kept up to step 8, no warning
  train.train_and_evaluate(config_a, str(tmp_path / "A2"))
  assert not [r for r in caplog.records if "metrics" in r.getMessage()]
  got = metrics.read_jsonl(str(tmp_path / "A2" / metrics.METRICS_FILE))
  assert [r["step"] for r in got] == [0, 2, 4, 6, 8, 10, 12]
  assert own.splitlines()[:5] == (
      tmp_path / "A2" / metrics.METRICS_FILE).read_text().splitlines()[:5]
