"""The Pallas FlashAttention kernel against the lesson's reference attention.

Runs the kernel in the Pallas interpreter (CPU), forward and all three
gradients, and checks that its Triton lowering for a GPU builds.

Tolerances, as max |kernel - oracle| / max(max |oracle|, 1), where the oracle
is `model.attention.attention(..., implementation="reference")` run in
float32 on the same (already rounded) inputs:
- float32 inputs: 1e-5 (only summation order differs; the worst of 120
  random cases of `test_matches_reference`'s space was 1.4e-6); on a GPU
  TF32's (`tests.helpers.float32_tolerance`);
- bfloat16 inputs: 3e-2 (the kernel feeds bf16 P and dS tiles to the matmuls
  and returns bf16, as FlashAttention does; the worst of the same 120 cases
  was 8.2e-3).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import export

from model.attention import attention
from model.kernels.flash_attention_triton import BlockSizes, choose_block_sizes
from model.kernels.router import flash_attention
from tests.segments import DOCUMENTS_KV, DOCUMENTS_Q, documents
from tests.helpers import (assert_kernel_close, float32_tolerance, kernel_and_oracle,
                           kernel_inputs, random_segments)


# The space of `test_matches_reference` (each example compiles the kernel in
# the interpreter, seconds): make test draws 3 fresh examples a run, beside
# the fixed cases below; `test_matches_reference_more_examples` (slow) 20.
CASES = dict(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 2),
    K=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    T=st.integers(1, 64),
    S=st.integers(1, 64),
    D=st.sampled_from([8, 16, 64]),
    causal=st.booleans(),
    segment_mode=st.sampled_from([None, "packed", "random"]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    block_q=st.sampled_from([16, 32]),
    block_k=st.sampled_from([16, 32]),
)


@settings(max_examples=3, deadline=None)
@given(**CASES)
def test_matches_reference(seed, B, K, group, T, S, D, causal, segment_mode,
                           dtype, block_q, block_k):
  """Forward, dq, dk, dv against the oracle: MHA, GQA and MQA; T != S and
  lengths that are not a multiple of the tile; causal; packed and padded
  segments; float32 and bfloat16."""
  _check_matches_reference(seed, B, K, group, T, S, D, causal, segment_mode, dtype,
                           block_q, block_k)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(**CASES)
def test_matches_reference_more_examples(seed, B, K, group, T, S, D, causal, segment_mode,
                                         dtype, block_q, block_k):
  _check_matches_reference(seed, B, K, group, T, S, D, causal, segment_mode, dtype,
                           block_q, block_k)


def _check_matches_reference(seed, B, K, group, T, S, D, causal, segment_mode, dtype,
                             block_q, block_k):
  H = K * group
  q, k, v, do = kernel_inputs(seed, B, T, S, H, K, D, dtype)
  q_seg = kv_seg = None
  if segment_mode is not None:
    rng = np.random.RandomState(seed)
    q_seg = random_segments(rng, B, T, segment_mode)
    kv_seg = random_segments(rng, B, S, segment_mode)
  got, want = kernel_and_oracle(q, k, v, do, causal=causal, q_seg=q_seg,
                                kv_seg=kv_seg, block_q=block_q,
                                block_k=block_k)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == dtype
    assert_kernel_close(a, b, dtype, name)


@pytest.mark.parametrize("H,K,T,S,causal", [
    pytest.param(4, 4, 40, 40, True, marks=pytest.mark.slow),
    pytest.param(4, 2, 1, 33, False, marks=pytest.mark.slow), (4, 1, 1, 33, True),
    (4, 1, 50, 20, True), (4, 2, 20, 50, True)])
def test_gqa_decoding_and_cross_attention(H, K, T, S, causal):
  """MHA/GQA/MQA with several tiles; decoding (T = 1); T > S and T < S."""
  q, k, v, do = kernel_inputs(0, 2, T, S, H, K, 16, jnp.float32)
  got, want = kernel_and_oracle(q, k, v, do, causal=causal, q_seg=None,
                                kv_seg=None, block_q=16, block_k=16)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert_kernel_close(a, b, jnp.float32, name)


def test_default_blocks_head_dim_128():
  """The default tile choice, with head_dim 128, bfloat16 and causal."""
  q, k, v, do = kernel_inputs(1, 1, 100, 100, 2, 1, 128, jnp.bfloat16)
  got, want = kernel_and_oracle(q, k, v, do, causal=True, q_seg=None,
                                kv_seg=None)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert_kernel_close(a, b, jnp.bfloat16, name)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_plan_of_packed_documents(causal):
  """The documents of tests/segments.py at a quarter of the scale, on tiles
  of 16: tile pairs inside one document run unmasked, pairs of different
  documents are skipped, and a key tile of one document and padding is
  masked."""
  quarter = lambda spans: [(i, start // 4, end // 4) for i, start, end in spans]
  q, k, v, do = kernel_inputs(4, 1, 80, 80, 2, 1, 16, jnp.float32)
  got, want = kernel_and_oracle(
      q, k, v, do, causal=causal, q_seg=documents(80, quarter(DOCUMENTS_Q)),
      kv_seg=documents(80, quarter(DOCUMENTS_KV)), block_q=16, block_k=16)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert_kernel_close(a, b, jnp.float32, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_rows_are_zero(dtype):
  """Queries with segment id 0, or whose id no key has, output exactly 0 and
  get exactly 0 gradient; keys nobody sees get 0 dk, dv; nothing is NaN."""
  q, k, v, do = kernel_inputs(2, 1, 24, 40, 2, 1, 16, dtype)
  q_seg = jnp.asarray([[0] * 4 + [1] * 10 + [7] * 5 + [2] * 5], jnp.int32)
  kv_seg = jnp.asarray([[1] * 15 + [2] * 15 + [0] * 5 + [3] * 5], jnp.int32)
  (out, dq, dk, dv), want = kernel_and_oracle(
      q, k, v, do, causal=False, q_seg=q_seg, kv_seg=kv_seg, block_q=16,
      block_k=16)
  masked_q = np.asarray((q_seg == 0) | (q_seg == 7))[0]
  unseen_k = np.asarray((kv_seg == 0) | (kv_seg == 3))[0]
  assert (np.asarray(out[0, masked_q]) == 0).all()
  assert (np.asarray(dq[0, masked_q]) == 0).all()
  assert (np.asarray(dk[0, unseen_k]) == 0).all()
  assert (np.asarray(dv[0, unseen_k]) == 0).all()
  for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
    assert_kernel_close(a, b, dtype, name)


def test_jit_and_grad_of_scalar_loss():
  """The kernel under jax.jit of jax.grad of a scalar loss, twice (cached)."""
  q, k, v, _ = kernel_inputs(3, 2, 48, 48, 4, 2, 16, jnp.float32)
  seg = jnp.asarray([[1] * 30 + [2] * 18, [1] * 40 + [0] * 8], jnp.int32)

  def loss(fn, q, k, v):
    return jnp.mean(fn(q, k, v) ** 2)

  def kernel(q, k, v):
    return flash_attention(q, k, v, causal=True, q_segment_ids=seg,
                           kv_segment_ids=seg, block_q=16, block_k=16)

  def oracle(q, k, v):
    return attention(q, k, v, causal=True, segment_ids=seg,
                     implementation="reference")

  grad_fn = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a),
                                       argnums=(0, 1, 2)))
  value, grads = grad_fn(q, k, v)
  value, grads = grad_fn(q + 1.0, k, v)
  with jax.default_matmul_precision("highest"):
    want_value, want_grads = jax.value_and_grad(
        lambda *a: loss(oracle, *a), argnums=(0, 1, 2))(q + 1.0, k, v)
  np.testing.assert_allclose(value, want_value, rtol=float32_tolerance())
  for a, b in zip(grads, want_grads):
    assert_kernel_close(a, b, jnp.float32, "grad")


@pytest.mark.parametrize("D,D_v", [(24, 16), (16, 24)])
def test_values_of_another_width_match_reference(D, D_v):
  """Values narrower than queries and keys (multi-head latent attention) or
  wider, causal with packed segments, float32: output [.., D_v], and the
  three gradients at their own widths, as the reference's."""
  q, k, v, do = kernel_inputs(2, 2, 40, 40, 2, 2, D, jnp.float32, D_v)
  rng = np.random.RandomState(2)
  seg = random_segments(rng, 2, 40, "packed")
  got, want = kernel_and_oracle(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg,
                                block_q=16, block_k=16)
  for name, a, b, x in zip(("out", "dq", "dk", "dv"), got, want, (do, q, k, v)):
    assert a.shape == x.shape, name
    assert_kernel_close(a, b, jnp.float32, name)


def test_bad_arguments_raise():
  q, k, v, _ = kernel_inputs(0, 1, 16, 16, 3, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="multiple"):
    flash_attention(q, k, v)
  q, k, v, _ = kernel_inputs(0, 1, 16, 16, 2, 2, 16, jnp.float32)
  seg = jnp.ones((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="both"):
    flash_attention(q, k, v, q_segment_ids=seg)
  with pytest.raises(ValueError, match="power of two"):
    flash_attention(q, k, v, block_q=24)
  with pytest.raises(ValueError, match="same B, S and K"):
    flash_attention(q, k, v[:, :8])


def test_block_sizes_follow_device_and_shape():
  """Hopper tiles depend on head_dim; short sequences shrink the tiles."""
  d64 = choose_block_sizes(4096, 4096, 64, backend="gpu", device_kind="NVIDIA H200")
  d128 = choose_block_sizes(4096, 4096, 128, backend="gpu", device_kind="NVIDIA H200")
  assert (d64.block_q, d64.block_k, d64.num_warps) == (128, 128, 4)
  assert (d128.block_q, d128.block_k, d128.num_warps) == (128, 64, 8)
  ampere = choose_block_sizes(4096, 4096, 128, backend="gpu", device_kind="NVIDIA A100")
  assert ampere.num_stages < d64.num_stages
  decode = choose_block_sizes(1, 4096, 64, backend="gpu", device_kind="NVIDIA H200")
  assert decode.block_q == decode.block_q_dq == 16 and decode.block_k == 128
  for blocks in (d64, d128, ampere, decode, choose_block_sizes(5, 300, 8, backend="cpu")):
    assert isinstance(blocks, BlockSizes)
    for size in (blocks.block_q, blocks.block_k, blocks.block_q_dkv,
                 blocks.block_k_dkv, blocks.block_q_dq, blocks.block_k_dq):
      assert size >= 16 and size & (size - 1) == 0


@dataclasses.dataclass(frozen=True)
class _Device:
  """What `flash_attention(device=...)` reads of a device."""
  platform: str
  device_kind: str


def test_device_argument_picks_the_tiles():
  """`device` (a compile-only GPU, say) sets the tiles instead of this host:
  an H200 gets 8 warps at head_dim 128, the CPU 4."""
  q = jnp.ones((1, 512, 2, 128), jnp.float32)

  def launches(device):
    jaxpr = jax.make_jaxpr(lambda q: flash_attention(
        q, q, q, causal=True, device=device, interpret=True))(q)
    return set(re.findall(r"num_warps=\d+", str(jaxpr)))
  assert launches(_Device("gpu", "NVIDIA H200")) == {"num_warps=8"}
  assert launches(_Device("cpu", "cpu")) == {"num_warps=4"}
  here = jax.devices()[0]
  assert launches(None) == launches(_Device(here.platform, here.device_kind))


def test_a_query_tile_on_a_hopper_gpu_runs_the_triton_kernels():
  """block_q is a Triton tile (the Hopper kernels have 64 query rows per
  warpgroup): with no lowering named it picks Triton there, instead of the
  Hopper kernels refusing it (seen on an H200)."""
  q, k, v, _ = kernel_inputs(0, 1, 64, 64, 2, 2, 64, jnp.bfloat16)
  h200 = _Device("gpu", "NVIDIA H200")
  got = flash_attention(q, k, v, causal=True, block_q=32, device=h200, interpret=True)
  want = attention(q, k, v, causal=True, implementation="reference")
  assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() < 3e-2


@pytest.mark.parametrize("D,softcap", [(64, None), (128, None), (64, 50.0)])
def test_triton_lowering_builds(D, softcap):
  """Forward and backward lower through Pallas' Triton backend for an H200
  (lowering only, for an abstract device: nothing is compiled or run), also
  with the soft-cap's tanh tile."""
  q = jax.ShapeDtypeStruct((2, 256, 4, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, D), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)

  def loss(q, k, v, q_seg, kv_seg):
    out = flash_attention(q, k, v, causal=True, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, block_q=128, block_k=64,
                          interpret=False, softcap=softcap)
    return out.astype(jnp.float32).sum()

  h200 = jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(h200):
    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(q, kv, kv, seg, seg)
  text = exported.mlir_module()
  for kernel in ("flash_attention_forward", "flash_attention_dkdv",
                 "flash_attention_dq"):
    assert f'name = "{kernel}"' in text


def _train_losses(steps=3, T=32, **model_fields):
  """Losses of `steps` AdamW steps of a 2-layer decoder on one packed batch
  (two documents and padding in row 0, one document in row 1)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from configs import base  # pylint: disable=import-outside-toplevel
  from model import build_model  # pylint: disable=import-outside-toplevel
  from training.optim import learning_rate_schedule, make_optimizer  # pylint: disable=import-outside-toplevel
  from training.steps import init_state, jit_train_step  # pylint: disable=import-outside-toplevel
  cfg = base.get_config()
  cfg.model.update(vocab_size=64, num_layers=2, d_ff=64, max_len=T, **model_fields)
  cfg.train.update(learning_rate=1e-2, warmup_steps=0, num_steps=steps)
  graphdef, params = nnx.split(build_model(cfg.model, nnx.Rngs(0)))
  tx = make_optimizer(cfg.train)
  step = jit_train_step(graphdef, tx, learning_rate_schedule(cfg.train), "next_token", 1)
  state = init_state(params, tx, 0)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T + 1), 0, 64)
  cut, end = T // 3, T - T // 4
  segment_ids = jnp.asarray([[1] * cut + [2] * (end - cut) + [0] * (T - end), [1] * T])
  positions = jnp.asarray([list(range(cut)) + list(range(T - cut)), list(range(T))])
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids,
               positions=positions, loss_mask=(segment_ids > 0).astype(jnp.float32))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return np.asarray(losses)


@pytest.mark.parametrize("dtype,rtol", [
    ("float32", 1e-5), pytest.param("bfloat16", 2e-3, marks=pytest.mark.slow)])
def test_training_with_pallas_matches_reference(dtype, rtol):
  """A decoder (GQA, RoPE, packed batch) trained 3 steps with the kernel has
  the losses it has with the reference attention (measured gaps: 3e-7
  float32, 1.6e-4 bfloat16)."""
  fields = dict(d_model=32, num_heads=4, num_kv_heads=2, dtype=dtype)
  want = _train_losses(attention_impl="reference", **fields)
  got = _train_losses(attention_impl="pallas", **fields)
  assert want[-1] < want[0]
  np.testing.assert_allclose(got, want, rtol=rtol)


@pytest.mark.slow
def test_training_with_hopper_kernel_matches_reference():
  """The same with the Mosaic GPU kernels (interpreted on CPU): head_dim 64,
  bfloat16, T = 128."""
  fields = dict(d_model=128, num_heads=2, num_kv_heads=1, dtype="bfloat16")
  want = _train_losses(T=128, attention_impl="reference", **fields)
  got = _train_losses(T=128, attention_impl="pallas", pallas_lowering="mosaic_gpu", **fields)
  np.testing.assert_allclose(got, want, rtol=2e-3)


@pytest.mark.parametrize("lowering,dtype,causal", [
    ("triton", jnp.float32, True), ("mosaic_tpu", jnp.float32, False),
    pytest.param("mosaic_gpu", jnp.bfloat16, True, marks=pytest.mark.slow)])
def test_parts_give_the_lse_and_the_gradients_of_a_merged_row(lowering, dtype, causal):
  """`flash_attention_parts`, the ring's blocks: the forward's lse is the
  row's log-sum-exp of the (soft-capped, masked) scores, -inf for a query
  that sees no key; and attention over keys split in two halves, merged by
  the online-softmax rule and differentiated through each half's backward
  from the merged (out, lse), equals the kernel over all keys, forward and
  backward (the ring's custom VJP in miniature)."""
  from model.kernels.router import flash_attention_parts  # pylint: disable=import-outside-toplevel
  B, T, S, H, K, D = 2, 96, 128, 4, 2, 64
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k, v = (jax.random.normal(x, (B, S, K, D), dtype) for x in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, dtype)
  q_seg = jnp.concatenate([jnp.full((B, 40), 1), jnp.full((B, 40), 2), jnp.zeros((B, 16), int)], 1)
  kv_seg = jnp.concatenate([jnp.full((B, 40), 1), jnp.full((B, 88), 2)], 1)
  options = dict(causal=causal, softcap=5.0, lowering=lowering)

  whole = flash_attention_parts(q, k, segments=True, **options)
  out, lse = whole.forward(q, k, v, q_seg, kv_seg)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32),
                 jnp.repeat(k, H // K, 2).astype(jnp.float32)) * D ** -0.5
  s = 5.0 * jnp.tanh(s / 5.0)
  visible = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  if causal:
    visible &= jnp.tril(jnp.ones((T, S), bool))
  want_lse = jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), -1)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                             atol=1e-2 if dtype == jnp.bfloat16 else float32_tolerance())

  if causal:  # split keys under a causal mask: the ring's test (tests/test_context_parallel.py)
    return
  # Keys [0, 64) and [64, 128) as two blocks, merged.
  halves = [slice(0, 64), slice(64, 128)]
  parts = flash_attention_parts(q, k[:, :64], segments=True, **options)
  blocks = [parts.forward(q, k[:, h], v[:, h], q_seg, kv_seg[:, h]) for h in halves]
  merged_lse = jnp.logaddexp(blocks[0][1], blocks[1][1])
  weight = lambda l: jnp.where(jnp.isfinite(l), jnp.exp(l - jnp.where(
      jnp.isfinite(merged_lse), merged_lse, 0)), 0).transpose(0, 2, 1)[..., None]
  merged = sum(o.astype(jnp.float32) * weight(l) for o, l in blocks)
  np.testing.assert_allclose(merged, out.astype(jnp.float32), atol=float32_tolerance())
  grads = [parts.backward(q, k[:, h], v[:, h], q_seg, kv_seg[:, h], out, merged_lse, do)
           for h in halves]
  dq, dk, dv = whole.backward(q, k, v, q_seg, kv_seg, out, lse, do)
  np.testing.assert_allclose(grads[0][0] + grads[1][0], dq, atol=1e-4)
  np.testing.assert_allclose(jnp.concatenate([grads[0][1], grads[1][1]], 1), dk, atol=1e-4)
  np.testing.assert_allclose(jnp.concatenate([grads[0][2], grads[1][2]], 1), dv, atol=1e-4)


@pytest.mark.parametrize("lowering,dtype,tolerance", [
    ("triton", jnp.float32, None), ("mosaic_tpu", jnp.float32, None),
    pytest.param("mosaic_gpu", jnp.bfloat16, 3e-2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("window,packed", [(1, False), (37, True), (130, False)])
def test_sliding_window_matches_reference(lowering, dtype, tolerance, window, packed):
  """Mistral's causal sliding window in each kernel (`window`): output and
  the three gradients against the reference, with packed documents and
  padding, a window of one key, one shorter than a tile and one longer; 200
  tokens, so the last tiles are ragged."""
  tolerance = float32_tolerance() if tolerance is None else tolerance
  B, T, H, K, D = 2, 200, 4, 2, 64
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k, v = (jax.random.normal(x, (B, T, K, D), dtype) for x in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, dtype)
  seg = None
  if packed:
    seg = jnp.concatenate([jnp.full((B, 90), 1), jnp.full((B, 100), 2),
                           jnp.zeros((B, 10), jnp.int32)], 1)
  ours = lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, q_segment_ids=seg,
                                         kv_segment_ids=seg, lowering=lowering)
  f32 = lambda x: x.astype(jnp.float32)
  oracle = lambda q, k, v: attention(f32(q), f32(k), f32(v), causal=True, window=window,
                                     segment_ids=seg, implementation="reference")
  got, got_vjp = jax.vjp(ours, q, k, v)
  want, want_vjp = jax.vjp(oracle, q, k, v)
  for a, b in zip((got, *got_vjp(do)), (want, *want_vjp(f32(do)))):
    scale = max(float(jnp.abs(b).max()), 1.0)
    assert float(jnp.abs(f32(a) - b).max()) / scale < tolerance


def test_sliding_window_needs_the_causal_mask():
  q = jnp.zeros((1, 16, 1, 16))
  with pytest.raises(ValueError, match="window=4 must be >= 1 and come with causal=True"):
    flash_attention(q, q, q, window=4)
