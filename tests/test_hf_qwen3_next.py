"""Qwen3-Next (`hf/qwen3_next.py`) against transformers' Qwen3NextForCausalLM
built tiny and random: import (transformers' parameter count, float32 logits
within 1e-4 of the largest, greedy generation token for token on ragged
prompts through the KV cache and the linear layers' state), export loaded
back by transformers to the same logits, the config's round trip, and the
80B-A3B preset's parameter count."""
import json

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from configs import base as base_config
from configs import qwen3_5_9b, qwen3_next_80b_a3b
from configs.errors import UserError
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from hf.qwen3_next import shortest_cycle
from model import accounting
from model.config import ModelConfig
from model.generate import generate
from training.workdir import load_run
from tests.helpers import assert_close, run_convert, save_hf

pytestmark = pytest.mark.hf  # transformers and torch

PROMPTS = ["def add(a, b):", "class "]
_TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=8, shared_expert_intermediate_size=16,
             max_position_embeddings=64, rope_parameters=dict(rope_type="default",
                                                              rope_theta=10000.0,
                                                              partial_rotary_factor=0.25))


def _qwen3_next(model_class=transformers.Qwen3NextForCausalLM,
                config_class=transformers.Qwen3NextConfig, **fields):
  """A tiny random Qwen3-Next (or Qwen3.5 text model, with `_TINY`'s dense
  fields): every weight normal (the zero-centred norms' w around 0, the
  linear layers' A_log and dt_bias too) so that a misplaced tensor shows."""
  torch.manual_seed(0)
  hf_model = model_class(config_class(**{k: v for k, v in {**_TINY, **fields}.items()
                                         if v is not None}))  # None: left out
  with torch.no_grad():
    for key, parameter in hf_model.named_parameters():
      plain_norm = key.endswith("linear_attn.norm.weight")  # Gated DeltaNet's: not zero-centred
      torch.nn.init.normal_(parameter, mean=float(plain_norm), std=0.3)
  return hf_model.eval()


def _ids(tok):
  return np.asarray([tok.encode_with_specials(p + "x = 1") for p in PROMPTS[:1]] * 2)


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids)).logits.float().numpy()


def _in_and_out(hf_model, tok, tmp_path, generation=True, exported_as=None):
  """from_hf: transformers' parameter count (a vision tower's aside), logits and (with `generation`)
  greedy generation of two prompts of different lengths in one batch; to_hf:
  transformers loads it back (as `exported_as`, default the same class) to
  the same logits. The run's model config."""
  hf_dir = save_hf(hf_model, tok, tmp_path / "hf")
  workdir = tmp_path / "run"
  count = hf_convert.from_hf(hf_dir, str(workdir))
  assert count == sum(p.numel() for name, p in hf_model.named_parameters()
                     if not name.startswith("model.visual."))  # a vision tower: read past
  config, _, model, _ = load_run(str(workdir))
  ids = _ids(tok)
  want = _hf_logits(hf_model, ids)
  assert_close(nnx.jit(lambda m, x: m(x))(model, ids), want)
  if generation:
    prompts = [tok.encode_with_specials(p) for p in PROMPTS]
    assert len(set(map(len, prompts))) == 2
    ours = generate(model, config.model, prompts, max_new_tokens=8, eos_id=-1)
    for prompt, new in zip(prompts, ours):
      with torch.no_grad():
        theirs = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
      assert new == theirs[0, len(prompt):].tolist()
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported) is (exported_as or type(hf_model))
  assert_close(_hf_logits(exported, ids), want)
  return config.model


def test_qwen3_next_in_and_out(tok, tmp_path):
  """Three linear layers and a full one, each with experts and a shared
  expert twice the experts' width; logits, export (fast)."""
  m = _in_and_out(_qwen3_next(), tok, tmp_path, generation=False)
  assert tuple(m.layer_types) == ("linear_attention+moe",) * 3 + ("full_attention+moe",)
  assert (m.norm, m.qk_norm, m.attention_output_gate, m.partial_rotary_factor,
          m.num_shared_experts, m.moe_shared_expert_gate) == (
              "rmsnorm_zero_centred", True, True, 0.25, 2, True)
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["mlp_only_layers"], exported["layer_types"]) == (
      "qwen3_next", [], ["linear_attention"] * 3 + ["full_attention"])


@pytest.mark.slow
def test_qwen3_next_dense_layer_in_and_out(tok, tmp_path):
  """Experts in all but layer 1 (mlp_only_layers): the kinds written as all
  four layers, the dense layer exported back in mlp_only_layers."""
  m = _in_and_out(_qwen3_next(mlp_only_layers=[1]), tok, tmp_path, generation=False)
  assert tuple(m.layer_types) == ("linear_attention+moe", "linear_attention",
                                  "linear_attention+moe", "full_attention+moe")
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert exported["mlp_only_layers"] == [1]


@pytest.mark.slow
def test_qwen3_next_generation(tok, tmp_path):
  """Greedy generation of ragged prompts token for token, all layers
  with experts, the cycle written once."""
  m = _in_and_out(_qwen3_next(num_hidden_layers=8), tok, tmp_path)
  assert tuple(m.layer_types) == ("linear_attention+moe",) * 3 + ("full_attention+moe",)


@pytest.mark.slow
def test_qwen3_next_dense_generation(tok, tmp_path):
  """No experts (num_experts 0): dense SwiGLU MLPs; generation too. The
  export is Qwen3.5's text model, the dense hybrid's first architecture."""
  m = _in_and_out(_qwen3_next(num_experts=0), tok, tmp_path,
                  exported_as=transformers.Qwen3_5ForCausalLM)
  assert (m.num_experts, tuple(m.layer_types)) == (
      0, ("linear_attention",) * 3 + ("full_attention",))


_DENSE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
          "shared_expert_intermediate_size")


def _qwen3_5(**fields):
  return _qwen3_next(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig,
                     **{k: None for k in _DENSE}, **fields)


@pytest.mark.parametrize("generation", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_qwen3_5_text_in_and_out(tok, tmp_path, generation):
  """Qwen3_5ForCausalLM (Gated DeltaNet's unfused in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a; dense MLPs; multimodal RoPE fields that text leaves
  plain): logits and export (fast), generation (slow)."""
  rope = dict(_TINY["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True)
  m = _in_and_out(_qwen3_5(rope_parameters=rope), tok, tmp_path, generation)
  assert (m.num_experts, tuple(m.layer_types)) == (
      0, ("linear_attention",) * 3 + ("full_attention",))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert exported["model_type"] == "qwen3_5_text"


def test_qwen3_5_moe_text_in_and_out(tok, tmp_path):
  """Qwen3_5MoeForCausalLM: experts with the gated shared expert in every
  layer, renormalised; exported as Qwen3-Next (the same function)."""
  hf_model = _qwen3_next(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig,
                         intermediate_size=None)
  m = _in_and_out(hf_model, tok, tmp_path, generation=False,
                  exported_as=transformers.Qwen3NextForCausalLM)
  assert (tuple(m.layer_types), m.num_shared_experts, m.moe_router) == (
      ("linear_attention+moe",) * 3 + ("full_attention+moe",), 2, "softmax_topk_norm")
  cfg = ModelConfig.resolve(m)
  assert hf_convert.round_trip_mismatch(hf_mappings.ARCHITECTURES["qwen3_5_moe_text"], cfg) == ""


_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)


@pytest.mark.parametrize("generation", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_qwen3_5_multimodal_language_model(tok, tmp_path, generation):
  """A Qwen3_5ForConditionalGeneration directory (as Qwen/Qwen3.5-* are
  published): its language model imported, the vision tower read past; text
  logits (and generation) as transformers' multimodal model gives them; the
  export is the text model."""
  text = {k: v for k, v in _TINY.items() if k not in _DENSE}
  torch.manual_seed(0)
  hf_model = transformers.Qwen3_5ForConditionalGeneration(
      transformers.Qwen3_5Config(text_config=text, vision_config=_VISION))
  with torch.no_grad():
    for key, parameter in hf_model.named_parameters():
      if "language_model" in key or key.startswith("lm_head"):
        torch.nn.init.normal_(parameter, mean=float(key.endswith("linear_attn.norm.weight")),
                              std=0.3)
  m = _in_and_out(hf_model.eval(), tok, tmp_path, generation,
                  exported_as=transformers.Qwen3_5ForCausalLM)
  assert (m.num_experts, m.attention_output_gate) == (0, True)


def test_shortest_cycle():
  assert shortest_cycle(["a", "b", "a", "b"]) == ("a", "b")
  assert shortest_cycle(["a", "a", "b", "a", "a", "b", "a"]) == ("a", "a", "b")
  assert shortest_cycle(["a", "b", "b"]) == ("a", "b", "b")


@pytest.mark.parametrize("field,value,message", [
    ("shared_expert_intermediate_size", 12, "shared_expert_intermediate_size=12 is not "
     "supported by the qwen3_next import (needs a positive multiple"),
    ("attention_bias", True, "attention_bias=True is not supported by the qwen3_next import"),
    ("layer_types", ["sliding_attention"] * 4, "layer_types=['sliding_attention'"),
])
def test_bad_config_is_refused_by_name(field, value, message):
  hf = dict(_TINY, model_type="qwen3_next", **{field: value})
  with pytest.raises(UserError) as e:
    hf_mappings.ARCHITECTURES["qwen3_next"].config_from_hf(hf)
  assert message in str(e.value)


def test_export_check_names_what_qwen3_next_does_not_map():
  """A Qwen3-Next config takes no other architecture, and Qwen3-Next takes
  nothing it does not map: a sliding window, an ungated attention output."""
  config = base_config.get_config()
  config.model.update(_from_tiny())
  cfg = ModelConfig.resolve(config.model)
  assert hf_convert.export_architecture(cfg).model_type == "qwen3_next"
  arch = hf_mappings.ARCHITECTURES["qwen3_next"]
  for field, value, named in [("attention_output_gate", False, "attention_output_gate"),
                              ("norm", "rmsnorm", "norm"),
                              ("moe_shared_expert_gate", False, "moe_shared_expert_gate")]:
    changed = base_config.get_config()
    changed.model.update(_from_tiny(), **{field: value})
    reason = hf_convert.round_trip_mismatch(arch, ModelConfig.resolve(changed.model))
    assert reason.startswith(f"model.{named}="), reason
  assert hf_convert.round_trip_mismatch(hf_mappings.ARCHITECTURES["qwen3_moe"], cfg)


def _from_tiny():
  return hf_mappings.ARCHITECTURES["qwen3_next"].config_from_hf(dict(_TINY,
                                                                     model_type="qwen3_next"))


# Qwen/Qwen3-Next-80B-A3B's published config.json (its model fields).
_80B_JSON = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                 head_dim=256, hidden_act="silu", max_position_embeddings=262144,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                 rope_theta=10000000.0, partial_rotary_factor=0.25, full_attention_interval=4,
                 linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                 mlp_only_layers=[])


def _check_preset(preset, hf_json: dict, model_type: str, hf_class, hf_config) -> int:
  """Asserts that `preset`'s closed-form count is its module's and that it
  is the import of `hf_json`, field for field; returns the count of
  transformers' `hf_class` of that config (built on the meta device), equal
  to the preset's."""
  with torch.device("meta"):
    hf_model = hf_class(hf_config(**hf_json))
  theirs = sum(p.numel() for p in hf_model.parameters())
  config = preset.get_config()
  accounting.check_formula(config.model)
  assert accounting.formula_params(config.model)["params_total"] == theirs
  imported = base_config.get_config()
  imported.model.update(hf_mappings.ARCHITECTURES[model_type].config_from_hf(
      dict(hf_json, model_type=model_type)))
  ours = ModelConfig.resolve(config.model).forward_fields()
  assert ModelConfig.resolve(imported.model).forward_fields() == ours
  return theirs


def test_80b_a3b_preset_counts_as_transformers():
  """configs/qwen3_next_80b_a3b.py: our closed form, the module's count and
  transformers' Qwen3NextForCausalLM of the published config agree,
  79,674,391,296; the preset is the import of that config.json."""
  assert _check_preset(qwen3_next_80b_a3b, _80B_JSON, "qwen3_next",
                       transformers.Qwen3NextForCausalLM,
                       transformers.Qwen3NextConfig) == 79_674_391_296


# Qwen/Qwen3.5-9B's language model: transformers' Qwen3_5TextConfig defaults
# (the "Qwen3.5-9B style configuration") with the model card's RoPE base and
# context length (configs/qwen3_5_9b.py says why).
_9B_JSON = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                head_dim=256, hidden_act="silu", max_position_embeddings=262144,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                     partial_rotary_factor=0.25),
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32)


def test_qwen3_5_9b_preset_counts_as_transformers():
  """configs/qwen3_5_9b.py: our closed form, the module's count and
  transformers' Qwen3_5ForCausalLM agree, 8,953,803,264; the config's sizes
  are Qwen3_5TextConfig's defaults; the preset is the import of it."""
  defaults = transformers.Qwen3_5TextConfig().to_dict()
  assert all(defaults[k] == v for k, v in _9B_JSON.items()
             if k not in ("max_position_embeddings", "rope_parameters"))
  assert _check_preset(qwen3_5_9b, _9B_JSON, "qwen3_5_text", transformers.Qwen3_5ForCausalLM,
                       transformers.Qwen3_5TextConfig) == 8_953_803_264
