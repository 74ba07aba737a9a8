"""bench/compile_h200.py without the CUDA plugin: its parsers of ptxas and
XLA's dumps (on real output), and its one-line refusal when the plugin is
missing (CI installs none)."""
import os
import subprocess
import sys

from bench import compile_h200

PTXAS_SPILLS = """\
ptxas warning : Registers are spilled to local memory in function 'flash_attention_hopper_dq_mosaic_gpu_kernel', 88 bytes spill stores, 128 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_attention_hopper_dq_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attention_hopper_dq_mosaic_gpu_kernel
    88 bytes stack frame, 88 bytes spill stores, 128 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 88 bytes cumulative stack size, 1 bytes smem
"""
PTXAS_CLEAN = """\
ptxas info    : Function properties for flash_attention_forward
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 166 registers, used 1 barriers
"""
THUNKS = """\
000: kCustomKernel [source | sink] loop_broadcast_fusion grid: [16, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
001: kCustomKernel [source | sink] flash_attention_forward grid: [8, 2, 4] threads: [128, 1, 1]  shared_memory: 32768 bytes
"""
MOSAIC_LOG = """\
gpu.launch_func @k::@k blocks in (%1, %2, %3) threads in (%c384, %c1, %c1) dynamic_shared_memory_size %20 args(%84 : !llvm.ptr)
gpu.launch_func @k::@k blocks in (%1, %2, %3) threads in (%c384, %c1, %c1) dynamic_shared_memory_size %c117840_i32 args(%68 : !llvm.ptr)
"""


def test_parsers_read_real_output():
  assert compile_h200.parse_ptxas(PTXAS_SPILLS) == dict(
      registers=168, spill_stores=88, spill_loads=128)
  assert compile_h200.parse_ptxas(PTXAS_CLEAN) == dict(
      registers=166, spill_stores=0, spill_loads=0)
  assert compile_h200.parse_triton_launches(THUNKS) == {
      "loop_broadcast_fusion": 0, "flash_attention_forward": 32768}
  assert compile_h200.parse_mosaic_smem(MOSAIC_LOG) == 117840
  assert compile_h200.parse_mosaic_smem("no launch here") is None


def test_cases_cover_both_lowerings_and_every_variant():
  cases = compile_h200.cases(tune=False)
  assert {(c["lowering"], c["fused"], c["D"], c["causal"], c["variant"]) for c in cases} == {
      (lowering, fused, D, causal, variant)
      for lowering, fused in (("mosaic_gpu", False), ("mosaic_gpu", True), ("triton", False))
      for D in (64, 128) for causal in (True, False) for variant in compile_h200.VARIANTS}
  assert len(compile_h200.cases(tune=True)) > len(cases)


def test_without_the_cuda_plugin_it_says_so_in_one_line():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "bench/compile_h200.py"], cwd=compile_h200.ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr.strip().count("\n") == 0, result.stderr
  assert "install JAX's CUDA plugin" in result.stderr
