"""Documents, as (name, text) pairs, streamed one at a time from the shards
of every `data.source`.

`stdlib`, `pydoc`, `embedded`: the corpora of `data/corpora.py`.
`files`: each file matched by `data.paths` is one document, named by its path.
`jsonl`: each non-blank line is one JSON object, one document whose text is
  the field `data.jsonl_field`; named `path:line`.
`arrayrecord`: each record is one document: UTF-8 text, or a JSON object whose
  field `data.jsonl_field` holds the text; named `path:index`.
`parquet`: each row is one document, the string column `data.parquet_column`
  (as the `datasets` library and public corpora ship text); named `path:row`.
  Only that column is read, one row group at a time; null values are dropped.

A shard (`Shard`) is the unit of the token cache (`data/tokens.py`) and of
the work shared among tokenisation workers and processes: one input file, a
fixed slice of a large Parquet file (whole row groups) or ArrayRecord file
(a range of records), or a fixed group of the embedded corpus's files. Its
`identity` (sizes and modification times, from `os.stat`) is what the cache
compares; planning the shards opens no file but the footers of large
Parquet files and the indexes of large ArrayRecord files.

Documents whose text is empty or only whitespace are dropped. Every document
falls in `train` or `validation` by its name alone (`corpora.is_validation`
with `data.val_percent`), so the split does not depend on the order of files
or on the machine, and one pass over the corpus serves both splits.
"""
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator

from ml_collections import config_dict
import pyarrow as pa
import pyarrow.parquet as pq

from configs.errors import UserError
from data import corpora

SPLITS = ("train", "validation")
EMBEDDED_SOURCES = ("stdlib", "pydoc", "embedded")
FILE_SOURCES = ("files", "jsonl", "arrayrecord", "parquet")
SLICE_BYTES = 64 << 20  # Parquet/ArrayRecord files larger than this are cut into slices of about it
STDLIB_FILES_PER_SHARD = 256

Document = tuple[str, str]  # (name, text)


@dataclasses.dataclass(frozen=True)
class Shard:
  """One unit of a source: a file, a slice [start, stop) of one, or an embedded group.

  `start`/`stop`: Parquet row groups or ArrayRecord records (-1: to the end);
  `first_row`: the row number of the slice's first row (names are `path:row`).
  `members`: the files of an embedded `stdlib` group (relative paths).
  """
  source: str  # files | jsonl | arrayrecord | parquet | stdlib | pydoc
  path: str
  field: str = ""  # data.jsonl_field or data.parquet_column
  start: int = 0
  stop: int = -1
  first_row: int = 0
  members: tuple[str, ...] = ()
  size: int = 0  # input bytes, for sharing out the work and for progress
  identity: str = ""  # sizes and modification times of the input files

  @property
  def name(self) -> str:
    """The shard as messages name it: the path, with the slice when there is one."""
    if self.members:
      return f"{self.path}[{self.members[0]} .. {self.members[-1]}]"
    if self.stop >= 0:
      unit = "row groups" if self.source == "parquet" else "records"
      return f"{self.path}[{unit} {self.start}:{self.stop}]"
    return self.path


def plan_shards(data_config: config_dict.ConfigDict) -> list[Shard]:
  """The shards of the source, in document order.

  Raises:
    UserError: an unknown source, a path that matches nothing, a Parquet or
      ArrayRecord file that cannot be opened.
  """
  if data_config.get("mixture"):
    raise ValueError("a data.mixture is read source by source (data/mixture.py), not as one")
  source = data_config.source
  if source in EMBEDDED_SOURCES:
    return embedded_shards(source)
  if source not in FILE_SOURCES:
    choices = ", ".join(EMBEDDED_SOURCES + FILE_SOURCES)
    raise UserError(f"data.source={source!r}: must be one of {choices}")
  field = data_config.parquet_column if source == "parquet" else data_config.jsonl_field
  shards = []
  for path in expand_paths(data_config.paths, source):
    shards.extend(_file_shards(source, path, field))
  return shards


def _file_shards(source: str, path: str, field: str) -> list[Shard]:
  stat = os.stat(path)
  whole = Shard(source, path, field, size=stat.st_size, identity=file_identity(path))
  if stat.st_size <= SLICE_BYTES or source not in ("parquet", "arrayrecord"):
    return [whole]
  shards = []
  if source == "parquet":
    meta = _open_parquet(path).metadata
    start, first_row, rows, size = 0, 0, 0, 0
    for group in range(meta.num_row_groups):
      rows += meta.row_group(group).num_rows
      size += meta.row_group(group).total_byte_size
      if size >= SLICE_BYTES or group == meta.num_row_groups - 1:
        shards.append(dataclasses.replace(whole, start=start, stop=group + 1,
                                          first_row=first_row, size=size))
        start, first_row, size = group + 1, first_row + rows, 0
        rows = 0
    return shards
  num_records = _arrayrecord_count(path)
  per_slice = max(1, num_records * SLICE_BYTES // stat.st_size)
  for start in range(0, num_records, per_slice):
    stop = min(start + per_slice, num_records)
    shards.append(dataclasses.replace(whole, start=start, stop=stop, first_row=start,
                                      size=stat.st_size * (stop - start) // num_records))
  return shards


def file_identity(path: str) -> str:
  """What the cache compares to detect an edited file: its size and mtime."""
  stat = os.stat(path)
  return f"{stat.st_size}:{stat.st_mtime_ns}"


def embedded_shards(source: str) -> list[Shard]:
  """`stdlib` in groups of STDLIB_FILES_PER_SHARD files (sorted), `pydoc` as one shard."""
  shards = []
  if source in ("stdlib", "embedded"):
    files = corpora.stdlib_files()
    for start in range(0, len(files), STDLIB_FILES_PER_SHARD):
      shards.append(Shard("stdlib", str(corpora.stdlib_root()),
                          members=tuple(files[start:start + STDLIB_FILES_PER_SHARD])))
  if source in ("pydoc", "embedded"):
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel
    shards.append(Shard("pydoc", topics.__file__))
  sizes = [sum(p.stat().st_size for p in _embedded_files(shard)) for shard in shards]
  return [dataclasses.replace(shard, size=size, identity=_embedded_identity(shard))
          for shard, size in zip(shards, sizes)]


def _embedded_files(shard: Shard) -> list[pathlib.Path]:
  root = pathlib.Path(shard.path)
  return [root / member for member in shard.members] or [root]


def _embedded_identity(shard: Shard) -> str:
  """Python's version and the size and mtime of every file of an embedded shard."""
  h = hashlib.sha256(sys.version.encode())
  for path in _embedded_files(shard):
    stat = path.stat()
    h.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
  return h.hexdigest()[:24]


def current_identity(shard: Shard) -> str:
  """The shard's identity now (a UserError naming the file if it vanished)."""
  try:
    if shard.source in EMBEDDED_SOURCES:
      return _embedded_identity(shard)
    return file_identity(shard.path)
  except FileNotFoundError as e:
    raise UserError(f"{e.filename}: the file vanished while the corpus was read; restore "
                    "it or leave it out of data.paths") from None


def shard_documents(shard: Shard) -> Iterator[Document]:
  """The non-empty documents of one shard, in order, one at a time."""
  if shard.source == "stdlib":
    docs = corpora.stdlib_texts(shard.members)
  elif shard.source == "pydoc":
    docs = iter(corpora.pydoc_documents())
  else:
    reader = {"files": _text_documents, "jsonl": _jsonl_documents,
              "arrayrecord": _arrayrecord_documents, "parquet": _parquet_documents}[shard.source]
    docs = reader(shard)
  return ((name, text) for name, text in docs if text.strip())


def iter_documents(data_config: config_dict.ConfigDict,
                   split: str | None = None) -> Iterator[Document]:
  """Every non-empty document of the source, or those of `split`, streamed.

  Raises:
    UserError: as `plan_shards`, a file that is not UTF-8, a bad JSONL line
      or record, a Parquet file with no string column data.parquet_column, or
      no non-empty document at all.
  """
  if split is not None and split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  any_document = False
  for shard in plan_shards(data_config):
    for name, text in shard_documents(shard):
      any_document = True
      if split is None or corpora.is_validation(name, data_config.val_percent) == (
          split == "validation"):
        yield name, text
  if not any_document:
    raise no_documents(data_config)


def no_documents(data_config: config_dict.ConfigDict) -> UserError:
  return UserError(f"data.source={data_config.source} data.paths={data_config.paths!r}: no "
                   "non-empty documents; point data.paths at files that hold text")


def expand_paths(paths: str, source: str) -> list[str]:
  """The files named by comma-separated paths or globs, in order, no repeats."""
  patterns = [p.strip() for p in paths.split(",") if p.strip()]
  if not patterns:
    raise UserError(f"data.paths is empty: data.source={source} needs files or "
                    "globs, e.g. --config.data.paths='corpus/*.txt'")
  files = []
  seen = set()
  for pattern in patterns:
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    matches = [m for m in matches if os.path.isfile(m)]
    if not matches:
      raise UserError(f"data.paths={paths!r}: no file matches {pattern!r}; check "
                      "the path (a directory needs a glob such as dir/*.txt)")
    for match in matches:
      if match not in seen:
        seen.add(match)
        files.append(match)
  return files


def _decode(data: bytes, where: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{where}: not UTF-8 text (bad byte at offset {e.start}); "
                    "convert it to UTF-8 or leave it out of data.paths") from None


def read_text(path: str) -> str:
  """The UTF-8 text of a file of data.paths (a one-line UserError if it is not)."""
  try:
    with open(path, "rb") as f:
      return _decode(f.read(), path)
  except FileNotFoundError:
    raise UserError(f"{path}: the file vanished while the corpus was read; restore it or "
                    "leave it out of data.paths") from None


def _text_documents(shard: Shard) -> Iterator[Document]:
  yield shard.path, read_text(shard.path)


def _jsonl_documents(shard: Shard) -> Iterator[Document]:
  for line_number, line in enumerate(read_text(shard.path).splitlines(), start=1):
    if line.strip():
      name = f"{shard.path}:{line_number}"
      yield (name, *text_fields(line, name, "line", ((shard.field, "jsonl_field"),)))


def _arrayrecord_reader(path: str):
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  try:
    reader = array_record_module.ArrayRecordReader(path)
    problem = "" if reader.ok() else "its index cannot be read"
  except Exception as e:  # pylint: disable=broad-except
    problem = str(e)
  if problem:
    raise UserError(f"{path}: not an ArrayRecord file ({problem}); re-create it, or use "
                    "data.source=files or jsonl for text")
  return reader


def _arrayrecord_count(path: str) -> int:
  reader = _arrayrecord_reader(path)
  try:
    return reader.num_records()
  finally:
    reader.close()


def _arrayrecord_documents(shard: Shard) -> Iterator[Document]:
  reader = _arrayrecord_reader(shard.path)
  try:
    stop = reader.num_records() if shard.stop < 0 else shard.stop
    for start in range(shard.start, stop, 1024):
      try:
        records = reader.read(list(range(start, min(start + 1024, stop))))
      except Exception as e:  # pylint: disable=broad-except
        raise UserError(f"{shard.path}: ArrayRecord records {start}.. cannot be read ({e}); the "
                        "file is damaged or truncated: re-create it or leave it out") from None
      for index, record in enumerate(records, start=start):
        name = f"{shard.path}:{index}"
        text = _decode(record, f"{shard.path} record {index}")
        if text.lstrip().startswith("{"):
          (text,) = text_fields(text, name, "record", ((shard.field, "jsonl_field"),))
        yield name, text
  finally:
    reader.close()


def _open_parquet(path: str) -> pq.ParquetFile:
  try:
    return pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path}: not a Parquet file ({e}); re-download it, or use "
                    "data.source=files or jsonl for text") from None


def _parquet_documents(shard: Shard) -> Iterator[Document]:
  parquet = _open_parquet(shard.path)
  column = shard.field
  schema = parquet.schema_arrow
  if column not in schema.names:
    raise UserError(f"{shard.path}: no column {column!r} (has {schema.names}); set "
                    "data.parquet_column to the column that holds the text")
  kind = schema.field(column).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
          or pa.types.is_string_view(kind) or pa.types.is_null(kind)):  # null: no value at all
    raise UserError(f"{shard.path}: column {column!r} is {kind}, not text; "
                    "set data.parquet_column to a string column")
  row = shard.first_row
  stop = parquet.num_row_groups if shard.stop < 0 else shard.stop
  for group in range(shard.start, stop):
    try:
      texts = parquet.read_row_group(group, columns=[column]).column(column).to_pylist()
    except (pa.ArrowException, OSError) as e:
      raise UserError(f"{shard.path}: row group {group} cannot be read ({e}); the file is "
                      "damaged or truncated: re-download it or leave it out") from None
    for text in texts:
      if text is not None:
        yield f"{shard.path}:{row}", text
      row += 1


def text_fields(line: str, name: str, what: str,
                fields: tuple[tuple[str, str], ...]) -> list[str]:
  """The string fields of the JSON object `line` (a JSONL line or a record).

  `fields` pairs each field with the config option that names it
  (jsonl_field, src_field, ...), for the one-line error when it is missing.
  """
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise UserError(f"{name}: {what} is not valid JSON ({e.msg}); each {what} "
                    "must be one JSON object") from None
  for field, option in fields:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise UserError(f"{name}: {what} has no string field {field!r} (has {keys}); "
                      f"set data.{option} to the field that holds the text")
  return [record[field] for field, _ in fields]
