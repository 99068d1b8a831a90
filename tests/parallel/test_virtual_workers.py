"""Many workers on one device (parallel.VirtualMesh, config.workers_per_device).

16 workers as 16 devices (one worker each, the existing code path), as 4
devices of K = 4 workers, and as 1 device of K = 16 must follow the same
trajectories (float32 within 1e-5 relative, float64 within 1e-12) for
DAdam on one_peer_exp, on AER (node-aware mesh for the reference) and on a
custom from_matrices schedule; one gossip round equals a dense NumPy
W @ X for every built-in topology; the HLO of a round carries only the
rows that cross devices (bytes worked out by hand below).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import sync_args
from decentral_jax import analysis
from decentral_jax.comm import collectives
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import devices
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.comm import gossip
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.runner import validation

N = 16
D_IN, D_OUT, B = 8, 12, 4
STEPS = 4
PARAM_BYTES = (D_IN * D_OUT + D_OUT) * 4


def _custom():
  """Period 2: a random mix of permutations, then pairs {i, i+8}."""
  rng = np.random.default_rng(3)
  w0 = np.zeros((N, N))
  for weight in (0.5, 0.3, 0.2):
    w0[np.arange(N), rng.permutation(N)] += weight
  w1 = np.zeros((N, N))
  for i in range(N):
    w1[i, i] = w1[i, (i + 8) % N] = 0.5
  return topology.from_matrices([w0, w1], name="custom")


def _topology(name):
  if name == "custom":
    return _custom()
  if name == "aer":
    return topology.make("alternating_exp_ring", N, 4)
  return topology.make(name, N)


def _mesh(k, topo=None):
  devices = require_devices(N)
  node_aware = k == 1 and topo is not None and parallel.is_node_aware(topo, 4)
  return parallel.make_mesh(N, 4 if node_aware else 1, node_aware=node_aware,
                            devices=devices, workers_per_device=k)


def _loss(p, batch):
  x, y = batch
  return jnp.mean(jnp.square(jnp.tanh(x @ p["w"] + p["b"]) - y))


def _run(method, topo_name, k, dtype):
  topo = _topology(topo_name)
  mesh = _mesh(k, topo)
  axis = parallel.worker_axis(mesh)
  if method == "dadam":
    tx = optim.decentralized_adamw(3e-2, topo, weight_decay=0.1,
                                   axis_name=axis)
  elif method == "all_reduce":
    tx = optax.chain(optim.all_reduce_gradients(axis), optax.adamw(3e-2))
  else:
    tx = optim.diloco(optax.adamw(3e-2), 2, **sync_args(axis_name=axis))

  def step(p, s, batch):
    g = jax.grad(_loss)(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  k1, k2 = jax.random.split(jax.random.key(0))
  params = parallel.replicate(
      {"w": jax.random.normal(k1, (D_IN, D_OUT), dtype) * 0.3,
       "b": jax.random.normal(k2, (D_OUT,), dtype) * 0.1}, mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  fn = jax.jit(parallel.per_worker(step, mesh))
  rng = np.random.default_rng(1)
  traj = []
  for _ in range(STEPS):
    batch = parallel.shard((rng.normal(size=(N, B, D_IN)).astype(dtype),
                            rng.normal(size=(N, B, D_OUT)).astype(dtype)),
                           mesh)
    params, state = fn(params, state, batch)
    traj.append(jax.device_get(params))
  return traj


@functools.lru_cache(maxsize=None)
def _cached(method, topo_name, k, dtype_name="float32"):
  return _run(method, topo_name, k, jnp.dtype(dtype_name))


def _assert_close(got, want, rtol):
  for t, (g, w) in enumerate(zip(got, want)):
    for key in w:
      w64 = np.asarray(w[key], np.float64)
      err = np.max(np.abs(np.asarray(g[key], np.float64) - w64))
      assert err <= rtol * np.max(np.abs(w64)), (t, key, err)


@pytest.mark.parametrize("topo_name,k", [
    pytest.param(t, k, id=f"{k}-{t}", marks=pytest.mark.slow)
    for t in ("one_peer_exp", "aer", "custom") for k in (4, 16)])
def test_virtual_workers_follow_one_worker_per_device(topo_name, k):
  want = _cached("dadam", topo_name, 1)
  got = _cached("dadam", topo_name, k)
  _assert_close(got, want, 1e-5)
  w = np.asarray(got[-1]["w"])
  assert np.ptp(w, axis=0).max() > 1e-4  # workers differ: not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("method", ["all_reduce", "diloco"])
def test_all_reduce_and_diloco_on_virtual_workers(method):
  _assert_close(_cached(method, "complete", 4), _cached(method, "complete", 1),
                1e-5)


@pytest.mark.slow
def test_float64_trajectories_match(x64):
  want = _cached("dadam", "aer", 1, "float64")
  got = _cached("dadam", "aer", 4, "float64")
  assert got[-1]["w"].dtype == np.float64
  _assert_close(got, want, 1e-12)


def _mix_fn(topo, mesh, comm_dtype=None):
  axis = parallel.worker_axis(mesh)
  return jax.jit(parallel.per_worker(
      lambda x, s: gossip.mix(x, topo, s, axis, comm_dtype=comm_dtype), mesh,
      replicated_argnums=(1,)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["complete", "ring", "one_peer_exp",
                                  "alternating_exp_ring", "exponential",
                                  "torus", "static_ring"])
def test_every_round_equals_the_dense_mixing_matrix(name):
  topo = topology.make(name, N, 4 if name == "alternating_exp_ring" else 1)
  x = np.random.default_rng(0).normal(size=(N, 3, 5)).astype(np.float32)
  for k in (4, 16):
    mesh = _mesh(k)
    fn = _mix_fn(topo, mesh)
    for s in range(topo.period):
      got = np.asarray(fn(parallel.shard(jnp.asarray(x), mesh), jnp.int32(s)))
      want = np.einsum("ij,j...->i...", topo.mixing_matrix(s),
                       x.astype(np.float64))
      np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


@pytest.mark.slow
def test_low_precision_gossip_on_virtual_workers():
  topo = topology.make("alternating_exp_ring", N, 4)
  x = np.random.default_rng(2).normal(size=(N, 64)).astype(np.float32)
  ref = _mix_fn(topo, _mesh(1), jnp.bfloat16)
  mesh = _mesh(4)
  got = _mix_fn(topo, mesh, jnp.bfloat16)
  for s in range(topo.period):
    a = np.asarray(ref(parallel.shard(jnp.asarray(x), _mesh(1)), jnp.int32(s)))
    b = np.asarray(got(parallel.shard(jnp.asarray(x), mesh), jnp.int32(s)))
    # bf16 on the wire (8 bits of mantissa): both far from exact ...
    exact = topo.mixing_matrix(s) @ x.astype(np.float64)
    assert np.abs(b - exact).max() > 1e-5
    # ... and within bf16 rounding of each other.
    np.testing.assert_allclose(b, a, atol=2e-2, rtol=0)


def _round_bytes(topo, k, step):
  mesh = _mesh(k)
  axis = parallel.worker_axis(mesh)
  x = jnp.zeros((N, D_IN * D_OUT + D_OUT), jnp.float32)
  fn = jax.jit(parallel.per_worker(lambda v: gossip.mix(v, topo, step, axis),
                                   mesh))  # round ``step`` only
  return analysis.communication(fn.lower(parallel.shard(x, mesh)),
                                stage="unoptimized")


@pytest.mark.slow
def test_a_round_sends_only_the_rows_that_cross_devices():
  row = PARAM_BYTES
  ope = topology.make("one_peer_exp", N)
  # XOR partners 1 and 2 are on the same device of 4 workers: no traffic;
  # partners 4 and 8 are on another device: its 4 rows, one permute.
  for s, rows in ((0, 0), (1, 0), (2, 4), (3, 4)):
    rep = _round_bytes(ope, 4, s)
    assert rep.bytes_per_step == (rows * row,), (s, rep.bytes_per_step)
  assert _round_bytes(ope, 16, 3).bytes_per_step == (0,)
  aer = topology.make("alternating_exp_ring", N, 4)
  # A node (4 workers) is one device: intra-node means are local; a
  # two-node mean sends the device's partial sum once (one row).
  for s in range(aer.period):
    rep = _round_bytes(aer, 4, s)
    want = 0 if aer.round(s).node_partners(4).count(-1) == 4 else row
    assert rep.bytes_per_step == (want,), (s, rep.bytes_per_step)
  # The global mean: the 4 workers' sum, all-reduced over 4 devices.
  rep = _round_bytes(topology.make("complete", N), 4, 0)
  assert [c.kind for c in rep.collectives] == ["all-reduce"]
  assert rep.collectives[0].operand_bytes == row


def test_collectives_outside_per_worker_are_a_clear_error():
  mesh = _mesh(4)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(jax.shard_map(lambda x: collectives.pmean(x, axis),
                             mesh=parallel.device_mesh(mesh),
                             in_specs=parallel.worker_spec(mesh),
                             out_specs=parallel.worker_spec(mesh)))
  with pytest.raises(ValueError, match="inside parallel.per_worker"):
    fn(parallel.shard(jnp.zeros((N,)), mesh))


def test_a_mesh_axis_name_on_virtual_workers_names_the_reduction_fix():
  """DiLoCo's default reduction averages over the mesh axis 'workers'; on
  virtual workers the error names reduction=..., and with it the run
  averages (x = 1, 2, .., N: one SGD step at lr 0 leaves x, the sync takes
  the mean (N + 1) / 2)."""
  mesh = _mesh(2)
  x = parallel.shard(jnp.arange(1.0, N + 1.0)[:, None], mesh)

  def step(tx):
    def one(p):
      u, _ = tx.update(jnp.zeros_like(p), tx.init(p), p)
      return optax.apply_updates(p, u)
    return jax.jit(parallel.per_worker(one, mesh))(x)

  with pytest.raises(ValueError, match=r"reduction=reductions.uncompressed"
                     r"\(axis_name=...\)"):
    step(optim.diloco(optax.sgd(0.0), 1))
  from decentral_jax.optim import reductions  # pylint: disable=import-outside-toplevel
  got = step(optim.diloco(optax.sgd(0.0), 1, outer=optax.sgd(1.0),
                          reduction=reductions.uncompressed(
                              axis_name=parallel.worker_axis(mesh))))
  np.testing.assert_allclose(np.asarray(got), np.full((N, 1), (N + 1) / 2))


def test_mesh_errors_name_the_fields():
  devices = require_devices(N)
  with pytest.raises(ValueError, match="workers_per_device=3 must divide"):
    parallel.make_mesh(N, workers_per_device=3, devices=devices)
  with pytest.raises(ValueError, match="not both"):
    parallel.make_mesh(4, workers_per_device=2, devices_per_worker=2)
  with pytest.raises(ValueError, match="need 4 devices but only 2"):
    parallel.make_mesh(16, workers_per_device=4, devices=devices[:2])
  mesh = parallel.make_mesh(N, workers_per_device=4, devices=devices)
  assert parallel.n_workers_of(mesh) == N
  assert parallel.device_mesh(mesh).devices.size == 4
  assert parallel.worker_axis(mesh) == collectives.VirtualAxes(
      "workers", 4, "virtual")


def _config(*overrides):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return config_lib.load_config(os.path.join(root, "configs", "gpt_tiny.py"), (
      "--config.model.n_layer=1", "--config.model.n_embd=16",
      "--config.model.n_head=2", "--config.model.block_size=8",
      "--config.global_batch=16", "--config.eval_batches=1",
      "--config.n_workers=8", "--config.topology=one_peer_exp",
      "--config.optimizer.name=adamw", "--config.optimizer.accum_steps=1",
      "--config.steps=2") + overrides)


def test_config_errors_name_the_fields():
  with pytest.raises(ValueError, match=r"config.workers_per_device=3 does "
                     r"not divide config.n_workers=8"):
    validation.check_config(_config("--config.workers_per_device=3"))
  with pytest.raises(ValueError, match=r"config.workers_per_device=2 and "
                     r"config.devices_per_worker=2"):
    validation.check_config(_config("--config.workers_per_device=2",
                                    "--config.devices_per_worker=2"))
  assert devices.devices_needed(_config("--config.workers_per_device=4")
                                   ) == (2, "config.n_workers=8 / config."
                                         "workers_per_device=4")


@pytest.mark.slow
def test_runner_trains_virtual_workers_like_devices():
  require_devices(8)
  runs = {}
  for k in (1, 4):
    exp = experiment_lib.Experiment(_config(
        f"--config.workers_per_device={k}"))
    state = exp.init_state()
    losses = []
    for s in range(2):
      state, m = exp.train_step(state, exp.get_batch(s), s)
      losses.append(np.asarray(m["loss"]))
    runs[k] = (exp, state, np.array(losses), exp.evaluate(state))
  (_, _, l1, e1), (exp, state, l4, e4) = runs[1], runs[4]
  assert l4.shape == (2, 8)
  np.testing.assert_allclose(l4, l1, rtol=1e-5)
  assert abs(e4["eval/loss"] - e1["eval/loss"]) < 1e-5 * e1["eval/loss"]
  # one_peer_exp on 8 workers: partners 1, 2 on the device (4 workers),
  # partner 4 on the other: one round in 3 sends a worker's parameters.
  comm = exp.communication(state, exp.get_batch(2))
  assert comm["workers_per_device"] == 4
  assert comm["ratio"] == pytest.approx(1 / 3)
  assert comm["device_bytes_per_step"] == pytest.approx(
      4 * comm["bytes_per_step"])
  # Elastic resume: a checkpoint of 8 devices x 1 worker resumes on
  # 2 devices x 4 workers (tests/runner/test_elastic_resume.py), but not with
  # another number of workers.
  meta = run_meta.checkpoint_meta(runs[1][0], 2)
  assert meta["layout"]["workers_per_device"] == 1
  run_meta.check_resumable(exp, meta, "/ckpt")
  with pytest.raises(ValueError, match=r"holds 4 workers .* config."
                     r"n_workers=8"):
    run_meta.check_resumable(exp, dict(meta, n_workers=4), "/ckpt")


def test_misuse_inside_the_worker_vmap_is_an_error_not_a_wrong_number():
  mesh = _mesh(4)
  x = parallel.shard(jnp.arange(N, dtype=jnp.float32), mesh)
  # The device axis name instead of worker_axis(mesh): it would average
  # each slot with the same slot of the other devices only.
  fn = jax.jit(parallel.per_worker(lambda v: collectives.pmean(v, "workers"),
                                   mesh))
  with pytest.raises(ValueError, match=r"pass parallel.worker_axis\(mesh\)"):
    fn(x)
  # A vmap of the caller's own, of size K, inside the worker function.
  axis = parallel.worker_axis(mesh)
  inner = jax.jit(parallel.per_worker(
      lambda v: jax.vmap(lambda c: collectives.psum(v * c, axis))(
          jnp.arange(4.0)), mesh))
  with pytest.raises(ValueError, match="not inside another jax.vmap"):
    inner(x)


def test_per_worker_integer_arguments_keep_their_values():
  mesh = _mesh(4)
  ids = parallel.shard(jnp.arange(N, dtype=jnp.int32), mesh)
  mask = parallel.shard(jnp.arange(N) % 2 == 0, mesh)
  fn = jax.jit(parallel.per_worker(
      lambda i, m: (i * 10 + collectives.index(parallel.worker_axis(mesh)),
                    jnp.where(m, 1.0, -1.0)), mesh))
  got_i, got_m = fn(ids, mask)
  np.testing.assert_array_equal(np.asarray(got_i), np.arange(N) * 11)
  np.testing.assert_array_equal(np.asarray(got_m),
                                np.where(np.arange(N) % 2 == 0, 1.0, -1.0))
