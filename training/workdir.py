"""A run is a directory: the resolved config, the tokenizer, checkpoints,
metrics and reports. This module sets one up and reads one back.

`<workdir>/config.json`           the resolved config that trained it (the newest one)
`<workdir>/config_history.jsonl`  every change of the config on a resume, with its step
`<workdir>/tokenizer/`            the tokenizer every checkpoint was trained with
`<workdir>/checkpoints/`          Orbax checkpoints (see training/checkpoint.py)

A resume may change the fields of `RESUME_SAFE_FIELDS` (they do not change
what is trained); any other change is refused unless
`train.allow_config_changes` is set. Either way the change is appended to the
history, so that config.json and the history together say what trained the run.
"""
import json
import os

import jax
from flax import nnx
from jax.experimental import multihost_utils
from ml_collections import config_dict

from configs import base, validation
from configs.errors import UserError
from data import pipeline
from model import accounting, fp8
import tokenizer as tokenizer_lib
from training.checkpoint import Checkpointer, DamagedCheckpoint, resolve_step
from training.steps import abstract_state

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.jsonl"
TOKENIZER_DIR = "tokenizer"

# Fields a resume may change without changing what is trained: how long, how
# often it logs, evaluates and checkpoints, how it is watched, the one-run
# switches. Add a new field here when changing it mid-run is harmless.
RESUME_SAFE_FIELDS = (
    "train.num_steps", "train.log_every", "train.eval_every", "train.eval_steps",
    "train.checkpoint_every", "train.keep_checkpoints", "train.peer_timeout_s",
    "train.peak_tflops", "train.allow_config_changes", "train.skip_memory_check",
    "train.restore_from", "train.restore_branch", "train.restore_step",
    "data.num_workers", "data.cache_dir",
    "data.tokenize_workers", "data.verify_cache", "train.compilation_cache_dir",
    "train.reuse_host_memory",  # how host memory is allocated, not what is computed
    "train.token_budget", "train.flop_budget",  # they set train.num_steps
    "model.scan_unroll",  # how the scan runs, not what it computes
    "train.downstream_tasks", "train.downstream_task_dir", "train.downstream_limit",
    "train.downstream_batch_size",  # what is measured, not what is trained
    "train.trackers", "train.profile_steps",  # where it is recorded, what is traced
)


def default_workdir(config_path: str) -> str:
  """`runs/<config file stem>`, train.py's workdir when --workdir is not given.

  `config_path` is the --config value: `configs/gpt2_small.py` (or
  `configs/gpt2_small.py:arg`, a parameterised config) gives `runs/gpt2_small`.
  """
  filename = os.path.basename(config_path.split(":", 1)[0])
  return os.path.join("runs", os.path.splitext(filename)[0])


def config_to_dict(config: config_dict.ConfigDict) -> dict:
  return json.loads(config.to_json())


def _with_new_defaults(saved: dict, defaults: config_dict.ConfigDict, before: dict) -> dict:
  """`saved`, plus every field configs/base.py gained since it was saved, at
  its value in `before` (`base.BEFORE_FIELD`) or else its default: either
  keeps the behaviour runs had before the field."""
  out = dict(saved)
  for key, value in defaults.items():
    if key not in out and key in before and not isinstance(before[key], dict):
      out[key] = before[key]
    elif key not in out:
      out[key] = value.to_dict() if isinstance(value, config_dict.ConfigDict) else value
    elif isinstance(value, config_dict.ConfigDict) and isinstance(out[key], dict):
      out[key] = _with_new_defaults(out[key], value, before.get(key, {}))
  return out


def saved_config(saved: dict) -> config_dict.ConfigDict:
  """A config as a run saved it (config.json, a sweep's manifest), with the
  fields added to configs/base.py since at the values that keep its behaviour."""
  return config_dict.ConfigDict(_with_new_defaults(saved, base.get_config(), base.BEFORE_FIELD))


def load_config(workdir: str) -> config_dict.ConfigDict:
  """The run's saved config; fields added to configs/base.py since it was
  saved get their defaults."""
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise UserError(f"{workdir} is not a run directory (no {CONFIG_FILE}); "
                    "train into it first with python train.py --workdir ...")
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is damaged (not valid JSON: {e.msg}, line {e.lineno}); restore it "
                    "or use a new workdir") from None
  return saved_config(saved)


def keep_layout(config: config_dict.ConfigDict, workdir: str) -> config_dict.ConfigDict:
  """`config` with `model.scan_layers` None (not asked for) set to the layout
  of the run it resumes (`workdir`) or starts from (`train.restore_from`),
  so that its checkpoints restore; an explicit value is left to be checked
  against that run's shapes."""
  if config.model.scan_layers is not None:
    return config
  for source in (workdir, config.train.restore_from):
    if source and os.path.exists(os.path.join(source, CONFIG_FILE)):
      config = config.copy_and_resolve_references()
      config.model.scan_layers = validation.scan_layers(load_config(source).model)
      return config
  return config


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"train.num_steps": 600, ...}: every leaf of a config dict, dotted."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


# Fields whose unset value (None) means another field's: set to that value,
# they change nothing.
UNSET_MEANS = {"data.seed": "train.seed", "model.num_kv_heads": "model.num_heads"}


def config_changes(saved: dict, config: dict) -> list[tuple[str, object, object]]:
  """(field, old, new) of every field that differs, in field order.

  Tuples and lists compare as equal sequences (JSON has only lists); a field
  of `UNSET_MEANS` compares by the value it stands for.
  """
  before, after = flatten(saved), flatten(config)
  out = []
  for field in sorted(set(before) | set(after)):
    old, new = before.get(field), after.get(field)
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
      old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    if field in UNSET_MEANS:
      old = before.get(UNSET_MEANS[field]) if old is None else old
      new = after.get(UNSET_MEANS[field]) if new is None else new
    if old != new:
      out.append((field, before.get(field), after.get(field)))
  return out


def unsafe_changes(changes: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
  """The changes that are not in RESUME_SAFE_FIELDS: they change what is trained."""
  return [c for c in changes if c[0] not in RESUME_SAFE_FIELDS]


def describe_changes(changes: list[tuple[str, object, object]]) -> str:
  """`train.learning_rate 0.003 -> 0.0001, ...`."""
  return ", ".join(f"{field} {old!r} -> {new!r}" for field, old, new in changes)


def read_history(workdir: str) -> list[dict]:
  """The config history: one {"step", "changes": [[field, old, new]...], "forced"}
  per resume that changed the config; [] when there is none."""
  path = os.path.join(workdir, HISTORY_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def history_lines(history: list[dict]) -> list[str]:
  """One line per history entry, for reports: `step 600: train.num_steps 600 -> 1200`."""
  return [f"step {h['step']}: {describe_changes(h['changes'])}"
          + (" (allow_config_changes)" if h["forced"] else "") for h in history]


def read_json(path: str) -> dict:
  """The JSON object in `path`, as `write_json_atomic` wrote it ({} when there is no file)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json_atomic(path: str, obj) -> None:
  """Writes `obj` as JSON to `path` through a temporary file: never half written."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def check_same_shapes(saved: config_dict.ConfigDict, config: config_dict.ConfigDict,
                      workdir: str) -> None:
  """Refuses to resume a workdir whose parameters or FP8 scaling state
  (model.fp8=delayed) have other shapes."""
  if (accounting.parameter_shapes(saved.model) == accounting.parameter_shapes(config.model)
      and fp8.state_shape(saved.model) == fp8.state_shape(config.model)):
    return
  diffs = [f"model.{k}={saved.model[k]!r} (now {config.model[k]!r})"
           for k in config.model if k in saved.model and saved.model[k] != config.model[k]]
  raise UserError(f"workdir {workdir} holds a model of other shapes: {', '.join(diffs)}; "
                  "use a new --workdir, or start from it with --config.train.restore_from")


def check_resume(config: config_dict.ConfigDict, workdir: str) -> list:
  """The changes of `config` against the workdir's config.json ([] for a new
  workdir); reads only.

  A change outside RESUME_SAFE_FIELDS is refused, naming each (old -> new)
  and the two ways on, unless train.allow_config_changes is set; shapes
  never change (`check_same_shapes`).
  """
  if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    return []
  saved = load_config(workdir)
  check_same_shapes(saved, config, workdir)
  changes = config_changes(saved.to_dict(), config_to_dict(config))
  # A layout left unset (None) resumes as the saved run's (`keep_layout`): no change.
  changes = [c for c in changes if not (c[0] == "model.scan_layers" and c[1] is None
                                        and c[2] == validation.scan_layers(saved.model))]
  # A run saved with a bool train.remat resumes under the policy it names (True: full).
  changes = [c for c in changes if not (c[0] == "train.remat" and
                                        validation.remat_name(c[1]) == validation.remat_name(c[2]))]
  unsafe = unsafe_changes(changes)
  if unsafe and not config.train.allow_config_changes:
    raise UserError(f"{workdir} was trained with another config: {describe_changes(unsafe)}; "
                    "use a new --workdir, or resume with these changes recorded in its "
                    f"{HISTORY_FILE}: --config.train.allow_config_changes=True")
  return changes


def prepare(config: config_dict.ConfigDict, workdir: str, resuming: bool) -> None:
  """Creates the workdir; one without a checkpoint gets its config.json now.

  Process 0 writes; every process of a multi-host run checks (the workdir is
  on a file system they share). A resumed workdir's config is recorded by
  `record_config` once training has resumed.
  """
  os.makedirs(workdir, exist_ok=True)
  _barrier("prepare_workdir")
  if jax.process_index() == 0 and not resuming:
    write_json_atomic(os.path.join(workdir, CONFIG_FILE), config_to_dict(config))


def record_config(config: config_dict.ConfigDict, workdir: str, step: int,
                  changes: list) -> None:
  """Writes config.json and appends `changes` (from `check_resume`) at `step`
  to the history; nothing when nothing changed. Process 0 only."""
  if not changes or jax.process_index() != 0:
    return
  entry = {"step": step, "changes": [list(c) for c in changes],
           "forced": bool(unsafe_changes(changes))}
  with open(os.path.join(workdir, HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(entry) + "\n")
  write_json_atomic(os.path.join(workdir, CONFIG_FILE), config_to_dict(config))


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def setup_tokenizer(config: config_dict.ConfigDict, workdir: str, given: str | None = None):
  """The run's tokenizer: the workdir's, a given one copied in, or trained once.

  The given one is `given` (train.restore_from's tokenizer, see
  training/loop.py), else config.tokenizer.path.

  Process 0 trains or copies it into the workdir; every process then loads
  that copy, so all of them encode with the same vocabulary.

  A trained one learns from the train split: its documents, or for a seq2seq
  task every source and target of its train pairs.
  """
  run_dir = os.path.join(workdir, TOKENIZER_DIR)
  if jax.process_index() == 0 and not os.path.isdir(run_dir):
    given = given or config.tokenizer.path
    if given:
      tok = tokenizer_lib.load_tokenizer(given)
    else:
      tok = tokenizer_lib.train_tokenizer(config.tokenizer.kind, config.tokenizer.vocab_size,
                                          pipeline.tokenizer_texts(config.data,
                                                                   config.tokenizer.train_bytes))
    tok.save(run_dir)
  _barrier("setup_tokenizer")
  tok = tokenizer_lib.load_tokenizer(run_dir)
  if tok.vocab_size > validation.real_vocab_size(config.model):
    field = validation.token_rows_field(config.model)
    raise UserError(f"the tokenizer has {tok.vocab_size} ids but model.{field}="
                    f"{config.model[field]}; raise model.{field}")
  return tok


def load_run(workdir: str, step: int | None = None, tokenizer_path: str | None = None):
  """(config, tokenizer, model, step) of a checkpoint of `workdir`.

  The state is restored onto this process's first device, whatever mesh it
  was saved from (for example a run trained on 8 devices). The checkpoints are
  only read: the run may still be training, its save in progress is left alone.
  """
  config = load_config(workdir)
  where = f"eval of {workdir}"
  checkpointer = Checkpointer(workdir, asynchronous=False, read_only=True)
  try:
    resolve_step(checkpointer, step, where)  # no checkpoint: say so before the tokenizer
    tok = tokenizer_lib.load_tokenizer(tokenizer_path or os.path.join(workdir, "tokenizer"))
    graphdef, abstract = abstract_state(config)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), abstract)
    step, state, meta = _restore_intact(checkpointer, step, abstract, where)
  finally:
    checkpointer.close()
  tokenizer_lib.check_fingerprint(meta["tokenizer_fingerprint"], tok)
  return config, tok, nnx.merge(graphdef, state["params"]), step


def _restore_intact(checkpointer, step: int | None, abstract, where: str):
  """(step, state, meta): checkpoint `step`, or without one the newest intact
  checkpoint (saying which damaged ones it skipped); a damaged `step` is a
  UserError. Nothing is moved: the run may still be training."""
  if step is not None:
    step = resolve_step(checkpointer, step, where)
    try:
      return (step, *checkpointer.restore(step, abstract))
    except DamagedCheckpoint as e:
      raise UserError(f"{where}: {e}; evaluate another step (available: "
                      f"{', '.join(map(str, checkpointer.all_steps()))})") from None
  resolve_step(checkpointer, None, where)  # a UserError when there is none
  return checkpointer.restore_newest_intact(abstract, move_aside=False, where=where)
