"""Leave-one-cluster-out validation of the runtime model (Figure 6).

Each cluster's decentralized bars are predicted with its compute fitted to
its own All-Reduce bars only and the shared values (compute CV, NIC ports
per node) fitted on the other clusters. The acceptance (Exp and AER within
20%, orders as measured) holds for every bar except the ones
``holdout.DOCUMENTED`` lists and docs/runtime_model.md explains; the test
fails if one of those starts to pass (the docs would be stale) or another
one fails.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model import holdout
from decentral_jax.runtime_model import paper


@pytest.fixture(scope="module")
def table():
  return holdout.rows()


@pytest.mark.slow
def test_leave_one_cluster_out_acceptance_and_documented_failures(table):
  assert len(table) == 3 * 3 * 4  # clusters x GPU counts x methods
  bad = holdout.failures(table)
  documented = [b for b in bad if any(b.startswith(k)
                                      for k in holdout.DOCUMENTED)]
  assert bad == documented, "undocumented failures: " + "; ".join(
      b for b in bad if b not in documented)
  for key in holdout.DOCUMENTED:  # every documented failure still fails
    assert any(b.startswith(key) for b in bad), f"{key} passes now: update " \
        "holdout.DOCUMENTED and docs/runtime_model.md"
  # Stated in the docs: T4 and A100 Exp/AER bars within 13%, A40 Exp within
  # 20%, every fitted All-Reduce bar within 10%.
  for r in table:
    if r["method"] in holdout.DECENTRALIZED and r["cluster"] != "A40":
      assert abs(r["error"]) < 0.13, r
    if r["method"] == "one_peer_exp" and r["cluster"] == "A40":
      assert abs(r["error"]) < 0.2, r
    if r["method"] == "all_reduce":
      assert abs(r["error"]) < 0.10, r


@pytest.mark.slow
def test_acceptance_rejects_a_wrong_bar_and_a_wrong_order(table):
  broken = copy.deepcopy(table)
  for r in broken:
    if (r["cluster"], r["n"], r["method"]) == ("T4", 32, "aer"):
      r["simulated_ms"], r["error"] = 1.3 * r["measured_ms"], 0.3
    if (r["cluster"], r["n"], r["method"]) == ("A100", 32, "all_reduce"):
      r["simulated_ms"] = 30.0  # faster than Exp and AER, unlike measured
  msgs = holdout.failures(broken)
  assert any(m.startswith("T4 n=32 aer") for m in msgs)
  assert any(m.startswith("A100 n=32: order of all_reduce") for m in msgs)


@pytest.mark.slow
def test_folds_never_see_their_own_decentralized_bars():
  for target in holdout.CLUSTERS:
    corrupt = copy.deepcopy(holdout.FIG6_MS)
    for m in ("one_peer_exp", "aer", "sgp"):
      corrupt[target][m] = tuple(10 * x for x in corrupt[target][m])
    seen = holdout.visible(target, corrupt)
    assert seen == holdout.visible(target)
    assert set(seen[target]) == {"n", "all_reduce"}
    for other in holdout.CLUSTERS:
      if other != target:
        assert set(seen[other]) == {"n", *paper.VALIDATED}
    # The stored compute is what the All-Reduce bars alone give.
    fold = holdout.FOLDS[target]
    got = holdout.fit_compute(target, fold["shared"], seen)
    for key, want in fold["compute"].items():
      assert got[key] == pytest.approx(want, rel=0.02), (target, key)


@pytest.mark.slow
@pytest.mark.parametrize("target", holdout.CLUSTERS)
def test_shared_values_are_the_other_clusters_best_fit(target):
  fold = holdout.FOLDS[target]
  others = [c for c in holdout.CLUSTERS if c != target]
  assert sorted(fold["others"]) == sorted(others)
  bars = holdout.visible(target)
  best = _shared_loss(others, fold["shared"], fold["others"], bars)
  cv = fold["shared"]["compute_cv"]
  for changed in ([{"compute_cv": cv * f} for f in (0.8, 1.2)] +
                  [{"nics_per_node": k} for k in holdout.NICS_GRID
                   if k != fold["shared"]["nics_per_node"]]):
    loss = _shared_loss(others, {**fold["shared"], **changed},
                               fold["others"], bars)
    assert loss >= best * (1 - 1e-9), (target, changed, loss, best)


def _shared_loss(names, shared: dict, computes: dict, bars: dict) -> float:
  """Sum of squared log-errors over the All-Reduce, Exp and AER bars of ``names``."""
  total = 0.0
  for name in names:
    for m in paper.VALIDATED:
      pred = holdout.predict_ms(name, m, computes[name]["a_s"],
                                computes[name]["b_s"], shared["compute_cv"],
                                shared["nics_per_node"], "closed_form")
      total += float(np.sum((np.log(pred) - np.log(bars[name][m]))**2))
  return total


def test_one_published_link_per_node_cannot_produce_the_exp_bars():
  """Byte counts: Exp rounds that cross nodes send L x 260 MB per node.

  A40, 16 GPUs: 2 of 4 rounds cross, 4 x 260 MB each: 520 MB/iteration, at
  25 Gbit/s = 3.125 GB/s at least 166.4 ms, measured 97.4 ms. 32 GPUs: 3 of
  5 rounds, 624 MB/iteration, 199.7 ms vs 110.8. A100, 32 GPUs, 100 Gbit/s:
  624 MB at 12.5 GB/s = 49.9 ms vs 44.7 measured. Two links per node halve
  the bounds below the measurements.
  """
  cases = (("A40", 16, 166.4, 97.4), ("A40", 32, 199.68, 110.8),
           ("A100", 32, 49.92, 44.7))
  for name, n, bound, measured in cases:
    assert holdout.published_bound_ms(name, n, "one_peer_exp") == \
        pytest.approx(bound)
    assert measured < bound
    assert holdout.published_bound_ms(name, n, "one_peer_exp", 2) < measured
  # AER sends one 2-node mean per node every other step: 130 MB/iteration.
  assert holdout.published_bound_ms("A40", 16, "aer") == pytest.approx(41.6)


def test_cluster_uses_published_links_and_transport():
  t4 = holdout.cluster("T4", 32, 2)
  a40 = holdout.cluster("A40", 16, 2)
  assert (t4.local_size, t4.nic_bandwidth_Bps, t4.flow_bandwidth_Bps) == (
      8, 12.5e9, None)
  # TCP: one flow stays on one 25 Gbit/s port; the node has two.
  assert a40.flow_bandwidth_Bps == a40.nic_bandwidth_Bps == 3.125e9
  assert a40.inter_flow_Bps(1) == 3.125e9
  assert a40.nic_capacity_Bps() == 6.25e9
  # Exp's crossing round: 4 GPUs, 2 per rail (port): half a port each.
  assert (a40.rail(0), a40.rail(1), a40.rail(2), a40.rail(3)) == (0, 0, 1, 1)
  assert a40.inter_flow_Bps(2, rail=True) == pytest.approx(3.125e9 / 2)
  with pytest.raises(ValueError, match="unknown Figure 6 cluster"):
    holdout.cluster("V100", 8, 1)


@pytest.mark.slow
def test_cli_validate_prints_both_tables(table, monkeypatch, capsys):
  monkeypatch.setattr(holdout, "rows", lambda folds=None: table)
  monkeypatch.setattr(holdout, "insample_rows", lambda params=None: table)
  assert cli.main(["validate"]) == 0
  out = capsys.readouterr().out
  assert "leave-one-cluster-out" in out and "in-sample" in out
  assert f"{len(holdout.DOCUMENTED)} failure(s), " \
      f"{len(holdout.DOCUMENTED)} documented" in out
  assert np.isfinite([r["simulated_ms"] for r in table]).all()
