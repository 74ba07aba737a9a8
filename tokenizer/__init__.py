"""Step 1 of the lesson, tokenization: train, save, load and check tokenizers.

Kinds: `bpe` (our byte-level BPE, `tokenizer/bpe.py`), `spm_bpe` and
`spm_unigram` (SentencePiece, `tokenizer/spm.py`), trained here, and `hf`
(a Hugging Face `tokenizer.json`, `tokenizer/hf.py`), loaded only. All share
the interface of `tokenizer.base.Tokenizer`. A saved tokenizer is a directory
holding the kind's file (`bpe.json`, `spm.model` or `hf/tokenizer.json` with
its config) and a `tokenizer.json` manifest with the kind and the
fingerprint, which `load_tokenizer` verifies. `export_hf` writes any kind as
a Hugging Face tokenizer directory (`tokenizer/export.py`).
"""
import json
import pathlib
from collections.abc import Iterable

from configs.errors import UserError
from tokenizer import bpe, hf, spm
from tokenizer.base import MANIFEST, Tokenizer, check_fingerprint
from tokenizer.export import export_hf

KINDS = ("bpe", "spm_bpe", "spm_unigram")

__all__ = ["KINDS", "Tokenizer", "check_fingerprint", "export_hf", "load_tokenizer",
           "train_tokenizer"]


def train_tokenizer(kind: str, vocab_size: int,
                    texts: Iterable[str]) -> Tokenizer:
  """Step 1: learns a `kind` vocabulary of `vocab_size` ids, specials included.

  `kind` is `bpe`, `spm_bpe` or `spm_unigram`; `texts` are the documents.
  """
  if kind == "bpe":
    return bpe.train_bpe(texts, vocab_size)
  if kind in spm.KINDS:
    return spm.train_spm(kind, vocab_size, texts)
  raise UserError(f"unknown tokenizer kind {kind!r}; choose one of "
                  f"{', '.join(KINDS)}")


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
  """Loads a saved tokenizer, a Hugging Face tokenizer or a SentencePiece `.model`.

  A directory (or its `tokenizer.json`) whose `tokenizer.json` is Hugging
  Face's loads as kind `hf`. For a saved tokenizer, the kind comes from the
  `tokenizer.json` manifest, and the fingerprint of what was loaded must equal
  the manifest's: otherwise the files were changed or damaged and a UserError
  names the file.
  """
  path = pathlib.Path(path)
  if path.name == MANIFEST:
    path = path.parent
  if path.is_file():
    return spm.load_spm_model(path)
  if not path.is_dir():
    raise UserError(f"no tokenizer at {path}: no such file or directory")
  manifest_path = path / MANIFEST
  if not manifest_path.is_file():
    if (path / "tokenizer.model").is_file():
      raise UserError(f"{path} has no {MANIFEST}, only a SentencePiece tokenizer.model; "
                      f"give the path of that file ({path / 'tokenizer.model'})")
    raise UserError(f"{path} is not a saved tokenizer: it has no {MANIFEST}")
  try:
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if hf.is_hf_tokenizer_json(manifest):
      return hf.load_hf(path)
    kind = manifest["kind"]
    expected = manifest["fingerprint"]
    if not isinstance(kind, str) or not isinstance(expected, str):
      raise TypeError("kind and fingerprint must be strings")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"corrupted tokenizer manifest {manifest_path}: "
                    f"{type(e).__name__}: {e}") from None
  if kind == "bpe":
    data_path = path / bpe.FILENAME
    tok = bpe.load_bpe(path)
  elif kind in spm.KINDS:
    data_path = path / spm.FILENAME
    tok = spm.load_spm_model(data_path)
  elif kind == "hf":
    data_path = path / hf.SUBDIR / hf.FILENAME
    tok = hf.load_hf(path / hf.SUBDIR)
  else:
    raise UserError(f"corrupted tokenizer manifest {manifest_path}: unknown "
                    f"kind {kind!r}")
  if tok.fingerprint != expected:
    raise UserError(
        f"corrupted tokenizer file {data_path}: its fingerprint "
        f"{tok.fingerprint[:12]} ({tok.kind}) does not match "
        f"{expected[:12]} ({kind}) recorded in {manifest_path}")
  return tok
