"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`):
multi-head latent attention (`model.attention=mla`, model/mla.py) with
query latents or direct queries, dense SwiGLU layers first
(`first_k_dense_replace`, our `moe_layers`), then mixtures of experts with
shared experts (`model.num_shared_experts`).

The routers: DeepSeek-V3's group-limited sigmoid routing is
`moe_router=deepseek` (renormalised, `norm_topk_prob` true, scaled by
`routed_scaling_factor`), its `e_score_correction_bias` the layer's
selection bias `score_bias`, its ineligible groups' experts never chosen
(`moe_group_mask_fill="-inf"`, the default: DeepSeek's reference code and
transformers 5's DeepseekV3TopkRouter; a run of "0", the older fill, does
not export: transformers would route it otherwise whenever a token's best
eligible biased score is negative); DeepSeek-V2's `topk_method=greedy` softmax top
k, as transformers runs it (never renormalised, `norm_topk_prob` unread), is
`moe_router=softmax_topk` at `routed_scaling_factor` 1. The rest is refused
in one line: V2's group_limited_greedy, other scaling factors and
`norm_topk_prob`, V3 without `norm_topk_prob`.

Two conventions, as model/mla.py says: the rope columns of `q_b_proj` (or
`q_proj`, per head) and of `kv_a_proj_with_mqa` are read evens-then-odds
(`model.mla.deinterleave`) and written back interleaved (V3's
`rope_interleave` false, a transformers option no DeepSeek checkpoint has,
is refused); DeepSeek's yarn (`mscale`, `mscale_all_dim`)
becomes `rope_attention_factor` and `attention_scale`. DeepSeek-V3's
multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers
L, L + 1, ...) are not in transformers' model: an import whose file holds
them reads them as our MTP modules (train.mtp_depth, `_mtp_tensors`; their
copies of the embedding and head read past), one whose file has none (as
transformers saves) reads past the config's; an export writes a run's
modules as those layers, with the copies.
"""
import math

import numpy as np

from configs.errors import UserError
from hf.llama import MOE_TRAINING, QWEN_EXPERTS, expert_tensors, rope_from_hf, rope_to_hf
from hf.tables import (Architecture, MTPLayers, ROTARY, Tensor, check_fields, same,
                       transposed)
from model.mla import deinterleave

# Fields every DeepSeek config.json may hold. `head_dim` and `qk_head_dim`
# are derived (transformers sets them from qk_rope_head_dim and qk_nope_head_dim
# + qk_rope_head_dim, whatever the file says); `auto_map` names DeepSeek's own
# modelling code; `aux_loss_alpha`, `seq_aux` and `ep_size` are training and
# placement settings.
_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
           "rope_scaling", "rope_parameters", "attention_bias", "q_lora_rank", "kv_lora_rank",
           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
           "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group",
           "topk_group", "routed_scaling_factor", "norm_topk_prob", "head_dim", "qk_head_dim",
           "auto_map", "aux_loss_alpha", "seq_aux", "ep_size"} | MOE_TRAINING
_REQUIRED = {"hidden_act": "silu", "pretraining_tp": 1, "moe_layer_freq": 1}
# transformers' defaults of the fields a config.json may leave out
# (DeepseekV3Config: DeepSeek-V3's own values; DeepseekV2Config's).
_DEFAULTS = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 attention_bias=False)
_V3_DEFAULTS = dict(_DEFAULTS, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                    n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                    norm_topk_prob=True, max_position_embeddings=4096)
_V2_DEFAULTS = dict(_DEFAULTS, vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                    moe_intermediate_size=1407, num_hidden_layers=32, num_attention_heads=32,
                    n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
                    n_group=None, topk_group=None, num_experts_per_tok=None,
                    first_k_dense_replace=0, norm_topk_prob=False, max_position_embeddings=2048,
                    topk_method="greedy")


def _yarn(hf: dict, qk: int) -> dict:
  """RoPE (`hf.llama.rope_from_hf`) with DeepSeek's yarn: `mscale` m and
  `mscale_all_dim` m_a give cos and sin the factor (0.1 m ln s + 1) / (0.1
  m_a ln s + 1) (without both: transformers' 0.1 ln s + 1, ours by default)
  unless `attention_factor` is given, and m_a multiplies the softmax scale
  1 / sqrt(d_n + d_r) by (0.1 m_a ln s + 1)^2, as transformers computes them."""
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  params = dict(hf.get(key) or {})
  mscale, mscale_all = params.pop("mscale", None), params.pop("mscale_all_dim", None)
  out = rope_from_hf({**hf, key: params})
  if (mscale or mscale_all) and out["rope_scaling"] != "yarn":
    raise UserError(f"Hugging Face config field {key}.mscale / mscale_all_dim is not supported "
                    f"by the DeepSeek import with rope_type {out['rope_scaling']!r} (only "
                    "with yarn)")
  if out["rope_scaling"] != "yarn":
    return out

  def get_mscale(m):
    factor = out["rope_scaling_factor"]
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

  if out["rope_attention_factor"] is None and mscale and mscale_all:
    out["rope_attention_factor"] = float(get_mscale(mscale) / get_mscale(mscale_all))
  if mscale_all:
    out["attention_scale"] = qk ** -0.5 * get_mscale(mscale_all) * get_mscale(mscale_all)
  return out


def _mscale_all_dim(cfg) -> float | None:
  """The `mscale_all_dim` whose (0.1 m_a ln s + 1)^2 / sqrt(d_n + d_r) is
  `cfg.attention_scale` as `_yarn` computes it, bit for bit (the inverse's
  nearest floats tried); None for the unscaled 1 / sqrt(d_n + d_r)."""
  if cfg.attention != "mla" or cfg.rope_scaling != "yarn":
    return None
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  if cfg.attention_scale == qk ** -0.5:
    return None
  log = math.log(cfg.rope_scaling_factor) if cfg.rope_scaling_factor > 1 else 0.0
  if cfg.attention_scale <= 0 or log == 0.0:
    return 0.0
  guess = (math.sqrt(cfg.attention_scale * qk ** 0.5) - 1.0) / (0.1 * log)
  candidates = [guess]
  for direction in (math.inf, -math.inf):
    m = guess
    for _ in range(8):
      m = math.nextafter(m, direction)
      candidates.append(m)
  for m in candidates:
    mscale = 0.1 * m * log + 1.0
    if qk ** -0.5 * mscale * mscale == cfg.attention_scale:
      return m
  return guess


def _moe(hf: dict, name: str) -> dict:
  """The experts' fields: num_experts 0 (a dense model) when
  first_k_dense_replace covers every layer, else the layers from it on."""
  layers, first = hf["num_hidden_layers"], hf["first_k_dense_replace"] or 0
  if first >= layers:
    return dict(num_experts=0)
  k = hf["num_experts_per_tok"]
  if not isinstance(k, int):
    raise UserError(f"Hugging Face config field num_experts_per_tok={k!r} is not supported by "
                    f"the {name} import (its layers from first_k_dense_replace={first} on have "
                    "experts: needs an integer)")
  return dict(num_experts=hf["n_routed_experts"], experts_per_token=k,
              moe_d_ff=hf["moe_intermediate_size"], num_shared_experts=hf["n_shared_experts"],
              moe_layers=tuple(range(first, layers)) if first else None)


def _body(hf: dict, name: str) -> dict:
  """Our fields for what V2 and V3 share: the MLA decoder, RoPE, the experts
  (`hf` with its version's defaults)."""
  h = hf["num_attention_heads"]
  if hf.get("num_key_value_heads") not in (None, h):
    raise UserError(f"Hugging Face config field num_key_value_heads="
                    f"{hf['num_key_value_heads']!r} is not supported by the {name} import "
                    f"(needs num_attention_heads={h}: every MLA head has its own key)")
  nope, rope, bias = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], bool(hf["attention_bias"])
  return dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
              num_layers=hf["num_hidden_layers"], num_heads=h, d_ff=hf["intermediate_size"],
              max_len=hf["max_position_embeddings"], pos_emb="rope", norm="rmsnorm",
              norm_position="pre", norm_eps=hf["rms_norm_eps"], mlp="swiglu", use_bias=False,
              qkv_bias=bias, out_bias=bias, mlp_bias=False,
              tie_embeddings=bool(hf["tie_word_embeddings"]), attention="mla",
              q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
              qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=hf["v_head_dim"],
              **_yarn(hf, nope + rope), **_moe(hf, name))


def _v3_from_hf(hf: dict) -> dict:
  """DeepSeek-V3: the group-limited sigmoid router (`moe_router=deepseek`)."""
  check_fields(hf, _FIELDS | {"num_nextn_predict_layers", "num_mtp_layers"},
               {**_REQUIRED, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "rope_interleave": True}, "deepseek_v3")
  hf = {**_V3_DEFAULTS, **hf}
  out = _body(hf, "deepseek_v3")
  if not out["num_experts"]:
    return out
  if not hf["norm_topk_prob"]:
    raise UserError("Hugging Face config field norm_topk_prob=False is not supported by the "
                    "deepseek_v3 import (model.moe_router=deepseek renormalises the chosen "
                    "experts' weights)")
  return dict(out, moe_router="deepseek", moe_n_group=hf["n_group"],
              moe_topk_group=hf["topk_group"],
              moe_routed_scaling_factor=float(hf["routed_scaling_factor"]))


def _v2_from_hf(hf: dict) -> dict:
  """DeepSeek-V2: transformers' greedy softmax top k (`moe_router=softmax_topk`)."""
  check_fields(hf, _FIELDS | {"topk_method", "mlp_bias"},
               {**_REQUIRED, "mlp_bias": False, "scoring_func": "softmax"}, "deepseek_v2")
  hf = {**_V2_DEFAULTS, **hf}
  out = _body(hf, "deepseek_v2")
  if not out["num_experts"]:
    return out
  method = hf["topk_method"]
  if method != "greedy":
    raise UserError(f"Hugging Face config field topk_method={method!r} is not supported by the "
                    "deepseek_v2 import (greedy is: model.moe_router=softmax_topk; no router "
                    "here limits a softmax top k to groups)")
  if hf["routed_scaling_factor"] != 1.0:
    raise UserError(f"Hugging Face config field routed_scaling_factor="
                    f"{hf['routed_scaling_factor']!r} is not supported by the deepseek_v2 import "
                    "(needs 1.0: model.moe_router=softmax_topk does not scale its weights)")
  if hf["norm_topk_prob"]:
    raise UserError("Hugging Face config field norm_topk_prob=True is not supported by the "
                    "deepseek_v2 import (transformers' DeepseekV2 never renormalises, "
                    "DeepSeek's own code does: ambiguous; needs false)")
  return dict(out, moe_router="softmax_topk")


def _body_to_hf(cfg, vocab_size: int) -> dict:
  """The fields V2 and V3 share (dense: first_k_dense_replace = every layer,
  with placeholder experts transformers never builds; multi-head attention:
  MLA of its head width, which the round trip names)."""
  rope = rope_to_hf(cfg)
  mscale_all = _mscale_all_dim(cfg)
  if mscale_all is not None:
    rope["mscale_all_dim"] = mscale_all
  moe = set(cfg.moe_layers) if cfg.num_experts else set()
  first = min(moe) if moe else cfg.num_layers
  if moe and moe != set(range(first, cfg.num_layers)):
    first = cfg.num_layers - len(moe)  # the round trip names moe_layers
  experts = cfg.num_experts or 1
  return dict(vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
              moe_intermediate_size=cfg.moe_d_ff or cfg.d_ff, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              tie_word_embeddings=cfg.tie_embeddings, attention_bias=bool(cfg.qkv_bias),
              q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank or cfg.head_dim,
              qk_nope_head_dim=cfg.qk_nope_head_dim or cfg.head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim or 2,
              v_head_dim=cfg.v_head_dim or cfg.head_dim, rope_parameters=rope,
              first_k_dense_replace=first,
              n_routed_experts=experts,
              num_experts_per_tok=cfg.experts_per_token if cfg.num_experts else 1,
              n_shared_experts=cfg.num_shared_experts)


def _v3_to_hf(cfg, vocab_size: int) -> dict:
  deepseek = cfg.num_experts and cfg.moe_router == "deepseek"
  return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
              **_body_to_hf(cfg, vocab_size), rope_interleave=True, num_nextn_predict_layers=0,
              n_group=cfg.moe_n_group if deepseek else 1,
              topk_group=cfg.moe_topk_group if deepseek else 1,
              routed_scaling_factor=cfg.moe_routed_scaling_factor if deepseek else 1.0,
              norm_topk_prob=True)


def _v2_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
              **_body_to_hf(cfg, vocab_size), mlp_bias=False, topk_method="greedy",
              n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)


def _rope_columns(nope: int, rope: int) -> np.ndarray:
  """Our order of a query head's (or kv_a_proj's) columns from DeepSeek's:
  the unrotated `nope` as they are, the rotated `rope` evens-then-odds
  (`deinterleave`)."""
  return np.concatenate([np.arange(nope), nope + deinterleave(rope)])


def _queries(name, path, m, h, qk, columns) -> Tensor:
  """A torch Linear [h (d_n + d_r), m] <-> our [m, h, d_n + d_r], each head's
  columns in our order."""
  back = np.argsort(columns)
  return Tensor(name, (path,), lambda w: (w.T.reshape(m, h, qk)[..., columns],),
                lambda k: k[..., back].reshape(m, h * qk).T)


def _mla_tensors(cfg, hf: str, ours: str) -> list[Tensor]:
  """One layer's attention: query latents (q_a_proj, its norm, q_b_proj) or
  q_proj; kv_a_proj_with_mqa (its rope columns reordered), its norm,
  kv_b_proj, o_proj; the biases of `attention_bias`."""
  m, h, r = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank
  nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  q_cols, kv_cols = _rope_columns(nope, rope), _rope_columns(r, rope)
  kv_back = np.argsort(kv_cols)
  hf, ours = hf + "self_attn.", ours + "attn/"
  if cfg.q_lora_rank:
    out = [transposed(hf + "q_a_proj.weight", ours + "q_a_proj/kernel"),
           same(hf + "q_a_layernorm.weight", ours + "q_a_norm/scale"),
           _queries(hf + "q_b_proj.weight", ours + "q_b_proj/kernel", cfg.q_lora_rank, h,
                    nope + rope, q_cols)]
  else:
    out = [_queries(hf + "q_proj.weight", ours + "q_proj/kernel", m, h, nope + rope, q_cols)]
  out += [Tensor(hf + "kv_a_proj_with_mqa.weight", (ours + "kv_a_proj/kernel",),
                 lambda w: (w.T[:, kv_cols],), lambda k: k[:, kv_back].T),
          same(hf + "kv_a_layernorm.weight", ours + "kv_a_norm/scale"),
          Tensor(hf + "kv_b_proj.weight", (ours + "kv_b_proj/kernel",),
                 lambda w: (w.T.reshape(r, h, nope + v),), lambda k: k.reshape(r, -1).T),
          Tensor(hf + "o_proj.weight", (ours + "o_proj/kernel",),
                 lambda w: (w.T.reshape(h, v, m),), lambda k: k.reshape(h * v, m).T)]
  if cfg.qkv_bias:
    out += [Tensor(hf + "kv_a_proj_with_mqa.bias", (ours + "kv_a_proj/bias",),
                   lambda b: (b[kv_cols],), lambda b: b[kv_back])]
    if cfg.q_lora_rank:
      out.append(same(hf + "q_a_proj.bias", ours + "q_a_proj/bias"))
  if cfg.out_bias:
    out.append(same(hf + "o_proj.bias", ours + "o_proj/bias"))
  return out


def _layer_tensors(cfg, hf: str, ours: str, *, moe: bool, selection_bias: bool) -> list[Tensor]:
  """One decoder layer's (`hf` and `ours` its name prefixes): its norms,
  attention (`_mla_tensors`) and MLP, dense or experts
  (`hf.llama.expert_tensors`) with the shared experts' MLP."""
  out = [same(hf + "input_layernorm.weight", ours + "norm_attn/scale"),
         same(hf + "post_attention_layernorm.weight", ours + "norm_mlp/scale"),
         *_mla_tensors(cfg, hf, ours)]
  if not moe:
    return out + [transposed(hf + f"mlp.{p}_proj.weight", ours + f"mlp/{p}/kernel")
                  for p in ("gate", "up", "down")]
  if selection_bias:  # zeros in a file without it, as transformers initialises it
    out.append(Tensor(hf + "mlp.gate.e_score_correction_bias", (ours + "mlp/score_bias",),
                      lambda b: (b,), lambda b: b, zeros_if_missing=True))
  out += expert_tensors(cfg, hf, ours, QWEN_EXPERTS)
  if cfg.num_shared_experts:
    out += [transposed(hf + f"mlp.shared_experts.{p}_proj.weight",
                       ours + f"mlp/shared/{p}/kernel") for p in ("gate", "up", "down")]
  return out


def _tensors(cfg, *, selection_bias: bool) -> list[Tensor]:
  """The embedding, each layer's (`_layer_tensors`), the final norm and the
  head."""
  out = [same("embed_tokens.weight", "decoder/embed/embedding", 0),
         same("norm.weight", "decoder/final_norm/scale")]
  for i in range(cfg.num_layers):
    out += _layer_tensors(cfg, f"layers.{i}.", f"decoder/layers/{i}/", moe=cfg.layer_is_moe(i),
                          selection_bias=selection_bias)
  if not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


def _read_past(cfg) -> tuple[str, ...]:
  """A tied head's copy, and the empty shared-expert MLPs of n_shared_experts 0."""
  out = ("lm_head.weight",) if cfg.tie_embeddings else ()
  if cfg.num_experts and not cfg.num_shared_experts:
    out += tuple(f"layers.{i}.mlp.shared_experts.{p}_proj.weight"
                 for i in range(cfg.num_layers) if cfg.layer_is_moe(i)
                 for p in ("gate", "up", "down"))
  return out


def _mtp_layers(hf: dict) -> tuple[str, ...]:
  """The tensor-name prefixes of DeepSeek-V3's multi-token-prediction layers,
  layers L .. L + n - 1 (transformers' default n: 1), which its model has
  not: read past where the import does not read them (`_mtp_depth` 0)."""
  layers = hf.get("num_hidden_layers", _V3_DEFAULTS["num_hidden_layers"])
  n = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
  return tuple(f"layers.{layers + j}." for j in range(n))


def _mtp_depth(hf: dict, names: set) -> int:
  """The multi-token-prediction modules a V3 import reads (train.mtp_depth):
  `num_nextn_predict_layers` when the file holds the first one's `eh_proj`
  (layer L), else 0 (transformers' own saves hold none: read past)."""
  layers = hf.get("num_hidden_layers", _V3_DEFAULTS["num_hidden_layers"])
  n = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
  return n if f"layers.{layers}.eh_proj.weight" in names else 0


def _mtp_tensors(cfg, depth: int) -> list[Tensor]:
  """Module j's tensors as DeepSeek-V3 names layer L + j: `enorm`, `hnorm`,
  `eh_proj` [d, 2d] (its input [enorm(emb); hnorm(h)], our M_k [2, d, d]),
  the decoder layer of the last layer's kind (`_layer_tensors`) and
  `shared_head.norm` (our final norm)."""
  d, moe = cfg.d_model, cfg.layer_is_moe(cfg.num_layers - 1)
  out = []
  for j in range(depth):
    hf, ours = f"layers.{cfg.num_layers + j}.", f"mtp/{j}/"
    out += [same(hf + "enorm.weight", ours + "enorm/scale"),
            same(hf + "hnorm.weight", ours + "hnorm/scale"),
            Tensor(hf + "eh_proj.weight", (ours + "eh_proj/kernel",),
                   lambda w: (w.T.reshape(2, d, d),), lambda k: k.reshape(2 * d, d).T),
            same(hf + "shared_head.norm.weight", ours + "final_norm/scale"),
            *_layer_tensors(cfg, hf, ours + "block/", moe=moe, selection_bias=True)]
  return out


def _mtp_copies(cfg, depth: int) -> list[Tensor]:
  """Module j's `embed_tokens` and `shared_head.head`: the model's embedding
  and head (the embedding when tied), which our modules share."""
  head = (same if cfg.tie_embeddings else transposed)
  out = []
  for j in range(depth):
    hf = f"layers.{cfg.num_layers + j}."
    out += [same(hf + "embed_tokens.weight", "decoder/embed/embedding", 0),
            head(hf + "shared_head.head.weight",
                 "decoder/embed/embedding" if cfg.tie_embeddings else "head/kernel",
                 0 if cfg.tie_embeddings else 1)]
  return out


DEEPSEEK_V3 = Architecture(
    "deepseek_v3", "DeepseekV3ForCausalLM", "model.", _v3_from_hf, _v3_to_hf,
    lambda cfg: _tensors(cfg, selection_bias=True), skipped=ROTARY, read_past=_read_past,
    dropped=_mtp_layers,
    mtp=MTPLayers(_mtp_depth, _mtp_tensors, _mtp_copies,
                  lambda depth: {"num_nextn_predict_layers": depth}))
DEEPSEEK_V2 = Architecture(
    "deepseek_v2", "DeepseekV2ForCausalLM", "model.", _v2_from_hf, _v2_to_hf,
    lambda cfg: _tensors(cfg, selection_bias=False), skipped=ROTARY, read_past=_read_past)
