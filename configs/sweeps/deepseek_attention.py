"""DeepSeek-V3's attention-side pieces on configs/tiny.py (d_model 128, 4
heads of 32, 2 layers) at equal training FLOPs, 3 seeds each: multi-head
latent attention (MLA) against MHA (the baseline), GQA (2 key/value heads)
and MQA (1), with the KV-cache bytes per token beside the loss (report.md's
runs and cost tables, `kv_cache_bytes_per_token`); and multi-token
prediction (train.mtp_depth=1, DeepSeek-V3's depth, at its weight 0.3) on
MHA against MHA without it.

MLA's sizes keep DeepSeek-V3's proportions at tiny's head width of 32: the
per-head query/key width without RoPE equals the value width (V3: 128 and
128), qk_nope_head_dim = v_head_dim = 32, tiny's own head width; the rotated
part is half that (V3: 64), qk_rope_head_dim = 16; the key/value latent is
kv_lora_rank = 64, half of d_model, a bottleneck as DeepSeek's are (V3: 512
of 7,168; V2-Lite: 512 of 2,048): V3's four head widths would be 128 here,
d_model itself, a latent that compresses nothing. No query latent (q_lora_rank
unset, as DeepSeek-V2-Lite): at d_model 128 a query bottleneck would only
cut the queries' rank. So MLA has about MHA's parameters and FLOPs per
token (+0.8% and +3.3%: 48-wide queries and keys), while its cache per token
and layer is the latent and the shared rope key, 64 + 16 = 80 values
against MHA's 2 x 4 x 32 = 256: 640 B per token against 2,048 (float32,
2 layers), between GQA's 1,024 and MQA's 512.

The budget, 4.6e12 FLOPs (model/accounting.py, with the MTP module's cost
for mtp_depth=1), gives MHA tiny's 600 steps (about its default cost, 2-3
minutes a run on a CPU core), GQA 633, MQA 652, MLA 581 and MHA with MTP
362: a variant that costs more per token trains fewer steps. The MTP module
(a projection, one more block and the shared 1,024-token head) adds 66% to
tiny's FLOPs per token, so at equal compute it trains 40% fewer steps.
DeepSeek-V3 compares at equal tokens, where its one module beside 61 layers
costs little: `--config.train.num_steps=600` instead of the budget runs that
comparison.

  python sweep.py run --sweep configs/sweeps/deepseek_attention.py --parallel 2 \
      --config.tokenizer.path=runs/tiny/tokenizer --config.train.flop_budget=4.6e12
  python sweep.py report --root runs/sweeps/deepseek_attention
"""
NAME = "deepseek_attention"
CONFIG = "configs/tiny.py"
SEEDS = 3

MLA = {"model.attention": "mla", "model.kv_lora_rank": 64, "model.qk_nope_head_dim": 32,
       "model.qk_rope_head_dim": 16, "model.v_head_dim": 32}


def get_sweep():
  return [{"model.num_kv_heads": 4}, {"model.num_kv_heads": 2}, {"model.num_kv_heads": 1},
          MLA, {"model.num_kv_heads": 4, "train.mtp_depth": 1}]
