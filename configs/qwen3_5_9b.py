"""Qwen3.5-9B's language model (Qwen/Qwen3.5-9B, text): d=4096, 32 layers in
cycles of three Gated DeltaNet layers (16 query/key heads of 128, 32 value
heads of 128, convolutions of 4) and one gated full-attention layer (16
query heads, 4 KV heads of 256, QK-norm, the output gate, RoPE on the first
quarter of each head, theta 1e7), every MLP a dense SwiGLU of 12,288;
zero-centred RMSNorm pre-norm, V=248,320, untied head, 262,144 positions.
8,953,803,264 parameters, as transformers counts Qwen3_5ForCausalLM
(tests/test_hf_qwen3_next.py).

Its config.json was not at hand offline: the sizes are transformers'
Qwen3_5TextConfig defaults (its docstring: "the Qwen3.5-9B style
configuration"), which the model card's sizes match; the RoPE base and the
context length (which change no parameter count) are the model card's.
The checkpoint's directory is multimodal: `convert.py from_hf` imports its
language model (docs/huggingface.md).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=248320, d_model=4096, num_layers=32,
                 num_heads=16, num_kv_heads=4, head_dim=256, d_ff=12288, max_len=262144,
                 pos_emb="rope", rope_theta=10000000.0, partial_rotary_factor=0.25,
                 norm="rmsnorm_zero_centred", norm_eps=1e-6, mlp="swiglu", use_bias=False,
                 qk_norm=True, attention_output_gate=True, tie_embeddings=False,
                 dtype="bfloat16", layer_types=("linear_attention",) * 3 + ("full_attention",),
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 scan_layers=True)  # one scanned cycle of four layers, 8 times
  c.tokenizer.update(vocab_size=248320)
  c.train.update(batch_size=256, seq_len=4096, remat=True)
  return c
