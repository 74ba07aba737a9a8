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

With `train.loss_chunk_size` > 0 the objectives with an LM head (all but
`classify`) compute the head and the loss chunk by chunk of tokens
(`chunked_loss_sums`): no float32 logits of the whole batch [B, T, V] are
made, forward or backward, and the sums equal the unchunked ones to
float32 rounding.

With `train.loss_impl=pallas` (or `auto`, compiled for a GPU) the same
objectives compute the head and the loss in one kernel (`fused_loss_sums`,
model/kernels/fused_loss.py) that keeps every tile of logits on chip: per
target it returns log Z, the target's logit and whether it is the largest,
of which the four sums are made (`_weighted_sums`), and its backward
recomputes the softmax from log Z.

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
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.errors import UserError
from model.kernels import fused_loss, fuses_loss
from model.layers import batch_axes, compile_device
from model.mtp import depth_weights, shift
from model.transformer import PADDED_LOGIT


def loss_sums(logits_BTV, targets_BT, weights_BT):
  """(sum of weighted losses, sum of weights, weighted count of correct,
  weighted sum of (log Z)^2).

  loss = log Z - logit[target] with log Z = logsumexp(logits), in float32; a
  prediction is correct when the target's logit is the maximum, which reuses
  the max of the logsumexp instead of a separate argmax pass over the
  vocabulary. The target's logit is selected, not gathered
  (`_selected_target`): the gradient, softmax minus one-hot, has no scatter.
  """
  with jax.named_scope("loss"):
    return _loss_sums(logits_BTV, targets_BT, weights_BT)


def _selected_target(logits_BTV, targets_BT):
  """The target's logit [B, T], selected where an iota over the vocabulary
  equals the target (its gradient a select: no scatter into [B, T, V]); the
  same value as a gather (`jnp.take_along_axis`), the other logits adding
  exact zeros."""
  hit_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, 2) == targets_BT[..., None]
  return jnp.where(hit_BTV, logits_BTV, 0.0).sum(axis=-1)


def _loss_sums(logits_BTV, targets_BT, weights_BT):
  logits_BTV = logits_BTV.astype(jnp.float32)
  max_BT = jax.lax.stop_gradient(logits_BTV.max(axis=-1))
  lse_BT = max_BT + jnp.log(jnp.exp(logits_BTV - max_BT[..., None]).sum(axis=-1))
  target_BT = _selected_target(logits_BTV, targets_BT)
  return _weighted_sums(lse_BT, target_BT, (target_BT >= max_BT).astype(jnp.float32), weights_BT)


def _weighted_sums(lse_BT, target_BT, correct_BT, weights_BT):
  """The four sums of `loss_sums` from each target's log Z, logit and
  whether it is the largest (1.0 or 0.0)."""
  return (((lse_BT - target_BT) * weights_BT).sum(), weights_BT.sum(),
          (correct_BT * weights_BT).sum(), (jnp.square(lse_BT) * weights_BT).sum())


def chunked_loss_sums(logits_fn, hidden_BTM, targets_BT, weights_BT, chunk_size: int):
  """`loss_sums(logits_fn(hidden_BTM), targets_BT, weights_BT)` without the
  float32 logits of the whole batch (train.loss_chunk_size).

  The positions are taken in n chunks of C = max(1, chunk_size // B) per
  row (at most T; B x C tokens a chunk): chunk c holds positions c, c + n,
  c + 2n, ... of every row, so that rows or positions split over devices
  split each chunk alike; T is padded to n x C with weight 0. A `lax.scan`
  over the chunks computes each chunk's logits [B, C, V] with `logits_fn`
  (the head), reduces them to the four sums and adds those up;
  `jax.checkpoint` makes the backward pass recompute each chunk's logits
  from its hidden states [B, C, M] instead of saving them, and the target's
  logit is selected (`_selected_target`), so its gradient, softmax minus
  one-hot, has no scatter.
  """
  B, T, _ = hidden_BTM.shape
  C = min(T, max(1, chunk_size // B))
  n = -(-T // C)

  def chunks(x_BT):  # [B, T, ...] -> [n, B, C, ...], chunk c = positions c, c + n, ...
    padded = jnp.pad(x_BT, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x_BT.ndim - 2))
    return jnp.moveaxis(padded.reshape(B, C, n, *x_BT.shape[2:]), 2, 0)

  @jax.checkpoint
  def chunk_sums(x_BCM, targets_BC, weights_BC):
    return _loss_sums(logits_fn(x_BCM), targets_BC, weights_BC)

  def add_chunk(sums, chunk):
    return tuple(a + b for a, b in zip(sums, chunk_sums(*chunk))), None

  zeros = tuple(jnp.zeros((), jnp.float32) for _ in range(4))
  with jax.named_scope("loss"):
    sums, _ = jax.lax.scan(add_chunk, zeros, (chunks(hidden_BTM), chunks(targets_BT),
                                              chunks(weights_BT.astype(jnp.float32))))
  return sums


def _whole_on_every_device(model, stack):
  """(`model`, its `stack`) with every parameter constrained whole on every
  device of the mesh (as they are without one). The chunked head then
  gathers its weights once, before its loop over the chunks, where
  parameters split over devices (mesh.fsdp) would otherwise be gathered
  in every chunk, forward and backward, and their gradients split in every
  chunk (XLA leaves a loop's collectives in the loop); the price is the
  head's weights whole on each device, also over mesh.tensor."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return model, stack
  graphdef, params, rest = nnx.split((model, stack), nnx.Param, ...)
  whole = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), params)
  return nnx.merge(graphdef, whole, rest)


def fused_loss_sums(model, stack, hidden_BTM, targets_BT, weights_BT):
  """`loss_sums` of the LM head's logits by the fused head-and-loss kernel
  (train.loss_impl=pallas, model/kernels/fused_loss.py): per target its log Z,
  logit and whether it is the largest, the logits never made; one kernel
  per device on a mesh (`_per_device`)."""
  device = compile_device()
  x_BTM, w_VM, mult, real_vocab = model.head_operands(stack, hidden_BTM)

  def kernel(x_BTM, w_VM, targets_BT):
    B, T, M = x_BTM.shape
    outs = fused_loss.fused_head_loss(x_BTM.reshape(B * T, M), w_VM, targets_BT.reshape(B * T),
                                      mult=mult, real_vocab=real_vocab,
                                      padded_logit=PADDED_LOGIT, device=device)
    return tuple(x_N.reshape(B, T) for x_N in outs)

  with jax.named_scope("loss"):
    lse_BT, target_BT, correct_BT = _per_device(kernel, x_BTM, w_VM, targets_BT)
    return _weighted_sums(lse_BT, target_BT, correct_BT, weights_BT.astype(jnp.float32))


def _per_device(kernel, x_BTM, w_VM, targets_BT):
  """`kernel(x_BTM, w_VM, targets_BT)` -> per-token [B, T] arrays, under
  `jax.shard_map` on a mesh of several devices (XLA cannot split a Pallas
  call): each device takes its rows (the batch axes) and positions (the
  context axis) and the head's weight whole; shard_map sums W's gradient
  over the devices."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(x_BTM, w_VM, targets_BT)
  batch = batch_axes(mesh)
  rows = math.prod(mesh.shape[axis] for axis in batch)
  if x_BTM.shape[0] % rows:
    raise UserError(f"train.loss_impl=pallas: {x_BTM.shape[0]} rows (per micro-batch) do not "
                    f"split over the {rows} devices of the batch axes {' x '.join(batch)}; "
                    "make train.batch_size / train.grad_accum_steps a multiple of it")
  tokens = P(batch, "context" if "context" in mesh.axis_names else None)
  # check_vma=False: the pallas_call's outputs do not declare how they vary over the mesh.
  return jax.shard_map(kernel, mesh=mesh, in_specs=(tokens, P(), tokens),
                       out_specs=(tokens,) * 3, check_vma=False)(x_BTM, w_VM, targets_BT)


def head_loss_sums(model, stack, hidden_BTM, targets_BT, weights_BT, chunk_size: int = 0,
                   impl: str = "xla"):
  """`loss_sums` of the LM head's logits (`model.logits(stack, .)`) of the
  final hidden states `hidden_BTM`: where `impl` (train.loss_impl) says so
  (`model.kernels.fuses_loss`), by the fused kernel (`fused_loss_sums`);
  else with `chunk_size` > 0 chunk by chunk (`chunked_loss_sums`, the
  head's weights whole on every device: `_whole_on_every_device`), with 0
  from the whole batch's logits."""
  if fuses_loss(impl, compile_device().platform, head_fuses=model.head_fuses,
                chunk_size=chunk_size):
    return fused_loss_sums(model, stack, hidden_BTM, targets_BT, weights_BT)
  if not chunk_size:
    return loss_sums(model.logits(stack, hidden_BTM), targets_BT, weights_BT)
  model, stack = _whole_on_every_device(model, stack)
  return chunked_loss_sums(lambda x_BCM: model.logits(stack, x_BCM), hidden_BTM, targets_BT,
                           weights_BT, chunk_size)


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


def next_token_loss(model, batch, chunk_size: int = 0, impl: str = "xla"):
  """Causal LM loss (`chunk_size`: train.loss_chunk_size, `impl`:
  train.loss_impl, `head_loss_sums`)."""
  hidden_BTM = model.hidden(batch["inputs"], segment_ids=batch.get("segment_ids"),
                            positions=batch["positions"])
  return head_loss_sums(model, model.decoder, hidden_BTM, batch["targets"], batch["loss_mask"],
                        chunk_size, impl)


def mtp_weights(batch, depth: int) -> list:
  """The weights [B, T] of each multi-token prediction depth 1..`depth`'s
  targets in `batch` (`model.mtp.depth_weights`): a function of the batch
  alone, so a step can count every depth's targets before its micro-batches."""
  return [depth_weights(batch["loss_mask"], batch.get("segment_ids"), k)
          for k in range(1, depth + 1)]


def next_token_mtp_loss(model, batch, chunk_size: int = 0, impl: str = "xla"):
  """(the causal LM's `loss_sums`, and per multi-token prediction depth k =
  1..D its (loss sum, target count, correct count)): one pass of the
  decoder, whose final hidden states the MTP modules continue from
  (`Decoder.mtp_hidden`); depth k's targets are the batch's targets k
  positions on. Every head's loss is chunked (or fused) alike (`head_loss_sums`)."""
  segment_ids, positions = batch.get("segment_ids"), batch["positions"]
  hidden_BTM = model.hidden(batch["inputs"], segment_ids=segment_ids, positions=positions)
  sums = head_loss_sums(model, model.decoder, hidden_BTM, batch["targets"], batch["loss_mask"],
                        chunk_size, impl)
  depth_hidden = model.mtp_hidden(hidden_BTM, batch["inputs"], segment_ids, positions)
  weights = mtp_weights(batch, len(depth_hidden))
  mtp = tuple(head_loss_sums(model, model.decoder, h_BTM, shift(batch["targets"], k), w_BT,
                             chunk_size, impl)[:3]
              for k, (h_BTM, w_BT) in enumerate(zip(depth_hidden, weights), start=1))
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


def encoder_decoder_loss(model, batch, chunk_size: int = 0, impl: str = "xla"):
  src_padding_mask = batch["src_mask"] > 0
  hidden_BTM = model.decode_hidden(batch["tgt_in"], model.encode(batch["src"], src_padding_mask),
                                   src_padding_mask)
  return head_loss_sums(model, model.decoder, hidden_BTM, batch["tgt_out"], batch["loss_mask"],
                        chunk_size, impl)


def masked_lm_loss(model, batch, chunk_size: int = 0, impl: str = "xla"):
  hidden_BTM = model.hidden(batch["inputs"], segment_ids=batch["segment_ids"],
                            positions=batch["positions"])
  return head_loss_sums(model, model.encoder, hidden_BTM, batch["targets"], batch["loss_mask"],
                        chunk_size, impl)


def classify_loss(model, batch):
  logits_BL = model.classify(batch["inputs"], batch["padding_mask"] > 0, batch["token_types"])
  return loss_sums(logits_BL, batch["labels"], batch["weights"])


def batch_loss(objective: str, model, batch, chunk_size: int = 0, impl: str = "xla"):
  """(loss sum, target count, correct count, (log Z)^2 sum) of `batch` for
  `objective`; `chunk_size`: train.loss_chunk_size and `impl`:
  train.loss_impl of the objectives with an LM head (`head_loss_sums`; a
  classifier's logits are [B, num_labels])."""
  if objective == "mlm":
    return masked_lm_loss(model, batch, chunk_size, impl)
  if objective == "classify":
    return classify_loss(model, batch)
  if objective == "seq2seq" and "src" in batch:
    return encoder_decoder_loss(model, batch, chunk_size, impl)
  return next_token_loss(model, batch, chunk_size, impl)
