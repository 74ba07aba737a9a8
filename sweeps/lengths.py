"""The sweep report's loss per evaluated length (`eval.py --seq_len L`, with
or without a RoPE override): one column per length any variant was evaluated
at, read from each variant's eval_lengths.json (`training/lengths.py`). A
section of report.md and its own report_lengths.csv, so that the main table
stays as it is."""
import csv
import os

from training.lengths import read_lengths


def length_columns(workdirs: list[str]) -> tuple[list[str], list[list]]:
  """(titles "loss@<label>", one row of losses per workdir, "" where missing),
  the labels ordered by length, then name."""
  entries = [read_lengths(w) for w in workdirs]
  labels = sorted({label for e in entries for label in e},
                  key=lambda label: (int(label.split("_")[0]), label))
  rows = [[e[label]["loss"] if label in e else "" for label in labels] for e in entries]
  return [f"loss@{label}" for label in labels], rows


def write_length_table(root: str, names: list[str], workdirs: list[str]) -> tuple[str, list[str]]:
  """(the markdown section, [report_lengths.csv]) of the variants' losses per
  evaluated length; ("", []) when no variant was evaluated at another length."""
  titles, rows = length_columns(workdirs)
  if not titles:
    return "", []
  path = os.path.join(root, "report_lengths.csv")
  with open(path, "w", encoding="utf-8", newline="") as f:
    csv.writer(f).writerows([["variant", *titles], *[[n, *r] for n, r in zip(names, rows)]])
  lines = ["", "## Validation loss by evaluated length", "",
           "eval.py --seq_len L (a label `L_<scaling><factor>`: with that RoPE scaling set at "
           "evaluation time).", "",
           "| variant | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(titles)]
  for name, row in zip(names, rows):
    lines.append(f"| {name} | " + " | ".join(v if v == "" else f"{v:.4f}" for v in row) + " |")
  return "\n".join(lines) + "\n", [path]
