"""What the FlashAttention kernels share: the custom VJP, the mask semantics,
the causal tile arithmetic, tile padding, the refs of a block-sparse plan.

The lesson's backward pass recomputes the tiles from the saved log-sum-exp:
the forward returns (out, lse) and keeps (q, k, v, segment ids, out, lse) as
residuals; the backward turns them and dO into (dq, dk, dv). A soft-cap
(`soft_cap_tile`) is elementwise on the score tile: the forward caps the
scaled scores, the backward recomputes the capped tile and multiplies dS by
the cap's derivative (`soft_cap_grad`) before dQ and dK.

Mask semantics, the same in every kernel: query i sees key j iff j <= i when
causal (top-left aligned), j is below the true key length (the arrays may be
padded past it), and, with segment ids, the ids of i and j are equal and the
key's is not 0 (the padding id). A query that sees no key gets a zero output
and zero gradients.

Each kernel streams tiles of one side past a tile of the other. Which of
them it must visit, and which it may visit without the mask, is
`kv_tile_range` (a query tile streaming key tiles) and `q_tile_range` (a key
tile streaming query tiles) without segment ids; with them, a block-sparse
plan (`block_sparse.py`).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

LOG2_E = math.log2(math.e)  # the kernels take exponentials base 2


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


def soft_cap_tile(s_TS, cap: float | None):
  """(c tanh(s / c), tanh(s / c)) of a tile of scaled scores, Gemma-2's
  soft-cap c = `cap`; (s, None) without one. The backward keeps the tanh for
  `soft_cap_grad`."""
  if cap is None:
    return s_TS, None
  tanh_TS = jnp.tanh(s_TS * (1.0 / cap))
  return cap * tanh_TS, tanh_TS


def soft_cap_grad(ds_TS, tanh_TS):
  """dS of the scores before the cap from dS after it: d/ds c tanh(s / c) =
  1 - tanh^2(s / c) (the identity without a cap, `tanh_TS` None)."""
  return ds_TS if tanh_TS is None else ds_TS * (1.0 - tanh_TS * tanh_TS)


def delta(o_BTHD, do_BTHD):
  """rowsum(dO * O) of the backward, [B, H, T] float32."""
  return jnp.einsum("bthd,bthd->bht", o_BTHD.astype(jnp.float32),
                    do_BTHD.astype(jnp.float32))


def visible(q_pos, k_pos, *, along_q, along_k, causal: bool, kv_len: int | None = None,
            q_seg=None, kv_seg=None):
  """Which (query, key) pairs of a tile may attend (the module's mask
  semantics), a boolean tile, or None when nothing is masked.

  q_pos, k_pos: the tile's query and key positions (vectors); kv_len: the
  true key length where the tile may hold padded keys, else None; q_seg,
  kv_seg: the tile's segment ids (vectors), or None. along_q(vector) and
  along_k(vector) spread a vector of the query or key side over the tile
  (each kernel lays its tiles out its own way).
  """
  terms = []
  if causal and kv_seg is not None:
    # A key of segment 0 moves past every query, once per key: two compares
    # and selects a score instead of three.
    k_pos = jnp.where(kv_seg != 0, k_pos, jnp.iinfo(jnp.int32).max)
  if causal or kv_len is not None:
    k_pos = along_k(k_pos)
  if causal:
    terms.append(k_pos <= along_q(q_pos))
  if kv_len is not None:
    terms.append(k_pos < kv_len)
  if kv_seg is not None:
    kv_ids = along_k(kv_seg)
    same = along_q(q_seg) == kv_ids
    terms.append(same if causal else same & (kv_ids != 0))
  if not terms:
    return None
  return functools.reduce(jnp.logical_and, terms)


def kv_tile_range(q_start, q_rows: int, *, block_k: int, kv_len: int, causal: bool):
  """(whole, seen): the query rows [q_start, q_start + q_rows) see key tiles
  (of `block_k`, over `kv_len` true keys) [0, seen), and every row sees all
  of the tiles [0, whole); [whole, seen) need the mask. Python ints when not
  causal."""
  seen, whole = -(-kv_len // block_k), kv_len // block_k
  if not causal:
    return whole, seen
  seen = jnp.minimum(lax.div(q_start + q_rows + block_k - 1, block_k), seen)
  return jnp.minimum(lax.div(q_start + 1, block_k), whole), seen


def q_tile_range(k_start, k_rows: int, *, block_q: int, num_q_tiles: int, causal: bool):
  """(first, whole): of `num_q_tiles` query tiles of `block_q`, those before
  `first` see none of the keys [k_start, k_start + k_rows) (causal), [first,
  whole) need the mask, [whole, num_q_tiles) see them all. Python ints when
  not causal."""
  if not causal:
    return 0, 0
  first = jnp.minimum(lax.div(k_start, block_q), num_q_tiles)
  whole = jnp.minimum(lax.div(k_start + k_rows + block_q - 2, block_q), num_q_tiles)
  return first, whole


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


def padded_call(flash, q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, *,
                q_multiple: int, kv_multiple: int, head_dim: int | None = None):
  """flash(q, k, v, q_seg, kv_seg) on inputs zero-padded to whole tiles,
  cut back to [B, T, H, D].

  Query lengths are padded to a multiple of `q_multiple`, key lengths to one
  of `kv_multiple`, the head dim to `head_dim` if given. Padded keys must be
  masked by the kernel (the true length, or segment id 0); padded query rows
  are cut off, so they get no gradient.
  """
  T, D = q_BTHD.shape[1], q_BTHD.shape[3]
  T_pad = round_up(T, q_multiple)
  S_pad = round_up(k_BSKD.shape[1], kv_multiple)
  D_pad = head_dim or D
  q = pad_to(pad_to(q_BTHD, 1, T_pad), 3, D_pad)
  k = pad_to(pad_to(k_BSKD, 1, S_pad), 3, D_pad)
  v = pad_to(pad_to(v_BSKD, 1, S_pad), 3, D_pad)
  out = flash(q, k, v, pad_segment_ids(q_segment_ids, T_pad),
              pad_segment_ids(kv_segment_ids, S_pad))
  return out[:, :T, :, :D]
