"""What both FlashAttention kernels share: the custom VJP, tile padding, the
refs of a block-sparse plan.

The lesson's backward pass recomputes the tiles from the saved log-sum-exp:
the forward returns (out, lse) and keeps (q, k, v, segment ids, out, lse) as
residuals; the backward turns them and dO into (dq, dk, dv).
"""
import functools

import jax
import jax.numpy as jnp


def flash_vjp(forward, backward):
  """A differentiable attention(q, k, v, q_seg, kv_seg, cfg) -> out.

  forward(q, k, v, q_seg, kv_seg, cfg) -> (out, lse);
  backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg) -> (dq, dk, dv).
  Segment ids (or None) are integers and get no gradient; cfg is static.
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
  def flash(q, k, v, q_seg, kv_seg, cfg):
    return forward(q, k, v, q_seg, kv_seg, cfg)[0]

  def flash_fwd(q, k, v, q_seg, kv_seg, cfg):
    out, lse = forward(q, k, v, q_seg, kv_seg, cfg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)

  def flash_bwd(cfg, residuals, do):
    return (*backward(*residuals, do, cfg), None, None)

  flash.defvjp(flash_fwd, flash_bwd)
  return flash


def plan_refs(tiles_ref, bounds_ref):
  """A kernel's refs of its block-sparse plan (`block_sparse.schedule`: the
  tile list and bounds, passed when segment ids are given), or None."""
  return None if tiles_ref is None else (tiles_ref, bounds_ref)


def pad_to(x, axis: int, size: int):
  """Zero-pads `x` along `axis` up to `size` (no copy when already there)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_segment_ids(segment_ids, size: int):
  """int32 segment ids [B, L] zero-padded to [B, size] (0 marks padding, which
  no query sees), or None."""
  if segment_ids is None:
    return None
  return pad_to(segment_ids.astype(jnp.int32), 1, size)
