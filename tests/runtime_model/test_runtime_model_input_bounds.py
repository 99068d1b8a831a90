"""The runtime model's public entry points refuse what they cannot price, in
one line naming the argument: a :class:`Cluster` above the worker count its
pricing holds in memory, impossible inputs of the alpha-beta formulas, and
a :class:`Workload` field of another type or out of its domain.
Expected values are computed by hand from docs/runtime_model_formulas.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from decentral_jax.runtime_model import Cluster
from decentral_jax.runtime_model import Workload
from decentral_jax.runtime_model import closed_form
from decentral_jax.runtime_model import make_method
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import pair_exchange_time
from decentral_jax.runtime_model import ring_all_reduce_time
from decentral_jax.runtime_model.workload import MAX_BUCKETS
from decentral_jax.runtime_model.workload import MAX_COMPUTE_CV
from decentral_jax.runtime_model.workload import MAX_PARAMS
from decentral_jax.runtime_model.workload import MAX_SECONDS
from decentral_jax.tools.runtime_model_cli import inputs


@pytest.mark.parametrize("n", [4097, 8192, 2**31,
                               pytest.param(10**400, id="10**400")])
def test_cluster_refuses_more_workers_than_pricing_holds(n):
  # Pricing an All-Reduce keeps [n, n] member lists: 65536 would need
  # 32 GiB and 2**31 was killed for memory before this bound.
  with pytest.raises(ValueError) as info:
    Cluster(n, local_size=1)
  msg = str(info.value)
  assert msg.startswith("n_workers must be an int >= 1 and <= 4096, got ")
  assert "\n" not in msg


def test_cluster_bound_is_the_command_lines():
  assert costs.MAX_WORKERS == 4096 == inputs.MAX_WORKERS
  c = Cluster(4096, local_size=8)
  assert c.n_nodes == 512


@pytest.mark.parametrize("call, message", [
    (lambda: ring_all_reduce_time(8, -1e8, 1e-5, 1e9),
     "nbytes must be a finite number >= 0, got -100000000.0."),
    (lambda: ring_all_reduce_time(8, 1e8, -1.0, 1e9),
     "latency_s must be a finite number >= 0, got -1.0."),
    (lambda: ring_all_reduce_time(2.5, 1e8, 1e-5, 1e9),
     "p must be an int >= 1, got 2.5."),
    (lambda: ring_all_reduce_time(0, 1e8, 1e-5, 1e9),
     "p must be an int >= 1, got 0."),
    (lambda: ring_all_reduce_time(8, 1e8, 1e-5, float("nan")),
     "bandwidth_Bps must be a finite number > 0, got nan."),
    (lambda: ring_all_reduce_time(8, 1e8, 1e-5, 0),
     "bandwidth_Bps must be a finite number > 0, got 0."),
    (lambda: pair_exchange_time(1e8, 1e-5, -5),
     "bandwidth_Bps must be a finite number > 0, got -5."),
    (lambda: pair_exchange_time(-1e8, 1e-5, 1e9),
     "nbytes must be a finite number >= 0, got -100000000.0."),
    (lambda: pair_exchange_time(1e8, float("inf"), 1e9),
     "latency_s must be a finite number >= 0, got inf."),
])
def test_alpha_beta_helpers_refuse_impossible_inputs(call, message):
  with pytest.raises(ValueError) as info:
    call()
  assert str(info.value) == message


def test_alpha_beta_helpers_price_valid_inputs():
  # 2(p-1) a + 2(p-1)/p M / b with p=4, M=1e8, a=1e-5, b=1e9:
  # 6e-5 + 1.5 * 0.1 = 0.15006.
  assert ring_all_reduce_time(4, 1e8, 1e-5, 1e9) == pytest.approx(0.15006)
  assert ring_all_reduce_time(1, 1e8, 1e-5, 1e9) == 0.0
  assert pair_exchange_time(0, 1e-5, 1e9) == pytest.approx(1e-5)


def test_docs_state_the_worker_bound():
  import os  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  with open(os.path.join(root, "docs", "runtime_model.md")) as f:
    text = f.read()
  assert f"at most `MAX_WORKERS` = {costs.MAX_WORKERS}" in text
  assert f"at most `MAX_SECONDS` = {MAX_SECONDS:g}" in text
  assert f"at most `MAX_COMPUTE_CV` = {MAX_COMPUTE_CV:g}" in text
  assert f"at most `MAX_BUCKETS` = {MAX_BUCKETS}" in text


_BASE = dict(param_count=1.24e8, forward_s=0.05, backward_s=0.1)


@pytest.mark.parametrize("field, value", [
    ("bucket_shares", (float("nan"),)),
    ("bucket_shares", (0.5, 0.6)),
    ("bucket_shares", 1.0),
    ("bucket_shares", "1"),
    ("bucket_shares", ()),
    ("bucket_shares", ((0.5, 0.5),)),
    ("bucket_ready", (float("nan"),)),
    ("bucket_ready", 1.0),
    ("bucket_ready", ()),
    ("bucket_ready", (0.5, 0.4, 1.0)),
    ("bucket_ready", (0.5, float("inf"))),
    ("compute_samples_s", 0.5),
    ("compute_samples_s", "fast"),
    ("compute_samples_s", (0.1, float("nan"))),
    ("compute_samples_s", (0.1, True)),
    ("compute_samples_s", (0.1, 1e300)),
    ("forward_s", 1e300),
    ("backward_s", 86400.5),
    ("optimizer_s", float("inf")),
    ("compute_cv", 1e300),
    ("bucket_bytes", 1e-300),
    ("bucket_bytes", 0.5),
    ("bucket_bytes", 1e300),
    ("grad_dtype", np.float32(2.5)),
    ("param_dtype", 2),
    ("devices_per_worker", 10**400),
    ("worker_layout", np.array([1, 2])),
    ("gossip_in_flight", "01"),
    ("gossip_in_flight", (True, 0.5)),
], ids=repr)
def test_workload_refuses_a_bad_field_in_one_line_naming_it(field, value):
  # Before: NaN priced as iteration_s=nan, scalars and empty tuples escaped
  # as TypeError/IndexError/OverflowError, a number taken as a dtype.
  with pytest.raises(ValueError) as info:
    Workload(**{**_BASE, field: value})
  msg = str(info.value)
  assert msg.startswith(f"{field} "), msg
  assert "\n" not in msg and len(msg) < 300, msg


def test_workload_nan_share_message():
  with pytest.raises(ValueError) as info:
    Workload(**_BASE, bucket_shares=(float("nan"),))
  assert str(info.value) == ("bucket_shares must be 1 to 4096 fractions in "
                             "(0, 1] summing to 1, got (nan,).")


def test_workload_sequence_fields_are_stored_as_float_tuples():
  w = Workload(**_BASE, bucket_shares=np.array([0.25, 0.75]),
               bucket_ready=[0.5, 1], compute_samples_s=np.array([1, 3]),
               gossip_in_flight=[0, 1])
  assert w.bucket_shares == (0.25, 0.75) and w.bucket_ready == (0.5, 1.0)
  assert w.compute_samples_s == (1.0, 3.0) and w.gossip_in_flight == (0, 1)
  assert all(type(x) is float for x in w.bucket_shares + w.compute_samples_s)
  hash(w)  # a frozen dataclass of tuples
  assert w.compute_mean_s == 2.0 and w.compute_std_s == 1.0  # by hand


@pytest.mark.parametrize("spec", ["all_reduce", "dadam:topology=one_peer_exp"])
def test_workload_at_its_bounds_prices_finite_times(spec):
  c = Cluster(16, local_size=4)
  for w in (Workload(MAX_PARAMS, MAX_SECONDS, MAX_SECONDS, MAX_SECONDS,
                     compute_cv=MAX_COMPUTE_CV, bucket_bytes=1e9 * 2**20),
            Workload(0, 0, 0, bucket_bytes=1)):
    t = closed_form(make_method(spec, c), c, w).iteration_s
    assert math.isfinite(t) and t >= 0, (spec, w, t)


def test_inner_collectives_beyond_a_day_are_refused_in_one_line():
  # data layout, D = 2: the worker's gradients all-reduced over PCIe,
  # 2 (D - 1) / D * 4e15 bytes / 15.75e9 B/s = 253968 s, over a day.
  c = Cluster(16, local_size=4)
  w = Workload(1e15, 0.05, 0.1, devices_per_worker=2, worker_layout="data",
               bucket_bytes=1e15)
  with pytest.raises(ValueError) as info:
    closed_form(make_method("all_reduce", c), c, w)
  msg = str(info.value)
  assert msg.startswith("optimizer_s (0 s) plus ") and "\n" not in msg
  assert f"({4e15 / 15.75e9:.0f} s per step)" in msg and "a day" in msg
