"""Ablation sweeps: named variants of a config, run locally or on SLURM, reported.

A sweep file (`configs/sweeps/*.py`) defines `get_sweep()`, returning either a
grid, `{"model.pos_emb": ["none", "rope"], "model.norm_position": ["pre",
"post"]}` (every combination; the first field varies slowest), or a list of
override dicts (one variant each). It may also set `NAME` (default: the file's
name) and `CONFIG` (the base config used when `--config` is not given).

Each variant is named after its overrides (`pos_emb=rope,norm_position=pre`)
and is two commands run in `<root>/<name>`: `train.py` (which resumes from the
workdir) and, once training has reached `train.num_steps`, `eval.py`. Every
variant's config is resolved and validated exactly as train.py will do it
before anything starts. Running a sweep again skips the finished variants and
resumes the others.

`<root>/sweep.json`               the variants and their commands (written by run)
`<root>/<name>/sweep.log`         the output of the variant's train.py and eval.py
`<root>/<name>/sweep_error.json`  the failed command and its last line of output
`<root>/slurm/`                   submitit's job files and logs
`<root>/report.md`, `report.csv`, `validation_curves.png`, `curves/<name>.png`
"""
import concurrent.futures
import csv
import dataclasses
import difflib
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from absl import flags
from matplotlib.figure import Figure
from ml_collections import config_dict, config_flags
import submitit
from submitit.slurm import slurm as submitit_slurm

from configs.errors import UserError
from configs.validation import validate
from training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "sweep.json"
LOG = "sweep.log"
ERROR = "sweep_error.json"
VALUE_TYPES = (str, int, float, bool)
STOP_TIMEOUT_S = 60  # how long checkpoint() waits for train.py to save and exit
# eval_report.json keys, their column titles in report.md and their formats.
REPORT_COLUMNS = (("loss", "val loss", ".4f"), ("perplexity", "perplexity", ".2f"),
                  ("token_accuracy", "token accuracy", ".4f"),
                  ("bits_per_byte", "bits per byte", ".4f"))


@dataclasses.dataclass
class Sweep:
  """A loaded sweep file: its name, its CONFIG (or None), one dict per variant."""
  path: str
  name: str
  config: str | None
  overrides: list[dict]


@dataclasses.dataclass
class Variant:
  """One run of a sweep: the fields it sets and the two commands that run it."""
  name: str
  overrides: dict
  workdir: str
  num_steps: int
  train_command: list[str]
  eval_command: list[str]


@dataclasses.dataclass
class State:
  """Where a variant stands: `not started`, `running/partial`, `done` or `failed`."""
  state: str
  step: int | None  # the last step in metrics.jsonl, or the evaluated step when done
  detail: str
  report: dict | None  # eval_report.json when done


class VariantFailed(Exception):
  """train.py or eval.py of a variant exited with an error (see its sweep.log)."""


def _first_line(error: BaseException) -> str:
  text = str(error).strip().strip("\"'")
  return text.splitlines()[0] if text else type(error).__name__


def load_sweep(path: str) -> Sweep:
  """Imports a sweep file and expands its `get_sweep()` into override dicts."""
  if not os.path.isfile(path):
    raise UserError(f"--sweep {path}: no such file")
  spec = importlib.util.spec_from_file_location("sweep_file", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    sweep = module.get_sweep()
  except Exception as e:  # pylint: disable=broad-except  # any mistake in the user's file
    raise UserError(f"--sweep {path}: cannot load it ({type(e).__name__}: {_first_line(e)})")
  name = getattr(module, "NAME", os.path.splitext(os.path.basename(path))[0])
  return Sweep(path, name, getattr(module, "CONFIG", None), expand(sweep, f"sweep {path}"))


def with_default_config(argv: list[str]) -> list[str]:
  """Command-line arguments with `--config=<the sweep file's CONFIG>` added when
  they name a --sweep but no --config."""
  if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
    return argv
  path = None
  for arg, following in zip(argv, argv[1:] + [None]):
    if arg.startswith("--sweep="):
      path = arg[len("--sweep="):]
    elif arg == "--sweep":
      path = following
  config = load_sweep(path).config if path else None
  return argv if config is None else [argv[0], f"--config={config}", *argv[1:]]


def expand(sweep, where: str) -> list[dict]:
  """A grid (field -> list of values) or a list of override dicts -> one dict per variant."""
  if isinstance(sweep, dict):
    if not sweep:
      raise UserError(f"{where}: get_sweep() returned an empty grid")
    for field, values in sweep.items():
      if not isinstance(values, (list, tuple)) or not values:
        raise UserError(f"{where}: grid field {field} needs a non-empty list of values, "
                        f"not {values!r}")
    variants = [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())]
  elif isinstance(sweep, (list, tuple)):
    if not sweep:
      raise UserError(f"{where}: get_sweep() returned an empty list")
    for overrides in sweep:
      if not isinstance(overrides, dict):
        raise UserError(f"{where}: each variant must be a dict of field -> value, "
                        f"not {overrides!r}")
    variants = [dict(overrides) for overrides in sweep]
  else:
    raise UserError(f"{where}: get_sweep() must return a grid (dict) or a list of dicts, "
                    f"not {type(sweep).__name__}")
  for overrides in variants:
    for field, value in overrides.items():
      if not isinstance(value, VALUE_TYPES):
        raise UserError(f"{where}: {field}={value!r}: a value must be a str, int, float or bool")
  return variants


def format_value(value) -> str:
  """A value as a `--config.<field>=` flag takes it."""
  if isinstance(value, bool):
    return "true" if value else "false"
  return str(value)


def _path_safe(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def variant_name(overrides: dict) -> str:
  """`pos_emb=rope,norm_position=pre`: each field by its last part (all of it when
  two fields share the last part); characters unsafe in a path become `_`."""
  if not overrides:
    return "base"
  lasts = [field.rsplit(".", 1)[-1] for field in overrides]
  return ",".join(f"{_path_safe(last if lasts.count(last) == 1 else field)}="
                  f"{_path_safe(format_value(value))}"
                  for (field, value), last in zip(overrides.items(), lasts))


def load_config(config_path: str, config_flags_: list[str]) -> config_dict.ConfigDict:
  """The config train.py builds from `--config config_path *config_flags_` (the
  same ml_collections parser, so what passes here passes there)."""
  argv = ["train.py", "--config", config_path, *config_flags_]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=values,
                                           lock_config=True, sys_argv=argv)
  try:
    values(argv)
    return holder.value
  except OSError as e:
    raise UserError(f"--config {config_path}: cannot load it ({_first_line(e)})")
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UserError(_first_line(e))


def _fields(config: config_dict.ConfigDict, prefix: str = "") -> list[str]:
  """Every leaf field of a config, dotted."""
  out = []
  for key, value in config.items():
    if isinstance(value, config_dict.ConfigDict):
      out += _fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def _check_field(field: str, fields: list[str], where: str) -> None:
  if field not in fields:
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(f"{where}: {field}: no such config field{hint}")


def make_variants(sweep: Sweep, config_path: str, extra_flags: list[str],
                  root: str) -> list[Variant]:
  """Named, validated variants; `extra_flags` (`--config.a.b=v`) apply to all."""
  fields = _fields(load_config(config_path, []))
  extra_fields = [flag[len("--config."):].split("=", 1)[0] for flag in extra_flags]
  for field in extra_fields:
    _check_field(field, fields, "command line")
  variants = []
  for overrides in sweep.overrides:
    for field in overrides:
      _check_field(field, fields, f"sweep {sweep.path}")
      if field in extra_fields:
        raise UserError(f"{field} is set both by sweep {sweep.path} and on the command line")
    name = variant_name(overrides)
    config_flags_ = extra_flags + [f"--config.{field}={format_value(value)}"
                                   for field, value in overrides.items()]
    try:
      config = load_config(config_path, config_flags_)
      validate(config)
    except UserError as e:
      raise UserError(f"variant {name}: {e}") from e
    workdir = os.path.join(os.path.abspath(root), name)
    variants.append(Variant(
        name, overrides, workdir, config.train.num_steps,
        train_command=[sys.executable, os.path.join(REPO, "train.py"), "--config",
                       os.path.abspath(config_path), "--workdir", workdir, *config_flags_],
        eval_command=[sys.executable, os.path.join(REPO, "eval.py"), "--workdir", workdir]))
  names = [v.name for v in variants]
  for name in names:
    if names.count(name) > 1:
      raise UserError(f"sweep {sweep.path}: {names.count(name)} variants are named {name} "
                      "(the same overrides?)")
  return variants


def _write_json(path: str, obj) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def _read_json(path: str) -> dict | None:
  """The file's JSON, or None when it is missing or half-written."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def write_manifest(root: str, sweep: Sweep, config_path: str, extra_flags: list[str],
                   variants: list[Variant]) -> None:
  os.makedirs(root, exist_ok=True)
  _write_json(os.path.join(root, MANIFEST), {
      "name": sweep.name, "sweep": os.path.abspath(sweep.path),
      "config": os.path.abspath(config_path), "extra_flags": extra_flags,
      "variants": [dataclasses.asdict(v) for v in variants]})


def read_manifest(root: str) -> tuple[dict, list[Variant]]:
  """The sweep in `root` and its variants (workdirs under `root` as it is now)."""
  manifest = _read_json(os.path.join(root, MANIFEST))
  if manifest is None:
    raise UserError(f"--root {root}: not a sweep (no {MANIFEST}); start one with "
                    "python sweep.py run --sweep ... --root ...")
  variants = [dataclasses.replace(Variant(**v), workdir=os.path.join(root, v["name"]))
              for v in manifest["variants"]]
  return manifest, variants


def variant_state(variant: Variant) -> State:
  error = _read_json(os.path.join(variant.workdir, ERROR))
  steps = [r["step"] for r in read_metrics(variant.workdir)]
  step = max(steps) if steps else None
  if error is not None:
    return State("failed", step, f"{error['error']} ({error['command']} {error['how']}; "
                 f"log {error['log']})", None)
  report = _read_json(os.path.join(variant.workdir, "eval_report.json"))
  if report is not None and report["step"] >= variant.num_steps:
    return State("done", report["step"], f"step {report['step']}/{variant.num_steps}, "
                 f"val loss {report['loss']:.4f}", report)
  if os.path.isdir(variant.workdir):
    return State("running/partial", step, f"step {step or 0}/{variant.num_steps}", None)
  return State("not started", None, "", None)


def unfinished(variants: list[Variant], out=print) -> list[Variant]:
  """The variants that are not done; says which are skipped."""
  todo = []
  for variant in variants:
    if variant_state(variant).state == "done":
      out(f"skip {variant.name}: done")
    else:
      todo.append(variant)
  return todo


def describe(variants: list[Variant]) -> list[str]:
  """The commands of each variant, for --dry_run."""
  lines = []
  for variant in variants:
    lines += [f"{variant.name}:", f"  {shlex.join(variant.train_command)}",
              f"  {shlex.join(variant.eval_command)}"]
  return lines


def _last_line(path: str) -> str:
  """The last non-empty line of a log (progress bars end their lines with \\r)."""
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - 65536))
    text = f.read().decode("utf-8", errors="replace")
  lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
  return lines[-1] if lines else ""


class VariantJob(submitit.helpers.Checkpointable):
  """Runs one variant: train.py, then eval.py once training has reached num_steps.

  The local launcher and the SLURM jobs run this same callable. On SLURM,
  submitit calls `checkpoint()` when the job is preempted or reaches its time
  limit: it stops train.py with SIGTERM (train.py saves and exits) and returns
  the same call, which submitit requeues; train.py then resumes from the
  workdir. In a multi-process job (SLURM_NTASKS > 1) every task trains and
  task 0 evaluates.
  """

  def __init__(self):
    self._child = None  # the running subprocess.Popen

  def __getstate__(self):
    return {"_child": None}  # a process does not travel with a requeued job

  def __call__(self, variant: Variant) -> dict:
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    os.makedirs(variant.workdir, exist_ok=True)
    error_path = os.path.join(variant.workdir, ERROR)
    if os.path.exists(error_path):
      os.remove(error_path)
    log = os.path.join(variant.workdir, LOG if rank == 0 else f"sweep.rank{rank}.log")
    self._run(variant, "train.py", variant.train_command, log)
    steps = [r["step"] for r in read_metrics(variant.workdir)]
    step = max(steps) if steps else 0
    if step < variant.num_steps:  # train.py was stopped (SIGTERM/SIGINT) and saved
      return {"name": variant.name, "state": "stopped", "step": step}
    if rank == 0:
      self._run(variant, "eval.py", variant.eval_command, log)
    return {"name": variant.name, "state": "done", "step": step,
            "report": _read_json(os.path.join(variant.workdir, "eval_report.json"))}

  def _run(self, variant: Variant, what: str, command: list[str], log_path: str) -> None:
    """Runs a command, its output appended to the log; VariantFailed if it fails."""
    with open(log_path, "a", encoding="utf-8") as log:
      log.write(f"$ {shlex.join(command)}\n")
      log.flush()
      # SLURM sends its time-limit signal (USR2) to every process of the job;
      # blocked in train.py, it leaves checkpoint() to stop it with SIGTERM, so
      # that it saves first.
      previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
      try:
        self._child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
      try:
        # Polled, not wait()ed: checkpoint() runs as a signal handler in this
        # thread and waits for the child itself, which a pending wait() blocks.
        while self._child.poll() is None:
          time.sleep(0.2)
        returncode = self._child.returncode
      finally:
        self._child = None
    if returncode:
      how = (f"exited with status {returncode}" if returncode > 0
             else f"was killed by {signal.Signals(-returncode).name}")
      error = {"command": what, "how": how,
               "error": _last_line(log_path), "log": log_path}
      _write_json(os.path.join(variant.workdir, ERROR), error)
      raise VariantFailed(f"{variant.name}: {error['command']} {how}: {error['error']}")

  def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
    """Stops train.py with SIGTERM (it saves), then resubmits this same call."""
    child = self._child
    if child is not None and child.poll() is None:
      child.terminate()
      try:
        child.wait(timeout=STOP_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        child.kill()
    return super().checkpoint(*args, **kwargs)


def run_local(variants: list[Variant], parallel: int, out=print) -> int:
  """Runs the variants here, `parallel` at a time; returns how many failed."""
  out(f"running {len(variants)} variant(s), {parallel} at a time; each logs to "
      f"<workdir>/{LOG}")
  failures = 0
  with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = {pool.submit(VariantJob(), variant): variant for variant in variants}
    try:
      for future in concurrent.futures.as_completed(futures):
        variant = futures[future]
        try:
          result = future.result()
        except VariantFailed as e:
          failures += 1
          out(f"failed  {e}")
          continue
        detail = (f", val loss {result['report']['loss']:.4f}" if result["state"] == "done"
                  else "; run the sweep again to resume")
        out(f"{result['state']:7s} {variant.name}: step {result['step']}{detail}")
    except KeyboardInterrupt:  # train.py got the SIGINT too: it saves and stops
      for future in futures:
        future.cancel()
      raise
  return failures


def slurm_parameters(name: str, *, nodes: int, tasks_per_node: int, gpus_per_node: int,
                     cpus_per_task: int, timeout_min: int, partition: str | None,
                     account: str | None, parallel: int | None, setup: list[str]) -> dict:
  """`submitit.AutoExecutor.update_parameters` arguments: one array task per variant."""
  params = {"name": name, "nodes": nodes, "tasks_per_node": tasks_per_node,
            "gpus_per_node": gpus_per_node, "cpus_per_task": cpus_per_task,
            "timeout_min": timeout_min,
            # the job unpickles VariantJob, so it imports training.sweep from here
            "slurm_setup": [f"cd {shlex.quote(REPO)}", *setup],
            # requeue-able even where the cluster's default is not (JobRequeue=0)
            "slurm_additional_parameters": {"requeue": True}}
  for key, value in (("partition", partition), ("account", account),
                     ("array_parallelism", parallel)):
    if value:
      params[f"slurm_{key}"] = value
  return params


def submit_slurm(variants: list[Variant], folder: str, parameters: dict, max_timeouts: int,
                 cluster: str = "slurm") -> list[submitit.Job]:
  """Submits the variants as one job array (`cluster="local"` runs them here)."""
  if not variants:
    return []
  try:
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster,
                                     slurm_max_num_timeout=max_timeouts)
  except RuntimeError as e:
    raise UserError(f"--launcher slurm: {_first_line(e)} (try --dry_run, or --launcher local)")
  executor.update_parameters(**parameters)
  return executor.map_array(VariantJob(), variants)


def slurm_preview(parameters: dict, folder: str, num_jobs: int, max_timeouts: int) -> str:
  """The executor submit_slurm makes and the sbatch script that submitit would
  write for the array (from submitit's own template)."""
  renames = submitit.SlurmExecutor._equivalence_dict()  # pylint: disable=protected-access
  slurm = {key[len("slurm_"):] if key.startswith("slurm_") else renames[key]: value
           for key, value in parameters.items()}
  folder = os.path.abspath(folder)
  command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(folder)}"
  script = submitit_slurm._make_sbatch_string(  # pylint: disable=protected-access
      command=command, folder=folder, map_count=num_jobs, **slurm)
  return (f"\nsubmitit.AutoExecutor(folder={folder!r}, cluster='slurm', slurm_max_num_timeout="
          f"{max_timeouts}).update_parameters(**{parameters})\n\n{script}")


def status_lines(root: str) -> list[str]:
  manifest, variants = read_manifest(root)
  states = [variant_state(v) for v in variants]
  counts = {}
  for s in states:
    counts[s.state] = counts.get(s.state, 0) + 1
  width = max(len(v.name) for v in variants)
  lines = [f"sweep {manifest['name']}: {len(variants)} variants in {root} ("
           + ", ".join(f"{n} {state}" for state, n in counts.items()) + ")"]
  for variant, s in zip(variants, states):
    lines.append(f"  {s.state:15s}  {variant.name:{width}s}  {s.detail}".rstrip())
  return lines


def _plot(path: str, title: str, curves: dict) -> None:
  """One line per name -> (steps, losses, style keywords)."""
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  for label, (steps, losses, style) in curves.items():
    ax.plot(steps, losses, label=label, **style)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def _curve(records: list[dict], split: str) -> tuple[list, list]:
  rows = [r for r in records if r["split"] == split]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def write_report(root: str) -> list[str]:
  """report.md and report.csv (one row per variant) and the validation-curve PNGs."""
  manifest, variants = read_manifest(root)
  fields = list(dict.fromkeys(f for v in variants for f in v.overrides))
  header = ["variant", *fields, "state", "step", *(key for key, _, _ in REPORT_COLUMNS)]
  rows, curves, files = [], {}, []
  for variant in variants:
    s = variant_state(variant)
    report = s.report or {}
    rows.append([variant.name, *(variant.overrides.get(f, "") for f in fields), s.state,
                 "" if s.step is None else s.step,
                 *(report.get(key, "") for key, _, _ in REPORT_COLUMNS)])
    records = read_metrics(variant.workdir)
    steps, losses = _curve(records, "validation")
    if steps:
      curves[variant.name] = (steps, losses, {"marker": "o"})
      os.makedirs(os.path.join(root, "curves"), exist_ok=True)
      path = os.path.join(root, "curves", f"{variant.name}.png")
      _plot(path, f"{manifest['name']}: {variant.name}",
            {"validation": (steps, losses, {"marker": "o"}),
             "train": (*_curve(records, "train"), {"alpha": 0.5})})
      files.append(path)
  if curves:
    files.insert(0, os.path.join(root, "validation_curves.png"))
    _plot(files[0], f"{manifest['name']}: validation loss", curves)
  csv_path = os.path.join(root, "report.csv")
  with open(csv_path, "w", encoding="utf-8", newline="") as f:
    csv.writer(f).writerows([header, *rows])
  md_path = os.path.join(root, "report.md")
  with open(md_path, "w", encoding="utf-8") as f:
    f.write(_markdown(manifest, fields, rows, files, root))
  return [md_path, csv_path, *files]


def _display(path: str) -> str:
  """A path relative to the repository when it lies inside it."""
  relative = os.path.relpath(path, REPO)
  return path if relative.startswith("..") else relative


def _markdown(manifest: dict, fields: list[str], rows: list[list], plots: list[str],
              root: str) -> str:
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
  lines += [""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots]
  return "\n".join(lines) + "\n"
