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
(:meth:`~decentral_jax.runner.experiment.Experiment.programs`: one per
distinct gossip round with ``gossip_rounds="static"``, with and without the
consensus measurement with ``consensus_at="next_step"``).

Topology strings are ``"SLICESxHOSTSxDEVICES"``: ``"1x1x8"`` is one host of
8 GPUs, ``"2x1x4"`` two hosts of 4 (devices ``0..3`` on the first).
Deviceless compiles skip kernel autotuning: a real GPU may pick other
kernels and a slightly different schedule.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from decentral_jax.analysis import overlap as overlap_lib
from decentral_jax.runner import experiment as experiment_lib

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
    compile_s: seconds of trace, lower and compile.
  """

  distinct_round: int | None
  consensus: str
  compiled: Any
  report: overlap_lib.OverlapReport
  compile_s: float


def compile_steps(config, *, target: str = "h200", topology: str = "1x1x8",
                  compiler_options: dict | None = None,
                  programs=None) -> tuple[experiment_lib.Experiment,
                                          list[CompiledStep]]:
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
      (default: all of :meth:`Experiment.programs`).

  Returns:
    ``(experiment, [CompiledStep, ...])``, one entry per program.

  Raises:
    ValueError: see :func:`gpu_devices` and :class:`Experiment` (a config
      error, or a device count that does not match the topology).
  """
  devices = gpu_devices(target, topology)
  exp = experiment_lib.Experiment(config, devices=devices)
  return exp, compile_programs(exp, programs, compiler_options)


def compile_programs(exp: experiment_lib.Experiment, programs=None,
                     compiler_options: dict | None = None
                     ) -> list[CompiledStep]:
  """Compiles train-step programs of a built experiment from abstract inputs.

  Works on any devices the experiment was built on: compile-only GPU
  devices (:func:`compile_steps`), real GPUs (the schedule XLA makes with
  kernel autotuning, to compare with the deviceless one:
  ``benchmarks/gpu_check.py``), or CPU devices. Nothing is placed on them.

  Args:
    exp: an :class:`~decentral_jax.runner.experiment.Experiment`.
    programs: ``(distinct round, consensus mode)`` pairs, or a function of
      ``exp`` returning them (default :meth:`Experiment.programs`).
    compiler_options: extra XLA options for every compile.

  Returns:
    One :class:`CompiledStep` per program, in order.
  """
  state, batch = exp.abstract_inputs()
  if callable(programs):
    programs = programs(exp)
  out = []
  for distinct, mode in (programs or exp.programs()):
    t0 = time.perf_counter()
    lowered = exp.step_program(distinct, mode).trace(state, batch).lower()
    compiled = lowered.compile(compiler_options or {})
    out.append(CompiledStep(distinct, mode, compiled,
                            overlap_lib.overlap_report(compiled),
                            time.perf_counter() - t0))
  return out


__all__ = ("TARGETS", "TARGETS_DIR", "CompiledStep", "compile_programs",
           "compile_steps",
           "gpu_devices", "target_config")
