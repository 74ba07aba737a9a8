"""model.attention.cache_attention: a few decoding queries against a
heads-first cache run one at a time on a CPU, with the values of the one
batched product (the reference einsums)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import (CACHE_QUERIES_ONE_BY_ONE, AttentionOptions, cache_attention,
                             cache_slot_mask, reference_attention)


def _products(fn, *args):
  """The dot_general equations of fn's jaxpr."""
  return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("queries", [1, 2, CACHE_QUERIES_ONE_BY_ONE, CACHE_QUERIES_ONE_BY_ONE + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_queries_one_by_one_give_the_batched_values(queries, with_bias):
  B, H, K, L, D = 2, 4, 2, 12, 8
  keys = jax.random.split(jax.random.key(0), 4)
  q_BTHD = jax.random.normal(keys[0], (B, queries, H, D))
  k_BKLD = jax.random.normal(keys[1], (B, K, L, D))
  v_BKLD = jax.random.normal(keys[2], (B, K, L, D))
  positions_BT = jnp.array([[3], [7]]) + jnp.arange(queries)  # rows at different slots
  bias = jax.random.normal(keys[3], (1, H, queries, L)) if with_bias else None
  options = AttentionOptions(mask=cache_slot_mask(positions_BT, L, window=5), bias=bias,
                             softcap=30.0)
  got = cache_attention(q_BTHD, k_BKLD, v_BKLD, options)
  want = reference_attention(q_BTHD, k_BKLD, v_BKLD, options, heads_first=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  one_by_one = 1 < queries <= CACHE_QUERIES_ONE_BY_ONE
  products = _products(lambda q: cache_attention(q, k_BKLD, v_BKLD, options), q_BTHD)
  assert len(products) == 2 * (queries if one_by_one else 1)  # scores and values per product
  rows = (1 if one_by_one else queries) * (H // K)  # [B, K, query x head of the group, ...]
  assert all(e.outvars[0].aval.shape[2] == rows for e in products)


def test_a_fully_masked_query_is_zero_one_by_one_too():
  q_BTHD = jnp.ones((1, 2, 2, 4))
  kv_BKLD = jnp.ones((1, 2, 6, 4))
  mask_BTL = jnp.array([[[True] * 6, [False] * 6]])
  out = cache_attention(q_BTHD, kv_BKLD, kv_BKLD, AttentionOptions(mask=mask_BTL))
  np.testing.assert_array_equal(out[0, 1], 0)
  np.testing.assert_allclose(out[0, 0], 1, rtol=1e-6)
