"""KV-cache generation: batched prompts of different lengths, sampling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.errors import UserError
from model import build_model
from model.generate import beam_search, generate, sample_logits
from model.transformer import EncoderDecoder
from tests.helpers import small_cfg

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9], [10, 11, 12]]


@pytest.mark.parametrize("family", [
    "decoder", pytest.param("encoder_decoder", marks=pytest.mark.slow)])  # beam: test_seq2seq
def test_batched_generation_equals_one_by_one(family):
  cfg = small_cfg(family=family, pos_emb="learned" if family == "decoder" else "rope",
                  tie_embeddings=False)
  model = build_model(cfg, nnx.Rngs(0))
  kwargs = dict(max_new_tokens=8)
  if family == "encoder_decoder":
    prompts = [[1]] * len(PROMPTS)
    batched = generate(model, cfg, prompts, sources=PROMPTS, **kwargs)
    alone = [generate(model, cfg, [[1]], sources=[s], **kwargs)[0] for s in PROMPTS]
    # With the cross-attention keys and values computed once at prefill,
    # each row is what the full forward pass of its source alone predicts
    # when teacher-forced on that row.
    for source, row in zip(PROMPTS, batched):
      logits = model(jnp.array([source]), jnp.array([[1] + row[:-1]]))
      assert np.asarray(jnp.argmax(logits[0], axis=-1)).tolist() == row
  else:
    batched = generate(model, cfg, PROMPTS, **kwargs)
    alone = [generate(model, cfg, [p], **kwargs)[0] for p in PROMPTS]
  assert batched == alone


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_the_decoder_runs_once_per_new_token_but_the_last(monkeypatch, search):
  """Prefill, then one step per new token whose logits are read: 1 + (N - 1)."""
  cfg = small_cfg(family="encoder_decoder")
  model = build_model(cfg, nnx.Rngs(0))
  calls = []
  step = EncoderDecoder.decode_step

  def counted(self, *args, **kwargs):
    jax.debug.callback(lambda: calls.append(1))
    return step(self, *args, **kwargs)

  monkeypatch.setattr(EncoderDecoder, "decode_step", counted)
  kwargs = dict(sources=[[3, 4, 5]], max_new_tokens=5)
  if search == "beam":
    out = beam_search(model, cfg, [[1]], beam_size=2, **kwargs)
  else:
    out = generate(model, cfg, [[1]], **kwargs)
  jax.effects_barrier()
  assert len(out[0]) == 5 and len(calls) == 1 + 4


def test_greedy_generation_equals_argmax_of_full_forward():
  cfg = small_cfg(tie_embeddings=False)
  model = build_model(cfg, nnx.Rngs(1))
  prompt = [3, 1, 4, 1, 5]
  new = generate(model, cfg, [prompt], max_new_tokens=6)[0]
  seq = list(prompt)
  for _ in range(6):
    seq.append(int(jnp.argmax(model(jnp.array([seq]))[0, -1])))
  assert new == seq[len(prompt):]


def test_generation_stops_at_eos():
  cfg = small_cfg()
  model = build_model(cfg, nnx.Rngs(0))
  first = generate(model, cfg, [[5]], max_new_tokens=1)[0][0]
  out = generate(model, cfg, [[5]], max_new_tokens=5, eos_id=first)[0]
  assert out == [first]


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  for seed in range(20):
    rng = jax.random.key(seed)
    assert int(sample_logits(logits, rng, temperature=1.0, top_k=1)[0]) == 0
    assert int(sample_logits(logits, rng, temperature=1.0, top_p=0.7)[0]) in (0, 1)


def test_learned_positions_bound_generation_length():
  cfg = small_cfg(pos_emb="learned", max_len=8)
  model = build_model(cfg, nnx.Rngs(0))
  with pytest.raises(UserError, match="model.max_len=8"):
    generate(model, cfg, [[1, 2, 3]], max_new_tokens=6)


def test_empty_prompt_is_a_user_error():
  cfg = small_cfg()
  with pytest.raises(UserError, match="at least one token"):
    generate(build_model(cfg, nnx.Rngs(0)), cfg, [[]], max_new_tokens=2)


def test_samples_are_valid_tokens():
  cfg = small_cfg()
  out = generate(build_model(cfg, nnx.Rngs(0)), cfg, PROMPTS, max_new_tokens=5, temperature=0.8,
                 top_k=10, top_p=0.9, seed=3)
  assert all(0 <= t < 64 for row in out for t in row)
  assert np.array([len(r) for r in out]).tolist() == [5] * 4


def test_num_tokens_keeps_ids_past_the_tokenizer_out_of_every_search():
  cfg = small_cfg(family="decoder", pos_emb="rope")
  model = build_model(cfg, nnx.Rngs(0))
  limit = 5
  greedy = generate(model, cfg, PROMPTS, max_new_tokens=12)
  assert any(t >= limit for row in greedy for t in row)  # without the limit it happens
  runs = [generate(model, cfg, PROMPTS, max_new_tokens=12, num_tokens=limit),
          generate(model, cfg, PROMPTS, max_new_tokens=12, temperature=2.0, num_tokens=limit),
          beam_search(model, cfg, PROMPTS, beam_size=3, max_new_tokens=12, num_tokens=limit)]
  assert all(t < limit for rows in runs for row in rows for t in row)
