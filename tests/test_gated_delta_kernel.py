"""The chunked gated delta rule's Pallas kernel (`model/kernels/gated_delta.py`):
the backward's chunk step against `jax.vjp` of the forward's; both
lowerings in the Pallas interpreter against the XLA chunked form
(`gated_deltanet.chunked`), forward and gradients (the backward kernel's) in
float32, with packed rows, a length no multiple of the chunk and an initial
state; the linear layers following `model.attention_impl`; one-line
refusals; the kernel on each device's rows of a 4-device CPU mesh; and the
Mosaic lowering compiled
for a v5p (with libtpu), the Triton one for an H200 (with JAX's CUDA
plugin), forward and backward, no accelerator attached, with the roofline
counting both kernels' FLOPs."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aot import roofline
from configs.errors import UserError
from model import build_model, gated_deltanet as gdn
from model.config import ModelConfig
from model.kernels import gated_delta
from tests.helpers import float32_tolerance, run_on_cpu_devices, run_python
from tests.test_gated_deltanet import model_cfg, rule_inputs

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only, beside others


def test_the_backward_chunk_step_is_the_forward_steps_vjp():
  """`_chunk_step_vjp` (the backward kernel's chunk) gives what `jax.vjp` of
  `_chunk_step` gives: a chunk of three documents, the state coming in
  reaching the first, the state going out the last; and one document the
  chunk continues to its end."""
  rng = np.random.default_rng(0)
  C, K, V = 16, 8, 4
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k = gdn.l2_normalize(normal(C, K)), gdn.l2_normalize(normal(C, K))  # as the kernel's
  v, S, do, dS = normal(C, V), normal(K, V), normal(C, V), normal(K, V)
  G = jnp.cumsum(-jnp.abs(normal(1, C)) * 0.3, axis=1)
  beta = jax.nn.sigmoid(normal(1, C))
  seg = jnp.asarray([[1] * 5 + [2] * 7 + [3] * 4], jnp.int32)
  for seg, cont, last in [(seg, seg == 1, seg == 3), (seg * 0, seg > 0, seg > 0)]:
    rows = (seg, cont.astype(jnp.float32), last.astype(jnp.float32))
    step = lambda q, k, v, G, beta, S: gated_delta._chunk_step(q, k, k.T, v, G, beta, *rows, S)
    want = jax.jit(lambda *x: jax.vjp(step, *x)[1]((do, dS)))(q, k, v, G, beta, S)
    got = jax.jit(lambda *x: gated_delta._chunk_step_vjp(*x, do, dS))(q, k, k.T, v, G, beta,
                                                                      *rows, S)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lowering", gated_delta.LOWERINGS)
def test_kernel_equals_the_xla_form(lowering):
  """Three documents over a row of 40 tokens (chunks of 16: the last one
  padded, boundaries inside chunks), two value heads per key head, from a
  given state: outputs, final states and every input's gradient, which
  the backward kernel computes."""
  inputs = rule_inputs(40, Hk=1, Hv=2, K=16, V=16)
  state = jnp.asarray(np.random.default_rng(1).normal(size=(2, 2, 16, 16)), jnp.float32)
  seg = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 4]], [13, 20, 7], axis=1), jnp.int32)
  kernel = lambda *x: gated_delta.gated_delta_rule(*x, seg, chunk=16, lowering=lowering)
  xla = lambda *x: gdn.chunked(*x, seg, chunk=16)
  (o_k, s_k), (o_x, s_x) = jax.jit(kernel)(*inputs, state), jax.jit(xla)(*inputs, state)
  np.testing.assert_allclose(o_k, o_x, atol=2e-6)
  np.testing.assert_allclose(s_k, s_x, atol=2e-6)
  loss = lambda form: lambda *x: jnp.sum(jnp.sin(form(*x)[0])) + jnp.sum(form(*x)[1] ** 2)
  grad_kernel = jax.grad(loss(kernel), argnums=range(6))
  assert "gated_delta_rule_backward" in str(jax.make_jaxpr(grad_kernel)(*inputs, state))
  grads_k = jax.jit(grad_kernel)(*inputs, state)  # jitted, the interpreter runs 3x faster
  grads_x = jax.jit(jax.grad(loss(xla), argnums=range(6)))(*inputs, state)
  for got, want in zip(grads_k, grads_x):  # the cotangents carry the forms' rounding
    np.testing.assert_allclose(got, want, atol=float32_tolerance())


def test_the_layers_follow_attention_impl():
  """attention_impl=pallas runs the linear layers on the kernel (interpreted
  here) and gives xla's logits; auto runs XLA on a CPU and the kernel on a
  GPU or TPU."""
  dims = (128, 128)
  assert gdn.rule_implementation("pallas", 64, "cpu", dims) == "pallas"
  assert [gdn.rule_implementation("auto", 64, p, dims) for p in ("cpu", "gpu", "tpu")] == [
      "xla", "pallas", "pallas"]
  assert gdn.rule_implementation("auto", 48, "gpu", dims) == "xla"
  assert gdn.rule_implementation("auto", 64, "gpu", (96, 128)) == "xla"  # not Triton's
  assert gdn.rule_implementation("reference", 64, "gpu", dims) == "xla"
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 20)), jnp.int32)
  forward = nnx.jit(lambda model, tokens: model(tokens))
  logits = {impl: forward(build_model(model_cfg(attention_impl=impl, linear_chunk_size=16),
                                      nnx.Rngs(0)), tokens) for impl in ("xla", "pallas")}
  np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=2e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_impl="pallas", linear_chunk_size=48), "config field "
     "model.linear_chunk_size=48: the delta-rule kernel .attention_impl=pallas. takes chunks "
     "of 16, 32, 64, 128 tokens; choose one or attention_impl xla"),
    (dict(attention_impl="cudnn"), "config field model.attention_impl='cudnn': cuDNN has no "
     "gated delta rule for the linear_attention layers; use attention_impl xla, pallas or auto"),
    (dict(attention_impl="pallas", pallas_lowering="triton", linear_value_head_dim=24,
          linear_chunk_size=16),
     "config field model.pallas_lowering='triton': the delta-rule kernel's Triton lowering "
     "takes head dims that are powers of two, not d_k, d_v = 4, 24; use attention_impl xla"),
])
def test_what_the_kernel_cannot_run_is_one_line(overrides, message):
  with pytest.raises(UserError, match=message) as err:
    ModelConfig.resolve(model_cfg(**overrides))
  assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match="takes chunks of 16, 32, 64, 128 tokens, not 8"):
    gated_delta.gated_delta_rule(*rule_inputs(8), chunk=8)
  with pytest.raises(ValueError, match="Triton lowering takes head dims that are powers of two, "
                     r"not d_k, d_v = \(16, 12\)"):
    gated_delta.gated_delta_rule(*rule_inputs(8, K=16, V=12), chunk=16, lowering="triton",
                                 interpret=False)


def test_a_hybrid_on_cudnn_exits_2_with_one_line():
  result = run_python(["-m", "model.summary", "--config", "configs/tiny.py",
                       "--config.model.layer_types=('linear_attention', 'full_attention')",
                       "--config.model.attention_impl=cudnn"])
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "error: config field model.attention_impl='cudnn': cuDNN has no gated delta rule for "
      "the linear_attention layers; use attention_impl xla, pallas or auto"]


ON_4_DEVICES = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from model import gated_deltanet as gdn
from model.kernels import gated_delta
from tests.test_gated_deltanet import rule_inputs
mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
rows = NamedSharding(mesh, P("data"))
seg = np.repeat([[1, 2]] * 4, [9, 11], axis=1).astype(np.int32)
q, k, v, g, beta, state, seg = (jax.device_put(jnp.asarray(x), rows) for x in (
    *rule_inputs(20, B=4, K=8, V=8), np.full((4, 4, 8, 8), 0.1, np.float32), seg))
def kernel(*x):
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return gdn._rows_on_each_device(lambda *a: gated_delta.gated_delta_rule(
        *a, chunk=16, lowering="triton", interpret=True), *x, seg)
xla = lambda *x: gdn.chunked(*x, seg, chunk=16)
loss = lambda form: lambda *x: jnp.sum(jnp.sin(form(*x)[0])) + jnp.sum(form(*x)[1] ** 2)
got = jax.jit(jax.value_and_grad(loss(kernel), argnums=range(6)))(q, k, v, g, beta, state)
want = jax.value_and_grad(loss(xla), argnums=range(6))(q, k, v, g, beta, state)
print(json.dumps([float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves,
                                                                      (got, want)))]))
"""


@pytest.mark.slow
def test_on_a_mesh_each_device_runs_its_rows():
  """On 4 CPU devices (data 2 x tensor 2) the kernel runs under shard_map on
  each device's rows: the same loss and gradients as the XLA form."""
  proc = run_on_cpu_devices(ON_4_DEVICES, 4)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert max(json.loads(proc.stdout.strip().splitlines()[-1])) < 1e-5


@pytest.mark.tpu
@pytest.mark.slow
def test_compiles_for_v5p():
  """The forward and backward kernels through Mosaic for a v5p: d_k = d_v = 128,
  chunks of 64, packed rows of 1,000 tokens, bfloat16 inputs."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
  compiled = compile_forward_and_backward(device, "tpu")
  assert_roofline_counts_the_kernel(compiled.as_text(), D=128)


@pytest.mark.cuda
@pytest.mark.slow
def test_compiles_for_h200():
  """The same through Triton and XLA for a compile-only H200
  (`bench/compile_h200.py`'s), d_k = d_v = 64."""
  from bench.compile_h200 import h200_device  # pylint: disable=import-outside-toplevel
  compiled = compile_forward_and_backward(h200_device(), "cuda", D=64)
  assert_roofline_counts_the_kernel(compiled.as_text(), D=64)


def assert_roofline_counts_the_kernel(hlo_text: str, D: int, B: int = 2, T: int = 1000,
                                      Hv: int = 4):
  """The roofline finds the forward and the backward kernel once each in the
  compiled step and counts their chunks' FLOPs (`gated_delta.chunk_flops`,
  `gated_delta.backward_chunk_flops`, chunks of 64)."""
  chunks = B * Hv * -(-T // 64)
  for name, per_chunk in (("forward", gated_delta.chunk_flops),
                          ("backward", gated_delta.backward_chunk_flops)):
    found = [k for k in roofline.kernels(hlo_text) if f"gated_delta_rule_{name}" in k.op_name]
    assert [k.flops for k in found] == [chunks * per_chunk(64, D, D)]


def compile_forward_and_backward(device, platform: str, B: int = 2, T: int = 1000,
                                 Hk: int = 2, Hv: int = 4, D: int = 128):
  """The kernel's forward and its backward compiled for `device` (abstract)."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def step(q, k, v, g, beta, seg, do):
    rule = lambda *x: gated_delta.gated_delta_rule(*x, None, seg, chunk=64, device=device)[0]
    out, vjp = jax.vjp(rule, q, k, v, g, beta)
    return out, vjp(do)

  with jax.default_device(device):
    lowered = jax.jit(step).trace(
        spec((B, T, Hk, D)), spec((B, T, Hk, D)), spec((B, T, Hv, D)),
        spec((B, T, Hv), jnp.float32), spec((B, T, Hv), jnp.float32), spec((B, T), jnp.int32),
        spec((B, T, Hv, D), jnp.float32)).lower(lowering_platforms=(platform,))
  return lowered.compile()
