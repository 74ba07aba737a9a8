"""Attention gets only the masks a batch needs (issue: masks nobody asked for).

A `data.packing=concat` row is one causal stream: the pipeline gives it no
segment ids, so the compiled step has no [B, T, S] segment mask. The fast
test reads the compiled CPU HLO of the `xla` path. The cuDNN path only
compiles for a GPU: the slow test builds it for a compile-only H200 and
needs JAX's CUDA plugin (marked `cuda`: run it from a venv made with
`pip install -r requirements-gpu.txt`).
"""
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import base
from data import pipeline
from model import build_model
from training.objectives import next_token_loss
from tests.helpers import ByteTokenizer, make_config, write_files

B, T = 4, 16


def _first_batch(tmp_path, packing):
  write_files(tmp_path, {f"{i}.txt": f"document {i} " * (5 + i) for i in range(8)})
  config = make_config(tmp_path, source="files", paths=str(tmp_path / "*.txt"),
                       packing=packing)
  return next(pipeline.make_train_iterator(config, ByteTokenizer()))


def _model():
  m = base.get_config().model
  m.update(vocab_size=260, d_model=32, num_heads=4, d_ff=64, num_layers=1,
           attention_impl="xla")
  return build_model(m, nnx.Rngs(0))


def _compiled_step(model, batch):
  """(params, batch) -> (loss sum, grads), compiled for batches like `batch`,
  with the HLO text of the compiled program."""
  graphdef, params = nnx.split(model)

  def loss(p, b):
    return next_token_loss(nnx.merge(graphdef, p), b)[0]

  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
  return lambda b: compiled(params, b)[0], compiled.as_text()


def _batch_masks(hlo: str) -> set[str]:
  """Shapes of boolean arrays per row of the batch over [T, S]: segment masks."""
  return set(re.findall(rf"pred\[{B},(?:1,)?{T},{T}\]", hlo))


def test_concat_rows_attend_with_causal_alone_and_masks_stay_boolean(tmp_path):
  """Concat rows: no segment ids, no [B, T, S] mask in the compiled training
  step, and the loss the all-ones segment ids gave. Packed rows: the mask
  is there (the check can see one) and stays boolean: the backward holds no
  float [B, 1, T, S] array (the shape of an additive bias and of the bias
  gradient cuDNN returns for one)."""
  concat = _first_batch(tmp_path / "c", "concat")
  packed = _first_batch(tmp_path / "p", "packed")
  assert "segment_ids" not in concat and "segment_ids" in packed
  assert concat["inputs"].shape == (B, T)
  model = _model()
  concat_loss, concat_hlo = _compiled_step(model, concat)
  packed_loss, packed_hlo = _compiled_step(model, packed)
  assert not _batch_masks(concat_hlo)
  assert _batch_masks(packed_hlo)
  assert not re.search(rf"(f32|bf16|f16)\[{B},1,{T},{T}\]", packed_hlo)
  ones = dict(concat, segment_ids=np.ones((B, T), np.int32))
  np.testing.assert_allclose(np.asarray(concat_loss(concat)), np.asarray(packed_loss(ones)),
                             rtol=1e-6)


_CUDNN_STEP = """
import re
import jax, jax.numpy as jnp
from bench.compile_h200 import h200_device
from model.attention import attention
B, T, H, D = 8, 1024, 12, 64  # gpt2_small's attention, bfloat16
def grads(*segment_ids):
  def loss(q, k, v, *segment_ids):
    return attention(q, k, v, causal=True, segment_ids=segment_ids[0] if segment_ids else None,
                     implementation="cudnn").astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2))
qkv = [jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)] * 3
with jax.default_device(h200_device()):
  for name, seg in (("concat", []), ("packed", [jax.ShapeDtypeStruct((B, T), jnp.int32)])):
    hlo = jax.jit(grads(*seg)).trace(*qkv, *seg).lower(lowering_platforms=("cuda",))
    hlo = hlo.compile().as_text()
    fmha = sorted(set(re.findall(r'custom_call_target="__cudnn\\$(fmha\\w*)"', hlo)))
    bias = sorted(set(re.findall(rf"(?:f32|bf16)\\[{B},1,{T},{T}\\]", hlo)))
    print(name, ",".join(fmha), ",".join(bias) or "-")
"""


@pytest.mark.slow
@pytest.mark.cuda
def test_cudnn_concat_step_has_no_bias_on_a_compile_only_h200():
  """Concat rows (no segment ids) compile to cuDNN's unmasked causal kernels
  with no bias and no [B, 1, T, S] bias gradient; packed rows still get both
  (JAX's cuDNN attention turns any mask into a bias and returns its
  gradient)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run([sys.executable, "-c", _CUDNN_STEP], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"})
  assert result.returncode == 0, result.stderr[-2000:]
  lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
  assert lines["concat"] == "fmhaSoftmax,fmhaSoftmaxBackward -"
  assert lines["packed"] == ("fmhaScaleBiasSoftmax,fmhaScaleBiasSoftmaxBackward "
                             "bf16[8,1,1024,1024]")
