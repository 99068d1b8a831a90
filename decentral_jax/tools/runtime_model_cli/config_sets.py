"""``--set FIELD=VALUE`` of ``measure`` and ``calibrate``: the config they read.

Each command declares the config fields it reads (:data:`READS`: a field,
or a group such as ``model.`` and every field under it); an override of
any other field is refused, naming it and why, before the config is
loaded (a field the command never reads would only be copied into the
record, or be replaced by the command's own choice: ``calibrate`` times
``all_reduce`` and ``one_peer_exp`` whatever ``algorithm`` and
``topology`` say). The config loader's messages, which speak of
``--config.FIELD`` flags, are put in this command line's spelling
(``--set FIELD=VALUE``). No JAX.
"""

from __future__ import annotations

import contextlib

#: Command -> (the config fields it reads, what it does instead of the rest).
READS = {
    "measure": (
        ("n_workers", "global_batch", "eval_batches", "comm_dtype", "seed",
         "model.", "data.", "distributed."),
        "it times one worker's forward and backward at the local batch and "
        "the links; the run's length, schedule, method and records are no "
        "part of it"),
    "calibrate": (
        ("n_workers", "global_batch", "eval_batches", "micro_batches",
         "devices_per_worker", "workers_per_device", "workers_per_node",
         "worker_layout", "comm_dtype", "bucket_bytes", "gossip_every",
         "gossip_rounds", "pipelined_gossip", "global_avg_interval",
         "log_interval", "consensus_at", "grad_clip", "seed", "model.",
         "data.", "optimizer."),
        "it times a few steps of its own all_reduce and one_peer_exp runs; "
        "the run's length, schedule, method, topology and records are no "
        "part of it"),
}


#: Why ``calibrate`` cannot time a compressed run.
NO_COMPRESSION = (
    "calibrate cannot time compression (its all_reduce run sends "
    "uncompressed gradients, and compressed gossip needs a static mixing "
    "matrix, not its one_peer_exp)")
#: Command -> ``(group, why)`` of config fields it cannot time: refused
#: with that reason, not as a field it does not read.
CANNOT = {"calibrate": (("compression.", NO_COMPRESSION),), "measure": ()}


def _reads(command: str, field: str) -> bool:
  return any(field == r or (r.endswith(".") and field.startswith(r))
             for r in READS[command][0])


def check_sets(command: str, sets) -> None:
  """Refuses a ``--set`` entry that is not ``FIELD=VALUE``, names a
  field ``command`` does not read (:data:`READS`), or sets a field an
  earlier entry set (only the last would count).

  Raises:
    ValueError: one line naming the entry, why, and the fix.
  """
  reads, why = READS[command]
  given = {}
  for item in sets:
    field, eq, _ = str(item).partition("=")
    field = field.strip()
    if field.startswith("--config."):
      field = field[len("--config."):]
    if not eq or not field:
      raise ValueError(f"--set {item!r} is not FIELD=VALUE; give e.g. "
                       "--set n_workers=4.")
    for group, reason in CANNOT[command]:
      if field.startswith(group):
        raise ValueError(f"--set {item}: {reason}; drop it.")
    if not _reads(command, field):
      names = ", ".join(r + "*" if r.endswith(".") else r for r in reads)
      raise ValueError(
          f"--set {item}: {command} does not read config.{field} ({why}); "
          f"drop it (it reads {names}).")
    if field in given:
      raise ValueError(f"--set {item}: config.{field} is given twice "
                       f"(--set {given[field]}, then --set {item}); give it "
                       "once.")
    given[field] = item


@contextlib.contextmanager
def set_spelling():
  """Re-raises a ``ValueError`` of the runner inside (a config check, a
  task's data or evaluation set) with its fixes spelled as this command
  line takes them: ``--config.FIELD=VALUE`` (``flag --config.FIELD``)
  becomes ``--set FIELD=VALUE`` (``set --config.FIELD`` ``give --set
  FIELD``)."""
  try:
    yield
  except ValueError as e:
    raise ValueError(str(e).replace("flag --config.", "--set ")
                     .replace("set --config.", "give --set ")
                     .replace("--config.", "--set ")) from None


def load(command: str, config: str, sets):
  """The config ``--config`` names with the ``--set`` overrides, checked
  by :func:`check_sets` first, then loaded and validated
  (:func:`decentral_jax.runner.validation.check_config`); the loader's
  errors in ``--set`` spelling (:func:`set_spelling`).

  Raises:
    ValueError: one line naming ``--set FIELD=VALUE`` or ``--config``.
  """
  from decentral_jax.runner import presets  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import validation  # pylint: disable=import-outside-toplevel
  check_sets(command, sets)
  with set_spelling():
    loaded = presets.load_named_or_file(config, sets)
    validation.check_config(loaded)
  return loaded
