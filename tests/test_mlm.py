"""Masked LM: BERT masking rates and exclusions, deterministic masks, the
pipeline (exact resume, new masks every epoch) and the eval report."""
import json

import numpy as np
import pytest

from configs import base
from data import masking
from data import pipeline
from training import evaluate
from tests.helpers import assert_batches_equal, ByteTokenizer, make_config, take

PAD, BOS, EOS, MASK = 0, 1, 2, 3


def masker(probability=0.15):
  return masking.BertMasking(probability, vocab_size=260, mask_id=MASK,
                             special_ids=(PAD, BOS, EOS, MASK))


def random_row(rng, length=512):
  tokens = rng.integers(4, 260, length).astype(np.int32)
  tokens[[0, 100, 200]] = BOS
  tokens[[99, 199]] = EOS
  segment_ids = np.ones(length, np.int32)
  segment_ids[-50:] = 0
  tokens[-50:] = PAD
  return {"inputs": tokens, "targets": np.roll(tokens, -1), "segment_ids": segment_ids,
          "positions": np.arange(length, dtype=np.int32),
          "loss_mask": np.ones(length, np.float32)}


def test_masking_rates_are_bert_80_10_10():
  rng = np.random.default_rng(0)
  selected = masked = randomised = kept = candidates = 0
  for _ in range(200):
    row = random_row(rng)
    out = masker().random_map(row, rng)
    sel = out["loss_mask"] > 0
    candidates += (row["segment_ids"] > 0).sum() - 5
    selected += sel.sum()
    masked += (out["inputs"][sel] == MASK).sum()
    same = out["inputs"][sel] == row["inputs"][sel]
    kept += same.sum()
    randomised += (~same & (out["inputs"][sel] != MASK)).sum()
    np.testing.assert_array_equal(out["targets"], row["inputs"])
    np.testing.assert_array_equal(out["inputs"][~sel], row["inputs"][~sel])
  assert abs(selected / candidates - 0.15) < 0.005
  # A random replacement equals the original 1 time in 256: counted as kept.
  assert abs(masked / selected - 0.8) < 0.01
  assert abs(randomised / selected - 0.1 * 255 / 256) < 0.01
  assert abs(kept / selected - (0.1 + 0.1 / 256)) < 0.01


def test_masking_never_selects_padding_or_specials_nor_writes_specials():
  rng = np.random.default_rng(1)
  for _ in range(50):
    row = random_row(rng)
    out = masker(0.9).random_map(row, rng)
    sel = out["loss_mask"] > 0
    assert not sel[row["segment_ids"] == 0].any()
    assert not np.isin(row["inputs"][sel], [PAD, BOS, EOS, MASK]).any()
    replaced = sel & (out["inputs"] != row["inputs"]) & (out["inputs"] != MASK)
    assert (out["inputs"][replaced] >= 4).all()
    np.testing.assert_array_equal(out["inputs"][row["segment_ids"] == 0], PAD)


def test_masks_are_deterministic_per_seed():
  row = random_row(np.random.default_rng(2))
  a = masker().random_map(row, np.random.default_rng(7))
  b = masker().random_map(row, np.random.default_rng(7))
  c = masker().random_map(row, np.random.default_rng(8))
  assert_batches_equal([a], [b])
  assert not np.array_equal(a["loss_mask"], c["loss_mask"])


def mlm_config(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  config.model.family = "encoder"
  config.train.objective = "mlm"
  return config


def test_mlm_batches_resume_exactly_and_remask_every_epoch(tmp_path):
  config = mlm_config(tmp_path)
  config.data.update(source="files", paths=str(tmp_path / "*.txt"), val_percent=0)
  for i in range(3):
    (tmp_path / f"d{i}.txt").write_text(f"document number {i} with some words", "utf-8")
  config.train.batch_size = 1
  tok = ByteTokenizer()
  iterator = pipeline.make_train_iterator(config, tok)
  first = take(iterator, 3)
  state = iterator.get_state()
  expected = take(iterator, 12)
  restored = pipeline.make_train_iterator(config, tok)
  restored.set_state(state)
  assert_batches_equal(take(restored, 12), expected)
  rows = {}
  for batch in first + expected:
    key = tuple(batch["targets"][0])
    rows.setdefault(key, []).append(tuple(batch["loss_mask"][0]))
  assert all(len(masks) > 1 for masks in rows.values())  # every row came back...
  assert all(len(set(masks)) > 1 for masks in rows.values())  # ...masked anew
  for batch in first:
    assert (batch["loss_mask"] <= (batch["segment_ids"] > 0)).all()


def test_mlm_eval_batches_are_fixed(tmp_path):
  config = mlm_config(tmp_path)
  tok = ByteTokenizer()
  a, b = (pipeline.make_eval_batches(config, tok, 2) for _ in range(2))
  assert_batches_equal(a, b)
  assert 0.1 < a[0]["loss_mask"].sum() / (a[0]["segment_ids"] > 0).sum() < 0.2


def test_mlm_train_and_eval_report(tmp_path):
  from training import loop  # pylint: disable=import-outside-toplevel
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=260, d_model=32, num_layers=1, num_heads=2,
                 d_ff=64, max_len=32, pos_emb="learned", attention_impl="xla")
  c.model.update(norm="layernorm", norm_position="post", mlp="gelu", use_bias=True,
                 type_vocab_size=2, embedding_norm=True, head_transform=True,
                 output_bias=True)  # BERT's layout (configs/bert_base.py)
  c.tokenizer.update(vocab_size=260)
  c.data.update(source="pydoc", cache_dir=str(tmp_path / "cache"))
  c.train.update(objective="mlm", num_steps=2, batch_size=4, seq_len=32, warmup_steps=1,
                 log_every=1, eval_every=2, eval_steps=1, checkpoint_every=2)
  workdir = tmp_path / "run"
  loop.train(c, str(workdir))
  evaluate.run_eval(str(workdir))
  report = json.loads((workdir / "eval_report.json").read_text())
  for key in ("masked_token_accuracy", "masked_tokens", "unigram_accuracy", "unigram_loss"):
    assert key in report
  assert 0 < report["unigram_accuracy"] < 0.5 and report["masked_tokens"] > 0
  assert (workdir / "eval" / "step_2" / "attention_maps.png").exists()


@pytest.mark.parametrize("probability", [0.0, 1.0])
def test_mlm_probability_must_be_a_fraction(probability):
  from configs.validation import validate  # pylint: disable=import-outside-toplevel
  from configs.errors import UserError  # pylint: disable=import-outside-toplevel
  c = base.get_config()
  c.model.family, c.train.objective = "encoder", "mlm"
  c.train.mlm_probability = probability
  with pytest.raises(UserError, match=f"train.mlm_probability={probability}: must be in"):
    validate(c)
