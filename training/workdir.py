"""A run is a directory: the resolved config, the tokenizer, checkpoints,
metrics and reports. This module sets one up and reads one back.

`<workdir>/config.json`   the resolved config of the first run in it
`<workdir>/tokenizer/`    the tokenizer every checkpoint was trained with
`<workdir>/checkpoints/`  Orbax checkpoints (see training/checkpoint.py)
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
from model import accounting
import tokenizer as tokenizer_lib
from training.checkpoint import Checkpointer, DamagedCheckpoint, resolve_step
from training.steps import abstract_state

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"


def default_workdir(config_path: str) -> str:
  """`runs/<config file stem>`, train.py's workdir when --workdir is not given.

  `config_path` is the --config value: `configs/gpt2_small.py` (or
  `configs/gpt2_small.py:arg`, a parameterised config) gives `runs/gpt2_small`.
  """
  filename = os.path.basename(config_path.split(":", 1)[0])
  return os.path.join("runs", os.path.splitext(filename)[0])


def config_to_dict(config: config_dict.ConfigDict) -> dict:
  return json.loads(config.to_json())


def _with_new_defaults(saved: dict, defaults: config_dict.ConfigDict) -> dict:
  """`saved`, plus every field configs/base.py gained since it was saved, at
  its default (a new field's default keeps the behaviour runs had before)."""
  out = dict(saved)
  for key, value in defaults.items():
    if key not in out:
      out[key] = value.to_dict() if isinstance(value, config_dict.ConfigDict) else value
    elif isinstance(value, config_dict.ConfigDict) and isinstance(out[key], dict):
      out[key] = _with_new_defaults(out[key], value)
  return out


def load_config(workdir: str) -> config_dict.ConfigDict:
  """The run's saved config; fields added to configs/base.py since it was
  saved get their defaults."""
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise UserError(f"{workdir} is not a run directory (no {CONFIG_FILE}); "
                    "train into it first with python train.py --workdir ...")
  with open(path, encoding="utf-8") as f:
    return config_dict.ConfigDict(_with_new_defaults(json.load(f), base.get_config()))


def _write_json_atomic(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def check_same_shapes(saved: config_dict.ConfigDict, config: config_dict.ConfigDict,
                      workdir: str) -> None:
  """Refuses to resume a workdir whose parameters have other shapes."""
  if accounting.parameter_shapes(saved.model) == accounting.parameter_shapes(config.model):
    return
  diffs = [f"model.{k}={saved.model[k]!r} (now {config.model[k]!r})"
           for k in config.model if k in saved.model and saved.model[k] != config.model[k]]
  raise UserError(f"workdir {workdir} holds a model of other shapes: {', '.join(diffs)}; "
                  "use a new --workdir, or start from it with --config.train.restore_from")


def prepare(config: config_dict.ConfigDict, workdir: str) -> None:
  """Creates the workdir, or checks that resuming it is compatible.

  Process 0 writes; every process of a multi-host run checks (the workdir is
  on a file system they share).
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(path):
    saved = load_config(workdir)
    check_same_shapes(saved, config, workdir)
    if tuple(saved.data.labels) != tuple(config.data.labels):
      raise UserError(f"workdir {workdir} was trained on the labels {tuple(saved.data.labels)}, "
                      f"this run has {tuple(config.data.labels)}; use a new --workdir")
  _barrier("prepare_workdir")
  if jax.process_index() == 0:
    _write_json_atomic(path, config_to_dict(config))


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
                                          pipeline.tokenizer_texts(config.data))
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
