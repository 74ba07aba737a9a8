"""Tests of Step 1 (tokenization): the lesson's BPE example, round trips, the
fast trainer against the lesson's algorithm, saving and loading, bad input."""
import json
import pathlib

import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenizer
from configs.errors import UserError
from data import corpora
from tokenizer import base, bpe, inputs, report, spm
from tokenizer import train as train_cli

KINDS = ("bpe", "spm_bpe", "spm_unigram")
LESSON_COUNTS = {"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5}
SAMPLES = [
    "",
    "def f(x):\n    return x  # done\n",
    "naïve café, 東京 and Ελληνικά",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧",
    "combining e\u0301 a\u0308 and \u0301 alone",
    "NUL \x00 inside, \x01 and \x7f too",
    "\u2581 SentencePiece's space symbol \u2581\u2581 in text",
    "   leading and trailing spaces   \n\n\t\r\n",
    "\ufffd\ufeff\u200b zero-width and BOM",
]

fast = settings(deadline=None, max_examples=150)


def small_corpus() -> list[str]:
  """About 150 kB of English and Python from the embedded corpora."""
  prose = [text for _, text in corpora.pydoc_documents()[:40]]
  code = [pathlib.Path(bpe.__file__).read_text(encoding="utf-8"),
          pathlib.Path(base.__file__).read_text(encoding="utf-8")]
  return prose + code


@pytest.fixture(scope="module")
def trained() -> dict[str, tokenizer.Tokenizer]:
  texts = small_corpus()
  return {kind: tokenizer.train_tokenizer(kind, 400, texts) for kind in KINDS}


# The lesson's worked example.

def test_lesson_worked_example_merges():
  assert bpe.learn_merges(LESSON_COUNTS, 4) == [
      ("u", "g"), ("u", "n"), ("h", "ug"), ("p", "un")]


def test_lesson_worked_example_apply():
  merges = bpe.learn_merges(LESSON_COUNTS, 4)
  assert bpe.apply_merges("bugs", merges) == ["b", "ug", "s"]
  assert bpe.apply_merges("hugs", merges) == ["hug", "s"]


def test_fast_trainer_on_lesson_example():
  sequences = {tuple(word): count for word, count in LESSON_COUNTS.items()}
  expected = bpe.learn_merges(LESSON_COUNTS, 100)
  assert list(bpe.iter_merges(sequences)) == expected


def test_ties_break_to_smallest_pair():
  assert bpe.learn_merges({"cd": 3, "ab": 3, "ba": 3}, 1) == [("a", "b")]
  sequences = {("c", "d"): 3, ("b", "a"): 3, ("a", "b"): 3}
  assert next(bpe.iter_merges(sequences)) == ("a", "b")


# The fast trainer learns what the lesson's algorithm learns.

@fast
@given(st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=9),
                       st.integers(1, 5), max_size=12))
def test_fast_trainer_matches_lesson_algorithm(word_counts):
  sequences = {tuple(word): count for word, count in word_counts.items()}
  assert list(bpe.iter_merges(sequences)) == bpe.learn_merges(word_counts, 1000)


def test_byte_level_trainer_matches_lesson_algorithm_on_a_corpus():
  texts = small_corpus()[:8]
  tok = bpe.train_bpe(texts, bpe.MIN_VOCAB_SIZE + 120)
  # Bytes as Latin-1 characters keep the bytes' order, so ties agree too.
  latin1_counts = {word.encode("utf-8").decode("latin-1"): count
                   for word, count in bpe.count_words(texts).items()}
  expected = bpe.learn_merges(latin1_counts, len(tok.merges))
  got = [(l.decode("latin-1"), r.decode("latin-1")) for l, r in tok.merges]
  assert got == expected
  assert len(got) >= 120


@fast
@given(st.text(max_size=40))
def test_encoder_applies_merges_in_learned_order(trained, text):
  tok = trained["bpe"]
  merges = [(l.decode("latin-1"), r.decode("latin-1")) for l, r in tok.merges]
  token_ids = {tok.token_bytes(i): i
               for i in range(bpe.FIRST_BYTE_ID, tok.vocab_size)}
  expected = []
  for piece in bpe.PRESPLIT.findall(text):
    symbols = bpe.apply_merges(piece.encode("utf-8").decode("latin-1"), merges)
    expected += [token_ids[s.encode("latin-1")] for s in symbols]
  assert tok.encode(text) == expected


def test_presplit_covers_text_gpt2_style():
  text = "Hello world's  end_of 42x\n\n  if(a):"
  pieces = bpe.PRESPLIT.findall(text)
  assert "".join(pieces) == text
  assert pieces == ["Hello", " world", "'s", " ", " end", "_", "of", " 42",
                    "x", "\n\n ", " if", "(", "a", "):"]


# Round trips, specials, decode rules.

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(trained, kind, text):
  tok = trained[kind]
  assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_any_unicode(trained, kind):
  tok = trained[kind]

  @fast
  @given(st.text())
  def check(text):
    assert tok.decode(tok.encode(text)) == text

  check()


@pytest.mark.parametrize("kind", KINDS)
def test_lone_surrogates_become_replacement_characters(trained, kind):
  tok = trained[kind]
  with_surrogates = st.lists(st.one_of(
      st.characters(), st.characters(categories=["Cs"]))).map("".join)

  @fast
  @given(with_surrogates)
  def check(text):
    assert tok.decode(tok.encode(text)) == base.replace_surrogates(text)

  check()
  assert tok.decode(tok.encode("a\ud800b\udfffc")) == "a\ufffdb\ufffdc"


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens(trained, kind):
  tok = trained[kind]
  specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id]
  assert tok.pad_id == 0
  assert len(set(specials)) == 4
  assert all(0 <= i < tok.vocab_size for i in specials)
  assert tok.vocab_size == 400
  ids = tok.encode("some text")
  assert not set(specials) & set(ids)
  with_specials = [tok.bos_id] + ids + [tok.mask_id, tok.eos_id, tok.pad_id]
  assert tok.decode(with_specials) == "some text"


@pytest.mark.parametrize("kind", KINDS)
def test_decode_broken_utf8_and_bad_ids(trained, kind):
  tok = trained[kind]
  euro = tok.encode("\u20ac")  # three byte tokens in a small vocabulary
  assert len(euro) == 3
  assert tok.decode(euro[:2] + tok.encode("x")) == "\ufffdx"
  with pytest.raises(ValueError):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError):
    tok.decode([-1])


@pytest.mark.parametrize("kind", KINDS)
def test_encode_batch_equals_encode(trained, kind):
  tok = trained[kind]
  assert tok.encode_batch(SAMPLES) == [tok.encode(text) for text in SAMPLES]


# Saving and loading.

@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(trained, kind, tmp_path):
  tok = trained[kind]
  saved = tok.save(tmp_path / "tok")
  manifest = json.loads((saved / base.MANIFEST).read_text())
  assert manifest["kind"] == kind
  assert manifest["fingerprint"] == tok.fingerprint
  loaded = tokenizer.load_tokenizer(saved)
  assert loaded.kind == kind
  assert loaded.fingerprint == tok.fingerprint
  assert len(loaded.fingerprint) == 64
  assert [loaded.encode(t) for t in SAMPLES] == [tok.encode(t) for t in SAMPLES]
  assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.mask_id) == (
      tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


@pytest.mark.parametrize("kind", ["spm_bpe", "spm_unigram"])
def test_load_bare_sentencepiece_model(trained, kind, tmp_path):
  saved = trained[kind].save(tmp_path / "tok")
  loaded = tokenizer.load_tokenizer(saved / spm.FILENAME)
  assert loaded.kind == kind
  assert loaded.fingerprint == trained[kind].fingerprint


def test_load_foreign_sentencepiece_model(tmp_path):
  """A model trained with SentencePiece's defaults: no pad, no mask."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(small_corpus()[:20]), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "foreign"),
      vocab_size=300, model_type="bpe", minloglevel=2)
  tok = tokenizer.load_tokenizer(tmp_path / "foreign.model")
  assert tok.kind == "spm_bpe"
  assert tok.pad_id == tok.mask_id == 0  # <unk>
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  assert tok.decode(tok.encode("hello world")) == "hello world"
  assert tok.encode_batch([]) == []


def test_fingerprints_differ_between_tokenizers(trained):
  assert len({tok.fingerprint for tok in trained.values()}) == 3


def test_check_fingerprint(trained):
  tok = trained["bpe"]
  tokenizer.check_fingerprint(tok.fingerprint, tok)
  other = trained["spm_bpe"]
  with pytest.raises(UserError, match=(
      f"checkpoint was trained with tokenizer {tok.fingerprint[:12]} "
      f"but got {other.fingerprint[:12]}")):
    tokenizer.check_fingerprint(tok.fingerprint, other)


def test_save_refuses_non_empty_directory(trained, tmp_path):
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "keep.txt").write_text("mine")
  with pytest.raises(UserError, match="already exists"):
    trained["bpe"].save(tmp_path / "tok")
  assert [p.name for p in (tmp_path / "tok").iterdir()] == ["keep.txt"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


# Corrupted saved tokenizers.

def test_corrupted_bpe_merge_is_caught(trained, tmp_path):
  saved = trained["bpe"].save(tmp_path / "tok")
  path = saved / bpe.FILENAME
  content = json.loads(path.read_text())
  content["merges"][-1], content["merges"][-2] = (content["merges"][-2],
                                                  content["merges"][-1])
  path.write_text(json.dumps(content))
  with pytest.raises(UserError, match=f"corrupted tokenizer file {path}"):
    tokenizer.load_tokenizer(saved)


def test_truncated_bpe_file_is_caught(trained, tmp_path):
  saved = trained["bpe"].save(tmp_path / "tok")
  path = saved / bpe.FILENAME
  path.write_text(path.read_text()[:100])
  with pytest.raises(UserError, match=f"corrupted BPE tokenizer file {path}"):
    tokenizer.load_tokenizer(saved)


@pytest.mark.parametrize("kind", ["spm_bpe", "spm_unigram"])
def test_corrupted_sentencepiece_model_is_caught(trained, kind, tmp_path):
  saved = trained[kind].save(tmp_path / "tok")
  path = saved / spm.FILENAME
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(UserError, match=str(path)):
    tokenizer.load_tokenizer(saved)


@pytest.mark.parametrize("kind", ["spm_bpe", "spm_unigram"])
def test_changed_sentencepiece_piece_is_caught(trained, kind, tmp_path):
  saved = trained[kind].save(tmp_path / "tok")
  path = saved / spm.FILENAME
  data = path.read_bytes()
  path.write_bytes(data.replace(b"<mask>", b"<mark>", 1))
  with pytest.raises(UserError, match=f"corrupted tokenizer file {path}"):
    tokenizer.load_tokenizer(saved)


def test_broken_manifest_and_missing_paths(trained, tmp_path):
  saved = trained["bpe"].save(tmp_path / "tok")
  (saved / base.MANIFEST).write_text("{not json")
  with pytest.raises(UserError, match="corrupted tokenizer manifest"):
    tokenizer.load_tokenizer(saved)
  with pytest.raises(UserError, match="no such file"):
    tokenizer.load_tokenizer(tmp_path / "absent")
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match="not a saved tokenizer"):
    tokenizer.load_tokenizer(tmp_path / "empty")
  (tmp_path / "junk.model").write_bytes(b"\x00\x01junk")
  with pytest.raises(UserError, match="junk.model"):
    tokenizer.load_tokenizer(tmp_path / "junk.model")


# Bad training input.

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("texts", [[], [""]])
def test_empty_corpus(kind, texts):
  with pytest.raises(UserError, match="empty"):
    tokenizer.train_tokenizer(kind, 1000, texts)


@pytest.mark.parametrize("kind,smallest", [("bpe", 260), ("spm_bpe", 261),
                                           ("spm_unigram", 261)])
def test_vocabulary_too_small(kind, smallest):
  with pytest.raises(UserError, match=f"{smallest} at least"):
    tokenizer.train_tokenizer(kind, smallest - 1, ["some text"])


@pytest.mark.parametrize("kind", KINDS)
def test_vocabulary_too_large_for_corpus(kind):
  with pytest.raises(UserError, match="vocabulary of 5000"):
    tokenizer.train_tokenizer(kind, 5000, ["a tiny corpus\n", "of two lines\n"])


def test_unknown_kind():
  with pytest.raises(UserError, match="unknown tokenizer kind 'wordpiece'"):
    tokenizer.train_tokenizer("wordpiece", 1000, ["text"])


def test_text_file_sample(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("grüße\n", encoding="utf-8")
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"caf\xe9\n")
  assert list(inputs.TextFileSample([good])) == ["grüße\n"]
  with pytest.raises(UserError, match=f"input file {bad} is not UTF-8"):
    list(inputs.TextFileSample([good, bad]))
  with pytest.raises(UserError, match="input file not found"):
    inputs.TextFileSample([tmp_path / "absent.txt"])


def test_text_file_sample_reads_each_files_share_of_max_bytes(tmp_path):
  (tmp_path / "a.txt").write_text("ü" * 3000, encoding="utf-8")  # 6,000 bytes
  (tmp_path / "b.txt").write_text("b" * 2000, encoding="utf-8")
  sample = inputs.TextFileSample([tmp_path / "a.txt", tmp_path / "b.txt"], max_bytes=802)
  a, b = list(sample)
  assert a == "ü" * 300 and b == "b" * 200  # a: 601 bytes, cut inside the 301st character
  assert (sample.bytes_read, sample.total_bytes) == (801, 8000)


# Command lines.

def run_cli(main, argv, capsys) -> tuple[int, str, str]:
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  out, err = capsys.readouterr()
  return exit_info.value.code, out, err


@pytest.mark.parametrize("kind", ["bpe", "spm_bpe"])
@pytest.mark.parametrize("problem", ["missing", "not_utf8", "tiny_vocab"])
def test_train_cli_bad_input_exits_2(kind, problem, tmp_path, capsys):
  text_file = tmp_path / "text.txt"
  text_file.write_text("hello world\n")
  (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
  files = {"missing": [str(tmp_path / "absent.txt")],
           "not_utf8": [str(text_file), str(tmp_path / "latin1.txt")],
           "tiny_vocab": [str(text_file)]}[problem]
  vocab = "100" if problem == "tiny_vocab" else "300"
  out_dir = tmp_path / "out"
  argv = ["--kind", kind, "--vocab_size", vocab, "--input", *files, "--out", str(out_dir)]
  code, _, err = run_cli(train_cli.main, argv, capsys)
  assert code == 2
  assert err.startswith("error: ") and err.count("\n") == 1
  assert not out_dir.exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt",
                                                         "text.txt"]


@pytest.mark.parametrize("argv,message", [
    (["--kind", "bpe", "--vocab-size", "300", "--out", "x"],
     "error: --vocab-size: flags are snake_case: --vocab_size"),
    (["--kind", "bpe", "--vocab_size", "300", "a.txt", "--out", "x"],
     "error: unexpected argument 'a.txt'; text files come after --input"),
])
def test_train_cli_spelling_mistakes_say_the_fix(argv, message, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, _, err = run_cli(train_cli.main, argv, capsys)
  assert (code, err.strip()) == (2, message)
  assert not (tmp_path / "x").exists()


def test_train_cli_and_report(tmp_path, capsys):
  text_file = tmp_path / "text.txt"
  text_file.write_text("\n".join(small_corpus()[:10]), encoding="utf-8")
  out_dir = tmp_path / "tok"
  train_cli.main(["--kind", "bpe", "--vocab_size", "300", "--input",
                  str(text_file), "--out", str(out_dir)])
  assert "trained bpe with 300 ids" in capsys.readouterr().out
  assert tokenizer.load_tokenizer(out_dir).vocab_size == 300
  report.main([str(out_dir)])
  out = capsys.readouterr().out
  for name in ("English prose", "Python code", "German", "Russian", "Chinese"):
    assert f"| {name}" in out
  argv = ["--kind", "bpe", "--vocab_size", "300", "--input", str(text_file),
          "--out", str(out_dir)]
  code, _, err = run_cli(train_cli.main, argv, capsys)
  assert code == 2 and "already exists" in err


def test_report_cli_bad_path_exits_2(tmp_path, capsys):
  code, _, err = run_cli(report.main, [str(tmp_path / "absent")], capsys)
  assert code == 2
  assert err.startswith("error: ") and err.count("\n") == 1


def test_report_shows_non_english_costs_more(trained):
  tok = trained["bpe"]
  english = report.measure(tok, "\n".join(small_corpus()[:40]))
  for text in (report.GERMAN, report.RUSSIAN, report.CHINESE):
    chars_per_token = report.measure(tok, text)["chars_per_token"]
    assert chars_per_token < english["chars_per_token"]
