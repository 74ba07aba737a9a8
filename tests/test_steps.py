"""The train step's claims: remat and gradient accumulation change the cost, not the result.

Each step runs with plain SGD at learning rate 1, so that the change of the
parameters is exactly minus the gradient the step computed.
"""
import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base, gpt2_small, validation
from configs.errors import UserError
from model import build_model
from model.remat import REMAT_POLICIES, remat_policy
from training.steps import init_state, jit_eval_step, jit_train_step

B, T = 8, 16


# GPT-2's kind of layer (configs/gpt2_small.py), two of them scanned.
GPT2_LAYERS = dict(num_layers=2, scan_layers=True, pos_emb="learned", norm="layernorm",
                   mlp="gelu_tanh", use_bias=True, tie_embeddings=True)


def model_config(**overrides):
  m = base.get_config().model
  m.update(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=64,
           max_len=T, pos_emb="rope", attention_impl="xla")
  m.update(**overrides)
  return m


def next_token_batch() -> dict:
  """Two documents per row; rows hold 16, 12, ... 2 targets (micro-batches differ)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 64, (B, T + 1)).astype(np.int32)
  segment_ids = np.where(np.arange(T) < T // 2, 1, 2).astype(np.int32)[None].repeat(B, 0)
  positions = (np.arange(T) % (T // 2)).astype(np.int32)[None].repeat(B, 0)
  loss_mask = (np.arange(T)[None] < (T - 2 * np.arange(B))[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": loss_mask,
          "segment_ids": segment_ids, "positions": positions}


@functools.cache
def sgd_step(*, remat: bool | str = False, accum_steps: int = 1, gpt2_layers: bool = False):
  """(loss, gradient, metrics) of one train step on `next_token_batch()` (computed once),
  of `model_config()`, or with `gpt2_layers` of its `GPT2_LAYERS` variant."""
  cfg = model_config(**(GPT2_LAYERS if gpt2_layers else {}))
  graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0), remat=remat))
  tx = optax.sgd(1.0)
  before = jax.device_get(params)
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", accum_steps)
  state, metrics = step(init_state(params, tx, 0), next_token_batch())
  gradient = jax.tree.map(lambda old, new: old - new, before, jax.device_get(state["params"]))
  return float(metrics["loss"]), gradient, jax.device_get(metrics)


def assert_trees_close(a, b, rtol, atol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_remat_gives_the_same_loss_and_gradients():
  loss, gradient, _ = sgd_step()
  loss_remat, gradient_remat, _ = sgd_step(remat=True)
  assert loss_remat == pytest.approx(loss, rel=1e-6)
  assert_trees_close(gradient_remat, gradient, rtol=1e-5, atol=1e-7)
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(gradient)) > 1e-3


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_each_remat_policy_gives_the_same_loss_and_gradients(policy):
  """float32: recomputing (all or part of) a block moves nothing past rounding."""
  loss, gradient, _ = sgd_step()
  loss_remat, gradient_remat, _ = sgd_step(remat=policy)
  assert loss_remat == pytest.approx(loss, rel=1e-6)
  assert_trees_close(gradient_remat, gradient, rtol=1e-5, atol=1e-7)


def test_gpt2_smalls_policy_on_its_layers_scanned_gives_the_same_loss_and_gradients():
  """configs/gpt2_small.py's train.remat on its kind of layer, two scanned, float32."""
  policy = gpt2_small.get_config().train.remat
  loss, gradient, _ = sgd_step(gpt2_layers=True)
  loss_remat, gradient_remat, _ = sgd_step(remat=policy, gpt2_layers=True)
  assert loss_remat == pytest.approx(loss, rel=1e-6)
  assert_trees_close(gradient_remat, gradient, rtol=1e-5, atol=1e-7)


def test_remat_names_and_the_bools_before_them():
  """True and False (configs and runs from before the names) are full and none;
  the registry is the config's list of choices; a bad name is one line naming them."""
  assert tuple(REMAT_POLICIES) == validation.CHOICES["train.remat"]
  assert [remat_policy(v).name for v in (True, False, "True", "false", "save_dots")] == [
      "full", "none", "full", "none", "save_dots"]
  with pytest.raises(UserError, match="^config field train.remat='dots': must be one of none, "
                     "full, save_dots, "):
    remat_policy("dots")


def test_remat_recomputes_in_the_backward_pass():
  """The remat step's program holds one checkpointed block per layer; the plain one none."""
  def checkpoints(remat):
    graphdef, params = nnx.split(build_model(model_config(), nnx.Rngs(0), remat=remat))
    tx = optax.sgd(1.0)
    step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", 1)
    program = str(jax.make_jaxpr(step)(init_state(params, tx, 0), next_token_batch()))
    return len(re.findall(r"\b(?:checkpoint|remat2?)\[", program))
  assert checkpoints(True) == model_config().num_layers
  assert checkpoints(False) == 0


@pytest.mark.parametrize("accum_steps", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gradient_accumulation_equals_the_whole_batch_step(accum_steps):
  loss, gradient, metrics = sgd_step()
  loss_accum, gradient_accum, metrics_accum = sgd_step(accum_steps=accum_steps)
  assert loss_accum == pytest.approx(loss, rel=1e-6)
  assert_trees_close(gradient_accum, gradient, rtol=1e-5, atol=1e-7)
  for key in ("targets", "accuracy", "grad_norm"):
    assert float(metrics_accum[key]) == pytest.approx(float(metrics[key]), rel=1e-5)

  # The mean of the micro-batches' mean losses is another number: the step
  # must add sums, not average averages.
  graphdef, params = nnx.split(build_model(model_config(), nnx.Rngs(0)))
  eval_step = jit_eval_step(graphdef, "next_token")
  batch = next_token_batch()
  rows = B // accum_steps
  micro_means = [float(sums[0] / sums[1]) for sums in (
      eval_step(params, {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()})
      for i in range(accum_steps))]
  assert abs(np.mean(micro_means) - loss) > 1e-4
