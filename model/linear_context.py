"""Gated DeltaNet over rows split across the context axis (`mesh.context`):
the linear layers' side of context parallelism (the full layers run the
ring of model/context_parallel.py).

The layer's state is small and of fixed size, and the gated delta rule is
affine in it: from a state S_in, a stretch of tokens ends in
S_out = A S_in + B, where A [d_k, d_k] is the product of the per-token maps
exp(g_t)(I - beta_t k_t k_t^T) and B the state the stretch ends in from zero;
each output o_t = S_t^T q_t is o_t(0) + S_in^T A_t^T q_t. One run of
`gated_deltanet.chunked` gives all of it: on the values [0 | v] from the
state [I | 0] (d_k + d_v columns; the rule treats every column by itself)
it ends in [A | B] and outputs [A_t^T q_t | o_t(0)].

So each device, for each of its chunks of the row (two under the zig-zag
layout), runs that from the chunk's start; the devices all-gather every
chunk's (A, B) (d_k (d_k + d_v) floats per value head and row, whatever the
length), each composes them in row order (2 x context steps of a d_k x d_k
product) to the state every chunk starts from, and corrects its outputs by
it. The short convolution reads the K-1 inputs before each chunk (a halo,
all-gathered with the chunks' last segment ids). A new document (a changed
segment id) at a chunk's start drops the incoming state and the halo, as
the rule and the convolution do inside a chunk. The rule costs about
(d_k + d_v) / d_v times the one-device run; the gathers are transposed by
autodiff (reduce-scatters), so gradients need nothing more.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model import context_parallel
from model.gated_deltanet import causal_conv, chunked
from model.layers import batch_axes


def _chunk_order(n: int, layout: str) -> np.ndarray:
  """[c] for each chunk of the row, its place in an all-gather of every
  device's chunks (device order, each device's chunks in local order)."""
  ids = [cid for d in range(n) for cid in context_parallel.device_chunks(d, n, layout)]
  return np.argsort(ids)


def _gather_chunks(x_BM, n: int, layout: str):
  """[B, c, ...] every device's per-chunk `x` [B, m, ...] in row order."""
  gathered = jax.lax.all_gather(x_BM, context_parallel.AXIS, axis=1, tiled=True)
  return gathered[:, _chunk_order(n, layout)]


def _previous(x_BC, mine):
  """[B, m, ...] for each of this device's chunks (`mine` [m], their ids),
  `x_BC`'s entry of the chunk before it (zeros before the first)."""
  padded = jnp.concatenate([jnp.zeros_like(x_BC[:, :1]), x_BC], axis=1)
  return padded[:, mine]


def _local_rule(y_q, y_k, y_v, g, beta, seg, kernels, *, chunk: int, layout: str):
  """One device's block [B, m * c, ...] (m chunks of c tokens): its conv
  inputs y, gates, segment ids and conv kernels -> the rule's output."""
  n, me = jax.lax.axis_size(context_parallel.AXIS), jax.lax.axis_index(context_parallel.AXIS)
  m = context_parallel.chunks_per_device(layout)
  mine = jnp.stack(context_parallel.device_chunks(me, n, layout))
  B, c = seg.shape[0], seg.shape[1] // m
  split = lambda x: x.reshape(B, m, c, *x.shape[2:])
  merge = lambda x: x.reshape(B * m, *x.shape[2:])  # chunks as rows
  seg_BMC = split(seg)
  first_BM, last_BM = seg_BMC[:, :, 0], seg_BMC[:, :, -1]
  prev_last_BM = _previous(_gather_chunks(last_BM, n, layout), mine)
  continues_BM = prev_last_BM == first_BM

  convs = []
  for y, kernel in zip((y_q, y_k, y_v), kernels):
    K = kernel.shape[0]
    y = split(y)
    halo = _previous(_gather_chunks(y[:, :, c - (K - 1):], n, layout), mine)
    halo_seg = _previous(_gather_chunks(seg_BMC[:, :, c - (K - 1):], n, layout), mine)
    halo = halo * (halo_seg == first_BM[..., None])[..., None, None].astype(halo.dtype)
    window = jnp.concatenate([halo, y], axis=2)
    convs.append(causal_conv(merge(window), kernel, merge(seg_BMC)))
  q, k, v = convs

  H, Dk = v.shape[2], q.shape[-1]
  values = jnp.concatenate([jnp.zeros((*v.shape[:3], Dk), v.dtype), v], axis=-1)
  start = jnp.concatenate([jnp.broadcast_to(jnp.eye(Dk), (B * m, H, Dk, Dk)),
                           jnp.zeros((B * m, H, Dk, v.shape[-1]))], axis=-1)
  o, state = chunked(q, k, values, merge(split(g)), merge(split(beta)), start,
                     merge(seg_BMC), chunk=chunk)
  A_BC, B_BC = (_gather_chunks(x.reshape(B, m, *x.shape[1:]), n, layout)
                for x in (state[..., :Dk], state[..., Dk:]))
  resets_BC = ~_gather_chunks(continues_BM, n, layout)

  def compose(S_BHKV, xs):
    A, Bc, reset = xs
    S_in = jnp.where(reset[:, None, None, None], 0.0, S_BHKV)
    return jnp.einsum("bhkj,bhjv->bhkv", A, S_in) + Bc, S_in

  move = lambda x: jnp.moveaxis(x, 1, 0)
  _, S_in_CBHKV = jax.lax.scan(compose, jnp.zeros_like(B_BC[:, 0]),
                               (move(A_BC), move(B_BC), move(resets_BC)))
  S_in = merge(jnp.moveaxis(S_in_CBHKV[mine], 0, 1))  # [B * m, H, d_k, d_v]
  out = o[..., Dk:] + jnp.einsum("bthk,bhkv->bthv", o[..., :Dk], S_in)
  return out.reshape(B, m * c, *out.shape[2:])


def context_rule(y_q, y_k, y_v, g_BTH, beta_BTH, segment_ids_BT, kernels, *, chunk: int,
                 layout: str = "zigzag"):
  """The convolution and chunked gated delta rule (float32 [B, T, h_v, d_v])
  of rows laid out by `layout` and split over the context axis: y_* the
  convolutions' inputs [B, T, heads, dim], the gates [B, T, h_v], segment ids
  [B, T] (None: one document) and the three conv kernels; each device runs
  `_local_rule` on its block under `jax.shard_map` (batch over the batch axes,
  heads whole)."""
  mesh = jax.sharding.get_abstract_mesh()
  seg = (jnp.zeros(g_BTH.shape[:2], jnp.int32) if segment_ids_BT is None
         else segment_ids_BT.astype(jnp.int32))
  rows = P(batch_axes(mesh), context_parallel.AXIS)
  local = lambda *a: _local_rule(*a[:6], a[6:], chunk=chunk, layout=layout)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 6 + (P(),) * 3, out_specs=rows,
                       check_vma=False)(
      y_q, y_k, y_v, g_BTH, beta_BTH, seg, *kernels)
