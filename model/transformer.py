"""The three families of the lesson, built from the same blocks.

- `Decoder` (decoder-only, GPT/LLaMA): causal self-attention, next-token
  logits. `m(tokens_BT, segment_ids=None, positions=None) -> logits_BTV`.
- `Encoder` (encoder-only, BERT): bidirectional self-attention with a
  padding mask, masked-LM logits.
  `m(tokens_BT, padding_mask=None, token_type_ids=None)`.
- `EncoderDecoder` (original transformer, T5): the encoder over the source;
  a causal decoder with cross-attention to the encoder output.
  `m.encode(src_BS, src_padding_mask=None)`,
  `m.decode(tgt_BT, encoded, src_padding_mask=None)`, `m(src, tgt)`.

Embedding (tokens, the position scheme's embedding, optional token types,
optional norm) -> L blocks (a loop over L blocks, or with
`model.scan_layers` one block scanned over parameters stacked on a leading
`layers` axis, per run of identical layers where the layers differ; with a
position scheme that biases the scores, such as T5's relative bias, the
bias is computed once per stack and added to every block's self-attention
scores: `model/positions.py`) -> final norm
(pre-norm only; a post-norm block already ends in a norm) -> head: an
optional transform (BERT's masked-LM head: dense, activation, norm), the
final hidden states times d_model^-0.5 when `scale_head_input` (T5 v1.0),
the output projection (tied E^T or its own matrix) and an optional bias
over the vocabulary; with `real_vocab_size` < `vocab_size` the logits of
the padded rows are `PADDED_LOGIT`. The projection computes in float32
whatever `model.dtype` (its inputs and weights cast up, as nanodo and MaxText
do), so the loss sees full-precision logits. With `model.num_labels` the
head is a sequence classifier instead (`model/classifier.py`):
`m.classify(tokens_BT, padding_mask_BT) -> logits [B, num_labels]`, and
`m.pooled(...)` is the pooled hidden state (training.embed's vectors).
"""
import itertools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import spmd
from jax.sharding import PartitionSpec as P

from model import context_parallel
from model.attention import soft_cap
from model.attention_kinds import ATTENTIONS
from model.blocks import Block
from model.classifier import SequenceClassifier, pool
from model import gated_deltanet
from model.embeddings import Embed, TokenTypes, rope_from_config
from model.layers import LAYERS_AXIS, Dense, batch_axes, param
from model.mlp import MLPS
from model.moe import MoE
from model.mtp import MTPModule, shift as mtp_shift
from model.norms import make_norm
from model.positions import POSITIONS
from model.relative_bias import positions_row
from model.remat import remat_policy


# The logit of a padded vocabulary row (past `model.real_vocab_size`): finite,
# so that softmax, cross-entropy, entropies and sampling (also divided by a
# temperature) give those rows probability 0 exactly, never a NaN.
PADDED_LOGIT = -1e9


def _batch_split(x_BTM):
  """x with its batch dimension split over the mesh's batch axes (data, fsdp),
  and its sequence over the context axis where the mesh splits rows.

  Without it XLA may gather a block's activations onto every device of an
  fsdp mesh (whose parameters are split along `embed`) rather than gather
  the parameters, which costs many times the memory. A no-op where no mesh
  is set (`jax.sharding.use_abstract_mesh`, set by the
  jitted steps of training/steps.py).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not {"data", "fsdp"} <= set(mesh.axis_names):
    return x_BTM
  sequence = context_parallel.AXIS if context_parallel.context_size() > 1 else None
  return jax.lax.with_sharding_constraint(x_BTM, P(batch_axes(mesh), sequence))


def _padding_segments(padding_mask_BT, shape):
  """A padding mask (True = real token) as segment ids (1 real, 0 pad)."""
  if padding_mask_BT is None:
    return None
  return jnp.broadcast_to(padding_mask_BT, shape).astype(jnp.int32)


class _Stack(nnx.Module):
  """Embedding, positions, a stack of blocks, final norm and output head."""

  def __init__(self, cfg, *, num_layers: int, cross: bool, causal: bool, embed: Embed | None,
               rngs: nnx.Rngs, remat: bool | str = False):
    self.d_model = cfg.d_model
    self.dtype = cfg.dtype  # the KV cache's (model/generate.py)
    self.scale_embeddings = cfg.scale_embeddings
    self.remat = remat_policy(remat)
    self.embed = embed if embed is not None else Embed(cfg, rngs=rngs)
    scheme = POSITIONS[cfg.pos_emb]
    self.positions = scheme.embedding(cfg, rngs=rngs) if scheme.embedding else None
    self.token_types = TokenTypes(cfg, rngs=rngs) if cfg.type_vocab_size else None
    self.embedding_norm = (make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
                           if cfg.embedding_norm else None)
    rope = rope_from_config(cfg) if scheme.rotary else None
    self.relative_bias = (scheme.bias(cfg, bidirectional=not causal, rngs=rngs)
                          if scheme.bias else None)
    self.scan = cfg.scan_layers
    self.scan_unroll = cfg.scan_unroll
    make_block = lambda i, r: Block(cfg, cross=cross, rope=rope, rngs=r,
                                    window=cfg.layer_window(i), moe=cfg.layer_is_moe(i),
                                    linear=cfg.layer_is_linear(i))
    if self.scan:
      # The segments of `layer_plan`, each stacked on its own `layers` axis:
      # a run of identical layers (DeepSeek-V3: layers 0-2 dense, 3-60 with
      # experts) or the repeats of a cycle of layer kinds (3 linear, 1 full),
      # whose body holds the cycle's blocks; one run is the stack itself.
      self.segments = layer_plan(cfg, num_layers)
      groups = {seg.name: _stacked_blocks(_segment_body(make_block, seg), seg.repeats, rngs)
                for seg in self.segments}
      self.layers = (groups[self.segments[0].name]
                     if len(self.segments) == 1 and self.segments[0].period == 1
                     else nnx.Dict(groups))
    else:
      self.layers = nnx.List([make_block(i, rngs) for i in range(num_layers)])
    self.num_layers = num_layers
    self.final_norm = (make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
                       if cfg.norm_position == "pre" else None)
    # The KV cache per token and layer: array name -> (heads, width) (the
    # `model.attention` entry's: k and v [g, d_k], or MLA's latent [1, r + d_r]);
    # the arrays are heads-first, [B, heads, L, width] (`kv_cache`).
    self.cache_shapes = tuple(ATTENTIONS[cfg.attention].cache(cfg).items())
    # A linear_attention layer's state instead, per sequence (no token axis).
    self.state_shapes = tuple(gated_deltanet.state_shapes(cfg).items())
    self.linear = tuple(cfg.layer_is_linear(i) for i in range(num_layers))
    self.moe_layers = tuple(i for i in range(num_layers) if cfg.layer_is_moe(i))
    # Layer i's index among the layers of its kind of cache (attention or
    # linear): its slice of a scanned stack's cache, stacked per kind.
    self.cache_index = tuple(self.linear[:i].count(self.linear[i]) for i in range(num_layers))

  def embed_tokens(self, tokens_BT, positions_BT, token_types_BT=None):
    """Token embeddings (times sqrt(d_model) when `scale_embeddings`) plus
    the position scheme's embedding (sinusoidal, learned), plus the token-type
    embeddings (type 0 where `token_types_BT` is None), then the embedding norm."""
    x_BTM = self.embed(tokens_BT)
    if self.scale_embeddings:
      x_BTM = x_BTM * math.sqrt(self.d_model)
    if self.positions is not None:
      x_BTM = x_BTM + self.positions(positions_BT)
    if self.token_types is not None:
      if token_types_BT is None:
        token_types_BT = jnp.zeros_like(tokens_BT)
      x_BTM = x_BTM + self.token_types(token_types_BT)
    if self.embedding_norm is not None:
      x_BTM = self.embedding_norm(x_BTM)
    return x_BTM

  def self_bias(self, q_positions_BT, k_positions_BS):
    """The position scheme's bias [B or 1, H, T, S] on this stack's
    self-attention scores (T5's relative bias), or None for a scheme without."""
    if self.relative_bias is None:
      return None
    return self.relative_bias(q_positions_BT, k_positions_BS)

  def run_blocks(self, x_BTM, *, bias_positions_BT, **kwargs):
    """The blocks and the final norm; `bias_positions_BT` ([B or 1, T]) are
    the positions the relative bias is computed at, once for all blocks.
    With experts, their layers' `MoEStats` (each field [MoE layers]) are left
    in `self.router_stats` (an `nnx.Intermediate`) for the training loss."""
    kwargs["bias"] = self.self_bias(bias_positions_BT, bias_positions_BT)

    # A scan of one block per iteration already keeps XLA from merging the
    # recomputation into the forward pass, so remat's barrier only costs memory
    # there (JAX's advice); with several blocks per iteration it keeps them apart.
    barrier = not self.scan or self.scan_unroll > 1

    def block(layer, h_BTM):
      run = lambda blk, h: blk(h, **kwargs)
      if self.remat.remat:
        run = nnx.remat(run, prevent_cse=barrier, policy=self.remat.jax_policy())
      h_BTM, stats = run(layer, h_BTM)
      return _batch_split(h_BTM), stats

    def body(blocks, h_BTM, _):
      # One repeat of a segment: its one block, or a cycle's blocks in
      # order, with their MoE statistics stacked [MoE blocks of the body].
      if isinstance(blocks, Block):
        return block(blocks, h_BTM)
      per_block = []
      for layer in blocks:
        h_BTM, layer_stats = block(layer, h_BTM)
        per_block += [] if layer_stats is None else [layer_stats]
      return h_BTM, jax.tree.map(lambda *s: jnp.stack(s), *per_block) if per_block else None

    x_BTM = _batch_split(x_BTM)
    if self.scan:
      per_run = []
      for seg, layers in self._groups():
        x_BTM, run_stats = _scan_layers(body, layers, x_BTM, unroll=self.scan_unroll)
        if run_stats is not None and seg.period > 1:  # [repeats, k, ...] -> layer order
          run_stats = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), run_stats)
        per_run += [] if run_stats is None else [run_stats]
      stats = jax.tree.map(lambda *s: jnp.concatenate(s), *per_run) if per_run else None
    else:
      per_layer = []
      for layer in self.layers:
        x_BTM, layer_stats = block(layer, x_BTM)
        per_layer += [] if layer_stats is None else [layer_stats]
      stats = jax.tree.map(lambda *s: jnp.stack(s), *per_layer) if per_layer else None
    if stats is not None:
      self.router_stats = nnx.Intermediate(stats)
    return self.final_norm(x_BTM) if self.final_norm is not None else x_BTM

  def kv_cache(self, batch: int, length: int, dtype=jnp.float32, count: tuple = ()):
    """Zeros for one attention layer's KV cache (or, with `count` = (n,),
    n layers' stacked), heads-first: k, v [*count, batch, g, length, d_k],
    MLA's latent [*count, batch, 1, length, r + d_r]; the layout the
    decoding step's products read (`Attention.decode`)."""
    return {name: jnp.zeros((*count, batch, heads, length, width), dtype)
            for name, (heads, width) in self.cache_shapes}

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    """Zeros for every layer: the self-attention's arrays (`kv_cache`), or
    a linear_attention layer's state [batch, ...] (its rule's state in
    float32, its convolutions' last inputs in `dtype`); scanned, one dict
    whose arrays are stacked over the layers of their kind [layers, batch,
    ...]."""

    def layer_cache(linear: bool, count: tuple = ()):
      if linear:
        return {name: jnp.zeros((*count, batch, *shape),
                                jnp.float32 if name == "state" else dtype)
                for name, shape in self.state_shapes}
      return self.kv_cache(batch, length, dtype, count)

    if not self.scan:
      return [layer_cache(linear) for linear in self.linear]
    cache = {}
    for linear in (False, True):
      if linear in self.linear:
        cache.update(layer_cache(linear, (self.linear.count(linear),)))
    return cache

  def cross_kv(self, context_BSM):
    """Every layer's cross-attention (k, v) [B, S, K, D] of the encoder
    output, one pair per layer (scanned: computed stacked, then split)."""
    if not self.scan:
      return [layer.cross_kv(context_BSM) for layer in self.layers]
    out = []
    for seg, layers in self._groups():
      if seg.period > 1:
        out += [self.block(i).cross_kv(context_BSM) for i in seg.layers]
        continue
      stacked = _map_layers(lambda layer: layer.cross_kv(context_BSM), layers)
      out += [jax.tree.map(lambda x: x[i], stacked) for i in range(seg.repeats)]
    return out

  def decode_step(self, tokens_BT, positions_BT, cache, cross_kv=None, cross_segment_ids=None,
                  blocks=None, valid_BT=None, prefill=False):
    """Hidden states of `tokens_BT` at `positions_BT` given the cache (and,
    with cross-attention, each layer's `cross_kv`); new cache.

    The layers run one after the other in both layouts; a scanned stack's
    cache stays one stacked array per k and v, each layer updating its slice
    in place. `blocks` (`self.blocks()`, taken once per generation outside
    the token loop) spares a scanned stack slicing every layer's weights out
    of the stacked ones at every token: a scan over the layers inside the
    token loop copied each layer's weights and both caches per token, which
    made CPU decoding half as fast (docs/results.md, "Against PyTorch").
    `valid_BT`: the real tokens of right-padded prompts; `prefill`: the
    tokens are the prompts, at positions 0..T-1 (`Block.decode`).
    """
    blocks = self.blocks() if blocks is None else blocks
    x_BTM = self.embed_tokens(tokens_BT, positions_BT)
    bias = None
    if self.relative_bias is not None:
      kv = cache if self.scan else cache[self.linear.index(False)]
      length = kv[self.cache_shapes[0][0]].shape[-2]
      bias = self.self_bias(positions_BT, positions_row(length))
    new_cache = cache if self.scan else []
    for i, block in enumerate(blocks):
      kwargs = dict(positions_BT=positions_BT, cross_segment_ids=cross_segment_ids, bias=bias,
                    context_kv=None if cross_kv is None else cross_kv[i], valid_BT=valid_BT,
                    prefill=prefill)
      if self.scan:
        x_BTM, new_cache = block.decode(x_BTM, cache=new_cache, layer=self.cache_index[i],
                                        **kwargs)
      else:
        x_BTM, layer_cache = block.decode(x_BTM, cache=cache[i], **kwargs)
        new_cache.append(layer_cache)
    if self.final_norm is not None:
      x_BTM = self.final_norm(x_BTM)
    return x_BTM, new_cache

  def block(self, i: int) -> Block:
    """Block `i` of the stack, in either layout (scanned: a slice of the
    stacked parameters)."""
    if not self.scan:
      return self.layers[i]
    seg, layers = next((seg, layers) for seg, layers in self._groups() if i in seg.layers)
    repeat, j = seg.where(i)
    graphdef, state = nnx.split(layers)
    body = _one_layer(graphdef, jax.tree.map(lambda x: x[repeat], state))
    return body if seg.period == 1 else body[j]

  def blocks(self) -> list[Block]:
    """Every block of the stack, in order (scanned: slices, as `block`)."""
    return [self.block(i) for i in range(self.num_layers)]

  def _groups(self) -> list[tuple["Segment", nnx.Module]]:
    """A scanned stack's segments with their stacked bodies (a Block, or a
    cycle's nnx.List of Blocks), in order."""
    if isinstance(self.layers, Block):
      return [(self.segments[0], self.layers)]
    return [(seg, self.layers[seg.name]) for seg in self.segments]

  def expert_biases(self) -> list[tuple[nnx.Variable, tuple[int, ...]]]:
    """The `ExpertBias` variables of the MoE layers, each with the rows of
    `router_stats` (one per MoE layer, in layer order) that it holds, in
    its own order: one [E] per MoE layer of a loop, one [n, E] per run of n
    MoE layers of a scanned stack and per MoE block of a scanned cycle."""
    moe = list(self.moe_layers)
    if not self.scan:
      return [(self.layers[i].mlp.score_bias, (moe.index(i),)) for i in moe]
    out = []
    for seg, layers in self._groups():
      bodies = [(layers, 0)] if seg.period == 1 else [(b, j) for j, b in enumerate(layers)]
      out += [(body.mlp.score_bias, tuple(moe.index(seg.layer(r, j)) for r in range(seg.repeats)))
              for body, j in bodies if isinstance(body.mlp, MoE)]
    return out

  def attention_maps(self, tokens_BT, *, causal: bool):
    """Every block's self-attention weights [B, h, T, T], in order (no
    packing), from one pass through the stack."""
    positions_BT = _default_positions(tokens_BT, None)
    x_BTM = self.embed_tokens(tokens_BT, positions_BT)
    row = positions_row(tokens_BT.shape[1])
    bias = self.self_bias(row, row)
    maps = []
    for block in self.blocks():
      maps.append(block.attention_weights(x_BTM, positions_BT=positions_BT, causal=causal,
                                          bias=bias))
      x_BTM, _ = block(x_BTM, positions_BT=positions_BT, causal=causal, bias=bias)
    return maps


class Segment(NamedTuple):
  """Layers first .. first + repeats x period - 1 of a scanned stack:
  `repeats` times a body of `period` layers (period 1: a run of identical
  layers), stacked on one `layers` axis of length `repeats`."""
  first: int
  repeats: int
  period: int

  @property
  def name(self) -> str:
    """Its key in the stack: "3_to_60" (a run), "0_to_47_every_4" (a cycle
    of 4 layers, 12 times; its body's blocks are keys 0..3 under it)."""
    last = self.first + self.repeats * self.period - 1
    return f"{self.first}_to_{last}" + (f"_every_{self.period}" if self.period > 1 else "")

  @property
  def layers(self) -> range:
    return range(self.first, self.first + self.repeats * self.period)

  def where(self, layer: int) -> tuple[int, int]:
    """(repeat, block of the body) that holds `layer`."""
    return divmod(layer - self.first, self.period)

  def layer(self, repeat: int, j: int = 0) -> int:
    """The layer of block j of the body at `repeat`."""
    return self.first + repeat * self.period + j


_SEGMENT_NAME = re.compile(r"(\d+)_to_(\d+)(?:_every_(\d+))?")


def segment(name: str) -> Segment | None:
  """The Segment a stack key names ("3_to_60", "0_to_47_every_4"), else None."""
  match = _SEGMENT_NAME.fullmatch(name)
  if match is None:
    return None
  first, last, period = int(match[1]), int(match[2]), int(match[3] or 1)
  return Segment(first, (last - first + 1) // period, period)


def _runs(kinds, first: int) -> list[Segment]:
  """Runs of identical consecutive `kinds`, the first at layer `first`."""
  counts = [len(list(run)) for _, run in itertools.groupby(kinds)]
  return [Segment(start, count, 1)
          for start, count in zip(itertools.accumulate([first, *counts[:-1]]), counts)]


def layer_plan(cfg, num_layers: int) -> tuple[Segment, ...]:
  """The segments a scanned stack of `num_layers` scans, in order.

  Layers described by `model.layer_types` repeat its cycle
  (`cfg.layer_cycle` layers) as many whole times as the stack holds, the
  layers left over in runs, when that compiles no more blocks than runs of
  identical layers would (3 linear and 1 full layer: 4 blocks for any
  depth, as MaxText scans its layer cycles); otherwise, and always for layers
  described by sliding_window_layers and moe_layers (the layout of runs
  saved before layer_types), runs of identical consecutive layers.
  """
  kinds = [cfg.layer_kind(i) for i in range(num_layers)]
  runs = _runs(kinds, 0)
  period = cfg.layer_cycle
  repeats = num_layers // period if period > 1 else 0
  if repeats >= 2:
    cycled = [Segment(0, repeats, period), *_runs(kinds[repeats * period:], repeats * period)]
    if period + len(cycled) - 1 <= len(runs):  # as few blocks, and scans that do not grow
      return tuple(cycled)
  return tuple(runs)


def _segment_body(make_block, seg: Segment):
  """rngs -> one repeat of `seg`: its block (a run's), or an nnx.List of
  the cycle's blocks; `make_block(layer, rngs)` builds the block of a layer."""
  if seg.period == 1:
    return lambda rngs: make_block(seg.first, rngs)
  return lambda rngs: nnx.List([make_block(seg.layer(0, j), rngs) for j in range(seg.period)])


def _stacked_blocks(make_block, num_layers: int, rngs: nnx.Rngs) -> Block:
  """One Block whose every parameter has a leading [num_layers] axis, named
  `layers` in its sharding metadata; each layer is initialised from its own
  split of `rngs`, as the loop's blocks are from successive draws."""
  make = nnx.split_rngs(splits=num_layers)(
      nnx.vmap(make_block, in_axes=0, out_axes=0,
               transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS}))
  return make(rngs)


_LAYERS_METADATA = {nnx.PARTITION_NAME: LAYERS_AXIS}


def _one_layer(graphdef, layer_state) -> Block:
  """The Block of one layer's slice of the stacked state (its metadata
  without the `layers` axis)."""
  return nnx.merge(graphdef, spmd.remove_axis(layer_state, 0, _LAYERS_METADATA))


def _scan_layers(fn, layers: Block, carry, xs=None, unroll: int = 1):
  """`fn(block, carry, x) -> (carry, y)` over the layers of the stacked
  `layers` (and over the leading axis of `xs`): a `jax.lax.scan` over their
  split state; `unroll` blocks per iteration (model.scan_unroll)."""
  graphdef, state = nnx.split(layers)
  return jax.lax.scan(lambda c, scanned: fn(_one_layer(graphdef, scanned[0]), c, scanned[1]),
                      carry, (state, xs), unroll=unroll)


def _map_layers(fn, layers: Block):
  """`fn(block)` of every layer of the stacked `layers`, stacked."""
  graphdef, state = nnx.split(layers)
  return jax.vmap(lambda layer_state: fn(_one_layer(graphdef, layer_state)))(state)


def _default_positions(tokens_BT, positions_BT):
  if positions_BT is not None:
    return positions_BT
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)


def _bias_positions(tokens_BT, positions_BT):
  """Positions for the relative bias: the given ones, else one [1, T] row
  (so the bias is computed once for the whole batch)."""
  return positions_row(tokens_BT.shape[1]) if positions_BT is None else positions_BT


class HeadTransform(nnx.Module):
  """BERT's masked-LM head transform, before the output projection:
  norm(act(x W + b)) with W [d, d], the activation of `model.mlp` and the
  model's norm."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dense = Dense(cfg.d_model, (cfg.d_model,), ("embed", None), use_bias=True, cfg=cfg,
                       rngs=rngs)
    self.activation = MLPS[cfg.mlp].activation
    self.norm = make_norm(cfg.d_model, cfg=cfg, rngs=rngs)

  def __call__(self, x_BTM):
    return self.norm(self.activation(self.dense(x_BTM)))


class _WithHead(nnx.Module):
  """The output head: optional transform, tied (E^T) or untied projection
  computed in float32 (times 1 / width multiplier under μP), optional bias
  over the vocabulary, the soft-cap
  c tanh(logits / c) with `final_softcap` (Gemma-2), the padded rows
  masked; or, with `model.num_labels`, a sequence classifier."""

  def _init_head(self, cfg, rngs):
    self.pooling = cfg.pooling
    self.classifier = SequenceClassifier(cfg, rngs=rngs) if cfg.num_labels else None
    if self.classifier is not None:
      return
    self.head_input_scale = cfg.d_model ** -0.5 if cfg.scale_head_input else None
    self.logit_mult = cfg.logit_mult  # μP: mup_output_mult / width multiplier (None under sp)
    self.head_transform = HeadTransform(cfg, rngs=rngs) if cfg.head_transform else None
    self.head = None if cfg.tie_embeddings else Dense(
        cfg.d_model, (cfg.vocab_size,), ("embed", "vocab"), use_bias=False, cfg=cfg, rngs=rngs,
        dtype=jnp.float32)
    self.output_bias = (param(rngs, jax.nn.initializers.zeros, (cfg.vocab_size,), ("vocab",),
                              cfg.param_dtype) if cfg.output_bias else None)
    self.real_vocab_size = (cfg.real_vocab_size if cfg.real_vocab_size < cfg.vocab_size
                            else None)
    self.final_softcap = cfg.final_softcap

  def padded_hidden(self, tokens_BT, padding_mask_BT, token_type_ids_BT=None):
    """Final hidden states [B, T, M] of right-padded rows (True = real token)."""
    raise NotImplementedError

  def pooled(self, tokens_BT, padding_mask_BT, token_type_ids_BT=None, pooling=None):
    """The pooled hidden state [B, M] (`pooling`: None for model.pooling)."""
    return pool(self.padded_hidden(tokens_BT, padding_mask_BT, token_type_ids_BT),
                padding_mask_BT, pooling or self.pooling)

  def classify(self, tokens_BT, padding_mask_BT, token_type_ids_BT=None):
    """Float32 class logits [B, num_labels] of right-padded rows."""
    return self.classifier(self.padded_hidden(tokens_BT, padding_mask_BT, token_type_ids_BT),
                           padding_mask_BT)

  def _projection_input(self, x_BTM):
    """The final hidden states as the output projection takes them: after
    the optional transform and the input scale."""
    if self.head_transform is not None:
      x_BTM = self.head_transform(x_BTM)
    if self.head_input_scale is not None:
      x_BTM = x_BTM * self.head_input_scale
    return x_BTM

  @property
  def head_fuses(self) -> bool:
    """Whether the fused head-and-loss kernel takes this head: an LM head
    without a soft-cap or a bias over the vocabulary."""
    return (self.classifier is None and self.final_softcap is None
            and self.output_bias is None)

  @jax.named_scope("logits")
  def head_operands(self, stack: _Stack, x_BTM):
    """What the fused head-and-loss kernel takes in place of `logits`
    (model/kernels/fused_loss.py, train.loss_impl=pallas): (the projection's
    input [B, T, M], its weight as vocabulary rows [V, M] (the tied
    embedding, or the untied kernel transposed), the logits' multiplier or
    None, the real vocabulary size or None); only for a head it takes
    (`head_fuses`; configs/validation.py refuses the others)."""
    if not self.head_fuses:
      raise ValueError("head_operands: the fused loss takes an LM head without soft-cap or bias")
    w_VM = stack.embed.embedding[...] if self.head is None else self.head.kernel[...].T
    return self._projection_input(x_BTM), w_VM, self.logit_mult, self.real_vocab_size

  @jax.named_scope("logits")
  def logits(self, stack: _Stack, x_BTM):
    """Float32 logits [B, T, V] of the final hidden states."""
    if self.classifier is not None:
      raise ValueError("a classifier (model.num_labels > 0) has no LM head; use classify")
    x_BTM = self._projection_input(x_BTM)
    logits_BTV = stack.embed.attend(x_BTM) if self.head is None else self.head(x_BTM)
    if self.logit_mult is not None:
      logits_BTV = logits_BTV * self.logit_mult
    if self.output_bias is not None:
      logits_BTV = logits_BTV + self.output_bias[...].astype(jnp.float32)
    logits_BTV = soft_cap(logits_BTV, self.final_softcap)
    if self.real_vocab_size is not None:
      real_V = jnp.arange(logits_BTV.shape[-1]) < self.real_vocab_size
      logits_BTV = jnp.where(real_V, logits_BTV, PADDED_LOGIT)
    return logits_BTV


class Decoder(_WithHead):
  """Decoder-only language model (causal, next-token)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool | str = False, mtp_depth: int = 0):
    """`mtp_depth`: DeepSeek-V3's multi-token prediction modules after the
    stack (train.mtp_depth; `model/mtp.py`), built after everything else so
    that the model's own parameters draw what they draw without them."""
    self.decoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, causal=True, embed=None,
                          rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)
    if mtp_depth:
      rope = rope_from_config(cfg) if POSITIONS[cfg.pos_emb].rotary else None
      self.mtp = nnx.List([MTPModule(cfg, rope=rope, rngs=rngs) for _ in range(mtp_depth)])

  def hidden(self, tokens_BT, segment_ids=None, positions=None):
    """Final hidden states [B, T, M]. On a mesh whose context axis splits
    the rows (n devices), the tokens, positions and segment ids are laid out
    zig-zag first (`model/context_parallel.py`: device i holds chunks i and
    2n-1-i of every row, so each does the same causal work) and the hidden
    states put back in row order at the end."""
    bias_positions = _bias_positions(tokens_BT, positions)
    positions = _default_positions(tokens_BT, positions)
    n = context_parallel.context_size()
    if n > 1:
      lay = lambda x: None if x is None else context_parallel.to_layout(x, n, "zigzag")
      tokens_BT, positions, segment_ids = lay(tokens_BT), lay(positions), lay(segment_ids)
    x_BTM = self.decoder.embed_tokens(tokens_BT, positions)
    x_BTM = self.decoder.run_blocks(x_BTM, bias_positions_BT=bias_positions,
                                    positions_BT=positions, causal=True, segment_ids=segment_ids)
    return context_parallel.from_layout(x_BTM, n, "zigzag") if n > 1 else x_BTM

  def __call__(self, tokens_BT, segment_ids=None, positions=None):
    return self.logits(self.decoder, self.hidden(tokens_BT, segment_ids, positions))

  def mtp_logits(self, hidden_BTM, tokens_BT, segment_ids=None, positions=None) -> list:
    """The multi-token prediction modules' float32 logits, [B, T, V] per
    depth k = 1..D, position i predicting token i+k+1 from `hidden_BTM` (the
    decoder's final hidden states of `tokens_BT`, `hidden`) and the tokens
    i+1..i+k (`model/mtp.py`); the last k positions of depth k read padding."""
    return [self.logits(self.decoder, normed_BTM)
            for normed_BTM in self.mtp_hidden(hidden_BTM, tokens_BT, segment_ids, positions)]

  def mtp_hidden(self, hidden_BTM, tokens_BT, segment_ids=None, positions=None) -> list:
    """The multi-token prediction modules' normed hidden states [B, T, M] per
    depth k = 1..D, what the head turns into `mtp_logits`."""
    bias_positions = _bias_positions(tokens_BT, positions)
    positions = _default_positions(tokens_BT, positions)
    bias = self.decoder.self_bias(bias_positions, bias_positions)
    h_BTM, out = hidden_BTM, []
    for k, module in enumerate(self.mtp, start=1):
      emb_BTM = self.decoder.embed_tokens(mtp_shift(tokens_BT, k), positions)
      h_BTM, normed_BTM = module(h_BTM, emb_BTM, positions_BT=positions,
                                 segment_ids=segment_ids, bias=bias)
      out.append(normed_BTM)
    return out

  def padded_hidden(self, tokens_BT, padding_mask_BT, token_type_ids_BT=None):
    del token_type_ids_BT  # A decoder has no token types.
    return self.hidden(tokens_BT, _padding_segments(padding_mask_BT, tokens_BT.shape))

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    return self.decoder.init_cache(batch, length, dtype)

  def decode_step(self, tokens_BT, positions_BT, cache, blocks=None, valid_BT=None,
                  prefill=False):
    """Logits of `tokens_BT` at `positions_BT` given the cache; new cache.
    `blocks`: `decoder.blocks()`, taken once per generation (`_Stack.decode_step`);
    `valid_BT`: the real tokens of right-padded prompts (None: all); `prefill`:
    the tokens are the prompts, at positions 0..T-1 of an empty cache."""
    x_BTM, cache = self.decoder.decode_step(tokens_BT, positions_BT, cache, blocks=blocks,
                                            valid_BT=valid_BT, prefill=prefill)
    return self.logits(self.decoder, x_BTM), cache


class Encoder(_WithHead):
  """Encoder-only model (bidirectional) with a masked-LM head."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool | str = False):
    self.encoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, causal=False,
                          embed=None, rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)

  def hidden(self, tokens_BT, padding_mask=None, segment_ids=None, positions=None,
             token_type_ids=None):
    bias_positions = _bias_positions(tokens_BT, positions)
    positions = _default_positions(tokens_BT, positions)
    x_BTM = self.encoder.embed_tokens(tokens_BT, positions, token_type_ids)
    if segment_ids is None:
      segment_ids = _padding_segments(padding_mask, tokens_BT.shape)
    return self.encoder.run_blocks(x_BTM, bias_positions_BT=bias_positions,
                                   positions_BT=positions, causal=False, segment_ids=segment_ids)

  def __call__(self, tokens_BT, padding_mask=None, segment_ids=None, positions=None,
               token_type_ids=None):
    """MLM logits; `padding_mask` (True = real) or packed `segment_ids` (0 = pad);
    `token_type_ids` [B, T] (BERT's sentence A/B; zeros when None) with
    `model.type_vocab_size`."""
    return self.logits(self.encoder, self.hidden(tokens_BT, padding_mask, segment_ids,
                                                 positions, token_type_ids))

  def padded_hidden(self, tokens_BT, padding_mask_BT, token_type_ids_BT=None):
    return self.hidden(tokens_BT, padding_mask_BT, token_type_ids=token_type_ids_BT)


class EncoderDecoder(_WithHead):
  """Encoder over the source, causal decoder with cross-attention to it.

  The token embedding is shared by encoder, decoder and (when tied) head.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, remat: bool | str = False):
    self.encoder = _Stack(cfg, num_layers=cfg.num_layers, cross=False, causal=False,
                          embed=None, rngs=rngs, remat=remat)
    self.decoder = _Stack(cfg, num_layers=cfg.num_decoder_layers, cross=True, causal=True,
                          embed=self.encoder.embed, rngs=rngs, remat=remat)
    self._init_head(cfg, rngs)

  def encode(self, src_BS, src_padding_mask=None):
    positions = _default_positions(src_BS, None)
    x_BSM = self.encoder.embed_tokens(src_BS, positions)
    return self.encoder.run_blocks(x_BSM, bias_positions_BT=_bias_positions(src_BS, None),
                                   positions_BT=positions, causal=False,
                                   segment_ids=_padding_segments(src_padding_mask, src_BS.shape))

  def _cross_segments(self, tgt_BT, src_padding_mask):
    if src_padding_mask is None:
      return None
    return (jnp.ones(tgt_BT.shape, jnp.int32), src_padding_mask.astype(jnp.int32))

  def decode_hidden(self, tgt_BT, encoded_BSM, src_padding_mask=None):
    """The decoder's final hidden states [B, T, M] of `tgt_BT` reading `encoded_BSM`."""
    positions = _default_positions(tgt_BT, None)
    x_BTM = self.decoder.embed_tokens(tgt_BT, positions)
    return self.decoder.run_blocks(
        x_BTM, bias_positions_BT=_bias_positions(tgt_BT, None), positions_BT=positions,
        causal=True, context_BSM=encoded_BSM,
        cross_segment_ids=self._cross_segments(tgt_BT, src_padding_mask))

  def decode(self, tgt_BT, encoded_BSM, src_padding_mask=None):
    return self.logits(self.decoder, self.decode_hidden(tgt_BT, encoded_BSM, src_padding_mask))

  def __call__(self, src_BS, tgt_BT, src_padding_mask=None):
    return self.decode(tgt_BT, self.encode(src_BS, src_padding_mask), src_padding_mask)

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    return self.decoder.init_cache(batch, length, dtype)

  def cross_cache(self, encoded_BSM):
    """The decoder's cross-attention keys and values of `encoded_BSM`, per
    layer: computed once per generation, then read at every step."""
    return self.decoder.cross_kv(encoded_BSM)

  def decode_step(self, tokens_BT, positions_BT, cache, cross_kv, src_padding_mask=None,
                  blocks=None):
    """Logits of `tokens_BT` at `positions_BT` given the self-attention cache
    and `cross_kv = cross_cache(encoded)`; new cache. `blocks`: as
    `Decoder.decode_step`."""
    x_BTM, cache = self.decoder.decode_step(
        tokens_BT, positions_BT, cache, cross_kv=cross_kv,
        cross_segment_ids=self._cross_segments(tokens_BT, src_padding_mask), blocks=blocks)
    return self.logits(self.decoder, x_BTM), cache
