"""Tests of the data pipeline: sources, token cache, packing, Grain iterators."""
import errno
import json
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module
import pyarrow as pa
import pyarrow.parquet as pq

from configs import base
from configs.errors import UserError
from data import corpora
from data import packing
from data import pipeline
from data import sources
from data import tokens
from training import evaluate
from tests.helpers import (BOS, EOS, PAD, ROOT, assert_batches_equal, ByteTokenizer, make_config,
                           take, write_files)


FIELDS = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
          "positions": np.int32, "loss_mask": np.float32}


def make_packer(docs, seq_len, mode) -> packing.RowPacker:
  return packing.RowPacker(packing.PackingIndex.of_documents(docs, mode), seq_len,
                           bos_id=BOS, eos_id=EOS, pad_id=PAD)


def packer_rows(docs, seq_len, mode) -> list[dict[str, np.ndarray]]:
  packer = make_packer(docs, seq_len, mode)
  return [packer(r) for r in range(packer.num_rows)]


# Packing.

def test_packed_rows_worked_example():
  # Stream: BOS 5 6 7 EOS BOS 8 EOS; rows of 5 tokens overlapping by one.
  row0, row1 = packer_rows([[5, 6, 7], [8]], 4, "packed")
  np.testing.assert_array_equal(row0["inputs"], [BOS, 5, 6, 7])
  np.testing.assert_array_equal(row0["targets"], [5, 6, 7, EOS])
  np.testing.assert_array_equal(row0["segment_ids"], [1, 1, 1, 1])
  np.testing.assert_array_equal(row0["positions"], [0, 1, 2, 3])
  np.testing.assert_array_equal(row0["loss_mask"], [1, 1, 1, 1])
  np.testing.assert_array_equal(row1["inputs"], [EOS, BOS, 8, PAD])
  np.testing.assert_array_equal(row1["targets"], [BOS, 8, EOS, PAD])
  np.testing.assert_array_equal(row1["segment_ids"], [1, 2, 2, 0])
  np.testing.assert_array_equal(row1["positions"], [0, 0, 1, 0])
  np.testing.assert_array_equal(row1["loss_mask"], [0, 1, 1, 0])


def test_concat_rows_worked_example():
  # Stream: BOS 5 6 7 EOS 8 EOS.
  row0, row1 = packer_rows([[5, 6, 7], [8]], 4, "concat")
  np.testing.assert_array_equal(row0["inputs"], [BOS, 5, 6, 7])
  np.testing.assert_array_equal(row0["targets"], [5, 6, 7, EOS])
  np.testing.assert_array_equal(row1["inputs"], [EOS, 8, PAD, PAD])
  np.testing.assert_array_equal(row1["targets"], [8, EOS, PAD, PAD])
  np.testing.assert_array_equal(row1["segment_ids"], [1, 1, 0, 0])
  np.testing.assert_array_equal(row1["positions"], [0, 1, 0, 0])
  np.testing.assert_array_equal(row1["loss_mask"], [1, 1, 0, 0])


@pytest.mark.parametrize("mode", ["packed", "concat"])
def test_packing_loses_and_repeats_no_token(mode):
  rng = np.random.default_rng(0)
  docs = [list(rng.integers(4, 260, size=n)) for n in (1, 30, 7, 3, 64, 2, 11)]
  seq_len = 8
  rows = packer_rows(docs, seq_len, mode)
  real_targets = np.concatenate([r["targets"][r["loss_mask"] == 1] for r in rows])
  np.testing.assert_array_equal(real_targets, [i for d in docs for i in d + [EOS]])
  for prev, row in zip(rows, rows[1:]):  # Rows overlap by one token.
    assert row["inputs"][0] == prev["targets"][-1]
  for row in rows:
    for key, dtype in FIELDS.items():
      assert row[key].shape == (seq_len,) and row[key].dtype == dtype
    real = row["segment_ids"] > 0
    n = real.sum()
    assert real[:n].all() and not real[n:].any()  # Padding only at the end.
    np.testing.assert_array_equal(row["inputs"][1:n], row["targets"][:n - 1])
    assert (row["inputs"][~real] == PAD).all() and (row["loss_mask"][~real] == 0).all()
    seg, pos = row["segment_ids"][:n], row["positions"][:n]
    if mode == "concat":
      assert (seg == 1).all() and (pos == np.arange(n)).all() and row["loss_mask"][:n].all()
      continue
    assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1}
    new_doc = np.concatenate([[True], np.diff(seg) == 1])
    np.testing.assert_array_equal(pos[new_doc], 0)
    np.testing.assert_array_equal(pos[1:][~new_doc[1:]], pos[:-1][~new_doc[1:]] + 1)
    # No loss across a boundary: exactly the EOS -> next BOS steps are masked.
    crossing = (row["inputs"][:n] == EOS) & (row["targets"][:n] == BOS)
    np.testing.assert_array_equal(row["loss_mask"][:n] == 0, crossing)


def test_rows_past_the_end_are_padding():
  packer = make_packer([[5, 6]], 4, "packed")
  row = packer(packer.num_rows)
  assert (row["inputs"] == PAD).all() and (row["segment_ids"] == 0).all()
  assert (row["loss_mask"] == 0).all()


# Training iterator.

def test_train_batches_format_and_exact_resume(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  tok = ByteTokenizer()
  iterator = pipeline.make_train_iterator(config, tok)
  first = take(iterator, 3)
  for key, dtype in FIELDS.items():
    assert first[0][key].shape == (4, 16) and first[0][key].dtype == dtype
  state = iterator.get_state()
  expected = take(iterator, 5)
  restored = pipeline.make_train_iterator(config, tok)
  restored.set_state(state)
  assert_batches_equal(take(restored, 5), expected)
  again = pipeline.make_train_iterator(config, tok)
  assert_batches_equal(take(again, 3), first)  # Same seed, same order.


def test_process_shards_are_disjoint_and_form_the_global_batch(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  tok = ByteTokenizer()
  global_batches = take(pipeline.make_train_iterator(config, tok), 4)
  shards = [take(pipeline.make_train_iterator(config, tok, process_index=p,
                                              process_count=2), 4) for p in range(2)]
  for step, global_batch in enumerate(global_batches):
    s0, s1 = shards[0][step], shards[1][step]
    assert s0["inputs"].shape == (2, 16)
    assert not {tuple(r) for r in s0["inputs"]} & {tuple(r) for r in s1["inputs"]}
    for key in FIELDS:
      np.testing.assert_array_equal(np.concatenate([s0[key], s1[key]]), global_batch[key])


def test_epochs_cover_every_row_in_a_new_order(tmp_path):
  write_files(tmp_path, {f"d{i}.txt": f"document number {i}" for i in range(6)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"),
                       val_percent=0)
  config.train.batch_size = 1
  config.train.seq_len = 8
  tok = ByteTokenizer()
  packer = pipeline.make_packer(tok, pipeline.split_index(config, tok, "train"),
                                config.train.seq_len)
  all_rows = sorted(tuple(packer(r)["inputs"]) for r in range(packer.num_rows))
  seen = [tuple(b["inputs"][0]) for b in
          take(pipeline.make_train_iterator(config, tok), 2 * packer.num_rows)]
  epoch1, epoch2 = seen[:packer.num_rows], seen[packer.num_rows:]
  assert sorted(epoch1) == all_rows and sorted(epoch2) == all_rows
  assert epoch1 != epoch2


def test_data_seed_unset_is_train_seed_and_set_changes_only_the_order(tmp_path):
  """data.seed None shuffles as train.seed did before the field existed; another
  data.seed gives the same rows in another order; train.seed then no longer
  moves the data."""
  config = make_config(tmp_path, source="pydoc")
  config.train.seed = 3
  tok = ByteTokenizer()
  unset = take(pipeline.make_train_iterator(config, tok), 4)
  config.data.seed = 3
  assert_batches_equal(take(pipeline.make_train_iterator(config, tok), 4), unset)
  config.data.seed = 4
  other = take(pipeline.make_train_iterator(config, tok), 4)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(other, unset))
  config.train.seed = 7
  assert_batches_equal(take(pipeline.make_train_iterator(config, tok), 4), other)
  packer = pipeline.make_packer(tok, pipeline.split_index(config, tok, "train"),
                                config.train.seq_len)
  row_ids = {tuple(packer(r)["inputs"]) for r in range(packer.num_rows)}
  assert all(tuple(row) in row_ids for batch in other for row in batch["inputs"])


def test_worker_processes_give_the_same_batches(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  tok = ByteTokenizer()
  expected = take(pipeline.make_train_iterator(config, tok), 3)
  config.data.num_workers = 1
  iterator = pipeline.make_train_iterator(config, tok)
  try:
    assert_batches_equal(take(iterator, 3), expected)
  finally:
    iterator.close()


def test_train_split_shorter_than_a_row(tmp_path):
  write_files(tmp_path, {"a.txt": "tiny"})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "a.txt"),
                       val_percent=0)
  with pytest.raises(UserError, match="fewer than one row"):
    pipeline.make_train_iterator(config, ByteTokenizer())


def test_batch_size_not_divisible_by_processes(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  with pytest.raises(UserError, match="train.batch_size=4 is not divisible"):
    pipeline.make_train_iterator(config, ByteTokenizer(), process_index=0, process_count=3)


# Validation batches and statistics.

def test_eval_batches_are_deterministic_and_cover_the_split(tmp_path):
  config = make_config(tmp_path, source="pydoc")
  tok = ByteTokenizer()
  batches = pipeline.make_eval_batches(config, tok, 3)
  assert len(batches) == 3 and batches[0]["inputs"].shape == (4, 16)
  assert_batches_equal(pipeline.make_eval_batches(config, tok, 3), batches)
  stats = pipeline.split_stats(config, tok, "validation")
  docs = list(sources.iter_documents(config.data, "validation"))
  assert stats.num_documents == len(docs)
  assert stats.num_bytes == sum(len(t.encode("utf-8")) for _, t in docs)
  full_pass = pipeline.make_eval_batches(config, tok)
  assert len(full_pass) == -(-stats.num_rows // 4)
  assert sum(b["loss_mask"].sum() for b in full_pass) == stats.num_targets


def test_small_validation_split_is_padded(tmp_path):
  # Document names are paths under tmp_path, so the split varies by run: pick
  # names so that exactly one document falls in the validation split.
  names, in_validation, i = [], 0, 0
  while len(names) < 20 or not in_validation:
    name = f"d{i}.txt"
    is_val = corpora.is_validation(str(tmp_path / name), 10)
    if not (is_val and in_validation):
      names.append(name)
      in_validation += is_val
    i += 1
  write_files(tmp_path, {name: f"text {name}" for name in names})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"),
                       val_percent=10)
  tok = ByteTokenizer()
  stats = pipeline.split_stats(config, tok, "validation")
  assert 0 < stats.num_rows < config.train.batch_size
  (batch,) = pipeline.make_eval_batches(config, tok, 5)
  assert batch["inputs"].shape == (4, 16)
  assert batch["loss_mask"].sum() == stats.num_targets
  assert (batch["loss_mask"][stats.num_rows:] == 0).all()


def test_empty_validation_split(tmp_path):
  config = make_config(tmp_path, source="pydoc", val_percent=0)
  with pytest.raises(UserError, match="data.val_percent=0 holds out none"):
    pipeline.make_eval_batches(config, ByteTokenizer(), 1)


# Token cache.

def cache_entries(tmp_path) -> list[str]:
  """The complete entries (directories) of the token cache, no temporary or failure files."""
  directory = tmp_path / "cache" / "tokens"
  if not directory.exists():
    return []
  return sorted(n for n in os.listdir(directory) if (directory / n).is_dir() and ".tmp-" not in n)


def leftovers(tmp_path) -> list[str]:
  """Temporary directories left in the token cache."""
  directory = tmp_path / "cache" / "tokens"
  return [n for n in os.listdir(directory) if ".tmp-" in n] if directory.exists() else []


def corpus_tokens(entries) -> tuple[np.ndarray, np.ndarray]:
  """All tokens and per-document lengths of the entries, in order."""
  toks = [np.asarray(e.array("tokens")) for e in entries]
  lengths = [np.diff(e.array("offsets")) for e in entries]
  return np.concatenate(toks), np.concatenate(lengths)


def test_second_load_comes_from_the_cache(tmp_path, monkeypatch):
  write_files(tmp_path, {f"d{i}.txt": f"document {i} ✓ " * (i + 3) for i in range(3)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  tok = ByteTokenizer()
  first = tokens.load_corpus(config.data, tok)
  assert tok.encode_calls > 0 and len(first) == len(sources.plan_shards(config.data)) > 1
  monkeypatch.setattr(tok, "encode_batch", lambda texts: pytest.fail("re-encoded"))
  second = tokens.load_corpus(config.data, tok)
  for a, b in zip(corpus_tokens(first), corpus_tokens(second)):
    np.testing.assert_array_equal(a, b)
  assert all(e.array("tokens").dtype == np.uint16 for e in second)
  assert isinstance(second[0].array("tokens"), np.memmap)
  with open(os.path.join(second[0].directory, "meta.json"), encoding="utf-8") as f:
    assert json.load(f)["num_tokens"] == first[0].num_tokens
  docs = list(sources.iter_documents(config.data))
  assert sum(e.num_documents for e in second) == len(docs)
  assert sum(sum(e.bytes_per_bucket) for e in second) == sum(len(t.encode()) for _, t in docs)


def test_the_cache_goes_where_data_cache_dir_or_the_environment_says(tmp_path, monkeypatch):
  """data.cache_dir="" puts the entries in $TRANSFORMER_LAB_CACHE (else
  ~/.cache/transformer_lab); a data.cache_dir of its own wins over both."""
  write_files(tmp_path, {"a.txt": "alpha " * 20})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "a.txt"), cache_dir="")
  monkeypatch.delenv(tokens.CACHE_ENV_VAR, raising=False)
  assert tokens.cache_root(config.data) == os.path.expanduser("~/.cache/transformer_lab")
  monkeypatch.setenv(tokens.CACHE_ENV_VAR, str(tmp_path / "machine"))
  (entry,) = tokens.load_corpus(config.data, ByteTokenizer())
  assert os.path.dirname(entry.directory) == str(tmp_path / "machine" / "tokens")
  config.data.cache_dir = str(tmp_path / "own")
  assert tokens.cache_dir(config.data) == str(tmp_path / "own" / "tokens")


def test_other_tokenizer_or_corpus_gets_another_entry(tmp_path):
  write_files(tmp_path, {"a.txt": "alpha " * 20})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "a.txt"),
                       val_percent=0)
  tokens.load_corpus(config.data, ByteTokenizer("bytes-v1"))
  tokens.load_corpus(config.data, ByteTokenizer("bytes-v2"))
  write_files(tmp_path, {"a.txt": "beta " * 20})
  (edited,) = tokens.load_corpus(config.data, ByteTokenizer("bytes-v1"))
  assert ByteTokenizer().decode(edited.array("tokens").tolist()) == "beta " * 20
  assert len(cache_entries(tmp_path)) == 3


def test_an_added_file_is_the_only_one_tokenised(tmp_path):
  write_files(tmp_path, {f"d{i}.txt": f"document {i} " * 9 for i in range(4)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  tok = ByteTokenizer()
  before = tokens.load_corpus(config.data, tok)
  write_files(tmp_path, {"d9.txt": "a new one " * 9})
  encoded = []
  tok.encode_batch = lambda texts: encoded.extend(texts) or [tok.encode(t) for t in texts]
  after = tokens.load_corpus(config.data, tok)
  assert encoded == ["a new one " * 9]
  assert [e.key for e in after[:4]] == [e.key for e in before] and len(after) == 5
  (tmp_path / "d0.txt").unlink()  # a removed file is left out
  assert [e.key for e in tokens.load_corpus(config.data, tok)] == [e.key for e in after[1:]]


def test_verify_cache_finds_a_file_rewritten_with_its_size_and_mtime(tmp_path, capsys):
  write_files(tmp_path, {"a.txt": "alpha " * 20, "b.txt": "bravo " * 20})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  tok = ByteTokenizer()
  tokens.load_corpus(config.data, tok)
  stat = os.stat(tmp_path / "a.txt")
  write_files(tmp_path, {"a.txt": "ALPHA " * 20})
  os.utime(tmp_path / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
  stale = tokens.load_corpus(config.data, tok)  # stat alone cannot tell
  assert tok.decode(stale[0].array("tokens").tolist()).startswith("alpha")
  config.data.verify_cache = True
  capsys.readouterr()
  fresh = tokens.load_corpus(config.data, tok)
  assert tok.decode(fresh[0].array("tokens").tolist()).startswith("ALPHA")
  note = capsys.readouterr().err
  assert "a.txt changed since it was tokenised (same size and mtime); rebuilding it" in note
  assert "b.txt" not in note


def test_two_workers_give_the_entries_of_one(tmp_path):
  write_files(tmp_path, {f"d{i}.txt": f"document {i} ✓ " * (i + 3) for i in range(5)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  one = tokens.load_corpus(config.data, ByteTokenizer())
  config.data.cache_dir = str(tmp_path / "cache2")
  config.data.tokenize_workers = 2
  two = tokens.load_corpus(config.data, ByteTokenizer())
  assert [e.key for e in one] == [e.key for e in two]
  for a, b in zip(corpus_tokens(one), corpus_tokens(two)):
    np.testing.assert_array_equal(a, b)


def test_processes_share_the_shards_and_wait_for_each_other(tmp_path):
  write_files(tmp_path, {f"d{i}.txt": f"document {i} " * (i + 3) for i in range(5)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  shards = sources.plan_shards(config.data)
  owner = tokens.owners(shards, 2)
  assert sorted(set(owner)) == [0, 1]
  config.data.tokenize_wait_s = 0.6
  with pytest.raises(UserError, match=r"d\d.txt: not in the token cache .* after 0.6 s; "
                     r"process 1 owed it \(see its log\), or raise data.tokenize_wait_s"):
    tokens.load_corpus(config.data, ByteTokenizer(), tokens.Share(0, 2))
  counts = []
  for p in (1, 0):
    tok = ByteTokenizer()
    encoded = []
    tok.encode_batch = lambda texts, e=encoded, t=tok: e.extend(texts) or [t.encode(x) for x in texts]
    entries = tokens.load_corpus(config.data, tok, tokens.Share(p, 2))
    counts.append(len(encoded))
    assert len(entries) == 5
  assert counts == [owner.count(1), 0]  # process 0 had tokenised its shards above


def test_a_shard_another_process_could_not_tokenise_stops_the_wait(tmp_path):
  write_files(tmp_path, {"a.txt": "fine text " * 5, "b.txt": "more text " * 5})
  (tmp_path / "c.txt").write_bytes(b"caf\xe9 " * 20)
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  owner = tokens.owners(sources.plan_shards(config.data), 2)
  bad = owner[2]
  with pytest.raises(UserError, match="c.txt: not UTF-8"):
    tokens.load_corpus(config.data, ByteTokenizer(), tokens.Share(bad, 2), wait=False)
  with pytest.raises(UserError, match=rf"process {bad} could not tokenise .*c.txt: .*not UTF-8"):
    tokens.load_corpus(config.data, ByteTokenizer(), tokens.Share(1 - bad, 2))


def test_failed_encoding_leaves_no_cache_file(tmp_path, monkeypatch):
  config = make_config(tmp_path, source="pydoc")
  tok = ByteTokenizer()

  def fail(texts):
    raise RuntimeError("tokenizer crashed")

  monkeypatch.setattr(tok, "encode_batch", fail)
  with pytest.raises(RuntimeError, match="tokenizer crashed"):
    tokens.load_corpus(config.data, tok)
  assert not cache_entries(tmp_path) and not leftovers(tmp_path)


def test_a_full_disk_is_one_line_and_leaves_the_rest_intact(tmp_path, monkeypatch):
  write_files(tmp_path, {"a.txt": "alpha " * 20})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  (kept,) = tokens.load_corpus(config.data, ByteTokenizer())
  write_files(tmp_path, {"b.txt": "bravo " * 20})

  def write_half_then_fail(path, array):
    with open(path, "wb") as f:
      f.write(b"\x93NUMPY partial")
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(tokens.np, "save", write_half_then_fail)
  with pytest.raises(UserError, match=r"no space left on the device while writing the tokens "
                     r"of .*b.txt; free space there or set data.cache_dir"):
    tokens.load_corpus(config.data, ByteTokenizer())
  assert cache_entries(tmp_path) == [kept.key] and not leftovers(tmp_path)
  monkeypatch.undo()
  tok = ByteTokenizer()
  assert len(tokens.load_corpus(config.data, tok)) == 2  # a later run writes the entry
  assert tok.encode_calls == 1


def test_an_unwritable_cache_directory_is_one_line(tmp_path):
  (tmp_path / "file").write_text("not a directory")
  config = make_config(tmp_path, source="pydoc")
  config.data.cache_dir = str(tmp_path / "file" / "cache")
  with pytest.raises(UserError, match=r"data.cache_dir=.*file/cache': cannot write the token "
                     r"cache in .* set data.cache_dir to a writable directory"):
    tokens.load_corpus(config.data, ByteTokenizer())


def test_a_file_that_changes_or_vanishes_while_read(tmp_path, monkeypatch):
  write_files(tmp_path, {"a.txt": "alpha " * 20, "b.txt": "bravo " * 20})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"))
  real = sources.current_identity
  monkeypatch.setattr(sources, "current_identity",
                      lambda shard: "edited" if shard.path.endswith("b.txt") else real(shard))
  with pytest.raises(UserError, match=r"b.txt: the file changed while it was tokenised; run "
                     "again once nothing writes to it"):
    tokens.load_corpus(config.data, ByteTokenizer())
  monkeypatch.undo()
  assert len(cache_entries(tmp_path)) == 1 and not leftovers(tmp_path)  # a.txt's entry
  (shard,) = [s for s in sources.plan_shards(config.data) if s.path.endswith("b.txt")]
  (tmp_path / "b.txt").unlink()
  with pytest.raises(UserError, match=r"b.txt: the file vanished while the corpus was read"):
    tokens.tokenise_shard(shard, str(tmp_path / "cache" / "tokens" / "x"), ByteTokenizer())
  assert len(cache_entries(tmp_path)) == 1 and not leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "swap_offsets", "counts"])
def test_damaged_cache_entry_is_rebuilt_with_a_note(tmp_path, capsys, damage):
  config = make_config(tmp_path, source="pydoc")
  (first,) = tokens.load_corpus(config.data, ByteTokenizer())
  directory = pathlib.Path(first.directory)
  token_file = directory / "tokens.npy"
  if damage == "flip_bytes":
    data = bytearray(token_file.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    token_file.write_bytes(bytes(data))
  elif damage == "truncate":
    token_file.write_bytes(token_file.read_bytes()[:1000])
  elif damage == "swap_offsets":  # a well-formed file of other contents
    np.save(directory / "offsets.npy", np.array([0, 3], np.int64))
  else:  # files intact, the recorded counts not theirs
    meta = json.loads((directory / "meta.json").read_text())
    meta["num_tokens"] += 1
    (directory / "meta.json").write_text(json.dumps(meta))
  capsys.readouterr()
  tok = ByteTokenizer()
  (again,) = tokens.load_corpus(config.data, tok)
  note = capsys.readouterr().err.strip().splitlines()[0]
  assert tok.encode_calls > 0
  assert note.startswith(f"note: token cache entry {directory} is damaged (")
  assert note.endswith("; rebuilding it")
  for a, b in zip(corpus_tokens([first]), corpus_tokens([again])):
    np.testing.assert_array_equal(a, b)
  tok = ByteTokenizer()
  tokens.load_corpus(config.data, tok)  # the rebuilt entry is used
  assert tok.encode_calls == 0 and "note:" not in capsys.readouterr().err


# Packing index.

def test_stored_index_gives_the_rows_of_the_documents_in_memory(tmp_path):
  write_files(tmp_path, {f"d{i:02d}.txt": f"text {i} " * (i % 7 + 1) for i in range(40)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"), val_percent=30)
  tok = ByteTokenizer()
  for mode in packing.PACKING_MODES:
    config.data.packing = mode
    for split in sources.SPLITS:
      index = pipeline.split_index(config, tok, split)
      assert isinstance(index.arrays["stream_start"], np.memmap)
      docs = [tok.encode(t) for _, t in sources.iter_documents(config.data, split)]
      assert 0 < len(docs) < 40
      want = make_packer(docs, 8, mode)
      got = pipeline.make_packer(tok, index, 8)
      assert (got.num_rows, got.num_targets) == (want.num_rows, want.num_targets)
      for row in range(got.num_rows + 1):
        for key, value in want(row).items():
          np.testing.assert_array_equal(got(row)[key], value, err_msg=f"{mode} {split} {row}")
      restored = pickle.loads(pickle.dumps(got))
      assert restored.index._arrays is None  # pickled as paths, not arrays
      np.testing.assert_array_equal(restored(3)["inputs"], got(3)["inputs"])


# Sources.

def test_embedded_split_is_deterministic_and_disjoint():
  data_config = base.get_config().data
  for source in ("stdlib", "pydoc"):
    data_config.source = source
    train = [name for name, _ in sources.iter_documents(data_config, "train")]
    validation = [name for name, _ in sources.iter_documents(data_config, "validation")]
    assert train and validation and not set(train) & set(validation)
    assert sorted(train + validation) == sorted(n for n, _ in sources.iter_documents(data_config))
    assert all(corpora.is_validation(n, data_config.val_percent) for n in validation)
  assert [n for n, _ in sources.iter_documents(data_config, "validation")] == validation


def test_files_and_globs(tmp_path):
  write_files(tmp_path, {f"t{i}.txt": f"text {i}\n" for i in range(10)})
  write_files(tmp_path, {"sub/readme.md": "# readme\n", "blank.txt": "  \n"})
  paths = f"{tmp_path}/*.txt, {tmp_path}/**/*.md"
  data_config = make_config(tmp_path, source="files", paths=paths, val_percent=50).data
  docs = list(sources.iter_documents(data_config))
  assert [n for n, _ in docs] == sorted(f"{tmp_path}/t{i}.txt" for i in range(10)) + [
      f"{tmp_path}/sub/readme.md"]  # blank.txt holds no text.
  assert docs[0][1] == "text 0\n"
  validation = list(sources.iter_documents(data_config, "validation"))
  train = list(sources.iter_documents(data_config, "train"))
  assert sorted(train + validation) == sorted(docs)
  assert all(corpora.is_validation(n, 50) for n, _ in validation)


def test_jsonl_field(tmp_path):
  records = [{"body": "first doc", "id": 1}, {"body": "second doc"}]
  lines = [json.dumps(records[0]), "", json.dumps(records[1])]
  (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  data_config = make_config(tmp_path, source="jsonl", paths=str(tmp_path / "d.jsonl"),
                            jsonl_field="body").data
  assert list(sources.iter_documents(data_config)) == [
      (f"{tmp_path}/d.jsonl:1", "first doc"), (f"{tmp_path}/d.jsonl:3", "second doc")]


def test_arrayrecord_text_and_json_records(tmp_path):
  path = str(tmp_path / "d.arrayrecord")
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  writer.write("plain text ✓".encode("utf-8"))
  writer.write(json.dumps({"text": "from json"}).encode("utf-8"))
  writer.close()
  data_config = make_config(tmp_path, source="arrayrecord", paths=path).data
  assert list(sources.iter_documents(data_config)) == [
      (f"{path}:0", "plain text ✓"), (f"{path}:1", "from json")]


def write_parquet(path, columns: dict[str, list], row_group_size: int = 2) -> None:
  pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def test_parquet_column_shards_and_row_groups(tmp_path):
  write_parquet(tmp_path / "train-00000-of-00002.parquet",
                {"id": [0, 1, 2], "body": ["first ✓", None, "third"]})
  write_parquet(tmp_path / "train-00001-of-00002.parquet", {"id": [3], "body": ["fourth"]})
  write_parquet(tmp_path / "train-empty.parquet", {"id": [], "body": []})  # body: null type
  data_config = make_config(tmp_path, source="parquet", paths=str(tmp_path / "train-*.parquet"),
                            parquet_column="body").data
  first, second = (str(tmp_path / f"train-0000{i}-of-00002.parquet") for i in range(2))
  assert list(sources.iter_documents(data_config)) == [
      (f"{first}:0", "first ✓"), (f"{first}:2", "third"), (f"{second}:0", "fourth")]


def test_parquet_training_iterator_resumes(tmp_path):
  texts = [f"document number {i} " * (i % 5 + 1) for i in range(60)]
  write_parquet(tmp_path / "d.parquet", {"text": texts}, row_group_size=16)
  config = make_config(tmp_path, source="parquet", paths=str(tmp_path / "*.parquet"))
  tok = ByteTokenizer()
  it = pipeline.make_train_iterator(config, tok)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  resumed = pipeline.make_train_iterator(config, tok)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in FIELDS:
      np.testing.assert_array_equal(got[key], want[key])


def test_eval_data_flag_reads_parquet_files(tmp_path):
  config = make_config(tmp_path)
  evaluate.apply_data_flag(config, "held/out-*.parquet")
  assert (config.data.source, config.data.paths, config.data.val_percent) == (
      "parquet", "held/out-*.parquet", 100)


@pytest.mark.parametrize("columns,message", [
    ({"body": ["x"]}, r"d.parquet: no column 'text' \(has \['body'\]\); set data.parquet_column"),
    ({"text": [1, 2]}, r"d.parquet: column 'text' is int64, not text; set data.parquet_column"),
])
def test_parquet_bad_column_is_a_user_error(tmp_path, columns, message):
  write_parquet(tmp_path / "d.parquet", columns)
  data_config = make_config(tmp_path, source="parquet", paths=str(tmp_path / "d.parquet")).data
  with pytest.raises(UserError, match=message):
    list(sources.iter_documents(data_config))


@pytest.mark.parametrize("source,files,message", [
    ("files", {}, r"data.paths=.*: no file matches '.*missing\*.txt'"),
    ("files", {"a.txt": " \n", "b.txt": ""}, "no non-empty documents"),
    ("jsonl", {"a.jsonl": '{"text": "ok"}\n{"text": oops}\n'},
     r"a.jsonl:2: line is not valid JSON"),
    ("jsonl", {"a.jsonl": '{"text": "ok"}\n\n{"body": "x"}\n'},
     r"a.jsonl:3: line has no string field 'text' \(has \['body'\]\); set data.jsonl_field"),
    ("arrayrecord", {"a.arrayrecord": "not an array record"}, "a.arrayrecord: not an ArrayRecord"),
    ("parquet", {}, r"data.paths=.*: no file matches '.*missing\*.txt'"),
    ("parquet", {"a.parquet": "not parquet"}, "a.parquet: not a Parquet file"),
])
def test_bad_input_is_a_user_error(tmp_path, source, files, message):
  write_files(tmp_path, files)
  pattern = str(tmp_path / "missing*.txt") if not files else str(tmp_path / "a.*")
  data_config = make_config(tmp_path, source=source, paths=pattern).data
  with pytest.raises(UserError, match=message):
    list(sources.iter_documents(data_config))


def test_non_utf8_file_is_named(tmp_path):
  (tmp_path / "good.txt").write_text("fine", encoding="utf-8")
  (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
  data_config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt")).data
  with pytest.raises(UserError, match=r"latin1.txt: not UTF-8 text \(bad byte at offset 3\)"):
    list(sources.iter_documents(data_config))


def test_empty_paths(tmp_path):
  data_config = make_config(tmp_path, source="jsonl", paths=" ").data
  with pytest.raises(UserError, match="data.paths is empty: data.source=jsonl needs"):
    list(sources.iter_documents(data_config))


def _corrupt_middle(path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 3:len(data) // 3 + 200] = b"\xff" * 200
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("source,damage,message", [
    ("parquet", "truncate", r"b.parquet: not a Parquet file .*; re-download it"),
    ("parquet", "empty", r"b.parquet: not a Parquet file .*; re-download it"),
    ("parquet", "corrupt", r"b.parquet: row group 0 cannot be read .*damaged or truncated"),
    ("arrayrecord", "truncate", r"b.arrayrecord: (not an ArrayRecord file|ArrayRecord records)"),
    ("arrayrecord", "empty", r"b.arrayrecord: not an ArrayRecord file"),
])
def test_a_damaged_shard_is_one_line_and_leaves_the_rest_intact(tmp_path, source, damage,
                                                                message):
  texts = [f"document {i} " * 50 for i in range(40)]
  for name in ("a", "b"):
    path = tmp_path / f"{name}.{source}"
    if source == "parquet":
      write_parquet(path, {"text": texts}, row_group_size=40)
    else:
      writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
      for text in texts:
        writer.write(text.encode())
      writer.close()
  config = make_config(tmp_path, source=source, paths=str(tmp_path / f"a.{source}"))
  (kept,) = tokens.load_corpus(config.data, ByteTokenizer())
  bad = tmp_path / f"b.{source}"
  {"truncate": lambda: bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 2]),
   "empty": lambda: bad.write_bytes(b""), "corrupt": lambda: _corrupt_middle(bad)}[damage]()
  config.data.paths = str(tmp_path / f"*.{source}")
  with pytest.raises(UserError, match=message):
    tokens.load_corpus(config.data, ByteTokenizer())
  assert cache_entries(tmp_path) == [kept.key] and not leftovers(tmp_path)


def test_prepare_fills_the_cache_and_bad_input_exits_2(tmp_path):
  write_files(tmp_path, {"corpus/a.txt": "alpha beta " * 40, "corpus/b.txt": "gamma " * 40})
  tok = tmp_path / "tok"
  from tokenizer import train_tokenizer  # pylint: disable=import-outside-toplevel
  train_tokenizer("bpe", 270, ["alpha beta gamma delta"] * 5).save(tok)
  base_cmd = [sys.executable, "-m", "data.prepare", "--config", "configs/tiny.py",
              "--config.data.source=files", f"--config.data.cache_dir={tmp_path / 'cache'}",
              f"--config.tokenizer.path={tok}", "--config.data.val_percent=50", "--workers", "1"]
  good = subprocess.run(base_cmd + [f"--config.data.paths={tmp_path}/corpus/*.txt"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert good.returncode == 0, good.stderr
  assert "data: 2 shards: tokenised 2 with 1 worker" in good.stderr
  assert "data: train: " in good.stdout and "data: validation: " in good.stdout
  (tmp_path / "corpus" / "c.txt").write_bytes(b"caf\xe9")
  bad = subprocess.run(base_cmd + [f"--config.data.paths={tmp_path}/corpus/*.txt"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith(
      f"error: {tmp_path}/corpus/c.txt: not UTF-8 text (bad byte at offset 3)")
  assert "Traceback" not in bad.stderr and len(cache_entries(tmp_path)) == 2


def test_checksums_are_read_once_per_entry(tmp_path, monkeypatch):
  """A warm start in a new process (here: the in-process memo cleared) trusts
  an entry whose files are as stamped when their CRC-32s last passed; a
  rewritten file or data.verify_cache=True reads them again."""
  config = make_config(tmp_path, source="pydoc")
  (first,) = tokens.load_corpus(config.data, ByteTokenizer())
  reads = []
  real = tokens.file_crc32
  monkeypatch.setattr(tokens, "file_crc32", lambda path: reads.append(path) or real(path))

  def warm_start(**data):
    tokens._VERIFIED.clear()
    reads.clear()
    config.data.update(**data)
    return tokens.load_corpus(config.data, ByteTokenizer())

  warm_start()
  assert len(reads) == 3  # the first start after tokenising reads them, and stamps them
  warm_start()
  assert reads == []
  warm_start(verify_cache=True)
  assert len(reads) == 3
  buckets = pathlib.Path(first.directory) / "buckets.npy"
  buckets.write_bytes(buckets.read_bytes())  # same contents, a new modification time
  warm_start(verify_cache=False)
  assert len(reads) == 3
  warm_start()
  assert reads == []
