"""Trains a Step 1 tokenizer and saves it: `python -m tokenizer.train`.

  python -m tokenizer.train --kind bpe --vocab_size 8192 --out runs/tok
  python -m tokenizer.train --kind spm_unigram --vocab_size 4096 \
      --input a.txt b.txt --out runs/tok_unigram

Without `--input`, learns from the train split of the embedded `stdlib` and
`pydoc` corpora (5% of the documents held out). Input files larger than
`--max_bytes` together are sampled: each gives its first bytes up to its
share, and the output says how many bytes were read. A user mistake is printed as
one line and the exit status is 2; `--out` is written only when training
succeeded, all at once.
"""
import pathlib
import sys
import time
from collections.abc import Sequence

from absl import flags

import tokenizer
from configs.cli import parse_flags
from configs.errors import UserError
from tokenizer import inputs

# Its own flags, not absl's global ones: main() runs inside other programs' processes (tests).
FLAGS = flags.FlagValues()
flags.DEFINE_enum("kind", None, list(tokenizer.KINDS), "The tokenizer kind.", flag_values=FLAGS)
flags.DEFINE_integer("vocab_size", None, "Number of ids, special tokens included.",
                     flag_values=FLAGS)
flags.DEFINE_multi_string("input", [], "UTF-8 text files: this one and the file arguments "
                          "after it (default: the embedded corpora's train split).",
                          flag_values=FLAGS)
flags.DEFINE_integer("max_bytes", inputs.DEFAULT_MAX_BYTES,
                     "Read at most about this many bytes of the input files.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "Directory to create with the saved tokenizer.",
                    flag_values=FLAGS)
flags.mark_flags_as_required(["kind", "vocab_size", "out"], flag_values=FLAGS)


def run(kind: str, vocab_size: int, input_paths: list[str], out: pathlib.Path,
        max_bytes: int = inputs.DEFAULT_MAX_BYTES) -> tokenizer.Tokenizer:
  """Checks the arguments, trains, saves; returns the trained tokenizer."""
  if out.exists():
    raise UserError(f"--out {out} already exists; choose a new directory")
  sample = inputs.TextFileSample(input_paths, max_bytes) if input_paths else None
  texts = sample if sample is not None else inputs.embedded_texts("train")
  start = time.perf_counter()
  tok = tokenizer.train_tokenizer(kind, vocab_size, texts)
  seconds = time.perf_counter() - start
  tok.save(out)
  read = f"read {sample.bytes_read} of {sample.total_bytes} bytes; " if sample else ""
  print(f"trained {tok.kind} with {tok.vocab_size} ids in {seconds:.1f} s; {read}"
        f"fingerprint {tok.fingerprint[:12]}; saved to {out}")
  return tok


def main(argv: Sequence[str] | None = None) -> None:
  """`argv`: the arguments after the program name (default: the command line's)."""
  FLAGS.unparse_flags()
  rest = parse_flags(["tokenizer.train", *(sys.argv[1:] if argv is None else argv)], FLAGS)
  try:
    if rest[1:] and not FLAGS.input:
      raise UserError(f"unexpected argument {rest[1]!r}; text files come after --input")
    run(FLAGS.kind, FLAGS.vocab_size, FLAGS.input + rest[1:], pathlib.Path(FLAGS.out),
        FLAGS.max_bytes)
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
