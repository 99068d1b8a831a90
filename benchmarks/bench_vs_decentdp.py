"""Side by side with the authors' library: decentral_jax vs decent-dp on CPU.

Same tiny causal LM on both sides (byte vocabulary 256, 2 layers, width 128,
4 heads, context 64, no biases, tied head; 434,816 parameters), local batch 8
sequences per worker, AccumAdamW with ``accum_steps`` 4 on the one-peer
exponential graph, 8 workers, random windows of the bundled CPython
documentation text:

* decent-dp 0.2.3 on PyTorch CPU: 8 gloo processes launched by ``torchrun``
  with ``OMP_NUM_THREADS=1`` (``benchmarks/decentdp_side_by_side.py``);
* decentral_jax: the step ``jit(shard_map(grad ->
  decentralized_adamw(accum_steps=4)))`` with parameters and optimizer
  state donated, on 8 CPU devices laid out as ``P`` processes of ``D``
  devices (``PxD``; default one process with 8 simulated devices). With
  ``P > 1`` the processes are started like the multi-process tests start
  theirs: one per process id, ``JAX_PLATFORMS=cpu``,
  ``XLA_FLAGS=--xla_force_host_platform_device_count=D``, joined on a free
  port of 127.0.0.1 through :func:`decentral_jax.runner.launch.initialize`
  (JAX's gloo CPU collectives), each in its own process group, all killed
  if any fails or the job runs past ``--timeout``. Every JAX process gets
  ``OMP_NUM_THREADS=1`` like the PyTorch side; ``:1t`` adds
  ``--xla_cpu_multi_thread_eigen=false`` (each device's matmuls on one
  thread, XLA's counterpart of ``OMP_NUM_THREADS=1``), ``:sync`` turns off
  JAX's asynchronous CPU dispatch, ``:pool1`` gives XLA's CPU thread pool
  one thread instead of one per core, and ``:local`` replaces the graph by the
  identity matrix (the same step with no communication at all, to separate
  communication from compute). Parameters are the model's pytree
  (``tree``), one flat vector (``flat``) or a pytree gossiped with one
  buffer per round (``bucketed``, a prototype); see :func:`jax_side`.

Each side runs ``--warmup`` steps (compilation and decent-dp's first two
special iterations included there) and then ``--steps`` timed steps with at
most two JAX steps in flight (the host waits for step ``t-1`` after
dispatching step ``t``); tokens/s counts all workers' tokens. Runs
alternate between the sides (the order rotates every repeat) ``--repeats``
times, each in fresh processes; the table reports medians and the ratio
decentral_jax / decent-dp of the medians, and every run logs the 1-minute
load average before and after it. Because the machine may be shared, each
side also reports CPU seconds per step and tokens per CPU-second (user +
system time of all its processes and threads during the timed steps).

Optional dependency, not used by CI: ``pip install torch==2.13.0 decent-dp
loguru``.

  python benchmarks/bench_vs_decentdp.py --repeats 5
  python benchmarks/bench_vs_decentdp.py --repeats 3 --jax_sides tree:1t \\
      flat:1t:8x1 flat:1t:8x1:local tree:1t:local
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _bucketed_mix(mix):
  """``gossip.mix`` that sends each dtype's leaves as ONE buffer per round.

  A prototype of a proposed change (not the shipped library): leaves of a
  dtype are concatenated, mixed with one collective per permute term, and
  split again, like decent-dp's contiguous buckets.
  """
  import jax
  import jax.numpy as jnp

  def bucketed(tree, topology, step, axis_name="workers", *, comm_dtype=None):
    leaves, treedef = jax.tree.flatten(tree)
    groups = {}
    for i, x in enumerate(leaves):
      groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    out = list(leaves)
    for idx in groups.values():
      flat = jnp.concatenate([leaves[i].ravel() for i in idx])
      mixed = mix(flat, topology, step, axis_name, comm_dtype=comm_dtype)
      offset = 0
      for i in idx:
        size = leaves[i].size
        out[i] = mixed[offset:offset + size].reshape(leaves[i].shape)
        offset += size
    return treedef.unflatten(out)

  return bucketed


def parse_jax_side(spec: str, workers: int) -> dict:
  """Options of a decentral_jax variant written ``LAYOUT[:OPTION...]``.

  ``LAYOUT`` is ``tree``, ``flat`` or ``bucketed`` (see :func:`jax_side`);
  options: ``1t`` (``--xla_cpu_multi_thread_eigen=false``), ``PxD`` (``P``
  processes of ``D`` CPU devices each joined through
  ``decentral_jax.runner.launch.initialize`` with gloo collectives; default
  ``1x<workers>``), ``sync`` (``jax_cpu_enable_async_dispatch=False``),
  ``local`` (identity mixing matrix: the same step without any
  communication), ``pool1`` (XLA's CPU thread pool with one thread),
  ``vK`` (``K`` workers on each device, vmapped:
  ``parallel.make_mesh(n, workers_per_device=K)``; ``v8`` puts 8 workers
  on one device, ``v4`` on two).

  Raises:
    ValueError: an unknown layout or option, or ``P * D * K != workers``.
  """
  parts = spec.split(":")
  if parts[0] not in ("tree", "flat", "bucketed"):
    raise ValueError(f"jax side {spec!r}: layout must be tree, flat or "
                     "bucketed.")
  out = {"layout": parts[0], "one_thread": False, "procs": 1,
         "devices": workers, "sync": False, "local": False, "pool1": False,
         "per_device": 1}
  for p in parts[1:]:
    m = re.fullmatch(r"(\d+)x(\d+)", p)
    v = re.fullmatch(r"v(\d+)", p)
    if p == "1t":
      out["one_thread"] = True
    elif p in ("sync", "local", "pool1"):
      out[p] = True
    elif m:
      out["procs"], out["devices"] = int(m.group(1)), int(m.group(2))
    elif v and int(v.group(1)) >= 1:
      out["per_device"] = int(v.group(1))
    else:
      raise ValueError(f"jax side {spec!r}: unknown option {p!r} (use 1t, "
                       "PxD, sync, local, pool1 or vK).")
  k = out["per_device"]
  if k > 1:
    if out["procs"] > 1 or workers % k:
      raise ValueError(f"jax side {spec!r}: vK needs one process and K "
                       f"dividing --workers {workers}.")
    out["devices"] = workers // k
  if out["procs"] * out["devices"] * k != workers:
    raise ValueError(f"jax side {spec!r}: {out['procs']} processes x "
                     f"{out['devices']} devices != --workers {workers}.")
  return out


def jax_side(args) -> dict:
  """Runs the decentral_jax side in this process; returns its measurements.

  Layouts: ``tree`` (parameters as the model's pytree: the plain library
  usage), ``flat`` (one float32 vector of all parameters, made with
  ``jax.flatten_util.ravel_pytree``, unravelled inside the loss; same
  optimizer, weight decay masked per element), ``bucketed`` (pytree, with
  the gossip prototype :func:`_bucketed_mix`).

  With ``--procs P > 1`` this is process ``--process_id`` of a ``P``-process
  job on ``127.0.0.1:--port`` (``decentral_jax.runner.launch.initialize``,
  gloo CPU collectives); each process owns ``n / P`` consecutive workers,
  draws only their batches and reports its own CPU time; process 0 returns
  the job's measurements (CPU time summed over the processes), the others
  return None. The simulated device count and XLA flags come from the
  environment the launcher sets (``XLA_FLAGS``, ``JAX_PLATFORMS=cpu``).

  ``--pool1``: XLA:CPU runs a step's operations on a thread pool with one
  thread per usable core (two here), even with
  ``--xla_cpu_multi_thread_eigen=false``; on a loaded machine the second
  thread adds CPU time without making the step faster. XLA has no flag for
  the pool's size, which it takes from the process's CPU affinity when the
  backend starts; so the process is pinned to one core while the backend
  starts and unpinned right after (it then runs on any core, as the
  PyTorch processes do). The counterpart of ``OMP_NUM_THREADS=1``.
  """
  cpus = os.sched_getaffinity(0)
  if args.pool1:  # XLA sizes its CPU thread pool by the usable cores
    os.sched_setaffinity(0, {sorted(cpus)[args.process_id % len(cpus)]})
  import jax
  if args.sync:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  from decentral_jax.runner import launch
  from decentral_jax.parallel import multiprocess
  if args.procs > 1:
    launch.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                           num_processes=args.procs,
                           process_id=args.process_id, cpu=True,
                           heartbeat_timeout_seconds=30)
  jax.devices()  # starts the CPU backend and its thread pool
  os.sched_setaffinity(0, cpus)  # unpinned again: any core, like torch
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.flatten_util import ravel_pytree
  import _common
  from decentral_jax.comm import gossip
  from decentral_jax import models
  from decentral_jax import optim
  from decentral_jax import parallel
  from decentral_jax import topology
  from decentral_jax.data import text
  from decentral_jax.models import gpt

  n, b, t = args.workers, args.local_batch, args.context
  cfg = gpt.GPTConfig(vocab_size=256, block_size=t, n_layer=2, n_head=4,
                      n_embd=128, bias=False, dropout=0.0, dtype=jnp.float32)
  mesh = parallel.make_mesh(n, devices=multiprocess.ordered_devices(),
                            workers_per_device=args.per_device)
  axis = parallel.worker_axis(mesh)
  sharding = parallel.worker_sharding(mesh)
  mine = (multiprocess.process_workers(mesh) if args.per_device == 1
          else np.arange(n))  # this process's workers
  topo = (topology.from_matrices([np.eye(n)], name="identity")
          if args.no_comm else topology.make("one_peer_exp", n))
  p0 = jax.tree.map(np.asarray, gpt.init_params(cfg, jax.random.key(0)))

  def stacked(x):  # n copies of a host array, each process fills its rows
    rows = np.ascontiguousarray(np.broadcast_to(x[None], (len(mine),) + x.shape))
    return jax.make_array_from_process_local_data(sharding, rows,
                                                  (n,) + x.shape)

  if args.layout == "bucketed":
    gossip.mix = _bucketed_mix(gossip.mix)
  if args.layout == "flat":
    flat0, unravel = ravel_pytree(p0)
    decay = np.asarray(ravel_pytree(jax.tree.map(
        lambda x: np.full(x.shape, float(x.ndim >= 2), np.float32), p0))[0])
    tx = optim.decentralized_adamw(
        args.lr, topo, b1=0.9, b2=0.95, weight_decay=0.1 * decay, mask=None,
        accum_steps=args.accum_steps, axis_name=axis)
    model = models.GPT(cfg)

    def loss_fn(flat, tokens):
      logits = model.apply({"params": unravel(flat)}, tokens[:, :-1])
      return models.lm_loss(logits, tokens[:, 1:])

    def one(flat, s, tokens):
      loss, g = jax.value_and_grad(loss_fn)(flat, tokens)
      u, s = tx.update(g, s, flat)
      return optax.apply_updates(flat, u), s, loss

    step = jax.jit(parallel.per_worker(one, mesh), donate_argnums=(0, 1))
    params = stacked(np.asarray(flat0))
  else:
    tx = optim.decentralized_adamw(
        args.lr, topo, b1=0.9, b2=0.95, weight_decay=0.1,
        accum_steps=args.accum_steps, axis_name=axis)
    step = _common.gpt_step(cfg, tx, mesh)
    params = jax.tree.map(stacked, p0)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  data = np.frombuffer(text.pydoc_corpus(), np.uint8).astype(np.int32)
  rng = np.random.default_rng(1234 + args.process_id)

  def batch():  # this process's workers' windows -> global [n, b, t+1]
    starts = rng.integers(0, len(data) - t - 1, size=len(mine) * b)
    windows = data[starts[:, None] + np.arange(t + 1)[None]]
    return jax.make_array_from_process_local_data(
        sharding, windows.reshape(len(mine), b, t + 1), (n, b, t + 1))

  loss = None
  t_compile = time.perf_counter()
  for i in range(args.warmup):
    params, state, loss = step(params, state, batch())
    loss.block_until_ready()
    if i == 0:
      t_compile = time.perf_counter() - t_compile
  multihost_utils.sync_global_devices("timed steps start")
  t0 = time.perf_counter()
  c0 = time.process_time()  # all threads of this process
  prev = None
  for _ in range(args.steps):
    params, state, loss = step(params, state, batch())
    if prev is not None:  # at most two steps in flight
      prev.block_until_ready()
    prev = loss
  loss.block_until_ready()
  cpu = time.process_time() - c0
  multihost_utils.sync_global_devices("timed steps end")
  elapsed = time.perf_counter() - t0
  if args.procs > 1:  # CPU seconds of every process
    cpu = float(np.sum(multihost_utils.process_allgather(np.float64(cpu))))
  if jax.process_index() != 0:
    return None
  name = f"decentral_jax-{args.layout}" + (
      "-1thread" if args.one_thread else "") + (
          f"-{args.procs}x{n // args.procs}" if args.procs > 1 else "") + (
              "-sync" if args.sync else "") + (
                  "-nocomm" if args.no_comm else "") + (
                      "-pool1" if args.pool1 else "") + (
                          f"-{args.per_device}perdevice"
                          if args.per_device > 1 else "")
  return {"side": name,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
          "processes": args.procs,
          "devices_per_process": n // args.procs // args.per_device,
          "workers_per_device": args.per_device,
          "xla_pool_threads": 1 if args.pool1 else len(cpus),
          "tokens_per_s": n * b * t * args.steps / elapsed,
          "ms_per_step": 1e3 * elapsed / args.steps, "steps": args.steps,
          "cpu_s_per_step": cpu / args.steps,
          "tokens_per_cpu_s": n * b * t * args.steps / cpu,
          "world_size": n,
          "final_loss_worker0": float(np.asarray(loss.addressable_data(0))[0]),
          "compile_plus_first_step_s": round(t_compile, 2),
          "jax": jax.__version__, "params": gpt.num_params(p0)}


def _last_json(stdout: str) -> dict:
  for line in reversed(stdout.strip().splitlines()):
    line = line.strip()
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError("no JSON result in the output:\n" + stdout[-2000:])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def jax_env(opts: dict) -> dict[str, str]:
  """Environment of a decentral_jax process: CPU platform, device count,
  XLA flags of the variant, ``OMP_NUM_THREADS=1`` (as on the PyTorch side)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f
           and "xla_cpu_multi_thread_eigen" not in f]
  flags.append(f"--xla_force_host_platform_device_count={opts['devices']}")
  if opts["one_thread"]:
    flags.append("--xla_cpu_multi_thread_eigen=false")
  env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu",
             OMP_NUM_THREADS="1")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return env


def run_jax_job(opts: dict, args) -> dict:
  """Starts the ``P`` processes of a decentral_jax variant and waits for them.

  Each process runs in its own process group (not its own session: with the
  kernel's scheduler autogroups, a new session would get its own share of
  the CPU against other programs, which the ``torchrun`` processes of the
  other side do not get) with its output in a temporary file; whatever
  happens (error, timeout, interrupt), every process group still alive is
  killed before this returns or raises.

  Raises:
    RuntimeError: a process failed (the others are killed at once) or the
      job ran past ``--timeout`` s; the message holds the tail of each
      process's output.
  """
  port = _free_port()
  env = jax_env(opts)
  base = [sys.executable, os.path.abspath(__file__), "--child_jax",
          "--workers", str(args.workers), "--layout", opts["layout"],
          "--procs", str(opts["procs"]), "--port", str(port),
          "--steps", str(args.steps), "--warmup", str(args.warmup),
          "--local_batch", str(args.local_batch), "--context",
          str(args.context), "--accum_steps", str(args.accum_steps),
          "--lr", str(args.lr), "--per_device", str(opts["per_device"])]
  base += ["--one_thread"] * opts["one_thread"] + ["--sync"] * opts["sync"] \
      + ["--no_comm"] * opts["local"] + ["--pool1"] * opts["pool1"]
  procs, logs = [], []
  with tempfile.TemporaryDirectory(prefix="bench_jax_") as tmp:
    try:
      for pid in range(opts["procs"]):
        logs.append(os.path.join(tmp, f"p{pid}.log"))
        with open(logs[-1], "wb") as log:
          procs.append(subprocess.Popen(
              base + ["--process_id", str(pid)], env=env, cwd=_ROOT,
              stdout=log, stderr=subprocess.STDOUT, process_group=0))
      deadline = time.monotonic() + args.timeout
      while time.monotonic() < deadline:  # until all end or one fails
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(codes):
          break
        time.sleep(0.2)
    finally:
      for p in procs:
        if p.poll() is None:
          with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    outs = []
    for path in logs:
      with open(path, encoding="utf-8", errors="replace") as f:
        outs.append(f.read())
  codes = [p.returncode for p in procs]
  if any(codes):
    tails = "\n".join(
        f"--- process {i} (exit {c}) ---\n" + "\n".join(
            l for l in o.splitlines() if "[Gloo]" not in l)[-2000:]
        for i, (c, o) in enumerate(zip(codes, outs)))
    raise RuntimeError(f"decentral_jax job failed or timed out after "
                       f"{args.timeout} s:\n{tails}")
  return _last_json(outs[0])


def run_side(side: str, args) -> dict:
  if side.startswith("jax:"):
    return run_jax_job(parse_jax_side(side[4:], args.workers), args)
  common = ["--steps", str(args.steps), "--warmup", str(args.warmup),
            "--local_batch", str(args.local_batch), "--context",
            str(args.context), "--accum_steps", str(args.accum_steps),
            "--lr", str(args.lr)]
  cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", str(args.workers),
         os.path.join(_HERE, "decentdp_side_by_side.py")
         ] + common
  env = dict(os.environ, OMP_NUM_THREADS="1")
  r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                     timeout=args.timeout, cwd=_ROOT)
  if r.returncode != 0:
    raise RuntimeError(f"{side} side failed (exit {r.returncode}):\n"
                       f"{r.stderr[-3000:]}")
  return _last_json(r.stdout)


def side_name(side: str, workers: int) -> str:
  """Table label of a side (``torch`` or ``jax:SPEC``)."""
  if side == "torch":
    return (f"decent-dp 0.2.3 (PyTorch CPU, {workers} gloo processes, "
            "1 thread each)")
  o = parse_jax_side(side[4:], workers)
  layout = {"tree": "pytree parameters", "flat": "flat parameter vector",
            "bucketed": "pytree + bucketed-gossip prototype"}[o["layout"]]
  where = (f"1 process x {o['devices']} device"
           f"{'s' * (o['devices'] > 1)}" if o["procs"] == 1 else
           f"{o['procs']} gloo processes x {o['devices']} "
           f"device{'s' * (o['devices'] > 1)}")
  if o["per_device"] > 1:
    where += f" x {o['per_device']} workers (vmapped)"
  knobs = ["single-threaded Eigen" if o["one_thread"] else
           "default XLA flags"]
  if o["pool1"]:
    knobs.append("1-thread XLA pool")
  if o["sync"]:
    knobs.append("synchronous dispatch")
  if o["local"]:
    knobs.append("NO communication (identity W)")
  return f"decentral_jax, {where}, {layout}, {', '.join(knobs)}"


DEFAULT_JAX_SIDES = ("tree:1t", "tree:1t:8x1", "flat:1t:8x1",
                     "flat:1t:8x1:pool1", "tree:1t:8x1:pool1")


def parse_args(argv=None):
  """The flags, each checked before any work (one ``error:`` line): counts
  and rates bounded, ``--out`` writable, each ``--jax_sides`` variant
  valid."""
  from decentral_jax.tools import flag_types  # one error: line
  count, real = flag_types.integer, flag_types.real  # bounded flag types
  ap = flag_types.Parser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=count(1, 1000), default=5)
  ap.add_argument("--steps", type=count(1, 10**6), default=30)
  ap.add_argument("--warmup", type=count(0, 10**6), default=5)
  ap.add_argument("--workers", type=count(1, 4096), default=8)
  ap.add_argument("--local_batch", type=count(1, 10**6), default=8)
  ap.add_argument("--context", type=count(1, 10**6), default=64)
  ap.add_argument("--accum_steps", type=count(1, 10**6), default=4)
  ap.add_argument("--lr", type=real(0, 10, open_lo=True), default=3e-3)
  ap.add_argument("--jax_sides", nargs="+", default=list(DEFAULT_JAX_SIDES),
                  help="decentral_jax variants LAYOUT[:OPTION...]: LAYOUT in "
                       "tree, flat, bucketed; options 1t "
                       "(--xla_cpu_multi_thread_eigen=false), PxD (P gloo "
                       "processes x D devices), sync (synchronous CPU "
                       "dispatch), local (no communication), pool1 (1-thread "
                       "XLA pool), vK (K workers per device); see "
                       "parse_jax_side")
  ap.add_argument("--no_torch", action="store_true",
                  help="leave out the decent-dp side (exploration runs)")
  ap.add_argument("--timeout", type=count(1, 86400, " (seconds)"),
                  default=600)
  ap.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                "vs_decentdp.jsonl"))
  for flag in ("--child_jax", "--one_thread", "--sync", "--no_comm",
               "--pool1"):
    ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--layout", choices=("tree", "flat", "bucketed"),
                  default="tree", help=argparse.SUPPRESS)
  ap.add_argument("--procs", type=count(1, 4096), default=1,
                  help=argparse.SUPPRESS)
  ap.add_argument("--per_device", type=count(1, 4096), default=1,
                  help=argparse.SUPPRESS)
  ap.add_argument("--process_id", type=count(0, 4095), default=0,
                  help=argparse.SUPPRESS)
  ap.add_argument("--port", type=count(0, 65535), default=0,
                  help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if not args.child_jax:
    import _common  # pylint: disable=import-outside-toplevel
    _common.check_flags(ap, args, outputs=("--out",),
                        rules=(_check_jax_sides,))
  return args


def _check_jax_sides(args) -> None:
  """Each ``--jax_sides`` variant parses at ``--workers``."""
  for v in args.jax_sides:
    try:
      parse_jax_side(v, args.workers)
    except ValueError as e:
      raise ValueError(f"--jax_sides: {e}") from None


def main(argv=None):
  args = parse_args(argv)
  if args.child_jax:
    res = jax_side(args)
    if res is not None:
      print(json.dumps(res), flush=True)
    return

  import statistics
  import _common
  if not args.no_torch:
    _common.require_decent_dp("; --no_torch runs the decentral_jax sides "
                              "only.")
  print("machine:", json.dumps(_common.machine_info()), flush=True)
  sides = ["torch"] * (not args.no_torch) + [f"jax:{v}"
                                              for v in args.jax_sides]
  results = {side: [] for side in sides}
  _common.make_parent_dir(args.out)
  for rep in range(args.repeats):
    k = rep % len(sides)
    for side in sides[k:] + sides[:k]:  # rotate the order every repeat
      load_before = round(os.getloadavg()[0], 2)
      res = run_side(side, args)
      info = _common.machine_info()
      res.update(repeat=rep, date_utc=info["date_utc"], variant=side,
                 load_avg_1m_before=load_before,
                 load_avg_1m=info.get("load_avg_1m"))
      results[side].append(res)
      _common.write_output(args.out, "--out", lambda f, res=res: f.write(
          json.dumps(res) + "\n"), mode="a",
                           kept="the repeats before this one are in it")
      print(f"repeat {rep} {side:<24} {res['tokens_per_s']:>10,.0f} "
            f"tokens/s  {res['ms_per_step']:.1f} ms/step  (load "
            f"{load_before} -> {res['load_avg_1m']}, "
            f"{res['cpu_s_per_step']:.3f} CPU-s/step)",
            flush=True)
  med = {k: statistics.median(r["tokens_per_s"] for r in v)
         for k, v in results.items()}
  ref = med.get("torch")
  rows = []
  for side in sides:
    rows.append({
        "library": side_name(side, args.workers),
        "tokens/s (median)": f"{med[side]:,.0f}",
        "ms/step (median)": f"{statistics.median(r['ms_per_step'] for r in results[side]):.1f}",
        "vs decent-dp": f"{med[side] / ref:.2f}x" if ref else "",
        "tokens per CPU-second (median)": f"{statistics.median(r['tokens_per_cpu_s'] for r in results[side]):,.0f}",
        "CPU-s/step (median)": f"{statistics.median(r['cpu_s_per_step'] for r in results[side]):.3f}",
        "runs (tokens/s)": ", ".join(f"{r['tokens_per_s']:,.0f}"
                                     for r in results[side]),
    })
  print()
  print(_common.format_table(rows, list(rows[0])))


if __name__ == "__main__":
  main()
