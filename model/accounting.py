"""What a model costs: parameters, KV cache, FLOPs and training memory.

Implements the lesson's "Counting parameters in a decoder layer" (attention
4d^2 for multi-head attention, MLP 3 d d_ff for SwiGLU, norms 2d; 6.74B for
the 7B shapes), "Cost: O(n^2) attention and the KV cache" (2 x layers x KV
heads x head dim x bytes per token) and "Efficient attention variants" (GQA
and MQA shrink W_K, W_V and the cache by h / g).

Every function takes the `model` section (a ConfigDict) or a resolved
`model.config.ModelConfig`.

Parameters are counted twice: `measured_params` reads the parameter tree of
the real module under `jax.eval_shape` (nothing is allocated, so the 7B
preset takes a tenth of a second on a CPU) and `formula_params` writes the
closed form; the tests hold them equal, and so does every entry point at
start-up (`check_formula`, through `with_budget`), naming the registry entry
whose count is off. Both return the same dict:

- `params_total`: every parameter once (a shared embedding counts once).
- `params_active`: those one token uses: the total less, in each
  mixture-of-experts layer, the E - k experts it is not routed to (the
  total for a dense model; Mixtral-8x7B: 12.9B of 46.7B).
- `params_per_layer`: layer 0 by component (an MoE layer's `mlp` is its
  router, experts and shared experts), `attention`, `cross_attention`
  (decoder of an encoder-decoder), `mlp`, `norms` (every norm of the layer)
  and `total`; the decoder's layers, or the encoder's for family=encoder.
- `params_per_encoder_layer`: the encoder's layers (encoder_decoder only).
- `num_layers` (the layers of `params_per_layer`), `num_encoder_layers`.
- `params_embedding`: input embedding + position tables + token-type tables +
  embedding norms + the output head (untied matrix, head transform, output
  bias).
- `params_position_table`: the learned position tables alone (T5's relative
  bias tables with `pos_emb=relative`).
- `params_final_norms`: the norm after each stack (pre-norm only).
- `params_mtp` (only with `mtp_depth` > 0, train.mtp_depth): DeepSeek-V3's
  multi-token prediction modules (`model/mtp.py`), in `params_total` and
  `params_active` (they run in every training step; less the experts a
  token skips in a module's MoE block, `mtp_inactive_params`).

FLOPs follow the PaLM appendix convention of docs/benchmarks.md, and the memory
estimate is documented at `activation_bytes_per_token`. A token or FLOP
budget becomes train.num_steps here (`with_budget`), from the same counts.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from configs import validation
from configs.errors import UserError
from model import build_model
from model import context_parallel
from model.attention import model_implementation
from model.attention_kinds import ATTENTIONS
from model.config import ModelConfig
from model.gated_deltanet import linear_params, rule_flops, state_shapes
from model.kernels import fuses_loss
from model.mlp import MLPS
from model.norms import NORMS
from model.positions import POSITIONS
from model.remat import remat_policy
from model.transformer import segment

# The attribute of a `Block` that owns a parameter -> its component.
_COMPONENTS = {"attn": "attention", "cross_attn": "cross_attention", "mlp": "mlp",
               "norm_attn": "norms", "norm_cross": "norms", "norm_mlp": "norms"}

# Attention implementations that write the [T, S] probabilities to memory;
# the fused kernels (cudnn, pallas) recompute them in the backward pass
# instead. `auto` counts as what the dispatcher picks (`model_implementation`).
_MATERIALISED_SCORES = ("reference", "xla")


def _itemsize(dtype) -> int:
  """Bytes per element of a jnp dtype (bfloat16 -> 2)."""
  return jnp.dtype(dtype).itemsize


def _layer_stacks(m) -> list[tuple[str, int, bool]]:
  """(stack name, layers, has cross-attention) for each stack of blocks."""
  if m.family == "encoder_decoder":
    return [("encoder", m.num_layers, False), ("decoder", m.num_decoder_layers, True)]
  return [(m.family, m.num_layers, False)]


def _assemble(m, per_layer: dict[str, dict[str, int]], mtp_depth: int = 0,
              **counts: int) -> dict:
  """The params dict from per-layer breakdowns keyed by stack name, with
  `params_active`: the total less the experts a token is not routed to
  (`inactive_params`, and the `mtp_depth` modules' `mtp_inactive_params`;
  the total for a dense model)."""
  out = dict(counts)
  mtp_inactive = mtp_inactive_params(m) * mtp_depth if mtp_depth else 0
  out["params_active"] = counts["params_total"] - inactive_params(m) - mtp_inactive
  if m.family == "encoder_decoder":
    out.update(params_per_layer=per_layer["decoder"], num_layers=m.num_decoder_layers,
               params_per_encoder_layer=per_layer["encoder"], num_encoder_layers=m.num_layers)
  else:
    out.update(params_per_layer=per_layer[m.family], num_layers=m.num_layers)
  return out


def parameter_shapes(model_cfg, mtp_depth: int = 0) -> dict[str, tuple[int, ...]]:
  """Path ("decoder/layers/0/attn/q_proj/kernel"; scanned,
  "decoder/layers/attn/q_proj/kernel" of shape [layers, ...]) -> shape of
  every parameter.

  Built under `jax.eval_shape`, so no parameter is allocated.
  """
  state = jax.eval_shape(lambda: nnx.state(
      build_model(model_cfg, nnx.Rngs(0), mtp_depth=mtp_depth), nnx.Param))
  return {"/".join(map(str, path)): tuple(variable.shape)
          for path, variable in nnx.to_flat_state(state)}


def measured_params(model_cfg, mtp_depth: int = 0) -> dict:
  """Parameter counts read off the real module's tree (see module docstring).

  The per-layer breakdown is layer 0's (scanned: a stacked leaf over its
  layers); `params_total` sums every leaf, so a layer that differed from
  layer 0 would show up as a total off the formula.
  """
  model_cfg = ModelConfig.resolve(model_cfg)
  counts = dict(params_total=0, params_embedding=0, params_position_table=0,
                params_final_norms=0, **({"params_mtp": 0} if mtp_depth else {}))
  per_layer = {stack: {} for stack, _, _ in _layer_stacks(model_cfg)}
  for path, shape in parameter_shapes(model_cfg, mtp_depth).items():
    size = math.prod(shape)
    parts = path.split("/")
    counts["params_total"] += size
    if parts[0] == "mtp":
      counts["params_mtp"] += size
    elif len(parts) > 2 and parts[1] == "layers":
      if seg := segment(parts[2]):  # scanned segments: [repeats, ...] under layers/<a>_to_<b>/
        cycle = seg.period > 1  # a cycle's body: layers/<a>_to_<b>_every_<p>/<j>/<component>
        first = seg.first == 0 and (not cycle or parts[3] == "0")
        component, one = parts[4 if cycle else 3], size // shape[0]
      elif parts[2].isdigit():  # a loop: layers/<i>/<component>
        first, component, one = parts[2] == "0", parts[3], size
      else:  # a scanned stack: [layers, ...] under layers/<component>
        first, component, one = True, parts[2], size // shape[0]
      if first:
        layer = per_layer[parts[0]]
        layer[_COMPONENTS[component]] = layer.get(_COMPONENTS[component], 0) + one
    elif len(parts) > 1 and parts[1] == "final_norm":
      counts["params_final_norms"] += size
    else:  # embed/embedding, positions/table, relative_bias/table, token_types/table,
      #      embedding_norm, head/kernel, head_transform, output_bias, classifier
      counts["params_embedding"] += size
      if len(parts) > 1 and parts[1] in ("positions", "relative_bias"):
        counts["params_position_table"] += size
  for layer in per_layer.values():
    layer["total"] = sum(layer.values())
  return _assemble(model_cfg, per_layer, mtp_depth, **counts)


def _attention_params(m) -> int:
  """An attention sublayer: the `model.attention` entry's count (mha: W_Q
  [d, h, d_k] and W_O [h, d_k, d], W_K, W_V [d, g, d_k], the biases of q, k,
  v (qkv_bias) and of o (out_bias), the two RMSNorm scales [d_k] of qk_norm;
  mla: `model.mla.mla_params`). Cross-attention is multi-head (MLA is a
  decoder's)."""
  return ATTENTIONS[m.attention].params(m)


def _mlp_params(m) -> int:
  """The `model.mlp` entry's count: two matrices d x d_ff (gelu, gelu_tanh,
  relu) or three (the gated swiglu, geglu, geglu_tanh), and their biases
  (mlp_bias)."""
  return MLPS[m.mlp].params(m.d_model, m.d_ff, m.mlp_bias)


def _expert_params(m) -> int:
  """One expert of a mixture (`model/moe.py`): the `model.mlp` matrices at
  width moe_d_ff, without biases."""
  return MLPS[m.mlp].params(m.d_model, m.moe_d_ff, False)


def _moe_params(m) -> int:
  """A mixture-of-experts MLP: the router d x E, E experts, and the shared
  experts' one MLP of num_shared_experts x moe_d_ff (with mlp_bias) and its
  gate W_g [d, 1] (moe_shared_expert_gate)."""
  shared = (MLPS[m.mlp].params(m.d_model, m.num_shared_experts * m.moe_d_ff, m.mlp_bias)
            if m.num_shared_experts else 0) + (m.d_model if m.moe_shared_expert_gate else 0)
  return m.d_model * m.num_experts + m.num_experts * _expert_params(m) + shared


def inactive_params(model_cfg) -> int:
  """Parameters a token does not use: the experts it is not routed to,
  (E - k) experts in each MoE layer (0 for a dense model)."""
  m = ModelConfig.resolve(model_cfg)
  return len(m.moe_layers) * (m.num_experts - m.experts_per_token) * _expert_params(m)


def routed_expert_params(model_cfg) -> int:
  """The routed experts' parameters, all E of every MoE layer: what
  `mesh.expert` splits (0 for a dense model)."""
  m = ModelConfig.resolve(model_cfg)
  return len(m.moe_layers) * m.num_experts * _expert_params(m)


def _norm_params(m) -> int:
  """The `model.norm` entry's count at width d_model: gamma (RMSNorm), or
  gamma and beta (LayerNorm)."""
  return NORMS[m.norm].params(m.d_model)


def _position_table_params(m) -> int:
  """The `model.pos_emb` entry's parameters per stack: the max_len x d table
  (learned) or T5's relative bias table, relative_buckets x h (relative)."""
  return POSITIONS[m.pos_emb].params(m)


def _stack_embedding_params(m) -> int:
  """A stack's token-type table (type_vocab_size x d) and embedding norm."""
  return m.type_vocab_size * m.d_model + (_norm_params(m) if m.embedding_norm else 0)


def _head_params(m) -> int:
  """The untied output matrix d x V, the head transform (d x d, its bias
  and a norm) and the output bias (V); or a classifier's pooler (d x d and
  its bias) and output matrix d x labels (and its bias)."""
  if m.num_labels:
    pooler = m.d_model * m.d_model + m.d_model if m.pooler else 0
    return pooler + m.d_model * m.num_labels + (m.num_labels if m.classifier_bias else 0)
  untied = 0 if m.tie_embeddings else m.d_model * m.vocab_size
  transform = m.d_model * m.d_model + m.d_model + _norm_params(m) if m.head_transform else 0
  return untied + transform + (m.vocab_size if m.output_bias else 0)


def _layer_params(m, cross: bool, moe: bool = False, linear: bool = False) -> dict[str, int]:
  """One layer by component; `linear`: its token mixer is Gated DeltaNet's
  (`model.gated_deltanet.linear_params`, counted as its attention)."""
  layer = {"attention": linear_params(m) if linear else _attention_params(m)}
  if cross:
    layer["cross_attention"] = _attention_params(m)
  layer["mlp"] = _moe_params(m) if moe else _mlp_params(m)
  layer["norms"] = (3 if cross else 2) * _norm_params(m)
  layer["total"] = sum(layer.values())
  return layer


def mtp_module_params(m) -> int:
  """One multi-token prediction module (`model/mtp.py`): the norms of the
  embedding and of h, M_k (2d x d), a decoder layer of the last layer's
  kind (softmax attention; with experts where the last layer has them) and,
  pre-norm, its final norm."""
  final_norm = _norm_params(m) if m.norm_position == "pre" else 0
  block = _layer_params(m, False, moe=m.layer_is_moe(m.num_layers - 1))["total"]
  return 2 * _norm_params(m) + 2 * m.d_model ** 2 + block + final_norm


def mtp_inactive_params(m) -> int:
  """Parameters of one multi-token prediction module a token does not use:
  the E - k experts of its block where it has experts (else 0)."""
  if not m.layer_is_moe(m.num_layers - 1):
    return 0
  return (m.num_experts - m.experts_per_token) * _expert_params(m)


def formula_params(model_cfg, mtp_depth: int = 0) -> dict:
  """The closed-form parameter counts, the same dict as `measured_params`."""
  m = ModelConfig.resolve(model_cfg)
  stacks = _layer_stacks(m)
  per_layer = {stack: _layer_params(m, cross, m.layer_is_moe(0), m.layer_is_linear(0))
               for stack, _, cross in stacks}
  position_table = len(stacks) * _position_table_params(m)
  embedding = (m.vocab_size * m.d_model + position_table + _head_params(m)
               + len(stacks) * _stack_embedding_params(m))
  final_norms = len(stacks) * _norm_params(m) if m.norm_position == "pre" else 0
  # Experts live in the decoder's `moe_layers` and linear attention in its
  # linear layers (decoders only); the others are dense softmax attention.
  linear = validation.linear_layers(m)
  layers = (sum(num * _layer_params(m, cross)["total"] for _, num, cross in stacks)
            + len(m.moe_layers) * (_moe_params(m) - _mlp_params(m))
            + len(linear) * (linear_params(m) - _attention_params(m)))
  mtp = {"params_mtp": mtp_depth * mtp_module_params(m)} if mtp_depth else {}
  return _assemble(m, per_layer, mtp_depth,
                   params_total=layers + embedding + final_norms + mtp_depth * mtp_module_params(m),
                   params_embedding=embedding, params_position_table=position_table,
                   params_final_norms=final_norms, **mtp)


def _entry_parts(counts: dict) -> dict[str, dict[str, int]]:
  """The parts of a params dict that a registry entry's closed form counts:
  config field of the entry -> {what the part is: its count}."""
  layer, encoder_layer = counts["params_per_layer"], counts.get("params_per_encoder_layer", {})
  return {"model.mlp": {"a layer's MLP": layer.get("mlp", 0),
                        "an encoder layer's MLP": encoder_layer.get("mlp", 0)},
          "model.norm": {"a layer's norms": layer.get("norms", 0),
                         "an encoder layer's norms": encoder_layer.get("norms", 0),
                         "the final norms": counts["params_final_norms"]},
          "model.pos_emb": {"the position tables": counts["params_position_table"]},
          "model.attention": {"a layer's attention": layer.get("attention", 0),
                              "a layer's cross-attention": layer.get("cross_attention", 0),
                              "an encoder layer's attention": encoder_layer.get("attention", 0)}}


def check_formula(model_cfg, mtp_depth: int = 0) -> None:
  """Raises `UserError` where the closed form (`formula_params`) differs from
  the module's parameters (`measured_params`, read under `jax.eval_shape`:
  nothing is allocated, about 0.1 s for configs/llama2_7b.py), in one line
  naming the registry entry whose count is off (its `params`), or this
  module's formula when no entry's part differs. Every count the start-up
  summary, the FLOPs and the budgets print rests on the closed form;
  `with_budget` calls this first. `mtp_depth`: train.mtp_depth, whose
  modules count too (`params_mtp`)."""
  m = ModelConfig.resolve(model_cfg)
  formula, measured = formula_params(m, mtp_depth), measured_params(m, mtp_depth)
  if formula == measured:
    return
  totals = f"(model total {formula['params_total']:,} against {measured['params_total']:,})"
  ours, theirs = _entry_parts(formula), _entry_parts(measured)
  for field, registry in (("model.mlp", MLPS), ("model.norm", NORMS), ("model.pos_emb", POSITIONS),
                          ("model.attention", ATTENTIONS)):
    for part, count in ours[field].items():
      if count != theirs[field][part]:
        name = getattr(m, field.split(".")[1])
        raise UserError(
            f"config field {field}={name!r}: its closed-form parameter count of {part}, "
            f"{count:,}, differs from the module's {theirs[field][part]:,} {totals}; fix the "
            f"entry's params in {registry.source(name)}")
  key = next(k for k in formula if formula[k] != measured.get(k))
  raise UserError(f"model/accounting.py's closed-form parameter count differs from the "
                  f"module's in {key} {totals}; fix formula_params for this config")


def kv_cache_bytes_per_token(model_cfg) -> int:
  """Decoder layers x the `model.attention` entry's cache per token and
  layer x bytes of model.dtype: 2 (K and V) x KV heads x head dim (mha), or
  kv_lora_rank + qk_rope_head_dim (mla: the latent and the shared rope key).

  An encoder-only model does not generate, so it has no cache (0). For an
  encoder-decoder this is the decoder's self-attention cache, as in
  `EncoderDecoder.init_cache`.
  """
  m = ModelConfig.resolve(model_cfg)
  if m.family == "encoder":
    return 0
  layers = m.num_decoder_layers if m.family == "encoder_decoder" else m.num_layers
  layers -= len(validation.linear_layers(m))  # a linear layer's state does not grow
  return layers * _kv_bytes_per_token_and_layer(m)


def _kv_bytes_per_token_and_layer(m) -> int:
  """One attention layer's KV cache per token: the `model.attention`
  entry's arrays in model.dtype."""
  per_layer = sum(math.prod(shape) for shape in ATTENTIONS[m.attention].cache(m).values())
  return per_layer * _itemsize(m.dtype)


def _linear_state_bytes_per_layer(m) -> int:
  """One linear_attention layer's decoding state per sequence: the rule
  state h_v x d_k x d_v in float32 and the convolutions' K-1 last inputs in
  model.dtype."""
  shapes = state_shapes(m)
  return (4 * math.prod(shapes["state"]) + _itemsize(m.dtype) * sum(
      math.prod(shape) for name, shape in shapes.items() if name != "state"))


def linear_state_bytes(model_cfg) -> int:
  """Bytes of the linear_attention layers' decoding state per sequence,
  whatever its length (`_linear_state_bytes_per_layer` each; 0 without
  them)."""
  m = ModelConfig.resolve(model_cfg)
  return len(validation.linear_layers(m)) * _linear_state_bytes_per_layer(m)


def _attention_flops(m, seq_len: int) -> int:
  """Forward FLOPs per token of one softmax attention sublayer's scores and
  weighted values, 2 S h (d_qk + d_v) (4 S d_attn where d_v = d_qk)."""
  return 2 * seq_len * m.num_heads * (m.head_dim + m.v_head_dim)


def layer_kind_costs(model_cfg, seq_len: int) -> dict[str, dict[str, int]]:
  """A decoder's costs per layer kind (`model.layer_types`' names, in the
  order they first appear), the lesson's cost side by side for a hybrid:
  `layers` of the kind; of one such layer, `params` and `params_active`
  (less the E - k experts a token skips), `flops_per_token_forward` (2 x
  its active parameters plus its token mixer's: `_attention_flops` at S =
  `seq_len`, or a linear layer's `gated_deltanet.rule_flops`, as
  `flops_per_token` counts them), and its decoding cache:
  `kv_cache_bytes_per_token` for an attention layer (grows with the
  context), `state_bytes_per_sequence` for a linear one (fixed)."""
  m = ModelConfig.resolve(model_cfg)
  costs = {}
  for i, name in enumerate(m.layer_types[:m.num_layers]):
    if name in costs:
      costs[name]["layers"] += 1
      continue
    kind = m.layer_kind(i)
    linear = kind.attention == "linear_attention"
    params = _layer_params(m, False, kind.moe, linear)["total"]
    active = params - ((m.num_experts - m.experts_per_token) * _expert_params(m) if kind.moe
                       else 0)
    mixer = rule_flops(m) if linear else _attention_flops(m, seq_len)
    costs[name] = dict(layers=1, params=params, params_active=active,
                       flops_per_token_forward=2 * active + mixer,
                       kv_cache_bytes_per_token=0 if linear else _kv_bytes_per_token_and_layer(m),
                       state_bytes_per_sequence=_linear_state_bytes_per_layer(m) if linear else 0)
  return costs


def flops_per_token(model_cfg, seq_len: int, train: bool = True, mtp_depth: int = 0) -> int:
  """Matmul FLOPs per token, the PaLM convention (docs/benchmarks.md's MFU).

  Forward = 2 N + 4 L S d_attn, with N the parameters without the position
  tables (for a mixture of experts the active ones, `params_active`: a token
  runs k experts, not E), S = `seq_len` (QK^T and AV, not halved for causal) and d_attn =
  heads x head_dim; train = 3 x forward = 6 N + 12 L S d_attn. Under
  attention=mla, whose queries and keys are head_dim = qk_nope_head_dim +
  qk_rope_head_dim wide and values v_head_dim, 4 d_attn is 2 heads x
  (head_dim + v_head_dim), and 2 N counts every MLA matrix once per token,
  as training and scoring run it (expanded keys and values; the absorbed
  decoding step differs: docs/models.md). L counts
  attention sublayers: the layers of a decoder or encoder; for an
  encoder-decoder the encoder's self-attention plus the decoder's self- and
  cross-attention, a "token" then being one source and one target token of
  equal length S. A linear_attention layer's rule costs
  `gated_deltanet.rule_flops` per token instead, whatever S.

  With `mtp_depth` = D multi-token prediction modules (train.mtp_depth), each
  adds its own 2 x `mtp_module_params` (less its experts a token skips,
  `mtp_inactive_params`), its block's attention and the shared head's d x V
  matmul once more: D x (2 (module + d V) + 4 S d_attn).
  """
  m = ModelConfig.resolve(model_cfg)
  params = formula_params(m)
  n = params["params_active"] - params["params_position_table"]
  linear = len(validation.linear_layers(m))
  attention_layers = sum(num * (2 if cross else 1) for _, num, cross in _layer_stacks(m)) - linear
  attention = _attention_flops(m, seq_len)
  mtp_active = mtp_module_params(m) - mtp_inactive_params(m)
  forward = 2 * n + attention_layers * attention + linear * rule_flops(m) + mtp_depth * (
      2 * (mtp_active + m.d_model * m.vocab_size) + attention)
  return 3 * forward if train else forward


def tokens_per_step(train) -> int:
  """Tokens of one optimizer step, train.batch_size x train.seq_len (padding
  included; train.grad_accum_steps splits the batch, it adds nothing)."""
  return train.batch_size * train.seq_len


def flops_per_step(config) -> int:
  """Training FLOPs of one optimizer step: `flops_per_token` (with the
  train.mtp_depth modules) x `tokens_per_step`."""
  return flops_per_token(config.model, config.train.seq_len, train=True,
                         mtp_depth=config.train.mtp_depth) * tokens_per_step(config.train)


def with_budget(config):
  """`config` with train.num_steps set by its budget: floor(train.token_budget /
  tokens per step) or floor(train.flop_budget / training FLOPs per step), and
  then train.warmup_steps by train.warmup_fraction (round(fraction x
  num_steps)); the config itself when none of them is set. train.py, sweep.py,
  compile.py and model.summary apply it after `validate`, before anything reads
  num_steps (the schedule, the start-up summary, config.json), so that they
  agree. It first checks the closed form those counts rest on
  (`check_formula`). A budget short of one step is a UserError."""
  check_formula(config.model, config.train.mtp_depth)
  given = validation.budget(config.train)
  fraction = config.train.get("warmup_fraction")
  if given is None and fraction is None:
    return config
  config = config.copy_and_resolve_references()
  if given is not None:
    field, amount = given
    per_step, what = ((tokens_per_step(config.train), "tokens") if field == "train.token_budget"
                      else (flops_per_step(config), "training FLOPs"))
    steps = int(amount // per_step)
    if steps < 1:
      raise UserError(f"{field}={amount:g} is less than one step ({per_step:,} {what} at "
                      f"train.batch_size={config.train.batch_size} x train.seq_len="
                      f"{config.train.seq_len}); raise it")
    config.train.num_steps = steps
  if fraction is not None:
    # A positive fraction warms up at least one step (inverse_sqrt needs one).
    config.train.warmup_steps = max(round(fraction * config.train.num_steps),
                                    1 if fraction > 0 else 0)
  return config


def _layer_activation_elements(m, seq_len: int, cross: bool, backend: str | None,
                               context: int = 1, moe: bool = False, expert: int = 1) -> int:
  """Elements one layer keeps per token for the backward pass (no remat);
  `moe`: its MLP is a mixture of experts, over `expert` devices."""
  d, f = m.d_model, m.d_ff
  materialised = context == 1 and model_implementation(m, backend) in _MATERIALISED_SCORES
  scores = m.num_heads * seq_len if materialised else 0
  attention = ATTENTIONS[m.attention].activations(m) + scores
  mlp = d + 2 * (MLPS[m.mlp].matrices - 1) * f
  if moe:
    k, hidden = m.experts_per_token, 2 * (MLPS[m.mlp].matrices - 1)
    # Over expert devices a device's receive buffer holds X rows per row it
    # sends (every peer may route all of its rows to it), or c at capacity c.
    buffer = expert if expert == 1 or not m.moe_capacity_factor else max(
        1.0, min(expert, m.moe_capacity_factor))
    mlp = (d + 4 * m.num_experts + 2 * k * d + buffer * (2 * k * d if expert > 1 else 0)
           + buffer * k * hidden * m.moe_d_ff + hidden * m.num_shared_experts * m.moe_d_ff)
    mlp = math.ceil(mlp)
  norms = (3 if cross else 2) * d
  return (2 if cross else 1) * attention + mlp + norms


def _saved_elements(m, policy) -> int:
  """Elements per token one layer keeps beside its input under a remat
  `policy` (model/remat.py): the tagged tensors it saves (an MLA or linear-
  attention layer's projections count as multi-head attention's)."""
  h, g, dk, d = m.num_heads, m.num_kv_heads, m.head_dim, m.d_model
  sizes = {"query_proj": h * dk, "key_proj": g * dk, "value_proj": g * dk,
           "attention_out": h * m.v_head_dim, "out_proj": d,
           "mlp_hidden": (MLPS[m.mlp].matrices - 1) * m.d_ff, "mlp_out": d}
  return sum(sizes[name] for name in policy.saves)


def activation_bytes_per_token(model_cfg, seq_len: int, remat,
                               backend: str | None = None, context: int = 1,
                               expert: int = 1) -> int:
  """Activation memory per token of a training step, after Korthikanti et al.

  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models") count, per layer and 16-bit activations, s b h (34 +
  5 a s / h) bytes: the inputs every matmul, norm and nonlinearity keeps for
  its backward pass. Adapted to this model (no dropout, so no masks; GQA;
  any d_ff; both MLPs) the elements per token per layer are

    attention  d (input of W_Q, W_K, W_V) + 2 h d_k (Q; input of W_O)
               + 2 g d_k (K, V) + h S (probabilities; only for the
               reference and xla implementations, fused kernels recompute;
               `auto` as the dispatcher resolves it on `backend`, default
               JAX's default backend: cudnn for 16-bit on a GPU, else xla;
               none with `context` > 1, whose ring recomputes its tiles)
               + h d_k + g d_k (the inputs of the qk_norm RMSNorms);
               under attention=mla, d + 2 q_lora_rank + 2 kv_lora_rank
               (the latents' norm inputs and up-projections' inputs) + 2 h
               (d_n + d_r) (Q, K) + 2 h d_v (V, input of o_proj) + h S
               (`model.mla.mla_activation_elements`)
    mlp        d (input) + 2 d_ff (plain: the activation's input and output)
                         or 4 d_ff (gated: gate, act(gate), up, product)
    experts    (a mixture-of-experts layer's MLP, `model/moe.py`) d (input) +
               4 E (the router's float32 logits and probabilities) + 2 k d
               (each token's k rows sorted by expert, and their outputs) +
               k times the MLP's hidden elements at moe_d_ff, and the shared
               experts' at num_shared_experts x moe_d_ff; over `expert` = X
               devices the receive buffer's 2 k d rows in and out and the
               hidden elements count X times (its worst-case size), or
               min(X, c) times at capacity factor c
    norms      d per norm (its input)

  times the bytes of model.dtype; cross-attention counts like attention
  (source as long as target). For MHA, a GELU MLP with d_ff = 4d and 16-bit
  this is 32 d + 2 h S bytes, the paper's 34 s b h + 5 a s^2 b less the
  dropout masks and dropout outputs. Outside the layers: the head's input (d
  elements; with `head_transform` 3 d more, the inputs of its dense,
  activation and norm), the input of each stack's `embedding_norm` (d) and
  the float32 logits (4 V bytes).

  With remat (train.remat: a policy name of model/remat.py, or a bool, True
  meaning full) each block keeps only its input (d elements per layer) and
  the tensors its policy saves (`_saved_elements`) and recomputes the rest in
  the backward pass, where one block's full activations are live at a time.
  """
  m = ModelConfig.resolve(model_cfg)
  stacks = _layer_stacks(m)
  n_moe = len(m.moe_layers)  # a decoder's (the one stack of a model with experts)
  per_layer = [(num - n_moe, _layer_activation_elements(m, seq_len, cross, backend, context))
               for _, num, cross in stacks]
  if n_moe:
    per_layer.append((n_moe, _layer_activation_elements(m, seq_len, False, backend, context,
                                                        moe=True, expert=expert)))
  policy = remat_policy(remat)
  if policy.remat:
    layer_elements = (sum(num for num, _ in per_layer) * (m.d_model + _saved_elements(m, policy))
                      + max(elements for num, elements in per_layer if num))
  else:
    layer_elements = sum(num * elements for num, elements in per_layer)
  outside = m.d_model * (1 + 3 * m.head_transform + len(stacks) * m.embedding_norm)
  return (layer_elements + outside) * _itemsize(m.dtype) + 4 * m.vocab_size


def mtp_activation_bytes_per_token(model_cfg, seq_len: int, backend: str | None = None,
                                   context: int = 1, expert: int = 1) -> int:
  """Activation memory per token of one multi-token prediction module
  (`model/mtp.py`, train.mtp_depth), counted as `activation_bytes_per_token`
  counts a layer: the inputs of its norms of the embedding and of h (2 d),
  of M_k (2 d), its block's (a decoder layer's, with experts over `expert`
  devices where the last layer has them), its final norm's
  (d, pre-norm), the head's input (d; 3 d more with `head_transform`) and
  its float32 logits (4 V bytes). train.remat leaves the modules out (only
  the decoder's blocks recompute), so this holds with it too."""
  m = ModelConfig.resolve(model_cfg)
  block = _layer_activation_elements(m, seq_len, False, backend, context,
                                     moe=m.layer_is_moe(m.num_layers - 1), expert=expert)
  elements = (4 * m.d_model + block
              + m.d_model * (m.norm_position == "pre") + m.d_model * (1 + 3 * m.head_transform))
  return elements * _itemsize(m.dtype) + 4 * m.vocab_size


def _moments(t, params: dict) -> int:
  """Optimizer moments kept, in parameters: adamw two per parameter, lion one,
  muon one on the non-embedding parameters (its matrices) and two on the
  embeddings and head (its AdamW part), adafactor at most one (a factored
  matrix keeps a row and a column) and one more with adafactor_momentum."""
  n, embedding = params["params_total"], params["params_embedding"]
  return {"adamw": 2 * n, "lion": n, "muon": n + embedding,
          "adafactor": n * (1 + (t.adafactor_momentum is not None))}[t.optimizer]


def training_memory_bytes(config, backend: str | None = None) -> dict[str, int]:
  """Bytes of a training step, summed over all devices (before sharding).

  `parameters` and `gradients` in model.param_dtype; `optimizer_state`:
  float32 moments of train.optimizer (`_moments`); `activations` at train.batch_size x
  train.seq_len, divided by train.grad_accum_steps (one micro-batch is live
  at a time; see `activation_bytes_per_token`, which also says what
  `backend` means); `total`: their sum. The train.mtp_depth multi-token
  prediction modules count in each: their parameters (`formula_params`),
  gradients, moments and activations (`mtp_activation_bytes_per_token`).
  With train.loss_chunk_size the float32 logits (4 V bytes a token, each
  head's) count for one chunk of that many tokens instead
  (training/objectives.py `chunked_loss_sums`: a chunk's logits live at a
  time, recomputed in the backward pass); with the fused loss kernel
  (`model.kernels.fuses_loss`: train.loss_impl pallas, or auto on a "gpu"
  `backend`) none, but its saved P W, 4 M bytes a token.
  """
  m, t = ModelConfig.resolve(config.model), config.train
  params = formula_params(m, t.mtp_depth)
  n = params["params_total"]
  tokens = t.batch_size // t.grad_accum_steps * t.seq_len
  context = config.mesh.context
  per_token = activation_bytes_per_token(m, t.seq_len, t.remat, backend, context,
                                         config.mesh.get("expert", 1))
  if t.mtp_depth:
    per_token += t.mtp_depth * mtp_activation_bytes_per_token(m, t.seq_len, backend, context,
                                                              config.mesh.get("expert", 1))
  activations = tokens * per_token
  if fuses_loss(t.loss_impl, backend or jax.default_backend(),
                head_fuses=m.final_softcap is None and not m.output_bias,
                chunk_size=t.loss_chunk_size):
    activations -= tokens * (1 + t.mtp_depth) * 4 * (m.vocab_size - m.d_model)
  elif t.loss_chunk_size:
    logits_per_token = 4 * m.vocab_size
    activations -= tokens * (1 + t.mtp_depth) * logits_per_token
    activations += min(tokens, t.loss_chunk_size) * logits_per_token
  memory = dict(parameters=n * _itemsize(m.param_dtype),
                gradients=n * _itemsize(m.param_dtype),
                optimizer_state=_moments(t, params) * 4,
                activations=activations)
  memory["total"] = sum(memory.values())
  return memory


def context_attention_flops(model_cfg, seq_len: int, n: int) -> dict:
  """Training attention FLOPs of one row per step on each of the `n` devices
  of the context axis (`model/context_parallel.py`): the (query, key) pairs a
  device computes (`causal_work`: hidden chunk pairs skipped) x 2 (head_dim
  + v_head_dim) (Q K^T and P V, 2 FLOPs a multiply-add; 4 head_dim but under
  MLA) x heads x attention layers (a hybrid's linear layers have none) x 3
  (forward and backward), with the zig-zag layout the model uses and, for
  comparison, the contiguous split."""
  m = ModelConfig.resolve(model_cfg)
  layers = m.num_layers - len(validation.linear_layers(m))
  per_pair = 2 * (m.head_dim + m.v_head_dim) * m.num_heads * layers * 3
  return {layout: [int(pairs) * per_pair for pairs in context_parallel.causal_work(seq_len, n,
                                                                                   layout)]
          for layout in ("zigzag", "contiguous")}
