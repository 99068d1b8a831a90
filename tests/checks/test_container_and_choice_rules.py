"""Two argument rules at the bottom layer and the functions that use them.

* A choice argument given an array (what ``optax.inject_hyperparams`` passes
  for a string it was not told is static) is refused naming the argument,
  its choices and ``static_args``, not with NumPy's "truth value of an
  array is ambiguous".
* A sequence argument that is not one (a number, None, a 0-d array) is
  refused naming it before anything iterates it.

Expected messages are written by hand from the docstrings.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decentral_jax import checks
from decentral_jax import optim
from decentral_jax import runtime_model
from decentral_jax import topology
from decentral_jax.comm import compress
from decentral_jax.comm.fault_schedule import FaultSchedule
from decentral_jax.topology import pairings

TWO = np.array(["a", "b"])


def refusal(call) -> str:
  with pytest.raises(ValueError) as info:
    call()
  message = str(info.value)
  assert "\n" not in message and "ambiguous" not in message
  return message


@pytest.mark.parametrize("call, start", [
    (lambda: checks.check_choice("mode", TWO, ("a", "b")),
     "mode must be one of a, b, got an array;"),
    (lambda: optim.scale_by_accum_adam(beta_convention=TWO),
     "beta_convention must be one of"),
    (lambda: compress.Compressor(format=np.array(["int8", "fp8"])),
     "format must be one of"),
    (lambda: optim.elastic_diloco(optax.sgd(0.1), 2,
                                  on_failure=np.array([0.1, 0.2])),
     "on_failure must be one of"),
    (lambda: runtime_model.Cluster(8, multi_node=np.array(["ring", "tree"])),
     "multi_node must be one of ring, tree, got an array;"),
    (lambda: runtime_model.Cluster(8, intra_link=np.array(["pcie", "x"])),
     "intra_link must be one of"),
    (lambda: topology.make("ring", 8).spectral_gap(TWO),
     "method must be one of auto, closed_form, dense, sparse, got an array;"),
    (lambda: topology.make("ring", 8).has_finite_time_consensus(
        method=jnp.array([1, 2])),
     "method must be one of auto, dense, random, got an array;"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_choice_given_an_array_names_the_argument(call, start):
  message = refusal(call)
  assert message.startswith(start), message
  assert "static_args" in message


def test_a_choice_still_takes_its_values():
  assert checks.check_choice("mode", "b", ("a", "b")) == "b"
  # W = (I + S + S^T) / 3 on 6: eigenvalues (1 + 2 cos(2 pi k / 6)) / 3,
  # the largest below 1 in modulus 2/3 (k = 1).
  assert topology.make("static_ring", 6).spectral_gap(
      "dense") == pytest.approx(1 / 3)


@pytest.mark.parametrize("value, got", [
    (5, "got 5."), (None, "got None."), (0.5, "got 0.5."),
    ("ab", "got 'ab'."), ({"a": 1}, "got {'a': 1}."),
    (np.array(0.5), "got an array of shape ()."),
])
def test_check_sequence_refuses_what_is_not_a_container(value, got):
  message = refusal(lambda: checks.check_sequence("xs", value, "a list of x"))
  assert message == f"xs must be a list of x, {got}"


def test_check_sequence_returns_a_list():
  assert checks.check_sequence("xs", (1, 2), "r") == [1, 2]
  assert checks.check_sequence("xs", iter([3]), "r") == [3]
  assert len(checks.check_sequence("xs", np.zeros((2, 3)), "r")) == 2
  with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
    checks.check_sequence("xs", np.zeros((2, 3)), "r", allow_array=False)


@pytest.mark.parametrize("events", [5, None, 0.5, np.float32(1),
                                    np.array(0.5)], ids=repr)
def test_fault_schedule_events_not_a_sequence_is_named(events):
  for build in (FaultSchedule, FaultSchedule.from_events):
    assert refusal(lambda: build(8, events)).startswith(
        "events must be a sequence of (worker, start, end, speed) tuples, "
        "got ")


def test_fault_schedule_events_as_a_tuple_still_work():
  s = FaultSchedule(4, ((1, 2, 4, 0.0),))
  assert s.alive(3).tolist() == [True, False, True, True]


@pytest.mark.parametrize("call, start", [
    (lambda: pairings.pair_schedule(5, 4), "pairings must be a list of"),
    (lambda: pairings.pair_schedule([5], 4), "pairings[0] must be a list of"),
    (lambda: pairings.pair_schedule([[5]], 4),
     "pairings[0][0] must be a group of one or two worker indices"),
    (lambda: topology.from_matrices(np.array(3.0)),
     "matrices must be a list of [n, n] mixing matrices"),
    (lambda: topology.from_permutations(jnp.array(0.1)),
     "from_permutations: rounds must be a list of rounds"),
    (lambda: topology.from_permutations(jnp.array([1, 2])),
     "from_permutations: rounds must be a list of rounds"),
    (lambda: topology.from_permutations(np.eye(4)),
     "from_permutations: rounds must be a list of rounds"),
    (lambda: topology.from_permutations([5]),
     "from_permutations: rounds[0] must be a list of"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_topology_sequences_not_containers_are_named(call, start):
  message = refusal(call)
  assert message.startswith(start), message


def test_topology_sequences_still_build():
  # Pairs (0 1)(2 3): W = blockdiag of [[.5, .5], [.5, .5]] twice.
  w = pairings.pair_schedule([[(0, 1), (2, 3)]], 4).mixing_matrix(0)
  np.testing.assert_allclose(w, np.kron(np.eye(2), np.full((2, 2), 0.5)))
  t = topology.from_permutations([[([0, 1], 0.5), ([1, 0], 0.5)]])
  np.testing.assert_allclose(t.mixing_matrix(0), np.full((2, 2), 0.5))
