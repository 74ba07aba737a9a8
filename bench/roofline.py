"""A roofline of a run's train step, kernel by kernel, without the chip.

  JAX_PLATFORMS=cpu venv-cuda/bin/python -m bench.roofline --config configs/gpt2_small.py \\
      --target gpu:h200
  JAX_PLATFORMS=cpu .venv/bin/python -m bench.roofline --config configs/tiny.py \\
      --target tpu:v5e:2x2 --json

Compiles the run's real train step for the target as compile.py does
(`aot.compiler.lower_step`: the model, AdamW, the mesh; `--config.x.y=`
overrides as every tool parses them) and reads the optimized program
(`compiled.as_text()`): each kernel's FLOPs, bytes and time at the chip's
peak FLOP/s and HBM bandwidth (`aot/roofline.py`), grouped by the part of
the model it comes from. The predicted step time is the sum over kernels
of max(FLOP time, byte time) plus a stated launch cost per kernel
(`aot.roofline.LAUNCH_SECONDS`: 5 us on a GPU, 0 on a TPU); the MFU bound
it implies is the model's FLOPs per step (`model.accounting.flops_per_step`,
per device) over that time at peak. Where the compiler gives a cost
analysis (TPU targets) its FLOPs and bytes stand beside ours, both with
each loop body counted once, as the compiler counts them. For GPT-2 small
(configs/gpt2_small.py, 32 x 1024) on one H200, the step the card measured
(`aot.roofline.MEASURED`) is printed beside the prediction.

The report names its train.remat policy; `python compile.py ... --remat_policies`
sets every policy side by side (memory, recomputed FLOPs).

`gpu:h200` is one H200 (`gpu:h200:1`). `cpu` is this machine's CPU, its
peaks measured by probes (bench/cpu_roofline.py). Prints a table (the `--top` kernels
by time, then the groups); `--json` prints the report as JSON instead,
`--out FILE` writes it there too. Bad input: one line on stderr, exit 2.
"""
import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from aot.roofline import parse_target, roofline_report
from bench.cpu_roofline import cpu_report, probe_peaks
from configs.cli import parse_flags
from configs.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_TARGET = flags.DEFINE_string("target", None, "gpu:h200 (one H200), gpu:h200:<gpus> or "
                              "tpu:<chip>:<topology> (tpu:v5e:2x2), or cpu (this machine's).")
_JSON = flags.DEFINE_bool("json", False, "Print the report as JSON.")
_OUT = flags.DEFINE_string("out", None, "Also write the report as JSON to this file.")
_TOP = flags.DEFINE_integer("top", 20, "Kernels to list, longest first.")
flags.mark_flags_as_required(["config", "target"])

def _bytes(n: float) -> str:
  return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def format_report(report: dict, top: int) -> str:
  """The report as the table bench.roofline prints."""
  total = report["total"]
  lines = [f"train step, batch {report['batch_size']} x {report['seq_len']}"
           + (f", loss in chunks of {report['loss_chunk_size']}"
              if report["loss_chunk_size"] else "")
           + f", loss_impl {report['loss_impl']}"
           + f", remat {report['remat']}, on {report['target']} ({report['devices']} device(s)); "
           f"per device: peak {report['peak_flops'] / 1e12:.3g} TFLOP/s (FP8 "
           f"{report['fp8_peak_flops'] / 1e12:.3g}), {report['hbm_bandwidth'] / 1e12:.3g} "
           f"TB/s HBM, {1e6 * report['launch_seconds_per_kernel']:.0f} us a kernel launch",
           "", f"top {top} kernels by time per step (flop and byte times per launch):",
           f"  {'kernel':<36} {'kind':<28} {'group':<20} {'runs':>4} {'GFLOP':>8} "
           f"{'MB':>9} {'flop us':>8} {'byte us':>8} {'ms/step':>8}"]
  for k in report["kernels"][:top]:
    lines.append(f"  {k['name'][:36]:<36} {k['kind'][:28]:<28} {k['group']:<20} {k['runs']:4d} "
                 f"{k['flops'] / 1e9:8.2f} {(k['bytes_read'] + k['bytes_written']) / 1e6:9.1f} "
                 f"{1e6 * k['flop_seconds']:8.1f} {1e6 * k['byte_seconds']:8.1f} "
                 f"{1e3 * k['step_seconds']:8.3f}")
  lines += ["", "per group, per step:",
            f"  {'group':<20} {'kernels':>7} {'TFLOP':>8} {'GB':>8} {'flop ms':>8} "
            f"{'byte ms':>8} {'launch ms':>9} {'ms':>8}"]
  for name, g in list(report["groups"].items()) + [("total", total)]:
    lines.append(f"  {name:<20} {g['kernels']:7d} {g['flops'] / 1e12:8.2f} "
                 f"{g['bytes'] / 1e9:8.1f} {1e3 * g['flop_seconds']:8.2f} "
                 f"{1e3 * g['byte_seconds']:8.2f} {1e3 * g['launch_seconds']:9.2f} "
                 f"{1e3 * g['step_seconds']:8.2f}")
  gemms, fp8 = report["gemms"], report["fp8_gemms"]
  lines += ["", f"GEMMs: {gemms['kernels']} kernels a step, {gemms['bytes'] / 1e9:.1f} GB; "
            f"with FP8 operands {fp8['all']['kernels']}, {fp8['all']['bytes'] / 1e9:.1f} GB"]
  lines += [f"  {operands:<36} {g['kernels']:7d} kernels {g['bytes'] / 1e9:8.1f} GB "
            f"{1e3 * g['step_seconds']:8.2f} ms"
            for operands, g in fp8.items() if operands != "all"]
  lines += ["", f"predicted step {1e3 * total['step_seconds']:.1f} ms (the sum over kernels "
            "of max(FLOP time, byte time) + launch): MFU <= "
            f"{100 * report['mfu_bound']:.1f}% (model FLOPs "
            f"{report['model_flops_per_device'] / 1e12:.2f} T a device a step); all FLOPs at "
            f"peak {1e3 * total['flop_seconds']:.1f} ms, all bytes at peak bandwidth "
            f"{1e3 * total['byte_seconds']:.1f} ms"]
  once, cost = report["loop_bodies_once"], report["compiler_cost_analysis"]
  if cost:
    lines.append(f"each loop body once: FLOPs {once['flops']:.4g} here, {cost['flops']:.4g} by "
                 f"the compiler's cost analysis; bytes {_bytes(once['bytes'])} here, "
                 f"{_bytes(cost['bytes'])} by the compiler")
  else:
    lines.append("the compiler gives no cost analysis for this target")
  measured = report["measured"]
  if measured:
    lines.append(f"measured on the card: {1e3 * measured['step_seconds']:.1f} ms a step, "
                 f"{100 * measured['mfu']:.1f}% MFU ({measured['source']})")
  lines.append(f"chip numbers: {report['chip_source']}")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  # Compile-only: no TPU or GPU is attached; libtpu and the CUDA plugin must not look for one.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    if _TARGET.value == "cpu":
      report = cpu_report(_CONFIG.value, probe_peaks())
    else:
      report = roofline_report(_CONFIG.value, parse_target(_TARGET.value))
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  text = json.dumps(report, indent=1)
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  print(text if _JSON.value else format_report(report, _TOP.value))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
