"""The optimizer (`train.optimizer`) and its learning-rate schedule (`train.schedule`).

AdamW (the default), Adafactor, Lion and Muon from optax, each after
global-norm clipping, with decoupled weight decay (times the learning rate)
on the matrices only: norms, biases and other vectors do not decay. Muon
orthogonalises the updates of the hidden weight matrices, the kernels inside
the blocks, one layer at a time; AdamW takes the embeddings, the output head,
norms and biases. Under μP (model.parametrization=mup) the hidden matrices'
updates are scaled by `hidden_lr_mult`. The schedules warm up linearly, then
follow `train.schedule`; docs/training.md has their formulas. The optimizer
takes the `nnx.Param`s only: the other variables of a model's state (a
deepseek router's selection bias, `model/moe.py` `ExpertBias`) get no update
and no decay (`trained_only`).
"""
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from configs.validation import decay_start, depth_mult, optimizer_option, width_mult
from model.moe import has_score_bias

# The kernels whose input is more than their first axis: the attention output
# projection maps [heads, head_dim] to d_model.
INPUT_AXES = {"o_proj": 2}


def learning_rate_schedule(train_cfg, peak: float | None = None) -> optax.Schedule:
  """Linear warm-up from 0 to `peak` (train.learning_rate) over warmup_steps,
  then train.schedule; step t is the count of steps taken (0 at the first)."""
  t = train_cfg
  peak = t.learning_rate if peak is None else peak
  end, warmup, total = peak * t.min_lr_ratio, t.warmup_steps, t.num_steps
  if t.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total, warmup + 1), end_value=end)

  def linear_to_end(step, start):
    """peak at step `start`, end at num_steps."""
    return peak + (end - peak) * jnp.clip((step - start) / max(total - start, 1), 0.0, 1.0)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    if t.schedule == "linear":
      after = linear_to_end(step, warmup)
    elif t.schedule == "constant":
      after = jnp.full_like(step, peak)
    elif t.schedule == "inverse_sqrt":
      after = peak * jnp.sqrt(warmup / jnp.maximum(step, warmup))
    else:  # wsd
      after = linear_to_end(step, decay_start(t))
    return jnp.where(step < warmup, peak * step / max(warmup, 1), after)

  return schedule


def decay_mask(params):
  """True for weight matrices, embeddings and position tables: parameters
  with two or more axes per layer that are not biases (q/k/v biases are
  [heads, head_dim]). A scanned stack's leading `layers` axis does not
  count, so its norms and biases do not decay, as in the per-layer layout."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim - _stacked(path) >= 2 and _name(path).split("/")[-1] != "bias",
      params)


def _name(path) -> str:
  """A parameter's path as a name: "decoder/layers/attn/q_proj/kernel"."""
  return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")


def _stacked(path) -> bool:
  """Whether the parameter at `path` belongs to a scanned stack (its blocks'
  parameters stacked on a leading `layers` axis, not a list of layers)."""
  parts = _name(path).split("/")
  return "layers" in parts[:-1] and not parts[parts.index("layers") + 1].isdigit()


def muon_dimensions(path, x) -> MuonDimensionNumbers | None:
  """How Muon sees parameter `x` at `path` as (input, output) matrices, or None
  for a parameter AdamW takes.

  Muon takes the kernels inside the blocks (`.../layers/...`): attention and
  MLP projections. A scanned stack's kernels lead with the `layers` axis, a
  batch axis (each layer's matrix is orthogonalised by itself); the input is
  the next axis (the next two for `o_proj`), the output every axis after it.
  """
  parts = _name(path).split("/")
  if "layers" not in parts or parts[-1] != "kernel":
    return None
  below = parts[parts.index("layers") + 1]
  first = 0 if below.isdigit() else 1  # a per-layer list, or the scanned stack's axis
  inputs = INPUT_AXES.get(parts[-2], 1)
  if x.ndim < first + inputs + 1:
    raise ValueError(f"{_name(path)}: shape {x.shape} is not a matrix of {inputs} input axes")
  return MuonDimensionNumbers(reduction_axis=tuple(range(first, first + inputs)),
                              output_axis=tuple(range(first + inputs, x.ndim)))


def muon_labels(params):
  """"muon" for the hidden matrices (`muon_dimensions`), "adamw" for the rest."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: "muon" if is_hidden(path, x) else "adamw", params)


def _muon_dimension_tree(updates):
  """`muon_dimensions` of every leaf of Muon's part (the rest is masked out)."""
  return jax.tree_util.tree_map_with_path(muon_dimensions, updates)


def _scale_by_shape(rms: float) -> optax.GradientTransformation:
  """Each orthogonalised update times rms * sqrt(max(fan_in, fan_out)), which
  makes its RMS `rms` (Moonlight's), or for rms 0 times sqrt(max(1, fan_out /
  fan_in)) (Keller Jordan's): optax.contrib.muon's two scalings, per layer."""

  def scale(path, u):
    dims = muon_dimensions(path, u)
    fan_in = math.prod(u.shape[a] for a in dims.reduction_axis)
    fan_out = math.prod(u.shape[a] for a in dims.output_axis)
    factor = rms * math.sqrt(max(fan_in, fan_out)) if rms > 0 else math.sqrt(
        max(1.0, fan_out / fan_in))
    return u * factor

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(scale, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def _adamw(train_cfg, schedule) -> optax.GradientTransformation:
  t = train_cfg
  return optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)


def _muon(train_cfg, schedule) -> optax.GradientTransformation:
  """Muon (optax.contrib's, with Nesterov momentum) on the hidden matrices at
  muon_lr, AdamW on the rest at learning_rate; one weight decay."""
  t = train_cfg
  matrices = optax.chain(
      scale_by_muon(ns_steps=optimizer_option(t, "muon_ns_steps"),
                    beta=optimizer_option(t, "muon_momentum"),
                    weight_dimension_numbers=_muon_dimension_tree),
      _scale_by_shape(optimizer_option(t, "muon_rms")),
      optax.add_decayed_weights(t.weight_decay),
      optax.scale_by_learning_rate(learning_rate_schedule(t, optimizer_option(t, "muon_lr"))))
  return optax.partition({"muon": matrices, "adamw": _adamw(t, schedule)}, muon_labels)


def _adafactor(train_cfg, schedule) -> optax.GradientTransformation:
  t = train_cfg
  clipping = optimizer_option(t, "adafactor_clipping")
  return optax.adafactor(
      schedule, min_dim_size_to_factor=optimizer_option(t, "adafactor_min_dim_to_factor"),
      decay_rate=optimizer_option(t, "adafactor_decay_rate"),
      multiply_by_parameter_scale=optimizer_option(t, "adafactor_param_scale"),
      clipping_threshold=clipping if clipping > 0 else None,
      momentum=optimizer_option(t, "adafactor_momentum"),
      weight_decay_rate=lambda count: t.weight_decay * schedule(count),
      weight_decay_mask=decay_mask)


def _lion(train_cfg, schedule) -> optax.GradientTransformation:
  t = train_cfg
  return optax.lion(schedule, b1=optimizer_option(t, "lion_b1"),
                    b2=optimizer_option(t, "lion_b2"), weight_decay=t.weight_decay,
                    mask=decay_mask)


OPTIMIZERS = {"adamw": _adamw, "adafactor": _adafactor, "lion": _lion, "muon": _muon}


def mup_width(model_section) -> float | None:
  """The width multiplier `make_optimizer` takes: d_model / mup_base_width
  under model.parametrization=mup, None under sp."""
  if model_section.parametrization != "mup":
    return None
  return width_mult(model_section)


def mup_depth(model_section) -> float | None:
  """Depth-μP's factor `make_optimizer` takes: sqrt(mup_base_depth /
  num_layers) with model.mup_base_depth; None without, or when it is 1."""
  if model_section.get("mup_base_depth") is None or depth_mult(model_section) == 1.0:
    return None
  return depth_mult(model_section)


def hidden_lr_mult(train_cfg, width: float) -> float:
  """μP's factor on the hidden matrices' learning rate at width multiplier
  `width` (Tensor Programs V, Table 3, for Adam-like updates, whose size
  does not follow the gradient's): 1 / width for AdamW and Lion (a sign
  update) and for Adafactor without parameter scaling; 1 / sqrt(width) for
  Adafactor with it (its update already carries the weights' RMS, 1 /
  sqrt(width) under μP's init); 1 for Muon at muon_rms=0, whose update,
  orthogonalised and scaled by sqrt(max(1, fan_out / fan_in)), already has
  the spectral norm μP asks; 1 / width for Muon with muon_rms > 0, whose
  scaling matches AdamW's update RMS instead."""
  t = train_cfg
  if t.optimizer == "adafactor" and optimizer_option(t, "adafactor_param_scale"):
    return width ** -0.5
  if t.optimizer == "muon" and optimizer_option(t, "muon_rms") == 0:
    return 1.0
  return 1.0 / width


def is_hidden(path, x) -> bool:
  """Whether `x` is a hidden matrix: a kernel inside the blocks, as Muon takes
  them (`muon_dimensions`)."""
  return muon_dimensions(path, x) is not None


def is_input_weight(path, x) -> bool:
  """Whether `x` is an input weight (Tensor Programs V's term): a token
  embedding (`.../embedding`, a tied head's weights too) or a learned position
  table (`.../positions/table`)."""
  del x
  parts = _name(path).split("/")
  return parts[-1] == "embedding" or parts[-2:] == ["positions", "table"]


def _scale_where(select, mult: float) -> optax.GradientTransformation:
  """The updates of the parameters `select(path, x)` picks times `mult` (their
  weight decay with them); every other update as it is. Stateless, so it
  resumes exactly and fits any schedule."""

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(
        lambda path, u: u * mult if select(path, u) else u, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(train_cfg, width: float | None = None,
                   depth: float | None = None) -> optax.GradientTransformation:
  """train.optimizer after clipping; with `width` (μP's width multiplier,
  `mup_width`) the hidden matrices' updates scaled by `hidden_lr_mult`, with
  `depth` (depth-μP's branch factor, `mup_depth`) by it too: no update rule
  here has a size that follows the gradient's, so each takes the same
  1 / sqrt(depth) (Tensor Programs VI, for Adam). train.embedding_lr_mult
  scales the input weights' updates (`is_input_weight`)."""
  parts = []
  if train_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  parts.append(OPTIMIZERS[train_cfg.optimizer](train_cfg, learning_rate_schedule(train_cfg)))
  if width is not None or depth is not None:
    mult = (1.0 if width is None else hidden_lr_mult(train_cfg, width)) * (depth or 1.0)
    parts.append(_scale_where(is_hidden, mult))
  if train_cfg.embedding_lr_mult != 1.0:
    parts.append(_scale_where(is_input_weight, train_cfg.embedding_lr_mult))
  return optax.chain(*parts)


def parameter_labels(state):
  """"param" for each `nnx.Param` of a model's state, "other" for its other
  variables (the leaves' labels as a prefix tree of `state`)."""
  return jax.tree.map(lambda v: "param" if isinstance(v, nnx.Param) else "other", state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def trained_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` on the `nnx.Param`s of a model's state; every other variable's
  update is zero, so the optimizer neither moves nor decays it, keeps no
  moments for it, and its (zero) gradient is not in the clipped norm."""
  return optax.partition({"param": tx, "other": optax.set_to_zero()}, parameter_labels)


def model_optimizer(config) -> optax.GradientTransformation:
  """`make_optimizer` for a whole config: train.optimizer with the model's
  μP width and depth factors; `trained_only` where the model holds variables
  other than parameters (a deepseek router's `ExpertBias`, the `Fp8Meta`
  state of model.fp8=delayed), so that the
  optimizer state of every other model keeps its tree (and its checkpoints)."""
  tx = make_optimizer(config.train, mup_width(config.model), mup_depth(config.model))
  others = has_score_bias(config.model) or config.model.fp8 == "delayed"
  return trained_only(tx) if others else tx
