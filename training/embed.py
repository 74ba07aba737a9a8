"""Sentence embeddings from a run: python -m training.embed --workdir W --input FILE --out X.npy

The lesson's "encoders for embeddings": each text is tokenised as a
classifier's input (`data/classify.py`: `BOS text EOS`, or an imported
tokenizer's own marks such as BERT's `[CLS] text [SEP]`, cut to the run's
train.seq_len), run through the model's stack (padding masked) and pooled
(`model/classifier.py`: `mean` over the real tokens, the usual sentence
embedding; `cls`; `last` for a decoder), in batches, optionally scaled to
unit L2 norm so that dot products are cosine similarities. The vectors are
the pooled hidden states themselves: no pooler or classifier is applied.

`--input`: a `.jsonl` file (the text in data.text_field, or --field), a
`.tsv` file with a header row (the column data.text_field, or --field), or
any other text file, one text per non-blank line. `--out`: a new `.npy` file
of float32 [texts, d_model], written whole or not at all.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from configs import base
from configs.errors import UserError
from configs.validation import CHOICES
from data import classify, sources
from training import workdir as workdir_lib


def read_texts(path: str, field: str) -> list[str]:
  """The texts of `--input` (see the module docstring)."""
  if not os.path.isfile(path):
    raise UserError(f"--input {path}: no such file")
  if path.endswith((".jsonl", ".tsv")):
    data = base.get_config().data
    data.update(task="labelled", paths=path, text_field=field)
    return [e.text for e in classify.file_examples(data)]
  texts = [line for line in sources.read_text(path).splitlines() if line.strip()]
  if not texts:
    raise UserError(f"--input {path}: no text (one text per non-blank line)")
  return texts


def embed_texts(model, tokenizer, texts: list[str], *, seq_len: int, pooling: str,
                normalize: bool = False, batch_size: int = 32, progress: bool = False
                ) -> np.ndarray:
  """Float32 pooled vectors [len(texts), d_model] of `texts` (at least one; see
  the module docstring)."""
  if pooling not in CHOICES["model.pooling"]:
    raise UserError(f"--pooling {pooling!r}: must be one of {', '.join(CHOICES['model.pooling'])}")
  examples = [classify.Example(f"text {i}", text, None, None) for i, text in enumerate(texts)]
  rows = classify.ClassifyRows(examples, (), tokenizer, seq_len=seq_len)
  graphdef, params = nnx.split(model)

  @jax.jit
  def pooled(params, inputs, padding_mask, token_types):
    return nnx.merge(graphdef, params).pooled(inputs, padding_mask > 0, token_types, pooling)

  out = []
  with tqdm(total=len(texts), desc="embed", unit="text", disable=not progress,
            file=sys.stderr) as bar:
    for start in range(0, len(texts), batch_size):
      batch = [rows(i) for i in range(start, start + batch_size)]  # past the end: padding
      arrays = [jnp.asarray(np.stack([row[k] for row in batch]))
                for k in ("inputs", "padding_mask", "token_types")]
      count = min(batch_size, len(texts) - start)
      out.append(np.asarray(pooled(params, *arrays), np.float32)[:count])
      bar.update(count)
  vectors = np.concatenate(out)
  if normalize:
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
  return vectors


def embed_file(workdir: str, input_path: str, out_path: str, *, step: int | None = None,
               pooling: str = "", field: str = "", normalize: bool = False,
               batch_size: int = 32, progress: bool = True) -> tuple[int, int]:
  """Embeds `input_path` with a checkpoint of `workdir` into `out_path`;
  (texts, width). `pooling`, `field`: "" for the run's model.pooling and
  data.text_field."""
  if not out_path.endswith(".npy"):
    raise UserError(f"--out {out_path}: must end in .npy (a numpy array file)")
  out_dir = os.path.dirname(os.path.abspath(out_path))
  if not os.path.isdir(out_dir):
    raise UserError(f"--out {out_path}: no directory {out_dir}")
  if batch_size < 1:
    raise UserError(f"--batch_size {batch_size}: must be a positive integer")
  config, tok, model, _ = workdir_lib.load_run(workdir, step)
  if config.model.family == "encoder_decoder":
    raise UserError(f"--workdir {workdir}: an encoder_decoder run; embeddings come from an "
                    "encoder or a decoder run")
  texts = read_texts(input_path, field or config.data.text_field)
  vectors = embed_texts(model, tok, texts, seq_len=config.train.seq_len,
                        pooling=pooling or config.model.pooling, normalize=normalize,
                        batch_size=batch_size, progress=progress)
  tmp = out_path + ".tmp.npy"
  np.save(tmp, vectors)
  os.replace(tmp, out_path)
  return vectors.shape


def main(argv):
  from absl import flags  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(2)
  f = flags.FLAGS
  try:
    count, width = embed_file(f.workdir, f.input, f.out, step=f.step, pooling=f.pooling,
                              field=f.field, normalize=f.normalize, batch_size=f.batch_size)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"wrote {f.out} ({count} x {width} float32)")


def _define_flags() -> None:
  """The command's flags, defined only when it runs (a library import defines none)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "The run directory.")
  flags.DEFINE_string("input", None, "Texts: .jsonl, .tsv (header row) or one per line.")
  flags.DEFINE_string("out", None, "The new .npy file of float32 [texts, d_model].")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
  flags.DEFINE_string("pooling", "", "cls | mean | last (default: the run's model.pooling).")
  flags.DEFINE_string("field", "", ".jsonl/.tsv: the text's field or column (default: the "
                      "run's data.text_field).")
  flags.DEFINE_bool("normalize", False, "Scale each vector to unit L2 norm.")
  flags.DEFINE_integer("batch_size", 32, "Texts per forward pass.")
  flags.mark_flags_as_required(["workdir", "input", "out"])


if __name__ == "__main__":
  from absl import app, logging  # pylint: disable=ungrouped-imports
  from configs.cli import parse_flags
  _define_flags()
  logging.set_verbosity(logging.WARNING)
  app.run(main, flags_parser=parse_flags)
