"""Per-architecture mappings between Hugging Face checkpoints and our models.

An `Architecture` says, for one Hugging Face `model_type`:
- `config_from_hf(hf)`: the HF config.json -> our `model` fields; every HF
  field is either honoured, known to leave the forward pass unchanged
  (`tables.INERT`: dropouts, token ids, bookkeeping), or refused by name;
- `config_to_hf(cfg, vocab_size)`: our config -> the HF config.json fields.
  It never raises: a value the architecture cannot express is written as the
  nearest one it can, so that the export check (`convert.export_architecture`,
  the round trip through `config_from_hf`) names our field that does not come
  back;
- `tensors(cfg)`: each HF tensor name with our parameter paths it fills
  (`Tensor`, with the transposes/reshapes both ways).

One module per family (`gpt2.py`, `bloom.py`, `llama.py` with Mixtral and
Qwen3-MoE, `deepseek.py` (V2, V3), `qwen3_next.py`, `bert.py`, `t5.py`, `bart.py`)
over the shared machinery of `tables.py`; a new architecture is one more
module and one more entry in `ARCHITECTURES`.
"""
from configs.errors import UserError
from hf import bart, bert, bloom, deepseek, gpt2, llama, qwen3_next, t5
from hf.tables import Architecture

ARCHITECTURES = {a.model_type: a for a in (gpt2.GPT2, llama.LLAMA, llama.MISTRAL, llama.QWEN2,
                                           llama.QWEN3, llama.MIXTRAL, llama.QWEN3_MOE,
                                           deepseek.DEEPSEEK_V3, deepseek.DEEPSEEK_V2,
                                           qwen3_next.QWEN3_NEXT, qwen3_next.QWEN3_5_TEXT,
                                           qwen3_next.QWEN3_5_MOE_TEXT, qwen3_next.QWEN3_5,
                                           qwen3_next.QWEN3_5_MOE,
                                           bert.BERT, t5.T5, t5.MT5, bart.BART, bloom.BLOOM)}

# The sequence classifiers (`*ForSequenceClassification`, our model.num_labels),
# by model_type.
CLASSIFIERS = {a.model_type: a for a in (llama.LLAMA_CLASSIFIER, llama.QWEN2_CLASSIFIER,
                                         bert.BERT_CLASSIFIER)}

# What a model of ours exports as, first match (LLaMA before Mistral: a model
# without a window is LLaMA; an mT5 import exports as T5 v1.1); a classifier
# as the first of CLASSIFIER_EXPORTS. BLOOM is the only one with ALiBi; DeepSeek
# the only ones with MLA (V3 first: a dense MLA model exports as V3); Qwen3.5's text
# model and Qwen3-Next the only ones with linear_attention layers and the attention
# output gate (Qwen3.5 first: a dense hybrid exports as Qwen3.5, one with experts as
# Qwen3-Next; Qwen3.5's MoE and multimodal directories are import only).
EXPORTS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "bert", "t5",
           "bart", "bloom", "deepseek_v3", "deepseek_v2", "qwen3_5_text", "qwen3_next")
CLASSIFIER_EXPORTS = ("llama", "qwen2", "bert")


def is_classifier(hf: dict) -> bool:
  """Whether an HF config.json is a `*ForSequenceClassification`'s."""
  return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or ())


def architecture_of(hf: dict) -> Architecture:
  """The mapping for an HF config.json (its model_type; a sequence classifier's
  by its `architectures`), or a UserError naming what is not supported."""
  kind = hf.get("model_type")
  table = CLASSIFIERS if is_classifier(hf) else ARCHITECTURES
  if kind in table:
    return table[kind]
  what = "sequence-classifier model_type" if table is CLASSIFIERS else "model_type"
  raise UserError(f"Hugging Face {what} {kind!r} is not supported; supported: "
                  f"{', '.join(table)}")
