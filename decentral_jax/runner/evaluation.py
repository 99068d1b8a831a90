"""Evaluation of a run: the averaged model, each worker's own model, and the
consensus distance, as separate programs that leave training untouched.

:class:`Evaluator` compiles the evaluation over all workers
(:func:`decentral_jax.runner.step.eval_step`) and the consensus distance
``(1/n) sum_i ||x_i - x_bar||^2`` (:func:`decentral_jax.comm.gossip.
consensus_distance`); both read the workers' *model* parameters, which for
SGP are ``z = x / w`` and for DiLoCo-style methods their own ``x``
(``methods.ALGORITHMS[...].model_params``), and the evaluation averages
what the method evaluates (``eval_params``: DiLoCo's global ``theta``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from decentral_jax.comm import gossip
from decentral_jax import parallel
from decentral_jax.parallel import multiprocess
from decentral_jax.runner import methods
from decentral_jax.runner import step as step_lib


class Evaluator:
  """The jitted evaluation and consensus distance of one run.

  The validation set is placed on the devices at the first
  :meth:`evaluate`.
  """

  def __init__(self, config, *, task, mesh, axis_name, n_workers: int,
               local_batch: int):
    """Builds (does not compile) the two programs.

    Args:
      config: the validated run config (``algorithm``).
      task: the run's :class:`~decentral_jax.runner.tasks.Task` (loss,
        ``eval_set``).
      mesh: the worker mesh; ``axis_name`` its worker axis.
      n_workers: workers ``n``.
      local_batch: rows per worker of an eval batch (``global_batch / n``).
    """
    self._task, self._mesh, self._axis = task, mesh, axis_name
    self._n, self._b = n_workers, local_batch
    self._algorithm = methods.ALGORITHMS[config.algorithm]
    self._eval_set = None  # placed on the devices at the first evaluation
    self._eval_step = self._build_eval_step()
    self._consensus_step = self._build_consensus_step()

  def _build_consensus_step(self):
    """The jitted consensus distance of a state's models (a separate program)."""
    algorithm = self._algorithm

    def consensus_worker(params, opt_state):
      own = (params if algorithm.model_params is None
             else algorithm.model_params(params, opt_state))
      return gossip.consensus_distance(own, self._axis)

    return jax.jit(parallel.per_worker(consensus_worker, self._mesh))

  def _build_eval_step(self):
    """The jitted evaluation over all workers (see :meth:`evaluate`)."""
    algorithm = self._algorithm

    def eval_worker(params, opt_state, rows, common):
      own = (params if algorithm.model_params is None
             else algorithm.model_params(params, opt_state))
      averaged = (None if algorithm.eval_params is None
                  else algorithm.eval_params(params, opt_state))
      return step_lib.eval_step(own, rows, common, loss_fn=self._task.loss,
                                axis_name=self._axis, averaged=averaged)

    return jax.jit(parallel.per_worker(
        eval_worker, self._mesh, replicated_argnums=(3,)))

  def _place_eval_set(self):
    """Eval rows per worker ``[n, E, B, ...]`` and a common subset ``[E, B, ...]``.

    Worker ``w`` holds rows ``w*B .. w*B+B-1`` of every eval batch (for the
    averaged model); the common subset is every ``n``-th row (spread over the
    whole validation set), the same for all workers.
    """
    n, b = self._n, self._b
    rows, common = [], []
    for x in self._task.eval_set:
      e = x.shape[0]
      per = x.reshape((e, n, b) + x.shape[2:]).swapaxes(0, 1)
      rows.append(np.ascontiguousarray(per))
      common.append(np.ascontiguousarray(x[:, ::n]))
    return (multiprocess.put_global(tuple(rows),
                                    parallel.worker_sharding(self._mesh)),
            multiprocess.put_global(tuple(common),
                                    NamedSharding(
                                        parallel.device_mesh(self._mesh),
                                        P())))

  def consensus_distance(self, state: step_lib.TrainState) -> float:
    """``(1/n) sum_i ||x_i - x_bar||^2`` of ``state`` (a separate program).

    The consensus distance of the workers' models (for SGP ``z = x / w``),
    float64 on the host; one synchronous All-Reduce of the parameters.
    """
    out = self._consensus_step(state.params, state.opt_state)
    return float(np.asarray(multiprocess.to_host(out)).reshape(-1)[0])

  def evaluate(self, state: step_lib.TrainState) -> dict[str, float]:
    """Validation metrics; ``state`` is read only (training is unaffected).

    The averaged model is ``x_bar = (1/n) sum_i x_i`` (exact mean, computed
    on the fly, never written back; for DiLoCo-style methods the mean of
    their global parameters ``theta``); it is evaluated on all
    ``eval_batches * global_batch`` validation sequences (images), split
    over the workers. Each worker's own parameters, and the averaged model
    again, are evaluated on a common subset (every ``n_workers``-th row of
    every eval batch, i.e. ``1/n`` of the validation set spread over all of
    it), so own-model and averaged-model losses compare on the same data.

    Returns:
      Floats, means taken in float64 on the host: ``eval/loss`` (averaged
      model, whole eval set, nats);
      ``eval/worker_loss_mean``, ``_min``, ``_max``, ``_std`` (the workers'
      own models on the subset); ``eval/loss_subset`` (averaged model on the
      subset); ``eval/worker_excess_mean`` and ``_max`` (own-model loss minus
      ``eval/loss_subset``: what the workers lose by not being averaged);
      ``consensus_distance``; and ``eval/accuracy`` for classifiers.
    """
    if self._eval_set is None:
      self._eval_set = self._place_eval_set()
    out = multiprocess.to_host(self._eval_step(state.params, state.opt_state,
                                              *self._eval_set))
    # [n, E] per worker and eval batch, averaged in float64: finite float32
    # losses keep a finite mean.
    per = {k: np.asarray(out[k], np.float64).reshape(self._n, -1)
           for k in ("avg_loss", "avg_accuracy", "own_loss",
                     "avg_subset_loss")}
    own = per["own_loss"].mean(axis=1)
    subset = float(per["avg_subset_loss"][0].mean())
    with np.errstate(invalid="ignore"):  # inf - inf: the record is refused
      result = self._result(per, own, subset, out)
    accuracy = self._task.has_accuracy
    if accuracy or (accuracy is None and self._task.unit == "samples"):
      result["eval/accuracy"] = float(per["avg_accuracy"].mean())
    return result

  @staticmethod
  def _result(per: dict, own: np.ndarray, subset: float, out: dict) -> dict:
    return {
        "eval/loss": float(per["avg_loss"].mean()),
        "eval/worker_loss_mean": float(own.mean()),
        "eval/worker_loss_min": float(own.min()),
        "eval/worker_loss_max": float(own.max()),
        "eval/worker_loss_std": float(own.std()),
        "eval/loss_subset": subset,
        "eval/worker_excess_mean": float(own.mean() - subset),
        "eval/worker_excess_max": float(own.max() - subset),
        "consensus_distance": float(out["consensus_distance"][0]),
    }
