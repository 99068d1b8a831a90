"""Optimizers: decentralized optax transforms and local-update methods.

- :mod:`~decentral_jax.optim.transforms`: ``decentralized``,
  ``decentralized_adamw`` (DAdam, AccumAdamW), ``gossip_mixing``,
  ``all_reduce_gradients``.
- :mod:`~decentral_jax.optim.accum_adam`: ``scale_by_accum_adam``.
- :mod:`~decentral_jax.optim.choco`: CHOCO-gossip of compressed parameters.
- :mod:`~decentral_jax.optim.push_sum`: SGP (push-sum gossip).
- :mod:`~decentral_jax.optim.desloc`: DES-LOC-Adam (local Adam with
  independent sync periods of the parameters and the two moments).
- :mod:`~decentral_jax.optim.gradient_tracking`: gradient tracking
  (DIGing) for D-SGD, DAdam and AccumAdamW.
- The DiLoCo family, by composition:
  :mod:`~decentral_jax.optim.local_steps` (the inner step and the outer
  state every local-update method shares),
  :mod:`~decentral_jax.optim.reductions` (how the pseudo-gradient is
  reduced: exact, low-precision, compressed, gossip),
  :mod:`~decentral_jax.optim.outer_timing` (when the outer step takes it:
  plain, delayed, eager, trickled), :mod:`~decentral_jax.optim.local_sgd_sync`
  (Local SGD), :mod:`~decentral_jax.optim.diloco_sync` (DiLoCo and
  decentralized DiLoCo), :mod:`~decentral_jax.optim.streaming_sync`
  (Streaming DiLoCo), :mod:`~decentral_jax.optim.elastic` (DiLoCo and Local
  SGD over slow and failing workers: quorum, rollback or proceed, rejoin).
- :mod:`~decentral_jax.optim.arguments` and
  :mod:`~decentral_jax.optim.precision`: the transforms' shared argument
  checks and compute dtypes.

Every public name of every module is listed here, except
``push_sum.push_sum`` and ``gradient_tracking.gradient_tracking`` (they
share their modules' names). Imports
:mod:`decentral_jax.comm` and :mod:`decentral_jax.topology`.
"""

from decentral_jax.optim.accum_adam import (
    BETA_CONVENTIONS, ScaleByAccumAdamState, horizon_matched_betas,
    scale_by_accum_adam)
from decentral_jax.optim.choco import ChocoState, choco_gossip
from decentral_jax.optim.desloc import (
    DesLocState, check_desloc_periods, desloc_adam)
# gradient_tracking.gradient_tracking is not listed (as push_sum.push_sum).
from decentral_jax.optim.gradient_tracking import (
    TRACKING_FORMS, GradientTrackingState, check_tracking_form,
    gradient_tracking_adamw, gradient_tracking_sgd, tracked_decentralized)
from decentral_jax.optim.diloco_sync import (
    DiLoCoState, check_reduction, diloco, resolve_timing)
from decentral_jax.optim.elastic import (
    ON_FAILURE, REJOIN, ElasticState, counters, elastic_diloco,
    elastic_local_sgd)
from decentral_jax.optim.local_sgd_sync import LocalSGDState, local_sgd
from decentral_jax.optim.local_steps import (
    OuterState, check_common, default_outer_optimizer, find_theta,
    global_copy, global_dtype, init_outer, inner_step, outer_step,
    param_delta, to_params)
from decentral_jax.optim.outer_timing import (
    TIMINGS, Delayed, Eager, FlatLayout, InFlight, OuterLoop, Plain,
    check_timing, named)
# push_sum.push_sum is not listed: it would hide the module of that name.
from decentral_jax.optim.push_sum import (
    PushSumState, check_column_stochastic, debiased, find_state,
    global_average, one_peer_directed_exp, sgp, weight_dtype)
from decentral_jax.optim.reductions import (
    Coding, CompressedMean, ErrorFeedback, ExactMean, GossipRound,
    LowPrecisionMean, Reduction, check_compression, compressed,
    compressed_mean, compressed_mean_bytes, compressed_pseudo_gradient,
    mean_low_precision, uncompressed)
from decentral_jax.optim.streaming_sync import (
    FragmentRounds, Pending, StreamingDiLoCoState, check_fragments,
    default_fragments, global_params, streaming_diloco)
from decentral_jax.optim.arguments import (
    NO_PARAMS, check_hyperparameter, check_learning_rate, check_period,
    check_transform, concrete_float, per_worker_state)
from decentral_jax.optim.precision import (
    as_dtype, compute_dtype, moment_dtype)
from decentral_jax.optim.transforms import (
    DecentralizedState, GossipMixingState, all_reduce_gradients,
    decentralized, decentralized_adamw, default_weight_decay_mask,
    find_states, gossip_mixing, local_adamw, round_count, round_step)
from decentral_jax.optim.pipelined import (
    PipelinedState, pipelined_adamw, pipelined_gossip, round_of_step)

__all__ = ["all_reduce_gradients", "as_dtype", "BETA_CONVENTIONS",
           "check_column_stochastic", "check_common", "check_compression",
           "check_fragments", "check_hyperparameter", "check_learning_rate",
           "check_period", "check_reduction", "check_timing",
           "check_transform", "choco_gossip", "ChocoState", "Coding",
           "compressed", "compressed_mean", "compressed_mean_bytes",
           "compressed_pseudo_gradient",
           "CompressedMean", "compute_dtype", "concrete_float", "counters",
           "debiased", "decentralized", "decentralized_adamw",
           "DecentralizedState", "DesLocState", "check_desloc_periods",
           "desloc_adam", "default_fragments",
           "default_outer_optimizer", "default_weight_decay_mask", "Delayed",
           "diloco", "DiLoCoState", "Eager", "elastic_diloco",
           "elastic_local_sgd", "ElasticState", "ErrorFeedback", "ExactMean",
           "find_state", "find_states", "find_theta", "FlatLayout",
           "FragmentRounds", "global_average", "global_copy", "global_dtype",
           "global_params", "gossip_mixing", "GossipMixingState",
           "GradientTrackingState", "TRACKING_FORMS", "check_tracking_form",
           "gradient_tracking_adamw", "gradient_tracking_sgd",
           "tracked_decentralized",
           "GossipRound", "horizon_matched_betas", "InFlight", "init_outer",
           "inner_step", "local_adamw", "local_sgd", "LocalSGDState",
           "LowPrecisionMean",
           "mean_low_precision", "moment_dtype", "named", "NO_PARAMS",
           "ON_FAILURE", "one_peer_directed_exp", "outer_step", "OuterLoop",
           "OuterState", "param_delta", "Pending", "PipelinedState",
           "per_worker_state", "pipelined_adamw", "pipelined_gossip", "Plain",
           "PushSumState",
           "Reduction", "REJOIN", "resolve_timing", "round_count",
           "round_of_step",
           "round_step", "scale_by_accum_adam", "ScaleByAccumAdamState",
           "sgp", "streaming_diloco", "StreamingDiLoCoState", "TIMINGS",
           "to_params", "uncompressed", "weight_dtype"]
