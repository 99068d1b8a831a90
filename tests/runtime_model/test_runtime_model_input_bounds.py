"""The runtime model's public entry points refuse what they cannot price, in
one line naming the argument: a :class:`Cluster` above the worker count its
pricing holds in memory, and impossible inputs of the alpha-beta formulas.
Expected values are computed by hand from docs/runtime_model_formulas.md.
"""

from __future__ import annotations

import pytest

from decentral_jax.runtime_model import Cluster
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import pair_exchange_time
from decentral_jax.runtime_model import ring_all_reduce_time
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
