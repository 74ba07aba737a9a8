"""Per-architecture mappings between Hugging Face checkpoints and our models.

An `Architecture` says, for one Hugging Face `model_type`:
- `config_from_hf(hf)`: the HF config.json -> our `model` fields; every HF
  field is either honoured, known to leave the forward pass unchanged
  (`_INERT`: dropouts, token ids, bookkeeping), or refused by name;
- `check_ours(cfg)`: why a `ModelConfig` has no such HF architecture ("" if it has);
- `config_to_hf(cfg, vocab_size)`: our config -> the HF config.json fields;
- `tensors(cfg)`: each HF tensor name with our parameter paths it fills
  (`Tensor`, with the transposes/reshapes both ways).

Torch `Linear` weights are [out, in]; ours are [in, ...]. GPT-2's `Conv1D` is
already [in, out] and packs q, k, v into one `c_attn`. Both RoPE layouts
rotate pairs (x[i], x[i + D/2]), so no permutation is needed. A new
architecture (BERT, T5, BART, Qwen2) is one more entry in `ARCHITECTURES`.
"""
import dataclasses
from collections.abc import Callable

import numpy as np

from configs.errors import UserError

# HF config fields that do not change what the model computes at inference:
# bookkeeping, token ids (the tokenizer carries them), dropouts (our model has
# none; a fine-tune runs without them) and initialisation.
_INERT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout",
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type",
    "summary_use_proj", "task_specific_params", "n_ctx", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "reorder_and_upcast_attn",
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor and the parameters of ours it holds.

  `to_ours(array)` gives one array per path in `paths`; `to_hf(*arrays)`
  packs them back.
  """
  hf_name: str
  paths: tuple[str, ...]
  to_ours: Callable
  to_hf: Callable


def _same(name, path):
  return Tensor(name, (path,), lambda w: (w,), lambda w: w)


def _transposed(name, path):
  """A torch Linear [out, in] <-> our [in, out]."""
  return Tensor(name, (path,), lambda w: (w.T,), lambda k: k.T)


def _linear_in(name, path, m, heads, d):
  """torch Linear [heads*d, m] <-> our projection [m, heads, d]."""
  return Tensor(name, (path,), lambda w: (w.T.reshape(m, heads, d),),
                lambda k: k.reshape(m, heads * d).T)


def _linear_out(name, path, heads, d, m):
  """torch Linear [m, heads*d] <-> our output projection [heads, d, m]."""
  return Tensor(name, (path,), lambda w: (w.T.reshape(heads, d, m),),
                lambda k: k.reshape(heads * d, m).T)


def _fields(hf: dict, honoured: set, required: dict, name: str) -> None:
  """Refuses the first HF field that is neither honoured, inert, nor at the
  value `required` gives it (a required False also takes null)."""
  for key, value in hf.items():
    if key in required:
      if value != required[key] and not (required[key] is False and not value):
        raise UserError(f"Hugging Face config field {key}={value!r} is not supported by the "
                        f"{name} import (needs {required[key]!r})")
    elif key not in honoured and key not in _INERT:
      raise UserError(f"Hugging Face config field {key}={value!r} is not supported by the "
                      f"{name} import")


def _plain_attention(cfg, *, bias: bool) -> dict:
  """The option values of a model whose projections all have `bias` or none,
  with unscaled embeddings, 1/sqrt(head_dim) scores, no window, an unscaled
  head input (T5's), and none of BERT's extras (GPT-2, LLaMA)."""
  return dict(qkv_bias=bias, out_bias=bias, mlp_bias=bias, scale_embeddings=False,
              attention_scale=cfg.head_dim ** -0.5, sliding_window=None, type_vocab_size=0,
              embedding_norm=False, head_transform=False, output_bias=False,
              scale_head_input=False)


def _need(cfg, **values) -> str:
  """Names the first field of `cfg` that differs from `values` ("" if none)."""
  for key, value in values.items():
    if getattr(cfg, key) != value:
      return f"model.{key}={getattr(cfg, key)!r} (needs {value!r})"
  return ""


# --- GPT-2 -----------------------------------------------------------------

def _gpt2_from_hf(hf: dict) -> dict:
  _fields(hf, {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
               "layer_norm_epsilon", "tie_word_embeddings"},
          {"activation_function": "gelu_new", "scale_attn_weights": True,
           "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}, "gpt2")
  d = hf.get("n_embd", 768)
  return dict(vocab_size=hf.get("vocab_size", 50257), d_model=d, num_layers=hf.get("n_layer", 12),
              num_heads=hf.get("n_head", 12), d_ff=hf.get("n_inner") or 4 * d,
              max_len=hf.get("n_positions", 1024), pos_emb="learned", norm="layernorm",
              norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu_tanh",
              use_bias=True, tie_embeddings=hf.get("tie_word_embeddings", True))


def _gpt2_check(cfg) -> str:
  if cfg.num_kv_heads != cfg.num_heads or cfg.head_dim * cfg.num_heads != cfg.d_model:
    return (f"model.num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim} (needs "
            f"num_heads={cfg.num_heads} heads of d_model/num_heads)")
  return _need(cfg, family="decoder", pos_emb="learned", norm="layernorm", norm_position="pre",
               mlp="gelu_tanh", **_plain_attention(cfg, bias=True))


def _gpt2_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=vocab_size,
              n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.num_layers,
              n_head=cfg.num_heads, n_inner=cfg.d_ff, activation_function="gelu_new",
              layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)


def _gpt2_tensors(cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [_same("wte.weight", "decoder/embed/embedding"),
         _same("wpe.weight", "decoder/positions/table"),
         _same("ln_f.weight", "decoder/final_norm/scale"),
         _same("ln_f.bias", "decoder/final_norm/bias")]
  for i in range(cfg.num_layers):
    hf, ours = f"h.{i}.", f"decoder/layers/{i}/"
    qkv = tuple(f"{ours}attn/{p}_proj/" for p in "qkv")
    out += [
        _same(hf + "ln_1.weight", ours + "norm_attn/scale"),
        _same(hf + "ln_1.bias", ours + "norm_attn/bias"),
        _same(hf + "ln_2.weight", ours + "norm_mlp/scale"),
        _same(hf + "ln_2.bias", ours + "norm_mlp/bias"),
        Tensor(hf + "attn.c_attn.weight", tuple(p + "kernel" for p in qkv),
               lambda w: tuple(x.reshape(m, h, d) for x in np.split(w, 3, axis=1)),
               lambda *ks: np.concatenate([k.reshape(m, h * d) for k in ks], axis=1)),
        Tensor(hf + "attn.c_attn.bias", tuple(p + "bias" for p in qkv),
               lambda b: tuple(x.reshape(h, d) for x in np.split(b, 3)),
               lambda *bs: np.concatenate([b.reshape(-1) for b in bs])),
        Tensor(hf + "attn.c_proj.weight", (ours + "attn/o_proj/kernel",),
               lambda w: (w.reshape(h, d, m),), lambda k: k.reshape(h * d, m)),
        _same(hf + "attn.c_proj.bias", ours + "attn/o_proj/bias"),
        _same(hf + "mlp.c_fc.weight", ours + "mlp/up/kernel"),
        _same(hf + "mlp.c_fc.bias", ours + "mlp/up/bias"),
        _same(hf + "mlp.c_proj.weight", ours + "mlp/down/kernel"),
        _same(hf + "mlp.c_proj.bias", ours + "mlp/down/bias"),
    ]
  if not cfg.tie_embeddings:
    out.append(_transposed("lm_head.weight", "head/kernel"))
  return out


# --- LLaMA and Mistral -------------------------------------------------------

def _rope(hf: dict) -> dict:
  """RoPE base and scaling from `rope_parameters` (transformers 5) or
  `rope_theta`/`rope_scaling` (earlier files): `default` or `linear`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.pop("rope_type", params.pop("type", "default"))
  factor = params.pop("factor", 1.0) if kind == "linear" else 1.0
  if kind not in ("default", "linear"):
    raise UserError(f"Hugging Face config field rope_type={kind!r} is not supported by the "
                    "import (default and linear are)")
  if params:
    key = next(iter(params))
    raise UserError(f"Hugging Face config field rope_parameters.{key}={params[key]!r} is not "
                    f"supported by the import with rope_type={kind!r}")
  return dict(rope_theta=theta, rope_scaling="none" if kind == "default" else "linear",
              rope_scaling_factor=factor)


def _llama_from_hf(hf: dict, name: str) -> dict:
  _fields(hf, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
               "rope_scaling", "rope_parameters"},
          {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
           "sliding_window": None}, name)
  d, h = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
  return dict(vocab_size=hf.get("vocab_size", 32000), d_model=d,
              num_layers=hf.get("num_hidden_layers", 32), num_heads=h,
              num_kv_heads=hf.get("num_key_value_heads") or h,
              head_dim=hf.get("head_dim") or d // h, d_ff=hf.get("intermediate_size", 11008),
              max_len=hf.get("max_position_embeddings", 2048), pos_emb="rope", norm="rmsnorm",
              norm_position="pre", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu",
              use_bias=False, tie_embeddings=hf.get("tie_word_embeddings", False), **_rope(hf))


def _llama_check(cfg) -> str:
  if cfg.rope_scaling not in ("none", "linear"):
    return f"model.rope_scaling={cfg.rope_scaling!r} (needs 'none' or 'linear')"
  return _need(cfg, family="decoder", pos_emb="rope", norm="rmsnorm", norm_position="pre",
               mlp="swiglu", **_plain_attention(cfg, bias=False))


def _llama_to_hf(cfg, vocab_size: int) -> dict:
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "linear":
    rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor}
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
              hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
              rope_parameters=rope)


def _llama_tensors(cfg) -> list[Tensor]:
  m, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = [_same("embed_tokens.weight", "decoder/embed/embedding"),
         _same("norm.weight", "decoder/final_norm/scale")]
  for i in range(cfg.num_layers):
    hf, ours = f"layers.{i}.", f"decoder/layers/{i}/"
    out += [
        _same(hf + "input_layernorm.weight", ours + "norm_attn/scale"),
        _same(hf + "post_attention_layernorm.weight", ours + "norm_mlp/scale"),
        _linear_in(hf + "self_attn.q_proj.weight", ours + "attn/q_proj/kernel", m, h, d),
        _linear_in(hf + "self_attn.k_proj.weight", ours + "attn/k_proj/kernel", m, k, d),
        _linear_in(hf + "self_attn.v_proj.weight", ours + "attn/v_proj/kernel", m, k, d),
        _linear_out(hf + "self_attn.o_proj.weight", ours + "attn/o_proj/kernel", h, d, m),
        _transposed(hf + "mlp.gate_proj.weight", ours + "mlp/gate/kernel"),
        _transposed(hf + "mlp.up_proj.weight", ours + "mlp/up/kernel"),
        _transposed(hf + "mlp.down_proj.weight", ours + "mlp/down/kernel"),
    ]
  if not cfg.tie_embeddings:
    out.append(_transposed("lm_head.weight", "head/kernel"))
  return out


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One Hugging Face architecture (see the module docstring).

  `prefix`: the body's prefix in HF tensor names ("model."), optional in files
  (GPT-2's own checkpoint has none); `lm_head.weight` never has it.
  `buffers`: tensor-name suffixes that are buffers, not weights (skipped).
  """
  model_type: str
  hf_class: str
  prefix: str
  config_from_hf: Callable[[dict], dict]
  check_ours: Callable
  config_to_hf: Callable
  tensors: Callable
  buffers: tuple[str, ...] = ()


ARCHITECTURES = {
    "gpt2": Architecture("gpt2", "GPT2LMHeadModel", "transformer.", _gpt2_from_hf, _gpt2_check,
                         _gpt2_to_hf, _gpt2_tensors, buffers=(".attn.bias", ".attn.masked_bias")),
    "llama": Architecture("llama", "LlamaForCausalLM", "model.",
                          lambda hf: _llama_from_hf(hf, "llama"), _llama_check, _llama_to_hf,
                          _llama_tensors, buffers=(".rotary_emb.inv_freq",)),
    "mistral": Architecture("mistral", "MistralForCausalLM", "model.",
                            lambda hf: _llama_from_hf(hf, "mistral"), _llama_check, _llama_to_hf,
                            _llama_tensors, buffers=(".rotary_emb.inv_freq",)),
}
# What a model of ours exports as (Mistral without a window is LLaMA).
EXPORTS = ("gpt2", "llama")
# Still to come, with the model options they need (issue 16).
PLANNED = ("bert", "t5", "bart", "qwen2")


def architecture_of(hf: dict) -> Architecture:
  """The mapping for an HF config.json, or a UserError naming its model_type."""
  kind = hf.get("model_type")
  if kind in ARCHITECTURES:
    return ARCHITECTURES[kind]
  later = " (planned)" if kind in PLANNED else ""
  raise UserError(f"Hugging Face model_type {kind!r}{later} is not supported; supported: "
                  f"{', '.join(ARCHITECTURES)}")
