"""Command line: ``python -m decentral_jax.runtime_model {predict,fig6,validate,utilisation,measure,calibrate}``.

Examples::

  # A40-like cluster (Figure 6 preset), 8/16/32 GPUs, table + bar chart:
  python -m decentral_jax.runtime_model predict --preset A40 \\
      --n-workers 8,16,32 --png /tmp/a40.png
  # Your own cluster and model (units in the flag names):
  python -m decentral_jax.runtime_model predict --n-workers 32 \\
      --local-size 8 --intra-GBps 300 --nic-Gbps 200 --params 1.3e9 \\
      --param-dtype bfloat16 --grad-dtype float32 --forward-ms 60 \\
      --backward-ms 120 --compute-cv 0.05
  # Figure 6 of the paper: measured vs predicted, and the chart:
  python -m decentral_jax.runtime_model fig6 --png docs/figures/runtime_fig6.png
  # Local-update methods next to All-Reduce and gossip (a spec's own
  # KEY=VALUE parameters follow it, separated by commas too):
  python -m decentral_jax.runtime_model predict --n-workers 16 \\
      --methods all_reduce,aer,diloco:H=10,streaming_diloco:H=10,P=4,tau=1
  # Named clusters and workloads; two datacenters over a wide-area link:
  python -m decentral_jax.runtime_model predict --preset cross_region_2dc \
      --workload 1b --n-workers 32 --methods all_reduce,diloco:H=30
  # Compressed communication (predict prints each one's break-even rate):
  python -m decentral_jax.runtime_model predict --n-workers 16 \
      --methods all_reduce,static_ring,dadam:topology=static_ring,compress=int8
  # Compute utilisation against bandwidth (eager paper, Table 5):
  python -m decentral_jax.runtime_model utilisation --png util.png
  # Leave-one-cluster-out validation on Figure 6:
  python -m decentral_jax.runtime_model validate
  # Measure your cluster (one process per host; SLURM-aware) and predict:
  python -m decentral_jax.runtime_model measure --config configs/gpt_tiny.py \\
      --out cluster.json
  python -m decentral_jax.runtime_model predict --cluster cluster.json
  # Measure a config's compute and collectives here and compare:
  python -m decentral_jax.runtime_model calibrate --config configs/gpt_tiny.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from decentral_jax import layout_modes
from decentral_jax.runtime_model import cluster_file
# The predict flags' checks and conversions (re-exported: part of this CLI).
from decentral_jax.runtime_model.cli.inputs import (  # noqa: F401
    MAX_BUCKETS, MAX_PARAMS, MAX_STEPS, MAX_WORKERS, check_file_workers,
    check_output_path, check_predict_args, check_utilisation_args,
    cluster_from_args, comma_list, describe_cluster_file, explicit_flags,
    flag_range,
    from_cluster_file, given_fields, simulated_steps, split_methods,
    workload_from_args)
from decentral_jax.runtime_model import core
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import holdout
from decentral_jax.runtime_model import paper
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import worker_devices
from decentral_jax.runtime_model import stragglers
from decentral_jax.runtime_model import utilisation
from decentral_jax.runtime_model.recommend import label

DEFAULT_METHODS = "all_reduce,one_peer_exp,aer"
# Added to DEFAULT_METHODS on a cluster of several datacenters, where a sync
# every H steps over the wide-area link is the usual choice (the local-update
# arms of experiments/compare.py, H = 10).
WAN_DEFAULT_METHODS = "local_sgd:H=10,diloco:H=10,streaming_diloco:H=10,P=2"
# Relative error of a Figure 6 bar the acceptance allows (fig6, validate).
TOLERANCE = 0.2


class _Parser(argparse.ArgumentParser):
  """argparse with its errors as one ``error:`` line (exit code 2)."""

  def error(self, message):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


def bar_chart(panels, path: str, ylabel: str = "ms / iteration") -> None:
  """Grouped bar chart like the paper's Figure 6.

  Args:
    panels: list of ``(title, [(group_label, {method: ms}, {method: ms} or
      None)])``; the first dict is drawn as solid bars, the optional second
      (measured values) as hatched bars beside them.
    path: PNG file to write.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8),
                           squeeze=False)
  colors = plt.get_cmap("tab10").colors
  for ax, (title, groups) in zip(axes[0], panels):
    methods = list(groups[0][1])
    both = groups[0][2] is not None
    width = 0.8 / (len(methods) * (2 if both else 1))
    for k, meth in enumerate(methods):
      for g, (_, pred, meas) in enumerate(groups):
        x0 = g + (k * (2 if both else 1)) * width - 0.4 + width / 2
        ax.bar(x0, pred[meth], width, color=colors[k],
               label=label(meth) + (" (model)" if both else "") if g == 0
               else None)
        if both:
          ax.bar(x0 + width, meas[meth], width, color="white",
                 edgecolor=colors[k], hatch="///",
                 label=label(meth) + " (measured)" if g == 0 else None)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", fontsize=8,
             ncol=min(len(labels), 4), frameon=False)
  fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 3) // 4) + 0.02, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _predict(args) -> int:
  chosen = "--methods" in explicit_flags(args)
  methods = split_methods(args.methods)
  if not methods:
    raise ValueError("--methods is empty; give e.g. "
                     "--methods all_reduce,one_peer_exp,aer.")
  _check_figure6(args)
  workers_note = None
  if "--n-workers" not in explicit_flags(args) and not args.cluster:
    workers_note = _default_workers(args)
  check_predict_args(args)
  faults = _faults_from_args(args)
  measured = None
  if args.cluster:
    if args.preset:
      raise ValueError("--cluster and --preset both give the cluster; use one.")
    measured = cluster_file.read(args.cluster)
    if "--n-workers" not in explicit_flags(args):
      args.n_workers = [measured["cluster"]["n_workers"]]
      check_file_workers(args.cluster, args.n_workers[0])
  setups = [(n, *_cluster_and_workload(args, n, measured))
            for n in args.n_workers]
  if not chosen:
    methods = default_methods(setups[0][1])
  if "all_reduce" not in methods:
    methods.insert(0, "all_reduce")  # the baseline every speedup refers to
  # Every spec is built and priced before anything is printed: a bad one,
  # or a table the arithmetic overflowed, is one error line.
  built = [_make_methods(args, methods, n, c) for n, c, _ in setups]
  priced = _price_all(args, setups, built, faults)
  if measured is not None:
    print(describe_cluster_file(args.cluster, measured))
  print(workload_line(args, setups, measured))
  print(methods_line(methods, chosen, setups[0][1]))
  if workers_note:
    print(workers_note)
  groups = []
  for (n, c, w), (table, made) in zip(setups, priced):
    _print_table(n, c, w, table, made)
    if not faults.none:
      _print_faults(n, w, table, made, faults, args.on_failure)
    groups.append((f"{n} GPUs", {k: 1e3 * p.simulated_s
                                 for k, p in table.items()}, None))
  if args.png:
    _write_chart([(args.preset or "predicted", groups)], args.png)
  return 0


def _table_numbers(n: int, c, w, table, made, faults, on_failure: str):
  """The numbers ``predict``'s tables at ``n`` workers print (seconds and
  bytes; ms/useful may be infinite by right), for :func:`_price_all`."""
  out = [w.compute_mean_s, w.compute_std_s]
  for p in table.values():
    out += [p.simulated_s, p.estimate.iteration_s, p.estimate.exposed_comm_s,
            p.estimate.variability_s, p.sent.worker_bytes, p.sent.node_bytes,
            p.sent.dc_bytes]
  if w.devices_per_worker > 1:
    out.append(worker_devices.inner_collective_s(c, w))
  if not faults.none:
    for key, p in table.items():
      mode, period = fault_mode(made[key])
      out.append(stragglers.straggler_cost(
          mode, n, p.simulated_s, faults, compute_s=w.compute_mean_s,
          compute_std_s=w.compute_std_s, period=period,
          on_failure=on_failure).step_s)
  return out


def _price_all(args, setups, built, faults) -> list:
  """:func:`_price` at every worker count, checked finite.

  The flags' bounds keep the model's arithmetic in range; as a backstop a
  table that would print a non-finite number (or whose arithmetic fails)
  is refused, naming the numeric flags given.

  Raises:
    ValueError: one line naming ``--n-workers`` and those flags.
  """
  priced = []
  for (n, c, w), made_methods in zip(setups, built):
    try:
      with np.errstate(all="ignore"):
        table, made = _price(args, made_methods, c, w)
        finite = all(np.isfinite(x) for x in _table_numbers(
            n, c, w, table, made, faults, args.on_failure))
    except ArithmeticError:  # OverflowError, ZeroDivisionError
      finite = False
    if not finite:
      raise ValueError(f"the model's times at --n-workers {n} are not "
                       f"finite numbers with {_given_numbers(args)}; bring "
                       "these values nearer to a real cluster and model.")
    priced.append((table, made))
  return priced


def _given_numbers(args) -> str:
  """``--preset X, --forward-ms 1e+300``: the preset or cluster file and
  the numeric flags given on the command line (but ``--n-workers``,
  ``--steps``, ``--seed``), as given, in the flags' units."""
  out = [f"--preset {args.preset}"] if args.preset else []
  out += [f"--cluster {args.cluster}"] if args.cluster else []
  for flag in sorted(explicit_flags(args) - {"--n-workers", "--steps",
                                             "--seed"}):
    v = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    if isinstance(v, list):
      out.append(f"{flag} {','.join(f'{x:g}' for x in v)}")
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      out.append(f"{flag} {v:g}")
  return ", ".join(out) or "the cluster and workload flags' defaults"


def default_methods(c) -> list[str]:
  """``predict``'s methods without ``--methods``: :data:`DEFAULT_METHODS`,
  and on a cluster of several datacenters :data:`WAN_DEFAULT_METHODS`."""
  out = split_methods(DEFAULT_METHODS)
  if c.datacenters > 1:
    out += split_methods(WAN_DEFAULT_METHODS)
  return out


def methods_line(methods, chosen: bool, c) -> str:
  """One line: the methods ``predict`` compares and why those."""
  names = ",".join(methods)  # as --methods takes them
  if chosen:
    return f"methods: {names} (as given by --methods)"
  if c.datacenters > 1:
    return (f"methods: {names} (the default across datacenters: All-Reduce, "
            "gossip and the local-update methods; choose with --methods)")
  return (f"methods: {names} (the default within one datacenter; add "
          "local-update methods with e.g. --methods "
          f"{DEFAULT_METHODS},diloco:H=10)")


def _check_figure6(args) -> None:
  """``--workload figure6`` exists only with a Figure 6 preset."""
  if args.workload == presets.FIGURE6 and (
      args.preset not in presets.FIGURE6_PRESETS):
    where = f"--preset {args.preset}" if args.preset else (
        f"--cluster {args.cluster}" if args.cluster else "the cluster flags")
    raise ValueError(
        f"--workload {presets.FIGURE6} is the paper's Transformer base with "
        "compute fitted to a Figure 6 cluster; give it with --preset "
        f"{' or '.join(presets.FIGURE6_PRESETS)} (not {where}), or use "
        f"--workload {' or '.join(presets.WORKLOADS)}.")


def _default_workers(args) -> str:
  """Sets ``args.n_workers`` when ``--n-workers`` is not given; the line
  saying so. With ``--preset``: :func:`presets.default_workers` (16 where
  the preset holds it); else 16."""
  n = presets.DEFAULT_WORKERS
  why = "the default"
  if args.preset:
    n = presets.default_workers(args.preset, n)
    why = (f"all GPUs of --preset {args.preset}" if n < presets.DEFAULT_WORKERS
           else f"the smallest count from {presets.DEFAULT_WORKERS} on that "
           f"--preset {args.preset} holds")
  args.n_workers = [n]
  return (f"workers: {n} (--n-workers not given: {why}; choose with "
          "--n-workers N[,N...])")


def workload_line(args, setups, measured: dict | None) -> str:
  """One line: the workload ``predict`` prices, its source, how to change it.

  Args:
    args: the parsed flags.
    setups: ``[(n, Cluster, Workload)]`` per worker count.
    measured: the ``--cluster`` file's contents, or None.
  """
  w = setups[0][2]
  flags = {flag for flag, *_ in _WORKLOAD_FLAGS} | {"--worker-layout"}
  given = sorted(explicit_flags(args) & flags)
  if args.preset in presets.FIGURE6_PRESETS and args.workload in (
      None, presets.FIGURE6):
    source = (f"--preset {args.preset}'s own workload (--workload "
              f"{presets.FIGURE6}), "
              f"{presets.WORKLOAD_WORDS[presets.FIGURE6]}")
  elif args.workload:
    source = (f"--workload {args.workload}: "
              f"{presets.WORKLOAD_WORDS[args.workload]}")
  elif measured is not None and measured.get("workload") is not None:
    source = f"--cluster {args.cluster}, measured by `measure`"
  elif given:
    source = (f"the workload flags ({', '.join(given)} as given, the rest "
              "at their defaults)")
    given = []
  else:
    source = ("the workload flags' defaults, the size of the paper's "
              "Transformer base")
  if given:
    source += f" ({', '.join(given)} as given)"
  ms = [1e3 * s[2].compute_mean_s for s in setups]
  compute = (f"{ms[0]:.1f} ms" if len({round(x, 1) for x in ms}) == 1 else
             ", ".join(f"{x:.1f} ms at n={s[0]}" for x, s in zip(ms, setups)))
  count = w.param_count
  words = (f"{count / 1e9:.4g}B" if count >= 1e9 else f"{count / 1e6:.4g}M"
           if count >= 1e6 else f"{count:,.0f}")
  return (f"workload: {words} parameters ({w.grad_dtype} gradients, "
          f"{w.param_dtype} parameters on the wire), compute {compute} per "
          f"step, from {source}. Change it with --workload "
          f"{'|'.join(presets.WORKLOAD_NAMES)} or --params, --forward-ms, "
          "--backward-ms.")


def _cluster_and_workload(args, n: int, measured: dict | None):
  """The cluster and workload at ``n`` workers: preset, file or flags.

  ``--preset`` and ``--workload`` give whole sets of fields; cluster and
  workload flags given as well override single fields.
  """
  if args.preset:
    try:
      c, w = presets.setup(args.preset, n, args.workload,
                           default=workload_from_args(args))
    except ValueError as e:
      raise ValueError(f"--n-workers {n} with --preset {args.preset}: {e}"
                       ) from None
    return given_fields(args, c, w)
  if measured is not None:
    c, w = from_cluster_file(measured, args, n)
  else:
    c, w = cluster_from_args(args, n), workload_from_args(args)
  if args.workload:
    c, w = given_fields(args, c, presets.workload(args.workload))
  return c, w


def _make_methods(args, methods, n: int, c) -> list:
  """``[(spec, Method, simulated steps)]`` of every spec at ``n`` workers.

  Raises:
    ValueError: a spec the cluster cannot run, naming it and ``n``.
  """
  out = []
  for spec in methods:
    try:
      m = core.make_method(spec, c)
      out.append((spec, m, simulated_steps(m, args.steps)))
    except ValueError as e:
      raise ValueError(f"--methods {spec} at --n-workers {n}: {e}") from None
  return out


def _price(args, made_methods, c, w):
  """Every method of :func:`_make_methods` priced, keyed for the table.

  Returns:
    ``({key: Prediction}, {key: Method})``.
  """
  table, made = {}, {}
  for spec, m, steps in made_methods:
    p = recommend.predict(spec, m, c, w, steps=steps,
                          warmup=args.steps // 5, seed=args.seed)
    table[p.key], made[p.key] = p, m
  return table, made


def _shape(c) -> str:
  """``(4 nodes x 8)``, or with datacenters ``(2 datacenters x 2 nodes x 8,
  wide-area 10 Gbit/s, 30 ms)``."""
  if c.datacenters == 1:
    return f"({c.n_nodes} nodes x {c.local_size})"
  return (f"({c.datacenters} datacenters x {c.n_nodes // c.datacenters} "
          f"nodes x {c.local_size}, wide-area {8 * c.wan_bandwidth_Bps / 1e9:.3g}"
          f" Gbit/s, {1e3 * c.wan_latency_s:.3g} ms)")


def _print_table(n: int, c, w, table: dict[str, recommend.Prediction],
                 methods: dict | None = None) -> None:
  """``predict``'s table at ``n`` workers, its footnotes and recommendation.

  ``methods``: ``{key: Method}`` of the table, for the break-even lines of
  compressed methods.
  """
  ar = table["all_reduce"].simulated_s if "all_reduce" in table else None
  span = (f" of {w.devices_per_worker} devices ({w.worker_layout})"
          if w.devices_per_worker > 1 else "")
  print(f"n={n} workers{span} {_shape(c)}, "
        f"compute {1e3 * w.compute_mean_s:.1f} ms (CV "
        f"{w.compute_std_s / max(w.compute_mean_s, 1e-300):.2f})")
  width = max([22] + [len(label(k)) + 3 for k in table])
  wan = c.datacenters > 1
  print(f"  {'method':<{width}}{'sim ms':>9}{'closed ms':>10}{'vs AR':>7}"
        f"{'comm ms':>9}{'var ms':>8}{'MB/it':>9}{'node MB/it':>11}"
        + (f"{'WAN MB/it':>10}" if wan else ""))
  for key, p in table.items():
    ratio = ar / p.simulated_s if ar else None
    speed = ("-" if ratio is None else f"{ratio:.2f}x" if ratio < 99.995
             else f" {ratio:.0f}x")
    star = ("*" if p.slow_mixing else "") + ("^" if p.library_gap else "")
    print(f"  {label(key) + star:<{width}}{1e3 * p.simulated_s:9.1f}"
          f"{1e3 * p.estimate.iteration_s:10.1f}"
          f"{speed:>7}{1e3 * p.estimate.exposed_comm_s:9.1f}"
          f"{1e3 * p.estimate.variability_s:8.1f}"
          f"{p.sent.worker_bytes / 1e6:9.1f}{p.sent.node_bytes / 1e6:11.1f}"
          + (f"{p.sent.dc_bytes / 1e6:10.1f}" if wan else ""))
  print("  MB/it: MB (1e6 bytes) the busiest worker sends per iteration; "
        "node MB/it: leaving the busiest node (averaged over a period)"
        + ("; WAN MB/it: leaving the busiest datacenter" if wan else ""))
  if w.devices_per_worker > 1:
    inner = next(iter(table.values())).sent.inner_bytes
    print(f"  inside each worker (every method): "
          f"{1e3 * worker_devices.inner_collective_s(c, w):.1f} ms and "
          f"{inner / 1e6:.1f} MB per iteration between its "
          f"{w.devices_per_worker} devices ({w.worker_layout}), counted "
          "in comm ms")
  if any(p.slow_mixing for p in table.values()):
    print("  * no exact averaging within one period (slower mixing); not "
          "recommended")
  gaps = sorted({p.library_gap for p in table.values() if p.library_gap})
  if gaps:
    print("  ^ not in the library yet (priced as asked; never recommended): "
          + "; ".join(gaps))
  if any(p.local for p in table.values()):
    print("  local-update methods sync every H steps: per-iteration time "
          "only, not the loss per iteration")
  for key, m in (methods or {}).items():
    if m.compress is not None:
      print(recommend.break_even_line(key, recommend.break_even(m, c, w)))
  line = recommend.recommend(table)
  print("  recommendation: " + line)
  if recommend.quality_caveat(line):
    print("  recommendation caveat: " + recommend.quality_caveat(line))


def _faults_from_args(args) -> stragglers.Faults:
  """``--slow-fraction``, ``--slow-speed``, ``--failure-rate``,
  ``--mean-downtime`` as :class:`stragglers.Faults` (errors name the flag)."""
  try:
    return stragglers.Faults(
        slow_fraction=args.slow_fraction, slow_speed=args.slow_speed,
        failure_rate=args.failure_rate, mean_downtime=args.mean_downtime)
  except ValueError as e:
    raise ValueError("--" + str(e).replace("_", "-", 1)) from None


def fault_mode(m) -> tuple[str, int]:
  """``(mode, H)`` of a method under faults: All-Reduce waits, gossip does
  not (deadline), DiLoCo / Local SGD over an exact all-reduce use a quorum
  (local D-SGD gossips: deadline)."""
  if m.kind == "all_reduce":
    return "wait", 1
  if m.kind == "local" and m.topology is None:
    return "quorum", int(m.period)
  return "deadline", 1


def _print_faults(n: int, w, table, made, faults, on_failure: str) -> None:
  """The table of what the faults cost each method (``docs/faults.md``)."""
  k = faults.slow_workers(n)
  print(f"  with faults: {k} of {n} workers at speed {faults.slow_speed:g}, "
        f"failure rate {faults.failure_rate:g}/step, mean downtime "
        f"{faults.mean_downtime:g} steps (up {100 * faults.up_fraction:.1f}% "
        f"of the time); on_failure={on_failure}")
  width = max([22] + [len(label(key)) + 3 for key in table])
  print(f"  {'method':<{width}}{'mode':>9}{'ms/step':>9}{'work %':>8}"
        f"{'useful %':>9}{'ms/useful':>10}")
  for key, p in table.items():
    mode, period = fault_mode(made[key])
    cost = stragglers.straggler_cost(
        mode, n, p.simulated_s, faults, compute_s=w.compute_mean_s,
        compute_std_s=w.compute_std_s, period=period, on_failure=on_failure)
    print(f"  {label(key):<{width}}{mode:>9}{1e3 * cost.step_s:9.1f}"
          f"{100 * cost.work_done:8.1f}{100 * cost.useful:9.1f}"
          f"{1e3 * cost.time_per_useful_step:10.1f}")
  print("  wait: every step waits for the slowest worker and stalls while "
        "any is down; deadline: gossip goes on without them; quorum: "
        "DiLoCo's outer step over the live workers. useful %: worker-steps "
        "that count; ms/useful = ms/step / useful")


def _write_chart(panels, path: str) -> None:
  """``bar_chart`` to ``--png path``; an OS error names the path."""
  try:
    bar_chart(panels, path)
  except OSError as e:
    raise ValueError(f"--png {path!r} could not be written: "
                     f"{e.strerror or e}.") from None
  print(f"wrote {path}")


def _fig6(args) -> int:
  check_output_path(args.png, "--png")
  params = None
  if args.refit:
    t4 = paper.fit_fig6("T4")
    params = {"T4": t4, "A40": paper.fit_fig6("A40", t4["compute_cv"])}
    for name, p in params.items():
      print(f"fitted {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in p.items()))
  table = paper.rows(params)
  _print_rows(table, paper.VALIDATED)
  bad = paper.failures(table, TOLERANCE)
  print("acceptance (All-Reduce, Exp, AER within 20%, ordering): " +
        ("PASS" if not bad else "FAIL\n  " + "\n  ".join(bad)))
  if args.png:
    panels = []
    for name, spec in paper.FIG6_MS.items():
      groups = []
      for n in spec["n"]:
        sel = [r for r in table if r["cluster"] == name and r["n"] == n]
        groups.append((f"{n} GPUs", {r["method"]: r["simulated_ms"] for r in sel},
                       {r["method"]: r["measured_ms"] for r in sel}))
      panels.append((f"{name} cluster ({paper.PUBLISHED[name]['local_size']}"
                     " GPUs/node)", groups))
    _write_chart(panels, args.png)
  return 1 if bad else 0


# Why a method's Figure 6 bars are reported but not judged.
NOT_JUDGED = {
    "sgp": "SGP (Exp) is reported, not judged: the model prices it as "
           "blocking push-sum, while its measured bars on A100 and A40 are "
           "near Exp's, as if its gossip overlapped the compute",
    "all_reduce": "All-Reduce is the bar the compute was fitted to",
}


def rows_text(table, judged, tolerance: float = TOLERANCE) -> str:
  """The measured-vs-predicted table of ``fig6`` and ``validate``.

  Args:
    table: rows of :func:`paper.rows` or :func:`holdout.rows` (``error`` =
      simulated / measured - 1).
    judged: methods the acceptance judges. A row with ``|error| >
      tolerance`` is marked ``!`` if its method is judged, else ``~``; a
      footnote explains each mark shown (:data:`NOT_JUDGED` says why).
    tolerance: the acceptance's relative error.
  """
  lines = [f"{'cluster':<8}{'GPUs':>5}  {'method':<14}{'measured':>9}"
           f"{'sim':>8}{'closed':>8}{'error':>8}"]
  marked = {"!": set(), "~": set()}
  for r in table:
    mark = ""
    if abs(r["error"]) > tolerance:
      mark = "!" if r["method"] in judged else "~"
      marked[mark].add(r["method"])
    lines.append(f"{r['cluster']:<8}{r['n']:>5}  {label(r['method']):<14}"
                 f"{r['measured_ms']:9.1f}{r['simulated_ms']:8.1f}"
                 f"{r['closed_form_ms']:8.1f}{100 * r['error']:+7.1f}% "
                 f"{mark}".rstrip())
  pct = f"{100 * tolerance:.0f}%"
  if marked["!"]:
    lines.append(f"! error beyond +-{pct}, the acceptance's tolerance")
  if marked["~"]:
    lines.append(f"~ error beyond +-{pct} in a bar the acceptance does not "
                 "judge: " + "; ".join(
                     NOT_JUDGED.get(m, f"{label(m)} is not judged")
                     for m in sorted(marked["~"])))
  return "\n".join(lines)


def _print_rows(table, judged) -> None:
  print(rows_text(table, judged))


def _validate(args) -> int:
  folds, insample = (holdout.refit() if args.refit
                     else (holdout.FOLDS, holdout.INSAMPLE))
  print("leave-one-cluster-out: each cluster's Exp and AER bars predicted "
        "from its published links,\nits compute fitted to its All-Reduce "
        "bars only, and the shared values fitted on the other clusters")
  for name in holdout.CLUSTERS:
    f = folds[name]
    print(f"  {name}: compute a={1e3 * f['compute']['a_s']:.1f} ms, "
          f"b={f['compute']['b_s']:.3f} s*GPU; from the others: compute CV "
          f"{f['shared']['compute_cv']:.3f}, {f['shared']['nics_per_node']} "
          "NIC port(s) per node")
  table = holdout.rows(folds)
  _print_rows(table, holdout.DECENTRALIZED)
  bad = holdout.failures(table, TOLERANCE)
  known = [b for b in bad if any(b.startswith(k) for k in holdout.DOCUMENTED)]
  print("acceptance (Exp, AER within 20%, ordering): " +
        ("PASS" if not bad else f"{len(bad)} failure(s), "
         f"{len(known)} documented (docs/runtime_model.md)\n  " +
         "\n  ".join(bad)))
  print("\nin-sample (each cluster fitted on its own All-Reduce, Exp and AER "
        "bars; for comparison):")
  _print_rows(holdout.insample_rows(insample), holdout.DECENTRALIZED)
  new = [b for b in bad if b not in known]
  return 1 if new else 0


def _utilisation(args) -> int:
  """The ``utilisation`` command: table, check against the paper, PNG."""
  check_output_path(args.png, "--png")
  check_output_path(args.table, "--table")
  check_utilisation_args(args)
  setting = utilisation.Setting(
      n_workers=args.n_workers, param_count=args.params,
      step_s=args.step_ms * 1e-3, period=args.H,
      latency_s=args.latency_ms * 1e-3, codec_Bps=args.codec_GBps * 1e9,
      grad_dtype=args.grad_dtype, bucket_bytes=args.bucket_MiB * 2**20)
  try:
    setting.cluster(1e9)
    setting.workload()
  except ValueError as e:
    raise ValueError(f"utilisation: {e}") from None
  rows = utilisation.table(setting)
  text = utilisation_table(setting, rows)
  print(text)
  if args.table:
    with open(args.table, "w", encoding="utf-8") as f:
      f.write(text + "\n")
    print(f"wrote {args.table}")
  if args.png:
    rates = np.logspace(np.log10(0.1e9 / 8), np.log10(1e12 / 8), 121)
    _utilisation_chart(setting, rates, rows, args.png)
  return 0


def utilisation_table(setting, rows) -> str:
  """The ``utilisation`` table (Markdown): Gbit/s needed per target."""
  targets = utilisation.TARGETS
  head = ("Compute utilisation against the link rate between workers: "
          f"{setting.n_workers} workers, {setting.param_count:.3g} "
          f"parameters, {1e3 * setting.step_s:.0f} ms of compute per step, "
          f"H = {setting.period}, latency {1e3 * setting.latency_s:.3g} ms, "
          f"codec {setting.codec_Bps / 1e9:.3g} GB/s (closed form, no "
          "compute variability). Gbit/s needed for each utilisation:")
  lines = [head, "", "| method | spec | " + " | ".join(
      f"{100 * t:.0f}%" for t in targets) + " |",
           "|---|---|" + "---|" * len(targets)]
  for r in rows:
    cells = ["not reached" if x is None else f"{8 * x / 1e9:.3g}"
             if x < 125e9 else f"{8 * x / 1e9:.0f}" for x in r["rates_Bps"]]
    mark = " ^" if r["library_gap"] else ""
    lines.append(f"| {r['label']}{mark} | `{r['spec']}` | "
                 + " | ".join(cells) + " |")
  gaps = sorted({r["library_gap"] for r in rows if r["library_gap"]})
  if gaps:
    lines.append("")
    lines.append("^ not in the library yet: " + "; ".join(gaps) + ".")
  dp = rows[0]["rates_Bps"][targets.index(0.95)] if 0.95 in targets else None
  if dp is not None:
    ratio = 8 * dp / 1e9 / utilisation.PAPER_DP_95_GBPS
    lines.append("")
    lines.append(f"data-parallel at 95%: {8 * dp / 1e9:.3g} Gbit/s; Kale et "
                 f"al. 2025 (Table 5): about {utilisation.PAPER_DP_95_GBPS:g}"
                 f" Gbit/s (ratio {ratio:.2f}).")
  return "\n".join(lines)


def _utilisation_chart(setting, rates, rows, path: str) -> None:
  """Utilisation (%) against Gbit/s, one line per method; ``path`` a PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  curves = utilisation.curves(setting, rates)
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  gaps = {r["label"] for r in rows if r["library_gap"]}
  for (lab, util), style in zip(curves.items(), ("-", "-", "--", "--", "--")):
    ax.plot(8 * rates / 1e9, 100 * util, style,
            label=lab + (" (not in the library)" if lab in gaps else ""))
  ax.axhline(95, color="grey", lw=0.8, ls=":")
  ax.axvline(utilisation.PAPER_DP_95_GBPS, color="grey", lw=0.8, ls=":")
  ax.text(utilisation.PAPER_DP_95_GBPS * 1.05, 40, "paper: DP 95% at\n222 "
          "Gbit/s", fontsize=7, color="grey")
  ax.set_xscale("log")
  ax.set_ylim(0, 101)
  ax.set_xlabel("bandwidth between workers (Gbit/s per direction)")
  ax.set_ylabel("compute utilisation (%)")
  ax.set_title(f"{setting.param_count:.3g} parameters, "
               f"{1e3 * setting.step_s:.0f} ms per step, H = "
               f"{setting.period}, {setting.n_workers} workers")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  try:
    fig.savefig(path, dpi=120)
  except OSError as e:
    raise ValueError(f"--png {path!r} could not be written: "
                     f"{e.strerror or e}.") from None
  finally:
    plt.close(fig)
  print(f"wrote {path}")


def _add_utilisation(sub) -> None:
  """The ``utilisation`` subcommand's flags (defaults: Kale et al. 2025, Table 5)."""
  u = sub.add_parser("utilisation", help="compute utilisation against the "
                     "bandwidth between workers for data-parallel, DiLoCo "
                     "and eager DiLoCo (Kale et al. 2025, Table 5); a table "
                     "and a PNG")
  for flag, typ, default, text in (
      ("--n-workers", int, 2, "workers, each its own node with one link"),
      ("--params", float, 1e9, f"parameter count, at most {MAX_PARAMS:g} "
       f"and in at most {MAX_BUCKETS} buckets of --bucket-MiB"),
      ("--step-ms", float, 100.0, "compute per step, ms (forward : "
       "backward = 1 : 2)"),
      ("--H", int, 30, "DiLoCo's inner steps per outer step"),
      ("--latency-ms", float, 0.0, "latency per message, ms"),
      ("--codec-GBps", float, 100.0, "float32 GB/s one worker quantizes or "
       "dequantizes (fp4 line)"),
      ("--grad-dtype", str, "bfloat16", "data-parallel's gradients on the "
       "wire"),
      ("--bucket-MiB", float, 25.0, "bucket (message) size, MiB")):
    shown = f"{default:g}" if isinstance(default, float) else default
    bounds = flag_range(flag, "utilisation")
    u.add_argument(flag, type=typ, default=default,
                   help=f"{text} (default {shown}"
                   + (f"; {bounds})" if bounds else ")"))
  u.add_argument("--png", help="write the utilisation curves to this PNG")
  u.add_argument("--table", help="write the table (Markdown) to this file")
  u.set_defaults(run=_utilisation)


def _measure(args) -> int:
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import launch  # pylint: disable=import-outside-toplevel
  from decentral_jax.parallel import multiprocess
  from decentral_jax.runner import validation  # pylint: disable=import-outside-toplevel
  from decentral_jax.runtime_model.cli import measure  # pylint: disable=import-outside-toplevel
  check_output_path(args.out, "--out")
  if args.repeats < 2:  # predict needs >= 2 compute samples for the spread
    raise ValueError(f"--repeats must be >= 2 (the compute spread needs two "
                     f"timings), got {args.repeats}.")
  config = config_lib.load_config(args.config, args.set)
  validation.check_config(config)
  launch.initialize_from_config(config)  # SLURM-aware, as the runner
  data = measure.measure(config, local_size=args.local_size,
                         sizes_bytes=[x * 1e6 for x in args.sizes_MB],
                         repeats=args.repeats, config_path=args.config,
                         overrides=args.set)
  if multiprocess.is_main_process():
    cluster_file.write(args.out, data)
    w = data["workload"]
    print(describe_cluster_file(args.out, {"schema": cluster_file.SCHEMA,
                                           **data}))
    print(f"  compute of one worker: forward {1e3 * w['forward_s']:.3g} ms, "
          f"backward {1e3 * w['backward_s']:.3g} ms (CV "
          f"{w['compute_cv']:.2f}), {w['param_count']:,} parameters")
    print(f"wrote {args.out}; predict with: python -m "
          f"decentral_jax.runtime_model predict --cluster {args.out}")
  return 0


def _calibrate(args) -> int:
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import validation  # pylint: disable=import-outside-toplevel
  from decentral_jax.runtime_model.cli import calibrate  # pylint: disable=import-outside-toplevel
  # The config and its device count are checked before JAX starts.
  config = config_lib.load_config(args.config, args.set)
  validation.check_config(config)
  validation.check_simulated_devices(int(config.n_workers),
                                     f"config.n_workers={config.n_workers}")
  import jax  # pylint: disable=import-outside-toplevel
  try:  # one CPU device per worker (on CPU; the command line's choice)
    jax.config.update("jax_num_cpu_devices", max(int(config.n_workers), 1))
  except RuntimeError:  # backend already started; use the devices it has
    pass
  report = calibrate.calibrate(config, steps=args.steps)
  print(calibrate.format_report(report))
  return 0


# (flag, type, default, help); units are in the flag names.
_CLUSTER_FLAGS = (
    ("--local-size", int, 8, "workers per node L"),
    ("--intra-GBps", float, 15.75, "intra-node bandwidth per worker and "
     "direction, GB/s (15.75 = PCIe 3.0 x16)"),
    ("--intra-latency-us", float, 5.0, "intra-node latency per message, us"),
    ("--nic-Gbps", float, 100.0, "line rate of one NIC port per direction, "
     "Gbit/s (100 = InfiniBand EDR), shared by the flows on it"),
    ("--nics-per-node", int, 1, "NIC ports per node (8 on a rail-optimised "
     "8-GPU node, e.g. DGX A100)"),
    ("--nic-efficiency", float, 1.0, "fraction of the line rate large "
     "transfers reach (about 0.94 for TCP over 1500-byte-MTU Ethernet)"),
    ("--flow-Gbps", float, 0.0, "cap on one inter-node flow (one collective's "
     "connections on a node, e.g. one TCP socket), Gbit/s (0: none)"),
    ("--inter-latency-us", float, 10.0, "inter-node latency per message, us"),
    ("--datacenters", int, 1, "datacenters (dividing the nodes), joined by "
     "a wide-area link"),
    ("--wan-Gbps", float, 10.0, "with --datacenters > 1: each datacenter's "
     "wide-area uplink per direction, Gbit/s, shared by its flows"),
    ("--wan-latency-ms", float, 30.0, "with --datacenters > 1: one-way "
     "latency between datacenters, ms"),
    ("--codec-GBps", float, 100.0, "float32 GB/s one device quantizes or "
     "dequantizes (compressed communication; an assumption)"),
)
_WORKLOAD_FLAGS = (
    ("--params", float, 65e6, "parameter count, whole, at most "
     f"{MAX_PARAMS:g} and in at most {MAX_BUCKETS} buckets of --bucket-MiB"),
    ("--grad-dtype", str, "float32", "dtype of All-Reduced gradients"),
    ("--param-dtype", str, "float32", "dtype of gossiped parameters"),
    ("--forward-ms", float, 30.0, "mean forward time per iteration, ms"),
    ("--backward-ms", float, 60.0, "mean backward time per iteration, ms"),
    ("--optimizer-ms", float, 0.0, "optimizer step time, ms"),
    ("--compute-cv", float, 0.0, "coefficient of variation of fwd+bwd"),
    ("--compute-samples-ms", comma_list(float), None, "comma-separated "
     "samples of fwd+bwd, ms, each 0 to 1e+06 (replace the mean and CV)"),
    ("--bucket-MiB", float, 25.0, "bucket size, MiB"),
    ("--devices-per-worker", int, 1, "devices of one worker "
     "(config.devices_per_worker; compute times are the worker's)"),
    ("--gossip-in-flight", str, None, "share of the step's compute that "
     "hides the gossip in the compiled program: a fraction, FORWARD,"
     "BACKWARD fractions, or a JSON file with in_flight_fractions "
     "(benchmarks/gpu_check.py --deviceless --json); default: the whole "
     "next forward and backward"),
)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser (all units are in the flag names)."""
  p = _Parser(
      prog="python -m decentral_jax.runtime_model",
      description="Runtime model of decentralized vs All-Reduce training "
      "(Wang et al., ICLR 2025, Sec. 4): predicted ms/iteration per method "
      "and topology, speedup over All-Reduce and a recommendation.",
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  q = sub.add_parser("predict", help="predict ms/iteration for a cluster "
                     "and model")
  q.add_argument("--n-workers", type=comma_list(int), default=[16],
                 help="comma-separated worker counts n (default 16; with "
                 "--preset the smallest count from 16 on that it holds, "
                 "e.g. 32 on cross_region_4dc, 8 on h100_node; with "
                 "--cluster its worker count)")
  q.add_argument("--methods", default=DEFAULT_METHODS,
                 help="comma-separated: all_reduce, sgp, topology names "
                 "(complete, ring, one_peer_exp, aer, ...) or local-update "
                 "specs NAME:KEY=VALUE,... (local_sgd:H=10, diloco:H=10, "
                 "diloco:H=10,topology=ring, streaming_diloco:H=10,P=4,tau=1"
                 ",comm_dtype=bfloat16, local_dsgd:H=4,topology=aer; H, "
                 "tau in steps, defaults H=10, P=1, tau=0; see "
                 f"docs/runtime_model.md); default {DEFAULT_METHODS}, on a "
                 "cluster of several datacenters also "
                 f"{WAN_DEFAULT_METHODS}")
  q.add_argument("--preset", choices=list(presets.CLUSTERS),
                 help="a named cluster: Figure 6's T4, A40, A100 (with the "
                 "paper's model and fitted compute), h100_node, h100_ib, "
                 "cross_region_2dc, cross_region_4dc (sources in "
                 "docs/runtime_model.md); cluster and workload flags given "
                 "as well override single fields")
  q.add_argument("--workload", choices=list(presets.WORKLOAD_NAMES),
                 help="a named workload: gpt2_small (124M parameters, 30.9 "
                 "ms per step), 1b (1e9 parameters, 100 ms per step) or "
                 "figure6 (the paper's 65M-parameter Transformer base fitted "
                 "to Figure 6; with --preset T4, A40 or A100, whose default "
                 "it is); default: the workload flags (65M parameters, 90 "
                 "ms per step); workload flags given as well override "
                 "single fields")
  q.add_argument("--cluster", metavar="FILE",
                 help="cluster JSON written by `measure` (its links and, if "
                 "measured, compute; flags given as well override its "
                 "fields; --n-workers defaults to its worker count)")
  for title, flags in (("cluster", _CLUSTER_FLAGS),
                       ("workload", _WORKLOAD_FLAGS)):
    g = q.add_argument_group(title)
    for flag, typ, default, text in flags:
      bounds = flag_range(flag)
      g.add_argument(flag, type=typ, default=default,
                     help=f"{text} (default {default}"
                     + (f"; {bounds})" if bounds else ")"))
    if title == "workload":
      g.add_argument("--worker-layout", choices=layout_modes.MODES,
                     default="fsdp", help="with --devices-per-worker > 1: "
                     "fsdp (parameters split over the worker's devices) or "
                     "data (replicated) (default fsdp)")
    if title == "cluster":
      g.add_argument("--multi-node", choices=core.MULTI_NODE_ALGORITHMS,
                     default="tree", help="algorithm of group means over "
                     "several nodes (default tree)")
      g.add_argument("--intra-link", choices=costs.INTRA_LINKS,
                     default="pcie", help="pcie: a GPU's intra-node and NIC "
                     "traffic share its PCIe link; nvlink: separate "
                     "(default pcie)")
      g.add_argument("--half-duplex", action="store_true",
                     help="NICs cannot send and receive at full rate at "
                     "once (default: full duplex)")
  g = q.add_argument_group("faults (docs/faults.md; a second table when set)")
  g.add_argument("--slow-fraction", type=float, default=0.0,
                 help="share of workers that are slow, round(f n) of them "
                 "(default 0)")
  g.add_argument("--slow-speed", type=float, default=0.5,
                 help=f"their speed, {flag_range('--slow-speed')} (default 0.5)")
  g.add_argument("--failure-rate", type=float, default=0.0,
                 help="failure probability of a live worker per step, in "
                 "[0, 1) (default 0)")
  g.add_argument("--mean-downtime", type=float, default=10.0,
                 help="mean steps a failed worker stays down, "
                 f"{flag_range('--mean-downtime')} (default 10)")
  g.add_argument("--on-failure", choices=stragglers.ON_FAILURE,
                 default="proceed", help="DiLoCo's quorum rule: proceed "
                 "with the live workers or roll the round back (default "
                 "proceed)")
  q.add_argument("--steps", type=int, default=300,
                 help="simulated iterations, the first fifth is warm-up")
  q.add_argument("--seed", type=int, default=0, help="seed of compute draws")
  q.add_argument("--png", help="write a grouped bar chart to this PNG")
  q.set_defaults(run=_predict)
  f = sub.add_parser("fig6", help="reproduce the paper's Figure 6")
  f.add_argument("--refit", action="store_true",
                 help="re-run the fits instead of using the stored constants")
  f.add_argument("--png", help="write the Figure 6 style chart to this PNG")
  f.set_defaults(run=_fig6)
  e = sub.add_parser("measure", help="measure this cluster's links and a "
                     "config's compute; write a cluster JSON for predict "
                     "--cluster")
  e.add_argument("--config", required=True,
                 help="config file with get_config() (its model, batch and "
                 "n_workers set the compute measured), e.g. configs/gpt_tiny.py")
  e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field (repeatable); "
                 "distributed.* joins a multi-process job as the runner does")
  e.add_argument("--out", required=True, help="cluster JSON to write")
  e.add_argument("--local-size", type=int, default=0,
                 help="devices per node (default 0: the devices of one "
                 "process)")
  e.add_argument("--sizes-MB", type=comma_list(float), default=[1.0, 16.0],
                 help="message sizes of the exchanges, MB (default 1,16)")
  e.add_argument("--repeats", type=int, default=5,
                 help="timed repetitions of each measurement, >= 2 (default 5)")
  e.set_defaults(run=_measure)
  _add_utilisation(sub)
  v = sub.add_parser("validate", help="leave-one-cluster-out validation on "
                     "Figure 6 (T4, A100, A40)")
  v.add_argument("--refit", action="store_true",
                 help="re-run every fold's fits (minutes) instead of the "
                 "stored values")
  v.set_defaults(run=_validate)
  c = sub.add_parser("calibrate", help="measure a config's compute and "
                     "collectives on this machine; compare with train steps")
  c.add_argument("--config", required=True,
                 help="config file with get_config(), e.g. configs/gpt_tiny.py")
  c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field (repeatable), e.g. "
                 "--set n_workers=8")
  c.add_argument("--steps", type=int, default=12,
                 help="measured rounds; each times every run, the compute-only "
                 "step and every collective once (default 12)")
  c.set_defaults(run=_calibrate)
  return p


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  args.explicit_flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
  if getattr(args, "steps", 2) < 2:
    print("error: --steps must be >= 2", file=sys.stderr)
    return 2
  try:
    return args.run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

