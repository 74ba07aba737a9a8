"""SPMD sharding: the device mesh, parameter and batch shardings.

Every parameter carries logical axis names (`model/layers.py`); `mesh.rules`
in the config maps each name to one mesh axis or to None (replicated). The
mesh has five axes:

- `data`: batch split, parameters replicated (data parallelism).
- `fsdp`: batch split and parameters (and so optimizer state) split along
  `embed` (fully sharded data parallelism, ZeRO-3 style).
- `expert`: batch split and a mixture of experts' experts split (expert
  parallelism: each device holds num_experts / expert of them and tokens
  travel to their experts by all-to-all, `model/moe.py`); other parameters
  replicated over it, like `data`.
- `context`: each row's sequence split (context parallelism: a decoder's
  activations are [B, T / context, ...] per device and attention runs as a
  ring or an all-gather over the axis, `model/context_parallel.py`);
  parameters replicated over it, like `data`.
- `tensor`: heads, KV heads, MLP hidden and vocabulary split (tensor
  parallelism).

A dimension is sharded over its mesh axis only when the axis size divides it;
otherwise that dimension is replicated (for example 4 KV heads on tensor=8:
every tensor shard holds all 4 heads). A mesh axis is used at most once per
parameter: a second dimension mapped to the same axis is replicated. One
device is the trivial 1x1x1 mesh, on which every spec is a no-op.

The training loop creates its whole train state (parameters and optimizer
moments) under `jax.jit` with these shardings as `out_shardings`
(`training/loop.py`), so the full state never sits on one device.
"""
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from configs.errors import UserError
from model.layers import BATCH_AXES

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
# The logical names that parameters carry (model/layers.py).
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "expert",
                "latent", "layers")


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A ("data", "fsdp", "expert", "context", "tensor") mesh over `devices` (default: all
  devices).

  Args:
    mesh_cfg: the `mesh` config section; at most one of data, fsdp, tensor
      may be -1, meaning the devices left over by the others.
    devices: the devices to lay out; None means `jax.devices()` (every
      device of every process).

  Returns:
    A mesh whose axis sizes multiply to the number of devices.

  Raises:
    UserError: more than one -1, or sizes that do not fit the device count.
  """
  devices = jax.devices() if devices is None else list(devices)
  n = len(devices)
  sizes = {axis: mesh_cfg.get(axis, 1) for axis in MESH_AXES}
  fields = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items()
                      if axis not in ("expert", "context") or size != 1)
  rest = [axis for axis, size in sizes.items() if size == -1]
  if len(rest) > 1:
    raise UserError(f"{fields}: at most one mesh axis may be -1 (the devices left over)")
  fixed = int(np.prod([size for size in sizes.values() if size != -1]))
  if rest:
    if n % fixed:
      raise UserError(f"{fields}: the fixed sizes multiply to {fixed}, which does not "
                      f"divide the {n} devices")
    sizes[rest[0]] = n // fixed
  elif fixed != n:
    raise UserError(f"{fields} multiply to {fixed}, not to the {n} devices; "
                    "make the product equal the device count or set one axis to -1")
  shape = tuple(sizes[axis] for axis in MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  except NotImplementedError as e:  # a TPU slice whose torus the sizes do not follow
    raise UserError(f"{fields}: each mesh axis of a TPU slice must be a product of some of "
                    f"its physical axes ({str(e).split('. ')[0]}); choose sizes that are "
                    "(on 4x4x4: 4, 16 or 64 per axis)") from e


def _rules_dict(rules) -> dict:
  """Checks `mesh.rules` (pairs of logical name, mesh axis or None) -> a dict."""
  out = {}
  for rule in rules:
    if len(rule) != 2:
      raise UserError(f"config field mesh.rules: {rule!r} is not a (logical axis, mesh "
                      "axis or None) pair")
    logical, axis = rule
    if logical not in LOGICAL_AXES:
      raise UserError(f"config field mesh.rules: logical axis {logical!r} must be one of "
                      f"{', '.join(LOGICAL_AXES)}")
    if axis is not None and axis not in MESH_AXES:
      raise UserError(f"config field mesh.rules: mesh axis {axis!r} (for {logical!r}) must "
                      f"be one of {', '.join(MESH_AXES)} or None")
    if logical in out:
      raise UserError(f"config field mesh.rules: logical axis {logical!r} appears twice")
    out[logical] = axis
  return out


def logical_to_mesh_spec(logical_axes, shape, mesh: Mesh, rules) -> P:
  """The mesh PartitionSpec of one array from its logical axis names.

  A dimension whose logical name has no rule, maps to None, maps to a mesh
  axis whose size does not divide it, or maps to a mesh axis already used by
  an earlier dimension is replicated.
  """
  rules = _rules_dict(rules)
  used = set()
  spec = []
  for name, dim in zip(logical_axes, shape):
    axis = rules.get(name)
    if axis is None or axis in used or dim % mesh.shape[axis]:
      spec.append(None)
    else:
      spec.append(axis)
      used.add(axis)
  return P(*spec)


def param_partition_specs(abstract_state, mesh: Mesh, rules):
  """Mesh PartitionSpecs for an nnx State (abstract, e.g. from `nnx.eval_shape`).

  Returns a tree of the state's structure whose leaves are PartitionSpecs;
  variables without logical names are replicated.
  """
  logical = nnx.get_partition_spec(abstract_state)
  return jax.tree.map(lambda axes, x: logical_to_mesh_spec(axes, x.shape, mesh, rules),
                      logical, abstract_state)


def state_shardings(abstract_state, mesh: Mesh, rules):
  """NamedShardings for an nnx State, usable as jit in/out_shardings."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      param_partition_specs(abstract_state, mesh, rules))


def _path_names(path) -> tuple[str, ...]:
  """A pytree key path as plain names: ("opt_state", "0", "mu", "decoder", ...)."""
  return tuple(jax.tree_util.keystr((key,), simple=True) for key in path)


def opt_state_shardings(abstract_opt_state, abstract_params, mesh: Mesh, rules):
  """NamedShardings for an optimizer state (abstract, e.g. from `jax.eval_shape`).

  A leaf whose key path ends with a parameter's key path and whose shape
  equals that parameter's (Adam's mu and nu, momentum, ...) takes the
  parameter's sharding; every other leaf (step counts, scalars, factored
  statistics) is replicated. Matching by path and shape, rather than through
  `optax.tree_map_params`, needs no optimizer object, so any tree that holds
  copies of the parameters works, for example a whole train-state dict
  {"params": ..., "opt_state": ..., "step": ...}.
  """
  shardings = jax.tree.leaves(state_shardings(abstract_params, mesh, rules))
  params = {_path_names(path): (x.shape, sharding) for (path, x), sharding in zip(
      jax.tree_util.tree_flatten_with_path(abstract_params)[0], shardings)}
  replicated = NamedSharding(mesh, P())

  def leaf_sharding(path, x):
    names = _path_names(path)
    for start in range(len(names)):
      shape, sharding = params.get(names[start:], (None, None))
      if shape == x.shape:
        return sharding
    return replicated

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_opt_state)


def batch_split(mesh) -> int:
  """The devices a batch's rows split over: data x fsdp x expert."""
  return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def batch_split_fields(mesh) -> str:
  """'mesh.data x mesh.fsdp' (with ' x mesh.expert' where it is > 1)."""
  return " x ".join(f"mesh.{axis}" for axis in BATCH_AXES
                    if axis != "expert" or mesh.shape[axis] > 1)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, ...] arrays with the batch split over the batch axes (data, fsdp, expert)."""
  return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Puts a host-local batch (a dict of numpy [B_local, ...]) onto the mesh.

  With one process the batch is the global batch (`jax.device_put`); with
  several, each process passes its own rows and the global batch is their
  concatenation (`jax.make_array_from_process_local_data`).

  Raises:
    UserError: the global batch does not split over the batch axes' devices.
  """
  sharding = batch_sharding(mesh)
  split = batch_split(mesh)
  for name, x in batch.items():
    rows = x.shape[0] * jax.process_count()
    if rows % split:
      raise UserError(f"batch field {name!r} has {rows} rows, which do not split over "
                      f"{batch_split_fields(mesh)} = {split} devices; make train.batch_size "
                      f"(per micro-batch) a multiple of {split}")
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)
  return {name: jax.make_array_from_process_local_data(sharding, x)
          for name, x in batch.items()}


def train_state_shardings(abstract, mesh, rules):
  """NamedShardings of a train state, usable as jit in/out_shardings.

  Parameters and their optimizer moments are split by `mesh.rules`;
  everything else (step, counts, RNG) is replicated.
  """
  return opt_state_shardings(abstract, abstract["params"], mesh, rules)


def with_shardings(abstract, shardings):
  """The abstract state with each leaf carrying its target sharding.

  Given to Orbax as the restore target, it puts every array directly into its
  shards on the current mesh, whatever mesh the checkpoint was saved from.
  """
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)
