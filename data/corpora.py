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


def stdlib_documents() -> list[tuple[str, str]]:
  """(relative path, source) for every standard-library .py file, sorted."""
  root = stdlib_root()
  docs = []
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root)
    if _EXCLUDED_DIRS.intersection(rel.parts):
      continue
    docs.append((rel.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
  return docs


def pydoc_documents() -> list[tuple[str, str]]:
  """(topic name, text) for every entry of pydoc_data.topics, sorted."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return sorted(topics.topics.items())


def is_validation(name: str, val_percent: int) -> bool:
  """Deterministic split by document name: md5(name) mod 100 < val_percent."""
  digest = hashlib.md5(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:4], "little") % 100 < val_percent


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
