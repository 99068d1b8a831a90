"""The runtime model's command line (``python -m decentral_jax.runtime_model``,
``decentral-jax predict|measure|validate``).

:mod:`~decentral_jax.tools.runtime_model_cli.main` (dispatch to the
subcommands), :mod:`~decentral_jax.tools.runtime_model_cli.parser` (the
flag tables), :mod:`~decentral_jax.tools.runtime_model_cli.inputs` (flags to
a cluster and workload), :mod:`~decentral_jax.tools.runtime_model_cli.tables`
(printing and charts), one module per subcommand's flow
(:mod:`~decentral_jax.tools.runtime_model_cli.predict`, with its dependency
table in :mod:`~decentral_jax.tools.runtime_model_cli.predict_needs`,
:mod:`~decentral_jax.tools.runtime_model_cli.paper_checks`), and
:mod:`~decentral_jax.tools.runtime_model_cli.measure` and
:mod:`~decentral_jax.tools.runtime_model_cli.calibrate` (measurements on this
machine, through the runner).
"""
