"""Per-architecture mappings between Hugging Face checkpoints and our models.

An `Architecture` says, for one Hugging Face `model_type`:
- `config_from_hf(hf)`: the HF config.json -> our `model` fields; every HF
  field is either honoured, known to leave the forward pass unchanged
  (`_INERT`: dropouts, token ids, bookkeeping), or refused by name;
- `config_to_hf(cfg, vocab_size)`: our config -> the HF config.json fields.
  it never raises: a value the architecture cannot express is written as the
  nearest one it can, so that the export check (`hf_convert.export_architecture`,
  the round trip through `config_from_hf`) names our field that does not come
  back;
- `tensors(cfg)`: each HF tensor name with our parameter paths it fills
  (`Tensor`, with the transposes/reshapes both ways).

Torch `Linear` weights are [out, in]; ours are [in, ...]. GPT-2's `Conv1D` is
already [in, out] and packs q, k, v into one `c_attn`. Both RoPE layouts
rotate pairs (x[i], x[i + D/2]), so no permutation is needed. A new
architecture is one more entry in `ARCHITECTURES`.
"""
import dataclasses
from collections.abc import Callable

import numpy as np

from configs.errors import UserError
from model.mlp import is_gated

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
    "gradient_checkpointing", "hidden_dropout_prob", "attention_probs_dropout_prob",
    "classifier_dropout", "_name_or_path", "_attn_implementation_autoset",
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor and the parameters of ours it holds.

  `to_ours(array)` gives one array per path in `paths`; `to_hf(*arrays)`
  packs them back. `vocab_axis`: the axis of our (single) array that runs over
  the vocabulary (cut to the tokenizer's rows on export), None if none.
  `zeros_if_missing`: a file without it is read as zeros, as transformers
  does (BART's `final_logits_bias` in files saved from `BartModel`).
  """
  hf_name: str
  paths: tuple[str, ...]
  to_ours: Callable
  to_hf: Callable
  vocab_axis: int | None = None
  zeros_if_missing: bool = False


def _same(name, path, vocab_axis=None):
  return Tensor(name, (path,), lambda w: (w,), lambda w: w, vocab_axis)


def _transposed(name, path, vocab_axis=None):
  """A torch Linear [out, in] <-> our [in, out]."""
  return Tensor(name, (path,), lambda w: (w.T,), lambda k: k.T, vocab_axis)


def _bias_in(name, path, heads, d):
  """A torch Linear bias [heads*d] <-> our projection bias [heads, d]."""
  return Tensor(name, (path,), lambda b: (b.reshape(heads, d),), lambda b: b.reshape(-1))


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


def _gpt2_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=vocab_size,
              n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.num_layers,
              n_head=cfg.num_heads, n_inner=cfg.d_ff, activation_function="gelu_new",
              layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)


def _gpt2_tensors(cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [_same("wte.weight", "decoder/embed/embedding", 0),
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
    out.append(_transposed("lm_head.weight", "head/kernel", 1))
  return out


# --- LLaMA, Mistral and Qwen2 ------------------------------------------------

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


def _rope(hf: dict) -> dict:
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


def _rope_to_hf(cfg) -> dict:
  """Our RoPE fields -> HF `rope_parameters` (inverse of `_rope`); a scaling
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
              use_bias=False, tie_embeddings=hf.get("tie_word_embeddings", False), **_rope(hf))


def _llama_from_hf(hf: dict) -> dict:
  _fields(hf, _LLAMA_FIELDS, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                              "pretraining_tp": 1}, "llama")
  return _llama_body(hf)


def _mistral_from_hf(hf: dict) -> dict:
  _fields(hf, _LLAMA_FIELDS | {"sliding_window"}, {"hidden_act": "silu"}, "mistral")
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
  _fields(hf, _LLAMA_FIELDS | {"use_sliding_window", "sliding_window", "max_window_layers",
                               "layer_types"}, {"hidden_act": "silu"}, "qwen2")
  return dict(_llama_body(hf), qkv_bias=True, out_bias=False, mlp_bias=False, **_qwen2_window(hf))


def _llama_body_to_hf(cfg, vocab_size: int) -> dict:
  return dict(vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              tie_word_embeddings=cfg.tie_embeddings, rope_parameters=_rope_to_hf(cfg))


def _llama_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["LlamaForCausalLM"], model_type="llama",
              **_llama_body_to_hf(cfg, vocab_size), attention_bias=False, mlp_bias=False)


def _mistral_to_hf(cfg, vocab_size: int) -> dict:
  return dict(architectures=["MistralForCausalLM"], model_type="mistral",
              **_llama_body_to_hf(cfg, vocab_size), sliding_window=cfg.sliding_window)


def _qwen2_to_hf(cfg, vocab_size: int) -> dict:
  """LLaMA's fields and the window: `layer_types` says which layers have it
  (`max_window_layers`, which transformers reads only without `layer_types`,
  is the first of them)."""
  layers = cfg.sliding_window_layers
  return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
              **_llama_body_to_hf(cfg, vocab_size), use_sliding_window=bool(layers),
              sliding_window=cfg.sliding_window,
              max_window_layers=layers[0] if layers else cfg.num_layers,
              layer_types=["sliding_attention" if i in layers else "full_attention"
                           for i in range(cfg.num_layers)])


def _llama_tensors(cfg) -> list[Tensor]:
  """LLaMA's and Mistral's tensors; Qwen2's with the q/k/v biases (cfg.qkv_bias)."""
  m, h, k, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = [_same("embed_tokens.weight", "decoder/embed/embedding", 0),
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
    if cfg.qkv_bias:
      out += [_bias_in(hf + f"self_attn.{p}_proj.bias", ours + f"attn/{p}_proj/bias", heads, d)
              for p, heads in (("q", h), ("k", k), ("v", k))]
  if not cfg.tie_embeddings:
    out.append(_transposed("lm_head.weight", "head/kernel", 1))
  return out


# --- BERT (masked LM) ---------------------------------------------------------

_BERT_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
             "relu": "relu"}
# Our model.mlp -> the HF name an export writes (the first that maps to it).
_BERT_ACT_NAMES = {ours: hf for hf, ours in reversed(_BERT_ACT.items())}


def _bert_from_hf(hf: dict) -> dict:
  """BertForMaskedLM: post-norm encoder, embedding LayerNorm, token types,
  the MLM head transform (dense, hidden_act, LayerNorm) and output bias."""
  _fields(hf, {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
               "layer_norm_eps", "tie_word_embeddings"},
          {"position_embedding_type": "absolute", "is_decoder": False,
           "add_cross_attention": False}, "bert")
  act = hf.get("hidden_act", "gelu")
  if act not in _BERT_ACT:
    raise UserError(f"Hugging Face config field hidden_act={act!r} is not supported by the bert "
                    f"import ({', '.join(_BERT_ACT)} are)")
  return dict(family="encoder", vocab_size=hf.get("vocab_size", 30522),
              d_model=hf.get("hidden_size", 768), num_layers=hf.get("num_hidden_layers", 12),
              num_heads=hf.get("num_attention_heads", 12), d_ff=hf.get("intermediate_size", 3072),
              max_len=hf.get("max_position_embeddings", 512), pos_emb="learned",
              norm="layernorm", norm_position="post", norm_eps=hf.get("layer_norm_eps", 1e-12),
              mlp=_BERT_ACT[act], use_bias=True, tie_embeddings=hf.get("tie_word_embeddings", True),
              type_vocab_size=hf.get("type_vocab_size", 2), embedding_norm=True,
              head_transform=True, output_bias=True)


def _bert_to_hf(cfg, vocab_size: int) -> dict:
  act = _BERT_ACT_NAMES.get(cfg.mlp, "gelu")
  return dict(architectures=["BertForMaskedLM"], model_type="bert", vocab_size=vocab_size,
              hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff, hidden_act=act,
              max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
              layer_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert_tensors(cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [_same("embeddings.word_embeddings.weight", "encoder/embed/embedding", 0),
         _same("embeddings.position_embeddings.weight", "encoder/positions/table"),
         _same("embeddings.token_type_embeddings.weight", "encoder/token_types/table"),
         _same("embeddings.LayerNorm.weight", "encoder/embedding_norm/scale"),
         _same("embeddings.LayerNorm.bias", "encoder/embedding_norm/bias"),
         _transposed("cls.predictions.transform.dense.weight", "head_transform/dense/kernel"),
         _same("cls.predictions.transform.dense.bias", "head_transform/dense/bias"),
         _same("cls.predictions.transform.LayerNorm.weight", "head_transform/norm/scale"),
         _same("cls.predictions.transform.LayerNorm.bias", "head_transform/norm/bias"),
         _same("cls.predictions.bias" if cfg.tie_embeddings else "cls.predictions.decoder.bias",
               "output_bias", 0)]
  for i in range(cfg.num_layers):
    hf, ours = f"encoder.layer.{i}.", f"encoder/layers/{i}/"
    for hf_name, p in (("query", "q"), ("key", "k"), ("value", "v")):
      out += [_linear_in(f"{hf}attention.self.{hf_name}.weight", f"{ours}attn/{p}_proj/kernel",
                         m, h, d),
              _bias_in(f"{hf}attention.self.{hf_name}.bias", f"{ours}attn/{p}_proj/bias", h, d)]
    out += [
        _linear_out(hf + "attention.output.dense.weight", ours + "attn/o_proj/kernel", h, d, m),
        _same(hf + "attention.output.dense.bias", ours + "attn/o_proj/bias"),
        _same(hf + "attention.output.LayerNorm.weight", ours + "norm_attn/scale"),
        _same(hf + "attention.output.LayerNorm.bias", ours + "norm_attn/bias"),
        _transposed(hf + "intermediate.dense.weight", ours + "mlp/up/kernel"),
        _same(hf + "intermediate.dense.bias", ours + "mlp/up/bias"),
        _transposed(hf + "output.dense.weight", ours + "mlp/down/kernel"),
        _same(hf + "output.dense.bias", ours + "mlp/down/bias"),
        _same(hf + "output.LayerNorm.weight", ours + "norm_mlp/scale"),
        _same(hf + "output.LayerNorm.bias", ours + "norm_mlp/bias"),
    ]
  if not cfg.tie_embeddings:
    out.append(_transposed("cls.predictions.decoder.weight", "head/kernel", 1))
  return out


def _bert_read_past(cfg) -> tuple[str, ...]:
  """Tied, the decoder's weight and bias are copies of the word embeddings and
  `cls.predictions.bias`; untied, the decoder's bias is the one used."""
  if cfg.tie_embeddings:
    return ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
  return ("cls.predictions.bias",)


# --- T5 (v1.0 and v1.1) ---------------------------------------------------------

# (is_gated_act, dense_act_fn) -> our model.mlp. transformers derives both from
# feed_forward_proj ("gated-gelu" is tanh GELU) unless config.json has them.
_T5_MLP = {(False, "relu"): "relu", (False, "gelu"): "gelu", (False, "gelu_new"): "gelu_tanh",
           (False, "gelu_pytorch_tanh"): "gelu_tanh", (True, "gelu"): "geglu",
           (True, "gelu_new"): "geglu_tanh", (True, "gelu_pytorch_tanh"): "geglu_tanh",
           (True, "silu"): "swiglu"}
_T5_FIELDS = {"vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
              "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance",
              "layer_norm_epsilon", "feed_forward_proj", "dense_act_fn", "is_gated_act",
              "tie_word_embeddings", "scale_decoder_outputs", "n_positions",
              "dropout_rate", "initializer_factor", "output_past"}


def _t5_mlp(hf: dict) -> str:
  """Our model.mlp for T5's feed-forward fields, as transformers reads them."""
  proj = hf.get("feed_forward_proj", "relu")
  act = hf.get("dense_act_fn", "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1])
  gated = hf.get("is_gated_act", proj.split("-")[0] == "gated")
  if (gated, act) not in _T5_MLP:
    raise UserError(f"Hugging Face config field feed_forward_proj={proj!r} (dense_act_fn="
                    f"{act!r}, is_gated_act={gated}) is not supported by the t5 import (relu, "
                    "gelu, gelu_new, gated-gelu, gated-silu are)")
  return _T5_MLP[gated, act]


def _t5_from_hf(hf: dict, name: str = "t5") -> dict:
  """T5ForConditionalGeneration: pre-norm RMSNorm, relative position bias,
  unscaled attention, no biases; the head input times d_model^-0.5 when
  scale_decoder_outputs (transformers 5) or, in older files, when
  tie_word_embeddings is not false (v1.0). The decoder starts from the pad id."""
  _fields(hf, _T5_FIELDS, {"is_decoder": False}, name)
  start, pad = hf.get("decoder_start_token_id"), hf.get("pad_token_id", 0)
  if start is not None and start != pad:
    raise UserError(f"Hugging Face config field decoder_start_token_id={start!r} is not "
                    f"supported by the {name} import (needs the pad id, {pad!r})")
  tied = hf.get("tie_word_embeddings", True) is not False
  num_layers = hf.get("num_layers", 6)
  return dict(family="encoder_decoder", vocab_size=hf.get("vocab_size", 32128),
              d_model=hf.get("d_model", 512), num_layers=num_layers,
              num_decoder_layers=hf.get("num_decoder_layers") or num_layers,
              num_heads=hf.get("num_heads", 8), head_dim=hf.get("d_kv", 64),
              d_ff=hf.get("d_ff", 2048), max_len=hf.get("n_positions", 512), pos_emb="relative",
              relative_buckets=hf.get("relative_attention_num_buckets", 32),
              relative_max_distance=hf.get("relative_attention_max_distance", 128),
              norm="rmsnorm", norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-6),
              mlp=_t5_mlp(hf), use_bias=False, attention_scale=1.0, decoder_start="pad",
              tie_embeddings=tied, scale_head_input=hf.get("scale_decoder_outputs", tied))


def _mt5_from_hf(hf: dict) -> dict:
  """MT5ForConditionalGeneration: T5's layout, gated-gelu by default, and a
  head input never scaled (transformers' mT5 has no scale_decoder_outputs;
  its head is the file's own, untied as for T5 v1.1). Exported, it is a T5
  v1.1 (`scale_decoder_outputs: false`)."""
  if "scale_decoder_outputs" in hf:
    raise UserError(f"Hugging Face config field scale_decoder_outputs="
                    f"{hf['scale_decoder_outputs']!r} is not supported by the mt5 import "
                    "(mT5 never scales the head input)")
  return dict(_t5_from_hf({"feed_forward_proj": "gated-gelu", **hf}, "mt5"),
              scale_head_input=False)


def _t5_to_hf(cfg, vocab_size: int) -> dict:
  """T5's config.json; feed_forward_proj with explicit dense_act_fn and
  is_gated_act (they win over it in transformers)."""
  gated, act = next((k for k, v in _T5_MLP.items() if v == cfg.mlp), (False, "relu"))
  proj = "gated-gelu" if cfg.mlp == "geglu_tanh" else f"gated-{act}" if gated else act
  return dict(architectures=["T5ForConditionalGeneration"], model_type="t5",
              vocab_size=vocab_size, d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff,
              num_layers=cfg.num_layers, num_decoder_layers=cfg.num_decoder_layers,
              num_heads=cfg.num_heads, n_positions=cfg.max_len,
              relative_attention_num_buckets=cfg.relative_buckets,
              relative_attention_max_distance=cfg.relative_max_distance,
              layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=proj, dense_act_fn=act,
              is_gated_act=gated, tie_word_embeddings=cfg.tie_embeddings,
              scale_decoder_outputs=cfg.scale_head_input, is_encoder_decoder=True,
              dropout_rate=0.0)


def _t5_attention(hf: str, ours: str, cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  return [*(_linear_in(f"{hf}{p}.weight", f"{ours}{p}_proj/kernel", m, h, d) for p in "qkv"),
          _linear_out(f"{hf}o.weight", f"{ours}o_proj/kernel", h, d, m)]


def _t5_tensors(cfg) -> list[Tensor]:
  """T5's tensors: no prefix; the relative bias table in block 0 of each stack;
  the decoder's block i: layer.0 self-attention, layer.1 cross-attention,
  layer.2 the MLP (the encoder's: layer.0, layer.1)."""
  gated = is_gated(cfg.mlp)
  out = [_same("shared.weight", "decoder/embed/embedding", 0)]
  for stack, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    out += [_same(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                  f"{stack}/relative_bias/table"),
            _same(f"{stack}.final_layer_norm.weight", f"{stack}/final_norm/scale")]
    for i in range(num_layers):
      hf, ours = f"{stack}.block.{i}.layer.", f"{stack}/layers/{i}/"
      mlp = f"{hf}{2 if stack == 'decoder' else 1}."
      out += [*_t5_attention(hf + "0.SelfAttention.", ours + "attn/", cfg),
              _same(hf + "0.layer_norm.weight", ours + "norm_attn/scale"),
              _same(mlp + "layer_norm.weight", ours + "norm_mlp/scale"),
              _transposed(mlp + "DenseReluDense.wo.weight", ours + "mlp/down/kernel")]
      if gated:
        out += [_transposed(mlp + "DenseReluDense.wi_0.weight", ours + "mlp/gate/kernel"),
                _transposed(mlp + "DenseReluDense.wi_1.weight", ours + "mlp/up/kernel")]
      else:
        out.append(_transposed(mlp + "DenseReluDense.wi.weight", ours + "mlp/up/kernel"))
      if stack == "decoder":
        out += [*_t5_attention(hf + "1.EncDecAttention.", ours + "cross_attn/", cfg),
                _same(hf + "1.layer_norm.weight", ours + "norm_cross/scale")]
  if not cfg.tie_embeddings:
    out.append(_transposed("lm_head.weight", "head/kernel", 1))
  return out


def _t5_read_past(cfg) -> tuple[str, ...]:
  """The stacks' own copies of `shared.weight`, and a tied head's."""
  return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
          *(("lm_head.weight",) if cfg.tie_embeddings else ()))


# --- BART (BartForConditionalGeneration) -------------------------------------

# BART's learned position tables have 2 more rows than max_position_embeddings:
# position p reads row p + 2 (rows 0 and 1 are never read).
_BART_POSITION_OFFSET = 2
# BartConfig fields that leave the forward pass unchanged: dropouts, layer
# drop, initialisation, generation settings, classification heads.
_BART_INERT = {"dropout", "activation_dropout", "encoder_layerdrop", "decoder_layerdrop",
               "init_std", "classif_dropout", "forced_bos_token_id", "forced_eos_token_id",
               "num_labels", "early_stopping", "no_repeat_ngram_size", "num_beams",
               "max_length", "min_length", "length_penalty", "output_past"}
# BART's ids where config.json gives none (BartConfig's defaults).
_BART_IDS = {"bos": 0, "pad": 1, "eos": 2}


def _bart_decoder_start(hf: dict) -> str:
  """Our `decoder_start` for the HF decoder_start_token_id: which of the
  config's eos, pad or bos ids it is (BART's: eos)."""
  start = hf.get("decoder_start_token_id", _BART_IDS["eos"])
  for name in ("eos", "pad", "bos"):
    if start == hf.get(f"{name}_token_id", _BART_IDS[name]):
      return name
  raise UserError(f"Hugging Face config field decoder_start_token_id={start!r} is not "
                  "supported by the bart import (needs the eos, pad or bos id)")


def _bart_from_hf(hf: dict) -> dict:
  """BartForConditionalGeneration: post-norm encoder-decoder, learned
  positions and an embedding LayerNorm (eps 1e-5) per stack, biases
  everywhere, one embedding shared by both stacks and the tied head,
  `final_logits_bias` as the output bias."""
  _fields(hf, {"vocab_size", "d_model", "encoder_layers", "decoder_layers",
               "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
               "decoder_ffn_dim", "max_position_embeddings", "activation_function",
               "scale_embedding", "num_hidden_layers", "num_attention_heads", "hidden_size"}
          | _BART_INERT,
          {"tie_word_embeddings": True, "is_decoder": False, "add_cross_attention": False,
           "normalize_before": False, "add_final_layer_norm": False,
           "normalize_embedding": True, "static_position_embeddings": False,
           "add_bias_logits": False, "extra_pos_embeddings": _BART_POSITION_OFFSET}, "bart")
  d, heads = hf.get("d_model", 1024), hf.get("encoder_attention_heads", 16)
  ffn, layers = hf.get("encoder_ffn_dim", 4096), hf.get("encoder_layers", 12)
  for key, value in (("decoder_attention_heads", heads), ("num_attention_heads", heads),
                     ("decoder_ffn_dim", ffn), ("num_hidden_layers", layers),
                     ("hidden_size", d)):
    if hf.get(key, value) != value:
      raise UserError(f"Hugging Face config field {key}={hf[key]!r} is not supported by the "
                      f"bart import (needs {value!r}, as the encoder's)")
  act = hf.get("activation_function", "gelu")
  if act not in _BERT_ACT:
    raise UserError(f"Hugging Face config field activation_function={act!r} is not supported "
                    f"by the bart import ({', '.join(_BERT_ACT)} are)")
  return dict(family="encoder_decoder", vocab_size=hf.get("vocab_size", 50265), d_model=d,
              num_layers=layers, num_decoder_layers=hf.get("decoder_layers", 12),
              num_heads=heads, d_ff=ffn, max_len=hf.get("max_position_embeddings", 1024),
              pos_emb="learned", norm="layernorm", norm_position="post", norm_eps=1e-5,
              mlp=_BERT_ACT[act], use_bias=True,
              scale_embeddings=bool(hf.get("scale_embedding", False)), tie_embeddings=True,
              embedding_norm=True, output_bias=True, decoder_start=_bart_decoder_start(hf))


def _bart_to_hf(cfg, vocab_size: int) -> dict:
  """BART's config.json; the token ids are BART's own, which `to_hf`
  replaces by the tokenizer's."""
  act = _BERT_ACT_NAMES.get(cfg.mlp, "gelu")
  return dict(architectures=["BartForConditionalGeneration"], model_type="bart",
              vocab_size=vocab_size, d_model=cfg.d_model, encoder_layers=cfg.num_layers,
              decoder_layers=cfg.num_decoder_layers, encoder_attention_heads=cfg.num_heads,
              decoder_attention_heads=cfg.num_heads, encoder_ffn_dim=cfg.d_ff,
              decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_len,
              activation_function=act, scale_embedding=cfg.scale_embeddings,
              tie_word_embeddings=True, is_encoder_decoder=True, dropout=0.0,
              attention_dropout=0.0, activation_dropout=0.0,
              forced_bos_token_id=None, forced_eos_token_id=None,
              **{f"{name}_token_id": i for name, i in _BART_IDS.items()},
              decoder_start_token_id=_BART_IDS.get(cfg.decoder_start))


def _bart_positions(name, path):
  """A BART position table [max_len + 2, M] <-> ours [max_len, M] (the 2
  unread rows dropped; zeros on export)."""
  offset = _BART_POSITION_OFFSET
  return Tensor(name, (path,), lambda w: (w[offset:],),
                lambda t: np.concatenate([np.zeros((offset, t.shape[1]), t.dtype), t]))


def _bart_attention(hf, ours, m, h, d) -> list[Tensor]:
  """One BartAttention (q, k, v, out projections with biases)."""
  out = [_linear_out(hf + "out_proj.weight", ours + "o_proj/kernel", h, d, m),
         _same(hf + "out_proj.bias", ours + "o_proj/bias")]
  for p in "qkv":
    out += [_linear_in(f"{hf}{p}_proj.weight", f"{ours}{p}_proj/kernel", m, h, d),
            _bias_in(f"{hf}{p}_proj.bias", f"{ours}{p}_proj/bias", h, d)]
  return out


def _bart_tensors(cfg) -> list[Tensor]:
  """`shared` is our one embedding of both stacks, which the parameter tree
  lists once, under the decoder."""
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [_same("shared.weight", "decoder/embed/embedding", 0),
         Tensor("final_logits_bias", ("output_bias",), lambda b: (b.reshape(-1),),
                lambda b: b.reshape(1, -1), 0, zeros_if_missing=True)]
  for stack, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    out += [_bart_positions(f"{stack}.embed_positions.weight", f"{stack}/positions/table"),
            _same(f"{stack}.layernorm_embedding.weight", f"{stack}/embedding_norm/scale"),
            _same(f"{stack}.layernorm_embedding.bias", f"{stack}/embedding_norm/bias")]
    for i in range(num_layers):
      hf, ours = f"{stack}.layers.{i}.", f"{stack}/layers/{i}/"
      norms = [("self_attn_layer_norm", "norm_attn"), ("final_layer_norm", "norm_mlp")]
      out += _bart_attention(hf + "self_attn.", ours + "attn/", m, h, d)
      if stack == "decoder":
        out += _bart_attention(hf + "encoder_attn.", ours + "cross_attn/", m, h, d)
        norms.append(("encoder_attn_layer_norm", "norm_cross"))
      for hf_norm, our_norm in norms:
        out += [_same(f"{hf}{hf_norm}.weight", f"{ours}{our_norm}/scale"),
                _same(f"{hf}{hf_norm}.bias", f"{ours}{our_norm}/bias")]
      out += [_transposed(hf + "fc1.weight", ours + "mlp/up/kernel"),
              _same(hf + "fc1.bias", ours + "mlp/up/bias"),
              _transposed(hf + "fc2.weight", ours + "mlp/down/kernel"),
              _same(hf + "fc2.bias", ours + "mlp/down/bias")]
  return out


def _bart_read_past(cfg) -> tuple[str, ...]:
  """The tied copies of `shared.weight` that files may hold."""
  del cfg
  return ("lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One Hugging Face architecture (see the module docstring).

  `prefix`: the body's prefix in HF tensor names ("model."), optional in files
  (GPT-2's own checkpoint has none); names starting with one of `unprefixed`
  (the heads: "lm_head.", BERT's "cls.") never have it.
  `skipped`: tensor-name suffixes read past: buffers, and weights of other
  heads that the architecture's model does not use (BERT's pooler and
  next-sentence head).
  `read_past(cfg)`: tensor names in files that transformers does not use with
  this config: a tied head's own copy; untied BERT's `cls.predictions.bias`
  (its decoder has its own).
  `objective`: our `train.objective` for fine-tuning an import.
  `auto_class`: the transformers Auto class that loads an export.
  `tied_head`: (head, embedding) tensor names as in files: an import whose
  config ties them is untied when the file holds the head with other values
  than the embedding, as transformers 5 loads it (T5 v1.1 saved by
  transformers 5: its T5Config always says tie_word_embeddings=true).
  """
  model_type: str
  hf_class: str
  prefix: str
  config_from_hf: Callable[[dict], dict]
  config_to_hf: Callable
  tensors: Callable
  skipped: tuple[str, ...] = ()
  unprefixed: tuple[str, ...] = ("lm_head.",)
  read_past: Callable = lambda cfg: ("lm_head.weight",) if cfg.tie_embeddings else ()
  objective: str = "next_token"
  auto_class: str = "AutoModelForCausalLM"
  tied_head: tuple[str, str] = ()


_ROTARY = (".rotary_emb.inv_freq",)
ARCHITECTURES = {
    "gpt2": Architecture("gpt2", "GPT2LMHeadModel", "transformer.", _gpt2_from_hf, _gpt2_to_hf,
                         _gpt2_tensors, skipped=(".attn.bias", ".attn.masked_bias")),
    "llama": Architecture("llama", "LlamaForCausalLM", "model.", _llama_from_hf, _llama_to_hf,
                          _llama_tensors, skipped=_ROTARY),
    "mistral": Architecture("mistral", "MistralForCausalLM", "model.", _mistral_from_hf,
                            _mistral_to_hf, _llama_tensors, skipped=_ROTARY),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", "model.", _qwen2_from_hf, _qwen2_to_hf,
                          _llama_tensors, skipped=_ROTARY),
    "bert": Architecture("bert", "BertForMaskedLM", "bert.", _bert_from_hf, _bert_to_hf,
                         _bert_tensors, unprefixed=("cls.",), read_past=_bert_read_past,
                         objective="mlm", auto_class="AutoModelForMaskedLM",
                         skipped=("embeddings.position_ids", "pooler.dense.weight",
                                  "pooler.dense.bias", "cls.seq_relationship.weight",
                                  "cls.seq_relationship.bias")),
    "t5": Architecture("t5", "T5ForConditionalGeneration", "", _t5_from_hf, _t5_to_hf,
                       _t5_tensors, read_past=_t5_read_past, objective="seq2seq",
                       auto_class="AutoModelForSeq2SeqLM",
                       tied_head=("lm_head.weight", "shared.weight"),
                       skipped=("EncDecAttention.relative_attention_bias.weight",)),
    "mt5": Architecture("mt5", "MT5ForConditionalGeneration", "", _mt5_from_hf, _t5_to_hf,
                        _t5_tensors, read_past=_t5_read_past, objective="seq2seq",
                        auto_class="AutoModelForSeq2SeqLM",
                        tied_head=("lm_head.weight", "shared.weight"),
                        skipped=("EncDecAttention.relative_attention_bias.weight",)),
    "bart": Architecture("bart", "BartForConditionalGeneration", "model.", _bart_from_hf,
                         _bart_to_hf, _bart_tensors,
                         unprefixed=("lm_head.", "final_logits_bias"),
                         read_past=_bart_read_past, objective="seq2seq",
                         auto_class="AutoModelForSeq2SeqLM"),
}
# What a model of ours exports as, first match (LLaMA before Mistral: a model
# without a window is LLaMA; an mT5 import exports as T5 v1.1).
EXPORTS = ("gpt2", "llama", "mistral", "qwen2", "bert", "t5", "bart")


def architecture_of(hf: dict) -> Architecture:
  """The mapping for an HF config.json, or a UserError naming its model_type."""
  kind = hf.get("model_type")
  if kind in ARCHITECTURES:
    return ARCHITECTURES[kind]
  raise UserError(f"Hugging Face model_type {kind!r} is not supported; supported: "
                  f"{', '.join(ARCHITECTURES)}")
