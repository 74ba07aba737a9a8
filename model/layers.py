"""Parameter helpers shared by every module: dtypes and annotated weights.

Each weight carries logical axis names (`vocab`, `embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `norm`, `expert`, and `layers`, the leading
axis of a scanned stack's parameters: `model/transformer.py`);
`training/sharding.py` maps them onto a device mesh by the rules in the
config.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from configs.errors import UserError

from model.fp8 import Fp8Matmul, check_backend

# Config dtype names -> jnp dtypes (`model.config.ModelConfig` resolves them).
# The logical axis of the layers of a scanned stack (its parameters' leading axis).
LAYERS_AXIS = "layers"

# The mesh axes that split the batch (`training/sharding.py`): activations
# are [B / (data x fsdp x expert), ...] on each device.
BATCH_AXES = ("data", "fsdp", "expert")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def batch_axes(mesh) -> tuple[str, ...]:
  """The batch axes (`BATCH_AXES`) that `mesh` has."""
  return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


def check_rows_split(B: int, mesh, what: str) -> None:
  """Raises `UserError` (naming `what`, the kernel) unless B rows split
  evenly over `mesh`'s batch axes, as a kernel run on each device's rows
  under `shard_map` needs."""
  batch = batch_axes(mesh)
  rows = math.prod(mesh.shape[axis] for axis in batch)
  if B % rows:
    raise UserError(f"{what}: {B} rows (per micro-batch) do not split over the {rows} devices "
                    f"of the batch axes {' x '.join(batch)}; make train.batch_size / "
                    "train.grad_accum_steps a multiple of it")


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str, ...],
          dtype) -> nnx.Param:
  """A parameter of `shape`, initialised by `init`, annotated with `axes`.

  A learned scalar (shape (), axes ()) carries no annotation (None): Flax's
  scan and vmap add the `layers` axis to a non-empty annotation only, and
  would fail to remove it from an empty one; unannotated, it is replicated
  on every device, which is what a scalar needs.
  """
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes or None,
                   eager_sharding=False)


def compile_device():
  """The device the traced program is compiled for: the abstract mesh's device
  (set by the jitted steps, `training/steps.traced_on`, so compile.py's target
  chip), else `jax.devices()[0]`. It picks the kernels' lowering and tiles,
  what attention's `auto` resolves to, and `Dense`'s operand shape."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device
  return jax.devices()[0]


def token_matrix_products() -> bool:
  """Whether a matrix product of activations [B, T, ...] runs on them as one
  [B*T, ...] matrix: on one CPU device. XLA's CPU backend then takes the
  weight gradient x^T dy as one plain product; over the two axes B and T
  it transposes dy from inside the fusion that computes it, a slow strided
  loop (docs/benchmarks.md, "Where a CPU step's time goes"). Elsewhere the
  axes stay apart, for their shardings."""
  mesh = jax.sharding.get_abstract_mesh()
  return (mesh.empty or mesh.size == 1) and compile_device().platform == "cpu"


def dense_init(std: float):
  return jax.nn.initializers.normal(std)


class Dense(nnx.Module):
  """y = x . W (+ b) contracting the last axis of x with the first of W.

  `out_shape` may have several axes (for example heads x head_dim), so the
  query projection is one [d, H, D] weight rather than a reshape of [d, H*D].
  Computes in `dtype` (default the model's `cfg.dtype`); the weights are
  stored in `cfg.param_dtype` and drawn with std `std` (default
  `cfg.init_std`). With `fp8` (attention's and the MLP's projections) the
  product follows `cfg.fp8` (`model/fp8.py`): under `current` or `delayed`
  it runs as one FP8 matrix product [tokens, in] . [in, out].
  """

  def __init__(self, in_features: int, out_shape: tuple[int, ...], axes: tuple[str, ...],
               *, use_bias: bool, cfg, rngs: nnx.Rngs, in_axes: int = 1, dtype=None,
               std: float | None = None, fp8: bool = False):
    self.in_axes = in_axes
    self.fp8 = Fp8Matmul(cfg.fp8, cfg.fp8_history) if fp8 and cfg.fp8 != "none" else None
    self.dtype = cfg.dtype if dtype is None else dtype
    pdt = cfg.param_dtype
    in_shape = (in_features,) if in_axes == 1 else in_features
    std = cfg.init_std if std is None else std
    self.kernel = param(rngs, dense_init(std), (*in_shape, *out_shape), axes, pdt)
    self.bias = (param(rngs, jax.nn.initializers.zeros, out_shape, axes[in_axes:], pdt)
                 if use_bias else None)

  def __call__(self, x):
    kernel = self.kernel[...].astype(self.dtype)
    y = self._fp8_product(x, kernel) if self.fp8 is not None else self._product(x, kernel)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y

  def _product(self, x, kernel):
    """x . W; on one CPU device over the rows [B*T, ...] (`token_matrix_products`)."""
    lead = x.shape[:x.ndim - self.in_axes]
    flat = len(lead) > 1 and token_matrix_products()
    if flat:  # [B, T, ...] -> [B*T, ...]
      x = x.reshape(-1, *x.shape[len(lead):])
    contract = tuple(range(x.ndim - self.in_axes, x.ndim))
    y = jax.lax.dot_general(x.astype(self.dtype), kernel,
                            ((contract, tuple(range(self.in_axes))), ((), ())))
    return y.reshape(*lead, *y.shape[1:]) if flat else y

  def _fp8_product(self, x, kernel):
    """The same product as one FP8 matrix product [tokens, in] . [in, out];
    refused on a GPU without FP8 tensor cores (`check_backend`)."""
    check_backend(compile_device(), self.fp8.mode)
    lead = x.shape[:x.ndim - self.in_axes]
    in_size = math.prod(x.shape[len(lead):])
    y_NM = self.fp8(x.astype(self.dtype).reshape(-1, in_size), kernel.reshape(in_size, -1),
                    self.dtype)
    return y_NM.reshape(*lead, *kernel.shape[self.in_axes:])
