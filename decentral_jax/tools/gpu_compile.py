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
it if the program allows (docs/gpu_overlap.md).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

import jax

from decentral_jax import checks

from decentral_jax.analysis import overlap as overlap_lib
from decentral_jax.runner import experiment as experiment_lib
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
      were scaled to; else None.
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


def compile_steps(config, *, target: str = "h200", topology: str = "1x1x8",
                  compiler_options: dict | None = None,
                  programs=None, collective_us=None, cluster=None,
                  compute_s: float | None = None
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

  Returns:
    ``(experiment, [CompiledStep, ...])``, one entry per program.

  Raises:
    ValueError: see :func:`gpu_devices` and :class:`Experiment` (a config
      error, or a device count that does not match the topology); both
      ``collective_us`` and ``cluster``; an unknown preset.
  """
  if collective_us is not None and cluster is not None:
    raise ValueError("give collective_us or cluster, not both.")
  devices = gpu_devices(target, topology)
  exp = experiment_lib.Experiment(config, devices=devices)
  if cluster is not None:
    if isinstance(cluster, str):
      cluster = runtime_presets.cluster(cluster, int(config.n_workers))
    collective_us = latency_profile.cluster_collective_us(exp, cluster)
  return exp, compile_programs(exp, programs, compiler_options,
                               collective_us=collective_us,
                               compute_s=compute_s)


def compile_programs(exp: experiment_lib.Experiment, programs=None,
                     compiler_options: dict | None = None, *,
                     collective_us=None,
                     compute_s: float | None = None) -> list[CompiledStep]:
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
      0; needs ``collective_us``).

  Returns:
    One :class:`CompiledStep` per program, in order.

  Raises:
    ValueError: ``collective_us`` is neither None, a positive number nor
      a function, or gives a collective a time that is not one;
      ``compute_s`` not > 0 or without ``collective_us``; the compiled
      text has no fingerprint, or XLA wrote no schedule.
  """
  if collective_us is not None and not callable(collective_us):
    collective_us = checks.check_float("collective_us", collective_us,
                                       minimum=0.0, open_min=True)
  if compute_s is not None:
    compute_s = checks.check_float("compute_s", compute_s, minimum=0.0,
                                   open_min=True)
    if collective_us is None:
      raise ValueError("compute_s rescales collective_us (or cluster): "
                       "give one of them too.")
  state, batch = exp.abstract_inputs()
  if callable(programs):
    programs = programs(exp)
  out = []
  for distinct, mode in (programs or exp.programs.keys()):
    t0 = time.perf_counter()
    lowered = exp.programs.get(distinct, mode).trace(state, batch).lower()
    with tempfile.TemporaryDirectory() as tmp:
      dump = ({"xla_dump_to": tmp, "xla_dump_latency_hiding_schedule": True}
              if compute_s is not None else {})
      compiled = lowered.compile({**(compiler_options or {}), **dump})
      texts = latency_profile.schedule_texts(tmp) if dump else None
    xla_us = None if texts is None else _program_busy_us(texts, distinct,
                                                          mode)
    report = overlap_lib.overlap_report(compiled)
    if collective_us is None:
      out.append(CompiledStep(distinct, mode, compiled, report,
                              time.perf_counter() - t0))
      continue
    costs = latency_profile.collective_costs(report, collective_us,
                                             distinct)
    if xla_us is not None:
      costs = {k: v * xla_us / (1e6 * compute_s) for k, v in costs.items()}
    profile = latency_profile.latency_profile(
        costs, latency_profile.fingerprint(compiled))
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "profile.pbtxt")
      with open(path, "w", encoding="utf-8") as f:
        f.write(profile)
      profiled = lowered.compile({**(compiler_options or {}),
                                  latency_profile.PROFILE_OPTION: path})
    out.append(CompiledStep(distinct, mode, profiled,
                            overlap_lib.overlap_report(profiled),
                            time.perf_counter() - t0, profile, report,
                            costs, xla_us))
  return out


def _program_busy_us(texts: list[str], distinct, mode) -> float:
  """:func:`~decentral_jax.tools.latency_profile.busy_us`, its error naming
  the program (not the temporary dump directory, gone by then)."""
  try:
    return latency_profile.busy_us(texts)
  except ValueError as e:
    raise ValueError(f"compute_s needs XLA's busy time of the program of "
                     f"round {distinct}, consensus {mode}: {e}") from None


__all__ = ("TARGETS", "TARGETS_DIR", "CompiledStep", "compile_programs",
           "compile_steps", "gpu_devices", "target_config")
