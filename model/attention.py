"""Steps 3 and 4 of the lesson: scaled dot-product and multi-head attention.

`attention(q, k, v, ...)` is the one dispatcher over implementations:

- `reference`: the lesson's math written out: scores Q K^T / sqrt(d_k) in
  float32, mask, softmax, weighted sum of V. The oracle for every test.
  Grouped-query attention is an einsum over a [K, G] split of the query
  heads, so K/V are never repeated in memory.
- `xla`, `cudnn`: `jax.nn.dot_product_attention` with that implementation.
- `pallas`: our online-softmax kernels (`model/kernels/`): Mosaic GPU on
  H100/H200 for 16-bit inputs with head_dim 64 or 128, Mosaic TPU on TPUs,
  Triton elsewhere; on a mesh each device runs it on its own rows and heads
  (`sharded_kernel`).
- `auto`: the fastest correct choice for the device and the inputs (see
  `choose_implementation`).

Masks, combined by logical AND: `causal` (top-left aligned: query i sees keys
j <= i), `window` (a sliding window, Mistral's `sliding_window`: query i sees
keys j with |i - j| < window, so with `causal` the `window` keys i - window
+ 1 .. i; `cudnn` takes it only with `causal`, `pallas` not yet),
`segment_ids` (packing and padding: a query sees keys of its own segment; id
0 marks padding and is never attended), and a dense boolean
`mask` [B, T, S] (True = may attend). A query whose row is fully masked gets
zeros, not NaN, from every implementation.

An additive `bias` [1 or B, H, T, S] (float32; T5's relative position bias)
is added to the scaled scores by `reference`, `xla` and `cudnn` (through
`jax.nn.dot_product_attention(bias=...)`); our `pallas` kernels take none.

A `softcap` c (Gemma-2's attention logit soft-capping) replaces the scaled
scores s by c tanh(s / c), before the bias and the mask, so no score leaves
(-c, c). `reference` and `pallas` (all three of our kernels) take it;
`xla` with a soft-cap computes the reference's einsums (XLA compiles them;
`jax.nn.dot_product_attention` has no soft-cap), and `cudnn` refuses it.

Values may be narrower or wider than queries and keys: v [B, S, K, D_v]
with D_v != D gives [B, T, H, D_v] (DeepSeek's multi-head latent attention,
`model/mla.py`). `reference` and `xla` take it (`xla` then runs the
reference's einsums: `jax.nn.dot_product_attention` wants v shaped as k);
`pallas` takes it without a score matrix: the Mosaic TPU kernel at the
values' own width, the GPU kernels and context-parallel attention with q, k
and v zero-padded to one width (`model.kernels.common.common_head_width`),
the output cut back; `cudnn` refuses it.

Every option travels as one `AttentionOptions` value, from `Attention` to the
dispatcher and into the implementation, prefill and decode alike. Each
implementation is an `IMPLEMENTATIONS` entry that declares the optional
features it takes (`takes`) and the shapes beyond q, k, v of one head width
(`shapes`); `Implementation.refusal` is the one check behind
the start-up refusal (`check_support`), the trace-time refusal (`attention`),
`auto` (`auto_implementation`) and the memory estimate
(`model_implementation`). An option or a shape an implementation does not
declare is refused in one line naming it, never dropped.
"""
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.errors import UserError
from model.embeddings import apply_rope
from model.gated_deltanet import rule_refusal
from model import context_parallel
from model.kernels import KERNEL_TAKES, MOSAIC_GPU_DTYPES, MOSAIC_GPU_HEAD_DIMS, is_hopper
from model.kernels.common import common_head_width
from model.layers import (Dense, batch_axes, check_rows_split, compile_device,
                          token_matrix_products)
from model.norms import make_qk_norm
from model.positions import POSITIONS
from model.registry import Registry
from model.remat import tag
from model.scores import SCORES

# The optional features of an attention call (`AttentionOptions.features`), in
# the order refusals name them, with the words a message uses. Causal and
# segment-id masks are not optional: every implementation takes them.
FEATURES = {"mask": "dense mask (option `mask`)",
            "window": "sliding window (option `window`)",
            "bias": "additive bias (option `bias`)",
            "softcap": "soft-cap (option `softcap`)"}


# What the arrays of a call may be beyond q, k and v of one head width D, as
# `call_features` finds them, with the words a message uses: declared apart
# from the options' features, in `Implementation.shapes`.
SHAPES = {"value_head_dim": "value head width other than the query and key width (v's D_v "
                            "!= q's D: multi-head latent attention)"}


def call_features(q_BTHD, v_BSKD, o: "AttentionOptions") -> tuple[str, ...]:
  """The features a call on these arrays with options `o` uses: `o`'s
  (`AttentionOptions.features`) and its arrays' (`SHAPES`)."""
  shapes = ("value_head_dim",) if v_BSKD.shape[-1] != q_BTHD.shape[-1] else ()
  return o.features() + shapes


def score_feature(score: str) -> str:
  """The feature of attention score `score` (an `SCORES` name)."""
  return f"score:{score}"


def _feature_words(feature: str) -> str:
  if feature in SHAPES:
    return SHAPES[feature]
  if feature.startswith("score:"):
    return f"attention score {feature[len('score:'):]!r} (option `score`)"
  return FEATURES[feature]


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """What an attention call computes beyond q, k and v: the masks (`causal`,
  `mask`, `segment_ids`, `window`), the `scale` on Q K^T (None: 1/sqrt(D)),
  the additive `bias`, the `softcap` and the `score` function (an `SCORES`
  name). See the module docstring for each."""
  causal: bool = False
  mask: Any = None
  segment_ids: Any = None
  scale: float | None = None
  window: int | None = None
  bias: Any = None
  softcap: float | None = None
  score: str = "softmax"

  def features(self) -> tuple[str, ...]:
    """The optional features this call uses (`FEATURES`, and its score's). A
    window without the causal mask also counts as a dense mask (cuDNN takes a
    window only on top of the causal mask)."""
    used = {"mask": self.mask is not None or (self.window is not None and not self.causal),
            "window": self.window is not None, "bias": self.bias is not None,
            "softcap": self.softcap is not None}
    return tuple(f for f in FEATURES if used[f]) + (score_feature(self.score),)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """A `model.attention_impl` choice: `run(q, k, v, options, lowering)`, the
  optional features it `takes` (`AttentionOptions.features`) and the
  `shapes` it takes (`SHAPES`); `auto` has no `run` (it resolves to another
  entry)."""
  name: str
  doc: str
  run: Callable | None
  takes: frozenset
  reads: tuple[str, ...] = ()
  shapes: frozenset = frozenset()

  def refusal(self, features) -> str | None:
    """The first of `features` (options' and shapes': `call_features`) this
    implementation does not take, or None."""
    return next((f for f in features if f not in self.takes and f not in self.shapes), None)


def _split_segment_ids(segment_ids):
  """[B, T] (self-attention) or a (q [B, T], kv [B, S]) pair -> the pair."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return segment_ids
  return segment_ids, segment_ids


def window_mask(T: int, S: int, window: int):
  """[1, T, S]: query i may see key j when |i - j| < window (top-left aligned)."""
  offset_TS = jnp.arange(T)[:, None] - jnp.arange(S)[None, :]
  return (jnp.abs(offset_TS) < window)[None]


def combined_mask(T: int, S: int, *, causal=False, mask=None, segment_ids=None, window=None):
  """The boolean [B or 1, T, S] mask that all the masks add up to, or None.
  The causal part is an iota comparison (query i sees key j <= i), which XLA
  folds into the ops that read it."""
  q_seg, kv_seg = _split_segment_ids(segment_ids)
  out = None
  if causal:
    out = (jnp.arange(T)[:, None] >= jnp.arange(S)[None, :])[None]
  if window is not None:
    out = window_mask(T, S, window) if out is None else out & window_mask(T, S, window)
  if q_seg is not None:
    seg = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    out = seg if out is None else out & seg
  if mask is not None:
    out = mask if out is None else out & mask
  return out


def soft_cap(scores, cap: float | None):
  """cap * tanh(scores / cap) (Gemma-2's soft-capping), or the scores for None."""
  return scores if cap is None else cap * jnp.tanh(scores / cap)


def _options(options, fields) -> AttentionOptions:
  """`options` (None: the defaults) with `fields` replaced."""
  options = AttentionOptions() if options is None else options
  return dataclasses.replace(options, **fields) if fields else options


# The key and value layouts the reference einsums take: sequence-first
# [B, S, K, D] (training's, the kernels') or heads-first [B, K, S, D] (the KV
# cache's: `Attention.decode`).
_KV_SPEC = {False: "bskd", True: "bksd"}


def _grouped_scores(q_BTHD, k, o: AttentionOptions, heads_first: bool = False):
  """The float32 scores softcap(Q K^T * scale) + bias as [B, K, T*G, S] (H =
  K * G heads; row t*G + g is query t of head k*G + g), and the boolean mask
  broadcastable to them (None: every key visible); `k` is [B, S, K, D], or
  [B, K, S, D] when `heads_first`.

  One 4-D batched product per KV head group: XLA's CPU backend runs the 5-D
  [B, K, G, T, S] form with a transpose of the scores on either side, and
  this form without (docs/benchmarks.md, "Where a CPU step's time goes").
  Same products and sums."""
  B, T, H, D = q_BTHD.shape
  K, S = (k.shape[1], k.shape[2]) if heads_first else (k.shape[2], k.shape[1])
  G = H // K
  scale = D ** -0.5 if o.scale is None else o.scale
  q_BKXD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
  scores = jnp.einsum(f"bkxd,{_KV_SPEC[heads_first]}->bkxs", q_BKXD, k,
                      preferred_element_type=jnp.float32) * scale
  scores = soft_cap(scores, o.softcap)
  if o.bias is not None:
    bias = o.bias.astype(jnp.float32).reshape(o.bias.shape[0], K, G, T, S)
    scores = scores + bias.transpose(0, 1, 3, 2, 4).reshape(-1, K, T * G, S)
  valid = combined_mask(T, S, causal=o.causal, mask=o.mask, segment_ids=o.segment_ids,
                        window=o.window)
  if valid is not None:
    valid = jnp.broadcast_to(valid[:, None, :, None, :], (valid.shape[0], 1, T, G, S))
    valid = valid.reshape(-1, 1, T * G, S)
  return scores, valid


def attention_weights(q_BTHD, k_BSKD, options: AttentionOptions | None = None, **fields):
  """score(softcap(Q K^T * scale) + bias, M) in float32, [B, K, G, T, S]
  (H = K * G heads), with the score function of `options.score` (softmax by
  default); `fields` replace those of `options`.

  Fully masked rows are all zeros.
  """
  o = _options(options, fields)
  B, T, H, _ = q_BTHD.shape
  K = k_BSKD.shape[2]
  scores, valid = _grouped_scores(q_BTHD, k_BSKD, o)
  weights = SCORES[o.score].weights(scores, valid)
  return weights.reshape(B, K, T, H // K, -1).transpose(0, 1, 3, 2, 4)


def reference_attention(q_BTHD, k, v, options: AttentionOptions | None = None, *,
                        heads_first: bool = False, **fields):
  """The lesson's math: the weights of `attention_weights`, times V (whose
  head width may differ from q's and k's: the output has V's). k and v are
  [B, S, K, D], or [B, K, S, D] when `heads_first` (the KV cache's layout,
  which the products read without a copy).

  Under softmax a fully masked query row is set to zero in the output
  [B, T, H, D] rather than in the weights [.., T, S]: the same result (its
  weights are zeros either way) with one pass fewer over the weights."""
  o = _options(options, fields)
  B, T, H, _ = q_BTHD.shape
  K, D = k.shape[1 if heads_first else 2], v.shape[3]
  scores, valid = _grouped_scores(q_BTHD, k, o, heads_first)
  if o.score == "softmax" and valid is not None:
    weights = jax.nn.softmax(jnp.where(valid, scores, jnp.finfo(jnp.float32).min), axis=-1)
  else:
    weights = SCORES[o.score].weights(scores, valid)
  out = jnp.einsum(f"bkxs,{_KV_SPEC[heads_first]}->bkxd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  out = out.reshape(B, K, T, H // K, D).transpose(0, 2, 1, 3, 4).reshape(B, T, H, D)
  if o.score == "softmax" and valid is not None:
    row_valid_BT = valid[:, 0, ::H // K].any(-1)  # rows t*G: query t
    out = jnp.where(row_valid_BT[:, :, None, None], out, 0)
  return out.astype(q_BTHD.dtype)


def _jax_attention(q_BTHD, k_BSKD, v_BSKD, o: AttentionOptions, implementation: str):
  """`jax.nn.dot_product_attention`, with fully masked rows set to zero.

  The window goes in as its `local_window_size` (window - 1 keys to the left;
  to the right too unless causal). The bias goes in in q's dtype (cuDNN
  takes no other). It has no soft-cap, only the softmax score and values as
  wide as the keys: `xla` with any of them runs the reference einsums (which
  XLA compiles); `cudnn` declares none, so the dispatcher refuses them
  before this runs.
  """
  if o.softcap is not None or o.score != "softmax" or v_BSKD.shape[-1] != k_BSKD.shape[-1]:
    return reference_attention(q_BTHD, k_BSKD, v_BSKD, o)
  T, S = q_BTHD.shape[1], k_BSKD.shape[1]
  valid = combined_mask(T, S, mask=o.mask, segment_ids=o.segment_ids)
  local = None if o.window is None else (o.window - 1, 0 if o.causal else o.window - 1)
  out = jax.nn.dot_product_attention(
      q_BTHD, k_BSKD, v_BSKD, mask=None if valid is None else valid[:, None],
      bias=None if o.bias is None else o.bias.astype(q_BTHD.dtype), scale=o.scale,
      is_causal=o.causal, local_window_size=local, implementation=implementation)
  if valid is None:
    return out
  causal_and_window = combined_mask(T, S, causal=o.causal, window=o.window)
  if causal_and_window is not None:
    valid = valid & causal_and_window
  row_valid_BT11 = valid.any(-1)[:, :, None, None]
  return jnp.where(row_valid_BT11, out, 0).astype(q_BTHD.dtype)


def kernel_head_split(num_heads: int, num_kv_heads: int, tensor: int) -> str:
  """How our kernels' heads split over `tensor` devices (`sharded_kernel`).

  "both": query and KV heads split (K % tensor == 0), each device runs the
  kernel on H / tensor query and K / tensor KV heads. "query": the query heads
  split and the KV heads are replicated (tensor % K == 0: MQA, or fewer KV
  heads than devices; the parameter rules replicate those heads too); each
  device takes the one KV head its query heads share. "whole": tensor is 1 or
  does not divide H, every device runs all heads (as the parameter rules then
  replicate the query heads). Raises `UserError` where the query heads split
  but the KV heads neither split nor fit one per device.
  """
  if tensor == 1 or num_heads % tensor:
    return "whole"
  if num_kv_heads % tensor == 0:
    return "both"
  if tensor % num_kv_heads == 0:
    return "query"
  raise UserError(f"attention_impl=pallas on mesh.tensor={tensor}: {num_heads} query heads "
                  f"split {tensor} ways but {num_kv_heads} KV heads neither split nor divide "
                  "it; choose num_kv_heads dividing or divisible by mesh.tensor")


def sharded_kernel(kernel, q_BTHD, k_BSKD, v_BSKD, q_seg_BT=None, kv_seg_BS=None, *,
                   sequence: str | None = None):
  """`kernel(q, k, v, q_seg, kv_seg)` under `jax.shard_map` over the abstract mesh.

  XLA cannot partition a Mosaic kernel (it refuses) nor a Triton one (it runs
  it on the whole batch on every device), so each device runs the kernel on
  its own rows and heads: the batch split over the batch axes (data, fsdp)
  with the segment ids of those rows, the heads over `tensor` as
  `kernel_head_split` says; the sequence stays whole per device, or is split
  over the mesh axis `sequence` (context parallelism: the kernel is then the
  ring or the all-gather, which talk over that axis). The kernel's custom VJP
  runs inside, on the same shards. Without a mesh (or on a mesh of one
  device) the kernel runs as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS)
  B, _, H, _ = q_BTHD.shape
  K = k_BSKD.shape[2]
  check_rows_split(B, mesh, "attention_impl=pallas")
  batch = batch_axes(mesh)
  tensor = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
  split = kernel_head_split(H, K, tensor)
  heads = None if split == "whole" else "tensor"
  q_spec = P(batch, sequence, heads, None)
  kv_spec = P(batch, sequence, "tensor" if split == "both" else None, None)
  seg_spec = P(batch, sequence)

  def local(q, k, v, *segments):
    if split == "query":  # the one KV head this device's query heads share
      head = jax.lax.axis_index("tensor") * K // tensor
      k, v = (jax.lax.dynamic_slice_in_dim(x, head, 1, axis=2) for x in (k, v))
    return kernel(q, k, v, *(segments or (None, None)))

  segments = () if q_seg_BT is None else (q_seg_BT, kv_seg_BS)
  # check_vma=False: the kernels' pallas_call outputs do not declare how they vary over
  # the mesh; the specs above say it.
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec)
                       + (seg_spec,) * len(segments), out_specs=q_spec, check_vma=False)(
                           q_BTHD, k_BSKD, v_BSKD, *segments)


def _pallas_attention(q_BTHD, k_BSKD, v_BSKD, o: AttentionOptions, lowering: str):
  """Our kernels (`model/kernels/router.py`) for `compile_device()`, one per
  device of the mesh (`sharded_kernel`). The dispatcher has checked that `o`
  uses only what the kernels declare (`model.kernels.KERNEL_TAKES`)."""
  from model.kernels.router import flash_attention  # pylint: disable=import-outside-toplevel
  device = compile_device()

  def kernel(q, k, v, q_seg, kv_seg):
    return flash_attention(q, k, v, causal=o.causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                           scale=o.scale, softcap=o.softcap, window=o.window,
                           lowering=None if lowering == "auto" else lowering, device=device)

  return sharded_kernel(kernel, q_BTHD, k_BSKD, v_BSKD, *_split_segment_ids(o.segment_ids))


def _reference_run(q, k, v, o, lowering):
  del lowering
  return reference_attention(q, k, v, o)


_EVERY_SCORE = frozenset(score_feature(name) for name in SCORES)

IMPLEMENTATIONS = Registry("model.attention_impl", [
    Implementation("reference", "the lesson's math in float32 einsums; the tests' oracle",
                   _reference_run, frozenset(FEATURES) | _EVERY_SCORE, shapes=frozenset(SHAPES)),
    Implementation("xla", "jax.nn.dot_product_attention (XLA); the reference einsums for a "
                   "soft-cap, another score or another value width", lambda q, k, v, o, _:
                   _jax_attention(q, k, v, o, "xla"), frozenset(FEATURES) | _EVERY_SCORE,
                   shapes=frozenset(SHAPES)),
    Implementation("cudnn", "jax.nn.dot_product_attention's cuDNN fused attention (GPU)",
                   lambda q, k, v, o, _: _jax_attention(q, k, v, o, "cudnn"),
                   frozenset({"mask", "window", "bias", score_feature("softmax")})),
    Implementation("pallas", "our FlashAttention kernels (model/kernels/)", _pallas_attention,
                   frozenset(KERNEL_TAKES), reads=("pallas_lowering",),
                   shapes=frozenset(SHAPES)),
    Implementation("auto", "the fastest implementation that takes the inputs, per device",
                   None, frozenset()),
])


def refusal_message(implementation: str, feature: str, source: str | None = None) -> str:
  """One line: `implementation` takes no `feature`, and which do; `source`
  names the config field that asked for it."""
  takers = [n for n, e in IMPLEMENTATIONS.items() if e.run is None or e.refusal((feature,)) is None]
  prefix = "" if source is None else f"config field {source}: "
  return (f"{prefix}attention_impl={implementation} takes no {_feature_words(feature)}; use "
          f"attention_impl {', '.join(takers[:-1])} or {takers[-1]}")


def check_options(implementation: str, features: tuple[str, ...]) -> None:
  """Raises `UserError` when `implementation` does not take one of
  `features` (a call's: `call_features`)."""
  refused = IMPLEMENTATIONS[implementation].refusal(features)
  if refused is not None:
    raise UserError(refusal_message(implementation, refused))


_CONTEXT_IMPLEMENTATIONS = ("reference", "xla", "pallas", "auto")


def _context_takes(implementation: str) -> frozenset:
  """What context-parallel attention takes with `implementation`'s blocks:
  `context_parallel.TAKES` for the JAX blocks, `KERNEL_BLOCK_TAKES` (no
  sliding window) for our kernels'."""
  if implementation == "pallas":
    return context_parallel.KERNEL_BLOCK_TAKES | frozenset(SHAPES)
  return context_parallel.TAKES | frozenset(SHAPES)


def _context_refusal(implementation: str, features) -> tuple[str | None, str, str] | None:
  """(the refused feature or None for the implementation, what, fix) where
  context-parallel attention cannot run this call: an implementation whose
  blocks cannot return their log-sum-exp (cudnn), or a feature the blocks do
  not take."""
  if implementation not in _CONTEXT_IMPLEMENTATIONS:
    return (None, f"attention_impl={implementation}", "the ring's blocks are our JAX "
            "attention or our Pallas kernels: attention_impl reference, xla, pallas or auto")
  takes = _context_takes(implementation)
  refused = next((f for f in features if f not in takes), None)
  if refused is not None:
    kernels = " (attention_impl=pallas: no window; use xla)" if implementation == "pallas" else ""
    return (refused, _feature_words(refused), "context-parallel attention takes causal, "
            f"segment and causal-window masks, a soft-cap and the softmax score{kernels}")
  return None


def check_context(cfg, n: int) -> None:
  """Raises `UserError` when the model's attention cannot run split over
  `n` devices of the context axis (`mesh.context`): one line naming the field."""
  if n == 1:
    return
  features = config_features(cfg)
  refusal = _context_refusal(cfg.attention_impl, features)
  if refusal is None:
    return
  feature, what, fix = refusal
  field = features[feature] if feature else f"model.attention_impl={cfg.attention_impl!r}"
  raise UserError(f"config field {field}: mesh.context={n} takes no {what} ({fix}); use "
                  "mesh.context=1")


def _context_attention(q_BTHD, k_BSKD, v_BSKD, o: AttentionOptions, implementation: str,
                       lowering: str, n: int):
  """Self-attention of rows split over the context axis (`mesh.context` = n):
  the ring or the all-gather of `model/context_parallel.py` on each device's
  block (batch and heads split as `sharded_kernel` splits them), its blocks
  our Pallas kernels for `pallas` (and for `auto` where it chooses them),
  the JAX blocks otherwise."""
  features = call_features(q_BTHD, v_BSKD, o)
  if implementation == "auto":
    chosen = choose_implementation(q_BTHD, features, o.segment_ids is not None)
    implementation = "pallas" if chosen == "pallas" else "xla"
  refusal = _context_refusal(implementation, features)
  if refusal is not None:
    raise UserError(f"mesh.context={n} takes no {refusal[1]} ({refusal[2]})")
  strategy = context_parallel.choose_strategy(context_parallel.current_strategy(),
                                              q_BTHD.shape[2], k_BSKD.shape[2], n)
  layout = context_parallel.layout_for(o.causal)
  fn = {"ring": context_parallel.ring_attention,
        "all_gather": context_parallel.all_gather_attention}[strategy]
  scale = q_BTHD.shape[-1] ** -0.5 if o.scale is None else o.scale
  plain = dataclasses.replace(o, segment_ids=None, scale=scale)
  kernel = None if implementation != "pallas" else dict(
      lowering=None if lowering == "auto" else lowering, device=compile_device())

  def run(q, k, v, q_seg, kv_seg):
    return fn(q, k, v, q_seg, kv_seg, options=plain, axis=context_parallel.AXIS, layout=layout,
              kernel=kernel)

  out_BTHD = sharded_kernel(run, *common_head_width(q_BTHD, k_BSKD, v_BSKD),
                            *_split_segment_ids(o.segment_ids), sequence=context_parallel.AXIS)
  return out_BTHD[..., :v_BSKD.shape[-1]]


@functools.lru_cache(maxsize=None)
def _log_choice(message: str) -> None:
  logging.info(message)


def auto_implementation(*, backend: str, dtype, head_dim: int,
                        features: tuple[str, ...] = (), segments: bool = False,
                        device_kind: str = "") -> str:
  """The `auto` rule, for calls that use `features` (`AttentionOptions.features`)
  with segment ids (`segments`: packed or padded rows) or without, on a
  device of `device_kind`.

  On a GPU: our kernel (`pallas`, the Mosaic GPU kernels) on a Hopper for
  16-bit inputs with segment ids, at the head dims it takes (64, 128) and
  with the features it takes; else `cudnn` for 16-bit inputs with head_dim a
  multiple of 8 up to 128 and no feature but a causal window; otherwise
  `xla`. Measured on an H200 (jax 0.11.2, bf16, causal; `python -m
  bench.attention`, bench/RESULTS.md 2026-12-04), fwd / fwd+bwd TFLOP/s:

  | rows (B x S, heads, D)          | ours (Mosaic GPU) | cudnn      |
  |---------------------------------|-------------------|------------|
  | 8 x 1024, 12, 64, packed        | 62.3 / 90.6       | 26.1 / 64.6 |
  | 8 x 1024, 12, 64                | 55.9 / 104        | 48.8 / 96.9 |
  | 4 x 4096, 32, 64                | 249 / 254         | 276 / 310  |
  | 4 x 4096, 32 / 8 KV, 64         | 249 / 269         | 262 / 316  |
  | 1 x 16384, 16, 128              | 537 / 432         | 467 / 534  |

  cuDNN takes segment ids only as the dense [B, 1, T, S] mask built from
  them, which slows it (GPT-2 small's packed row: 64.6 against 96.9 without);
  our kernels skip the tiles that share no document (cuDNN's last three rows
  read 15% to 30% under an earlier run's on the same card, which only
  widens its lead there). GPT-2 small training
  (`bench.train_throughput`, segment ids in the batch): 308,440 tokens/s with
  our kernel, 297,863 with cuDNN. Without segment ids cuDNN stays: it led
  at 4k and 16k tokens and trailed by 7% only at GPT-2 small's 1,024.
  Other GPUs: cuDNN (our Triton kernels were not faster on the packed row:
  61.3 against 64.6 fwd+bwd).

  On a TPU: `pallas` (our Mosaic TPU kernel) where it takes the features (no
  dense mask or bias), otherwise `xla`. Memory decides
  this: the kernel keeps O(T) per row for the backward pass where XLA's
  attention keeps every layer's [heads, T, S] scores, so llama2_7b at 4,096
  tokens per chip on a v5p-64 fits without remat with it (41 GiB per chip)
  and not with XLA (108 GiB; docs/compiling.md). Its speed against XLA and
  JAX's splash attention is untimed until `bench/attention.py` runs on a TPU.

  On a CPU: `reference`, whose 4-D einsums XLA's CPU backend runs faster
  than `xla`'s (jax.nn.dot_product_attention) in every case of the table
  in docs/benchmarks.md ("Where a CPU step's time goes";
  `python -m bench.vs_torch --parts attention`).
  """
  if (backend == "gpu" and segments and is_hopper(device_kind)
      and jnp.dtype(dtype).name in MOSAIC_GPU_DTYPES and head_dim in MOSAIC_GPU_HEAD_DIMS
      and IMPLEMENTATIONS["pallas"].refusal(features) is None):
    return "pallas"
  fused = {"window", score_feature("softmax")}
  if (backend == "gpu" and set(features) <= fused
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  if backend == "tpu" and IMPLEMENTATIONS["pallas"].refusal(features) is None:
    return "pallas"
  if backend == "cpu":
    return "reference"
  return "xla" if IMPLEMENTATIONS["xla"].refusal(features) is None else "reference"


def choose_implementation(q_BTHD, features: tuple[str, ...], segments: bool = False) -> str:
  """`auto_implementation` for these queries (with segment ids or not) on the
  device of `compile_device()` (logged once); the rule and the measurements
  it rests on are `auto_implementation`'s docstring."""
  D = q_BTHD.shape[-1]
  device = compile_device()
  choice = auto_implementation(backend=device.platform, dtype=q_BTHD.dtype, head_dim=D,
                               features=features, segments=segments,
                               device_kind=device.device_kind)
  _log_choice(f"attention_impl=auto chose {choice} for head_dim={D}, "
              f"dtype={q_BTHD.dtype}, features={', '.join(features)}, "
              f"segment ids: {'yes' if segments else 'no'} on {device.device_kind}")
  return choice


def config_features(cfg) -> dict[str, str]:
  """The optional features the model's training attention uses -> the config
  field (with its value) that asks for each: the position scheme's bias,
  the sliding window (causal), the soft-cap, the score function, and values
  of another width than the keys (MLA's v_head_dim)."""
  out = {}
  if POSITIONS[cfg.pos_emb].bias is not None:
    out["bias"] = f"model.pos_emb={cfg.pos_emb!r}"
  if cfg.sliding_window is not None:
    out["window"] = f"model.sliding_window={cfg.sliding_window}"
  if cfg.attn_softcap is not None:
    out["softcap"] = f"model.attn_softcap={cfg.attn_softcap}"
  out[score_feature(cfg.attention_score)] = f"model.attention_score={cfg.attention_score!r}"
  if cfg.v_head_dim != cfg.head_dim:
    out["value_head_dim"] = (f"model.v_head_dim={cfg.v_head_dim} (model.attention="
                             f"{cfg.attention!r}, queries and keys {cfg.head_dim} wide)")
  return out


def model_implementation(cfg, backend: str | None = None) -> str:
  """The implementation the model's training attention runs:
  `cfg.attention_impl`, with `auto` resolved for `backend` (default: JAX's
  default backend) over `config_features`."""
  if IMPLEMENTATIONS[cfg.attention_impl].run is not None:
    return cfg.attention_impl
  return auto_implementation(backend=backend or jax.default_backend(), dtype=cfg.dtype,
                             head_dim=cfg.head_dim, features=tuple(config_features(cfg)))


def check_support(cfg) -> None:
  """Raises `UserError` when `cfg.attention_impl` does not take a feature the
  config asks for (`config_features`: one line naming the field), or when
  `cfg.pallas_lowering` names a kernel that does not take the config's dtype
  or head dim (the kernel package declares what each takes; `flash_attention`
  checks the arrays again at trace time), or when the linear_attention layers'
  rule cannot run on `cfg.attention_impl` (`gated_deltanet.rule_refusal`)."""
  linear = any(cfg.layer_kind(i).attention == "linear_attention"
               for i in range(len(cfg.layer_types)))
  refused_linear = linear and rule_refusal(cfg)
  if refused_linear:
    field, why = refused_linear
    raise UserError(f"config field {field}={getattr(cfg, field.split('.')[1])!r}: {why}")
  implementation = IMPLEMENTATIONS[cfg.attention_impl]
  features = config_features(cfg)
  if implementation.run is not None:
    refused = implementation.refusal(features)
    if refused is not None:
      raise UserError(refusal_message(cfg.attention_impl, refused, features[refused]))
  if cfg.pallas_lowering != "mosaic_gpu":
    return
  field = f"config field model.pallas_lowering={cfg.pallas_lowering!r}"
  dtype = jnp.dtype(cfg.dtype).name
  if dtype not in MOSAIC_GPU_DTYPES:
    raise UserError(f"{field}: needs model.dtype {' or '.join(MOSAIC_GPU_DTYPES)}, "
                    f"not {dtype} (or use triton)")
  if cfg.head_dim not in MOSAIC_GPU_HEAD_DIMS:
    raise UserError(f"{field}: needs a head_dim of "
                    f"{' or '.join(map(str, MOSAIC_GPU_HEAD_DIMS))}, not {cfg.head_dim} "
                    "(or use triton)")


def attention(q_BTHD, k_BSKD, v_BSKD, options: AttentionOptions | None = None, *,
              implementation: str = "reference", pallas_lowering: str = "auto", **fields):
  """Scaled dot-product attention over H query heads and K <= H KV heads.

  q [B, T, H, D], k [B, S, K, D] and v [B, S, K, D_v] with H % K == 0 (MHA,
  GQA, MQA); returns [B, T, H, D_v] in q's dtype (D_v != D: the
  `value_head_dim` shape, which not every implementation takes). `options`
  (an `AttentionOptions`; its fields may also be given, or replaced, as
  keywords: `causal=True`, ...) says what is computed: see the module docstring for the masks, the additive
  `bias` [1 or B, H, T, S], the `softcap` and the `score`. An implementation
  that does not take one of them refuses it in one line (`UserError`).
  `pallas_lowering` (auto, triton, mosaic_gpu, mosaic_tpu) picks our kernel when
  implementation is pallas.
  """
  o = _options(options, fields)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r}: must be one of "
                     f"{', '.join(IMPLEMENTATIONS)}")
  n = context_parallel.context_size()
  if n > 1:
    return _context_attention(q_BTHD, k_BSKD, v_BSKD, o, implementation, pallas_lowering, n)
  features = call_features(q_BTHD, v_BSKD, o)
  if IMPLEMENTATIONS[implementation].run is None:
    implementation = choose_implementation(q_BTHD, features, o.segment_ids is not None)
  check_options(implementation, features)
  with jax.named_scope("attention"):
    return IMPLEMENTATIONS[implementation].run(q_BTHD, k_BSKD, v_BSKD, o, pallas_lowering)


class Attention(nnx.Module):
  """Multi-head attention with h query heads and g KV heads (Step 4).

  Self-attention when `context` is None, cross-attention (queries from x,
  keys and values from the encoder output) otherwise. W_Q is [d, h, d_k],
  W_K and W_V are [d, g, d_k], W_O is [h, d_k, d]. With `qk_norm`, each
  head's queries and keys go through an RMSNorm over d_k (its own learned
  scale [d_k] for Q and for K, shared by the heads) before RoPE, as Qwen3,
  OLMo-2 and Gemma-3 do: the scores then grow with the scales, not with the
  activations (zero-centred under model.norm=rmsnorm_zero_centred, as
  Qwen3-Next's). RoPE rotates the first `rotary_dim` = head_dim x
  partial_rotary_factor dims of each head (`rope`'s frequencies are that
  wide). With `attention_output_gate` (Qwen3-Next), W_G [d, h, d_k] gives a
  gate per head and dim: the attention output times sigmoid(x W_G) enters
  W_O.
  """

  def __init__(self, cfg, *, rope=None, window: int | None = None, rngs: nnx.Rngs):
    """`cfg`: the `model.config.ModelConfig`; `window`: the sliding window of
    this layer's self-attention (`cfg.layer_window(layer)`), None for none."""
    d, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, b_out = cfg.qkv_bias, cfg.out_bias
    self.rope = rope  # (inv_freq, attention_factor) or None
    # The options every call of this layer shares; each call adds its masks and bias.
    self.options = AttentionOptions(scale=cfg.attention_scale, softcap=cfg.attn_softcap,
                                    score=cfg.attention_score)
    self.window = window  # self-attention only
    self.implementation = cfg.attention_impl
    self.pallas_lowering = cfg.pallas_lowering
    std = cfg.hidden_std
    self.q_proj = Dense(d, (H, Dh), ("embed", "heads", "head_dim"), use_bias=b, cfg=cfg, rngs=rngs,
                        std=std, fp8=True)
    self.k_proj = Dense(d, (K, Dh), ("embed", "kv_heads", "head_dim"), use_bias=b, cfg=cfg,
                        rngs=rngs, std=std, fp8=True)
    self.v_proj = Dense(d, (K, Dh), ("embed", "kv_heads", "head_dim"), use_bias=b, cfg=cfg,
                        rngs=rngs, std=std, fp8=True)
    self.o_proj = Dense((H, Dh), (d,), ("heads", "head_dim", "embed"), use_bias=b_out, cfg=cfg,
                        rngs=rngs, in_axes=2, std=std, fp8=True)
    self.gate_proj = (Dense(d, (H, Dh), ("embed", "heads", "head_dim"), use_bias=b, cfg=cfg,
                            rngs=rngs, std=std, fp8=True) if cfg.attention_output_gate else None)
    self.q_norm = make_qk_norm(Dh, cfg=cfg, rngs=rngs) if cfg.qk_norm else None
    self.k_norm = make_qk_norm(Dh, cfg=cfg, rngs=rngs) if cfg.qk_norm else None

  def _rotate(self, x_BTHD, positions_BT):
    if self.rope is None or positions_BT is None:
      return x_BTHD
    inv_freq, attention_factor = self.rope
    return apply_rope(x_BTHD, positions_BT, inv_freq, attention_factor)

  def project_q(self, x_BTM, positions_BT=None):
    """Q [B, T, h, d_k]: normalised with `qk_norm`, then rotated when RoPE is
    on and `positions_BT` are given (self-attention)."""
    q_BTHD = tag(self.q_proj(x_BTM), "query_proj")
    if self.q_norm is not None:
      q_BTHD = self.q_norm(q_BTHD)
    return self._rotate(q_BTHD, positions_BT)

  def project_kv(self, context_BSM, positions_BS=None):
    """K and V [B, S, g, d_k] (K normalised with `qk_norm`, then rotated when
    RoPE is on and `positions_BS` are given)."""
    k_BSKD = tag(self.k_proj(context_BSM), "key_proj")
    if self.k_norm is not None:
      k_BSKD = self.k_norm(k_BSKD)
    return self._rotate(k_BSKD, positions_BS), tag(self.v_proj(context_BSM), "value_proj")

  def project_out(self, out_BTHD, x_BTM):
    """W_O of the heads' output, gated by sigmoid(x W_G) with
    `attention_output_gate` (x: the layer's input, the queries' tokens)."""
    out_BTHD = tag(out_BTHD, "attention_out")
    if self.gate_proj is not None:
      gate_BTHD = jax.nn.sigmoid(self.gate_proj(x_BTM).astype(jnp.float32))
      out_BTHD = (out_BTHD.astype(jnp.float32) * gate_BTHD).astype(out_BTHD.dtype)
    return tag(self.o_proj(out_BTHD), "out_proj")

  def __call__(self, x_BTM, *, positions_BT=None, context_BSM=None, context_kv=None,
               causal=False, segment_ids=None, mask=None, bias=None):
    """Self-attention over x, or cross-attention to `context_BSM` (or to its
    keys and values `context_kv` = `project_kv(context_BSM)`, computed once
    for a whole generation). `bias` [1 or B, H, T, S] is added to the scores
    (the stack's relative position bias)."""
    window = None
    if context_kv is not None or context_BSM is not None:
      q_BTHD = self.project_q(x_BTM)
      k_BSKD, v_BSKD = context_kv if context_kv is not None else self.project_kv(context_BSM)
    else:
      q_BTHD = self.project_q(x_BTM, positions_BT)
      k_BSKD, v_BSKD = self.project_kv(x_BTM, positions_BT)
      window = self.window
    options = dataclasses.replace(self.options, causal=causal, segment_ids=segment_ids,
                                  mask=mask, window=window, bias=bias)
    out_BTHD = attention(q_BTHD, k_BSKD, v_BSKD, options, implementation=self.implementation,
                         pallas_lowering=self.pallas_lowering)
    return self.project_out(out_BTHD, x_BTM)

  def weights(self, x_BTM, *, positions_BT, causal, bias=None):
    """Self-attention weights [B, h, T, T] (for plots)."""
    q_BTHD = self.project_q(x_BTM, positions_BT)
    k_BSKD, _ = self.project_kv(x_BTM, positions_BT)
    options = dataclasses.replace(self.options, causal=causal, window=self.window, bias=bias)
    w_BKGTS = attention_weights(q_BTHD, k_BSKD, options)
    B, K, G, T, S = w_BKGTS.shape
    return w_BKGTS.reshape(B, K * G, T, S)

  def decode(self, x_BTM, positions_BT, cache, bias=None, layer=None):
    """Self-attention against a KV cache (generation).

    `cache` holds k, v [B, g, L, d_k], or with `layer` every layer's
    [layers, B, g, L, d_k] (a scanned stack's cache, updated in place at
    `layer`: no per-layer copy of it in the token loop); the new keys and
    values of the tokens at `positions_BT` are written at those slots, and
    query t of row b sees slots 0..positions_BT[b, t] (the last `window` of
    them with a sliding window). Rows may sit at different positions, so a
    batch of prompts of different lengths decodes exactly like each prompt
    alone. The cache is heads-first, the layout the score and value
    products read, so no step copies it (sequence-first, XLA transposed
    every layer's k and v, the whole cache, at every step); the step runs
    the reference einsums on that layout whatever `attention_impl` (a
    single decoding query is memory-bound and gains nothing from a fused
    kernel, and the slot mask is dense). The layer's options (scale,
    soft-cap, score) are the training call's: the one `AttentionOptions`
    value serves both. `bias` [1 or B, H, T, L] is added to the scores over
    the cache slots. Returns (output, updated cache).
    """
    q_BTHD = self.project_q(x_BTM, positions_BT)
    k_BTKD, v_BTKD = self.project_kv(x_BTM, positions_BT)
    cache = dict(cache, k=write_slots(cache["k"], k_BTKD, positions_BT, layer),
                 v=write_slots(cache["v"], v_BTKD, positions_BT, layer))
    k_BKLD, v_BKLD = ((cache["k"], cache["v"]) if layer is None
                      else (cache["k"][layer], cache["v"][layer]))
    mask_BTL = cache_slot_mask(positions_BT, k_BKLD.shape[2], self.window)
    options = dataclasses.replace(self.options, mask=mask_BTL, bias=bias)
    out_BTHD = cache_attention(q_BTHD, k_BKLD.astype(q_BTHD.dtype), v_BKLD.astype(q_BTHD.dtype),
                               options)
    return self.project_out(out_BTHD, x_BTM), cache


# Up to this many decoding queries, `cache_attention` on a CPU runs them one at a time.
CACHE_QUERIES_ONE_BY_ONE = 3


def cache_attention(q_BTHD, k_BKLD, v_BKLD, options: AttentionOptions):
  """`reference_attention` of T decoding queries against a heads-first
  cache (`options` holding the slot mask [B, T, L] and the bias [1 or B, H,
  T, L]). On one CPU device (`token_matrix_products`), 2 to
  CACHE_QUERIES_ONE_BY_ONE queries (a speculative pass verifying drafts)
  run one at a time, each as a greedy step's query: XLA's CPU backend hands
  the score and value products of two queries or more to a library kernel
  that costs about ten times a one-query product at decoding's sizes
  (docs/evaluation.md, "Where a drafted pass loses")."""
  T = q_BTHD.shape[1]
  if not (token_matrix_products() and 1 < T <= CACHE_QUERIES_ONE_BY_ONE):
    return reference_attention(q_BTHD, k_BKLD, v_BKLD, options, heads_first=True)

  def query(t):
    row = dataclasses.replace(options, mask=options.mask[:, t:t + 1],
                              bias=None if options.bias is None else options.bias[:, :, t:t + 1])
    return reference_attention(q_BTHD[:, t:t + 1], k_BKLD, v_BKLD, row, heads_first=True)

  return jnp.concatenate([query(t) for t in range(T)], axis=1)


def write_slots(cache_BKLD, new_BTKD, positions_BT, layer=None):
  """A heads-first cache array [B, K, L, D] (with `layer`: [layers, B, K,
  L, D], written at that layer) with each row's new entries [B, T, K, D]
  at its slots `positions_BT`."""
  rows_B1 = jnp.arange(new_BTKD.shape[0])[:, None]
  slot = (rows_B1, slice(None), positions_BT)
  slot = slot if layer is None else (layer, *slot)
  return cache_BKLD.at[slot].set(new_BTKD.astype(cache_BKLD.dtype))


def cache_slot_mask(positions_BT, length: int, window: int | None):
  """The decoding mask [B, T, L] over `length` cache slots: query t of row b
  sees slots 0..positions_BT[b, t], the last `window` of them with a
  sliding window."""
  slots_L = jnp.arange(length)
  mask_BTL = slots_L[None, None, :] <= positions_BT[:, :, None]
  if window is not None:
    mask_BTL = mask_BTL & (slots_L[None, None, :] > positions_BT[:, :, None] - window)
  return mask_BTL


def mha_params(m) -> int:
  """One `Attention`'s parameters: W_Q [d, h, d_k] and W_O [h, d_k, d]; W_K,
  W_V [d, g, d_k]; the biases of q, k, v (qkv_bias) and of o (out_bias); the
  two RMSNorm scales [d_k] of qk_norm; with attention_output_gate, W_G [d, h,
  d_k] and its bias (qkv_bias)."""
  d, h, g, dk = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  biases = (h * dk + 2 * g * dk if m.qkv_bias else 0) + (d if m.out_bias else 0)
  gate = (d * h * dk + (h * dk if m.qkv_bias else 0)) if m.attention_output_gate else 0
  return 2 * d * h * dk + 2 * d * g * dk + biases + (2 * dk if m.qk_norm else 0) + gate


def mha_rotary_dim(m) -> int:
  """The width RoPE rotates in each query and key head: head_dim x
  partial_rotary_factor (validated to be a whole even number)."""
  return round(m.head_dim * m.partial_rotary_factor)


def mha_activation_elements(m) -> int:
  """Elements per token one `Attention` keeps for its backward pass, the
  scores aside (`model.accounting.activation_bytes_per_token`): d (input of
  W_Q, W_K, W_V) + 2 h d_k (Q; input of W_O) + 2 g d_k (K, V) + h d_k + g
  d_k (the inputs of the qk_norm RMSNorms)."""
  d, h, g, dk = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  return d + 2 * h * dk + 2 * g * dk + (h * dk + g * dk if m.qk_norm else 0)
