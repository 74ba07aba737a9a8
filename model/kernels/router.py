"""Which FlashAttention kernel runs, and its one entry point.

`flash_attention` checks the inputs, picks the lowering for the device
(`choose_lowering`: Mosaic TPU on a TPU, Mosaic GPU on Hopper for what it
takes, the portable Triton kernels otherwise and in the interpreter) and the
kernel's tiles, and calls it. The three kernels compute the same function
with the same masks (`common.py`).
"""
import dataclasses
import functools

import jax

from model.kernels import common
from model.kernels import flash_attention_hopper as hopper
from model.kernels import flash_attention_tpu as tpu
from model.kernels import flash_attention_triton as triton
from model.kernels import is_hopper


LOWERINGS = ("triton", "mosaic_gpu", "mosaic_tpu")
# The lowerings whose kernels take values of another width than the keys as
# they are (the others get them zero-padded to one width).
NATIVE_VALUE_WIDTH = ("mosaic_tpu",)


def choose_lowering(q_BTHD, k_BSKD, *, backend: str, device_kind: str,
                    block_q: int | None = None) -> str:
  """Which kernel runs: "mosaic_tpu" (`flash_attention_tpu.py`) on a TPU;
  "mosaic_gpu" (`flash_attention_hopper.py`: wgmma, TMA, warp
  specialisation) on a Hopper GPU for the inputs it takes, unless the call
  sets a query tile (`block_q`), which its fixed 64 rows per warpgroup
  cannot honour; else "triton" (`flash_attention_triton.py`: every GPU,
  every mask; the one the interpreter runs on CPU)."""
  if backend == "tpu":
    return "mosaic_tpu"
  if (backend == "gpu" and is_hopper(device_kind) and block_q is None
      and hopper.supports(q_BTHD, k_BSKD) is None):
    return "mosaic_gpu"
  return "triton"


@functools.partial(jax.jit, static_argnames=(
    "causal", "scale", "softcap", "window", "block_q", "block_k", "interpret", "lowering",
    "device"))
def flash_attention(q_BTHD, k_BSKD, v_BSKD, *, causal: bool = False,
                    q_segment_ids=None, kv_segment_ids=None,
                    scale: float | None = None, softcap: float | None = None,
                    window: int | None = None,
                    block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None,
                    lowering: str | None = None, device=None):
  """Exact attention by tiles with the online softmax (FlashAttention).

  Args:
    q_BTHD: queries [B, T, H, D].
    k_BSKD, v_BSKD: keys [B, S, K, D] and values [B, S, K, D_v], H % K == 0;
      values of another width (multi-head latent attention: D_v 128, D 192)
      run at their width in the Mosaic TPU kernel (`NATIVE_VALUE_WIDTH`),
      zero-padded to the wider of D and D_v in the others
      (`common.common_head_width`), their output cut back to D_v.
    causal: query i sees key j only if j <= i (top-left aligned when T != S).
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S], both or neither;
      query i sees key j only if the ids are equal and the key's is not 0.
    scale: score multiplier, default 1 / sqrt(D).
    softcap: c of Gemma-2's soft-cap c tanh(s / c) on the scaled scores
      (every kernel); None: none.
    window: with `causal`, Mistral's sliding window: query i sees keys
      i - window < j <= i (every kernel; the tiles wholly outside it are
      neither fetched nor computed, by the block-sparse plan); None: none.
    block_q, block_k: query and key tile (powers of two >= 16) of every
      kernel, forward and backward; default `choose_block_sizes`.
    interpret: run the Pallas interpreter; default: when `device` is not the
      lowering's platform (a GPU; a TPU for "mosaic_tpu", whose interpreter
      is Pallas's TPU interpret mode).
    lowering: "triton" (the portable kernels of `flash_attention_triton.py`), "mosaic_gpu"
      (the Hopper kernels: 16-bit, head_dim 64 or 128; only
      block_k applies, query tiles are 64 rows per warpgroup) or
      "mosaic_tpu" (the TPU kernels; block_q a multiple of 16 and block_k
      of 128 when compiled); default `choose_lowering` (Triton on a Hopper
      GPU when block_q is set).
    device: the device tiles and lowering are chosen for (its `platform` and
      `device_kind`); default `jax.devices()[0]`. A compile-only device
      (`jax.experimental.topologies`) compiles ahead of time for a GPU this
      host lacks (`bench/compile_h200.py`); the model passes its mesh's
      abstract device (`model.attention.compile_device`). Called on one
      device's shard: on a mesh the model runs it under `shard_map`
      (`model.attention.sharded_kernel`).

  Returns:
    [B, T, H, D_v] in q's dtype; rows with no visible key are zeros.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("flash_attention: give both q_segment_ids and "
                     "kv_segment_ids, or neither")
  if v_BSKD.shape[:3] != k_BSKD.shape[:3]:
    raise ValueError(f"flash_attention: k {k_BSKD.shape}, v {v_BSKD.shape}: want k "
                     "[B, S, K, D] and v [B, S, K, D_v] with the same B, S and K")
  D_v = v_BSKD.shape[-1]
  scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
  padded = common.common_head_width(q_BTHD, k_BSKD, v_BSKD)
  lowering, options = _configure(*padded, causal=causal, scale=scale,
                                 softcap=softcap, window=window, block_q=block_q,
                                 block_k=block_k, interpret=interpret, lowering=lowering,
                                 device=device)
  operands = (q_BTHD, k_BSKD, v_BSKD) if lowering in NATIVE_VALUE_WIDTH else padded
  out_BTHD = _WHOLE[lowering](*operands, q_segment_ids=q_segment_ids,
                              kv_segment_ids=kv_segment_ids, **options)
  return out_BTHD[..., :D_v]


def flash_attention_parts(q_BTHD, k_BSKD, *, segments: bool = False, **options):
  """The kernel `flash_attention` would run for inputs shaped like q and k
  (arrays or `jax.ShapeDtypeStruct`s), as its forward with the log-sum-exp
  and its backward from a given (out, lse) (`common.Parts`): the blocks of
  the context-parallel ring (`model/context_parallel.py`), which merges
  partial results and differentiates them itself. `segments`: whether the
  calls pass segment ids; `options` (causal, scale, softcap, window,
  block_q, block_k, interpret, lowering, device) as `flash_attention`'s."""
  lowering, options = _configure(q_BTHD, k_BSKD, k_BSKD, **options)
  return _PARTS[lowering](q_BTHD, k_BSKD, segments=segments, **options)


def _configure(q_BTHD, k_BSKD, v_BSKD, *, causal: bool = False, scale: float | None = None,
               softcap: float | None = None, window: int | None = None,
               block_q: int | None = None,
               block_k: int | None = None, interpret: bool | None = None,
               lowering: str | None = None, device=None):
  """Checks the call and chooses its kernel: (lowering, that kernel's options
  but the segment ids)."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  if k_BSKD.shape != (B, S, K, D) or v_BSKD.shape != k_BSKD.shape:
    raise ValueError(f"flash_attention: q {q_BTHD.shape}, k {k_BSKD.shape}, "
                     f"v {v_BSKD.shape}: want q [B, T, H, D] and k, v "
                     "[B, S, K, D] with the same B and D")
  if H % K:
    raise ValueError(f"flash_attention: {H} query heads is not a multiple of "
                     f"{K} KV heads")
  if window is not None and (not causal or window < 1):
    raise ValueError(f"flash_attention: window={window} must be >= 1 and come with "
                     "causal=True")
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if block is not None and (block < triton.MIN_BLOCK or block & (block - 1)):
      raise ValueError(f"flash_attention: {name}={block} must be a power of "
                       f"two >= {triton.MIN_BLOCK}")
  device = device or jax.devices()[0]
  scale = D ** -0.5 if scale is None else float(scale)
  if lowering is None:
    lowering = choose_lowering(q_BTHD, k_BSKD, backend=device.platform,
                               device_kind=device.device_kind, block_q=block_q)
  if interpret is None:
    interpret = device.platform != ("tpu" if lowering == "mosaic_tpu" else "gpu")
  softcap = None if softcap is None else float(softcap)
  if lowering == "mosaic_tpu":
    if not interpret and block_k is not None and block_k % tpu.LANES:
      raise ValueError(f"flash_attention: lowering='mosaic_tpu' on a TPU takes block_k "
                       f"a multiple of {tpu.LANES} (the lane width), not {block_k}")
    blocks = tpu.choose_tpu_blocks(T, S, D, q_BTHD.dtype.itemsize,
                                   device_kind=device.device_kind)
    blocks = dataclasses.replace(
        blocks, **({} if block_q is None else dict(block_q=block_q, block_q_dkv=block_q)),
        **({} if block_k is None else dict(block_k=block_k, block_k_dkv=block_k)))
    return lowering, dict(causal=causal, scale=scale, blocks=blocks, interpret=interpret,
                          softcap=softcap, window=window)
  if lowering == "mosaic_gpu":
    reason = hopper.supports(q_BTHD, k_BSKD)
    if reason is not None:
      raise ValueError(f"flash_attention: lowering='mosaic_gpu' does not take "
                       f"{reason}; use lowering='triton'")
    if block_q is not None:
      raise ValueError("flash_attention: lowering='mosaic_gpu' has query tiles "
                       f"of {hopper.ROWS} rows per warpgroup; drop block_q={block_q}")
    if block_k is not None and block_k not in (64, 128, 256):
      raise ValueError(f"flash_attention: lowering='mosaic_gpu' takes block_k "
                       f"64, 128 or 256, not {block_k}")
    blocks = hopper.choose_hopper_blocks(D, S, interpret=interpret)
    if block_k is not None:
      blocks = dataclasses.replace(blocks, block_k=block_k)
    return lowering, dict(causal=causal, scale=scale, blocks=blocks, interpret=interpret,
                          softcap=softcap, window=window)
  if lowering != "triton":
    raise ValueError(f"flash_attention: lowering={lowering!r}; choose one of "
                     f"{LOWERINGS}")
  return lowering, dict(causal=causal, scale=scale, block_q=block_q, block_k=block_k,
                        interpret=interpret, device=device, softcap=softcap, window=window)


# Each lowering's differentiable whole and its `common.Parts`, on the options
# `_configure` chose.
_WHOLE = {"mosaic_tpu": tpu.tpu_flash_attention, "mosaic_gpu": hopper.hopper_flash_attention,
          "triton": triton.triton_flash_attention}
_PARTS = {"mosaic_tpu": tpu.tpu_parts, "mosaic_gpu": hopper.hopper_parts,
          "triton": lambda q, k, segments, **options: triton.triton_parts(q, k, **options)}
