"""Analysis of compiled programs: which collectives a step runs, and their bytes.

- :mod:`~decentral_jax.analysis.hlo`: the HLO text parser.
- :mod:`~decentral_jax.analysis.accounting`: collectives and bytes per
  step (per branch, averaged over a sync period); re-exported here.
- :mod:`~decentral_jax.analysis.workers`: bytes per worker of a run
  (workers of several devices, several workers per device, one compiled
  step per gossip round); re-exported here.
"""

from decentral_jax.analysis import accounting
from decentral_jax.analysis import workers
from decentral_jax.analysis.accounting import *  # noqa: F401,F403
from decentral_jax.analysis.workers import *  # noqa: F401,F403

__all__ = (*accounting.__all__, *workers.__all__)
