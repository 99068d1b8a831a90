"""The experiment runner: config -> trained, checkpointed workers.

Above the library: it imports the parts below it (checks, topology, comm,
optim, parallel, analysis, models, data, method_names), never the runtime
model or the tools; only the tools import it. Its modules hold the runner's concepts and are imported by
path, so this face imports only the extension points
(:mod:`~decentral_jax.runner.extensions`, which loads no JAX:
``register_model``, ``register_data``, ``register_optimizer``, ``Model``,
``Data``, ``linen_model``, ``nnx_model``; docs/extending.md):

* your own model, data and optimizer: :mod:`~decentral_jax.runner.extensions`
  (names and builders), :mod:`~decentral_jax.runner.custom_task` (the task
  built from them, checked before any compile);
* the config: :mod:`~decentral_jax.runner.config` (``base_config``,
  loading), :mod:`~decentral_jax.runner.config_groups` (one builder per
  group of fields), :mod:`~decentral_jax.runner.presets` (the named runs),
  :mod:`~decentral_jax.runner.field_rules` and
  :mod:`~decentral_jax.runner.validation` (one-line refusals),
  :mod:`~decentral_jax.runner.devices` (devices a config needs);
* the methods: :mod:`~decentral_jax.runner.methods` (one home per method
  family and the registry), :mod:`~decentral_jax.runner.builders`
  (schedule, optimizer and runtime-model spec of a config);
* the run: :mod:`~decentral_jax.runner.tasks` (model, loss, data),
  :mod:`~decentral_jax.runner.step` (per-worker steps),
  :mod:`~decentral_jax.runner.experiment` (mesh and state),
  :mod:`~decentral_jax.runner.programs` (the compiled steps),
  :mod:`~decentral_jax.runner.evaluation`,
  :mod:`~decentral_jax.runner.fault_run` (fault masks),
  :mod:`~decentral_jax.runner.train` (the loop),
  :mod:`~decentral_jax.runner.recorder` and
  :mod:`~decentral_jax.runner.preemption`;
* what a run keeps: :mod:`~decentral_jax.runner.checkpoint`,
  :mod:`~decentral_jax.runner.run_meta` (resume checks),
  :mod:`~decentral_jax.runner.orbax_quiet`,
  :mod:`~decentral_jax.runner.metrics`, :mod:`~decentral_jax.runner.workdir`;
* several processes: :mod:`~decentral_jax.runner.launch`,
  :mod:`~decentral_jax.runner.agreement`; and
  :mod:`~decentral_jax.runner.tuning` (the learning-rate protocol).
"""

from decentral_jax.runner.extensions import Data
from decentral_jax.runner.extensions import Model
from decentral_jax.runner.extensions import linen_model
from decentral_jax.runner.extensions import nnx_model
from decentral_jax.runner.extensions import register_data
from decentral_jax.runner.extensions import register_model
from decentral_jax.runner.extensions import register_optimizer

__all__ = ["Data", "Model", "linen_model", "nnx_model", "register_data",
           "register_model", "register_optimizer"]
