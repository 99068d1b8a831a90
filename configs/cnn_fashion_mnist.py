"""cnn_fashion_mnist: a small CNN on Fashion-MNIST with 8 workers.

Data: the standard Fashion-MNIST IDX files (``train-images-idx3-ubyte.gz``,
``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
``t10k-labels-idx1-ubyte.gz``; uncompressed names work too) in ``data.path``,
by default ``/usr/share/datasets/fashion-mnist``. On Debian/Ubuntu install
them with ``apt-get install dataset-fashion-mnist``; otherwise download the
four files from https://github.com/zalandoresearch/fashion-mnist and pass
``--config.data.path=DIR``. Validation uses the 10k test images.

Run::

  python experiments/train.py --config configs/cnn_fashion_mnist.py --workdir /tmp/fmnist
"""

from __future__ import annotations

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  """Returns the cnn_fashion_mnist configuration."""
  c = config_dict.ConfigDict()

  # --- Parallel training ---------------------------------------------------
  # "all_reduce" (exact gradient average, then AdamW; paper Alg. 2) or
  # "decentralized" (gossip over `topology`, DAdam / AccumAdamW; Alg. 1, 4).
  c.algorithm = "decentralized"
  # Gossip topology (decentral_jax.topology.NAMES); ignored by all_reduce.
  c.topology = "one_peer_exp"
  # Number of workers n (one per device).
  c.n_workers = 8
  # Workers per node L (node-aware topologies such as alternating_exp_ring).
  c.workers_per_node = 1
  # dtype in which gossiped parameters are sent: "" or "bfloat16".
  c.comm_dtype = ""
  # How the gossip round is chosen: "switch" (one compile; lax.switch on
  # step % period inside the step) or "static" (one compile per distinct
  # round, chosen on the host: no conditional around the collectives, so
  # XLA can overlap them with the forward/backward on GPUs).
  c.gossip_rounds = "switch"
  # Exact global parameter average every this many steps; 0 = never.
  c.global_avg_interval = 0

  # --- Run length, batch, regularisation -----------------------------------
  # Number of optimizer steps (500 x 256 images ~ 2 epochs).
  c.steps = 500
  # Images per step over all workers (32 per worker); divisible by n_workers.
  c.global_batch = 256
  # Seed of the initial parameters, the data order and dropout.
  c.seed = 0
  # Global-norm clip of each worker's local gradient; 0 disables.
  c.grad_clip = 0.0

  # --- Evaluation, logging, checkpoints ------------------------------------
  # Evaluate the averaged model every this many steps (and at the end).
  c.eval_interval = 100
  # Validation batches per evaluation, each of global_batch test images.
  c.eval_batches = 8
  # Write a metrics line every this many steps.
  c.log_interval = 20
  # Save a checkpoint every this many steps (and at the end).
  c.checkpoint_interval = 250
  # Number of checkpoints kept in <workdir>/checkpoints.
  c.keep_checkpoints = 2
  # Also write TensorBoard event files (needs the tensorboardX package).
  c.tensorboard = False
  # Output directory; the --workdir flag takes precedence.
  c.workdir = config_dict.placeholder(str)

  # --- Optimizer -------------------------------------------------------------
  c.optimizer = config_dict.ConfigDict()
  # "adamw" (DAdam when decentralized) or "accum_adamw" (AccumAdamW).
  c.optimizer.name = "accum_adamw"
  # Adam moment decays.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  # Added to the denominator outside the square root.
  c.optimizer.eps = 1e-8
  # Decoupled weight decay on parameters with ndim >= 2.
  c.optimizer.weight_decay = 1e-4
  # AccumAdam window T; 1 for adamw.
  c.optimizer.accum_steps = 4

  # --- Learning-rate schedule -----------------------------------------------
  c.schedule = config_dict.ConfigDict()
  # "warmup_cosine", "inverse_sqrt" or "constant".
  c.schedule.name = "warmup_cosine"
  # Peak learning rate.
  c.schedule.peak_lr = 2e-3
  # Linear-warmup length in steps.
  c.schedule.warmup_steps = 25
  # Learning rate at the last step.
  c.schedule.final_lr = 1e-4

  # --- Model ----------------------------------------------------------------
  c.model = config_dict.ConfigDict()
  # "cnn" (decentral_jax.models.cnn): conv-pool-conv-pool-dense-dense.
  c.model.name = "cnn"
  # Output channels of the two 3x3 convolutions.
  c.model.features = (32, 64)
  # Width of the hidden dense layer.
  c.model.dense = 128
  # Number of classes.
  c.model.num_classes = 10

  # --- Data -----------------------------------------------------------------
  c.data = config_dict.ConfigDict()
  # Fashion-MNIST IDX files.
  c.data.source = "fashion_mnist"
  # Directory of the IDX files; unset = /usr/share/datasets/fashion-mnist.
  c.data.path = config_dict.placeholder(str)
  # Unused (the validation split is the test set).
  c.data.val_fraction = 0.0

  # --- Multi-host (see README, "Running on a cluster") ----------------------
  c.distributed = config_dict.ConfigDict()
  # Join a multi-process job with jax.distributed.initialize (one process per
  # host). Jobs started by `srun` with several tasks join even when False.
  c.distributed.enabled = False
  # "host:port" of process 0's coordinator; "" to detect it on SLURM.
  c.distributed.coordinator_address = ""
  # Total number of processes; 0 to detect it on SLURM.
  c.distributed.num_processes = 0
  # This process's id in [0, num_processes); -1 to detect it on SLURM.
  c.distributed.process_id = -1
  # Seconds without a heartbeat after which a process counts as dead and the
  # others stop with an error instead of hanging.
  c.distributed.heartbeat_timeout_seconds = 100
  return c
