"""bench/vs_torch.py: its torch reference computes our model, and the bench runs.

The torch decoder, given our initial parameters, must give our first-step
loss for both models of the bench (learned positions with concat rows; RoPE
with packed rows and their segment mask), and the two optimizers must keep
the losses together over the next steps. The smoke run (slow) trains both
models a few steps at tiny sizes, decodes a tiny GPT-2 and checks the JSON.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import tiny
from configs.errors import UserError
from tests.helpers import ROOT, assert_one_line_error, run_python

pytestmark = pytest.mark.hf  # torch and transformers

vs_torch = pytest.importorskip("bench.vs_torch")
from bench import cpu_profile  # noqa: E402  (after the skip: it imports torch)


def _small(name: str):
  """configs/tiny.py at test sizes, as the bench's model `name`; gpt2_style
  with a Python loop of blocks, tiny scanned (both layouts are copied)."""
  c = tiny.get_config()
  c.model.update(vocab_size=64, d_model=32, num_heads=2, d_ff=48, max_len=32,
                 scan_layers=name == "tiny")
  c.tokenizer.vocab_size = 64
  c.train.update(batch_size=2, seq_len=16, warmup_steps=2, num_steps=6)
  return vs_torch.model_config(c, name)


def _batch(config, seed: int) -> dict:
  """Random tokens; packed rows (not concat) hold two documents and padding."""
  B, T = config.train.batch_size, config.train.seq_len
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
           "loss_mask": np.ones((B, T), np.float32)}
  if config.data.packing == "packed":
    cut, end = T // 3, T - 2  # document 1: [0, cut), document 2: [cut, end), then padding
    segment_ids = np.zeros((B, T), np.int32)
    segment_ids[:, :cut], segment_ids[:, cut:end] = 1, 2
    batch["positions"][:, cut:end] -= cut
    batch["positions"][:, end:] = 0
    batch["loss_mask"][:, [cut - 1]] = 0.0
    batch["loss_mask"][:, end:] = 0.0
    batch["segment_ids"] = segment_ids
  return batch


@pytest.mark.parametrize("name", vs_torch.MODELS)
def test_torch_reference_is_our_model(name):
  config = _small(name)
  vs_torch.check_schedule(config.train, config.train.num_steps)
  ours = vs_torch.OursTrainer(config)
  theirs = vs_torch.TorchTrainer(config, ours.state["params"], compile_model=False)
  for step in range(config.train.num_steps):
    batch = _batch(config, step)
    ours.timed(batch)
    theirs.timed(batch)
  assert abs(ours.losses[0] - theirs.losses[0]) < vs_torch.FIRST_LOSS_TOLERANCE
  # Same optimizer, schedule, clipping and decay mask: the losses stay together.
  np.testing.assert_allclose(theirs.losses, ours.losses, atol=1e-4)
  assert ours.losses[-1] < ours.losses[0]


def test_torch_reference_refuses_what_it_does_not_implement():
  c = tiny.get_config()
  c.model.num_kv_heads = 2
  with pytest.raises(UserError, match="model.num_kv_heads=2"):
    vs_torch.model_config(c, "tiny")
  c = tiny.get_config()
  c.train.optimizer = "lion"
  with pytest.raises(UserError, match="train.optimizer='lion'"):
    vs_torch.model_config(c, "gpt2_style")


def test_bad_flag_is_one_line():
  assert_one_line_error(run_python(["-m", "bench.vs_torch", "--models", "gpt3"]),
                        "--models=gpt3", "gpt2_style, tiny")


@pytest.mark.slow
def test_smoke_run_writes_json(tmp_path, tok_dir):
  out = tmp_path / "vs_torch.json"
  cmd = [sys.executable, "-m", "bench.vs_torch", "--config", str(ROOT / "configs" / "tiny.py"),
         f"--config.tokenizer.path={tok_dir}", "--config.data.source=pydoc",
         f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.batch_size=2",
         "--config.train.seq_len=32", "--steps", "3", "--block", "1", "--gpt2", "tiny",
         "--prompt_len", "8", "--decode_tokens", "4", "--decode_batches", "1,2",
         "--repeats", "1", "--parts", "train,decode,profile,attention", "--profile_steps", "1",
         "--out", str(out)]
  result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=280)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  for key in ("date", "command", "commit", "device", "jax", "torch", "transformers",
              "torch_threads", "batch_size", "seq_len", "steps", "schedule", "train",
              "train_table", "decode", "decode_table", "profile", "profile_table",
              "attention", "attention_table"):
    assert key in report, key
  assert [r["model"] for r in report["train"]] == list(vs_torch.MODELS)
  for r in report["train"]:
    assert r["first_step_loss_gap"] < vs_torch.FIRST_LOSS_TOLERANCE
    assert r["ratio_ours_over_torch"] > 0
    for side in ("ours", "torch"):
      for key in ("ms_median", "ms_p10", "ms_p90", "tokens_per_s", "final_loss", "startup_s",
                  "build_s", "first_step_s"):
        assert key in r[side], (side, key)
      assert len(r[side]["ms_all"]) == 2 and len(r[side]["losses"]) == 3
  rows = report["decode"]["rows"]
  assert [r["batch"] for r in rows] == [1, 2]
  assert all(r["identical_tokens"] and r["ratio_ours_over_transformers"] > 0 for r in rows)


@pytest.mark.parametrize("name", vs_torch.MODELS)
def test_profile_finds_each_part_of_the_step(name):
  """Every category the model has gets time on both sides: our named scopes
  reach the compiled program's thunks (the scanned stack's included), and
  torch's ops are sorted by name and by the optimizer range."""
  config = _small(name)
  ours = vs_torch.OursTrainer(config)
  theirs = vs_torch.TorchTrainer(config, ours.state["params"], compile_model=False)
  batches = [_batch(config, seed) for seed in range(3)]
  hlo = ours.step_fn.lower(ours.state, batches[0]).compile().as_text()
  ours.step(batches[0])
  theirs.step(batches[0])
  profiles = {"ours": cpu_profile.profile_ours(ours.step, batches[1:], hlo),
              "torch": cpu_profile.profile_torch(theirs.step, batches[1:])}
  for side, profile in profiles.items():
    assert set(profile["ms"]) == set(cpu_profile.CATEGORIES)
    for category in ("matmuls", "attention", "activation", "norms", "loss", "optimizer"):
      assert profile["ms"][category] > 0, (side, category)
  scoped = [op for op in profiles["ours"]["top"] if op["category"] == "attention"]
  assert all("attention" in op["scope"] for op in scoped)
  table = cpu_profile.profile_table([{"model": name, **{
      side: {**p, "step_ms": 1.0} for side, p in profiles.items()}}])
  assert table.count(f"| {name} |") == len(cpu_profile.CATEGORIES) + 2


def test_attention_alone_times_every_case():
  rows = cpu_profile.attention_times(batch=1, seq=16, heads=2, head_dim=8, repeats=1)
  assert [r["case"] for r in rows] == list(cpu_profile.ATTENTION_CASES)
  assert all(r[k] > 0 for r in rows for k in ("reference", "xla", "torch"))
