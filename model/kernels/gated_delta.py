"""A Pallas kernel for the chunked gated delta rule (Gated DeltaNet's
training form, `model.gated_deltanet.chunked`), in both lowerings: Triton
on a GPU, Mosaic on a TPU, the Pallas interpreter on a CPU.

One program per (batch row, value head) runs the row's chunks in order and
keeps the head's state S [d_k, d_v] in float32 on chip (registers on a GPU,
VMEM scratch on a TPU) from one chunk to the next; HBM sees each input once
and each output once. Per chunk of C tokens, `_chunk_step` computes what the
XLA form computes (its WY form, `model/gated_deltanet.py`'s docstring):

  A = (beta K K^T) * decay, strictly lower;  T = (I + A)^-1
  U = T (beta V);  W = T (beta K exp(G));  V' = U - W S
  O = (Q exp(G)) S + ((Q K^T) * decay) V';  S <- exp(G_C) S + (K exp(G_C - G))^T V'

with T by the XLA form's forward substitution (`forward_substitution`,
stable where a product form of the inverse is not) on the identity, then U
and W as two products with it. Every product is float32 at full precision.
Segment ids reset the state at a document boundary exactly as the XLA form
does; the row is padded to a whole number of chunks with tokens that write
nothing and keep S.

The two lowerings differ only in how a program walks its chunks: the Triton
program loops over them (`lax.fori_loop`) with the state as the loop's
carry; the Mosaic grid has the chunks as its last, sequential ("arbitrary")
axis with the state in a VMEM scratch buffer, one chunk's blocks in VMEM per
step. The per-token rows the chunk step needs (cumulative log decay, beta,
segment ids, which document a token continues) come in as [1, C] rows; the
step turns a row into a column by a masked reduction (no transposes, which
Mosaic takes only for tile-aligned shapes). The keys come in twice, K and
K^T per chunk, so that every product is a plain one.

Backward: a `jax.custom_vjp` with a Pallas backward kernel in the same two
lowerings. Under differentiation the forward kernel also writes each
chunk's incoming state S_c ([B, h_v, N, d_k, d_v] float32, the residual;
flash-linear-attention's chunk_fwd_h keeps the same). The backward program
per (row, head) walks the chunks from the last to the first carrying the
state's cotangent dS [d_k, d_v] in float32 (the Triton program's loop
carry; on the Mosaic grid, index maps that flip the sequential axis and a
VMEM scratch buffer), starting from the final state's cotangent and ending
with the initial state's. Per chunk, `_chunk_step_vjp` recomputes the
chunk's terms from S_c (T by forward substitution again) and applies the
chunk step's VJP derived by hand: dV' from the outputs and the outgoing
state, T^T products for the cotangents of U's and W's right-hand sides, dA =
-(dB X^T) on A's strict lower triangle, the decays' cotangents to G, and
dS <- keeps dS + (Q reads)^T dO - W^T dV'. Products with a transposed
operand contract its first axis (`_dot_tn`, `_dot_nt`) rather than
transpose it. The kernel returns the cotangents of the chunk-major q, k, v,
G and beta; XLA takes them back through the normalisation, the head
repeat, the padding and the cumulative sum of G (the VJP of
`_chunk_major`).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from model import gated_deltanet as gdn
from model.kernels import (LINEAR_KERNEL_CHUNKS, TRITON_AND_TPU, lowering_for,
                           triton_takes_head_dims)

LOWERINGS = TRITON_AND_TPU


def _dot(a, b):
  """a @ b in float32 at full precision (not TF32 or one bf16 pass)."""
  return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a^T @ b (contracting both first axes), as `_dot`, with no transpose."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _dot_nt(a, b):
  """a @ b^T (contracting both last axes), as `_dot`, with no transpose."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _chunk_terms(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV):
  """What one chunk's step computes before its outputs (module docstring),
  shared by the forward (`_chunk_step`) and the backward
  (`_chunk_step_vjp`), as a dict: the decay inside the chunk, the C x C
  products K-beta K^T and Q K^T, T, U, W, V', and which tokens read the
  incoming state (`reads_C1`) and write the outgoing one (`writes_C1`)
  with how much of it it keeps (`keeps_11`).

  G_1C: cumulative log decay from the chunk's start; seg_1C: segment ids;
  cont_1C: 1 where a token's document is the one the chunk continues (the
  state coming in reaches it); last_1C: 1 where it is the chunk's last
  token's document (it reaches the state going out)."""
  C = q_CK.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  diagonal = rows == cols
  column = lambda x_1C: jnp.sum(jnp.where(diagonal, x_1C, 0), axis=1, keepdims=True)
  G_C1, beta_C1, seg_C1, cont_C1 = map(column, (G_1C, beta_1C, seg_1C, cont_1C))
  inside_CC = jnp.exp(jnp.where((rows >= cols) & (seg_C1 == seg_1C), G_C1 - G_1C, -jnp.inf))
  k_beta_CK = k_CK * beta_C1
  kk_CC = _dot(k_beta_CK, kT_KC)
  strict_CC = rows > cols
  A_CC = jnp.where(strict_CC, kk_CC * inside_CC, 0.0)
  T_CC = gdn.forward_substitution(A_CC, diagonal.astype(jnp.float32))
  reads_C1 = jnp.exp(G_C1) * cont_C1  # the decayed incoming state each token reads
  U_CV, W_CK = _dot(T_CC, v_CV * beta_C1), _dot(T_CC, k_beta_CK * reads_C1)
  end_1C = lax.broadcasted_iota(jnp.int32, (1, C), 1) == C - 1
  at_end = lambda x_1C: jnp.sum(jnp.where(end_1C, x_1C, 0), axis=1, keepdims=True)
  G_end, cont_end = at_end(G_1C), at_end(cont_1C)  # [1, 1]
  writes_1C = last_1C * jnp.exp(G_end - G_1C)
  return dict(
      diagonal=diagonal, strict_CC=strict_CC, beta_C1=beta_C1, inside_CC=inside_CC,
      k_beta_CK=k_beta_CK, kk_CC=kk_CC, qk_CC=_dot(q_CK, kT_KC), T_CC=T_CC, reads_C1=reads_C1,
      U_CV=U_CV, W_CK=W_CK, new_CV=U_CV - _dot(W_CK, S_KV),
      writes_1C=writes_1C, writes_C1=column(writes_1C), keeps_11=jnp.exp(G_end) * cont_end)


def _chunk_step(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV):
  """One chunk of the rule (module docstring; inputs as `_chunk_terms`): (o
  [C, d_v], the new state)."""
  t = _chunk_terms(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV)
  o_CV = _dot(q_CK * t["reads_C1"], S_KV) + _dot(t["qk_CC"] * t["inside_CC"], t["new_CV"])
  S_KV = S_KV * t["keeps_11"] + _dot(kT_KC * t["writes_1C"], t["new_CV"])
  return o_CV, S_KV


def _chunk_step_vjp(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV,
                    do_CV, dS_KV):
  """The VJP of `_chunk_step` by hand, from the incoming state S_KV and the
  cotangents of the chunk's outputs (do_CV) and of its outgoing state
  (dS_KV): (dq, dk [C, d_k], dv [C, d_v], dG, dbeta [1, C], the incoming
  state's cotangent [d_k, d_v]). It recomputes the chunk's terms; a
  product X = T B = (I + A)^-1 B passes dB = T^T dX back and dA = -dB X^T
  on A's strictly lower triangle (`gated_deltanet.unit_lower_solve`'s
  rule); a decay exp(G_i - G_j) passes its cotangent times itself to G_i
  and minus that to G_j. Segment ids, cont and last get none."""
  t = _chunk_terms(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV)
  inside_CC, reads_C1, writes_C1 = t["inside_CC"], t["reads_C1"], t["writes_C1"]
  beta_C1, k_beta_CK, new_CV = t["beta_C1"], t["k_beta_CK"], t["new_CV"]
  # o = (Q reads) S + (QK^T * inside) V';  S' = S keeps + (K writes)^T V'
  d_new_CV = _dot_tn(t["qk_CC"] * inside_CC, do_CV) + _dot(k_CK * writes_C1, dS_KV)
  d_scores_CC = _dot_nt(do_CV, new_CV)
  d_q_reads_CK, d_k_writes_CK = _dot_nt(do_CV, S_KV), _dot_nt(new_CV, dS_KV)
  dS_in_KV = (dS_KV * t["keeps_11"] + _dot_tn(q_CK * reads_C1, do_CV)
              - _dot_tn(t["W_CK"], d_new_CV))
  # V' = U - W S;  U = T (beta V);  W = T (beta K reads)
  d_beta_v_CV = _dot_tn(t["T_CC"], d_new_CV)
  d_beta_k_reads_CK = _dot_tn(t["T_CC"], -_dot_nt(d_new_CV, S_KV))
  dA_CC = jnp.where(t["strict_CC"], -(_dot_nt(d_beta_v_CV, t["U_CV"])
                                      + _dot_nt(d_beta_k_reads_CK, t["W_CK"])), 0.0)
  # A = (beta K K^T) * inside, strictly lower;  scores = (Q K^T) * inside
  d_kk_CC, d_qk_CC = dA_CC * inside_CC, d_scores_CC * inside_CC
  d_log_CC = (dA_CC * t["kk_CC"] + d_scores_CC * t["qk_CC"]) * inside_CC  # of G_i - G_j
  d_k_beta_CK = _dot(d_kk_CC, k_CK) + d_beta_k_reads_CK * reads_C1
  dq_CK = _dot(d_qk_CC, k_CK) + d_q_reads_CK * reads_C1
  dk_CK = (_dot_tn(d_kk_CC, k_beta_CK) + _dot_tn(d_qk_CC, q_CK) + d_k_beta_CK * beta_C1
           + d_k_writes_CK * writes_C1)
  dv_CV = d_beta_v_CV * beta_C1
  rowsum = lambda x: jnp.sum(x, axis=1, keepdims=True)
  dbeta_C1 = rowsum(d_beta_v_CV * v_CV) + rowsum(d_k_beta_CK * k_CK)
  d_reads_C1 = rowsum(d_beta_k_reads_CK * k_beta_CK) + rowsum(d_q_reads_CK * q_CK)
  d_writes_C1 = rowsum(d_k_writes_CK * k_CK) * writes_C1  # of log writes: G_end - G_i
  d_end_11 = (jnp.sum(d_writes_C1, axis=0, keepdims=True)
              + jnp.sum(dS_KV * S_KV, keepdims=True) * t["keeps_11"])
  last_token_C1 = lax.broadcasted_iota(jnp.int32, (q_CK.shape[0], 1), 0) == q_CK.shape[0] - 1
  dG_C1 = (rowsum(d_log_CC) + d_reads_C1 * reads_C1 - d_writes_C1
           + jnp.where(last_token_C1, d_end_11, 0.0))
  row = lambda x_C1: jnp.sum(jnp.where(t["diagonal"], x_C1, 0), axis=0, keepdims=True)
  dG_1C = row(dG_C1) - jnp.sum(d_log_CC, axis=0, keepdims=True)
  return dq_CK, dk_CK, dv_CV, dG_1C, row(dbeta_C1), dS_in_KV


def _triton_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref, last_ref,
                   S0_ref, o_ref, S_ref, *states_ref):
  """One (row, head): a loop over its chunks carrying the state; with
  `states_ref`, each chunk's incoming state saved for the backward."""
  def body(n, S_KV):
    if states_ref:
      states_ref[0][n] = S_KV
    o_CV, S_KV = _chunk_step(q_ref[n], k_ref[n], kT_ref[n], v_ref[n], G_ref[n], beta_ref[n],
                             seg_ref[n], cont_ref[n], last_ref[n], S_KV)
    o_ref[n] = o_CV.astype(o_ref.dtype)
    return S_KV
  S_ref[...] = lax.fori_loop(0, q_ref.shape[0], body, S0_ref[...].astype(jnp.float32))


def _tpu_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref, last_ref,
                S0_ref, o_ref, S_ref, *rest):
  """One (row, head, chunk) grid step; the state lives in `state_ref` (VMEM,
  the last of `rest`) across the sequential chunk axis; with a states
  output before it, each chunk's incoming state saved for the backward."""
  *states_ref, state_ref = rest
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    state_ref[...] = S0_ref[...].astype(jnp.float32)

  if states_ref:
    states_ref[0][...] = state_ref[...]
  o_CV, state_ref[...] = _chunk_step(q_ref[...], k_ref[...], kT_ref[...], v_ref[...],
                                     G_ref[...], beta_ref[...], seg_ref[...], cont_ref[...],
                                     last_ref[...], state_ref[...])
  o_ref[...] = o_CV.astype(o_ref.dtype)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    S_ref[...] = state_ref[...]


def _triton_backward_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref,
                            last_ref, states_ref, do_ref, dS_ref, dq_ref, dk_ref, dv_ref, dG_ref,
                            dbeta_ref, dS0_ref):
  """One (row, head): a loop over its chunks from the last to the first
  carrying the state's cotangent (`_chunk_step_vjp` per chunk)."""
  N = q_ref.shape[0]

  def body(i, dS_KV):
    n = N - 1 - i
    dq, dk, dv, dG, dbeta, dS_KV = _chunk_step_vjp(
        q_ref[n], k_ref[n], kT_ref[n], v_ref[n], G_ref[n], beta_ref[n], seg_ref[n], cont_ref[n],
        last_ref[n], states_ref[n], do_ref[n], dS_KV)
    dq_ref[n], dk_ref[n], dv_ref[n], dG_ref[n], dbeta_ref[n] = dq, dk, dv, dG, dbeta
    return dS_KV
  dS0_ref[...] = lax.fori_loop(0, N, body, dS_ref[...])


def _tpu_backward_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref,
                         last_ref, states_ref, do_ref, dS_ref, dq_ref, dk_ref, dv_ref, dG_ref,
                         dbeta_ref, dS0_ref, dstate_ref):
  """One (row, head, chunk) grid step, the chunks in reverse (the index maps
  flip the sequential axis); the state's cotangent lives in `dstate_ref`
  (VMEM) from one step to the next."""
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    dstate_ref[...] = dS_ref[...]

  (dq_ref[...], dk_ref[...], dv_ref[...], dG_ref[...], dbeta_ref[...],
   dstate_ref[...]) = _chunk_step_vjp(
       q_ref[...], k_ref[...], kT_ref[...], v_ref[...], G_ref[...], beta_ref[...], seg_ref[...],
       cont_ref[...], last_ref[...], states_ref[...], do_ref[...], dstate_ref[...])

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    dS0_ref[...] = dstate_ref[...]


def _blocks(x_BTH_, chunk: int):
  """[B, T, H, D] (or [B, T, H]) padded to N whole chunks with zeros, as
  [B, H, N, C, D] (or the rows [B, H, N, 1, C])."""
  B, T, H = x_BTH_.shape[:3]
  pad = -T % chunk
  x = jnp.pad(x_BTH_, [(0, 0), (0, pad)] + [(0, 0)] * (x_BTH_.ndim - 2))
  N = (T + pad) // chunk
  if x.ndim == 3:
    return jnp.moveaxis(x.reshape(B, N, chunk, H), 3, 1)[:, :, :, None, :]
  return jnp.moveaxis(x.reshape(B, N, chunk, H, -1), 3, 1)


def _chunk_major(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, chunk: int):
  """The kernel's float inputs: q, k [B, H, N, C, d_k], K^T [B, H, N, d_k,
  C], v [B, H, N, C, d_v] and the rows G, beta [B, H, N, 1, C]
  (`_chunk_terms`), padded to N whole chunks."""
  q, k, v, g, beta = gdn._prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
  k_BHNCK = _blocks(k, chunk)
  return dict(q=_blocks(q, chunk), k=k_BHNCK, kT=jnp.swapaxes(k_BHNCK, -1, -2),
              v=_blocks(v, chunk), G=jnp.cumsum(_blocks(g, chunk), axis=-1),
              beta=_blocks(beta, chunk))


def _segment_rows(segment_ids_BT, B: int, T: int, chunk: int):
  """The kernel's rows seg, cont, last [B, N, 1, C] (`_chunk_terms`), the
  padding continuing the row's last document."""
  pad = -T % chunk
  N = (T + pad) // chunk
  seg_BNC = jnp.pad(gdn._segments(segment_ids_BT, (B, T)), [(0, 0), (0, pad)],
                    mode="edge").reshape(B, N, chunk)
  prev_BN = jnp.concatenate([seg_BNC[:, :1, 0], seg_BNC[:, :-1, -1]], axis=1)
  per_row = lambda x: x[:, :, None, :]
  return dict(seg=per_row(seg_BNC),
              cont=per_row((seg_BNC == prev_BN[..., None]).astype(jnp.float32)),
              last=per_row((seg_BNC == seg_BNC[..., -1:]).astype(jnp.float32)))


# The kernels' per-chunk inputs in their order (`_chunk_terms`' arguments).
NAMES = ("q", "k", "kT", "v", "G", "beta", "seg", "cont", "last")


def _specs(inputs: dict, lowering: str, reverse: bool = False):
  """(grid, the BlockSpec of an array shaped as one of `_chunk_major`'s or
  `_segment_rows`'s, the BlockSpec of a per-(row, head) [B, H, ...] one)
  for `lowering`: the Triton program takes a (row, head)'s whole arrays;
  the Mosaic grid step one chunk's blocks, the chunks in reverse order
  where `reverse`."""
  B, H, N = inputs["q"].shape[:3]
  if lowering == "triton":
    chunks = lambda x: (pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h: (b, h, 0, 0, 0))
                        if x.ndim == 5 else
                        pl.BlockSpec((None, *x.shape[1:]), lambda b, h: (b, 0, 0, 0)))
    head = lambda x: pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h: (b, h, 0, 0))
    return (B, H), chunks, head
  at = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  chunks = lambda x: (pl.BlockSpec((None, None, None, *x.shape[3:]),
                                   lambda b, h, n: (b, h, at(n), 0, 0))
                      if x.ndim == 5 else
                      pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h, n: (b, at(n), 0, 0)))
  head = lambda x: pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h, n: (b, h, 0, 0))
  return (B, H, N), chunks, head


def _compiler_params(lowering: str):
  return (pltriton.CompilerParams(num_warps=4, num_stages=1) if lowering == "triton" else
          pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")))


def _call(inputs: dict, S0_BHKV, *, lowering: str, interpret: bool, keep_states: bool = False):
  """The forward pallas_call over `_chunk_major`'s and `_segment_rows`'
  inputs: (o [B, H, N, C, d_v], S), and with `keep_states` each chunk's
  incoming state [B, H, N, d_k, d_v] too (the backward's residual)."""
  B, H, N, C, K = inputs["q"].shape
  V = inputs["v"].shape[-1]
  grid, chunks, head = _specs(inputs, lowering)
  out_shape = [jax.ShapeDtypeStruct((B, H, N, C, V), jnp.float32),
               jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
  if keep_states:
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), jnp.float32))
  out_specs = [chunks(out_shape[0]), head(out_shape[1])] + [chunks(x) for x in out_shape[2:]]
  tpu = lowering != "triton"
  return pl.pallas_call(
      _tpu_kernel if tpu else _triton_kernel, grid=grid,
      in_specs=[chunks(inputs[n]) for n in NAMES] + [head(S0_BHKV)],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)] if tpu else (),
      interpret=interpret, name="gated_delta_rule_forward" + ("_tpu" if tpu else ""),
      compiler_params=_compiler_params(lowering),
  )(*(inputs[n] for n in NAMES), S0_BHKV)


def _call_backward(inputs: dict, states_BHNKV, do_BHNCV, dS_BHKV, *, lowering: str,
                   interpret: bool):
  """The backward pallas_call: the cotangents of `_chunk_major`'s q, k, v,
  G, beta (k's counting K^T's) and of the initial state, from each chunk's
  incoming state (`_call`'s `keep_states`) and the cotangents of o and of
  the final state."""
  grid, chunks, head = _specs(inputs, lowering, reverse=True)
  names = ("q", "k", "v", "G", "beta")
  out_shape = [jax.ShapeDtypeStruct(inputs[n].shape, jnp.float32) for n in names]
  out_shape.append(jax.ShapeDtypeStruct(dS_BHKV.shape, jnp.float32))
  tpu = lowering != "triton"
  grads = pl.pallas_call(
      _tpu_backward_kernel if tpu else _triton_backward_kernel, grid=grid,
      in_specs=([chunks(inputs[n]) for n in NAMES]
                + [chunks(states_BHNKV), chunks(do_BHNCV), head(dS_BHKV)]),
      out_specs=[chunks(x) for x in out_shape[:-1]] + [head(out_shape[-1])],
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(dS_BHKV.shape[2:], jnp.float32)] if tpu else (),
      interpret=interpret, name="gated_delta_rule_backward" + ("_tpu" if tpu else ""),
      compiler_params=_compiler_params(lowering),
  )(*(inputs[n] for n in NAMES), states_BHNKV, do_BHNCV, dS_BHKV)
  return dict(zip(names, grads[:-1])), grads[-1]


def _forward(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, S0_BHKV, segment_ids_BT, *, chunk: int,
             lowering: str, interpret: bool, keep_states: bool = False):
  """(o [B, T, H, d_v], the final state) by the kernel, and with
  `keep_states` each chunk's incoming state too."""
  B, T = q_BTHK.shape[:2]
  inputs = {**_chunk_major(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, chunk),
            **_segment_rows(segment_ids_BT, B, T, chunk)}
  o_BHNCV, S_BHKV, *states = _call(inputs, S0_BHKV, lowering=lowering, interpret=interpret,
                                   keep_states=keep_states)
  _, H, N, C, V = o_BHNCV.shape
  o_BTHV = jnp.moveaxis(o_BHNCV.reshape(B, H, N * C, V), 1, 2)[:, :T]
  return (o_BTHV, S_BHKV, *states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _rule(q, k, v, g, beta, S0, segment_ids, chunk, lowering, interpret):
  return _forward(q, k, v, g, beta, S0, segment_ids, chunk=chunk, lowering=lowering,
                  interpret=interpret)


def _rule_fwd(q, k, v, g, beta, S0, segment_ids, chunk, lowering, interpret):
  o, S, states = _forward(q, k, v, g, beta, S0, segment_ids, chunk=chunk, lowering=lowering,
                          interpret=interpret, keep_states=True)
  return (o, S), (q, k, v, g, beta, segment_ids, states)


def _rule_bwd(chunk, lowering, interpret, residuals, cotangents):
  """The backward kernel (`_call_backward`) on the chunks, then the VJP of
  `_chunk_major` (normalising, repeating, padding, the cumulative sum) in
  XLA back to the inputs; segment ids get none."""
  *raw, segment_ids, states = residuals
  do_BTHV, dS_BHKV = cotangents
  B, T = raw[0].shape[:2]
  inputs, prepare_vjp = jax.vjp(lambda *x: _chunk_major(*x, chunk), *raw)
  grads, dS0 = _call_backward(
      {**inputs, **_segment_rows(segment_ids, B, T, chunk)}, states,
      _blocks(do_BTHV.astype(jnp.float32), chunk), dS_BHKV.astype(jnp.float32),
      lowering=lowering, interpret=interpret)
  return (*prepare_vjp({**grads, "kT": jnp.zeros_like(inputs["kT"])}), dS0, None)


_rule.defvjp(_rule_fwd, _rule_bwd)


def chunk_flops(C: int, d_k: int, d_v: int) -> int:
  """Matmul FLOPs of one chunk of C tokens of one value head as
  `_chunk_step` computes it (what the roofline counts per program and
  chunk): beta K K^T and Q K^T (2 C^2 d_k each); T by forward substitution
  on the identity (C - 1 rows, each a C-long row of A times C x C: 2 (C - 1)
  C^2); U and W as products with T (2 C^2 d_v, 2 C^2 d_k); W S, Q S and the
  state update (2 C d_k d_v each); the scores times V' (2 C^2 d_v). The XLA
  form substitutes on [beta V, beta K exp(G)] instead
  (`gated_deltanet.rule_flops`)."""
  return (4 * C * C * d_k + 2 * (C - 1) * C * C + 2 * C * C * (d_v + d_k)
          + 6 * C * d_k * d_v + 2 * C * C * d_v)


def backward_chunk_flops(C: int, d_k: int, d_v: int) -> int:
  """Matmul FLOPs of one chunk of C tokens of one value head as the
  backward (`_chunk_step_vjp`) computes it, which the roofline counts per
  program and chunk of the backward kernel: the recomputed beta K K^T, Q K^T,
  T, U, W and W S (`chunk_flops` less the outputs and the state update);
  then 6 C x C x d_k products (T^T dW', dA's W part, and dq and dk through
  the scores and A), 4 C x C x d_v ones (the scores^T dO, dO V'^T, T^T dV',
  dA's U part) and 6 d_k x d_v ones of C (the state's cotangent through W,
  Q reads and K writes; dO S^T, V' dS^T, dV' S^T)."""
  return (18 * C * C * d_k + 2 * (C - 1) * C * C + 10 * C * C * d_v + 14 * C * d_k * d_v)


def refusal(chunk: int) -> str | None:
  """Why the kernel cannot take chunks of `chunk` tokens, or None."""
  if chunk not in LINEAR_KERNEL_CHUNKS:
    return (f"the delta-rule kernel takes chunks of {', '.join(map(str, LINEAR_KERNEL_CHUNKS))} "
            f"tokens, not {chunk}")
  return None


def gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None,
                     segment_ids_BT=None, *, chunk: int = 64, lowering: str | None = None,
                     interpret: bool | None = None, device=None):
  """The chunked gated delta rule by the kernel: the same (o [B, T, h_v, d_v]
  float32, final state [B, h_v, d_k, d_v]) as `gated_deltanet.chunked`,
  differentiable in every float input (the backward kernel, module
  docstring).

  lowering: "triton" or "mosaic_tpu"; default "mosaic_tpu" on a TPU, else
  "triton". interpret: run the Pallas interpreter; default when `device`
  (default `jax.devices()[0]`) is not the lowering's platform.
  """
  reason = refusal(chunk)
  if reason is not None:
    raise ValueError(f"gated_delta_rule: {reason}")
  device = device or jax.devices()[0]
  lowering, interpret = lowering_for(device, lowering, interpret, kernel="gated_delta_rule")
  dims = (k_BTHK.shape[-1], v_BTHV.shape[-1])
  if lowering == "triton" and not interpret and not triton_takes_head_dims(*dims):
    raise ValueError(f"gated_delta_rule: the Triton lowering takes head dims that are powers "
                     f"of two, not d_k, d_v = {dims}; use gated_deltanet.chunked")
  B, _, H, V = v_BTHV.shape
  S0 = (jnp.zeros((B, H, k_BTHK.shape[-1], V), jnp.float32) if state_BHKV is None
        else state_BHKV.astype(jnp.float32))
  return _rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, S0, segment_ids_BT, chunk, lowering,
               interpret)
