"""Self-speculative greedy decoding with the MTP modules (model/generate.py's
`mtp_speculative`, `generate(draft="mtp")`): the tokens of plain greedy
decoding for prompts of several lengths and batch sizes, with drafts mostly
rejected, partly accepted and all accepted; the passes and acceptance those
drafts must give, counted from the modules' teacher-forced logits; the
refusals; eval.py --prompt --draft mtp."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from model import build_model
from model.generate import generate, mtp_speculative
from tests.helpers import assert_one_line_error, run_python, small_cfg
from training import workdir as workdir_lib

D = 2
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [3, 1]]


def model_config(**overrides):
  return small_cfg(**{"max_len": 48, "pos_emb": "rope", "tie_embeddings": False, **overrides})


@nnx.jit
def teacher_forced_drafts(model, tokens_BT):
  """Each module's argmax [D, B, T] over whole rows (position i: token i+k+1)."""
  return jnp.stack([logits.argmax(-1) for logits in
                    model.mtp_logits(model.hidden(tokens_BT), tokens_BT)])


def expected_counts(model, prompts, outs):
  """(passes, accepted) that `mtp_speculative` must count for `prompts`
  whose greedy continuations are `outs`: at each pass from a row whose
  newest token is n, module k's draft of token n+k is its teacher-forced
  argmax at n-1 while the drafts before it were right (it read them)."""
  rows = [p + o for p, o in zip(prompts, outs)]
  padded = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for b, row in enumerate(rows):
    padded[b, :len(row)] = row
  drafts = np.asarray(teacher_forced_drafts(model, jnp.asarray(padded)))
  passes = accepted = 0
  for b, (prompt, row) in enumerate(zip(prompts, rows)):
    n, end = len(prompt), len(row) - 1
    while n < end:
      taken = 0
      while (taken < len(drafts) and n + taken + 1 <= end
             and drafts[taken, b, n - 1] == row[n + taken + 1]):
        taken += 1
      passes, accepted, n = passes + 1, accepted + taken, n + taken + 1
  return passes, accepted


def check(model, cfg, prompts, max_new_tokens=12, **kwargs):
  """Asserts the speculative tokens are greedy's and the counts the
  teacher-forced ones; returns the stats."""
  greedy = generate(model, cfg, prompts, max_new_tokens=max_new_tokens, **kwargs)
  tokens, stats = mtp_speculative(model, cfg, prompts, max_new_tokens=max_new_tokens, **kwargs)
  assert tokens == greedy
  if "eos_id" not in kwargs:
    assert (stats["passes"], stats["accepted"]) == expected_counts(model, prompts, greedy)
  assert stats["drafted"] == len(model.mtp) * stats["passes"]
  return stats


@pytest.mark.slow
def test_random_drafts_give_greedys_tokens():
  """Vocabulary 64, four prompts of 1 to 7 tokens: the drafts are mostly rejected."""
  cfg = model_config()
  model = build_model(cfg, nnx.Rngs(0), mtp_depth=D)
  stats = check(model, cfg, PROMPTS, num_tokens=60)
  assert stats["acceptance_rate"] < 0.2


@pytest.mark.slow
def test_a_small_vocabulary_accepts_some_drafts_and_ends_rows_at_eos():
  """With 8 tokens (a scanned stack) chance drafts match: passes that take
  0..D drafts, counted exactly; one row and three; a row ends at its EOS."""
  cfg = model_config(vocab_size=8, scan_layers=True)
  model = build_model(cfg, nnx.Rngs(3), mtp_depth=D)
  prompts = [[1, 2, 3], [2, 1, 0, 2, 3], [0]]
  assert 0 < check(model, cfg, prompts, max_new_tokens=20)["acceptance_rate"] < 1
  check(model, cfg, prompts[1:2], max_new_tokens=20, prompt_width=5)
  check(model, cfg, prompts, max_new_tokens=20, eos_id=6)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(attention="mla", q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=8,
         qk_rope_head_dim=4, v_head_dim=6, scan_layers=False),
    dict(pos_emb="learned"), dict(pos_emb="alibi"), dict(pos_emb="relative"),
    dict(sliding_window=4), dict(norm_position="post")])
def test_every_cache_and_position_scheme_drafts_and_gives_greedys_tokens(overrides):
  """MLA's latent cache in the modules' blocks, a learned table, ALiBi, T5's
  relative bias, a sliding window, post-norm: greedy's tokens, exact counts."""
  cfg = model_config(vocab_size=8, **overrides)
  model = build_model(cfg, nnx.Rngs(3), mtp_depth=D)
  check(model, cfg, [[1, 2, 3], [2, 1, 0, 2, 3, 5], [0]], max_new_tokens=20)


def copying_model(cfg, depth: int, copies: int):
  """A model whose first `copies` MTP modules predict the token they read
  (M_k passes the embedding's half, the block adds nothing, the tied head
  reads it back), and whose main model, tied too, repeats its last token:
  those drafts are accepted."""
  model = build_model(cfg, nnx.Rngs(0), mtp_depth=depth)
  for module in list(model.mtp)[:copies]:
    kernel = np.zeros(module.eh_proj.kernel.shape, np.float32)
    kernel[0] = np.eye(cfg.d_model)  # [enorm(emb); hnorm(h)]: the embedding's half
    module.eh_proj.kernel[...] = jnp.asarray(kernel)
    module.block.attn.o_proj.kernel[...] = jnp.zeros_like(module.block.attn.o_proj.kernel[...])
    module.block.mlp.down.kernel[...] = jnp.zeros_like(module.block.mlp.down.kernel[...])
  return model


def test_copied_drafts_are_accepted_and_save_passes():
  """All D drafts right: D + 1 tokens a pass; module 1's only: 2 tokens a pass."""
  cfg = small_cfg(max_len=48, pos_emb="rope")
  stats = check(copying_model(cfg, D, D), cfg, PROMPTS, max_new_tokens=13)
  assert stats["acceptance_rate"] == 1.0
  assert stats["tokens_per_pass"] == D + 1
  assert stats["passes"] == len(PROMPTS) * 12 // (D + 1)
  stats = check(copying_model(cfg, D, 1), cfg, PROMPTS, max_new_tokens=13)
  assert stats["acceptance_rate"] == 0.5


def test_the_first_modules_of_several_draft_alone():
  """draft_depth=1 of two copying modules: greedy's tokens, 2 tokens a pass,
  one draft a pass; a depth past the modules is refused."""
  cfg = small_cfg(max_len=48, pos_emb="rope")
  model = copying_model(cfg, D, D)
  greedy = generate(model, cfg, PROMPTS, max_new_tokens=13)
  tokens, stats = mtp_speculative(model, cfg, PROMPTS, max_new_tokens=13, draft_depth=1)
  assert tokens == greedy
  assert (stats["draft_depth"], stats["acceptance_rate"], stats["tokens_per_pass"]) == (1, 1.0, 2)
  assert stats["drafted"] == stats["passes"] == len(PROMPTS) * 12 // 2
  with pytest.raises(UserError, match="draft with 1 to 2 of them"):
    mtp_speculative(model, cfg, PROMPTS, max_new_tokens=2, draft_depth=D + 1)


def test_refusals_are_one_line():
  cfg = model_config()
  plain = build_model(cfg, nnx.Rngs(0))
  with pytest.raises(UserError, match="train.mtp_depth > 0"):
    generate(plain, cfg, PROMPTS, max_new_tokens=2, draft="mtp")
  model = build_model(cfg, nnx.Rngs(0), mtp_depth=1)
  with pytest.raises(UserError, match="temperature=0.7 samples"):
    generate(model, cfg, PROMPTS, max_new_tokens=2, temperature=0.7, draft="mtp")
  with pytest.raises(UserError, match="the one drafter is 'mtp'"):
    generate(model, cfg, PROMPTS, max_new_tokens=2, draft="ngram")
  seq2seq = small_cfg(family="encoder_decoder", num_decoder_layers=1)
  with pytest.raises(UserError, match="encoder_decoder"):
    generate(build_model(seq2seq, nnx.Rngs(0)), seq2seq, [[1]], sources=[[2]],
             max_new_tokens=2, draft="mtp")


@pytest.mark.parametrize("flags, fragments", [
    (["--prompt", "def ", "--draft", "mtp"], ["train.mtp_depth=0", "drop --draft"]),
    (["--prompt", "def ", "--draft", "mtp", "--temperature", "0.5"],
     ["verifies the drafts greedily", "--temperature 0.5"]),
    (["--draft", "mtp"], ["no --prompt is given", "add --prompt TEXT or drop --draft"]),
])
def test_eval_refuses_a_draft_it_cannot_make_in_one_line_exit_2(tmp_path, flags, fragments):
  """Before the checkpoint is read: a run without MTP modules, a sampling
  temperature, --draft without --prompt; nothing written."""
  run = tmp_path / "run"
  run.mkdir()
  config = base.get_config()
  config.train.mtp_depth = 1 if "--temperature" in flags else 0
  workdir_lib.write_json_atomic(str(run / workdir_lib.CONFIG_FILE),
                                workdir_lib.config_to_dict(config))
  result = run_python(["eval.py", "--workdir", str(run), *flags])
  assert result.returncode == 2
  assert_one_line_error(result, *fragments)
  assert sorted(p.name for p in run.iterdir()) == [workdir_lib.CONFIG_FILE]
