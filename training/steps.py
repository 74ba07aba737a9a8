"""The jitted train and eval steps over a functional train state.

The model is split once (`nnx.split`) into a static graph definition and a
parameter State; the step merges them inside `jax.jit` (no `nnx.jit`
overhead), takes `jax.grad` of the objective, and applies the optimizer.
The state is donated, so parameters and optimizer moments are updated in
place. Under model.fp8=delayed the gradients of the projections' `Fp8Meta`
variables are their new scales and amax histories: the step writes them
over the old ones (combined over micro-batches by `accumulate_grads`), and
the optimizer and the gradient norm see zeros in their place. Gradient
accumulation runs the micro-batches in a `lax.scan` and adds the gradients
of the summed losses, so a step with accumulation equals the step on the
whole batch.

A step whose loss or gradient norm is not finite leaves the parameters
untouched and records its number in `state["bad_step"]` (-1 while all is
well); the loop checks it before writing any checkpoint.

With `train.moe_bias_update_rate` > 0 the step also moves each deepseek MoE
layer's selection bias (`model/moe.py` `ExpertBias`, which the optimizer
does not touch) by DeepSeek-V3's auxiliary-loss-free rule
(`balance_score_bias`), from the step's expert loads of that layer.
"""
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model import build_model, context_parallel
from model.attention import check_context
from model.config import ModelConfig
from model.fp8 import accumulate_grads, overwrite_fp8_meta, zero_fp8_meta
from model.moe import ExpertBias
from training.objectives import (batch_loss, mtp_training_sum, mtp_weights, next_token_mtp_loss,
                                 training_loss_sum)
from training.optim import model_optimizer


def init_state(params, tx, seed: int) -> dict:
  """The train state: step, parameters, optimizer state, first bad step (-1: none).

  `rng` (a key from `seed`) is read by nothing: the model has no dropout and
  the data pipeline seeds itself. It stays because every checkpoint written
  so far holds it and Orbax restores onto a target of the same tree.
  """
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
          "bad_step": jnp.full((), -1, jnp.int32), "rng": jax.random.key_data(
              jax.random.key(seed))}


def abstract_state(config, remat: bool | str = False):
  """(graphdef, train state of ShapeDtypeStructs) of a run config, nothing allocated.

  The restore target for a checkpoint saved with `config`; `remat` (train.remat,
  a policy of model/remat.py) is what the graphdef recomputes in the backward pass.
  A model whose attention cannot run split over `mesh.context` devices is
  refused here, in one line, before anything is written.
  """
  check_context(ModelConfig.resolve(config.model), config.mesh.context)
  graphdef, params = nnx.split(nnx.eval_shape(
      lambda: build_model(config.model, nnx.Rngs(0), remat=remat,
                          mtp_depth=config.train.mtp_depth)))
  tx = model_optimizer(config)
  return graphdef, jax.eval_shape(lambda: init_state(params, tx, 0))


def _loss_sums(graphdef, params, batch, objective, router: bool = False, mtp: bool = False,
               loads: bool = False, chunk_size: int = 0, loss_impl: str = "xla"):
  """The objective's sums of a batch (`chunk_size`: train.loss_chunk_size,
  tokens per chunk of the head and loss; 0: unchunked; `loss_impl`:
  train.loss_impl, "pallas" for the fused head-and-loss kernel); with `router` (a mixture of experts),
  also the router's terms, each summed as its mean over the MoE layers times
  the batch's target count (`router_sums`; with `loads`, followed by each
  layer's assignments per expert); with `mtp` (train.mtp_depth > 0), (those,
  every multi-token prediction depth's sums)."""
  model = nnx.merge(graphdef, params)
  if mtp:
    sums, depth_sums = next_token_mtp_loss(model, batch, chunk_size, loss_impl)
  else:
    sums = batch_loss(objective, model, batch, chunk_size, loss_impl)
  out = (sums, router_sums(model, sums[1], loads)) if router else sums
  return (out, depth_sums) if mtp else out


# The metrics of a mixture of experts' router, `MoEStats` averaged over its layers.
ROUTER_METRICS = ("moe_aux_loss", "router_z_loss", "expert_load", "moe_dropped",
                  "moe_seq_aux_loss")


def router_losses(config):
  """(train.moe_aux_loss, train.router_z_loss, train.moe_seq_aux_loss) of a
  mixture of experts (`model.num_experts` > 0): what `train_step` weighs its
  router losses by (`weighed_router_sum`); None for a dense model."""
  if not config.model.num_experts:
    return None
  return (config.train.moe_aux_loss, config.train.router_z_loss, config.train.moe_seq_aux_loss)


def weighed_router_sum(router_losses, router):
  """The router's losses to add to the training loss: `router_losses`'
  weights times their terms of `router_sums` (the load-balancing loss, the
  z-loss and the sequence-wise balance loss)."""
  terms = (router[0], router[1], router[4])
  return sum(w * term for w, term in zip(router_losses, terms))


def mtp_of(config):
  """(train.mtp_depth, train.mtp_weight) with multi-token prediction: what
  `train_step` adds the MTP loss by; None without (train.mtp_depth=0)."""
  if not config.train.mtp_depth:
    return None
  return (config.train.mtp_depth, config.train.mtp_weight)


def mtp_metrics(depth: int) -> tuple:
  """The metric names of `depth` multi-token prediction depths:
  mtp1_loss, mtp1_accuracy, mtp2_loss, ..."""
  return tuple(f"mtp{k}_{what}" for k in range(1, depth + 1) for what in ("loss", "accuracy"))


def router_sums(model, count, loads: bool = False) -> tuple:
  """(load-balancing loss, router z-loss, load, dropped fraction,
  sequence-wise balance loss) of the model's MoE layers (`model/moe.py`),
  each the mean over the layers times `count`, so that micro-batches add up
  like the loss sums; with `loads`, followed by each layer's assignments per
  expert (`MoEStats.counts`, [MoE layers, E]), which add up as they are."""
  stats = model.decoder.router_stats.get_value()
  sums = tuple(jnp.mean(x) * count for x in (stats.aux_loss, stats.z_loss, stats.load,
                                              stats.dropped, stats.seq_aux_loss))
  return (*sums, stats.counts) if loads else sums


def balance_score_bias(graphdef, params, counts_LE, rate: float):
  """`params` with each MoE layer's selection bias moved by `rate` x
  sign(mean load - load) per expert: DeepSeek-V3's auxiliary-loss-free load
  balancing (Wang et al. 2024; DeepSeek-V3 section 2.1.2). An expert that got
  more than its layer's mean share of the step's assignments (`counts_LE`,
  `MoEStats.counts` of each MoE layer) is chosen less from the next step on,
  one that got fewer more; one at the mean stays. The sign is taken of the
  layer's total - E x count, exact in float32 for totals below 2^24."""
  model = nnx.merge(graphdef, params)
  E = counts_LE.shape[-1]
  step_LE = rate * jnp.sign(counts_LE.sum(axis=-1, keepdims=True) - E * counts_LE)
  for bias, rows in model.decoder.expert_biases():  # [E] per layer, or [n, E] stacked
    bias[...] = bias[...] + step_LE[jnp.array(rows)].reshape(bias.shape)
  return nnx.state(model)


def mean_abs_score_bias(params):
  """The mean |b| over every MoE layer's experts of the selection biases
  (`ExpertBias`) in a model's state: metric `moe_bias_abs`, how far the
  auxiliary-loss-free balancing has moved the routing from the router's own."""
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return jnp.mean(jnp.concatenate([jnp.abs(v[...]).ravel() for v in leaves
                                   if isinstance(v, ExpertBias)]))


def _grads(graphdef, params, batch, objective, accum_steps, z_loss=0.0, router_losses=None,
           mtp=None, loads: bool = False, chunk_size: int = 0, loss_impl: str = "xla"):
  """Gradient of the summed training loss (cross-entropy plus `z_loss` x
  (log Z)^2, plus with `router_losses` = (aux weight, z weight) the MoE
  router's losses, plus with `mtp` = (train.mtp_weight, the whole batch's
  target count, each depth's) the multi-token prediction loss) and the sums
  (with the router's sums when `router_losses` is given, and with `loads`
  each MoE layer's assignments per expert after them; then, with `mtp`,
  (those, each depth's sums)), over accum_steps micro-batches; `chunk_size`:
  train.loss_chunk_size, `loss_impl`: train.loss_impl (`_loss_sums`)."""

  def sum_loss(p, micro):
    out = _loss_sums(graphdef, p, micro, objective, router=router_losses is not None,
                     mtp=mtp is not None, loads=loads, chunk_size=chunk_size,
                     loss_impl=loss_impl)
    if mtp is not None:
      out, depth_sums = out
    sums = out if router_losses is None else out[0]
    total = training_loss_sum(sums, z_loss)
    if router_losses is not None:
      total = total + weighed_router_sum(router_losses, out[1])
    if mtp is None:
      return total, out
    return total + mtp_training_sum(depth_sums, mtp[0], mtp[1], mtp[2]), (out, depth_sums)

  grad_fn = jax.grad(sum_loss, has_aux=True)
  if accum_steps == 1:
    return grad_fn(params, batch)
  micro = jax.tree.map(lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)

  def body(carry, mb):
    g, sums = grad_fn(params, mb)
    return (accumulate_grads(carry[0], g), jax.tree.map(jnp.add, carry[1], sums)), None

  # Zeros of the gradients' and sums' tree, shapes and dtypes, as the carry.
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                       jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro)))
  (grads, sums), _ = jax.lax.scan(body, zeros, micro)
  return grads, sums


def _sharded_grads(grads, grad_sharding):
  """The gradients in their parameters' shards, materialised as such.

  Under fsdp XLA sums each weight's gradient over the devices with an
  all-reduce of the whole weight and slices the device's shard where it is
  read: in the global norm and the optimizer update, after the backward pass,
  so the whole gradient of every layer would be alive at once. The barrier
  makes the slices the values that the norm and the update read, so each
  whole gradient is freed as soon as its shard is taken (docs/compiling.md
  has the memory it saves). An identity on the values.
  """
  return jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(grads, grad_sharding))


def train_step(state, batch, *, graphdef, tx, schedule, objective: str, accum_steps: int,
               grad_sharding=None, z_loss: float = 0.0, router_losses=None, mtp=None,
               bias_rate: float = 0.0, loss_chunk_size: int = 0, loss_impl: str = "xla"):
  """One optimizer step; `grad_sharding`: the parameters' shardings, to which
  the gradients are held (`_sharded_grads`) on a mesh; `z_loss`: the weight
  of (log Z)^2 (train.z_loss), whose term is reported as metric `z_loss`;
  `router_losses`: for a mixture of experts, the weights (train.moe_aux_loss,
  train.router_z_loss, train.moe_seq_aux_loss) of its router's losses, which
  are reported (unweighted) as `moe_aux_loss`, `router_z_loss`,
  `moe_seq_aux_loss`, `expert_load` (the most tokens an expert got over the
  mean) and `moe_dropped` (the fraction of assignments dropped at capacity),
  each averaged over the MoE layers; `mtp`:
  (train.mtp_depth, train.mtp_weight) with multi-token prediction, whose
  depths' mean cross-entropy and accuracy are reported as `mtp<k>_loss` and
  `mtp<k>_accuracy` (`loss` and `accuracy` stay the main model's);
  `bias_rate`: train.moe_bias_update_rate, with which the deepseek MoE
  layers' selection biases move after the update (`balance_score_bias`, from
  the whole step's loads, micro-batches added; not after a bad step), their
  mean |b| reported as `moe_bias_abs`; `loss_chunk_size`: train.loss_chunk_size,
  the head and loss computed that many tokens at a time (0: the whole batch's
  logits at once; training/objectives.py `chunked_loss_sums`); `loss_impl`:
  train.loss_impl, "pallas" for the fused head-and-loss kernel
  (`fused_loss_sums`)."""
  depth_counts = None
  if mtp is not None:
    depth_counts = [w.sum() for w in mtp_weights(batch, mtp[0])]
    mtp = (mtp[1], batch["loss_mask"].sum(), depth_counts)
  grads, sums = _grads(graphdef, state["params"], batch, objective, accum_steps, z_loss,
                       router_losses, mtp, loads=bool(bias_rate), chunk_size=loss_chunk_size,
                       loss_impl=loss_impl)
  depth_sums = None
  if mtp is not None:
    sums, depth_sums = sums
  router = None
  if router_losses is not None:
    sums, router = sums
  loss_sum, count, correct, log_z_sq_sum = sums
  fp8_meta = grads  # the new delayed-scaling state, where the model has one (model/fp8.py)
  grads = zero_fp8_meta(grads)
  if grad_sharding is not None:
    grads = _sharded_grads(grads, grad_sharding)
  count = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: g / count, grads)
  loss = loss_sum / count
  z_term = z_loss * log_z_sq_sum / count
  with jax.named_scope("optimizer"):
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(z_term) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = overwrite_fp8_meta(optax.apply_updates(state["params"], updates), fp8_meta)
    if bias_rate:
      params = balance_score_bias(graphdef, params, router[-1], bias_rate)
    # Keep the old values after a bad step; a select fuses into the update,
    # where a lax.cond would make XLA copy the donated buffers.
    keep_if_bad = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    params = keep_if_bad(params, state["params"])
    opt_state = keep_if_bad(opt_state, state["opt_state"])
  bad_step = jnp.where((state["bad_step"] < 0) & ~ok, state["step"], state["bad_step"])
  new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state,
               "bad_step": bad_step}
  metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state["step"]),
             "accuracy": correct / count, "targets": count}
  if z_loss:
    metrics["z_loss"] = z_term
  if router is not None:
    metrics.update(zip(ROUTER_METRICS, (r / count for r in router[:len(ROUTER_METRICS)])))
  if bias_rate:
    metrics["moe_bias_abs"] = mean_abs_score_bias(params)
  for k, (depth_loss, depth_count, depth_correct) in enumerate(depth_sums or (), start=1):
    metrics[f"mtp{k}_loss"] = depth_loss / jnp.maximum(depth_count, 1.0)
    metrics[f"mtp{k}_accuracy"] = depth_correct / jnp.maximum(depth_count, 1.0)
  return new_state, metrics


def eval_step(params, batch, *, graphdef, objective: str, mtp_depth: int = 0,
              loss_chunk_size: int = 0, loss_impl: str = "xla"):
  """(loss sum, target count, correct count, (log Z)^2 sum) of one batch;
  with `mtp_depth`, followed by each depth's (loss sum, target count,
  correct count), flat; `loss_chunk_size` and `loss_impl` as `train_step`'s."""
  if not mtp_depth:
    return _loss_sums(graphdef, params, batch, objective, chunk_size=loss_chunk_size,
                      loss_impl=loss_impl)
  sums, depth_sums = _loss_sums(graphdef, params, batch, objective, mtp=True,
                                chunk_size=loss_chunk_size, loss_impl=loss_impl)
  return (*sums, *(x for depth in depth_sums for x in depth))


def traced_on(mesh, fn, context_strategy: str = "auto"):
  """`fn` traced with `mesh` as the abstract mesh, so that the model's sharding
  constraints on activations (model/transformer.py) name its axes, and with
  `context_strategy` (mesh.context_strategy) for attention over rows split
  by its context axis."""

  def run(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
        context_parallel.use_strategy(context_strategy):
      return fn(*args)

  # The jitted program's name in a profile and its HLO module (jit_train_step).
  run.__name__ = getattr(fn, "func", fn).__name__
  return run


def jit_train_step(graphdef, tx, schedule, objective, accum_steps, state_sharding=None,
                   batch_sharding=None, z_loss: float = 0.0, context_strategy: str = "auto",
                   router_losses=None, mtp=None, bias_rate: float = 0.0,
                   loss_chunk_size: int = 0, loss_impl: str = "xla"):
  fn = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                         objective=objective, accum_steps=accum_steps, z_loss=z_loss,
                         router_losses=router_losses, mtp=mtp, bias_rate=bias_rate,
                         loss_chunk_size=loss_chunk_size, loss_impl=loss_impl)
  if state_sharding is None:
    return jax.jit(fn, donate_argnums=(0,))
  fn = functools.partial(fn, grad_sharding=state_sharding["params"])
  return jax.jit(traced_on(batch_sharding.mesh, fn, context_strategy), donate_argnums=(0,),
                 in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None))


def jit_eval_step(graphdef, objective, mesh=None, context_strategy: str = "auto",
                  mtp_depth: int = 0, loss_chunk_size: int = 0, loss_impl: str = "xla"):
  fn = functools.partial(eval_step, graphdef=graphdef, objective=objective,
                         mtp_depth=mtp_depth, loss_chunk_size=loss_chunk_size,
                         loss_impl=loss_impl)
  return jax.jit(fn if mesh is None else traced_on(mesh, fn, context_strategy))
