"""``measure``: a JAX microbenchmark that calibrates the runtime model on a cluster.

Run on the cluster to be predicted, one process per host under
``jax.distributed`` (or a single process), with the same start-up as the
training runner: :func:`decentral_jax.runner.launch.initialize_from_config`
reads ``config.distributed`` (``--set distributed.enabled=true`` with the
coordinator fields, or nothing on SLURM, where a job step of several tasks
joins automatically). It measures, as medians over ``repeats``:

* one worker's forward and forward + backward time for the config's model at
  its local batch (``global_batch / n_workers``) on one device, on a
  different batch each repeat, and their spread (compute CV, samples);
* ``ppermute`` pair exchanges at several sizes: two devices of node 0;
  device 0 and the first device of node 1 (one flow across nodes); and all
  ``L`` devices of node 0 with those of node 1 at once (``L`` concurrent
  flows), where a node is a process (or ``--local-size`` devices);
* the All-Reduce (``psum``) of a gradient-sized float32 buffer over all
  devices.

:func:`decentral_jax.runtime_model.cluster_file.fit_links` turns the
exchanges into the :class:`~decentral_jax.runtime_model.costs.Cluster`
fields, and the file (schema in :mod:`.cluster_file`) is what ``predict
--cluster FILE`` reads. Process 0 writes it. Units: seconds, bytes.
"""

from __future__ import annotations

import datetime
import math
import os
import time

import numpy as np

from decentral_jax.runtime_model import cluster_file
from decentral_jax.tools import distinct_paths
from decentral_jax.tools.runtime_model_cli import cluster_header
from decentral_jax.tools.runtime_model_cli import config_sets
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import tables


def _timed(fn, *args, repeats: int) -> list[float]:
  """Seconds of ``repeats`` calls of a compiled ``fn`` (after one warm-up)."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  out = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append(time.perf_counter() - t)
  return out


def _exchange(mesh, perm, size: int, repeats: int) -> float:
  """Median seconds of one ``ppermute`` of ``size`` float32 per device."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  n = mesh.devices.size
  sharding = NamedSharding(mesh, P("d"))
  x = jax.jit(lambda: jnp.ones((n * size,), jnp.float32),
              out_shardings=sharding)()
  fn = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "d", perm),
                             mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  return float(np.median(_timed(fn, x, repeats=repeats)))


def _all_reduce(mesh, size: int, repeats: int) -> float:
  """Median seconds of a ``psum`` of ``size`` float32 held by every device."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  n = mesh.devices.size
  x = jax.jit(lambda: jnp.ones((n * size,), jnp.float32),
              out_shardings=NamedSharding(mesh, P("d")))()
  fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
                             in_specs=P("d"), out_specs=P("d")))
  return float(np.median(_timed(fn, x, repeats=repeats)))


def _task(config):
  """The config's task at its local batch (``global_batch / n_workers``);
  built before anything is timed, so its errors (data, evaluation set)
  cost no measurement."""
  from decentral_jax.runner import tasks  # pylint: disable=import-outside-toplevel
  n = int(config.n_workers)
  return tasks.make_task(config, n, int(config.global_batch) // n)


def _compute(config, task, repeats: int) -> tuple[dict, dict]:
  """One worker's forward and forward + backward seconds on one device."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.local_devices()[0]
  # Zeros of the parameters' shapes: the timing of dense ops does not depend
  # on the values, and tracing the initializer is much cheaper than running
  # it (compiling it) on a cold process.
  shapes = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
  params = jax.device_put(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                       shapes), device)
  count = int(sum(np.size(x) for x in jax.tree.leaves(params)))

  def loss(p, batch):
    return task.loss(p, batch, None)[0]

  fwd = jax.jit(loss)
  both = jax.jit(jax.value_and_grad(loss))
  batches = [jax.device_put(jax.tree.map(lambda a: a[0],
                                         task.host_batch(k, [0])), device)
             for k in range(repeats + 1)]
  jax.block_until_ready(fwd(params, batches[0]))
  jax.block_until_ready(both(params, batches[0]))
  f_s, fb_s = [], []
  for b in batches[1:]:  # alternate, so slow phases of the host hit both
    t = time.perf_counter()
    jax.block_until_ready(fwd(params, b))
    f_s.append(time.perf_counter() - t)
    t = time.perf_counter()
    jax.block_until_ready(both(params, b))
    fb_s.append(time.perf_counter() - t)
  f, fb = float(np.median(f_s)), float(np.median(fb_s))
  samples = np.asarray(fb_s)
  work = dict(param_count=count, forward_s=f, backward_s=max(fb - f, 0.0),
              compute_cv=float(samples.std() / max(samples.mean(), 1e-300)),
              compute_samples_s=[float(x) for x in fb_s],
              **wire_dtypes(config, [x.dtype for x in jax.tree.leaves(shapes)]))
  return work, {"forward_samples_s": f_s, "forward_backward_samples_s": fb_s}


def wire_dtypes(config, leaf_dtypes) -> dict:
  """``grad_dtype`` and ``param_dtype`` of the workload as the runner
  sends them: gradients (All-Reduce) in the parameters' own dtype (the
  widest of ``leaf_dtypes``, e.g. bfloat16 with ``model.param_dtype=
  bfloat16``), parameters (gossip, local sync) in ``config.comm_dtype``
  where set, else in that dtype. Names, e.g. ``"bfloat16"``."""
  own = max((np.dtype(d) for d in leaf_dtypes), key=lambda d: d.itemsize,
            default=np.dtype(np.float32))
  comm = str(getattr(config, "comm_dtype", "") or "")
  return dict(grad_dtype=own.name, param_dtype=comm or own.name)


def host_bytes(devices) -> tuple[float, str]:
  """Bytes one device of ``devices`` (this process's) can hold for a
  message, and where the figure comes from.

  On CPU the simulated devices share the host's memory
  (``SC_PHYS_PAGES``), so each gets its share; on an accelerator, the
  device's ``bytes_limit`` (its memory, when the backend reports it).
  Returns ``(inf, "")`` when neither is known.
  """
  stats = None
  try:
    stats = devices[0].memory_stats()
  except (AttributeError, NotImplementedError, RuntimeError):
    pass
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"]), (
        f"{stats['bytes_limit'] / 1e9:.3g} GB of device memory")
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return math.inf, ""
  return total / len(devices), (
      f"this host's {total / 1e9:.3g} GB shared by {len(devices)} devices")


def check_sizes_fit(sizes_bytes, devices) -> None:
  """Raises ValueError naming ``--sizes-MB`` unless every size is a finite
  number of at least 4 bytes and a message and its received copy
  (2 x the largest size) fit in one device's share of memory
  (:func:`host_bytes`), before anything is allocated."""
  if not all(isinstance(s, (int, float)) and math.isfinite(s) and s >= 4
             for s in sizes_bytes):
    raise ValueError("--sizes-MB needs finite sizes of >= 4 bytes, got "
                     f"{[s / 1e6 for s in sizes_bytes]} MB.")
  limit, source = host_bytes(devices)
  largest = max(sizes_bytes)
  if 2 * largest > limit:
    raise ValueError(
        f"--sizes-MB {largest / 1e6:g} needs {2 * largest / 1e9:.3g} GB per "
        f"device (a message and its copy), more than {source}; give sizes "
        f"of at most {limit / 2e6:.4g} MB.")


def measure(config, *, local_size: int = 0, sizes_bytes=(1e6, 16e6),
            repeats: int = 5, config_path: str = "",
            overrides=()) -> dict:
  """Runs the measurements; every process calls it (collectives).

  Must run after :func:`decentral_jax.runner.launch.initialize_from_config`
  (or in a single process).

  Args:
    config: a run config (``decentral_jax.runner.config``): its model, batch and
      ``n_workers`` set the compute measured.
    local_size: devices per node; 0: the devices of one process
      (:func:`decentral_jax.parallel.multiprocess.host_local_size`).
    sizes_bytes: message sizes of the exchanges (>= 2 distinct, bytes).
    repeats: timed repetitions of everything (>= 1).
    config_path, overrides: recorded in ``meta``.

  Returns:
    The file's dict (without ``schema``): ``cluster``, ``workload``,
    ``measurements``, ``meta``.

  Raises:
    ValueError: fewer than 2 devices, ``local_size`` not dividing the
      device count, fewer than 2 sizes, a size that is not finite or that
      this host's devices cannot hold (:func:`check_sizes_fit`),
      ``repeats < 1``, or the config's task
      (:func:`decentral_jax.runner.tasks.make_task`: its data, its
      evaluation set), before anything is timed.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from decentral_jax.parallel import multiprocess
  devices = multiprocess.ordered_devices()
  n = len(devices)
  big_l = int(local_size) or multiprocess.host_local_size()
  check_sizes_fit(list(sizes_bytes), jax.local_devices())
  sizes = sorted({int(s) for s in sizes_bytes})
  if n < 2:
    raise ValueError(f"measure needs >= 2 devices, found {n}; start one "
                     "process per host, or simulate CPU devices with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N.")
  if big_l < 1 or n % big_l:
    raise ValueError(f"--local-size {big_l} must divide the {n} devices.")
  if len(sizes) < 2 or sizes[0] < 4:
    raise ValueError("--sizes-MB needs >= 2 distinct sizes of >= 4 bytes.")
  if repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {repeats}.")
  task = _task(config)
  mesh = Mesh(np.array(devices), ("d",))
  elems = [max(1, s // 4) for s in sizes]
  meas = {"sizes_bytes": [4 * e for e in elems], "repeats": int(repeats),
          "concurrent_flows": None, "intra_pair_s": None,
          "inter_pair_s": None, "inter_concurrent_s": None}
  if big_l >= 2:
    meas["intra_pair_s"] = [_exchange(mesh, [(0, 1), (1, 0)], e, repeats)
                            for e in elems]
  if n // big_l >= 2:
    one = [(0, big_l), (big_l, 0)]
    many = [(j, big_l + j) for j in range(big_l)] + \
        [(big_l + j, j) for j in range(big_l)]
    meas["inter_pair_s"] = [_exchange(mesh, one, e, repeats) for e in elems]
    meas["inter_concurrent_s"] = [_exchange(mesh, many, e, repeats)
                                  for e in elems]
    meas["concurrent_flows"] = big_l
  work, comp = _compute(config, task, repeats)
  meas.update(comp)
  meas["all_reduce_bytes"] = 4 * work["param_count"]
  meas["all_reduce_s"] = _all_reduce(mesh, work["param_count"], repeats)
  links = cluster_file.fit_links(meas, n, big_l)
  meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"),
          "jax_version": jax.__version__, "backend": jax.default_backend(),
          "device_kind": devices[0].device_kind,
          "process_count": jax.process_count(), "devices": n,
          "config": config_path, "overrides": list(overrides)}
  return {"cluster": links, "workload": work, "measurements": meas,
          "meta": meta}


def run(args) -> int:
  """The ``measure`` subcommand: measure, write ``--out``, describe it.

  Raises:
    ValueError: a bad flag or config (one line naming it).
  """
  from decentral_jax.runner import launch  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import presets  # pylint: disable=import-outside-toplevel
  from decentral_jax.parallel import multiprocess
  inputs.check_output_path(args.out, "--out")
  distinct_paths.check_distinct_paths(
      [("--out", args.out)],
      [("--config", distinct_paths.config_file(args.config, presets.PRESETS))])
  if args.repeats < 2:  # predict needs >= 2 compute samples for the spread
    raise ValueError(f"--repeats must be >= 2 (the compute spread needs two "
                     f"timings), got {args.repeats}.")
  config = config_sets.load("measure", args.config, args.set)
  distinct_paths.check_distinct_paths(  # the corpus or token files it reads
      [("--out", args.out)], distinct_paths.data_inputs(
          config.data.get("path"), "--set data.path"))
  with config_sets.set_spelling():  # the errors' fixes name --set FIELD
    launch.initialize_from_config(config)  # SLURM-aware, as the runner
    data = measure(config, local_size=args.local_size,
                   sizes_bytes=[x * 1e6 for x in args.sizes_MB],
                   repeats=args.repeats, config_path=args.config,
                   overrides=args.set)
  if multiprocess.is_main_process():
    tables.write_output("--out", args.out,
                        lambda: cluster_file.write(args.out, data))
    w = data["workload"]
    print(cluster_header.describe_cluster_file(
        args.out, {"schema": cluster_file.SCHEMA, **data}))
    print(f"  compute of one worker: forward {1e3 * w['forward_s']:.3g} ms, "
          f"backward {1e3 * w['backward_s']:.3g} ms (CV "
          f"{w['compute_cv']:.2f}), {w['param_count']:,} parameters")
    print(f"wrote {args.out}; predict with: python -m "
          f"decentral_jax.runtime_model predict --cluster {args.out}")
  return 0
