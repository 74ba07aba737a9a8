"""The texts Step 1 (tokenization) learns from: embedded corpora or files."""
import pathlib
from collections.abc import Sequence

from configs.errors import UserError
from data import corpora

VAL_PERCENT = 5


def embedded_texts(split_name: str = "train",
                   val_percent: int = VAL_PERCENT) -> list[str]:
  """The `stdlib` + `pydoc` documents of one split (train or validation)."""
  docs = corpora.split(corpora.embedded_documents("embedded"), split_name,
                       val_percent)
  return [text for _, text in docs]


def read_text_files(paths: Sequence[str | pathlib.Path]) -> list[str]:
  """The contents of `paths`, each strictly UTF-8 (UserError otherwise)."""
  texts = []
  for path in paths:
    try:
      data = pathlib.Path(path).read_bytes()
    except FileNotFoundError:
      raise UserError(f"input file not found: {path}") from None
    except OSError as e:
      raise UserError(f"cannot read input file {path}: {e.strerror}") from None
    try:
      texts.append(data.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise UserError(f"input file {path} is not UTF-8 text: byte "
                      f"0x{data[e.start]:02x} at offset {e.start} is invalid "
                      f"({e.reason})") from None
  return texts
