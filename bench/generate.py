"""Benchmark of seq2seq generation: new tokens per second of `model.generate`.

  python -m bench.generate [--config configs/transformer_base.py] [--batch 8]
                           [--src_len 128] [--new_tokens 32] [--beam 4] [--repeats 3]
                           [--out bench/results/generate.json]

An encoder-decoder of the config's shapes with random weights (the output
does not matter, only the work) generates `--new_tokens` tokens for each of
`--batch` sources of `--src_len` random tokens from a one-token prompt, with
no EOS so every row runs to the end: greedy sampling, then beam search with
`--beam` beams. Each is compiled by a first call and then timed over
`--repeats` calls; the table shows the median seconds per call and new
tokens per second (batch x new tokens / seconds; for beam search the
returned tokens, not the beams' work). The same numbers go to the JSON file.
"""
import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from bench.bench_utils import git_commit
from model import build_model
from model.generate import beam_search, generate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def time_calls(fn, repeats: int) -> tuple[float, list[list[int]]]:
  """Median seconds of `repeats` calls of `fn` after one compiling call."""
  out = fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", type=pathlib.Path, default=ROOT / "configs" / "transformer_base.py")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--src_len", type=int, default=128)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--beam", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path,
                      default=ROOT / "bench" / "results" / "generate.json")
  args = parser.parse_args()

  m = load_config(args.config).model
  if m.family != "encoder_decoder":
    sys.exit(f"error: {args.config} is a {m.family}; this benchmark needs an encoder_decoder")
  model = build_model(m, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  sources = rng.integers(1, m.vocab_size, (args.batch, args.src_len)).tolist()
  prompts = [[1]] * args.batch
  common = dict(sources=sources, max_new_tokens=args.new_tokens, eos_id=-1)
  searches = [("greedy", lambda: generate(model, m, prompts, **common)),
              (f"beam {args.beam}", lambda: beam_search(model, m, prompts, beam_size=args.beam,
                                                       **common))]
  print(f"{args.config.name}: {m.num_layers} + {m.num_decoder_layers} layers, d={m.d_model}, "
        f"V={m.vocab_size}; batch {args.batch}, source {args.src_len} tokens, "
        f"{args.new_tokens} new tokens; {jax.default_backend()}, {os.cpu_count()} CPUs")
  print("| search | s per call | new tokens/s |")
  print("|---|---:|---:|")
  results = []
  for name, fn in searches:
    seconds, out = time_calls(fn, args.repeats)
    tokens = sum(len(row) for row in out)
    results.append(dict(search=name, seconds=seconds, new_tokens=tokens,
                        tokens_per_s=tokens / seconds))
    print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.1f} |")

  args.out.parent.mkdir(parents=True, exist_ok=True)
  report = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "commit": git_commit(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "cpus": os.cpu_count(),
      "config": args.config.name,
      "batch": args.batch,
      "src_len": args.src_len,
      "new_tokens": args.new_tokens,
      "repeats": args.repeats,
      "results": results,
  }
  args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
