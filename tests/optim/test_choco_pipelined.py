"""CHOCO-gossip, both orders (optim.choco): a float64 NumPy oracle of the
recursions with int8 and top-k messages, the worker mean on random data,
the identity compressor with gamma 1 against plain gossip bit for bit, a
resume mid-run, and pipelined CHOCO's permutes reading only the step's
inputs in the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.analysis import hlo
from decentral_jax.comm import compress
from decentral_jax.optim import choco
from decentral_jax.optim import transforms

LR = 0.1
STEPS = 6


def _problem(n, seed=0):
  """Worker i's least squares 0.5 ||A_i w + b - Y_i||^2 / rows."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, 5, 3))
  y = rng.normal(size=(n, 5, 2))
  x0 = {"b": rng.normal(size=(n, 2)), "w": rng.normal(size=(n, 2, 3))}
  return a, y, x0


def _np_grad(p, a, y):
  r = a @ p["w"].T + p["b"] - y
  return {"b": r.sum(0) / len(a), "w": r.T @ a / len(a)}


def _np_q(v, fmt, block):
  """deQ(Q(v)) written out: float32 blocks of ``block`` values (zero
  padded); int8: codes round(v / s) in [-127, 127], s = max|v| / 127 in
  float32; top-k: the largest magnitude of each block kept."""
  flat = np.asarray(v, np.float32).reshape(-1)
  pad = (-flat.size) % block
  blocks = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, block)
  if fmt == "int8":
    amax = np.abs(blocks).max(1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1))
    codes = np.clip(np.round(blocks / scale[:, None]), -127, 127)
    out = (codes.astype(np.float32) * scale[:, None]).astype(np.float32)
  else:
    keep = np.argmax(np.abs(blocks), axis=1)
    out = np.zeros_like(blocks)
    out[np.arange(len(blocks)), keep] = blocks[np.arange(len(blocks)), keep]
  return out.reshape(-1)[:v.size].reshape(v.shape).astype(np.float64)


def _oracle(topo, fmt, block, gamma, pipelined, n, steps=STEPS):
  """Both recursions of optim.choco, per worker and leaf, in float64."""
  a, y, x = _problem(n)
  w_mat = topo.mixing_matrix(0)
  x_hat = {k: np.zeros_like(v) for k, v in x.items()}
  s = {k: np.zeros_like(v) for k, v in x.items()}
  out = []
  for _ in range(steps):
    g = [_np_grad({k: x[k][i] for k in x}, a[i], y[i]) for i in range(n)]
    new = {}
    for k in x:
      u = -LR * np.stack([gi[k] for gi in g])
      sent = x[k] if pipelined else x[k] + u
      q = np.stack([_np_q(sent[i] - x_hat[k][i], fmt, block)
                    for i in range(n)])
      x_hat[k] = x_hat[k] + q
      s[k] = s[k] + np.einsum("ij,j...->i...", w_mat, q)
      new[k] = sent + (u if pipelined else 0) + gamma * (s[k] - x_hat[k])
    x = new
    out.append((x, dict(x_hat), dict(s)))
  return out


def _run(tx, n, steps=STEPS, start=None, dtype=jnp.float64):
  """``steps`` steps of ``chain(sgd(LR), tx)`` on the problem; ``start``:
  ``(params, state)`` to continue from. Returns the per-step
  ``(params, state)`` on the host and the last on the devices."""
  mesh = parallel.make_mesh(n)
  a, y, x0 = _problem(n)
  full = optax.chain(optax.sgd(LR), tx)

  def step(p, s, a, y):
    g = jax.grad(lambda q: 0.5 * jnp.sum(
        (a @ q["w"].T + q["b"] - y) ** 2) / a.shape[0])(p)
    u, s = full.update(g, s, p)
    return optax.apply_updates(p, u), s

  if start is None:
    p = parallel.shard(jax.tree.map(lambda v: jnp.asarray(v, dtype), x0),
                       mesh)
    s = jax.jit(parallel.per_worker(full.init, mesh))(p)
  else:
    p, s = start
  data = [parallel.shard(jnp.asarray(v, dtype), mesh) for v in (a, y)]
  fn = jax.jit(parallel.per_worker(step, mesh))
  out = []
  for _ in range(steps):
    p, s = fn(p, s, *data)
    out.append(jax.tree.map(np.asarray, (p, s)))
  return out, (p, s)


@pytest.mark.parametrize("pipelined", [True, False],
                         ids=["pipelined", "koloskova"])
@pytest.mark.parametrize("fmt,block,name,n,gamma", [
    ("int8", 4, "static_ring", 4, 0.6), ("topk", 3, "exponential", 8, 0.4)])
def test_matches_a_numpy_oracle(fmt, block, name, n, gamma, pipelined, x64):
  del x64
  require_devices(n)
  topo = topology.make(name, n)
  c = compress.Compressor(fmt, block, 1 / block if fmt == "topk" else None)
  tx = choco.choco_gossip(topo, c, gamma, parallel.worker_axis(
      parallel.make_mesh(n)), pipelined=pipelined)
  got, _ = _run(tx, n)
  want = _oracle(topo, fmt, block, gamma, pipelined, n)
  # top-k sends float32 values exactly: float64 rounding. int8's decoded
  # values differ from NumPy's by a float32 ulp (1.5e-8 here; its scale
  # and product as XLA fuses them): float32 rounding of the messages.
  tol = 1e-7 if fmt == "int8" else 1e-12
  for (p, s), (x, x_hat, nsum) in zip(got, want):
    state = s[1]
    for k in ("b", "w"):
      np.testing.assert_allclose(p[k], x[k], rtol=0, atol=tol)
      np.testing.assert_allclose(state.public[k], x_hat[k], rtol=0, atol=tol)
      np.testing.assert_allclose(state.neighbour_sum[k], nsum[k], rtol=0,
                                 atol=tol)
  # The two orders differ (the pipelined round lacks the step's update).
  other = _oracle(topo, fmt, block, gamma, not pipelined, n)
  assert np.abs(other[-1][0]["w"] - want[-1][0]["w"]).max() > 1e-3


def _random_walk(tx, n, x0, us):
  """``x_{t+1} = x_t + tx(u_t)`` for the given local steps ``us``."""
  mesh = parallel.make_mesh(n)

  def run(x, us):
    def body(carry, u):
      x, s = carry
      d, s = tx.update(u, s, x)
      return (x + d, s), None
    return jax.lax.scan(body, (x, tx.init(x)), us)[0][0]

  return np.asarray(jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(x0, mesh), parallel.shard(us, mesh)))


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_worker_mean_moves_only_by_the_mean_local_step(pipelined, x64):
  """Random parameters and local steps, 4-bit messages, gamma 0.3: after
  300 steps the mean is x_0's plus the sum of the mean steps."""
  del x64
  n = 6
  require_devices(n)
  rng = np.random.default_rng(11)
  x0 = rng.normal(size=(n, 13))
  us = 0.1 * rng.normal(size=(n, 300, 13))
  topo = topology.make("exponential", n)
  tx = choco.choco_gossip(topo, compress.Compressor("int4", 4), 0.3,
                          parallel.worker_axis(parallel.make_mesh(n)),
                          pipelined=pipelined)
  got = _random_walk(tx, n, x0, us)
  np.testing.assert_allclose(got.mean(0), x0.mean(0) + us.sum(1).mean(0),
                             rtol=0, atol=1e-10)
  assert np.var(got, 0).sum() < 0.5 * np.var(x0, 0).sum()  # it mixes


@pytest.mark.parametrize("name,n", [
    pytest.param("torus", 9, marks=pytest.mark.slow),
    pytest.param("exponential", 8, marks=pytest.mark.slow), ("complete", 4)])
def test_identity_with_gamma_one_is_plain_gossip_bit_for_bit(name, n, x64):
  """Koloskova's order is ``decentralized(sgd, mix_after_update=True)``,
  the pipelined one ``decentralized(sgd)``: every bit, random data of two
  shapes, three seeds, float64 and float32."""
  require_devices(n)
  topo = topology.make(name, n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  ident = compress.Compressor("none")
  for pipelined in (True, False):
    tx = optax.chain(optax.sgd(LR), choco.choco_gossip(
        topo, ident, 1.0, axis, pipelined=pipelined))
    ref = transforms.decentralized(optax.sgd(LR), topo, axis,
                                   mix_after_update=not pipelined)
    for seed, dtype in ((0, np.float64), (1, np.float64), (2, np.float32)):
      rng = np.random.default_rng(seed)
      x0 = {"a": rng.normal(size=(n, 7)).astype(dtype),
            "b": rng.normal(size=(n, 3, 5)).astype(dtype)}
      got, want = (_walk(t, mesh, x0) for t in (tx, ref))
      for k in x0:
        np.testing.assert_array_equal(got[k], want[k])
  del x64


def _walk(tx, mesh, x0, steps=4):
  """``steps`` steps of ``tx`` with the gradient ``sin(x)``."""
  def run(x):
    def body(_, carry):
      x, s = carry
      d, s = tx.update(jax.tree.map(jnp.sin, x), s, x)
      return optax.apply_updates(x, d), s
    return jax.lax.fori_loop(0, steps, body, (x, tx.init(x)))[0]

  return jax.tree.map(np.asarray, jax.jit(parallel.per_worker(run, mesh))(
      parallel.shard(x0, mesh)))


@pytest.mark.slow
def test_resume_mid_run_is_bit_exact():
  """Three steps, the state through host memory (as a checkpoint holds
  it), three more: the straight six-step run, bit for bit."""
  n = 8
  require_devices(n)
  mesh = parallel.make_mesh(n)
  tx = choco.choco_gossip(topology.make("exponential", n),
                          compress.Compressor("int8", 8), 0.5,
                          parallel.worker_axis(mesh), pipelined=True)
  full, _ = _run(tx, n, dtype=jnp.float32)
  first, last = _run(tx, n, steps=3, dtype=jnp.float32)
  host = jax.tree.map(np.asarray, last)
  rest, _ = _run(tx, n, steps=3, dtype=jnp.float32, start=jax.tree.map(
      lambda v: parallel.shard(jnp.asarray(v), mesh), host))
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(first + rest)):
    np.testing.assert_array_equal(a, b)


def _ancestors(instrs, name):
  """Names of every entry instruction ``name`` reads, transitively."""
  by_name = {i.name: i for i in instrs}
  seen, todo = set(), [name]
  while todo:
    ins = by_name.get(todo.pop())
    if ins is None:
      continue
    for op in hlo.operand_names(ins.operands):
      if op not in seen:
        seen.add(op)
        todo.append(op)
  return seen


@pytest.mark.parametrize("pipelined", [True, False])
def test_permutes_read_only_the_steps_inputs(pipelined):
  """In the compiled step (XLA:CPU) no collective-permute of pipelined
  CHOCO reads the data batch (through the gradient), so it can be in
  flight with the forward and backward; every one of Koloskova's order
  does."""
  n = 4
  require_devices(n)
  mesh = parallel.make_mesh(n)
  tx = optax.chain(optax.sgd(LR), choco.choco_gossip(
      topology.make("static_ring", n), compress.Compressor("int8", 4), 0.5,
      parallel.worker_axis(mesh), pipelined=pipelined))
  a, y, x0 = _problem(n)

  def step(p, s, a, y):
    g = jax.grad(lambda q: 0.5 * jnp.sum(
        (a @ q["w"].T + q["b"] - y) ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = parallel.shard(jax.tree.map(jnp.float32, x0), mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  data = [parallel.shard(jnp.asarray(v, jnp.float32), mesh) for v in (a, y)]
  text = jax.jit(parallel.per_worker(step, mesh)).lower(
      p, s, *data).compile().as_text()
  comps, entry, _ = hlo.parse_module(text)
  instrs = comps[entry]
  n_inputs = len(jax.tree.leaves((p, s)))
  data_params = {i.name for i in instrs if i.opcode == "parameter"
                 and int(i.operands) >= n_inputs}
  assert len(data_params) == 2, [i.operands for i in instrs
                                 if i.opcode == "parameter"]
  permutes = [i for i in instrs if hlo.collective_kind(i.opcode)
              == "collective-permute" and not i.opcode.endswith("-done")]
  # Two payload arrays (codes, scales) x two leaves x two ring neighbours.
  assert len(permutes) == 8, [i.opcode for i in instrs]
  reads_data = [bool(_ancestors(instrs, i.name) & data_params)
                for i in permutes]
  assert reads_data == [not pipelined] * len(permutes)
