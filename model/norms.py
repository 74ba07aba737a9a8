"""Step 5 of the lesson: the norms, one `NORMS` entry per `model.norm`.

LN(x) = gamma * (x - mean) / sqrt(var + eps) + beta;
RMSNorm(x) = gamma * x / sqrt(mean(x^2) + eps) (no mean, no beta);
zero-centred RMSNorm(x) = (1 + w) * x / sqrt(mean(x^2) + eps), w stored and
initialised to zeros (Qwen3-Next, Qwen3.5, Gemma: weight decay pulls the
scale towards 1, not 0);
DyT(x) = gamma * tanh(alpha * x) + beta (Zhu et al. 2025, "Transformers
without Normalization": no statistics at all, one learned scalar alpha per
norm, initialised to 0.5).
The statistics (and DyT's tanh) are computed in float32 whatever the compute
dtype (the lesson's low-precision pitfall); the result is cast back.
"""
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import param
from model.registry import Registry


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, *, cfg, rngs: nnx.Rngs):
    pdt = cfg.param_dtype
    self.eps = cfg.norm_eps
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",), pdt)
    self.bias = param(rngs, jax.nn.initializers.zeros, (dim,), ("norm",), pdt)

  @jax.named_scope("norm")
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, *, cfg, rngs: nnx.Rngs, eps: float | None = None):
    """`eps`: None for model.norm_eps (MLA's latent norms have DeepSeek's own)."""
    self.eps = cfg.norm_eps if eps is None else eps
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",),
                       cfg.param_dtype)

  @jax.named_scope("norm")
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class RMSNormZeroCentred(nnx.Module):
  """RMSNorm whose learned scale is stored as w and applied as (1 + w), w
  initialised to zeros (transformers' Qwen3NextRMSNorm)."""

  def __init__(self, dim: int, *, cfg, rngs: nnx.Rngs):
    self.eps = cfg.norm_eps
    self.scale = param(rngs, jax.nn.initializers.zeros, (dim,), ("norm",), cfg.param_dtype)

  @jax.named_scope("norm")
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
    return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class DyT(nnx.Module):
  """Dynamic Tanh: gamma * tanh(alpha * x) + beta, alpha a learned scalar."""

  ALPHA_INIT = 0.5  # the paper's default for non-LLM models; see docs/models.md

  def __init__(self, dim: int, *, cfg, rngs: nnx.Rngs):
    pdt = cfg.param_dtype
    self.alpha = param(rngs, jax.nn.initializers.constant(self.ALPHA_INIT), (), (), pdt)
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",), pdt)
    self.bias = param(rngs, jax.nn.initializers.zeros, (dim,), ("norm",), pdt)

  @jax.named_scope("norm")
  def __call__(self, x):
    y = jnp.tanh(self.alpha[...].astype(jnp.float32) * x.astype(jnp.float32))
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Norm:
  """A `model.norm` choice: its module `(dim, cfg=, rngs=)` and its
  parameters for a width `dim`."""
  name: str
  doc: str
  module: Callable
  params: Callable[[int], int]
  reads: tuple[str, ...] = ()


NORMS = Registry("model.norm", [
    Norm("layernorm", "LayerNorm: mean and variance, gamma and beta (the original, BERT, GPT-2)",
         LayerNorm, lambda dim: 2 * dim),
    Norm("rmsnorm", "RMSNorm: root mean square, gamma only (LLaMA, T5)", RMSNorm,
         lambda dim: dim),
    Norm("rmsnorm_zero_centred", "RMSNorm with its scale applied as (1 + w), w initialised to "
         "zeros (Qwen3-Next, Qwen3.5); qk_norm's norms too", RMSNormZeroCentred, lambda dim: dim),
    Norm("dyt", "Dynamic Tanh, gamma tanh(alpha x) + beta, no statistics (Zhu et al. 2025)",
         DyT, lambda dim: 2 * dim + 1),
])


def make_norm(dim: int, *, cfg, rngs: nnx.Rngs) -> nnx.Module:
  """The `model.norm` entry's module over the last axis, of width `dim`."""
  return NORMS[cfg.norm].module(dim, cfg=cfg, rngs=rngs)


def make_qk_norm(dim: int, *, cfg, rngs: nnx.Rngs) -> nnx.Module:
  """`qk_norm`'s RMSNorm over each head's `dim`: zero-centred under
  model.norm=rmsnorm_zero_centred (Qwen3-Next's q_norm and k_norm), else
  plain RMSNorm whatever model.norm is (Qwen3, OLMo-2)."""
  if cfg.norm == "rmsnorm_zero_centred":
    return RMSNormZeroCentred(dim, cfg=cfg, rngs=rngs)
  return RMSNorm(dim, cfg=cfg, rngs=rngs)
