"""A corpus larger than the training process may hold: train.py under an
RLIMIT_DATA budget (its heap and private mappings; the token cache is mapped
read-only and does not count) trains on Parquet shards of more text than the
budget. The tokenizer is a Hugging Face byte-level BPE (Rust), so that
tokenising a gigabyte takes a minute or two on 2 cores."""
import json
import os
import resource
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from data import corpora
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
BUDGET = 1 << 30  # RLIMIT_DATA of the training process and its workers
SHARD_TEXT_BYTES = 64 << 20


def write_corpus(directory, text_bytes: int) -> int:
  """Parquet shards of pydoc's topics, each document a different window of
  them; the bytes of text written."""
  base = "\n".join(text for _, text in corpora.pydoc_documents())
  directory.mkdir()
  written, shard, offset = 0, 0, 0
  while written < text_bytes:
    texts, size = [], 0
    while size < SHARD_TEXT_BYTES:
      length = 2000 + offset % 6000
      start = (offset * 7919) % (len(base) - length)
      texts.append(base[start:start + length])
      size += length
      offset += 1
    pq.write_table(pa.table({"text": texts}), directory / f"s{shard:04d}.parquet")
    written += sum(len(t.encode("utf-8")) for t in texts)
    shard += 1
  return written


def hf_tokenizer(directory) -> None:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.train_from_iterator([t for _, t in corpora.pydoc_documents()], trainers.BpeTrainer(
      vocab_size=1000, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  directory.mkdir()
  tok.save(str(directory / "tokenizer.json"))
  eot = "<|endoftext|>"
  (directory / "special_tokens_map.json").write_text(json.dumps(
      {"bos_token": eot, "eos_token": eot, "unk_token": eot}))


def _limit_data():
  resource.setrlimit(resource.RLIMIT_DATA, (BUDGET, BUDGET))


@pytest.mark.timeout(1800)
def test_training_on_a_corpus_larger_than_the_memory_budget(tmp_path):
  text_bytes = write_corpus(tmp_path / "corpus", BUDGET + (64 << 20))
  assert text_bytes > BUDGET
  hf_tokenizer(tmp_path / "tok")
  cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir",
         str(tmp_path / "run"), "--config.data.source=parquet",
         f"--config.data.paths={tmp_path / 'corpus'}/*.parquet",
         f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.tokenize_workers=2",
         f"--config.tokenizer.path={tmp_path / 'tok'}", "--config.train.num_steps=4",
         "--config.train.log_every=1", "--config.train.eval_every=4",
         "--config.train.eval_steps=1", "--config.train.checkpoint_every=4"]
  result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          preexec_fn=_limit_data, capture_output=True, text=True, timeout=1700)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "step 4/4: val1_loss=" in result.stdout
  assert "shards: tokenised " in result.stderr
