"""DeepSeek-V2 and DeepSeek-V3 checkpoints through convert.py, against
transformers (hf/deepseek.py).

- Import: tiny random DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (dense
  first layer, then experts with a shared expert; query latents or direct
  queries; DeepSeek's yarn with mscale; biases; V3's group-limited router
  with a non-zero selection bias) give our logits within 1e-4 of the largest
  (float32) and greedy generation token for token; V3's multi-token
  prediction layers are read past, its selection bias is the router's.
- Export: transformers loads the run back to the same logits; the config
  comes back through config.json field for field.
- DeepSeek-V3 (configs/deepseek_v3.py): our parameter counts, total and
  active per token, equal transformers' DeepseekV3ForCausalLM's on the meta
  device (active from its modules' shapes).
- What is not supported is one line.
"""
import json

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx

from configs import base as base_config
from configs import deepseek_v3
from configs.errors import UserError
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from model import accounting
from model.config import ModelConfig
from model.generate import generate
from training.workdir import load_run
from tests.helpers import assert_close, convert_error_line, edit_hf_config, run_convert, save_hf

pytestmark = pytest.mark.hf  # transformers and torch

PROMPTS = ["def add(", "class "]
_TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=10,
             kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
             first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, max_position_embeddings=64)
# DeepSeek's yarn: cos and sin times mscale(4, 1) / mscale(4, 0.8), the softmax
# scale times mscale(4, 0.8)^2.
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
             original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8)


def _deepseek(version: int, **fields):
  """A tiny random DeepSeek-V`version` (`_TINY` and `fields`): every weight
  normal (norms around 1) so that a misplaced tensor shows; V3's selection
  bias drawn too, so that it changes the routing."""
  torch.manual_seed(0)
  name = f"DeepseekV{version}"
  config = getattr(transformers, name + "Config")(**{**_TINY, **fields})
  hf_model = getattr(transformers, name + "ForCausalLM")(config)
  with torch.no_grad():
    for key, parameter in hf_model.named_parameters():
      torch.nn.init.normal_(parameter, mean=float(key.endswith("norm.weight")), std=0.3)
    for key, buffer in hf_model.named_buffers():
      if key.endswith("e_score_correction_bias"):
        torch.nn.init.normal_(buffer, std=0.3)
  return hf_model.eval()


def _ids(tok):
  return np.asarray([tok.encode_with_specials(p + "x = 1") for p in PROMPTS[:1]] * 2)


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids)).logits.float().numpy()


def _in_and_out(hf_model, tok, tmp_path, hf_dir=None, generation=True, scan_layers=None):
  """from_hf (into `scan_layers`' layout): transformers' parameter count, the
  logits and (with `generation`) greedy generation are transformers'; to_hf:
  transformers loads it back to the same logits. The run's (config, model)."""
  hf_dir = hf_dir or save_hf(hf_model, tok, tmp_path / "hf")
  workdir = tmp_path / "run"
  count = hf_convert.from_hf(hf_dir, str(workdir), scan_layers=scan_layers)  # buffers aside
  assert count == sum(p.numel() for p in hf_model.parameters())
  config, _, model, _ = load_run(str(workdir))
  ids = _ids(tok)
  want = _hf_logits(hf_model, ids)
  assert_close(nnx.jit(lambda m, x: m(x))(model, ids), want)
  prompts = [tok.encode_with_specials(p) for p in PROMPTS] if generation else []
  ours = generate(model, config.model, prompts, max_new_tokens=8, eos_id=-1) if prompts else []
  for prompt, new in zip(prompts, ours):
    with torch.no_grad():
      theirs = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    assert new == theirs[0, len(prompt):].tolist()
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported) is type(hf_model)
  assert_close(_hf_logits(exported, ids), want)
  return config.model, model


def _with_mtp_layer(hf_dir, layers: int):
  """DeepSeek-V3's file layout: a multi-token-prediction layer stored as
  layer `layers` (its projection, norms and head; transformers has none)."""
  path = hf_dir / "model.safetensors"
  tensors = safetensors.numpy.load_file(str(path))
  mtp = f"model.layers.{layers}."
  tensors.update({mtp + "eh_proj.weight": np.ones((32, 64), np.float32),
                  mtp + "enorm.weight": np.ones(32, np.float32),
                  mtp + "shared_head.head.weight": np.ones((320, 32), np.float32)})
  safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def _with_full_mtp_layer(hf_model, hf_dir, layers: int) -> dict:
  """DeepSeek-V3's multi-token-prediction module as its files hold it, layer
  `layers` in DeepSeek's tensor names, random: `enorm`, `hnorm`, `eh_proj`,
  a decoder layer shaped as the last one (experts, selection bias, shared
  expert), `shared_head.norm`, and copies of the embedding and head
  (`embed_tokens`, `shared_head.head`). Returns the file's tensors."""
  path = hf_dir / "model.safetensors"
  tensors = safetensors.numpy.load_file(str(path))
  gen = np.random.default_rng(5)
  mtp, last = f"model.layers.{layers}.", f"model.layers.{layers - 1}."
  d = hf_model.config.hidden_size
  norm = lambda shape: (1.0 + 0.3 * gen.normal(size=shape)).astype(np.float32)
  for name, value in list(tensors.items()):
    if name.startswith(last):
      mean = 1.0 if name.endswith("norm.weight") else 0.0
      tensors[mtp + name[len(last):]] = (mean + 0.3 * gen.normal(size=value.shape)).astype(
          np.float32)
  tensors.update({mtp + "enorm.weight": norm(d), mtp + "hnorm.weight": norm(d),
                  mtp + "eh_proj.weight": (0.3 * gen.normal(size=(d, 2 * d))).astype(np.float32),
                  mtp + "shared_head.norm.weight": norm(d),
                  mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
                  mtp + "shared_head.head.weight": tensors["lm_head.weight"]})
  safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
  edit_hf_config(hf_dir, num_nextn_predict_layers=1)
  return tensors


def _deepseek_mtp_logits(hf_model, tensors, layers: int, ids, tmp_path):
  """DeepSeek-V3's module 1 on `ids`, written out in torch: h^0 the main
  model's final hidden states, e the embedding of token i+1, eh_proj
  [enorm(e); hnorm(h^0)], the layer (transformers' DeepseekV3DecoderLayer,
  loaded from the layer's tensors as layer `layers` of a model one layer
  deeper), shared_head.norm, shared_head.head. [B, T - 1, V]: the last
  position reads past the row."""
  mtp = f"model.layers.{layers}."
  own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
  deeper = tmp_path / "deeper"
  deeper.mkdir()
  safetensors.numpy.save_file({k: v for k, v in tensors.items()
                               if not k.startswith(tuple(mtp + o for o in own))},
                              str(deeper / "model.safetensors"), metadata={"format": "pt"})
  config = hf_model.config.to_dict()
  config.update(num_hidden_layers=layers + 1)
  (deeper / "config.json").write_text(json.dumps(config))
  ref = transformers.AutoModelForCausalLM.from_pretrained(deeper,
                                                          attn_implementation="eager").eval()
  t = lambda name: torch.from_numpy(np.array(tensors[mtp + name]))

  def rms(x, scale):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf_model.config.rms_norm_eps)
    return x * scale

  ids = torch.as_tensor(ids)
  B, T = ids.shape
  with torch.no_grad():
    h0 = hf_model.model(ids).last_hidden_state
    e = hf_model.model.embed_tokens(ids[:, 1:])
    x = torch.cat([rms(e, t("enorm.weight")), rms(h0[:, :-1], t("hnorm.weight"))], -1)
    x = x @ t("eh_proj.weight").T
    positions = torch.arange(T - 1)[None].expand(B, -1)
    mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
    out = ref.model.layers[layers](x, attention_mask=mask, position_ids=positions,
                                   position_embeddings=ref.model.rotary_emb(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    return (rms(out, t("shared_head.norm.weight")) @ t("shared_head.head.weight").T).numpy()


def test_v3_mtp_layer_imports_as_the_module_and_exports_back(tok, tmp_path, capsys):
  """A V3 file with its MTP layer (layer L in DeepSeek's names, experts in
  it): the import is a run with train.mtp_depth=1 whose module's logits are
  DeepSeek's module written out (join order, MoE block with its selection
  bias, shared head); the export writes every tensor of the file back as it
  was (the copies of the embedding and head too) with
  num_nextn_predict_layers 1, and imports again to the same module. An MTP
  layer whose shapes disagree with config.json is one line."""
  layers = _TINY["num_hidden_layers"]
  hf_model = _deepseek(3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
  hf_dir = tmp_path / "hf"
  save_hf(hf_model, tok, hf_dir)
  tensors = _with_full_mtp_layer(hf_model, hf_dir, layers)
  assert run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run") == 0
  config, _, model, _ = load_run(str(tmp_path / "run"))
  assert config.train.mtp_depth == 1
  ids = _ids(tok).astype(np.int32)
  hidden = model.hidden(ids)
  got = np.asarray(model.mtp_logits(hidden, ids)[0])[:, :-1]
  want = _deepseek_mtp_logits(hf_model, tensors, layers, ids, tmp_path)
  assert_close(got, want)
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", tmp_path / "run", "--out", out) == 0
  exported = safetensors.numpy.load_file(str(out / "model.safetensors"))
  assert sorted(exported) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
  assert run_convert("from_hf", "--hf_dir", out, "--workdir", tmp_path / "again") == 0
  _, _, again, _ = load_run(str(tmp_path / "again"))
  np.testing.assert_array_equal(np.asarray(again.mtp_logits(again.hidden(ids), ids)[0]),
                                np.asarray(model.mtp_logits(hidden, ids)[0]))
  bad = {**tensors, f"model.layers.{layers}.eh_proj.weight": np.zeros((32, 32), np.float32)}
  safetensors.numpy.save_file(bad, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
  err = convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "bad")
  assert f"tensor model.layers.{layers}.eh_proj.weight has shape (32, 32), config.json " \
         "implies (32, 64)" in err
  assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("generation,scan", [(False, True),
                                             pytest.param(True, None, marks=pytest.mark.slow)])
def test_deepseek_v3_in_and_out(tok, tmp_path, generation, scan):
  """DeepseekV3ForCausalLM: a dense layer, then 8 experts (top 2 of the best
  2 of 4 groups, scaled by 2.5, a selection bias) with a shared expert;
  query latents, biases, yarn with mscale; config.json's MTP layer, which
  transformers' file has not, read past; the selection bias lands in
  `score_bias`. The exported config.json
  imports back to the same config. Into scanned runs of layers (the dense
  one, the MoE ones: `--scan_layers`), and into the loop with greedy
  generation (slow)."""
  hf_model = _deepseek(3, attention_bias=True, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5, rope_parameters=_YARN)
  hf_dir = tmp_path / "hf"
  save_hf(hf_model, tok, hf_dir)
  m, model = _in_and_out(hf_model, tok, tmp_path, str(hf_dir), generation, scan)
  assert ModelConfig.resolve(m).scan_layers is bool(scan)
  assert (m.attention, m.num_experts, m.experts_per_token, m.moe_d_ff, m.num_shared_experts,
          tuple(m.moe_layers), m.moe_router, m.moe_n_group, m.moe_topk_group,
          m.moe_routed_scaling_factor) == ("mla", 8, 2, 16, 1, (1,), "deepseek", 4, 2, 2.5)
  np.testing.assert_array_equal(  # e_score_correction_bias: the router's selection bias
      np.asarray(model.decoder.block(1).mlp.score_bias[...]),
      hf_model.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
  assert (m.q_lora_rank, m.qkv_bias, m.out_bias, m.rope_scaling) == (10, True, True, "yarn")
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["first_k_dense_replace"],
          exported["num_nextn_predict_layers"]) == ("deepseek_v3", 1, 0)
  back = base_config.get_config()
  back.model.update(**{"family": "decoder",
                       **hf_mappings.ARCHITECTURES["deepseek_v3"].config_from_hf(exported)})
  assert (ModelConfig.resolve(back.model).forward_fields()
          == ModelConfig.resolve(m).forward_fields())


@pytest.mark.slow  # V2's complex-number RoPE
def test_deepseek_v2_lite_in_and_out(tok, tmp_path):
  """DeepseekV2ForCausalLM as V2-Lite: direct queries (no q_lora_rank),
  greedy softmax top 2 of 8 experts, not renormalised, two shared experts."""
  hf_model = _deepseek(2, q_lora_rank=None, n_shared_experts=2, topk_method="greedy")
  m, _ = _in_and_out(hf_model, tok, tmp_path)
  assert (m.q_lora_rank, m.num_shared_experts, m.moe_router) == (None, 2, "softmax_topk")
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == (
      "deepseek_v2")


@pytest.mark.slow
def test_deepseek_v3_dense_tied(tok, tmp_path):
  """Every layer dense (first_k_dense_replace = the layers), tied embeddings,
  direct queries, no yarn."""
  hf_model = _deepseek(3, first_k_dense_replace=2, q_lora_rank=None, tie_word_embeddings=True)
  m, _ = _in_and_out(hf_model, tok, tmp_path)
  assert (m.num_experts, m.tie_embeddings, m.rope_scaling) == (0, True, "none")


# config.json of deepseek-ai/DeepSeek-V3 (its fp8 quantization_config aside,
# refused below) and deepseek-ai/DeepSeek-V2-Lite (auto_map aside).
_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280}
_V2_LITE_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 102400}


def _resolved(fields: dict) -> ModelConfig:
  config = base_config.get_config()
  config.model.update(**{"family": "decoder", **fields})
  return ModelConfig.resolve(config.model)


def test_published_configs_import_and_export_as_themselves():
  """DeepSeek-V3's config.json is configs/deepseek_v3.py's model (its yarn
  too), and exports as deepseek_v3; V2-Lite's imports with softmax_topk and
  exports as deepseek_v2; both come back through config.json unchanged."""
  v3 = _resolved(hf_mappings.architecture_of(_V3_JSON).config_from_hf(_V3_JSON))
  preset = ModelConfig.resolve(deepseek_v3.get_config().model)
  assert v3.forward_fields() == preset.forward_fields()
  assert (v3.rope_attention_factor, round(v3.attention_scale, 4)) == (1.0, 0.1352)
  v2 = _resolved(hf_mappings.architecture_of(_V2_LITE_JSON).config_from_hf(_V2_LITE_JSON))
  assert (v2.moe_router, v2.q_lora_rank, tuple(v2.moe_layers)) == (
      "softmax_topk", 0, tuple(range(1, 27)))
  for cfg, name in ((v3, "deepseek_v3"), (v2, "deepseek_v2")):
    assert hf_convert.export_architecture(cfg).model_type == name


def test_export_of_mla_models_names_what_deepseek_cannot_hold():
  """A dense MLA model exports as DeepSeek-V3; experts only in some middle
  layers (DeepSeek's are the layers from first_k_dense_replace on) are named."""
  config = base_config.get_config()
  config.model.update(attention="mla", q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, tie_embeddings=False)
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == (
      "deepseek_v3")
  config.model.update(num_layers=3, num_experts=4, moe_layers=(1,), moe_router="deepseek")
  with pytest.raises(UserError, match=r"deepseek_v3: model.moe_layers=\(1,\) \(needs \(2,\)\)"):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))


def test_group_mask_fill_exports_as_transformers_routes():
  """transformers' DeepseekV3TopkRouter never chooses a masked group's expert
  (`moe_group_mask_fill="-inf"`): a V3 config imports as "-inf", and a run
  of the older fill "0" is refused by name (transformers would route it
  otherwise)."""
  v3 = hf_mappings.ARCHITECTURES["deepseek_v3"]
  config = base_config.get_config()
  config.model.update(attention="mla", q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, tie_embeddings=False, num_experts=8,
                      moe_router="deepseek", moe_n_group=4, moe_topk_group=2)
  cfg = ModelConfig.resolve(config.model)
  assert v3.config_from_hf(v3.config_to_hf(cfg, cfg.vocab_size))["moe_n_group"] == 4
  assert cfg.moe_group_mask_fill == "-inf"
  assert hf_convert.round_trip_mismatch(v3, cfg) == ""
  config.model.moe_group_mask_fill = "0"
  assert hf_convert.round_trip_mismatch(v3, ModelConfig.resolve(config.model)) == (
      "model.moe_group_mask_fill='0' (needs '-inf')")


@pytest.mark.parametrize("version,change,message", [
    (3, dict(norm_topk_prob=False), "norm_topk_prob=False is not supported by the deepseek_v3 "
     "import (model.moe_router=deepseek renormalises"),
    (3, dict(rope_interleave=False), "rope_interleave=False is not supported by the "
     "deepseek_v3 import (needs True)"),
    (3, dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported by the "
     "deepseek_v3 import (needs num_attention_heads=128"),
    (3, dict(quantization_config={"quant_method": "fp8"}), "quantization_config="),
    (3, dict(topk_method="greedy"), "topk_method='greedy' is not supported by the deepseek_v3 "
     "import (needs 'noaux_tc')"),
    (2, dict(topk_method="group_limited_greedy", n_group=8, topk_group=3),
     "topk_method='group_limited_greedy' is not supported by the deepseek_v2 import (greedy "
     "is"),
    (2, dict(routed_scaling_factor=16.0), "routed_scaling_factor=16.0 is not supported by the "
     "deepseek_v2 import (needs 1.0"),
    (2, dict(norm_topk_prob=True), "norm_topk_prob=True is not supported by the deepseek_v2 "
     "import (transformers' DeepseekV2 never renormalises"),
    (2, dict(mlp_bias=True), "mlp_bias=True is not supported by the deepseek_v2 import"),
])
def test_unsupported_fields_are_refused_by_name(version, change, message):
  hf = {**(_V3_JSON if version == 3 else _V2_LITE_JSON), **change}
  with pytest.raises(UserError, match="^Hugging Face config field " + message.replace(
      "(", r"\(").replace(")", r"\)")):
    hf_mappings.architecture_of(hf).config_from_hf(hf)


def test_refusals_are_one_line_and_write_nothing(tok, tmp_path, capsys):
  """convert.py from_hf: an unsupported router, and a weight past the MTP
  layers that config.json declares, are one line each; no workdir."""
  hf_dir = tmp_path / "hf"
  save_hf(_deepseek(2, q_lora_rank=None), tok, hf_dir)
  edit_hf_config(hf_dir, topk_method="group_limited_greedy", n_group=4, topk_group=2)
  err = convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "a")
  assert "topk_method='group_limited_greedy' is not supported by the deepseek_v2" in err
  v3_dir = tmp_path / "v3"
  save_hf(_deepseek(3, n_group=4, topk_group=2), tok, v3_dir)
  _with_mtp_layer(v3_dir, 2)
  edit_hf_config(v3_dir, num_nextn_predict_layers=0)
  err = convert_error_line(capsys, "from_hf", "--hf_dir", v3_dir, "--workdir", tmp_path / "b")
  assert "tensor model.layers.2." in err and "is not used by the deepseek_v3 mapping" in err
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_deepseek_v3_parameter_counts_match_transformers():
  """configs/deepseek_v3.py: `params_total` is transformers' count of
  DeepseekV3ForCausalLM with V3's config (built on the meta device: nothing
  allocated; its selection biases are buffers, not parameters), and
  `params_active` is that less, in each MoE layer, the E - k routed experts a
  token skips, their size read off transformers' expert tensors: embeddings,
  attention, dense layers, shared experts, the router and k experts."""
  hf = transformers.DeepseekV3Config(**{k: v for k, v in _V3_JSON.items()
                                         if k not in ("torch_dtype", "transformers_version")})
  with torch.device("meta"):
    model = transformers.DeepseekV3ForCausalLM(hf)
  total = sum(p.numel() for p in model.parameters())
  experts = model.model.layers[hf.first_k_dense_replace].mlp.experts
  per_expert = sum(p.numel() for p in experts.parameters()) // hf.n_routed_experts
  moe_layers = hf.num_hidden_layers - hf.first_k_dense_replace
  active = total - moe_layers * (hf.n_routed_experts - hf.num_experts_per_tok) * per_expert
  ours = accounting.formula_params(deepseek_v3.get_config().model)
  assert (ours["params_total"], ours["params_active"]) == (total, active) == (
      671_026_404_352, 37_552_282_624)
  # The published 671B total and 37B activated (the 14B MTP module aside).
  assert (total // 10**9, active // 10**9) == (671, 37)
