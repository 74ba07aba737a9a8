"""BLOOM (BloomForCausalLM) against `transformers`: tiny random models, both ways.

As tests/test_hf_convert.py does for the other architectures: a tiny random
`BloomForCausalLM` saved with our tokenizer, imported with `convert.py
from_hf` and loaded with `training.workdir.load_run`; float32 logits within
1e-4 (absolute) of transformers', also on a right-padded batch with its
attention mask (transformers builds BLOOM's ALiBi from the mask), greedy
KV-cache generation token for token, and the `convert.py to_hf` export loaded
by transformers to the same logits. With 4 heads and with 6, whose ALiBi
slopes are two interleaved geometric sequences.
"""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from configs import base as base_config
from configs.errors import UserError
from model.config import ModelConfig
from model.generate import generate
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from training.workdir import load_run
from tests.helpers import convert_error_line, edit_hf_config, run_convert, save_hf

pytestmark = pytest.mark.hf  # transformers and torch

PROMPTS = ["def add(", "class "]
TOLERANCE = 1e-4  # absolute, float32 logits
# name -> BloomConfig fields beyond _bloom's
CASES = {"4_heads_tied": dict(hidden_size=64, n_head=4),
         "6_heads_untied": dict(hidden_size=48, n_head=6, tie_word_embeddings=False)}


def _bloom(**kw):
  """A tiny random BloomForCausalLM in eval mode: weights drawn wider than
  BLOOM's init (at 0.02 greedy decoding repeats one token), biases and
  LayerNorms drawn at random (zeros and ones would not show a misplaced
  tensor)."""
  torch.manual_seed(0)
  hf_model = transformers.BloomForCausalLM(transformers.BloomConfig(**{**dict(
      vocab_size=300, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.5), **kw}))
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      if name.endswith("bias") or "layernorm" in name or "ln_f" in name:
        torch.nn.init.normal_(parameter, mean=float(name.endswith("weight")), std=0.2)
  return hf_model.eval()


def _hf_logits(hf_model, ids, mask=None):
  """transformers' float32 logits of `ids` (with the attention mask `mask`)."""
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids), attention_mask=None if mask is None else
                    torch.as_tensor(mask.astype(np.int64))).logits.numpy()


def _max_diff(ours, theirs) -> float:
  """max |ours - theirs| of two arrays of one shape."""
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  assert ours.shape == theirs.shape
  return float(np.abs(ours - theirs).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_bloom_in_and_out(tok, tmp_path, case):
  """Import: logits, logits of a right-padded row at its real tokens, greedy
  generation; export: transformers' logits again."""
  shape = CASES[case]
  hf_model = _bloom(**shape)
  tied = shape.get("tie_word_embeddings", True)
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf_model, tok, tmp_path / "hf"),
                     "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  m = config.model
  assert (m.pos_emb, m.embedding_norm, m.mlp, m.d_ff, m.max_len, m.tie_embeddings) == (
      "alibi", True, "gelu_tanh", 4 * shape["hidden_size"], 2048, tied)

  ids = np.random.default_rng(0).integers(0, tok.vocab_size, (2, 20))
  theirs = _hf_logits(hf_model, ids)
  assert _max_diff(model(ids), theirs) < TOLERANCE

  mask = np.arange(20) < np.array([[20], [13]])  # row 1 right-padded after 13 tokens
  ours = model(jnp.asarray(ids), segment_ids=jnp.asarray(mask, jnp.int32))
  assert _max_diff(np.asarray(ours)[mask], _hf_logits(hf_model, ids, mask)[mask]) < TOLERANCE

  prompts = [tok.encode_with_specials(p) for p in PROMPTS]
  new = generate(model, m, prompts, max_new_tokens=16, eos_id=-1)
  assert all(len(set(tokens)) > 4 for tokens in new)  # not one token repeated
  for prompt, tokens in zip(prompts, new):
    with torch.no_grad():
      want = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    assert tokens == want[0, len(prompt):].tolist()

  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = json.loads((out / "config.json").read_text())
  assert (exported["model_type"], exported["n_head"], exported["seq_length"],
          exported["tie_word_embeddings"]) == ("bloom", shape["n_head"], 2048, tied)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert isinstance(reloaded, transformers.BloomForCausalLM)
  assert _max_diff(_hf_logits(reloaded, ids), theirs) < TOLERANCE


def test_bloom_post_layernorm_residual_is_refused_by_name(tok, tmp_path, capsys):
  hf_dir = tmp_path / "hf"
  save_hf(_bloom(n_layer=1), tok, hf_dir)
  edit_hf_config(hf_dir, apply_residual_connection_post_layernorm=True)
  assert ("Hugging Face config field apply_residual_connection_post_layernorm=True is not "
          "supported by the bloom import (needs False)") in convert_error_line(
              capsys, "from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run")


def test_bloom_published_configs():
  """bigscience's files: bloom-560m's Megatron fields are inert; BLOOMZ's
  older names (`n_embed`, `num_attention_heads`) and its `seq_length`."""
  bloom = hf_mappings.ARCHITECTURES["bloom"]
  bloom_560m = {
      "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"],
      "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True,
      "bos_token_id": 1, "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 1024,
      "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True,
      "model_type": "bloom", "n_head": 16, "n_inner": None, "n_layer": 24, "offset_alibi": 100,
      "pad_token_id": 3, "pretraining_tp": 1, "skip_bias_add": True, "skip_bias_add_qkv": False,
      "slow_but_exact": False, "transformers_version": "4.26.0", "unk_token_id": 0,
      "use_cache": True, "vocab_size": 250880}
  fields = bloom.config_from_hf(bloom_560m)
  assert {k: fields[k] for k in ("d_model", "num_heads", "num_layers", "d_ff", "max_len")} == dict(
      d_model=1024, num_heads=16, num_layers=24, d_ff=4096, max_len=2048)
  bloomz_560m = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_embed": 1024,
                 "n_layer": 24, "num_attention_heads": 16, "seq_length": 2048,
                 "vocab_size": 250880}
  assert bloom.config_from_hf(bloomz_560m) == fields
  with pytest.raises(UserError, match="field alibi_bias_max=8 is not supported by the bloom"):
    bloom.config_from_hf({**bloomz_560m, "alibi_bias_max": 8})


def test_alibi_exports_as_bloom_or_names_the_field():
  """A BLOOM-shaped config of ours exports as BLOOM (and through JSON comes
  back unchanged); an MLP that is not 4 * d_model is named."""
  config = base_config.get_config()
  config.model.update(vocab_size=300, d_model=64, num_heads=4, d_ff=256, max_len=512,
                      pos_emb="alibi", norm="layernorm", norm_eps=1e-5, embedding_norm=True,
                      mlp="gelu_tanh", use_bias=True, tie_embeddings=True)
  cfg = ModelConfig.resolve(config.model)
  bloom = hf_convert.export_architecture(cfg)
  assert bloom.model_type == "bloom"
  again = base_config.get_config().model
  again.update(**bloom.config_from_hf(json.loads(json.dumps(bloom.config_to_hf(cfg, 300)))),
               dtype=config.model.dtype, param_dtype=config.model.param_dtype)
  assert ModelConfig.resolve(again) == cfg
  config.model.d_ff = 192
  with pytest.raises(UserError, match=r"bloom: model.d_ff=192 \(needs 256\)"):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))
