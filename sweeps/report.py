"""A sweep's report: report.md; report.csv, one row per run (a variant and a
seed); report_summary.csv, one row per variant (its statistics over its seeds
against the baseline variant, `sweeps/stats.py`, and its cost); the
validation-curve plots (against steps, tokens and FLOPs), for a sweep of
learning rates the loss against the learning rate (`sweeps/lr_transfer.py`),
and each run's config history."""
import csv
import os

from configs.errors import UserError
from model import accounting
from training import workdir as workdir_lib
from training.metrics import read_metrics
from training.plots import plot_against_steps_tokens_and_flops, plot_curves, split_curve
from sweeps import stats
from sweeps.common import REPO
from sweeps.lengths import write_length_table
from sweeps.lr_transfer import write_lr_section
from sweeps.state import read_manifest, variant_state
from sweeps.variants import Variant

# eval_report.json keys, their column titles in report.md and their formats.
REPORT_COLUMNS = (("loss", "val loss", ".4f"), ("perplexity", "perplexity", ".2f"),
                  ("token_accuracy", "token accuracy", ".4f"),
                  ("bits_per_byte", "bits per byte", ".4f"))
# What a run cost: keys of report.csv (and report_summary.csv, at num_steps).
COST_COLUMNS = ("params", "params_non_embedding", "flops_per_token", "tokens", "flops")
# Per-run measurements of the loop (metrics.jsonl), summarised like the metrics.
TIME_COLUMNS = ("wall_s", "tokens_per_s")
STAT_COLUMNS = (*(key for key, _, _ in REPORT_COLUMNS), *TIME_COLUMNS)
STAT_FIELDS = ("n", "mean", "sd", "ci_low", "ci_high", "diff", "diff_ci_low", "diff_ci_high",
               "p", "verdict")


def write_report(root: str, baseline: str | None = None) -> list[str]:
  """report.md, report.csv, report_summary.csv and the validation-curve PNGs;
  `baseline`: the variant the others are compared with (default: the first)."""
  manifest, runs = read_manifest(root)
  groups = list(dict.fromkeys(run.group for run in runs))
  baseline = baseline or groups[0]
  if baseline not in groups:
    raise UserError(f"--baseline {baseline}: no such variant in {root} (its variants: "
                    f"{', '.join(groups)})")
  fields = list(dict.fromkeys(f for v in runs for f in v.overrides))
  rows, files, histories, records = [], [], {}, {}
  for run in runs:
    history = workdir_lib.read_history(run.workdir)
    if history:
      histories[run.name] = workdir_lib.history_lines(history)
    records[run.name] = read_metrics(run.workdir)
    rows.append(_run_row(run, records[run.name]))
    path = _run_plot(root, manifest["name"], run, records[run.name])
    if path:
      files.append(path)
  curves = {group: _mean_curve([(run, records[run.name]) for run in runs if run.group == group])
            for group in groups}
  curves = {group: curve for group, curve in curves.items() if curve}
  if curves:
    files.insert(0, os.path.join(root, "validation_curves.png"))
    band = " (band: min-max over seeds)" if manifest.get("seeds") else ""
    plot_against_steps_tokens_and_flops(
        files[0], f"{manifest['name']}: validation loss in training{band} (train.eval_steps "
        "batches; the table's val loss is the whole split)", curves)
  summary = _summaries(runs, rows, groups, baseline)
  csv_path = os.path.join(root, "report.csv")
  _write_csv(csv_path, ["variant", "seed", *fields, "state", "step",
                        *(key for key, _, _ in REPORT_COLUMNS), *COST_COLUMNS, *TIME_COLUMNS,
                        "run"],
             [{**row, **{f: run.overrides.get(f, "") for f in fields}}
              for run, row in zip(runs, rows)])
  summary_path = os.path.join(root, "report_summary.csv")
  _write_csv(summary_path, ["variant", *fields, "runs", "num_steps", *COST_COLUMNS,
                            *(f"{key}_{s}" for key in STAT_COLUMNS for s in STAT_FIELDS)],
             [{**row, **{f: group_runs[0].overrides.get(f, "") for f in fields}}
              for row, group_runs in summary])
  md_path = os.path.join(root, "report.md")
  length_section, length_files = write_length_table(
      root, [v.name for v in runs], [v.workdir for v in runs], [v.group for v in runs],
      [v.config["train"]["seq_len"] for v in runs if v.config])
  lr_section, lr_files = write_lr_section(root, summary, fields)
  files = lr_files + files
  with open(md_path, "w", encoding="utf-8") as f:
    summary_rows = [row for row, _ in summary]
    f.write(_markdown(manifest, fields, runs, rows, files, root, histories,
                      _statistics_section(baseline, summary_rows) + lr_section
                      + _cost_section(summary_rows))
            + length_section)
  return [md_path, csv_path, summary_path, *length_files, *files]


def _write_csv(path: str, header: list[str], rows: list[dict]) -> None:
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.DictWriter(f, header, extrasaction="ignore")
    writer.writeheader()
    writer.writerows([{key: "" if row.get(key) is None else row.get(key, "") for key in header}
                      for row in rows])


def _run_config(run: Variant):
  """The config the run trained with (its config.json), else the one the sweep
  asks for; None when neither is known."""
  if os.path.exists(os.path.join(run.workdir, workdir_lib.CONFIG_FILE)):
    return workdir_lib.load_config(run.workdir)
  return workdir_lib.saved_config(run.config) if run.config else None


def _run_row(run: Variant, records: list[dict]) -> dict:
  """A run's report.csv row: its state, metrics (when done) and cost."""
  s = variant_state(run)
  report = s.report or {}
  config = _run_config(run)
  row = {"variant": run.group, "run": run.name, "state": s.state, "step": s.step,
         "seed": run.seed if run.seed is not None else (config.train.seed if config else None),
         **{key: report.get(key) for key, _, _ in REPORT_COLUMNS}}
  if config is not None:
    row.update(_cost(config, s.step or 0))
  seconds = [r["seconds"] for r in records if r["split"] == "train" and "seconds" in r]
  if seconds:
    row["wall_s"] = sum(seconds)
    if "tokens" in row:
      row["tokens_per_s"] = row["tokens"] / max(row["wall_s"], 1e-9)
  return row


def _cost(config, steps: int) -> dict:
  """Parameters (total, non-embedding), training FLOPs per token, and the
  tokens and FLOPs of `steps` steps (`model/accounting.py`, as train.py's
  start-up summary counts them)."""
  params = accounting.formula_params(config.model)
  per_token = accounting.flops_per_token(config.model, config.train.seq_len, train=True)
  tokens = steps * accounting.tokens_per_step(config.train)
  return {"params": params["params_total"],
          "params_non_embedding": params["params_total"] - params["params_embedding"],
          "flops_per_token": per_token, "tokens": tokens, "flops": per_token * tokens}


def _run_plot(root: str, sweep_name: str, run: Variant, records: list[dict]) -> str | None:
  """curves/<run>.png: the run's validation and training loss; None before
  its first validation."""
  steps, losses = split_curve(records, "validation")
  if not steps:
    return None
  os.makedirs(os.path.join(root, "curves"), exist_ok=True)
  path = os.path.join(root, "curves", f"{run.name}.png")
  batches = next((int(r["batches"]) for r in records if "batches" in r), "?")
  plot_curves(path, f"{sweep_name}: {run.name}",
              {f"validation, {batches} batches (in training)": (steps, losses, {"marker": "."}),
               "train": (*split_curve(records, "train"), {"alpha": 0.5})})
  return path


def _mean_curve(runs: list[tuple[Variant, list[dict]]]):
  """A variant's in-training validation curve for validation_curves.png: at
  each step the mean over the seeds that logged it and, with several seeds,
  the band from their min to their max; None before any validation."""
  by_step, config = {}, None
  for run, records in runs:
    # The last record of a step: a resumed run may have logged it twice.
    steps = dict(zip(*split_curve(records, "validation")))
    for step, loss in steps.items():
      by_step.setdefault(step, []).append(loss)
    if config is None and steps:
      config = _run_config(run)
  if not by_step or config is None:
    return None
  steps = sorted(by_step)
  values = [by_step[step] for step in steps]
  band = ([min(v) for v in values], [max(v) for v in values]) if len(runs) > 1 else None
  return (steps, [sum(v) / len(v) for v in values], accounting.tokens_per_step(config.train),
          accounting.flops_per_step(config), band, {"marker": "."})


def _summaries(runs: list[Variant], rows: list[dict], groups: list[str],
               baseline: str) -> list[tuple[dict, list[Variant]]]:
  """(report_summary.csv row, the variant's runs) per variant: its statistics
  over its finished runs (`sweeps/stats.py`) against `baseline`, and its cost
  at train.num_steps."""
  done = {group: [row for run, row in zip(runs, rows) if run.group == group
                  and row["state"] == "done"] for group in groups}
  summaries = {group: {key: stats.summarize([r[key] for r in done[group]
                                             if r.get(key) is not None])
                       for key in STAT_COLUMNS} for group in groups}
  out = []
  for group in groups:
    group_runs = [run for run in runs if run.group == group]
    row = {"variant": group, "runs": len(group_runs), "num_steps": group_runs[0].num_steps}
    config = _run_config(group_runs[0])
    if config is not None:
      row.update(_cost(config, group_runs[0].num_steps))
    for key in STAT_COLUMNS:
      s = summaries[group][key]
      c = stats.compare(s, summaries[baseline][key], is_baseline=group == baseline)
      row.update({f"{key}_n": s.n, f"{key}_mean": s.mean, f"{key}_sd": s.sd,
                  f"{key}_ci_low": s.low, f"{key}_ci_high": s.high, f"{key}_diff": c.diff,
                  f"{key}_diff_ci_low": c.low, f"{key}_diff_ci_high": c.high,
                  f"{key}_p": c.p, f"{key}_verdict": c.verdict})
    out.append((row, group_runs))
  return out


def _display(path: str) -> str:
  """A path relative to the repository when it lies inside it."""
  relative = os.path.relpath(path, REPO)
  return path if relative.startswith("..") else relative


def _format(value, spec: str) -> str:
  return "" if value is None or value == "" else format(value, spec)


def _markdown(manifest: dict, fields: list[str], runs: list[Variant], rows: list[dict],
              plots: list[str], root: str, histories: dict, sections: str) -> str:
  """The runs table, then `sections`, the config histories and the plots."""
  titles = ["variant", *fields, "state", "step", *(title for _, title, _ in REPORT_COLUMNS)]
  seeds = (f" Each variant {manifest['seeds']} times, train.seed 0..{manifest['seeds'] - 1} "
           "(runs `<variant>,seed=<k>`)." if manifest.get("seeds") else "")
  lines = [f"# Sweep {manifest['name']}", "",
           f"Config `{_display(manifest['config'])}`, sweep `{_display(manifest['sweep'])}`, "
           f"flags for every variant: `{' '.join(manifest['extra_flags']) or 'none'}`.{seeds} "
           "Metrics: eval.py over the whole validation split (eval_report.json).", "",
           "| " + " | ".join(titles) + " |",
           "|" + "---|" * (len(fields) + 3) + "---:|" * len(REPORT_COLUMNS)]
  for run, row in zip(runs, rows):
    cells = [run.name, *(run.overrides.get(f, "") for f in fields), row["state"],
             "" if row["step"] is None else row["step"],
             *(_format(row[key], spec) for key, _, spec in REPORT_COLUMNS)]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  lines.append(sections.rstrip("\n"))
  if histories:
    lines += ["", "Config changes on resume (config_history.jsonl):", ""]
    lines += [f"- {name}, {line}" for name, entries in histories.items() for line in entries]
  lines += [""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots]
  return "\n".join(lines) + "\n"


def _interval(low, high, spec: str) -> str:
  return "" if low is None else f"[{low:{spec}}, {high:{spec}}]"


def _statistics_section(baseline: str, summary: list[dict]) -> str:
  """The section of each metric's mean, sd and interval per variant, and its
  difference from the baseline."""
  lines = ["", "## Statistics over seeds", "",
           f"Per variant over its finished runs: n, mean, sample sd and the 95% interval of "
           f"the mean (Student t); against the baseline `{baseline}`: the difference of means, "
           "its 95% interval (Welch-Satterthwaite df) and Welch's two-sided p. "
           f"\"{stats.SAME}\": the variant's interval overlaps the baseline's. Formulas: "
           "docs/sweeps.md; all numbers in report_summary.csv."]
  for key, title, spec in REPORT_COLUMNS:
    if not any(row[f"{key}_n"] for row in summary):
      continue
    lines += ["", f"### {title}", "",
              "| variant | n | mean | sd | 95% interval | diff vs baseline | 95% interval "
              "of diff | p | |", "|---|---:|---:|---:|---|---:|---|---:|---|"]
    for row in summary:
      n = row[f"{key}_n"]
      interval = (_interval(row[f"{key}_ci_low"], row[f"{key}_ci_high"], spec)
                  or (stats.NO_INTERVAL if n == 1 else ""))
      cells = [row["variant"], n, _format(row[f"{key}_mean"], spec),
               _format(row[f"{key}_sd"], spec), interval, _format(row[f"{key}_diff"], "+" + spec),
               _interval(row[f"{key}_diff_ci_low"], row[f"{key}_diff_ci_high"], "+" + spec),
               _format(row[f"{key}_p"], ".3g"), row[f"{key}_verdict"]]
      lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"


def _count(n) -> str:
  """12_345_678 -> '12.35M'; '' for None."""
  if n is None or n == "":
    return ""
  for unit, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6),
                     ("K", 1e3)):
    if n >= size:
      return f"{n / size:,.2f}{unit}"
  return f"{n:,.0f}"


def _mean_sd(row: dict, key: str, spec: str) -> str:
  """`mean +- sd` (the mean alone for one run)."""
  mean, sd = row[f"{key}_mean"], row[f"{key}_sd"]
  if mean is None:
    return ""
  return format(mean, spec) + ("" if sd is None else f" ± {sd:{spec}}")


def _cost_section(summary: list[dict]) -> str:
  """The section of each variant's size, compute and time."""
  lines = ["", "## Cost", "",
           "Per variant at train.num_steps: parameters (non-embedding: without the embedding, "
           "position tables and head), training FLOPs per token (6N + attention, "
           "model/accounting.py), tokens (steps x batch x seq_len) and training FLOPs; wall "
           "time of the training loop and tokens/s, mean ± sd over its finished runs.", "",
           "| variant | parameters | non-embedding | FLOPs/token | steps | tokens | training "
           "FLOPs | wall time (s) | tokens/s |", "|---|" + "---:|" * 8]
  for row in summary:
    cells = [row["variant"], _count(row.get("params")), _count(row.get("params_non_embedding")),
             _count(row.get("flops_per_token")), row["num_steps"], _count(row.get("tokens")),
             _count(row.get("flops")), _mean_sd(row, "wall_s", ".1f"),
             _mean_sd(row, "tokens_per_s", ",.0f")]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"
