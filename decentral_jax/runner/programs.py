"""The compiled train-step programs of a run, and which one runs when.

A run compiles one train step (:func:`decentral_jax.runner.step.train_step`
over all workers) per *program key* ``(distinct round, consensus mode)``:

* the distinct round: None when one program holds the whole gossip
  schedule (``gossip_rounds="switch"``: the round is picked in the graph
  with ``lax.switch``); else the topology's distinct round of the step
  (``"static"``: one program per distinct round, chosen on the host, so
  the collective sits outside any conditional and XLA can overlap it with
  the forward/backward pass on accelerators), or :data:`LOCAL_STEP` for
  the steps without gossip of ``decentralized`` with ``gossip_every > 1``;
* the consensus mode (``consensus`` of ``train_step``): ``"logged"``
  (measured inside log steps, ``consensus_at="log_step"``), or ``"none"``
  and ``"input"`` (measured at the top of the step after a log step, from
  its input, ``consensus_at="next_step"``).

:class:`StepPrograms` maps a step to its key (:meth:`~StepPrograms.key_of`),
jits each program the first time it is asked for
(:meth:`~StepPrograms.get`; with ``config.faults`` also a variant taking the
step's worker masks) and reads the bytes the programs send per step
(:meth:`~StepPrograms.communication`, through
:func:`decentral_jax.analysis.run_communication.run_bytes`).
:func:`resolve_dispatch` picks ``"static"`` / ``"next_step"`` on
accelerators and ``"switch"`` / ``"log_step"`` on CPU
(``docs/gpu_overlap.md``); CPU trajectories are bit-identical either way.
"""

from __future__ import annotations

import collections
import functools

import jax

from decentral_jax.analysis import run_communication
from decentral_jax import parallel
from decentral_jax.runner import methods
from decentral_jax.runner import step as step_lib
from decentral_jax.runner import tasks

#: XLA options of the train-step programs on GPUs (``docs/gpu_overlap.md``).
#: XLA runs its latency-hiding scheduler by default only from Hopper on;
#: without it an A100 program runs every collective synchronously. Two
#: collectives in flight let the gossip and the consensus distance's
#: All-Reduce (or a round's several group means) overlap the same
#: backward pass instead of queueing for one slot (XLA's default is 1).
#: The runner knows no cluster, so 2 is its default; compiles given the
#: runtime model's cluster (``tools.gpu_compile.compile_steps``,
#: ``gpu_check.py --cluster``) set the limit each program's links allow
#: (``runtime_model.links.parallel_collectives``: 1 where the buckets
#: share one NIC or one PCIe link, 2 where fsdp's NVLink collectives run
#: beside a gossip on the NICs).
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


#: Program key (:meth:`StepPrograms.key_of`) of the steps without gossip
#: of ``decentralized`` with ``gossip_every > 1`` and static rounds.
LOCAL_STEP = -1


def resolve_dispatch(c, platform: str) -> tuple[str, str]:
  """``(gossip_rounds, consensus_at)`` of a validated config on ``platform``.

  ``"auto"`` resolves to what lets XLA overlap the step's collectives with
  its forward/backward pass on accelerators (``docs/gpu_overlap.md``):
  ``gossip_rounds="static"`` (one program per distinct round, chosen on the
  host) when the method allows it (``Method.static_rounds``:
  ``decentralized``, also with ``gossip_every > 1``, and ``sgp``) and
  ``consensus_at="next_step"``; on ``platform="cpu"``
  (XLA:CPU runs collectives synchronously, nothing to overlap) ``"switch"``
  and ``"log_step"``, which compile fewer programs. CPU trajectories are
  bit-identical either way.

  Args:
    c: a validated run config.
    platform: the devices' platform (``"cpu"``, ``"gpu"``, ``"tpu"``).
  """
  accel = platform != "cpu"
  rounds = c.gossip_rounds
  if rounds == "auto":
    static_ok = methods.lookup(c.algorithm).static_rounds
    rounds = "static" if accel and static_ok else "switch"
  consensus = c.consensus_at
  if consensus == "auto":
    consensus = "next_step" if accel else "log_step"
  return rounds, consensus


def gossip_every(c) -> int:
  """``config.gossip_every`` of ``decentralized`` (1 for other methods:
  ``Method.gossip_every``)."""
  method = methods.lookup(c.algorithm)
  return 1 if method.gossip_every is None else method.gossip_every(c)


def round_stride(c) -> int:
  """Steps per round of the gossip schedule: 2 for pipelined gossip (round
  ``floor(k / 2)`` at step ``k``), else 1 (``Method.round_stride``)."""
  method = methods.lookup(c.algorithm)
  return 1 if method.round_stride is None else method.round_stride(c)


def round_indices(topology, gossip_rounds: str, tau: int,
                  stride: int = 1) -> dict:
  """``{distinct round: a round index}`` (``{None: None}``: one program).

  ``"switch"`` compiles the whole schedule once (the round is picked
  in-graph with ``lax.switch``); ``"static"`` compiles one step per
  distinct round (the host picks it from the step number), so the
  collective sits outside any conditional and XLA can overlap it with the
  forward/backward pass on accelerators. With ``gossip_every = tau > 1``
  the round index is the step ``tau x r`` of the round's first use, and
  :data:`LOCAL_STEP` (index 1) is the program of the steps between two
  gossip steps, with no collective. With ``stride = 2`` (pipelined
  gossip, ``tau = 1``) it is the step ``2 r``.

  Args:
    topology: the run's :class:`~decentral_jax.topology.Topology`, or None.
    gossip_rounds: ``"static"`` or ``"switch"`` (resolved).
    tau: gossip every ``tau`` steps (:func:`gossip_every`).
    stride: steps per round (:func:`round_stride`).
  """
  distinct = topology.distinct_rounds if topology is not None else ()
  if gossip_rounds != "static" or (len(distinct) <= 1 and tau == 1):
    return {None: None}
  rounds = {}
  for r, d in enumerate(topology.round_to_distinct):
    rounds.setdefault(d, r * tau * stride)
  if tau > 1:
    rounds[LOCAL_STEP] = 1  # a step between two gossip steps
  return rounds


class StepPrograms:
  """The jitted train steps of one run, one per program key, built on use.

  Attributes:
    gossip_rounds: ``config.gossip_rounds`` with ``"auto"`` resolved
      (``"static"`` or ``"switch"``, see :func:`resolve_dispatch`).
    consensus_at: ``config.consensus_at`` resolved (``"log_step"`` or
      ``"next_step"``).
    rounds: ``{distinct round: round index}`` (:func:`round_indices`).
    traces: how many times a train step was traced (compiled): one per
      distinct gossip round with ``gossip_rounds="static"`` (else one),
      times two with ``consensus_at="next_step"`` (steps with and without
      the measurement) once both have run.
  """

  def __init__(self, config, *, topology, mesh, loss_fn, tx, axis_name,
               sharding, state_shardings, gathered: tuple, platform: str):
    """Resolves the dispatch; compiles nothing yet.

    Args:
      config: the validated run config.
      topology: the gossip topology, or None.
      mesh: the worker mesh.
      loss_fn: the task's loss.
      tx: the per-worker optax transform.
      axis_name: the mesh's worker axis.
      sharding: the worker sharding of the metrics.
      state_shardings: the state's shardings (workers of several devices),
        or None to let jit pick them.
      gathered: ``gathered_outputs`` of
        :func:`decentral_jax.parallel.per_worker` (``(1,)``: the metrics
        of a multi-process job, replicated inside the step).
      platform: the devices' platform; ``"gpu"`` adds
        :data:`GPU_COMPILER_OPTIONS`.
    """
    self.config, self.topology = config, topology
    self._mesh, self._loss, self._tx, self._axis = mesh, loss_fn, tx, axis_name
    self._sharding, self._state_shardings = sharding, state_shardings
    self._gathered = gathered
    self._compiler_options = (dict(GPU_COMPILER_OPTIONS) if platform == "gpu"
                              else None)
    self.gossip_rounds, self.consensus_at = resolve_dispatch(config, platform)
    self.rounds = round_indices(topology, self.gossip_rounds,
                                gossip_every(config), round_stride(config))
    self.traces = 0
    # (distinct round, consensus mode, masks) -> jitted step, built when
    # first run. With faults, the steps where a worker is dead or slow take
    # the masks (healthy steps run the plain ones, bit for bit).
    self._steps = {}

  def get(self, distinct: int | None, consensus: str, masks: bool = False):
    """The jitted step over all workers of one program of :meth:`keys`.

    Args:
      distinct: the topology's distinct round (None: the program that
        holds every round), as :meth:`key_of` returns.
      consensus: ``"logged"``, ``"input"`` or ``"none"`` (see
        :func:`decentral_jax.runner.step.train_step`).
      masks: the variant that takes ``(alive, working, rejoining)``
        (``config.faults``).

    Returns:
      ``jitted(state, batch, *masks) -> (state, metrics)``, ``state``
      donated.
    """
    key = (distinct, consensus, bool(masks))
    if key not in self._steps:
      self._steps[key] = self._jit(self.rounds[distinct], consensus, masks)
    return self._steps[key]

  def _jit(self, round_index: int | None, consensus: str,
           masks: bool = False):
    """The jitted step over all workers for a static round (or None);
    ``masks``: it takes ``(alive, working, rejoining)`` (replicated)."""
    c = self.config
    worker = functools.partial(
        step_lib.train_step, loss_fn=self._loss, tx=self._tx,
        axis_name=self._axis, dropout=tasks.uses_dropout(c),
        global_avg_interval=int(c.global_avg_interval),
        log_interval=int(c.log_interval), total_steps=int(c.steps),
        round_index=round_index, consensus=consensus,
        micro_batches=int(c.micro_batches),
        model_params=methods.ALGORITHMS[c.algorithm].model_params,
        global_average=methods.ALGORITHMS[c.algorithm].global_average)

    def counted(state, batch, *masks):
      self.traces += 1  # runs once per trace
      return worker(state, batch, masks=masks or None)

    extra = {}
    if self._state_shardings is not None:
      extra["out_shardings"] = (self._state_shardings, self._sharding)
    if self._compiler_options:
      extra["compiler_options"] = self._compiler_options
    return jax.jit(parallel.per_worker(counted, self._mesh,
                                       replicated_argnums=(2, 3, 4) if masks
                                       else (),
                                       gathered_outputs=self._gathered),
                   donate_argnums=(0,), **extra)

  def needs_step(self) -> bool:
    """Whether :meth:`key_of` reads the step number (static rounds or
    ``consensus_at="next_step"``)."""
    return None not in self.rounds or self.consensus_at == "next_step"

  def key_of(self, step: int | None) -> tuple[int | None, str]:
    """``(distinct round or None, consensus mode)`` of the step after ``step``.

    The key of the compiled program that runs on a state of ``step``
    completed steps: the topology's distinct round of that step (None when
    one program holds every round; :data:`LOCAL_STEP` for a step without
    gossip with ``gossip_every > 1``) and the ``consensus`` argument of
    :func:`decentral_jax.runner.step.train_step`.
    """
    distinct = None
    if None not in self.rounds:
      topo, tau = self.topology, gossip_every(self.config)
      every = tau * round_stride(self.config)
      if int(step) % tau:
        distinct = LOCAL_STEP
      else:
        distinct = topo.round_to_distinct[int(step) // every % topo.period]
    if self.consensus_at == "log_step":
      return distinct, "logged"
    log = int(self.config.log_interval)
    measure = step is not None and step > 0 and step % log == 0
    return distinct, "input" if measure else "none"

  def keys(self) -> list[tuple[int | None, str]]:
    """Every ``(distinct round, consensus mode)`` that runs on healthy
    steps (see :meth:`key_of`), rounds in schedule order."""
    modes = (("logged",) if self.consensus_at == "log_step"
             else ("none", "input"))
    return [(d, m) for d in self.rounds for m in modes]

  def period_counts(self) -> dict:
    """``{distinct round: steps of one period that run it}``; ``{None: 1}``
    when one program holds every round. The period is the topology's
    times ``gossip_every``."""
    if None in self.rounds:
      return {None: 1}
    cycle = (self.topology.period * gossip_every(self.config)
             * round_stride(self.config))
    return collections.Counter(self.key_of(k)[0] for k in range(cycle))

  def communication(self, state, batch, *, param_bytes: int,
                    stage: str | None = None) -> dict:
    """Bytes the busiest worker sends per step, read from the programs' HLO.

    Lowers (and for ``stage="optimized"`` compiles) every program with
    ``state`` and ``batch`` (abstract or real; not donated, nothing runs),
    weighs each by :meth:`period_counts` and, with
    ``consensus_at="next_step"``, counts the measuring programs once every
    ``log_interval`` steps: :func:`decentral_jax.analysis.run_communication.
    run_bytes`, which documents the result.

    Args:
      state, batch: the inputs of a train step.
      param_bytes: one worker's parameter bytes (> 0).
      stage: ``"unoptimized"`` or ``"optimized"``; None: the default of
        :func:`~decentral_jax.analysis.run_communication.run_bytes`.
    """
    c = self.config
    counts = self.period_counts()

    def lowered(mode):
      return [(self.get(d, mode).lower(state, batch), k)
              for d, k in counts.items()]

    if self.consensus_at == "log_step":
      steps, measuring = lowered("logged"), None
    else:
      steps, measuring = lowered("none"), lowered("input")
    return run_communication.run_bytes(
        steps, measuring_steps=measuring,
        measure_every=int(c.log_interval), n_workers=int(c.n_workers),
        param_bytes=param_bytes, diagnostics_scope=step_lib.DIAGNOSTICS_SCOPE,
        stage=stage, devices_per_worker=int(c.devices_per_worker),
        workers_per_device=int(c.workers_per_device))
