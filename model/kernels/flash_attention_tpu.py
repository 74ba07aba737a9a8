"""FlashAttention forward and backward for TPUs, lowered by Mosaic TPU.

The same algorithm as the portable kernels of `flash_attention.py` (online
softmax forward; backward recomputing P from the saved log-sum-exp, with
delta = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - delta),
dK = scale * dS^T Q, dQ = scale * dS K; a soft-cap as in `common.py`), laid
out the way a TPU core wants
it: one program per grid step, with the streamed tile a grid axis of its
own ("arbitrary", run in order) instead of a loop inside the program, so
Mosaic's pipeline fetches the next K/V (or Q/dO) tile by DMA while the
current one is on the MXU. Running state (m, l, the float32 accumulators)
lives in VMEM scratch across those steps.

Which tiles a program streams comes from a block-sparse plan
(`block_sparse.plan_over_keys` / `plan_over_queries`), handed to the kernels
as scalar-prefetch arguments in SMEM: the index maps of the streamed
operands read the plan, so tiles that see nothing (above the causal
diagonal, or sharing no segment) are never fetched or computed, and tiles
seen whole run without a mask. Without segment ids the plan is built from
one segment covering the true lengths (shared by every batch row), which
also masks the keys past the true length when the lengths were padded up to
whole tiles. Steps past a program's `count` keep the last tile's block index
(no new DMA) and do nothing.

Layout: q, k, v are transposed to [B, H, T, D] / [B, K, S, D] so that a tile
is a (rows, D) slab in the two minor dimensions TPUs tile by (8 sublanes x
128 lanes). Query head h reads KV head h // G through the index map (G query
heads per KV head), and the dK/dV kernel sums over the G query heads of a KV
head as a grid axis, so K and V are never copied per query head. A query
whose keys are all masked gets a zero output and zero gradients. Values
may be narrower than queries and keys (v [B, K, S, D_v], multi-head latent
attention's 128 against 192): V, O, dO and dV tiles are D_v wide, so P V,
dO V^T and P^T dO cost D_v, not D, per score (zero-padding V to D would add
D / D_v - 1 = 50% to those products and to the O and dO bytes).

On a CPU the kernels run in the Pallas interpreter (`interpret=True`; it
keeps the TPU semantics used here: scalar prefetch, VMEM scratch that
persists across the steps of a program), which is how the test suite checks
them against the reference; `tests/test_flash_attention_tpu.py` also
compiles them for TPU v5e and v5p with libtpu, without a TPU.
"""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from model.kernels import block_sparse
from model.kernels import common

LANES = 128  # the lane width: the key tile of a compiled kernel is a multiple of it
_SUBLANES = 16  # rows of a bf16 (8 x 128 x 32-bit) vreg: the query tile is a multiple of it
_HEAD_DIM_MULTIPLE = 64  # each head dim (q and k's, v's) is zero-padded to a multiple of this


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
  """Tiles of the three kernels and the scoped-VMEM limit they compile with.

  Attributes:
    block_q, block_k: query and key tile of the forward and dQ kernels.
    block_q_dkv, block_k_dkv: tiles of the dK/dV kernel.
    vmem_limit_bytes: the scoped VMEM the compiler may use per kernel.
  """
  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  vmem_limit_bytes: int


# Per generation: the largest tiles tried and the scoped-VMEM limit. v6e's
# MXU is 256 x 256 (so its key tile may be 1024), v4, v5e and v5p have
# 128 x 128 MXUs. VMEM per TensorCore (JAX's `pallas.mosaic.tpu_info`):
# 16 MiB on v4, 64 MiB on v5p, 128 MiB on v5e and v6e; each limit leaves
# room for the compiler's own scratch.
_GENERATIONS = {
    "v4": (512, 512, 12 << 20),
    "v5e": (512, 512, 32 << 20),
    "v5p": (512, 512, 32 << 20),
    "v6e": (512, 1024, 32 << 20),
}


def tpu_generation(device_kind: str) -> str | None:
  """"v4", "v5e", "v5p" or "v6e" from a device_kind ("TPU v5 lite", ...)."""
  kind = device_kind.lower()
  if "v6" in kind:
    return "v6e"
  if "v5" in kind:
    return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p"
  if "v4" in kind:
    return "v4"
  return None


def vmem_bytes(block_q: int, block_k: int, head_dim: int, itemsize: int) -> int:
  """An upper estimate of one kernel's VMEM: its double-buffered tiles (four
  row-tiles of block_q or block_k rows, the most any kernel streams), two
  float32 accumulators, and the float32 [block_q, block_k] intermediates
  (scores, P, dP, dS) with their row vectors padded to 128 lanes."""
  tiles = 2 * 4 * max(block_q, block_k) * head_dim * itemsize
  accumulators = 2 * max(block_q, block_k) * head_dim * 4
  rows = 6 * max(block_q, block_k) * LANES * 4
  return tiles + accumulators + rows + 4 * block_q * block_k * 4


def choose_tpu_blocks(q_len: int, kv_len: int, head_dim: int, itemsize: int, *,
                      device_kind: str) -> TpuBlocks:
  """Tiles for a TPU generation and a shape.

  Start from the generation's largest tiles (`_GENERATIONS`; v5p's for an
  unknown kind, and for the interpreter), halve the larger tile until
  `vmem_bytes` fits in half the scoped-VMEM limit (so a larger head dim
  may get smaller tiles: on v6e, 512 x 512 at head_dim 256 against
  512 x 1024 at 64; on v4, 512 x 256 at 128), then shrink each tile to
  cover the sequence:
  the query tile to a multiple of 16 rows, the key tile to a multiple of
  128 lanes. `bench/compile_tpu.py` prints what the compiler makes of them.
  """
  block_q, block_k, limit = _GENERATIONS[tpu_generation(device_kind) or "v5p"]
  while vmem_bytes(block_q, block_k, head_dim, itemsize) > limit // 2 and max(
      block_q, block_k) > LANES:
    if block_k >= block_q:
      block_k //= 2
    else:
      block_q //= 2
  block_q = min(block_q, common.round_up(q_len, _SUBLANES))
  block_k = min(block_k, common.round_up(kv_len, LANES))
  return TpuBlocks(block_q=block_q, block_k=block_k, block_q_dkv=block_q,
                   block_k_dkv=block_k, vmem_limit_bytes=limit)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call, shared by the forward and backward."""
  scale: float
  causal: bool
  softcap: float | None  # c of c tanh(s / c) on the scaled scores; None: no cap
  window: int | None  # the causal sliding window, or None
  num_kv_heads: int
  blocks: TpuBlocks
  interpret: bool
  per_batch_plan: bool  # segment ids given: one plan per batch row


def _dot(a, b, contract_a: int, contract_b: int):
  """2-D matmul contracting the given axes, accumulated in float32."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _scores(q_TD, k_SD, q_start, k_start, q_seg_T1, kv_seg_1S, *, cfg: _Config,
            masked: bool):
  """Scaled scores of a tile [block_q, block_k] float32, soft-capped with
  `cfg.softcap`; with `masked`, -inf where the key is after the query
  (causal), outside the sliding window, or in another segment or padding
  (id 0). Returns them and the
  cap's tanh tile (None without a cap) for the backward."""
  s_TS, tanh_TS = common.soft_cap_tile(_dot(q_TD, k_SD, 1, 1) * cfg.scale, cfg.softcap)
  if not masked:
    return s_TS, tanh_TS
  visible = (q_seg_T1 == kv_seg_1S) & (kv_seg_1S != 0)
  if cfg.causal:
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, s_TS.shape, 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, s_TS.shape, 1)
    visible &= k_pos <= q_pos
    if cfg.window is not None:
      visible &= q_pos - k_pos < cfg.window
  return jnp.where(visible, s_TS, -jnp.inf), tanh_TS


def _plan(q_seg_BT, kv_seg_BS, *, over_keys: bool, q_tile: int, k_tile: int,
          causal: bool, window: int | None):
  """The block-sparse plan, flattened for SMEM: (tiles [P * N], bounds
  [P * 2] of (split, count)) over the P = B' x C program tiles, and N, the
  length of each tile list."""
  make = block_sparse.plan_over_keys if over_keys else block_sparse.plan_over_queries
  tiles, bounds = make(q_seg_BT, kv_seg_BS, q_tile=q_tile, k_tile=k_tile, causal=causal,
                       window=window)
  N = tiles.shape[2]
  return tiles.reshape(-1), bounds[:, :, 0, 1:].reshape(-1), N


def _step(tiles_ref, bounds_ref, program, n, N: int):
  """The tile a program streams at step n (the last listed one past its
  count, so the block index repeats and nothing is fetched)."""
  count = bounds_ref[2 * program + 1]
  return tiles_ref[program * N + jnp.minimum(n, count - 1)]


def _run_plan_step(update, tiles_ref, bounds_ref, *, b, tile, n, N: int, per_batch_plan: bool,
                   num_tiles: int):
  """Step n of the plan of this program's (batch, tile): `update(start_tile,
  masked)` on the listed tile, masked for the plan's first `split` steps,
  unmasked up to its count, and nothing past it."""
  program = (b if per_batch_plan else 0) * num_tiles + tile
  split, count = bounds_ref[2 * program], bounds_ref[2 * program + 1]
  listed = _step(tiles_ref, bounds_ref, program, n, N)
  pl.when(n < split)(lambda: update(listed, masked=True))
  pl.when((n >= split) & (n < count))(lambda: update(listed, masked=False))


def _forward_kernel(tiles_ref, bounds_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref,
                    o_ref, lse_ref, m_ref, l_ref, acc_ref, *, cfg: _Config, N: int,
                    num_q_tiles: int):
  """Forward, one (batch, head, query tile) over the key tiles of its plan."""
  b, _, i, n = (pl.program_id(a) for a in range(4))
  block_q, block_k = cfg.blocks.block_q, cfg.blocks.block_k

  @pl.when(n == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def update(k_tile, masked: bool):
    s_TS, _ = _scores(q_ref[...], k_ref[...], i * block_q, k_tile * block_k, q_seg_ref[...],
                      kv_seg_ref[...], cfg=cfg, masked=masked)
    m_T1 = m_ref[...]
    m_new_T1 = jnp.maximum(m_T1, jnp.max(s_TS, axis=1, keepdims=True))
    # A row with no visible key so far keeps m = -inf; subtracting 0 instead
    # keeps exp(-inf - m) = 0 rather than NaN.
    m_safe_T1 = jnp.where(m_new_T1 == -jnp.inf, 0.0, m_new_T1)
    correction_T1 = jnp.exp(m_T1 - m_safe_T1)
    p_TS = jnp.exp(s_TS - m_safe_T1)
    l_ref[...] = correction_T1 * l_ref[...] + jnp.sum(p_TS, axis=1, keepdims=True)
    v_SD = v_ref[...]
    acc_ref[...] = correction_T1 * acc_ref[...] + _dot(p_TS.astype(v_SD.dtype), v_SD, 1, 0)
    m_ref[...] = m_new_T1

  _run_plan_step(update, tiles_ref, bounds_ref, b=b, tile=i, n=n, N=N,
                 per_batch_plan=cfg.per_batch_plan, num_tiles=num_q_tiles)

  @pl.when(n == N - 1)
  def _finish():
    l_T1 = l_ref[...]
    empty_T1 = l_T1 == 0.0
    o_ref[...] = (acc_ref[...] / jnp.where(empty_T1, 1.0, l_T1)).astype(o_ref.dtype)
    # +inf for an empty row makes the backward's exp(s - lse) exactly 0.
    lse_ref[...] = jnp.where(empty_T1, jnp.inf, m_ref[...] + jnp.log(l_T1))


def _dq_kernel(tiles_ref, bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               q_seg_ref, kv_seg_ref, dq_ref, acc_ref, *, cfg: _Config, N: int,
               num_q_tiles: int):
  """Backward, dQ of one (batch, head, query tile) over its key tiles."""
  b, _, i, n = (pl.program_id(a) for a in range(4))
  block_q, block_k = cfg.blocks.block_q, cfg.blocks.block_k

  @pl.when(n == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def update(k_tile, masked: bool):
    k_SD = k_ref[...]
    s_TS, tanh_TS = _scores(q_ref[...], k_SD, i * block_q, k_tile * block_k, q_seg_ref[...],
                            kv_seg_ref[...], cfg=cfg, masked=masked)
    p_TS = jnp.exp(s_TS - lse_ref[...])
    dp_TS = _dot(do_ref[...], v_ref[...], 1, 1)
    ds_TS = common.soft_cap_grad(p_TS * (dp_TS - delta_ref[...]), tanh_TS)
    acc_ref[...] += _dot(ds_TS.astype(k_SD.dtype), k_SD, 1, 0)

  _run_plan_step(update, tiles_ref, bounds_ref, b=b, tile=i, n=n, N=N,
                 per_batch_plan=cfg.per_batch_plan, num_tiles=num_q_tiles)

  @pl.when(n == N - 1)
  def _finish():
    dq_ref[...] = (acc_ref[...] * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(tiles_ref, bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 q_seg_ref, kv_seg_ref, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref, *,
                 cfg: _Config, N: int, num_k_tiles: int, group: int):
  """Backward, dK and dV of one (batch, KV head, key tile): over the G query
  heads of the KV head and the query tiles of its plan."""
  b, _, j, g, n = (pl.program_id(a) for a in range(5))
  block_q, block_k = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv

  @pl.when((g == 0) & (n == 0))
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  def update(q_tile, masked: bool):
    q_TD, do_TD = q_ref[...], do_ref[...]
    s_TS, tanh_TS = _scores(q_TD, k_ref[...], q_tile * block_q, j * block_k, q_seg_ref[...],
                            kv_seg_ref[...], cfg=cfg, masked=masked)
    p_TS = jnp.exp(s_TS - lse_ref[...])
    dv_acc_ref[...] += _dot(p_TS.astype(do_TD.dtype), do_TD, 0, 0)
    dp_TS = _dot(do_TD, v_ref[...], 1, 1)
    ds_TS = common.soft_cap_grad(p_TS * (dp_TS - delta_ref[...]), tanh_TS)
    dk_acc_ref[...] += _dot(ds_TS.astype(q_TD.dtype), q_TD, 0, 0)

  _run_plan_step(update, tiles_ref, bounds_ref, b=b, tile=j, n=n, N=N,
                 per_batch_plan=cfg.per_batch_plan, num_tiles=num_k_tiles)

  @pl.when((g == group - 1) & (n == N - 1))
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _compiler_params(cfg: _Config, num_grid_axes: int):
  """Mosaic TPU parameters: every grid axis parallel but the streamed ones
  (the last, and in the dK/dV kernel the query-head axis before it)."""
  streamed = 1 if num_grid_axes == 4 else 2
  semantics = ("parallel",) * (num_grid_axes - streamed) + ("arbitrary",) * streamed
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=cfg.blocks.vmem_limit_bytes)


def _launch_plan(q_seg_BT1, kv_seg_B1S, cfg: _Config, *, over_keys: bool, block_q: int,
                 block_k: int, num_tiles: int):
  """A launch's plan: (tiles, bounds, N, seg_b, streamed), with seg_b(b) the
  batch row of the segment ids (and plan) program b reads, and
  streamed(b, tile, n, tiles_ref, bounds_ref) the tile that program (b, tile)
  streams at step n, for the index maps."""
  tiles, bounds, N = _plan(q_seg_BT1[..., 0], kv_seg_B1S[:, 0], over_keys=over_keys,
                           q_tile=block_q, k_tile=block_k, causal=cfg.causal,
                           window=cfg.window)
  seg_b = (lambda b: b) if cfg.per_batch_plan else (lambda b: 0)

  def streamed(b, tile, n, tiles_ref, bounds_ref):
    return _step(tiles_ref, bounds_ref, seg_b(b) * num_tiles + tile, n, N)

  return tiles, bounds, N, seg_b, streamed


def _over_keys_specs(q_seg_BT1, kv_seg_B1S, cfg: _Config, *, D: int, D_v: int, group: int,
                     num_tiles: int):
  """The plan and block specs of a launch with grid (batch, query head, query
  tile, step over its key tiles), the forward's and dQ's: (tiles, bounds, N,
  specs) with specs q (also dQ), k, v, o (out, dO: values' width D_v), row
  (lse, delta), q_seg, kv_seg."""
  block_q, block_k = cfg.blocks.block_q, cfg.blocks.block_k
  tiles, bounds, N, seg_b, kv_tile = _launch_plan(
      q_seg_BT1, kv_seg_B1S, cfg, over_keys=True, block_q=block_q, block_k=block_k,
      num_tiles=num_tiles)
  def kv(width):
    return pl.BlockSpec((None, None, block_k, width), lambda b, h, i, n, *p: (
        b, lax.div(h, group), kv_tile(b, i, n, *p), 0))

  specs = types.SimpleNamespace(
      q=pl.BlockSpec((None, None, block_q, D), lambda b, h, i, n, *_: (b, h, i, 0)),
      o=pl.BlockSpec((None, None, block_q, D_v), lambda b, h, i, n, *_: (b, h, i, 0)),
      k=kv(D), v=kv(D_v),
      row=pl.BlockSpec((None, None, block_q, 1), lambda b, h, i, n, *_: (b, h, i, 0)),
      q_seg=pl.BlockSpec((None, block_q, 1), lambda b, h, i, n, *_: (seg_b(b), i, 0)),
      kv_seg=pl.BlockSpec((None, 1, block_k), lambda b, h, i, n, *p: (
          seg_b(b), 0, kv_tile(b, i, n, *p))))
  return tiles, bounds, N, specs


def _forward(q_BHTD, k_BKSD, v_BKSD, q_seg_BT1, kv_seg_B1S, cfg: _Config):
  """Launches the forward kernel: (out [B, H, T, D_v], lse [B, H, T, 1])."""
  B, H, T, D = q_BHTD.shape
  D_v = v_BKSD.shape[3]
  group = H // cfg.num_kv_heads
  C = T // cfg.blocks.block_q
  tiles, bounds, N, specs = _over_keys_specs(q_seg_BT1, kv_seg_B1S, cfg, D=D, D_v=D_v,
                                             group=group, num_tiles=C)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, H, C, N),
      in_specs=[specs.q, specs.k, specs.v, specs.q_seg, specs.kv_seg],
      out_specs=[specs.o, specs.row],
      scratch_shapes=[pltpu.VMEM((cfg.blocks.block_q, 1), jnp.float32),
                      pltpu.VMEM((cfg.blocks.block_q, 1), jnp.float32),
                      pltpu.VMEM((cfg.blocks.block_q, D_v), jnp.float32)],
  )
  return pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg, N=N, num_q_tiles=C),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((B, H, T, D_v), q_BHTD.dtype),
                 jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32)],
      compiler_params=_compiler_params(cfg, 4),
      interpret=cfg.interpret,
      name="flash_attention_tpu_forward",
  )(tiles, bounds, q_BHTD, k_BKSD, v_BKSD, q_seg_BT1, kv_seg_B1S)


def _backward(q_BHTD, k_BKSD, v_BKSD, q_seg_BT1, kv_seg_B1S, o_BHTD, lse_BHT1, do_BHTD,
              cfg: _Config):
  """Launches the dQ and dK/dV kernels: (dq, dk, dv)."""
  delta_BHT1 = jnp.sum(o_BHTD.astype(jnp.float32) * do_BHTD.astype(jnp.float32),
                       axis=-1, keepdims=True)
  args = (q_BHTD, k_BKSD, v_BKSD, do_BHTD, lse_BHT1, delta_BHT1, q_seg_BT1, kv_seg_B1S)
  return (_dq(*args, cfg=cfg), *_dkdv(*args, cfg=cfg))


def _dq(q_BHTD, k_BKSD, v_BKSD, do_BHTD, lse_BHT1, delta_BHT1, q_seg_BT1, kv_seg_B1S, *,
        cfg: _Config):
  """Launches the dQ kernel, grid (batch, query head, query tile, step over
  its key tiles): dq [B, H, T, D]."""
  B, H, T, D = q_BHTD.shape
  group = H // k_BKSD.shape[1]
  args = (q_BHTD, k_BKSD, v_BKSD, do_BHTD, lse_BHT1, delta_BHT1, q_seg_BT1, kv_seg_B1S)
  C = T // cfg.blocks.block_q
  tiles, bounds, N, specs = _over_keys_specs(q_seg_BT1, kv_seg_B1S, cfg, D=D,
                                             D_v=v_BKSD.shape[3], group=group, num_tiles=C)
  dq_BHTD = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, N=N, num_q_tiles=C),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(B, H, C, N),
          in_specs=[specs.q, specs.k, specs.v, specs.o, specs.row, specs.row, specs.q_seg,
                    specs.kv_seg],
          out_specs=specs.q,
          scratch_shapes=[pltpu.VMEM((cfg.blocks.block_q, D), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(q_BHTD.shape, q_BHTD.dtype),
      compiler_params=_compiler_params(cfg, 4),
      interpret=cfg.interpret,
      name="flash_attention_tpu_dq",
  )(tiles, bounds, *args)
  return dq_BHTD


def _dkdv(q_BHTD, k_BKSD, v_BKSD, do_BHTD, lse_BHT1, delta_BHT1, q_seg_BT1, kv_seg_B1S, *,
          cfg: _Config):
  """Launches the dK/dV kernel, grid (batch, KV head, key tile, query head of
  the group, step over its query tiles): dk [B, K, S, D], dv [B, K, S, D_v]."""
  H, D = q_BHTD.shape[1], q_BHTD.shape[3]
  B, K, S = k_BKSD.shape[:3]
  D_v = v_BKSD.shape[3]
  group = H // K
  args = (q_BHTD, k_BKSD, v_BKSD, do_BHTD, lse_BHT1, delta_BHT1, q_seg_BT1, kv_seg_B1S)
  block_q, block_k = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
  C = S // block_k
  tiles, bounds, N, seg_b, q_tile = _launch_plan(
      q_seg_BT1, kv_seg_B1S, cfg, over_keys=False, block_q=block_q, block_k=block_k,
      num_tiles=C)

  def per_query(width):
    return pl.BlockSpec((None, None, block_q, width), lambda b, kh, j, g, n, *p: (
        b, kh * group + g, q_tile(b, j, n, *p), 0))

  def per_key(width):
    return pl.BlockSpec((None, None, block_k, width), lambda b, kh, j, g, n, *_: (b, kh, j, 0))

  q_spec, do_spec, row_spec = per_query(D), per_query(D_v), per_query(1)
  k_spec, v_spec = per_key(D), per_key(D_v)
  dk_BKSD, dv_BKSD = pl.pallas_call(
      functools.partial(_dkdv_kernel, cfg=cfg, N=N, num_k_tiles=C, group=group),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(B, K, C, group, N),
          in_specs=[
              q_spec, k_spec, v_spec, do_spec, row_spec, row_spec,
              pl.BlockSpec((None, block_q, 1), lambda b, kh, j, g, n, *p: (
                  seg_b(b), q_tile(b, j, n, *p), 0)),
              pl.BlockSpec((None, 1, block_k), lambda b, kh, j, g, n, *_: (seg_b(b), 0, j)),
          ],
          out_specs=[k_spec, v_spec],
          scratch_shapes=[pltpu.VMEM((block_k, D), jnp.float32),
                          pltpu.VMEM((block_k, D_v), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(k_BKSD.shape, k_BKSD.dtype),
                 jax.ShapeDtypeStruct(v_BKSD.shape, v_BKSD.dtype)],
      compiler_params=_compiler_params(cfg, 5),
      interpret=cfg.interpret,
      name="flash_attention_tpu_dkdv",
  )(tiles, bounds, *args)
  return dk_BKSD, dv_BKSD


_flash = common.flash_vjp(_forward, _backward)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How [B, T, H, D] inputs become the kernels' operands: lengths padded to
  whole tiles, the head dims (D of q and k, D_v of v, the output and dO) each
  to a multiple of 64, transposed to [B, heads, length, D]; segment ids as
  [B, T, 1] and [B, 1, S] (without them, one segment over the true lengths,
  [1, ...])."""
  T: int
  S: int
  D: int
  D_v: int
  T_pad: int
  S_pad: int

  @classmethod
  def of(cls, q_BTHD, k_BSKD, blocks: TpuBlocks, D_v: int):
    T, D, S = q_BTHD.shape[1], q_BTHD.shape[3], k_BSKD.shape[1]
    return cls(T, S, D, D_v, common.round_up(T, max(blocks.block_q, blocks.block_q_dkv)),
               common.round_up(S, max(blocks.block_k, blocks.block_k_dkv)))

  def heads_first(self, x_BLHD, length: int):
    width = common.round_up(x_BLHD.shape[3], _HEAD_DIM_MULTIPLE)
    return common.pad_to(common.pad_to(x_BLHD, 1, length), 3, width).transpose(0, 2, 1, 3)

  def operands(self, q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids):
    if q_segment_ids is None:
      q_segment_ids, kv_segment_ids = jnp.ones((1, self.T), jnp.int32), jnp.ones(
          (1, self.S), jnp.int32)
    q_seg = common.pad_segment_ids(q_segment_ids, self.T_pad)
    kv_seg = common.pad_segment_ids(kv_segment_ids, self.S_pad)
    return (self.heads_first(q_BTHD, self.T_pad), self.heads_first(k_BSKD, self.S_pad),
            self.heads_first(v_BSKD, self.S_pad), q_seg[:, :, None], kv_seg[:, None, :])

  def back(self, x_BHLD, length: int, width: int):
    """[B, L, heads, width] cut to the true `length` and head dim `width`."""
    return x_BHLD.transpose(0, 2, 1, 3)[:, :length, :, :width]


def _setup(q_BTHD, k_BSKD, *, causal: bool, scale: float, segments: bool, blocks: TpuBlocks,
           interpret: bool, softcap: float | None, window: int | None = None,
           value_dim: int | None = None):
  """The kernels' static config and the operands' `_Layout`; `value_dim`:
  the values' head width (None: as the keys')."""
  cfg = _Config(scale=scale, causal=causal, softcap=softcap, window=window,
                num_kv_heads=k_BSKD.shape[2],
                blocks=blocks, interpret=interpret, per_batch_plan=segments)
  D_v = k_BSKD.shape[3] if value_dim is None else value_dim
  return cfg, _Layout.of(q_BTHD, k_BSKD, blocks, D_v)


def tpu_flash_attention(q_BTHD, k_BSKD, v_BSKD, *, causal: bool, scale: float,
                        q_segment_ids, kv_segment_ids, blocks: TpuBlocks,
                        interpret: bool, softcap: float | None = None,
                        window: int | None = None):
  """FlashAttention on a TPU (or its interpreter): q [B, T, H, D], k
  [B, S, K, D], v [B, S, K, D_v] -> [B, T, H, D_v]; see
  `router.flash_attention`. Values narrower than the keys (multi-head latent
  attention) stay narrow: P V, dO V^T and P^T dO run at their width. The
  operands are laid out as `_Layout` says."""
  cfg, layout = _setup(q_BTHD, k_BSKD, causal=causal, scale=scale,
                       segments=q_segment_ids is not None, blocks=blocks, interpret=interpret,
                       softcap=softcap, window=window, value_dim=v_BSKD.shape[3])
  out_BHTD = _flash(*layout.operands(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids),
                    cfg)
  return layout.back(out_BHTD, layout.T, layout.D_v)


def tpu_parts(q_BTHD, k_BSKD, **options) -> common.Parts:
  """The TPU kernels' forward (with its lse) and backward for inputs shaped
  like q and k; `options` (causal, scale, segments, blocks, interpret,
  softcap, window) as `_setup`'s."""
  cfg, layout = _setup(q_BTHD, k_BSKD, **options)
  T = layout.T

  def forward(q, k, v, q_seg, kv_seg):
    out, lse = _forward(*layout.operands(q, k, v, q_seg, kv_seg), cfg)
    return layout.back(out, T, layout.D_v), common.lse_to_natural(lse[:, :, :T, 0],
                                                                  base2=False)

  def backward(q, k, v, q_seg, kv_seg, out, lse, do):
    lse = jnp.pad(common.lse_from_natural(lse, base2=False),
                  ((0, 0), (0, 0), (0, layout.T_pad - T)), constant_values=jnp.inf)
    dq, dk, dv = _backward(*layout.operands(q, k, v, q_seg, kv_seg),
                           layout.heads_first(out, layout.T_pad), lse[..., None],
                           layout.heads_first(do, layout.T_pad), cfg)
    return (layout.back(dq, T, layout.D), layout.back(dk, layout.S, layout.D),
            layout.back(dv, layout.S, layout.D_v))

  return common.Parts(forward, backward)
