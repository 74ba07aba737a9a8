"""Step 1, handing a tokenizer on: our kinds written as a Hugging Face directory.

  python -m tokenizer.export runs/tiny/tokenizer --out runs/tiny_hf_tokenizer

`export_hf(tok, out_dir)` writes `tokenizer.json`, `tokenizer_config.json` and
`special_tokens_map.json` (an `hf` tokenizer: the files it came from), which `transformers.AutoTokenizer.from_pretrained`
loads (class `PreTrainedTokenizerFast`) to the ids of our encoder:
`tokenizer(text, add_special_tokens=False)` gives `tok.encode(text)` and
`tokenizer(text)` gives `tok.encode_with_specials(text)` (BOS first, as our
runs start a document). Special tokens keep their ids and decode to nothing;
their text in the input is plain text (`split_special_tokens`), as in ours.

- `bpe`: a byte-level BPE model with our vocabulary and merges in learned
  order, after a split by our pre-split pattern. Python's `re` and the
  library's Oniguruma read `\\s`, `\\w`, `\\d` differently, so the pattern is
  written out with explicit character classes computed from Python's own
  Unicode tables (`presplit_pattern`). Hugging Face's BPE applies the
  lowest-ranked merge present, ours the next one in learned order; the two
  can differ only where two merges produce the same token (see
  `bpe.train_bpe`), which a merge list learned by `train_bpe` rarely has.
- `spm_bpe` / `spm_unigram`: the pieces with their scores (a BPE model whose
  merges follow the scores, or a Unigram model), byte fallback, and spaces
  written as spaces in the pieces, so that a literal U+2581 in the text stays
  three byte pieces as in ours. Control, unknown and byte pieces get a score
  of -1e6, so that their text in the input is never matched as them.
  Only models with our training settings (identity normalisation, no dummy
  prefix, extra spaces kept, byte fallback) export; others are refused.
"""
import argparse
import functools
import json
import pathlib
import sys
from collections.abc import Sequence

import tokenizers
from sentencepiece import sentencepiece_model_pb2
from tokenizers import decoders, models, pre_tokenizers, processors

from configs.errors import UserError
import tokenizer
from tokenizer import base, bpe, hf, spm

SPECIAL_SCORE = -1e6
_PIECE = sentencepiece_model_pb2.ModelProto.SentencePiece


def export_hf(tok: base.Tokenizer, out_dir: str | pathlib.Path) -> pathlib.Path:
  """Writes `tok` as a Hugging Face tokenizer directory; returns its path.

  An `hf` tokenizer writes the files it was loaded from. `out_dir` is created
  if needed; the files in it are overwritten.
  """
  out = pathlib.Path(out_dir)
  if isinstance(tok, hf.HFTokenizer):
    out.mkdir(parents=True, exist_ok=True)
    tok.write_hf(out)
    return out
  if isinstance(tok, bpe.BPETokenizer):
    hf_tok, roles = _bpe_tokenizer(tok), {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>"}
  else:
    hf_tok, roles = _spm_tokenizer(tok)
  bos = roles["bos_token"]
  hf_tok.post_processor = processors.TemplateProcessing(
      single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
      special_tokens=[(bos, tok.bos_id)])
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles, "add_bos_token": True,
            "add_eos_token": False, "split_special_tokens": True,
            "clean_up_tokenization_spaces": False}
  out.mkdir(parents=True, exist_ok=True)
  (out / "tokenizer.json").write_text(hf_tok.to_str(pretty=True), encoding="utf-8")
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                             encoding="utf-8")
  (out / "special_tokens_map.json").write_text(json.dumps(roles, indent=2) + "\n",
                                               encoding="utf-8")
  return out


def _add_specials(hf_tok: tokenizers.Tokenizer, specials: list[str]) -> None:
  hf_tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                             for t in specials])


def _bpe_tokenizer(tok: bpe.BPETokenizer) -> tokenizers.Tokenizer:
  """Our byte-level BPE: its vocabulary in GPT-2's byte-to-character alphabet."""
  alphabet = _byte_alphabet()
  vocab = {name: i for i, name in enumerate(bpe.SPECIALS)}
  for i in range(bpe.FIRST_BYTE_ID, tok.vocab_size):
    vocab["".join(alphabet[b] for b in tok.token_bytes(i))] = i
  merges = [("".join(alphabet[b] for b in left), "".join(alphabet[b] for b in right))
            for left, right in tok.merges]
  hf_tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
  hf_tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(presplit_pattern()), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  hf_tok.decoder = decoders.ByteLevel()
  _add_specials(hf_tok, list(bpe.SPECIALS))
  return hf_tok


@functools.cache
def _byte_alphabet() -> list[str]:
  """The byte-to-character table of byte-level BPE, as `tokenizers` uses it."""
  return [chr(c) for c in _byte_code_points()]


def _byte_code_points() -> list[int]:
  """GPT-2's table: printable Latin-1 bytes stand for themselves, the rest
  for 256, 257, ... in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  points = {}
  extra = 256
  for b in range(256):
    if b in printable:
      points[b] = b
    else:
      points[b] = extra
      extra += 1
  return [points[b] for b in range(256)]


@functools.cache
def presplit_pattern() -> str:
  """`bpe.PRESPLIT` for Oniguruma, with Python's `\\s`, `\\w`, `\\d` spelled out.

  Python's `re` reads `\\s` as `str.isspace`, `\\d` as `str.isdecimal` and
  `\\w` as `str.isalnum` or "_"; the classes are the ranges of code points
  where those hold, in the Unicode version of this Python.
  """
  space, word, digit = [], [], []
  for code in range(sys.maxunicode + 1):
    if 0xD800 <= code <= 0xDFFF:
      continue
    char = chr(code)
    if char.isspace():
      space.append(code)
    if char.isalnum() or char == "_":
      word.append(code)
    if char.isdecimal():
      digit.append(code)
  word_set, digit_set = set(word), set(digit)
  letter = [c for c in word if c not in digit_set and c != ord("_")]
  space_or_word = sorted(set(space) | word_set)
  s, d, l, sw = (_ranges(codes) for codes in (space, digit, letter, space_or_word))
  return (rf"'(?:[sdmt]|ll|ve|re)| ?[{l}]+| ?[{d}]+| ?(?:[^{sw}]|_)+"
          rf"|[{s}]+(?![^{s}])|[{s}]+")


def _ranges(codes: list[int]) -> str:
  """Sorted code points as the inside of an Oniguruma character class."""
  parts = []
  start = prev = codes[0]
  for code in codes[1:] + [None]:
    if code is not None and code == prev + 1:
      prev = code
      continue
    parts.append(rf"\x{{{start:X}}}" if start == prev else rf"\x{{{start:X}}}-\x{{{prev:X}}}")
    if code is not None:
      start = prev = code
  return "".join(parts)


def _spm_tokenizer(tok: spm.SentencePieceTokenizer) -> tuple[tokenizers.Tokenizer, dict]:
  """A SentencePiece model as a BPE or Unigram model with byte fallback."""
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(tok.model_proto)
  normalizer = proto.normalizer_spec
  if (normalizer.name != "identity" or normalizer.add_dummy_prefix
      or normalizer.remove_extra_whitespaces or not proto.trainer_spec.byte_fallback):
    raise UserError(
        "only SentencePiece models trained here (tokenizer.kind=spm_bpe or spm_unigram: "
        "identity normalisation, no dummy prefix, extra spaces kept, byte fallback) export "
        "to Hugging Face's format; this one has normalisation "
        f"{normalizer.name!r}, add_dummy_prefix={normalizer.add_dummy_prefix}, "
        f"remove_extra_whitespaces={normalizer.remove_extra_whitespaces}, "
        f"byte_fallback={proto.trainer_spec.byte_fallback}")
  pieces = [p.piece.replace("\u2581", " ") if p.type == _PIECE.NORMAL else p.piece
            for p in proto.pieces]
  normal = [p.type == _PIECE.NORMAL for p in proto.pieces]
  if tok.kind == "spm_unigram":
    vocab = [(piece, p.score if is_normal else SPECIAL_SCORE)
             for piece, p, is_normal in zip(pieces, proto.pieces, normal)]
    model = models.Unigram(vocab, unk_id=_unk_id(proto), byte_fallback=True)
  else:
    model = models.BPE({piece: i for i, piece in enumerate(pieces)},
                       _merges_by_score(pieces, proto, normal), byte_fallback=True,
                       unk_token=pieces[_unk_id(proto)])
  hf_tok = tokenizers.Tokenizer(model)
  hf_tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  specials = [piece for piece, p in zip(pieces, proto.pieces)
              if p.type in (_PIECE.CONTROL, _PIECE.UNKNOWN)]
  _add_specials(hf_tok, specials)
  roles = {"bos_token": pieces[tok.bos_id], "eos_token": pieces[tok.eos_id],
           "unk_token": pieces[_unk_id(proto)], "pad_token": pieces[tok.pad_id],
           "mask_token": pieces[tok.mask_id]}
  return hf_tok, roles


def _unk_id(proto) -> int:
  return next(i for i, p in enumerate(proto.pieces) if p.type == _PIECE.UNKNOWN)


def _merges_by_score(pieces: list[str], proto, normal: list[bool]) -> list[tuple[str, str]]:
  """SentencePiece BPE as merges: every split of a piece into two pieces, the
  piece of the highest score first (SentencePiece merges that pair first)."""
  ids = {piece: i for i, piece in enumerate(pieces) if normal[i]}
  merges = []
  for i in sorted(ids.values(), key=lambda i: (-proto.pieces[i].score, i)):
    piece = pieces[i]
    for k in range(1, len(piece)):
      if piece[:k] in ids and piece[k:] in ids:
        merges.append((piece[:k], piece[k:]))
  return merges


def main(argv: Sequence[str] | None = None) -> None:
  """`python -m tokenizer.export TOKENIZER --out DIR`; a user mistake exits 2."""
  parser = argparse.ArgumentParser(
      prog="python -m tokenizer.export",
      description="Write a saved tokenizer as a Hugging Face tokenizer directory.")
  parser.add_argument("tokenizer", type=pathlib.Path,
                      help="a saved tokenizer (a run's tokenizer/ directory)")
  parser.add_argument("--out", required=True, type=pathlib.Path,
                      help="directory to create with tokenizer.json and its configs")
  args = parser.parse_args(argv)
  try:
    if args.out.exists():
      raise UserError(f"--out {args.out} already exists; choose a new directory")
    tok = tokenizer.load_tokenizer(args.tokenizer)
    export_hf(tok, args.out)
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)
  print(f"wrote {tok.kind} tokenizer {tok.fingerprint[:12]} ({tok.vocab_size} ids) "
        f"as a Hugging Face tokenizer to {args.out}")


if __name__ == "__main__":
  main()
