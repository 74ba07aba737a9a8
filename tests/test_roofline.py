"""aot/roofline.py and bench/roofline.py: a per-kernel roofline of a compiled step.

The parsing is checked on hand-written HLO; one real compile (tiny on a
v5e slice through libtpu) checks the whole tool.
"""
import json
import os
import subprocess
import sys

import pytest

from aot import roofline
from model.kernels import gated_delta
from tests.helpers import ROOT, with_libtpu

# A scan over 3 layers (known trip count) whose body holds a GEMM fusion, an
# in-place stacking of its output and an asynchronous all-reduce; the entry
# holds a cuBLAS GEMM, a fusion reading one slice of a stacked buffer and
# bookkeeping that launches nothing.
MODULE = """
HloModule jit_train_step

%fused_dot (p0: bf16[8,16], p1: bf16[16,32]) -> bf16[8,32] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_dus (q0: f32[3,8,32], q1: bf16[8,32], q2: s32[]) -> f32[3,8,32] {
  %q0 = f32[3,8,32]{2,1,0} parameter(0)
  %q1 = bf16[8,32]{1,0} parameter(1)
  %c = f32[8,32]{1,0} convert(%q1)
  %b = f32[1,8,32]{2,1,0} bitcast(%c)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[3,8,32]{2,1,0} dynamic-update-slice(%q0, %b, %q2, %z, %z)
}

%fused_slice (r0: f32[3,8,32], r1: s32[]) -> f32[8,32] {
  %r0 = f32[3,8,32]{2,1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8,32]{2,1,0} dynamic-slice(%r0, %r1, %z, %z), dynamic_slice_sizes={1,8,32}
  ROOT %neg = f32[8,32]{1,0} bitcast(%ds)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], bf16[8,16], bf16[16,32], f32[3,8,32])) -> (s32[], bf16[8,16], bf16[16,32], f32[3,8,32]) {
  %t = (s32[], bf16[8,16]{1,0}, bf16[16,32]{1,0}, f32[3,8,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%t), index=1
  %w = bf16[16,32]{1,0} get-tuple-element(%t), index=2
  %stack = f32[3,8,32]{2,1,0} get-tuple-element(%t), index=3
  %gemm = bf16[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp()/while/body/closed_call/mlp/dot_general"}
  %stacked = f32[3,8,32]{2,1,0} fusion(%stack, %gemm, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(train_step)/jvp()/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}
  %ars = f32[16,32]{1,0} all-reduce-start(%w), replica_groups={{0,1}}, to_apply=%add
  %ard = f32[16,32]{1,0} all-reduce-done(%ars)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[8,16]{1,0}, bf16[16,32]{1,0}, f32[3,8,32]{2,1,0}) tuple(%next, %x, %w, %stacked)
}

%cond (u: (s32[], bf16[8,16], bf16[16,32], f32[3,8,32])) -> pred[] {
  %u = (s32[], bf16[8,16]{1,0}, bf16[16,32]{1,0}, f32[3,8,32]{2,1,0}) parameter(0)
  %j = s32[] get-tuple-element(%u), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x: bf16[8,16], w: bf16[16,32], s: f32[3,8,32]) -> f32[8,32] {
  %x = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,32]{1,0} parameter(1)
  %s = f32[3,8,32]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,16]{1,0}, bf16[16,32]{1,0}, f32[3,8,32]{2,1,0}) tuple(%zero, %x, %w, %s)
  %loop = (s32[], bf16[8,16]{1,0}, bf16[16,32]{1,0}, f32[3,8,32]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %cublas = (bf16[8,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}, metadata={op_name="jit(train_step)/jvp(logits)/btm,vm->btv/dot_general"}
  %stack = f32[3,8,32]{2,1,0} get-tuple-element(%loop), index=3
  %cast = bf16[16,32]{1,0} bitcast(%w)
  ROOT %last = f32[8,32]{1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(train_step)/optimizer/mul"}
}
"""


def by_name(found):
  return {k.name: k for k in found}


def test_kernels_are_the_launching_instructions_with_loop_trip_counts():
  found = by_name(roofline.kernels(MODULE))
  # Bookkeeping (parameters, constants, tuples, bitcasts, the while itself, a -done)
  # launches nothing; the body's kernels and the condition's compare run 3 times.
  assert set(found) == {"gemm", "stacked", "ars", "next", "lt", "cublas", "last"}
  assert {name: k.runs for name, k in found.items()} == {
      "gemm": 3, "stacked": 3, "ars": 3, "next": 3, "lt": 3, "cublas": 1, "last": 1}
  assert found["gemm"].kind == "kCustom" and found["cublas"].kind == "__cublas$gemm"
  assert found["ars"].kind == "all-reduce-start"


def test_flops_of_dots_in_fusions_and_of_cublas_gemms():
  found = by_name(roofline.kernels(MODULE))
  assert found["gemm"].flops == found["cublas"].flops == 2 * 8 * 32 * 16
  assert found["stacked"].flops == found["last"].flops == found["ars"].flops == 0


def test_bytes_count_operands_and_results_but_slices_and_in_place_updates_by_their_size():
  found = by_name(roofline.kernels(MODULE))
  assert (found["gemm"].bytes_read, found["gemm"].bytes_written) == (
      2 * 8 * 16 + 2 * 16 * 32, 2 * 8 * 32)
  # The stack of 3 is updated in place: the bf16 update and the index are read,
  # the f32 update written.
  assert (found["stacked"].bytes_read, found["stacked"].bytes_written) == (2 * 8 * 32 + 4,
                                                                           4 * 8 * 32)
  # Only one of the stack's 3 slices is read.
  assert (found["last"].bytes_read, found["last"].bytes_written) == (4 * 8 * 32 + 4, 4 * 8 * 32)
  assert found["cublas"].bytes_written == 2 * 8 * 32 + 1024  # the result and its workspace
  assert (found["ars"].bytes_read, found["ars"].bytes_written) == (2 * 16 * 32, 4 * 16 * 32)


def test_groups_from_op_names():
  found = by_name(roofline.kernels(MODULE))
  assert {name: k.group for name, k in found.items()} == {
      "gemm": "mlp", "stacked": "casts and copies", "ars": "collectives", "next": "other",
      "lt": "other", "cublas": "head and loss", "last": "optimizer"}
  cases = {
      "jit(train_step)/transpose(jvp())/while/body/closed_call/attention/jit(flash_attention)/"
      "flash_attention_hopper_dq/mpmd_map": "attention",
      "jit(train_step)/transpose(jvp(norm))/reduce_sum": "norms and residuals",
      "jit(train_step)/jvp()/while/body/closed_call/add": "norms and residuals",
      "jit(train_step)/jvp()/while/body/closed_call/mlp/activation/tanh": "mlp",
      "jit(train_step)/transpose(jvp(loss))/jit(take_along_axis)/scatter-add": "head and loss",
      "jit(train_step)/jvp(jit(_take))/gather": "head and loss",
      "jit(train_step)/closed_call/convert_element_type": "casts and copies",
      "jit(train_step)/optimizer/jit(_where)/select_n": "optimizer",
      "jit(train_step)/div": "other", "": "other"}
  for op_name, group in cases.items():
    assert roofline.group_of(op_name, "fusion") == group, op_name
  assert roofline.group_of("", "copy") == "casts and copies"
  assert roofline.group_of("jit(train_step)/mlp/dot_general", "all-gather-start") == "collectives"


def test_convolution_flops_count_only_window_positions_on_the_input():
  # As libtpu writes a projection [4,128,128] x [128,4,32] -> [4,128,4,32]: the
  # heads axis is a spatial dimension of size 1 under a window of 4 padded by 3
  # a side, of whose 16 (output, window) pairs 4 read the input.
  tpu = """ENTRY %main (a: f32[4,128,128,1], w: f32[128,4,32,1]) -> f32[4,128,4,32] {
  %a = f32[4,128,128,1]{2,1,3,0} parameter(0)
  %w = f32[128,4,32,1]{0,2,1,3} parameter(1)
  ROOT %c = f32[4,128,4,32]{3,1,2,0} convolution(%a, %w), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f, metadata={op_name="jit(train_step)/jvp(attention)/dot_general"}
}
"""
  assert roofline.kernels(tpu)[0].flops == 2 * (4 * 128) * 128 * (4 * 32)
  # A causal depthwise convolution over 10 positions, kernel 4, padded 3 on the left.
  depthwise = """ENTRY %main (x: f32[2,10,8], k: f32[4,1,8]) -> f32[2,10,8] {
  %x = f32[2,10,8]{2,1,0} parameter(0)
  %k = f32[4,1,8]{2,1,0} parameter(1)
  ROOT %c = f32[2,10,8]{2,1,0} convolution(%x, %k), window={size=4 pad=3_0}, dim_labels=b0f_0io->b0f, feature_group_count=8
}
"""
  assert roofline.kernels(depthwise)[0].flops == 2 * 2 * 8 * 1 * (10 * 4 - 6)


def attention_module(target, names_and_shapes, extra=""):
  lines = [f'  %k{i} = {result} custom-call({", ".join(f"%{o}" for o in operands)}), '
           f'custom_call_target="{target}"{extra}, metadata={{op_name="jit(train_step)/attention/'
           f'jit(flash_attention)/{name}/pallas_call"}}'
           for i, (name, operands, result) in enumerate(names_and_shapes)]
  return ("ENTRY %main (q: bf16[2,128,4,64], k: bf16[2,256,2,64]) -> bf16[2,128,4,64] {\n"
          "  %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)\n"
          "  %k = bf16[2,256,2,64]{3,2,1,0} parameter(1)\n"
          "  %s = s32[4]{0} parameter(2)\n" + "\n".join(lines) + "\n}\n")


FORWARD = 4 * 2 * 4 * 128 * 256 * 64  # 4 B H T S D


def test_pallas_attention_flops_by_the_flashattention_convention():
  q = "bf16[2,128,4,64]{3,2,1,0}"
  split = attention_module("mosaic_gpu_v2", [
      ("flash_attention_hopper_forward", ["q", "k", "k"], q),
      ("flash_attention_hopper_dq", ["q", "k", "k", "q"], q),
      ("flash_attention_hopper_dkdv", ["q", "k", "k", "q"], q)])
  flops = [k.flops for k in roofline.kernels(split)]  # [B, T, H, D] queries, [B, S, K, D] keys
  assert flops == [FORWARD / 2, 1.5 * FORWARD / 2, 2 * FORWARD / 2]  # causal: half
  assert [k.flops for k in roofline.kernels(split, causal=False)] == [
      FORWARD, 1.5 * FORWARD, 2 * FORWARD]
  fused = attention_module("__gpu$xla.gpu.triton", [
      ("flash_attention_dkdv", ["q", "k", "k", "q"], q)])
  assert [k.flops for k in roofline.kernels(fused)] == [2.5 * FORWARD / 2]  # no dQ kernel
  # Mosaic TPU: [B, H, T, D] and [B, K, S, D], after scalar-prefetch operands.
  tpu = attention_module("tpu_custom_call", [("flash_attention_tpu_forward", ["s", "q", "k"],
                                              q)]).replace("bf16[2,256,2,64]", "bf16[2,2,256,64]")
  assert roofline.kernels(tpu.replace("bf16[2,128,4,64]", "bf16[2,4,128,64]"))[0].flops == \
      FORWARD / 2


def test_gated_delta_kernel_flops_per_row_head_and_chunk():
  """The delta-rule kernel: `chunk_flops` for each of B H N chunks, read off
  q [B, H, N, C, d_k] and v [B, H, N, C, d_v] (K^T [B, H, N, d_k, C] between)."""
  q, kT, v = "f32[2,4,3,64,32]", "f32[2,4,3,32,64]", "f32[2,4,3,64,16]"
  module = (f"ENTRY %main (q: {q}, t: {kT}, v: {v}) -> {v} {{\n"
            f"  %q = {q}{{4,3,2,1,0}} parameter(0)\n"
            f"  %t = {kT}{{4,3,2,1,0}} parameter(1)\n"
            f"  %v = {v}{{4,3,2,1,0}} parameter(2)\n"
            f"  %o = {v}{{4,3,2,1,0}} custom-call(%q, %q, %t, %v), "
            'custom_call_target="tpu_custom_call", '
            'metadata={op_name="jit(step)/gated_delta_rule_forward_tpu/pallas_call"}\n}\n')
  assert [k.flops for k in roofline.kernels(module)] == [
      2 * 4 * 3 * gated_delta.chunk_flops(64, 32, 16)]


def test_cudnn_attention_flops_by_mask_type():
  q = "bf16[2,128,4,64]{3,2,1,0}"
  causal = ', backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}'
  forward = attention_module("__cudnn$fmhaSoftmax", [("fwd", ["q", "k", "k"], q)], causal)
  backward = attention_module("__cudnn$fmhaSoftmaxBackward", [("bwd", ["q", "k", "k"], q)])
  assert roofline.kernels(forward)[0].flops == FORWARD / 2
  assert roofline.kernels(backward)[0].flops == 2.5 * FORWARD  # no mask: not causal


def test_summary_adds_max_of_flop_and_byte_time_and_launches_per_run():
  found = roofline.kernels(MODULE)
  report = roofline.summary(found, peak_flops=1e12, hbm_bandwidth=1e9, launch_seconds=1e-6)
  total = report["total"]
  assert total["kernels"] == sum(k.runs for k in found) == 17
  assert total["flops"] == 4 * 2 * 8 * 32 * 16  # the loop's GEMM 3 times, cuBLAS once
  expected = sum(k.runs * (max(k.flops / 1e12, (k.bytes_read + k.bytes_written) / 1e9) + 1e-6)
                 for k in found)
  assert total["step_seconds"] == pytest.approx(expected)
  assert sum(g["step_seconds"] for g in report["groups"].values()) == pytest.approx(expected)
  assert report["loop_bodies_once"]["flops"] == 2 * 2 * 8 * 32 * 16
  times = [k["step_seconds"] for k in report["kernels"]]
  assert times == sorted(times, reverse=True)
  assert list(report["groups"]) == [g for g in roofline.GROUPS if g in report["groups"]]


def roofline_cli(*args):
  env = with_libtpu(dict(os.environ, JAX_PLATFORMS="cpu"))
  return subprocess.run([sys.executable, "-m", "bench.roofline", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_an_unknown_target_is_one_line_and_exit_2():
  result = roofline_cli("--config", "configs/tiny.py", "--target", "gpu:v9")
  assert result.returncode == 2
  assert result.stderr.strip().startswith("error: --target") and len(
      result.stderr.strip().splitlines()) == 1


@pytest.mark.tpu
@pytest.mark.slow
def test_tiny_roofline_for_a_v5e_slice(tmp_path):
  out = tmp_path / "roofline.json"
  result = roofline_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                        "--config.model.scan_layers=False", "--out", str(out), "--top", "5")
  assert result.returncode == 0, result.stderr
  assert "per group, per step:" in result.stdout and "predicted step" in result.stdout
  report = json.loads(out.read_text())
  assert report["devices"] == 4 and report["launch_seconds_per_kernel"] == 0
  groups = report["groups"]
  assert {"attention", "mlp", "optimizer", "head and loss"} <= set(groups)
  attention = [k for k in report["kernels"] if k["kind"] == "tpu_custom_call"]
  assert attention and all(k["flops"] > 0 and k["group"] == "attention" for k in attention)
  assert groups["mlp"]["flops"] > 0
  # libtpu's cost analysis stands beside ours (unscanned: each kernel once either way).
  cost = report["compiler_cost_analysis"]
  assert cost["flops"] == pytest.approx(report["total"]["flops"], rel=0.5)
  assert 0 < report["mfu_bound"] <= 1 and report["measured"] is None


def test_gpu_h200_is_one_card_and_the_measured_step_is_gpt2_small_on_it():
  from configs import gpt2_small, tiny  # pylint: disable=import-outside-toplevel
  one = roofline.parse_target("gpu:h200")
  assert (one.name, one.num_devices) == ("gpu:h200:1", 1)
  c = gpt2_small.get_config()
  c.model.scan_layers, c.train.loss_chunk_size = False, 4096
  assert not roofline.is_measured_run(c, one)  # the preset's fused loss; the card ran XLA's
  c.train.loss_impl = "xla"
  assert roofline.is_measured_run(c, one)
  c.train.remat = "save_dots"
  assert not roofline.is_measured_run(c, one)
  c.train.remat = "none"
  assert not roofline.is_measured_run(c, roofline.parse_target("gpu:h200:8"))
  assert not roofline.is_measured_run(tiny.get_config(), one)
  c.train.remat = False  # a bool from before the names: False is none
  assert roofline.is_measured_run(c, one)
  c.train.batch_size = 16
  assert not roofline.is_measured_run(c, one)


@pytest.mark.cuda
@pytest.mark.slow
def test_tiny_roofline_for_one_h200(monkeypatch):
  """configs/tiny.py with our Hopper kernel (bf16, head_dim 64) on a
  compile-only H200: no cost analysis, attention FLOPs from the kernels."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  c = tiny.get_config()
  c.model.update(attention_impl="pallas", num_layers=1, dtype="bfloat16", num_heads=2)
  report = roofline.roofline_report(c, roofline.parse_target("gpu:h200"))
  assert report["compiler_cost_analysis"] is None and report["measured"] is None
  assert report["launch_seconds_per_kernel"] == 5e-6
  attention = [k for k in report["kernels"] if k["kind"] == "mosaic_gpu_v2"]
  assert len(attention) == 3 and all(k["flops"] > 0 for k in attention)  # forward, dQ, dK/dV
  assert report["total"]["kernels"] > 10 and 0 < report["mfu_bound"] <= 1


# model.fp8's GEMMs on a GPU: cuBLAS FP8 calls reading e4m3 operands (forward)
# and an e5m2 gradient (backward), with scalar scales beside them.
FP8_MODULE = """
HloModule jit_train_step

ENTRY %main (x: f8e4m3fn[8,16], w: f8e4m3fn[16,32], g: f8e5m2[8,32], s: f32[], y: bf16[8,16]) -> bf16[8,32] {
  %x = f8e4m3fn[8,16]{1,0} parameter(0)
  %w = f8e4m3fn[16,32]{1,0} parameter(1)
  %g = f8e5m2[8,32]{1,0} parameter(2)
  %s = f32[] parameter(3)
  %y = bf16[8,16]{1,0} parameter(4)
  %fwd = (bf16[8,32]{1,0}, s8[64]{0}) custom-call(%x, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %dx = (bf16[8,16]{1,0}, s8[64]{0}) custom-call(%g, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %plain = (bf16[8,32]{1,0}, s8[64]{0}) custom-call(%y, %y), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %neg = bf16[8,32]{1,0} negate(%x)
}
"""


def test_fp8_gemms_are_counted_by_their_operands_dtypes():
  found = by_name(roofline.kernels(FP8_MODULE))
  assert found["fwd"].gemm_operands == "f8e4m3fn,f8e4m3fn"
  assert found["dx"].gemm_operands == "f8e5m2,f8e4m3fn"
  assert found["plain"].gemm_operands == "bf16,bf16" and found["neg"].gemm_operands == ""
  assert found["fwd"].bytes_read == 8 * 16 + 16 * 32 + 2 * 4  # one byte an element, the scales
  report = roofline.summary(list(found.values()), peak_flops=1e12, hbm_bandwidth=1e9,
                            launch_seconds=0.0, fp8_peak_flops=2e12)
  rows = {r["name"]: r for r in report["kernels"]}
  assert rows["fwd"]["flop_seconds"] == 2 * 8 * 16 * 32 / 2e12  # FP8 operands: the FP8 peak
  assert rows["plain"]["flop_seconds"] == rows["plain"]["flops"] / 1e12
  assert report["gemms"]["kernels"] == 3
  fp8 = report["fp8_gemms"]
  assert fp8["all"]["kernels"] == 2
  assert fp8["all"]["bytes"] == sum(found[k].bytes_read + found[k].bytes_written
                                    for k in ("fwd", "dx"))
  assert {k: v["kernels"] for k, v in fp8.items() if k != "all"} == {
      "f8e4m3fn,f8e4m3fn": 1, "f8e5m2,f8e4m3fn": 1}
