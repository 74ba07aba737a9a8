"""convert.py against `transformers` itself: tiny random models, both ways.

Each case builds a tiny random-initialised `transformers` model (nothing is
downloaded), saves it with a tokenizer, imports it with `convert.py from_hf`,
loads the run with `training.evaluate.load_run` and compares float32 logits
(within 1e-4 of the largest logit) and greedy KV-cache generation token for
token; then exports it with `convert.py to_hf` and loads that with
`transformers` to the same logits and tokenizer ids.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import convert
from configs import base as base_config
from configs import from_run
from configs.errors import UserError
from model.config import ModelConfig
from model.generate import generate
from tokenizer import bpe, export_hf
from training import hf_convert, hf_mappings
from training import workdir as workdir_lib
from training.evaluate import load_run

TEXTS = ["def add(a, b):\n    return a + b\n" * 3, "class Foo: pass\n", "hello world"] * 5
PROMPTS = ["def add(", "class "]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
  return bpe.train_bpe(TEXTS, 290)


def _gpt2(**kw):
  return transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw))


def _llama(cls=transformers.LlamaForCausalLM, config=transformers.LlamaConfig, **kw):
  args = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
  return cls(config(**{**args, **kw}))


def _save(hf_model, tok, path, **kw):
  hf_model.save_pretrained(path, **kw)
  export_hf(tok, path)
  return str(path)


def _run_convert(*args) -> int:
  try:
    convert.main([str(a) for a in args])
  except SystemExit as e:
    return e.code
  return 0


def _ids(tok):
  return np.asarray([tok.encode_with_specials(p + "x = 1") for p in PROMPTS[:1]] * 2)


def _assert_close(ours, theirs):
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  assert ours.shape == theirs.shape
  scale = np.abs(theirs).max()
  np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4 * scale)


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids)).logits.float().numpy()


def _check_import(hf_model, tok, tmp_path, **save_kw):
  """from_hf, then logits and greedy generation against `hf_model`; the run dir."""
  hf_model.eval()
  workdir = tmp_path / "run"
  assert _run_convert("from_hf", "--hf_dir", _save(hf_model, tok, tmp_path / "hf", **save_kw),
                      "--workdir", workdir) == 0
  config, run_tok, model, step = load_run(str(workdir))
  assert step == 0 and run_tok.encode("def f") == tok.encode("def f")
  ids = _ids(tok)
  _assert_close(model(ids), _hf_logits(hf_model, ids))
  prompts = [tok.encode_with_specials(p) for p in PROMPTS]
  ours = generate(model, config.model, prompts, max_new_tokens=8, eos_id=-1)
  for prompt, new in zip(prompts, ours):
    with torch.no_grad():
      theirs = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    assert new == theirs[0, len(prompt):].tolist()
  return workdir


def _check_export(workdir, tok, tmp_path, reference):
  """to_hf, loaded by transformers: the same logits (on the tokenizer's ids) and ids."""
  out = tmp_path / "exported"
  assert _run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  ids = _ids(tok)
  _assert_close(_hf_logits(exported, ids), reference[..., :exported.config.vocab_size])
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok("def add(a, b)")["input_ids"] == tok.encode_with_specials("def add(a, b)")


def test_gpt2_in_and_out(tok, tmp_path):
  """Also our padded rows (320 here, 50,304 for GPT-2): dropped on export, the
  tokenizer's 290 remain with their logits unchanged."""
  hf_model = _gpt2()
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert exported["vocab_size"] == tok.vocab_size == 290
  # The config to fine-tune it with: the run's own.
  assert (from_run.get_config(str(workdir)).model.to_dict()
          == workdir_lib.load_config(str(workdir)).model.to_dict())


@pytest.mark.slow
def test_llama_gqa_head_dim_in_and_out(tok, tmp_path):
  """GQA (4 query heads, 2 KV heads) with head_dim 16 != d/h = 8, untied head."""
  hf_model = _llama(head_dim=16)
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(num_key_value_heads=4),  # MHA
    dict(num_key_value_heads=1, tie_word_embeddings=True),  # MQA, tied
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
])
def test_llama_variants(tok, tmp_path, kw):
  hf_model = _llama(**kw)
  workdir = _check_import(hf_model, tok, tmp_path)
  _check_export(workdir, tok, tmp_path, _hf_logits(hf_model.eval(), _ids(tok)))


@pytest.mark.slow
def test_mistral_sharded(tok, tmp_path):
  """Mistral (no sliding window), saved in several safetensors shards with an index."""
  hf_model = _llama(transformers.MistralForCausalLM, transformers.MistralConfig,
                    sliding_window=None)
  _check_import(hf_model, tok, tmp_path, max_shard_size="20KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_import_onto_a_sharded_mesh(tok, tmp_path):
  """convert.py on 4 (host) devices with mesh fsdp=2, tensor=2: the weights are
  placed in their shards as read; the run has the same logits."""
  hf_model = _llama().eval()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  result = subprocess.run(
      [sys.executable, "convert.py", "from_hf", "--hf_dir", _save(hf_model, tok, tmp_path / "hf"),
       "--workdir", str(tmp_path / "run"), "--fsdp", "2", "--tensor", "2"],
      capture_output=True, text=True, check=False, cwd=ROOT, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  config, _, model, _ = load_run(str(tmp_path / "run"))
  assert (config.mesh.fsdp, config.mesh.tensor) == (2, 2)
  ids = _ids(tok)
  _assert_close(model(ids), _hf_logits(hf_model, ids))


@pytest.mark.slow
def test_bfloat16(tok, tmp_path):
  """A bfloat16 checkpoint imports as bfloat16 parameters and exports as bfloat16."""
  hf_model = _llama().to(torch.bfloat16)
  workdir = tmp_path / "run"
  assert _run_convert("from_hf", "--hf_dir", _save(hf_model, tok, tmp_path / "hf"),
                      "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  assert config.model.param_dtype == "bfloat16"
  ids = _ids(tok)
  theirs = _hf_logits(hf_model, ids)
  np.testing.assert_array_less(np.abs(np.asarray(model(ids)) - theirs).max(),
                               0.05 * np.abs(theirs).max())
  out = tmp_path / "exported"
  assert _run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert exported.dtype == torch.bfloat16
  for name, param in hf_model.state_dict().items():  # vocabulary rows: the tokenizer's 290
    assert torch.equal(exported.state_dict()[name], param[:tok.vocab_size]), name


def _error_line(capsys, *args) -> str:
  capsys.readouterr()  # transformers' progress bars while saving
  assert _run_convert(*args) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ")
  return err


@pytest.mark.parametrize("change, message", [
    (lambda d: os.remove(d / "model.safetensors"), "no model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"damaged"), "cannot read"),
    (lambda d: _edit_config(d, model_type="bert"), "model_type 'bert' (planned)"),
    (lambda d: _edit_config(d, activation_function="relu"), "activation_function='relu'"),
    (lambda d: _edit_config(d, unknown_field=1), "unknown_field=1"),
    (lambda d: _edit_config(d, n_embd=64), "has shape"),
    (lambda d: os.remove(d / "tokenizer.json"), "no tokenizer.json"),
])
def test_bad_hf_dir(tok, tmp_path, capsys, change, message):
  hf_dir = tmp_path / "hf"
  _save(_gpt2(), tok, hf_dir)
  change(hf_dir)
  assert message in _error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                tmp_path / "run")
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_llama_refuses_unsupported_fields(tok, tmp_path, capsys):
  for kw, message in [(dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                             "rope_theta": 1e4}), "rope_type='yarn'"),
                      (dict(attention_bias=True), "attention_bias=True")]:
    hf_dir = tmp_path / "hf"
    _save(_llama(), tok, hf_dir)
    _edit_config(hf_dir, **kw)
    assert message in _error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                  tmp_path / "run")


def _edit_config(hf_dir, **changes):
  path = hf_dir / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.slow
def test_commands_import_evaluate_finetune_export(tok, tmp_path):
  """The README's worked example with the real commands: convert.py from_hf,
  eval.py, train.py from the imported run, convert.py to_hf of the fine-tune."""
  for i in range(9):
    (tmp_path / f"doc{i}.txt").write_text(f"def f{i}(a, b):\n    return a + b * {i}\n")

  def run(*args):
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                            check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]

  run("convert.py", "from_hf", "--hf_dir", _save(_gpt2(), tok, tmp_path / "hf"),
      "--workdir", tmp_path / "run")
  run("eval.py", "--workdir", tmp_path / "run", "--data", tmp_path / "doc0.txt",
      "--prompt", "def ", "--max_new_tokens", "4")
  assert json.loads((tmp_path / "run" / "eval_report.json").read_text())["step"] == 0
  run("train.py", f"--config=configs/from_run.py:{tmp_path / 'run'}",
      f"--config.train.restore_from={tmp_path / 'run'}", "--workdir", tmp_path / "ft",
      "--config.train.num_steps=2", "--config.data.source=files",
      f"--config.data.paths={tmp_path}/doc*.txt", "--config.data.val_percent=60",
      "--config.train.batch_size=2", "--config.train.seq_len=16", "--config.train.eval_steps=1",
      "--config.train.warmup_steps=1")
  run("convert.py", "to_hf", "--workdir", tmp_path / "ft", "--out", tmp_path / "ft_hf")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft_hf").eval()
  _, _, model, step = load_run(str(tmp_path / "ft"))
  assert step == 2
  ids = _ids(tok)
  _assert_close(_hf_logits(exported, ids), np.asarray(model(ids))[..., :tok.vocab_size])


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


def test_export_refuses_configs_without_hf_architecture():
  config = base_config.get_config()
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == "llama"
  config.model.pos_emb = "sinusoidal"
  with pytest.raises(UserError, match="gpt2: model.pos_emb='sinusoidal' .needs 'learned'.; "
                                      "llama: model.pos_emb='sinusoidal' .needs 'rope'."):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))


@pytest.mark.parametrize("field,value", [("sliding_window", 4), ("qkv_bias", True),
                                         ("attention_scale", 1.0), ("embedding_norm", True),
                                         ("type_vocab_size", 2), ("scale_head_input", True)])
def test_export_refuses_options_llama_does_not_have(field, value):
  config = base_config.get_config()
  config.model[field] = value
  with pytest.raises(UserError, match=f"llama: model.{field}="):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))
