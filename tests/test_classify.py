"""Sequence classification: config rules, pooling, the data, a run end to end
(train, report, confusion plot, predictions, eval.py --data), a classifier
started from a masked-LM run, and one-line label errors."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from configs.validation import validate
from data import classify, corpora
from model import build_model
from model.classifier import pool
from tests.helpers import ByteTokenizer, ROOT
from training import evaluate, loop

WORDS = {"fruit": "apple banana cherry plum pear", "number": "one two three four five",
         "colour": "red green blue white black"}


def labelled_tsv(path, count=48, extra=""):
  """A .tsv of texts made of one label's words (and `extra` lines)."""
  rng = np.random.default_rng(0)
  lines = ["text\tlabel"]
  for i in range(count):
    label = list(WORDS)[i % 3]
    words = rng.choice(WORDS[label].split(), 6)
    lines.append(f"{' '.join(words)}\t{label}")
  path.write_text("\n".join(lines) + "\n" + extra, encoding="utf-8")
  return str(path)


def encoder_config(tmp_path, paths, **model):
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=260, d_model=32, num_layers=1, num_heads=2,
                 d_ff=64, max_len=32, pos_emb="learned", norm="layernorm",
                 norm_position="post", mlp="gelu", use_bias=True, type_vocab_size=2,
                 embedding_norm=True, attention_impl="xla", num_labels=3, pooling="cls",
                 pooler=True)
  c.model.update(**model)
  c.tokenizer.update(vocab_size=260)
  c.data.update(task="labelled", paths=paths, val_percent=25,
                cache_dir=str(tmp_path / "cache"))
  c.train.update(objective="classify", num_steps=3, batch_size=4, seq_len=32, warmup_steps=1,
                 log_every=1, eval_every=3, eval_steps=2, checkpoint_every=3)
  return c


@pytest.mark.parametrize("change, message", [
    ({"model.num_labels": 0}, "model.num_labels=0: must be the number of classes (> 0) for "
                              "train.objective=classify"),
    ({"train.objective": "mlm", "data.task": "none"},
     "model.num_labels=3: is for train.objective=classify"),
    ({"model.pooling": "mean"}, "model.pooler=True: is for model.pooling=cls"),
    ({"model.pooling": "max"}, "model.pooling='max': must be one of cls, mean, last"),
    ({"data.labels": ("a", "b")}, "data.labels=('a', 'b'): names 2 classes but "
                                  "model.num_labels=3"),
    ({"data.task": "code_summary"}, "data.task='code_summary': needs train.objective=seq2seq "
                                    "(is classify)"),
    ({"data.paths": ""}, "data.paths='': is required for data.task=labelled"),
    ({"model.family": "encoder_decoder"}, "model.num_labels=3: is for model.family=encoder or "
                                          "decoder"),
])
def test_config_rules(tmp_path, change, message):
  c = encoder_config(tmp_path, "x.tsv")
  for field, value in change.items():
    section, key = field.split(".")
    c[section][key] = value
  with pytest.raises(UserError) as err:
    validate(c)
  assert message in str(err.value)


def test_pooling_by_hand():
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(2, 5, 3)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(pool(hidden, mask, "cls"), hidden[:, 0])
  np.testing.assert_allclose(pool(hidden, mask, "mean"),
                             [hidden[0, :3].mean(0), hidden[1].mean(0)], rtol=1e-6)
  np.testing.assert_array_equal(pool(hidden, mask, "last"), [hidden[0, 2], hidden[1, 4]])


@pytest.mark.parametrize("family, pooling", [("encoder", "mean"), ("decoder", "last"),
                                             ("encoder", "cls")])
def test_padding_does_not_change_the_class_logits(family, pooling):
  c = base.get_config()
  c.model.update(family=family, vocab_size=64, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                 num_labels=3, pooling=pooling, attention_impl="xla")
  model = build_model(c.model, nnx.Rngs(0))
  ids = np.array([[5, 6, 7, 8]], np.int32)
  padded = np.array([[5, 6, 7, 8, 0, 0, 0]], np.int32)
  short = model.classify(ids, ids > 0)
  long = model.classify(padded, padded > 0)
  assert short.shape == (1, 3) and short.dtype == np.float32
  np.testing.assert_allclose(short, long, atol=1e-5)
  with pytest.raises(ValueError, match="no LM head"):
    model.logits(model.encoder if family == "encoder" else model.decoder, np.zeros((1, 1, 16)))


def test_stdlib_package_task_is_split_by_module():
  c = base.get_config()
  c.data.update(task="stdlib_package", val_percent=25)
  train, val = (classify.load_examples(c.data, s) for s in ("train", "validation"))
  assert {e.name for e in train}.isdisjoint(e.name for e in val)
  assert all(corpora.is_validation(e.name, 25) for e in val)
  assert {e.label for e in train} == set(classify.PACKAGES) == {e.label for e in val}
  assert all(e.name.split("/")[0] == e.label for e in train[:50])
  assert classify.label_names(c.data) == tuple(sorted(classify.PACKAGES))


def test_rows_of_pairs_jsonl_and_tsv(tmp_path):
  (tmp_path / "a.jsonl").write_text(json.dumps({"q": "ab", "a": "c", "y": 1}) + "\n" +
                                    json.dumps({"q": "d", "a": "ef"}) + "\n")
  (tmp_path / "b.tsv").write_text("q\ta\ty\nxy\tz\t0\n")
  c = base.get_config()
  c.data.update(task="labelled", paths=f"{tmp_path}/a.jsonl,{tmp_path}/b.tsv", val_percent=0,
                text_field="q", text_pair_field="a", label_field="y")
  examples = classify.load_examples(c.data, "train")
  assert [(e.text, e.pair, e.label) for e in examples] == [
      ("ab", "c", "1"), ("d", "ef", None), ("xy", "z", "0")]
  rows = classify.ClassifyRows(examples, ("0", "1"), ByteTokenizerWithSpecials(), seq_len=8)
  row = rows(0)  # BOS a b EOS | c EOS
  np.testing.assert_array_equal(row["inputs"], [1, 101, 102, 2, 103, 2, 0, 0])
  np.testing.assert_array_equal(row["token_types"], [0, 0, 0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(row["padding_mask"], [1, 1, 1, 1, 1, 1, 0, 0])
  assert (int(row["labels"]), float(row["weights"])) == (1, 1.0)
  assert float(rows(1)["weights"]) == 0.0 and float(rows(3)["weights"]) == 0.0  # no label, filler
  with pytest.raises(UserError, match=r"b.tsv:2: label '0' is not one of the run's 1 labels "
                                      r"\(1\)"):
    classify.ClassifyRows(examples, ("1",), ByteTokenizerWithSpecials(), seq_len=8)


class ByteTokenizerWithSpecials(ByteTokenizer):
  def encode_classified(self, text, pair=None):
    from tokenizer.base import Tokenizer  # pylint: disable=import-outside-toplevel
    return Tokenizer.encode_classified(self, text, pair)


def test_a_classifier_starts_from_a_language_model_with_a_fresh_head(tmp_path, capsys):
  """The body must match; only the classifier is new, and one line says so."""
  def params(**model):
    c = encoder_config(tmp_path, "x.tsv", **model)
    return nnx.state(nnx.eval_shape(lambda: build_model(c.model, nnx.Rngs(0))), nnx.Param)
  c = encoder_config(tmp_path, "x.tsv")
  mlm = params(num_labels=0, pooler=False, head_transform=True, output_bias=True)
  loop._check_source_shapes(c, "train.restore_from='mlm'", mlm, params())
  assert capsys.readouterr().out == (
      "train.restore_from='mlm': the classification head (classifier/out/bias, "
      "classifier/out/kernel, classifier/pooler/bias, classifier/pooler/kernel) is initialised "
      "fresh; the source's head_transform/dense/bias, head_transform/dense/kernel, "
      "head_transform/norm/bias, head_transform/norm/scale, output_bias is not used\n")
  with pytest.raises(UserError, match="its parameters have other shapes"):
    loop._check_source_shapes(c, "train.restore_from='mlm'", mlm, params(d_ff=48))


@pytest.mark.slow
def test_train_report_predictions_and_a_start_from_masked_lm(tmp_path, capsys):
  """A masked-LM encoder run, then a classifier started from it (its own head
  fresh, one line says so), its report and plots, and eval.py --data."""
  paths = labelled_tsv(tmp_path / "train.tsv")
  mlm = encoder_config(tmp_path, paths, head_transform=True, output_bias=True)
  mlm.model.update(num_labels=0, pooler=False)
  mlm.data.update(task="none", source="pydoc", paths="")
  mlm.train.update(objective="mlm", num_steps=1, checkpoint_every=1, eval_every=1)
  loop.train(mlm, str(tmp_path / "mlm"))
  c = encoder_config(tmp_path, paths, head_transform=True, output_bias=True)
  c.train.restore_from = str(tmp_path / "mlm")
  loop.train(c, str(tmp_path / "run"))
  out = capsys.readouterr().out
  assert ("the classification head (classifier/out/bias, classifier/out/kernel, "
          "classifier/pooler/bias, classifier/pooler/kernel) is initialised fresh; the "
          "source's head_transform/dense/bias") in out
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["data"]["labels"] == ["colour", "fruit", "number"]

  report = evaluate.run_eval(str(tmp_path / "run"))
  assert report["labels"] == ["colour", "fruit", "number"]
  assert 0 <= report["accuracy"] <= 1 and 0 <= report["macro_f1"] <= 1
  assert set(report["per_class"]) == {"colour", "fruit", "number"}
  assert np.sum(report["confusion_matrix"]) == report["labelled_examples"] == report["examples"]
  assert report["majority_baseline"]["accuracy"] >= 1 / 3
  folder = tmp_path / "run" / "eval" / f"step_{report['step']}"
  assert json.loads((tmp_path / "run" / "eval_report.json").read_text()) == json.loads(
      (folder / "eval_report.json").read_text())
  assert (folder / "confusion_matrix.png").stat().st_size > 1000
  lines = (folder / "predictions.jsonl").read_text().splitlines()
  assert len(lines) == report["examples"] and {"name", "label", "probability", "true"} == set(
      json.loads(lines[0]))

  user = tmp_path / "user.jsonl"
  user.write_text(json.dumps({"text": "red blue"}) + "\n" + json.dumps({"text": "one two"}) + "\n")
  report = evaluate.run_eval(str(tmp_path / "run"), data=str(user))
  assert report["examples"] == 2 and "accuracy" not in report  # nothing to score
  user_folder = folder.parent / f"{folder.name}_data-user.jsonl"
  predictions = [json.loads(x) for x in (user_folder / "predictions.jsonl").open()]
  # The whole-split report is left as it was.
  assert json.loads((tmp_path / "run" / "eval_report.json").read_text())["accuracy"] >= 0
  assert [p["name"] for p in predictions] == [f"{user}:1", f"{user}:2"]
  assert all(p["label"] in WORDS for p in predictions)
  user.write_text(json.dumps({"text": "red", "label": "animal"}) + "\n")
  with pytest.raises(UserError, match=f"{user}:1: label 'animal' is not one of the run's 3 "):
    evaluate.run_eval(str(tmp_path / "run"), data=str(user))


def test_label_count_error_is_one_line_exit_2(tmp_path):
  c = encoder_config(tmp_path, labelled_tsv(tmp_path / "t.tsv"))
  result = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/classify_encoder.py", "--workdir",
       str(tmp_path / "run"), "--config.data.task=labelled", f"--config.data.paths={c.data.paths}",
       "--config.model.num_labels=4"], capture_output=True, text=True, cwd=ROOT, check=False)
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert errors == ["error: model.num_labels=4 but the data has 3 labels (colour, fruit, "
                    "number); set --config.model.num_labels=3"]
  assert not (tmp_path / "run").exists()


def test_presets_validate():
  from configs import classify_decoder, classify_encoder  # pylint: disable=import-outside-toplevel
  for module in (classify_encoder, classify_decoder):
    validate(module.get_config())
  assert jax.tree.leaves(classify_decoder.get_config().model.pooling) == ["last"]
