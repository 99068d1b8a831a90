"""Wiring of one run: config -> mesh, topology, task, optimizer, jitted steps.

:class:`Experiment` turns a validated ``ml_collections`` config (see
:mod:`decentral_jax.runner.config`) into the pieces of a run, without touching the
file system: a device mesh (one worker per device, or per
``config.devices_per_worker`` devices), the topology, the
:class:`~decentral_jax.runner.tasks.Task`, the per-worker optax transform, the
jitted train steps of :mod:`decentral_jax.runner.step` over all workers
(:mod:`decentral_jax.runner.programs`) and the evaluation of the averaged
model (:mod:`decentral_jax.runner.evaluation`). The loop that drives it is
:func:`decentral_jax.runner.train.train_and_evaluate`; what a checkpoint
records about the run is :mod:`decentral_jax.runner.run_meta`.

State layout: every leaf of the :class:`~decentral_jax.runner.step.TrainState` has
a leading worker axis ``[n_workers, ...]`` sharded over the mesh's worker
axis (``"workers"``, or ``("nodes", "local")`` for node-aware topologies),
so each device holds one worker's parameters, optimizer state, step and RNG
key. All workers start from the same parameters.

Workers of several devices (``config.devices_per_worker = D > 1``; in a
multi-process job a worker's devices are on one host, workers placed on
hosts in order): the mesh gets a last axis ``"inner"`` of size
``D`` (:func:`decentral_jax.parallel.make_mesh`), each batch ``[n, B, ...]``
is split over it along ``B`` (``B = global_batch / n_workers`` must be
divisible by ``D``), and ``config.worker_layout`` places the state
(:mod:`decentral_jax.parallel.layouts`): ``"fsdp"`` splits every floating leaf of
parameters and optimizer state over the worker's devices along its first
dimension divisible by ``D`` (leaves with none stay replicated on the
worker's devices, with a ``UserWarning`` naming them), ``"data"``
replicates it. The jitted steps return the state with these shardings.

Many workers per device (``config.workers_per_device = K > 1``,
single-process runs): ``n_workers / K`` devices of ``K`` vmapped workers
each (:class:`decentral_jax.parallel.VirtualMesh`); the state keeps its
``[n, ...]`` layout, so checkpoints and metrics are those of ``n``
devices, and node-aware topologies run as two-level permutes and group
means (:mod:`decentral_jax.comm.collectives`).

Multi-host: after :func:`decentral_jax.runner.launch.initialize_from_config`
the mesh spans every process's devices in the order of
:func:`~decentral_jax.parallel.multiprocess.ordered_devices` (worker ``i`` on process
``i // local_device_count``; for node-aware topologies a node is a
process), and each process feeds only its own workers' data.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Sec. 5 and App. D for the experiment settings).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import config_dict

from decentral_jax import analysis
from decentral_jax.runner import agreement
from decentral_jax.runner import builders
from decentral_jax.runner import custom_task
from decentral_jax.runner import data_files
from decentral_jax.runner import methods
from decentral_jax.runner import evaluation
from decentral_jax.runner import fault_run
from decentral_jax.runner import programs as programs_lib
from decentral_jax.parallel import multiprocess
from decentral_jax.parallel import layouts
from decentral_jax import parallel
from decentral_jax.runner import step as step_lib
from decentral_jax.runner import tasks
from decentral_jax.topology import schedules as topology_lib
from decentral_jax.runner import validation

Batch = step_lib.Batch
TrainState = step_lib.TrainState

def run_keys(c) -> tuple[jax.Array, jax.Array]:
  """``(init_key, dropout_key) = split(key(config.seed))``: the keys every
  run of ``config`` draws its initial parameters and dropout keys from."""
  return tuple(jax.random.split(jax.random.key(int(c.seed))))


def worker_layout_of(c) -> layouts.WorkerLayout:
  """The :class:`~decentral_jax.parallel.layouts.WorkerLayout` of a validated config
  (``config.devices_per_worker``, ``config.worker_layout``)."""
  return layouts.WorkerLayout(int(c.devices_per_worker), c.worker_layout)


def _check_multi_process(c, n: int, n_devices: int, node_aware: bool) -> None:
  """Layout checks of a multi-process job (every device used, D per worker)."""
  procs = jax.process_count()
  dpw = int(c.devices_per_worker)
  local = jax.local_device_count()
  if local % dpw:
    raise ValueError(
        f"config.devices_per_worker={dpw} does not divide the {local} "
        "devices of each process: a worker would span two hosts; use a "
        f"divisor of {local}.")
  if n * dpw != jax.device_count() or n_devices != n * dpw:
    total = jax.device_count()
    if dpw == 1:
      raise ValueError(
          f"config.n_workers={n} but this {procs}-process job has {total} "
          f"devices ({local} per process); a multi-process run puts one "
          f"worker on every device: set --config.n_workers={total} (and a "
          "config.global_batch divisible by it).")
    raise ValueError(
        f"config.n_workers={n} x config.devices_per_worker={dpw} but this "
        f"{procs}-process job has {total} devices ({local} per process); a "
        "multi-process run uses every device: set --config.n_workers="
        f"{total // dpw}.")
  if node_aware:
    try:
      multiprocess.check_node_layout(n, int(c.workers_per_node))
    except ValueError as e:
      raise ValueError(f"config.topology={c.topology!r} is node-aware: "
                       f"config.{e}") from None


def _check_config(c, multi_process: bool) -> None:
  """Validates the config (agreed between processes first) and the job."""
  if multi_process:
    # First, so that a field that differs is reported on every process
    # before any check that could fail on some processes only.
    agreement.check_same_config(c)
  validation.check_config(c)
  if c.distributed.enabled and not jax.distributed.is_initialized():
    raise ValueError(
        "config.distributed.enabled=True but this process has not joined "
        "a multi-process job; call decentral_jax.runner.launch."
        "initialize_from_config(config) before JAX touches devices "
        "(experiments/train.py does), or set "
        "--config.distributed.enabled=False.")


def _workers_per_device(c, multi_process: bool) -> int:
  """``config.workers_per_device``, refused above 1 in a multi-process job."""
  wpd = int(c.workers_per_device)
  if wpd > 1 and multi_process:
    raise ValueError(
        f"config.workers_per_device={wpd} is supported in single-process "
        "runs only (a multi-process job puts one worker on every device); "
        "set --config.workers_per_device=1.")
  return wpd


def _make_topology(c, workers_per_device: int):
  """(the gossip topology or None, whether the mesh is node-aware).

  With ``K > 1`` workers per device node-aware rounds run as two-level
  permutes on a flat mesh, so the mesh is never node-aware then.
  """
  if not methods.ALGORITHMS[c.algorithm].uses_topology:
    return None, False
  n, local_size = int(c.n_workers), int(c.workers_per_node)
  try:
    topology = topology_lib.make(c.topology, n, local_size)
  except ValueError as e:
    raise ValueError(f"config.topology={c.topology!r} with config."
                     f"n_workers={n}, workers_per_node={local_size}: {e}"
                     ) from None
  node_aware = (workers_per_device == 1 and
                parallel.is_node_aware(topology, local_size))
  return topology, node_aware


def _make_mesh(c, devices: list, node_aware: bool):
  """The worker mesh; its errors name the config fields to change."""
  n, dpw = int(c.n_workers), int(c.devices_per_worker)
  wpd = int(c.workers_per_device)
  try:
    return parallel.make_mesh(n, int(c.workers_per_node),
                              node_aware=node_aware, devices=devices,
                              devices_per_worker=dpw, workers_per_device=wpd)
  except ValueError as e:
    if wpd > 1:
      raise ValueError(
          f"config.n_workers={n} at config.workers_per_device={wpd}: {e} "
          "Raise --config.workers_per_device or lower --config.n_workers."
          ) from None
    if dpw > 1:
      raise ValueError(
          f"config.n_workers={n} x config.devices_per_worker={dpw}: {e} "
          "Lower --config.n_workers or --config.devices_per_worker."
          ) from None
    raise ValueError(f"config.n_workers={n}: {e} experiments/train.py "
                     "sets this by itself on CPU; otherwise lower "
                     "--config.n_workers.") from None


class Experiment:
  """Everything a run needs except the file system, built from a config.

  Attributes:
    config: the (validated) config.
    mesh: ``jax.sharding.Mesh`` with one worker per device.
    axis_name: the worker axis (``"workers"`` or ``("nodes", "local")``).
    topology: the gossip :class:`~decentral_jax.topology.Topology`, or None
      for ``all_reduce``.
    task: the :class:`~decentral_jax.runner.tasks.Task` (model, loss, data).
    schedule: learning-rate schedule ``step -> lr``.
    tx: the per-worker optax transform.
    n_workers: number of workers ``n``.
    local_batch: sequences (or images) per worker per step.
    param_count: parameters of one worker's model.
    unit: ``"tokens"`` or ``"samples"``.
    tokens_per_step: tokens (LM) or samples (images) per step, all workers.
    local_workers: int64 [k]: the workers whose devices belong to this
      process (all workers in a single-process run); each process reads
      only its own workers' data.
    layout: how a worker lies on its devices
      (:class:`~decentral_jax.parallel.layouts.WorkerLayout`:
      ``config.devices_per_worker``, ``config.worker_layout``).
    workers_per_device: ``config.workers_per_device`` (``K``).
    programs: the compiled train steps
      (:class:`~decentral_jax.runner.programs.StepPrograms`: which program
      runs after a step, the resolved ``gossip_rounds`` and
      ``consensus_at``, how many times a step was traced).
    evaluator: the evaluation programs
      (:class:`~decentral_jax.runner.evaluation.Evaluator`).
    faults: the run's fault schedule and rules
      (:func:`decentral_jax.runner.fault_run.make`), or None.
    data_files: the fingerprint of the data files the task read
      (:func:`decentral_jax.runner.data_files.fingerprint`; ``{}`` for
      ``pydoc`` and a data source of your own).
  """

  def __init__(self, config: config_dict.ConfigDict, *,
               devices: list | None = None):
    """Builds mesh, topology, task, optimizer and the jitted steps.

    In a multi-process job every process also checks, with the others,
    that all processes were given the same config (except
    ``config.distributed`` and ``config.workdir``), that all of them built
    the task and that they computed the same initial parameters; if not,
    every process raises (none is left waiting in a collective).

    Args:
      config: a run config (see ``configs/gpt_tiny.py``).
      devices: devices to place workers on, in worker order (default: every
        device of the job ordered by process, then device id).

    Raises:
      ValueError: an invalid config field, more workers than devices (the
        message says how to simulate CPU devices), with
        ``config.devices_per_worker > 1``: fewer than ``n_workers *
        devices_per_worker`` devices, or in a multi-process job a
        ``devices_per_worker`` that does not divide each process's
        devices; ``config.workers_per_device > 1`` in a multi-process job;
        missing data
        files, or a
        corpus too short for the context length; in a multi-process job,
        configs that differ between processes (the fields are named),
        ``n_workers`` differing from the job's device count, a node-aware
        topology whose ``workers_per_node`` is not the number of devices
        per process, another process failing to build its task, or initial
        parameters that differ between processes.
    """
    multi_process = jax.process_count() > 1
    _check_config(config, multi_process)
    c = self.config = config
    if devices is None:
      devices = multiprocess.ordered_devices()
    self.n_workers = n = int(c.n_workers)
    self.local_batch = int(c.global_batch) // n
    self.layout = worker_layout_of(c)
    self.workers_per_device = _workers_per_device(c, multi_process)
    self.topology, node_aware = _make_topology(c, self.workers_per_device)
    if multi_process:
      _check_multi_process(c, n, len(devices), node_aware)
    self.mesh = _make_mesh(c, devices, node_aware)
    self.local_workers = (multiprocess.process_workers(self.mesh)
                          if self.workers_per_device == 1
                          else np.arange(n, dtype=np.int64))
    self.axis_name = parallel.worker_axis(self.mesh)
    self._sharding = parallel.worker_sharding(self.mesh)
    self._batch_sharding = layouts.batch_sharding(self.mesh)
    self._init_key, self._dropout_key = run_keys(c)
    self._params0 = None
    self._params0_finite = False
    self.task = (self._agreed_task() if multi_process else
                 tasks.make_task(c, n, self.local_batch))
    self.unit = self.task.unit
    self.tokens_per_step = self.task.units_per_step
    self.schedule = builders.make_schedule(c)
    self.tx = builders.make_optimizer(c, self.schedule, self.topology,
                                      self.axis_name)
    self._batch_workers = self.local_workers if multi_process else None
    self.param_count = sum(int(np.prod(x.shape)) for x in
                           jax.tree.leaves(self._param_shapes()))
    self._state_shardings, self._init_fn = self._build_init()
    # Multi-process: metrics are gathered inside the step, so every process
    # reads step t-1's metrics locally while step t runs.
    self.programs = programs_lib.StepPrograms(
        c, topology=self.topology, mesh=self.mesh, loss_fn=self.task.loss,
        tx=self.tx, axis_name=self.axis_name, sharding=self._sharding,
        state_shardings=self._state_shardings,
        gathered=(1,) if multi_process else (),
        platform=parallel.device_mesh(self.mesh).devices.flat[0].platform)
    self.faults = fault_run.make(c)  # config.faults, or None
    self.data_files = data_files.fingerprint(c)  # once, stored per checkpoint
    self.evaluator = evaluation.Evaluator(
        c, task=self.task, mesh=self.mesh, axis_name=self.axis_name,
        n_workers=n, local_batch=self.local_batch)

  # -- builders --------------------------------------------------------------

  def _param_shapes(self):
    """``jax.ShapeDtypeStruct`` leaves of one worker's parameters."""
    return jax.eval_shape(self.task.init_params, self._init_key)

  def _build_init(self):
    """(state shardings or None, jitted ``init(params, rng_data) -> state``).

    With ``devices_per_worker > 1`` the state's layout over each worker's
    devices is fixed here (``layouts.state_shardings``); otherwise the
    jitted functions pick it.
    """
    init = parallel.per_worker(
        functools.partial(step_lib.init_state, tx=self.tx), self.mesh,
        replicated_argnums=(0, 1))
    dpw = self.layout.devices_per_worker
    if dpw == 1:
      return None, jax.jit(init)
    shapes = self._param_shapes()
    layouts.check_params(
        shapes, self.layout, what=f"config.worker_layout='fsdp' with "
        f"config.devices_per_worker={dpw}: ")
    shardings = layouts.state_shardings(
        jax.eval_shape(init, shapes, jax.random.key_data(self._dropout_key)),
        self.mesh, self.layout)
    return shardings, jax.jit(init, out_shardings=shardings)

  def _agreed_task(self) -> tasks.Task:
    """The task, once every process has built it with equal initial params.

    Multi-process only: a failure on one host (e.g. its copy of the data is
    missing) is exchanged instead of leaving the others waiting, and the
    host copy of the initial parameters is kept for :meth:`init_state`.
    """
    task = params = error = None
    try:
      task = tasks.make_task(self.config, self.n_workers, self.local_batch)
      params = jax.device_get(task.init_params(self._init_key))
    except Exception as e:  # pylint: disable=broad-except
      error = e  # re-raised below on this process, after the exchange
    agreement.check_same_start(params, error)
    self._params0 = params
    return task

  # -- state and data --------------------------------------------------------

  def init_state(self) -> TrainState:
    """Initial state: identical parameters on every worker, zero moments.

    Returns:
      A :class:`~decentral_jax.runner.step.TrainState` whose leaves are
      ``[n_workers, ...]`` arrays sharded over the worker axis (``step`` 0).

    Raises:
      ValueError: an initial parameter holds NaN/inf (names the leaf), or
        the parameters and optimizer state do not fit in memory (names
        the parameter count).
    """
    try:
      if self._params0 is None:
        self._params0 = self.task.init_params(self._init_key)
      if not self._params0_finite:  # before the first step: names the leaf
        custom_task.check_finite_params(self._params0,
                                        f"model {self.config.model.name!r}")
        self._params0_finite = True
      everywhere = NamedSharding(parallel.device_mesh(self.mesh), P())
      params, rng = multiprocess.put_global(
          (self._params0, jax.random.key_data(self._dropout_key)), everywhere)
      return self._init_fn(params, rng)
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
        raise
      raise ValueError(
          f"model {self.config.model.name!r} with {self.param_count:,} "
          f"parameters per worker ({self.n_workers} workers) does not fit "
          "in memory at init (the parameters and optimizer state): lower "
          "the model's size (config.model.n_embd, n_layer) or "
          "config.n_workers.") from None

  def get_batch(self, step: int) -> Batch:
    """The training batch of ``step`` (0-based) for all workers, on device.

    Returns:
      A tuple of arrays ``[n_workers, local_batch, ...]`` (LM: int32 inputs
      and targets ``[n, B, T]``; images: uint8 ``[n, B, 28, 28]`` and int32
      labels ``[n, B]``) sharded over the worker axis (and ``B`` over each
      worker's devices with ``config.devices_per_worker > 1``). Deterministic in
      ``(seed, step)``; worker ``w`` gets its own shard of the data. In a
      multi-process job each process reads only the rows of its
      :attr:`local_workers` and the global array is assembled from them
      (``jax.make_array_from_process_local_data``).
    """
    rows = self.task.host_batch(int(step), self._batch_workers)
    if self._batch_workers is None:
      return jax.device_put(tuple(rows), self._batch_sharding)
    return tuple(
        jax.make_array_from_process_local_data(
            self._batch_sharding, x, (self.n_workers,) + x.shape[1:])
        for x in rows)

  # -- steps -------------------------------------------------------------------

  def _mask_args(self, step: int | None, state: TrainState) -> tuple:
    """``(alive, working, rejoining)`` of ``step`` if a worker is dead or
    slow then (``config.faults``), else ()."""
    if self.faults is None:
      return ()
    if step is None:
      step = self._device_step(state)
    return self.faults.masks(int(step))

  @staticmethod
  def _device_step(state: TrainState) -> int:
    return int(np.asarray(jax.device_get(
        state.step.addressable_shards[0].data)).reshape(-1)[0])

  def fault_record(self, done: int) -> dict:
    """``config.faults`` fields of the record after ``done`` steps
    (:mod:`decentral_jax.runner.fault_run`); ``{}`` without faults."""
    return {} if self.faults is None else self.faults.record(done)

  def train_step(self, state: TrainState, batch: Batch,
                 step: int | None = None) -> tuple[TrainState, dict]:
    """One step on every worker. ``state`` is donated (do not reuse it).

    Args:
      state: stacked state from :meth:`init_state` or a previous step.
      batch: from :meth:`get_batch`.
      step: the number of completed steps in ``state`` (host int), to
        pick the compiled round (``gossip_rounds="static"``), the
        consensus variant (``consensus_at="next_step"``) and, with
        ``config.faults``, the step's masks, without reading ``state.step``
        from the device (which would wait for the previous step); read from
        the device if omitted and needed.

    Returns:
      ``(new_state, metrics)``; metrics are device arrays ``[n_workers]``
      (see :func:`decentral_jax.runner.step.train_step`): ``loss``,
      ``grad_norm``, ``finite``, ``consensus_distance`` and ``accuracy``
      for classifiers. ``consensus_distance`` is that of the updated
      parameters on log steps with ``consensus_at="log_step"``, that of
      the *input* state when ``step`` is a positive multiple of
      ``log_interval`` with ``"next_step"`` (the value of the previous log
      step, measured while this step computes), NaN otherwise. In a
      multi-process job the metrics are gathered inside the step and
      replicated on every device, so each process reads all
      ``n_workers`` values locally.
    """
    masks = self._mask_args(step, state)
    if step is None and self.programs.needs_step():
      step = self._device_step(state)
    fn = self.programs.get(*self.programs.key_of(step), masks=bool(masks))
    return fn(state, batch, *masks)

  def abstract_params(self):
    """One worker's parameters as ``jax.ShapeDtypeStruct``\\ s (no compute)."""
    return self._param_shapes()

  def abstract_inputs(self) -> tuple[TrainState, Batch]:
    """``(state, batch)`` of :meth:`train_step` as sharded ShapeDtypeStructs.

    Their shapes, dtypes and shardings, built without placing anything on
    the devices (for ``programs.get(...).trace(state, batch).lower()``,
    e.g. on compile-only devices: :mod:`decentral_jax.tools.gpu_compile`).
    """
    rng = jax.eval_shape(lambda: jax.random.key_data(self._dropout_key))
    state = jax.eval_shape(self._init_fn, self._param_shapes(), rng)
    shardings = self._state_shardings
    if shardings is None:
      shardings = jax.tree.map(lambda _: self._sharding, state)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, shardings)
    rows = jax.eval_shape(lambda: tuple(self.task.host_batch(0, None)))
    batch = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=self._batch_sharding)
                  for x in rows)
    return state, batch

  def consensus_distance(self, state: TrainState) -> float:
    """``(1/n) sum_i ||x_i - x_bar||^2`` of the workers' models in ``state``
    (:meth:`decentral_jax.runner.evaluation.Evaluator.consensus_distance`)."""
    return self.evaluator.consensus_distance(state)

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Validation metrics of the averaged model and of each worker's own;
    ``state`` is read only (:meth:`decentral_jax.runner.evaluation.
    Evaluator.evaluate` lists them)."""
    return self.evaluator.evaluate(state)

  def communication(self, state: TrainState, batch: Batch, *,
                    stage: str | None = None) -> dict[str, float]:
    """Bytes the busiest worker sends per step, read from the steps' HLO.

    Lowers (and for ``stage="optimized"`` compiles) every train-step
    program with ``state`` and ``batch`` (not donated, nothing runs):
    :meth:`decentral_jax.runner.programs.StepPrograms.communication`, read
    by :func:`decentral_jax.analysis.run_communication.run_bytes` (the mean
    over a period, in which a sync every ``H`` steps counts ``1 / H`` and
    the rounds of a topology count by how often they occur; the
    consensus-distance diagnostics of logging steps apart).

    Returns:
      ``{"bytes_per_step", "diagnostics_bytes_per_step", "param_bytes",
      "ratio", "stage"}`` and, with several devices per worker or workers
      per device, the per-device figures (see ``run_bytes``).
    """
    params = (self._params0 if self._params0 is not None
              else self._param_shapes())
    return self.programs.communication(
        state, batch, param_bytes=analysis.tree_bytes(params), stage=stage)

  def learning_rate(self, step: int) -> float:
    """Learning rate used by the update of step ``step`` (1-based)."""
    return float(self.schedule(max(int(step) - 1, 0)))
