"""Tools: the command lines and the main job, on top of the library.

The top floor of the layers (checks -> topology -> comm -> {optim, parallel}
-> runner -> tools): it may import every other part of the package, and
nothing below imports it. Each tool is a module with ``main(argv) -> int``,
imported by name only when it runs, so this face imports nothing (no JAX):

* :mod:`decentral_jax.tools.cli`: the ``decentral-jax`` command;
* :mod:`decentral_jax.tools.train`: train one configuration;
* :mod:`decentral_jax.tools.compare`: the main job;
* :mod:`decentral_jax.tools.runtime_model_cli`: the runtime model's command
  line (``python -m decentral_jax.runtime_model``; ``predict`` and
  ``validate`` import no JAX);
* :mod:`decentral_jax.tools.gpu_compile` and
  :mod:`decentral_jax.tools.latency_profile`: compiling the runner's train
  steps for GPU targets without a GPU, with collectives priced by the
  runtime model; :mod:`decentral_jax.tools.overlap` reports what overlaps
  (:mod:`decentral_jax.tools.dummy_bins`: the token files of zeros its
  gpt2_small case compiles on, never replacing a user's).
"""
