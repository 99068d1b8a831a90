"""Model size, dtypes, buckets and compute distribution of one iteration.

Units: seconds (``_s``), bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib

import ml_dtypes  # noqa: F401  (registers 'bfloat16' etc. with numpy)
import numpy as np
from scipy import special

from decentral_jax import checks
from decentral_jax import layout_modes
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import MAX_WORKERS


#: The largest parameter count the model prices (4 PB of float32).
MAX_PARAMS = 1e15
#: The most buckets a workload's parameter message is cut into: the
#: simulator's work grows with them (1e12 float32 parameters in 25 MiB
#: buckets, 152588 of them, took over a minute), and no real job has more.
MAX_BUCKETS = 4096
# Largest bucket size (MiB) a flag or a method spec's bucket_MiB takes.
MAX_BUCKET_MIB = 1e9
#: The smallest bucket, one byte (a subnormal size overflowed the count).
MIN_BUCKET_MIB = 2.0 ** -20
#: Longest compute time (seconds) a workload field takes: a day, the
#: cluster file's bound (``forward_s=1e300`` priced as inf or NaN).
MAX_SECONDS = 86400.0
#: Largest ``compute_cv`` (the cluster file's bound).
MAX_COMPUTE_CV = 1e3


def bucket_count(param_count: float, itemsize: float,
                 bucket_bytes: float) -> int:
  """Buckets of ``bucket_bytes`` bytes that ``param_count`` values of
  ``itemsize`` bytes fill (at least one)."""
  return max(1, math.ceil(param_count * itemsize / bucket_bytes))


def number_tuple(name: str, value, rule: str, *, min_size: int = 1,
                 max_size: int | None = None, minimum: float = 0.0,
                 maximum: float = 1.0, open_min: bool = False
                 ) -> tuple[float, ...]:
  """``value`` as a tuple of Python floats, or one ValueError naming ``name``.

  Args:
    name: the field, as the user spells it.
    value: a list, tuple or 1-D array of ``min_size`` to ``max_size`` (None:
      no limit) finite real numbers (ints or floats, not bools or strings)
      in ``[minimum, maximum]`` (``open_min``: ``> minimum``).
    rule: what the field must be, for the message.

  Raises:
    ValueError: ``"{name} must be {rule}, got {value!r}."`` for a scalar, a
      string, a nested or empty sequence, a wrong length, NaN, inf, or a
      value out of range.
  """
  if isinstance(value, (list, tuple)):
    items = list(value)
  elif (hasattr(value, "shape") and hasattr(value, "dtype")
        and np.ndim(value) == 1):
    items = list(np.asarray(value))
  else:
    items = None
  if (items is None or len(items) < min_size
      or (max_size is not None and len(items) > max_size)
      or not all(checks.is_number(x) and (minimum < float(x) if open_min
                                          else minimum <= float(x))
                 and float(x) <= maximum for x in items)):
    raise ValueError(f"{name} must be {rule}, got {reprlib.repr(value)}.")
  return tuple(float(x) for x in items)


def check_in_flight(value) -> tuple[float, float] | None:
  """``Workload.gossip_in_flight`` checked: None or two fractions in [0, 1].

  Raises:
    ValueError: not None and not a pair of finite numbers in [0, 1]
      (:func:`number_tuple`).
  """
  if value is None:
    return None
  return number_tuple("gossip_in_flight", value, "None or (forward, "
                      "backward) fractions in [0, 1]", min_size=2,
                      max_size=2)


def wire_dtype(where: str, name) -> np.dtype:
  """``np.dtype(name)`` if the library can send values of that dtype.

  The rule of :func:`decentral_jax.checks.check_comm_dtype` (width and byte
  order through :func:`decentral_jax.checks.check_wire_width_and_order`): a
  floating dtype (bfloat16 included) of 2 to 8 bytes in native byte order (8-bit
  floats travel only block-scaled: ``compress=fp8``). ``name`` is a dtype
  name, a dtype or a scalar type (a number such as ``np.float32(2.5)``,
  whose dtype NumPy would take, is refused). ``where`` names the
  field or flag in the one-line ValueError raised otherwise (an integer,
  complex, unknown, 8-bit or byte-swapped name; NumPy parses some strings
  such as ``",,"`` as code, which is caught too).
  """
  try:  # a name, dtype or scalar type; np.dtype(np.float32(2.5)) is float32
    dt = np.dtype(name) if isinstance(name, (str, np.dtype, type)) else None
  except (TypeError, ValueError, SyntaxError):
    dt = None
  if (dt is None or (dt.kind != "f" and "float" not in dt.name)
      or dt.itemsize > 8):
    raise ValueError(f"{where} {name!r} is not a floating dtype name (values "
                     "on the wire are floats); use e.g. float32 or bfloat16.")
  checks.check_wire_width_and_order(f"{where} {name!r}", dt,
                                   "compress=fp8 or fp4")
  return dt


@dataclasses.dataclass(frozen=True)
class Workload:
  """Model size and per-worker compute time of one training iteration.

  Attributes:
    param_count: number of parameters, in ``[0, MAX_PARAMS]`` (the message
      is ``param_count`` times the dtype size: gradients for All-Reduce,
      parameters for gossip).
    forward_s: mean forward time per iteration and worker (seconds; this
      and every time field in ``[0, MAX_SECONDS]``, a day).
    backward_s: mean backward time (seconds).
    optimizer_s: optimizer step time (seconds), spread over buckets.
    compute_cv: coefficient of variation of forward + backward (Gaussian,
      independent per worker and step; truncated at 5% of the mean), in
      ``[0, MAX_COMPUTE_CV]``.
    compute_samples_s: optional samples of forward + backward time (a list,
      tuple or 1-D array of seconds, at least 2, each finite, > 0 and at
      most a day: they are divided by their mean; stored as a tuple); when
      given they replace ``forward_s + backward_s`` and ``compute_cv``,
      and ``forward_s : backward_s`` only sets the split.
    grad_dtype: dtype of communicated gradients (numpy name, e.g. "float32",
      a dtype or a scalar type; :func:`wire_dtype`).
    param_dtype: dtype of communicated parameters.
    bucket_bytes: bucket capacity (bytes, at least 1 and at most
      ``MAX_BUCKET_MIB`` MiB) used when ``bucket_shares`` is None; 25 MiB is
      the PyTorch DDP and Decent-DP default. The buckets it cuts are at
      most ``MAX_BUCKETS``.
    bucket_shares: optional fraction of the message in each bucket, in the
      order buckets become ready (1 to ``MAX_BUCKETS`` finite fractions in
      (0, 1], summing to 1 within 1e-6; stored as a tuple).
    bucket_ready: optional fraction of the backward after which each bucket
      is ready (1 to ``MAX_BUCKETS`` finite fractions in [0, 1],
      non-decreasing, last = 1 within 1e-9, as many as ``bucket_shares``;
      without ``bucket_shares`` the buckets are equal); default: cumulative
      shares.
    devices_per_worker: devices ``D`` of one worker (``config.
      devices_per_worker``, an int in ``[1, MAX_WORKERS]``), all in one
      node; the compute times are the worker's (its ``D`` devices
      together). Default 1.
    worker_layout: how a worker of ``D > 1`` devices holds its state
      (``config.worker_layout``): ``"fsdp"`` (parameters split over its
      devices; each forward/backward all-gathers the parameters and
      reduce-scatters the gradients inside the worker; a one-peer gossip
      round sends ``param_bytes / D`` per device) or ``"data"`` (replicated;
      gradients all-reduced inside the worker; every device sends the full
      parameters). See :mod:`decentral_jax.runtime_model.worker_devices`.
    gossip_in_flight: optional ``(forward, backward)`` fractions of the
      two passes that run while the compiled step's gossip is in flight
      (``OverlapReport.in_flight_fractions()`` of a deviceless GPU
      compile); overlapped gossip is then hidden only behind that part of
      the step (:mod:`decentral_jax.runtime_model.in_flight`).
      Default None: behind the whole next forward and backward
      (Decent-DP's pipeline).

  Raises:
    ValueError: a field of another type or out of its domain (a scalar or
      string for a sequence field, NaN, inf, a bool, a number for a dtype),
      one line naming the field; checked at construction.
  """

  param_count: float
  forward_s: float
  backward_s: float
  optimizer_s: float = 0.0
  compute_cv: float = 0.0
  compute_samples_s: tuple[float, ...] | None = None
  grad_dtype: str = "float32"
  param_dtype: str = "float32"
  bucket_bytes: float = 25 * 2**20
  bucket_shares: tuple[float, ...] | None = None
  bucket_ready: tuple[float, ...] | None = None
  devices_per_worker: int = 1
  worker_layout: str = "fsdp"
  gossip_in_flight: tuple[float, float] | None = None

  def __post_init__(self):
    object.__setattr__(self, "gossip_in_flight",
                       check_in_flight(self.gossip_in_flight))
    checks.check_float("param_count", self.param_count, minimum=0)
    if self.param_count > MAX_PARAMS:
      raise ValueError(f"param_count must be at most {MAX_PARAMS:g}, got "
                       f"{self.param_count:g}.")
    for name in ("forward_s", "backward_s", "optimizer_s"):
      checks.check_float(name, getattr(self, name), minimum=0,
                         maximum=MAX_SECONDS)
    checks.check_float("compute_cv", self.compute_cv, minimum=0,
                       maximum=MAX_COMPUTE_CV)
    checks.check_float("bucket_bytes", self.bucket_bytes, minimum=1)
    if self.bucket_bytes > MAX_BUCKET_MIB * 2**20:
      raise ValueError(f"bucket_bytes must be at most {MAX_BUCKET_MIB:g} MiB, "
                       f"got {self.bucket_bytes:g} bytes.")
    checks.check_int("devices_per_worker", self.devices_per_worker, minimum=1,
                     maximum=MAX_WORKERS)
    if (not isinstance(self.worker_layout, str)
        or self.worker_layout not in layout_modes.MODES):
      raise ValueError(f"worker_layout must be one of {layout_modes.MODES}, "
                       f"got {self.worker_layout!r}.")
    for name in ("grad_dtype", "param_dtype"):
      wire_dtype(name, getattr(self, name))
    self._check_sequences()
    self._check_size()

  def _check_sequences(self) -> None:
    """``compute_samples_s``, ``bucket_shares`` and ``bucket_ready`` checked
    (:func:`number_tuple`) and stored as tuples of floats."""
    if self.compute_samples_s is not None:
      # the samples are divided by their mean: a step takes some time
      object.__setattr__(self, "compute_samples_s", number_tuple(
          "compute_samples_s", self.compute_samples_s, ">= 2 finite times > 0 "
          f"in seconds (each at most {MAX_SECONDS:g})", min_size=2,
          maximum=MAX_SECONDS, open_min=True))
    rule = f"1 to {MAX_BUCKETS} fractions in (0, 1] summing to 1"
    if self.bucket_shares is not None:
      sh = number_tuple("bucket_shares", self.bucket_shares, rule,
                        max_size=MAX_BUCKETS, open_min=True)
      if abs(math.fsum(sh) - 1) > 1e-6:
        raise ValueError(f"bucket_shares must be {rule}, got "
                         f"{reprlib.repr(self.bucket_shares)} (sum "
                         f"{math.fsum(sh):g}).")
      object.__setattr__(self, "bucket_shares", sh)
    if self.bucket_ready is None:
      return
    size = (len(self.bucket_shares) if self.bucket_shares is not None
            else None)
    rule = ("non-decreasing fractions of the backward in [0, 1] ending at 1, "
            + (f"one per bucket ({size})" if size else
               f"one per bucket (1 to {MAX_BUCKETS})"))
    rd = number_tuple("bucket_ready", self.bucket_ready, rule,
                      min_size=size or 1, max_size=size or MAX_BUCKETS)
    if any(b < a for a, b in zip(rd, rd[1:])) or abs(rd[-1] - 1) > 1e-9:
      raise ValueError(f"bucket_ready must be {rule}, got "
                       f"{reprlib.repr(self.bucket_ready)}.")
    object.__setattr__(self, "bucket_ready", rd)

  def _check_size(self) -> None:
    """``param_count`` (at most :data:`MAX_PARAMS`) of gradients or
    parameters in at most :data:`MAX_BUCKETS` buckets of ``bucket_bytes``
    (when neither ``bucket_shares`` nor ``bucket_ready`` sets them)."""
    if self.bucket_shares is not None or self.bucket_ready is not None:
      return
    itemsize = max(np.dtype(self.grad_dtype).itemsize,
                   np.dtype(self.param_dtype).itemsize)
    nb = bucket_count(self.param_count, itemsize, self.bucket_bytes)
    if nb > MAX_BUCKETS:
      raise ValueError(
          f"param_count {self.param_count:g} of {itemsize}-byte values in "
          f"buckets of {self.bucket_bytes / 2**20:g} MiB makes {nb} buckets, "
          f"more than the {MAX_BUCKETS} the runtime model handles; lower "
          "param_count or raise the bucket size.")

  @property
  def grad_bytes(self) -> float:
    return float(self.param_count) * np.dtype(self.grad_dtype).itemsize

  @property
  def param_bytes(self) -> float:
    return float(self.param_count) * np.dtype(self.param_dtype).itemsize

  @property
  def compute_mean_s(self) -> float:
    """Mean forward + backward time (seconds)."""
    if self.compute_samples_s is not None:
      return float(np.mean(self.compute_samples_s))
    return self.forward_s + self.backward_s

  @property
  def compute_std_s(self) -> float:
    """Standard deviation of forward + backward (seconds)."""
    if self.compute_samples_s is not None:
      return float(np.std(self.compute_samples_s))
    return self.compute_cv * self.compute_mean_s

  def buckets(self, message_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """Bucket sizes (bytes, float64 [nb]) and ready fractions (float64 [nb])."""
    if self.bucket_shares is not None:
      shares = np.asarray(self.bucket_shares, float)
    else:
      nb = (len(self.bucket_ready) if self.bucket_ready is not None
            else max(1, math.ceil(message_bytes / self.bucket_bytes)))
      shares = np.full(nb, 1.0 / nb)
    ready = (np.asarray(self.bucket_ready, float) if self.bucket_ready
             is not None else np.cumsum(shares))
    ready[-1] = 1.0
    return shares * message_bytes, ready

  def compute_factors(self, steps: int, n: int, seed: int) -> np.ndarray:
    """Per-step, per-worker multipliers of the mean compute, float64 [steps, n]."""
    rng = np.random.default_rng(seed)
    if self.compute_samples_s is not None:
      s = np.asarray(self.compute_samples_s, float)
      return rng.choice(s, size=(steps, n)) / s.mean()
    z = rng.standard_normal((steps, n))
    return np.maximum(1.0 + self.compute_cv * z, 0.05)

  def expected_max_excess(self, m: int) -> float:
    """``E[max of m compute draws] - mean`` (seconds) for one iteration."""
    if m <= 1:
      return 0.0
    if self.compute_samples_s is not None:
      x = np.sort(np.asarray(self.compute_samples_s, float))
      j = np.arange(1, x.size + 1) / x.size
      w = j**m - (j - 1.0 / x.size)**m
      return float(np.sum(w * x) - x.mean())
    return self.compute_cv * self.compute_mean_s * expected_max_normal(m)


#: Most iterations one simulation runs (``simulate(steps=)``, ``predict
#: --steps``): its compute draws take 8 bytes per worker and step.
MAX_SIMULATED_STEPS = 100_000

_ABSENT = object()


def check_model_arguments(*, c=_ABSENT, w=_ABSENT, steps=_ABSENT,
                          warmup=_ABSENT, seed=_ABSENT) -> None:
  """The argument rule of the runtime model's public functions; only the
  arguments given are checked.

  Args:
    c: a :class:`~decentral_jax.runtime_model.costs.Cluster`.
    w: a :class:`Workload`.
    steps: simulated iterations, an int in ``[1, MAX_SIMULATED_STEPS]``.
    warmup: iterations discarded, an int in ``[0, steps)``.
    seed: the seed of the compute draws, an int >= 0 (not None: the same
      seed gives the same draws).

  Raises:
    ValueError: naming the first bad argument and what it must be.
  """
  if c is not _ABSENT:
    checks.check_type("c", c, Cluster, "a runtime_model.Cluster")
  if w is not _ABSENT:
    checks.check_type("w", w, Workload, "a runtime_model.Workload")
  if steps is not _ABSENT:
    checks.check_int("steps", steps, minimum=1, maximum=MAX_SIMULATED_STEPS)
  if warmup is not _ABSENT:
    checks.check_int("warmup", warmup, minimum=0)
    if steps is not _ABSENT and warmup >= steps:
      raise ValueError(f"need 0 <= warmup < steps, got warmup={warmup}, "
                       f"steps={steps}.")
  if seed is not _ABSENT:
    checks.check_int("seed", seed, minimum=0)


def expected_max_normal(m: int) -> float:
  """``E[max(Z_1..Z_m)]`` for i.i.d. standard normals (numerical integral).

  Args:
    m: an int in ``[1, MAX_WORKERS]`` (4096; the integration grid, x in
      [-9, 9], holds for these counts).

  Raises:
    ValueError: ``m`` not an int in that range.
  """
  m = checks.check_int("m", m, minimum=1, maximum=MAX_WORKERS)
  if m <= 1:
    return 0.0
  x = np.linspace(-9.0, 9.0, 8001)
  cdf = special.ndtr(x)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  return float(np.trapezoid(x * m * pdf * cdf**(m - 1), x))


def coupling_excess(m: int, slack_sigmas: float) -> float:
  """``E[(max(Z_1..Z_{m-1}) - Z_0 - s)^+]`` for i.i.d. standard normals.

  The expected wait (in units of the compute standard deviation) of a worker
  for the slowest of the ``m - 1`` other members of its group when its
  communication has ``s`` standard deviations of slack. ``m = n``, ``s = 0``
  is All-Reduce's barrier minus the worker's own time.

  Args:
    m: the group size, an int in ``[1, MAX_WORKERS]``.
    slack_sigmas: ``s``, a finite number (below 0 counts as 0; rounded to
      3 decimals).

  Raises:
    ValueError: ``m`` or ``slack_sigmas`` out of range, naming it.
  """
  m = checks.check_int("m", m, minimum=1, maximum=MAX_WORKERS)
  s = checks.check_float("slack_sigmas", slack_sigmas)
  return _coupling_excess(m, max(0.0, round(s, 3)))


@functools.lru_cache(maxsize=4096)
def _coupling_excess(m: int, s: float) -> float:
  """:func:`coupling_excess` of checked arguments (cached)."""
  if m <= 1:
    return 0.0
  x = np.linspace(-8.0, 8.0, 321)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  y = np.linspace(s, s + 12.0, 241)
  cdf_y = np.trapezoid(pdf * special.ndtr(x[None, :] + y[:, None])**(m - 1),
                       x, axis=1)
  return float(np.trapezoid(1.0 - cdf_y, y))
