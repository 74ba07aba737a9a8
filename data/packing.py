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
"""
import numpy as np

from data import tokens

PACKING_MODES = ("packed", "concat")


class RowPacker:
  """Row index -> one row, as a dict of [seq_len] arrays; picklable for workers.

  Rows `num_rows` and beyond are all padding (used to fill a last batch).
  """

  def __init__(self, split: tokens.TokenizedSplit, seq_len: int, mode: str, *,
               bos_id: int, eos_id: int, pad_id: int):
    if mode not in PACKING_MODES:
      raise ValueError(f"packing mode must be one of {PACKING_MODES}, got {mode!r}")
    self.seq_len = seq_len
    self.mode = mode
    self.pad_id = pad_id
    self.stream, self.doc_starts = _layout(split, mode, bos_id=bos_id, eos_id=eos_id)
    # Real targets: every document token plus one EOS per document.
    self.num_targets = split.num_tokens + split.num_documents

  @property
  def num_rows(self) -> int:
    """Rows holding at least one target (the last one may be padded)."""
    return -(-max(len(self.stream) - 1, 0) // self.seq_len)

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    t = self.seq_len
    start = row * t
    window = self.stream[start:start + t + 1].astype(np.int32)  # [<= T + 1]
    n = max(len(window) - 1, 0)  # real inputs, each with a target
    inputs = np.full([t], self.pad_id, np.int32)
    targets = np.full([t], self.pad_id, np.int32)
    segment_ids = np.zeros([t], np.int32)
    positions = np.zeros([t], np.int32)
    loss_mask = np.zeros([t], np.float32)
    inputs[:n] = window[:n]
    targets[:n] = window[1:n + 1]
    if self.mode == "packed":
      doc = np.searchsorted(self.doc_starts, start + np.arange(n + 1), side="right") - 1
      segment_ids[:n] = doc[:n] - doc[0] + 1
      doc_start_in_row = np.maximum(self.doc_starts[doc[:n]], start) - start
      positions[:n] = np.arange(n) - doc_start_in_row
      loss_mask[:n] = doc[:n] == doc[1:n + 1]
    else:
      segment_ids[:n] = 1
      positions[:n] = np.arange(n)
      loss_mask[:n] = 1.0
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
            "positions": positions, "loss_mask": loss_mask}


def _layout(split: tokens.TokenizedSplit, mode: str, *, bos_id: int,
            eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """The stream ([len] in the split's dtype) and where each document starts in it.

  `packed`: document d is BOS tokens EOS at stream[doc_starts[d]:...].
  `concat`: one BOS, then each document's tokens followed by EOS; doc_starts
  is unused and empty.
  """
  offsets = split.offsets  # [D + 1]
  num_docs = split.num_documents
  doc_of_token = np.repeat(np.arange(num_docs), np.diff(offsets))  # [N]
  specials_per_doc = 2 if mode == "packed" else 1
  length = split.num_tokens + specials_per_doc * num_docs + (mode == "concat")
  stream = np.full([length], bos_id, split.tokens.dtype)
  # Each earlier document adds its specials; + 1 for the BOS ahead of them all
  # (`concat`) or ahead of this document (`packed`).
  token_index = np.arange(split.num_tokens) + specials_per_doc * doc_of_token + 1
  stream[token_index] = split.tokens
  eos_index = offsets[1:] + specials_per_doc * np.arange(num_docs) + 1
  stream[eos_index] = eos_id
  if mode == "packed":
    doc_starts = offsets[:-1] + 2 * np.arange(num_docs)
  else:
    doc_starts = np.zeros([0], np.int64)
  return stream, doc_starts
