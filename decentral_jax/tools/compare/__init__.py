"""The main job: which communication scheme on which cluster, and what quality.

Trains a small proxy model from the same initial parameters and data order,
for the same number of steps, once per method of ``--methods`` (and seed of
``--seeds``), then prices every method on every cluster of ``--clusters``
with the runtime model for the workload ``--workload`` names, and answers:
per cluster, which method first reaches each of a few loss targets that
every run reaches, with a one-line recommendation and its margin
(:mod:`decentral_jax.tools.compare.answer`).

The quick default (``decentral-jax compare --outdir results/compare``,
or ``python experiments/compare.py`` in a clone, about 2 minutes on an
idle 2-core CPU): the package's preset ``gpt_quick``
(:mod:`decentral_jax.runner.presets`, also ``configs/gpt_quick.py``: a
2-layer byte-level GPT of width 64, 8 workers, 200 steps), the methods of :data:`DEFAULT_METHODS`, one seed, the clusters
``A40`` (Figure 6: 4 x A40 per node, 25 Gbit/s Ethernet), ``h100_node``
(one NVLink node of 8 H100) and ``cross_region_2dc`` (two datacenters of
H100 nodes over a 10 Gbit/s, 30 ms wide-area link), each priced with
compute of its own GPUs (workload ``own``: on A40 the paper's
Transformer-base with the compute fitted to its Figure 6 bars, on the H100
clusters ``gpt2_small``, 124M parameters, 30.9 ms of H100 compute per
step). ``--full``:
the study of BENCHMARKS.md (the preset ``gpt_tiny``, 300 steps, the six
methods of :data:`FULL_METHODS`, seeds 0, 1, 2, periodic checkpoints);
flags given as well win over both.

Methods (``--methods``, or ``all``):

* ``all_reduce``: All-Reduce AdamW;
* ``dadam``: DAdam on ``one_peer_exp``;
* ``accum_adamw``: AccumAdamW on ``one_peer_exp`` in its best measured
  setting: window T = config.optimizer.accum_steps (4), horizon-matched
  betas (``optimizer.beta_convention="per_step"``: b1**T, b2**T per window);
* ``diloco``: DiLoCo, inner AdamW, outer Nesterov (lr 0.3, momentum 0.9),
  sync every 10 steps;
* ``local_sgd``: Local SGD with inner AdamW, sync every 10 steps;
* ``local_dadam``: DAdam gossiping every 5 steps on ``one_peer_exp``;
* ``accum_adamw_paper``: AccumAdamW with the paper's per-window betas;
* ``accum_adamw_aer``: AccumAdamW (as ``accum_adamw``) on
  ``alternating_exp_ring``, 2 workers per node;
* ``streaming_diloco``: Streaming DiLoCo, 2 fragments, overlap 1 step,
  merge alpha 0.5, sync every 10 steps (outer as ``diloco``);
* ``decentralized_diloco``: DiLoCo whose outer mean is one gossip round on
  ``one_peer_exp``, every 10 steps;
* ``sgp``: SGP (push-sum AdamW) on ``one_peer_exp``;
* ``diloco_delayed``, ``diloco_eager``: ``diloco`` with its outer step
  overlapped with the next round (arXiv 2502.12996): one round stale, or
  eager (each worker's own fresh pseudo-gradient in place of its stale
  one), the reduction trickled over the round's inner steps;
* then the arms the method homes declare (``Method.arms``), today
  ``desloc_adam`` (DES-LOC, K_x 10, K_u 30, K_v 60), ``noloco`` (NoLoCo,
  H 10), ``gradient_tracking`` (DIGing on ``one_peer_exp``), ``muloco``
  (DiLoCo with a Muon inner optimizer) and ``muloco_int4`` (its
  pseudo-gradients in int4 with error feedback); BENCHMARKS.md study 20.

Each method runs at its own tuned peak learning rate (:data:`TUNED_PEAK_LR`,
chosen for gpt_tiny at 300 steps by the project's tuning protocol,
``decentral_jax.runner.tuning``; BENCHMARKS.md, section 10; the quick proxy
reuses them untuned).

Clusters (``--clusters``): every preset of
``decentral_jax.runtime_model.presets`` (T4, A40, A100, h100_node, h100_ib,
cross_region_2dc, cross_region_4dc; sources in docs/runtime_model.md,
"Presets") or cluster JSON files written by ``python -m
decentral_jax.runtime_model measure`` (priced with their own measured
workload). A cluster is priced at the smallest multiple of
``config.n_workers`` GPUs that it holds and that, on a preset of several
nodes, spans at least two nodes, so its inter-node links are priced (at 8
workers: h100_ib and T4 16, A40 and A100 8, cross_region_2dc 16,
cross_region_4dc 32, h100_node, one node, 8); each table header names the
count. A cluster file is priced only on links it measured (``predict``'s
rule: a one-node file at more workers than its node holds is refused
before training). Empty entries of ``--clusters`` are refused. Workload
(``--workload``): ``own`` (the default: ``figure6`` on the Figure 6
clusters, ``gpt2_small`` on the H100 ones), ``gpt2_small``, ``1b`` or
``figure6`` (the paper's Transformer-base fitted to each Figure 6 cluster;
T4, A40, A100 only) or a workload file (an existing path, or a name ending
in ``.json``) read from a compiled train step. Each cluster's table, panel
title and recommendation line name the workload whose compute is priced
there, and say "H100 compute on A40 links" where a workload's compute
comes from another GPU.
The loss per step is measured here, the time per step predicted: a what-if,
not a measurement. ``--clusters=`` (empty) turns the pricing off.

Outputs in ``--outdir``: ``results.md`` (the answer: one table per cluster
and the recommendations; then the details: final validation loss of the
averaged model, the workers' own losses, consensus distance, bytes sent per
step read from the compiled step's HLO, predicted ms/step; and the check
against the stored reference, ``reference.json`` beside this module),
``loss_vs_predicted_time.png`` (the frontier per cluster),
``loss_vs_step.png``, and ``<run>/metrics.jsonl`` per run. This machine's
CPU timings (ms/step, tokens/s, ``cpu_loss_vs_time_this_machine.png``) are
load-dependent and only written with ``--cpu_timing``; they show compute
overheads of simulated devices, never a ranking. A plot of these names that
an earlier invocation left and this one does not write (the CPU plot
without ``--cpu_timing``, the frontier with ``--clusters=``) is deleted.

  decentral-jax compare --outdir results/compare     # quick, ~2 min
  decentral-jax compare --full --outdir results/full  # the study
  decentral-jax compare --clusters=h100_ib,cross_region_4dc --workload=1b \\
      --outdir results/compare_1b
  decentral-jax compare --methods=all_reduce,diloco,sgp --seeds=0,1,2 \\
      --outdir results/compare_seeds

``--config.<field>=value`` overrides apply to every run (the fields a method
sets, e.g. its algorithm, optimizer name, topology, sync period, are set
per run; a method field its algorithm does not read, e.g. comm_dtype for
all_reduce, keeps its default there, with a note).

Interrupted and repeated invocations: each run's subdirectory of
``--outdir`` records its outcome (``compare_result.json``). The same
command again keeps every run that finished with the same config (its
metrics and timings as recorded), resumes an interrupted run from its last
checkpoint (SIGTERM or Ctrl-C saves one; the message says so) and trains
the others; a subdirectory of another config is replaced (one holding
anything a run does not write is refused). A kept run whose record is
impossible (:mod:`.kept`), or whose step-0 loss, parameter count or
communication disagrees with the other runs', is named in one
``warning:`` line and trained again. The invocation holds a lock on
``--outdir`` itself (``<outdir>/run.lock``) from before the first run to
the last results file, and each subdirectory's own while its run trains, so
a second invocation on the same ``--outdir`` (any methods) is refused, not
interleaved. ``--fresh`` trains every run from step 0. Without
``--checkpoints`` (the quick default) no periodic checkpoints are written
(``config.checkpoint_interval=0``) and a run's final checkpoint is deleted
once its outcome is recorded (about 20 KB per run remain); ``--checkpoints``
(on under ``--full``, or with an explicit ``--config.checkpoint_interval``)
keeps the config's periodic checkpoints, about 74 MB per run (DiLoCo
123 MB). ``--config.workdir`` (each run's work directory is
``--outdir/<run>``) and ``--nocheckpoints`` with a nonzero
``--config.checkpoint_interval`` are refused.

Bad input (a missing or broken config file, an unknown field, a bad value in
any run's config, an ``--outdir`` that is a file or cannot be created, a
``--clusters`` entry that is neither a preset nor a valid cluster file) is one
``error: ...`` line on stderr and exit code 2, before anything trains. A run
that diverges is marked in the table and the other runs go on; then one
``error:`` line names the diverged runs and the exit code is 3. A malformed
``reference.json`` beside this module is one ``warning:`` line naming the
file and key after training; the results are still written.
``--help`` prints this text and the flags (exit code 0); :func:`main`
returns the exit code.

Modules: :mod:`.runs` (the method table and the run configs), :mod:`.job`
(running, keeping and resuming the runs), :mod:`.kept` (the checks of a
kept run), :mod:`.progress`,
:mod:`.pricing` (the runtime model's prices), :mod:`.answer` (which
method first reaches each target loss), :mod:`.results` and :mod:`.plots`
(results.md and the figures), :mod:`.reference` (the stored reference),
:mod:`.flags` and :mod:`.command` (:func:`main`).
"""

from decentral_jax.tools.compare.command import main

__all__ = ["main"]
