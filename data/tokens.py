"""Tokenise a split once and cache it on disk.

A cache entry is keyed by a SHA-256 over the tokenizer's fingerprint and the
split's content (every document's name and text), so editing, adding or
removing a document, changing `data.val_percent` or `data.jsonl_field`, or
changing the tokenizer gives a new entry, and the same corpus on another
machine gives the same one. An entry in `data.cache_dir` (or
`~/.cache/transformer_lab` when empty), under `tokens/`, is three files:

  <stem>.tokens.npy   [num_tokens] uint16 (uint32 when vocab_size > 65536):
                      every document's tokens, concatenated, no special tokens
  <stem>.offsets.npy  [num_documents + 1] int64: document d is
                      tokens[offsets[d]:offsets[d + 1]]
  <stem>.json         counts (documents, tokens, UTF-8 bytes) and the CRC-32
                      of each .npy file; written last, so its presence marks a
                      complete entry

Each file is written to a temporary name and moved into place with
`os.replace`, so an interrupted run never leaves a partial file behind. An
entry whose files do not match its recorded counts or checksums (a disk that
flipped bits, a file truncated or replaced by hand) is rebuilt, with a
one-line note, never used.
"""
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import zlib

from ml_collections import config_dict
import numpy as np

from data import sources

DEFAULT_CACHE_DIR = "~/.cache/transformer_lab"
_FORMAT_VERSION = 1
_ENCODE_CHUNK_DOCS = 256  # documents per tokenizer.encode_batch call
_ARRAY_FILES = (".tokens.npy", ".offsets.npy")


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """One split, tokenised: `tokens[offsets[d]:offsets[d + 1]]` is document d."""
  tokens: np.ndarray  # [num_tokens] uint16 | uint32
  offsets: np.ndarray  # [num_documents + 1] int64
  num_bytes: int  # UTF-8 bytes of all the split's texts

  @property
  def num_documents(self) -> int:
    return len(self.offsets) - 1

  @property
  def num_tokens(self) -> int:
    return len(self.tokens)


def cache_dir(data_config: config_dict.ConfigDict) -> str:
  """The directory of the token cache entries."""
  root = data_config.cache_dir or DEFAULT_CACHE_DIR
  return os.path.join(os.path.expanduser(root), "tokens")


def load_split(data_config: config_dict.ConfigDict, tokenizer, split: str) -> TokenizedSplit:
  """`split` of the `data` section, tokenised; from the cache when it is there.

  Args:
    data_config: the `data` section of the config.
    tokenizer: the tokenizer contract (`encode_batch`, `vocab_size`,
      `fingerprint`).
    split: `train` or `validation`.

  Returns:
    The tokenised split (an empty one when the split has no documents).
  """
  docs = sources.load_documents(data_config, split)
  stem = os.path.join(cache_dir(data_config),
                      f"{data_config.source}-{split}-{_cache_key(docs, tokenizer)}")
  if os.path.exists(stem + ".json"):
    cached, problem = _read_entry(stem)
    if cached is not None:
      return cached
    print(f"note: token cache entry {stem} is damaged ({problem}); rebuilding it",
          file=sys.stderr)
  split_tokens = _encode(docs, tokenizer)
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  _atomic_write(stem + ".tokens.npy", lambda f: np.save(f, split_tokens.tokens))
  _atomic_write(stem + ".offsets.npy", lambda f: np.save(f, split_tokens.offsets))
  meta = {"source": data_config.source, "split": split,
          "tokenizer": tokenizer.fingerprint, "num_documents": split_tokens.num_documents,
          "num_tokens": split_tokens.num_tokens, "num_bytes": split_tokens.num_bytes,
          "crc32": {suffix: _file_crc32(stem + suffix) for suffix in _ARRAY_FILES}}
  _atomic_write(stem + ".json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
  return split_tokens


def _read_entry(stem: str) -> tuple[TokenizedSplit | None, str]:
  """(the cached split, "") when its files match the recorded counts and
  checksums, else (None, what does not match)."""
  try:
    with open(stem + ".json", encoding="utf-8") as f:
      meta = json.load(f)
    if "crc32" not in meta:
      return None, "written by an older version, without checksums"
    recorded = meta["crc32"]
    for suffix in _ARRAY_FILES:
      if recorded.get(suffix) != _file_crc32(stem + suffix):
        return None, f"{os.path.basename(stem + suffix)} does not match its recorded checksum"
    split_tokens = TokenizedSplit(tokens=np.load(stem + ".tokens.npy"),
                                  offsets=np.load(stem + ".offsets.npy"),
                                  num_bytes=meta["num_bytes"])
  except (OSError, ValueError, KeyError) as e:
    return None, f"{type(e).__name__}: {e}"
  counts = (split_tokens.num_documents, split_tokens.num_tokens, int(split_tokens.offsets[-1]))
  if counts != (meta["num_documents"], meta["num_tokens"], meta["num_tokens"]):
    return None, "its files do not match the recorded document and token counts"
  return split_tokens, ""


def _file_crc32(path: str) -> int:
  """CRC-32 of a file's bytes, read in 16 MiB chunks."""
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc


def _cache_key(docs: list[sources.Document], tokenizer) -> str:
  """SHA-256 (hex, first 24 digits) of the format, tokenizer and documents."""
  h = hashlib.sha256(f"v{_FORMAT_VERSION}\0{tokenizer.fingerprint}\0".encode())
  for name, text in docs:
    h.update(f"{len(name)}:{name}{len(text)}:".encode())
    h.update(text.encode("utf-8"))
  return h.hexdigest()[:24]


def _encode(docs: list[sources.Document], tokenizer) -> TokenizedSplit:
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
  chunks = [np.zeros([0], dtype)]
  lengths = [0]
  for start in range(0, len(docs), _ENCODE_CHUNK_DOCS):
    texts = [text for _, text in docs[start:start + _ENCODE_CHUNK_DOCS]]
    for ids in tokenizer.encode_batch(texts):
      chunks.append(np.asarray(ids, dtype))
      lengths.append(len(ids))
  return TokenizedSplit(tokens=np.concatenate(chunks),
                        offsets=np.cumsum(lengths, dtype=np.int64),
                        num_bytes=sum(len(text.encode("utf-8")) for _, text in docs))


def _atomic_write(path: str, write) -> None:
  """Calls `write(file)` on a temporary file, then renames it to `path`."""
  fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(path),
                                  prefix=os.path.basename(path) + ".tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp_path, path)
  finally:
    if os.path.exists(tmp_path):
      os.remove(tmp_path)
