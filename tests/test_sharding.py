"""Sharding on 8 CPU devices: meshes, rules, parameter and batch shardings.

JAX fixes its device count when it first initialises, and other test files in
the same pytest process import it first, so each check runs in a fresh Python
with 8 host devices and prints its measurements as one JSON line.
"""
import json

import pytest

from tests.helpers import json_on_cpu_devices

PRELUDE = """
import json
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import base
from configs.errors import UserError
from model import build_model
from training import sharding

RULES = base.get_config().mesh.rules


def mesh_cfg(data, fsdp, tensor):
  c = base.get_config().mesh
  c.update(data=data, fsdp=fsdp, tensor=tensor)
  return c


def small_model():
  c = base.get_config().model
  c.update(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128,
           max_len=32, attention_impl="reference")
  return c


def flat(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
          for path, leaf in leaves}


def error(fn):
  try:
    fn()
  except UserError as e:
    return str(e)
  return None
"""


def run_on_8_devices(code: str) -> dict:
  """Runs PRELUDE + `code` in a fresh Python with 8 CPU devices; its JSON line."""
  return json_on_cpu_devices(PRELUDE + code, 8)


MESH_CHECKS = """
out = {"devices": jax.device_count()}
out["shapes"] = [list(sharding.make_mesh(mesh_cfg(*s)).devices.shape)
                 for s in [(2, 2, 2), (1, 8, 1), (8, 1, 1), (-1, 2, 1), (2, -1, 2), (1, 1, -1)]]
out["names"] = list(sharding.make_mesh(mesh_cfg(2, 2, 2)).axis_names)
out["one_device"] = list(sharding.make_mesh(mesh_cfg(1, 1, 1), jax.devices()[:1]).devices.shape)
out["bad_product"] = error(lambda: sharding.make_mesh(mesh_cfg(2, 2, 3)))
out["bad_rest"] = error(lambda: sharding.make_mesh(mesh_cfg(3, -1, 1)))
out["two_rest"] = error(lambda: sharding.make_mesh(mesh_cfg(-1, -1, 1)))

abstract = nnx.state(nnx.eval_shape(lambda: build_model(small_model(), nnx.Rngs(0))))
layer = "decoder/layers/"  # scanned (the default): every layer stacked, [layers, ...]


def specs(shape, rules=RULES):
  s = flat(sharding.param_partition_specs(abstract, sharding.make_mesh(mesh_cfg(*shape)), rules))
  return {name: list(s[name + "/value"]) for name in (
      "decoder/embed/embedding", layer + "mlp/up/kernel", layer + "mlp/down/kernel",
      layer + "attn/q_proj/kernel", layer + "attn/k_proj/kernel", layer + "attn/o_proj/kernel",
      layer + "norm_mlp/scale")}


out["specs_222"] = specs((2, 2, 2))
out["specs_118"] = specs((1, 1, 8))
out["specs_same_axis_twice"] = specs((1, 1, 8), (("embed", "tensor"), ("mlp", "tensor")))
out["bad_logical"] = error(lambda: specs((2, 2, 2), (("embd", "fsdp"),)))
out["bad_axis"] = error(lambda: specs((2, 2, 2), (("embed", "model"),)))
out["twice"] = error(lambda: specs((2, 2, 2), (("embed", "fsdp"), ("embed", None))))

mesh = sharding.make_mesh(mesh_cfg(2, 2, 2))
batch = sharding.shard_batch({"inputs": np.zeros((8, 16), np.int32)}, mesh)
out["batch_spec"] = list(batch["inputs"].sharding.spec)
out["batch_shard"] = list(batch["inputs"].addressable_shards[0].data.shape)
out["bad_batch"] = error(lambda: sharding.shard_batch({"inputs": np.zeros((6, 16))}, mesh))
print(json.dumps(out))
"""


def test_meshes_rules_and_batches():
  out = run_on_8_devices(MESH_CHECKS)
  assert out["devices"] == 8
  assert out["shapes"] == [[2, 2, 1, 1, 2], [1, 8, 1, 1, 1], [8, 1, 1, 1, 1], [4, 2, 1, 1, 1],
                           [2, 2, 1, 1, 2], [1, 1, 1, 1, 8]]
  assert out["names"] == ["data", "fsdp", "expert", "context", "tensor"]
  assert out["one_device"] == [1, 1, 1, 1, 1]
  for key in ("bad_product", "bad_rest"):
    assert "mesh.data" in out[key] and "mesh.tensor" in out[key], out[key]
    assert "8 devices" in out[key], out[key]
  assert "mesh.data=2 x mesh.fsdp=2 x mesh.tensor=3 multiply to 12" in out["bad_product"]
  assert "at most one" in out["two_rest"]

  s = out["specs_222"]
  assert s["decoder/embed/embedding"] == ["tensor", "fsdp"]
  assert s["decoder/layers/mlp/up/kernel"] == [None, "fsdp", "tensor"]
  assert s["decoder/layers/mlp/down/kernel"] == [None, "tensor", "fsdp"]
  assert s["decoder/layers/attn/q_proj/kernel"] == [None, "fsdp", "tensor", None]
  assert s["decoder/layers/attn/k_proj/kernel"] == [None, "fsdp", "tensor", None]
  assert s["decoder/layers/attn/o_proj/kernel"] == [None, "tensor", None, "fsdp"]
  assert s["decoder/layers/norm_mlp/scale"] == [None, None]
  # 2 KV heads do not split 8 ways: replicated; 4 query heads neither; d_ff=128 does.
  s = out["specs_118"]
  assert s["decoder/layers/attn/k_proj/kernel"] == [None, "fsdp", None, None]
  assert s["decoder/layers/attn/q_proj/kernel"] == [None, "fsdp", None, None]
  assert s["decoder/layers/mlp/up/kernel"] == [None, "fsdp", "tensor"]
  # A mesh axis shards at most one dimension of a parameter.
  assert out["specs_same_axis_twice"]["decoder/layers/mlp/up/kernel"] == [None, "tensor", None]
  assert "mesh.rules" in out["bad_logical"] and "'embd'" in out["bad_logical"]
  assert "mesh.rules" in out["bad_axis"] and "'model'" in out["bad_axis"]
  assert "twice" in out["twice"]

  assert out["batch_spec"] == [["data", "fsdp", "expert"]]
  assert out["batch_shard"] == [2, 16]
  assert "6 rows" in out["bad_batch"] and "multiple of 4" in out["bad_batch"]


MODEL_CHECKS = """
cfg = small_model()
tokens = np.random.RandomState(0).randint(0, 256, (8, 17)).astype(np.int32)
host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
reference_logits = np.asarray(build_model(cfg, nnx.Rngs(0))(jnp.asarray(host_batch["inputs"])))
tx = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
out = {}


def sharded_params(mesh):
  # Each parameter created directly in its shards: jit with their shardings as
  # out_shardings, as training/loop.py creates its train state.
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(build_model(cfg, nnx.Rngs(0))),
                   out_shardings=sharding.state_shardings(abstract, mesh, RULES))()
  return graphdef, params


def train_losses(name, mesh):
  graphdef, params = sharded_params(mesh)
  param_sh = sharding.state_shardings(params, mesh, RULES)
  opt_sh = sharding.opt_state_shardings(jax.eval_shape(tx.init, params), params, mesh, RULES)
  batch_sh = sharding.batch_sharding(mesh)
  batch = sharding.shard_batch(host_batch, mesh)
  flat_params, flat_sh = flat(params), flat(param_sh)
  out[name] = {
      "placed": all(flat_params[k].sharding.is_equivalent_to(flat_sh[k], flat_params[k].ndim)
                    for k in flat_params),
      "specs": {k: list(flat_params[k].sharding.spec) for k in (
          "decoder/embed/embedding/value", "decoder/layers/mlp/up/kernel/value")},
      "shards": {k: [list(flat_params[k].shape),
                     list(flat_params[k].addressable_shards[0].data.shape)] for k in (
          "decoder/embed/embedding/value", "decoder/layers/mlp/up/kernel/value")},
  }
  logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, batch["inputs"])
  out[name]["logits_diff"] = float(np.abs(np.asarray(logits) - reference_logits).max())

  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(batch["inputs"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, in_shardings=(param_sh, opt_sh, {"inputs": batch_sh, "targets": batch_sh}),
                 out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())))
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  flat_opt = flat(opt_state)
  out[name]["opt"] = {k: list(v.sharding.spec) for k, v in flat_opt.items()
                      if k.endswith("mu/decoder/layers/mlp/up/kernel/value")
                      or k.endswith("count")}
  losses = []
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  out[name]["losses"] = losses


train_losses("one", sharding.make_mesh(mesh_cfg(1, 1, 1), jax.devices()[:1]))
train_losses("222", sharding.make_mesh(mesh_cfg(2, 2, 2)))
train_losses("181", sharding.make_mesh(mesh_cfg(1, 8, 1)))
print(json.dumps(out))
"""


def test_sharded_model_matches_one_device():
  out = run_on_8_devices(MODEL_CHECKS)
  embedding, up = "decoder/embed/embedding/value", "decoder/layers/mlp/up/kernel/value"
  for name in ("one", "222", "181"):
    assert out[name]["placed"], name
    assert out[name]["logits_diff"] < 1e-5, (name, out[name]["logits_diff"])
  assert out["222"]["specs"] == {embedding: ["tensor", "fsdp"], up: [None, "fsdp", "tensor"]}
  assert out["222"]["shards"] == {embedding: [[256, 64], [128, 32]],
                                  up: [[2, 64, 128], [2, 32, 64]]}
  assert out["181"]["shards"] == {embedding: [[256, 64], [256, 8]],
                                  up: [[2, 64, 128], [2, 8, 128]]}
  for name in ("222", "181"):
    opt = out[name]["opt"]
    assert [spec for k, spec in opt.items() if k.endswith("kernel/value")] == [
        out[name]["specs"][up]], opt
    assert all(spec == [] for k, spec in opt.items() if k.endswith("count")), opt
    for loss, reference in zip(out[name]["losses"], out["one"]["losses"]):
      assert abs(loss - reference) <= 1e-5 * abs(reference), (name, out[name]["losses"],
                                                               out["one"]["losses"])
  assert out["one"]["losses"][2] < out["one"]["losses"][0]


# name: (mesh data, fsdp, tensor; query heads H, KV heads K): heads split both ways, query
# heads only (MQA; 2 KV heads on tensor=4), heads whole (tensor does not divide H).
PALLAS_CASES = {"both": ((2, 2, 2), 4, 2), "mqa": ((2, 1, 4), 4, 1), "query": ((1, 2, 4), 8, 2),
                "whole": ((4, 1, 2), 3, 3)}
PALLAS_CHECKS = """
from model import attention as attn

rng = np.random.RandomState(0)
out = {}
for name, (mesh_shape, H, K) in CASES.items():
  B, T, D = 8, 16, 16
  q = jnp.asarray(rng.randn(B, T, H, D), jnp.float32)
  k, v = (jnp.asarray(rng.randn(B, T, K, D), jnp.float32) for _ in range(2))
  segments = jnp.asarray(np.repeat(rng.randint(1, 3, (B, 1)), T, 1) * (rng.rand(B, T) < 0.9),
                         jnp.int32)

  def loss(q, k, v, segments, implementation):
    o = attn.attention(q, k, v, causal=True, segment_ids=segments,
                       implementation=implementation)
    return (o * jnp.cos(o)).sum()

  grads = jax.grad(loss, argnums=(0, 1, 2))
  reference = grads(q, k, v, segments, "reference")
  mesh = sharding.make_mesh(mesh_cfg(*mesh_shape))

  def sharded(q, k, v, segments):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return grads(q, k, v, segments, "pallas")

  batch = NamedSharding(mesh, P(("data", "fsdp")))
  step = jax.jit(sharded, in_shardings=batch)
  got = step(q, k, v, segments)
  out[name] = {"diff": max(float(jnp.abs(a - b).max()) for a, b in zip(got, reference)),
               "shard_map": "shard_map" in str(jax.make_jaxpr(sharded)(q, k, v, segments))}
with jax.sharding.use_abstract_mesh(sharding.make_mesh(mesh_cfg(1, 1, 8)).abstract_mesh):
  out["bad_heads"] = error(lambda: attn.kernel_head_split(8, 3, 8))
with jax.sharding.use_abstract_mesh(sharding.make_mesh(mesh_cfg(2, 4, 1)).abstract_mesh):
  out["bad_rows"] = error(lambda: jax.eval_shape(lambda x: attn.attention(
      x, x, x, implementation="pallas"), jax.ShapeDtypeStruct((2, 16, 8, 16), jnp.float32)))
print(json.dumps(out))
"""


@pytest.mark.parametrize("cases", [
    ("query", "whole"),
    pytest.param(tuple(PALLAS_CASES), marks=pytest.mark.slow)])
def test_pallas_kernels_run_under_shard_map(cases):
  """Our kernels (interpreted) on 8 devices, each on its own rows and heads
  (`shard_map`), forward and backward, against the reference; heads split
  both ways also in tests/test_sharded_training.py."""
  code = f"CASES = {json.dumps({name: PALLAS_CASES[name] for name in cases})}\n" + PALLAS_CHECKS
  out = run_on_8_devices(code)
  for name in cases:
    assert out[name]["shard_map"], name
    assert out[name]["diff"] < 1e-4, (name, out[name])
  assert "mesh.tensor=8" in out["bad_heads"] and "num_kv_heads" in out["bad_heads"]
  assert "2 rows" in out["bad_rows"] and "data x fsdp" in out["bad_rows"]
