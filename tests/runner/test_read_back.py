"""Files a run reads back (checkpoints, their manifests, ``metrics.jsonl``):
damage is named and set aside, never trusted, raised raw, or hung on."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from decentral_jax import records
from decentral_jax.runner import checkpoint
from decentral_jax.runner import checkpoint_files
from decentral_jax.runner import meta_schema
from decentral_jax.runner import metrics
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import metrics_rules
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools.compare import kept
from decentral_jax.tools.learners import records as learner_records

BIG = "1" + "0" * 5000  # past Python's 4,300-digit int conversion limit


def test_an_integer_too_long_to_convert_is_damage_naming_the_file():
  got = records.parse_json(b'{"step": ' + BIG.encode() + b"}", "f.json")
  assert isinstance(got, records.Damaged), got
  assert got.file == "f.json" and got.reason.startswith("is not JSON"), got
  # Python's advice (sys.set_int_max_str_digits) is no fix a user can make.
  assert got.reason == ("is not JSON: it holds a number of more than 4300 "
                        "digits (no run writes one)"), got


def test_a_checkpoint_with_an_over_long_integer_is_corrupt(tmp_path):
  """Orbax's unsummed step metadata with a 5,001-digit integer: the
  checkpoint is corrupt (so an older one is used), not a raw ValueError."""
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  workdir_lib.write_sums(str(root))
  (root / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": '
                                             + BIG + "}")
  status, why = checkpoint_files.check_checkpoint(str(root))
  assert status == "corrupt" and "_CHECKPOINT_METADATA" in why, why


def test_a_step_entry_of_non_ascii_digits_is_not_a_checkpoint(tmp_path):
  """"²" passes ``str.isdigit`` but not ``int``: the entry is ignored and
  the directory has no checkpoint (it raised "invalid literal" before)."""
  root = tmp_path / "checkpoints"
  (root / "\u00b2").mkdir(parents=True)
  (root / "\uff18").mkdir()  # fullwidth 8
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() is None
  assert sorted(os.listdir(root)) == ["\u00b2", "\uff18"]


def test_a_listed_file_replaced_by_a_link_is_never_followed(tmp_path):
  """A listed file replaced by a link to a file of the same bytes (whose
  checksum matches): damage naming it; a link to ``/proc/kmsg`` or a FIFO
  would be read for ever."""
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  (root / "b").write_bytes(b"b")
  workdir_lib.write_sums(str(root))
  outside = tmp_path / "outside"
  outside.write_bytes(b"b")
  assert hashlib.sha256(outside.read_bytes()).hexdigest() in (
      root / workdir_lib.SUMS_FILE).read_text()
  os.remove(root / "b")
  os.symlink(outside, root / "b")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and why.startswith("b is not a regular file"), why


def test_a_listed_fifo_is_damage_without_blocking(tmp_path):
  root = tmp_path / "5"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  digest = hashlib.sha256(b"").hexdigest()
  os.mkfifo(root / "f")
  (root / workdir_lib.SUMS_FILE).write_text(
      f"{hashlib.sha256(b'a').hexdigest()}  a\n{digest}  f\n")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and "f" in why, why


# -- metrics.jsonl: one rule set for every reader -----------------------------

# A gpt run's stored config: 16 x 8 = 128 tokens per step (by hand).
CONFIG = {"steps": 10, "log_interval": 1, "eval_interval": 2,
          "global_batch": 16, "schedule": {"peak_lr": 3e-3},
          "model": {"name": "gpt", "block_size": 8}}
PEAKED = [[0, 1, 2, 3e-3]]  # its log schedule: one segment with its peak
# An evaluation's keys (evaluation.Evaluator.evaluate); excess by hand:
# 5.25 - 5.2 = 0.05 and 5.5 - 5.2 = 0.3.
EVAL = {"eval/loss": 5.3, "eval/worker_loss_mean": 5.25,
        "eval/worker_loss_min": 5.0, "eval/worker_loss_max": 5.5,
        "eval/worker_loss_std": 0.25, "eval/loss_subset": 5.2,
        "eval/worker_excess_mean": 0.05, "eval/worker_excess_max": 0.3}
# Its log as the runner writes it: lr and train_time_s in every record,
# train/loss after step 0 (metrics_rules.missing_error), the evaluation's
# keys at steps 0 and 2 (eval_interval=2) only.
GOOD = [{"step": 0, "lr": 1e-4, **EVAL, "train_time_s": 0.0},
        {"step": 1, "lr": 1e-4, "train/loss": 5.5, "train_time_s": 1.0},
        {"step": 2, "lr": 2e-4, "train/loss": 5.4, **EVAL,
         "train_time_s": 2.0, "step_time_ms": 10.0,
         "tokens_per_sec": 12800.0},  # 128 / 0.01 s
        {"step": 3, "lr": 3e-4, "train/loss": 5.3, "train_time_s": 3.0}]


def _log(tmp_path, edit: dict | None = None, at: int = 1) -> str:
  rows = [dict(r) for r in GOOD]
  rows[at].update(edit or {})
  (tmp_path / metrics.METRICS_FILE).write_text(
      "".join(json.dumps(r) + "\n" for r in rows))
  return str(tmp_path)


def _resume_error(workdir: str, step: int = 3, schedule=PEAKED) -> str:
  with pytest.raises(metrics.MetricsError) as info:
    metrics.truncate_after(workdir, step, CONFIG, schedule)
  return str(info.value)


def test_the_intact_log_is_kept_whole(tmp_path):
  workdir = _log(tmp_path)
  assert metrics.truncate_after(workdir, 3, CONFIG, PEAKED) == 0
  assert metrics.read_jsonl(os.path.join(workdir, metrics.METRICS_FILE)) \
      == GOOD
  assert kept.metrics_error(GOOD, CONFIG) is None


@pytest.mark.parametrize("key", ["train/loss", "consensus_distance", "lr",
                                 "eval/worker_excess_max"])
def test_a_value_beyond_float32_is_damage_for_every_reader(tmp_path, key):
  """float32 tops out at 3.4028e38 (numpy.finfo): 1e40 is no value the
  run computes, in a resumed log, a kept compare run and a learners' log
  alike (a checkpoint's window refuses it too)."""
  assert 1e40 > float(np.finfo(np.float32).max)
  workdir = _log(tmp_path, {key: 1e40}, at=1)
  needle = f"{key} is 1e+40, beyond the largest float32"
  assert "line 2: " + needle in _resume_error(workdir)
  assert needle in kept.metrics_error([dict(GOOD[1], **{key: 1e40})])
  with pytest.raises(ValueError, match="beyond the largest float32"):
    learner_records.read_metrics(workdir)
  # A byte count is taken in float64: no float32 bound there.
  assert metrics_rules.row_error(
      {"step": 1, "comm/bytes_per_step": 1e40}) is None


@pytest.mark.parametrize("lo, hi, std, ok", [
    (5.5, 5.5, 1e19, False),    # every worker equal: the std is 0
    (5.5, 5.5, 0.0, True),
    (5.0, 6.0, 0.5, True),      # two workers at 5 and 6: std 0.5 exactly
    (5.0, 6.0, 0.5001, False),
    (5.0, 6.0, -0.1, False)])
def test_the_workers_loss_std_is_bounded_by_their_min_and_max(
    tmp_path, lo, hi, std, ok):
  """A population std of values in [lo, hi] is at most (hi - lo) / 2
  (Popoviciu); NumPy's std of [lo, hi] is exactly that bound."""
  assert np.std([lo, hi]) == (hi - lo) / 2
  subset = EVAL["eval/loss_subset"]  # the excess columns follow (by hand)
  edit = {"eval/worker_loss_min": lo, "eval/worker_loss_max": hi,
          "eval/worker_loss_mean": (lo + hi) / 2, "eval/worker_loss_std": std,
          "eval/worker_excess_mean": (lo + hi) / 2 - subset,
          "eval/worker_excess_max": hi - subset}
  why = metrics_rules.row_error(dict(GOOD[0], **edit))
  assert (why is None) == ok, why
  if not ok:
    assert "eval/worker_loss_std" in why and "\n" not in why, why
    workdir = _log(tmp_path, edit, at=0)
    assert "line 1: eval/worker_loss_std" in _resume_error(workdir)
    with pytest.raises(ValueError, match="eval/worker_loss_std"):
      metrics.read_jsonl(os.path.join(workdir, metrics.METRICS_FILE))


@pytest.mark.parametrize("edit, needle", [
    ({"train/loss": None}, "train/loss is null"),
    ({"lr": None}, "lr is null"),
    ({"eval/worker_loss_mean": None}, "eval/worker_loss_mean is null")])
def test_a_null_the_writer_never_writes_is_damage(tmp_path, edit, needle):
  """A non-finite loss stops the run before its record is written and lr
  is always finite: a null there before the checkpoint is damage."""
  workdir = _log(tmp_path, edit, at=2)
  assert "line 3: " + needle in _resume_error(workdir)
  assert needle in kept.metrics_error([dict(GOOD[2], **edit)], CONFIG)
  # A null accuracy (a model's own aux value may be NaN) is not damage.
  assert metrics_rules.null_error(
      dict(GOOD[1], **{"train/accuracy": None})) is None


@pytest.mark.parametrize("key, says", [
    ("lr", "lr missing, but the runner writes it in every record"),
    ("train_time_s",
     "train_time_s missing, but the runner writes it in every record"),
    ("train/loss", "train/loss missing, but the runner writes it in every "
     "record after step 0")])
def test_a_record_without_a_key_the_runner_always_writes_is_damage(
    tmp_path, key, says):
  """The recorder writes lr and train_time_s in every record and the mean
  training loss in every record after step 0: step 3's record without
  one was edited, in a resumed log (line 4) and in a kept compare run."""
  rows = [dict(r) for r in GOOD]
  del rows[3][key]
  assert rows[3]["step"] == 3
  assert metrics_rules.null_error(rows[3]) == says
  (tmp_path / metrics.METRICS_FILE).write_text(
      "".join(json.dumps(r) + "\n" for r in rows))
  assert "line 4: " + says in _resume_error(str(tmp_path))
  assert kept.metrics_error(rows, CONFIG) == "at step 3: " + says
  assert kept.metrics_error(rows) == "at step 3: " + says
  # Two gone: both named, in the order the runner writes them.
  both = {k: v for k, v in GOOD[3].items() if k not in ("lr", "train_time_s")}
  assert metrics_rules.null_error(both) == (
      "lr, train_time_s missing, but the runner writes them in every record")


def test_a_step_0_record_needs_no_training_loss(tmp_path):
  """Step 0's record (the starting evaluation) comes before any training
  step: it has no train/loss, but lr and train_time_s like every record."""
  assert "train/loss" not in GOOD[0] and GOOD[0]["step"] == 0
  assert metrics_rules.null_error(GOOD[0]) is None
  assert metrics_rules.missing_error(GOOD[0]) is None
  workdir = _log(tmp_path)
  assert metrics.truncate_after(workdir, 3, CONFIG, PEAKED) == 0
  assert kept.metrics_error(GOOD[:1], CONFIG) is None
  for key in ("lr", "train_time_s"):
    row = {k: v for k, v in GOOD[0].items() if k != key}
    assert metrics_rules.null_error(row) == (
        f"{key} missing, but the runner writes it in every record")


def test_the_learners_reader_does_not_require_the_runner_s_keys(tmp_path):
  """The learners write their step-0 record without lr, and train/loss
  only on the periods the command saw merged (tools/learners/records.py):
  the learners' reader (null_error with runner=False, as truncate_after
  without a config) requires none of the runner's keys."""
  rows = [{"step": 0, "tokens": 0, "eval/loss": 5.5, "train_time_s": 0.0},
          {"step": 4, "tokens": 128, "learners/merged": 2,  # not seen
           "learners/tokens/0": 64, "learners/tokens/1": 64, "lr": 1e-4,
           "train_time_s": 1.0},
          {"step": 8, "tokens": 256, "learners/merged": 2,
           "learners/tokens/0": 64, "learners/tokens/1": 64, "lr": 2e-4,
           "train_time_s": 2.0, "train/loss": 5.0, "eval/loss": 5.1}]
  for row in rows:
    assert metrics_rules.null_error(row, runner=False) is None
  # As a train run's records, the first two would be damage.
  assert [metrics_rules.null_error(r) for r in rows] == [
      "lr missing, but the runner writes it in every record",
      "train/loss missing, but the runner writes it in every record after "
      "step 0", None]
  assert metrics_rules.null_error({"step": 3}, runner=False) is None
  path = tmp_path / metrics.METRICS_FILE
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert learner_records.read_metrics(str(tmp_path)) == rows
  assert metrics.read_jsonl(str(path)) == rows
  assert metrics.truncate_after(str(tmp_path), 8) == 0  # the learners' call
  # ... while a null lr is still damage there (lr is always finite).
  assert metrics_rules.null_error(dict(rows[1], lr=None), runner=False) == (
      "lr is null, but the writer always writes a finite number there (a "
      "non-finite loss stops the run unrecorded; lr is always finite)")


def test_a_throughput_that_is_not_its_step_time_is_damage(tmp_path):
  """128 tokens per step over 10 ms is 12,800 tokens/s, not 9,999."""
  workdir = _log(tmp_path, {"tokens_per_sec": 9999.0}, at=2)
  assert "line 3: tokens_per_sec is 9999.0, but 128 tokens per step" in \
      _resume_error(workdir)


def test_a_decreasing_train_time_is_damage(tmp_path):
  """Cumulative timed seconds 1.0 then 0.5: they never decrease."""
  workdir = _log(tmp_path, {"train_time_s": 0.5}, at=2)
  assert ("line 3: train_time_s must not decrease (cumulative seconds), "
          "got 0.5 at step 2 after 1.0 at step 1") in _resume_error(workdir)
  rows = [GOOD[1], dict(GOOD[2], train_time_s=0.5)]
  assert "train_time_s must not decrease" in metrics_rules.order_error(rows)


def test_an_excess_loss_that_is_not_its_row_s_is_damage(tmp_path):
  """excess_max = worker_loss_max - loss_subset = 5.25 - 5.0 = 0.25."""
  row = {"step": 2, "eval/loss": 5.0, "eval/loss_subset": 5.0,
         "eval/worker_loss_mean": 5.125, "eval/worker_loss_max": 5.25,
         "eval/worker_loss_min": 5.0, "eval/worker_loss_std": 0.125,
         "eval/worker_excess_mean": 0.125, "eval/worker_excess_max": 0.25}
  assert metrics_rules.row_error(row) is None
  workdir = _log(tmp_path, dict(row, **{"eval/worker_excess_max": 0.5}), 2)
  assert ("line 3: eval/worker_excess_max is 0.5, but eval/worker_loss_max "
          "5.25 - eval/loss_subset 5.0 = 0.25") in _resume_error(workdir)


# A log across a schedule change: peak 3e-3 up to step 6 (warmup lr by
# hand 5.8e-4 at step 6), then peak 4e-4 from step 7 on.
CHANGED = [[0, 1, 2, 3e-3], [6, 1, 2, 4e-4]]


@pytest.mark.parametrize("history, step, want", [
    (CHANGED, 0, 3e-3), (CHANGED, 6, 3e-3), (CHANGED, 7, 4e-4),
    ([[0, 1, 2]], 3, None),  # a segment without its peak: not known
    ([[4, 1, 2, 1e-3]], 4, None), ([[4, 1, 2, 1e-3]], 5, 1e-3),
    (None, 3, None)])
def test_the_peak_a_record_was_written_under(history, step, want):
  assert metrics_resume.peak_at(history, step) == want


def test_records_are_checked_against_their_own_segment_s_peak(tmp_path):
  """Records written before a resume lowered the peak (lr 5.8e-4 > 4e-4)
  stay intact; one after it above 4e-4 is damage; without a history the
  lr rule is skipped (a resume may have changed the peak)."""
  path = tmp_path / metrics.METRICS_FILE
  lrs = [(5, 4.9e-4), (6, 5.8e-4), (7, 1.0e-4), (8, 1.04e-4)]
  path.write_text("".join(json.dumps({  # evaluated: 6, 8 (eval_interval 2)
      "step": s, "lr": lr, "train/loss": 5.0, "train_time_s": float(s),
      **(EVAL if s in (6, 8) else {})}) + "\n" for s, lr in lrs))
  config = dict(CONFIG, schedule={"peak_lr": 4e-4})
  assert metrics.truncate_after(str(tmp_path), 8, config, CHANGED) == 0
  path.write_text(path.read_text().replace("0.000104", "0.0005"))
  with pytest.raises(metrics.MetricsError, match="line 4: lr must be <= "
                     "schedule.peak_lr 0.0004"):
    metrics.truncate_after(str(tmp_path), 8, config, CHANGED)
  assert metrics.truncate_after(str(tmp_path), 8, config, None) == 0


def test_the_history_records_a_changed_peak_as_a_new_segment():
  assert metrics_resume.schedule_history(
      [[0, 1, 2, 3e-3]], 6, 1, 2, 4e-4) == CHANGED
  assert metrics_resume.schedule_history(CHANGED, 8, 1, 2, 4e-4) == CHANGED
  meta = {"step": 8, "data_position": 8, "config": dict(
      CONFIG, schedule={"peak_lr": 5e-4}), metrics_resume.SCHEDULE_KEY:
          CHANGED}
  assert ("last segment [6, 1, 2, 0.0004] disagrees with "
          "config.schedule.peak_lr=0.0005") in meta_schema.meta_error(meta)


# -- a non-finite loss at the first step of a resumed invocation -------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _tiny(steps: int, *extra: str):
  """A tiny gpt_tiny config of ``steps`` steps, checkpointed every 2."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
       "model.block_size=8", "global_batch=16", "eval_interval=0",
       "checkpoint_interval=2", f"steps={steps}", *extra])


class _Restored:
  """The checkpointer a stopped resumed run holds: checkpoint 6 restored,
  without checksums (``verify``: unverified), none kept."""
  directory = "ckpts"

  def last_good_step(self):
    return None, False

  def verify(self, step):
    return "unverified", "no SHA256SUMS"

  def step_dir(self, step):
    return f"ckpts/{step}"


def test_a_non_finite_first_loss_after_a_resume_names_the_checkpoint():
  """Resumed from checkpoint 6, step 7's loss is taken at the restored
  state before any update of this invocation: the learning rate plays no
  part; the restored (unverified) checkpoint is named. Step 8's loss
  still names the rates; step 7's parameters after an update name the
  checkpoint first, then the rates as the alternative."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import recorder  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  nan_loss = {"loss": np.array([2.0, np.nan]),
              "finite": np.array([True, False])}
  bad_params = {"loss": np.array([2.0, 2.0]),
                "finite": np.array([True, False])}
  text = str(recorder.non_finite_error(7, nan_loss, _Restored(), c,
                                       resumed_at=6))
  assert ("the state restored unverified (it has no SHA256SUMS) from "
          "checkpoint 6, ckpts/6)") in text, text
  assert "Lower config.schedule.peak_lr" not in text, text
  for step, m in ((8, nan_loss), (7, bad_params)):
    text = str(recorder.non_finite_error(step, m, _Restored(), c,
                                         resumed_at=6))
    assert "ower config.schedule.peak_lr (now" in text, text
    assert ("checkpoint 6 (ckpts/6)" in text) == (step == 7), text


@pytest.mark.slow  # two tiny training runs
def test_a_restored_checkpoint_with_nan_parameters_is_named(tmp_path):
  """Checkpoint 2 re-saved with NaN parameters and its SHA256SUMS removed
  (restored unverified, as documented): the resumed run stops at step 3
  naming that checkpoint, not the learning rate."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from conftest import require_devices  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import experiment as experiment_lib  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import train  # pylint: disable=g-import-not-at-top
  require_devices(8)
  workdir = str(tmp_path / "run")
  config = _tiny
  exp = experiment_lib.Experiment(config(2))
  train.train_and_evaluate(config(2), workdir, experiment=exp)
  ckpts = os.path.join(workdir, "checkpoints")
  with checkpoint.Checkpointer(ckpts) as ckpt:
    state, meta = ckpt.restore(2, exp.init_state())
  poisoned = jax.tree_util.tree_map(
      lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x,
      state)
  shutil.rmtree(os.path.join(ckpts, "2"))
  with checkpoint.Checkpointer(ckpts) as ckpt:
    ckpt.save(2, poisoned, meta)
  os.remove(os.path.join(ckpts, "2", workdir_lib.SUMS_FILE))
  with pytest.raises(FloatingPointError) as info:
    train.train_and_evaluate(config(4), workdir)
  text = str(info.value)
  assert "at step 3" in text and "restored unverified" in text, text
  assert os.path.join(ckpts, "2") in text, text
  assert "Lower config.schedule.peak_lr" not in text, text


def test_a_log_line_with_an_over_long_integer_is_a_damaged_log(tmp_path):
  """A resumed run sets such a log aside (MetricsError naming the line),
  it does not stop with Python's raw digit-limit ValueError."""
  workdir = _log(tmp_path)
  path = tmp_path / metrics.METRICS_FILE
  path.write_text(path.read_text().replace('"train_time_s": 2.0',
                                           f'"train_time_s": {BIG}'))
  assert "line 3: not a JSON record" in _resume_error(workdir)


@pytest.mark.slow  # three tiny training runs
def test_a_log_written_before_a_lowered_peak_stays_whole(tmp_path, caplog):
  """peak_lr 3e-3 for 6 steps, resumed to 8 with peak 4e-4 (accepted), then
  to 10: the records of steps 1-6 (lr above 4e-4 at step 6 of the
  warmup, by hand) are intact, not set aside; the document records the
  two peaks and where each invocation ended."""
  from conftest import require_devices  # pylint: disable=g-import-not-at-top
  from decentral_jax.runner import train  # pylint: disable=g-import-not-at-top
  require_devices(8)
  workdir = str(tmp_path / "run")
  low = ("schedule.peak_lr=0.0004", "schedule.final_lr=0.00001")
  train.train_and_evaluate(_tiny(6, "log_interval=1"), workdir)
  caplog.set_level("WARNING")
  for steps in (8, 10):
    train.train_and_evaluate(_tiny(steps, "log_interval=1", *low), workdir)
  assert not [r for r in caplog.records if "moved it to" in r.getMessage()]
  got = metrics.read_jsonl(os.path.join(workdir, metrics.METRICS_FILE))
  assert [r["step"] for r in got] == list(range(1, 11))
  # Warmup from peak / 30 = 1e-4, rising (3e-3 - 1e-4) / 30 per step.
  assert got[5]["lr"] == pytest.approx(1e-4 + 5 * 2.9e-3 / 30, rel=1e-6)
  assert got[5]["lr"] > 4e-4
  assert not os.path.lexists(os.path.join(workdir, metrics.CORRUPT_FILE))
  with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    meta = ckpt.restore_meta(10)
  # Each invocation that ran to its end closes its segment at its last step.
  assert meta[metrics_resume.SCHEDULE_KEY] == [[0, 1, 0, 3e-3, 6],
                                               [6, 1, 0, 4e-4, 8],
                                               [8, 1, 0, 4e-4]]


def test_a_save_writes_the_document_as_it_was_when_the_save_started(
    tmp_path, monkeypatch):
  """The log window's lists go on growing while Orbax writes in the
  background: the document written is the one of the save's step (a later
  step's losses in it made a genuine checkpoint look corrupt)."""
  handed = []
  real = checkpoint.ocp.args.JsonSave

  def spy(item):
    handed.append(item)
    return real(item)

  monkeypatch.setattr(checkpoint.ocp.args, "JsonSave", spy)
  window = {"losses": [2.5], "accs": []}
  meta = {"step": 3, "metrics_window": window}
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    ckpt.save(3, {"x": np.zeros(2, np.float32)}, meta)
    window["losses"].append(9.0)  # the next step, while the write runs
    ckpt.wait()
    assert handed[0]["metrics_window"]["losses"] == [2.5]
    assert ckpt.restore_meta(3)["metrics_window"]["losses"] == [2.5]


@pytest.mark.parametrize("text, key", [
    ('{"events": [1], "events": []}', "events"),
    ('{"events": [{"state": "dead", "worker": 3, "state": "slow"}]}',
     "state"),
    ('[{"a": {"b": 1, "b": 1}}]', "b"),  # even the same value twice
])
def test_a_key_given_twice_is_damage_naming_the_key(text, key):
  """json.loads keeps the last of a repeated key; which value was meant is
  unknown, so every reader of parse_json refuses the file, naming the key."""
  got = records.parse_json(text.encode(), "f.json")
  assert isinstance(got, records.Damaged), got
  assert got.key == key, got
  assert str(got) == f"f.json: holds the key '{key}' twice in one object; " \
      "keep one", got


def test_a_metrics_line_with_a_key_twice_is_damage(tmp_path):
  rows = "".join(json.dumps(r) + "\n" for r in GOOD).splitlines(True)
  rows[2] = rows[2].replace('"train/loss": 5.4', '"train/loss": 5.4, '
                            '"train/loss": 1.0')
  assert rows[2].count("train/loss") == 2
  (tmp_path / metrics.METRICS_FILE).write_text("".join(rows))
  text = _resume_error(str(tmp_path))
  assert "line 3: not a JSON record (holds the key 'train/loss' twice" \
      in text, text
  # A last line without its newline is a torn write only if it is not
  # JSON; one holding a key twice is no torn write of any writer.
  got = records.parse_jsonl(b'{"step": 1}\n{"step": 2, "step": 3}', "m")
  assert isinstance(got, records.Damaged) and got.key == "line 2", got


def _corrupt_newest(tmp_path) -> str:
  """checkpoints/3 intact, checkpoints/5 failing its checksum."""
  root = tmp_path / "checkpoints"
  for step in (3, 5):
    (root / str(step)).mkdir(parents=True)
    (root / str(step) / "a").write_text("a")
    workdir_lib.write_sums(str(root / str(step)))
  (root / "5" / "a").write_text("b")
  return str(root)


def test_a_dangling_link_at_the_corrupt_name_is_not_free(tmp_path):
  """os.path.exists is False for a dangling link; renaming a directory
  onto it fails (ENOTDIR). The next free name is used."""
  root = _corrupt_newest(tmp_path)
  os.symlink(str(tmp_path / "nowhere"), os.path.join(root, "5.corrupt"))
  with checkpoint.Checkpointer(root) as ckpt:
    assert ckpt.select_restore_step() == 3
  assert sorted(os.listdir(root)) == ["3", "5.corrupt", "5.corrupt-2"]
  assert os.path.islink(os.path.join(root, "5.corrupt"))


def test_a_corrupt_checkpoint_that_cannot_be_moved_is_one_line(
    tmp_path, monkeypatch):
  import errno  # pylint: disable=import-outside-toplevel
  root = _corrupt_newest(tmp_path)

  def rename(src, dst):
    raise OSError(errno.EXDEV, "Invalid cross-device link", src)

  monkeypatch.setattr(checkpoint.os, "rename", rename)
  with checkpoint.Checkpointer(root) as ckpt:
    with pytest.raises(checkpoint.CheckpointError) as info:
      ckpt.select_restore_step()
  text = str(info.value)
  src = os.path.join(root, "5")
  assert text == (f"cannot move {src} to {src}.corrupt: Invalid "
                  "cross-device link (EXDEV); move the corrupt one away "
                  "and run again."), text


def test_a_file_not_the_run_s_beside_an_intact_checkpoint_is_no_damage(
    tmp_path):
  """Every listed file verifies (hashes by hashlib), but a ``.DS_Store``
  or a note sits beside them: one line naming the files and the fix; the
  trained checkpoint is never moved aside nor an older one used. An
  unlisted file inside an item's directory stays damage."""
  root = tmp_path / "checkpoints"
  for step in (3, 5):
    (root / str(step) / "state").mkdir(parents=True)
    (root / str(step) / "state" / "a").write_bytes(b"a")
    (root / str(step) / workdir_lib.SUMS_FILE).write_text(
        hashlib.sha256(b"a").hexdigest() + "  state/a\n")
  (root / "5" / ".DS_Store").write_bytes(b"\0")
  (root / "5" / "state" / ".a.swp").write_bytes(b"")
  step_dir = os.path.join(str(root), "5")
  assert checkpoint_files.check_checkpoint(step_dir) == (
      "extra", "every file SHA256SUMS lists verifies, but .DS_Store and "
      "state/.a.swp are not the run's")
  with checkpoint.Checkpointer(str(root)) as ckpt:
    with pytest.raises(checkpoint.CheckpointError) as info:
      ckpt.select_restore_step()
    assert str(info.value) == (
        f"checkpoint 5 ({step_dir}): every file SHA256SUMS lists verifies, "
        "but .DS_Store and state/.a.swp are not the run's; move the file(s) "
        "named out of that directory and run again.")
    assert sorted(os.listdir(root)) == ["3", "5"]
    assert ckpt.last_good_step() == (5, True)  # its listed files verify
  os.remove(os.path.join(step_dir, ".DS_Store"))
  os.remove(os.path.join(step_dir, "state", ".a.swp"))
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() == 5
  # A changed listed file is corrupt, a stray file beside it or not.
  (root / "5" / "notes.txt").write_text("lr sweep")
  (root / "5" / "state" / "a").write_bytes(b"b")
  assert checkpoint_files.check_checkpoint(step_dir) == (
      "corrupt", "state/a does not match its checksum")
  # Unlisted inside an item's directory: a lost line or a swapped file.
  (root / "3" / "state" / "b").write_bytes(b"b")
  assert checkpoint_files.check_checkpoint(str(root / "3")) == (
      "corrupt", "SHA256SUMS does not list state/b")
  os.remove(root / "3" / "state" / "b")
  with checkpoint.Checkpointer(str(root)) as ckpt:
    assert ckpt.select_restore_step() == 3
  assert sorted(os.listdir(root)) == ["3", "5.corrupt"]
