"""Compile time against depth, scanned and looped layers (`model.scan_layers`).

  python -m bench.compile_time --out bench/results/compile_time.json
  python -m bench.compile_time --no-cpu --steps 0   # the TPU compiles alone
  python -m bench.compile_time --pattern 3:1 --tpu "" --steps 0 --depths 8,48

For 2, 8, 32 and 80 layers of configs/tiny.py's width, the seconds to lower
and compile the train step (as training/loop.py builds it: AdamW, the
mesh, `train.remat`) with the layers scanned and looped: on this host's CPU,
and for a TPU slice through `aot/compiler.py` (`--tpu`, default
tpu:v5p:2x2x1; "" skips it). Then the CPU train-step time of configs/tiny.py
itself, scanned over looped: the two compiled steps run alternately
(`--steps` each, after a warm-up) and the ratio of their medians is printed.
The persistent compilation cache stays off, so every compile is a real one.

`--pattern L:F` makes the layers a hybrid: L linear-attention layers (Gated
DeltaNet) before each F full-attention ones (`model.layer_types`), as
Qwen3-Next's 3:1. Two layouts are then compiled at each depth: the cycle
scanned as one body (`scan_layers=True`) and the loop.
"""
import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only, beside others

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from aot import compiler, targets  # pylint: disable=wrong-import-position
from bench.bench_utils import git_commit  # pylint: disable=wrong-import-position
from configs import tiny  # pylint: disable=wrong-import-position
from training.sharding import make_mesh  # pylint: disable=wrong-import-position
from training.steps import init_state  # pylint: disable=wrong-import-position

DEPTHS = (2, 8, 32, 80)


def config(num_layers: int, scan: bool):
  c = tiny.get_config()
  c.model.update(num_layers=num_layers, scan_layers=scan)
  return c


def pattern_configs(num_layers: int, linear: int, full: int) -> dict:
  """configs/tiny.py with `linear` linear-attention layers before each `full`
  ones, {"cycle": scanned by its cycle, "looped": a loop}."""
  layouts = {}
  for name in ("cycle", "looped"):
    c = config(num_layers, name == "cycle")
    c.model.layer_types = ("linear_attention",) * linear + ("full_attention",) * full
    layouts[name] = c
  return layouts


def cpu_compile_seconds(c) -> float:
  start = time.perf_counter()
  lowered, _ = compiler.lower_on_mesh(c, make_mesh(c.mesh))
  lowered.compile()
  return time.perf_counter() - start


def tpu_compile_seconds(c, target: str) -> float:
  c.mesh.update(data=1, fsdp=-1)
  return compiler.compile_report(c, targets.parse_target(target))["compile_seconds"]


def step_seconds(steps: int) -> dict:
  """Median seconds per train step of configs/tiny.py, {scanned: s, looped: s}."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from model import build_model  # pylint: disable=import-outside-toplevel
  from training.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  runs = {}
  for scan in (True, False):
    c = config(2, scan)
    lowered, _ = compiler.lower_on_mesh(c, make_mesh(c.mesh))
    step = lowered.compile()
    params = nnx.state(build_model(c.model, nnx.Rngs(0)))
    state = init_state(params, make_optimizer(c.train), 0)
    rng = np.random.default_rng(0)
    T = c.train.seq_len
    batch = {"inputs": rng.integers(1, 1000, (c.train.batch_size, T)).astype(np.int32),
             "targets": rng.integers(1, 1000, (c.train.batch_size, T)).astype(np.int32),
             "segment_ids": np.ones((c.train.batch_size, T), np.int32),
             "positions": np.broadcast_to(np.arange(T), (c.train.batch_size, T)).astype(np.int32),
             "loss_mask": np.ones((c.train.batch_size, T), np.float32)}
    state, batch = jax.device_put((state, batch), step.input_shardings[0])
    runs["scanned" if scan else "looped"] = [step, state, batch, []]
  for i in range(steps + 3):  # alternate, so that both see the same load
    for run in runs.values():
      step, state, batch, times = run
      start = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      if i >= 3:
        times.append(time.perf_counter() - start)
      run[1] = state
  return {name: statistics.median(run[3]) for name, run in runs.items()}


def write(result: dict, path: str) -> None:
  """The result so far, as JSON, to `path` ("" writes nothing)."""
  if path:
    with open(path, "w", encoding="utf-8") as f:
      f.write(json.dumps(result, indent=2) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="", help="write the JSON here too")
  parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True,
                      help="compile on this host's CPU (--no-cpu skips it)")
  parser.add_argument("--tpu", default="tpu:v5p:2x2x1", help='TPU target ("" skips it)')
  parser.add_argument("--depths", default=",".join(map(str, DEPTHS)))
  parser.add_argument("--steps", type=int, default=30,
                      help="timed train steps of each layout (0 skips the step timing)")
  parser.add_argument("--pattern", default="",
                      help='"L:F": L linear-attention layers before each F full ones, scanned '
                           "by the cycle and looped; empty: identical layers")
  args = parser.parse_args()
  depths = [int(d) for d in args.depths.split(",") if d] if args.cpu or args.tpu else []
  result = {
      "date": datetime.date.today().isoformat(), "commit": git_commit(),
      "jax": jax.__version__, "cpu_devices": len(jax.devices()), "tpu_target": args.tpu,
      "model": "configs/tiny.py (d=128) at each depth",
      "compile": [{"layers": layers} for layers in depths]}
  if args.pattern:
    linear, full = map(int, args.pattern.split(":"))
    result.update(pattern=args.pattern, model=result["model"] + f", {linear} linear-attention "
                  f"layers before each {full} full-attention ones")
    names, layouts = ("cycle", "looped"), lambda n: pattern_configs(n, linear, full)
  else:
    names = ("scanned", "looped")
    layouts = lambda n: {"scanned": config(n, True), "looped": config(n, False)}
  for name in names:  # every scanned depth first: the looped deep ones take longest
    for row in result["compile"]:
      if args.cpu:
        row[f"cpu_{name}_s"] = round(cpu_compile_seconds(layouts(row["layers"])[name]), 2)
      if args.tpu:
        row[f"tpu_{name}_s"] = round(tpu_compile_seconds(layouts(row["layers"])[name], args.tpu),
                                     2)
      print(json.dumps(row), flush=True)
      write(result, args.out)
  if args.steps:
    steps = step_seconds(args.steps)
    result.update(train_step_s={k: round(v, 5) for k, v in steps.items()},
                  train_step_ratio_scanned_over_looped=round(steps["scanned"] / steps["looped"], 4))
  print(json.dumps(result, indent=2))
  write(result, args.out)


if __name__ == "__main__":
  main()
