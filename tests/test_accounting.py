"""Parameter, KV-cache, FLOP and memory accounting: the lesson's numbers exactly."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from configs import base, bert_base, gpt2_small, llama2_7b, tiny, transformer_base
from model import accounting
from model.attention import choose_implementation
from model.summary import summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama(**overrides):
  config = llama2_7b.get_config()
  config.model.update(**overrides)
  return config


def test_llama2_7b_matches_the_lesson():
  m = llama2_7b.get_config().model
  params = accounting.measured_params(m)
  assert params == accounting.formula_params(m)
  layer = params["params_per_layer"]
  assert layer == {"attention": 67_108_864, "mlp": 135_266_304, "norms": 8_192,
                   "total": 202_383_360}
  assert params["num_layers"] * layer["total"] == 6_476_267_520
  assert params["params_embedding"] == 262_144_000
  assert params["params_final_norms"] == 4_096
  assert params["params_total"] == 6_476_267_520 + 262_144_000 + 4_096
  assert round(params["params_total"] / 1e9, 2) == 6.74


def test_llama2_7b_kv_cache_at_32k():
  report = summarize(_llama(max_len=32768))
  assert report["kv_cache_bytes_per_token"] == 524_288
  assert report["kv_cache_bytes_at_max_len"] == 17_179_869_184 == 16 * 2**30


def test_grouped_query_attention_shrinks_cache_and_attention():
  m = _llama(num_kv_heads=8).model
  assert accounting.kv_cache_bytes_per_token(m) == 131_072
  params = accounting.measured_params(m)
  assert params == accounting.formula_params(m)
  assert params["params_per_layer"]["attention"] == 41_943_040


def test_kv_cache_bytes_follow_compute_dtype():
  assert accounting.kv_cache_bytes_per_token(_llama(dtype="float32").model) == 1_048_576
  assert accounting.kv_cache_bytes_per_token(_llama(num_kv_heads=1).model) == 16_384
  assert accounting.kv_cache_bytes_per_token(bert_base.get_config().model) == 0


def test_gpt2_small_is_124m():
  m = gpt2_small.get_config().model
  params = accounting.measured_params(m)
  assert params == accounting.formula_params(m)
  d, V, L = 768, 50304, 12
  layer = (4 * d * d + 4 * d) + (8 * d * d + 4 * d + d) + 4 * d
  assert params["params_total"] == L * layer + V * d + 1024 * d + 2 * d == 124_475_904
  assert params["params_position_table"] == 1024 * d


def test_flops_per_token_palm_convention():
  m = llama2_7b.get_config().model
  n = accounting.formula_params(m)["params_total"]
  forward = 2 * n + 4 * 32 * 4096 * 4096
  assert accounting.flops_per_token(m, 4096, train=False) == forward
  assert accounting.flops_per_token(m, 4096) == 3 * forward


def test_flops_reproduce_the_benchmark_mfu():
  # docs/benchmarks.md: GPT-2 small at 254,700 tokens/s = 27.6% of 790 TFLOP/s,
  # with N = parameters without the position table.
  m = gpt2_small.get_config().model
  flops = accounting.flops_per_token(m, 1024)
  assert flops == 6 * (124_475_904 - 1024 * 768) + 12 * 12 * 1024 * 768
  assert round(254_700 * flops / 790e12 * 100, 1) == 27.6


def _small(**overrides):
  m = base.get_config().model
  m.update(vocab_size=97, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=16)
  m.update(**overrides)
  return m


@pytest.mark.parametrize("overrides", [
    {},
    dict(num_kv_heads=2),
    dict(num_kv_heads=1),
    dict(use_bias=True),
    dict(tie_embeddings=False),
    dict(norm="layernorm", mlp="gelu"),
    dict(mlp="relu"),
    dict(mlp="geglu_tanh", use_bias=True),
    dict(qkv_bias=True, num_kv_heads=2),
    dict(use_bias=True, out_bias=False, mlp_bias=False, mlp="gelu"),
    dict(pos_emb="learned", use_bias=True, norm="layernorm"),
    dict(pos_emb="sinusoidal"),
    dict(pos_emb="none", head_dim=6),
    dict(norm_position="post", norm="layernorm", num_kv_heads=2),
    dict(family="encoder", pos_emb="learned", norm_position="post", mlp="gelu",
         use_bias=True),
    dict(family="encoder_decoder", num_decoder_layers=3, pos_emb="learned",
         tie_embeddings=False, num_kv_heads=2),
    dict(family="encoder_decoder", norm_position="post", norm="layernorm", use_bias=True,
         mlp="gelu", pos_emb="sinusoidal"),
    dict(family="encoder", pos_emb="learned", norm_position="post", norm="layernorm",
         type_vocab_size=2, embedding_norm=True, head_transform=True, output_bias=True),
    dict(head_transform=True, output_bias=True, tie_embeddings=False),
    dict(family="encoder_decoder", embedding_norm=True, type_vocab_size=3, norm="layernorm"),
    dict(family="encoder", pos_emb="relative", relative_buckets=8, relative_max_distance=16),
    dict(pos_emb="relative", scale_head_input=True),
    dict(qk_norm=True, num_kv_heads=2, head_dim=12, attn_softcap=50.0, final_softcap=30.0),
    dict(family="encoder_decoder", qk_norm=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_measured_equals_formula(overrides):
  m = _small(**overrides)
  assert accounting.measured_params(m) == accounting.formula_params(m)


def test_qkv_bias_without_out_bias():
  """Qwen2's layout (q, k, v biases; none on o or the MLP) and use_bias with
  out_bias and mlp_bias turned off."""
  for overrides, want in ((dict(qkv_bias=True), {"q_proj", "k_proj", "v_proj"}),
                          (dict(use_bias=True, out_bias=False, mlp_bias=False),
                           {"q_proj", "k_proj", "v_proj"}),
                          (dict(use_bias=True, qkv_bias=False), {"o_proj", "up", "gate", "down"})):
    biased = {path.split("/")[-2] for path in accounting.parameter_shapes(_small(**overrides))
              if path.endswith("/bias")}
    assert biased == want, overrides


def test_qk_norm_adds_two_scales_of_head_dim_per_attention():
  """QK-norm: a q scale and a k scale [d_k] in each attention sublayer (Qwen3's
  q_norm, k_norm); the soft-caps add no parameter."""
  plain = accounting.formula_params(_small(head_dim=12, num_layers=3))
  normed = accounting.formula_params(_small(head_dim=12, num_layers=3, qk_norm=True,
                                            attn_softcap=50.0, final_softcap=30.0))
  assert normed["params_per_layer"]["attention"] - plain["params_per_layer"]["attention"] == 24
  assert normed["params_total"] - plain["params_total"] == 3 * 24


def test_presets_measured_equals_formula():
  for preset in (tiny, bert_base, transformer_base):
    m = preset.get_config().model
    assert accounting.measured_params(m) == accounting.formula_params(m), preset.__name__


def test_encoder_decoder_layers_reported_separately():
  params = accounting.formula_params(transformer_base.get_config().model)
  attention = 4 * 512 * 512 + 4 * 512
  assert params["params_per_encoder_layer"]["attention"] == attention
  assert "cross_attention" not in params["params_per_encoder_layer"]
  assert params["params_per_layer"]["cross_attention"] == attention
  assert params["params_per_layer"]["norms"] == 3 * 2 * 512
  assert params["params_embedding"] == 37000 * 512  # shared and tied: counted once


def test_activations_follow_korthikanti_without_dropout():
  config = gpt2_small.get_config()
  config.model.attention_impl, config.train.remat = "xla", "none"
  d, h, S, V, L, B = 768, 12, 1024, 50304, 12, 32
  per_token = L * (32 * d + 2 * h * S) + 2 * d + 4 * V
  memory = accounting.training_memory_bytes(config)
  assert memory["activations"] == B * S * per_token
  config.train.remat = True
  remat = accounting.training_memory_bytes(config)["activations"]
  assert remat == B * S * ((L * d + 16 * d + h * S) * 2 + 2 * d + 4 * V)
  config.train.grad_accum_steps = 4
  assert accounting.training_memory_bytes(config)["activations"] == remat // 4


def test_activations_of_the_bert_embedding_norm_and_head_transform():
  config = bert_base.get_config()
  d = 768
  bert = accounting.activation_bytes_per_token(config.model, 128, remat=False)
  config.model.update(embedding_norm=False, head_transform=False)
  plain = accounting.activation_bytes_per_token(config.model, 128, remat=False)
  assert bert - plain == 4 * d * 4  # float32: norm input, dense, activation and norm inputs


def test_training_memory_adamw():
  memory = accounting.training_memory_bytes(llama2_7b.get_config())
  n = 6_738_415_616
  assert memory["parameters"] == memory["gradients"] == 4 * n
  assert memory["optimizer_state"] == 8 * n
  assert memory["total"] == 16 * n + memory["activations"]


def _summary_cli(*args):
  return subprocess.run([sys.executable, "-m", "model.summary", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_json():
  result = _summary_cli("--config", "configs/llama2_7b.py", "--config.model.num_kv_heads=8",
                        "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  for key in ("params_total", "params_per_layer", "params_embedding",
              "kv_cache_bytes_per_token", "kv_cache_bytes_at_max_len",
              "flops_per_token_forward", "flops_per_token_train", "training_memory_bytes"):
    assert key in report
  assert set(report["training_memory_bytes"]) == {"parameters", "gradients",
                                                  "optimizer_state", "activations", "total"}
  assert report["kv_cache_bytes_per_token"] == 131_072
  assert report["params_per_layer"]["attention"] == 41_943_040


def test_cli_table():
  result = _summary_cli("--config", "configs/llama2_7b.py")
  assert result.returncode == 0, result.stderr
  assert "202,383,360" in result.stdout and "6,738,415,616" in result.stdout
  assert "524,288" in result.stdout


def test_cli_sets_the_steps_from_a_budget_as_train_py_does():
  """configs/sweeps/heads.py's budget: 4.6e12 FLOPs are 600 steps of MHA and
  652 of MQA, which costs less per step."""
  for kv_heads, steps in ((4, 600), (1, 652)):
    result = _summary_cli("--config", "configs/tiny.py", "--config.train.flop_budget=4.6e12",
                          f"--config.model.num_kv_heads={kv_heads}", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["train_steps"] == steps
    assert report["train_tokens"] == steps * 16 * 128
    assert report["train_flops"] == steps * 16 * 128 * report["flops_per_token_train"] <= 4.6e12


def test_cli_bad_config_is_one_line_exit_2():
  result = _summary_cli("--config", "configs/llama2_7b.py", "--config.model.num_heads=5")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ")
  assert "model.d_model" in lines[0] and "model.num_heads=5" in lines[0]


def test_activations_follow_the_dispatchers_choice_for_auto():
  """`auto` counts the attention scores exactly when the dispatcher picks an
  implementation that keeps them: xla on CPU and for float32 on a GPU; cuDNN
  (no scores) for 16-bit on a GPU, our kernel (no scores) on a TPU."""
  def activations(impl, dtype, backend=None):
    config = gpt2_small.get_config()
    config.model.update(attention_impl=impl, dtype=dtype)
    config.train.loss_impl = "xla"  # the same loss on every backend: attention's choice alone
    return accounting.training_memory_bytes(config, backend)["activations"]

  for dtype in ("float32", "bfloat16"):
    assert activations("auto", dtype, "cpu") == activations("xla", dtype)
    assert activations("auto", dtype, "tpu") == activations("pallas", dtype)
    assert activations("xla", dtype) > activations("cudnn", dtype)
  assert activations("auto", "float32", "gpu") == activations("xla", "float32")
  assert activations("auto", "bfloat16", "gpu") == activations("cudnn", "bfloat16")
  # With no backend given, the estimate is for this machine: what the real
  # dispatcher picks for gpt2_small's queries here.
  q = jnp.zeros((1, 1, 12, 64), jnp.bfloat16)
  here = choose_implementation(q, ("score:softmax",))
  assert activations("auto", "bfloat16") == activations(here, "bfloat16")
