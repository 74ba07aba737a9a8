"""Compile targets for `compile.py`: the chips, their numbers, their abstract devices.

A target is `<platform>:<chip>:<shape>`: `tpu:v5p:4x4x4` (a 64-chip v5p
slice, the shape as Cloud TPU writes it), `tpu:v5e:2x2`, `gpu:h200:8` (one
node of 8 H200s). `target_devices` returns abstract devices of that slice
(`jax.experimental.topologies`), which JAX compiles for exactly as for the
real chips, without them: TPU targets need libtpu (`make install-tpu`,
which keeps it in .venv/libtpu, or `pip install -r requirements-tpu.txt` and
JAX_PLATFORMS=cpu on a machine without a TPU), GPU targets JAX's CUDA plugin
(`pip install -r requirements-gpu.txt`, 4.4 GB, no driver or GPU needed).

Per-chip numbers, each from its maker's page (`Chip.source`): the dense bf16
peak (from `training/hardware.py`, by the chip's `device_kind`, the table
the training loop's MFU uses), HBM capacity and bandwidth, and the interconnect bandwidth per chip
counted both directions (ICI for TPUs, NVLink for GPUs), which is what a
ring collective over the chip's links can use.
"""
import dataclasses
import importlib.util
import math
import pathlib
import sys

from configs.errors import UserError
from training import hardware

GB = 1e9
GIB = 2**30
ROOT = pathlib.Path(__file__).resolve().parents[1]
H200_TARGET_CONFIG = ROOT / "bench" / "h200_target.txtpb"
LIBTPU_DIR = ROOT / ".venv" / "libtpu"  # `make install` keeps libtpu here, off the default path
INSTALL = {"tpu": "make install-tpu (or pip install -r requirements-tpu.txt and run with "
                  "JAX_PLATFORMS=cpu)",
           "gpu": "pip install -r requirements-gpu.txt (its own venv: the CUDA wheels take "
                  "4.4 GB; no GPU or driver needed)"}


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip: the numbers a roofline needs, and where they come from."""
  platform: str  # "tpu" or "gpu"
  device_kind: str  # as `jax.Device.device_kind` names it
  hbm_bytes: float
  hbm_bandwidth: float  # bytes/s
  interconnect_bandwidth: float  # bytes/s per chip, both directions (ICI or NVLink)
  source: str
  fp8_speedup: float = 1.0  # dense FP8 FLOP/s over dense bf16 (2: Hopper's tensor cores)

  @property
  def peak_flops(self) -> float:
    """Dense bf16 FLOP/s."""
    return hardware.peak_tflops(self.device_kind) * 1e12

  @property
  def fp8_peak_flops(self) -> float:
    """Dense FLOP/s of a product of FP8 operands (model.fp8); the bf16 peak
    where the chip has no faster FP8 path."""
    return self.fp8_speedup * self.peak_flops


CHIPS = {
    "v4": Chip("tpu", "TPU v4", 32 * GIB, 1200 * GB, 1.1e15 / 4096,
               "cloud.google.com/tpu/docs/v4 (ICI: the pod's 1.1 PB/s all-reduce "
               "bandwidth over its 4096 chips)"),
    "v5e": Chip("tpu", "TPU v5 lite", 16 * GIB, 800 * GIB, 400 * GB,
                "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("tpu", "TPU v5", 95 * GIB, 2765 * GB, 1200 * GB,
                "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("tpu", "TPU v6 lite", 32 * GB, 1638 * GB, 800 * GB,
                "cloud.google.com/tpu/docs/v6e"),
    "h200": Chip("gpu", "NVIDIA H200", 141 * GB, 4.8e12, 900 * GB,
                 "NVIDIA H200 SXM datasheet (dense bf16 is half the sparse 1,979 TFLOP/s, "
                 "dense FP8 half the sparse 3,958)", fp8_speedup=2.0),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice to compile for: its chip and how many of them."""
  name: str  # as given, "tpu:v5p:4x4x4"
  chip_name: str
  chip: Chip
  shape: str  # "4x4x4" (TPU topology) or "8" (GPUs in the node)
  num_devices: int


def parse_target(text: str) -> Target:
  """`tpu:<chip>:<AxB[xC]>` or `gpu:h200:<n>` -> Target; UserError naming the fix."""
  usage = ("--target: expected tpu:<chip>:<topology> (e.g. tpu:v5p:4x4x4, tpu:v5e:2x2) or "
           "gpu:h200:<gpus> (e.g. gpu:h200:8)")
  parts = text.split(":")
  if len(parts) != 3:
    raise UserError(f"{usage}, got {text!r}")
  platform, chip_name, shape = parts
  chip = CHIPS.get(chip_name)
  if chip is None or chip.platform != platform:
    known = ", ".join(f"{c.platform}:{name}" for name, c in CHIPS.items())
    raise UserError(f"--target {text!r}: unknown chip; known: {known}")
  dims = shape.split("x") if platform == "tpu" else [shape]
  if not all(d.isdigit() and int(d) > 0 for d in dims):
    raise UserError(f"{usage}, got {text!r}")
  return Target(text, chip_name, chip, shape, math.prod(int(d) for d in dims))


def target_devices(target: Target) -> list:
  """Abstract devices of the target slice (compile-only; nothing runs on them)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  if (target.chip.platform == "tpu" and importlib.util.find_spec("libtpu") is None
      and LIBTPU_DIR.is_dir()):
    sys.path.append(str(LIBTPU_DIR))  # loaded for this compile only, never probed at start-up
  try:
    if target.chip.platform == "tpu":
      topology = topologies.get_topology_desc(platform="tpu",
                                              topology_name=f"{target.chip_name}:{target.shape}")
    else:
      topology = topologies.get_topology_desc(
          platform="cuda", topology=f"1x1x{target.num_devices}",
          target_config=H200_TARGET_CONFIG.read_text())
  except Exception as e:  # pylint: disable=broad-except  (missing plugin, bad topology)
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"--target {target.name}: cannot build its devices ({first_line}); "
                    f"check the topology and install: {INSTALL[target.chip.platform]}") from e
  return list(topology.devices)
