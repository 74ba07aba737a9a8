"""GPT-2 (GPT2LMHeadModel): GPT-2's `Conv1D` is already [in, out] and packs
q, k, v into one `c_attn`."""
import numpy as np

from hf.tables import Architecture, Tensor, check_fields, same, transposed


def _gpt2_from_hf(hf: dict) -> dict:
  check_fields(hf, {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
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
  out = [same("wte.weight", "decoder/embed/embedding", 0),
         same("wpe.weight", "decoder/positions/table"),
         same("ln_f.weight", "decoder/final_norm/scale"),
         same("ln_f.bias", "decoder/final_norm/bias")]
  for i in range(cfg.num_layers):
    hf, ours = f"h.{i}.", f"decoder/layers/{i}/"
    qkv = tuple(f"{ours}attn/{p}_proj/" for p in "qkv")
    out += [
        same(hf + "ln_1.weight", ours + "norm_attn/scale"),
        same(hf + "ln_1.bias", ours + "norm_attn/bias"),
        same(hf + "ln_2.weight", ours + "norm_mlp/scale"),
        same(hf + "ln_2.bias", ours + "norm_mlp/bias"),
        Tensor(hf + "attn.c_attn.weight", tuple(p + "kernel" for p in qkv),
               lambda w: tuple(x.reshape(m, h, d) for x in np.split(w, 3, axis=1)),
               lambda *ks: np.concatenate([k.reshape(m, h * d) for k in ks], axis=1)),
        Tensor(hf + "attn.c_attn.bias", tuple(p + "bias" for p in qkv),
               lambda b: tuple(x.reshape(h, d) for x in np.split(b, 3)),
               lambda *bs: np.concatenate([b.reshape(-1) for b in bs])),
        Tensor(hf + "attn.c_proj.weight", (ours + "attn/o_proj/kernel",),
               lambda w: (w.reshape(h, d, m),), lambda k: k.reshape(h * d, m)),
        same(hf + "attn.c_proj.bias", ours + "attn/o_proj/bias"),
        same(hf + "mlp.c_fc.weight", ours + "mlp/up/kernel"),
        same(hf + "mlp.c_fc.bias", ours + "mlp/up/bias"),
        same(hf + "mlp.c_proj.weight", ours + "mlp/down/kernel"),
        same(hf + "mlp.c_proj.bias", ours + "mlp/down/bias"),
    ]
  if not cfg.tie_embeddings:
    out.append(transposed("lm_head.weight", "head/kernel", 1))
  return out


GPT2 = Architecture("gpt2", "GPT2LMHeadModel", "transformer.", _gpt2_from_hf, _gpt2_to_hf,
                    _gpt2_tensors, skipped=(".attn.bias", ".attn.masked_bias"))
