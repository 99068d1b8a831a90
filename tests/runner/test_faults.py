"""Fault injection: kills, signals, corrupt checkpoints, failed saves, locks.

Every run uses the same tiny gpt_tiny config (20 steps, a checkpoint every
5) as an uninterrupted in-process reference run, so each recovery is
checked bit for bit: the final checkpoint's arrays and every metrics record
except the timings. Three command-line runs (a kill -9 during a save, a
SIGTERM, a save that hits the file size limit) run in the background
while this process compiles and trains; the first fills a JAX compilation
cache that the other two read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import metrics
from decentral_jax.runner import train
from decentral_jax.runner import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 20
RUN = ("--config.model.n_layer=1", "--config.model.n_embd=32",
       "--config.model.n_head=2", "--config.model.block_size=16",
       "--config.global_batch=16", "--config.eval_batches=1",
       "--config.topology=one_peer_exp", "--config.model.dropout=0.1",
       "--config.optimizer.accum_steps=2", f"--config.steps={STEPS}",
       "--config.schedule.warmup_steps=3", "--config.log_interval=5",
       "--config.eval_interval=10", "--config.checkpoint_interval=5")
TIMINGS = ("step_time_ms", "tokens_per_sec", "train_time_s")
CLI_TIMEOUT_S = 240

# Every test trains or starts processes; the file-level checks of the same
# code are in tests/runner/test_metrics.py and tests/runner/test_workdir.py.
pytestmark = pytest.mark.integration


def load():
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                RUN)


@pytest.fixture(scope="module")
def exp():
  require_devices(8)
  return experiment_lib.Experiment(load())


def ckpt_dir(workdir) -> str:
  return os.path.join(str(workdir), "checkpoints")


def final_state(exp, workdir) -> list[np.ndarray]:
  ckpt = checkpoint.Checkpointer(ckpt_dir(workdir))
  try:
    assert ckpt.latest_step() == STEPS
    assert ckpt.verify(STEPS) == ("ok", "")
    state, _ = ckpt.restore(STEPS, exp.init_state())
  finally:
    ckpt.close()
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def records(workdir) -> list[dict]:
  rows = metrics.read_jsonl(os.path.join(str(workdir), metrics.METRICS_FILE))
  return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


@pytest.fixture(scope="module")
def reference(exp, tmp_path_factory):
  """The uninterrupted run: (workdir, final arrays, metrics records)."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  rows = records(workdir)
  assert [r["step"] for r in rows] == [0, 5, 10, 15, 20]
  return workdir, final_state(exp, workdir), rows


def assert_same_as_reference(exp, reference, workdir) -> None:
  _, arrays, rows = reference
  got = final_state(exp, workdir)
  assert len(got) == len(arrays)
  for a, b in zip(got, arrays):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert records(workdir) == rows


def copy_run(reference, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  return workdir


def lock_holder(workdir) -> dict:
  path = os.path.join(str(workdir), workdir_lib.LOCK_FILE)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  return json.loads(text) if text.strip() else {}


def holds_lock(workdir, pid: int) -> bool:
  try:
    return lock_holder(workdir).get("pid") == pid
  except (OSError, ValueError):  # not written yet, or being written
    return False


# -- command-line runs in the background ---------------------------------------


class Cli:
  """``experiments/train.py`` in a subprocess with its output collected."""

  def __init__(self, workdir, *extra, cache: str, limit_file_bytes=None):
    self.workdir = str(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
               XLA_FLAGS=" ".join(
        f for f in env.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in f))

    argv = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
            f"--config={os.path.join(ROOT, 'configs', 'gpt_tiny.py')}",
            f"--workdir={self.workdir}", *RUN, *extra]
    if limit_file_bytes:  # no file may grow past this: EFBIG
      argv = ["sh", "-c", f"ulimit -f {limit_file_bytes // 1024} && "
              'exec "$@"', "sh", *argv]
    self.proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    self.lines = []
    self.notes = {}
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for raw in self.proc.stdout:
      self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

  @property
  def output(self) -> str:
    return "\n".join(self.lines)

  def wait_until(self, predicate, what: str, timeout_s=CLI_TIMEOUT_S,
                 poll_s=0.05):
    deadline = time.monotonic() + timeout_s
    while not predicate():
      if self.proc.poll() is not None:
        raise AssertionError(f"the run ended before {what}:\n{self.output}")
      if time.monotonic() > deadline:
        raise AssertionError(f"no {what} in {timeout_s} s:\n{self.output}")
      time.sleep(poll_s)

  def wait(self, timeout_s=CLI_TIMEOUT_S) -> int:
    code = self.proc.wait(timeout=timeout_s)
    self._reader.join(timeout=10)
    return code

  def kill(self):
    if self.proc.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()


def stopped(pid: int) -> bool:
  with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
    return f.read().rsplit(")", 1)[1].split()[0] == "T"


def refuse_then_kill_during_save(run: Cli) -> None:
  """While ``run`` holds its workdir a second run must be refused; then
  ``run`` is frozen while a save of step >= 10 is in flight and killed."""
  pid = run.proc.pid
  run.wait_until(lambda: holds_lock(run.workdir, pid), "lock record")
  try:
    train.train_and_evaluate(load(), run.workdir)
    run.notes["refused"] = None
  except workdir_lib.WorkdirInUse as e:
    run.notes["refused"] = str(e)
  directory = ckpt_dir(run.workdir)

  def in_flight():
    if not os.path.isdir(directory):
      return []
    return [n for n in os.listdir(directory) if checkpoint.TMP_SUFFIX in n
            and int(n.split(".")[0]) >= 10]

  while True:
    run.wait_until(in_flight, "save of step >= 10", poll_s=0.002)
    os.kill(pid, signal.SIGSTOP)
    run.wait_until(lambda: stopped(pid), "stop", poll_s=0.001)
    if names := in_flight():  # frozen with the save still in flight
      run.notes["killed_during"] = names[0]
      os.kill(pid, signal.SIGKILL)
      return
    os.kill(pid, signal.SIGCONT)


def sigterm_before_first_step(run: Cli) -> None:
  """SIGTERM once the run has announced its layout (handlers installed)."""
  run.wait_until(lambda: any("workers on 1 process(es)" in l
                             for l in run.lines), "start-up", poll_s=0.002)
  os.kill(run.proc.pid, signal.SIGTERM)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  """The three runs; the first fills a compilation cache the others read."""
  root = tmp_path_factory.mktemp("cli")
  cache = str(root / "jax_cache")
  runs = {"kill9": Cli(root / "kill9", cache=cache)}
  watchers = {"kill9": threading.Thread(
      target=refuse_then_kill_during_save, args=(runs["kill9"],), daemon=True)}

  def start_the_others():
    with contextlib.suppress(AssertionError):  # it ended: start them anyway
      runs["kill9"].wait_until(lambda: any(
          "step 5:" in l for l in runs["kill9"].lines), "step 5")
    runs["sigterm"] = Cli(root / "sigterm", cache=cache)
    runs["full"] = Cli(root / "full", cache=cache,
                       limit_file_bytes=256 << 10)
    watchers["sigterm"] = threading.Thread(
        target=sigterm_before_first_step, args=(runs["sigterm"],),
        daemon=True)
    watchers["sigterm"].start()

  watchers["kill9"].start()
  starter = threading.Thread(target=start_the_others, daemon=True)
  starter.start()
  yield runs, watchers, starter
  starter.join(timeout=CLI_TIMEOUT_S)
  for run in runs.values():
    run.kill()


def finish_watcher(cli_runs, name: str) -> Cli:
  runs, watchers, starter = cli_runs
  starter.join(timeout=CLI_TIMEOUT_S)
  if name in watchers:
    watchers[name].join(timeout=CLI_TIMEOUT_S)
    assert not watchers[name].is_alive(), runs[name].output
  return runs[name]


# -- tests ----------------------------------------------------------------------


def test_kill_9_during_save_resumes_bit_exactly(cli_runs, exp, reference,
                                                caplog):
  """kill -9 with a save in flight; a second run was refused meanwhile."""
  run = finish_watcher(cli_runs, "kill9")
  assert run.wait() == -signal.SIGKILL
  refused = run.notes["refused"]
  assert refused is not None, "a second run on a live workdir started"
  assert f"pid {run.proc.pid} on host" in refused and run.workdir in refused
  assert "\n" not in refused
  tmp = os.path.join(ckpt_dir(run.workdir), run.notes["killed_during"])
  assert os.path.isdir(tmp)  # the save was cut short
  committed = [int(n) for n in os.listdir(ckpt_dir(run.workdir))
               if n.isdigit()]
  assert committed and max(committed) < STEPS
  caplog.set_level("WARNING")
  train.train_and_evaluate(load(), run.workdir, experiment=exp)
  assert not os.path.exists(tmp)
  text = caplog.text
  assert f"removed {tmp}" in text
  assert "taking over the lock" in text
  assert f"pid {run.proc.pid} is no longer running" in text
  assert lock_holder(run.workdir) == {}  # released
  assert_same_as_reference(exp, reference, run.workdir)


def test_sigterm_cli_saves_exits_143_and_resumes(cli_runs, exp, reference):
  """SIGTERM before the first step: stop after it (or soon after)."""
  run = finish_watcher(cli_runs, "sigterm")
  assert run.wait() == 128 + signal.SIGTERM, run.output
  directory = ckpt_dir(run.workdir)
  said = [l for l in run.lines if l.startswith("preempted: ")]
  assert len(said) == 1, run.output
  step = int(said[0].split(" after step ")[1].split(";")[0])
  assert 1 <= step < STEPS
  assert said[0] == (f"preempted: stopped by SIGTERM after step {step}; "
                     f"checkpoint {step} is saved in {directory}: run the "
                     "same command again to resume.")
  ckpt = checkpoint.Checkpointer(directory)
  assert ckpt.latest_step() == step and ckpt.verify(step) == ("ok", "")
  ckpt.close()
  assert lock_holder(run.workdir) == {}
  train.train_and_evaluate(load(), run.workdir, experiment=exp)
  assert_same_as_reference(exp, reference, run.workdir)


def test_full_file_system_on_a_save_is_one_line(cli_runs):
  """A real write error inside TensorStore (RLIMIT_FSIZE: EFBIG)."""
  run = finish_watcher(cli_runs, "full")
  assert run.wait() == 2, run.output
  directory = ckpt_dir(run.workdir)
  errors = [l for l in run.lines if "error" in l.lower()]
  assert errors == [f"error: checkpoint 5 could not be saved in {directory}: "
                    "File too large (EFBIG)"], run.output
  assert "Traceback" not in run.output and "Event loop" not in run.output
  assert os.listdir(directory) == [], run.output  # partial save removed
  assert lock_holder(run.workdir) == {}


@pytest.mark.parametrize("damage", ["random_bytes", "truncated",
                                    "missing_state", "emptied"])
def test_damaged_newest_checkpoint_falls_back(exp, reference, tmp_path,
                                              caplog, damage):
  workdir = copy_run(reference, tmp_path)
  newest = os.path.join(ckpt_dir(workdir), str(STEPS))
  files = [os.path.join(d, f) for d, _, names in os.walk(newest)
           for f in names]
  data = max(files, key=os.path.getsize)
  if damage == "random_bytes":
    with open(data, "r+b") as f:
      f.seek(os.path.getsize(data) // 2)
      f.write(np.random.default_rng(0).bytes(64))
  elif damage == "truncated":
    os.truncate(data, os.path.getsize(data) // 3)
  elif damage == "emptied":
    shutil.rmtree(newest)
    os.mkdir(newest)
  else:
    shutil.rmtree(os.path.join(newest, "state"))
  caplog.set_level("WARNING")
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  warned = [r.getMessage() for r in caplog.records
            if "is corrupt" in r.getMessage()]
  older = os.path.join(ckpt_dir(workdir), "15")
  assert len(warned) == 1 and "\n" not in warned[0]
  assert warned[0].startswith(f"checkpoint {STEPS} ({newest}) is corrupt: ")
  assert warned[0].endswith(f"moved it to {newest}.corrupt and resuming from "
                            f"checkpoint 15 ({older}) instead.")
  assert os.path.isdir(newest + ".corrupt")
  assert_same_as_reference(exp, reference, workdir)  # redone from step 15


def test_no_intact_checkpoint_is_an_error(exp, reference, tmp_path):
  workdir = copy_run(reference, tmp_path)
  for step in (15, STEPS):
    shutil.rmtree(os.path.join(ckpt_dir(workdir), str(step), "state"))
  with pytest.raises(checkpoint.CheckpointError) as info:
    train.train_and_evaluate(load(), str(workdir), experiment=exp)
  message = str(info.value)
  assert "\n" not in message and "no intact checkpoint" in message
  assert "15: missing state/" in message and f"{STEPS}: missing" in message
  assert sorted(os.listdir(ckpt_dir(workdir))) == ["15", str(STEPS)]


def test_a_stray_file_in_the_checkpoint_is_named_and_nothing_retrained(
    exp, reference, tmp_path):
  """A ``.DS_Store`` beside checkpoint 15's verified files: the resume is
  refused in one line naming it, nothing is moved or rewritten; once it is
  moved away the run resumes from 15, bit-exact."""
  workdir = copy_run(reference, tmp_path)
  shutil.rmtree(os.path.join(ckpt_dir(workdir), str(STEPS)))
  step_dir = os.path.join(ckpt_dir(workdir), "15")
  stray = os.path.join(step_dir, ".DS_Store")
  with open(stray, "wb") as f:
    f.write(b"\0\0\0\1Bud1")
  log = os.path.join(str(workdir), metrics.METRICS_FILE)
  with open(log, "rb") as f:
    before = f.read()
  with pytest.raises(checkpoint.CheckpointError) as info:
    train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert str(info.value) == (
      f"checkpoint 15 ({step_dir}): every file SHA256SUMS lists verifies, "
      "but .DS_Store is not the run's; move the file(s) named out of that "
      "directory and run again.")
  assert os.listdir(ckpt_dir(workdir)) == ["15"]
  with open(log, "rb") as f:
    assert f.read() == before
  os.remove(stray)
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert_same_as_reference(exp, reference, workdir)  # redone from step 15


def test_nan_message_names_only_a_verified_checkpoint(exp, tmp_path,
                                                      monkeypatch):
  """Checkpoint 10 is damaged after it was committed: 5 is the good one."""
  workdir = str(tmp_path / "nan")
  clean = exp.get_batch

  def poisoned(step):
    batch = clean(step)
    if step != 12:
      return batch
    committed = os.path.join(ckpt_dir(workdir), "10")
    deadline = time.monotonic() + 60
    while not os.path.isdir(committed) and time.monotonic() < deadline:
      time.sleep(0.01)  # the background save of step 10 commits
    os.remove(os.path.join(committed, "state", "_METADATA"))
    inputs = np.array(batch[0])
    inputs[3, 0, 0] = 10**6  # out-of-range token: NaN embedding
    return (jax.device_put(inputs, batch[0].sharding),) + tuple(batch[1:])

  monkeypatch.setattr(exp, "get_batch", poisoned)
  with pytest.raises(FloatingPointError) as info:
    train.train_and_evaluate(load(), workdir, experiment=exp)
  message = str(info.value)
  assert "step 13 " in message
  assert f"the last good checkpoint (step 5) is kept in {ckpt_dir(workdir)}" \
      in message


def test_failed_save_is_reported_at_its_step(exp, reference, tmp_path,
                                             monkeypatch):
  """ENOSPC in Orbax's background commit of checkpoint 10."""
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=import-outside-toplevel
  real = atomicity.AtomicRenameTemporaryPath.finalize

  failed = threading.Event()

  async def disk_full(self, *args, **kwargs):
    if self.get_final().name == "10":
      failed.set()
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                    str(self.get() / "commit_success.txt"))
    return await real(self, *args, **kwargs)

  steps, train_step = [], exp.train_step

  def slow_after_10(state, batch, step=None):
    steps.append(len(steps))
    if len(steps) == 11:  # however loaded the machine, it failed by now
      assert failed.wait(timeout=120)
    if len(steps) > 10:
      time.sleep(0.25)  # room to notice the failure before the next save
    return train_step(state, batch, step)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize",
                      disk_full)
  monkeypatch.setattr(exp, "train_step", slow_after_10)
  workdir = tmp_path / "run"
  with pytest.raises(checkpoint.CheckpointWriteError) as info:
    train.train_and_evaluate(load(), str(workdir), experiment=exp)
  directory = ckpt_dir(workdir)
  assert str(info.value) == (f"checkpoint 10 could not be saved in "
                             f"{directory}: No space left on device (ENOSPC)")
  assert info.value.errno == errno.ENOSPC
  assert isinstance(info.value, ValueError)  # the CLI: one line, exit 2
  assert len(steps) < 15  # stopped before the next save was due
  assert sorted(os.listdir(directory)) == ["5"]  # no temporary directory
  monkeypatch.undo()
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert_same_as_reference(exp, reference, workdir)


def test_sigterm_in_process_keeps_the_window_and_handlers(exp, reference,
                                                          tmp_path,
                                                          monkeypatch):
  """SIGTERM during step 7 (between two log records): stop after step 7."""
  train_step = exp.train_step

  def signalled(state, batch, step=None):
    if step == 6:
      os.kill(os.getpid(), signal.SIGTERM)
    return train_step(state, batch, step)

  monkeypatch.setattr(exp, "train_step", signalled)
  before = signal.getsignal(signal.SIGTERM)
  workdir = tmp_path / "run"
  with pytest.raises(train.Preempted) as info:
    train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert signal.getsignal(signal.SIGTERM) is before
  assert (info.value.step, info.value.exit_code) == (7, 143)
  ckpt = checkpoint.Checkpointer(ckpt_dir(workdir))
  assert ckpt.all_steps() == [5, 7] and ckpt.verify(7) == ("ok", "")
  assert ckpt.restore_meta(7)["metrics_window"]["losses"]  # steps 6 and 7
  ckpt.close()
  assert lock_holder(workdir) == {}
  monkeypatch.undo()
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert_same_as_reference(exp, reference, workdir)  # same step-10 loss


def test_torn_last_metrics_line_is_dropped(exp, reference, tmp_path, caplog):
  workdir = copy_run(reference, tmp_path)
  shutil.rmtree(os.path.join(ckpt_dir(workdir), str(STEPS)))
  path = os.path.join(str(workdir), metrics.METRICS_FILE)
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()[:4]  # steps 0, 5, 10, 15
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + '\n{"step": 20, "lr": 0.00')  # cut short
  caplog.set_level("WARNING")
  train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert f"{path}: line 5 is incomplete" in caplog.text
  assert_same_as_reference(exp, reference, workdir)


def test_stale_lock_and_leftover_tmp_dir(exp, reference, tmp_path, caplog):
  """A lock record of a dead pid and a temporary save directory."""
  workdir = copy_run(reference, tmp_path)
  dead = subprocess.Popen(["true"])
  dead.wait()
  with open(os.path.join(str(workdir), workdir_lib.LOCK_FILE), "w",
            encoding="utf-8") as f:
    json.dump({"host": os.uname().nodename, "pid": dead.pid,
               "started": "2020-01-01T00:00:00"}, f)
  tmp = os.path.join(ckpt_dir(workdir), f"25{checkpoint.TMP_SUFFIX}")
  os.makedirs(os.path.join(tmp, "state"))
  caplog.set_level("WARNING")
  final = train.train_and_evaluate(load(), str(workdir), experiment=exp)
  assert final["step"] == STEPS
  assert f"pid {dead.pid} is no longer running" in caplog.text
  assert "started 2020-01-01T00:00:00" in caplog.text
  assert f"removed {tmp}" in caplog.text and not os.path.exists(tmp)
  assert lock_holder(workdir) == {}


def test_live_lock_in_this_process_is_refused(exp, tmp_path):
  workdir = str(tmp_path / "run")
  with workdir_lib.WorkdirLock(workdir):
    with pytest.raises(workdir_lib.WorkdirInUse, match=f"pid {os.getpid()}"):
      train.train_and_evaluate(load(), workdir, experiment=exp)
    assert sorted(os.listdir(workdir)) == [workdir_lib.LOCK_FILE]


def test_unwritable_workdir_is_one_line(exp, tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  # a file, or a path inside one: was "File exists (EEXIST)", no fix
  fix = ("is a file, or inside one, not a directory; give a directory (it is "
         "created if missing).")
  cases = {str(blocker / "run"): fix, str(blocker): fix}
  read_only = tmp_path / "read_only"
  read_only.mkdir()
  real_open = os.open

  def erofs(path, *args, **kwargs):  # as a read-only mount answers
    if str(path).startswith(str(read_only)):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(os, "open", erofs)
  cases[str(read_only)] = "Read-only file system (EROFS)"
  for workdir, reason in cases.items():
    with pytest.raises(workdir_lib.PathError) as info:
      train.train_and_evaluate(load(), workdir, experiment=exp)
    message = str(info.value)
    assert "\n" not in message and message.endswith(reason), message
    assert workdir in message and isinstance(info.value, ValueError)
