"""BART (BartForConditionalGeneration)."""
import numpy as np

from configs.errors import UserError
from hf import bert
from hf.tables import (Architecture, Tensor, bias_in, check_fields, linear_in, linear_out, same,
                       transposed)


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
  check_fields(hf, {"vocab_size", "d_model", "encoder_layers", "decoder_layers",
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
  if act not in bert.ACTIVATIONS:
    raise UserError(f"Hugging Face config field activation_function={act!r} is not supported "
                    f"by the bart import ({', '.join(bert.ACTIVATIONS)} are)")
  return dict(family="encoder_decoder", vocab_size=hf.get("vocab_size", 50265), d_model=d,
              num_layers=layers, num_decoder_layers=hf.get("decoder_layers", 12),
              num_heads=heads, d_ff=ffn, max_len=hf.get("max_position_embeddings", 1024),
              pos_emb="learned", norm="layernorm", norm_position="post", norm_eps=1e-5,
              mlp=bert.ACTIVATIONS[act], use_bias=True,
              scale_embeddings=bool(hf.get("scale_embedding", False)), tie_embeddings=True,
              embedding_norm=True, output_bias=True, decoder_start=_bart_decoder_start(hf))


def _bart_to_hf(cfg, vocab_size: int) -> dict:
  """BART's config.json; the token ids are BART's own, which `to_hf`
  replaces by the tokenizer's."""
  act = bert.ACT_NAMES.get(cfg.mlp, "gelu")
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
  out = [linear_out(hf + "out_proj.weight", ours + "o_proj/kernel", h, d, m),
         same(hf + "out_proj.bias", ours + "o_proj/bias")]
  for p in "qkv":
    out += [linear_in(f"{hf}{p}_proj.weight", f"{ours}{p}_proj/kernel", m, h, d),
            bias_in(f"{hf}{p}_proj.bias", f"{ours}{p}_proj/bias", h, d)]
  return out


def _bart_tensors(cfg) -> list[Tensor]:
  """`shared` is our one embedding of both stacks, which the parameter tree
  lists once, under the decoder."""
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [same("shared.weight", "decoder/embed/embedding", 0),
         Tensor("final_logits_bias", ("output_bias",), lambda b: (b.reshape(-1),),
                lambda b: b.reshape(1, -1), 0, zeros_if_missing=True)]
  for stack, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    out += [_bart_positions(f"{stack}.embed_positions.weight", f"{stack}/positions/table"),
            same(f"{stack}.layernorm_embedding.weight", f"{stack}/embedding_norm/scale"),
            same(f"{stack}.layernorm_embedding.bias", f"{stack}/embedding_norm/bias")]
    for i in range(num_layers):
      hf, ours = f"{stack}.layers.{i}.", f"{stack}/layers/{i}/"
      norms = [("self_attn_layer_norm", "norm_attn"), ("final_layer_norm", "norm_mlp")]
      out += _bart_attention(hf + "self_attn.", ours + "attn/", m, h, d)
      if stack == "decoder":
        out += _bart_attention(hf + "encoder_attn.", ours + "cross_attn/", m, h, d)
        norms.append(("encoder_attn_layer_norm", "norm_cross"))
      for hf_norm, our_norm in norms:
        out += [same(f"{hf}{hf_norm}.weight", f"{ours}{our_norm}/scale"),
                same(f"{hf}{hf_norm}.bias", f"{ours}{our_norm}/bias")]
      out += [transposed(hf + "fc1.weight", ours + "mlp/up/kernel"),
              same(hf + "fc1.bias", ours + "mlp/up/bias"),
              transposed(hf + "fc2.weight", ours + "mlp/down/kernel"),
              same(hf + "fc2.bias", ours + "mlp/down/bias")]
  return out


def _bart_read_past(cfg) -> tuple[str, ...]:
  """The tied copies of `shared.weight` that files may hold."""
  del cfg
  return ("lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")



BART = Architecture("bart", "BartForConditionalGeneration", "model.", _bart_from_hf,
                    _bart_to_hf, _bart_tensors,
                    unprefixed=("lm_head.", "final_logits_bias"),
                    read_past=_bart_read_past, objective="seq2seq",
                    auto_class="AutoModelForSeq2SeqLM")
