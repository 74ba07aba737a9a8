"""What every Hugging Face architecture mapping shares.

`Tensor`: one HF tensor and the parameters of ours it fills, with the
transposes and reshapes both ways; the constructors below for torch's layouts
(a torch `Linear` weight is [out, in], ours are [in, ...]). `Architecture`:
one HF `model_type`, its config mapping and tensor table. `check_fields`
refuses an HF config field the mapping neither honours nor knows to be inert.
"""
import dataclasses
from collections.abc import Callable

from configs.errors import UserError

# HF config fields that do not change what the model computes at inference:
# bookkeeping, token ids (the tokenizer carries them), dropouts (our model has
# none; a fine-tune runs without them) and initialisation.
INERT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout",
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type",
    "summary_use_proj", "task_specific_params", "n_ctx", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "reorder_and_upcast_attn",
    "gradient_checkpointing", "hidden_dropout_prob", "attention_probs_dropout_prob",
    "classifier_dropout", "_name_or_path", "_attn_implementation_autoset",
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor and the parameters of ours it holds.

  `to_ours(array)` gives one array per path in `paths`; `to_hf(*arrays)`
  packs them back. `vocab_axis`: the axis of our (single) array that runs over
  the vocabulary (cut to `model.real_vocab_size` on export), None if none.
  `zeros_if_missing`: a file without it is read as zeros, as transformers
  does (BART's `final_logits_bias` in files saved from `BartModel`).
  """
  hf_name: str
  paths: tuple[str, ...]
  to_ours: Callable
  to_hf: Callable
  vocab_axis: int | None = None
  zeros_if_missing: bool = False


def same(name, path, vocab_axis=None):
  return Tensor(name, (path,), lambda w: (w,), lambda w: w, vocab_axis)


def transposed(name, path, vocab_axis=None):
  """A torch Linear [out, in] <-> our [in, out]."""
  return Tensor(name, (path,), lambda w: (w.T,), lambda k: k.T, vocab_axis)


def bias_in(name, path, heads, d):
  """A torch Linear bias [heads*d] <-> our projection bias [heads, d]."""
  return Tensor(name, (path,), lambda b: (b.reshape(heads, d),), lambda b: b.reshape(-1))


def linear_in(name, path, m, heads, d):
  """torch Linear [heads*d, m] <-> our projection [m, heads, d]."""
  return Tensor(name, (path,), lambda w: (w.T.reshape(m, heads, d),),
                lambda k: k.reshape(m, heads * d).T)


def linear_out(name, path, heads, d, m):
  """torch Linear [m, heads*d] <-> our output projection [heads, d, m]."""
  return Tensor(name, (path,), lambda w: (w.T.reshape(heads, d, m),),
                lambda k: k.reshape(heads * d, m).T)


def check_fields(hf: dict, honoured: set, required: dict, name: str) -> None:
  """Refuses the first HF field that is neither honoured, inert, nor at the
  value `required` gives it (a required False also takes null)."""
  for key, value in hf.items():
    if key in required:
      if value != required[key] and not (required[key] is False and not value):
        raise UserError(f"Hugging Face config field {key}={value!r} is not supported by the "
                        f"{name} import (needs {required[key]!r})")
    elif key not in honoured and key not in INERT:
      raise UserError(f"Hugging Face config field {key}={value!r} is not supported by the "
                      f"{name} import")


def classifier_fields(hf: dict, name: str) -> tuple[dict, dict]:
  """(the HF config without the classification fields, our classifier's
  fields) of a `*ForSequenceClassification` config.json: `num_labels` from
  `id2label` (transformers' default: 2); `problem_type` must be single-label
  (regression and multi-label train with other losses)."""
  kind = hf.get("problem_type")
  if kind not in (None, "single_label_classification"):
    raise UserError(f"Hugging Face config field problem_type={kind!r} is not supported by the "
                    f"{name} import (needs single_label_classification: one class per text)")
  id2label = hf.get("id2label")
  num_labels = len(id2label) if id2label else hf.get("num_labels", 2)
  rest = {k: v for k, v in hf.items() if k not in ("problem_type", "num_labels")}
  return rest, {"num_labels": num_labels}


def label_names(hf: dict, num_labels: int) -> tuple[str, ...]:
  """The class names of a classifier's config.json in id order (`id2label`,
  whose keys JSON writes as strings; transformers' LABEL_i without one)."""
  id2label = {str(k): v for k, v in (hf.get("id2label") or {}).items()}
  return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))


def labels_to_hf(names) -> dict:
  """`id2label` and `label2id` of the class names in id order."""
  return {"id2label": {str(i): name for i, name in enumerate(names)},
          "label2id": {name: i for i, name in enumerate(names)}}


@dataclasses.dataclass(frozen=True)
class MTPLayers:
  """How an architecture's checkpoints hold multi-token prediction modules
  (`model/mtp.py`, train.mtp_depth), which transformers' model has not.

  `depth(hf, names)`: the modules an import reads (its train.mtp_depth; 0:
  none, read past as `Architecture.dropped` says) from config.json and the
  file's tensor names (after the prefix). `tensors(cfg, depth)`: their
  tensors, both ways. `copies(cfg, depth)`: tensors the file holds again
  for each module that are the model's own (the embedding, the head):
  written by an export, read past by an import. `config(depth)`: the
  config.json fields of an export with `depth` modules.
  """
  depth: Callable[[dict, set], int]
  tensors: Callable
  copies: Callable
  config: Callable[[int], dict]


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One Hugging Face architecture (see the module docstring).

  `prefix`: the body's prefix in HF tensor names ("model."), optional in files
  (GPT-2's own checkpoint has none); names starting with one of `unprefixed`
  (the heads: "lm_head.", BERT's "cls.") never have it.
  `skipped`: tensor-name suffixes read past: buffers, and weights of other
  heads that the architecture's model does not use (BERT's pooler and
  next-sentence head).
  `read_past(cfg)`: tensor names in files that transformers does not use with
  this config: a tied head's own copy; untied BERT's `cls.predictions.bias`
  (its decoder has its own).
  `objective`: our `train.objective` for fine-tuning an import (`classify`:
  a `*ForSequenceClassification`, whose config.json names its labels).
  `auto_class`: the transformers Auto class that loads an export.
  `tied_head`: (head, embedding) tensor names as in files: an import whose
  config ties them is untied when the file holds the head with other values
  than the embedding, as transformers 5 loads it (T5 v1.1 saved by
  transformers 5: its T5Config always says tie_word_embeddings=true).
  `dropped(hf)`: tensor-name prefixes (after `prefix`) an import reads past,
  modules of the checkpoint that transformers' model has not (DeepSeek-V3's
  multi-token-prediction layers, where the import does not read them).
  `mtp`: an `MTPLayers` where the checkpoints can hold multi-token
  prediction modules that import as ours (None: an export writes none).
  """
  model_type: str
  hf_class: str
  prefix: str
  config_from_hf: Callable[[dict], dict]
  config_to_hf: Callable
  tensors: Callable
  skipped: tuple[str, ...] = ()
  unprefixed: tuple[str, ...] = ("lm_head.",)
  read_past: Callable = lambda cfg: ("lm_head.weight",) if cfg.tie_embeddings else ()
  objective: str = "next_token"
  auto_class: str = "AutoModelForCausalLM"
  tied_head: tuple[str, str] = ()
  dropped: Callable = lambda hf: ()
  mtp: MTPLayers | None = None


ROTARY = (".rotary_emb.inv_freq",)
