"""FlashAttention for Hopper (H100, H200) on Mosaic GPU: wgmma, TMA, warp groups.

The same algorithm as `flash_attention.py` (the lesson's "Efficient attention
variants": online softmax forward; backward recomputing the tiles of P from
the saved base-2 log-sum-exp), laid out the way Hopper runs fastest:

- Every CTA runs three warpgroups. Two compute warpgroups each own a 64-row
  tile (the M of one wgmma): a query tile in the forward and dQ kernels, a
  key tile in the dK/dV kernel. The third, the producer, streams the other
  side's tiles with TMA through a ring of `stages` shared-memory slots.
- Each slot has a "full" barrier (arrived by its TMA copies) and a "free"
  barrier (arrived by both compute warpgroups when done with it); the
  producer refills a slot once it is free. A compute warpgroup that needs
  fewer tiles than its neighbour (causal) still waits for and frees the rest,
  so the ring stays in step.
- Matmuls are wgmma with float32 accumulators in registers; P and dS stay in
  registers as the A operand of the next wgmma, never written to memory.
- The backward is written transposed for dK/dV (S^T = K Q^T, so the key
  tile is the wgmma M): dV += P^T dO, dK += dS^T Q, summed over the query
  heads of a KV head inside the kernel (GQA/MQA without copying K/V).

What it takes: float16/bfloat16, head_dim 64 or 128, causal or not, grouped
heads, any lengths (padded to whole tiles, padded keys masked). Segment ids
go to the portable kernel (`flash_attention.py`), which also covers every
other GPU, float32 and other head dims; `supports` says which applies.

On CPU the same kernel bodies run in the Mosaic GPU interpreter, which
simulates the warpgroups, shared memory, TMA and barriers; it does not model
register layouts or wgmma, so `_Ops` is the one place that swaps wgmma for a
plain dot and drops layout hints when interpreting.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOG2_E = math.log2(math.e)
ROWS = 64  # rows of a compute warpgroup's tile: the M of one wgmma
_COMPUTE_WGS = 2
_PRODUCER = _COMPUTE_WGS  # index of the producer warpgroup
HEAD_DIMS = (64, 128)
DTYPES = (jnp.float16, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class HopperBlocks:
  """Tiles of the streamed side and the depth of the TMA ring.

  Attributes:
    block_k: keys per streamed tile (forward and dQ kernels).
    block_q_dkv: queries per streamed tile (dK/dV kernel).
    stages: slots in the shared-memory ring of each kernel.
  """
  block_k: int
  block_q_dkv: int
  stages: int


def choose_hopper_blocks(head_dim: int) -> HopperBlocks:
  """The starting tiles for an H100/H200 (228 KiB shared memory per SM).

  head_dim 64: key tiles of 128, three stages (96 KiB of K/V). head_dim 128:
  key tiles of 128, two stages (128 KiB of K/V plus 32 KiB of Q). The dK/dV
  kernel streams query tiles of 64 (Q, dO, lse, delta) two deep.
  `bench/attention.py --tune` measures the alternatives on the card.
  """
  return HopperBlocks(block_k=128, block_q_dkv=64,
                      stages=3 if head_dim <= 64 else 2)


def supports(q_BTHD, k_BSKD, *, has_segments: bool) -> str | None:
  """None if this kernel takes these inputs, else the reason it does not."""
  if has_segments:
    return "segment ids"
  if q_BTHD.dtype not in DTYPES or k_BSKD.dtype != q_BTHD.dtype:
    return f"dtype {q_BTHD.dtype} (wants float16 or bfloat16)"
  if q_BTHD.shape[-1] not in HEAD_DIMS:
    return f"head_dim {q_BTHD.shape[-1]} (wants one of {HEAD_DIMS})"
  return None


class _Ops:
  """The one place where the interpreter and the GPU differ.

  On the GPU: wgmma into float32 accumulators, arrays pinned to the WGMMA
  register layout, vectors loaded from shared memory in the row or column
  layout of a WGMMA tile. In the interpreter: `lax.dot_general` and no
  layouts. Everything else (TMA, barriers, warpgroups, masks, softmax) is the
  same code on both.
  """

  def __init__(self, interpret: bool):
    self.interpret = interpret

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def tile(self, x):
    """`x` pinned to the layout of a wgmma accumulator."""
    return self.cast(x, plgpu.Layout.WGMMA)

  def iota(self, shape, dim: int):
    return self.tile(lax.broadcasted_iota(jnp.int32, shape, dim))

  def load_vector(self, ref, along: int):
    """A 1-D float32 tile broadcastable along rows (1) or columns (0)."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(along))

  def matmul(self, a, b_ref, *, transpose_b: bool, acc=None):
    """acc + a @ b (b^T if `transpose_b`) in float32; acc=None means 0.

    `a` is an array in registers or a shared-memory ref, `b_ref` a
    shared-memory ref.
    """
    if self.interpret:
      a_val = a if isinstance(a, jax.Array) else a[...]
      out = lax.dot_general(a_val, b_ref[...],
                            (((1,), (1 if transpose_b else 0,)), ((), ())),
                            preferred_element_type=jnp.float32)
      return out if acc is None else acc + out
    b = b_ref.transpose((1, 0)) if transpose_b else b_ref
    if acc is None:
      shape = (a.shape[0], b.shape[1])

      def fresh(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
      return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(accumulate)(plgpu.ACC.init(acc))

  def set_registers(self, producer: bool):
    """Registers move from the producer (TMA only) to the compute groups."""
    if not self.interpret:
      plgpu.set_max_registers(40 if producer else 232,
                              action="decrease" if producer else "increase")


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call, shared by the three kernels."""
  scale: float
  causal: bool
  q_len: int  # padded query length (a multiple of 2 * ROWS)
  kv_len: int  # true key length
  kv_len_padded: int  # a multiple of block_k and of 2 * ROWS
  group: int  # query heads per KV head
  blocks: HopperBlocks
  interpret: bool

  @property
  def ragged(self) -> bool:
    """Whether the last key tile holds padding that must be masked."""
    return self.kv_len % self.blocks.block_k != 0


def _smem(shape, dtype):
  """A shared-memory tile in the 128-byte swizzled layout wgmma reads."""
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(128)))


def _steps(lo, hi, body, carry=0):
  return lax.fori_loop(lo, hi, body, carry)


def _produce(num_steps, stages: int, full, free, issue):
  """Producer loop: step j waits until its slot is free, then `issue`s the
  TMA copies of step j into slot j % stages, arriving on `full`. At the end
  it waits for the last slots to be freed, so no barrier phase is left
  unobserved when the kernel exits."""
  def wait_free(j, carry):
    plgpu.barrier_wait(free.at[lax.rem(j, stages)])
    return carry

  def step(j, carry):
    pl.when(j >= stages)(lambda: wait_free(j - stages, None))
    issue(j, lax.rem(j, stages), full.at[lax.rem(j, stages)])
    return carry
  _steps(0, num_steps, step)
  _steps(jnp.maximum(num_steps - stages, 0), num_steps, wait_free)


def _pass(lo, hi, stages: int, full, free):
  """Steps [lo, hi) a compute warpgroup does not need: wait, then free."""
  def step(j, carry):
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(full.at[slot])
    plgpu.barrier_arrive(free.at[slot])
    return carry
  _steps(lo, hi, step)


def _kv_tiles_seen(q_end, cfg: _Config):
  """Key tiles a query tile ending (exclusive) at `q_end` sees."""
  num_tiles = cfg.kv_len_padded // cfg.blocks.block_k
  if not cfg.causal:
    return jnp.int32(pl.cdiv(cfg.kv_len, cfg.blocks.block_k))
  seen = lax.div(q_end + cfg.blocks.block_k - 1, cfg.blocks.block_k)
  return jnp.minimum(jnp.minimum(seen, pl.cdiv(cfg.kv_len, cfg.blocks.block_k)),
                     num_tiles)


def _kv_tiles_unmasked(q_start, cfg: _Config):
  """Leading key tiles every row of the query tile at `q_start` sees whole."""
  whole = cfg.kv_len // cfg.blocks.block_k
  if not cfg.causal:
    return jnp.int32(whole)
  return jnp.minimum(lax.div(q_start + 1, cfg.blocks.block_k), whole)


def _cta_q_start(cfg: _Config):
  """First query row of this CTA. Causal CTAs run the last (longest) query
  tiles first, so the short ones fill the tail of the launch."""
  num_ctas = cfg.q_len // (_COMPUTE_WGS * ROWS)
  index = lax.axis_index("q")
  if cfg.causal:
    index = num_ctas - 1 - index
  return index * (_COMPUTE_WGS * ROWS)


def _mask(s, q_start, k_start, ops: _Ops, cfg: _Config, *, transposed: bool):
  """-inf where a key may not be seen: after the query (causal) or padding.

  `s` is [queries, keys], or [keys, queries] when `transposed`.
  """
  q_pos = ops.iota(s.shape, 1 if transposed else 0) + q_start
  k_pos = ops.iota(s.shape, 0 if transposed else 1) + k_start
  visible = None
  if cfg.causal:
    visible = k_pos <= q_pos
  if cfg.ragged:
    in_range = k_pos < cfg.kv_len
    visible = in_range if visible is None else visible & in_range
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _rows(vector, shape):
  """A per-row vector broadcast over the columns of a tile."""
  return lax.broadcast_in_dim(vector, shape, [0])


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem,
                    lse_smem, q_full, kv_full, kv_free, *, cfg: _Config, ops: _Ops):
  """Forward: online softmax of two query tiles against streamed K/V tiles."""
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  block_k, stages = cfg.blocks.block_k, cfg.blocks.stages
  cta_q = _cta_q_start(cfg)
  cta_steps = _kv_tiles_seen(cta_q + _COMPUTE_WGS * ROWS, cfg)

  @pl.when(wg == _PRODUCER)
  def _producer():
    ops.set_registers(producer=True)
    kv_head = lax.div(h, cfg.group)

    def issue(j, slot, full):
      rows = (b, pl.ds(j * block_k, block_k), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], full)
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], full)
    _produce(cta_steps, stages, kv_full, kv_free, issue)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    ops.set_registers(producer=False)
    q_start = cta_q + wg * ROWS
    q_tile = q_smem.at[wg]
    q_rows = (b, pl.ds(q_start, ROWS), h)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_tile, q_full.at[wg])
    plgpu.barrier_wait(q_full.at[wg])
    D = q_tile.shape[-1]

    def step(j, carry, masked: bool):
      o, m, l = carry
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(kv_full.at[slot])
      s = ops.matmul(q_tile, k_smem.at[slot], transpose_b=True) * (cfg.scale * _LOG2_E)
      if masked:
        s = _mask(s, q_start, j * block_k, ops, cfg, transposed=False)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - _rows(m_new, s.shape))
      l = l * alpha + jnp.sum(p, axis=1)
      o = ops.matmul(p.astype(q_tile.dtype), v_smem.at[slot], transpose_b=False,
                     acc=o * _rows(alpha, o.shape))
      plgpu.barrier_arrive(kv_free.at[slot])
      return o, m_new, l

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (ops.tile(jnp.zeros((ROWS, D), jnp.float32)),
             ops.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
             ops.cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
    unmasked = _kv_tiles_unmasked(q_start, cfg)
    seen = _kv_tiles_seen(q_start + ROWS, cfg)
    carry = _steps(0, unmasked, functools.partial(step, masked=False), carry)
    o, m, l = _steps(unmasked, seen, functools.partial(step, masked=True), carry)
    _pass(seen, cta_steps, stages, kv_full, kv_free)

    q_tile[...] = (o / _rows(l, o.shape)).astype(q_tile.dtype)
    lse_smem.at[wg][...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, o_ref.at[q_rows])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q_start, ROWS)])
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem,
               do_smem, lse_smem, delta_smem, k_smem, v_smem, q_full, kv_full,
               kv_free, *, cfg: _Config, ops: _Ops):
  """Backward, dQ of two query tiles: recompute P from the lse per K/V tile."""
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  block_k, stages = cfg.blocks.block_k, cfg.blocks.stages
  cta_q = _cta_q_start(cfg)
  cta_steps = _kv_tiles_seen(cta_q + _COMPUTE_WGS * ROWS, cfg)

  @pl.when(wg == _PRODUCER)
  def _producer():
    ops.set_registers(producer=True)
    kv_head = lax.div(h, cfg.group)

    def issue(j, slot, full):
      rows = (b, pl.ds(j * block_k, block_k), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], full)
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], full)
    _produce(cta_steps, stages, kv_full, kv_free, issue)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    ops.set_registers(producer=False)
    q_start = cta_q + wg * ROWS
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    q_rows = (b, pl.ds(q_start, ROWS), h)
    vec_rows = (b, h, pl.ds(q_start, ROWS))
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_tile, q_full.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_tile, q_full.at[wg])
    plgpu.copy_gmem_to_smem(lse_ref.at[vec_rows], lse_smem.at[wg], q_full.at[wg])
    plgpu.copy_gmem_to_smem(delta_ref.at[vec_rows], delta_smem.at[wg], q_full.at[wg])
    plgpu.barrier_wait(q_full.at[wg])
    lse = ops.load_vector(lse_smem.at[wg], along=1)
    delta = ops.load_vector(delta_smem.at[wg], along=1)

    def step(j, dq, masked: bool):
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(kv_full.at[slot])
      s = ops.matmul(q_tile, k_smem.at[slot], transpose_b=True) * (cfg.scale * _LOG2_E)
      if masked:
        s = _mask(s, q_start, j * block_k, ops, cfg, transposed=False)
      p = jnp.exp2(s - _rows(lse, s.shape))
      dp = ops.matmul(do_tile, v_smem.at[slot], transpose_b=True)
      ds = p * (dp - _rows(delta, dp.shape))
      dq = ops.matmul(ds.astype(q_tile.dtype), k_smem.at[slot], transpose_b=False,
                      acc=dq)
      plgpu.barrier_arrive(kv_free.at[slot])
      return dq

    dq = ops.tile(jnp.zeros(q_tile.shape, jnp.float32))
    unmasked = _kv_tiles_unmasked(q_start, cfg)
    seen = _kv_tiles_seen(q_start + ROWS, cfg)
    dq = _steps(0, unmasked, functools.partial(step, masked=False), dq)
    dq = _steps(unmasked, seen, functools.partial(step, masked=True), dq)
    _pass(seen, cta_steps, stages, kv_full, kv_free)

    q_tile[...] = (dq * cfg.scale).astype(q_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[q_rows])
    plgpu.wait_smem_to_gmem(0)


def _q_tiles(k_start, cfg: _Config):
  """Query tiles of the dK/dV kernel for the key tile at `k_start`:
  [first, full) cross the causal diagonal, [full, end) see the whole tile."""
  block_q = cfg.blocks.block_q_dkv
  end = cfg.q_len // block_q
  if not cfg.causal:
    return jnp.int32(0), jnp.int32(0), end
  first = jnp.minimum(lax.div(k_start, block_q), end)
  full = jnp.minimum(lax.div(k_start + ROWS - 1 + block_q - 1, block_q), end)
  return first, full, end


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                 k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_full,
                 q_full, q_free, *, cfg: _Config, ops: _Ops):
  """Backward, dK and dV of two key tiles: stream (query head of the group,
  query tile) pairs, recompute P^T from the lse, accumulate over both."""
  b, kv_head, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  block_q, stages = cfg.blocks.block_q_dkv, cfg.blocks.stages
  cta_k = lax.axis_index("k") * (_COMPUTE_WGS * ROWS)
  cta_first, _, end = _q_tiles(cta_k, cfg)
  per_head = end - cta_first  # streamed tiles per query head

  @pl.when(wg == _PRODUCER)
  def _producer():
    ops.set_registers(producer=True)

    def issue(j, slot, full):
      head = kv_head * cfg.group + lax.div(j, per_head)
      q_start = (cta_first + lax.rem(j, per_head)) * block_q
      rows = (b, pl.ds(q_start, block_q), head)
      vec_rows = (b, head, pl.ds(q_start, block_q))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], full)
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], full)
      plgpu.copy_gmem_to_smem(lse_ref.at[vec_rows], lse_smem.at[slot], full)
      plgpu.copy_gmem_to_smem(delta_ref.at[vec_rows], delta_smem.at[slot], full)
    _produce(cfg.group * per_head, stages, q_full, q_free, issue)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    ops.set_registers(producer=False)
    k_start = cta_k + wg * ROWS
    k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
    k_rows = (b, pl.ds(k_start, ROWS), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[k_rows], k_tile, kv_full.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[k_rows], v_tile, kv_full.at[wg])
    plgpu.barrier_wait(kv_full.at[wg])
    first, full, _ = _q_tiles(k_start, cfg)

    def step(i, carry, head_step0, masked: bool):
      dk, dv = carry
      j = head_step0 + i - cta_first
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(q_full.at[slot])
      q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
      s_t = ops.matmul(k_tile, q_tile, transpose_b=True) * (cfg.scale * _LOG2_E)
      if masked:
        s_t = _mask(s_t, i * block_q, k_start, ops, cfg, transposed=True)
      lse = ops.load_vector(lse_smem.at[slot], along=0)
      p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse, s_t.shape, [1]))
      dv = ops.matmul(p_t.astype(k_tile.dtype), do_tile, transpose_b=False, acc=dv)
      dp_t = ops.matmul(v_tile, do_tile, transpose_b=True)
      delta = ops.load_vector(delta_smem.at[slot], along=0)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
      dk = ops.matmul(ds_t.astype(k_tile.dtype), q_tile, transpose_b=False, acc=dk)
      plgpu.barrier_arrive(q_free.at[slot])
      return dk, dv

    def head(g, carry):
      head_step0 = g * per_head
      _pass(head_step0, head_step0 + first - cta_first, stages, q_full, q_free)
      carry = _steps(first, full, functools.partial(
          step, head_step0=head_step0, masked=True), carry)
      return _steps(full, end, functools.partial(
          step, head_step0=head_step0, masked=False), carry)

    zeros = ops.tile(jnp.zeros(k_tile.shape, jnp.float32))
    dk, dv = _steps(0, cfg.group, head, (zeros, zeros))
    k_tile[...] = (dk * cfg.scale).astype(k_tile.dtype)
    v_tile[...] = dv.astype(v_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[k_rows])
    plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[k_rows])
    plgpu.wait_smem_to_gmem(0)


def _kernel(name: str, body, out_type, scratch, grid, names, cfg: _Config):
  """A three-warpgroup Mosaic GPU kernel (interpreted when not on a GPU)."""
  interpret = None
  if cfg.interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=import-outside-toplevel
    interpret = params.InterpretGPUParams()
  return plgpu.kernel(
      functools.partial(body, cfg=cfg, ops=_Ops(cfg.interpret)),
      out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
      num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret, kernel_name=f"flash_attention_hopper_{name}")


def _forward(q_BTHD, k_BSKD, v_BSKD, cfg: _Config):
  """(out [B, T, H, D], lse [B, H, T] base 2)."""
  B, T, H, D = q_BTHD.shape
  dtype, blocks = q_BTHD.dtype, cfg.blocks
  ring = (blocks.stages, blocks.block_k, D)
  scratch = [
      _smem((_COMPUTE_WGS, ROWS, D), dtype), _smem(ring, dtype), _smem(ring, dtype),
      plgpu.SMEM((_COMPUTE_WGS, ROWS), jnp.float32),
      plgpu.Barrier(num_arrivals=1, num_barriers=_COMPUTE_WGS),
      plgpu.Barrier(num_arrivals=2, num_barriers=blocks.stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=blocks.stages),
  ]
  out_type = (jax.ShapeDtypeStruct(q_BTHD.shape, dtype),
              jax.ShapeDtypeStruct((B, H, T), jnp.float32))
  grid = (T // (_COMPUTE_WGS * ROWS), B, H)
  return _kernel("forward", _forward_kernel, out_type, scratch, grid, ("q", "b", "h"), cfg)(
      q_BTHD, k_BSKD, v_BSKD)


def _backward(q_BTHD, k_BSKD, v_BSKD, o_BTHD, lse_BHT, do_BTHD, cfg: _Config):
  """(dq, dk, dv) from the dQ kernel and the dK/dV kernel."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  dtype, blocks = q_BTHD.dtype, cfg.blocks
  delta_BHT = jnp.einsum("bthd,bthd->bht", o_BTHD.astype(jnp.float32),
                         do_BTHD.astype(jnp.float32))
  args = (q_BTHD, k_BSKD, v_BSKD, do_BTHD, lse_BHT, delta_BHT)
  own = (_COMPUTE_WGS, ROWS, D)
  own_vec = plgpu.SMEM((_COMPUTE_WGS, ROWS), jnp.float32)

  ring = (blocks.stages, blocks.block_k, D)
  dq = _kernel("dq", _dq_kernel, jax.ShapeDtypeStruct(q_BTHD.shape, dtype), [
      _smem(own, dtype), _smem(own, dtype), own_vec, own_vec,
      _smem(ring, dtype), _smem(ring, dtype),
      plgpu.Barrier(num_arrivals=4, num_barriers=_COMPUTE_WGS),
      plgpu.Barrier(num_arrivals=2, num_barriers=blocks.stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=blocks.stages),
  ], (T // (_COMPUTE_WGS * ROWS), B, H), ("q", "b", "h"), cfg)(*args)

  ring = (blocks.stages, blocks.block_q_dkv, D)
  ring_vec = plgpu.SMEM((blocks.stages, blocks.block_q_dkv), jnp.float32)
  dk, dv = _kernel("dkdv", _dkdv_kernel, (jax.ShapeDtypeStruct(k_BSKD.shape, dtype),
                                  jax.ShapeDtypeStruct(v_BSKD.shape, dtype)), [
      _smem(own, dtype), _smem(own, dtype),
      _smem(ring, dtype), _smem(ring, dtype), ring_vec, ring_vec,
      plgpu.Barrier(num_arrivals=2, num_barriers=_COMPUTE_WGS),
      plgpu.Barrier(num_arrivals=4, num_barriers=blocks.stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=blocks.stages),
  ], (S // (_COMPUTE_WGS * ROWS), B, K), ("k", "b", "h"), cfg)(*args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BTHD, k_BSKD, v_BSKD, cfg: _Config):
  return _forward(q_BTHD, k_BSKD, v_BSKD, cfg)[0]


def _flash_fwd(q_BTHD, k_BSKD, v_BSKD, cfg: _Config):
  o_BTHD, lse_BHT = _forward(q_BTHD, k_BSKD, v_BSKD, cfg)
  return o_BTHD, (q_BTHD, k_BSKD, v_BSKD, o_BTHD, lse_BHT)


def _flash_bwd(cfg: _Config, residuals, do_BTHD):
  return _backward(*residuals, do_BTHD, cfg)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis: int, multiple: int):
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def hopper_flash_attention(q_BTHD, k_BSKD, v_BSKD, *, causal: bool, scale: float,
                           blocks: HopperBlocks | None = None, interpret: bool):
  """Attention [B, T, H, D] for inputs `supports` accepts (no segment ids).

  Query and key lengths are zero-padded to whole tiles (padded keys are
  masked, padded query rows cut off), so any T and S work; causal is top-left
  aligned, as in `flash_attention`.
  """
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  blocks = blocks or choose_hopper_blocks(D)
  pair = _COMPUTE_WGS * ROWS
  kv_multiple = math.lcm(blocks.block_k, pair, blocks.block_q_dkv)
  q_multiple = math.lcm(pair, blocks.block_q_dkv)
  q = _pad_to(q_BTHD, 1, q_multiple)
  k = _pad_to(k_BSKD, 1, kv_multiple)
  v = _pad_to(v_BSKD, 1, kv_multiple)
  cfg = _Config(scale=scale, causal=causal, q_len=q.shape[1], kv_len=S,
                kv_len_padded=k.shape[1], group=H // K, blocks=blocks,
                interpret=interpret)
  return _flash(q, k, v, cfg)[:, :T]
