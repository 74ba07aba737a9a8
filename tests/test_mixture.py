"""Weighted data mixtures (data.mixture): parsing and names, one-line errors,
the weights' share of the drawn tokens, exact resume, per-source validation
in training and in eval.py, sweeps over the weights; and the stream of a run
without a mixture, unchanged."""
import hashlib
import json

import jax
import numpy as np
import pytest

import sweeps as sweep_lib
from configs import base
from configs.errors import UserError
from configs.validation import mixture_parts, validate
from data import mixture
from data import pipeline
from training import evaluate, loop
from training.metrics import read_metrics
from tests.helpers import (ByteTokenizer, TINY, assert_batches_equal, final_params, make_config,
                           small_config, take, write_files, write_sweep)

A, B = ord("a") + 4, ord("b") + 4  # ByteTokenizer's ids of "a" and "b"


def two_sources(tmp_path, weights=(0.8, 0.2)):
  """A config mixing files of "a"s and files of "b"s, in tmp_path (the cwd)."""
  write_files(tmp_path, {f"a/d{i}.txt": "a" * (20 + 7 * i) for i in range(30)})
  write_files(tmp_path, {f"b/d{i}.txt": "b" * (20 + 5 * i) for i in range(30)})
  return make_config(tmp_path, val_percent=20,
                     mixture=f"files:a/*.txt={weights[0]},files:b/*.txt={weights[1]}")


def test_parts_names_and_weights():
  data = base.get_config().data
  data.mixture = ("stdlib=0.7, jsonl:/data/notes/*.jsonl=0.2,parquet:wiki.parquet=1e-1,"
                  "files:x/*.txt,y/*.txt=1,files:*.md=2,jsonl:/other/notes/a*.jsonl=3")
  assert [(p.name, p.source, p.paths, p.weight) for p in mixture_parts(data)] == [
      ("stdlib", "stdlib", "", 0.7), ("jsonl-notes", "jsonl", "/data/notes/*.jsonl", 0.2),
      ("parquet-wiki", "parquet", "wiki.parquet", 0.1),
      ("files-x", "files", "x/*.txt,y/*.txt", 1.0), ("files", "files", "*.md", 2.0),
      ("jsonl-notes-2", "jsonl", "/other/notes/a*.jsonl", 3.0)]
  data.mixture = ""
  assert mixture_parts(data) == []


@pytest.mark.parametrize("value,fragment", [
    ("stdlib=0.8,pydoc=0", "the weight of pydoc is '0'; a weight is a number > 0"),
    ("stdlib=-1", "the weight of stdlib is '-1'"),
    ("stdlib=lots", "the weight of stdlib is 'lots'"),
    ("stdlib=nan", "the weight of stdlib is 'nan'"),
    ("wiki=1", "'wiki' is not a source; each is one of stdlib, pydoc"),
    ("stdlib=1,,pydoc=1", "an empty source between commas"),
    ("stdlib=1,pydoc", "'pydoc' has no weight"),
    ("jsonl=1", "jsonl needs its files: jsonl:<paths or globs>=1"),
    ("stdlib:a.txt=1", "stdlib is built in and takes no paths; write stdlib=1"),
    ("pydoc=1,pydoc=2", "names pydoc: twice"),
    ("stdlib=1,pydoc=0.00001", "weighs its sources 1e+05 to 1; at most 10,000 to 1"),
])
def test_a_bad_mixture_is_one_line_naming_the_field(value, fragment):
  config = base.get_config()
  config.data.mixture = value
  with pytest.raises(UserError, match="data.mixture") as e:
    validate(config)
  assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_mixture_beside_data_paths_or_a_task_is_refused():
  config = base.get_config()
  config.data.update(mixture="stdlib=1,pydoc=1", paths="a/*.txt")
  with pytest.raises(UserError, match="data.paths='a/\\*.txt': is unused beside data.mixture"):
    validate(config)
  config.data.paths = ""
  config.train.objective, config.data.task = "seq2seq", "reverse"
  with pytest.raises(UserError, match="train.objective=seq2seq reads data.task: unset"):
    validate(config)


def test_an_empty_source_is_one_line_naming_it(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = two_sources(tmp_path)
  write_files(tmp_path, {"blank/a.txt": "  \n"})
  config.data.mixture += ",files:blank/*.txt=1"
  with pytest.raises(UserError, match="^data.mixture source files-blank: .*no non-empty "
                                      "documents") as e:
    pipeline.make_train_iterator(config, ByteTokenizer())
  assert "\n" not in str(e.value)
  config.data.mixture = "files:a/*.txt=1,files:nothing/*.txt=1"
  with pytest.raises(UserError, match="^data.mixture source files-nothing: .*no file matches"):
    pipeline.make_train_iterator(config, ByteTokenizer())


def test_two_sources_at_0_8_and_0_2_draw_their_tokens_within_2_percent(tmp_path, monkeypatch):
  """Acceptance: over 200 steps each source's share of the drawn tokens is
  within 2% (relative) of its weight, and `Draws` counts the rows drawn."""
  monkeypatch.chdir(tmp_path)
  config = two_sources(tmp_path)
  batches = take(pipeline.make_train_iterator(config, ByteTokenizer()), 200)
  inputs = np.stack([b["inputs"] for b in batches])  # [steps, B, T]
  tokens = {"files-a": int((inputs == A).sum()), "files-b": int((inputs == B).sum())}
  total = sum(tokens.values())
  for name, weight in (("files-a", 0.8), ("files-b", 0.2)):
    assert abs(tokens[name] / total - weight) <= 0.02 * weight, tokens
  rows = {"files-a": int((inputs == A).any(-1).sum()), "files-b": int((inputs == B).any(-1).sum())}
  draws = mixture.Draws({source.name: source.weight for source in mixture.sources(config)})
  assert rows == draws.rows(200 * config.train.batch_size)
  assert rows == {"files-a": 640, "files-b": 160}


def test_the_mixed_stream_is_deterministic_and_resumes_exactly(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = two_sources(tmp_path, (0.7, 0.3))
  tok = ByteTokenizer()
  iterator = pipeline.make_train_iterator(config, tok)
  first = take(iterator, 7)
  state = iterator.get_state()
  expected = take(iterator, 9)
  restored = pipeline.make_train_iterator(config, tok)
  restored.set_state(state)
  assert_batches_equal(take(restored, 9), expected)
  assert_batches_equal(take(pipeline.make_train_iterator(config, tok), 7), first)
  config.data.seed = 1  # another order of each source's rows
  other = take(pipeline.make_train_iterator(config, tok), 7)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def test_each_source_keeps_its_validation_split(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = two_sources(tmp_path)
  tok = ByteTokenizer()
  sets = pipeline.make_source_eval_batches(config, tok, 2)
  assert list(sets) == ["files-a", "files-b"]
  for name, token in (("files-a", A), ("files-b", B)):
    (source,) = [s for s in mixture.sources(config) if s.name == name]
    assert_batches_equal(sets[name], pipeline.make_eval_batches(source.config, tok, 2))
    real = np.concatenate([b["inputs"][b["segment_ids"] > 0] for b in sets[name]])
    assert set(real.tolist()) <= {token, 1, 2}  # its own letter, BOS, EOS
  assert {name: rows[1] > 0 for name, rows in pipeline.split_rows(config, tok).items()} == {
      "files-a": True, "files-b": True}


def test_the_tokenizer_sample_takes_each_source_by_weight(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  for letter in "ab":
    write_files(tmp_path, {f"{letter}.jsonl": "\n".join(
        json.dumps({"text": letter * 20}) for _ in range(50))})
  data = make_config(tmp_path, mixture="jsonl:a.jsonl=3,jsonl:b.jsonl=1").data
  texts = list(pipeline.tokenizer_texts(data, 400))
  a, b = (sum(len(t) for t in texts if t[0] == letter) for letter in "ab")
  assert (a, b) == (300, 100)  # quotas of 3/4 and 1/4 of 400 bytes, 20 bytes a document
  assert "train text of jsonl-a" in capsys.readouterr().err


def test_a_run_without_mixture_draws_the_stream_it_drew_before(tmp_path, monkeypatch):
  """The batches of a run without data.mixture, hashed as the code before
  mixtures gave them: an existing run resumes on the same stream."""
  monkeypatch.chdir(tmp_path)
  write_files(tmp_path, {f"d{i}.txt": f"document {i}: " + "word " * (3 * i + 5)
                         for i in range(40)})
  config = make_config(tmp_path, source="files", paths="*.txt", val_percent=20)
  tok = ByteTokenizer()
  h = hashlib.sha256()
  for batch in (take(pipeline.make_train_iterator(config, tok), 3)
                + pipeline.make_eval_batches(config, tok, 2)):
    for key in sorted(batch):
      h.update(key.encode())
      h.update(batch[key].tobytes())
  assert h.hexdigest() == "7ca7e04a7e0f87f389600f08c0fb4fbd2dd32d0fe7fc07303edb2cf0e41b0e7a"


def test_eval_data_flag_on_a_mixture_run_reads_that_corpus_alone():
  config = base.get_config()
  config.data.mixture = "stdlib=1,pydoc=1"
  evaluate.apply_data_flag(config, "notes/*.jsonl")
  assert (config.data.mixture, config.data.source, config.data.paths) == (
      "", "jsonl", "notes/*.jsonl")


def test_a_sweep_over_mixture_weights_names_its_variants(tmp_path):
  path = write_sweep(tmp_path, """
def get_sweep():
  return {"data.mixture": ["stdlib=0.8,jsonl:/data/notes/*.jsonl=0.2",
                           "stdlib=0.5,jsonl:/data/notes/*.jsonl=0.5"]}
""")
  variants = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY, [], str(tmp_path))
  assert [v.name for v in variants] == ["mixture=stdlib_0.8_jsonl__data_notes__.jsonl_0.2",
                                        "mixture=stdlib_0.5_jsonl__data_notes__.jsonl_0.5"]
  config = sweep_lib.load_config(TINY, variants[1].train_command[6:])
  assert config.data.mixture == "stdlib=0.5,jsonl:/data/notes/*.jsonl=0.5"


def mixture_run(tok_dir, tmp_path, num_steps: int):
  """small_config on pydoc (0.8) and a JSONL corpus of notes (0.2), with a
  schedule that does not depend on train.num_steps (so a run resumed to more
  steps trains as one that ran them at once)."""
  write_files(tmp_path, {f"notes/n{i}.jsonl": "\n".join(json.dumps(
      {"text": f"note {i}.{j}: the value of x is {i * j}"}) for j in range(12))
                         for i in range(40)})
  c = small_config(tok_dir)
  c.data.update(val_percent=20, mixture=f"pydoc=0.8,jsonl:{tmp_path}/notes/*.jsonl=0.2",
                tokenize_workers=1)  # no worker processes to start for small corpora
  c.train.update(num_steps=num_steps, schedule="constant", eval_every=5, checkpoint_every=5)
  return c


def test_a_mixture_run_logs_each_source(tok_dir, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  last = loop.train(mixture_run(tok_dir, tmp_path, 10), workdir)
  out = capsys.readouterr().out
  assert "a mixture of 2 sources, each drawn by its weight:" in out
  assert "  pydoc       weight 0.8 (80.0%): train " in out and "draws 32 rows = " in out
  assert "val2_loss/jsonl-notes=" in out
  assert {"val2_loss/pydoc", "val2_loss/jsonl-notes"} <= set(last)
  records = read_metrics(workdir)
  train = [r for r in records if r["split"] == "train"][-1]
  assert (train["tokens/pydoc"], train["tokens/jsonl-notes"]) == (32 * 32, 8 * 32)
  val = [r for r in records if r["split"] == "validation"][-1]
  assert val["loss"] == pytest.approx(0.8 * val["loss/pydoc"] + 0.2 * val["loss/jsonl-notes"])
  assert val["targets"] == val["targets/pydoc"] + val["targets/jsonl-notes"]


@pytest.mark.slow
def test_a_mixture_run_resumes_bit_exactly_and_eval_reports_each_source(tok_dir, tmp_path):
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.train(mixture_run(tok_dir, tmp_path, 20), straight)
  loop.train(mixture_run(tok_dir, tmp_path, 10), resumed)
  loop.train(mixture_run(tok_dir, tmp_path, 20), resumed)
  (step_a, params_a), (step_b, params_b) = final_params(straight), final_params(resumed)
  assert step_a == step_b == 20
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  report = evaluate.run_eval(straight, max_new_tokens=2)
  assert list(report["sources"]) == ["pydoc", "jsonl-notes"]
  sources = report["sources"]
  for key in ("loss", "bits_per_byte", "unigram_loss"):
    assert report[key] == pytest.approx(
        0.8 * sources["pydoc"][key] + 0.2 * sources["jsonl-notes"][key])
  assert report["targets"] == sources["pydoc"]["targets"] + sources["jsonl-notes"]["targets"]
