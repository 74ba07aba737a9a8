"""Trains a Step 1 tokenizer and saves it: `python -m tokenizer.train`.

  python -m tokenizer.train --kind bpe --vocab-size 8192 --out runs/tok
  python -m tokenizer.train --kind spm_unigram --vocab-size 4096 \
      --input a.txt b.txt --out runs/tok_unigram

Without `--input`, learns from the train split of the embedded `stdlib` and
`pydoc` corpora (5% of the documents held out). Input files larger than
`--max-bytes` together are sampled: each gives its first bytes up to its
share, and the output says how many bytes were read. A user mistake is printed as
one line and the exit status is 2; `--out` is written only when training
succeeded, all at once.
"""
import argparse
import pathlib
import sys
import time
from collections.abc import Sequence

import tokenizer
from configs.errors import UserError
from tokenizer import inputs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m tokenizer.train",
      description="Train a tokenizer (Step 1 of the lesson) and save it.")
  parser.add_argument("--kind", required=True, choices=tokenizer.KINDS)
  parser.add_argument("--vocab-size", required=True, type=int,
                      help="number of ids, special tokens included")
  parser.add_argument("--input", nargs="+", metavar="FILE",
                      help="UTF-8 text files (default: the embedded corpora's "
                      "train split)")
  parser.add_argument("--max-bytes", type=int, default=inputs.DEFAULT_MAX_BYTES,
                      help="read at most about this many bytes of the input files")
  parser.add_argument("--out", required=True, type=pathlib.Path,
                      help="directory to create with the saved tokenizer")
  return parser.parse_args(argv)


def run(args: argparse.Namespace) -> tokenizer.Tokenizer:
  """Checks the arguments, trains, saves; returns the trained tokenizer."""
  if args.out.exists():
    raise UserError(f"--out {args.out} already exists; choose a new directory")
  sample = inputs.TextFileSample(args.input, args.max_bytes) if args.input else None
  texts = sample if sample is not None else inputs.embedded_texts("train")
  start = time.perf_counter()
  tok = tokenizer.train_tokenizer(args.kind, args.vocab_size, texts)
  seconds = time.perf_counter() - start
  tok.save(args.out)
  read = f"read {sample.bytes_read} of {sample.total_bytes} bytes; " if sample else ""
  print(f"trained {tok.kind} with {tok.vocab_size} ids in {seconds:.1f} s; {read}"
        f"fingerprint {tok.fingerprint[:12]}; saved to {args.out}")
  return tok


def main(argv: Sequence[str] | None = None) -> None:
  try:
    run(parse_args(argv))
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
