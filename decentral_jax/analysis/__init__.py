"""Analysis of compiled programs: which collectives a step runs, their bytes,
and whether they overlap the forward/backward pass.

- :mod:`~decentral_jax.analysis.hlo`: the HLO text parser.
- :mod:`~decentral_jax.analysis.accounting`: collectives and bytes per
  step (per branch, averaged over a sync period); re-exported here.
- :mod:`~decentral_jax.analysis.workers`: bytes per worker of a run
  (workers of several devices, several workers per device, one compiled
  step per gossip round); re-exported here.
- :mod:`~decentral_jax.analysis.overlap`: for each collective of a
  scheduled (GPU) program, asynchronous or not, inside a conditional or
  not, and the forward / backward work scheduled while it moves data;
  re-exported here.
"""

from decentral_jax.analysis import accounting
from decentral_jax.analysis import overlap
from decentral_jax.analysis import workers
from decentral_jax.analysis.accounting import *  # noqa: F401,F403
from decentral_jax.analysis.overlap import *  # noqa: F401,F403
from decentral_jax.analysis.workers import *  # noqa: F401,F403

__all__ = (*accounting.__all__, *overlap.__all__, *workers.__all__)
