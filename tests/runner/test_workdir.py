"""The work-directory lock (``run.lock``) without a training run.

A run that is refused a held directory end to end is in tests/runner/test_faults.py
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


def test_clear_refuses_a_symlinked_run_folder_and_leaves_no_lock(tmp_path):
  # <outdir>/all_reduce -> elsewhere: the target's files are not ours.
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / "checkpoints" / "5").mkdir(parents=True)
  link = tmp_path / "out" / "all_reduce"
  link.parent.mkdir()
  link.symlink_to(elsewhere, target_is_directory=True)
  with pytest.raises(workdir_lib.NotARunDirectory) as info:
    with workdir_lib.hold(str(link), flag="--outdir"):
      workdir_lib.clear(str(link), ("checkpoints",))
  message = str(info.value)
  assert "\n" not in message and f"{link} is a symbolic link" in message
  assert isinstance(info.value, ValueError)
  # Nothing deleted, and the lock file the refused hold created is gone.
  assert sorted(os.listdir(elsewhere)) == ["checkpoints"]
  assert os.listdir(elsewhere / "checkpoints") == ["5"]
  assert os.path.islink(link)


def test_a_refused_folder_keeps_its_own_lock_file_but_not_ours(tmp_path):
  refused = tmp_path / "data"
  refused.mkdir()
  (refused / "data.bin").write_text("someone's data")
  with pytest.raises(workdir_lib.NotARunDirectory):
    with workdir_lib.hold(str(refused)):
      workdir_lib.clear(str(refused), ("config.json",))
  assert os.listdir(refused) == ["data.bin"]
  # A lock file that was there before is not ours to delete.
  (refused / workdir_lib.LOCK_FILE).write_text("")
  with pytest.raises(workdir_lib.NotARunDirectory):
    with workdir_lib.hold(str(refused)):
      workdir_lib.clear(str(refused), ("config.json",))
  assert sorted(os.listdir(refused)) == ["data.bin", workdir_lib.LOCK_FILE]


def test_a_run_refused_before_it_wrote_anything_leaves_no_lock_file(
    tmp_path):
  # Any error before the body wrote an entry: the lock file we made goes.
  fresh = tmp_path / "run"
  for error in (RuntimeError, ValueError, KeyboardInterrupt):
    with pytest.raises(error):
      with workdir_lib.hold(str(fresh)):
        assert os.listdir(fresh) == [workdir_lib.LOCK_FILE]
        raise error("refused")
    assert os.listdir(fresh) == []
  # A run that wrote something keeps its (emptied) lock file.
  with pytest.raises(RuntimeError):
    with workdir_lib.hold(str(fresh)):
      (fresh / "metrics.jsonl").write_text("{}\n")
      raise RuntimeError("stopped")
  assert sorted(os.listdir(fresh)) == ["metrics.jsonl", workdir_lib.LOCK_FILE]
  assert (fresh / workdir_lib.LOCK_FILE).read_text() == ""
  # A lock file that was there before is kept whatever the body did.
  (fresh / "metrics.jsonl").unlink()
  with pytest.raises(RuntimeError):
    with workdir_lib.hold(str(fresh)):
      raise RuntimeError("refused")
  assert os.listdir(fresh) == [workdir_lib.LOCK_FILE]
  # Leaving normally keeps it too (it is never deleted then).
  other = tmp_path / "other"
  with workdir_lib.hold(str(other)):
    pass
  assert os.listdir(other) == [workdir_lib.LOCK_FILE]


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  target = tmp_path / "notes.txt"
  target.write_text("someone's notes\n")
  (workdir / workdir_lib.LOCK_FILE).symlink_to(target)
  for take in (lambda: workdir_lib.WorkdirLock(str(workdir)).acquire(),
               lambda: workdir_lib.hold(str(workdir)).__enter__()):
    with pytest.raises(workdir_lib.PathError) as info:
      take()
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    assert (f"the lock file {workdir / workdir_lib.LOCK_FILE} is a symbolic "
            f"link (to {target})") in message
    assert "someone's notes" not in message
    assert target.read_text() == "someone's notes\n"  # not emptied
    assert os.path.islink(workdir / workdir_lib.LOCK_FILE)
  # A dangling link is refused too (not created through).
  (workdir / workdir_lib.LOCK_FILE).unlink()
  (workdir / workdir_lib.LOCK_FILE).symlink_to(tmp_path / "missing")
  with pytest.raises(workdir_lib.PathError, match="is a symbolic link"):
    workdir_lib.WorkdirLock(str(workdir)).acquire()
  assert not (tmp_path / "missing").exists()


def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  os.mkfifo(workdir / workdir_lib.LOCK_FILE)
  with pytest.raises(workdir_lib.PathError) as info:
    workdir_lib.WorkdirLock(str(workdir)).acquire()
  assert str(info.value).startswith(
      f"the lock file {workdir / workdir_lib.LOCK_FILE} is not a regular "
      "file")


def test_a_lock_file_deleted_before_the_flock_is_opened_again(
    tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  first = workdir_lib.WorkdirLock(workdir)
  first.acquire()
  assert first.created
  first.discard()  # a refused folder: the holder deletes its file
  assert not os.path.exists(first.path)
  # A taker that opened the old file just before another holder deleted
  # it and made a new one: its flock succeeds on a file no path names, so
  # it must open the path again and lock the file there.
  real_flock, calls = workdir_lib.fcntl.flock, []

  def flock(fd, op):
    if not calls:
      os.unlink(first.path)
      open(first.path, "w").close()  # pylint: disable=consider-using-with
    calls.append(os.fstat(fd).st_ino)
    return real_flock(fd, op)

  open(first.path, "w").close()  # pylint: disable=consider-using-with
  monkeypatch.setattr(workdir_lib.fcntl, "flock", flock)
  second = workdir_lib.WorkdirLock(workdir)
  second.acquire()
  assert len(calls) == 2 and calls[0] != calls[1]
  assert calls[1] == os.stat(first.path).st_ino  # the file the path names
  monkeypatch.setattr(workdir_lib.fcntl, "flock", real_flock)
  with pytest.raises(workdir_lib.WorkdirInUse):
    workdir_lib.WorkdirLock(workdir).acquire()
  second.release()


def test_the_in_use_message_names_the_tool_s_flag(tmp_path):
  workdir = str(tmp_path / "run")
  with workdir_lib.hold(workdir):
    for flag in ("--workdir", "--outdir"):
      with pytest.raises(workdir_lib.WorkdirInUse) as info:
        workdir_lib.WorkdirLock(workdir, flag).acquire()
      assert str(info.value).endswith(
          f"wait for it to finish, stop it, or pass another {flag}.")


def test_a_manifest_that_leaves_out_a_required_file_is_corrupt(tmp_path):
  """A SHA256SUMS with a line deleted would let that file be edited
  unchecked: a required file it does not list is damage (hashes by
  hashlib, independent of the manifest writer)."""
  import hashlib  # pylint: disable=import-outside-toplevel
  (tmp_path / "meta").mkdir()
  files = {"meta/metadata": b'{"step": 6}', "state.bin": b"\x00\x01"}
  for rel, data in files.items():
    (tmp_path / rel).write_bytes(data)
  line = lambda rel: f"{hashlib.sha256(files[rel]).hexdigest()}  {rel}\n"  # noqa: E731
  sums = tmp_path / workdir_lib.SUMS_FILE
  sums.write_text(line("meta/metadata") + line("state.bin"))
  required = ("meta/metadata",)
  assert workdir_lib.check_sums(str(tmp_path), required) == ("ok", "")
  sums.write_text(line("state.bin"))  # the metadata's line deleted
  assert workdir_lib.check_sums(str(tmp_path)) == ("ok", "")  # not required
  assert workdir_lib.check_sums(str(tmp_path), required) == (
      "corrupt", "SHA256SUMS does not list meta/metadata")
  (tmp_path / "meta" / "metadata").unlink()  # absent: nothing to list
  assert workdir_lib.check_sums(str(tmp_path), required) == ("ok", "")


def test_a_checkpoint_manifest_must_list_every_file(tmp_path):
  """A checkpoint's SHA256SUMS that leaves any file out (here the state
  arrays, swapped for other ones) is damage, not a file restored unchecked;
  Orbax's two late top-level files are the only ones it need not list
  (hashes by hashlib, independent of the manifest writer)."""
  import hashlib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import checkpoint_files  # pylint: disable=import-outside-toplevel
  (tmp_path / "meta").mkdir()
  (tmp_path / "state" / "d").mkdir(parents=True)
  files = {"meta/metadata": b'{"step": 6}', "state/d/arr": b"\x00\x01",
           "state/_METADATA": b"{}"}
  for rel, data in files.items():
    (tmp_path / rel).write_bytes(data)
  (tmp_path / "commit_success.txt").write_text("ok")  # written after the sums
  line = lambda rel: f"{hashlib.sha256(files[rel]).hexdigest()}  {rel}\n"  # noqa: E731
  sums = tmp_path / workdir_lib.SUMS_FILE
  sums.write_text("".join(line(r) for r in sorted(files)))
  assert checkpoint_files.check_checkpoint(str(tmp_path)) == ("ok", "")
  sums.write_text(line("meta/metadata"))  # only the meta/ line kept
  assert workdir_lib.check_sums(str(tmp_path), ("meta/metadata",)) == (
      "ok", "")  # a partial manifest is fine where completeness is not asked
  assert checkpoint_files.check_checkpoint(str(tmp_path)) == (
      "corrupt", "SHA256SUMS does not list state/_METADATA")
  sums.write_text(line("meta/metadata") + line("state/_METADATA"))
  assert checkpoint_files.check_checkpoint(str(tmp_path)) == (
      "corrupt", "SHA256SUMS does not list state/d/arr")


def test_a_manifest_in_sha256sum_s_binary_form_or_with_a_line_repeated_is_read(
    tmp_path):
  """``sha256sum -b`` writes ``HASH *PATH``, and ``sha256sum -c`` accepts
  it and a repeated line; both were "malformed" (the intact checkpoint was
  moved aside). One path with two checksums is malformed, naming the line."""
  import hashlib  # pylint: disable=import-outside-toplevel
  root = tmp_path / "ckpt"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  (root / "b").write_bytes(b"b")
  da, db = (hashlib.sha256(x).hexdigest() for x in (b"a", b"b"))
  sums = root / workdir_lib.SUMS_FILE
  sums.write_text(f"{da} *a\n{db}  b\n{db}  b\n")
  assert workdir_lib.check_sums(str(root)) == ("ok", "")
  sums.write_text(f"{da.upper()}  a\n{db}  b\n")
  assert workdir_lib.check_sums(str(root)) == ("ok", "")
  sums.write_text(f"{da}  a\n{db}  a\n")
  assert workdir_lib.check_sums(str(root)) == (
      "corrupt", "SHA256SUMS is malformed (line 2 lists 'a' again with "
      "another checksum)")
  sums.write_text(f"{da}  a\nnot a line\n")
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and why.startswith(
      "SHA256SUMS is malformed (line 2 'not a line' is not"), why


def test_a_manifest_larger_than_64_mib_is_damage_unread(tmp_path):
  """A SHA256SUMS grown past 64 MiB (sparse: no disk used) is corrupt,
  naming the file and the cap, without reading it (a 1 GB one took 45 s
  and 6 GB of memory); one at the cap is still read: its zeros after
  line 1 are a malformed line 2."""
  import hashlib  # pylint: disable=import-outside-toplevel
  root = tmp_path / "ckpt"
  root.mkdir()
  (root / "a").write_bytes(b"a")
  sums = root / workdir_lib.SUMS_FILE
  sums.write_text(f"{hashlib.sha256(b'a').hexdigest()}  a\n")
  with open(sums, "r+b") as f:
    f.truncate(64 * 2**20 + 1)
  assert workdir_lib.check_sums(str(root)) == (
      "corrupt", "SHA256SUMS is larger than 67108864 bytes")
  with open(sums, "r+b") as f:
    f.truncate(64 * 2**20)
  status, why = workdir_lib.check_sums(str(root))
  assert status == "corrupt" and "malformed (line 2 " in why, why


def _returns_within(fn, seconds: float = 10.0):
  """``fn()``'s value; fails (instead of hanging the suite) if it blocks."""
  import threading  # pylint: disable=import-outside-toplevel
  out = []
  t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), "blocked (opened a FIFO?)"
  return out[0]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "socket"])
def test_a_run_file_that_is_not_a_regular_file_is_named_unopened(
    tmp_path, kind):
  """A FIFO (an open blocks for ever), a socket, a directory or a link in
  place of a file the run keeps is refused by ``lstat`` before any open."""
  path = tmp_path / "config.json"
  target = tmp_path / "target"
  target.write_text("{}")
  sock = None
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "directory":
    path.mkdir()
  elif kind == "symlink":
    os.symlink(target, path)
  else:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
  try:
    why = workdir_lib.not_regular_error(str(path))
  finally:
    if sock is not None:
      sock.close()
  assert why == {"fifo": "is not a regular file (a FIFO, a socket or a "
                         "device)",
                 "socket": "is not a regular file (a FIFO, a socket or a "
                           "device)",
                 "directory": "is a directory",
                 "symlink": "is a symbolic link, not the run's own file"
                 }[kind], why
  assert workdir_lib.not_regular_error(str(target)) is None
  assert workdir_lib.not_regular_error(str(tmp_path / "absent")) is None


def test_a_manifest_that_is_a_fifo_is_corrupt_not_a_hang(tmp_path):
  (tmp_path / "a").write_text("x")
  os.mkfifo(tmp_path / workdir_lib.SUMS_FILE)
  got = _returns_within(lambda: workdir_lib.check_sums(str(tmp_path)))
  assert got == ("corrupt", f"{workdir_lib.SUMS_FILE} is not a regular file "
                 "(a FIFO, a socket or a device)"), got


def test_the_losses_rule_of_a_run_reads_no_fifo_config(tmp_path):
  """``metrics_rules.workdir_losses_signed`` (every metrics reader asks it)
  with a FIFO as config.json: built-in rules, at once."""
  # pylint: disable-next=import-outside-toplevel
  from decentral_jax.runner import metrics_rules
  os.mkfifo(tmp_path / "config.json")
  assert _returns_within(
      lambda: metrics_rules.workdir_losses_signed(str(tmp_path))) is False


def test_train_refuses_workdir_given_twice(tmp_path, monkeypatch, capsys):
  """``--workdir A --config.workdir=B``: one directory would be dropped
  silently; refused naming both, before anything is written. Either alone
  names the directory trained in."""
  from decentral_jax.tools import train as train_cli  # pylint: disable=import-outside-toplevel
  seen = []
  monkeypatch.setattr(train_cli.train, "train_and_evaluate",
                      lambda config, workdir: seen.append(workdir) or {})
  a, b = str(tmp_path / "A"), str(tmp_path / "B")
  config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), "configs", "gpt_tiny.py")
  for argv in (["--workdir", a, f"--config.workdir={b}"],
               [f"--config.workdir={b}", "--workdir", a],
               ["--workdir", a, "--config.workdir", b]):
    assert train_cli.main(["--config", config, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert f"--workdir={a}" in err[0] and f"--config.workdir={b}" in err[0]
    assert "give one of them" in err[0]
  assert seen == [] and not os.path.exists(a) and not os.path.exists(b)
  assert train_cli.main(["--config", config, f"--config.workdir={b}"]) == 0
  assert train_cli.main(["--config", config, "--workdir", a]) == 0
  assert seen == [b, a]


@pytest.mark.parametrize("make, kind", [
    (lambda p: p.write_text("x"), "a regular file"),
    (lambda p: os.symlink(p, p), "a symbolic link that leads to no directory"),
    (lambda p: os.symlink(p.parent / "gone", p),
     "a symbolic link that leads to no directory"),
    (lambda p: os.mkfifo(p), "not a directory (a FIFO"),
])
def test_a_checkpoints_entry_that_is_no_directory_is_named(
    tmp_path, make, kind):
  """``<workdir>/checkpoints`` of the wrong kind: one line naming what is
  there and the fix, not the OS's "File exists"; nothing is created."""
  from decentral_jax.runner import checkpoint  # pylint: disable=import-outside-toplevel
  path = tmp_path / "checkpoints"
  make(path)
  with pytest.raises(workdir_lib.PathError) as info:
    checkpoint.Checkpointer(str(path))
  text = str(info.value)
  assert "\n" not in text and f"{path} is {kind}" in text, text
  assert "move it away" in text and "File exists" not in text, text
  assert os.listdir(tmp_path) == ["checkpoints"]
  assert not os.path.isdir(path)
