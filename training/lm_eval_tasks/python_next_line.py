"""python_next_line: which of four lines is the real next line of a snippet of
Python standard-library source (an lm-eval multiple-choice task that needs no
network; docs/downstream.md).

lm-eval loads the items through `load` (the YAML's `custom_dataset`), from
python_next_line.jsonl beside this file. The file is built by

  python -m training.lm_eval_tasks.python_next_line

deterministically (seed SEED) from the standard library of the Python that
runs it: the files that `data/corpora.py` holds out for validation at the
default data.val_percent (5%), which runs on `stdlib` never train on. An item
is a context (the whole lines before a code line, at most CONTEXT_CHARS
characters) and four choices: the real next line and three code lines of the
same indentation from other held-out files, none of which occurs in the
item's own file. Chance: 25%.
"""
import io
import json
import pathlib
import random
import sys
import tokenize

SEED = 0
ITEMS = 300
CHOICES = 4
CONTEXT_CHARS = 240  # the most characters of context before the line to choose
LINE_CHARS = (12, 80)  # length of a line that may be chosen (its stripped text)
PER_FILE = 12  # the most items drawn from one file
DATA = pathlib.Path(__file__).with_suffix(".jsonl")


def load(**_):
  """The task's one split, `test` (lm-eval's custom_dataset; it passes the
  task's metadata, unused)."""
  import datasets  # pylint: disable=import-outside-toplevel
  rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
  return {"test": datasets.Dataset.from_list(rows)}


def code_lines(source: str) -> list[int]:
  """Indices of the lines that are a whole statement on one line, starting
  with a name or keyword (no docstring, comment, decorator or continuation),
  of LINE_CHARS characters once stripped."""
  lines = source.splitlines()
  found, start, first = [], None, None
  try:
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
      if token.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENCODING):
        continue
      if token.type == tokenize.NEWLINE:
        row = start - 1
        if (first == tokenize.NAME and token.start[0] == start
            and LINE_CHARS[0] <= len(lines[row].strip()) <= LINE_CHARS[1]):
          found.append(row)
        start = None
      elif start is None:
        start, first = token.start[0], token.type
  except (tokenize.TokenError, SyntaxError):
    return []
  return found


def _context(lines: list[str], row: int) -> str | None:
  """The whole lines before `row`, as many as fit in CONTEXT_CHARS (at least two)."""
  taken, size = [], 0
  for line in reversed(lines[:row]):
    if size + len(line) + 1 > CONTEXT_CHARS:
      break
    taken.append(line)
    size += len(line) + 1
  if len(taken) < 2:
    return None
  return "".join(line + "\n" for line in reversed(taken))


def _indent(line: str) -> str:
  return line[:len(line) - len(line.lstrip())]


def build() -> list[dict]:
  """The task's items, drawn with SEED from the held-out standard-library files."""
  # Imported here: lm-eval imports this module (for `load`) outside the repository's packages.
  from configs import base  # pylint: disable=import-outside-toplevel
  from data import corpora  # pylint: disable=import-outside-toplevel
  val_percent = base.get_config().data.val_percent
  held_out = [rel for rel in corpora.stdlib_files() if corpora.is_validation(rel, val_percent)]
  files = {rel: text.splitlines() for rel, text in corpora.stdlib_texts(held_out)}
  rng = random.Random(SEED)
  candidates, by_indent = [], {}
  for rel, lines in files.items():
    rows = code_lines("\n".join(lines) + "\n")
    for row in rows:
      by_indent.setdefault(_indent(lines[row]), []).append((rel, lines[row]))
    rows = [row for row in rows if _context(lines, row) is not None]
    candidates += [(rel, row) for row in rng.sample(rows, min(PER_FILE, len(rows)))]
  items = []
  for rel, row in rng.sample(candidates, len(candidates)):
    lines = files[rel]
    own = {line.strip() for line in lines}
    others = sorted({line for other, line in by_indent[_indent(lines[row])]
                     if other != rel and line.strip() not in own})
    if len(others) < CHOICES - 1:
      continue
    choices = rng.sample(others, CHOICES - 1)
    answer = rng.randrange(CHOICES)
    choices.insert(answer, lines[row])
    items.append({"context": _context(lines, row), "choices": choices, "answer": answer,
                  "source": f"{rel}:{row + 1}"})
    if len(items) == ITEMS:
      break
  if len(items) < ITEMS:
    raise SystemExit(f"only {len(items)} items from {len(held_out)} held-out files; "
                     f"{ITEMS} wanted")
  return items


def main():
  items = build()
  DATA.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items),
                  encoding="utf-8")
  files = len({item["source"].split(":")[0] for item in items})
  print(f"wrote {DATA.name}: {len(items)} items from {files} files of the Python "
        f"{sys.version.split()[0]} standard library, {DATA.stat().st_size:,} bytes")


if __name__ == "__main__":
  main()
