"""Mixture of experts: step 5's position-wise MLP split into experts, each
token routed to a few of them (`model.num_experts` > 0).

The lesson's MLP holds much of a model's stored knowledge and two-thirds of
a layer's parameters. A mixture-of-experts layer keeps E such MLPs
("experts", each of hidden width `model.moe_d_ff`, with the block's
`model.mlp` activation) and a router, a d x E matrix: for each token the
router's softmax over the experts picks the k best (`model.experts_per_token`)
and the layer returns their outputs weighted by the router's probabilities
(`ROUTERS`: renormalised over the k, as Mixtral, or not). A token then costs
k experts' FLOPs while the layer stores E experts' parameters: more
knowledge at the same compute (Switch, Mixtral, Qwen3-MoE, DeepSeek).
`model.num_shared_experts` adds always-on experts (DeepSeek; Qwen2-MoE's
shared expert without its gate), one MLP of that many times the width.

Dropless: every (token, expert) assignment is computed. The N x k
assignments are sorted by expert and run through grouped matmuls
(`jax.lax.ragged_dot`: one [rows of expert e] x [d, f] product per expert,
over contiguous groups), then scattered back and summed with their weights.
No capacity, no token dropped, so the layer is the same function whatever
the batch.

What researchers watch, per layer (`MoEStats`): the load-balancing loss of
Switch and Mixtral, E sum_e (tokens routed to e / tokens) P_e with P_e the
mean router probability of e (its minimum, k, when the load is uniform),
the router z-loss of ST-MoE, the mean over tokens of (log sum_e exp
logit_e)^2, and the load, the most assignments any expert got over the mean.
Training adds `train.moe_aux_loss` x the first and `train.router_z_loss` x
the second, averaged over the MoE layers.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import Dense, dense_init, param
from model.mlp import MLP, MLPS
from model.registry import Registry


@dataclasses.dataclass(frozen=True)
class Router:
  """A `model.moe_router` choice: softmax over the experts, the top k, and
  whether their weights are renormalised to sum to 1."""
  name: str
  doc: str
  normalize: bool
  reads: tuple[str, ...] = ()


ROUTERS = Registry("model.moe_router", [
    Router("softmax_topk_norm", "softmax over the experts, the top k renormalised to sum 1 "
           "(Mixtral; Qwen3-MoE with norm_topk_prob)", True),
    Router("softmax_topk", "softmax over the experts, the top k weighted by their "
           "probabilities (Switch, Qwen2-MoE; Qwen3-MoE without norm_topk_prob)", False),
])


class MoEStats(NamedTuple):
  """One layer's router statistics (float32 scalars; see the module docstring)."""
  aux_loss: jax.Array
  z_loss: jax.Array
  load: jax.Array


def route(logits_NE, k: int, normalize: bool):
  """(weights [N, k] float32, experts [N, k] int32, probabilities [N, E]) of
  the router's logits: softmax, the top k, renormalised with `normalize`."""
  probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  weights_NK, experts_NK = jax.lax.top_k(probs_NE, k)
  if normalize:
    weights_NK = weights_NK / weights_NK.sum(axis=-1, keepdims=True)
  return weights_NK, experts_NK.astype(jnp.int32), probs_NE


def router_stats(logits_NE, probs_NE, counts_E) -> MoEStats:
  """The load-balancing loss, router z-loss and load of one layer's routing."""
  E = probs_NE.shape[-1]
  N = probs_NE.shape[0]
  fraction_E = counts_E.astype(jnp.float32) / N
  aux = E * jnp.sum(fraction_E * probs_NE.mean(axis=0))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)))
  load = counts_E.max().astype(jnp.float32) / jnp.maximum(counts_E.mean(), 1e-9)
  return MoEStats(aux, z, load)


class Experts(nnx.Module):
  """E weights of one shape, [E, *in, *out], applied per group of rows."""

  def __init__(self, num_experts: int, in_features: int, out_features: int,
               axes: tuple[str, str], *, cfg, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.kernel = param(rngs, dense_init(cfg.init_std), (num_experts, in_features, out_features),
                        ("expert", *axes), cfg.param_dtype)

  def __call__(self, x_RI, group_sizes_E):
    """Rows [R, in] sorted by expert, `group_sizes_E` rows each -> [R, out]."""
    return jax.lax.ragged_dot(x_RI.astype(self.dtype), self.kernel[...].astype(self.dtype),
                              group_sizes_E, preferred_element_type=jnp.float32)


class MoE(nnx.Module):
  """The mixture-of-experts MLP of a block; returns (output, `MoEStats`)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f, E = cfg.d_model, cfg.moe_d_ff, cfg.num_experts
    kind = MLPS[cfg.mlp]
    self.activation = kind.activation
    self.k = cfg.experts_per_token
    self.normalize = ROUTERS[cfg.moe_router].normalize
    self.dtype = cfg.dtype
    self.router = Dense(d, (E,), ("embed", None), use_bias=False, cfg=cfg, rngs=rngs,
                        dtype=jnp.float32)
    self.up = Experts(E, d, f, ("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.gate = Experts(E, d, f, ("embed", "mlp"), cfg=cfg, rngs=rngs) if kind.gated else None
    self.down = Experts(E, f, d, ("mlp", "embed"), cfg=cfg, rngs=rngs)
    self.shared = (MLP(dataclasses.replace(cfg, d_ff=cfg.num_shared_experts * f), rngs=rngs)
                   if cfg.num_shared_experts else None)

  def __call__(self, x_BTM):
    B, T, M = x_BTM.shape
    x_NM = x_BTM.reshape(B * T, M)
    logits_NE = self.router(x_NM)
    weights_NK, experts_NK, probs_NE = route(logits_NE, self.k, self.normalize)
    E = probs_NE.shape[-1]

    # Dropless grouped matmuls: the N k assignments sorted by expert.
    experts_A = experts_NK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    counts_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
    rows_AM = x_NM[order_A // self.k]
    if self.gate is not None:
      h_AF = self.activation(self.gate(rows_AM, counts_E)) * self.up(rows_AM, counts_E)
    else:
      h_AF = self.activation(self.up(rows_AM, counts_E))
    out_AM = self.down(h_AF.astype(self.dtype), counts_E)
    out_NKM = jnp.zeros_like(out_AM).at[order_A].set(out_AM).reshape(B * T, self.k, M)
    y_NM = jnp.einsum("nkm,nk->nm", out_NKM, weights_NK)
    y_BTM = y_NM.reshape(B, T, M).astype(self.dtype)
    if self.shared is not None:
      y_BTM = y_BTM + self.shared(x_BTM)
    return y_BTM, router_stats(logits_NE, probs_NE, counts_E)
