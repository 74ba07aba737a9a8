"""Attention speed and memory: our Pallas kernel beside its competitors.

The grid of docs/benchmarks.md (batch x seq = 16,384 tokens, heads x head_dim =
2048, bfloat16, layout [B, S, H, D]; D 64 and 128; S 1k, 4k, 16k; causal on
and off), a grouped-query case (32 query heads, 8 KV heads) and the GPT-2
small training shape (batch 8, S 1024, 12 heads, D 64, causal), also packed
as `data.packing=packed` trains it (`gpt2-small-packed`: documents of S/8 to
S/2 tokens, segment ids; `xla` and `cudnn` get the dense mask that
`model.attention` builds from them, `jax_mosaic` takes none). Every case
runs, in this one process:

- `ours_mosaic`: `model.kernels.router.flash_attention` with
  lowering="mosaic_gpu" (the Hopper kernels: wgmma, TMA, warp groups);
- `ours_triton`: the same with lowering="triton" (the portable kernels);
- `xla`, `cudnn`: `jax.nn.dot_product_attention(implementation=...)`;
- `jax_pallas`: JAX's bundled Triton kernel
  `jax.experimental.pallas.ops.gpu.attention.mha` (K/V repeated per query
  head for GQA, which it does not support);
- `jax_mosaic`: JAX's bundled Mosaic GPU kernel
  `jax.experimental.pallas.ops.gpu.attention_mgpu.attention`, run in
  float16 (its bfloat16 path fails in JAX 0.11.2; inputs are converted
  before timing), block_q 64, block_kv 128, backward tiles 64 (its backward
  is non-causal only; it has no softmax scale argument, which does not
  change its time);
- `tokamax`: Tokamax's `dot_product_attention(implementation="mosaic")`
  (its Mosaic GPU kernels, sm90; a separate install, `pip install tokamax`:
  without it the cell says so), its default tiles, GQA native, a packed row
  as a dense [B, 1, S, S] mask of the segment ids.

On a TPU (or with `--competitors tpu`) the competitors are instead:

- `ours_tpu`: `flash_attention` with lowering="mosaic_tpu"
  (`model/kernels/flash_attention_tpu.py`);
- `xla`: as above;
- `jax_flash_tpu`: JAX's bundled TPU FlashAttention
  `jax.experimental.pallas.ops.tpu.flash_attention` (layout [B, H, S, D]:
  the transposes are timed with it; K/V repeated per query head for GQA,
  which it does not support; no interpreter path);
- `jax_splash`: JAX's splash attention (`...ops.tpu.splash_attention`,
  `make_splash_mha` with a causal or full mask, GQA native, vmapped over
  the batch; q pre-scaled, as it has no scale argument).

Times are the median of timed repeats after warm-up, each ended by
`block_until_ready`. TFLOP/s follow the FlashAttention convention: forward
FLOPs = 4 * B * S^2 * H * D, halved when causal; forward+backward = 3.5 x
forward (a packed row counts them the same, as if it had one document: an
effective rate, since our kernels skip the tiles that share no document,
`model.kernels.block_sparse`; in `gpt2-small-packed` the Mosaic GPU
forward's CTAs stream 18 to 22 key tiles a batch row where causal alone
needs 36, its dK/dV kernel's 34 to 42 query tiles where it needs 72).
Memory, at S = 32k (B = 1, causal, fwd+bwd): the compiled program's
arguments + outputs + temporaries (`memory_analysis`), and, where the device
reports it, `peak_bytes_in_use` measured in a fresh process per competitor
(the peak counter cannot be reset within one process).

A competitor that fails shows "error: <message>" in its cell.

  python -m bench.attention --out bench/attention.json          # GPU
  python -m bench.attention --quick --out /tmp/attention.json   # CPU check
  python -m bench.attention --out bench/attention-tpu.json      # TPU
  python -m bench.attention --tune                               # our tiles

`--tune` times our kernels over their tiles: block_q x block_k for Triton,
block_k x stages x ping-pong x {dQ kernel (with key tiles of 64 too where
block_k is 128), dQ fused into the dK/dV kernel} for Mosaic GPU (query tiles
are 64 rows per warpgroup), skipping the Mosaic tiles over the shared memory
of an H100/H200.
"""
import argparse
import datetime
import functools
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_utils import command_line, git_commit
from model.attention import attention
from model.kernels import flash_attention_hopper as hopper
from model.kernels import hopper_pipeline
from model.kernels.router import flash_attention

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMPETITORS = ("ours_mosaic", "ours_triton", "xla", "cudnn", "jax_pallas",
               "jax_mosaic", "tokamax")
TPU_COMPETITORS = ("ours_tpu", "xla", "jax_flash_tpu", "jax_splash")
MEMORY_SEQ = 32768


def grid_cases(quick: bool) -> list[dict]:
  """The shapes to time: dicts of B, S, H, K, D, causal and a label."""
  if quick:
    tokens, width, seqs, dims = 256, 128, (128, 256), (64,)
  else:
    tokens, width, seqs, dims = 16384, 2048, (1024, 4096, 16384), (64, 128)
  cases = []
  for D in dims:
    for S in seqs:
      for causal in (True, False):
        cases.append(dict(label="grid", B=tokens // S, S=S, H=width // D,
                          K=width // D, D=D, causal=causal))
  if quick:
    cases.append(dict(label="gqa", B=1, S=128, H=4, K=2, D=64, causal=True))
    cases.append(dict(label="packed", B=1, S=128, H=2, K=2, D=64, causal=True,
                      packed=True))
  else:
    cases.append(dict(label="gqa", B=4, S=4096, H=32, K=8, D=64, causal=True))
    cases.append(dict(label="gpt2-small", B=8, S=1024, H=12, K=12, D=64,
                      causal=True))
    cases.append(dict(label="gpt2-small-packed", B=8, S=1024, H=12, K=12, D=64,
                      causal=True, packed=True))
  return cases


def segment_ids(case: dict):
  """[B, S] int32 segment ids of a packed row, as `data.packing=packed`
  trains: documents 1, 2, ... of lengths drawn between S/8 and S/2 (fixed
  seed), the last one cut at S."""
  rng = np.random.RandomState(0)
  rows = []
  for _ in range(case["B"]):
    lengths = []
    while sum(lengths) < case["S"]:
      lengths.append(rng.randint(case["S"] // 8, case["S"] // 2 + 1))
    rows.append(np.repeat(np.arange(1, len(lengths) + 1), lengths)[:case["S"]])
  return jnp.asarray(np.stack(rows), jnp.int32)


def memory_case(quick: bool, D: int) -> dict:
  S = 512 if quick else MEMORY_SEQ
  width = 64 if quick else 2048
  return dict(label="memory", B=1, S=S, H=width // D, K=width // D, D=D,
              causal=True)


def attention_fn(name: str, case: dict, tiles=None):
  """The competitor `name` as a function (q, k, v) -> out for `case`.

  `tiles`: for `ours_triton` (block_q, block_k), for `ours_mosaic`
  (block_k, stages, pingpong, block_k_dq, fused_dq); None: the kernel's own
  choice.
  """
  causal, scale = case["causal"], 1.0 / math.sqrt(case["D"])
  on_gpu = jax.default_backend() == "gpu"
  seg = segment_ids(case) if case.get("packed") else None
  ours = dict(causal=causal, scale=scale, q_segment_ids=seg, kv_segment_ids=seg)
  if name == "ours_triton":
    block_q, block_k = tiles or (None, None)
    return functools.partial(flash_attention, block_q=block_q, block_k=block_k,
                             lowering="triton", **ours)
  if name == "ours_mosaic" and tiles is None:
    return functools.partial(flash_attention, lowering="mosaic_gpu", **ours)
  if name == "ours_mosaic":
    return functools.partial(hopper.hopper_flash_attention, blocks=mosaic_blocks(tiles),
                             interpret=not on_gpu, **ours)
  if name in ("xla", "cudnn") and seg is not None:
    # As training runs them: a dense [B, 1, S, S] mask from the segment ids.
    return functools.partial(attention, causal=causal, segment_ids=seg, scale=scale,
                             implementation=name)
  if name in ("xla", "cudnn"):
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             scale=scale, implementation=name)
  if name == "jax_pallas":
    from jax.experimental.pallas.ops.gpu import attention as jax_attention  # pylint: disable=import-outside-toplevel
    group = case["H"] // case["K"]

    def fn(q, k, v):
      k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
      return jax_attention.mha(q, k, v, seg, sm_scale=scale, causal=causal,
                               interpret=not on_gpu)
    return fn
  if name == "ours_tpu":
    return functools.partial(flash_attention, lowering="mosaic_tpu", **ours)
  if name == "jax_flash_tpu":
    return _jax_flash_tpu(case, seg, scale)
  if name == "jax_splash":
    return _jax_splash(case, seg, scale, interpret=jax.default_backend() != "tpu")
  if name == "jax_mosaic":
    if seg is not None:
      raise ValueError("jax_mosaic takes no segment ids")
    if not on_gpu:
      raise RuntimeError("jax_mosaic needs a GPU (it has no interpreter path)")
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=import-outside-toplevel
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

    return functools.partial(attention_mgpu.attention, config=config)
  if name == "tokamax":
    return _tokamax(case, seg, scale)
  raise ValueError(f"unknown competitor {name!r}")


def _tokamax(case: dict, seg, scale: float):
  """Tokamax's Mosaic GPU attention as (q, k, v) -> out (same layout)."""
  import tokamax  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():  # else Tokamax parses this script's argparse flags with absl
    flags.FLAGS(sys.argv[:1])
  mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
  return functools.partial(tokamax.dot_product_attention, mask=mask, scale=scale,
                           is_causal=case["causal"], implementation="mosaic")


def _jax_flash_tpu(case: dict, seg, scale: float):
  """JAX's bundled TPU FlashAttention as (q, k, v) -> out in our layout."""
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # pylint: disable=import-outside-toplevel
  group = case["H"] // case["K"]
  segment_ids = None if seg is None else tpu_flash.SegmentIds(q=seg, kv=seg)

  def fn(q, k, v):
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    out = tpu_flash.flash_attention(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        segment_ids=segment_ids, causal=case["causal"], sm_scale=scale)
    return out.transpose(0, 2, 1, 3)
  return fn


def _jax_splash(case: dict, seg, scale: float, interpret: bool):
  """JAX's splash attention as (q, k, v) -> out in our layout."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  S, H = case["S"], case["H"]
  head_mask = splash.CausalMask((S, S)) if case["causal"] else splash.FullMask((S, S))
  kernel = splash.make_splash_mha(splash.MultiHeadMask([head_mask] * H), head_shards=1,
                                  q_seq_shards=1, interpret=interpret)

  def one_row(q_HTD, k_KSD, v_KSD, seg_S):
    segment_ids = None if seg is None else splash.SegmentIds(q=seg_S, kv=seg_S)
    return kernel(q_HTD * scale, k_KSD, v_KSD, segment_ids=segment_ids)

  def fn(q, k, v):
    rows = seg if seg is not None else jnp.zeros(q.shape[:2], jnp.int32)
    out = jax.vmap(one_row)(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                            v.transpose(0, 2, 1, 3), rows)
    return out.transpose(0, 2, 1, 3)
  return fn


def competitors(choice: str | None) -> tuple:
  """The competitors of a run: `TPU_COMPETITORS` on a TPU (or choice
  "tpu"), else the GPU ones."""
  if choice is None:
    choice = "tpu" if jax.default_backend() == "tpu" else "gpu"
  return TPU_COMPETITORS if choice == "tpu" else COMPETITORS


def triton_tune_tiles(quick: bool) -> list[tuple]:
  """(block_q, block_k) candidates of `--tune`."""
  if quick:
    return [(32, 64), (64, 64)]
  return [(bq, bk) for bq in (64, 128) for bk in (64, 128)]


def mosaic_blocks(tiles: tuple) -> hopper.HopperBlocks:
  """The Hopper kernels' tiles for a (block_k, stages, pingpong, block_k_dq,
  fused_dq) candidate of `--tune` (dK/dV query tiles of 64)."""
  block_k, stages, pingpong, block_k_dq, fused_dq = tiles
  return hopper.HopperBlocks(block_k=block_k, block_q_dkv=64, stages=stages,
                             pingpong=pingpong, block_k_dq=block_k_dq, fused_dq=fused_dq)


def mosaic_tune_tiles(quick: bool, D: int) -> list[tuple]:
  """(block_k, stages, pingpong, block_k_dq, fused_dq) candidates of `--tune`
  that fit in the shared memory of an H100/H200 at head_dim D: the separate
  dQ kernel (with its own key tile 64 where block_k is 128), or dQ fused
  into the dK/dV kernel."""
  if quick:
    return [(64, 2, True, None, False), (128, 2, False, None, True)]
  tiles = []
  for bk in (64, 128):
    for stages in (2, 3, 4):
      for pingpong in (True, False):
        tiles += [(bk, stages, pingpong, bk_dq, False)
                  for bk_dq in ((None, 64) if bk == 128 else (None,))]
        tiles.append((bk, stages, pingpong, None, True))

  def fits(t):
    return max(hopper.shared_memory_bytes(D, jnp.bfloat16, mosaic_blocks(t), False).values()
               ) <= hopper_pipeline.SHARED_MEMORY_BYTES
  return [t for t in tiles if fits(t)]


def input_dtype(name: str):
  """bfloat16, but float16 for `jax_mosaic` (see the module docstring)."""
  return jnp.float16 if name == "jax_mosaic" else jnp.bfloat16


def row_label(case: dict) -> str:
  """D:S:causal, the name `--rows` selects a grid row by."""
  return f"{case['D']}:{case['S']}:{'yes' if case['causal'] else 'no'}"


def row_name(case: dict) -> str:
  """What `--rows` selects a row by: D:S:causal for the grid, else its label."""
  return row_label(case) if case["label"] == "grid" else case["label"]


def make_inputs(case: dict, seed: int = 0, dtype=jnp.bfloat16):
  B, S, H, K, D = (case[x] for x in "BSHKD")
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (B, S, H, D), dtype)
  k = jax.random.normal(keys[1], (B, S, K, D), dtype)
  v = jax.random.normal(keys[2], (B, S, K, D), dtype)
  do = jax.random.normal(keys[3], (B, S, H, D), dtype)
  return q, k, v, do


def forward_and_backward(fn):
  """(q, k, v, do) -> (dq, dk, dv): the forward pass and its VJP."""
  def step(q, k, v, do):
    _, vjp = jax.vjp(fn, q, k, v)
    return vjp(do)
  return step


def time_median(fn, args, warmup: int, repeats: int) -> float:
  """Median seconds of `fn(*args)` over `repeats` runs after `warmup` runs."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def forward_flops(case: dict) -> float:
  flops = 4.0 * case["B"] * case["S"] ** 2 * case["H"] * case["D"]
  return flops / 2 if case["causal"] else flops


def short_error(exc: Exception) -> str:
  lines = [line for line in str(exc).splitlines() if line.strip()]
  message = lines[0] if lines else type(exc).__name__
  return f"error: {type(exc).__name__}: {message[:80]}"


def measure(name: str, case: dict, inputs, warmup: int, repeats: int,
            tiles=None) -> dict:
  """Forward and forward+backward times and TFLOP/s, or an error each."""
  q, k, v, do = (x.astype(input_dtype(name)) for x in inputs)
  try:
    fn = attention_fn(name, case, tiles)
  except Exception as exc:  # pylint: disable=broad-except
    return {mode: dict(error=short_error(exc)) for mode in ("fwd", "fwd_bwd")}
  result = {}
  for mode, step, args, factor in (
      ("fwd", jax.jit(fn), (q, k, v), 1.0),
      ("fwd_bwd", jax.jit(forward_and_backward(fn)), (q, k, v, do), 3.5)):
    try:
      seconds = time_median(step, args, warmup, repeats)
      result[mode] = dict(ms=seconds * 1e3,
                          tflops=factor * forward_flops(case) / seconds / 1e12)
    except Exception as exc:  # pylint: disable=broad-except
      result[mode] = dict(error=short_error(exc))
  return result


def compiled_bytes(name: str, case: dict) -> dict:
  """Arguments + outputs + temporaries of the compiled fwd+bwd program."""
  q = jax.ShapeDtypeStruct((case["B"], case["S"], case["H"], case["D"]),
                           input_dtype(name))
  kv = jax.ShapeDtypeStruct((case["B"], case["S"], case["K"], case["D"]),
                            input_dtype(name))
  try:
    step = jax.jit(forward_and_backward(attention_fn(name, case)))
    stats = step.lower(q, kv, kv, q).compile().memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes)
    return dict(bytes=int(total))
  except Exception as exc:  # pylint: disable=broad-except
    return dict(error=short_error(exc))


def peak_bytes_child(name: str, case: dict) -> dict:
  """In this (fresh) process: run fwd+bwd once, report peak_bytes_in_use."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return dict(error="n/a: device has no memory_stats")
  inputs = make_inputs(case, dtype=input_dtype(name))
  try:
    step = jax.jit(forward_and_backward(attention_fn(name, case)))
    jax.block_until_ready(step(*inputs))
  except Exception as exc:  # pylint: disable=broad-except
    return dict(error=short_error(exc))
  return dict(bytes=int(jax.devices()[0].memory_stats()["peak_bytes_in_use"]))


def peak_bytes(name: str, case: dict) -> dict:
  """`peak_bytes_child` in a fresh Python process."""
  if jax.devices()[0].memory_stats() is None:
    return dict(error="n/a: device has no memory_stats")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  command = [sys.executable, "-m", "bench.attention", "--peak_child",
             json.dumps(dict(name=name, case=case))]
  try:
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
  except Exception as exc:  # pylint: disable=broad-except
    return dict(error=short_error(exc))


def cell(result: dict) -> str:
  """'fwd / fwd+bwd' TFLOP/s, or the error(s)."""
  parts = [result[mode].get("error") or f"{result[mode]['tflops']:.3g}"
           for mode in ("fwd", "fwd_bwd")]
  return parts[0] if parts[0] == parts[1] and "error" in parts[0] else " / ".join(parts)


def speed_table(rows: list[dict]) -> str:
  names = tuple(rows[0]["results"])
  header = ("| case | B | S | H/K | D | causal | "
            + " | ".join(f"{c} fwd / fwd+bwd" for c in names) + " |")
  lines = [header, "|" + "---|" * (6 + len(names))]
  for row in rows:
    c = row["case"]
    lines.append(
        f"| {c['label']} | {c['B']} | {c['S']} | {c['H']}/{c['K']} | {c['D']} "
        f"| {'yes' if c['causal'] else 'no'} | "
        + " | ".join(cell(row["results"][name]) for name in names) + " |")
  return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
  def mib(entry):
    return entry.get("error") or f"{entry['bytes'] / 2**20:.1f}"
  lines = ["| D | S | H | competitor | compiled MiB (args+out+temp) | "
           "peak_bytes_in_use MiB |", "|---|---|---|---|---|---|"]
  for row in rows:
    c = row["case"]
    lines.append(f"| {c['D']} | {c['S']} | {c['H']} | {row['name']} | "
                 f"{mib(row['compiled'])} | {mib(row['peak'])} |")
  return "\n".join(lines)


def tile_label(tiles: tuple) -> str:
  """64x2 (Triton: block_q x block_k); Mosaic: 128x2 pp dq64, 128x2 fused."""
  if len(tiles) == 2:
    return "x".join(map(str, tiles))
  block_k, stages, pingpong, block_k_dq, fused = tiles
  return (f"{block_k}x{stages}{' pp' if pingpong else ''}"
          f"{f' dq{block_k_dq}' if block_k_dq else ''}{' fused' if fused else ''}")


def tune_table(rows: list[dict]) -> str:
  lines = ["| kernel | case | S | D | causal | tiles: fwd / fwd+bwd TFLOP/s |",
           "|---|---|---|---|---|---|"]
  for row in rows:
    c = row["case"]
    cells = ", ".join(f"{tile_label(r['tiles'])}: {cell(r)}" for r in row["results"])
    lines.append(f"| {row['name']} | {c['label']} | {c['S']} | {c['D']} | "
                 f"{'yes' if c['causal'] else 'no'} | {cells} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny shapes; runs on a CPU in the interpreter")
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  parser.add_argument("--warmup", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--tune", action="store_true",
                      help="also time our kernel over block_q x block_k")
  parser.add_argument("--no_memory", action="store_true",
                      help="skip the S = 32k memory measurement")
  parser.add_argument("--rows", nargs="+", metavar="LABEL",
                      help="only these rows: D:S:causal of the grid (e.g. 128:16384:yes), "
                           "gqa, gpt2-small or gpt2-small-packed (packed with --quick)")
  parser.add_argument("--competitors", choices=("gpu", "tpu"),
                      help="which set to run (default: tpu on a TPU, else gpu)")
  parser.add_argument("--only", nargs="+", metavar="NAME",
                      help="time only these competitors (default: all of the set)")
  parser.add_argument("--peak_child", help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args.peak_child:
    request = json.loads(args.peak_child)
    print(json.dumps(peak_bytes_child(request["name"], request["case"])))
    return

  warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
  repeats = args.repeats if args.repeats is not None else (2 if args.quick else 10)
  device = jax.devices()[0]
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              device=device.device_kind, backend=jax.default_backend(),
              jax=jax.__version__, commit=git_commit(),
              command=command_line(),
              warmup=warmup, repeats=repeats, dtype="bfloat16")
  print(f"# Attention benchmark: {meta['device']} ({meta['backend']}), "
        f"jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
  print(f"# median of {repeats} after {warmup} warm-up; TFLOP/s fwd / fwd+bwd\n",
        flush=True)

  cases = [c for c in grid_cases(args.quick) if args.rows is None or row_name(c) in args.rows]
  if not cases:
    parser.error(f"--rows {' '.join(args.rows)} matches no row; rows are "
                 + ", ".join(row_name(c) for c in grid_cases(args.quick)))
  names = competitors(args.competitors)
  if args.only:
    unknown = sorted(set(args.only) - set(names))
    if unknown:
      parser.error(f"--only {' '.join(unknown)}: not a competitor here; they are "
                   + ", ".join(names))
    names = tuple(n for n in names if n in args.only)
  speed_rows = []
  report = dict(meta=meta, speed=speed_rows)

  def save():  # after every row: a run stopped by its time limit keeps what it measured
    if args.out:
      args.out.write_text(json.dumps(report, indent=2))

  for case in cases:
    inputs = make_inputs(case)
    results = {name: measure(name, case, inputs, warmup, repeats)
               for name in names}
    speed_rows.append(dict(case=case, results=results))
    table = speed_table(speed_rows).splitlines()
    print("\n".join(table if len(speed_rows) == 1 else table[-1:]), flush=True)
    save()

  if args.tune and competitors(args.competitors) == TPU_COMPETITORS:
    print("\n--tune sweeps the GPU kernels' tiles only; skipped")
  elif args.tune:
    tune_rows = report["tune"] = []
    for case in cases:
      inputs = make_inputs(case)
      for name, tiles in (("ours_mosaic", mosaic_tune_tiles(args.quick, case["D"])),
                          ("ours_triton", triton_tune_tiles(args.quick))):
        if name not in names:
          continue
        tune_rows.append(dict(name=name, case=case, results=[]))
        for t in tiles:
          result = dict(tiles=list(t), **measure(name, case, inputs, warmup, repeats, tiles=t))
          tune_rows[-1]["results"].append(result)
          print(f"{name} {tile_label(t)}: {cell(result)}", flush=True)
          save()
    print("\n" + tune_table(tune_rows))

  if not args.no_memory:
    memory_rows = []
    for D in ((64,) if args.quick else (64, 128)):
      case = memory_case(args.quick, D)
      for name in names:
        memory_rows.append(dict(case=case, name=name,
                                compiled=compiled_bytes(name, case),
                                peak=peak_bytes(name, case)))
    print("\n" + memory_table(memory_rows))
    report["memory"] = memory_rows

  if args.out:
    save()
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
