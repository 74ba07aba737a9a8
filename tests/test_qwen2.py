"""Qwen2: the `configs/qwen2_0_5b.py` preset against `transformers`' count,
and its config.json mapping both ways (with its own sliding window).

The checkpoint parity of Qwen2 (import, export, the window) is in
tests/test_hf_convert.py with the other architectures.
"""
import json
import subprocess
import sys

import pytest
import torch
import transformers

from configs import base, qwen2_0_5b
from model import accounting
from model.config import ModelConfig
from tests.test_hf_convert import ROOT
from hf import convert as hf_convert
from hf import mappings as hf_mappings


def _hf_qwen2_0_5b():
  """Qwen2-0.5B's config, as configs/qwen2_0_5b.py states it."""
  return transformers.Qwen2Config(
      vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
      rms_norm_eps=1e-6, tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def test_qwen2_0_5b_has_the_transformers_parameter_count():
  """Counted on torch's meta device (unique tensors: the tied head once);
  nothing downloaded, nothing allocated on either side."""
  with torch.device("meta"):
    hf = transformers.Qwen2ForCausalLM(_hf_qwen2_0_5b())
  want = sum(p.numel() for p in hf.parameters())
  m = qwen2_0_5b.get_config().model
  assert accounting.formula_params(m)["params_total"] == want == 494_032_768
  assert accounting.measured_params(m) == accounting.formula_params(m)


def test_qwen2_0_5b_summary_and_export_architecture():
  """`python -m model.summary --json` prints the same count; the preset
  exports as Qwen2 with the config transformers builds."""
  result = subprocess.run([sys.executable, "-m", "model.summary", "--config",
                           "configs/qwen2_0_5b.py", "--json"], capture_output=True, text=True,
                          check=True, cwd=ROOT)
  assert json.loads(result.stdout)["params_total"] == 494_032_768
  cfg = ModelConfig.resolve(qwen2_0_5b.get_config().model)
  arch = hf_convert.export_architecture(cfg)
  assert arch.model_type == "qwen2"
  exported = transformers.Qwen2Config(**arch.config_to_hf(cfg, cfg.vocab_size)).to_dict()
  want = _hf_qwen2_0_5b().to_dict()
  for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
              "tie_word_embeddings", "rope_parameters", "vocab_size", "layer_types"):
    assert exported.get(key) == want.get(key), key


@pytest.mark.parametrize("window", [
    {}, dict(sliding_window=8), dict(sliding_window=8, sliding_window_layers=(2,)),
    dict(sliding_window=8, sliding_window_layers=(0, 2))], ids=["none", "all", "last", "some"])
def test_qwen2_config_round_trip(window):
  """Our Qwen2 config -> its config.json (through JSON) -> our config again,
  every model field the same; transformers reads the window's layers as ours."""
  config = qwen2_0_5b.get_config()
  config.model.update(num_layers=3, **window)
  cfg = ModelConfig.resolve(config.model)
  qwen2 = hf_mappings.ARCHITECTURES["qwen2"]
  hf = json.loads(json.dumps(qwen2.config_to_hf(cfg, cfg.vocab_size)))
  again = base.get_config().model
  again.update(**qwen2.config_from_hf(hf), dtype="bfloat16")
  assert ModelConfig.resolve(again) == cfg
  layer_types = transformers.Qwen2Config(**hf).layer_types
  assert [i for i, kind in enumerate(layer_types)
          if kind == "sliding_attention"] == list(cfg.sliding_window_layers)
