"""The runtime model's commands refuse an output naming one of their inputs
or another output, before any work: ``predict --png`` over ``--cluster``,
``--workload-file`` or a ``--gossip-in-flight`` file, ``utilisation
--table`` and ``--png`` naming one file."""

import pytest

from decentral_jax.tools.runtime_model_cli import main as cli


@pytest.mark.parametrize("flag", ["--cluster", "--workload-file",
                                  "--gossip-in-flight"])
def test_predict_png_over_an_input_file_is_refused_and_the_file_kept(
    tmp_path, capsys, flag):
  f = tmp_path / "in.png"
  f.write_text('{"schema": "kept"}\n')
  code = cli.main(["predict", flag, str(f), "--png", str(f)])
  assert code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: --png {str(f)!r} is the file {flag} "
                        "reads"), err
  assert f.read_text() == '{"schema": "kept"}\n'


def test_predict_in_flight_fractions_are_no_file(tmp_path, capsys):
  # a fraction is a value, not a path: no clash with a PNG of that name
  code = cli.main(["predict", "--n-workers", "16", "--gossip-in-flight",
                   "0.5", "--methods", "all_reduce,one_peer_exp",
                   "--png", str(tmp_path / "0.5.png")])
  assert code == 0, capsys.readouterr().err
  assert (tmp_path / "0.5.png").read_bytes()[:4] == b"\x89PNG"


def test_utilisation_table_and_png_naming_one_file_are_refused(
    tmp_path, capsys):
  f = tmp_path / "out.png"
  code = cli.main(["utilisation", "--table", str(f), "--png", str(f)])
  assert code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: --png {str(f)!r} is also --table's "
                        "file"), err
  assert not f.exists()  # refused before the table was written
