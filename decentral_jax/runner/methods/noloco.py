"""NoLoCo: inner AdamW steps, then a momentum outer step averaged with one
random peer, no all-reduce (Kolehmainen et al., arXiv 2506.10911;
:mod:`decentral_jax.optim.noloco`).

Every worker takes ``sync_every = H`` inner steps (``parts.inner``: AdamW
or AccumAdamW of ``config.optimizer`` on its own gradient, clipped to
``grad_clip``) from its outer parameters ``phi_i``; then it meets its
partner of the round (a seeded cycle of ``noloco.pairing_rounds`` random
pairings, :func:`decentral_jax.topology.pairings.random_pairs` with
``noloco.pairing_seed``; with an odd ``n_workers`` one worker per round
is alone) and takes ``delta_i <- alpha delta_i + beta mean_pair(x - phi)
- gamma (phi_i - mean_pair(phi))``, ``phi_i <- phi_i + delta_i``. The
evaluated model is the workers' mean of ``phi_i``.

Config fields of its own (``noloco.*``): ``alpha`` in ``[0, 1)``,
``beta`` > 0, ``gamma`` within the stability range ``0 < gamma < 2 (1 +
alpha)`` (:func:`decentral_jax.optim.noloco.is_stable`; refused outside
it, naming ``config.noloco.gamma``), ``pairing_seed`` >= 0 and
``pairing_rounds`` in ``[1, 1024]``. Compression, ``comm_dtype``, faults
and the global average are not read (refused by name). Priced as the
runtime model's ``noloco:H=..,seed=..,rounds=..``: one float32 exchange
with the partner every ``H`` steps
(:mod:`decentral_jax.runtime_model.local_methods`).
"""

from __future__ import annotations

from decentral_jax.optim import noloco
from decentral_jax.runner import field_checks
from decentral_jax.runner.methods import parts
from decentral_jax.runner.methods import registry
from decentral_jax.topology import pairings

FIELDS = ("sync_every",)
CONFIG_FIELDS = {
    "noloco.alpha": registry.ConfigField(
        0.5, field_checks.real(0, 1),
        "noloco: outer momentum alpha (paper: 0.5)"),
    "noloco.beta": registry.ConfigField(
        0.7, field_checks.real(0, lo_open=True),
        "noloco: weight beta of the pair's mean update (paper: 0.7)"),
    "noloco.gamma": registry.ConfigField(
        0.7, field_checks.real(0, lo_open=True),
        "noloco: pull gamma towards the pair's mean parameters, "
        "0 < gamma < 2 (1 + alpha) (paper: gamma = beta)"),
    "noloco.pairing_seed": registry.ConfigField(
        0, field_checks.integer(0),
        "noloco: seed of the random pairings"),
    "noloco.pairing_rounds": registry.ConfigField(
        pairings.DEFAULT_ROUNDS, field_checks.integer(1, 1024),
        "noloco: distinct pairings drawn (the schedule's period, one "
        "compiled branch each)"),
}


def pairing(config):
  """The run's pairing schedule (``config.noloco`` seed and rounds)."""
  c = config.noloco
  return pairings.random_pairs(int(config.n_workers),
                               seed=int(c.pairing_seed),
                               rounds=int(c.pairing_rounds))


def build(config, schedule, topology, axis_name):
  """``noloco(inner = clip + AdamW, H, random pairs, alpha, beta, gamma)``."""
  del topology
  c = config.noloco
  return noloco.noloco(parts.inner(config, schedule), int(config.sync_every),
                       pairing(config), alpha=float(c.alpha),
                       beta=float(c.beta), gamma=float(c.gamma),
                       axis_name=axis_name)


def checks(config) -> None:
  """``noloco.gamma`` within the stability range of ``noloco.alpha``."""
  c = config.noloco
  noloco.check_outer(c.alpha, c.beta, c.gamma,
                     ("config.noloco.alpha", "config.noloco.beta",
                      "config.noloco.gamma"))


def warnings(config) -> list[str]:
  """``steps`` not a multiple of ``sync_every``: the evaluated ``phi``
  misses the last steps; a single worker: no peer to average with."""
  out = []
  if config.steps % config.sync_every:
    out.append(f"config.steps={config.steps} is not a multiple of "
               f"config.sync_every={config.sync_every}: eval/loss reports "
               f"the workers' outer parameters phi, which do not include the "
               f"last {config.steps % config.sync_every} steps.")
  if int(config.n_workers) == 1:
    out.append("config.n_workers=1 with config.algorithm='noloco': no peer "
               "to average with; the outer step is a momentum step on the "
               "worker's own update.")
  return out


def outer_params(params, opt_state):
  """The evaluated parameters: this worker's ``phi_i``."""
  del params
  return noloco.outer_params(opt_state)


def runtime_spec(config) -> str:
  """``noloco:H=..,seed=..,rounds=..``."""
  c = config.noloco
  return (f"noloco:H={int(config.sync_every)},seed={int(c.pairing_seed)},"
          f"rounds={int(c.pairing_rounds)}")


NOLOCO = registry.register(registry.Method(
    "noloco", build, fields=FIELDS, runtime_spec=runtime_spec,
    label="NoLoCo", checks=checks, warnings=warnings,
    eval_params=outer_params, config_fields=CONFIG_FIELDS,
    # H = 10 as the DiLoCo arms, the paper's alpha, beta, gamma; peak lr
    # 3e-3 chosen by the tuning protocol in the main job's setting (seed 0:
    # 2.1231, 2.0373, 2.2730, 2.4052 at 1.5e-3, 3e-3, 6e-3, 1.2e-2).
    arms=(registry.Arm("noloco", fields=(("sync_every", 10),),
                       peak_lr=3e-3),)))
