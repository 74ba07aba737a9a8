"""Sharded training end to end: `training.loop.train` on 8 CPU devices.

Meshes (data, fsdp, tensor) = (2, 2, 2) and (1, 8, 1) give the train losses
of one device (the (2, 2, 2) run with attention_impl=pallas: our kernel in
the interpreter, each device on its rows and heads under `shard_map`, as on
a TPU or GPU), the saved parameters and optimizer moments are split across
the devices, and a checkpoint written on 8 devices is evaluated by a process
with one. JAX fixes its device count when it first initialises, so every run
is a fresh Python (as in tests/test_sharding.py) that prints one JSON line.
"""
import json

import pytest

from tests.helpers import json_on_cpu_devices
from training.metrics import read_metrics

STEPS = 6
UP = "decoder/layers/mlp/up/kernel/value"  # scanned: [layers=1, embed, mlp]

PRELUDE = """
import json
import sys

import jax

from tests.helpers import small_config
from training import loop

args = json.loads(sys.argv[1])


def config(mesh, attention_impl="xla"):
  c = small_config(args["tok"])
  c.model.attention_impl = attention_impl
  # 8 rows: the batch splits over data x fsdp = 8 devices of the (1, 8, 1) mesh.
  c.train.update(num_steps=args["steps"], batch_size=8, log_every=1, eval_every=args["steps"],
                 checkpoint_every=args["steps"])
  c.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
  return c
"""

# Trains on each 8-device mesh, then restores the last checkpoint onto that
# mesh the way the loop resumes and reports where the MLP kernel landed.
ON_8_DEVICES = PRELUDE + """
from flax import nnx

from model import build_model
from training.checkpoint import Checkpointer
from training.optim import make_optimizer
from training import sharding
from training.sharding import make_mesh
from training.steps import init_state

out = {"devices": jax.device_count()}
for name, mesh_shape in args["meshes"].items():
  c = config(mesh_shape, args["attention"].get(name, "xla"))
  workdir = args["workdirs"][name]
  loop.train(c, workdir)
  tx = make_optimizer(c.train)
  abstract = jax.eval_shape(
      lambda: init_state(nnx.state(build_model(c.model, nnx.Rngs(0))), tx, 0))
  shardings = sharding.train_state_shardings(abstract, make_mesh(c.mesh), c.mesh.rules)
  checkpointer = Checkpointer(workdir, asynchronous=False)
  state, _ = checkpointer.restore(args["steps"], sharding.with_shardings(abstract, shardings))
  checkpointer.close()
  leaves = {jax.tree_util.keystr(path, simple=True, separator="/"): x
            for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  kernel = leaves["params/" + args["up"]]
  [mu] = [x for path, x in leaves.items() if path.endswith("mu/" + args["up"])]
  out[name] = {"spec": list(kernel.sharding.spec),
               "shard": list(kernel.addressable_shards[0].data.shape),
               "mu_spec": list(mu.sharding.spec)}
print(json.dumps(out))
"""

# Trains the one-device reference, then evaluates it and the 8-device run.
ON_1_DEVICE = PRELUDE + """
from training.evaluate import run_eval

loop.train(config((1, 1, 1)), args["workdirs"]["one"])
out = {"devices": jax.device_count()}
for name in ("one", "222"):
  report = run_eval(args["workdirs"][name], max_new_tokens=4)
  out[name] = {"step": report["step"], "loss": report["loss"]}
print(json.dumps(out))
"""


def run_python(code: str, args: dict, devices: int) -> dict:
  """Runs `code` in a fresh Python with `devices` CPU devices; its JSON line."""
  return json_on_cpu_devices(code, devices, json.dumps(args))


def train_losses(workdir: str) -> list[float]:
  return [r["loss"] for r in read_metrics(workdir) if r["split"] == "train"]


@pytest.mark.slow  # over a minute on 2 CPU cores: make test-slow
def test_sharded_training_matches_one_device_and_evaluates_on_one(tok_dir, tmp_path):
  workdirs = {name: str(tmp_path / name) for name in ("one", "222", "181")}
  args = {"tok": tok_dir, "steps": STEPS, "workdirs": workdirs, "up": UP,
          "meshes": {"222": (2, 2, 2), "181": (1, 8, 1)}, "attention": {"222": "pallas"}}
  sharded = run_python(ON_8_DEVICES, args, devices=8)
  single = run_python(ON_1_DEVICE, args, devices=1)
  assert sharded["devices"] == 8 and single["devices"] == 1

  reference = train_losses(workdirs["one"])
  assert len(reference) == STEPS and reference[-1] < reference[0]
  for name in ("222", "181"):
    losses = train_losses(workdirs[name])
    assert len(losses) == STEPS, (name, losses)
    for loss, ref in zip(losses, reference):
      assert abs(loss - ref) <= 1e-4 * abs(ref), (name, losses, reference)

  # MLP up kernel [layers=1, embed=32, mlp=64]: layers whole, embed over fsdp,
  # mlp over tensor; Adam's first moment follows its parameter.
  assert sharded["222"] == {"spec": [None, "fsdp", "tensor"], "shard": [1, 16, 32],
                            "mu_spec": [None, "fsdp", "tensor"]}
  assert sharded["181"]["shard"] == [1, 4, 64]
  assert sharded["181"]["spec"][1] == "fsdp" == sharded["181"]["mu_spec"][1]

  # The 8-device checkpoint restores and evaluates on one device.
  assert single["222"]["step"] == single["one"]["step"] == STEPS
  assert abs(single["222"]["loss"] - single["one"]["loss"]) <= 1e-4 * single["one"]["loss"]
