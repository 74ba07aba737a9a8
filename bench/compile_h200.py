"""Compile our attention kernels for an H200 with no GPU attached.

Deviceless ahead-of-time compilation: JAX's CUDA plugin can build a compile-
only H200 (`jax.experimental.topologies` with the target in
`bench/h200_target.txtpb`), and XLA then compiles for it exactly as it would
on the card: the Triton kernels through XLA's Triton pipeline, the Mosaic GPU
kernels through Mosaic's, both down to ptxas for sm_90a. Nothing runs, so
this says nothing about speed or results; it catches what fails before
running (lowering, layouts, shared memory, ptxas) and shows each kernel's
registers and spills, so a device session spends its minutes on timing.

Every case is forward + backward (the forward, dQ and dK/dV kernels, or
the forward and the fused dK/dV kernel) in bfloat16, for both lowerings and
the fused Mosaic GPU backward, head_dim 64 and 128, causal or not, and
three variants that change the kernels' code: `plain` (T = S = 2048, one KV
head per query head), `seg+gqa` (segment ids, 4 query heads per KV head)
and `ragged` (T = 1000, S = 1500: padded tiles, masked padded keys, MQA).
`--tune` adds the tiles `bench/attention.py --tune` sweeps on the card
(causal, `plain`).

Columns: `regs` is ptxas's registers per thread (for the Mosaic kernels the
launch value, 65536 / 384 threads = 168; their compute warpgroups raise it to
232 with setmaxnreg), `spill` the bytes spilled to local memory (stores /
loads), `smem` the kernel's dynamic shared memory (Triton: XLA's launch;
Mosaic GPU: Mosaic's allocation). A kernel whose code an earlier case
already compiled (the dK/dV kernel does not depend on block_k, say) is not
recompiled, and its row says so.

`per step` reads the SASS (nvdisasm; for Mosaic GPU its own dump of the
binary it built, whose ptxas options differ from a plain `ptxas` run on its
PTX by tens of instructions a step; for Triton, a plain `ptxas` run on XLA's
PTX, as for its registers) of each inner loop that issues wgmma,
one warp's view of one iteration: instructions (a warp issues at most one a
cycle), the cycles the SM's tensor cores spend on its wgmmas (16-bit dense:
2048 multiply-adds a cycle, 989 TFLOP/s at 1.83 GHz on 132 SMs), the cycles
its exponentials take on the special-function unit (MUFU: 16 lanes a cycle
an SM, 8 cycles a warp instruction), and its local-memory loads and stores
(spills) when there are any: `458 i / 1024 tc / 528 mufu`. A loop can keep
the tensor cores busy only if its instructions and MUFU cycles fit in its
tensor cycles (the two compute warpgroups share both); a static bound, not
a timing. Code under a branch counts as if taken; `min` is the count on
the shortest way through an iteration, where it is shorter: the step loops
of a listed plan (segment ids) mask a step under a branch, and the fused
dK/dV loop holds a dQ product over 128 keys that each warpgroup runs every
other step (at head_dim 128, 512 of its 1536 tensor cycles).

Setup, once, in a venv of its own (the CUDA wheels take 4.4 GB; no driver
or GPU is needed); the same venv runs the suite's `cuda` tests:

  python3 -m venv venv-cuda
  venv-cuda/bin/pip install -r requirements-gpu.txt nvidia-cuda-nvdisasm

(nvidia-cuda-nvdisasm only for the `per step` column.)

Works with jax 0.10.2 (CI's) and 0.11.2 (the H200 machine's; there a
python3.12 venv with "jax[cuda13]==0.11.2" flax==0.12.10 ml-collections
nvidia-cuda-nvdisasm).

Run (about 6 minutes on 2 cores; 13 with --tune; --lowering and --variant
select cases):

  venv-cuda/bin/python -m bench.compile_h200 --out bench/results/compile_h200.json

Exit status 1 if any case failed to compile.
"""
import argparse
import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from bench import attention as bench_attention
from bench.bench_utils import command_line, git_commit
from model.kernels import flash_attention_hopper as hopper
from model.kernels.router import flash_attention

ROOT = pathlib.Path(__file__).resolve().parents[1]

TARGET = ROOT / "bench" / "h200_target.txtpb"
VARIANTS = {  # name: (T, S, H, K, segment ids)
    "plain": (2048, 2048, 4, 4, False),
    "seg+gqa": (2048, 2048, 8, 2, True),
    "ragged": (1000, 1500, 4, 1, False),
}


def h200_device():
  """A compile-only H200 (raises if JAX's CUDA plugin is not installed)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topology = topologies.get_topology_desc(
      platform="cuda", topology="1x1x1", target_config=TARGET.read_text())
  return topology.devices[0]


def cases(tune: bool) -> list[dict]:
  """Each case: lowering, D, causal, variant, tiles (None: the kernel's own),
  fused (Mosaic GPU's own tiles with the fused dQ backward)."""
  out = [dict(lowering=lowering, D=D, causal=causal, variant=variant, tiles=None,
              fused=fused)
         for lowering, fused in (("mosaic_gpu", False), ("mosaic_gpu", True),
                                 ("triton", False))
         for D in (64, 128) for causal in (True, False) for variant in VARIANTS]
  if tune:
    out += [dict(lowering="mosaic_gpu", D=D, causal=True, variant="plain", tiles=tiles,
                 fused=tiles[4])
            for D in (64, 128) for tiles in bench_attention.mosaic_tune_tiles(False, D)]
    out += [dict(lowering="triton", D=D, causal=True, variant="plain", tiles=tiles,
                 fused=False)
            for D in (64, 128) for tiles in bench_attention.triton_tune_tiles(False)]
  return out


def attention(case: dict, device):
  """(q, k, v, q_seg, kv_seg) -> out, with tiles chosen for `device`."""
  kwargs = dict(causal=case["causal"], scale=1.0 / math.sqrt(case["D"]))
  tiles = case["tiles"]
  if case["lowering"] == "mosaic_gpu":
    if tiles is None:  # the default tiles, with the backward the case names
      S = VARIANTS[case["variant"]][1]
      blocks = dataclasses.replace(hopper.choose_hopper_blocks(case["D"], S),
                                   fused_dq=case["fused"])
    else:
      blocks = bench_attention.mosaic_blocks(tiles)
    return lambda q, k, v, qs, ks: hopper.hopper_flash_attention(
        q, k, v, q_segment_ids=qs, kv_segment_ids=ks, blocks=blocks,
        interpret=False, **kwargs)
  block_q, block_k = tiles or (None, None)
  return lambda q, k, v, qs, ks: flash_attention(
      q, k, v, q_segment_ids=qs, kv_segment_ids=ks, block_q=block_q,
      block_k=block_k, lowering=case["lowering"], device=device, **kwargs)


def forward_and_backward(fn):
  def step(q, k, v, qs, ks, do):
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, qs, ks), q, k, v)
    return vjp(do)
  return step


def abstract_inputs(case: dict, device) -> tuple:
  T, S, H, K, segments = VARIANTS[case["variant"]]
  D, sharding = case["D"], jax.sharding.SingleDeviceSharding(device)

  def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  q_seg, kv_seg = (spec((2, T), jnp.int32), spec((2, S), jnp.int32)) if segments else (None, None)
  return (spec((2, T, H, D)), spec((2, S, K, D)), spec((2, S, K, D)), q_seg, kv_seg,
          spec((2, T, H, D)))


def parse_ptxas(text: str) -> dict:
  """Registers and spill bytes from `ptxas -v` output (one kernel)."""
  registers = re.search(r"Used (\d+) registers", text)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return dict(registers=int(registers.group(1)) if registers else None,
              spill_stores=int(spills.group(1)) if spills else 0,
              spill_loads=int(spills.group(2)) if spills else 0)


def parse_triton_launches(thunks: str) -> dict[str, int]:
  """{kernel: dynamic shared memory bytes} from XLA's thunk sequence dump."""
  return {m.group(1): int(m.group(2)) for m in re.finditer(
      r"kCustomKernel .*? (\S+) grid: .*?shared_memory: (\d+) bytes", thunks)}


def parse_mosaic_smem(mlir_log: str) -> int | None:
  """The dynamic shared memory of a Mosaic GPU launch (its last lowering)."""
  sizes = re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", mlir_log)
  return int(sizes[-1]) if sizes else None


TENSOR_MACS_PER_CYCLE = {"BF16": 2048, "F16": 2048, "TF32": 1024}  # dense, an SM
MUFU_CYCLES = 8  # one warp instruction on the special-function unit


def sass_loops(sass: str) -> list[dict]:
  """Per iteration of each inner loop of a kernel's SASS that issues wgmma,
  in program order: instructions, tensor-core cycles, MUFU cycles, local
  memory accesses (see the module docstring).

  A loop is a backward branch with its target; branches back from the
  out-of-line barrier retries that follow the kernel's EXIT are not loops,
  and a loop that holds another such loop is not an inner one.
  """
  labels, instructions, predicated = {}, [], []
  for line in sass.splitlines():
    label = re.match(r"^(\.L_x_\d+):", line.strip())
    if label:
      labels[label.group(1)] = len(instructions)
      continue
    inst = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*$", line)
    if inst:
      instructions.append(re.sub(r"^@!?U?P\w+\s+", "", inst.group(1)))
      predicated.append(inst.group(1).startswith("@"))
  spans = []
  for end, inst in enumerate(instructions):
    target = re.search(r"BRA `\((\.L_x_\d+)\)", inst)
    start = labels.get(target.group(1)) if target else None
    if start is not None and start <= end:
      body = instructions[start:end + 1]
      if any(i.startswith("HGMMA") for i in body) and not any(
          i.startswith("EXIT") for i in body):
        spans.append((start, end))
  inner = [(a, b) for a, b in spans
           if not any((a, b) != (c, d) and a <= c and d <= b for c, d in spans)]
  loops = []
  for start, end in sorted(set(inner)):
    body = instructions[start:end + 1]
    tensor = 0.0
    for inst in body:
      mma = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)\.F32\.(\w+)", inst)
      if mma:
        m, n, k = map(int, mma.group(1, 2, 3))
        tensor += m * n * k / TENSOR_MACS_PER_CYCLE.get(mma.group(4), 2048)
    loops.append(dict(
        instructions=len(body),
        shortest=_shortest_path(instructions, predicated, labels, start, end),
        tensor_cycles=round(tensor),
        mufu_cycles=MUFU_CYCLES * sum(i.startswith("MUFU") for i in body),
        local=sum(i.split()[0].split(".")[0] in ("LDL", "STL") for i in body)))
  return loops


def _shortest_path(instructions, predicated, labels, start: int, end: int) -> int:
  """Instructions on the shortest way through one iteration of the loop
  [start, end]: a predicated branch forward inside the loop may be taken or
  not (a step's mask under a branch, say); branches out of it (barrier
  retries) are not taken."""
  cost = {end + 1: 0}
  for i in range(end, start - 1, -1):
    target = re.search(r"BRA `\((\.L_x_\d+)\)", instructions[i])
    to = labels.get(target.group(1)) if target and i < end else None
    if to is not None and i < to <= end:
      taken = cost[to]
      cost[i] = 1 + (min(taken, cost[i + 1]) if predicated[i] else taken)
    else:
      cost[i] = 1 + cost[i + 1]
  return cost[start]


@functools.cache
def cuda_tool(name: str) -> str | None:
  """A CUDA tool (ptxas, nvdisasm) of the wheels next to this Python, else
  the one on PATH, else None."""
  found = glob.glob(str(pathlib.Path(sys.prefix) / "lib" / "python*" / "site-packages"
                        / "nvidia" / "*" / "bin" / name))
  return found[0] if found else shutil.which(name)


def ptxas(ptx: pathlib.Path) -> tuple[dict, list[dict] | None]:
  """ptxas -v on a Triton kernel's PTX for sm_90a: (its report, `sass_loops`
  of the cubin, None without nvdisasm)."""
  cubin = ptx.with_suffix(".cubin")
  result = subprocess.run([cuda_tool("ptxas") or "ptxas", "-v", "--gpu-name", "sm_90a",
                           str(ptx), "-o", str(cubin)],
                          capture_output=True, text=True, check=False)
  report = parse_ptxas(result.stderr)
  if cuda_tool("nvdisasm") is None or not cubin.exists():
    return report, None
  sass = subprocess.run([cuda_tool("nvdisasm"), str(cubin)], capture_output=True,
                        text=True, check=False).stdout
  return report, sass_loops(sass)


def kernel_reports(dump: pathlib.Path) -> dict[str, dict]:
  """{kernel: registers, spills, smem, loops} from one compile's dump folder."""
  reports = {}
  for path in sorted(dump.glob("*.ptxas")):  # Mosaic GPU: one per kernel
    name = re.sub(r"_\d+$", "", path.stem)
    log = path.with_suffix(".mlir-passes.log")
    sass = path.with_suffix(".sass_ctrl")  # Mosaic's own binary, with nvdisasm
    loops = sass_loops(sass.read_text()) if sass.exists() else None
    reports[name] = dict(parse_ptxas(path.read_text()), loops=loops,
                         smem=parse_mosaic_smem(log.read_text()) if log.exists() else None)
  launches = {}
  for path in dump.glob("*thunk_sequence.txt"):
    launches.update(parse_triton_launches(path.read_text()))
  for path in sorted(dump.glob("*.ptx")):  # XLA's modules: the Triton kernels
    entry = re.search(r"\.entry (flash_attention\w*)\(", path.read_text())
    if entry is None or path.name.startswith("flash_attention_hopper"):
      continue
    report, loops = ptxas(path)
    reports[entry.group(1)] = dict(report, loops=loops, smem=launches.get(entry.group(1)))
  return reports


def compile_case(case: dict, device) -> dict:
  """Compiles one case; its kernels' reports, or the error."""
  with tempfile.TemporaryDirectory() as dump:
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump
    start = time.perf_counter()
    try:
      step = forward_and_backward(attention(case, device))
      with jax.default_device(device):  # Pallas' Triton lowering asks it for the GPU
        lowered = jax.jit(step).trace(*abstract_inputs(case, device)).lower(
            lowering_platforms=("cuda",))
      # XLA's dump of every kernel's PTX (jax 0.11 wants the last two options).
      lowered.compile(compiler_options={"xla_dump_to": dump, "xla_gpu_dump_llvmir": True,
                                        "xla_dump_emitter_re": ".*"})
    except Exception as exc:  # pylint: disable=broad-except
      first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
      return dict(error=f"{type(exc).__name__}: {first[:200]}",
                  seconds=time.perf_counter() - start)
    kernels = kernel_reports(pathlib.Path(dump))
  if "new_body" in kernels:  # JAX names a kernel with a Ref argument (fused dK/dV) so
    kernels["flash_attention_hopper_dkdv"] = kernels.pop("new_body")
  prefix = "flash_attention_hopper_" if case["lowering"] == "mosaic_gpu" else "flash_attention_"
  for name in (prefix + kernel for kernel in ("forward", "dkdv") + (() if case["fused"] else ("dq",))):
    kernels.setdefault(name, dict(cached=True))
  return dict(kernels=kernels, seconds=time.perf_counter() - start)


def tiles_label(case: dict) -> str:
  """auto (the kernel's own tiles), auto fused, or bench/attention.py's label."""
  if case["tiles"] is None:
    return "auto fused" if case["fused"] else "auto"
  return bench_attention.tile_label(case["tiles"])


def loops_label(loops: list[dict] | None) -> str:
  """`per step`: each inner loop as instructions / tensor / MUFU cycles."""
  if loops is None:
    return "no nvdisasm"
  return "; ".join(
      f"{loop['instructions']} i"
      + (f" (min {loop['shortest']})" if loop["shortest"] < loop["instructions"] else "")
      + f" / {loop['tensor_cycles']} tc / {loop['mufu_cycles']} mufu"
      + (f" / {loop['local']} ldl+stl" if loop["local"] else "") for loop in loops)


def table(rows: list[dict]) -> str:
  lines = ["| lowering | D | causal | variant | tiles | kernel | regs | spill (st/ld B) "
           "| smem KiB | per step |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    case, result = row["case"], row["result"]
    head = (f"| {case['lowering']} | {case['D']} | {'yes' if case['causal'] else 'no'} "
            f"| {case['variant']} | {tiles_label(case)} ")
    if "error" in result:
      lines.append(head + f"| error: {result['error']} | | | | |")
      continue
    for name, k in sorted(result["kernels"].items()):
      if k.get("cached"):
        lines.append(head + f"| {name} | same code as an earlier row (not recompiled) | | | |")
        continue
      smem = "?" if k["smem"] is None else f"{k['smem'] / 1024:.1f}"
      lines.append(head + f"| {name} | {k['registers']} | {k['spill_stores']}/"
                   f"{k['spill_loads']} | {smem} | {loops_label(k.get('loops'))} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  parser.add_argument("--tune", action="store_true",
                      help="also the tiles bench/attention.py --tune sweeps")
  parser.add_argument("--lowering", choices=("mosaic_gpu", "triton"),
                      help="only the cases of this lowering")
  parser.add_argument("--variant", choices=tuple(VARIANTS),
                      help="only the cases of this variant")
  args = parser.parse_args()
  # Before the CUDA plugin loads: its version probe wants a driver, which a
  # compile-only target does not need; Mosaic GPU then writes ptxas's report
  # and (with nvdisasm) the SASS of the binary it built.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
  try:
    device = h200_device()
  except Exception as exc:  # pylint: disable=broad-except
    sys.exit(f"compile_h200: no compile-only H200 ({type(exc).__name__}: {exc}); "
             "install JAX's CUDA plugin as this script's docstring says")
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              target=device.device_kind, jax=jax.__version__, commit=git_commit(),
              command=command_line())
  print(f"# Deviceless compile for {meta['target']} (sm_90a), jax {meta['jax']}, "
        f"commit {meta['commit']}, {meta['date']}", flush=True)
  rows = []
  for case in cases(args.tune):
    if (args.lowering or case["lowering"]) != case["lowering"] or (
        args.variant or case["variant"]) != case["variant"]:
      continue
    rows.append(dict(case=case, result=compile_case(case, device)))
    print(table(rows[-1:]).splitlines()[-1] if "error" in rows[-1]["result"]
          else f"ok {case} {rows[-1]['result']['seconds']:.1f}s", flush=True)
  print("\n" + table(rows))
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  failed = [r for r in rows if "error" in r["result"]]
  print(f"\n{len(rows) - len(failed)} compiled, {len(failed)} failed")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
