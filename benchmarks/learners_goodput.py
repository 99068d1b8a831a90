"""Goodput of decoupled learners against one SPMD program, under failures.

4 learners of a small byte-level GPT (2 layers, width 64, context 64, 4
sequences per step, inner AdamW, H inner steps per period, outer Nesterov
0.7/0.9), one failure schedule: one SIGKILL every ``--kill-every`` merged
periods (half a period after the period ends) and learner 3 at about half
speed (``--slow-sleep`` seconds slept per inner step). Three ways to run it:

* ``spmd``: DiLoCo in one SPMD program (optim.diloco over 4 simulated CPU
  devices, in a subprocess); it saves a checkpoint after every period, the
  slow worker holds every step (the sleep is taken by the program), and a
  SIGKILL kills the whole program, which is started again from its
  checkpoint (process start, JAX import and compile included);
* ``sync``: the same DiLoCo as learners through the synchronizer on Ray;
  the killed learner is restarted by Ray, the merge waits for it;
* ``decoupled``: Decoupled DiLoCo (quorum 3, grace 1 s, Dynamic Local
  Updates): the merge goes on without the dead learner, the slow learner
  does fewer inner steps.

Reported per mode: merged tokens per wall-second (from the first start to
the last merge), wall-seconds, final validation loss of ``theta``; and the
runtime model's pricing (decentral_jax.runtime_model.stragglers: "wait"
for spmd/sync, "quorum" with on_failure="proceed" for decoupled) of the
same slow fraction and the measured failure rate and downtime.

  nice python benchmarks/learners_goodput.py --out benchmarks/results/learners_goodput.json

``--reprice`` runs nothing: it prices the runs stored in ``--out`` again
at the settings they were measured with (the file's ``"args"``, left as
they are): the modes of ``--modes`` (default all), each of which, and
the sync run a decoupled price reads, must be stored there; it refuses
every other flag. A run that keeps modes from
``--out`` must use the settings they were measured with. The file is
checked before any of its numbers is used (types and bounds of ``"args"``
as the flags', one resume or downtime entry per kill, kills within the
schedule, at least 2 merge times, a period above 0 s, a healthy step
``period / sync_every - slow_sleep`` above 0 s): a damaged one is one
``error:`` line naming ``--out``, the file and the key.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
N = 4
GPT_ARGS = (("seed", 0), ("batch", 4), ("context", 64))


def spec(args, mode):
  from decentral_jax.tools.learners import spec as spec_lib  # pylint: disable=import-outside-toplevel
  sleep = (0.0,) * (N - 1) + (args.slow_sleep,)
  return spec_lib.RunSpec(
      problem="gpt", problem_args=GPT_ARGS, shards=N,
      sync_every=args.sync_every, periods=args.periods, inner="adamw",
      inner_lr=args.lr, mode="sync" if mode == "spmd" else mode,
      quorum=N - 1 if mode == "decoupled" else N, grace_s=1.0, dynamic_updates=mode == "decoupled",
      sleep_s=sleep)


def eval_loss(theta) -> float:
  """Mean validation loss of ``theta`` on 8 fixed batches."""
  import jax  # pylint: disable=import-outside-toplevel
  from decentral_jax.data import text  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import problems  # pylint: disable=import-outside-toplevel
  problem = problems.build("gpt", N, GPT_ARGS)
  _, val = text.byte_splits(text.pydoc_corpus())
  loss = jax.jit(problem.loss)
  return float(np.mean([loss(theta, b) for b in text.eval_batches(
      val, 64, 8, 8)]))


# ------------------------------------------------------------ one program
def spmd_worker(args) -> None:
  """The SPMD program: resumes from ``args.ckpt``, checkpoints each period,
  appends ``period seconds`` to ``args.progress``."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax import optim, parallel  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import problems  # pylint: disable=import-outside-toplevel
  problem = problems.build("gpt", N, GPT_ARGS)
  mesh = parallel.make_mesh(N)
  tx = optim.diloco(optax.adamw(args.lr), args.sync_every)
  grad = jax.grad(problem.loss)

  def step(params, state, batch):
    updates, state = tx.update(grad(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(parallel.per_worker(step, mesh))
  start = 0
  if os.path.exists(args.ckpt):
    with open(args.ckpt, "rb") as f:
      start, host_params, host_state = pickle.load(f)
    params = parallel.shard(host_params, mesh)
    state = jax.tree.map(lambda x: parallel.shard(x, mesh), host_state)
  else:
    params = parallel.shard(jax.tree.map(
        lambda p: np.repeat(p[None], N, 0), problem.params), mesh)
    state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  h = args.sync_every
  for period in range(start, args.periods):
    for s in range(h):
      t = period * h + s
      batch = [problem.batch(i, t) for i in range(N)]
      batch = tuple(np.stack([b[j] for b in batch]) for j in range(2))
      params, state = step(params, state, parallel.shard(batch, mesh))
      time.sleep(args.slow_sleep)  # the slow worker holds every step
    host = jax.device_get((params, state))
    with open(args.ckpt + ".tmp", "wb") as f:
      pickle.dump((period + 1, *host), f)
    os.replace(args.ckpt + ".tmp", args.ckpt)
    with open(args.progress, "a", encoding="utf-8") as f:
      f.write(f"{period + 1} {time.time()}\n")


def _period_s(times) -> float:
  """Median seconds between consecutive periods' ends (the first period,
  which holds the start-up, excluded)."""
  return float(np.median(np.diff(times))) if len(times) > 1 else 1.0


def _spmd_periods(progress) -> list[float]:
  if not os.path.exists(progress):
    return []
  with open(progress, encoding="utf-8") as f:
    return [float(line.split()[1]) for line in f if line.strip()]


def run_spmd(args, tmp) -> dict:
  """Drives the SPMD program through the kill schedule."""
  ckpt, progress = os.path.join(tmp, "spmd.pkl"), os.path.join(tmp, "p.txt")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={N}"}
  cmd = [sys.executable, __file__, "--spmd-worker", "--ckpt", ckpt,
         "--progress", progress, *_shared_flags(args)]
  start, kills, restarts = time.time(), [], []
  proc = subprocess.Popen(cmd, env=env)
  while True:
    done = _spmd_periods(progress)
    if proc.poll() is not None:
      if len(done) >= args.periods:
        break
      raise RuntimeError(f"the SPMD program exited with {proc.returncode}")
    due = (len(kills) + 1) * args.kill_every
    if len(done) >= due and due < args.periods:
      time.sleep(0.5 * _period_s(done))
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      kills.append(time.time())
      proc = subprocess.Popen(cmd, env=env)
      restarts.append(time.time())
    time.sleep(0.05)
  with open(ckpt, "rb") as f:
    _, params, _ = pickle.load(f)
  theta = {k: np.asarray(v)[0] for k, v in params.items()}
  done = _spmd_periods(progress)
  # Kill to the end of the next period: restart, compile, redo, one period.
  resume = [min(t for t in done if t > k) - k for k in kills]
  return {"seconds": time.time() - start, "theta": theta,
          "kills": len(kills), "first_period_s": done[0] - start,
          "period_s": _period_s(done), "resume_s": resume}


# --------------------------------------------------------------- learners
def run_learners(args, mode) -> dict:
  """Drives 4 learners on Ray through the kill schedule."""
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  cluster.start(num_cpus=2)
  c = cluster.Cluster(spec(args, mode))
  start = time.time()
  try:
    for i in range(N):
      c.add(i)
    kills = []  # (learner, time)
    while True:
      status = c.status()
      if status["done"]:
        break
      due = (len(kills) + 1) * args.kill_every
      if status["version"] >= due and due < args.periods:
        time.sleep(0.5 * _period_s(status["log"]["merge_time"]))
        victim = len(kills) % (N - 1)
        c.kill(victim)
        kills.append((victim, time.time()))
      time.sleep(0.05)
    # SIGKILL to the restarted learner's join (None: not back before the end).
    down = [min((t - k for w, _, t in status["log"]["joins"]
                 if w == victim and t > k), default=None)
            for victim, k in kills]
    learners = c.learner_status()
    out = {"seconds": time.time() - start, "theta": c.params()["theta"],
           "kills": len(kills), "downtime_s": down, "log": status["log"],
           "h": {i: s["h"] for i, s in learners.items()},
           "steps": {i: s["steps"] for i, s in learners.items()},
           "max_wait": {i: max(s["waits"], default=0.0) for i, s in learners.items()}}
  finally:
    c.close()
  return out


def _healthy_step(measured, mode, h, sleep):
  """``(key, seconds)``: the healthy inner step of ``mode`` ("spmd": its
  median period; "sync" and "decoupled": the sync run's median merge gap),
  divided by the ``h`` inner steps of a period, less the slow learner's
  ``sleep`` per step; ``key`` names the measured period it came from."""
  if mode == "spmd":
    return "measured.spmd.period_s", measured["spmd"]["period_s"] / h - sleep
  return ("measured.sync.log.merge_time",
          _period_s(measured["sync"]["log"]["merge_time"]) / h - sleep)


def model_prices(args, measured, modes=None) -> dict:
  """Runtime-model tokens/s of each mode (stragglers.straggler_cost: "wait"
  for spmd and sync, "quorum" with on_failure="proceed" for decoupled).

  Inputs, all measured: a healthy inner step ``t`` (a learner's: the sync
  run's median period / H minus the slow learner's sleep; the SPMD
  program's: its median period / H minus the sleep), the slow learner's
  speed ``t / (t + sleep)``, the failure rate ``kills / (N * steps)`` and
  the mean downtime in steps (learners: SIGKILL to rejoin; SPMD: SIGKILL to
  the next period's end less one period). ``modes``: those priced, each
  skipped where it (or, for decoupled, the sync run it takes ``t`` from)
  is not in ``measured`` (None: every mode).
  """
  from decentral_jax.runtime_model import stragglers  # pylint: disable=import-outside-toplevel
  steps, h, sleep = args.periods * args.sync_every, args.sync_every, \
      args.slow_sleep
  out, modes = {}, MODES if modes is None else modes
  for mode, how in (("spmd", "wait"), ("sync", "wait"),
                    ("decoupled", "quorum")):
    if mode not in modes or any(m not in measured for m in _needs(mode)):
      continue
    r = measured[mode]
    key, t = _healthy_step(measured, mode, h, sleep)
    if t <= 0:  # stored files are checked (_results_agree); a run cannot
      raise ValueError(f"{key}: a healthy step of {t:.3g} s (<= 0); "
                       "nothing to price")
    if mode == "spmd":
      down = np.mean(r["resume_s"]) - r["period_s"] if r["kills"] else 0.0
    else:
      back = [d for d in r["downtime_s"] if d is not None]
      down = np.mean(back) if back else 0.0
    faults = stragglers.Faults(
        slow_fraction=1 / N, slow_speed=t / (t + sleep),
        failure_rate=r["kills"] / (N * steps),
        mean_downtime=max(1.0, down / t))
    cost = stragglers.straggler_cost(how, N, t, faults, compute_s=t,
                                     period=h, on_failure="proceed")
    out[mode] = {"tokens_per_s": N * 256 * cost.useful / cost.step_s,
                 "step_s": t, "faults": faults.__dict__,
                 "useful": cost.useful, "priced_step_s": cost.step_s}
  return out


def _shared_flags(args) -> list[str]:
  return ["--periods", str(args.periods), "--sync-every",
          str(args.sync_every), "--slow-sleep", str(args.slow_sleep),
          "--lr", str(args.lr)]


MODES = ("spmd", "sync", "decoupled")


def _needs(mode: str) -> tuple:
  """The stored runs pricing ``mode`` reads (:func:`_healthy_step`: a
  learner's healthy step is the sync run's)."""
  return (mode,) if mode == "spmd" else ("sync", mode)


def parse_args(argv=None):
  """The flags, each checked before any work and before Ray starts (one
  ``error:`` line): counts and times bounded, ``--kill-every`` below
  ``--periods`` (it kills at merged periods ``N, 2N, ...`` before the
  last), ``--modes`` known, ``--out`` writable (read by ``--reprice``)."""
  from decentral_jax.tools import flag_types  # one error: line
  count, real = flag_types.integer, flag_types.real  # bounded flag types
  p = flag_types.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--periods", type=count(1, 10**4), default=16)
  p.add_argument("--sync-every", type=count(1, 10**4), default=8)
  p.add_argument("--kill-every", type=count(1, 10**4), default=4)
  p.add_argument("--slow-sleep", type=real(0, 60, " (seconds)"),
                 default=0.03)
  p.add_argument("--lr", type=real(0, 10, open_lo=True), default=3e-3)
  p.add_argument("--modes", default=",".join(MODES),
                 help="comma-separated, of " + ", ".join(MODES))
  p.add_argument("--out", default=None,
                 help="JSON results; the modes not run are kept from it")
  p.add_argument("--reprice", action="store_true",
                 help="run nothing: price the stored results again")
  p.add_argument("--spmd-worker", action="store_true",
                 help=argparse.SUPPRESS)
  p.add_argument("--ckpt", help=argparse.SUPPRESS)
  p.add_argument("--progress", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  import _common  # pylint: disable=import-outside-toplevel
  if args.reprice:  # before --spmd-worker: the reprice runs no program
    _common.check_report_flags(
        p, argv, mode="with --reprice",
        reads=("--out", "--reprice", "--modes"),
        why="it prices the runs stored in --out again at the settings they "
        "were measured with (the file's \"args\")")
  if args.spmd_worker:
    _common.check_flags(p, args, outputs=("--ckpt", "--progress"))
    return args
  _common.check_flags(p, args, outputs=("--out",),
                      inputs=("--out",) if args.reprice else (),
                      rules=(_check_modes, _check_kill_every, _check_kept))
  return args


#: The flags that set what a measured run did (keys of the file's "args").
SETTINGS = ("periods", "sync_every", "kill_every", "slow_sleep", "lr")


def _results_schema() -> dict:
  """The results file's fields (decentral_jax.records' schema): "args"
  bounded as the flags are, each mode's measured counts and seconds."""
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  count, secs = ("int", 1, 10**4, False), ("number", 0, 1e9, False)
  args = records.Obj({"periods": count, "sync_every": count,
                      "kill_every": count,
                      "slow_sleep": ("number", 0, 60, False),
                      "lr": ("number", 0, 10, False)}, SETTINGS, extra=True)
  kills = ("int", 0, 10**4, False)
  spmd = records.Obj({"period_s": secs, "kills": kills,
                      "resume_s": ("numbers", 0, 1e9, False)},
                     ("period_s", "kills", "resume_s"), extra=True)
  log = records.Obj({"merge_time": ("numbers", 0, None, False)},
                    ("merge_time",), extra=True)
  learners = {"kills": kills, "downtime_s": ("list", None, None, False)}
  measured = records.Obj({
      "spmd": (spmd, None, None, False),
      "sync": (records.Obj({**learners, "log": (log, None, None, False)},
                           ("kills", "downtime_s", "log"), extra=True),
               None, None, False),
      "decoupled": (records.Obj(learners, tuple(learners), extra=True),
                    None, None, False),
      "model": ("object", None, None, False)})
  return {"args": (args, None, None, False),
          "measured": (measured, None, None, False)}


def _results_agree(saved: dict):
  """``(key, why)`` for results that disagree with themselves, or None:
  ``lr > 0``; each mode's kills at most the kill schedule's (one per
  ``kill_every`` merged periods before the last) and as many resume or
  downtime entries as kills (each null or seconds in [0, 1e9]); the SPMD
  run's period above 0 seconds; the sync run's merge times at least 2 (the
  period is their median gap) and in order (not decreasing); the healthy
  step of spmd and sync (:func:`_healthy_step`) above 0 seconds."""
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  a, measured = saved["args"], saved["measured"]
  if a["lr"] <= 0:
    return "args.lr", f"args.lr must be > 0, got {records.short(a['lr'])}"
  most = (a["periods"] - 1) // a["kill_every"]
  for mode in MODES:
    if mode not in measured:
      continue
    r, key = measured[mode], f"measured.{mode}"
    if r["kills"] > most:
      return f"{key}.kills", (
          f"{key}.kills is {r['kills']}, more than the {most} kills of "
          f"args.periods {a['periods']} with args.kill_every "
          f"{a['kill_every']}")
    times = "resume_s" if mode == "spmd" else "downtime_s"
    bad = next((i for i, d in enumerate(r[times]) if d is not None and (
        not records.is_real(d) or not 0 <= d <= 1e9)), None)
    if bad is not None:
      return f"{key}.{times}", (
          f"{key}.{times}[{bad}] must be null or seconds in [0, 1e9], got "
          f"{records.short(r[times][bad])}")
    if len(r[times]) != r["kills"]:
      return f"{key}.{times}", (
          f"{key}.{times} has {len(r[times])} entries for {key}.kills "
          f"{r['kills']} (one per kill)")
  if "spmd" in measured and measured["spmd"]["period_s"] <= 0:
    return "measured.spmd.period_s", (
        "measured.spmd.period_s must be > 0 seconds (a median period), got "
        f"{records.short(measured['spmd']['period_s'])}")
  merge = measured.get("sync", {"log": {"merge_time": [0, 0]}})["log"][
      "merge_time"]
  if len(merge) < 2:
    return "measured.sync.log.merge_time", (
        f"measured.sync.log.merge_time has {len(merge)} entries; a run "
        "merges at least twice (--kill-every below --periods), and its "
        "period is the median gap between merges")
  if any(b < a_ for a_, b in zip(merge, merge[1:])):
    return "measured.sync.log.merge_time", (
        "measured.sync.log.merge_time must not decrease (merge times in "
        "order)")
  for mode in ("spmd", "sync"):
    if mode not in measured:
      continue
    key, t = _healthy_step(measured, mode, a["sync_every"], a["slow_sleep"])
    if t <= 0:
      return key, (
          f"{key} gives a healthy step of {t:.6g} s (median "
          f"period / args.sync_every {a['sync_every']} - args.slow_sleep "
          f"{records.short(a['slow_sleep'])}); it must be > 0 (each "
          "period holds the slow learner's sleep)")
  return None


def stored(path: str) -> dict:
  """``{"args": ..., "measured": ...}`` of a results file, checked before
  any number of it is used (decentral_jax.records: types and ranges of
  ``args`` as the flags bound them, each mode's measured values, counts
  that agree; see :func:`_results_agree`).

  Raises:
    ValueError: one line naming ``--out``, the file and the key.
  """
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  got = records.read_json(path, _results_schema(), ("args", "measured"),
                          check=_results_agree)
  if isinstance(got, records.Damaged) and got.key is None:
    raise ValueError(f"--out {path!r} cannot be read as results of this "
                     f"script ({got.reason}); give a file it wrote.")
  if isinstance(got, records.Damaged):
    raise ValueError(f"--out {path!r} is not results of this script: "
                     f"{got.reason}; give a file it wrote (or rerun every "
                     f"mode into a new --out).")
  return got


def _check_kept(args) -> None:
  """The modes kept from --out (not rerun) were measured at the settings
  of its "args": this run must use the same ones (one file, one setting).
  ``--reprice`` reads the file: it must be one this script wrote."""
  if not args.out or not os.path.exists(args.out):
    return
  saved = stored(args.out)
  if args.reprice:
    _check_stored_modes(args, saved["measured"])
    return
  kept = sorted(set(saved["measured"]) - {"model"}
                - set(args.modes.split(",")))
  for key in SETTINGS if kept else ():
    if getattr(args, key) != saved["args"][key]:
      flag = "--" + key.replace("_", "-")
      raise ValueError(
          f"{flag} {getattr(args, key)}: --out {args.out!r} keeps "
          f"{','.join(kept)} measured at {flag} {saved['args'][key]}, "
          "which the file's \"args\" would no longer say; use "
          f"{flag} {saved['args'][key]}, rerun every mode (--modes "
          f"{','.join(MODES)}) or give a new --out.")


def _check_stored_modes(args, measured: dict) -> None:
  """``--reprice``: every mode of ``--modes`` is stored in ``--out``, with
  the runs its price reads (:func:`_needs`)."""
  asked = args.modes.split(",")
  missing = [m for m in MODES if m not in measured and any(
      m in _needs(a) for a in asked)]
  if missing:
    stored_modes = [m for m in MODES if m in measured]
    fix = (f"give --modes {','.join(stored_modes)}" if stored_modes and
           all(m in measured for s in stored_modes for m in _needs(s))
           else "run them first")
    why = ("; decoupled is priced with the sync run's step"
           if "sync" in missing and "sync" not in asked else "")
    raise ValueError(
        f"--reprice: --out {args.out!r} holds no measured result for "
        f"{','.join(missing)} (modes asked: {args.modes}{why}); {fix}.")


def _check_modes(args) -> None:
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
  try:
    modes = flag_types.comma_parts(args.modes, "spmd,sync")
  except argparse.ArgumentTypeError as e:
    raise ValueError(f"--modes {e}") from None
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    raise ValueError(f"--modes: unknown mode {unknown[0]!r}; give some of "
                     f"{','.join(MODES)}.")
  why = flag_types.repeated_entry(args.modes, modes, "spmd,sync")
  if why:
    raise ValueError(f"--modes {why}")


def _check_kill_every(args) -> None:
  """--reprice reads --out; --kill-every kills before the last period."""
  if args.reprice and not args.out:
    raise ValueError("--reprice prices the results stored in --out; give "
                     "--out FILE.")
  if args.kill_every >= args.periods and not args.reprice:
    raise ValueError(
        f"--kill-every {args.kill_every} never kills a learner: the run "
        f"ends after --periods {args.periods} merged periods; use "
        f"--kill-every below {args.periods}.")


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.spmd_worker:
    spmd_worker(args)
    return
  import tempfile  # pylint: disable=import-outside-toplevel
  measured, settings, stored_prices = {}, vars(args), {}
  if args.out and os.path.exists(args.out):  # keep the modes not rerun
    saved = stored(args.out)
    measured = saved["measured"]
    stored_prices = measured.pop("model", None) or {}
    if args.reprice:  # priced at the settings the runs were measured with
      settings = saved["args"]
      args = argparse.Namespace(**{**vars(args), **{
          k: settings[k] for k in SETTINGS}})
  with tempfile.TemporaryDirectory() as tmp:
    for mode in ([] if args.reprice else args.modes.split(",")):
      r = run_spmd(args, tmp) if mode == "spmd" else run_learners(args, mode)
      r["loss"] = eval_loss(r.pop("theta"))
      tokens = (sum(sum(t.values()) for t in r["log"]["tokens"])
                if "log" in r else N * args.periods * args.sync_every * 256)
      r["tokens"], r["tokens_per_s"] = tokens, tokens / r["seconds"]
      measured[mode] = r
      print(f"{mode}: {r['tokens_per_s']:.0f} tokens/s, {r['seconds']:.1f} s,"
            f" loss {r['loss']:.3f}, kills {r['kills']}", flush=True)
  asked = args.modes.split(",") if args.reprice else MODES
  priced = model_prices(args, measured, asked)
  measured["model"] = {  # --reprice: the stored prices of others are kept
      **{k: v for k, v in stored_prices.items() if k not in asked}, **priced}
  print("runtime model tokens/s:", {k: round(v["tokens_per_s"]) for k, v in
                                    priced.items()})
  if args.out:
    import _common  # pylint: disable=import-outside-toplevel
    _common.write_output(args.out, "--out", lambda f: json.dump(
        {"args": settings, "measured": measured}, f, indent=1, default=str),
                         kept="the tokens/s were printed above")


if __name__ == "__main__":
  main()
