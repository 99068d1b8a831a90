"""Decoupled learners: each learner its own JAX program, joined to a
synchronizer through Ray (docs/learners.md).

* :mod:`~decentral_jax.tools.learners.spec`: the run both sides agree on;
* :mod:`~decentral_jax.tools.learners.synchronizer`: ``theta``, the outer
  optimizer and the merge (sync, or decoupled with quorum and grace);
* :mod:`~decentral_jax.tools.learners.learner`: the inner steps of one
  learner on its data shard;
* :mod:`~decentral_jax.tools.learners.fragments`: Streaming DiLoCo's
  fragment partition and schedule;
* :mod:`~decentral_jax.tools.learners.outer`: the outer optimizers
  (Nesterov SGD, Delayed Nesterov);
* :mod:`~decentral_jax.tools.learners.cluster`: both as Ray actors (Ray is
  imported only there, only when used);
* :mod:`~decentral_jax.tools.learners.flags`: its flags and the run they
  describe;
* :mod:`~decentral_jax.tools.learners.main`: ``decentral-jax learners``.
"""
