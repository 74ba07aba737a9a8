"""Pallas FlashAttention kernels: `router.py` (which kernel runs; the one
entry point), one file per kernel (`flash_attention_triton.py`,
`flash_attention_hopper.py` over its pipeline machinery `hopper_pipeline.py`,
`flash_attention_tpu.py`), and what they share (`common.py`, the block-sparse
plans of `block_sparse.py`); and the chunked gated delta rule's kernel
(`gated_delta.py`, the linear_attention layers'); the LM head and its
cross-entropy in one kernel (`fused_loss.py`, train.loss_impl).

What each kernel takes, declared here so that the attention dispatcher
(`model/attention.py`) can check a config without importing the kernels.
"""
# The Mosaic GPU (Hopper) kernel, `flash_attention_hopper.py`: 16-bit inputs
# and these head dims. The portable Triton kernel and the Mosaic TPU kernel
# (`flash_attention_tpu.py`, head dim padded to a multiple of 64) take every
# dtype and head dim.
MOSAIC_GPU_DTYPES = ("bfloat16", "float16")
MOSAIC_GPU_HEAD_DIMS = (64, 128)

# The optional attention features (`model.attention.AttentionOptions.features`)
# every kernel takes, forward and backward, beside the causal and segment-id
# masks: the causal sliding window, the soft-cap, and the softmax score. No
# dense mask, additive bias or other score function: `attention_impl=pallas`
# refuses those by name. Each feature here is a promise that every kernel
# computes it: tests/test_declarations.py runs each, in every lowering,
# against the reference attention with that feature.
KERNEL_TAKES = frozenset({"window", "softcap", "score:softmax"})


def is_hopper(device_kind: str) -> bool:
  """Whether a GPU of this `device_kind` is a Hopper (sm_90), which the
  Mosaic GPU kernels (`flash_attention_hopper.py`) target."""
  return any(name in device_kind for name in ("H100", "H200", "H800", "GH200"))

# The chunked gated delta rule's kernel (`gated_delta.py`, Gated DeltaNet's
# linear_attention layers): chunk sizes it takes (model.linear_chunk_size).
# Powers of two, as Triton's blocks must be, from 16, the smallest side of
# its matrix products, to 128, whose C x C products still fit on chip.
LINEAR_KERNEL_CHUNKS = (16, 32, 64, 128)


# The lowerings of the kernels other than attention's (`gated_delta.py`, `fused_loss.py`).
TRITON_AND_TPU = ("triton", "mosaic_tpu")


def lowering_for(device, lowering: str | None, interpret: bool | None, *,
                 kernel: str) -> tuple[str, bool]:
  """(lowering, interpret) of a call of a kernel with the `TRITON_AND_TPU`
  lowerings (`kernel` names it in the error): by default "mosaic_tpu" on a
  TPU, else "triton"; the interpreter where `device` is not the lowering's
  platform."""
  lowering = lowering or ("mosaic_tpu" if device.platform == "tpu" else "triton")
  if lowering not in TRITON_AND_TPU:
    raise ValueError(f"{kernel}: lowering={lowering!r}; choose one of {TRITON_AND_TPU}")
  if interpret is None:
    interpret = device.platform != ("tpu" if lowering == "mosaic_tpu" else "gpu")
  return lowering, interpret


def fuses_loss(loss_impl: str, platform: str, *, head_fuses: bool, chunk_size: int) -> bool:
  """Whether train.loss_impl runs the fused head-and-loss kernel
  (`fused_loss.py`): `pallas` always; `auto` compiled for a GPU, for a head
  it takes (`head_fuses`: no soft-cap, no bias over the vocabulary) and
  without loss chunks (on a CPU it would run in the Pallas interpreter)."""
  return loss_impl == "pallas" or (loss_impl == "auto" and platform == "gpu" and head_fuses
                                   and not chunk_size)


def triton_takes_head_dims(*dims: int) -> bool:
  """Whether the delta-rule kernel's Triton lowering takes these head dims:
  it loads [C, d] blocks, and Triton takes only power-of-two sizes."""
  return all(d > 0 and d & (d - 1) == 0 for d in dims)
