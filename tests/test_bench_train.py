"""Smoke test of bench/train_throughput.py: a one-layer model, two timed steps."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_throughput_runs_and_writes_json(tmp_path):
  out = tmp_path / "train_throughput.json"
  cmd = [sys.executable, "-m", "bench.train_throughput", "--config",
         str(ROOT / "configs" / "tiny.py"), "--config.model.num_layers=1",
         "--config.train.batch_size=2", "--config.train.seq_len=16", "--steps", "2",
         "--warmup", "1", "--out", str(out)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "| ours |" in result.stdout and "| plain |" in result.stdout, result.stdout

  report = json.loads(out.read_text())
  for key in ("date", "command", "commit", "device", "backend", "jax", "config", "batch_size",
              "seq_len", "tokens_per_step", "flop_formula", "peak_flops", "rows",
              "ratio_ours_over_plain", "paired_ratio_ours_over_plain", "table"):
    assert key in report, key
  assert report["batch_size"] == 2 and report["seq_len"] == 16
  assert report["flop_formula"]["flops_per_token"] > 0
  rows = {r["name"]: r for r in report["rows"]}
  assert set(rows) == {"ours", "plain"}
  for row in rows.values():
    for key in ("ms_per_step", "tokens_per_second", "tflops", "mfu", "ratio_vs_plain",
                "first_step_loss"):
      assert key in row, key
    assert row["tokens_per_second"] > 0
    assert len(row["ms_all"]) == 2
  # Same parameters and batch: the two steps see the same first loss.
  assert abs(rows["ours"]["first_step_loss"] - rows["plain"]["first_step_loss"]) < 1e-4
  assert report["ratio_ours_over_plain"] > 0
