"""The runtime model's command line (``python -m decentral_jax.runtime_model``).

:mod:`~decentral_jax.runtime_model.cli.main` (sub-commands),
:mod:`~decentral_jax.runtime_model.cli.inputs` (flags to a cluster and
workload), :mod:`~decentral_jax.runtime_model.cli.measure` and
:mod:`~decentral_jax.runtime_model.cli.calibrate` (measurements on this
machine, through the runner). The only part of the runtime model that may
import the runner.
"""
