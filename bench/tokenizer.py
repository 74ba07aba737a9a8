"""Benchmark of Step 1 (tokenization): our BPE vs SentencePiece BPE and Unigram.

  python -m bench.tokenizer [--vocab_size 8192] [--corpus_mb 12.6]
                            [--out bench/results/tokenizer.json]

All three train, in this one process, on the same text (the standard-library
corpus as one document, cut to `--corpus_mb` megabytes if given) to the same
vocabulary size, with the settings `tokenizer.train_tokenizer` uses. Each
then encodes that text once from a fresh start (our encoder's word cache
empty). Printed: train seconds, the ratio to SentencePiece BPE's train time,
encode MB/s, bytes per token, and whether decode(encode(text)) == text. The
same numbers go to the JSON file.
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import time

import sentencepiece

import tokenizer
from data import corpora

ROOT = pathlib.Path(__file__).resolve().parents[1]

REFERENCE_KIND = "spm_bpe"


def corpus_text(corpus_mb: float | None) -> str:
  """The standard-library corpus as one text, cut to `corpus_mb` MB."""
  text = "".join(source for _, source in corpora.stdlib_documents())
  if corpus_mb is None:
    return text
  return text.encode("utf-8")[:int(corpus_mb * 1e6)].decode(
      "utf-8", errors="ignore")


def bench_kind(kind: str, vocab_size: int, text: str) -> dict:
  """Train time, encode throughput and round trip of one kind on `text`."""
  start = time.perf_counter()
  tok = tokenizer.train_tokenizer(kind, vocab_size, [text])
  train_s = time.perf_counter() - start
  start = time.perf_counter()
  ids = tok.encode(text)
  encode_s = time.perf_counter() - start
  num_bytes = len(text.encode("utf-8"))
  return {
      "kind": kind,
      "vocab_size": tok.vocab_size,
      "train_s": train_s,
      "encode_s": encode_s,
      "encode_mb_per_s": num_bytes / encode_s / 1e6,
      "tokens": len(ids),
      "bytes_per_token": num_bytes / len(ids),
      "round_trip": tok.decode(ids) == text,
  }


def format_table(results: list[dict]) -> str:
  reference = next(r for r in results if r["kind"] == REFERENCE_KIND)
  lines = ["| tokenizer | train s | train / spm_bpe | encode MB/s | "
           "bytes/token | round trip |",
           "|---|---:|---:|---:|---:|---|"]
  for r in results:
    lines.append(f"| {r['kind']} | {r['train_s']:.2f} | "
                 f"{r['train_s'] / reference['train_s']:.2f} | "
                 f"{r['encode_mb_per_s']:.2f} | {r['bytes_per_token']:.2f} | "
                 f"{'yes' if r['round_trip'] else 'NO'} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--corpus_mb", type=float, default=None,
                      help="cut the corpus to this many MB (default: all)")
  parser.add_argument("--out", type=pathlib.Path,
                      default=ROOT / "bench" / "results" / "tokenizer.json")
  args = parser.parse_args()

  text = corpus_text(args.corpus_mb)
  num_bytes = len(text.encode("utf-8"))
  print(f"corpus: standard library, {num_bytes / 1e6:.1f} MB as one text; "
        f"vocabulary {args.vocab_size}; {os.cpu_count()} CPUs")
  results = [bench_kind(kind, args.vocab_size, text)
             for kind in ("bpe", "spm_bpe", "spm_unigram")]
  print(format_table(results))

  args.out.parent.mkdir(parents=True, exist_ok=True)
  report = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "python": platform.python_version(),
      "sentencepiece": sentencepiece.__version__,
      "cpus": os.cpu_count(),
      "corpus_bytes": num_bytes,
      "vocab_size": args.vocab_size,
      "results": results,
  }
  args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
