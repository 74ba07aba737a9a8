"""The Hopper (Mosaic GPU) FlashAttention kernels against the reference.

On CPU the kernels run in the Mosaic GPU interpreter (warpgroups, shared
memory, TMA copies and barriers simulated; wgmma replaced by a dot, see
`flash_attention_hopper._Ops`), forward and all three gradients, and their
Mosaic GPU lowering for CUDA is built (not compiled). On a Hopper GPU the
same cases run the compiled kernels.

In the interpreter these take 30 to 110 s each on 2 CPU cores, so
`make test` runs two of the cases (head_dim 128 unmasked, and the fused
backward, causal, MQA) and `make test-slow` the rest.

Tolerance, as max |kernel - oracle| / max(max |oracle|, 1) against the float32
reference on the same rounded inputs: 1e-2 for float16, 3e-2 for bfloat16
(P and dS are fed to the matmuls in the input dtype, as FlashAttention does).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import attention
from model.kernels import flash_attention_hopper as hopper
from model.kernels import hopper_pipeline
from model.kernels.router import choose_lowering, flash_attention
from tests.segments import DOCUMENTS_KV, DOCUMENTS_Q, documents
from tests.helpers import kernel_inputs

TOLERANCE = {jnp.float16: 1e-2, jnp.bfloat16: 3e-2}


def _segments(B, L, seed):
  """Packed segment ids [B, L]: ascending ids 1..3, trailing 0 padding."""
  rng = np.random.RandomState(seed)
  ids = np.sort(rng.randint(1, 4, size=(B, L)), axis=1)
  ids[:, L - L // 5:] = 0
  return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("B,T,S,H,K,D,causal,segments,dtype,blocks", [
    # GQA, causal, packed segments with empty rows, lengths off the tile grid
    # (padded queries, masked keys); warpgroups taking turns; the dQ kernel
    # on key tiles of its own size.
    pytest.param(1, 130, 200, 2, 1, 64, True, True, jnp.float16,
                 hopper.HopperBlocks(128, 64, 2, pingpong=True, block_k_dq=64),
                 marks=pytest.mark.slow),
    # head_dim 128, four key tiles through a two-slot ring, two KV heads,
    # warpgroups not taking turns.
    (1, 128, 256, 2, 2, 128, False, False, jnp.bfloat16,
     hopper.HopperBlocks(64, 64, 2, pingpong=False)),
    # T > S causal: whole query tiles past the keys, unmasked and masked key
    # tiles, warpgroups that skip steps their neighbour needs, MQA over three
    # query heads.
    pytest.param(1, 256, 128, 3, 1, 64, True, False, jnp.bfloat16,
                 hopper.HopperBlocks(64, 64, 2), marks=pytest.mark.slow),
    # The fused backward (dQ added by the dK/dV kernel): GQA, causal, packed
    # segments with empty rows, ragged lengths, turns, head_dim 128 (two
    # 64-column dQ products per tile pair).
    pytest.param(1, 130, 200, 4, 2, 128, True, True, jnp.bfloat16,
                 hopper.HopperBlocks(64, 64, 2, pingpong=True, fused_dq=True),
                 marks=pytest.mark.slow),
    # The fused backward, causal without segment ids (every tile masked),
    # T > S, MQA over three query heads, no turns.
    (1, 256, 128, 3, 1, 64, True, False, jnp.float16,
     hopper.HopperBlocks(64, 64, 2, pingpong=False, fused_dq=True)),
    # Head_dim 128's defaults on the card: the forward's warpgroups take
    # turns, the fused backward's do not.
    pytest.param(1, 192, 256, 2, 1, 128, True, False, jnp.bfloat16,
                 hopper.HopperBlocks(128, 64, 2, pingpong=True, fused_dq=True,
                                     bwd_pingpong=False), marks=pytest.mark.slow),
    # One key tile, shorter than the ring: the pipelined forward's first
    # and last steps are its only ones.
    pytest.param(1, 64, 48, 2, 1, 64, True, False, jnp.bfloat16,
                 hopper.HopperBlocks(64, 64, 2, pingpong=True), marks=pytest.mark.slow),
])
def test_matches_reference(B, T, S, H, K, D, causal, segments, dtype, blocks):
  _check_against_reference(B, T, S, H, K, D, causal, segments, dtype, blocks, D ** -0.5)


@pytest.mark.slow
def test_scale_not_positive_matches_reference():
  """A scale <= 0 takes the other branch of `_base2` (scores scaled before
  the mask), in the forward and both backward kernels."""
  _check_against_reference(1, 130, 200, 2, 1, 64, True, True, jnp.float16,
                           hopper.HopperBlocks(128, 64, 2, pingpong=False), -0.2)


@pytest.mark.slow
@pytest.mark.parametrize("causal,blocks", [
    (True, hopper.HopperBlocks(64, 64, 2, pingpong=True)),
    (False, hopper.HopperBlocks(64, 64, 2, pingpong=False)),
])
def test_block_sparse_plan_matches_reference(causal, blocks):
  """Packed documents on tiles of 64: every kernel walks its listed plan
  (tiles skipped, unmasked, masked; a CTA that sees nothing), GQA."""
  _check_against_reference(1, 320, 320, 2, 1, 64, causal, "documents", jnp.float16,
                           blocks, 0.125)


def _check_against_reference(B, T, S, H, K, D, causal, segments, dtype, blocks, scale):
  q, k, v, do = kernel_inputs(0, B, T, S, H, K, D, dtype)
  if segments == "documents":
    q_seg, kv_seg = documents(T, DOCUMENTS_Q), documents(S, DOCUMENTS_KV)
  elif segments:
    # The first 5 queries get id 9, which no key has: rows that see nothing.
    q_seg, kv_seg = _segments(B, T, 0).at[:, :5].set(9), _segments(B, S, 1)
  else:
    q_seg = kv_seg = None
  interpret = jax.default_backend() != "gpu"

  def kernel(q, k, v):
    return hopper.hopper_flash_attention(
        q, k, v, causal=causal, scale=scale, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg, blocks=blocks, interpret=interpret)

  def oracle(q, k, v):
    return attention(q, k, v, causal=causal, implementation="reference", scale=scale,
                     segment_ids=None if q_seg is None else (q_seg, kv_seg))

  out, vjp = jax.vjp(kernel, q, k, v)
  got = (out, *vjp(do))
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want_out, want_vjp = jax.vjp(oracle, *f32[:3])
  want = (want_out, *want_vjp(f32[3]))
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == dtype and a.shape == b.shape, name
    a = np.asarray(a.astype(jnp.float32))
    assert np.isfinite(a).all(), f"{name}: not finite"
    err = np.abs(a - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1.0)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
  if segments:  # queries that see no key: exactly zero output and gradient
    empty = ~np.asarray(_sees_a_key(q_seg, kv_seg, causal))
    assert not np.asarray(got[0])[empty].any() and not np.asarray(got[1])[empty].any()


def _sees_a_key(q_seg, kv_seg, causal):
  """[B, T]: whether each query sees any key."""
  mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
  if causal:
    mask &= jnp.tril(jnp.ones(mask.shape[1:], bool))
  return mask.any(-1)


@pytest.mark.parametrize("D,causal,segments,fused", [
    (64, True, False, False), (128, False, True, False), (128, True, True, True)])
def test_mosaic_gpu_lowering_builds(D, causal, segments, fused):
  """Forward, dQ and dK/dV (or the fused dK/dV) lower through Pallas' Mosaic
  GPU backend for CUDA (to the Mosaic GPU dialect; ptxas runs only with the
  CUDA plugin: bench/compile_h200.py)."""
  q = jax.ShapeDtypeStruct((2, 512, 4, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, D), jnp.bfloat16)
  q_seg = jnp.ones((2, 512), jnp.int32) if segments else None
  kv_seg = jnp.ones((2, 384), jnp.int32) if segments else None

  blocks = dataclasses.replace(hopper.choose_hopper_blocks(D, 384), fused_dq=fused)

  def grads(q, k, v):
    def loss(q, k, v):
      out = hopper.hopper_flash_attention(
          q, k, v, causal=causal, scale=D ** -0.5, q_segment_ids=q_seg,
          kv_segment_ids=kv_seg, blocks=blocks, interpret=False)
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = jax.jit(grads).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == (2 if fused else 3)
  assert "flash_attention_hopper_forward" in text
  assert ("flash_attention_hopper_dq" in text) != fused


def test_choose_lowering():
  """Mosaic GPU on Hopper for what it takes; Triton for the rest."""
  bf16 = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
  h200 = dict(backend="gpu", device_kind="NVIDIA H200")
  assert choose_lowering(bf16, bf16, **h200) == "mosaic_gpu"
  assert choose_lowering(bf16, bf16, **h200, block_q=128) == "triton"
  f32 = bf16.astype(jnp.float32)
  assert choose_lowering(f32, f32, **h200) == "triton"
  d32 = jnp.zeros((1, 8, 2, 32), jnp.bfloat16)
  assert choose_lowering(d32, d32, **h200) == "triton"
  assert choose_lowering(bf16, bf16, backend="gpu",
                         device_kind="NVIDIA A100-SXM4-80GB") == "triton"
  assert choose_lowering(bf16, bf16, backend="cpu", device_kind="cpu") == "triton"


def test_hopper_blocks_follow_head_dim_and_length():
  """Head_dim 128 gets the backward the H200 ran fastest (fused, no turns)."""
  tuned = dict(fused_dq=True, bwd_pingpong=False)
  assert hopper.choose_hopper_blocks(64, 4096) == hopper.HopperBlocks(128, 64, 3)
  assert hopper.choose_hopper_blocks(128, 4096) == hopper.HopperBlocks(128, 64, 2, **tuned)
  assert hopper.choose_hopper_blocks(128, 40) == hopper.HopperBlocks(64, 64, 2, **tuned)
  assert hopper.choose_hopper_blocks(64, 200) == hopper.HopperBlocks(128, 64, 2)
  assert hopper.choose_hopper_blocks(64, 40) == hopper.HopperBlocks(64, 64, 2)
  interpreted = hopper.choose_hopper_blocks(128, 4096, interpret=True)
  assert not interpreted.pingpong and not interpreted.fused_dq


def test_backward_kernels_take_their_own_pingpong():
  blocks = hopper.HopperBlocks(128, 64, 2, pingpong=True, bwd_pingpong=False)
  assert blocks.for_backward() == hopper.HopperBlocks(128, 64, 2, pingpong=False)
  assert hopper.HopperBlocks(128, 64, 2).for_backward() == hopper.HopperBlocks(128, 64, 2)
  # The turn barriers are the backward kernels' own: none without turns.
  with_turns = hopper.shared_memory_bytes(128, jnp.bfloat16, hopper.HopperBlocks(128, 64, 2),
                                          False)
  without = hopper.shared_memory_bytes(128, jnp.bfloat16, blocks, False)
  assert without["forward"] == with_turns["forward"]
  assert without["dkdv"] < with_turns["dkdv"] and without["dq"] < with_turns["dq"]


@pytest.mark.parametrize("D", hopper.HEAD_DIMS)
@pytest.mark.parametrize("segments", [False, True])
def test_default_tiles_fit_in_shared_memory(D, segments):
  for kv_len in (40, 200, 4096, 32768):
    sizes = hopper.shared_memory_bytes(D, jnp.bfloat16,
                                       hopper.choose_hopper_blocks(D, kv_len), segments)
    assert set(sizes) == {"forward", "dq", "dkdv"}
    assert 0 < max(sizes.values()) <= hopper_pipeline.SHARED_MEMORY_BYTES


def test_tiles_over_shared_memory_are_refused():
  q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"needs 258.1 KiB of shared memory in the dq kernel"):
    hopper.hopper_flash_attention(q, q, q, causal=True, scale=1.0, interpret=True,
                                  blocks=hopper.HopperBlocks(128, 64, 3))
  # Mosaic GPU allocated 232,512 bytes for this forward (bench/compile_h200.py),
  # 64 over the limit: refused here, before compiling.
  with pytest.raises(ValueError, match=r"needs 227.1 KiB of shared memory in the forward kernel"):
    hopper.hopper_flash_attention(q, q, q, causal=True, scale=1.0, interpret=True,
                                  blocks=hopper.HopperBlocks(128, 64, 3, block_k_dq=64))


def test_shared_memory_count_matches_mosaic():
  """Mosaic GPU's own allocations, read off bench/compile_h200.py for an
  H200 (head_dim 128, bfloat16, no segment ids)."""
  sizes = hopper.shared_memory_bytes(128, jnp.bfloat16, hopper.HopperBlocks(
      128, 64, 2, block_k_dq=64), False)
  assert sizes == {"forward": 167008, "dq": 133184, "dkdv": 133184}
  fused = hopper.shared_memory_bytes(128, jnp.bfloat16, hopper.HopperBlocks(
      64, 64, 2, fused_dq=True), False)
  assert fused["dkdv"] == 215136


def test_mosaic_gpu_refuses_what_it_does_not_take():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="float32.*lowering='triton'"):
    flash_attention(q.astype(jnp.float32), q.astype(jnp.float32),
                    q.astype(jnp.float32), lowering="mosaic_gpu")
  with pytest.raises(ValueError, match="head_dim 32"):
    flash_attention(q[..., :32], q[..., :32], q[..., :32], lowering="mosaic_gpu")
  with pytest.raises(ValueError, match="block_q"):
    flash_attention(q, q, q, block_q=64, lowering="mosaic_gpu")
  with pytest.raises(ValueError, match="block_k"):
    flash_attention(q, q, q, block_k=32, lowering="mosaic_gpu")
  with pytest.raises(ValueError, match="lowering="):
    flash_attention(q, q, q, lowering="mosaic")


def _trace_gradients(blocks, segments: bool):
  """Traces the forward and backward kernels for CUDA (shapes only)."""
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  seg = jnp.ones((1, 128), jnp.int32) if segments else None

  def loss(q, k, v):
    return hopper.hopper_flash_attention(
        q, k, v, causal=True, scale=0.125, q_segment_ids=seg, kv_segment_ids=seg,
        blocks=blocks, interpret=False).astype(jnp.float32).sum()
  jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)


def _barrier(num_arrivals: int):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=2)


@pytest.mark.parametrize("scratch,field,wrong,fused,segments,match", [
    # A TMA barrier counting a copy that no code issues.
    ("_forward_scratch", "q_full", _barrier(2), False, False,
     "barrier of 2 arrivals is arrived on by 1 TMA copies"),
    # A ring's free barrier counting one compute warpgroup, not both.
    ("_dq_scratch", "kv_free", _barrier(1), False, False,
     "barrier of 1 arrivals is arrived on by 2 compute warpgroups"),
    ("_forward_scratch", "turn", _barrier(2), False, False,
     "barrier of 2 arrivals is arrived on by 1 the other compute warpgroup"),
    ("_dkdv_scratch", "ds_read", _barrier(2), True, False,
     "barrier of 2 arrivals is arrived on by 1 the multiplying warpgroup"),
    # Refs out of step with the layout: a ring slot of the wrong tile, a
    # segment-id buffer missing though segment ids are given.
    ("_dkdv_scratch", "q", None, False, False, "do not match"),
    ("_forward_scratch", "q_seg", None, False, True, "do not match"),
])
def test_scratch_out_of_step_with_kernel_raises_at_trace_time(
    monkeypatch, scratch, field, wrong, fused, segments, match):
  """Every barrier's arrival count comes from the scratch entries or
  warpgroups that arrive on it, and the kernels check each against the
  code that arrives, at trace time: a drift raises instead of deadlocking
  the GPU."""
  blocks = hopper.HopperBlocks(64, 64, 2, pingpong=True, fused_dq=fused)
  _trace_gradients(blocks, segments)  # the kernels' own layouts trace
  build = getattr(hopper, scratch)

  def broken(D, dtype, blocks, seg):
    layout = build(D, dtype, blocks, seg)
    if field == "q" and wrong is None:  # query tiles of 32 rows in a ring of 64
      return layout._replace(q=hopper_pipeline.swizzled_smem((blocks.stages, 32, D), dtype))
    return layout._replace(**{field: wrong})
  monkeypatch.setattr(hopper, scratch, broken)
  hopper._fused_backward.clear_cache()  # jitted: traced again (jax.clear_caches() would
  # drop every compiled program of this process, which the tests after this one recompile)
  with pytest.raises(ValueError, match=match):
    _trace_gradients(blocks, segments)
