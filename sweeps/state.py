"""The sweep's manifest (`<root>/sweep.json`) and where each variant stands."""
import dataclasses
import json
import os

from configs.errors import UserError
from training import workdir as workdir_lib
from training.metrics import read_metrics
from sweeps.sweep_file import Sweep
from sweeps.variants import Variant

MANIFEST = "sweep.json"
LOG = "sweep.log"
ERROR = "sweep_error.json"
REPORT = "eval_report.json"
TIMES = "sweep_times.jsonl"  # per command run: wall and CPU seconds, the host, XLA's threads


@dataclasses.dataclass
class State:
  """Where a variant stands: `not started`, `running/partial`, `done`, `failed`
  or `changed` (its workdir was trained with another config than the sweep's)."""
  state: str
  step: int | None  # the last step in metrics.jsonl, or the evaluated step when done
  detail: str
  report: dict | None  # eval_report.json when done


def write_json(path: str, obj) -> None:
  """Writes JSON atomically (a reader sees the old file or the new one)."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def read_json(path: str) -> dict | None:
  """The file's JSON, or None when it is missing or half-written."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def read_times(workdir: str) -> list[dict]:
  """The records of sweep_times.jsonl (one per train.py or eval.py the sweep
  ran in the workdir, oldest first; a half-written last line is left out)."""
  try:
    with open(os.path.join(workdir, TIMES), encoding="utf-8") as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    return []
  records = []
  for line in lines:
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def last_step(workdir: str) -> int | None:
  """The last step a run has logged (metrics.jsonl), None before its first."""
  steps = [r["step"] for r in read_metrics(workdir)]
  return max(steps) if steps else None


def write_manifest(root: str, sweep: Sweep, config_path: str, extra_flags: list[str],
                   variants: list[Variant], seeds: int | None = None) -> None:
  """sweep.json: the sweep (its file, or its --grid flags), its flags, `seeds`
  (runs per variant; None: one, unnamed by seed) and every run."""
  os.makedirs(root, exist_ok=True)
  write_json(os.path.join(root, MANIFEST), {
      "name": sweep.name, "sweep": sweep.source, "grid": sweep.grid,
      "config": os.path.abspath(config_path), "extra_flags": extra_flags, "seeds": seeds,
      "variants": [dataclasses.asdict(v) for v in variants]})


def check_seeds(root: str, seeds: int | None) -> None:
  """A root run with seeds is resumed with seeds, and one run without them
  without: the two lay out their workdirs differently (`<variant>,seed=<k>`
  and `<variant>`), and one report over both would mix them."""
  manifest = read_json(os.path.join(root, MANIFEST))
  had = manifest and manifest.get("seeds")
  if manifest is None or bool(had) == bool(seeds):
    return
  if had:
    raise UserError(f"--root {root} was run with --seeds {had}; give --seeds {had} (or more) "
                    "to resume or extend it, or a new --root for one run per variant")
  raise UserError(f"--root {root} was run without seeds (one run per variant); give a new "
                  f"--root for --seeds {seeds}")


def read_manifest(root: str) -> tuple[dict, list[Variant]]:
  """The sweep in `root` and its variants (workdirs under `root` as it is now)."""
  manifest = read_json(os.path.join(root, MANIFEST))
  if manifest is None:
    raise UserError(f"--root {root}: not a sweep (no {MANIFEST}); start one with "
                    "python sweep.py run --sweep ... --root ...")
  variants = [dataclasses.replace(Variant(**v), workdir=os.path.join(root, v["name"]))
              for v in manifest["variants"]]
  return manifest, variants


def changed_fields(variant: Variant) -> list:
  """(field, trained, asked) of each field outside the resume-safe ones in which
  the variant's workdir was trained otherwise than the sweep now asks; []
  for a variant not started."""
  if not variant.config or not os.path.exists(os.path.join(variant.workdir,
                                                           workdir_lib.CONFIG_FILE)):
    return []
  saved = workdir_lib.load_config(variant.workdir).to_dict()
  # The manifest's config, like the run's, gets the defaults of fields added
  # since it was written: a newer checkout does not make a finished run changed.
  asked = workdir_lib.saved_config(variant.config).to_dict()
  if not asked["data"]["labels"]:  # train.py fills an empty data.labels in from the data
    asked["data"]["labels"] = saved["data"]["labels"]
  return workdir_lib.unsafe_changes(workdir_lib.config_changes(saved, asked))


def set_aside(variant: Variant) -> str:
  """Moves a changed variant's workdir to `<workdir>.replaced<N>`; returns where."""
  n = 1
  while os.path.exists(f"{variant.workdir}.replaced{n}"):
    n += 1
  os.rename(variant.workdir, f"{variant.workdir}.replaced{n}")
  return f"{variant.workdir}.replaced{n}"


def variant_state(variant: Variant) -> State:
  error = read_json(os.path.join(variant.workdir, ERROR))
  step = last_step(variant.workdir)
  changes = changed_fields(variant)
  if changes:
    return State("changed", step, f"trained with {workdir_lib.describe_changes(changes)} "
                 "(old -> asked)", None)
  if error is not None:
    return State("failed", step, f"{error['error']} ({error['command']} {error['how']}; "
                 f"log {error['log']})", None)
  report = read_json(os.path.join(variant.workdir, REPORT))
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


def status_lines(root: str) -> list[str]:
  manifest, variants = read_manifest(root)
  states = [variant_state(v) for v in variants]
  counts = {}
  for s in states:
    counts[s.state] = counts.get(s.state, 0) + 1
  width = max(len(v.name) for v in variants)
  seeds = manifest.get("seeds")
  runs = (f"{len(variants)} runs ({len(variants) // seeds} variant(s) x {seeds} seeds)"
          if seeds else f"{len(variants)} variants")
  lines = [f"sweep {manifest['name']}: {runs} in {root} ("
           + ", ".join(f"{n} {state}" for state, n in counts.items()) + ")"]
  for variant, s in zip(variants, states):
    lines.append(f"  {s.state:15s}  {variant.name:{width}s}  {s.detail}".rstrip())
  return lines
