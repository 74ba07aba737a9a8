"""μP (`model.parametrization=mup`, docs/models.md "μP"): at its base width
it is the standard parametrization; wider, the hidden matrices' init and
learning rate, the logits and the attention scale follow the width; the
coordinate check (`bench/coord_check.py`) keeps the logits flat where sp's
grow; depth-μP (`model.mup_base_depth`) scales the residual branches and the
hidden learning rate with depth; what they do not cover is refused in one line."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench import coord_check
from configs import base, tiny
from configs.errors import UserError
from configs.validation import validate
from hf import convert
from model import build_model
from model.config import ModelConfig
from training import optim
from training import workdir as workdir_lib
from training.loop import _check_source_parametrization
from tests.helpers import assert_trees_equal


def _config(width=32, **model):
  c = base.get_config()
  c.tokenizer.vocab_size = 64
  c.model.update(**{"vocab_size": 64, "d_model": width, "num_heads": 4, "d_ff": 3 * width,
                    "num_layers": 2, **model})
  return c


def test_mup_at_its_base_width_is_sp():
  """Width multiplier 1: the same weights, logits and updates as sp."""
  sp, mup = _config(), _config(parametrization="mup", mup_base_width=32)
  models = [build_model(c.model, nnx.Rngs(0)) for c in (sp, mup)]
  params = [nnx.state(m, nnx.Param) for m in models]
  assert_trees_equal(*params)
  tokens = jnp.arange(16).reshape(2, 8) % 64
  np.testing.assert_array_equal(models[0](tokens), models[1](tokens))
  grads = jax.tree.map(jnp.ones_like, params[0])
  txs = [optim.make_optimizer(c.train, optim.mup_width(c.model)) for c in (sp, mup)]
  updates = [tx.update(grads, tx.init(params[0]), params[0])[0] for tx in txs]
  assert_trees_equal(*updates)


def test_hidden_matrices_init_and_learning_rate_follow_the_width():
  """Width multiplier 4 (d = 128 over base 32): the block kernels drawn with
  std 0.02 / 2 and updated at 1/4 of AdamW's step, the embeddings and norms
  as under sp; logits times 1/4; attention scale sqrt(base head_dim) / head_dim."""
  c = _config(128, parametrization="mup", mup_base_width=32)
  cfg = ModelConfig.resolve(c.model)
  assert (cfg.width_mult, cfg.logit_mult) == (4.0, 0.25)
  assert cfg.attention_scale == pytest.approx(np.sqrt(8) / 32)
  params = nnx.state(build_model(c.model, nnx.Rngs(0)), nnx.Param)
  flat = {jax.tree_util.keystr(k, simple=True, separator="/"): v
          for k, v in jax.tree_util.tree_leaves_with_path(params)}
  up = next(v for k, v in flat.items() if k.endswith("mlp/up/kernel/value"))
  embedding = next(v for k, v in flat.items() if k.endswith("embedding/value"))
  assert float(jnp.std(up)) == pytest.approx(0.01, rel=0.05)
  assert float(jnp.std(embedding)) == pytest.approx(0.02, rel=0.05)
  grads = jax.tree.map(jnp.ones_like, params)
  sp_tx, mup_tx = optim.make_optimizer(c.train), optim.make_optimizer(c.train, 4.0)
  sp_u, mup_u = (tx.update(grads, tx.init(params), params)[0] for tx in (sp_tx, mup_tx))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sp_u), jax.tree.leaves(mup_u)):
    hidden = optim.muon_dimensions(path, a) is not None
    np.testing.assert_allclose(b, a / 4 if hidden else a, rtol=1e-6)
  assert any(optim.muon_dimensions(p, a) is not None
             for p, a in jax.tree_util.tree_leaves_with_path(sp_u))


def test_the_output_multiplier_scales_the_logits_at_any_width():
  """model.mup_output_mult = alpha: the logits times alpha / m, at the base
  width too (there alpha times sp's, from the same weights), tied or not."""
  tokens = jnp.arange(16).reshape(2, 8) % 64
  for tied in (True, False):
    sp = build_model(_config(tie_embeddings=tied).model, nnx.Rngs(0))
    mup = build_model(_config(parametrization="mup", mup_output_mult=8.0,
                              tie_embeddings=tied).model, nnx.Rngs(0))
    np.testing.assert_allclose(mup(tokens), 8.0 * sp(tokens), rtol=1e-6)
  wide = ModelConfig.resolve(_config(128, parametrization="mup", mup_base_width=32,
                                     mup_output_mult=8.0).model)
  assert wide.logit_mult == 2.0
  assert ModelConfig.resolve(_config(128, parametrization="mup", mup_base_width=32,
                                     mup_output_mult=4.0).model).logit_mult is None


@pytest.mark.parametrize("model", [dict(mup_base_width=16), dict(mup_output_mult=4.0)])
def test_to_hf_refuses_a_mup_run_whose_logits_no_hf_model_scales(tmp_path, model):
  """Wider than its base, or with an output multiplier: one line, nothing written."""
  c = _config(parametrization="mup", **model)
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / workdir_lib.CONFIG_FILE).write_text(
      json.dumps(workdir_lib.config_to_dict(c)))
  with pytest.raises(UserError, match="whose logit and attention scales no Hugging Face") as err:
    convert.to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
  assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("optimizer,option,mult", [
    ("adamw", {}, 0.25), ("lion", {}, 0.25), ("adafactor", {}, 0.5),
    ("adafactor", {"adafactor_param_scale": False}, 0.25), ("muon", {}, 0.25),
    ("muon", {"muon_rms": 0.0}, 1.0)])
def test_each_optimizer_takes_its_hidden_learning_rate(optimizer, option, mult):
  c = _config()
  c.train.update(optimizer=optimizer, **option)
  validate(c)
  assert optim.hidden_lr_mult(c.train, 4.0) == mult


@pytest.mark.slow
def test_logits_stay_flat_across_width_under_mup_and_grow_under_sp():
  """The coordinate check on configs/tiny.py's text, widths 64 and 512 (4
  heads, d_ff 3d), 5 AdamW steps at 1e-2: the logits' RMS moves by at most
  1.5x under μP (base width 64) and grows over 2x under sp. Width 64 is
  trained once: μP at its base width is sp (test_mup_at_its_base_width_is_sp)."""
  config = tiny.get_config()
  tokens = coord_check.text_batch(config, 4)

  def logits(width, parametrization):
    c = coord_check.at_width(config, width, parametrization, base_width=64, ff_mult=3, lr=1e-2,
                             steps=5)
    return coord_check.coordinates(c, tokens)[-1]["logits"]

  base = logits(64, "sp")
  ratio = {p: logits(512, p) / base for p in ("sp", "mup")}
  assert 1 / 1.5 <= ratio["mup"] <= 1.5, ratio
  assert ratio["sp"] > 2.0, ratio


@pytest.mark.parametrize("model,message", [
    (dict(mup_base_width=32), "model.mup_base_width=32: needs model.parametrization=mup"),
    (dict(parametrization="mup", attention_scale=0.1),
     "model.attention_scale=0.1: sets the attention scale that μP decides"),
    (dict(parametrization="mup", num_experts=4), "model.num_experts=4: is not covered by μP"),
    (dict(parametrization="mup", mup_base_width=0), "model.mup_base_width=0: must be a positive"),
    (dict(parametrization="mu"), "model.parametrization='mu': must be one of sp, mup"),
    (dict(mup_output_mult=8.0), "model.mup_output_mult=8.0: needs model.parametrization=mup"),
    (dict(parametrization="mup", mup_output_mult=0.0),
     "model.mup_output_mult=0.0: must be positive"),
])
def test_bad_mup_settings_are_one_line(model, message):
  c = _config(**model)
  with pytest.raises(UserError, match="^config field " + message.replace("(", r"\(").replace(
      ")", r"\)")) as err:
    validate(c)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("source,ours", [
    (dict(), dict(parametrization="mup", mup_base_width=16)),
    (dict(parametrization="mup", mup_base_width=16), dict()),
    (dict(parametrization="mup", mup_base_width=16),
     dict(parametrization="mup", mup_base_width=8)),
    (dict(), dict(num_layers=2, mup_base_depth=1)),
    (dict(parametrization="mup", mup_base_width=16),
     dict(parametrization="mup", mup_base_width=16, mup_output_mult=4.0))])
def test_restore_from_another_parametrization_is_one_line(source, ours):
  with pytest.raises(UserError, match="their weights are scaled otherwise") as err:
    _check_source_parametrization(_config(**ours), "train.restore_from=src", _config(**source))
  assert "\n" not in str(err.value)
  _check_source_parametrization(_config(**ours), "train.restore_from=src", _config(**ours))


def test_depth_mup_at_its_base_depth_changes_nothing_and_deeper_scales_branches_and_steps():
  """model.mup_base_depth = num_layers: the model and updates of no base
  depth. Base 1 at 4 layers: each residual branch and each hidden matrix's
  update times sqrt(1 / 4) = 1/2, the rest as without."""
  at_base = _config(mup_base_depth=2)
  assert ModelConfig.resolve(at_base.model).branch_mult is None
  assert optim.mup_depth(at_base.model) is None
  deep = _config(num_layers=4, mup_base_depth=1)
  cfg = ModelConfig.resolve(deep.model)
  assert cfg.branch_mult == 0.5 and optim.mup_depth(deep.model) == 0.5
  assert "mup_base_depth" in cfg.forward_fields()
  assert "mup_base_depth" not in ModelConfig.resolve(at_base.model).forward_fields()
  model = build_model(deep.model, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 8, 32))
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  block = model.decoder.block(0)
  h = x + 0.5 * block.attn(block.norm_attn(x), positions_BT=positions, causal=True)
  want = h + 0.5 * block.mlp(block.norm_mlp(h))
  np.testing.assert_allclose(block(x, positions_BT=positions, causal=True)[0], want,
                             rtol=1e-5, atol=1e-6)
  params = nnx.state(model, nnx.Param)
  grads = jax.tree.map(jnp.ones_like, params)
  plain_u, deep_u = (tx.update(grads, tx.init(params), params)[0] for tx in (
      optim.make_optimizer(deep.train), optim.model_optimizer(deep)))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(plain_u), jax.tree.leaves(deep_u)):
    np.testing.assert_allclose(b, a / 2 if optim.muon_dimensions(path, a) is not None else a,
                               rtol=1e-6)


@pytest.mark.slow
def test_depth_mup_keeps_the_residual_stream_from_growing_with_depth():
  """configs/tiny.py at d 64, 2 and 8 layers, 5 AdamW steps at 1e-2 on one
  batch of text: the last block's output grows about with depth without a
  base depth (measured 2.9 to 9.9) and does not grow with depth-μP (base 2;
  measured 2.9 to 1.3: its branches add up less coherently this early). The
  2 layers are trained once: at its base depth, depth-μP changes nothing
  (test_depth_mup_at_its_base_depth_changes_nothing_and_deeper_scales_branches_and_steps)."""
  config = tiny.get_config()
  tokens = coord_check.text_batch(config, 4)
  rms = {}
  for base_depth, layers in ((None, 2), (None, 8), (2, 8)):
    c = coord_check.at_width(config, 64, "sp", base_width=64, ff_mult=3, lr=1e-2, steps=5)
    c.model.update(num_layers=layers, mup_base_depth=base_depth)
    validate(c)
    rms[base_depth, layers] = coord_check.coordinates(c, tokens)[-1][f"block {layers - 1}"]
  assert rms[None, 8] / rms[None, 2] > 2.5, rms
  assert rms[2, 8] / rms[None, 2] < 1, rms


@pytest.mark.parametrize("model,message", [
    (dict(mup_base_depth=2, norm_position="post"),
     "model.mup_base_depth=2: scales pre-norm residual branches"),
    (dict(mup_base_depth=0), "model.mup_base_depth=0: must be a positive"),
    (dict(mup_base_depth=2, family="encoder_decoder", num_decoder_layers=4),
     "model.mup_base_depth=2: needs both stacks of one depth"),
])
def test_bad_depth_mup_settings_are_one_line(model, message):
  c = _config(**model)
  with pytest.raises(UserError, match="^config field " + message.replace("(", r"\(")) as err:
    validate(c)
  assert "\n" not in str(err.value)
