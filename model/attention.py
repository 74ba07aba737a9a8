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
"""
import functools
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.errors import UserError
from model.embeddings import apply_rope
from model.kernels import MOSAIC_GPU_DTYPES, MOSAIC_GPU_HEAD_DIMS
from model.layers import Dense
from model.norms import RMSNorm

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "pallas", "auto")


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
  """The boolean [B or 1, T, S] mask that all the masks add up to, or None."""
  q_seg, kv_seg = _split_segment_ids(segment_ids)
  out = None
  if causal:
    out = jnp.tril(jnp.ones((T, S), bool))[None]
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


def attention_weights(q_BTHD, k_BSKD, *, causal=False, mask=None, segment_ids=None,
                      scale=None, window=None, bias=None, softcap=None):
  """softmax(softcap(Q K^T * scale) + bias + M) in float32, [B, K, G, T, S]
  (H = K * G heads).

  Fully masked rows are all zeros.
  """
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  scale = D ** -0.5 if scale is None else scale
  q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                      preferred_element_type=jnp.float32) * scale
  scores = soft_cap(scores, softcap)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32).reshape(bias.shape[0], K, H // K, T, S)
  valid = combined_mask(T, S, causal=causal, mask=mask, segment_ids=segment_ids, window=window)
  if valid is None:
    return jax.nn.softmax(scores, axis=-1)
  valid_B11TS = valid[:, None, None]
  scores = jnp.where(valid_B11TS, scores, jnp.finfo(jnp.float32).min)
  return jnp.where(valid_B11TS, jax.nn.softmax(scores, axis=-1), 0.0)


def reference_attention(q_BTHD, k_BSKD, v_BSKD, *, causal=False, mask=None,
                        segment_ids=None, scale=None, window=None, bias=None, softcap=None):
  """The lesson's math: weights from `attention_weights`, times V."""
  B, T, H, D = q_BTHD.shape
  weights = attention_weights(q_BTHD, k_BSKD, causal=causal, mask=mask,
                              segment_ids=segment_ids, scale=scale, window=window, bias=bias,
                              softcap=softcap)
  out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v_BSKD.dtype), v_BSKD,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, D).astype(q_BTHD.dtype)


def _jax_attention(q_BTHD, k_BSKD, v_BSKD, *, causal, mask, segment_ids, scale, window, bias,
                   softcap, implementation):
  """`jax.nn.dot_product_attention`, with fully masked rows set to zero.

  The window goes in as its `local_window_size` (window - 1 keys to the left;
  to the right too unless causal). The bias goes in in q's dtype (cuDNN
  takes no other). It takes no soft-cap: `xla` with one runs the reference
  einsums, `cudnn` refuses it.
  """
  if softcap is not None:
    if implementation == "cudnn":
      raise UserError("attention_impl=cudnn takes no soft-cap (model.attn_softcap); use "
                      "attention_impl xla, pallas or auto")
    return reference_attention(q_BTHD, k_BSKD, v_BSKD, causal=causal, mask=mask,
                               segment_ids=segment_ids, scale=scale, window=window, bias=bias,
                               softcap=softcap)
  T, S = q_BTHD.shape[1], k_BSKD.shape[1]
  valid = combined_mask(T, S, mask=mask, segment_ids=segment_ids)
  local = None if window is None else (window - 1, 0 if causal else window - 1)
  out = jax.nn.dot_product_attention(
      q_BTHD, k_BSKD, v_BSKD, mask=None if valid is None else valid[:, None],
      bias=None if bias is None else bias.astype(q_BTHD.dtype), scale=scale, is_causal=causal,
      local_window_size=local, implementation=implementation)
  if valid is None:
    return out
  causal_and_window = combined_mask(T, S, causal=causal, window=window)
  if causal_and_window is not None:
    valid = valid & causal_and_window
  row_valid_BT11 = valid.any(-1)[:, :, None, None]
  return jnp.where(row_valid_BT11, out, 0).astype(q_BTHD.dtype)


def compile_device():
  """The device the traced program is compiled for: the abstract mesh's device
  (set by the jitted steps, `training/steps.traced_on`, so compile.py's target
  chip), else `jax.devices()[0]`. It picks the kernel's lowering and tiles and
  what `auto` resolves to."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device
  return jax.devices()[0]


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


def sharded_kernel(kernel, q_BTHD, k_BSKD, v_BSKD, q_seg_BT=None, kv_seg_BS=None):
  """`kernel(q, k, v, q_seg, kv_seg)` under `jax.shard_map` over the abstract mesh.

  XLA cannot partition a Mosaic kernel (it refuses) nor a Triton one (it runs
  it on the whole batch on every device), so each device runs the kernel on
  its own rows and heads: the batch split over the batch axes (data, fsdp)
  with the segment ids of those rows, the heads over `tensor` as
  `kernel_head_split` says; the sequence stays whole per device. The
  kernel's custom VJP runs inside, on the same shards. Without a mesh (or on
  a mesh of one device) the kernel runs as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS)
  B, _, H, _ = q_BTHD.shape
  K = k_BSKD.shape[2]
  batch = tuple(axis for axis in ("data", "fsdp") if axis in mesh.axis_names)
  rows = math.prod(mesh.shape[axis] for axis in batch)
  if B % rows:
    raise UserError(f"attention_impl=pallas: {B} rows (per micro-batch) do not split over "
                    f"the {rows} devices of the batch axes {' x '.join(batch)}; make "
                    "train.batch_size / train.grad_accum_steps a multiple of it")
  tensor = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
  split = kernel_head_split(H, K, tensor)
  heads = None if split == "whole" else "tensor"
  q_spec = P(batch, None, heads, None)
  kv_spec = P(batch, None, "tensor" if split == "both" else None, None)
  seg_spec = P(batch, None)

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


def _pallas_attention(q_BTHD, k_BSKD, v_BSKD, *, causal, mask, segment_ids, scale, window,
                      bias, softcap, lowering):
  """Our kernels (`model/kernels/router.py`) for `compile_device()`, one per
  device of the mesh (`sharded_kernel`)."""
  if bias is not None:
    raise UserError("attention_impl=pallas: our kernels take no additive bias "
                    "(pos_emb=relative); use attention_impl xla, cudnn or auto")
  if mask is not None or window is not None:
    raise ValueError("implementation='pallas' takes causal and segment_ids masks, "
                     "not a dense mask or a window; use 'xla' or 'auto' for those")
  from model.kernels.router import flash_attention  # pylint: disable=import-outside-toplevel
  device = compile_device()

  def kernel(q, k, v, q_seg, kv_seg):
    return flash_attention(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                           scale=scale, softcap=softcap, lowering=None if lowering == "auto" else lowering,
                           device=device)

  return sharded_kernel(kernel, q_BTHD, k_BSKD, v_BSKD, *_split_segment_ids(segment_ids))


@functools.lru_cache(maxsize=None)
def _log_choice(message: str) -> None:
  logging.info(message)


def auto_implementation(*, backend: str, dtype, head_dim: int, has_dense_mask: bool,
                        has_softcap: bool = False, has_window: bool = False) -> str:
  """The `auto` rule.

  On a GPU: `cudnn` for 16-bit inputs with head_dim a multiple of 8 up to 128,
  no dense mask and no soft-cap (cuDNN's fused flash attention, the fastest
  measured in docs/benchmarks.md), otherwise `xla`.

  On a TPU: `pallas` (our Mosaic TPU kernel) where it takes the inputs (no
  dense mask or bias, no sliding window), otherwise `xla`. Memory decides
  this: the kernel keeps O(T) per row for the backward pass where XLA's
  attention keeps every layer's [heads, T, S] scores, so llama2_7b at 4,096
  tokens per chip on a v5p-64 fits without remat with it (41 GiB per chip)
  and not with XLA (108 GiB; docs/compiling.md). Its speed against XLA and
  JAX's splash attention is untimed until `bench/attention.py` runs on a TPU.

  On a CPU: `xla`.
  """
  if (backend == "gpu" and not has_dense_mask and not has_softcap
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  if backend == "tpu" and not has_dense_mask and not has_window:
    return "pallas"
  return "xla"


def choose_implementation(q_BTHD, *, has_dense_mask: bool, has_softcap: bool = False,
                          has_window: bool = False) -> str:
  """`auto_implementation` for these queries on the platform of `compile_device()`
  (logged once)."""
  D = q_BTHD.shape[-1]
  backend = compile_device().platform
  choice = auto_implementation(backend=backend, dtype=q_BTHD.dtype, head_dim=D,
                               has_dense_mask=has_dense_mask, has_softcap=has_softcap,
                               has_window=has_window)
  _log_choice(f"attention_impl=auto chose {choice} for head_dim={D}, "
              f"dtype={q_BTHD.dtype}, dense_mask={has_dense_mask}, softcap={has_softcap}, "
              f"window={has_window} on {backend}")
  return choice


def model_implementation(cfg, backend: str | None = None) -> str:
  """The implementation the model's training attention runs (causal and
  segment masks; T5's relative bias counts as a dense mask):
  `cfg.attention_impl`, with `auto` resolved for `backend` (default: JAX's
  default backend)."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  return auto_implementation(backend=backend or jax.default_backend(), dtype=cfg.dtype,
                             head_dim=cfg.head_dim, has_dense_mask=cfg.pos_emb == "relative",
                             has_softcap=cfg.attn_softcap is not None,
                             has_window=cfg.sliding_window is not None)


def check_kernel_support(cfg) -> None:
  """Raises `UserError` when `cfg.pallas_lowering` names a kernel that does not
  take the config's dtype or head dim (the kernel package declares what each
  takes; `flash_attention` checks the arrays again at trace time), or when
  `attention_impl=pallas` meets a sliding window (not in our kernels yet) or
  T5's relative position bias (our kernels take no additive bias), or when
  `attn_softcap` meets cudnn, which takes no soft-cap."""
  if cfg.attn_softcap is not None and cfg.attention_impl == "cudnn":
    raise UserError(f"config field model.attn_softcap={cfg.attn_softcap}: attention_impl=cudnn "
                    "takes no soft-cap; use attention_impl xla, pallas or auto")
  if cfg.attention_impl == "pallas" and cfg.sliding_window is not None:
    raise UserError(f"config field model.sliding_window={cfg.sliding_window}: our pallas "
                    "kernels take no sliding window yet; use attention_impl xla, cudnn or auto")
  if cfg.attention_impl == "pallas" and cfg.pos_emb == "relative":
    raise UserError("config field model.pos_emb='relative': our pallas kernels take no "
                    "additive bias; use attention_impl xla, cudnn or auto")
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


def attention(q_BTHD, k_BSKD, v_BSKD, *, causal: bool = False, mask=None,
              segment_ids=None, scale: float | None = None, window: int | None = None,
              bias=None, softcap: float | None = None, implementation: str = "reference",
              pallas_lowering: str = "auto"):
  """Scaled dot-product attention over H query heads and K <= H KV heads.

  q [B, T, H, D], k and v [B, S, K, D] with H % K == 0 (MHA, GQA, MQA);
  returns [B, T, H, D] in q's dtype. See the module docstring for the masks,
  the additive `bias` [1 or B, H, T, S] and the `softcap`.
  `pallas_lowering` (auto, triton, mosaic_gpu, mosaic_tpu) picks our kernel when
  implementation is pallas.
  """
  if implementation == "auto":
    # cuDNN takes a window only on top of the causal mask.
    # A bias counts as dense: `auto` leaves it to XLA.
    bidirectional_window = window is not None and not causal
    dense = mask is not None or bidirectional_window or bias is not None
    implementation = choose_implementation(q_BTHD, has_dense_mask=dense,
                                           has_softcap=softcap is not None,
                                           has_window=window is not None)
  kwargs = dict(causal=causal, mask=mask, segment_ids=segment_ids, scale=scale, window=window,
                bias=bias, softcap=softcap)
  if implementation == "reference":
    return reference_attention(q_BTHD, k_BSKD, v_BSKD, **kwargs)
  if implementation in ("xla", "cudnn"):
    return _jax_attention(q_BTHD, k_BSKD, v_BSKD, implementation=implementation, **kwargs)
  if implementation == "pallas":
    return _pallas_attention(q_BTHD, k_BSKD, v_BSKD, lowering=pallas_lowering, **kwargs)
  raise ValueError(f"attention implementation {implementation!r}: must be one of "
                   f"{', '.join(IMPLEMENTATIONS)}")


class Attention(nnx.Module):
  """Multi-head attention with h query heads and g KV heads (Step 4).

  Self-attention when `context` is None, cross-attention (queries from x,
  keys and values from the encoder output) otherwise. W_Q is [d, h, d_k],
  W_K and W_V are [d, g, d_k], W_O is [h, d_k, d]. With `qk_norm`, each
  head's queries and keys go through an RMSNorm over d_k (its own learned
  scale [d_k] for Q and for K, shared by the heads) before RoPE, as Qwen3,
  OLMo-2 and Gemma-3 do: the scores then grow with the scales, not with the
  activations.
  """

  def __init__(self, cfg, *, rope=None, window: int | None = None, rngs: nnx.Rngs):
    """`cfg`: the `model.config.ModelConfig`; `window`: the sliding window of
    this layer's self-attention (`cfg.layer_window(layer)`), None for none."""
    d, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, b_out = cfg.qkv_bias, cfg.out_bias
    self.rope = rope  # (inv_freq, attention_factor) or None
    self.scale = cfg.attention_scale
    self.softcap = cfg.attn_softcap
    self.window = window  # self-attention only
    self.implementation = cfg.attention_impl
    self.pallas_lowering = cfg.pallas_lowering
    self.q_proj = Dense(d, (H, Dh), ("embed", "heads", "head_dim"), use_bias=b, cfg=cfg, rngs=rngs)
    self.k_proj = Dense(d, (K, Dh), ("embed", "kv_heads", "head_dim"), use_bias=b, cfg=cfg,
                        rngs=rngs)
    self.v_proj = Dense(d, (K, Dh), ("embed", "kv_heads", "head_dim"), use_bias=b, cfg=cfg,
                        rngs=rngs)
    self.o_proj = Dense((H, Dh), (d,), ("heads", "head_dim", "embed"), use_bias=b_out, cfg=cfg,
                        rngs=rngs, in_axes=2)
    self.q_norm = RMSNorm(Dh, cfg=cfg, rngs=rngs) if cfg.qk_norm else None
    self.k_norm = RMSNorm(Dh, cfg=cfg, rngs=rngs) if cfg.qk_norm else None

  def _rotate(self, x_BTHD, positions_BT):
    if self.rope is None or positions_BT is None:
      return x_BTHD
    inv_freq, attention_factor = self.rope
    return apply_rope(x_BTHD, positions_BT, inv_freq, attention_factor)

  def project_q(self, x_BTM, positions_BT=None):
    """Q [B, T, h, d_k]: normalised with `qk_norm`, then rotated when RoPE is
    on and `positions_BT` are given (self-attention)."""
    q_BTHD = self.q_proj(x_BTM)
    if self.q_norm is not None:
      q_BTHD = self.q_norm(q_BTHD)
    return self._rotate(q_BTHD, positions_BT)

  def project_kv(self, context_BSM, positions_BS=None):
    """K and V [B, S, g, d_k] (K normalised with `qk_norm`, then rotated when
    RoPE is on and `positions_BS` are given)."""
    k_BSKD = self.k_proj(context_BSM)
    if self.k_norm is not None:
      k_BSKD = self.k_norm(k_BSKD)
    return self._rotate(k_BSKD, positions_BS), self.v_proj(context_BSM)

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
    out_BTHD = attention(q_BTHD, k_BSKD, v_BSKD, causal=causal, segment_ids=segment_ids,
                         mask=mask, scale=self.scale, window=window, bias=bias,
                         softcap=self.softcap, implementation=self.implementation,
                         pallas_lowering=self.pallas_lowering)
    return self.o_proj(out_BTHD)

  def weights(self, x_BTM, *, positions_BT, causal, bias=None):
    """Self-attention weights [B, h, T, T] (for plots)."""
    q_BTHD = self.project_q(x_BTM, positions_BT)
    k_BSKD, _ = self.project_kv(x_BTM, positions_BT)
    w_BKGTS = attention_weights(q_BTHD, k_BSKD, causal=causal, scale=self.scale,
                                window=self.window, bias=bias, softcap=self.softcap)
    B, K, G, T, S = w_BKGTS.shape
    return w_BKGTS.reshape(B, K * G, T, S)

  def decode(self, x_BTM, positions_BT, cache, bias=None):
    """Self-attention against a KV cache (generation).

    `cache` holds k, v [B, L, g, d_k]; the new keys and values of the tokens
    at `positions_BT` are written at those slots, and query t of row b sees
    slots 0..positions_BT[b, t] (the last `window` of them with a sliding
    window). Rows may sit at different positions, so a
    batch of prompts of different lengths decodes exactly like each prompt
    alone. The slot mask is dense, so `cudnn` and `pallas` (which take
    causal and segment masks only) run this step with `xla`; a single
    decoding query is memory-bound and gains nothing from a fused kernel.
    `bias` [1 or B, H, T, L] is added to the scores over the cache slots.
    Returns (output, updated cache).
    """
    q_BTHD = self.project_q(x_BTM, positions_BT)
    k_BTKD, v_BTKD = self.project_kv(x_BTM, positions_BT)
    rows_B1 = jnp.arange(x_BTM.shape[0])[:, None]
    cache = dict(k=cache["k"].at[rows_B1, positions_BT].set(k_BTKD.astype(cache["k"].dtype)),
                 v=cache["v"].at[rows_B1, positions_BT].set(v_BTKD.astype(cache["v"].dtype)))
    slots_L = jnp.arange(cache["k"].shape[1])
    mask_BTL = slots_L[None, None, :] <= positions_BT[:, :, None]
    if self.window is not None:
      mask_BTL = mask_BTL & (slots_L[None, None, :] > positions_BT[:, :, None] - self.window)
    impl = self.implementation if self.implementation in ("reference", "xla") else "xla"
    out_BTHD = attention(q_BTHD, cache["k"].astype(q_BTHD.dtype),
                         cache["v"].astype(q_BTHD.dtype), mask=mask_BTL, scale=self.scale,
                         bias=bias, softcap=self.softcap, implementation=impl)
    return self.o_proj(out_BTHD), cache
