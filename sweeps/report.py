"""A sweep's report: report.md and report.csv (one row per variant), the
validation-curve plots (against steps and against tokens) and each variant's
config history."""
import csv
import os

from training import workdir as workdir_lib
from training.metrics import read_metrics
from training.plots import plot_against_steps_and_tokens, plot_curves, split_curve
from sweeps.common import REPO
from sweeps.lengths import write_length_table
from sweeps.state import read_manifest, variant_state

# eval_report.json keys, their column titles in report.md and their formats.
REPORT_COLUMNS = (("loss", "val loss", ".4f"), ("perplexity", "perplexity", ".2f"),
                  ("token_accuracy", "token accuracy", ".4f"),
                  ("bits_per_byte", "bits per byte", ".4f"))


def write_report(root: str) -> list[str]:
  """report.md and report.csv (one row per variant) and the validation-curve PNGs."""
  manifest, variants = read_manifest(root)
  fields = list(dict.fromkeys(f for v in variants for f in v.overrides))
  header = ["variant", *fields, "state", "step", *(key for key, _, _ in REPORT_COLUMNS)]
  rows, curves, files, histories = [], {}, [], {}
  for variant in variants:
    history = workdir_lib.read_history(variant.workdir)
    if history:
      histories[variant.name] = workdir_lib.history_lines(history)
    s = variant_state(variant)
    report = s.report or {}
    rows.append([variant.name, *(variant.overrides.get(f, "") for f in fields), s.state,
                 "" if s.step is None else s.step,
                 *(report.get(key, "") for key, _, _ in REPORT_COLUMNS)])
    records = read_metrics(variant.workdir)
    steps, losses = split_curve(records, "validation")
    if steps:
      train = variant.config.get("train", {})
      tokens_per_step = train.get("batch_size", 0) * train.get("seq_len", 0)
      curves[variant.name] = (steps, losses, tokens_per_step, {"marker": "."})
      os.makedirs(os.path.join(root, "curves"), exist_ok=True)
      path = os.path.join(root, "curves", f"{variant.name}.png")
      batches = next((int(r["batches"]) for r in records if "batches" in r), "?")
      plot_curves(path, f"{manifest['name']}: {variant.name}",
                  {f"validation, {batches} batches (in training)":
                   (steps, losses, {"marker": "."}),
                   "train": (*split_curve(records, "train"), {"alpha": 0.5})})
      files.append(path)
  if curves:
    files.insert(0, os.path.join(root, "validation_curves.png"))
    plot_against_steps_and_tokens(
        files[0], f"{manifest['name']}: validation loss in training (train.eval_steps "
        "batches; the table's val loss is the whole split)", curves)
  csv_path = os.path.join(root, "report.csv")
  with open(csv_path, "w", encoding="utf-8", newline="") as f:
    csv.writer(f).writerows([header, *rows])
  md_path = os.path.join(root, "report.md")
  length_section, length_files = write_length_table(
      root, [v.name for v in variants], [v.workdir for v in variants])
  with open(md_path, "w", encoding="utf-8") as f:
    f.write(_markdown(manifest, fields, rows, files, root, histories) + length_section)
  return [md_path, csv_path, *length_files, *files]


def _display(path: str) -> str:
  """A path relative to the repository when it lies inside it."""
  relative = os.path.relpath(path, REPO)
  return path if relative.startswith("..") else relative


def _markdown(manifest: dict, fields: list[str], rows: list[list], plots: list[str],
              root: str, histories: dict) -> str:
  titles = ["variant", *fields, "state", "step", *(title for _, title, _ in REPORT_COLUMNS)]
  lines = [f"# Sweep {manifest['name']}", "",
           f"Config `{_display(manifest['config'])}`, sweep `{_display(manifest['sweep'])}`, "
           f"flags for every variant: `{' '.join(manifest['extra_flags']) or 'none'}`. "
           "Metrics: eval.py over the whole validation split (eval_report.json).", "",
           "| " + " | ".join(titles) + " |",
           "|" + "---|" * (len(fields) + 3) + "---:|" * len(REPORT_COLUMNS)]
  for row in rows:
    metrics = [value if value == "" else format(value, spec)
               for value, (_, _, spec) in zip(row[len(fields) + 3:], REPORT_COLUMNS)]
    lines.append("| " + " | ".join(map(str, [*row[:len(fields) + 3], *metrics])) + " |")
  if histories:
    lines += ["", "Config changes on resume (config_history.jsonl):", ""]
    lines += [f"- {name}, {line}" for name, entries in histories.items() for line in entries]
  lines += [""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots]
  return "\n".join(lines) + "\n"
