"""Sequence classifiers and embeddings against `transformers`, and export of every row.

Tiny random-initialised `transformers` models (nothing is downloaded) saved
with a tokenizer, imported with `convert.py from_hf`: class logits within
1e-4 of the largest against `BertForSequenceClassification` and
`Qwen2ForSequenceClassification` on a right-padded batch, exported back to
the same tensors; mean-pooled embeddings against `BertModel`'s hidden states
mean-pooled by hand.
"""
import json

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from hf import convert as hf_convert
from tests.test_hf_convert import _assert_close, _llama, _randomised, _run_convert, _save
from tokenizer import bpe
from training import embed
from training.workdir import load_run

TEXTS = ["def add(a, b):\n    return a + b\n" * 3, "class Foo: pass\n", "hello world"] * 5
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
INPUTS = ["def add(a, b): return a", "class Foo"]


@pytest.fixture(scope="module")
def tok():
  return bpe.train_bpe(TEXTS, 290)


def _batch(tok):
  """(ids, mask, token types) [2, T] of INPUTS as classifier inputs, the
  shorter one right-padded with the pad id."""
  encoded = [tok.encode_classified(text) for text in INPUTS]
  width = max(len(ids) for ids, _ in encoded)
  ids = np.full((len(encoded), width), tok.pad_id, np.int64)
  mask = np.zeros_like(ids)
  for i, (row, _) in enumerate(encoded):
    ids[i, :len(row)], mask[i, :len(row)] = row, 1
  return ids, mask, np.zeros_like(ids)


def _hf_class_logits(hf_model, ids, mask, types=None):
  kwargs = {} if types is None else {"token_type_ids": torch.as_tensor(types)}
  with torch.no_grad():
    return hf_model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                    **kwargs).logits.float().numpy()


def _check_classifier(hf_model, tok, tmp_path, with_types: bool):
  """Import: logits against `hf_model`, labels kept; export: the same
  tensors and labels, loaded by AutoModelForSequenceClassification."""
  hf_model.eval()
  hf_dir = _save(hf_model, tok, tmp_path / "hf")
  workdir = tmp_path / "run"
  assert _run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  assert (config.train.objective, config.data.task) == ("classify", "labelled")
  assert tuple(config.data.labels) == tuple(LABELS.values())
  ids, mask, types = _batch(tok)
  theirs = _hf_class_logits(hf_model, ids, mask, types if with_types else None)
  _assert_close(model.classify(ids, mask > 0, types), theirs)
  out = tmp_path / "exported"
  assert _run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  original = safetensors.numpy.load_file(f"{hf_dir}/model.safetensors")
  exported = safetensors.numpy.load_file(f"{out}/model.safetensors")
  assert set(exported) <= set(original)
  for name, array in exported.items():
    np.testing.assert_array_equal(array, original[name], err_msg=name)
  back = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
  assert back.config.id2label == LABELS
  np.testing.assert_array_equal(_hf_class_logits(back, ids, mask, types if with_types else None),
                                theirs)
  return workdir


def test_bert_for_sequence_classification_in_and_out(tok, tmp_path):
  """[CLS] through the pooler (dense + tanh) and the classifier; token types;
  the padded row masked."""
  hf_model = _randomised(transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=320, hidden_size=32, num_attention_heads=4, intermediate_size=48,
      num_hidden_layers=2, max_position_embeddings=64, id2label=LABELS)))
  workdir = _check_classifier(hf_model, tok, tmp_path, with_types=True)
  model = json.loads((workdir / "config.json").read_text())["model"]
  assert (model["pooling"], model["pooler"], model["num_labels"]) == ("cls", True, 3)


@pytest.mark.slow
def test_qwen2_for_sequence_classification_in_and_out(tok, tmp_path):
  """The last real token (right padding, as transformers finds it from the
  pad id), `score` without a bias."""
  hf_model = _randomised(_llama(transformers.Qwen2ForSequenceClassification,
                                transformers.Qwen2Config, id2label=LABELS,
                                pad_token_id=tok.pad_id))
  workdir = _check_classifier(hf_model, tok, tmp_path, with_types=False)
  model = json.loads((workdir / "config.json").read_text())["model"]
  assert (model["pooling"], model["classifier_bias"]) == ("last", False)


def test_mean_pooled_embeddings_equal_bert_model(tok, tmp_path):
  """training.embed's mean-pooled, L2-normalised vectors of a BertForMaskedLM
  import against `BertModel`'s last hidden states of the same ids, averaged
  over the attention mask by hand."""
  hf_model = _randomised(transformers.BertForMaskedLM(transformers.BertConfig(
      vocab_size=320, hidden_size=32, num_attention_heads=4, intermediate_size=48,
      num_hidden_layers=2, max_position_embeddings=64)))
  hf_dir = _save(hf_model, tok, tmp_path / "hf")
  assert _run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run") == 0
  (tmp_path / "texts.txt").write_text("\n".join(INPUTS) + "\n")
  out = tmp_path / "vectors.npy"
  assert embed.embed_file(str(tmp_path / "run"), str(tmp_path / "texts.txt"), str(out),
                          pooling="mean", normalize=True, batch_size=1,
                          progress=False) == (2, 32)
  body = transformers.BertModel.from_pretrained(hf_dir).eval()
  ids, mask, types = _batch(load_run(str(tmp_path / "run"))[1])  # the imported tokenizer's marks
  with torch.no_grad():
    hidden = body(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                  token_type_ids=torch.as_tensor(types)).last_hidden_state.numpy()
  mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  mean /= np.linalg.norm(mean, axis=1, keepdims=True)
  np.testing.assert_allclose(np.load(out), mean, atol=1e-5)


def test_export_keeps_rows_past_the_tokenizer(tok, tmp_path):
  """A Qwen2 of 320 rows for the tokenizer's 290 ids (as Qwen2's 151,936 for
  151,646) comes back with its 320 rows, every tensor and logit unchanged."""
  hf_model = _randomised(_llama(transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
  hf_model.eval()
  hf_dir = _save(hf_model, tok, tmp_path / "hf")
  assert _run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run") == 0
  assert _run_convert("to_hf", "--workdir", tmp_path / "run", "--out", tmp_path / "out") == 0
  original = safetensors.numpy.load_file(f"{hf_dir}/model.safetensors")
  exported = safetensors.numpy.load_file(f"{tmp_path}/out/model.safetensors")
  assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
  for name, array in exported.items():
    np.testing.assert_array_equal(array, original[name], err_msg=name)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert back.config.vocab_size == 320
  ids = torch.as_tensor([tok.encode_with_specials("def add(a, b)")])
  with torch.no_grad():
    np.testing.assert_array_equal(back(ids).logits.numpy(), hf_model(ids).logits.numpy())


def test_export_architecture_of_a_classifier():
  """A decoder classifier with last pooling exports as LLaMA's; cls pooling
  has no decoder classifier in transformers, so the refusal names it."""
  from configs import base  # pylint: disable=import-outside-toplevel
  from model.config import ModelConfig  # pylint: disable=import-outside-toplevel
  config = base.get_config()
  config.model.update(num_labels=4, pooling="last")
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).hf_class == (
      "LlamaForSequenceClassification")
  config.model.pooling = "mean"
  with pytest.raises(Exception, match="model.pooling='mean' \\(needs 'last'\\)"):
    hf_convert.export_architecture(ModelConfig.resolve(config.model))
