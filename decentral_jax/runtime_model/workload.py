"""Model size, dtypes, buckets and compute distribution of one iteration.

Units: seconds (``_s``), bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes  # noqa: F401  (registers 'bfloat16' etc. with numpy)
import numpy as np
from scipy import special

from decentral_jax import checks
from decentral_jax import layout_modes


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


def bucket_count(param_count: float, itemsize: float,
                 bucket_bytes: float) -> int:
  """Buckets of ``bucket_bytes`` bytes that ``param_count`` values of
  ``itemsize`` bytes fill (at least one)."""
  return max(1, math.ceil(param_count * itemsize / bucket_bytes))


def check_in_flight(value) -> tuple[float, float] | None:
  """``Workload.gossip_in_flight`` checked: None or two fractions in [0, 1].

  Raises:
    ValueError: not None and not a pair of finite numbers in [0, 1].
  """
  if value is None:
    return None
  try:
    pair = tuple(float(v) for v in value)
  except (TypeError, ValueError):
    pair = ()
  if len(pair) != 2 or not all(math.isfinite(v) and 0.0 <= v <= 1.0
                               for v in pair):
    raise ValueError(f"gossip_in_flight must be None or (forward, backward) "
                     f"fractions in [0, 1], got {value!r}.")
  return pair


def wire_dtype(where: str, name) -> np.dtype:
  """``np.dtype(name)`` if the library can send values of that dtype.

  The rule of :func:`decentral_jax.checks.check_comm_dtype` (width and byte
  order through :func:`decentral_jax.checks.check_wire_width_and_order`): a
  floating dtype (bfloat16 included) of 2 to 8 bytes in native byte order (8-bit
  floats travel only block-scaled: ``compress=fp8``). ``where`` names the
  field or flag in the one-line ValueError raised otherwise (an integer,
  complex, unknown, 8-bit or byte-swapped name; NumPy parses some strings
  such as ``",,"`` as code, which is caught too).
  """
  try:
    dt = np.dtype(name)
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
    param_count: number of parameters (the message is ``param_count`` times
      the dtype size: gradients for All-Reduce, parameters for gossip).
    forward_s: mean forward time per iteration and worker (seconds).
    backward_s: mean backward time (seconds).
    optimizer_s: optimizer step time (seconds), spread over buckets.
    compute_cv: coefficient of variation of forward + backward (Gaussian,
      independent per worker and step; truncated at 5% of the mean).
    compute_samples_s: optional samples of forward + backward time (seconds,
      at least 2, each finite and > 0: they are divided by their mean); when
      given they replace ``forward_s + backward_s`` and ``compute_cv``,
      and ``forward_s : backward_s`` only sets the split.
    grad_dtype: dtype of communicated gradients (numpy name, e.g. "float32").
    param_dtype: dtype of communicated parameters.
    bucket_bytes: bucket capacity (bytes) used when ``bucket_shares`` is None;
      25 MiB is the PyTorch DDP and Decent-DP default.
    bucket_shares: optional fraction of the message in each bucket, in the
      order buckets become ready (sums to 1).
    bucket_ready: optional fraction of the backward after which each bucket
      is ready (non-decreasing, last = 1; without ``bucket_shares`` the
      buckets are equal); default: cumulative shares.
    devices_per_worker: devices ``D`` of one worker (``config.
      devices_per_worker``), all in one node; the compute times are the
      worker's (its ``D`` devices together). Default 1.
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
    for name in ("param_count", "forward_s", "backward_s", "optimizer_s",
                 "compute_cv"):
      checks.check_float(name, getattr(self, name), minimum=0)
    checks.check_float("bucket_bytes", self.bucket_bytes, minimum=0,
                       open_min=True)
    checks.check_int("devices_per_worker", self.devices_per_worker, minimum=1)
    if self.worker_layout not in layout_modes.MODES:
      raise ValueError(f"worker_layout must be one of {layout_modes.MODES}, "
                       f"got {self.worker_layout!r}.")
    for name in ("grad_dtype", "param_dtype"):
      wire_dtype(name, getattr(self, name))
    self._check_size()
    s = np.asarray([1.0, 1.0] if self.compute_samples_s is None
                   else self.compute_samples_s, float)
    if s.ndim != 1 or s.size < 2 or not np.all(np.isfinite(s) & (s > 0)):
      # the samples are divided by their mean: a step takes some time
      raise ValueError("compute_samples_s must be >= 2 finite times > 0 in "
                       f"seconds, got {list(self.compute_samples_s)!r}.")
    sh = np.asarray([1.0] if self.bucket_shares is None
                    else self.bucket_shares, float)
    if sh.ndim != 1 or sh.size < 1 or np.any(sh <= 0) or abs(sh.sum() - 1) > 1e-6:
      raise ValueError("bucket_shares must be positive fractions summing to 1.")
    if self.bucket_ready is not None:
      rd = np.asarray(self.bucket_ready, float)
      if (rd.size != (rd.size if self.bucket_shares is None else sh.size)
          or np.any(np.diff(rd) < 0) or rd[0] < 0 or abs(rd[-1] - 1) > 1e-9):
        raise ValueError("bucket_ready must be non-decreasing fractions of the "
                         "backward in [0, 1], one per bucket, ending at 1.")

  def _check_size(self) -> None:
    """``param_count`` at most :data:`MAX_PARAMS`, and (buckets cut by
    ``bucket_bytes``) its gradients or parameters in at most
    :data:`MAX_BUCKETS` buckets."""
    if self.param_count > MAX_PARAMS:
      raise ValueError(f"param_count must be at most {MAX_PARAMS:g}, got "
                       f"{self.param_count:g}.")
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


def expected_max_normal(m: int) -> float:
  """``E[max(Z_1..Z_m)]`` for i.i.d. standard normals (numerical integral)."""
  if m <= 1:
    return 0.0
  x = np.linspace(-9.0, 9.0, 8001)
  cdf = special.ndtr(x)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  return float(np.trapezoid(x * m * pdf * cdf**(m - 1), x))


@functools.lru_cache(maxsize=4096)
def coupling_excess(m: int, slack_sigmas: float) -> float:
  """``E[(max(Z_1..Z_{m-1}) - Z_0 - s)^+]`` for i.i.d. standard normals.

  The expected wait (in units of the compute standard deviation) of a worker
  for the slowest of the ``m - 1`` other members of its group when its
  communication has ``s`` standard deviations of slack. ``m = n``, ``s = 0``
  is All-Reduce's barrier minus the worker's own time.
  """
  if m <= 1:
    return 0.0
  s = max(0.0, round(float(slack_sigmas), 3))
  x = np.linspace(-8.0, 8.0, 321)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  y = np.linspace(s, s + 12.0, 241)
  cdf_y = np.trapezoid(pdf * special.ndtr(x[None, :] + y[:, None])**(m - 1),
                       x, axis=1)
  return float(np.trapezoid(1.0 - cdf_y, y))
