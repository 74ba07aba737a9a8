"""The typed model config: the `model` section resolved once.

`ModelConfig.resolve(config.model)` validates the section (the rules of
`configs/validation.py`), computes the derived values (`head_dim`,
`v_head_dim`, `num_kv_heads`, `q_lora_rank`, `num_decoder_layers`, `real_vocab_size`, the
per-projection and classifier biases, the layers with the sliding window, the
layout of the layers (`scan_layers`),
`scale_embeddings`, `attention_scale`), looks every option up in its
registry (`REGISTRIES`), resolves the dtypes to jnp dtypes and checks that
the chosen attention implementation takes what the config asks of it
(`model.attention.check_support`).
Every module, the accounting and the attention dispatcher read this frozen
dataclass; nothing below `build_model` sees the ConfigDict.
"""
import dataclasses
import json
from typing import Any

from configs import validation
from model.attention import IMPLEMENTATIONS, check_support
from model.attention_kinds import ATTENTIONS
from model.embeddings import ROPE_SCALINGS
from model.layers import DTYPES
from model.mlp import MLPS
from model.moe import ROUTERS
from model.norms import NORMS
from model.positions import POSITIONS
from model.scores import SCORES


# Fields that say how the model is computed or initialised, not what it computes.
_HOW = ("attention_impl", "pallas_lowering", "dtype", "param_dtype", "fp8", "fp8_history",
        "init_std", "use_bias", "scan_layers", "scan_unroll", "layer_cycle")

# Every option axis the model implements: its field -> its registry. Resolving
# a config looks each chosen name up, so a name in CHOICES without an entry is
# one line at start-up; `forward_fields` drops the fields that only unchosen
# entries read.
REGISTRIES = {r.field: r for r in (NORMS, POSITIONS, MLPS, ATTENTIONS, SCORES, IMPLEMENTATIONS,
                                   ROPE_SCALINGS, ROUTERS)}


# ModelConfig.resolve's sections, by their JSON, and how many it keeps.
_RESOLVED: dict[str, "ModelConfig"] = {}
_RESOLVED_MAX = 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every field of the `model` section (see configs/base.py), with the
  optional ones filled in and `dtype`/`param_dtype` as jnp dtypes.
  `real_vocab_size` is vocab_size when the section leaves it None;
  `sliding_window_layers` is always the sorted tuple of the windowed layers
  (every layer when the section leaves it None; none without a window), and
  `moe_layers` of the layers with experts (none for a dense model);
  `moe_d_ff` is d_ff when the section leaves it None; under
  `attention=mla`, `head_dim` is the query/key width qk_nope_head_dim +
  qk_rope_head_dim and `num_kv_heads` is num_heads (the training
  attention's expanded keys), under mha `v_head_dim` is head_dim;
  `q_lora_rank` is 0 for None (queries projected directly);
  `layer_types` is every layer's kind (`configs.validation.layer_types`: the
  section's tuple repeated to the layers, or the kinds its
  sliding_window_layers and moe_layers give), from which
  `sliding_window_layers` and `moe_layers` are derived, and `layer_cycle`
  its declared period (0 without one; `model.transformer.layer_plan`);
  `scan_layers` is resolved to a bool (`configs.validation.scan_layers`)."""
  family: str
  vocab_size: int
  real_vocab_size: int
  d_model: int
  num_layers: int
  num_decoder_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  attention: str
  q_lora_rank: int
  kv_lora_rank: int | None
  qk_nope_head_dim: int | None
  qk_rope_head_dim: int | None
  v_head_dim: int
  d_ff: int
  max_len: int
  pos_emb: str
  attention_score: str
  relative_buckets: int
  relative_max_distance: int
  rope_theta: float
  rope_scaling: str
  rope_scaling_factor: float
  rope_original_max_len: int
  rope_beta_fast: float
  rope_beta_slow: float
  rope_attention_factor: float | None
  rope_truncate: bool
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  partial_rotary_factor: float
  norm: str
  norm_position: str
  norm_eps: float
  mlp: str
  num_experts: int
  experts_per_token: int
  moe_d_ff: int
  num_shared_experts: int
  moe_shared_expert_gate: bool
  moe_router: str
  moe_n_group: int
  moe_topk_group: int
  moe_routed_scaling_factor: float
  moe_group_mask_fill: str
  moe_layers: tuple[int, ...]
  moe_capacity_factor: float
  use_bias: bool
  qkv_bias: bool
  out_bias: bool
  mlp_bias: bool
  scale_embeddings: bool
  attention_scale: float
  tie_embeddings: bool
  decoder_start: str
  scale_head_input: bool
  type_vocab_size: int
  embedding_norm: bool
  head_transform: bool
  output_bias: bool
  attention_output_gate: bool
  qk_norm: bool
  attn_softcap: float | None
  final_softcap: float | None
  num_labels: int
  pooling: str
  pooler: bool
  classifier_bias: bool
  sliding_window: int | None
  sliding_window_layers: tuple[int, ...]
  layer_types: tuple[str, ...]
  layer_cycle: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int
  linear_chunk_size: int
  scan_layers: bool
  scan_unroll: int
  attention_impl: str
  pallas_lowering: str
  dtype: Any
  param_dtype: Any
  fp8: str
  fp8_history: int
  init_std: float
  parametrization: str
  mup_base_width: int | None
  mup_output_mult: float
  mup_base_depth: int | None

  def forward_fields(self) -> dict:
    """The fields that decide the function the model computes, each once.

    Left out: how it is computed (`attention_impl`, `pallas_lowering`,
    `dtype`, `param_dtype`, `fp8`, `scan_layers`), how it is initialised (`init_std`), `use_bias`
    (the three per-projection biases resolve it), and the fields the others
    leave unused: those that only unchosen registry entries read (RoPE's
    without `pos_emb=rope`, the scaling parameters the scaling type does not
    read, the relative bias's without `pos_emb=relative`: each entry's
    `reads`), the experts' without `num_experts` (`d_ff` with experts in
    every layer), the decoder's without
    `family=encoder_decoder`, the
    LM head's with a classifier (`num_labels` > 0) and the classifier's
    without one. Two
    configs with equal forward fields and equal weights give the same logits.
    """
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
              if f.name not in _HOW}
    unused = set()
    for field, registry in REGISTRIES.items():
      unused |= registry.reads(getattr(self, field.split(".")[1]))
    if self.family != "encoder_decoder":
      unused |= {"num_decoder_layers", "decoder_start"}
    if self.parametrization != "mup":
      unused |= {"mup_base_width", "mup_output_mult"}
    if self.mup_base_depth is None or self.branch_mult is None:
      unused |= {"mup_base_depth"}
    if not self.num_experts:
      unused |= {"experts_per_token", "moe_d_ff", "num_shared_experts", "moe_router",
                 "moe_capacity_factor", "moe_shared_expert_gate"}
    elif len(self.moe_layers) == self.num_layers:
      unused |= {"d_ff"}  # every MLP is a mixture of experts of moe_d_ff
    if not any(self.layer_kind(i).attention == "linear_attention"
               for i in range(len(self.layer_types))):
      unused |= {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "linear_chunk_size"}
    else:
      unused |= {"linear_chunk_size"}  # how the rule is computed, not what
    if self.num_labels:
      unused |= {"tie_embeddings", "scale_head_input", "head_transform", "output_bias"}
    else:
      unused |= {"pooling", "pooler", "classifier_bias"}
    return {k: v for k, v in fields.items() if k not in unused}

  @classmethod
  def resolve(cls, section) -> "ModelConfig":
    """The `model` ConfigDict section -> a ModelConfig (a ModelConfig passes
    through). Raises `UserError` for a bad value. Resolved once per distinct
    section: the entry points, the accounting, the steps and the modules all
    ask for the same section's, and get the one computed first."""
    if isinstance(section, cls):
      return section
    key = json.dumps(section.to_dict(), sort_keys=True, default=repr)
    if key not in _RESOLVED:
      if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
      _RESOLVED[key] = cls._resolve(section)
    return _RESOLVED[key]

  @classmethod
  def _resolve(cls, section) -> "ModelConfig":
    validation.validate_model(section)
    for field, registry in REGISTRIES.items():
      registry[section[field.split(".")[1]]]  # pylint: disable=pointless-statement
    values = {field.name: section[field.name] for field in dataclasses.fields(cls)
              if field.name in section}
    values.update(num_kv_heads=validation.num_kv_heads(section),
                  head_dim=validation.head_dim(section),
                  v_head_dim=validation.v_head_dim(section),
                  q_lora_rank=section.q_lora_rank or 0,
                  num_decoder_layers=validation.num_decoder_layers(section),
                  real_vocab_size=validation.real_vocab_size(section),
                  sliding_window_layers=validation.sliding_window_layers(section),
                  layer_types=validation.layer_types(section),
                  layer_cycle=validation.layer_cycle(section),
                  **validation.linear_heads(section),
                  moe_layers=validation.moe_layers(section),
                  moe_d_ff=validation.moe_d_ff(section),
                  scan_layers=validation.scan_layers(section),
                  qkv_bias=validation.projection_bias(section, "qkv_bias"),
                  out_bias=validation.projection_bias(section, "out_bias"),
                  mlp_bias=validation.projection_bias(section, "mlp_bias"),
                  classifier_bias=validation.classifier_bias(section),
                  scale_embeddings=(POSITIONS[section.pos_emb].scales_embeddings
                                    if section.scale_embeddings is None
                                    else section.scale_embeddings),
                  attention_scale=validation.attention_scale(section),
                  dtype=DTYPES[section.dtype], param_dtype=DTYPES[section.param_dtype])
    cfg = cls(**values)
    check_support(cfg)
    return cfg

  @property
  def rotary_dim(self) -> int:
    """The width RoPE rotates in each query and key head: head_dim, or MLA's
    qk_rope_head_dim (the `model.attention` entry's)."""
    return ATTENTIONS[self.attention].rotary_dim(self)

  @property
  def width_mult(self) -> float:
    """μP's width multiplier, d_model / mup_base_width (1 under sp)."""
    return validation.width_mult(self)

  @property
  def hidden_std(self) -> float:
    """The init std of the hidden matrices (attention and MLP projections):
    init_std, over sqrt(width multiplier) under μP (variance 1 / fan_in
    relative to the base width)."""
    return self.init_std / self.width_mult ** 0.5

  @property
  def logit_mult(self) -> float | None:
    """μP's factor on the logits, mup_output_mult / width multiplier (the
    readout multiplier, Tensor Programs V's alpha_output / m); None when it is 1."""
    if self.parametrization != "mup":
      return None
    mult = self.mup_output_mult / self.width_mult
    return None if mult == 1.0 else mult

  @property
  def branch_mult(self) -> float | None:
    """Depth-μP's factor on each residual branch, sqrt(mup_base_depth /
    num_layers); None when it is 1 (no base depth, or at it)."""
    mult = validation.depth_mult(self)
    return None if mult == 1.0 else mult

  def layer_kind(self, layer: int) -> validation.LayerKind:
    """Layer `layer`'s kind (of `layer_types`): its attention, experts or not."""
    return validation.layer_kind(self.layer_types[layer])

  def layer_is_moe(self, layer: int) -> bool:
    """Whether decoder layer `layer`'s MLP is a mixture of experts."""
    return self.layer_kind(layer).moe

  def layer_is_linear(self, layer: int) -> bool:
    """Whether layer `layer`'s token mixer is Gated DeltaNet's linear attention."""
    return self.layer_kind(layer).attention == "linear_attention"

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of decoder layer `layer`'s self-attention (None: it
    sees every earlier key)."""
    sliding = self.layer_kind(layer).attention == "sliding_attention"
    return self.sliding_window if sliding else None
