"""The lesson's cost, measured: decoding speed and cache memory at growing
context for softmax attention, a hybrid and linear attention alone.

  python -m bench.linear_cost [--contexts 256,1024,4096] [--new_tokens 256]
                              [--repeats 5] [--out bench/results/linear_cost.json]

Three decoders of configs/tiny.py's width (d = 128) at 4 layers, with random
weights: every layer full attention, 3 linear-attention layers
(Gated DeltaNet) before each full one (Qwen3-Next's 3:1), and every layer
linear. For each context C, batch 1 reads a prompt of C tokens and
decodes greedy tokens: once 1 and once `--new_tokens`, each compiled by a
first call and timed over `--repeats` calls (the fastest, the least
disturbed by the machine). Prefill is the
first's time; decoding tokens/s is (new tokens - 1) over the difference,
the tokens after the prompt alone. The cache is measured off the arrays
`init_cache(1, C + new tokens)` returns (KV cache slots of the full layers,
states of the linear ones) and checked against model.accounting's count.
A table to stdout, the same rows as JSON with the commit and the CPU.
"""
import argparse
import datetime
import json
import platform
import time

import jax
import numpy as np
from flax import nnx

from bench.bench_utils import command_line, git_commit
from configs import tiny
from model import accounting, build_model
from model.generate import generate

VARIANTS = {"softmax": ("full_attention",),
            "hybrid 3:1": ("linear_attention",) * 3 + ("full_attention",),
            "linear": ("linear_attention",)}


def model_config(layer_types: tuple[str, ...], max_len: int):
  c = tiny.get_config().model
  c.update(num_layers=4, layer_types=layer_types, max_len=max_len, attention_impl="xla")
  return c


def cache_bytes(model, length: int) -> int:
  """Bytes of every array of a batch-1 cache of `length` slots."""
  return sum(x.nbytes for x in jax.tree.leaves(model.init_cache(1, length)))


def measure(name: str, layer_types, context: int, new_tokens: int, repeats: int) -> dict:
  c = model_config(layer_types, context + new_tokens)
  model = build_model(c, nnx.Rngs(0))
  prompt = [list(np.random.default_rng(0).integers(1, c.vocab_size, context))]
  seconds = {}
  for tokens in (1, new_tokens):
    call = lambda n=tokens: generate(model, c, prompt, max_new_tokens=n, temperature=0.0,
                                     eos_id=-1)
    call()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      call()
      times.append(time.perf_counter() - start)
    seconds[tokens] = min(times)
  measured = cache_bytes(model, context + new_tokens)
  formula = (accounting.kv_cache_bytes_per_token(c) * (context + new_tokens)
             + accounting.linear_state_bytes(c))
  assert measured == formula, (name, measured, formula)
  return {"model": name, "context": context, "new_tokens": new_tokens,
          "prefill_seconds": seconds[1],
          "decode_tokens_per_second": (new_tokens - 1) / (seconds[new_tokens] - seconds[1]),
          "cache_bytes": measured}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--contexts", default="256,1024,4096")
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  rows = [measure(name, kinds, int(context), args.new_tokens, args.repeats)
          for context in args.contexts.split(",") for name, kinds in VARIANTS.items()]
  print(f"{'model':<12} {'context':>8} {'prefill s':>10} {'decode tokens/s':>16} {'cache':>12}")
  for row in rows:
    print(f"{row['model']:<12} {row['context']:>8} {row['prefill_seconds']:>10.3f} "
          f"{row['decode_tokens_per_second']:>16.1f} {row['cache_bytes'] / 2**10:>8.1f} KiB")
  result = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
            "command": command_line(), "cpu": platform.processor() or platform.machine(),
            "jax": jax.__version__, "devices": len(jax.devices()), "rows": rows}
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
