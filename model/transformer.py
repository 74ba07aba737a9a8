"""The three families of the lesson, built from the same blocks.

- `Decoder` (decoder-only, GPT/LLaMA): causal self-attention, next-token
  logits. `m(tokens_BT, segment_ids=None, positions=None) -> logits_BTV`.
- `Encoder` (encoder-only, BERT): bidirectional self-attention with a
  padding mask, masked-LM logits. `m(tokens_BT, padding_mask=None)`.
- `EncoderDecoder` (original transformer, T5): the encoder over the source;
  a causal decoder with cross-attention to the encoder output.
  `m.encode(src_BS, src_padding_mask=None)`,
  `m.decode(tgt_BT, encoded, src_padding_mask=None)`, `m(src, tgt)`.

Embedding -> L blocks -> final norm (pre-norm only; a post-norm block already
ends in a norm) -> head (tied E^T or its own matrix). Logits are float32.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.validation import head_dim, num_decoder_layers
from model.blocks import Block
from model.embeddings import Embed, LearnedPositions, rope_frequencies, sinusoidal
from model.layers import DTYPES, Dense
from model.norms import make_norm


def _batch_split(x_BTD):
  """x with its batch dimension split over the mesh's batch axes (data, fsdp).

  Without it XLA may gather a block's activations onto every device of an
  fsdp mesh (whose parameters are split along `embed`) rather than gather
  the parameters: measured with compile.py, a 2-layer 7B-wide model on 64
  v5p chips at fsdp=64 needed 64 GiB per chip, 8.6 GiB with the split. A
  no-op where no mesh is set (`jax.sharding.use_abstract_mesh`, set by the
  jitted steps of training/steps.py).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not {"data", "fsdp"} <= set(mesh.axis_names):
    return x_BTD
  return jax.lax.with_sharding_constraint(x_BTD, P(("data", "fsdp")))


def _padding_segments(padding_mask_BT, shape):
  """A padding mask (True = real token) as segment ids (1 real, 0 pad)."""
  if padding_mask_BT is None:
    return None
  return jnp.broadcast_to(padding_mask_BT, shape).astype(jnp.int32)


class _Stack(nnx.Module):
  """Embedding, positions, a stack of blocks, final norm and output head."""

  def __init__(self, cfg, *, num_layers: int, cross: bool, embed: Embed | None,
               rngs: nnx.Rngs, remat: bool = False):
    self.cfg_pos = cfg.pos_emb
    self.d_model = cfg.d_model
    self.dtype = DTYPES[cfg.dtype]
    self.remat = remat
    self.embed = embed if embed is not None else Embed(cfg, rngs=rngs)
    self.positions = LearnedPositions(cfg, rngs=rngs) if cfg.pos_emb == "learned" else None
    rope = None
    if cfg.pos_emb == "rope":
      rope = rope_frequencies(head_dim(cfg), cfg.rope_theta, cfg.rope_scaling,
                              cfg.rope_scaling_factor, cfg.rope_original_max_len)
    self.layers = nnx.List([Block(cfg, cross=cross, rope=rope, rngs=rngs)
                            for _ in range(num_layers)])
    self.final_norm = (make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
                       if cfg.norm_position == "pre" else None)
    self.kv_shape = (cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads,
                     head_dim(cfg))

  def embed_tokens(self, tokens_BT, positions_BT):
    x_BTD = self.embed(tokens_BT)
    if self.cfg_pos == "sinusoidal":
      # The original transformer scales embeddings by sqrt(d) before adding PE.
      x_BTD = x_BTD * math.sqrt(self.d_model) + sinusoidal(positions_BT, self.d_model).astype(
          self.dtype)
    elif self.positions is not None:
      x_BTD = x_BTD + self.positions(positions_BT)
    return x_BTD

  def run_blocks(self, x_BTD, **kwargs):
    x_BTD = _batch_split(x_BTD)
    for layer in self.layers:
      if self.remat:
        x_BTD = nnx.remat(lambda blk, h: blk(h, **kwargs))(layer, x_BTD)
      else:
        x_BTD = layer(x_BTD, **kwargs)
      x_BTD = _batch_split(x_BTD)
    return self.final_norm(x_BTD) if self.final_norm is not None else x_BTD

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    """Zeros for every layer: k, v [batch, length, g, d_k]."""
    shape = (batch, length, *self.kv_shape)
    return [dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)) for _ in self.layers]

  def decode_step(self, tokens_BT, positions_BT, cache, **cross):
    """Hidden states of `tokens_BT` at `positions_BT` given the cache; new cache."""
    x_BTD = self.embed_tokens(tokens_BT, positions_BT)
    new_cache = []
    for layer, layer_cache in zip(self.layers, cache):
      x_BTD, layer_cache = layer.decode(x_BTD, positions_BT=positions_BT, cache=layer_cache,
                                        **cross)
      new_cache.append(layer_cache)
    if self.final_norm is not None:
      x_BTD = self.final_norm(x_BTD)
    return x_BTD, new_cache

  def attention_maps(self, tokens_BT, layer: int, *, causal: bool):
    """Self-attention weights [B, h, T, T] of block `layer` (no packing)."""
    positions_BT = _default_positions(tokens_BT, None)
    x_BTD = self.embed_tokens(tokens_BT, positions_BT)
    for block in list(self.layers)[:layer]:
      x_BTD = block(x_BTD, positions_BT=positions_BT, causal=causal)
    return self.layers[layer].attention_weights(x_BTD, positions_BT=positions_BT, causal=causal)


def _default_positions(tokens_BT, positions_BT):
  if positions_BT is not None:
    return positions_BT
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)


class _WithHead(nnx.Module):
  """Tied (E^T) or untied output projection to float32 logits."""

  def _init_head(self, cfg, rngs):
    self.head = None if cfg.tie_embeddings else Dense(
        cfg.d_model, (cfg.vocab_size,), ("embed", "vocab"), use_bias=False, cfg=cfg, rngs=rngs)

  def logits(self, stack: _Stack, x_BTD):
    if self.head is None:
      return stack.embed.attend(x_BTD).astype(jnp.float32)
    return self.head(x_BTD).astype(jnp.float32)


class Decoder(_WithHead):
  """Decoder-only language model (causal, next-token)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool = False):
    self.decoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, embed=None,
                          rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)

  def hidden(self, tokens_BT, segment_ids=None, positions=None):
    positions = _default_positions(tokens_BT, positions)
    x_BTD = self.decoder.embed_tokens(tokens_BT, positions)
    return self.decoder.run_blocks(x_BTD, positions_BT=positions, causal=True,
                                   segment_ids=segment_ids)

  def __call__(self, tokens_BT, segment_ids=None, positions=None):
    return self.logits(self.decoder, self.hidden(tokens_BT, segment_ids, positions))

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    return self.decoder.init_cache(batch, length, dtype)

  def decode_step(self, tokens_BT, positions_BT, cache):
    """Logits of `tokens_BT` at `positions_BT` given the cache; new cache."""
    x_BTD, cache = self.decoder.decode_step(tokens_BT, positions_BT, cache)
    return self.logits(self.decoder, x_BTD), cache


class Encoder(_WithHead):
  """Encoder-only model (bidirectional) with a masked-LM head."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool = False):
    self.encoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, embed=None,
                          rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)

  def hidden(self, tokens_BT, padding_mask=None, segment_ids=None, positions=None):
    positions = _default_positions(tokens_BT, positions)
    x_BTD = self.encoder.embed_tokens(tokens_BT, positions)
    if segment_ids is None:
      segment_ids = _padding_segments(padding_mask, tokens_BT.shape)
    return self.encoder.run_blocks(x_BTD, positions_BT=positions, causal=False,
                                   segment_ids=segment_ids)

  def __call__(self, tokens_BT, padding_mask=None, segment_ids=None, positions=None):
    """MLM logits; `padding_mask` (True = real) or packed `segment_ids` (0 = pad)."""
    return self.logits(self.encoder, self.hidden(tokens_BT, padding_mask, segment_ids,
                                                 positions))


class EncoderDecoder(_WithHead):
  """Encoder over the source, causal decoder with cross-attention to it.

  The token embedding is shared by encoder, decoder and (when tied) head.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool = False):
    self.encoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, embed=None,
                          rngs=rngs, remat=remat)
    self.decoder = _Stack(cfg, num_layers=num_decoder_layers(cfg), cross=True,
                          embed=self.encoder.embed, rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)

  def encode(self, src_BS, src_padding_mask=None):
    positions = _default_positions(src_BS, None)
    x_BSD = self.encoder.embed_tokens(src_BS, positions)
    return self.encoder.run_blocks(x_BSD, positions_BT=positions, causal=False,
                                   segment_ids=_padding_segments(src_padding_mask, src_BS.shape))

  def _cross_segments(self, tgt_BT, src_padding_mask):
    if src_padding_mask is None:
      return None
    return (jnp.ones(tgt_BT.shape, jnp.int32), src_padding_mask.astype(jnp.int32))

  def decode(self, tgt_BT, encoded_BSD, src_padding_mask=None):
    positions = _default_positions(tgt_BT, None)
    x_BTD = self.decoder.embed_tokens(tgt_BT, positions)
    x_BTD = self.decoder.run_blocks(
        x_BTD, positions_BT=positions, causal=True, context_BSD=encoded_BSD,
        cross_segment_ids=self._cross_segments(tgt_BT, src_padding_mask))
    return self.logits(self.decoder, x_BTD)

  def __call__(self, src_BS, tgt_BT, src_padding_mask=None):
    return self.decode(tgt_BT, self.encode(src_BS, src_padding_mask), src_padding_mask)

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    return self.decoder.init_cache(batch, length, dtype)

  def decode_step(self, tokens_BT, positions_BT, cache, encoded_BSD, src_padding_mask=None):
    x_BTD, cache = self.decoder.decode_step(
        tokens_BT, positions_BT, cache, context_BSD=encoded_BSD,
        cross_segment_ids=self._cross_segments(tokens_BT, src_padding_mask))
    return self.logits(self.decoder, x_BTD), cache
