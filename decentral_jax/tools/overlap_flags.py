"""The flags of ``decentral-jax overlap`` (:mod:`decentral_jax.tools.overlap`):
the parser, their bounds, and the checks that run before JAX starts (a
list flag's unknown or repeated entry, a flag nothing reads)."""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable

from decentral_jax.tools import distinct_paths
from decentral_jax.tools import dummy_bins
from decentral_jax.tools import flag_types
from decentral_jax.tools.overlap_cases import CASES, GPT2_SMALL

# The checkout that holds the imported package (tools/ is 2 deep).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# The shipped GPU target descriptions (NAME.txtpb), as gpu_compile reads
# them (that module imports JAX; the flags are checked before it starts).
_TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "gpu_targets")
MODES = ("before", "after")
#: The XLA option that ``--overlap_limit`` sets.
OVERLAP_LIMIT_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"
#: The map-valued XLA option that ``--network_gbps`` sets (in XLA_FLAGS).
NETWORK_OPTION = "xla_gpu_analytical_latency_estimator_options"

# Bounds of the numeric flags: XLA's parallel collective limit (streams),
# a link rate (Gbit/s) and a node's GPUs.
MAX_OVERLAP_LIMIT = 64
MAX_NETWORK_GBPS = 1e6
MAX_GPUS_PER_NODE = 1024


def shipped_targets() -> tuple[str, ...]:
  """The names of the shipped GPU targets (``gpu_targets/NAME.txtpb``)."""
  return tuple(sorted(n[:-len(".txtpb")] for n in os.listdir(_TARGETS_DIR)
                      if n.endswith(".txtpb")))


def target_error(name: str) -> str | None:
  """Why ``name`` is not a GPU target (a shipped one or an existing .txtpb
  file), or None."""
  if name.endswith(".txtpb"):
    return None if os.path.isfile(name) else (
        f"target file {name!r} does not exist (a .txtpb GPU target "
        "description)")
  if name in shipped_targets():
    return None
  return (f"unknown target {name!r}; one of {', '.join(shipped_targets())} "
          "or a .txtpb file")


def is_hopper(name: str) -> bool:
  """Whether the target ``name`` (shipped, or a .txtpb file) is a Hopper
  GPU or newer (CUDA compute capability 9+): the targets whose latency
  estimator is XLA's analytical one, which ``--network_gbps`` sets."""
  path = name if name.endswith(".txtpb") else os.path.join(
      _TARGETS_DIR, f"{name}.txtpb")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError):
    return False
  got = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", text)
  return bool(got) and int(got.group(1)) >= 9


def name_list(what: str, error: Callable[[str], str | None], example: str):
  """An argparse ``type``: a comma list of names, returned as the text
  with each entry stripped (``"a, b"`` -> ``"a,b"``).

  Raises:
    argparse.ArgumentTypeError: an empty list or entry, an entry that
      ``error`` refuses (its words), or an entry given twice
      (:func:`~decentral_jax.tools.flag_types.repeated_entry`).
  """
  def parse(text: str) -> str:
    if not text.strip():
      raise argparse.ArgumentTypeError(
          f"needs at least one {what}, e.g. {example}")
    parts = flag_types.comma_parts(text, example)
    for part in parts:
      why = error(part)
      if why:
        raise argparse.ArgumentTypeError(f"{why} (e.g. {example})")
    why = flag_types.repeated_entry(text, parts, example)
    if why:
      raise argparse.ArgumentTypeError(why)
    return ",".join(parts)
  return parse


def xla_options(texts: list[str]) -> dict:
  """``--xla KEY=VALUE`` entries as ``{KEY: VALUE}``, the value as XLA
  parses it from text: ``true`` / ``false`` (any case) a bool, anything
  else the text itself (an int, float or string option reads it by its
  own type). Whether XLA knows the name and takes the value is asked of
  XLA before the first compile
  (:func:`~decentral_jax.tools.gpu_compile.check_compiler_options`).

  Raises:
    ValueError: one line naming ``--xla``: no ``=``, an empty value, a
      key that is not an XLA option name (``xla_`` then lower-case
      letters, digits and underscores), a key given twice, or a value
      out of its flag's bounds (:func:`check_xla_bounds`).
  """
  out = {}
  for text in texts:
    key, eq, value = (t.strip() for t in text.partition("="))
    if not (eq and re.fullmatch(r"xla_[a-z0-9_]+", key) and value):
      raise ValueError(f"--xla {text!r} must be KEY=VALUE with an XLA "
                       "option name, e.g. --xla xla_gpu_enable_latency_"
                       "hiding_scheduler=true.")
    if key in out:
      raise ValueError(f"--xla {key} is given twice; give each XLA option "
                       "once.")
    out[key] = (value.lower() == "true" if value.lower() in ("true", "false")
                else value)
    check_xla_bounds(key, out[key])
  return out



def xla_refusal(texts: list[str], message: str) -> str:
  """The ``error:`` line of XLA's refusal ``message`` of an ``--xla``
  option (``texts`` as typed): XLA quotes the value it was handed, and
  :func:`xla_options` hands a bool for ``true`` / ``false`` (XLA then shows
  ``'1'`` or ``'0'``), so the value is quoted as the user typed it (the
  message names the option)."""
  m = re.match(r"While setting option (xla_[a-z0-9_]+), '([^']*)'", message)
  typed = {k.strip(): v.strip() for k, _, v in (t.partition("=")
                                                 for t in texts)}
  if m and m.group(1) in typed:
    message = message.replace(f"'{m.group(2)}'", repr(typed[m.group(1)]), 1)
  return f"--xla: XLA refuses it: {message.rstrip('.')}; {_xla_fix(message)}."


def _xla_fix(message: str) -> str:
  """The fix of XLA's refusal ``message``, by what it refuses: an unknown
  name, a value of a message-valued (map or proto) option, which XLA's
  compile options cannot set at all, or a scalar of the wrong type."""
  if "No such" in message:
    return "check the name against XLA's DebugOptions"
  m = re.match(r"While setting option (xla_[a-z0-9_]+), .* is not a valid "
               r"message value", message)
  if m is None:
    return "a bool takes true or false, an int a whole number"
  where = ("use --network_gbps and --gpus_per_node" if m.group(1) ==
           NETWORK_OPTION else f"set it in XLA_FLAGS (--{m.group(1)}=...)")
  return (f"--xla sets only bool, number, string and enum options, and "
          f"{m.group(1)} takes a message (a map or proto); {where} instead")

def check_xla_bounds(key: str, value) -> None:
  """Refuses an ``--xla`` value of an option a flag of this command also
  sets outside that flag's bounds: :data:`OVERLAP_LIMIT_OPTION`, a whole
  number, in ``[1, MAX_OVERLAP_LIMIT]`` (``--overlap_limit``'s bound;
  below 1 XLA's GPU scheduler aborts the process: its collective-broadcast
  limit, 1, may not exceed it). Other text is left to XLA's parser."""
  n = _as_int(value)
  if key != OVERLAP_LIMIT_OPTION or isinstance(value, bool) or not \
      isinstance(n, int):  # not a whole number: XLA's parser refuses it
    return
  if not 1 <= n <= MAX_OVERLAP_LIMIT:
    raise ValueError(f"--xla {key}={value} must be an int in [1, "
                     f"{MAX_OVERLAP_LIMIT}] (as --overlap_limit; XLA aborts "
                     "below 1); give one in that range or use "
                     "--overlap_limit.")


def _known(kind: str, names) -> Callable[[str], str | None]:
  return lambda n: None if n in names else (
      f"unknown {kind} {n!r}; one of {', '.join(names)}")


#: Flags read only with others (:func:`check_needs`; a list of flags with
#: ``--render``, which only prints earlier runs' tables, is refused apart).
NEEDS = (
    flag_types.Needs("--all_programs",
                     lambda a: "after" in a.modes.split(","),
                     "without mode after in --modes (mode before compiles "
                     "every program already)",
                     "add after to --modes or drop --all_programs"),
    flag_types.Needs(
        "--network_gbps", lambda a: a.network_gbps == 0 or any(
            is_hopper(t) for t in a.targets.split(",")),
        "without a Hopper target in --targets (XLA prices collectives with "
        "the analytical latency estimator it sets only there: "
        f"{', '.join(t for t in shipped_targets() if is_hopper(t))})",
        "add one or drop --network_gbps"),
    flag_types.Needs("--gpus_per_node", lambda a: a.network_gbps > 0,
                     "without --network_gbps above 0",
                     "add --network_gbps or drop --gpus_per_node"),
    flag_types.Needs("--profile", lambda a: a.timeline, "without --timeline",
                     "add --timeline or drop --profile"),
    flag_types.Needs("--fixture_cases", lambda a: bool(a.fixtures),
                     "without --fixtures", "add --fixtures DIR or drop "
                     "--fixture_cases"),
    flag_types.Needs(
        "--data_dir", lambda a: any(CASES.get(c, ("",))[0] == GPT2_SMALL
                                    for c in a.cases.split(",")),
        "without a gpt2_small case in --cases",
        "add one or drop --data_dir"),
)


def check_needs(args, given: set) -> None:
  """Refuses a flag given (``given``) where nothing reads it: any other
  flag with ``--render``, a row of :data:`NEEDS`, ``--fixtures`` when no
  case of ``--cases`` is in ``--fixture_cases`` (nothing would be
  written), or an ``--xla`` option that a flag of its own also sets to
  another value (:func:`xla_conflict`).

  Raises:
    ValueError: one line naming the flag.
  """
  if args.render is not None:
    other = sorted(given - {"--render"})
    if other:
      raise ValueError(f"{other[0]} has no effect with --render (it only "
                       "prints the tables of earlier runs); drop one of "
                       "them.")
  flag_types.check_needs(NEEDS, given, args)
  cases = args.cases.split(",")
  if args.fixtures and not set(cases) & set(args.fixture_cases.split(",")):
    raise ValueError(
        f"--fixtures writes the programs of --fixture_cases "
        f"({args.fixture_cases}), none of which is in --cases "
        f"({args.cases}); give --fixture_cases {cases[0]} or drop "
        "--fixtures.")
  why = xla_conflict(args)
  if why:
    raise ValueError(why)


def _as_int(value):
  """``int(value)`` of an option's text (``03`` is 3), or the text."""
  try:
    return int(str(value).strip(), 10)
  except ValueError:
    return value


def xla_conflict(args) -> str | None:
  """Why ``--xla`` sets an option to another value than the flag of its
  own that also sets it (``--overlap_limit``: :data:`OVERLAP_LIMIT_OPTION`;
  ``--network_gbps``: :data:`NETWORK_OPTION`, only through ``XLA_FLAGS``),
  or None."""
  given = xla_options(args.xla)
  if args.overlap_limit and OVERLAP_LIMIT_OPTION in given and _as_int(
      given[OVERLAP_LIMIT_OPTION]) != int(args.overlap_limit):
    return (f"--overlap_limit {args.overlap_limit} and --xla "
            f"{OVERLAP_LIMIT_OPTION}={given[OVERLAP_LIMIT_OPTION]} set the "
            "same XLA option to different values; give one of them.")
  if args.network_gbps and NETWORK_OPTION in given:
    return (f"--network_gbps {args.network_gbps:g} and --xla "
            f"{NETWORK_OPTION} set the same XLA option; give one of them.")
  return None


#: The dummy token files a gpt2_small case writes in ``--data_dir``
#: (file name -> zero uint16 tokens; :mod:`~decentral_jax.tools.dummy_bins`).
DUMMY_TOKENS = {"train.bin": 300_000, "val.bin": 20_000}


def check_paths(args) -> None:
  """Refuses, before any compile, an output that cannot be written
  (``--out``, ``--fixtures``, ``--data_dir`` where a gpt2_small case
  writes its token files, or one already holding a ``train.bin`` or
  ``val.bin`` that is not exactly that dummy:
  :func:`~decentral_jax.tools.dummy_bins.check_dummy_bins`) and a
  ``--profile`` that cannot be read or holds a bad cost
  (:func:`profile_costs`, kept as ``args.profile_costs``).

  Raises:
    ValueError: one line naming the flag, the path and the fix.
  """
  flag_types.check_output_file(args.out, "--out")
  flag_types.check_output_dir(args.fixtures, "--fixtures")  # None: not given
  if args.profile is not None and not args.profile.strip():
    raise ValueError("--profile is empty; give a ProfiledInstructionsProto "
                     "text file or drop --profile.")
  if args.timeline:
    flag_types.check_input_file(args.profile, "--profile")
  gpt2 = any(CASES[c][0] == GPT2_SMALL for c in args.cases.split(","))
  if gpt2:
    flag_types.check_output_dir(args.data_dir, "--data_dir")
    dummy_bins.check_dummy_bins(args.data_dir, DUMMY_TOKENS, "--data_dir")
  _check_distinct(args, gpt2)
  args.profile_costs = profile_costs(args.profile if args.timeline else None)


def profile_costs(path) -> dict:
  """``{instruction: us}`` of the ``--profile`` file ``path`` ({} for
  None), read once (``records.read_bytes``) and checked
  (``analysis.timeline.read_profile``) before any compile.

  Raises:
    ValueError: one line naming ``--profile``, the file and the entry: a
      file that cannot be read or is not UTF-8 text, no ``costs`` block,
      a cost that is not a finite number of microseconds >= 0.
  """
  if path is None:
    return {}
  from decentral_jax import records
  from decentral_jax.analysis import timeline
  raw = records.read_bytes(path)
  if isinstance(raw, records.Damaged):
    raise raw.error("--profile ")
  try:
    return timeline.read_profile(raw.decode("utf-8"))
  except UnicodeDecodeError:
    raise ValueError(f"--profile {path} is not UTF-8 text; give a "
                     "ProfiledInstructionsProto text file.") from None
  except ValueError as e:
    raise ValueError(f"--profile {path}: {e}") from None


def _check_distinct(args, gpt2: bool) -> None:
  """``--out`` (rows appended) names none of the files the command reads
  (``--profile``, each ``--targets`` description, shipped or a .txtpb
  file, each case's config) nor the token files a gpt2_small case writes
  in ``--data_dir``, nor lies in the ``--fixtures`` directory, which is
  none of those input files (ValueError names both flags)."""
  inputs = [("--profile", args.profile if args.timeline else None)]
  inputs += [("--targets", t if t.endswith(".txtpb") else os.path.join(
      _TARGETS_DIR, f"{t}.txtpb")) for t in args.targets.split(",")]
  inputs += [("--cases", os.path.join(_ROOT, CASES[c][0].split(":")[0]))
             for c in args.cases.split(",")]
  outputs = [("--out", args.out)]
  if gpt2:
    outputs += [(f"--data_dir ({name})", os.path.join(args.data_dir, name))
                for name in ("train.bin", "val.bin")]
  distinct_paths.check_distinct_paths(outputs, inputs,
                                      [("--fixtures", args.fixtures)])


def _list_flags(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--cases", default="gpt_tiny,aer,virtual",
                  type=name_list("case", _known("case", CASES),
                                 "gpt_tiny,aer"),
                  help="comma list of configs to compile, of: "
                  f"{', '.join(CASES)} (default %(default)s)")
  ap.add_argument("--modes", default="before,after",
                  type=name_list("mode", _known("mode", MODES),
                                 "before,after"),
                  help="before (switch rounds, consensus on log steps), "
                  "after (the defaults) or both (default %(default)s)")
  ap.add_argument("--targets", default="h200",
                  type=name_list("target", target_error, "h200,a100_sxm_80"),
                  help="comma list of GPU targets: "
                  f"{', '.join(shipped_targets())} or a .txtpb file "
                  "(default %(default)s)")


#: The shipped rows of the main cases (the example of ``--render``) and the
#: default ``--out`` (created by the first run, so a run leaves the shipped
#: rows as they are), relative to the checkout.
SHIPPED_ROWS = "benchmarks/results/gpu_overlap/main.jsonl"
DEFAULT_OUT = "benchmarks/results/gpu_overlap.jsonl"


def build_parser(prog: str) -> argparse.ArgumentParser:
  """The command's flags (``prog`` names it in usage lines); a list flag
  (``--cases``, ``--modes``, ``--targets``) with an unknown, empty or
  repeated entry exits with code 2 after one line naming the flag."""
  ap = flag_types.Parser(prog=prog, description=__doc__.split("\n")[0])
  _list_flags(ap)
  ap.add_argument("--all_programs", action="store_true",
                  help="mode after: every round also with the consensus "
                  "measurement (default: the first round only)")
  ap.add_argument("--overlap_limit", type=flag_types.integer(
      0, MAX_OVERLAP_LIMIT), default=0,
                  help="xla_gpu_experimental_parallel_collective_overlap_"
                  f"limit (0: XLA's default, 1; at most {MAX_OVERLAP_LIMIT})")
  ap.add_argument("--out", default=os.path.join(_ROOT, DEFAULT_OUT),
                  help="JSON lines file, one line per program, appended "
                  f"(default: {DEFAULT_OUT} of the checkout, created by "
                  f"the first run; the shipped rows are {SHIPPED_ROWS} and "
                  "its neighbours)")
  ap.add_argument("--fixtures", default=None,
                  help="directory for the stripped, gzipped scheduled HLO "
                  "of --fixture_cases (test fixtures; default: none)")
  ap.add_argument("--fixture_cases", default="gpt_tiny,aer,virtual",
                  type=name_list("case", _known("case", CASES),
                                 "gpt_tiny,aer"),
                  help="with --fixtures: the cases written there (default "
                  "%(default)s)")
  ap.add_argument("--data_dir", default="/tmp/bench_gpu_overlap_bins",
                  help="where the gpt2_small case writes its dummy token "
                  "files (zeros); a train.bin or val.bin already there "
                  "that is not exactly that dummy is refused, never "
                  "replaced")
  ap.add_argument("--network_gbps", type=flag_types.real(
      0, MAX_NETWORK_GBPS, " Gbit/s"), default=0.0,
                  help="model an inter-node link of this many Gbit/s in "
                  "XLA's latency estimator (Hopper targets), through "
                  f"XLA_FLAGS; 0: XLA's own model (at most "
                  f"{MAX_NETWORK_GBPS:g})")
  ap.add_argument("--gpus_per_node", type=flag_types.integer(
      1, MAX_GPUS_PER_NODE), default=4,
                  help="with --network_gbps: GPUs per node in XLA's latency "
                  f"estimator (default 4, at most {MAX_GPUS_PER_NODE})")
  ap.add_argument("--xla", action="append", default=[],
                  help="an extra XLA compile option KEY=VALUE (repeatable; "
                  "a bool takes true or false; XLA checks the name and the "
                  "value's type before the first compile; a message-valued "
                  "option such as a map goes in XLA_FLAGS)")
  ap.add_argument("--timeline", action="store_true",
                  help="draw each case's step per target to a PNG next to "
                  "--out")
  ap.add_argument("--profile", default=None,
                  help="ProfiledInstructionsProto text pricing instructions "
                  "(us) for --timeline's clock")
  ap.add_argument("--render", nargs="*", default=None,
                  help="only print the tables of these JSON-lines files")
  return ap
