"""Packing a tokenised split into fixed-length rows of seq_len + 1 tokens.

Both modes lay the split out as one token stream and cut it into rows that
overlap by one token: row r is `stream[r * T : r * T + T + 1]` (T = seq_len),
its inputs are `row[:-1]` and its targets `row[1:]`. So every stream token
after the first is the target of exactly one row; the last row is padded.

`packed`: stream = BOS doc_1 EOS BOS doc_2 EOS ... A document that does not
  fit is cut at the row boundary and continues in the next row. Within a row,
  `segment_ids` number the documents 1, 2, 3, ... and `positions` restart at 0
  at each document (and at the row start), so attention masked by segment never
  crosses documents. `loss_mask` is 1 where the input and its target belong to
  the same document: the target of a document's last token is its EOS, and
  the EOS -> next BOS step across the boundary carries no loss.
`concat`: stream = BOS doc_1 EOS doc_2 EOS ... Every row is one segment (id 1)
  with positions 0..T-1 and loss on every target; attention sees across the
  EOS separators.

Padding is token `pad_id`, segment 0, position 0, loss_mask 0. In both modes
the real targets (loss_mask 1), read row by row, are exactly
doc_1 EOS doc_2 EOS ...: no token is lost or repeated.

The stream is never built: a `PackingIndex` holds, per document of the split,
its shard, where its tokens start in that shard's token array, and where it
starts in the stream (20 bytes a document, none per token). A row is cut
from the memory-mapped token arrays of the documents it overlaps. The index
is computed once per set of cache entries, split, data.val_percent and mode,
and stored under `index/<key>/` beside the token cache, memory-mapped too.
"""
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from data import tokens

PACKING_MODES = ("packed", "concat")
_INDEX_FORMAT = 1
_INDEX_FILES = ("stream_start.npy", "doc_shard.npy", "doc_start.npy")


class PackingIndex:
  """The documents of one split laid out as a stream (see the module docstring).

  stream_start [D + 1] int64: document d is stream[stream_start[d]:stream_start[d + 1]]
    (BOS tokens EOS when packed, tokens EOS when concat: stream[0] is then the BOS)
  doc_shard    [D] int32: the shard that holds document d
  doc_start    [D] int64: where its tokens start in that shard's token array

  Picklable for Grain's workers: a stored index pickles as its paths and is
  mapped again in the worker.
  """

  def __init__(self, mode: str, arrays: dict[str, np.ndarray] | None = None,
               shard_tokens: list | None = None, *, directory: str = "",
               token_paths: tuple[str, ...] = (), num_bytes: int = 0):
    if mode not in PACKING_MODES:
      raise ValueError(f"packing mode must be one of {PACKING_MODES}, got {mode!r}")
    self.mode = mode
    self.directory = directory
    self.token_paths = token_paths
    self.num_bytes = num_bytes  # UTF-8 bytes of the split's texts
    self._arrays = arrays
    self._shard_tokens = shard_tokens

  @classmethod
  def of_documents(cls, documents: list, mode: str) -> "PackingIndex":
    """An index in memory over token lists, one shard (for tests and small inputs)."""
    lengths = np.array([len(d) for d in documents], np.int64)
    flat = np.array([t for d in documents for t in d], np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    arrays = {"stream_start": _stream_start(lengths, mode),
              "doc_shard": np.zeros(len(documents), np.int32), "doc_start": starts}
    return cls(mode, arrays, [flat], num_bytes=int(lengths.sum()))

  def __getstate__(self):
    state = dict(self.__dict__)
    if self.directory:
      state["_arrays"] = state["_shard_tokens"] = None
    return state

  @property
  def arrays(self) -> dict[str, np.ndarray]:
    if self._arrays is None:
      self._arrays = {name[:-4]: np.load(os.path.join(self.directory, name), mmap_mode="r")
                      for name in _INDEX_FILES}
    return self._arrays

  def shard_tokens(self, shard: int) -> np.ndarray:
    if self._shard_tokens is None:
      self._shard_tokens = [None] * len(self.token_paths)
    if self._shard_tokens[shard] is None:
      self._shard_tokens[shard] = np.load(self.token_paths[shard], mmap_mode="r")
    return self._shard_tokens[shard]

  @property
  def specials(self) -> int:
    """Special tokens each document adds to the stream (BOS and EOS, or EOS)."""
    return 2 if self.mode == "packed" else 1

  @property
  def num_documents(self) -> int:
    return len(self.arrays["doc_start"])

  @property
  def stream_length(self) -> int:
    return int(self.arrays["stream_start"][-1])

  @property
  def num_tokens(self) -> int:
    """Document tokens, without BOS/EOS."""
    return self.stream_length - self.specials * self.num_documents - (self.mode == "concat")

  def document(self, d: int) -> np.ndarray:
    """The tokens of document d (a view of the mapped shard array)."""
    a = self.arrays
    length = int(a["stream_start"][d + 1] - a["stream_start"][d]) - self.specials
    start = int(a["doc_start"][d])
    return self.shard_tokens(int(a["doc_shard"][d]))[start:start + length]


def _stream_start(lengths: np.ndarray, mode: str) -> np.ndarray:
  """[D + 1] where each document starts in the stream, then the stream's length."""
  specials = 2 if mode == "packed" else 1
  first = 0 if mode == "packed" else 1  # concat: one BOS ahead of every document
  return np.concatenate([[first], first + np.cumsum(lengths + specials)]).astype(np.int64)


def load_index(entries: list[tokens.Entry], split: str, val_percent: int, mode: str,
               root: str) -> PackingIndex:
  """The stored index of `split` over the cache entries; built (atomically) when missing."""
  parts = [f"v{_INDEX_FORMAT}", mode, split, str(val_percent)] + [e.key for e in entries]
  key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
  directory = os.path.join(root, "index", key)
  token_paths = tuple(os.path.join(e.directory, "tokens.npy") for e in entries)
  num_bytes = sum(e.num_bytes(split, val_percent) for e in entries)
  if not _index_intact(directory):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=key + ".tmp-")
    try:
      _write_index(entries, split, val_percent, mode, tmp)
      try:
        os.rename(tmp, directory)
      except OSError:
        if not _index_intact(directory):  # not another process's complete index
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return PackingIndex(mode, directory=directory, token_paths=token_paths, num_bytes=num_bytes)


def _selected(entry: tokens.Entry, split: str, val_percent: int) -> np.ndarray:
  """The documents of the entry in `split`, by index."""
  held_out = np.asarray(entry.array("buckets")) < val_percent
  return np.flatnonzero(held_out if split == "validation" else ~held_out)


def _write_index(entries, split: str, val_percent: int, mode: str, directory: str) -> None:
  """Two passes over the entries' offsets and buckets: count, then fill the mapped files."""
  counts = [len(_selected(e, split, val_percent)) for e in entries]
  total = sum(counts)
  out = {name[:-4]: np.lib.format.open_memmap(os.path.join(directory, name), mode="w+",
                                              dtype=dtype, shape=(total + (name[0] == "s"),))
         for name, dtype in zip(_INDEX_FILES, (np.int64, np.int32, np.int64))}
  position = 0
  out["stream_start"][0] = 0 if mode == "packed" else 1
  specials = 2 if mode == "packed" else 1
  for shard, (entry, count) in enumerate(zip(entries, counts)):
    docs = _selected(entry, split, val_percent)
    offsets = np.asarray(entry.array("offsets"))
    starts = offsets[docs]
    lengths = offsets[docs + 1] - starts
    base = out["stream_start"][position]
    out["stream_start"][position + 1:position + count + 1] = base + np.cumsum(lengths + specials)
    out["doc_shard"][position:position + count] = shard
    out["doc_start"][position:position + count] = starts
    position += count
  for array in out.values():
    array.flush()
  del out
  meta = {"format": _INDEX_FORMAT, "mode": mode, "split": split, "val_percent": val_percent,
          "num_documents": total,
          "crc32": {name: tokens.file_crc32(os.path.join(directory, name)) for name in _INDEX_FILES}}
  with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f)


def _index_intact(directory: str) -> bool:
  try:
    with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
      meta = json.load(f)
    return all(meta["crc32"][name] == tokens.file_crc32(os.path.join(directory, name))
               for name in _INDEX_FILES)
  except (OSError, ValueError, KeyError):
    return False


class RowPacker:
  """Row index -> one row, as a dict of [seq_len] arrays; picklable for workers.

  Rows `num_rows` and beyond are all padding (used to fill a last batch).
  """

  def __init__(self, index: PackingIndex, seq_len: int, *, bos_id: int, eos_id: int,
               pad_id: int):
    self.index = index
    self.seq_len = seq_len
    self.mode = index.mode
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    # Real targets: every document token plus one EOS per document.
    self.num_targets = index.num_tokens + index.num_documents

  @property
  def stream_length(self) -> int:
    return self.index.stream_length

  @property
  def num_rows(self) -> int:
    """Rows holding at least one target (the last one may be padded)."""
    return -(-max(self.stream_length - 1, 0) // self.seq_len)

  def _window(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """stream[start:end] as int32, and where the documents it overlaps start (first
    of them at or before `start`)."""
    stream_start = self.index.arrays["stream_start"]
    window = np.empty([end - start], np.int32)
    d0 = max(int(np.searchsorted(stream_start, start, side="right")) - 1, 0)
    d1 = int(np.searchsorted(stream_start, end, side="left"))
    d1 = min(d1, self.index.num_documents)
    starts = np.asarray(stream_start[d0:d1 + 1], np.int64)
    if start == 0 and self.mode == "concat":
      window[0] = self.bos_id
    first = 1 if self.mode == "packed" else 0  # where the tokens start within the document
    for k, d in enumerate(range(d0, d1)):
      a, b = int(starts[k]), int(starts[k + 1])
      tokens_at = a + first  # stream position of the document's first token
      length = b - a - self.index.specials
      lo, hi = max(start, tokens_at), min(end, tokens_at + length)
      if lo < hi:
        window[lo - start:hi - start] = self.index.document(d)[lo - tokens_at:hi - tokens_at]
      if first and start <= a < end:
        window[a - start] = self.bos_id
      if start <= b - 1 < end:
        window[b - 1 - start] = self.eos_id
    return window, starts[:-1] if len(starts) else starts

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    t = self.seq_len
    start = row * t
    end = min(start + t + 1, self.stream_length)
    window, doc_starts = self._window(start, end) if end > start else (
        np.zeros([0], np.int32), np.zeros([0], np.int64))
    n = max(len(window) - 1, 0)  # real inputs, each with a target
    inputs = np.full([t], self.pad_id, np.int32)
    targets = np.full([t], self.pad_id, np.int32)
    segment_ids = np.zeros([t], np.int32)
    positions = np.zeros([t], np.int32)
    loss_mask = np.zeros([t], np.float32)
    inputs[:n] = window[:n]
    targets[:n] = window[1:n + 1]
    if self.mode == "packed" and n:
      doc = np.searchsorted(doc_starts, start + np.arange(n + 1), side="right") - 1
      segment_ids[:n] = doc[:n] - doc[0] + 1
      doc_start_in_row = np.maximum(doc_starts[doc[:n]], start) - start
      positions[:n] = np.arange(n) - doc_start_in_row
      loss_mask[:n] = doc[:n] == doc[1:n + 1]
    else:
      segment_ids[:n] = 1
      positions[:n] = np.arange(n)
      loss_mask[:n] = 1.0
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
            "positions": positions, "loss_mask": loss_mask}
