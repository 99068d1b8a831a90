"""Analysis of compiled programs: which collectives a step runs, and their bytes.

- :mod:`~decentral_jax.analysis.hlo`: the HLO text parser.
- :mod:`~decentral_jax.analysis.accounting`: collectives and bytes per
  step (per branch, averaged over a sync period); re-exported here.
"""

from decentral_jax.analysis.accounting import *  # noqa: F401,F403
from decentral_jax.analysis.accounting import __all__  # noqa: F401
