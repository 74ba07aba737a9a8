"""Training objectives: the loss of a batch, summed over its real targets.

- `next_token` (decoder): predict token t+1 from tokens <= t (the lesson's
  "trained with cross-entropy on next-token prediction").
- `seq2seq` with a decoder (prefix LM): source and target in one sequence,
  the same next-token loss with `loss_mask` set only on target tokens.
- `seq2seq` with an encoder-decoder: teacher forcing; the encoder reads
  `src` (padding masked by `src_mask`), the decoder reads `tgt_in` (BOS +
  target) and predicts `tgt_out` (target + EOS) through cross-attention.
- `mlm` (encoder): the batch's `inputs` have the selected positions masked
  (BERT 80/10/10, done by the data pipeline); the loss is on those only.
- `classify` (encoder or decoder with `model.num_labels`): one label per
  row, cross-entropy of the classifier's logits (`model/classifier.py`) over
  the rows with weight 1; padding tokens are masked out of attention and
  pooling.

Cross-entropy is
computed from float32 logits. Each objective returns (sum of per-target
losses, number of targets, number of correct argmax predictions, sum of
log^2 Z), so that micro-batches and evaluation passes add up exactly.

Multi-token prediction (DeepSeek-V3; `train.mtp_depth` = D > 0, next_token
decoders): `next_token_mtp_loss` returns the main sums and, per depth k, the
sums of the MTP modules' predictions of token i+k+1 (`model/mtp.py`); the
training loss adds lambda / D x the sum of their mean cross-entropies
(`mtp_training_sum`), and the reported `loss` stays the main model's.

The z-loss (PaLM; `train.z_loss`): log Z = logsumexp(logits) is the log of
the softmax normaliser, which cross-entropy leaves free to drift (adding a
constant to every logit changes no probability). The training objective
adds weight x mean over targets of (log Z)^2, pulling it to 0 so that the
logits stay in the range where float32 and bfloat16 softmaxes are exact
(`training_loss_sum`); the reported loss stays the cross-entropy.
"""
import jax
import jax.numpy as jnp

from model.mtp import depth_weights, shift


def loss_sums(logits_BTV, targets_BT, weights_BT):
  """(sum of weighted losses, sum of weights, weighted count of correct,
  weighted sum of (log Z)^2).

  loss = log Z - logit[target] with log Z = logsumexp(logits), in float32; a
  prediction is correct when the target's logit is the maximum, which reuses
  the max of the logsumexp instead of a separate argmax pass over the
  vocabulary.
  """
  with jax.named_scope("loss"):
    return _loss_sums(logits_BTV, targets_BT, weights_BT)


def _loss_sums(logits_BTV, targets_BT, weights_BT):
  logits_BTV = logits_BTV.astype(jnp.float32)
  max_BT = jax.lax.stop_gradient(logits_BTV.max(axis=-1))
  lse_BT = max_BT + jnp.log(jnp.exp(logits_BTV - max_BT[..., None]).sum(axis=-1))
  target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  losses_BT = lse_BT - target_BT
  correct_BT = (target_BT >= max_BT).astype(jnp.float32)
  return ((losses_BT * weights_BT).sum(), weights_BT.sum(), (correct_BT * weights_BT).sum(),
          (jnp.square(lse_BT) * weights_BT).sum())


def cross_entropy_sums(logits_BTV, targets_BT, weights_BT):
  """(sum of weighted losses, sum of weights, weighted count of correct): `loss_sums`
  without the z-loss term."""
  return loss_sums(logits_BTV, targets_BT, weights_BT)[:3]


def training_loss_sum(sums, z_loss: float):
  """What training differentiates: the summed cross-entropy plus `z_loss` x
  the summed (log Z)^2 (`sums` as the objectives return them)."""
  loss_sum, _, _, log_z_sq_sum = sums
  return loss_sum + z_loss * log_z_sq_sum if z_loss else loss_sum


def token_losses(logits_BTV, targets_BT):
  """Cross-entropy of every target [B, T] in float32 (unweighted, unsummed)."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT


def next_token_logits(model, batch):
  """The causal LM's logits of a batch; a batch without `segment_ids`
  (data.packing=concat) is attended with the causal mask alone."""
  return model(batch["inputs"], segment_ids=batch.get("segment_ids"),
               positions=batch["positions"])


def next_token_loss(model, batch):
  """Causal LM loss."""
  return loss_sums(next_token_logits(model, batch), batch["targets"], batch["loss_mask"])


def mtp_weights(batch, depth: int) -> list:
  """The weights [B, T] of each multi-token prediction depth 1..`depth`'s
  targets in `batch` (`model.mtp.depth_weights`): a function of the batch
  alone, so a step can count every depth's targets before its micro-batches."""
  return [depth_weights(batch["loss_mask"], batch.get("segment_ids"), k)
          for k in range(1, depth + 1)]


def next_token_mtp_loss(model, batch):
  """(the causal LM's `loss_sums`, and per multi-token prediction depth k =
  1..D its (loss sum, target count, correct count)): one pass of the
  decoder, whose final hidden states the MTP modules continue from
  (`Decoder.mtp_logits`); depth k's targets are the batch's targets k
  positions on."""
  segment_ids, positions = batch.get("segment_ids"), batch["positions"]
  hidden_BTM = model.hidden(batch["inputs"], segment_ids=segment_ids, positions=positions)
  sums = loss_sums(model.logits(model.decoder, hidden_BTM), batch["targets"],
                   batch["loss_mask"])
  depth_logits = model.mtp_logits(hidden_BTM, batch["inputs"], segment_ids, positions)
  weights = mtp_weights(batch, len(depth_logits))
  mtp = tuple(cross_entropy_sums(logits_BTV, shift(batch["targets"], k), w_BT)
              for k, (logits_BTV, w_BT) in enumerate(zip(depth_logits, weights), start=1))
  return sums, mtp


def mtp_training_sum(mtp, weight: float, count, depth_counts):
  """What the MTP modules add to the summed training loss:
  `weight` / D x sum over depths of (depth k's loss sum / its target count
  `depth_counts[k]`), times `count` (the main loss's target count), so that
  the step's division by `count` leaves lambda / D x the sum of the depths'
  mean cross-entropies (DeepSeek-V3's L_MTP). The counts are the whole
  batch's, so micro-batches add up to it exactly."""
  terms = [s[0] / jnp.maximum(c, 1.0) for s, c in zip(mtp, depth_counts)]
  return weight / len(mtp) * sum(terms) * count


def encoder_decoder_loss(model, batch):
  logits_BTV = model(batch["src"], batch["tgt_in"], src_padding_mask=batch["src_mask"] > 0)
  return loss_sums(logits_BTV, batch["tgt_out"], batch["loss_mask"])


def masked_lm_loss(model, batch):
  logits_BTV = model(batch["inputs"], segment_ids=batch["segment_ids"],
                     positions=batch["positions"])
  return loss_sums(logits_BTV, batch["targets"], batch["loss_mask"])


def classify_loss(model, batch):
  logits_BL = model.classify(batch["inputs"], batch["padding_mask"] > 0, batch["token_types"])
  return loss_sums(logits_BL, batch["labels"], batch["weights"])


def batch_loss(objective: str, model, batch):
  """(loss sum, target count, correct count, (log Z)^2 sum) of `batch` for `objective`."""
  if objective == "mlm":
    return masked_lm_loss(model, batch)
  if objective == "classify":
    return classify_loss(model, batch)
  if objective == "seq2seq" and "src" in batch:
    return encoder_decoder_loss(model, batch)
  return next_token_loss(model, batch)
