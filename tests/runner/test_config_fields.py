"""No config field is accepted and then ignored.

For every field of ``base_config()`` and every algorithm of
``methods.ALGORITHMS``: setting the field from its default to another
valid value (:data:`ALTERNATES`) either changes the train step that runs
(its lowered HLO) or is refused by ``check_config`` with one line naming
the field. Fields about the run rather than its step are listed, with the
reason, in :data:`EXEMPT`; a field in neither table fails
:func:`test_every_field_is_exempt_or_has_an_alternate`, and the sweep
(``slow``) picks up every algorithm of the registry by itself.

The fast tier runs one pair of the sweep and checks the tables, that every
(field, algorithm) pair the runner used to accept and ignore
(:data:`IGNORED`, read off the method homes) is refused, and that
``comm_dtype`` reaches the wire of the local-update methods (bytes per
step from the step's HLO, against the figures worked out by hand).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest
from ml_collections import config_dict

from conftest import FIXTURES, require_devices
from decentral_jax.parallel import mesh
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import methods
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax import topology

N = 8  # workers of every config below
# A tiny GPT (and CNN) so that a lowering takes about a second.
TINY = {"gpt": {"model.n_layer": 1, "model.n_embd": 16, "model.n_head": 2,
                "model.block_size": 8, "global_batch": 16,
                "eval_batches": 1},
        "cnn": {"model.features": (4, 8), "model.dense": 16,
                "global_batch": 16, "eval_batches": 1,
                "data.path": os.path.join(FIXTURES, "fashion_mnist")}}

# Fields about the run rather than its step, and why.
EXEMPT = {
    "algorithm": "the other axis of the table",
    "steps": "the run's length (and the schedule's horizon)",
    "seed": "initial parameters, data order and dropout keys: the inputs",
    "eval_interval": "when the averaged model is evaluated",
    "eval_batches": "how much validation data is evaluated",
    "log_interval": "when metrics (and the consensus distance) are logged",
    "checkpoint_interval": "when checkpoints are written",
    "keep_checkpoints": "how many checkpoints are kept",
    "tensorboard": "an extra metrics file",
    "tracker": "an extra copy of the metrics records (Weights & Biases)",
    "workdir": "where the run writes",
    "model.name": "which model group: the sweep runs on both (gpt, cnn)",
    "data.source": "which data the step is fed",
    "data.path": "where the data is read from",
    "data.val_fraction": "how a byte corpus is split for validation",
    "distributed.enabled": "joining a multi-process job",
    "distributed.coordinator_address": "joining a multi-process job",
    "distributed.num_processes": "joining a multi-process job",
    "distributed.process_id": "joining a multi-process job",
    "distributed.heartbeat_timeout_seconds": "failure detection",
    "distributed.initialization_timeout_seconds": "start-up timeout",
    # The fault group changes which workers step, not the compiled healthy
    # step: with faults.enabled each field is checked against a NumPy oracle
    # of the run (tests/runner/test_faults_runner.py, test_fault_schedule.py); with
    # faults.enabled=False a non-default value is refused
    # (test_disabled_fault_fields_are_refused below).
    **{f"faults.{k}": "the fault schedule of the run, not the step"
       for k in ("enabled", "failure_rate", "mean_downtime", "min_quorum",
                 "on_failure", "rejoin", "seed", "slow_fraction",
                 "slow_speed", "stragglers", "trace")},
}

# Another valid value of every other field (with fields it needs).
ALTERNATES = {
    "topology": ("ring", {}),
    "n_workers": (4, {}),
    "workers_per_node": (2, {}),
    "devices_per_worker": (2, {}),
    "workers_per_device": (2, {}),
    "worker_layout": ("data", {}),
    "comm_dtype": ("bfloat16", {}),
    "bucket_bytes": (2**20, {}),  # all of the tiny model in one bucket
    "gossip_rounds": ("static", {}),
    # On CPU "auto" is "log_step"; "next_step" compiles another step.
    "consensus_at": ("next_step", {}),
    "global_avg_interval": (5, {}),
    "gossip_every": (2, {}),
    "pipelined_gossip": (True, {}),
    "sync_every": (5, {}),
    "sync_every_u": (8, {}),
    "sync_every_v": (16, {}),
    "outer_optimizer.name": ("adam", {}),
    "outer_optimizer.lr": (0.5, {}),
    "outer_optimizer.momentum": (0.5, {}),
    "outer_optimizer.nesterov": (False, {}),
    "num_fragments": (2, {}),
    "overlap_steps": (1, {}),
    "merge_alpha": (0.5, {}),
    # trickle_reduction=False: one_peer_exp (decentralized_diloco's default)
    # has three rounds, which a trickled reduction refuses.
    "outer_overlap": ("eager", {"trickle_reduction": False}),
    "outer_latency": (2, {}),
    "trickle_reduction": (False, {}),
    # Read only with a format other than "none" (see _READ_WITH).
    "compression.format": ("int8", {}),
    "compression.block": (64, {}),
    "compression.fraction": (0.05, {}),
    "compression.error_feedback": (True, {}),
    "compression.error_decay": (0.9, {}),
    "compression.consensus_step": (0.25, {}),
    "global_batch": (32, {}),
    "micro_batches": (2, {}),
    "grad_clip": (0.5, {}),
    "optimizer.name": ("adamw", {"optimizer.accum_steps": 1}),
    "optimizer.b1": (0.8, {}),
    "optimizer.b2": (0.9, {}),
    "optimizer.eps": (1e-6, {}),
    "optimizer.weight_decay": (0.05, {}),
    "optimizer.accum_steps": (2, {}),
    "optimizer.beta_convention": ("per_step", {}),
    "schedule.name": ("constant", {}),
    "schedule.peak_lr": (1e-3, {}),
    "schedule.warmup_steps": (5, {}),
    "schedule.final_lr": (1e-4, {}),
    "model.vocab_size": (300, {}),
    "model.block_size": (16, {}),
    "model.n_layer": (2, {}),
    "model.n_head": (4, {}),
    "model.n_embd": (32, {}),
    "model.bias": (True, {}),
    "model.dropout": (0.1, {}),
    "model.dtype": ("bfloat16", {}),
    "model.param_dtype": ("bfloat16", {}),
    "model.remat": ("block", {}),
    "model.features": ((4, 8, 8), {}),
    "model.dense": (32, {}),
    "model.num_classes": (12, {}),
}

# The (field, algorithms) the runner accepted and ignored before
# check_config refused them, read off the method homes, experiment.py and
# step.py (with the defaults: topology one_peer_exp, one device per worker).
_NO_GOSSIP = ("all_reduce", "local_sgd", "diloco", "streaming_diloco",
              "desloc_adam")
_NO_OUTER = ("all_reduce", "decentralized", "local_sgd", "sgp", "desloc_adam")
_ALL = ("all_reduce", "decentralized", "local_sgd", "diloco",
        "decentralized_diloco", "streaming_diloco", "sgp", "desloc_adam")
IGNORED = {
    "topology": _NO_GOSSIP,
    "comm_dtype": ("all_reduce", "desloc_adam"),
    "bucket_bytes": _NO_GOSSIP,
    "gossip_rounds": _NO_GOSSIP,
    "global_avg_interval": ("all_reduce",  # workers already agree
                            "desloc_adam"),  # its own parameter syncs
    "gossip_every": tuple(a for a in _ALL if a != "decentralized"),
    "pipelined_gossip": tuple(a for a in _ALL if a != "decentralized"),
    "sync_every": ("all_reduce", "decentralized", "sgp"),
    "sync_every_u": tuple(a for a in _ALL if a != "desloc_adam"),
    "sync_every_v": tuple(a for a in _ALL if a != "desloc_adam"),
    "outer_optimizer.name": _NO_OUTER,
    "outer_optimizer.lr": _NO_OUTER,
    "outer_optimizer.momentum": _NO_OUTER,
    "outer_optimizer.nesterov": _NO_OUTER,
    "num_fragments": tuple(a for a in _ALL if a != "streaming_diloco"),
    "overlap_steps": tuple(a for a in _ALL if a != "streaming_diloco"),
    "merge_alpha": tuple(a for a in _ALL if a != "streaming_diloco"),
    "outer_overlap": _NO_OUTER,
    # Read only with outer_overlap != "none" (the sweep's base has none).
    "outer_latency": _ALL,
    "trickle_reduction": _ALL,
    # Only alternating_exp_ring reads the nodes; one_peer_exp does not.
    "workers_per_node": _ALL,
    # Placement over a worker's devices: there is one.
    "worker_layout": _ALL,
    # Nothing is compressed with the default format "none".
    "compression.format": ("all_reduce", "decentralized_diloco", "sgp",
                           "desloc_adam"),
    "compression.block": _ALL,
    "compression.fraction": _ALL,
    "compression.error_feedback": _ALL,
    "compression.error_decay": _ALL,
    "compression.consensus_step": _ALL,
}


def _leaves(c: config_dict.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for key, value in c.items():
    if isinstance(value, config_dict.ConfigDict):
      out += _leaves(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def _set(c, field: str, value) -> None:
  *groups, last = field.split(".")
  node = c
  for g in groups:
    node = node[g]
  node[last] = value


# What an algorithm needs set to run at all (DES-LOC runs its own Adam).
_BASES = {"desloc_adam": {"optimizer.name": "adamw",
                          "optimizer.accum_steps": 1}}
# Another value where the alternate is an algorithm's base.
_OWN_ALTERNATES = {("optimizer.name", "desloc_adam"): ("accum_adamw", {})}
# Accepted and without effect on an algorithm's base, with why: left out of
# the sweep below (not collected), since no other value exists to compare.
_SAME_STEP = {("optimizer.beta_convention", "desloc_adam"):
              "AdamW (its base): both conventions are Adam; an explicit "
              "override is refused by config.load_config"}


def _config(model: str, algorithm: str, **fields) -> config_dict.ConfigDict:
  """``base_config(model)``, tiny, for ``algorithm``, with ``fields``."""
  c = config_lib.base_config(model)
  for name, value in {**TINY[model], "algorithm": algorithm,
                      **_BASES.get(algorithm, {}), **fields}.items():
    _set(c, name, value)
  return c


def _changed(model: str, algorithm: str, field: str):
  value, extra = _OWN_ALTERNATES.get((field, algorithm),
                                     _alternates()[field])
  return _config(model, algorithm, **{field: value, **extra})


def _derived_alternate(field: str, spec):
  """Another valid value of a declared field not in ALTERNATES: the other
  bool, or the default's neighbour (+1, or x0.5 / x2 for a real) that its
  own rule accepts; a text field needs an ALTERNATES entry."""
  d = spec.default
  if isinstance(d, bool):
    return not d
  candidates = ((d + 1, d - 1) if isinstance(d, int) else
                (d * 0.5, d * 2, d + 0.5) if isinstance(d, float) else ())
  for value in candidates:
    try:
      spec.rule(field, value)
      return value
    except ValueError:
      continue
  raise AssertionError(f"config.{field} (declared): add another valid value "
                       "to ALTERNATES.")


@functools.cache
def _alternates() -> dict:
  """ALTERNATES plus the declared fields of the registered methods."""
  out = dict(ALTERNATES)
  for name, spec in methods.declared_fields().items():
    if name not in out:
      out[name] = (_derived_alternate(name, spec), {})
  return out


def _model_of(field: str) -> str:
  gpt = set(_leaves(config_lib.base_config("gpt")))
  return "gpt" if field in gpt else "cnn"


# ---------------------------------------------------------------------------
# The tables.
# ---------------------------------------------------------------------------


def test_every_field_is_exempt_or_has_an_alternate():
  fields = set(_leaves(config_lib.base_config("gpt"))) | set(
      _leaves(config_lib.base_config("cnn")))
  missing = sorted(fields - set(EXEMPT) - set(_alternates()))
  assert not missing, (
      f"config fields {missing} are neither in EXEMPT (with the reason) nor "
      "in ALTERNATES (another valid value, swept for every algorithm).")
  stale = sorted((set(EXEMPT) | set(ALTERNATES)) - fields)
  assert not stale, f"{stale} are not config fields any more."
  assert not set(EXEMPT) & set(ALTERNATES)


def test_every_algorithm_lists_the_method_fields_it_reads():
  assert set(_ALL) <= set(methods.ALGORITHMS)
  fields = set(_leaves(config_lib.base_config("gpt")))
  assert set(methods.method_fields()) <= fields
  for name, entry in methods.ALGORITHMS.items():
    assert set(entry.fields) <= set(methods.method_fields()), name
    assert set(entry.config_fields) <= set(entry.fields), name
    assert entry.uses_topology == ("topology" in entry.fields), name


def test_a_declared_field_is_refused_by_every_other_algorithm():
  """A method's own field (Method.config_fields): read by it alone."""
  declared = methods.declared_fields()
  assert {"sync_every_u", "sync_every_v"} <= set(declared)
  for name in declared:
    owners = [a for a, e in methods.ALGORITHMS.items()
              if name in e.config_fields]
    for algorithm in set(methods.ALGORITHMS) - set(owners):
      with pytest.raises(ValueError, match=f"config.{name}=.* has no effect"):
        validation.check_config(_changed("gpt", algorithm, name))


# What a field needs to be read at all (the sweep's base has neither).
_READ_WITH = {"workers_per_node": {"topology": "alternating_exp_ring"},
              "worker_layout": {"devices_per_worker": 2},
              "outer_latency": {"outer_overlap": "delayed"},
              "trickle_reduction": {"outer_overlap": "delayed"},
              "compression.block": {"compression.format": "int8"},
              "compression.fraction": {"compression.format": "topk"},
              "compression.error_feedback": {"compression.format": "int8"},
              "compression.error_decay": {"compression.format": "int8",
                                          "compression.error_feedback": True},
              "compression.consensus_step": {"compression.format": "int8",
                                             "topology": "exponential"}}


def _accepted(config) -> bool:
  try:
    validation.check_config(config)
  except ValueError:
    return False
  return True


@pytest.mark.parametrize("field", list(_alternates()))
def test_every_alternate_is_accepted_by_some_algorithm(field):
  """Else the sweep would pass on refusals of a bad value."""
  value, extra = _alternates()[field]
  extra = {**extra, **_READ_WITH.get(field, {})}
  assert any(_accepted(_config(_model_of(field), a, **{field: value}, **extra))
             for a in methods.ALGORITHMS), field


# ---------------------------------------------------------------------------
# What the runner used to ignore is refused (cheap: check_config only).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,algorithm", [
    (f, a) for f, algos in IGNORED.items() for a in algos])
def test_an_ignored_field_is_refused_in_one_line_naming_it(field, algorithm):
  with pytest.raises(ValueError) as info:
    validation.check_config(_changed("gpt", algorithm, field))
  message = str(info.value)
  assert "\n" not in message, message
  assert f"config.{field}=" in message, message
  assert "has no effect" in message, message
  assert f"--config.{field.split('.')[0]}" in message, message  # the fix


@pytest.mark.parametrize("name", topology.NAMES)
def test_workers_per_node_is_read_only_by_node_aware_topologies(name):
  """Refused exactly where 2 workers per node change no gossip round."""
  flat, nodes = topology.make(name, N, 1), topology.make(name, N, 2)
  same = flat.period == nodes.period and all(
      np.array_equal(flat.mixing_matrix(k), nodes.mixing_matrix(k))
      for k in range(flat.period)) and not mesh.is_node_aware(nodes, 2)
  config = _config("gpt", "decentralized", topology=name, workers_per_node=2)
  if same:
    with pytest.raises(ValueError, match="config.workers_per_node=2 has no"):
      validation.check_config(config)
  else:
    validation.check_config(config)


def test_outer_momentum_is_refused_with_the_adam_outer_optimizer():
  for key, value in (("momentum", 0.5), ("nesterov", False)):
    config = _config("gpt", "diloco", **{"outer_optimizer.name": "adam",
                                         f"outer_optimizer.{key}": value})
    with pytest.raises(ValueError,
                       match=f"config.outer_optimizer.{key}={value!r} has no "
                       "effect with config.outer_optimizer.name='adam'"):
      validation.check_config(config)


def test_resume_compares_only_the_fields_the_run_reads():
  """A checkpoint's value of a field the run ignores changed nothing."""
  require_devices(N)
  ar = experiment_lib.Experiment(_config("gpt", "all_reduce"))
  meta = run_meta.checkpoint_meta(ar, 5)
  # As a run written before such values were refused would have stored.
  run_meta.check_resumable(ar, dict(meta, comm_dtype="bfloat16",
                                    sync_every=20, gossip_every=3,
                                    workers_per_node=2), "ckpt")
  dec = experiment_lib.Experiment(_config("gpt", "decentralized"))
  meta = run_meta.checkpoint_meta(dec, 5)
  run_meta.check_resumable(dec, dict(meta, sync_every=20, num_fragments=2),
                           "ckpt")
  for key, value in (("gossip_every", 2), ("comm_dtype", "bfloat16")):
    with pytest.raises(ValueError, match=f"config.{key}="):
      run_meta.check_resumable(dec, dict(meta, **{key: value}), "ckpt")


# ---------------------------------------------------------------------------
# comm_dtype reaches the wire of the local-update methods.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", [
    pytest.param("local_sgd", marks=pytest.mark.slow), "diloco",
    pytest.param("decentralized_diloco", marks=pytest.mark.slow)])
def test_comm_dtype_halves_the_local_update_methods_bytes(algorithm):
  """bfloat16: half the float32 bytes of each sync (H = 10 steps).

  Local SGD and DiLoCo: an all-reduce's ``2 (n - 1) / n`` x the bytes, in
  bfloat16 (an all-to-all and an all-gather of ``(n - 1) / n`` each);
  decentralized DiLoCo on one_peer_exp: one peer's copy of the parameters
  per sync. Every leaf of the tiny model is a multiple of 8 elements, so
  no padding is sent.
  """
  require_devices(N)
  exp = experiment_lib.Experiment(_config("gpt", algorithm,
                                          comm_dtype="bfloat16"))
  state = exp.init_state()
  comm = exp.communication(state, exp.get_batch(0))
  floats = sum(x.size for x in jax.tree.leaves(state.params)) // N
  sync = (2 * (N - 1) / N if algorithm != "decentralized_diloco" else 1.0)
  assert comm["param_bytes"] == 4 * floats
  np.testing.assert_allclose(comm["bytes_per_step"], sync * 2 * floats / 10,
                             rtol=1e-12)


# ---------------------------------------------------------------------------
# The sweep: every (field, algorithm) pair (about 150 lowerings).
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hlo(config_json: str) -> str:
  """The lowered train step (round 0) of a config, as text."""
  exp = experiment_lib.Experiment(config_dict.ConfigDict(
      json.loads(config_json)))
  state, batch = exp.init_state(), exp.get_batch(0)
  step = jax.jit(functools.partial(exp.train_step, step=0))
  return step.lower(state, batch).as_text()


def _step_text(config) -> str:
  return _hlo(config.to_json())


# One representative pair stays in the fast tier (a field that used to be
# ignored and now changes the step); the other ~300 are slow.
_FAST_PAIR = ("comm_dtype", "diloco")
_SWEPT = [pytest.param(f, a, marks=() if (f, a) == _FAST_PAIR else
                       pytest.mark.slow)
          for f in _alternates() for a in methods.ALGORITHMS
          if (f, a) not in _SAME_STEP]


@pytest.mark.parametrize("field,algorithm", _SWEPT)
def test_every_field_changes_the_step_or_is_refused(field, algorithm):
  require_devices(2 * N)
  model = _model_of(field)
  changed = _changed(model, algorithm, field)
  try:
    validation.check_config(changed)
  except ValueError as e:
    message = str(e)
    assert "\n" not in message and f"config.{field}" in message, message
    return
  same = _step_text(changed) == _step_text(_config(model, algorithm))
  assert not same, (f"config.{field}={_alternates()[field][0]!r} is accepted "
                    f"with algorithm={algorithm} but the train step is the "
                    "same.")


@pytest.mark.parametrize("field,value", [
    ("failure_rate", 0.1), ("mean_downtime", 3.0), ("min_quorum", 2),
    ("on_failure", "rollback"), ("rejoin", "keep"), ("seed", 5),
    ("slow_fraction", 0.25), ("slow_speed", 0.25), ("stragglers", "wait")])
def test_disabled_fault_fields_are_refused(field, value):
  c = config_lib.base_config("gpt")
  c.algorithm = "diloco"
  default = c.faults[field]
  if value == default:  # pick another valid value than the default
    pytest.fail(f"faults.{field}: the test value equals the default")
  c.faults[field] = value
  with pytest.raises(ValueError, match=f"config.faults.{field}"):
    validation.check_config(c)


def test_nesterov_is_refused_without_outer_momentum():
  """Nesterov SGD with momentum 0 is plain SGD: optax's updates agree."""
  import optax
  g = {"w": np.arange(3.0, dtype=np.float32)}
  a, b = (optax.sgd(0.7, momentum=None, nesterov=n) for n in (True, False))
  ua, _ = a.update(g, a.init(g))
  ub, _ = b.update(g, b.init(g))
  np.testing.assert_array_equal(ua["w"], ub["w"])
  config = _config("gpt", "diloco", **{"outer_optimizer.momentum": 0.0,
                                       "outer_optimizer.nesterov": False})
  with pytest.raises(ValueError, match=(
      r"config.outer_optimizer.nesterov=False has no effect with "
      r"config.outer_optimizer.momentum=0.0 .*--config.outer_optimizer."
      r"nesterov=True")):
    validation.check_config(config)
  # Momentum 0 alone (plain SGD outer step) and nesterov=False with
  # momentum stay valid.
  validation.check_config(_config("gpt", "diloco",
                                  **{"outer_optimizer.momentum": 0.0}))
  validation.check_config(_config("gpt", "diloco",
                                  **{"outer_optimizer.nesterov": False}))
