"""FP8 projections (`model.fp8`, model/fp8.py): the scaling rules (amax,
scale = fmax / amax with margin, the rolled history of `delayed`), e4m3
operands forward and e5m2 gradients backward through the custom VJPs, the
train step writing the new scales and histories over the old ones (never
the optimizer), exact resume, and the mistakes refused in one line."""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.errors import UserError
from configs.validation import validate
from model import build_model, fp8
from tests.helpers import assert_trees_equal
from tests.test_optim import run_config, straight_and_stopped
from tests.test_steps import model_config, next_token_batch
from training import loop, workdir
from training.optim import model_optimizer
from training.steps import init_state, jit_train_step

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _operands():
  x_NK = jax.random.normal(jax.random.key(0), (32, 16))
  w_KM = 0.05 * jax.random.normal(jax.random.key(1), (16, 8))
  return x_NK, w_KM


def test_the_scale_puts_the_amax_on_the_formats_largest_value():
  assert float(fp8.scale_for(jnp.float32(2.0), E4M3_MAX, 1.0)) == 224.0
  assert float(fp8.scale_for(jnp.float32(2.0), E4M3_MAX, 1.0, margin=1)) == 112.0
  assert float(fp8.scale_for(jnp.float32(0.5), E5M2_MAX, 1.0)) == 2 * E5M2_MAX
  for amax in (0.0, np.inf, np.nan):  # nothing seen, or an overflow: the previous scale stays
    assert float(fp8.scale_for(jnp.float32(amax), E4M3_MAX, 3.0)) == 3.0
  np.testing.assert_array_equal(fp8.FMAX_3, [E4M3_MAX, E4M3_MAX, E5M2_MAX])


def test_quantize_saturates_and_the_history_rolls_newest_first():
  q = fp8.quantize(jnp.array([1.0, -1000.0, 1000.0]), 1.0, fp8.E4M3)
  assert q.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(q.astype(jnp.float32), [1.0, -E4M3_MAX, E4M3_MAX])
  history = jnp.array([[3.0, 2.0, 1.0], [6.0, 5.0, 4.0]])
  np.testing.assert_array_equal(fp8.roll_history(history, jnp.array([9.0, 8.0])),
                                [[9.0, 3.0, 2.0], [8.0, 6.0, 5.0]])


def _dot_operand_dtypes(fn, *args) -> list[tuple[str, str]]:
  """The operand dtypes of every dot_general in the jaxpr of `fn(*args)`."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for sub in jax.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("mode", ["current", "delayed"])
def test_forward_in_e4m3_gradients_in_e5m2(mode):
  """The forward product takes two e4m3 operands; the backward's two products
  each take the e5m2 output gradient and an e4m3 operand; the results are
  the float32 product's within FP8's rounding."""
  x_NK, w_KM = _operands()
  meta = (jnp.full((3,), 16.0), jnp.zeros((3, 4))) if mode == "delayed" else ()

  def loss(x, w):
    if mode == "current":
      return jnp.sum(fp8.current_matmul(x, w, jnp.float32) ** 2)
    return jnp.sum(fp8.delayed_matmul(x, w, *meta, jnp.float32) ** 2)

  grad = jax.grad(loss, argnums=(0, 1))
  assert _dot_operand_dtypes(loss, x_NK, w_KM) == [("float8_e4m3fn", "float8_e4m3fn")]
  assert sorted(_dot_operand_dtypes(grad, x_NK, w_KM)) == [
      ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
      ("float8_e5m2", "float8_e4m3fn")]
  exact = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1))(x_NK, w_KM)
  for got, want in zip(grad(x_NK, w_KM), exact):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=0.15 * float(jnp.abs(want).max()))


def test_micro_batch_state_combines_to_the_largest_amax():
  """Histories by their maximum, scales by their minimum (the carry's zeros
  take the first micro-batch's), true gradients added."""
  def tree(scale, history, grad):
    return {"s": fp8.Fp8Scale(jnp.array(scale)), "h": fp8.Fp8AmaxHistory(jnp.array(history)),
            "w": nnx.Param(jnp.array(grad))}

  combined = tree([0.0, 0.0], [0.0, 0.0], 0.0)  # the scan's initial carry
  for micro_batch in (tree([4.0, 2.0], [1.0, 3.0], 1.0), tree([2.0, 8.0], [2.0, 0.5], 2.0)):
    combined = fp8.accumulate_grads(combined, micro_batch)
  np.testing.assert_array_equal(combined["s"][...], [2.0, 2.0])
  np.testing.assert_array_equal(combined["h"][...], [2.0, 3.0])
  assert float(combined["w"][...]) == 3.0


def test_delayed_scaling_returns_the_new_state_as_its_gradient():
  """The step quantizes with the kept scales; the "gradients" of the state
  are the histories with this step's amaxes rolled in, and the scales
  fmax / (each history's maximum)."""
  x_NK, w_KM = _operands()
  scales = jnp.array([100.0, 1000.0, 1e4])
  history = jnp.array([[8.0, 0.0], [0.01, 0.0], [0.0, 0.0]])
  y = fp8.delayed_matmul(x_NK, w_KM, scales, history, jnp.float32)
  qx, qw = fp8.quantize(x_NK, 100.0, fp8.E4M3), fp8.quantize(w_KM, 1000.0, fp8.E4M3)
  np.testing.assert_array_equal(y, jnp.dot(qx.astype(jnp.float32), qw.astype(jnp.float32))
                                / 1e5)
  g_NM = jnp.ones((32, 8))
  _, vjp = jax.vjp(lambda s, h: fp8.delayed_matmul(x_NK, w_KM, s, h, jnp.float32),
                   scales, history)
  new_scales, new_history = vjp(g_NM)
  amaxes = [float(jnp.abs(x_NK).max()), float(jnp.abs(w_KM).max()), 1.0]
  np.testing.assert_allclose(new_history, [[amaxes[0], 8.0], [amaxes[1], 0.01], [1.0, 0.0]])
  np.testing.assert_allclose(new_scales, [E4M3_MAX / max(amaxes[0], 8.0),
                                          E4M3_MAX / max(amaxes[1], 0.01), E5M2_MAX / 1.0],
                             rtol=1e-6)


def _delayed_model_config():
  m = model_config()
  m.update(fp8="delayed", fp8_history=4)
  return m


def _meta(params) -> dict:
  """Each `Fp8Meta` of a one-layer model by its path (the scanned stack's
  `layers` axis dropped)."""
  return {path: np.asarray(v[...])[0] for path, v in nnx.to_flat_state(params)
          if isinstance(v, fp8.Fp8Meta)}


@functools.cache
def _adamw_steps(accum_steps: int = 1):
  """(initial state, state after 2 AdamW steps, the optimizer) of a one-layer
  model under model.fp8=delayed on `next_token_batch()`."""
  c = run_config("unused")
  c.model = _delayed_model_config()
  tx = model_optimizer(c)
  graphdef, params = nnx.split(build_model(c.model, nnx.Rngs(0)))
  step = jit_train_step(graphdef, tx, optax.constant_schedule(1e-2), "next_token", accum_steps)
  first = init_state(params, tx, 0)
  before = jax.device_get(first)
  state = first
  for _ in range(2):
    state, _ = step(state, next_token_batch())
  return before, jax.device_get(state), tx


def test_the_train_step_overwrites_the_state_and_the_optimizer_leaves_it_alone():
  before, after, _ = _adamw_steps()
  meta_before, meta_after = _meta(before["params"]), _meta(after["params"])
  # q, k, v, o and the MLP's gate, up and down: each a scale and a history.
  assert len(meta_before) == 2 * 7
  for path, history in meta_after.items():
    if path[-1] == "amax_history":
      assert history.shape == (3, 4)
      assert (history[:, :2] > 0).all() and (history[:, 2:] == 0).all()
      scales = meta_after[(*path[:-1], "scales")]
      np.testing.assert_allclose(scales, fp8.FMAX_3 / history.max(axis=1), rtol=1e-6)
  # No optimizer moments for the state (a [layers, 3] scale, a [layers, 3, 4] history).
  moments = [np.asarray(x) for x in jax.tree.leaves(after["opt_state"])]
  assert moments and not any(m.shape in ((1, 3), (1, 3, 4)) for m in moments)


@pytest.mark.slow
def test_micro_batches_roll_in_the_steps_amax_once():
  """With two micro-batches the history gains one entry per step, the larger
  micro-batch amax, and the scales follow the histories' maxima."""
  _, whole, _ = _adamw_steps()
  _, accumulated, _ = _adamw_steps(accum_steps=2)
  meta = _meta(accumulated["params"])
  for path, history in meta.items():
    if path[-1] == "amax_history":
      assert (history[:, :2] > 0).all() and (history[:, 2:] == 0).all()
      # The forward amaxes of the first step are the whole batch's.
      np.testing.assert_allclose(history[:2, 1], _meta(whole["params"])[path][:2, 1], rtol=1e-5)
      np.testing.assert_allclose(meta[(*path[:-1], "scales")], fp8.FMAX_3 / history.max(axis=1),
                                 rtol=1e-6)


def test_a_stopped_run_resumes_to_the_same_scales_and_histories(tok_dir, tmp_path,
                                                                 monkeypatch):
  """train.py under model.fp8=delayed: a run stopped at step 3 and resumed
  ends with the straight run's parameters, scales and amax histories, bit
  for bit."""
  c = run_config(tok_dir)
  c.model.update(fp8="delayed", fp8_history=4)
  (step_a, params_a), (step_b, params_b) = straight_and_stopped(c, tmp_path, monkeypatch)
  assert step_a == step_b == 6
  assert_trees_equal(params_a, params_b)
  history = np.asarray(params_a["decoder"]["layers"]["mlp"]["up"]["fp8"]["amax_history"]["value"])
  assert (history > 0).all()  # six steps filled all four entries


def test_mistakes_are_one_line():
  c = run_config("unused")
  for field, value, message in [
      ("fp8", "e4m3", "model.fp8='e4m3': must be one of none, current, delayed"),
      ("fp8_history", 0, "model.fp8_history=0: must be a positive integer")]:
    c.model[field] = value
    with pytest.raises(UserError, match="^config field " + message.replace("(", r"\(")):
      validate(c)
    c.model[field] = {"fp8": "none", "fp8_history": 16}[field]


AMPERE = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                               compute_capability="8.0")


def test_a_gpu_without_fp8_tensor_cores_is_refused():
  with pytest.raises(UserError) as err:
    fp8.check_backend(AMPERE, "delayed")
  assert str(err.value) == ("model.fp8=delayed: NVIDIA A100-SXM4-80GB (compute capability 8.0) "
                            "has no FP8 tensor cores (sm_89 or later: Ada, Hopper); use "
                            "model.fp8=none")
  fp8.check_backend(AMPERE, "none")
  for ok in (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                   compute_capability="9.0"),
             types.SimpleNamespace(platform="cpu", device_kind="cpu")):
    fp8.check_backend(ok, "current")


def test_the_model_asks_before_its_first_fp8_product(monkeypatch):
  """A projection under model.fp8 checks the device the program is compiled
  for (`model.layers.compile_device`) as it is traced: the UserError that
  train.py prints as one line, exit 2."""
  m = model_config()
  m.update(fp8="current")
  model = build_model(m, nnx.Rngs(0))
  monkeypatch.setattr("model.layers.compile_device", lambda: AMPERE)
  with pytest.raises(UserError, match=r"^model.fp8=current: NVIDIA A100-SXM4-80GB"):
    model(jnp.zeros((1, 8), jnp.int32))


def _config(**model):
  c = run_config("unused")
  c.model.update(**model)
  return c


def test_a_resume_that_changes_the_scaling_state_is_refused():
  """model.fp8 none -> delayed, or another history length, changes the
  checkpoint's tree: one line, not a "damaged" checkpoint; none <-> current
  keep it."""
  none, current = _config(fp8="none"), _config(fp8="current")
  workdir.check_same_shapes(none, current, "run")
  for saved, now in [(none, _config(fp8="delayed")),
                     (_config(fp8="delayed", fp8_history=4), _config(fp8="delayed"))]:
    with pytest.raises(UserError, match=r"^workdir run holds a model of other shapes: model.fp8"):
      workdir.check_same_shapes(saved, now, "run")


def test_restore_from_a_run_without_the_state_starts_it_fresh(capsys):
  """train.restore_from a bf16 run into model.fp8=delayed takes its
  parameters and starts the scaling state fresh, saying so in one line."""
  def params(**model):
    return nnx.split(nnx.eval_shape(lambda: build_model(_config(**model).model,
                                                        nnx.Rngs(0))))[1]

  loop._check_source_shapes(_config(fp8="delayed"), "train.restore_from='bf16'",
                            params(fp8="none"), params(fp8="delayed"))
  assert capsys.readouterr().out == (
      "train.restore_from='bf16': the FP8 scaling state (model.fp8=delayed) starts fresh, "
      "scales 1 and empty amax histories: the source's is missing or of other shapes\n")
  loop._check_source_shapes(_config(fp8="delayed"), "w", params(fp8="delayed"),
                            params(fp8="delayed"))
  assert capsys.readouterr().out == ""
