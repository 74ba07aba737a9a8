"""A block's self-attention, one `ATTENTIONS` entry per `model.attention`.

- `mha`: `model.attention.Attention`, h query heads over g = num_kv_heads KV
  heads (multi-head, grouped-query and multi-query attention); its KV cache
  keeps K and V, 2 g head_dim values per token and layer.
- `mla`: `model.mla.LatentAttention`, DeepSeek's multi-head latent
  attention; its KV cache keeps one latent and one rotated key,
  kv_lora_rank + qk_rope_head_dim values per token and layer.

The blocks build the entry's module, the stacks its KV cache and RoPE
frequencies, the accounting reads its parameter count, cache and activation
elements, `python -m model.summary` its description, and
`ModelConfig.forward_fields` drops the fields only the other entries read.
The attention implementations (`model.attention.IMPLEMENTATIONS`) say which
shapes of queries, keys and values each takes (MLA's values are narrower
than its queries and keys), so a kind is refused by an implementation that
cannot run it, at start-up, by declaration.
"""
import dataclasses
from collections.abc import Callable

from configs.validation import MLA_FIELDS
from model.attention import Attention, mha_activation_elements, mha_params, mha_rotary_dim
from model.mla import LatentAttention, mla_activation_elements, mla_cache, mla_params
from model.registry import Registry


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """A `model.attention` choice: `module(cfg, rope=, window=, rngs=)`, a
  block's self-attention (`__call__`, `weights`, `decode`); `params(cfg)`,
  its parameters; `cache(cfg)`, its KV cache per token and layer, array name
  -> trailing shape (two axes, so that an array is [..., B, L, *shape] and
  `model/generate.py` finds its batch axis fourth from the end);
  `activations(cfg)`, the elements per token it keeps for the backward pass,
  the scores aside; `rotary_dim(cfg)`, the width RoPE rotates in each query
  and key head; `describe(cfg)`, its heads in a few words; `reads`, the config
  fields only it reads."""
  name: str
  doc: str
  module: Callable
  params: Callable
  cache: Callable
  activations: Callable
  rotary_dim: Callable
  describe: Callable
  reads: tuple[str, ...] = ()


def _mha_cache(cfg) -> dict[str, tuple[int, ...]]:
  return {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}


def _describe_mla(cfg) -> str:
  queries = f"q latent {cfg.q_lora_rank}" if cfg.q_lora_rank else "q direct"
  return (f"{cfg.num_heads} MLA heads of {cfg.qk_nope_head_dim} + {cfg.qk_rope_head_dim} "
          f"rotated (values {cfg.v_head_dim}; {queries}, kv latent {cfg.kv_lora_rank})")


ATTENTIONS = Registry("model.attention", [
    AttentionKind("mha", "multi-head attention: h query heads over num_kv_heads KV heads (MHA, "
                  "GQA, MQA); the cache keeps K and V", Attention, mha_params, _mha_cache,
                  mha_activation_elements, mha_rotary_dim,
                  lambda cfg: f"{cfg.num_heads} heads ({cfg.num_kv_heads} KV) of {cfg.head_dim}",
                  reads=("num_kv_heads", "head_dim", "qk_norm", "attention_output_gate")),
    AttentionKind("mla", "DeepSeek's multi-head latent attention (V2, V3): keys and values from "
                  "one latent, a shared RoPE key; the cache keeps the latent", LatentAttention,
                  mla_params, mla_cache, mla_activation_elements,
                  lambda cfg: cfg.qk_rope_head_dim, _describe_mla, reads=tuple(MLA_FIELDS)),
])
