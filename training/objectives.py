"""Training objectives: the loss of a batch, summed over its real targets.

`next_token`: a decoder predicts token t+1 from tokens <= t (the lesson's
"trained with cross-entropy on next-token prediction"). Cross-entropy is
computed from float32 logits. Each objective returns (sum of per-target
losses, number of targets, number of correct argmax predictions), so that
micro-batches and evaluation passes add up exactly.
"""
import jax.numpy as jnp
import optax


def cross_entropy_sums(logits_BTV, targets_BT, weights_BT):
  """(sum of weighted losses, sum of weights, weighted count of correct)."""
  losses_BT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV.astype(jnp.float32), targets_BT)
  correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
  return ((losses_BT * weights_BT).sum(), weights_BT.sum(), (correct_BT * weights_BT).sum())


def next_token_loss(model, batch):
  logits_BTV = model(batch["inputs"], segment_ids=batch["segment_ids"],
                     positions=batch["positions"])
  return cross_entropy_sums(logits_BTV, batch["targets"], batch["loss_mask"])


OBJECTIVES = {"next_token": next_token_loss}


def batch_loss(objective: str, model, batch):
  return OBJECTIVES[objective](model, batch)
