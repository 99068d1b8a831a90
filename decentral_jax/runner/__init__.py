"""The experiment runner: config -> trained, checkpointed workers.

:mod:`~decentral_jax.runner.config` (schema), :mod:`~decentral_jax.runner.validation`
(one-line config errors), :mod:`~decentral_jax.runner.builders` (schedule and
optimizer from a config), :mod:`~decentral_jax.runner.tasks` (model, loss, data),
:mod:`~decentral_jax.runner.step` (``TrainState``, per-worker steps),
:mod:`~decentral_jax.runner.experiment` (mesh, jitted steps, evaluation),
:mod:`~decentral_jax.runner.train` (the loop), :mod:`~decentral_jax.runner.checkpoint`,
:mod:`~decentral_jax.runner.metrics`, :mod:`~decentral_jax.runner.workdir`,
:mod:`~decentral_jax.runner.agreement`, :mod:`~decentral_jax.runner.launch`
(multi-process start-up) and :mod:`~decentral_jax.runner.tuning`.

The top layer: it may import every other part of the library. Nothing
below imports it.
"""
