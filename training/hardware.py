"""Peak dense bf16 matmul throughput per accelerator: the MFU denominator.

Keyed by `jax.Device.device_kind` exactly as JAX reports it (for GPUs the
CUDA device name, for TPUs "TPU v<generation>[ lite]"), never by substring:
"TPU v5 lite" (v5e) is not "TPU v5" (v5p), and "NVIDIA L40S" is not
"NVIDIA L4". A kind not in the table has no known peak, so no MFU is
reported for it (set `train.peak_tflops` instead); a wrong denominator would
be worse than none.

Figures are per chip, dense (without 2:4 sparsity; NVIDIA's datasheets list
the sparse figure, twice the dense one, with an asterisk). Sources:
NVIDIA's product datasheets (A100, H100, H200, HGX B200, L4, L40S, A10) and
Google Cloud's TPU system architecture pages (v4, v5e, v5p, v6e). The A10G
exists only in AWS G5 instances and has no NVIDIA datasheet; its figure is
the one commonly quoted for it (about half the A10's tensor throughput).

Also how much memory a device can hold, for train.py's pre-flight check, and
what the host is (its CPU model, the CPUs a process may use, XLA's CPU
thread count), for the records of timed runs.
"""
import os

PEAK_BF16_TFLOPS: dict[str, float] = {
    # NVIDIA Ampere
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A10": 125.0,
    "NVIDIA A10G": 70.0,
    # NVIDIA Ada
    "NVIDIA L4": 121.0,
    "NVIDIA L40S": 362.0,
    # NVIDIA Hopper
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,  # SXM
    "NVIDIA H200 NVL": 835.0,
    # NVIDIA Blackwell
    "NVIDIA B200": 2250.0,
    # Google TPU
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5": 459.0,  # v5p
    "TPU v6 lite": 918.0,  # v6e (Trillium)
}


def peak_tflops(device_kind: str) -> float | None:
  """Dense bf16 peak TFLOP/s of one device of `device_kind`, None when unknown."""
  return PEAK_BF16_TFLOPS.get(device_kind)


def host_memory_available() -> int:
  """Bytes of host RAM available to a new allocation: MemAvailable of
  /proc/meminfo, else the physical memory (os.sysconf)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_limit(device) -> tuple[int | None, str]:
  """(bytes one device can hold, what that is): the allocator's bytes_limit of
  a GPU or TPU, host RAM available for a CPU device; None when unknown."""
  if device.platform == "cpu":
    return host_memory_available(), "host RAM available"
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (int(limit), f"{device.device_kind} memory") if limit else (None, "")


# XLA's CPU client sizes its thread pools (the intra-op pool that splits
# matmuls and reductions among them) from the first of these set to an
# integer, else from the CPUs the process may run on (its affinity mask).
XLA_THREAD_VARS = ("PJRT_NPROC", "NPROC")


def usable_cpus() -> int:
  """The CPUs this process may run on (its affinity mask; taskset and SLURM
  narrow it)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def xla_cpu_threads(env: dict | None = None) -> int:
  """The threads XLA's CPU client runs with in a process started with
  environment `env` (default: this one's) and this process's affinity."""
  env = os.environ if env is None else env
  for name in XLA_THREAD_VARS:
    value = env.get(name, "")
    if value.strip().isdigit():
      return int(value)
  return usable_cpus()


def cpu_model() -> str | None:
  """The CPU's model name from /proc/cpuinfo (Linux), or None."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                  None)
  except OSError:
    return None
