"""The runtime model's public functions refuse a bad argument in one line
naming it (as ``Cluster`` and ``Workload`` refuse their fields), before any
allocation or integral; messages are written by hand from the docstrings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax import runtime_model as rm
from decentral_jax import topology

C = rm.Cluster(8)
W = rm.Workload(param_count=10**6, forward_s=0.03, backward_s=0.06,
                compute_cv=0.1)


def refusal(call) -> str:
  with pytest.raises(ValueError) as info:
    call()
  assert "\n" not in str(info.value)
  return str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=10**9), "steps must be an int >= 1 and <= 100000, got "
     "1000000000."),
    (dict(steps=100.7, warmup=10), "steps must be an int >= 1 and <= 100000, "
     "got 100.7."),
    (dict(warmup=10.2), "warmup must be an int >= 0, got 10.2."),
    (dict(steps=50, warmup=50), "need 0 <= warmup < steps, got warmup=50, "
     "steps=50."),
    (dict(seed=0.5), "seed must be an int >= 0, got 0.5."),
    (dict(seed=-5), "seed must be an int >= 0, got -5."),
    (dict(seed=None), "seed must be an int >= 0, got None."),
    (dict(seed=[1, 2]), "seed must be an int >= 0, got [1, 2]."),
], ids=repr)
def test_simulate_names_a_bad_count_or_seed(kwargs, message):
  assert refusal(lambda: rm.simulate("all_reduce", C, W, **kwargs)) == message


def test_simulate_steps_bound_is_predicts():
  from decentral_jax.tools.runtime_model_cli import inputs
  assert inputs.MAX_STEPS == 100_000


@pytest.mark.parametrize("call, message", [
    (lambda: rm.closed_form("all_reduce", C, None),
     "w must be a runtime_model.Workload, got None."),
    (lambda: rm.simulate("all_reduce", C, {"param_count": 1}),
     "w must be a runtime_model.Workload, got an object of type dict."),
    (lambda: rm.bytes_per_iteration("all_reduce", C, None),
     "w must be a runtime_model.Workload, got None."),
    (lambda: rm.closed_form("all_reduce", "x", W),
     "c must be a runtime_model.Cluster, got an object of type str."),
    (lambda: rm.make_method("all_reduce", "x"),
     "c must be a runtime_model.Cluster, got an object of type str."),
    (lambda: rm.round_cost(C, None),
     "rnd must be a topology Round (an entry of Topology.rounds), got None."),
    (lambda: rm.round_cost(C, np.eye(8)),
     "rnd must be a topology Round (an entry of Topology.rounds), got an "
     "object of type ndarray."),
    (lambda: rm.round_cost(None, topology.make("ring", 8).rounds[0]),
     "c must be a runtime_model.Cluster, got None."),
], ids=lambda x: x if isinstance(x, str) else "")
def test_wrong_object_is_named(call, message):
  assert refusal(call) == message


@pytest.mark.parametrize("m", [0, -3, 0.5, 2.5, True, float("nan"), None,
                               "x", 4097, 10**20], ids=repr)
def test_order_statistic_integrals_take_a_worker_count(m):
  for f in (rm.expected_max_normal, lambda m: rm.coupling_excess(m, 0.0)):
    assert refusal(lambda: f(m)).startswith(
        "m must be an int >= 1 and <= 4096, got ")


@pytest.mark.parametrize("s", [None, [1], float("nan")], ids=repr)
def test_coupling_excess_names_the_slack(s):
  assert refusal(lambda: rm.coupling_excess(4, s)).startswith(
      "slack_sigmas must be a finite number, got ")


def test_integrals_in_range_unchanged():
  # E[max of 2] = 1/sqrt(pi), of 3 = 3/(2 sqrt(pi)) (closed forms).
  assert rm.expected_max_normal(1) == 0.0
  assert rm.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi),
                                                    rel=1e-6)
  assert rm.expected_max_normal(3) == pytest.approx(
      1.5 / math.sqrt(math.pi), rel=1e-6)
  # m = 2, s = 0: E[(Z_1 - Z_0)^+] with Z_1 - Z_0 ~ N(0, 2): sqrt(2/(2 pi)).
  assert rm.coupling_excess(2, 0.0) == pytest.approx(1 / math.sqrt(math.pi),
                                                     rel=1e-3)
  assert rm.coupling_excess(np.int64(1), np.float32(0.5)) == 0.0
