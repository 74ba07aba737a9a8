"""FlashAttention for Hopper (H100, H200) on Mosaic GPU: wgmma, TMA, warp groups.

The same algorithm as `flash_attention_triton.py` (the lesson's "Efficient attention
variants": online softmax forward; backward recomputing the tiles of P from
the saved base-2 log-sum-exp), laid out the way Hopper runs fastest:

- Every CTA runs three warpgroups (`hopper_pipeline.py`: the TMA ring, its
  barriers and their trace-time checks, the turns). Two compute warpgroups
  each own a 64-row tile: a query tile in the forward and dQ kernels, a key
  tile in the dK/dV kernel. The third, the producer, streams the other
  side's tiles through the ring (the forward, software-pipelined, gives K
  and V barriers of their own).
- Each kernel body takes its operands, outputs and shared memory by name
  (`_Operands`, `_ForwardScratch`, `_DqScratch`, `_DkDvScratch`: NamedTuples
  of refs); each barrier of a scratch list counts what arrives on it, and
  the code arriving checks that count at trace time (`_DqExchange` too).
- Matmuls are wgmma with float32 accumulators in registers; P and dS stay in
  registers as the A operand of the next wgmma (the fused backward also
  writes dS to shared memory, for dQ). Scores are masked and scaled to base
  2 where ptxas makes one FFMA of the scale and the subtracted max or lse.
  A soft-cap c tanh(s / c) (Gemma-2) caps the scaled scores first and
  multiplies dS by 1 - tanh^2 (`common.soft_cap_tile`, `soft_cap_grad`).
- The two compute warpgroups take turns on the tensor cores
  (`hopper_pipeline.Turns`): one's softmax (or dS) overlaps the other's
  matmuls. In the forward a turn
  carries S_j and P_{j-1} V_{j-1} together (`_forward_kernel`).
- The backward is written transposed for dK/dV (S^T = K Q^T, so the key
  tile is the wgmma M): dV += P^T dO, dK += dS^T Q, summed over the query
  heads of a KV head inside the kernel (GQA/MQA without copying K/V).

What it takes: float16/bfloat16, head_dim 64 or 128, causal or not, segment
ids (packing, padding; a query with no visible key gets zeros), grouped
heads, any lengths (padded to whole tiles, padded keys masked); the mask
semantics and causal tile arithmetic are `common.py`'s. The portable
kernel (`flash_attention_triton.py`) covers every other GPU, float32 and other head
dims; `supports` says which applies.

Which tiles a CTA streams is its plan (`_Plan`). Without segment ids it is
computed in the kernel: every key tile, or those up to the diagonal when
causal, the ones that need no mask apart. With segment ids it is a list
`block_sparse.schedule` makes before the kernels run (block-sparse, as
FlexAttention's block masks): tiles that share no segment with the CTA's
tiles are not streamed at all, and tiles inside one segment (below the
diagonal) run without the mask, so packed documents cost what their own
attention costs.

Cost, in tile matmuls per (query tile, key tile) pair: forward 2 (S, PV);
backward 7 by default, since the dQ kernel recomputes S and dP that the
dK/dV kernel also computes; by the FlashAttention convention (backward = 2.5
forwards) that backward reaches at most 5/7 of the matmul rate.
`HopperBlocks(fused_dq=True)` is FlashAttention-3's backward, 5 matmuls: the
dK/dV kernel also stores dS^T to shared memory, multiplies it (transposed)
by the key tiles, and adds the product into a zeroed float32 dQ with TMA
reduce-add (`copy_smem_to_gmem(reduction_op="add")`), once per query tile
and 128 keys (`_DqExchange`); the dQ buffer is a Ref in global memory
passed to `pl.kernel`, which aliases it in and out. The Mosaic GPU
interpreter has no reduce-add, so there `_Ops` reads, adds and writes, into
one buffer per compute warpgroup (the interpreter runs a CTA's warpgroups
at once). The reduce-adds of a query tile's dQ arrive in the order the CTAs
reach them, so the fused backward's dQ can differ in its last bits from run
to run (FlashAttention-2 and -3's atomic dQ alike); the separate dQ
kernel's does not.
On an H200 the fused backward was at least as fast (bench/RESULTS.md,
2026-12-04): it is the default at head_dim 128 (`choose_hopper_blocks`).

On CPU the same kernel bodies run in the Mosaic GPU interpreter, which
simulates the warpgroups, shared memory, TMA copies, barriers and register
reallocation; it does not model register layouts or wgmma, so `_Ops` is the
one place that swaps wgmma for a plain dot and drops layout hints when
interpreting.
"""
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels import MOSAIC_GPU_DTYPES as DTYPES
from model.kernels import MOSAIC_GPU_HEAD_DIMS as HEAD_DIMS
from model.kernels import block_sparse
from model.kernels import common
from model.kernels import hopper_pipeline as pipeline
from model.kernels.hopper_pipeline import COMPUTE_WGS, PRODUCER, ROWS

_DQ_COLUMNS = 64  # columns of a dQ partial product per wgmma (fused backward)


@dataclasses.dataclass(frozen=True)
class HopperBlocks:
  """Tiles of the streamed side and the depth of the TMA ring.

  Attributes:
    block_k: keys per streamed tile (forward and dQ kernels).
    block_q_dkv: queries per streamed tile (dK/dV kernel).
    stages: slots in the shared-memory ring of each kernel.
    pingpong: the two compute warpgroups of each kernel take turns on the
      tensor cores (`hopper_pipeline.Turns`).
    block_k_dq: keys per streamed tile of the dQ kernel; None: block_k.
    fused_dq: no dQ kernel: the dK/dV kernel also multiplies each dS tile
      by its key tile and adds the product into a float32 dQ in global
      memory with TMA reduce-add (FlashAttention-3's backward: 5 tile
      matmuls per tile pair instead of 7).
    bwd_pingpong: `pingpong` for the backward kernels (dQ, dK/dV); None:
      as the forward's.
  """
  block_k: int
  block_q_dkv: int
  stages: int
  pingpong: bool = True
  block_k_dq: int | None = None
  fused_dq: bool = False
  bwd_pingpong: bool | None = None

  @property
  def q_multiple(self) -> int:
    """The query length is padded to a multiple of this."""
    return math.lcm(COMPUTE_WGS * ROWS, self.block_q_dkv)

  @property
  def kv_multiple(self) -> int:
    """The key length is padded to a multiple of this."""
    return math.lcm(COMPUTE_WGS * ROWS, self.block_k, self.block_k_dq or self.block_k)

  def for_dq(self) -> "HopperBlocks":
    """The tiles as the dQ kernel sees them (its key tile as block_k)."""
    return dataclasses.replace(self, block_k=self.block_k_dq or self.block_k,
                               block_k_dq=None)

  def for_backward(self) -> "HopperBlocks":
    """The tiles as the backward kernels see them (`bwd_pingpong` as pingpong)."""
    if self.bwd_pingpong is None:
      return self
    return dataclasses.replace(self, pingpong=self.bwd_pingpong, bwd_pingpong=None)


def choose_hopper_blocks(head_dim: int, kv_len: int, *,
                         interpret: bool = False) -> HopperBlocks:
  """The starting tiles for an H100/H200 (228 KiB shared memory per SM).

  head_dim 64: key tiles of 128, three stages (96 KiB of K/V). head_dim 128:
  key tiles of 128, two stages (128 KiB of K/V plus 32 KiB of Q). Keys that
  fit in 64 (decoding a short context) get one tile of 64, and a sequence of
  at most two tiles a ring of two. The dK/dV kernel streams query tiles of 64
  (Q, dO, lse, delta). The dQ kernel takes the forward's key tile: at
  head_dim 128 ptxas for sm_90a (`bench/compile_h200.py`) finds it spilling
  at most 8 bytes (causal with segment ids), none with its own tile of 64
  (`block_k_dq`, which `bench/attention.py --tune` times). Ping-pong is on,
  except in the interpreter: there each warpgroup is a thread running XLA
  programs, and inside a jitted program (a training step) a warpgroup
  blocked on its turn can hold the CPU thread its neighbour needs (seen: a
  2-core machine hangs); it changes no result, and the kernel tests turn it
  on explicitly.

  At head_dim 128 the backward is the fused one without ping-pong: on an
  H200 (`bench/attention.py --tune`, S = 16k causal; bench/RESULTS.md,
  2026-12-04) the backward ran about 18% faster without turns than with
  them, fused or not, and fused at least as fast as with the dQ kernel,
  while the forward was fastest with key tiles of 128 and turns. Head_dim
  64 keeps the separate dQ kernel and turns until the card times it.
  """
  block_k = 64 if kv_len <= 64 else 128
  stages = 3 if head_dim <= 64 and kv_len > 2 * block_k else 2
  tuned_backward = head_dim == 128 and not interpret
  return HopperBlocks(block_k=block_k, block_q_dkv=64, stages=stages,
                      pingpong=not interpret, fused_dq=tuned_backward,
                      bwd_pingpong=False if tuned_backward else None)


def supports(q_BTHD, k_BSKD) -> str | None:
  """None if this kernel takes these inputs, else the reason it does not."""
  if q_BTHD.dtype.name not in DTYPES or k_BSKD.dtype != q_BTHD.dtype:
    return f"dtype {q_BTHD.dtype} (wants {' or '.join(DTYPES)})"
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

  def positions(self, n: int, reduced: int):
    """0 .. n-1 as a vector along a wgmma tile: one entry per row
    (reduced=1) or per column (reduced=0), like `load_vector`."""
    return self.cast(lax.broadcasted_iota(jnp.int32, (n,), 0),
                     plgpu.Layout.WGMMA.reduce(reduced))

  def load_vector(self, ref, along: int):
    """A 1-D tile (lse, delta, segment ids) as a vector with one entry per
    row (along=1) or per column (along=0) of a wgmma tile."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(along))

  def matmul(self, a, b_ref, *, transpose_b: bool = False, acc=None,
             transpose_a: bool = False):
    """acc + a @ b (a^T if `transpose_a`, b^T if `transpose_b`) in float32;
    acc=None means 0. `a` is an array in registers or a shared-memory ref
    (only a ref may be transposed), `b_ref` a shared-memory ref."""
    term = (a, b_ref, transpose_a, transpose_b)
    return self.matmuls([[term]], None if acc is None else [acc])[0]

  def matmuls(self, products, accs=None):
    """[accs[i] + the sum of the terms of products[i]] in float32; accs None,
    or an entry None: a fresh accumulator. A term is (a, b_ref, transpose_a,
    transpose_b), as in `matmul`. On the GPU every wgmma is issued (those
    into fresh accumulators first) before the one wait."""
    accs = [None] * len(products) if accs is None else accs
    if self.interpret:
      def dot(a, b_ref, transpose_a, transpose_b):
        a_val = a if isinstance(a, jax.Array) else a[...]
        return lax.dot_general(a_val, b_ref[...],
                               (((0 if transpose_a else 1,), (1 if transpose_b else 0,)),
                                ((), ())), preferred_element_type=jnp.float32)
      sums = [functools.reduce(jnp.add, [dot(*term) for term in terms])
              for terms in products]
      return [out if acc is None else acc + out for acc, out in zip(accs, sums)]

    def operands(a, b_ref, transpose_a, transpose_b):
      return (a.transpose((1, 0)) if transpose_a else a,
              b_ref.transpose((1, 0)) if transpose_b else b_ref)

    def issue(indices, acc_refs):
      for i, acc_ref in zip(indices, acc_refs):
        for term in products[i]:
          plgpu.wgmma(acc_ref, *operands(*term))
    fresh = [i for i, acc in enumerate(accs) if acc is None]
    held = [i for i, acc in enumerate(accs) if acc is not None]

    def with_fresh(*fresh_refs):
      """The fresh products are issued first; then the held ones, in
      run_state (whose exit waits for every wgmma in flight)."""
      issue(fresh, fresh_refs)
      out = {}
      if held:
        out.update(zip(held, pl.run_state(functools.partial(issue, held))(
            tuple(plgpu.ACC.init(accs[i]) for i in held))))
      out.update({i: ref[...] for i, ref in zip(fresh, fresh_refs)})
      return [out[i] for i in range(len(products))]
    if not fresh:
      return with_fresh()
    shapes = []
    for i in fresh:
      a, b = operands(*products[i][0])
      shapes.append((a.shape[0], b.shape[1]))
    return pl.run_scoped(with_fresh, *[plgpu.ACC(shape, jnp.float32) for shape in shapes])

  @property
  def dq_slabs(self) -> int:
    """Float32 dQ buffers of the fused backward: one on the GPU, where TMA
    reduce-add is atomic; one per compute warpgroup in the interpreter,
    which runs CTAs one after another but the warpgroups of a CTA at once,
    and emulates reduce-add by read, add, write."""
    return COMPUTE_WGS if self.interpret else 1

  def add_to_gmem(self, smem_ref, gmem_ref, wg):
    """gmem_ref[slab] += smem_ref (a TMA reduce-add on the GPU)."""
    if self.interpret:
      gmem_ref.at[wg][...] = gmem_ref.at[wg][...] + smem_ref[...]
    else:
      plgpu.copy_smem_to_gmem(smem_ref, gmem_ref.at[0], reduction_op="add")


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call, shared by the three kernels."""
  scale: float
  causal: bool
  softcap: float | None  # c of c tanh(s / c) on the scaled scores; None: no cap
  segments: bool  # segment ids given: mask by them, rows may be empty
  window: int | None  # the causal sliding window, or None; with one, `segments` (its plan)
  q_len: int  # true query length (the arrays are padded past it)
  kv_len: int  # true key length (the arrays are padded past it)
  group: int  # query heads per KV head
  blocks: HopperBlocks
  interpret: bool

  @property
  def q_len_padded(self) -> int:
    """The query length of the arrays (`HopperBlocks.q_multiple`)."""
    return common.round_up(self.q_len, self.blocks.q_multiple)

  @property
  def ragged(self) -> bool:
    """Whether padded keys need a mask of their own (segment id 0 already
    hides them when segments are given)."""
    return not self.segments and self.kv_len % self.blocks.block_k != 0


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The steps of a CTA over its streamed tiles, as one warpgroup takes
  them: the CTA streams `count` tiles, steps start .. start + count - 1,
  step n being tile `tile(n)`; this warpgroup takes steps [first, last) and
  passes the others. Its steps in [whole_from, whole_to) see their whole
  tile and run without the mask; its other steps are masked. `listed`: the
  plan `block_sparse.schedule` made from segment ids (masked steps first,
  whole_to == last)."""
  first: jax.Array
  whole_from: jax.Array
  whole_to: jax.Array
  last: jax.Array
  count: jax.Array
  tile: Callable[[jax.Array], jax.Array]
  listed: bool
  start: jax.Array | int = 0


def _listed_plan(cta_start, wg, plan_refs, *, from_first: bool) -> _Plan:
  """Warpgroup `wg`'s view of the listed plan of the CTA whose tiles start
  at row `cta_start`: from its bound `first` on, or from step 0."""
  tiles_ref, bounds_ref = plan_refs
  b, cta = lax.axis_index("b"), lax.div(cta_start, COMPUTE_WGS * ROWS)
  first = bounds_ref[b, cta, wg, 0] if from_first else jnp.int32(0)
  split, count = bounds_ref[b, cta, wg, 1], bounds_ref[b, cta, wg, 2]
  return _Plan(first, whole_from=split, whole_to=count, last=count, count=count,
               tile=lambda n: tiles_ref[b, cta, n], listed=True)


def _query_rows_plan(cta_q, wg, plan_refs, cfg: _Config) -> _Plan:
  """The key tiles of the forward or dQ CTA whose query tiles start at
  `cta_q`, as warpgroup `wg` takes them. Without segment ids: tiles 0, 1,
  ... up to the diagonal when causal (`common.kv_tile_range`), the masked
  ones last. With them: every step of the listed plan (which masks a step
  the warpgroup does not need to nothing; its `first` is 0): with a pass
  loop before the step loop, ptxas for sm_90a zeroed the fresh S and dP
  accumulators of the dQ step with some 120 register moves instead of
  wgmma's no-accumulate form (seen in the SASS of that variant, which was
  not kept)."""
  if plan_refs is not None:
    return _listed_plan(cta_q, wg, plan_refs, from_first=False)
  tiles = functools.partial(common.kv_tile_range, block_k=cfg.blocks.block_k,
                            kv_len=cfg.kv_len, causal=cfg.causal)
  whole, seen = (jnp.int32(x) for x in tiles(cta_q + wg * ROWS, ROWS))
  return _Plan(first=jnp.int32(0), whole_from=jnp.int32(0), whole_to=whole, last=seen,
               count=jnp.int32(tiles(cta_q, COMPUTE_WGS * ROWS)[1]), tile=lambda n: n,
               listed=False)


def _key_rows_plan(cta_k, wg, plan_refs, cfg: _Config) -> _Plan:
  """The query tiles (of each query head) of the dK/dV CTA whose key tiles
  start at `cta_k`, as warpgroup `wg` takes them, the masked ones first:
  without segment ids, from the diagonal on when causal
  (`common.q_tile_range`); with them, the listed plan."""
  if plan_refs is not None:
    return _listed_plan(cta_k, wg, plan_refs, from_first=True)
  end = cfg.q_len_padded // cfg.blocks.block_q_dkv
  tiles = functools.partial(common.q_tile_range, block_q=cfg.blocks.block_q_dkv,
                            num_q_tiles=end, causal=cfg.causal)
  cta_first, _ = (jnp.int32(x) for x in tiles(cta_k, COMPUTE_WGS * ROWS))
  first, whole = (jnp.int32(x) for x in tiles(cta_k + wg * ROWS, ROWS))
  return _Plan(first=first, whole_from=whole, whole_to=end, last=end,
               count=end - cta_first, tile=lambda n: n, listed=False, start=cta_first)


def _cta_q_start(cfg: _Config):
  """First query row of this CTA. Causal CTAs run the last (longest) query
  tiles first, so the short ones fill the tail of the launch."""
  num_ctas = cfg.q_len_padded // (COMPUTE_WGS * ROWS)
  index = lax.axis_index("q")
  if cfg.causal:
    index = num_ctas - 1 - index
  return index * (COMPUTE_WGS * ROWS)


def _mask(s, q_start, k_start, ops: _Ops, cfg: _Config, *, transposed: bool,
          q_seg=None, kv_seg=None):
  """-inf where a key may not be seen (`common.visible`). `s` is [queries,
  keys], or [keys, queries] when `transposed`; `q_seg` and `kv_seg` are the
  tile's segment ids, vectors along those axes."""
  q_axis, k_axis = (1, 0) if transposed else (0, 1)
  q_pos = ops.positions(s.shape[q_axis], k_axis) + q_start if cfg.causal else None
  k_pos = (ops.positions(s.shape[k_axis], q_axis) + k_start
           if cfg.causal or cfg.ragged else None)
  mask = common.visible(
      q_pos, k_pos,
      along_q=lambda x: lax.broadcast_in_dim(x, s.shape, [q_axis]),
      along_k=lambda x: lax.broadcast_in_dim(x, s.shape, [k_axis]),
      causal=cfg.causal, kv_len=cfg.kv_len if cfg.ragged else None,
      q_seg=q_seg if cfg.segments else None, kv_seg=kv_seg if cfg.segments else None,
      window=cfg.window)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _rows(vector, shape):
  """A per-row vector broadcast over the columns of a tile."""
  return lax.broadcast_in_dim(vector, shape, [0])


class _Operands(NamedTuple):
  """A kernel's operands in global memory, None where not given: the
  forward's are q, k, v and the segment ids; the backward kernels' add dO,
  lse and delta. `plan`: the kernel's listed plan, (tiles, bounds)
  (`_query_plan`, `_key_plan`); `dq_acc`: the fused backward's float32 dQ
  buffer (`_DqExchange`)."""
  q: Any
  k: Any
  v: Any
  q_seg: Any = None
  kv_seg: Any = None
  do: Any = None
  lse: Any = None
  delta: Any = None
  plan: Any = None
  dq_acc: Any = None


class _ForwardOut(NamedTuple):
  o: Any
  lse: Any


class _DqOut(NamedTuple):
  dq: Any


class _DkDvOut(NamedTuple):
  dk: Any
  dv: Any


class _ForwardScratch(NamedTuple):
  """Shared memory of the forward kernel: each compute warpgroup's query
  tile (and its segment ids, lse), the ring of K and V tiles (and key
  segment ids), their barriers, the turns."""
  q: Any
  q_seg: Any
  lse: Any
  k: Any
  v: Any
  kv_seg: Any
  q_full: Any
  k_full: Any
  k_free: Any
  v_full: Any
  v_free: Any
  turn: Any


class _DqScratch(NamedTuple):
  """Shared memory of the dQ kernel: each compute warpgroup's Q, dO, lse,
  delta (and query segment ids), the ring of K and V tiles (and key
  segment ids), their barriers, the turns."""
  q: Any
  do: Any
  lse: Any
  delta: Any
  q_seg: Any
  k: Any
  v: Any
  kv_seg: Any
  q_full: Any
  kv_full: Any
  kv_free: Any
  turn: Any


class _DkDvScratch(NamedTuple):
  """Shared memory of the dK/dV kernel: each compute warpgroup's K and V
  tiles (and key segment ids), the ring of Q, dO, lse, delta (and query
  segment ids), the fused backward's dS and dQ tiles, the barriers, the
  turns."""
  k: Any
  v: Any
  kv_seg: Any
  q: Any
  do: Any
  lse: Any
  delta: Any
  q_seg: Any
  ds: Any
  dq: Any
  kv_full: Any
  q_full: Any
  q_free: Any
  ds_ready: Any
  ds_read: Any
  turn: Any


def _stream_kv(gmem: _Operands, smem, rings, plan: _Plan, cfg: _Config):
  """The producer of `_query_tile_kernel`: the K, V (and key segment ids)
  tiles of the CTA's plan, of this CTA's KV head, into the ring of `smem`
  (`_ForwardScratch` or `_DqScratch`), through one pair (full, free) of
  barrier arrays in `rings`, or K (and ids) through the first of two and V
  through the second."""
  pipeline.set_registers(producer=True)
  b, kv_head = lax.axis_index("b"), lax.div(lax.axis_index("h"), cfg.group)
  block_k = cfg.blocks.block_k

  def copies(n, slot, with_k: bool, with_v: bool):
    keys = pl.ds(plan.tile(n) * block_k, block_k)
    pairs = [(gmem.k.at[b, keys, kv_head], smem.k.at[slot]),
             (pipeline.at(gmem.kv_seg, b, keys), pipeline.at(smem.kv_seg, slot))
             ] if with_k else []
    return pairs + ([(gmem.v.at[b, keys, kv_head], smem.v.at[slot])] if with_v else [])

  if len(rings) == 1:
    issues = [lambda n, slot, barrier: pipeline.copy_in(copies(n, slot, True, True), barrier)]
  else:
    issues = [lambda n, slot, barrier: pipeline.copy_in(copies(n, slot, True, False), barrier),
              lambda n, slot, barrier: pipeline.copy_in(copies(n, slot, False, True), barrier)]
  pipeline.produce(plan.count, cfg.blocks.stages, list(zip(rings, issues)))


def _query_tile_kernel(compute, gmem: _Operands, smem, rings, per_step: int, cfg: _Config):
  """The frame of the forward and dQ kernels. The producer warpgroup streams
  the K/V tiles that the CTA's query tiles see (`_stream_kv`, through
  `rings`); each compute warpgroup runs `compute(q_start, plan, turns)` on
  its own query tile, taking turns on the tensor cores through the turn
  barriers of `smem`, `per_step` a step."""
  wg = lax.axis_index("wg")
  cta_q = _cta_q_start(cfg)

  @pl.when(wg == PRODUCER)
  def _producer():
    _stream_kv(gmem, smem, rings, _query_rows_plan(cta_q, 0, gmem.plan, cfg), cfg)

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    pipeline.set_registers(producer=False)
    turns = pipeline.Turns(smem.turn, cfg.blocks.pingpong, per_step=per_step)
    turns.start()
    compute(cta_q + wg * ROWS, _query_rows_plan(cta_q, wg, gmem.plan, cfg), turns)
    turns.finish()


def _over_kv_tiles(step, carry, plan: _Plan, rings, turns, cfg: _Config,
                   prologue=None, last=None):
  """A compute warpgroup's steps over the key tiles of its plan, from step
  0 (plan.first is 0): `carry = prologue()` if given (which takes step 0,
  masked); `step(n, carry, masked=...)` over the rest of [0, plan.last),
  in one loop for a listed plan (`masked` a traced flag, the masked steps
  first), else in two (the unmasked steps first); then `last(carry,
  plan.last)` if given; then passes the rest of the CTA's steps."""
  start = 0
  if prologue is not None:
    carry, start = prologue(), 1
  if plan.listed:
    carry = lax.fori_loop(start, plan.last,
                          lambda n, c: step(n, c, masked=n < plan.whole_from), carry)
  else:
    masked_from = jnp.maximum(plan.whole_to, start)
    carry = lax.fori_loop(start, masked_from, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(masked_from, plan.last, functools.partial(step, masked=True), carry)
  if last is not None:
    carry = last(carry, plan.last)
  pipeline.pass_steps(plan.last, plan.count, cfg.blocks.stages, rings, turns)
  return carry


def _masked_if(masked, mask, x):
  """mask(x) if the step is masked: `masked` is a Python bool, or a traced
  one (a listed plan's steps, in one loop)."""
  if isinstance(masked, bool):
    return mask(x) if masked else x
  return lax.cond(masked, mask, lambda x: x, x)


def _base2(s, cfg: _Config):
  """Scores `s`, the factor that takes them to base 2 and the soft-cap's
  tanh tile (None without a cap): (s, scale * log2 e) for a positive scale,
  so that the factor meets the subtracted max or lse in one FFMA per score
  (and the row max is taken before scaling); else the scores already scaled,
  and 1 (a scale <= 0 would turn the mask's -inf); with a soft-cap, the
  capped scaled scores and log2 e."""
  if cfg.softcap is not None:
    capped, tanh = common.soft_cap_tile(s * cfg.scale, cfg.softcap)
    return capped, common.LOG2_E, tanh
  factor = cfg.scale * common.LOG2_E
  return (s, factor, None) if factor > 0 else (s * factor, 1.0, None)


def _key_segments(kv_seg_smem, slot, masked: bool, cfg: _Config, ops: _Ops):
  """The segment ids of the key tile in ring `slot`, as a vector along a
  query tile's columns, if a step that may be masked needs them; read
  before the slot is freed."""
  if masked is False or not cfg.segments:
    return None
  return ops.load_vector(kv_seg_smem.at[slot], along=0)


def _forward_kernel(gmem: _Operands, out: _ForwardOut, smem: _ForwardScratch, *,
                    cfg: _Config, ops: _Ops):
  """Forward: online softmax of two query tiles against streamed K/V tiles.

  Software-pipelined (FlashAttention-3's intra-warpgroup overlap): in one
  turn on the tensor cores a warpgroup issues S_j = Q K_j^T and
  P_{j-1} V_{j-1}, and waits once; the softmax of S_j then runs while the
  other warpgroup has its turn. So each turn carries both matmuls of a
  step, enough to cover the other warpgroup's exponentials, which at
  head_dim 128 take longer than one matmul (`bench/compile_h200.py`: 528
  MUFU against 512 tensor cycles). K and V have barriers of their own: K_j
  is freed after S_j, V_j a turn later after P_j V_j.
  """
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  stages = cfg.blocks.stages
  rings = [(smem.k_full, smem.k_free), (smem.v_full, smem.v_free)]

  def compute(q_start, plan: _Plan, turns):
    q_tile = smem.q.at[wg]
    q_rows = (b, pl.ds(q_start, ROWS), h)
    pipeline.copy_in([(gmem.q.at[q_rows], q_tile),
                      (pipeline.at(gmem.q_seg, b, pl.ds(q_start, ROWS)),
                       pipeline.at(smem.q_seg, wg))],
                     smem.q_full.at[wg])
    plgpu.barrier_wait(smem.q_full.at[wg])
    q_seg = ops.load_vector(smem.q_seg.at[wg], along=1) if cfg.segments else None

    def softmax(n, s, kv_seg, o, m, l, masked: bool):
      """Online softmax of step n's S (key segment ids `kv_seg`): o and l
      rescaled, the new max, P (16-bit)."""
      s, factor, _ = _base2(s, cfg)
      s = _masked_if(masked, lambda s: _mask(
          s, q_start, plan.tile(n) * cfg.blocks.block_k, ops, cfg, transposed=False,
          q_seg=q_seg, kv_seg=kv_seg), s)
      m_new = jnp.maximum(m, jnp.max(s, axis=1) * factor)  # base 2
      if cfg.segments:  # a row with no visible key yet keeps m = -inf
        m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      else:
        m_new_safe = m_new
      alpha = jnp.exp2(m - m_new_safe)
      p = jnp.exp2(s * factor - _rows(m_new_safe, s.shape))
      l = l * alpha + jnp.sum(p, axis=1)
      return o * _rows(alpha, o.shape), m_new, l, p.astype(q_tile.dtype)

    def step(n, carry, masked: bool):
      o, m, l, p = carry
      slot, prev = lax.rem(n, stages), lax.rem(n - 1, stages)
      plgpu.barrier_wait(smem.v_full.at[prev])
      plgpu.barrier_wait(smem.k_full.at[slot])
      turns.take()
      o, s = ops.matmuls([[(p, smem.v.at[prev], False, False)],
                          [(q_tile, smem.k.at[slot], False, True)]], [o, None])
      turns.hand_over()
      kv_seg = _key_segments(smem.kv_seg, slot, masked, cfg, ops)
      pipeline.release(smem.v_free.at[prev])
      pipeline.release(smem.k_free.at[slot])
      return softmax(n, s, kv_seg, o, m, l, masked)

    def last(carry, seen):
      """P V of the last step taken."""
      o, m, l, p = carry
      slot = lax.rem(seen - 1, stages)
      plgpu.barrier_wait(smem.v_full.at[slot])
      turns.take()
      o = ops.matmul(p, smem.v.at[slot], acc=o)
      turns.hand_over()
      pipeline.release(smem.v_free.at[slot])
      return o, m, l, p

    def prologue():
      """Step 0, which every warpgroup takes: S alone (masked, to be safe
      for every tile; one of many)."""
      plgpu.barrier_wait(smem.k_full.at[0])
      turns.take()
      s = ops.matmul(q_tile, smem.k.at[0], transpose_b=True)
      turns.hand_over()
      kv_seg = _key_segments(smem.kv_seg, 0, True, cfg, ops)
      pipeline.release(smem.k_free.at[0])
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      return softmax(0, s, kv_seg, ops.tile(jnp.zeros(q_tile.shape, jnp.float32)),
                     ops.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
                     ops.cast(jnp.zeros((ROWS,), jnp.float32), row_layout), masked=True)

    o, m, l, _ = _over_kv_tiles(step, None, plan, rings, turns, cfg, prologue=prologue,
                                last=last)

    lse = m + jnp.log2(l)
    if cfg.segments:  # an empty row: output 0, and lse = +inf makes P = 0
      empty = l == 0.0
      l = jnp.where(empty, 1.0, l)
      lse = jnp.where(empty, jnp.inf, lse)
    q_tile[...] = (o / _rows(l, o.shape)).astype(q_tile.dtype)
    smem.lse.at[wg][...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, out.o.at[q_rows])
    plgpu.copy_smem_to_gmem(smem.lse.at[wg], out.lse.at[b, h, pl.ds(q_start, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  # A turn a step, and one more: S_0 alone, then P V of the last tile alone.
  _query_tile_kernel(compute, gmem, smem, rings, 1, cfg)


def _dq_kernel(gmem: _Operands, out: _DqOut, smem: _DqScratch, *, cfg: _Config, ops: _Ops):
  """Backward, dQ of two query tiles: recompute P from the lse per K/V tile."""
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  stages = cfg.blocks.stages
  rings = [(smem.kv_full, smem.kv_free)]

  def compute(q_start, plan: _Plan, turns):
    q_tile, do_tile = smem.q.at[wg], smem.do.at[wg]
    q_rows = (b, pl.ds(q_start, ROWS), h)
    vec_rows = (b, h, pl.ds(q_start, ROWS))
    pipeline.copy_in([(gmem.q.at[q_rows], q_tile), (gmem.do.at[q_rows], do_tile),
                      (gmem.lse.at[vec_rows], smem.lse.at[wg]),
                      (gmem.delta.at[vec_rows], smem.delta.at[wg]),
                      (pipeline.at(gmem.q_seg, b, pl.ds(q_start, ROWS)),
                       pipeline.at(smem.q_seg, wg))],
                     smem.q_full.at[wg])
    plgpu.barrier_wait(smem.q_full.at[wg])
    lse = ops.load_vector(smem.lse.at[wg], along=1)
    delta = ops.load_vector(smem.delta.at[wg], along=1)
    q_seg = ops.load_vector(smem.q_seg.at[wg], along=1) if cfg.segments else None

    def step(n, dq, masked: bool):
      slot = lax.rem(n, stages)
      plgpu.barrier_wait(smem.kv_full.at[slot])
      turns.take()
      s, dp = ops.matmuls([[(q_tile, smem.k.at[slot], False, True)],
                           [(do_tile, smem.v.at[slot], False, True)]])
      turns.hand_over()
      s, factor, tanh = _base2(s, cfg)
      x = s * factor - _rows(lse, s.shape)  # masked after: one FFMA a score
      kv_seg = _key_segments(smem.kv_seg, slot, masked, cfg, ops)
      x = _masked_if(masked, lambda x: _mask(
          x, q_start, plan.tile(n) * cfg.blocks.block_k, ops, cfg, transposed=False,
          q_seg=q_seg, kv_seg=kv_seg), x)
      p = jnp.exp2(x)
      ds = common.soft_cap_grad(p * (dp - _rows(delta, dp.shape)), tanh)
      turns.take()
      dq = ops.matmul(ds.astype(q_tile.dtype), smem.k.at[slot], transpose_b=False,
                      acc=dq)
      turns.hand_over()
      pipeline.release(smem.kv_free.at[slot])
      return dq

    dq = _over_kv_tiles(step, ops.tile(jnp.zeros(q_tile.shape, jnp.float32)), plan,
                        rings, turns, cfg)
    q_tile[...] = (dq * cfg.scale).astype(q_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, out.dq.at[q_rows])
    plgpu.wait_smem_to_gmem(0)

  _query_tile_kernel(compute, gmem, smem, rings, 2, cfg)


class _DqExchange:
  """The fused backward's dQ: dS K over the CTA's 128 keys, added to the
  float32 dQ in global memory once per CTA step.

  Each compute warpgroup puts its dS^T tile (its 64 keys x the step's
  queries) in shared memory; at step t warpgroup t % 2 multiplies both
  tiles, transposed, by the CTA's two key tiles (64 output columns per
  wgmma, so that the product takes 32 float32 registers a thread) and adds
  the product to dQ with one TMA reduce-add, while the other warpgroup
  passes the same number of turns. Against each warpgroup adding the part
  of its own 64 keys, that halves the reduce traffic to global memory, as
  FlashAttention-3 does (a dQ tile added per 128 keys).

  Barriers: `ready[w]` completes when both warpgroups have stored their dS
  of a step that warpgroup w multiplies (two arrivals); `read[w]` when
  warpgroup w has read them, which the other waits for before it stores
  the next step's dS.
  """

  def __init__(self, smem: "_DkDvScratch", ops: _Ops):
    pipeline.check_arrivals(smem.ds_ready, COMPUTE_WGS, "compute warpgroups")
    pipeline.check_arrivals(smem.ds_read, 1, "the multiplying warpgroup")
    self.ds_smem, self.dq_smem, self.k_smem = smem.ds, smem.dq, smem.k
    self.ready, self.read, self.ops = smem.ds_ready, smem.ds_read, ops
    self.wg = lax.axis_index("wg")
    self.chunks = smem.k.shape[-1] // _DQ_COLUMNS  # turns `add` takes a step

  def _mine(self, t):
    return lax.rem(t, COMPUTE_WGS) == self.wg

  def put(self, ds_t, t):
    """Stores this warpgroup's dS^T of step t, once the other warpgroup has
    read step t - 1's (when it was the one multiplying)."""
    other = 1 - self.wg
    pl.when((t > 0) & self._mine(t))(lambda: plgpu.barrier_wait(self.read.at[other]))
    self.ds_smem.at[self.wg][...] = ds_t
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.ready.at[lax.rem(t, COMPUTE_WGS)])

  def add(self, t, dq_tile_ref, turns: pipeline.Turns):
    """At step t, dq_tile_ref [slabs, block_q, D] += dS K if this warpgroup's
    turn; else pass the turns."""
    wg, ops = self.wg, self.ops

    @pl.when(self._mine(t))
    def _multiply():
      plgpu.barrier_wait(self.ready.at[wg])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read dq_smem
      for c in range(self.chunks):
        columns = pl.ds(c * _DQ_COLUMNS, _DQ_COLUMNS)
        turns.take()
        part, = ops.matmuls([[(self.ds_smem.at[w], self.k_smem.at[w, :, columns], True, False)
                              for w in range(COMPUTE_WGS)]])
        turns.hand_over()
        self.dq_smem.at[wg, :, columns][...] = part
      plgpu.barrier_arrive(self.read.at[wg])
      plgpu.commit_smem()
      ops.add_to_gmem(self.dq_smem.at[wg], dq_tile_ref, wg)

    @pl.when(~self._mine(t))
    def _pass_turns():
      for _ in range(self.chunks):
        turns.take()
        turns.hand_over()

  def finish(self, num_steps):
    """Observes the other warpgroup's last `read`, which no `put` waited for."""
    last = num_steps - 1
    pl.when((num_steps > 0) & ~self._mine(last))(
        lambda: plgpu.barrier_wait(self.read.at[1 - self.wg]))


def _dkdv_kernel(gmem: _Operands, out: _DkDvOut, smem: _DkDvScratch, *, cfg: _Config,
                 ops: _Ops):
  """Backward, dK and dV of two key tiles: stream (query head of the group,
  query tile) pairs, recompute P^T from the lse, accumulate over both. With
  `fused_dq`, also add dS K for each pair into `gmem.dq_acc` [slabs, B, T,
  H, D] float32 (unscaled; `_DqExchange`)."""
  b, kv_head, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  block_q, stages = cfg.blocks.block_q_dkv, cfg.blocks.stages
  cta_k = lax.axis_index("k") * (COMPUTE_WGS * ROWS)

  @pl.when(wg == PRODUCER)
  def _producer():
    pipeline.set_registers(producer=True)
    plan = _key_rows_plan(cta_k, 0, gmem.plan, cfg)

    def issue(t, slot, barrier):
      head = kv_head * cfg.group + lax.div(t, plan.count)
      queries = pl.ds(plan.tile(plan.start + lax.rem(t, plan.count)) * block_q, block_q)
      pipeline.copy_in([(gmem.q.at[b, queries, head], smem.q.at[slot]),
                        (gmem.do.at[b, queries, head], smem.do.at[slot]),
                        (gmem.lse.at[b, head, queries], smem.lse.at[slot]),
                        (gmem.delta.at[b, head, queries], smem.delta.at[slot]),
                        (pipeline.at(gmem.q_seg, b, queries), pipeline.at(smem.q_seg, slot))],
                       barrier)
    pipeline.produce(cfg.group * plan.count, stages, [((smem.q_full, smem.q_free), issue)])

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    pipeline.set_registers(producer=False)
    k_start = cta_k + wg * ROWS
    k_tile, v_tile = smem.k.at[wg], smem.v.at[wg]
    dtype = k_tile.dtype
    k_rows = (b, pl.ds(k_start, ROWS), kv_head)
    pipeline.copy_in([(gmem.k.at[k_rows], k_tile), (gmem.v.at[k_rows], v_tile),
                      (pipeline.at(gmem.kv_seg, b, pl.ds(k_start, ROWS)),
                       pipeline.at(smem.kv_seg, wg))],
                     smem.kv_full.at[wg])
    plgpu.barrier_wait(smem.kv_full.at[wg])
    kv_seg = ops.load_vector(smem.kv_seg.at[wg], along=1) if cfg.segments else None
    plan = _key_rows_plan(cta_k, wg, gmem.plan, cfg)
    # Steps [first, whole) are masked, [whole, plan.last) not.
    first, whole, count = plan.first, plan.whole_from, plan.count
    exchange = None
    if cfg.blocks.fused_dq:
      exchange = _DqExchange(smem, ops)
      if cfg.causal or cfg.segments:
        # Both warpgroups take every tile the CTA streams (each dQ product
        # needs both dS), in one loop, every tile masked: with a masked and an
        # unmasked loop ptxas spilled 236 bytes at head_dim 128, with one none
        # (bench/compile_h200.py, before `_DqExchange`). The mask costs a
        # compare and a select per score, against five matmuls.
        first, whole = plan.start, plan.last
    turns = pipeline.Turns(smem.turn, cfg.blocks.pingpong,
                           per_step=3 + (exchange.chunks if exchange else 0))
    turns.start()

    def step(n, carry, g, masked: bool):
      dk, dv = carry
      t = g * count + n - plan.start  # the CTA's step
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(smem.q_full.at[slot])
      q_tile, do_tile = smem.q.at[slot], smem.do.at[slot]
      turns.take()
      s_t = ops.matmul(k_tile, q_tile, transpose_b=True)
      turns.hand_over()
      s_t, factor, tanh_t = _base2(s_t, cfg)
      lse = ops.load_vector(smem.lse.at[slot], along=0)
      x_t = s_t * factor - lax.broadcast_in_dim(lse, s_t.shape, [1])  # masked after: FFMA
      if masked:
        q_seg = ops.load_vector(smem.q_seg.at[slot], along=0) if cfg.segments else None
        x_t = _mask(x_t, plan.tile(n) * block_q, k_start, ops, cfg, transposed=True,
                    q_seg=q_seg, kv_seg=kv_seg)
      p_t = jnp.exp2(x_t)
      # dV first: P^T's registers are free before dP^T takes its own (with
      # S^T and dP^T issued together, ptxas spills at head_dim 128).
      turns.take()
      dv = ops.matmul(p_t.astype(dtype), do_tile, acc=dv)
      dp_t = ops.matmul(v_tile, do_tile, transpose_b=True)
      turns.hand_over()
      delta = ops.load_vector(smem.delta.at[slot], along=0)
      ds_t = common.soft_cap_grad(p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1])),
                                  tanh_t).astype(dtype)
      if exchange is not None:
        exchange.put(ds_t, t)
      turns.take()
      dk = ops.matmul(ds_t, q_tile, acc=dk)
      turns.hand_over()
      pipeline.release(smem.q_free.at[slot])  # the dQ product reads no slot of the ring
      if exchange is not None:
        exchange.add(t, gmem.dq_acc.at[:, b, pl.ds(plan.tile(n) * block_q, block_q),
                                      kv_head * cfg.group + g], turns)
      return dk, dv

    def head(g, carry):  # masked steps first, in either plan (`_key_rows_plan`)
      head_step0 = g * count
      pipeline.pass_steps(head_step0, head_step0 + first - plan.start, stages,
                          [(smem.q_full, smem.q_free)], turns)
      carry = lax.fori_loop(first, whole, functools.partial(step, g=g, masked=True), carry)
      return lax.fori_loop(whole, plan.last, functools.partial(step, g=g, masked=False),
                           carry)

    zeros = ops.tile(jnp.zeros(k_tile.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, cfg.group, head, (zeros, zeros))
    if exchange is not None:
      exchange.finish(cfg.group * count)
    turns.finish()
    k_tile[...] = (dk * cfg.scale).astype(dtype)
    v_tile[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_tile, out.dk.at[k_rows])
    plgpu.copy_smem_to_gmem(v_tile, out.dv.at[k_rows])
    plgpu.wait_smem_to_gmem(0)


def _forward_scratch(D: int, dtype, blocks: HopperBlocks, seg: bool) -> _ForwardScratch:
  """The forward's scratch; each barrier counts the arrivals of the copies
  or warpgroups that arrive on it."""
  ring = (blocks.stages, blocks.block_k, D)
  q = pipeline.swizzled_smem((COMPUTE_WGS, ROWS, D), dtype)
  q_seg = pipeline.vectors(COMPUTE_WGS, ROWS, jnp.int32, seg)
  k, v = pipeline.swizzled_smem(ring, dtype), pipeline.swizzled_smem(ring, dtype)
  kv_seg = pipeline.vectors(blocks.stages, blocks.block_k, jnp.int32, seg)
  return _ForwardScratch(
      q=q, q_seg=q_seg, lse=pipeline.vectors(COMPUTE_WGS, ROWS, jnp.float32), k=k, v=v,
      kv_seg=kv_seg,
      q_full=pipeline.filled_by(q, q_seg, num_barriers=COMPUTE_WGS),
      k_full=pipeline.filled_by(k, kv_seg, num_barriers=blocks.stages),
      k_free=pipeline.each_compute_wg(blocks.stages),
      v_full=pipeline.filled_by(v, num_barriers=blocks.stages),
      v_free=pipeline.each_compute_wg(blocks.stages),
      turn=pipeline.turn_barriers(blocks.pingpong))


def _dq_scratch(D: int, dtype, blocks: HopperBlocks, seg: bool) -> _DqScratch:
  """The dQ kernel's scratch (for `blocks`, which it reads `for_dq`)."""
  blocks = blocks.for_dq()
  own, ring = (COMPUTE_WGS, ROWS, D), (blocks.stages, blocks.block_k, D)
  q, do = pipeline.swizzled_smem(own, dtype), pipeline.swizzled_smem(own, dtype)
  lse = pipeline.vectors(COMPUTE_WGS, ROWS, jnp.float32)
  delta = pipeline.vectors(COMPUTE_WGS, ROWS, jnp.float32)
  q_seg = pipeline.vectors(COMPUTE_WGS, ROWS, jnp.int32, seg)
  k, v = pipeline.swizzled_smem(ring, dtype), pipeline.swizzled_smem(ring, dtype)
  kv_seg = pipeline.vectors(blocks.stages, blocks.block_k, jnp.int32, seg)
  return _DqScratch(
      q=q, do=do, lse=lse, delta=delta, q_seg=q_seg, k=k, v=v, kv_seg=kv_seg,
      q_full=pipeline.filled_by(q, do, lse, delta, q_seg, num_barriers=COMPUTE_WGS),
      kv_full=pipeline.filled_by(k, v, kv_seg, num_barriers=blocks.stages),
      kv_free=pipeline.each_compute_wg(blocks.stages),
      turn=pipeline.turn_barriers(blocks.pingpong))


def _dkdv_scratch(D: int, dtype, blocks: HopperBlocks, seg: bool) -> _DkDvScratch:
  """The dK/dV kernel's scratch, with the fused backward's dS and dQ tiles
  and barriers when `blocks.fused_dq`."""
  own, ring = (COMPUTE_WGS, ROWS, D), (blocks.stages, blocks.block_q_dkv, D)
  fused = blocks.fused_dq
  k, v = pipeline.swizzled_smem(own, dtype), pipeline.swizzled_smem(own, dtype)
  kv_seg = pipeline.vectors(COMPUTE_WGS, ROWS, jnp.int32, seg)
  q, do = pipeline.swizzled_smem(ring, dtype), pipeline.swizzled_smem(ring, dtype)
  lse = pipeline.vectors(blocks.stages, blocks.block_q_dkv, jnp.float32)
  delta = pipeline.vectors(blocks.stages, blocks.block_q_dkv, jnp.float32)
  q_seg = pipeline.vectors(blocks.stages, blocks.block_q_dkv, jnp.int32, seg)
  return _DkDvScratch(
      k=k, v=v, kv_seg=kv_seg, q=q, do=do, lse=lse, delta=delta, q_seg=q_seg,
      ds=(pipeline.swizzled_smem((COMPUTE_WGS, ROWS, blocks.block_q_dkv), dtype)
          if fused else None),
      dq=(pipeline.swizzled_smem((COMPUTE_WGS, blocks.block_q_dkv, D), jnp.float32)
          if fused else None),
      kv_full=pipeline.filled_by(k, v, kv_seg, num_barriers=COMPUTE_WGS),
      q_full=pipeline.filled_by(q, do, lse, delta, q_seg, num_barriers=blocks.stages),
      q_free=pipeline.each_compute_wg(blocks.stages),
      # `_DqExchange`: ready is arrived on by both warpgroups, read by one.
      ds_ready=pipeline.each_compute_wg(COMPUTE_WGS) if fused else None,
      ds_read=plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS) if fused else None,
      turn=pipeline.turn_barriers(blocks.pingpong))


# Mosaic GPU's own shared memory in the forward kernel, beyond its scratch
# list (for the softmax's row max and sum across warps): the allocation it
# reports for every forward tile choice compiled by bench/compile_h200.py is
# the scratch list plus 2 KiB; for the dQ and dK/dV kernels, the list alone.
_FORWARD_EXTRA_BYTES = 2048


def shared_memory_bytes(head_dim: int, dtype, blocks: HopperBlocks,
                        segments: bool) -> dict[str, int]:
  """Shared memory each kernel takes, as Mosaic GPU allocates it
  (`hopper_pipeline.scratch_bytes`, and 2 KiB more in the forward:
  `_FORWARD_EXTRA_BYTES`)."""
  scratch = {"forward": (_forward_scratch, blocks),
             "dq": (_dq_scratch, blocks.for_backward()),
             "dkdv": (_dkdv_scratch, blocks.for_backward())}
  sizes = {name: pipeline.scratch_bytes(build(head_dim, dtype, tiles, segments))
           for name, (build, tiles) in scratch.items()}
  sizes["forward"] += _FORWARD_EXTRA_BYTES
  return sizes


def _check_shared_memory(head_dim: int, dtype, blocks: HopperBlocks, segments: bool):
  sizes = shared_memory_bytes(head_dim, dtype, blocks, segments)
  name, size = max(sizes.items(), key=lambda item: item[1])
  if size > pipeline.SHARED_MEMORY_BYTES:
    raise ValueError(
        f"flash_attention: {blocks} with head_dim {head_dim} needs "
        f"{size / 1024:.1f} KiB of shared memory in the {name} kernel, over the "
        f"{pipeline.SHARED_MEMORY_BYTES // 1024} KiB of an H100/H200; use fewer stages "
        "or a smaller block_k")


def _query_plan(q_seg_BT, kv_seg_BS, block_k: int, cfg: _Config):
  """The listed plan of the forward or dQ kernel (key tiles of `block_k`)
  from the segment ids: (tiles [B, C, J], bounds [B, C, 2, 3]), or None
  without segment ids."""
  if not cfg.segments:
    return None
  return block_sparse.plan_over_keys(q_seg_BT, kv_seg_BS, q_tile=ROWS, k_tile=block_k,
                                     causal=cfg.causal, per_cta=COMPUTE_WGS,
                                     window=cfg.window)


def _key_plan(q_seg_BT, kv_seg_BS, cfg: _Config):
  """The listed plan of the dK/dV kernel (query tiles of block_q_dkv), or
  None without segment ids."""
  if not cfg.segments:
    return None
  return block_sparse.plan_over_queries(q_seg_BT, kv_seg_BS, q_tile=cfg.blocks.block_q_dkv,
                                        k_tile=ROWS, causal=cfg.causal, per_cta=COMPUTE_WGS,
                                        window=cfg.window)


def _kernel(name: str, body, out_type, scratch, grid, names, cfg: _Config):
  """The kernel `flash_attention_hopper_{name}` (`hopper_pipeline.kernel`):
  body(operands, outputs, scratch, cfg=, ops=) receives an `_Operands` of
  global-memory refs, outputs as refs in the NamedTuple type of `out_type`,
  and `scratch` as a NamedTuple of refs."""
  return pipeline.kernel(
      f"flash_attention_hopper_{name}",
      lambda operands, outputs, refs: body(operands, outputs, refs, cfg=cfg,
                                           ops=_Ops(cfg.interpret)),
      out_type, scratch, grid, names, interpret=cfg.interpret)


def _forward(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, cfg: _Config):
  """(out [B, T, H, D], lse [B, H, T] base 2)."""
  B, T, H, D = q_BTHD.shape
  gmem = _Operands(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS,
                   plan=_query_plan(q_seg_BT, kv_seg_BS, cfg.blocks.block_k, cfg))
  out_type = _ForwardOut(o=jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
                         lse=jax.ShapeDtypeStruct((B, H, T), jnp.float32))
  return _kernel("forward", _forward_kernel, out_type,
                 _forward_scratch(D, q_BTHD.dtype, cfg.blocks, cfg.segments),
                 (T // (COMPUTE_WGS * ROWS), B, H), ("q", "b", "h"), cfg)(gmem)


def _backward(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, o_BTHD, lse_BHT,
              do_BTHD, cfg: _Config):
  """(dq, dk, dv) from the dQ kernel and the dK/dV kernel, or from the
  dK/dV kernel alone with `fused_dq`."""
  cfg = dataclasses.replace(cfg, blocks=cfg.blocks.for_backward())
  B, T, H, D = q_BTHD.shape
  dtype = q_BTHD.dtype
  gmem = _Operands(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, do=do_BTHD, lse=lse_BHT,
                   delta=common.delta(o_BTHD, do_BTHD))
  dkdv_gmem = gmem._replace(plan=_key_plan(q_seg_BT, kv_seg_BS, cfg))
  if cfg.blocks.fused_dq:
    return _fused_backward(dkdv_gmem, cfg)
  dq_cfg = dataclasses.replace(cfg, blocks=cfg.blocks.for_dq())
  dq = _kernel("dq", _dq_kernel, _DqOut(jax.ShapeDtypeStruct(q_BTHD.shape, dtype)),
               _dq_scratch(D, dtype, cfg.blocks, cfg.segments),
               (T // (COMPUTE_WGS * ROWS), B, H), ("q", "b", "h"), dq_cfg)(
                   gmem._replace(plan=_query_plan(q_seg_BT, kv_seg_BS,
                                                  dq_cfg.blocks.block_k, cfg))).dq
  return (dq, *_dkdv(dkdv_gmem, cfg))


def _dkdv(gmem: _Operands, cfg: _Config) -> _DkDvOut:
  """The dK/dV kernel run on `gmem`."""
  (B, S, K, D), dtype = gmem.k.shape, gmem.q.dtype
  grad = jax.ShapeDtypeStruct(gmem.k.shape, dtype)
  return _kernel("dkdv", _dkdv_kernel, _DkDvOut(dk=grad, dv=grad),
                 _dkdv_scratch(D, dtype, cfg.blocks, cfg.segments),
                 (S // (COMPUTE_WGS * ROWS), B, K), ("k", "b", "h"), cfg)(gmem)


@functools.partial(jax.jit, static_argnums=(1,))
def _fused_backward(gmem: _Operands, cfg: _Config):
  """(dq, dk, dv) from the dK/dV kernel alone, adding into a zeroed float32
  dQ (jitted: a Ref in global memory exists only inside `jit`)."""
  q_BTHD = gmem.q
  dq_acc = jax.new_ref(jnp.zeros((_Ops(cfg.interpret).dq_slabs, *q_BTHD.shape),
                                 jnp.float32), memory_space=plgpu.GMEM)
  dk, dv = _dkdv(gmem._replace(dq_acc=dq_acc), cfg)
  return (dq_acc[...].sum(0) * cfg.scale).astype(q_BTHD.dtype), dk, dv


_flash = common.flash_vjp(_forward, _backward)


def _setup(q_BTHD, k_BSKD, *, causal: bool, scale: float, segments: bool,
           blocks: HopperBlocks | None, interpret: bool, softcap: float | None,
           window: int | None = None):
  """The call's `_Config` and `common.padded_call`'s padding (query and key
  lengths to whole tiles; with a sliding `window`, the plan's segment ids)."""
  _, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  blocks = blocks or choose_hopper_blocks(D, S, interpret=interpret)
  segments = segments or window is not None
  _check_shared_memory(D, q_BTHD.dtype, blocks, segments)
  cfg = _Config(scale=scale, causal=causal, softcap=softcap, segments=segments, window=window,
                q_len=T, kv_len=S, group=H // K, blocks=blocks, interpret=interpret)
  return cfg, dict(q_multiple=blocks.q_multiple, kv_multiple=blocks.kv_multiple,
                   segments=window is not None)


def hopper_flash_attention(q_BTHD, k_BSKD, v_BSKD, *, causal: bool, scale: float,
                           q_segment_ids=None, kv_segment_ids=None,
                           blocks: HopperBlocks | None = None, interpret: bool,
                           softcap: float | None = None, window: int | None = None):
  """Attention [B, T, H, D] for inputs `supports` accepts.

  Query and key lengths are zero-padded to whole tiles (padded keys are
  masked, padded query rows cut off), so any T and S work. The mask
  semantics of `common.py`: causal top-left aligned; segment ids [B, T] and
  [B, S] (both or neither); a query that sees no key gets zeros. The same
  semantics as `flash_attention`; `softcap` its soft-cap, `window` its
  sliding window.
  """
  cfg, padding = _setup(q_BTHD, k_BSKD, causal=causal, scale=scale,
                        segments=q_segment_ids is not None, blocks=blocks,
                        interpret=interpret, softcap=softcap, window=window)
  return common.padded_call(
      lambda q, k, v, q_seg, kv_seg: _flash(q, k, v, q_seg, kv_seg, cfg),
      q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, **padding)


def hopper_parts(q_BTHD, k_BSKD, **options) -> common.Parts:
  """The Hopper kernels' forward (with its lse) and backward for inputs shaped
  like q and k; `options` (causal, scale, segments, blocks, interpret,
  softcap, window) as `_setup`'s."""
  cfg, padding = _setup(q_BTHD, k_BSKD, **options)
  return common.padded_parts(lambda *a: _forward(*a, cfg), lambda *a: _backward(*a, cfg),
                             q_BTHD, k_BSKD, **padding)
