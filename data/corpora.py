"""The embedded corpora that every Python install carries.

`stdlib`: the source of the Python standard library (about 12.6 MB of code;
the `test`/`tests` packages and site-packages left out). `pydoc`: the text
of the Python documentation topics (`pydoc_data.topics`, about 0.5 MB of
English). Each is a list of documents (one per file or topic), split into
train and validation deterministically by document name, so the split is the
same on every machine with the same Python.
"""
import hashlib
import pathlib
import sysconfig

_EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages"})


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[str]:
  """The relative path of every standard-library .py file, sorted."""
  root = stdlib_root()
  rels = (path.relative_to(root) for path in sorted(root.rglob("*.py")))
  return [rel.as_posix() for rel in rels if not _EXCLUDED_DIRS.intersection(rel.parts)]


def stdlib_documents() -> list[tuple[str, str]]:
  """(relative path, source) for every standard-library .py file, sorted."""
  return list(stdlib_texts(stdlib_files()))


def stdlib_texts(rels):
  """(relative path, source) of the given standard-library files, one at a time."""
  root = stdlib_root()
  for rel in rels:
    yield rel, (root / rel).read_text(encoding="utf-8", errors="replace")


def pydoc_documents() -> list[tuple[str, str]]:
  """(topic name, text) for every entry of pydoc_data.topics, sorted."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return sorted(topics.topics.items())


def bucket(name: str) -> int:
  """The document's split bucket in [0, 100): md5(name) mod 100."""
  digest = hashlib.md5(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:4], "little") % 100


def is_validation(name: str, val_percent: int) -> bool:
  """Deterministic split by document name: bucket(name) < val_percent."""
  return bucket(name) < val_percent


def split(docs: list[tuple[str, str]], split_name: str,
          val_percent: int) -> list[tuple[str, str]]:
  """The `train` or `validation` part of `docs`."""
  want_val = split_name == "validation"
  return [d for d in docs if is_validation(d[0], val_percent) == want_val]


def embedded_documents(source: str) -> list[tuple[str, str]]:
  """`stdlib`, `pydoc` or `embedded` (both)."""
  if source == "stdlib":
    return stdlib_documents()
  if source == "pydoc":
    return pydoc_documents()
  if source == "embedded":
    return stdlib_documents() + pydoc_documents()
  raise ValueError(f"not an embedded corpus: {source!r}")

