"""The Mosaic TPU FlashAttention kernel (`model/kernels/flash_attention_tpu.py`).

Its numbers are checked in the Pallas interpreter on CPU against
`implementation="reference"`, forward and the three gradients, with the
tolerances of `tests/test_flash_attention.py` (max |kernel - oracle| /
max(max |oracle|, 1): 1e-5 for float32, 3e-2 for bfloat16; over 12 random
cases of `test_matches_reference_random`'s space, 3 float32 and 9 bfloat16,
the worst was 9.0e-7 and 4.9e-3).
Its Mosaic lowering is checked by compiling it for TPU v5e and v5p with
libtpu's compiler through abstract devices (`jax.experimental.topologies`),
no TPU attached: a compile error fails the test.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bench import compile_tpu
from model.attention import attention
from model.kernels import flash_attention_tpu as tpu
from model.kernels.router import choose_lowering, flash_attention
from tests.helpers import (assert_kernel_close, kernel_and_oracle, kernel_inputs,
                           random_segments)

# Several processes on one host may load libtpu for compiling only.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _check(seed, B, T, S, H, K, D, *, causal, segment_mode, dtype, block_q=16,
           block_k=16, D_v=None):
  q, k, v, do = kernel_inputs(seed, B, T, S, H, K, D, dtype, D_v)
  q_seg = kv_seg = None
  if segment_mode is not None:
    rng = np.random.RandomState(seed)
    q_seg = random_segments(rng, B, T, segment_mode)
    kv_seg = random_segments(rng, B, S, segment_mode)
  got, want = kernel_and_oracle(q, k, v, do, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                                lowering="mosaic_tpu", block_q=block_q, block_k=block_k)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == dtype
    assert_kernel_close(a, b, dtype, name)


def test_matches_reference_gqa_causal_packed():
  """GQA (2 query heads per KV head), causal, packed segments with padding
  (query rows that see nothing), lengths not a multiple of the tile, several
  tiles each way: the plan skips tiles, runs some whole and some masked."""
  _check(0, 2, 40, 50, 4, 2, 16, causal=True, segment_mode="packed", dtype=jnp.float32)


def test_values_narrower_than_keys_match_reference():
  """Multi-head latent attention's shapes (queries and keys 48 wide, values
  32: DeepSeek-V3's 192 and 128 scaled down), causal with packed segments:
  the output is 32 wide, and dq, dk, dv keep their widths."""
  _check(1, 2, 40, 40, 2, 2, 48, causal=True, segment_mode="packed", dtype=jnp.float32,
         D_v=32)


def test_values_stay_narrow_in_the_tpu_kernel():
  """Values 64 wide against keys 192 wide (after padding to whole lanes)
  reach the forward kernel at 64, not padded to the keys' 192: the output of
  its pallas_call is [B, H, T, 64] (the other lowerings pad)."""
  q, k, v, _ = kernel_inputs(0, 1, 16, 16, 2, 2, 192, jnp.float32, 64)
  jaxpr = str(jax.make_jaxpr(functools.partial(flash_attention, lowering="mosaic_tpu"))(q, k, v))
  assert "f32[1,2,16,64]" in jaxpr and "f32[1,2,16,192]" in jaxpr


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 8 interpreted compiles of three kernels, up to 2 min each when loaded
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 2),
    K=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    T=st.integers(1, 48),
    S=st.integers(1, 48),
    D=st.sampled_from([8, 64]),
    causal=st.booleans(),
    segment_mode=st.sampled_from([None, "packed", "random"]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    block_q=st.sampled_from([16, 32]),
    block_k=st.sampled_from([16, 32]),
)
def test_matches_reference_random(seed, B, K, group, T, S, D, causal, segment_mode, dtype,
                                  block_q, block_k):
  """Forward, dq, dk, dv: MHA, GQA, MQA; T != S and odd lengths; causal;
  packed and random segments (rows that see nothing); float32 and bfloat16."""
  _check(seed, B, T, S, K * group, K, D, causal=causal, segment_mode=segment_mode,
         dtype=dtype, block_q=block_q, block_k=block_k)


def test_attention_dispatches_to_tpu_kernel():
  """implementation="pallas", pallas_lowering="mosaic_tpu" runs this kernel
  (interpreted on CPU), and a TPU chooses it by default."""
  q, k, v, _ = kernel_inputs(0, 1, 8, 8, 2, 1, 16, jnp.float32)
  jaxpr = str(jax.make_jaxpr(functools.partial(
      attention, causal=True, implementation="pallas", pallas_lowering="mosaic_tpu"))(q, k, v))
  assert "flash_attention_tpu_forward" in jaxpr
  assert choose_lowering(q, k, backend="tpu", device_kind="TPU v5 lite") == "mosaic_tpu"
  assert choose_lowering(q, k, backend="cpu", device_kind="cpu") == "triton"
  with pytest.raises(ValueError, match="block_k a multiple of 128"):
    flash_attention(q, k, v, lowering="mosaic_tpu", interpret=False, block_k=64)


def test_tiles_per_generation():
  """Each generation gets its tiles; a larger head dim gets smaller ones
  within the VMEM budget; a short sequence gets one small tile."""
  kinds = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
  for generation, kind in kinds.items():
    assert tpu.tpu_generation(kind) == generation
    for D in (64, 128, 256):
      blocks = tpu.choose_tpu_blocks(8192, 8192, D, 2, device_kind=kind)
      assert blocks.block_k % 128 == 0 and blocks.block_q % 16 == 0
      assert tpu.vmem_bytes(blocks.block_q, blocks.block_k, D, 2) <= blocks.vmem_limit_bytes // 2
  wide = tpu.choose_tpu_blocks(8192, 8192, 64, 2, device_kind="TPU v6 lite")
  narrow = tpu.choose_tpu_blocks(8192, 8192, 256, 2, device_kind="TPU v6 lite")
  assert narrow.block_q * narrow.block_k < wide.block_q * wide.block_k
  short = tpu.choose_tpu_blocks(1, 100, 128, 2, device_kind="TPU v5 lite")
  assert (short.block_q, short.block_k) == (16, 128)


@functools.lru_cache(maxsize=None)
def _tpu_device(topology: str):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


def compile_variant(device, *, D: int, causal: bool, segments: bool, group: int,
                    B: int = 2, T: int = 1024, K: int = 2, dtype=jnp.bfloat16,
                    softcap: float | None = None):
  """Compiles forward + backward for `device` (a TPU from
  `jax.experimental.topologies`): the compiled step."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

  def step(q, k, v, do, q_seg, kv_seg):
    def f(q, k, v):
      return flash_attention(q, k, v, causal=causal, device=device, lowering="mosaic_tpu",
                             softcap=softcap, q_segment_ids=q_seg if segments else None,
                             kv_segment_ids=kv_seg if segments else None)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))

  H = K * group
  return jax.jit(step).lower(
      spec((B, T, H, D), dtype), spec((B, T, K, D), dtype), spec((B, T, K, D), dtype),
      spec((B, T, H, D), dtype), spec((B, T), jnp.int32), spec((B, T), jnp.int32)).compile()


@pytest.mark.tpu
def test_compiles_for_v5e():
  """One variant through Mosaic and XLA for a v5e: head_dim 128, causal,
  segment ids, GQA; the program holds our three kernels, each within the
  scoped VMEM it was given."""
  compiled = compile_variant(_tpu_device("v5e:2x2"), D=128, causal=True, segments=True,
                             group=4)
  vmem = compile_tpu.kernel_vmem(compiled.as_text())
  assert set(vmem) == set(compile_tpu.KERNELS)
  limit = tpu.choose_tpu_blocks(1024, 1024, 128, 2, device_kind="TPU v5 lite").vmem_limit_bytes
  assert all(0 < used <= limit for used in vmem.values()), vmem


@pytest.mark.slow
@pytest.mark.tpu
def test_softcap_compiles_for_v5e():
  """The soft-cap's tanh tile, forward and backward, through Mosaic for a v5e."""
  compile_variant(_tpu_device("v5e:2x2"), D=128, causal=True, segments=True, group=4,
                  softcap=50.0)


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments,group", [(False, 1), (True, 4)])
def test_every_variant_compiles(topology, D, causal, segments, group):
  """Every variant (head dims 64/128/256, causal or not, plain MHA or segment
  ids with GQA) compiles for v5e and v5p."""
  compile_variant(_tpu_device(topology), D=D, causal=causal, segments=segments, group=group)
