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
