"""KV-cache generation (the lesson's "KV cache" and batched-generation pitfall).

A decoder caches each past token's keys and values so that every new token
costs one position of work in every projection and MLP. An encoder-decoder
also projects the encoder output to each decoder layer's cross-attention
keys and values once per request (`EncoderDecoder.cross_cache`, at prefill)
and every step attends to those. The loop runs the decoder once per new
token but the last (whose logits nobody reads). Prompts of different lengths are right-padded
into one batch, and every row keeps its own position counter: row b's
prompt fills cache slots 0..l_b-1, its first new token is read from the
logits at l_b-1, and its t-th new token is written at slot l_b+t. The query
at position p attends to slots 0..p only, so the padding slots after a short
prompt are never seen (they are overwritten before they become visible), and
each row decodes exactly as it would alone. This sidesteps the left- vs
right-padding mismatch: positions are never shifted by padding.

Sampling (`generate`): greedy (temperature 0), temperature, top-k and top-p
(nucleus), each row with its own random key derived from (seed, step, row).

Beam search (`beam_search`): each row keeps N hypotheses, N cache rows. At
every step each live hypothesis proposes every token (its log-probability
plus the token's) and each finished one (it emitted EOS) proposes only
itself, padded, unchanged; the N best proposals of the row by length-normalised
score, log p / ((5 + n) / 6)^alpha (GNMT's length penalty, n = tokens
generated incl. EOS), survive, and their caches are gathered from their
parents (the cross-attention cache is the same for a prompt's beams and is
not gathered). The answer is the best of the N at the end. With N = 1 every
proposal has the same length, so beam search picks the argmax: greedy.

Self-speculative greedy decoding (`generate(..., draft="mtp")`,
`mtp_speculative`) with the D multi-token prediction modules of a decoder
trained with train.mtp_depth (`model/mtp.py`), as DeepSeek-V3 drafts with
its MTP module (arXiv:2412.19437). A row whose main model has read
positions 0..n-1 knows token n (its argmax at n-1). Module k at position n-1
reads h^{k-1}_{n-1} and the embedding of token n-1+k and drafts token n+k,
so the D modules in turn draft tokens n+1..n+D. The main model then reads
tokens n..n+D in one pass against its KV cache; its argmax at n-1+j is its
own greedy token n+j, so the drafts are accepted up to the first that
differs, and the main model's token after them comes free: 1 to D+1 tokens
per pass, each the one plain greedy decoding chooses. The slots written for
rejected tokens need no rollback: the row's position counter stays before
them, no query sees a slot past its own position, and the next pass
overwrites them. Each module keeps a KV cache of its own block, whose slot
j reads h^{k-1}_j and token j+k: each pass recomputes the last 2D slots
before n (those that read a token drafted in an earlier pass, or an
h^{k-1} of such; a pass moves n by at most D+1), the prefill computes the
prompt's. Rows that have max_new_tokens tokens or an EOS stay where they
are (recomputing the same slots) until every row has.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import validation
from configs.errors import UserError
from model.positions import POSITIONS
from model.relative_bias import positions_row


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


def _pad_prompts(prompts: list[list[int]], pad_id: int, width: int | None = None):
  """[B, max(width, longest)] right-padded tokens and the [B] lengths."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("generation needs at least one prompt, each with at least one token "
                    "(start the prompt with the BOS token)")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), max(lengths.max(), width or 0)), pad_id, np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _check_length(model_cfg, total: int) -> None:
  if POSITIONS[model_cfg.pos_emb].bounded and total > model_cfg.max_len:
    raise UserError(f"prompt plus max_new_tokens = {total} exceeds the learned position "
                    f"table (model.max_len={model_cfg.max_len}); generate fewer tokens")


def _cache_rows(fn, cache):
  """`fn(array, axis)` on the batch axis of every cache array: k and v are
  [..., B, g, L, d_k] (MLA's latent [..., B, 1, L, r + d_r]) and
  cross-attention k and v [..., B, S, g, d_k], with a leading layers axis in
  a scanned stack's cache."""
  return jax.tree.map(lambda c: fn(c, c.ndim - 4), cache)


def _prefill(model, tokens_BP, lengths_B, src_BS, src_lengths_B, *, max_new_tokens: int,
             copies: int):
  """Reads the prompts (and encodes the sources) into a fresh KV cache.

  Returns (step, first logits [B * copies, V], cache of B * copies rows): each
  row repeated `copies` times in a row (the beams of a prompt are adjacent),
  `step(tokens, positions, cache)` the decoder step against the (repeated)
  cross-attention keys and values of the encoder output.
  """
  B, P = tokens_BP.shape
  # The decoder's blocks, sliced out of a scanned stack once, outside the token loop.
  decoder_step = functools.partial(model.decode_step, blocks=model.decoder.blocks())
  step = decoder_step

  def repeat(x, axis=0):
    return jnp.repeat(x, copies, axis=axis)

  if src_BS is not None:
    src_mask_BS = jnp.arange(src_BS.shape[1])[None] < src_lengths_B[:, None]
    cross_kv = model.cross_cache(model.encode(src_BS, src_mask_BS))
    step = functools.partial(decoder_step, cross_kv=cross_kv, src_padding_mask=src_mask_BS)
  cache = model.init_cache(B, P + max_new_tokens, jnp.dtype(model.decoder.dtype))
  positions_BP = jnp.broadcast_to(jnp.arange(P), (B, P))
  # A linear layer's state must not read a shorter prompt's padding; latent
  # attention runs the prompt in its expanded form.
  prompt = ({} if src_BS is not None
            else {"valid_BT": positions_BP < lengths_B[:, None], "prefill": True})
  logits_BPV, cache = step(tokens_BP, positions_BP, cache, **prompt)
  first_BV = logits_BPV[jnp.arange(B), lengths_B - 1]
  if copies == 1:
    return step, first_BV, cache
  if src_BS is not None:
    step = functools.partial(decoder_step, cross_kv=_cache_rows(repeat, cross_kv),
                             src_padding_mask=repeat(src_mask_BS))
  return step, repeat(first_BV), _cache_rows(repeat, cache)


def _decode_loop(step, first_logits_BV, lengths_B, cache, rng, *, max_new_tokens: int,
                 eos_id: int, pad_id: int, sampling: dict):
  """Samples max_new_tokens per row [B, T]; tokens after a row's EOS become pad.

  The decoder runs once per new token but the last: token t + 1 is sampled
  from the step that read token t.
  """
  B = first_logits_BV.shape[0]

  def choose(t, logits_BV, out_BT, done_B):
    token_B = sample_logits(logits_BV, jax.random.fold_in(rng, t), **sampling)
    token_B = jnp.where(done_B, pad_id, token_B)
    return token_B, out_BT.at[:, t].set(token_B), done_B | (token_B == eos_id)

  def body(t, carry):
    logits_BV, cache, out_BT, done_B = carry
    token_B, out_BT, done_B = choose(t, logits_BV, out_BT, done_B)
    logits_B1V, cache = step(token_B[:, None], (lengths_B + t)[:, None], cache)
    return logits_B1V[:, 0], cache, out_BT, done_B

  out_BT = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
  if max_new_tokens == 0:
    return out_BT
  carry = (first_logits_BV, cache, out_BT, jnp.zeros((B,), bool))
  logits_BV, _, out_BT, done_B = jax.lax.fori_loop(0, max_new_tokens - 1, body, carry)
  return choose(max_new_tokens - 1, logits_BV, out_BT, done_B)[1]


def length_penalty(num_tokens, alpha: float):
  """GNMT's ((5 + n) / 6)^alpha; beam scores are log p divided by it (alpha 0: none)."""
  return ((5.0 + num_tokens) / 6.0) ** alpha


def _beam_loop(step, first_logits_RV, lengths_B, cache, *, beam_size: int,
               max_new_tokens: int, eos_id: int, pad_id: int, alpha: float):
  """Beam search over R = B * N cache rows; the best hypothesis [B, T] of each row.

  As in `_decode_loop`, the decoder runs once per new token but the last.
  """
  N = beam_size
  R, V = first_logits_RV.shape
  B = R // N
  neg_inf = jnp.float32(-jnp.inf)
  lengths_R = jnp.repeat(lengths_B, N)
  is_pad_V = jnp.arange(V) == pad_id

  def choose(t, logits_RV, beams):
    """The N best proposals of each row at step t: (parents [B, N], tokens, beams)."""
    out_BNT, logp_BN, num_BN, done_BN = beams
    token_logp_BNV = jax.nn.log_softmax(logits_RV.astype(jnp.float32)).reshape(B, N, V)
    live_BNV = logp_BN[..., None] + token_logp_BNV
    finished_BNV = jnp.where(is_pad_V, logp_BN[..., None], neg_inf)
    proposal_BNV = jnp.where(done_BN[..., None], finished_BNV, live_BNV)
    proposal_num_BN = jnp.where(done_BN, num_BN, t + 1)
    score_BNV = proposal_BNV / length_penalty(proposal_num_BN, alpha)[..., None]
    _, best_BN = jax.lax.top_k(score_BNV.reshape(B, N * V), N)
    parent_BN, token_BN = best_BN // V, (best_BN % V).astype(jnp.int32)
    logp_BN = jnp.take_along_axis(proposal_BNV.reshape(B, N * V), best_BN, axis=1)
    num_BN = jnp.take_along_axis(proposal_num_BN, parent_BN, axis=1)
    done_BN = jnp.take_along_axis(done_BN, parent_BN, axis=1) | (token_BN == eos_id)
    out_BNT = jnp.take_along_axis(out_BNT, parent_BN[..., None], axis=1).at[:, :, t].set(token_BN)
    return parent_BN, token_BN, (out_BNT, logp_BN, num_BN, done_BN)

  def body(t, carry):
    logits_RV, cache, beams = carry
    parent_BN, token_BN, beams = choose(t, logits_RV, beams)
    rows_R = (jnp.arange(B)[:, None] * N + parent_BN).reshape(R)
    cache = _cache_rows(lambda c, axis: jnp.take(c, rows_R, axis=axis), cache)
    logits_R1V, cache = step(token_BN.reshape(R, 1), (lengths_R + t)[:, None], cache)
    return logits_R1V[:, 0], cache, beams

  # Only beam 0 is live at the start, so the first step's N best are distinct tokens.
  logp_BN = jnp.where(jnp.arange(N) == 0, 0.0, neg_inf)[None].repeat(B, axis=0)
  beams = (jnp.full((B, N, max_new_tokens), pad_id, jnp.int32), logp_BN,
           jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), bool))
  if max_new_tokens == 0:
    return beams[0][:, 0]
  logits_RV, _, beams = jax.lax.fori_loop(0, max_new_tokens - 1, body,
                                          (first_logits_RV, cache, beams))
  out_BNT, logp_BN, num_BN, _ = choose(max_new_tokens - 1, logits_RV, beams)[2]
  best_B = jnp.argmax(logp_BN / length_penalty(num_BN, alpha), axis=1)
  return out_BNT[jnp.arange(B), best_B]


def _within_vocabulary(step, first_RV, num_tokens: int | None):
  """`step` and the first logits with every id >= `num_tokens` (rows of the
  embedding past the tokenizer's vocabulary, e.g. padded to a multiple of 64)
  at the lowest logit, so that no search can choose an id nobody can decode."""
  V = first_RV.shape[-1]
  if num_tokens is None or num_tokens >= V:
    return step, first_RV
  valid_V = jnp.arange(V) < num_tokens

  def limit(logits):
    return jnp.where(valid_V, logits, jnp.finfo(logits.dtype).min)

  def limited_step(*args, **kwargs):
    logits, cache = step(*args, **kwargs)
    return limit(logits), cache

  return limited_step, limit(first_RV)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id",
                                             "pad_id", "search", "num_tokens"))
def _generate(graphdef, state, tokens_BP, lengths_B, src_BS, src_lengths_B, rng, *,
              max_new_tokens, eos_id, pad_id, search, num_tokens):
  """`search` is ("sample", sampling items) or ("beam", beam size, alpha)."""
  model = nnx.merge(graphdef, state)
  copies = search[1] if search[0] == "beam" else 1
  step, first_RV, cache = _prefill(model, tokens_BP, lengths_B, src_BS, src_lengths_B,
                                   max_new_tokens=max_new_tokens, copies=copies)
  step, first_RV = _within_vocabulary(step, first_RV, num_tokens)
  if search[0] == "beam":
    return _beam_loop(step, first_RV, lengths_B, cache, beam_size=search[1],
                      max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                      alpha=search[2])
  return _decode_loop(step, first_RV, lengths_B, cache, rng, max_new_tokens=max_new_tokens,
                      eos_id=eos_id, pad_id=pad_id, sampling=dict(search[1]))


def _mtp_drafts(model, h0_BLM, tokens_BL, positions_BW, caches, limit):
  """The first len(`caches`) MTP modules at the window `positions_BW` (each
  row's last position n-1 last), module k reading h^{k-1} there (h^0: the main model's, from
  `h0_BLM`) and token j+k of `tokens_BL` at position j, writing its KV
  cache. Returns (tokens with module k's greedy choice at n-1 written as
  token n+k, which module k+1 reads, the new caches)."""
  B = positions_BW.shape[0]
  rows_B1, rows_B = jnp.arange(B)[:, None], jnp.arange(B)
  bias = model.decoder.self_bias(positions_BW, positions_row(h0_BLM.shape[1]))
  h_BWM, new_caches = h0_BLM[rows_B1, positions_BW], []
  for k, (module, cache) in enumerate(zip(model.mtp, caches), start=1):
    emb_BWM = model.decoder.embed_tokens(tokens_BL[rows_B1, positions_BW + k], positions_BW)
    h_BWM, normed_BWM, cache = module.decode(h_BWM, emb_BWM, positions_BT=positions_BW,
                                             cache=cache, bias=bias)
    new_caches.append(cache)
    draft_B = jnp.argmax(limit(model.logits(model.decoder, normed_BWM[:, -1:])[:, 0]), axis=-1)
    tokens_BL = tokens_BL.at[rows_B, positions_BW[:, -1] + k + 1].set(draft_B.astype(jnp.int32))
  return tokens_BL, new_caches


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "pad_id",
                                             "num_tokens", "depth"))
def _speculate(graphdef, state, tokens_BP, lengths_B, *, max_new_tokens, eos_id, pad_id,
               num_tokens, depth):
  """Greedy tokens [B, max_new_tokens] by self-speculative decoding with the
  first `depth` MTP modules (module docstring); per row, the verification
  passes and the drafts accepted in them."""
  model = nnx.merge(graphdef, state)
  B, P = tokens_BP.shape
  D = depth
  W = 2 * D  # the MTP slots each round recomputes (module docstring)
  L = P + max_new_tokens + 2 * D + 2  # every slot a row writes before it is frozen, and more
  rows_B, rows_B1 = jnp.arange(B), jnp.arange(B)[:, None]
  blocks = model.decoder.blocks()
  dtype = jnp.dtype(model.decoder.dtype)

  def limit(logits):
    if num_tokens is None or num_tokens >= logits.shape[-1]:
      return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < num_tokens, logits,
                     jnp.finfo(logits.dtype).min)

  def main(tokens_BT, positions_BT, cache, h0_BLM, prefill=False):
    """The main model over `tokens_BT`: (its greedy next tokens, cache, h^0
    written); `prefill`: the tokens are the prompts (`Block.decode`)."""
    x_BTM, cache = model.decoder.decode_step(tokens_BT, positions_BT, cache, blocks=blocks,
                                             prefill=prefill)
    greedy_BT = jnp.argmax(limit(model.logits(model.decoder, x_BTM)), axis=-1).astype(jnp.int32)
    return greedy_BT, cache, h0_BLM.at[rows_B1, positions_BT].set(x_BTM.astype(h0_BLM.dtype))

  prompt_BP = jnp.broadcast_to(jnp.arange(P), (B, P))
  h0_BLM = jnp.zeros((B, L, model.decoder.d_model), dtype)
  greedy_BP, cache, h0_BLM = main(tokens_BP, prompt_BP, model.init_cache(B, L, dtype), h0_BLM,
                                  prefill=True)
  tokens_BL = jnp.full((B, L), pad_id, jnp.int32).at[:, :P].set(tokens_BP)
  tokens_BL = tokens_BL.at[rows_B, lengths_B].set(greedy_BP[rows_B, lengths_B - 1])
  caches = [model.decoder.kv_cache(B, L, dtype) for _ in range(D)]
  # The modules over the prompts: the slots before the first window.
  _, caches = _mtp_drafts(model, h0_BLM, tokens_BL, prompt_BP, caches, limit)
  slots_L = jnp.arange(L)

  def live(n_B, tokens_BL):
    """Rows still decoding: fewer than max_new_tokens so far (token n is the
    row's newest) and no EOS among them."""
    new_BL = (slots_L >= lengths_B[:, None]) & (slots_L <= n_B[:, None])
    ended_B = jnp.any(new_BL & (tokens_BL == eos_id), axis=1)
    return (n_B - lengths_B + 1 < max_new_tokens) & ~ended_B

  def body(carry):
    n_B, tokens_BL, h0_BLM, cache, caches, passes_B, accepted_B = carry
    live_B = live(n_B, tokens_BL)
    window_BW = jnp.maximum(n_B[:, None] - W + jnp.arange(W), 0)
    tokens_BL, caches = _mtp_drafts(model, h0_BLM, tokens_BL, window_BW, caches, limit)
    verify_BV = n_B[:, None] + jnp.arange(D + 1)
    drafted_BV = tokens_BL[rows_B1, verify_BV]
    greedy_BV, cache, h0_BLM = main(drafted_BV, verify_BV, cache, h0_BLM)
    agree_BD = drafted_BV[:, 1:] == greedy_BV[:, :-1]
    taken_B = jnp.sum(jnp.cumprod(agree_BD, axis=1), axis=1)
    tokens_BL = tokens_BL.at[rows_B1, verify_BV + 1].set(greedy_BV)
    return (jnp.where(live_B, n_B + taken_B + 1, n_B), tokens_BL, h0_BLM, cache, caches,
            passes_B + live_B, accepted_B + jnp.where(live_B, taken_B, 0))

  zeros_B = jnp.zeros((B,), jnp.int32)
  n_B, tokens_BL, *_, passes_B, accepted_B = jax.lax.while_loop(
      lambda carry: jnp.any(live(carry[0], carry[1])), body,
      (lengths_B, tokens_BL, h0_BLM, cache, caches, zeros_B, zeros_B))
  out_BT = tokens_BL[rows_B1, lengths_B[:, None] + jnp.arange(max_new_tokens)]
  is_eos_BT = (out_BT == eos_id).astype(jnp.int32)
  out_BT = jnp.where(jnp.cumsum(is_eos_BT, axis=1) - is_eos_BT > 0, pad_id, out_BT)
  return out_BT, passes_B, accepted_B


def _trim(out_BT, eos_id: int) -> list[list[int]]:
  rows = []
  for row in np.asarray(out_BT).tolist():
    rows.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
  return rows


def _run(model, model_cfg, prompts, sources, *, max_new_tokens, eos_id, pad_id, seed, search,
         prompt_width, source_width, num_tokens) -> list[list[int]]:
  tokens_BP, lengths_B = _pad_prompts(prompts, pad_id, prompt_width)
  _check_length(model_cfg, tokens_BP.shape[1] + max_new_tokens)
  src_BS = src_lengths_B = None
  if model_cfg.family == "encoder_decoder":
    if sources is None or len(sources) != len(prompts):
      raise UserError("an encoder-decoder generates from `sources`, one per prompt")
    src_BS, src_lengths_B = _pad_prompts(sources, pad_id, source_width)
  elif model_cfg.family != "decoder":
    raise UserError(f"model.family={model_cfg.family!r} does not generate text; "
                    "use a decoder or an encoder_decoder")
  graphdef, state = nnx.split(model)
  out_BT = _generate(graphdef, state, tokens_BP, lengths_B, src_BS, src_lengths_B,
                     jax.random.key(seed), max_new_tokens=max_new_tokens, eos_id=eos_id,
                     pad_id=pad_id, search=search, num_tokens=num_tokens)
  return _trim(out_BT, eos_id)


def mtp_speculative(model, model_cfg, prompts: list[list[int]], *, max_new_tokens: int,
                    eos_id: int = -1, pad_id: int = 0, prompt_width: int | None = None,
                    num_tokens: int | None = None, draft_depth: int | None = None
                    ) -> tuple[list[list[int]], dict]:
  """Greedy decoding drafted by the MTP modules of a decoder trained with
  train.mtp_depth (module docstring): `generate`'s tokens at temperature 0,
  drafted by the first `draft_depth` modules (default: all; module k reads
  only the modules before it, so its first D draft as trained), and
  {"draft_depth" D, "passes" (the main model's verification passes,
  each row's while it decodes), "drafted" (D per pass), "accepted" (drafts
  equal to the main model's greedy token), "acceptance_rate"
  (accepted / drafted), "tokens_per_pass" ((accepted + passes) / passes:
  the tokens each pass of the main model commits, at most D + 1)}."""
  if model_cfg.family != "decoder":
    raise UserError(f"draft=mtp: model.family={model_cfg.family!r} has no multi-token "
                    "prediction modules (a decoder trained with train.mtp_depth > 0 has)")
  if validation.linear_layers(model_cfg):
    raise UserError("draft=mtp: a rejected draft rolls the KV cache back, which a "
                    "linear_attention layer's state cannot do; generate without the draft")
  if not len(getattr(model, "mtp", ())):
    raise UserError("draft=mtp drafts with the multi-token prediction modules, and this model "
                    "has none; train it with train.mtp_depth > 0, or generate without the draft")
  depth = len(model.mtp) if draft_depth is None else draft_depth
  if not 1 <= depth <= len(model.mtp):
    raise UserError(f"draft_depth={depth}: the model has {len(model.mtp)} multi-token "
                    f"prediction modules; draft with 1 to {len(model.mtp)} of them")
  tokens_BP, lengths_B = _pad_prompts(prompts, pad_id, prompt_width)
  _check_length(model_cfg, tokens_BP.shape[1] + max_new_tokens)
  graphdef, state = nnx.split(model)
  out_BT, passes_B, accepted_B = _speculate(
      graphdef, state, tokens_BP, lengths_B, max_new_tokens=max_new_tokens, eos_id=eos_id,
      pad_id=pad_id, num_tokens=num_tokens, depth=depth)
  passes, accepted = int(passes_B.sum()), int(accepted_B.sum())
  stats = {"draft_depth": depth, "passes": passes, "drafted": depth * passes,
           "accepted": accepted, "acceptance_rate": accepted / max(depth * passes, 1),
           "tokens_per_pass": (accepted + passes) / max(passes, 1)}
  return _trim(out_BT, eos_id), stats


def generate(model, model_cfg, prompts: list[list[int]], *, max_new_tokens: int,
             eos_id: int = -1, pad_id: int = 0, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, sources: list[list[int]] | None = None,
             prompt_width: int | None = None, source_width: int | None = None,
             num_tokens: int | None = None, draft: str | None = None) -> list[list[int]]:
  """New tokens for each prompt (up to and including EOS), with a KV cache.

  For a decoder, `prompts` are the token prefixes. For an encoder-decoder,
  `sources` are the encoder inputs and `prompts` the decoder prefixes
  (usually just [bos]). `prompt_width`/`source_width` pad every batch to at
  least that many tokens, so that batches of other lengths reuse one
  compiled function (the output does not change). `num_tokens` (the
  tokenizer's vocabulary size) keeps ids the model has rows for but the
  tokenizer cannot decode from ever being chosen. `draft="mtp"`: greedy
  decoding drafted by the model's multi-token prediction modules and
  verified by the main model (`mtp_speculative`, which also reports the
  acceptance): the same tokens, fewer passes of the main model; temperature
  0 only.
  """
  if draft is not None:
    if draft != "mtp":
      raise UserError(f"draft={draft!r}: the one drafter is 'mtp' (the model's multi-token "
                      "prediction modules); or generate without a draft")
    if temperature > 0:
      raise UserError(f"draft=mtp verifies drafts greedily, and temperature={temperature} "
                      "samples; use temperature 0, or generate without the draft")
    return mtp_speculative(model, model_cfg, prompts, max_new_tokens=max_new_tokens,
                           eos_id=eos_id, pad_id=pad_id, prompt_width=prompt_width,
                           num_tokens=num_tokens)[0]
  sampling_items = tuple(sorted(dict(temperature=float(temperature), top_k=int(top_k),
                                     top_p=float(top_p)).items()))
  return _run(model, model_cfg, prompts, sources, max_new_tokens=max_new_tokens,
              eos_id=eos_id, pad_id=pad_id, seed=seed, search=("sample", sampling_items),
              prompt_width=prompt_width, source_width=source_width, num_tokens=num_tokens)


def beam_search(model, model_cfg, prompts: list[list[int]], *, beam_size: int,
                max_new_tokens: int, eos_id: int = -1, pad_id: int = 0, alpha: float = 0.6,
                sources: list[list[int]] | None = None, prompt_width: int | None = None,
                source_width: int | None = None, num_tokens: int | None = None
                ) -> list[list[int]]:
  """The best of `beam_size` hypotheses for each prompt, as `generate` returns them.

  Scores are log p / ((5 + n) / 6)^alpha (see the module docstring); beam 1
  is greedy. Arguments as in `generate`.
  """
  if not 1 <= beam_size <= model_cfg.vocab_size:
    raise UserError(f"beam size {beam_size}: must be in [1, model.vocab_size="
                    f"{model_cfg.vocab_size}]")
  return _run(model, model_cfg, prompts, sources, max_new_tokens=max_new_tokens,
              eos_id=eos_id, pad_id=pad_id, seed=0, search=("beam", int(beam_size), float(alpha)),
              prompt_width=prompt_width, source_width=source_width, num_tokens=num_tokens)
