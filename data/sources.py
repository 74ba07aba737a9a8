"""Documents, as (name, text) pairs, from every `data.source`.

`stdlib`, `pydoc`, `embedded`: the corpora of `data/corpora.py`.
`files`: each file matched by `data.paths` is one document, named by its path.
`jsonl`: each non-blank line is one JSON object, one document whose text is
  the field `data.jsonl_field`; named `path:line`.
`arrayrecord`: each record is one document: UTF-8 text, or a JSON object whose
  field `data.jsonl_field` holds the text; named `path:index`.
`parquet`: each row is one document, the string column `data.parquet_column`
  (as the `datasets` library and public corpora ship text); named `path:row`.
  Only that column is read, one row group at a time; null values are dropped.

Documents whose text is empty or only whitespace are dropped. Every source is
split into `train` and `validation` the same way, deterministically by document
name (`corpora.is_validation` with `data.val_percent`), so the split does not
depend on the order of files or on the machine.
"""
import glob
import json
import os

import grain
from ml_collections import config_dict
import pyarrow as pa
import pyarrow.parquet as pq

from configs.errors import UserError
from data import corpora

SPLITS = ("train", "validation")
EMBEDDED_SOURCES = ("stdlib", "pydoc", "embedded")
FILE_SOURCES = ("files", "jsonl", "arrayrecord", "parquet")

Document = tuple[str, str]  # (name, text)


def load_documents(data_config: config_dict.ConfigDict, split: str) -> list[Document]:
  """The documents of `split` (`train` or `validation`) of the `data` section."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  return corpora.split(all_documents(data_config), split, data_config.val_percent)


def all_documents(data_config: config_dict.ConfigDict) -> list[Document]:
  """Every non-empty document of the source, both splits.

  Raises:
    UserError: an unknown source, a path that matches nothing, a file that is
      not UTF-8, a bad JSONL line or record, a Parquet file that cannot be read
      or has no string column data.parquet_column, or no non-empty document.
  """
  source = data_config.source
  if source in EMBEDDED_SOURCES:
    docs = corpora.embedded_documents(source)
  elif source in FILE_SOURCES:
    reader = {"files": _text_documents, "jsonl": _jsonl_documents,
              "arrayrecord": _arrayrecord_documents, "parquet": _parquet_documents}[source]
    field = data_config.parquet_column if source == "parquet" else data_config.jsonl_field
    docs = []
    for path in expand_paths(data_config.paths, source):
      docs.extend(reader(path, field))
  else:
    choices = ", ".join(EMBEDDED_SOURCES + FILE_SOURCES)
    raise UserError(f"data.source={source!r}: must be one of {choices}")
  docs = [(name, text) for name, text in docs if text.strip()]
  if not docs:
    raise UserError(f"data.source={source} data.paths={data_config.paths!r}: no "
                    "non-empty documents; point data.paths at files that hold text")
  return docs


def expand_paths(paths: str, source: str) -> list[str]:
  """The files named by comma-separated paths or globs, in order, no repeats."""
  patterns = [p.strip() for p in paths.split(",") if p.strip()]
  if not patterns:
    raise UserError(f"data.paths is empty: data.source={source} needs files or "
                    "globs, e.g. --config.data.paths='corpus/*.txt'")
  files = []
  for pattern in patterns:
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    matches = [m for m in matches if os.path.isfile(m)]
    if not matches:
      raise UserError(f"data.paths={paths!r}: no file matches {pattern!r}; check "
                      "the path (a directory needs a glob such as dir/*.txt)")
    files.extend(m for m in matches if m not in files)
  return files


def _decode(data: bytes, where: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{where}: not UTF-8 text (bad byte at offset {e.start}); "
                    "convert it to UTF-8 or leave it out of data.paths") from None


def read_text(path: str) -> str:
  """The UTF-8 text of a file of data.paths (a one-line UserError if it is not)."""
  with open(path, "rb") as f:
    return _decode(f.read(), path)


def _text_documents(path: str, field: str) -> list[Document]:
  del field  # Plain text files have no fields.
  return [(path, read_text(path))]


def _jsonl_documents(path: str, field: str) -> list[Document]:
  docs = []
  for line_number, line in enumerate(read_text(path).splitlines(), start=1):
    if line.strip():
      name = f"{path}:{line_number}"
      docs.append((name, *text_fields(line, name, "line", ((field, "jsonl_field"),))))
  return docs


def _arrayrecord_documents(path: str, field: str) -> list[Document]:
  try:
    records = grain.sources.ArrayRecordDataSource([path])
    num_records = len(records)
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"{path}: not an ArrayRecord file ({e}); use "
                    "data.source=files or jsonl for text") from None
  docs = []
  for index in range(num_records):
    name = f"{path}:{index}"
    text = _decode(records[index], f"{path} record {index}")
    if text.lstrip().startswith("{"):
      (text,) = text_fields(text, name, "record", ((field, "jsonl_field"),))
    docs.append((name, text))
  return docs


def _parquet_documents(path: str, column: str) -> list[Document]:
  try:
    parquet = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path}: not a Parquet file ({e}); use data.source=files or "
                    "jsonl for text") from None
  schema = parquet.schema_arrow
  if column not in schema.names:
    raise UserError(f"{path}: no column {column!r} (has {schema.names}); set "
                    "data.parquet_column to the column that holds the text")
  kind = schema.field(column).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
          or pa.types.is_string_view(kind) or pa.types.is_null(kind)):  # null: no value at all
    raise UserError(f"{path}: column {column!r} is {kind}, not text; "
                    "set data.parquet_column to a string column")
  docs = []
  row = 0
  for group in range(parquet.num_row_groups):
    for text in parquet.read_row_group(group, columns=[column]).column(column).to_pylist():
      if text is not None:
        docs.append((f"{path}:{row}", text))
      row += 1
  return docs


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
