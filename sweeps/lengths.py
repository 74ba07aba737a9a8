"""The sweep report's loss per evaluated length (`eval.py --seq_len L`, with
or without a RoPE override): one column per length any variant was evaluated
at, read from each variant's eval_lengths.json (`training/lengths.py`). A
section of report.md and its own report_lengths.csv, so that the main table
stays as it is."""
import csv
import os
import textwrap

from matplotlib.figure import Figure

from sweeps import stats
from training.lengths import read_lengths


def length_columns(entries: list[dict]) -> tuple[list[str], list[list]]:
  """(titles "loss@<label>", one row of losses per run, "" where missing) of
  the runs' eval_lengths.json `entries`, the labels ordered by length, then name."""
  labels = _labels(entries)
  rows = [[e[label]["loss"] if label in e else "" for label in labels] for e in entries]
  return [f"loss@{label}" for label in labels], rows


def _labels(entries: list[dict]) -> list[str]:
  """Every evaluated label of the runs, ordered by length, then name."""
  return sorted({label for e in entries for label in e},
                key=lambda label: (int(label.split("_")[0]), label))


def write_length_table(root: str, names: list[str], workdirs: list[str],
                       groups: list[str] | None = None,
                       train_lens: list[int] | None = None) -> tuple[str, list[str]]:
  """(the markdown section, its CSV files) of the runs' losses per evaluated
  length; ("", []) when no run was evaluated at another length.

  report_lengths.csv has a row per run. With `groups` (each run's variant)
  naming a variant more than once (seeds), the section also has a table of
  each variant's mean and 95% interval per length over its runs evaluated
  there (`sweeps/stats.py`), and report_lengths_summary.csv its numbers.
  `loss_by_position.png`: a panel per evaluated length, each variant's loss
  against position (the mean over its runs), the training lengths
  (`train_lens`, each run's) dashed."""
  entries = [read_lengths(w) for w in workdirs]
  titles, rows = length_columns(entries)
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
  plot = os.path.join(root, "loss_by_position.png")
  _plot_by_position(plot, entries, groups or names, sorted(set(train_lens or [])))
  files.append(plot)
  lines += ["", "![loss_by_position.png](loss_by_position.png)"]
  return "\n".join(lines) + "\n", files


def _plot_by_position(path: str, entries: list[dict], groups: list[str],
                      train_lens: list[int]) -> None:
  """A panel per evaluated length: each variant's loss per position bucket,
  the mean over its runs evaluated there (`entries`: each run's
  eval_lengths.json), at the buckets' middles."""
  labels = _labels(entries)
  variants = list(dict.fromkeys(groups))
  names, ncol, legend_lines = _legend_layout(variants, width_inches=5 * len(labels))
  fig = Figure(figsize=(5 * len(labels), 4 + 0.15 * legend_lines))
  axes = fig.subplots(1, len(labels), sharey=True, squeeze=False)[0]
  lines = {}
  for ax, label in zip(axes, labels):
    for i, group in enumerate(variants):
      tables = [e[label]["loss_by_position"] for e, g in zip(entries, groups)
                if g == group and label in e]
      if not tables:
        continue
      buckets = tables[0]["buckets"]  # runs evaluated with other --position_buckets: left out
      tables = [t for t in tables if [b["start"] for b in t["buckets"]] ==
                [b["start"] for b in buckets]]
      losses = [[t["buckets"][i]["loss"] for t in tables if t["buckets"][i]["loss"] is not None]
                for i in range(len(buckets))]
      points = [((b["start"] + b["end"] - 1) / 2, sum(v) / len(v))
                for b, v in zip(buckets, losses) if v]
      lines[group], = ax.plot(*zip(*points), marker=".", color=f"C{i % 10}")
    for train_len in train_lens:
      ax.axvline(train_len, color="gray", linestyle="--")
    ax.set_title(f"evaluated at {label}" + (f" (training length {', '.join(map(str, train_lens))}"
                                            " dashed)" if train_lens else ""), fontsize=9)
    ax.set_xlabel("position in the row")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("validation loss (nats per token)")
  shown = [i for i, g in enumerate(variants) if g in lines]
  fig.legend([lines[variants[i]] for i in shown], [names[i] for i in shown],
             loc="lower center", ncol=ncol, fontsize=7)
  fig.tight_layout(rect=(0, 0.15 * legend_lines / (4 + 0.15 * legend_lines), 1, 1))
  fig.savefig(path, dpi=100)


def _legend_layout(variants: list[str], width_inches: float) -> tuple[list[str], int, int]:
  """(each variant's legend label: the comma-separated fields of its name
  that not every variant shares, wrapped to fit a column; the legend's
  columns, at most 4, none narrower than 28 characters; its lines of text,
  for the space below the panels). 7-point text fits about 14 characters
  an inch."""
  fields = [v.split(",") for v in variants]
  shared = set.intersection(*map(set, fields)) if len(fields) > 1 else set()
  short = [", ".join(f for f in parts if f not in shared) or v for parts, v in zip(fields, variants)]
  ncol = max(1, min(4, len(short), int(14 * width_inches) // 34))
  width = int(14 * width_inches / ncol) - 6  # less the marker
  names = [textwrap.fill(v, width, break_long_words=False) for v in short]
  rows = [names[i:i + ncol] for i in range(0, len(names), ncol)]
  return names, ncol, sum(max(n.count("\n") + 1 for n in row) for row in rows) + 1


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
