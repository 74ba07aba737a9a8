"""Hugging Face checkpoints in and out, behind convert.py.

`from_hf(hf_dir, workdir)` reads an HF model directory (config.json, the
safetensors weights, single or sharded with `model.safetensors.index.json`,
and the tokenizer files) and writes a run directory at step 0: config.json,
tokenizer/ and an Orbax checkpoint, as train.py writes them, so eval.py
evaluates it and train.py fine-tunes it (`train.restore_from`). Everything is
checked before any weight is read: the architecture, every config field
(`hf/mappings.py`), the tensor names and shapes. The tensor tables name
one layer's parameter ("decoder/layers/3/attn/q_proj/kernel"); in a
scanned stack (`model.scan_layers`) that is slice 3 of the stacked
parameter (`_locate`), both ways. Tensors are read one
at a time (`safe_open`), converted on the host and placed on the run's mesh
with its sharding rules, so the host holds about one tensor, not the model.
The run is written into a temporary directory next to the workdir and renamed
at the end: a failure leaves no workdir.

`to_hf(workdir, out_dir, step)` writes config.json, model.safetensors and
the tokenizer (`export_hf`) for `transformers.AutoModelForCausalLM` (BERT:
`AutoModelForMaskedLM`, T5 and BART: `AutoModelForSeq2SeqLM`) and
`AutoTokenizer`; the token ids in config.json are the tokenizer's (an
encoder-decoder's `decoder_start_token_id` too, the id `model.decoder_start`
names; an import checks it against that id). Vocabulary rows past the
`model.real_vocab_size` (our padding, 50,304 against GPT-2's 50,257) are
dropped, and so is the option; every other row is written, also rows the
tokenizer never gives (T5's 32,128 rows for 32,100 ids, Qwen2's 151,936 for
151,646), so a checkpoint comes back with its own shapes. A sequence
classifier (`model.num_labels`) exports as `AutoModelForSequenceClassification`
with its labels (`data.labels`) as `id2label`. Imports keep the
checkpoint's rows, or pad them to a multiple (`pad_vocab_to_multiple`) with
`model.real_vocab_size` the checkpoint's, so that the padded rows' logits
are masked and the outputs do not change.
"""
import functools
import json
import os
import pathlib
import re
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
from model.moe import ExpertBias
from model.transformer import segment
import tokenizer as tokenizer_lib
from hf import mappings as hf_mappings
from hf import tables as hf_tables
from training import workdir as workdir_lib
from training.checkpoint import Checkpointer
from training.workdir import load_run
from training.optim import model_optimizer
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


def run_config(hf: dict, arch, tok, pad_vocab_to_multiple: int = 1):
  """Our run config (configs/base.py defaults) for the HF config `hf`; the
  vocabulary rows padded up to a multiple of `pad_vocab_to_multiple` with
  `model.real_vocab_size` the checkpoint's rows (1: no padding)."""
  if (not isinstance(pad_vocab_to_multiple, int) or isinstance(pad_vocab_to_multiple, bool)
      or pad_vocab_to_multiple < 1):
    raise UserError(f"--pad_vocab_to_multiple {pad_vocab_to_multiple!r}: must be a positive "
                    "integer (1: keep the checkpoint's rows)")
  config = base.get_config()
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  if dtype not in _PARAM_DTYPES:
    raise UserError(f"Hugging Face config field dtype={dtype!r} is not supported "
                    f"({', '.join(_PARAM_DTYPES)} are)")
  config.model.update(**{"family": "decoder", **arch.config_from_hf(hf)}, attention_impl="auto",
                      dtype=_PARAM_DTYPES[dtype], param_dtype=_PARAM_DTYPES[dtype])
  rows = config.model.vocab_size
  padded = -(-rows // pad_vocab_to_multiple) * pad_vocab_to_multiple
  if padded != rows:
    config.model.update(vocab_size=padded, real_vocab_size=rows)
  config.tokenizer.update(path="", vocab_size=tok.vocab_size)
  config.train.objective = arch.objective
  if arch.objective == "seq2seq":  # the user's pairs (eval.py --data, train.py data.paths),
    config.data.update(task="pairs", pair_specials=True)  # marked as T5 and BART were trained
  if arch.objective == "classify":  # the user's labelled texts, the checkpoint's labels
    config.data.update(task="labelled",
                       labels=hf_tables.label_names(hf, config.model.num_labels))
  config.train.seq_len = min(config.train.seq_len, config.model.max_len)
  if tok.vocab_size > rows:
    raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model only "
                    f"vocab_size={rows} rows")
  start = hf.get("decoder_start_token_id")
  if config.model.family == "encoder_decoder" and start is not None:
    ours = seq2seq.decoder_start_id(tok, config.model.decoder_start)
    if start != ours:
      raise UserError(f"Hugging Face config field decoder_start_token_id={start!r} is not the "
                      f"tokenizer's {config.model.decoder_start} id ({ours}), where our decoder "
                      f"starts (model.decoder_start={config.model.decoder_start})")
  return config


def _flat(tree) -> dict:
  """{our parameter path ("decoder/layers/0/attn/q_proj/kernel"): leaf}."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    out[name.removesuffix("/value")] = leaf
  return out


_LAYER_PATH = re.compile(r"^(.*/layers)/(\d+)/(.*)$")
_EXPERT_PATH = re.compile(r"^(.*)\[(\d+)\]$")


def _locate(path: str, flat: dict) -> tuple[str, tuple[int, ...]]:
  """(our parameter path, the index of the slice it names) of a tensor-table
  path: a scanned stack holds "decoder/layers/{i}/attn/q_proj/kernel" as
  slice (i,) of its stacked "decoder/layers/attn/q_proj/kernel", or, where
  it stacks segments (`model.transformer.layer_plan`), as the slice of the
  segment that holds layer i: (i - a,) of a run "decoder/layers/{a}_to_{b}/...",
  or (r,) of block j of a cycle ".../{a}_to_{b}_every_{p}/{j}/..." where
  i = a + r p + j; a path ending in "[j]"
  names expert j of a mixture's stacked weight (HF files keep one tensor
  per expert), after the layer where it is stacked."""
  expert = _EXPERT_PATH.match(path)
  path, index = (expert[1], (int(expert[2]),)) if expert else (path, ())
  match = _LAYER_PATH.match(path)
  if path in flat or match is None:
    return path, index
  stack, layer, rest = match[1], int(match[2]), match[3]
  if f"{stack}/{rest}" in flat:
    return f"{stack}/{rest}", (layer, *index)
  keys = {p[len(stack) + 1:].split("/")[0] for p in flat if p.startswith(stack + "/")}
  for seg in filter(None, map(segment, keys)):
    if layer in seg.layers:
      repeat, j = seg.where(layer)
      held = f"{stack}/{seg.name}/{rest}" if seg.period == 1 else f"{stack}/{seg.name}/{j}/{rest}"
      if held in flat:
        return held, (repeat, *index)
  return path, index


def _shape(path: str, flat: dict) -> tuple:
  """The shape of the parameter a tensor-table path names (one layer's, one
  expert's)."""
  stacked, index = _locate(path, flat)
  return tuple(flat[stacked].shape)[len(index):]


def _plan(arch, cfg, files: dict, abstract_params: dict, hf_dir, dropped=(),
          mtp_depth: int = 0) -> list:
  """[(Tensor, full HF name)], every name and shape checked before reading;
  the name is None for a missing `Tensor.zeros_if_missing` (read as zeros).
  Names starting with one of `dropped` (after the prefix) are read past;
  `mtp_depth` modules' tensors (`Architecture.mtp`) are read too."""
  names = {}
  for name in files:
    short = name.removeprefix(arch.prefix)
    if name.endswith(arch.skipped) or short.startswith(tuple(dropped)):
      continue
    for old, new in _LEGACY_NAMES.items():
      if short.endswith(old):
        short = short.removesuffix(old) + new
    names[short] = name
  plan, wanted = [], set()
  for tensor in _tensors(arch, cfg, mtp_depth):
    wanted.add(tensor.hf_name)
    if tensor.hf_name not in names and tensor.zeros_if_missing:
      plan.append((tensor, None))
      continue
    if tensor.hf_name not in names:
      raise UserError(f"{hf_dir}: the weights have no tensor {arch.prefix}{tensor.hf_name}")
    full = names[tensor.hf_name]
    with _open(files[full]) as f:
      shape = tuple(f.get_slice(full).get_shape())
    expected = _hf_shape(tensor, abstract_params, cfg.real_vocab_size)
    if shape != expected:
      raise UserError(f"{hf_dir}: tensor {full} has shape {shape}, config.json implies "
                      f"{expected}")
    plan.append((tensor, full))
  extra = sorted(set(names) - wanted - set(arch.read_past(cfg)))
  if extra:
    raise UserError(f"{hf_dir}: tensor {names[extra[0]]} is not used by the {arch.model_type} "
                    f"mapping ({len(extra)} unused)")
  return plan


def _tensors(arch, cfg, mtp_depth: int) -> list:
  """The model's tensors (`arch.tensors`) and its `mtp_depth` multi-token
  prediction modules' (`Architecture.mtp`; none where it has no mapping)."""
  mtp = arch.mtp.tensors(cfg, mtp_depth) if arch.mtp and mtp_depth else []
  return arch.tensors(cfg) + mtp


def _hf_shape(tensor, abstract_params: dict, vocab: int) -> tuple:
  """The HF shape our parameters imply (to_hf of zeros of their shapes), with
  `vocab` rows on the vocabulary axis (the checkpoint's, before padding)."""
  shapes = [list(_shape(p, abstract_params)) for p in tensor.paths]
  if tensor.vocab_axis is not None:
    shapes[0][tensor.vocab_axis] = vocab
  return tuple(tensor.to_hf(*[np.zeros(s, np.float32) for s in shapes]).shape)


def _padded(piece, tensor, shape: tuple):
  """`piece` with zero rows appended on the vocabulary axis up to `shape`
  (their logits are masked: `model.real_vocab_size`)."""
  if tensor.vocab_axis is None or piece.shape == shape:
    return piece
  widths = [(0, 0)] * piece.ndim
  widths[tensor.vocab_axis] = (0, shape[tensor.vocab_axis] - piece.shape[tensor.vocab_axis])
  return np.pad(piece, widths)


def _set_layer(stacked, index: tuple[int, ...], piece, abstract, sharding):
  """`stacked` (zeros of `abstract` in `sharding` when None) with slice
  `index` (a layer, an expert, or both) set to `piece`, in place on the
  devices: the host holds one layer's (expert's) tensor at a time."""
  if stacked is None:
    stacked = jax.jit(lambda: jnp.zeros(abstract.shape, abstract.dtype),
                      out_shardings=sharding)()
  return _layer_setter(sharding)(stacked, index, piece)


@functools.lru_cache(maxsize=None)
def _layer_setter(sharding):
  """`stacked.at[index].set(piece)`, the stacked array donated and kept in `sharding`."""
  return jax.jit(lambda stacked, index, piece: stacked.at[index].set(piece),
                 donate_argnums=0, out_shardings=sharding)


def _own_head(arch, files: dict) -> bool:
  """Whether the file holds `arch.tied_head`'s head with other values than
  its embedding (compared in blocks of rows): transformers 5 then unties them."""
  if not arch.tied_head or not all(name in files for name in arch.tied_head):
    return False
  head, embedding = arch.tied_head
  with _open(files[head]) as f, _open(files[embedding]) as g:
    head_slice, embedding_slice = f.get_slice(head), g.get_slice(embedding)
    if head_slice.get_shape() != embedding_slice.get_shape():
      return True
    rows = head_slice.get_shape()[0]
    blocks = [slice(i, min(i + 4096, rows)) for i in range(0, rows, 4096)]
    return any(not np.array_equal(head_slice[b], embedding_slice[b]) for b in blocks)


def _check_target(workdir: pathlib.Path) -> None:
  if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
    raise UserError(f"--workdir {workdir} already exists and is not empty; choose a new one")


def from_hf(hf_dir: str, workdir: str, *, fsdp: int = 1, tensor: int = 1,
            pad_vocab_to_multiple: int = 1, scan_layers: bool | None = None) -> int:
  """Imports `hf_dir` into a new run directory `workdir`; returns the parameter
  count (the `nnx.Param`s: a deepseek router's selection bias is not one).

  `fsdp`, `tensor`: the run's mesh.fsdp and mesh.tensor (the weights are
  placed in those shards while they are read). `pad_vocab_to_multiple`:
  see `run_config`. `scan_layers`: the run's model.scan_layers (None: scanned
  unless the layers differ; True also scans DeepSeek's dense and MoE runs).
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
  config = run_config(hf, arch, tok, pad_vocab_to_multiple)
  config.mesh.update(fsdp=fsdp, tensor=tensor)
  config.model.scan_layers = scan_layers
  files = _weight_files(hf_dir)
  if arch.mtp:
    config.train.mtp_depth = arch.mtp.depth(hf, {n.removeprefix(arch.prefix) for n in files})
  if config.model.tie_embeddings and _own_head(arch, files):
    config.model.tie_embeddings = False
  cfg = ModelConfig.resolve(config.model)
  _, abstract = abstract_state(config)
  abstract_params = _flat(abstract["params"])
  depth = config.train.mtp_depth
  dropped = ([t.hf_name for t in arch.mtp.copies(cfg, depth)] if depth
             else arch.dropped(hf))
  plan = _plan(arch, cfg, files, abstract_params, hf_dir, dropped, depth)

  mesh, rules = make_mesh(config.mesh), config.mesh.rules
  shardings = _flat(state_shardings(abstract["params"], mesh, rules))
  params = {}
  for tensor, full in plan:
    if full is None:
      pieces = tensor.to_ours(np.zeros(_hf_shape(tensor, abstract_params, cfg.real_vocab_size),
                                       np.float32))
    else:
      with _open(files[full]) as f:
        pieces = tensor.to_ours(f.get_tensor(full))
    for path, piece in zip(tensor.paths, pieces):
      stacked, index = _locate(path, abstract_params)
      dtype = abstract_params[stacked].dtype
      piece = _padded(np.asarray(piece).astype(dtype, copy=False), tensor,
                      _shape(path, abstract_params))
      if not index:
        params[path] = jax.device_put(piece, shardings[path])
      else:
        params[stacked] = _set_layer(params.get(stacked), index, piece,
                                     abstract_params[stacked], shardings[stacked])
    del pieces
  leaves = [params[path] for path in _flat(abstract["params"])]
  params_tree = jax.tree.unflatten(jax.tree.structure(abstract["params"]), leaves)
  tx = model_optimizer(config)
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
  return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(
      abstract["params"], is_leaf=lambda x: isinstance(x, nnx.Variable))
             if isinstance(v, nnx.Param))  # not a router's selection bias


def _array(params: dict, path: str) -> np.ndarray:
  """The host array of a tensor-table path (a layer's slice of a stacked one)."""
  stacked, index = _locate(path, params)
  array = params[stacked][index] if index else params[stacked]
  return np.asarray(jax.device_get(array))


def round_trip_mismatch(arch, cfg: ModelConfig) -> str:
  """Why `cfg` is not the HF architecture `arch` ("" if it is).

  Writes `arch`'s config.json for `cfg`, imports it back and compares every
  forward field (`ModelConfig.forward_fields`; the vocabulary's size aside,
  which export cuts to the rows that are not padding): the first one that does not come back is
  named with the value `arch` gives it. One rule for every architecture, so a
  new model option is refused by every architecture that does not map it.
  """
  config = base.get_config()
  try:
    config.model.update(**{"family": "decoder",
                           **arch.config_from_hf(arch.config_to_hf(cfg, cfg.vocab_size))},
                        attention_impl="reference")
    back = ModelConfig.resolve(config.model).forward_fields()
  except UserError as e:
    return str(e)
  for key, value in cfg.forward_fields().items():
    if key not in ("vocab_size", "real_vocab_size") and back.get(key) != value:
      return f"model.{key}={value!r} (needs {back.get(key)!r})"
  return ""


def export_architecture(cfg) -> hf_mappings.Architecture:
  """The HF architecture our `cfg` exports as (the first of
  `hf_mappings.EXPORTS` that takes it; a classifier's, of
  `CLASSIFIER_EXPORTS`), or a UserError with each one's reason."""
  reasons = []
  names, table = ((hf_mappings.CLASSIFIER_EXPORTS, hf_mappings.CLASSIFIERS) if cfg.num_labels
                  else (hf_mappings.EXPORTS, hf_mappings.ARCHITECTURES))
  for name in names:
    arch = table[name]
    reason = round_trip_mismatch(arch, cfg)
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
  if cfg.parametrization == "mup" and (cfg.width_mult != 1.0 or cfg.logit_mult is not None):
    raise UserError(f"{workdir}: trained with model.parametrization=mup at width multiplier "
                    f"{cfg.width_mult:g} and model.mup_output_mult={cfg.mup_output_mult:g}, "
                    "whose logit and attention scales no Hugging Face architecture has; "
                    "export a run trained under sp")
  arch = export_architecture(cfg)
  config, tok, model, step = load_run(workdir, step)
  params = _flat(nnx.state(model, nnx.Any(nnx.Param, ExpertBias)))
  vocab = cfg.real_vocab_size  # every row but our padding, also rows the tokenizer never gives
  dtype = jnp.dtype(cfg.param_dtype)
  np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
  tensors = {}
  depth = config.train.mtp_depth if arch.mtp else 0
  copies = arch.mtp.copies(cfg, depth) if depth else []
  for tensor in _tensors(arch, cfg, depth) + copies:
    arrays = [_array(params, p) for p in tensor.paths]
    if tensor.vocab_axis is not None:
      arrays = [np.take(arrays[0], np.arange(vocab), axis=tensor.vocab_axis)]
    name = (tensor.hf_name if tensor.hf_name.startswith(arch.unprefixed)
            else arch.prefix + tensor.hf_name)
    tensors[name] = np.ascontiguousarray(tensor.to_hf(*arrays).astype(np_dtype))
  hf = arch.config_to_hf(cfg, vocab)
  if arch.mtp:
    hf.update(arch.mtp.config(depth))
  hf.update(dtype=dtype.name, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id)
  if cfg.family == "encoder_decoder":
    hf["decoder_start_token_id"] = seq2seq.decoder_start_id(tok, cfg.decoder_start)
  if cfg.num_labels:
    names = config.data.labels or hf_tables.label_names({}, cfg.num_labels)
    hf.update(hf_tables.labels_to_hf(names))
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
