"""Shared code of the benchmark scripts: machine facts, GPT train steps.

Nothing here is imported by the library; the scripts in ``benchmarks/``
(``import _common``: a script's own folder is on ``sys.path``) and
``benchmarks/studies/`` use it to describe the machine in their output and
to build the same decentralized GPT train step in every benchmark.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

PyTree = Any


def set_cpu_devices(n: int, single_thread_eigen: bool = False,
                    source: str | None = None) -> None:
  """Asks XLA for ``n`` simulated CPU devices; call before importing jax.

  A count the environment already sets (``XLA_FLAGS``'
  ``--xla_force_host_platform_device_count`` or ``JAX_NUM_CPU_DEVICES``) is
  kept once checked to be a whole number >= 1 (XLA aborts on 'abc', JAX
  fails on 0); with ``source`` given, fewer than ``n`` is refused at once
  (:func:`check_cpu_devices`).

  Args:
    n: number of simulated CPU devices.
    single_thread_eigen: also pass ``--xla_cpu_multi_thread_eigen=false``,
      so that each device's matmuls and convolutions run on one thread (the
      devices themselves still run concurrently). With many simulated
      devices on few cores this avoids oversubscribing the cores, the
      analogue of ``OMP_NUM_THREADS=1`` for one PyTorch process per worker.
    source: the flag that asks for ``n`` (``"--n_workers=16"``), for the
      refusal; None: not checked here.

  Raises:
    RuntimeError: jax was already imported (the flags would be ignored).
    SystemExit: code 2 after one ``error:`` line: a count of the
      environment that is not a whole number >= 1
      (:func:`decentral_jax.checks.xla_flags_device_count`,
      :func:`~decentral_jax.checks.environment_count`), or fewer devices
      than ``n`` (:func:`check_cpu_devices`).
  """
  import sys
  if "jax" in sys.modules:
    raise RuntimeError("set_cpu_devices must run before jax is imported.")
  from decentral_jax import checks  # NumPy only: before JAX reads them
  try:
    count = checks.xla_flags_device_count()
    checks.environment_count("JAX_NUM_CPU_DEVICES")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  flags = os.environ.get("XLA_FLAGS", "")
  if count is None:
    flags = f"{flags} --xla_force_host_platform_device_count={n}"
  if single_thread_eigen and "xla_cpu_multi_thread_eigen" not in flags:
    flags = f"{flags} --xla_cpu_multi_thread_eigen=false"
  os.environ["XLA_FLAGS"] = flags.strip()
  if source is not None:
    check_cpu_devices(n, source)


def check_cpu_devices(n: int, source: str, flag: bool = True) -> None:
  """Refuses, before any work, a CPU run whose environment simulates fewer
  than the ``n`` devices ``source`` asks for (the count JAX made, so no
  spelling of ``XLA_FLAGS`` is re-parsed here). ``source`` is the flag
  that asks for ``n`` (``"--n_workers=16"``: the line offers to lower it),
  or with ``flag=False`` the script whose count is fixed (``"bench_step_time
  .py"``).

  Raises:
    SystemExit: code 2 after one ``error:`` line naming the variable that
      set the count, ``source`` and the fix; a bad ``JAX_NUM_CPU_DEVICES``
      (:func:`decentral_jax.checks.environment_count`) too.
  """
  import sys
  from decentral_jax import checks  # NumPy only: before JAX reads it
  try:
    env = checks.environment_count("JAX_NUM_CPU_DEVICES")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  import jax
  if jax.default_backend() != "cpu" or jax.local_device_count() >= n:
    return
  var = (f"JAX_NUM_CPU_DEVICES={env}" if env is not None else
         f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  lower = f", or lower {source.partition('=')[0]}" if flag else " or unset it"
  print(f"error: the environment ({var}) simulates "
        f"{jax.local_device_count()} CPU devices in this process, but "
        f"{source} needs {n}; raise its count to {n}"
        f"{', unset it' if flag else ''}{lower}.", file=sys.stderr)
  raise SystemExit(2)


def make_parent_dir(path: str) -> None:
  """Creates the folder an output file ``path`` goes in; a bare file name
  (``vs.jsonl``) goes in the current directory, which exists
  (``os.makedirs("")`` raised FileNotFoundError)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def machine_info() -> dict[str, Any]:
  """Date, CPU model, core count, memory, Python/JAX versions, devices."""
  import jax
  info: dict[str, Any] = {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M"),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
      "cpu_cores": os.cpu_count(),
  }
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          info["cpu"] = line.split(":", 1)[1].strip()
          break
    with open("/proc/meminfo") as f:
      kb = int(f.readline().split()[1])
      info["mem_gib"] = round(kb / 2**20, 1)
  except OSError:
    pass
  try:
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  except OSError:
    pass
  return info


def require_decent_dp(note: str = "") -> None:
  """Exits with an install hint unless torch and decent-dp are importable.

  Both are optional (not in requirements.txt, not used by CI); only the
  PyTorch side of the comparison with decent-dp needs them.

  Args:
    note: ends the message (e.g. how to run without them); default ".".
  """
  import importlib.util
  missing = [m for m in ("torch", "decent_dp")
             if importlib.util.find_spec(m) is None]
  if missing:
    raise SystemExit(
        f"missing optional package(s) {', '.join(missing)}: the decent-dp "
        "side needs pip install torch==2.13.0 decent-dp loguru"
        + (note or "."))


def git_revision() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))
                          ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def median(xs):
  return statistics.median(xs)


def timed(fn: Callable[[], Any]) -> float:
  """Seconds taken by ``fn()`` (which must block until its work is done)."""
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def gpt_step(cfg, tx, mesh, *, clip: float = 0.0,
             round_index: int | None = None):
  """Jitted decentralized GPT train step over ``mesh`` (one worker/device).

  Args:
    cfg: ``decentral_jax.models.gpt.GPTConfig``.
    tx: optax transform whose ``update`` runs per worker (may gossip).
    mesh: mesh from ``decentral_jax.parallel.make_mesh``.
    clip: global-norm clip of each worker's gradient (0 = none).
    round_index: if given, passed to ``tx.update`` so that only that gossip
      round is compiled (no ``lax.switch``).

  Returns:
    ``step(params, opt_state, tokens) -> (params, opt_state, loss)`` with
    stacked per-worker ``params``/``opt_state`` (donated) and ``tokens`` int32
    [n, B, T+1]; ``loss`` is float32 [n] (each worker's mean loss, nats).
  """
  import jax
  import optax
  from decentral_jax import models
  from decentral_jax import parallel

  model = models.GPT(cfg)

  def loss_fn(p, tokens):
    logits = model.apply({"params": p}, tokens[:, :-1])
    return models.lm_loss(logits, tokens[:, 1:])

  def step(p, s, tokens):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens)
    if clip:
      g, _ = optax.clip_by_global_norm(clip).update(g, optax.EmptyState())
    if round_index is None:
      u, s = tx.update(g, s, p)
    else:
      u, s = tx.update(g, s, p, round_index=round_index)
    return optax.apply_updates(p, u), s, loss

  return jax.jit(parallel.per_worker(step, mesh), donate_argnums=(0, 1))


def format_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
  """A Markdown table of ``rows`` restricted to ``cols``."""
  out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
  return "\n".join(out)


def check_flags(parser, args, *, outputs=(), inputs=(), dirs=(),
                rules=()) -> None:
  """Refuses, before any work, what a script's flags cannot do: an output
  file (``outputs``) or directory (``dirs``) that cannot be written, an
  input file (``inputs``) that cannot be read, and each of ``rules``
  (callables of ``args`` raising ValueError, e.g. a topology the worker
  count does not allow). Flags are named as given (``"--json"``), read
  from ``args`` by their dest; None is "not given" (such a flag's default
  is None, never ``""``), and an empty value is refused: ``--json ''``
  (an unset shell variable) would otherwise run the work and write
  nothing, as :func:`~decentral_jax.tools.flag_types.check_output_file`
  refuses it.

  Raises:
    SystemExit: code 2 after one ``error:`` line (``parser.error``).
  """
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel

  def value(flag):
    got = getattr(args, flag.lstrip("-").replace("-", "_"))
    if got is not None and not str(got).strip():
      raise ValueError(f"{flag} is empty; give a "
                       f"{'directory' if flag in dirs else 'file name'}.")
    return got

  try:
    for flag in outputs:
      flag_types.check_output_file(value(flag), flag)
    for flag in dirs:
      flag_types.check_output_dir(value(flag), flag)
    for flag in inputs:
      flag_types.check_input_file(value(flag), flag)
    for rule in rules:
      rule(args)
  except ValueError as e:
    parser.error(str(e))


REPORT_WHY = "the report only prints the tables of results written before"


def check_report_flags(parser, argv, *, mode: str, reads,
                       why: str = REPORT_WHY) -> None:
  """Refuses, by name, each flag given in a script's report mode (named by
  ``mode``, e.g. ``"--report"``) that the report does not read: the report
  only prints tables from a file written before, so a run flag given with
  it (``--repeats``) would change nothing. ``reads`` lists the long flags
  the report mode reads (its mode flags included); ``argv`` is the command
  line (None: ``sys.argv[1:]``); ``why`` says what the mode does instead.

  Raises:
    SystemExit: code 2 after one ``error:`` line (``parser.error``).
  """
  import sys  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
  given = flag_types.given_flags(parser, sys.argv[1:] if argv is None else argv)
  unread = sorted(given - set(reads) - {"--help"})
  if unread:
    parser.error(
        f"{', '.join(unread)} {'has' if len(unread) == 1 else 'have'} no "
        f"effect {mode}: {why} and reads {', '.join(sorted(reads))}; drop "
        f"{'it' if len(unread) == 1 else 'them'}.")


def write_output(path: str, flag: str, write, **kw) -> None:
  """A script's output written through
  :func:`decentral_jax.tools.flag_types.write_output`: a write the checks
  could not foresee (a full device) is one ``error:`` line naming ``flag``
  and ``path`` (exit code 2), not a traceback."""
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
  flag_types.write_output(path, flag, write, **kw)


def check_topology(flag: str, name: str, n: int, where: str) -> None:
  """Refuses topology ``name`` (given by ``flag``) at ``n`` workers
  (``where`` says whence, e.g. ``"--workers 3"``) when it cannot be built
  (NumPy only, before JAX).

  Raises:
    ValueError: one line naming both flags and the topology's own reason.
  """
  from decentral_jax import topology  # pylint: disable=import-outside-toplevel
  try:
    topology.make(name, n)
  except ValueError as e:
    raise ValueError(f"{flag} {name} at {where}: {e}") from None


def check_comm_dtype(flag: str, name: str) -> None:
  """Refuses a wire dtype the library does not send (not a float of 16
  bits or more; empty: not given).

  Raises:
    ValueError: one line naming ``flag``.
  """
  from decentral_jax import checks  # pylint: disable=import-outside-toplevel
  if name:
    checks.check_comm_dtype(name, flag)


def _field_error(r: dict, fields: dict) -> str | None:
  """Why the record ``r`` lacks a field of ``fields`` (``{key: kind}``,
  each required; a kind of :mod:`decentral_jax.records`, ``"real"`` any
  JSON number (NaN of a diverged run included), a trailing ``?`` allowing
  null, a dict an object with those fields), or None."""
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  for key, kind in fields.items():
    if key not in r:
      return f"misses {key!r} (the keys it must have: {list(fields)})"
    v = r[key]
    if isinstance(kind, dict):
      why = (_field_error(v, kind) if isinstance(v, dict) else
             f"must be an object, got {records.short(v)}")
      if why:
        return f"{key} {why}"
      continue
    kind = kind.rstrip("?")
    if v is None and fields[key].endswith("?"):
      continue
    if kind == "real":
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{key} must be a number, got {records.short(v)}"
      continue
    why = records.value_error(key, v, kind)
    if why:
      return why
  return None


def _refuse_results(damaged, flag: str) -> None:
  import sys  # pylint: disable=import-outside-toplevel
  print(f"error: {flag} {damaged.file}: {damaged.reason}; give the results "
        f"file this script wrote, or another {flag} path.", file=sys.stderr)
  raise SystemExit(2)


def read_rows(path: str, flag: str, fields: dict) -> list[dict]:
  """The rows of a JSON-lines results file a script wrote before (``flag``
  names it), each checked for ``fields`` (:func:`_field_error`) before a
  number of it is used; ``[]`` when ``path`` does not exist. A last line
  cut short (a run killed while appending) is refused too: the next row
  appended would join it.

  Raises:
    SystemExit: code 2 after one ``error:`` line naming ``flag``, the file,
      the line and the key (not JSON lines, a row without a field).
  """
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  got = records.read_jsonl(path, lambda r: _field_error(r, fields))
  if not isinstance(got, records.Damaged) and got.torn:  # an append joins it
    got = records.Damaged(path, f"line {got.torn}: not a JSON record (cut "
                          "short, without its newline); remove that line")
  if isinstance(got, records.Damaged):
    if got.missing:
      return []
    _refuse_results(got, flag)
  return got.records


def read_document(path: str, flag: str, fields: dict,
                  row_fields: dict | None = None) -> dict:
  """The JSON object of a results file a script wrote before, checked for
  ``fields`` (:func:`_field_error`) and, with ``row_fields``, each entry of
  its ``"rows"`` list (``fields`` names it a ``"list"``; not empty) for
  those.

  Raises:
    SystemExit: code 2 after one ``error:`` line naming ``flag``, the file
      and the key.
  """
  from decentral_jax import records  # pylint: disable=import-outside-toplevel
  got = records.read_json(path)
  if not isinstance(got, records.Damaged):
    why = (_field_error(got, fields) if isinstance(got, dict) else
           f"must be a JSON object with {list(fields)}, got "
           f"{records.short(got)}")
    if not why and row_fields and not got.get("rows"):
      why = "rows must be a non-empty list of the rows of a run"
    for i, row in enumerate(got.get("rows") if row_fields and not why
                            else []):
      why = (_field_error(row, row_fields) if isinstance(row, dict)
             else f"must be an object, got {records.short(row)}")
      if why:
        why = f"rows[{i}] {why}"
        break
    if why:
      got = records.Damaged(path, why)
  if isinstance(got, records.Damaged):
    _refuse_results(got, flag)
  return got
