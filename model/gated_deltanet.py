"""Gated DeltaNet: linear attention with a state of fixed size, the layer
kind `linear_attention` of `model.layer_types` (Qwen3-Next, Qwen3.5).

The lesson ends on attention's O(n^2) cost and a KV cache that grows with
every token. A linear-attention head keeps one state S [d_k, d_v] instead,
which each token updates by the gated delta rule (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks", 2025):

  S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

The decay exp(g_t) in (0, 1] forgets; the write strength beta_t in (0, 1)
replaces what the state recalled for k_t by v_t (the delta rule); q_t and
k_t are L2-normalised and q_t scaled by d_k^-0.5. Decoding keeps S and the
short convolution's last inputs per sequence: memory that does not grow
with the context.

Two forms compute the rule, both in float32:
- `recurrent`: token by token (a `lax.scan` over time), what decoding runs;
- `chunked`: chunks of C tokens (`model.linear_chunk_size`, 64). Inside a
  chunk the C updates are one triangular system (the WY or UT form: with
  A_ij = beta_i k_i.k_j exp(G_i - G_j) for j < i, G the chunk's cumulative
  log decay, (I + A) U = beta V and (I + A) W = beta K exp(G)), so that the
  chunk's outputs and its state update are matrix products; a `lax.scan`
  over the chunks carries S. What training and prefill run.
A Pallas kernel (`model/kernels/gated_delta.py`) computes `chunked` too;
`rule_implementation` picks it from `model.attention_impl` as the softmax
layers' kernels are picked. The forms agree to float32 rounding at any
length (the last chunk is padded with tokens that leave S as it is) and
all start a new state where a packed row starts a new document (its
segment id changes), as the convolution does not reach across one.

The layer (`GatedDeltaNet`, transformers' Qwen3NextGatedDeltaNet): q, k, v
= SiLU(causal depthwise convolution of width K over x W_q, x W_k, x W_v);
z = x W_z, beta = sigmoid(x W_b), g = -exp(A_log) softplus(x W_a + dt_bias);
the rule's output per head RMS-normalised (a learned scale over d_v) and
gated by SiLU(z), then W_o. h_v value heads share h_k query and key heads
(h_v / h_k each, as grouped-query attention shares KV heads).
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import context_parallel
from model.kernels import LINEAR_KERNEL_CHUNKS, triton_takes_head_dims
from model.layers import Dense, batch_axes, check_rows_split, compile_device, param


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(sum(x^2) + eps) over the last axis (FLA's and transformers')."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH):
  """The rule's float32 inputs: q and k normalised, q scaled by d_k^-0.5, and
  q, k repeated over the value heads that share them."""
  groups = v_BTHV.shape[2] // q_BTHK.shape[2]
  q_BTHK, k_BTHK = (jnp.repeat(l2_normalize(x.astype(jnp.float32)), groups, axis=2)
                    for x in (q_BTHK, k_BTHK))
  q_BTHK = q_BTHK * q_BTHK.shape[-1] ** -0.5
  return (q_BTHK, k_BTHK, v_BTHV.astype(jnp.float32), g_BTH.astype(jnp.float32),
          beta_BTH.astype(jnp.float32))


def _segments(segment_ids_BT, shape):
  """Segment ids [B, T] (one segment where None): a new one resets the state."""
  return jnp.zeros(shape, jnp.int32) if segment_ids_BT is None else segment_ids_BT


def recurrent(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None, segment_ids_BT=None):
  """The gated delta rule token by token: (o [B, T, h_v, d_v] float32, the
  final state [B, h_v, d_k, d_v]). `state_BHKV`: the state before the first
  token (zeros when None), which the first document continues."""
  q, k, v, g, beta = _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
  B, T, H, K = k.shape
  state = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if state_BHKV is None else state_BHKV
  seg_BT = _segments(segment_ids_BT, (B, T))
  new_BT = jnp.concatenate([jnp.zeros((B, 1), bool), seg_BT[:, 1:] != seg_BT[:, :-1]], axis=1)

  def step(S_BHKV, xs):
    q_t, k_t, v_t, g_t, beta_t, new_B = xs
    S_BHKV = jnp.where(new_B[:, None, None, None], 0.0, S_BHKV) * jnp.exp(g_t)[..., None, None]
    recalled_BHV = jnp.einsum("bhkv,bhk->bhv", S_BHKV, k_t)
    S_BHKV = S_BHKV + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - recalled_BHV) * beta_t[..., None])
    return S_BHKV, jnp.einsum("bhkv,bhk->bhv", S_BHKV, q_t)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  state, o_TBHV = jax.lax.scan(step, state, tuple(map(time_major, (q, k, v, g, beta, new_BT))))
  return jnp.moveaxis(o_TBHV, 0, 1), state


def forward_substitution(A, rhs):
  """(I + A)^-1 rhs for A strictly lower triangular [..., C, C], row by row:
  x_i = rhs_i - sum_{j<i} A_ij x_j, one `lax.fori_loop` step a row, each a
  masked reduction (no dynamic indexing, so the delta-rule kernel runs it
  too). Forward substitution is backward stable; the power series of A is
  not: with nearly equal keys (a run of one repeated token, beta near 1)
  A's entries near 1 make (-A)^k's grow as binomial coefficients (C(63, 31)
  ~ 1e18 at C = 64), and a product form of (I + A)^-1 lost every digit and
  overflowed to NaN. No triangular-solve call either: XLA's CPU backend runs
  that as a LAPACK call, which wedged a multithreaded train step."""
  row = jax.lax.broadcasted_iota(jnp.int32, (A.shape[-1], 1), 0)

  def step(i, x):
    a_i = jnp.sum(jnp.where(row == i, A, 0.0), axis=-2)  # [..., C]: row i of A
    return x - jnp.where(row == i, jnp.sum(a_i[..., :, None] * x, axis=-2)[..., None, :], 0.0)

  return jax.lax.fori_loop(1, A.shape[-1], step, rhs)


@jax.custom_vjp
def unit_lower_solve(A, rhs):
  """(I + A)^-1 rhs for A strictly lower triangular [..., C, C]
  (`forward_substitution`), with the solve's own gradients: the cotangent
  through (I + A^T)^-1 (the same substitution on the flipped transpose) and
  dA = -tril(d_rhs x^T, -1), so that the backward pass keeps x, not one
  copy of it per row of the loop."""
  return forward_substitution(A, rhs)


def _solve_fwd(A, rhs):
  x = forward_substitution(A, rhs)
  return x, (A, x)


def _solve_bwd(residuals, dx):
  A, x = residuals
  flip = lambda y: jnp.flip(y, axis=-2)
  d_rhs = flip(forward_substitution(jnp.flip(jnp.swapaxes(A, -1, -2), (-2, -1)), flip(dx)))
  C = A.shape[-1]
  lower = jnp.tril(jnp.ones((C, C), bool), -1)
  return jnp.where(lower, -jnp.einsum("...iv,...jv->...ij", d_rhs, x), 0.0), d_rhs


unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def chunked(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None, segment_ids_BT=None,
            chunk: int = 64):
  """The gated delta rule in chunks of `chunk` tokens (the WY form, module
  docstring): the same (o, final state) as `recurrent`."""
  q, k, v, g, beta = _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
  B, T, H, K = k.shape
  V = v.shape[-1]
  state = jnp.zeros((B, H, K, V), jnp.float32) if state_BHKV is None else state_BHKV
  seg_BT = _segments(segment_ids_BT, (B, T))
  pad = -T % chunk
  # Padding tokens: k = 0, beta = 0 and g = 0 write nothing and keep S; they
  # extend the last document, so the state it ends with is carried out.
  q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                      for x in (q, k, v, g, beta))
  seg_BT = jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge")
  N = (T + pad) // chunk

  def chunks(x):  # [B, N*C, H, ...] -> [N, B, H, C, ...]
    x = x.reshape(B, N, chunk, *x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2) if x.ndim == 5 else jnp.moveaxis(
        jnp.moveaxis(x, 1, 0), -1, 2)

  q, k, v, g, beta = map(chunks, (q, k, v, g, beta))  # q [N, B, H, C, K]; g [N, B, H, C]
  seg_NBC = jnp.moveaxis(seg_BT.reshape(B, N, chunk), 1, 0)
  # The document each chunk continues: the one of the token before it (the
  # first chunk continues `state_BHKV`'s, its first token's).
  prev_NB = jnp.concatenate([seg_NBC[:1, :, 0], seg_NBC[:-1, :, -1]], axis=0)

  G = jnp.cumsum(g, axis=-1)  # [N, B, H, C]: log decay from the chunk's start
  same_NBCC = seg_NBC[..., :, None] == seg_NBC[..., None, :]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  decay_ij = lambda mask: jnp.exp(jnp.where(mask[:, :, None], G[..., :, None] - G[..., None, :],
                                            -jnp.inf))
  inside = decay_ij(same_NBCC & lower)  # exp(G_i - G_j), j <= i in one document
  k_beta = k * beta[..., None]
  A = jnp.einsum("nbhik,nbhjk->nbhij", k_beta, k) * inside
  A = jnp.where(jnp.eye(chunk, dtype=bool), 0.0, A)  # strictly lower
  continues_NBHC = (seg_NBC == prev_NB[..., None])[:, :, None, :]
  rhs = jnp.concatenate([v * beta[..., None],
                         k_beta * (jnp.exp(G) * continues_NBHC)[..., None]], axis=-1)
  solved = unit_lower_solve(A, rhs)
  U, W = solved[..., :V], solved[..., V:]  # new values; keys that read the old state
  scores = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * inside
  q_reads = q * (jnp.exp(G) * continues_NBHC)[..., None]
  last_NB = seg_NBC[..., -1]
  writes = ((seg_NBC == last_NB[..., None])[:, :, None, :]
            * jnp.exp(G[..., -1:] - G))  # [N, B, H, C]
  k_writes = k * writes[..., None]
  keeps = jnp.exp(G[..., -1]) * (last_NB == prev_NB)[:, :, None]  # [N, B, H]

  def step(S_BHKV, xs):
    U_c, W_c, scores_c, q_c, k_c, keep_c = xs
    V_new = U_c - jnp.einsum("bhck,bhkv->bhcv", W_c, S_BHKV)
    o_c = jnp.einsum("bhck,bhkv->bhcv", q_c, S_BHKV) + jnp.einsum("bhij,bhjv->bhiv", scores_c,
                                                                  V_new)
    S_BHKV = S_BHKV * keep_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, V_new)
    return S_BHKV, o_c

  state, o_NBHCV = jax.lax.scan(step, state, (U, W, scores, q_reads, k_writes, keeps))
  o_BTHV = jnp.moveaxis(o_NBHCV, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, N * chunk, H, V)
  return o_BTHV[:, :T], state


def rule_refusal(cfg) -> tuple[str, str] | None:
  """(field, why) where the model config's `attention_impl` (and
  `pallas_lowering`) cannot run its linear layers' rule with chunks of
  `linear_chunk_size` tokens and its head dims, or None."""
  if cfg.attention_impl == "cudnn":
    return ("model.attention_impl", "cuDNN has no gated delta rule for the linear_attention "
            "layers; use attention_impl xla, pallas or auto")
  if cfg.attention_impl != "pallas":
    return None
  if cfg.linear_chunk_size not in LINEAR_KERNEL_CHUNKS:
    return ("model.linear_chunk_size", "the delta-rule kernel (attention_impl=pallas) takes "
            f"chunks of {', '.join(map(str, LINEAR_KERNEL_CHUNKS))} tokens; choose one or "
            "attention_impl xla")
  dims = (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
  if cfg.pallas_lowering == "triton" and not triton_takes_head_dims(*dims):
    return ("model.pallas_lowering", f"the delta-rule kernel's Triton lowering takes head dims "
            f"that are powers of two, not d_k, d_v = {dims[0]}, {dims[1]}; use attention_impl "
            "xla")
  return None


def rule_implementation(attention_impl: str, chunk: int, platform: str,
                        head_dims: tuple[int, int]) -> str:
  """Which form runs the linear layers' chunked rule on `platform`, following
  `model.attention_impl` as the softmax layers do: "pallas" (the kernel,
  `model/kernels/gated_delta.py`; interpreted on a CPU) for pallas, and for
  auto on a TPU, or a GPU where its Triton lowering takes the head dims
  (d_k, d_v), where the kernel takes the chunk size; "xla" (`chunked`) for
  reference and xla, and for auto otherwise (on a CPU the interpreter would
  be far slower than XLA)."""
  if attention_impl == "pallas":
    return "pallas"
  runs = platform == "tpu" or (platform == "gpu" and triton_takes_head_dims(*head_dims))
  return "pallas" if attention_impl == "auto" and runs and chunk in LINEAR_KERNEL_CHUNKS else "xla"


def _rows_on_each_device(rule, *arrays):
  """`rule(*arrays)` (arrays or None, batch first; returns a pair) on each
  device's rows under `jax.shard_map` over the mesh's batch axes, since XLA
  cannot partition a Pallas call; as it is without a mesh of several."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return rule(*arrays)
  check_rows_split(arrays[0].shape[0], mesh, "the delta-rule kernel")
  batch = batch_axes(mesh)
  given = [i for i, x in enumerate(arrays) if x is not None]

  def local(*xs):
    full = [None] * len(arrays)
    for i, x in zip(given, xs):
      full[i] = x
    return rule(*full)

  split = P(batch)
  return jax.shard_map(local, mesh=mesh, in_specs=(split,) * len(given), out_specs=(split, split),
                       check_vma=False)(*(arrays[i] for i in given))


def causal_conv(window_BPHD, kernel_KHD, segment_ids_BT=None):
  """SiLU of the causal depthwise convolution out_t = sum_i w_i x_{t-K+1+i}
  over time, each channel by itself, of the T inputs at the end of
  `window_BPHD` [B, K-1+T, ...]: the K-1 before them first (zeros at a row's
  start; what decoding keeps). A tap that reaches into another document (a
  changed segment id; the K-1 before continue the first) reads zero."""
  K = kernel_KHD.shape[0]
  B, T = window_BPHD.shape[0], window_BPHD.shape[1] - (K - 1)
  dtype = window_BPHD.dtype
  seg_BT = _segments(segment_ids_BT, (B, T))
  seg_padded = jnp.concatenate([jnp.repeat(seg_BT[:, :1], K - 1, axis=1), seg_BT], axis=1)
  out = sum(window_BPHD[:, i:i + T] * kernel_KHD[i].astype(dtype)
            * (seg_padded[:, i:i + T] == seg_BT)[..., None, None].astype(dtype)
            for i in range(K))
  return jax.nn.silu(out)


def _dt_bias_init(key, shape, dtype):
  """softplus^-1 of dt drawn log-uniformly from [0.001, 0.1] (Mamba's and
  FLA's initialisation of the decay's time step)."""
  dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(0.001), math.log(0.1)))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _a_log_init(key, shape, dtype):
  """log A, A uniform in [0.01, 16] (transformers' Qwen3-Next)."""
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNet(nnx.Module):
  """A block's token mixer for `linear_attention` layers (module docstring).

  Shapes: W_q, W_k [d, h_k, d_k], W_v, W_z [d, h_v, d_v], W_b, W_a [d, h_v],
  the convolutions [K, heads, head dim] each, A_log and dt_bias [h_v], the
  output norm's scale [d_v], W_o [h_v, d_v, d].
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, std = cfg.d_model, cfg.hidden_std
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    pdt = cfg.param_dtype
    self.chunk = cfg.linear_chunk_size
    self.attention_impl, self.pallas_lowering = cfg.attention_impl, cfg.pallas_lowering
    self.eps = cfg.norm_eps
    dense = lambda shape, axes: Dense(d, shape, ("embed", *axes), use_bias=False, cfg=cfg,
                                      rngs=rngs, std=std)
    self.q_proj = dense((Hk, Dk), ("kv_heads", "head_dim"))
    self.k_proj = dense((Hk, Dk), ("kv_heads", "head_dim"))
    self.v_proj = dense((Hv, Dv), ("heads", "head_dim"))
    self.z_proj = dense((Hv, Dv), ("heads", "head_dim"))
    self.b_proj = dense((Hv,), ("heads",))
    self.a_proj = dense((Hv,), ("heads",))
    conv_init = jax.nn.initializers.normal(K ** -0.5)
    self.conv_q = param(rngs, conv_init, (K, Hk, Dk), (None, "kv_heads", "head_dim"), pdt)
    self.conv_k = param(rngs, conv_init, (K, Hk, Dk), (None, "kv_heads", "head_dim"), pdt)
    self.conv_v = param(rngs, conv_init, (K, Hv, Dv), (None, "heads", "head_dim"), pdt)
    self.A_log = param(rngs, _a_log_init, (Hv,), ("heads",), pdt)
    self.dt_bias = param(rngs, _dt_bias_init, (Hv,), ("heads",), pdt)
    self.norm_scale = param(rngs, jax.nn.initializers.ones, (Dv,), ("norm",), pdt)
    self.o_proj = Dense((Hv, Dv), (d,), ("heads", "head_dim", "embed"), use_bias=False,
                        cfg=cfg, rngs=rngs, in_axes=2, std=std)

  def _inputs(self, x_BTM, past: dict | None, segment_ids_BT):
    """(q, k, v, g, beta, z, the convolutions' new pasts) of x."""
    convs = {}
    for name, proj in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj)):
      y_BTHD = proj(x_BTM)
      kernel = getattr(self, f"conv_{name}")[...]
      before = (jnp.zeros((y_BTHD.shape[0], kernel.shape[0] - 1, *y_BTHD.shape[2:]),
                          y_BTHD.dtype) if past is None
                else past[f"conv_{name}"].astype(y_BTHD.dtype))
      window = jnp.concatenate([before, y_BTHD], axis=1)
      convs[name] = causal_conv(window, kernel, segment_ids_BT)
      convs[f"past_{name}"] = window
    return convs, *self._gates(x_BTM), self.z_proj(x_BTM)

  def _gates(self, x_BTM):
    """The log decay g = -exp(A_log) softplus(x W_a + dt_bias) and the write
    strength beta = sigmoid(x W_b), [B, T, h_v] float32."""
    a_BTH = self.a_proj(x_BTM).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    g_BTH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a_BTH)
    return g_BTH, jax.nn.sigmoid(self.b_proj(x_BTM).astype(jnp.float32))

  def _rule(self, q, k, v, g, beta, state_BHKV=None, segment_ids_BT=None):
    """The chunked rule by the form `rule_implementation` picks: (o, state)."""
    device = compile_device()
    head_dims = (k.shape[-1], v.shape[-1])
    if rule_implementation(self.attention_impl, self.chunk, device.platform, head_dims) == "xla":
      return chunked(q, k, v, g, beta, state_BHKV, segment_ids_BT, chunk=self.chunk)
    from model.kernels.gated_delta import (  # pylint: disable=import-outside-toplevel
        LOWERINGS, gated_delta_rule)
    lowering = self.pallas_lowering if self.pallas_lowering in LOWERINGS else None
    return _rows_on_each_device(
        lambda *a: gated_delta_rule(*a, chunk=self.chunk, lowering=lowering, device=device),
        q, k, v, g, beta, state_BHKV, segment_ids_BT)

  def _output(self, o_BTHV, z_BTHV, dtype):
    """The gated output norm RMSNorm(o) * SiLU(z), then W_o."""
    o = o_BTHV * jax.lax.rsqrt(jnp.mean(o_BTHV * o_BTHV, -1, keepdims=True) + self.eps)
    o = (self.norm_scale[...].astype(jnp.float32) * o).astype(dtype)
    o = o.astype(jnp.float32) * jax.nn.silu(z_BTHV.astype(jnp.float32))
    return self.o_proj(o.astype(dtype))

  def __call__(self, x_BTM, *, positions_BT=None, causal=True, segment_ids=None, bias=None):
    """The layer over whole rows (the chunked form); `segment_ids` (packed
    rows) start a new state at each document; positions and bias unused."""
    del positions_BT, causal, bias
    if context_parallel.context_size() > 1:
      return self._across_context(x_BTM, segment_ids)
    convs, g, beta, z = self._inputs(x_BTM, None, segment_ids)
    o, _ = self._rule(convs["q"], convs["k"], convs["v"], g, beta, segment_ids_BT=segment_ids)
    return self._output(o, z, x_BTM.dtype)

  def _across_context(self, x_BTM, segment_ids):
    """The layer over rows split across the context axis (zig-zag layout):
    the projections as on one device, the convolutions and the rule by
    `model.linear_context.context_rule` (each device's chunk state passed on)."""
    from model.linear_context import context_rule  # pylint: disable=import-outside-toplevel
    kernels = tuple(getattr(self, f"conv_{name}")[...] for name in ("q", "k", "v"))
    o = context_rule(self.q_proj(x_BTM), self.k_proj(x_BTM), self.v_proj(x_BTM),
                     *self._gates(x_BTM), segment_ids, kernels, chunk=self.chunk)
    return self._output(o, self.z_proj(x_BTM), x_BTM.dtype)

  def weights(self, x_BTM, *, positions_BT=None, causal=True, bias=None):
    """The [B, h_v, T, T] matrix the layer's rule applies to the values
    (its output is linear in them: o_i = sum_j M_ij v_j), before the
    output norm: what an attention map shows, read off `recurrent` run on
    one-hot values."""
    del positions_BT, causal, bias
    convs, g, beta, _ = self._inputs(x_BTM, None, None)
    B, T, H = g.shape
    eye_BTHT = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (B, T, H, T))
    m_BTHT, _ = recurrent(convs["q"], convs["k"], eye_BTHT, g, beta)
    return jnp.transpose(m_BTHT, (0, 2, 1, 3))

  def decode(self, x_BTM, positions_BT, cache, *, bias=None, layer=None, valid_BT=None):
    """Tokens against this layer's state (`cache`: "state" [B, h_v, d_k, d_v]
    and each convolution's K-1 last inputs; with `layer`, the whole stack's,
    stacked over its linear layers); returns (x, cache). `valid_BT`: the
    real tokens of a right-padded prompt (None: all), which alone move the
    state; the convolutions keep the last K-1 real inputs."""
    del positions_BT, bias
    names = ("state", "conv_q", "conv_k", "conv_v")
    mine = {n: cache[n] if layer is None else cache[n][layer] for n in names}
    past = {n: mine[n] for n in names[1:]}
    convs, g, beta, z = self._inputs(x_BTM, past, None)
    if valid_BT is not None:  # padding neither decays nor writes
      g, beta = jnp.where(valid_BT[..., None], g, 0.0), jnp.where(valid_BT[..., None], beta, 0.0)
    T = x_BTM.shape[1]
    form = recurrent if T == 1 else self._rule
    o, state = form(convs["q"], convs["k"], convs["v"], g, beta, mine["state"].astype(
        jnp.float32))
    count_B = (jnp.full(x_BTM.shape[:1], T) if valid_BT is None
               else valid_BT.sum(-1).astype(jnp.int32))
    new = {"state": state.astype(mine["state"].dtype)}
    for name in ("q", "k", "v"):
      window = convs[f"past_{name}"]  # [B, K-1+T, ...]: keep the K-1 before the first unread
      kept = past[f"conv_{name}"].shape[1]
      rows = count_B[:, None] + jnp.arange(kept)[None]
      new[f"conv_{name}"] = jnp.take_along_axis(
          window, rows.reshape(*rows.shape, *(1,) * (window.ndim - 2)), axis=1).astype(
              past[f"conv_{name}"].dtype)
    if layer is not None:
      new = {n: cache[n].at[layer].set(new[n]) for n in names}
      new = {**cache, **new}
    return self._output(o, z, x_BTM.dtype), new


def state_shapes(cfg) -> dict[str, tuple[int, ...]]:
  """A linear layer's decoding state per sequence, array name -> shape (three
  axes, so that the batch axis of [..., B, *shape] is fourth from the end, as
  a KV cache's): the rule's state and each convolution's K-1 last inputs."""
  Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  past = cfg.linear_conv_kernel_dim - 1
  return {"state": (Hv, Dk, Dv), "conv_q": (past, Hk, Dk), "conv_k": (past, Hk, Dk),
          "conv_v": (past, Hv, Dv)}


def rule_flops(cfg) -> int:
  """Forward matmul FLOPs per token of one layer's chunked rule (not halved
  for causal, as attention's 4 S d_attn): per value head and chunk of C
  tokens, beta K K^T and Q K^T (2 C^2 d_k each), `unit_lower_solve` for U
  and W (C - 1 rows of substitution, each a C-long row of A times the C x
  (d_v + d_k) right-hand side), W S, Q S and the state update K^T V (2 C d_k
  d_v each) and the scores times V (2 C^2 d_v); over C tokens, linear in
  the row's length."""
  C, Dk, Dv = cfg.linear_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  per_chunk = (4 * C * C * Dk + 2 * (C - 1) * C * (Dv + Dk)
               + 6 * C * Dk * Dv + 2 * C * C * Dv)
  return cfg.linear_num_value_heads * per_chunk // C


def linear_params(cfg) -> int:
  """A linear-attention layer's parameters: W_q, W_k, W_v, W_z, W_b, W_a, the
  three convolutions, A_log, dt_bias, the output norm's scale and W_o."""
  d, Hk, Hv = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_num_value_heads
  key, value = Hk * cfg.linear_key_head_dim, Hv * cfg.linear_value_head_dim
  K = cfg.linear_conv_kernel_dim
  return (d * (2 * key + 2 * value + 2 * Hv) + K * (2 * key + value) + 2 * Hv
          + cfg.linear_value_head_dim + value * d)
