"""Segment-id layouts the kernel tests share."""
import jax.numpy as jnp
import numpy as np


def documents(L: int, spans):
  """Segment ids [1, L]: 0, then each span (id, start, end) in turn."""
  ids = np.zeros((1, L), np.int32)
  for segment, start, end in spans:
    ids[:, start:end] = segment
  return jnp.asarray(ids)


# Packed documents 1 and 2 on both sides; keys 100:128 are padding, and the
# queries of 256:320 and the keys of 256:300 are in documents the other side
# lacks. On tiles of 64 (the Hopper kernels; the portable ones run it at a
# quarter of the scale on tiles of 16): tile pairs inside document 2 (no
# mask, without causal), pairs of different documents (skipped), a key tile
# of document 2 and padding (masked), a warpgroup that passes the first step
# of its CTA, and a CTA of each kernel that sees nothing
# (tests/test_block_sparse.py lists the Hopper plans).
DOCUMENTS_Q = [(1, 0, 64), (2, 64, 256), (5, 256, 320)]
DOCUMENTS_KV = [(1, 0, 64), (2, 64, 256), (0, 100, 128), (3, 256, 300)]
