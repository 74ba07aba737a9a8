"""Seq2seq pairs as fixed-shape rows, for the two families that can read them.

The lesson's "Three families": a decoder-only model reads source and target
as one causal sequence (prefix LM); an encoder-decoder reads the source with
its bidirectional encoder and generates the target with its causal decoder
through cross-attention. Padding is masked in both (the lesson's pitfall:
"padding masks forgotten in batched encoders").

Decoder (prefix LM), T = train.seq_len; the sequence is
`BOS src EOS tgt EOS` (the first EOS is the separator), n_src + n_tgt + 3
tokens, and a row holds its first T + 1:

  inputs       [T] int32    BOS src EOS tgt, then pad
  targets      [T] int32    src EOS tgt EOS, then pad (next token of each input)
  segment_ids  [T] int32    1 on the sequence, 0 on padding
  positions    [T] int32    0, 1, ..., 0 on padding
  loss_mask    [T] float32  1 only where the target is a tgt token or the final EOS

Encoder-decoder, S = train.seq_len, U = train.tgt_seq_len or S (src and tgt
as `encode` gives them; with data.pair_specials, as `encode_with_specials`
marks a model input, a final EOS of the target's marking taken as the EOS
below: T5's src is "src </s>", BART's "<s> src </s>" and its tgt "<s> tgt",
so that tgt_in is "</s> <s> tgt" and tgt_out "<s> tgt </s>", as
transformers shifts BART's labels):

  src          [S] int32    src, then pad (no BOS/EOS)
  src_mask     [S] int32    1 on src tokens, 0 on padding
  tgt_in       [U] int32    BOS tgt, then pad (teacher forcing; the first
                            token is `decoder_start_id`: BOS, or with
                            model.decoder_start=pad (T5's) the pad id, with
                            model.decoder_start=eos (BART's) the EOS id)
  tgt_out      [U] int32    tgt EOS, then pad
  loss_mask    [U] float32  1 on tgt EOS

A pair that does not fit (decoder: n_src + n_tgt + 2 > T; encoder-decoder:
n_src > S or n_tgt + 1 > U) is dropped, and the count is logged; if no pair
fits it is a UserError. Rows `num_pairs` and beyond are all padding (to fill a
last validation batch).
"""
from absl import logging
from ml_collections import config_dict
import numpy as np

from configs.errors import UserError
from data import tasks


def _marked(tokenizer, text: str, eos_id: int) -> list[int]:
  """`text` as the tokenizer marks a model input, without a final EOS (the
  rows add it back where it belongs)."""
  ids = tokenizer.encode_with_specials(text)
  return ids[:-1] if ids and ids[-1] == eos_id else ids


def decoder_start_id(tokenizer, decoder_start: str) -> int:
  """The id an encoder-decoder's decoder starts from (`model.decoder_start`):
  the tokenizer's bos, pad (T5) or eos (BART) id."""
  return {"bos": tokenizer.bos_id, "pad": tokenizer.pad_id, "eos": tokenizer.eos_id}[decoder_start]


class PairRows:
  """The tokenised pairs of a split that fit, and their rows; a Grain source.

  `src_texts`/`tgt_texts` and `src_ids`/`tgt_ids` (lists of int32 arrays)
  hold the kept pairs in order; `self(i)` or `self[i]` is row i. `specials`
  (encoder-decoder, data.pair_specials): src and tgt marked with the
  tokenizer's special tokens (see the module docstring); the source's final
  EOS is kept.
  """

  def __init__(self, pairs: list[tasks.Pair], tokenizer, *, family: str, seq_len: int,
               tgt_seq_len: int = 0, decoder_start: str = "bos", specials: bool = False):
    self.family = family
    self.seq_len = seq_len
    self.tgt_seq_len = tgt_seq_len or seq_len
    self.bos_id, self.eos_id, self.pad_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    self.start_id = decoder_start_id(tokenizer, decoder_start)  # encoder_decoder
    if specials:
      src_ids = [tokenizer.encode_with_specials(src) for src, _ in pairs]
      tgt_ids = [_marked(tokenizer, tgt, self.eos_id) for _, tgt in pairs]
    else:
      src_ids = tokenizer.encode_batch([src for src, _ in pairs])
      tgt_ids = tokenizer.encode_batch([tgt for _, tgt in pairs])
    keep = [i for i in range(len(pairs)) if self.fits(len(src_ids[i]), len(tgt_ids[i]))]
    self.num_dropped = len(pairs) - len(keep)
    self.src_texts = [pairs[i][0] for i in keep]
    self.tgt_texts = [pairs[i][1] for i in keep]
    self.src_ids = [np.asarray(src_ids[i], np.int32) for i in keep]
    self.tgt_ids = [np.asarray(tgt_ids[i], np.int32) for i in keep]

  def fits(self, num_src: int, num_tgt: int) -> bool:
    if self.family == "decoder":
      return num_src + num_tgt + 2 <= self.seq_len
    return num_src <= self.seq_len and num_tgt + 1 <= self.tgt_seq_len

  @property
  def num_pairs(self) -> int:
    return len(self.src_ids)

  def __len__(self) -> int:
    return self.num_pairs

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self(index)

  def prompt(self, index: int) -> list[int]:
    """What generation starts from: BOS src EOS (decoder) or the decoder
    start token (encoder-decoder)."""
    if self.family == "decoder":
      return [self.bos_id, *self.src_ids[index].tolist(), self.eos_id]
    return [self.start_id]

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    real = index < self.num_pairs
    src = self.src_ids[index] if real else np.zeros([0], np.int32)
    tgt = self.tgt_ids[index] if real else np.zeros([0], np.int32)
    if self.family == "decoder":
      return self._prefix_lm_row(src, tgt, real)
    return self._encoder_decoder_row(src, tgt, real)

  def _prefix_lm_row(self, src, tgt, real: bool) -> dict[str, np.ndarray]:
    t = self.seq_len
    seq = (np.concatenate([[self.bos_id], src, [self.eos_id], tgt, [self.eos_id]])
           if real else np.zeros([0], np.int32))
    n = max(len(seq) - 1, 0)  # inputs with a target
    row = {"inputs": np.full([t], self.pad_id, np.int32),
           "targets": np.full([t], self.pad_id, np.int32),
           "segment_ids": np.zeros([t], np.int32), "positions": np.zeros([t], np.int32),
           "loss_mask": np.zeros([t], np.float32)}
    row["inputs"][:n] = seq[:n]
    row["targets"][:n] = seq[1:n + 1]
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n)
    # Input len(src) + 1 is the separator EOS: from there on the targets are tgt EOS.
    row["loss_mask"][len(src) + 1:n] = 1.0
    return row

  def _encoder_decoder_row(self, src, tgt, real: bool) -> dict[str, np.ndarray]:
    s, u = self.seq_len, self.tgt_seq_len
    row = {"src": np.full([s], self.pad_id, np.int32), "src_mask": np.zeros([s], np.int32),
           "tgt_in": np.full([u], self.pad_id, np.int32),
           "tgt_out": np.full([u], self.pad_id, np.int32),
           "loss_mask": np.zeros([u], np.float32)}
    row["src"][:len(src)] = src
    row["src_mask"][:len(src)] = 1
    if real:
      m = len(tgt) + 1
      row["tgt_in"][:m] = np.concatenate([[self.start_id], tgt])
      row["tgt_out"][:m] = np.concatenate([tgt, [self.eos_id]])
      row["loss_mask"][:m] = 1.0
    return row


def load_rows(config: config_dict.ConfigDict, tokenizer, split: str) -> PairRows:
  """The rows of `split` of data.task for model.family; logs the pairs dropped.

  Raises:
    UserError: data.task=none, or no pair of the split fits the row lengths.
  """
  task = config.data.task
  if task == "none":
    raise UserError("train.objective=seq2seq needs data.task: one of "
                    f"{', '.join(tasks.TASKS)} (pairs reads your .tsv/.jsonl files)")
  pairs = tasks.load_pairs(config.data, split)
  if not pairs:
    raise UserError(f"the {split} split of data.task={task} is empty: data.val_percent="
                    f"{config.data.val_percent} leaves it no pairs; change data.val_percent "
                    "or add pairs")
  rows = pair_rows(config, tokenizer, pairs)
  if rows.num_dropped:
    logging.warning("data.task=%s: dropped %d of %d %s pairs longer than the rows (%s)",
                    task, rows.num_dropped, len(pairs), split, _lengths(config))
  if not rows.num_pairs:
    raise UserError(f"data.task={task}: none of the {len(pairs)} {split} pairs fits "
                    f"{_lengths(config)}; raise train.seq_len (or data.val_percent, "
                    "or shorten the pairs)")
  return rows


def pair_rows(config: config_dict.ConfigDict, tokenizer, pairs: list[tasks.Pair]) -> PairRows:
  """`pairs` as the rows of a run of `config` (its family, lengths, specials)."""
  return PairRows(pairs, tokenizer, family=config.model.family, seq_len=config.train.seq_len,
                  tgt_seq_len=config.train.tgt_seq_len,
                  decoder_start=config.model.decoder_start, specials=config.data.pair_specials)


def _lengths(config: config_dict.ConfigDict) -> str:
  t = config.train
  if config.model.family == "decoder":
    return f"BOS src EOS tgt EOS <= train.seq_len + 1 = {t.seq_len + 1} tokens"
  return (f"src <= train.seq_len = {t.seq_len}, tgt + EOS <= train.tgt_seq_len = "
          f"{t.tgt_seq_len or t.seq_len} tokens")
