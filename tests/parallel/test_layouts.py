"""Workers spanning several devices (decentral_jax.parallel.layouts).

On 16 simulated CPU devices, 4 workers of 4 devices each ("fsdp": state
split over a worker's devices; "data": state replicated, batch split) must
follow the trajectories of 4 workers of one device each (the existing code
path), for DAdam on one_peer_exp, All-Reduce AdamW and DiLoCo. The
compiled one-peer round is checked in the HLO: with "fsdp" each device
sends its shard only (parameter bytes / 4), with "data" the whole
parameters.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from conftest import require_devices
from decentral_jax import analysis
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.comm import gossip
from decentral_jax.parallel import layouts
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology

N, D = 4, 4
D_IN, D_OUT, B = 16, 32, 8
STEPS = 3
PARAM_BYTES = (D_IN * D_OUT + D_OUT) * 4  # w [16, 32] + b [32], float32


def _params(dtype, extra: bool = False):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  p = {"w": jax.random.normal(k1, (D_IN, D_OUT), dtype) * 0.3,
       "b": jax.random.normal(k2, (D_OUT,), dtype) * 0.1}
  if extra:  # no dimension divisible by 4: replicated on a worker's devices
    p["s"] = 1.0 + 0.1 * jax.random.normal(k3, (3,), dtype)
  return p


def _loss(p, batch):
  x, y = batch
  pred = jnp.tanh(x @ p["w"] + p["b"])
  loss = jnp.mean(jnp.square(pred - y))
  if "s" in p:
    loss = loss + jnp.mean(jnp.square(pred[:, :3] * p["s"] - 0.5))
  return loss


def _batches(dtype):
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(N, B, D_IN)).astype(dtype),
           rng.normal(size=(N, B, D_OUT)).astype(dtype) * 0.5)
          for _ in range(STEPS)]


def _txs():
  one_peer = topology.make("one_peer_exp", N)
  return {
      "dadam": lambda: optim.decentralized_adamw(3e-2, one_peer,
                                                 weight_decay=0.1),
      "all_reduce": lambda: optax.chain(optim.all_reduce_gradients(),
                                        optax.adamw(3e-2)),
      "diloco": lambda: optim.diloco(optax.adamw(3e-2), 2),
  }


def _mesh(layout):
  devices = require_devices(N * D)
  if layout is None:
    return parallel.make_mesh(N, devices=devices[:N])
  return parallel.make_mesh(N, devices=devices, devices_per_worker=D)


def _run(name, layout, dtype, extra=False):
  """Parameters after every step, and the compiled step (for its HLO)."""
  tx = _txs()[name]()
  mesh = _mesh(layout)

  def step(p, s, batch):
    loss, g = jax.value_and_grad(_loss)(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  params0 = _params(dtype, extra)
  params = parallel.replicate(params0, mesh)
  init = parallel.per_worker(tx.init, mesh)
  if layout is None:
    init_fn = jax.jit(init)
    step_fn = jax.jit(parallel.per_worker(step, mesh))
    place_batch = lambda b: parallel.shard(b, mesh)
  else:
    params = layouts.place(params, mesh, layout)
    p_sh = layouts.state_shardings(params, mesh, layout)
    s_sh = layouts.state_shardings(jax.eval_shape(init, params), mesh, layout)
    init_fn = jax.jit(init, out_shardings=s_sh)
    step_fn = jax.jit(parallel.per_worker(step, mesh),
                      out_shardings=(p_sh, s_sh,
                                     parallel.worker_sharding(mesh)))
    place_batch = lambda b: layouts.place_batch(b, mesh)
  state = init_fn(params)
  batches = [place_batch(b) for b in _batches(dtype)]
  compiled = step_fn.lower(params, state, batches[0]).compile()
  traj = []
  for b in batches:
    params, state, _ = compiled(params, state, b)
    traj.append(jax.device_get(params))
  return traj, compiled, params


@functools.lru_cache(maxsize=None)
def _cached(name, mode, dtype_name, extra=False):
  layout = None if mode is None else layouts.WorkerLayout(D, mode)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return _run(name, layout, jnp.dtype(dtype_name), extra)


def _assert_close(got, want, rtol):
  for t, (g, w) in enumerate(zip(got, want)):
    for k in w:
      scale = np.max(np.abs(w[k]))
      err = np.max(np.abs(np.asarray(g[k], np.float64) - w[k])) / scale
      assert err <= rtol, (t, k, err)


@pytest.mark.parametrize("name,mode", [
    pytest.param(n, m, id=f"{m}-{n}", marks=pytest.mark.slow)
    for n in ("dadam", "all_reduce", "diloco") for m in ("fsdp", "data")])
def test_multi_device_workers_follow_one_device_workers(name, mode):
  extra = name == "diloco"  # one leaf that fsdp cannot split
  want, _, _ = _cached(name, None, "float32", extra)
  got, _, final = _cached(name, mode, "float32", extra)
  _assert_close(got, want, 1e-5)
  # The state keeps its layout: fsdp leaves split over "inner".
  specs = jax.tree.map(lambda x: x.sharding.spec, final)
  if mode == "fsdp":
    assert specs["w"] == P("workers", "inner", None)
    assert specs["b"] == P("workers", "inner")
    if extra:
      assert specs["s"] == P("workers", None)
  else:
    assert all(s == P("workers", *([None] * (len(s) - 1)))
               for s in jax.tree.leaves(specs, is_leaf=lambda s:
                                        isinstance(s, P)))
  # Workers differ (the test would be vacuous otherwise) but not for AR.
  w = np.asarray(got[-1]["w"])
  assert (np.ptp(w, axis=0).max() > 1e-4) == (name != "all_reduce")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "data"])
def test_float64_trajectories_match(x64, mode):
  want, _, _ = _cached("dadam", None, "float64")
  got, _, _ = _cached("dadam", mode, "float64")
  assert got[-1]["w"].dtype == np.float64
  _assert_close(got, want, 1e-12)


@pytest.mark.slow
def test_one_peer_round_bytes_per_device_and_per_worker():
  ref = analysis.communication(_cached("dadam", None, "float32", False)[1])
  fsdp = analysis.communication(_cached("dadam", "fsdp", "float32", False)[1])
  data = analysis.communication(_cached("dadam", "data", "float32", False)[1])
  assert ref.n_devices == N and fsdp.n_devices == data.n_devices == N * D
  # One device per worker: the parameters once per round (2 rounds).
  assert ref.bytes_per_step == (PARAM_BYTES,) * 2
  t = analysis.traffic(fsdp, D)
  # fsdp: every device sends its shard to the peer worker's device.
  assert t.device_out == (PARAM_BYTES / D,) * 2
  assert t.worker_out == (PARAM_BYTES,) * 2
  permutes = [c for c in fsdp.collectives
              if c.kind == "collective-permute" and any(
                  a // D != b // D for a, b in c.source_target_pairs)]
  assert permutes and all(c.operand_bytes <= PARAM_BYTES / D
                          for c in permutes)
  # data: every device sends the full parameters (D copies per worker),
  # and the gradient is all-reduced inside the worker.
  t = analysis.traffic(data, D)
  assert t.device_out == (PARAM_BYTES,) * 2
  assert t.worker_out == (D * PARAM_BYTES,) * 2
  assert t.mean_worker > t.mean_worker_out  # intra-worker all-reduce
  inner = [c for c in data.collectives if c.kind == "all-reduce"]
  assert inner and all(all(len({d // D for d in g}) == 1
                           for g in c.replica_groups) for c in inner)
  # D = 1: traffic is the report's figure.
  t1 = analysis.traffic(ref, 1)
  assert t1.device == t1.device_out == t1.worker == t1.worker_out == (
      PARAM_BYTES,) * 2


def test_mesh_axes_and_one_device_workers_unchanged():
  devices = require_devices(N * D)
  plain = parallel.make_mesh(N, devices=devices[:N])
  same = parallel.make_mesh(N, devices=devices[:N], devices_per_worker=1)
  assert plain.axis_names == same.axis_names == ("workers",)
  assert same.axis_types == (AxisType.Explicit,)
  assert same == plain
  m = parallel.make_mesh(N, devices=devices, devices_per_worker=D)
  assert m.axis_names == ("workers", "inner")
  assert dict(m.shape) == {"workers": N, "inner": D}
  assert m.axis_types == (AxisType.Explicit, AxisType.Auto)
  assert [d.id for d in m.devices[1]] == [devices[k].id for k in range(4, 8)]
  assert parallel.worker_axis(m) == "workers"
  assert parallel.n_workers_of(m) == N and parallel.devices_per_worker(m) == D
  node = parallel.make_mesh(N, 2, node_aware=True, devices=devices,
                            devices_per_worker=D)
  assert node.axis_names == ("nodes", "local", "inner")
  assert dict(node.shape) == {"nodes": 2, "local": 2, "inner": D}
  assert parallel.worker_axis(node) == ("nodes", "local")
  assert parallel.n_workers_of(node) == N
  assert layouts.batch_sharding(plain) == parallel.worker_sharding(plain)


def test_split_dimension_and_unsplit_leaves_are_reported():
  params = {"w": jnp.zeros((6, 8)), "v": jnp.zeros((8, 12)),
            "s": jnp.zeros((3,)), "k": jnp.zeros((4,), jnp.int32)}
  lay = layouts.WorkerLayout(4, "fsdp")
  assert layouts.inner_dim((6, 8), jnp.float32, 4) == 1
  assert layouts.inner_dim((8, 12), jnp.float32, 4) == 0
  assert layouts.inner_dim((8, 12), jnp.float32, 4, "largest") == 1
  assert layouts.inner_dim((8,), jnp.int32, 4) is None
  assert layouts.inner_dim((8,), jnp.float32, 1) is None
  mesh = _mesh(lay)
  specs = layouts.state_specs(params, mesh, lay, stacked=False)
  assert specs == {"w": P(None, "inner"), "v": P("inner"), "s": P(),
                   "k": P()}
  assert layouts.unsplit_leaves(params, lay) == ["['s']"]
  assert layouts.unsplit_leaves(params, layouts.WorkerLayout(4, "data")) == []
  with pytest.warns(UserWarning, match=r"\['s'\] \(3,\)"):
    assert layouts.check_params(params, lay) == ["['s']"]
  with pytest.raises(ValueError, match=r"devices_per_worker=4.*\['s'\]"):
    layouts.check_params(params, lay, unsplit="error", what="config: ")
  stacked = layouts.state_specs(
      jax.tree.map(lambda x: jnp.zeros((N,) + x.shape, x.dtype), params),
      mesh, layouts.WorkerLayout(4, "data"))
  assert stacked["w"] == P("workers", None, None)


def test_bad_layouts_raise_clear_errors():
  devices = require_devices(N * D)
  with pytest.raises(ValueError, match="4 workers of 8 devices each need 32 "
                     "devices but only 16"):
    parallel.make_mesh(N, devices=devices, devices_per_worker=8)
  with pytest.raises(ValueError, match="devices_per_worker must be an int >= 1"):
    parallel.make_mesh(N, devices=devices, devices_per_worker=0)
  with pytest.raises(ValueError, match="devices_per_worker must be an int >= 1"):
    layouts.WorkerLayout(2.0)
  with pytest.raises(ValueError, match="mode must be one of"):
    layouts.WorkerLayout(4, "tensor")
  with pytest.raises(ValueError, match="split must be one of"):
    layouts.WorkerLayout(4, "fsdp", "last")
  mesh = _mesh(layouts.WorkerLayout(D))
  with pytest.raises(ValueError, match="layout has devices_per_worker=2"):
    layouts.state_specs({"w": jnp.zeros((N, 8))}, mesh,
                        layouts.WorkerLayout(2))
  with pytest.raises(ValueError, match=r"batch leaf '\[0\]'.*divisible by 4"):
    layouts.place_batch((np.zeros((N, 6, 2), np.float32),), mesh)
  with pytest.raises(ValueError, match="unsplit must be"):
    layouts.check_params({}, layouts.WorkerLayout(D), unsplit="maybe")
  with pytest.raises(ValueError, match="must divide"):
    analysis.traffic(analysis.communication(
        "HloModule m, num_partitions=6\n\nENTRY %e () -> f32[] {\n"
        "  ROOT %c = f32[] constant(0)\n}\n"), 4)


@pytest.mark.slow
def test_node_aware_workers_of_two_devices_mix_like_the_matrix():
  # AER on (nodes, local, inner): node means, then pair means of nodes.
  devices = require_devices(N * D)
  topo = topology.make("aer", N, 2)
  mesh = parallel.make_mesh(N, 2, node_aware=True, devices=devices[:2 * N],
                            devices_per_worker=2)
  assert parallel.is_node_aware(topo, 2)
  lay = layouts.WorkerLayout(2, "fsdp")
  x = np.arange(N * 8, dtype=np.float32).reshape(N, 8) ** 1.5
  xs = layouts.place(jnp.asarray(x), mesh, lay)
  assert xs.sharding.spec == P(("nodes", "local"), "inner")
  for r in range(topo.period):
    fn = jax.jit(parallel.per_worker(
        lambda t, r=r: gossip.mix(t, topo, r, parallel.worker_axis(mesh)),
        mesh))
    np.testing.assert_allclose(np.asarray(fn(xs)), topo.round(r).matrix @ x,
                               rtol=1e-6)


# ---------------------------------------------------------------------------
# The runner: config.devices_per_worker and config.worker_layout.
# ---------------------------------------------------------------------------


def _config(*overrides, devices_per_worker=D, worker_layout="fsdp"):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return config_lib.load_config(os.path.join(root, "configs", "gpt_tiny.py"), (
      "--config.model.n_layer=1", "--config.model.n_embd=16",
      "--config.model.n_head=2", "--config.model.block_size=8",
      "--config.global_batch=16", "--config.eval_batches=1",
      f"--config.n_workers={N}", "--config.topology=one_peer_exp",
      "--config.steps=2", f"--config.devices_per_worker={devices_per_worker}",
      f"--config.worker_layout={worker_layout}") + overrides)


@pytest.mark.slow
def test_runner_builds_fsdp_workers_and_resumes_another_layout():
  require_devices(N * D)
  exp = experiment_lib.Experiment(_config())
  assert exp.mesh.axis_names == ("workers", "inner")
  assert exp.layout == layouts.WorkerLayout(D, "fsdp")
  state = exp.init_state()
  kernel = state.params["h_0"]["mlp"]["c_fc"]["kernel"]
  assert kernel.sharding.spec == P("workers", "inner", None)
  batch = exp.get_batch(0)
  assert batch[0].sharding.spec == P("workers", "inner")
  comm = exp.communication(state, batch)
  # One-peer gossip: each device sends its quarter, each worker the whole
  # (the trajectories are checked above with the library-level steps).
  assert comm["ratio"] == 1.0
  assert comm["device_bytes_per_step"] == comm["param_bytes"] / D
  assert comm["devices_per_worker"] == D
  meta = run_meta.checkpoint_meta(exp, 1)
  assert meta["layout"]["devices_per_worker"] == D
  assert meta["layout"]["worker_layout"] == "fsdp"
  run_meta.check_resumable(exp, dict(meta), "ckpt")
  # Elastic resume: another devices_per_worker or worker_layout (also of a
  # checkpoint written before the fields, D = 1) is accepted
  # (tests/runner/test_elastic_resume.py), another number of workers is not.
  for key, value in (("devices_per_worker", 1), ("worker_layout", "data")):
    run_meta.check_resumable(exp, dict(meta, **{key: value}), "ckpt")
  old = {k: v for k, v in meta.items()
         if k not in ("devices_per_worker", "worker_layout", "layout")}
  run_meta.check_resumable(exp, old, "ckpt")
  with pytest.raises(ValueError, match="not the number of workers"):
    run_meta.check_resumable(
        exp, dict(meta, n_workers=meta["n_workers"] * 2), "ckpt")


def test_config_default_is_one_device_per_worker():
  assert config_lib.base_config().devices_per_worker == 1


def test_runner_layout_errors_name_the_config_fields():
  require_devices(N * D)
  for kwargs, overrides, match in (
      (dict(devices_per_worker=8), ("--config.global_batch=32",),
       r"config.n_workers=4 x config.devices_per_worker=8: 4 workers of 8 "
       r"devices each need 32 devices"),
      (dict(), ("--config.global_batch=8",),
       r"config.global_batch=8 gives 2 .* config.devices_per_worker=4"),
      (dict(devices_per_worker=0), (), r"config.devices_per_worker must be"),
      (dict(worker_layout="tensor"), (), r"config.worker_layout='tensor'")):
    with pytest.raises(ValueError, match=match):
      experiment_lib.Experiment(_config(*overrides, **kwargs))


def test_make_mesh_refuses_duplicate_and_foreign_devices():
  devices = require_devices(4)
  with pytest.raises(ValueError, match=r"devices\[2\] is .*, already "
                     r"devices\[0\]; give each device once"):
    parallel.make_mesh(3, devices=[devices[0], devices[1], devices[0]])
  with pytest.raises(ValueError, match=r"devices\[3\] is .*already devices\[1\]"):
    parallel.make_mesh(2, devices=devices[:3] + [devices[1]],
                       workers_per_device=2)
  with pytest.raises(ValueError, match=r"devices\[1\] must be a jax.Device "
                     r"\(e.g. from jax.devices\(\)\), got int 1"):
    parallel.make_mesh(2, devices=[devices[0], 1])
  with pytest.raises(ValueError, match=r"devices must be a sequence of "
                     r"jax.Device \(e.g. jax.devices\(\)\), got int"):
    parallel.make_mesh(2, devices=5)
  # Distinct devices in any order are used in that order.
  mesh = parallel.make_mesh(2, devices=[devices[3], devices[1]])
  assert list(mesh.devices.flat) == [devices[3], devices[1]]
