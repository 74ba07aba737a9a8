"""The one interface every tokenizer of Step 1 (tokenization) implements.

Step 1 of the lesson turns text into the integer tokens a model reads. This
module holds what the kinds share: the abstract `Tokenizer`, decoding through
a table of token bytes (`TableTokenizer`), the treatment of lone surrogates,
the fingerprint, atomic saving with a `tokenizer.json` manifest, and
`check_fingerprint`.

Conventions shared by the kinds trained here (`bpe`, `spm_bpe`,
`spm_unigram`); a Hugging Face tokenizer (`hf`) replaces lone surrogates too
but otherwise encodes and decodes as its own files say (`tokenizer/hf.py`):

- Encoding: text is a sequence of Unicode scalar values. A lone surrogate
  (U+D800..U+DFFF, which has no UTF-8 encoding) is replaced by U+FFFD before
  encoding, so `decode(encode(s)) == s` holds exactly for every string without
  surrogates, and for a string with them gives the string with each surrogate
  code point replaced by U+FFFD.
- Decoding: the ids of special tokens (pad, bos, eos, mask, and SentencePiece's
  other control tokens) decode to nothing; their text is never produced. The
  token bytes are joined and decoded as UTF-8 with errors="replace", so an
  id sequence that cuts a character apart gives U+FFFD for the broken part.
  An id outside [0, vocab_size) is a programming error (ValueError).
"""
import abc
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterable

import numpy as np

from configs.errors import UserError

MANIFEST = "tokenizer.json"
_SURROGATES = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> str:
  """Step 1 input rule: each lone surrogate code point becomes U+FFFD."""
  return _SURROGATES.sub("\ufffd", text)


def fingerprint_of(content: dict) -> str:
  """sha256 hex digest of `content` written as canonical JSON."""
  canonical = json.dumps(content, sort_keys=True, separators=(",", ":"),
                         ensure_ascii=True)
  return hashlib.sha256(canonical.encode("ascii")).hexdigest()


class Tokenizer(abc.ABC):
  """Step 1: text <-> token ids, the same way for every kind.

  Subclasses name their special ids, compute the fingerprint of their
  vocabulary, merges (or scores) and specials, and implement `vocab_size`,
  `token_bytes`, `encode`, `decode` and `_write_files`.
  """

  kind: str

  def __init__(self, *, pad_id: int, bos_id: int, eos_id: int, mask_id: int,
               fingerprint: str):
    self.pad_id = pad_id
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.mask_id = mask_id
    self.fingerprint = fingerprint

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids, special tokens included."""

  @abc.abstractmethod
  def token_bytes(self, token_id: int) -> bytes:
    """The bytes `token_id` stands for (empty for special tokens)."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no bos/eos added)."""

  def encode_with_specials(self, text: str) -> list[int]:
    """Token ids of `text` as a model input starts: BOS, then `encode(text)`.

    This is what `transformers`' `tokenizer(text)["input_ids"]` gives for a
    tokenizer exported by `tokenizer.export_hf`; a Hugging Face tokenizer
    (kind `hf`) adds the special tokens its own files say.
    """
    return [self.bos_id] + self.encode(text)

  def encode_classified(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
    """(ids, token type ids) of a classifier's input: `BOS text EOS`, with a
    pair `BOS text EOS pair EOS` whose `pair EOS` has type 1 (BERT's
    segments); a Hugging Face tokenizer marks them as its own files say."""
    first = [self.bos_id] + self.encode(text) + [self.eos_id]
    second = [] if pair is None else self.encode(pair) + [self.eos_id]
    return first + second, [0] * len(first) + [1] * len(second)

  def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
    """`encode` of each text, in order."""
    return [self.encode(text) for text in texts]

  @abc.abstractmethod
  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`: specials skipped, broken UTF-8 replaced by U+FFFD."""

  def _check_ids(self, ids: Iterable[int]) -> np.ndarray:
    """`ids` as a 1-D int64 array; ValueError if any lies outside the vocabulary."""
    array = np.asarray(ids, dtype=np.int64)
    if array.ndim != 1:
      raise ValueError("decode takes a 1-D sequence of ids, got shape "
                       f"{array.shape}")
    if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
      raise ValueError(f"ids must lie in [0, {self.vocab_size}), got "
                       f"{array.min()}..{array.max()}")
    return array

  @abc.abstractmethod
  def _write_files(self, directory: pathlib.Path) -> None:
    """Writes this kind's files into the (new, empty) `directory`."""

  def save(self, directory: str | os.PathLike) -> pathlib.Path:
    """Writes the files and `tokenizer.json` to `directory`, atomically.

    Everything is written to a temporary sibling directory that is renamed to
    `directory` at the end, so `directory` is either complete or absent. An
    existing non-empty `directory` is refused (UserError), never overwritten.
    """
    target = pathlib.Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
      raise UserError(f"{target} already exists and is not an empty directory; "
                      "choose another place to save the tokenizer")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-",
                                        dir=target.parent))
    try:
      self._write_files(tmp)
      manifest = {"kind": self.kind, "fingerprint": self.fingerprint,
                  "vocab_size": self.vocab_size}
      (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n",
                                  encoding="utf-8")
      tmp.chmod(0o755)
      os.replace(tmp, target)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    return target


class TableTokenizer(Tokenizer):
  """A tokenizer that decodes through a table of the bytes of each id.

  `id_bytes[i]` is what id i decodes to (empty for special tokens); decoding
  joins the bytes and reads them as UTF-8 with errors="replace".
  """

  def __init__(self, id_bytes: list[bytes], **specials):
    self._id_bytes = id_bytes
    super().__init__(**specials)

  @property
  def vocab_size(self) -> int:
    return len(self._id_bytes)

  def token_bytes(self, token_id: int) -> bytes:
    return self._id_bytes[token_id]

  def decode(self, ids: Iterable[int]) -> str:
    table = self._id_bytes
    return b"".join([table[i] for i in self._check_ids(ids).tolist()]).decode(
        "utf-8", errors="replace")


def check_fingerprint(expected: str, tokenizer: Tokenizer) -> None:
  """Refuses a tokenizer other than the one a checkpoint was trained with."""
  if tokenizer.fingerprint != expected:
    raise UserError(
        f"checkpoint was trained with tokenizer {expected[:12]} but got "
        f"{tokenizer.fingerprint[:12]} ({tokenizer.kind}, vocabulary "
        f"{tokenizer.vocab_size}); use the tokenizer saved in the run "
        "directory")
