"""bench/compile_h200.py without the CUDA plugin: its parsers of ptxas and
XLA's dumps (on real output), and its one-line refusal when the plugin is
missing (CI installs none)."""
import importlib.util
import os
import subprocess
import sys

import pytest

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


# nvdisasm's layout: an outer loop (.L_x_5) around an inner one (.L_x_10)
# whose barrier wait retries out of line, after the EXIT, and branches back.
SASS = """\
.L_x_5:
        /*0000*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_10:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R6 ;
        /*0020*/               @!P1 BRA `(.L_x_20) ;
.L_x_11:
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR20], R88, gsb0 ;
        /*0048*/               @P4 BRA `(.L_x_12) ;
        /*0050*/                   MUFU.EX2 R16, R20 ;
        /*0060*/                   LDL R18, [R1] ;
.L_x_12:
        /*0070*/               @P2 BRA `(.L_x_10) ;
        /*0080*/                   HGMMA.64x64x8.F32.TF32 R88, gdesc[UR20], R88, gsb0 ;
        /*0090*/               @P3 BRA `(.L_x_5) ;
        /*00a0*/                   EXIT ;
.L_x_20:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R6 ;
        /*00c0*/               @!P1 BRA `(.L_x_20) ;
        /*00d0*/                   BRA `(.L_x_11) ;
"""


def test_sass_loops_finds_the_inner_wgmma_loop():
  """One iteration of .L_x_10: 8 instructions, 6 when the branch to
  .L_x_12 is taken (the retry branch out of the loop is not); 64 + 32
  tensor cycles; one MUFU instruction; one local load. Not the outer loop,
  nor the retry."""
  assert compile_h200.sass_loops(SASS) == [
      dict(instructions=8, shortest=6, tensor_cycles=96, mufu_cycles=8, local=1)]
  assert compile_h200.loops_label(compile_h200.sass_loops(SASS)) == (
      "8 i (min 6) / 96 tc / 8 mufu / 1 ldl+stl")
  assert compile_h200.loops_label(None) == "no nvdisasm"


def test_cases_cover_both_lowerings_and_every_variant():
  cases = compile_h200.cases(tune=False)
  assert {(c["lowering"], c["fused"], c["D"], c["causal"], c["variant"]) for c in cases} == {
      (lowering, fused, D, causal, variant)
      for lowering, fused in (("mosaic_gpu", False), ("mosaic_gpu", True), ("triton", False))
      for D in (64, 128) for causal in (True, False) for variant in compile_h200.VARIANTS}
  assert len(compile_h200.cases(tune=True)) > len(cases)


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda13_plugin") is not None,
                    reason="JAX's CUDA plugin is installed here")
def test_without_the_cuda_plugin_it_says_so_in_one_line():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-m", "bench.compile_h200"], cwd=compile_h200.ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr.strip().count("\n") == 0, result.stderr
  assert "install JAX's CUDA plugin" in result.stderr
