"""DES-LOC-Adam: local Adam with independent sync periods of the parameters
and the two moments (Iacob et al., arXiv 2505.22549;
:mod:`decentral_jax.optim.desloc`).

Every worker runs Adam (``config.optimizer.name = "adamw"``: its ``b1``,
``b2``, ``eps`` (inside the square root, ``sqrt(v + eps**2)``) and
decoupled ``weight_decay`` on the leaves with ``ndim >= 2``, without bias
correction as the paper's Algorithm 2) on its own gradient, clipped to
``grad_clip``; the parameters are averaged every ``sync_every = K_x``
steps, the first moment every ``sync_every_u = K_u`` and the second every
``sync_every_v = K_v`` steps. The evaluated model is the workers' average.
Priced as the runtime model's ``desloc:Kx=..,Ku=..,Kv=..``
(:mod:`decentral_jax.runtime_model.local_methods`).
"""

from __future__ import annotations

from decentral_jax.optim import desloc
from decentral_jax.optim import transforms
from decentral_jax.runner import field_checks
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry

FIELDS = ("sync_every",)
# K_u and K_v: the periods in steps of the averages of Adam's first and
# second moments (the paper recommends K_u = 3 K_x, K_v = 6 K_x).
CONFIG_FIELDS = {
    "sync_every_u": registry.ConfigField(
        30, field_checks.integer(1),
        "desloc_adam: steps between two averages of the first moment (K_u)"),
    "sync_every_v": registry.ConfigField(
        60, field_checks.integer(1),
        "desloc_adam: steps between two averages of the second moment (K_v)"),
}


def build(config, schedule, topology, axis_name):
  """``chain(clip_by_global_norm(grad_clip), desloc_adam)``."""
  del topology
  o = config.optimizer
  return parts.clipped(config, desloc.desloc_adam(
      schedule, int(config.sync_every), int(config.sync_every_u),
      int(config.sync_every_v), b1=float(o.b1), b2=float(o.b2),
      eps=float(o.eps), weight_decay=float(o.weight_decay),
      mask=transforms.default_weight_decay_mask, axis_name=axis_name))


def checks(config) -> None:
  """DES-LOC runs its own local Adam: ``optimizer.name`` must be ``adamw``
  (whose ``beta_convention`` is read as by AdamW: not at all)."""
  o = config.optimizer
  if o.name != "adamw":
    raise ValueError(
        f"config.optimizer.name={o.name!r} with config.algorithm="
        "'desloc_adam': DES-LOC runs its own local Adam; set "
        "--config.optimizer.name=adamw --config.optimizer.accum_steps=1.")


def warnings(config) -> list[str]:
  """Moment periods shorter than the parameters' (the paper's ordering is
  ``K_x <= K_u <= K_v``)."""
  kx, ku, kv = (int(config.sync_every), int(config.sync_every_u),
                int(config.sync_every_v))
  if ku < kx or kv < kx:
    return [f"config.sync_every_u={ku} or config.sync_every_v={kv} is below "
            f"config.sync_every={kx}: the moments are averaged more often "
            "than the parameters, which costs more bytes than it saves "
            "(DES-LOC recommends sync_every_u = 3 sync_every, sync_every_v "
            "= 6 sync_every)."]
  return []


def runtime_spec(config) -> str:
  """``desloc:Kx=..,Ku=..,Kv=..``."""
  return (f"desloc:Kx={int(config.sync_every)},Ku={int(config.sync_every_u)},"
          f"Kv={int(config.sync_every_v)}")


DESLOC_ADAM = registry.register(registry.Method(
    "desloc_adam", build, fields=FIELDS, runtime_spec=runtime_spec,
    label="desloc_adam", checks=checks, warnings=warnings,
    config_fields=CONFIG_FIELDS,
    # K_x = 10 as the DiLoCo arms, the paper's K_u = 3 K_x, K_v = 6 K_x.
    # Peak lr 3e-3: the tuning protocol's pick (benchmarks/studies).
    arms=(registry.Arm("desloc_adam", fields=(
        ("sync_every", 10), ("sync_every_u", 30), ("sync_every_v", 60)),
        peak_lr=3e-3),)))
