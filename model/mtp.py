"""DeepSeek-V3's multi-token prediction (MTP, arXiv:2412.19437 §2.2).

`train.mtp_depth` = D modules after a decoder, run one after the other.
Module k (1..D) takes the embedding of token i+k (the decoder's own
`embed_tokens`, shared) and the previous depth's hidden state h^{k-1}_i
(h^0: the decoder's final hidden state), normalises each with the model's
norm (`enorm`, `hnorm`; RMSNorm in DeepSeek's configs), projects their
concatenation [enorm(emb); hnorm(h)], in that order, with M_k (`eh_proj`,
2d -> d, no bias), runs one transformer block of the kind of the decoder's
last layer (its attention, MLA where the model has it, its sliding window,
its experts where it has them; a linear_attention last layer's module
attends in full, as Qwen3-Next's MTP layer does; causal, over the same
positions and segments as the decoder) and a final norm (pre-norm models;
DeepSeek's `shared_head.norm`), giving h^k_i; the shared output head of
h^k_i predicts token i+k+1. This is DeepSeek-V3's module as its files
store it (`model.layers.{L}.*`, hf/deepseek.py). Positions whose token
i+k+1 lies past the row or in another segment are not scored (`shift`,
`depth_weights`). An MoE block's router statistics are not among the
router losses, and its selection bias is not moved by
`train.moe_bias_update_rate` (the decoder's layers' are).

The modules' parameters count in `model/accounting.py` (`mtp_module_params`); the
loss and its report are training/objectives.py's `next_token_mtp_loss`. At generation
the modules draft tokens for self-speculative decoding (`decode`, each
module's block against its own KV cache; `model/generate.py`).
"""
import jax.numpy as jnp
from flax import nnx

from model.blocks import Block
from model.layers import Dense
from model.norms import make_norm


class MTPModule(nnx.Module):
  """One depth: norms of the embedding and of h, M_k, a block, a final norm."""

  def __init__(self, cfg, *, rope, rngs: nnx.Rngs):
    last = cfg.num_layers - 1
    self.enorm = make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
    self.hnorm = make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
    # M_k [2, d, d]: the concatenation [enorm(emb); hnorm(h)] contracted as one 2d axis.
    self.eh_proj = Dense((2, cfg.d_model), (cfg.d_model,), (None, "embed", None),
                         use_bias=False, cfg=cfg, rngs=rngs, in_axes=2)
    self.block = Block(cfg, cross=False, rope=rope, rngs=rngs, window=cfg.layer_window(last),
                       moe=cfg.layer_is_moe(last))
    self.final_norm = (make_norm(cfg.d_model, cfg=cfg, rngs=rngs)
                       if cfg.norm_position == "pre" else None)

  def _join(self, h_BTM, emb_BTM):
    """M_k [enorm(emb); hnorm(h)] [B, T, M]."""
    return self.eh_proj(jnp.stack([self.enorm(emb_BTM), self.hnorm(h_BTM)], axis=-2))

  def __call__(self, h_BTM, emb_BTM, *, positions_BT, segment_ids=None, bias=None):
    """(h^k [B, T, M] before the final norm, h^k after it: what the head reads)."""
    x_BTM, _ = self.block(self._join(h_BTM, emb_BTM), positions_BT=positions_BT, causal=True,
                          segment_ids=segment_ids, bias=bias)
    return x_BTM, (self.final_norm(x_BTM) if self.final_norm is not None else x_BTM)

  def decode(self, h_BTM, emb_BTM, *, positions_BT, cache, bias=None):
    """`__call__` at `positions_BT` against this module's block's KV cache
    (`Block.decode`): (h^k, h^k after the final norm, the new cache)."""
    x_BTM, cache = self.block.decode(self._join(h_BTM, emb_BTM), positions_BT=positions_BT,
                                     cache=cache, bias=bias)
    return x_BTM, (self.final_norm(x_BTM) if self.final_norm is not None else x_BTM), cache


def shift(x_BT, k: int, fill=0):
  """x moved k positions left along T (x'[:, i] = x[:, i + k]), the last k
  positions `fill`."""
  if k == 0:
    return x_BT
  return jnp.concatenate([x_BT[:, k:], jnp.full((x_BT.shape[0], k), fill, x_BT.dtype)], axis=1)


def depth_weights(loss_mask_BT, segment_ids_BT, k: int):
  """The weights of depth k's targets (token i+k+1 at position i): the main
  loss mask at i and at i+k, and i+k in i's segment (packed rows); 0 for the
  last k positions."""
  w_BT = loss_mask_BT * shift(loss_mask_BT, k)
  if segment_ids_BT is not None:
    w_BT = w_BT * (shift(segment_ids_BT, k, -1) == segment_ids_BT).astype(w_BT.dtype)
  return w_BT
