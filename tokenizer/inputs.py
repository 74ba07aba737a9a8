"""The texts Step 1 (tokenization) learns from: embedded corpora or files,
sampled to at most about `max_bytes` so that a corpus larger than memory is
never read whole."""
import os
from collections.abc import Iterator, Sequence

from configs.errors import UserError
from data import corpora

VAL_PERCENT = 5
DEFAULT_MAX_BYTES = 100_000_000


def embedded_texts(split_name: str = "train",
                   val_percent: int = VAL_PERCENT) -> list[str]:
  """The `stdlib` + `pydoc` documents of one split (train or validation)."""
  docs = corpora.split(corpora.embedded_documents("embedded"), split_name,
                       val_percent)
  return [text for _, text in docs]


class TextFileSample:
  """The texts of `paths`, each strictly UTF-8 (UserError otherwise), streamed.

  When the files hold more than `max_bytes`, each gives its first bytes up to
  its share of `max_bytes` (in proportion to its size, cut at a character
  boundary), so the sample spans every file. `bytes_read` counts what was
  read so far; `total_bytes` is the files' size.
  """

  def __init__(self, paths: Sequence[str | os.PathLike], max_bytes: int = DEFAULT_MAX_BYTES):
    self.paths = list(paths)
    self.max_bytes = max_bytes
    self.bytes_read = 0
    sizes = []
    for path in self.paths:
      try:
        sizes.append(os.stat(path).st_size)
      except FileNotFoundError:
        raise UserError(f"input file not found: {path}") from None
      except OSError as e:
        raise UserError(f"cannot read input file {path}: {e.strerror}") from None
    self.sizes = sizes
    self.total_bytes = sum(sizes)

  def __iter__(self) -> Iterator[str]:
    for path, size in zip(self.paths, self.sizes):
      quota = size if self.total_bytes <= self.max_bytes else int(
          self.max_bytes * size / self.total_bytes)
      try:
        with open(path, "rb") as f:
          data = f.read(quota)
      except OSError as e:
        raise UserError(f"cannot read input file {path}: {e.strerror}") from None
      self.bytes_read += len(data)
      yield _decode(data, path, cut=quota < size)


def _decode(data: bytes, path, cut: bool) -> str:
  """`data` as UTF-8; a file read only in part may end inside a character."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    if cut and e.reason == "unexpected end of data" and e.start >= len(data) - 3:
      return data[:e.start].decode("utf-8")
    raise UserError(f"input file {path} is not UTF-8 text: byte "
                    f"0x{data[e.start]:02x} at offset {e.start} is invalid "
                    f"({e.reason})") from None
