"""KV-cache generation (the lesson's "KV cache" and batched-generation pitfall).

A decoder caches each past token's keys and values so that every new token
costs one position of work. Prompts of different lengths are right-padded
into one batch, and every row keeps its own position counter: row b's
prompt fills cache slots 0..l_b-1, its first new token is read from the
logits at l_b-1, and its t-th new token is written at slot l_b+t. The query
at position p attends to slots 0..p only, so the padding slots after a short
prompt are never seen (they are overwritten before they become visible), and
each row decodes exactly as it would alone. This sidesteps the left- vs
right-padding mismatch: positions are never shifted by padding.

Sampling: greedy (temperature 0), temperature, top-k and top-p (nucleus),
each row with its own random key derived from (seed, step, row).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.errors import UserError


def sample_logits(logits_BV, rng, *, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0):
  """Next tokens [B] from float32 logits [B, V]."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  neg_inf = jnp.finfo(logits_BV.dtype).min
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, neg_inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # The smallest logit still inside the nucleus (the first token always is).
    cutoff_B1 = jnp.min(jnp.where(mass_before_BV < top_p, sorted_BV, jnp.inf), axis=-1,
                        keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, neg_inf, logits_BV)
  keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(logits_BV.shape[0]))
  return jax.vmap(jax.random.categorical)(keys, logits_BV).astype(jnp.int32)


def _pad_prompts(prompts: list[list[int]], pad_id: int):
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("generation needs at least one prompt, each with at least one token "
                    "(start the prompt with the BOS token)")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), lengths.max()), pad_id, np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _check_length(model_cfg, total: int) -> None:
  if model_cfg.pos_emb == "learned" and total > model_cfg.max_len:
    raise UserError(f"prompt plus max_new_tokens = {total} exceeds the learned position "
                    f"table (model.max_len={model_cfg.max_len}); generate fewer tokens")


def _decode_loop(step, first_logits_BV, lengths_B, cache, rng, *, max_new_tokens: int,
                 eos_id: int, pad_id: int, sampling: dict):
  """Samples max_new_tokens per row; tokens after a row's EOS become pad."""
  B = first_logits_BV.shape[0]

  def body(t, carry):
    logits_BV, cache, out_BN, done_B = carry
    token_B = sample_logits(logits_BV, jax.random.fold_in(rng, t), **sampling)
    token_B = jnp.where(done_B, pad_id, token_B)
    out_BN = out_BN.at[:, t].set(token_B)
    done_B = done_B | (token_B == eos_id)
    logits_B1V, cache = step(token_B[:, None], (lengths_B + t)[:, None], cache)
    return logits_B1V[:, 0], cache, out_BN, done_B

  out_BN = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
  carry = (first_logits_BV, cache, out_BN, jnp.zeros((B,), bool))
  return jax.lax.fori_loop(0, max_new_tokens, body, carry)[2]


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id",
                                             "pad_id", "sampling_items"))
def _generate_decoder(graphdef, state, tokens_BP, lengths_B, rng, *, max_new_tokens,
                      eos_id, pad_id, sampling_items):
  model = nnx.merge(graphdef, state)
  B, P = tokens_BP.shape
  cache = model.init_cache(B, P + max_new_tokens, jnp.dtype(model.decoder.dtype))
  positions_BP = jnp.broadcast_to(jnp.arange(P), (B, P))
  logits_BPV, cache = model.decode_step(tokens_BP, positions_BP, cache)
  first_BV = logits_BPV[jnp.arange(B), lengths_B - 1]
  return _decode_loop(model.decode_step, first_BV, lengths_B, cache, rng,
                      max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                      sampling=dict(sampling_items))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id",
                                             "pad_id", "sampling_items"))
def _generate_seq2seq(graphdef, state, src_BS, src_lengths_B, tgt_BP, tgt_lengths_B, rng, *,
                      max_new_tokens, eos_id, pad_id, sampling_items):
  model = nnx.merge(graphdef, state)
  src_mask_BS = jnp.arange(src_BS.shape[1])[None] < src_lengths_B[:, None]
  encoded = model.encode(src_BS, src_mask_BS)
  B, P = tgt_BP.shape
  cache = model.init_cache(B, P + max_new_tokens, jnp.dtype(model.decoder.dtype))
  step = functools.partial(model.decode_step, encoded_BSD=encoded,
                           src_padding_mask=src_mask_BS)
  logits_BPV, cache = step(tgt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
  first_BV = logits_BPV[jnp.arange(B), tgt_lengths_B - 1]
  return _decode_loop(step, first_BV, tgt_lengths_B, cache, rng,
                      max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                      sampling=dict(sampling_items))


def _trim(out_BN, eos_id: int) -> list[list[int]]:
  rows = []
  for row in np.asarray(out_BN).tolist():
    rows.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
  return rows


def generate(model, model_cfg, prompts: list[list[int]], *, max_new_tokens: int,
             eos_id: int = -1, pad_id: int = 0, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, sources: list[list[int]] | None = None
             ) -> list[list[int]]:
  """New tokens for each prompt (up to and including EOS), with a KV cache.

  For a decoder, `prompts` are the token prefixes. For an encoder-decoder,
  `sources` are the encoder inputs and `prompts` the decoder prefixes
  (usually just [bos]).
  """
  tokens_BP, lengths_B = _pad_prompts(prompts, pad_id)
  _check_length(model_cfg, tokens_BP.shape[1] + max_new_tokens)
  graphdef, state = nnx.split(model)
  sampling_items = tuple(sorted(dict(temperature=float(temperature), top_k=int(top_k),
                                     top_p=float(top_p)).items()))
  kwargs = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                sampling_items=sampling_items)
  rng = jax.random.key(seed)
  if model_cfg.family == "decoder":
    out_BN = _generate_decoder(graphdef, state, tokens_BP, lengths_B, rng, **kwargs)
  elif model_cfg.family == "encoder_decoder":
    if sources is None or len(sources) != len(prompts):
      raise UserError("an encoder-decoder generates from `sources`, one per prompt")
    src_BS, src_lengths_B = _pad_prompts(sources, pad_id)
    out_BN = _generate_seq2seq(graphdef, state, src_BS, src_lengths_B, tokens_BP, lengths_B,
                               rng, **kwargs)
  else:
    raise UserError(f"model.family={model_cfg.family!r} does not generate text; "
                    "use a decoder or an encoder_decoder")
  return _trim(out_BN, eos_id)
