"""DeepSeek's multi-head latent attention (`model.attention=mla`, model/mla.py).

- Exactness against transformers' DeepseekV3 and DeepseekV2 (whole dense
  models, weights copied in: logits within 1e-4 of the largest, KV-cache
  decoding too, parameter counts of the attention and of the model; RoPE on
  interleaved pairs or halves, q_lora_rank or direct queries, biases, yarn
  with DeepSeek's mscale), and DeepSeek-V3's attention counted on the meta
  device.
- Decoding against the latent cache (absorbed up-projections, the prompt's
  prefill expanded) equals the full forward pass at every step, greedy, in
  both layer layouts and with a sliding window; `generate` too; the cache
  keeps r + d_r values per token; in bfloat16 no less accurate than the
  bfloat16 forward pass; the prefill runs through our kernels with
  attention_impl=pallas and equals the absorbed form.
- The accounting's closed forms (parameters, FLOPs, KV cache, with
  DeepSeek-V3's worked numbers of docs/models.md).
- The value-width shape each attention implementation declares: computed as
  the reference computes it, or refused by name at start-up and at trace
  time; `auto` and context parallelism follow the declarations.
- Bad MLA configs are one line.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import base
from configs.errors import UserError
from hf import convert as hf_convert
from model import accounting, build_model
from model.attention import (IMPLEMENTATIONS, AttentionOptions, attention, auto_implementation,
                             check_context, model_implementation)
from model.attention_kinds import ATTENTIONS
from model.config import ModelConfig
from model.generate import generate
from model.mla import deinterleave, mla_params
from model.summary import format_table, summarize
from training import sharding
from tests.helpers import (assert_one_line_error, float32_tolerance, kernel_tolerance, run_python,
                           scanned_copy)

# Heads, their unrotated and rotated query/key widths, value width, KV and query latents.
H, NOPE, ROPE, V, R, RQ = 4, 8, 4, 6, 12, 10


def mla_section(**overrides):
  """A tiny MLA decoder's model section (queries and keys 12 wide, values 6)."""
  m = base.get_config().model
  m.update(vocab_size=64, d_model=32, d_ff=48, num_layers=2, num_heads=H, max_len=64,
           attention="mla", q_lora_rank=RQ, kv_lora_rank=R, qk_nope_head_dim=NOPE,
           qk_rope_head_dim=ROPE, v_head_dim=V, norm_eps=1e-6, tie_embeddings=False,
           attention_impl="xla", scan_layers=False)
  m.update(**overrides)
  return m


# transformers: name -> (model class, its config beyond _deepseek(), our fields
# beyond mla_section(), whether its RoPE pairs are interleaved).
def _mscale(factor, mscale):
  return 0.1 * mscale * math.log(factor) + 1.0


HF_CASES = {
    "v3_q_latent_biases": ("DeepseekV3ForCausalLM", dict(attention_bias=True),
                           dict(qkv_bias=True, out_bias=True), True),
    "v3_direct_queries_biases": ("DeepseekV3ForCausalLM",
                                 dict(q_lora_rank=None, attention_bias=True),
                                 dict(q_lora_rank=None, qkv_bias=True, out_bias=True), True),
    "v3_rope_halves": ("DeepseekV3ForCausalLM", dict(rope_interleave=False), {}, False),
    # DeepSeek-V3's yarn: cos and sin times mscale(s, m) / mscale(s, m_all), the
    # softmax scale times mscale(s, m_all)^2.
    "v3_yarn_mscale": ("DeepseekV3ForCausalLM",
                       dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                 original_max_position_embeddings=16,
                                                 mscale=1.0, mscale_all_dim=0.8)),
                       dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=16,
                            rope_attention_factor=_mscale(4.0, 1.0) / _mscale(4.0, 0.8),
                            attention_scale=(NOPE + ROPE) ** -0.5 * _mscale(4.0, 0.8) ** 2),
                       True),
    "v2_lite": ("DeepseekV2ForCausalLM", dict(q_lora_rank=None), dict(q_lora_rank=None), True),
}


def _deepseek(cls: str, fields: dict):
  """transformers' dense DeepSeek (first_k_dense_replace = every layer) with
  random weights, norms around 1 and biases that count; eager attention."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{**dict(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=H, num_key_value_heads=H, q_lora_rank=RQ, kv_lora_rank=R,
      qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, first_k_dense_replace=2,
      max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False), **fields})
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  hf = getattr(transformers, cls)(config).eval()
  for name, parameter in hf.named_parameters():
    torch.nn.init.normal_(parameter, mean=float(name.endswith("norm.weight")), std=0.3)
  return hf


def _copy_deepseek(hf, model, interleaved: bool):
  """transformers' DeepSeek weights into our decoder (a loop of layers): the
  torch [out, in] matrices transposed and split into heads, the rope columns
  of the queries and of kv_a_proj in our pair order (`deinterleave`)."""
  weights = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  rope_order = deinterleave(ROPE) if interleaved else np.arange(ROPE)

  def put(module, name, value):
    assert getattr(module, name).shape == value.shape, name
    getattr(module, name)[...] = jnp.asarray(value)

  def query_heads(w):  # [h (d_n + d_r), in] -> [in, h, d_n + d_r], rope columns reordered
    k = w.T.reshape(w.shape[1], H, NOPE + ROPE)
    return np.concatenate([k[..., :NOPE], k[..., NOPE:][..., rope_order]], axis=-1)

  kv_order = np.concatenate([np.arange(R), R + rope_order])
  put(model.decoder.embed, "embedding", weights["model.embed_tokens.weight"])
  put(model.decoder.final_norm, "scale", weights["model.norm.weight"])
  put(model.head, "kernel", weights["lm_head.weight"].T)
  for i, block in enumerate(model.decoder.layers):
    w = {k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items()
         if k.startswith(f"model.layers.{i}.")}
    put(block.norm_attn, "scale", w["input_layernorm.weight"])
    put(block.norm_mlp, "scale", w["post_attention_layernorm.weight"])
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
      put(getattr(block.mlp, ours), "kernel", w[f"mlp.{theirs}.weight"].T)
    a = block.attn
    if a.q_proj is not None:
      put(a.q_proj, "kernel", query_heads(w["self_attn.q_proj.weight"]))
    else:
      put(a.q_a_proj, "kernel", w["self_attn.q_a_proj.weight"].T)
      put(a.q_a_norm, "scale", w["self_attn.q_a_layernorm.weight"])
      put(a.q_b_proj, "kernel", query_heads(w["self_attn.q_b_proj.weight"]))
      if a.q_a_proj.bias is not None:
        put(a.q_a_proj, "bias", w["self_attn.q_a_proj.bias"])
    put(a.kv_a_proj, "kernel", w["self_attn.kv_a_proj_with_mqa.weight"].T[:, kv_order])
    if a.kv_a_proj.bias is not None:
      put(a.kv_a_proj, "bias", w["self_attn.kv_a_proj_with_mqa.bias"][kv_order])
    put(a.kv_a_norm, "scale", w["self_attn.kv_a_layernorm.weight"])
    put(a.kv_b_proj, "kernel", w["self_attn.kv_b_proj.weight"].T.reshape(R, H, NOPE + V))
    put(a.o_proj, "kernel", w["self_attn.o_proj.weight"].T.reshape(H, V, 32))
    if a.o_proj.bias is not None:
      put(a.o_proj, "bias", w["self_attn.o_proj.bias"])


@pytest.mark.hf
@pytest.mark.parametrize("case", [  # V2-Lite's complex-number RoPE: the slowest case
    pytest.param(c, marks=pytest.mark.slow) if c == "v2_lite" else c for c in sorted(HF_CASES)])
def test_logits_decoding_and_counts_match_transformers(case):
  """transformers' dense DeepSeek and ours with its weights: the logits
  within 1e-4 of the largest, KV-cache decoding (a 9-token prefill, then one
  token at a time) too; the attention's and the model's parameters equal our
  closed form and our module's."""
  import torch  # pylint: disable=import-outside-toplevel
  cls, hf_fields, our_fields, interleaved = HF_CASES[case]
  hf = _deepseek(cls, hf_fields)
  section = mla_section(**our_fields)
  model = build_model(section, nnx.Rngs(0))
  _copy_deepseek(hf, model, interleaved)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 12))
  with torch.no_grad():
    want = hf(torch.from_numpy(tokens)).logits.numpy()
  tolerance = 1e-4 * np.abs(want).max()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), want, atol=tolerance)
  cache, steps = model.init_cache(2, 12), []
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  for start, stop in [(0, 9), (9, 10), (10, 11), (11, 12)]:
    logits, cache = model.decode_step(jnp.asarray(tokens[:, start:stop]),
                                      positions[:, start:stop], cache)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), want, atol=tolerance)
  formula, measured = accounting.formula_params(section), accounting.measured_params(section)
  assert formula == measured
  attention = sum(p.numel() for p in hf.model.layers[0].self_attn.parameters())
  assert formula["params_per_layer"]["attention"] == attention
  assert formula["params_total"] == sum(p.numel() for p in hf.parameters())


# DeepSeek-V3's attention (config.json of deepseek-ai/DeepSeek-V3): d = 7168,
# 128 heads, q_lora_rank 1536, kv_lora_rank 512, 128 + 64 rotated, values 128.
V3 = dict(d_model=7168, num_heads=128, num_layers=61, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dtype="bfloat16")
V3_ATTENTION = 187_107_328  # parameters of one layer's attention, docs/models.md


@pytest.mark.hf
def test_deepseek_v3_attention_parameters_match_transformers():
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  with torch.device("meta"):
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        transformers.DeepseekV3Config(), layer_idx=0)
  assert sum(p.numel() for p in attention.parameters()) == V3_ATTENTION
  formula = accounting.formula_params(mla_section(**V3))
  assert formula["params_per_layer"]["attention"] == V3_ATTENTION


def test_the_latent_up_projections_split_over_fsdp():
  """The query and KV up-projections [latent, h, d] split their latent axis
  over fsdp (logical `latent`) and their heads over tensor: without it
  DeepSeek-V3's took 11.8 GiB whole on every chip of an fsdp-only v5p-256."""
  state = nnx.state(nnx.eval_shape(lambda: build_model(mla_section(), nnx.Rngs(0))))
  mesh = jax.sharding.AbstractMesh((1, 2, 1, 1, 2), sharding.MESH_AXES)
  specs = sharding.param_partition_specs(state, mesh, base.get_config().mesh.rules)
  attn = specs["decoder"]["layers"][0]["attn"]
  for proj in ("q_b_proj", "kv_b_proj"):
    assert attn[proj]["kernel"].value == P("fsdp", "tensor", None), proj


def test_deepseek_v3_kv_cache_against_mha_of_the_same_heads():
  """docs/models.md's worked numbers: per token, bf16, 61 layers, 576 values
  (512 latent + 64 rope key) a layer against MHA's 2 x 128 heads x 128."""
  mla = accounting.kv_cache_bytes_per_token(mla_section(**V3))
  mha = accounting.kv_cache_bytes_per_token(mla_section(
      **{**V3, **{field: None for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                            "qk_rope_head_dim", "v_head_dim")}},
      attention="mha", head_dim=128))
  assert (mla, mha) == (61 * 576 * 2, 61 * 2 * 128 * 128 * 2) == (70_272, 3_997_696)


@pytest.mark.parametrize("overrides", [
    {}, dict(q_lora_rank=None), dict(q_lora_rank=0, qkv_bias=True, out_bias=True),
    dict(scan_layers=True, num_layers=3, use_bias=True)])
def test_closed_forms(overrides):
  """The module's parameters equal the closed form; FLOPs per token are 2 N
  + 2 L S h (d_qk + d_v); the KV cache is layers x (r + d_r) x bytes; the
  summary describes the heads."""
  section = mla_section(**overrides)
  formula = accounting.formula_params(section)
  assert formula == accounting.measured_params(section)
  m = ModelConfig.resolve(section)
  n, layers = formula["params_total"], m.num_layers
  assert accounting.flops_per_token(m, 128, train=False) == (
      2 * n + 2 * layers * 128 * H * (NOPE + ROPE + V))
  assert accounting.kv_cache_bytes_per_token(m) == layers * (R + ROPE) * 4
  config = base.get_config()
  config.model = section
  table = format_table(config, summarize(config, "cpu"))
  assert f"{H} MLA heads of {NOPE} + {ROPE} rotated (values {V}" in table
  assert "2 L S h (d_qk + d_v)" in table


def test_a_wrong_closed_form_is_refused_naming_the_entry(monkeypatch):
  """Every entry point's start-up check (`check_formula`) names the
  `model.attention` entry whose count is off."""
  accounting.check_formula(mla_section())
  monkeypatch.setitem(ATTENTIONS, "mla", dataclasses.replace(
      ATTENTIONS["mla"], params=lambda m: mla_params(m) + 1))
  with pytest.raises(UserError, match=r"^config field model.attention='mla': its closed-form "
                     r"parameter count of a layer's attention, [\d,]+, differs from the "
                     r"module's [\d,]+ \(model total [\d,]+ against [\d,]+\); fix the entry's "
                     r"params in model/attention_kinds.py$"):
    accounting.check_formula(mla_section())


def _scanned_copy(looped, section):
  """The scanned layout of `section` holding `looped`'s weights, built
  abstractly: no initialisation."""
  return scanned_copy(looped, nnx.eval_shape(lambda: build_model(section, nnx.Rngs(0))))


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="loop"),
    pytest.param(dict(scan_layers=True, num_layers=3), id="scanned", marks=pytest.mark.slow),
    pytest.param(dict(sliding_window=3, q_lora_rank=None), id="window",
                 marks=pytest.mark.slow)])
def test_latent_cache_decoding_equals_the_full_forward_pass(overrides):
  """Greedy decoding against the latent cache, a prompt's prefill then one
  token a step, gives at each step the logits of the full forward pass over
  the tokens so far (its causal logits at that position; float32
  tolerance); the cache holds per token and layer only r + d_r values (a
  scanned stack's stacked, updated in place); `generate` on prompts of
  different lengths at once gives each prompt's greedy continuation alone;
  the model is causal; and the scanned layout with the loop's weights gives
  the loop's logits."""
  section = mla_section(**overrides)
  forward = nnx.jit(lambda m, tokens: m(tokens))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 11)))
  model = build_model(mla_section(**dict(overrides, scan_layers=False)), nnx.Rngs(0))
  if section.scan_layers:
    looped, model = model, _scanned_copy(model, section)
    np.testing.assert_allclose(forward(model, tokens), forward(looped, tokens), atol=1e-5,
                               rtol=1e-5)
  layers = section.num_layers
  shapes = [leaf.shape for leaf in jax.tree.leaves(model.init_cache(2, 12))]
  assert shapes == ([(layers, 2, 1, 12, R + ROPE)] if section.scan_layers
                    else [(2, 1, 12, R + ROPE)] * layers)
  step = nnx.jit(lambda m, tokens, positions, cache: m.decode_step(tokens, positions, cache))
  prefill = nnx.jit(lambda m, tokens, positions, cache: m.decode_step(tokens, positions, cache,
                                                                      prefill=True))
  prompts, continuations = [[5, 9, 1, 33, 7], [2, 60, 14]], []
  for prompt in prompts:
    cache = model.init_cache(1, len(prompt) + 6)
    logits, cache = prefill(model, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache)
    generated, steps = list(prompt), [logits[0]]
    for t in range(6):
      generated.append(int(steps[-1][-1].argmax()))
      logits, cache = step(model, jnp.asarray([generated[-1:]]),
                           jnp.asarray([[len(prompt) + t]]), cache)
      steps.append(logits[0])
    full = forward(model, jnp.asarray([generated]))[0]
    scale = max(float(jnp.abs(full).max()), 1.0)
    np.testing.assert_allclose(jnp.concatenate(steps), full, atol=float32_tolerance() * scale,
                               rtol=0)
    continuations.append(generated[len(prompt):])
  if not section.scan_layers:  # the scanned stack's decoding is the step checked above
    assert generate(model, ModelConfig.resolve(section), prompts, max_new_tokens=6) == (
        continuations)
  changed = tokens.at[:, 6:].set((tokens[:, 6:] + 1) % 64)
  np.testing.assert_allclose(forward(model, changed)[:, :6], forward(model, tokens)[:, :6],
                             atol=1e-6)


def test_latent_cache_decoding_in_bfloat16_is_as_accurate_as_the_forward_pass():
  """model.dtype=bfloat16 (float32 parameters, a bfloat16 latent cache):
  decoding against the latent cache (absorbed up-projections: the query
  meets the cached latent through W_UK, and the output leaves through W_UV,
  in a different order of products than the forward's expanded heads),
  teacher-forced over 11 tokens (a prompt of 5, then one a step), against
  the same model's float32 forward pass. bfloat16 keeps 8 significant bits
  (unit roundoff 2^-8 = 3.9e-3), so neither path is close to float32's
  1e-5; what the absorbed order must not do is lose more: its largest error
  is at most twice the bfloat16 forward pass's own, and both are within
  3e-2 of the largest logit (`kernel_tolerance`'s bfloat16 bound, the
  flash kernels' against their float32 reference)."""
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 11)))
  reference = build_model(mla_section(), nnx.Rngs(0))
  model = build_model(mla_section(dtype="bfloat16"), nnx.Rngs(0))
  want = np.asarray(nnx.jit(lambda m, t: m(t))(reference, tokens), np.float32)
  forward = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens).astype(jnp.float32))
  step = nnx.jit(lambda m, tokens, positions, cache: m.decode_step(tokens, positions, cache))
  cache = model.init_cache(2, 11, jnp.bfloat16)
  logits, cache = step(model, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
  steps = [logits]
  for t in range(5, 11):
    logits, cache = step(model, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
    steps.append(logits)
  decoded = np.asarray(jnp.concatenate(steps, axis=1).astype(jnp.float32))
  scale = max(np.abs(want).max(), 1.0)
  forward_err = np.abs(forward - want).max() / scale
  decoded_err = np.abs(decoded - want).max() / scale
  assert 0 < forward_err <= kernel_tolerance(jnp.bfloat16)
  assert decoded_err <= max(2 * forward_err, float32_tolerance())


def test_prefill_runs_the_expanded_form_through_the_kernels():
  """A prompt's prefill with attention_impl=pallas attends in the expanded
  form through our kernels (a pallas_call; the interpreter here) and gives
  the logits and the latent cache of the absorbed form, which has none."""
  model = build_model(mla_section(attention_impl="pallas"), nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 7)))
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))

  def run(prefill):
    fn = lambda m: m.decode_step(tokens, positions, m.init_cache(2, 9), prefill=prefill)
    jaxpr = str(jax.make_jaxpr(lambda: nnx.split(model) and fn(model))())
    return nnx.jit(fn)(model), "pallas_call" in jaxpr

  (logits, cache), kernel = run(True)
  (absorbed, absorbed_cache), absorbed_kernel = run(False)
  assert kernel and not absorbed_kernel
  scale = max(float(jnp.abs(absorbed).max()), 1.0)
  np.testing.assert_allclose(logits, absorbed, atol=float32_tolerance() * scale, rtol=0)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(absorbed_cache)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


# Attention with values narrower than queries and keys: what each implementation declares.

RUNNABLE = [name for name, entry in IMPLEMENTATIONS.items() if entry.run is not None]
TAKERS = [name for name in RUNNABLE if "value_head_dim" in IMPLEMENTATIONS[name].shapes]
REFUSERS = [name for name in RUNNABLE if name not in TAKERS]


def test_the_declarations_cover_every_implementation():
  assert "reference" in TAKERS and REFUSERS and set(TAKERS) | set(REFUSERS) == set(RUNNABLE)


def _narrow_value_inputs(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (2, 16, H, NOPE + ROPE), dtype)
  k = jax.random.normal(ks[1], (2, 16, H, NOPE + ROPE), dtype)
  v = jax.random.normal(ks[2], (2, 16, H, V), dtype)
  return q, k, v, jax.random.normal(ks[3], (2, 16, H, V), dtype)


@pytest.mark.parametrize("impl,lowering", [(impl, "auto") for impl in TAKERS]
                         + [("pallas", "mosaic_tpu")])
def test_an_implementation_that_takes_narrow_values_computes_the_reference(impl, lowering):
  """Output [.., V] and the three gradients equal the reference's, causal
  with packed segments and a soft-cap, float32; pallas also through the
  Mosaic TPU kernel (interpreted here), which keeps the values narrow."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    pytest.skip("cudnn runs on a GPU only")
  q, k, v, do = _narrow_value_inputs()
  options = AttentionOptions(causal=True, softcap=2.0,
                             segment_ids=jnp.asarray([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4]))

  def run(name):
    out, vjp = jax.vjp(lambda *a: attention(*a, options, implementation=name,
                                            pallas_lowering=lowering), q, k, v)
    return [out, *vjp(do)]

  want = run("reference")
  assert want[0].shape == v.shape
  for name, got, expected in zip(("output", "dq", "dk", "dv"), run(impl), want):
    np.testing.assert_allclose(got, expected, atol=float32_tolerance(), err_msg=name)


@pytest.mark.parametrize("impl", REFUSERS)
def test_an_implementation_without_narrow_values_refuses_them_by_name(impl):
  """At trace time (the dispatcher) and at start-up (the config), one line
  naming the implementation and the ones that take it."""
  q, k, v, _ = _narrow_value_inputs(jnp.bfloat16)
  with pytest.raises(UserError, match=rf"^attention_impl={impl} takes no value head width "
                     r"other than the query and key width .*; use attention_impl reference, "
                     r"xla, pallas or auto$") as err:
    attention(q, k, v, AttentionOptions(causal=True), implementation=impl)
  assert "\n" not in str(err.value)
  with pytest.raises(UserError, match=rf"^config field model.v_head_dim={V} \(model.attention="
                     rf"'mla', queries and keys {NOPE + ROPE} wide\): attention_impl={impl} "
                     r"takes no value head width") as err:
    ModelConfig.resolve(mla_section(attention_impl=impl, dtype="bfloat16"))
  assert "\n" not in str(err.value)


def test_auto_and_context_parallelism_follow_the_declarations():
  """`auto` picks only an implementation that takes narrow values (never
  cuDNN; our kernels, which pad the values, on a TPU); with values as wide as
  the keys it may pick cuDNN; mesh.context takes narrow values (padded too)."""
  features = ("score:softmax", "value_head_dim")
  for backend, kind in (("gpu", "NVIDIA H100 80GB HBM3"), ("gpu", "A100"), ("tpu", "TPU v5p"),
                        ("cpu", "cpu")):
    chosen = auto_implementation(backend=backend, dtype=jnp.bfloat16, head_dim=64,
                                 features=features, segments=True, device_kind=kind)
    assert "value_head_dim" in IMPLEMENTATIONS[chosen].shapes, (backend, chosen)
  cfg = ModelConfig.resolve(mla_section(attention_impl="auto", dtype="bfloat16"))
  assert model_implementation(cfg, "gpu") == "xla"
  equal = ModelConfig.resolve(mla_section(attention_impl="auto", dtype="bfloat16",
                                          qk_nope_head_dim=60, v_head_dim=64))
  assert model_implementation(equal, "gpu") == "cudnn"
  assert model_implementation(cfg, "tpu") == "pallas"
  for impl in ("auto", "xla", "pallas"):
    check_context(ModelConfig.resolve(mla_section(attention_impl=impl, dtype="bfloat16")), 2)


def test_training_gradients_reach_every_parameter():
  """The training loss (`xla`: the reference's einsums for narrow values)
  has finite gradients, nonzero in every parameter: both latents' norms,
  the shared rope key's columns, each up-projection."""
  model = build_model(mla_section(), nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)))
  grads = nnx.jit(nnx.grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 3])))(model)
  for path, grad in nnx.to_flat_state(grads):
    value = np.asarray(grad[...])
    assert np.isfinite(value).all() and np.abs(value).max() > 0, path
  rope_columns = np.asarray(grads["decoder"]["layers"][0]["attn"]["kv_a_proj"]["kernel"][...])
  assert np.abs(rope_columns[:, R:]).max() > 0


# Bad configs: one line naming the field and the fix.

BAD = [
    (dict(attention="mha", kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=None,
          qk_rope_head_dim=None, v_head_dim=None),
     r"^config field model.kv_lora_rank=8: is for model.attention=mla \(multi-head latent "
     r"attention\), not mha; unset it$"),
    (dict(kv_lora_rank=None),
     r"^config field model.kv_lora_rank=None: is required by model.attention=mla; set it "
     r"\(DeepSeek-V3: 512\)$"),
    (dict(v_head_dim=0), r"^config field model.v_head_dim=0: must be a positive integer$"),
    (dict(q_lora_rank=-1), r"^config field model.q_lora_rank=-1: must be a positive integer or 0$"),
    (dict(qk_rope_head_dim=5), r"^config field model.qk_rope_head_dim=5: must be even"),
    (dict(pos_emb="learned"), r"^config field model.pos_emb='learned': must be rope for "
                              r"model.attention=mla .*; set model.pos_emb=rope$"),
    (dict(family="encoder"), r"^config field model.attention='mla': is a decoder's "
                             r"self-attention .*model.family=encoder is not supported"),
    (dict(num_kv_heads=2), r"^config field model.num_kv_heads=2: is for model.attention=mha: "
                           r"MLA's keys and values come from one latent .*; unset it$"),
    (dict(head_dim=8), r"^config field model.head_dim=8: is for model.attention=mha"),
    (dict(qk_norm=True), r"^config field model.qk_norm=True: is for model.attention=mha"),
    (dict(parametrization="mup"), r"^config field model.parametrization='mup': with "
                                  r"model.attention=mla is not supported .*; use sp$"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_a_bad_mla_config_is_one_line(overrides, message):
  with pytest.raises(UserError, match=message) as err:
    ModelConfig.resolve(mla_section(**overrides))
  assert "\n" not in str(err.value)


def test_an_mla_field_missing_on_the_command_line_exits_2_in_one_line():
  result = run_python(["-m", "model.summary", "--config", "configs/tiny.py",
                       "--config.model.attention=mla"])
  assert result.returncode == 2
  assert_one_line_error(result, "model.kv_lora_rank=None", "is required by model.attention=mla")
  assert result.stderr.count("\n") == 1, result.stderr


def test_an_mla_decoder_exports_as_deepseek_v3():
  """MLA models export through DeepSeek-V3's architecture (tests/test_hf_deepseek.py
  checks the tensors both ways)."""
  arch = hf_convert.export_architecture(ModelConfig.resolve(mla_section()))
  assert (arch.model_type, arch.hf_class) == ("deepseek_v3", "DeepseekV3ForCausalLM")
