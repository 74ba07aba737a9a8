"""Mixtures of experts (`model/moe.py`, `model.num_experts`): the dropless
layer against a per-token loop over its chosen experts, the router's
statistics and losses in a train step, the parameter accounting (Mixtral's
counts as transformers gives them), and the one-line refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base, mixtral_8x7b, tiny_moe
from configs.errors import UserError
from configs.validation import validate
from model import accounting, build_model
from model.config import ModelConfig
from model.mlp import MLPS
from model.moe import MoE, ROUTERS, routing
from training import steps


def _model_config(**fields):
  c = base.get_config()
  c.tokenizer.vocab_size = 64
  c.model.update(vocab_size=64, d_model=32, num_heads=4, d_ff=48, num_experts=4,
                 experts_per_token=2, moe_d_ff=24, **fields)
  return c


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("mlp,shared", [("swiglu", 0), ("gelu", 1), ("geglu", 2)])
def test_moe_layer_equals_a_loop_over_each_tokens_experts(router, mlp, shared):
  """Every token's output is the weighted sum of its top-k experts' MLPs
  (weights: the router's softmax, renormalised over the k or not) plus the
  shared experts' MLP: the sorted, grouped (`ragged_dot`) computation equals
  this loop, token by token, to float32 rounding."""
  cfg = ModelConfig.resolve(_model_config(moe_router=router, mlp=mlp,
                                          num_shared_experts=shared).model)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
  got, stats = layer(x)

  act = MLPS[mlp].activation
  router_w, up, down = (np.asarray(w[...]) for w in (layer.router.kernel, layer.up.kernel,
                                                     layer.down.kernel))
  gate = None if layer.gate is None else np.asarray(layer.gate.kernel[...])
  want = np.zeros(x.shape, np.float32)
  for b in range(2):
    for t in range(5):
      x_m = np.asarray(x[b, t])
      if ROUTERS[router].sigmoid:  # its routing against transformers': test_router_deepseek.py
        weights, chosen, _ = (np.asarray(a[0]) for a in routing(cfg)(x_m[None] @ router_w))
      else:
        probs = np.asarray(jax.nn.softmax(x_m @ router_w))
        chosen = np.argsort(-probs)[:cfg.experts_per_token]
        weights = probs[chosen] / (probs[chosen].sum() if ROUTERS[router].normalize else 1.0)
      for e, w in zip(chosen, weights):
        hidden = np.asarray(act(x_m @ gate[e])) * (x_m @ up[e]) if gate is not None else (
            np.asarray(act(x_m @ up[e])))
        want[b, t] += w * (hidden @ down[e])
  if shared:
    want += np.asarray(layer.shared(x))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  assert all(np.isfinite(float(v)) for v in stats[:4])
  assert float(stats.share.sum()) == pytest.approx(1.0)


def test_padding_tokens_reach_no_expert_and_count_in_no_statistic():
  """Rows with padding (segment id 0): the real tokens' outputs are those of
  the unpadded layer, the padding's are zero (no shared expert here), and
  the statistics equal those of the real tokens alone (the sequence-wise
  balance loss: of each row's real tokens)."""
  cfg = ModelConfig.resolve(_model_config().model)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  # Compiled: four shapes op by op take seconds each (the layer is the same).
  call = nnx.jit(lambda layer, x, real=None: layer(x, real_BT=real))
  x = jax.random.normal(jax.random.key(2), (2, 6, cfg.d_model))
  real = jnp.array([[True] * 6, [True] * 3 + [False] * 3])
  got, stats = call(layer, x, real)
  alone, alone_stats = call(layer, x[real][None])
  np.testing.assert_allclose(np.asarray(got[real]), np.asarray(alone[0]), atol=1e-6)
  assert float(jnp.abs(got[~real]).max()) == 0.0
  for a, b in zip(stats[:-1], alone_stats[:-1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  # The sequence-wise balance loss is each row's over its real tokens, averaged.
  rows = [call(layer, x[:1])[1].seq_aux_loss, call(layer, x[1:, :3])[1].seq_aux_loss]
  np.testing.assert_allclose(float(stats.seq_aux_loss), np.mean(rows), rtol=1e-5)


def test_capacity_drops_each_experts_latest_assignments():
  """model.moe_capacity_factor=0.5 (4 tokens x 2 / 4 experts x 0.5: one
  assignment per expert): each expert keeps the earliest token routed to
  it; a dropped assignment adds nothing; the dropped fraction counts them."""
  cfg = ModelConfig.resolve(_model_config(moe_capacity_factor=0.5).model)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (1, 4, cfg.d_model))
  got, stats = layer(x)
  router_w, up, gate, down = (np.asarray(w[...]) for w in (
      layer.router.kernel, layer.up.kernel, layer.gate.kernel, layer.down.kernel))
  want, taken, dropped = np.zeros(x.shape, np.float32), set(), 0
  for t in range(4):
    x_m = np.asarray(x[0, t])
    probs = np.asarray(jax.nn.softmax(x_m @ router_w))
    chosen = np.argsort(-probs)[:2]
    for e, w in zip(chosen, probs[chosen] / probs[chosen].sum()):
      if e in taken:
        dropped += 1
        continue
      taken.add(e)
      want[0, t] += w * ((np.asarray(jax.nn.silu(x_m @ gate[e])) * (x_m @ up[e])) @ down[e])
  assert dropped > 0
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  assert float(stats.dropped) == pytest.approx(dropped / 8)


def test_router_statistics():
  """The load-balancing loss is E sum_e f_e P_e with f_e the fraction of
  tokens sent to e: k when routing is uniform; the load is the busiest
  expert over the mean; the dropped fraction is of all assignments."""
  from model.moe import _sums, stats_of_sums  # pylint: disable=import-outside-toplevel
  logits = jnp.zeros((8, 4))
  uniform = jnp.array([4, 4, 4, 4])
  stats = stats_of_sums(*_sums(logits, jax.nn.softmax(logits), uniform, uniform, jnp.ones(8)))
  assert float(stats.aux_loss) == pytest.approx(2.0)  # k = 2: 16 assignments of 8 tokens
  assert float(stats.z_loss) == pytest.approx(np.log(4) ** 2)
  assert float(stats.dropped) == 0.0
  halves = [_sums(logits[:4], jax.nn.softmax(logits[:4]), jnp.array([4, 2, 1, 1]),
                  jnp.array([4, 2, 1, 1]), jnp.ones(4)),
            _sums(logits[4:], jax.nn.softmax(logits[4:]), jnp.array([6, 0, 1, 1]),
                  jnp.array([3, 0, 1, 1]), jnp.ones(4))]
  skewed = stats_of_sums(*jax.tree.map(jnp.add, *halves))  # two devices' sums added
  assert float(skewed.load) == pytest.approx(2.5)
  assert float(skewed.dropped) == pytest.approx(3 / 16)


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_train_step_weighs_and_reports_the_router_losses(scan):
  """A train step of configs/tiny_moe.py: the router's losses are reported
  (the load-balancing loss near k = 2 at initialisation, the sequence-wise
  one near 1), and their weights
  change the router's gradient and nothing when zero."""
  c = tiny_moe.get_config()
  c.model.update(scan_layers=scan, vocab_size=128)
  c.train.update(batch_size=2, seq_len=16)
  graphdef, _ = steps.abstract_state(c)
  params = nnx.state(build_model(c.model, nnx.Rngs(0)), nnx.Param)
  tokens = np.random.default_rng(0).integers(1, 128, (2, 16)).astype(np.int32)
  batch = dict(inputs=tokens, targets=np.roll(tokens, -1, 1), segment_ids=np.ones_like(tokens),
               positions=np.tile(np.arange(16, dtype=np.int32), (2, 1)),
               loss_mask=np.ones((2, 16), np.float32))
  grads = {}
  # The weights as arguments: one compilation serves the four.
  weighed = jax.jit(lambda p, b, w: steps._grads(graphdef, p, b, "next_token", 1,
                                                  router_losses=w))
  for weights in [(0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]:
    g, (sums, router) = weighed(params, batch, tuple(jnp.float32(w) for w in weights))
    grads[weights] = g
    aux, z, load, dropped, seq = (float(r / sums[1]) for r in router)
    assert 1.5 < aux < 2.5 and z > 0 and 1.0 <= load <= 4.0 and dropped == 0.0
    assert 0.75 < seq < 1.25  # DeepSeek-V3's sequence-wise balance loss: 1 when balanced
  router_grad = lambda w: jax.tree.leaves(nnx.state(
      nnx.merge(graphdef, grads[w]).decoder.layers, nnx.Param))
  for w in [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]:
    assert any(not np.allclose(a, b) for a, b in zip(router_grad(w),
                                                       router_grad((0.0, 0.0, 0.0))))


def test_mixtral_counts_as_transformers():
  """configs/mixtral_8x7b.py: 46,702,792,704 parameters, 12,879,925,248
  active per token (MixtralForCausalLM's count; 2 of 8 experts), and the
  training FLOPs per token from the active ones."""
  params = accounting.formula_params(mixtral_8x7b.get_config().model)
  assert params["params_total"] == 46_702_792_704
  assert params["params_active"] == 12_879_925_248
  flops = accounting.flops_per_token(mixtral_8x7b.get_config().model, 4096)
  assert flops == 3 * (2 * 12_879_925_248 + 4 * 32 * 4096 * 32 * 128)


@pytest.mark.parametrize("fields", [dict(), dict(num_shared_experts=1),
                                    dict(moe_layers=(1,), scan_layers=None),
                                    dict(moe_layers=(1,), scan_layers=True),  # scanned runs
                                    dict(mlp="gelu", use_bias=True, scan_layers=False)])
def test_measured_parameters_equal_the_formula(fields):
  m = _model_config(**fields).model
  assert accounting.measured_params(m) == accounting.formula_params(m)


@pytest.mark.parametrize("section,overrides,message", [
    ("model", dict(experts_per_token=5),
     "model.experts_per_token=5: must be <= model.num_experts=4 (each token's top k of them)"),
    ("model", dict(num_experts=0, moe_d_ff=24),
     "model.moe_d_ff=24: needs model.num_experts > 0"),
    ("model", dict(family="encoder", pos_emb="learned"),
     "model.num_experts=4: mixtures of experts are built for decoders"),
    ("model", dict(moe_layers=(2,)), "model.moe_layers=(2,): must name distinct layers in 0..1"),
    ("model", dict(moe_router="hash"), "model.moe_router='hash': must be one of"),
    ("train", dict(moe_aux_loss=-1.0), "train.moe_aux_loss=-1.0: must be >= 0"),
    ("model", dict(moe_capacity_factor=-1.0), "model.moe_capacity_factor=-1.0: must be >= 0"),
    ("model", dict(num_experts=0, moe_capacity_factor=1.25),
     "model.moe_capacity_factor=1.25: needs model.num_experts > 0"),
    ("mesh", dict(expert=3), "mesh.expert=3: must divide model.num_experts=4"),
    ("mesh", dict(expert=0), "mesh.expert=0: must be a positive integer"),
])
def test_bad_moe_settings_are_one_line(section, overrides, message):
  c = _model_config()
  c[section].update(**overrides)
  if section == "mesh":
    c.mesh.data = 1
  if section == "model" and overrides.get("family") == "encoder":
    c.train.objective = "mlm"
  with pytest.raises(UserError, match="^config field " + message.replace("(", r"\(").replace(
      ")", r"\)")) as err:
    validate(c)
  assert "\n" not in str(err.value)


def test_an_expert_axis_on_a_dense_model_is_one_line():
  c = base.get_config()
  c.mesh.update(data=1, expert=2)
  with pytest.raises(UserError, match=r"^config field mesh.expert=2: splits a mixture of "
                     r"experts' experts, but model.num_experts=0 \(a dense model\)"):
    validate(c)


def test_a_router_loss_on_a_dense_model_is_one_line():
  c = base.get_config()
  c.train.moe_aux_loss = 0.01
  with pytest.raises(UserError, match=r"^config field train.moe_aux_loss=0.01: weighs a "
                     r"mixture of experts' router loss, but model.num_experts=0") as err:
    validate(c)
  assert "\n" not in str(err.value)


MESH_TRAINING = """
from training import steps

def config(**mesh):
  c = tiny_moe.get_config()
  c.model.update(vocab_size=128, num_shared_experts=1, mlp=MLP)
  c.train.update(batch_size=8, seq_len=32, moe_aux_loss=0.02, router_z_loss=0.001)
  c.mesh.update(**mesh)
  return c

from configs import tiny_moe
c = config()
rng = np.random.default_rng(0)
tokens = rng.integers(1, 128, (8, 32)).astype(np.int32)
batch = dict(inputs=tokens, targets=np.roll(tokens, -1, 1), segment_ids=np.ones_like(tokens),
             positions=np.tile(np.arange(32, dtype=np.int32), (8, 1)),
             loss_mask=np.ones((8, 32), np.float32))
graphdef, _ = steps.abstract_state(c)
params = nnx.state(build_model(c.model, nnx.Rngs(0)), nnx.Param)
grads = lambda p, b: steps._grads(graphdef, p, b, "next_token", 1,
                                  router_losses=(0.02, 0.001, 0.0001))
want_g, (want_sums, want_router) = jax.jit(grads)(params, batch)
out = {}
for mesh in MESHES:
  m = sharding.make_mesh(config(**mesh).mesh)
  g, (sums, router) = jax.jit(steps.traced_on(m, grads))(
      params, jax.device_put(batch, sharding.batch_sharding(m)))
  name = "_".join(f"{k}{v}" for k, v in mesh.items())
  out[name] = [abs(float(a) - float(b)) / max(abs(float(b)), 1e-6)
               for a, b in zip((*sums[:1], *router), (*want_sums[:1], *want_router))] + [
      float(jnp.abs(a - b).max() / jnp.abs(b).max())
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g))]
# At capacity 1 each device's tokens (one row on either mesh) drop the same
# assignments, whether the experts are local (data 8) or across devices.
c = config(data=8)
c.model.moe_capacity_factor = 1.0
graphdef, _ = steps.abstract_state(c)
capped = {}
for mesh in CAPPED:
  m = sharding.make_mesh(config(**mesh).mesh)
  capped[str(mesh)] = jax.jit(steps.traced_on(m, grads))(
      params, jax.device_put(batch, sharding.batch_sharding(m)))
(want_g, (want_sums, want_router)), *others = capped.values()
assert float(want_router[3]) > 0  # some assignments dropped
for g, (sums, router) in others:
  out["capacity"] = out.get("capacity", []) + [
      abs(float(a) - float(b)) / abs(float(b))
      for a, b in zip((*sums[:1], *router), (*want_sums[:1], *want_router))] + [
      float(jnp.abs(a - b).max() / jnp.abs(b).max())
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g))]
print(json.dumps(out))
"""


# Each mesh is a compilation on 8 devices (seconds): make test checks expert
# parallelism with fsdp, with tensor, and a context-split row (its sequence-wise
# statistics), and the drops of expert 8; the slow case adds the data x fsdp x
# tensor mesh (its axes checked on dense models in test_sharding.py) and the
# drops of expert 4 x fsdp 2, and gelu runs all of them.
FAST_MESHES = [dict(data=1, fsdp=4, context=2), dict(data=1, expert=4, fsdp=2),
               dict(data=2, expert=2, tensor=2)]
SLOW_MESHES = [dict(data=2, fsdp=2, tensor=2)]
FAST_CAPPED = [dict(data=8), dict(data=1, expert=8)]  # data 8 first: the reference
SLOW_CAPPED = [dict(data=8), dict(data=1, expert=4, fsdp=2)]


@pytest.mark.parametrize("mlp,meshes,capped", [
    ("swiglu", FAST_MESHES, FAST_CAPPED),
    pytest.param("swiglu", SLOW_MESHES, SLOW_CAPPED, marks=pytest.mark.slow),
    pytest.param("gelu", SLOW_MESHES + FAST_MESHES, FAST_CAPPED + SLOW_CAPPED[1:],
                 marks=pytest.mark.slow)], ids=["swiglu", "swiglu-data_fsdp_tensor", "gelu"])
def test_training_on_eight_devices_equals_one_device(mlp, meshes, capped):
  """configs/tiny_moe.py with a shared expert: the loss, the router's losses
  and load, and every gradient on 8 CPU devices (data 2 x fsdp 2 x tensor 2;
  fsdp 4 x context 2; expert 4 x fsdp 2; data 2 x expert 2 x tensor 2)
  within 1e-5 relative of one device's: each device routes its own tokens,
  the experts' rows travel to their devices and back, and the statistics
  add up over the devices. At a capacity factor of 1, expert 8 and expert 4
  x fsdp 2 drop what data 8 drops (each device one row on all three)."""
  from tests.test_sharding import run_on_8_devices  # pylint: disable=import-outside-toplevel
  out = run_on_8_devices(MESH_TRAINING.replace("MESHES", repr(meshes)).replace(
      "MLP", repr(mlp)).replace("CAPPED", repr(capped)))
  for name, errors in out.items():
    assert max(errors) < 1e-5, (name, errors)


def test_training_and_eval_report_the_experts(tok_dir, tmp_path):
  """A short MoE run at capacity 1: metrics.jsonl carries the router's
  metrics (some assignments dropped), and eval.py's report each MoE layer's
  share of tokens per expert (summing to 1) beside expert_load.png."""
  from tests.helpers import small_config  # pylint: disable=import-outside-toplevel
  from training import evaluate, loop  # pylint: disable=import-outside-toplevel
  from training.metrics import read_metrics  # pylint: disable=import-outside-toplevel
  c = small_config(tok_dir)
  c.model.update(num_layers=2, num_experts=4, experts_per_token=2, moe_capacity_factor=1.0)
  c.train.update(num_steps=4, log_every=2, eval_every=4, checkpoint_every=4, moe_aux_loss=0.01)
  loop.train(c, str(tmp_path / "run"))
  train = [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "train"]
  assert {"moe_aux_loss", "router_z_loss", "expert_load", "moe_dropped"} <= set(train[-1])
  assert 0 < train[-1]["moe_dropped"] < 1
  report = evaluate.run_eval(str(tmp_path / "run"), max_new_tokens=2, prompts=["def "])
  assert report["moe_layers"] == [0, 1]
  np.testing.assert_allclose(np.sum(report["expert_share"], axis=1), 1.0, rtol=1e-5)
  assert all(1.0 <= load <= 2.0 for load in report["expert_load"])  # E / k = 2 at most
  assert (tmp_path / "run" / "eval" / "step_4" / "expert_load.png").stat().st_size > 0
