"""Compile our Mosaic TPU attention kernels for TPUs without one attached.

Deviceless ahead-of-time compilation, as `bench/compile_h200.py` does for
the H200: with libtpu installed (`requirements-libtpu.txt`),
`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)` gives
abstract TPU devices of a slice, and XLA and Mosaic compile for them
exactly as on the chip. Nothing runs: this says whether each kernel
compiles and how much VMEM the compiler gives it, not how fast it is.

Per case (generation x head_dim 64/128/256 x causal or not x variant:
`plain` T = S = 2048 with one KV head per query head, `seg+gqa` segment ids
and 4 query heads per KV head, `ragged` T = 1000, S = 1500 with MQA;
bfloat16, batch 2), the tiles `choose_tpu_blocks` picks for that
generation and its scoped-VMEM limit; forward + backward compiled as one
program (`ok`, or the error's first line); and from the compiled program,
for each of the three kernels (`fwd`, `dq`, `dkdv`), the scoped VMEM the
compiler allotted it (the `used_scoped_memory_configs` of its
`tpu_custom_call`, memory space 1 = VMEM), beside the HBM temporaries of
XLA's memory analysis.

Run (about 14 minutes on 2 shared cores for the 36 default cases):

  python -m bench.compile_tpu --out bench/results/compile_tpu-$(date +%F).json

`--topology` picks the slices (default v5e:2x2 and v5p:2x2x1; v4:2x2x1 and
v6e:2x2 also work), `--head_dim` and `--variant` the cases. Exit status 1
if any case failed to compile.
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only, beside others

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp

from bench.bench_utils import command_line, git_commit
from model.kernels import flash_attention_tpu as tpu
# pylint: enable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1")
VARIANTS = {  # name: (T, S, H, K, segment ids)
    "plain": (2048, 2048, 4, 4, False),
    "seg+gqa": (2048, 2048, 8, 2, True),
    "ragged": (1000, 1500, 4, 1, False),
}
B = 2
KERNELS = ("forward", "dq", "dkdv")  # flash_attention_tpu_<kernel>
_CALL = re.compile(r"%\w*flash_attention_tpu_([a-z]+)_*[.\d]* = .*custom_call_target=\"tpu_custom_call\""
                   r".*\"used_scoped_memory_configs\":\[\{\"memory_space\":\"1\",\"offset\":\"\d+\",\"size\":\"(\d+)\"")


def tpu_device(topology: str):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


def first_line(exc: Exception) -> str:
  lines = [line for line in str(exc).splitlines() if line.strip()]
  return (lines[0] if lines else type(exc).__name__)[:160]


def kernel_vmem(compiled_text: str) -> dict:
  """{kernel: scoped VMEM bytes} of our kernels in a compiled program's HLO."""
  return {name: int(size) for name, size in _CALL.findall(compiled_text)}


def compile_case(device, topology: str, variant: str, D: int, causal: bool) -> dict:
  T, S, H, K, segments = VARIANTS[variant]
  blocks = tpu.choose_tpu_blocks(T, S, D, 2, device_kind=device.device_kind)
  row = dict(topology=topology, device_kind=device.device_kind, variant=variant, D=D,
             causal=causal, block_q=blocks.block_q, block_k=blocks.block_k,
             vmem_limit=blocks.vmem_limit_bytes)
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

  def step(q, k, v, do, q_seg, kv_seg):
    def f(q, k, v):
      return tpu.tpu_flash_attention(q, k, v, causal=causal, scale=D ** -0.5,
                                     q_segment_ids=q_seg if segments else None,
                                     kv_segment_ids=kv_seg if segments else None,
                                     blocks=blocks, interpret=False)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))

  start = time.perf_counter()
  try:
    compiled = jax.jit(step).lower(
        spec((B, T, H, D)), spec((B, S, K, D)), spec((B, S, K, D)), spec((B, T, H, D)),
        spec((B, T), jnp.int32), spec((B, S), jnp.int32)).compile()
    row["step"] = "ok"
    row["vmem_bytes"] = kernel_vmem(compiled.as_text())
    row["hbm_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
  except Exception as exc:  # pylint: disable=broad-except
    row["step"] = first_line(exc)
  row["compile_s"] = round(time.perf_counter() - start, 1)
  return row


def table(rows: list[dict]) -> str:
  head = (f"{'topology':10} {'variant':8} {'D':>4} {'causal':6} {'tiles':>9} {'limit':>5} "
          f"{'fwd':>6} {'dq':>6} {'dkdv':>6} {'hbm tmp':>8}  step")
  lines = [head, "-" * len(head), "(VMEM per kernel and HBM temporaries in MiB)"]
  for r in rows:
    vmem = r.get("vmem_bytes", {})
    cells = [f"{vmem[k] / 2**20:.2f}" if k in vmem else "-" for k in KERNELS]
    temp = f"{r['hbm_temp_bytes'] / 2**20:.1f}" if "hbm_temp_bytes" in r else "-"
    lines.append(
        f"{r['topology']:10} {r['variant']:8} {r['D']:>4} {str(r['causal']):6} "
        f"{r['block_q']:>4}x{r['block_k']:<4} {r['vmem_limit'] >> 20:>4}M "
        f"{cells[0]:>6} {cells[1]:>6} {cells[2]:>6} {temp:>8}  {r['step']}")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  parser.add_argument("--topology", nargs="+", default=list(TOPOLOGIES))
  parser.add_argument("--head_dim", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--variant", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
  args = parser.parse_args()
  meta = dict(date=datetime.date.today().isoformat(), commit=git_commit(),
              jax=jax.__version__, command=command_line())
  rows = []
  for topology in args.topology:
    device = tpu_device(topology)
    for variant in args.variant:
      for D in args.head_dim:
        for causal in (False, True):
          rows.append(compile_case(device, topology, variant, D, causal))
          print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(f"\n{meta}\n{table(rows)}")
  failed = [r for r in rows if r["step"] != "ok"]
  print(f"{len(rows) - len(failed)} compiled, {len(failed)} failed")
  if args.out:
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
