"""The roofline of `python -m bench.roofline --target cpu`: our train step on this CPU.

  python -m bench.roofline --config configs/tiny_gpt2.py --target cpu

What bench.roofline does for a GPU or TPU target, for the host CPU (where
sweeps and ladders run): the run's train step compiled as train.py compiles
it (`aot.compiler.lower_on_mesh` over a mesh of this process's CPU device),
its optimized HLO read kernel by kernel by `aot.roofline.kernels` (on a CPU
a kernel is one thunk of XLA's runtime: a fusion, a dot, a library call),
priced at this CPU's peaks (`aot.roofline.summary`) and printed by
bench.roofline, with the compiler's own cost analysis beside.

No datasheet gives a cloud VM's share of its CPU, so both peaks are
measured here, each the best of `PROBE_REPEATS` runs (`probe_peaks`):
FLOP/s, a float32 [2048, 2048] x [2048, 2048] product compiled by XLA (its
GEMM on every usable core); memory bandwidth, the bytes `x * 2 + 1` reads
and writes over 64 Mi float32 (256 MiB each way, past any cache). A kernel
costs no launch (0 s: XLA's CPU runtime calls its thunks in one process;
what dispatching them costs is what a measured step shows beyond the
prediction).
"""
import os
import time

import jax
import jax.numpy as jnp

from aot.compiler import cost_analysis, lower_on_mesh
from aot.roofline import kernels, summary
from configs.validation import remat_name
from model import accounting
from model.resolve import resolve
from training.hardware import cpu_model
from training.sharding import make_mesh

PROBE_MATMUL = 2048
PROBE_ELEMENTS = 64 * 2**20
PROBE_REPEATS = 5


def _best_seconds(fn, args, repeats: int) -> float:
  """The shortest of `repeats` timed calls of `fn(*args)`, after one untimed."""
  jax.block_until_ready(fn(*args))  # compiled, and the pages touched
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def probe_peaks(repeats: int = PROBE_REPEATS) -> dict:
  """This CPU's FLOP/s and memory bandwidth as XLA reaches them (see the module's
  docstring), the best of `repeats` runs each."""
  n = PROBE_MATMUL
  a = jnp.ones((n, n), jnp.float32)
  flops = 2 * n**3 / _best_seconds(jax.jit(jnp.dot), (a, a), repeats)
  x = jnp.ones((PROBE_ELEMENTS,), jnp.float32)
  moved = 2 * x.nbytes / _best_seconds(jax.jit(lambda x: x * 2 + 1), (x,), repeats)
  return {"peak_flops": flops, "bandwidth": moved,
          "source": f"measured here, best of {repeats}: float32 {n}x{n} matmul by XLA "
                    f"(FLOP/s); x * 2 + 1 over {PROBE_ELEMENTS // 2**20} Mi float32, read "
                    "and written (bytes/s)"}


def cpu_report(config, peaks: dict) -> dict:
  """The train step of `config` compiled for this CPU; the roofline as
  bench.roofline's report (`aot.roofline.roofline_report`'s keys), priced at
  `peaks` (`probe_peaks`)."""
  config = resolve(config)
  mesh = make_mesh(config.mesh, jax.local_devices(backend="cpu")[:1])
  lowered, _ = lower_on_mesh(config, mesh, "train")
  compiled = lowered.compile()
  found = kernels(compiled.as_text(), causal=config.model.family != "encoder")
  report = summary(found, peak_flops=peaks["peak_flops"], hbm_bandwidth=peaks["bandwidth"],
                   launch_seconds=0.0)
  model_flops = accounting.flops_per_step(config)
  predicted = report["total"]["step_seconds"]
  cost = cost_analysis(compiled)
  report.update(
      target=f"cpu ({cpu_model()}, {len(os.sched_getaffinity(0))} usable cores)", devices=1,
      batch_size=config.train.batch_size, seq_len=config.train.seq_len,
      loss_chunk_size=config.train.loss_chunk_size, remat=remat_name(config.train.remat),
      model_flops_per_device=model_flops,
      mfu_bound=model_flops / (predicted * peaks["peak_flops"]),
      compiler_cost_analysis=({"flops": cost.get("flops"), "bytes": cost.get("bytes accessed")}
                              if cost else None),
      measured=None,
      chip_source=peaks["source"])
  return report

