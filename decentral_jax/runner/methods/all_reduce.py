"""All-Reduce: the exact gradient average, then AdamW (Wang et al. 2025,
Alg. 2; the baseline every other method is compared with).

``chain(all_reduce_gradients, clip_by_global_norm(c), adamw)``: the workers
hold equal parameters, so it reads no gossip, sync or compression field
(and ``global_avg_interval`` would average equal values). Priced as the
runtime model's ``all_reduce`` (its buckets from ``bucket_bytes``).
"""

from __future__ import annotations

import optax

from decentral_jax.optim import transforms
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry


def build(config, schedule, topology, axis_name):
  """``chain(all_reduce_gradients, clip_by_global_norm(c), adamw)``.

  The clip acts on the averaged gradient; ``accum_adamw`` applies
  AccumAdamW after the all-reduce.
  """
  del topology
  clip = float(config.grad_clip)
  steps = [transforms.all_reduce_gradients(axis_name)]
  if clip:
    steps.append(optax.clip_by_global_norm(clip))
  return optax.chain(*steps, *parts.adam(config, schedule))


def runtime_spec(config) -> str:
  """``all_reduce[:bucket_MiB=..]``."""
  return parts.with_settings(
      "all_reduce", parts.message_settings(config, (), buckets=True))


ALL_REDUCE = registry.register(registry.Method(
    "all_reduce", build, fields=(), runtime_spec=runtime_spec,
    label="all_reduce"))
