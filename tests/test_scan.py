"""Scanned layers (`model.scan_layers`) against the loop, and the compilation cache."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import base, from_run
from data import tokens as tokens_lib
from model import accounting, build_model
from model import config as model_config, resolve as resolve_lib
from model.config import ModelConfig
from model.generate import beam_search, generate
from model.transformer import Segment, layer_plan, segment
from training import compile_cache, loop, optim, sharding, workdir as workdir_lib
from training.steps import balance_score_bias
from tests.helpers import both_splits, final_params, scanned_copy

FAMILIES = {
    "decoder": dict(family="decoder"),
    "encoder": dict(family="encoder", pos_emb="learned", norm="layernorm", norm_position="post",
                    mlp="gelu", type_vocab_size=2, embedding_norm=True, head_transform=True,
                    output_bias=True, use_bias=True),
    "encoder_decoder": dict(family="encoder_decoder", pos_emb="relative", num_decoder_layers=2,
                            relative_buckets=8, relative_max_distance=16, attention_scale=1.0),
}


def model_cfg(scan, **overrides):
  c = base.get_config().model
  c.update(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=64,
           max_len=32, attention_impl="xla", scan_layers=scan)
  c.update(**overrides)
  return c


def loop_and_scanned(remat=False, **overrides):
  """The same weights in both layouts: the loop's layers stacked into the scanned model."""
  looped = build_model(model_cfg(False, **overrides), nnx.Rngs(0))
  scanned = build_model(model_cfg(True, **overrides), nnx.Rngs(1), remat=remat)
  return looped, scanned_copy(looped, scanned)


def forward(model, family, tokens):
  if family == "encoder_decoder":
    return model(tokens, tokens[:, ::-1])
  return model(tokens)


# unroll 1 is slow: unroll 2 runs the same scan (remat inside, one block an
# iteration in its remainder) and test_registry.py compares the default scan's
# logits with the loop's for every registry option.
@pytest.mark.parametrize("family,unroll", [
    pytest.param("decoder", 1, marks=pytest.mark.slow),
    ("decoder", 2),  # 3 layers: 2 a loop of 1 iteration and 1 more
    *(pytest.param(f, 2, marks=pytest.mark.slow) for f in FAMILIES if f != "decoder")])
def test_scanned_layers_give_the_loops_logits_and_gradients(family, unroll):
  """Same weights: same logits and same gradients (stacked), with remat inside
  the scan, one block or two per iteration (model.scan_unroll)."""
  looped, scanned = loop_and_scanned(remat=True, scan_unroll=unroll, **FAMILIES[family])
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 1, 64)

  def loss_and_grads(model):
    loss = lambda m: jnp.mean(jax.nn.log_softmax(forward(m, family, tokens))[..., 3])
    return nnx.jit(nnx.value_and_grad(loss))(model)

  (loss_l, grads_l), (loss_s, grads_s) = loss_and_grads(looped), loss_and_grads(scanned)
  np.testing.assert_allclose(loss_s, loss_l, rtol=1e-5)
  got = dict(nnx.to_flat_state(grads_s))
  for path, grad in nnx.to_flat_state(grads_l):
    if "layers" in path:
      at = path.index("layers") + 1
      stacked = got[path[:at] + path[at + 1:]][...][path[at]]
    else:
      stacked = got[path][...]
    np.testing.assert_allclose(stacked, grad[...], atol=1e-6, err_msg=str(path))
  np.testing.assert_allclose(forward(scanned, family, tokens), forward(looped, family, tokens),
                             atol=1e-5)


def test_scanned_generation_and_beam_search_match_the_loop():
  """KV-cache sampling of a decoder and beam search of an encoder-decoder (T5's
  relative bias over the cache, cross-attention keys per layer) in both layouts."""
  looped, scanned = loop_and_scanned()
  prompts = [[1, 5, 9], [2, 7]]
  outs = [generate(m, model_cfg(scan), prompts, max_new_tokens=5, temperature=0.8, seed=3)
          for m, scan in ((looped, False), (scanned, True))]
  assert outs[0] == outs[1]
  looped, scanned = loop_and_scanned(**FAMILIES["encoder_decoder"])
  sources = [[3, 4, 5, 6], [7, 8]]
  outs = [beam_search(m, model_cfg(scan, **FAMILIES["encoder_decoder"]), [[1], [1]],
                      beam_size=3, max_new_tokens=4, sources=sources)
          for m, scan in ((looped, False), (scanned, True))]
  assert outs[0] == outs[1]


def test_attention_maps_and_accounting_read_either_layout():
  looped, scanned = loop_and_scanned()
  tokens = jnp.arange(1, 9)[None]
  np.testing.assert_allclose(scanned.decoder.attention_maps(tokens, causal=True),
                             looped.decoder.attention_maps(tokens, causal=True), atol=1e-6)
  assert (accounting.measured_params(model_cfg(True))
          == accounting.measured_params(model_cfg(False))
          == accounting.formula_params(model_cfg(True)))


def test_stacked_parameters_carry_the_layers_axis():
  """[layers, ...] parameters whose `layers` axis no mesh axis splits."""
  state = nnx.state(nnx.eval_shape(lambda: build_model(model_cfg(True), nnx.Rngs(0))))
  kernel = state["decoder"]["layers"]["attn"]["q_proj"]["kernel"]
  assert kernel.shape == (3, 32, 4, 8)
  assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
  mesh = sharding.make_mesh(base.get_config().mesh)
  spec = sharding.param_partition_specs(state, mesh, base.get_config().mesh.rules)
  assert spec["decoder"]["layers"]["attn"]["q_proj"]["kernel"].value == P(
      None, "fsdp", "tensor", None)


def test_scan_layers_default_and_a_window_on_some_layers():
  """None scans unless only some layers have the window; True scans those
  in runs of identical layers."""
  assert ModelConfig.resolve(model_cfg(None)).scan_layers
  some = dict(sliding_window=4, sliding_window_layers=(1, 2))
  assert not ModelConfig.resolve(model_cfg(None, **some)).scan_layers
  assert ModelConfig.resolve(model_cfg(None, sliding_window=4)).scan_layers
  cfg = ModelConfig.resolve(model_cfg(True, **some))
  assert cfg.scan_layers and layer_plan(cfg, cfg.num_layers) == (Segment(0, 1, 1),
                                                                  Segment(1, 2, 1))


# Layer 0 dense, 1 with experts, 2 and 3 with experts and a window: three runs.
MIXED = dict(num_layers=4, num_experts=4, experts_per_token=2, moe_d_ff=16, moe_layers=(1, 2, 3),
             moe_router="deepseek", moe_n_group=2, moe_topk_group=2, sliding_window=3,
             sliding_window_layers=(2, 3))


def _loop_path(path: tuple, scanned_paths) -> tuple:
  """The scanned layout's (path, repeat) of a loop parameter's path."""
  at = path.index("layers") + 1
  for seg in map(segment, scanned_paths):
    if path[at] in seg.layers:
      repeat, j = seg.where(path[at])
      body = (seg.name,) if seg.period == 1 else (seg.name, j)
      return path[:at] + body + path[at + 1:], repeat
  raise AssertionError(path)


def _assert_same_layer_grads(grads_looped, grads_scanned, segments):
  got = dict(nnx.to_flat_state(grads_scanned))
  for path, grad in nnx.to_flat_state(grads_looped):
    if "layers" in path:
      path, i = _loop_path(path, segments)
      np.testing.assert_allclose(got[path][...][i], grad[...], atol=1e-6, err_msg=str(path))


def _assert_scanned_as_looped(overrides: dict, counts_LE) -> dict:
  """Same weights in the loop and the scanned layout of `overrides`: the
  same loss and gradients, router statistics (rows in layer order),
  auxiliary-loss-free bias steps from `counts_LE` ([MoE layers, E]),
  generation and parameter counts. Returns the scanned stack's segments."""
  looped, scanned = loop_and_scanned(**overrides)
  segments = nnx.state(scanned)["decoder"]["layers"]
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 1, 64)

  def loss_and_grads(model):
    loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 3])
    return nnx.jit(nnx.value_and_grad(loss))(model)

  (loss_l, grads_l), (loss_s, grads_s) = loss_and_grads(looped), loss_and_grads(scanned)
  np.testing.assert_allclose(loss_s, loss_l, rtol=1e-5)
  _assert_same_layer_grads(grads_l, grads_s, segments)
  stats = [m.decoder.router_stats.get_value() for m in (looped, scanned)]
  assert stats[1].counts.shape == counts_LE.shape
  np.testing.assert_array_equal(stats[1].counts, stats[0].counts)

  moe_layers = ModelConfig.resolve(model_cfg(True, **overrides)).moe_layers
  biases = []
  for model in (looped, scanned):
    graphdef, state = nnx.split(model)
    moved = nnx.merge(graphdef, balance_score_bias(graphdef, state, counts_LE, 0.5))
    biases.append(np.stack([moved.decoder.block(i).mlp.score_bias[...] for i in moe_layers]))
  np.testing.assert_array_equal(biases[1], biases[0])
  np.testing.assert_array_equal(biases[0], 0.5 * np.sign(
      counts_LE.sum(1, keepdims=True) - counts_LE.shape[1] * counts_LE))

  prompts = [[1, 5, 9], [2, 7]]
  assert (generate(scanned, model_cfg(True, **overrides), prompts, max_new_tokens=6, seed=3)
          == generate(looped, model_cfg(False, **overrides), prompts, max_new_tokens=6, seed=3))
  assert (accounting.measured_params(model_cfg(True, **overrides))
          == accounting.measured_params(model_cfg(False, **overrides))
          == accounting.formula_params(model_cfg(True, **overrides)))
  return segments


def _weight_decay_and_muon(segments_path: tuple, overrides: dict) -> tuple:
  """(decays, Muon's reduction axes) of the attention query kernel and the
  MLP norm's scale under `segments_path` of the scanned layout: a stacked
  axis is no matrix axis."""
  scanned = build_model(model_cfg(True, **overrides), nnx.Rngs(0))
  params = nnx.state(scanned, nnx.Param)
  decays = {path: d.get_value() for path, d in nnx.to_flat_state(optim.decay_mask(params))}
  muon = {path: d.get_value() for path, d in nnx.to_flat_state(jax.tree_util.tree_map_with_path(
      optim.muon_dimensions, params))}
  kernel, scale = (*segments_path, "attn", "q_proj", "kernel"), (*segments_path, "norm_mlp",
                                                                    "scale")
  return decays[kernel], decays[scale], muon[kernel].reduction_axis


@pytest.mark.slow
def test_differing_layers_scan_in_runs_as_the_loop():
  """DeepSeek-V3's layout in small (a dense layer, then experts, a window on
  the last two): `scan_layers=True` stacks each run of identical layers
  ("0_to_0", "1_to_1", "2_to_3") and scans them one after the other, as the loop."""
  counts_LE = jnp.asarray([[9, 1, 4, 2], [1, 1, 1, 9], [4, 4, 4, 4]], jnp.float32)
  assert set(_assert_scanned_as_looped(MIXED, counts_LE)) == {"0_to_0", "1_to_1", "2_to_3"}
  assert _weight_decay_and_muon(("decoder", "layers", "2_to_3"), MIXED) == (True, False, (1,))


def test_a_run_saved_before_the_field_keeps_its_loop(tmp_path):
  """config.json without model.scan_layers loads (and resumes) as the loop it trained."""
  saved = json.loads(base.get_config().to_json())
  del saved["model"]["scan_layers"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert workdir_lib.load_config(str(tmp_path)).model.scan_layers is False
  assert from_run.get_config(str(tmp_path)).model.scan_layers is False
  resumed = workdir_lib.keep_layout(base.get_config(), str(tmp_path))
  assert resumed.model.scan_layers is False
  asked = base.get_config()
  asked.model.scan_layers = True
  assert workdir_lib.keep_layout(asked, str(tmp_path)).model.scan_layers is True


def write_documents(directory, at_least: int) -> None:
  """doc0.txt, doc1.txt, ... in `directory`: at least `at_least`, and as many
  as a split of half of them (data.val_percent=50) needs to have both sides."""
  for i in range(both_splits(lambda i: str(directory / f"doc{i}.txt"), 50, at_least)):
    (directory / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps over "
                                           f"the lazy dog {i} times.\n" * 40)


@pytest.mark.slow
def test_a_second_start_compiles_nothing(tmp_path, monkeypatch):
  """A 2-step run started again with the same config (a requeued job) reads
  every compiled program from the persistent cache: hits, no miss, no new entry."""
  write_documents(tmp_path, 16)
  c = base.get_config()
  c.model.update(vocab_size=288, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=16)
  c.tokenizer.update(vocab_size=260)
  c.data.update(source="files", paths=str(tmp_path / "doc*.txt"), cache_dir=str(tmp_path / "d"),
                val_percent=50)
  c.train.update(num_steps=2, batch_size=2, seq_len=16, eval_steps=1, log_every=1,
                 compilation_cache_dir=str(tmp_path / "jax"))
  events = []
  listener = lambda event, **kwargs: events.append(event)
  jax.monitoring.register_event_listener(listener)
  try:
    jax.clear_caches()  # what this process compiled already would not reach the cache
    loop.train(c, str(tmp_path / "first"))
    entries = sorted(os.listdir(tmp_path / "jax"))
    jax.clear_caches()  # what a new process starts without
    events.clear()
    loop.train(c, str(tmp_path / "second"))
  finally:
    jax.monitoring.unregister_event_listener(listener)
    compile_cache.enable(compile_cache.OFF)
  assert entries and sorted(os.listdir(tmp_path / "jax")) == entries
  assert events.count("/jax/compilation_cache/cache_hits") > 0
  assert "/jax/compilation_cache/cache_misses" not in events


def test_compilation_cache_off_by_config_or_environment(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
  monkeypatch.setenv(tokens_lib.CACHE_ENV_VAR, str(tmp_path / "machine"))
  assert compile_cache.cache_dir("") == str(tmp_path / "machine" / "jax")
  monkeypatch.delenv(tokens_lib.CACHE_ENV_VAR, raising=False)
  assert compile_cache.cache_dir("") == os.path.expanduser("~/.cache/transformer_lab/jax")
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
  assert compile_cache.cache_dir("") == str(tmp_path / "env")
  assert compile_cache.cache_dir(str(tmp_path / "own")) == str(tmp_path / "own")
  assert compile_cache.cache_dir(compile_cache.OFF) is None
  monkeypatch.setenv(compile_cache.ENV_VAR, compile_cache.OFF)
  assert compile_cache.cache_dir("") is None


def test_a_learned_scalar_stacks_and_scans():
  """A 0-d parameter (DyT's alpha) gets the `layers` axis in a scanned stack
  and loses it again per layer (Flax adds the axis only to a non-empty
  annotation: `model/layers.param` leaves a scalar's unannotated)."""
  from model.layers import param  # pylint: disable=import-outside-toplevel
  from model.transformer import _scan_layers, _stacked_blocks  # pylint: disable=import-outside-toplevel

  class Scaled(nnx.Module):

    def __init__(self, rngs):
      self.alpha = param(rngs, jax.nn.initializers.constant(0.5), (), (), jnp.float32)

  stacked = _stacked_blocks(Scaled, 3, nnx.Rngs(0))
  assert stacked.alpha.shape == (3,)
  out, _ = _scan_layers(lambda layer, h, _: (h * layer.alpha[...], None), stacked, jnp.ones(()))
  assert float(out) == 0.125


# A cycle of three kinds (a window, experts, both) repeated over 7 layers:
# twice, then layer 6 (sliding) as its own run.
CYCLE = dict(num_layers=7, num_experts=4, experts_per_token=2, moe_d_ff=16,
             moe_router="deepseek", moe_n_group=2, moe_topk_group=2, sliding_window=3,
             layer_types=("sliding_attention", "full_attention+moe", "sliding_attention+moe"))


def test_layer_types_scan_by_their_cycle_as_the_loop():
  """`model.layer_types` repeated to the layers: a scanned stack stacks the
  cycle's repeats ("0_to_5_every_3", its body blocks 0..2) and the layer
  left over ("6_to_6"), as the loop; each selection bias of the cycle's body
  takes its layers' rows of the router statistics."""
  cfg = ModelConfig.resolve(model_cfg(None, **CYCLE))
  assert cfg.scan_layers and cfg.layer_cycle == 3
  assert cfg.moe_layers == (1, 2, 4, 5) and cfg.sliding_window_layers == (0, 2, 3, 5, 6)
  assert layer_plan(cfg, 7) == (Segment(0, 2, 3), Segment(6, 1, 1))
  counts_LE = jnp.asarray([[9, 1, 4, 2], [1, 1, 1, 9], [4, 4, 4, 4], [2, 8, 3, 3]], jnp.float32)
  segments = _assert_scanned_as_looped(CYCLE, counts_LE)
  assert set(segments) == {"0_to_5_every_3", "6_to_6"}
  assert set(segments["0_to_5_every_3"]) == {0, 1, 2}
  scanned = build_model(model_cfg(True, **CYCLE), nnx.Rngs(0))
  assert [rows for _, rows in scanned.decoder.expert_biases()] == [(0, 2), (1, 3)]
  assert _weight_decay_and_muon(("decoder", "layers", "0_to_5_every_3", 1), CYCLE) == (
      True, False, (1,))


@pytest.mark.parametrize("num_layers,layer_types,plan", [
    # 3:1 over 8 layers: one cycle body of 4 blocks, scanned twice.
    (8, ("sliding_attention",) * 3 + ("full_attention",), ((0, 2, 4),)),
    # A full-length tuple (transformers' layer_types) is scanned by its period.
    (6, ("sliding_attention", "full_attention") * 3, ((0, 3, 2),)),
    # 5:1 over 26 layers (Gemma-3 1B): 4 times the cycle, the 2 left over as a run
    # (7 blocks against 9 runs); over 14 layers the 5 runs are fewer than 6 + 1.
    (26, ("sliding_attention",) * 5 + ("full_attention",), ((0, 4, 6), (24, 2, 1))),
    (14, ("sliding_attention",) * 5 + ("full_attention",),
     ((0, 5, 1), (5, 1, 1), (6, 5, 1), (11, 1, 1), (12, 2, 1))),
    # One repeat of the cycle buys nothing: runs.
    (5, ("sliding_attention",) * 3 + ("full_attention",), ((0, 3, 1), (3, 1, 1), (4, 1, 1))),
    # Three dense layers then experts, written out: two runs beat a 6-layer body.
    (6, ("full_attention",) * 3 + ("full_attention+moe",) * 3, ((0, 3, 1), (3, 3, 1))),
    # One kind: the stack itself.
    (4, ("full_attention",), ((0, 4, 1),)),
])
def test_the_layer_plan_scans_the_fewest_blocks(num_layers, layer_types, plan):
  moe = any(kind.endswith("+moe") for kind in layer_types)
  cfg = ModelConfig.resolve(model_cfg(True, num_layers=num_layers, layer_types=layer_types,
                                      sliding_window=3 if "sliding_attention" in layer_types
                                      else None, num_experts=4 if moe else 0))
  assert layer_plan(cfg, num_layers) == tuple(Segment(*s) for s in plan)


def test_layer_types_and_the_old_fields_describe_the_same_layers():
  """The kinds sliding_window_layers and moe_layers give are the kinds
  layer_types writes: the same forward fields and parameter counts; only
  the scanned layout (runs against the cycle) and its default differ."""
  old = ModelConfig.resolve(model_cfg(None, num_layers=4, sliding_window=3,
                                      sliding_window_layers=(0, 2), num_experts=4,
                                      moe_layers=(1, 3)))
  new = ModelConfig.resolve(model_cfg(None, num_layers=4, sliding_window=3, num_experts=4,
                                      layer_types=("sliding_attention", "full_attention+moe")))
  assert old.layer_types == new.layer_types == ("sliding_attention", "full_attention+moe") * 2
  assert old.forward_fields() == new.forward_fields()
  assert (old.scan_layers, old.layer_cycle, new.scan_layers, new.layer_cycle) == (
      False, 0, True, 2)


def test_a_layer_types_run_trains_resumes_and_resolves_its_config_once(tmp_path, monkeypatch):
  """train.py's path (`loop.train`) on layers of two kinds scanned by their
  cycle: the config is validated once and its model section resolved once
  (`model.resolve`), and the run resumes from its checkpoint."""
  write_documents(tmp_path, 8)
  c = base.get_config()
  c.model.update(vocab_size=288, d_model=16, num_layers=4, num_heads=2, d_ff=32, max_len=16,
                 sliding_window=4, layer_types=("sliding_attention", "full_attention"))
  c.tokenizer.update(vocab_size=260)
  c.data.update(source="files", paths=str(tmp_path / "doc*.txt"), cache_dir=str(tmp_path / "d"),
                val_percent=50)
  c.train.update(num_steps=2, batch_size=2, seq_len=16, eval_steps=1, log_every=1,
                 checkpoint_every=2, warmup_steps=0)
  calls = {"validate": 0, "model": 0}
  validate, model_resolve = resolve_lib.validate, ModelConfig._resolve.__func__

  def counted(name, fn):
    def call(*args):
      calls[name] += 1
      return fn(*args)
    return call

  monkeypatch.setattr(resolve_lib, "validate", counted("validate", validate))
  monkeypatch.setattr(ModelConfig, "_resolve", classmethod(counted("model", model_resolve)))
  monkeypatch.setattr(model_config, "_RESOLVED", {})
  loop.train(c, str(tmp_path / "run"))
  assert calls == {"validate": 1, "model": 1}
  saved = workdir_lib.load_config(str(tmp_path / "run")).model
  assert tuple(saved.layer_types) == ("sliding_attention", "full_attention")
  assert set(nnx.state(nnx.eval_shape(lambda: build_model(saved, nnx.Rngs(0))))[
      "decoder"]["layers"]) == {"0_to_3_every_2"}
  c.train.num_steps = 3
  loop.train(c, str(tmp_path / "run"))
  assert final_params(tmp_path / "run")[0] == 3
