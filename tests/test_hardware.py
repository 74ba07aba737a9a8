"""The MFU denominator: exact device kinds, the confusable ones, unknown kinds."""
import jax
import pytest

from configs import base
from training import hardware
from training.loop import peak_flops


@pytest.mark.parametrize("kind,tflops", [
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA A10", 125.0), ("NVIDIA A10G", 70.0),
    # As JAX reports them: v5e and v6e are the "lite" chips, v5p is plain "TPU v5".
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v6 lite", 918.0),
])
def test_each_device_kind_has_its_own_peak(kind, tflops):
  assert hardware.peak_tflops(kind) == tflops


@pytest.mark.parametrize("kind", [
    "cpu", "TPU v6", "TPU v5p", "TPU v5e", "NVIDIA A100", "NVIDIA H100", "H200",
    "NVIDIA GeForce RTX 4090", "NVIDIA L40", "nvidia h200", "NVIDIA H200 ", "",
])
def test_unknown_or_partial_kinds_have_no_peak(kind):
  assert hardware.peak_tflops(kind) is None


def test_confusable_kinds_differ():
  """The substring table this replaced gave v5e the v5p figure and L40S L4's."""
  peak = hardware.peak_tflops
  assert peak("TPU v5 lite") < peak("TPU v5") / 2
  assert peak("NVIDIA L40S") > 2 * peak("NVIDIA L4")
  assert peak("NVIDIA A10G") != peak("NVIDIA A10")


def test_no_mfu_on_an_unknown_device_unless_the_config_gives_a_peak():
  c = base.get_config()
  assert jax.devices()[0].device_kind not in hardware.PEAK_BF16_TFLOPS  # the CPU here
  assert peak_flops(c) is None
  c.train.peak_tflops = 100.0
  assert peak_flops(c) == 100e12 * jax.device_count()
