"""Rematerialisation policies by name (train.remat): which of a block's
activations the backward pass keeps and which it recomputes.

`none` keeps every activation (no remat); `full` keeps only each block's
input and recomputes the block in the backward pass; the `save_*` policies
recompute the block but keep the tensors they name, so the backward pass
reruns only what lies between them (MaxText's `remat_policy` idea). The
blocks tag those tensors with `jax.ad_checkpoint.checkpoint_name` (the names
of `TAGS`: model/attention.py's projections and attention output,
model/mlp.py's matrices); outside a remat a tag is the identity.
"""
import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from configs import validation
from model.registry import Registry

# The tagged tensors: name -> what it is.
TAGS = {
    "query_proj": "Q, x W_Q [B, T, h, d_k]",
    "key_proj": "K, x W_K [B, T, g, d_k]",
    "value_proj": "V, x W_V [B, T, g, d_k]",
    "attention_out": "the heads' attention output, W_O's input [B, T, h, d_k]",
    "out_proj": "W_O's output [B, T, d]",
    "mlp_hidden": "the MLP's first matrices' outputs (up, and gate when gated) [B, T, d_ff]",
    "mlp_out": "the MLP's last matrix's output [B, T, d]",
}


@dataclasses.dataclass(frozen=True)
class RematPolicy:
  """A train.remat choice: `remat` (whether the block is recomputed at all)
  and `saves`, the `TAGS` it keeps (every matrix product without batch
  dimensions for `save_dots`, which names them all)."""
  name: str
  doc: str
  remat: bool
  saves: tuple[str, ...] = ()
  every_dot: bool = False

  def jax_policy(self):
    """The `jax.checkpoint` policy (None: save nothing)."""
    if self.every_dot:
      return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if self.saves:
      return jax.checkpoint_policies.save_only_these_names(*self.saves)
    return None


_ATTENTION = ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj")

REMAT_POLICIES = Registry("train.remat", [
    RematPolicy("none", "no remat: the backward pass reads every saved activation", False),
    RematPolicy("full", "keep each block's input, recompute the whole block", True),
    RematPolicy("save_dots", "keep every weight matmul's output (attention and MLP), "
                "recompute norms, activations and attention", True, tuple(TAGS), True),
    RematPolicy("save_dots_except_mlp", "keep Q, K, V, the attention output and W_O's "
                "output; recompute the MLP", True, _ATTENTION),
    RematPolicy("save_qkv_proj", "keep Q, K and V", True, _ATTENTION[:3]),
    RematPolicy("save_attention_out", "keep the attention output (the attention kernel "
                "reruns only where it needs its own residuals)", True, ("attention_out",)),
    RematPolicy("save_out_proj", "keep W_O's output", True, ("out_proj",)),
])


def remat_policy(value) -> RematPolicy:
  """The policy of a train.remat value (a name, or the bool runs saved
  before policies had names: True is `full`, False `none`)."""
  return REMAT_POLICIES[validation.remat_name(value)]


def tag(x, name: str):
  """`x` named `name` (one of `TAGS`) for the policies that keep it."""
  return checkpoint_name(x, name)
