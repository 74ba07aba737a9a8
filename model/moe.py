"""Mixture of experts: step 5's position-wise MLP split into experts, each
token routed to a few of them (`model.num_experts` > 0).

The lesson's MLP holds much of a model's stored knowledge and two-thirds of
a layer's parameters. A mixture-of-experts layer keeps E such MLPs
("experts", each of hidden width `model.moe_d_ff`, with the block's
`model.mlp` activation) and a router, a d x E matrix: for each token the
router's softmax over the experts picks the k best (`model.experts_per_token`)
and the layer returns their outputs weighted by the router's probabilities
(`ROUTERS`: renormalised over the k, as Mixtral, or not; or DeepSeek-V3's
sigmoid affinities, group-limited and scaled: `route_sigmoid`). A token then costs
k experts' FLOPs while the layer stores E experts' parameters: more
knowledge at the same compute (Switch, Mixtral, Qwen3-MoE, DeepSeek).
`model.num_shared_experts` adds always-on experts (DeepSeek; Qwen2-MoE's
shared expert), one MLP of that many times the width; with
`model.moe_shared_expert_gate` its output is scaled per token by
sigmoid(x W_g), W_g [d, 1] (Qwen2-MoE's and Qwen3-Next's shared_expert_gate).

Dropless by default: every (token, expert) assignment is computed. The
N x k assignments are sorted by expert and run through grouped matmuls
(`jax.lax.ragged_dot`: one [rows of expert e] x [d, f] product per expert,
over contiguous groups), then scattered back and summed with their weights.
No token is dropped, so the layer is the same function whatever the batch.
With `model.moe_capacity_factor` c > 0 each expert takes at most
ceil(c N k / E) of a device's N tokens (Switch, GShard); an assignment past
that is dropped (its expert's output counts as zero; the token keeps the
residual and its other experts), earlier tokens first.

Expert parallelism (`mesh.expert` = X > 1, `expert_parallel`): each device
of the expert axis holds E / X of the experts. A device routes its own
tokens, sends each sorted row to the device that holds its expert (an
all-to-all), computes its experts on the rows it received, and sends the
outputs back (the same all-to-all reversed).

What researchers watch, per layer (`MoEStats`): the load-balancing loss of
Switch and Mixtral, E sum_e (tokens routed to e / tokens) P_e with P_e the
mean router probability of e (its minimum, k, when the load is uniform),
the router z-loss of ST-MoE, the mean over tokens of (log sum_e exp
logit_e)^2, the load, the most assignments any expert got over the mean,
and the fraction of assignments dropped (0 when dropless), all over the
real tokens: padding tokens (segment id 0) reach no expert, take no
capacity and count in no statistic. Training adds
`train.moe_aux_loss` x the first and `train.router_z_loss` x the second,
averaged over the MoE layers, and `train.moe_seq_aux_loss` x DeepSeek-V3's
sequence-wise balance loss, the same product per sequence (`_seq_sums`).

DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3
section 2.1.2): a deepseek-router layer holds a per-expert bias `score_bias`
(an `ExpertBias`, not a parameter) that is added to the affinities for the
choice of experts only. The optimizer never moves it; the train step does,
by `train.moe_bias_update_rate` x sign(mean load - the expert's load) after
each step, from the layer's `MoEStats.counts` (training/steps.py).
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.errors import UserError
from model.attention import compile_device
from model.layers import Dense, batch_axes, dense_init, param
from model.mlp import MLP, MLPS
from model.registry import Registry


@dataclasses.dataclass(frozen=True)
class Router:
  """A `model.moe_router` choice: softmax over the experts, the top k, and
  whether their weights are renormalised to sum to 1; with `sigmoid`,
  DeepSeek-V3's group-limited sigmoid routing instead (`route_sigmoid`)."""
  name: str
  doc: str
  normalize: bool
  reads: tuple[str, ...] = ()
  sigmoid: bool = False


ROUTERS = Registry("model.moe_router", [
    Router("softmax_topk_norm", "softmax over the experts, the top k renormalised to sum 1 "
           "(Mixtral; Qwen3-MoE with norm_topk_prob)", True),
    Router("softmax_topk", "softmax over the experts, the top k weighted by their "
           "probabilities (Switch, Qwen2-MoE; Qwen3-MoE without norm_topk_prob)", False),
    Router("deepseek", "sigmoid affinities, the top k of the best moe_topk_group of "
           "moe_n_group expert groups, renormalised to sum 1 and scaled by "
           "moe_routed_scaling_factor (DeepSeek-V3)", True,
           reads=("moe_n_group", "moe_topk_group", "moe_routed_scaling_factor",
                  "moe_group_mask_fill"), sigmoid=True),
])


class MoEStats(NamedTuple):
  """One layer's router statistics (float32; see the module docstring): four
  scalars, `share`, each expert's fraction of the assignments [E], `counts`,
  the assignments routed to each expert [E] (kept or dropped; what the
  selection bias balances, added over micro-batches), and `seq_aux_loss`,
  DeepSeek-V3's sequence-wise balance loss (`_seq_sums`)."""
  aux_loss: jax.Array
  z_loss: jax.Array
  load: jax.Array
  dropped: jax.Array
  share: jax.Array
  counts: jax.Array
  seq_aux_loss: jax.Array


class ExpertBias(nnx.Variable):
  """A deepseek-router layer's per-expert selection bias [E] (`score_bias`,
  float32, zeros at first): part of the model's state, so checkpoints save
  and restore it, but not an `nnx.Param`: the optimizer leaves it alone
  (training/optim.py) and the train step moves it (training/steps.py)."""


def has_score_bias(cfg) -> bool:
  """Whether a model section's MoE layers hold an `ExpertBias` (a mixture of
  experts under a sigmoid router: `model.moe_router=deepseek`)."""
  return bool(cfg.num_experts) and ROUTERS[cfg.moe_router].sigmoid


def route(logits_NE, k: int, normalize: bool):
  """(weights [N, k] float32, experts [N, k] int32, probabilities [N, E]) of
  the router's logits: softmax, the top k, renormalised with `normalize`."""
  probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  weights_NK, experts_NK = jax.lax.top_k(probs_NE, k)
  if normalize:
    weights_NK = weights_NK / weights_NK.sum(axis=-1, keepdims=True)
  return weights_NK, experts_NK.astype(jnp.int32), probs_NE


# `model.moe_group_mask_fill`: the biased score an ineligible group's experts
# get in the top k. "-inf" never picks them (DeepSeek's reference inference
# code, transformers 5.24's DeepseekV3TopkRouter, vLLM's grouped_topk since
# its PR 13474); "0" picks one over an eligible expert whose biased score is
# below 0 (the earlier fill: DeepSeek's Hub modeling_deepseek.py before
# V3-0324, vLLM before that PR, earlier transformers).
GROUP_MASK_FILLS = {"-inf": -jnp.inf, "0": 0.0}


def route_sigmoid(logits_NE, k: int, *, n_group: int, topk_group: int, scale: float,
                  bias_E=None, mask_fill: str = "-inf"):
  """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter), as `route`
  returns it: sigmoid affinities s [N, E]; the experts in `n_group` groups of
  E / n_group, a group scored by the sum of its two best s + `bias_E`, only
  the best `topk_group` groups eligible; the top k of s + `bias_E` with the
  other groups' experts set to `mask_fill` (`GROUP_MASK_FILLS`: "-inf" only
  ever chooses eligible experts, "0" also ineligible ones over eligible ones
  scoring below 0); their weights s (the bias selects, it does not weigh) renormalised to
  sum 1 and times `scale`. The probabilities returned are s / sum s, each
  token's affinities normalised (what the balance statistics read)."""
  scores_NE = jax.nn.sigmoid(logits_NE.astype(jnp.float32))
  choice_NE = scores_NE if bias_E is None else scores_NE + bias_E.astype(jnp.float32)
  N, E = scores_NE.shape
  if n_group > 1:
    group_NG = jax.lax.top_k(choice_NE.reshape(N, n_group, E // n_group), 2)[0].sum(-1)
    best_NG = jax.lax.top_k(group_NG, topk_group)[1]
    eligible_NG = jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], best_NG].set(True)
    choice_NE = jnp.where(jnp.repeat(eligible_NG, E // n_group, axis=1), choice_NE,
                          GROUP_MASK_FILLS[mask_fill])
  experts_NK = jax.lax.top_k(choice_NE, k)[1]
  weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=1)
  weights_NK = weights_NK / (weights_NK.sum(axis=-1, keepdims=True) + 1e-20) * scale
  probs_NE = scores_NE / scores_NE.sum(axis=-1, keepdims=True)
  return weights_NK, experts_NK.astype(jnp.int32), probs_NE


def routing(cfg):
  """The routing function of a model config's `model.moe_router`: logits
  [N, E] -> (weights [N, k], experts [N, k], probabilities [N, E])."""
  entry = ROUTERS[cfg.moe_router]
  if entry.sigmoid:
    return functools.partial(route_sigmoid, k=cfg.experts_per_token, n_group=cfg.moe_n_group,
                             topk_group=cfg.moe_topk_group,
                             scale=cfg.moe_routed_scaling_factor,
                             mask_fill=cfg.moe_group_mask_fill)
  return functools.partial(route, k=cfg.experts_per_token, normalize=entry.normalize)


def _sums(logits_NE, probs_NE, counts_E, kept_E, real_N):
  """What the statistics are made of, as sums over the real tokens (`real_N`
  1, padding 0; so that devices add them up): assignments per expert [E],
  router probabilities per expert [E], (log Z)^2, the token count and the
  assignments dropped."""
  lse_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
  return (counts_E.astype(jnp.float32), (probs_NE * real_N[:, None]).sum(axis=0),
          jnp.sum(jnp.square(lse_N) * real_N), real_N.sum(),
          jnp.sum(counts_E - kept_E).astype(jnp.float32))


def _seq_parts(experts_NK, probs_NE, real_N, rows: int):
  """What `_seq_sums` is made of, per sequence of `rows` sequences of N / rows
  tokens: tokens routed to each expert [rows, E], the probabilities' sums
  [rows, E] and the real tokens [rows] (sums over the tokens, so that the
  devices holding parts of a sequence add them up)."""
  (N, _), E = experts_NK.shape, probs_NE.shape[-1]
  real_N = real_N.astype(jnp.float32)
  chosen_NE = jax.nn.one_hot(experts_NK, E, dtype=jnp.float32).sum(axis=1) * real_N[:, None]
  return (chosen_NE.reshape(rows, N // rows, E).sum(axis=1),
          (probs_NE * real_N[:, None]).reshape(rows, N // rows, E).sum(axis=1),
          real_N.reshape(rows, N // rows).sum(axis=1))


def _seq_sums(counts_RE, probs_RE, tokens_R, k: int):
  """(sum over the sequences of DeepSeek-V3's sequence-wise balance loss,
  the sequences) from `_seq_parts`: for a sequence of T real tokens,
  sum_e f_e P_e with f_e = E / (k T) x its tokens routed to e (1 when
  uniform) and P_e its mean probability of e (for the deepseek router the
  affinities normalised per token, s_e / sum_j s_j): 1 when balanced. A
  sequence of padding only counts in neither."""
  E = counts_RE.shape[-1]
  loss_R = E / k * jnp.sum(counts_RE * probs_RE, axis=-1) / jnp.maximum(tokens_R, 1.0) ** 2
  return loss_R.sum(), (tokens_R > 0).sum().astype(jnp.float32)


def stats_of_sums(counts_E, probs_E, z_sum, tokens, dropped, seq_sum=0.0,
                  sequences=0.0) -> MoEStats:
  """The load-balancing loss, router z-loss, load, dropped fraction and
  sequence-wise balance loss (`MoEStats`) from `_sums` and `_seq_sums` (of
  one device, or added over devices)."""
  E = counts_E.shape[0]
  tokens = jnp.maximum(tokens, 1.0)  # a batch of padding only
  aux = E * jnp.sum((counts_E / tokens) * (probs_E / tokens))
  load = counts_E.max() / jnp.maximum(counts_E.mean(), 1e-9)
  assignments = jnp.maximum(counts_E.sum(), 1.0)
  return MoEStats(aux, z_sum / tokens, load, dropped / assignments, counts_E / assignments,
                  counts_E, seq_sum / jnp.maximum(sequences, 1.0))


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int | None:
  """The most assignments an expert takes from `tokens` tokens of one device:
  ceil(factor x tokens x k / E); None when dropless (factor 0)."""
  return math.ceil(factor * tokens * k / num_experts) if factor else None


def sort_by_expert(experts_A, num_experts: int, cap: int | None, real_A=None):
  """(order [A], kept [E], routed [E]): the assignments' order sorted by
  expert (stable, so earlier tokens first), how many each expert keeps and
  how many were routed to it. Padding assignments (`real_A` False) go to the
  end and count in neither; with a capacity `cap`, those past it follow the
  kept rows."""
  E = num_experts
  if real_A is not None:
    experts_A = jnp.where(real_A, experts_A, E)  # padding: a bucket past the experts
  order_A = jnp.argsort(experts_A, stable=True)
  counts_E = jnp.bincount(experts_A, length=E + 1)[:E].astype(jnp.int32)
  if cap is None:
    return order_A, counts_E, counts_E
  sorted_A = experts_A[order_A]
  starts = jnp.cumsum(counts_E) - counts_E
  rank_A = jnp.arange(experts_A.shape[0]) - jnp.append(starts, 0)[sorted_A]
  kept_A = (rank_A < cap) & (sorted_A < E)
  order_A = order_A[jnp.argsort(jnp.where(kept_A, sorted_A, E), stable=True)]
  return order_A, jnp.minimum(counts_E, cap), counts_E


def grouped_mlp(rows_RM, groups_E, up_EMF, gate_EMF, down_EFM, *, activation, dtype):
  """Each expert's MLP on its contiguous group of rows (sizes `groups_E`;
  rows past their sum give zeros): `jax.lax.ragged_dot`, in `dtype` (the
  matmuls accumulate in float32 as XLA's dots do), float32 out."""
  grouped = lambda rows, w: jax.lax.ragged_dot(rows.astype(dtype), w.astype(dtype), groups_E,
                                               preferred_element_type=dtype)
  if gate_EMF is not None:
    h_RF = activation(grouped(rows_RM, gate_EMF)) * grouped(rows_RM, up_EMF)
  else:
    h_RF = activation(grouped(rows_RM, up_EMF))
  return grouped(h_RF, down_EFM).astype(jnp.float32)


def moe_tokens(x_NM, router_ME, up_EMF, gate_EMF, down_EFM, *, k: int, normalize: bool = True,
               activation, dtype, capacity_factor: float = 0.0, experts=None, real_N=None,
               router=None, rows: int = 1):
  """The experts' output for tokens [N, M] (float32), their statistics'
  `_sums` and their sequences' `_seq_parts`: route (`router`, a `routing`
  function; None: `route` with `normalize`), sort the N k assignments by expert (`sort_by_expert`), run
  each expert's group through its matrices, scatter back and weigh.
  `experts`: how the sorted rows reach their experts; None: `grouped_mlp`
  here (every expert's weights on this device), else `expert_parallel`.
  `real_N` (False: padding, None: all real): padding tokens reach no expert
  (their output is zero), take no capacity and count in no statistic.
  `rows`: the sequences the N tokens are, for `_seq_parts`."""
  N, M = x_NM.shape
  logits_NE = jnp.dot(x_NM.astype(jnp.float32), router_ME.astype(jnp.float32))
  weights_NK, experts_NK, probs_NE = (route(logits_NE, k, normalize) if router is None
                                      else router(logits_NE))
  E = probs_NE.shape[-1]
  real_A = None if real_N is None else jnp.repeat(real_N, k)
  order_A, kept_E, counts_E = sort_by_expert(experts_NK.reshape(-1), E,
                                             capacity(N, k, E, capacity_factor), real_A)
  rows_AM = x_NM[order_A // k].astype(dtype)
  run = experts or grouped_mlp
  out_AM = run(rows_AM, kept_E, up_EMF, gate_EMF, down_EFM, activation=activation, dtype=dtype)
  out_NKM = jnp.zeros_like(out_AM).at[order_A].set(out_AM).reshape(N, k, M)
  real = jnp.ones((N,), jnp.float32) if real_N is None else real_N.astype(jnp.float32)
  return (jnp.einsum("nkm,nk->nm", out_NKM, weights_NK),
          _sums(logits_NE, probs_NE, counts_E, kept_E, real),
          _seq_parts(experts_NK, probs_NE, real, rows))


def _all_to_all_rows(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                     *, axis: str, chunk: int):
  """`jax.lax.ragged_all_to_all` from a dense `jax.lax.all_to_all`, for
  backends without the ragged collective (XLA:CPU): each device's chunk for
  each peer is padded to `chunk` rows, exchanged, and written at the offset
  the sender gave. The same result; X x chunk rows sent."""
  n, L = operand.shape[0], jnp.arange(chunk)
  rows_XL = input_offsets[:, None] + L
  blocks_XLM = jnp.where((L < send_sizes[:, None])[..., None],
                         operand[jnp.clip(rows_XL, 0, n - 1)], 0)
  blocks_XLM = jax.lax.all_to_all(blocks_XLM, axis, 0, 0)
  at_X = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)
  dest_XL = jnp.where(L < recv_sizes[:, None], at_X[:, None] + L, output.shape[0])
  return output.at[dest_XL.reshape(-1)].set(blocks_XLM.reshape(-1, *operand.shape[1:]),
                                            mode="drop")


def expert_parallel(rows_AM, kept_E, up_EMF, gate_EMF, down_EFM, *, activation, dtype,
                    axis: str, bound: int, ragged: bool):
  """`moe_tokens`' experts over the mesh axis `axis` (X devices, each holding
  E / X experts: the weights here are this device's [E / X, ...]): the rows,
  sorted by expert, go to their experts' devices, are computed there
  (`grouped_mlp`) and come back in their order (rows dropped at capacity,
  past sum(kept_E), give zeros).

  Every device's kept counts are all-gathered first ([X, E]), so each knows
  what every pair of devices exchanges. A device receives each sender's rows
  after the earlier senders', in expert order; it regroups them by expert
  for the grouped matmuls and undoes that before sending them back. `bound`:
  the most rows a device sends any one peer (its A rows dropless, E / X
  experts' capacities otherwise); the receive buffer is X x bound rows.
  `ragged`: `jax.lax.ragged_all_to_all` (TPU, GPU), else `_all_to_all_rows`.
  """
  X, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  E_X = up_EMF.shape[0]  # this device's experts
  counts_XE = jax.lax.all_gather(kept_E, axis)
  sends_XX = counts_XE.reshape(X, X, E_X).sum(-1)  # [sender, receiver] rows
  before_XX = jnp.cumsum(sends_XX, axis=0) - sends_XX  # rows of earlier senders
  send_X, recv_X = sends_XX[me], sends_XX[:, me]
  send_at_X = jnp.cumsum(send_X) - send_X  # where each receiver's rows start here
  land_X, recv_at_X = before_XX[me], before_XX[:, me]  # my rows' place there; theirs here
  exchange = (functools.partial(jax.lax.ragged_all_to_all, axis_name=axis) if ragged else
              functools.partial(_all_to_all_rows, axis=axis, chunk=bound))
  R, M = X * bound, rows_AM.shape[1]
  got_RM = exchange(rows_AM, jnp.zeros((R, M), rows_AM.dtype), send_at_X, send_X, land_X, recv_X)

  mine_XE = jax.lax.dynamic_slice_in_dim(counts_XE, me * E_X, E_X, axis=1)
  sizes = jnp.concatenate([mine_XE.reshape(-1), (R - mine_XE.sum())[None]])
  pair_R = jnp.repeat(jnp.arange(X * E_X + 1), sizes, total_repeat_length=R)
  order_R = jnp.argsort(jnp.where(pair_R < X * E_X, pair_R % E_X, E_X), stable=True)
  out_RM = grouped_mlp(got_RM[order_R], mine_XE.sum(0), up_EMF, gate_EMF, down_EFM,
                       activation=activation, dtype=dtype)
  out_RM = jnp.zeros_like(out_RM, rows_AM.dtype).at[order_R].set(out_RM.astype(rows_AM.dtype))
  back_at_X = jnp.cumsum(sends_XX, axis=1)[:, me] - recv_X  # where my rows sit at each sender
  back_AM = exchange(out_RM, jnp.zeros((rows_AM.shape[0], M), out_RM.dtype), recv_at_X, recv_X,
                     back_at_X, send_X)
  return back_AM.astype(jnp.float32)


class Experts(nnx.Module):
  """E weights of one shape, [E, in, out] (logical axes expert, `axes`)."""

  def __init__(self, num_experts: int, in_features: int, out_features: int,
               axes: tuple[str, str], *, cfg, rngs: nnx.Rngs):
    self.kernel = param(rngs, dense_init(cfg.init_std), (num_experts, in_features, out_features),
                        ("expert", *axes), cfg.param_dtype)


# The mesh axes the default rules (configs/base.py mesh.rules) give the
# router [M, E], the up and gate [E, M, F] and the down [E, F, M] weights.
# Weights placed otherwise by other rules are resharded to these on entry.
_WEIGHT_AXES = (("fsdp", None), ("expert", "fsdp", "tensor"), ("expert", "fsdp", "tensor"),
                ("expert", "tensor", "fsdp"))


def _weight_spec(shape, names, mesh) -> P:
  """`names` as a PartitionSpec, an axis kept only where the mesh has it and
  it divides the dimension (else that dimension is whole on every device)."""
  return P(*(n if n in mesh.axis_names and mesh.shape[n] > 1 and dim % mesh.shape[n] == 0
             else None for n, dim in zip(names, shape)))


def _gather(w, spec: P):
  """The weight on every device from its shard (`spec`), whole but for its
  experts, which stay split over the expert axis."""
  for axis, name in enumerate(spec):
    if name is not None and name != "expert":
      w = jax.lax.all_gather(w, name, axis=axis, tiled=True)
  return w


def _ragged_collectives() -> bool:
  """Whether the compile target has `jax.lax.ragged_all_to_all` (TPU and GPU;
  XLA:CPU has not)."""
  return compile_device().platform in ("tpu", "gpu")


class MoE(nnx.Module):
  """The mixture-of-experts MLP of a block; returns (output, `MoEStats`).

  On a mesh each device routes and sorts its own tokens (`jax.shard_map`
  over the batch axes, and `context` where the rows are split), with every
  expert's weights gathered to it from their fsdp and tensor shards
  (`_gather`; their gradients leave by reduce-scatter). With `mesh.expert`
  > 1 a device keeps only its experts and the rows travel to them
  (`expert_parallel`); without, no token moves. The statistics' sums are
  added over the devices, so they are the whole batch's."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f, E = cfg.d_model, cfg.moe_d_ff, cfg.num_experts
    kind = MLPS[cfg.mlp]
    self.activation = kind.activation
    self.k = cfg.experts_per_token
    self.routing = routing(cfg)
    self.capacity_factor = cfg.moe_capacity_factor
    self.dtype = cfg.dtype
    self.router = Dense(d, (E,), ("embed", None), use_bias=False, cfg=cfg, rngs=rngs,
                        dtype=jnp.float32)
    self.up = Experts(E, d, f, ("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.gate = Experts(E, d, f, ("embed", "mlp"), cfg=cfg, rngs=rngs) if kind.gated else None
    self.down = Experts(E, f, d, ("mlp", "embed"), cfg=cfg, rngs=rngs)
    self.shared = (MLP(dataclasses.replace(cfg, d_ff=cfg.num_shared_experts * f), rngs=rngs)
                   if cfg.num_shared_experts else None)
    self.shared_gate = (Dense(d, (1,), ("embed", None), use_bias=False, cfg=cfg, rngs=rngs)
                        if cfg.moe_shared_expert_gate else None)
    # Unannotated: replicated on every device (E numbers), with a `layers` axis when scanned.
    self.score_bias = ExpertBias(jnp.zeros((E,), jnp.float32)) if has_score_bias(cfg) else None

  def __call__(self, x_BTM, real_BT=None):
    """`real_BT`: False at padding tokens (None: every token is real)."""
    B, T, M = x_BTM.shape
    real_BT = jnp.ones((B, T), bool) if real_BT is None else real_BT
    weights = (self.router.kernel[...], self.up.kernel[...],
               None if self.gate is None else self.gate.kernel[...], self.down.kernel[...])
    # () or (the selection bias,): it selects, and no gradient reaches it.
    bias = () if self.score_bias is None else (jax.lax.stop_gradient(self.score_bias[...]),)
    tokens = functools.partial(moe_tokens, k=self.k, activation=self.activation,
                               dtype=self.dtype, capacity_factor=self.capacity_factor)

    def local(x, real, bias, *w, experts=None):
      b, t, _ = x.shape
      router = functools.partial(self.routing, bias_E=bias[0]) if bias else self.routing
      y, sums, parts = tokens(x.reshape(b * t, M), *w, router=router, experts=experts,
                              real_N=real.reshape(b * t), rows=b)
      return y.reshape(b, t, M), sums, parts

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      y_BTM, sums, parts = local(x_BTM, real_BT, bias, *weights)
      sums += _seq_sums(*parts, self.k)
    else:
      rows = batch_axes(mesh)
      seq = "context" if "context" in mesh.axis_names and mesh.shape["context"] > 1 else None
      spec = P(rows, seq, None)
      axes = rows + ((seq,) if seq else ())
      w_specs = [None if w is None else _weight_spec(w.shape, names, mesh)
                 for w, names in zip(weights, _WEIGHT_AXES)]
      X = mesh.shape["expert"] if "expert" in mesh.axis_names else 1
      experts = None
      if X > 1:
        E = self.up.kernel.shape[0]
        if E % X:
          raise UserError(f"model.num_experts={E} does not split over mesh.expert={X} "
                          "devices; make num_experts a multiple of mesh.expert")
        A = B // math.prod(mesh.shape[a] for a in rows) * (T // (mesh.shape[seq] if seq else 1))
        A *= self.k
        cap = capacity(A // self.k, self.k, E, self.capacity_factor)
        experts = functools.partial(expert_parallel, axis="expert", ragged=_ragged_collectives(),
                                    bound=A if cap is None else min(A, E // X * cap))

      def on_device(x, real, bias, *w):
        w = [None if a is None else _gather(a, sp) for a, sp in zip(w, w_specs)]
        y, sums, parts = local(x, real, bias, *w, experts=experts)
        if seq:  # each sequence's parts whole on each of its devices, its loss counted once
          parts = jax.lax.psum(parts, seq)
          sums += tuple(s / mesh.shape[seq] for s in _seq_sums(*parts, self.k))
        else:
          sums += _seq_sums(*parts, self.k)
        return y, jax.tree.map(lambda s: jax.lax.psum(s, axes), sums)

      # check_vma=False: the gathered weights make every tensor device compute the
      # same values, which the specs say and the type check cannot infer.
      y_BTM, sums = jax.shard_map(on_device, mesh=mesh,
                                  in_specs=(spec, P(rows, seq), tuple(P() for _ in bias),
                                            *w_specs),
                                  out_specs=(spec, P()), check_vma=False)(x_BTM, real_BT, bias,
                                                                          *weights)
    y_BTM = y_BTM.astype(self.dtype)
    if self.shared is not None:
      shared_BTM = self.shared(x_BTM)
      if self.shared_gate is not None:
        shared_BTM = shared_BTM * jax.nn.sigmoid(self.shared_gate(x_BTM))
      y_BTM = y_BTM + shared_BTM
    return y_BTM, stats_of_sums(*sums)
