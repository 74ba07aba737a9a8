"""convert.py against `transformers` itself: tiny random models, both ways.

Each case builds a tiny random-initialised `transformers` model (nothing is
downloaded), saves it with a tokenizer, imports it with `convert.py from_hf`,
loads the run with `training.workdir.load_run` and compares float32 logits
(within 1e-4 of the largest logit) and greedy KV-cache generation token for
token; then exports it with `convert.py to_hf` and loads that with
`transformers` to the same logits and tokenizer ids.
"""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from configs import base as base_config
from configs import bert_base
from configs import from_run
from configs.errors import UserError
from model.config import ModelConfig
from model.generate import generate
from model.transformer import PADDED_LOGIT
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from training import workdir as workdir_lib
from training.workdir import load_run
from training.objectives import cross_entropy_sums
from tests.helpers import (assert_close, both_splits, convert_error_line, edit_hf_config,
                           python_on_cpu_devices, randomised, run_command, run_convert, save_hf,
                           tiny_gpt2, tiny_llama)

pytestmark = pytest.mark.hf  # transformers and torch

PROMPTS = ["def add(", "class "]


def _bert(**kw):
  return transformers.BertForMaskedLM(transformers.BertConfig(**{**dict(
      vocab_size=320, hidden_size=32, num_attention_heads=4, intermediate_size=48,
      num_hidden_layers=2, max_position_embeddings=64), **kw}))


def _ids(tok):
  return np.asarray([tok.encode_with_specials(p + "x = 1") for p in PROMPTS[:1]] * 2)


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids)).logits.float().numpy()


def _check_import(hf_model, tok, tmp_path, generation=True, **save_kw):
  """from_hf, then logits and (decoders) greedy generation against `hf_model`;
  the run dir."""
  hf_model.eval()
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf_model, tok, tmp_path / "hf", **save_kw),
                     "--workdir", workdir) == 0
  config, run_tok, model, step = load_run(str(workdir))
  assert step == 0 and run_tok.encode("def f") == tok.encode("def f")
  ids = _ids(tok)
  assert_close(model(ids), _hf_logits(hf_model, ids))
  if not generation:
    return workdir
  prompts = [tok.encode_with_specials(p) for p in PROMPTS]
  ours = generate(model, config.model, prompts, max_new_tokens=8, eos_id=-1)
  for prompt, new in zip(prompts, ours):
    with torch.no_grad():
      theirs = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    assert new == theirs[0, len(prompt):].tolist()
  return workdir


def _check_export(workdir, tok, tmp_path, reference, auto_class="AutoModelForCausalLM"):
  """to_hf, loaded by transformers: the same logits (on the tokenizer's ids) and ids."""
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = getattr(transformers, auto_class).from_pretrained(out).eval()
  ids = _ids(tok)
  assert_close(_hf_logits(exported, ids), reference[..., :exported.config.vocab_size])
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok("def add(a, b)")["input_ids"] == tok.encode_with_specials("def add(a, b)")


def test_gpt2_in_and_out(tok, tmp_path):
  """Every row comes back: the checkpoint's 320, past the tokenizer's 290 (as
  T5's 32,128 for 32,100 ids), with their logits unchanged."""
  hf_model = tiny_gpt2()
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["vocab_size"], tok.vocab_size) == (320, 290)
  # The config to fine-tune it with: the run's own.
  assert (from_run.get_config(str(workdir)).model.to_dict()
          == workdir_lib.load_config(str(workdir)).model.to_dict())


def test_gpt2_padded_on_import(tok, tmp_path):
  """A 290-row GPT-2 imported with --pad_vocab_to_multiple 64: 320 rows, the
  30 padded ones masked (model.real_vocab_size=290). The real ids' logits and
  the loss are transformers' (so those of the unpadded import), no sampled id
  is a padded one, and the export is transformers' 290-row model again."""
  hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=290, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf_model, tok, tmp_path / "hf"), "--workdir",
                     workdir, "--pad_vocab_to_multiple", 64) == 0
  config, _, model, _ = load_run(str(workdir))
  assert (config.model.vocab_size, config.model.real_vocab_size) == (320, 290)
  assert model.decoder.embed.embedding.shape == (320, 32)
  ids = _ids(tok)
  ours, theirs = np.asarray(model(ids)), _hf_logits(hf_model, ids)
  assert_close(ours[..., :290], theirs)
  assert (ours[..., 290:] == PADDED_LOGIT).all()
  targets, weights = np.roll(ids, -1, axis=1), np.ones(ids.shape, np.float32)
  loss, _, _ = cross_entropy_sums(jnp.asarray(ours), targets, weights)
  want, _, _ = cross_entropy_sums(jnp.asarray(theirs), targets, weights)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  sampled = generate(model, config.model, [tok.encode_with_specials(p) for p in PROMPTS],
                     max_new_tokens=16, temperature=100.0)
  assert max(max(new) for new in sampled) < 290
  _check_export(workdir, tok, tmp_path, theirs)
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["vocab_size"] == 290


@pytest.mark.slow
def test_llama_gqa_head_dim_in_and_out(tok, tmp_path):
  """GQA (4 query heads, 2 KV heads) with head_dim 16 != d/h = 8, untied head."""
  hf_model = tiny_llama(head_dim=16)
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(num_key_value_heads=4),  # MHA
    dict(num_key_value_heads=1, tie_word_embeddings=True),  # MQA, tied
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
])
def test_llama_variants(tok, tmp_path, kw):
  hf_model = tiny_llama(**kw)
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))


@pytest.mark.slow
def test_mistral_sharded(tok, tmp_path):
  """Mistral (no sliding window), saved in several safetensors shards with an index."""
  hf_model = tiny_llama(transformers.MistralForCausalLM, transformers.MistralConfig,
                    sliding_window=None)
  _check_import(hf_model, tok, tmp_path, max_shard_size="20KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_import_onto_a_sharded_mesh(tok, tmp_path):
  """convert.py on 4 (host) devices with mesh fsdp=2, tensor=2: the weights are
  placed in their shards as read; the run has the same logits."""
  hf_model = tiny_llama().eval()
  result = python_on_cpu_devices(
      ["convert.py", "from_hf", "--hf_dir", save_hf(hf_model, tok, tmp_path / "hf"),
       "--workdir", tmp_path / "run", "--fsdp", "2", "--tensor", "2"], 4)
  assert result.returncode == 0, result.stderr[-2000:]
  config, _, model, _ = load_run(str(tmp_path / "run"))
  assert (config.mesh.fsdp, config.mesh.tensor) == (2, 2)
  ids = _ids(tok)
  assert_close(model(ids), _hf_logits(hf_model, ids))


@pytest.mark.slow
def test_bfloat16(tok, tmp_path):
  """A bfloat16 checkpoint imports as bfloat16 parameters and exports as bfloat16."""
  hf_model = tiny_llama().to(torch.bfloat16)
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf_model, tok, tmp_path / "hf"),
                     "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  assert config.model.param_dtype == "bfloat16"
  ids = _ids(tok)
  theirs = _hf_logits(hf_model, ids)
  np.testing.assert_array_less(np.abs(np.asarray(model(ids)) - theirs).max(),
                               0.05 * np.abs(theirs).max())
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert exported.dtype == torch.bfloat16
  for name, param in hf_model.state_dict().items():  # every row, past the tokenizer's 290
    assert torch.equal(exported.state_dict()[name], param), name


@pytest.mark.parametrize("change, message", [
    (lambda d: os.remove(d / "model.safetensors"), "no model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"damaged"), "cannot read"),
    (lambda d: edit_hf_config(d, model_type="mamba"), "model_type 'mamba' is not supported"),
    (lambda d: edit_hf_config(d, activation_function="relu"), "activation_function='relu'"),
    (lambda d: edit_hf_config(d, unknown_field=1), "unknown_field=1"),
    (lambda d: edit_hf_config(d, n_embd=64), "has shape"),
    (lambda d: os.remove(d / "tokenizer.json"), "no tokenizer.json"),
])
def test_bad_hf_dir(tok, tmp_path, capsys, change, message):
  hf_dir = tmp_path / "hf"
  save_hf(tiny_gpt2(), tok, hf_dir)
  change(hf_dir)
  assert message in convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                       tmp_path / "run")
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_run_refuses_a_tokenizer_past_the_real_vocabulary(tok, tmp_path):
  """Its ids past model.real_vocab_size would have masked logits."""
  tok.save(tmp_path / "tok")
  config = base_config.get_config()
  config.model.update(vocab_size=320, real_vocab_size=280)
  config.tokenizer.path = str(tmp_path / "tok")
  with pytest.raises(UserError, match="the tokenizer has 290 ids but model.real_vocab_size=280; "
                                      "raise model.real_vocab_size"):
    workdir_lib.setup_tokenizer(config, str(tmp_path / "run"))


def test_bad_pad_vocab_to_multiple(tok, tmp_path, capsys):
  assert "--pad_vocab_to_multiple 0: must be a positive integer" in convert_error_line(
      capsys, "from_hf", "--hf_dir", save_hf(tiny_gpt2(), tok, tmp_path / "hf"), "--workdir",
      tmp_path / "run", "--pad_vocab_to_multiple", "0")
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_llama_refuses_unsupported_fields(tok, tmp_path, capsys):
  for kw, message in [(dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                             "rope_theta": 1e4}), "rope_type='dynamic'"),
                      (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                             "original_max_position_embeddings": 16,
                                             "rope_theta": 1e4}), "rope_parameters.mscale=0.7"),
                      (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 16,
                                             "rope_theta": 1e4}),
                       "rope_parameters.low_freq_factor is missing"),
                      (dict(attention_bias=True), "attention_bias=True")]:
    hf_dir = tmp_path / "hf"
    save_hf(tiny_llama(), tok, hf_dir)
    edit_hf_config(hf_dir, **kw)
    assert message in convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                         tmp_path / "run")


@pytest.mark.slow
def test_commands_import_evaluate_finetune_export(tok, tmp_path):
  """docs/huggingface.md's worked example with the real commands: convert.py from_hf,
  eval.py, train.py from the imported run, convert.py to_hf of the fine-tune."""
  for i in range(both_splits(lambda i: str(tmp_path / f"doc{i}.txt"), 60, 9)):
    (tmp_path / f"doc{i}.txt").write_text(f"def f{i}(a, b):\n    return a + b * {i}\n")

  run_command("convert.py", "from_hf", "--hf_dir", save_hf(tiny_gpt2(), tok, tmp_path / "hf"),
      "--workdir", tmp_path / "run")
  run_command("eval.py", "--workdir", tmp_path / "run", "--data", tmp_path / "doc0.txt",
      "--prompt", "def ", "--max_new_tokens", "4", "--score")
  other_data = tmp_path / "run" / "eval" / "step_0_data-doc0.txt"  # a folder of its own
  assert json.loads((other_data / "eval_report.json").read_text())["step"] == 0
  run_command("train.py", f"--config=configs/from_run.py:{tmp_path / 'run'}",
      f"--config.train.restore_from={tmp_path / 'run'}", "--workdir", tmp_path / "ft",
      "--config.train.num_steps=2", "--config.data.source=files",
      f"--config.data.paths={tmp_path}/doc*.txt", "--config.data.val_percent=60",
      "--config.train.batch_size=2", "--config.train.seq_len=16", "--config.train.eval_steps=1",
      "--config.train.warmup_steps=1")
  run_command("convert.py", "to_hf", "--workdir", tmp_path / "ft", "--out", tmp_path / "ft_hf")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft_hf").eval()
  _, _, model, step = load_run(str(tmp_path / "ft"))
  assert step == 2
  ids = _ids(tok)
  assert_close(_hf_logits(exported, ids), model(ids))


def test_llama_config_fields_old_and_new_rope_forms():
  """transformers 5's rope_parameters and the earlier rope_theta/rope_scaling
  give the same fields; what remains in either is refused by name."""
  base = dict(model_type="llama", hidden_size=32, num_attention_heads=4)
  llama = hf_mappings.ARCHITECTURES["llama"]
  new = llama.config_from_hf({**base, "rope_parameters": {
      "rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}})
  old = llama.config_from_hf({**base, "rope_theta": 500.0,
                              "rope_scaling": {"type": "linear", "factor": 4.0}})
  assert new == old and (new["rope_scaling"], new["rope_scaling_factor"]) == ("linear", 4.0)
  with pytest.raises(UserError, match="rope_parameters.partial_rotary_factor=0.5"):
    llama.config_from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                      "partial_rotary_factor": 0.5}})


def test_bookkeeping_fields_of_transformers_4_files_are_inert():
  """Files saved by transformers 4 often carry `_name_or_path` (the directory
  it was loaded from) and `_attn_implementation_autoset`."""
  hf = dict(model_type="llama", hidden_size=32, num_attention_heads=4)
  llama = hf_mappings.ARCHITECTURES["llama"]
  assert llama.config_from_hf({**hf, "_name_or_path": "meta-llama/Llama-2-7b-hf",
                               "_attn_implementation_autoset": True}) == llama.config_from_hf(hf)


def test_export_refuses_configs_without_hf_architecture():
  config = base_config.get_config()
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == "llama"
  config.model.pos_emb = "sinusoidal"
  with pytest.raises(UserError, match="gpt2: model.pos_emb='sinusoidal' .needs 'learned'.; "
                                      "llama: model.pos_emb='sinusoidal' .needs 'rope'."):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))


@pytest.mark.parametrize("field,value,model_type", [
    ("sliding_window", 4, "mistral"), ("qkv_bias", True, "qwen2"), ("qk_norm", True, "qwen3"),
    ("rope_scaling", "yarn", "llama"), ("rope_scaling", "llama3", "llama")])
def test_export_picks_the_architecture_of_each_option(field, value, model_type):
  config = base_config.get_config()
  config.model[field] = value
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == model_type


def test_export_of_a_window_in_some_layers():
  """Qwen2 has a per-layer window; Mistral's is in every layer or none."""
  config = base_config.get_config()
  config.model.update(sliding_window=4, sliding_window_layers=(1,))
  with pytest.raises(UserError, match=r"mistral: model.sliding_window_layers=\(1,\) "
                                      r".needs \(0, 1\)\)"):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))
  config.model.qkv_bias = True
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == "qwen2"


def test_export_refuses_ntk_rope_by_name():
  config = base_config.get_config()
  config.model.update(rope_scaling="ntk", rope_scaling_factor=2.0)
  with pytest.raises(UserError, match="llama: model.rope_scaling='ntk'"):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))


# A value other than configs/base.py's for every forward field of its model
# (a LLaMA): LLaMA's config.json either brings it back or the export check
# names it (the window's layers: Mistral's, whose window is in every layer).
_OTHER_VALUES = dict(
    family="encoder", vocab_size=2048, d_model=64, num_layers=3, num_heads=8, num_kv_heads=2,
    head_dim=16, d_ff=256, max_len=128, pos_emb="learned", rope_theta=500.0,
    rope_scaling="ntk", norm="layernorm", norm_position="post", norm_eps=1e-5, mlp="gelu",
    qkv_bias=True, out_bias=True, mlp_bias=True, scale_embeddings=True, attention_scale=1.0,
    tie_embeddings=False, scale_head_input=True, type_vocab_size=2, embedding_norm=True,
    head_transform=True, output_bias=True, sliding_window=8, real_vocab_size=1000,
    sliding_window_layers=(1,), num_labels=4, qk_norm=True, attn_softcap=50.0,
    final_softcap=30.0, attention_score="sigmoid", num_experts=4, moe_layers=(1,),
    parametrization="mup", attention="mla", layer_types=("full_attention", "sliding_attention"),
    partial_rotary_factor=0.5, attention_output_gate=True)
_LLAMA_MAPS = ("vocab_size", "real_vocab_size", "d_model", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "d_ff", "max_len", "rope_theta", "norm_eps",
               "tie_embeddings")


@pytest.mark.parametrize("field", sorted(_OTHER_VALUES))
def test_export_check_names_every_field_llama_does_not_map(field):
  """The export check is one round trip for every field, so a new model
  option that an architecture does not map is refused by it, by name. A field
  added to `ModelConfig` must be added to `_OTHER_VALUES` (the first assert)."""
  config = base_config.get_config()
  assert set(ModelConfig.resolve(config.model).forward_fields()) == set(_OTHER_VALUES)
  config.model[field] = _OTHER_VALUES[field]
  arch = "llama"
  if field == "rope_scaling":
    config.model.rope_scaling_factor = 2.0
  named = field
  if field in ("sliding_window_layers", "layer_types"):  # named by the layers, as either says them
    config.model.sliding_window, arch, named = 8, "mistral", "sliding_window_layers"
  if field == "moe_layers":  # experts in layer 1 only: named by the experts, first
    config.model.num_experts, named = 4, "num_experts"
  if field == "attention":  # DeepSeek's latent attention needs its fields
    config.model.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
  reason = hf_convert.round_trip_mismatch(hf_mappings.ARCHITECTURES[arch],
                                          ModelConfig.resolve(config.model))
  if field in _LLAMA_MAPS:
    assert reason == ""
  else:
    value = ModelConfig.resolve(config.model).forward_fields()[named]
    assert reason.startswith(f"model.{named}={value!r} (needs "), reason


def test_qwen3_in_and_out(tok, tmp_path):
  """QK-norm (q_norm, k_norm drawn at random, so that swapping them shows),
  a head_dim of 16 that is not hidden_size / heads = 8, GQA, untied head."""
  hf_model = tiny_llama(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=16)
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      if "norm" in name:
        torch.nn.init.normal_(parameter, mean=1.0, std=0.5)
  workdir = _check_import(hf_model, tok, tmp_path)
  model_config = workdir_lib.load_config(str(workdir)).model
  assert (model_config.qk_norm, model_config.head_dim, model_config.use_bias) == (True, 16, False)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["head_dim"], exported["attention_bias"]) == (
      "qwen3", 16, False)


def test_qwen3_with_attention_bias_is_refused_by_name():
  hf = {"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 4,
        "attention_bias": True}
  with pytest.raises(UserError, match="attention_bias=True is not supported by the qwen3 "
                                      "import"):
    hf_mappings.ARCHITECTURES["qwen3"].config_from_hf(hf)


def _random_experts(hf_model):
  """`hf_model` with its experts' and router's weights drawn wider, so that a
  swapped gate and up, or a transposed expert, shows in the logits and the
  routing is not a near tie."""
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      if ".experts." in name or name.endswith("mlp.gate.weight"):
        torch.nn.init.normal_(parameter, std=0.3)
  return hf_model


def test_mixtral_in_and_out(tok, tmp_path):
  """MixtralForCausalLM: 4 experts of width 48, top 2 (renormalised): the
  logits within 1e-4, greedy generation token for token, and the export
  loaded back by transformers with the same logits."""
  hf_model = _random_experts(tiny_llama(transformers.MixtralForCausalLM,
                                        transformers.MixtralConfig, intermediate_size=48,
                                        num_local_experts=4, num_experts_per_tok=2))
  workdir = _check_import(hf_model, tok, tmp_path)
  model_config = workdir_lib.load_config(str(workdir)).model
  assert (model_config.num_experts, model_config.experts_per_token,
          model_config.moe_router) == (4, 2, "softmax_topk_norm")
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["num_local_experts"]) == ("mixtral", 4)


@pytest.mark.parametrize("norm_topk_prob", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_qwen3_moe_in_and_out(tok, tmp_path, norm_topk_prob):
  """Qwen3MoeForCausalLM with a dense first layer (mlp_only_layers) and
  experts in the others (3 layers: 4 experts of 16, top 2; the dense MLP of
  64), QK-norm; both routers."""
  hf_model = _random_experts(tiny_llama(
      transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, head_dim=8,
      num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      mlp_only_layers=[0], norm_topk_prob=norm_topk_prob))
  workdir = _check_import(hf_model, tok, tmp_path)
  model_config = workdir_lib.load_config(str(workdir)).model
  assert (tuple(model_config.moe_layers), model_config.moe_d_ff, model_config.moe_router) == (
      (1, 2), 16, "softmax_topk_norm" if norm_topk_prob else "softmax_topk")
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["mlp_only_layers"]) == ("qwen3_moe", [0])


def test_bert_base_preset_exports_as_bert():
  config = bert_base.get_config()
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == "bert"


def test_qwen2_in_and_out(tok, tmp_path):
  """q/k/v biases without an o bias; GQA, untied head; Qwen2's own window of
  3 keys (shorter than the prompts and the generated tokens) in layer 1 only
  (max_window_layers=1), full attention in layer 0."""
  hf_model = randomised(tiny_llama(transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                                use_sliding_window=True, sliding_window=3, max_window_layers=1))
  assert hf_model.config.layer_types == ["full_attention", "sliding_attention"]
  workdir = _check_import(hf_model, tok, tmp_path)
  model_config = workdir_lib.load_config(str(workdir)).model
  assert (model_config.sliding_window, list(model_config.sliding_window_layers)) == (3, [1])
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["use_sliding_window"], exported["sliding_window"],
          exported["layer_types"]) == ("qwen2", True, 3, ["full_attention", "sliding_attention"])


def test_qwen2_window_fields():
  """How transformers 5 reads Qwen2's window: `layer_types` when given, else
  the layers from `max_window_layers` on; nothing without use_sliding_window
  (Qwen2-0.5B's file has sliding_window=131072, unused)."""
  qwen2 = hf_mappings.ARCHITECTURES["qwen2"]
  base = dict(model_type="qwen2", num_hidden_layers=4, sliding_window=8)

  def window(**kw):
    fields = qwen2.config_from_hf({**base, **kw})
    return fields["sliding_window"], fields["sliding_window_layers"]

  assert window(use_sliding_window=False, max_window_layers=0) == (None, None)
  assert window(use_sliding_window=True, max_window_layers=0) == (8, None)  # every layer
  assert window(use_sliding_window=True, max_window_layers=2) == (8, (2, 3))
  assert window(use_sliding_window=True, max_window_layers=4) == (None, None)
  assert window(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"] * 2,
                max_window_layers=3) == (8, (0, 2))
  for kw, message in [
      (dict(use_sliding_window=True, layer_types=["chunked_attention"] * 4),
       "layer_types=.'chunked_attention'"),
      (dict(use_sliding_window=False, layer_types=["sliding_attention"] * 4),
       "use_sliding_window=False")]:
    with pytest.raises(UserError, match=message):
      window(**kw)


@pytest.mark.slow
def test_mistral_sliding_window_in_and_out(tok, tmp_path):
  """A window of 4 keys, shorter than the prompts plus the generated tokens."""
  hf_model = tiny_llama(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=4)
  workdir = _check_import(hf_model, tok, tmp_path)
  assert workdir_lib.load_config(str(workdir)).model.sliding_window == 4
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (exported["model_type"], exported["sliding_window"]) == ("mistral", 4)


@pytest.mark.slow
@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
    dict(rope_type="yarn", rope_theta=500.0, factor=2.0, original_max_position_embeddings=32,
         beta_fast=16.0, beta_slow=2.0, attention_factor=1.3, truncate=False),
    dict(rope_type="llama3", rope_theta=500.0, factor=8.0, original_max_position_embeddings=16,
         low_freq_factor=1.0, high_freq_factor=4.0),
])
def test_llama_rope_scaling_in_and_out(tok, tmp_path, rope):
  hf_model = tiny_llama(head_dim=16, rope_parameters=rope)
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert rope.items() <= exported["rope_parameters"].items()


def test_llama_yarn_factor_from_the_context_lengths():
  """No `factor`: transformers takes max_position_embeddings / original."""
  llama = hf_mappings.ARCHITECTURES["llama"]
  fields = llama.config_from_hf({"model_type": "llama", "max_position_embeddings": 1024,
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                     "original_max_position_embeddings": 256}})
  assert (fields["rope_scaling"], fields["rope_scaling_factor"]) == ("yarn", 4.0)


def test_bert_masked_lm_in_and_out(tok, tmp_path):
  """Embedding LayerNorm, token types, post-norm, erf GELU, the MLM head
  transform and output bias, tied; imported with the mlm objective."""
  hf_model = randomised(_bert())
  workdir = _check_import(hf_model, tok, tmp_path, generation=False)
  config = workdir_lib.load_config(str(workdir))
  assert (config.model.family, config.train.objective) == ("encoder", "mlm")
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)),
                auto_class="AutoModelForMaskedLM")


@pytest.mark.slow
def test_bert_untied_tanh_gelu_in_and_out(tok, tmp_path):
  """Untied, the decoder's own bias is the output bias; gelu_new is tanh GELU."""
  hf_model = randomised(_bert(tie_word_embeddings=False, hidden_act="gelu_new"))
  workdir = _check_import(hf_model, tok, tmp_path, generation=False)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)),
                auto_class="AutoModelForMaskedLM")


@pytest.mark.slow
def test_bert_hub_file_layout(tok, tmp_path):
  """As bert-base-uncased's model.safetensors: LayerNorm gamma/beta names, the
  pooler and next-sentence head, and the tied decoder's own copies; read as
  transformers reads them."""
  hf_model = randomised(_bert()).eval()
  hf_dir = save_hf(hf_model, tok, tmp_path / "hf")
  path = tmp_path / "hf" / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  tensors = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                      "LayerNorm.beta"): v
             for k, v in tensors.items()}
  tensors.update({"bert.pooler.dense.weight": np.zeros((32, 32), np.float32),
                  "bert.pooler.dense.bias": np.zeros(32, np.float32),
                  "cls.seq_relationship.weight": np.zeros((2, 32), np.float32),
                  "cls.seq_relationship.bias": np.zeros(2, np.float32),
                  "cls.predictions.decoder.weight":
                      tensors["bert.embeddings.word_embeddings.weight"],
                  "cls.predictions.decoder.bias": tensors["cls.predictions.bias"]})
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  assert run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run") == 0
  _, _, model, _ = load_run(str(tmp_path / "run"))
  ids = _ids(tok)
  assert_close(model(ids), _hf_logits(hf_model, ids))


def test_bert_refuses_unsupported_fields(tok, tmp_path, capsys):
  for kw, message in [(dict(position_embedding_type="relative_key"),
                       "position_embedding_type='relative_key'"),
                      (dict(hidden_act="silu"), "hidden_act='silu'"),
                      (dict(is_decoder=True), "is_decoder=True")]:
    hf_dir = tmp_path / "hf"
    save_hf(_bert(num_hidden_layers=1), tok, hf_dir)
    edit_hf_config(hf_dir, **kw)
    assert message in convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                         tmp_path / "run")


# The config.json fields of public checkpoints (as published; values only read).
_PUBLISHED = {
    "Llama-3.1-8B": ("llama", {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256},
        dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=8192,
             num_kv_heads=8, max_len=131072)),
    "Qwen2-0.5B": ("qwen2", {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        dict(qkv_bias=True, out_bias=False, head_dim=64, tie_embeddings=True)),
    "Mistral-7B-v0.1": ("mistral", {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
        dict(sliding_window=4096)),
    "bert-base-uncased": ("bert", {
        "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
        "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
        "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
        "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
        "position_embedding_type": "absolute", "transformers_version": "4.6.0.dev0",
        "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522},
        {k: v for k, v in bert_base.get_config().model.to_dict().items()
         if k in ("family", "vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                  "norm_position", "norm_eps", "mlp", "type_vocab_size", "embedding_norm",
                  "head_transform", "output_bias", "tie_embeddings")}),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_published_configs_import(name):
  model_type, hf, expected = _PUBLISHED[name]
  fields = hf_mappings.architecture_of(hf).config_from_hf(hf)
  assert {k: fields.get(k) for k in expected} == expected
  config = base_config.get_config()
  config.model.update(**fields)
  cfg = ModelConfig.resolve(config.model)
  assert hf_convert.export_architecture(cfg).model_type == model_type


def test_tensor_tables_find_a_layer_in_its_scanned_cycle():
  """A scanned stack of a `model.layer_types` cycle holds layer i as repeat r
  of block j of the cycle's body (i = a + r p + j); the layers after the
  last repeat in their run; experts after the layer's slice."""
  flat = {"decoder/layers/0_to_3_every_2/1/attn/q_proj/kernel": None,
          "decoder/layers/0_to_3_every_2/1/mlp/w_in": None,
          "decoder/layers/4_to_4/attn/q_proj/kernel": None}
  locate = hf_convert._locate  # pylint: disable=protected-access
  assert locate("decoder/layers/3/attn/q_proj/kernel", flat) == (
      "decoder/layers/0_to_3_every_2/1/attn/q_proj/kernel", (1,))
  assert locate("decoder/layers/1/mlp/w_in[2]", flat) == (
      "decoder/layers/0_to_3_every_2/1/mlp/w_in", (0, 2))
  assert locate("decoder/layers/4/attn/q_proj/kernel", flat) == (
      "decoder/layers/4_to_4/attn/q_proj/kernel", (0,))
