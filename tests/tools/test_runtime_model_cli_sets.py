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
