"""`model.moe_router=deepseek` (`model/moe.py` `route_sigmoid`): DeepSeek-V3's
group-limited sigmoid routing equals transformers' DeepseekV3TopkRouter on
the same weights (and selection bias), `model.moe_group_mask_fill` decides
where a token's best eligible biased score is negative, and a whole layer with its shared
experts equals DeepseekV3MoE; the sequence-wise balance loss
(`train.moe_seq_aux_loss`) is the paper's; mistakes are one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3MoE,
                                                                  DeepseekV3TopkRouter)

from configs import base
from configs.errors import UserError
from configs.validation import validate
from model.config import ModelConfig
from model.moe import MoE, route_sigmoid, routing


def _config(**fields):
  c = base.get_config()
  c.tokenizer.vocab_size = 64
  c.model.update(vocab_size=64, d_model=32, num_heads=4, d_ff=48, num_experts=8,
                 experts_per_token=3, moe_d_ff=24, moe_router="deepseek", **fields)
  return c


@pytest.mark.parametrize("n_group,topk_group,scale", [(1, 1, 1.0), (4, 2, 2.5), (2, 1, 1.5)])
@pytest.mark.parametrize("bias", [False, True])
def test_routing_equals_transformers(n_group, topk_group, scale, bias):
  """The chosen experts and their weights are transformers': the group
  limit (only topk_group of n_group groups, a group scored by its best two
  affinities plus bias), the bias selecting but not weighing, the k weights
  renormalised and scaled by routed_scaling_factor."""
  E, k, d, N = 8, 2 if topk_group == 1 and n_group == 4 else 3, 16, 64
  hf = DeepseekV3TopkRouter(DeepseekV3Config(
      hidden_size=d, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
      topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=scale))
  gen = np.random.default_rng(0)
  weight = gen.normal(size=(E, d)).astype(np.float32)
  x = gen.normal(size=(N, d)).astype(np.float32)
  bias_E = (gen.normal(size=E) * 0.3).astype(np.float32) if bias else None
  with torch.no_grad():
    hf.weight.copy_(torch.from_numpy(weight))
    if bias:
      hf.e_score_correction_bias.copy_(torch.from_numpy(bias_E))
    _, want_w, want_i = hf(torch.from_numpy(x))
  logits = x @ weight.T
  got_w, got_i, probs = route_sigmoid(logits, k, n_group=n_group, topk_group=topk_group,
                                      scale=scale, bias_E=bias_E)
  # transformers' topk is unsorted: compare each token's (expert, weight) pairs as sets.
  order_got, order_want = np.argsort(np.asarray(got_i)), np.argsort(want_i.numpy())
  got_i_s = np.take_along_axis(np.asarray(got_i), order_got, 1)
  want_i_s = np.take_along_axis(want_i.numpy(), order_want, 1)
  np.testing.assert_array_equal(got_i_s, want_i_s)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), order_got, 1),
                             np.take_along_axis(want_w.numpy(), order_want, 1), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got_w).sum(-1), scale, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
  if n_group > 1:  # the group limit binds: some token's chosen experts differ without it
    free_i = np.sort(np.asarray(route_sigmoid(logits, k, n_group=1, topk_group=1, scale=scale,
                                              bias_E=bias_E)[1]), axis=1)
    assert (free_i != got_i_s).any()
    groups = got_i_s // (E // n_group)
    assert all(len(set(row)) <= topk_group for row in groups)


def test_layer_routes_as_transformers():
  """The MoE layer under moe_router=deepseek routes with the config's group
  fields: its `routing` is transformers' router on the layer's weights."""
  cfg = ModelConfig.resolve(_config(moe_n_group=4, moe_topk_group=2,
                                    moe_routed_scaling_factor=2.5).model)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  x = np.array(jax.random.normal(jax.random.key(1), (10, cfg.d_model)))
  w = np.asarray(layer.router.kernel[...])
  hf = DeepseekV3TopkRouter(DeepseekV3Config(
      hidden_size=cfg.d_model, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
      topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5))
  with torch.no_grad():
    hf.weight.copy_(torch.from_numpy(w.T.copy()))
    _, want_w, want_i = hf(torch.from_numpy(x))
  got_w, got_i, _ = routing(cfg)(x @ w)
  np.testing.assert_array_equal(np.sort(np.asarray(got_i), 1), np.sort(want_i.numpy(), 1))
  np.testing.assert_allclose(np.sort(np.asarray(got_w), 1), np.sort(want_w.numpy(), 1),
                             rtol=1e-5)


def _reference_choice(scores_NE, bias_E, n_group, topk_group, k, fill):
  """DeepSeek's rule written out token by token (inference/model.py's Gate):
  groups scored by their two best biased scores, the other groups' biased
  scores replaced by `fill`, the top k of the result (ties to the lower
  expert, as a stable sort orders them), weighed by their scores."""
  N, E = scores_NE.shape
  choice_NE = scores_NE + bias_E
  experts, weights = [], []
  for n in range(N):
    groups = choice_NE[n].reshape(n_group, E // n_group)
    group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
    best = set(np.argsort(-group_score, kind="stable")[:topk_group])
    masked = np.array([c if e // (E // n_group) in best else fill
                       for e, c in enumerate(choice_NE[n])], np.float32)
    chosen = np.argsort(-masked, kind="stable")[:k]
    experts.append(np.sort(chosen))
    weights.append(scores_NE[n, np.sort(chosen)] / scores_NE[n, chosen].sum())
  return np.array(experts), np.array(weights)


def test_group_mask_fill_decides_when_the_best_eligible_score_is_negative():
  """Selection biases of -2 make every biased score negative: "-inf" keeps
  the top k in the eligible groups (DeepSeek's rule, and transformers'
  DeepseekV3TopkRouter), "0" takes the masked groups' experts, scored 0,
  over them (the older fill's rule); every token's choice differs."""
  E, k, d, N, n_group, topk_group = 8, 3, 16, 32, 4, 2
  gen = np.random.default_rng(1)
  weight = gen.normal(size=(E, d)).astype(np.float32)
  x = gen.normal(size=(N, d)).astype(np.float32)
  bias_E = (gen.normal(size=E) * 0.3 - 2.0).astype(np.float32)
  logits = x @ weight.T
  scores = 1 / (1 + np.exp(-logits))
  assert (scores + bias_E).max() < 0
  got = {}
  for fill, fill_value in (("-inf", -np.inf), ("0", 0.0)):
    cfg = ModelConfig.resolve(_config(moe_n_group=n_group, moe_topk_group=topk_group,
                                      moe_group_mask_fill=fill).model)
    w, i, _ = routing(cfg)(jnp.asarray(logits), bias_E=jnp.asarray(bias_E))
    order = np.argsort(np.asarray(i), axis=1)
    got[fill] = np.take_along_axis(np.asarray(i), order, 1)
    want_i, want_w = _reference_choice(scores, bias_E, n_group, topk_group, k, fill_value)
    np.testing.assert_array_equal(got[fill], want_i)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1), want_w, rtol=1e-5)
  hf = DeepseekV3TopkRouter(DeepseekV3Config(
      hidden_size=d, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
      topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=1.0))
  with torch.no_grad():
    hf.weight.copy_(torch.from_numpy(weight))
    hf.e_score_correction_bias.copy_(torch.from_numpy(bias_E))
    hf_i = np.sort(hf(torch.from_numpy(x))[2].numpy(), axis=1)
  np.testing.assert_array_equal(hf_i, got["-inf"])
  assert (got["-inf"] != got["0"]).any(axis=1).all()


@pytest.mark.parametrize("overrides,message", [
    (dict(moe_router="softmax_topk_norm", moe_n_group=2),
     "model.moe_n_group=2: is read by model.moe_router=deepseek only"),
    (dict(moe_router="softmax_topk", moe_routed_scaling_factor=2.5),
     "model.moe_routed_scaling_factor=2.5: is read by model.moe_router=deepseek only"),
    (dict(num_experts=0, moe_d_ff=None),
     "model.moe_router='deepseek': needs model.num_experts > 0"),
    (dict(num_experts=0, moe_d_ff=None, moe_router="softmax_topk_norm", moe_topk_group=2),
     "model.moe_topk_group=2: needs model.num_experts > 0 and model.moe_router=deepseek"),
    (dict(moe_router="softmax_topk", moe_group_mask_fill="0"),
     "model.moe_group_mask_fill='0': is read by model.moe_router=deepseek only"),
    (dict(moe_group_mask_fill="0"), "model.moe_group_mask_fill='0': is read with "
     "model.moe_n_group > 1 only (no group is masked); set it to '-inf'"),
    (dict(moe_n_group=2, moe_group_mask_fill="zero"),
     "model.moe_group_mask_fill='zero': must be one of -inf, 0"),
    (dict(moe_n_group=3), "model.moe_n_group=3: must split model.num_experts=8"),
    (dict(moe_n_group=8), "model.moe_n_group=8: must split model.num_experts=8 into equal "
     "groups of at least 2"),
    (dict(moe_n_group=2, moe_topk_group=3), "model.moe_topk_group=3: must be <= "
     "model.moe_n_group=2"),
    (dict(moe_n_group=4, moe_topk_group=1), "model.experts_per_token=3: must be <= the 2 "
     "experts of model.moe_topk_group=1 groups"),
    (dict(moe_routed_scaling_factor=0.0), "model.moe_routed_scaling_factor=0.0: must be "
     "positive"),
    (dict(moe_n_group=0), "model.moe_n_group=0: must be a positive integer"),
    (dict(num_experts=0, moe_d_ff=None, moe_router="softmax_topk_norm", seq_aux=1e-4),
     "train.moe_seq_aux_loss=0.0001: weighs a mixture of experts' router loss, but "
     "model.num_experts=0"),
    (dict(seq_aux=-1.0), "train.moe_seq_aux_loss=-1.0: must be >= 0"),
])
def test_bad_deepseek_router_settings_are_one_line(overrides, message):
  c = _config()
  c.train.moe_seq_aux_loss = overrides.pop("seq_aux", 0.0)
  c.model.update(**overrides)
  with pytest.raises(UserError, match="^config field " + message.replace("(", r"\(").replace(
      ")", r"\)")) as err:
    validate(c)
  assert "\n" not in str(err.value)


def test_sequence_wise_balance_loss_is_deepseeks():
  """L_Bal of DeepSeek-V3 (eq. 17-20), per sequence of T real tokens:
  sum_i f_i P_i, f_i = N_r / (K_r T) x the tokens choosing i, P_i the mean
  over the tokens of s_i / sum_j s_j; averaged over the sequences, padding
  in none, and a sequence split over two devices adds up to the whole."""
  from model.moe import _seq_parts, _seq_sums  # pylint: disable=import-outside-toplevel
  gen = np.random.default_rng(0)
  E, k, rows, T = 6, 2, 3, 5
  s = gen.uniform(size=(rows * T, E)).astype(np.float32)
  experts = np.argsort(-s, axis=1)[:, :k]
  probs = s / s.sum(1, keepdims=True)
  real = np.ones(rows * T, bool)
  real[-2:] = False  # the last sequence has 3 real tokens
  want = []
  for r in range(rows):
    t = [i for i in range(r * T, (r + 1) * T) if real[i]]
    f = np.array([E / (k * len(t)) * sum(e in experts[i] for i in t) for e in range(E)])
    p = probs[t].mean(0)
    want.append((f * p).sum())
  total, sequences = _seq_sums(*_seq_parts(jnp.asarray(experts), jnp.asarray(probs),
                                           jnp.asarray(real), rows), k)
  assert float(sequences) == rows
  np.testing.assert_allclose(float(total) / rows, np.mean(want), rtol=1e-6)
  first = _seq_sums(*_seq_parts(jnp.asarray(experts[:T]), jnp.asarray(probs[:T]),
                                jnp.asarray(real[:T]), 1), k)
  parts = jax.tree.map(lambda a, b: a + b, *[
      _seq_parts(jnp.asarray(experts[:T][i::2]), jnp.asarray(probs[:T][i::2]),
                 jnp.asarray(real[:T][i::2]), 1) for i in (0, 1)])
  np.testing.assert_allclose(float(_seq_sums(*parts, k)[0]), float(first[0]), rtol=1e-6)
  np.testing.assert_allclose(float(first[0]), want[0], rtol=1e-6)


def test_moe_layer_with_shared_experts_equals_transformers():
  """A whole DeepSeek-V3 MoE layer (transformers' DeepseekV3MoE: the group-
  limited router, SwiGLU experts, n_shared_experts always-on experts added)
  on our layer's weights gives our layer's output."""
  cfg = ModelConfig.resolve(_config(moe_n_group=4, moe_topk_group=2, num_shared_experts=2,
                                    moe_routed_scaling_factor=2.5).model)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  hf = DeepseekV3MoE(DeepseekV3Config(
      hidden_size=cfg.d_model, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
      topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=2,
      moe_intermediate_size=cfg.moe_d_ff, hidden_act="silu"))
  t = lambda w: torch.from_numpy(np.array(w[...]))
  with torch.no_grad():
    hf.gate.weight.copy_(t(layer.router.kernel).T)
    hf.experts.gate_up_proj.copy_(torch.cat([t(layer.gate.kernel), t(layer.up.kernel)],
                                            dim=2).transpose(1, 2))
    hf.experts.down_proj.copy_(t(layer.down.kernel).transpose(1, 2))
    for name in ("gate", "up", "down"):
      getattr(hf.shared_experts, f"{name}_proj").weight.copy_(
          t(getattr(layer.shared, name).kernel).T)
    x = jax.random.normal(jax.random.key(3), (2, 5, cfg.d_model))
    want = hf(torch.from_numpy(np.array(x))).numpy()
  got, _ = layer(x)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)
