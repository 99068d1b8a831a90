"""Your own model and data in the runner: an MLP-Mixer on Grain-read images.

The model and the data live outside the package, in ``experiments/mixer.py``
(a Flax Linen MLP-Mixer; striped images in ArrayRecord files read through
``grain.MapDataset``), and are named in the run config as
``"mixer:make_mixer"`` and ``"mixer:stripes_data"``. This script writes the
data files, trains with DAdam (decentralized AdamW on one-peer exponential
gossip) with checkpoints, trains a second copy in two halves (stopped, then
resumed from its checkpoint) and checks that both end bit for bit equal,
then prices the run on a cluster with the runtime model (``decentral-jax
predict``) from the model's parameter count. Every flag, ``--preset`` and
``--n-workers-priced`` by predict's own rules too, is checked before any
training (one ``error:`` line, exit 2). The same command again, also after
SIGTERM (one ``preempted:`` line, exit 143), resumes where it stopped::

  pip install -r requirements-extras.txt      # grain
  python experiments/own_model.py --workdir runs/own_model

The same config trains from the command line (``experiments/`` is on the
path there, so ``mixer`` imports)::

  python experiments/train.py --config experiments/own_model.py \\
      --workdir runs/own --config.data.options.path=runs/own_model/data

docs/extending.md explains each extension point.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from decentral_jax.checks import INT32_MAX  # NumPy only
from decentral_jax.tools import flag_types  # no JAX

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
  sys.path.insert(0, HERE)  # `mixer` is the user's module beside this file


def get_config():
  """The run config: the Mixer on the striped images with DAdam."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.base_config("mixer:make_mixer")
  c.model.options.patch = 4
  c.model.options.width = 32
  c.model.options.depth = 2
  c.model.options.classes = 4
  c.data.source = "mixer:stripes_data"
  c.data.options.path = os.path.join("runs", "own_model", "data")
  c.algorithm, c.topology = "decentralized", "one_peer_exp"
  c.n_workers, c.global_batch = 4, 64
  c.optimizer.name, c.optimizer.accum_steps = "adamw", 1
  # inverse_sqrt does not depend on `steps`, so a run stopped at half of
  # them (main's second copy) is the same run up to there.
  c.schedule.name, c.schedule.peak_lr = "inverse_sqrt", 3e-3
  c.steps, c.schedule.warmup_steps = 60, 10
  c.log_interval, c.eval_interval, c.eval_batches = 10, 30, 4
  c.checkpoint_interval = 30
  return c


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default=os.path.join("runs", "own_model"))
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--preset", default="A40",
                 help="runtime-model cluster preset that prices the run")
  p.add_argument("--n-workers-priced", default="8,16",
                 help="worker counts priced on the preset")
  p.add_argument("--forward-ms", type=float, default=None,
                 help="forward time per step on the priced GPU (default: a "
                      "third of this machine's measured step)")
  why = flag_types.repeated_flag(p, sys.argv[1:] if argv is None else argv)
  if why:  # argparse keeps the last value of a flag given twice
    p.error(why)
  args = p.parse_args(argv)
  # The runner's bound of config.steps; predict's of --forward-ms (the
  # backward pass priced is twice the forward).
  if not 2 <= args.steps <= INT32_MAX:
    p.error(f"--steps={args.steps} must be a whole number in [2, "
            f"{INT32_MAX}] (the run resumes from its half).")
  if args.forward_ms is not None and not 0 <= args.forward_ms <= 5e5:
    p.error(f"--forward-ms={args.forward_ms} must be a time in [0, 5e5] ms "
            "(0: a third of the measured step).")
  if not args.workdir:
    p.error("--workdir is empty; give the directory the data and both runs "
            "are written to, e.g. --workdir runs/own_model.")
  try:  # a file, unwritable: refused before JAX starts
    flag_types.check_output_dir(args.workdir, "--workdir")
  except ValueError as e:
    p.error(str(e))
  _check_pricing(p, args)
  return args


def _check_pricing(p, args) -> None:
  """Runs ``predict``'s own checks of ``--preset`` and ``--n-workers-priced``
  (positive, unique, at most its bound, a multiple of the preset's workers
  per node) before any training, on a placeholder workload: a bad value is
  ``p.error`` (exit 2) naming this script's flag."""
  # pylint: disable=import-outside-toplevel
  import contextlib
  import io
  err = io.StringIO()
  with contextlib.redirect_stdout(io.StringIO()), \
      contextlib.redirect_stderr(err):
    try:
      code = _predict(get_config(), 10**6, args.forward_ms or 1.0, args)[0]
    except SystemExit as e:  # a flag predict's parser refuses
      code = e.code
  if code:
    why = err.getvalue().strip().splitlines()[-1].partition("error: ")[2]
    p.error(_in_own_flags(why.split(" (see ")[0]))  # not predict's --help


def _in_own_flags(why: str) -> str:
  """predict's refusal in this script's flags: its ``--methods SPEC at
  --n-workers N: reason`` is this config's method at ``--n-workers-priced
  N``, without advice to change a topology this script has no flag for."""
  found = re.match(r"--methods (\S+) at --n-workers (\d+): (.*)$", why)
  if not found:
    return why.replace("--n-workers", "--n-workers-priced")
  spec, n, reason = found.groups()
  reason = re.sub(r" \(or use [^)]*\)", "", reason).rstrip(".")
  reason = reason.removeprefix(f"{spec!r}: ")
  return (f"--n-workers-priced {n}: this script's method {spec} (its "
          f"get_config()) cannot be priced at {n} workers: {reason}; give "
          "other --n-workers-priced counts.")


def _final_params(config, workdir):
  """Every worker's parameters from the last checkpoint in ``workdir``."""
  # pylint: disable=import-outside-toplevel
  import jax
  from decentral_jax.runner import checkpoint as checkpoint_lib
  from decentral_jax.runner import experiment as experiment_lib
  exp = experiment_lib.Experiment(config)
  with checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints")) \
      as ckpt:
    state, _ = ckpt.restore(ckpt.latest_step(), exp.init_state())
  return jax.device_get(state.params), exp.param_count


def _predict(config, param_count, forward, args) -> tuple[int, str]:
  """``predict``'s exit code and printed text for this run's method against
  All-Reduce on ``args.preset`` (errors go to stderr)."""
  # pylint: disable=import-outside-toplevel
  import contextlib
  import io
  from decentral_jax.runner import builders
  from decentral_jax.tools.runtime_model_cli import main as predict_cli
  spec, _ = builders.spec_for_config(config)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = predict_cli.main([
        "predict", "--preset", args.preset, "--params", str(param_count),
        "--forward-ms", f"{forward:.3f}", "--backward-ms",
        f"{2 * forward:.3f}", "--n-workers", args.n_workers_priced,
        "--methods", f"all_reduce,{spec}"])
  return code, out.getvalue()


def _price(config, param_count, step_ms, args) -> str:
  """The runtime model's ``predict`` of this run's method against
  All-Reduce on ``args.preset`` (its text)."""
  forward = args.forward_ms if args.forward_ms else step_ms / 3
  code, text = _predict(config, param_count, forward, args)
  if code:
    raise SystemExit(f"predict failed ({code}): {text}")
  return text


def _latest_step(workdir: str) -> int | None:
  """The newest checkpoint's step in ``workdir`` (None: none yet)."""
  from decentral_jax.runner import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  with checkpoint_lib.Checkpointer(directory) as ckpt:
    return ckpt.latest_step()


def _check_reused(args) -> None:
  """A reused ``--workdir`` holds runs of at most ``--steps`` steps (the
  same command again resumes or ends at once).

  Raises:
    ValueError: one line naming ``--workdir``, ``--steps`` and the fix.
  """
  for run in ("straight", "resumed"):
    done = _latest_step(os.path.join(args.workdir, run))
    if done is not None and done > args.steps:
      raise ValueError(
          f"--workdir {args.workdir!r} holds a {run} run trained to step "
          f"{done}, past --steps {args.steps}; give --steps {done} or more "
          "(the same command resumes) or a new --workdir.")


def _train_both(config, args):
  """The straight run, then the same run in two halves (the half skipped
  when ``resumed`` already holds its checkpoint: a rerun after a SIGTERM or
  a finished run goes on from there)."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  straight = train.train_and_evaluate(config,
                                      os.path.join(args.workdir, "straight"))
  half = get_config()
  half.data.options.path, half.steps = config.data.options.path, \
      args.steps // 2
  half.checkpoint_interval = config.checkpoint_interval
  split = os.path.join(args.workdir, "resumed")
  if (_latest_step(split) or 0) < half.steps:
    train.train_and_evaluate(half, split)
  resumed = train.train_and_evaluate(config, split)  # resumes at steps // 2
  return straight, resumed, split


def _step_ms(straight: dict, workdir: str) -> float:
  """The straight run's measured ms per step: this invocation's, else (a
  rerun with nothing left to time) the last one its metrics.jsonl holds.

  Raises:
    ValueError: no step was ever timed (names ``--forward-ms``).
  """
  if "step_time_ms" in straight:
    return straight["step_time_ms"]
  import json  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, "straight", "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    times = [r["step_time_ms"] for r in map(json.loads, filter(str.strip, f))
             if "step_time_ms" in r]
  if not times:
    raise ValueError(f"{path} holds no timed step to price the run from; "
                     "give --forward-ms.")
  return times[-1]


def _run(args) -> dict:
  """Writes the data, trains, resumes, prices; returns what it printed."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  import mixer
  from decentral_jax.runner import validation
  try:  # simulated CPU devices, one per worker (before JAX starts)
    jax.config.update("jax_num_cpu_devices", 4)
  except RuntimeError:
    pass  # the backend already runs (e.g. under pytest, with more devices)
  _check_reused(args)
  data = os.path.join(args.workdir, "data")
  if not all(os.path.exists(os.path.join(data, f)) for f in mixer.FILES):
    mixer.write_stripes(data)
  config = get_config()
  config.data.options.path, config.steps = data, args.steps
  config.checkpoint_interval = max(args.steps // 2, 1)
  validation.check_config(config)
  straight, resumed, split = _train_both(config, args)
  a, param_count = _final_params(config, os.path.join(args.workdir,
                                                      "straight"))
  b, _ = _final_params(config, split)
  equal = all(np.array_equal(x, y) for x, y in
              zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  print(f"{config.model.name} on {config.data.source}: {param_count:,} "
        f"parameters, {config.n_workers} workers, {config.steps} steps: "
        f"eval/loss {straight['eval/loss']:.4f}, eval/accuracy "
        f"{straight['eval/accuracy']:.3f}")
  print(f"resumed at step {args.steps // 2}: eval/loss "
        f"{resumed['eval/loss']:.4f}; parameters "
        f"{'bit-exact' if equal else 'DIFFER'} from the straight run")
  step_ms = 0.0 if args.forward_ms else _step_ms(straight, args.workdir)
  pricing = _price(config, param_count, step_ms, args)
  print(pricing)
  return {"straight": straight, "resumed": resumed, "bit_exact": equal,
          "param_count": param_count, "pricing": pricing}


def main(argv=None) -> dict:
  """Writes the data, trains, resumes, prices; returns what it printed.

  The same command again resumes (or ends at once). Bad input (flags, a
  reused ``--workdir`` past ``--steps``, bad data) is one ``error:`` line
  and exit 2; a diverged run exit 3; SIGTERM / SIGINT one ``preempted:``
  line and exit 143 / 130 (checkpoint saved), as ``decentral-jax train``.
  """
  args = _parse(argv)
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  try:
    return _run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except FloatingPointError as e:  # diverged; the last good checkpoint stays
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(3) from None
  except train.Preempted as e:  # checkpoint saved: run the same again
    print(f"preempted: {e}", file=sys.stderr)
    raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
  main()
