"""The work-directory lock (``run.lock``) without a training run.

A run that is refused a held directory end to end is in tests/test_faults.py
(integration tier).
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from decentral_jax.runner import workdir as workdir_lib


def test_a_held_lock_refuses_a_second_holder_and_names_it(tmp_path):
  workdir = str(tmp_path / "run")
  with workdir_lib.WorkdirLock(workdir) as held:
    with open(held.path, encoding="utf-8") as f:
      record = json.load(f)
    assert (record["pid"], record["host"]) == (os.getpid(),
                                               socket.gethostname())
    with pytest.raises(workdir_lib.WorkdirInUse) as info:
      workdir_lib.WorkdirLock(workdir).acquire()  # a second open file
    message = str(info.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert held.path in message and isinstance(info.value, ValueError)
    assert sorted(os.listdir(workdir)) == [workdir_lib.LOCK_FILE]
  with open(held.path, encoding="utf-8") as f:
    assert f.read() == ""  # released: emptied, never deleted
  with workdir_lib.WorkdirLock(workdir) as again:  # free again, no takeover
    assert again.previous is None


def test_hold_is_reentrant_in_its_thread_only(tmp_path):
  import threading  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "run")
  with workdir_lib.hold(workdir) as outer:
    with workdir_lib.hold(workdir) as inner:  # the same holder
      assert inner is outer
    # Leaving the inner block released nothing.
    with pytest.raises(workdir_lib.WorkdirInUse):
      workdir_lib.WorkdirLock(workdir).acquire()
    errors = []

    def other_thread():
      try:
        with workdir_lib.hold(workdir):
          pass
      except workdir_lib.WorkdirInUse as e:
        errors.append(e)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(errors) == 1  # another thread is another run
  with workdir_lib.WorkdirLock(workdir):  # released by the outer block
    pass


def test_clear_removes_only_a_run_s_entries_and_keeps_the_lock(tmp_path):
  workdir = tmp_path / "run"
  with workdir_lib.hold(str(workdir)):
    (workdir / "checkpoints" / "5").mkdir(parents=True)
    (workdir / "config.json").write_text("{}")
    (workdir / "data.bin").write_text("someone's data")
    with pytest.raises(ValueError) as info:
      workdir_lib.clear(str(workdir), ("config.json", "checkpoints"))
    message = str(info.value)
    assert "\n" not in message and f"{workdir} is not a run directory" in \
        message and "'data.bin'" in message
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json",
                                           "data.bin", workdir_lib.LOCK_FILE]
    (workdir / "data.bin").unlink()
    workdir_lib.clear(str(workdir), ("config.json", "checkpoints",
                                     "metrics.jsonl"))
    assert os.listdir(workdir) == [workdir_lib.LOCK_FILE]  # still held
    with pytest.raises(workdir_lib.WorkdirInUse):
      workdir_lib.WorkdirLock(str(workdir)).acquire()
