"""compile.py: ahead-of-time compilation for TPU slices and GPU nodes.

TPU targets compile here through libtpu (requirements-libtpu.txt); the GPU
target needs JAX's CUDA plugin, which the suite's venv does not have: run
this file from a venv made with `pip install -r requirements-gpu.txt` to
check it. The 70B preset's parameter count is checked against the published
Llama-2-70b figure from shapes alone.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from configs import llama2_70b, tiny, validation
from configs.errors import UserError
from model import accounting
from tests.helpers import ROOT, with_libtpu
from aot import compiler as aot
from aot import targets as aot_targets

LLAMA2_70B = 68_976_648_192  # parameters of Llama-2-70b as published


def compile_cli(*args):
  env = with_libtpu(dict(os.environ, JAX_PLATFORMS="cpu"))
  return subprocess.run([sys.executable, "compile.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_llama2_70b_has_the_published_parameter_count():
  assert accounting.formula_params(llama2_70b.get_config().model)["params_total"] == LLAMA2_70B


@pytest.mark.slow
def test_llama2_70b_module_has_the_published_parameter_count():
  assert accounting.measured_params(llama2_70b.get_config().model)["params_total"] == LLAMA2_70B


def test_targets_parse_and_bad_ones_say_the_form():
  target = aot_targets.parse_target("tpu:v5p:4x4x4")
  assert (target.chip_name, target.num_devices) == ("v5p", 64)
  assert aot_targets.parse_target("gpu:h200:8").num_devices == 8
  for bad in ("tpu:v5p", "tpu:v9:2x2", "gpu:v5e:2x2", "tpu:v5e:2xx"):
    with pytest.raises(UserError, match="--target"):
      aot_targets.parse_target(bad)


def test_collectives_read_from_hlo():
  hlo = """
  %all-reduce.2 = f32[1024,128]{1,0:T(8,128)} all-reduce(%f), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, to_apply=%add
  %ag = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) all-gather-start(%p), replica_groups=[16,4]<=[64], dimensions={0}
  %agd = bf16[256,128]{1,0} all-gather-done(%ag)
  %ag2 = bf16[1024,128]{0,1:T(8,128)(2,1)} all-gather(%p0), replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2], device_ids=([2,2]T(1,0)) {'axis_1'}, dimensions={1}
  %rs = f32[8]{0} reduce-scatter(%x), replica_groups={{0,1},{2,3}}, dimensions={0}
  %gte = f32[] get-tuple-element(%all-reduce.2), index=0
  """
  found = aot.collectives(hlo)
  assert found["all-reduce"] == {"count": 1, "bytes": 1024 * 128 * 4,
                                 "traffic_bytes": 2 * 3 * 1024 * 128 * 4 // 4}
  assert found["all-gather"] == {"count": 2, "bytes": 256 * 128 * 2 + 1024 * 128 * 2,
                                 "traffic_bytes": 3 * 256 * 128 * 2 // 4 + 1024 * 128 * 2 // 2}
  assert found["reduce-scatter"] == {"count": 1, "bytes": 32, "traffic_bytes": 32}


def test_a_ragged_all_to_all_moves_at_most_what_it_sends():
  """An expert-parallel exchange (model/moe.py): the result is the receive
  buffer (4 peers x 512 rows); the traffic is 3/4 of the rows sent (512)."""
  hlo = """
  %rows = bf16[512,1,128]{2,1,0} bitcast(%x)
  %ragged_all_to_all.74 = bf16[2048,1,128]{2,1,0:T(1,128)} ragged-all-to-all(%rows, %buf, %a, %b, %c, /*index=5*/%d), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}
  """
  found = aot.collectives(hlo)
  assert found["ragged-all-to-all"] == {"count": 1, "bytes": 2048 * 128 * 2,
                                        "traffic_bytes": 3 * 512 * 128 * 2 // 4}


def test_a_loop_body_counts_once_per_iteration():
  """Scanned layers: the collectives and kernels of a while loop's body count
  its trip count times per step (the compiler's, or the bound of its
  condition as TPU programs have it), nested loops multiply, and a loop of
  unknown trip count counts once."""
  hlo = """HloModule m
%body.1 (p: f32[8]) -> f32[8] {
  %ag = bf16[256,128]{1,0} all-gather(%p0), replica_groups=[1,4]<=[4], dimensions={0}
  %k = f32[4,2,128,64]{3,2,1,0} custom-call(%r), custom_call_target="tpu_custom_call", metadata={op_name="jit(run)/flash_attention_tpu_dq/pallas_call"}
  %inner = f32[8] while(%x), condition=%cond.2, body=%body.2, backend_config={"known_trip_count":{"n":"2"}}
}
%body.2 (p: f32[8]) -> f32[8] {
  %ar = f32[8]{0} all-reduce(%p), replica_groups=[1,4]<=[4], to_apply=%add
}
%cond.2 (p: f32[8]) -> pred[] {
  %lt = pred[] compare(%a, %b), direction=LT
}
%unknown (p: f32[8]) -> f32[8] {
  %ar2 = f32[8]{0} all-reduce(%p), replica_groups=[1,4]<=[4], to_apply=%add
}
%tpu_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar3 = f32[8]{0} all-reduce(%p), replica_groups=[1,4]<=[4], to_apply=%add
}
%tpu_cond (p: (s32[], f32[8])) -> pred[] {
  %constant.1 = s32[]{:T(128)} constant(5)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.1), direction=LT
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %w = f32[8] while(%a), condition=%cond.1, body=%body.1, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"80"}}
  %w2 = f32[8] while(%a), condition=%cond.1, body=%unknown
  %w3 = (s32[], f32[8]) while(%t), condition=%tpu_cond, body=%tpu_body
  %ag0 = bf16[256,128]{1,0} all-gather(%p0), replica_groups=[1,4]<=[4], dimensions={0}
}
"""
  runs = aot.multiplicities(hlo)
  assert (runs["main"], runs["body.1"], runs["body.2"], runs["unknown"]) == (1, 80, 160, 1)
  assert runs["tpu_body"] == 5  # no known trip count: `i < 5` in its condition
  found = aot.collectives(hlo)
  assert found["all-gather"]["count"] == 81 and found["all-reduce"]["count"] == 161 + 5
  assert found["all-gather"]["bytes"] == 81 * 256 * 128 * 2
  assert aot.kernels(hlo)["flash_attention_tpu_dq"]["count"] == 80
  assert aot.has_loops(hlo) and not aot.has_loops(hlo.replace('"n":"80"', '"n":"1"')
                                                   .replace('"n":"2"', '"n":"1"')
                                                   .replace("constant(5)", "constant(1)"))


@pytest.mark.tpu
def test_tiny_compiles_for_a_v5e_slice_and_reports_json():
  # Looped layers: XLA's cost analysis counts a scanned loop's body once.
  result = compile_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                       "--config.mesh.fsdp=2", "--config.model.scan_layers=False", "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert (report["devices"], report["mesh"]) == (4, {"data": 2, "fsdp": 2, "expert": 1, "context": 1,
                                                  "tensor": 1})
  memory = report["memory_per_device"]
  # float32 parameters split over fsdp=2 (the norms' gains replicated), and AdamW's two
  # float32 moments twice that.
  assert 0 <= memory["parameters"] * 2 - report["params_total"] * 4 < 0.01 * memory["parameters"]
  assert 0 <= memory["optimizer_state"] - 2 * memory["parameters"] <= 64  # + step counts
  assert memory["peak"] >= memory["arguments"] > memory["parameters"]
  assert report["fits"] and report["verdict"].startswith("fits")
  assert report["flops_per_device"] == pytest.approx(report["formula_flops_per_device"],
                                                     rel=0.1)
  assert report["collectives"]["all-gather"]["count"] > 0  # fsdp gathers the parameters
  # attention_impl=auto is our Mosaic TPU kernel on a TPU
  assert {k["lowering"] for k in report["kernels"].values()} == {"mosaic_tpu"}
  assert 0 < report["mfu_bound"] <= 1


def test_kernels_read_from_hlo():
  hlo = """
  %flash_attention_tpu_dq.1 = f32[4,2,128,64]{3,2,1,0:T(8,128)S(1)} custom-call(%r, %c), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[4]{0}, f32[4,2,128,64]{3,2,1,0}}, metadata={op_name="jit(run)/jvp()/shard_map/jit(flash_attention)/flash_attention_tpu_dq/pallas_call" stack_frame_id=68}
  %flash_attention_tpu_dq.2 = f32[4,2,128,64]{3,2,1,0} custom-call(%r, %c), custom_call_target="tpu_custom_call"
  %mpmd_map.24 = (bf16[3,128,2,64]{3,2,1,0}, f32[3,2,128]{2,1,0}) custom-call(%p, %q), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={bf16[3,128,2,64]{3,2,1,0}, s32[3,128]{1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(run)/jvp()/shard_map/jit(flash_attention)/flash_attention_hopper_forward/mpmd_map" scheduling_name="mpmd_map.24"}
  %triton.1 = bf16[2,4,128,64]{3,2,1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(shard_map))/flash_attention_dkdv/pallas_call"}
  %custom-call.11 = bf16[128,4,32]{2,1,0} custom-call(%all-gather.85), custom_call_target="AsyncCollectiveDone"
  """
  assert aot.kernels(hlo) == {
      "flash_attention_tpu_dq": {"lowering": "mosaic_tpu", "count": 2,
                                 "operands": ["s32[4]", "f32[4,2,128,64]"],
                                 "results": ["f32[4,2,128,64]"]},
      "flash_attention_hopper_forward": {"lowering": "mosaic_gpu", "count": 1,
                                         "operands": ["bf16[3,128,2,64]", "s32[3,128]"],
                                         "results": ["bf16[3,128,2,64]", "f32[3,2,128]"]},
      "flash_attention_dkdv": {"lowering": "triton", "count": 1, "operands": [],
                               "results": ["bf16[2,4,128,64]"]}}


TPU_KERNELS = {"flash_attention_tpu_forward", "flash_attention_tpu_dq", "flash_attention_tpu_dkdv"}


def gathered_shapes(hlo_text: str) -> list[list[int]]:
  """The shapes every all-gather of a compiled program takes and gives."""
  out = []
  for line in hlo_text.splitlines():
    match = re.search(r"=\s*(.*?)\sall-gather(?:-start)?\(", line)
    if match:
      out += [[int(d) for d in dims.split(",") if d]
              for dims in re.findall(r"\[([\d,]*)\]", match.group(1))]
  return out


@pytest.mark.tpu
@pytest.mark.parametrize("data,fsdp,tensor,kv_heads", [(1, 4, 1, 4), (2, 1, 2, 2)])
def test_pallas_train_step_compiles_for_a_v5e_4_one_kernel_per_device(monkeypatch, data, fsdp,
                                                                       tensor, kv_heads):
  """configs/tiny.py (one layer; with 2 KV heads: GQA) with our kernel for a
  v5e-4: the compiled step calls the Mosaic TPU kernels on each device's rows
  and heads (batch 16 / data x fsdp, 4 heads / tensor) and gathers no q, k or
  v (no all-gather of rank 4 holds the whole batch of 16)."""
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # as compile.py: no TPU attached
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  c = tiny.get_config()
  c.model.update(attention_impl="pallas", num_layers=1, num_kv_heads=kv_heads)
  c.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
  lowered, _, _ = aot.lower_step(c, aot_targets.parse_target("tpu:v5e:2x2"))
  text = lowered.compile().as_text()
  found = aot.kernels(text)
  assert set(found) == TPU_KERNELS and {k["lowering"] for k in found.values()} == {"mosaic_tpu"}
  rows, heads = 16 // (data * fsdp), 4 // tensor
  # The kernels' layout: q [rows, heads, T, D] and k, v [rows, KV heads, T, D] (T and D
  # padded to the tiles), segment ids [rows, T, 1] and [rows, 1, T].
  q, kv = f"f32[{rows},{heads},128,64]", f"f32[{rows},{kv_heads // tensor},128,64]"
  forward = found["flash_attention_tpu_forward"]
  assert {q, kv, f"s32[{rows},128,1]", f"s32[{rows},1,128]"} <= set(forward["operands"])
  assert forward["results"][0] == found["flash_attention_tpu_dq"]["results"][0] == q
  assert found["flash_attention_tpu_dkdv"]["results"] == [kv]
  gathered = gathered_shapes(text)
  assert not [shape for shape in gathered if len(shape) == 4 and 16 in shape], gathered


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("dtype,heads,lowering", [("bfloat16", 2, "mosaic_gpu"),
                                                   ("float32", 4, "triton")])
def test_pallas_train_step_compiles_for_8_h200s_one_kernel_per_device(monkeypatch, dtype,
                                                                       heads, lowering):
  """configs/tiny.py with our kernel on 8 H200s at fsdp=8: the Hopper kernel
  (bf16, head_dim 64) or Triton's (float32) on 3 of the 24 rows per GPU, no
  all-gather of q, k or v (none of rank 4 holds the whole batch of 24; no
  weight has a dimension of 24)."""
  monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  c = tiny.get_config()
  c.model.update(attention_impl="pallas", num_layers=1, dtype=dtype, num_heads=heads)
  c.train.batch_size = 24
  c.mesh.update(data=1, fsdp=8, tensor=1)
  lowered, _, _ = aot.lower_step(c, aot_targets.parse_target("gpu:h200:8"))
  text = lowered.compile().as_text()
  found = aot.kernels(text)
  assert found and {k["lowering"] for k in found.values()} == {lowering}, found
  assert all(shape.split("[")[1].startswith("3,") for k in found.values()
             for shape in k["operands"] + k["results"]), found
  gathered = gathered_shapes(text)
  assert gathered and not [shape for shape in gathered if len(shape) == 4 and 24 in shape]


@pytest.mark.tpu
def test_mesh_that_does_not_divide_the_slice_is_one_line():
  result = compile_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                       "--config.mesh.fsdp=3")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: mesh.data=-1")
  assert "Traceback" not in result.stderr


@pytest.mark.tpu
@pytest.mark.slow
def test_llama2_7b_fits_a_v5p_64_with_fsdp_and_remat():
  result = compile_cli("--config", "configs/llama2_7b.py", "--target", "tpu:v5p:4x4x4",
                       "--config.mesh.fsdp=64", "--config.train.remat=True", "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report["fits"]
  exact = 6_738_415_616 * 4 / 64
  assert exact <= report["memory_per_device"]["parameters"] <= exact * 1.01


@pytest.mark.tpu
@pytest.mark.slow
def test_fsdp_gradients_are_freed_layer_by_layer():
  """8 layers of Llama-2-70B on v5p-256 with fsdp=256 and remat: the whole
  all-reduced gradient of a layer is not kept until the optimizer update
  (training/steps.py `_sharded_grads`): 11.1 GiB per chip, 21.7 without."""
  result = compile_cli("--config", "configs/llama2_70b.py", "--target", "tpu:v5p:4x8x8",
                       "--config.mesh.fsdp=256", "--config.model.num_layers=8", "--json")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout)["memory_per_device"]["peak"] < 13 * 2**30


# Bytes per chip of the looped 70B step with XLA's attention (scan_layers=False,
# attention_impl=xla), the layout this preset had before scanning: bench/RESULTS.md.
LLAMA2_70B_LOOPED_PEAK = 19_972_161_568


@pytest.mark.tpu
@pytest.mark.slow
def test_llama2_70b_scanned_needs_no_more_than_the_loop():
  """The preset as it is (layers scanned, our kernel, remat) on v5p-256: scanning
  must not cost memory, so the peak per chip stays at or under the loop's."""
  result = compile_cli("--config", "configs/llama2_70b.py", "--target", "tpu:v5p:4x8x8",
                       "--config.mesh.fsdp=256", "--json")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout)["memory_per_device"]["peak"] <= LLAMA2_70B_LOOPED_PEAK


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.timeout(900)  # seven compiles: 3 minutes on 2 CPU cores at a load of 15
def test_every_remat_policy_compiles_and_reports_memory_and_recomputed_flops():
  """One row per train.remat policy: `none` recomputes nothing, `full` keeps the
  least and recomputes the most, a policy that saves the matmuls in between."""
  result = compile_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                       "--config.model.scan_layers=False", "--remat_policies", "--json")
  assert result.returncode == 0, result.stderr
  rows = {r["remat"]: r for r in json.loads(result.stdout)}
  assert tuple(rows) == validation.CHOICES["train.remat"]
  assert rows["none"]["recomputed_flops"] == 0
  assert 0 < rows["save_dots"]["recomputed_flops"] < rows["full"]["recomputed_flops"]
  assert rows["full"]["temporary_bytes"] < rows["none"]["temporary_bytes"]


@pytest.mark.cuda
@pytest.mark.slow
def test_tiny_compiles_for_an_h200():
  result = compile_cli("--config", "configs/tiny.py", "--target", "gpu:h200:1", "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report["device_kind"] == "NVIDIA H200" and report["fits"]
  assert report["memory_per_device"]["temporaries"] > 0
  assert report["formula_flops_per_device"] > 0


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.parametrize("step", ["eval", "generate"])
def test_eval_and_generation_steps_compile(step):
  result = compile_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                       "--config.mesh.fsdp=2", f"--step={step}", "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report["step"] == step and report["fits"]
  assert report["memory_per_device"]["optimizer_state"] == 0
  assert report["flops_per_device"] == pytest.approx(report["formula_flops_per_device"],
                                                     rel=0.1)
  if step == "generate":
    assert report["memory_per_device"]["kv_cache"] == report["accounting_per_device"]["kv_cache"]


@pytest.mark.tpu
@pytest.mark.parametrize("chip,shape", [("v4", "2x2x1"), ("v5e", "2x2"), ("v5p", "2x2x1"),
                                        ("v6e", "2x2")])
def test_each_tpu_chip_names_the_device_kind_its_peak_is_keyed_by(chip, shape):
  devices = aot_targets.target_devices(aot_targets.parse_target(f"tpu:{chip}:{shape}"))
  assert devices[0].device_kind == aot_targets.CHIPS[chip].device_kind
