"""decentral_jax.tools.compare's pricing and answer: clusters, workloads,
loss targets, the recommendation per cluster, and the main job end to end."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from decentral_jax.tools.compare import answer
from decentral_jax.tools.compare import pricing
from decentral_jax.tools.compare import runs as runs_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(path="gpt_quick.py", *overrides):
  from decentral_jax.runner import config as config_lib
  return config_lib.load_config(os.path.join(ROOT, "configs", path),
                                list(overrides))


def _arms(methods, *overrides):
  return dict(runs_lib.arm_configs(_config("gpt_quick.py", *overrides), 4,
                                  True, runs_lib.select_runs(methods)))


# --- Pricing (tools/compare/pricing.py) ---


def test_time_to_target_interpolates_between_evaluations():
  steps, losses = [30, 60, 90], [2.0, 1.7, 1.5]
  # 1.6 lies halfway from 1.7 (step 60) to 1.5 (step 90).
  assert pricing.step_to_target(steps, losses, 1.6) == pytest.approx(
      75.0, rel=1e-12)
  assert pricing.time_to_target(steps, losses, 1.6, 10.0) == \
      pytest.approx(0.75, rel=1e-12)
  assert pricing.time_to_target(steps, losses, 1.4, 10.0) is None  # never
  assert pricing.step_to_target(steps, losses, 2.5) == 30.0  # first point
  assert pricing.step_to_target(steps, losses, 1.7) == 60.0  # exactly hit
  # A non-finite point is skipped: 2.0 is halfway from 3.0 (step 0) to 1.0
  # (step 20); the first crossing counts.
  assert pricing.step_to_target([0, 10, 20, 30, 40], [3.0, float("nan"),
                                                      1.0, 2.5, 0.5],
                                2.0) == 10.0
  assert pricing.step_to_target([], [], 1.0) is None
  with pytest.raises(ValueError, match="2 steps but 1 losses"):
    pricing.step_to_target([1, 2], [1.0], 1.0)
  # Three significant figures, ms below a second.
  assert [pricing.format_duration(s) for s in (
      0.0, 0.0004, 0.75, 4.0, 12.345, 59.99, 90.0, 9000.0)] == [
          "0 s", "0.400 ms", "750 ms", "4.00 s", "12.3 s", "1.00 min",
          "1.50 min", "2.50 h"]
  # 1234 h (4442400 s) and 999.6 h still three figures; 1e7 h in full.
  assert [pricing.format_duration(h * 3600.0) for h in (
      1234.0, 999.6, 1e7)] == ["1230 h", "1000 h", "10000000 h"]
  # No duration: NaN, infinite or negative seconds.
  for bad in (float("nan"), float("inf"), -float("inf"), -1.0, -1e-6):
    assert pricing.format_duration(bad) == "n/a"
  assert pricing.format_duration(-0.0) == "0 s"


def test_every_preset_is_accepted_at_a_gpu_count_it_holds():
  clusters = pricing.parse_clusters(
      "t4,A40,a100,H100_node,h100_ib,cross_region_2dc,cross_region_4dc",
      "gpt2_small")
  # docs/runtime_model.md, "Presets": 8 (T4, h100_ib) or 4 (A40, A100)
  # GPUs per node, priced at two nodes at least so that the inter-node
  # links count; h100_node is one node of 8; cross-region needs whole
  # nodes in each of 2 or 4 datacenters: multiples of 16 and 32.
  want = {"T4": 16, "A40": 8, "A100": 8, "h100_node": 8, "h100_ib": 16,
          "cross_region_2dc": 16, "cross_region_4dc": 32}
  assert {cl.label: pricing.priced_workers(cl, 8) for cl in clusters} == want
  assert {cl.label: pricing.priced_workers(cl, 4) for cl in clusters} == {
      **want, "h100_node": 4}
  assert {cl.label: pricing.priced_workers(cl, 24) for cl in clusters} == {
      "T4": 24, "A40": 24, "A100": 24, "h100_node": (
          "preset 'h100_node' has 8 GPUs; use at most 8 workers."),
      "h100_ib": 24,
      "cross_region_2dc": 48, "cross_region_4dc": 96}
  (node,) = pricing.parse_clusters("h100_node", "1b")
  assert "at most 8 workers" in pricing.priced_workers(node, 16)
  run = runs_lib.METHODS["dadam"]
  config = _arms("dadam", "--config.n_workers=16", "--config.global_batch=64"
                 )[run]
  assert "at most 8 workers" in pricing.predicted_ms(config, (node,), "1b")[
      "h100_node"]


def test_empty_cluster_entries_are_refused():
  assert pricing.parse_clusters("", "gpt2_small") == ()
  assert [c.label for c in pricing.parse_clusters(" A40 , h100_node ",
                                                  "gpt2_small")] == [
                                                      "A40", "h100_node"]
  for bad, entry in (("A40,,h100_node", 2), (",", 1), ("A40,", 2)):
    with pytest.raises(ValueError) as info:
      pricing.parse_clusters(bad, "gpt2_small")
    assert str(info.value).startswith(
        f"--clusters={bad!r}: entry {entry} is empty;"), str(info.value)


def test_cross_region_prices_follow_the_wide_area_link():
  arms = _arms("all_reduce,dadam,diloco")
  (wan,) = pricing.parse_clusters("cross_region_2dc", "gpt2_small")
  got = {run.name: pricing.predicted_ms(c, (wan,), "gpt2_small")[
      "cross_region_2dc"] for run, c in arms.items()}
  # gpt2_small: 124,439,808 float32 parameters, 6 N FLOPs per token x 16384
  # tokens at 40% of 989.4 TFLOP/s per step.
  compute_ms = 1e3 * 6 * 124_439_808 * 16384 / (0.4 * 989.4e12)
  assert compute_ms == pytest.approx(30.9, abs=0.05)
  m_bytes, wan_Bps, one_way_s = 4 * 124_439_808, 10e9 / 8, 0.030
  # All-Reduce: the gradient crosses the 10 Gbit/s uplink at least once
  # (half of it each way in a reduce-scatter and again in an all-gather:
  # M / b) after the backward, plus a one-way latency.
  floor_ms = compute_ms + 1e3 * (m_bytes / wan_Bps + one_way_s)
  assert got["all_reduce"] > floor_ms > 10 * compute_ms
  # DiLoCo (H = 10) sends the same All-Reduce once per 10 steps: its mean
  # step is the compute plus a tenth of All-Reduce's communication.
  assert got["diloco"] == pytest.approx(
      compute_ms + (got["all_reduce"] - compute_ms) / 10, rel=0.05)
  # Gossip every step sends the parameters over the uplink every step.
  assert got["diloco"] < got["dadam"] < got["all_reduce"]
  text = pricing.pricing_text((wan,), 8, "gpt2_small", {}, "gpt")
  assert "at 16 GPUs (30.9 ms of compute per step)" in text
  assert "GPT-2 small: 124M parameters" in text
  assert "a what-if, not a measurement" in text


def test_workload_flag_and_figure6_workload():
  assert pricing.check_workload("1b") == "1b"
  with pytest.raises(ValueError, match="--workload='2b' is neither a "
                     "workload name nor an existing file; use one of "
                     "gpt2_small, 1b, figure6, own or the path of a workload "
                     "file"):
    pricing.check_workload("2b")
  with pytest.raises(ValueError, match="'h100_ib' has no Figure 6 workload"):
    pricing.parse_clusters("A40,h100_ib", "figure6")
  run = runs_lib.METHODS["all_reduce"]
  config = _arms("all_reduce")[run]
  (a40,) = pricing.parse_clusters("A40", "figure6")
  # Figure 6, A40 at 8 GPUs, measured All-Reduce: 166.1 ms (the fitted
  # model's documented accuracy: within 20%).
  assert pricing.predicted_ms(config, (a40,), "figure6")["A40"] == \
      pytest.approx(166.1, rel=0.2)
  # The 1B workload's 100 ms of compute is a floor of every step.
  assert pricing.predicted_ms(config, (a40,), "1b")["A40"] > 100.0


def test_an_existing_workload_file_is_read_whatever_its_suffix(tmp_path):
  # A valid compiled-step workload file named without ".json" is a file,
  # as predict --workload-file reads it; a directory is named as such.
  import json
  path = str(tmp_path / "wl")
  with open(path, "w") as f:
    json.dump({"format": "decentral_jax.compiled_workload.v1",
               "param_count": 1000000,
               "compute_s": {"forward": 0.01, "backward": 0.02,
                             "optimizer": 0.001},
               "gossip_in_flight": {"forward": 1.0, "backward": 1.0},
               "param_dtype": "float32"}, f)
  assert pricing.check_workload(path) == path
  (a40,) = pricing.parse_clusters("A40", path)
  assert a40.workload_of(path) == path
  assert pricing.workload_label(a40, path).startswith(f"{path}: read from")
  with pytest.raises(ValueError, match=f"--workload: workload file "
                     f"{str(tmp_path)!r}: not readable JSON \\(is a directory"):
    pricing.check_workload(str(tmp_path))


def test_a_one_node_cluster_file_is_not_priced_across_nodes(tmp_path):
  # measure on one node of 4 devices: inter_pair_s null, NIC rate and
  # latency at the Cluster defaults. gpt_quick's 8 workers are priced at 8
  # GPUs = 8 / 4 = 2 nodes, over a link the file never measured: refused
  # before training, as predict refuses it; 4 workers fit the one node.
  from decentral_jax.runtime_model import cluster_file
  from decentral_jax.tools.compare import flags
  sizes = [1e6, 4e6, 16e6]
  one = {"sizes_bytes": sizes, "repeats": 3, "concurrent_flows": 4,
         "intra_pair_s": [5e-6 + m / 20e9 for m in sizes],
         "inter_pair_s": None, "inter_concurrent_s": None,
         "all_reduce_bytes": 4e6, "all_reduce_s": 0.01}
  path = str(tmp_path / "one.json")
  cluster_file.write(path, {
      "cluster": cluster_file.fit_links(one, 4, 4),
      "workload": {"param_count": 65e6, "forward_s": 0.03,
                   "backward_s": 0.06, "compute_cv": 0.1},
      "measurements": one, "meta": {"devices": 4}})
  clusters = pricing.parse_clusters(path, "own")
  config = _config("gpt_quick.py")
  assert config.n_workers == 8
  with pytest.raises(ValueError) as info:
    flags.check_measured_links(clusters, config)
  msg = str(info.value)
  assert msg.startswith(f"--clusters entry {path!r} measured no inter-node "
                        "link") and "\n" not in msg, msg
  assert "at 8 GPUs (2 nodes)" in msg and "--nic-Gbps X" in msg, msg
  assert "--config.n_workers=4 (one node)" in msg, msg
  flags.check_measured_links(clusters, _config("gpt_quick.py",
                                               "n_workers=4"))
  flags.check_measured_links(pricing.parse_clusters("A40", "own"), config)


def _cluster_json(tmp_path, name="mine.json", workload=True) -> str:
  from decentral_jax.runtime_model import cluster_file
  from decentral_jax.runtime_model import paper
  c, _ = paper.setup("A40", 8)
  path = str(tmp_path / name)
  cluster_file.write(path, {
      "cluster": dataclasses.asdict(c),
      "workload": {"param_count": 1e6, "forward_s": 0.01,
                   "backward_s": 0.02, "compute_cv": 0.0} if workload
                  else None,
      "measurements": {}, "meta": {"devices": 8, "device_kind": "test"}})
  return path


def test_cluster_files_are_priced_with_their_measured_workload(tmp_path):
  path = _cluster_json(tmp_path)
  (cl,) = pricing.parse_clusters(f" {path} ", "1b")
  assert (cl.label, cl.path, cl.preset) == ("mine.json", path, None)
  arms = _arms("all_reduce,dadam")
  got = {run.name: pricing.predicted_ms(config, (cl,), "1b")
         for run, config in arms.items()}
  # By hand from the alpha-beta formulas: the file's A40 links at 8 GPUs (2
  # nodes x 4, tree), 1e6 float32 parameters (M = 4 MB, one 25 MiB bucket),
  # forward 10 ms + backward 20 ms, no variability (--workload does not
  # apply to a file).
  m_bytes, compute_s = 4e6, 0.03
  # All-Reduce: the two-level tree pays 2(L-1) intra + 2(q-1) inter
  # latencies, and its bytes are limited by the one flow per node across
  # (25 Gbit/s): 2(q-1)/q M / 3.125e9.
  all_reduce_s = (compute_s + 2 * 3 * 5e-6 + 2 * 1 * 30e-6
                  + 2 * (2 - 1) / 2 * m_bytes / 3.125e9)
  # DAdam: every gossip round hides behind the 30 ms of compute.
  assert 30e-6 + m_bytes / (7.37e9 / 4) < compute_s
  assert got == {
      "all_reduce": {"mine.json": pytest.approx(1e3 * all_reduce_s,
                                                rel=1e-9)},
      "dadam": {"mine.json": pytest.approx(1e3 * compute_s, rel=1e-9)}}
  assert "own measured workload" in cl.describe(8)
  os.makedirs(tmp_path / "b")
  other = _cluster_json(tmp_path / "b")
  assert [x.label for x in pricing.parse_clusters(
      f"{path},{other},T4", "gpt2_small")] == ["mine.json", other, "T4"]
  assert pricing.parse_clusters("", "gpt2_small") == ()
  for spec, match in (("A40,a40", "more than once"),
                      (f"{path},{path}", "more than once"),
                      (_cluster_json(tmp_path, "bare.json", False),
                       "no measured workload"),
                      ("nope", "neither a preset nor an existing file; give "
                       "comma-separated preset names \\(T4, A40, A100, "
                       "h100_node, h100_ib, cross_region_2dc, "
                       "cross_region_4dc\\)")):
    with pytest.raises(ValueError, match=match) as info:
      pricing.parse_clusters(spec, "gpt2_small")
    assert "--clusters" in str(info.value) and "\n" not in str(info.value)


def test_pricing_columns_name_what_cannot_be_priced():
  runs = [runs_lib.METHODS["all_reduce"], runs_lib.METHODS["dadam"]]
  finals = [(runs[0], {"eval/loss": 2.0}), (runs[1], None)]
  prices = {"all_reduce": {"A": 12.34, "B": "too few GPUs"},
            "dadam": {"A": 1.0, "B": 2.0}}
  clusters = (pricing.PricingCluster("A"), pricing.PricingCluster("B"))
  heads, cells, notes = pricing.pricing_columns(finals, prices, clusters)
  assert heads == ["predicted ms/step, A", "predicted ms/step, B"]
  assert cells == {"all_reduce": ["12.3", "-"], "dadam": ["-", "-"]}
  assert notes == ["Not priced on B ('-'): All-Reduce: too few GPUs"]


# --- The answer (tools/compare/answer.py) ---

LABELS = {"ar": "AR", "lo": "Local", "go": "Gossip"}


def test_targets_are_losses_every_run_reaches():
  curves = {"ar": [([0, 10, 20], [5.5, 3.0, 2.3])],
            "lo": [([0, 10, 20], [5.6, 3.2, 2.63]),
                   ([0, 10, 20], [5.4, 3.1, 2.6])]}
  # Floor: the highest of the lowest losses, 2.63; drop from the lowest
  # first loss, 5.4: 2.77; targets 2.63 + 0.1 * 2.77, + 0.05 * 2.77 and
  # + 0.02 * 2.77 (2.6854: not the floor, a run's lowest loss), rounded up
  # to 0.001.
  assert answer.common_targets(curves) == [2.907, 2.769, 2.686]
  # A curve that ends non-finite counts with its finite part: it reaches
  # nothing below 5.5, so that is the only common target.
  curves["lo"].append(([0, 10], [5.5, float("nan")]))
  assert answer.common_targets(curves) == [5.5]
  assert answer.common_targets({"x": [([0], [float("nan")])]}) == []


def test_no_target_when_a_method_never_gets_below_the_initial_loss(tmp_path):
  # As --config.steps=4 with diloco: its loss only rises before its first
  # sync, so the lowest loss it reaches is the shared initial loss 4.0.
  # Every run meets that at step 0: no target, no winner, no crash.
  curves = {"ar": [([0, 2, 4], [4.0, 3.5, 3.0])],
            "lo": [([0, 2, 4], [4.0, 4.1, 4.2])]}
  assert answer.common_targets(curves) == []
  prices = {"ar": {"fast": 10.0}, "lo": {"fast": 10.0}}
  clusters = (pricing.PricingCluster("fast"),)
  md, lines = answer.answer_markdown(clusters, curves, prices,
                                     {"ar": [3.0], "lo": [4.2]}, LABELS)
  assert lines == ["no common loss target below the initial loss (some run "
                   "never got below it), so no method is named"]
  assert "inf" not in md and "**" not in md
  png = answer.plot_frontier(clusters, curves, prices, LABELS, {"fast": 8},
                             str(tmp_path))
  assert open(png, "rb").read(4) == b"\x89PNG"
  # A target that only some runs meet at their first evaluation is kept:
  # seed 1 starts at 4.4, above the floor 4.2.
  curves["lo"].append(([0, 2, 4], [4.4, 4.3, 4.2]))
  curves["ar"].append(([0, 2, 4], [4.4, 3.6, 3.1]))
  assert answer.common_targets(curves) == [4.2]


def test_zero_times_and_ties_name_no_winner():
  labels = {"a": "A", "b": "B"}
  # Both at their first evaluation (0 s): a tie, no ratio, no "inf".
  zero = [answer.Entry("a", 0.0, 0.0, 0.0, 1),
          answer.Entry("b", 0.0, 0.0, 0.0, 1)]
  assert answer.verdict("c", zero, 4.0, labels) == (
      "c: no clear winner (tie): A and B reach loss 4.000 in 0 s each.")
  assert answer.short_verdict(zero, 4.0, labels) == \
      "to 4.000: no clear winner (tie)"
  # Equal times with one seed: no winner either.
  tie = [answer.Entry("a", 2.5, 2.5, 2.5, 1),
         answer.Entry("b", 2.5, 2.5, 2.5, 1)]
  assert answer.verdict("c", tie, 3.0, labels) == (
      "c: no clear winner (tie): A and B reach loss 3.000 in 2.50 s each.")
  assert answer.short_verdict(tie, 3.0, labels) == \
      "to 3.000: no clear winner (tie)"
  # Only the first is at 0 s: it is first, with no ratio.
  first = [answer.Entry("a", 0.0, 0.0, 0.0, 1),
           answer.Entry("b", 0.5, 0.5, 0.5, 1)]
  assert answer.short_verdict(first, 3.0, labels) == (
      "first to 3.000: A, at its first evaluation, before B")
  assert answer.verdict("c", first, 3.0, labels).startswith(
      "c: **A**, first to loss 3.000 in 0 s, at its first evaluation, "
      "before B (500 ms);")
  # A real margin: 3 s against 1 s.
  won = [answer.Entry("a", 1.0, 1.0, 1.0, 1),
         answer.Entry("b", 3.0, 3.0, 3.0, 1)]
  assert answer.short_verdict(won, 3.0, labels) == \
      "first to 3.000: A, 3.00x before B"


def test_every_method_tied_for_first_is_bold():
  # To loss 2.0: A and B at step 10 x 10 ms = 100 ms, C at step 20 (200 ms).
  curves = {"a": [([0, 10], [4.0, 2.0])], "b": [([0, 10], [4.0, 2.0])],
            "c": [([0, 20], [4.0, 2.0])]}
  labels, finals = {"a": "A", "b": "B", "c": "C"}, {k: [2.0] for k in "abc"}
  rows = answer.cluster_table("x", curves, {k: 10.0 for k in "abc"}, [2.0],
                              finals, labels).splitlines()[2:]
  assert rows == ["| A | 10.0 | **100 ms** | 2.0000 |",
                  "| B | 10.0 | **100 ms** | 2.0000 |",
                  "| C | 10.0 | 200 ms | 2.0000 |"]
  # B at 10.5 ms/step (105 ms) is second: only A is bold.
  rows = answer.cluster_table("x", curves, {"a": 10.0, "b": 10.5, "c": 10.0},
                              [2.0], finals, labels).splitlines()[2:]
  assert rows[:2] == ["| A | 10.0 | **100 ms** | 2.0000 |",
                      "| B | 10.5 | 105 ms | 2.0000 |"]


def test_final_loss_column_says_mean_only_with_seeds():
  curves = {"ar": [([0, 10], [4.0, 2.0])]}
  one = answer.cluster_table("c", curves, {"ar": 10.0}, [2.0],
                             {"ar": [2.0]}, {"ar": "AR"})
  assert one.startswith("| method | predicted ms/step | to loss <= 2.000 | "
                        "final loss |\n")
  two = answer.cluster_table("c", curves, {"ar": 10.0}, [2.0],
                             {"ar": [2.0, 2.5]}, {"ar": "AR"})
  assert "| final loss (mean of seeds) |\n" in two and "| 2.2500 |" in two


def _two_clusters():
  # Two curves per method (seeds); Local needs twice AR's steps, at a
  # fifth of its step time on the slow cluster and the same on the fast.
  curves = {"ar": [([0, 10, 20], [4.0, 3.0, 2.0]),
                   ([0, 10, 20], [4.0, 3.2, 2.0])],
            "lo": [([0, 20, 40], [4.0, 3.0, 2.0]),
                   ([0, 20, 40], [4.0, 3.0, 2.0])]}
  prices = {"ar": {"fast": 10.0, "slow": 500.0},
            "lo": {"fast": 10.0, "slow": 100.0}}
  return curves, prices


def test_rank_and_verdict_with_seeds():
  curves, prices = _two_clusters()
  ms = {k: v["slow"] for k, v in prices.items()}
  got = answer.rank(curves, ms, 2.0)
  # Loss 2.0 at step 20 (AR) and 40 (Local): 10 s and 4 s.
  assert [(e.name, e.mean_s, e.low_s, e.high_s, e.seeds) for e in got] == [
      ("lo", pytest.approx(4.0), pytest.approx(4.0), pytest.approx(4.0), 2),
      ("ar", pytest.approx(10.0), pytest.approx(10.0), pytest.approx(10.0),
       2)]
  assert answer.verdict("slow", got, 2.0, LABELS) == (
      "slow: **Local**, first to loss 2.000 in 4.00 s (seeds 4.00 s to "
      "4.00 s), 2.50x before AR (10.0 s); clear: outside the 2 seeds' "
      "spread.")
  # Loss 3.0: AR at step 10 and 10 + 0.2 / 1.2 x 10 (seeds), Local at 20,
  # on the fast cluster: 0.1 s, 0.1167 s and 0.2 s.
  ms = {k: v["fast"] for k, v in prices.items()}
  got = answer.rank(curves, ms, 3.0)
  assert [e.name for e in got] == ["ar", "lo"]
  assert got[0].low_s == pytest.approx(0.1) and \
      got[0].high_s == pytest.approx(0.35 / 3)
  assert answer.verdict("fast", got, 3.0, LABELS) == (
      "fast: **AR**, first to loss 3.000 in 108 ms (seeds 100 ms to 117 ms),"
      " 1.85x before Local (200 ms); clear: outside the 2 seeds' spread.")
  # Overlapping spreads: no clear winner.
  overlap = [answer.Entry("ar", 1.0, 0.8, 1.3, 3),
             answer.Entry("lo", 1.1, 0.9, 1.2, 3)]
  assert answer.verdict("c", overlap, 2.5, LABELS) == (
      "c: no clear winner: AR (800 ms to 1.30 s) and Local (900 ms to "
      "1.20 s) reach loss 2.500 within the seeds' spread.")
  # One seed: the margin, and the spread is unknown.
  single = [answer.Entry("ar", 1.0, 1.0, 1.0, 1),
            answer.Entry("lo", 1.5, 1.5, 1.5, 1)]
  assert answer.verdict("c", single, 2.5, LABELS) == (
      "c: **AR**, first to loss 2.500 in 1.00 s, 1.50x before Local (1.50 s); "
      "one seed, so the spread over seeds is unknown (--seeds=0,1,2 "
      "measures it).")
  assert answer.verdict("c", [], 2.5, LABELS) == \
      "c: no method could be priced here."


def test_unpriced_or_unreached_methods_are_left_out_of_the_ranking():
  curves = {"ar": [([0, 10], [4.0, 2.0])], "lo": [([0, 10], [4.0, 3.0])],
            "go": [([0, 10], [4.0, 1.0])]}
  ms = {"ar": 10.0, "lo": 10.0, "go": "does not fit"}
  assert [e.name for e in answer.rank(curves, ms, 2.5)] == ["ar"]


def test_answer_markdown_tables_and_recommendations(tmp_path):
  curves, prices = _two_clusters()
  clusters = (pricing.PricingCluster("fast"), pricing.PricingCluster("slow"))
  finals = {"ar": [2.0, 2.0], "lo": [2.0, 2.0]}
  md, lines = answer.answer_markdown(clusters, curves, prices, finals, LABELS)
  # Targets: floor 2.0 (every run's final loss), drop 2.0: 2.2, 2.1, 2.04.
  assert "Targets: validation loss 2.200, 2.100, 2.040;" in md
  assert ("| method | predicted ms/step | to loss <= 2.200 | to loss <= "
          "2.100 | to loss <= 2.040 | final loss (mean of seeds) |") in md
  # Slow cluster, loss 2.04: Local at step 20 + 0.96 x 20 = 39.2, x 0.1 s.
  assert ("| Local | 100.0 | **3.60 s (3.60 s-3.60 s)** | **3.80 s (3.80 s-"
          "3.80 s)** | **3.92 s (3.92 s-3.92 s)** | 2.0000 |") in md
  # Fast cluster: AR at steps 19.6 and 10 + 1.16 / 1.2 x 10 = 19.67 (mean
  # 19.63), x 10 ms.
  assert lines[0].startswith("fast: **AR**, first to loss 2.040 in 196 ms")
  assert lines[1].startswith("slow: **Local**, first to loss 2.040 in 3.92 s")
  assert md.count("Recommendation: ") == 2
  png = answer.plot_frontier(clusters, curves, prices, LABELS,
                             {"fast": 8, "slow": 16}, str(tmp_path))
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # The method that ends lowest is named when it is not the first.
  finals = {"ar": [1.5, 1.5], "lo": [2.0, 2.0]}
  _, lines = answer.answer_markdown(clusters, curves, prices, finals, LABELS)
  assert lines[1].endswith(" AR ends lowest (1.5000 after 10.0 s).")
  assert "ends lowest" not in lines[0]  # AR is first there


# --- experiments/compare.py end to end ---


def _env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")
         and not k.startswith("SLURM_")}
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.integration
def test_bad_flags_are_one_error_line_before_training(tmp_path):
  not_a_cluster = tmp_path / "other.json"
  not_a_cluster.write_text('{"schema": "other"}')
  cases = {("--clusters=nope",): ("'nope'", "neither a preset",
                                  "cross_region_2dc"),
           ("--clusters=/nonexistent.json",): ("'/nonexistent.json'",
                                               "measure"),
           (f"--clusters={not_a_cluster}",): ("expected \"schema\"",
                                              "Fix the file"),
           ("--workload=2b",): ("--workload='2b'", "gpt2_small"),
           ("--workload=figure6",): ("'h100_node' has no Figure 6",),
           ("--seeds=0,x",): ("--seeds", "'x' is not a seed"),
           ("--clusters=A40,,h100_node",): ("--clusters=", "entry 2 is empty"),
           ("--seeds=,",): ("--seeds=','", "entry 1 is empty")}
  procs = {args: subprocess.Popen(
      [sys.executable, "experiments/compare.py", *args,
       "--outdir", str(tmp_path / "out")], cwd=ROOT, env=_env(), text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in cases}
  for args, names in cases.items():
    _, err = procs[args].communicate(timeout=240)
    assert procs[args].returncode == 2, err[-3000:]
    assert "Traceback (most recent call last):\n  File \"" not in err or \
        "compare.py" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    for name in names:
      assert name in errors[0], (name, errors[0])
  assert not (tmp_path / "out").exists()  # nothing trained or written


@pytest.mark.integration
def test_end_to_end_answer_per_cluster(tmp_path):
  # A 1-layer model for 6 steps, two seeds; evaluations at 0, 3 and 6.
  outdir = tmp_path / "cmp"
  proc = subprocess.run(
      [sys.executable, "experiments/compare.py", "--methods=all_reduce,dadam",
       "--seeds=0,1", f"--clusters=h100_node,cross_region_2dc,"
       f"{_cluster_json(tmp_path)}", "--outdir", str(outdir),
       "--config.steps=6", "--config.eval_interval=3",
       "--config.eval_batches=1", "--config.model.n_layer=1",
       "--config.model.n_embd=16", "--config.model.n_head=2",
       "--config.schedule.warmup_steps=2"],
      cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  md = (outdir / "results.md").read_text()
  for cluster in ("h100_node", "cross_region_2dc", "mine.json"):
    assert f"### {cluster} (" in md
  assert md.count("Recommendation: ") == 3
  assert "**Workload (time per step): gpt2_small: GPT-2 small" in md
  assert "cross_region_2dc: 2 datacenters of h100_ib nodes, 10 Gbit/s and " \
      "30 ms between them, at 16 GPUs" in md
  assert "Reference check: no stored reference for this set-up" in md
  assert "ms/step |" not in md.replace("predicted ms/step", "")  # no CPU ms
  # The recommendations are printed, one per cluster.
  out = proc.stdout.splitlines()
  # mine.json is priced on its own measured workload, not gpt2_small.
  rec = out.index("recommendations (predicted, for workload gpt2_small; "
                  "cluster files: their own measured workload):")
  assert [x.split(":")[0].strip() for x in out[rec + 1:rec + 4]] == [
      "h100_node", "cross_region_2dc", "mine.json"]
  assert "run 4 of 4 (dadam_seed1)" in proc.stderr
  for run in ("all_reduce_seed0", "all_reduce_seed1", "dadam_seed0",
              "dadam_seed1"):
    assert (outdir / run / "metrics.jsonl").exists()
    assert not (outdir / run / "checkpoints").exists()  # off by default
  assert sorted(p.name for p in outdir.glob("*.png")) == [
      "loss_vs_predicted_time.png", "loss_vs_step.png"]


@pytest.mark.integration
def test_a_method_that_never_improves_gives_no_target_not_a_crash(tmp_path):
  # DiLoCo syncs every 10 steps: in 4 steps its averaged model stays at the
  # initial loss, so no target below it is common to every run.
  outdir = tmp_path / "cmp"
  proc = subprocess.run(
      [sys.executable, "experiments/compare.py",
       "--methods=all_reduce,diloco", "--clusters=h100_node",
       "--outdir", str(outdir), "--config.steps=4",
       "--config.eval_interval=2", "--config.eval_batches=1",
       "--config.model.n_layer=1", "--config.model.n_embd=16",
       "--config.model.n_head=2", "--config.schedule.warmup_steps=2"],
      cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  md = (outdir / "results.md").read_text()
  assert "None: no common loss target below the initial loss" in md
  assert "inf" not in md.replace("info", "") and "**" not in md.split(
      "## The answer")[1].split("## Details")[0]
  assert "no common loss target below the initial loss" in proc.stdout
  assert (outdir / "loss_vs_predicted_time.png").exists()


def test_each_cluster_names_the_workload_whose_compute_is_priced(
    tmp_path, monkeypatch):
  a40, h100 = pricing.parse_clusters("A40,h100_node", "own")
  assert pricing.check_workload("own") == "own"
  assert a40.workload_of("own") == "figure6"
  assert h100.workload_of("own") == "gpt2_small"
  assert pricing.workload_label(a40, "own") == \
      "figure6: the A40 GPUs' own fitted compute"
  assert pricing.workload_label(h100, "own") == "gpt2_small: H100 compute"
  assert pricing.workload_label(a40, "gpt2_small") == \
      "gpt2_small: H100 compute on A40 links"
  # Under own, A40 is priced with its Figure 6 compute, as --workload=figure6.
  config = _arms("all_reduce")[runs_lib.METHODS["all_reduce"]]
  assert pricing.predicted_ms(config, (a40,), "own") == \
      pricing.predicted_ms(config, (a40,), "figure6")
  curves, _ = _two_clusters()
  prices = {"ar": {"A40": 10.0, "h100_node": 500.0},
            "lo": {"A40": 10.0, "h100_node": 100.0}}
  titles = []
  monkeypatch.setattr("matplotlib.axes.Axes.set_title",
                      lambda self, text, **kw: titles.append(text))
  for workload, words in (("gpt2_small", "gpt2_small: H100 compute on A40 "
                           "links"), ("own", "figure6: the A40 GPUs' own "
                                      "fitted compute")):
    md, lines = answer.answer_markdown((a40, h100), curves, prices,
                                       {"ar": [2.0], "lo": [2.0]}, LABELS,
                                       {"A40": 8, "h100_node": 8}, workload)
    assert lines[0].startswith(f"A40: priced for {words}, **AR**"), lines[0]
    assert lines[1].startswith("h100_node: priced for gpt2_small: H100 "
                               "compute, **Local**"), lines[1]
    assert f"### A40 (8 GPUs, time per step for {words})" in md
    answer.plot_frontier((a40, h100), curves, prices, LABELS,
                         {"A40": 8, "h100_node": 8}, str(tmp_path), workload)
    assert titles[-2].startswith(f"A40, 8 GPUs (predicted; {words})\n")
    assert titles[-1].startswith("h100_node, 8 GPUs (predicted; gpt2_small: "
                                 "H100 compute)\n")
