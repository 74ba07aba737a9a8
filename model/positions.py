"""Step 2 of the lesson, position information: one `POSITIONS` entry per `model.pos_emb`.

A position scheme enters the model in one (or none) of three places, which
its entry declares:

- `embedding`: a module of the stack, `positions_BT -> [B, T, M]`, added to
  the token embeddings (sinusoidal, learned);
- `rotary`: queries and keys rotated by their positions inside every
  attention (RoPE, `model/embeddings.py`);
- `bias`: a module of the stack, `(q_positions_BT, k_positions_BS) -> [B or 1,
  H, T, S]` float32, computed once per forward pass and added to the scores
  of every self-attention layer (T5's relative bias, ALiBi), which needs an
  attention implementation that takes an additive bias.

The stacks (`model/transformer.py`), the accounting (`params`, per stack),
`ModelConfig.forward_fields` (`reads`), the length checks (`bounded`) and the
attention dispatcher's start-up check (`bias`) read the entry.
"""
import dataclasses
from collections.abc import Callable

from model.alibi import AlibiBias
from model.embeddings import LearnedPositions, SinusoidalPositions
from model.registry import Registry
from model.relative_bias import RelativeBias

ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_len",
               "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate",
               "rope_low_freq_factor", "rope_high_freq_factor", "partial_rotary_factor")


@dataclasses.dataclass(frozen=True)
class PositionScheme:
  """A `model.pos_emb` choice (see the module docstring).

  `embedding(cfg, rngs=)` and `bias(cfg, bidirectional=, rngs=)` build the
  stack's module, or are None; `params(cfg)` counts its parameters per stack;
  `reads` lists the config fields only it reads; `bounded` says positions
  past `model.max_len` have no encoding; `scales_embeddings` is what
  `model.scale_embeddings=None` means with it.
  """
  name: str
  doc: str
  embedding: Callable | None = None
  rotary: bool = False
  bias: Callable | None = None
  params: Callable = lambda cfg: 0
  reads: tuple[str, ...] = ()
  bounded: bool = False
  scales_embeddings: bool = False


POSITIONS = Registry("model.pos_emb", [
    PositionScheme("none", "no position information (a causal decoder still infers some)"),
    PositionScheme("sinusoidal", "fixed sin/cos encodings added to the embeddings (the "
                   "original transformer), any length", embedding=SinusoidalPositions,
                   scales_embeddings=True),
    PositionScheme("learned", "a learned [max_len, d] table added to the embeddings (GPT-2, "
                   "BERT)", embedding=LearnedPositions,
                   params=lambda cfg: cfg.max_len * cfg.d_model, bounded=True),
    PositionScheme("rope", "rotary embeddings of queries and keys (LLaMA), with "
                   "model.rope_scaling", rotary=True, reads=ROPE_FIELDS),
    PositionScheme("relative", "T5's learned relative bias on the scores, bucketed offsets",
                   bias=RelativeBias, params=lambda cfg: cfg.relative_buckets * cfg.num_heads,
                   reads=("relative_buckets", "relative_max_distance")),
    PositionScheme("alibi", "a fixed linear distance penalty per head on the scores (Press et "
                   "al. 2022; BLOOM), any length", bias=AlibiBias),
])
