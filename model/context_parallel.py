"""Attention over a sequence split across devices (context parallelism).

The lesson's cost section is why long context is hard: attention is O(n^2) in
time and, computed tile by tile with the online softmax, O(n) in memory, but
on one device. Here the sequence of q, k and v is split over a mesh axis of N
devices (`axis`, "context" in the model's mesh); each device holds T / N
queries, keys and values, and sees every key either way:

- `ring`: K/V blocks travel around the ring (`jax.lax.ppermute`), one hop per
  step; at each of the N steps a device attends its queries to the block it
  holds and merges the partial result into its running (output, log-sum-exp)
  with the online-softmax rule of the lesson: lse = logaddexp(lse_1, lse_2),
  o = o_1 e^(lse_1 - lse) + o_2 e^(lse_2 - lse). The next block's transfer is
  issued before the current block's compute, so the two may overlap. The
  backward pass (a custom VJP) recomputes each block's probabilities from the
  saved log-sum-exp, keeps dQ at home and sends dK/dV around the ring with
  their block, so after N hops they arrive home complete (software-pipelined:
  `_ring_backward`). Memory per device: its own blocks, the travelling
  blocks and their dK/dV, never the T x T scores.
- `all_gather`: K/V gathered once (`jax.lax.all_gather`), then the local
  queries attend to all of them (its transpose, a reduce-scatter, gives dK/dV).
  One collective per layer instead of N hops; cheap where K/V are small
  (GQA, MQA), as Llama 3 chose.

Both compute with blocks of one of two kinds: `JaxBlocks` (our JAX
attention, tile by tile) or `KernelBlocks` (our Pallas kernels, through
their forward with the log-sum-exp and their backward from the merged row's).
Both take the causal and segment-id masks (packing and padding; the ids
travel with their keys), a soft-cap and the softmax score; the JAX blocks a
causal sliding window too, their masks computed from each token's index in
the whole row (`token_index`), not from its position in the local block.

Causal load balance (`zigzag`): with a contiguous split device 0's queries see
almost no key and device N-1's see almost all. The zig-zag layout cuts the
row into 2N chunks and gives device i chunks i and 2N-1-i, so every device
does the same causal work (`causal_work`). The blocks then skip the fully
masked pairs (the JAX blocks per pair of tiles, by `jax.lax.cond`; the
kernel blocks per pair of chunks, by which of three calls they make).
"""
import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("ring", "all_gather")
LAYOUTS = ("zigzag", "contiguous")
AXIS = "context"

# What context-parallel attention takes beyond the causal and segment masks
# (`model.attention.AttentionOptions.features`).
TAKES = frozenset({"window", "softcap", "score:softmax"})
# What it takes with our Pallas kernels as the blocks (`KernelBlocks`): no window.
KERNEL_BLOCK_TAKES = TAKES - {"window"}

# mesh.context_strategy while a step is traced (`use_strategy`).
_STRATEGY = contextvars.ContextVar("context_strategy", default="auto")


@contextlib.contextmanager
def use_strategy(strategy: str):
  """Traces inside run context-parallel attention by `strategy` (ring,
  all_gather or auto); the jitted steps set `mesh.context_strategy`."""
  token = _STRATEGY.set(strategy)
  try:
    yield
  finally:
    _STRATEGY.reset(token)


def current_strategy() -> str:
  """The strategy `use_strategy` set (auto without one)."""
  return _STRATEGY.get()


def context_size() -> int:
  """Devices each row is split over: the abstract mesh's `context` axis (1
  without a mesh or without the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[AXIS]


def choose_strategy(strategy: str, num_heads: int, num_kv_heads: int, n: int) -> str:
  """`strategy`, with `auto` resolved: `all_gather` where the whole row's K/V
  (2 T K D per row) is no larger than this device's queries and output (2 T H
  D / n), that is K n <= H (GQA and MQA with few devices: Llama 3's choice,
  one collective per layer and no more memory than the activations already
  hold); `ring` otherwise (MHA, or many devices), which holds one travelling
  block at a time. A memory rule: neither has been timed on a device here."""
  if strategy != "auto":
    return strategy
  return "all_gather" if num_kv_heads * n <= num_heads else "ring"


def layout_for(causal: bool) -> str:
  """The layout of a stack's rows: zig-zag for causal attention (balanced
  work), contiguous otherwise (every device's work is equal already)."""
  return "zigzag" if causal else "contiguous"


def chunks_per_device(layout: str) -> int:
  """How many chunks of the row each device holds: 2 zig-zag, 1 contiguous."""
  return 2 if layout == "zigzag" else 1


def device_chunks(device, n: int, layout: str):
  """The chunk ids (of `n * chunks_per_device(layout)` chunks of the row)
  device `device` holds, in its local order; `device` may be traced."""
  if layout == "zigzag":
    return (device, 2 * n - 1 - device)
  return (device,)


def row_order(length: int, n: int, layout: str) -> np.ndarray:
  """[length] the token index of the row at each place of the laid-out row:
  device i's block is places i * length / n to (i + 1) * length / n."""
  c = n * chunks_per_device(layout)
  if length % c:
    raise ValueError(f"a row of {length} tokens does not split into {c} chunks")
  chunk = length // c
  ids = [cid for d in range(n) for cid in device_chunks(d, n, layout)]
  return np.concatenate([np.arange(cid * chunk, (cid + 1) * chunk) for cid in ids])


def to_layout(x, n: int, layout: str, axis: int = 1):
  """`x` with its sequence `axis` reordered into `layout` (`row_order`): for
  zig-zag, the 2n chunks as (0, 2n-1, 1, 2n-2, ...), written as a reshape, a
  reverse and a stack, which XLA moves between devices without gathering the
  row; the identity for contiguous."""
  if layout == "contiguous":
    return x
  x = jnp.moveaxis(x, axis, 0)
  chunks = x.reshape(2 * n, x.shape[0] // (2 * n), *x.shape[1:])
  pairs = jnp.stack([chunks[:n], chunks[n:][::-1]], axis=1)
  return jnp.moveaxis(pairs.reshape(x.shape), 0, axis)


def from_layout(x, n: int, layout: str, axis: int = 1):
  """The inverse of `to_layout`."""
  if layout == "contiguous":
    return x
  x = jnp.moveaxis(x, axis, 0)
  pairs = x.reshape(n, 2, x.shape[0] // (2 * n), *x.shape[1:])
  chunks = jnp.concatenate([pairs[:, 0], pairs[:, 1][::-1]], axis=0)
  return jnp.moveaxis(chunks.reshape(x.shape), 0, axis)


def causal_work(length: int, n: int, layout: str) -> np.ndarray:
  """[n] (query, key) pairs each device computes under the causal mask with
  this layout, counted by chunk pairs: a pair whose keys all follow its
  queries is skipped, a pair on the diagonal counted whole (the blocks' tiles
  skip finer still inside it, by the same amount on every device)."""
  c = n * chunks_per_device(layout)
  chunk = length // c
  work = np.zeros(n, np.int64)
  for d in range(n):
    for qc in device_chunks(d, n, layout):
      work[d] += sum(chunk * chunk for kc in range(c) if kc <= qc)
  return work


def token_index(device, n: int, layout: str, block: int):
  """[block] the index in the whole row of each token of device `device`'s
  block of `block` tokens (`device` may be traced)."""
  chunk = block // chunks_per_device(layout)
  return jnp.concatenate([cid * chunk + jnp.arange(chunk)
                          for cid in device_chunks(device, n, layout)])


def _block_scores(q_BTKGD, k_BSKD, q_idx_T, k_idx_S, q_seg_BT, k_seg_BS, o):
  """Float32 scores [B, K, G, T, S] after the scale and soft-cap, the raw
  tanh argument's derivative factor (1 where no soft-cap), and the boolean
  mask [B, 1, 1, T, S]."""
  s = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                 preferred_element_type=jnp.float32) * o.scale
  dcap = None
  if o.softcap is not None:
    t = jnp.tanh(s / o.softcap)
    s, dcap = o.softcap * t, 1 - t * t
  valid = jnp.ones((1, 1, 1, q_idx_T.shape[0], k_idx_S.shape[0]), bool)
  offset_TS = q_idx_T[:, None] - k_idx_S[None, :]
  if o.causal:
    valid = valid & (offset_TS >= 0)
  if o.window is not None:
    valid = valid & (offset_TS < o.window)
  if q_seg_BT is not None:
    same = (q_seg_BT[:, :, None] == k_seg_BS[:, None, :]) & (k_seg_BS[:, None, :] != 0)
    valid = valid & same[:, None, None]
  return s, dcap, valid


def _tile_forward(q, k, v, q_idx, k_idx, q_seg, k_seg, o):
  """One tile pair's normalised output [B, T, K, G, D] (float32) and log-sum-exp
  [B, K, G, T] (-inf for a query that sees no key of the block)."""
  s, _, valid = _block_scores(q, k, q_idx, k_idx, q_seg, k_seg, o)
  s = jnp.where(valid, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])
  l = p.sum(-1)
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
  out = out / jnp.where(l > 0, l, 1.0).transpose(0, 3, 1, 2)[..., None]
  return out, lse


def _merge(out_a, lse_a, out_b, lse_b):
  """The online-softmax merge of two partial results over disjoint keys."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
  w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
  weight = lambda w: w.transpose(0, 3, 1, 2)[..., None]  # [B, K, G, T] -> [B, T, K, G, 1]
  return out_a * weight(w_a) + out_b * weight(w_b), lse


def _tile_backward(q, k, v, out, lse, dout, q_idx, k_idx, q_seg, k_seg, o):
  """dQ, dK, dV (float32) of one tile pair, from the whole row's `out` and `lse`
  (the probabilities recomputed as exp(s - lse))."""
  s, dcap, valid = _block_scores(q, k, q_idx, k_idx, q_seg, k_seg, o)
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  p = jnp.where(valid, jnp.exp(s - lse_safe[..., None]), 0.0)
  dv = jnp.einsum("bkgts,btkgd->bskd", p, dout)
  dp = jnp.einsum("btkgd,bskd->bkgts", dout, v.astype(jnp.float32))
  delta = jnp.einsum("btkgd,btkgd->bkgt", dout, out)
  ds = p * (dp - delta[..., None])
  if dcap is not None:
    ds = ds * dcap
  ds = ds * o.scale
  dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32))
  dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(jnp.float32))
  return dq, dk, dv


# The largest tile side of the blocks' score arrays: a chunk pair is computed
# tile pair by tile pair, so the scores in memory are [B, K, G, TILE, TILE]
# whatever the chunk (32 heads: 128 MiB per row in float32).
TILE = 1024


def _tiled(x, size: int, axis: int):
  """x with `axis` cut into tiles of `size`, the tile index first."""
  x = jnp.moveaxis(x, axis, 0)
  return jnp.moveaxis(x.reshape(x.shape[0] // size, size, *x.shape[1:]), 1, axis + 1)


def _untiled(x, axis: int):
  """The inverse of `_tiled`."""
  x = jnp.moveaxis(x, axis + 1, 1)
  return jnp.moveaxis(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), 0, axis)


def _visible(o, q_idx, k_idx):
  """Whether the causal mask leaves any key of `k_idx` to a query of `q_idx`."""
  return q_idx[-1] >= k_idx[0] if o.causal else True


def _block_forward(q, k, v, q_idx, k_idx, q_seg, k_seg, o, tile=None):
  """A chunk pair's (output [B, T, K, G, D] float32, lse [B, K, G, T]), tile
  pair by tile pair (`TILE`): for each query tile, the key tiles are merged
  by the online softmax, in `_loop`s (while loops: see `_loop` for why not a
  scan); a tile pair the causal mask hides is not computed. `tile`: the tile side (default the largest divisor
  of each side up to `TILE`); a tile must not straddle two chunks of the
  zig-zag layout (its row indices must run on)."""
  tq, tk = (math.gcd(q.shape[1], TILE), math.gcd(k.shape[1], TILE)) if tile is None else (tile,) * 2
  kt, vt, kit = _tiled(k, tk, 1), _tiled(v, tk, 1), _tiled(k_idx, tk, 0)
  kst = None if k_seg is None else _tiled(k_seg, tk, 1)
  qt, qit = _tiled(q, tq, 1), _tiled(q_idx, tq, 0)
  qst = None if q_seg is None else _tiled(q_seg, tq, 1)
  B, _, K, G, _ = q.shape
  pick = lambda tiles, i: None if tiles is None else tiles[i]

  def query_tile(i, acc):
    q_i, qi, qs = qt[i], qit[i], pick(qst, i)

    def key_tile(j, tile_acc):
      ki = kit[j]
      merged = lambda a: _merge(*a, *_tile_forward(q_i, kt[j], vt[j], qi, ki, qs, pick(kst, j),
                                                   o))
      return jax.lax.cond(_visible(o, qi, ki), merged, lambda a: a, tile_acc)

    init = (jnp.zeros(q_i.shape, jnp.float32), jnp.full((B, K, G, tq), -jnp.inf, jnp.float32))
    out_i, lse_i = _loop(kt.shape[0], key_tile, init)
    return acc[0].at[i].set(out_i), acc[1].at[i].set(lse_i)

  init = (jnp.zeros(qt.shape, jnp.float32), jnp.full((qt.shape[0], B, K, G, tq), -jnp.inf,
                                                     jnp.float32))
  out, lse = _loop(qt.shape[0], query_tile, init)
  return _untiled(out, 1), _untiled(lse, 3)


def _block_backward(q, k, v, out, lse, dout, q_idx, k_idx, q_seg, k_seg, o, tile=None):
  """A chunk pair's dQ, dK, dV (float32), tile pair by tile pair: a scan over
  key tiles, each accumulating its dK, dV over a scan of the query tiles and
  adding their dQ parts. `tile` as `_block_forward`'s."""
  tq, tk = (math.gcd(q.shape[1], TILE), math.gcd(k.shape[1], TILE)) if tile is None else (tile,) * 2
  qs = None if q_seg is None else _tiled(q_seg, tq, 1)
  queries = (_tiled(q, tq, 1), _tiled(out, tq, 1), _tiled(lse, tq, 3), _tiled(dout, tq, 1),
             _tiled(q_idx, tq, 0), qs)

  def one_key_tile(dq, key):
    kt, vt, ki, kst = key

    def step(dkv, query):
      qt, ot, lt, dot, qi, qst = query
      zeros = lambda: (jnp.zeros(qt.shape, jnp.float32), jnp.zeros(kt.shape, jnp.float32),
                       jnp.zeros(vt.shape, jnp.float32))
      grads = jax.lax.cond(_visible(o, qi, ki), lambda: _tile_backward(
          qt, kt, vt, ot, lt, dot, qi, ki, qst, kst, o), zeros)
      return (dkv[0] + grads[1], dkv[1] + grads[2]), grads[0]

    init = (jnp.zeros(kt.shape, jnp.float32), jnp.zeros(vt.shape, jnp.float32))
    (dk, dv), dq_parts = jax.lax.scan(step, init, queries)
    return dq + dq_parts, (dk, dv)

  ks = None if k_seg is None else _tiled(k_seg, tk, 1)
  dq0 = jnp.zeros((q.shape[1] // tq, *q.shape[:1], tq, *q.shape[2:]), jnp.float32)
  dq, (dk, dv) = jax.lax.scan(one_key_tile, dq0,
                              (_tiled(k, tk, 1), _tiled(v, tk, 1), _tiled(k_idx, tk, 0), ks))
  return _untiled(dq, 1), _untiled(dk, 1), _untiled(dv, 1)


def _loop(n: int, step, carry):
  """`step(i, carry)` for i in 0..n-1, as a `jax.lax.while_loop`.

  Not `fori_loop`: with a static trip count that is a scan, and inside an
  outer scan that is differentiated (the model's scanned layers), JAX's
  partial evaluation stacked every iteration's tile scores of this custom
  VJP's forward as residuals: O(T^2) memory (a train step of one layer at
  T = 16,384 on 4 devices: 4.35 GiB of temporaries, 0.38 GiB with this loop).
  """
  def body(state):
    i, carry = state
    return i + 1, step(i, carry)

  return jax.lax.while_loop(lambda state: state[0] < n, body, (0, carry))[1]


def _tile(n: int, layout: str, block: int) -> int:
  """The tile side of a device's block of `block` tokens: at most `TILE`, and
  never straddling two chunks of the layout (a tile's row indices run on,
  which the causal skip of `_visible` reads)."""
  return math.gcd(block // chunks_per_device(layout), TILE)


@dataclasses.dataclass(frozen=True)
class JaxBlocks:
  """The ring's blocks as JAX ops: `_block_forward` / `_block_backward`, tile
  pair by tile pair with masks from the row indices (`token_index`), so they
  take the sliding window too (`TAKES`). Every block method takes this
  device's queries and one device's keys: q [B, T, H, D], k and v
  [B, T, K, D], segment ids [B, T] or None, `me` this device and `src` the
  keys' device (traced), and works in float32: forward -> (out [B, T, H, D],
  lse [B, H, T]); backward(..., out, lse, do) -> (dq, dk, dv)."""
  o: "_Static"
  n: int
  layout: str

  def _indices(self, me, src, T: int):
    return (token_index(me, self.n, self.layout, T), token_index(src, self.n, self.layout, T),
            _tile(self.n, self.layout, T))

  def forward(self, q, k, v, q_seg, k_seg, me, src):
    B, T, H, _ = q.shape
    q_idx, k_idx, tile = self._indices(me, src, T)
    out, lse = _block_forward(_split_heads(q, k.shape[2]), k, v, q_idx, k_idx, q_seg, k_seg,
                              self.o, tile)
    return out.reshape(q.shape), lse.reshape(B, H, T)

  def backward(self, q, k, v, q_seg, k_seg, out, lse, do, me, src):
    B, T, H, _ = q.shape
    K = k.shape[2]
    q_idx, k_idx, tile = self._indices(me, src, T)
    split = lambda x: _split_heads(x.astype(jnp.float32), K)
    dq, dk, dv = _block_backward(_split_heads(q, K), k, v, split(out),
                                 lse.reshape(B, K, H // K, T), split(do), q_idx, k_idx, q_seg,
                                 k_seg, self.o, tile)
    return dq.reshape(q.shape), dk, dv


def _halves(h: int):
  """(first, second): a block's first and second chunk of `h` tokens along
  axis 1 (None stays None), as `KernelBlocks` cuts queries, keys and ids."""
  return ((lambda x: None if x is None else x[:, :h]),
          (lambda x: None if x is None else x[:, h:]))


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
  """The ring's blocks as our Pallas kernels (`model.kernels.router.
  flash_attention_parts`: the forward returning its log-sum-exp, the backward
  from the merged row's (out, lse)), the methods as `JaxBlocks`'.

  The kernels' causal mask is top-left aligned on local positions, which the
  zig-zag layout makes exact: a device's block is chunks (i, 2n-1-i) and a
  key block from device j is chunks (j, 2n-1-j), so per chunk pair the keys
  are all before the queries, all after, or the same chunk. Hence three
  kernel calls, chosen per step by `lax.switch`, none with a wasted tile:

  - j = i (the first step): one causal call on the whole block (chunk i
    cannot see 2n-1-i, chunk 2n-1-i sees all of i: the local causal mask);
  - j < i: every query sees the key block's first chunk (j) whole and
    nothing of its second (2n-1-j > 2n-1-i): a non-causal call on half the keys;
  - j > i: only the second query chunk (2n-1-i) sees the keys, all of them:
    a non-causal call on half the queries, the first half's lse -inf.

  So every step computes T^2 / 2 (query, key) pairs and the first T^2 / 2
  with the diagonal's mask: the balanced work of `causal_work`. Without the
  causal mask (the contiguous layout) every step is one non-causal call. The
  kernels take no sliding window, whose mask the local positions cannot
  express here."""
  o: "_Static"
  n: int
  layout: str
  dtype: str
  lowering: str | None
  device: object

  def _parts(self, q, k, causal: bool, segments: bool):
    from model.kernels.router import flash_attention_parts  # pylint: disable=import-outside-toplevel
    return flash_attention_parts(
        jax.ShapeDtypeStruct(q.shape, self.dtype), jax.ShapeDtypeStruct(k.shape, self.dtype),
        segments=segments, causal=causal, scale=self.o.scale, softcap=self.o.softcap,
        lowering=self.lowering, device=self.device)

  def _case(self, me, src):
    """0: the diagonal step, 1: keys before (j < i), 2: keys after."""
    if not self.o.causal:
      return 0
    return jnp.where(src == me, 0, jnp.where(src < me, 1, 2))

  def forward(self, q, k, v, q_seg, k_seg, me, src):
    B, T, H, D = q.shape
    h, segments = T // 2, q_seg is not None
    half, later = _halves(h)
    cast = lambda o, l: (o.astype(jnp.float32), l)

    def diagonal(q, k, v, q_seg, k_seg):
      return cast(*self._parts(q, k, self.o.causal, segments).forward(q, k, v, q_seg, k_seg))

    def keys_before(q, k, v, q_seg, k_seg):
      parts = self._parts(q, half(k), False, segments)
      return cast(*parts.forward(q, half(k), half(v), q_seg, half(k_seg)))

    def keys_after(q, k, v, q_seg, k_seg):
      out, lse = cast(*self._parts(later(q), k, False, segments).forward(
          later(q), k, v, later(q_seg), k_seg))
      return (jnp.concatenate([jnp.zeros((B, h, H, D), jnp.float32), out], 1),
              jnp.concatenate([jnp.full((B, H, h), -jnp.inf, jnp.float32), lse], 2))

    cases = [diagonal, keys_before, keys_after] if self.o.causal else [diagonal]
    return jax.lax.switch(self._case(me, src), cases, q, k, v, q_seg, k_seg)

  def backward(self, q, k, v, q_seg, k_seg, out, lse, do, me, src):
    T = q.shape[1]
    h, segments = T // 2, q_seg is not None
    half, later = _halves(h)
    out, do = out.astype(q.dtype), do.astype(q.dtype)
    f32 = lambda *grads: tuple(g.astype(jnp.float32) for g in grads)
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)

    def diagonal(q, k, v, q_seg, k_seg, out, lse, do):
      return f32(*self._parts(q, k, self.o.causal, segments).backward(
          q, k, v, q_seg, k_seg, out, lse, do))

    def keys_before(q, k, v, q_seg, k_seg, out, lse, do):
      dq, dk, dv = f32(*self._parts(q, half(k), False, segments).backward(
          q, half(k), half(v), q_seg, half(k_seg), out, lse, do))
      return (dq, jnp.concatenate([dk, zeros(dk)], 1), jnp.concatenate([dv, zeros(dv)], 1))

    def keys_after(q, k, v, q_seg, k_seg, out, lse, do):
      dq, dk, dv = f32(*self._parts(later(q), k, False, segments).backward(
          later(q), k, v, later(q_seg), k_seg, later(out), lse[:, :, h:], later(do)))
      return jnp.concatenate([zeros(dq), dq], 1), dk, dv

    cases = [diagonal, keys_before, keys_after] if self.o.causal else [diagonal]
    return jax.lax.switch(self._case(me, src), cases, q, k, v, q_seg, k_seg, out, lse, do)


def _merge_heads(out_a, lse_a, out_b, lse_b):
  """`_merge` of results [B, T, H, D] with their lse [B, H, T]."""
  out, lse = _merge(out_a[:, :, :, None], lse_a[:, :, None], out_b[:, :, :, None],
                    lse_b[:, :, None])
  return out[:, :, :, 0], lse[:, :, 0]


def _ring_forward(blocks, q, k, v, q_seg, k_seg, *, axis):
  """(out [B, T, H, D] float32, lse [B, H, T]) of the local queries against
  the whole row, the K/V blocks passed around the ring."""
  n, me = blocks.n, jax.lax.axis_index(axis)
  B, T, H, _ = q.shape
  perm = [(i, (i + 1) % n) for i in range(n)]

  def step(s, carry):
    out, lse, k, v, k_seg = carry
    # Issued before this block's compute, so the transfer may overlap it.
    nxt = jax.lax.ppermute((k, v, k_seg), axis, perm)
    block = blocks.forward(q, k, v, q_seg, k_seg, me, (me - s) % n)
    return (*_merge_heads(out, lse, *block), *nxt)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((B, H, T), -jnp.inf, jnp.float32))
  out, lse, *_ = _loop(n, step, (*init, k, v, k_seg))
  return out, lse


def _ring_backward(blocks, q, k, v, q_seg, k_seg, out, lse, dout, *, axis):
  """dQ, dK, dV (float32): dQ accumulated at home, dK and dV travelling with
  their block and home again after n hops.

  Software-pipelined so that every transfer can overlap a block's compute:
  at step s a device sends on the K/V it holds (for step s + 1) and the dK/dV
  sums it finished at step s - 1, while it computes its share of the block
  it holds; the sum for that block arrives meanwhile and the share is added
  to it. After the last step one more hop takes each block's sum home."""
  n, me = blocks.n, jax.lax.axis_index(axis)
  perm = [(i, (i + 1) % n) for i in range(n)]
  grads = lambda s, k, v, k_seg: blocks.backward(q, k, v, q_seg, k_seg, out, lse, dout, me,
                                                 (me - s) % n)
  nxt = jax.lax.ppermute((k, v, k_seg), axis, perm)
  dq, dk, dv = grads(0, k, v, k_seg)

  def step(s, carry):
    dq, k, v, k_seg, dk, dv = carry
    nxt = jax.lax.ppermute((k, v, k_seg), axis, perm)
    dk_in, dv_in = jax.lax.ppermute((dk, dv), axis, perm)
    g = grads(s, k, v, k_seg)
    return dq + g[0], *nxt, dk_in + g[1], dv_in + g[2]

  dq, _, _, _, dk, dv = _loop(n - 1, lambda i, c: step(i + 1, c), (dq, *nxt, dk, dv))
  dk, dv = jax.lax.ppermute((dk, dv), axis, perm)
  return dq, dk, dv


def _split_heads(q_BTHD, K: int):
  B, T, H, D = q_BTHD.shape
  return q_BTHD.reshape(B, T, K, H // K, D)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, q_seg, k_seg, blocks, axis):
  return _ring_fwd(q, k, v, q_seg, k_seg, blocks, axis)[0]


def _ring_fwd(q, k, v, q_seg, k_seg, blocks, axis):
  out, lse = _ring_forward(blocks, q, k, v, q_seg, k_seg, axis=axis)
  result = out.astype(q.dtype)
  return result, (q, k, v, q_seg, k_seg, out, lse)


def _ring_bwd(blocks, axis, residuals, dout):
  q, k, v, q_seg, k_seg, out, lse = residuals
  dq, dk, dv = _ring_backward(blocks, q, k, v, q_seg, k_seg, out, lse, dout, axis=axis)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _blocks(options, q_BTHD, n: int, layout: str, kernel):
  """The blocks a strategy computes with: `JaxBlocks`, or with `kernel` (a
  dict of the kernels' `lowering` and `device`) `KernelBlocks`."""
  o = _static(options, q_BTHD.shape[-1])
  if kernel is None:
    return JaxBlocks(o, n, layout)
  if o.window is not None:
    raise ValueError("context-parallel attention with our Pallas kernels takes no sliding "
                     "window; use attention_impl xla")
  return KernelBlocks(o, n, layout, jnp.dtype(q_BTHD.dtype).name, **kernel)


def ring_attention(q_BTHD, k_BSKD, v_BSKD, q_seg_BT=None, kv_seg_BS=None, *, options, axis: str,
                   layout: str = "zigzag", kernel=None):
  """Ring attention of this device's block, inside `shard_map` over `axis`.

  q [B, T, H, D], k and v [B, T, K, D] and the segment ids [B, T] are this
  device's blocks of rows laid out by `layout`; `options` an
  `AttentionOptions` (its causal mask, window, soft-cap and scale; no dense
  mask or bias, the softmax score) whose masks apply to the indices in the
  whole row. `kernel`: None for the JAX blocks (`JaxBlocks`), or the
  lowering and device of our Pallas kernels (`KernelBlocks`, a dict with
  `lowering`, None for the device's choice, and `device`). Returns this
  device's output block [B, T, H, D] in q's dtype.
  """
  n = jax.lax.axis_size(axis)
  blocks = _blocks(options, q_BTHD, n, layout, kernel)
  return _ring(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, blocks, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gathered(q, k, v, q_seg, k_seg, blocks, axis):
  return _gathered_fwd(q, k, v, q_seg, k_seg, blocks, axis)[0]


def _source(x, src, T: int):
  """Device `src`'s block of T tokens of a gathered row (or None)."""
  return None if x is None else jax.lax.dynamic_slice_in_dim(x, src * T, T, axis=1)


def _gathered_fwd(q, k, v, q_seg, k_seg, blocks, axis):
  me = jax.lax.axis_index(axis)
  B, T, H, _ = q.shape

  def step(src, carry):
    block = blocks.forward(q, _source(k, src, T), _source(v, src, T), q_seg,
                           _source(k_seg, src, T), me, src)
    return _merge_heads(*carry, *block)

  out, lse = _loop(blocks.n, step, (jnp.zeros(q.shape, jnp.float32),
                                    jnp.full((B, H, T), -jnp.inf, jnp.float32)))
  return out.astype(q.dtype), (q, k, v, q_seg, k_seg, out, lse)


def _gathered_bwd(blocks, axis, residuals, dout):
  q, k, v, q_seg, k_seg, out, lse = residuals
  me, T = jax.lax.axis_index(axis), q.shape[1]

  def step(src, carry):
    dq, dk, dv = carry
    g = blocks.backward(q, _source(k, src, T), _source(v, src, T), q_seg,
                        _source(k_seg, src, T), out, lse, dout, me, src)
    add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(
        acc, _source(acc, src, T) + x, src * T, axis=1)
    return dq + g[0], add(dk, g[1]), add(dv, g[2])

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = _loop(blocks.n, step, (zeros(q), zeros(k), zeros(v)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def all_gather_attention(q_BTHD, k_BSKD, v_BSKD, q_seg_BT=None, kv_seg_BS=None, *, options,
                         axis: str, layout: str = "zigzag", kernel=None):
  """All-gather attention of this device's block, inside `shard_map` over
  `axis`: the whole row's K/V (and their segment ids) gathered, then the
  local queries attend to each device's block in turn with the ring's blocks
  and merge (no more hops; the gather's transpose, a reduce-scatter, sums
  dK/dV back to their devices). Arguments as `ring_attention`'s."""
  n = jax.lax.axis_size(axis)
  blocks = _blocks(options, q_BTHD, n, layout, kernel)
  gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)
  return _gathered(q_BTHD, gather(k_BSKD), gather(v_BSKD), q_seg_BT, gather(kv_seg_BS), blocks,
                   axis)


def _static(options, head_dim: int):
  """`options` checked for what context parallelism takes, with its scale
  resolved (1/sqrt(head_dim) for None)."""
  if options.mask is not None or options.bias is not None or options.score != "softmax":
    what = ("a dense mask" if options.mask is not None else "an additive bias"
            if options.bias is not None else f"the {options.score!r} score")
    raise ValueError(f"context-parallel attention takes causal, segment and window masks, a "
                     f"soft-cap and the softmax score, not {what}")
  if options.window is not None and not options.causal:
    raise ValueError("context-parallel attention takes a sliding window with the causal mask "
                     "only")
  scale = head_dim ** -0.5 if options.scale is None else options.scale
  return _Static(options.causal, float(scale), options.softcap, options.window)


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static options the ring and the all-gather compute with."""
  causal: bool
  scale: float
  softcap: float | None
  window: int | None
