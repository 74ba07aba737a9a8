"""Optimizers and schedules (training/optim.py): adamw is the optimizer of
before, bit for bit; each schedule follows its formula and the start-up line
says so; Muon takes exactly the hidden matrices and orthogonalises each
layer's by itself; every optimizer trains, and stops and resumes
bit-identically; a WSD decay branched from a stable-phase checkpoint
(train.restore_branch) continues the schedule."""
import functools
import math
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from model import accounting, build_model
from training import loop, optim, startup
from training.metrics import read_metrics
from training.steps import init_state, jit_train_step
from tests.helpers import assert_trees_equal, final_params, small_cfg, small_config


def train_config(**train):
  c = base.get_config()
  c.train.update(**train)
  return c


def random_tree(tree, seed: int):
  """Normal draws shaped as the leaves of `tree`, float32."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), tree)


def random_params(model_cfg, seed: int = 0):
  """Parameters of `model_cfg`'s shapes, drawn without building the model."""
  _, abstract = nnx.split(nnx.eval_shape(lambda: build_model(model_cfg, nnx.Rngs(0))))
  return random_tree(abstract, seed)


def test_adamw_is_the_optimizer_of_before_bit_for_bit():
  t = train_config(warmup_steps=2, num_steps=4).train
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.num_steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)
  before = optax.chain(optax.clip_by_global_norm(t.grad_clip), optax.adamw(
      schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  params = random_params(small_cfg(num_layers=2, scan_layers=False))  # no [heads, D] biases
  runs = []
  for tx in (before, optim.make_optimizer(t)):
    p, state, update = params, tx.init(params), jax.jit(tx.update)
    for step in range(4):
      updates, state = update(random_tree(p, step), state, p)
      p = optax.apply_updates(p, updates)
    runs.append((p, state))
  assert_trees_equal(runs[0], runs[1])
  assert t.optimizer == "adamw" and t.schedule == "cosine"


def test_weight_decay_takes_the_same_parameters_scanned_or_looped():
  """Matrices and embeddings decay; norms and biases (q/k/v's [heads, head_dim]
  too) do not, also when a scanned stack gives them a leading layers axis."""
  masks = {}
  for scan in (True, False):
    cfg = small_cfg(num_layers=2, scan_layers=scan, use_bias=True)
    masks[scan] = {optim._name(path).replace("layers/0/", "layers/"): decays
                   for path, decays in jax.tree_util.tree_leaves_with_path(
                       optim.decay_mask(random_params(cfg)))
                   if "layers/1/" not in optim._name(path)}
  assert masks[True] == masks[False]
  assert masks[True]["decoder/layers/attn/q_proj/kernel"]
  assert not masks[True]["decoder/layers/attn/q_proj/bias"]
  assert not any(decays for name, decays in masks[True].items() if "norm" in name)


PEAK, END, W, N = 2e-3, 2e-4, 10, 100  # learning_rate, its min_lr_ratio 0.1, warm-up, steps
FORMULAS = {  # the learning rate after warm-up at step count s, as docs/training.md writes it
    "cosine": lambda s: END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * (s - W) / (N - W))),
    "linear": lambda s: PEAK + (END - PEAK) * (s - W) / (N - W),
    "constant": lambda s: PEAK,
    "inverse_sqrt": lambda s: PEAK * math.sqrt(W / s),
    "wsd": lambda s: PEAK + (END - PEAK) * max(s - 80, 0) / 20,  # decay_fraction 0.2: from 80
}


@pytest.mark.parametrize("name", FORMULAS)
def test_each_schedule_follows_its_formula(name):
  t = train_config(learning_rate=PEAK, min_lr_ratio=0.1, warmup_steps=W, num_steps=N,
                   schedule=name).train
  schedule = optim.learning_rate_schedule(t)
  steps = [0, 1, 5, 9, 10, 11, 50, 79, 80, 81, 90, 99]
  expected = [PEAK * s / W if s < W else FORMULAS[name](s) for s in steps]
  np.testing.assert_allclose([float(schedule(s)) for s in steps], expected, rtol=2e-6)


def test_wsd_holds_then_decays_linearly_over_its_last_fraction():
  t = train_config(learning_rate=1.0, min_lr_ratio=0.1, warmup_steps=10, num_steps=100,
                   schedule="wsd", decay_fraction=0.25).train
  schedule = optim.learning_rate_schedule(t)
  np.testing.assert_allclose([float(schedule(s)) for s in (0, 5, 10, 40, 75, 80, 95, 99, 100)],
                             [0, 0.5, 1, 1, 1, 0.82, 0.28, 0.136, 0.1], rtol=1e-6)


@pytest.mark.parametrize("name,tail", [
    ("cosine", ", then a cosine decay to 0.000201 at step 100"),
    ("linear", ", then a linear decay to 0.00022 at step 100"),
    ("constant", ", then constant"),
    ("inverse_sqrt", ", then an inverse-sqrt decay to 0.000636 at step 100"),
    ("wsd", ", held to step 81, then a linear decay to 0.00029 at step 100"),
])
def test_the_schedule_line_says_where_it_peaks_and_what_follows(name, tail):
  c = train_config(learning_rate=PEAK, min_lr_ratio=0.1, warmup_steps=W, num_steps=N,
                   schedule=name)
  line = startup.schedule_line(c, optim.learning_rate_schedule(c.train))
  assert line == f"schedule    learning rate peaks at 0.002 at step 11/100{tail}"


# Muon: which parameters, and how it sees them.

HIDDEN = {"attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/up", "mlp/gate",
          "mlp/down"}


def labels_by_name(model_cfg) -> dict:
  _, params = nnx.split(nnx.eval_shape(lambda: build_model(model_cfg, nnx.Rngs(0))))
  return {optim._name(path): label for path, label in  # pylint: disable=protected-access
          jax.tree_util.tree_flatten_with_path(optim.muon_labels(params))[0]}


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_embedding_lr_mult_scales_the_input_weights_updates_and_nothing_else(pos_emb):
  params = random_params(small_cfg(num_layers=2, pos_emb=pos_emb, tie_embeddings=True))
  grads = random_tree(params, 1)
  txs = [optim.make_optimizer(train_config(embedding_lr_mult=mult).train) for mult in (1.0, 0.25)]
  updates = [tx.update(grads, tx.init(params), params)[0] for tx in txs]
  picked = []
  for (path, plain), scaled in zip(jax.tree_util.tree_flatten_with_path(updates[0])[0],
                                   jax.tree.leaves(updates[1])):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if optim.is_input_weight(path, plain):
      picked.append(name)
      np.testing.assert_allclose(scaled, 0.25 * plain, rtol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(scaled, plain, err_msg=name)
  table = ["decoder/positions/table/value"] if pos_emb == "learned" else []
  assert sorted(picked) == sorted(["decoder/embed/embedding/value"] + table)


@pytest.mark.parametrize("scan", [True, False])
def test_muon_takes_the_block_kernels_and_adamw_the_rest(scan):
  labels = labels_by_name(small_cfg(scan_layers=scan, tie_embeddings=False))
  layers = ["decoder/layers"] if scan else ["decoder/layers/0", "decoder/layers/1"]
  assert {n for n, l in labels.items() if l == "muon"} == {
      f"{layer}/{name}/kernel" for layer in layers for name in HIDDEN}
  assert {"decoder/embed/embedding", "decoder/final_norm/scale", "head/kernel",
          f"{layers[0]}/norm_attn/scale"} <= {n for n, l in labels.items() if l == "adamw"}


def test_muon_leaves_biases_norms_and_the_heads_of_an_encoder_to_adamw():
  labels = labels_by_name(small_cfg(
      family="encoder", use_bias=True, qk_norm=True, pos_emb="learned", type_vocab_size=2,
      embedding_norm=True, head_transform=True, output_bias=True, tie_embeddings=False))
  hidden = {f"encoder/layers/{name}/kernel" for name in HIDDEN}
  assert {n for n, l in labels.items() if l == "muon"} == hidden
  assert len(labels) - len(hidden) == 21  # biases, norms, tables, the head and its transform


def muon_tree(layers: int):
  """Per-layer ("0", "1", ...) kernels of a 2-layer block, or with layers=0 the
  same stacked on a leading axis as a scanned stack holds them."""
  d, h, dh, f = 8, 2, 4, 12
  shapes = {"q_proj": (d, h, dh), "o_proj": (h, dh, d), "up": (d, f)}
  block = lambda lead: {name: {"kernel": jnp.zeros(lead + s)} for name, s in shapes.items()}
  if layers:
    return {"decoder": {"layers": {str(i): block(()) for i in range(layers)}}}
  return {"decoder": {"layers": block((2,))}}


def test_muon_orthogonalises_each_layers_matrix_as_optax_muon_does():
  """The update of each layer's [input, output] matrix (o_proj's input is
  [heads, head_dim]) is optax.contrib.muon's of that 2-D matrix, in a scanned
  stack as in a per-layer one."""
  t = train_config(optimizer="muon", warmup_steps=0, schedule="constant", weight_decay=0.0,
                   grad_clip=0.0, learning_rate=0.02).train
  stacked = random_tree(muon_tree(0), 0)
  per_layer = {"decoder": {"layers": {str(i): jax.tree.map(lambda x, i=i: x[i],
                                                           stacked["decoder"]["layers"])
                                      for i in range(2)}}}
  grads = random_tree(stacked, 1)
  grads_per_layer = {"decoder": {"layers": {str(i): jax.tree.map(lambda x, i=i: x[i],
                                                                 grads["decoder"]["layers"])
                                            for i in range(2)}}}

  @functools.partial(jax.jit, static_argnums=0)
  def updates(tx, params, grads):
    return tx.update(grads, tx.init(params), params)[0]

  ours_stacked = updates(optim.make_optimizer(t), stacked, grads)
  ours = updates(optim.make_optimizer(t), per_layer, grads_per_layer)
  reference = optax.contrib.muon(0.02, consistent_rms=0.2)
  for i in range(2):
    for name, kernel in grads_per_layer["decoder"]["layers"][str(i)].items():
      inputs = 2 if name == "o_proj" else 1
      matrix = lambda x, inputs=inputs: x["kernel"].reshape(
          math.prod(x["kernel"].shape[:inputs]), -1)
      expected = updates(reference, matrix(per_layer["decoder"]["layers"][str(i)][name]),
                         matrix(kernel))
      got = ours["decoder"]["layers"][str(i)][name]
      np.testing.assert_allclose(matrix(got), expected, rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(ours_stacked["decoder"]["layers"][name]["kernel"][i],
                                 got["kernel"], rtol=1e-5, atol=1e-7)


# Every optimizer and schedule trains.

def fixed_batch(rows: int = 8, length: int = 16, vocab: int = 64) -> dict:
  tokens = np.random.default_rng(0).integers(1, vocab, (rows, length + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": np.ones((rows, length), np.float32),
          "segment_ids": np.ones((rows, length), np.int32),
          "positions": np.arange(length, dtype=np.int32)[None].repeat(rows, 0)}


@pytest.mark.parametrize("optimizer,schedule,lr", [
    pytest.param("adafactor", "linear", 0.3, marks=pytest.mark.slow),  # steps relative to RMS
    pytest.param("muon", "wsd", 1e-2, marks=pytest.mark.slow),  # fast: the resume test's muon
    pytest.param("lion", "constant", 3e-3, marks=pytest.mark.slow),
    pytest.param("adamw", "cosine", 1e-2, marks=pytest.mark.slow),
    pytest.param("adamw", "inverse_sqrt", 1e-2, marks=pytest.mark.slow)])
def test_every_optimizer_and_schedule_trains(optimizer, schedule, lr):
  c = train_config(optimizer=optimizer, schedule=schedule, learning_rate=lr, warmup_steps=2,
                   num_steps=12)
  if optimizer == "adafactor":
    c.train.adafactor_min_dim_to_factor = 16  # the tiny model's matrices are factored too
  graphdef, params = nnx.split(build_model(small_cfg(num_layers=1), nnx.Rngs(0)))
  tx = optim.make_optimizer(c.train)
  step = jit_train_step(graphdef, tx, optim.learning_rate_schedule(c.train), "next_token", 1)
  state, batch, losses = init_state(params, tx, 0), fixed_batch(), []
  for _ in range(c.train.num_steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert int(state["bad_step"]) == -1
  assert losses[-1] < losses[0] - 0.5, losses


def test_adafactor_factors_the_second_moments_of_large_matrices():
  c = train_config(optimizer="adafactor", adafactor_min_dim_to_factor=16)
  params = random_params(small_cfg(num_layers=1))
  sizes = [x.size for x in jax.tree.leaves(optim.make_optimizer(c.train).init(params))]
  assert sum(sizes) < sum(x.size for x in jax.tree.leaves(params)) // 2


def test_the_memory_estimate_counts_each_optimizers_moments():
  state = {name: accounting.training_memory_bytes(train_config(optimizer=name))["optimizer_state"]
           for name in ("adamw", "lion", "muon", "adafactor")}
  n = accounting.formula_params(base.get_config().model)["params_total"]
  assert state["adamw"] == 8 * n and state["lion"] == state["adafactor"] == 4 * n
  assert state["lion"] < state["muon"] < state["adamw"]


# Stop and resume, bit for bit; a WSD decay branched from a stable phase.

def stop_at(monkeypatch, stop_step: int) -> None:
  """The next run stops at `stop_step` as on SIGTERM: it saves and raises
  `loop.Stopped` (train.py's exit status 143)."""
  def should_stop(self, step):
    if step == stop_step:
      self.signum = signal.SIGTERM
    return self.signum is not None
  monkeypatch.setattr(loop.StopRequest, "should_stop", should_stop)


def straight_and_stopped(config, tmp_path, monkeypatch, stop_step: int = 3):
  """`config` trained straight (tmp_path/straight) and stopped at
  `stop_step` as on SIGTERM (exit status 143, a checkpoint of that step),
  then resumed to the end (tmp_path/stopped): each run's final (step,
  parameters), straight first."""
  loop.train(config, str(tmp_path / "straight"))
  with monkeypatch.context() as patch:
    stop_at(patch, stop_step)
    with pytest.raises(loop.Stopped) as stopped:
      loop.train(config, str(tmp_path / "stopped"))
  assert stopped.value.exit_status == 143
  assert final_params(tmp_path / "stopped")[0] == stop_step
  loop.train(config, str(tmp_path / "stopped"))
  return tuple(final_params(tmp_path / name) for name in ("straight", "stopped"))


def run_config(tok_dir, **train):
  c = small_config(tok_dir)
  c.train.update(**{**dict(num_steps=6, warmup_steps=2, checkpoint_every=100, log_every=1,
                           eval_every=100, eval_steps=1), **train})
  return c


@pytest.mark.parametrize("optimizer,schedule,parametrization", [
    pytest.param("adamw", "cosine", "sp", marks=pytest.mark.slow),  # as tests/test_train.py's
    ("muon", "wsd", "sp"),
    pytest.param("adafactor", "linear", "sp", marks=pytest.mark.slow),
    pytest.param("lion", "inverse_sqrt", "sp", marks=pytest.mark.slow),
    ("adamw", "cosine", "mup"),
    pytest.param("muon", "wsd", "mup", marks=pytest.mark.slow),
    pytest.param("adafactor", "linear", "mup", marks=pytest.mark.slow),
    pytest.param("lion", "inverse_sqrt", "mup", marks=pytest.mark.slow)])
def test_a_stopped_run_resumes_to_the_straight_runs_parameters_and_state(
    tok_dir, tmp_path, monkeypatch, optimizer, schedule, parametrization):
  """Under μP at width multiplier 2 (base width 16) too."""
  c = run_config(tok_dir, optimizer=optimizer, schedule=schedule)
  if parametrization == "mup":
    c.model.update(parametrization="mup", mup_base_width=c.model.d_model // 2)
  (step_a, params_a), (step_b, params_b) = straight_and_stopped(c, tmp_path, monkeypatch)
  assert step_a == step_b == 6
  assert_trees_equal(params_a, params_b)


@pytest.fixture(scope="module")
def stable_run(tok_dir, tmp_path_factory):
  """A 4-step stable phase: warm-up over 2 steps, then constant; checkpoints at 2 and 4."""
  workdir = tmp_path_factory.mktemp("stable") / "run"
  loop.train(run_config(tok_dir, num_steps=4, schedule="constant", checkpoint_every=2),
             str(workdir))
  return workdir


def test_a_wsd_decay_branched_from_the_stable_phase_continues_the_schedule(
    tok_dir, stable_run, tmp_path, capsys):
  """4 stable steps, then a branch decaying over 4 more, equal the straight
  8-step wsd run: the branch continues the optimizer state, the step (so the
  schedule) and the data position."""
  wsd = dict(num_steps=8, schedule="wsd", decay_fraction=0.5)
  loop.train(run_config(tok_dir, **wsd), str(tmp_path / "straight"))
  capsys.readouterr()
  branch = run_config(tok_dir, **wsd, restore_from=str(stable_run), restore_branch=True)
  loop.train(branch, str(tmp_path / "branch"))
  assert (f"restored    step 4 of train.restore_from={stable_run}, branched: its optimizer "
          "state and data position, training to 8") in capsys.readouterr().out
  rates = {r["step"]: r["learning_rate"] for r in read_metrics(str(tmp_path / "branch"))
           if r["split"] == "train"}
  peak, end = 3e-3, 3e-4  # small_config's learning_rate, min_lr_ratio 0.1
  assert sorted(rates) == [5, 6, 7, 8]  # step k runs at step count k - 1; the decay from 4
  np.testing.assert_allclose([rates[k] for k in (5, 6, 7, 8)],
                             [peak + (end - peak) * (k - 1 - 4) / 4 for k in (5, 6, 7, 8)],
                             rtol=1e-6)
  (step_a, params_a), (step_b, params_b) = (final_params(tmp_path / name)
                                            for name in ("straight", "branch"))
  assert step_a == step_b == 8
  assert_trees_equal(params_a, params_b)


def test_a_branch_from_an_earlier_checkpoint_of_the_stable_phase(tok_dir, stable_run, tmp_path,
                                                                capsys):
  """train.restore_step picks the source's checkpoint of step 2, not its newest
  (4): the branch retrains steps 3-4 and decays over 5-8, ending where the
  straight wsd run ends."""
  wsd = dict(num_steps=8, schedule="wsd", decay_fraction=0.5)
  loop.train(run_config(tok_dir, **wsd), str(tmp_path / "straight"))
  capsys.readouterr()
  loop.train(run_config(tok_dir, **wsd, restore_from=str(stable_run), restore_branch=True,
                        restore_step=2), str(tmp_path / "branch"))
  assert f"restored    step 2 of train.restore_from={stable_run}, branched" in (
      capsys.readouterr().out)
  rates = [r["step"] for r in read_metrics(str(tmp_path / "branch")) if r["split"] == "train"]
  assert sorted(rates) == [3, 4, 5, 6, 7, 8]
  assert_trees_equal(final_params(tmp_path / "straight")[1],
                     final_params(tmp_path / "branch")[1])


@pytest.mark.parametrize("train,message", [
    (dict(restore_step=3), "no checkpoint at step 3; available: 2, 4"),
    (dict(optimizer="lion"), "train.restore_branch continues its optimizer state, which does "
     "not fit this run's (train.optimizer=adamw there, lion here;"),
    (dict(num_steps=4), "its step 4 is not before train.num_steps=4 (counted from its step 0)"),
    (dict(num_steps=8, schedule="wsd", decay_fraction=0.75),
     "its step 4 is past the start of this run's wsd decay, step 2 of train.num_steps=8"),
], ids=["no_such_step", "another_optimizer", "no_step_left", "decay_before_its_step"])
def test_a_branch_that_cannot_continue_is_one_line_and_writes_nothing(
    tok_dir, stable_run, tmp_path, train, message):
  c = run_config(tok_dir, **{"num_steps": 8, **train}, restore_from=str(stable_run),
                 restore_branch=True)
  with pytest.raises(UserError) as error:
    loop.train(c, str(tmp_path / "branch"))
  assert str(error.value).startswith(f"train.restore_from={str(stable_run)!r}: {message}")
  assert "\n" not in str(error.value)
  assert not (tmp_path / "branch").exists()
