"""train.loss_chunk_size (training/objectives.py `chunked_loss_sums`): the
head and the loss over chunks of tokens give the unchunked sums and
gradients to float32 rounding for every objective with an LM head and every
head feature, chunk sizes that do not divide the tokens included; the train
and eval steps pass it on, on one device and on meshes of 8; the compiled
train step holds no float32 logits of the whole batch; the memory estimate
counts one chunk's logits; the config field is checked."""

import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base, gpt2_small, validation
from configs.errors import UserError
from model import accounting, build_model
from tests.helpers import json_on_cpu_devices, small_cfg
from training.objectives import (batch_loss, mtp_training_sum, mtp_weights, next_token_mtp_loss,
                                 training_loss_sum)
from training.steps import init_state, jit_eval_step, jit_train_step

B, T, V = 4, 16, 72
Z_LOSS = 1e-2
# Tokens per chunk: 12 (3 positions a row, 16 = 5 x 3 + 1: the last chunk
# padded), and in `test_chunk_sizes` also 1 (fewer than the rows: one
# position of each row) and 1000 (more than the batch: one chunk).
CHUNK = 12
CHUNKS = (1, CHUNK, 1000)

# Each head feature in at least one model: tied and untied projection, head
# transform, scale_head_input, μP's logit multiplier, output bias, soft-cap,
# padded vocabulary rows.
DECODERS = {
    "tied_bias_softcap_padded": dict(output_bias=True, final_softcap=2.0, real_vocab_size=70),
    "untied_transform_scaled": dict(tie_embeddings=False, head_transform=True,
                                    scale_head_input=True),
    "mup": dict(parametrization="mup", mup_base_width=16, mup_output_mult=3.0),
}


def model_cfg(**overrides):
  return small_cfg(vocab_size=V, num_layers=1, max_len=T, **overrides)


def perturbed(model, seed: int = 1):
  """`model` with every parameter moved by noise, so that zero-initialised
  ones (the output bias) take part in the logits."""
  graphdef, params = nnx.split(model)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


def lm_batch(seed: int = 0) -> dict:
  """Two documents per row, rows with 16, 14, 12, 10 targets."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 70, (B, T + 1)).astype(np.int32)
  segment_ids = np.where(np.arange(T) < T // 2, 1, 2).astype(np.int32)[None].repeat(B, 0)
  positions = (np.arange(T) % (T // 2)).astype(np.int32)[None].repeat(B, 0)
  loss_mask = (np.arange(T)[None] < (T - 2 * np.arange(B))[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": loss_mask,
          "segment_ids": segment_ids, "positions": positions}


def encoder_decoder_batch() -> dict:
  rng = np.random.default_rng(2)
  tgt = rng.integers(1, 70, (B, T + 1)).astype(np.int32)
  src_mask = (np.arange(T)[None] < (T - 3 * np.arange(B))[:, None]).astype(np.int32)
  return {"src": rng.integers(1, 70, (B, T)).astype(np.int32) * src_mask, "src_mask": src_mask,
          "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:],
          "loss_mask": (np.arange(T)[None] < (T - np.arange(B))[:, None]).astype(np.float32)}


def with_predicted_targets(batch, logits_BTV, key: str) -> dict:
  """`batch` with every other target the model's own argmax, so that the
  accuracy counts are not 0."""
  targets = np.array(batch[key])
  targets[:, ::2] = np.asarray(logits_BTV.argmax(-1))[:, ::2]
  return dict(batch, **{key: targets})


def sums_and_grads(objective, model, batch, chunk_size):
  """(the objective's sums, the gradient of its training loss with the z-loss)."""
  graphdef, params = nnx.split(model)

  def loss(p):
    sums = batch_loss(objective, nnx.merge(graphdef, p), batch, chunk_size)
    return training_loss_sum(sums, Z_LOSS), sums

  return jax.jit(jax.grad(loss, has_aux=True))(params)[::-1]


def assert_close(chunked, whole):
  """Sums and gradients equal to float32 rounding; counts exactly."""
  for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def check_objective(objective, model, batch, chunk_sizes=(CHUNK,)):
  whole_sums, whole_grads = sums_and_grads(objective, model, batch, 0)
  assert float(whole_sums[2]) > 0  # some correct predictions to count
  for chunk_size in chunk_sizes:
    sums, grads = sums_and_grads(objective, model, batch, chunk_size)
    assert float(sums[1]) == float(whole_sums[1])
    assert float(sums[2]) == float(whole_sums[2])
    assert_close((sums, grads), (whole_sums, whole_grads))


@pytest.mark.parametrize("name", DECODERS)
def test_next_token_loss_and_gradients_equal_the_unchunked(name):
  """Every head feature."""
  model = perturbed(build_model(model_cfg(**DECODERS[name]), nnx.Rngs(0)))
  batch = lm_batch()
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("next_token", model, with_predicted_targets(batch, logits, "targets"))


def test_chunk_sizes():
  """Chunks of one position per row, several with the last padded, one."""
  model = perturbed(build_model(model_cfg(**DECODERS["tied_bias_softcap_padded"]), nnx.Rngs(0)))
  batch = lm_batch()
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("next_token", model, with_predicted_targets(batch, logits, "targets"), CHUNKS)


def test_prefix_lm_loss_and_gradients_equal_the_unchunked():
  """seq2seq with a decoder: the loss on the target tokens only."""
  model = perturbed(build_model(model_cfg(**DECODERS["tied_bias_softcap_padded"]), nnx.Rngs(0)))
  batch = lm_batch()
  batch["loss_mask"][:, :T // 2] = 0
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("seq2seq", model, with_predicted_targets(batch, logits, "targets"))


def test_masked_lm_loss_and_gradients_equal_the_unchunked():
  model = perturbed(build_model(model_cfg(family="encoder", head_transform=True,
                                          output_bias=True), nnx.Rngs(0)))
  batch = lm_batch()
  logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  check_objective("mlm", model, with_predicted_targets(batch, logits, "targets"))


def test_encoder_decoder_loss_and_gradients_equal_the_unchunked():
  model = perturbed(build_model(model_cfg(family="encoder_decoder", tie_embeddings=False,
                                          scale_head_input=True, real_vocab_size=70),
                                nnx.Rngs(0)))
  batch = encoder_decoder_batch()
  logits = model(batch["src"], batch["tgt_in"], src_padding_mask=batch["src_mask"] > 0)
  check_objective("seq2seq", model, with_predicted_targets(batch, logits, "tgt_out"))


def mtp_grad(depth: int = 2, weight: float = 0.3, **model):
  """The jitted gradient of the multi-token prediction training loss of a
  small decoder with `depth` MTP modules (and `model`'s fields) on
  `lm_batch()`, every other target its argmax: (chunk_size, impl) ->
  (gradients, (sums, each depth's sums))."""
  model = perturbed(build_model(model_cfg(pos_emb="rope", **model), nnx.Rngs(0),
                                mtp_depth=depth))
  batch = lm_batch()
  hidden = model.hidden(batch["inputs"], segment_ids=batch["segment_ids"],
                        positions=batch["positions"])
  batch = with_predicted_targets(batch, model.logits(model.decoder, hidden), "targets")
  counts = [w.sum() for w in mtp_weights(batch, depth)]
  graphdef, params = nnx.split(model)

  def loss(p, head):
    sums, depth_sums = next_token_mtp_loss(nnx.merge(graphdef, p), batch, *head)
    total = training_loss_sum(sums, Z_LOSS) + mtp_training_sum(depth_sums, weight, sums[1],
                                                               counts)
    return total, (sums, depth_sums)

  return functools.partial(jax.jit(jax.grad(loss, has_aux=True), static_argnums=1), params)


def test_multi_token_prediction_loss_and_gradients_equal_the_unchunked():
  """The main head and every MTP depth's head chunked alike."""
  grad = mtp_grad(output_bias=True)
  whole_grads, whole_sums = grad((0, "xla"))
  grads, sums = grad((CHUNK, "xla"))
  assert [float(s[1]) for s in sums[1]] == [float(s[1]) for s in whole_sums[1]]
  assert_close((sums, grads), (whole_sums, whole_grads))


def sgd_train_and_eval(chunk_size, accum_steps=2):
  """(metrics, new parameters, eval sums) of one SGD train step and one eval
  step of a small decoder on `lm_batch()`."""
  model = perturbed(build_model(model_cfg(real_vocab_size=70), nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  tx = optax.sgd(1.0)
  batch = lm_batch()
  evals = jit_eval_step(graphdef, "next_token", loss_chunk_size=chunk_size)(params, batch)
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", accum_steps,
                        z_loss=Z_LOSS, loss_chunk_size=chunk_size)
  state, metrics = step(init_state(params, tx, 0), batch)
  return jax.device_get(metrics), jax.device_get(state["params"]), jax.device_get(evals)


def test_the_train_and_eval_steps_pass_the_chunk_size_on():
  """Micro-batches included: the step's metrics and update equal the unchunked."""
  whole = sgd_train_and_eval(0)
  chunked = sgd_train_and_eval(12)
  assert chunked[0]["targets"] == whole[0]["targets"]
  assert_close(chunked, whole)


# One SGD step of each of VARIANTS (train-step keyword arguments) of a small
# decoder (with MODEL's fields) on meshes of 8 CPU devices, the rows split
# over data x fsdp, and over context too in the second mesh; the steps must agree.
ON_8_DEVICES = """
import json
import jax, numpy as np, optax
from flax import nnx
from configs import base
from model import build_model
from tests.helpers import small_cfg
from tests.test_loss_chunks import lm_batch
from training.sharding import batch_sharding, make_mesh, train_state_shardings
from training.steps import init_state, jit_train_step

checked = []
for data, fsdp, context, tensor in ((2, 2, 1, 2), (2, 2, 2, 1)):
  c = base.get_config()
  c.model = small_cfg(vocab_size=72, num_layers=1, max_len=16, real_vocab_size=70,
                      attention_impl="xla", **MODEL)
  c.mesh.update(data=data, fsdp=fsdp, context=context, tensor=tensor)
  mesh = make_mesh(c.mesh, jax.devices())
  out = []
  for variant in VARIANTS:
    graphdef, params = nnx.split(build_model(c.model, nnx.Rngs(0)))
    tx = optax.sgd(1.0)
    state = init_state(params, tx, 0)
    shardings = train_state_shardings(jax.eval_shape(lambda: state), mesh, c.mesh.rules)
    step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", 1,
                          state_sharding=shardings, batch_sharding=batch_sharding(mesh),
                          z_loss=1e-2, **variant)
    new, metrics = step(jax.device_put(state, shardings),
                        jax.device_put(lm_batch(), batch_sharding(mesh)))
    out.append(jax.device_get((metrics, new["params"])))
  for a, b in zip(*map(jax.tree.leaves, out)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
  checked.append(dict(mesh.shape))
print(json.dumps(checked))
"""


def check_on_8_devices(variants: list[dict], **model) -> None:
  """Runs `ON_8_DEVICES` with these variants and model fields."""
  script = ON_8_DEVICES.replace("VARIANTS", repr(variants)).replace("MODEL", repr(model))
  checked = json_on_cpu_devices(script, 8)
  assert [(m["fsdp"], m["context"], m["tensor"]) for m in checked] == [(2, 1, 2), (2, 2, 1)]


@pytest.mark.slow
def test_the_chunked_step_on_8_devices_equals_the_unchunked():
  """The chunked head's weights are gathered whole before its loop
  (objectives._whole_on_every_device)."""
  check_on_8_devices([dict(loss_chunk_size=0), dict(loss_chunk_size=12)], output_bias=True)


def f32_logit_shapes(text: str) -> list[str]:
  """The float32 shapes of the whole batch's logits, [B*T, V] or [B, T, V],
  in optimized HLO text."""
  return re.findall(rf"f32\[(?:{B * T},{V}|{B},{T},{V})\]", text)


def compiled_train_step(chunk_size) -> str:
  model = build_model(model_cfg(), nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx = optax.sgd(1.0)
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", 1,
                        z_loss=Z_LOSS, loss_chunk_size=chunk_size)
  return step.lower(init_state(params, tx, 0), lm_batch()).compile().as_text()


def test_the_chunked_train_step_has_no_float32_logits_of_the_whole_batch():
  assert f32_logit_shapes(compiled_train_step(0))
  chunked = compiled_train_step(12)
  assert not f32_logit_shapes(chunked)
  assert re.search(rf"f32\[(?:{B * 3},{V}|{B},3,{V})\]", chunked)  # a chunk's logits


def test_the_memory_estimate_counts_the_logits_of_one_chunk():
  """GPT-2 small at 32 x 1024 tokens, with 2 MTP depths: the float32 logits of
  3 heads x 32,768 tokens become those of one chunk of 4,096."""
  config = gpt2_small.get_config()
  config.train.mtp_depth = 2
  whole = accounting.training_memory_bytes(config)
  config.train.loss_chunk_size = 4096
  chunked = accounting.training_memory_bytes(config)
  assert whole["activations"] - chunked["activations"] == (3 * 32768 - 4096) * 4 * 50304
  assert {k: v for k, v in chunked.items() if k not in ("activations", "total")} == {
      k: v for k, v in whole.items() if k not in ("activations", "total")}


def test_loss_chunk_size_must_be_a_non_negative_integer():
  config = base.get_config()
  validation.validate(config)  # 0, the default
  config.train.loss_chunk_size = 4096
  validation.validate(config)
  config.train.loss_chunk_size = -1
  with pytest.raises(UserError, match=r"train.loss_chunk_size=-1: must be a positive integer "
                                      r"or 0$"):
    validation.validate(config)
