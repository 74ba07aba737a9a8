"""Sequence classification data: labelled texts as fixed-shape rows.

`data.task` (with train.objective=classify) selects the examples:

- `stdlib_package`: which standard-library package (`PACKAGES`) a
  function's source comes from, over every function and method of those
  packages (`corpora.stdlib_documents`), split by module path like
  code_summary (`corpora.is_validation` with data.val_percent), so that no
  held-out function's module is trained on. Nothing is downloaded.
- `labelled`: the user's `.tsv` files (a header row naming the columns) or
  `.jsonl` files (one object a line) in data.paths: the text is
  data.text_field, the label data.label_field (a string, or a number read as
  its text), and with data.text_pair_field a second text (token type 1, BERT's
  sentence B). Split by `path:line` with data.val_percent.

Labels are mapped to ids by the run's label list `label_names`: data.labels
when set (an import's, or the run's saved config), else the train split's
labels sorted. A label outside that list is one UserError naming it.

A row, T = train.seq_len (`Tokenizer.encode_classified`: `BOS text EOS`, or
the HF tokenizer's own marks, truncated to T):

  inputs        [T] int32    the tokens, then pad
  padding_mask  [T] int32    1 on the tokens, 0 on padding
  token_types   [T] int32    0, and 1 on the pair's tokens; 0 on padding
  labels        []  int32    the class id (0 when the example has no label)
  weights       []  float32  1 for a labelled example, 0 for filler rows (past
                             the split's end) and unlabelled ones
"""
import ast
import dataclasses
import functools
import json
import textwrap

from absl import logging
from ml_collections import config_dict
import numpy as np

from configs.errors import UserError
from data import corpora
from data import sources

# The packages of the built-in task: large ones (hundreds of functions each)
# that every Python 3.10+ carries.
TASKS = ("stdlib_package", "labelled")
PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "tkinter", "unittest",
            "xml")


@dataclasses.dataclass(frozen=True)
class Example:
  """One text to classify; `pair` the second text or None, `label` None when
  the file gives none (eval.py --data of texts to predict)."""
  name: str  # module path, or path:line
  text: str
  pair: str | None
  label: str | None


def function_sources(source: str) -> list[str]:
  """The dedented source of every function and method of a module (the
  decorators left out); a file that does not parse gives none."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  lines = source.splitlines()
  return [textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
          for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@functools.lru_cache(maxsize=1)
def stdlib_package_examples() -> tuple[Example, ...]:
  """Every function of `PACKAGES`, labelled with its top-level package."""
  out = []
  for module, text in corpora.stdlib_documents():
    package = module.split("/")[0]
    if package in PACKAGES and "/" in module:
      out.extend(Example(module, body, None, package) for body in function_sources(text))
  return tuple(out)


def load_examples(data_config: config_dict.ConfigDict, split: str) -> list[Example]:
  """The examples of `split` (`train` or `validation`) of data.task."""
  if split not in sources.SPLITS:
    raise ValueError(f"split must be one of {sources.SPLITS}, got {split!r}")
  held_out = split == "validation"
  if data_config.task == "stdlib_package":
    return [e for e in stdlib_package_examples()
            if corpora.is_validation(e.name, data_config.val_percent) == held_out]
  if data_config.task == "labelled":
    return [e for e in file_examples(data_config)
            if corpora.is_validation(e.name, data_config.val_percent) == held_out]
  raise UserError(f"data.task={data_config.task!r}: train.objective=classify reads "
                  "stdlib_package or labelled")


def label_names(data_config: config_dict.ConfigDict) -> tuple[str, ...]:
  """The run's classes in id order: data.labels, else the train split's sorted."""
  if data_config.labels:
    return tuple(data_config.labels)
  if data_config.task == "stdlib_package":
    return tuple(sorted(PACKAGES))
  labels = sorted({e.label for e in load_examples(data_config, "train") if e.label is not None})
  if not labels:
    raise UserError(f"data.paths={data_config.paths!r}: the train split has no labels (field "
                    f"data.label_field={data_config.label_field!r}); label the examples")
  return tuple(labels)


def resolve_labels(config: config_dict.ConfigDict) -> tuple[str, ...]:
  """Fills data.labels (when empty) with `label_names`, and checks
  model.num_labels against them; the label list, which the run's
  config.json then keeps."""
  names = label_names(config.data)
  if len(names) != config.model.num_labels:
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    raise UserError(f"model.num_labels={config.model.num_labels} but the data has "
                    f"{len(names)} labels ({shown}); set --config.model.num_labels={len(names)}")
  config.data.labels = names
  return names


def tokenizer_texts(data_config: config_dict.ConfigDict) -> list[str]:
  """What the tokenizer of a classification task trains on: the train texts."""
  return [text for e in load_examples(data_config, "train")
          for text in (e.text, e.pair) if text is not None]


# The user's files.

def file_examples(data_config: config_dict.ConfigDict) -> list[Example]:
  """Every example of the .tsv / .jsonl files of data.paths.

  Raises:
    UserError: a path that matches nothing, a file of another kind, a missing
      text column or field, a malformed line, or no example at all.
  """
  d = data_config
  examples = []
  for path in sources.expand_paths(d.paths, "task=labelled"):
    if path.endswith(".tsv"):
      examples.extend(_tsv_examples(path, d))
    elif path.endswith(".jsonl"):
      examples.extend(_jsonl_examples(path, d))
    else:
      raise UserError(f"{path}: data.task=labelled reads .tsv (with a header row) or .jsonl "
                      "files; rename it or leave it out of data.paths")
  if not examples:
    raise UserError(f"data.paths={d.paths!r}: no examples; data.task=labelled needs lines "
                    "with a text and a label")
  return examples


def _tsv_examples(path: str, d) -> list[Example]:
  lines = sources.read_text(path).splitlines()
  header = lines[0].split("\t") if lines else []
  wanted = [(d.text_field, "text_field")] + ([(d.text_pair_field, "text_pair_field")]
                                             if d.text_pair_field else [])
  for field, option in wanted:
    if field not in header:
      raise UserError(f"{path}: the header row {header} has no column {field!r}; the first "
                      f"line names the tab-separated columns, set data.{option} to one of them")
  label_col = header.index(d.label_field) if d.label_field in header else None
  pair_col = header.index(d.text_pair_field) if d.text_pair_field else None
  out = []
  for line_number, line in enumerate(lines[1:], start=2):
    if not line.strip():
      continue
    cells = line.split("\t")
    if len(cells) != len(header):
      raise UserError(f"{path}:{line_number}: {len(cells)} tab-separated columns, the "
                      f"header has {len(header)}; fix the line (tabs inside text are not allowed)")
    out.append(Example(f"{path}:{line_number}", cells[header.index(d.text_field)],
                       None if pair_col is None else cells[pair_col],
                       None if label_col is None else cells[label_col]))
  return out


def _jsonl_examples(path: str, d) -> list[Example]:
  fields = ((d.text_field, "text_field"),) + (((d.text_pair_field, "text_pair_field"),)
                                              if d.text_pair_field else ())
  out = []
  for line_number, line in enumerate(sources.read_text(path).splitlines(), start=1):
    if not line.strip():
      continue
    name = f"{path}:{line_number}"
    texts = sources.text_fields(line, name, "line", fields)
    label = json.loads(line).get(d.label_field)  # an object: text_fields checked it
    if label is not None and (not isinstance(label, (str, int)) or isinstance(label, bool)):
      raise UserError(f"{name}: label field {d.label_field!r} is {label!r}; a label is a "
                      "string or an integer")
    out.append(Example(name, texts[0], texts[1] if len(texts) > 1 else None,
                       None if label is None else str(label)))
  return out


class ClassifyRows:
  """The tokenised examples of a split and their rows; a Grain source.

  `self(i)` or `self[i]` is row i (see the module docstring); rows
  `num_examples` and beyond are filler (weights 0). `label_ids[i]` is -1 for
  an unlabelled example.
  """

  def __init__(self, examples: list[Example], labels: tuple[str, ...], tokenizer, *,
               seq_len: int):
    index = {name: i for i, name in enumerate(labels)}
    for e in examples:
      if e.label is not None and e.label not in index:
        shown = ", ".join(labels[:12]) + (", ..." if len(labels) > 12 else "")
        raise UserError(f"{e.name}: label {e.label!r} is not one of the run's {len(labels)} "
                        f"labels ({shown}); fix the label or leave the example out")
    self.examples = examples
    self.labels = labels
    self.seq_len = seq_len
    self.pad_id = tokenizer.pad_id
    self.label_ids = np.array([-1 if e.label is None else index[e.label] for e in examples],
                              np.int32)
    encoded = [tokenizer.encode_classified(e.text, e.pair) for e in examples]
    self.num_truncated = sum(len(ids) > seq_len for ids, _ in encoded)
    self.ids = [np.asarray(ids[:seq_len], np.int32) for ids, _ in encoded]
    self.types = [np.asarray(types[:seq_len], np.int32) for _, types in encoded]

  @property
  def num_examples(self) -> int:
    return len(self.examples)

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self(index)

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    t = self.seq_len
    row = {"inputs": np.full([t], self.pad_id, np.int32), "padding_mask": np.zeros([t], np.int32),
           "token_types": np.zeros([t], np.int32), "labels": np.zeros([], np.int32),
           "weights": np.zeros([], np.float32)}
    if index < self.num_examples:
      n = len(self.ids[index])
      row["inputs"][:n] = self.ids[index]
      row["padding_mask"][:n] = 1
      row["token_types"][:n] = self.types[index]
      label = self.label_ids[index]
      row["labels"] = np.asarray(max(label, 0), np.int32)
      row["weights"] = np.asarray(float(label >= 0), np.float32)
    return row


def load_rows(config: config_dict.ConfigDict, tokenizer, split: str) -> ClassifyRows:
  """The rows of `split` of data.task; logs the examples truncated.

  Raises:
    UserError: an empty split, or a label outside the run's labels.
  """
  examples = load_examples(config.data, split)
  if not examples:
    raise UserError(f"the {split} split of data.task={config.data.task} is empty: "
                    f"data.val_percent={config.data.val_percent} leaves it no examples; change "
                    "data.val_percent or add examples")
  rows = ClassifyRows(examples, label_names(config.data), tokenizer,
                      seq_len=config.train.seq_len)
  if rows.num_truncated:
    logging.info("data.task=%s: %d of %d %s examples cut to train.seq_len=%d tokens",
                 config.data.task, rows.num_truncated, rows.num_examples, split,
                 config.train.seq_len)
  return rows
