"""BART (`BartForConditionalGeneration`) in and out, against transformers.

A tiny random BART (random LayerNorm and bias weights, a random nonzero
`final_logits_bias`) is saved with our tokenizer, imported with `convert.py
from_hf` and compared in float32: logits of `model(src, tgt, src_padding_mask)`
against `hf(input_ids, attention_mask, decoder_input_ids)`, and greedy KV-cache
generation from the decoder start (eos) against `hf.generate`; then exported
with `convert.py to_hf` and loaded by `AutoModelForSeq2SeqLM` and
`AutoTokenizer` to the same logits, generations and ids. The preset
`configs/bart_base.py` has facebook/bart-base's parameter count.
"""
import json
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from configs import bart_base
from configs.errors import UserError
from model import accounting
from model.config import ModelConfig
from model.generate import generate
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from training.workdir import load_run
from tests.helpers import (assert_close, both_splits, convert_error_line, edit_hf_config,
                           run_command, run_convert, save_hf)

pytestmark = pytest.mark.hf  # transformers and torch

NEW_TOKENS = 8
SOURCES = ["def add(a, b):\n    return a + b", "class Foo"]


def _bart(tok, **kw):
  """A tiny random BART with the tokenizer's ids (and 30 rows past its
  vocabulary); biases, LayerNorms and final_logits_bias drawn at random
  (zeros and ones would hide a misplaced tensor). The decoder has more layers
  than the encoder. Weights of std 0.3 and this seed make greedy decoding
  change tokens along the way, not repeat one."""
  config = transformers.BartConfig(**{**dict(
      vocab_size=320, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
      max_position_embeddings=64, init_std=0.3, bos_token_id=tok.bos_id,
      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, decoder_start_token_id=tok.eos_id), **kw})
  torch.manual_seed(39)
  hf_model = transformers.BartForConditionalGeneration(config)
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        torch.nn.init.normal_(parameter, mean=float(name.endswith("weight")), std=0.1)
    torch.nn.init.normal_(hf_model.final_logits_bias, std=0.1)
  return hf_model.eval()


def _inputs(tok):
  """Sources of two lengths (right-padded, with their mask) and targets that
  start with the decoder start token (eos)."""
  sources = [tok.encode_with_specials(text) for text in SOURCES]
  src = np.full((len(sources), max(map(len, sources))), tok.pad_id, np.int64)
  for row, ids in zip(src, sources):
    row[:len(ids)] = ids
  tgt = np.asarray([[tok.eos_id, *tok.encode("return a + b")]] * len(sources))
  return sources, src, src != tok.pad_id, tgt


def _hf_logits(hf_model, tok):
  _, src, mask, tgt = _inputs(tok)
  with torch.no_grad():
    return hf_model(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(mask),
                    decoder_input_ids=torch.as_tensor(tgt)).logits.numpy()


def _hf_generate(hf_model, tok, **kw):
  """Greedy new tokens (after the decoder start), forced bos/eos off, no stop at eos."""
  _, src, mask, _ = _inputs(tok)
  with torch.no_grad():
    out = hf_model.generate(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(mask),
                            max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                            forced_bos_token_id=None, forced_eos_token_id=None,
                            eos_token_id=None, **kw)
  return out[:, 1:].tolist()


def _import(hf_model, tok, tmp_path, hf_dir=None):
  """from_hf of `hf_model` saved with `tok` (or of `hf_dir`); the workdir."""
  workdir = tmp_path / "run"
  hf_dir = hf_dir or save_hf(hf_model, tok, tmp_path / "hf")
  assert run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", workdir) == 0
  return workdir


def _export(workdir, tmp_path):
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  return out, transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()


def test_bart_in_and_out(tok, tmp_path):
  """Logits of the import and of its export; the export's config and tokenizer."""
  hf_model = _bart(tok)
  workdir = _import(hf_model, tok, tmp_path)
  config, _, model, step = load_run(str(workdir))
  assert step == 0
  assert (config.model.family, config.model.decoder_start, config.train.objective,
          config.data.task, config.data.pair_specials) == (
      "encoder_decoder", "eos", "seq2seq", "pairs", True)
  _, src, mask, tgt = _inputs(tok)
  assert not mask.all()  # a padded source
  reference = _hf_logits(hf_model, tok)
  assert_close(model(src, tgt, src_padding_mask=mask), reference)

  out, exported = _export(workdir, tmp_path)
  hf = json.loads((out / "config.json").read_text())
  assert (hf["model_type"], hf["decoder_start_token_id"], hf["vocab_size"]) == (
      "bart", tok.eos_id, 320)  # every row, also the 30 past the tokenizer's
  assert_close(_hf_logits(exported, tok), reference)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok("def add(a, b)")["input_ids"] == tok.encode_with_specials("def add(a, b)")


@pytest.mark.slow
def test_bart_greedy_generation_in_and_out(tok, tmp_path):
  """KV-cache greedy decoding from the eos id, token for token with
  hf.generate; the export generates the same from its config's
  decoder_start_token_id."""
  hf_model = _bart(tok)
  workdir = _import(hf_model, tok, tmp_path)
  config, _, model, _ = load_run(str(workdir))
  sources = _inputs(tok)[0]

  def ours(**kw):
    return generate(model, config.model, [[tok.eos_id]] * len(sources), sources=sources,
                    max_new_tokens=NEW_TOKENS, eos_id=-1, pad_id=tok.pad_id, **kw)

  greedy = ours()
  assert greedy == _hf_generate(hf_model, tok, decoder_start_token_id=tok.eos_id)
  assert any(a != b for row in greedy for a, b in zip(row, row[1:]))  # not one token repeated
  _, exported = _export(workdir, tmp_path)
  assert _hf_generate(exported, tok) == greedy


@pytest.mark.slow
def test_bart_scaled_embeddings_tanh_gelu_in_and_out(tok, tmp_path):
  """scale_embedding=True (token embeddings times sqrt(d_model)), gelu_new."""
  hf_model = _bart(tok, scale_embedding=True, activation_function="gelu_new")
  workdir = _import(hf_model, tok, tmp_path)
  config, _, model, _ = load_run(str(workdir))
  assert (config.model.scale_embeddings, config.model.mlp) == (True, "gelu_tanh")
  _, src, mask, tgt = _inputs(tok)
  assert_close(model(src, tgt, src_padding_mask=mask), _hf_logits(hf_model, tok))
  _, exported = _export(workdir, tmp_path)
  assert exported.config.scale_embedding
  assert_close(_hf_logits(exported, tok), _hf_logits(hf_model, tok))


@pytest.mark.slow
def test_bart_hub_file_layout(tok, tmp_path):
  """As facebook/bart-base's file (saved from `BartModel`): no "model."
  prefix, no final_logits_bias (zeros, as transformers reads it), no
  lm_head, the encoder's and decoder's own copies of `shared`."""
  hf_dir = save_hf(_bart(tok), tok, tmp_path / "hf")
  path = tmp_path / "hf" / "model.safetensors"
  tensors = {k.removeprefix("model."): v for k, v in safetensors.numpy.load_file(path).items()
             if k != "final_logits_bias"}
  tensors.update({f"{stack}.embed_tokens.weight": tensors["shared.weight"]
                  for stack in ("encoder", "decoder")})
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  reference = transformers.BartForConditionalGeneration.from_pretrained(hf_dir).eval()
  assert not reference.final_logits_bias.any()
  workdir = _import(None, tok, tmp_path, hf_dir=hf_dir)
  _, _, model, _ = load_run(str(workdir))
  _, src, mask, tgt = _inputs(tok)
  assert_close(model(src, tgt, src_padding_mask=mask), _hf_logits(reference, tok))


def test_bart_refuses_what_it_cannot_express(tok, tmp_path, capsys):
  """Each is one line, exit status 2, and no workdir."""
  hf_dir = tmp_path / "hf"
  save_hf(_bart(tok, encoder_layers=1, decoder_layers=1), tok, hf_dir)
  for kw, message in [(dict(decoder_ffn_dim=64), "decoder_ffn_dim=64"),
                      (dict(decoder_attention_heads=2), "decoder_attention_heads=2"),
                      (dict(activation_function="silu"), "activation_function='silu'"),
                      (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
                      (dict(normalize_before=True), "normalize_before=True"),
                      (dict(decoder_start_token_id=7), "decoder_start_token_id=7")]:
    original = (hf_dir / "config.json").read_text()
    edit_hf_config(hf_dir, **kw)
    assert message in convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                         tmp_path / "run")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    (hf_dir / "config.json").write_text(original)


# facebook/bart-base's config.json (transformers 4.x fields; values only read).
_BART_BASE_HF = {
    "_name_or_path": "bart-base", "activation_dropout": 0.1, "activation_function": "gelu",
    "add_bias_logits": False, "add_final_layer_norm": False, "architectures": ["BartModel"],
    "attention_dropout": 0.1, "bos_token_id": 0, "classif_dropout": 0.1,
    "classifier_dropout": 0.0, "d_model": 768, "decoder_attention_heads": 12,
    "decoder_ffn_dim": 3072, "decoder_layerdrop": 0.0, "decoder_layers": 6,
    "decoder_start_token_id": 2, "dropout": 0.1, "early_stopping": True,
    "encoder_attention_heads": 12, "encoder_ffn_dim": 3072, "encoder_layerdrop": 0.0,
    "encoder_layers": 6, "eos_token_id": 2, "forced_bos_token_id": 0, "forced_eos_token_id": 2,
    "gradient_checkpointing": False, "id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"},
    "init_std": 0.02, "is_encoder_decoder": True,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2}, "max_position_embeddings": 1024,
    "model_type": "bart", "no_repeat_ngram_size": 3, "normalize_before": False,
    "normalize_embedding": True, "num_beams": 4, "num_hidden_layers": 6, "pad_token_id": 1,
    "scale_embedding": False,
    "task_specific_params": {"summarization": {"length_penalty": 1.0, "max_length": 128,
                                               "min_length": 12, "num_beams": 4}},
    "torch_dtype": "float32", "transformers_version": "4.12.0.dev0", "use_cache": True,
    "vocab_size": 50265}


def test_bart_base_config_imports_as_the_preset():
  """facebook/bart-base's config.json gives configs/bart_base.py's model, which
  exports as bart; the round trip through config_to_hf gives it back."""
  bart = hf_mappings.ARCHITECTURES["bart"]
  fields = bart.config_from_hf(_BART_BASE_HF)
  preset = bart_base.get_config().model
  assert {k: preset[k] for k in fields} == fields
  cfg = ModelConfig.resolve(preset)
  assert hf_convert.export_architecture(cfg).model_type == "bart"
  assert bart.config_from_hf(bart.config_to_hf(cfg, 50265)) == fields


@pytest.mark.parametrize("changes", [
    dict(decoder_start="pad"), dict(decoder_start="bos"), dict(scale_embeddings=True),
    dict(mlp="relu"), dict(mlp="gelu_tanh"), dict(num_decoder_layers=2, max_len=64)])
def test_bart_config_round_trip(changes):
  """Each is BART: it exports as bart, and config_to_hf then config_from_hf
  gives back each field it sets."""
  bart = hf_mappings.ARCHITECTURES["bart"]
  preset = bart_base.get_config().model
  preset.update(**changes)
  cfg = ModelConfig.resolve(preset)
  assert hf_convert.export_architecture(cfg).model_type == "bart"
  fields = bart.config_from_hf(bart.config_to_hf(cfg, 50265))
  assert {k: preset[k] for k in fields} == fields


@pytest.mark.parametrize("field,value", [("tie_embeddings", False), ("norm_eps", 1e-6),
                                         ("output_bias", False), ("embedding_norm", False)])
def test_export_names_what_bart_needs(field, value):
  config = bart_base.get_config()
  config.model[field] = value
  with pytest.raises(UserError, match=f"bart: model.{field}="):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))


def test_bart_base_has_the_transformers_parameter_count():
  """configs/bart_base.py against BartForConditionalGeneration at
  facebook/bart-base's shapes (BartConfig()'s defaults are bart-large's),
  counted on torch's meta device (unique parameters: the shared embedding
  once). Two honest differences: our `output_bias` is a parameter, BART's
  `final_logits_bias` (the same V numbers) a buffer, counted here; our
  position tables have max_len rows, BART's 2 more that are never read."""
  m = bart_base.get_config().model
  config = transformers.BartConfig(
      d_model=m.d_model, encoder_layers=m.num_layers, decoder_layers=m.num_decoder_layers,
      encoder_attention_heads=m.num_heads, decoder_attention_heads=m.num_heads,
      encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, vocab_size=m.vocab_size,
      max_position_embeddings=m.max_len)
  with torch.device("meta"):
    hf = transformers.BartForConditionalGeneration(config)
  parameters = sum(p.numel() for p in hf.parameters())
  assert parameters == 139_420_416  # facebook/bart-base's published count
  want = parameters + hf.final_logits_bias.numel() - 2 * 2 * m.d_model
  assert accounting.formula_params(m)["params_total"] == want
  assert accounting.measured_params(m)["params_total"] == want


@pytest.mark.slow
def test_bart_commands_evaluate_finetune_export(tok, tmp_path):
  """An imported BART is a data.task=pairs run: eval.py --data takes a pairs
  file, train.py fine-tunes it on data.paths, to_hf exports the fine-tune."""
  workdir = _import(_bart(tok), tok, tmp_path)
  pairs = tmp_path / "pairs.tsv"
  count = both_splits(lambda i: f"{pairs}:{i + 2}", 50, 6)  # named path:line, after the header
  pairs.write_text("src\ttgt\n" + "".join(f"def f{i}(a):\treturn a + {i}\n"
                                          for i in range(count)))

  run_command("eval.py", "--workdir", workdir, "--data", pairs, "--max_examples", 2,
              "--beam_size", 2)
  # another data file's report goes to a folder of its own, not the top-level copy
  report = json.loads((workdir / "eval" / "step_0_data-pairs.tsv" / "eval_report.json")
                      .read_text())
  assert (report["step"], report["data"], report["examples"]) == (0, "task=pairs", 2)
  run_command("train.py", f"--config=configs/from_run.py:{workdir}",
      f"--config.train.restore_from={workdir}", "--workdir", tmp_path / "ft",
      "--config.train.num_steps=2", f"--config.data.paths={pairs}",
      "--config.data.val_percent=50", "--config.train.batch_size=2",
      "--config.train.seq_len=16", "--config.train.eval_steps=1", "--config.train.warmup_steps=1")
  run_command("convert.py", "to_hf", "--workdir", tmp_path / "ft", "--out", tmp_path / "ft_hf")
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ft_hf").eval()
  _, _, model, step = load_run(str(tmp_path / "ft"))
  assert step == 2
  _, src, mask, tgt = _inputs(tok)
  assert_close(_hf_logits(exported, tok), model(src, tgt, src_padding_mask=mask))
