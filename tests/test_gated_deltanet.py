"""Gated DeltaNet (`model/gated_deltanet.py`): the chunked form against the
recurrent one and against transformers' own, packed rows, the layer against
Qwen3-Next's, and hybrid decoders (`model.layer_types` with linear_attention)
trained, scanned and decoded."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from configs.validation import validate, validate_model
from model import accounting, build_model, gated_deltanet as gdn
from model.config import ModelConfig
from model.generate import generate
from model.summary import format_table, summarize
from model.transformer import Segment, layer_plan
from tests.helpers import run_on_cpu_devices, scanned_copy


def rule_inputs(T: int, B: int = 2, Hk: int = 2, Hv: int = 4, K: int = 8, V: int = 6,
                seed: int = 0):
  """Random q, k [B, T, Hk, K], v [B, T, Hv, V], log decays g <= 0 and write
  strengths beta in (0, 1), float32."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  g = -np.abs(normal(B, T, Hv)) * 0.5
  beta = 1 / (1 + np.exp(-normal(B, T, Hv)))
  return normal(B, T, Hk, K), normal(B, T, Hk, K), normal(B, T, Hv, V), g, beta


@pytest.mark.parametrize("T,chunk", [
    pytest.param(150, 64, marks=pytest.mark.slow), (64, 64), (7, 4), (33, 8),
    pytest.param(1, 16, marks=pytest.mark.slow)])
def test_chunked_equals_recurrent_at_any_length(T, chunk):
  """Outputs, final states and every input's gradient, also where T is no
  multiple of the chunk (its last chunk padded) and from a given state."""
  inputs = rule_inputs(T)
  state = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 8, 6)), jnp.float32)
  o_r, s_r = jax.jit(gdn.recurrent)(*inputs, state_BHKV=state)
  o_c, s_c = jax.jit(partial(gdn.chunked, chunk=chunk))(*inputs, state_BHKV=state)
  np.testing.assert_allclose(o_c, o_r, atol=2e-6)
  np.testing.assert_allclose(s_c, s_r, atol=2e-6)
  loss = lambda form: lambda *x: jnp.sum(jnp.sin(form(*x)[0])) + jnp.sum(form(*x)[1] ** 2)
  grads_r = jax.jit(jax.grad(loss(gdn.recurrent), argnums=range(5)))(*inputs)
  grads_c = jax.jit(jax.grad(loss(partial(gdn.chunked, chunk=chunk)), argnums=range(5)))(*inputs)
  for got, want in zip(grads_c, grads_r):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)


def test_packed_rows_reset_the_state_at_each_document():
  """A packed row's documents (segment ids 1, 2, 3; the second row 1 then 5)
  give what each gives alone, in both forms, with chunks that cut across
  the boundaries; the carried state is the last document's."""
  q, k, v, g, beta = rule_inputs(100)
  seg = np.ones((2, 100), np.int32)
  seg[:, 30:], seg[:, 77:], seg[1, 9:] = 2, 3, 5
  chunked = jax.jit(partial(gdn.chunked, chunk=16))
  o_r, s_r = jax.jit(gdn.recurrent)(q, k, v, g, beta, segment_ids_BT=seg)
  o_c, s_c = chunked(q, k, v, g, beta, segment_ids_BT=seg)
  np.testing.assert_allclose(o_c, o_r, atol=2e-6)
  np.testing.assert_allclose(s_c, s_r, atol=2e-6)
  alone = lambda a, b: chunked(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
  for a, b in ((0, 30), (30, 77), (77, 100)):
    np.testing.assert_allclose(o_c[0, a:b], alone(a, b)[0][0], atol=2e-6)
  np.testing.assert_allclose(s_c[0], alone(77, 100)[1][0], atol=2e-6)
  np.testing.assert_allclose(o_c[1, 9:], alone(9, 100)[0][1], atol=2e-6)


@pytest.mark.hf
def test_both_forms_equal_transformers_reference():
  """transformers' torch_chunk_gated_delta_rule and
  torch_recurrent_gated_delta_rule (Qwen3-Next's reference code, which FLA's
  kernels match): the same outputs and final states."""
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_next import modeling_qwen3_next as hf  # pylint: disable=import-outside-toplevel
  inputs = rule_inputs(150)
  torch_inputs = [torch.tensor(x) for x in inputs]
  for ours, theirs in ((gdn.chunked, hf.torch_chunk_gated_delta_rule),
                       (gdn.recurrent, hf.torch_recurrent_gated_delta_rule)):
    o, s = ours(*inputs)
    o_hf, s_hf = theirs(*torch_inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(o, o_hf.numpy(), atol=2e-6)
    np.testing.assert_allclose(s, s_hf.numpy(), atol=2e-6)


def model_cfg(scan=False, **overrides):
  """A small hybrid decoder: linear, full, linear, full; 8 value heads over
  the 4 key heads, d_k 4; chunks of 4."""
  c = base.get_config().model
  c.update(vocab_size=64, d_model=32, num_layers=4, num_heads=4, d_ff=64, max_len=64,
           attention_impl="xla", layer_types=("linear_attention", "full_attention"),
           linear_num_value_heads=8, linear_key_head_dim=4, linear_chunk_size=4,
           init_std=0.3, scan_layers=scan)
  c.update(**overrides)
  return c


def _weights_from_hf(ours: gdn.GatedDeltaNet, layer, cfg) -> None:
  """`layer`'s (transformers' Qwen3NextGatedDeltaNet) weights into `ours`:
  its fused in_proj_qkvz and in_proj_ba hold each key head's q, k, then its
  value heads' v, z (b, a) in turn; its one convolution holds q, k, v."""
  Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  Dk, Dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
  t = lambda p: np.asarray(p.detach().numpy(), np.float32)
  qkvz = t(layer.in_proj_qkvz.weight).T.reshape(cfg.d_model, Hk, -1)
  ba = t(layer.in_proj_ba.weight).T.reshape(cfg.d_model, Hk, 2 * r)
  split = np.cumsum([Dk, Dk, r * Dv])
  q, k, v, z = np.split(qkvz, split, axis=-1)
  ours.q_proj.kernel[...], ours.k_proj.kernel[...] = q, k
  ours.v_proj.kernel[...] = v.reshape(cfg.d_model, Hv, Dv)
  ours.z_proj.kernel[...] = z.reshape(cfg.d_model, Hv, Dv)
  ours.b_proj.kernel[...] = ba[..., :r].reshape(cfg.d_model, Hv)
  ours.a_proj.kernel[...] = ba[..., r:].reshape(cfg.d_model, Hv)
  conv = t(layer.conv1d.weight)[:, 0].T  # [K, channels]
  cq, ck, cv = np.split(conv, [Hk * Dk, 2 * Hk * Dk], axis=-1)
  ours.conv_q[...], ours.conv_k[...] = cq.reshape(-1, Hk, Dk), ck.reshape(-1, Hk, Dk)
  ours.conv_v[...] = cv.reshape(-1, Hv, Dv)
  ours.A_log[...], ours.dt_bias[...] = t(layer.A_log), t(layer.dt_bias)
  ours.norm_scale[...] = t(layer.norm.weight)
  ours.o_proj.kernel[...] = t(layer.out_proj.weight).T.reshape(Hv, Dv, cfg.d_model)


@pytest.mark.hf
def test_the_layer_equals_qwen3_next_gated_deltanet():
  """The whole layer (projections, convolution, gates, rule, gated norm,
  output) against transformers' Qwen3NextGatedDeltaNet with the same
  random weights: float32 outputs within 1e-5 of the largest."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.qwen3_next import modeling_qwen3_next as hf  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig.resolve(model_cfg(norm_eps=1e-6))
  hf_cfg = transformers.Qwen3NextConfig(
      hidden_size=cfg.d_model, linear_num_key_heads=cfg.linear_num_key_heads,
      linear_num_value_heads=cfg.linear_num_value_heads,
      linear_key_head_dim=cfg.linear_key_head_dim,
      linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=4,
      rms_norm_eps=1e-6, layer_types=["linear_attention"], num_hidden_layers=1)
  torch.manual_seed(0)
  layer = hf.Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).float()
  with torch.no_grad():
    for p in layer.parameters():
      p.copy_(torch.randn_like(p) * 0.3)
  ours = gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
  _weights_from_hf(ours, layer, cfg)
  x = np.random.default_rng(0).normal(size=(2, 11, cfg.d_model)).astype(np.float32)
  with torch.no_grad():
    want = layer(torch.tensor(x)).numpy()
  got = np.asarray(ours(jnp.asarray(x)))
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_the_layer_on_a_packed_row_is_each_document_alone():
  """Convolution and rule both stop at a document boundary."""
  layer = gdn.GatedDeltaNet(ModelConfig.resolve(model_cfg()), rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 13, 32)), jnp.float32)
  seg = jnp.asarray([[1] * 6 + [2] * 7])
  packed = layer(x, segment_ids=seg)
  np.testing.assert_allclose(packed[:, :6], layer(x[:, :6]), atol=1e-5)
  np.testing.assert_allclose(packed[:, 6:], layer(x[:, 6:]), atol=1e-5)


def test_the_weights_mix_the_values_as_the_rule_does():
  """`weights` (the [T, T] matrix the rule applies to the values) times the
  values is the rule's output."""
  cfg = ModelConfig.resolve(model_cfg())
  layer = gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 32)), jnp.float32)
  m_BHTT = layer.weights(x)
  convs, g, beta, _ = layer._inputs(x, None, None)  # pylint: disable=protected-access
  o, _ = gdn.recurrent(convs["q"], convs["k"], convs["v"], g, beta)
  np.testing.assert_allclose(jnp.einsum("bhij,bjhv->bihv", m_BHTT, convs["v"]), o, atol=1e-5)
  assert np.all(np.triu(np.asarray(m_BHTT), 1) == 0)  # causal


@pytest.mark.slow
def test_a_hybrid_scans_by_its_cycle_as_the_loop_and_counts_as_its_formula():
  """Linear and full layers: the scanned stack (one cycle body, 2 repeats)
  gives the loop's logits and gradients; the parameter count read off the
  module equals the closed form in both layouts."""
  cfg = ModelConfig.resolve(model_cfg(True))
  assert layer_plan(cfg, 4) == (Segment(0, 2, 2),)
  looped = build_model(model_cfg(False), nnx.Rngs(0))
  scanned = scanned_copy(looped, build_model(model_cfg(True), nnx.Rngs(1)))
  tokens = jax.random.randint(jax.random.key(0), (2, 11), 1, 64)
  loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 3])
  (loss_l, grads_l), (loss_s, grads_s) = (nnx.value_and_grad(loss)(m) for m in (looped, scanned))
  np.testing.assert_allclose(loss_s, loss_l, rtol=1e-5)
  a_log_l = grads_l["decoder"]["layers"][2]["attn"]["A_log"][...]
  a_log_s = grads_s["decoder"]["layers"]["0_to_3_every_2"][0]["attn"]["A_log"][...][1]
  np.testing.assert_allclose(a_log_s, a_log_l, atol=1e-6)
  for scan in (False, True):
    assert (accounting.measured_params(model_cfg(scan))
            == accounting.formula_params(model_cfg(scan)))


@pytest.mark.parametrize("scan", [False, True])
def test_decoding_a_hybrid_keeps_a_state_and_gives_the_full_forward_tokens(scan):
  """Greedy KV-cache and state decoding of prompts of two lengths (the
  shorter one's padding never reaches a state) gives the tokens of
  recomputing the whole row at every step; beam search runs."""
  c = model_cfg(scan)
  model = build_model(c, nnx.Rngs(0))
  prompts = [[1, 5, 9, 3, 4, 5, 6, 7, 8, 9, 10], [2, 7]]
  logits = nnx.jit(lambda m, row: m(row))  # causal: right padding leaves the rest alone
  want = []
  for prompt in prompts:
    row = list(prompt)
    for _ in range(6):
      padded = jnp.asarray([row + [0] * (17 - len(row))])
      row.append(int(jnp.argmax(logits(model, padded)[0, len(row) - 1])))
    want.append(row[len(prompt):])
  assert generate(model, c, prompts, max_new_tokens=6, temperature=0.0) == want
  cache = model.init_cache(2, 20)
  cache = cache if scan else cache[0]
  assert cache["state"].shape[-4:] == (2, 8, 4, 4)  # [B, h_v, d_k, d_v], no token axis
  with pytest.raises(UserError, match="draft=mtp: a rejected draft rolls the KV cache back"):
    generate(model, c, prompts, max_new_tokens=2, draft="mtp")


@pytest.mark.parametrize("overrides,message", [
    (dict(family="encoder", layer_types=("linear_attention",)), "linear_attention layers are "
     "causal"),
    (dict(linear_num_value_heads=6), "model.linear_num_value_heads=6: must be a multiple of "
     "model.linear_num_key_heads=4"),
    (dict(linear_chunk_size=0), "model.linear_chunk_size=0: must be a positive integer"),
])
def test_bad_linear_fields_are_one_line(overrides, message):
  with pytest.raises(UserError, match=message) as err:
    validate_model(model_cfg(**overrides))
  assert "\n" not in str(err.value)


def test_a_context_mesh_refuses_chunks_shorter_than_the_convolution():
  config = base.get_config()
  config.model = model_cfg()
  config.tokenizer.vocab_size = 64
  config.mesh.context = 4
  config.train.seq_len = 16
  with pytest.raises(UserError, match="train.seq_len=16: gives chunks of 2 tokens over 2 x "
                     "mesh.context = 8, fewer than the 3 inputs") as err:
    validate(config)
  assert "\n" not in str(err.value)


def test_the_summary_gives_each_layer_kind_its_cost():
  """`model.summary` per layer kind of `model_cfg` (d 32, 4 heads of 8, 4 KV
  heads, SwiGLU d_ff 64, float32; linear: 4 key heads of 4, 8 value heads of
  4, convolution 4, chunks of 4) at S = 64, against hand counts."""
  config = base.get_config()
  config.model, config.train.seq_len = model_cfg(), 64
  report = summarize(config, "cpu")
  mlp, norms = 3 * 32 * 64, 2 * 32
  linear_mixer = (32 * (2 * 16 + 2 * 32 + 2 * 8) + 4 * (2 * 16 + 32) + 2 * 8 + 4
                  + 32 * 32)  # W_q,k,v,z,b,a; convolutions; A_log, dt_bias; norm; W_o
  assert linear_mixer == 4884
  # rule per value head and chunk of 4: beta K K^T and Q K^T 4 C^2 d_k, the
  # solve (3 rows of substitution, a row of 4 times the 4 x (d_v + d_k)
  # side), W S, Q S, K^T V 6 C d_k d_v, scores V 2 C^2 d_v; 8 heads / 4 tokens
  rule = 8 * (4 * 16 * 4 + 2 * 3 * 4 * 8 + 6 * 4 * 16 + 2 * 16 * 4) // 4
  linear = dict(layers=2, params=linear_mixer + mlp + norms,
                params_active=linear_mixer + mlp + norms,
                flops_per_token_forward=2 * (linear_mixer + mlp + norms) + rule,
                kv_cache_bytes_per_token=0,
                state_bytes_per_sequence=4 * 8 * 4 * 4 + 4 * 3 * (4 * 4 + 4 * 4 + 8 * 4))
  full_params = 4 * 32 * 32 + mlp + norms
  full = dict(layers=2, params=full_params, params_active=full_params,
              flops_per_token_forward=2 * full_params + 2 * 64 * 4 * (8 + 8),
              kv_cache_bytes_per_token=2 * 4 * 8 * 4, state_bytes_per_sequence=0)
  assert report["layer_kinds"] == {"linear_attention": linear, "full_attention": full}
  assert linear["flops_per_token_forward"] == 24_104 and full["state_bytes_per_sequence"] == 0
  embedding_and_norms = report["params_embedding"] + report["params_final_norms"]
  assert report["flops_per_token_forward"] == 2 * (
      linear["flops_per_token_forward"] + full["flops_per_token_forward"]) + 2 * (
          embedding_and_norms)
  table = format_table(config, report)
  assert "linear_attention: state per sequence" in table
  assert "full_attention: KV cache per token" in table


def test_the_chunked_rule_calls_no_triangular_solve():
  """No triangular-solve call in the compiled CPU program: XLA runs one as a
  LAPACK call, which wedged a multithreaded train step (`unit_lower_solve`)."""
  inputs = rule_inputs(40)
  text = jax.jit(lambda *x: gdn.chunked(*x, chunk=16)).lower(*inputs).compile().as_text()
  assert "custom-call" not in text and "triangular-solve" not in text


@pytest.mark.parametrize("kind", ["random", "equal keys"])
def test_the_solve_is_exact_and_stable_with_its_gradients(kind):
  """`unit_lower_solve` at C = 64 against numpy's solve, value and both
  gradients (against jax's triangular solve) in float64-checked float32.
  "equal keys": A = all ones below the diagonal, what a run of one repeated
  token with beta near 1 and no decay gives; a product form of the inverse
  (the power series of -A, entries up to C(63, 31) ~ 1e18) returned 1e11
  there and NaN at longer rows, in eval.py's loss of a trained model."""
  C, rng = 64, np.random.default_rng(0)
  A = (np.tril(np.ones((C, C)), -1) if kind == "equal keys"
       else np.tril(rng.normal(size=(C, C)) / np.sqrt(C), -1)).astype(np.float32)
  A = np.broadcast_to(A, (2, C, C))  # A and the right-hand side share their batch axes
  rhs = rng.normal(size=(2, C, 3)).astype(np.float32)
  want = np.linalg.solve(np.eye(C) + A.astype(np.float64), rhs.astype(np.float64))
  np.testing.assert_allclose(gdn.unit_lower_solve(jnp.asarray(A), jnp.asarray(rhs)), want,
                             rtol=1e-4, atol=1e-4 * np.abs(want).max())
  weights = jnp.asarray(rng.normal(size=(2, C, 3)), jnp.float32)
  lower = jnp.tril(jnp.ones((C, C)), -1)
  loss = lambda solve: lambda A, r: jnp.sum(weights * solve(A * lower, r))
  exact = lambda A, r: jax.scipy.linalg.solve_triangular(jnp.eye(C) + A, r, lower=True)
  got = jax.grad(loss(gdn.unit_lower_solve), argnums=(0, 1))(jnp.asarray(A), jnp.asarray(rhs))
  ref = jax.grad(loss(exact), argnums=(0, 1))(jnp.asarray(A), jnp.asarray(rhs))
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(jnp.abs(r).max()))


def test_a_run_of_one_repeated_token_stays_finite_and_equals_the_recurrence():
  """Equal keys over 256 tokens (4 chunks of 64), beta near 1, no decay: the
  chunked form equals the token-by-token recurrence and is finite."""
  q, k, v, g, beta = rule_inputs(256)
  k = jnp.broadcast_to(k[:, :1], k.shape)
  g, beta = jnp.zeros_like(g), jnp.full_like(beta, 0.99)
  o, state = gdn.chunked(q, k, v, g, beta, chunk=64)
  o_ref, state_ref = gdn.recurrent(q, k, v, g, beta)
  assert np.isfinite(np.asarray(o)).all()
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(state, state_ref, rtol=1e-4, atol=1e-4)


ROWS_DO_NOT_SPLIT = """
import jax, numpy as np
from jax.sharding import AxisType
from configs.errors import UserError
from model import gated_deltanet as gdn
from tests.test_gated_deltanet import rule_inputs
mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
  try:
    gdn._rows_on_each_device(lambda *a: (a[0], a[0]), *rule_inputs(8, B=3))
  except UserError as e:
    print(e)
"""


def test_rows_that_do_not_split_over_the_mesh_are_one_line():
  """The delta-rule kernel runs each device's rows under shard_map: 3 rows
  on 2 data devices is a UserError naming the fix, not a traceback."""
  proc = run_on_cpu_devices(ROWS_DO_NOT_SPLIT, 2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "3 rows (per micro-batch) do not split over the 2 devices of the batch axes data" \
      in proc.stdout and "train.batch_size" in proc.stdout
