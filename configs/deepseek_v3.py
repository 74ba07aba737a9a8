"""DeepSeek-V3's shapes (config.json of deepseek-ai/DeepSeek-V3): d=7168, 61
layers of multi-head latent attention (128 heads; query latent 1536, KV
latent 512, 128 + 64 rotated, values 128), the first 3 with dense SwiGLU
MLPs of 18,432, the other 58 with 256 routed SwiGLU experts of 2,048 (8 per
token, DeepSeek-V3's group-limited sigmoid router: 8 groups, the best 4,
weights renormalised times 2.5) and one shared expert; RMSNorm pre-norm,
V=129,280, untied head; RoPE theta 1e4 with yarn x40 from 4,096 positions
(mscale = mscale_all_dim = 1: cos and sin times 1.0, the softmax scale
(0.1 ln 40 + 1)^2 / sqrt(192)). 671,026,404,352 parameters, 37,552,282,624
active per token, as transformers counts DeepseekV3ForCausalLM
(tests/test_hf_deepseek.py); the published 671B total and 37B activated,
without the 14B multi-token-prediction module (`train.mtp_depth`, 0 here).
Training as the paper's pre-training: 4,096-token sequences, the
sequence-wise balance loss at 1e-4 and the selection biases moved at 1e-3.

Too big for one device; what a slice needs for it, without the slice
(docs/models.md has the figures; docs/huggingface.md the checkpoint import):
`python compile.py --config configs/deepseek_v3.py --target tpu:v5p:4x8x8
--config.mesh.data=1 --config.mesh.fsdp=64 --config.mesh.expert=4` (a
v5p-256, 86.66 GiB per chip with MLA on our kernels).
"""
import math

from configs import base

_YARN_FACTOR, _QK = 40.0, 128 + 64
_MSCALE = 0.1 * 1.0 * math.log(_YARN_FACTOR) + 1.0  # yarn's mscale_all_dim 1, as transformers


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=129280, d_model=7168, num_layers=61,
                 num_heads=128, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, d_ff=18432,
                 max_len=163840, pos_emb="rope", rope_theta=10000.0, rope_scaling="yarn",
                 rope_scaling_factor=_YARN_FACTOR, rope_original_max_len=4096,
                 rope_attention_factor=1.0,
                 attention_scale=_QK ** -0.5 * _MSCALE * _MSCALE,
                 norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", use_bias=False,
                 tie_embeddings=False, dtype="bfloat16", num_experts=256, experts_per_token=8,
                 moe_d_ff=2048, num_shared_experts=1, moe_layers=tuple(range(3, 61)),
                 moe_router="deepseek", moe_n_group=8, moe_topk_group=4,
                 moe_routed_scaling_factor=2.5,
                 scan_layers=True)  # the 3 dense layers, then the 58 with experts: two scans
  c.tokenizer.update(vocab_size=129280)
  c.train.update(batch_size=256, seq_len=4096, learning_rate=2.2e-4, warmup_steps=2000,
                 remat="full", moe_seq_aux_loss=1e-4,  # DeepSeek-V3's alpha and bias-update gamma
                 moe_bias_update_rate=1e-3)
  return c
