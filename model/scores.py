"""Step 3 of the lesson, scores to weights: one `SCORES` entry per `model.attention_score`.

An entry's `weights(scores, valid)` turns the float32 scores [B, K, T*G, S]
(row t*G + g: query t of head k*G + g; scaled, soft-capped, biased) into
attention weights over the last axis, with `valid` the boolean mask
broadcastable to them (None: every key visible); a fully masked
query row gets zeros. `reference` computes every entry; the other
implementations declare which they take (`model/attention.py`).
"""
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from model.registry import Registry


def softmax_weights(scores, valid):
  """softmax over the visible keys (the lesson's Step 3)."""
  if valid is None:
    return jax.nn.softmax(scores, axis=-1)
  scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
  return jnp.where(valid, jax.nn.softmax(scores, axis=-1), 0.0)


def sigmoid_weights(scores, valid):
  """sigmoid(s + b) per key, b = -log n with n the keys the query sees (Ramapuram
  et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"):
  the weights are not normalised over the keys, and b keeps their sum near 1 at
  the start of training. n counts the visible keys of each query row (all S
  without a mask), so a KV-cache step, whose cache has more slots than the
  query sees, computes what the full forward pass does."""
  if valid is None:
    return jax.nn.sigmoid(scores - jnp.log(scores.shape[-1]))
  visible = jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(jnp.float32)
  return jnp.where(valid, jax.nn.sigmoid(scores - jnp.log(visible)), 0.0)


@dataclasses.dataclass(frozen=True)
class Score:
  """A `model.attention_score` choice: `weights(scores, valid)`."""
  name: str
  doc: str
  weights: Callable
  reads: tuple[str, ...] = ()


SCORES = Registry("model.attention_score", [
    Score("softmax", "softmax over the keys (every implementation)", softmax_weights),
    Score("sigmoid", "sigmoid(s - log n) per key, n the keys it sees (Ramapuram et al. 2024); "
          "reference and xla", sigmoid_weights),
])
