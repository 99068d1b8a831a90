"""Compiling the runner's train steps for GPUs on a machine without one.

XLA compiles a program for an NVIDIA GPU target on a CPU-only machine
("deviceless" ahead-of-time compilation): with the ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` wheels installed (no CUDA libraries or driver needed)
and ``jax_platforms="cpu"``, :func:`gpu_devices` returns compile-only
devices of a GPU *topology* described by a target file (``h200``,
``h100_sxm``, ``a100_sxm_80``, shipped in ``gpu_targets/``, Apache-2.0, from
XLA), and a ``jax.jit`` program traced with ``jax.ShapeDtypeStruct`` inputs
sharded over them compiles to the optimized, *scheduled* GPU HLO. That text
says which collectives are asynchronous and what XLA's latency-hiding
scheduler placed between their start and done
(:func:`decentral_jax.analysis.overlap.overlap_report`).

:func:`compile_steps` builds an :class:`~decentral_jax.runner.experiment.
Experiment` on such devices (nothing is placed on them: the state and the
batch are abstract) and compiles every train-step program it would run
(:meth:`~decentral_jax.runner.programs.StepPrograms.keys`: one per
distinct gossip round with ``gossip_rounds="static"``, with and without the
consensus measurement with ``consensus_at="next_step"``).

Topology strings are ``"SLICESxHOSTSxDEVICES"``: ``"1x1x8"`` is one host of
8 GPUs, ``"2x1x4"`` two hosts of 4 (devices ``0..3`` on the first).
Deviceless compiles skip kernel autotuning: a real GPU may pick other
kernels and a slightly different schedule.

XLA's latency-hiding scheduler starts a collective only as early as its own
estimate of the transfer needs; for GPUs of one host that estimate is the
NVLink time, so the gossip starts late in the backward pass. Given the time
a collective really takes (``collective_us``: microseconds, a number or a
function of the collective, e.g. ``cluster_collective_us`` of
:mod:`decentral_jax.tools.latency_profile`, from the runtime model's
description of a cluster), :func:`compile_programs` compiles each program
twice: once as usual, to learn the names of its collectives, then with a
profile (XLA's profile-guided latency estimation,
``ProfiledInstructionsProto`` text, written by
:mod:`~decentral_jax.tools.latency_profile`) that prices each asynchronous
collective at that time, so the scheduler starts it early enough to hide
it if the program allows (docs/gpu_overlap.md). With ``roofline``
(:func:`target_roofline`) the profile also prices every GEMM, fusion and
copy at its roofline time on the target
(:mod:`decentral_jax.analysis.roofline`), so the whole schedule is on the
GPU's clock rather than XLA's deviceless cost model's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from typing import Any

import jax

from decentral_jax import checks

from decentral_jax.analysis import overlap as overlap_lib
from decentral_jax.analysis import roofline as roofline_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runtime_model import links as runtime_links
from decentral_jax.runtime_model import presets as runtime_presets
from decentral_jax.tools import latency_profile

#: Directory of the shipped GPU target descriptions (``NAME.txtpb``).
TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "gpu_targets")
#: Target names accepted by :func:`gpu_devices`.
TARGETS = ("h200", "h100_sxm", "a100_sxm_80")

_INSTALL = ('pip install "jax-cuda12-plugin==0.10.2" '
            '"jax-cuda12-pjrt==0.10.2" (or -r requirements-gpu-compile.txt)')


def target_config(target: str) -> str:
  """The text of a shipped GPU target description.

  Args:
    target: one of :data:`TARGETS`, or the path of a ``.txtpb`` file (a
      ``stream_executor.GpuTargetConfigProto`` in text form).

  Raises:
    ValueError: unknown target name or unreadable file.
  """
  path = target
  if not target.endswith(".txtpb"):
    if target not in TARGETS:
      raise ValueError(f"target must be one of {', '.join(TARGETS)} or a "
                       f".txtpb file, got {target!r}.")
    path = os.path.join(TARGETS_DIR, f"{target}.txtpb")
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"target file {path!r} cannot be read: {e}.") from None


#: XLA's option: how many asynchronous collectives may be in flight at once.
OVERLAP_LIMIT_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"


#: Dense bfloat16 matmul peak (FLOP/s) of each shipped target (NVIDIA
#: datasheets: H100 SXM5 and H200 989.4 TFLOP/s, A100 SXM 312 TFLOP/s).
PEAK_BF16_FLOPS = {"h200": 989.4e12, "h100_sxm": 989.4e12,
                   "a100_sxm_80": 312e12}


def target_roofline(target: str, gemm_efficiency: float = 0.5,
                    memory_efficiency: float = 0.7,
                    peak_flops: float | None = None
                    ) -> roofline_lib.Roofline:
  """The :class:`~decentral_jax.analysis.roofline.Roofline` of a target.

  The HBM bandwidth is the target description's ``memory_bandwidth``
  (bytes/s); the peak is :data:`PEAK_BF16_FLOPS` (or ``peak_flops``). The
  default efficiencies (GEMMs at 50% of the bf16 peak, memory-bound
  kernels at 70% of HBM bandwidth) are the ones docs/gpu_overlap.md
  calibrates.

  Raises:
    ValueError: see :func:`target_config`; a target file without
      ``memory_bandwidth``; a target file without ``peak_flops``; an
      efficiency outside (0, 1].
  """
  text = target_config(target)
  m = re.search(r"\bmemory_bandwidth:\s*([0-9.eE+]+)", text)
  if m is None:
    raise ValueError(f"target {target!r} has no memory_bandwidth field; "
                     f"pass a target description that has one.")
  peak = peak_flops if peak_flops is not None else PEAK_BF16_FLOPS.get(
      target)
  if peak is None:
    raise ValueError(f"no bf16 peak known for target {target!r}: pass "
                     f"peak_flops (FLOP/s).")
  return roofline_lib.Roofline(peak, float(m.group(1)), gemm_efficiency,
                               memory_efficiency)


def gpu_devices(target: str = "h200", topology: str = "1x1x8") -> list:
  """Compile-only GPU devices of ``topology`` for ``target``.

  Args:
    target: see :func:`target_config`.
    topology: ``"SLICESxHOSTSxDEVICES"``, e.g. ``"1x1x8"`` or ``"2x1x4"``.

  Returns:
    The devices in id order (they hold no data: anything placed on them
    fails; compile only).

  Raises:
    ValueError: the CUDA plugin is not installed (the message says how to
      install it), JAX was started on another platform than ``"cpu"``, or
      XLA rejects the target or topology.
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  text = target_config(target)
  if jax.config.jax_platforms not in ("cpu", None, ""):
    raise ValueError(f"deviceless GPU compiles need jax_platforms='cpu' "
                     f"(JAX_PLATFORMS=cpu), got {jax.config.jax_platforms!r}.")
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=text,
                                        topology=topology)
  except NotImplementedError:
    raise ValueError(f"compiling for GPUs without a GPU needs the CUDA PJRT "
                     f"plugin, which is not installed: {_INSTALL}.") from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"XLA rejected GPU target {target!r} with topology "
                     f"{topology!r}: {str(e).splitlines()[0]}") from None
  return sorted(topo.devices, key=lambda d: d.id)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """One compiled train-step program and its overlap report.

  Attributes:
    distinct_round: the topology's distinct round it runs (None: all
      rounds in one program, chosen in-graph).
    consensus: the ``consensus`` mode of
      :func:`decentral_jax.runner.step.train_step` it was built with.
    compiled: the ``jax.stages.Compiled`` (its ``as_text()`` is the
      scheduled HLO).
    report: :func:`~decentral_jax.analysis.overlap.overlap_report` of it.
    compile_s: seconds of trace, lower and compile (both compiles with a
      profile).
    profile: the :func:`~decentral_jax.tools.latency_profile.latency_profile`
      text it was compiled with (None:
      XLA's own latency estimates).
    unprofiled: with a profile, the report of the same program compiled
      without it (the first of the two compiles); else None.
    profile_us: with a profile, ``{collective start name: microseconds}``
      it gives; else None.
    xla_compute_us: with ``compute_s``, XLA's estimate of the program's
      busy time (its scheduler's own clock, microseconds) that the times
      were scaled to; with ``roofline``, that estimate before the profile;
      else None.
    roofline_costs: with ``roofline``, the
      :class:`~decentral_jax.analysis.roofline.InstructionCost` of every
      compute instruction of the first compile (all in the profile); else
      None.
    xla_instruction_us: with ``roofline``, XLA's own estimate of each
      instruction of the first compile (``{name: us}``, from its
      scheduler's dump); else None.
    profiled_instruction_us, profiled_busy_us: with ``roofline``, the same
      of the profiled compile (the scheduler's view after the profile);
      else None.
    overlap_limit: the :data:`OVERLAP_LIMIT_OPTION` it was compiled with
      when :func:`compile_programs` set one (from the cluster's links);
      else None (the caller's options or the runner's default).
  """

  distinct_round: int | None
  consensus: str
  compiled: Any
  report: overlap_lib.OverlapReport
  compile_s: float
  profile: str | None = None
  unprofiled: overlap_lib.OverlapReport | None = None
  profile_us: dict[str, float] | None = None
  xla_compute_us: float | None = None
  roofline_costs: tuple | None = None
  xla_instruction_us: dict | None = None
  profiled_instruction_us: dict | None = None
  profiled_busy_us: float | None = None
  overlap_limit: int | None = None

  def class_table(self) -> dict | None:
    """:func:`~decentral_jax.analysis.roofline.class_table` of the
    roofline costs against XLA's estimates before the profile (None
    without ``roofline``)."""
    if self.roofline_costs is None:
      return None
    return roofline_lib.class_table(self.roofline_costs,
                                    self.xla_instruction_us)


def compile_steps(config, *, target: str = "h200", topology: str = "1x1x8",
                  compiler_options: dict | None = None,
                  programs=None, collective_us=None, cluster=None,
                  compute_s: float | None = None, roofline=None,
                  overlap_limit="cluster"
                  ) -> tuple[experiment_lib.Experiment, list[CompiledStep]]:
  """Compiles the runner's train steps of ``config`` for a GPU target.

  Args:
    config: a run config (e.g. ``config_lib.load_config(
      "configs/gpt_tiny.py")``); validated here.
    target, topology: see :func:`gpu_devices`; the topology must have
      ``n_workers * devices_per_worker / workers_per_device`` devices.
    compiler_options: XLA options for every compile, e.g.
      ``{"xla_gpu_experimental_parallel_collective_overlap_limit": 2}``.
    programs: which ``(distinct round, consensus mode)`` programs to
      compile: a list, or a function of the experiment returning one
      (default: all of ``exp.programs.keys()``).
    collective_us: the transfer time to tell XLA's scheduler, see
      :func:`compile_programs`.
    cluster: instead of ``collective_us``, the cluster whose links to
      price the collectives with (:func:`~decentral_jax.tools.latency_profile.
      cluster_collective_us`): a
      :class:`decentral_jax.runtime_model.costs.Cluster` or the name of a
      :mod:`decentral_jax.runtime_model.presets` cluster (e.g. ``"A40"``,
      the paper's: 4 A40s per node, 25 Gbit/s Ethernet), built for the
      config's ``n_workers``.
    compute_s: see :func:`compile_programs`.
    roofline: None, True (:func:`target_roofline` of ``target`` at the
      default efficiencies) or an :class:`~decentral_jax.analysis.
      roofline.Roofline`: price every compute instruction too, see
      :func:`compile_programs`.
    overlap_limit: ``"cluster"`` (the default): with ``cluster``, each
      program's :data:`OVERLAP_LIMIT_OPTION` is
      :func:`~decentral_jax.runtime_model.links.parallel_collectives` of
      the cluster and the program's round (its ppermute terms if the
      gossip is compressed; the config's devices per worker and layout; an
      All-Reduce over all workers in programs with the consensus
      measurement or without a topology; the smallest over the rounds for
      a program of all rounds), replacing any in
      ``compiler_options``; without ``cluster``, the options as given. An
      int: that limit for every program. None: the options as given.

  Returns:
    ``(experiment, [CompiledStep, ...])``, one entry per program.

  Raises:
    ValueError: see :func:`gpu_devices` and :class:`Experiment` (a config
      error, or a device count that does not match the topology); both
      ``collective_us`` and ``cluster``; an unknown preset; an
      ``overlap_limit`` that is neither ``"cluster"``, None nor an int >= 1.
  """
  if collective_us is not None and cluster is not None:
    raise ValueError("give collective_us or cluster, not both.")
  if overlap_limit not in ("cluster", None):
    overlap_limit = checks.check_int("overlap_limit", overlap_limit,
                                     minimum=1)
  devices = gpu_devices(target, topology)
  exp = experiment_lib.Experiment(config, devices=devices)
  if cluster is not None:
    if isinstance(cluster, str):
      cluster = runtime_presets.device_slice(
          cluster, int(config.n_workers), int(config.devices_per_worker))
    collective_us = latency_profile.cluster_collective_us(exp, cluster)
  if overlap_limit == "cluster":
    overlap_limit = None if cluster is None else cluster_overlap_limit(
        exp, cluster)
  if roofline is True:
    roofline = target_roofline(target)
  return exp, compile_programs(exp, programs, compiler_options,
                               collective_us=collective_us,
                               compute_s=compute_s,
                               roofline=roofline or None,
                               overlap_limit=overlap_limit)


def cluster_overlap_limit(exp: experiment_lib.Experiment, cluster):
  """``(distinct round, consensus mode) -> limit``: the collectives of each
  program of ``exp`` that truly run at once on ``cluster``
  (:func:`~decentral_jax.runtime_model.links.parallel_collectives`; see
  :func:`compile_steps`' ``overlap_limit``).

  Raises:
    ValueError: the cluster has another number of workers than ``exp``.
  """
  c = exp.config
  if cluster.n_workers != int(c.n_workers):
    raise ValueError(f"cluster has n_workers={cluster.n_workers} but the "
                     f"experiment has {int(c.n_workers)} workers; build the "
                     f"cluster for {int(c.n_workers)}.")
  rounds = exp.topology.distinct_rounds if exp.topology is not None else ()
  kw = dict(permutes=str(c.compression.format) != "none",
            devices_per_worker=int(c.devices_per_worker),
            worker_layout=str(c.worker_layout))

  def limit(distinct, mode) -> int:
    if not rounds:  # no topology: All-Reduce (or DiLoCo-style syncs)
      return runtime_links.parallel_collectives(cluster, None,
                                                all_reduce=True, **kw)
    # One program for every round (chosen in-graph): the smallest.
    which = (rounds if distinct is None or not 0 <= distinct < len(rounds)
             else [rounds[distinct]])
    return min(runtime_links.parallel_collectives(
        cluster, r, all_reduce=mode != "none", **kw) for r in which)

  return limit


def compile_programs(exp: experiment_lib.Experiment, programs=None,
                     compiler_options: dict | None = None, *,
                     collective_us=None,
                     compute_s: float | None = None,
                     roofline: roofline_lib.Roofline | None = None,
                     overlap_limit=None) -> list[CompiledStep]:
  """Compiles train-step programs of a built experiment from abstract inputs.

  Works on any devices the experiment was built on: compile-only GPU
  devices (:func:`compile_steps`), real GPUs (the schedule XLA makes with
  kernel autotuning, to compare with the deviceless one:
  ``benchmarks/gpu_check.py``), or CPU devices. Nothing is placed on them.

  With ``collective_us``, each program is compiled twice: as usual, then
  with :data:`~decentral_jax.tools.latency_profile.PROFILE_OPTION` naming
  a :func:`~decentral_jax.tools.latency_profile.latency_profile` that prices
  every asynchronous collective of the first compile (matched by
  instruction name) at ``collective_us`` microseconds. XLA's
  latency-hiding scheduler then places each start at least that much
  estimated compute before its done, where the program's dependencies
  allow; the instructions left out of the profile keep XLA's own
  estimates. Twice the compile time.

  XLA's scheduler compares that time with its own estimate of the compute
  of the program *on the target GPU*, which is not the cluster's (for
  GPT-2 small compiled deviceless for H200 it estimates about 220 ms of
  busy time per step, against 122 ms of compute on the paper's A40s; for
  Ampere targets its estimates are unitless "T-shirt sizes", so there
  microseconds alone change nothing). With
  ``compute_s``, the step's compute time on the cluster, the times are
  rescaled to XLA's clock: the first compile also dumps the scheduler's
  timeline (``xla_dump_latency_hiding_schedule``, to a temporary
  directory), and each time is multiplied by XLA's busy time over
  ``compute_s``, so the scheduler sees each transfer as the same share of
  the step as the cluster has it.

  Args:
    exp: an :class:`~decentral_jax.runner.experiment.Experiment`.
    programs: ``(distinct round, consensus mode)`` pairs, or a function of
      ``exp`` returning them (default ``exp.programs.keys()``).
    compiler_options: extra XLA options for every compile.
    collective_us: None (XLA's estimates), a number of microseconds > 0
      for every asynchronous collective, or a function ``(collective,
      distinct_round) -> microseconds`` of a
      :class:`~decentral_jax.analysis.overlap.CollectiveOverlap` and the
      program's distinct round (e.g. :func:`~decentral_jax.tools.
      latency_profile.cluster_collective_us`).
    compute_s: None, or the step's compute time on the cluster (seconds >
      0; needs ``collective_us``; not with ``roofline``).
    roofline: None, or an :class:`~decentral_jax.analysis.roofline.
      Roofline` of the target (:func:`target_roofline`): the profile then
      also prices every compute instruction of the first compile (GEMMs,
      fusions, copies) at its roofline time, so the scheduler's clock is
      the GPU's and collectives need no rescaling; both compiles dump the
      schedule, to compare XLA's estimates before and after
      (:meth:`CompiledStep.class_table`). Works for real-GPU compiles too.
    overlap_limit: None (the options as given), an int >= 1, or a function
      ``(distinct round, consensus mode) -> int`` (e.g.
      :func:`cluster_overlap_limit`): each program's
      :data:`OVERLAP_LIMIT_OPTION`, over ``compiler_options``' and the
      runner's default.

  Returns:
    One :class:`CompiledStep` per program, in order.

  Raises:
    ValueError: ``collective_us`` is neither None, a positive number nor
      a function, or gives a collective a time that is not one;
      ``compute_s`` not > 0, without ``collective_us`` or with
      ``roofline``; ``roofline`` not a Roofline; the compiled text has no
      fingerprint, or XLA wrote no schedule.
  """
  collective_us, compute_s = _check_times(collective_us, compute_s,
                                          roofline)
  state, batch = exp.abstract_inputs()
  if callable(programs):
    programs = programs(exp)
  base = dict(compiler_options or {})
  out = []
  for distinct, mode in (programs or exp.programs.keys()):
    t0 = time.perf_counter()
    limit = (overlap_limit(distinct, mode) if callable(overlap_limit)
             else overlap_limit)
    options = base if limit is None else {**base, OVERLAP_LIMIT_OPTION:
                                          checks.check_int(
                                              "overlap_limit", limit,
                                              minimum=1)}
    lowered = exp.programs.get(distinct, mode).trace(state, batch).lower()
    dump = compute_s is not None or roofline is not None
    compiled, texts = _compile(lowered, options, dump)
    xla_us = None if texts is None else _program_busy_us(texts, distinct,
                                                          mode)
    report = overlap_lib.overlap_report(compiled)
    if collective_us is None and roofline is None:
      out.append(CompiledStep(distinct, mode, compiled, report,
                              time.perf_counter() - t0,
                              overlap_limit=limit))
      continue
    costs = ({} if collective_us is None else latency_profile.
             collective_costs(report, collective_us, distinct))
    if compute_s is not None:
      costs = {k: v * xla_us / (1e6 * compute_s) for k, v in costs.items()}
    extra = {}
    if roofline is not None:
      rows = roofline_lib.instruction_costs(compiled, roofline)
      extra = {"roofline_costs": rows, "xla_instruction_us":
               roofline_lib.xla_instruction_us(texts)}
      profile_us = {**{r.name: r.us for r in rows}, **costs}
    else:
      profile_us = costs
    profile = latency_profile.latency_profile(
        profile_us, latency_profile.fingerprint(compiled))
    profiled, texts = _compile(lowered, options, roofline is not None,
                               profile)
    if texts is not None:
      extra.update(profiled_instruction_us=roofline_lib.xla_instruction_us(
          texts), profiled_busy_us=_program_busy_us(texts, distinct, mode))
    out.append(CompiledStep(distinct, mode, profiled,
                            overlap_lib.overlap_report(profiled),
                            time.perf_counter() - t0, profile, report,
                            costs, xla_us, overlap_limit=limit, **extra))
  return out


def _check_times(collective_us, compute_s, roofline):
  """``(collective_us, compute_s)`` checked (see :func:`compile_programs`)."""
  if collective_us is not None and not callable(collective_us):
    collective_us = checks.check_float("collective_us", collective_us,
                                       minimum=0.0, open_min=True)
  if compute_s is not None:
    compute_s = checks.check_float("compute_s", compute_s, minimum=0.0,
                                   open_min=True)
    if collective_us is None or roofline is not None:
      raise ValueError("compute_s rescales collective_us (or cluster) to "
                       "XLA's clock: give one of them, and no roofline "
                       "(whose times are already on the GPU's clock).")
  if roofline is not None and not isinstance(roofline,
                                             roofline_lib.Roofline):
    raise ValueError(f"roofline must be an analysis.roofline.Roofline "
                     f"(e.g. gpu_compile.target_roofline('h100_sxm')), got "
                     f"{type(roofline).__name__}.")
  return collective_us, compute_s


def _compile(lowered, options: dict, dump: bool, profile: str | None = None):
  """``(compiled, schedule texts or None)``: one compile, with the
  scheduler's dump when ``dump``, with a latency ``profile`` (text) when
  given."""
  with tempfile.TemporaryDirectory() as tmp:
    opts = dict(options)
    if dump:
      opts.update(xla_dump_to=tmp,
                  xla_dump_latency_hiding_schedule=True)
    if profile is not None:
      path = os.path.join(tmp, "profile.pbtxt")
      with open(path, "w", encoding="utf-8") as f:
        f.write(profile)
      opts[latency_profile.PROFILE_OPTION] = path
    compiled = lowered.compile(opts)
    texts = latency_profile.schedule_texts(tmp) if dump else None
  return compiled, texts


def check_compiler_options(options: dict) -> None:
  """Refuses XLA compile options XLA would refuse at the first compile: a
  name it does not know, or a value its type does not parse (a bool takes
  ``True``/``False``, an int a whole number), by compiling a one-add
  program with them on the default backend (milliseconds; XLA's options
  are one set for every backend), so that the error comes before any
  slow compile (a dump option dumps the probe to a temporary folder).

  Args:
    options: ``{name: value}``, as ``compiler_options`` of
      :func:`compile_steps`.

  Raises:
    ValueError: XLA's line, e.g. ``While setting option
      xla_gpu_enable_latency_hiding_scheduler, 'maybe' is not a valid bool
      value.`` or ``No such compile option: 'xla_x'``.
  """
  if not options:
    return
  with tempfile.TemporaryDirectory() as tmp:
    opts = dict(options)
    if any(k.startswith("xla_dump") for k in opts):  # dump the probe there
      opts["xla_dump_to"] = tmp if "xla_dump_to" not in opts or isinstance(
          opts["xla_dump_to"], str) else opts["xla_dump_to"]
    try:
      jax.jit(lambda x: x + 1).lower(0.0).compile(opts)
    except (RuntimeError, TypeError, OverflowError) as e:
      line = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise ValueError(line.removeprefix("INVALID_ARGUMENT: ")) from None


def _program_busy_us(texts: list[str], distinct, mode) -> float:
  """:func:`~decentral_jax.tools.latency_profile.busy_us`, its error naming
  the program (not the temporary dump directory, gone by then)."""
  try:
    return latency_profile.busy_us(texts)
  except ValueError as e:
    raise ValueError(f"compute_s needs XLA's busy time of the program of "
                     f"round {distinct}, consensus {mode}: {e}") from None


__all__ = ("OVERLAP_LIMIT_OPTION", "PEAK_BF16_FLOPS", "TARGETS",
           "TARGETS_DIR", "CompiledStep", "check_compiler_options",
           "cluster_overlap_limit",
           "compile_programs", "compile_steps", "gpu_devices",
           "target_config", "target_roofline")
