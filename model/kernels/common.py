"""What the FlashAttention kernels share: the custom VJP, the mask semantics,
the causal tile arithmetic, tile padding, the refs of a block-sparse plan.

The lesson's backward pass recomputes the tiles from the saved log-sum-exp:
the forward returns (out, lse) and keeps (q, k, v, segment ids, out, lse) as
residuals; the backward turns them and dO into (dq, dk, dv). A soft-cap
(`soft_cap_tile`) is elementwise on the score tile: the forward caps the
scaled scores, the backward recomputes the capped tile and multiplies dS by
the cap's derivative (`soft_cap_grad`) before dQ and dK.

Mask semantics, the same in every kernel: query i sees key j iff j <= i when
causal (top-left aligned), i - j < window with a sliding window (causal
only), j is below the true key length (the arrays may be
padded past it), and, with segment ids, the ids of i and j are equal and the
key's is not 0 (the padding id). A query that sees no key gets a zero output
and zero gradients.

Each kernel streams tiles of one side past a tile of the other. Which of
them it must visit, and which it may visit without the mask, is
`kv_tile_range` (a query tile streaming key tiles) and `q_tile_range` (a key
tile streaming query tiles) without segment ids; with them, a block-sparse
plan (`block_sparse.py`).
"""
import dataclasses
import functools
import math
from typing import Callable

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
            q_seg=None, kv_seg=None, window: int | None = None):
  """Which (query, key) pairs of a tile may attend (the module's mask
  semantics), a boolean tile, or None when nothing is masked.

  q_pos, k_pos: the tile's query and key positions (vectors); kv_len: the
  true key length where the tile may hold padded keys, else None; q_seg,
  kv_seg: the tile's segment ids (vectors), or None; window: with `causal`,
  Mistral's sliding window (query i sees keys i - window < j <= i), or None. along_q(vector) and
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
  if window is not None:
    terms.append(along_q(q_pos) - k_pos < window)
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


def common_head_width(q_BTHD, k_BSKD, v_BSKD):
  """q, k and v zero-padded to one head width, the wider of q's (and k's) and
  v's: values narrower than the keys (multi-head latent attention, 128
  against 192) through kernels that take one width. Zero columns of q and k
  add nothing to a score, and zero columns of v give zero output columns,
  which the caller cuts off (`[..., :v.shape[-1]]`); the pad's gradient is
  the cut, so dq, dk and dv come back at their own widths."""
  D = max(q_BTHD.shape[-1], v_BSKD.shape[-1])
  return pad_to(q_BTHD, 3, D), pad_to(k_BSKD, 3, D), pad_to(v_BSKD, 3, D)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_segment_ids(segment_ids, size: int):
  """int32 segment ids [B, L] zero-padded to [B, size] (0 marks padding, which
  no query sees), or None."""
  if segment_ids is None:
    return None
  return pad_to(segment_ids.astype(jnp.int32), 1, size)


def padded_inputs(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, *, T_pad: int,
                  S_pad: int, D_pad: int):
  """(q, k, v, q_seg, kv_seg) zero-padded: query rows to `T_pad`, keys to
  `S_pad`, the head dim to `D_pad`, the segment ids with 0 (padding)."""
  pad = lambda x, L: pad_to(pad_to(x, 1, L), 3, D_pad)
  return (pad(q_BTHD, T_pad), pad(k_BSKD, S_pad), pad(v_BSKD, S_pad),
          pad_segment_ids(q_segment_ids, T_pad), pad_segment_ids(kv_segment_ids, S_pad))


def _padding(q_BTHD, k_BSKD, q_multiple: int, kv_multiple: int, head_dim: int | None):
  """(T_pad, S_pad, D_pad) of `padded_inputs` for these tile multiples."""
  return dict(T_pad=round_up(q_BTHD.shape[1], q_multiple),
              S_pad=round_up(k_BSKD.shape[1], kv_multiple),
              D_pad=head_dim or q_BTHD.shape[3])


def one_segment(q_BTHD, k_BSKD, q_segment_ids, kv_segment_ids):
  """The segment ids, or where none are given one segment over each row: a
  kernel visits a sliding window's tiles by the block-sparse plan
  (`block_sparse.py`), which it builds from segment ids."""
  if q_segment_ids is not None:
    return q_segment_ids, kv_segment_ids
  return (jnp.ones(q_BTHD.shape[:2], jnp.int32), jnp.ones(k_BSKD.shape[:2], jnp.int32))


def padded_call(flash, q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, *,
                q_multiple: int, kv_multiple: int, head_dim: int | None = None,
                segments: bool = False):
  """flash(q, k, v, q_seg, kv_seg) on inputs zero-padded to whole tiles,
  cut back to [B, T, H, D].

  Query lengths are padded to a multiple of `q_multiple`, key lengths to one
  of `kv_multiple`, the head dim to `head_dim` if given. Padded keys must be
  masked by the kernel (the true length, or segment id 0); padded query rows
  are cut off, so they get no gradient. `segments`: the kernel needs segment
  ids (`one_segment` where none are given).
  """
  T, D = q_BTHD.shape[1], q_BTHD.shape[3]
  if segments:
    q_segment_ids, kv_segment_ids = one_segment(q_BTHD, k_BSKD, q_segment_ids, kv_segment_ids)
  out = flash(*padded_inputs(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids,
                             **_padding(q_BTHD, k_BSKD, q_multiple, kv_multiple, head_dim)))
  return out[:, :T, :, :D]


def lse_to_natural(lse, *, base2: bool):
  """A kernel's log-sum-exp (base 2 or natural, +inf for a query that sees
  no key, which makes its backward's P exactly 0) as the natural log with
  -inf there: the form in which partial results over disjoint keys merge
  (`model/context_parallel.py`)."""
  lse = lse * (1.0 / LOG2_E) if base2 else lse
  return jnp.where(lse == jnp.inf, -jnp.inf, lse)


def lse_from_natural(lse, *, base2: bool):
  """The inverse of `lse_to_natural`."""
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
  return lse * LOG2_E if base2 else lse


@dataclasses.dataclass(frozen=True)
class Parts:
  """A kernel configured for one call, as its two passes, for a caller that
  merges partial results itself (the context-parallel ring) instead of
  differentiating the kernel whole. On [B, T, H, D] inputs of any length:

  - forward(q, k, v, q_seg, kv_seg) -> (out [B, T, H, D] in q's dtype,
    lse [B, H, T] float32, the natural log, -inf where a query sees no key);
  - backward(q, k, v, q_seg, kv_seg, out, lse, do) -> (dq, dk, dv) from an
    (out, lse) that may be the merged result over more keys than these: the
    probabilities exp(s - lse) and delta = rowsum(dO * O) then are those of
    the whole row, so the gradients are these keys' share of it.
  """
  forward: Callable
  backward: Callable


def padded_parts(forward, backward, q_BTHD, k_BSKD, *, q_multiple: int, kv_multiple: int,
                 head_dim: int | None = None, segments: bool = False) -> Parts:
  """`Parts` of a kernel in the [B, T, H, D] layout with a base-2 lse [B, H, T]
  (the Triton and Mosaic GPU kernels): forward(q, k, v, q_seg, kv_seg) and
  backward(q, k, v, q_seg, kv_seg, out, lse, do) on inputs padded as
  `padded_call` pads them (`segments` as its)."""
  T, D = q_BTHD.shape[1], q_BTHD.shape[3]
  sizes = _padding(q_BTHD, k_BSKD, q_multiple, kv_multiple, head_dim)
  rows = lambda x: pad_to(pad_to(x, 1, sizes["T_pad"]), 3, sizes["D_pad"])
  cut = lambda x: x[:, :T, :, :D]

  def inputs(q, k, v, q_seg, kv_seg):
    if segments:
      q_seg, kv_seg = one_segment(q, k, q_seg, kv_seg)
    return padded_inputs(q, k, v, q_seg, kv_seg, **sizes)

  def parts_forward(q, k, v, q_seg, kv_seg):
    out, lse = forward(*inputs(q, k, v, q_seg, kv_seg))
    return cut(out), lse_to_natural(lse[:, :, :T], base2=True)

  def parts_backward(q, k, v, q_seg, kv_seg, out, lse, do):
    lse = jnp.pad(lse_from_natural(lse, base2=True), ((0, 0), (0, 0), (0, sizes["T_pad"] - T)),
                  constant_values=jnp.inf)
    dq, dk, dv = backward(*inputs(q, k, v, q_seg, kv_seg), rows(out), lse, rows(do))
    S = k.shape[1]
    return cut(dq), dk[:, :S, :, :D], dv[:, :S, :, :D]

  return Parts(parts_forward, parts_backward)
