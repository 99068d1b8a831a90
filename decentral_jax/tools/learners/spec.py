"""The run a synchronizer and its learners agree on (:class:`RunSpec`).

A learner is refused at join unless every field of its
:meth:`RunSpec.fingerprint` (model, method and data sharding) equals the
synchronizer's; the message names the first field that differs. A
synchronizer's checkpoint records the run's :meth:`RunSpec.trajectory`
(every field but the learner count, ``periods`` and the scheduling,
:data:`RESUME_FREE`), and a resume by another run is refused
(:func:`check_resume`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re

from decentral_jax import checks

MODES = ("sync", "decoupled")
#: The most fragments (the one-program method's
#: ``optim.streaming_sync.MAX_FRAGMENTS``; this module does not load JAX).
MAX_FRAGMENTS = 2**16
INNER = ("sgd", "adamw")
#: The problems (``problems.NAMES``; this module does not load JAX) and the
#: ``problem_args`` each takes: key -> (kind, least, most), kind ``int``,
#: ``real`` (finite), ``str`` (non-empty) or ``strs`` (a tuple of strings).
PROBLEM_ARGS = {
    "quadratic": {"seed": ("int", 0, 2**32 - 1), "noise": ("real", 0.0, 1e3)},
    "gpt": {"seed": ("int", 0, 2**32 - 1),
            **{k: ("int", 1, 2**16) for k in ("n_layer", "n_embd", "n_head",
                                              "context", "batch")}},
    "runner": {"config": ("str", None, None),
               "overrides": ("strs", None, None)}}
#: The largest inner_lr / outer_lr, the runner's bound on learning rates
#: (``runner.field_rules.MAX_LR``).
MAX_LR = 1e3
OUTER = ("nesterov", "delayed_nesterov")
#: The most seconds a learner may sleep after an inner step (a day, the
#: bound of the command's other seconds flags; ``time.sleep`` overflows far
#: beyond it).
MAX_SLEEP_S = 86400.0


# Fields a resumed run may change: the learner count (learners of a former,
# larger K leave) and the scheduling; every other field defines the
# trajectory (RunSpec.trajectory).
RESUME_FREE = ("shards", "periods", "mode", "quorum", "grace_s",
               "max_staleness", "dynamic_updates", "sleep_s", "keep_state")


# Trajectory fields added after checkpoints first recorded their run: one
# without such a field was written before it existed and ran its default.
ADDED = ("inner_schedule",)


class JoinRefused(ValueError):
  """A learner whose run does not match the synchronizer's."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run of decoupled learners.

  Attributes:
    problem: the model and data (:data:`~decentral_jax.tools.learners.
      problems.NAMES`).
    problem_args: ``(key, value)`` pairs for the problem (sizes, seed).
    shards: data shards = learner ids ``0 .. shards - 1`` (learner ``i``
      reads shard ``i``).
    sync_every: the sync period ``H`` in inner steps.
    periods: merged periods (outer steps) the run ends after.
    inner: inner optimizer, ``"sgd"`` or ``"adamw"``; with ``problem=
      "runner"`` the config's ``optimizer.name`` (the problem builds it).
    inner_lr: its learning rate (``"runner"``: the schedule's peak,
      ``schedule.peak_lr``).
    inner_schedule: the learning-rate schedule by inner step: ``"constant"``
      (``inner_lr`` throughout; the only one without a runner config), or
      a runner config's schedule in words (``runner_problem.
      schedule_text``).
    outer_lr, outer_momentum: the outer Nesterov SGD (DiLoCo's 0.7, 0.9).
    mode: ``"sync"`` (every active learner's pseudo-gradient of the period,
      as DiLoCo) or ``"decoupled"`` (Decoupled DiLoCo: quorum and grace).
    quorum: learners' pseudo-gradients needed before a merge (sync mode:
      also every active learner's; ``shards`` waits for all to join).
    grace_s: decoupled mode: seconds the synchronizer waits after the
      quorum for the other active learners.
    max_staleness: decoupled mode: a pseudo-gradient computed from ``theta``
      more than this many merges old is dropped (logged).
    dynamic_updates: Dynamic Local Updates: learner ``w`` takes
      ``H_w = max(1, floor(v_w / v_max * H))`` inner steps per period
      (``v`` = measured inner steps per second).
    sleep_s: per learner seconds slept after each inner step (an
      artificially slow learner); missing entries are 0.
    compressor: the format pseudo-gradients travel in
      (:class:`decentral_jax.comm.compress.Compressor`: ``none``, ``int8``,
      ``fp8``, ``int4``, ``fp4``, ``topk``), with error feedback at the
      learner.
    block: the compressor's values per scale (or per top-k chunk).
    fragments: Streaming DiLoCo's ``P``: ``theta`` is cut into this many
      fragments (the one-program method's partition), each sent, merged
      and stepped by its own outer state at its own offset ``p H // P``
      (``1 <= P <= sync_every``, at most the number of leaves).
    overlap_steps: Streaming DiLoCo's ``tau``: a fragment's merge is taken
      ``tau`` inner steps after its send (``tau * P < sync_every``).
    merge_alpha: Streaming DiLoCo's ``alpha`` in ``[0, 1]``: at a merge
      ``x_p <- alpha x_p + (1 - alpha) theta_p``.
    outer: the outer optimizer, ``"nesterov"`` (DiLoCo's) or
      ``"delayed_nesterov"`` (Async Local-SGD's Delayed Nesterov,
      :mod:`decentral_jax.tools.learners.outer`).
    delay_buffer: Delayed Nesterov's buffer ``N`` (merges per momentum
      step); 1 with ``outer="nesterov"``.
    keep_state: a learner sends its inner optimizer state and its error
      feedback residual to the synchronizer before each pseudo-gradient
      (when it has any), so that a restarted learner starts from them
      instead of afresh (costs their bytes per period: ``state_bytes`` in
      the learner's status).
  """
  problem: str = "quadratic"
  problem_args: tuple = ()
  shards: int = 2
  sync_every: int = 4
  periods: int = 4
  inner: str = "sgd"
  inner_lr: float = 0.1
  inner_schedule: str = "constant"
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  mode: str = "sync"
  quorum: int = 1
  grace_s: float = 0.5
  max_staleness: int = 2
  dynamic_updates: bool = False
  sleep_s: tuple = ()
  compressor: str = "none"
  block: int = 256
  fragments: int = 1
  overlap_steps: int = 0
  merge_alpha: float = 0.0
  outer: str = "nesterov"
  delay_buffer: int = 1
  keep_state: bool = True

  def __post_init__(self):
    """Checks the fields.

    Raises:
      ValueError: a field out of range, naming it.
    """
    for name in ("shards", "sync_every", "periods", "quorum"):
      checks.check_int(f"RunSpec.{name}", getattr(self, name), minimum=1,
                       maximum=checks.INT32_MAX)
    if self.periods * self.sync_every > checks.INT32_MAX:
      raise ValueError(
          f"RunSpec.periods={self.periods} x sync_every={self.sync_every} "
          f"inner steps exceed {checks.INT32_MAX} (the step counters are "
          "int32); use fewer periods or a shorter sync period.")
    if self.mode not in MODES:
      raise ValueError(f"RunSpec.mode must be one of {MODES}, got "
                       f"{self.mode!r}.")
    check_inner(self)
    if self.quorum > self.shards:
      raise ValueError(f"RunSpec.quorum={self.quorum} exceeds shards="
                       f"{self.shards}; use quorum <= shards.")
    checks.check_float("RunSpec.grace_s", self.grace_s, minimum=0.0,
                       maximum=MAX_SLEEP_S)
    checks.check_int("RunSpec.max_staleness", self.max_staleness, minimum=0,
                     maximum=checks.INT32_MAX)
    self.codec()  # checks compressor and block
    check_numbers(self)
    if len(self.sleep_s) > self.shards:
      raise ValueError(f"RunSpec.sleep_s has {len(self.sleep_s)} entries for "
                       f"{self.shards} shards.")
    check_outer_and_fragments(self)
    check_problem(self)

  @property
  def streaming(self) -> bool:
    """Whether the learners run Streaming DiLoCo's fragment schedule
    (``fragments > 1``, ``overlap_steps > 0`` or ``merge_alpha > 0``)."""
    return self.fragments > 1 or self.overlap_steps > 0 or self.merge_alpha > 0

  def codec(self):
    """The :class:`~decentral_jax.comm.compress.Compressor` of the run.

    Raises:
      ValueError: an unknown format or a bad block, naming the field.
    """
    from decentral_jax.comm import compress  # pylint: disable=import-outside-toplevel
    try:
      return compress.Compressor(self.compressor, self.block)
    except ValueError as e:
      raise ValueError(f"RunSpec.compressor/block: {e}") from None

  def sleep_of(self, learner: int) -> float:
    """Seconds learner ``learner`` sleeps after each inner step."""
    return float(self.sleep_s[learner]) if learner < len(self.sleep_s) else 0.0

  def fingerprint(self) -> dict:
    """The fields a learner must share with the synchronizer: the model
    (``problem``, ``problem_args``), the method (``inner``, ``inner_lr``,
    ``inner_schedule``, ``sync_every``, ``mode``, ``dynamic_updates``,
    ``compressor``, ``block``) and the data sharding
    (``shards``)."""
    return {"problem": self.problem, "problem_args": tuple(self.problem_args),
            "shards": self.shards, "inner": self.inner,
            "inner_lr": self.inner_lr,
            "inner_schedule": self.inner_schedule,
            "sync_every": self.sync_every,
            "mode": self.mode, "dynamic_updates": self.dynamic_updates,
            "compressor": self.compressor, "block": self.block,
            "fragments": self.fragments, "overlap_steps": self.overlap_steps,
            "merge_alpha": self.merge_alpha, "outer": self.outer,
            "delay_buffer": self.delay_buffer}

  def trajectory(self) -> dict:
    """The fields that define the run's trajectory (every field but
    :data:`RESUME_FREE`), as JSON values: what a synchronizer's checkpoint
    records and a resume must match (:func:`check_resume`)."""
    return json.loads(json.dumps(
        {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in RESUME_FREE}, default=float))


def check_resume(saved, ours: dict, where: str) -> None:
  """Refuses to resume checkpoint ``where``, written by a run whose
  :meth:`RunSpec.trajectory` was ``saved``, with the run ``ours``.

  A field of :data:`ADDED` that ``saved`` lacks (a checkpoint written
  before the field existed) counts as its :class:`RunSpec` default.

  Raises:
    ValueError: the first field that differs, with both values and the fix
      (a new checkpoint directory; ``--periods`` to extend a run).
  """
  if not isinstance(saved, dict):
    raise ValueError(f"{where}: its run is {saved!r}, not a JSON object; "
                     "start a new checkpoint directory (or --workdir).")
  defaults = RunSpec().trajectory()
  for field in [*ours, *(k for k in saved if k not in ours)]:
    a = saved.get(field, defaults[field] if field in ADDED else "<missing>")
    b = ours.get(field, "<missing>")
    if a != b:
      name, a, b = _narrow(field, a, b)
      raise ValueError(
          f"{where} was written by a run with {name}={a!r}, this run has "
          f"{b!r}; resume it with the same run (only the learner count, "
          "--periods and the scheduling flags may change: --periods extends "
          "it) or start a new checkpoint directory (--checkpoint-dir, or a "
          "new --workdir).")


def _narrow(field: str, a, b):
  """``(name, a, b)``: ``problem_args``' first differing argument, and of
  a list argument (a config's overrides) only the items not in both."""
  try:
    a_args, b_args = dict(a), dict(b)
  except (TypeError, ValueError):
    return field, a, b
  for key in [*b_args, *(k for k in a_args if k not in b_args)]:
    x, y = a_args.get(key, "<missing>"), b_args.get(key, "<missing>")
    if x != y:
      if isinstance(x, list) and isinstance(y, list):
        x, y = [v for v in x if v not in y], [v for v in y if v not in x]
      return f"{field}.{key}", x, y
  return field, a, b


def _real(v) -> bool:
  """A finite real number (NumPy scalars too), not a boolean."""
  return (isinstance(v, numbers.Real) and not isinstance(v, bool)
          and math.isfinite(v))


def check_numbers(run: RunSpec) -> None:
  """Checks ``inner_lr``, ``outer_lr`` (in ``(0, MAX_LR]``), ``outer_momentum``
  (in ``[0, 1)``) and ``sleep_s`` (seconds in ``[0, MAX_SLEEP_S]`` each).

  Raises:
    ValueError: naming the field, its value and its range.
  """
  for name in ("inner_lr", "outer_lr"):
    value = getattr(run, name)
    if not (_real(value) and 0 < value <= MAX_LR):
      raise ValueError(f"RunSpec.{name} must be a finite number > 0 and at "
                       f"most {MAX_LR:g} (the runner's bound on learning "
                       f"rates), got {value!r}.")
  if not (_real(run.outer_momentum) and 0 <= run.outer_momentum < 1):
    raise ValueError("RunSpec.outer_momentum must be a number in [0, 1), got "
                     f"{run.outer_momentum!r}.")
  if not isinstance(run.sleep_s, (tuple, list)) or not all(
      _real(x) and 0 <= x <= MAX_SLEEP_S for x in run.sleep_s):
    raise ValueError("RunSpec.sleep_s must be a tuple of seconds in [0, "
                     f"{MAX_SLEEP_S:g}] (one per learner), got "
                     f"{run.sleep_s!r}.")


def _arg_ok(kind: str, lo, hi, value) -> bool:
  """Whether ``value`` is a ``problem_args`` value of ``kind`` in
  ``[lo, hi]`` (:data:`PROBLEM_ARGS`)."""
  if kind == "str":
    return isinstance(value, str) and bool(value)
  if kind == "strs":
    return isinstance(value, (tuple, list)) and all(
        isinstance(v, str) for v in value)
  if kind == "int" and not (isinstance(value, numbers.Integral)
                            and not isinstance(value, bool)):
    return False
  return _real(value) and lo <= value <= hi


def check_problem(run: RunSpec) -> None:
  """Checks ``problem`` (a key of :data:`PROBLEM_ARGS`) and
  ``problem_args``: ``(key, value)`` pairs, each key once and one the
  problem takes, each value of its kind and range (a NaN ``noise`` made
  every loss NaN).

  Raises:
    ValueError: naming the field (``RunSpec.problem_args.noise``), its value
      and what it may be.
  """
  takes = PROBLEM_ARGS.get(run.problem) if isinstance(run.problem, str) \
      else None
  if takes is None:
    raise ValueError(f"RunSpec.problem must be one of {tuple(PROBLEM_ARGS)}, "
                     f"got {run.problem!r}.")
  pairs = run.problem_args
  if not (isinstance(pairs, (tuple, list)) and all(
      isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str)
      for p in pairs)):
    raise ValueError("RunSpec.problem_args must be a tuple of (key, value) "
                     f"pairs, got {pairs!r}.")
  seen = set()
  for key, value in pairs:
    if key not in takes or key in seen:
      why = "twice" if key in seen else f"for problem {run.problem!r}"
      raise ValueError(f"RunSpec.problem_args has {key!r} {why}; its keys "
                       f"are {', '.join(takes)} (each at most once).")
    seen.add(key)
    kind, lo, hi = takes[key]
    if not _arg_ok(kind, lo, hi, value):
      rule = {"str": "a non-empty string", "strs": "a tuple of strings",
              "int": f"an int in [{lo}, {hi}]"}.get(kind)
      rule = rule or f"a finite number in [{lo:g}, {hi:g}]"
      raise ValueError(f"RunSpec.problem_args.{key} must be {rule}, got "
                       f"{value!r}.")


def check_inner(run: RunSpec) -> None:
  """Checks ``inner`` and ``inner_schedule``: without a runner config
  (``problem != "runner"``) one of :data:`INNER` at a ``"constant"``
  learning rate (the learner builds it from ``inner`` and ``inner_lr``);
  with one, the config's optimizer name and schedule (non-empty strings).

  Raises:
    ValueError: naming the field and what it may be.
  """
  for name in ("inner", "inner_schedule"):
    value = getattr(run, name)
    if not (isinstance(value, str) and value):
      raise ValueError(f"RunSpec.{name} must be a non-empty string, got "
                       f"{value!r}.")
  if run.problem == "runner":
    return
  if run.inner not in INNER:
    raise ValueError(f"RunSpec.inner must be one of {INNER}, got "
                     f"{run.inner!r}.")
  if run.inner_schedule != "constant":
    raise ValueError(f"RunSpec.inner_schedule={run.inner_schedule!r} needs "
                     "problem='runner' (a runner config's schedule); the "
                     "other problems step at a constant inner_lr.")


def check_outer_and_fragments(run: RunSpec) -> None:
  """Checks ``fragments``, ``overlap_steps``, ``merge_alpha``, ``outer`` and
  ``delay_buffer``.

  Raises:
    ValueError: a field out of range, naming it and its range.
  """
  for name, lo, hi in (("fragments", 1, MAX_FRAGMENTS),
                       ("overlap_steps", 0, checks.INT32_MAX),
                       ("delay_buffer", 1, checks.INT32_MAX)):
    checks.check_int(f"RunSpec.{name}", getattr(run, name), minimum=lo,
                     maximum=hi)
  if run.fragments > run.sync_every:
    raise ValueError(f"RunSpec.fragments={run.fragments} exceeds sync_every="
                     f"{run.sync_every}; use 1 <= fragments <= sync_every.")
  if run.overlap_steps * run.fragments >= run.sync_every:
    raise ValueError(
        f"RunSpec.overlap_steps={run.overlap_steps} with fragments="
        f"{run.fragments} needs overlap_steps * fragments < sync_every="
        f"{run.sync_every} (a fragment is merged before the next is sent).")
  if not (_real(run.merge_alpha) and 0 <= run.merge_alpha <= 1):
    raise ValueError(f"RunSpec.merge_alpha must be a number in [0, 1], got "
                     f"{run.merge_alpha!r}.")
  if run.outer not in OUTER:
    raise ValueError(f"RunSpec.outer must be one of {OUTER}, got "
                     f"{run.outer!r}.")
  if run.outer == "nesterov" and run.delay_buffer != 1:
    raise ValueError(f"RunSpec.delay_buffer={run.delay_buffer} needs outer="
                     "'delayed_nesterov' (Nesterov SGD has no buffer).")
  for name in ("keep_state", "dynamic_updates"):
    checks.check_bool(f"RunSpec.{name}", getattr(run, name))
  if run.streaming and run.dynamic_updates:
    raise ValueError("RunSpec.dynamic_updates with fragments/overlap_steps/"
                     "merge_alpha: a fragment schedule has one sync period "
                     "for every learner; use one of them.")


def check_join(learner: int, ours: dict, theirs: dict, shards: int) -> None:
  """Refuses a learner whose fingerprint differs from ``ours``.

  Raises:
    JoinRefused: a learner id outside ``[0, shards)`` or the first field
      that differs, with both values.
  """
  if not isinstance(learner, int) or not 0 <= learner < shards:
    raise JoinRefused(f"learner {learner!r} refused at join: learner ids are "
                      f"0..{shards - 1} (one per data shard).")
  for field, value in ours.items():
    if field not in theirs or theirs[field] != value:
      raise JoinRefused(
          f"learner {learner} refused at join: field {field!r} is "
          f"{theirs.get(field, '<missing>')!r} at the learner but {value!r} "
          "at the synchronizer; start the learner with the synchronizer's "
          "run spec.")


#: The flag of the ``learners`` command that sets each RunSpec field: field
#: -> (without --config, with --config); the command tells a refusal in
#: RunSpec's words in its flags' (:func:`flag_words`). None: no flag sets it
#: (a fixed default).
FIELD_FLAGS = {
    "shards": ("--learners",) * 2, "periods": ("--periods",) * 2,
    "mode": ("--mode",) * 2, "quorum": ("--quorum",) * 2,
    "grace_s": ("--grace",) * 2,
    "dynamic_updates": ("--dynamic-updates",) * 2,
    "sleep_s": ("--sleep",) * 2, "fragments": ("--fragments",) * 2,
    "overlap_steps": ("--overlap-steps",) * 2,
    "merge_alpha": ("--merge-alpha",) * 2, "outer": ("--outer",) * 2,
    "delay_buffer": ("--delay-buffer",) * 2,
    "keep_state": ("--drop-state",) * 2,
    "problem": ("--problem", "--config"),
    "sync_every": ("--sync-every", "--config.sync_every"),
    "inner": ("--inner", "--config.optimizer.name"),
    "inner_lr": ("--inner-lr", "--config.schedule.peak_lr"),
    "outer_lr": (None, "--config.outer_optimizer.lr"),
    "outer_momentum": (None, "--config.outer_optimizer.momentum"),
    "compressor": (None, "--config.compression.format"),
    "block": (None, "--config.compression.block")}
# Field names that are also words of prose: named as fields only as
# "RunSpec.<name>" or "<name>=".
_PROSE = ("periods", "mode", "outer", "inner", "problem", "compressor",
          "block")
_FIELD = re.compile(r"(RunSpec\.)?\b([a-z_]+)\b(?=(=?))")


def flag_words(message: str, config: bool) -> str:
  """``message``, a :class:`RunSpec` refusal, with each field it names
  replaced by the flag that sets it (:data:`FIELD_FLAGS`; ``config``: the
  run has ``--config``), e.g. ``RunSpec.quorum=5 exceeds shards=2`` ->
  ``--quorum=5 exceeds --learners=2``."""
  def flag(m):
    prefix, name, eq = m.groups()
    got = FIELD_FLAGS.get(name, (None, None))[config]
    if got is None or not (prefix or eq or name not in _PROSE):
      return m.group(0)
    return got
  return _FIELD.sub(flag, message)
