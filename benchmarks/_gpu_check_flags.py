"""The flags of ``benchmarks/gpu_check.py``: parsed and checked before any
part runs or anything is compiled.

:func:`parse_args` reads the flags (:func:`build_parser`) and checks them:
an empty value where ``""`` means the flag left out
(:func:`check_not_empty`), the numbers (:func:`check_numbers`), the
latency-profile and roofline flags, ``--programs``
(:func:`parse_programs`), ``--topology`` (:func:`check_topology`), the
outputs (:func:`check_outputs_are_not_inputs`), a flag given where nothing
reads it (:data:`FLAG_READERS`, :func:`check_needs`) and ``--config`` with
its ``--set`` overrides (:func:`check_config`). A bad one exits with code
2 and one ``error:`` line naming it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: ``--help``'s description: the first line of gpu_check.py's docstring.
DESCRIPTION = ("GPU check: step speed, and the gossip overlap of the compiled "
               "train step.")
TINY = os.path.join(_ROOT, "configs", "gpt_tiny.py")

# Largest --collective_us: 1000 s, far beyond any transfer of a step.
MAX_COLLECTIVE_US = 1e9
MAX_TOPOLOGY_GPUS = 4096  # --topology: GPUs in all (and so per factor)


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked (:func:`check_flags`; a bad one exits with code 2)."""
  ap = build_parser()
  args = ap.parse_args(argv)
  from decentral_jax.tools import flag_types
  args.given = flag_types.given_flags(
      ap, sys.argv[1:] if argv is None else argv)
  try:
    check_not_empty(ap, args)
    check_flags(args)
    check_config(args)
  except ValueError as e:
    ap.error(str(e))
  return args


#: What to give each flag whose default, "", stands for the flag left out.
EMPTY_MEANS_ABSENT = {
    "--deviceless": "a GPU target (h200, h100_sxm, a100_sxm_80) or a "
                    ".txtpb file",
    "--topology": "SLICESxHOSTSxGPUS (e.g. 1x2x4)"}


def check_not_empty(ap: argparse.ArgumentParser, args) -> None:
  """Refuses a flag given (``args.given``) with an empty value where its
  default, ``""``, means the flag left out (``--deviceless ''`` would run
  on this machine's devices instead of compiling for a target).

  Raises:
    ValueError: ``--deviceless is empty; give ... or drop --deviceless.``
  """
  for flag in sorted(args.given):
    dest = flag[2:].replace("-", "_")
    if ap.get_default(dest) == "" and getattr(args, dest, None) == "":
      give = EMPTY_MEANS_ABSENT.get(flag, "a value")
      raise ValueError(f"{flag} is empty, which reads as {flag} left out; "
                       f"give {give} or drop {flag}.")


# (flag, least, most) of the integer flags, in their units (steps,
# repeats, sequences, seconds).
INT_FLAGS = (("--batch", 1, 10**6), ("--warmup", 0, 10**6),
             ("--steps", 1, 10**6), ("--repeats", 1, 10**4),
             ("--warm_steps", 1, 10**6), ("--timed_steps", 1, 10**6),
             ("--child_timeout", 1, 7 * 86400))
MAX_COMPUTE_MS = 1e6  # --compute_ms, as predict's compute times
MAX_PEAK_FLOPS = 1e18  # FLOP/s; an H200 is about 1e15 dense bfloat16


def check_numbers(args: argparse.Namespace) -> None:
  """Checks the numeric flags other than the latency profile's.

  Raises:
    ValueError: ``--min_fraction`` not a finite number in [0, 1]; a flag of
      :data:`INT_FLAGS` outside its range; ``--peak_flops`` not 0 (the
      GPU's own, :func:`gpu_check.peak_flops`) or a finite FLOP/s in (0,
      MAX_PEAK_FLOPS].
  """
  from decentral_jax import checks
  checks.check_float("--min_fraction", args.min_fraction, minimum=0.0,
                     maximum=1.0)
  for flag, low, high in INT_FLAGS:
    if getattr(args, flag[2:]) is not None:  # --batch None: not given
      checks.check_int(flag, getattr(args, flag[2:]), minimum=low,
                       maximum=high)
  flops = args.peak_flops
  if flops != 0 and not 0 < flops <= MAX_PEAK_FLOPS:  # False for NaN too
    raise ValueError(f"--peak_flops must be 0 (the GPU's own peak) or a "
                     f"finite FLOP/s in (0, {MAX_PEAK_FLOPS:g}], got "
                     f"{flops:g}.")


_PARTS = ("timing", "schedule", "gossip_timing")
#: What reads each flag: ``deviceless`` (``--deviceless`` compiles) and the
#: parts run on this machine's devices (:func:`check_needs`). Under
#: ``--deviceless`` the parts' numbers (:data:`INT_FLAGS`, ``--peak_flops``)
#: are checked (:func:`check_numbers`, first) and then refused: no part runs.
FLAG_READERS = {
    "--topology": ("deviceless",), "--workload": ("deviceless",),
    "--quiet": ("deviceless",), "--part": _PARTS,
    "--smoke": ("timing",), "--batch": ("timing",),
    "--warmup": ("timing",), "--steps": ("timing",),
    "--repeats": ("timing",), "--peak_flops": ("timing",),
    "--child_timeout": ("schedule",),
    "--warm_steps": ("gossip_timing",), "--timed_steps": ("gossip_timing",),
    "--programs": ("deviceless", "schedule"),
    "--min_fraction": ("deviceless", "schedule"),
    "--roofline": ("deviceless", "schedule"),
    # The timing part times GPT-2 small's own config, not --config's.
    "--config": ("deviceless", "schedule", "gossip_timing"),
    "--set": ("deviceless", "schedule", "gossip_timing"),
}


def _needs() -> tuple:
  """The rows of :data:`FLAG_READERS` as dependency rules, and
  ``--gemm_efficiency`` / ``--memory_efficiency`` needing ``--roofline``."""
  from decentral_jax.tools import flag_types
  rows = []
  for flag, readers in FLAG_READERS.items():
    parts = [p for p in readers if p != "deviceless"]
    if "deviceless" not in readers:
      read = ("it chooses the parts run on this machine's devices"
              if flag == "--part" else f"it is read by --part "
              f"{' or '.join(parts)} on this machine's devices")
      rows.append(flag_types.Needs(
          flag, lambda a: not a.deviceless, f"with --deviceless ({read})",
          f"drop {flag} or --deviceless"))
    if not parts:
      rows.append(flag_types.Needs(
          flag, lambda a: bool(a.deviceless), "without --deviceless",
          f"add --deviceless TARGET (e.g. h200) or drop {flag}"))
    elif flag != "--part":
      rows.append(flag_types.Needs(
          flag, lambda a, parts=parts: bool(a.deviceless) or a.part in (
              "all", *parts),
          f"without --part {' or '.join(parts)} (or all)"
          + (" or --deviceless" if "deviceless" in readers else ""),
          f"choose that part or drop {flag}"))
  for flag in ("--gemm_efficiency", "--memory_efficiency"):
    rows.append(flag_types.Needs(
        flag, lambda a: a.roofline, "without --roofline",
        f"add --roofline or drop {flag}"))
  return tuple(rows)


def check_needs(args: argparse.Namespace) -> None:
  """Refuses a flag given (``args.given``) where nothing reads it: a
  ``--deviceless`` flag without it, a part's flag with another ``--part``
  (or ``--part`` with ``--deviceless``, or a part's number such as
  ``--steps``, ``--batch``, ``--repeats``), a roofline share without
  ``--roofline``.

  Raises:
    ValueError: ``--topology has no effect without --deviceless; ...``.
  """
  from decentral_jax.tools import flag_types
  given = set(getattr(args, "given", ()))
  flag_types.check_needs(_needs(), given, args)


def check_topology(spec: str) -> None:
  """Raises ValueError unless ``spec`` is ``SLICESxHOSTSxGPUS``, three
  positive ints of ASCII digits (e.g. ``1x1x8``; ``str.isdigit`` would
  take ``'²'`` and ``'١'``) whose product (the GPUs the target describes)
  is at most MAX_TOPOLOGY_GPUS, before XLA sees it (XLA's mock topology
  builds every device, so a huge one would not finish)."""
  parts = spec.split("x")
  if len(parts) != 3 or not all(
      re.fullmatch(r"[0-9]+", p) and p.strip("0") for p in parts):
    raise ValueError(f"--topology {spec!r} must be SLICESxHOSTSxGPUS, three "
                     "positive ints such as 1x1x8 or 2x1x4.")
  if (any(len(p.lstrip("0")) > len(str(MAX_TOPOLOGY_GPUS)) for p in parts)
      or math.prod(int(p) for p in parts) > MAX_TOPOLOGY_GPUS):
    raise ValueError(f"--topology {spec!r} describes more than "
                     f"{MAX_TOPOLOGY_GPUS} GPUs (SLICES*HOSTS*GPUS); give "
                     f"at most {MAX_TOPOLOGY_GPUS}, such as 1x1x8 or 2x1x4.")


def check_outputs_are_not_inputs(args: argparse.Namespace) -> None:
  """Raises ValueError when ``--json`` or ``--workload`` names the
  ``--config`` or ``--deviceless`` file, or both name one file
  (:func:`decentral_jax.tools.distinct_paths.check_distinct_paths`)."""
  from decentral_jax.tools import distinct_paths
  txtpb = args.deviceless if (args.deviceless or "").endswith(".txtpb") \
      else None
  distinct_paths.check_distinct_paths(
      [("--json", args.json), ("--workload", args.workload)],
      [("--config", distinct_paths.config_file(args.config)),
       ("--deviceless", txtpb)])


def check_flags(args: argparse.Namespace) -> None:
  """Checks the latency-profile flags, in the units typed; ``--cluster``
  becomes the preset's own spelling (case ignored, as
  ``experiments/compare.py --clusters``).

  Raises:
    ValueError: one of them without ``--deviceless``; ``--deviceless``
      neither a shipped target nor a ``.txtpb`` file; ``--cluster`` not a
      runtime-model preset, or with ``--collective_us``; ``--collective_us``
      outside (0, MAX_COLLECTIVE_US]; ``--compute_ms`` not a finite number
      > 0, or without ``--cluster`` or ``--collective_us``; the numbers of
      :func:`check_numbers`, ``--programs`` (:func:`parse_programs`),
      ``--topology`` (:func:`check_topology`) or ``--json`` (a folder that
      does not exist, not writable) bad; an output naming an input or the
      other output (:func:`check_outputs_are_not_inputs`).
  """
  from decentral_jax.runtime_model import presets
  from decentral_jax.tools.runtime_model_cli import inputs
  check_numbers(args)
  parse_programs(args.programs)
  if args.topology:
    check_topology(args.topology)
  inputs.check_output_path(args.json, "--json")
  inputs.check_output_path(args.workload, "--workload")
  check_outputs_are_not_inputs(args)
  given = [f for f, v in (("--cluster", args.cluster),
                          ("--collective_us", args.collective_us),
                          ("--compute_ms", args.compute_ms)) if v is not None]
  if given and not args.deviceless:
    verb = "applies" if len(given) == 1 else "apply"
    raise ValueError(f"{' and '.join(given)} {verb} to --deviceless "
                     "compiles only; add --deviceless TARGET (e.g. h200).")
  if args.deviceless and not args.deviceless.endswith(".txtpb"):
    from decentral_jax.tools import gpu_compile
    if args.deviceless not in gpu_compile.TARGETS:
      raise ValueError(f"--deviceless {args.deviceless!r} is not a GPU "
                       f"target; use one of {', '.join(gpu_compile.TARGETS)} "
                       "or a .txtpb file.")
  if args.cluster is not None:
    name = presets.cluster_preset_name(args.cluster)
    if name is None:
      raise ValueError(f"--cluster {args.cluster!r} is not a runtime-model "
                       f"preset; use one of {', '.join(presets.CLUSTERS)} "
                       "(case ignored).")
    args.cluster = name
    if args.collective_us is not None:
      raise ValueError("--cluster and --collective_us both give the transfer "
                       "times; give one of them.")
  us = args.collective_us
  if us is not None and not 0 < us <= MAX_COLLECTIVE_US:
    raise ValueError(f"--collective_us must be a transfer time in "
                     f"microseconds in (0, {MAX_COLLECTIVE_US:g}], got {us:g}.")
  for flag in ("gemm_efficiency", "memory_efficiency"):
    e = getattr(args, flag)
    if not 0 < e <= 1:
      raise ValueError(f"--{flag} must be a share of the peak in (0, 1], "
                       f"got {e:g}.")
  check_needs(args)
  if args.roofline and args.compute_ms is not None:
    raise ValueError("--roofline puts every time on the GPU's clock; "
                     "--compute_ms (a rescaling to XLA's clock) does not "
                     "apply with it: drop one.")
  ms = args.compute_ms
  if ms is not None:
    if not (0 < ms and math.isfinite(ms)):
      raise ValueError(f"--compute_ms must be the step's compute time in "
                       f"milliseconds, a finite number > 0, got {ms:g}.")
    if ms > MAX_COMPUTE_MS:
      raise ValueError(f"--compute_ms must be at most {MAX_COMPUTE_MS:g} "
                       f"(ms, about 17 minutes per step), got {ms:g}.")
    if args.cluster is None and us is None:
      raise ValueError("--compute_ms rescales the transfer times of "
                       "--cluster or --collective_us; give one of them too.")


def check_config(args: argparse.Namespace) -> None:
  """Loads ``--config`` with the ``--set`` overrides (no JAX) when
  ``--deviceless`` or a part that reads them (:data:`FLAG_READERS`) will
  run, so a bad one is refused before any part runs (the timing part, the
  first, reads neither).

  Raises:
    ValueError: the config file missing or bad, an unknown ``--set``
      field or value (the message of ``runner.config.load_config``);
      ``--json`` or ``--workload`` naming a file the config's
      ``data.path`` reads (``distinct_paths.data_inputs``).
  """
  from decentral_jax.tools import distinct_paths
  readers = FLAG_READERS["--config"]
  if args.deviceless or args.part == "all" or args.part in readers:
    config = run_config(args)
    distinct_paths.check_distinct_paths(  # the corpus or token files it reads
        [("--json", args.json), ("--workload", args.workload)],
        distinct_paths.data_inputs(config.data.get("path"),
                                   "--set data.path"))


def run_config(args, extra=()):
  """``--config`` with the ``--set`` overrides and then ``extra``
  (``KEY=VALUE`` strings), loaded (no JAX)."""
  from decentral_jax.runner import config as config_lib
  return config_lib.load_config(args.config, list(args.set) + list(extra))


def parse_programs(spec: str) -> list[tuple[int | None, str]] | None:
  """``--programs`` as ``(round, mode)`` pairs; None for ``all``/``none``.

  ``ROUND:MODE,...``: ``ROUND`` an int, or ``None`` / empty for every
  round; ``MODE`` default ``none``.

  Raises:
    ValueError: an empty entry (e.g. ``--programs ,``), a round that is
      not an int, or a program given twice (``0:none,0``: the mode's
      default filled in), naming the entry.
  """
  if spec in ("all", "none"):
    return None
  out = []
  for k, item in enumerate(spec.split(","), 1):
    if not item.strip():
      raise ValueError(f"--programs {spec!r}: entry {k} is empty; give "
                       "all, none or ROUND:MODE,... (e.g. 0:none,0:input).")
    r, _, mode = item.strip().partition(":")
    # ASCII digits without a leading zero ("²" passes str.isdigit()).
    if r not in ("", "None") and not re.fullmatch(r"-?(0|[1-9][0-9]*)", r):
      raise ValueError(f"--programs {spec!r}: entry {k} ({item!r}) has round "
                       f"{r!r}, not an int; give ROUND:MODE (e.g. 0:input).")
    out.append((None if r in ("", "None") else int(r), mode or "none"))
  for k, pair in enumerate(out):
    if pair in out[:k]:
      raise ValueError(
          f"--programs {spec!r}: entry {k + 1} repeats entry "
          f"{out.index(pair) + 1} (the program of round "
          f"{'every' if pair[0] is None else pair[0]}, mode {pair[1]}; "
          "MODE defaults to none); give each program once, e.g. "
          "0:none,0:input.")
  return out


def build_parser() -> argparse.ArgumentParser:
  """The flags; a refusal is one ``error:`` line (``flag_types.Parser``)."""
  from decentral_jax.tools import flag_types
  ap = flag_types.Parser(description=DESCRIPTION)
  ap.add_argument("--part", choices=("all", "timing", "schedule",
                                     "gossip_timing"), default="all")
  ap.add_argument("--deviceless", metavar="TARGET", default="",
                  help="compile for this GPU target here (h200, h100_sxm, "
                  "a100_sxm_80 or a .txtpb file) and print the reports")
  ap.add_argument("--topology", default="",
                  help="deviceless topology SLICESxHOSTSxGPUS, at most "
                  f"{MAX_TOPOLOGY_GPUS} GPUs in all (default 1x1xN, N the "
                  "devices the config needs)")
  ap.add_argument("--config", default=TINY,
                  help="run config for schedule, gossip_timing and "
                  "--deviceless (default configs/gpt_tiny.py)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override (repeatable)")
  ap.add_argument("--programs", default="all",
                  help="all, none (steps without the consensus "
                  "measurement) or ROUND:MODE,... (e.g. 0:none,0:input)")
  ap.add_argument("--cluster", default=None,
                  help="--deviceless: tell XLA's scheduler the runtime "
                  "model's transfer time of each collective on this "
                  "runtime_model preset cluster (e.g. A40) through a "
                  "latency profile (compiles each program twice)")
  ap.add_argument("--collective_us", type=float, default=None,
                  help="--deviceless: the same with one transfer time (us, "
                  f"at most {MAX_COLLECTIVE_US:g}) for every asynchronous "
                  "collective")
  ap.add_argument("--compute_ms", type=float, default=None,
                  help="with --cluster/--collective_us: the step's compute "
                  "time on that cluster (ms); the times are rescaled to "
                  "XLA's own estimate of the program's compute (e.g. 122.3 "
                  "for GPT-2 small on the A40 preset)")
  ap.add_argument("--roofline", action="store_true",
                  help="price every GEMM, fusion and copy at the target's "
                  "roofline in the latency profile too (deviceless and "
                  "real-GPU compiles; docs/gpu_overlap.md)")
  ap.add_argument("--gemm_efficiency", type=float, default=0.5,
                  help="--roofline: share of the bf16 peak a GEMM reaches")
  ap.add_argument("--memory_efficiency", type=float, default=0.7,
                  help="--roofline: share of HBM bandwidth a memory-bound "
                  "kernel reaches")
  ap.add_argument("--min_fraction", type=float, default=1 / 64,
                  help="report collectives of at least this share of one "
                  "worker's parameter bytes (default 1/64)")
  ap.add_argument("--json", default=None, help="write the result here")
  ap.add_argument("--workload", default=None,
                  help="--deviceless: write the runtime-model workload read "
                  "from the first compiled program (JSON) here")
  ap.add_argument("--quiet", action="store_true",
                  help="no per-program tables")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny timing model (CPU check of the script itself)")
  ap.add_argument("--batch", type=int, default=None,
                  help="sequences per step (default: the config's 30, "
                  "4 under --smoke)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="steps per repeat")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--peak_flops", type=float, default=0.0)
  ap.add_argument("--warm_steps", type=int, default=6,
                  help="gossip_timing: untimed steps (compiles)")
  ap.add_argument("--timed_steps", type=int, default=20)
  ap.add_argument("--child_timeout", type=int, default=150)
  ap.add_argument("--json_only", action="store_true")
  return ap
