"""MuLoCo's inner optimizer: Muon on the hidden matrices, AdamW on the rest.

MuLoCo (Therien et al., arXiv 2505.23725) is DiLoCo (or Streaming DiLoCo)
whose workers take their ``H`` inner steps with Muon instead of AdamW; the
outer step, the pseudo-gradient and its compression (4-bit with error
feedback) are those of :func:`decentral_jax.optim.diloco_sync.diloco` and
:func:`decentral_jax.optim.streaming_sync.streaming_diloco`, so this module
builds only the inner transform, :func:`muon_inner`, and the rule that
splits the parameters between its two branches, :func:`muon_labels`.

Which leaves get Muon. Muon orthogonalizes a matrix update, so it is defined
for the weight matrices of linear maps. ``optax.contrib.muon`` sends every
2-D leaf to Muon and every other leaf to Adam; this module follows Muon's
reference setup (Jordan 2024, the MuLoCo paper's and Moonlight's setup)
instead: the embeddings, which in a GPT with a tied head are also the
unembedding, are 2-D but are lookup tables, not linear maps, and go to
AdamW with the biases, LayerNorm scales and every leaf that is not 2-D
(convolution kernels included). For :class:`decentral_jax.models.gpt.GPT`
that gives:

=============================================  =======
leaf                                           branch
=============================================  =======
``h_*/attn/c_attn/kernel``, ``c_proj/kernel``  Muon
``h_*/mlp/c_fc/kernel``, ``c_proj/kernel``     Muon
``wte/embedding`` (embedding and tied head)    AdamW
``wpe/embedding`` (positions)                  AdamW
``*/bias``, ``ln_*/scale``                     AdamW
=============================================  =======

A leaf is an embedding when its name (the last key of its path) is in
``embeddings`` (``("embedding",)``: the parameter name of
``flax.linen.Embed``); ``embeddings=()`` gives optax's rule (every 2-D leaf
to Muon). A name given explicitly that is no leaf's name (a typo, or a
module's name such as ``"wte"``) is refused when the leaves are labelled;
the default matches none in a model without embedding tables.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Sequence

import jax
import optax
from optax import contrib as optax_contrib

from decentral_jax import checks
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms

PyTree = Any

#: The leaf names of embedding tables (``flax.linen.Embed``'s parameter).
EMBEDDINGS = ("embedding",)


def _leaf_name(path) -> str:
  """The last key of a tree path as a string (dict key, attribute, index)."""
  if not path:
    return ""
  key = path[-1]
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def muon_labels(params: PyTree, embeddings: Sequence[str] = EMBEDDINGS
                ) -> PyTree:
  """``"muon"`` for each 2-D leaf not named in ``embeddings``, else ``"adam"``.

  Args:
    params: the parameter pytree (arrays or shape-dtype structs).
    embeddings: leaf names of embedding tables, trained by AdamW.

  Returns:
    A pytree of strings with the structure of ``params``.

  Raises:
    ValueError: ``embeddings`` not a tuple of strings, or (given explicitly,
      not the default :data:`EMBEDDINGS`) naming no leaf of ``params``.
  """
  _check_embeddings(embeddings)
  return _labels(params, tuple(embeddings), embeddings is not EMBEDDINGS)


def _labels(params: PyTree, embeddings: tuple[str, ...], strict: bool
            ) -> PyTree:
  """:func:`muon_labels`; ``strict``: every name must be a leaf's name."""
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  leaves = sorted({_leaf_name(path) for path, _ in paths})
  for name in embeddings if strict else ():
    if name not in leaves:
      near = difflib.get_close_matches(name, leaves, n=1)
      hint = f" (nearest: {near[0]!r})" if near else ""
      shown = ", ".join(leaves[:12]) + (", ..." if len(leaves) > 12 else "")
      raise ValueError(
          f"embeddings names {name!r}, which is no leaf's name{hint}; a "
          f"leaf's name is the last key of its path, here one of: {shown}.")
  names = frozenset(embeddings)
  return jax.tree_util.tree_map_with_path(
      lambda path, p: ("muon" if len(p.shape) == 2
                       and _leaf_name(path) not in names else "adam"),
      params)


def _check_embeddings(embeddings) -> None:
  if not isinstance(embeddings, (tuple, list)) or not all(
      isinstance(e, str) for e in embeddings):
    raise ValueError(f"embeddings={embeddings!r} must be a tuple of leaf "
                     "names, e.g. ('embedding',) or ().")


def _scaled(schedule: optax.ScalarOrSchedule, ratio: float):
  """``ratio * schedule`` (``schedule`` itself for ratio 1)."""
  if ratio == 1.0:
    return schedule
  if callable(schedule):
    return lambda count: ratio * schedule(count)
  return ratio * schedule


#: The most Newton-Schulz iterations (5 reach the orthogonal factor's
#: neighbourhood; each is three matmuls per matrix and step).
MAX_NS_STEPS = 100


def _check(ns_steps, beta, consistent_rms, adam_lr_ratio, embeddings):
  checks.check_int("ns_steps", ns_steps, minimum=1, maximum=MAX_NS_STEPS)
  checks.check_probability("beta", beta, open_max=True)
  checks.check_float("consistent_rms", consistent_rms, minimum=0.0)
  checks.check_float("adam_lr_ratio", adam_lr_ratio, minimum=0.0,
                     open_min=True)
  _check_embeddings(embeddings)


def muon_inner(learning_rate: optax.ScalarOrSchedule, *, ns_steps: int = 5,
               beta: float = 0.95, consistent_rms: float = 0.2,
               adam_lr_ratio: float = 1.0, b1: float = 0.9,
               b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0,
               embeddings: Sequence[str] = EMBEDDINGS,
               adam: Callable[[optax.ScalarOrSchedule],
                              optax.GradientTransformation] | None = None
               ) -> optax.GradientTransformation:
  r"""Muon on the hidden matrices and AdamW on the other leaves.

  Muon branch (``optax.contrib.muon``, Jordan 2024), per matrix
  ``W`` of shape ``[fan_in, fan_out]`` with gradient ``G`` at count ``t``
  (from 1):

  .. math::
    m &\leftarrow \beta m + (1 - \beta) G, \quad
    \hat m = \beta \frac{m}{1 - \beta^{t+1}}
      + (1 - \beta) \frac{G}{1 - \beta^t} \ \text{(Nesterov)} \\
    O &= \mathrm{NS}_5(\hat m / (\|\hat m\|_F + 10^{-8})), \quad
    W \leftarrow W - \eta\,(s\,O + \lambda W)

  with ``NS`` the quintic Newton-Schulz step ``X <- a X + (b A + c A^2) X``,
  ``A = X X^T`` (``X`` the wide orientation), ``(a, b, c) = (3.4445,
  -4.7750, 2.0315)``, run ``ns_steps`` times, and ``s =
  consistent_rms * sqrt(max(fan_in, fan_out))`` (Liu et al., arXiv
  2502.16982: the update's RMS matches AdamW's, so one learning rate
  serves both branches; ``consistent_rms=0`` uses Muon's width scaling
  ``sqrt(max(1, fan_out / fan_in))`` instead). The other branch, at
  learning rate ``adam_lr_ratio * eta``: ``adam(lr)`` if given (the
  runner passes the run's AdamW or AccumAdamW), else ``optax.adamw`` with
  ``b1``, ``b2``, ``eps`` and decoupled ``weight_decay`` on its 2-D leaves
  (the embeddings), as the AdamW of the other methods. The split is
  :func:`muon_labels`.

  Args:
    learning_rate: ``eta``, a float or a schedule of the step count.
    ns_steps: Newton-Schulz iterations (integer in [1, :data:`MAX_NS_STEPS`]).
    beta: Muon's momentum in [0, 1).
    consistent_rms: RMS of Muon's update relative to its learning rate
      (>= 0; 0: width scaling).
    adam_lr_ratio: the other branch's learning rate over ``eta`` (> 0).
    b1, b2, eps: the default AdamW's moments (in [0, 1)) and epsilon
      (finite, >= 0).
    weight_decay: ``lambda`` (finite, >= 0), decoupled, on every Muon
      matrix and (default AdamW) every 2-D leaf of the other branch.
    embeddings: leaf names trained by the other branch although 2-D (a
      tuple of strings; given explicitly, each must be a leaf's name).
    adam: ``lr -> optax transform`` of the other branch (None: AdamW),
      called here.

  Returns:
    An ``optax.GradientTransformation`` (``optax.partition`` of the two
    branches); updates have the params' shapes and dtypes.

  Raises:
    ValueError: an argument outside its range, named; ``adam(lr)`` not an
      optax transform; at ``init``, an explicit ``embeddings`` name that is
      no leaf's name (:func:`muon_labels`).

  References:
    Therien et al., MuLoCo: Muon is a practical inner optimizer for DiLoCo,
    arXiv 2505.23725; Jordan et al., Muon (2024); Liu et al., Muon is
    Scalable for LLM Training, arXiv 2502.16982.
  """
  _check(ns_steps, beta, consistent_rms, adam_lr_ratio, embeddings)
  arguments.check_learning_rate(learning_rate)
  for name, value, below_one in (("b1", b1, True), ("b2", b2, True),
                                 ("eps", eps, False),
                                 ("weight_decay", weight_decay, False)):
    arguments.check_hyperparameter(name, value, below_one=below_one)
  if adam is not None and not callable(adam):
    raise ValueError(f"adam={adam!r} must be a function lr -> optax "
                     "transform, or None for AdamW.")
  muon = optax_contrib.muon(
      learning_rate, ns_steps=int(ns_steps), beta=float(beta),
      weight_decay=float(weight_decay), nesterov=True,
      consistent_rms=float(consistent_rms) or None)
  lr = _scaled(learning_rate, float(adam_lr_ratio))
  other = adam(lr) if adam is not None else optax.adamw(
      lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
      mask=transforms.default_weight_decay_mask)
  arguments.check_transform("adam(lr)", other)
  strict, embeddings = embeddings is not EMBEDDINGS, tuple(embeddings)
  return optax.partition({"muon": muon, "adam": other},
                         lambda params: _labels(params, embeddings, strict))
