"""The runtime model's argument parser, built from flag tables.

Every subcommand is one row of :data:`SUBCOMMANDS`: its name, its help line
and its flags in sections (``None`` for the subcommand's own options, else
an argument group's title), each flag a ``(flag, argparse keywords)`` pair.
The numeric cluster and workload flags of ``predict`` and the flags of
``utilisation`` are ``(flag, type, default, help)`` rows whose help gets the
default and the accepted range (:func:`~decentral_jax.tools.
runtime_model_cli.inputs.flag_range`) appended. Units are in the flag names
(``--intra-GBps``, ``--forward-ms``, ...). No JAX.
"""

from __future__ import annotations

import argparse

from decentral_jax import layout_modes
from decentral_jax.runtime_model import costs
from decentral_jax.runtime_model import presets
from decentral_jax.runtime_model import stragglers
from decentral_jax.tools import flag_types
from decentral_jax.tools.runtime_model_cli import inputs

#: The prog of ``python -m decentral_jax.runtime_model``.
PROG = "python -m decentral_jax.runtime_model"
DEFAULT_METHODS = "all_reduce,one_peer_exp,aer"
# Added to DEFAULT_METHODS on a cluster of several datacenters, where a sync
# every H steps over the wide-area link is the usual choice (the local-update
# arms of the main job, H = 10).
WAN_DEFAULT_METHODS = "local_sgd:H=10,diloco:H=10,streaming_diloco:H=10,P=2"

#: The top-level --help epilog: what each subcommand is for, by example.
EXAMPLES = """Command line: ``python -m decentral_jax.runtime_model {predict,fig6,validate,utilisation,measure,calibrate}``.

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
      --methods all_reduce,aer,diloco:H=10,streaming_diloco:H=10,P=4
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


_Parser = flag_types.Parser  # errors as one ``error:`` line, exit code 2


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
#: ``predict``'s workload flags, ``(flag, type, default, help)``.
WORKLOAD_FLAGS = (
    ("--params", float, 65e6, "parameter count, whole, at most "
     f"{inputs.MAX_PARAMS:g} and in at most {inputs.MAX_BUCKETS} buckets of "
     "--bucket-MiB"),
    ("--grad-dtype", str, "float32", "dtype of All-Reduced gradients"),
    ("--param-dtype", str, "float32", "dtype of gossiped parameters"),
    ("--forward-ms", float, 30.0, "mean forward time per iteration, ms"),
    ("--backward-ms", float, 60.0, "mean backward time per iteration, ms"),
    ("--optimizer-ms", float, 0.0, "optimizer step time, ms"),
    ("--compute-cv", float, 0.0, "coefficient of variation of fwd+bwd"),
    ("--compute-samples-ms", inputs.COMPUTE_SAMPLES_MS, None,
     "comma-separated samples of fwd+bwd, ms (replace the mean and CV)"),
    ("--bucket-MiB", float, 25.0, "bucket size, MiB"),
    ("--devices-per-worker", int, 1, "devices of one worker "
     "(config.devices_per_worker; compute times are the worker's)"),
    ("--gossip-in-flight", str, None, "share of the step's compute that "
     "hides the gossip in the compiled program: a fraction, FORWARD,"
     "BACKWARD fractions, or a JSON file with in_flight_fractions "
     "(benchmarks/gpu_check.py --deviceless --json); default: the whole "
     "next forward and backward"),
)
_UTILISATION_FLAGS = (
    ("--n-workers", int, 2, "workers, each its own node with one link"),
    ("--params", float, 1e9, f"parameter count, at most "
     f"{inputs.MAX_PARAMS:g} and in at most {inputs.MAX_BUCKETS} buckets of "
     "--bucket-MiB"),
    ("--step-ms", float, 100.0, "compute per step, ms (forward : "
     "backward = 1 : 2)"),
    ("--H", int, 30, "DiLoCo's inner steps per outer step"),
    ("--latency-ms", float, 0.0, "latency per message, ms"),
    ("--codec-GBps", float, 100.0, "float32 GB/s one worker quantizes or "
     "dequantizes (fp4 line)"),
    ("--grad-dtype", str, "bfloat16", "data-parallel's gradients on the "
     "wire"),
    ("--bucket-MiB", float, 25.0, "bucket (message) size, MiB"),
)


def _ranged(rows, command: str = "predict", shown=str) -> list:
  """``(flag, type, default, help)`` rows as ``(flag, keywords)``, the help
  ending in the default (as ``shown`` writes it) and the flag's range."""
  out = []
  for flag, typ, default, text in rows:
    bounds = inputs.flag_range(flag, command)
    out.append((flag, dict(type=typ, default=default, help=(
        f"{text} (default {shown(default)}"
        + (f"; {bounds})" if bounds else ")")))))
  return out


def _g(x) -> str:
  return f"{x:g}" if isinstance(x, float) else str(x)


_PREDICT_OWN = (
    ("--n-workers", dict(
        type=inputs.comma_list(int, unique=True), default=[16],
        help="comma-separated worker counts n (default 16; with --preset the "
        "count it holds closest to 16 (at least 16 where it holds that "
        "many), e.g. 32 on cross_region_4dc, 8 on h100_node; with "
        "--cluster its worker count)")),
    ("--methods", dict(
        default=DEFAULT_METHODS,
        help="comma-separated: all_reduce, sgp, topology names (complete, "
        "ring, one_peer_exp, aer, ...) or local-update specs "
        "NAME:KEY=VALUE,... (local_sgd:H=10, diloco:H=10, "
        "diloco:H=10,topology=ring, streaming_diloco:H=10,P=4"
        ",comm_dtype=bfloat16, local_dsgd:H=4,topology=aer, "
        "desloc:Kx=10,Ku=30,Kv=60, noloco:H=10, "
        "gradient_tracking:topology=one_peer_exp, gossip specs "
        "dadam:topology=exponential,compress=int8,pipelined=1; a comma "
        "followed by KEY=VALUE continues the spec before it; H, tau in "
        "steps, defaults H=10, P=1, tau=0; see docs/runtime_model_methods.md); "
        f"default {DEFAULT_METHODS}, on a cluster of several datacenters "
        f"also {WAN_DEFAULT_METHODS}")),
    ("--preset", dict(
        choices=list(presets.CLUSTERS),
        help="a named cluster: Figure 6's T4, A40, A100 (with the paper's "
        "model and fitted compute), h100_node, h100_ib, cross_region_2dc, "
        "cross_region_4dc (sources in docs/runtime_model.md); cluster and "
        "workload flags given as well override single fields")),
    ("--workload", dict(
        choices=list(presets.WORKLOAD_NAMES),
        help="a named workload: gpt2_small (124M parameters, 30.9 ms per "
        "step), 1b (1e9 parameters, 100 ms per step) or figure6 (the "
        "paper's 65M-parameter Transformer base fitted to Figure 6; with "
        "--preset T4, A40 or A100, whose default it is); default: the "
        "workload flags (65M parameters, 90 ms per step); workload flags "
        "given as well override single fields")),
    ("--workload-file", dict(
        metavar="FILE",
        help="workload JSON read from a compiled train step (benchmarks/"
        "gpu_check.py --deviceless TARGET --workload FILE): parameters, "
        "forward/backward/optimizer time on the profile's clock, gossip "
        "in-flight fractions; workload flags given as well override single "
        "fields")),
    ("--cluster", dict(
        metavar="FILE",
        help="cluster JSON written by `measure` (its links and, if "
        "measured, compute; flags given as well override its fields; "
        "--n-workers defaults to its worker count)")),
)
_CLUSTER_CHOICES = (
    ("--multi-node", dict(
        choices=costs.MULTI_NODE_ALGORITHMS, default="tree",
        help="algorithm of group means over several nodes (default tree)")),
    ("--intra-link", dict(
        choices=costs.INTRA_LINKS, default="pcie",
        help="pcie: a GPU's intra-node and NIC traffic share its PCIe link; "
        "nvlink: separate (default pcie)")),
    ("--half-duplex", dict(
        action="store_true",
        help="NICs cannot send and receive at full rate at once (default: "
        "full duplex)")),
)
_WORKER_LAYOUT = ("--worker-layout", dict(
    choices=layout_modes.MODES, default="fsdp",
    help="with --devices-per-worker > 1: fsdp (parameters split over the "
    "worker's devices) or data (replicated) (default fsdp)"))
_FAULT_FLAGS = (
    ("--slow-fraction", dict(
        type=float, default=0.0,
        help="share of workers that are slow, round(f n) of them (default "
        "0)")),
    ("--slow-speed", dict(
        type=float, default=0.5,
        help=f"their speed, {inputs.flag_range('--slow-speed')} (default "
        "0.5)")),
    ("--failure-rate", dict(
        type=float, default=0.0,
        help="failure probability of a live worker per step, in [0, 1) "
        "(default 0)")),
    ("--mean-downtime", dict(
        type=float, default=10.0,
        help="mean steps a failed worker stays down, "
        f"{inputs.flag_range('--mean-downtime')} (default 10)")),
    ("--on-failure", dict(
        choices=stragglers.ON_FAILURE, default="proceed",
        help="DiLoCo's quorum rule: proceed with the live workers or roll "
        "the round back (default proceed)")),
)
_PREDICT_RUN = (
    ("--steps", dict(type=int, default=300,
                     help="simulated iterations, the first fifth is "
                     f"warm-up (at least {inputs.MIN_STEPS})")),
    ("--seed", dict(type=int, default=0, help="seed of compute draws")),
    ("--png", dict(help="write a grouped bar chart to this PNG")),
)


def _set_flag(text: str) -> tuple:
  """``--set KEY=VALUE`` (repeatable) of ``measure`` and ``calibrate``."""
  return ("--set", dict(action="append", default=[], metavar="KEY=VALUE",
                        help=text))


_MEASURE_FLAGS = (
    ("--config", dict(
        required=True,
        help="a preset name (gpt_tiny, gpt_quick) or a config file with "
        "get_config() (its model, batch and n_workers set the compute "
        "measured), e.g. configs/gpt_tiny.py")),
    _set_flag("override a config field (repeatable); distributed.* "
                   "joins a multi-process job as the runner does"),
    ("--out", dict(required=True, help="cluster JSON to write")),
    ("--local-size", dict(type=flag_types.integer(0, inputs.MAX_WORKERS),
                          default=0,
                          help="devices per node (default 0: the devices of "
                          f"one process; at most {inputs.MAX_WORKERS})")),
    ("--sizes-MB", dict(type=flag_types.number_list(flag_types.real(
        inputs.MIN_MESSAGE_MB, inputs.MAX_MESSAGE_MB, " MB"), unique=True),
                        default=[1.0, 16.0],
                        help="message sizes of the exchanges, MB, each "
                        f"{inputs.MIN_MESSAGE_MB:g} to "
                        f"{inputs.MAX_MESSAGE_MB:g} and held by every device "
                        "of this host (default 1,16)")),
    ("--repeats", dict(type=flag_types.integer(2, inputs.MAX_REPEATS),
                       default=5,
                       help="timed repetitions of each measurement, 2 to "
                       f"{inputs.MAX_REPEATS} (default 5)")),
)
_CALIBRATE_FLAGS = (
    ("--config", dict(required=True, help="a preset name (gpt_tiny, "
                      "gpt_quick) or a config file with get_config(), "
                      "e.g. configs/gpt_tiny.py")),
    _set_flag("override a config field (repeatable), e.g. --set "
                   "n_workers=8"),
    ("--steps", dict(type=flag_types.integer(2, inputs.MAX_REPEATS),
                     default=12,
                     help="measured rounds; each times every run, the "
                     "compute-only step and every collective once, 2 to "
                     f"{inputs.MAX_REPEATS} (default 12)")),
)

#: ``(name, help, ((group title or None, ((flag, keywords), ...)), ...))``
#: per subcommand, in the order ``--help`` lists them.
SUBCOMMANDS = (
    ("predict", "predict ms/iteration for a cluster and model", (
        (None, _PREDICT_OWN),
        ("cluster", (*_ranged(_CLUSTER_FLAGS), *_CLUSTER_CHOICES)),
        ("workload", (*_ranged(WORKLOAD_FLAGS), _WORKER_LAYOUT)),
        ("faults (docs/faults.md; a second table when set)", _FAULT_FLAGS),
        (None, _PREDICT_RUN))),
    ("fig6", "reproduce the paper's Figure 6", ((None, (
        ("--refit", dict(action="store_true", help="re-run the fits instead "
                         "of using the stored constants")),
        ("--png", dict(help="write the Figure 6 style chart to this "
                       "PNG")))),)),
    ("measure", "measure this cluster's links and a config's compute; write "
     "a cluster JSON for predict --cluster", ((None, _MEASURE_FLAGS),)),
    ("utilisation", "compute utilisation against the bandwidth between "
     "workers for data-parallel, DiLoCo and eager DiLoCo (Kale et al. 2025, "
     "Table 5); a table and a PNG", ((None, (
         *_ranged(_UTILISATION_FLAGS, "utilisation", _g),
         ("--png", dict(help="write the utilisation curves to this PNG")),
         ("--table", dict(help="write the table (Markdown) to this "
                          "file")))),)),
    ("validate", "leave-one-cluster-out validation on Figure 6 (T4, A100, "
     "A40)", ((None, (
         ("--refit", dict(action="store_true", help="re-run every fold's "
                          "fits (minutes) instead of the stored values")),)),)),
    ("calibrate", "measure a config's compute and collectives on this "
     "machine; compare with train steps", ((None, _CALIBRATE_FLAGS),)),
)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
  """The argument parser of :data:`SUBCOMMANDS` (units in the flag names).

  ``prog`` names the entry point in usage lines and errors (``decentral-jax``
  for the installed command); the subcommand chosen is ``args.command``.
  """
  p = _Parser(
      prog=prog,
      description="Runtime model of decentralized vs All-Reduce training "
      "(Wang et al., ICLR 2025, Sec. 4): predicted ms/iteration per method "
      "and topology, speedup over All-Reduce and a recommendation.",
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
  sub = p.add_subparsers(dest="command", required=True)
  p.subcommands = sub.choices  # name -> its parser, for parse()
  for name, text, sections in SUBCOMMANDS:
    s = sub.add_parser(name, help=text)
    for title, flags in sections:
      target = s if title is None else s.add_argument_group(title)
      for flag, keywords in flags:
        target.add_argument(flag, **keywords)
  return p


def parse(parser: argparse.ArgumentParser, argv: list[str]):
  """``parser.parse_args(argv)`` (a :func:`build_parser` parser), but a
  flag the subcommand does not know is refused by the subcommand's own
  parser, so the ``error:`` line points at its help (``see decentral-jax
  predict --help``), which lists the flags, not at the top-level help,
  which lists the subcommands (exit code 2)."""
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    parser.subcommands[args.command].error(
        f"unrecognized arguments: {' '.join(unknown)}")
  return args
