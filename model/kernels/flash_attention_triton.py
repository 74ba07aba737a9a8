"""FlashAttention forward and backward as portable Pallas kernels.

The lesson's "Efficient attention variants" section, made concrete: exact
attention computed tile by tile with the online softmax, so the T x S score
matrix never exists in memory.

- Forward (`_forward_kernel`): one program per (query tile, batch, head). It
  keeps a running maximum m, normaliser l and float32 accumulator o, and for
  each key tile s updates m' = max(m, max(s)), l' = l * exp(m - m') +
  sum(exp(s - m')), o' = o * exp(m - m') + exp(s - m') V; at the end it writes
  o / l and the log-sum-exp m + log(l) of every query row.
- Backward (`_dkdv_kernel`, `_dq_kernel`): the tiles of P = exp(s - lse) are
  recomputed from the saved log-sum-exp, never stored. With
  delta = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - delta),
  dK = scale * dS^T Q, dQ = scale * dS K.
- Soft-cap (`softcap` c, Gemma-2): the scaled scores s become c tanh(s / c)
  in every kernel's tile, and the backward multiplies dS by 1 - tanh^2(s / c)
  before dK and dQ (`common.soft_cap_tile`, `common.soft_cap_grad`).

The exponentials are taken base 2 (exp2 is the native GPU instruction): the
scores are multiplied by scale * log2(e) and the saved log-sum-exp is in
base 2 as well.

Masks: causal, segment ids, and keys past the true length when the
sequence was padded to whole tiles, with the semantics and tile arithmetic
of `common.py`: the tiles no query sees (above the diagonal) are skipped and
the mask is applied only on the tiles that need it. With segment ids each
program visits the tiles of its block-sparse plan (`block_sparse.py`): tiles
that share no segment are skipped, tiles inside one segment (below the
diagonal) run without a mask.

Grouped-query and multi-query attention (H query heads, K KV heads): query
head h reads KV head h // (H // K) through the BlockSpec index map, and dK,
dV of a KV head are summed over its H // K query heads inside one program, so
K and V are never copied per query head.

The kernels are plain `pl.pallas_call`s: Triton lowering on an NVIDIA GPU,
the Pallas interpreter everywhere else. On Hopper (H100/H200), inputs the
Mosaic GPU kernels of `flash_attention_hopper.py` take (16-bit, head_dim 64
or 128) go there instead; on a TPU, the Mosaic TPU kernels of
`flash_attention_tpu.py`: `router.choose_lowering` is the rule and
`router.flash_attention(lowering=...)` overrides it.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from model.kernels import block_sparse
from model.kernels import is_hopper
from model.kernels import common

MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the three kernels.

  Attributes:
    block_q, block_k: query and key tile of the forward kernel.
    block_q_dkv, block_k_dkv: tiles of the dK/dV kernel (one key tile per
      program, looping over query tiles).
    block_q_dq, block_k_dq: tiles of the dQ kernel (one query tile per
      program, looping over key tiles).
    num_warps, num_stages: Triton warps per program and software-pipeline
      depth of the forward kernel.
    num_warps_bwd, num_stages_bwd: the same for the two backward kernels.
  """
  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  block_q_dq: int
  block_k_dq: int
  num_warps: int
  num_stages: int
  num_warps_bwd: int
  num_stages_bwd: int

  @property
  def q_multiple(self) -> int:
    """The query length is padded to a multiple of this."""
    return max(self.block_q, self.block_q_dkv, self.block_q_dq)

  @property
  def kv_multiple(self) -> int:
    """The key length is padded to a multiple of this."""
    return max(self.block_k, self.block_k_dkv, self.block_k_dq)


def _fit(block: int, length: int) -> int:
  """`block`, shrunk to the smallest power of two >= 16 that covers `length`."""
  return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def choose_block_sizes(q_len: int, kv_len: int, head_dim: int, *,
                       backend: str, device_kind: str = "") -> BlockSizes:
  """Picks tile sizes and pipeline depth for a device and a shape.

  The rule, per device:

  - Hopper (H100, H200, H800, GH200; 228 KiB of shared memory per SM):
    forward query tile 128; key tile 128 for head_dim <= 64 and 64 for
    head_dim 128, so that three pipeline stages of K and V tiles fit in
    shared memory; 4 warps for head_dim <= 64, 8 above (so the float32
    accumulator takes about 64 registers a thread). Backward: the dK/dV
    kernel holds a key tile of 128 (64 for head_dim > 64) and streams query
    tiles of 64; the dQ kernel is the mirror image. 2 stages, 8 warps (two
    float32 accumulators, dK and dV).
  - Any other GPU (Ampere and older, smaller shared memory): tiles of 64,
    2 stages, 4 warps.
  - No GPU (the Pallas interpreter): tiles of 128. The interpreter's cost is
    per grid step and per loop iteration, so fewer, larger tiles are faster;
    warps and stages are ignored.

  Every tile is then shrunk to the smallest power of two >= 16 that covers
  the sequence, so a short sequence (decoding, T = 1) is one small tile.
  These are starting points; `bench/attention.py --tune` measures the
  alternatives on the card at hand.
  """
  if backend == "gpu" and is_hopper(device_kind):
    wide = 128 if head_dim <= 64 else 64
    blocks = BlockSizes(
        block_q=128, block_k=wide, block_q_dkv=64, block_k_dkv=wide,
        block_q_dq=wide, block_k_dq=64,
        num_warps=4 if head_dim <= 64 else 8, num_stages=3,
        num_warps_bwd=8, num_stages_bwd=2)
  elif backend == "gpu":
    blocks = BlockSizes(
        block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64,
        block_q_dq=64, block_k_dq=64,
        num_warps=4, num_stages=2, num_warps_bwd=4, num_stages_bwd=2)
  else:
    blocks = BlockSizes(
        block_q=128, block_k=128, block_q_dkv=128, block_k_dkv=128,
        block_q_dq=128, block_k_dq=128,
        num_warps=4, num_stages=1, num_warps_bwd=4, num_stages_bwd=1)
  return dataclasses.replace(
      blocks,
      block_q=_fit(blocks.block_q, q_len),
      block_k=_fit(blocks.block_k, kv_len),
      block_q_dkv=_fit(blocks.block_q_dkv, q_len),
      block_k_dkv=_fit(blocks.block_k_dkv, kv_len),
      block_q_dq=_fit(blocks.block_q_dq, q_len),
      block_k_dq=_fit(blocks.block_k_dq, kv_len))


def _compiler_params(num_warps: int, num_stages: int):
  """The one backend-specific call: Triton launch parameters.

  `pltriton.CompilerParams` selects the Triton lowering of `pl.pallas_call`
  on a GPU under both jax 0.10 and 0.11 (without it, 0.10 would pick Mosaic
  GPU); the interpreter ignores it. If Triton lowering moves, change it here.
  """
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call, shared by the forward and backward."""
  scale: float
  causal: bool
  softcap: float | None  # c of c tanh(s / c) on the scaled scores; None: no cap
  window: int | None  # the causal sliding window, or None; with one, segment ids are given
  q_len: int  # true query length (the arrays are padded past it)
  kv_len: int  # true key length (the arrays are padded past it)
  blocks: BlockSizes
  interpret: bool


def _dot(a, b, contract_a: int, contract_b: int):
  """2-D matmul contracting the given axes, accumulated in float32."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _mask(q_start, k_start, block_q: int, block_k: int, cfg: _Config, *,
          ragged: bool, q_seg_T=None, kv_seg_S=None):
  """`common.visible` for a [block_q, block_k] tile; `ragged`: the tile may
  hold padded keys."""
  return common.visible(q_start + jnp.arange(block_q, dtype=jnp.int32),
                        k_start + jnp.arange(block_k, dtype=jnp.int32),
                        along_q=lambda x: x[:, None], along_k=lambda x: x[None, :],
                        causal=cfg.causal, kv_len=cfg.kv_len if ragged else None,
                        window=cfg.window,
                        q_seg=q_seg_T, kv_seg=kv_seg_S)


def _key_tile_mask(q_start, kv_tile, block_q: int, block_k: int, cfg: _Config, *,
                   masked: bool, q_seg_T, kv_seg_ref):
  """The mask of key tile `kv_tile` for the query tile at `q_start` (forward
  and dQ kernels), or None for a step seen whole."""
  if not masked:
    return None
  k_start = kv_tile * block_k
  return _mask(q_start, k_start, block_q, block_k, cfg,
               ragged=q_seg_T is None and cfg.kv_len % block_k != 0, q_seg_T=q_seg_T,
               kv_seg_S=None if q_seg_T is None else kv_seg_ref[pl.ds(k_start, block_k)])


def _scores(q_TD, k_SD, mask, cfg: _Config):
  """Base-2 scores of a tile (soft-capped with `cfg.softcap`), masked entries
  -inf, [block_q, block_k] float32, and the cap's tanh tile (None without a
  cap) for the backward."""
  s_TS, tanh_TS = common.soft_cap_tile(_dot(q_TD, k_SD, 1, 1) * cfg.scale, cfg.softcap)
  s_TS = s_TS * common.LOG2_E
  return (s_TS if mask is None else jnp.where(mask, s_TS, -jnp.inf)), tanh_TS


def _fori(lo, hi, body, carry):
  """`lax.fori_loop`, left out when its bounds are Python ints and the range
  is empty."""
  if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def _loop_over_kv_tiles(tile, carry, q_start, block_q: int, block_k: int, cfg: _Config,
                        plan):
  """Runs `tile(j, carry, masked=...)` over the key tiles a query tile sees.

  With segment ids, the tiles of its plan (`plan`: the refs of its key tile
  list and bounds, see `_plan_args`), the masked ones first. Otherwise the
  tiles `common.kv_tile_range` gives: those seen whole without the mask,
  then the others with it.
  """
  if plan is not None:
    return _loop_over_plan(tile, carry, plan)
  whole, seen = common.kv_tile_range(q_start, block_q, block_k=block_k,
                                     kv_len=cfg.kv_len, causal=cfg.causal)
  carry = _fori(0, whole, functools.partial(tile, masked=False), carry)
  return _fori(whole, seen, functools.partial(tile, masked=True), carry)


def _loop_over_plan(tile, carry, plan):
  """`tile(j, carry, masked=...)` over the tiles of a listed plan
  (`block_sparse.schedule`): steps [0, split) masked, [split, count) seen
  whole."""
  tiles_ref, bounds_ref = plan
  split, count = bounds_ref[1], bounds_ref[2]
  carry = lax.fori_loop(0, split, lambda n, c: tile(tiles_ref[n], c, masked=True), carry)
  return lax.fori_loop(split, count, lambda n, c: tile(tiles_ref[n], c, masked=False), carry)


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, tiles_ref, bounds_ref,
                    o_ref, lse_ref, *, cfg: _Config):
  """Forward pass: the online softmax over the key tiles of one query tile."""
  block_q, block_k = cfg.blocks.block_q, cfg.blocks.block_k
  q_start = pl.program_id(0) * block_q
  q_TD = q_ref[...]
  q_seg_T = None if q_seg_ref is None else q_seg_ref[...]

  def tile(kv_tile, carry, masked):
    o_TD, m_T, l_T = carry
    k_slice = pl.ds(kv_tile * block_k, block_k)
    mask = _key_tile_mask(q_start, kv_tile, block_q, block_k, cfg, masked=masked,
                          q_seg_T=q_seg_T, kv_seg_ref=kv_seg_ref)
    s_TS, _ = _scores(q_TD, k_ref[k_slice, :], mask, cfg)
    m_new_T = jnp.maximum(m_T, jnp.max(s_TS, axis=1))
    # A row with no visible key so far keeps m = -inf; subtracting 0 instead
    # keeps exp2(-inf - m) = 0 rather than NaN.
    m_safe_T = jnp.where(m_new_T == -jnp.inf, 0.0, m_new_T)
    correction_T = jnp.exp2(m_T - m_safe_T)
    p_TS = jnp.exp2(s_TS - m_safe_T[:, None])
    l_T = correction_T * l_T + jnp.sum(p_TS, axis=1)
    v_SD = v_ref[k_slice, :]
    o_TD = correction_T[:, None] * o_TD + _dot(p_TS.astype(v_SD.dtype), v_SD, 1, 0)
    return o_TD, m_new_T, l_T

  carry = (jnp.zeros(q_TD.shape, jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = _loop_over_kv_tiles(tile, carry, q_start, block_q, block_k, cfg,
                              common.plan_refs(tiles_ref, bounds_ref))
  o_TD, m_T, l_T = carry
  empty_T = l_T == 0.0
  o_ref[...] = (o_TD / jnp.where(empty_T, 1.0, l_T)[:, None]).astype(o_ref.dtype)
  # +inf for an empty row makes the backward's exp2(s - lse) exactly 0.
  lse_ref[...] = jnp.where(empty_T, jnp.inf, m_T + jnp.log2(l_T))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
                 kv_seg_ref, tiles_ref, bounds_ref, dk_ref, dv_ref, *, cfg: _Config):
  """Backward, dK and dV of one key tile: loop over the query heads that share
  this KV head and over their query tiles, recomputing P from the lse."""
  block_q, block_k = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
  num_q_tiles = pl.cdiv(cfg.q_len, block_q)
  group = q_ref.shape[1]
  k_start = pl.program_id(0) * block_k
  k_SD = k_ref[...]
  v_SD = v_ref[...]
  kv_seg_S = None if kv_seg_ref is None else kv_seg_ref[...]

  def tile(q_tile, carry, head, masked):
    dk_SD, dv_SD = carry
    q_slice = pl.ds(q_tile * block_q, block_q)
    q_TD = q_ref[q_slice, head, :]
    do_TD = do_ref[q_slice, head, :]
    # Padded keys are this program's own rows, zero and cut off: no mask.
    mask = None if not masked else _mask(
        q_tile * block_q, k_start, block_q, block_k, cfg, ragged=False,
        q_seg_T=None if kv_seg_S is None else q_seg_ref[q_slice], kv_seg_S=kv_seg_S)
    s_TS, tanh_TS = _scores(q_TD, k_SD, mask, cfg)
    p_TS = jnp.exp2(s_TS - lse_ref[head, q_slice][:, None])
    dv_SD = dv_SD + _dot(p_TS.astype(do_TD.dtype), do_TD, 0, 0)
    dp_TS = _dot(do_TD, v_SD, 1, 1)
    ds_TS = common.soft_cap_grad(p_TS * (dp_TS - delta_ref[head, q_slice][:, None]), tanh_TS)
    dk_SD = dk_SD + _dot(ds_TS.astype(q_TD.dtype), q_TD, 0, 0)
    return dk_SD, dv_SD

  plan = common.plan_refs(tiles_ref, bounds_ref)

  def head_loop(head, carry):
    if plan is not None:
      return _loop_over_plan(functools.partial(tile, head=head), carry, plan)
    first, whole = common.q_tile_range(k_start, block_k, block_q=block_q,
                                       num_q_tiles=num_q_tiles, causal=cfg.causal)
    carry = _fori(first, whole, functools.partial(tile, head=head, masked=True), carry)
    return _fori(whole, num_q_tiles, functools.partial(tile, head=head, masked=False),
                 carry)

  zeros_SD = jnp.zeros(k_SD.shape, jnp.float32)
  dk_SD, dv_SD = lax.fori_loop(0, group, head_loop, (zeros_SD, zeros_SD))
  dk_ref[...] = (dk_SD * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_SD.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
               kv_seg_ref, tiles_ref, bounds_ref, dq_ref, *, cfg: _Config):
  """Backward, dQ of one query tile: loop over the key tiles, recomputing P."""
  block_q, block_k = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
  q_start = pl.program_id(0) * block_q
  q_TD = q_ref[...]
  do_TD = do_ref[...]
  lse_T = lse_ref[...]
  delta_T = delta_ref[...]
  q_seg_T = None if q_seg_ref is None else q_seg_ref[...]

  def tile(kv_tile, dq_TD, masked):
    k_slice = pl.ds(kv_tile * block_k, block_k)
    mask = _key_tile_mask(q_start, kv_tile, block_q, block_k, cfg, masked=masked,
                          q_seg_T=q_seg_T, kv_seg_ref=kv_seg_ref)
    k_SD = k_ref[k_slice, :]
    s_TS, tanh_TS = _scores(q_TD, k_SD, mask, cfg)
    p_TS = jnp.exp2(s_TS - lse_T[:, None])
    dp_TS = _dot(do_TD, v_ref[k_slice, :], 1, 1)
    ds_TS = common.soft_cap_grad(p_TS * (dp_TS - delta_T[:, None]), tanh_TS)
    return dq_TD + _dot(ds_TS.astype(k_SD.dtype), k_SD, 1, 0)

  dq_TD = jnp.zeros(q_TD.shape, jnp.float32)
  dq_TD = _loop_over_kv_tiles(tile, dq_TD, q_start, block_q, block_k, cfg,
                              common.plan_refs(tiles_ref, bounds_ref))
  dq_ref[...] = (dq_TD * cfg.scale).astype(dq_ref.dtype)


def _plan_args(q_seg_BT, kv_seg_BS, *, over_keys: bool, q_tile: int, k_tile: int,
               causal: bool, window: int | None):
  """With segment ids, the block-sparse plan of a kernel
  (`block_sparse.plan_over_keys` for the forward and dQ kernels, whose
  programs own a query tile; `plan_over_queries` for dK/dV) and its
  BlockSpecs, as (arrays, specs): tiles [B, P, J] (J padded to a power of
  two for Triton) and bounds [B, P, 4] (first, split, count, 0) of the P
  program tiles. Without them, (None, None) twice."""
  if q_seg_BT is None:
    return (None, None), (None, None)
  make = block_sparse.plan_over_keys if over_keys else block_sparse.plan_over_queries
  tiles, bounds = make(q_seg_BT, kv_seg_BS, q_tile=q_tile, k_tile=k_tile, causal=causal,
                       window=window)
  tiles = common.pad_to(tiles, 2, pl.next_power_of_2(tiles.shape[2]))
  bounds = common.pad_to(bounds[:, :, 0], 2, 4)
  specs = (pl.BlockSpec((None, None, tiles.shape[2]), lambda i, b, h: (b, i, 0)),
           pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)))
  return (tiles, bounds), specs


def _forward(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, cfg: _Config):
  """Launches the forward kernel: (out [B, T, H, D], lse [B, H, T] base 2)."""
  B, T, H, D = q_BTHD.shape
  S = k_BSKD.shape[1]
  group = H // k_BSKD.shape[2]
  block_q = cfg.blocks.block_q
  kv_spec = pl.BlockSpec((None, S, None, D),
                         lambda t, b, h: (b, 0, lax.div(h, group), 0))
  q_spec = pl.BlockSpec((None, block_q, None, D), lambda t, b, h: (b, t, h, 0))
  has_seg = q_seg_BT is not None
  plan, plan_specs = _plan_args(q_seg_BT, kv_seg_BS, over_keys=True, q_tile=block_q,
                                k_tile=cfg.blocks.block_k, causal=cfg.causal,
                                window=cfg.window)
  in_specs = [
      q_spec, kv_spec, kv_spec,
      pl.BlockSpec((None, block_q), lambda t, b, h: (b, t)) if has_seg else None,
      pl.BlockSpec((None, S), lambda t, b, h: (b, 0)) if has_seg else None,
      *plan_specs,
  ]
  return pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg),
      grid=(T // block_q, B, H),
      in_specs=in_specs,
      out_specs=[q_spec,
                 pl.BlockSpec((None, None, block_q), lambda t, b, h: (b, h, t))],
      out_shape=[jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
                 jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
      compiler_params=_compiler_params(cfg.blocks.num_warps,
                                       cfg.blocks.num_stages),
      interpret=cfg.interpret,
      name="flash_attention_forward",
  )(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, *plan)


def _backward(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, o_BTHD, lse_BHT,
              do_BTHD, cfg: _Config):
  """Launches the dK/dV and dQ kernels: (dq, dk, dv)."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  group = H // K
  blocks = cfg.blocks
  has_seg = q_seg_BT is not None
  delta_BHT = common.delta(o_BTHD, do_BTHD)
  params = _compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd)
  args = (q_BTHD, k_BSKD, v_BSKD, do_BTHD, lse_BHT, delta_BHT, q_seg_BT,
          kv_seg_BS)

  # dK, dV: grid over (key tile, batch, KV head); all query heads of the group.
  block_k = blocks.block_k_dkv
  group_q_spec = pl.BlockSpec((None, T, group, D), lambda s, b, g: (b, 0, g, 0))
  group_row_spec = pl.BlockSpec((None, group, T), lambda s, b, g: (b, g, 0))
  kv_tile_spec = pl.BlockSpec((None, block_k, None, D),
                              lambda s, b, g: (b, s, g, 0))
  plan, plan_specs = _plan_args(q_seg_BT, kv_seg_BS, over_keys=False,
                                q_tile=blocks.block_q_dkv, k_tile=block_k, causal=cfg.causal,
                                window=cfg.window)
  dk_BSKD, dv_BSKD = pl.pallas_call(
      functools.partial(_dkdv_kernel, cfg=cfg),
      grid=(S // block_k, B, K),
      in_specs=[
          group_q_spec, kv_tile_spec, kv_tile_spec, group_q_spec,
          group_row_spec, group_row_spec,
          pl.BlockSpec((None, T), lambda s, b, g: (b, 0)) if has_seg else None,
          pl.BlockSpec((None, block_k), lambda s, b, g: (b, s)) if has_seg else None,
          *plan_specs,
      ],
      out_specs=[kv_tile_spec, kv_tile_spec],
      out_shape=[jax.ShapeDtypeStruct(k_BSKD.shape, k_BSKD.dtype),
                 jax.ShapeDtypeStruct(v_BSKD.shape, v_BSKD.dtype)],
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dkdv",
  )(*args, *plan)

  # dQ: grid over (query tile, batch, query head).
  block_q = blocks.block_q_dq
  q_tile_spec = pl.BlockSpec((None, block_q, None, D),
                             lambda t, b, h: (b, t, h, 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda t, b, h: (b, h, t))
  kv_spec = pl.BlockSpec((None, S, None, D),
                         lambda t, b, h: (b, 0, lax.div(h, group), 0))
  plan, plan_specs = _plan_args(q_seg_BT, kv_seg_BS, over_keys=True, q_tile=block_q,
                                k_tile=blocks.block_k_dq, causal=cfg.causal,
                                window=cfg.window)
  dq_BTHD = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(T // block_q, B, H),
      in_specs=[
          q_tile_spec, kv_spec, kv_spec, q_tile_spec, row_spec, row_spec,
          pl.BlockSpec((None, block_q), lambda t, b, h: (b, t)) if has_seg else None,
          pl.BlockSpec((None, S), lambda t, b, h: (b, 0)) if has_seg else None,
          *plan_specs,
      ],
      out_specs=q_tile_spec,
      out_shape=jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dq",
  )(*args, *plan)
  return dq_BTHD, dk_BSKD, dv_BSKD


_flash = common.flash_vjp(_forward, _backward)


def _setup(q_BTHD, k_BSKD, *, causal: bool, scale: float, block_q: int | None,
           block_k: int | None, interpret: bool, device, softcap: float | None,
           window: int | None = None):
  """The call's `_Config` and `common.padded_call`'s padding (tiles chosen for
  `device` by `choose_block_sizes` unless `block_q` / `block_k` are given;
  the head dim zero-padded to a power of two >= 16, the lengths to whole
  tiles; with a sliding `window`, the plan's segment ids)."""
  T, D = q_BTHD.shape[1], q_BTHD.shape[3]
  S = k_BSKD.shape[1]
  blocks = choose_block_sizes(T, S, D, backend=device.platform,
                              device_kind=device.device_kind)
  if block_q is not None:
    blocks = dataclasses.replace(blocks, block_q=block_q, block_q_dkv=block_q,
                                 block_q_dq=block_q)
  if block_k is not None:
    blocks = dataclasses.replace(blocks, block_k=block_k, block_k_dkv=block_k,
                                 block_k_dq=block_k)
  cfg = _Config(scale=scale, causal=causal, softcap=softcap, window=window, q_len=T, kv_len=S,
                blocks=blocks, interpret=interpret)
  return cfg, dict(q_multiple=blocks.q_multiple, kv_multiple=blocks.kv_multiple,
                   head_dim=max(MIN_BLOCK, pl.next_power_of_2(D)),
                   segments=window is not None)


def triton_flash_attention(q_BTHD, k_BSKD, v_BSKD, *, q_segment_ids, kv_segment_ids,
                           **options):
  """The portable kernels on [B, T, H, D] inputs; `options` (causal, scale,
  block_q, block_k, interpret, device, softcap, window) as `_setup`'s."""
  cfg, padding = _setup(q_BTHD, k_BSKD, **options)
  return common.padded_call(
      lambda q, k, v, q_seg, kv_seg: _flash(q, k, v, q_seg, kv_seg, cfg),
      q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, **padding)


def triton_parts(q_BTHD, k_BSKD, **options) -> common.Parts:
  """The portable kernels' forward (with its lse) and backward for inputs
  shaped like q and k; `options` as `triton_flash_attention`'s."""
  cfg, padding = _setup(q_BTHD, k_BSKD, **options)
  return common.padded_parts(lambda *a: _forward(*a, cfg), lambda *a: _backward(*a, cfg),
                             q_BTHD, k_BSKD, **padding)
