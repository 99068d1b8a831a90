"""The cases of ``decentral-jax overlap`` (:mod:`decentral_jax.tools.overlap`):
each a runner config of the checkout's ``configs/``, its overrides and the
GPU topology it is compiled for."""

_TINY = "configs/gpt_tiny.py"
#: The paper's GPT-2 small config (the case that needs dummy token files).
GPT2_SMALL = "configs/gpt2_small_owt.py:decentralized"
# name -> (config file, overrides, GPU topology "slices x hosts x devices").
CASES = {
    "gpt_tiny": (_TINY, (), "1x1x8"),
    "dadam": (_TINY, ("optimizer.name=adamw", "optimizer.accum_steps=1"),
              "1x1x8"),
    "aer": (_TINY, ("topology=alternating_exp_ring", "workers_per_node=4"),
            "2x1x4"),
    "virtual": (_TINY, ("workers_per_device=4",), "1x1x2"),
    "spanning": (_TINY, ("n_workers=4", "devices_per_worker=2"), "1x1x8"),
    "ring": (_TINY, ("topology=ring",), "1x1x8"),
    "torus": (_TINY, ("topology=torus",), "1x1x8"),
    "exponential": (_TINY, ("topology=exponential",), "1x1x8"),
    "complete": (_TINY, ("topology=complete",), "1x1x8"),
    "sgp": (_TINY, ("algorithm=sgp",), "1x1x8"),
    "local_dadam": (_TINY, ("gossip_every=2",), "1x1x8"),
    "all_reduce": (_TINY, ("algorithm=all_reduce", "optimizer.name=adamw",
                           "optimizer.accum_steps=1"), "1x1x8"),
    "diloco": (_TINY, ("algorithm=diloco",), "1x1x8"),
    # DiLoCo's overlapped outer step: the trickled reduction (one slice of
    # the pseudo-gradients per step, outside any conditional) against the
    # one-shot reduction in the sync step's conditional.
    "diloco_eager": (_TINY, ("algorithm=diloco", "outer_overlap=eager"),
                     "1x1x8"),
    "diloco_eager_one_shot": (_TINY, ("algorithm=diloco",
                                      "outer_overlap=eager",
                                      "trickle_reduction=False"), "1x1x8"),
    "streaming_eager": (_TINY, ("algorithm=streaming_diloco",
                                "num_fragments=2", "outer_overlap=eager"),
                        "1x1x8"),
    # The paper's GPT-2 small (bfloat16 compute, float32 parameters), AER
    # on two hosts of 4 GPUs, 30 sequences of 1024 tokens per worker.
    "gpt2_small": (GPT2_SMALL, ("n_workers=8", "global_batch=240",
                           "eval_batches=1"), "2x1x4"),
}
