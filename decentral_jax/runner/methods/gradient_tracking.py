"""Gradient tracking: DAdam / AccumAdamW along a tracked gradient (DIGing,
Nedic, Olshevsky and Shi 2017; Koloskova, Lin and Stich 2021;
:mod:`decentral_jax.optim.gradient_tracking`).

``config.algorithm = "gradient_tracking"``: each worker clips its own
gradient ``g``, the tracker ``y_k = W_k y_{k-1} + g_k - g_{k-1}`` (``y_0
= g_0``) gossips over ``config.topology`` with the parameters, and DAdam
(``optimizer.name = "adamw"``) or AccumAdamW (``accum_adamw``) takes ``y``
as its gradient (the tracked quantity is the gradient fed to Adam, as in
GTAdam, Carnevale et al. 2023): from ``W_k x_k`` (combine-then-adapt,
DAdam's order, the default) or, with ``tracking.adapt_then_combine``,
mixing after the step. One extra gossip of ``y`` per step,
overlapped like the parameters'. Priced as the runtime model's
``gradient_tracking:topology=T`` (twice the bytes of ``dadam``). Refused
with compression, ``gossip_every > 1``, ``global_avg_interval`` and
faults.
"""

from __future__ import annotations

from decentral_jax.optim import gradient_tracking
from decentral_jax.optim import transforms
from decentral_jax.runner import field_checks
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry

FIELDS = ("topology", "comm_dtype", "bucket_bytes", "gossip_rounds")
CONFIG_FIELDS = {
    "tracking.adapt_then_combine": registry.ConfigField(
        False, field_checks.boolean,
        "gradient_tracking: mix after the local step, x+ = W (x - lr d(y)) "
        "(Koloskova et al. 2021, Alg. 1) instead of from W x (DIGing)"),
}
_NAME = "config.algorithm='gradient_tracking'"


def form(config) -> str:
  """``"atc"`` if ``config.tracking.adapt_then_combine``, else ``"cta"``."""
  return "atc" if bool(config.tracking.adapt_then_combine) else "cta"


def build(config, schedule, topology, axis_name):
  """``chain(clip_by_global_norm(c), gradient_tracking_adamw)``."""
  o = config.optimizer
  accum = int(o.accum_steps) if o.name == "accum_adamw" else 1
  return parts.clipped(config, gradient_tracking.gradient_tracking_adamw(
      schedule, topology, form=form(config), b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, mask=transforms.default_weight_decay_mask,
      accum_steps=accum, axis_name=axis_name,
      comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
      bucket_bytes=int(config.bucket_bytes),
      beta_convention=o.beta_convention))


def checks(config) -> None:
  """What gradient tracking cannot run yet, each refused by its field."""
  if int(config.gossip_every) != 1:
    raise ValueError(
        f"config.gossip_every={config.gossip_every} with {_NAME}: the "
        "tracker gossips with the parameters every step (no local steps); "
        "set --config.gossip_every=1.")
  fmt = config.compression.format
  if fmt != "none":
    raise ValueError(
        f"config.compression.format={fmt!r} with {_NAME}: compressed "
        "gossip of the parameters and the tracker is not supported; set "
        "--config.compression.format=none (or --config.algorithm="
        "decentralized for CHOCO-gossip).")
  if int(config.global_avg_interval) != 0:
    raise ValueError(
        f"config.global_avg_interval={config.global_avg_interval} with "
        f"{_NAME}: a global average of the parameters alone is not "
        "implemented for the tracker; set --config.global_avg_interval=0.")


def runtime_spec(config) -> str:
  """``gradient_tracking:topology=T`` with the message settings."""
  return parts.with_settings(
      f"gradient_tracking:topology={config.topology}",
      parts.message_settings(config, FIELDS, buckets=True))


GRADIENT_TRACKING = registry.register(registry.Method(
    "gradient_tracking", build, fields=FIELDS, runtime_spec=runtime_spec,
    label="Gradient tracking", uses_topology=True, static_rounds=True,
    checks=checks, config_fields=CONFIG_FIELDS,
    # DAdam on the one-peer exponential graph with a tracker; its peak lr
    # chosen by the tuning protocol in the main job's setting (gpt_tiny, 8
    # workers, 300 steps, seed 0): final validation loss 2.202, 2.155,
    # 2.382, 2.428 at 1.5e-3, 3e-3, 6e-3, 1.2e-2.
    arms=(registry.Arm("gradient_tracking", optimizer="adamw",
                       topology="one_peer_exp", peak_lr=3e-3),)))
