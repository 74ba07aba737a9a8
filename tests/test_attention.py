"""Steps 3-4 of the lesson: the attention worked example and mask properties."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from model.attention import attention, attention_weights, combined_mask

Q = K = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, :, None, :]  # [1, 3, 1, 2]
V = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])[None, :, None, :]


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_lesson_worked_example_unmasked(impl):
  out = attention(Q, K, V, implementation=impl)[0, :, 0]
  np.testing.assert_allclose(np.round(np.asarray(out), 3),
                             [[3.000, 4.000], [3.407, 4.407], [3.510, 4.510]], atol=1e-3)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_lesson_worked_example_causal(impl):
  out = attention(Q, K, V, causal=True, implementation=impl)[0, :, 0]
  np.testing.assert_allclose(np.round(np.asarray(out), 3),
                             [[1.000, 2.000], [2.340, 3.340], [3.510, 4.510]], atol=1e-3)


def test_lesson_softmax_weights():
  """Our softmax(Q K^T / sqrt(d_k)) on the lesson's example, and its causal
  version: the lesson's weights renormalised over the visible keys."""
  weights = attention_weights(Q, K)[0, 0, 0]
  np.testing.assert_allclose(np.round(np.asarray(weights), 3),
                             [[0.401, 0.198, 0.401], [0.198, 0.401, 0.401],
                              [0.248, 0.248, 0.503]], atol=1e-3)
  causal = np.asarray(attention_weights(Q, K, causal=True)[0, 0, 0])
  np.testing.assert_allclose(causal, [[1.0, 0.0, 0.0], [0.198 / 0.599, 0.401 / 0.599, 0.0],
                                      [0.248, 0.248, 0.503]], atol=2e-3)


def _random_qkv(key, B, T, S, H, K, D, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, S, K, D), dtype),
          jax.random.normal(kv, (B, S, K, D), dtype))


def _packed_padded_segments():
  # Row 0: two documents then padding; row 1: one document filling the row.
  return jnp.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9], jnp.int32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("causal", [False, True])
def test_implementations_agree_on_packed_padded_batch(impl, causal):
  q, k, v = _random_qkv(jax.random.key(0), 2, 9, 9, 4, 2, 16)
  seg = _packed_padded_segments()
  want = attention(q, k, v, causal=causal, segment_ids=seg, implementation="reference")
  got = attention(q, k, v, causal=causal, segment_ids=seg, implementation=impl)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  # Padding queries (segment 0) get zeros, not NaN.
  assert np.all(np.asarray(got)[0, 7:] == 0)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_fully_masked_row_gives_zeros_and_finite_grads(impl):
  q, k, v = _random_qkv(jax.random.key(1), 1, 4, 4, 2, 2, 8)
  mask = jnp.ones((1, 4, 4), bool).at[0, 2].set(False)

  def loss(q, k, v):
    return attention(q, k, v, mask=mask, implementation=impl).sum()

  out = attention(q, k, v, mask=mask, implementation=impl)
  assert np.all(np.asarray(out)[0, 2] == 0)
  for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v):
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_gqa_equals_mha_with_each_kv_head_repeated(impl):
  q, k, v = _random_qkv(jax.random.key(2), 2, 5, 5, 4, 2, 8)
  # GQA with 2 KV heads == MHA with each KV head repeated for its 2 query heads.
  gqa = attention(q, k, v, causal=True, implementation=impl)
  mha = attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), causal=True,
                  implementation="reference")
  np.testing.assert_allclose(np.asarray(gqa), np.asarray(mha), atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 8), t=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_causal_mask_never_sees_the_future(T, t, seed):
  t = min(t, T - 1)
  q, k, v = _random_qkv(jax.random.key(seed), 1, T, T, 2, 1, 4)
  out = attention(q, k, v, causal=True)
  k2 = k.at[:, t + 1:].set(99.0)
  v2 = v.at[:, t + 1:].set(-99.0)
  out2 = attention(q, k2, v2, causal=True)
  np.testing.assert_allclose(np.asarray(out[:, :t + 1]), np.asarray(out2[:, :t + 1]), atol=1e-6)


def test_combined_mask_cross_attention_segments():
  q_seg = jnp.array([[1, 1, 0]])
  kv_seg = jnp.array([[1, 0]])
  m = combined_mask(3, 2, segment_ids=(q_seg, kv_seg))
  np.testing.assert_array_equal(np.asarray(m[0]), [[True, False], [True, False], [False, False]])


def test_unknown_implementation_is_an_error():
  with pytest.raises(ValueError, match="must be one of"):
    attention(Q, K, V, implementation="flash")


@pytest.mark.hf
@pytest.mark.parametrize("window", [1, 3, 20])
def test_sliding_window_mask_is_transformers(window):
  """causal & window equals transformers' causal mask with its sliding-window overlay."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers.masking_utils import (  # pylint: disable=import-outside-toplevel
      and_masks, causal_mask_function, sliding_window_overlay)
  reference = and_masks(causal_mask_function, sliding_window_overlay(window))
  want = reference(0, 0, torch.arange(9)[:, None], torch.arange(9)[None, :]).numpy()
  np.testing.assert_array_equal(np.asarray(combined_mask(9, 9, causal=True, window=window)[0]),
                                want)


@pytest.mark.parametrize("causal", [False, True])
def test_xla_sliding_window_agrees_with_reference(causal):
  """Packed, padded rows with a 3-key window: xla (local_window_size) == reference."""
  q, k, v = _random_qkv(jax.random.key(3), 2, 9, 9, 4, 2, 16)
  seg = _packed_padded_segments()
  want = attention(q, k, v, causal=causal, segment_ids=seg, window=3, implementation="reference")
  got = attention(q, k, v, causal=causal, segment_ids=seg, window=3, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  unwindowed = attention(q, k, v, causal=causal, segment_ids=seg, implementation="reference")
  assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-3
  assert np.all(np.asarray(got)[0, 7:] == 0)
