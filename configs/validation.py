"""All config checks, in one place.

`validate(config)` runs at start-up of every tool (train.py, eval.py,
model.summary) and `build_model` runs `validate_model` (through
`model.config.ModelConfig.resolve`). A bad value raises a `UserError` whose
one line names the field, the value and what is allowed. The meaning of the
optional model fields (`head_dim`, `num_kv_heads`, `num_decoder_layers`) is
defined here; what an attention kernel takes is checked by the model where
the implementation is chosen (`model.attention.check_support`), since
configs never import the model. The `model.` choices of `CHOICES` are the
names of the model's registries (`model/registry.py`; a test holds them
equal): a new choice is its registry entry plus its name here.
"""
import math
import os
import re
from typing import NamedTuple

from ml_collections import config_dict

from configs.errors import UserError

CHOICES = {
    "model.family": ("decoder", "encoder", "encoder_decoder"),
    "model.pos_emb": ("none", "sinusoidal", "learned", "rope", "relative", "alibi"),
    "model.attention": ("mha", "mla"),
    "model.attention_score": ("softmax", "sigmoid"),
    "model.rope_scaling": ("none", "linear", "ntk", "yarn", "llama3"),
    "model.norm": ("layernorm", "rmsnorm", "rmsnorm_zero_centred", "dyt"),
    "model.decoder_start": ("bos", "pad", "eos"),
    "model.pooling": ("cls", "mean", "last"),
    "model.norm_position": ("pre", "post"),
    "model.mlp": ("gelu", "gelu_tanh", "relu", "swiglu", "geglu", "geglu_tanh"),
    "model.moe_router": ("softmax_topk_norm", "softmax_topk", "deepseek"),
    "model.moe_group_mask_fill": ("-inf", "0"),
    "model.parametrization": ("sp", "mup"),
    "model.attention_impl": ("reference", "xla", "cudnn", "pallas", "auto"),
    "model.pallas_lowering": ("auto", "triton", "mosaic_gpu", "mosaic_tpu"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.fp8": ("none", "current", "delayed"),
    "tokenizer.kind": ("bpe", "spm_bpe", "spm_unigram"),
    "data.source": ("stdlib", "pydoc", "embedded", "files", "jsonl", "arrayrecord",
                    "parquet"),
    "data.packing": ("packed", "concat"),
    "data.task": ("none", "reverse", "sort", "addition", "code_summary", "pairs",
                  "stdlib_package", "labelled"),
    "data.task_addition_format": ("plain", "aligned"),
    "train.objective": ("next_token", "seq2seq", "mlm", "classify"),
    "train.loss_impl": ("xla", "pallas", "auto"),
    "train.optimizer": ("adamw", "adafactor", "lion", "muon"),
    "train.schedule": ("cosine", "linear", "constant", "inverse_sqrt", "wsd"),
    "train.remat": ("none", "full", "save_dots", "save_dots_except_mlp", "save_qkv_proj",
                    "save_attention_out", "save_out_proj"),
    "mesh.context_strategy": ("ring", "all_gather", "auto"),
}

# Each optimizer's own fields (train.<name>), with the value None stands for.
OPTIMIZER_OPTIONS = {
    "adafactor": {"adafactor_decay_rate": 0.8, "adafactor_clipping": 1.0,
                  "adafactor_momentum": None, "adafactor_param_scale": True,
                  "adafactor_min_dim_to_factor": 128},
    "lion": {"lion_b1": 0.9, "lion_b2": 0.99},
    "muon": {"muon_lr": None, "muon_momentum": 0.95, "muon_ns_steps": 5, "muon_rms": 0.2},
}

# The data.source values that read the user's files (data.paths); the others are built in.
FILE_SOURCES = ("files", "jsonl", "arrayrecord", "parquet")

# The data.task values each objective reads (next_token and mlm read data.source).
TASKS = {
    "seq2seq": ("reverse", "sort", "addition", "code_summary", "pairs"),
    "classify": ("stdlib_package", "labelled"),
}

# The trackers train.trackers may name (training/trackers.py implements each).
TRACKERS = ("tensorboard", "wandb", "mlflow")

# Which objectives each model family can train with.
OBJECTIVES = {
    "decoder": ("next_token", "seq2seq", "classify"),
    "encoder": ("mlm", "classify"),
    "encoder_decoder": ("seq2seq",),
}


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def _fail(field: str, value, why: str) -> None:
  raise UserError(f"config field {field}={value!r}: {why}")


def _check_choice(config, field: str, prefix: str = "") -> None:
  value = _get(config, field[len(prefix):])
  if value not in CHOICES[field]:
    _fail(field, value, f"must be one of {', '.join(CHOICES[field])}")


def _check_positive(config, field: str, prefix: str = "", allow_none=False,
                    allow_zero=False) -> None:
  value = _get(config, field[len(prefix):])
  if value is None and allow_none:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
    _fail(field, value, "must be a positive integer" + (" or 0" if allow_zero else ""))


# The fields of model.attention=mla (DeepSeek's multi-head latent attention),
# with DeepSeek-V3's values; q_lora_rank may be None or 0 (queries projected
# directly), the others are required.
MLA_FIELDS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128}


def num_kv_heads(m) -> int:
  """KV heads g (None means g = h, multi-head attention). MLA's training
  attention has a key and a value per query head (expanded from the shared
  latent): h."""
  if m.attention == "mla" or m.num_kv_heads is None:
    return m.num_heads
  return m.num_kv_heads


def head_dim(m) -> int:
  """Per-head width d_k of the queries and keys (None means d_model //
  num_heads); MLA's is qk_nope_head_dim + qk_rope_head_dim."""
  if m.attention == "mla":
    return m.qk_nope_head_dim + m.qk_rope_head_dim
  return m.d_model // m.num_heads if m.head_dim is None else m.head_dim


def v_head_dim(m) -> int:
  """Per-head width of the values: head_dim, or MLA's v_head_dim."""
  return m.v_head_dim if m.attention == "mla" else head_dim(m)


def num_decoder_layers(m) -> int:
  """Decoder layers of an encoder_decoder (None means num_layers)."""
  return m.num_layers if m.num_decoder_layers is None else m.num_decoder_layers


def projection_bias(m, field: str) -> bool:
  """Whether the projections of `field` (qkv_bias, out_bias, mlp_bias) have
  biases (None means model.use_bias)."""
  return m.use_bias if m[field] is None else m[field]


def token_rows_field(m) -> str:
  """The model field that bounds the tokenizer's ids: `real_vocab_size` when
  set (the rows past it are padding), else `vocab_size`."""
  return "vocab_size" if m.real_vocab_size is None else "real_vocab_size"


def real_vocab_size(m) -> int:
  """The rows of the vocabulary that are tokens, the rest padding whose
  logits are masked (None means all vocab_size rows)."""
  return m[token_rows_field(m)]


# A layer's token mixer in `model.layer_types` (transformers' names): softmax
# attention over every earlier key, or the last `model.sliding_window` of
# them, or Gated DeltaNet's linear attention (model/gated_deltanet.py).
LAYER_ATTENTIONS = ("full_attention", "sliding_attention", "linear_attention")
MOE_SUFFIX = "+moe"  # a layer kind ending in it has a mixture of experts as its MLP


class LayerKind(NamedTuple):
  """What one layer is: its self-attention (a LAYER_ATTENTIONS name) and
  whether its MLP is a mixture of experts."""
  attention: str
  moe: bool

  @property
  def name(self) -> str:
    """The kind as `model.layer_types` writes it ("full_attention+moe")."""
    return self.attention + (MOE_SUFFIX if self.moe else "")


def layer_kind(name: str) -> LayerKind:
  """A `model.layer_types` entry ("sliding_attention", "full_attention+moe")
  as a LayerKind; a UserError for a name that is not a kind."""
  attention, moe = (name.removesuffix(MOE_SUFFIX), True) if (
      isinstance(name, str) and name.endswith(MOE_SUFFIX)) else (name, False)
  if attention not in LAYER_ATTENTIONS:
    _fail("model.layer_types", name, f"is not a layer kind: use one of "
          f"{', '.join(LAYER_ATTENTIONS)}, each optionally followed by {MOE_SUFFIX} (its MLP "
          "a mixture of experts), e.g. ('linear_attention', 'linear_attention', 'full_attention')")
  return LayerKind(attention, moe)


def stack_layers(m) -> int:
  """Layers of the model's longest stack (the decoder's of an encoder_decoder
  may outnumber the encoder's): how far `layer_types` describes the layers."""
  return max(m.num_layers, num_decoder_layers(m)) if m.family == "encoder_decoder" else (
      m.num_layers)


def layer_types(m) -> tuple[str, ...]:
  """Every layer's kind, layer 0 first: `model.layer_types` repeated to the
  layers of the longest stack (`stack_layers`), or, where it is None, the
  kinds that `model.sliding_window_layers` and `model.moe_layers` give (a
  window on those layers, every layer when None; experts likewise). The one
  place a layer's kind is derived: the window and expert layers, the
  scanned layout, the accounting and the HF mappings all read it."""
  n = stack_layers(m)
  if m.layer_types is not None:
    return tuple(m.layer_types[i % len(m.layer_types)] for i in range(n))
  window = (() if m.sliding_window is None else
            range(m.num_layers) if m.sliding_window_layers is None else m.sliding_window_layers)
  experts = (() if not m.num_experts else
             range(m.num_layers) if m.moe_layers is None else m.moe_layers)
  return tuple(LayerKind(LAYER_ATTENTIONS[i in window], i in experts).name for i in range(n))


def layer_cycle(m) -> int:
  """The period of the kinds `model.layer_types` declares (its shortest
  repeating unit: ("a", "b", "a", "b") repeats every 2), which a scanned
  stack may scan over; 0 where the kinds come from sliding_window_layers and
  moe_layers (a scanned stack then scans runs of identical layers, the
  layout runs saved before layer_types keep)."""
  declared = m.layer_types
  if declared is None:
    return 0
  return next(p for p in range(1, len(declared) + 1)
              if all(declared[i] == declared[i % p] for i in range(len(declared))))


def _layers_where(m, test) -> tuple[int, ...]:
  """The layers of the first stack whose `LayerKind` passes `test`, sorted."""
  return tuple(i for i, kind in enumerate(layer_types(m)[:m.num_layers])
               if test(layer_kind(kind)))


def sliding_window_layers(m) -> tuple[int, ...]:
  """The layers whose self-attention has `model.sliding_window`
  (`layer_types`' sliding_attention layers)."""
  return _layers_where(m, lambda kind: kind.attention == "sliding_attention")


def moe_layers(m) -> tuple[int, ...]:
  """The layers whose MLP is a mixture of experts (`layer_types`' +moe layers)."""
  return _layers_where(m, lambda kind: kind.moe)


def linear_layers(m) -> tuple[int, ...]:
  """The layers whose token mixer is Gated DeltaNet's linear attention."""
  return _layers_where(m, lambda kind: kind.attention == "linear_attention")


def linear_heads(m) -> dict[str, int]:
  """The linear_attention layers' sizes with their defaults filled in."""
  key_heads = m.linear_num_key_heads or m.num_heads
  key_dim = m.linear_key_head_dim or head_dim(m)
  return {"linear_num_key_heads": key_heads,
          "linear_num_value_heads": m.linear_num_value_heads or key_heads,
          "linear_key_head_dim": key_dim,
          "linear_value_head_dim": m.linear_value_head_dim or key_dim}


def moe_d_ff(m) -> int:
  """Each expert's hidden width (None means d_ff)."""
  return m.d_ff if m.moe_d_ff is None else m.moe_d_ff


def scan_layers(m) -> bool:
  """Whether each stack runs its blocks under scans: `model.scan_layers`,
  None meaning yes unless the layers differ by sliding_window_layers or
  moe_layers (runs saved before `model.layer_types` keep their loop); layers
  described by `layer_types` scan by their cycle (model/transformer.py)."""
  if m.scan_layers is None:
    return m.layer_types is not None or len(set(layer_types(m))) == 1
  return bool(m.scan_layers)


def width_mult(m) -> float:
  """μP's width multiplier, d_model / model.mup_base_width (1 under sp, or
  with no base width)."""
  if m.parametrization != "mup" or m.mup_base_width is None:
    return 1.0
  return m.d_model / m.mup_base_width


def depth_mult(m) -> float:
  """Depth-μP's factor on each residual branch, sqrt(model.mup_base_depth /
  num_layers) (1 without a base depth); the hidden matrices' learning rate
  takes it too (docs/models.md, "Depth")."""
  if m.mup_base_depth is None:
    return 1.0
  return math.sqrt(m.mup_base_depth / m.num_layers)


def attention_scale(m) -> float:
  """The factor on Q K^T (None means 1/sqrt(head_dim); under μP
  sqrt(base head_dim) / head_dim, the head_dim at the base width, so that
  it is 1/sqrt(head_dim) there and falls as 1/head_dim with width)."""
  if m.attention_scale is not None:
    return m.attention_scale
  if m.parametrization == "mup":
    return math.sqrt(head_dim(m) / width_mult(m)) / head_dim(m)
  return head_dim(m) ** -0.5


def remat_name(value) -> str:
  """The train.remat policy a value names (model/remat.py): a name of
  `CHOICES["train.remat"]`, or the bool of configs and runs from before the
  policies had names (True, also written "true" on the command line, is
  `full`; False is `none`). UserError for anything else."""
  if isinstance(value, str) and value.lower() in ("true", "false"):
    value = value.lower() == "true"
  if isinstance(value, bool):
    return "full" if value else "none"
  if value not in CHOICES["train.remat"]:
    _fail("train.remat", value, f"must be one of {', '.join(CHOICES['train.remat'])} "
          "(True and False mean full and none)")
  return value


def eval_every(t) -> int:
  """Steps between in-training validation passes (None means num_steps // 10,
  at least 1: ten points on the curve whatever the run's length)."""
  return max(1, t.num_steps // 10) if t.eval_every is None else t.eval_every


def data_seed(config) -> int:
  """The seed of the data order and the MLM masks (data.seed; None means
  train.seed, as every run before data.seed had it)."""
  return config.train.seed if config.data.seed is None else config.data.seed


MAX_WEIGHT_RATIO = 10_000  # data.mixture: the largest weight over the smallest


class MixturePart(NamedTuple):
  """One source of data.mixture: its name in metrics and reports, and what it reads."""
  name: str  # stdlib, pydoc, embedded; a file source: its kind and label, e.g. jsonl-notes
  source: str  # a data.source
  paths: str  # its data.paths ("" for the built-in corpora)
  weight: float  # > 0; the sources' rows are drawn in proportion to their weights


def mixture_parts(d) -> list[MixturePart]:
  """The sources of data.mixture in order ([] when it is empty), each named
  (`mixture_name`); a UserError naming the bad part and the fix.

  `source[:paths]=weight`, comma-separated; the paths of one source may be
  several globs, comma-separated as in data.paths (a piece without `=` belongs
  to the next source's paths): `jsonl:a/*.jsonl,b/*.jsonl=0.3,stdlib=0.7`.
  """
  if not d.mixture.strip():
    return []
  parts, pending = [], []
  for piece in d.mixture.split(","):
    if not piece.strip():
      _fail("data.mixture", d.mixture, "has an empty source between commas; write "
            "source[:paths]=weight, comma-separated, e.g. stdlib=0.7,pydoc=0.3")
    pending.append(piece)
    if "=" in piece:
      spec, weight = ",".join(pending).rsplit("=", 1)
      parts.append(_mixture_part(d.mixture, spec.strip(), weight.strip()))
      pending = []
  if pending:
    _fail("data.mixture", d.mixture, f"{','.join(pending).strip()!r} has no weight; write "
          "source[:paths]=weight, e.g. stdlib=0.7,pydoc=0.3")
  weights = [part.weight for part in parts]
  if max(weights) > MAX_WEIGHT_RATIO * min(weights):
    _fail("data.mixture", d.mixture, f"weighs its sources {max(weights) / min(weights):.3g} to 1; "
          f"at most {MAX_WEIGHT_RATIO:,} to 1 (a source drawn less than once in "
          f"{MAX_WEIGHT_RATIO:,} rows): raise the smallest weight or drop that source")
  named, seen = [], set()
  for part in parts:
    if (part.source, part.paths) in seen:
      _fail("data.mixture", d.mixture, f"names {part.source}:{part.paths} twice; give each "
            "source one weight")
    seen.add((part.source, part.paths))
    name, n = part.name, 1
    while name in {p.name for p in named}:
      n += 1
      name = f"{part.name}-{n}"
    named.append(part._replace(name=name))
  return named


def _mixture_part(value: str, spec: str, weight_text: str) -> MixturePart:
  """One `source[:paths]=weight` of data.mixture, checked."""
  source, _, paths = (x.strip() for x in spec.partition(":"))
  if source not in CHOICES["data.source"]:
    _fail("data.mixture", value, f"{source!r} is not a source; each is one of "
          f"{', '.join(CHOICES['data.source'])}, written source[:paths]=weight")
  if source in FILE_SOURCES and not paths:
    _fail("data.mixture", value, f"{source} needs its files: {source}:<paths or "
          f"globs>={weight_text or '<weight>'}")
  if source not in FILE_SOURCES and paths:
    _fail("data.mixture", value, f"{source} is built in and takes no paths; write "
          f"{source}={weight_text or '<weight>'}")
  try:
    weight = float(weight_text)
  except ValueError:
    weight = math.nan
  if not (math.isfinite(weight) and weight > 0):
    _fail("data.mixture", value, f"the weight of {spec} is {weight_text!r}; a weight is a "
          "number > 0 (drop a source rather than weigh it 0)")
  return MixturePart(mixture_name(source, paths), source, paths, weight)


def mixture_name(source: str, paths: str) -> str:
  """A mixture source's name: the built-in corpora by their own (`stdlib`), a
  file source by its kind and the last path component of its first glob
  that has no wildcard, without a file's extension (`jsonl:/data/notes/*.jsonl`:
  `jsonl-notes`; `parquet:wiki.parquet`: `parquet-wiki`; `files:*.txt`:
  `files`). Characters other than letters, digits, `_`, `.` and `-` become
  `_`; data.mixture numbers a name that two sources share (`jsonl-notes-2`)."""
  if source not in FILE_SOURCES:
    return source
  components = paths.split(",")[0].strip().rstrip("/").split("/")
  label = ""
  for i in reversed(range(len(components))):
    if components[i] not in ("", ".", "..", "~") and not re.search(r"[*?\[]", components[i]):
      is_file = i == len(components) - 1
      label = os.path.splitext(components[i])[0] if is_file else components[i]
      break
  label = re.sub(r"[^\w.-]", "_", label)
  return f"{source}-{label}" if label.strip("_") else source


def budget(t) -> tuple[str, float] | None:
  """(field, value) of the budget that sets train.num_steps, None when neither
  train.token_budget nor train.flop_budget is set (0)."""
  for field in ("token_budget", "flop_budget"):
    if t[field]:
      return f"train.{field}", t[field]
  return None


def optimizer_option(t, field: str):
  """train.<field> of an optimizer's own (`OPTIMIZER_OPTIONS`), None meaning its
  default there; muon_lr's default is train.learning_rate."""
  value = t[field]
  if value is None:
    (value,) = [o[field] for o in OPTIMIZER_OPTIONS.values() if field in o]
  return t.learning_rate if field == "muon_lr" and value is None else value


def decay_fraction(t) -> float:
  """wsd's share of num_steps that decays (None means 0.2)."""
  return 0.2 if t.decay_fraction is None else t.decay_fraction


def decay_start(t) -> int:
  """wsd: the step count where the decay starts (num_steps less its rounded
  decay_fraction); the learning rate is constant from warmup_steps to it."""
  return t.num_steps - round(decay_fraction(t) * t.num_steps)


def trackers(t) -> tuple[str, ...]:
  """The tracker names of train.trackers, comma-separated ("" means none)."""
  return tuple(name.strip() for name in t.trackers.split(",") if name.strip())


def profile_steps(t) -> tuple[int, int] | None:
  """(first, last) of train.profile_steps ("first,last"), None when "" (no trace);
  `validate` has checked the form."""
  if not t.profile_steps.strip():
    return None
  first, last = (int(part) for part in t.profile_steps.split(","))
  return first, last


def eval_points(t) -> int:
  """Validation passes of a run: every eval_every steps and at the last step."""
  return -(-t.num_steps // eval_every(t))


def validate_model(m: config_dict.ConfigDict) -> None:
  """Checks the `model` section; every rule has a test of its message."""
  p = "model."
  for field in CHOICES:
    if field.startswith(p):
      _check_choice(m, field, p)
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                "relative_buckets", "relative_max_distance"):
    _check_positive(m, p + field, p)
  for field in ("num_kv_heads", "head_dim", "num_decoder_layers", "sliding_window",
                "real_vocab_size"):
    _check_positive(m, p + field, p, allow_none=True)
  if real_vocab_size(m) > m.vocab_size:
    _fail("model.real_vocab_size", m.real_vocab_size,
          f"must be <= model.vocab_size={m.vocab_size} (the rows past it are padding)")
  _check_positive(m, p + "type_vocab_size", p, allow_zero=True)
  _check_positive(m, p + "fp8_history", p)
  _validate_classifier(m)
  _validate_mla(m)
  if m.attention == "mha" and m.head_dim is None and m.d_model % m.num_heads:
    _fail("model.d_model", m.d_model,
          f"must be divisible by model.num_heads={m.num_heads} (or set model.head_dim)")
  if m.num_heads % num_kv_heads(m):
    _fail("model.num_kv_heads", m.num_kv_heads,
          f"must divide model.num_heads={m.num_heads} (h query heads share g KV heads)")
  if m.attention == "mha" and m.pos_emb == "rope" and head_dim(m) % 2:
    _fail("model.head_dim", head_dim(m), "must be even for pos_emb=rope (RoPE rotates pairs)")
  _validate_qwen3_next_parts(m)
  if m.pos_emb == "sinusoidal" and m.d_model % 2:
    _fail("model.d_model", m.d_model, "must be even for pos_emb=sinusoidal (sin/cos pairs)")
  if m.pos_emb == "relative" and m.relative_buckets < 4:
    _fail("model.relative_buckets", m.relative_buckets,
          "must be >= 4 (exact and logarithmic halves, per direction in the encoder)")
  if m.pos_emb == "relative" and m.relative_max_distance <= m.relative_buckets // 2:
    _fail("model.relative_max_distance", m.relative_max_distance,
          f"must exceed model.relative_buckets // 2 = {m.relative_buckets // 2} "
          "(the offsets with a bucket each)")
  if m.rope_theta <= 0:
    _fail("model.rope_theta", m.rope_theta, "must be positive")
  if m.rope_scaling_factor < 1:
    _fail("model.rope_scaling_factor", m.rope_scaling_factor,
          "must be >= 1 (how many times longer the context becomes)")
  if m.rope_scaling != "none" and m.pos_emb != "rope":
    _fail("model.rope_scaling", m.rope_scaling, "needs model.pos_emb=rope")
  _validate_rope_scaling(m)
  if m.norm_eps <= 0:
    _fail("model.norm_eps", m.norm_eps, "must be positive")
  if m.sliding_window is not None and m.family != "decoder":
    _fail("model.sliding_window", m.sliding_window,
          f"is for causal decoders (model.family=decoder, not {m.family}); unset it")
  _validate_layer_types(m)
  _validate_window_layers(m)
  _validate_moe(m)
  _validate_mup(m)
  scan_layers(m)
  if isinstance(m.scan_unroll, bool) or not isinstance(m.scan_unroll, int) or m.scan_unroll < 1:
    _fail("model.scan_unroll", m.scan_unroll, "must be a positive integer (blocks per iteration)")
  for field in ("attn_softcap", "final_softcap"):
    if m[field] is not None and not m[field] > 0:
      _fail(f"model.{field}", m[field], "must be positive (the cap c of c tanh(x / c)) or None")
  if m.attention_scale is not None and m.attention_scale <= 0:
    _fail("model.attention_scale", m.attention_scale,
          "must be positive (1.0 for unscaled, as T5) or None for 1/sqrt(head_dim)")


def _validate_mla(m: config_dict.ConfigDict) -> None:
  """model.attention=mla (DeepSeek's multi-head latent attention): its fields
  set, the MHA head fields and qk_norm unset, a RoPE decoder under sp; with
  mha, no MLA field set."""
  if m.attention != "mla":
    for field in MLA_FIELDS:
      if m[field] is not None:
        _fail(f"model.{field}", m[field], f"is for model.attention=mla (multi-head latent "
              f"attention), not {m.attention}; unset it")
    return
  for field, deepseek in MLA_FIELDS.items():
    if field != "q_lora_rank" and m[field] is None:
      _fail(f"model.{field}", None, f"is required by model.attention=mla; set it "
            f"(DeepSeek-V3: {deepseek})")
    _check_positive(m, f"model.{field}", "model.", allow_none=field == "q_lora_rank",
                    allow_zero=field == "q_lora_rank")
  if m.qk_rope_head_dim % 2:
    _fail("model.qk_rope_head_dim", m.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
  if m.family != "decoder":
    _fail("model.attention", m.attention, f"is a decoder's self-attention (DeepSeek's); "
          f"model.family={m.family} is not supported: use model.attention=mha")
  if m.pos_emb != "rope":
    _fail("model.pos_emb", m.pos_emb, "must be rope for model.attention=mla (its queries and "
          "its shared key rotate qk_rope_head_dim pairs); set model.pos_emb=rope")
  unset = {"num_kv_heads": "MLA's keys and values come from one latent (kv_lora_rank)",
           "head_dim": "MLA's heads are qk_nope_head_dim + qk_rope_head_dim wide (queries, "
                       "keys) and v_head_dim (values)",
           "qk_norm": "MLA normalises its latents instead (q_a and kv_a RMSNorms)"}
  for field, why in unset.items():
    if m[field] not in (None, False):
      _fail(f"model.{field}", m[field], f"is for model.attention=mha: {why}; unset it")
  if m.parametrization == "mup":
    _fail("model.parametrization", m.parametrization, "with model.attention=mla is not "
          "supported (μP's rules have no case for the latent ranks); use sp")


def _validate_qwen3_next_parts(m: config_dict.ConfigDict) -> None:
  """Partial RoPE, the attention output gate and the shared expert's gate
  (Qwen3-Next's pieces): each needs what it acts on."""
  f = m.partial_rotary_factor
  if not (isinstance(f, (int, float)) and 0 < f <= 1):
    _fail("model.partial_rotary_factor", f, "must be in (0, 1] (the fraction of each head's "
          "dims RoPE rotates)")
  if f != 1:
    if m.pos_emb != "rope" or m.attention != "mha":
      _fail("model.partial_rotary_factor", f, "needs model.pos_emb=rope and "
            "model.attention=mha (MLA rotates qk_rope_head_dim); set it to 1.0")
    rotary = head_dim(m) * f
    if rotary != int(rotary) or int(rotary) % 2 or not rotary:
      _fail("model.partial_rotary_factor", f, f"times model.head_dim={head_dim(m)} must be a "
            f"positive even whole number of dims (RoPE rotates pairs), not {rotary:g}")
  if not isinstance(m.attention_output_gate, bool):
    _fail("model.attention_output_gate", m.attention_output_gate, "must be true or false")
  if m.attention_output_gate and (m.attention != "mha" or m.family != "decoder"):
    _fail("model.attention_output_gate", m.attention_output_gate, "is for model.attention=mha "
          "in a decoder (model.family=decoder); set it to false")
  if not isinstance(m.moe_shared_expert_gate, bool):
    _fail("model.moe_shared_expert_gate", m.moe_shared_expert_gate, "must be true or false")
  if m.moe_shared_expert_gate and not (m.num_experts and m.num_shared_experts):
    _fail("model.moe_shared_expert_gate", m.moe_shared_expert_gate, "gates the shared "
          "experts: needs model.num_experts > 0 and model.num_shared_experts > 0; set it to "
          "false")


def _validate_classifier(m: config_dict.ConfigDict) -> None:
  """`model.num_labels` and the pooling that the classifier reads."""
  _check_positive(m, "model.num_labels", "model.", allow_zero=True)
  if m.num_labels and m.family == "encoder_decoder":
    _fail("model.num_labels", m.num_labels, "is for model.family=encoder or decoder (the "
          "classifier reads one stack's pooled hidden states)")
  if m.pooler and m.pooling != "cls":
    _fail("model.pooler", m.pooler, f"is for model.pooling=cls (BERT's pooler reads the first "
          f"token), not {m.pooling}; unset it")


def classifier_bias(m) -> bool:
  """Whether the classifier's logits have a bias (None means model.use_bias)."""
  return m.use_bias if m.classifier_bias is None else m.classifier_bias


def _validate_layer_types(m: config_dict.ConfigDict) -> None:
  """`model.layer_types`: a non-empty tuple of layer kinds, at most one per
  layer (it repeats to the layers), the layers' only description
  (sliding_window_layers and moe_layers unset), with the window its
  sliding_attention layers use and the experts its +moe layers hold."""
  declared = m.layer_types
  if declared is None:
    return
  if not isinstance(declared, (tuple, list)) or not declared:
    _fail("model.layer_types", declared, "must be a non-empty tuple of layer kinds that "
          "repeats to model.num_layers, e.g. ('linear_attention', 'linear_attention', "
          "'full_attention')"
          " (None: sliding_window_layers and moe_layers say)")
  kinds = [layer_kind(name) for name in declared]
  if len(kinds) > stack_layers(m):
    _fail("model.layer_types", declared, f"has {len(kinds)} kinds for {stack_layers(m)} "
          "layers (model.num_layers); give at most one kind per layer (the tuple repeats)")
  for field in ("sliding_window_layers", "moe_layers"):
    if m[field] is not None:
      _fail(f"model.{field}", m[field], "describes the layers a second time beside "
            "model.layer_types; unset it and say each layer's kind in model.layer_types "
            "(sliding_attention, +moe)")
  sliding = any(kind.attention == "sliding_attention" for kind in kinds)
  if sliding and m.sliding_window is None:
    _fail("model.layer_types", declared, "has sliding_attention layers but "
          "model.sliding_window is None; set the window they use")
  if m.sliding_window is not None and not sliding:
    _fail("model.sliding_window", m.sliding_window, "is set but no kind of model.layer_types "
          "is sliding_attention; unset it or name the sliding layers in model.layer_types")
  if any(kind.attention == "linear_attention" for kind in kinds):
    _validate_linear(m)
  moe = any(kind.moe for kind in kinds)
  if moe and not m.num_experts:
    _fail("model.layer_types", declared, f"has {MOE_SUFFIX} layers but model.num_experts=0; "
          "set the experts they hold")
  if m.num_experts and not moe:
    _fail("model.num_experts", m.num_experts, f"is set but no kind of model.layer_types ends "
          f"in {MOE_SUFFIX}; mark the layers with experts (e.g. 'full_attention{MOE_SUFFIX}') "
          "or set it to 0")


def _validate_linear(m: config_dict.ConfigDict) -> None:
  """The linear_attention layers' fields (model/gated_deltanet.py)."""
  if m.family != "decoder":
    _fail("model.layer_types", m.layer_types, f"linear_attention layers are causal (Gated "
          f"DeltaNet's state runs forward): for model.family=decoder, not {m.family}")
  for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim"):
    _check_positive(m, f"model.{field}", "model.", allow_none=True)
  for field in ("linear_conv_kernel_dim", "linear_chunk_size"):
    _check_positive(m, f"model.{field}", "model.")
  heads = linear_heads(m)
  if heads["linear_num_value_heads"] % heads["linear_num_key_heads"]:
    _fail("model.linear_num_value_heads", heads["linear_num_value_heads"],
          f"must be a multiple of model.linear_num_key_heads={heads['linear_num_key_heads']} "
          "(each key head serves as many value heads)")


def _validate_window_layers(m: config_dict.ConfigDict) -> None:
  """`model.sliding_window_layers`: distinct layer indices, with a window."""
  layers = m.sliding_window_layers
  if layers is None:
    return
  if m.sliding_window is None:
    _fail("model.sliding_window_layers", layers,
          "needs model.sliding_window (the window those layers use); set it or unset this")
  _validate_layer_tuple(m, "sliding_window_layers")


def _validate_layer_tuple(m: config_dict.ConfigDict, field: str) -> None:
  """`model.<field>`: a non-empty tuple of distinct layer indices (or None)."""
  layers = m[field]
  if (not isinstance(layers, (tuple, list)) or not layers
      or any(not isinstance(i, int) or isinstance(i, bool) for i in layers)):
    _fail(f"model.{field}", layers,
          "must be a non-empty tuple of layer indices, e.g. (1, 2) (None: every layer)")
  if len(set(layers)) != len(layers) or not all(0 <= i < m.num_layers for i in layers):
    _fail(f"model.{field}", layers,
          f"must name distinct layers in 0..{m.num_layers - 1} (model.num_layers="
          f"{m.num_layers})")


def _validate_mup(m: config_dict.ConfigDict) -> None:
  """model.parametrization=mup and what it covers (docs/models.md, "μP")."""
  _check_choice(m, "model.parametrization", "model.")
  _check_positive(m, "model.mup_base_width", "model.", allow_none=True)
  _check_positive(m, "model.mup_base_depth", "model.", allow_none=True)
  if m.mup_base_depth is not None:
    if m.norm_position != "pre":
      _fail("model.mup_base_depth", m.mup_base_depth, "scales pre-norm residual branches; "
            "use model.norm_position=pre or unset it")
    if m.family == "encoder_decoder" and num_decoder_layers(m) != m.num_layers:
      _fail("model.mup_base_depth", m.mup_base_depth, "needs both stacks of one depth "
            f"(model.num_layers={m.num_layers}, decoder {num_decoder_layers(m)}); unset it")
  if not m.mup_output_mult > 0:
    _fail("model.mup_output_mult", m.mup_output_mult, "must be positive")
  if m.parametrization != "mup":
    if m.mup_base_width is not None:
      _fail("model.mup_base_width", m.mup_base_width, "needs model.parametrization=mup")
    if m.mup_output_mult != 1.0:
      _fail("model.mup_output_mult", m.mup_output_mult, "needs model.parametrization=mup; "
            "unset it")
    return
  refusals = (("attention_scale", m.attention_scale is not None,
               "sets the attention scale that μP decides (sqrt(base head_dim) / head_dim)"),
              ("num_experts", bool(m.num_experts), "is not covered by μP here (its router is "
               "a readout of its own)"),
              ("num_labels", bool(m.num_labels), "is not covered by μP here (a classifier "
               "head)"),
              ("head_transform", bool(m.head_transform), "is not covered by μP here (a dense "
               "layer inside the head)"))
  for field, refused, why in refusals:
    if refused:
      _fail(f"model.{field}", m[field], f"{why}; use model.parametrization=sp")


def _validate_moe(m: config_dict.ConfigDict) -> None:
  """The mixture-of-experts fields (model/moe.py)."""
  _check_positive(m, "model.num_experts", "model.", allow_zero=True)
  _check_positive(m, "model.num_shared_experts", "model.", allow_zero=True)
  if not m.num_experts:
    if m.moe_capacity_factor:
      _fail("model.moe_capacity_factor", m.moe_capacity_factor,
            "needs model.num_experts > 0 (a mixture of experts); set it to 0")
    for field in ("moe_layers", "moe_d_ff"):
      if m[field] is not None:
        _fail(f"model.{field}", m[field], "needs model.num_experts > 0 (a mixture of experts); "
              "unset it")
    if m.num_shared_experts:
      _fail("model.num_shared_experts", m.num_shared_experts,
            "needs model.num_experts > 0 (a mixture of experts); set it to 0")
    if m.moe_router == "deepseek":
      _fail("model.moe_router", m.moe_router, "needs model.num_experts > 0 (a mixture of "
            "experts); set model.num_experts")
    for field, default in _DEEPSEEK_ROUTER.items():
      if m[field] != default:
        _fail(f"model.{field}", m[field], "needs model.num_experts > 0 and "
              f"model.moe_router=deepseek; set it to {default}")
    return
  if m.family != "decoder":
    _fail("model.num_experts", m.num_experts,
          f"mixtures of experts are built for decoders (model.family=decoder, not {m.family})")
  _check_positive(m, "model.experts_per_token", "model.")
  if m.experts_per_token > m.num_experts:
    _fail("model.experts_per_token", m.experts_per_token,
          f"must be <= model.num_experts={m.num_experts} (each token's top k of them)")
  _check_positive(m, "model.moe_d_ff", "model.", allow_none=True)
  if not (isinstance(m.moe_capacity_factor, (int, float)) and m.moe_capacity_factor >= 0):
    _fail("model.moe_capacity_factor", m.moe_capacity_factor,
          "must be >= 0 (0: dropless; else each expert's capacity in tokens x k / E)")
  if m.moe_layers is not None:
    _validate_layer_tuple(m, "moe_layers")
  _validate_deepseek_router(m)


# The fields only `model.moe_router=deepseek` reads, with their defaults.
_DEEPSEEK_ROUTER = {"moe_n_group": 1, "moe_topk_group": 1, "moe_routed_scaling_factor": 1.0,
                    "moe_group_mask_fill": "-inf"}


def _validate_deepseek_router(m: config_dict.ConfigDict) -> None:
  """DeepSeek-V3's router fields (model/moe.py `route_sigmoid`): set only
  under `moe_router=deepseek`; groups that split the experts, at least two
  experts each, enough eligible experts for the top k, a group mask fill
  only with groups to mask."""
  if m.moe_router != "deepseek":
    for field, default in _DEEPSEEK_ROUTER.items():
      if m[field] != default:
        _fail(f"model.{field}", m[field], "is read by model.moe_router=deepseek only (not "
              f"{m.moe_router}); set it to {default} or use moe_router=deepseek")
    return
  _check_positive(m, "model.moe_n_group", "model.")
  _check_positive(m, "model.moe_topk_group", "model.")
  if m.num_experts % m.moe_n_group or (m.moe_n_group > 1 and m.num_experts < 2 * m.moe_n_group):
    _fail("model.moe_n_group", m.moe_n_group, f"must split model.num_experts={m.num_experts} "
          "into equal groups of at least 2 experts (a group scores by its best two)")
  if m.moe_n_group == 1 and m.moe_group_mask_fill != "-inf":
    _fail("model.moe_group_mask_fill", m.moe_group_mask_fill,
          "is read with model.moe_n_group > 1 only (no group is masked); set it to '-inf'")
  if m.moe_topk_group > m.moe_n_group:
    _fail("model.moe_topk_group", m.moe_topk_group,
          f"must be <= model.moe_n_group={m.moe_n_group} (the groups a token may use)")
  eligible = m.moe_topk_group * m.num_experts // m.moe_n_group
  if m.experts_per_token > eligible:
    _fail("model.experts_per_token", m.experts_per_token,
          f"must be <= the {eligible} experts of model.moe_topk_group={m.moe_topk_group} groups")
  if not (isinstance(m.moe_routed_scaling_factor, (int, float))
          and m.moe_routed_scaling_factor > 0):
    _fail("model.moe_routed_scaling_factor", m.moe_routed_scaling_factor, "must be positive")


def _validate_rope_scaling(m: config_dict.ConfigDict) -> None:
  """The parameters of rope_scaling=yarn and llama3 (as transformers reads them)."""
  _check_positive(m, "model.rope_original_max_len", "model.")
  if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow < m.rope_beta_fast:
    _fail("model.rope_beta_fast", m.rope_beta_fast,
          f"must exceed model.rope_beta_slow={m.rope_beta_slow} > 0 (rotations per context)")
  if m.rope_attention_factor is not None and m.rope_scaling != "yarn":
    _fail("model.rope_attention_factor", m.rope_attention_factor,
          f"is for model.rope_scaling=yarn (not {m.rope_scaling}); unset it")
  if m.rope_attention_factor is not None and m.rope_attention_factor <= 0:
    _fail("model.rope_attention_factor", m.rope_attention_factor, "must be positive or None")
  if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    _fail("model.rope_high_freq_factor", m.rope_high_freq_factor,
          f"must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} > 0")


def validate(config: config_dict.ConfigDict) -> None:
  """Checks a whole run config (model, tokenizer, data, train, mesh)."""
  validate_model(config.model)
  for field in ("tokenizer.kind", "data.source", "data.packing", "data.task",
                "data.task_addition_format", "train.objective", "train.loss_impl"):
    _check_choice(config, field)
  for field in ("train.num_steps", "train.batch_size", "train.seq_len",
                "train.grad_accum_steps", "train.log_every", "train.eval_steps", "train.checkpoint_every", "train.keep_checkpoints",
                "tokenizer.vocab_size", "data.task_size", "data.task_test_size",
                "data.task_min_len", "data.task_max_len", "tokenizer.train_bytes"):
    _check_positive(config, field)
  for field in ("train.warmup_steps", "train.tgt_seq_len", "data.task_test_min_len",
                "data.tokenize_workers", "train.loss_chunk_size"):
    _check_positive(config, field, allow_zero=True)
  _check_positive(config, "train.eval_every", allow_none=True)
  _check_positive(config, "data.seed", allow_none=True, allow_zero=True)
  _check_positive(config, "train.restore_step", allow_none=True)
  _validate_budget(config.train)
  remat_name(config.train.remat)
  family, objective = config.model.family, config.train.objective
  if objective not in OBJECTIVES[family]:
    _fail("train.objective", objective,
          f"does not fit model.family={family}; use one of {', '.join(OBJECTIVES[family])}")
  _validate_tasks(config)
  _validate_downstream(config)
  for field in ("train.seq_len", "train.tgt_seq_len"):
    if config.model.pos_emb == "learned" and _get(config, field) > config.model.max_len:
      _fail(field, _get(config, field),
            f"exceeds the learned position table (model.max_len={config.model.max_len}); "
            "raise model.max_len or use another pos_emb")
  if config.train.batch_size % config.train.grad_accum_steps:
    _fail("train.grad_accum_steps", config.train.grad_accum_steps,
          f"must divide train.batch_size={config.train.batch_size}")
  _validate_optimizer(config.train)
  _validate_tracking(config.train)
  if not config.tokenizer.path and config.tokenizer.vocab_size > real_vocab_size(config.model):
    field = token_rows_field(config.model)
    _fail("tokenizer.vocab_size", config.tokenizer.vocab_size,
          f"exceeds model.{field}={config.model[field]}")
  if mixture_parts(config.data):
    _validate_mixture(config)
  elif config.data.source in FILE_SOURCES and not config.data.paths:
    _fail("data.paths", config.data.paths, f"is required for data.source={config.data.source}")
  if not 0 <= config.data.val_percent < 100:
    _fail("data.val_percent", config.data.val_percent, "must be in [0, 100)")
  if not config.data.tokenize_wait_s > 0:
    _fail("data.tokenize_wait_s", config.data.tokenize_wait_s, "must be positive")
  if not config.train.z_loss >= 0:
    _fail("train.z_loss", config.train.z_loss, "must be >= 0 (0: no z-loss)")
  for field in ("moe_aux_loss", "router_z_loss", "moe_seq_aux_loss"):
    if not config.train[field] >= 0:
      _fail(f"train.{field}", config.train[field], "must be >= 0 (0: none)")
    if config.train[field] and not config.model.num_experts:
      _fail(f"train.{field}", config.train[field],
            "weighs a mixture of experts' router loss, but model.num_experts=0 (a dense "
            "model); set it to 0")
  _validate_bias_update(config)
  _validate_mtp(config)
  _validate_loss_impl(config)
  if not 0 < config.train.mlm_probability < 1:
    _fail("train.mlm_probability", config.train.mlm_probability, "must be in (0, 1)")
  for axis in ("data", "fsdp", "context", "tensor"):
    value = config.mesh[axis]
    if not isinstance(value, int) or (value < 1 and value != -1):
      _fail(f"mesh.{axis}", value, "must be a positive integer or -1 (the rest)")
  _validate_expert(config)
  _validate_context(config)


def _validate_bias_update(config) -> None:
  """train.moe_bias_update_rate: >= 0, and > 0 only for a mixture of experts
  with the deepseek router (the one with a selection bias)."""
  rate, m = config.train.moe_bias_update_rate, config.model
  if not (isinstance(rate, (int, float)) and rate >= 0):
    _fail("train.moe_bias_update_rate", rate, "must be >= 0 (0: off; DeepSeek-V3: 0.001)")
  if rate and not m.num_experts:
    _fail("train.moe_bias_update_rate", rate, "moves a mixture of experts' selection bias, but "
          "model.num_experts=0 (a dense model); set it to 0")
  if rate and m.moe_router != "deepseek":
    _fail("train.moe_bias_update_rate", rate, "moves the selection bias of "
          f"model.moe_router=deepseek only (not {m.moe_router}); use moe_router=deepseek or "
          "set it to 0")


def _validate_expert(config) -> None:
  """mesh.expert > 1: the experts of a mixture split over that many devices."""
  n, m = config.mesh.expert, config.model
  if not isinstance(n, int) or n < 1:
    _fail("mesh.expert", n, "must be a positive integer (the devices the experts split over)")
  if n == 1:
    return
  if not m.num_experts:
    _fail("mesh.expert", n, "splits a mixture of experts' experts, but model.num_experts=0 "
          "(a dense model); use mesh.expert=1, or mesh.data for the batch")
  if m.num_experts % n:
    _fail("mesh.expert", n, f"must divide model.num_experts={m.num_experts} (each device "
          "holds num_experts / expert of them)")


def _validate_loss_impl(config) -> None:
  """train.loss_impl=pallas (model/kernels/fused_loss.py): an LM head the
  fused kernel computes (no soft-cap, no bias over the vocabulary), whole
  (the kernel keeps the logits on chip: no loss chunks)."""
  t, m = config.train, config.model
  if t.loss_impl != "pallas":
    return
  if t.objective == "classify":
    _fail("train.loss_impl", t.loss_impl, "fuses an LM head and its loss; train.objective="
          "classify has none; use train.loss_impl=xla")
  if m.final_softcap is not None:
    _fail("train.loss_impl", t.loss_impl, f"has no soft-capped logits (model.final_softcap="
          f"{m.final_softcap}); use train.loss_impl=xla")
  if m.output_bias:
    _fail("train.loss_impl", t.loss_impl, "has no bias over the vocabulary (model.output_bias"
          "=True); use train.loss_impl=xla")
  if t.loss_chunk_size:
    _fail("train.loss_chunk_size", t.loss_chunk_size, "chunks the xla loss; train.loss_impl="
          "pallas never makes the logits; set train.loss_chunk_size=0")


def _validate_mtp(config) -> None:
  """train.mtp_depth / mtp_weight: multi-token prediction modules after a
  next_token decoder (model/mtp.py)."""
  t, m = config.train, config.model
  if not isinstance(t.mtp_depth, int) or t.mtp_depth < 0:
    _fail("train.mtp_depth", t.mtp_depth,
          "must be an integer >= 0 (0: no multi-token prediction)")
  if not t.mtp_weight >= 0:
    _fail("train.mtp_weight", t.mtp_weight, "must be >= 0 (DeepSeek-V3: 0.3, then 0.1)")
  if not t.mtp_depth:
    return
  if m.family != "decoder" or t.objective != "next_token":
    _fail("train.mtp_depth", t.mtp_depth, f"predicts further tokens of a next_token decoder, "
          f"not model.family={m.family} with train.objective={t.objective}; set it to 0")
  if t.mtp_depth >= t.seq_len:
    _fail("train.mtp_depth", t.mtp_depth,
          f"must be below train.seq_len={t.seq_len} (depth k predicts k + 1 tokens ahead)")
  if config.mesh.context != 1:
    _fail("train.mtp_depth", t.mtp_depth, f"does not run with rows split over mesh.context="
          f"{config.mesh.context}; set mesh.context=1 or train.mtp_depth=0")
  if m.num_labels:
    _fail("train.mtp_depth", t.mtp_depth, "needs a language-model head, but model.num_labels="
          f"{m.num_labels} makes a classifier; set it to 0")


def _validate_context(config) -> None:
  """mesh.context > 1: a decoder's rows split over the context axis, in 2 x
  context chunks (the zig-zag layout), attended by the ring or all-gather.
  What the attention takes there is checked by the model
  (`model.attention.check_context`)."""
  _check_choice(config, "mesh.context_strategy")
  n, m, t = config.mesh.context, config.model, config.train
  if n == 1:
    return
  if n == -1:
    _fail("mesh.context", n, "must be a positive integer (the devices each row is split over)")
  if m.family != "decoder":
    _fail("mesh.context", n, f"splits the sequence of a decoder's rows; model.family={m.family} "
          "is not supported yet (use mesh.context=1)")
  if t.seq_len % (2 * n):
    _fail("train.seq_len", t.seq_len, f"must be a multiple of 2 x mesh.context = {2 * n} "
          "(the zig-zag layout gives each device two chunks of every row)")
  if linear_layers(m) and t.seq_len // (2 * n) < m.linear_conv_kernel_dim - 1:
    _fail("train.seq_len", t.seq_len, f"gives chunks of {t.seq_len // (2 * n)} tokens over "
          f"2 x mesh.context = {2 * n}, fewer than the {m.linear_conv_kernel_dim - 1} inputs "
          "before a token the linear_attention convolution reads; use a longer seq_len or a "
          "smaller mesh.context")


def _validate_tracking(t: config_dict.ConfigDict) -> None:
  """train.trackers: known names, each once. train.profile_steps: "" or
  "first,last" with 1 <= first <= last <= num_steps (unchecked against a
  budget's num_steps, not known yet: a trace past the run's end stops with it)."""
  names = trackers(t)
  for name in names:
    if name not in TRACKERS:
      _fail("train.trackers", t.trackers, f"{name!r} is not a tracker; name some of "
            f"{', '.join(TRACKERS)}, comma-separated (\"\": none)")
    if names.count(name) > 1:
      _fail("train.trackers", t.trackers, f"names {name} twice; name each tracker once")
  value = t.profile_steps
  if not value.strip():
    return
  parts = value.split(",")
  limit = t.num_steps if budget(t) is None else math.inf
  if (len(parts) != 2 or not all(p.strip().isdigit() for p in parts)
      or not 1 <= int(parts[0]) <= int(parts[1]) <= limit):
    within = "" if budget(t) else f" <= train.num_steps={t.num_steps}"
    _fail("train.profile_steps", value, f"must be \"first,last\", two step numbers with "
          f"1 <= first <= last{within} (e.g. \"10,15\"; \"\": no trace)")


def _validate_budget(t: config_dict.ConfigDict) -> None:
  """train.token_budget and train.flop_budget: non-negative, at most one set."""
  for field in ("token_budget", "flop_budget"):
    if not t[field] >= 0:
      _fail(f"train.{field}", t[field], "must be >= 0 (0: unused)")
  if t.token_budget and t.flop_budget:
    _fail("train.flop_budget", t.flop_budget, f"and train.token_budget={t.token_budget:g} "
          "both set train.num_steps; set one of them to 0")


def _check_range(t, field: str, low: float, high: float, *, low_open=False,
                 high_open=True) -> None:
  """train.<field> within low..high (each end open or closed); None passes."""
  value = t[field]
  if value is None:
    return
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not (low < value if low_open else low <= value)
      or not (value < high if high_open else value <= high)):
    _fail(f"train.{field}", value,
          f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")


def _validate_optimizer(t: config_dict.ConfigDict) -> None:
  """The optimizer, its own fields, the learning-rate schedule and restore_branch."""
  for field in ("train.optimizer", "train.schedule"):
    _check_choice(t, field, "train.")
  for optimizer, options in OPTIMIZER_OPTIONS.items():
    for field in options:
      if t[field] is not None and t.optimizer != optimizer:
        _fail(f"train.{field}", t[field], f"is for train.optimizer={optimizer} (not "
              f"{t.optimizer}); unset it")
  if t.decay_fraction is not None and t.schedule != "wsd":
    _fail("train.decay_fraction", t.decay_fraction,
          f"is for train.schedule=wsd (not {t.schedule}); unset it")
  for field in ("learning_rate", "muon_lr", "embedding_lr_mult"):
    if t[field] is not None and not t[field] > 0:
      _fail(f"train.{field}", t[field], "must be positive")
  for field in ("b1", "b2", "lion_b1", "lion_b2", "adafactor_momentum", "muon_momentum"):
    _check_range(t, field, 0, 1)
  _check_range(t, "min_lr_ratio", 0, 1, high_open=False)
  _check_range(t, "decay_fraction", 0, 1, low_open=True, high_open=False)
  _check_range(t, "warmup_fraction", 0, 1)
  _check_range(t, "adafactor_decay_rate", 0, 1, low_open=True, high_open=False)
  for field in ("weight_decay", "adafactor_clipping", "muon_rms"):
    _check_range(t, field, 0, float("inf"))
  for field in ("adafactor_min_dim_to_factor", "muon_ns_steps"):
    _check_positive(t, f"train.{field}", "train.", allow_none=True)
  if t.schedule == "inverse_sqrt" and t.warmup_fraction == 0:
    _fail("train.warmup_fraction", t.warmup_fraction, "must be > 0 for train.schedule="
          "inverse_sqrt (learning_rate * sqrt(warmup_steps / step) after it)")
  if t.schedule == "inverse_sqrt" and t.warmup_steps < 1 and t.warmup_fraction is None:
    _fail("train.warmup_steps", t.warmup_steps, "must be >= 1 for train.schedule=inverse_sqrt "
          "(learning_rate * sqrt(warmup_steps / step) after it)")
  if t.schedule == "wsd" and not t.warmup_steps <= decay_start(t) < t.num_steps:
    _fail("train.decay_fraction", t.decay_fraction,
          f"must leave the decay at least one step, after the warm-up: "
          f"{decay_fraction(t):g} x num_steps={t.num_steps} is "
          f"{t.num_steps - decay_start(t)} steps, and train.warmup_steps={t.warmup_steps}; "
          "change either")
  if t.restore_branch and not t.restore_from:
    _fail("train.restore_branch", t.restore_branch,
          "needs train.restore_from (the run to branch from); set it or unset this")
  if t.restore_step is not None and not t.restore_from:
    _fail("train.restore_step", t.restore_step,
          "needs train.restore_from (the run whose checkpoint it names); set it or unset this")


def _validate_mixture(config) -> None:
  """data.mixture mixes text corpora, whose sources name their own paths."""
  d, objective = config.data, config.train.objective
  if objective not in ("next_token", "mlm"):
    _fail("data.mixture", d.mixture, f"mixes text corpora (next_token, mlm); "
          f"train.objective={objective} reads data.task: unset data.mixture")
  if d.paths:
    _fail("data.paths", d.paths, "is unused beside data.mixture, whose sources name their "
          "own paths (source:paths=weight); unset data.paths")


def _validate_tasks(config: config_dict.ConfigDict) -> None:
  """The task fields (data.task and its lengths, the classifier's labels)."""
  d, objective = config.data, config.train.objective
  wanted = TASKS.get(objective, ("none",))
  if d.task not in wanted:
    (needs,) = [o for o, tasks in TASKS.items() if d.task in tasks] or [None]
    if d.task == "none":
      _fail("data.task", d.task, f"train.objective={objective} needs a task: one of "
            f"{', '.join(wanted)}")
    if needs is None:
      _fail("data.task", d.task, f"is not a task of train.objective={objective}; use one of "
            f"{', '.join(wanted)}")
    choice = f"={wanted[0]}" if len(wanted) == 1 else f" to one of {', '.join(wanted)}"
    _fail("data.task", d.task, f"needs train.objective={needs} (is {objective}); set "
          f"data.task{choice} for {objective}")
  num_labels = config.model.num_labels
  if (objective == "classify") != (num_labels > 0):
    _fail("model.num_labels", num_labels, "must be the number of classes (> 0) for "
          "train.objective=classify" if objective == "classify" else
          f"is for train.objective=classify (a classifier has no LM head for {objective}); "
          "set it to 0")
  if d.labels and len(d.labels) != num_labels:
    _fail("data.labels", tuple(d.labels), f"names {len(d.labels)} classes but "
          f"model.num_labels={num_labels}; make them agree")
  if d.task == "labelled" and not d.paths:
    _fail("data.paths", d.paths, "is required for data.task=labelled (.tsv or .jsonl files)")
  if d.pair_specials and config.model.family != "encoder_decoder":
    _fail("data.pair_specials", d.pair_specials, "is for model.family=encoder_decoder (a "
          "decoder's prefix-LM row is BOS src EOS tgt EOS); unset it")
  if d.task_max_len < d.task_min_len:
    _fail("data.task_max_len", d.task_max_len,
          f"must be >= data.task_min_len={d.task_min_len}")
  if d.task_test_min_len and not d.task_min_len <= d.task_test_min_len <= d.task_max_len:
    _fail("data.task_test_min_len", d.task_test_min_len,
          f"must be 0 or in [data.task_min_len, data.task_max_len] = "
          f"[{d.task_min_len}, {d.task_max_len}]")
  if d.task == "pairs" and not d.paths:
    _fail("data.paths", d.paths, "is required for data.task=pairs (.tsv or .jsonl files)")


def _named(field: str) -> str:
  """How an error names `field`: a config field, or a flag (`--tasks`) as given."""
  return field if field.startswith("--") else f"config field {field}"


def downstream_task_names(value: str, field: str = "train.downstream_tasks") -> tuple[str, ...]:
  """The lm-eval task names of the comma-separated `value` ("": none);
  `field` (train.downstream_tasks or eval.py's --tasks) names it in the error.
  Whether lm-eval knows them is checked where it is imported
  (`training/downstream.py`)."""
  if not isinstance(value, str):
    raise UserError(f"{_named(field)}={value!r}: must be a comma-separated string of lm-eval "
                    "task names, e.g. hellaswag,arc_easy")
  names = tuple(name.strip() for name in value.split(",")) if value.strip() else ()
  if any(not name for name in names):
    raise UserError(f"{_named(field)}={value!r}: has an empty task name; separate the names "
                    "with single commas, e.g. hellaswag,arc_easy")
  if len(set(names)) < len(names):
    raise UserError(f"{_named(field)}={value!r}: names a task twice; name each once")
  return names


def check_downstream_model(m, field: str, value: str) -> None:
  """lm-eval tasks (`field`=`value`) score a decoder's next-token log-probabilities."""
  if m.family != "decoder":
    raise UserError(f"{_named(field)}={value!r}: lm-eval tasks score a decoder language model, "
                    f"this one is model.family={m.family}; evaluate a decoder run")
  if m.num_labels:
    raise UserError(f"{_named(field)}={value!r}: a classifier (model.num_labels="
                    f"{m.num_labels}) has no LM head for lm-eval tasks; evaluate a language model")


def _validate_downstream(config: config_dict.ConfigDict) -> None:
  """train.downstream_*: lm-eval tasks scored in the training loop."""
  t = config.train
  names = downstream_task_names(t.downstream_tasks)
  if names:
    check_downstream_model(config.model, "train.downstream_tasks", t.downstream_tasks)
  if t.downstream_task_dir and not names:
    _fail("train.downstream_task_dir", t.downstream_task_dir,
          "adds task YAMLs for train.downstream_tasks, which is empty; name the tasks to run "
          "or unset this")
  _check_positive(config, "train.downstream_limit", allow_zero=True)
  _check_positive(config, "train.downstream_batch_size")
