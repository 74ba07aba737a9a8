"""DeepSeek-V3's multi-token prediction (train.mtp_depth, model/mtp.py): the
loss against a hand computation from the modules' logits, the main loss's
gradients untouched at weight 0, depth 0 as before, the parameter and FLOP
counts, exact resume, the metrics reported, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base, gpt2_small, validation
from configs.errors import UserError
from model import accounting, build_model, summary
from model.moe import MoE
from tests.helpers import (assert_one_line_error, assert_trees_equal, run_python,
                           small_cfg)
from tests.test_optim import run_config, straight_and_stopped
from tests.test_steps import next_token_batch
from training import evaluate
from training.metrics import by_name, evaluate_mixture, read_metrics
from training.steps import init_state, jit_eval_step, jit_train_step

D = 2


def model_config():
  return small_cfg(num_layers=1, max_len=16, pos_emb="rope")


def sgd_step(depth: int, weight: float, model=None, accum_steps: int = 1):
  """(gradient, metrics) of one SGD step at learning rate 1 on `next_token_batch()`."""
  model = model or build_model(model_config(), nnx.Rngs(0), mtp_depth=depth)
  graphdef, params = nnx.split(model)
  tx = optax.sgd(1.0)
  before = jax.device_get(params)
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1.0), "next_token", accum_steps,
                        mtp=(depth, weight) if depth else None)
  state, metrics = step(init_state(params, tx, 0), next_token_batch())
  gradient = jax.tree.map(lambda old, new: old - new, before, jax.device_get(state["params"]))
  return gradient, jax.device_get(metrics)


def hand_losses(model, batch):
  """(main mean CE, [depth k's mean CE and accuracy]) from the model's own
  logits, the targets k positions on counted where they stay in the row,
  the loss mask and the segment."""
  inputs, targets = batch["inputs"], batch["targets"]
  mask, segments = batch["loss_mask"], batch["segment_ids"]
  hidden = model.hidden(inputs, segment_ids=segments, positions=batch["positions"])
  logp = np.asarray(jax.nn.log_softmax(model.logits(model.decoder, hidden)))
  B, T = inputs.shape
  main = -sum(logp[b, i, targets[b, i]] * mask[b, i] for b in range(B) for i in range(T))
  depths = []
  for k, logits in enumerate(model.mtp_logits(hidden, inputs, segments, batch["positions"]),
                             start=1):
    logits = np.asarray(logits)
    lp = np.asarray(jax.nn.log_softmax(logits))
    total = count = correct = 0.0
    for b in range(B):
      for i in range(T - k):
        if mask[b, i] and mask[b, i + k] and segments[b, i] == segments[b, i + k]:
          target = targets[b, i + k]
          total -= lp[b, i, target]
          count += 1
          correct += float(logits[b, i].argmax() == target)
    depths.append((total / count, correct / count))
  return main / mask.sum(), depths


def test_the_loss_is_the_main_loss_plus_lambda_over_d_times_the_depths_losses():
  """The step's gradient is that of main + lambda / D x sum_k CE_k, computed by hand."""
  weight = 0.3
  model = build_model(model_config(), nnx.Rngs(0), mtp_depth=D)
  batch = next_token_batch()
  main, depths = hand_losses(model, batch)
  gradient, metrics = sgd_step(D, weight, model=nnx.clone(model))
  assert metrics["loss"] == pytest.approx(main, rel=1e-5)
  for k, (loss, accuracy) in enumerate(depths, start=1):
    assert metrics[f"mtp{k}_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics[f"mtp{k}_accuracy"] == pytest.approx(accuracy, abs=1e-6)
  graphdef, params = nnx.split(model)

  def total(p):
    m = nnx.merge(graphdef, p)
    hidden = m.hidden(batch["inputs"], segment_ids=batch["segment_ids"],
                      positions=batch["positions"])
    logp = jax.nn.log_softmax(m.logits(m.decoder, hidden))
    ce = lambda lp, t, w: -(jnp.take_along_axis(lp, t[..., None], -1)[..., 0] * w).sum() / w.sum()
    out = ce(logp, batch["targets"], batch["loss_mask"])
    for k, logits in enumerate(m.mtp_logits(hidden, batch["inputs"], batch["segment_ids"],
                                            batch["positions"]), start=1):
      w = np.zeros_like(batch["loss_mask"])
      w[:, :-k] = (batch["loss_mask"][:, :-k] * batch["loss_mask"][:, k:]
                   * (batch["segment_ids"][:, :-k] == batch["segment_ids"][:, k:]))
      t = np.zeros_like(batch["targets"])
      t[:, :-k] = batch["targets"][:, k:]
      out = out + weight / D * ce(jax.nn.log_softmax(logits), t, w)
    return out

  expected = jax.jit(jax.grad(total))(params)  # one compilation, not one per operation
  for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(gradient)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-4, atol=1e-6)
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(gradient["mtp"])) > 1e-4


@pytest.mark.slow
def test_weight_zero_leaves_the_main_gradients_and_accumulation_adds_up():
  plain, plain_metrics = sgd_step(0, 0.0)
  gradient, metrics = sgd_step(D, 0.0)
  assert set(gradient) == set(plain) | {"mtp"}
  for name in plain:
    for x, y in zip(jax.tree.leaves(plain[name]), jax.tree.leaves(gradient[name])):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)
  assert all(float(np.abs(g).max()) == 0 for g in jax.tree.leaves(gradient["mtp"]))
  assert metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-6)
  whole, whole_metrics = sgd_step(D, 0.3)
  halves, halves_metrics = sgd_step(D, 0.3, accum_steps=2)
  for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(halves)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
  for k in range(1, D + 1):
    assert halves_metrics[f"mtp{k}_loss"] == pytest.approx(whole_metrics[f"mtp{k}_loss"],
                                                           rel=1e-5)


def test_depth_zero_is_todays_model_and_step():
  """mtp_depth=0 builds the same parameters, and the step the same numbers, as before."""
  def params(depth=None):
    kwargs = {} if depth is None else {"mtp_depth": depth}
    state = nnx.state(build_model(model_config(), nnx.Rngs(0), **kwargs), nnx.Param)
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}

  today, with_mtp = params(), params(D)
  assert_trees_equal(today, params(0))
  assert {p for p in with_mtp if p[0] != "mtp"} == set(today)
  assert_trees_equal(today, {p: with_mtp[p] for p in today})  # the main model draws the same
  graphdef, params = nnx.split(build_model(model_config(), nnx.Rngs(0)))
  assert jit_eval_step(graphdef, "next_token", mtp_depth=0)(params, next_token_batch()) is not None
  assert len(jit_eval_step(graphdef, "next_token")(params, next_token_batch())) == 4


def test_eval_step_adds_each_depths_sums():
  model = build_model(model_config(), nnx.Rngs(0), mtp_depth=D)
  graphdef, params = nnx.split(model)
  batch = next_token_batch()
  sums = [float(x) for x in jit_eval_step(graphdef, "next_token", mtp_depth=D)(params, batch)]
  main, depths = hand_losses(model, batch)
  assert len(sums) == 4 + 3 * D
  assert sums[0] / sums[1] == pytest.approx(main, rel=1e-5)
  for k, (loss, accuracy) in enumerate(depths):
    loss_sum, count, correct = sums[4 + 3 * k:7 + 3 * k]
    assert (loss_sum / count, correct / count) == pytest.approx((loss, accuracy), rel=1e-5)


@pytest.mark.parametrize("overrides", [dict(), dict(norm_position="post", mlp="gelu"),
                                       dict(attention="mla", q_lora_rank=16, kv_lora_rank=8,
                                            qk_nope_head_dim=8, qk_rope_head_dim=4,
                                            v_head_dim=8)])
def test_the_closed_form_counts_the_modules(overrides):
  m = small_cfg(**overrides)
  accounting.check_formula(m, mtp_depth=D)
  counts = accounting.formula_params(m, D)
  assert counts["params_mtp"] == accounting.measured_params(m, D)["params_mtp"] > 0
  assert counts["params_total"] == accounting.formula_params(m)["params_total"] + (
      counts["params_mtp"])
  assert "params_mtp" not in accounting.formula_params(m)
  extra = (accounting.flops_per_token(m, 32, train=False, mtp_depth=D)
           - accounting.flops_per_token(m, 32, train=False))
  assert extra == D * (2 * (counts["params_mtp"] // D + m.d_model * m.vocab_size)
                       + 2 * 32 * m.num_heads * (accounting.ModelConfig.resolve(m).head_dim
                                                 + accounting.ModelConfig.resolve(m).v_head_dim))


_EXPERTS = dict(num_experts=4, experts_per_token=2, moe_d_ff=16, num_shared_experts=1,
                moe_router="deepseek", moe_n_group=2, moe_topk_group=1)


@pytest.mark.parametrize("moe_layers,moe", [((1,), True), ((0,), False)])
def test_the_modules_block_is_the_last_layers_kind_and_counted(moe_layers, moe):
  """With experts in the last layer the module's block has them (MoE, the
  router's selection bias) and the closed form counts them, in the total
  and, less the E - k a token skips, in the active count and the FLOPs;
  with a dense last layer the block is dense. Its sliding window is the
  last layer's."""
  m = small_cfg(**_EXPERTS, moe_layers=moe_layers, sliding_window=4,
                sliding_window_layers=(1,))
  model = build_model(m, nnx.Rngs(0), mtp_depth=D)
  cfg = accounting.ModelConfig.resolve(m)
  for module in model.mtp:
    assert isinstance(module.block.mlp, MoE) is moe
    assert module.block.attn.window == 4
  accounting.check_formula(m, mtp_depth=D)
  counts, without = accounting.formula_params(m, D), accounting.formula_params(m)
  assert counts == accounting.measured_params(m, D)
  skipped = D * (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.moe_d_ff
  assert counts["params_active"] == without["params_active"] + counts["params_mtp"] - (
      skipped if moe else 0)
  extra = (accounting.flops_per_token(m, 32, train=False, mtp_depth=D)
           - accounting.flops_per_token(m, 32, train=False))
  assert extra == 2 * (counts["params_mtp"] - (skipped if moe else 0)) + D * (
      2 * cfg.d_model * cfg.vocab_size + 2 * 32 * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim))


def test_the_join_is_the_normed_embedding_then_the_normed_hidden_state():
  """M_k reads [enorm(emb); hnorm(h)] in that order (DeepSeek-V3's eh_proj):
  its first d rows multiply the embedding's norm, the last d h's."""
  model = build_model(small_cfg(), nnx.Rngs(0), mtp_depth=1)
  module = model.mtp[0]
  module.hnorm.scale[...] = module.hnorm.scale[...] * 2.0  # tell the two norms apart
  h, emb = jax.random.normal(jax.random.key(1), (2, 2, 5, 32))
  kernel = np.asarray(module.eh_proj.kernel[...]).reshape(64, 32)
  want = np.concatenate([module.enorm(emb), module.hnorm(h)], axis=-1) @ kernel
  got = module._join(h, emb)  # pylint: disable=protected-access
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_stopped_mtp_run_resumes_exactly_and_reports_each_depth(tok_dir, tmp_path,
                                                                    monkeypatch):
  c = run_config(tok_dir, mtp_depth=D, mtp_weight=0.3, eval_every=3)
  (step_a, params_a), (step_b, params_b) = straight_and_stopped(c, tmp_path, monkeypatch)
  assert step_a == step_b == 6
  assert "mtp" in params_a
  assert_trees_equal(params_a, params_b)
  records = read_metrics(str(tmp_path / "straight"))
  train = [r for r in records if r["split"] == "train"]
  val = [r for r in records if r["split"] == "validation"]
  for name in ("mtp1_loss", "mtp1_accuracy", "mtp2_loss", "mtp2_accuracy", "loss"):
    assert all(np.isfinite(r[name]) for r in train), name
  assert val and all(0 < r["mtp2_loss"] and "loss" in r for r in val)
  report = evaluate.run_eval(str(tmp_path / "straight"), max_new_tokens=2)
  assert 0 < report["mtp1_loss"] and 0 <= report["mtp2_accuracy"] <= 1 and report["loss"] > 0
  # eval.py --prompt --draft mtp: the same completions, with the drafts' acceptance.
  plain, drafted = (evaluate.complete_prompts(str(tmp_path / "straight"), ["def ", "x"],
                                              max_new_tokens=6, out=str(tmp_path / name),
                                              draft=draft)
                    for name, draft in (("plain", None), ("drafted", "mtp")))
  assert drafted["samples"] == plain["samples"] and "speculative" not in plain
  assert drafted["speculative"]["draft_depth"] == D and drafted["speculative"]["passes"] > 0


def bad(**train):
  c = base.get_config()
  c.train.update(**train)
  return c


@pytest.mark.parametrize("config_fn,fragments", [
    (lambda: bad(mtp_depth=-1), ("train.mtp_depth=-1", "integer >= 0")),
    (lambda: bad(mtp_depth=1, mtp_weight=-0.1), ("train.mtp_weight=-0.1", ">= 0")),
    (lambda: bad(mtp_depth=1, objective="mlm"), ("train.mtp_depth=1", "next_token",
                                                 "set it to 0")),
    (lambda: bad(mtp_depth=4, seq_len=4), ("train.mtp_depth=4", "train.seq_len=4")),
])
def test_bad_settings_are_one_line(config_fn, fragments):
  config = config_fn()
  if config.train.objective == "mlm":
    config.model.family = "encoder"
  with pytest.raises(UserError) as raised:
    validation.validate(config)
  message = str(raised.value)
  assert "\n" not in message and all(f in message for f in fragments), message


def test_another_family_is_refused_in_one_line_exit_2(tmp_path):
  result = run_python(["train.py", "--config", "configs/base.py", "--workdir",
                       str(tmp_path / "run"), "--config.model.family=encoder",
                       "--config.train.objective=mlm", "--config.train.mtp_depth=1"])
  assert result.returncode == 2
  assert_one_line_error(result, "train.mtp_depth=1", "model.family=encoder")
  assert not (tmp_path / "run").exists()


def test_the_summary_counts_the_modules():
  config = base.get_config()
  config.model.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64)
  config.train.mtp_depth = D
  report = summary.summarize(config)
  assert report["params_mtp"] == accounting.formula_params(config.model, D)["params_mtp"]
  assert report["flops_per_token_train"] == accounting.flops_per_token(
      config.model, config.train.seq_len, train=True, mtp_depth=D) > accounting.flops_per_token(
          config.model, config.train.seq_len, train=True)
  assert f"{D} MTP modules" in summary.format_table(config, report)


def test_a_sweeps_cost_counts_the_mtp_modules_as_train_py_does():
  """report.csv's FLOPs are the start-up summary's: with the MTP modules."""
  from sweeps import report  # pylint: disable=import-outside-toplevel
  c = base.get_config()
  c.train.mtp_depth = 2
  cost = report._cost(c, 10)  # pylint: disable=protected-access
  assert cost["flops"] == 10 * accounting.flops_per_step(c)
  assert cost["flops_per_token"] > report._cost(base.get_config(), 10)["flops_per_token"]  # pylint: disable=protected-access


def test_training_memory_counts_the_modules_parameters_moments_and_activations():
  """GPT-2 small (bfloat16 activations, xla attention) with 2 modules: their
  parameters as built (`measured_params`), gradients and AdamW's two float32
  moments of them, and per token each module's norm and M_k inputs (4 d),
  a layer's Korthikanti elements (16 d + h S), its final norm's and the
  head's input (2 d) and float32 logits (4 V bytes); remat does not
  recompute the modules."""
  config = gpt2_small.get_config()
  config.model.attention_impl = "xla"
  d, h, S, V, B = 768, 12, 1024, 50304, 32
  without = accounting.training_memory_bytes(config)
  config.train.mtp_depth = 2
  with_mtp = accounting.training_memory_bytes(config)
  n = accounting.measured_params(config.model, 2)["params_mtp"]
  assert n == accounting.formula_params(config.model, 2)["params_mtp"] > 0
  assert with_mtp["parameters"] - without["parameters"] == 4 * n  # float32 parameters
  assert with_mtp["gradients"] - without["gradients"] == 4 * n
  assert with_mtp["optimizer_state"] - without["optimizer_state"] == 2 * 4 * n
  module = 2 * (22 * d + h * S) + 4 * V
  assert with_mtp["activations"] - without["activations"] == B * S * 2 * module
  assert with_mtp["total"] == sum(v for k, v in with_mtp.items() if k != "total")
  config.train.remat = True
  remat_with = accounting.training_memory_bytes(config)["activations"]
  config.train.mtp_depth = 0
  assert remat_with - accounting.training_memory_bytes(config)["activations"] == B * S * 2 * module


def test_a_mixtures_validation_weighs_each_depths_metrics_as_the_loss():
  """`evaluate_mixture`'s top-level record has mtp<k>_loss/_accuracy, the
  sources' weighted as its loss is, beside each source's own."""
  # An eval step's sums: loss, targets, correct, (log Z)^2, then per depth loss, count, correct.
  sums = {"a": [4.0, 2.0, 1.0, 0.0, 6.0, 2.0, 2.0], "b": [9.0, 3.0, 0.0, 0.0, 3.0, 1.0, 0.0]}
  mixture, by_source = evaluate_mixture(lambda params, batch: sums[batch], None,
                                        {"a": ["a"], "b": ["b"]}, {"a": 3.0, "b": 1.0})
  assert mixture["loss"] == pytest.approx((3 * 2.0 + 1 * 3.0) / 4)
  assert mixture["mtp1_loss"] == pytest.approx((3 * 3.0 + 1 * 3.0) / 4)
  assert mixture["mtp1_accuracy"] == pytest.approx((3 * 1.0 + 1 * 0.0) / 4)
  assert by_name(by_source)["mtp1_loss/a"] == 3.0
