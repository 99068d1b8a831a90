"""Local SGD, DiLoCo, decentralized and Streaming DiLoCo against NumPy oracles.

Worker ``i`` minimises ``f_i(x) = ||x - b_i||^2 / 2`` (gradient ``x - b_i``)
with inner SGD; the oracles below re-implement each recursion in float64
NumPy from the papers' definitions, independently of the transforms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import quadratic_problem as _problem
from helpers import sync_args
from decentral_jax import optim
from decentral_jax.comm import compress
from decentral_jax import parallel
from decentral_jax import topology

LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9


def _run(tx, x0, targets, steps):
  """Trains stacked params ``x0`` [n, ...] (a dict); returns per-step params."""
  n = targets["a"].shape[0]
  mesh = parallel.make_mesh(n)

  def step(params, state, b):
    grads = jax.tree.map(lambda x, t: x - t, params, b)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(parallel.per_worker(step, mesh))
  init = jax.jit(parallel.per_worker(tx.init, mesh))
  params = parallel.shard(x0, mesh)
  b = parallel.shard(targets, mesh)
  state = init(params)
  out = []
  for _ in range(steps):
    params, state = step(params, state, b)
    out.append(jax.tree.map(np.asarray, jax.device_get(params)))
  return out, jax.device_get(state)


def _nesterov(g, trace):
  """optax.sgd(OUTER_LR, momentum, nesterov=True) as in its documentation."""
  trace = g + MOMENTUM * trace
  return -OUTER_LR * (g + MOMENTUM * trace), trace


def test_diloco_and_local_sgd_worked_example(x64):
  """2 workers, b = (+1, -1), theta_0 = 2, H = 2: the values computed by hand."""
  del x64
  require_devices(2)
  x0 = {"a": np.full((2, 1), 2.0)}
  b = {"a": np.array([[1.0], [-1.0]])}
  tx = optim.diloco(optax.sgd(LR), 2)
  traj, _ = _run(tx, x0, b, 6)
  theta = [traj[k]["a"][0, 0] for k in (1, 3, 5)]
  np.testing.assert_allclose(theta, [1.4946, 0.901455, 0.318730], atol=5e-7)
  assert np.all(traj[1]["a"] == traj[1]["a"][0])  # x_i <- theta on all
  traj, _ = _run(optim.local_sgd(optax.sgd(LR), 2), x0, b, 6)
  np.testing.assert_allclose([traj[k]["a"][0, 0] for k in (1, 3, 5)],
                             [1.62, 1.3122, 1.062882], atol=5e-7)


def _diloco_oracle(x0, b, h, steps, w=None):
  """DiLoCo (w=None) or decentralized DiLoCo with round matrices w(k)."""
  x = {k: v.copy() for k, v in x0.items()}
  theta = {k: v.copy() for k, v in x0.items()}
  trace = {k: np.zeros_like(v) for k, v in x0.items()}
  outer = 0
  out = []
  for t in range(1, steps + 1):
    x = {k: x[k] - LR * (x[k] - b[k]) for k in x}
    if t % h == 0:
      for k in x:
        if w is None:
          mixed = np.broadcast_to(x[k].mean(0), x[k].shape)
        else:
          mixed = np.einsum("ij,j...->i...", w(outer), x[k])
        step, trace[k] = _nesterov(theta[k] - mixed, trace[k])
        theta[k] = theta[k] + step
        x[k] = theta[k].copy()
      outer += 1
    out.append({k: v.copy() for k, v in x.items()})
  return out


def test_diloco_matches_numpy_oracle(x64):
  del x64
  require_devices(4)
  x0, b = _problem(4)
  got, state = _run(optim.diloco(optax.sgd(LR), 3), x0, b, 10)
  want = _diloco_oracle(x0, b, 3, 10)
  for g, w in zip(got, want):
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-12)
  assert int(np.asarray(state.outer.count)[0]) == 3
  theta = optim.global_params(state)
  np.testing.assert_allclose(np.asarray(theta["a"]), got[8]["a"], atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring", "one_peer_exp"])
def test_decentralized_diloco_matches_dense_oracle(name, x64):
  del x64
  require_devices(8)
  n = 8
  topo = topology.make(name, n)
  x0, b = _problem(n, seed=1)
  got, _ = _run(optim.diloco(optax.sgd(LR), 2, **sync_args(topology=topo)), x0,
                b, 9)
  want = _diloco_oracle(x0, b, 2, 9, w=topo.mixing_matrix)
  for g, w in zip(got, want):
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-12)
  assert not np.allclose(got[-1]["a"][0], got[-1]["a"][1])  # per-worker theta


@pytest.mark.slow
def test_equivalences(x64):
  """Outer SGD lr 1 = Local SGD; complete = DiLoCo; streaming(1, 0, 0) = DiLoCo."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=2)
  sgd1, _ = _run(optim.diloco(optax.sgd(LR), 3, outer=optax.sgd(1.0)), x0, b, 9)
  local, _ = _run(optim.local_sgd(optax.sgd(LR), 3), x0, b, 9)
  plain, _ = _run(optim.diloco(optax.sgd(LR), 3), x0, b, 9)
  complete, _ = _run(
      optim.diloco(optax.sgd(LR), 3,
                   **sync_args(topology=topology.make("complete", 4))),
      x0, b, 9)
  stream, _ = _run(optim.streaming_diloco(optax.sgd(LR), 3), x0, b, 9)
  for k in x0:
    np.testing.assert_allclose(sgd1[-1][k], local[-1][k], rtol=1e-14)
    np.testing.assert_array_equal(complete[-1][k], plain[-1][k])
    np.testing.assert_array_equal(stream[-1][k], plain[-1][k])


def _streaming_oracle(x0, b, h, steps, frags, tau, alpha):
  """Streaming DiLoCo from arXiv 2501.18512, written per leaf in NumPy."""
  p_count = max(frags.values()) + 1
  offsets = [p * h // p_count % h for p in range(p_count)]
  x = {k: v.copy() for k, v in x0.items()}
  theta = {k: v[0].copy() for k, v in x0.items()}
  trace = {k: np.zeros_like(v[0]) for k, v in x0.items()}
  sent = {}
  out = []
  for t in range(1, steps + 1):
    x = {k: x[k] - LR * (x[k] - b[k]) for k in x}
    for p in range(p_count):
      leaves = [k for k in x if frags[k] == p]
      if t % h == offsets[p] and t >= max(offsets[p], 1):
        sent[p] = {k: x[k].copy() for k in leaves}
      if (t - tau) % h == offsets[p] and t - tau >= max(offsets[p], 1):
        for k in leaves:
          step, trace[k] = _nesterov(theta[k] - sent[p][k].mean(0), trace[k])
          theta[k] = theta[k] + step
          x[k] = alpha * x[k] + (1 - alpha) * theta[k]
    out.append({k: v.copy() for k, v in x.items()})
  return out


@pytest.mark.parametrize("p_count,tau,alpha", [
    c if c == (3, 1, 0.3) else pytest.param(*c, marks=pytest.mark.slow)
    for c in [(1, 0, 0.0), (1, 2, 0.5), (2, 1, 0.0), (3, 1, 0.3),
              (3, 0, 1.0)]])
def test_streaming_diloco_matches_numpy_oracle(p_count, tau, alpha, x64):
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=3)
  frags = {"a": 0, "b": min(1, p_count - 1), "c": p_count - 1}
  tx = optim.streaming_diloco(optax.sgd(LR), 6, num_fragments=p_count,
                           fragments=frags, overlap_steps=tau,
                           merge_alpha=alpha)
  got, _ = _run(tx, x0, b, 20)
  want = _streaming_oracle(x0, b, 6, 20, frags, tau, alpha)
  for t, (g, w) in enumerate(zip(got, want)):
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-12,
                                 err_msg=f"step {t + 1} leaf {k}")


@pytest.mark.slow
def test_streaming_low_precision_pseudo_gradients():
  """bfloat16 on the wire, float32 sums: close to the float32 run."""
  require_devices(4)
  x0, b = _problem(4, seed=4)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  exact, _ = _run(optim.streaming_diloco(optax.sgd(LR), 4, num_fragments=2),
                  x0, b, 12)
  low, state = _run(optim.streaming_diloco(
      optax.sgd(LR), 4, num_fragments=2,
      **sync_args(comm_dtype=jnp.bfloat16)), x0, b, 12)
  for k in x0:
    assert low[-1][k].dtype == np.float32
    np.testing.assert_allclose(low[-1][k], exact[-1][k], rtol=0, atol=2e-2)
    assert not np.array_equal(low[-1][k], exact[-1][k])  # bf16 did round
  for theta in jax.tree.leaves(state.theta):  # equal on all workers
    assert theta.dtype == jnp.float32
    np.testing.assert_array_equal(theta, np.broadcast_to(theta[0], theta.shape))


def test_default_fragments_contiguous_and_balanced():
  params = {"a": np.zeros(10), "b": np.zeros(3), "c": np.zeros(100),
            "d": np.zeros(1)}
  assert optim.default_fragments(params, 1) == {"a": 0, "b": 0, "c": 0, "d": 0}
  assert optim.default_fragments(params, 4) == {"a": 0, "b": 1, "c": 2, "d": 3}
  assert optim.default_fragments(params, 2) == {"a": 0, "b": 0, "c": 0, "d": 1}
  even = {f"w{i}": np.zeros(5) for i in range(6)}
  ids = jax.tree.leaves(optim.default_fragments(even, 3))
  assert ids == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("make,match", [
    (lambda: optim.local_sgd(optax.sgd(1.0), 0), "sync_every"),
    (lambda: optim.diloco(optax.sgd(1.0), 2.5), "sync_every"),
    # Above int32 the step counters on the device cannot hold the period.
    (lambda: optim.diloco(optax.sgd(1.0), 2**31),
     "sync_every must be an int >= 1 and <= 2147483647, got 2147483648"),
    (lambda: optim.local_sgd(optax.sgd(1.0), 10**12), "sync_every"),
    (lambda: optim.ExactMean(3), "axis_name must be a mesh axis name"),
    (lambda: optim.ExactMean(""), "axis_name must be a mesh axis name"),
    (lambda: optim.compressed(compress.Compressor("int8"), False, 0.5,
                              "workers"),
     "error_decay=0.5 decays the error-feedback residual"),
    (lambda: optim.streaming_diloco(optax.sgd(1.0), 4, num_fragments=2,
                                 overlap_steps=2), "overlap_steps"),
    (lambda: optim.streaming_diloco(optax.sgd(1.0), 4, num_fragments=5),
     "num_fragments"),
    (lambda: optim.streaming_diloco(optax.sgd(1.0), 4, merge_alpha=1.5),
     "merge_alpha"),
    (lambda: optim.streaming_diloco(optax.sgd(1.0), 4,
                                    **sync_args(comm_dtype=jnp.int8)),
     "comm_dtype"),
])
def test_bad_arguments(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_fragments_and_missing_params():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
  tx = optim.streaming_diloco(optax.sgd(1.0), 4, num_fragments=2,
                           fragments={"a": 0, "b": 0})
  with pytest.raises(ValueError, match=r"fragments \[1\] have no"):
    tx.init(params)
  tx = optim.streaming_diloco(optax.sgd(1.0), 4, num_fragments=3)
  with pytest.raises(ValueError, match="num_fragments=3"):
    tx.init(params)
  tx = optim.diloco(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match="needs the current parameters"):
    tx.update(params, tx.init(params))


def _local_dsgd_oracle(x0, b, tau, steps, w):
  """x <- W_{k/tau} x at steps k % tau == 0 (else I), then a local SGD step."""
  x = {k: v.copy() for k, v in x0.items()}
  out = []
  for k in range(steps):
    for name in x:
      grad = x[name] - b[name]
      if k % tau == 0:
        x[name] = np.einsum("ij,j...->i...", w(k // tau), x[name])
      x[name] = x[name] - LR * grad
    out.append({name: v.copy() for name, v in x.items()})
  return out


@pytest.mark.slow
@pytest.mark.parametrize("tau", [1, 3])
def test_decentralized_with_gossip_every_matches_oracle(tau, x64):
  """Local D-SGD: gossip every tau steps; tau = 1 is today's D-SGD."""
  del x64
  from decentral_jax import optim  # pylint: disable=import-outside-toplevel
  require_devices(8)
  topo = topology.make("one_peer_exp", 8)
  x0, b = _problem(8, seed=5)
  x0 = {k: v + np.random.default_rng(6).normal(size=v.shape)
        for k, v in x0.items()}  # workers start apart
  got, _ = _run(optim.decentralized(optax.sgd(LR), topo, gossip_every=tau),
                x0, b, 8)
  want = _local_dsgd_oracle(x0, b, tau, 8, topo.mixing_matrix)
  for g, w in zip(got, want):
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-12)
  if tau == 1:  # bit for bit the transform without the argument
    plain, _ = _run(optim.decentralized(optax.sgd(LR), topo), x0, b, 8)
    for k in x0:
      np.testing.assert_array_equal(got[-1][k], plain[-1][k])
  with pytest.raises(ValueError, match="gossip_every"):
    optim.decentralized(optax.sgd(LR), topo, gossip_every=0)


# --------------------------------------------------------------------------
# comm_dtype: what goes on the wire of Local SGD and (decentralized) DiLoCo.
# --------------------------------------------------------------------------


def _wire(x):
  """``x`` rounded to bfloat16 (to nearest, ties to even) and back."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  return np.asarray(np.asarray(x, ml_dtypes.bfloat16), x.dtype)


def _low_precision_oracle(x0, b, h, steps, method, w=None):
  """The sync of ``method`` with bfloat16 on the wire, float64 elsewhere.

  local_sgd: ``x_i <- c(sum_j c(x_j) / n)``; diloco: ``Delta = c(sum_j
  c(theta - x_j) / n)``; gossip (decentralized DiLoCo with round matrices
  ``w(k)``): ``Delta_i = theta_i - (W_ii x_i + sum_{j != i} W_ij c(x_j))``;
  ``c`` the rounding to bfloat16.
  """
  x = {k: v.copy() for k, v in x0.items()}
  theta = {k: v.copy() for k, v in x0.items()}
  trace = {k: np.zeros_like(v) for k, v in x0.items()}
  outer, out = 0, []
  for t in range(1, steps + 1):
    x = {k: x[k] - LR * (x[k] - b[k]) for k in x}
    if t % h == 0:
      for k in x:
        n = x[k].shape[0]
        if method == "local_sgd":
          x[k] = np.broadcast_to(_wire(_wire(x[k]).sum(0) / n), x[k].shape)
          continue
        if method == "diloco":
          delta = _wire(_wire(theta[k] - x[k]).sum(0) / n)
          delta = np.broadcast_to(delta, x[k].shape)
        else:
          m = w(outer)
          off = m - np.diag(np.diag(m))
          mixed = (np.diag(m).reshape((n,) + (1,) * (x[k].ndim - 1)) * x[k]
                   + np.einsum("ij,j...->i...", off, _wire(x[k])))
          delta = theta[k] - mixed
        step, trace[k] = _nesterov(delta, trace[k])
        theta[k] = theta[k] + step
        x[k] = theta[k].copy()
      outer += 1
    out.append({k: np.array(v) for k, v in x.items()})
  return out


@pytest.mark.parametrize("method", ["local_sgd", *(
    pytest.param(m, marks=pytest.mark.slow)
    for m in ("diloco", "ring", "one_peer_exp"))])
def test_comm_dtype_rounds_what_is_sent_and_sums_wider(method, x64):
  """bfloat16 on the wire, float64 sums, against the NumPy recursion."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=7)
  if method == "local_sgd":
    tx = optim.local_sgd(optax.sgd(LR), 3, **sync_args(comm_dtype=jnp.bfloat16,
        timing=False))
    exact = optim.local_sgd(optax.sgd(LR), 3)
  else:
    topo = None if method == "diloco" else topology.make(method, 4)
    tx = optim.diloco(optax.sgd(LR), 3, **sync_args(topology=topo,
        comm_dtype=jnp.bfloat16))
    exact = optim.diloco(optax.sgd(LR), 3, **sync_args(topology=topo))
  got, _ = _run(tx, x0, b, 9)
  kind = method if method in ("local_sgd", "diloco") else "gossip"
  want = _low_precision_oracle(
      x0, b, 3, 9, kind, w=None if kind != "gossip" else topo.mixing_matrix)
  plain, _ = _run(exact, x0, b, 9)
  for t, (g, w) in enumerate(zip(got, want)):
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-12,
                                 err_msg=f"step {t + 1} leaf {k}")
      assert g[k].dtype == np.float64
  for k in x0:  # the wire dtype did change the result
    assert not np.allclose(got[-1][k], plain[-1][k], rtol=1e-9, atol=0)


@pytest.mark.slow  # an equivalence of two compiled runs
def test_diloco_comm_dtype_is_streaming_diloco_with_one_fragment():
  """Both send theta - x in bfloat16 and sum in float32: bit for bit."""
  require_devices(4)
  x0, b = _problem(4, seed=8)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  plain, state = _run(optim.diloco(optax.sgd(LR), 4,
                                   **sync_args(comm_dtype=jnp.bfloat16)),
                      x0, b, 12)
  stream, _ = _run(optim.streaming_diloco(
      optax.sgd(LR), 4, **sync_args(comm_dtype=jnp.bfloat16)), x0, b, 12)
  for k in x0:
    np.testing.assert_array_equal(plain[-1][k], stream[-1][k])
  for theta in jax.tree.leaves(state.theta):  # equal on all workers
    np.testing.assert_array_equal(theta, np.broadcast_to(theta[0], theta.shape))


@pytest.mark.parametrize("make", [
    lambda: optim.local_sgd(optax.sgd(1.0), 2, **sync_args(comm_dtype=jnp.int8,
        timing=False)),
    lambda: optim.diloco(optax.sgd(1.0), 2, **sync_args(comm_dtype="int32"))])
def test_comm_dtype_must_be_floating(make):
  with pytest.raises(ValueError, match="comm_dtype must be a floating dtype"):
    make()
