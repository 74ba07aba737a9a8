"""A sweep's report: report.md; report.csv, one row per run (a variant and a
seed); report_summary.csv, one row per variant (its statistics over its seeds
against the baseline variant, `sweeps/stats.py`, its cost and KV cache per
token, and for a mixture of experts its experts' load); the
validation-curve plots (against steps, tokens and FLOPs), for a sweep of
learning rates the loss against the learning rate (`sweeps/lr_transfer.py`),
and each run's config history.

`rebuild_statistics` recomputes the statistics alone from report.csv, for a
report whose runs are gone (the checked-in ablations, docs/ablations/)."""
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
COST_COLUMNS = ("params", "params_non_embedding", "flops_per_token", "tokens", "flops",
                "kv_cache_bytes_per_token")
# Per-run measurements of the loop (metrics.jsonl), summarised like the metrics.
TIME_COLUMNS = ("wall_s", "tokens_per_s")
STAT_COLUMNS = (*(key for key, _, _ in REPORT_COLUMNS), *TIME_COLUMNS)
# A mixture of experts' balance per run, columns only where some run has it:
# key, title in report.md, format. expert_load: eval.py's on the whole
# validation split (eval_report.json, the most-loaded expert's share of the
# tokens over the mean share, averaged over the MoE layers; 1: even);
# train_expert_load: the mean of the train records' `expert_load` (the same,
# per training batch); moe_bias_abs: the last train record's mean |selection
# bias| (train.moe_bias_update_rate > 0).
LOAD_COLUMNS = (("expert_load", "experts' load, validation", ".3f"),
                ("train_expert_load", "experts' load, training mean", ".3f"),
                ("moe_bias_abs", "selection bias, mean abs", ".3g"))
# The load columns compared with the baseline like STAT_COLUMNS (where present).
LOAD_STAT_COLUMNS = ("expert_load", "train_expert_load")
# Whether a lower value is the better one, per statistics key (the verdict's word).
LOWER_IS_BETTER = {"loss": True, "perplexity": True, "token_accuracy": False,
                   "bits_per_byte": True, "wall_s": True, "tokens_per_s": False,
                   "expert_load": True, "train_expert_load": True}
STAT_FIELDS = ("n", "mean", "sd", "ci_low", "ci_high", "diff", "diff_ci_low", "diff_ci_high",
               "p", "holm_p", "verdict", "paired_diff", "paired_ci_low", "paired_ci_high",
               "paired_p", "paired_holm_p", "paired_verdict")
STATISTICS = "## Statistics over seeds"


def write_report(root: str, baseline: str | None = None) -> list[str]:
  """report.md, report.csv, report_summary.csv and the validation-curve PNGs;
  `baseline`: the variant the others are compared with (default: the first)."""
  manifest, runs = read_manifest(root)
  groups = list(dict.fromkeys(run.group for run in runs))
  baseline = baseline or groups[0]
  _check_baseline(baseline, groups, root)
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
  keys = _stat_keys(rows)
  loads = _present(rows, [key for key, _, _ in LOAD_COLUMNS])
  curves = {group: _mean_curve([(run, records[run.name]) for run in runs if run.group == group])
            for group in groups}
  curves = {group: curve for group, curve in curves.items() if curve}
  if curves:
    files.insert(0, os.path.join(root, "validation_curves.png"))
    band = " (band: min-max over seeds)" if manifest.get("seeds") else ""
    plot_against_steps_tokens_and_flops(
        files[0], f"{manifest['name']}: validation loss in training{band} (train.eval_steps "
        "batches; the table's val loss is the whole split)", curves)
  summary = _summaries(runs, rows, groups, baseline, keys)
  csv_path = os.path.join(root, "report.csv")
  _write_csv(csv_path, ["variant", "seed", "data_seed", *fields, "state", "step",
                        *(key for key, _, _ in REPORT_COLUMNS), *loads, *COST_COLUMNS,
                        *TIME_COLUMNS, "run"],
             [{**row, **{f: run.overrides.get(f, "") for f in fields}}
              for run, row in zip(runs, rows)])
  summary_path = os.path.join(root, "report_summary.csv")
  _write_csv(summary_path, ["variant", *fields, "runs", "num_steps", *COST_COLUMNS,
                            *(f"{key}_{s}" for key in loads if key not in keys
                              for s in ("mean", "sd")), *_stat_header(keys)],
             [{**row, **{f: group_runs[0].overrides.get(f, "") for f in fields}}
              for row, group_runs in summary])
  md_path = os.path.join(root, "report.md")
  length_section, length_files = write_length_table(
      root, [v.name for v in runs], [v.workdir for v in runs], [v.group for v in runs],
      [v.config["train"]["seq_len"] for v in runs if v.config])
  lr_section, lr_files = write_lr_section(
      root, summary, fields, {group: [r["loss"] for r in rows if r["variant"] == group
                                      and r["state"] == "done" and r.get("loss") is not None]
                              for group in groups})
  files = lr_files + files
  with open(md_path, "w", encoding="utf-8") as f:
    summary_rows = [row for row, _ in summary]
    f.write(_markdown(manifest, fields, runs, rows, files, root, histories,
                      _statistics_section(baseline, summary_rows) + lr_section
                      + _cost_section(summary_rows) + _load_section(summary_rows, loads))
            + length_section)
  return [md_path, csv_path, summary_path, *length_files, *files]


def rebuild_statistics(root: str, baseline: str | None = None) -> list[str]:
  """report_summary.csv's statistics and report.md's statistics section
  recomputed from report.csv alone (every run's seeds and metrics), the rest
  of both files kept: for a report whose runs are gone. `baseline`: default
  the one report_summary.csv names."""
  paths = [os.path.join(root, name) for name in ("report.csv", "report_summary.csv",
                                                 "report.md")]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise UserError(f"{missing[0]} is missing: --from_csv rebuilds the statistics of a report "
                    "that `sweep.py report` wrote; run that first")
  rows = _read_csv(paths[0])
  if rows and "data_seed" not in rows[0]:
    raise UserError(f"{paths[0]} has no data_seed column (written before it): add one, each "
                    "run's data.seed, or its seed where data.seed was unset")
  keys = _stat_keys(rows)
  for row in rows:
    for key in keys:
      row[key] = float(row[key]) if row.get(key) else None
  summary = _read_csv(paths[1])
  groups = [row["variant"] for row in summary]
  baseline = baseline or next((row["variant"] for row in summary
                               if row.get("loss_verdict") == stats.BASELINE), groups[0])
  _check_baseline(baseline, groups, root)
  columns = _statistics(rows, groups, baseline, keys)
  header = [c for c in _csv_header(paths[1])
            if not any(c.startswith(f"{key}_") for key in keys)]
  summary = [{**{c: row[c] for c in header}, **columns[row["variant"]]} for row in summary]
  with open(paths[2], encoding="utf-8") as f:
    md = f.read()
  start = md.find(f"\n{STATISTICS}\n")
  if start < 0:
    raise UserError(f"{paths[2]} has no \"{STATISTICS}\" section to rebuild; run `sweep.py "
                    "report` on the runs")
  end = md.find("\n## ", start + 1)
  section = _statistics_section(baseline, summary)
  md = md[:start] + section.rstrip("\n") + "\n" + (md[end:] if end >= 0 else "")
  _write_csv(paths[1], header + _stat_header(keys), summary)
  with open(paths[2], "w", encoding="utf-8") as f:
    f.write(md)
  return paths[1:]


def _check_baseline(baseline: str, groups: list[str], root: str) -> None:
  if baseline not in groups:
    raise UserError(f"--baseline {baseline}: no such variant in {root} (its variants: "
                    f"{', '.join(groups)})")


def _present(rows: list[dict], keys) -> list[str]:
  """Those of `keys` that some row has a value of."""
  return [key for key in keys if any(row.get(key) not in (None, "") for row in rows)]


def _stat_keys(rows: list[dict]) -> tuple[str, ...]:
  """The keys compared over seeds: STAT_COLUMNS, and LOAD_STAT_COLUMNS where
  some run (a `rows` entry) has them."""
  return (*STAT_COLUMNS, *_present(rows, LOAD_STAT_COLUMNS))


def _stat_header(keys) -> list[str]:
  return [f"{key}_{s}" for key in keys for s in STAT_FIELDS]


def _csv_header(path: str) -> list[str]:
  with open(path, encoding="utf-8", newline="") as f:
    return next(csv.reader(f))


def _read_csv(path: str) -> list[dict]:
  with open(path, encoding="utf-8", newline="") as f:
    return list(csv.DictReader(f))


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
    row["data_seed"] = config.data.seed if config.data.seed is not None else config.train.seed
    row.update(_cost(config, s.step or 0))
  row.update(_loads(report, records))
  seconds = [r["seconds"] for r in records if r["split"] == "train" and "seconds" in r]
  if seconds:
    row["wall_s"] = sum(seconds)
    if "tokens" in row:
      row["tokens_per_s"] = row["tokens"] / max(row["wall_s"], 1e-9)
  return row


def _cost(config, steps: int) -> dict:
  """Parameters (total, non-embedding), training FLOPs per token, the tokens
  and FLOPs of `steps` steps (`model/accounting.py`, as train.py's start-up
  summary counts them), and the KV cache's bytes per token of generation."""
  mtp_depth = config.train.get("mtp_depth", 0)
  params = accounting.formula_params(config.model, mtp_depth)
  per_token = accounting.flops_per_token(config.model, config.train.seq_len, train=True,
                                         mtp_depth=mtp_depth)
  tokens = steps * accounting.tokens_per_step(config.train)
  return {"params": params["params_total"],
          "params_non_embedding": params["params_total"] - params["params_embedding"],
          "flops_per_token": per_token, "tokens": tokens, "flops": per_token * tokens,
          "kv_cache_bytes_per_token": accounting.kv_cache_bytes_per_token(config.model)}


def _loads(report: dict, records: list[dict]) -> dict:
  """A mixture of experts' LOAD_COLUMNS from its eval_report.json and train
  records; {} for a dense run."""
  out = {}
  if report.get("expert_load"):
    out["expert_load"] = sum(report["expert_load"]) / len(report["expert_load"])
  train = [r["expert_load"] for r in records if r["split"] == "train" and "expert_load" in r]
  if train:
    out["train_expert_load"] = sum(train) / len(train)
  bias = [r["moe_bias_abs"] for r in records if r["split"] == "train" and "moe_bias_abs" in r]
  if bias:
    out["moe_bias_abs"] = bias[-1]
  return out


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


def _summaries(runs: list[Variant], rows: list[dict], groups: list[str], baseline: str,
               keys) -> list[tuple[dict, list[Variant]]]:
  """(report_summary.csv row, the variant's runs) per variant: its statistics
  over its finished runs against `baseline` (`_statistics` of `keys`), the
  mean and sd of the other LOAD_COLUMNS, and its cost at train.num_steps."""
  columns = _statistics(rows, groups, baseline, keys)
  for key in _present(rows, [key for key, _, _ in LOAD_COLUMNS if key not in keys]):
    for group in groups:
      s = stats.summarize([r[key] for r in rows if r["variant"] == group
                           and r["state"] == "done" and r.get(key) is not None])
      columns[group].update({f"{key}_mean": s.mean, f"{key}_sd": s.sd})
  out = []
  for group in groups:
    group_runs = [run for run in runs if run.group == group]
    row = {"variant": group, "runs": len(group_runs), "num_steps": group_runs[0].num_steps}
    config = _run_config(group_runs[0])
    if config is not None:
      row.update(_cost(config, group_runs[0].num_steps))
    out.append(({**row, **columns[group]}, group_runs))
  return out


def _paired(mine: list[dict], theirs: list[dict], key: str):
  """(the variant's values, the baseline's of the same seeds) of `key` when
  every finished run of the variant with a value has a partner in the
  baseline, a run with the same train.seed and data seed (so the same
  initialisation and data order); None otherwise."""
  def by_seed(rows):
    pairs = [((r["seed"], r.get("data_seed")), r[key]) for r in rows
             if r.get(key) is not None]
    keys = [k for k, _ in pairs]
    if any(None in k or "" in k for k in keys) or len(set(keys)) < len(keys):
      return None
    return dict(pairs)
  mine, theirs = by_seed(mine), by_seed(theirs)
  if mine is None or theirs is None or not mine or not set(mine) <= set(theirs):
    return None
  return list(mine.values()), [theirs[k] for k in mine]


def _statistics(rows: list[dict], groups: list[str], baseline: str,
                keys) -> dict[str, dict]:
  """{variant: its report_summary.csv statistics}: per metric of `keys` over its finished
  runs (`rows`: report.csv's rows, values as numbers or None), n, mean, sd and
  interval; against `baseline`, Welch's difference, interval, p, Holm's p over
  the variants, and the verdict; where the seeds pair, the same paired."""
  done = {group: [r for r in rows if r["variant"] == group and r["state"] == "done"]
          for group in groups}
  columns = {group: {} for group in groups}
  for key in keys:
    lower = LOWER_IS_BETTER[key]
    summaries = {group: stats.summarize([r[key] for r in done[group]
                                         if r.get(key) is not None]) for group in groups}
    welch, paired = {}, {}
    for group in groups:
      welch[group] = stats.compare(summaries[group], summaries[baseline], lower,
                                   is_baseline=group == baseline)
      pairs = None if group == baseline else _paired(done[group], done[baseline], key)
      paired[group] = stats.compare_paired(*pairs, lower) if pairs else stats.NONE
    holm = dict(zip(groups, stats.holm([welch[g].p for g in groups])))
    paired_holm = dict(zip(groups, stats.holm([paired[g].p for g in groups])))
    for group in groups:
      s, c, pc = summaries[group], welch[group], paired[group]
      columns[group].update({
          f"{key}_n": s.n, f"{key}_mean": s.mean, f"{key}_sd": s.sd, f"{key}_ci_low": s.low,
          f"{key}_ci_high": s.high, f"{key}_diff": c.diff, f"{key}_diff_ci_low": c.low,
          f"{key}_diff_ci_high": c.high, f"{key}_p": c.p, f"{key}_holm_p": holm[group],
          f"{key}_verdict": c.verdict, f"{key}_paired_diff": pc.diff,
          f"{key}_paired_ci_low": pc.low, f"{key}_paired_ci_high": pc.high,
          f"{key}_paired_p": pc.p, f"{key}_paired_holm_p": paired_holm[group],
          f"{key}_paired_verdict": pc.verdict})
  return columns


def _display(path: str) -> str:
  """A path relative to the repository when it lies inside it."""
  relative = os.path.relpath(path, REPO)
  return path if relative.startswith("..") else relative


def _format(value, spec: str) -> str:
  return "" if value is None or value == "" else format(value, spec)


def _markdown(manifest: dict, fields: list[str], runs: list[Variant], rows: list[dict],
              plots: list[str], root: str, histories: dict, sections: str) -> str:
  """The runs table (beside the metrics, the KV cache per token where a run
  has one, and the experts' load where runs have it), then `sections`, the
  config histories and the plots."""
  extra = [column for column in (*_KV_COLUMN, *LOAD_COLUMNS)
           if any(row.get(column[0]) for row in rows)]
  titles = ["variant", *fields, "state", "step",
            *(title for _, title, _ in (*REPORT_COLUMNS, *extra))]
  seeds = (f" Each variant {manifest['seeds']} times, train.seed 0..{manifest['seeds'] - 1} "
           "(runs `<variant>,seed=<k>`)." if manifest.get("seeds") else "")
  lines = [f"# Sweep {manifest['name']}", "",
           f"Config `{_display(manifest['config'])}`, sweep `{_display(manifest['sweep'])}`, "
           f"flags for every variant: `{' '.join(manifest['extra_flags']) or 'none'}`.{seeds} "
           "Metrics: eval.py over the whole validation split (eval_report.json).", "",
           "| " + " | ".join(titles) + " |",
           "|" + "---|" * (len(fields) + 3) + "---:|" * (len(REPORT_COLUMNS) + len(extra))]
  for run, row in zip(runs, rows):
    cells = [run.name, *(run.overrides.get(f, "") for f in fields), row["state"],
             "" if row["step"] is None else row["step"],
             *(_format(row.get(key), spec) for key, _, spec in (*REPORT_COLUMNS, *extra))]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  lines.append(sections.rstrip("\n"))
  if histories:
    lines += ["", "Config changes on resume (config_history.jsonl):", ""]
    lines += [f"- {name}, {line}" for name, entries in histories.items() for line in entries]
  lines += [""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots]
  return "\n".join(lines) + "\n"


# The runs table's KV-cache column (key, title, format).
_KV_COLUMN = (("kv_cache_bytes_per_token", "KV cache/token (B)", ","),)


def _bound(value: float, spec: str) -> str:
  """`value` in `spec`, or in two significant digits where `spec` would
  print a value that is not 0 as 0 (so an interval whose verdict says it
  excludes 0 never reads as touching it)."""
  text = format(value, spec)
  if value != 0 and float(text) == 0:
    text = format(value, ("+" if "+" in spec else "") + ".2g")
  return text


def _p(value) -> str:
  """A p-value in 3 significant digits, more where 3 would round it across
  stats.ALPHA (0.04998 never reads as 0.05)."""
  if value is None or value == "":
    return ""
  for digits in range(3, 13):
    text = format(value, f".{digits}g")
    if (float(text) < stats.ALPHA) == (value < stats.ALPHA):
      break
  return text


def _interval(low, high, spec: str) -> str:
  return "" if low is None else f"[{_bound(low, spec)}, {_bound(high, spec)}]"


def _statistics_section(baseline: str, summary: list[dict]) -> str:
  """The section of each metric's mean, sd and interval per variant, and its
  difference from the baseline: unpaired (Welch) and, where some variant's
  seeds pair with the baseline's, paired."""
  lines = ["", STATISTICS, "",
           "Per variant over its finished runs: n, mean, sample sd and the 95% interval of "
           f"the mean (Student t). Against the baseline `{baseline}`: the difference of means, "
           "its 95% interval (Welch-Satterthwaite df), Welch's two-sided p and Holm's p "
           "(adjusted over the variants compared with the baseline on that metric); where "
           "every seed of a variant has a partner in the baseline (the same train.seed and "
           "data seed), the paired comparison too: the mean of the per-seed differences, its "
           "95% interval (Student t), the paired t-test's p and Holm's p. Each verdict is "
           "that of the interval beside it: \"lower\" or \"higher\" (better or worse for "
           f"the metric) when it excludes 0, \"{stats.SAME}\" when it contains 0. The "
           "verdicts are per comparison; a Holm p of 0.05 or more marks a difference that "
           "does not hold for the family of comparisons. Formulas: docs/sweeps.md; all "
           "numbers in report_summary.csv."]
  if any(row.get("expert_load_n") or row.get("train_expert_load_n") for row in summary):
    lines[-1] += (" The experts' load (the most-loaded expert's tokens over the mean; 1: "
                  "even) counts lower as better.")
  for key, title, spec in (*REPORT_COLUMNS, *LOAD_COLUMNS):
    if not any(row.get(f"{key}_n") for row in summary):
      continue
    paired = any(row[f"{key}_paired_verdict"] for row in summary)
    titles = ["variant", "n", "mean", "sd", "95% interval", "diff vs baseline",
              "95% interval of diff", "p", "Holm p", "verdict"]
    if paired:
      titles += ["paired diff", "95% interval of paired diff", "paired p", "paired Holm p",
                 "paired verdict"]
    lines += ["", f"### {title}", "", "| " + " | ".join(titles) + " |",
              "|---|" + "---:|" * 3 + "---|---:|---|---:|---:|---|"
              + ("---:|---|---:|---:|---|" if paired else "")]
    for row in summary:
      n = row[f"{key}_n"]
      interval = (_interval(row[f"{key}_ci_low"], row[f"{key}_ci_high"], spec)
                  or (stats.NO_INTERVAL if n == 1 else ""))
      cells = [row["variant"], n, _format(row[f"{key}_mean"], spec),
               _format(row[f"{key}_sd"], spec), interval, _format(row[f"{key}_diff"], "+" + spec),
               _interval(row[f"{key}_diff_ci_low"], row[f"{key}_diff_ci_high"], "+" + spec),
               _p(row[f"{key}_p"]), _p(row[f"{key}_holm_p"]),
               row[f"{key}_verdict"]]
      if paired:
        cells += [_format(row[f"{key}_paired_diff"], "+" + spec),
                  _interval(row[f"{key}_paired_ci_low"], row[f"{key}_paired_ci_high"],
                            "+" + spec),
                  _p(row[f"{key}_paired_p"]), _p(row[f"{key}_paired_holm_p"]),
                  row[f"{key}_paired_verdict"]]
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
           "model/accounting.py), the KV cache's bytes per token in generation (all layers, "
           "model.dtype; `kv_cache_bytes_per_token`), tokens (steps x batch x seq_len) and "
           "training FLOPs; wall "
           "time of the training loop and tokens/s, mean ± sd over its finished runs.", "",
           "| variant | parameters | non-embedding | FLOPs/token | KV cache/token | steps | "
           "tokens | training FLOPs | wall time (s) | tokens/s |", "|---|" + "---:|" * 9]
  for row in summary:
    kv = row.get("kv_cache_bytes_per_token")
    cells = [row["variant"], _count(row.get("params")), _count(row.get("params_non_embedding")),
             _count(row.get("flops_per_token")), "" if kv is None else f"{kv:,} B",
             row["num_steps"], _count(row.get("tokens")),
             _count(row.get("flops")), _mean_sd(row, "wall_s", ".1f"),
             _mean_sd(row, "tokens_per_s", ",.0f")]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"


def _load_section(summary: list[dict], loads: list[str]) -> str:
  """The section of each variant's experts' load (LOAD_COLUMNS, mean ± sd
  over its finished runs); "" when no run has one."""
  columns = [column for column in LOAD_COLUMNS if column[0] in loads]
  if not columns:
    return ""
  lines = ["", "## Experts' load", "",
           "Per variant, mean ± sd over its finished runs. Experts' load: the most-loaded "
           "expert's share of the tokens over the mean share (1: even; E / k at most), averaged "
           "over the MoE layers, on the whole validation split at the end (eval.py) and over "
           "the training batches (the train records' `expert_load`, their mean); selection "
           "bias: the mean |b| of auxiliary-loss-free balancing's per-expert biases at the "
           "last train record (`moe_bias_abs`).", "",
           "| variant | " + " | ".join(title for _, title, _ in columns) + " |",
           "|---|" + "---:|" * len(columns)]
  for row in summary:
    cells = [row["variant"], *(_mean_sd(row, key, spec) for key, _, spec in columns)]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"
