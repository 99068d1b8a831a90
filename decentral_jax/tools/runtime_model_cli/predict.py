"""``predict``: ms/iteration of each method on a cluster and workload.

The flow of the runtime model's ``predict`` subcommand (Wang et al., ICLR
2025, Sec. 4; local-update methods and faults as in docs/runtime_model.md):
the cluster and workload at each ``--n-workers`` from a preset, a cluster
file or the flags (:mod:`~decentral_jax.tools.runtime_model_cli.inputs`),
every method spec built and priced (simulated and closed-form seconds per
iteration, bytes per iteration) before anything is printed, then one table
per worker count (:mod:`~decentral_jax.tools.runtime_model_cli.tables`).
Bad input raises ``ValueError`` with one line naming the flag. No JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys

import numpy as np

from decentral_jax.runtime_model import workload_file
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model import method_messages
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import recommend
from decentral_jax.runtime_model import worker_devices
from decentral_jax.runtime_model import workload as workload_lib
from decentral_jax.runtime_model import stragglers
from decentral_jax.tools import distinct_paths
from decentral_jax.tools import flag_types
from decentral_jax.tools.runtime_model_cli import cluster_header
from decentral_jax.tools.runtime_model_cli import file_cluster
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import parser as parser_lib
from decentral_jax.tools.runtime_model_cli import predict_needs
from decentral_jax.tools.runtime_model_cli.predict_needs import NEEDS
from decentral_jax.tools.runtime_model_cli import simulated_work
from decentral_jax.tools.runtime_model_cli import tables
from decentral_jax.tools.runtime_model_cli import wire_dtype


def run(args) -> int:
  chosen = "--methods" in inputs.explicit_flags(args)
  methods = inputs.split_methods(args.methods)
  if not methods:
    raise ValueError("--methods is empty; give e.g. "
                     "--methods all_reduce,one_peer_exp,aer.")
  inputs.check_input_paths(args)
  _check_distinct_files(args)
  _check_figure6(args)
  workers_note = None
  if "--n-workers" not in inputs.explicit_flags(args) and not args.cluster:
    workers_note = _default_workers(args)
  inputs.check_predict_args(args)
  faults = _faults_from_args(args)
  measured = None
  if args.cluster:
    if args.preset:
      raise ValueError("--cluster and --preset both give the cluster; use one.")
    measured = cluster_file.read(args.cluster)
    if "--n-workers" not in inputs.explicit_flags(args):
      args.n_workers = [measured["cluster"]["n_workers"]]
  predict_needs.check_slow_workers(args)
  setups = [(n, *_cluster_and_workload(args, n, measured))
            for n in args.n_workers]
  _check_some_time(setups)
  if not chosen:
    methods = default_methods(setups[0][1])
  # Every spec is built and priced before anything is printed: a bad one,
  # a repeat, or a table the arithmetic overflowed, is one error line.
  built, added = _build_methods(args, methods, setups)
  simulated_work.check(args, simulated_work.work(setups, built), methods,
                       added)
  setting = predict_needs.Setting(args, setups, built, [
      _base_flow(args, n, measured) for n, _, _ in setups], measured,
      _cluster_and_workload,
      lambda n, c, w, made: _printed(args, n, c, w, made, faults))
  flag_types.check_needs(NEEDS, inputs.explicit_flags(args), setting)
  predict_needs.check_pipelined(setting)
  priced = _price_all(args, setups, built, faults)
  if measured is not None:
    for line in predict_needs.unused_file_keys(args.cluster, measured, setting):
      print(line, file=sys.stderr)
    print(cluster_header.describe_cluster_file(
        args.cluster, measured, setups[0][1], inputs.explicit_flags(args)))
  print(workload_line(args, setups, measured, setting.methods))
  print(methods_line(methods, chosen, setups[0][1], added))
  if workers_note:
    print(workers_note)
  groups = []
  for (n, c, w), (table, made) in zip(setups, priced):
    tables.print_table(n, c, w, table, made, setting.break_even)
    if not faults.none:
      tables.print_faults(n, w, table, made, faults, args.on_failure)
    groups.append((f"{n} GPUs", {k: 1e3 * p.simulated_s
                                 for k, p in table.items()}, None))
  if args.png:
    tables.write_chart([(args.preset or "predicted", groups)], args.png)
  return 0


def _printed(args, n: int, c, w, made_methods, faults) -> str:
  """What the tables at ``n`` workers print for cluster ``c``, workload
  ``w`` and the methods built (for a flag's no-effect rule: a field that
  leaves this unchanged changes no printed number)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), np.errstate(all="ignore"):
    table, made = _price(args, made_methods, c, w)
    tables.print_table(n, c, w, table, made)
    if not faults.none:
      tables.print_faults(n, w, table, made, faults, args.on_failure)
  return out.getvalue()


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
      mode, period = tables.fault_mode(made[key])
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
  for flag in sorted(inputs.explicit_flags(args) - {"--n-workers", "--steps",
                                             "--seed"}):
    v = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    if isinstance(v, list):
      out.append(f"{flag} {','.join(f'{x:g}' for x in v)}")
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      out.append(f"{flag} {v:g}")
  return ", ".join(out) or "the cluster and workload flags' defaults"


def default_methods(c) -> list[str]:
  """``predict``'s methods without ``--methods``:
  :data:`~decentral_jax.tools.runtime_model_cli.parser.DEFAULT_METHODS`,
  and on a cluster of several datacenters
  :data:`~decentral_jax.tools.runtime_model_cli.parser.WAN_DEFAULT_METHODS`.
  """
  out = inputs.split_methods(parser_lib.DEFAULT_METHODS)
  if c.datacenters > 1:
    out += inputs.split_methods(parser_lib.WAN_DEFAULT_METHODS)
  return out


def methods_line(methods, chosen: bool, c, added: bool = False) -> str:
  """One line: the methods ``predict`` compares and why those (``added``:
  ``all_reduce`` was not in ``--methods``, added as the baseline)."""
  names = ",".join(methods)  # as --methods takes them
  if chosen and added:
    return (f"methods: {names} (--methods, with all_reduce added: the "
            "baseline every speedup refers to)")
  if chosen:
    return f"methods: {names} (as given by --methods)"
  if c.datacenters > 1:
    return (f"methods: {names} (the default across datacenters: All-Reduce, "
            "gossip and the local-update methods; choose with --methods)")
  return (f"methods: {names} (the default within one datacenter; add "
          "local-update methods with e.g. --methods "
          f"{parser_lib.DEFAULT_METHODS},diloco:H=10)")


def _check_some_time(setups) -> None:
  """Refuses one worker with no compute (forward, backward and optimizer
  times all 0): with nothing sent either, every method takes 0 ms per
  iteration and no speed-up is defined. Zero compute with 2 or more workers
  prices the communication alone and is kept."""
  for n, _, w in setups:
    if n == 1 and w.compute_mean_s == 0 and w.optimizer_s == 0:
      raise ValueError(
          "--n-workers 1 with no compute (--forward-ms, --backward-ms and "
          "--optimizer-ms all 0): one worker sends nothing, so every method "
          "takes 0 ms per iteration and none is faster than another; give a "
          "compute time > 0 or --n-workers >= 2.")


def _check_distinct_files(args) -> None:
  """``--png`` names none of the files ``predict`` reads (``--cluster``,
  ``--workload-file``, a ``--gossip-in-flight`` file): the chart is
  written after the tables and would replace that input."""
  in_flight = args.gossip_in_flight
  distinct_paths.check_distinct_paths(
      [("--png", args.png)],
      [("--cluster", args.cluster), ("--workload-file", args.workload_file),
       ("--gossip-in-flight",
        in_flight if in_flight and os.path.isfile(in_flight) else None)])


def _check_figure6(args) -> None:
  """``--workload figure6`` exists only with a Figure 6 preset;
  ``--workload-file`` replaces ``--workload``."""
  if args.workload_file and args.workload:
    raise ValueError(f"--workload {args.workload} and --workload-file "
                     f"{args.workload_file}: give one of them.")
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


def workload_line(args, setups, measured: dict | None, methods=()) -> str:
  """One line: the workload ``predict`` prices, its source, how to change it.

  Args:
    args: the parsed flags.
    setups: ``[(n, Cluster, Workload)]`` per worker count.
    measured: the ``--cluster`` file's contents, or None.
  """
  w = setups[0][2]
  flags = {flag for flag, *_ in parser_lib.WORKLOAD_FLAGS} | {"--worker-layout"}
  given = sorted(inputs.explicit_flags(args) & flags)
  if args.workload_file:
    source = (f"--workload-file {args.workload_file}, read from a compiled "
              "train step")
  elif args.preset in presets.FIGURE6_PRESETS and args.workload in (
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
          f"{w.param_dtype} parameters on the wire"
          f"{wire_dtype.theta_note(methods, w)}), compute {compute} per "
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
                           default=inputs.workload_from_args(args))
    except ValueError as e:
      raise ValueError(f"--n-workers {n} with --preset {args.preset}: {e}"
                       ) from None
    if args.workload_file:
      w = workload_file.read_workload(args.workload_file)
    return inputs.given_fields(args, c, w)
  if measured is not None:
    c, w = file_cluster.from_cluster_file(measured, args, n)
  else:
    c, w = inputs.cluster_from_args(args, n), inputs.workload_from_args(args)
  if args.workload:
    c, w = inputs.given_fields(args, c, presets.workload(args.workload))
  if args.workload_file:
    c, w = inputs.given_fields(args, c, workload_file.read_workload(
        args.workload_file))
  return c, w


def _base_flow(args, n: int, measured: dict | None):
  """The flow cap (bytes/s) of ``--preset`` or the ``--cluster`` file at
  ``n`` workers, which ``--flow-Gbps`` replaces (None: none)."""
  if args.preset:
    return presets.setup(args.preset, n, args.workload, default=(
        inputs.workload_from_args(args)))[0].flow_bandwidth_Bps
  if measured is not None:
    return measured["cluster"].get("flow_bandwidth_Bps")
  return None


def full_form(m, w=None) -> tuple:
  """What a built method is, its spelling aside: the optimizer family
  (a bare topology name is DAdam's gossip over it; AccumAdam with its
  ``T``), the topology (name, workers, workers per node) and every other
  :class:`~decentral_jax.runtime_model.method.Method` field, defaults
  filled in (with the workload ``w``, also those that stand for its
  values: :func:`~decentral_jax.runtime_model.method_messages.filled_in`).
  ``ring`` and ``dadam:topology=ring``, ``AR`` and ``all_reduce``,
  ``diloco:H=10`` and ``diloco:H=10,overlap=none`` (and with ``w``
  ``diloco:H=10,comm_dtype=float32``, ``all_reduce:bucket_MiB=25`` and
  ``all_reduce`` at 25 MiB buckets) have one full form."""
  if w is not None:
    m = method_messages.filled_in(m, w)
  head, _, rest = m.name.partition(":")
  if m.kind == "gossip" and head not in ("accum_adam", "sgp",
                                         "gradient_tracking"):
    head = "dadam"
  if head == "accum_adam":
    head += ":" + rest.split(",")[0]  # T=k, spelled first
  topo = m.topology and (m.topology.name, m.topology.n_workers,
                         m.topology.local_size)
  fields = tuple((f.name, getattr(m, f.name)) for f in dataclasses.fields(m)
                 if f.name not in ("name", "topology"))
  return head, topo, fields


def _build_methods(args, methods: list, setups) -> tuple[list, bool]:
  """The specs built at every worker count (:func:`_make_methods`), with
  ``all_reduce`` put first (the baseline every speedup refers to) unless
  a spec is it (then spelled ``all_reduce``, e.g. ``AR``); returns
  ``(built, added)``.

  Raises:
    ValueError: a bad spec, or two specs of one :func:`full_form` at every
      worker count (one row twice), naming both.
  """
  built = [_make_methods(args, methods, n, c, w) for n, c, w in setups]
  forms = [tuple(full_form(b[k][1], w) for b, (_, _, w) in zip(built, setups))
           for k in range(len(methods))]
  seen = {}
  for k, form in enumerate(forms):
    if form in seen:
      j = seen[form]
      raise ValueError(
          f"--methods: entry {k + 1} ({methods[k]}) is entry {j + 1} "
          f"({methods[j]}) again (the same method, spelled otherwise); give "
          "each method once.")
    seen[form] = k
  baseline = tuple(full_form(make_method("all_reduce", c), w)
                   for _, c, w in setups)
  added = baseline not in seen
  k = 0 if added else seen[baseline]
  if added:
    methods.insert(0, "all_reduce")
  methods[k] = "all_reduce"  # the tables find the baseline by this key
  ar = [_make_methods(args, ["all_reduce"], n, c, w) for n, c, w in setups]
  built = [a + b if added else b[:k] + a + b[k + 1:]
           for a, b in zip(ar, built)]
  return built, added


def _make_methods(args, methods, n: int, c, w) -> list:
  """``[(spec, Method, simulated steps)]`` of every spec at ``n`` workers
  (on the workload ``w``).

  Raises:
    ValueError: a spec the cluster cannot run, naming it and ``n``, or
      whose ``bucket_MiB`` cuts ``w``'s message into more than
      ``MAX_BUCKETS`` buckets.
  """
  out = []
  for spec in methods:
    try:
      m = make_method(spec, c)
      _check_spec_buckets(m, w)
      out.append((spec, m, inputs.simulated_steps(m, args.steps)))
    except ValueError as e:
      raise ValueError(f"--methods {spec} at --n-workers {n}: {e}") from None
  return out


def _check_spec_buckets(m, w) -> None:
  """A spec's ``bucket_MiB`` cuts the message (the wider of the gradient
  and parameter dtypes, as ``--bucket-MiB``) into at most
  ``MAX_BUCKETS`` buckets."""
  if m.bucket_bytes is None:
    return
  itemsize = max(np.dtype(w.grad_dtype).itemsize,
                 np.dtype(w.param_dtype).itemsize)
  count = workload_lib.bucket_count(w.param_count, itemsize, m.bucket_bytes)
  if count > inputs.MAX_BUCKETS:
    raise ValueError(
        f"bucket_MiB={m.bucket_bytes / 2**20:g} cuts {w.param_count:g} "
        f"{itemsize}-byte values into {count} buckets, more than the "
        f"{inputs.MAX_BUCKETS} the model handles; raise bucket_MiB.")


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


def _faults_from_args(args) -> stragglers.Faults:
  """``--slow-fraction``, ``--slow-speed``, ``--failure-rate``,
  ``--mean-downtime`` as :class:`stragglers.Faults` (errors name the flag)."""
  try:
    return stragglers.Faults(
        slow_fraction=args.slow_fraction, slow_speed=args.slow_speed,
        failure_rate=args.failure_rate, mean_downtime=args.mean_downtime)
  except ValueError as e:
    raise ValueError("--" + str(e).replace("_", "-", 1)) from None
