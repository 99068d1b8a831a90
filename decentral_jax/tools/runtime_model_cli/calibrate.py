"""Calibrate the runtime model for a training config on this machine.

Measures, on the config's own mesh (one worker per device): the per-worker
compute of a train step without communication (forward, backward, AdamW
update), the gradient All-Reduce (``pmean`` of the parameter tree), every
distinct gossip round of ``one_peer_exp`` (:func:`decentral_jax.comm.gossip.mix`)
and a flat ``pmean`` at two sizes (fitting the mesh's alpha and beta). It
then predicts the per-iteration time of the config's All-Reduce and
one_peer_exp runs, with and without compute/communication overlap, and times
those runs with :class:`decentral_jax.runner.experiment.Experiment`.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.tools.runtime_model_cli import config_sets


def fit_ring_alpha_beta(n: int, nbytes, seconds) -> tuple[float, float]:
  """Latency (s) and bandwidth (bytes/s) of a ring all-reduce from 2 timings.

  Solves ``t = 2(n-1) a + 2(n-1)/n * M / b`` for the two ``(M, t)`` points;
  ``b`` is capped at 1e18 (no measurable size dependence) and ``a >= 0``.
  """
  if n <= 1:
    return 0.0, 1e18
  (m1, t1), (m2, t2) = sorted(zip(nbytes, seconds))
  ring = 2 * (n - 1) / n
  beta = min(ring * (m2 - m1) / max(t2 - t1, 1e-300), 1e18)
  return max(t1 - ring * m1 / beta, 0.0) / (2 * (n - 1)), beta


def calibrate(config, steps: int = 12) -> dict:
  """Measures, fits and predicts; see the module docstring.

  All measurements are taken round-robin (one of each per round, ``steps``
  rounds after two warm-up rounds) so that other load on the machine affects
  them alike, and summarised by their medians. Needs ``config.n_workers``
  devices: on CPU the ``calibrate`` subcommand (:func:`run`) asks JAX for
  that many before calling this.

  Args:
    config: a loaded run config
      (:func:`decentral_jax.runner.config.load_config`), e.g.
      ``configs/gpt_tiny.py`` with overrides.
    steps: measured rounds, >= 1.

  Returns:
    A dict: ``n_workers``, ``param_count``, ``compute_ms`` and ``compute_cv``
    (compute-only step; the CV is reported, not used), ``alpha_us`` and
    ``beta_GBps`` (fitted ring all-reduce latency per step, bandwidth),
    ``collectives_ms`` (measured ``all_reduce`` and per-round gossip times),
    and ``runs``: for ``all_reduce`` and ``one_peer_exp`` the measured
    ms/iteration and the predictions ``overlap`` and ``serial`` (measured
    collectives) and ``alpha_beta`` (fitted formula, overlap), in ms.

  Raises:
    ValueError: from :class:`decentral_jax.runner.experiment.Experiment`
      (a bad config, too few devices).
  """
  n = int(config.n_workers)
  timers, exp, params = _train_step_timers(config)
  sizes = (max(exp.param_count // 8, 1), exp.param_count)
  timers.update(_operation_timers(exp, params, sizes))
  samples = {k: [] for k in timers}
  for rnd in range(steps + 2):
    for k, run in timers.items():
      t = run()
      if rnd >= 2:
        samples[k].append(t)
  med = {k: float(np.median(v)) for k, v in samples.items()}
  alpha, beta = fit_ring_alpha_beta(
      n, [4.0 * s for s in sizes], [med[f"flat{s}"] for s in sizes])
  rounds = [med[f"round{d}"] for d in exp.topology.round_to_distinct]
  cv = float(np.std(samples["compute"]) / np.mean(samples["compute"]))
  return {"n_workers": n, "param_count": exp.param_count,
          "compute_ms": 1e3 * med["compute"], "compute_cv": cv,
          "alpha_us": 1e6 * alpha, "beta_GBps": beta / 1e9,
          "collectives_ms": {"all_reduce": 1e3 * med["all_reduce_op"],
                             "gossip_rounds": [1e3 * t for t in rounds]},
          "runs": _predictions(n, exp, med, rounds, alpha, beta)}


def _train_step_timers(config):
  """Timers of one train step of the All-Reduce and the one_peer_exp run.

  Returns:
    ``({"all_reduce": fn, "decentralized": fn}, experiment, params)``: each
    ``fn()`` runs the next step and returns its seconds; the last
    (decentralized) experiment and a copy of its parameters.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import experiment  # pylint: disable=import-outside-toplevel
  timers = {}
  for algo in ("all_reduce", "decentralized"):
    exp = experiment.Experiment(run_config(config, algo))
    box = {"state": exp.init_state(), "k": 0}

    def run(exp=exp, box=box):
      batch = exp.get_batch(box["k"])
      box["k"] += 1
      t = time.perf_counter()
      box["state"], metrics = exp.train_step(box["state"], batch)
      jax.block_until_ready(metrics["loss"])
      return time.perf_counter() - t

    timers[algo] = run
  return timers, exp, jax.tree.map(lambda x: x.copy(), box["state"].params)


def run_config(config, algorithm: str):
  """The config of one of calibrate's runs: ``config`` with ``algorithm``
  over ``one_peer_exp``, and every method field that run does not read
  (:func:`decentral_jax.runner.validation.unread_reason`, e.g.
  ``comm_dtype`` or ``global_avg_interval`` for ``all_reduce``, a local
  method's ``sync_every``) at its default, so a field one run reads does
  not make the other's config invalid."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import methods  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import validation  # pylint: disable=import-outside-toplevel
  cfg = copy.deepcopy(config)
  cfg.algorithm, cfg.topology = algorithm, "one_peer_exp"
  default = config_lib.base_config(str(cfg.model.name))
  for name in methods.method_fields():
    if validation.unread_reason(cfg, name) is not None:
      *group, leaf = name.split(".")
      parent = cfg
      for part in group:
        parent = parent[part]
      want = default
      for part in name.split("."):
        want = want[part]
      parent[leaf] = want
  return cfg


def _operation_timers(exp, params, sizes) -> dict:
  """Timers of the compute-only step, the gradient All-Reduce, every distinct
  gossip round and a flat ``pmean`` of each of ``sizes`` float32 values."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from decentral_jax.comm import gossip
  from decentral_jax import parallel
  mesh, axis, topo = exp.mesh, exp.axis_name, exp.topology
  loss = exp.task.loss
  adamw = optax.adamw(1e-3)

  def compute_only(p, batch):
    g = jax.grad(lambda q: loss(q, batch, None)[0])(p)
    u, _ = adamw.update(g, adamw.init(p), p)
    return optax.global_norm(optax.apply_updates(p, u))

  def timed(fn, *args):
    fn = jax.jit(parallel.per_worker(fn, mesh))

    def run():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      return time.perf_counter() - t
    return run

  timers = {"compute": timed(compute_only, params, exp.get_batch(0))}
  pmean = lambda p: gossip.mean(p, axis)  # noqa: E731
  timers["all_reduce_op"] = timed(pmean, params)
  for r in range(len(topo.distinct_rounds)):
    step = topo.round_to_distinct.index(r)
    timers[f"round{r}"] = timed(lambda p, s=step: gossip.mix(p, topo, s, axis),
                                params)
  for size in sizes:
    timers[f"flat{size}"] = timed(
        pmean, parallel.replicate(np.zeros(size, np.float32), mesh))
  return timers


def _predictions(n: int, exp, med: dict, rounds, alpha: float,
                 beta: float) -> dict:
  """Simulated ms/iteration of both runs from the medians ``med`` (seconds)."""
  comp = med["compute"]
  # A jitted SPMD step ends together on all workers, so per-worker
  # variability is not observable here: the model gets the median compute.
  w = Workload(exp.param_count, comp / 3, 2 * comp / 3,
                    bucket_shares=(1.0,))
  c = Cluster(n, n, alpha, min(beta, 1e18), alpha, min(beta, 1e18))
  runs = {}
  for algo, name, meas in (("all_reduce", "all_reduce", (med["all_reduce_op"],)),
                           ("decentralized", "one_peer_exp", tuple(rounds))):
    kind, tp = ("all_reduce", None) if algo == "all_reduce" else (
        "gossip", exp.topology)
    runs[name] = {"measured_ms": 1e3 * med[algo]}
    for label, overlap, m_s in (("overlap", True, meas), ("serial", False, meas),
                                ("alpha_beta", True, None)):
      method = Method(name, kind, tp, overlap=overlap, measured_s=m_s)
      runs[name][label] = 1e3 * simulate(method, c, w, steps=20, warmup=4)
  return runs


def format_report(r: dict) -> str:
  """Human-readable table of a :func:`calibrate` result."""
  lines = [
      f"{r['n_workers']} workers, {r['param_count']:,} parameters; compute "
      f"(fwd+bwd+AdamW, no comm) {r['compute_ms']:.2f} ms (median; step "
      f"CV {r['compute_cv']:.2f})",
      f"fitted ring all-reduce: alpha {r['alpha_us']:.1f} us/step, beta "
      f"{r['beta_GBps']:.3g} GB/s; measured all-reduce "
      f"{r['collectives_ms']['all_reduce']:.2f} ms, gossip rounds " +
      ", ".join(f"{t:.2f}" for t in r["collectives_ms"]["gossip_rounds"]) +
      " ms",
      f"{'run':<14}{'measured':>10}{'overlap':>10}{'serial':>10}"
      f"{'alpha-beta':>12}   (ms/iteration; predictions)"]
  for name, v in r["runs"].items():
    lines.append(f"{name:<14}{v['measured_ms']:10.2f}{v['overlap']:10.2f}"
                 f"{v['serial']:10.2f}{v['alpha_beta']:12.2f}")
  return "\n".join(lines)


def run(args) -> int:
  """The ``calibrate`` subcommand: check the config, measure, print.

  Raises:
    ValueError: a bad flag or config (one line naming it).
  """
  from decentral_jax.runner import devices  # pylint: disable=import-outside-toplevel
  # The config and its device count are checked before JAX starts.
  config = config_sets.load("calibrate", args.config, args.set)
  if config.compression.format != "none":
    raise ValueError(
        f"config.compression.format={config.compression.format!r} (from "
        f"--config {args.config}): {config_sets.NO_COMPRESSION}; use a "
        "config without compression.")
  if int(config.n_workers) < 2:
    raise ValueError(
        f"config.n_workers={config.n_workers}: calibrate needs at least 2 "
        "workers (it fits the all-reduce's latency and bandwidth from "
        "collectives between workers, and one worker sends nothing); give "
        "--set n_workers=2 or more.")
  devices.check_simulated_devices(int(config.n_workers),
                                     f"config.n_workers={config.n_workers}")
  import jax  # pylint: disable=import-outside-toplevel
  try:  # one CPU device per worker (on CPU; the command line's choice)
    jax.config.update("jax_num_cpu_devices", max(int(config.n_workers), 1))
  except RuntimeError:  # backend already started; use the devices it has
    pass
  with config_sets.set_spelling():
    report = calibrate(config, steps=args.steps)
  print(format_report(report))
  return 0
