"""Benchmark of self-speculative decoding: greedy tokens/s with and without MTP drafts.

  python -m bench.speculative [--workdir RUN | --steps 200 --mtp_depth 3 [--config PRESET]
      [--set KEY=VALUE ...]] [--depths 1,2,3] [--batch 1,2,4] [--new_tokens 128]
      [--context 0] [--repeats 5] [--note TEXT] [--out bench/results/speculative.json]
  python -m bench.speculative --costs 128x2,512x8 [--lengths 256,2048] [--depths 1,2,3]
  python -m bench.speculative --products 256,512,1024

A run trained with train.mtp_depth (`--workdir`; its newest checkpoint)
completes the prompts below greedily, once plainly (`generate`: one pass of
the main model per token) and once drafted by its multi-token prediction
modules (`mtp_speculative`: D drafts verified in one pass), for each draft
depth D of `--depths` (the first D modules; default every depth the run
has). Random weights would draft almost nothing that the main model
accepts, so without `--workdir` the script first trains `--config`
(configs/tiny.py) with train.mtp_depth=`--mtp_depth` and the `--set`
overrides (train.py's `--config.KEY=VALUE`) for `--steps` steps into a
temporary folder (on the preset's corpus). For each depth and each batch
size of `--batch` (the first prompts), both are compiled by a first call and
timed over `--repeats` calls each, alternating, with no EOS so every row
runs `--new_tokens` tokens (after `--context` tokens of model/attention.py
and the prompt: a long context); the table shows the median new tokens per
second of each, the speedup, the share of drafts accepted and the tokens
each main-model pass commits, and checks that both gave the same tokens,
and the machine's load average (`os.getloadavg`, 1 minute) before and after
the timing: on a shared machine the ratio of the interleaved medians is the
figure, the absolute tokens/s are not. The same numbers go to the JSON
file, with the run, the machine (CPU model from /proc/cpuinfo) and `--note`
(what else ran on the machine, for example).

Where a drafted pass's time goes (`components`, batch 1, each depth): each
piece of a pass in a compiled loop of its own, timed interleaved with
greedy's step like the calls above and given in greedy steps: the main
model reading D+1 tokens against its cache (the verification) and the D
modules reading the 2D positions a pass recomputes (the drafts, each with
its head at the last position), against a KV cache as long as the
run's. A pass cannot cost less than their sum;
with t tokens a pass the speedup is at most t over it.

`--costs DxL,...` measures only those pass costs, on models of random
weights (a cost does not depend on the weights, acceptance does) of
configs/tiny.py's kind with d_model D and L layers (heads of 32, d_ff 3D),
for each draft depth of `--depths` and each KV-cache length of `--lengths`:
how the floor of a pass moves with the model's shape and its context; and
what a pass of the drafted loop itself costs in greedy steps (`loop_pass`:
`generate` and `mtp_speculative` timed at two lengths, the difference per
pass), the floor plus the loop's own work and memory traffic.
`--products D,...` times one layer's projection, [M, D] x [D, 3D] in float32
for M = 1, 2, 3, 4, 8 rows: what reading M tokens through a weight costs
against reading one.
"""
import argparse
import datetime
import functools
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.bench_utils import command_line, git_commit
from configs import tiny
from configs.errors import UserError
from model import build_model
from model.generate import generate, mtp_speculative
from training import hardware
from training import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `--context N`: each prompt follows the first N tokens of this file (Python, like the corpus).
CONTEXT = ROOT / "model" / "attention.py"
PROMPTS = ["def ", "import os\n", "class ", "    return ", "for i in range(", "if __name__",
           "    def __init__(self", "# "]


def train_run(workdir: str, config: str, steps: int, depth: int, overrides: list[str]) -> None:
  """`config` with `depth` MTP modules and `overrides` (KEY=VALUE), `steps`
  steps, into `workdir`."""
  command = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / config),
             "--workdir", workdir, f"--config.train.mtp_depth={depth}",
             f"--config.train.num_steps={steps}", f"--config.train.checkpoint_every={steps}",
             f"--config.train.eval_every={steps}", "--config.train.warmup_fraction=0.1",
             *(f"--config.{item}" for item in overrides)]
  print(f"training: {' '.join(command[1:])}", flush=True)
  subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def median_seconds(fns, repeats: int):
  """[(median seconds, last output)] of each of `fns` over `repeats` calls
  after a compiling call, the calls alternating (a machine whose load
  changes slows each alike)."""
  outs = [fn() for fn in fns]
  times = [[] for _ in fns]
  for _ in range(repeats):
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      outs[i] = fn()
      times[i].append(time.perf_counter() - start)
  return [(statistics.median(t), out) for t, out in zip(times, outs)]


def components(model, repeats: int, depth: int, steps: int = 64, length: int = 256) -> dict:
  """Seconds of one greedy step (one token through the main model and its
  head), of one verification (D+1 tokens, the head at each) and of the
  first D = `depth` modules' drafts (2D positions each), batch 1, a KV
  cache of `length` slots, each the median over `repeats` runs of a loop
  of `steps`; the last two also in greedy steps."""
  graphdef, state = nnx.split(model)
  D = depth

  def loop(tokens: int, modules: bool):
    @jax.jit
    def run(state, token_B):
      model = nnx.merge(graphdef, state)
      blocks = model.decoder.blocks()
      caches = [model.decoder.kv_cache(1, length) for _ in range(D)]

      def body(i, carry):
        token_B, cache, caches = carry
        positions_BT = i + jnp.arange(tokens)[None]
        tokens_BT = jnp.broadcast_to(token_B[:, None], (1, tokens))
        if not modules:
          x_BTM, cache = model.decoder.decode_step(tokens_BT, positions_BT, cache, blocks=blocks)
          # The head at every token, as a verification reads it.
          return jnp.argmax(model.logits(model.decoder, x_BTM), -1).max(-1), cache, caches
        h_BTM, new = model.decoder.embed_tokens(tokens_BT, positions_BT), []
        for module, module_cache in zip(list(model.mtp)[:D], caches):
          h_BTM, normed_BTM, module_cache = module.decode(h_BTM, h_BTM, positions_BT=positions_BT,
                                                          cache=module_cache)
          token_B = jnp.argmax(model.logits(model.decoder, normed_BTM[:, -1:])[:, 0], -1)
          new.append(module_cache)
        return token_B, cache, new

      carry = (token_B, model.init_cache(1, length + 2 * D), caches)
      return jax.lax.fori_loop(0, steps, body, carry)[0]
    return lambda: run(state, jnp.ones((1,), jnp.int32)).block_until_ready()

  timed = median_seconds([loop(1, False), loop(D + 1, False), loop(2 * D, True)], repeats)
  greedy_s, verify_s, drafts_s = (seconds / steps for seconds, _ in timed)
  return {"draft_depth": D, "cache_length": length, "greedy_step_seconds": greedy_s,
          "verify_seconds": verify_s, "drafts_seconds": drafts_s, "verify_in_greedy_steps": verify_s / greedy_s,
          "drafts_in_greedy_steps": drafts_s / greedy_s,
          "pass_floor_in_greedy_steps": (verify_s + drafts_s) / greedy_s}


def loop_pass(model, model_cfg, depth: int, repeats: int, length: int, short: int = 16) -> dict:
  """Seconds of one pass of the drafted loop itself (`mtp_speculative` with
  the first `depth` modules) and of one step of greedy's (`generate`),
  batch 1: each run for `short` new tokens and for enough to fill about
  `length` cache slots after a 4-token prompt, the four calls alternating
  (`median_seconds`); the difference of a long and a short call over the
  difference of their passes (greedy: of their tokens) leaves out the
  prefill and the call's own costs. Random weights accept few drafts, so
  nearly every pass commits one token: this is what a pass costs, the
  floor of `components` plus what the loop adds to it."""
  prompt, long = [[1, 2, 3, 4]], length - 4 - 2 * depth - 2
  short = min(short, long // 2)
  common = dict(eos_id=-1, pad_id=0)
  calls = [functools.partial(generate, model, model_cfg, prompt, max_new_tokens=n, **common)
           for n in (short, long)]
  calls += [functools.partial(mtp_speculative, model, model_cfg, prompt, max_new_tokens=n,
                              draft_depth=depth, **common) for n in (short, long)]
  (g_short, _), (g_long, _), (s_short, (_, short_stats)), (s_long, (_, long_stats)) = (
      median_seconds(calls, repeats))
  step_s = (g_long - g_short) / (long - short)
  pass_s = (s_long - s_short) / (long_stats["passes"] - short_stats["passes"])
  return {"loop_greedy_step_seconds": step_s, "loop_pass_seconds": pass_s,
          "loop_pass_in_greedy_steps": pass_s / step_s}


def describe(parts: dict) -> str:
  """One line of `components`' pass floor."""
  D, floor = parts["draft_depth"], parts["pass_floor_in_greedy_steps"]
  return (f"depth {D}, {parts['cache_length']} cache slots: a greedy step "
          f"{parts['greedy_step_seconds'] * 1e6:,.0f} us; a drafted pass at least {floor:.2f} steps "
          f"(the main model over {D + 1} tokens {parts['verify_in_greedy_steps']:.2f}, the {D} "
          f"module(s) over {2 * D} positions {parts['drafts_in_greedy_steps']:.2f}): every draft "
          f"accepted, at most {(D + 1) / floor:.2f}x greedy")


def bench(workdir: str, depths: list[int] | None, batches: list[int], new_tokens: int,
          repeats: int, context: int) -> tuple[dict, list, list]:
  """(the run, a row per draft depth and batch, `components` per depth) of
  `workdir`: greedy and drafted calls timed alternately (module docstring)."""
  modules = workdir_lib.load_config(workdir).train.mtp_depth  # refused before the checkpoint
  if not modules:
    raise UserError(f"{workdir} was trained without train.mtp_depth; train one with it "
                    "(or leave out --workdir)")
  depths = depths or list(range(1, modules + 1))
  if not 1 <= min(depths) <= max(depths) <= modules:
    raise UserError(f"--depths {','.join(map(str, depths))}: {workdir} has {modules} MTP "
                    f"modules; draft with 1 to {modules} of them")
  config, tok, model, step = workdir_lib.load_run(workdir)
  context_ids = tok.encode(CONTEXT.read_text())[:context]
  if len(context_ids) < context:
    raise UserError(f"--context {context}: {CONTEXT.relative_to(ROOT)} has "
                    f"{len(context_ids)} tokens; ask for fewer")
  prompts = [[tok.bos_id] + context_ids + tok.encode(p) for p in PROMPTS]
  width = max(map(len, prompts))
  m = config.model
  print(f"{workdir} at step {step}: {m.num_layers} layers, d={m.d_model}, V={m.vocab_size}, "
        f"{config.train.mtp_depth} MTP modules; {new_tokens} new tokens; "
        f"{jax.default_backend()}, {hardware.cpu_model()}, {hardware.usable_cpus()} CPUs")
  print("| depth | batch | greedy tokens/s | MTP drafted tokens/s | speedup | accepted | "
        "tokens per pass | same tokens | load before / after |")
  print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
  results, parts = [], []
  for depth in depths:
    for batch in batches:
      rows = (prompts * batch)[:batch]
      load_before = os.getloadavg()[0]
      common = dict(max_new_tokens=new_tokens, eos_id=-1, pad_id=tok.pad_id, prompt_width=width,
                    num_tokens=tok.vocab_size)
      (plain_s, plain), (spec_s, (drafted, stats)) = median_seconds(
          [lambda: generate(model, m, rows, **common),
           lambda: mtp_speculative(model, m, rows, draft_depth=depth, **common)], repeats)
      tokens, load_after = batch * new_tokens, os.getloadavg()[0]
      results.append(dict(batch=batch, load_before=load_before, load_after=load_after,
                          greedy_seconds=plain_s, mtp_seconds=spec_s,
                          greedy_tokens_per_s=tokens / plain_s, mtp_tokens_per_s=tokens / spec_s,
                          speedup=plain_s / spec_s, same_tokens=drafted == plain, **stats))
      print(f"| {depth} | {batch} | {tokens / plain_s:,.1f} | {tokens / spec_s:,.1f} | "
            f"{plain_s / spec_s:.2f}x | {stats['acceptance_rate']:.1%} | "
            f"{stats['tokens_per_pass']:.2f} | {drafted == plain} | "
            f"{load_before:.1f} / {load_after:.1f} |", flush=True)
  for depth in depths:
    parts.append(components(model, repeats, depth, length=width + new_tokens))
    print(describe(parts[-1]), flush=True)
  run = {"workdir": workdir, "step": step, "context_tokens": context,
         "mtp_depth": config.train.mtp_depth,
         "mtp_weight": config.train.mtp_weight, "layers": m.num_layers, "d_model": m.d_model,
         "vocab_size": m.vocab_size}
  return run, results, parts


def shape_costs(shapes: list[str], depths: list[int], lengths: list[int], repeats: int) -> list:
  """`components` and `loop_pass` of random-weight models of
  configs/tiny.py's kind, one per "DxL" of `shapes` (d_model D, L layers,
  heads of 32, d_ff 3D), at each draft depth and KV-cache length."""
  costs = []
  for shape in shapes:
    d_model, layers = (int(x) for x in shape.split("x"))
    config = tiny.get_config()
    config.model.update(d_model=d_model, num_layers=layers, num_heads=d_model // 32,
                        d_ff=3 * d_model, max_len=max(lengths) + 2 * max(depths))
    model = build_model(config.model, nnx.Rngs(0), mtp_depth=max(depths))
    for length in lengths:
      for depth in depths:
        parts = components(model, repeats, depth, length=length)
        parts.update(loop_pass(model, config.model, depth, repeats, length))
        costs.append({"d_model": d_model, "layers": layers, "vocab_size": config.model.vocab_size,
                      "load": os.getloadavg()[0], **parts})
        print(f"d_model {d_model}, {layers} layers, {describe(parts)}; the loop's pass "
              f"{parts['loop_pass_in_greedy_steps']:.2f} steps (load {costs[-1]['load']:.1f})",
              flush=True)
  return costs


def product_costs(widths: list[int], repeats: int, rows: tuple = (1, 2, 3, 4, 8),
                  layers: int = 16, steps: int = 20) -> list:
  """Microseconds of one float32 product [M, d] x [d, 3d] (a layer's
  projection: M tokens through a weight read from memory) for each M of
  `rows` and d of `widths`: `layers` distinct weights in turn, `steps`
  times, in one compiled loop, the median over `repeats` runs."""
  costs = []
  for d in widths:
    weights = [jax.random.normal(jax.random.key(i), (d, 3 * d)) for i in range(layers)]

    def loop(m: int):
      @jax.jit
      def run(x_MD, weights):
        def body(_, x_MD):
          for w_DN in weights:
            x_MD = (x_MD @ w_DN)[:, :d] * 0.01
          return x_MD
        return jax.lax.fori_loop(0, steps, body, x_MD)
      return lambda: run(jnp.ones((m, d)), weights).block_until_ready()

    timed = median_seconds([loop(m) for m in rows], repeats)
    micros = {m: seconds / steps / layers * 1e6 for m, (seconds, _) in zip(rows, timed)}
    costs.append({"d": d, "weight_bytes": 12 * d * d, "load": os.getloadavg()[0],
                  "microseconds_by_rows": micros})
    print(f"[M, {d}] x [{d}, {3 * d}]: " + ", ".join(
        f"M={m} {us:,.0f} us ({us / micros[rows[0]]:.2f}x)" for m, us in micros.items()),
        flush=True)
  return costs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", help="A run trained with train.mtp_depth (default: train "
                      "--config into a temporary folder).")
  parser.add_argument("--config", default="configs/tiny.py",
                      help="The preset trained without --workdir.")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="A config override for that training (model.num_layers=4); repeatable.")
  parser.add_argument("--steps", type=int, default=200, help="Training steps without --workdir.")
  parser.add_argument("--mtp_depth", type=int, default=3, help="MTP modules without --workdir.")
  parser.add_argument("--depths", default="",
                      help="Draft depths, comma-separated (default: 1 to the run's modules).")
  parser.add_argument("--batch", default="1,2,4", help="Batch sizes, comma-separated.")
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--context", type=int, default=0, help="Tokens of model/attention.py "
                      "before each prompt (a long context: a KV cache that many slots longer).")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--costs", default="", metavar="DxL,...",
                      help="Only the pass costs of random-weight models of these shapes.")
  parser.add_argument("--lengths", default="256", help="KV-cache lengths of --costs.")
  parser.add_argument("--products", default="", metavar="D,...",
                      help="Only the cost of [M, D] x [D, 3D] products for M = 1, 2, 3, 4, 8.")
  parser.add_argument("--note", default="", help="Recorded as is (e.g. what else ran).")
  parser.add_argument("--out", type=pathlib.Path, help="The JSON file (default: "
                      "bench/results/speculative.json; speculative_costs.json with --costs, "
                      "speculative_products.json with --products).")
  args = parser.parse_args()
  depths = [int(d) for d in args.depths.split(",") if d]
  report = {"command": command_line(), "commit": git_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "machine": {"cpu_model": hardware.cpu_model(), "cpus": hardware.usable_cpus(),
                        "xla_threads": hardware.xla_cpu_threads(),
                        "load_average_at_start": os.getloadavg()},
            "note": args.note, "repeats": args.repeats}
  if args.products:
    out = args.out or ROOT / "bench" / "results" / "speculative_products.json"
    report["products"] = product_costs([int(d) for d in args.products.split(",")],
                                       args.repeats)
  elif args.costs:
    out = args.out or ROOT / "bench" / "results" / "speculative_costs.json"
    report["costs"] = shape_costs(args.costs.split(","), depths or [1, 2, 3],
                                  [int(n) for n in args.lengths.split(",")], args.repeats)
  else:
    out = args.out or ROOT / "bench" / "results" / "speculative.json"
    trained = None
    with tempfile.TemporaryDirectory() as tmp:
      workdir = args.workdir
      if workdir is None:
        workdir = os.path.join(tmp, "run")
        start = time.perf_counter()
        train_run(workdir, args.config, args.steps, args.mtp_depth, args.set)
        trained = {"config": args.config, "overrides": args.set, "steps": args.steps,
                   "seconds": round(time.perf_counter() - start, 1)}
      try:
        run, results, parts = bench(workdir, depths, [int(b) for b in args.batch.split(",")],
                                    args.new_tokens, args.repeats, args.context)
      except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if trained is not None:
      run = {**run, "workdir": None, "trained_here": trained}
    report.update(run=run, new_tokens=args.new_tokens, prompts=PROMPTS, results=results,
                  components=parts)
  report["machine"]["load_average_at_end"] = os.getloadavg()
  out.parent.mkdir(parents=True, exist_ok=True)
  workdir_lib.write_json_atomic(str(out), report)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
