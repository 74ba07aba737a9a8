"""Seq2seq: padding masks, the prefix-LM loss, beam search, batched generation,
the tasks (synthetic, code summary, user pairs), their rows and the report."""
import json
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from configs.validation import validate
from data import corpora
from data import pipeline
from data import seq2seq
from data import tasks
from model import build_model
from model.generate import beam_search, generate
from training import evaluate
from training.objectives import batch_loss
from tests.helpers import assert_batches_equal, ByteTokenizer, small_cfg, t5_like, take

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9], [10, 11, 12]]
PAD, BOS, EOS = 0, 1, 2
ROOT = pathlib.Path(__file__).resolve().parents[1]


def task_config(tmp_path=None, **overrides):
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=260, d_model=32, num_layers=1,
                 num_heads=2, d_ff=64, max_len=64, attention_impl="xla")
  c.tokenizer.update(vocab_size=260)
  c.data.update(task="reverse", task_size=200, task_test_size=20, task_min_len=3,
                task_max_len=8)
  if tmp_path is not None:
    c.data.cache_dir = str(tmp_path / "cache")
  c.train.update(objective="seq2seq", batch_size=4, seq_len=12, num_steps=2, warmup_steps=1,
                 log_every=1, eval_every=2, eval_steps=1, checkpoint_every=2)
  for key, value in overrides.items():
    section, name = key.split("__")
    c[section][name] = value
  return c


# Padding masks (the lesson's pitfall: padding forgotten in batched encoders).

def test_encoder_padding_does_not_change_real_positions():
  cfg = small_cfg(family="encoder", pos_emb="learned")
  model = build_model(cfg, nnx.Rngs(0))
  tokens = jnp.array([[5, 6, 7, 8, 9, 10]])
  alone = model(tokens[:, :4])
  padded = jnp.array([[5, 6, 7, 8, 0, 0]])
  batched = model(jnp.concatenate([padded, tokens]),
                  padding_mask=jnp.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool))
  np.testing.assert_allclose(batched[0, :4], alone[0], atol=1e-5)
  np.testing.assert_allclose(batched[1], model(tokens)[0], atol=1e-5)
  unmasked = model(padded)  # Without the mask the padding leaks in.
  assert not np.allclose(unmasked[0, :4], alone[0], atol=1e-3)


@pytest.mark.parametrize("pos_emb,num_decoder_layers", [
    pytest.param("sinusoidal", None, marks=pytest.mark.slow), ("rope", 1)])
def test_encoder_decoder_source_padding_is_masked_in_encoder_and_cross_attention(
    pos_emb, num_decoder_layers):
  cfg = small_cfg(family="encoder_decoder", pos_emb=pos_emb,
                  num_decoder_layers=num_decoder_layers)
  model = build_model(cfg, nnx.Rngs(0))
  src, tgt = jnp.array([[5, 6, 7]]), jnp.array([[1, 9, 10]])
  alone = model(src, tgt)
  padded = jnp.array([[5, 6, 7, 0, 0]])
  mask = jnp.array([[1, 1, 1, 0, 0]], bool)
  np.testing.assert_allclose(model.encode(padded, mask)[0, :3], model.encode(src)[0], atol=1e-5)
  np.testing.assert_allclose(model(padded, tgt, src_padding_mask=mask), alone, atol=1e-5)
  # Without the mask the padding leaks in.
  assert not np.allclose(model(padded, tgt), alone, atol=1e-3)


# The prefix LM.

def test_prefix_lm_row_worked_example():
  rows = seq2seq.PairRows([("ab", "xyz")], ByteTokenizer(), family="decoder", seq_len=10)
  row = rows(0)
  a, b, x, y, z = (ord(ch) + 4 for ch in "abxyz")
  np.testing.assert_array_equal(row["inputs"], [BOS, a, b, EOS, x, y, z, PAD, PAD, PAD])
  np.testing.assert_array_equal(row["targets"], [a, b, EOS, x, y, z, EOS, PAD, PAD, PAD])
  np.testing.assert_array_equal(row["loss_mask"], [0, 0, 0, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(row["segment_ids"], [1] * 7 + [0] * 3)
  np.testing.assert_array_equal(row["positions"], list(range(7)) + [0] * 3)
  assert rows.prompt(0) == [BOS, a, b, EOS]


def test_encoder_decoder_row_worked_example():
  rows = seq2seq.PairRows([("ab", "xyz")], ByteTokenizer(), family="encoder_decoder",
                          seq_len=4, tgt_seq_len=6)
  row = rows(0)
  a, b, x, y, z = (ord(ch) + 4 for ch in "abxyz")
  np.testing.assert_array_equal(row["src"], [a, b, PAD, PAD])
  np.testing.assert_array_equal(row["src_mask"], [1, 1, 0, 0])
  np.testing.assert_array_equal(row["tgt_in"], [BOS, x, y, z, PAD, PAD])
  np.testing.assert_array_equal(row["tgt_out"], [x, y, z, EOS, PAD, PAD])
  np.testing.assert_array_equal(row["loss_mask"], [1, 1, 1, 1, 0, 0])
  assert (rows(1)["loss_mask"] == 0).all() and (rows(1)["src_mask"] == 0).all()


def test_prefix_lm_loss_ignores_the_source():
  cfg = small_cfg(family="decoder", vocab_size=260, max_len=16)
  model = build_model(cfg, nnx.Rngs(0))
  rows = seq2seq.PairRows([("hello", "olleh"), ("abc", "cba")], ByteTokenizer(),
                          family="decoder", seq_len=16)
  batch = {k: np.stack([rows(0)[k], rows(1)[k]]) for k in rows(0)}
  loss_sum, count, _, _ = batch_loss("seq2seq", model, batch)
  assert count == 6 + 4  # target tokens + EOS of each pair
  changed = dict(batch, targets=np.where(batch["loss_mask"] > 0, batch["targets"], 77))
  assert float(batch_loss("seq2seq", model, changed)[0]) == float(loss_sum)


def test_pairs_that_do_not_fit_are_dropped_or_refused(tmp_path):
  c = task_config(tmp_path, model__family="decoder", data__task_min_len=3, data__task_max_len=8,
                  train__seq_len=12)
  rows = seq2seq.load_rows(c, ByteTokenizer(), "train")
  assert rows.num_dropped > 0  # 2 * length + 2 > 12 for length >= 6
  assert all(len(s) + len(t) + 2 <= 12 for s, t in zip(rows.src_ids, rows.tgt_ids))
  c.train.seq_len = 6
  with pytest.raises(UserError, match="none of the .* train pairs fits"):
    seq2seq.load_rows(c, ByteTokenizer(), "train")


def test_seq2seq_needs_a_task():
  c = task_config(data__task="none")
  with pytest.raises(UserError, match="train.objective=seq2seq needs data.task"):
    seq2seq.load_rows(c, ByteTokenizer(), "train")


# Beam search and batched generation.

def _generate_both(model, cfg, prompts, beam_size=None, **kwargs):
  if cfg.family == "encoder_decoder":
    kwargs["sources"], prompts = prompts, [[1]] * len(prompts)
  if beam_size is None:
    return generate(model, cfg, prompts, **kwargs)
  return beam_search(model, cfg, prompts, beam_size=beam_size, **kwargs)


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_beam_one_is_greedy(family):
  cfg = small_cfg(family=family, tie_embeddings=False)
  model = build_model(cfg, nnx.Rngs(0))
  kwargs = dict(max_new_tokens=8, eos_id=5)
  assert (_generate_both(model, cfg, PROMPTS, beam_size=1, **kwargs)
          == _generate_both(model, cfg, PROMPTS, **kwargs))


@pytest.mark.parametrize("family", [
    pytest.param("decoder", marks=pytest.mark.slow), "encoder_decoder"])
def test_batched_beam_search_equals_one_by_one(family):
  cfg = small_cfg(family=family, tie_embeddings=False)
  model = build_model(cfg, nnx.Rngs(1))
  prompts = PROMPTS[:3]
  kwargs = dict(max_new_tokens=6, eos_id=5)
  batched = _generate_both(model, cfg, prompts, beam_size=3, **kwargs)
  assert batched == [_generate_both(model, cfg, [p], beam_size=3, **kwargs)[0] for p in prompts]
  widths = {"prompt_width": 9} if family == "decoder" else {"source_width": 9}
  assert (_generate_both(model, cfg, prompts, **kwargs, **widths)
          == _generate_both(model, cfg, prompts, **kwargs))


# The tasks.

@pytest.mark.parametrize("task", tasks.SYNTHETIC_TASKS)
def test_synthetic_tasks_are_deterministic_and_exactly_scorable(task):
  c = task_config(data__task=task, data__task_min_len=2, data__task_max_len=9,
                  data__task_test_min_len=7)
  train, held_out = tasks.load_pairs(c.data, "train"), tasks.load_pairs(c.data, "validation")
  assert train == tasks.load_pairs(c.data, "train") and len(held_out) == 20
  assert not {s for s, _ in train} & {s for s, _ in held_out}
  c.data.task_seed = 1
  assert tasks.load_pairs(c.data, "train") != train
  for src, tgt in train + held_out:
    if task == "reverse":
      assert src.isalpha() and tgt == "".join(reversed(src))
    elif task == "sort":
      assert src.isdigit() and tgt == "".join(sorted(src))
    else:
      a, b = src.split("+")
      assert int(tgt) == int(a) + int(b) and str(int(a)) == a
  lengths = [len(s) for s, _ in held_out] if task != "addition" else [
      len(n) for s, _ in held_out for n in s.split("+")]
  assert min(lengths) >= 7 and max(lengths) <= 9


def test_addition_carries():
  rng = np.random.default_rng(0)
  pairs = [tasks.make_example("addition", rng, 3, 3) for _ in range(200)]
  assert any(len(t) == 4 for _, t in pairs)  # a carry out of the top digit
  assert all(int(t) == sum(map(int, s.split("+"))) for s, t in pairs)


def test_addition_formats():
  assert tasks.addition_pair(12, 5, "plain", 3) == ("12+5", "17")
  assert tasks.addition_pair(12, 5, "aligned", 3) == ("012+005", "7100")
  assert tasks.addition_pair(999, 1, "aligned", 3) == ("999+001", "0001")
  assert tasks.addition_pair(0, 0, "aligned", 2) == ("00+00", "000")


def test_aligned_addition_draws_the_plain_numbers():
  c = task_config(data__task="addition", data__task_min_len=1, data__task_max_len=5,
                  data__task_test_min_len=4)
  plain = {split: tasks.load_pairs(c.data, split) for split in ("train", "validation")}
  c.data.task_addition_format = "aligned"
  aligned = {split: tasks.load_pairs(c.data, split) for split in ("train", "validation")}
  for split in ("train", "validation"):
    assert len(aligned[split]) == len(plain[split])
    for (src, tgt), (plain_src, plain_tgt) in zip(aligned[split], plain[split]):
      a, b = src.split("+")
      assert len(a) == len(b) == 5 and len(tgt) == 6
      assert f"{int(a)}+{int(b)}" == plain_src and int(tgt[::-1]) == int(plain_tgt)
  assert min(len(n.lstrip("0")) for s, _ in aligned["validation"] for n in s.split("+")) == 4


SNIPPET = '''
import os

def get_item_count(items, *, strict=False):
    """Return the number of items.

    More text here.
    """
    # Counted in one pass.
    return len(items)

class Box:
    def open(self):
        """Open the box."""
        self.is_open = True

    def empty(self):
        """Only a docstring."""

def no_doc(x):
    return x

def one_line(): "Same line."; return 1
'''


def test_code_summary_extraction():
  summaries = tasks.function_summaries(SNIPPET)
  assert [(name, summary) for name, _, summary in summaries] == [
      ("get_item_count", "Return the number of items."), ("open", "Open the box.")]
  source = summaries[0][1]
  assert source == ("def get_item_count(items, *, strict=False):\n"
                    "    # Counted in one pass.\n    return len(items)")
  assert summaries[1][1] == "def open(self):\n    self.is_open = True"
  assert tasks.name_baseline(source) == "get item count"
  assert tasks.name_baseline("def __init__(self):\n  pass") == "init"
  assert tasks.function_summaries("def broken(:\n") == []


def test_code_summary_is_split_by_module():
  c = task_config(data__task="code_summary")
  everything = tasks.stdlib_function_summaries()
  held_out = [(src, tgt) for module, _, src, tgt in everything
              if corpora.is_validation(module, c.data.val_percent)]
  train, val = tasks.load_pairs(c.data, "train"), tasks.load_pairs(c.data, "validation")
  assert val == held_out and len(train) + len(val) == len(everything)
  assert len(train) > 1000 and 0 < len(val) < len(train) / 5


def write(path, text):
  path.write_text(text, encoding="utf-8")
  return str(path)


def test_tsv_and_jsonl_pairs(tmp_path):
  write(tmp_path / "a.tsv", "id\tquestion\tanswer\n1\twhat\tthat\n\n2\tone\ttwo\n")
  write(tmp_path / "b.jsonl", '{"question": "q", "answer": "a", "x": 1}\n\n'
        '{"question": "r", "answer": "b"}\n')
  c = task_config(data__task="pairs", data__paths=f"{tmp_path}/*.tsv,{tmp_path}/*.jsonl",
                  data__src_field="question", data__tgt_field="answer", data__val_percent=0)
  pairs = tasks.load_pairs(c.data, "train")
  assert pairs == [("what", "that"), ("one", "two"), ("q", "a"), ("r", "b")]
  assert tasks.file_pairs(c.data)[1][0] == f"{tmp_path}/a.tsv:4"
  assert tasks.tokenizer_texts(c.data) == ["what", "that", "one", "two", "q", "a", "r", "b"]


@pytest.mark.parametrize("name,text,message", [
    ("a.tsv", "src\tother\nx\ty\n", "has no column 'tgt'"),
    ("a.tsv", "src\ttgt\nx\ty\tz\n", "a.tsv:2: 3 tab-separated columns, the header has 2"),
    ("a.jsonl", '{"src": "x"}\n', "a.jsonl:1: line has no string field 'tgt'"),
    ("a.jsonl", '{"src": "x", "tgt": 3}\n', "no string field 'tgt'"),
    ("a.jsonl", "not json\n", "a.jsonl:1: line is not valid JSON"),
    ("a.txt", "x\ty\n", "reads .tsv (with a header row) or .jsonl"),
    ("a.tsv", "src\ttgt\n", "no pairs"),
])
def test_pair_file_errors(tmp_path, name, text, message):
  c = task_config(data__task="pairs", data__paths=write(tmp_path / name, text))
  with pytest.raises(UserError, match=re.escape(message)) as err:
    tasks.load_pairs(c.data, "train")
  assert "\n" not in str(err.value)


def test_pairs_task_needs_paths_and_seq2seq():
  c = task_config(data__task="pairs")
  with pytest.raises(UserError, match="data.paths='': is required for data.task=pairs"):
    validate(c)
  c = task_config(data__task="sort", train__objective="next_token", model__family="decoder")
  with pytest.raises(UserError, match="data.task='sort': needs train.objective=seq2seq"):
    validate(c)


def test_objective_that_does_not_fit_the_family_is_one_line():
  result = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/seq2seq_reverse.py", "--workdir",
       "/nonexistent/run", "--config.train.objective=mlm"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert result.stderr.strip() == (
      "error: config field train.objective='mlm': does not fit "
      "model.family=encoder_decoder; use one of seq2seq")


# The pipeline and the tokenizer's texts.

@pytest.mark.parametrize("family,keys", [
    ("decoder", ("inputs", "targets", "segment_ids", "positions", "loss_mask")),
    ("encoder_decoder", ("src", "src_mask", "tgt_in", "tgt_out", "loss_mask"))])
def test_task_batches_resume_exactly(tmp_path, family, keys):
  c = task_config(tmp_path, model__family=family, train__seq_len=20)
  tok = ByteTokenizer()
  iterator = pipeline.make_train_iterator(c, tok)
  first = take(iterator, 2)
  assert tuple(sorted(first[0])) == tuple(sorted(keys))
  assert all(v.shape == (4, 20) for v in first[0].values())
  state = iterator.get_state()
  expected = take(iterator, 3)
  restored = pipeline.make_train_iterator(c, tok)
  restored.set_state(state)
  assert_batches_equal(take(restored, 3), expected)
  (batch,) = pipeline.make_eval_batches(c, tok, 1)
  assert batch["loss_mask"].sum() > 0
  assert pipeline.tokenizer_texts(c.data, c.tokenizer.train_bytes)[:2] == list(tasks.load_pairs(c.data, "train")[0])


@pytest.mark.parametrize("family", [
    pytest.param("decoder", marks=pytest.mark.slow), "encoder_decoder"])
def test_train_and_eval_report(tmp_path, family):
  from training import loop  # pylint: disable=import-outside-toplevel
  c = task_config(tmp_path, model__family=family, train__seq_len=20)
  workdir = str(tmp_path / "run")
  loop.train(c, workdir)
  report = evaluate.run_eval(workdir, beam_size=2, max_examples=6)
  saved = json.loads((tmp_path / "run" / "eval_report.json").read_text())
  assert saved["data"] == "task=reverse" and saved["examples"] == 6
  for search in ("greedy", "beam"):
    assert {"exact_match", "bleu", "chrf"} <= set(saved[search])
  assert saved["samples"][0]["reference"] == "".join(reversed(saved["samples"][0]["source"]))
  plot = tmp_path / "run" / "eval" / f"step_{saved['step']}" / "attention_maps.png"
  assert plot.exists() == (family == "decoder")
  assert report["files"]
  # --data: the run scored on your pairs, in a folder of their own.
  probe = tmp_path / "probe.tsv"
  probe.write_text("src\ttgt\nabc\tcba\nhello\tolleh\nxyz\tzyx\n")
  mine = evaluate.run_eval(workdir, data=str(probe), beam_size=2)
  assert (mine["data"], mine["data_override"], mine["examples"]) == ("task=pairs", str(probe), 3)
  assert mine["bleu_tokenize"] == "char"  # the run's task is synthetic
  assert [s["source"] for s in mine["samples"]] == ["abc", "hello", "xyz"]
  assert (tmp_path / "run" / "eval" / f"step_{saved['step']}_data-probe.tsv"
          / "eval_report.json").exists()
  assert json.loads((tmp_path / "run" / "eval_report.json").read_text()) == saved
  with pytest.raises(UserError, match="--data stdlib: a seq2seq run is scored on pairs"):
    evaluate.run_eval(workdir, data="stdlib")


def test_text_scores():
  scores = evaluate.text_scores(["Return the sum.", "x"], ["Return the sum.", "y"])
  assert scores["exact_match"] == 0.5 and scores["chrf"] > 0 and scores["bleu"] > 0


@pytest.mark.parametrize("decoder_start, start_id", [("pad", PAD), ("eos", EOS)])
def test_decoder_start_replaces_bos(decoder_start, start_id):
  """model.decoder_start=pad (T5) or eos (BART): the decoder's first input,
  in training rows and as the generation prompt, is the pad or EOS id."""
  rows = seq2seq.PairRows([("ab", "xyz")], ByteTokenizer(), family="encoder_decoder",
                          seq_len=4, tgt_seq_len=6, decoder_start=decoder_start)
  x, y, z = (ord(ch) + 4 for ch in "xyz")
  np.testing.assert_array_equal(rows(0)["tgt_in"], [start_id, x, y, z, PAD, PAD])
  np.testing.assert_array_equal(rows(0)["tgt_out"], [x, y, z, EOS, PAD, PAD])
  assert rows.prompt(0) == [start_id]


def _bart_like_tokenizer(directory):
  """A byte-level BPE with BART's specials and its post-processor
  (`<s> $A </s>`), saved by transformers."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["def add(a, b): return a + b", "Return the sum."] * 3,
                          trainers.BpeTrainer(
                              vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False))
  tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
  PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>",
                          eos_token="</s>", unk_token="<unk>").save_pretrained(directory)


@pytest.mark.hf
@pytest.mark.parametrize("kind, decoder_start", [("t5", "pad"), ("bart", "eos")])
def test_pair_specials_frame_pairs_as_transformers(kind, decoder_start, tmp_path):
  """data.pair_specials (set by T5 and BART imports): the source is what
  transformers' tokenizer gives, tgt_out the labels `tokenizer(text_target=)`
  gives, tgt_in those labels shifted right from the decoder start, as
  transformers' `shift_tokens_right` makes the decoder inputs."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  if kind == "t5":
    tok, special = t5_like()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(
        tmp_path)
  else:
    _bart_like_tokenizer(tmp_path)
  reference, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), \
      tokenizer_lib.load_tokenizer(tmp_path)
  src, tgt = "def add(a, b): return a + b", "Return the sum."
  rows = seq2seq.PairRows([(src, tgt)], ours, family="encoder_decoder", seq_len=40,
                          tgt_seq_len=30, decoder_start=decoder_start, specials=True)
  row = rows(0)
  want_src = reference(src)["input_ids"]
  labels = reference(text_target=tgt)["input_ids"]
  start = seq2seq.decoder_start_id(ours, decoder_start)
  shift = transformers.models.bart.modeling_bart.shift_tokens_right
  want_in = shift(torch.tensor([labels]), ours.pad_id, start)[0].tolist()
  assert row["src"][:len(want_src)].tolist() == want_src and row["src_mask"].sum() == len(
      want_src)
  assert row["tgt_out"][:len(labels)].tolist() == labels
  assert row["tgt_in"][:len(labels)].tolist() == want_in
  assert row["loss_mask"].sum() == len(labels)
  plain = seq2seq.PairRows([(src, tgt)], ours, family="encoder_decoder", seq_len=40,
                           tgt_seq_len=30, decoder_start=decoder_start)(0)
  assert plain["src"][:len(want_src)].tolist() != want_src


def test_pair_specials_is_for_encoder_decoders():
  c = base.get_config()
  c.train.objective = "seq2seq"
  c.data.update(task="reverse", pair_specials=True)
  with pytest.raises(UserError, match="data.pair_specials=True: is for model.family="
                                      "encoder_decoder"):
    validate(c)
