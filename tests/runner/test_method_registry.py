"""A method is registered in one place: its home.

A toy method defined here (D-PSGD, Lian et al. 2017: plain SGD, then one
round of the fixed mixing matrix of ``config.topology`` every step) is
registered with one call, and then, with nothing else changed: its transform
equals a NumPy re-implementation, a tiny run of the runner trains, the
config validation accepts the fields it reads and refuses by name one it
does not read, and the runtime model prices it from its spec. The fixture
unregisters it, so that every other test sees the library's registry.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.optim import transforms
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import field_checks
from decentral_jax.runner import methods
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8
LR = 0.5


def _toy_build(config, schedule, topo, axis_name):
  """D-PSGD: ``x_{k+1} = W x_k - lr g(x_k)`` (the gossip overlapped)."""
  del config
  return optax.chain(optax.sgd(schedule),
                     transforms.gossip_mixing(topo, axis_name))


TOY = methods.Method(
    "toy_dpsgd", _toy_build, fields=("topology",),
    # A bare topology name: Decent-DP's overlapped gossip on it.
    runtime_spec=lambda config: str(config.topology), label="toy_dpsgd",
    uses_topology=True)


@pytest.fixture
def toy():
  methods.register(TOY)
  try:
    yield TOY
  finally:
    methods.unregister(TOY.name)


def _config(*extra):
  return config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      (*TINY_RUN, "--config.algorithm=toy_dpsgd", "--config.topology=ring",
       f"--config.schedule.peak_lr={LR}",
       "--config.optimizer.weight_decay=0", "--config.grad_clip=0",
       f"--config.n_workers={N}", *extra))


def test_registering_twice_or_an_unknown_field_is_refused(toy):
  with pytest.raises(ValueError, match="'toy_dpsgd' is already registered"):
    methods.register(toy)
  with pytest.raises(ValueError, match="names model.dropout, not in "
                     "METHOD_FIELDS"):
    methods.register(toy._replace(name="other", fields=("model.dropout",)))
  # A record whose parts have the wrong type is refused when registered,
  # naming the part, not later where the runner or the pricing calls it.
  for part, value, words in (
      ("runtime_spec", None, "Method.runtime_spec of 'other' must be callable"),
      ("build", "sgd", "Method.build of 'other' must be callable"),
      ("checks", 3, "Method.checks of 'other' must be callable or None"),
      ("fields", "sync_every", "Method.fields of 'other' must be a tuple"),
      ("label", "", "Method.label of 'other' must be a non-empty string")):
    with pytest.raises(ValueError, match=words):
      methods.register(toy._replace(name="other", **{part: value}))
  assert "other" not in methods.ALGORITHMS
  assert "other" not in methods.ALGORITHMS


def test_the_toy_transform_equals_numpy_dpsgd(toy):
  require_devices(N)
  config = _config()
  topo = topology.make("ring", N)
  tx = builders.make_optimizer(config, optax.constant_schedule(LR), topo,
                               "workers")
  mesh = parallel.make_mesh(N)
  rng = np.random.default_rng(0)
  targets = rng.normal(size=(N, 3))
  x0 = rng.normal(size=3)

  def step(p, s, c):
    g = jax.tree.map(lambda x: x - c, p)  # loss_i = 0.5 ||x - c_i||^2
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  stepf = jax.jit(parallel.per_worker(step, mesh))
  p = parallel.replicate({"x": jnp.asarray(x0, jnp.float32)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  c = parallel.shard(jnp.asarray(targets, jnp.float32), mesh)
  want = np.broadcast_to(x0, (N, 3)).astype(np.float64)
  for k in range(4):
    w = topo.mixing_matrix(k)
    want = w @ want - LR * (want - targets)
    p, s = stepf(p, s, c)
    np.testing.assert_allclose(np.asarray(p["x"]), want, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow
def test_a_tiny_run_of_the_toy_method_trains(toy):
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  state = exp.init_state()
  losses = []
  for s in range(12):
    state, m = exp.train_step(state, exp.get_batch(s), s)
    losses.append(float(np.mean(jax.device_get(m["loss"]))))
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert np.isfinite(exp.evaluate(state)["eval/loss"])


def test_validation_reads_the_toy_fields_and_refuses_the_others(toy):
  validation.check_config(_config("--config.topology=exponential"))
  assert methods.display_name(_config()) == "toy_dpsgd (ring)"
  with pytest.raises(ValueError) as info:
    validation.check_config(_config("--config.comm_dtype=bfloat16"))
  # The library's readers first, then those of later homes (in name order).
  readers = [a for a, e in methods.ALGORITHMS.items()
             if "comm_dtype" in e.fields and a != "toy_dpsgd"]
  assert readers[:6] == ["decentralized", "local_sgd", "diloco",
                         "decentralized_diloco", "streaming_diloco", "sgp"]
  assert str(info.value) == (
      "config.comm_dtype='bfloat16' has no effect with config.algorithm="
      f"'toy_dpsgd' (read only by {', '.join(readers)}); leave it at its "
      "default: --config.comm_dtype=''.")
  with pytest.raises(ValueError, match="config.sync_every=3 has no effect "
                     "with config.algorithm='toy_dpsgd'"):
    validation.check_config(_config("--config.sync_every=3"))
  with pytest.raises(ValueError, match="config.faults.enabled=True needs "
                     "config.algorithm in local_sgd, diloco, decentralized, "
                     "got 'toy_dpsgd'"):
    validation.check_config(_config("--config.faults.enabled=True"))


def test_the_runtime_model_prices_the_toy_method(toy):
  config = _config()
  spec, fields = builders.spec_for_config(config)
  assert (spec, fields) == ("ring", {"devices_per_worker": 1,
                                     "worker_layout": "fsdp"})
  # One worker per node, no latency, 1 GB/s between nodes.
  c = Cluster(N, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,), **fields)
  m = make_method(spec, c)
  assert m.kind == "gossip" and m.overlap and m.topology.name == "ring"
  t = simulate(m, c, w, steps=40, warmup=8)
  assert t == pytest.approx(closed_form(m, c, w).iteration_s, rel=1e-6)
  # Ring gossip over the 1 GB/s NIC: each worker sends its 100 MB to one
  # neighbour per step (0.1 s), more than the 60 ms of compute it hides
  # behind, so a step takes the exchange.
  assert t == pytest.approx(0.1, rel=1e-6)


# A toy method with a field of its own: D-PSGD whose mixing runs every
# `toy.gossip_every` steps would need a program; the field is only declared,
# validated, refused elsewhere, recorded and kept on resume.
TOY_FIELD = methods.ConfigField(3, field_checks.integer(1, 100),
                                "toy: an integer in [1, 100]")
TOY_OWN = TOY._replace(
    name="toy_own", config_fields={"toy.period": TOY_FIELD},
    arms=(methods.Arm("toy_arm", topology="ring",
                      fields=(("toy.period", 5),), peak_lr=1e-3),))


@pytest.fixture
def toy_own():
  methods.register(TOY_OWN)
  try:
    yield methods.lookup(TOY_OWN.name)
  finally:
    methods.unregister(TOY_OWN.name)


def test_a_declared_field_joins_the_config_and_is_read_by_its_method(toy_own):
  assert "toy.period" in toy_own.fields  # folded in by register
  c = config_lib.base_config()
  assert c.toy.period == 3
  config = _config("--config.algorithm=toy_own", "--config.toy.period=7")
  validation.check_config(config)
  with pytest.raises(ValueError, match=r"^config.toy.period must be an "
                     r"integer in \[1, 100\], got 101; set "
                     r"--config.toy.period=<int>.$"):
    validation.check_config(_config("--config.algorithm=toy_own",
                                    "--config.toy.period=101"))
  with pytest.raises(ValueError, match="^config.toy.period=7 has no effect "
                     "with config.algorithm='diloco' .read only by toy_own."):
    validation.check_config(_config("--config.algorithm=diloco",
                                    "--config.topology=one_peer_exp",
                                    "--config.toy.period=7"))
  methods.unregister("toy_own")
  try:
    assert "toy" not in config_lib.base_config()  # gone with its method
  finally:
    methods.register(TOY_OWN)


def test_declared_fields_are_refused_when_malformed_or_taken(toy_own):
  bad = {"toy period": TOY_FIELD, "sync_every": TOY_FIELD,
         "toy.period": TOY_FIELD._replace(doc="another"),
         "toy.other": TOY_FIELD._replace(default=0)}
  words = {"toy period": "is not a dotted field name",
           "sync_every": "config.sync_every is already a field",
           "toy.period": "config.toy.period is already a field",
           "toy.other": r"config.toy.other must be an integer"}
  for name, spec in bad.items():
    with pytest.raises(ValueError, match=words[name]):
      methods.register(TOY._replace(name="other",
                                    config_fields={name: spec}))
  with pytest.raises(ValueError, match="Method.arms of 'other' must be a "
                     "tuple of Arm"):
    methods.register(TOY._replace(name="other", arms=("toy_arm",)))
  with pytest.raises(ValueError, match="arm name 'toy_arm' is taken"):
    methods.register(TOY._replace(name="other",
                                  arms=(methods.Arm("toy_arm"),)))
  # A base field, at any depth, is refused when registered (the config
  # built before and after is the library's).
  for name, words in (
      ("steps", "declares config.steps, which the base config already has"),
      ("model.dropout", "declares config.model.dropout, which the base "
       "config already has"),
      ("steps.sub", "declares config.steps.sub, but config.steps is a "
       "field, not a group")):
    with pytest.raises(ValueError, match=f"^method 'other' {words}"):
      methods.register(TOY._replace(name="other",
                                    config_fields={name: TOY_FIELD}))
  assert "other" not in methods.ALGORITHMS
  assert config_lib.base_config().steps != TOY_FIELD.default


def test_a_declared_field_may_join_an_existing_group(toy_own):
  extra = TOY._replace(name="other", config_fields={
      "schedule.toy_level": TOY_FIELD})
  methods.register(extra)
  try:
    c = config_lib.base_config()
    assert c.schedule.toy_level == 3 and c.schedule.name == "warmup_cosine"
    validation.check_config(_config("--config.algorithm=other",
                                    "--config.schedule.toy_level=4"))
  finally:
    methods.unregister("other")
  assert "toy_level" not in config_lib.base_config().schedule


def test_a_declared_field_is_kept_across_a_resume(toy_own):
  require_devices(N)
  exp = experiment_lib.Experiment(_config("--config.algorithm=toy_own",
                                          "--config.toy.period=7"))
  meta = run_meta.checkpoint_meta(exp, 4)
  assert meta["toy.period"] == 7
  run_meta.check_resumable(exp, meta, "ckpt")
  with pytest.raises(ValueError, match="written with config.toy.period=5 but "
                     "this run has 7"):
    run_meta.check_resumable(exp, {**meta, "toy.period": 5}, "ckpt")
  old = {k: v for k, v in meta.items() if k != "toy.period"}
  with pytest.raises(ValueError, match="config.toy.period=3 but this run "
                     "has 7"):  # written before the field: its default
    run_meta.check_resumable(exp, old, "ckpt")


@pytest.mark.slow
def test_an_arm_joins_the_main_job_method_table(toy_own):
  script = (
      "from decentral_jax.runner import methods\n"
      "from tests.runner.test_method_registry import TOY_OWN\n"
      "methods.register(TOY_OWN)\n"
      "from decentral_jax.tools.compare import runs\n"
      "run = runs.METHODS['toy_arm']\n"
      "print(run.algorithm, run.topology, run.fields, "
      "runs.TUNED_PEAK_LR['toy_arm'], run.label)\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep +
                            os.path.join(ROOT, "tests")},
                       capture_output=True, text=True, timeout=300, check=True)
  assert out.stdout.strip().splitlines()[-1] == (
      "toy_own ring (('toy.period', 5),) 0.001 toy_dpsgd (ring), "
      "toy.period=5")
