"""Seq2seq tasks as (source, target) string pairs, split into train and validation.

The lesson picks the encoder-decoder "where input and output are clearly
separate"; a decoder-only model reads the same pairs as one sequence (prefix
LM, `data/seq2seq.py`). `data.task` selects the pairs:

- `reverse`: a random lowercase string -> the string reversed.
- `sort`: a random string of digits -> its digits in ascending order.
- `addition`: a and b of task_min_len..task_max_len digits, written as
  data.task_addition_format says:
  `plain`: "a+b" -> the sum, "12+5" -> "17";
  `aligned`: both numbers zero-padded to task_max_len digits, the sum
  zero-padded to task_max_len + 1 digits and written least-significant digit
  first, so each digit of the sum sits a fixed distance from the digits it
  depends on and is written after the carry into it: with task_max_len=3,
  "012+005" -> "7100". A target is the sum and nothing else in both formats,
  so exact match on it is exact match on the sum.
  These three are synthetic and exactly scorable: drawn from
  np.random.default_rng((data.task_seed, split)), lengths uniform in
  [task_min_len, task_max_len] for train and [task_test_min_len or
  task_min_len, task_max_len] for the held-out validation set; a training
  example whose source is also held out is dropped.
- `code_summary`: from the Python standard library (`corpora.stdlib_documents`),
  the source of each function with its docstring removed -> the docstring's
  first line; split by module path (`corpora.is_validation`).
- `pairs`: the user's pairs in data.paths: `.tsv` files with a header row
  naming the columns, or `.jsonl` files of objects; the source and target are
  the columns/fields data.src_field and data.tgt_field. Split by
  `path:line` (`corpora.is_validation` with data.val_percent).
"""
import ast
import functools
import re
import textwrap

from ml_collections import config_dict
import numpy as np

from configs.errors import UserError
from data import corpora
from data import sources

SYNTHETIC_TASKS = ("reverse", "sort", "addition")
TASKS = SYNTHETIC_TASKS + ("code_summary", "pairs")
_SPLIT_IDS = {"train": 0, "validation": 1}
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_DIGITS = np.array(list("0123456789"))

Pair = tuple[str, str]  # (source, target)


def load_pairs(data_config: config_dict.ConfigDict, split: str) -> list[Pair]:
  """The (source, target) pairs of `split` (`train` or `validation`) of data.task."""
  if split not in sources.SPLITS:
    raise ValueError(f"split must be one of {sources.SPLITS}, got {split!r}")
  task = data_config.task
  if task in SYNTHETIC_TASKS:
    return synthetic_pairs(data_config, split)
  if task == "code_summary":
    return [(src, tgt) for module, _, src, tgt in stdlib_function_summaries()
            if corpora.is_validation(module, data_config.val_percent) == (split == "validation")]
  if task == "pairs":
    return [pair for _, pair in corpora.split(file_pairs(data_config), split,
                                              data_config.val_percent)]
  raise UserError(f"data.task={task!r}: must be one of {', '.join(TASKS)} for a seq2seq run")


def tokenizer_texts(data_config: config_dict.ConfigDict) -> list[str]:
  """What the tokenizer of a task trains on: every train source and target."""
  return [text for pair in load_pairs(data_config, "train") for text in pair]


# Synthetic tasks.

def make_example(task: str, rng: np.random.Generator, min_len: int, max_len: int,
                 addition_format: str = "plain") -> Pair:
  """One example of a synthetic task, lengths uniform in [min_len, max_len]."""
  if task == "reverse":
    src = "".join(rng.choice(_LETTERS, rng.integers(min_len, max_len + 1)))
    return src, src[::-1]
  if task == "sort":
    src = "".join(rng.choice(_DIGITS, rng.integers(min_len, max_len + 1)))
    return src, "".join(sorted(src))
  if task == "addition":
    a, b = (_random_number(rng, int(rng.integers(min_len, max_len + 1))) for _ in range(2))
    return addition_pair(a, b, addition_format, max_len)
  raise ValueError(f"not a synthetic task: {task!r}")


def addition_pair(a: int, b: int, addition_format: str, width: int) -> Pair:
  """a + b in `addition_format` (`plain` or `aligned` to `width` digits; see the top)."""
  if addition_format == "plain":
    return f"{a}+{b}", str(a + b)
  if addition_format == "aligned":
    return f"{a:0{width}d}+{b:0{width}d}", str(a + b).zfill(width + 1)[::-1]
  raise ValueError(f"not an addition format: {addition_format!r}")


def _random_number(rng: np.random.Generator, digits: int) -> int:
  """A uniform random integer of exactly `digits` digits (0 allowed for 1 digit)."""
  first = rng.choice(_DIGITS[1:] if digits > 1 else _DIGITS)
  return int(first + "".join(rng.choice(_DIGITS, digits - 1)))


def synthetic_pairs(data_config: config_dict.ConfigDict, split: str) -> list[Pair]:
  d = data_config
  test_min_len = d.task_test_min_len or d.task_min_len
  addition_format = d.task_addition_format
  held_out = _draw(d.task, d.task_seed, "validation", d.task_test_size, test_min_len,
                   d.task_max_len, addition_format)
  if split == "validation":
    return held_out
  held_out_sources = {src for src, _ in held_out}
  train = _draw(d.task, d.task_seed, "train", d.task_size, d.task_min_len, d.task_max_len,
                addition_format)
  return [pair for pair in train if pair[0] not in held_out_sources]


def _draw(task: str, seed: int, split: str, count: int, min_len: int, max_len: int,
          addition_format: str) -> list[Pair]:
  rng = np.random.default_rng((seed, _SPLIT_IDS[split]))
  return [make_example(task, rng, min_len, max_len, addition_format) for _ in range(count)]


# Code summarisation on the standard library.

def function_summaries(source: str) -> list[tuple[str, str, str]]:
  """(name, source without its docstring, docstring's first line) of each function.

  Every function and method with a docstring whose first line is not blank
  and whose body holds more than the docstring; the source is dedented and
  starts at the `def` line (decorators left out). A file that does not parse
  gives nothing.
  """
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  lines = source.splitlines()
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    docstring = ast.get_docstring(node)
    summary = docstring.strip().splitlines()[0].strip() if docstring and docstring.strip() else ""
    if not summary or len(node.body) < 2:
      continue
    doc_node = node.body[0]
    # The docstring must sit on lines of its own, after the signature.
    if (lines[doc_node.lineno - 1][:doc_node.col_offset].strip()
        or node.body[1].lineno <= doc_node.end_lineno):
      continue
    kept = (lines[node.lineno - 1:doc_node.lineno - 1]
            + lines[doc_node.end_lineno:node.end_lineno])
    out.append((node.name, textwrap.dedent("\n".join(kept)), summary))
  return out


@functools.lru_cache(maxsize=1)
def stdlib_function_summaries() -> tuple[tuple[str, str, str, str], ...]:
  """(module path, name, source, summary) over the whole standard library."""
  return tuple((module, *summary) for module, text in corpora.stdlib_documents()
               for summary in function_summaries(text))


def name_baseline(source: str) -> str:
  """The copy-the-function-name guess: `def get_item_count(...)` -> "get item count"."""
  match = re.search(r"def\s+(\w+)", source)
  return " ".join(part for part in match.group(1).split("_") if part) if match else ""


# The user's pairs.

def file_pairs(data_config: config_dict.ConfigDict) -> list[tuple[str, Pair]]:
  """(path:line, (source, target)) of every .tsv / .jsonl file of data.paths.

  Raises:
    UserError: a path that matches nothing, a file of another kind, a missing
      column or field, a malformed line, or no pair at all.
  """
  pairs = []
  for path in sources.expand_paths(data_config.paths, "task=pairs"):
    if path.endswith(".tsv"):
      pairs.extend(_tsv_pairs(path, data_config.src_field, data_config.tgt_field))
    elif path.endswith(".jsonl"):
      pairs.extend(_jsonl_pairs(path, data_config.src_field, data_config.tgt_field))
    else:
      raise UserError(f"{path}: data.task=pairs reads .tsv (with a header row) or .jsonl "
                      "files; rename it or leave it out of data.paths")
  if not pairs:
    raise UserError(f"data.paths={data_config.paths!r}: no pairs; data.task=pairs needs "
                    "lines with a source and a target")
  return pairs


def _tsv_pairs(path: str, src_field: str, tgt_field: str) -> list[tuple[str, Pair]]:
  lines = sources.read_text(path).splitlines()
  header = lines[0].split("\t") if lines else []
  for field, name in ((src_field, "src_field"), (tgt_field, "tgt_field")):
    if field not in header:
      raise UserError(f"{path}: the header row {header} has no column {field!r}; the first "
                      f"line names the tab-separated columns, set data.{name} to one of them")
  src_col, tgt_col = header.index(src_field), header.index(tgt_field)
  pairs = []
  for line_number, line in enumerate(lines[1:], start=2):
    if not line.strip():
      continue
    cells = line.split("\t")
    if len(cells) != len(header):
      raise UserError(f"{path}:{line_number}: {len(cells)} tab-separated columns, the "
                      f"header has {len(header)}; fix the line (tabs inside text are not allowed)")
    pairs.append((f"{path}:{line_number}", (cells[src_col], cells[tgt_col])))
  return pairs


def _jsonl_pairs(path: str, src_field: str, tgt_field: str) -> list[tuple[str, Pair]]:
  pairs = []
  for line_number, line in enumerate(sources.read_text(path).splitlines(), start=1):
    if line.strip():
      name = f"{path}:{line_number}"
      src, tgt = sources.text_fields(line, name, "line",
                                     ((src_field, "src_field"), (tgt_field, "tgt_field")))
      pairs.append((name, (src, tgt)))
  return pairs
