"""What registry entries declare, held against what they compute.

A declaration is a promise, and each promise here is a test generated from
the registries, so that a new entry or a new declaration is tested by being
made (docs/extending.md):

- every feature an attention implementation declares (`takes`; our kernels'
  `model.kernels.KERNEL_TAKES`) runs against `reference` with that feature,
  output and gradients, on inputs where the feature changes the output; our
  kernels in each lowering (their interpreters on a CPU); every feature it
  does not declare is refused by name; and the case lists are checked to be
  non-empty and to cover every pair, so no declaration goes untested;
- every `SCORES` entry against its definition, and finite, within [0, 1] and
  normalised (where its definition is) at logits of +-1e4;
- every `NORMS` entry against its definition, learned parameters away from
  their initial values, on inputs with a mean, large and tiny rows.

The MLP activations are held against transformers' `ACT2FN` in
tests/test_mlp.py, the parameter counts in tests/test_registry.py.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from configs.errors import UserError
from model.attention import (FEATURES, IMPLEMENTATIONS, AttentionOptions, attention,
                             score_feature)
from model.config import ModelConfig
from model.kernels.router import LOWERINGS
from model.norms import NORMS
from model.scores import SCORES
from tests.helpers import float32_tolerance

# Attention: every implementation that runs, every feature it can be asked for.

RUNNABLE = tuple(name for name, entry in IMPLEMENTATIONS.items() if entry.run is not None)
ALL_FEATURES = tuple(FEATURES) + tuple(score_feature(name) for name in SCORES)
DECLARED = tuple((impl, feature) for impl in RUNNABLE
                 for feature in sorted(IMPLEMENTATIONS[impl].takes))
UNDECLARED = tuple((impl, feature) for impl in RUNNABLE for feature in ALL_FEATURES
                   if feature not in IMPLEMENTATIONS[impl].takes)

# The lowerings of `pallas` whose cases run in the fast suite (a few seconds
# each in their interpreters); mosaic_gpu's take about a minute each: slow.
FAST_LOWERINGS = ("triton", "mosaic_tpu")


def _honour_cases():
  """(implementation, feature, lowering) for every declared pair: our
  kernels' in each lowering (`pallas_lowering`), the others' once."""
  for impl, feature in DECLARED:
    for lowering in LOWERINGS if impl == "pallas" else ("auto",):
      slow = impl == "pallas" and lowering not in FAST_LOWERINGS
      yield pytest.param(impl, feature, lowering, id=f"{impl}-{lowering}-{feature}",
                         marks=[pytest.mark.slow] if slow else [])


HONOUR_CASES = tuple(_honour_cases())

B, T, H, K = 1, 32, 2, 1


def _segments(length: int):
  """The packed row every case has: two documents and padding (query rows
  that see no key)."""
  half = 7 * length // 16
  return jnp.asarray([[1] * half + [2] * half + [0] * (length - 2 * half)])


def _inputs(dtype, D, T=T):
  """q, k, v and an output cotangent [B, T, H or K, D], in `dtype`."""
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k, v = (jax.random.normal(x, (B, T, K, D), dtype) for x in ks[1:3])
  return q, k, v, jax.random.normal(ks[3], q.shape, dtype)


def options_using(feature: str, T: int = T, segments=None) -> AttentionOptions:
  """Causal attention (with `segments` as its segment ids) that uses
  `feature` (a `FEATURES` key or an `SCORES` feature). A feature this does
  not know raises KeyError: a new one must be given a value here."""
  if feature.startswith("score:"):
    score = feature[len("score:"):]
    SCORES[score]  # pylint: disable=pointless-statement  # UserError for no such score
    return AttentionOptions(causal=True, segment_ids=segments, score=score)
  values = {
      "mask": lambda: (jax.random.bernoulli(jax.random.key(5), 0.6, (B, T, T))
                       | jnp.eye(T, dtype=bool)),
      "window": lambda: 5,
      "bias": lambda: 2 * jax.random.normal(jax.random.key(6), (1, H, T, T)),
      "softcap": lambda: 1.0,
  }
  return AttentionOptions(causal=True, segment_ids=segments, **{feature: values[feature]()})


def _run(impl, lowering, options, q, k, v, do):
  """(out, dq, dk, dv) of `impl` in float32."""
  out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, options, implementation=impl,
                                               pallas_lowering=lowering), q, k, v)
  return [x.astype(jnp.float32) for x in (out, *vjp(do))]


def _error(got, want) -> float:
  """max |got - want| / max(max |want|, 1)."""
  return float(jnp.abs(got - want).max()) / max(float(jnp.abs(want).max()), 1.0)


def test_every_declaration_has_its_cases():
  """The generated cases are not empty, cover every declared (implementation,
  feature) pair (our kernels' in every lowering) and every undeclared one,
  and every declared feature is one `options_using` can build."""
  assert RUNNABLE and DECLARED and UNDECLARED and HONOUR_CASES
  honoured = {tuple(case.values[:2]) for case in HONOUR_CASES}
  assert honoured == set(DECLARED)
  assert set(DECLARED) | set(UNDECLARED) == set(itertools.product(RUNNABLE, ALL_FEATURES))
  for impl, feature in DECLARED:
    assert feature in ALL_FEATURES, f"{impl} declares {feature!r}, no feature of a call"
    options_using(feature)
  pallas = {case.values[2] for case in HONOUR_CASES if case.values[0] == "pallas"}
  assert pallas == set(LOWERINGS)
  oracle = [feature for impl, feature in DECLARED if impl == "reference"]
  assert oracle == sorted(ALL_FEATURES), "the reference, every test's oracle, takes every feature"


@pytest.mark.parametrize("impl,feature,lowering", HONOUR_CASES)
def test_a_declared_feature_is_computed_as_the_reference_computes_it(impl, feature, lowering):
  """`impl` with `feature` gives the reference's output and gradients with
  it, on inputs where the feature changes the reference's output (so that a
  feature dropped, or a kernel that computes another function, fails)."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    pytest.skip("cudnn runs on a GPU only")
  sixteen_bit = impl == "cudnn" or lowering == "mosaic_gpu"
  dtype, D = (jnp.bfloat16, 64) if sixteen_bit else (jnp.float32, 16)
  length = 64 if lowering == "mosaic_gpu" else T  # its 64 query rows per warpgroup
  segments = _segments(length)
  q, k, v, do = _inputs(dtype, D, length)
  options = options_using(feature, length, segments)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  with jax.default_matmul_precision("highest"):
    want = _run("reference", "auto", options, *f32)
    plain = _run("reference", "auto", AttentionOptions(causal=True, segment_ids=segments), *f32)
  if feature != score_feature(AttentionOptions.score):  # the default changes nothing
    assert _error(plain[0], want[0]) > 1e-2, f"{feature} does not change these inputs' output"
  if impl == "reference":  # the oracle: its case checks that the feature reaches it
    return
  got = _run(impl, lowering, options, q, k, v, do)
  tolerance = 3e-2 if sixteen_bit else float32_tolerance()
  for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
    assert np.isfinite(np.asarray(a)).all(), f"{impl} with {feature}: {name} not finite"
    assert _error(a, b) <= tolerance, (
        f"{impl} ({lowering}) declares {feature} but its {name} is {_error(a, b):.3g} from the "
        "reference's")


@pytest.mark.parametrize("impl,feature", UNDECLARED)
def test_an_undeclared_feature_is_refused_by_name(impl, feature):
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  option = feature.split(":")[0]
  options = options_using(feature, T=4)
  with pytest.raises(UserError, match=rf"^attention_impl={impl} takes no .*\(option `{option}`\)"):
    attention(q, q, q, options, implementation=impl)


# Scores: each entry's definition, in float64 numpy. softmax: exp(s_j) over
# the sum of exp(s) over the keys the query sees; sigmoid: sigmoid(s_j - log
# n), n the keys the query sees (Ramapuram et al. 2024). Both zero on keys the
# query does not see. `normalised`: the weights of a row that sees a key sum
# to 1. A new entry adds its definition here.

def _softmax(s, valid):
  s = np.where(valid, s, -np.inf)
  top = np.max(s, -1, keepdims=True)
  e = np.where(valid, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
  return e / np.maximum(e.sum(-1, keepdims=True), 1e-300)


def _sigmoid(s, valid):
  n = np.maximum(valid.sum(-1, keepdims=True), 1)
  return np.where(valid, (1 + np.tanh((s - np.log(n)) / 2)) / 2, 0)  # sigmoid, no overflow


SCORE_DEFINITIONS = {"softmax": (_softmax, True), "sigmoid": (_sigmoid, False)}


def _score_definition(name):
  assert name in SCORE_DEFINITIONS, (
      f"model.attention_score={name!r} has no definition in tests/test_declarations.py's "
      "SCORE_DEFINITIONS; add the paper's formula there")
  return SCORE_DEFINITIONS[name]


def test_every_score_has_a_definition():
  assert SCORES and set(SCORES) == set(SCORE_DEFINITIONS)


# Scores [B, K, T*G, S] as the entries receive them (`model.attention._grouped_scores`):
# moderate ones, and logits of +-1e4 with ties and one row of all -1e4.
MODERATE = 3 * np.asarray(jax.random.normal(jax.random.key(0), (1, 2, 6, 5)), np.float32)
LARGE = np.asarray([[1e4, 1e4, -1e4, 0, 5e3], [-1e4] * 5, [1e4, 1e4 - 1, 1e4 - 30, -1e4, 1e4],
                    [0, 1e4, 0, -1e4, 0], [-1e4, 0, 1e4, 9e3, -5e3], [3e3, -3e3, 1e4, 1e4, 1e4]],
                   np.float32)[None, None].repeat(2, 1)
# Keys each query row sees, broadcast over the heads: row 3 sees none.
VALID = np.asarray([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0],
                    [0, 1, 1, 1, 0], [1, 1, 1, 1, 0]], bool)[None, None]


@pytest.mark.parametrize("scores", [MODERATE, LARGE], ids=["moderate", "large"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(SCORES))
def test_a_score_is_its_definition(name, scores, masked):
  """The entry's weights equal its definition; at logits of +-1e4 they stay
  finite, within [0, 1], zero on keys not seen (rows that see none: all
  zero), and sum to 1 over a row where its definition normalises."""
  definition, normalised = _score_definition(name)
  valid = VALID if masked else np.ones_like(VALID)
  got = np.asarray(SCORES[name].weights(jnp.asarray(scores), jnp.asarray(valid) if masked
                                        else None))
  assert got.shape == scores.shape and np.isfinite(got).all(), f"{name}: not finite"
  want = definition(scores.astype(np.float64), np.broadcast_to(valid, scores.shape))
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
  assert (got >= 0).all() and (got <= 1 + 1e-6).all()
  seen = np.broadcast_to(valid, got.shape)
  assert not got[~seen].any()
  if normalised:
    sums = got.sum(-1)
    np.testing.assert_allclose(sums[seen.any(-1)], 1, atol=1e-5)


# Norms: each entry's definition, in float64 numpy, over the last axis with
# the module's learned parameters (`params`, by name) and eps. A new entry
# adds its definition here.

def _layernorm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _rmsnorm(x, p, eps):
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * p["scale"]


def _rmsnorm_zero_centred(x, p, eps):
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * (1 + p["scale"])


def _dyt(x, p, eps):
  del eps
  return np.tanh(p["alpha"] * x) * p["scale"] + p["bias"]


NORM_DEFINITIONS = {"layernorm": _layernorm, "rmsnorm": _rmsnorm,
                    "rmsnorm_zero_centred": _rmsnorm_zero_centred, "dyt": _dyt}


def test_every_norm_has_a_definition():
  assert NORMS and set(NORMS) == set(NORM_DEFINITIONS)


@pytest.mark.parametrize("name", list(NORMS))
def test_a_norm_is_its_definition(name):
  """The module over rows with a mean away from 0, of large (1e3) and tiny
  (1e-3, where eps counts) values, every learned parameter set to random
  values away from its initial ones, equals its definition."""
  assert name in NORM_DEFINITIONS, (
      f"model.norm={name!r} has no definition in tests/test_declarations.py's "
      "NORM_DEFINITIONS; add the paper's formula there")
  m = base.get_config().model
  m.norm = name
  cfg = ModelConfig.resolve(m)
  dim = 8
  module = NORMS[name].module(dim, cfg=cfg, rngs=nnx.Rngs(0))
  leaves, treedef = jax.tree.flatten(nnx.state(module, nnx.Param))
  nnx.update(module, jax.tree.unflatten(treedef, [
      1 + 0.5 * jax.random.normal(jax.random.key(10 + i), leaf.shape)
      for i, leaf in enumerate(leaves)]))
  params = {"/".join(map(str, path)): np.asarray(variable[...], np.float64)
            for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param))}
  rows = jax.random.normal(jax.random.key(1), (4, dim))
  x = jnp.stack([rows[0] + 5, 1e3 * rows[1], 1e-3 * rows[2], rows[3]])
  got = np.asarray(module(x))
  want = NORM_DEFINITIONS[name](np.asarray(x, np.float64), params, cfg.norm_eps)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
