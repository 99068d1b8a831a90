"""What stops a run, and what refuses one, names the cause in one line.

A gradient norm past float32's range (gradients beyond ~1.8e19: Adam's
second moment and the global norm overflow and every update is 0) stops
the run like a non-finite loss; a training batch holding NaN/inf is named
as the cause instead of the learning rate; micro-batch losses near the
float32 limit do not overflow their sum; a GPT whose sizes are each within
bounds but whose parameter count is not, a data source whose ``len`` is
negative or huge, ``config.tracker='wandb'`` without a key, and more
workers than CPU devices can be simulated are refused with one line each.
Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import models
from decentral_jax import parallel
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import devices
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import extensions
from decentral_jax.runner import field_rules
from decentral_jax.runner import recorder
from decentral_jax.runner import step as step_lib
from decentral_jax.runner import train
from decentral_jax.runner import validation

N, B, D = 4, 2, 3
_X = np.random.default_rng(3).normal(size=(64, D)).astype(np.float32)
EXAMPLES = [(_X[i], _X[i].sum()) for i in range(64)]


class NoCheckpoint:
  directory = "ckpt"

  def last_good_step(self):
    return None, False


def one_step_finite(scale: float) -> np.ndarray:
  """``finite`` of one train step of 2 workers with Adam, loss
  ``scale * sum(w * x)`` at ``w = x = 1`` (gradient ``scale`` per entry)."""
  require_devices(2)
  mesh = parallel.make_mesh(2)
  tx = optax.adam(1e-3)

  def loss(params, batch, key):
    del key
    return scale * jnp.sum(params["w"] * batch[0][0]), {}

  def step(state, batch):
    return step_lib.train_step(
        state, batch, loss_fn=loss, tx=tx, axis_name=parallel.worker_axis(mesh),
        dropout=False, global_avg_interval=0, log_interval=1, total_steps=1,
        consensus="none")

  params = parallel.replicate({"w": jnp.ones(3)}, mesh)
  state = jax.jit(parallel.per_worker(
      lambda p: step_lib.init_state(p, jnp.zeros(2, jnp.uint32), tx=tx),
      mesh))(params)
  batch = parallel.shard((np.ones((2, 1, 3), np.float32),), mesh)
  _, metrics = jax.jit(parallel.per_worker(step, mesh))(state, batch)
  return np.asarray(metrics["finite"])


def test_a_gradient_norm_past_float32_is_not_finite():
  """Gradient 1e20 per entry: the loss 3e20 and the parameters stay finite
  (Adam's update is 1e20 / sqrt(inf) = 0), but |g|^2 = 3e40 > 3.4e38 is
  inf: the step was counted finite and the run never moved. Gradient 1e10:
  |g| = 1.7e10, finite."""
  assert not one_step_finite(1e20).any()
  assert one_step_finite(1e10).all()


def test_a_gradient_overflow_is_named_with_its_fix():
  c = config_lib.base_config("gpt")
  metrics = {"loss": np.array([2.0, 5e29]), "finite": np.array([True, False]),
             "grad_norm": np.array([1.0, np.inf], np.float32)}
  text = str(recorder.non_finite_error(4, metrics, NoCheckpoint(), c))
  assert text.startswith("gradient norm overflow at step 4 on worker(s) [1] "
                         "(losses [5e+29], gradient norms [inf])"), text
  assert text.endswith("Scale the loss down (divide it by a constant) so "
                       "that its gradients stay well below 1e19, or, if the "
                       "loss grew during the run, lower "
                       "config.schedule.peak_lr."), text
  # A non-finite loss keeps naming the learning rate (its norm is NaN too).
  metrics["loss"] = np.array([2.0, np.nan])
  metrics["grad_norm"] = np.array([1.0, np.nan], np.float32)
  text = str(recorder.non_finite_error(4, metrics, NoCheckpoint(), c))
  assert text.startswith("non-finite training loss or parameters at step 4")
  assert "config.schedule.peak_lr" in text


def fake_exp(batches):
  """An experiment whose task reads ``batches[step]`` (arrays [3, ...])."""
  def host_batch(step, workers):
    if step not in batches:
      raise ValueError("out of data")
    return tuple(x[np.asarray(workers)] for x in batches[step])
  return types.SimpleNamespace(local_workers=np.arange(3),
                               task=types.SimpleNamespace(
                                   host_batch=host_batch))


def test_the_workers_whose_batch_holds_nan_or_inf_are_found():
  x = np.ones((3, 2, 4), np.float32)
  bad = x.copy()
  bad[1, 0, 2], bad[2, 1, 0] = np.nan, -np.inf
  ids = np.full((3, 2), 2**40, np.int64)  # integers are never non-finite
  exp = fake_exp({0: (x, ids), 2: (bad, ids)})
  assert recorder.non_finite_rows(exp, 2) == [1, 2]
  assert recorder.non_finite_rows(exp, 0) == []
  assert recorder.non_finite_rows(exp, 5) is None  # cannot be read again


def test_a_batch_holding_nan_is_blamed_not_the_learning_rate():
  """It named config.schedule.peak_lr and config.grad_clip only."""
  c = config_lib.base_config("gpt")
  metrics = {"loss": np.array([2.0, np.nan]), "finite": np.array([True, False]),
             "grad_norm": np.array([1.0, np.nan], np.float32)}
  text = str(recorder.non_finite_error(3, metrics, NoCheckpoint(), c, [1]))
  assert text.startswith("the training batch of step 3 holds NaN/inf on "
                         "worker(s) [1] (losses [nan]); stopping, no intact "
                         "checkpoint had been written yet."), text
  assert text.endswith("fix the data source (config.data.source).")
  assert "peak_lr" not in text
  assert str(recorder.non_finite_error(3, metrics, NoCheckpoint(), c, [])) \
      == str(recorder.non_finite_error(3, metrics, NoCheckpoint(), c))


@pytest.mark.parametrize("k", [2, 4])
def test_micro_batch_losses_near_the_float32_limit_do_not_overflow(k):
  """loss_j = w * mean(x_j) + 3e38 with w = 1, x = 1..8: each loss_j is
  float32(3e38) (mean(x_j) <= 8 is far below its ulp of 2e31); their sum
  over k micro-batches was 6e38 = inf, the mean is float32(3e38). The
  gradient in w is mean(x) = 4.5; both as sum_j (term_j / k), bit for bit
  the float32 sum of the terms divided by k (k a power of two)."""
  x = np.arange(1.0, 9.0, dtype=np.float32)

  def loss(params, batch, key):
    del key
    return params["w"] * jnp.mean(batch[0]) + jnp.float32(3e38), {}

  (value, _), grads = step_lib.loss_and_grad(
      loss, {"w": jnp.float32(1.0)}, (jnp.asarray(x),), None, k)
  assert float(value) == float(np.float32(3e38))
  terms = [np.float32(np.mean(x[j::k])) for j in range(k)]
  total = np.float32(0.0)
  for t in terms:
    total = np.float32(total + t)
  assert float(grads["w"]) == float(total / np.float32(k)) == 4.5


def _gpt_model(**fields):
  c = config_lib.base_config("gpt")
  for name, value in fields.items():
    c.model[name] = value
  return c


@pytest.mark.parametrize("bias", [False, True])
def test_the_gpt_parameter_count_formula_matches_its_init(bias):
  c = _gpt_model(vocab_size=37, block_size=5, n_layer=3, n_embd=12,
                 n_head=3, bias=bias)
  cfg = models.GPTConfig(vocab_size=37, block_size=5, n_layer=3, n_head=3,
                         n_embd=12, bias=bias)
  shapes = jax.eval_shape(lambda k: models.gpt.init_params(cfg, k),
                          jax.random.key(0))
  want = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
  assert validation.gpt_param_count(c.model) == want


def test_a_gpt_too_large_to_hold_is_refused_naming_its_fields():
  """n_embd 131072, one layer: 12 * 131072^2 = 2.06e11 parameters, each
  size field within its bound; it passed and ended in RESOURCE_EXHAUSTED."""
  c = _gpt_model(n_embd=131072, n_head=1, n_layer=1, vocab_size=256,
                 block_size=8)
  with pytest.raises(ValueError) as e:
    validation.check_config(c)
  assert str(e.value) == (
      "config.model.n_embd=131072, n_layer=1, vocab_size=256 and block_size="
      "8 give 2.06e+11 parameters per worker, more than the 6.87e+10 (2**36)"
      " a worker may hold; lower config.model.n_embd or config.model.n_layer"
      ".")
  validation.check_config(_gpt_model(n_embd=65536, n_head=1, n_layer=1))


def make_len_data(length=64, stream_nan_at=-1):
  """EXAMPLES with a ``len`` of ``length``; or, with ``stream_nan_at >= 0``,
  an iterator source whose batch of that step holds a NaN on worker 1."""
  class Sized:
    def __len__(self):
      if length == "raise":
        raise RuntimeError("the index\nis not built")
      return length

    def __getitem__(self, i):
      return EXAMPLES[i % 64]

  def stream(start):
    step = start
    while True:
      x = np.ones((N, B, D), np.float32)
      if step == stream_nan_at:
        x[1, 0, 0] = np.nan
      yield x, x.sum(-1)
      step += 1
  return extensions.Data(stream if stream_nan_at >= 0 else Sized(), EXAMPLES)


def make_linear():
  def init(key, batch):
    del key
    return {"w": jnp.zeros((batch[0].shape[-1],))}

  def loss(params, batch, key):
    del key
    return jnp.mean((batch[0] @ params["w"] - batch[1]) ** 2)
  return extensions.Model(init, loss)


@pytest.fixture(autouse=True)
def guard_names():
  """Registers this file's model and data source for its tests only (other
  files assert the exact list of registered names)."""
  extensions.register_model("guard_linear", make_linear)
  extensions.register_data("guard_len", make_len_data)
  yield
  extensions._REGISTRY["model"].pop("guard_linear")  # pylint: disable=protected-access
  extensions._REGISTRY["data"].pop("guard_len")  # pylint: disable=protected-access


def linear_config(**options):
  c = config_lib.base_config("guard_linear")
  c.data.source = "guard_len"
  for name, value in options.items():
    c.data.options[name] = value
  c.algorithm, c.n_workers, c.global_batch = "all_reduce", N, N * B
  c.optimizer.accum_steps = 1
  c.steps, c.log_interval, c.eval_interval = 3, 1, 3
  c.eval_batches, c.checkpoint_interval = 1, 3
  return c


@pytest.mark.parametrize("length, got", [
    (-1, "fails (ValueError: __len__() should return >= 0)"),
    (0, "is 0"), (2**62, f"is {2**62}"),
    (2.0, "returns a float (2.0), not an int"),
    ("raise", "fails (RuntimeError: the index is not built)")])
def test_a_source_length_out_of_range_is_one_line(length, got):
  """-1 and 2**62 gave Python's and NumPy's messages, naming no source; a
  __len__ that raises gave its traceback, and one returning 2.0 was called
  neither a random-access source nor a callable."""
  require_devices(N)
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(linear_config(length=length))
  assert str(e.value) == (
      f"data source 'guard_len': len(Data.train) {got}, expected a whole "
      "number of examples in [1, 2147483647]; fix the source's __len__.")


@pytest.mark.slow
def test_a_run_whose_data_turns_nan_names_the_data(tmp_path):
  require_devices(N)
  c = linear_config(stream_nan_at=1)
  with pytest.raises(FloatingPointError) as e:
    train.train_and_evaluate(c, str(tmp_path))
  assert str(e.value).startswith("the training batch of step 2 holds NaN/inf "
                                 "on worker(s) [1]"), str(e.value)


def test_an_out_of_memory_init_is_one_line(monkeypatch):
  require_devices(N)
  exp = experiment_lib.Experiment(linear_config())

  def exhausted(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory "
                                     "allocating 206158430208 bytes.")
  monkeypatch.setattr(experiment_lib.multiprocess, "put_global", exhausted)
  with pytest.raises(ValueError) as e:
    exp.init_state()
  assert str(e.value) == (
      "model 'guard_linear' with 3 parameters per worker (4 workers) does "
      "not fit in memory at init (the parameters and optimizer state): lower "
      "the model's size (config.model.n_embd, n_layer) or config.n_workers.")


@pytest.fixture(name="no_wandb_key")
def fixture_no_wandb_key(monkeypatch, tmp_path):
  for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY",
               "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR",
               "NETRC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
  monkeypatch.chdir(tmp_path)
  return tmp_path


@pytest.mark.slow  # needs wandb (requirements-extras.txt, as the slow tier)
def test_wandb_without_a_key_is_refused_before_training(no_wandb_key,
                                                        monkeypatch):
  """It passed the check and ended in wandb's UsageError traceback."""
  with pytest.raises(ValueError) as e:
    field_rules.RULES["tracker"]("tracker", "wandb")
  assert str(e.value) == (
      "config.tracker='wandb' has no W&B API key (no WANDB_API_KEY, no `wandb "
      "login` entry in ~/.netrc): run `wandb login`, or set WANDB_MODE=offline"
      " to log to local files, or set --config.tracker=''.")
  field_rules.RULES["tracker"]("tracker", "")
  monkeypatch.setenv("WANDB_MODE", "offline")
  assert field_rules.wandb_can_log()
  monkeypatch.delenv("WANDB_MODE")
  (no_wandb_key / ".netrc").write_text(
      "machine api.wandb.ai\n  login user\n  password 0123abcd\n")
  assert field_rules.wandb_can_log()
  (no_wandb_key / ".netrc").write_text("machine example.org password x\n")
  assert not field_rules.wandb_can_log()
  monkeypatch.setenv("WANDB_API_KEY", "0123abcd")
  assert field_rules.wandb_can_log()


def test_too_many_simulated_devices_gives_advice_that_can_be_followed():
  """It advised JAX_NUM_CPU_DEVICES=2000, which is refused as well."""
  with pytest.raises(ValueError) as e:
    devices.check_simulated_devices(2000, "config.n_workers=2000")
  text = str(e.value)
  assert "JAX_NUM_CPU_DEVICES yourself" not in text
  assert text.endswith("JAX_NUM_CPU_DEVICES and XLA_FLAGS' device count "
                       "have the same limit); lower it (config."
                       "workers_per_device > 1 puts several workers on one "
                       "device), or run on that many real devices."), text
