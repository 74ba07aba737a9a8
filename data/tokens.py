"""Tokenise a corpus once, shard by shard, and cache it on disk.

One cache entry per shard (`sources.Shard`: an input file, a fixed slice of a
large one, a group of embedded files), in `data.cache_dir` (when empty,
`$TRANSFORMER_LAB_CACHE`, else `~/.cache/transformer_lab`) under
`tokens/<key>/`. The key is a SHA-256 over the format, the tokenizer's
fingerprint, the source kind and field, the path, the slice, and the shard's
identity: the size and mtime of its files. So a warm start stats the input
files and reads no corpus text; an edited file (new size or mtime) gets a new
entry, an added file is the only one tokenised, a removed one is left out.
`data.verify_cache=True` reads every shard again and compares the SHA-256 of
its documents with the one recorded, re-tokenising those that differ (a file
rewritten with its old size and mtime).

An entry is a directory of four files:

  tokens.npy   [num_tokens] uint16 (uint32 when vocab_size > 65536): every
               document's tokens, concatenated, no special tokens
  offsets.npy  [num_documents + 1] int64: document d is tokens[offsets[d]:offsets[d + 1]]
  buckets.npy  [num_documents] uint8: `corpora.bucket` of each document's name;
               document d is in validation when buckets[d] < data.val_percent
  meta.json    the shard, the counts (documents, tokens, UTF-8 bytes per
               bucket), the SHA-256 of its documents and the CRC-32 of each .npy

It is written in a temporary directory renamed into place, so an interrupted
or failed run never leaves a partial entry. An entry whose files do not match
its recorded counts or checksums is rebuilt with a one-line note, never used.
The checksums are read once per entry: `verified.json` records the files'
size, modification time and inode when they passed, and a later start
whose files still have them reads only the counts (a warm start then costs
nothing per token); `data.verify_cache=True` reads every checksum again.
The arrays are opened memory-mapped (`mmap_mode="r"`).

Tokenisation runs in `data.tokenize_workers` processes (spawned: no JAX in
them). In a job of several processes the shards are shared out among them by
size (`owners`), so each is tokenised once in the whole job; a process waits
for the others' shards through the shared file system, at most
`data.tokenize_wait_s`.
"""
import array
import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import zlib

from ml_collections import config_dict
import numpy as np
from tqdm import tqdm

from configs.errors import UserError
from data import corpora
from data import sources

DEFAULT_CACHE_DIR = "~/.cache/transformer_lab"
# Moves the whole cache: the token cache and packing index (when data.cache_dir is
# empty) and the compilation cache (training/compile_cache.py). `make clean-cache` removes it.
CACHE_ENV_VAR = "TRANSFORMER_LAB_CACHE"
FORMAT_VERSION = 2
NUM_BUCKETS = 100
_ENCODE_CHUNK_DOCS = 256  # documents per tokenizer.encode_batch call
_ENCODE_CHUNK_BYTES = 4 << 20  # or fewer, when the documents are large
_ARRAY_FILES = ("tokens.npy", "offsets.npy", "buckets.npy")
_STAMP = "verified.json"  # the files' (size, mtime, inode) when their checksums last passed
_HEADER_BYTES = 128  # the .npy header of tokens.npy, written before its length is known
_POLL_S = 0.5
_CLOCK_SKEW_S = 60.0  # a failure note older than the wait by more than this is stale


@dataclasses.dataclass(frozen=True)
class Entry:
  """A shard's complete cache entry: its directory and counts."""
  directory: str
  num_documents: int
  num_tokens: int
  bytes_per_bucket: tuple[int, ...]  # [NUM_BUCKETS] UTF-8 bytes of the documents of each bucket

  @property
  def key(self) -> str:
    return os.path.basename(self.directory)

  def array(self, name: str) -> np.ndarray:
    """tokens, offsets or buckets, memory-mapped."""
    return np.load(os.path.join(self.directory, f"{name}.npy"), mmap_mode="r")

  def num_bytes(self, split: str, val_percent: int) -> int:
    held_out = sum(self.bytes_per_bucket[:val_percent])
    return held_out if split == "validation" else sum(self.bytes_per_bucket) - held_out


@dataclasses.dataclass(frozen=True)
class Share:
  """This process's part of the job: process `index` of `count`, `local` on its host."""
  index: int = 0
  count: int = 1
  local: int = 1


def default_root() -> str:
  """The cache of this machine: $TRANSFORMER_LAB_CACHE, else ~/.cache/transformer_lab."""
  return os.path.expanduser(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR)


def cache_root(data_config: config_dict.ConfigDict) -> str:
  """The directory of the cache (`tokens/` and the packing `index/` below it):
  data.cache_dir, else `default_root()`."""
  return os.path.expanduser(data_config.cache_dir) if data_config.cache_dir else default_root()


def cache_dir(data_config: config_dict.ConfigDict) -> str:
  """The directory of the token cache entries."""
  return os.path.join(cache_root(data_config), "tokens")


def num_workers(data_config: config_dict.ConfigDict, share: Share) -> int:
  """data.tokenize_workers, or (0) the usable cores of the host shared by its processes."""
  if data_config.tokenize_workers:
    return data_config.tokenize_workers
  return max(1, len(os.sched_getaffinity(0)) // share.local)


def owners(shards: list[sources.Shard], count: int) -> list[int]:
  """The process that tokenises each shard: largest first, to the least loaded."""
  load = [0] * count
  owner = [0] * len(shards)
  for i in sorted(range(len(shards)), key=lambda i: (-shards[i].size, i)):
    p = min(range(count), key=lambda p: (load[p], p))
    owner[i] = p
    load[p] += shards[i].size + 1
  return owner


def shard_key(shard: sources.Shard, tokenizer) -> str:
  parts = (f"v{FORMAT_VERSION}", tokenizer.fingerprint, shard.source, shard.field,
           os.path.abspath(shard.path), f"{shard.start}:{shard.stop}", ",".join(shard.members),
           shard.identity)
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def load_corpus(data_config: config_dict.ConfigDict, tokenizer, share: Share = Share(), *,
                wait: bool = True, quiet: bool = False) -> list[Entry]:
  """Every shard of the `data` section, tokenised: from the cache, else tokenised now.

  Args:
    data_config: the `data` section of the config.
    tokenizer: the tokenizer contract (`encode_batch`, `vocab_size`, `fingerprint`).
    share: this process's part of the job; it tokenises the shards it owns.
    wait: wait for the shards other processes own (False: return what is
      cached, for a data.prepare task that fills only its part).
    quiet: no summary line unless something was tokenised here.

  Returns:
    The cache entries, in document order.

  Raises:
    UserError: bad input (named, with the fix), a cache directory that is not
      writable or a full disk, a shard another process did not deliver in
      data.tokenize_wait_s, or no non-empty document in the whole corpus.
  """
  start = time.perf_counter()
  shards = sources.plan_shards(data_config)
  root = cache_dir(data_config)
  _make_writable_dir(root, data_config)
  stems = [os.path.join(root, shard_key(shard, tokenizer)) for shard in shards]
  owner = owners(shards, share.count)
  entries: list[Entry | None] = [None] * len(shards)
  todo = []
  for i, (shard, stem) in enumerate(zip(shards, stems)):
    if owner[i] != share.index:
      continue
    if os.path.exists(stem + ".failed"):  # an earlier run's: this one tries again
      os.remove(stem + ".failed")
    entry, problem = (read_entry(stem, trust_stamp=not data_config.verify_cache)
                      if os.path.isdir(stem) else (None, ""))
    if problem:
      print(f"note: token cache entry {stem} is damaged ({problem}); rebuilding it",
            file=sys.stderr)
    elif entry is not None and data_config.verify_cache and _changed(shard, stem):
      print(f"note: token cache entry {stem}: {shard.name} changed since it was tokenised "
            "(same size and mtime); rebuilding it", file=sys.stderr)
      entry, problem = None, "changed"
    if problem:
      shutil.rmtree(stem, ignore_errors=True)
    if entry is None:
      todo.append(i)
    entries[i] = entry
  workers = min(num_workers(data_config, share), len(todo)) or 1
  tokenised = _tokenise(shards, stems, todo, tokenizer, workers)
  for i, entry in tokenised.items():
    entries[i] = entry
  waited = 0
  if wait:
    waited = _wait_for_others(shards, stems, owner, entries, data_config.tokenize_wait_s)
  seconds = time.perf_counter() - start
  cached = sum(1 for i in range(len(shards)) if owner[i] == share.index) - len(todo)
  if not quiet or tokenised:
    _summary(share, len(shards), tokenised, cached, waited, workers, seconds)
  if wait and not any(entry.num_documents for entry in entries):
    raise sources.no_documents(data_config)
  return [entry for entry in entries if entry is not None]


def _make_writable_dir(root: str, data_config: config_dict.ConfigDict) -> None:
  try:
    os.makedirs(root, exist_ok=True)
    problem = "" if os.access(root, os.W_OK | os.X_OK) else "permission denied"
  except OSError as e:
    problem = e.strerror or str(e)
  if problem:
    raise UserError(f"data.cache_dir={data_config.cache_dir!r}: cannot write the token cache "
                    f"in {root} ({problem}); set data.cache_dir to a writable directory")


def _summary(share: Share, num_shards: int, tokenised: dict[int, Entry], cached: int,
             waited: int, workers: int, seconds: float) -> None:
  """One line: what this process tokenised, took from the cache, and waited for."""
  docs = sum(e.num_documents for e in tokenised.values())
  megabytes = sum(sum(e.bytes_per_bucket) for e in tokenised.values()) / 1e6
  where = f"process {share.index} of {share.count}: " if share.count > 1 else ""
  work = (f"tokenised {len(tokenised)} with {workers} worker{'s' * (workers > 1)} "
          f"({docs} documents, {megabytes:.1f} MB, {megabytes / max(seconds, 1e-9):.1f} MB/s)"
          if tokenised else "tokenised 0")
  print(f"data: {where}{num_shards} shards: {work}, {cached} from the cache, {waited} from "
        f"other processes, in {seconds:.1f} s", file=sys.stderr, flush=True)


def _tokenise(shards, stems, todo: list[int], tokenizer, workers: int) -> dict[int, Entry]:
  """Tokenises shards `todo` (by index) in `workers` processes; their entries."""
  if not todo:
    return {}
  total = sum(shards[i].size for i in todo)
  done: dict[int, Entry] = {}
  bar = tqdm(total=total, desc="tokenise", unit="B", unit_scale=True, disable=None,
             file=sys.stderr, leave=False)
  try:
    if workers == 1:
      for i in todo:
        done[i] = tokenise_shard(shards[i], stems[i], tokenizer)
        _advance(bar, shards[i], done)
      return done
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker,
        initargs=(pickle.dumps(tokenizer),)) as pool:
      futures = {pool.submit(_worker_tokenise, shards[i], stems[i]): i
                 for i in sorted(todo, key=lambda i: -shards[i].size)}
      try:
        for future in concurrent.futures.as_completed(futures):
          i = futures[future]
          done[i] = future.result()
          _advance(bar, shards[i], done)
      except BaseException:
        for future in futures:
          future.cancel()
        raise
    return done
  finally:
    bar.close()


def _advance(bar, shard: sources.Shard, done: dict[int, Entry]) -> None:
  bar.update(shard.size)
  bar.set_postfix(documents=sum(e.num_documents for e in done.values()), refresh=False)


_WORKER_TOKENIZER = None


def _init_worker(tokenizer_bytes: bytes) -> None:
  """A tokenisation worker: one thread for the tokenizer (the workers are the parallelism)."""
  global _WORKER_TOKENIZER  # pylint: disable=global-statement
  os.environ["RAYON_NUM_THREADS"] = "1"
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  _WORKER_TOKENIZER = pickle.loads(tokenizer_bytes)


def _worker_tokenise(shard: sources.Shard, stem: str) -> Entry:
  return tokenise_shard(shard, stem, _WORKER_TOKENIZER)


def tokenise_shard(shard: sources.Shard, stem: str, tokenizer) -> Entry:
  """Tokenises one shard into the cache entry `stem` (atomically); its entry.

  Raises:
    UserError: bad input, the file changed while it was read, a full disk or a
      cache that cannot be written; nothing is left behind.
  """
  root = os.path.dirname(stem)
  failed = stem + ".failed"
  try:
    if os.path.exists(failed):
      os.remove(failed)
    tmp = tempfile.mkdtemp(dir=root, prefix=os.path.basename(stem) + ".tmp-")
  except OSError as e:
    raise _write_error(e, root, shard) from None
  try:
    meta = _write_entry(shard, tmp, tokenizer)
    try:
      os.rename(tmp, stem)
    except OSError as e:
      if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
        raise
      # Another process wrote the same entry first: keep that one.
    return _entry(stem, meta)
  except UserError as e:
    _record_failure(failed, str(e))
    raise
  except OSError as e:
    error = _write_error(e, root, shard)
    _record_failure(failed, str(error))
    raise error from None
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _record_failure(path: str, message: str) -> None:
  """So that processes waiting for the shard stop with its error at once."""
  try:
    with open(path, "w", encoding="utf-8") as f:
      f.write(message)
  except OSError:
    pass


def _write_error(e: OSError, root: str, shard: sources.Shard) -> UserError:
  if e.errno in (errno.ENOSPC, errno.EDQUOT):
    return UserError(f"{root}: no space left on the device while writing the tokens of "
                     f"{shard.name}; free space there or set data.cache_dir to a larger disk")
  if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
    return UserError(f"{root}: cannot write the token cache ({e.strerror}); set "
                     "data.cache_dir to a writable directory")
  return UserError(f"{root}: writing the tokens of {shard.name} failed ({e.strerror or e}); "
                   "check the disk of data.cache_dir")


def _npy_header(dtype: np.dtype, length: int) -> bytes:
  """A .npy (1.0) header of exactly _HEADER_BYTES bytes for a [length] array."""
  text = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
               "shape": (length,)})
  body = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
  return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


def _write_entry(shard: sources.Shard, directory: str, tokenizer) -> dict:
  """Streams the shard's documents through the tokenizer into `directory`; the meta."""
  dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
  offsets = array.array("q", [0])
  buckets = bytearray()
  bytes_per_bucket = [0] * NUM_BUCKETS
  digest = hashlib.sha256()
  token_path = os.path.join(directory, "tokens.npy")
  with open(token_path, "wb") as f:
    f.write(_npy_header(dtype, 0))
    texts: list[str] = []
    chunk_bytes = 0

    def flush():
      for ids in tokenizer.encode_batch(texts):
        f.write(np.asarray(ids, dtype).tobytes())
        offsets.append(offsets[-1] + len(ids))
      texts.clear()

    for name, text in sources.shard_documents(shard):
      size = len(text.encode("utf-8"))
      b = corpora.bucket(name)
      buckets.append(b)
      bytes_per_bucket[b] += size
      digest.update(f"{len(name)}:{name}{size}:".encode())
      digest.update(text.encode("utf-8"))
      texts.append(text)
      chunk_bytes += size
      if len(texts) >= _ENCODE_CHUNK_DOCS or chunk_bytes >= _ENCODE_CHUNK_BYTES:
        flush()
        chunk_bytes = 0
    if texts:
      flush()
    f.seek(0)
    f.write(_npy_header(dtype, offsets[-1]))
  if sources.current_identity(shard) != shard.identity:
    raise UserError(f"{shard.path}: the file changed while it was tokenised; run again "
                    "once nothing writes to it")
  np.save(os.path.join(directory, "offsets.npy"), np.frombuffer(offsets, np.int64))
  np.save(os.path.join(directory, "buckets.npy"), np.frombuffer(bytes(buckets), np.uint8))
  meta = {"format": FORMAT_VERSION, "shard": dataclasses.asdict(shard),
          "tokenizer": tokenizer.fingerprint, "num_documents": len(buckets),
          "num_tokens": offsets[-1], "bytes_per_bucket": bytes_per_bucket,
          "sha256": digest.hexdigest(),
          "crc32": {name: file_crc32(os.path.join(directory, name)) for name in _ARRAY_FILES}}
  with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  return meta


def _entry(stem: str, meta: dict) -> Entry:
  return Entry(directory=stem, num_documents=meta["num_documents"],
               num_tokens=meta["num_tokens"], bytes_per_bucket=tuple(meta["bytes_per_bucket"]))


_VERIFIED: dict[str, tuple] = {}  # stem -> (stat of its files, entry): checked in this process


def _stat_signature(stem: str) -> tuple:
  return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in
               (os.stat(os.path.join(stem, n)) for n in _ARRAY_FILES + ("meta.json",)))


def _stamped_signature(stem: str) -> tuple | None:
  """The files' signature when their checksums were last found right (`_STAMP`)."""
  try:
    with open(os.path.join(stem, _STAMP), encoding="utf-8") as f:
      return tuple(tuple(s) for s in json.load(f))
  except (OSError, ValueError, TypeError):
    return None


def _stamp(stem: str, signature: tuple) -> None:
  """Records that the files of `signature` passed their checksums; best effort."""
  tmp = os.path.join(stem, f"{_STAMP}.{os.getpid()}")
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(signature, f)
    os.replace(tmp, os.path.join(stem, _STAMP))
  except OSError:
    pass


def read_entry(stem: str, *, trust_stamp: bool = True) -> tuple[Entry | None, str]:
  """(the cached entry, "") when its files match the recorded counts and
  checksums, else (None, what does not match). The checksums are read once:
  files whose size, modification time and inode are those stamped when they
  last passed are trusted (`trust_stamp=False`, data.verify_cache, reads
  them all again), so a warm start does not read the whole cache."""
  try:
    signature = _stat_signature(stem)
    if stem in _VERIFIED and _VERIFIED[stem][0] == signature:
      return _VERIFIED[stem][1], ""
    with open(os.path.join(stem, "meta.json"), encoding="utf-8") as f:
      meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
      return None, "written by another version of the cache"
    checked = trust_stamp and _stamped_signature(stem) == signature
    if not checked:
      for name in _ARRAY_FILES:
        if meta["crc32"].get(name) != file_crc32(os.path.join(stem, name)):
          return None, f"{name} does not match its recorded checksum"
    entry = _entry(stem, meta)
    tokens, offsets, buckets = (entry.array(n) for n in ("tokens", "offsets", "buckets"))
    counts = (len(tokens), len(offsets), int(offsets[-1]), len(buckets))
  except (OSError, ValueError, KeyError, IndexError) as e:
    return None, f"{type(e).__name__}: {e}"
  if counts != (entry.num_tokens, entry.num_documents + 1, entry.num_tokens,
                entry.num_documents):
    return None, "its files do not match the recorded document and token counts"
  if not checked:
    _stamp(stem, signature)
  _VERIFIED[stem] = (signature, entry)
  return entry, ""


def _changed(shard: sources.Shard, stem: str) -> bool:
  """data.verify_cache: whether the shard's documents no longer hash to the entry's record."""
  digest = hashlib.sha256()
  for name, text in sources.shard_documents(shard):
    data = text.encode("utf-8")
    digest.update(f"{len(name)}:{name}{len(data)}:".encode())
    digest.update(data)
  with open(os.path.join(stem, "meta.json"), encoding="utf-8") as f:
    recorded = json.load(f)["sha256"]
  return digest.hexdigest() != recorded


def _wait_for_others(shards, stems, owner: list[int], entries: list[Entry | None],
                     wait_s: float) -> int:
  """Fills `entries` with the shards other processes owe; how many there were."""
  missing = [i for i, entry in enumerate(entries) if entry is None]
  waited = len(missing)
  deadline = time.time() + wait_s
  started = time.time()
  while True:
    for i in list(missing):
      if os.path.isdir(stems[i]):
        entry, _ = read_entry(stems[i])
        if entry is not None:
          entries[i] = entry
          missing.remove(i)
          continue
      reason = _failure_since(stems[i] + ".failed", started - _CLOCK_SKEW_S)
      if reason:
        raise UserError(f"process {owner[i]} could not tokenise {shards[i].name}: {reason}")
    if not missing:
      return waited
    if time.time() > deadline:
      i = missing[0]
      raise UserError(f"{shards[i].name}: not in the token cache {os.path.dirname(stems[i])} "
                      f"after {wait_s:g} s; process {owner[i]} owed it (see its log), or "
                      "raise data.tokenize_wait_s")
    time.sleep(_POLL_S)


def _failure_since(path: str, since: float) -> str:
  """The error recorded at `path` if it was written after `since` (not a stale note
  of an earlier run), else ""."""
  try:
    if os.path.getmtime(path) < since:
      return ""
    with open(path, encoding="utf-8") as f:
      return f.read().strip()
  except OSError:
    return ""


def file_crc32(path: str) -> int:
  """CRC-32 of a file's bytes, read in 16 MiB chunks."""
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc
