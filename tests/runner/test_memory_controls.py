"""The memory controls: micro-batches, activation checkpointing, parameter dtype.

``micro_batches = k`` (gradient accumulation inside a step,
:func:`decentral_jax.runner.step.loss_and_grad`) must give the loss and
gradient of the whole local batch to float32 rounding, against
``jax.value_and_grad`` of the whole batch and a loop over the micro-batches
written here; a run with k = 4 must end where the run with k = 1 ends. With
k = 1 the step is the single-batch path, bit for bit (the trajectories of
``tests/optim/test_diloco_family_identity.py`` guard the runner).
``model.remat`` must leave loss and gradient unchanged and put the blocks
under ``jax.checkpoint``; ``model.param_dtype=bfloat16`` stores bfloat16
parameters and trains to a loss within 2 % of float32's. Bad values are
refused in one line naming the field; a resume may change the memory
controls but not the parameter dtype. The memory each control saves is
measured by ``benchmarks/bench_memory.py`` (docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax import models
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import step as step_lib
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
CFG = models.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                       n_embd=32)


def gpt_loss(cfg):
  model = models.GPT(cfg)

  def loss(params, batch, key):
    del key
    inputs, targets = batch
    value = models.lm_loss(model.apply({"params": params}, inputs), targets)
    return value, {"first_id": jnp.mean(inputs[:, 0].astype(jnp.float32))}
  return loss


def gpt_batch(rows=8):
  idx = jax.random.randint(jax.random.key(1), (rows, CFG.block_size + 1), 0,
                           CFG.vocab_size)
  return idx[:, :-1], idx[:, 1:]


def assert_close(a, b, rtol, atol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float64),
                               np.asarray(y, np.float64), rtol=rtol, atol=atol)


def test_micro_batch_split_is_strided():
  x = np.arange(24).reshape(12, 2)
  [split] = step_lib.micro_batch_split((jnp.asarray(x),), 3)
  assert split.shape == (3, 4, 2)
  for j in range(3):
    for i in range(4):
      np.testing.assert_array_equal(split[j, i], x[3 * i + j])


@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.slow)
                               for k in (2, 4, 8)])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(k):
  params = models.gpt.init_params(CFG, jax.random.key(0))
  loss, batch = gpt_loss(CFG), gpt_batch()
  (whole, whole_aux), whole_g = jax.jit(
      jax.value_and_grad(loss, has_aux=True))(params, batch, None)
  (value, aux), grads = jax.jit(
      lambda p, b: step_lib.loss_and_grad(loss, p, b, None, k))(params, batch)
  # float32 rounding of k partial means against one mean.
  np.testing.assert_allclose(value, whole, rtol=1e-6)
  np.testing.assert_allclose(aux["first_id"], whole_aux["first_id"],
                             rtol=1e-6)
  assert_close(grads, whole_g, rtol=1e-4, atol=1e-7)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_one_micro_batch_is_value_and_grad_bit_for_bit():
  params = models.gpt.init_params(CFG, jax.random.key(0))
  loss, batch = gpt_loss(CFG), gpt_batch()
  direct = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch,
                                                           None)
  one = jax.jit(lambda p, b: step_lib.loss_and_grad(loss, p, b, None, 1))(
      params, batch)
  for x, y in zip(jax.tree.leaves(direct), jax.tree.leaves(one)):
    np.testing.assert_array_equal(x, y)


def test_micro_batch_j_gets_dropout_key_fold_in_j():
  # loss_j = w * mean(b_j) * u_j with u_j = uniform(fold_in(key, j)):
  # the mean over j and its gradient in w, written out by hand.
  k, key = 4, jax.random.key(7)
  x = np.arange(1.0, 13.0, dtype=np.float32)

  def loss(params, batch, dkey):
    return params["w"] * jnp.mean(batch[0]) * jax.random.uniform(dkey), {}

  (value, _), grads = step_lib.loss_and_grad(
      loss, {"w": jnp.float32(3.0)}, (jnp.asarray(x),), key, k)
  terms = [float(np.mean(x[j::k])) *
           float(jax.random.uniform(jax.random.fold_in(key, j)))
           for j in range(k)]
  np.testing.assert_allclose(grads["w"], np.mean(terms), rtol=1e-6)
  np.testing.assert_allclose(value, 3.0 * np.mean(terms), rtol=1e-6)


def tiny_run(**fields):
  args = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
          "model.block_size=8", "global_batch=32", f"n_workers={N}",
          "eval_batches=1", "steps=4", "schedule.warmup_steps=2",
          "optimizer.name=adamw", "optimizer.accum_steps=1"]
  args += [f"{k.replace('__', '.')}={v}" for k, v in fields.items()]
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                args)


def train(config, steps):
  exp = experiment_lib.Experiment(config)
  state, losses = exp.init_state(), []
  for s in range(steps):
    state, metrics = exp.train_step(state, exp.get_batch(s), s)
    losses.append(float(np.mean(metrics["loss"])))
  return jax.device_get(state.params), np.array(losses)


@pytest.mark.slow
def test_a_run_with_four_micro_batches_ends_where_one_batch_ends():
  require_devices(N)
  one, one_losses = train(tiny_run(), 3)
  four, four_losses = train(tiny_run(micro_batches=4), 3)
  np.testing.assert_allclose(four_losses, one_losses, rtol=1e-5)
  assert_close(four, one, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_micro_batches_on_workers_of_two_devices_end_where_one_batch_ends():
  require_devices(2 * N)
  one, one_losses = train(tiny_run(devices_per_worker=2), 2)
  two, two_losses = train(tiny_run(devices_per_worker=2, micro_batches=2), 2)
  np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)
  assert_close(two, one, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_bfloat16_parameters_train_to_within_two_percent_of_float32():
  require_devices(N)
  _, f32 = train(tiny_run(steps=12), 12)
  params, bf16 = train(tiny_run(steps=12, model__param_dtype="bfloat16"), 12)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  assert f32[-1] < f32[0] - 0.2  # it trains at all
  np.testing.assert_allclose(bf16[-1], f32[-1], rtol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [
    "block", pytest.param("block_dots", marks=pytest.mark.slow)])
def test_remat_leaves_loss_and_gradient_and_names_unchanged(remat):
  cfg = dataclasses.replace(CFG, remat=remat)
  params = models.gpt.init_params(CFG, jax.random.key(0))
  assert jax.tree.structure(models.gpt.init_params(
      cfg, jax.random.key(0))) == jax.tree.structure(params)
  batch = gpt_batch()
  grad = lambda c: jax.jit(jax.value_and_grad(gpt_loss(c), has_aux=True))
  (ref, _), ref_g = grad(CFG)(params, batch, None)
  (value, _), grads = grad(cfg)(params, batch, None)
  np.testing.assert_allclose(value, ref, rtol=1e-6)
  assert_close(grads, ref_g, rtol=1e-4, atol=1e-7)
  # The blocks run under jax.checkpoint (one per block, the primitive
  # `remat2` in this JAX), with the policy of the mode; none without remat.
  jaxpr = lambda c: str(jax.make_jaxpr(
      lambda p: jax.grad(lambda q: gpt_loss(c)(q, batch, None)[0])(p))(
          params))
  remat_eqn = re.compile(r"= remat\w*\[")
  assert len(remat_eqn.findall(jaxpr(cfg))) == CFG.n_layer
  assert not remat_eqn.findall(jaxpr(CFG))
  policies = set(re.findall(r"policy=(\w+)", jaxpr(cfg)))
  assert policies == ({"DotsSaveable"} if remat == "block_dots" else {"None"})


@pytest.mark.slow
def test_bfloat16_parameters_are_stored_in_bfloat16():
  cfg = dataclasses.replace(CFG, param_dtype=jnp.bfloat16)
  params = models.gpt.init_params(cfg, jax.random.key(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  ref = models.gpt.init_params(CFG, jax.random.key(0))
  loss, batch = gpt_loss(CFG), gpt_batch()
  # The float32 model at the rounded weights: bfloat16 keeps 8 bits.
  value, _ = jax.jit(gpt_loss(cfg))(params, batch, None)
  np.testing.assert_allclose(value, jax.jit(loss)(ref, batch, None)[0],
                             rtol=0.01)


@pytest.mark.parametrize("field, value, message", [
    ("micro_batches", 3, "config.micro_batches=3 does not divide the local "
     "batch of 4 sequences per worker; set --config.micro_batches= one of "
     "[1, 2, 4]"),
    ("micro_batches", 0, "config.micro_batches must be an integer in [1, "),
    ("model.remat", "all", "unknown config.model.remat='all'; use one of "
     "none, block, block_dots"),
    ("model.param_dtype", "float16", "unknown config.model.param_dtype="),
])
def test_bad_memory_fields_are_refused_naming_them(field, value, message):
  c = tiny_run()
  *groups, last = field.split(".")
  (c[groups[0]] if groups else c)[last] = value
  with pytest.raises(ValueError, match="^" + message.replace("[", r"\[")
                     .replace("]", r"\]").replace("(", r"\(")):
    validation.check_config(c)


def test_micro_batches_must_divide_the_batch_per_device():
  c = tiny_run(devices_per_worker=2, micro_batches=4)
  with pytest.raises(ValueError, match=r"2 sequences per device \(4 per "
                     r"worker over config.devices_per_worker=2 devices\)"):
    validation.check_config(c)
  validation.check_config(tiny_run(devices_per_worker=2, micro_batches=2))


def test_gpt_config_refuses_an_unknown_remat():
  with pytest.raises(ValueError, match="GPTConfig.remat must be one of"):
    models.GPTConfig(remat="layers")
  assert models.gpt.REMAT_MODES == config_lib.REMAT_MODES


def test_a_resume_may_change_the_memory_controls_not_the_parameter_dtype():
  require_devices(N)
  saved = run_meta.checkpoint_meta(experiment_lib.Experiment(tiny_run()), 0)
  # A run with the defaults stores the model group as before these fields.
  assert "param_dtype" not in saved["model"] and "remat" not in saved["model"]
  run_meta.check_resumable(experiment_lib.Experiment(
      tiny_run(micro_batches=2, model__remat="block")), saved, "ckpt")
  # Named by the member that differs (absent in the old document: the
  # default, float32, shown resolved).
  with pytest.raises(ValueError, match=r"written with config.model."
                     r"param_dtype=float32 \(the default\) but this run has "
                     "'bfloat16'"):
    run_meta.check_resumable(experiment_lib.Experiment(
        tiny_run(model__param_dtype="bfloat16")), saved, "ckpt")
