"""Qwen3-Next (`qwen3_next`, `Qwen3NextForCausalLM`): a hybrid of Gated
DeltaNet layers (`linear_attention`, model/gated_deltanet.py) and gated
full-attention layers, with experts and a gated shared expert.

Config: transformers' `layer_types` is our `model.layer_types`, written as
the shortest tuple that repeats to the layers, each kind `+moe` where
`mlp_only_layers` and `decoder_sparse_step` give the layer experts (as
Qwen3-MoE's); every norm is zero-centred (`model.norm=rmsnorm_zero_centred`:
the blocks', the final norm, q_norm and k_norm; Gated DeltaNet's gated norm
is a plain RMSNorm, as transformers'); the full layers have QK-norm, the
output gate (`model.attention_output_gate`) and partial RoPE
(`rope_parameters.partial_rotary_factor`, `model.partial_rotary_factor`,
0.25 when absent as in transformers); each MoE layer has one shared expert
of `shared_expert_intermediate_size` (`model.num_shared_experts` times
`moe_intermediate_size`) gated by `shared_expert_gate`
(`model.moe_shared_expert_gate`).

Qwen3.5's text model (`qwen3_5_text`, `Qwen3_5ForCausalLM`) is the same
hybrid with dense MLPs only and Gated DeltaNet's projections unfused by kind:
`in_proj_qkv` (every key head's query, then every key head's key, then
every value head's value), `in_proj_z`, `in_proj_b`, `in_proj_a`. Its
multimodal RoPE (`mrope_section`, `mrope_interleaved`) rotates every
section by the token's position for text, which is plain RoPE: the two
fields are inert here.

Tensors: `q_proj` holds each head's query then its gate ([q_h, gate_h] per
head h), split into our W_Q and W_G. Gated DeltaNet's fused projections hold,
per key head, its query, key, then its value heads' values and z
(`in_proj_qkvz`), and its value heads' b then a (`in_proj_ba`); its one
depthwise convolution [channels, 1, K] runs over q, k, v concatenated. Ours
are separate (`q_proj`, ..., `conv_q`, `conv_k`, `conv_v`).
"""
import numpy as np

from configs.errors import UserError
from configs.validation import layer_kind
from hf.llama import MOE_TRAINING, QWEN_EXPERTS, expert_tensors, rope_from_hf, rope_to_hf
from hf.tables import (Architecture, ROTARY, Tensor, check_fields, linear_in, linear_out, same,
                       transposed)

_BODY_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
           "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling",
           "rope_parameters", "partial_rotary_factor", "layer_types", "linear_conv_kernel_dim",
           "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
           "linear_num_value_heads", "full_attention_interval"}
_FIELDS = _BODY_FIELDS | {"decoder_sparse_step", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "num_experts_per_tok",
                          "num_experts", "norm_topk_prob", "mlp_only_layers"} | MOE_TRAINING
_MROPE = ("mrope_section", "mrope_interleaved")


def shortest_cycle(kinds) -> tuple[str, ...]:
  """The shortest prefix of `kinds` that, repeated, gives all of them."""
  n = len(kinds)
  period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
  return tuple(kinds[:period])


def _rope(hf: dict) -> dict:
  """`rope_from_hf` with `partial_rotary_factor` taken out of
  `rope_parameters` (or the top level, older files); 0.25 without it."""
  params = {k: v for k, v in dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}
                                  ).items() if k not in _MROPE}
  factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  rest = {k: v for k, v in hf.items() if k not in ("rope_scaling", "partial_rotary_factor")}
  return dict(rope_from_hf(dict(rest, rope_parameters=params)), partial_rotary_factor=factor)


def _layers(hf: dict, num_layers: int, name: str) -> list[str]:
  """Every layer's kind, ours: transformers' layer_types (without it, every
  `full_attention_interval`-th layer full, the others linear; the published
  files' form), +moe where Qwen3-Next builds experts."""
  interval = hf.get("full_attention_interval", 4)
  kinds = hf.get("layer_types") or [
      "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
  if len(kinds) != num_layers or not set(kinds) <= {"linear_attention", "full_attention"}:
    raise UserError(f"Hugging Face config field layer_types={kinds!r} is not supported by the "
                    f"{name} import (needs {num_layers} of linear_attention, full_attention)")
  step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
  experts = hf.get("num_experts", 512) > 0
  return [kind + ("+moe" if experts and i not in dense and (i + 1) % step == 0 else "")
          for i, kind in enumerate(kinds)]


def _body(hf: dict, kinds) -> dict:
  """Our fields of the hybrid both families share, `kinds` every layer's."""
  d, h = hf.get("hidden_size", 2048), hf.get("num_attention_heads", 16)
  return dict(vocab_size=hf.get("vocab_size", 151936), d_model=d, num_layers=len(kinds),
              num_heads=h, num_kv_heads=hf.get("num_key_value_heads") or h,
              head_dim=hf.get("head_dim") or 256, d_ff=hf.get("intermediate_size", 5632),
              max_len=hf.get("max_position_embeddings", 32768), pos_emb="rope",
              norm="rmsnorm_zero_centred", norm_position="pre",
              norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", use_bias=False, qk_norm=True,
              attention_output_gate=True, tie_embeddings=hf.get("tie_word_embeddings", False),
              **_rope(hf), layer_types=shortest_cycle(kinds),
              linear_num_key_heads=hf.get("linear_num_key_heads", 16),
              linear_num_value_heads=hf.get("linear_num_value_heads", 32),
              linear_key_head_dim=hf.get("linear_key_head_dim", 128),
              linear_value_head_dim=hf.get("linear_value_head_dim", 128),
              linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4))


def _from_hf(hf: dict) -> dict:
  check_fields(hf, _FIELDS, {"hidden_act": "silu", "attention_bias": False}, "qwen3_next")
  kinds = _layers(hf, hf.get("num_hidden_layers", 48), "qwen3_next")
  out = _body(hf, kinds)
  if not any(layer_kind(kind).moe for kind in kinds):
    return out
  return dict(out, **_experts(hf, "qwen3_next"),
              moe_router="softmax_topk_norm" if hf.get("norm_topk_prob", True) else "softmax_topk")


def _experts(hf: dict, name: str, num_experts: int = 512, per_token: int = 10) -> dict:
  """The experts' fields (`num_experts`, `per_token`: the family's defaults)
  and the gated shared expert, whose width `shared_expert_intermediate_size`
  must be a multiple of the experts'."""
  f = hf.get("moe_intermediate_size", 512)
  shared = hf.get("shared_expert_intermediate_size", 512)
  if not shared or shared % f:
    raise UserError(f"Hugging Face config field shared_expert_intermediate_size={shared!r} is "
                    f"not supported by the {name} import (needs a positive multiple of "
                    f"moe_intermediate_size={f}: our shared experts are experts of that width)")
  return dict(num_experts=hf.get("num_experts", num_experts),
              experts_per_token=hf.get("num_experts_per_tok", per_token), moe_d_ff=f,
              num_shared_experts=shared // f, moe_shared_expert_gate=True)


def _body_to_hf(cfg, vocab_size: int) -> dict:
  """The fields both families share, written whatever ours says (the export
  check's round trip names what differs)."""
  rope = dict(rope_to_hf(cfg), partial_rotary_factor=cfg.partial_rotary_factor)
  return dict(vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope,
              attention_bias=False,
              layer_types=["linear_attention" if cfg.layer_is_linear(i) else "full_attention"
                           for i in range(cfg.num_layers)],
              linear_num_key_heads=cfg.linear_num_key_heads,
              linear_num_value_heads=cfg.linear_num_value_heads,
              linear_key_head_dim=cfg.linear_key_head_dim,
              linear_value_head_dim=cfg.linear_value_head_dim,
              linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)


def _to_hf(cfg, vocab_size: int) -> dict:
  """Our config -> Qwen3-Next's config.json."""
  moe = [i for i in range(cfg.num_layers) if cfg.layer_is_moe(i)]
  return dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
              **_body_to_hf(cfg, vocab_size), num_experts=cfg.num_experts if moe else 0,
              num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.moe_d_ff,
              shared_expert_intermediate_size=cfg.num_shared_experts * cfg.moe_d_ff,
              norm_topk_prob=cfg.moe_router == "softmax_topk_norm", decoder_sparse_step=1,
              mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe])


def _qwen3_5_from_hf(hf: dict) -> dict:
  """Qwen3.5's text model: the hybrid with dense MLPs."""
  check_fields(hf, _BODY_FIELDS, {"hidden_act": "silu", "attention_bias": False},
               "qwen3_5_text")
  kinds = _layers(dict(hf, num_experts=0), hf.get("num_hidden_layers", 32), "qwen3_5_text")
  return _body(hf, kinds)


def _qwen3_5_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
              **_body_to_hf(cfg, vocab_size))


_QWEN3_5_MOE_FIELDS = (_BODY_FIELDS - {"intermediate_size"}) | {
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "num_experts"} | MOE_TRAINING


def _qwen3_5_moe_from_hf(hf: dict) -> dict:
  """Qwen3.5's MoE text model: experts with the gated shared expert in every
  layer, top-k always renormalised (no dense MLP, no intermediate_size)."""
  check_fields(hf, _QWEN3_5_MOE_FIELDS, {"hidden_act": "silu", "attention_bias": False},
               "qwen3_5_moe_text")
  kinds = [kind + "+moe" for kind in _layers(dict(hf, num_experts=0),
                                             hf.get("num_hidden_layers", 40), "qwen3_5_moe_text")]
  return dict(_body(hf, kinds), **_experts(hf, "qwen3_5_moe_text", 256, 8),
              moe_router="softmax_topk_norm")


def _qwen3_5_moe_to_hf(cfg, vocab_size: int) -> dict:
  body = _body_to_hf(cfg, vocab_size)
  del body["intermediate_size"]
  return dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **body,
              num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.moe_d_ff,
              shared_expert_intermediate_size=cfg.num_shared_experts * cfg.moe_d_ff)


# The multimodal directories' top-level fields besides text_config: the vision
# tower's (read past) and its token ids.
_MULTIMODAL_FIELDS = {"text_config", "vision_config", "image_token_id", "video_token_id",
                      "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings"}


def _language_model(text_from_hf, text_to_hf, model_type: str, hf_class: str):
  """(config_from_hf, config_to_hf) of a multimodal Qwen3.5 directory
  (`model_type`, `hf_class`) over its text model's: `text_config` (the top
  level's tie_word_embeddings winning) is the text model's config.json;
  written back without a vision config."""
  def config_from_hf(hf: dict) -> dict:
    check_fields(hf, _MULTIMODAL_FIELDS, {}, model_type)
    text = {k: v for k, v in dict(hf.get("text_config") or {}).items() if k != "model_type"}
    if "tie_word_embeddings" in hf:
      text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text_from_hf(text)

  def config_to_hf(cfg, vocab_size: int) -> dict:
    text = text_to_hf(cfg, vocab_size)
    del text["architectures"]
    return dict(architectures=[hf_class], model_type=model_type,
                tie_word_embeddings=cfg.tie_embeddings, text_config=text)

  return config_from_hf, config_to_hf


def _query_and_gate(name, ours, m, heads, d) -> Tensor:
  """q_proj [heads * 2d, m], each head's query then its gate <-> our W_Q and
  W_G [m, heads, d]."""
  def to_ours(w):
    w = w.T.reshape(m, heads, 2, d)
    return w[:, :, 0], w[:, :, 1]
  return Tensor(name, (ours + "q_proj/kernel", ours + "gate_proj/kernel"), to_ours,
                lambda q, g: np.stack([q, g], axis=2).reshape(m, heads * 2 * d).T)


def _linear_tensors(cfg, hf: str, ours: str, fused: bool) -> list[Tensor]:
  """Gated DeltaNet's tensors (see the module docstring for the layouts):
  Qwen3-Next's `fused` projections or Qwen3.5's."""
  m, Hk, Hv = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_num_value_heads
  Dk, Dv, r, K = (cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk,
                  cfg.linear_conv_kernel_dim)

  def qkvz_to_ours(w):
    q, k, v, z = np.split(w.T.reshape(m, Hk, -1), np.cumsum([Dk, Dk, r * Dv]), axis=-1)
    return q, k, v.reshape(m, Hv, Dv), z.reshape(m, Hv, Dv)

  def qkvz_to_hf(q, k, v, z):
    return np.concatenate([q, k, v.reshape(m, Hk, r * Dv), z.reshape(m, Hk, r * Dv)],
                          axis=-1).reshape(m, -1).T

  def qkv_to_ours(w):
    q, k, v = np.split(w.T, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    return q.reshape(m, Hk, Dk), k.reshape(m, Hk, Dk), v.reshape(m, Hv, Dv)

  def qkv_to_hf(q, k, v):
    return np.concatenate([x.reshape(m, -1) for x in (q, k, v)], axis=-1).T

  def ba_to_ours(w):
    ba = w.T.reshape(m, Hk, 2 * r)
    return ba[..., :r].reshape(m, Hv), ba[..., r:].reshape(m, Hv)

  def ba_to_hf(b, a):
    return np.concatenate([b.reshape(m, Hk, r), a.reshape(m, Hk, r)], axis=-1).reshape(m, -1).T

  def conv_to_ours(w):
    cq, ck, cv = np.split(w[:, 0].T, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    return cq.reshape(K, Hk, Dk), ck.reshape(K, Hk, Dk), cv.reshape(K, Hv, Dv)

  def conv_to_hf(cq, ck, cv):
    return np.concatenate([c.reshape(K, -1) for c in (cq, ck, cv)], axis=-1).T[:, None, :]

  a = ours + "attn/"
  projections = ([Tensor(hf + "in_proj_qkvz.weight", tuple(a + f"{p}_proj/kernel" for p in "qkvz"),
                         qkvz_to_ours, qkvz_to_hf),
                  Tensor(hf + "in_proj_ba.weight", (a + "b_proj/kernel", a + "a_proj/kernel"),
                         ba_to_ours, ba_to_hf)] if fused else
                 [Tensor(hf + "in_proj_qkv.weight", tuple(a + f"{p}_proj/kernel" for p in "qkv"),
                         qkv_to_ours, qkv_to_hf),
                  linear_in(hf + "in_proj_z.weight", a + "z_proj/kernel", m, Hv, Dv),
                  transposed(hf + "in_proj_b.weight", a + "b_proj/kernel"),
                  transposed(hf + "in_proj_a.weight", a + "a_proj/kernel")])
  return projections + [
          Tensor(hf + "conv1d.weight", (a + "conv_q", a + "conv_k", a + "conv_v"),
                 conv_to_ours, conv_to_hf),
          same(hf + "A_log", a + "A_log"), same(hf + "dt_bias", a + "dt_bias"),
          same(hf + "norm.weight", a + "norm_scale"),
          linear_out(hf + "out_proj.weight", a + "o_proj/kernel", Hv, Dv, m)]


def _tensors(cfg, fused: bool = True) -> list[Tensor]:
  """Qwen3-Next's tensors (`fused`) or Qwen3.5's text model's."""
  m, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = [same("embed_tokens.weight", "decoder/embed/embedding", 0),
         same("norm.weight", "decoder/final_norm/scale")]
  for i in range(cfg.num_layers):
    hf, ours = f"layers.{i}.", f"decoder/layers/{i}/"
    out += [same(hf + "input_layernorm.weight", ours + "norm_attn/scale"),
            same(hf + "post_attention_layernorm.weight", ours + "norm_mlp/scale")]
    if cfg.layer_is_linear(i):
      out += _linear_tensors(cfg, hf + "linear_attn.", ours, fused)
    else:
      a = hf + "self_attn."
      out += [_query_and_gate(a + "q_proj.weight", ours + "attn/", m, h, d),
              linear_in(a + "k_proj.weight", ours + "attn/k_proj/kernel", m, k, d),
              linear_in(a + "v_proj.weight", ours + "attn/v_proj/kernel", m, k, d),
              linear_out(a + "o_proj.weight", ours + "attn/o_proj/kernel", h, d, m),
              same(a + "q_norm.weight", ours + "attn/q_norm/scale"),
              same(a + "k_norm.weight", ours + "attn/k_norm/scale")]
    if cfg.layer_is_moe(i):
      out += expert_tensors(cfg, hf, ours, QWEN_EXPERTS)
      out += [transposed(hf + f"mlp.shared_expert.{p}_proj.weight", ours + f"mlp/shared/{p}/kernel")
              for p in ("gate", "up", "down")]
      out.append(transposed(hf + "mlp.shared_expert_gate.weight", ours + "mlp/shared_gate/kernel"))
    else:
      out += [transposed(hf + f"mlp.{p}_proj.weight", ours + f"mlp/{p}/kernel")
              for p in ("gate", "up", "down")]
  if not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


QWEN3_NEXT = Architecture("qwen3_next", "Qwen3NextForCausalLM", "model.", _from_hf, _to_hf,
                          _tensors, skipped=ROTARY)
QWEN3_5_TEXT = Architecture("qwen3_5_text", "Qwen3_5ForCausalLM", "model.", _qwen3_5_from_hf,
                            _qwen3_5_to_hf, lambda cfg: _tensors(cfg, fused=False),
                            skipped=ROTARY)
QWEN3_5_MOE_TEXT = Architecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "model.",
                                _qwen3_5_moe_from_hf, _qwen3_5_moe_to_hf,
                                lambda cfg: _tensors(cfg, fused=False), skipped=ROTARY)
# The multimodal directories (Qwen/Qwen3.5-*): the language model under
# model.language_model., the vision tower (model.visual.) and the
# multi-token-prediction module (mtp.) read past. Import only: their text
# models export as Qwen3.5's text model or Qwen3-Next.
_MULTIMODAL = dict(unprefixed=("lm_head.",), skipped=ROTARY,
                   dropped=lambda hf: ("model.visual.", "mtp."))
QWEN3_5 = Architecture("qwen3_5", "Qwen3_5ForConditionalGeneration", "model.language_model.",
                       *_language_model(_qwen3_5_from_hf, _qwen3_5_to_hf, "qwen3_5",
                                        "Qwen3_5ForConditionalGeneration"),
                       lambda cfg: _tensors(cfg, fused=False), **_MULTIMODAL)
QWEN3_5_MOE = Architecture("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
                           "model.language_model.",
                           *_language_model(_qwen3_5_moe_from_hf, _qwen3_5_moe_to_hf,
                                            "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
                           lambda cfg: _tensors(cfg, fused=False), **_MULTIMODAL)
