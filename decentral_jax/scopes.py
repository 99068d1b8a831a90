"""Names the library gives parts of a traced program.

:func:`decentral_jax.comm.gossip.every` traces its conditional inside
``jax.named_scope(f"{PERIOD_SCOPE}{period}")``;
:mod:`decentral_jax.analysis.accounting` reads the period back from the
compiled HLO's op names to average a branch's bytes over it. Kept here, on
the bottom floor, so that the analysis imports no communication code.
"""

#: Prefix of the named scope of a conditional that runs every ``period``
#: steps (followed by the period, an int).
PERIOD_SCOPE = "comm_every_"
