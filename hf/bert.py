"""BERT: BertForMaskedLM and BertForSequenceClassification (the body, BERT's
pooler on [CLS] and a dense classifier)."""
from configs.errors import UserError
from hf.tables import (Architecture, Tensor, bias_in, check_fields, classifier_fields, labels_to_hf,
                       linear_in, linear_out, same, transposed)


# HF hidden_act -> our model.mlp.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu"}
# Our model.mlp -> the HF name an export writes (the first that maps to it).
ACT_NAMES = {ours: hf for hf, ours in reversed(ACTIVATIONS.items())}


def _bert_from_hf(hf: dict) -> dict:
  """BertForMaskedLM: post-norm encoder, embedding LayerNorm, token types,
  the MLM head transform (dense, hidden_act, LayerNorm) and output bias."""
  check_fields(hf, {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "hidden_act", "max_position_embeddings",
                     "type_vocab_size", "layer_norm_eps", "tie_word_embeddings"},
                {"position_embedding_type": "absolute", "is_decoder": False,
                 "add_cross_attention": False}, "bert")
  act = hf.get("hidden_act", "gelu")
  if act not in ACTIVATIONS:
    raise UserError(f"Hugging Face config field hidden_act={act!r} is not supported by the bert "
                    f"import ({', '.join(ACTIVATIONS)} are)")
  return dict(family="encoder", vocab_size=hf.get("vocab_size", 30522),
              d_model=hf.get("hidden_size", 768), num_layers=hf.get("num_hidden_layers", 12),
              num_heads=hf.get("num_attention_heads", 12), d_ff=hf.get("intermediate_size", 3072),
              max_len=hf.get("max_position_embeddings", 512), pos_emb="learned",
              norm="layernorm", norm_position="post", norm_eps=hf.get("layer_norm_eps", 1e-12),
              mlp=ACTIVATIONS[act], use_bias=True,
              tie_embeddings=hf.get("tie_word_embeddings", True),
              type_vocab_size=hf.get("type_vocab_size", 2), embedding_norm=True,
              head_transform=True, output_bias=True)


def _bert_classifier_from_hf(hf: dict) -> dict:
  """BertForSequenceClassification: the body, [CLS] through the pooler
  (dense + tanh), a classifier with a bias; no masked-LM head."""
  rest, fields = classifier_fields(hf, "bert")
  return dict(_bert_from_hf(rest), head_transform=False, output_bias=False, pooling="cls",
              pooler=True, classifier_bias=True, **fields)


def _bert_to_hf(cfg, vocab_size: int) -> dict:
  act = ACT_NAMES.get(cfg.mlp, "gelu")
  return dict(architectures=["BertForMaskedLM"], model_type="bert", vocab_size=vocab_size,
              hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff, hidden_act=act,
              max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
              layer_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert_classifier_to_hf(cfg, vocab_size: int) -> dict:
  """Written as BERT's whatever our pooling (the round trip names the
  fields that do not come back)."""
  return dict(_bert_to_hf(cfg, vocab_size), architectures=["BertForSequenceClassification"],
              **labels_to_hf([f"LABEL_{i}" for i in range(cfg.num_labels)]))


def _bert_tensors(cfg) -> list[Tensor]:
  """The body's tensors and the masked-LM head, or with `num_labels` the
  pooler and classifier."""
  out = _bert_body_tensors(cfg)
  if cfg.num_labels:
    return out + [transposed("pooler.dense.weight", "classifier/pooler/kernel"),
                  same("pooler.dense.bias", "classifier/pooler/bias"),
                  transposed("classifier.weight", "classifier/out/kernel"),
                  same("classifier.bias", "classifier/out/bias")]
  out += [transposed("cls.predictions.transform.dense.weight", "head_transform/dense/kernel"),
          same("cls.predictions.transform.dense.bias", "head_transform/dense/bias"),
          same("cls.predictions.transform.LayerNorm.weight", "head_transform/norm/scale"),
          same("cls.predictions.transform.LayerNorm.bias", "head_transform/norm/bias"),
          same("cls.predictions.bias" if cfg.tie_embeddings else "cls.predictions.decoder.bias",
               "output_bias", 0)]
  if not cfg.tie_embeddings:
    out.append(transposed("cls.predictions.decoder.weight", "head/kernel", 1))
  return out


def _bert_body_tensors(cfg) -> list[Tensor]:
  m, h, d = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = [same("embeddings.word_embeddings.weight", "encoder/embed/embedding", 0),
         same("embeddings.position_embeddings.weight", "encoder/positions/table"),
         same("embeddings.token_type_embeddings.weight", "encoder/token_types/table"),
         same("embeddings.LayerNorm.weight", "encoder/embedding_norm/scale"),
         same("embeddings.LayerNorm.bias", "encoder/embedding_norm/bias")]
  for i in range(cfg.num_layers):
    hf, ours = f"encoder.layer.{i}.", f"encoder/layers/{i}/"
    for hf_name, p in (("query", "q"), ("key", "k"), ("value", "v")):
      out += [linear_in(f"{hf}attention.self.{hf_name}.weight", f"{ours}attn/{p}_proj/kernel",
                        m, h, d),
              bias_in(f"{hf}attention.self.{hf_name}.bias", f"{ours}attn/{p}_proj/bias", h, d)]
    out += [
        linear_out(hf + "attention.output.dense.weight", ours + "attn/o_proj/kernel", h, d, m),
        same(hf + "attention.output.dense.bias", ours + "attn/o_proj/bias"),
        same(hf + "attention.output.LayerNorm.weight", ours + "norm_attn/scale"),
        same(hf + "attention.output.LayerNorm.bias", ours + "norm_attn/bias"),
        transposed(hf + "intermediate.dense.weight", ours + "mlp/up/kernel"),
        same(hf + "intermediate.dense.bias", ours + "mlp/up/bias"),
        transposed(hf + "output.dense.weight", ours + "mlp/down/kernel"),
        same(hf + "output.dense.bias", ours + "mlp/down/bias"),
        same(hf + "output.LayerNorm.weight", ours + "norm_mlp/scale"),
        same(hf + "output.LayerNorm.bias", ours + "norm_mlp/bias"),
    ]
  return out


def _bert_read_past(cfg) -> tuple[str, ...]:
  """Tied, the decoder's weight and bias are copies of the word embeddings and
  `cls.predictions.bias`; untied, the decoder's bias is the one used."""
  if cfg.tie_embeddings:
    return ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
  return ("cls.predictions.bias",)


BERT = Architecture("bert", "BertForMaskedLM", "bert.", _bert_from_hf, _bert_to_hf,
                    _bert_tensors, unprefixed=("cls.",), read_past=_bert_read_past,
                    objective="mlm", auto_class="AutoModelForMaskedLM",
                    skipped=("embeddings.position_ids", "pooler.dense.weight",
                             "pooler.dense.bias", "cls.seq_relationship.weight",
                             "cls.seq_relationship.bias"))
BERT_CLASSIFIER = Architecture(
    "bert", "BertForSequenceClassification", "bert.", _bert_classifier_from_hf,
    _bert_classifier_to_hf, _bert_tensors, unprefixed=("classifier.",), read_past=lambda cfg: (),
    objective="classify", auto_class="AutoModelForSequenceClassification",
    skipped=("embeddings.position_ids", "embeddings.token_type_ids"))
