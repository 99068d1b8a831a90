"""Library arguments: every public function refuses a bad one in one line naming it.

One table per package (topology, comm, optim, parallel, data, models): a
float where an int is expected, a bool, a negative or out-of-range value,
NaN, a string, an array where the value must be static, a wrong type. Each
call must raise ``ValueError`` at construction (or, for values only a traced
step sees, when it is first traced) with a one-line message containing the
phrase, which names the argument. The phrases are written by hand from the
rules in the docstrings, not read back from the code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from helpers import sync_args
from decentral_jax import checks
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.comm import collectives
from decentral_jax.comm import compress
from decentral_jax.comm import gossip
from decentral_jax.data import sharding
from decentral_jax.data import text
from decentral_jax.models import cnn
from decentral_jax.models import gpt
from decentral_jax.optim import muloco
from decentral_jax.optim import push_sum
from decentral_jax.parallel import layouts
from decentral_jax.parallel import multiprocess

NAN = float("nan")
SGD = optax.sgd(0.1)
PARAMS = {"a": jnp.zeros(2), "b": jnp.zeros(3)}


def _ring4():
  return topology.make("ring", 4)


def _case(phrase, call, name):
  return pytest.param(call, phrase, id=name)


TOPOLOGY = [
    _case("rounds[0][0] perm[1] must be an int >= 0 and <= 3, got 1.5",
          lambda: topology.from_permutations([[([0, 1.5, 2, 3], 1.0)]]),
          "from_permutations-float-entry"),
    _case("rounds[0][0] perm[3] must be an int >= 0 and <= 3, got True",
          lambda: topology.from_permutations([[([0, 1, 2, True], 1.0)]]),
          "from_permutations-bool-entry"),
    _case("rounds[0][1] perm[0] must be an int >= 0 and <= 1, got 2",
          lambda: topology.from_permutations(
              [[([0, 1], 0.5), ([2, 0], 0.5)]]),
          "from_permutations-out-of-range"),
    _case("rounds[0][0] weight must be a finite number, got 'half'",
          lambda: topology.from_permutations([[([0, 1], "half")]]),
          "from_permutations-string-weight"),
    _case("rounds[0][0] weight must be a finite number, got nan",
          lambda: topology.from_permutations([[([0, 1], NAN)]]),
          "from_permutations-nan-weight"),
    _case("rounds[0][0] must be a (perm, weight) pair",
          lambda: topology.from_permutations([[[0, 1]]]),
          "from_permutations-no-weight"),
    _case("n_workers must be an int >= 1, got 2.5",
          lambda: topology.complete(2.5), "complete-float"),
    _case("n_workers must be an int >= 1, got True",
          lambda: topology.exponential(True), "exponential-bool"),
    _case("n_workers must be an int >= 1, got 0",
          lambda: topology.static_ring(0), "static_ring-zero"),
    _case("n_workers must be an int >= 1, got 4.0",
          lambda: topology.one_peer_exp(4.0), "one_peer_exp-float"),
    _case("n_workers must be an int >= 1, got -2",
          lambda: topology.ring(-2), "ring-negative"),
    _case("n_workers must be an int >= 1, got 8.0",
          lambda: topology.alternating_exp_ring(8.0, 2), "aer-float"),
    _case("shape[0] must be an int >= 1, got 2.5",
          lambda: topology.torus(4, shape=(2.5, 1.6)), "torus-float-shape"),
    _case("torus shape must be a pair (rows, cols), got 4",
          lambda: topology.torus(4, shape=4), "torus-int-shape"),
    _case("topology 'ring' takes no argument shape",
          lambda: topology.make("ring", 4, shape=(2, 2)), "make-extra-kwarg"),
    _case("local_size must be an int >= 1, got True",
          lambda: topology.make("ring", 4, local_size=True), "make-bool-local"),
    _case("local_size must be an int >= 1, got 2.5",
          lambda: topology.Topology("x", _ring4().rounds, 2.5),
          "Topology-float-local"),
    _case("rounds[0] must be a topology.Round, got ndarray",
          lambda: topology.Topology("x", [np.eye(2)]), "Topology-matrix"),
    _case("step must be an int, got 1.5",
          lambda: _ring4().round(1.5), "round-float-step"),
    _case("step must be an int, got True",
          lambda: _ring4().mixing_matrix(True), "mixing_matrix-bool-step"),
    _case("atol must be a finite number >= 0.0, got -1.0",
          lambda: _ring4().has_finite_time_consensus(atol=-1.0),
          "finite_time-negative-atol"),
    _case("column_stochastic must be a bool (True or False), got 'yes'",
          lambda: topology.from_matrices([np.eye(2)], column_stochastic="yes"),
          "from_matrices-string-flag"),
    _case("groups[0][1] must be an int >= 0, got 1.5",
          lambda: topology.Partition.from_groups([[0, 1.5], [2, 3]]),
          "Partition-float-member"),
    _case("terms[0] has worker index 7 outside 0..3",
          lambda: topology.Round(self_weights=[0.5] * 4, terms=[
              topology.PermuteTerm([(0, 7)], [0.5] * 4)]),
          "Round-out-of-range-term"),
    _case("perm must be (source, destination) pairs of ints",
          lambda: topology.PermuteTerm([(0, 1.5)], [0.5, 0.5]),
          "PermuteTerm-float-pair"),
]

OPTIM = [
    _case("inner must be an optax.GradientTransformation",
          lambda: optim.decentralized("adam", _ring4()), "decentralized-inner"),
    _case("topology must be a decentral_jax.topology.Topology",
          lambda: optim.decentralized(SGD, "ring"), "decentralized-topology"),
    _case("mix_after_update must be a bool (True or False), got 'no'",
          lambda: optim.decentralized(SGD, _ring4(), mix_after_update="no"),
          "decentralized-string-flag"),
    _case("topology must be a decentral_jax.topology.Topology",
          lambda: optim.gossip_mixing("ring"), "gossip_mixing-topology"),
    _case("learning_rate must be a finite number >= 0, got nan",
          lambda: optim.decentralized_adamw(NAN, _ring4()), "dadam-nan-lr"),
    _case("weight_decay must be a finite number >= 0, got -0.1",
          lambda: optim.decentralized_adamw(1e-3, _ring4(), weight_decay=-0.1),
          "dadam-negative-decay"),
    _case("b1 must be a number in [0, 1), got '0.9'",
          lambda: optim.decentralized_adamw(1e-3, _ring4(), b1="0.9"),
          "dadam-string-b1"),
    _case("b2 must be a number in [0, 1), got False",
          lambda: optim.scale_by_accum_adam(b2=False), "accum_adam-bool-b2"),
    _case("b1 must be a finite number >= 0.0 and < 1.0, got 1.5",
          lambda: optim.horizon_matched_betas(1.5, 0.9, 2),
          "horizon_matched_betas-b1"),
    _case("b2 must be a finite number >= 0.0 and < 1.0, got nan",
          lambda: optim.horizon_matched_betas(0.9, NAN, 2),
          "horizon_matched_betas-nan-b2"),
    _case("inner must be an optax.GradientTransformation",
          lambda: optim.local_sgd("adam", 2), "local_sgd-inner"),
    _case("outer must be an optax.GradientTransformation",
          lambda: optim.diloco(SGD, 2, outer="nesterov"), "diloco-outer"),
    _case("topology must be a decentral_jax.topology.Topology",
          lambda: optim.diloco(SGD, 2,
                               **sync_args(topology="ring")),
                                   "diloco-topology"),
    _case("num_fragments must be an int >= 1 and <= 65536, got 2.5",
          lambda: optim.streaming_diloco(SGD, 4, num_fragments=2.5),
          "streaming-float-fragments"),
    _case("merge_alpha must be a finite number >= 0.0 and <= 1.0, got '0.5'",
          lambda: optim.streaming_diloco(SGD, 4, merge_alpha="0.5"),
          "streaming-string-alpha"),
    _case("num_fragments must be an int >= 1, got 1.5",
          lambda: optim.default_fragments(PARAMS,
                                          1.5), "default_fragments-float"),
    _case("fragments['a'] must be an int >= 0 and <= 1, got 0.0",
          lambda: optim.check_fragments({"a": 0.0, "b": 1}, PARAMS, 2),
          "check_fragments-float-id"),
    _case("integer and bool leaves cannot be averaged",
          lambda: optim.local_sgd(SGD, 2).init({"w": jnp.zeros(2),
                                             "step": jnp.zeros((), jnp.int32)}),
          "local_sgd-int-leaf"),
    _case("integer and bool leaves cannot be averaged",
          lambda: optim.streaming_diloco(SGD, 4).init({"m": jnp.zeros(2,
              bool)}),
          "streaming-bool-leaf"),
    _case("nesterov must be a bool (True or False), got 'yes'",
          lambda: push_sum.sgp(0.1, _ring4(), nesterov="yes"), "sgp-flag"),
    _case("momentum must be a number in [0, 1), got 1.5",
          lambda: push_sum.sgp(0.1, _ring4(), momentum=1.5), "sgp-momentum"),
    _case("learning_rate must be a finite number >= 0, got inf",
          lambda: push_sum.sgp(float("inf"), _ring4()), "sgp-inf-lr"),
    _case("inner must be an optax.GradientTransformation",
          lambda: push_sum.push_sum("sgd", _ring4()), "push_sum-inner"),
    _case("n_workers must be an int >= 1, got 2.5",
          lambda: push_sum.one_peer_directed_exp(2.5), "directed_exp-float"),
]


def _inject_merge_alpha():
  tx = optax.inject_hyperparams(
      optim.streaming_diloco,
      static_args=("inner", "sync_every", "num_fragments", "overlap_steps"))(
          inner=SGD, sync_every=4, merge_alpha=0.5)
  return tx.init(PARAMS)


OPTIM += [
    _case("merge_alpha must be a finite number >= 0.0 and <= 1.0, got an "
          "array; under optax.inject_hyperparams list 'merge_alpha' in "
          "static_args", _inject_merge_alpha, "streaming-inject-alpha"),
]

# A concrete array of several values is not a hyperparameter: refused by
# shape before its values could skip the range check (all are out of range).
TWO = np.array([-0.5, -0.5])
OPTIM += [_case(f"{name} must be a scalar{hint}, got an array of shape (2,)",
                call, f"array-{label}") for name, hint, call, label in [
    ("learning_rate", " or a schedule", lambda: optim.local_adamw(TWO),
     "adamw-lr"),
    ("b1", "", lambda: optim.local_adamw(1e-3, b1=TWO), "adamw-b1"),
    ("b2", "", lambda: optim.scale_by_accum_adam(b2=jnp.asarray(TWO)),
     "accum-b2"),
    ("eps", "", lambda: optim.scale_by_accum_adam(eps=TWO), "accum-eps"),
    ("weight_decay", "", lambda: optim.local_adamw(1e-3, weight_decay=TWO),
     "adamw-wd"),
    ("b2", "", lambda: optim.desloc_adam(1e-3, 1, 1, 1, b2=TWO), "desloc-b2"),
    ("momentum", "", lambda: push_sum.sgp(0.1, _ring4(), momentum=TWO),
     "sgp-momentum"),
    ("learning_rate", " or a schedule",
     lambda: muloco.muon_inner(jnp.asarray(TWO)), "muloco-lr")]]

GOSSIP_ONE = topology.make("ring", 1)
COMM = [
    _case("topology must be a decentral_jax.topology.Topology",
          lambda: gossip.mix(PARAMS, "ring", 0), "mix-topology"),
    _case("column_stochastic must be a bool (True or False), got 1",
          lambda: gossip.mix(PARAMS, GOSSIP_ONE, 0, column_stochastic=1),
          "mix-int-flag"),
    _case("step must be an int or a traced integer scalar, got True",
          lambda: gossip.mix(PARAMS, GOSSIP_ONE, True), "mix-bool-step"),
    _case("step must be an int or a traced integer scalar, got '1'",
          lambda: gossip.mix(PARAMS, _ring4(), "1"), "mix-string-step"),
    _case("step must be an int or a traced integer scalar, got None",
          lambda: gossip.mix(PARAMS, _ring4(), None), "mix-none-step"),
    _case("step must be an int or a traced integer scalar, got a float32 "
          "array of shape ()", lambda: gossip.mix(PARAMS, _ring4(),
                                                  jnp.float32(1)),
          "mix-float-array-step"),
    _case("step must be an int or a traced integer scalar, got None",
          lambda: compress.mix_compressed(PARAMS, _ring4(), None,
                                          compressor=compress.Compressor()),
          "mix_compressed-none-step"),
    _case("step must be an int or a traced integer scalar, got '1'",
          lambda: compress.mix_compressed(PARAMS, _ring4(), "1",
                                          compressor=compress.Compressor()),
          "mix_compressed-string-step"),
]

PARALLEL = [
    _case("n_workers must be an int >= 1, got 2.5",
          lambda: parallel.make_mesh(2.5), "make_mesh-float"),
    _case("local_size must be an int >= 1, got True",
          lambda: parallel.make_mesh(4, local_size=True), "make_mesh-bool-local"),
    _case("node_aware must be a bool (True or False), got 'yes'",
          lambda: parallel.make_mesh(4, 2, node_aware="yes"),
          "make_mesh-string-flag"),
    _case("workers_per_device must be an int >= 1, got 2.5",
          lambda: parallel.VirtualMesh(parallel.make_mesh(2), 2.5),
          "VirtualMesh-float"),
    _case("replicated_argnums[0] must be an int >= 0, got 1.5",
          lambda: parallel.per_worker(lambda x: x, parallel.make_mesh(2),
                                      replicated_argnums=(1.5,)),
          "per_worker-float-argnum"),
    _case("fn must be callable, got str",
          lambda: parallel.per_worker("step", parallel.make_mesh(2)),
          "per_worker-fn"),
    _case("mesh must be a jax.sharding.Mesh or parallel.VirtualMesh",
          lambda: parallel.shard({"a": np.zeros(2)}, "mesh"), "shard-mesh"),
    _case("worker must be an int >= 0, got -1",
          lambda: parallel.unstack({"a": np.zeros((4, 2))}, -1),
          "unstack-negative"),
    _case("worker must be an int >= 0, got 1.5",
          lambda: parallel.unstack({"a": np.zeros((4, 2))}, 1.5),
          "unstack-float"),
    _case("worker must be an int >= 0 and < 4",
          lambda: parallel.unstack({"a": np.zeros((4, 2))}, 9),
          "unstack-out-of-range"),
    _case("local_size must be an int >= 1, got 1.5",
          lambda: parallel.is_node_aware(topology.make("ring", 4), 1.5),
          "is_node_aware-float"),
    _case("devices_per_worker must be an int >= 1, got 2.5",
          lambda: layouts.inner_dim((8,), jnp.float32, 2.5),
          "inner_dim-float"),
    _case("split must be one of first, largest, got 'last'",
          lambda: layouts.inner_dim((8,), jnp.float32, 2, split="last"),
          "inner_dim-split"),
    _case("devices_per_worker must be an int >= 1, got 1.5",
          lambda: layouts.check_batch({"x": np.zeros((2, 4))}, 1.5),
          "check_batch-float"),
    _case("workers_per_node must be an int >= 1, got 0",
          lambda: multiprocess.check_node_layout(8, 0),
          "check_node_layout-zero"),
    _case("layout must be a layouts.WorkerLayout, got str",
          lambda: layouts.state_specs({"w": np.zeros((2, 4))},
                                      parallel.make_mesh(2), "fsdp"),
          "state_specs-layout"),
]

DATA = [
    _case("val_fraction must be a finite number > 0.0 and < 1.0, got '0.5'",
          lambda: text.byte_splits(b"abcd" * 10, val_fraction="0.5"),
          "byte_splits-string"),
    _case("chunk must be an int >= 1, got 0",
          lambda: text.max_token_id(np.arange(5), chunk=0),
          "max_token_id-zero-chunk"),
    _case("epoch must be an int >= 0, got 1.5",
          lambda: sharding.EpochSharder(16, 2, 2, 0).permutation(1.5),
          "permutation-float-epoch"),
]

MODELS = [
    _case("GPTConfig.vocab_size must be an int >= 1, got True",
          lambda: gpt.GPTConfig(vocab_size=True), "GPTConfig-bool-size"),
    _case("GPTConfig.bias must be a bool (True or False), got 'no'",
          lambda: gpt.GPTConfig(bias="no"), "GPTConfig-string-bias"),
    _case("GPTConfig.dropout must be a finite number >= 0.0 and < 1.0, got "
          "'0.1'", lambda: gpt.GPTConfig(dropout="0.1"),
          "GPTConfig-string-dropout"),
    _case("GPTConfig.dtype must be a floating dtype",
          lambda: gpt.GPTConfig(dtype=jnp.int32), "GPTConfig-int-dtype"),
    _case("cfg must be a GPTConfig, got dict",
          lambda: gpt.init_params({"n_layer": 2}, jax.random.key(0)),
          "gpt_init-cfg"),
    _case("CNN.features[1] must be an int >= 1, got 0",
          lambda: cnn.CNN(features=(32, 0)), "CNN-zero-feature"),
    _case("CNN.num_classes must be an int >= 1, got 2.5",
          lambda: cnn.CNN(num_classes=2.5), "CNN-float-classes"),
    _case("image_shape[1] must be an int >= 1, got 28.5",
          lambda: cnn.init_params(cnn.CNN(), jax.random.key(0), (28, 28.5, 1)),
          "cnn_init-float-shape"),
]


@pytest.mark.parametrize(
    "call, phrase", TOPOLOGY + OPTIM + COMM + PARALLEL + DATA + MODELS)
def test_bad_argument_is_one_line_naming_it(call, phrase):
  with pytest.raises(ValueError) as info:
    call()
  message = str(info.value)
  assert "\n" not in message, message
  assert phrase in message, message


# -- what a traced step sees: collectives, stacked arguments ------------------


def _traced(fn, n, k, x):
  """``fn(x, axis)`` per worker on ``n`` workers, ``k`` per device."""
  require_devices(n // k)
  mesh = parallel.make_mesh(n, workers_per_device=k)
  axis = parallel.worker_axis(mesh)
  step = jax.jit(parallel.per_worker(lambda a: fn(a, axis), mesh))
  return step(parallel.shard(x, mesh))


def _one_line(fn, *args) -> str:
  with pytest.raises(ValueError) as info:
    fn(*args)
  message = str(info.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("perm, phrase", [
    ([(0, 8)], "perm[0][1] must be an int >= 0 and <= 7, got 8"),
    ([(0, 1.5)], "perm[0][1] must be an int >= 0 and <= 7, got 1.5"),
    ([(-1, 0)], "perm[0][0] must be an int >= 0 and <= 7, got -1"),
    ([(0, 1), (2, 1)], "perm destinations must be distinct"),
    ([(0, 1), (0, 2)], "perm sources must be distinct"),
])
def test_permute_refuses_bad_pairs_on_real_and_virtual_workers(k, perm, phrase):
  x = jnp.arange(16.0).reshape(8, 2)
  message = _one_line(
      _traced, lambda a, axis: collectives.permute(a, axis, perm), 8, k, x)
  assert phrase in message, message


@pytest.mark.parametrize("k", [1, 2])
def test_all_to_all_names_the_leading_size(k):
  x = jnp.zeros((8, 5, 2))  # each worker holds [5, 2], not [8, 2]
  message = _one_line(_traced, collectives.all_to_all, 8, k, x)
  assert ("all_to_all: x has shape (5, 2); it needs a leading axis of "
          "size n=8" in message), message
  # The right size goes through: row j of worker i arrives as row i on j.
  rows = jnp.arange(8.0)[:, None] * 10 + jnp.arange(8.0)[None, :]
  out = np.asarray(_traced(collectives.all_to_all, 8, k, rows[..., None]))
  np.testing.assert_array_equal(out[..., 0], np.asarray(rows).T)


@pytest.mark.parametrize("k", [1, 2])
def test_stacked_array_not_placed_with_shard(k):
  require_devices(8 // k)
  mesh = parallel.make_mesh(8, workers_per_device=k)
  step = parallel.per_worker(lambda t: jax.tree.map(lambda a: a * 2, t), mesh)
  for x in (jnp.ones((8, 3)), np.ones((8, 3), np.float32)):
    message = _one_line(jax.jit(step), {"w": x})
    assert ("per_worker: argument 0 leaf \"['w']\" is not sharded over the "
            "worker axis" in message and "parallel.shard" in message), message
  # Placed with shard it runs, and replicated arguments are not checked.
  np.testing.assert_array_equal(
      jax.jit(step)({"w": parallel.shard(jnp.ones((8, 3)), mesh)})["w"],
      np.full((8, 3), 2.0))
  both = parallel.per_worker(lambda a, s: a * s, mesh, replicated_argnums=(1,))
  np.testing.assert_array_equal(
      jax.jit(both)(parallel.shard(jnp.ones((8, 3)), mesh), jnp.float32(3)),
      np.full((8, 3), 3.0))


def test_local_sgd_update_refuses_an_integer_leaf():
  """Also in update (a state built from other params): the message, not
  JAX's "cond branches must have equal output types"."""
  require_devices(4)
  mesh = parallel.make_mesh(4)
  tx = optim.local_sgd(SGD, 2)
  state = parallel.replicate(tx.init({"w": jnp.zeros(2)}), mesh)
  params = parallel.replicate({"w": jnp.zeros(2, jnp.int32)}, mesh)
  step = jax.jit(parallel.per_worker(lambda g, s, p: tx.update(g, s, p), mesh))
  message = _one_line(step, params, state, params)
  assert ("local_sgd: leaf \"['w']\" has dtype int32; integer and bool "
          "leaves cannot be averaged") in message, message


def test_diloco_init_refuses_a_complex_leaf_by_name():
  dtype = jnp.complex64
  tx = optim.diloco(SGD, 2)
  with pytest.raises(ValueError) as e:
    tx.init({"b": jnp.zeros(2), "z": {"w": jnp.zeros(2, dtype)}})
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("diloco: parameter leaf \"['z']['w']\" has dtype "
                            "complex"), message
  assert "two real leaves" in message
  tx.init({"b": jnp.zeros(2), "w": jnp.zeros(2, jnp.bfloat16)})  # real: fine


# -- the shared rules themselves ----------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: checks.check_int("n", 2.0, minimum=1),
     "n must be an int >= 1, got 2.0."),
    (lambda: checks.check_int("n", True), "n must be an int, got True."),
    (lambda: checks.check_int("n", 9, minimum=0, maximum=7),
     "n must be an int >= 0 and <= 7, got 9."),
    (lambda: checks.check_float("lr", NAN, minimum=0.0, open_min=True),
     "lr must be a finite number > 0.0, got nan."),
    (lambda: checks.check_probability("p", 1.5),
     "p must be a finite number >= 0.0 and <= 1.0, got 1.5."),
    (lambda: checks.check_choice("mode", "tensor", ("fsdp", "data")),
     "mode must be one of fsdp, data, got 'tensor'."),
    (lambda: checks.check_choice("tracker", "x", ("", "wandb")),
     "tracker must be one of '' (unset), wandb, got 'x'."),
    (lambda: checks.check_bool("flag", 1),
     "flag must be a bool (True or False), got 1."),
    (lambda: checks.check_float_dtype("d", "int8"),
     "d must be a floating dtype or None, got 'int8'."),
    (lambda: checks.check_int("bucket_bytes", jnp.int32(4), minimum=0),
     "bucket_bytes must be an int >= 0, got an array; under "
     "optax.inject_hyperparams list 'bucket_bytes' in static_args (optax "
     "takes callables, dtype classes included, for schedules)."),
])
def test_shared_checks_messages(call, message):
  with pytest.raises(ValueError) as info:
    call()
  assert str(info.value) == message


def test_shared_checks_return_python_values():
  assert type(checks.check_int("n", np.int64(3))) is int  # pylint: disable=unidiomatic-typecheck
  assert checks.check_bool("b", np.bool_(True)) is True
  assert checks.check_float("x", 1) == 1.0
  assert checks.check_float_dtype("d", "bfloat16") == jnp.bfloat16
  assert checks.check_float_dtype("d", None) is None


def test_float_dtype_accepts_scalar_types_and_refuses_arrays():
  # A scalar type (np.float16, ml_dtypes' bfloat16) is a dtype, not an array.
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  assert checks.check_float_dtype("d", np.float16) == np.dtype("float16")
  assert checks.check_float_dtype("d", np.float64) == np.dtype("float64")
  assert checks.check_float_dtype("d", ml_dtypes.bfloat16) == jnp.bfloat16
  with pytest.raises(ValueError) as info:
    checks.check_float_dtype("d", np.int32)
  assert str(info.value) == ("d must be a floating dtype or None, got "
                             "<class 'numpy.int32'>.")
  for array in (np.zeros(2, np.float16), jnp.zeros((), jnp.float32)):
    with pytest.raises(ValueError, match="got an array; under optax"):
      checks.check_float_dtype("d", array)


# -- buffers an overlapped outer step must hold -------------------------------


@pytest.mark.parametrize("build, held", [
    (lambda t: optim.diloco(SGD, 2**26 // t.latency, timing=t), True),
    (lambda t: optim.diloco(SGD, 2**26 // t.latency + 1, timing=t), False),
    (lambda t: optim.streaming_diloco(SGD, 2**25 // t.latency,
                                      num_fragments=2, timing=t), True),
    (lambda t: optim.streaming_diloco(SGD, 2**25 // t.latency + 1,
                                      num_fragments=2, timing=t), False),
], ids=["diloco-at-limit", "diloco-above", "streaming-at-limit",
        "streaming-above"])
@pytest.mark.parametrize("timing", [optim.Delayed(1, trickle=True),
                                    optim.Delayed(4, trickle=False),
                                    optim.Eager(2)], ids=repr)
def test_in_flight_slices_bounded_at_construction(build, held, timing):
  """latency * sync_every (* fragments) <= 2**26: each in-flight buffer is
  [d, H, S] with S >= 1 (2**31 - 1 of either ran out of memory)."""
  if held:
    build(timing)
    return
  message = _one_line(build, timing)
  assert "latency x sync_every" in message and "67108864" in message, message


@pytest.mark.parametrize("period, timing", [
    (2**31 - 1, optim.Delayed(1, trickle=True)), (2**31 - 1, optim.Eager(1)),
    (2, optim.Delayed(2**31 - 1))])
def test_in_flight_refusal_names_the_values(period, timing):
  message = _one_line(lambda: optim.diloco(SGD, period, timing=timing))
  assert f"sync_every={period}" in message, message
  assert f"latency={timing.latency}" in message, message
  # Plain DiLoCo holds no buffer: the same period is accepted.
  optim.diloco(SGD, period)
  optim.diloco(SGD, 100000, timing=optim.Eager(8))


@pytest.mark.parametrize("args, phrase", [
    ((0, 1), "sync_every must be an int >= 1"),
    ((-4, 2), "sync_every must be an int >= 1"),
    ((4, 5), "num_fragments=5 must be in [1, sync_every=4]"),
    ((4, 0), "num_fragments must be an int >= 1 and <= 65536, got 0"),
    ((4, 2.0), "num_fragments must be an int >= 1"),
    # 2**30 fragments built a list of 2**30 offsets and never returned.
    ((2**31 - 1, 2**30), "num_fragments must be an int >= 1 and <= 65536, "
     "got 1073741824")])
def test_fragment_offsets_checks_its_arguments(args, phrase):
  # (0, 1) divided by zero, (4, 5) gave [0, 0, 1, 2, 3], (-4, 2) [0, -2].
  from decentral_jax.optim import streaming_sync
  assert phrase in _one_line(streaming_sync.fragment_offsets, *args)
  # p H // P by hand: distinct offsets in [0, H).
  assert streaming_sync.fragment_offsets(4, 2) == [0, 2]
  assert streaming_sync.fragment_offsets(5, 3) == [0, 1, 3]
  assert streaming_sync.fragment_offsets(4, 4) == [0, 1, 2, 3]


# -- axis names: by type at construction, against the mesh when traced --------


@pytest.mark.parametrize("build", [
    lambda ax: optim.gossip_mixing(topology.make("one_peer_exp", 4), ax),
    lambda ax: optim.decentralized_adamw(0.1, topology.make("ring", 4),
                                         axis_name=ax),
    lambda ax: optim.sgp(0.1, optim.one_peer_directed_exp(4), axis_name=ax),
    lambda ax: optim.all_reduce_gradients(ax),
    lambda ax: optim.elastic_diloco(SGD, 2, axis_name=ax),
    lambda ax: optim.desloc_adam(0.1, 1, 2, 3, axis_name=ax),
    lambda ax: optim.gradient_tracking_sgd(0.1, topology.make("ring", 4),
                                           axis_name=ax),
    lambda ax: optim.pipelined_adamw(0.1, topology.make("ring", 4),
                                     axis_name=ax),
    lambda ax: optim.ExactMean(ax)],
    ids=["gossip_mixing", "decentralized_adamw", "sgp", "all_reduce",
         "elastic_diloco", "desloc_adam", "gradient_tracking", "pipelined",
         "ExactMean"])
@pytest.mark.parametrize("axis", [None, 1, "", (), ("nodes", 2)], ids=repr)
def test_axis_name_refused_by_type_at_construction(build, axis):
  # None and 1 failed later as "'NoneType' object is not iterable".
  message = _one_line(build, axis)
  assert "axis_name must be a mesh axis name" in message, message
  assert repr(axis) in message, message


@pytest.mark.parametrize("make, axis", [
    (lambda: optim.diloco(SGD, 2, reduction=optim.ExactMean("nodes")),
     "nodes"),
    (lambda: optax.chain(SGD, optim.gossip_mixing(
        topology.make("one_peer_exp", 4), ("workers", "local"))), "local")])
def test_axis_the_mesh_lacks_is_named_when_traced(make, axis):
  # ExactMean("nodes") on a ("workers",) mesh: a bare AssertionError.
  require_devices(4)
  mesh = parallel.make_mesh(4)
  tx = make()
  p = parallel.replicate({"w": jnp.ones(3)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)

  def step(p, s):
    return tx.update(p, s, p)

  message = _one_line(jax.jit(parallel.per_worker(step, mesh)), p, s)
  assert f"the mesh has no axis {axis!r}" in message, message
  assert "('workers',)" in message, message


def test_an_axis_of_the_mesh_that_the_shard_map_does_not_map_is_named():
  """devices_per_worker=2: the mesh has an 'inner' axis over a worker's
  devices, which per_worker does not map; the message said the mesh had no
  axis 'inner' while listing it."""
  require_devices(8)
  mesh = parallel.make_mesh(4, devices_per_worker=2)
  tx = optax.chain(SGD, optim.all_reduce_gradients("inner"))
  p = parallel.replicate({"w": jnp.ones(3)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(p)
  message = _one_line(jax.jit(parallel.per_worker(
      lambda p, s: tx.update(p, s, p), mesh)), p, s)
  assert "the mesh's axis 'inner' is not mapped by this shard_map (it maps " \
      "('workers',)" in message, message


@pytest.mark.parametrize("kwargs, says", [
    ({"device": "workers", "per_device": 0}, "per_device must be an int >= 1"),
    ({"device": "workers", "per_device": 2.0}, "per_device must be an int"),
    ({"device": "", "per_device": 2}, "device must be a non-empty axis name"),
    ({"device": "v", "per_device": 2, "virtual": "v"}, "are both 'v'")])
def test_virtual_axes_refuse_a_layout_they_cannot_name(kwargs, says):
  from decentral_jax.comm import axes  # pylint: disable=import-outside-toplevel
  assert says in _one_line(lambda: axes.VirtualAxes(**kwargs))


def test_virtual_axes_take_a_numpy_integer_as_the_other_integers_do():
  from decentral_jax.comm import axes  # pylint: disable=import-outside-toplevel
  v = axes.VirtualAxes("workers", np.int64(2))
  assert v == axes.VirtualAxes("workers", 2) and type(v.per_device) is int
  assert "got np.True_" in _one_line(
      lambda: axes.VirtualAxes("workers", np.bool_(True)))


def test_an_axis_named_twice_is_named_as_such():
  from decentral_jax.comm import axes  # pylint: disable=import-outside-toplevel
  assert _one_line(lambda: axes.check_axis_name(("a", "a"))) == (
      "axis_name=('a', 'a') names an axis twice; name each mesh axis once.")
