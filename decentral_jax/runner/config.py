"""The run-config schema: every field defined once, and loading with overrides.

:func:`base_config` defines every field of a run, with its meaning, units and
default, composed of one builder per group (in
:mod:`decentral_jax.runner.config_groups`: ``optimizer_group``,
``schedule_group``, ``compression_group``, ``faults_group``, ...,
each field with its comment); the files in ``configs/`` are short variants
that override what differs (``configs/gpt_tiny.py``,
``configs/cnn_fashion_mnist.py``, ``configs/gpt2_small_owt.py``). The model
group depends on the model: ``config_groups.gpt_model`` or ``cnn_model``.
:func:`load_config` parses a config file with command-line style overrides
exactly as ``experiments/train.py`` does (the entry points take them out of
their command line with :func:`split_overrides`). The checks of a loaded
config are in :mod:`decentral_jax.runner.validation`.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import inspect
import os
import re
from typing import Callable, Sequence

import jax.numpy as jnp
from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags

from decentral_jax import checks
from decentral_jax import layout_modes
from decentral_jax.runner import config_groups
from decentral_jax.runner import extensions
from decentral_jax.runner import flagfiles
from decentral_jax.runner import methods

OPTIMIZERS = ("adamw", "accum_adamw")
GOSSIP_ROUNDS = ("auto", "switch", "static")
CONSENSUS_AT = ("auto", "log_step", "next_step")
# config.worker_layout values: the worker layout modes.
WORKER_LAYOUTS = layout_modes.MODES
SCHEDULES = ("warmup_cosine", "inverse_sqrt", "constant")
# config.tracker values: none, or Weights & Biases.
TRACKERS = ("", "wandb")
DATA_SOURCES = {"gpt": ("pydoc", "text_file", "token_bins"),
                "cnn": ("fashion_mnist",)}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# config.model.remat values (decentral_jax.models.gpt.REMAT_MODES).
REMAT_MODES = ("none", "block", "block_dots")
GPT2_VOCAB = 50257  # token ids in nanoGPT's train.bin / val.bin
# Largest seed: jax.random.key keeps 32 bits (2**32 would be seed 0).
SEED_MAX = 2**32 - 1
# Most CPU devices the entry points simulate in one process (the limit and
# why: decentral_jax.checks).
MAX_SIMULATED_CPU_DEVICES = checks.MAX_SIMULATED_CPU_DEVICES


def base_config(model: str = "gpt") -> config_dict.ConfigDict:
  """Every field of a run config, with its default.

  The defaults are the ``gpt_tiny`` run except for its AccumAdamW beta
  convention and learning rate (``configs/gpt_tiny.py``). Composed of one
  builder per group of :mod:`~decentral_jax.runner.config_groups`, in this
  order: the method and its workers, the local-update fields
  (``outer_optimizer_group``), ``compression_group``, ``faults_group``, run
  length and batch, evaluation / logging / checkpoints, ``optimizer_group``,
  ``schedule_group``, the model (``gpt_model`` or ``cnn_model``),
  ``data_group`` and ``distributed_group``.

  Args:
    model: ``"gpt"`` or ``"cnn"``: which ``model`` group to include; or
      your own model, a name given to ``extensions.register_model`` or
      ``"package.module:attribute"`` (``config_groups.custom_model``, and a
      ``data`` group of ``source`` and ``options``: docs/extending.md).

  Returns:
    An unlocked ``ConfigDict``; a config file overrides what differs and
    returns it (``ml_collections.config_flags`` locks it).

  Raises:
    ValueError: an unknown ``model``.
  """
  custom = model not in config_groups.MODELS
  if custom and not (extensions.is_reference(model) or
                     model in extensions.registered("model")):
    raise ValueError(f"unknown model {model!r}; use one of "
                     f"{tuple(config_groups.MODELS)}, a name given to "
                     "register_model, or 'package.module:attribute'.")
  c = config_dict.ConfigDict()
  config_groups.add_parallel_fields(c)
  config_groups.add_local_update_fields(c)
  # Compressed communication, then slow and failing workers.
  c.compression = config_groups.compression_group()
  c.faults = config_groups.faults_group()
  config_groups.add_run_fields(c)
  config_groups.add_record_fields(c)
  # Each worker's optimizer and its learning-rate schedule.
  c.optimizer = config_groups.optimizer_group()
  c.schedule = config_groups.schedule_group()
  # The model (gpt_model(), cnn_model() or custom_model()), its data, the
  # multi-host job.
  c.model = config_groups.model_group(model)
  c.data = config_groups.data_group(model)
  c.distributed = config_groups.distributed_group()
  # Last, the fields the registered methods declare (Method.config_fields),
  # so that one colliding with any field above is refused.
  methods.add_declared_fields(c)
  return c


# ----------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------


def _where_relative(path: str) -> str:
  """For a relative ``path``: where it was looked for (the current
  directory), and the checkout's file of that name if there is one."""
  if os.path.isabs(path):
    return ""
  text = f" (relative to the current directory, {os.getcwd()}"
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  if os.path.isfile(os.path.join(root, path)):
    text += f"; the checkout has {os.path.join(root, path)}"
  return text + ")"


def load_config(path: str, overrides=()) -> config_dict.ConfigDict:
  """Loads a config file with overrides, parsed exactly as on the command line.

  Args:
    path: a config file with ``get_config()``, optionally with its argument
      (``"configs/gpt2_small_owt.py:all_reduce"``).
    overrides: strings ``"field=value"`` or ``"--config.field=value"``
      (``"optimizer.accum_steps=8"``), typed and checked by
      ``ml_collections.config_flags`` as ``experiments/train.py`` does.

  Returns:
    The locked ``ConfigDict`` (not yet validated: see
    :func:`decentral_jax.runner.validation.check_config`).

  Raises:
    ValueError: a missing, unreadable or broken config file (named, with the
      error of its import or ``get_config``, ``sys.exit()`` included), an
      unknown field (named), a value of the wrong type (the override
      named), or an override the run would not read (see
      :func:`_refuse_unread_overrides`).
  """
  file_part = path.split(":", 1)[0]
  if not os.path.exists(file_part):
    raise ValueError(f"config file {file_part!r} does not exist"
                     + _where_relative(file_part) + ".")
  if not os.path.isfile(file_part):
    raise ValueError(f"config file {file_part!r} is not a file; pass a "
                     "Python file with get_config(), e.g. configs/gpt_tiny.py.")
  if not os.access(file_part, os.R_OK):
    raise ValueError(f"config file {file_part!r} is not readable.")
  return with_overrides(lambda: _read_config_file(path), overrides, path)


def with_overrides(make_config: Callable[[], config_dict.ConfigDict],
                   overrides=(), source: str = "the config"
                   ) -> config_dict.ConfigDict:
  """``make_config()`` with overrides, parsed exactly as on the command line.

  Args:
    make_config: returns a fresh ``ConfigDict`` at each call (parsing the
      overrides changes the one it is given).
    overrides: strings ``"field=value"`` or ``"--config.field=value"``.
    source: where the config comes from, for messages (a file path or
      ``"the gpt_quick preset"``).

  Returns:
    The locked ``ConfigDict`` (not yet validated).

  Raises:
    ValueError: as :func:`load_config`, naming ``source``.
  """
  args = [o if o.startswith("--") else f"--config.{o}" for o in overrides]
  base = make_config()
  base.lock()
  if not args:
    return base
  args = [_whole_override(base, arg, source) for arg in args]
  try:
    # A fresh copy: parsing overrides changes it.
    argv = ["load_config", *args]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", make_config(),
                                    flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    fv(argv)
    config = fv.config
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    error = e
  else:
    _refuse_unread_overrides(config, args)
    return config
  for arg in args:  # name the override whose field does not exist
    key = arg[len("--config."):].split("=", 1)[0]
    node = base
    parts = key.split(".")
    for i, part in enumerate(parts):
      if not isinstance(node, config_dict.ConfigDict) or part not in node:
        near = (difflib.get_close_matches(part, list(node.keys()), n=1)
                if isinstance(node, config_dict.ConfigDict) else [])
        guess = ".".join(parts[:i] + near[:1] + parts[i + 1:])
        hint = f" (did you mean {guess}?)" if near else ""
        raise ValueError(f"{arg}{_origin(arg)}: unknown config field "
                         f"{key!r} in {source}{hint}.")
      node = node[part]
  said = config_error_message(error)
  named = [a for a in args if a.partition("=")[0] + "=" in said]
  raise ValueError(f"{source}: {said}{_origin(named[-1]) if named else ''}")


def _whole_override(base: config_dict.ConfigDict, arg: str,
                    source: str) -> str:
  """``arg`` (``--config.FIELD=VALUE``) with the value of an int field
  read as a count flag reads it (:func:`decentral_jax.checks.whole_number`:
  ``1e3`` is 1000); a value that is no whole number (``2.5``, ``nan``)
  is refused with the field's rule (``the config: --config.steps=2.5:
  config.steps must be an integer in [1, 2147483647], got '2.5'; set
  --config.steps=<int>.``). Other fields and unknown ones are left to the
  config parser.

  Raises:
    ValueError: one line naming ``source``, the override, the field rule
      and the fix.
  """
  key, sep, text = arg[len("--config."):].partition("=")
  node = base
  for part in key.split("."):
    if not sep or not isinstance(node, config_dict.ConfigDict) or \
        part not in node:
      return arg
    node = node[part]
  if isinstance(node, bool) or not isinstance(node, int):
    return arg
  value = checks.whole_number(text)
  if value is not None:
    return f"--config.{key}={value}"
  from decentral_jax.runner import field_rules  # pylint: disable=import-outside-toplevel
  rules = {**field_rules.RULES, **field_rules.FAULT_RULES,
           **{k: r for m in field_rules.MODEL_RULES.values()
              for k, r in m.items()}}
  if key in rules:
    try:
      rules[key](key, text)
    except ValueError as e:
      raise ValueError(f"{source}: {arg}{_origin(arg)}: {e}") from None
  raise ValueError(f"{source}: {arg}{_origin(arg)}: config.{key} must be an "
                   f"integer, got {text!r}; set --config.{key}=<int>.")


def _refuse_unread_overrides(config: config_dict.ConfigDict,
                             args: Sequence[str]) -> None:
  """Refuses an explicit ``--config.optimizer.beta_convention`` where the
  optimizer takes one step per window: adamw, or accum_adamw at
  ``accum_steps=1``.

  With one step per window both conventions are Adam (``b ** 1 = b``), so
  the field changes nothing. It is refused only when given as an
  override: a config file's own value (``configs/gpt_tiny.py`` sets
  ``per_step`` for its AccumAdamW) stays accepted when an override
  switches to adamw or to ``accum_steps=1``. (Other fields a run does not
  read are refused by ``validation.check_config`` whatever set them.)
  """
  opt = config.get("optimizer", {})
  name, steps = opt.get("name"), opt.get("accum_steps")
  if name == "adamw":
    setting, fix = ("config.optimizer.name='adamw'",
                    "--config.optimizer.name=accum_adamw")
  elif name == "accum_adamw" and steps == 1 and not isinstance(steps, bool):
    setting, fix = ("config.optimizer.name='accum_adamw' and config."
                    "optimizer.accum_steps=1",
                    "--config.optimizer.accum_steps above 1")
  else:
    return
  for arg in args:
    if arg.split("=", 1)[0] == "--config.optimizer.beta_convention":
      raise ValueError(
          f"{arg}{_origin(arg)} has no effect with {setting} (one step per window: both "
          f"conventions are Adam); drop it, or set {fix}.")


def _read_config_file(path: str) -> config_dict.ConfigDict:
  """The locked ``get_config(arg)`` of ``"file.py[:arg]"``, run in a fresh module.

  The file is executed with ``importlib`` (``exec_module``) in a module of its
  own that is not put in ``sys.modules``, so no name of an earlier config
  file leaks into it (``ml_collections.config_flags.DEFINE_config_file`` uses
  the deprecated ``load_module`` and reuses one module name for every file).

  Raises:
    ValueError: the file cannot be executed, has no ``get_config``, is
      given an ``arg`` its ``get_config`` takes none of (an empty one
      included) or none where it needs one, its ``get_config`` raises, or
      returns something other than a ``ConfigDict``.
  """
  file_part, *arg = path.split(":", 1)
  try:
    loader = importlib.machinery.SourceFileLoader("config_file", file_part)
    spec = importlib.util.spec_from_file_location("config_file", file_part,
                                                  loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wrong_arg = _wrong_arg(module.get_config, file_part, arg)
    config = None if wrong_arg else module.get_config(*arg)
  except SystemExit as e:  # sys.exit() in the file: not a config
    raise ValueError(f"config file {path!r} could not be loaded: it called "
                     f"sys.exit({e.code!r}) while being imported or in "
                     "get_config().") from None
  except Exception as e:  # pylint: disable=broad-except
    # The file itself: a syntax error, no get_config(), get_config raising.
    raise ValueError(f"config file {path!r} could not be loaded: "
                     f"{_root_cause(e)}") from None
  if wrong_arg:
    raise ValueError(f"config file {path!r} {wrong_arg}")
  if not isinstance(config, config_dict.ConfigDict):
    raise ValueError(f"get_config() of {path!r} returned a "
                     f"{type(config).__name__}, not an ml_collections "
                     "ConfigDict.")
  config.lock()
  return config


def _wrong_arg(get_config: Callable, file_part: str,
               arg: list[str]) -> str | None:
  """What is wrong with calling ``get_config(*arg)`` (``arg``: ``[]`` or
  the one ``ARG`` of ``FILE.py:ARG``), as the rest of a sentence naming
  the config file; None: nothing (or the signature cannot be read)."""
  if not callable(get_config):
    return None  # calling it says so
  if arg == [""]:
    return (f"ends in ':' with no ARG; give {file_part}:ARG or drop the "
            "':'.")
  try:
    inspect.signature(get_config).bind(*arg)
  except (TypeError, ValueError):
    if arg:
      return (f"takes no ARG (its get_config() has no parameter); drop "
              f"':{arg[0]}' and give {file_part}.")
    return (f"needs an ARG (its get_config() has a required parameter); "
            f"give {file_part}:ARG.")
  return None


def _root_cause(error: BaseException) -> str:
  """``"Type: message"`` of the innermost exception behind ``error``."""
  seen = {id(error)}
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
    if id(error) in seen:
      break
    seen.add(id(error))
  if isinstance(error, AttributeError) and "get_config" in str(error):
    return "it defines no get_config()"
  return f"{type(error).__name__}: {' '.join(str(error).split())}"


# absl's boolean parser raises ValueError(this, value), shown as a tuple.
_NON_BOOLEAN = re.compile(
    r"""\('Non-boolean argument to boolean flag', (['"])(.*?)\1\)""")


def config_error_message(error: BaseException) -> str:
  """One line from an ml_collections / absl flag-parsing exception (a
  non-boolean value of a boolean flag or field says what is accepted)."""
  msg = str(error.args[0] if error.args else error)
  msg = msg.replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
  msg = " ".join(msg.split())
  if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":
    msg = msg[1:-1]  # KeyError quotes its message
  return _NON_BOOLEAN.sub(lambda m: f"{m.group(2)!r} is not a boolean; give "
                          "true or false (also 1 or 0)", msg)


def parse_command_line(flag_values: flags.FlagValues, program: str,
                       argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Reads ``argv`` (the arguments, no program name) into ``flag_values``.

  ``--flagfile=FILE`` is expanded first
  (:func:`decentral_jax.runner.flagfiles.expand_flagfiles`), once,
  so its lines count as typed in its place: a flag given twice, on the
  command line or in files, is refused. The ``--config.<field>=value``
  overrides are then set apart (:func:`split_overrides`); the flags are
  reset before each parse, so a second call starts from the defaults.
  Every refusal of an argument read from a flag file names the file
  (``in --flagfile FILE``, with the fix of an indented comment or an
  include written with a space: :func:`flagfiles.origin`), and so do the
  later errors of its override (:class:`Override`); an argument that is
  no flag is refused there (a flag file holds flags).

  Args:
    flag_values: the command's ``absl.flags.FlagValues``.
    program: the program name absl is shown (``"train"``, ``"compare"``).
    argv: the arguments, program name excluded.

  Returns:
    ``(positional arguments typed on the command line, --config.<field>=
    value overrides as`` :class:`Override` ``strings)``.

  Raises:
    ValueError: a bad flag or value (one line, naming it and its file).
  """
  sourced = flagfiles.expand_flagfiles(argv)
  _refuse_repeats(flag_values, sourced)
  rest, overrides = _split_sourced([(program, ""), *sourced])
  flag_values.unparse_flags()
  try:
    positional = flag_values([t for t, _ in rest])[1:]
  except flags.Error as e:
    where = _refused_by_absl(flag_values, rest, str(e))
    flag_values.unparse_flags()
    raise ValueError(config_error_message(e) + where) from None
  typed, k = [], 1
  for token in positional:  # in order: find where each was given
    while k < len(rest) and rest[k][0] != token:
      k += 1
    where = rest[k][1] if k < len(rest) else ""
    k += 1
    if where:
      flag_values.unparse_flags()
      raise ValueError(f"unexpected argument {token!r}"
                       f"{flagfiles.origin(token, where)}; a flag file "
                       "holds flags (--name=value), one a line.")
    typed.append(token)
  return typed, overrides


def _refused_by_absl(flag_values: flags.FlagValues,
                     args: Sequence[tuple[str, str]], said: str) -> str:
  """:func:`flagfiles.origin` of the argument of ``args`` (``(argument,
  where)`` pairs, program name first) whose parse fails with ``said``:
  the shortest prefix failing so; ``""`` if none was read from a file."""
  if not any(where for _, where in args):
    return ""
  for k in range(2, len(args) + 1):
    flag_values.unparse_flags()
    try:
      flag_values([t for t, _ in args[:k]])
    except flags.Error as e:
      if str(e) == said:
        return flagfiles.origin(*args[k - 1], known=set(flag_values))
  return ""


class Override(str):
  """A ``--config.<field>=value`` string that knows where it was given:
  ``where`` is ``""`` (the command line) or ``" in --flagfile FILE"``;
  :func:`with_overrides` names it in its errors."""
  where = ""

  @classmethod
  def given(cls, text: str, where: str) -> "Override":
    """``text`` given at ``where``."""
    out = cls(text)
    out.where = where
    return out


def _origin(override: str) -> str:
  """Where ``override`` was given (:class:`Override`), for a message."""
  return flagfiles.origin(override, getattr(override, "where", ""))


def _refuse_repeats(flag_values: flags.FlagValues,
                    args: Sequence[tuple[str, str]]) -> None:
  """Refuses a flag of ``flag_values`` given twice in ``args``, the
  ``(argument, where)`` pairs of
  :func:`decentral_jax.runner.flagfiles.expand_flagfiles`
  (``--config=gpt_tiny --config=gpt_quick``: absl keeps the last alone);
  ``--x``, ``--x=v`` and ``--nox`` are one flag, a multi flag may repeat.
  Nothing after ``--`` counts.

  Raises:
    ValueError: ``--config is given twice (--config=gpt_tiny, then
      --config=gpt_quick in --flagfile f.flags); give it once.``
  """
  seen = {}
  for token, where in args:
    if token == "--":
      break
    name = token.lstrip("-").split("=", 1)[0]
    if not token.startswith("-") or not name:
      continue
    if name not in flag_values and name.startswith("no") and \
        isinstance(flag_values[name[2:]] if name[2:] in flag_values
                   else None, flags.BooleanFlag):
      name = name[2:]
    if name not in flag_values or isinstance(flag_values[name],
                                             flags.MultiFlag):
      continue
    if name in seen:
      raise ValueError(f"--{name} is given twice ({seen[name]}, then "
                       f"{token}{where}); give it once.")
    seen[name] = token + where


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates ``--config.<field>=value`` overrides from the other arguments.

  Args:
    argv: a command line, program name first. An override's value may also
      be the next argument (``--config.steps 100``); a bare
      ``--config.<field>`` followed by another flag is kept as is (a
      boolean). Arguments after ``--`` are not looked at.

  Returns:
    ``(rest, overrides)``: ``argv`` without the overrides, in order, and the
    overrides as ``"--config.<field>=value"`` strings for
    :func:`load_config`.

  Raises:
    ValueError: one field overridden twice (``--config.steps=2
      --config.steps=3``: only the last would count); give it once.
  """
  rest, overrides = _split_sourced([(a, "") for a in argv])
  return [t for t, _ in rest], [str(o) for o in overrides]


def _split_sourced(args: Sequence[tuple[str, str]]
                   ) -> tuple[list[tuple[str, str]], list[Override]]:
  """:func:`split_overrides` of ``(argument, where)`` pairs: the other
  arguments as pairs, the overrides as :class:`Override`; a field given
  twice is named with where each was given."""
  rest, overrides = [], []
  i = 0
  while i < len(args):
    arg, where = args[i]
    if arg == "--":
      rest += args[i:]
      break
    if arg.startswith("--config."):
      if ("=" not in arg and i + 1 < len(args)
          and not args[i + 1][0].startswith("--")):
        arg = f"{arg}={args[i + 1][0]}"
        i += 1
      overrides.append(Override.given(arg, where))
    else:
      rest.append((arg, where))
    i += 1
  fields = [o.partition("=")[0] for o in overrides]
  for k, name in enumerate(fields):
    if name in fields[:k]:
      first = overrides[fields.index(name)]
      raise ValueError(f"{name} is given twice ({first}{_origin(first)}, "
                       f"then {overrides[k]}{_origin(overrides[k])}); give "
                       "it once.")
  return rest, overrides
