"""Flags of ``predict`` and their conversion: checks, units.

Used by the command line's flag tables
(:mod:`~decentral_jax.tools.runtime_model_cli.parser`) and its subcommands
(:mod:`~decentral_jax.tools.runtime_model_cli.predict`, ...). Units are in the flag names: GB/s and Gbit/s
(1e9), us, ms, MiB. A cluster file priced with flags beside it:
:mod:`~decentral_jax.tools.runtime_model_cli.file_cluster`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from decentral_jax.runtime_model import in_flight
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model import workload as workload_lib
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model import local_sync
from decentral_jax.tools import flag_types

# Largest inputs `predict` accepts. Its cost grows with n^2 (mixing
# matrices; the model's own bound, costs.MAX_WORKERS) and with n x
# simulated steps x buckets (simulated_work.MAX_SIMULATED).
MAX_WORKERS = costs.MAX_WORKERS

# The runtime model's bounds on a workload (the same for flags and files).
MAX_BUCKETS = workload_lib.MAX_BUCKETS


MAX_STEPS = workload_lib.MAX_SIMULATED_STEPS
# Fewest simulated steps of `predict --steps`: the first fifth (4) is
# warm-up and the mean covers 16 more, past the pipeline's fill (at 2 the
# mean is the first step's compute alone and can flip the recommendation).
MIN_STEPS = 20


# `measure`'s message sizes (--sizes-MB, each at least one float32) and
# repetitions (--repeats), and `calibrate`'s rounds (--steps): every device
# of a host holds a message and its copy, and each repetition times every
# measurement once (on 2 cores 1000 repetitions of a 16 MB exchange take
# about a minute).
MIN_MESSAGE_MB = 4e-6
MAX_MESSAGE_MB = 65536.0
MAX_REPEATS = 1000

# Largest --seed: NumPy's seeds are 32-bit.
MAX_SEED = 2**32 - 1


# Largest --n-workers of `utilisation`: its table bisects the closed form
# 1,500 times, whose cost grows faster than n^2 (on 2 cores: 4 s at 64
# workers, about 110 s at 512).
MAX_UTILISATION_WORKERS = 256


# Physical bounds of the numeric flags, in the flags' units: times at most
# 1e6 ms (about 17 minutes; 1e9 us), bandwidths in [1e-3, 1e6] Gbit/s or
# GB/s, buckets at most 1e9 MiB (--params: MAX_PARAMS). Beyond them the
# model's arithmetic overflows (a table of nan or of 300-digit times) or
# prices no real cluster. Each is (low, low excluded, high or None).
_MAX_MS = 1e6
_RATE = (1e-3, False, 1e6)
FLAG_BOUNDS = {
    "--local-size": (1, False, MAX_WORKERS), "--intra-GBps": _RATE,
    "--intra-latency-us": (0, False, 1e3 * _MAX_MS), "--nic-Gbps": _RATE,
    "--flow-Gbps": (0, False, 1e6),
    "--inter-latency-us": (0, False, 1e3 * _MAX_MS),
    "--nics-per-node": (1, False, MAX_WORKERS),
    "--nic-efficiency": (0.01, False, 1),
    "--forward-ms": (0, False, _MAX_MS),
    "--backward-ms": (0, False, _MAX_MS),
    "--optimizer-ms": (0, False, _MAX_MS), "--compute-cv": (0, False, 10),
    "--bucket-MiB": (workload_lib.MIN_BUCKET_MIB, False,
                     workload_lib.MAX_BUCKET_MIB),
    "--devices-per-worker": (1, False, MAX_WORKERS),
    "--seed": (0, False, MAX_SEED),
    "--datacenters": (1, False, MAX_WORKERS), "--wan-Gbps": _RATE,
    "--wan-latency-ms": (0, False, _MAX_MS), "--codec-GBps": _RATE,
    "--slow-speed": (1e-3, False, 1), "--mean-downtime": (1, False, 1e6),
}


# The same for `utilisation` (its --n-workers, --params and --grad-dtype are
# checked apart); --step-ms > 0: with no compute there is no utilisation.
UTILISATION_FLAG_BOUNDS = {
    "--step-ms": (0, True, _MAX_MS),
    "--H": (1, False, MAX_STEPS), "--latency-ms": (0, False, _MAX_MS),
    "--codec-GBps": _RATE,
    "--bucket-MiB": (workload_lib.MIN_BUCKET_MIB, False,
                     workload_lib.MAX_BUCKET_MIB),
}


#: One sample of ``--compute-samples-ms``: a forward + backward time in
#: (0, 1e6] ms (the samples are divided by their mean: a zero one is no step
#: time). At least :data:`MIN_COMPUTE_SAMPLES` of them give the spread.
COMPUTE_SAMPLE_MS = flag_types.real(0, _MAX_MS, " (ms)", open_lo=True)
COMPUTE_SAMPLES_MS = flag_types.number_list(COMPUTE_SAMPLE_MS)
MIN_COMPUTE_SAMPLES = 2


# Largest --params (1e15: 4 PB of float32 parameters); checked after the
# buckets, whose bound is the stricter one for small --bucket-MiB.
MAX_PARAMS = workload_lib.MAX_PARAMS


def flag_range(flag: str, command: str = "predict") -> str | None:
  """The range of a numeric flag as its help states it, e.g. ``"0.001 to
  1e+06"`` or ``">= 1"``; None for a flag without bounds here."""
  table = UTILISATION_FLAG_BOUNDS if command == "utilisation" else FLAG_BOUNDS
  g = lambda x: str(x) if isinstance(x, int) else f"{x:g}"
  if flag == "--compute-samples-ms" and command == "predict":
    low, high, strict = COMPUTE_SAMPLE_MS.bounds
    return (f"at least {MIN_COMPUTE_SAMPLES}, each "
            f"{'above ' if strict else ''}{g(low)} to {g(high)}")
  if flag not in table:
    return None
  low, strict, high = table[flag]
  if flag == "--flow-Gbps":
    return f"0 or {_RATE[0]:g} to {high:g}"
  if high is None:
    return f"{'>' if strict else '>='} {g(low)}"
  return f"{'above ' if strict else ''}{g(low)} to {g(high)}"


def _check_bounds(args, table: dict) -> None:
  """Raises ValueError naming the first flag of ``table`` out of its range.

  The message names the flag and the value as given, in the flag's units.
  """
  for flag, (low, strict, high) in table.items():
    v = _value(args, flag)
    integer = isinstance(v, int)
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and
          (integer or math.isfinite(v)) and (v > low if strict else v >= low)
          and (high is None or v <= high))
    if not ok:
      kind = "an integer" if integer else "a finite number"
      g = lambda x: str(x) if isinstance(x, int) else f"{x:g}"
      if high is None:
        rule = f"{'>' if strict else '>='} {g(low)}"
      else:
        rule = f"in {'(' if strict else '['}{g(low)}, {g(high)}]"
      raise ValueError(f"{flag} must be {kind} {rule}, got {v!r}.")


def _value(args, flag: str):
  return getattr(args, flag.lstrip("-").replace("-", "_"))


def check_output_path(path: str | None, flag: str) -> None:
  """Raises ValueError naming ``flag`` unless ``path`` can be written
  (:func:`decentral_jax.tools.flag_types.check_output_file`).

  Checked before the work that produces the file, so a typo in the path
  does not cost the run. None: the flag was not given; an empty path is
  refused (it would write nothing).
  """
  flag_types.check_output_file(path, flag)
  if path is not None and flag == "--png":
    flag_types.check_image_name(path, flag)


def check_input_paths(args) -> None:
  """Refuses an empty ``--cluster`` or ``--workload-file`` of ``predict``
  (an empty path is no file, not the flag left out: the default cluster or
  workload would be priced in its place).

  Raises:
    ValueError: one line naming the flag.
  """
  for flag in ("--cluster", "--workload-file"):
    if _value(args, flag) == "":
      raise ValueError(f"{flag} is empty; give a JSON file's path or drop "
                       f"{flag}.")


def check_predict_args(args) -> None:
  """Validates the flags of ``predict``.

  Every number is finite and within its bounds (``FLAG_BOUNDS``, in the
  flag's units; ``--flow-Gbps`` is 0 or a rate); ``--gossip-in-flight``
  is one or two fractions in [0, 1] or a JSON file; worker counts
  are in ``[1, MAX_WORKERS]`` and (without ``--preset``) multiples of
  ``--local-size``; dtypes are numpy names; compute samples
  (:func:`check_compute_samples`) are >= 2 times in (0, 1e6] ms; the
  parameter message fits in ``MAX_BUCKETS``
  buckets; ``--steps`` is in ``[MIN_STEPS, MAX_STEPS]``; ``--png`` is writable.

  Raises:
    ValueError: the first bad flag, named, with its value and range.
  """
  _check_bounds(args, FLAG_BOUNDS)
  if 0 < args.flow_Gbps < _RATE[0]:
    raise ValueError(f"--flow-Gbps must be 0 (no cap) or in [{_RATE[0]:g}, "
                     f"{FLAG_BOUNDS['--flow-Gbps'][2]:g}], got "
                     f"{args.flow_Gbps!r}.")
  check_in_flight_flag(args.gossip_in_flight)
  if not args.n_workers:
    raise ValueError("--n-workers is empty; give e.g. --n-workers 16,32.")
  for n in args.n_workers:
    if not 1 <= n <= MAX_WORKERS:
      raise ValueError(f"--n-workers {n} is outside [1, {MAX_WORKERS}] (the "
                       "model's time and memory grow with n^2).")
    if not args.preset and not args.cluster and n % (
        args.local_size * args.datacenters):
      raise ValueError(not_a_multiple(
          n, args.local_size, args.datacenters,
          f"--local-size {args.local_size}" + (
              f" x --datacenters {args.datacenters} (workers per "
              "datacenter)" if n % args.local_size == 0 else
              " (workers per node)")))
  if not MIN_STEPS <= args.steps <= MAX_STEPS:
    raise ValueError(
        f"--steps must be in [{MIN_STEPS}, {MAX_STEPS}], got {args.steps}: "
        "the first fifth is warm-up and the mean needs steady steps after "
        f"it; give --steps {MIN_STEPS} or more (default 300).")
  itemsize = 0
  check_param_count(args.params)
  for flag in ("--grad-dtype", "--param-dtype"):
    itemsize = max(itemsize, float_dtype_flag(flag, _value(args, flag)).itemsize)
  check_compute_samples(args.compute_samples_ms)
  _check_bucket_count(args, itemsize, "the simulator")
  check_output_path(args.png, "--png")


def check_compute_samples(samples) -> None:
  """Refuses ``--compute-samples-ms`` (ms; None: not given) with fewer
  than :data:`MIN_COMPUTE_SAMPLES` samples, or an entry outside
  :data:`COMPUTE_SAMPLE_MS` (named by its position: the flag's own type,
  for values not read by the parser).

  Raises:
    ValueError: one line naming the flag and the count or the entry.
  """
  if samples is None:
    return
  text = ",".join(repr(float(x)) for x in samples)
  try:
    COMPUTE_SAMPLES_MS(text)
  except argparse.ArgumentTypeError as e:
    raise ValueError(f"--compute-samples-ms: {e}.") from None
  if len(samples) < MIN_COMPUTE_SAMPLES:
    raise ValueError(
        f"--compute-samples-ms needs at least {MIN_COMPUTE_SAMPLES} samples "
        f"(their spread is the compute's), got {len(samples)} ({text}); give "
        "another, e.g. --compute-samples-ms 90,110, or use --compute-cv.")


def _check_bucket_count(args, itemsize: float, handler: str) -> None:
  """``--params`` in ``--bucket-MiB`` buckets of ``itemsize``-byte values:
  at most ``MAX_BUCKETS`` (what ``handler`` handles); its bounds first
  (a count near the float maximum overflows the bucket arithmetic)."""
  _check_bounds(args, {"--params": (1, False, MAX_PARAMS)})
  buckets = workload_lib.bucket_count(args.params, itemsize,
                                     args.bucket_MiB * 2**20)
  if buckets > MAX_BUCKETS:
    raise ValueError(
        f"--params {args.params:g} in --bucket-MiB {args.bucket_MiB:g} makes "
        f"{buckets} buckets, more than the {MAX_BUCKETS} {handler} "
        "handles; raise --bucket-MiB or lower --params.")


def check_param_count(params) -> None:
  """Raises ValueError unless ``--params`` is a whole count >= 1 (1.3e9 is one)."""
  if isinstance(params, bool) or not isinstance(params, (int, float)) or \
      not math.isfinite(params) or params < 1 or params != math.floor(params):
    raise ValueError(f"--params must be a whole parameter count >= 1 (e.g. "
                     f"1.3e9), got {params!r}.")


def float_dtype_flag(flag: str, name) -> np.dtype:
  """``np.dtype(name)`` if it names a floating dtype (bfloat16 included)."""
  return workload_lib.wire_dtype(flag, name)


def check_in_flight_flag(text: str | None) -> None:
  """Raises ValueError naming ``--gossip-in-flight`` and the value as typed
  unless it is None, a JSON file :func:`in_flight.read_in_flight`
  reads, or one or two comma-separated fractions in [0, 1]."""
  if text is None:
    return
  try:
    in_flight.read_in_flight(text)
    return
  except ValueError as e:
    problem = str(e)
  if problem.startswith("--gossip-in-flight") and (
      "gossip_in_flight" not in problem):
    raise ValueError(problem)
  raise ValueError(f"--gossip-in-flight {text!r}: give a fraction in [0, 1] "
                   "(the share of forward and backward that hides the "
                   "gossip), FORWARD,BACKWARD fractions or a JSON file with "
                   "in_flight_fractions in [0, 1].")


def check_utilisation_args(args) -> None:
  """Validates the flags of ``utilisation`` that bound its time and memory.

  ``--n-workers`` in ``[2, MAX_UTILISATION_WORKERS]`` (one worker sends
  nothing: every method is at 100% at any rate, and the table's ratio to
  the paper's data-parallel rate means nothing), ``--params`` a whole
  count, the other numbers within ``UTILISATION_FLAG_BOUNDS`` (in the
  flags' units), ``--grad-dtype`` floating, the gradients in at most
  ``MAX_BUCKETS`` buckets of ``--bucket-MiB``.

  Raises:
    ValueError: the first bad flag, named, with its value and range.
  """
  n = args.n_workers
  if isinstance(n, bool) or not isinstance(n, int) or n < 2:
    raise ValueError(f"--n-workers must be >= 2, got {n!r}: one worker "
                     "sends nothing, so every method has 100% utilisation "
                     "at any rate and the Gbit/s table is meaningless.")
  if n > MAX_UTILISATION_WORKERS:
    raise ValueError(f"--n-workers {n} is above {MAX_UTILISATION_WORKERS} "
                     "(the table's time grows faster than n^2: about 2 "
                     "minutes at 512 workers).")
  check_param_count(args.params)
  _check_bounds(args, UTILISATION_FLAG_BOUNDS)
  itemsize = max(float_dtype_flag("--grad-dtype", args.grad_dtype).itemsize,
                 np.dtype(Workload.param_dtype).itemsize)  # its parameters'
  _check_bucket_count(args, itemsize, "the model")


def comma_list(typ, unique: bool = False):
  """An argparse ``type``: a comma-separated list of ``typ`` values.

  Raises:
    argparse.ArgumentTypeError: an empty part (``"16,,"``: a stray comma),
      a part ``typ`` cannot convert, or with ``unique`` a value given twice
      (``"16,16"``; :func:`~decentral_jax.tools.flag_types.repeated_entry`).
  """
  def parse(text: str) -> list:
    parts = flag_types.comma_parts(text, "16,32")
    try:
      out = [typ(t) for t in parts]
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"expected comma-separated {typ.__name__} values, got {text!r}"
      ) from None
    why = flag_types.repeated_entry(text, out, "16,32") if unique else None
    if why:
      raise argparse.ArgumentTypeError(why)
    return out
  return parse


def split_methods(text: str) -> list[str]:
  """``--methods`` as a list of specs.

  Split at commas; a part of the form ``KEY=VALUE`` (an ``=`` and no
  ``:``) continues the spec before it, so
  ``"all_reduce,streaming_diloco:H=10,P=4,tau=1"`` gives ``["all_reduce",
  "streaming_diloco:H=10,P=4,tau=1"]``.

  Raises:
    ValueError: an empty part (a stray comma), a ``KEY=VALUE`` part with
      no spec before it, or a spec given twice. An empty ``text`` gives
      ``[]``.
  """
  out = []
  parts = [t.strip() for t in text.split(",")]
  if parts == [""]:
    return out
  for k, part in enumerate(parts):
    if not part:
      raise ValueError(f"--methods {text!r}: entry {k + 1} is empty; "
                       "separate the specs by single commas, e.g. "
                       "all_reduce,diloco:H=10,topology=ring.")
    if "=" in part and ":" not in part:
      if not out or ":" not in out[-1]:
        raise ValueError(f"--methods: {part!r} has no method before it; "
                         "write NAME:KEY=VALUE,KEY=VALUE, e.g. "
                         "streaming_diloco:H=10,P=4,tau=1.")
      out[-1] += "," + part
    else:
      out.append(part)
  why = flag_types.repeated_entry(text, [_spelling(o) for o in out],
                                  "all_reduce,aer")
  if why:
    raise ValueError(f"--methods {why}.")
  return out


def _spelling(spec: str) -> str:
  """A method spec as the runtime model reads it: case, ``-`` for ``_``
  and the order of its ``KEY=VALUE`` options aside (``AER`` is ``aer``,
  ``diloco:P=2,H=8`` is ``diloco:h=8,p=2``)."""
  name, _, options = spec.lower().replace("-", "_").partition(":")
  return name + (":" + ",".join(sorted(options.split(","))) if options
                 else "")


def simulated_steps(m: Method, steps: int) -> int:
  """Steps to simulate ``m`` for: ``steps``, or more for two whole periods.

  Raises:
    ValueError: the needed steps exceed ``MAX_STEPS`` (names the method).
  """
  if m.kind != "local":
    return steps
  period = local_sync.schedule_period(m)
  start = -(-(steps // 5) // period) * period
  need = max(steps, start + 2 * period)
  if need > MAX_STEPS:
    raise ValueError(f"--methods {m.name}: its schedule repeats every "
                     f"{period} steps and needs {need} simulated steps, more "
                     f"than {MAX_STEPS}; lower H.")
  return need


def cluster_fields(args) -> dict:
  """:class:`Cluster` keyword arguments (but ``n_workers``) of the cluster flags.

  Units: ``--intra-GBps`` and ``--codec-GBps`` GB/s (1e9 bytes/s),
  ``--nic-Gbps`` (per NIC port), ``--flow-Gbps`` and ``--wan-Gbps`` Gbit/s
  (1e9 bits/s, divided by 8), latencies in us (``--wan-latency-ms`` in
  ms), ``--nic-efficiency`` a fraction, ``--nics-per-node`` and
  ``--datacenters`` counts.
  """
  return dict(
      local_size=args.local_size,
      intra_latency_s=args.intra_latency_us * 1e-6,
      intra_bandwidth_Bps=args.intra_GBps * 1e9,
      inter_latency_s=args.inter_latency_us * 1e-6,
      nic_bandwidth_Bps=args.nic_Gbps * 1e9 / 8,
      flow_bandwidth_Bps=args.flow_Gbps * 1e9 / 8 if args.flow_Gbps
      else None, multi_node=args.multi_node, intra_link=args.intra_link,
      nics_per_node=args.nics_per_node, nic_efficiency=args.nic_efficiency,
      full_duplex=not args.half_duplex, datacenters=args.datacenters,
      wan_latency_s=args.wan_latency_ms * 1e-3,
      wan_bandwidth_Bps=args.wan_Gbps * 1e9 / 8,
      codec_Bps=args.codec_GBps * 1e9)


def cluster_from_args(args, n: int) -> Cluster:
  """The :class:`Cluster` of ``predict``'s cluster flags for ``n`` workers.

  Units as :func:`cluster_fields`.
  """
  return Cluster(n_workers=n, **cluster_fields(args))


def workload_fields(args) -> dict:
  """:class:`Workload` keyword arguments of the workload flags (ms -> s, MiB -> bytes)."""
  samples = (tuple(x * 1e-3 for x in args.compute_samples_ms)
             if args.compute_samples_ms else None)
  return dict(
      param_count=args.params, forward_s=args.forward_ms * 1e-3,
      backward_s=args.backward_ms * 1e-3,
      optimizer_s=args.optimizer_ms * 1e-3, compute_cv=args.compute_cv,
      compute_samples_s=samples, grad_dtype=args.grad_dtype,
      param_dtype=args.param_dtype, bucket_bytes=args.bucket_MiB * 2**20,
      devices_per_worker=args.devices_per_worker,
      worker_layout=args.worker_layout,
      gossip_in_flight=(in_flight.read_in_flight(
          args.gossip_in_flight) if args.gossip_in_flight else None))


def workload_from_args(args) -> Workload:
  """The :class:`Workload` of ``predict``'s workload flags (ms -> s, MiB -> bytes)."""
  return Workload(**workload_fields(args))


def given_fields(args, c: Cluster, w: Workload):
  """``(c, w)`` with the cluster and workload flags given on the command line applied.

  Used for ``--preset`` and ``--workload``: their fields, with each flag
  given explicitly taking precedence (converted as :func:`cluster_fields`
  and :func:`workload_fields`); flags for the compute mean or CV drop
  compute samples.

  Raises:
    ValueError: the combination is refused by ``Cluster`` or ``Workload``.
  """
  given = explicit_flags(args)
  flags_c, flags_w = cluster_fields(args), workload_fields(args)
  over_c = {f: flags_c[f] for flag, f in CLUSTER_FIELDS.items()
            if flag in given}
  over_w = {f: flags_w[f] for flag, f in WORKLOAD_FIELDS.items()
            if flag in given}
  if given & {"--forward-ms", "--backward-ms", "--compute-cv"} and \
      "--compute-samples-ms" not in given:
    over_w["compute_samples_s"] = None
  if "--datacenters" in given and c.wan_bandwidth_Bps is None:
    over_c.setdefault("wan_bandwidth_Bps", flags_c["wan_bandwidth_Bps"])
    over_c.setdefault("wan_latency_s", flags_c["wan_latency_s"])
  if over_c:
    c = dataclasses.replace(c, **over_c)
  if over_w:
    w = dataclasses.replace(w, **over_w)
  return c, w


# predict flag -> (Cluster or Workload field, value from the parsed flags).
CLUSTER_FIELDS = {
    "--local-size": "local_size", "--intra-GBps": "intra_bandwidth_Bps",
    "--intra-latency-us": "intra_latency_s",
    "--nic-Gbps": "nic_bandwidth_Bps", "--nics-per-node": "nics_per_node",
    "--nic-efficiency": "nic_efficiency", "--flow-Gbps": "flow_bandwidth_Bps",
    "--inter-latency-us": "inter_latency_s", "--multi-node": "multi_node",
    "--intra-link": "intra_link", "--half-duplex": "full_duplex",
    "--datacenters": "datacenters", "--wan-Gbps": "wan_bandwidth_Bps",
    "--wan-latency-ms": "wan_latency_s", "--codec-GBps": "codec_Bps"}


WORKLOAD_FIELDS = {
    "--params": "param_count", "--grad-dtype": "grad_dtype",
    "--param-dtype": "param_dtype", "--forward-ms": "forward_s",
    "--backward-ms": "backward_s", "--optimizer-ms": "optimizer_s",
    "--compute-cv": "compute_cv", "--compute-samples-ms": "compute_samples_s",
    "--bucket-MiB": "bucket_bytes", "--devices-per-worker": "devices_per_worker",
    "--worker-layout": "worker_layout",
    "--gossip-in-flight": "gossip_in_flight"}


def explicit_flags(args) -> set:
  """The flags given on the command line, e.g. ``{"--n-workers"}``.

  :func:`decentral_jax.tools.runtime_model_cli.main.main` records them in
  ``args.explicit_flags``; empty when ``args`` was built otherwise.
  """
  return getattr(args, "explicit_flags", set())


def not_a_multiple(n: int, local_size: int, datacenters: int,
                   what: str) -> str:
  """The refusal of ``--n-workers n`` that ``local_size`` x
  ``datacenters`` workers (``what``, as the user gave them) do not divide,
  naming both fixes: the next multiple of ``--n-workers``, or the largest
  ``--local-size`` below ``local_size`` that fits ``n`` (when one
  does)."""
  per = local_size * datacenters
  fix = f"give --n-workers a multiple of {per} (e.g. {-(-n // per) * per})"
  if n % datacenters == 0:
    fits = max(d for d in range(1, local_size + 1)
               if (n // datacenters) % d == 0)
    fix += f" or --local-size {fits}"
  return f"--n-workers {n} is not a multiple of {what}; {fix}."
