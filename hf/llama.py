"""LLaMA, Mistral, Qwen2, Qwen3 and their mixtures of experts (Mixtral,
Qwen3-MoE): one tensor table, six config mappings (rope scaling types,
Mistral's window, Qwen2's per-layer window, Qwen3's QK-norm: Qwen2's layout
without q/k/v biases, with an RMSNorm of each head's queries and keys before
RoPE, `model.qk_norm`; its head_dim may differ from hidden_size /
num_attention_heads; the experts of `model/moe.py`: a router and each
expert's three matrices, `expert_tensors`). Both RoPE layouts rotate pairs (x[i],
x[i + D/2]), so no permutation is needed. LLaMA's and Qwen2's
`*ForSequenceClassification`: the body and a `score` matrix without bias on
the last real token (pooling=last), no LM head."""
from configs.errors import UserError
from hf.tables import (Architecture, ROTARY, Tensor, bias_in, check_fields, classifier_fields,
                       labels_to_hf, linear_in, linear_out, same, transposed)


# rope_type -> {HF rope_parameters key: (our model field, default)}; a None
# default is required, except yarn's attention_factor (None: from the factor).
_ROPE_PARAMS = {
    "default": {},
    "linear": {"factor": ("rope_scaling_factor", 1.0)},
    "yarn": {"factor": ("rope_scaling_factor", None),
             "original_max_position_embeddings": ("rope_original_max_len", None),
             "beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
             "attention_factor": ("rope_attention_factor", None),
             "truncate": ("rope_truncate", True)},
    "llama3": {"factor": ("rope_scaling_factor", None),
               "original_max_position_embeddings": ("rope_original_max_len", None),
               "low_freq_factor": ("rope_low_freq_factor", None),
               "high_freq_factor": ("rope_high_freq_factor", None)},
}


def rope_from_hf(hf: dict) -> dict:
  """RoPE base and scaling from `rope_parameters` (transformers 5) or
  `rope_theta`/`rope_scaling` (earlier files): rope_type default, linear,
  yarn or llama3, each parameter as transformers defines it (yarn's factor
  defaults to max_position_embeddings / original_max_position_embeddings)."""
  params = {k: v for k, v in dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}
                                  ).items() if v is not None}
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.pop("rope_type", params.pop("type", "default"))
  if kind not in _ROPE_PARAMS:
    raise UserError(f"Hugging Face config field rope_type={kind!r} is not supported by the "
                    f"import ({', '.join(_ROPE_PARAMS)} are)")
  out = dict(rope_theta=theta, rope_scaling="none" if kind == "default" else kind)
  for key, (field, default) in _ROPE_PARAMS[kind].items():
    out[field] = params.pop(key, default)
  if params:
    key = next(iter(params))
    raise UserError(f"Hugging Face config field rope_parameters.{key}={params[key]!r} is not "
                    f"supported by the import with rope_type={kind!r}")
  if kind == "yarn":
    max_len = hf.get("max_position_embeddings", 2048)
    if out["rope_original_max_len"] is None:
      out["rope_original_max_len"] = max_len
    if out["rope_scaling_factor"] is None:
      out["rope_scaling_factor"] = max_len / out["rope_original_max_len"]
  for key, (field, _) in _ROPE_PARAMS[kind].items():
    if out[field] is None and field != "rope_attention_factor":
      raise UserError(f"Hugging Face config field rope_parameters.{key} is missing "
                      f"(rope_type={kind!r} needs it)")
  return out


def rope_to_hf(cfg) -> dict:
  """Our RoPE fields -> HF `rope_parameters` (inverse of `rope_from_hf`); a scaling
  HF does not define (ntk) is written as none, so the round trip names it."""
  kind = cfg.rope_scaling if cfg.rope_scaling in _ROPE_PARAMS else "default"
  out = {"rope_type": kind, "rope_theta": cfg.rope_theta}
  for key, (field, _) in _ROPE_PARAMS[kind].items():
    if getattr(cfg, field) is not None:
      out[key] = getattr(cfg, field)
  return out


_LLAMA_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
                 "rope_scaling", "rope_parameters"}


def _llama_body(hf: dict) -> dict:
  """Our fields for the LLaMA body that Mistral and Qwen2 share."""
  d, h = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
  return dict(vocab_size=hf.get("vocab_size", 32000), d_model=d,
              num_layers=hf.get("num_hidden_layers", 32), num_heads=h,
              num_kv_heads=hf.get("num_key_value_heads") or h,
              head_dim=hf.get("head_dim") or d // h, d_ff=hf.get("intermediate_size", 11008),
              max_len=hf.get("max_position_embeddings", 2048), pos_emb="rope", norm="rmsnorm",
              norm_position="pre", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu",
              use_bias=False, tie_embeddings=hf.get("tie_word_embeddings", False),
              **rope_from_hf(hf))


def _llama_from_hf(hf: dict) -> dict:
  check_fields(hf, _LLAMA_FIELDS, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                                    "pretraining_tp": 1}, "llama")
  return _llama_body(hf)


def _mistral_from_hf(hf: dict) -> dict:
  check_fields(hf, _LLAMA_FIELDS | {"sliding_window"}, {"hidden_act": "silu"}, "mistral")
  return dict(_llama_body(hf), sliding_window=hf.get("sliding_window"))


def _qwen2_window(hf: dict) -> dict:
  """Qwen2's own window as transformers 5 applies it: layer i attends to the
  last `sliding_window` keys (itself included) when `use_sliding_window` and
  `layer_types[i]` is "sliding_attention"; without `layer_types`, the layers
  i >= `max_window_layers`. -> our `sliding_window` and
  `sliding_window_layers` (None: every layer)."""
  num_layers = hf.get("num_hidden_layers", 32)
  window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
  first = hf.get("max_window_layers", 28)
  layer_types = hf.get("layer_types") or [
      "sliding_attention" if window is not None and i >= first else "full_attention"
      for i in range(num_layers)]
  if (len(layer_types) != num_layers
      or not set(layer_types) <= {"full_attention", "sliding_attention"}):
    raise UserError(f"Hugging Face config field layer_types={layer_types!r} is not supported "
                    f"by the qwen2 import (needs {num_layers} of full_attention, "
                    "sliding_attention)")
  layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
  if layers and window is None:
    raise UserError("Hugging Face config field layer_types has sliding_attention layers but "
                    f"use_sliding_window={hf.get('use_sliding_window')!r}, sliding_window="
                    f"{hf.get('sliding_window')!r}: no window for them (transformers refuses "
                    "it too)")
  if not layers:
    return dict(sliding_window=None, sliding_window_layers=None)
  return dict(sliding_window=window,
              sliding_window_layers=None if len(layers) == num_layers else layers)


def _qwen2_from_hf(hf: dict) -> dict:
  """Qwen2: LLaMA with q/k/v biases and its per-layer window (`_qwen2_window`)."""
  check_fields(hf, _LLAMA_FIELDS | {"use_sliding_window", "sliding_window", "max_window_layers",
                                     "layer_types"}, {"hidden_act": "silu"}, "qwen2")
  return dict(_llama_body(hf), qkv_bias=True, out_bias=False, mlp_bias=False, **_qwen2_window(hf))


def _qwen3_from_hf(hf: dict) -> dict:
  """Qwen3: LLaMA with QK-norm and Qwen2's per-layer window; no biases
  (attention_bias must be false)."""
  check_fields(hf, _LLAMA_FIELDS | {"use_sliding_window", "sliding_window", "max_window_layers",
                                     "layer_types"},
               {"hidden_act": "silu", "attention_bias": False}, "qwen3")
  return dict(_llama_body(hf), qk_norm=True, **_qwen2_window(hf))


MOE_TRAINING = {"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}


def _mixtral_from_hf(hf: dict) -> dict:
  """Mixtral: Mistral whose every MLP is num_local_experts SwiGLU experts of
  intermediate_size, softmax top-k renormalised (`moe_router=softmax_topk_norm`).
  The router's training fields (aux loss weight, jitter) leave inference
  unchanged."""
  check_fields(hf, _LLAMA_FIELDS | {"sliding_window", "num_local_experts",
                                     "num_experts_per_tok"} | MOE_TRAINING,
               {"hidden_act": "silu"}, "mixtral")
  return dict(_llama_body(hf), sliding_window=hf.get("sliding_window"),
              num_experts=hf.get("num_local_experts", 8),
              experts_per_token=hf.get("num_experts_per_tok", 2),
              moe_router="softmax_topk_norm")


def _qwen3_moe_layers(hf: dict):
  """The layers with experts as transformers builds Qwen3-MoE: layer i unless
  it is in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0."""
  step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
  num_layers = hf.get("num_hidden_layers", 32)
  layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
  if not layers:
    raise UserError("Hugging Face config fields decoder_sparse_step, mlp_only_layers leave no "
                    "layer with experts; import it as qwen3")
  return None if len(layers) == num_layers else layers


def _qwen3_moe_from_hf(hf: dict) -> dict:
  """Qwen3-MoE: Qwen3 (QK-norm, no biases) with experts of
  moe_intermediate_size in the layers `_qwen3_moe_layers` names (dense ones
  of intermediate_size elsewhere), top-k renormalised when norm_topk_prob."""
  check_fields(hf, _LLAMA_FIELDS | {"num_experts", "num_local_experts", "num_experts_per_tok",
                                     "moe_intermediate_size", "decoder_sparse_step",
                                     "mlp_only_layers", "norm_topk_prob", "sliding_window",
                                     "max_window_layers"} | MOE_TRAINING,
               {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
               "qwen3_moe")
  return dict(_llama_body(hf), qk_norm=True,
              num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
              experts_per_token=hf.get("num_experts_per_tok", 8),
              moe_d_ff=hf.get("moe_intermediate_size", 768),
              moe_router="softmax_topk_norm" if hf.get("norm_topk_prob") else "softmax_topk",
              moe_layers=_qwen3_moe_layers(hf))


def _llama_body_to_hf(cfg, vocab_size: int) -> dict:
  return dict(vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope_to_hf(cfg))


def _llama_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["LlamaForCausalLM"], model_type="llama",
              **_llama_body_to_hf(cfg, vocab_size), attention_bias=False, mlp_bias=False)


def _mistral_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["MistralForCausalLM"], model_type="mistral",
              **_llama_body_to_hf(cfg, vocab_size), sliding_window=cfg.sliding_window)


def _qwen_window_to_hf(cfg) -> dict:
  """Qwen2's and Qwen3's window: `layer_types` says which layers have it
  (`max_window_layers`, which transformers reads only without `layer_types`,
  is the first of them)."""
  layers = cfg.sliding_window_layers
  return dict(use_sliding_window=bool(layers), sliding_window=cfg.sliding_window,
              max_window_layers=layers[0] if layers else cfg.num_layers,
              layer_types=["sliding_attention" if i in layers else "full_attention"
                           for i in range(cfg.num_layers)])


def _qwen2_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
              **_llama_body_to_hf(cfg, vocab_size), **_qwen_window_to_hf(cfg))


def _qwen3_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
              **_llama_body_to_hf(cfg, vocab_size), attention_bias=False,
              **_qwen_window_to_hf(cfg))


def _mixtral_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
              **_llama_body_to_hf(cfg, vocab_size) | dict(intermediate_size=cfg.moe_d_ff),
              sliding_window=cfg.sliding_window, num_local_experts=cfg.num_experts,
              num_experts_per_tok=cfg.experts_per_token)


def _qwen3_moe_to_hf(cfg, vocab_size: int) -> dict:
  moe = set(cfg.moe_layers)
  return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
              **_llama_body_to_hf(cfg, vocab_size), attention_bias=False,
              use_sliding_window=False, num_experts=cfg.num_experts,
              num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.moe_d_ff,
              norm_topk_prob=cfg.moe_router == "softmax_topk_norm", decoder_sparse_step=1,
              mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe])


# Where a checkpoint keeps a mixture of experts: the block's name and each
# expert's gate, up and down matrices.
QWEN_EXPERTS = ("mlp.", ("gate_proj", "up_proj", "down_proj"))
_MIXTRAL_EXPERTS = ("block_sparse_moe.", ("w1", "w3", "w2"))


def expert_tensors(cfg, hf: str, ours: str, experts) -> list[Tensor]:
  """A mixture of experts' tensors as the checkpoints hold them: the router
  `<block>gate` and one tensor per matrix of each expert j (our `[j]` slice
  of the stacked [E, ...] weight), named by `experts` (`QWEN_EXPERTS`,
  `_MIXTRAL_EXPERTS`)."""
  block, names = experts
  out = [transposed(hf + block + "gate.weight", ours + "mlp/router/kernel")]
  for j in range(cfg.num_experts):
    out += [transposed(hf + f"{block}experts.{j}.{theirs}.weight", ours + f"mlp/{mine}/kernel[{j}]")
            for theirs, mine in zip(names, ("gate", "up", "down"))]
  return out


def _llama_tensors(cfg, experts=QWEN_EXPERTS) -> list[Tensor]:
  """LLaMA's and Mistral's tensors; Qwen2's with the q/k/v biases (cfg.qkv_bias),
  Qwen3's with the q/k norms (cfg.qk_norm); Mixtral's and Qwen3-MoE's with
  experts in the MoE layers (`expert_tensors`)."""
  m, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = [same("embed_tokens.weight", "decoder/embed/embedding", 0),
         same("norm.weight", "decoder/final_norm/scale")]
  for i in range(cfg.num_layers):
    hf, ours = f"layers.{i}.", f"decoder/layers/{i}/"
    out += [
        same(hf + "input_layernorm.weight", ours + "norm_attn/scale"),
        same(hf + "post_attention_layernorm.weight", ours + "norm_mlp/scale"),
        linear_in(hf + "self_attn.q_proj.weight", ours + "attn/q_proj/kernel", m, h, d),
        linear_in(hf + "self_attn.k_proj.weight", ours + "attn/k_proj/kernel", m, k, d),
        linear_in(hf + "self_attn.v_proj.weight", ours + "attn/v_proj/kernel", m, k, d),
        linear_out(hf + "self_attn.o_proj.weight", ours + "attn/o_proj/kernel", h, d, m),
    ]
    if cfg.layer_is_moe(i):
      out += expert_tensors(cfg, hf, ours, experts)
    else:
      out += [transposed(hf + f"mlp.{p}_proj.weight", ours + f"mlp/{p}/kernel")
              for p in ("gate", "up", "down")]
    if cfg.qkv_bias:
      out += [bias_in(hf + f"self_attn.{p}_proj.bias", ours + f"attn/{p}_proj/bias", heads, d)
              for p, heads in (("q", h), ("k", k), ("v", k))]
    if cfg.qk_norm:
      out += [same(hf + f"self_attn.{p}_norm.weight", ours + f"attn/{p}_norm/scale")
              for p in ("q", "k")]
  if cfg.num_labels:
    out.append(transposed("score.weight", "classifier/out/kernel"))
  elif not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


def _classifier(from_hf, to_hf, name: str):
  """(config_from_hf, config_to_hf) of `name`ForSequenceClassification over
  the causal LM's: the last real token's hidden state, `score` without bias."""

  def config_from_hf(hf: dict) -> dict:
    rest, fields = classifier_fields(hf, name.lower())
    return dict(from_hf(rest), pooling="last", pooler=False, classifier_bias=False, **fields)

  def config_to_hf(cfg, vocab_size: int) -> dict:
    return dict(to_hf(cfg, vocab_size), architectures=[f"{name}ForSequenceClassification"],
                **labels_to_hf([f"LABEL_{i}" for i in range(cfg.num_labels)]))

  return config_from_hf, config_to_hf


LLAMA = Architecture("llama", "LlamaForCausalLM", "model.", _llama_from_hf, _llama_to_hf,
                     _llama_tensors, skipped=ROTARY)
MISTRAL = Architecture("mistral", "MistralForCausalLM", "model.", _mistral_from_hf,
                       _mistral_to_hf, _llama_tensors, skipped=ROTARY)
QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", "model.", _qwen2_from_hf, _qwen2_to_hf,
                     _llama_tensors, skipped=ROTARY)
QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", "model.", _qwen3_from_hf, _qwen3_to_hf,
                     _llama_tensors, skipped=ROTARY)
MIXTRAL = Architecture("mixtral", "MixtralForCausalLM", "model.", _mixtral_from_hf,
                       _mixtral_to_hf, lambda cfg: _llama_tensors(cfg, _MIXTRAL_EXPERTS),
                       skipped=ROTARY)
QWEN3_MOE = Architecture("qwen3_moe", "Qwen3MoeForCausalLM", "model.", _qwen3_moe_from_hf,
                         _qwen3_moe_to_hf, _llama_tensors, skipped=ROTARY)
LLAMA_CLASSIFIER = Architecture(
    "llama", "LlamaForSequenceClassification", "model.", *_classifier(
        _llama_from_hf, _llama_to_hf, "Llama"), _llama_tensors, skipped=ROTARY,
    unprefixed=("score.",), read_past=lambda cfg: (), objective="classify",
    auto_class="AutoModelForSequenceClassification")
QWEN2_CLASSIFIER = Architecture(
    "qwen2", "Qwen2ForSequenceClassification", "model.", *_classifier(
        _qwen2_from_hf, _qwen2_to_hf, "Qwen2"), _llama_tensors, skipped=ROTARY,
    unprefixed=("score.",), read_past=lambda cfg: (), objective="classify",
    auto_class="AutoModelForSequenceClassification")
