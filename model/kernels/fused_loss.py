"""The LM head and the cross-entropy in one Pallas kernel: the float32 logits
[tokens, vocab] never go to HBM (train.loss_impl=pallas).

It is FlashAttention without values: the vocabulary rows of the head's
weight W [V, M] play the keys, a block of tokens' final hidden states h
[N, M] the queries. Per token the kernel returns what the loss's sums are
made of (`training/objectives.py`): the log-sum-exp lse = log sum_v
exp(s_v) of the logits s = mult x h W^T, the target's logit s_t, and
whether s_t is the largest logit (the 'correct' count).

- Forward (`_forward_kernel`): one program per block of tokens loops over
  the vocabulary's blocks, computes each logits tile (f32 products over
  chunks of the hidden width), and keeps the online max m and sum l of
  exp(s - m), as flash attention does; the target's logit is selected where
  an iota equals the target. Differentiated, it also accumulates
  P W = sum_v softmax_v W_v [N, M], flash attention's output with W as the
  values (rescaled by exp(m - m') as m grows), for the backward.
- Backward: with cotangents g_lse and g_t of lse and s_t, the logits'
  cotangent is dS = g_lse softmax + g_t onehot(t). So dh = mult (g_lse P W +
  g_t W_t) from the forward's P W and a gather of the targets' rows (no
  kernel); dW = mult dS^T h by `_dw_kernel`: one program per block of
  vocabulary rows loops over the token blocks, recomputing the logits tile
  and softmax from the saved lse. The z-loss (weight x lse^2) needs nothing
  of its own: it is in g_lse.

The padded vocabulary rows past `real_vocab` (`model.transformer`'s
`PADDED_LOGIT`) get that logit, as `model.logits` gives them, and no
gradient; rows padded to whole blocks here get -inf. The kernel is a
plain `pl.pallas_call`: the Triton lowering on an NVIDIA GPU, the Pallas
interpreter on the CPU; on a TPU the Mosaic lowering
(`_tpu_forward_kernel`, `_tpu_dw_kernel`), whose grid streams the blocks
(the vocabulary's, or the tokens') along its last, sequential axis with the
loop's carry in VMEM scratch.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from model.kernels import lowering_for

MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16.
LANES = 128  # Mosaic TPU: the hidden width is padded to a multiple of the lane width


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tiles and launch parameters of the two kernels.

  block_n, block_v: tokens per forward program, vocabulary rows per step of
  its loop; block_v_dw, block_n_dw: vocabulary rows per dW program, tokens
  per step of its loop; block_m: the chunk of the hidden width every
  product runs over (each program's f32 accumulator, P W or dW, is
  M / block_m chunks of [rows, block_m])."""
  block_n: int
  block_v: int
  block_v_dw: int
  block_n_dw: int
  block_m: int
  num_warps: int
  num_stages: int


def _fit(block: int, length: int) -> int:
  """`block`, shrunk to the smallest power of two >= 16 that covers `length`."""
  return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def choose_blocks(tokens: int, vocab: int, width: int, *, backend: str) -> Blocks:
  """The tiles for a device and shape. On a GPU: 32 tokens x 32 vocabulary
  rows forward and 32 rows x 16 tokens for dW, over 128-wide chunks of the
  hidden width, 8 warps: a program's f32 accumulator (32 x M: P W or dW)
  takes 96 registers a thread at M = 768, and the forward also holds its
  32 x M hidden states. Compiled for the H200 at M = 768 (ptxas): the
  forward at 255 registers with 1 KB of spills, dW at 254 with none; wider
  tiles spill more (32 x 64 forward: 12 KB). Not yet timed on a card. In
  the interpreter (no GPU), tiles of 128: its cost is per loop step. Every
  tile is shrunk to cover the shape. On a TPU (Mosaic): 256 tokens x 512
  vocabulary rows both ways over the whole hidden width (one chunk): 8 to
  11 MB of VMEM at M = 768 with the double-buffered blocks and the f32
  accumulator (it compiles for a v5p)."""
  if backend == "tpu":
    width = -(-width // LANES) * LANES
    blocks = Blocks(block_n=256, block_v=512, block_v_dw=512, block_n_dw=256, block_m=width,
                    num_warps=4, num_stages=1)
  elif backend == "gpu":
    blocks = Blocks(block_n=32, block_v=32, block_v_dw=32, block_n_dw=16, block_m=128,
                    num_warps=8, num_stages=2)
  else:
    blocks = Blocks(block_n=128, block_v=128, block_v_dw=128, block_n_dw=128, block_m=128,
                    num_warps=4, num_stages=1)
  return dataclasses.replace(
      blocks, block_n=_fit(blocks.block_n, tokens), block_v=_fit(blocks.block_v, vocab),
      block_v_dw=_fit(blocks.block_v_dw, vocab), block_n_dw=_fit(blocks.block_n_dw, tokens),
      block_m=blocks.block_m if backend == "tpu" else _fit(blocks.block_m, width))


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call, shared by the forward and backward."""
  vocab: int  # W's true rows (the arrays are padded past it)
  real_vocab: int  # rows past it get `padded_logit` (model.real_vocab_size)
  padded_logit: float
  mult: float | None  # the head's scalar output multiplier (μP), or None
  blocks: Blocks
  lowering: str  # "triton" or "mosaic_tpu"
  interpret: bool


def _dot(a, b, contract_a: int, contract_b: int):
  """2-D matmul contracting the given axes, accumulated in float32."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _chunks(width: int, cfg: _Config):
  """The static slices of the hidden width the products run over."""
  return [pl.ds(k, cfg.blocks.block_m) for k in range(0, width, cfg.blocks.block_m)]


def _logits_tile(h_ref, w_ref, rows, cols, v_start, cfg: _Config):
  """The logits mult x h[rows] W[cols]^T of a tile [rows, cols], f32,
  summed over chunks of the hidden width; columns at or past `real_vocab`
  are `padded_logit`, at or past `vocab` (block padding) -inf. Also the
  tile's vocabulary ids [1, cols]."""
  s_NV = functools.reduce(jnp.add, [_dot(h_ref[rows, k], w_ref[cols, k], 1, 1)
                                    for k in _chunks(h_ref.shape[1], cfg)])
  if cfg.mult is not None:
    s_NV = s_NV * cfg.mult
  ids_1V = v_start + lax.broadcasted_iota(jnp.int32, (1, s_NV.shape[1]), 1)
  if cfg.real_vocab < cfg.vocab:
    s_NV = jnp.where(ids_1V < cfg.real_vocab, s_NV, cfg.padded_logit)
  if w_ref.shape[0] > cfg.vocab:
    s_NV = jnp.where(ids_1V < cfg.vocab, s_NV, -jnp.inf)
  return s_NV, ids_1V


def _forward_kernel(h_ref, w_ref, t_ref, lse_ref, target_ref, correct_ref, *pw_ref,
                    cfg: _Config):
  """One block of tokens: the online log-sum-exp over the vocabulary's
  blocks, the target's logit, and (differentiated) P W."""
  block_v = cfg.blocks.block_v
  targets_N1 = t_ref[...][:, None]
  chunks = _chunks(h_ref.shape[1], cfg)

  def step(j, carry):
    m_N, l_N, target_N, pw = carry
    v_start = j * block_v
    cols = pl.ds(v_start, block_v)
    s_NV, ids_1V = _logits_tile(h_ref, w_ref, slice(None), cols, v_start, cfg)
    m_new_N = jnp.maximum(m_N, jnp.max(s_NV, axis=1))
    correction_N = jnp.exp(m_N - m_new_N)
    p_NV = jnp.exp(s_NV - m_new_N[:, None])
    l_N = correction_N * l_N + jnp.sum(p_NV, axis=1)
    target_N = target_N + jnp.sum(jnp.where(ids_1V == targets_N1, s_NV, 0.0), axis=1)
    pw = tuple(correction_N[:, None] * acc + _dot(p_NV, w_ref[cols, k], 1, 0)
               for acc, k in zip(pw, chunks))
    return m_new_N, l_N, target_N, pw

  N = t_ref.shape[0]
  zeros_N = jnp.zeros((N,), jnp.float32)
  pw = tuple(jnp.zeros((N, cfg.blocks.block_m), jnp.float32) for _ in chunks) if pw_ref else ()
  m_N, l_N, target_N, pw = lax.fori_loop(0, w_ref.shape[0] // block_v, step,
                                         (jnp.full((N,), -jnp.inf, jnp.float32), zeros_N,
                                          zeros_N, pw))
  lse_ref[...] = m_N + jnp.log(l_N)
  target_ref[...] = target_N
  correct_ref[...] = (target_N >= m_N).astype(jnp.float32)
  for acc, k in zip(pw, chunks):
    pw_ref[0][:, k] = acc / l_N[:, None]


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_target_ref, dw_ref, *, cfg: _Config):
  """One block of vocabulary rows: dW = mult dS^T h over the token blocks,
  dS = g_lse softmax + g_t onehot(t) recomputed from the saved lse."""
  block_n = cfg.blocks.block_n_dw
  v_start = pl.program_id(0) * w_ref.shape[0]
  chunks = _chunks(h_ref.shape[1], cfg)

  def step(i, dw):
    rows = pl.ds(i * block_n, block_n)
    s_NV, ids_1V = _logits_tile(h_ref, w_ref, rows, slice(None), v_start, cfg)
    p_NV = jnp.exp(s_NV - lse_ref[rows][:, None])
    hit_NV = (ids_1V == t_ref[rows][:, None]) & (ids_1V < cfg.real_vocab)
    ds_NV = g_lse_ref[rows][:, None] * p_NV + jnp.where(hit_NV, g_target_ref[rows][:, None], 0.0)
    return tuple(acc + _dot(ds_NV, h_ref[rows, k], 0, 0) for acc, k in zip(dw, chunks))

  dw = tuple(jnp.zeros((w_ref.shape[0], cfg.blocks.block_m), jnp.float32) for _ in chunks)
  dw = lax.fori_loop(0, h_ref.shape[0] // block_n, step, dw)
  for acc, k in zip(dw, chunks):
    dw_ref[:, k] = acc * cfg.mult if cfg.mult is not None else acc


def _tpu_forward_kernel(h_ref, w_ref, t_ref, lse_ref, target_ref, correct_ref, *rest,
                        cfg: _Config):
  """Mosaic TPU: one (token block, vocabulary block) grid step of
  `_forward_kernel`'s loop, its carry in VMEM scratch across the sequential
  vocabulary axis; per-token values are [block, 1] columns."""
  pw_ref = rest[0] if len(rest) == 5 else None
  m_ref, l_ref, tgt_ref, acc_ref = rest[-4:]
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    tgt_ref[...] = jnp.zeros(tgt_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  s_NV, ids_1V = _logits_tile(h_ref, w_ref, slice(None), slice(None), j * w_ref.shape[0], cfg)
  m_N1 = m_ref[...]
  m_new_N1 = jnp.maximum(m_N1, jnp.max(s_NV, axis=1, keepdims=True))
  correction_N1 = jnp.exp(m_N1 - m_new_N1)
  p_NV = jnp.exp(s_NV - m_new_N1)
  l_ref[...] = correction_N1 * l_ref[...] + jnp.sum(p_NV, axis=1, keepdims=True)
  tgt_ref[...] += jnp.sum(jnp.where(ids_1V == t_ref[...], s_NV, 0.0), axis=1, keepdims=True)
  m_ref[...] = m_new_N1
  if pw_ref is not None:
    acc_ref[...] = correction_N1 * acc_ref[...] + _dot(p_NV, w_ref[...], 1, 0)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    m_N1, l_N1, tgt_N1 = m_ref[...], l_ref[...], tgt_ref[...]
    lse_ref[...] = m_N1 + jnp.log(l_N1)
    target_ref[...] = tgt_N1
    correct_ref[...] = (tgt_N1 >= m_N1).astype(jnp.float32)
    if pw_ref is not None:
      pw_ref[...] = acc_ref[...] / l_N1


def _tpu_dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_target_ref, dw_ref, acc_ref, *,
                   cfg: _Config):
  """Mosaic TPU: one (vocabulary block, token block) grid step of
  `_dw_kernel`'s loop, dW accumulated in VMEM across the token axis."""
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  s_NV, ids_1V = _logits_tile(h_ref, w_ref, slice(None), slice(None),
                              pl.program_id(0) * w_ref.shape[0], cfg)
  p_NV = jnp.exp(s_NV - lse_ref[...])
  hit_NV = (ids_1V == t_ref[...]) & (ids_1V < cfg.real_vocab)
  ds_NV = g_lse_ref[...] * p_NV + jnp.where(hit_NV, g_target_ref[...], 0.0)
  acc_ref[...] += _dot(ds_NV, h_ref[...], 0, 0)

  @pl.when(i == pl.num_programs(1) - 1)
  def _finish():
    dw_ref[...] = acc_ref[...] * cfg.mult if cfg.mult is not None else acc_ref[...]


def _tpu_params():
  """Mosaic TPU: the first grid axis parallel, the streamed one sequential."""
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _tpu_forward(h_NM, w_VM, targets_N, cfg: _Config, *, with_pw: bool):
  """`_forward` by the Mosaic TPU kernel."""
  N, M = h_NM.shape
  block_n, block_v = cfg.blocks.block_n, cfg.blocks.block_v
  column = pl.BlockSpec((block_n, 1), lambda i, j: (i, 0))
  tokens = pl.BlockSpec((block_n, M), lambda i, j: (i, 0))
  out_shape = [jax.ShapeDtypeStruct((N, 1), jnp.float32)] * 3
  outs = pl.pallas_call(
      functools.partial(_tpu_forward_kernel, cfg=cfg),
      grid=(N // block_n, w_VM.shape[0] // block_v),
      in_specs=[tokens, pl.BlockSpec((block_v, M), lambda i, j: (j, 0)), column],
      out_specs=[column] * 3 + ([tokens] if with_pw else []),
      out_shape=out_shape + ([jax.ShapeDtypeStruct((N, M), jnp.float32)] if with_pw else []),
      scratch_shapes=[pltpu.VMEM((block_n, 1), jnp.float32)] * 3
      + [pltpu.VMEM((block_n, M) if with_pw else (8, LANES), jnp.float32)],
      compiler_params=_tpu_params(),
      interpret=cfg.interpret,
      name="fused_loss_forward_tpu",
  )(h_NM, w_VM, targets_N[:, None])
  return [x[:, 0] for x in outs[:3]] + list(outs[3:])


def _tpu_dw(h_NM, w_VM, targets_N, lse_N, g_lse_N, g_target_N, cfg: _Config):
  """`_dw` by the Mosaic TPU kernel."""
  N, M = h_NM.shape
  block_n, block_v = cfg.blocks.block_n_dw, cfg.blocks.block_v_dw
  column = pl.BlockSpec((block_n, 1), lambda j, i: (i, 0))
  vocab_rows = pl.BlockSpec((block_v, M), lambda j, i: (j, 0))
  return pl.pallas_call(
      functools.partial(_tpu_dw_kernel, cfg=cfg),
      grid=(w_VM.shape[0] // block_v, N // block_n),
      in_specs=[pl.BlockSpec((block_n, M), lambda j, i: (i, 0)), vocab_rows] + [column] * 4,
      out_specs=vocab_rows,
      out_shape=jax.ShapeDtypeStruct(w_VM.shape, jnp.float32),
      scratch_shapes=[pltpu.VMEM((block_v, M), jnp.float32)],
      compiler_params=_tpu_params(),
      interpret=cfg.interpret,
      name="fused_loss_dw_tpu",
  )(h_NM, w_VM, *(x[:, None] for x in (targets_N, lse_N, g_lse_N, g_target_N)))


def _forward(h_NM, w_VM, targets_N, cfg: _Config, *, with_pw: bool):
  """Launches the forward kernel: (lse, target logit, correct) [N] f32,
  and with `with_pw` P W [N, M] f32."""
  if cfg.lowering == "mosaic_tpu":
    return _tpu_forward(h_NM, w_VM, targets_N, cfg, with_pw=with_pw)
  N, M = h_NM.shape
  block_n = cfg.blocks.block_n
  row = pl.BlockSpec((block_n,), lambda i: (i,))
  tokens = pl.BlockSpec((block_n, M), lambda i: (i, 0))
  out_shape = [jax.ShapeDtypeStruct((N,), jnp.float32)] * 3
  return pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg),
      grid=(N // block_n,),
      in_specs=[tokens, pl.BlockSpec(w_VM.shape, lambda i: (0, 0)), row],
      out_specs=[row] * 3 + ([tokens] if with_pw else []),
      out_shape=out_shape + ([jax.ShapeDtypeStruct((N, M), jnp.float32)] if with_pw else []),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.blocks.num_warps,
                                              num_stages=cfg.blocks.num_stages),
      interpret=cfg.interpret,
      name="fused_loss_forward",
  )(h_NM, w_VM, targets_N)


def _dw(h_NM, w_VM, targets_N, lse_N, g_lse_N, g_target_N, cfg: _Config):
  """Launches the dW kernel: dW [V, M] f32."""
  if cfg.lowering == "mosaic_tpu":
    return _tpu_dw(h_NM, w_VM, targets_N, lse_N, g_lse_N, g_target_N, cfg)
  N, M = h_NM.shape
  block_v = cfg.blocks.block_v_dw
  whole_row = pl.BlockSpec((N,), lambda j: (0,))
  vocab_rows = pl.BlockSpec((block_v, M), lambda j: (j, 0))
  return pl.pallas_call(
      functools.partial(_dw_kernel, cfg=cfg),
      grid=(w_VM.shape[0] // block_v,),
      in_specs=[pl.BlockSpec((N, M), lambda j: (0, 0)), vocab_rows] + [whole_row] * 4,
      out_specs=vocab_rows,
      out_shape=jax.ShapeDtypeStruct(w_VM.shape, jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.blocks.num_warps,
                                              num_stages=cfg.blocks.num_stages),
      interpret=cfg.interpret,
      name="fused_loss_dw",
  )(h_NM, w_VM, targets_N, lse_N, g_lse_N, g_target_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(h_NM, w_VM, targets_N, cfg: _Config):
  return tuple(_forward(h_NM, w_VM, targets_N, cfg, with_pw=False))


def _fused_fwd(h_NM, w_VM, targets_N, cfg: _Config):
  lse_N, target_N, correct_N, pw_NM = _forward(h_NM, w_VM, targets_N, cfg, with_pw=True)
  return (lse_N, target_N, correct_N), (h_NM, w_VM, targets_N, lse_N, pw_NM)


def _fused_bwd(cfg: _Config, residuals, cotangents):
  h_NM, w_VM, targets_N, lse_N, pw_NM = residuals
  g_lse_N, g_target_N, _ = cotangents  # 'correct' is a count: no gradient
  hit_N = (targets_N >= 0) & (targets_N < cfg.real_vocab)
  w_target_NM = jnp.where(hit_N[:, None], jnp.take(w_VM, jnp.where(hit_N, targets_N, 0), axis=0),
                          0.0)
  dh_NM = g_lse_N[:, None] * pw_NM + g_target_N[:, None] * w_target_NM
  if cfg.mult is not None:
    dh_NM = dh_NM * cfg.mult
  dw_VM = _dw(h_NM, w_VM, targets_N, lse_N, g_lse_N, g_target_N, cfg)
  return dh_NM, dw_VM, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def kernel_flops(name: str, tokens: int, vocab: int, width: int, *, with_pw: bool) -> float:
  """FLOPs of one launch of kernel `name` ("fused_loss_forward" or
  "fused_loss_dw", as in a program's op names, e.g. "jvp(fused_loss_forward)")
  on h [tokens, width] and W [vocab, width]: the logits
  are 2 N V M; the forward adds P W (2 N V M) when differentiated
  (`with_pw`); dW recomputes the logits and adds dS^T h. Forward and
  backward of a training step: 4 x 2 N V M in all, where XLA's head and
  loss take 3 (the logits, dH, dW) and keep the logits in HBM."""
  logits = 2.0 * tokens * vocab * width
  if "fused_loss_dw" in name:
    return 2 * logits
  return 2 * logits if with_pw else logits


def fused_head_loss(h_NM, w_VM, targets_N, *, mult: float | None = None,
                    real_vocab: int | None = None, padded_logit: float = -1e9,
                    blocks: Blocks | None = None, lowering: str | None = None,
                    interpret: bool | None = None, device=None):
  """Per token: (lse, target logit, correct) [N] f32 of the logits
  mult x h W^T [N, V] (float32 products), without making them.

  Args:
    h_NM: the head's input [N, M] (cast to f32).
    w_VM: its weight [V, M], vocabulary rows (cast to f32); the tied
      embedding as it is, an untied head's [M, V] kernel transposed.
    targets_N: int [N]; an id outside [0, real_vocab) selects no logit of
      the real vocabulary (its target logit is `padded_logit` past
      real_vocab, 0 outside [0, V)) and gets no gradient.
    mult: a scalar the logits are multiplied by (μP's output multiplier).
    real_vocab: rows at or past it have logit `padded_logit` (default V).
    blocks: the tiles; default `choose_blocks` for `device`.
    lowering: "triton" or "mosaic_tpu"; default "mosaic_tpu" on a TPU, else
      "triton".
    interpret: run the Pallas interpreter; default when `device` is not the
      lowering's platform.
    device: the device the call is compiled for; default `jax.devices()[0]`.

  Differentiable in h and W (`jax.custom_vjp`); the arrays are padded here
  to whole tiles (tokens, vocabulary rows, hidden width) and cut back.
  """
  (N, M), V = h_NM.shape, w_VM.shape[0]
  if w_VM.shape[1] != M:
    raise ValueError(f"fused_head_loss: h {h_NM.shape} and W {w_VM.shape}: want h [N, M] and "
                     "W [V, M]")
  device = device or jax.devices()[0]
  lowering, interpret = lowering_for(device, lowering, interpret, kernel="fused_head_loss")
  blocks = blocks or choose_blocks(N, V, M, backend=device.platform)
  cfg = _Config(vocab=V, real_vocab=V if real_vocab is None else min(real_vocab, V),
                padded_logit=float(padded_logit), mult=None if mult is None else float(mult),
                blocks=blocks, lowering=lowering, interpret=interpret)
  n_multiple = max(blocks.block_n, blocks.block_n_dw)
  v_multiple = max(blocks.block_v, blocks.block_v_dw)
  pad_n, pad_v, pad_m = -N % n_multiple, -V % v_multiple, -M % blocks.block_m
  h_NM = jnp.pad(h_NM.astype(jnp.float32), ((0, pad_n), (0, pad_m)))
  w_VM = jnp.pad(w_VM.astype(jnp.float32), ((0, pad_v), (0, pad_m)))
  targets_N = jnp.pad(targets_N.astype(jnp.int32), (0, pad_n))
  return tuple(x[:N] for x in _fused(h_NM, w_VM, targets_N, cfg))
