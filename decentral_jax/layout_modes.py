"""The worker-layout modes: how a worker of several devices holds its state.

``fsdp`` splits every floating leaf of the parameters and optimizer state
over the worker's devices (one all-gather / reduce-scatter per leaf each
step); ``data`` replicates them and splits only the batch (one all-reduce
of the gradients). :mod:`decentral_jax.parallel.layouts` places state by
them and :mod:`decentral_jax.runtime_model.workload` prices them. Pure
Python: it imports nothing else from the library.
"""

FSDP = "fsdp"
DATA = "data"
#: Every mode, in the order the config and command lines list them.
MODES = (FSDP, DATA)
