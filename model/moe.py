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
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

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


def _sums(logits_NE, probs_NE, counts_E):
  """What the statistics are made of, as sums over tokens (so that devices
  add them up): assignments per expert [E], router probabilities per expert
  [E], (log Z)^2 and the token count."""
  lse_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
  return (counts_E.astype(jnp.float32), probs_NE.sum(axis=0), jnp.sum(jnp.square(lse_N)),
          jnp.float32(probs_NE.shape[0]))


def stats_of_sums(counts_E, probs_E, z_sum, tokens) -> MoEStats:
  """The load-balancing loss, router z-loss and load (`MoEStats`) from
  `_sums` (of one device, or added over devices)."""
  E = counts_E.shape[0]
  aux = E * jnp.sum((counts_E / tokens) * (probs_E / tokens))
  load = counts_E.max() / jnp.maximum(counts_E.mean(), 1e-9)
  return MoEStats(aux, z_sum / tokens, load)


def moe_tokens(x_NM, router_ME, up_EMF, gate_EMF, down_EFM, *, k: int, normalize: bool,
               activation, dtype):
  """The experts' output for tokens [N, M] (float32) and their statistics'
  `_sums`: route, sort the N k assignments by expert, run each expert's group
  through its matrices (`jax.lax.ragged_dot`), scatter back and weigh."""
  N, M = x_NM.shape
  logits_NE = jnp.dot(x_NM.astype(jnp.float32), router_ME.astype(jnp.float32))
  weights_NK, experts_NK, probs_NE = route(logits_NE, k, normalize)
  E = probs_NE.shape[-1]
  experts_A = experts_NK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)
  counts_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
  rows_AM = x_NM[order_A // k].astype(dtype)
  grouped = lambda rows, w: jax.lax.ragged_dot(rows, w.astype(dtype), counts_E,
                                               preferred_element_type=jnp.float32)
  if gate_EMF is not None:
    h_AF = activation(grouped(rows_AM, gate_EMF)) * grouped(rows_AM, up_EMF)
  else:
    h_AF = activation(grouped(rows_AM, up_EMF))
  out_AM = grouped(h_AF.astype(dtype), down_EFM)
  out_NKM = jnp.zeros_like(out_AM).at[order_A].set(out_AM).reshape(N, k, M)
  return jnp.einsum("nkm,nk->nm", out_NKM, weights_NK), _sums(logits_NE, probs_NE, counts_E)


class Experts(nnx.Module):
  """E weights of one shape, [E, in, out] (logical axes expert, `axes`)."""

  def __init__(self, num_experts: int, in_features: int, out_features: int,
               axes: tuple[str, str], *, cfg, rngs: nnx.Rngs):
    self.kernel = param(rngs, dense_init(cfg.init_std), (num_experts, in_features, out_features),
                        ("expert", *axes), cfg.param_dtype)


# The mesh axes the default rules (configs/base.py mesh.rules) give the
# router [M, E], the up and gate [E, M, F] and the down [E, F, M] weights.
_WEIGHT_AXES = (("fsdp", None), (None, "fsdp", "tensor"), (None, "fsdp", "tensor"),
                (None, "tensor", "fsdp"))


def _weight_spec(shape, names, mesh) -> P:
  """`names` as a PartitionSpec, an axis kept only where the mesh has it and
  it divides the dimension (else that dimension is whole on every device)."""
  return P(*(n if n in mesh.axis_names and mesh.shape[n] > 1 and dim % mesh.shape[n] == 0
             else None for n, dim in zip(names, shape)))


def _gather(w, spec: P):
  """The whole weight on every device from its shard (`spec`)."""
  for axis, name in enumerate(spec):
    if name is not None:
      w = jax.lax.all_gather(w, name, axis=axis, tiled=True)
  return w


class MoE(nnx.Module):
  """The mixture-of-experts MLP of a block; returns (output, `MoEStats`).

  On a mesh each device routes and computes its own tokens (`jax.shard_map`
  over the batch axes, and `context` where the rows are split), with every
  expert's weights gathered to it from their fsdp and tensor shards
  (`_gather`; their gradients leave by reduce-scatter), so no token moves
  and the sort is local; the statistics' sums are added over the devices,
  so they are the whole batch's. Expert parallelism (each device holding
  some experts, tokens sent to them by all-to-all) is not built yet."""

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
    weights = (self.router.kernel[...], self.up.kernel[...],
               None if self.gate is None else self.gate.kernel[...], self.down.kernel[...])
    tokens = functools.partial(moe_tokens, k=self.k, normalize=self.normalize,
                               activation=self.activation, dtype=self.dtype)

    def local(x, *w):
      b, t, _ = x.shape
      y, sums = tokens(x.reshape(b * t, M), *w)
      return y.reshape(b, t, M), sums

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      y_BTM, sums = local(x_BTM, *weights)
    else:
      rows = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
      seq = "context" if "context" in mesh.axis_names and mesh.shape["context"] > 1 else None
      spec = P(rows, seq, None)
      axes = rows + ((seq,) if seq else ())
      # The weights arrive in their shards (embed over fsdp, the hidden width
      # over tensor, as the default rules place them) and are gathered here,
      # so that their gradients leave by reduce-scatter, as a dense MLP's.
      w_specs = [None if w is None else _weight_spec(w.shape, names, mesh)
                 for w, names in zip(weights, _WEIGHT_AXES)]

      def on_device(x, *w):
        w = [None if a is None else _gather(a, sp) for a, sp in zip(w, w_specs)]
        y, sums = local(x, *w)
        return y, jax.tree.map(lambda s: jax.lax.psum(s, axes), sums)

      # check_vma=False: the gathered weights make every tensor device compute the
      # same values, which the specs say and the type check cannot infer.
      y_BTM, sums = jax.shard_map(on_device, mesh=mesh, in_specs=(spec, *w_specs),
                                  out_specs=(spec, P()), check_vma=False)(x_BTM, *weights)
    y_BTM = y_BTM.astype(self.dtype)
    if self.shared is not None:
      y_BTM = y_BTM + self.shared(x_BTM)
    return y_BTM, stats_of_sums(*sums)
