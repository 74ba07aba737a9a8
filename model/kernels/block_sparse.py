"""Block-sparse tile plans from segment ids: which tiles a CTA visits.

FlashAttention's causal kernels skip the tiles above the diagonal (the
lesson's "Efficient attention variants": nothing there is visible). Packed
training (`data.packing=packed`) adds a second kind of empty tile: a query
tile and a key tile that share no document. This module finds, from the
segment ids alone and before a kernel runs, which (query tile, key tile)
pairs can see anything and which see their whole tile (one segment on both
sides, below the diagonal), as FlexAttention's block masks do, and orders
them into the list of tiles each CTA streams.

A CTA's compute warpgroups each own a tile on one side (queries in the
forward and dQ kernels, keys in the dK/dV kernel) and stream the tiles of
the other side. `schedule` gives each CTA the tiles its warpgroups see,
in two sections: those that need the mask, then those both warpgroups see
whole (no mask); and, per warpgroup, the leading steps it can pass because
it sees nothing there. (Masked tiles first: the order in which the dK/dV
kernel takes its tiles without segment ids too, so one pair of loops serves
both; the forward and dQ kernels take a list in one loop and branch around
the mask.)

Shape letters besides the project's: C CTAs, W warpgroups of a CTA, J the
tiles a CTA streams.
"""
import jax.numpy as jnp
from jax import lax

_BIG = jnp.iinfo(jnp.int32).max
_SMALL = jnp.iinfo(jnp.int32).min


def tile_ranges(segment_ids_BL, tile: int):
  """Per tile of `tile` positions: (lo, hi, uniform), each [B, L / tile].

  lo and hi bound the tile's nonzero ids (id 0 is padding, which nothing
  sees; a tile of padding gets the empty range lo > hi); uniform: every
  position has the one id lo (nonzero)."""
  B, L = segment_ids_BL.shape
  ids = segment_ids_BL.reshape(B, L // tile, tile)
  real = ids != 0
  lo = jnp.min(jnp.where(real, ids, _BIG), axis=-1)
  hi = jnp.max(jnp.where(real, ids, _SMALL), axis=-1)
  return lo, hi, real.all(axis=-1) & (lo == hi)


def pair_visibility(q_seg_BT, kv_seg_BS, q_tile: int, k_tile: int, causal: bool,
                    window: int | None = None):
  """(visible, whole), each [B, T / q_tile, S / k_tile]: whether a query tile
  may see any key of a key tile (their id ranges overlap, and not all keys
  are after all queries when causal), and whether every query sees every
  key (one id on both sides, every key at or before every query when
  causal, and within the sliding `window` of every query, which comes with
  the causal mask). `visible` may be true of a pair that sees nothing (ranges
  overlap without a shared id); such a pair is visited with the mask."""
  q_lo, q_hi, q_uniform = (x[:, :, None] for x in tile_ranges(q_seg_BT, q_tile))
  k_lo, k_hi, k_uniform = (x[:, None, :] for x in tile_ranges(kv_seg_BS, k_tile))
  visible = (q_lo <= k_hi) & (k_lo <= q_hi)
  whole = q_uniform & k_uniform & (q_lo == k_lo)
  if causal:
    q_first = jnp.arange(q_seg_BT.shape[1] // q_tile)[:, None] * q_tile
    k_first = jnp.arange(kv_seg_BS.shape[1] // k_tile)[None, :] * k_tile
    visible &= k_first <= q_first + q_tile - 1
    whole &= k_first + k_tile - 1 <= q_first
    if window is not None:  # the nearest pair within the window; the farthest
      visible &= q_first - (k_first + k_tile - 1) < window
      whole &= q_first + q_tile - 1 - k_first < window
  return visible, whole


def schedule(visible_BCWJ, whole_BCWJ):
  """The tile list of each CTA and each warpgroup's bounds in it.

  visible, whole: [B, C, W, J], for CTA c's warpgroup w and streamed tile
  j (whole implies visible). Returns

  - tiles [B, C, J] int32: the streamed tiles in visiting order, the first
    `count` of them used: those visible to either warpgroup and seen whole
    by neither or only one (masked), then those both see whole (unmasked),
    each section ascending;
  - bounds [B, C, W, 3] int32: (first, split, count). count (at least 1: a
    CTA that sees nothing still streams tile 0) is the CTA's steps, [split,
    count) the unmasked ones. Warpgroup w may pass the steps before
    `first`, in which it sees nothing; it takes step `first` at least (a
    warpgroup that sees nothing takes the last step, masked to nothing).
  """
  listed = visible_BCWJ.any(axis=2)
  both_whole = whole_BCWJ.all(axis=2)
  J = listed.shape[-1]
  tiles = jnp.argsort(jnp.where(listed, both_whole, 2) * J + jnp.arange(J), axis=-1)
  tiles = tiles.astype(jnp.int32)
  count = jnp.maximum(listed.sum(axis=-1), 1)[:, :, None]
  split = count - both_whole.sum(axis=-1)[:, :, None]
  seen = jnp.take_along_axis(visible_BCWJ, tiles[:, :, None, :], axis=-1)
  first = jnp.minimum(jnp.where(seen.any(axis=-1), jnp.argmax(seen, axis=-1), J), count - 1)
  bounds = jnp.stack(jnp.broadcast_arrays(first, split, count), axis=-1)
  return tiles, lax.convert_element_type(bounds, jnp.int32)


def plan_over_keys(q_seg_BT, kv_seg_BS, *, q_tile: int, k_tile: int, causal: bool,
                   per_cta: int = 1, window: int | None = None):
  """The plan of a kernel whose CTAs own `per_cta` query tiles of `q_tile`
  rows each and stream key tiles of `k_tile` (forward, dQ): `schedule` of
  [B, T / (q_tile * per_cta), per_cta, S / k_tile]."""
  visible, whole = pair_visibility(q_seg_BT, kv_seg_BS, q_tile, k_tile, causal, window)
  B, tiles_q, tiles_k = visible.shape
  shape = (B, tiles_q // per_cta, per_cta, tiles_k)
  return schedule(visible.reshape(shape), whole.reshape(shape))


def plan_over_queries(q_seg_BT, kv_seg_BS, *, q_tile: int, k_tile: int, causal: bool,
                      per_cta: int = 1, window: int | None = None):
  """The plan of a kernel whose CTAs own `per_cta` key tiles of `k_tile`
  each and stream query tiles of `q_tile` (dK/dV): `schedule` of
  [B, S / (k_tile * per_cta), per_cta, T / q_tile]."""
  visible, whole = pair_visibility(q_seg_BT, kv_seg_BS, q_tile, k_tile, causal, window)
  B, tiles_q, tiles_k = visible.shape
  shape = (B, tiles_k // per_cta, per_cta, tiles_q)
  return schedule(visible.transpose(0, 2, 1).reshape(shape),
                  whole.transpose(0, 2, 1).reshape(shape))
