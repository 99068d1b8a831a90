"""MuLoCo: DiLoCo and Streaming DiLoCo with Muon as the inner optimizer
(Therien et al., arXiv 2505.23725; :mod:`decentral_jax.optim.muloco`).

Every worker takes ``sync_every = H`` inner steps with Muon on its hidden
matrices and AdamW on its embeddings, LayerNorm scales and biases
(:func:`decentral_jax.optim.muloco.muon_inner`: the leaf table is there),
on its own gradient clipped to ``grad_clip``; then, as DiLoCo
(``num_fragments = 1``) or Streaming DiLoCo (``num_fragments > 1``, with
``overlap_steps`` and ``merge_alpha``), the pseudo-gradients are averaged
(in ``comm_dtype``, or compressed with error feedback by
``config.compression``: 4-bit ``int4``/``fp4`` is the paper's low-bit
setting; the library has no 2-bit format) and the outer optimizer steps
``theta``, the evaluated model. The composition is the local-update
methods' own (:func:`decentral_jax.runner.methods.local_updates.diloco_with`,
:func:`~decentral_jax.runner.methods.local_updates.streaming_diloco_with`).

Its own fields: ``muon.ns_steps`` (Newton-Schulz iterations),
``muon.beta`` (Muon's Nesterov momentum), ``muon.consistent_rms`` (Muon's
update RMS per unit learning rate, 0.2 matches AdamW's so that
``schedule.peak_lr`` serves both branches) and ``muon.adam_lr_ratio`` (the
other branch's learning rate over Muon's). The other branch is the run's
``config.optimizer`` (``adamw`` as in the paper and ``configs/
muloco_tiny.py``, or ``accum_adamw``); ``optimizer.weight_decay`` decays
every 2-D leaf of both branches. Priced as the runtime model's ``diloco:H=..``
or ``streaming_diloco:H=..,P=..,tau=..`` (the bytes do not depend on the
inner optimizer; Muon's Newton-Schulz FLOPs are not in the compute time).
"""

from __future__ import annotations

import optax

from decentral_jax.optim import muloco
from decentral_jax.runner import field_checks
from decentral_jax.runner.methods import local_updates
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry

FIELDS = ("sync_every", "outer_optimizer.name", "outer_optimizer.lr",
          "outer_optimizer.momentum", "outer_optimizer.nesterov",
          "comm_dtype", "num_fragments", "overlap_steps", "merge_alpha",
          "compression.format", "compression.block", "compression.fraction",
          "compression.error_feedback", "compression.error_decay")
CONFIG_FIELDS = {
    "muon.ns_steps": registry.ConfigField(
        5, field_checks.integer(1, muloco.MAX_NS_STEPS),
        "muloco: Newton-Schulz iterations of Muon's orthogonalization"),
    "muon.beta": registry.ConfigField(
        0.95, field_checks.real(0.0, 1.0),
        "muloco: Muon's (Nesterov) momentum, in [0, 1)"),
    "muon.consistent_rms": registry.ConfigField(
        0.2, field_checks.real(0.0, field_checks.MAX_LR, hi_closed=True),
        "muloco: RMS of Muon's update per unit learning rate (0.2: AdamW's; "
        "0: Muon's width scaling sqrt(max(1, fan_out / fan_in)))"),
    "muon.adam_lr_ratio": registry.ConfigField(
        1.0, field_checks.real(0.0, field_checks.MAX_LR, lo_open=True,
                               hi_closed=True),
        "muloco: learning rate of the AdamW leaves (embeddings, scales, "
        "biases) over Muon's"),
}
# The main job's arms: compare's DiLoCo arm (H = 10, outer Nesterov lr 0.3)
# with Muon inside, its pseudo-gradients exact or in int4 with error
# feedback (blocks of 256; its own wire format, so comm_dtype stays unset).
# Peak lr: the tuning protocol's choice for "muloco" in the main job's
# setting (gpt_tiny, 8 workers, 300 steps, seed 0): final validation loss
# 2.157, 2.050, 1.841, 1.692 at 1.5e-3 .. 1.2e-2, then 1.667 at 2.4e-2 and
# 1.841 at 4.8e-2 (the grid extended twice past its high end).
# "muloco_int4" runs at the same lr (not re-tuned).
_SYNC = (("sync_every", 10), ("outer_optimizer.lr", 0.3))
PEAK_LR = 2.4e-2
ARMS = (
    registry.Arm("muloco", fields=_SYNC, peak_lr=PEAK_LR),
    registry.Arm("muloco_int4", fields=(
        *_SYNC, ("comm_dtype", ""), ("compression.format", "int4"),
        ("compression.error_feedback", True)), peak_lr=PEAK_LR),
)
# Fields Streaming DiLoCo reads and DiLoCo (one fragment) does not.
_STREAMING_ONLY = ("overlap_steps", "merge_alpha")


def inner(config, schedule):
  """``chain(clip_by_global_norm(grad_clip), muon_inner)`` of ``config``:
  the other leaves take the run's ``config.optimizer`` (AdamW or
  AccumAdamW, :func:`parts.adam`) at ``muon.adam_lr_ratio`` times the
  schedule."""
  m = config.muon
  return parts.clipped(config, muloco.muon_inner(
      schedule, ns_steps=int(m.ns_steps), beta=float(m.beta),
      consistent_rms=float(m.consistent_rms),
      adam_lr_ratio=float(m.adam_lr_ratio),
      weight_decay=float(config.optimizer.weight_decay),
      adam=lambda lr: optax.chain(*parts.adam(config, lr))))


def build(config, schedule, topology, axis_name):
  """DiLoCo (``num_fragments = 1``) or Streaming DiLoCo around Muon."""
  del topology
  if int(config.num_fragments) == 1:
    return local_updates.diloco_with(inner(config, schedule), config, None,
                                     axis_name)
  return local_updates.streaming_diloco_with(inner(config, schedule), config,
                                             axis_name)


def checks(config) -> None:
  """Streaming DiLoCo's fragments and overlap fit in the sync period."""
  if int(config.num_fragments) > 1:
    local_updates.check_fragments(config)


def unread(config, field: str) -> str | None:
  """``overlap_steps`` and ``merge_alpha`` with one fragment (DiLoCo)."""
  if field in _STREAMING_ONLY and int(config.num_fragments) == 1:
    return ("config.num_fragments=1 (MuLoCo is plain DiLoCo; overlap_steps "
            "and merge_alpha are Streaming DiLoCo's, num_fragments > 1)")
  return None


def runtime_spec(config) -> str:
  """``diloco:H=..`` or ``streaming_diloco:H=..,P=..,tau=..``, with the
  message settings (``comm_dtype``, ``compress``, ``block``)."""
  h, p = int(config.sync_every), int(config.num_fragments)
  spec = (f"diloco:H={h}" if p == 1 else
          f"streaming_diloco:H={h},P={p},tau={int(config.overlap_steps)}")
  return parts.with_settings(spec, parts.message_settings(config, FIELDS))


MULOCO = registry.register(registry.Method(
    "muloco", build, fields=FIELDS, runtime_spec=runtime_spec,
    label="MuLoCo", checks=checks, unread=unread,
    compression_checks=local_updates.check_compression,
    warnings=local_updates.diloco_warnings,
    eval_params=local_updates.theta, config_fields=CONFIG_FIELDS,
    arms=ARMS))
