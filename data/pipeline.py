"""Grain pipelines: the training iterator, validation batches, split statistics.

A batch is a dict of numpy arrays, B rows of T = train.seq_len tokens (see
`data/packing.py` for what each field holds in each `data.packing` mode):

  inputs       [B, T] int32    tokens fed to the model
  targets      [B, T] int32    the next token of each input
  segment_ids  [B, T] int32    document within the row, 1, 2, ...; 0 = padding
  positions    [B, T] int32    position within the document (packed) or row
  loss_mask    [B, T] float32  1 where the target is real and within a document

The objective and data.task choose the rows (`rows_of_split`):

- `next_token`: packed rows of documents, as above. With
  data.packing=concat the rows have no `segment_ids`: a concat row is one
  stream whose only padding (in the split's last row) comes after every real
  token, where causal attention alone hides it, so the model attends with
  `causal` and no mask (see `_causal_rows`).
- `mlm`: the same packed rows, masked BERT-style (`data/masking.py`):
  `inputs` with the selected tokens replaced, `targets` the original tokens,
  `loss_mask` on the selected positions only.
- `seq2seq` (data.task, `data/tasks.py`): one pair per row
  (`data/seq2seq.py`): the prefix-LM fields above for a decoder, or
  src/src_mask/tgt_in/tgt_out/loss_mask for an encoder-decoder.
- `classify` (data.task, `data/classify.py`): one labelled text per row:
  inputs/padding_mask/token_types and a label and weight per row.

Training: the rows of the train split, shuffled with seed data.seed (None:
train.seed, `configs.validation.data_seed`), a different order every epoch,
repeated forever. Global batch g is rows [g * B, (g + 1) * B) of that
stream (B = train.batch_size); process p of P gets its slice of B / P rows,
[g * B + p * B / P, g * B + (p + 1) * B / P).
The iterator is Grain's, so `get_state()` / `set_state()` resume exactly.

A mixture (data.mixture, `data/mixture.py`): each source's train rows,
shuffled and repeated as above, interleaved by weight with Grain's
`MapDataset.mix` before the MLM masks and the batches; each source keeps its
own validation split (`make_source_eval_batches`).
"""
import dataclasses
import functools
import sys

from absl import flags
import grain
from ml_collections import config_dict
import numpy as np

from configs.errors import UserError
from configs.validation import data_seed, mixture_parts
from data import classify
from data import corpora
from data import masking
from data import mixture
from data import packing
from data import seq2seq
from data import sources
from data import tasks
from data import tokens

Batch = dict[str, np.ndarray]

# Rows are cut from memory-mapped arrays: one thread keeps the next batches ready
# while the accelerator runs; data.num_workers adds worker processes.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)


@dataclasses.dataclass(frozen=True)
class SplitStats:
  """Sizes of one split.

  Bits per byte over the split: bpb = mean_loss_nats * num_targets /
  (num_bytes * ln 2), where mean_loss_nats is the mean over loss_mask of a
  full pass (`make_eval_batches(..., num_batches=None)`), or an estimate of it
  from fewer batches.
  """
  num_documents: int
  num_bytes: int  # UTF-8 bytes of the documents' texts
  num_tokens: int  # document tokens, without BOS/EOS
  num_targets: int  # targets with loss_mask 1 over the whole split
  num_rows: int  # packed rows of seq_len + 1 tokens


def split_index(config: config_dict.ConfigDict, tokenizer, split: str,
                share: tokens.Share = tokens.Share(), *, quiet: bool = False
                ) -> packing.PackingIndex:
  """The packing index of `split`: the corpus tokenised (or from the cache), then laid out."""
  entries = tokens.load_corpus(config.data, tokenizer, share, quiet=quiet)
  return packing.load_index(entries, split, config.data.val_percent, config.data.packing,
                            tokens.cache_root(config.data))


def make_packer(tokenizer, index: packing.PackingIndex, seq_len: int) -> packing.RowPacker:
  """The rows of a split's index, per train.seq_len."""
  return packing.RowPacker(index, seq_len, bos_id=tokenizer.bos_id,
                           eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)


def split_stats(config: config_dict.ConfigDict, tokenizer, split: str) -> SplitStats:
  """Documents, bytes, tokens, targets and rows of `split`."""
  index = split_index(config, tokenizer, split, quiet=True)
  packer = make_packer(tokenizer, index, config.train.seq_len)
  return SplitStats(num_documents=index.num_documents, num_bytes=index.num_bytes,
                    num_tokens=index.num_tokens, num_targets=packer.num_targets,
                    num_rows=packer.num_rows)


def tokenizer_texts(data_config: config_dict.ConfigDict, max_bytes: int):
  """The texts a run's tokenizer trains on: the task's train pairs, or a
  sample of at most about `max_bytes` of the train documents (`sample_texts`)."""
  if data_config.task in classify.TASKS:
    return classify.tokenizer_texts(data_config)
  if data_config.task != "none":
    return tasks.tokenizer_texts(data_config)
  parts = mixture_parts(data_config)
  if parts:
    return _mixture_texts(data_config, parts, max_bytes)
  return sample_texts(data_config, max_bytes)


def _mixture_texts(data_config: config_dict.ConfigDict, parts, max_bytes: int):
  """A mixture's sample: each source's (`sample_texts`), of at most its weight's
  share of `max_bytes`."""
  total = sum(part.weight for part in parts)
  for part in parts:
    with mixture.named(part.name):
      yield from sample_texts(mixture.alone(data_config, part),
                              int(max_bytes * part.weight / total), f" of {part.name}")


def sample_texts(data_config: config_dict.ConfigDict, max_bytes: int, what: str = ""):
  """The train documents' texts, streamed: all of them when the source's files
  hold at most `max_bytes`, else from each shard its first documents up to its
  share of `max_bytes` (in proportion to its size), so that the sample spans
  the corpus and never holds more than one document at a time. Prints how
  many bytes of text it gave (`what`: of which source)."""
  shards = sources.plan_shards(data_config)
  total = sum(shard.size for shard in shards)
  given = 0
  for shard in shards:
    quota = float("inf") if total <= max_bytes else max_bytes * shard.size / total
    taken = 0
    for name, text in sources.shard_documents(shard):
      if taken >= quota:
        break
      if not corpora.is_validation(name, data_config.val_percent):
        size = len(text.encode("utf-8"))
        taken += size
        yield text
    given += taken
  print(f"tokenizer: learning from {given / 1e6:.1f} MB of train text{what} (of "
        f"{total / 1e6:.1f} MB of input files; tokenizer.train_bytes={max_bytes})",
        file=sys.stderr, flush=True)


# Rows of each split this process has laid out, by `_rows_key`: the start-up
# summary (`split_rows`) reads the counts the data iterators already made
# instead of loading and laying out every split again (about a second).
_COUNTED: dict[tuple, int] = {}


def _rows_key(config: config_dict.ConfigDict, tokenizer, split: str) -> tuple:
  return (config.data.to_json(), config.train.seq_len, config.train.objective,
          tokenizer.fingerprint, split)


def rows_of_split(config: config_dict.ConfigDict, tokenizer, split: str,
                  share: tokens.Share = tokens.Share(), *, quiet: bool = False):
  """(number of rows, row index -> row) of `split` for the objective and data.task."""
  num_rows, row_fn = _rows_of_split(config, tokenizer, split, share, quiet=quiet)
  _COUNTED[_rows_key(config, tokenizer, split)] = num_rows
  return num_rows, row_fn


def _rows_of_split(config: config_dict.ConfigDict, tokenizer, split: str,
                   share: tokens.Share, *, quiet: bool):
  if config.train.objective == "seq2seq":
    rows = seq2seq.load_rows(config, tokenizer, split)
    return rows.num_pairs, rows
  if config.train.objective == "classify":
    rows = classify.load_rows(config, tokenizer, split)
    return rows.num_examples, rows
  index = split_index(config, tokenizer, split, share, quiet=quiet)
  packer = make_packer(tokenizer, index, config.train.seq_len)
  if split == "train" and packer.stream_length < config.train.seq_len + 1:
    raise UserError(
        f"the train split of data.source={config.data.source} has {packer.stream_length} "
        f"tokens (with BOS/EOS), fewer than one row of train.seq_len + 1 = "
        f"{config.train.seq_len + 1}; add documents or lower train.seq_len")
  if split == "validation" and packer.num_targets == 0:
    raise UserError(
        f"the validation split of data.source={config.data.source} is empty: "
        f"data.val_percent={config.data.val_percent} holds out none of the documents; "
        "raise data.val_percent or add documents")
  if config.data.packing == "concat" and config.train.objective == "next_token":
    return packer.num_rows, functools.partial(_causal_rows, packer)
  return packer.num_rows, packer


def split_rows(config: config_dict.ConfigDict, tokenizer) -> dict[str, tuple[int, int]]:
  """(train rows, validation rows) of each source by name: data.mixture's
  sources, or the one data.source (the counts the data iterators made, where
  they did)."""
  def count(source_config, split):
    counted = _COUNTED.get(_rows_key(source_config, tokenizer, split))
    return rows_of_split(source_config, tokenizer, split)[0] if counted is None else counted

  def rows(source_config):
    return tuple(count(source_config, split) for split in sources.SPLITS)

  mix = mixture.sources(config)
  if not mix:
    return {config.data.source: rows(config)}
  out = {}
  for source in mix:
    with mixture.named(source.name):
      out[source.name] = rows(source.config)
  return out


def _causal_rows(packer: packing.RowPacker, row: int) -> dict[str, np.ndarray]:
  """A concat row without `segment_ids`: all ones but for trailing padding,
  which a causal decoder never attends from a real token, and whose queries
  carry no loss; leaving them out spares attention a [B, T, S] mask (and
  cuDNN a bias and its gradient)."""
  out = packer(row)
  del out["segment_ids"]
  return out


def _masked(config: config_dict.ConfigDict, tokenizer, ds: grain.MapDataset) -> grain.MapDataset:
  """`mlm`: BERT masking, seeded by (data.seed, element index); else `ds`."""
  if config.train.objective != "mlm":
    return ds
  return ds.random_map(masking.for_tokenizer(config.train.mlm_probability, tokenizer),
                       seed=data_seed(config))


def make_train_iterator(config: config_dict.ConfigDict, tokenizer, *, process_index: int = 0,
                        process_count: int = 1, local_process_count: int = 1
                        ) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of this process's training batches.

  Args:
    config: the full config (sections `data` and `train`).
    tokenizer: the tokenizer contract (`encode_batch`, special ids,
      `fingerprint`).
    process_index: this process, in [0, process_count).
    process_count: processes sharing each global batch of train.batch_size rows.
    local_process_count: those of them on this host (they share its cores
      for tokenisation).

  Returns:
    A Grain iterator of batches of train.batch_size // process_count rows.

  Raises:
    UserError: batch size not divisible by the process count, or a train split
      shorter than one row.
  """
  local_batch_size = _local_batch_size(config, process_index, process_count)
  share = tokens.Share(process_index, process_count, local_process_count)
  ds = (_mixed_rows if config.data.mixture else _endless_rows)(config, tokenizer, share)
  ds = (_masked(config, tokenizer, ds)
        .batch(local_batch_size, drop_remainder=True)  # Exact: the stream is endless.
        [process_index::process_count]
        .to_iter_dataset(_READ_OPTIONS))
  if config.data.num_workers > 0:
    if not flags.FLAGS.is_parsed():
      # Grain 0.2.18's workers read its absl flags and fail when a script has
      # not parsed them (google/grain#1355); their defaults are what we want.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.data.num_workers))
  return iter(ds)


def _endless_rows(config: config_dict.ConfigDict, tokenizer, share: tokens.Share
                  ) -> grain.MapDataset:
  """The train split's rows, shuffled with data.seed, a new order every epoch, forever."""
  num_rows, row_fn = rows_of_split(config, tokenizer, "train", share)
  return (grain.MapDataset.range(num_rows)
          .shuffle(seed=data_seed(config))
          .repeat()
          .map(row_fn))


def _mixed_rows(config: config_dict.ConfigDict, tokenizer, share: tokens.Share
                ) -> grain.MapDataset:
  """data.mixture: each source's `_endless_rows`, interleaved by weight (Grain's
  mix, as `mixture.Draws` counts them)."""
  mix = mixture.sources(config)
  parts = []
  for source in mix:
    with mixture.named(source.name):
      parts.append(_endless_rows(source.config, tokenizer, share))
  return grain.MapDataset.mix(parts, [source.weight for source in mix])


def make_source_eval_batches(config: config_dict.ConfigDict, tokenizer,
                             num_batches: int | None = None, **process) -> dict[str, list[Batch]]:
  """data.mixture: each source's first validation batches (`make_eval_batches`
  of the source alone, `process` its process arguments), by name."""
  out = {}
  for source in mixture.sources(config):
    with mixture.named(source.name):
      out[source.name] = make_eval_batches(source.config, tokenizer, num_batches, **process)
  return out


def make_eval_batches(config: config_dict.ConfigDict, tokenizer, num_batches: int | None = None,
                      *, process_index: int = 0, process_count: int = 1,
                      local_process_count: int = 1) -> list[Batch]:
  """The first validation batches in order; the same list on every call.

  Args:
    config: the full config (sections `data` and `train`).
    tokenizer: the tokenizer contract.
    num_batches: at most this many global batches; None: the whole split.
    process_index: this process, in [0, process_count).
    process_count: processes sharing each global batch, as in training.
    local_process_count: those of them on this host.

  Returns:
    min(num_batches, ceil(rows / train.batch_size)) batches of this process's
    rows; rows past the end of the split are padding (loss_mask 0).

  Raises:
    UserError: the validation split has no documents.
  """
  local_batch_size = _local_batch_size(config, process_index, process_count)
  share = tokens.Share(process_index, process_count, local_process_count)
  num_rows, row_fn = rows_of_split(config, tokenizer, "validation", share, quiet=True)
  batch_size = config.train.batch_size
  available = -(-num_rows // batch_size)
  count = available if num_batches is None else min(num_batches, available)
  ds = (_masked(config, tokenizer, grain.MapDataset.range(count * batch_size).map(row_fn))
        .batch(local_batch_size)
        [process_index::process_count])
  return [ds[i] for i in range(len(ds))]


def _local_batch_size(config: config_dict.ConfigDict, process_index: int,
                      process_count: int) -> int:
  batch_size = config.train.batch_size
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, {process_count})")
  if batch_size % process_count:
    raise UserError(f"train.batch_size={batch_size} is not divisible by the "
                    f"{process_count} processes; use a multiple of {process_count}")
  return batch_size // process_count
