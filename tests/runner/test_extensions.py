"""Your own model, data and inner optimizer in the runner (runner.extensions).

A linear least-squares model and a list of examples, registered from this
file (and named as ``module:attribute``), train under All-Reduce with a
registered SGD; the trajectory is checked against a NumPy re-implementation
(the documented per-epoch sharding rule and the gradient by hand), and a
resumed run against the straight one, bit for bit. Bad input is refused
before any compile with one line naming the model or the source.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax.runner import checkpoint as checkpoint_lib
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import custom_task
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import extensions
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import recorder as recorder_lib
from decentral_jax.runner import metrics_rules
from decentral_jax.runner import train
from decentral_jax.runner import validation

N, B, D, SIZE, LR = 4, 2, 3, 40, 0.05
_X = np.random.default_rng(7).normal(size=(SIZE, D)).astype(np.float32)
_Y = (_X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
EXAMPLES = [(_X[i], _Y[i]) for i in range(SIZE)]


def make_linear(scale=0.0, extra=""):
  """A linear model w [D] with the mean squared error (``extra``: one more
  parameter leaf, an int32 ``"int"`` or a zero-size ``"empty"`` one)."""
  def init(key, batch):
    x, _ = batch
    params = {"w": scale * jax.random.normal(key, (x.shape[-1],))}
    if extra == "int":
      params["layer"] = {"count": jax.numpy.zeros((2,), jax.numpy.int32)}
    if extra == "empty":
      params["e"] = jax.numpy.zeros((3, 0))
    if extra == "float8":
      params["f8"] = jax.numpy.zeros((2,), jax.numpy.float8_e4m3fn)
    if extra == "str":
      params["s"] = "abc"
    if extra == "raises":
      raise RuntimeError("boom in init")
    if extra == "key":  # init returning (params, key), a common slip
      return params, key
    if extra == "int_key":
      params[0] = jax.numpy.zeros((2,))
    if extra == "nan":  # a leaf the loss never reads: losses stay finite
      params["layer"] = {"b": jax.numpy.array([0.0, jnp.nan, jnp.inf])}
    return params

  def loss(params, batch, key):
    del key
    x, y = batch
    return ((x @ params["w"] - y) ** 2).mean()

  return extensions.Model(5 if extra == "not_callable" else init, loss)


def make_data(bad=""):
  """The examples, or a broken variant named by ``bad``."""
  train_set = EXAMPLES
  if bad == "short":
    train_set = EXAMPLES[:N * B - 1]
  elif bad == "dtype":
    train_set = [(x.astype(np.float64), y) for x, y in EXAMPLES]
  elif bad == "empty":
    train_set = [() for _ in EXAMPLES]
  elif bad in ("int64", "uint64", "int64_fits", "float64"):
    label = {"int64": np.int64(2**32 + 5), "uint64": np.uint64(2**63),
             "int64_fits": np.int64(-2**31), "float64": np.float64(-1e39)}[bad]
    train_set = [(x, label) for x, _ in EXAMPLES]
  elif bad in ("float128", "timedelta64", "complex256"):  # JAX holds none
    train_set = [(x, np.array(1, bad)) for x, _ in EXAMPLES]
  elif bad in ("complex128", "complex128_imag"):
    label = 1e300 + 1j if bad == "complex128" else 1 - 1e300j
    train_set = [(x, np.complex128(label)) for x, _ in EXAMPLES]
  elif bad == "float64_fits":  # float32's largest finite value; one that flushes
    train_set = [(x, np.float64(2.0**128 - 2.0**104 if i % 2 else 1e-50))
                 for i, (x, _) in enumerate(EXAMPLES)]
  units = {"units_str": "x", "units_half": 1.5, "units_bool": True}.get(bad, 1)
  return extensions.Data(
      train=train_set, eval=train_set if bad.endswith("_fits") else EXAMPLES,
      units_per_example=units)


extensions.register_model("test_linear", make_linear)
extensions.register_data("test_examples", make_data)
extensions.register_optimizer("test_sgd", lambda learning_rate: optax.sgd(
    learning_rate))


def linear_config(model="test_linear", **fields):
  c = config_lib.base_config(model)
  c.data.source = "test_examples"
  c.algorithm, c.n_workers, c.global_batch = "all_reduce", N, N * B
  c.optimizer.name, c.optimizer.accum_steps = "test_sgd", 1
  c.schedule.name, c.schedule.peak_lr = "constant", LR
  c.grad_clip = 0.0
  c.steps, c.log_interval, c.eval_interval = 6, 1, 3
  c.eval_batches, c.checkpoint_interval = 1, 3
  for name, value in fields.items():
    node = c
    *path, last = name.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return c


def oracle_ids(step, seed=0):
  """The per-epoch sharding rule of decentral_jax.data.sharding, by hand."""
  spe = SIZE // (N * B)
  perm = np.random.default_rng(np.random.SeedSequence(
      [seed, step // spe])).permutation(SIZE)
  return np.stack([perm[w * spe * B + (step % spe) * B:][:B]
                   for w in range(N)])


def test_registered_model_data_and_optimizer_match_numpy_sgd():
  require_devices(N)
  c = linear_config()
  validation.check_config(c)
  exp = experiment_lib.Experiment(c)
  for step in (0, 4, 5):  # 5 steps per epoch: 5 is the next epoch
    x, y = exp.task.host_batch(step)
    np.testing.assert_array_equal(x, _X[oracle_ids(step)])
    np.testing.assert_array_equal(y, _Y[oracle_ids(step)])
  state = exp.init_state()
  w = np.zeros(D, np.float64)
  for step in range(6):
    state, _ = exp.train_step(state, exp.get_batch(step), step)
    ids = oracle_ids(step).reshape(-1)
    x, y = _X[ids].astype(np.float64), _Y[ids].astype(np.float64)
    w -= LR * 2.0 / len(ids) * x.T @ (x @ w - y)
  got = np.asarray(jax.device_get(state.params["w"]))
  assert got.shape == (N, D)
  np.testing.assert_allclose(got, np.broadcast_to(w, (N, D)), rtol=2e-5,
                             atol=2e-6)
  assert np.abs(w).max() > 0.1  # not vacuous: the weights moved


def _final_weights(workdir, c):
  """Every worker's w restored from the run's last checkpoint."""
  exp = experiment_lib.Experiment(c)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(str(workdir),
                                                  "checkpoints"))
  state, _ = ckpt.restore(ckpt.latest_step(), exp.init_state())
  ckpt.close()
  return np.asarray(jax.device_get(state.params["w"]))


@pytest.mark.slow
def test_module_attribute_names_and_resume_is_bit_exact(tmp_path):
  require_devices(N)
  here = os.path.splitext(os.path.basename(__file__))[0]
  c = linear_config(f"{here}:make_linear", **{
      "data.source": f"{here}:make_data", "model.options.scale": 0.1,
      "algorithm": "decentralized", "topology": "ring"})
  validation.check_config(c)
  straight = train.train_and_evaluate(c, str(tmp_path / "a"))
  half = linear_config(f"{here}:make_linear", **{
      "data.source": f"{here}:make_data", "model.options.scale": 0.1,
      "algorithm": "decentralized", "topology": "ring", "steps": 3})
  train.train_and_evaluate(half, str(tmp_path / "b"))
  resumed = train.train_and_evaluate(c, str(tmp_path / "b"))
  for key in ("step", "train/loss", "eval/loss", "consensus_distance"):
    assert straight[key] == resumed[key], key
  assert "eval/accuracy" not in straight  # the loss reports none
  np.testing.assert_array_equal(_final_weights(tmp_path / "a", c),
                                _final_weights(tmp_path / "b", c))


def make_vector_loss():
  model = make_linear()
  return extensions.Model(model.init, lambda p, b, k: (b[0] @ p["w"]) ** 2)


def make_stream(change_at=-1, stop_at=99, raise_at=-1, big_at=-1,
                empty=False):
  """Whole steps from an iterator; the shape changes at ``change_at``, the
  read of ``raise_at`` raises, the labels of ``big_at`` hold an int64
  beyond int32 (every label int64), ``empty``: steps of no arrays."""
  def batches(start):
    for step in range(start, stop_at):
      if step == raise_at:
        raise OSError("stream read failed")
      if empty:
        yield ()
        continue
      if big_at >= 0:
        labels = np.zeros((N, B), np.int64)
        labels[1, 0] = -(2**31) - 1 if step == big_at else 0
        yield np.ones((N, B, D), np.float32), labels
        continue
      width = D + 1 if step == change_at else D
      yield (np.ones((N, B, width), np.float32),
             np.zeros((N, B), np.float32))
  evaluation = EXAMPLES if big_at < 0 else [(x, np.int64(0))
                                            for x, _ in EXAMPLES]
  return extensions.Data(train=batches, eval=evaluation)


class _Unreadable:
  """EXAMPLES whose reads of ``bad`` ids raise ``error``."""

  def __init__(self, bad, error):
    self.bad, self.error = set(bad), error

  def __len__(self):
    return SIZE

  def __getitem__(self, i):
    if i in self.bad:
      raise self.error
    return EXAMPLES[i]


def make_bad_reads(train_from=SIZE, train_ids=(), eval_id=-1):
  """Training reads of ids >= ``train_from`` or in ``train_ids`` raise
  (IndexError, OSError), the evaluation read of ``eval_id`` (KeyError)."""
  bad = set(range(train_from, SIZE)) | set(train_ids)
  error = IndexError("index out of range") if train_from < SIZE else \
      OSError("disk read failed")
  return extensions.Data(train=_Unreadable(bad, error),
                         eval=_Unreadable({eval_id}, KeyError("gone")))


extensions.register_model("test_vector_loss", make_vector_loss)
extensions.register_data("test_stream", make_stream)
extensions.register_data("test_bad_reads", make_bad_reads)


@pytest.mark.parametrize("fields, message", [
    ({"model.name": "no_such_package_xyz.models:make"},
     "config.model.name='no_such_package_xyz.models:make': module "
     "'no_such_package_xyz.models' does not import (ModuleNotFoundError"),
    ({"model.name": "optax:no_such_builder"},
     "module 'optax' has no attribute 'no_such_builder'"),
    ({"model.name": "not_registered"},
     "unknown config.model.name='not_registered'; use a name given to "
     "register_model (registered: ['test_linear', 'test_vector_loss'])"),
    ({"data.source": "numpy:no_such_source"},
     "config.data.source='numpy:no_such_source': module 'numpy' has no "
     "attribute"),
    ({"optimizer.name": "no_such_optax"},
     "unknown config.optimizer.name='no_such_optax'; use adamw, "
     "accum_adamw, a name given to register_optimizer"),
    ({"optimizer.b1": 0.8},
     "config.optimizer.b1=0.8 has no effect with config.optimizer.name="
     "'test_sgd' (your own inner optimizer reads none of the AdamW fields)"),
])
def test_names_that_do_not_resolve_are_refused_by_the_config_check(
    fields, message):
  c = linear_config(**fields)
  with pytest.raises(ValueError) as e:
    validation.check_config(c)
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"model.name": "test_vector_loss"},
     "model 'test_vector_loss': the loss returned float32[2], expected a "
     "float scalar"),
    ({"model.options.extra": "int"},
     "model 'test_linear': init's parameter leaf ['layer']['count'] is "
     "int32[2]; every leaf must be a float array"),
    ({"model.options.extra": "empty"},
     "model 'test_linear': init's parameter leaf ['e'] has shape [3, 0] (no "
     "elements)"),
    # float8 passed as "floating" and failed in the optimizer's update
    # with JAX's promotion message.
    ({"model.options.extra": "float8"},
     "model 'test_linear': init's parameter leaf ['f8'] is "
     "float8_e4m3fn[2]; parameters must be float16, bfloat16, float32, "
     "float64"),
    # init's own failures were tracebacks (the loss's were one line).
    ({"model.options.extra": "raises"},
     "model 'test_linear': init fails on one worker's example float32[2, "
     "3], float32[2]: RuntimeError: boom in init"),
    ({"model.options.extra": "str"},
     "model 'test_linear': init fails on one worker's example float32[2, "
     "3], float32[2]: TypeError: "),
    ({"model.options.extra": "not_callable"},
     "model 'test_linear': Model.init is a int, not a callable init(key, "
     "example) -> parameters."),
    # A PRNG key leaf crashed the check itself (np.dtype('key<fry>')); an
    # int dict key gave JAX's "Comparator raised exception" naming no key.
    ({"model.options.extra": "key"},
     "model 'test_linear': init's parameter leaf [1] is key<fry>[]; every "
     "leaf must be a float array"),
    ({"model.options.extra": "int_key"},
     "model 'test_linear': init's parameters have the key 0 (int) at the "
     "top; parameter dict keys must be strings: use str(key)."),
    # "x" failed in int(); 1.5 was truncated to 1 unit per example.
    ({"data.options.bad": "units_str"},
     "config.data.source='test_examples': Data.units_per_example='x' must "
     "be a whole number >= 1"),
    ({"data.options.bad": "units_half"},
     "config.data.source='test_examples': Data.units_per_example=1.5 must "
     "be a whole number >= 1"),
    ({"data.options.bad": "units_bool"},
     "config.data.source='test_examples': Data.units_per_example=True must "
     "be a whole number >= 1"),
    ({"data.options.bad": "short"},
     "data source 'test_examples' has 7 training examples, fewer than one "
     "step needs (4 workers x 2 = 8)"),
    ({"data.options.bad": "dtype"},
     "data source 'test_examples': evaluation examples are float32[3], "
     "float32[], expected float64[3], float32[]"),
    # An empty example passed the data checks and failed in init, blamed
    # on the model; int64/uint64 values beyond 32 bits trained wrapped.
    ({"data.options.bad": "empty"},
     f"data source 'test_examples': example {oracle_ids(0)[0, 0]} holds no "
     "arrays (an empty tuple); return a tuple of arrays."),
    ({"data.options.bad": "int64"},
     f"data source 'test_examples': array 1 of example {oracle_ids(0)[0, 0]}"
     " (step 0) holds the int64 value 4294967301, outside [-2147483648, "
     "2147483647] (the device narrows it to 32 bits by wrapping)"),
    ({"data.options.bad": "uint64"},
     f"data source 'test_examples': array 1 of example {oracle_ids(0)[0, 0]}"
     " (step 0) holds the uint64 value 9223372036854775808, outside [0, "
     "4294967295]"),
    # A finite float64 beyond float32's range became inf on the device:
    # a generic non-finite loss at step 0.
    ({"data.options.bad": "float64"},
     f"data source 'test_examples': array 1 of example {oracle_ids(0)[0, 0]}"
     " (step 0) holds the float64 value -1e+39, beyond float32's range (the "
     "device narrows float64 to float32, where it becomes inf); give values "
     "of magnitude <= 3.4028234663852886e+38."),
    # float128 / timedelta64 / complex256 passed as numeric and failed in
    # the model's init, blamed on the model.
    *[({"data.options.bad": dtype},
       f"data source 'test_examples' gave arrays float32[4, 2, 3], {dtype}"
       "[4, 2] at step 0, expected numeric arrays [n_workers=4, local_batch="
       "2, ...] (bool, integer, float up to float64 or complex up to "
       "complex128).") for dtype in ("float128", "timedelta64",
                                     "complex256")],
    # complex128 beyond float32's range in either part became inf.
    *[({"data.options.bad": bad},
       f"data source 'test_examples': array 1 of example {oracle_ids(0)[0, 0]}"
       f" (step 0) holds the complex128 value {shown}, beyond float32's range"
       " (the device narrows complex128 to complex64, where it becomes inf);"
       " give values of magnitude <= 3.4028234663852886e+38 in each part.")
      for bad, shown in (("complex128", "(1e+300+1j)"),
                         ("complex128_imag", "(1-1e+300j)"))],
    ({"data.source": "test_stream", "data.options.empty": True},
     "data source 'test_stream' yielded arrays none at step 0, expected "
     "[n_workers=4, local_batch, ...] each."),
    ({"eval_batches": 6},
     "data source 'test_examples' has 40 evaluation examples, fewer than "
     "config.eval_batches * config.global_batch = 48"),
    ({"data.options.typo": 1},
     "config.data.source='test_examples' failed with options {'typo': 1}: "
     "TypeError"),
])
def test_bad_models_and_sources_are_refused_before_training(fields, message):
  require_devices(N)
  c = linear_config(**fields)
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(c)
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_non_finite_initial_parameter_is_named_before_the_first_step(
    tmp_path):
  # It stopped the run at step 1 as a diverged run (FloatingPointError),
  # blaming the learning rate and the clip although the losses were finite.
  require_devices(N)
  c = linear_config(**{"model.options.extra": "nan"})
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, str(tmp_path))
  assert str(e.value) == (
      "model 'test_linear': init's parameter leaf ['layer']['b'] holds 2 "
      "NaN/inf value(s) of 3; the initial parameters must be finite: fix "
      "the model's init (or its options).")
  assert not isinstance(e.value, FloatingPointError)
  assert not os.path.exists(tmp_path / metrics_lib.METRICS_FILE)  # no step


def test_an_iterator_source_is_checked_step_by_step():
  require_devices(N)
  exp = experiment_lib.Experiment(linear_config(**{
      "data.source": "test_stream", "data.options.change_at": 2,
      "data.options.stop_at": 4}))
  for step in (0, 1):
    x, _ = exp.task.host_batch(step)
    assert x.shape == (N, B, D)
  with pytest.raises(ValueError, match=r"data source 'test_stream' gave "
                     r"arrays float32\[2, 4\], float32\[2\] per worker at "
                     r"step 2, expected float32\[2, 3\], float32\[2\] as at "
                     r"step 0"):
    exp.task.host_batch(2)
  x, _ = exp.task.host_batch(3)  # restarted at step 3 (a resume)
  assert x.shape == (N, B, D)
  with pytest.raises(ValueError, match="data source 'test_stream' ran out "
                     "of batches at step 4"):
    exp.task.host_batch(4)


def test_64_bit_integers_are_checked_in_range_at_every_step():
  """int64 values that fit int32 are accepted; one beyond it at step 2 of
  an iterator is named with its worker and row."""
  require_devices(N)
  exp = experiment_lib.Experiment(linear_config(
      **{"data.options.bad": "int64_fits"}))
  assert int(exp.task.host_batch(0)[1].min()) == -2**31
  exp = experiment_lib.Experiment(linear_config(**{
      "data.source": "test_stream", "data.options.big_at": 2}))
  exp.task.host_batch(1)
  with pytest.raises(ValueError, match=r"^data source 'test_stream': array "
                     r"1 of the batch of step 2 \(worker 1, row 0\) holds "
                     r"the int64 value -2147483649, outside \[-2147483648, "):
    exp.task.host_batch(2)


def test_float64_within_float32s_range_is_accepted_and_a_flush_warned(
    caplog):
  require_devices(N)
  with caplog.at_level(logging.WARNING):
    exp = experiment_lib.Experiment(linear_config(
        **{"data.options.bad": "float64_fits"}))
    y = exp.task.host_batch(0)[1]
  assert y.dtype == np.float64 and set(np.abs(y).ravel()) <= {
      1e-50, 2.0**128 - 2.0**104}
  warned = [r.getMessage() for r in caplog.records
            if "smallest subnormal" in r.getMessage()]
  assert warned == [
      f"data source 'test_examples'{what}: array 1 holds non-zero float64 "
      "values below float32's smallest subnormal (1.4e-45), which become 0 "
      "on the device." for what in ("", " (evaluation)")]


def _numpy_mse(kernel, bias, batch):
  x, y = (np.asarray(a, np.float64) for a in batch)
  out = x @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
  return float(((out[:, 0] - y) ** 2).mean())


@pytest.mark.slow
def test_linen_and_nnx_adapters_init_and_loss():
  from flax import linen as nn
  from flax import nnx
  batch = EXAMPLES[0][0][None].repeat(4, 0), _Y[:4]

  def mse(out, b):
    return ((out[:, 0] - b[1]) ** 2).mean()

  linen = extensions.linen_model(nn.Dense(1), mse)
  params = linen.init(jax.random.key(0), batch)
  assert params["kernel"].shape == (D, 1)
  np.testing.assert_allclose(
      float(linen.loss(params, batch, None)),
      _numpy_mse(params["kernel"], params["bias"], batch), rtol=1e-5)
  model = extensions.nnx_model(lambda rngs: nnx.Linear(D, 1, rngs=rngs), mse)
  params = model.init(jax.random.key(0), batch)
  assert params["kernel"].shape == (D, 1)
  moved = jax.tree.map(lambda p: p + 0.5, params)  # the loss reads params
  np.testing.assert_allclose(
      float(jax.jit(lambda p: model.loss(p, batch, None))(moved)),
      _numpy_mse(moved["kernel"], moved["bias"], batch), rtol=1e-5)


@pytest.mark.slow
def test_an_optax_contrib_optimizer_by_module_attribute():
  require_devices(N)
  c = linear_config(**{"optimizer.name": "optax.contrib:muon"})
  validation.check_config(c)
  exp = experiment_lib.Experiment(c)
  state = exp.init_state()
  reference = optax.contrib.muon(learning_rate=LR)
  w = {"w": np.zeros(D, np.float32)}
  ref_state = reference.init(w)
  for step in range(3):
    state, _ = exp.train_step(state, exp.get_batch(step), step)
    ids = oracle_ids(step).reshape(-1)
    x, y = _X[ids].astype(np.float64), _Y[ids].astype(np.float64)
    grad = 2.0 / len(ids) * x.T @ (x @ np.asarray(w["w"], np.float64) - y)
    update, ref_state = reference.update(
        {"w": grad.astype(np.float32)}, ref_state, w)
    w = optax.apply_updates(w, update)
  got = np.asarray(jax.device_get(state.params["w"]))
  np.testing.assert_allclose(got[0], w["w"], rtol=1e-5, atol=1e-6)


def test_registration_refuses_taken_built_in_and_malformed_names():
  extensions.register_model("test_linear", make_linear)  # again: the same
  with pytest.raises(ValueError, match=r"register_model\('test_linear', "
                     r"\.\.\.\): the name is already registered"):
    extensions.register_model("test_linear", make_vector_loss)
  for name in ("gpt", "a:b", ""):
    with pytest.raises(ValueError, match="the name must be a non-empty "
                       "string without ':' and not one of the built-in"):
      extensions.register_model(name, make_linear)
  with pytest.raises(ValueError, match="not one of the built-in "
                     r"\('adamw', 'accum_adamw'\)"):
    extensions.register_optimizer("adamw", optax.sgd)


def test_a_source_that_runs_out_saves_the_steps_trained(tmp_path):
  require_devices(N)
  c = linear_config(**{"data.source": "test_stream",
                       "data.options.stop_at": 4, "checkpoint_interval": 3})
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError, match="data source 'test_stream' ran out "
                     "of batches at step 4"):
    train.train_and_evaluate(c, workdir)
  # Steps 0-3 trained: checkpoint 4 saved beside the scheduled 3.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "3", "4"]
  # Enough batches now: the run resumes from step 4 and finishes.
  c = linear_config(**{"data.source": "test_stream",
                       "data.options.stop_at": 4, "checkpoint_interval": 3})
  c.data.options.stop_at = 6
  assert train.train_and_evaluate(c, workdir)["step"] == 6


def make_aux_model(key="accuracy", value=0.5, dtype="float32", offset=0.0,
                   aux_dtype="float32"):
  """The linear model; its loss (``+ offset``, cast to ``dtype``) returns
  ``{key: value}`` as aux (``value`` of ``aux_dtype``; ``key`` "tuple":
  the key ("a", 1))."""
  model = make_linear()
  key = ("a", 1) if key == "tuple" else key

  def loss(params, batch, rng):
    value_ = model.loss(params, batch, rng) + offset
    return value_.astype(dtype), {key: jnp.asarray(value, aux_dtype)}

  return extensions.Model(model.init, loss)


#: The aux model by module:attribute (registering it would change the list
#: of registered names another test expects).
AUX = f"{os.path.splitext(os.path.basename(__file__))[0]}:make_aux_model"


def _rows(workdir):
  with open(os.path.join(str(workdir), "metrics.jsonl"),
            encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("key", ["loss", "consensus_distance", "finite",
                                 "grad_norm", "faults/useful_steps"])
def test_an_aux_key_of_the_runner_s_own_metrics_is_refused(key):
  """aux {"loss": 1.0} replaced the logged train/loss, {"consensus_distance":
  -5.0} was logged as the run's: the model check names the key."""
  require_devices(N)
  c = linear_config(AUX, **{"model.options.key": key})
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(c)
  assert str(e.value) == (
      f"model {AUX!r}: the loss's aux uses {key!r}, a name of the "
      "runner's own per-step metrics (loss, grad_norm, finite, "
      "consensus_distance, faults/*); rename that aux key.")


@pytest.mark.parametrize("fields, message", [
    # Averaged over micro-batches, then cast back: an int32 accuracy was
    # truncated, a bool one rounded up.
    ({"model.options.aux_dtype": "int32"},
     "the loss's aux 'accuracy' is int32; aux values are averaged over "
     "micro-batches, workers and steps, so they must be float scalars: "
     "return 'accuracy': value.astype(jnp.float32)."),
    ({"model.options.aux_dtype": "bool"},
     "the loss's aux 'accuracy' is bool; aux values are averaged"),
    # Non-string keys failed after step 0's evaluation with JAX's
    # "Comparator raised exception while sorting pytree dictionary keys".
    ({"model.options.key": 1},
     "the loss's aux has the key 1 (int); aux keys are metric names: use "
     "strings, e.g. '1'."),
    ({"model.options.key": "tuple"},
     "the loss's aux has the key ('a', 1) (tuple); aux keys are metric "
     "names"),
])
def test_aux_values_not_float_and_keys_not_strings_are_refused(fields,
                                                                message):
  require_devices(N)
  c = linear_config(AUX, **fields)
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(c)
  assert str(e.value).startswith(f"model {AUX!r}: {message}"), str(e.value)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_float_dtype_of_loss_is_accepted(dtype):
  """A bfloat16 loss was refused as "not a float scalar" (NumPy does not
  count bfloat16 as floating); an integer loss still is."""
  require_devices(N)
  c = linear_config(AUX, **{"model.options.dtype": dtype})
  assert experiment_lib.Experiment(c).task.has_accuracy
  c = linear_config(AUX, **{"model.options.dtype": "int32"})
  with pytest.raises(ValueError, match=r"the loss returned int32\[\], "
                     "expected a float scalar"):
    experiment_lib.Experiment(c)


def test_any_finite_accuracy_of_a_model_of_your_own_is_read_back():
  """The reader's range of an accuracy: [0, 1] for the built-in models,
  any finite number for a model of your own (as its losses)."""
  for key in ("eval/accuracy", "train/accuracy"):
    assert metrics_rules.value_error(key, 2.0, True) is None
    assert metrics_rules.value_error(key, -0.5, True) is None
    assert metrics_rules.value_error(key, 2.0, False) == (
        f"{key} must be in [0, 1], got 2.0")
    assert metrics_rules.value_error(key, "x", True) == (
        f"{key} must be a number, got 'x'")


@pytest.mark.slow
def test_an_accuracy_outside_0_1_is_written_and_resumed(tmp_path):
  """A model of your own reporting "accuracy" 2.0: the resumed run used to
  call its own intact metrics.jsonl damaged and move it aside."""
  require_devices(N)
  workdir = str(tmp_path / "run")
  c = linear_config(AUX, **{"model.options.value": 2.0, "steps": 3})
  train.train_and_evaluate(c, workdir)
  c = linear_config(AUX, **{"model.options.value": 2.0})
  assert train.train_and_evaluate(c, workdir)["step"] == 6
  assert not [f for f in os.listdir(workdir) if "corrupt" in f]
  rows = _rows(workdir)
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3, 6]
  assert all(r["eval/accuracy"] == 2.0 for r in rows if "eval/accuracy" in r)
  assert [r["train/accuracy"] for r in rows if "train/accuracy" in r] == \
      [2.0] * 6


def test_a_mean_of_finite_float32_losses_is_finite():
  """Two workers' losses 3e38: their float32 mean overflowed to inf (null
  in metrics.jsonl); the window averages in float64."""
  window = recorder_lib.Window()
  for loss in ([3e38, 3e38], [3e38, 2e38]):
    window.add({"loss": np.float32(loss), "accuracy": np.float32([1, 0])},
               None)
  got = window.summary(1, "samples")
  want = (2 * float(np.float32(3e38)) + float(np.float32(3e38)) +
          float(np.float32(2e38))) / 4
  assert got["train/loss"] == pytest.approx(want, rel=1e-15)
  assert got["train/accuracy"] == 0.5


@pytest.mark.slow
def test_finite_losses_near_the_float32_limit_are_logged_finite(tmp_path):
  """Loss = mse + 3e38 on 4 workers (finite): train/loss and eval/loss were
  null (their float32 mean overflowed) in a run that finished."""
  require_devices(N)
  workdir = str(tmp_path / "run")
  c = linear_config(AUX, **{"model.options.offset": 3e38, "steps": 3})
  train.train_and_evaluate(c, workdir)
  want = float(np.float32(3e38))  # mse ~ 10 vanishes beside float32's ulp
  for row in _rows(workdir):
    for key in ("train/loss", "eval/loss", "eval/worker_loss_mean"):
      if key in row:
        assert row[key] == pytest.approx(want, rel=1e-7), (key, row)


def make_eval_inf():
  """The linear model; its loss is inf in evaluation (key None) alone."""
  model = make_linear()
  return extensions.Model(model.init, lambda p, b, k: model.loss(p, b, k) + (
      jnp.inf if k is None else 0.0))


def test_a_non_finite_evaluation_loss_stops_the_run(tmp_path):
  """A record whose loss is not finite is never written (it was null, and
  the run finished with rc 0)."""
  require_devices(N)
  here = AUX.split(":")[0]
  c = linear_config(f"{here}:make_eval_inf", **{"model.needs_key": True})
  workdir = str(tmp_path / "run")
  with pytest.raises(FloatingPointError, match=r"^non-finite eval/loss at "
                     r"step 0 \(inf\); stopping, no intact checkpoint had "
                     "been written yet. No parameter update had been "
                     "applied yet"):
    train.train_and_evaluate(c, workdir)
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl")) or \
      not _rows(workdir)


def test_a_source_that_raises_is_one_line_naming_example_and_step():
  require_devices(N)
  # len() says 40, ids >= 20 raise: the first such id of step 0's
  # sharding (oracle_ids, in worker-major order) is named.
  first = next(int(i) for i in oracle_ids(0).reshape(-1) if i >= 20)
  c = linear_config(**{"data.source": "test_bad_reads",
                       "data.options.train_from": 20})
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(c)
  assert str(e.value) == (
      f"data source 'test_bad_reads': reading example {first} (step 0) "
      "failed: IndexError: index out of range")
  c = linear_config(**{"data.source": "test_bad_reads",
                       "data.options.eval_id": 5})
  with pytest.raises(ValueError) as e:
    experiment_lib.Experiment(c)
  assert str(e.value) == (
      "data source 'test_bad_reads' (evaluation): reading example 5 "
      "failed: KeyError: 'gone'")
  exp = experiment_lib.Experiment(linear_config(**{
      "data.source": "test_stream", "data.options.raise_at": 2}))
  with pytest.raises(ValueError) as e:
    exp.task.host_batch(2)
  assert str(e.value) == ("data source 'test_stream': reading the batch of "
                          "step 2 failed: OSError: stream read failed")
  assert exp.task.host_batch(3)[0].shape == (N, B, D)  # restarted


def test_a_read_failing_mid_run_saves_the_steps_trained(tmp_path):
  # One id of step 4 (epoch 0 of 5 steps: read at no earlier step) fails.
  require_devices(N)
  bad = int(oracle_ids(4)[1, 0])
  assert bad not in np.concatenate([oracle_ids(s) for s in range(4)])
  c = linear_config(**{"data.source": "test_bad_reads",
                       "data.options.train_ids": (bad,)})
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, workdir)
  where = os.path.join(workdir, "checkpoints")
  assert str(e.value) == (
      f"data source 'test_bad_reads': reading example {bad} (step 4) "
      f"failed: OSError: disk read failed; checkpoint 4 is saved in {where}"
      ": fix the data source and run the same command again to resume.")
  assert sorted(os.listdir(where)) == ["3", "4"]
  assert [r["step"] for r in _rows(workdir) if "train/loss" in r][-1] == 4
  c.data.options.train_ids = ()  # fixed: resumes from step 4
  assert train.train_and_evaluate(c, workdir)["step"] == 6


def test_device_dtype_accepts_what_jax_holds():
  held = [np.bool_, np.int8, np.uint64, np.float16, np.float32, np.float64,
          np.complex64, np.complex128, jnp.bfloat16]
  refused = [np.dtype("f16"), np.dtype("c32"), "timedelta64[s]",
             "datetime64[s]", "U3", object]
  assert [custom_task.device_dtype(d) for d in held] == [True] * len(held)
  assert [custom_task.device_dtype(d) for d in refused] == [False] * 6
