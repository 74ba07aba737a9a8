"""Sequence classification on a stack's hidden states, in place of the LM head.

The lesson's "encoders for embeddings and classification": a sequence is
summarised by one vector, `pool`ed from the final hidden states by
`model.pooling`:

- `cls`: the first token's (BERT's [CLS]);
- `mean`: the mean over the real tokens (padding left out), the usual
  sentence embedding;
- `last`: the last real token's, which a causal decoder's attention has let
  see every token (transformers' `Qwen2ForSequenceClassification`,
  `LlamaForSequenceClassification`).

`SequenceClassifier` maps that vector to `model.num_labels` logits in
float32: with `model.pooler`, BERT's pooler first (dense d->d with bias,
tanh, as `BertForSequenceClassification` has it), then a dense d->labels
layer (with a bias when `model.classifier_bias`).
"""
import jax.numpy as jnp
from flax import nnx

from model.layers import Dense


def pool(hidden_BTM, padding_mask_BT, pooling: str):
  """The pooled vector [B, M] of each row (`padding_mask_BT`: True = real token)."""
  if pooling == "cls":
    return hidden_BTM[:, 0]
  mask_BT = padding_mask_BT.astype(jnp.float32)
  if pooling == "mean":
    summed_BM = jnp.einsum("btm,bt->bm", hidden_BTM.astype(jnp.float32), mask_BT)
    return (summed_BM / jnp.maximum(mask_BT.sum(axis=1, keepdims=True), 1.0)).astype(
        hidden_BTM.dtype)
  if pooling == "last":
    positions_BT = jnp.arange(hidden_BTM.shape[1]) * padding_mask_BT
    last_B = positions_BT.argmax(axis=1)
    return jnp.take_along_axis(hidden_BTM, last_B[:, None, None], axis=1)[:, 0]
  raise ValueError(f"unknown pooling {pooling!r}")


class SequenceClassifier(nnx.Module):
  """Pooled hidden state -> (BERT's pooler) -> float32 logits [B, num_labels]."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.pooling = cfg.pooling
    self.pooler = (Dense(cfg.d_model, (cfg.d_model,), ("embed", None), use_bias=True, cfg=cfg,
                         rngs=rngs) if cfg.pooler else None)
    self.out = Dense(cfg.d_model, (cfg.num_labels,), ("embed", None),
                     use_bias=cfg.classifier_bias, cfg=cfg, rngs=rngs, dtype=jnp.float32)

  def __call__(self, hidden_BTM, padding_mask_BT):
    x_BM = pool(hidden_BTM, padding_mask_BT, self.pooling)
    if self.pooler is not None:
      x_BM = jnp.tanh(self.pooler(x_BM))
    return self.out(x_BM)
