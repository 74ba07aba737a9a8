"""Hugging Face tokenizers in and out, checked against `transformers` itself.

In: tiny tokenizers are trained here with the `tokenizers` library, set up as
the real ones are (GPT-2's byte-level BPE, Llama-3's split regex and BOS
template, Qwen2's NFC and no BOS, Llama-2's SentencePiece-style BPE with byte
fallback, BERT's WordPiece with its normalizer and [CLS]/[SEP] template, T5's
Unigram with metaspace and </s>), saved with `transformers`, and loaded both
by `AutoTokenizer` and by `tokenizer.load_tokenizer`; nothing is downloaded.
Out: our trained kinds go through `tokenizer.export_hf` and `AutoTokenizer`
must give our encoder's ids.
"""
import json

import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import tokenizer
from configs import base as base_config
from configs.errors import UserError
from data import corpora
from tokenizer import bpe, export, hf
from training import workdir
from tests.helpers import t5_like, TOKENIZER_CORPUS

pytestmark = pytest.mark.hf  # transformers and torch

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
fast = settings(deadline=None, max_examples=100)


def gpt2_like() -> tuple[Tokenizer, dict]:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.train_from_iterator(TOKENIZER_CORPUS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  eot = "<|endoftext|>"
  return tok, {"bos_token": eot, "eos_token": eot, "unk_token": eot}


def llama3_like() -> tuple[Tokenizer, dict]:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TOKENIZER_CORPUS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
      special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
  return tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


def qwen2_like() -> tuple[Tokenizer, dict]:
  """Byte-level BPE after NFC and a split regex; no BOS at all (bos_token null)."""
  tok, _ = llama3_like()
  tok.normalizer = normalizers.NFC()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  return tok, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "extra_special_tokens": ["<|im_start|>", "<|im_end|>"]}


def llama2_like() -> tuple[Tokenizer, dict]:
  """SentencePiece BPE as converted by transformers: byte fallback, metaspace."""
  specials = ["<unk>", "<s>", "</s>"]
  trainer_tok = Tokenizer(models.BPE())
  trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                 normalizers.Replace(" ", "▁")])
  trainer_tok.train_from_iterator(TOKENIZER_CORPUS, trainers.BpeTrainer(
      vocab_size=200, special_tokens=specials, show_progress=False))
  learned = json.loads(trainer_tok.to_str())["model"]
  vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
  for token in sorted(learned["vocab"], key=learned["vocab"].get):
    vocab.setdefault(token, len(vocab))
  merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
  tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                             fuse_unk=True))
  tok.normalizer = trainer_tok.normalizer
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  return tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "add_bos_token": True, "add_eos_token": False}


def bert_like() -> tuple[Tokenizer, dict]:
  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  tok.train_from_iterator(TOKENIZER_CORPUS, trainers.WordPieceTrainer(
      vocab_size=300, special_tokens=specials, show_progress=False))
  tok.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
  return tok, {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
               "sep_token": "[SEP]", "mask_token": "[MASK]"}


BUILDERS = {"gpt2": gpt2_like, "llama3": llama3_like, "qwen2": qwen2_like, "llama2": llama2_like,
            "bert": bert_like, "t5": t5_like}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
  """Each tiny tokenizer saved by transformers: name -> directory."""
  dirs = {}
  for name, build in BUILDERS.items():
    tok, special = build()
    out = tmp_path_factory.mktemp(name)
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(out)
    dirs[name] = out
  return dirs


@pytest.fixture(scope="module")
def pairs(hf_dirs) -> dict:
  """name -> (transformers' AutoTokenizer, ours), both from the saved directory."""
  return {name: (AutoTokenizer.from_pretrained(d), tokenizer.load_tokenizer(d))
          for name, d in hf_dirs.items()}


@pytest.mark.parametrize("name", BUILDERS)
def test_loaded_tokenizer_gives_transformers_ids(pairs, name):
  reference, ours = pairs[name]
  assert ours.kind == "hf"

  specials = sorted(reference.all_special_tokens)
  with_specials = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(specials)),
                           max_size=6).map("".join)

  @fast
  @given(st.one_of(st.text(), with_specials))
  def check(text):
    assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode_with_specials(text) == reference(text)["input_ids"]

  check()
  for text in TOKENIZER_CORPUS[:6]:
    assert ours.encode_with_specials(text) == reference(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == reference.decode(
        reference(text)["input_ids"], skip_special_tokens=True)
  assert ours.encode_batch(TOKENIZER_CORPUS[:6]) == [ours.encode(t) for t in TOKENIZER_CORPUS[:6]]


@pytest.mark.parametrize("name,first,last", [
    ("gpt2", [], []), ("llama3", ["<|begin_of_text|>"], []), ("qwen2", [], []),
    ("llama2", ["<s>"], []),
    ("bert", ["[CLS]"], ["[SEP]"]), ("t5", [], ["</s>"])])
def test_special_tokens_as_transformers_adds_them(pairs, name, first, last):
  reference, ours = pairs[name]
  ids = ours.encode_with_specials("hello world")
  body = ours.encode("hello world")
  assert ids == reference.convert_tokens_to_ids(first) + body + reference.convert_tokens_to_ids(last)


@pytest.mark.parametrize("name,roles", [
    ("gpt2", {"bos_id": "<|endoftext|>", "eos_id": "<|endoftext|>", "pad_id": "<|endoftext|>",
              "mask_id": "<|endoftext|>"}),
    ("qwen2", {"bos_id": "<|endoftext|>", "eos_id": "<|endoftext|>", "pad_id": "<|endoftext|>",
               "mask_id": "<|endoftext|>"}),
    ("llama2", {"bos_id": "<s>", "eos_id": "</s>", "pad_id": "</s>", "mask_id": "<unk>"}),
    ("bert", {"bos_id": "[CLS]", "eos_id": "[SEP]", "pad_id": "[PAD]", "mask_id": "[MASK]"}),
    ("t5", {"bos_id": "<pad>", "eos_id": "</s>", "pad_id": "<pad>", "mask_id": "<unk>"})])
def test_our_special_ids(pairs, name, roles):
  reference, ours = pairs[name]
  for attribute, token in roles.items():
    assert getattr(ours, attribute) == reference.convert_tokens_to_ids(token), attribute
  assert ours.vocab_size == len(reference)
  assert ours.decode([ours.bos_id, ours.eos_id]) == ""


@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (False, True), (False, False)])
def test_add_bos_eos_flags_are_ignored_as_transformers_does(hf_dirs, tmp_path, add_bos, add_eos):
  """transformers 5 takes the template of tokenizer.json, whatever the config's flags say."""
  config = json.loads((hf_dirs["llama2"] / hf.CONFIG_FILE).read_text())
  config.update(add_bos_token=add_bos, add_eos_token=add_eos)
  (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
  (tmp_path / hf.FILENAME).write_text((hf_dirs["llama2"] / hf.FILENAME).read_text())
  reference, ours = AutoTokenizer.from_pretrained(tmp_path), tokenizer.load_tokenizer(tmp_path)
  for text in TOKENIZER_CORPUS[:6]:
    assert ours.encode_with_specials(text) == reference(text)["input_ids"]
  assert ours.encode_with_specials("hi") == [ours.bos_id] + ours.encode("hi")


def test_config_specials_missing_from_the_file_are_added(hf_dirs, tmp_path):
  """Role and extra tokens named only in the config join the vocabulary as transformers adds them."""
  (tmp_path / hf.FILENAME).write_text((hf_dirs["gpt2"] / hf.FILENAME).read_text())
  (tmp_path / hf.CONFIG_FILE).write_text(json.dumps({
      "eos_token": "<|endoftext|>", "mask_token": "<mask>",
      "additional_special_tokens": ["<tool>"]}))
  reference, ours = AutoTokenizer.from_pretrained(tmp_path), tokenizer.load_tokenizer(tmp_path)
  text = "call <tool> on <mask> please<|endoftext|>"
  assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
  assert ours.vocab_size == len(reference)
  assert ours.mask_id == reference.convert_tokens_to_ids("<mask>") == ours.vocab_size - 2
  assert ours.decode(ours.encode(text)) == "call  on  please"


def test_t5_extra_ids_are_special(pairs):
  reference, ours = pairs["t5"]
  text = "fill <extra_id_0> and <extra_id_2>"
  assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
  assert reference.convert_tokens_to_ids("<extra_id_2>") in ours.encode(text)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_saved_hf_tokenizer_round_trip(pairs, name, tmp_path):
  _, ours = pairs[name]
  saved = ours.save(tmp_path / "tok")
  assert json.loads((saved / tokenizer.MANIFEST).read_text())["kind"] == "hf"
  loaded = tokenizer.load_tokenizer(saved)
  assert loaded.fingerprint == ours.fingerprint
  assert loaded.encode_with_specials(TOKENIZER_CORPUS[2]) == ours.encode_with_specials(TOKENIZER_CORPUS[2])
  # The saved copy is itself a Hugging Face tokenizer directory.
  assert tokenizer.load_tokenizer(saved / hf.SUBDIR).fingerprint == ours.fingerprint
  path = saved / hf.SUBDIR / hf.FILENAME
  content = json.loads(path.read_text())
  content["decoder"] = None
  path.write_text(json.dumps(content))
  with pytest.raises(UserError, match="corrupted tokenizer file"):
    tokenizer.load_tokenizer(saved)


def test_bad_hf_tokenizer_is_a_user_error(hf_dirs, tmp_path):
  (tmp_path / hf.FILENAME).write_text('{"model": {"type": "Nope"}}')
  with pytest.raises(UserError, match="not a valid Hugging Face tokenizer.json"):
    tokenizer.load_tokenizer(tmp_path)
  no_eos = tmp_path / "no_eos"
  no_eos.mkdir()
  (no_eos / hf.FILENAME).write_text((hf_dirs["gpt2"] / hf.FILENAME).read_text())
  with pytest.raises(UserError, match="no eos_token or sep_token; name one in"):
    tokenizer.load_tokenizer(no_eos / hf.FILENAME)
  only_spm = tmp_path / "only_spm"
  only_spm.mkdir()
  (only_spm / "tokenizer.model").write_bytes(b"")
  with pytest.raises(UserError, match="only a SentencePiece tokenizer.model; give the path"):
    tokenizer.load_tokenizer(only_spm)


# Our tokenizers exported: transformers loads them to our ids.

OUR_KINDS = ("bpe", "spm_bpe", "spm_unigram")
TRICKY = [
    "",
    "def f(x):\n    return x  # done\n\n\n",
    "x² ⅻ ½ ① ٣ 42_000 __init__ a_b",  # No/Nl numbers, Arabic digit, underscores
    "\x1c\x1d\x1e\x1f\x85 \u2028 \u3000 tabs\t\tand\r\n",  # spaces only Python calls spaces
    "literal <pad> <bos> <eos> <mask> <unk> <0x41> specials",
    "\u2581 SentencePiece's space symbol \u2581\u2581 in text",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧, combining e\u0301",
    "   leading and trailing spaces   ",
    "it's they'll we've I'm you're she'd 'S",
]


@fast
@given(st.text())
def test_exported_presplit_is_ours(text):
  split = pre_tokenizers.Split(Regex(export.presplit_pattern()), behavior="isolated")
  assert [piece for piece, _ in split.pre_tokenize_str(text)] == bpe.PRESPLIT.findall(text)


@pytest.mark.parametrize("text", TRICKY)
def test_exported_presplit_on_tricky_text(text):
  split = pre_tokenizers.Split(Regex(export.presplit_pattern()), behavior="isolated")
  assert [piece for piece, _ in split.pre_tokenize_str(text)] == bpe.PRESPLIT.findall(text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
  """kind -> (ours, AutoTokenizer of its export)."""
  texts = [text for _, text in corpora.pydoc_documents()[:15]] + TRICKY
  result = {}
  for kind in OUR_KINDS:
    ours = tokenizer.train_tokenizer(kind, 400, texts)
    out = tokenizer.export_hf(ours, tmp_path_factory.mktemp(kind) / "hf")
    result[kind] = (ours, AutoTokenizer.from_pretrained(out))
  return result


@pytest.mark.parametrize("kind", OUR_KINDS)
def test_export_loads_in_transformers_to_our_ids(exported, kind):
  ours, reference = exported[kind]

  @fast
  @given(st.text())
  def check(text):
    assert reference(text, add_special_tokens=False)["input_ids"] == ours.encode(text)

  check()
  for text in TRICKY:
    assert reference(text, add_special_tokens=False)["input_ids"] == ours.encode(text), text
    assert reference(text)["input_ids"] == ours.encode_with_specials(text)
    assert reference.decode(ours.encode(text), skip_special_tokens=True) == text
  assert len(reference) == ours.vocab_size
  for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
    assert getattr(reference, attribute) == getattr(ours, attribute.replace("_token", ""))


@pytest.mark.parametrize("kind", OUR_KINDS)
def test_export_loads_back_as_hf_kind(exported, kind, tmp_path):
  ours, _ = exported[kind]
  loaded = tokenizer.load_tokenizer(tokenizer.export_hf(ours, tmp_path))
  assert loaded.kind == "hf"
  assert [loaded.encode(t) for t in TRICKY] == [ours.encode(t) for t in TRICKY]
  assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.mask_id) == (
      ours.bos_id, ours.eos_id, ours.pad_id, ours.mask_id)


@pytest.mark.parametrize("name", ["llama2", "bert"])
def test_export_of_an_hf_tokenizer_writes_its_files(pairs, name, tmp_path):
  reference, ours = pairs[name]
  again = AutoTokenizer.from_pretrained(tokenizer.export_hf(ours, tmp_path))
  for text in TOKENIZER_CORPUS[:6]:
    assert again(text)["input_ids"] == reference(text)["input_ids"]
  assert tokenizer.load_tokenizer(tmp_path).fingerprint == ours.fingerprint


def test_run_copies_an_hf_tokenizer_into_its_workdir(hf_dirs, pairs, tmp_path):
  config = base_config.get_config()
  config.tokenizer.path = str(hf_dirs["bert"])
  tok = workdir.setup_tokenizer(config, str(tmp_path))
  assert tok.kind == "hf" and tok.fingerprint == pairs["bert"][1].fingerprint
  assert (tmp_path / workdir.TOKENIZER_DIR / hf.SUBDIR / hf.FILENAME).is_file()
  assert workdir.setup_tokenizer(config, str(tmp_path)).fingerprint == tok.fingerprint


def test_export_refuses_a_foreign_sentencepiece_model(tmp_path):
  """SentencePiece's defaults (NFKC, dummy prefix) are not what export_hf writes."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(TOKENIZER_CORPUS), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "foreign"), vocab_size=100,
      model_type="unigram", minloglevel=2)
  foreign = tokenizer.load_tokenizer(tmp_path / "foreign.model")
  with pytest.raises(UserError, match="only SentencePiece models trained here"):
    tokenizer.export_hf(foreign, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", OUR_KINDS)
def test_export_matches_on_real_documents(kind, tmp_path):
  """A 3000-id vocabulary of each kind; 250 held-out prose and code documents."""
  prose = [text for _, text in corpora.pydoc_documents()]
  code = [text for _, text in corpora.embedded_documents("stdlib")[:100]]
  ours = tokenizer.train_tokenizer(kind, 3000, prose[:200] + code[:50])
  reference = AutoTokenizer.from_pretrained(tokenizer.export_hf(ours, tmp_path))
  for text in prose[200:400] + code[50:100]:
    assert reference(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def test_export_command(exported, tmp_path, capsys):
  ours, _ = exported["bpe"]
  ours.save(tmp_path / "tok")
  export.main([str(tmp_path / "tok"), "--out", str(tmp_path / "hf")])
  assert "as a Hugging Face tokenizer" in capsys.readouterr().out
  reference = AutoTokenizer.from_pretrained(tmp_path / "hf")
  assert reference(TOKENIZER_CORPUS[1])["input_ids"] == ours.encode_with_specials(TOKENIZER_CORPUS[1])
  for argv in ([str(tmp_path / "tok"), "--out", str(tmp_path / "hf")],
               [str(tmp_path / "absent"), "--out", str(tmp_path / "hf2")]):
    with pytest.raises(SystemExit) as exit_info:
      export.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
  assert not (tmp_path / "hf2").exists()
