"""train.loss_impl=pallas (model/kernels/fused_loss.py, in the Pallas
interpreter, float32): the fused head-and-loss kernel (both lowerings) gives
the XLA head's per-token log Z, target logit and 'correct', and their
gradients in h and W, to float32 rounding (padded vocabulary rows, a logit
multiplier, ragged tiles, targets outside the vocabulary); every objective
with an LM head and the train and eval steps equal the xla loss; the config
refuses what the kernel does not take; the roofline counts its FLOPs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from aot import roofline
from configs import base, gpt2_small, validation
from configs.errors import UserError
from model import accounting, build_model
from model.kernels import fused_loss, fuses_loss
from tests.test_loss_chunks import (Z_LOSS, assert_close, check_on_8_devices,
                                    encoder_decoder_batch, lm_batch, model_cfg, mtp_grad,
                                    perturbed, with_predicted_targets)
from training.objectives import batch_loss, training_loss_sum
from training.steps import init_state, jit_eval_step, jit_train_step

# Tiles of 16 over N = 50 tokens, V = 70 rows, M = 40: ragged in all three
# (the hidden width in three chunks), several tiles of each.
SMALL = fused_loss.Blocks(block_n=16, block_v=16, block_v_dw=32, block_n_dw=32, block_m=16,
                          num_warps=4, num_stages=1)
N, V, M, REAL = 50, 70, 40, 66
# The Mosaic TPU lowering's: the hidden width whole (padded to the 128 lanes).
SMALL_TPU = fused_loss.Blocks(block_n=16, block_v=32, block_v_dw=32, block_n_dw=16, block_m=128,
                              num_warps=4, num_stages=1)


def reference(h_NM, w_VM, targets_N, mult):
  """The XLA head's per-token (lse, target logit, correct), as
  `training.objectives._loss_sums` computes them from `model.logits`."""
  s_NV = jnp.where(jnp.arange(V) < REAL, (h_NM @ w_VM.T) * mult, -1e9)
  max_N = jax.lax.stop_gradient(s_NV.max(-1))
  lse_N = max_N + jnp.log(jnp.exp(s_NV - max_N[:, None]).sum(-1))
  target_N = jnp.where(jnp.arange(V)[None] == targets_N[:, None], s_NV, 0.0).sum(-1)
  return lse_N, target_N, (target_N >= max_N).astype(jnp.float32)


@pytest.mark.parametrize("lowering, blocks", [("triton", SMALL), ("mosaic_tpu", SMALL_TPU)])
def test_kernel_equals_the_xla_head_with_gradients(lowering, blocks):
  """Both lowerings: padded rows, a multiplier, z-loss, weights with zeros,
  a target in the padded rows and one outside the vocabulary (-100, masked
  LM's ignore id)."""
  keys = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(keys[0], (N, M))
  w = 0.3 * jax.random.normal(keys[1], (V, M))
  targets = jax.random.randint(keys[2], (N,), 0, REAL).at[3].set(REAL + 1).at[7].set(-100)
  weights = (jax.random.uniform(keys[3], (N,)) > 0.3).astype(jnp.float32)
  kernel = lambda h, w: fused_loss.fused_head_loss(h, w, targets, mult=0.7, real_vocab=REAL,
                                                   blocks=blocks, lowering=lowering,
                                                   interpret=True)
  xla = lambda h, w: reference(h, w, targets, 0.7)

  def loss(head):
    def f(h, w):
      lse, target, correct = head(h, w)
      return ((lse - target) * weights).sum() + Z_LOSS * (lse ** 2 * weights).sum(), correct
    return jax.grad(f, argnums=(0, 1), has_aux=True)

  got, want = jax.jit(kernel)(h, w), xla(h, w)
  assert float(want[2].sum()) > 0  # some targets are the argmax
  np.testing.assert_array_equal(got[2], want[2])
  assert_close((got[:2], jax.jit(loss(kernel))(h, w)), (want[:2], loss(xla)(h, w)))


def sums_and_grads(objective, model, batch, impl):
  graphdef, params = nnx.split(model)

  def loss(p):
    sums = batch_loss(objective, nnx.merge(graphdef, p), batch, impl=impl)
    return training_loss_sum(sums, Z_LOSS), sums

  return jax.jit(jax.grad(loss, has_aux=True))(params)[::-1]


def check_objective(objective, model, batch):
  want = sums_and_grads(objective, model, batch, "xla")
  got = sums_and_grads(objective, model, batch, "pallas")
  assert float(want[0][2]) > 0
  assert [float(x) for x in got[0][1:3]] == [float(x) for x in want[0][1:3]]
  assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("head", [
    dict(real_vocab_size=70),
    dict(tie_embeddings=False, head_transform=True, scale_head_input=True),
    dict(parametrization="mup", mup_base_width=16, mup_output_mult=3.0)])
def test_next_token_equals_the_xla_loss(head):
  """Tied and untied projections, head transform, input scale, μP's
  multiplier, padded vocabulary rows; masked targets."""
  model = perturbed(build_model(model_cfg(**head), nnx.Rngs(0)))
  batch = lm_batch()
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("next_token", model, with_predicted_targets(batch, logits, "targets"))


@pytest.mark.slow
def test_masked_lm_and_encoder_decoder_equal_the_xla_loss():
  model = perturbed(build_model(model_cfg(family="encoder", head_transform=True), nnx.Rngs(0)))
  batch = lm_batch()
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("mlm", model, with_predicted_targets(batch, logits, "targets"))
  model = perturbed(build_model(model_cfg(family="encoder_decoder", tie_embeddings=False,
                                          real_vocab_size=70), nnx.Rngs(0)))
  batch = encoder_decoder_batch()
  logits = model(batch["src"], batch["tgt_in"], src_padding_mask=batch["src_mask"] > 0)
  check_objective("seq2seq", model, with_predicted_targets(batch, logits, "tgt_out"))


@pytest.mark.slow
def test_multi_token_prediction_equals_the_xla_loss():
  """The main head and every MTP depth's head fused alike."""
  grad = mtp_grad()
  assert_close(grad((0, "pallas")), grad((0, "xla")))


def sgd_train_and_eval(impl):
  model = perturbed(build_model(model_cfg(real_vocab_size=70), nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  tx = optax.sgd(1.0)
  batch = lm_batch()
  evals = jit_eval_step(graphdef, "next_token", loss_impl=impl)(params, batch)
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", 2,
                        z_loss=Z_LOSS, loss_impl=impl)
  state, metrics = step(init_state(params, tx, 0), batch)
  return jax.device_get(metrics), jax.device_get(state["params"]), jax.device_get(evals)


def test_the_train_and_eval_steps_equal_the_xla_loss():
  """Two micro-batches, SGD: metrics, updated parameters and eval sums."""
  got, want = sgd_train_and_eval("pallas"), sgd_train_and_eval("xla")
  assert got[0]["targets"] == want[0]["targets"]
  assert_close(got, want)


@pytest.mark.parametrize("overrides, field", [
    (dict(model=dict(final_softcap=30.0)), "train.loss_impl"),
    (dict(model=dict(output_bias=True)), "train.loss_impl"),
    (dict(train=dict(loss_chunk_size=4096)), "train.loss_chunk_size"),
    (dict(train=dict(loss_impl="fused")), "train.loss_impl")])
def test_the_config_refuses_what_the_kernel_does_not_take(overrides, field):
  config = base.get_config()
  config.train.loss_impl = "pallas"
  for section, values in overrides.items():
    config[section].update(values)
  with pytest.raises(UserError, match=field):
    validation.validate(config)


def test_auto_fuses_only_compiled_for_a_gpu_a_head_the_kernel_takes():
  """On this CPU auto is the xla loss; the kernel takes neither a soft-cap nor a bias."""
  model = build_model(model_cfg(), nnx.Rngs(0))
  assert model.head_fuses and not fuses_loss("auto", "cpu", head_fuses=True, chunk_size=0)
  assert fuses_loss("auto", "gpu", head_fuses=True, chunk_size=0)
  assert not fuses_loss("auto", "gpu", head_fuses=True, chunk_size=4096)
  for head in (dict(final_softcap=30.0), dict(output_bias=True)):
    assert not build_model(model_cfg(**head), nnx.Rngs(0)).head_fuses


def test_the_roofline_counts_the_kernels_flops():
  """Forward 2 N V M (4 differentiated), dW 4 N V M: 8 N V M a step (N V M = 120)."""
  shapes = [("fused_loss_forward", True), ("fused_loss_dw", False)]
  assert sum(fused_loss.kernel_flops(k, 8, 5, 3, with_pw=p) for k, p in shapes) == 8 * 120
  assert fused_loss.kernel_flops("fused_loss_forward", 8, 5, 3, with_pw=False) == 2 * 120


@pytest.mark.slow
def test_the_fused_step_on_8_devices_equals_the_xla_step():
  """The kernel under shard_map, the tied embedding whole on each device."""
  check_on_8_devices([dict(loss_impl="xla"), dict(loss_impl="pallas")])


@pytest.mark.cuda
def test_compiles_for_h200_and_the_roofline_counts_it():
  """Forward and backward through Triton and XLA for a compile-only H200
  (`bench/compile_h200.py`'s): the roofline finds both kernels once, at 4
  and 4 x N V M FLOPs (the forward with P W, then dW)."""
  from bench.compile_h200 import h200_device  # pylint: disable=import-outside-toplevel
  assert_roofline_counts_the_kernels(h200_device(), "cuda")


@pytest.mark.tpu
def test_compiles_for_v5p_and_the_roofline_counts_it():
  """The same through Mosaic for a v5p (libtpu)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
  assert_roofline_counts_the_kernels(device, "tpu")


def assert_roofline_counts_the_kernels(device, platform: str):
  """Compiles the kernels' forward and backward for `device` (abstract)."""
  tokens, vocab, width = 512, 1024, 128
  sharding = jax.sharding.SingleDeviceSharding(device)
  specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in
           (((tokens, width), jnp.float32), ((vocab, width), jnp.float32), ((tokens,), jnp.int32))]

  def grads(h, w, targets):
    def loss(h, w):
      lse, target, _ = fused_loss.fused_head_loss(h, w, targets, device=device)
      return (lse - target).sum()
    return jax.grad(loss, argnums=(0, 1))(h, w)

  with jax.default_device(device):
    lowered = jax.jit(grads).trace(*specs).lower(lowering_platforms=(platform,))
  found = [(re.search(r"fused_loss_(forward|dw)", k.op_name).group(), k.flops)
           for k in roofline.kernels(lowered.compile().as_text()) if "fused_loss" in k.op_name]
  nvm = tokens * vocab * width
  assert sorted(found) == [("fused_loss_dw", 4.0 * nvm), ("fused_loss_forward", 4.0 * nvm)]
