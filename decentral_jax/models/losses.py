"""Losses of the models: next-token cross-entropy and classification.

Both take logits in any float dtype and compute in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy.

  Args:
    logits: float [B, T, V].
    targets: int [B, T] with values in [0, V).

  Returns:
    Scalar float32: ``mean_{b,t} -log softmax(logits[b, t])[targets[b, t]]``
    in nats per token.

  Raises:
    ValueError: shapes that do not match ([B, T, V] vs [B, T]).
  """
  if logits.ndim != 3 or targets.shape != logits.shape[:2]:
    raise ValueError(f"lm_loss needs logits [B, T, V] and targets [B, T]; got "
                     f"logits {logits.shape} and targets {targets.shape}.")
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets)
  return jnp.mean(losses)


def classification_loss(logits: jax.Array,
                        labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean cross-entropy and accuracy of a batch.

  Args:
    logits: float [B, C].
    labels: int [B] with values in [0, C).

  Returns:
    ``(loss, accuracy)``: scalar float32 mean cross-entropy (nats) and the
    float32 fraction of rows whose argmax equals the label.

  Raises:
    ValueError: shapes that do not match ([B, C] vs [B]).
  """
  if logits.ndim != 2 or labels.shape != logits.shape[:1]:
    raise ValueError(f"classification_loss needs logits [B, C] and labels "
                     f"[B]; got logits {logits.shape} and labels "
                     f"{labels.shape}.")
  loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels))
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels)
                      .astype(jnp.float32))
  return loss, accuracy
