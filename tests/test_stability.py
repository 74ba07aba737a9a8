"""The stability knobs against hand-written float32 references: z-loss,
QK-norm, the attention and final soft-caps (every implementation that takes
one, our Pallas kernels in the interpreter, KV-cache decoding), and the one-line
refusals where an implementation cannot take a soft-cap."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from configs.validation import validate
from model import build_model
from model.attention import Attention, attention, auto_implementation
from model.config import ModelConfig
from model.embeddings import rope_from_config
from model.generate import generate
from model.kernels.router import flash_attention
from tests.test_model import small_cfg
from training.objectives import loss_sums, training_loss_sum


def _log_softmax(x):
  m = x.max(-1, keepdims=True)
  lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
  return x - lse, lse[..., 0]


def test_z_loss_value_and_gradient_match_numpy():
  """Sums and d/dlogits [CE + w log^2 Z] = softmax - onehot + 2 w log Z softmax."""
  rng = np.random.RandomState(0)
  logits = (rng.randn(2, 3, 11) * 3 + 2).astype(np.float32)
  targets = rng.randint(0, 11, (2, 3))
  weights = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
  logp, lse = _log_softmax(logits.astype(np.float64))
  ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  loss_sum, count, _, log_z_sq_sum = loss_sums(jnp.asarray(logits), targets, weights)
  np.testing.assert_allclose(loss_sum, (ce * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(log_z_sq_sum, (lse ** 2 * weights).sum(), rtol=1e-5)
  assert float(count) == 4
  w = 1e-2
  grad = jax.grad(lambda x: training_loss_sum(loss_sums(x, targets, weights), w))(
      jnp.asarray(logits))
  p = np.exp(logp)
  onehot = np.eye(11)[targets]
  want = (p - onehot + 2 * w * lse[..., None] * p) * weights[..., None]
  np.testing.assert_allclose(grad, want, atol=1e-5)


def test_the_loss_gradient_is_a_select_not_a_scatter():
  """The target's logit is selected by an iota, so d/dlogits has no scatter
  into [B, T, V] (issue 66: the scatter was a 13 GB kernel of GPT-2 small's step)."""
  logits, targets = jnp.zeros((2, 3, 11)), jnp.array([[1, 2, 3], [4, 5, 10]])
  grad = jax.make_jaxpr(jax.grad(lambda x: loss_sums(x, targets, jnp.ones((2, 3)))[0]))(logits)
  assert "scatter" not in str(grad) and "gather" not in str(grad)


def test_z_loss_is_its_own_training_metric():
  """train.z_loss: the step reports z_loss = w x mean log^2 Z of the model's
  logits, and `loss` stays the cross-entropy."""
  from training.optim import learning_rate_schedule, make_optimizer  # pylint: disable=import-outside-toplevel
  from training.steps import init_state, jit_train_step  # pylint: disable=import-outside-toplevel
  config = base.get_config()
  config.model = small_cfg()
  config.train.update(z_loss=1e-3, warmup_steps=1)
  model = build_model(config.model, nnx.Rngs(0))
  rng = np.random.RandomState(1)
  tokens = rng.randint(1, 64, (2, 9))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.broadcast_to(np.arange(8), (2, 8)),
           "loss_mask": np.ones((2, 8), np.float32)}
  logits = np.asarray(model(jnp.asarray(batch["inputs"])), np.float64)
  logp, lse = _log_softmax(logits)
  ce = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
  graphdef, params = nnx.split(model)
  tx = make_optimizer(config.train)
  step = jit_train_step(graphdef, tx, learning_rate_schedule(config.train), "next_token", 1,
                        z_loss=1e-3)
  _, metrics = step(init_state(params, tx, 0), batch)
  np.testing.assert_allclose(metrics["z_loss"], 1e-3 * (lse ** 2).mean(), rtol=1e-4)
  np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-4)


def _rms(x, scale, eps):
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def _rope(x_BTHD, inv_freq):
  pos = np.arange(x_BTHD.shape[1])[:, None] * inv_freq[None]
  cos, sin = np.cos(pos)[None, :, None], np.sin(pos)[None, :, None]
  x1, x2 = np.split(x_BTHD, 2, axis=-1)
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _numpy_attention(attn, cfg, x_BTM, *, qk_norm, softcap):
  """Causal self-attention of `attn`'s weights, written out in float32 numpy:
  projections, RMSNorm per head over d_k, RoPE, scores, cap, softmax."""
  w = {name: np.asarray(getattr(attn, name).kernel[...]) for name in
       ("q_proj", "k_proj", "v_proj", "o_proj")}
  q = np.einsum("btm,mhd->bthd", x_BTM, w["q_proj"])
  k = np.einsum("btm,mhd->bthd", x_BTM, w["k_proj"])
  v = np.einsum("btm,mhd->bthd", x_BTM, w["v_proj"])
  if qk_norm:
    q = _rms(q, np.asarray(attn.q_norm.scale[...]), cfg.norm_eps)
    k = _rms(k, np.asarray(attn.k_norm.scale[...]), cfg.norm_eps)
  inv_freq = np.asarray(rope_from_config(cfg)[0], np.float32)
  q, k = _rope(q, inv_freq), _rope(k, inv_freq)
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
  if softcap is not None:
    s = softcap * np.tanh(s / softcap)
  T = s.shape[-1]
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhts,bshd->bthd", p, v)
  return np.einsum("bthd,hdm->btm", out, w["o_proj"])


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("qk_norm,softcap", [(True, None), (False, 1.0), (True, 2.0)])
def test_attention_layer_matches_numpy(impl, qk_norm, softcap):
  """QK-norm before RoPE (learned scales drawn at random) and the attention
  soft-cap, GQA, against the numpy reference; a cap of 1 or 2 is active on
  these scores (without it the output differs)."""
  cfg = ModelConfig.resolve(small_cfg(num_kv_heads=2, qk_norm=qk_norm, attn_softcap=softcap,
                                      attention_impl=impl, init_std=0.3))
  attn = Attention(cfg, rope=rope_from_config(cfg), rngs=nnx.Rngs(0))
  if qk_norm:
    for norm in (attn.q_norm, attn.k_norm):
      norm.scale[...] = jax.random.uniform(jax.random.key(3), norm.scale.shape, minval=0.5,
                                           maxval=2.0)
  x = np.random.RandomState(0).randn(2, 7, cfg.d_model).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  got = np.asarray(attn(jnp.asarray(x), positions_BT=positions, causal=True))
  want = _numpy_attention(attn, cfg, x, qk_norm=qk_norm, softcap=softcap)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  other = _numpy_attention(attn, cfg, x, qk_norm=qk_norm, softcap=None if softcap else 1.0)
  assert np.abs(other - want).max() > 1e-3


def test_final_softcap_matches_numpy():
  """Logits c tanh(x / c) of the uncapped model's logits (same weights)."""
  capped = build_model(small_cfg(final_softcap=3.0), nnx.Rngs(0))
  plain = build_model(small_cfg(), nnx.Rngs(0))
  tokens = jnp.asarray([[1, 5, 9, 2, 7]])
  x = np.asarray(plain(tokens), np.float64)
  np.testing.assert_allclose(capped(tokens), 3.0 * np.tanh(x / 3.0), atol=1e-5)
  assert np.abs(x).max() > 3.0 or np.abs(3.0 * np.tanh(x / 3.0) - x).max() > 1e-3


def test_kv_cache_decoding_takes_every_knob():
  """Greedy KV-cache generation equals the argmax of the full forward with
  QK-norm and both soft-caps."""
  cfg = small_cfg(qk_norm=True, attn_softcap=1.5, final_softcap=2.0, num_kv_heads=2)
  model = build_model(cfg, nnx.Rngs(2))
  prompt = [3, 1, 4, 1, 5]
  new = generate(model, cfg, [prompt], max_new_tokens=3)[0]
  seq = list(prompt)
  for _ in range(3):
    seq.append(int(jnp.argmax(model(jnp.array([seq]))[0, -1])))
  assert new == seq[len(prompt):]


def _inputs(B, T, H, K, D, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  return tuple(x.astype(dtype) for x in (
      jax.random.normal(keys[0], (B, T, H, D)) * 2, jax.random.normal(keys[1], (B, T, K, D)),
      jax.random.normal(keys[2], (B, T, K, D)), jax.random.normal(keys[3], (B, T, H, D))))


# lowering, causal, segment ids, T, D, dtype, tolerance (tests/test_flash_attention.py's).
PALLAS_CASES = [("triton", True, False, 40, 16, jnp.float32, 1e-5),
                pytest.param("triton", False, True, 40, 16, jnp.float32, 1e-5,
                             marks=pytest.mark.slow),
                ("mosaic_tpu", True, True, 40, 16, jnp.float32, 1e-5),
                pytest.param("mosaic_gpu", True, True, 72, 64, jnp.bfloat16, 3e-2,
                             marks=pytest.mark.slow)]


@pytest.mark.parametrize("lowering,causal,segments,T,D,dtype,tolerance", PALLAS_CASES)
def test_pallas_softcap_matches_reference(lowering, causal, segments, T, D, dtype, tolerance):
  """Forward and the three gradients of each kernel's soft-cap in its
  interpreter, several tiles (16 for Triton; Mosaic GPU's 64-row tiles over
  72 positions), GQA; the oracle in float32 on the same inputs."""
  q, k, v, do = _inputs(1, T, 4, 2, D, dtype)
  seg = jnp.asarray([[1] * (T - 15) + [2] * 12 + [0] * 3]) if segments else None
  blocks = dict(block_q=16, block_k=16) if lowering == "triton" else {}

  def kernel(q, k, v):
    return flash_attention(q, k, v, causal=causal, softcap=2.0, q_segment_ids=seg,
                           kv_segment_ids=seg, lowering=lowering, **blocks)

  def oracle(q, k, v, cap=2.0):
    return attention(q, k, v, causal=causal, softcap=cap, implementation="reference",
                     segment_ids=None if seg is None else (seg, seg))

  out, vjp = jax.vjp(kernel, q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  with jax.default_matmul_precision("highest"):
    want, want_vjp = jax.vjp(oracle, *f32[:3])
    grads, want_grads = vjp(do), want_vjp(f32[3])
  for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1.0)
    assert err < tolerance, f"{name}: {err:.2e}"
  uncapped = oracle(*f32[:3], cap=None)
  assert np.abs(np.asarray(uncapped) - np.asarray(want)).max() > 1e-2


def test_cudnn_refuses_a_softcap_in_one_line():
  with pytest.raises(UserError, match=r"^config field model.attn_softcap=50.0: "
                                      r"attention_impl=cudnn takes no soft-cap"):
    ModelConfig.resolve(small_cfg(attention_impl="cudnn", attn_softcap=50.0))
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(UserError, match="attention_impl=cudnn takes no soft-cap"):
    attention(q, q, q, softcap=50.0, implementation="cudnn")


def test_auto_does_not_pick_cudnn_for_a_softcap():
  gpu = dict(backend="gpu", dtype=jnp.bfloat16, head_dim=64)
  assert auto_implementation(**gpu, features=("score:softmax",)) == "cudnn"
  assert auto_implementation(**gpu, features=("softcap", "score:softmax")) == "xla"
  cfg = ModelConfig.resolve(small_cfg(attention_impl="pallas", pallas_lowering="mosaic_gpu",
                                      dtype="bfloat16", head_dim=64, attn_softcap=50.0))
  assert cfg.attn_softcap == 50.0


def test_auto_picks_our_kernel_on_a_hopper_for_segment_ids():
  """On an H200 our Mosaic GPU kernel beat cuDNN's dense segment mask
  (model/attention.py, auto_implementation's table); without segment ids,
  on other GPUs, or where the kernel does not take the inputs, cuDNN or XLA."""
  h200 = dict(backend="gpu", dtype=jnp.bfloat16, head_dim=64, device_kind="NVIDIA H200")
  plain = ("score:softmax",)
  assert auto_implementation(**h200, features=plain, segments=True) == "pallas"
  assert auto_implementation(**h200, features=("window",) + plain, segments=True) == "pallas"
  assert auto_implementation(**h200, features=plain) == "cudnn"
  assert auto_implementation(**dict(h200, device_kind="NVIDIA A100-SXM4-80GB"),
                             features=plain, segments=True) == "cudnn"
  assert auto_implementation(**dict(h200, head_dim=96), features=plain, segments=True) == "cudnn"
  assert auto_implementation(**dict(h200, dtype=jnp.float32), features=plain,
                             segments=True) == "xla"
  assert auto_implementation(**h200, features=("bias",) + plain, segments=True) == "xla"


def test_auto_picks_our_kernel_on_a_tpu_where_it_takes_the_inputs():
  """Memory decides on TPUs (model/attention.py, auto_implementation): our
  kernel, soft-cap and sliding window included, but XLA for a dense mask or
  bias."""
  tpu = dict(backend="tpu", dtype=jnp.bfloat16, head_dim=128)
  plain, capped = ("score:softmax",), ("softcap", "score:softmax")
  assert auto_implementation(**tpu, features=plain) == "pallas"
  assert auto_implementation(**tpu, features=capped) == "pallas"
  assert auto_implementation(**tpu, features=("mask",) + plain) == "xla"
  assert auto_implementation(**tpu, features=("bias",) + plain) == "xla"
  assert auto_implementation(**tpu, features=("window",) + plain) == "pallas"


def test_auto_picks_our_einsums_on_a_cpu():
  """On a CPU `reference` runs faster than `xla` (docs/benchmarks.md), with
  every feature."""
  cpu = dict(backend="cpu", dtype=jnp.float32, head_dim=32)
  for features in (("score:softmax",), ("mask", "score:softmax"), ("softcap", "score:sigmoid")):
    assert auto_implementation(**cpu, features=features) == "reference"


@pytest.mark.parametrize("field,value,message", [
    ("model.attn_softcap", 0.0, "model.attn_softcap=0.0: must be positive"),
    ("model.final_softcap", -1.0, "model.final_softcap=-1.0: must be positive"),
    ("train.z_loss", -1e-4, "train.z_loss=-0.0001: must be >= 0"),
])
def test_bad_values_are_one_line_errors(field, value, message):
  config = base.get_config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(UserError, match=message):
    validate(config)
