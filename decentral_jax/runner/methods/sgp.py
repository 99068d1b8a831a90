"""SGP: Stochastic Gradient Push (Assran et al., ICML 2019).

The inner AdamW steps on the push-sum numerators; every step one blocking
push-sum round over ``config.topology`` mixes numerators and weights, and
the model is the de-biased ``numerator / weight``
(:mod:`decentral_jax.optim.push_sum`). The evaluation averages the
numerators; ``global_avg_interval`` averages numerators and weights
(:func:`~decentral_jax.optim.push_sum.global_average`). Priced as the
runtime model's ``sgp`` (a blocking round on the directed one-peer
exponential graph).
"""

from __future__ import annotations

from decentral_jax.optim import push_sum
from decentral_jax.runner.methods import decentralized
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry


def build(config, schedule, topology, axis_name):
  """SGP: the inner AdamW on the numerators, push-sum mixing over topology."""
  return push_sum.push_sum(parts.inner(config, schedule), topology, axis_name,
                           comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
                           bucket_bytes=int(config.bucket_bytes))


def numerators(params, opt_state):
  """The evaluated parameters: the push-sum numerators (averaged)."""
  del opt_state
  return params


FIELDS = (*decentralized.GOSSIP_FIELDS, "global_avg_interval")


def runtime_spec(config) -> str:
  """``sgp[:comm_dtype=..]``: the model prices the blocking round as one
  message, so ``config.bucket_bytes`` does not enter the spec."""
  return parts.with_settings("sgp", parts.message_settings(config, FIELDS))


SGP = registry.register(registry.Method(
    "sgp", build, fields=FIELDS, runtime_spec=runtime_spec, label="sgp",
    uses_topology=True, static_rounds=True, eval_params=numerators,
    model_params=push_sum.debiased, global_average=push_sum.global_average))
