"""Hugging Face checkpoints in and out, behind convert.py.

`from_hf(hf_dir, workdir)` reads an HF model directory (config.json, the
safetensors weights, single or sharded with `model.safetensors.index.json`,
and the tokenizer files) and writes a run directory at step 0: config.json,
tokenizer/ and an Orbax checkpoint, as train.py writes them, so eval.py
evaluates it and train.py fine-tunes it (`train.restore_from`). Everything is
checked before any weight is read: the architecture, every config field
(`training/hf_mappings.py`), the tensor names and shapes. Tensors are read one
at a time (`safe_open`), converted on the host and placed on the run's mesh
with its sharding rules, so the host holds about one tensor, not the model.
The run is written into a temporary directory next to the workdir and renamed
at the end: a failure leaves no workdir.

`to_hf(workdir, out_dir, step)` writes config.json, model.safetensors and
the tokenizer (`export_hf`) for `transformers.AutoModelForCausalLM` (BERT:
`AutoModelForMaskedLM`, BART: `AutoModelForSeq2SeqLM`) and `AutoTokenizer`;
the token ids in config.json are the tokenizer's (an encoder-decoder's
`decoder_start_token_id` too, from `model.decoder_start`). Vocabulary rows
past the tokenizer's (our padding, 50,304 against GPT-2's 50,257) are dropped.
Imports keep the checkpoint's rows: zero rows added on import would give
padded ids a logit of 0, above real ones, and change the outputs.
"""
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from configs import base
from configs.errors import UserError
from data import seq2seq
from model.config import ModelConfig
import tokenizer as tokenizer_lib
from training import hf_mappings
from training import workdir as workdir_lib
from training.checkpoint import Checkpointer
from training.evaluate import load_run
from training.optim import make_optimizer
from training.sharding import make_mesh, opt_state_shardings, state_shardings
from training.steps import abstract_state, init_state

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
# Tensor-name endings of old checkpoints (BERT's hub files) and what
# transformers renames them to on load.
_LEGACY_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}
_PARAM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise UserError(f"{path}: no such file (not a Hugging Face model directory)") from None
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def _open(path: pathlib.Path):
  """`safe_open` of a safetensors file (numpy arrays); a UserError if unreadable."""
  try:
    return safe_open(path, framework="numpy")
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"cannot read {path}: {' '.join(str(e).split())}") from None


def _weight_files(hf_dir: pathlib.Path) -> dict:
  """{tensor name: file} from the index, or of the one model.safetensors."""
  if (hf_dir / INDEX_FILE).is_file():
    weight_map = _read_json(hf_dir / INDEX_FILE).get("weight_map") or {}
    files = {name: hf_dir / file for name, file in weight_map.items()}
  elif (hf_dir / WEIGHTS_FILE).is_file():
    files = None
  else:
    raise UserError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors weights are "
                    "read; convert .bin files with transformers' save_pretrained first)")
  if files is None:
    with _open(hf_dir / WEIGHTS_FILE) as f:
      return {name: hf_dir / WEIGHTS_FILE for name in f.keys()}
  missing = sorted({str(p) for p in files.values() if not p.is_file()})
  if missing:
    raise UserError(f"{hf_dir / INDEX_FILE} names missing weight file(s): {', '.join(missing)}")
  return files


def run_config(hf: dict, arch, tok):
  """Our run config (configs/base.py defaults) for the HF config `hf`."""
  config = base.get_config()
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  if dtype not in _PARAM_DTYPES:
    raise UserError(f"Hugging Face config field dtype={dtype!r} is not supported "
                    f"({', '.join(_PARAM_DTYPES)} are)")
  config.model.update(**{"family": "decoder", **arch.config_from_hf(hf)}, attention_impl="auto",
                      dtype=_PARAM_DTYPES[dtype], param_dtype=_PARAM_DTYPES[dtype])
  config.tokenizer.update(path="", vocab_size=tok.vocab_size)
  config.train.objective = arch.objective
  if arch.objective == "seq2seq":  # the user's pairs: eval.py --data, train.py data.paths
    config.data.task = "pairs"
  config.train.seq_len = min(config.train.seq_len, config.model.max_len)
  if tok.vocab_size > config.model.vocab_size:
    raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model only "
                    f"vocab_size={config.model.vocab_size} rows")
  return config


def _flat(tree) -> dict:
  """{our parameter path ("decoder/layers/0/attn/q_proj/kernel"): leaf}."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    out[name.removesuffix("/value")] = leaf
  return out


def _plan(arch, cfg, files: dict, abstract_params: dict, hf_dir) -> list:
  """[(Tensor, full HF name)], every name and shape checked before reading;
  the name is None for a missing `Tensor.zeros_if_missing` (read as zeros)."""
  names = {}
  for name in files:
    if name.endswith(arch.skipped):
      continue
    short = name.removeprefix(arch.prefix)
    for old, new in _LEGACY_NAMES.items():
      if short.endswith(old):
        short = short.removesuffix(old) + new
    names[short] = name
  plan, wanted = [], set()
  for tensor in arch.tensors(cfg):
    wanted.add(tensor.hf_name)
    if tensor.hf_name not in names and tensor.zeros_if_missing:
      plan.append((tensor, None))
      continue
    if tensor.hf_name not in names:
      raise UserError(f"{hf_dir}: the weights have no tensor {arch.prefix}{tensor.hf_name}")
    full = names[tensor.hf_name]
    with _open(files[full]) as f:
      shape = tuple(f.get_slice(full).get_shape())
    expected = _hf_shape(tensor, abstract_params)
    if shape != expected:
      raise UserError(f"{hf_dir}: tensor {full} has shape {shape}, config.json implies "
                      f"{expected}")
    plan.append((tensor, full))
  extra = sorted(set(names) - wanted - set(arch.read_past(cfg)))
  if extra:
    raise UserError(f"{hf_dir}: tensor {names[extra[0]]} is not used by the {arch.model_type} "
                    f"mapping ({len(extra)} unused)")
  return plan


def _hf_shape(tensor, abstract_params: dict) -> tuple:
  """The HF shape our parameters imply (to_hf of zeros of their shapes)."""
  zeros = [np.zeros(abstract_params[p].shape, np.float32) for p in tensor.paths]
  return tuple(tensor.to_hf(*zeros).shape)


def _check_target(workdir: pathlib.Path) -> None:
  if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
    raise UserError(f"--workdir {workdir} already exists and is not empty; choose a new one")


def from_hf(hf_dir: str, workdir: str, *, fsdp: int = 1, tensor: int = 1) -> int:
  """Imports `hf_dir` into a new run directory `workdir`; returns the parameter count.

  `fsdp`, `tensor`: the run's mesh.fsdp and mesh.tensor (the weights are
  placed in those shards while they are read).
  """
  hf_dir, workdir = pathlib.Path(hf_dir), pathlib.Path(workdir)
  _check_target(workdir)
  if not hf_dir.is_dir():
    raise UserError(f"--hf_dir {hf_dir}: no such directory")
  hf = _read_json(hf_dir / "config.json")
  arch = hf_mappings.architecture_of(hf)
  if not (hf_dir / "tokenizer.json").is_file():
    raise UserError(f"{hf_dir}: no tokenizer.json (the Hugging Face tokenizer is imported with "
                    "the weights)")
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  config = run_config(hf, arch, tok)
  config.mesh.update(fsdp=fsdp, tensor=tensor)
  cfg = ModelConfig.resolve(config.model)
  files = _weight_files(hf_dir)
  _, abstract = abstract_state(config)
  abstract_params = _flat(abstract["params"])
  plan = _plan(arch, cfg, files, abstract_params, hf_dir)

  mesh, rules = make_mesh(config.mesh), config.mesh.rules
  shardings = _flat(state_shardings(abstract["params"], mesh, rules))
  params = {}
  for tensor, full in plan:
    if full is None:
      pieces = tensor.to_ours(np.zeros(_hf_shape(tensor, abstract_params), np.float32))
    else:
      with _open(files[full]) as f:
        pieces = tensor.to_ours(f.get_tensor(full))
    for path, piece in zip(tensor.paths, pieces):
      dtype = abstract_params[path].dtype
      params[path] = jax.device_put(np.asarray(piece).astype(dtype, copy=False), shardings[path])
    del pieces
  leaves = [params[path] for path in _flat(abstract["params"])]
  params_tree = jax.tree.unflatten(jax.tree.structure(abstract["params"]), leaves)
  tx = make_optimizer(config.train)
  state = jax.jit(lambda p: init_state(p, tx, config.train.seed), donate_argnums=0,
                  out_shardings=opt_state_shardings(abstract, abstract["params"], mesh, rules)
                  )(params_tree)

  tmp = workdir.parent / f".{workdir.name}.converting-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  try:
    (tmp / workdir_lib.CONFIG_FILE).write_text(
        json.dumps(workdir_lib.config_to_dict(config), indent=2, sort_keys=True),
        encoding="utf-8")
    tok.save(tmp / workdir_lib.TOKENIZER_DIR)
    checkpointer = Checkpointer(str(tmp), asynchronous=False)
    try:
      checkpointer.save(0, state, None, {"config": workdir_lib.config_to_dict(config),
                                         "tokenizer_fingerprint": tok.fingerprint})
      checkpointer.wait()
    finally:
      checkpointer.close()
    if workdir.exists():
      workdir.rmdir()
    tmp.rename(workdir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return sum(int(np.prod(x.shape)) for x in abstract_params.values())


def export_architecture(cfg) -> hf_mappings.Architecture:
  """The HF architecture our `cfg` exports as, or a UserError with each reason."""
  reasons = []
  for name in hf_mappings.EXPORTS:
    arch = hf_mappings.ARCHITECTURES[name]
    reason = arch.check_ours(cfg)
    if not reason:
      return arch
    reasons.append(f"{name}: {reason}")
  raise UserError(f"this model has no Hugging Face architecture ({'; '.join(reasons)})")


def to_hf(workdir: str, out_dir: str, step: int | None = None) -> pathlib.Path:
  """Exports a checkpoint of `workdir` as a Hugging Face model directory."""
  out = pathlib.Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise UserError(f"--out {out} already exists and is not empty; choose a new one")
  config = workdir_lib.load_config(workdir)
  cfg = ModelConfig.resolve(config.model)
  arch = export_architecture(cfg)
  config, tok, model, step = load_run(workdir, step)
  params = _flat(nnx.state(model, nnx.Param))
  vocab = min(tok.vocab_size, cfg.vocab_size)
  dtype = jnp.dtype(cfg.param_dtype)
  np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
  tensors = {}
  for tensor in arch.tensors(cfg):
    arrays = [np.asarray(jax.device_get(params[p])) for p in tensor.paths]
    if tensor.vocab_axis is not None:
      arrays = [np.take(arrays[0], np.arange(vocab), axis=tensor.vocab_axis)]
    name = (tensor.hf_name if tensor.hf_name.startswith(arch.unprefixed)
            else arch.prefix + tensor.hf_name)
    tensors[name] = np.ascontiguousarray(tensor.to_hf(*arrays).astype(np_dtype))
  hf = arch.config_to_hf(cfg, vocab)
  hf.update(dtype=dtype.name, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id)
  if cfg.family == "encoder_decoder":
    hf["decoder_start_token_id"] = seq2seq.decoder_start_id(tok, cfg.decoder_start)
  tmp = out.parent / f".{out.name}.exporting-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  try:
    safetensors.numpy.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    tokenizer_lib.export_hf(tok, tmp)
    if out.exists():
      out.rmdir()
    tmp.rename(out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out
