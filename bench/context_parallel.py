"""Context parallelism: per-device memory and step time against sequence
length and context size (`mesh.context`, docs/context_parallel.md).

For every `--seq_lens` x `--contexts` pair the train step of `--config` is
compiled on a mesh of data=1, fsdp=N/context, context, tensor=1 over N
devices, `--rows` rows per step, and the table gives:

- the compiler's memory per device (`memory_analysis`: peak = arguments +
  outputs + temporaries - donated; temporaries alone), and its verdict
  against the chip's HBM where the target is a slice;
- the collectives of the compiled step (collective-permutes: the ring's
  hops, and in brackets those compiled asynchronous with compute scheduled
  between start and done, `aot.compiler.async_overlap`; all-gathers: the
  all-gather strategy's K/V, and fsdp's parameters);
- on the devices this process has (no `--target`), the step time: the
  median of `--steps` timed steps after one untimed, each ended by
  `block_until_ready`, on a state of zeros (parameters and optimizer
  state: the work of a step does not depend on their values) and a batch
  of random tokens, one document per row.

Without `--target` the devices are this process's: on a CPU, run with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` for 8 of them. With
`--target` (compile.py's syntax: tpu:v5p:2x2x2, gpu:h200:8) the step is
compiled for that slice, without running.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.context_parallel \
      --config configs/tiny.py --seq_lens 1024,4096,16384 --contexts 1,2,4,8
  PYTHONPATH=.venv/libtpu JAX_PLATFORMS=cpu python -m bench.context_parallel \
      --config configs/tiny.py --target tpu:v5p:2x2x2 --seq_lens 8192,32768 --contexts 1,4,8

Writes bench/results/context_parallel-<date>.json (or `--out`).
"""
import datetime
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from aot import compiler
from aot.targets import parse_target, target_devices
from bench.bench_utils import command_line, git_commit
from configs.cli import parse_flags
from configs.errors import UserError
from model.resolve import resolve
from training.sharding import batch_sharding, make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file (a decoder).",
                                          lock_config=True)
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096"], "train.seq_len values.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1", "2", "4"], "mesh.context values (each "
                              "dividing the device count).")
_ROWS = flags.DEFINE_integer("rows", 0, "Rows per step (train.batch_size); 0: the device "
                             "count.")
_STRATEGY = flags.DEFINE_enum("strategy", None, ["ring", "all_gather", "auto"],
                              "mesh.context_strategy; default the config's.")
_TARGET = flags.DEFINE_string("target", None, "Compile for this slice instead of running "
                              "(compile.py's --target).")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per row of the table.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "bench/results/context_parallel-<date>.json.")
flags.mark_flags_as_required(["config"])


def case_config(base, seq_len: int, context: int, devices: int, rows: int):
  """`base` with this case's sequence length, rows and mesh."""
  c = base.copy_and_resolve_references()
  c.train.seq_len = seq_len
  c.train.batch_size = rows
  c.train.grad_accum_steps = 1
  c.model.max_len = max(c.model.max_len, seq_len)
  c.mesh.update(data=1, fsdp=devices // context, context=context, tensor=1)
  if _STRATEGY.value:
    c.mesh.context_strategy = _STRATEGY.value
  return c


def random_batch(config, mesh) -> dict:
  """Random tokens, one document per row, laid out over the batch sharding."""
  t = config.train
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), np.int32)
  positions = np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), (t.batch_size, t.seq_len))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.ones((t.batch_size, t.seq_len), np.int32),
           "positions": np.ascontiguousarray(positions),
           "loss_mask": np.ones((t.batch_size, t.seq_len), np.float32)}
  return jax.device_put(batch, batch_sharding(mesh))


def time_step(compiled, lowered, config, mesh, steps: int) -> float:
  """Median seconds of `steps` runs of the compiled train step (one untimed
  first), on zeros for the state."""
  (state_info, _), _ = lowered.args_info
  (state_shardings, _), _ = compiled.input_shardings
  state = jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), state_info,
                       state_shardings)
  batch = random_batch(config, mesh)
  times = []
  for i in range(steps + 1):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    if i:
      times.append(time.perf_counter() - start)
  return statistics.median(times)


def run_case(config, devices, chip, steps: int | None) -> dict:
  """One row: compile (and time, where `steps`) the train step of `config`."""
  config = resolve(config)
  mesh = make_mesh(config.mesh, devices)
  lowered, held = compiler.lower_on_mesh(config, mesh, "train")
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  memory = compiler._memory(compiled, held)  # pylint: disable=protected-access
  hlo_text = compiled.as_text()
  found = compiler.collectives(hlo_text)
  overlap = compiler.async_overlap(hlo_text).get("collective-permute", {})
  t = config.train
  row = {"seq_len": t.seq_len, "context": config.mesh.context, "rows": t.batch_size,
         "mesh": dict(mesh.shape), "strategy": config.mesh.context_strategy,
         "attention_impl": config.model.attention_impl, "compile_seconds": round(compile_s, 2),
         "peak_bytes": memory["peak"], "temporaries_bytes": memory["temporaries"],
         "fits": None if chip is None else memory["peak"] <= chip.hbm_bytes,
         "collectives": {name: c["count"] for name, c in found.items()},
         "permutes_overlapped": overlap.get("overlapped", 0)}
  if steps:
    seconds = time_step(compiled, lowered, config, mesh, steps)
    row.update(step_seconds=seconds, tokens_per_second=t.batch_size * t.seq_len / seconds)
  return row


def table(rows: list[dict]) -> str:
  lines = ["| seq_len | context | mesh (fsdp x context) | peak / device | temporaries | "
           "permutes (overlapped) | all-gathers | step | tokens/s |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    c = r["collectives"]
    step = f"{1000 * r['step_seconds']:,.0f} ms" if "step_seconds" in r else "n/a"
    rate = f"{r['tokens_per_second']:,.0f}" if "step_seconds" in r else "n/a"
    lines.append(
        f"| {r['seq_len']:,} | {r['context']} | {r['mesh']['fsdp']} x {r['mesh']['context']} | "
        f"{r['peak_bytes'] / 2**20:,.1f} MiB{'' if r['fits'] is not False else ' (no fit)'} | "
        f"{r['temporaries_bytes'] / 2**20:,.1f} MiB | {c.get('collective-permute', 0)} "
        f"({r['permutes_overlapped']}) | "
        f"{c.get('all-gather', 0)} | "
        f"{step} | {rate} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  base = _CONFIG.value
  try:
    target = parse_target(_TARGET.value) if _TARGET.value else None
    devices = target_devices(target) if target else jax.devices()
    rows = _ROWS.value or len(devices)
    results = []
    for seq_len in map(int, _SEQ_LENS.value):
      for context in map(int, _CONTEXTS.value):
        if len(devices) % context:
          raise UserError(f"--contexts: {context} does not divide the {len(devices)} devices")
        config = case_config(base, seq_len, context, len(devices), rows)
        results.append(run_case(config, devices, target.chip if target else None,
                                None if target else _STEPS.value))
        print(table(results[-1:]).splitlines()[-1], flush=True)
  except UserError as e:
    raise SystemExit(f"error: {e}") from None
  report = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
            "command": command_line(), "target": _TARGET.value or "this process's devices",
            "device_kind": devices[0].device_kind, "devices": len(devices), "rows": results}
  print()
  print(table(results))
  out = pathlib.Path(_OUT.value or ROOT / "bench" / "results" /
                     f"context_parallel-{report['date']}.json")
  out.write_text(json.dumps(report, indent=1) + "\n")
  print(f"\nwrote {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
