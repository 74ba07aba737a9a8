"""Step 5 of the lesson: the transformer block.

Pre-norm: x = x + Sublayer(Norm(x)) (an unnormalised residual stream).
Post-norm (the original paper): x = Norm(x + Sublayer(x)).
Depth-μP (model.mup_base_depth): x = x + sqrt(base depth / num_layers) Sublayer(Norm(x)).
A block is self-attention (the `model.attention` entry's: multi-head or
DeepSeek's latent attention; in a `linear_attention` layer Gated DeltaNet),
then cross-attention (decoder of an
encoder-decoder only; multi-head), then the MLP (or a mixture of experts,
`model/moe.py`), each wrapped that way.
"""
import jax
from flax import nnx

from model.attention import Attention
from model.attention_kinds import ATTENTIONS
from model.gated_deltanet import GatedDeltaNet
from model.mla import LatentAttention
from model.mlp import MLP
from model.moe import MoE
from model.norms import make_norm


class Block(nnx.Module):

  def __init__(self, cfg, *, cross: bool, rope, rngs: nnx.Rngs, window: int | None = None,
               moe: bool = False, linear: bool = False):
    """`window`: this layer's self-attention sliding window (None: none);
    `moe`: its MLP is a mixture of experts; `linear`: its token mixer is
    Gated DeltaNet's linear attention (`model/gated_deltanet.py`) instead."""
    self.pre_norm = cfg.norm_position == "pre"
    self.branch_mult = cfg.branch_mult  # depth-μP: sqrt(base depth / num_layers), or None
    self.attn = (GatedDeltaNet(cfg, rngs=rngs) if linear else
                 ATTENTIONS[cfg.attention].module(cfg, rope=rope, window=window, rngs=rngs))
    self.norm_attn = make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
    self.cross_attn = Attention(cfg, rngs=rngs) if cross else None
    self.norm_cross = make_norm(cfg.d_model, cfg=cfg, rngs=rngs) if cross else None
    self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
    self.norm_mlp = make_norm(cfg.d_model, cfg=cfg, rngs=rngs)

  def _residual(self, x, norm, sublayer, scope: str):
    """The sublayer wrapped by the norm and the residual; its ops run under
    the named scope `scope` ("attention", "mlp"), which names them in the
    compiled program's metadata (`aot/roofline.py` groups kernels by it)."""
    h = norm(x) if self.pre_norm else x
    with jax.named_scope(scope):
      branch = sublayer(h)
    if self.pre_norm:
      return x + (branch if self.branch_mult is None else branch * self.branch_mult)
    return norm(x + branch)

  def _cross_and_mlp(self, x, context_BSM, cross_segment_ids, context_kv=None,
                     segment_ids=None):
    """(x after cross-attention and the MLP, the experts' `MoEStats` or None);
    `segment_ids` (0: padding) keep padding tokens away from the experts."""
    if self.cross_attn is not None:
      x = self._residual(x, self.norm_cross, lambda h: self.cross_attn(
          h, context_BSM=context_BSM, context_kv=context_kv, segment_ids=cross_segment_ids),
                         "attention")
    if not isinstance(self.mlp, MoE):
      return self._residual(x, self.norm_mlp, self.mlp, "mlp"), None
    stats = []

    def experts(h):
      out, layer_stats = self.mlp(h, real_BT=None if segment_ids is None else segment_ids != 0)
      stats.append(layer_stats)
      return out

    return self._residual(x, self.norm_mlp, experts, "mlp"), stats[0]

  def __call__(self, x_BTM, *, positions_BT, causal, segment_ids=None, context_BSM=None,
               cross_segment_ids=None, bias=None):
    """(the block's output, its experts' `MoEStats` or None for a dense MLP);
    `bias`: the stack's relative position bias for self-attention, or None."""
    x_BTM = self._residual(x_BTM, self.norm_attn, lambda h: self.attn(
        h, positions_BT=positions_BT, causal=causal, segment_ids=segment_ids, bias=bias),
                           "attention")
    return self._cross_and_mlp(x_BTM, context_BSM, cross_segment_ids, segment_ids=segment_ids)

  def attention_weights(self, x_BTM, *, positions_BT, causal, bias=None):
    """This block's self-attention weights [B, h, T, T] for input x."""
    h = self.norm_attn(x_BTM) if self.pre_norm else x_BTM
    return self.attn.weights(h, positions_BT=positions_BT, causal=causal, bias=bias)

  def cross_kv(self, context_BSM):
    """This block's cross-attention keys and values of the encoder output."""
    return self.cross_attn.project_kv(context_BSM)

  def decode(self, x_BTM, *, positions_BT, cache, context_kv=None, cross_segment_ids=None,
             bias=None, layer=None, valid_BT=None, prefill=False):
    """One generation step against this block's KV cache (and the encoder
    output's cross-attention `context_kv`); returns (x, cache). With `layer`,
    `cache` is the whole stack's, stacked (`Attention.decode`). `valid_BT`:
    the real tokens of right-padded prompts, which alone move a linear
    layer's state (a KV cache's padding slots are overwritten later).
    `prefill`: the tokens are the prompt, every row's first T, which latent
    attention runs in its expanded form (`LatentAttention.prefill`)."""
    new_cache = {}
    extra = ({"valid_BT": valid_BT} if isinstance(self.attn, GatedDeltaNet)
             else {"prefill": prefill} if isinstance(self.attn, LatentAttention) else {})

    def self_attention(h):
      out, new_cache["kv"] = self.attn.decode(h, positions_BT, cache, bias=bias, layer=layer,
                                              **extra)
      return out

    x_BTM = self._residual(x_BTM, self.norm_attn, self_attention, "attention")
    return (self._cross_and_mlp(x_BTM, None, cross_segment_ids, context_kv)[0],
            new_cache["kv"])
