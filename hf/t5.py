"""T5 (v1.0 and v1.1) and mT5 (T5ForConditionalGeneration, MT5ForConditionalGeneration)."""
from configs.errors import UserError
from hf.tables import Architecture, Tensor, check_fields, linear_in, linear_out, same, transposed
from model.mlp import is_gated


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
  check_fields(hf, _T5_FIELDS, {"is_decoder": False}, name)
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
  return [*(linear_in(f"{hf}{p}.weight", f"{ours}{p}_proj/kernel", m, h, d) for p in "qkv"),
          linear_out(f"{hf}o.weight", f"{ours}o_proj/kernel", h, d, m)]


def _t5_tensors(cfg) -> list[Tensor]:
  """T5's tensors: no prefix; the relative bias table in block 0 of each stack;
  the decoder's block i: layer.0 self-attention, layer.1 cross-attention,
  layer.2 the MLP (the encoder's: layer.0, layer.1)."""
  gated = is_gated(cfg.mlp)
  out = [same("shared.weight", "decoder/embed/embedding", 0)]
  for stack, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    out += [same(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 f"{stack}/relative_bias/table"),
            same(f"{stack}.final_layer_norm.weight", f"{stack}/final_norm/scale")]
    for i in range(num_layers):
      hf, ours = f"{stack}.block.{i}.layer.", f"{stack}/layers/{i}/"
      mlp = f"{hf}{2 if stack == 'decoder' else 1}."
      out += [*_t5_attention(hf + "0.SelfAttention.", ours + "attn/", cfg),
              same(hf + "0.layer_norm.weight", ours + "norm_attn/scale"),
              same(mlp + "layer_norm.weight", ours + "norm_mlp/scale"),
              transposed(mlp + "DenseReluDense.wo.weight", ours + "mlp/down/kernel")]
      if gated:
        out += [transposed(mlp + "DenseReluDense.wi_0.weight", ours + "mlp/gate/kernel"),
                transposed(mlp + "DenseReluDense.wi_1.weight", ours + "mlp/up/kernel")]
      else:
        out.append(transposed(mlp + "DenseReluDense.wi.weight", ours + "mlp/up/kernel"))
      if stack == "decoder":
        out += [*_t5_attention(hf + "1.EncDecAttention.", ours + "cross_attn/", cfg),
                same(hf + "1.layer_norm.weight", ours + "norm_cross/scale")]
  if not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


def _t5_read_past(cfg) -> tuple[str, ...]:
  """The stacks' own copies of `shared.weight`, and a tied head's."""
  return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
          *(("lm_head.weight",) if cfg.tie_embeddings else ()))


T5 = Architecture("t5", "T5ForConditionalGeneration", "", _t5_from_hf, _t5_to_hf,
                  _t5_tensors, read_past=_t5_read_past, objective="seq2seq",
                  auto_class="AutoModelForSeq2SeqLM",
                  tied_head=("lm_head.weight", "shared.weight"),
                  skipped=("EncDecAttention.relative_attention_bias.weight",))
MT5 = Architecture("mt5", "MT5ForConditionalGeneration", "", _mt5_from_hf, _t5_to_hf,
                   _t5_tensors, read_past=_t5_read_past, objective="seq2seq",
                   auto_class="AutoModelForSeq2SeqLM",
                   tied_head=("lm_head.weight", "shared.weight"),
                   skipped=("EncDecAttention.relative_attention_bias.weight",))
