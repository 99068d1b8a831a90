"""One process of the multi-process test jobs of ``tests/runner/test_multihost.py``.

Run as ``python tests/runner/multihost_worker.py --out DIR --port P --process_id I
--case NAME [--case NAME ...] [--steps N] [--check_errors]``, once per
process, with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in the environment.
The process joins a 2-process job on ``127.0.0.1:P`` through
:func:`decentral_jax.runner.launch.initialize_from_config` and, for every case,
trains it with :func:`decentral_jax.runner.train.train_and_evaluate` in
``DIR/<case>``, then runs it again on the same directory (which restores the
final checkpoint and evaluates it); a case of ``INTERRUPT_AT`` is first
stopped after a checkpoint and resumed from it. It writes ``DIR/<case>_p<I>.npz`` with
its workers' final parameters, every worker's per-step losses, the
evaluations and the workers whose training rows it read. With
``--check_errors`` it first builds configs that do not fit the job's layout
and writes their error messages to ``DIR/errors_p<I>.json``. With
``--startup_checks`` it only builds experiments that the processes must
refuse together (:func:`startup_checks`). With ``--step_delay S`` every
step sleeps ``S`` seconds first; ``--extra=--config.F=V`` (repeatable) sets
a config field of every case; a run stopped by SIGTERM writes
``DIR/preempted_p<I>.json`` (the step of the checkpoint saved) and exits
with status 143.

The module also holds what the single-process reference run in the test
shares with the workers: the case configs and :func:`run_case`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_PROCESSES = 2
DEVICES_PER_PROCESS = 4
STEPS = 10

TINY = ("--config.model.n_layer=1", "--config.model.n_embd=32",
        "--config.model.n_head=2", "--config.model.block_size=16",
        "--config.global_batch=16", "--config.eval_batches=1",
        "--config.n_workers=8", "--config.eval_interval=0",
        "--config.checkpoint_interval=0", "--config.log_interval=5",
        "--config.schedule.warmup_steps=3", "--config.schedule.peak_lr=1e-2")

CASES = {
    # AccumAdamW (T=2) with gossip on the one-peer exponential graph.
    "one_peer_exp": ("--config.algorithm=decentralized",
                     "--config.topology=one_peer_exp",
                     "--config.optimizer.name=accum_adamw",
                     "--config.optimizer.accum_steps=2"),
    # All-Reduce: pmean of the gradients over all 8 workers, then AdamW.
    "all_reduce": ("--config.algorithm=all_reduce",
                   "--config.optimizer.name=adamw",
                   "--config.optimizer.accum_steps=1"),
    # AER, 2 nodes x 4 workers: node-aware 2-D mesh, each process a node.
    "aer": ("--config.algorithm=decentralized",
            "--config.topology=alternating_exp_ring",
            "--config.workers_per_node=4",
            "--config.optimizer.name=accum_adamw",
            "--config.optimizer.accum_steps=2"),
    # DiLoCo: AdamW inner steps, outer Nesterov step on theta at steps 3, 6
    # and 9 (an all-reduce of the parameters across the processes); the job
    # stops after step 5 (checkpoint 5, inside the second sync window) and
    # resumes from it (``INTERRUPT_AT``).
    "diloco": ("--config.algorithm=diloco", "--config.sync_every=3",
               "--config.optimizer.name=adamw",
               "--config.optimizer.accum_steps=1",
               "--config.checkpoint_interval=5"),
    # 4 workers of 2 devices each ("fsdp": state split over a worker's
    # devices), 2 workers per process; DAdam on the one-peer graph.
    "fsdp": ("--config.algorithm=decentralized",
             "--config.topology=one_peer_exp", "--config.n_workers=4",
             "--config.devices_per_worker=2", "--config.worker_layout=fsdp",
             "--config.optimizer.name=adamw",
             "--config.optimizer.accum_steps=1"),
}
# Cases whose 2-process job is stopped after this many steps (a checkpoint
# step) and resumed from the checkpoint; the reference trains straight.
INTERRUPT_AT = {"diloco": 5}


class Interrupted(Exception):
  """Raised by :func:`run_case`'s step to stop a run after a checkpoint."""


def case_config(case: str, *extra: str, steps: int = STEPS):
  """The gpt_tiny config of ``case``: tiny sizes, 8 workers, ``steps`` steps."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  return config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      (*TINY, f"--config.steps={steps}", *CASES[case], *extra))


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
  """This process's rows of a worker-stacked array: (worker ids, values).

  A worker of several devices holds its row in pieces (one per device);
  they are put together here.
  """
  blocks = {}
  for s in x.addressable_shards:
    rows = s.index[0]
    start, stop = rows.start or 0, rows.stop or x.shape[0]
    block = blocks.setdefault(
        start, np.full((stop - start,) + x.shape[1:], np.nan, x.dtype)
        if np.issubdtype(x.dtype, np.floating) else
        np.zeros((stop - start,) + x.shape[1:], x.dtype))
    block[(slice(None),) + tuple(s.index[1:])] = np.asarray(s.data)
  starts = sorted(blocks)
  workers = np.concatenate([np.arange(b, b + len(blocks[b]))
                            for b in starts]).astype(np.int64)
  return workers, np.concatenate([blocks[b] for b in starts])


def to_host(x: jax.Array) -> np.ndarray:
  """The whole of a worker-stacked array on every process (a collective)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_case(config, workdir: str, experiment,
             interrupt_at: int | None = None) -> dict[str, np.ndarray]:
  """Trains ``config``, then restores and evaluates its final checkpoint.

  Args:
    config: the case config; experiment: a ``Experiment`` built from it.
    workdir: the run directory (shared by the processes of a job).
    interrupt_at: if set (a checkpoint step of ``config``), the first run
      stops before step ``interrupt_at + 1`` and the training is resumed
      from checkpoint ``interrupt_at`` (same process, same compiled steps).

  Returns:
    Arrays to compare: ``workers`` (this process's worker ids), ``losses``
    [steps, n_workers] (every worker), ``param/<leaf>`` [k, ...] (this
    process's workers after the last step), ``restored/<leaf>`` (the same
    read back from the checkpoint), ``eval_loss`` and ``eval_loss_restored``;
    for DiLoCo-style methods also ``theta/<leaf>`` and
    ``restored_theta/<leaf>`` (the global parameters in the optimizer
    state, :func:`decentral_jax.optim.streaming_sync.global_params`).
  """
  # pylint: disable=import-outside-toplevel
  from decentral_jax import optim
  from decentral_jax.runner import train
  # pylint: enable=import-outside-toplevel
  steps, last = [], {}
  step_fn = experiment.train_step

  def recording_step(state, batch, step=None):
    if interrupt_at is not None and step == interrupt_at and \
        "interrupted" not in last:
      last["interrupted"] = step
      raise Interrupted(step)
    new_state, metrics = step_fn(state, batch, step)
    steps.append(metrics["loss"])
    last["state"] = new_state
    return new_state, metrics

  experiment.train_step = recording_step
  if interrupt_at is not None:
    try:
      train.train_and_evaluate(config, workdir, experiment=experiment)
      raise AssertionError(f"the run was not interrupted at {interrupt_at}")
    except Interrupted:
      pass
    assert len(steps) == interrupt_at, len(steps)
  final = train.train_and_evaluate(config, workdir, experiment=experiment)
  evaluate_fn = experiment.evaluate

  def recording_eval(state):
    last["restored"] = state
    return evaluate_fn(state)

  experiment.evaluate = recording_eval
  again = train.train_and_evaluate(config, workdir, experiment=experiment)
  out = {"losses": np.stack([to_host(x) for x in steps]),
         "resumed_from": np.int64(-1 if interrupt_at is None
                                  else interrupt_at),
         "eval_loss": np.float64(final["eval/loss"]),
         "eval_loss_restored": np.float64(again["eval/loss"])}
  for key, state in (("param", last["state"]), ("restored", last["restored"])):
    theta = optim.global_params(state.opt_state)
    trees = [(key, state.params)]
    if theta is not None:
      trees.append(("theta" if key == "param" else "restored_theta", theta))
    for name, tree in trees:
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        workers, rows = local_rows(leaf)
        out[f"{name}/{jax.tree_util.keystr(path)}"] = rows
  out["workers"] = workers
  return out


def delayed(step_fn, seconds: float):
  """``step_fn`` after a sleep (the numbers do not change)."""

  def step(state, batch, step=None):
    time.sleep(seconds)
    return step_fn(state, batch, step)

  return step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--case", action="append", required=True)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--heartbeat", type=int, default=10)
  parser.add_argument("--log_interval", type=int, default=5)
  parser.add_argument("--check_errors", action="store_true")
  parser.add_argument("--startup_checks", action="store_true")
  parser.add_argument("--step_delay", type=float, default=0.0)
  parser.add_argument("--extra", action="append", default=[],
                      help="a --config.<field>=value of every case")
  args = parser.parse_args()
  sys.path.insert(0, ROOT)
  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import orbax_quiet
  from decentral_jax.runner import launch
  from decentral_jax.runner import experiment as experiment_lib
  from decentral_jax.runner import train
  from decentral_jax.data import text
  # pylint: enable=import-outside-toplevel
  orbax_quiet.quiet_orbax_logs()
  # Records which workers' training rows this process reads.
  read_rows_of, sampler_batch = set(), text.LMSampler.batch

  def batch(self, step, workers=None):
    read_rows_of.update(range(self.n_workers) if workers is None
                        else (int(w) for w in workers))
    return sampler_batch(self, step, workers)

  text.LMSampler.batch = batch
  dist = (*args.extra, f"--config.log_interval={args.log_interval}",
          "--config.distributed.enabled=True",
          f"--config.distributed.coordinator_address=127.0.0.1:{args.port}",
          f"--config.distributed.num_processes={N_PROCESSES}",
          f"--config.distributed.process_id={args.process_id}",
          f"--config.distributed.heartbeat_timeout_seconds={args.heartbeat}")
  first = case_config(args.case[0], *dist, steps=args.steps)
  assert launch.initialize_from_config(first)
  assert jax.process_count() == N_PROCESSES
  assert jax.local_device_count() == DEVICES_PER_PROCESS
  if args.startup_checks:
    startup_checks(args.out, args.process_id, dist)
    return
  if args.check_errors:
    errors = {}
    for name, case, extra in (
        ("aer_workers_per_node_2", "aer", ("--config.workers_per_node=2",)),
        ("n_workers_4", "one_peer_exp", ("--config.n_workers=4",)),
        ("devices_per_worker_3", "one_peer_exp", (
            "--config.n_workers=2", "--config.devices_per_worker=3",
            "--config.global_batch=12"))):
      try:
        experiment_lib.Experiment(case_config(case, *dist, *extra))
        errors[name] = ""
      except ValueError as e:
        errors[name] = str(e)
    with open(os.path.join(args.out, f"errors_p{args.process_id}.json"), "w",
              encoding="utf-8") as f:
      json.dump(errors, f)
  for case in args.case:
    config = case_config(case, *dist, steps=args.steps)
    exp = experiment_lib.Experiment(config)
    read_rows_of.clear()
    if args.step_delay:  # time for a signal to arrive mid-run
      exp.train_step = delayed(exp.train_step, args.step_delay)
    try:
      result = run_case(config, os.path.join(args.out, case), exp,
                        INTERRUPT_AT.get(case))
    except train.Preempted as e:  # every process saved checkpoint e.step
      with open(os.path.join(args.out, f"preempted_p{args.process_id}.json"),
                "w", encoding="utf-8") as f:
        json.dump({"step": e.step}, f)
      print(f"process {args.process_id}: {e}", flush=True)
      sys.exit(e.exit_code)
    result["data_workers"] = np.array(sorted(read_rows_of), np.int64)
    np.savez(os.path.join(args.out, f"{case}_p{args.process_id}.npz"),
             **result)
  print(f"process {args.process_id}: done", flush=True)


def startup_checks(out: str, process_id: int, dist) -> None:
  """Builds experiments that the processes must refuse together.

  Writes ``DIR/startup_p<I>.json``: for each check, the ValueError message
  this process got ("" if none). Each check runs on every process in the
  same order, so the job stays in step after a refusal.
  """
  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import experiment as experiment_lib
  from decentral_jax.runner import tasks
  # pylint: enable=import-outside-toplevel
  errors = {}

  def attempt(name, config):
    try:
      experiment_lib.Experiment(config)
      errors[name] = ""
    except ValueError as e:
      errors[name] = str(e)

  # config.steps differs (10 on process 0, 20 on process 1).
  attempt("steps", case_config("one_peer_exp", *dist,
                               steps=STEPS * (1 + process_id)))
  # Same config, but process 1 draws its initial parameters with another
  # PRNG implementation.
  impl = jax.config.jax_default_prng_impl
  if process_id == 1:
    jax.config.update("jax_default_prng_impl", "rbg")
  attempt("init", case_config("one_peer_exp", *dist))
  jax.config.update("jax_default_prng_impl", impl)
  # Building the task fails on process 1 only (its data is missing).
  make_task = tasks.make_task

  def missing_data(*args, **kwargs):
    raise ValueError("config.data.path='/data/x' does not exist")

  if process_id == 1:
    tasks.make_task = missing_data
  attempt("task", case_config("one_peer_exp", *dist))
  tasks.make_task = make_task
  # Equal configs (but for config.distributed and workdir) still start.
  attempt("same", case_config(
      "one_peer_exp", *dist, f"--config.workdir=/tmp/p{process_id}",
      f"--config.distributed.initialization_timeout_seconds={60 + process_id}"))
  with open(os.path.join(out, f"startup_p{process_id}.json"), "w",
            encoding="utf-8") as f:
    json.dump(errors, f)
  print(f"process {process_id}: done", flush=True)


if __name__ == "__main__":
  main()
