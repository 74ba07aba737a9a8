"""DeepSeek's multi-head latent attention (MLA; DeepSeek-V2, V3): `model.attention=mla`.

With h heads, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v =
v_head_dim, r = kv_lora_rank and r_q = q_lora_rank:

- queries: x -> q_a_proj [d, r_q] -> RMSNorm -> q_b_proj [r_q, h, d_n + d_r]
  (DeepSeek-V3), or one q_proj [d, h, d_n + d_r] without q_lora_rank
  (DeepSeek-V2-Lite); the last d_r of each head are rotated by RoPE;
- keys and values: x -> kv_a_proj [d, r + d_r]: the latent c (its first r,
  through an RMSNorm) and one key k_r (its last d_r, rotated by RoPE) that
  every head shares; kv_b_proj [r, h, d_n + d_v] expands c into each head's
  unrotated key part k_n and its value;
- head i scores q_i . [k_n,i, k_r] times `attention_scale` (None: 1 /
  sqrt(d_n + d_r)); the heads' outputs go through o_proj [h, d_v, d].

This is transformers' DeepseekV3Attention and DeepseekV2Attention
(tests/test_mla.py), with two conventions. The latent norms are RMSNorms with
DeepSeek's eps of 1e-6 (`LATENT_NORM_EPS`), whatever model.norm and
model.norm_eps say. RoPE rotates the pairs (x[i], x[i + d_r/2]), as it does
everywhere here, where DeepSeek rotates (x[2i], x[2i + 1]): a DeepSeek
checkpoint reads with the rope columns of q_b_proj (or q_proj, per head) and
of kv_a_proj in the order of `deinterleave` (evens, then odds), after which
every score is the same.

Training runs the expanded heads through the attention dispatcher: queries
and keys d_n + d_r wide, values d_v (the `value_head_dim` shape, which
`reference` and `xla` take; `cudnn` and `pallas` refuse it by declaration).
KV-cache decoding keeps per token and layer only [c, k_r], r + d_r values
(the cache array `latent`, [B, 1, L, r + d_r]), and never expands it:
kv_b_proj's key part W_UK is absorbed into the query (q_n,i W_UK,i^T, r
wide) and its value part W_UV into the output, so that a step is
multi-query attention of [q_n,i W_UK,i^T, q_r,i] against the cached [c, k_r]
with values c, each head's output times W_UV,i, then o_proj: the same
scores and outputs as the expanded form, in another order of products.
The prompt's prefill writes the same cache but attends in the expanded form,
as training does (through our kernels where `attention_impl` picks them):
T queries against T keys, where the absorbed form would make every head's
query r + d_r = 576 wide against values r = 512 wide (DeepSeek-V3), 3 times
the expanded form's 192 and 128, and the score matrix of a dense slot mask.
"""
import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention import (AttentionOptions, attention, attention_weights, cache_attention,
                             cache_slot_mask, write_slots)
from model.embeddings import apply_rope
from model.layers import Dense
from model.norms import RMSNorm

# The eps of DeepSeek's latent RMSNorms (q_a_layernorm, kv_a_layernorm): their
# class's default, whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(rope_dim: int) -> np.ndarray:
  """The order of DeepSeek's rope columns that rotates them here as DeepSeek
  does: [0, 2, ..., d_r - 2, 1, 3, ..., d_r - 1], its pairs (x[2i], x[2i + 1])
  becoming ours (x[i], x[i + d_r/2])."""
  return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


class LatentAttention(nnx.Module):
  """MLA self-attention (see the module docstring); `Attention`'s interface
  for a decoder's blocks: `__call__`, `weights`, `decode`."""

  def __init__(self, cfg, *, rope, window: int | None = None, rngs: nnx.Rngs):
    """`cfg`: the `model.config.ModelConfig`; `rope`: (inv_freq,
    attention_factor) over qk_rope_head_dim; `window`: this layer's sliding
    window (None for none)."""
    d, H = cfg.d_model, cfg.num_heads
    self.nope, self.rank = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    self.rope = rope
    self.options = AttentionOptions(scale=cfg.attention_scale, softcap=cfg.attn_softcap,
                                    score=cfg.attention_score)
    self.window = window
    self.implementation = cfg.attention_impl
    self.pallas_lowering = cfg.pallas_lowering
    dense = functools.partial(Dense, cfg=cfg, rngs=rngs, std=cfg.hidden_std)
    norm = functools.partial(RMSNorm, cfg=cfg, rngs=rngs, eps=LATENT_NORM_EPS)
    if cfg.q_lora_rank:
      self.q_proj = None
      self.q_a_proj = dense(d, (cfg.q_lora_rank,), ("embed", None), use_bias=cfg.qkv_bias)
      self.q_a_norm = norm(cfg.q_lora_rank)
      self.q_b_proj = dense(cfg.q_lora_rank, (H, qk), ("latent", "heads", "head_dim"),
                            use_bias=False)
    else:
      self.q_proj = dense(d, (H, qk), ("embed", "heads", "head_dim"), use_bias=False)
      self.q_a_proj = self.q_a_norm = self.q_b_proj = None
    self.kv_a_proj = dense(d, (self.rank + cfg.qk_rope_head_dim,), ("embed", None),
                           use_bias=cfg.qkv_bias)
    self.kv_a_norm = norm(self.rank)
    self.kv_b_proj = dense(self.rank, (H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                           ("latent", "heads", "head_dim"), use_bias=False)
    self.o_proj = dense((H, cfg.v_head_dim), (d,), ("heads", "head_dim", "embed"),
                        use_bias=cfg.out_bias, in_axes=2)

  def _rotate(self, x_BTHD, positions_BT):
    inv_freq, attention_factor = self.rope
    return apply_rope(x_BTHD, positions_BT, inv_freq, attention_factor)

  def project_q(self, x_BTM, positions_BT):
    """Each head's query parts: unrotated [B, T, h, d_n] and rotated [B, T, h, d_r]."""
    if self.q_proj is not None:
      q_BTHD = self.q_proj(x_BTM)
    else:
      q_BTHD = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTM)))
    return q_BTHD[..., :self.nope], self._rotate(q_BTHD[..., self.nope:], positions_BT)

  def latent(self, x_BTM, positions_BT):
    """What the KV cache keeps of each token: [c, k_r] [B, T, 1, r + d_r],
    the normalised latent and the rotated key every head shares."""
    ckv_BT1C = self.kv_a_proj(x_BTM)[:, :, None, :]
    return jnp.concatenate([self.kv_a_norm(ckv_BT1C[..., :self.rank]),
                            self._rotate(ckv_BT1C[..., self.rank:], positions_BT)], axis=-1)

  def expand(self, latent_BS1C):
    """Each head's keys [B, S, h, d_n + d_r] and values [B, S, h, d_v] of
    the latents (training: the expanded form)."""
    kv_BSHD = self.kv_b_proj(latent_BS1C[:, :, 0, :self.rank])
    rope_BS1D = latent_BS1C[..., self.rank:]
    k_rope_BSHD = jnp.broadcast_to(rope_BS1D, (*kv_BSHD.shape[:3], rope_BS1D.shape[-1]))
    return (jnp.concatenate([kv_BSHD[..., :self.nope], k_rope_BSHD], axis=-1),
            kv_BSHD[..., self.nope:])

  def _qkv(self, x_BTM, positions_BT):
    q_nope_BTHD, q_rope_BTHD = self.project_q(x_BTM, positions_BT)
    k_BSHD, v_BSHD = self.expand(self.latent(x_BTM, positions_BT))
    return jnp.concatenate([q_nope_BTHD, q_rope_BTHD], axis=-1), k_BSHD, v_BSHD

  def __call__(self, x_BTM, *, positions_BT, causal=False, segment_ids=None, mask=None,
               bias=None):
    """Self-attention over x (training, scoring): the expanded form."""
    q_BTHD, k_BSHD, v_BSHD = self._qkv(x_BTM, positions_BT)
    options = dataclasses.replace(self.options, causal=causal, segment_ids=segment_ids,
                                  mask=mask, window=self.window, bias=bias)
    out_BTHD = attention(q_BTHD, k_BSHD, v_BSHD, options, implementation=self.implementation,
                         pallas_lowering=self.pallas_lowering)
    return self.o_proj(out_BTHD)

  def weights(self, x_BTM, *, positions_BT, causal, bias=None):
    """Self-attention weights [B, h, T, T] (for plots)."""
    q_BTHD, k_BSHD, _ = self._qkv(x_BTM, positions_BT)
    options = dataclasses.replace(self.options, causal=causal, window=self.window, bias=bias)
    w_BKGTS = attention_weights(q_BTHD, k_BSHD, options)
    B, K, G, T, S = w_BKGTS.shape
    return w_BKGTS.reshape(B, K * G, T, S)

  def decode(self, x_BTM, positions_BT, cache, bias=None, layer=None, prefill=False):
    """Self-attention against the latent cache, with the up-projections
    absorbed (see the module docstring).

    `cache` holds `latent` [B, 1, L, r + d_r], or with `layer` every
    layer's [layers, B, 1, L, r + d_r] (a scanned stack's, updated in place
    at `layer`; heads-first, one head, as `Attention.decode`'s); the tokens
    at `positions_BT` write their [c, k_r] at those slots and see slots
    0..position (the last `window` of them with a sliding window), as
    `Attention.decode`. With `prefill` the tokens are every row's first T
    (positions 0..T-1 of an empty cache, the prompt) and attend to one
    another in the expanded form (`prefill`). Returns (output, updated
    cache).
    """
    latent_BT1C = self.latent(x_BTM, positions_BT)
    cache = dict(cache, latent=write_slots(cache["latent"], latent_BT1C, positions_BT, layer))
    if prefill:
      return self.prefill(x_BTM, positions_BT, latent_BT1C, bias), cache
    q_nope_BTHD, q_rope_BTHD = self.project_q(x_BTM, positions_BT)
    latent_B1LC = (cache["latent"] if layer is None else cache["latent"][layer]).astype(
        q_nope_BTHD.dtype)
    w_RHD = self.kv_b_proj.kernel[...].astype(q_nope_BTHD.dtype)  # [r, h, d_n + d_v]
    q_latent_BTHR = jnp.einsum("bthn,rhn->bthr", q_nope_BTHD, w_RHD[..., :self.nope])
    q_BTHC = jnp.concatenate([q_latent_BTHR, q_rope_BTHD], axis=-1)
    options = dataclasses.replace(
        self.options, mask=cache_slot_mask(positions_BT, latent_B1LC.shape[2], self.window),
        bias=bias)
    out_BTHR = cache_attention(q_BTHC, latent_B1LC, latent_B1LC[..., :self.rank], options)
    out_BTHD = jnp.einsum("bthr,rhv->bthv", out_BTHR, w_RHD[..., self.nope:])
    return self.o_proj(out_BTHD), cache

  def prefill(self, x_BTM, positions_BT, latent_BT1C, bias=None):
    """A prompt's self-attention in the expanded form: its T tokens, at
    positions 0..T-1, see one another causally (within the sliding window),
    which is what they see of a cache they alone have written; through
    `attention_impl` as in training (`pallas`: our kernels, no score matrix).
    `bias` [1 or B, H, T, L] over the cache slots is cut to the T written."""
    q_nope_BTHD, q_rope_BTHD = self.project_q(x_BTM, positions_BT)
    k_BTHD, v_BTHD = self.expand(latent_BT1C.astype(q_nope_BTHD.dtype))
    T = x_BTM.shape[1]
    options = dataclasses.replace(self.options, causal=True, window=self.window,
                                  bias=None if bias is None else bias[..., :T])
    out_BTHD = attention(jnp.concatenate([q_nope_BTHD, q_rope_BTHD], axis=-1), k_BTHD, v_BTHD,
                         options, implementation=self.implementation,
                         pallas_lowering=self.pallas_lowering)
    return self.o_proj(out_BTHD)


def mla_params(m) -> int:
  """One `LatentAttention`'s parameters: q_a_proj d x r_q, its norm r_q and
  q_b_proj r_q x h (d_n + d_r), or q_proj d x h (d_n + d_r) without
  q_lora_rank; kv_a_proj d x (r + d_r), its norm r and kv_b_proj r x h (d_n
  + d_v); o_proj h d_v x d; the biases of q_a_proj and kv_a_proj (qkv_bias)
  and of o_proj (out_bias)."""
  d, h, rq, r = m.d_model, m.num_heads, m.q_lora_rank, m.kv_lora_rank
  qk = m.qk_nope_head_dim + m.qk_rope_head_dim
  q = d * rq + rq + rq * h * qk + (rq if m.qkv_bias else 0) if rq else d * h * qk
  kv = (d * (r + m.qk_rope_head_dim) + (r + m.qk_rope_head_dim if m.qkv_bias else 0) + r
        + r * h * (m.qk_nope_head_dim + m.v_head_dim))
  return q + kv + h * m.v_head_dim * d + (d if m.out_bias else 0)


def mla_activation_elements(m) -> int:
  """Elements per token one `LatentAttention` keeps for its backward pass,
  the scores aside (`model.accounting.activation_bytes_per_token`): d (the
  input of q_a_proj or q_proj and of kv_a_proj) + 2 r_q (the query latent's
  norm input and q_b_proj's) + 2 r (the KV latent's norm input and
  kv_b_proj's) + 2 h (d_n + d_r) (Q, K) + 2 h d_v (V; input of o_proj)."""
  qk = m.qk_nope_head_dim + m.qk_rope_head_dim
  return (m.d_model + 2 * m.q_lora_rank + 2 * m.kv_lora_rank + 2 * m.num_heads * qk
          + 2 * m.num_heads * m.v_head_dim)


def mla_cache(m) -> dict[str, tuple[int, ...]]:
  """The KV cache per token and layer: `latent`, [1, r + d_r]."""
  return {"latent": (1, m.kv_lora_rank + m.qk_rope_head_dim)}
