"""Decentralized training: DAdam / AccumAdamW gossip, CHOCO-gossip, Local
DAdam (Wang et al. 2025, Alg. 1 and 4; Koloskova et al. 2019 for CHOCO).

``config.algorithm = "decentralized"``: each worker clips its own gradient,
then DAdam (``optimizer.name = "adamw"``) or AccumAdamW (``accum_adamw``)
steps from the gossip-mixed point ``W_k x_k``, one round of the mixing
matrix of ``config.topology`` every ``gossip_every`` steps (Local DAdam for
``gossip_every > 1``). With ``config.compression``: the local step, then
CHOCO-gossip of ``x_i + u_i`` with error feedback through the public copies
``x_hat`` (consensus step ``compression.consensus_step``). Priced as the
runtime model's ``dadam`` / ``accum_adam`` (overlapped gossip), or
``local_dsgd:H=..`` for ``gossip_every > 1``. With
``config.pipelined_gossip``: the round sent in step k is mixed in step k+1
(:mod:`decentral_jax.optim.pipelined`), priced with ``pipelined=1``; with
``config.compression`` too, pipelined CHOCO-gossip (the round of the step's
input parameters, in flight with the forward and backward;
:func:`decentral_jax.optim.choco.choco_gossip` with ``pipelined=True``).
"""

from __future__ import annotations

import optax

from decentral_jax.optim import choco
from decentral_jax.optim import pipelined
from decentral_jax.optim import transforms
from decentral_jax.runner import field_checks
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry
from decentral_jax.topology import schedules as topology_lib

GOSSIP_FIELDS = ("topology", "comm_dtype", "bucket_bytes", "gossip_rounds")
CHOCO_FIELDS = ("compression.format", "compression.block",
                "compression.fraction", "compression.consensus_step")


def build(config, schedule, topology, axis_name):
  """``chain(clip_by_global_norm(c), decentralized_adamw)``.

  Each worker clips its own gradient, then DAdam (``adamw``) or AccumAdamW
  (``accum_adamw``) steps from the gossip-mixed point ``W_k x_k``, mixing
  every ``config.gossip_every`` steps. With ``config.compression``:
  ``chain(clip, AdamW or AccumAdamW, choco_gossip)``, the local step
  ``u_i`` then CHOCO-gossip of ``x_i + u_i`` (:mod:`optim.choco`; of
  ``x_i`` beside the local step with ``config.pipelined_gossip``). Your
  own inner optimizer (``optimizer.name`` neither adamw nor accum_adamw,
  :func:`parts.own_optimizer`): ``chain(clip, decentralized(inner))``, its
  step taken from ``W_k x_k`` (:func:`transforms.decentralized`).
  """
  comp = parts.compressor(config)
  if comp is not None:
    gamma = float(config.compression.consensus_step)
    return parts.clipped(config, optax.chain(
        *parts.adam(config, schedule),
        choco.choco_gossip(topology, comp, gamma, axis_name,
                           pipelined=bool(config.pipelined_gossip))))
  o = config.optimizer
  if o.name not in ("adamw", "accum_adamw"):  # your own inner optimizer
    return parts.clipped(config, transforms.decentralized(
        parts.own_optimizer(config, schedule), topology, axis_name,
        comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
        gossip_every=int(config.gossip_every),
        bucket_bytes=int(config.bucket_bytes)))
  accum = int(o.accum_steps) if o.name == "accum_adamw" else 1
  if config.pipelined_gossip:
    return parts.clipped(config, pipelined.pipelined_adamw(
        schedule, topology, b1=o.b1, b2=o.b2, eps=o.eps,
        weight_decay=o.weight_decay, mask=transforms.default_weight_decay_mask,
        accum_steps=accum, axis_name=axis_name,
        comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
        bucket_bytes=int(config.bucket_bytes),
        beta_convention=o.beta_convention))
  return parts.clipped(config, transforms.decentralized_adamw(
      schedule, topology, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, mask=transforms.default_weight_decay_mask,
      accum_steps=accum,
      axis_name=axis_name, comm_dtype=parts.COMM_DTYPES[config.comm_dtype],
      gossip_every=int(config.gossip_every),
      bucket_bytes=int(config.bucket_bytes),
      beta_convention=o.beta_convention))


def runtime_spec(config) -> str:
  """``dadam:topology=T`` or ``accum_adam:T=..,topology=T`` with the
  message settings; ``local_dsgd:H=..,topology=T[,comm_dtype=..]`` for
  ``gossip_every = H > 1``. No ``bucket_MiB`` for blocking CHOCO-gossip
  (compressed, not pipelined): the model prices its round as one message."""
  blocking = (config.compression.format != "none"
              and not config.pipelined_gossip)
  extra = parts.message_settings(config, FIELDS, buckets=not blocking)
  every = int(config.gossip_every)
  if every > 1:
    spec = f"local_dsgd:H={every},topology={config.topology}"
    return parts.with_settings(
        spec, [e for e in extra if e.startswith("comm_dtype")])
  if config.optimizer.name == "accum_adamw":
    spec = (f"accum_adam:T={int(config.optimizer.accum_steps)},"
            f"topology={config.topology}")
  else:
    spec = f"dadam:topology={config.topology}"
  if config.pipelined_gossip:
    extra = [*extra, "pipelined=1"]
  return parts.with_settings(spec, extra)


def check_compression(config, fmt: str) -> None:
  """CHOCO-gossip needs a static mixing matrix and gossip every step."""
  c = config
  topo = topology_lib.make(c.topology, int(c.n_workers),
                           int(c.workers_per_node))
  if topo.period != 1:
    raise ValueError(
        f"{fmt} (CHOCO-gossip) needs a static mixing matrix, but config."
        f"topology={c.topology} changes every round (period {topo.period}); "
        "set --config.topology to one of exponential, static_ring, torus, "
        "complete (or --config.compression.format=none).")
  if c.gossip_every != 1:
    raise ValueError(
        f"config.gossip_every={c.gossip_every} with {fmt}: CHOCO-gossip "
        "mixes every step; set --config.gossip_every=1 (or --config."
        "compression.format=none).")


def unread(config, field: str) -> str | None:
  """CHOCO-gossip sends one payload per leaf: no ``bucket_bytes``."""
  z = config.compression
  if field == "bucket_bytes" and z.format != "none":
    return (f"config.compression.format={z.format!r} (CHOCO-gossip sends one "
            "payload per leaf)")
  return None


def check_pipelined(config) -> None:
  """Pipelined gossip mixes every step (a round per two steps' sequence)."""
  if config.pipelined_gossip and int(config.gossip_every) != 1:
    raise ValueError(
        f"config.pipelined_gossip=True with config.gossip_every="
        f"{config.gossip_every}: pipelined gossip sends a round every step; "
        "set --config.gossip_every=1 or --config.pipelined_gossip=False.")


def check_faults(config) -> None:
  """A rejoining worker takes the mean of its live neighbours (no theta):
  where a worker can fail and come back (``failure_rate > 0`` or a trace),
  ``rejoin`` must say so (``copy_mean``); without failures nothing rejoins
  and ``rejoin`` is left at its default like any unread fault setting."""
  if config.pipelined_gossip:
    raise ValueError(
        "config.pipelined_gossip=True with config.faults: pipelined gossip "
        "has no live-worker round; set --config.pipelined_gossip=False.")
  f = config.faults
  rejoins = bool(f.failure_rate) or bool(f.trace)
  if rejoins and f.rejoin != "copy_mean":
    raise ValueError(
        f"config.faults.rejoin={f.rejoin!r}: config.algorithm=decentralized "
        "has no theta and rejoins a worker with the mean of its live "
        "neighbours; set --config.faults.rejoin=copy_mean.")


_NO_OUTER_STEP = ("config.algorithm='decentralized' (gossip takes no outer "
                  "step to hold to a quorum or roll back)")
FIELDS = (*GOSSIP_FIELDS, "global_avg_interval", "gossip_every",
          *CHOCO_FIELDS)
CONFIG_FIELDS = {
    "pipelined_gossip": registry.ConfigField(
        False, field_checks.boolean,
        "decentralized: pipelined gossip (decentral_jax.optim.pipelined): "
        "the round sent in step k is mixed in step k+1, off the update's "
        "critical path; one step of staleness and one parameter-sized "
        "buffer in the optimizer state (docs/pipelined_gossip.md); with "
        "compression: pipelined CHOCO-gossip, the round of the step's input "
        "parameters, no extra buffer (decentral_jax.optim.choco). Needs "
        "gossip_every 1, no faults"),
}

DECENTRALIZED = registry.register(registry.Method(
    "decentralized", build, fields=FIELDS, runtime_spec=runtime_spec,
    label="dadam", uses_topology=True, static_rounds=True,
    gossip_every=lambda config: int(config.gossip_every),
    round_stride=lambda config: 2 if config.pipelined_gossip and (
        config.compression.format == "none") else 1,
    checks=check_pipelined, config_fields=CONFIG_FIELDS,
    compression_checks=check_compression,
    unread=unread, faults=check_faults,
    unread_faults={"min_quorum": _NO_OUTER_STEP,
                   "on_failure": _NO_OUTER_STEP}))
