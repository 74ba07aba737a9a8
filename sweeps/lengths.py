"""The sweep report's loss per evaluated length (`eval.py --seq_len L`, with
or without a RoPE override): one column per length any variant was evaluated
at, read from each variant's eval_lengths.json (`training/lengths.py`). A
section of report.md and its own report_lengths.csv, so that the main table
stays as it is."""
import csv
import os

from sweeps import stats
from training.lengths import read_lengths


def length_columns(workdirs: list[str]) -> tuple[list[str], list[list]]:
  """(titles "loss@<label>", one row of losses per workdir, "" where missing),
  the labels ordered by length, then name."""
  entries = [read_lengths(w) for w in workdirs]
  labels = sorted({label for e in entries for label in e},
                  key=lambda label: (int(label.split("_")[0]), label))
  rows = [[e[label]["loss"] if label in e else "" for label in labels] for e in entries]
  return [f"loss@{label}" for label in labels], rows


def write_length_table(root: str, names: list[str], workdirs: list[str],
                       groups: list[str] | None = None) -> tuple[str, list[str]]:
  """(the markdown section, its CSV files) of the runs' losses per evaluated
  length; ("", []) when no run was evaluated at another length.

  report_lengths.csv has a row per run. With `groups` (each run's variant)
  naming a variant more than once (seeds), the section also has a table of
  each variant's mean and 95% interval per length over its runs evaluated
  there (`sweeps/stats.py`), and report_lengths_summary.csv its numbers."""
  titles, rows = length_columns(workdirs)
  if not titles:
    return "", []
  path = os.path.join(root, "report_lengths.csv")
  with open(path, "w", encoding="utf-8", newline="") as f:
    csv.writer(f).writerows([["variant", *titles], *[[n, *r] for n, r in zip(names, rows)]])
  lines = ["", "## Validation loss by evaluated length", "",
           "eval.py --seq_len L (a label `L_<scaling><factor>`: with that RoPE scaling set at "
           "evaluation time).", ""]
  files = [path]
  if groups and len(set(groups)) < len(groups):
    summary_path = os.path.join(root, "report_lengths_summary.csv")
    summary = _summaries(titles, rows, groups)
    with open(summary_path, "w", encoding="utf-8", newline="") as f:
      csv.writer(f).writerows(
          [["variant", *(f"{t}_{k}" for t in titles for k in ("n", "mean", "sd", "ci_low",
                                                                "ci_high"))],
           *[[group, *(x for s in row for x in (s.n, s.mean, s.sd, s.low, s.high))]
             for group, row in summary.items()]])
    files.append(summary_path)
    lines += ["Per variant: the mean over its runs evaluated at that length, its 95% interval "
              "(Student t) and n; the runs one by one below.", "",
              "| variant | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(titles)]
    for group, row in summary.items():
      lines.append(f"| {group} | " + " | ".join(_cell(s) for s in row) + " |")
    lines.append("")
  lines += ["| run | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(titles)]
  for name, row in zip(names, rows):
    lines.append(f"| {name} | " + " | ".join(v if v == "" else f"{v:.4f}" for v in row) + " |")
  return "\n".join(lines) + "\n", files


def _summaries(titles: list[str], rows: list[list], groups: list[str]) -> dict:
  """{variant: [stats.Summary of each length's losses over its runs]}."""
  out = {}
  for group in dict.fromkeys(groups):
    mine = [row for row, g in zip(rows, groups) if g == group]
    out[group] = [stats.summarize([row[i] for row in mine if row[i] != ""])
                  for i in range(len(titles))]
  return out


def _cell(s: stats.Summary) -> str:
  """`mean [low, high] (n)`; the value alone for n = 1, blank for none."""
  if not s.n:
    return ""
  if s.low is None:
    return f"{s.mean:.4f} (n=1)"
  return f"{s.mean:.4f} [{s.low:.4f}, {s.high:.4f}] (n={s.n})"
