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

Backward: a `jax.custom_vjp` whose backward is the VJP of the XLA form
(`gated_deltanet.chunked`), which recomputes the chunks in XLA. The kernel
speeds the forward (and prefill); gradients are the XLA form's, so they are
exact by construction. A Pallas backward is left for later.
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


def _chunk_step(q_CK, k_CK, kT_KC, v_CV, G_1C, beta_1C, seg_1C, cont_1C, last_1C, S_KV):
  """One chunk of the rule (module docstring): (o [C, d_v], the new state).

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
  A_CC = jnp.where(rows > cols, _dot(k_beta_CK, kT_KC) * inside_CC, 0.0)
  T_CC = gdn.forward_substitution(A_CC, diagonal.astype(jnp.float32))
  reads_C1 = jnp.exp(G_C1) * cont_C1  # the decayed incoming state each token reads
  new_CV = _dot(T_CC, v_CV * beta_C1) - _dot(_dot(T_CC, k_beta_CK * reads_C1), S_KV)
  o_CV = _dot(q_CK * reads_C1, S_KV) + _dot(_dot(q_CK, kT_KC) * inside_CC, new_CV)
  end_1C = lax.broadcasted_iota(jnp.int32, (1, C), 1) == C - 1
  at_end = lambda x_1C: jnp.sum(jnp.where(end_1C, x_1C, 0), axis=1, keepdims=True)
  G_end, cont_end = at_end(G_1C), at_end(cont_1C)  # [1, 1]
  writes_1C = last_1C * jnp.exp(G_end - G_1C)
  S_KV = S_KV * (jnp.exp(G_end) * cont_end) + _dot(kT_KC * writes_1C, new_CV)
  return o_CV, S_KV


def _triton_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref, last_ref,
                   S0_ref, o_ref, S_ref):
  """One (row, head): a loop over its chunks carrying the state."""
  def body(n, S_KV):
    o_CV, S_KV = _chunk_step(q_ref[n], k_ref[n], kT_ref[n], v_ref[n], G_ref[n], beta_ref[n],
                             seg_ref[n], cont_ref[n], last_ref[n], S_KV)
    o_ref[n] = o_CV.astype(o_ref.dtype)
    return S_KV
  S_ref[...] = lax.fori_loop(0, q_ref.shape[0], body, S0_ref[...].astype(jnp.float32))


def _tpu_kernel(q_ref, k_ref, kT_ref, v_ref, G_ref, beta_ref, seg_ref, cont_ref, last_ref,
                S0_ref, o_ref, S_ref, state_ref):
  """One (row, head, chunk) grid step; the state lives in `state_ref` (VMEM)
  across the sequential chunk axis."""
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    state_ref[...] = S0_ref[...].astype(jnp.float32)

  o_CV, state_ref[...] = _chunk_step(q_ref[...], k_ref[...], kT_ref[...], v_ref[...],
                                     G_ref[...], beta_ref[...], seg_ref[...], cont_ref[...],
                                     last_ref[...], state_ref[...])
  o_ref[...] = o_CV.astype(o_ref.dtype)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    S_ref[...] = state_ref[...]


def _chunk_major(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk: int):
  """The kernel's inputs: q, k [B, H, N, C, d_k], K^T [B, H, N, d_k, C], v
  [B, H, N, C, d_v], the rows G, beta [B, H, N, 1, C] and seg, cont, last
  [B, N, 1, C] (`_chunk_step`), padded to N whole chunks."""
  q, k, v, g, beta = gdn._prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
  B, T, H, _ = k.shape
  pad = -T % chunk
  N = (T + pad) // chunk
  q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                      for x in (q, k, v, g, beta))
  seg_BNC = jnp.pad(gdn._segments(segment_ids_BT, (B, T)), [(0, 0), (0, pad)],
                    mode="edge").reshape(B, N, chunk)
  blocks = lambda x: jnp.moveaxis(x.reshape(B, N, chunk, H, -1), 3, 1)  # [B, H, N, C, D]
  rows = lambda x: jnp.moveaxis(x.reshape(B, N, chunk, H), 3, 1)[:, :, :, None, :]
  k_BHNCK = blocks(k)
  prev_BN = jnp.concatenate([seg_BNC[:, :1, 0], seg_BNC[:, :-1, -1]], axis=1)
  per_row = lambda x: x[:, :, None, :]
  return dict(
      q=blocks(q), k=k_BHNCK, kT=jnp.swapaxes(k_BHNCK, -1, -2), v=blocks(v),
      G=jnp.cumsum(rows(g), axis=-1), beta=rows(beta), seg=per_row(seg_BNC),
      cont=per_row((seg_BNC == prev_BN[..., None]).astype(jnp.float32)),
      last=per_row((seg_BNC == seg_BNC[..., -1:]).astype(jnp.float32)))


def _call(inputs: dict, S0_BHKV, *, lowering: str, interpret: bool):
  """The pallas_call over `_chunk_major`'s inputs: (o [B, H, N, C, d_v], S)."""
  B, H, N, C, K = inputs["q"].shape
  V = inputs["v"].shape[-1]
  names = ("q", "k", "kT", "v", "G", "beta", "seg", "cont", "last")
  out_shape = [jax.ShapeDtypeStruct((B, H, N, C, V), jnp.float32),
               jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
  if lowering == "triton":
    whole = lambda x: (pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h: (b, h, 0, 0, 0))
                       if x.ndim == 5 else
                       pl.BlockSpec((None, *x.shape[1:]), lambda b, h: (b, 0, 0, 0)))
    state = pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0))
    return pl.pallas_call(
        _triton_kernel, grid=(B, H),
        in_specs=[whole(inputs[n]) for n in names] + [state],
        out_specs=[whole(jax.ShapeDtypeStruct((B, H, N, C, V), jnp.float32)), state],
        out_shape=out_shape, interpret=interpret, name="gated_delta_rule_forward",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )(*(inputs[n] for n in names), S0_BHKV)
  one = lambda x: (pl.BlockSpec((None, None, None, *x.shape[3:]), lambda b, h, n: (b, h, n, 0, 0))
                   if x.ndim == 5 else
                   pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h, n: (b, n, 0, 0)))
  state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
  return pl.pallas_call(
      _tpu_kernel, grid=(B, H, N),
      in_specs=[one(inputs[n]) for n in names] + [state],
      out_specs=[one(jax.ShapeDtypeStruct((B, H, N, C, V), jnp.float32)), state],
      out_shape=out_shape, scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
      interpret=interpret, name="gated_delta_rule_forward_tpu",
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
  )(*(inputs[n] for n in names), S0_BHKV)


def _forward(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, S0_BHKV, segment_ids_BT, *, chunk: int,
             lowering: str, interpret: bool):
  inputs = _chunk_major(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk)
  o_BHNCV, S_BHKV = _call(inputs, S0_BHKV, lowering=lowering, interpret=interpret)
  B, H, N, C, V = o_BHNCV.shape
  o_BTHV = jnp.moveaxis(o_BHNCV.reshape(B, H, N * C, V), 1, 2)
  return o_BTHV[:, :q_BTHK.shape[1]], S_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _rule(q, k, v, g, beta, S0, segment_ids, chunk, lowering, interpret):
  return _forward(q, k, v, g, beta, S0, segment_ids, chunk=chunk, lowering=lowering,
                  interpret=interpret)


def _rule_fwd(q, k, v, g, beta, S0, segment_ids, chunk, lowering, interpret):
  out = _forward(q, k, v, g, beta, S0, segment_ids, chunk=chunk, lowering=lowering,
                 interpret=interpret)
  return out, (q, k, v, g, beta, S0, segment_ids)


def _rule_bwd(chunk, lowering, interpret, residuals, cotangents):
  """The XLA form's VJP (module docstring); segment ids get none."""
  del lowering, interpret
  *diff, segment_ids = residuals
  _, vjp = jax.vjp(lambda *a: gdn.chunked(*a, segment_ids_BT=segment_ids, chunk=chunk), *diff)
  return (*vjp(cotangents), None)


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
  differentiable in every float input (the XLA form's VJP).

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
