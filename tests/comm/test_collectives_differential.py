"""Virtual workers against one worker per device, collective by collective.

Every public collective of :mod:`decentral_jax.comm.collectives` runs on
``make_mesh(n)`` (one worker per device: the ``jax.lax`` collectives) and on
``make_mesh(n, workers_per_device=K)`` for ``K`` in {2, 4, n}; the results
must have the same pytree, shapes and dtypes and the same bits, and a bad
argument must be refused with the same exception and message. The
one-worker-per-device values are checked against NumPy first, so the
reference itself is right.

Inputs are integer-valued (also in floating dtypes): every sum is then exact
in any order, and the bits must agree. Floating sums of arbitrary values may
differ in the last bits (a device adds its ``K`` workers first); that case
is bounded separately against a float64 NumPy sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax.comm import collectives

N = 8
KS = (2, 4, N)
DTYPES = ("int32", "bool", "bfloat16", "float32", "float64")
SHAPES = ((), (0,), (3,), (3, 5))
# Shifts that cross devices for every K, a partial permutation with a
# self-pair, and nothing at all.
PERMS = {
    "shift": tuple((i, (i + 1) % N) for i in range(N)),
    "shift3": tuple((i, (i + 3) % N) for i in range(N)),
    "partial": ((0, 5), (5, 0), (2, 2), (7, 1)),
    "none": (),
}


def _mesh(k):
  devices = require_devices(N)
  return parallel.make_mesh(N, devices=devices, workers_per_device=k)


def _inputs(dtype_name, shape, seed=0):
  """``x`` ``[n, *shape]``, ``rows`` ``[n, n, *shape]``, equal ``c``, ``ids``.

  ``ids`` (the worker indices) is never empty: XLA refuses to compile a
  ``shard_map`` whose operands are all zero-size and whose output has the
  worker index (a compiler limitation, unrelated to the collectives).
  """
  rng = np.random.default_rng(seed)
  lo, hi = (0, 2) if dtype_name == "bool" else (-8, 9)
  x = rng.integers(lo, hi, size=(N,) + shape)
  rows = rng.integers(lo, hi, size=(N, N) + shape)
  c = np.broadcast_to(rng.integers(lo, hi, size=shape), (N,) + shape)
  dtype = jnp.dtype(dtype_name)
  # jnp arrays: a zero-size NumPy array does not go through device_put with
  # a sharding (a JAX limitation, unrelated to the collectives).
  return tuple(jnp.asarray(np.asarray(a).astype(dtype))
               for a in (x, rows, c)) + (jnp.arange(N),)


def _all_ops(x, rows, c, ids, axis):
  """Every public collective of one worker's arrays, in one traced function."""
  out = {
      "ids": ids,
      "psum": collectives.psum(x, axis),
      "pmean": collectives.pmean(x, axis),
      "all_gather": collectives.all_gather(x, axis),
      "all_to_all": collectives.all_to_all(rows, axis),
      "index": collectives.index(axis),
      "size": jnp.int32(collectives.size(axis)),
      "uniform": collectives.uniform(c),
      "tree_psum": collectives.psum({"a": x, "b": (x, None)}, axis),
      "tree_pmean": collectives.pmean([x], axis),
  }
  for name, perm in PERMS.items():
    out["permute_" + name] = collectives.permute(x, axis, perm)
  out["tree_permute"] = collectives.permute({"p": x}, axis, PERMS["shift"])
  return out


def _run(fn, k, *args):
  """``fn(*one_worker_args, axis)`` on every worker, stacked as host arrays."""
  mesh = _mesh(k)
  axis = parallel.worker_axis(mesh)
  out = jax.jit(parallel.per_worker(lambda *a: fn(*a, axis), mesh))(
      *parallel.shard(args, mesh))
  # A zero-size sharded array cannot be fetched (a JAX limitation); it has
  # no values, its shape and dtype are the output's.
  return jax.tree.map(lambda o: np.zeros(o.shape, o.dtype) if o.size == 0
                      else np.asarray(jax.device_get(o)), out)


@functools.lru_cache(maxsize=None)
def _cached(dtype_name, shape, k, x64):
  assert jax.config.jax_enable_x64 == x64
  return _run(_all_ops, k, *_inputs(dtype_name, shape))


def _numpy_reference(x, rows, c, ids):
  """The one-worker-per-device results worked out in NumPy (float64).

  Integer sums wrap around in their dtype (as XLA's), bool sums are int32.
  """
  x, rows, c = (np.asarray(a) for a in (x, rows, c))
  if x.dtype == np.bool_:
    total = x.sum(0, dtype=np.int32)
  elif np.issubdtype(x.dtype, np.integer):
    total = x.sum(0, dtype=x.dtype)
  else:
    total = x.astype(np.float64).sum(0)
  total = np.broadcast_to(total.astype(np.float64), x.shape)
  x, rows, c = (np.asarray(a, np.float64) for a in (x, rows, c))
  ref = {
      "psum": total, "pmean": total / N,
      "all_gather": np.broadcast_to(x[None], (N,) + x.shape),
      "all_to_all": np.swapaxes(rows, 0, 1),
      "ids": np.arange(N), "index": np.arange(N), "size": np.full(N, N), "uniform": c,
  }
  for name, perm in PERMS.items():
    got = np.zeros_like(x)
    for src, dst in perm:
      got[dst] = x[src]
    ref["permute_" + name] = got
  return ref


def _same_bits(got, want, where):
  assert type(got) is type(want), where
  assert jax.tree.structure(got) == jax.tree.structure(want), where
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    at = f"{where}{jax.tree_util.keystr(path)}"
    assert g.dtype == w.dtype, (at, g.dtype, w.dtype)
    assert g.shape == w.shape, (at, g.shape, w.shape)
    assert g.tobytes() == w.tobytes(), (at, g, w)


def _check(dtype_name, shape, k, x64=False):
  want = _cached(dtype_name, shape, 1, x64)
  ref = _numpy_reference(*_inputs(dtype_name, shape))
  for key, r in ref.items():
    np.testing.assert_array_equal(np.asarray(want[key], np.float64), r,
                                  err_msg=f"one worker per device: {key}")
  _same_bits(_cached(dtype_name, shape, k, x64), want,
             f"K={k} {dtype_name}{shape}")


def _x64_for(dtype_name):
  return dtype_name == "float64"


@pytest.fixture
def x64_if(request):
  """Float64 on for the float64 cases only."""
  on = _x64_for(request.node.callspec.params["dtype_name"])
  jax.config.update("jax_enable_x64", on)
  try:
    yield on
  finally:
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype_name", [
    d if d in ("int32", "float32") else pytest.param(d, marks=pytest.mark.slow)
    for d in DTYPES])
def test_every_collective_every_dtype(dtype_name, x64_if):
  _check(dtype_name, (3,), 4, x64_if)


@pytest.mark.parametrize("dtype_name", ["float32"])
@pytest.mark.parametrize("shape,k", [
    pytest.param((), N, marks=pytest.mark.slow),
    pytest.param((0,), 2, marks=pytest.mark.slow), ((3, 5), 2)])
def test_every_collective_shapes_and_k(dtype_name, shape, k, x64_if):
  _check(dtype_name, shape, k, x64_if)


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", DTYPES + ("int8", "uint8", "float16"))
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_collective_full_product(dtype_name, k, shape, x64_if):
  _check(dtype_name, shape, k, x64_if)


def test_pmean_of_integers_is_the_float_mean():
  """The reported case: int32 ``0..7`` averages to 3.5, not 3."""
  x = jnp.arange(N, dtype=jnp.int32)
  for k in (1,) + KS:
    got = _run(collectives.pmean, k, x)
    assert got.dtype == np.float32, k
    np.testing.assert_array_equal(got, np.full(N, 3.5, np.float32))


def _float_sums(dtype, k):
  """Arbitrary floats: same dtype; both within (n-1) ulps of the exact sum."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(N, 257)) *
                  rng.uniform(0.01, 100.0, size=(N, 1)), dtype)
  x64 = np.asarray(x, np.float64)
  exact = x64.sum(0)
  bound = (N - 1) * float(jnp.finfo(dtype).eps) * np.abs(x64).sum(0)
  for kk in (1, k):
    got = _run(lambda v, a: (collectives.psum(v, a),
                             collectives.pmean(v, a)), kk, x)
    for out, scale in zip(got, (1, N)):
      assert out.dtype == x.dtype, (kk, dtype)
      err = np.abs(np.asarray(out, np.float64) * scale - exact)
      assert np.all(err <= bound), (kk, dtype, np.max(err / bound))


def test_float_sums_within_rounding_of_the_exact_sum():
  _float_sums(jnp.float32, 2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k", KS)
def test_float_sums_within_rounding_all(dtype, k):
  _float_sums(dtype, k)


def test_special_values_move_exactly():
  """NaN, infinities and -0.0 through gather, permute and all_to_all."""
  special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, 3e38, -1.5],
                     np.float32)
  x = jnp.asarray(special)
  rows = jnp.asarray(np.stack([np.roll(special, i) for i in range(N)]))

  def moves(v, r, a):
    return (collectives.all_gather(v, a),
            collectives.permute(v, a, PERMS["shift3"]),
            collectives.all_to_all(r, a))

  want = _run(moves, 1, x, rows)
  np.testing.assert_array_equal(want[1], np.roll(special, 3))
  for k in KS:
    _same_bits(_run(moves, k, x, rows), want, f"K={k}")


def _refusal(fn, k, *args):
  try:
    _run(fn, k, *args)
  except (ValueError, TypeError) as e:
    return type(e), str(e)
  pytest.fail(f"K={k}: no error")


X = jnp.arange(N, dtype=jnp.float32)
OBJ = object()
BAD = {
    "all_to_all_wrong_rows": (
        lambda v, a: collectives.all_to_all(v, a),
        jnp.zeros((N, 3), jnp.float32), "leading axis of size n=8"),
    "all_to_all_scalar": (
        lambda v, a: collectives.all_to_all(v, a), X,
        "leading axis of size n=8"),
    "all_to_all_tree": (
        lambda v, a: collectives.all_to_all({"w": v}, a), X,
        "['w'] has shape ()"),
    "permute_out_of_range": (
        lambda v, a: collectives.permute(v, a, [(0, N)]), X, "<= 7"),
    "permute_negative": (
        lambda v, a: collectives.permute(v, a, [(0, -1)]), X, ">= 0"),
    "permute_float": (
        lambda v, a: collectives.permute(v, a, [(0, 1.5)]), X, "got 1.5"),
    "permute_bool": (
        lambda v, a: collectives.permute(v, a, [(True, 2)]), X, "got True"),
    "permute_triple": (
        lambda v, a: collectives.permute(v, a, [(0, 1, 2)]), X,
        "(source, destination) pair"),
    "permute_not_pairs": (
        lambda v, a: collectives.permute(v, a, 3), X, "sequence of"),
    "permute_two_sources": (
        lambda v, a: collectives.permute(v, a, [(0, 1), (0, 2)]), X,
        "sources must be distinct"),
    "permute_two_destinations": (
        lambda v, a: collectives.permute(v, a, [(0, 1), (2, 1)]), X,
        "destinations must be distinct"),
    "psum_string": (lambda v, a: collectives.psum("x", a), X, "collectives.psum"),
    "pmean_string_array": (
        lambda v, a: collectives.pmean(np.array(["a"]), a), X,
        "numeric or bool dtype"),
    "all_gather_object": (
        lambda v, a: collectives.all_gather({"o": OBJ}, a), X,
        "['o'] is object"),
    "permute_string": (
        lambda v, a: collectives.permute("s", a, [(0, 1)]), X,
        "collectives.permute"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_same_refusals(case):
  fn, x, needle = BAD[case]
  want = _refusal(fn, 1, x)
  assert needle in want[1], want
  assert "\n" not in want[1]
  ks = KS if case in ("all_to_all_wrong_rows", "permute_out_of_range") else (4,)
  for k in ks:
    assert _refusal(fn, k, x) == want, k


def test_group_mean_refuses_integers():
  mesh = _mesh(4)
  axis = parallel.worker_axis(mesh)
  groups = [tuple(range(N))]
  fn = parallel.per_worker(lambda v: collectives.group_mean(v, axis, groups),
                           mesh)
  with pytest.raises(ValueError, match="group_mean: x has dtype int32"):
    jax.jit(fn)(parallel.shard(jnp.arange(N, dtype=jnp.int32), mesh))
