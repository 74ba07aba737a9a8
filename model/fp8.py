"""FP8 matrix products with per-tensor scaling: `model.fp8` (none | current | delayed).

A projection x . W runs as a product of 8-bit floats: the input and the
kernel in e4m3 (float8_e4m3fn, max 448, more mantissa) in the forward pass,
the gradient of the output in e5m2 (float8_e5m2, max 57344, more range) in
the backward pass, each product accumulated in float32 and divided by the
two operands' scales. A tensor t is quantized as clip(t * s, +-fmax) with
one scale s per tensor, s = fmax / amax / 2^margin (`scale_for`), so that
its largest magnitude lands on the format's largest value.

- `current` scaling takes amax = max |t| of the tensor itself, every call:
  no state, one more pass over each operand.
- `delayed` scaling (Transformer Engine's DelayedScaling recipe, amax
  "max" over the history) quantizes with the scale kept from the previous
  steps: each projection keeps a scale and a history of the last
  `model.fp8_history` amaxes for each of its three tensors (input, kernel,
  output gradient; `Fp8Scale`, `Fp8AmaxHistory`). After each step the
  newest amaxes are rolled into the histories and the scales recomputed
  from the histories' maxima.

The state is part of the model (a checkpoint holds it) but is not trained:
the backward pass returns the new scales and histories as their
"gradients" (Flax's OVERWRITE_WITH_GRADIENT idea), and the train step
writes them over the old values instead of handing them to the optimizer
(`training/steps.py`; micro-batches combine by `accumulate_grads`). The
head, the routed MoE experts, the router and the other small projections
stay in the compute dtype; only attention's and the MLP's projections
(a MoE's shared experts are an MLP) take `model.fp8`.

On a GPU the products need FP8 tensor cores, compute capability 8.9 (Ada,
Hopper) or later (`check_backend`); XLA's CPU backend emulates them, so the
CPU runs every mode (slowly: it converts the operands back up).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.errors import UserError

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
MODES = ("none", "current", "delayed")

# The rows of a projection's delayed-scaling state: input, kernel, output gradient.
FORMATS = (E4M3, E4M3, E5M2)
# numpy, not a jax array: importing the model must not start JAX's backend
# (jax.distributed.initialize comes first in a multi-process run).
FMAX_3 = np.array([float(jnp.finfo(f).max) for f in FORMATS], np.float32)

# The oldest GPU with FP8 tensor cores: Ada (sm_89); Hopper is 9.0.
MIN_COMPUTE_CAPABILITY = (8, 9)


class Fp8Meta(nnx.Variable):
  """A projection's delayed-scaling state, rows input / kernel / output
  gradient. Part of the model's state (checkpointed), not an `nnx.Param`:
  the optimizer leaves it alone and the train step overwrites it with its
  gradient (`overwrite_fp8_meta`)."""


class Fp8Scale(Fp8Meta):
  """The three scales [3] the next step quantizes with."""


class Fp8AmaxHistory(Fp8Meta):
  """The three amax histories [3, history], newest first."""


def is_fp8_meta(x) -> bool:
  return isinstance(x, Fp8Meta)


def scale_for(amax, fmax, previous, margin: int = 0):
  """The per-tensor scale fmax / amax / 2^margin; `previous` where amax is 0
  (nothing seen yet) or not finite (an overflow must not poison the scale)."""
  ok = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(ok, fmax / jnp.where(ok, amax, 1.0) / 2.0**margin, previous)


def roll_history(history_RH, amax_R):
  """Each row's amax history with the newest amax at position 0, the oldest dropped."""
  return jnp.roll(history_RH, 1, axis=-1).at[:, 0].set(amax_R)


def amax(x):
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def quantize(x, scale, fmt):
  """x * scale, saturated to +-fmax of `fmt`, in `fmt`."""
  fmax = float(jnp.finfo(fmt).max)
  return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(fmt)


def _scaled_dot(a, b, scale_a, scale_b, dtype):
  """a . b of two FP8 matrices, accumulated in float32, unscaled, in `dtype`."""
  y = jax.lax.dot(a, b, preferred_element_type=jnp.float32)
  return (y / (scale_a * scale_b)).astype(dtype)


def _input_grads(qx_NK, qw_KM, qg_NM, sx, sw, sg, dtype):
  """(dx = g . W^T, dW = x^T . g) from the quantized operands."""
  return (_scaled_dot(qg_NM, qw_KM.T, sg, sw, dtype), _scaled_dot(qx_NK.T, qg_NM, sx, sg, dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_matmul(x_NK, w_KM, dtype):
  """x . W in FP8 with current scaling: each operand's scale from its own amax."""
  return _current_fwd(x_NK, w_KM, dtype)[0]


def _current_fwd(x_NK, w_KM, dtype):
  sx, sw = scale_for(amax(x_NK), FMAX_3[0], 1.0), scale_for(amax(w_KM), FMAX_3[1], 1.0)
  qx, qw = quantize(x_NK, sx, E4M3), quantize(w_KM, sw, E4M3)
  return _scaled_dot(qx, qw, sx, sw, dtype), (qx, qw, sx, sw)


def _current_bwd(dtype, res, g_NM):
  qx, qw, sx, sw = res
  sg = scale_for(amax(g_NM), FMAX_3[2], 1.0)
  return _input_grads(qx, qw, quantize(g_NM, sg, E5M2), sx, sw, sg, dtype)


current_matmul.defvjp(_current_fwd, _current_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def delayed_matmul(x_NK, w_KM, scales_3, history_3H, dtype):
  """x . W in FP8 with delayed scaling: quantized with the kept `scales_3`;
  the "gradients" of `scales_3` and `history_3H` are their new values (the
  step's amaxes rolled in, the scales recomputed from the histories' maxima)."""
  return _delayed_fwd(x_NK, w_KM, scales_3, history_3H, dtype)[0]


def _delayed_fwd(x_NK, w_KM, scales_3, history_3H, dtype):
  qx, qw = quantize(x_NK, scales_3[0], E4M3), quantize(w_KM, scales_3[1], E4M3)
  y = _scaled_dot(qx, qw, scales_3[0], scales_3[1], dtype)
  return y, (qx, qw, scales_3, history_3H, amax(x_NK), amax(w_KM))


def _delayed_bwd(dtype, res, g_NM):
  qx, qw, scales_3, history_3H, amax_x, amax_w = res
  qg = quantize(g_NM, scales_3[2], E5M2)
  dx, dw = _input_grads(qx, qw, qg, scales_3[0], scales_3[1], scales_3[2], dtype)
  new_history_3H = roll_history(history_3H, jnp.stack([amax_x, amax_w, amax(g_NM)]))
  new_scales_3 = scale_for(new_history_3H.max(axis=-1), FMAX_3, scales_3)
  return dx, dw, new_scales_3, new_history_3H


delayed_matmul.defvjp(_delayed_fwd, _delayed_bwd)


class Fp8Matmul(nnx.Module):
  """A projection's matrix product x [N, K] . W [K, M] in FP8 (`model.fp8`);
  under `delayed` it holds the projection's `Fp8Meta` state: scales 1 and
  empty histories at first (replicated: a few numbers; a scanned stack adds
  its `layers` axis)."""

  def __init__(self, mode: str, history: int):
    self.mode = mode
    if mode == "delayed":
      self.scales = Fp8Scale(jnp.ones((3,), jnp.float32))
      self.amax_history = Fp8AmaxHistory(jnp.zeros((3, history), jnp.float32))

  def __call__(self, x_NK, w_KM, dtype):
    if self.mode == "current":
      return current_matmul(x_NK, w_KM, dtype)
    return delayed_matmul(x_NK, w_KM, self.scales[...], self.amax_history[...], dtype)


def state_shape(model_cfg) -> tuple[int, int] | None:
  """The shape of each projection's amax history under a model config (its
  scales are [3]); None where the model keeps no FP8 state. A checkpoint
  resumes only under the same (`training/workdir.check_same_shapes`)."""
  return (3, model_cfg.fp8_history) if model_cfg.fp8 == "delayed" else None


def is_state_path(name: str) -> bool:
  """Whether a parameter path name, "decoder/layers/mlp/up/fp8/scales",
  names delayed-scaling state (`Fp8Matmul`'s variables)."""
  return name.split("/")[-2:] in (["fp8", "scales"], ["fp8", "amax_history"])


def _min_scale(carry, scale):
  """The smaller scale (the larger amax); the carry's initial zeros (no
  micro-batch yet: a scale is never 0) take `scale`."""
  return jnp.where(carry == 0, scale, jnp.minimum(carry, scale))


def accumulate_grads(carry, grads):
  """The gradients of micro-batches combined: each micro-batch rolls its
  amaxes into the same old history, so the step's histories are their
  element-wise maximum and its scales their minimum (fmax over the largest
  amax); the true gradients are added."""
  def combine(x, y):
    if isinstance(x, Fp8AmaxHistory):
      return jax.tree.map(jnp.maximum, x, y)
    if isinstance(x, Fp8Scale):
      return jax.tree.map(_min_scale, x, y)
    return jax.tree.map(jnp.add, x, y)

  return jax.tree.map(combine, carry, grads, is_leaf=is_fp8_meta)


def zero_fp8_meta(grads):
  """The gradients with every `Fp8Meta` leaf zero: what the optimizer and the
  gradient norm see (the leaves' own "gradients" are the new state)."""
  return jax.tree.map(lambda g: jax.tree.map(jnp.zeros_like, g) if is_fp8_meta(g) else g,
                      grads, is_leaf=is_fp8_meta)


def overwrite_fp8_meta(params, new):
  """`params` with each `Fp8Meta` leaf replaced by its value in `new`."""
  return jax.tree.map(lambda p, n: n if is_fp8_meta(p) else p, params, new, is_leaf=is_fp8_meta)


def check_backend(device, mode: str) -> None:
  """Refuses `model.fp8` on a GPU without FP8 tensor cores (before sm_89),
  in one line; the CPU emulates FP8 products and TPUs' XLA converts them."""
  if mode == "none" or device.platform not in ("gpu", "cuda"):
    return
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return
  if tuple(int(p) for p in str(capability).split(".")) < MIN_COMPUTE_CAPABILITY:
    raise UserError(f"model.fp8={mode}: {device.device_kind} (compute capability {capability}) "
                    "has no FP8 tensor cores (sm_89 or later: Ada, Hopper); use model.fp8=none")
