"""T5 (v1.0 and v1.1) as our encoder-decoder: relative position bias,
unscaled attention, the scaled tied head; logits parity with tiny random
`transformers` T5 models (float32, within 1e-4 of the largest logit), for
the full forward and for KV-cache decoding: weights copied by hand, and
through `convert.py from_hf` / `to_hf` with greedy generation token for token."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx

from configs import base, t5_base
from configs.errors import UserError
from model import accounting, build_model
from model.attention import attention
from model.config import ModelConfig
from model.generate import generate
from model.relative_bias import relative_bucket
from hf import convert as hf_convert
from hf import mappings as hf_mappings
from training import workdir as workdir_lib
from training.workdir import load_run
from tests.helpers import (assert_close, both_splits, convert_error_line, edit_hf_config,
                           run_command, run_convert, save_hf)

pytestmark = pytest.mark.hf  # transformers and torch

M, H, D, F, V, BUCKETS, MAX_DISTANCE = 32, 4, 8, 48, 64, 8, 16

# version -> (transformers' T5Config fields, our model fields)
VERSIONS = {
    "v1.0": (dict(feed_forward_proj="relu", tie_word_embeddings=True),
             dict(mlp="relu", tie_embeddings=True, scale_head_input=True)),
    "v1.1": (dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
             dict(mlp="geglu_tanh", tie_embeddings=False, scale_head_input=False)),
}


def _ours_config(**overrides):
  m = base.get_config().model
  m.update(family="encoder_decoder", vocab_size=V, d_model=M, num_heads=H, head_dim=D, d_ff=F,
           num_layers=2, num_decoder_layers=2, pos_emb="relative", relative_buckets=BUCKETS,
           relative_max_distance=MAX_DISTANCE, attention_scale=1.0, norm="rmsnorm",
           norm_eps=1e-6, use_bias=False, attention_impl="xla")
  m.update(**overrides)
  return m


def _set(variable, tensor, shape):
  variable[...] = jnp.asarray(tensor.detach().numpy()).reshape(shape)


def _copy_attention(ours, hf):
  for ours_name, hf_name in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
    _set(getattr(ours, ours_name).kernel, getattr(hf, hf_name).weight.T, (M, H, D))
  _set(ours.o_proj.kernel, hf.o.weight.T, (H, D, M))


def _copy_mlp(ours, hf):
  if hasattr(hf, "wi"):
    _set(ours.up.kernel, hf.wi.weight.T, (M, F))
  else:  # gated: act(wi_0 x) * wi_1 x
    _set(ours.gate.kernel, hf.wi_0.weight.T, (M, F))
    _set(ours.up.kernel, hf.wi_1.weight.T, (M, F))
  _set(ours.down.kernel, hf.wo.weight.T, (F, M))


def _copy_weights(hf, ours):
  """T5ForConditionalGeneration's weights into our EncoderDecoder (its layers
  looped, `model.scan_layers=False`: one block object per layer)."""
  _set(ours.encoder.embed.embedding, hf.shared.weight, (V, M))
  if ours.head is not None:
    _set(ours.head.kernel, hf.lm_head.weight.T, (M, V))
  for hf_stack, stack in ((hf.encoder, ours.encoder), (hf.decoder, ours.decoder)):
    _set(stack.relative_bias.table,
         hf_stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight, (BUCKETS, H))
    _set(stack.final_norm.scale, hf_stack.final_layer_norm.weight, (M,))
    for hf_block, block in zip(hf_stack.block, stack.layers):
      _copy_attention(block.attn, hf_block.layer[0].SelfAttention)
      _set(block.norm_attn.scale, hf_block.layer[0].layer_norm.weight, (M,))
      if block.cross_attn is not None:
        _copy_attention(block.cross_attn, hf_block.layer[1].EncDecAttention)
        _set(block.norm_cross.scale, hf_block.layer[1].layer_norm.weight, (M,))
      _copy_mlp(block.mlp, hf_block.layer[-1].DenseReluDense)
      _set(block.norm_mlp.scale, hf_block.layer[-1].layer_norm.weight, (M,))


@pytest.mark.slow  # make test: test_t5_in_and_out[v1.0] through convert.py
@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_logits_match_transformers(version):
  """The full forward, and KV-cache decoding (a 16-token prefill, then one
  token at a time: the bias row of each new position), against transformers."""
  hf_fields, our_fields = VERSIONS[version]
  torch.manual_seed(0)
  config = transformers.T5Config(
      vocab_size=V, d_model=M, d_kv=D, d_ff=F, num_layers=2, num_decoder_layers=2,
      num_heads=H, relative_attention_num_buckets=BUCKETS,
      relative_attention_max_distance=MAX_DISTANCE, layer_norm_epsilon=1e-6, dropout_rate=0.0,
      **hf_fields)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  ours = build_model(_ours_config(scan_layers=False, **our_fields), nnx.Rngs(0))
  _copy_weights(hf, ours)
  rng = np.random.default_rng(0)
  # Lengths past max_distance, so the logarithmic and the last buckets are used.
  src, tgt = rng.integers(0, V, (2, 21)), rng.integers(0, V, (2, 19))
  src_mask = np.ones_like(src)
  src_mask[1, 15:] = 0
  with torch.no_grad():
    want = hf(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src_mask),
              decoder_input_ids=torch.from_numpy(tgt)).logits.numpy()
  forward = nnx.jit(lambda model, s, t, mask: model(s, t, src_padding_mask=mask))
  got = np.asarray(forward(ours, jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(src_mask) > 0))
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
  cross_kv = nnx.jit(lambda model, s, mask: model.cross_cache(model.encode(s, mask)))(
      ours, jnp.asarray(src), jnp.asarray(src_mask) > 0)
  step = nnx.jit(lambda model, *args: model.decode_step(*args))
  cache = ours.init_cache(2, 19)
  positions = jnp.broadcast_to(jnp.arange(19), (2, 19))
  steps = []
  for start, stop in [(0, 16), (16, 17), (17, 18), (18, 19)]:
    logits, cache = step(ours, jnp.asarray(tgt[:, start:stop]), positions[:, start:stop], cache,
                         cross_kv, jnp.asarray(src_mask) > 0)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), want, atol=1e-4 * np.abs(want).max())


def test_buckets_match_transformers():
  offsets = np.arange(-300, 301)[None, :]
  t5_attention = transformers.models.t5.modeling_t5.T5Attention
  reference = t5_attention._relative_position_bucket  # pylint: disable=protected-access
  for bidirectional in (True, False):
    want = reference(
        torch.from_numpy(offsets), bidirectional=bidirectional, num_buckets=32,
        max_distance=128).numpy()
    got = relative_bucket(jnp.asarray(offsets, jnp.int32), bidirectional=bidirectional,
                          num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_bias_is_the_same_in_reference_and_xla():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 4, 8)), jnp.float32) for _ in range(3))
  k, v = k[:, :, :2], v[:, :, :2]  # GQA: 4 query heads over 2 KV heads
  bias = jnp.asarray(rng.normal(size=(1, 4, 6, 6)), jnp.float32)
  want = attention(q, k, v, causal=True, bias=bias, implementation="reference")
  got = attention(q, k, v, causal=True, bias=bias, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  unbiased = attention(q, k, v, causal=True, implementation="reference")
  assert not np.allclose(np.asarray(unbiased), np.asarray(want), atol=1e-3)


def test_pallas_with_relative_bias_is_refused():
  with pytest.raises(UserError, match="model.pos_emb='relative': attention_impl=pallas takes "
                                     "no additive bias"):
    build_model(_ours_config(attention_impl="pallas"), nnx.Rngs(0))
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(UserError, match="attention_impl=pallas takes no additive bias"):
    attention(q, q, q, bias=jnp.zeros((1, 2, 4, 4)), implementation="pallas")


@pytest.mark.parametrize("field,value,message", [
    ("relative_buckets", 2, "must be >= 4"),
    ("relative_max_distance", 4, "must exceed model.relative_buckets // 2"),
    ("relative_buckets", 0, "must be a positive integer"),
])
def test_bad_relative_fields_are_refused(field, value, message):
  with pytest.raises(UserError, match=message):
    build_model(_ours_config(**{field: value}), nnx.Rngs(0))


def test_accounting_counts_the_bias_tables():
  m = _ours_config(**VERSIONS["v1.1"][1])
  measured, formula = accounting.measured_params(m), accounting.formula_params(m)
  assert measured == formula
  assert formula["params_position_table"] == 2 * BUCKETS * H


@pytest.mark.parametrize("shapes", [
    dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),  # t5-base
    {},  # T5Config()'s defaults: t5-small's shapes
], ids=["base", "small"])
def test_t5_base_has_the_transformers_parameter_count(shapes):
  """configs/t5_base.py (at t5-small's shapes for T5Config()'s defaults)
  against T5ForConditionalGeneration, counted on torch's meta device
  (unique tensors: the tied embeddings once)."""
  config = transformers.T5Config(**shapes)
  with torch.device("meta"):
    hf = transformers.T5ForConditionalGeneration(config)
  want = sum(p.numel() for p in hf.parameters())
  m = t5_base.get_config().model
  m.update(d_model=config.d_model, d_ff=config.d_ff, num_layers=config.num_layers,
           num_decoder_layers=config.num_decoder_layers, num_heads=config.num_heads,
           head_dim=config.d_kv)
  assert accounting.formula_params(m)["params_total"] == want
  assert accounting.measured_params(m)["params_total"] == want


@pytest.mark.slow
def test_decoder_only_relative_bias_decodes_like_the_forward():
  """A decoder-only model with the causal relative bias: KV-cache decoding
  (prefill, then one token at a time) gives the full forward's logits, also
  with attention_impl=reference."""
  m = _ours_config(family="decoder", num_decoder_layers=None)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, V, (2, 20)))
  for impl in ("xla", "reference"):
    m.attention_impl = impl
    ours = build_model(m, nnx.Rngs(2))
    # A bias of order 1 (the initialiser's is 0.02), so that a wrong row shows.
    ours.decoder.relative_bias.table[...] = jnp.asarray(rng.normal(size=(BUCKETS, H)),
                                                        jnp.float32)
    want = np.asarray(ours(tokens))
    cache = ours.init_cache(2, 20)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    steps = []
    for start, stop in [(0, 18), (18, 19), (19, 20)]:
      logits, cache = ours.decode_step(tokens[:, start:stop], positions[:, start:stop], cache)
      steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want,
                               atol=1e-5 * np.abs(want).max())


# --- convert.py from_hf / to_hf -------------------------------------------------

CONVERT_V = 320  # the tiny checkpoints' rows, past the tokenizer's 290


def _t5(version, **kw):
  """A tiny random T5ForConditionalGeneration (decoder start: the pad id, 0 as
  our tokenizers'), its norm weights drawn at random so that a misplaced
  tensor shows; v1.1 with its own head, as the published v1.1 checkpoints."""
  torch.manual_seed(0)
  config = transformers.T5Config(**{**dict(
      vocab_size=CONVERT_V, d_model=M, d_kv=D, d_ff=F, num_layers=2, num_decoder_layers=3,
      num_heads=H, relative_attention_num_buckets=BUCKETS,
      relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0, pad_token_id=0,
      decoder_start_token_id=0, eos_token_id=2), **VERSIONS[version][0], **kw})
  hf = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, parameter in hf.named_parameters():
      if "layer_norm" in name:
        torch.nn.init.normal_(parameter, mean=1.0, std=0.5)
    if not VERSIONS[version][0]["tie_word_embeddings"]:
      hf.lm_head.weight = torch.nn.Parameter(torch.randn(CONVERT_V, M))
  return hf


def _pairs(vocab):
  """Sources [2, 21] (row 1 padded after 15 tokens) and targets [2, 19]: past
  max_distance, so the logarithmic and the last buckets are used."""
  rng = np.random.default_rng(1)
  src, tgt = rng.integers(3, vocab, (2, 21)), rng.integers(3, vocab, (2, 19))
  mask = np.ones_like(src)
  mask[1, 15:] = 0
  return src, tgt, mask


def _hf_seq2seq_logits(hf, src, tgt, mask):
  with torch.no_grad():
    return hf(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(mask),
              decoder_input_ids=torch.as_tensor(tgt)).logits.numpy()


@pytest.mark.parametrize("version,layers", [
    ("v1.0", (1, 2)), pytest.param("v1.1", (2, 3), marks=pytest.mark.slow)])
def test_t5_in_and_out(tok, tmp_path, version, layers):
  """from_hf: the run's logits (with a padded source) and greedy KV-cache
  generation from the pad id match transformers; to_hf: AutoModelForSeq2SeqLM
  and AutoTokenizer load it to the same logits and ids. `layers`: encoder's,
  decoder's."""
  hf = _t5(version, num_layers=layers[0], num_decoder_layers=layers[1])
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf, tok, tmp_path / "hf"),
                     "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  m = config.model
  assert (m.family, m.mlp, m.num_decoder_layers, m.tie_embeddings, config.train.objective,
          config.data.pair_specials) == (
      "encoder_decoder", VERSIONS[version][1]["mlp"], layers[1],
      VERSIONS[version][1]["tie_embeddings"], "seq2seq", True)
  src, tgt, mask = _pairs(tok.vocab_size)
  want = _hf_seq2seq_logits(hf, src, tgt, mask)
  forward = nnx.jit(lambda model, s, t, k: model(s, t, src_padding_mask=k))
  assert_close(forward(model, jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(mask) > 0), want)

  sources = [row[:n].tolist() for row, n in zip(src, mask.sum(1))]
  ours = generate(model, m, [[tok.pad_id]] * 2, sources=sources, max_new_tokens=8,
                  pad_id=tok.pad_id)
  with torch.no_grad():
    theirs = hf.generate(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(mask),
                         max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         use_cache=False)  # transformers sizes its cache by num_layers
  assert ours == theirs[:, 1:].tolist()

  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
  assert_close(_hf_seq2seq_logits(exported, src, tgt, mask), want)
  assert exported.config.decoder_start_token_id == tok.pad_id
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tok("def add(a, b)")["input_ids"] == tok.encode_with_specials("def add(a, b)")


def test_t5_hub_file_layout_imports_tied(tok, tmp_path):
  """As older hub files: the stacks' `embed_tokens` and the head saved as
  copies of `shared`; read past, the import is tied (the v1.1 case of
  test_t5_in_and_out: a head that differs is untied)."""
  hf_dir = tmp_path / "hf"
  save_hf(_t5("v1.0", num_layers=1, num_decoder_layers=1), tok, hf_dir)
  path = hf_dir / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
    tensors[name] = tensors["shared.weight"]
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  assert run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", tmp_path / "run") == 0
  assert workdir_lib.load_config(str(tmp_path / "run")).model.tie_embeddings


@pytest.mark.parametrize("fields,message", [
    (dict(feed_forward_proj="gated-relu", dense_act_fn="relu", is_gated_act=True),
     "feed_forward_proj='gated-relu' (dense_act_fn='relu', is_gated_act=True)"),
    (dict(decoder_start_token_id=2), "decoder_start_token_id=2"),
    (dict(is_decoder=True), "is_decoder=True"),
])
def test_t5_refuses_unsupported_fields(tok, tmp_path, capsys, fields, message):
  hf_dir = tmp_path / "hf"
  save_hf(_t5("v1.0", num_layers=1, num_decoder_layers=1), tok, hf_dir)
  edit_hf_config(hf_dir, **fields)
  assert message in convert_error_line(capsys, "from_hf", "--hf_dir", hf_dir, "--workdir",
                                       tmp_path / "run")
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_t5_base_preset_exports_as_t5_and_back():
  """The preset is T5 v1.0 base: it exports as t5, and its config.json
  imports to the same model fields; so do v1.1's form of it, every MLP kind,
  a tied unscaled and an untied scaled head, and other depths and widths."""
  t5 = hf_mappings.ARCHITECTURES["t5"]
  variants = [*(fields for _, fields in VERSIONS.values()),
              *(dict(mlp=kind) for kind in ("gelu", "gelu_tanh", "geglu", "swiglu")),
              dict(tie_embeddings=True, scale_head_input=False),
              dict(tie_embeddings=False, scale_head_input=True),
              dict(num_decoder_layers=3, head_dim=32, relative_buckets=16, max_len=1024)]
  for fields in variants:
    config = t5_base.get_config()
    config.model.update(**fields)
    cfg = ModelConfig.resolve(config.model)
    assert hf_convert.export_architecture(cfg).model_type == "t5"
    config.model.update(**t5.config_from_hf(json.loads(json.dumps(t5.config_to_hf(cfg, 32128)))))
    assert ModelConfig.resolve(config.model) == cfg


@pytest.mark.slow
def test_t5_commands_import_evaluate_finetune_export(tok, tmp_path):
  """The commands on a T5 import: eval.py on a pairs file (the import is a
  data.task=pairs run; generation from the pad id), train.py fine-tuning it
  with objective seq2seq, convert.py to_hf of the fine-tune, loaded by
  transformers."""
  pairs = tmp_path / "pairs.tsv"
  count = both_splits(lambda i: f"{pairs}:{i + 2}", 50, 6)  # named path:line, after the header
  pairs.write_text("src\ttgt\n" + "".join(f"def f{i}(a):\treturn a + {i}\n"
                                          for i in range(count)))

  run_command("convert.py", "from_hf", "--hf_dir",
      save_hf(_t5("v1.0", num_layers=1, num_decoder_layers=2), tok, tmp_path / "hf"),
      "--workdir", tmp_path / "run")
  run_command("eval.py", "--workdir", tmp_path / "run", "--data", pairs, "--max_examples", "4",
      "--beam_size", "2", "--max_new_tokens", "4")
  other_data = tmp_path / "run" / "eval" / "step_0_data-pairs.tsv"  # a folder of its own
  report = json.loads((other_data / "eval_report.json").read_text())
  assert (report["step"], report["data"]) == (0, "task=pairs")
  run_command("train.py", f"--config=configs/from_run.py:{tmp_path / 'run'}",
      f"--config.train.restore_from={tmp_path / 'run'}", "--workdir", tmp_path / "ft",
      "--config.train.num_steps=2", f"--config.data.paths={pairs}",
      "--config.data.val_percent=50", "--config.train.batch_size=2",
      "--config.train.seq_len=16", "--config.train.eval_steps=1",
      "--config.train.warmup_steps=1")
  run_command("convert.py", "to_hf", "--workdir", tmp_path / "ft", "--out", tmp_path / "ft_hf")
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ft_hf").eval()
  config, _, model, step = load_run(str(tmp_path / "ft"))
  assert (step, config.train.objective) == (2, "seq2seq")
  src, tgt, mask = _pairs(tok.vocab_size)
  ours = model(jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(mask) > 0)
  assert_close(_hf_seq2seq_logits(exported, src, tgt, mask), np.asarray(ours))


# config.json of public checkpoints (as published, task_specific_params left
# out; values only read): t5-small (v1.0) and flan-t5-small (v1.1, 6 heads of
# 64 in a width of 512).
_PUBLISHED = {
    "t5-small": ({
        "architectures": ["T5WithLMHeadModel"], "d_ff": 2048, "d_kv": 64, "d_model": 512,
        "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
        "initializer_factor": 1.0, "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06,
        "model_type": "t5", "n_positions": 512, "num_heads": 8, "num_layers": 6,
        "output_past": True, "pad_token_id": 0, "relative_attention_num_buckets": 32,
        "vocab_size": 32128},
        dict(mlp="relu", tie_embeddings=True, scale_head_input=True, num_decoder_layers=6,
             head_dim=64, relative_max_distance=128)),
    "flan-t5-small": ({
        "architectures": ["T5ForConditionalGeneration"], "d_ff": 1024, "d_kv": 64,
        "d_model": 512, "decoder_start_token_id": 0, "dense_act_fn": "gelu_new",
        "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True,
        "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
        "num_decoder_layers": 8, "num_heads": 6, "num_layers": 8, "pad_token_id": 0,
        "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
        "tie_word_embeddings": False, "vocab_size": 32128},
        dict(mlp="geglu_tanh", tie_embeddings=False, scale_head_input=False,
             num_decoder_layers=8, num_heads=6, head_dim=64)),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_published_t5_configs_import(name):
  hf, expected = _PUBLISHED[name]
  fields = hf_mappings.architecture_of(hf).config_from_hf(hf)
  assert {k: fields.get(k) for k in expected} == expected
  config = base.get_config()
  config.model.update(**fields)
  assert hf_convert.export_architecture(ModelConfig.resolve(config.model)).model_type == "t5"


@pytest.mark.slow
def test_mt5_imports_with_an_unscaled_head_and_exports_as_t5(tok, tmp_path):
  """mT5 (model_type mt5): T5 v1.1's layout, its own head, the head input not
  scaled; from_hf's logits match MT5ForConditionalGeneration's, and the
  export is a T5 (v1.1, scale_decoder_outputs false) with the same logits."""
  torch.manual_seed(1)
  hf = transformers.MT5ForConditionalGeneration(transformers.MT5Config(
      vocab_size=CONVERT_V, d_model=M, d_kv=D, d_ff=F, num_layers=1, num_decoder_layers=1,
      num_heads=H, relative_attention_num_buckets=BUCKETS,
      relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0, pad_token_id=0,
      decoder_start_token_id=0, eos_token_id=2)).eval()
  with torch.no_grad():
    hf.lm_head.weight = torch.nn.Parameter(torch.randn(CONVERT_V, M))
  workdir = tmp_path / "run"
  assert run_convert("from_hf", "--hf_dir", save_hf(hf, tok, tmp_path / "hf"),
                     "--workdir", workdir) == 0
  config, _, model, _ = load_run(str(workdir))
  m = config.model
  assert (m.mlp, m.tie_embeddings, m.scale_head_input) == ("geglu_tanh", False, False)
  src, tgt, mask = _pairs(tok.vocab_size)
  want = _hf_seq2seq_logits(hf, src, tgt, mask)
  assert_close(model(jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(mask) > 0), want)
  out = tmp_path / "exported"
  assert run_convert("to_hf", "--workdir", workdir, "--out", out) == 0
  assert json.loads((out / "config.json").read_text())["model_type"] == "t5"
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
  assert_close(_hf_seq2seq_logits(exported, src, tgt, mask), want)
