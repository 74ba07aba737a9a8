"""Model properties: positions, masks, KV cache, presets (Steps 2-5 of the lesson)."""
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from model import build_model
from model.embeddings import apply_rope, rope_frequencies, sinusoidal
from tests.helpers import small_cfg


def test_rope_lesson_mini_check():
  q = k = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
  inv_freq = (math.pi / 6,)

  def score(m, n):
    qm = apply_rope(q, jnp.array([[m]]), inv_freq)
    kn = apply_rope(k, jnp.array([[n]]), inv_freq)
    return float(jnp.sum(qm * kn))

  assert score(1, 3) == pytest.approx(0.5, abs=1e-6)
  assert score(5, 7) == pytest.approx(0.5, abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 500),
       seed=st.integers(0, 1000))
def test_rope_scores_depend_only_on_offset(m, n, shift, seed):
  q, k = jax.random.normal(jax.random.key(seed), (2, 1, 1, 1, 16))
  inv_freq, _ = rope_frequencies(16)

  def score(a, b):
    return float(jnp.sum(apply_rope(q, jnp.array([[a]]), inv_freq)
                         * apply_rope(k, jnp.array([[b]]), inv_freq)))

  assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-3)


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_rope_scaling_slows_the_lowest_frequency(scaling):
  base_freq, _ = rope_frequencies(64, 10000.0)
  scaled, scale = rope_frequencies(64, 10000.0, scaling, 4.0, 256)
  assert scaled[-1] < base_freq[-1]
  if scaling == "linear":
    np.testing.assert_allclose(scaled, np.array(base_freq) / 4)
  if scaling == "yarn":
    assert scaled[0] == pytest.approx(base_freq[0])  # fast pairs kept
    assert scale == pytest.approx(0.1 * math.log(4) + 1)


def _sinusoidal_table(num_positions: int, d: int) -> np.ndarray:
  """The original transformer's fixed encodings, [num_positions, d], in float64."""
  pos = np.arange(num_positions, dtype=np.float64)[:, None]
  inv = 10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  table = np.zeros((num_positions, d))
  table[:, 0::2] = np.sin(pos * inv)
  table[:, 1::2] = np.cos(pos * inv)
  return table


def test_sinusoidal_matches_formula():
  table = _sinusoidal_table(50, 16)
  p, i = 7, 3
  assert table[p, 2 * i] == pytest.approx(math.sin(p / 10000 ** (2 * i / 16)), abs=1e-6)
  assert table[p, 2 * i + 1] == pytest.approx(math.cos(p / 10000 ** (2 * i / 16)), abs=1e-6)
  np.testing.assert_allclose(np.asarray(sinusoidal(jnp.arange(50)[None], 16))[0], table,
                             atol=1e-5)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 1000), norm_position=st.sampled_from(["pre", "post"]))
def test_without_positions_encoder_is_permutation_equivariant(seed, norm_position):
  cfg = small_cfg(family="encoder", pos_emb="none", norm_position=norm_position)
  model = build_model(cfg, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(seed), (1, 7), 0, 64)
  perm = np.random.default_rng(seed).permutation(7)
  out = model(tokens)
  out_perm = model(tokens[:, perm])
  np.testing.assert_allclose(np.asarray(out[:, perm]), np.asarray(out_perm), atol=1e-4)


@pytest.mark.parametrize("pos_emb", ["none", "sinusoidal", "learned", "rope"])
@pytest.mark.parametrize("norm,norm_position", [("layernorm", "pre"), ("rmsnorm", "post")])
def test_decoder_never_sees_the_future(pos_emb, norm, norm_position):
  model = build_model(small_cfg(pos_emb=pos_emb, norm=norm, norm_position=norm_position),
                      nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 64)
  t = 4
  changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 7) % 64)
  np.testing.assert_allclose(np.asarray(model(tokens)[:, :t + 1]),
                             np.asarray(model(changed)[:, :t + 1]), atol=1e-5)
  assert not np.allclose(np.asarray(model(tokens)[:, t + 1:]),
                         np.asarray(model(changed)[:, t + 1:]))


def test_packed_documents_do_not_see_each_other():
  model = build_model(small_cfg(), nnx.Rngs(0))
  doc_a = jnp.array([[5, 6, 7]])
  doc_b = jnp.array([[9, 10, 11, 12]])
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3]])
  out = model(packed, segment_ids=segments, positions=positions)
  np.testing.assert_allclose(np.asarray(out[:, 3:]), np.asarray(model(doc_b)), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out[:, :3]), np.asarray(model(doc_a)), atol=1e-5)


def test_gqa_config_with_all_kv_heads_equals_default_mha():
  tokens = jnp.arange(8)[None]
  mha = build_model(small_cfg(), nnx.Rngs(3))
  gqa = build_model(small_cfg(num_kv_heads=4), nnx.Rngs(3))
  np.testing.assert_allclose(np.asarray(mha(tokens)), np.asarray(gqa(tokens)), atol=1e-6)


@pytest.mark.parametrize("family,pos_emb", [
    ("decoder", "learned"), ("decoder", "rope"), ("encoder_decoder", "sinusoidal"),
    *(pytest.param(f, p, marks=pytest.mark.slow) for f, p in (
        ("decoder", "sinusoidal"), ("encoder_decoder", "learned"), ("encoder_decoder", "rope")))])
def test_kv_cache_prefill_and_steps_equal_full_forward(family, pos_emb):
  cfg = small_cfg(family=family, pos_emb=pos_emb, num_kv_heads=2)
  model = build_model(cfg, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
  extra = {}
  if family == "decoder":
    full = model(tokens)
  else:
    src = jax.random.randint(jax.random.key(2), (2, 5), 0, 64)
    encoded = model.encode(src)
    full = model.decode(tokens, encoded)
    extra = dict(cross_kv=model.cross_cache(encoded))
  cache = model.init_cache(2, 9)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  logits, cache = model.decode_step(tokens[:, :4], positions[:, :4], cache, **extra)
  steps = [logits]
  for t in range(4, 9):
    logits, cache = model.decode_step(tokens[:, t:t + 1], positions[:, t:t + 1], cache, **extra)
    steps.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-4)


PRESETS = ["tiny", "gpt2_small", "bert_base", "transformer_base"]


@pytest.mark.parametrize("name", [
    PRESETS[0], *(pytest.param(name, marks=pytest.mark.slow) for name in PRESETS[1:])])
def test_presets_run_a_finite_forward_pass(name):
  cfg = importlib.import_module(f"configs.{name}").get_config().model
  cfg.attention_impl = "xla"
  model = build_model(cfg, nnx.Rngs(0))
  tokens = jnp.arange(8)[None] % cfg.vocab_size
  out = model(tokens, tokens) if cfg.family == "encoder_decoder" else model(tokens)
  assert out.shape == (1, 8, cfg.vocab_size)
  assert np.all(np.isfinite(np.asarray(out)))


def test_llama2_7b_preset_through_eval_shape():
  cfg = importlib.import_module("configs.llama2_7b").get_config().model

  def forward():
    model = build_model(cfg, nnx.Rngs(0))
    return model(jnp.zeros((1, 16), jnp.int32))

  out = jax.eval_shape(forward)
  assert out.shape == (1, 16, 32000) and out.dtype == jnp.float32


def test_bf16_compute_keeps_float32_params_and_logits():
  model = build_model(small_cfg(dtype="bfloat16"), nnx.Rngs(0))
  out = model(jnp.arange(6)[None])
  assert out.dtype == jnp.float32
  params = nnx.state(model, nnx.Param)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_bf16_model_logits_are_the_float32_head_of_its_hidden_states(tie_embeddings):
  """The head computes in float32: a bf16 model's logits equal the float32
  product of its bf16 hidden states and the float32 head weights, to float32
  rounding, and differ from the bf16 product (which the check would catch)."""
  model = build_model(small_cfg(dtype="bfloat16", tie_embeddings=tie_embeddings,
                                vocab_size=512, d_model=128), nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 512)
  hidden = model.hidden(tokens)
  assert hidden.dtype == jnp.bfloat16
  if tie_embeddings:
    head_MV = model.decoder.embed.embedding[...].T
  else:
    head_MV = model.head.kernel[...]
  expected = np.asarray(hidden, np.float64) @ np.asarray(head_MV, np.float64)
  logits = np.asarray(model(tokens))
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
  bf16_head = np.asarray((hidden @ head_MV.astype(jnp.bfloat16)).astype(jnp.float32))
  assert np.abs(bf16_head - expected).max() > 100 * np.abs(logits - expected).max()


def test_attention_scale_multiplies_the_scores():
  """attention_scale=s gives the scores of the default 1/sqrt(d_k) times s sqrt(d_k)."""
  x = jax.random.normal(jax.random.key(0), (1, 6, 32))
  positions = jnp.arange(6)[None]
  maps = {}
  for scale in (None, 1.0):
    model = build_model(small_cfg(attention_scale=scale, num_layers=1), nnx.Rngs(0))
    maps[scale] = model.decoder.block(0).attn.weights(x, positions_BT=positions, causal=True)
  d_k = 8
  default_logits = np.log(np.asarray(maps[None])[0, 0, 5])
  unscaled_logits = np.log(np.asarray(maps[1.0])[0, 0, 5])
  np.testing.assert_allclose(unscaled_logits - unscaled_logits[0],
                             (default_logits - default_logits[0]) * math.sqrt(d_k), atol=1e-4)


def test_attention_scale_reaches_every_path():
  """Training forward and KV-cache decoding agree under attention_scale=1."""
  model = build_model(small_cfg(attention_scale=1.0, num_layers=1), nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 5), 0, 64)
  full = model(tokens)
  cache = model.init_cache(1, 8)
  step, _ = model.decode_step(tokens, jnp.arange(5)[None], cache)
  np.testing.assert_allclose(np.asarray(step), np.asarray(full), atol=1e-4)
  default = build_model(small_cfg(num_layers=1), nnx.Rngs(0))(tokens)
  assert np.abs(np.asarray(default) - np.asarray(full)).max() > 1e-4


def test_scale_embeddings_multiplies_by_sqrt_d_model():
  tokens = jnp.arange(4)[None]
  plain = build_model(small_cfg(pos_emb="none", num_layers=1), nnx.Rngs(0))
  scaled = build_model(small_cfg(pos_emb="none", scale_embeddings=True, num_layers=1),
                       nnx.Rngs(0))
  positions = jnp.arange(4)[None]
  np.testing.assert_allclose(np.asarray(scaled.decoder.embed_tokens(tokens, positions)),
                             np.asarray(plain.decoder.embed_tokens(tokens, positions))
                             * math.sqrt(32), rtol=1e-6)
  sinusoidal_default = build_model(small_cfg(pos_emb="sinusoidal", num_layers=1), nnx.Rngs(0))
  unscaled = build_model(small_cfg(pos_emb="sinusoidal", scale_embeddings=False, num_layers=1),
                         nnx.Rngs(0))
  diff = (sinusoidal_default.decoder.embed_tokens(tokens, positions)
          - unscaled.decoder.embed_tokens(tokens, positions))
  np.testing.assert_allclose(np.asarray(diff), np.asarray(plain.decoder.embed_tokens(
      tokens, positions)) * (math.sqrt(32) - 1), rtol=1e-5, atol=1e-6)


def test_bert_embedding_and_head_options_reach_kv_cache_decoding():
  """Token types (type 0 when none are given), the embedding norm, the head
  transform and the output bias act the same in the forward pass and in
  KV-cache decoding (tests/test_hf_parity.py checks them against BERT)."""
  model = build_model(small_cfg(type_vocab_size=2, embedding_norm=True, head_transform=True,
                                output_bias=True, norm="layernorm", num_layers=1), nnx.Rngs(0))
  model.output_bias[...] = jax.random.normal(jax.random.key(2), (64,))
  tokens = jax.random.randint(jax.random.key(1), (1, 5), 0, 64)
  full = model(tokens)
  step, _ = model.decode_step(tokens, jnp.arange(5)[None], model.init_cache(1, 8))
  np.testing.assert_allclose(np.asarray(step), np.asarray(full), atol=1e-4)
