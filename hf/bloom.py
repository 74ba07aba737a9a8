"""BLOOM (BloomForCausalLM): GPT-2's layout with ALiBi instead of position
embeddings (`model.pos_emb=alibi`, BLOOM's slopes), a LayerNorm of the word
embeddings and a fused `query_key_value` laid out per head: its [3 H D]
outputs are (head, q/k/v, D), as transformers views them
(`fused_qkv.view(B, T, H, 3, D)`).

BLOOM has no position limit and its config no `max_position_embeddings`:
`model.max_len` is `seq_length` (written by bigscience's BLOOMZ files, kept
by transformers, which reads nothing of it), 2048 without it, BLOOM's
training context; an export writes it back.
"""
import numpy as np

from hf.tables import Architecture, Tensor, check_fields, linear_out, same, transposed

# config.json fields that transformers' BLOOM reads for no computation: the
# Megatron-DeepSpeed flags of bigscience's files (kernel fusions, the fp32
# softmax that transformers always does, `offset_alibi`, `skip_bias_add*`),
# `n_inner` (its MLP is 4 * hidden_size whatever it says), `pretraining_tp`
# with `slow_but_exact` (the output projections as a sum over slices of the
# input: the same product), `unk_token_id` and the hidden dropout.
_INERT = {"attention_softmax_in_fp32", "bias_dropout_fusion", "masked_softmax_fusion",
          "offset_alibi", "skip_bias_add", "skip_bias_add_qkv", "n_inner", "pretraining_tp",
          "slow_but_exact", "unk_token_id", "hidden_dropout"}

# Our field <- (config.json names, the first given wins, as transformers reads
# them: `n_embed` over hidden_size, `num_attention_heads` over n_head,
# `num_hidden_layers` over n_layer; BloomConfig's default).
_SIZES = {
    "d_model": (("n_embed", "hidden_size"), 64),
    "num_heads": (("num_attention_heads", "n_head"), 8),
    "num_layers": (("num_hidden_layers", "n_layer"), 2),
    "vocab_size": (("vocab_size",), 250880),
    "max_len": (("seq_length",), 2048),
}


def _bloom_from_hf(hf: dict) -> dict:
  """Our fields of a BLOOM config.json: pre-norm LayerNorm, ALiBi, the
  embedding LayerNorm, tanh GELU MLP of 4 * hidden_size, biases."""
  check_fields(hf, {name for names, _ in _SIZES.values() for name in names}
               | {"layer_norm_epsilon", "tie_word_embeddings"} | _INERT,
               {"apply_residual_connection_post_layernorm": False}, "bloom")
  sizes = {field: next((hf[n] for n in names if hf.get(n) is not None), default)
           for field, (names, default) in _SIZES.items()}
  return dict(sizes, d_ff=4 * sizes["d_model"], pos_emb="alibi", norm="layernorm",
              norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
              embedding_norm=True, mlp="gelu_tanh", use_bias=True,
              tie_embeddings=hf.get("tie_word_embeddings", True))


def _bloom_to_hf(cfg, vocab_size: int) -> dict:
  """BLOOM's config.json of our config (`seq_length`: model.max_len)."""
  return dict(architectures=["BloomForCausalLM"], model_type="bloom", vocab_size=vocab_size,
              hidden_size=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
              seq_length=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
              apply_residual_connection_post_layernorm=False,
              tie_word_embeddings=cfg.tie_embeddings, hidden_dropout=0.0, attention_dropout=0.0)


def _fused_qkv(name: str, paths: tuple[str, ...], m: int, h: int, d: int) -> Tensor:
  """BLOOM's `query_key_value` weight [H*3*D, M] <-> our q, k, v kernels [M, H, D]."""
  return Tensor(name, paths,
                lambda w: tuple(w.T.reshape(m, h, 3, d)[:, :, i] for i in range(3)),
                lambda *ks: np.stack(ks, axis=2).reshape(m, h * 3 * d).T)


def _fused_qkv_bias(name: str, paths: tuple[str, ...], h: int, d: int) -> Tensor:
  """BLOOM's `query_key_value` bias [H*3*D] <-> our q, k, v biases [H, D]."""
  return Tensor(name, paths, lambda b: tuple(b.reshape(h, 3, d)[:, i] for i in range(3)),
                lambda *bs: np.stack(bs, axis=1).reshape(-1))


def _bloom_tensors(cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [same("word_embeddings.weight", "decoder/embed/embedding", 0),
         same("word_embeddings_layernorm.weight", "decoder/embedding_norm/scale"),
         same("word_embeddings_layernorm.bias", "decoder/embedding_norm/bias"),
         same("ln_f.weight", "decoder/final_norm/scale"),
         same("ln_f.bias", "decoder/final_norm/bias")]
  for i in range(cfg.num_layers):
    hf, ours = f"h.{i}.", f"decoder/layers/{i}/"
    qkv = tuple(f"{ours}attn/{p}_proj/" for p in "qkv")
    out += [
        same(hf + "input_layernorm.weight", ours + "norm_attn/scale"),
        same(hf + "input_layernorm.bias", ours + "norm_attn/bias"),
        same(hf + "post_attention_layernorm.weight", ours + "norm_mlp/scale"),
        same(hf + "post_attention_layernorm.bias", ours + "norm_mlp/bias"),
        _fused_qkv(hf + "self_attention.query_key_value.weight",
                   tuple(p + "kernel" for p in qkv), m, h, d),
        _fused_qkv_bias(hf + "self_attention.query_key_value.bias",
                        tuple(p + "bias" for p in qkv), h, d),
        linear_out(hf + "self_attention.dense.weight", ours + "attn/o_proj/kernel", h, d, m),
        same(hf + "self_attention.dense.bias", ours + "attn/o_proj/bias"),
        transposed(hf + "mlp.dense_h_to_4h.weight", ours + "mlp/up/kernel"),
        same(hf + "mlp.dense_h_to_4h.bias", ours + "mlp/up/bias"),
        transposed(hf + "mlp.dense_4h_to_h.weight", ours + "mlp/down/kernel"),
        same(hf + "mlp.dense_4h_to_h.bias", ours + "mlp/down/bias"),
    ]
  if not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


BLOOM = Architecture("bloom", "BloomForCausalLM", "transformer.", _bloom_from_hf, _bloom_to_hf,
                     _bloom_tensors)
