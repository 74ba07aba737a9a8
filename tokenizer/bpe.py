"""Step 1: byte-pair encoding, from the lesson's worked example to production.

The lesson's form works on a word-count table: start from characters and
repeatedly merge the most frequent adjacent pair (`learn_merges`), then apply
the learned merges in order to new words (`apply_merges`).

The production form (`train_bpe`, `BPETokenizer`) is byte-level BPE as used
since GPT-2: words are UTF-8 bytes, so any string is representable; text is
pre-split on spaces and punctuation by a GPT-2 style regex; the ids are
0 <pad>, 1 <bos>, 2 <eos>, 3 <mask>, then the 256 bytes (id 4 + byte value),
then the merged tokens in the order they were learned.

Ties between pairs of equal count are broken the same way everywhere: the
smallest (left, right) pair wins, comparing the symbols as strings (as bytes
for byte-level BPE; UTF-8 keeps the order of code points, so both agree).

The scalable trainer (`iter_merges`) learns exactly the merges of the lesson's
algorithm but keeps the pair counts up to date incrementally, touching only the
words that contain the merged pair, and finds the most frequent pair with a
heap whose stale entries are skipped lazily.
"""
import bisect
import collections
import heapq
import json
import pathlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from configs.errors import UserError
from tokenizer import base

SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(len(SPECIALS))
FIRST_BYTE_ID = len(SPECIALS)
MIN_VOCAB_SIZE = FIRST_BYTE_ID + 256
FILENAME = "bpe.json"

# GPT-2's pre-split pattern written for Python's `re`, which has no \p{..}:
# letters \p{L} -> [^\W\d_] (word characters that are neither digits nor "_"),
# numbers \p{N} -> \d, everything else -> [^\s\w]|_ . Every character is a
# space, a letter, a digit or "everything else", so the pieces cover the text.
PRESPLIT = re.compile(r"'(?:[sdmt]|ll|ve|re)"
                      r"| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+"
                      r"|\s+(?!\S)|\s+")
_CACHE_LIMIT = 1 << 20

Symbol = TypeVar("Symbol", str, bytes, int)


def _merge_symbols(symbols: Sequence[Symbol], left: Symbol, right: Symbol,
                   merged: Symbol) -> list[Symbol]:
  """Replaces each `left right`, scanning left to right, by `merged`."""
  out = []
  i = 0
  last = len(symbols) - 1
  while i <= last:
    if i < last and symbols[i] == left and symbols[i + 1] == right:
      out.append(merged)
      i += 2
    else:
      out.append(symbols[i])
      i += 1
  return out


def learn_merges(word_counts: dict[str, int],
                 num_merges: int) -> list[tuple[str, str]]:
  """Step 1, the lesson's algorithm: recount all pairs, merge the most frequent.

  Starts from characters. Stops after `num_merges` merges or when no word has
  two symbols left. Ties: the smallest (left, right) pair of strings wins.
  """
  words = [(list(word), count) for word, count in word_counts.items()]
  merges = []
  for _ in range(num_merges):
    pair_counts = collections.Counter()
    for symbols, count in words:
      for pair in zip(symbols, symbols[1:]):
        pair_counts[pair] += count
    if not pair_counts:
      break
    left, right = min(pair_counts, key=lambda p: (-pair_counts[p], p))
    merges.append((left, right))
    words = [(_merge_symbols(symbols, left, right, left + right), count)
             for symbols, count in words]
  return merges


def apply_merges(word: str, merges: Iterable[tuple[str, str]]) -> list[str]:
  """Step 1: segments `word` by applying the learned merges in learned order."""
  symbols = list(word)
  for left, right in merges:
    symbols = _merge_symbols(symbols, left, right, left + right)
  return symbols


def iter_merges(
    sequence_counts: dict[tuple[Symbol, ...], int]
) -> Iterator[tuple[Symbol, Symbol]]:
  """Step 1 at scale: yields the merges of `learn_merges`, in order, lazily.

  `sequence_counts` maps each word, already split into its initial symbols
  (characters or single bytes), to its count. The merges are those the
  lesson's algorithm learns on the same table (same tie-breaking), but each
  merge costs time in proportion to the words that contain the pair only:

  - `pair_counts` is updated around each occurrence of the merged pair `a b`
    in a word: with `x` before and `y` after it, the pairs `x a` and `b y` lose
    the word's count and `x ab` and `ab y` gain it (`x` is taken from the
    already merged part, so `a b a b` correctly gives one `ab ab`);
  - `where` remembers which words may contain a pair;
  - a heap holds (-count, left, right) entries. A count only falls after its
    entry was pushed, except for pairs with the newly merged symbol, which are
    pushed again once a merge is done. An entry whose count is out of date is
    pushed again with the current count when it reaches the top, so the top
    entry with an up-to-date count is the most frequent pair.
  """
  symbol_ids: dict[Symbol, int] = {}
  symbols: list[Symbol] = []

  def intern(symbol: Symbol) -> int:
    if symbol not in symbol_ids:
      symbol_ids[symbol] = len(symbols)
      symbols.append(symbol)
    return symbol_ids[symbol]

  words: list[list[int]] = []
  counts: list[int] = []
  for sequence, count in sequence_counts.items():
    if len(sequence) > 1:
      words.append([intern(s) for s in sequence])
      counts.append(count)

  pair_counts: dict[tuple[int, int], int] = collections.defaultdict(int)
  where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
  for index, (word, count) in enumerate(zip(words, counts)):
    for pair in zip(word, word[1:]):
      pair_counts[pair] += count
      where[pair].add(index)
  heap = [(-count, symbols[a], symbols[b], a, b)
          for (a, b), count in pair_counts.items()]
  heapq.heapify(heap)

  while heap:
    neg_count, _, _, a, b = heapq.heappop(heap)
    count = pair_counts.get((a, b), 0)
    if count <= 0:
      continue
    if count != -neg_count:
      heapq.heappush(heap, (-count, symbols[a], symbols[b], a, b))
      continue
    yield symbols[a], symbols[b]
    merged = intern(symbols[a] + symbols[b])
    grown = set()
    for index in where.pop((a, b)):
      word = words[index]
      count = counts[index]
      new = []
      copied = 0
      i = -1
      for _ in range(word.count(a)):
        i = word.index(a, i + 1)
        if i < copied or i + 1 == len(word) or word[i + 1] != b:
          continue
        if i > 0:
          before = merged if i == copied else word[i - 1]
          pair_counts[before, a] -= count
          pair = (before, merged)
          pair_counts[pair] += count
          where[pair].add(index)
          grown.add(pair)
        if i + 2 < len(word):
          after = word[i + 2]
          pair_counts[b, after] -= count
          pair = (merged, after)
          pair_counts[pair] += count
          where[pair].add(index)
          grown.add(pair)
        new += word[copied:i]
        new.append(merged)
        copied = i + 2
      if copied:
        new += word[copied:]
        words[index] = new
    del pair_counts[a, b]
    for pair in grown:
      if pair_counts[pair] > 0:
        heapq.heappush(heap, (-pair_counts[pair], symbols[pair[0]],
                              symbols[pair[1]], pair[0], pair[1]))


def count_words(texts: Iterable[str]) -> collections.Counter[str]:
  """Step 1 pre-split: how often each regex piece occurs in `texts`."""
  counts = collections.Counter()
  for text in texts:
    counts.update(PRESPLIT.findall(base.replace_surrogates(text)))
  return counts


def train_bpe(texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
  """Step 1, production: byte-level BPE with `vocab_size` ids in all.

  Merges are learned (by `iter_merges`) until the vocabulary holds
  `vocab_size` ids: 4 specials, 256 bytes, and the merged tokens. A merge whose
  result is already a token (the same bytes reached by another merge order)
  is kept in the merge list but adds no id.
  """
  if vocab_size < MIN_VOCAB_SIZE:
    raise UserError(f"BPE vocabulary size {vocab_size} is too small: it needs "
                    f"256 bytes + {len(SPECIALS)} special tokens = "
                    f"{MIN_VOCAB_SIZE} at least")
  word_counts = count_words(texts)
  if not word_counts:
    raise UserError("the corpus is empty: no text to learn BPE merges from")
  byte_symbols = [bytes([b]) for b in range(256)]
  sequence_counts = {
      tuple(byte_symbols[b] for b in word.encode("utf-8")): count
      for word, count in word_counts.items()}
  wanted = vocab_size - MIN_VOCAB_SIZE
  merges = []
  tokens = set(byte_symbols)
  learned = iter_merges(sequence_counts)
  while len(tokens) - 256 < wanted:
    merge = next(learned, None)
    if merge is None:
      raise UserError(
          f"the corpus is too small for a BPE vocabulary of {vocab_size}: it "
          f"has no pairs left after {len(tokens) - 256} merged tokens; use "
          f"more text or a vocabulary size of at most "
          f"{len(tokens) + len(SPECIALS)}")
    merges.append(merge)
    tokens.add(merge[0] + merge[1])
  return BPETokenizer(merges)


class BPETokenizer(base.TableTokenizer):
  """Step 1, production: byte-level BPE behind the common interface.

  Encoding pre-splits the text with `PRESPLIT` and segments each piece by
  applying the merges in learned order (the segmentation training produced);
  pieces are cached, so repeated words cost one dictionary lookup.
  """

  kind = "bpe"

  def __init__(self, merges: Sequence[tuple[bytes, bytes]]):
    id_bytes = [b""] * len(SPECIALS) + [bytes([b]) for b in range(256)]
    token_ids = {token: i for i, token in enumerate(id_bytes)
                 if i >= FIRST_BYTE_ID}
    self.merges = [(bytes(left), bytes(right)) for left, right in merges]
    self._merge_pairs: list[tuple[int, int]] = []
    self._merge_results: list[int] = []
    self._ranks: dict[tuple[int, int], list[int]] = {}
    for rank, (left, right) in enumerate(self.merges):
      if left not in token_ids or right not in token_ids:
        raise ValueError(f"merge {rank} joins a token that does not exist yet: "
                         f"{left!r} + {right!r}")
      merged = left + right
      if merged not in token_ids:
        token_ids[merged] = len(id_bytes)
        id_bytes.append(merged)
      pair = (token_ids[left], token_ids[right])
      self._merge_pairs.append(pair)
      self._merge_results.append(token_ids[merged])
      self._ranks.setdefault(pair, []).append(rank)
    fingerprint = base.fingerprint_of({
        "kind": self.kind,
        "specials": list(SPECIALS),
        "vocab": [token.hex() for token in id_bytes[FIRST_BYTE_ID:]],
        "merges": [[left.hex(), right.hex()] for left, right in self.merges],
    })
    super().__init__(id_bytes, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                     mask_id=MASK_ID, fingerprint=fingerprint)
    self._cache: dict[str, list[int]] = {}

  def _encode_piece(self, piece: str) -> list[int]:
    """Applies the merges in learned order to the bytes of one piece.

    Each step merges the applicable pair with the lowest rank above the last
    rank applied, which is the learned order with absent merges skipped.
    """
    ids = [FIRST_BYTE_ID + b for b in piece.encode("utf-8")]
    last = -1
    while len(ids) > 1:
      best = None
      for pair in zip(ids, ids[1:]):
        ranks = self._ranks.get(pair)
        if ranks is not None:
          i = bisect.bisect_right(ranks, last)
          if i < len(ranks) and (best is None or ranks[i] < best):
            best = ranks[i]
      if best is None:
        break
      left, right = self._merge_pairs[best]
      ids = _merge_symbols(ids, left, right, self._merge_results[best])
      last = best
    return ids

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`: pre-split, then each piece from the cache."""
    ids = []
    cache = self._cache
    for piece in PRESPLIT.findall(base.replace_surrogates(text)):
      piece_ids = cache.get(piece)
      if piece_ids is None:
        if len(cache) >= _CACHE_LIMIT:
          cache.clear()
        piece_ids = cache[piece] = self._encode_piece(piece)
      ids += piece_ids
    return ids

  def _write_files(self, directory: pathlib.Path) -> None:
    content = {"specials": list(SPECIALS),
               "merges": [[left.hex(), right.hex()]
                          for left, right in self.merges]}
    (directory / FILENAME).write_text(json.dumps(content) + "\n",
                                      encoding="utf-8")


def load_bpe(directory: pathlib.Path) -> BPETokenizer:
  """Reads `bpe.json` from a saved tokenizer directory (UserError if broken)."""
  path = directory / FILENAME
  try:
    content = json.loads(path.read_text(encoding="utf-8"))
    if content["specials"] != list(SPECIALS):
      raise ValueError(f"special tokens {content['specials']} are not "
                       f"{list(SPECIALS)}")
    merges = [(bytes.fromhex(left), bytes.fromhex(right))
              for left, right in content["merges"]]
    return BPETokenizer(merges)
  except OSError as e:
    raise UserError(f"cannot read the BPE tokenizer file {path}: "
                    f"{e.strerror}") from None
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f"corrupted BPE tokenizer file {path}: "
                    f"{type(e).__name__}: {e}") from None
