"""Checks of a run config: the boundary between the user's config and the runner.

:func:`check_config` validates every field of
:func:`decentral_jax.runner.config.base_config` (type, sign, range, finiteness,
choices, and cross-field rules such as ``global_batch`` divisible by
``n_workers``), raising a one-line ``ValueError`` that names the field and
the override that fixes it; past it the runner reads fields without
fallbacks. :func:`ignored_fields` lists the fields set to a value the run
would not read (:func:`unread_reason`; :func:`check_config` refuses them)
and :func:`config_warnings` lists accepted but suspicious settings.

The rules of single fields are in :mod:`decentral_jax.runner.field_rules`;
the checks of one method (its sync and gossip periods, its compression and
faults) in its home under :mod:`decentral_jax.runner.methods`, reached
through the registry; device and process counts in
:mod:`decentral_jax.runner.devices`.
"""

from __future__ import annotations

from ml_collections import config_dict

from decentral_jax.comm import fault_schedule
from decentral_jax.runner import builders
from decentral_jax.runner import devices
from decentral_jax.runner import field_checks
from decentral_jax.runner import field_rules
from decentral_jax.runner import methods
from decentral_jax.runner.config import DATA_SOURCES
from decentral_jax.runner.config import OPTIMIZERS
from decentral_jax.runner.config import base_config
from decentral_jax.topology import schedules as topology_lib


_BYTE_SOURCES = ("pydoc", "text_file")
# Fields only the built-in AdamW / AccumAdamW read.
_ADAM_FIELDS = ("optimizer.b1", "optimizer.b2", "optimizer.eps",
                "optimizer.weight_decay", "optimizer.beta_convention")
# Topologies whose rounds depend on config.workers_per_node (node-aware: the
# others build the same rounds for any number of workers per node).
_NODE_TOPOLOGIES = ("alternating_exp_ring",)


#: The most parameters a GPT worker may have (6.9e10: 256 GiB in float32,
#: beyond one accelerator's memory and several times any GPT this runner
#: has trained); the size fields are bounded one by one, their product here.
MAX_GPT_PARAMS = 2**36


def gpt_param_count(model: config_dict.ConfigDict) -> int:
  """Parameters of one worker's GPT (``config.model``), by formula: tied
  token embedding ``V C``, positions ``T C``, per block ``12 C^2 + 2 C``
  (``c_attn``, ``c_proj``, ``c_fc``, ``c_proj`` kernels and two LayerNorm
  scales) plus ``11 C`` biases, and the final LayerNorm ``C`` (+ ``C``)."""
  v, t = int(model.vocab_size), int(model.block_size)
  c, layers, bias = int(model.n_embd), int(model.n_layer), bool(model.bias)
  block = 12 * c * c + 2 * c + 11 * c * bias
  return v * c + t * c + layers * block + c + c * bias


def _divisors(n: int, limit: int = 12) -> list[int]:
  """The first ``limit`` divisors of ``n`` (O(sqrt n), for messages)."""
  small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))[:limit]


def check_config(config: config_dict.ConfigDict) -> None:
  """Validates a run config; raises a one-line ``ValueError`` naming the field.

  Checks that every field of :func:`base_config` is present and then each
  field against its rule (``field_rules.RULES``, ``MODEL_RULES``): choices
  by name;
  integers (never bools) in ``[min, 2**31 - 1]``, the seed in
  ``[0, 2**32 - 1]``; reals finite (no NaN or inf) with a lower bound
  (``schedule.peak_lr > 0``; ``schedule.final_lr``, ``grad_clip``,
  ``optimizer.eps`` and ``optimizer.weight_decay`` >= 0) or in ``[0, 1)``
  (``optimizer.b1``, ``optimizer.b2``, ``model.dropout``,
  ``data.val_fraction``); bools True or False; paths strings or unset.
  Then the relations: ``workers_per_node`` divides ``n_workers``, which
  divides ``global_batch``; ``devices_per_worker`` divides the local batch
  ``global_batch / n_workers``, and ``micro_batches`` the local batch per
  device; ``optimizer.accum_steps`` is 1 for ``adamw``;
  ``model.n_head`` divides ``model.n_embd`` and the GPT has at most
  :data:`MAX_GPT_PARAMS` parameters (:func:`gpt_param_count`);
  ``schedule.final_lr <=
  peak_lr`` for ``warmup_cosine`` (a cosine "decay" upwards is refused);
  ``data.val_fraction > 0`` for byte corpora (pydoc, text_file). A warmup
  longer than the run is allowed (see :func:`config_warnings`). Device
  counts, data files, token ids and corpus lengths are checked when the
  experiment is built. Last, a field set to a value the run would not read
  (:func:`ignored_fields`, e.g. ``comm_dtype`` with ``all_reduce`` or
  ``sync_every`` with ``decentralized``) is refused.

  Raises:
    ValueError: the first problem found; the message names the config field
      and how to fix it.
  """
  c = config
  model = _model_kind(c)
  base = base_config(c.model.name if model == "custom" else model)
  field_rules.check_fields(c, list(base.keys()), "")
  for group in ("optimizer", "outer_optimizer", "schedule", "model", "data",
                "distributed", "compression"):
    field_rules.check_fields(c[group], list(base[group].keys()), group)
  declared = methods.declared_fields()
  for name in declared:
    *group, leaf = name.split(".")
    field_rules.check_fields(field_rules.field(c, ".".join(group)) if group
                             else c, [leaf], ".".join(group))
  for name, rule in {**field_rules.RULES, **field_rules.MODEL_RULES[model],
                     **{n: f.rule for n, f in declared.items()}}.items():
    value = field_rules.field(c, name)
    if name in field_rules.UP_TO_ONE and value == 1 and \
        not isinstance(value, bool):
      continue
    rule(name, value)
  _check_workers(c)
  o, s = c.optimizer, c.schedule
  if o.name != "accum_adamw" and o.accum_steps != 1:
    raise ValueError(
        f"config.optimizer.accum_steps={o.accum_steps} only applies to "
        "accum_adamw; set --config.optimizer.name=accum_adamw or "
        "--config.optimizer.accum_steps=1.")
  if s.name == "warmup_cosine" and s.final_lr > s.peak_lr:
    raise ValueError(
        f"config.schedule.final_lr={s.final_lr!r} exceeds config.schedule."
        f"peak_lr={s.peak_lr!r}; the cosine decays from peak_lr to final_lr: "
        f"set --config.schedule.final_lr={s.peak_lr / 10:g} (or lower).")
  if model == "gpt" and c.model.n_embd % c.model.n_head:
    raise ValueError(
        f"config.model.n_head={c.model.n_head} must divide config.model."
        f"n_embd={c.model.n_embd}; set --config.model.n_head= one of "
        f"{_divisors(int(c.model.n_embd))}.")
  if model == "gpt" and gpt_param_count(c.model) > MAX_GPT_PARAMS:
    raise ValueError(
        f"config.model.n_embd={c.model.n_embd}, n_layer={c.model.n_layer}, "
        f"vocab_size={c.model.vocab_size} and block_size="
        f"{c.model.block_size} give {gpt_param_count(c.model):.3g} "
        f"parameters per worker, more than the {MAX_GPT_PARAMS:.3g} "
        "(2**36) a worker may hold; lower config.model.n_embd or "
        "config.model.n_layer.")
  if c.data.source in _BYTE_SOURCES and not c.data.val_fraction > 0:
    raise ValueError(
        f"config.data.val_fraction={c.data.val_fraction!r} leaves no "
        f"validation split of data.source={c.data.source}; set "
        "--config.data.val_fraction=0.1 (any value in (0, 1)).")
  method = methods.lookup(c.algorithm)
  if method.checks is not None:
    method.checks(c)
  ignored = ignored_fields(c)
  if ignored:
    raise ValueError(ignored[0])
  _check_compression(c, method)
  _check_faults(c, method)
  devices.check_distributed(c)


def _model_kind(c: config_dict.ConfigDict) -> str:
  """``"gpt"``, ``"cnn"`` or ``"custom"`` (your own model: a registered
  name or ``module:attribute``, resolved by its field rule)."""
  if "model" not in c or "name" not in c.model:
    return "gpt"
  name = c.model.name
  if name in DATA_SOURCES:
    return name
  if "options" in c.model:
    field_rules.MODEL_RULES["custom"]["model.name"]("model.name", name)
    return "custom"
  return field_checks.choice(name, "model.name", tuple(DATA_SOURCES))


def _check_workers(c: config_dict.ConfigDict) -> None:
  """Cross-field checks of workers, nodes, devices and the batch."""
  n, local = int(c.n_workers), int(c.workers_per_node)
  if n % local:
    raise ValueError(f"config.workers_per_node={local} must divide "
                     f"config.n_workers={n}; set --config.workers_per_node= "
                     f"one of {_divisors(n)}.")
  batch = int(c.global_batch)
  if batch % n:
    lo = max(n, batch // n * n)
    raise ValueError(
        f"config.global_batch={batch} is not divisible by config.n_workers="
        f"{n} (the global batch is split evenly across workers); use e.g. "
        f"--config.global_batch={lo} or {lo + n}.")
  dpw = int(c.devices_per_worker)
  if (batch // n) % dpw:
    raise ValueError(
        f"config.global_batch={batch} gives {batch // n} sequences per "
        f"worker (config.n_workers={n}), which a worker of config."
        f"devices_per_worker={dpw} devices cannot split evenly; use a "
        f"global_batch divisible by {n * dpw}.")
  _check_micro_batches(batch // n, dpw, int(c.micro_batches))
  k = int(c.workers_per_device)
  if k > 1 and dpw > 1:
    raise ValueError(
        f"config.workers_per_device={k} and config.devices_per_worker={dpw}:"
        " a worker either spans several devices or shares one with others; "
        "set one of them to 1.")
  if n % k:
    raise ValueError(
        f"config.workers_per_device={k} does not divide config.n_workers="
        f"{n} (each device holds the same number of workers); use one of "
        f"{_divisors(n)}.")


def _check_micro_batches(local: int, dpw: int, k: int) -> None:
  """``micro_batches`` divides the local batch per device."""
  if (local // dpw) % k:
    where = (f"{local} sequences per worker" if dpw == 1 else
             f"{local // dpw} sequences per device ({local} per worker over "
             f"config.devices_per_worker={dpw} devices)")
    raise ValueError(
        f"config.micro_batches={k} does not divide the local batch of "
        f"{where}; set --config.micro_batches= one of "
        f"{_divisors(local // dpw)}.")


def _check_faults(c: config_dict.ConfigDict, method: methods.Method) -> None:
  """The `faults` group: each field, then its relations to the run."""
  if "faults" not in c:
    return
  field_rules.check_fields(c.faults, list(base_config().faults.keys()),
                           "faults")
  for name, rule in field_rules.FAULT_RULES.items():
    value = field_rules.field(c, name)
    if name in field_rules.FAULT_UP_TO_ONE and value == 1 and \
        not isinstance(value, bool):
      continue
    rule(name, value)
  f = c.faults
  if not f.enabled:
    defaults = base_config().faults
    for key, default in defaults.items():
      if key != "enabled" and f[key] != default:
        raise ValueError(
            f"config.faults.{key}={f[key]!r} has no effect with "
            "config.faults.enabled=False; set --config.faults.enabled=True "
            f"or leave it at its default --config.faults.{key}={default!r}.")
    return
  if method.faults is None:
    raise ValueError(
        f"config.faults.enabled=True needs config.algorithm in "
        f"{', '.join(_fault_algorithms())}, got {c.algorithm!r}; set "
        "--config.algorithm=diloco or --config.faults.enabled=False.")
  method.faults(c)
  if f.min_quorum > c.n_workers:
    raise ValueError(
        f"config.faults.min_quorum={f.min_quorum} exceeds config.n_workers="
        f"{c.n_workers}: no outer step could ever be taken; set "
        f"--config.faults.min_quorum=<1..{c.n_workers}>.")
  _check_unread_faults(c)
  if f.trace:
    fault_schedule.check_trace_path(f.trace)
  if c.global_avg_interval:
    raise ValueError(
        f"config.global_avg_interval={c.global_avg_interval} would average "
        "dead workers' parameters too; with config.faults.enabled set "
        "--config.global_avg_interval=0.")


def _fault_algorithms() -> tuple[str, ...]:
  """The algorithms that run with ``config.faults.enabled`` (``Method.faults``
  set): those with an exact sync first, then those that gossip."""
  able = [m for m in methods.ALGORITHMS.values() if m.faults is not None]
  return tuple(m.name for m in sorted(able, key=lambda m: m.uses_topology))


def _check_compression(c: config_dict.ConfigDict,
                       method: methods.Method) -> None:
  """config.compression against the method (fields it does not read are
  refused by :func:`ignored_fields` already)."""
  z = c.compression
  if z.format == "none":
    return
  fmt = f"config.compression.format={z.format!r}"
  if z.format in ("int4", "fp4") and z.block % 2:
    raise ValueError(
        f"config.compression.block={z.block} must be even with {fmt} (two "
        f"values per byte); set --config.compression.block={z.block + 1}.")
  if c.comm_dtype:
    raise ValueError(
        f"config.comm_dtype={c.comm_dtype!r} and {fmt} both set what is "
        "sent; set --config.comm_dtype='' (or --config.compression.format="
        "none).")
  if "faults" in c and c.faults.enabled:
    raise ValueError(
        f"{fmt} and config.faults.enabled=True: the elastic sync sends "
        "float32; set --config.compression.format=none or "
        "--config.faults.enabled=False.")
  if method.compression_checks is not None:
    method.compression_checks(c, fmt)


def _unread_fault_reason(c: config_dict.ConfigDict, key: str) -> str | None:
  """Why the enabled fault schedule of ``c`` does not read
  ``config.faults.<key>``, or None if it does."""
  f = c.faults
  why = methods.lookup(c.algorithm).unread_faults.get(key)
  if why is not None:
    return why
  rates = ("failure_rate", "mean_downtime", "slow_fraction", "slow_speed",
           "seed")
  if key in rates and f.trace:
    return "config.faults.trace (the trace replaces the rates)"
  if key == "mean_downtime" and not f.failure_rate:
    return "config.faults.failure_rate=0 (no worker fails)"
  if key == "slow_speed" and not f.slow_fraction:
    return "config.faults.slow_fraction=0 (no worker is slow)"
  no_trace = " and no config.faults.trace"
  if key == "rejoin" and not f.failure_rate and not f.trace:
    return f"config.faults.failure_rate=0{no_trace} (no worker fails)"
  if key == "stragglers" and not f.slow_fraction and not f.trace:
    return f"config.faults.slow_fraction=0{no_trace} (no worker is slow)"
  misses = f.failure_rate or f.trace or (f.slow_fraction
                                         and f.stragglers != "wait")
  if key in ("on_failure", "min_quorum") and not misses:
    return (f"config.faults.failure_rate=0{no_trace}, and no slow worker "
            "left behind (slow_fraction=0 or stragglers='wait'): no worker "
            "fails or misses the quorum")
  if key == "seed" and not f.failure_rate and not f.slow_fraction:
    return ("config.faults.failure_rate=0 and slow_fraction=0 (nothing is "
            "drawn)")
  return None


def unread_fault_keys(c: config_dict.ConfigDict) -> tuple[str, ...]:
  """The ``config.faults`` fields the enabled schedule of ``c`` does not
  read (() without faults); a resume does not compare them (a checkpoint
  of an older version may hold a value the method then required, e.g.
  decentralized's ``rejoin='copy_mean'`` without failures)."""
  if "faults" not in c or not c.faults.enabled:
    return ()
  return tuple(k for k in base_config().faults.keys()
               if k != "enabled" and _unread_fault_reason(c, k) is not None)


def _check_unread_faults(c: config_dict.ConfigDict) -> None:
  """Refuses a fault setting the enabled schedule would not read, and a
  ``slow_fraction`` that makes no worker slow."""
  f, defaults = c.faults, base_config().faults
  for key, default in defaults.items():
    why = _unread_fault_reason(c, key)
    if why is not None and f[key] != default and _method_allows(c, key,
                                                                default):
      raise ValueError(
          f"config.faults.{key}={f[key]!r} has no effect with {why}; leave "
          f"it at its default: --config.faults.{key}={_setting(default)}.")
  n = int(c.n_workers)
  if f.slow_fraction and not f.trace:
    if int(round(float(f.slow_fraction) * n)) == 0:  # as from_rates counts
      raise ValueError(
          f"config.faults.slow_fraction={f.slow_fraction!r} makes "
          f"round({f.slow_fraction!r} x config.n_workers={n}) = 0 workers "
          f"slow; set --config.faults.slow_fraction={1 / n:.6g} (one "
          "worker) or more, or 0.")
    if f.slow_speed == 1:
      raise ValueError(
          f"config.faults.slow_fraction={f.slow_fraction!r} with config."
          "faults.slow_speed=1 slows no worker down; set --config.faults."
          "slow_speed below 1, or --config.faults.slow_fraction=0.")


def _method_allows(c: config_dict.ConfigDict, key: str, default) -> bool:
  """Whether the method's fault check accepts ``config.faults.<key>`` at
  its default (decentralized requires ``rejoin='copy_mean'`` where workers
  can fail: its value is then the method's, never an unread setting)."""
  trial = c.copy_and_resolve_references()
  trial.faults[key] = default
  try:
    methods.lookup(c.algorithm).faults(trial)
  except ValueError:
    return False
  return True


def _setting(value) -> str:
  """``value`` as the right-hand side of a ``--config.<field>=`` flag."""
  return repr(value) if isinstance(value, str) else str(value)


def unread_reason(config: config_dict.ConfigDict, field: str) -> str | None:
  """Why ``config`` does not read ``field``, or None if it does.

  Not read: a field of :func:`decentral_jax.runner.methods.method_fields`
  (a method's own declared fields included) that ``config.algorithm`` does not list (``Method.fields``), or one its
  ``Method.unread`` names (CHOCO-gossip's ``bucket_bytes``);
  ``workers_per_node`` unless the algorithm gossips over a node-aware
  topology (``alternating_exp_ring``, the only one whose rounds depend on
  it); ``worker_layout`` with ``devices_per_worker = 1``;
  ``outer_optimizer.momentum`` and ``nesterov`` with
  ``outer_optimizer.name = "adam"``, ``nesterov`` with
  ``outer_optimizer.momentum = 0``; ``outer_latency`` and
  ``trickle_reduction`` with ``outer_overlap = "none"``;
  ``schedule.final_lr`` unless ``schedule.name = "warmup_cosine"``;
  ``schedule.warmup_steps`` with ``schedule.name = "constant"``; the other
  ``compression`` fields with ``compression.format = "none"``,
  ``compression.fraction`` unless ``topk``, ``compression.error_decay``
  without ``error_feedback``; ``optimizer.b1``, ``b2``, ``eps``,
  ``weight_decay`` and ``beta_convention`` with your own inner optimizer
  (``optimizer.name`` neither adamw nor accum_adamw); ``data.path`` with
  ``data.source = "pydoc"`` (the bundled text). A group
  (``"outer_optimizer"``) is not read if none of its fields is.

  Returns:
    The setting that ignores it, with why (for a message), or None.
  """
  c = config
  if field == "data.path" and c.data.get("source") == "pydoc":
    return ("config.data.source='pydoc' (the bundled text; to train on "
            "your own file set --config.data.source=text_file, or "
            "token_bins for a directory of train.bin/val.bin)")
  if field in _ADAM_FIELDS and c.optimizer.name not in OPTIMIZERS:
    return (f"config.optimizer.name={c.optimizer.name!r} (your own inner "
            "optimizer reads none of the AdamW fields)")
  entry = methods.lookup(c.algorithm)
  members = [f for f in methods.method_fields() if f.startswith(field + ".")]
  if members:
    reasons = [unread_reason(c, f) for f in members]
    return reasons[0] if all(reasons) else None
  if field in methods.method_fields() and field not in entry.fields:
    users = [a for a, e in methods.ALGORITHMS.items() if field in e.fields]
    readers = (f"read only by {', '.join(users)}" if users else
               "no registered method reads it")
    return f"config.algorithm={c.algorithm!r} ({readers})"
  why = entry.unread(c, field) if entry.unread is not None else None
  if why is not None:
    return why
  if field in ("outer_optimizer.momentum", "outer_optimizer.nesterov") and \
      c.outer_optimizer.name == "adam":
    return "config.outer_optimizer.name='adam' (Adam with its default betas)"
  if field == "outer_optimizer.nesterov" and \
      float(c.outer_optimizer.momentum) == 0:
    return ("config.outer_optimizer.momentum=0.0 (Nesterov without momentum "
            "is plain SGD)")
  if field == "workers_per_node" and not (
      entry.uses_topology and
      topology_lib.canonical_name(c.topology) in _NODE_TOPOLOGIES):
    where = (f"config.topology={c.topology!r}" if entry.uses_topology else
             f"config.algorithm={c.algorithm!r}")
    return (f"{where} (only the node-aware {', '.join(_NODE_TOPOLOGIES)} "
            "groups workers into nodes)")
  if field in ("outer_latency", "trickle_reduction") and \
      c.outer_overlap == "none":
    return "config.outer_overlap='none' (plain DiLoCo waits for its reduction)"
  z = c.compression
  if field.startswith("compression.") and field != "compression.format":
    if z.format == "none":
      return "config.compression.format='none' (nothing is compressed)"
    if field == "compression.fraction" and z.format != "topk":
      return f"config.compression.format={z.format!r} (read by topk only)"
    if field == "compression.error_decay" and not z.error_feedback:
      return "config.compression.error_feedback=False (no residual to decay)"
  if field == "worker_layout" and int(c.devices_per_worker) == 1:
    return ("config.devices_per_worker=1 (it places a worker's state on its "
            "devices)")
  if field == "schedule.final_lr" and c.schedule.name != "warmup_cosine":
    return (f"config.schedule.name={c.schedule.name!r} (only warmup_cosine "
            "decays to final_lr)")
  if field == "schedule.warmup_steps" and c.schedule.name == "constant":
    return "config.schedule.name='constant' (peak_lr from the first step)"
  return None


def ignored_fields(config: config_dict.ConfigDict) -> list[str]:
  """Fields of a config set to a value that the run would not read.

  Each field :func:`unread_reason` names must keep its
  :func:`base_config` default: another value could not change the run,
  yet it would be recorded in the run's checkpoints. Call it on a config
  whose fields passed their type checks (:func:`check_config` does).

  Returns:
    One line per such field, naming it, the setting that ignores it and
    the override that fixes it (empty if none).
  """
  c = config
  kind = _model_kind(c)
  default = base_config(c.model.name if kind == "custom" else kind)
  out = []
  paths = ("data.path",) if "path" in c.data else ()
  for name in (*methods.method_fields(), "workers_per_node", "worker_layout",
               "schedule.final_lr", "schedule.warmup_steps", *_ADAM_FIELDS,
               *paths):
    value, want = field_rules.field(c, name), field_rules.field(default, name)
    if name == "topology":
      same = (topology_lib.canonical_name(value) ==
              topology_lib.canonical_name(want))
    else:
      same = value == want
    why = None if same else unread_reason(c, name)
    if why is not None:
      out.append(f"config.{name}={value!r} has no effect with {why}; leave "
                 f"it at its default: --config.{name}={_setting(want)}.")
  return out


def config_warnings(config: config_dict.ConfigDict) -> list[str]:
  """Settings of a valid config that run but are probably not meant.

  Currently: the method's own (``Method.warnings``; the DiLoCo methods:
  ``steps`` not a multiple of ``sync_every``, the evaluated theta misses
  the last steps), and
  ``schedule.warmup_steps > steps`` (warmup_cosine,
  inverse_sqrt): the learning rate never reaches ``peak_lr``; the stated
  peak is the schedule the run uses (:func:`builders.make_schedule`) at
  its last step, ``steps - 1`` (the warmup rises, so its largest value).
  Allowed because short smoke tests of long configs do exactly this.

  Returns:
    One line per finding (empty if none); the entry points print them.
  """
  c = config
  method = methods.lookup(c.algorithm)
  out = method.warnings(c) if method.warnings is not None else []
  s = c.schedule
  if s.name != "constant" and s.warmup_steps > c.steps:
    last_lr = float(builders.make_schedule(c)(c.steps - 1))
    out.append(
        f"config.schedule.warmup_steps={s.warmup_steps} > config.steps="
        f"{c.steps}: the learning rate stays in its linear warmup and peaks "
        f"at {last_lr / float(s.peak_lr):.3g} x peak_lr (step "
        f"{c.steps - 1}).")
  return out

