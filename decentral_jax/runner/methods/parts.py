"""Parts the method homes share: the wire dtypes, AdamW / AccumAdamW, the
gradient clip, the compressor, the inner optimizer and the runtime-model
message settings of a run config.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from decentral_jax.comm import compress
from decentral_jax.optim import transforms
from decentral_jax.runner import extensions

# config.comm_dtype -> the dtype on the wire of the synchronisation.
COMM_DTYPES = {"": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
               "float32": jnp.float32}


def own_optimizer(config, schedule) -> optax.GradientTransformation:
  """Your own inner optimizer: ``build(learning_rate=schedule)`` of the
  builder ``config.optimizer.name`` names (``extensions.resolve``).

  Raises:
    ValueError: the name does not resolve, the builder fails, or it returns
      no optax ``GradientTransformation`` (one line naming it).
  """
  name = config.optimizer.name
  build = extensions.resolve("optimizer", name)
  try:
    tx = build(learning_rate=schedule)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"config.optimizer.name={name!r}: build(learning_rate="
                     f"schedule) failed: {type(e).__name__}: "
                     f"{' '.join(str(e).split())}") from None
  if not (callable(getattr(tx, "init", None)) and
          callable(getattr(tx, "update", None))):
    raise ValueError(f"config.optimizer.name={name!r} returned a "
                     f"{type(tx).__name__}, not an optax "
                     "GradientTransformation.")
  return tx


def adam(config, schedule) -> list[optax.GradientTransformation]:
  """AdamW (``adamw``) or AccumAdamW (``accum_adamw``) of ``config.optimizer``,
  or your own inner optimizer (any other name: :func:`own_optimizer`).

  Weight decay on leaves with ``ndim >= 2``; the learning rate ``schedule``.
  """
  o = config.optimizer
  if o.name not in ("adamw", "accum_adamw"):
    return [own_optimizer(config, schedule)]
  mask = transforms.default_weight_decay_mask
  if o.name == "adamw":
    return [optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=mask)]
  return [transforms.scale_by_accum_adam(o.b1, o.b2, o.eps,
                                    accum_steps=int(o.accum_steps),
                                    beta_convention=o.beta_convention),
          optax.add_decayed_weights(o.weight_decay, mask),
          optax.scale_by_learning_rate(schedule)]


def clipped(config, tx: optax.GradientTransformation):
  """``chain(clip_by_global_norm(config.grad_clip), tx)`` (``tx`` if 0)."""
  clip = float(config.grad_clip)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


def compressor(config) -> compress.Compressor | None:
  """``config.compression`` as a Compressor, or None for ``"none"``."""
  c = config.compression
  if c.format == "none":
    return None
  if c.format == "topk":
    return compress.Compressor("topk", block=int(c.block),
                               fraction=float(c.fraction))
  return compress.Compressor(str(c.format), block=int(c.block))


def inner(config, schedule) -> optax.GradientTransformation:
  """The worker-local inner optimizer of the local-update methods and SGP.

  ``chain(clip_by_global_norm(c), adamw)`` on each worker's own gradient.
  """
  return clipped(config, optax.chain(*adam(config, schedule)))


def message_settings(config, fields, *, buckets: bool = False) -> list[str]:
  """The runtime-model spec's message settings of a run config.

  ``comm_dtype=..`` if the method reads ``comm_dtype`` (in ``fields``) and
  it is set; ``compress=..,block=..[,fraction=..]`` if it reads
  ``compression.format`` and it is not ``none``; with ``buckets``,
  ``bucket_MiB=..`` (MiB, 2**20 bytes) if ``bucket_bytes > 0`` (0: one
  collective per leaf keeps the workload's buckets).
  """
  extra = []
  if config.comm_dtype and "comm_dtype" in fields:
    extra.append(f"comm_dtype={config.comm_dtype}")
  comp = config.compression
  if comp.format != "none" and "compression.format" in fields:
    extra += [f"compress={comp.format}", f"block={int(comp.block)}"]
    if comp.format == "topk":
      extra.append(f"fraction={float(comp.fraction):g}")
  if buckets and int(config.bucket_bytes) > 0:
    extra.append(f"bucket_MiB={int(config.bucket_bytes) / 2**20:g}")
  return extra


def with_settings(spec: str, extra: list[str]) -> str:
  """``spec`` with the settings ``extra`` appended (``NAME[:K=V,...]``)."""
  if not extra:
    return spec
  return spec + ("," if ":" in spec else ":") + ",".join(extra)
