"""Learners and synchronizer without Ray: the merge, the modes, bad peers.

The learners here run in threads of this process and call the synchronizer
directly (a :class:`~decentral_jax.tools.learners.learner.Link` of plain
calls); tests/tools/test_learners_ray.py runs the same classes as Ray
actors in their own processes.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np
import pytest

from conftest import require_devices
from helpers import spmd_diloco, spmd_quadratic
from decentral_jax.tools.learners import cluster
from decentral_jax.tools.learners import learner as learner_lib
from decentral_jax.tools.learners import main as main_lib
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib

LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9


def local_link(sync):
  return learner_lib.Link(lambda name, *args: getattr(sync, name)(*args))


def run_local(run, ids, timeout=60):
  sync = sync_lib.Synchronizer(run)
  learners = [learner_lib.Learner(run, i, local_link(sync)) for i in ids]
  deadline = time.monotonic() + timeout
  while sync.version < run.periods and time.monotonic() < deadline:
    time.sleep(0.01)
  status = [lrn.stop() for lrn in learners]
  sync.close()
  return sync, status


@pytest.mark.slow
def test_sync_mode_equals_diloco_in_one_program():
  """3 learners, H = 3, 4 periods, noisy targets: theta equals the
  one-program DiLoCo's parameters after its 12th step (float32 rounding)."""
  require_devices(3)
  run = spec_lib.RunSpec(shards=3, sync_every=3, periods=4, inner_lr=LR,
                         quorum=3)
  sync, status = run_local(run, range(3))
  assert sync.version == 4 and all(s["error"] is None for s in status)
  assert sync.log["merged_with"] == [[0, 1, 2]] * 4
  assert sync.log["tokens"] == [{"0": 3, "1": 3, "2": 3}] * 4
  want = spmd_diloco(3, 3, 4)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], rtol=2e-6, atol=2e-6)
  # Without the outer step (theta = mean of x) the answer differs.
  assert not np.allclose(sync.theta["a"], spmd_diloco(3, 3, 3)["a"],
                         atol=1e-3)


def _delta(value, like):
  return {k: np.full(v.shape, value, np.float32) for k, v in like.items()}


def test_decoupled_merge_waits_for_quorum_then_grace_and_weights_tokens():
  run = spec_lib.RunSpec(shards=3, mode="decoupled", quorum=2, grace_s=0.4,
                         periods=5)
  sync = sync_lib.Synchronizer(run)
  try:
    for i in range(3):
      sync.join(i, run.fingerprint())
    theta0 = {k: v.copy() for k, v in sync.theta.items()}
    assert sync.push(0, 0, _delta(1.0, theta0), 1) == "accepted"
    time.sleep(0.6)
    assert sync.version == 0  # one of a quorum of two: no merge
    assert sync.push(1, 0, _delta(4.0, theta0), 3) == "accepted"
    quorum_at = time.monotonic()
    time.sleep(0.15)
    assert sync.version == 0  # quorum met, grace window not over
    while sync.version == 0 and time.monotonic() < quorum_at + 10:
      time.sleep(0.01)
    assert sync.version == 1  # merged without learner 2
    assert time.monotonic() - quorum_at >= 0.4
    assert sync.log["merged_with"] == [[0, 1]]
    # Delta = (1*1 + 3*4)/4 = 3.25; Nesterov from a zero trace:
    # theta1 = theta0 - lr (1 + momentum) Delta.
    for k in theta0:
      np.testing.assert_allclose(sync.theta[k],
                                 theta0[k] - OUTER_LR * 1.9 * 3.25, rtol=1e-6)
    # All three active learners in: merged at once, no grace wait.
    for i in range(3):
      sync.push(i, 1, _delta(0.0, theta0), 1)
    time.sleep(0.1)
    assert sync.version == 2
    # A pseudo-gradient more than max_staleness = 2 merges old is dropped.
    sync.version = 4
    assert sync.push(0, 1, _delta(0.0, theta0), 1) == "stale"
  finally:
    sync.close()


BAD = [
    (lambda d: {**d, "a": d["a"][:2]}, "leaf 'a' has shape (2,)"),
    (lambda d: {**d, "b": d["b"].astype(np.float64)}, "leaf 'b' has dtype"),
    (lambda d: {**d, "c": np.full_like(d["c"], np.nan)}, "leaf 'c' holds NaN"),
    (lambda d: {**d, "c": np.full_like(d["c"], -np.inf)}, "leaf 'c' holds"),
    (lambda d: {"a": d["a"]}, "leaves ['a'] differ"),
]


def test_a_bad_pseudo_gradient_is_rejected_logged_and_never_merged(capsys):
  run = spec_lib.RunSpec(shards=1, mode="decoupled", grace_s=0.0)
  sync = sync_lib.Synchronizer(run)
  try:
    sync.join(0, run.fingerprint())
    theta0 = {k: v.copy() for k, v in sync.theta.items()}
    for bad, why in BAD:
      answer = sync.push(0, 0, bad(_delta(1.0, theta0)), 1)
      assert answer.startswith("rejected: ") and why in answer, answer
      assert f"learner 0 (version 0): {why}" in capsys.readouterr().err
    time.sleep(0.1)
    assert sync.version == 0 and sync.status()["pending"] == 0
    assert [r[0] for r in sync.log["rejected"]] == [0] * len(BAD)
    for k in theta0:
      np.testing.assert_array_equal(sync.theta[k], theta0[k])
  finally:
    sync.close()


def test_join_refuses_another_model_method_or_sharding_naming_the_field():
  run = spec_lib.RunSpec(shards=2)
  sync = sync_lib.Synchronizer(run)
  try:
    for field, value in [("sync_every", 8), ("shards", 4), ("inner", "adamw"),
                         ("problem_args", (("seed", 1),))]:
      other = spec_lib.RunSpec(**{**run.__dict__, field: value})
      with pytest.raises(spec_lib.JoinRefused, match=f"field '{field}'"):
        sync.join(1, other.fingerprint())
    with pytest.raises(spec_lib.JoinRefused, match="learner ids are 0..1"):
      sync.join(2, run.fingerprint())
    assert sync.status()["active"] == []
  finally:
    sync.close()


def test_dynamic_local_updates():
  assert learner_lib.local_updates(8, 1.0, 2.0) == 4
  assert learner_lib.local_updates(8, 0.9, 1.0) == 7  # floor(7.2)
  assert learner_lib.local_updates(8, 0.01, 1.0) == 1
  assert learner_lib.local_updates(8, 0.0, 0.0) == 8


@pytest.mark.slow
def test_a_slow_learner_takes_fewer_inner_steps_and_blocks_nobody():
  run = spec_lib.RunSpec(shards=2, mode="decoupled", quorum=1, grace_s=0.05,
                         sync_every=8, periods=6, dynamic_updates=True,
                         sleep_s=(0.0, 0.02))
  sync, status = run_local(run, range(2))
  assert sync.version == 6
  assert status[1]["h"][-1] < 8 and status[0]["h"][-1] == 8
  assert max(status[0]["waits"]) < run.grace_s
  merged = sync.log["tokens"]
  assert sum(int(t.get("0", 0)) for t in merged) > sum(
      int(t.get("1", 0)) for t in merged)


def test_ray_missing_is_one_line_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "ray", None)
  with pytest.raises(ImportError, match=r"requirements-ray.txt"):
    cluster.require_ray()


def test_an_unreachable_address_is_one_line_after_a_bounded_wait():
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  start = time.monotonic()
  with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} within 0.5 s"):
    cluster.probe(f"127.0.0.1:{port}", 0.5)
  assert time.monotonic() - start < 3
  with pytest.raises(ValueError, match="HOST:PORT"):
    cluster.probe("nowhere", 0.5)
  # str.isdigit() takes "²", which int() refuses (a ValueError before).
  for bad in ("127.0.0.1:\u00b2", "127.0.0.1:\u0663", "127.0.0.1:080"):
    with pytest.raises(ValueError, match="--address must be HOST:PORT"):
      cluster.probe(bad, 0.5)


def test_an_address_host_is_a_hostname_ipv4_or_bracketed_ipv6():
  from decentral_jax import checks  # pylint: disable=import-outside-toplevel
  assert [checks.host_port(a) for a in (
      "10.0.0.1:6379", "node-1.cluster.local:6379", "my_head:1", "[::1]:80",
      "[2001:db8::7]:65535")] == [
          ("10.0.0.1", 6379), ("node-1.cluster.local", 6379), ("my_head", 1),
          ("::1", 80), ("2001:db8::7", 65535)]


@pytest.mark.parametrize("address", [
    "127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:0", "nohost", ":80",
    " :80", "127.0.0.1:", "ho st:80", "h\n:80", "http://x:80", "a/b:80",
    "[::1:80", "1.2.3.999:80"])
def test_a_malformed_address_is_refused_at_flag_check_exit_2(address,
                                                             capsys):
  # TCP ports are 1..65535 (RFC 793's 16-bit field; 0 is no port): out of
  # range or malformed is one line, exit 2, before Ray or a connect wait.
  from decentral_jax.tools import cli  # pylint: disable=import-outside-toplevel
  start = time.monotonic()
  assert cli.main(["learners", "--address", address,
                   "--connect-timeout", "30"]) == 2
  assert time.monotonic() - start < 20
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: --address must be HOST:PORT with a port in [1, 65535]"), err


def test_the_learners_command_refuses_bad_flags_and_unreachable_clusters(
    capsys):
  from decentral_jax.tools import cli  # pylint: disable=import-outside-toplevel
  assert cli.main(["learners", "--learners", "2", "--quorum", "3"]) == 2
  assert "--quorum=3 exceeds --learners=2" in capsys.readouterr().err
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  assert cli.main(["learners", "--address", f"127.0.0.1:{port}",
                   "--connect-timeout", "0.3"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: cannot reach")


@pytest.mark.parametrize("flags,words", [
    (("--inner-lr", "nan"), "argument --inner-lr: must be a finite number "
     "in (0, 1000], got 'nan'"),
    (("--kill-every", "-1"), "argument --kill-every: must be an integer in "
     "[0, 2147483647], got '-1'"),
    (("--connect-timeout", "-5"), "argument --connect-timeout: must be a "
     "finite number in (0, 86400] s, got '-5'"),
    (("--grace", "inf"), "argument --grace: must be a finite number in "
     "[0, 86400] s, got 'inf'"),
    (("--quorum", "0"), "argument --quorum: must be an integer in [1, 1024]"),
    (("--learners", "99999999999999999999"), "argument --learners: must be "
     "an integer in [1, 1024]"),
    (("--periods", "1e30"), "argument --periods: must be an integer"),
    (("--sleep", "a,b"), "--sleep='a,b': entry 1 must be a finite number "
     "in [0, 86400] s, got 'a'"),
    (("--sleep", "0,0"), "--sleep has 2 values for --learners=4"),
    (("--sleep", "0,0,-1,0"), "--sleep='0,0,-1,0': entry 3 must be a finite "
     "number in [0, 86400] s, got '-1'"),
    (("--sleep", "1e30,0,0,0"), "--sleep='1e30,0,0,0': entry 1 must be a "
     "finite number in [0, 86400] s, got '1e30'"),
    (("--sleep", ","), "--sleep=',': entry 1 is empty; separate the "
     "seconds (one per learner) by single commas, e.g. --sleep=0,0,0,0.05."),
    (("--sleep", "0,,0.5,0"), "--sleep='0,,0.5,0': entry 2 is empty"),
    (("--delay-buffer", "3"), "--delay-buffer has no effect with --outer "
     "nesterov (Nesterov SGD steps at every merge, it has no buffer); add "
     "--outer delayed_nesterov or drop --delay-buffer."),
    (("--delay-buffer", "1"), "--delay-buffer has no effect with --outer "
     "nesterov"),
    # Delayed Nesterov with N = 1 is Nesterov SGD (outer.py's recursion)
    (("--outer", "delayed_nesterov"), "--outer delayed_nesterov with "
     "--delay-buffer 1 (the default) is Nesterov SGD, the default --outer "
     "nesterov (the momentum steps at every merge); give --delay-buffer "
     "N > 1"),
    (("--outer", "delayed_nesterov", "--delay-buffer", "1"),
     "--outer delayed_nesterov with --delay-buffer 1 (the default) is "
     "Nesterov SGD"),
    (("--kill-every", "100", "--periods", "5"), "--kill-every 100 never "
     "kills a learner: the run ends after 5 merged periods (--periods 5); "
     "use --kill-every below 5, more --periods, or drop --kill-every."),
    (("--kill-every", "10"), "--kill-every 10 never kills a learner: the "
     "run ends after 10 merged periods (--periods' default 10)"),
    (("--quorum", "5"), "error: --quorum=5 exceeds --learners=4; use "
     "--quorum <= --learners."),
    (("--fragments", "9", "--sync-every", "8"), "error: --fragments=9 "
     "exceeds --sync-every=8; use 1 <= --fragments <= --sync-every."),
    (("--dynamic-updates", "--fragments", "2"), "error: --dynamic-updates "
     "with --fragments/--overlap-steps/--merge-alpha: a fragment schedule"),
    (("--outer", "delayed_nesterov", "--delay-buffer", "0"),
     "argument --delay-buffer: must be an integer in [1, 1000000], got '0'"),
    (("--fragments", "2", "--overlap-steps", "4"), "error: "
     "--overlap-steps=4 with --fragments=2 needs --overlap-steps * "
     "--fragments < --sync-every=8"),
    (("--merge-alpha", "-0.5"), "argument --merge-alpha: must be a finite "
     "number in [0, 1], got '-0.5'")])
def test_the_learners_command_names_a_bad_number_before_ray_starts(
    capsys, monkeypatch, flags, words):
  from decentral_jax.tools import cli  # pylint: disable=import-outside-toplevel
  def start(*a, **k):
    raise AssertionError("Ray started: the flags were accepted")
  monkeypatch.setattr(cluster, "start", start)
  count = [] if "--learners" in flags else ["--learners", "4"]  # once
  assert cli.main(["learners", *count, *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err



def _refused_before_ray(monkeypatch, capsys, argv):
  from decentral_jax.tools import cli  # pylint: disable=import-outside-toplevel
  def start(*a, **k):
    raise AssertionError("Ray started: the flags were accepted")
  monkeypatch.setattr(cluster, "start", start)
  assert cli.main(["learners", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


def test_dynamic_updates_with_one_learner_is_refused(capsys, monkeypatch):
  # H_w = max(1, floor(v_w / v_max * H)) with v_w = v_max: always H.
  err = _refused_before_ray(monkeypatch, capsys,
                            ["--learners", "1", "--dynamic-updates"])
  assert "--dynamic-updates has no effect with --learners 1" in err
  assert "drop --dynamic-updates" in err


def test_dynamic_updates_with_a_sync_period_of_one_is_refused(capsys,
                                                             monkeypatch):
  # H_w = max(1, floor(v_w / v_max * 1)) = 1 for every speed v_w <= v_max:
  # the learners at 0 s and 0.5 s per step both run one inner step.
  err = _refused_before_ray(monkeypatch, capsys, [
      "--learners", "2", "--sync-every", "1", "--dynamic-updates",
      "--sleep", "0,0.5"])
  assert err == ("error: --dynamic-updates has no effect with --sync-every 1 "
                 "(H_w = max(1, floor(v_w / v_max * H)) is 1 for every "
                 "learner when H = 1); give --sync-every 2 or more or drop "
                 "--dynamic-updates.")
  # H = 2 is accepted: the slow learner runs max(1, floor(0 * 2)) = 1 step.
  from decentral_jax.tools.learners import flags as flags_lib  # pylint: disable=import-outside-toplevel
  run = flags_lib.run_spec(flags_lib.parser().parse_args([
      "--learners", "2", "--sync-every", "2", "--dynamic-updates"]))
  assert run.dynamic_updates and run.sync_every == 2


@pytest.mark.parametrize("name", ["cfg", "metrics.jsonl", "config.json",
                                  "learners.json", "corpus"])
def test_json_naming_an_input_or_a_record_is_refused(capsys, monkeypatch,
                                                     tmp_path, name):
  cfg = tmp_path / "cfg.py"
  cfg.write_text(open("configs/gpt_tiny.py").read())
  corpus = tmp_path / "corpus"
  corpus.write_text("alpha beta gamma " * 2000)
  before = {p.name: p.read_bytes() for p in (cfg, corpus)}
  wd = tmp_path / "wd"
  wd.mkdir()
  target = {"cfg": cfg, "corpus": corpus}.get(name, wd / name)
  err = _refused_before_ray(monkeypatch, capsys, [
      "--config", str(cfg), "--config.algorithm=diloco",
      "--config.data.source=text_file", f"--config.data.path={corpus}",
      "--workdir", str(wd), "--json", str(target)])
  assert f"--json '{target}' is the file" in err, err
  assert "give --json another path" in err
  assert {p.name: p.read_bytes() for p in (cfg, corpus)} == before


@pytest.mark.slow
def test_int8_pseudo_gradients_with_error_feedback():
  """int8 payloads (block 2: one scale per two values): a quarter of the
  float32 bytes plus the scales, and theta within the quantization error
  of the one-program DiLoCo's; a garbage payload is rejected."""
  run = spec_lib.RunSpec(shards=2, sync_every=3, periods=3, compressor="int8",
                         block=2, quorum=2)
  sync, status = run_local(run, range(2))
  assert sync.version == 3 and not sync.log["rejected"]
  # 9 values per pseudo-gradient: leaves of 3, 4 and 1 values -> 2, 2, 1
  # blocks of (2 + 4) bytes = 30 bytes, against 36 in float32.
  assert status[0]["bytes"] == 3 * 30
  want = spmd_diloco(2, 3, 3)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], atol=0.05)
  assert not all(np.allclose(sync.theta[k], want[k], atol=1e-6) for k in want)
  sync = sync_lib.Synchronizer(run)
  try:
    sync.join(0, run.fingerprint())
    bad = {k: {"codes": np.zeros(1, np.int8)} for k in sync.theta}
    assert "not a int8 payload" in sync.push(0, 0, bad, 1)
  finally:
    sync.close()


def test_decoupled_pushes_of_one_version_add_up_each_step_counted_once():
  """Learner 0 sends its progress twice from version 0 (Delta 1 after 1
  token, then 2 more after 2 tokens): held as one pseudo-gradient 3 of 3
  tokens; with learner 1's 7 of 1 token the merge is (3*3 + 7*1)/4 = 4."""
  run = spec_lib.RunSpec(shards=2, mode="decoupled", quorum=2, grace_s=0.0)
  sync = sync_lib.Synchronizer(run)
  try:
    for i in range(2):
      sync.join(i, run.fingerprint())
    theta0 = {k: v.copy() for k, v in sync.theta.items()}
    sync.push(0, 0, _delta(1.0, theta0), 1)
    sync.push(0, 0, _delta(2.0, theta0), 2)
    assert sync.status()["pending"] == 1 and sync.version == 0
    sync.push(1, 0, _delta(7.0, theta0), 1)
    deadline = time.monotonic() + 10
    while sync.version == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert sync.log["tokens"] == [{"0": 3, "1": 1}]
    for k in theta0:
      np.testing.assert_allclose(sync.theta[k], theta0[k] - OUTER_LR * 1.9 * 4,
                                 rtol=1e-6)
  finally:
    sync.close()


def spmd_streaming(n, h, periods, fragments, tau, alpha, seed=0, noise=0.1):
  """Streaming DiLoCo (inner SGD ``LR``, default outer) in one SPMD program
  on the learners' quadratic problem and data order; returns worker 0's
  ``theta`` after ``h * periods + tau`` steps (every fragment merged
  ``periods`` times, none more)."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax import optim  # pylint: disable=import-outside-toplevel
  tx = optim.streaming_diloco(optax.sgd(LR), h, num_fragments=fragments,
                              overlap_steps=tau, merge_alpha=alpha)
  _, state = spmd_quadratic(tx, n, h * periods + tau, seed, noise)
  theta = optim.streaming_sync.global_params(state)
  return jax.tree.map(lambda v: np.asarray(v)[0], jax.device_get(theta))


def test_sync_fragments_equal_streaming_diloco_in_one_program():
  """2 learners, H = 4, P = 2 fragments (leaves a, b | c at offsets 0, 2),
  overlap tau = 1, merge weight alpha = 0.5, 3 periods: theta equals the
  one-program Streaming DiLoCo's to float32 rounding; each fragment merged
  3 times with its own outer state."""
  require_devices(2)
  run = spec_lib.RunSpec(shards=2, sync_every=4, periods=3, inner_lr=LR,
                         quorum=2, fragments=2, overlap_steps=1,
                         merge_alpha=0.5)
  sync, status = run_local(run, range(2))
  assert all(s["error"] is None for s in status), status
  assert sync.versions == [3, 3] and sync.fragments == [["a", "b"], ["c"]]
  assert [f[:3] for f in sync.log["fragments"]] == [
      [1, 1, [0, 1]], [0, 1, [0, 1]], [1, 2, [0, 1]], [0, 2, [0, 1]],
      [1, 3, [0, 1]], [0, 3, [0, 1]]]
  assert sync.log["tokens"] == [{"0": 4, "1": 4}] * 3
  want = spmd_streaming(2, 4, 3, 2, 1, 0.5)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], rtol=2e-6, atol=2e-6)
  # Whole-model DiLoCo on the same data gives another theta.
  assert not np.allclose(sync.theta["c"], spmd_diloco(2, 4, 3)["c"],
                         atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fragments,tau,alpha", [(3, 0, 0.0), (3, 1, 0.25),
                                                 (2, 2, 0.0)])
def test_sync_fragments_equal_streaming_diloco_more_schedules(fragments, tau,
                                                              alpha):
  """3 learners, H = 5 (offsets 0, 1, 3 for P = 3; 0, 2 for P = 2)."""
  require_devices(3)
  run = spec_lib.RunSpec(shards=3, sync_every=5, periods=3, inner_lr=LR,
                         quorum=3, fragments=fragments, overlap_steps=tau,
                         merge_alpha=alpha)
  sync, status = run_local(run, range(3))
  assert all(s["error"] is None for s in status), status
  assert sync.versions == [3] * fragments
  want = spmd_streaming(3, 5, 3, fragments, tau, alpha)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], rtol=2e-6, atol=2e-6)


@pytest.mark.slow
def test_decoupled_fragments_merge_on_their_own_and_block_nobody():
  """Decoupled learners with 3 fragments, one learner 3x slower: every
  fragment merges 4 times, fast learners never wait past the grace."""
  run = spec_lib.RunSpec(shards=2, mode="decoupled", quorum=1, grace_s=0.05,
                         sync_every=6, periods=4, fragments=3,
                         sleep_s=(0.002, 0.006))
  sync, status = run_local(run, range(2))
  assert all(s["error"] is None for s in status), status
  assert min(sync.versions) == 4
  merged = {f for f, _, _, _ in sync.log["fragments"]}
  assert merged == {0, 1, 2}
  assert max(status[0]["waits"]) < run.grace_s


@pytest.mark.parametrize("fields,words", [
    ({"fragments": 0}, "RunSpec.fragments must be an int >= 1"),
    ({"max_staleness": 1.5}, "RunSpec.max_staleness must be an int"),
    ({"sync_every": 2**31 - 1, "periods": 1, "fragments": 2**30},
     "RunSpec.fragments must be an int >= 1 and <= 65536"),
    ({"dynamic_updates": "no"}, "RunSpec.dynamic_updates must be a bool"),
    ({"keep_state": "yes"}, "RunSpec.keep_state must be a bool"),
    ({"delay_buffer": 2**40, "outer": "delayed_nesterov"},
     "RunSpec.delay_buffer must be an int >= 1 and <= 2147483647"),
    ({"max_staleness": -1}, "RunSpec.max_staleness must be an int >= 0"),
    ({"sync_every": 2**31}, "RunSpec.sync_every must be an int >= 1 and "
                            "<= 2147483647"),
    ({"sync_every": 2**16, "periods": 2**16}, "inner steps exceed"),
    ({"grace_s": float("inf")}, "RunSpec.grace_s must be a finite number"),
    ({"grace_s": 1e30}, "RunSpec.grace_s must be a finite number"),
    ({"fragments": 5}, "RunSpec.fragments=5 exceeds sync_every=4"),
    ({"fragments": 2, "overlap_steps": 2}, "RunSpec.overlap_steps=2"),
    ({"overlap_steps": 1.5}, "RunSpec.overlap_steps must be an int"),
    ({"merge_alpha": 1.5}, "RunSpec.merge_alpha must be a number in [0, 1]"),
    ({"outer": "adam"}, "RunSpec.outer must be one of"),
    ({"delay_buffer": 0}, "RunSpec.delay_buffer must be an int >= 1"),
    ({"delay_buffer": 4}, "RunSpec.delay_buffer=4 needs outer="),
    ({"fragments": 2, "dynamic_updates": True}, "RunSpec.dynamic_updates"),
])
def test_run_spec_names_a_bad_fragment_or_outer_field(fields, words):
  with pytest.raises(ValueError) as e:
    spec_lib.RunSpec(**fields)
  assert words in str(e.value)


def test_more_fragments_than_leaves_is_one_line_naming_the_field():
  with pytest.raises(ValueError, match="RunSpec.fragments=4 exceeds the 3 parameter leaves"):
    sync_lib.Synchronizer(spec_lib.RunSpec(sync_every=8, fragments=4))


def np_delayed_nesterov(deltas, theta0, lr, beta, n):
  """NumPy oracle of Delayed Nesterov (float64): the recursion of
  tools/learners/outer.py written out, one merged Delta per merge."""
  theta = {k: np.asarray(v, np.float64) for k, v in theta0.items()}
  m = {k: np.zeros_like(v) for k, v in theta.items()}
  d = {k: np.zeros_like(v) for k, v in theta.items()}
  for k_merge, delta in enumerate(deltas, start=1):
    for key in theta:
      d[key] = d[key] + delta[key]
      if k_merge % n == 0:
        m[key] = beta * m[key] + d[key] / n
        theta[key] = theta[key] - lr * (beta * m[key] + delta[key] / n)
        d[key] = np.zeros_like(d[key])
      else:
        theta[key] = theta[key] - lr * delta[key] / n
  return theta


def np_oracle_run(run, n=None, seed=0, noise=0.1):
  """Synchronous learners on the quadratic problem in NumPy (float64):
  every period each learner takes H inner SGD steps from theta on its
  shard's targets (step ``k H + t`` of period ``k``), the merged Delta is
  their mean, and Delayed Nesterov with buffer ``n`` (default the run's)
  steps theta. Returns theta after the run's periods."""
  from decentral_jax.tools.learners import problems  # pylint: disable=import-outside-toplevel
  x0, b = problems.quadratic_targets(run.shards, seed)
  theta0 = {k: v[0] for k, v in x0.items()}
  deltas = []
  for period in range(run.periods):
    theta = np_delayed_nesterov(deltas, theta0, run.outer_lr,
                                run.outer_momentum, n or run.delay_buffer)
    xs = []
    for w in range(run.shards):
      x = dict(theta)
      for t in range(run.sync_every):
        target = problems.quadratic_batch(b, w, period * run.sync_every + t,
                                          seed, noise)
        x = {k: x[k] - run.inner_lr * (x[k] - target[k]) for k in x}
      xs.append(x)
    deltas.append({k: theta[k] - np.mean([x[k] for x in xs], 0)
                   for k in theta})
  return np_delayed_nesterov(deltas, theta0, run.outer_lr, run.outer_momentum,
                             n or run.delay_buffer)


def test_delayed_nesterov_one_buffer_is_nesterov_sgd():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import outer  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  dn, ref = outer.delayed_nesterov(0.7, 0.9, 1), optax.sgd(0.7, 0.9, True)
  x = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
  s_dn, s_ref = dn.init(x), ref.init(x)
  for _ in range(4):
    g = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
    u_dn, s_dn = dn.update(g, s_dn)
    u_ref, s_ref = ref.update(g, s_ref)
    np.testing.assert_allclose(u_dn["w"], u_ref["w"], rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="delay buffer must be an int >= 1"):
    outer.delayed_nesterov(0.7, 0.9, 0)


@pytest.mark.parametrize("name", ["nesterov", "delayed_nesterov"])
@pytest.mark.parametrize("lr, beta, words", [
    (-0.7, 0.9, "outer learning_rate"), (float("nan"), 0.9,
                                         "outer learning_rate"),
    (0.0, 0.9, "outer learning_rate"), (0.7, 1.0, "outer momentum"),
    (0.7, 1.5, "outer momentum"), (0.7, -0.1, "outer momentum")])
def test_outer_optimizers_refuse_numbers_that_would_step_uphill_or_diverge(
    name, lr, beta, words):
  """A negative or NaN rate stepped uphill or gave NaN; momentum >= 1 grows
  the step without bound (the library function took them; RunSpec did not)."""
  from decentral_jax.tools.learners import outer  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=words):
    outer.make(name, lr, beta)


def test_delayed_nesterov_worked_example():
  """N = 2, lr 1, beta 0.5, scalar Deltas 1, 2, 3, 4 from theta = 0:
  merge 1: theta = -1/2; merge 2: m = (1 + 2)/2 = 1.5, theta = -0.5 -
  (0.75 + 1) = -2.25; merge 3: -2.25 - 1.5 = -3.75; merge 4: m = 0.75 +
  3.5 = 4.25, theta = -3.75 - (2.125 + 2) = -7.875."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import outer  # pylint: disable=import-outside-toplevel
  dn = outer.delayed_nesterov(1.0, 0.5, 2)
  theta, state, got = jnp.zeros([]), dn.init(jnp.zeros([])), []
  for delta in (1.0, 2.0, 3.0, 4.0):
    u, state = dn.update(jnp.asarray(delta), state)
    theta = theta + u
    got.append(float(theta))
  assert got == [-0.5, -2.25, -3.75, -7.875]


@pytest.mark.slow
def test_sync_learners_with_delayed_nesterov_match_numpy_oracle():
  """3 learners, H = 3, 5 periods, buffer N = 2 on the noisy quadratic:
  theta equals the NumPy recursion (float64) to float32 rounding, and
  differs from Nesterov SGD's."""
  run = spec_lib.RunSpec(shards=3, sync_every=3, periods=5, inner_lr=LR,
                         quorum=3, outer="delayed_nesterov", delay_buffer=2)
  sync, status = run_local(run, range(3))
  assert all(s["error"] is None for s in status) and sync.version == 5
  want = np_oracle_run(run)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], rtol=1e-5, atol=1e-5)
  nesterov = np_oracle_run(run, n=1)
  assert not np.allclose(sync.theta["a"], nesterov["a"], atol=1e-3)


def test_decoupled_merges_step_delayed_nesterov_on_token_weighted_deltas():
  """Decoupled, buffer N = 3: three merges of two learners' pushes (tokens
  1 and 3) step theta as the NumPy recursion on the weighted means."""
  run = spec_lib.RunSpec(shards=2, mode="decoupled", quorum=2, grace_s=0.0,
                         outer="delayed_nesterov", delay_buffer=3,
                         periods=10)
  sync = sync_lib.Synchronizer(run)
  try:
    for i in range(2):
      sync.join(i, run.fingerprint())
    theta0 = {k: v.copy() for k, v in sync.theta.items()}
    means = []
    for merge, (a, b) in enumerate([(1.0, -2.0), (0.5, 4.0), (3.0, 1.0)]):
      sync.push(0, merge, _delta(a, theta0), 1)
      sync.push(1, merge, _delta(b, theta0), 3)
      deadline = time.monotonic() + 10
      while sync.version == merge and time.monotonic() < deadline:
        time.sleep(0.005)
      means.append(_delta((a + 3 * b) / 4, theta0))
    want = np_delayed_nesterov(means, theta0, OUTER_LR, MOMENTUM, 3)
    for k in theta0:
      np.testing.assert_allclose(sync.theta[k], want[k], rtol=1e-6, atol=1e-6)
  finally:
    sync.close()


def _restart_learner_1(run, at_version=2, timeout=60):
  """Learners 0 and 1 in threads; after ``at_version`` merges learner 1
  stops (after its period) and a new learner 1 joins in its place.
  Returns the synchronizer and the new learner's status."""
  sync = sync_lib.Synchronizer(run)
  learners = [learner_lib.Learner(run, i, local_link(sync)) for i in (0, 1)]
  deadline = time.monotonic() + timeout
  while sync.version < at_version and time.monotonic() < deadline:
    time.sleep(0.005)
  learners[1].stop()
  learners[1] = learner_lib.Learner(run, 1, local_link(sync))
  while sync.version < run.periods and time.monotonic() < deadline:
    time.sleep(0.01)
  status = [lrn.stop() for lrn in learners]
  sync.close()
  return sync, status[1]


@pytest.mark.slow
def test_a_restarted_learner_keeps_its_adamw_state_and_residual():
  """Sync mode, inner AdamW, int8 pseudo-gradients with error feedback:
  learner 1 replaced after 2 merges starts from the AdamW moments and the
  residual it sent, and theta equals the run without a restart; without
  keep_state (moments and residual afresh) it does not. Each period sends
  AdamW's count, mu, nu (4 + 2 * 8 * 4 bytes) and the residual (8 * 4)."""
  run = spec_lib.RunSpec(shards=2, sync_every=3, periods=5, inner="adamw",
                         inner_lr=0.05, quorum=2, compressor="int8", block=2)
  reference, status = run_local(run, range(2))
  assert status[0]["state_bytes"] == 5 * (4 + 2 * 8 * 4 + 8 * 4)
  sync, new = _restart_learner_1(run)
  assert new["restored"] and new["error"] is None and sync.version == 5
  for k in reference.theta:
    np.testing.assert_allclose(sync.theta[k], reference.theta[k], rtol=1e-6,
                               atol=1e-7)
  dropped = spec_lib.RunSpec(**{**run.__dict__, "keep_state": False})
  sync, new = _restart_learner_1(dropped)
  assert not new["restored"] and new["state_bytes"] == 0
  assert not all(np.allclose(sync.theta[k], reference.theta[k], atol=1e-5)
                 for k in reference.theta)


@pytest.mark.slow
def test_a_restarted_learner_rejoins_the_fragment_schedule():
  """Sync mode, P = 2, tau = 1, alpha = 0.5: learner 1 replaced after 2
  periods starts from theta at the step its first send of each fragment is
  the synchronizer's current version; every fragment merge still has both
  learners and the run ends at 6 merges per fragment. Its lost progress on
  the fragments moves theta off the one-program run's (0.07 measured;
  bound 0.2)."""
  require_devices(2)
  run = spec_lib.RunSpec(shards=2, sync_every=4, periods=6, inner_lr=LR,
                         quorum=2, fragments=2, overlap_steps=1,
                         merge_alpha=0.5)
  sync, new = _restart_learner_1(run)
  assert new["error"] is None and len(new["joined"]) == 1
  assert sync.versions == [6, 6]
  assert all(f[2] == [0, 1] for f in sync.log["fragments"])
  assert len(sync.log["fragments"]) == 12
  want = spmd_streaming(2, 4, 6, 2, 1, 0.5)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], atol=0.2)


def test_fragment_schedule_worked_by_hand():
  """H = 4, P = 2, tau = 1: fragment 1 (offset 2) sent after steps 2, 6,
  10 and merged after 3, 7, 11; fragment 0 sent after 4, 8, 12, merged
  after 5, 9, 13. H = 5, tau = 2: fragment 1 sent after 2, 7, merged after
  4, 9; fragment 0 sent after 5, merged after 7."""
  from decentral_jax.tools.learners import fragments  # pylint: disable=import-outside-toplevel
  assert fragments.offsets(4, 2) == [0, 2] and fragments.offsets(5, 3) == [
      0, 1, 3]
  sends = [t for t in range(1, 13) if fragments.is_send(t, 2, 4)]
  assert sends == [2, 6, 10] and fragments.send_step(3, 2, 4) == 10
  assert [t for t in range(13) if fragments.is_send(t, 0, 4)] == [4, 8, 12]
  start = lambda v, h, tau: fragments.start_step(  # noqa: E731
      v, fragments.offsets(h, 2), h, tau)
  assert start([0, 0], 4, 1) == 0  # a fresh run
  assert start([2, 2], 4, 1) == 9  # after fragment 0's merge at 9
  assert start([2, 3], 4, 1) == 11  # fragment 1 merged at 11, sends at 12
  assert start([1, 2], 5, 2) == 9
  # Fragment 1 sent after step 7 but not merged: start at 6, send it at 7.
  assert start([1, 1], 5, 2) == 6


def test_the_summary_names_the_run():
  run = spec_lib.RunSpec(shards=3, sync_every=8, quorum=3, fragments=2,
                         overlap_steps=1, merge_alpha=0.5,
                         outer="delayed_nesterov", delay_buffer=4,
                         compressor="int8", block=64)
  assert main_lib.describe(run) == (
      "run: sync, 3 learners, H=8, inner sgd lr 0.1, outer delayed Nesterov "
      "(buffer 4) lr 0.7 momentum 0.9, Streaming: 2 fragments (tau=1, "
      "alpha=0.5), int8 pseudo-gradients")
  assert main_lib.describe(spec_lib.RunSpec()) == (
      "run: sync, 2 learners, H=4, inner sgd lr 0.1, outer Nesterov lr 0.7 "
      "momentum 0.9")
  # One fragment with an overlap (or a merge alpha) is Streaming DiLoCo's
  # schedule too, not plain DiLoCo.
  for fields, words in (({"overlap_steps": 1}, "(tau=1, alpha=0)"),
                        ({"merge_alpha": 0.3}, "(tau=0, alpha=0.3)")):
    assert main_lib.describe(spec_lib.RunSpec(**fields)).endswith(
        ", Streaming: 1 fragment " + words), fields


def test_the_summary_warns_of_a_learner_never_merged(capsys):
  # --quorum 1: ten merges of learner 0 alone (learner 1 still starting);
  # learner 1 is named, learners that merged once (or in a fragment) not.
  log = {"merged_with": [[0]] * 10, "tokens": [{"0": 8}] * 10,
         "rejected": [], "fragments": []}
  assert main_lib.never_merged(log, 2) == [1]
  assert main_lib.merge_warning(log, 2) == (
      "warning: learner 1 of 2 never merged (none of its pseudo-gradients "
      "entered the 10 merges): the result is of the other learners only; "
      "leave --quorum unset (sync: every learner) or run more periods.")
  assert main_lib.never_merged(log, 3) == [1, 2]
  assert main_lib.merge_warning(log, 3).startswith("warning: learners 1, 2 "
                                                   "of 3 never merged")
  late = {**log, "merged_with": [[0]] * 9 + [[0, 1]]}
  assert main_lib.never_merged(late, 2) == []
  assert main_lib.merge_warning(late, 2) is None
  assert main_lib.never_merged({**log, "fragments": [[1, 1, [1], {}]]},
                               2) == []


def test_the_quadratic_run_reports_its_distance_to_the_optimum():
  """x* of the mean of 0.5 ||x - b_i||^2 is mean_i b_i; the distance is
  checked by hand from the problem's targets (seed 0, 4 shards)."""
  rng = np.random.default_rng(0)  # quadratic_targets' draws, in order
  starts = [rng.normal(size=(1, 3)), rng.normal(size=(1, 2, 2)),
            rng.normal(size=(1,))]
  targets = [rng.normal(size=(4,) + s.shape[1:]) for s in starts]
  best = {k: t.mean(0) for k, t in zip("abc", targets)}
  run = spec_lib.RunSpec(shards=4)
  assert main_lib.distance_to_optimum(run, best) == 0.0
  zeros = {k: np.zeros_like(v, np.float32) for k, v in best.items()}
  want = np.sqrt(sum(np.sum(v ** 2) for v in best.values()))
  assert main_lib.distance_to_optimum(run, zeros) == pytest.approx(want,
                                                                   rel=1e-12)
  assert main_lib.distance_to_optimum(
      spec_lib.RunSpec(problem="gpt", shards=4), zeros) is None


def test_the_fragment_bound_is_the_one_program_methods():
  from decentral_jax.optim import streaming_sync  # pylint: disable=import-outside-toplevel
  assert spec_lib.MAX_FRAGMENTS == streaming_sync.MAX_FRAGMENTS
