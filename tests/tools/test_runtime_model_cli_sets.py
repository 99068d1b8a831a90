"""``measure`` and ``calibrate``: the config fields ``--set`` may change are
those the command's timings read, and a config they cannot time is
refused in one line, in ``--set FIELD=VALUE`` spelling, before JAX runs."""

import pytest

from decentral_jax.tools.runtime_model_cli import main as cli


@pytest.fixture
def no_work(monkeypatch):
  """measure's and calibrate's work and calibrate's device check replaced
  by a stop: a run that gets there raises "reached"."""
  from decentral_jax.runner import devices  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import calibrate, measure  # pylint: disable=import-outside-toplevel
  def reached(*a, **k):
    raise ValueError("reached")
  monkeypatch.setattr(measure, "measure", reached)
  monkeypatch.setattr(calibrate, "calibrate", reached)
  monkeypatch.setattr(devices, "check_simulated_devices", lambda *a: None)


def _errors(capsys) -> list:
  return capsys.readouterr().err.strip().splitlines()


def test_calibrate_refuses_one_worker(no_work, capsys):
  # one worker sends nothing: the all-reduce fit had no data (alpha 0,
  # beta at its clamp) and was printed as a fit
  assert cli.main(["calibrate", "--config", "gpt_tiny", "--set",
                   "n_workers=1", "--set", "global_batch=2"]) == 2
  err = _errors(capsys)
  assert len(err) == 1 and err[0].startswith(
      "error: config.n_workers=1: calibrate needs at least 2 workers"), err
  assert "--set n_workers=2 or more" in err[0]
  assert cli.main(["calibrate", "--config", "gpt_tiny", "--set",
                   "n_workers=2"]) == 2
  assert _errors(capsys) == ["error: reached"]


@pytest.mark.parametrize("item", [
    # read by the task both commands build (its evaluation set)
    "eval_batches=1",
    # passed to the train steps calibrate times (a periodic exact average,
    # the consensus distance on log steps)
    "global_avg_interval=4", "log_interval=3", "consensus_at=next_step"])
def test_a_field_the_timed_steps_read_is_accepted(item, no_work, capsys,
                                                  tmp_path):
  for command in (["calibrate"], ["measure", "--out",
                                  str(tmp_path / "c.json")]):
    if command[0] == "measure" and not item.startswith("eval_batches"):
      continue
    assert cli.main([*command, "--config", "gpt_tiny", "--set", item]) == 2
    assert _errors(capsys) == ["error: reached"], (command, item)


@pytest.mark.parametrize("argv", [
    ["--set", "compression.format=int8"],
    ["--set", "compression.format=int8", "--set", "topology=static_ring"],
    ["--set", "compression.block=128"]])
def test_calibrate_refuses_compression_as_untimable(argv, no_work, capsys):
  # was: refused in the runner's spelling, naming a topology the user
  # never chose, with a fix (--set topology=...) that is itself refused
  assert cli.main(["calibrate", "--config", "gpt_tiny", *argv]) == 2
  err = _errors(capsys)
  assert len(err) == 1 and err[0].startswith(f"error: {argv[0]} {argv[1]}: "
                                             "calibrate cannot time "
                                             "compression"), err
  assert "--config." not in err[0] and err[0].endswith("; drop it."), err


def test_calibrate_refuses_a_config_file_with_compression(
    no_work, capsys, tmp_path):
  cfg = tmp_path / "c.py"
  cfg.write_text(
      "from decentral_jax.runner import presets\n\n"
      "def get_config():\n"
      "  c = presets.load_named_or_file('gpt_tiny', [])\n"
      "  c.topology = 'static_ring'\n"
      "  c.compression.format = 'int8'\n"
      "  return c\n")
  assert cli.main(["calibrate", "--config", str(cfg)]) == 2
  err = _errors(capsys)
  assert len(err) == 1 and err[0].startswith(
      "error: config.compression.format='int8' (from --config "), err
  assert "calibrate cannot time compression" in err[0]


def test_each_calibrate_run_gets_only_the_fields_it_reads():
  """A decentralized-only field (comm_dtype, global_avg_interval,
  gossip_rounds) no longer makes the all_reduce run's config invalid; the
  one_peer_exp run keeps it."""
  from decentral_jax.runner import presets, validation  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import calibrate  # pylint: disable=import-outside-toplevel
  sets = ["comm_dtype=bfloat16", "global_avg_interval=4",
          "gossip_rounds=static", "log_interval=3"]
  config = presets.load_named_or_file("gpt_tiny", sets)
  ar = calibrate.run_config(config, "all_reduce")
  validation.check_config(ar)
  assert (ar.algorithm, ar.comm_dtype, ar.global_avg_interval,
          ar.gossip_rounds, ar.log_interval) == ("all_reduce", "", 0, "auto",
                                                 3)
  dec = calibrate.run_config(config, "decentralized")
  validation.check_config(dec)
  assert (dec.algorithm, dec.topology, dec.comm_dtype,
          dec.global_avg_interval, dec.gossip_rounds) == (
              "decentralized", "one_peer_exp", "bfloat16", 4, "static")
  assert config.algorithm == "decentralized" and config.comm_dtype == \
      "bfloat16"  # the loaded config is left as it was


def test_measure_refuses_a_task_error_before_timing_in_set_spelling(
    monkeypatch, capsys, tmp_path):
  """An evaluation set too large (4 * 4194304 * 129 tokens > 2**28) was
  found after the link exchanges, with a fix naming --config.eval_batches,
  not a flag of measure."""
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  def timed(*a, **k):
    raise AssertionError("timed before the task was built")
  monkeypatch.setattr(measure, "_exchange", timed)
  monkeypatch.setattr(measure, "_all_reduce", timed)
  assert cli.main(["measure", "--config", "gpt_tiny", "--out",
                   str(tmp_path / "c.json"), "--local-size", "2", "--set",
                   "global_batch=4194304"]) == 2
  err = _errors(capsys)
  assert len(err) == 1 and err[0].startswith(
      "error: config.eval_batches=4 gives an evaluation set"), err
  # 4194304 * 65 tokens > 2**28 at one batch: the fix is the batch or the
  # context, in measure's spelling.
  assert err[0].endswith("one batch is already too many: lower --set "
                         "global_batch or --set model.block_size."), err
  assert "--config." not in err[0], err
  assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("command", ["measure", "calibrate"])
def test_one_field_set_twice_is_refused(no_work, capsys, command, tmp_path):
  # --set may repeat (one field each); the same field twice ran with the
  # last value and recorded both.
  out = ["--out", str(tmp_path / "c.json")] if command == "measure" else []
  assert cli.main([command, *out, "--config", "gpt_tiny", "--set",
                   "n_workers=2", "--set", "n_workers=4"]) == 2
  assert _errors(capsys) == [
      "error: --set n_workers=4: config.n_workers is given twice "
      "(--set n_workers=2, then --set n_workers=4); give it once."]
  assert cli.main([command, *out, "--config", "gpt_tiny", "--set",
                   "n_workers=2", "--set", "global_batch=4"]) == 2
  assert _errors(capsys) == ["error: reached"]


def test_measure_distributed_off_slurm_names_its_fix_in_set_spelling(
    no_work, capsys, tmp_path, monkeypatch):
  """The fix named --config.distributed.* flags, which measure does not
  take ("unrecognized arguments")."""
  monkeypatch.delenv("SLURM_NTASKS", raising=False)
  assert cli.main(["measure", "--config", "gpt_quick", "--out",
                   str(tmp_path / "m.json"), "--set",
                   "distributed.enabled=True"]) == 2
  assert _errors(capsys) == [
      "error: config.distributed.enabled=True but no SLURM job with several "
      "tasks was found to detect the set-up from; give --set "
      "distributed.coordinator_address=HOST:PORT, --set "
      "distributed.num_processes=N and --set distributed.process_id=I (0 on "
      "the coordinator's host)."]
  assert not (tmp_path / "m.json").exists()
