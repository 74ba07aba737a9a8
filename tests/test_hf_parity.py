"""Logits parity with tiny random `transformers` models, weights copied in memory
with convert.py's mappings (`hf/mappings.py`).

Covers the model options that these architectures need: Mistral's sliding
window and Qwen2's in some layers only (with KV-cache decoding), Qwen2's
q/k/v biases without an o bias,
LLaMA's yarn and llama3 RoPE scaling. float32, within 1e-4 of the largest
logit.
"""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from configs import base, bert_base
from model import accounting, build_model
from model.config import ModelConfig
from hf import mappings as hf_mappings

pytestmark = pytest.mark.hf  # transformers and torch

SHAPES = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=48, num_hidden_layers=2, rms_norm_eps=1e-6,
              max_position_embeddings=64, tie_word_embeddings=False)

# name -> (transformers class, its config beyond SHAPES, our model fields beyond _ours())
CASES = {
    "mistral_window": ("MistralForCausalLM", dict(sliding_window=4), dict(sliding_window=4)),
    "qwen2_qkv_bias": ("Qwen2ForCausalLM", {}, dict(qkv_bias=True)),
    # Qwen2's own window in layer 1 only; our reference implementation (the
    # others run xla, as the convert.py tests do). Slow: test_hf_convert.py's
    # fast Qwen2 case has the window too.
    "qwen2_window_layer_1": ("Qwen2ForCausalLM",
                             dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
                             dict(qkv_bias=True, sliding_window=4, sliding_window_layers=(1,),
                                  attention_impl="reference")),
    "llama_yarn": ("LlamaForCausalLM",
                   dict(max_position_embeddings=1024,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=256)),
                   dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=256)),
    "llama3": ("LlamaForCausalLM",
               dict(rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0,
                                         original_max_position_embeddings=16,
                                         low_freq_factor=1.0, high_freq_factor=4.0)),
               dict(rope_theta=500.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                    rope_original_max_len=16)),
}

SLOW = ("qwen2_window_layer_1",)


def _ours(**overrides):
  """Our model and its config section."""
  m = base.get_config().model
  m.update(family="decoder", vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
           d_ff=48, num_layers=2, max_len=64, pos_emb="rope", norm="rmsnorm", norm_eps=1e-6,
           mlp="swiglu", use_bias=False, tie_embeddings=False, attention_impl="xla")
  m.update(**overrides)
  return build_model(m, nnx.Rngs(0)), m


def _copy_weights(hf, ours, model_config):
  """transformers' weights into our model, through convert.py's mapping
  (`hf/mappings.py`) for the HF model's type."""
  arch = hf_mappings.ARCHITECTURES[hf.config.model_type]
  weights = {name.removeprefix(arch.prefix): tensor.detach().numpy()
             for name, tensor in hf.state_dict().items()}
  for tensor in arch.tensors(ModelConfig.resolve(model_config)):
    for path, value in zip(tensor.paths, tensor.to_ours(weights[tensor.hf_name])):
      node, layer = ours, None
      for part in path.split("/"):
        if part.isdigit() and isinstance(node, nnx.List):
          node = node[int(part)]
        elif part.isdigit():  # a scanned stack: slice `layer` of its stacked parameters
          layer = int(part)
        else:
          node = getattr(node, part)
      if layer is None:
        assert node.shape == value.shape, path
        node[...] = jnp.asarray(value)
      else:
        assert node.shape[1:] == value.shape, path
        node[...] = node[...].at[layer].set(jnp.asarray(value))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in sorted(CASES)])
def test_logits_match_transformers(case):
  cls, hf_fields, our_fields = CASES[case]
  torch.manual_seed(0)
  config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{**SHAPES, **hf_fields})
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  hf = getattr(transformers, cls)(config).eval()
  for name, parameter in hf.named_parameters():
    if name.endswith("bias"):  # initialised to zero: make them count
      torch.nn.init.normal_(parameter, std=0.5)
  ours, model_config = _ours(**our_fields)
  _copy_weights(hf, ours, model_config)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 12))
  with torch.no_grad():
    want = hf(torch.from_numpy(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens)))
  tolerance = 1e-4 * np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=tolerance)
  if "window" in case:  # decoding: a 9-token prefill, then one token at a time
    cache = ours.init_cache(2, 12)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    steps = []
    for start, stop in [(0, 9), (9, 10), (10, 11), (11, 12)]:
      logits, cache = ours.decode_step(jnp.asarray(tokens[:, start:stop]),
                                       positions[:, start:stop], cache)
      steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, atol=tolerance)


BERT = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=48,
            num_hidden_layers=2, max_position_embeddings=64, type_vocab_size=2,
            hidden_act="gelu", layer_norm_eps=1e-12)


def _ours_bert():
  """Our BERT and its config section."""
  m = base.get_config().model
  m.update(family="encoder", vocab_size=64, d_model=32, num_heads=4, d_ff=48, num_layers=2,
           max_len=64, pos_emb="learned", norm="layernorm", norm_position="post",
           norm_eps=1e-12, mlp="gelu", use_bias=True, tie_embeddings=True, type_vocab_size=2,
           embedding_norm=True, head_transform=True, output_bias=True, attention_impl="xla")
  return build_model(m, nnx.Rngs(0)), m


def test_bert_masked_lm_logits_match_transformers():
  """Embedding LayerNorm, token types, the MLM head transform and output bias,
  erf GELU, post-norm; with padding (compared at the real tokens)."""
  torch.manual_seed(0)
  hf = transformers.BertForMaskedLM(transformers.BertConfig(**BERT)).eval()
  for name, parameter in hf.named_parameters():
    if name.endswith("bias") or "LayerNorm" in name:  # zeros and ones: make them count
      torch.nn.init.normal_(parameter, mean=float(name.endswith("weight")), std=0.5)
  assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
  ours, model_config = _ours_bert()
  _copy_weights(hf, ours, model_config)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (2, 12))
  types = (np.arange(12) >= rng.integers(3, 9, (2, 1))).astype(np.int64)
  mask = np.ones((2, 12), bool)
  mask[1, 9:] = False
  with torch.no_grad():
    want = hf(input_ids=torch.from_numpy(tokens), token_type_ids=torch.from_numpy(types),
              attention_mask=torch.from_numpy(mask.astype(np.int64))).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens), padding_mask=jnp.asarray(mask),
                        token_type_ids=jnp.asarray(types)))
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-4 * np.abs(want).max())
  with torch.no_grad():  # no token types: zeros, in both
    want = hf(input_ids=torch.from_numpy(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_bert_base_parameter_count_matches_transformers():
  """configs/bert_base.py counts the unique parameters of BertForMaskedLM
  (its decoder weight is tied to the word embeddings, its bias is
  cls.predictions.bias); built on the meta device, nothing downloaded."""
  with torch.device("meta"):
    hf = transformers.BertForMaskedLM(transformers.BertConfig())
  want = sum(parameter.numel() for parameter in hf.parameters())
  assert accounting.formula_params(bert_base.get_config().model)["params_total"] == want
