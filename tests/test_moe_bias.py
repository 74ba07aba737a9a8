"""DeepSeek-V3's auxiliary-loss-free load balancing (`train.moe_bias_update_rate`,
`model/moe.py` `ExpertBias`, `training/steps.py` `balance_score_bias`): the
bias selects experts but does not weigh them; the optimizer never moves it;
the train step moves each layer's by exactly +-gamma toward balance, from
that layer's loads over the whole step (micro-batches added), not after a
bad step; a stopped run resumes to the same biases; mistakes are one line."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from configs.validation import validate
from model import build_model
from model.moe import route_sigmoid
from tests.helpers import assert_trees_equal
from tests.test_optim import run_config, straight_and_stopped
from tests.test_steps import next_token_batch
from training.metrics import read_metrics
from training.optim import model_optimizer
from training.steps import init_state, jit_train_step, router_losses

E = 8
GAMMA = 0.01


def _config(scan: bool = True, **train):
  c = base.get_config()
  c.tokenizer.vocab_size = 64
  c.model.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
                 max_len=16, pos_emb="rope", attention_impl="xla", num_experts=E,
                 experts_per_token=2, moe_d_ff=24, moe_router="deepseek", moe_n_group=2,
                 moe_topk_group=2, scan_layers=scan)
  c.train.update(warmup_steps=0, learning_rate=1e-2, weight_decay=0.1, **train)
  return c


def _biases(params) -> np.ndarray:
  """Every MoE layer's selection bias, [layers, E] (either layout)."""
  flat = [(path, np.asarray(v[...])) for path, v in nnx.to_flat_state(params)
          if path[-1] == "score_bias"]
  return np.concatenate([b.reshape(-1, E) for _, b in sorted(flat, key=lambda p: str(p[0]))])


def _with_biases(params, bias_LE):
  """`params` with the MoE layers' selection biases set to `bias_LE` [layers, E]."""
  flat = []
  layer = iter(range(len(bias_LE)))
  for path, v in nnx.to_flat_state(params):
    if path[-1] == "score_bias":
      rows = bias_LE if v[...].ndim == 2 else bias_LE[next(layer)]
      v = v.replace(jnp.asarray(rows, jnp.float32))
    flat.append((path, v))
  return nnx.from_flat_state(flat)


@functools.cache
def _model(scan: bool):
  """(graphdef, initial state) of `_config(scan)`'s model (built once)."""
  return nnx.split(build_model(_config(scan).model, nnx.Rngs(0)))


def _counts(scan: bool, bias_LE, batch) -> np.ndarray:
  """Each MoE layer's assignments per expert [layers, E] of a forward pass
  of the initial weights with the selection biases `bias_LE` over `batch`."""
  graphdef, params = _model(scan)
  model = nnx.merge(graphdef, _with_biases(params, bias_LE))
  model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
  return np.asarray(model.decoder.router_stats.get_value().counts)


@functools.cache
def _step_fn(scan: bool, rate: float, accum_steps: int):
  """The jitted train step of `_config(scan)` at gamma `rate` (compiled once)."""
  c = _config(scan, moe_bias_update_rate=rate)
  return jit_train_step(_model(scan)[0], model_optimizer(c),
                        optax.constant_schedule(c.train.learning_rate), "next_token",
                        accum_steps, router_losses=router_losses(c), bias_rate=rate)


def _step(scan: bool, rate: float, bias_LE, accum_steps: int = 1, batch=None):
  """(params before, state after, metrics, each MoE layer's expert counts of
  the forward pass before the step) of one train step of `_config(scan)`
  at gamma `rate` from the initial weights with the selection biases
  `bias_LE`."""
  params = _with_biases(_model(scan)[1], bias_LE)
  batch = next_token_batch() if batch is None else batch
  before = jax.device_get(params)
  tx = model_optimizer(_config(scan, moe_bias_update_rate=rate))
  state, metrics = _step_fn(scan, rate, accum_steps)(init_state(params, tx, 0), batch)
  return before, jax.device_get(state), jax.device_get(metrics), _counts(scan, bias_LE, batch)


def _imbalanced() -> np.ndarray:
  """Layer 0 sends every token to expert 0 (with the other of its two);
  layer 1 is left to its router."""
  bias = np.zeros((2, E), np.float32)
  bias[0, 0] = 5.0
  return bias


def test_the_bias_selects_and_does_not_weigh():
  """A bias on an expert brings tokens to it; each token's weights are still
  its unbiased affinities of the experts it chose, renormalised and scaled."""
  gen = np.random.default_rng(0)
  logits = gen.normal(size=(64, E)).astype(np.float32)
  kw = dict(n_group=2, topk_group=1, scale=2.5)
  bias = np.zeros(E, np.float32)
  bias[5] = 0.4
  w0, i0, p0 = route_sigmoid(logits, 2, **kw)
  w1, i1, p1 = route_sigmoid(logits, 2, **kw, bias_E=bias)
  i0, i1 = np.asarray(i0), np.asarray(i1)
  assert (i1 == 5).any(axis=1).sum() > (i0 == 5).any(axis=1).sum()
  s = 1 / (1 + np.exp(-logits))
  for w, i in ((w0, i0), (w1, i1)):
    chosen = np.take_along_axis(s, i, axis=1)
    np.testing.assert_allclose(np.asarray(w), 2.5 * chosen / chosen.sum(1, keepdims=True),
                               rtol=1e-6)
  same = (np.sort(i0, 1) == np.sort(i1, 1)).all(1)
  assert same.any() and not same.all()
  np.testing.assert_array_equal(np.sort(np.asarray(w0)[same], 1),
                                np.sort(np.asarray(w1)[same], 1))
  np.testing.assert_array_equal(np.asarray(p0), np.asarray(p1))


@pytest.mark.slow  # about 30 s alone, 95 s beside another worker
def test_the_optimizer_never_moves_the_bias():
  """gamma = 0: AdamW with weight decay moves every parameter and no bias
  (set away from 0, so that decay would show)."""
  bias = np.random.default_rng(1).normal(size=(2, E)).astype(np.float32)
  before, state, metrics, _ = _step(True, 0.0, bias)
  np.testing.assert_array_equal(_biases(state["params"]), bias)
  assert "moe_bias_abs" not in metrics
  for (path, old), (_, new) in zip(nnx.to_flat_state(before),
                                   nnx.to_flat_state(state["params"])):
    if path[-1] != "score_bias":
      assert not np.array_equal(np.asarray(old[...]), np.asarray(new[...])), path


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_each_layers_bias_moves_by_gamma_toward_balance(scan):
  """gamma = 0.01: each layer's bias moves by -gamma x sign(its load - the
  mean load) from its own counts: the layer forced onto expert 0 lowers
  expert 0's and raises the underloaded experts'; `moe_bias_abs` is the
  mean |b|. The biases are [layers, E] scanned, one [E] per layer else."""
  gamma = np.float32(GAMMA)
  bias = _imbalanced()
  before, state, metrics, counts = _step(scan, GAMMA, bias)
  shapes = [v[...].shape for path, v in nnx.to_flat_state(before) if path[-1] == "score_bias"]
  assert shapes == ([(2, E)] if scan else [(E,), (E,)])
  got = _biases(state["params"])
  sign = np.sign(counts.mean(axis=1, keepdims=True) - counts)
  np.testing.assert_array_equal(got, bias + gamma * sign.astype(np.float32))
  assert counts[0, 0] == counts[0].sum() / 2  # every token's first choice
  assert got[0, 0] == np.float32(5.0) - gamma
  under = counts[0] < counts[0].mean()
  assert under.sum() >= E // 2 and (got[0][under] == gamma).all()
  assert not np.array_equal(sign[0], sign[1])  # per layer, not their average
  assert float(metrics["moe_bias_abs"]) == pytest.approx(np.abs(got).mean(), rel=1e-6)


@pytest.mark.slow  # about 30 s alone, 95 s beside another worker
def test_a_bad_step_leaves_the_bias():
  """A step whose loss is not finite keeps the biases as they were."""
  batch = next_token_batch()
  batch["loss_mask"] = np.where(batch["loss_mask"] > 0, np.float32(np.nan), 0.0)
  _, state, _, _ = _step(True, GAMMA, _imbalanced(), batch=batch)
  assert int(state["bad_step"]) == 0
  np.testing.assert_array_equal(_biases(state["params"]), _imbalanced())


def _skewed_batch() -> dict:
  """`next_token_batch()` whose first four rows are its first row: the two
  micro-batches of `accum_steps=2` load the experts differently."""
  batch = next_token_batch()
  return {k: np.concatenate([np.repeat(v[:1], 4, axis=0), v[4:]]) for k, v in batch.items()}


@pytest.mark.slow  # 46 s beside another worker
def test_gradient_accumulation_moves_the_bias_as_the_whole_batch():
  """Two micro-batches move the biases as the whole batch does: by the
  counts added over both, not by either micro-batch's own."""
  bias, batch = np.zeros((2, E), np.float32), _skewed_batch()
  _, whole, _, counts = _step(True, GAMMA, bias, batch=batch)
  _, accum, _, _ = _step(True, GAMMA, bias, accum_steps=2, batch=batch)
  np.testing.assert_array_equal(_biases(accum["params"]), _biases(whole["params"]))
  halves = [_counts(True, bias, {k: v[i * 4:(i + 1) * 4] for k, v in batch.items()})
            for i in (0, 1)]
  np.testing.assert_array_equal(halves[0] + halves[1], counts)
  sign = lambda n: np.sign(n.mean(axis=1, keepdims=True) - n)
  assert all(not np.array_equal(sign(half), sign(counts)) for half in halves)


def test_validation_refuses_the_rate_without_the_deepseek_router():
  for fields, rate, message in [
      (dict(), -0.001, "train.moe_bias_update_rate=-0.001: must be >= 0 (0: off; DeepSeek-V3: "
       "0.001)"),
      (dict(moe_router="softmax_topk_norm", moe_n_group=1, moe_topk_group=1), 0.001,
       "train.moe_bias_update_rate=0.001: moves the selection bias of model.moe_router=deepseek "
       "only (not softmax_topk_norm); use moe_router=deepseek or set it to 0"),
      (dict(moe_router="softmax_topk_norm", moe_n_group=1, moe_topk_group=1, num_experts=0,
            moe_d_ff=None), 0.001,
       "train.moe_bias_update_rate=0.001: moves a mixture of experts' selection bias, but "
       "model.num_experts=0 (a dense model); set it to 0")]:
    c = _config(moe_bias_update_rate=rate)
    c.model.update(**fields)
    with pytest.raises(UserError) as err:
      validate(c)
    assert str(err.value) == f"config field {message}"
  validate(_config(moe_bias_update_rate=0.001))


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_biases(tok_dir, tmp_path, monkeypatch):
  """train.py with gamma > 0: a run stopped at step 3 and resumed ends with
  the straight run's parameters and biases, bit for bit; the biases moved
  and `moe_bias_abs` is logged."""
  c = run_config(tok_dir, moe_bias_update_rate=0.01)
  c.model.update(num_experts=4, experts_per_token=2, moe_d_ff=32, moe_router="deepseek")
  (step_a, params_a), (step_b, params_b) = straight_and_stopped(c, tmp_path, monkeypatch)
  assert step_a == step_b == 6
  assert_trees_equal(params_a, params_b)
  bias = np.asarray(params_a["decoder"]["layers"]["mlp"]["score_bias"]["value"])
  assert bias.shape == (1, 4) and np.abs(bias).max() > 0
  train = [r for r in read_metrics(str(tmp_path / "straight")) if r["split"] == "train"]
  assert len(train) == 6 and all(r["moe_bias_abs"] >= 0 for r in train)
  assert train[-1]["moe_bias_abs"] == pytest.approx(np.abs(bias).mean(), rel=1e-6)


MESH_STEPS = """
from configs import tiny_moe
from training import steps
from training.optim import model_optimizer


def config(**mesh):
  c = tiny_moe.get_config()
  c.model.update(vocab_size=128, num_shared_experts=1, moe_router="deepseek", moe_n_group=2,
                 moe_topk_group=1)
  c.train.update(batch_size=16, seq_len=32, moe_bias_update_rate=0.01, warmup_steps=0,
                 grad_accum_steps=2)
  c.mesh.update(**mesh)
  return c


rng = np.random.default_rng(0)
tokens = rng.integers(1, 128, (16, 32)).astype(np.int32)
batch = dict(inputs=tokens, targets=np.roll(tokens, -1, 1), segment_ids=np.ones_like(tokens),
             positions=np.tile(np.arange(32, dtype=np.int32), (16, 1)),
             loss_mask=np.ones((16, 32), np.float32))
c = config()
graphdef, abstract = steps.abstract_state(c)
tx = model_optimizer(c)
params = nnx.state(build_model(c.model, nnx.Rngs(0)))


def three_steps(mesh=None):
  state = steps.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), params), tx, 0)
  kw, b = {}, batch
  if mesh is not None:
    m = sharding.make_mesh(config(**mesh).mesh)
    kw = dict(state_sharding=sharding.train_state_shardings(abstract, m, c.mesh.rules),
              batch_sharding=sharding.batch_sharding(m))
    state, b = jax.device_put(state, kw["state_sharding"]), jax.device_put(b, kw["batch_sharding"])
  step = steps.jit_train_step(graphdef, tx, optax.constant_schedule(0.01), "next_token", 2,
                              router_losses=steps.router_losses(c), bias_rate=0.01, **kw)
  for _ in range(3):
    state, _ = step(state, b)
  return [np.asarray(v[...]) for path, v in nnx.to_flat_state(jax.device_get(state["params"]))
          if path[-1] == "score_bias"]


want = three_steps()
out = {"moved": bool(np.abs(want[0]).max() > 0)}
for mesh in MESHES:
  out[str(mesh)] = all(np.array_equal(a, b) for a, b in zip(three_steps(mesh), want))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_on_eight_devices_the_biases_move_as_on_one():
  """configs/tiny_moe.py under the deepseek router, three steps of two
  micro-batches: the biases on 8 CPU devices (data 2 x fsdp 2 x tensor 2;
  expert 4 x fsdp 2) equal one device's, bit for bit (the loads are counts
  added over the devices)."""
  from tests.test_sharding import run_on_8_devices  # pylint: disable=import-outside-toplevel
  meshes = [dict(data=2, fsdp=2, tensor=2), dict(data=1, expert=4, fsdp=2)]
  out = run_on_8_devices(MESH_STEPS.replace("MESHES", repr(meshes)))
  assert out == {"moved": True, **{str(mesh): True for mesh in meshes}}
