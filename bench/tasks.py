"""Every documented task result over seeds: train, evaluate, aggregate, render.

  python -m bench.tasks [--seeds 5] [--only seq2seq_reverse --only addition]
      [--threads 1,2] [--launcher local|slurm] [--root runs/bench/tasks] [--write_docs]
      [--config.train.num_steps=20 ...]   # overrides for every preset (smoke runs)
  python -m bench.tasks --docs_only       # docs/tasks.md from bench/results/tasks.json

Each task preset of docs/tasks.md (`PRESETS`) is one sweep of the sweep
machinery (`sweeps/`, as `sweep.py run` makes it): its `--seeds` runs
(train.seed 0..N-1) in `<root>/<preset>/base,seed=<k>`, or with `--threads`
one group per thread count, `PJRT_NPROC=<t>,seed=<k>` (XLA's CPU client takes
its thread count from PJRT_NPROC; without --threads the runs use every CPU
they may run on). Each run is train.py then eval.py (its default beam 4 and
length penalty 0.6, every held-out example); a finished run (its
eval_report.json at train.num_steps) is skipped, an unfinished one resumed,
and `sweep.py status --root <root>/<preset>` follows them. `--launcher slurm`
submits one job array per preset and returns; run the same command again
once they are done to collect them.

Collected into `--out` (bench/results/tasks.json, per preset, replacing only
the presets run): each run's figures from eval_report.json (`FIGURES`), the
wall and CPU seconds of its train.py and eval.py (`sweep_times.jsonl`: as
`time` counts them, start-up included) and the machine and XLA thread count
it ran with; and per thread count and figure the mean, min, max, sd, n and
95% interval of the mean over the finished seeds (`sweeps/stats.py`).
`--write_docs` (or `--docs_only`, which trains nothing) renders each preset
into docs/tasks.md between `<!-- bench.tasks:begin NAME -->` and
`<!-- bench.tasks:end NAME -->`, and one table row per measured preset into the
README's headline numbers (the block named `headlines`);
tests/test_bench_tasks.py holds both equal to the rendering of the checked-in
JSON.
"""
import datetime
import json
import os
import pathlib
import re
import sys
import textwrap

from absl import app, flags, logging

from bench.bench_utils import command_line, git_commit
from configs.cli import OVERRIDE, parse_flags
from configs.errors import UserError
import sweeps as sweep_lib
from sweeps.common import command_exits
from sweeps import stats
from training import hardware
from training.workdir import describe_changes

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS

# The task presets (configs/<name>.py), in docs/tasks.md's order, and the figures
# their tables there show.
SYNTHETIC = ("exact_match_greedy", "exact_match_beam", "chrf_greedy")
PRESETS = {
    "seq2seq_reverse": SYNTHETIC,
    "seq2seq_reverse_decoder": SYNTHETIC,
    "code_summary": ("bleu_greedy", "bleu_beam", "chrf_greedy", "chrf_beam"),
    "bert_mlm": ("masked_token_accuracy", "loss"),
    "addition": SYNTHETIC,
    "classify_encoder": ("accuracy", "macro_f1"),
    "classify_decoder": ("accuracy", "macro_f1"),
}
# Per objective, each figure's place in eval_report.json.
FIGURES = {
    "seq2seq": {"exact_match_greedy": ("greedy", "exact_match"),
                "exact_match_beam": ("beam", "exact_match"),
                "bleu_greedy": ("greedy", "bleu"), "bleu_beam": ("beam", "bleu"),
                "chrf_greedy": ("greedy", "chrf"), "chrf_beam": ("beam", "chrf"),
                "loss": ("loss",), "token_accuracy": ("token_accuracy",)},
    "mlm": {"masked_token_accuracy": ("masked_token_accuracy",), "loss": ("loss",),
            "unigram_accuracy": ("unigram_accuracy",)},
    "classify": {"accuracy": ("accuracy",), "macro_f1": ("macro_f1",), "loss": ("loss",)},
}
TIMES = ("train_wall_s", "train_cpu_s", "eval_wall_s", "eval_cpu_s")
# Column titles and formats of the docs tables (times: `_duration`).
TITLES = {"exact_match_greedy": ("exact match greedy", ".3f"),
          "exact_match_beam": ("exact match beam 4", ".3f"),
          "bleu_greedy": ("BLEU greedy", ".2f"), "bleu_beam": ("BLEU beam 4", ".2f"),
          "chrf_greedy": ("chrF greedy", ".2f"), "chrf_beam": ("chrF beam 4", ".2f"),
          "masked_token_accuracy": ("masked-token accuracy", ".3f"), "loss": ("loss", ".3f"),
          "accuracy": ("accuracy", ".3f"), "macro_f1": ("macro-F1", ".3f"),
          "train_wall_s": ("train wall", None), "train_cpu_s": ("train CPU", None)}
DOC_TIMES = ("train_wall_s", "train_cpu_s")
# The README's headline line of each preset: what the task is (its first figure is shown).
HEADLINES = {"seq2seq_reverse": "Reversing strings, encoder-decoder",
             "seq2seq_reverse_decoder": "Reversing strings, prefix LM",
             "code_summary": "Code summarisation", "bert_mlm": "Masked LM",
             "addition": "Addition, prefix LM",
             "classify_encoder": "Package classification, encoder",
             "classify_decoder": "Package classification, decoder"}
HEADLINE_BLOCK = "headlines"
THREADS_VAR = hardware.XLA_THREAD_VARS[0]  # PJRT_NPROC
BEGIN, END = "<!-- bench.tasks:begin {} -->", "<!-- bench.tasks:end {} -->"
BLOCK = re.compile(r"<!-- bench\.tasks:begin (\S+) -->\n(.*?)<!-- bench\.tasks:end (\S+) -->",
                   re.DOTALL)


def _define_flags() -> None:
  """The command's flags, defined when it runs (importing this module, as the
  tests do, defines none)."""
  flags.DEFINE_integer("seeds", 5, "Runs per preset (and thread count): train.seed 0..N-1.",
                       lower_bound=1)
  flags.DEFINE_multi_string("only", [], f"Presets to run (repeat or comma-separate; default "
                            f"all): {', '.join(PRESETS)}.")
  flags.DEFINE_list("threads", [], "XLA CPU thread counts (PJRT_NPROC), one group of seeds "
                    "each; default: not set (every CPU a run may use).")
  flags.DEFINE_enum("launcher", "local", ["local", "slurm"], "Where the runs train.")
  flags.DEFINE_string("root", "runs/bench/tasks", "The runs: <root>/<preset>/<run>.")
  flags.DEFINE_integer("parallel", 1, "Runs at once (local processes, or the SLURM array's "
                       "%N).", lower_bound=1)
  flags.DEFINE_bool("dry_run", False, "Print the runs' commands; run nothing.")
  flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "tasks.json"), "The JSON.")
  flags.DEFINE_bool("write_docs", False, "Render the JSON's tables into --docs.")
  flags.DEFINE_bool("docs_only", False, "Render --out into --docs; train nothing.")
  flags.DEFINE_string("docs", str(ROOT / "docs" / "tasks.md"), "The page of the tables.")
  flags.DEFINE_string("readme", str(ROOT / "README.md"), "The page of the headline lines.")
  flags.DEFINE_string("partition", None, "SLURM: partition.")
  flags.DEFINE_string("account", None, "SLURM: account to charge.")
  flags.DEFINE_integer("cpus_per_task", 2, "SLURM: CPUs per run.")
  flags.DEFINE_integer("gpus_per_node", 0, "SLURM: GPUs per run (the presets are CPU-sized).")
  flags.DEFINE_integer("mem_gb", 0, "SLURM: memory per run, GB (0: the cluster's default).",
                       lower_bound=0)
  flags.DEFINE_integer("timeout_min", 120, "SLURM: time limit of a run, minutes.")
  flags.DEFINE_multi_string("slurm_setup", [], "SLURM: shell line before srun.")


def presets(only: list[str]) -> list[str]:
  """The presets `--only` names (comma-separated or repeated), in PRESETS order."""
  names = [n.strip() for value in only for n in value.split(",") if n.strip()]
  unknown = [n for n in names if n not in PRESETS]
  if unknown:
    raise UserError(f"--only {unknown[0]}: no such task preset; the presets: "
                    f"{', '.join(PRESETS)}")
  return [n for n in PRESETS if n in names] if names else list(PRESETS)


def thread_counts(values: list[str]) -> list[int | None]:
  """--threads as integers (None: not set)."""
  if not values:
    return [None]
  if not all(v.strip().isdigit() and int(v) > 0 for v in values):
    raise UserError(f"--threads {','.join(values)}: positive integers, e.g. --threads 1,2")
  return list(dict.fromkeys(int(v) for v in values))


def plan(name: str, root: str, seeds: int, threads: list[int | None],
         overrides: list[str]) -> tuple[sweep_lib.Sweep, str, list[sweep_lib.Variant]]:
  """The preset's sweep, config path and runs (every seed of every thread
  count), validated as train.py will validate them."""
  config = str(ROOT / "configs" / f"{name}.py")
  sweep = sweep_lib.Sweep(str(ROOT / "bench" / "tasks.py"), name, config, [{}], seeds)
  sweep_lib.check_seeds(root, seeds)
  variants = []
  for t in threads:
    try:
      variants += sweep_lib.make_variants(sweep, config, overrides, root, seeds,
                                          env={THREADS_VAR: t} if t else None)
    except UserError as e:
      raise UserError(f"{name}: {e}") from e
  return sweep, config, variants


def _changed(name: str, root: str, variants: list[sweep_lib.Variant]) -> None:
  """UserError when a run of `root` was trained with another config than asked."""
  for variant in variants:
    fields = sweep_lib.changed_fields(variant)
    if fields:
      raise UserError(f"{name}: {variant.name} in {root} was trained with another config "
                      f"({describe_changes(fields)}); use a new --root")


def _figures(objective: str, report: dict) -> dict:
  out = {}
  for key, path in FIGURES[objective].items():
    value = report
    for part in path:
      value = value.get(part) if isinstance(value, dict) else None
    if value is not None:
      out[key] = value
  return out


def run_record(variant: sweep_lib.Variant, objective: str) -> dict:
  """One run: its state, figures (when done), times and machine."""
  state = sweep_lib.variant_state(variant)
  times = sweep_lib.read_times(variant.workdir)
  record = {"run": variant.name, "seed": variant.seed,
            "threads": int(variant.env[THREADS_VAR]) if THREADS_VAR in variant.env else None,
            "state": state.state, "step": state.step}
  if state.state == "done":
    record["figures"] = _figures(objective, state.report)
  elif state.state != "not started":
    record["detail"] = state.detail
  for command in ("train", "eval"):
    ran = [t for t in times if t["command"] == f"{command}.py"]
    if ran:
      record[f"{command}_wall_s"] = round(sum(t["wall_s"] for t in ran), 3)
      cpu = [t["cpu_s"] for t in ran]
      record[f"{command}_cpu_s"] = None if None in cpu else round(sum(cpu), 3)
      record[f"{command}_invocations"] = len(ran)
  train = [t for t in times if t["command"] == "train.py"]
  if train:
    last = train[-1]
    record.update(started=train[0]["started"], xla_threads=last["xla_cpu_threads"],
                  machine={k: last[k] for k in ("host", "cpu_model", "cpus")})
  else:
    record["xla_threads"] = record["threads"]
  return record


def aggregate(values: list[float]) -> dict:
  """n, mean, min, max, sample sd and the 95% interval of the mean (Student t;
  None where n is too small)."""
  s = stats.summarize(values)
  return {"n": s.n, "mean": s.mean, "min": min(values) if values else None,
          "max": max(values) if values else None, "sd": s.sd, "ci_low": s.low,
          "ci_high": s.high}


def summarize(runs: list[dict], objective: str) -> list[dict]:
  """Per XLA thread count (the runs' order), each figure's and time's aggregate
  over the finished runs."""
  done = [r for r in runs if r["state"] == "done"]
  groups = []
  for threads in dict.fromkeys(r["xla_threads"] for r in done):
    group = [r for r in done if r["xla_threads"] == threads]
    values = {key: [r["figures"][key] for r in group if key in r["figures"]]
              for key in FIGURES[objective]}
    values.update({key: [r[key] for r in group if r.get(key) is not None] for key in TIMES})
    groups.append({"xla_threads": threads, "runs": len(group),
                   "figures": {key: aggregate(v) for key, v in values.items() if v}})
  return groups


def preset_result(name: str, config: str, variants: list[sweep_lib.Variant], seeds: int,
                  threads: list[int | None], overrides: list[str], root: str) -> dict:
  objective = variants[0].config["train"]["objective"]
  runs = [run_record(v, objective) for v in variants]
  machines = [dict(m) for m in {tuple(sorted(r["machine"].items())) for r in runs
                                if "machine" in r}]
  return {"config": os.path.relpath(config, ROOT), "objective": objective,
          "command": command_line(), "commit": git_commit(),
          "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "root": root, "overrides": overrides, "seeds": seeds,
          "threads": [t for t in threads if t], "num_steps": variants[0].num_steps,
          "machines": sorted(machines, key=lambda m: m["host"]), "runs": runs,
          "summary": summarize(runs, objective)}


def write_results(path: str, results: dict) -> dict:
  """Merges `results` (preset -> result) into the JSON at `path`; returns it."""
  data = {"presets": {}}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  merged = {**data["presets"], **results}
  data["presets"] = {name: merged[name] for name in PRESETS if name in merged}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  os.replace(path + ".tmp", path)
  return data


# The docs tables.

def _duration(seconds: float, key: str) -> str:
  if key.endswith("_cpu_s") or seconds < 60:
    return f"{seconds:,.0f} s"
  minutes, rest = divmod(round(seconds), 60)
  return f"{minutes} min {rest:02d} s"


def _value(value: float, key: str) -> str:
  fmt = TITLES[key][1]
  return _duration(value, key) if fmt is None else format(value, fmt)


def _cell(summary: dict | None, key: str) -> str:
  if not summary:
    return "–"
  if summary["n"] == 1:
    return _value(summary["mean"], key)
  return (f"{_value(summary['mean'], key)} ({_value(summary['min'], key)}–"
          f"{_value(summary['max'], key)})")


def _machine(machines: list[dict]) -> str:
  if not machines:
    return "an unrecorded machine"
  return "; ".join(f"{m['cpu_model'] or 'unknown CPU'} ({m['cpus']} CPUs usable)"
                   for m in machines)


def render_block(name: str, result: dict | None) -> str:
  """The markdown between the preset's markers: its table of mean (min–max)
  and n per thread count, and where the numbers come from."""
  if result is None:
    return ("Over seeds: not measured yet; `python -m bench.tasks --write_docs` writes the\n"
            "mean, min–max and n over 5 seeds here.")
  keys = list(PRESETS[name]) + list(DOC_TIMES)
  lines = ["| XLA threads | seeds (n) | " + " | ".join(TITLES[k][0] for k in keys) + " |",
           "|---:|---:|" + "---:|" * len(keys)]
  for group in result["summary"]:
    lines.append(f"| {group['xla_threads'] if group['xla_threads'] is not None else '?'} | "
                 f"{group['runs']} | "
                 + " | ".join(_cell(group["figures"].get(k), k) for k in keys) + " |")
  if not result["summary"]:
    lines.append("| | 0 | " + " | ".join("–" for _ in keys) + " |")
  failed = [r["run"] for r in result["runs"] if r["state"] != "done"]
  seeds = result["seeds"]
  head = (f"Over seeds: mean (min–max) of {seeds} runs per row, `train.seed` 0..{seeds - 1}, "
          f"{result['num_steps']:,} steps each; train times as `time` counts train.py "
          "(start-up included). "
          + (f"Not finished: {', '.join(failed)}. " if failed else "")
          + f"`{result['command']}` at commit {result['commit']}, {result['date'][:10]}, on "
          f"{_machine(result['machines'])}; every run in `bench/results/tasks.json`.")
  head = textwrap.fill(head, width=92, break_long_words=False, break_on_hyphens=False)
  return head + "\n\n" + "\n".join(lines)


def read_blocks(text: str) -> dict:
  """name -> the text between its markers (one block per name)."""
  blocks = {}
  for match in BLOCK.finditer(text):
    name, body, end = match.groups()
    if end != name or name in blocks:
      raise UserError(f"bench.tasks block {name}: ends as {end} or comes twice")
    blocks[name] = body
  return blocks


def _fill_blocks(text: str, render) -> str:
  """`text` with the body of every block replaced by `render(its name)`."""
  return BLOCK.sub(lambda m: f"{BEGIN.format(m[1])}\n{render(m[1])}\n{END.format(m[1])}", text)


def render_docs(text: str, results: dict) -> str:
  """`text` with every preset's block rendered from `results` (preset -> result;
  a preset not in it gets the not-measured line)."""
  blocks = read_blocks(text)
  missing = [name for name in PRESETS if name not in blocks]
  unknown = [name for name in blocks if name not in PRESETS]
  if missing or unknown:
    raise UserError(f"the page's bench.tasks blocks: missing {', '.join(missing) or 'none'}, "
                    f"unknown {', '.join(unknown) or 'none'}; one per preset: "
                    + BEGIN.format("NAME") + " ... " + END.format("NAME"))
  return _fill_blocks(text, lambda name: render_block(name, results.get(name)))


def render_headlines(results: dict) -> str:
  """The README's task lines: one table row per measured preset, its first
  figure's mean and min–max over every finished run (all thread counts
  together), the command that reruns it and the commit; the machine once
  above the table when every preset ran on the same one, else per row."""
  rows = []
  for name, result in results.items():
    key = PRESETS[name][0]
    values = [r["figures"][key] for r in result["runs"]
              if r["state"] == "done" and key in r["figures"]]
    if not values:
      continue
    figure = aggregate(values)
    threads = result["threads"]
    rerun = f"python -m bench.tasks --only {name}" + (
        f" --threads {','.join(map(str, threads))}" if threads else "")
    runs = (f"{figure['n']}: {result['seeds']} seeds x "
            f"{' and '.join(map(str, threads)) or 'every'} thread{'s' * (threads != [1])}")
    rows.append((_machine(result["machines"]),
                 f"{HEADLINES[name]} (`{result['config']}`)",
                 f"{TITLES[key][0]} {_value(figure['mean'], key)} "
                 f"({_value(figure['min'], key)}–{_value(figure['max'], key)})",
                 runs, f"`{rerun}`", result["commit"]))
  if not rows:
    return ("- **Tasks over seeds**: not measured yet; `python -m bench.tasks --write_docs`\n"
            "  writes one row per task preset here.")
  machines = list(dict.fromkeys(row[0] for row in rows))
  one_machine = len(machines) == 1
  head = ("- **Every task preset over seeds** (mean (min–max) over the runs, XLA threads "
          "as listed" + (f"; {machines[0]}" if one_machine else "") + "; per run and figure: "
          "[docs/tasks.md](docs/tasks.md#every-task-over-seeds)):")
  titles = ["task", "figure", "runs", "command", "commit"] + ([] if one_machine else ["machine"])
  lines = [textwrap.fill(head, width=78, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False), "",
           "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
  for machine, *cells in rows:
    lines.append("| " + " | ".join(cells + ([] if one_machine else [machine])) + " |")
  return "\n".join(lines) + "\n"


def render_readme(text: str, results: dict) -> str:
  """`text` with its headline block rendered from `results`."""
  blocks = read_blocks(text)
  if list(blocks) != [HEADLINE_BLOCK]:
    raise UserError(f"the README needs one bench.tasks block, {BEGIN.format(HEADLINE_BLOCK)}"
                    f" ... {END.format(HEADLINE_BLOCK)}; it has {', '.join(blocks) or 'none'}")
  return _fill_blocks(text, lambda _: render_headlines(results))


def write_docs(docs: str, out: str, readme: str) -> None:
  """Renders the JSON at `out` into the page `docs` and the README's headlines."""
  if not os.path.exists(out):
    raise UserError(f"--out {out}: no such file; run python -m bench.tasks first")
  with open(out, encoding="utf-8") as f:
    results = json.load(f)["presets"]
  for path, render in ((docs, render_docs), (readme, render_readme)):
    text = pathlib.Path(path).read_text(encoding="utf-8")
    pathlib.Path(path).write_text(render(text, results), encoding="utf-8")
    print(f"wrote {path}")


# The command.

def run(overrides: list[str]) -> int:
  names = presets(FLAGS.only)
  threads = thread_counts(FLAGS.threads)
  planned = {}
  for name in names:  # every run's config checked before any trains
    root = os.path.join(FLAGS.root, name)
    planned[name] = (root, *plan(name, root, FLAGS.seeds, threads, overrides))
  if FLAGS.dry_run:
    for _, _, _, variants in planned.values():
      print("\n".join(sweep_lib.describe(variants)))
    return 0
  todo = {}
  for name, (root, sweep, config, variants) in planned.items():
    _changed(name, root, variants)
    sweep_lib.write_manifest(root, sweep, config, overrides, variants, FLAGS.seeds)
    todo[name] = sweep_lib.unfinished(variants)
  if FLAGS.launcher == "slurm" and any(todo.values()):
    return _submit(planned, todo)
  failures = sweep_lib.run_local([v for vs in todo.values() for v in vs], FLAGS.parallel)
  results = {name: preset_result(name, config, variants, FLAGS.seeds, threads, overrides, root)
             for name, (root, _, config, variants) in planned.items()}
  write_results(FLAGS.out, results)
  for name, result in results.items():
    print(f"\n{name}:\n{render_block(name, result)}")
  print(f"\nwrote {FLAGS.out}")
  if FLAGS.write_docs:
    write_docs(FLAGS.docs, FLAGS.out, FLAGS.readme)
  return 1 if failures else 0


def _submit(planned: dict, todo: dict) -> int:
  """One SLURM job array per preset with unfinished runs."""
  params = {name: sweep_lib.slurm_parameters(
      f"tasks-{name}", nodes=1, tasks_per_node=1, gpus_per_node=FLAGS.gpus_per_node,
      cpus_per_task=FLAGS.cpus_per_task, timeout_min=FLAGS.timeout_min,
      partition=FLAGS.partition, account=FLAGS.account, parallel=FLAGS.parallel,
      setup=FLAGS.slurm_setup, mem_gb=FLAGS.mem_gb) for name in todo if todo[name]}
  sweep_lib.check_fits(next(iter(params.values())))
  for name, p in params.items():
    root = planned[name][0]
    jobs = sweep_lib.submit_slurm(todo[name], os.path.join(root, "slurm"), p, max_timeouts=3)
    for job, variant in zip(jobs, todo[name]):
      print(f"submitted {job.job_id}  {name}/{variant.name}")
  print("once they are done, run the same command again to collect them (follow with python "
        f"sweep.py status --root {FLAGS.root}/<preset>)")
  return 0


def _parse(argv: list[str]) -> list[str]:
  """parse_flags on the flags; main gets the --config.* overrides (checked
  against each preset's config when its runs are made)."""
  overrides = [arg for arg in argv[1:] if arg.startswith(OVERRIDE)]
  return parse_flags([a for a in argv if a not in overrides]) + overrides


def main(argv):
  logging.set_verbosity(logging.WARNING)
  overrides = argv[1:]
  bad = [arg for arg in overrides if not arg.startswith(OVERRIDE) or "=" not in arg]
  with command_exits("runs"):
    if bad:
      raise UserError(f"{bad[0]}: unexpected argument; overrides are --config.a.b=value")
    if FLAGS.docs_only:
      if overrides:
        raise UserError("--docs_only takes no --config.* overrides")
      write_docs(FLAGS.docs, FLAGS.out, FLAGS.readme)
      return
    sys.exit(run(overrides))


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=_parse)
