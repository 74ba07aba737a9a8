"""The DeepSeek-V3 ablations (configs/sweeps/deepseek_attention.py,
deepseek_moe.py): every variant a valid config with the steps and KV cache
their docstrings state; and the report's columns for them, on fake runs: the
KV cache per token beside the loss, and the experts' load, compared over
seeds like the loss, kept by `--from_csv`."""
import csv
import json
import math
import os

import pytest
from scipy import stats as scipy_stats

from ml_collections.config_dict import ConfigDict

from model.accounting import kv_cache_bytes_per_token, mtp_module_params
from model.config import ModelConfig
import sweeps as sweep_lib
from sweeps import report
from tests.helpers import ROOT, TINY

SWEEPS = ROOT / "configs" / "sweeps"
TINY_MOE = str(ROOT / "configs" / "tiny_moe.py")


def variants(name: str, config: str, budget: str, root):
  sweep = sweep_lib.load_sweep(str(SWEEPS / f"{name}.py"))
  return sweep, sweep_lib.make_variants(sweep, config, [f"--config.train.flop_budget={budget}"],
                                        str(root))


def test_the_attention_sweep_gives_each_variant_its_steps_and_kv_cache(tmp_path):
  """MHA, GQA, MQA, MLA and MHA with MTP at 4.6e12 FLOPs, 3 seeds: the steps
  and KV-cache bytes per token the docstring states."""
  sweep, runs = variants("deepseek_attention", TINY, "4.6e12", tmp_path)
  assert sweep.seeds == 3 and len(runs) == 15
  groups = {}
  for run in runs:
    groups.setdefault(run.group, []).append(run)
  assert [len(v) for v in groups.values()] == [3] * 5
  expected = [(600, 2048), (633, 1024), (652, 512), (581, 640), (362, 2048)]
  assert [(v[0].num_steps, kv_cache_bytes_per_token(ConfigDict(v[0].config["model"])))
          for v in groups.values()] == expected
  mla = next(iter(v for k, v in groups.items() if k.startswith("attention=mla")))[0]
  assert mla.config["model"]["q_lora_rank"] is None
  assert [r.config["train"]["mtp_depth"] for r in runs] == [0] * 12 + [1] * 3
  # The report's parameters count the MTP module, as its FLOPs and budget do.
  mha, mtp = (report._cost(ConfigDict(v[0].config), 1) for k, v in groups.items()
              if k in (next(iter(groups)), list(groups)[-1]))
  assert mtp["params"] - mha["params"] == mtp_module_params(ModelConfig.resolve(
      ConfigDict(runs[-1].config["model"])))


def test_the_moe_sweep_balances_three_ways_at_the_same_steps(tmp_path):
  """Auxiliary loss (baseline), auxiliary-loss-free bias, neither: the deepseek
  router, 596 steps each at 3.5e12 FLOPs."""
  sweep, runs = variants("deepseek_moe", TINY_MOE, "3.5e12", tmp_path)
  assert sweep.seeds == 3 and len(runs) == 9
  trains = [(r.config["train"]["moe_aux_loss"], r.config["train"]["moe_bias_update_rate"])
            for r in runs[::3]]
  assert trains == [(0.02, 0.0), (0.0, 1e-3), (0.0, 0.0)]
  assert {r.config["model"]["moe_router"] for r in runs} == {"deepseek"}
  assert {r.num_steps for r in runs} == {596}


MOE_SWEEP = """
def get_sweep():
  return [{"train.moe_aux_loss": 0.02}, {"train.moe_aux_loss": 0.0}]
"""
# Per variant and seed: (validation loss, eval.py's per-layer expert_load, the
# train records' expert_load).
LOADS = [[(3.50, [1.10, 1.20], [1.3, 1.1]), (3.52, [1.12, 1.16], [1.2, 1.2]),
          (3.49, [1.08, 1.10], [1.4, 1.2])],
         [(3.55, [1.60, 1.80], [2.0, 1.8]), (3.57, [1.72, 1.64], [1.9, 1.7]),
          (3.54, [1.50, 1.90], [2.1, 1.9])]]


def fake_moe_run(run, loss: float, layer_loads: list[float], train_loads: list[float],
                 bias: float | None) -> None:
  """A finished mixture-of-experts run's files as train.py and eval.py leave
  them: router metrics in its train records, per-layer loads in its report."""
  os.makedirs(run.workdir)
  with open(os.path.join(run.workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(run.config, f)
  with open(os.path.join(run.workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for i, load in enumerate(train_loads):
      record = {"step": 2 * (i + 1), "split": "train", "loss": loss + 1, "seconds": 1.0,
                "expert_load": load}
      if bias is not None:
        record["moe_bias_abs"] = bias * (i + 1)
      f.write(json.dumps(record) + "\n")
      f.write(json.dumps({"step": 2 * (i + 1), "split": "validation", "loss": loss}) + "\n")
  with open(os.path.join(run.workdir, "eval_report.json"), "w", encoding="utf-8") as f:
    json.dump({"step": run.num_steps, "loss": loss, "perplexity": math.exp(loss),
               "token_accuracy": 0.3, "bits_per_byte": loss / 2,
               "expert_load": layer_loads}, f)


def read_csv(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return list(csv.DictReader(f))


def moe_report(tmp_path, write_sweep_text=MOE_SWEEP):
  path = tmp_path / "s.py"
  path.write_text(write_sweep_text)
  sweep = sweep_lib.load_sweep(str(path))
  root = tmp_path / "root"
  flags = ["--config.train.num_steps=4"]
  runs = sweep_lib.make_variants(sweep, TINY_MOE, flags, str(root), 3)
  sweep_lib.write_manifest(str(root), sweep, TINY_MOE, flags, runs, 3)
  for i, run in enumerate(runs):
    loss, layers, train = LOADS[i // 3][i % 3]
    fake_moe_run(run, loss, layers, train, bias=0.01 if i // 3 else None)
  sweep_lib.write_report(str(root))
  return root, runs


def test_the_report_puts_the_experts_load_beside_the_loss_and_compares_it(tmp_path):
  """report.csv: each run's mean over layers of eval.py's expert_load, the
  mean of its train records' and its last moe_bias_abs; report_summary.csv:
  Welch's comparison of the loads against the baseline (lower is better),
  moe_bias_abs's mean and sd; report.md: the runs table's load and KV-cache
  columns, the loads' statistics, the Experts' load section; `--from_csv`
  rebuilds both files as written."""
  root, runs = moe_report(tmp_path)
  rows = read_csv(root / "report.csv")
  assert float(rows[1]["expert_load"]) == pytest.approx((1.12 + 1.16) / 2)
  assert float(rows[2]["train_expert_load"]) == pytest.approx(1.3)
  assert rows[0]["moe_bias_abs"] == "" and float(rows[3]["moe_bias_abs"]) == pytest.approx(0.02)
  assert {r["kv_cache_bytes_per_token"] for r in rows} == {"2048"}  # 2 layers x 2 x 128 x 4 B
  summary = read_csv(root / "report_summary.csv")
  base = [sum(layers) / 2 for _, layers, _ in LOADS[0]]
  other = [sum(layers) / 2 for _, layers, _ in LOADS[1]]
  welch = scipy_stats.ttest_ind(other, base, equal_var=False)
  assert float(summary[1]["expert_load_p"]) == pytest.approx(welch.pvalue)
  assert summary[0]["expert_load_verdict"] == "baseline"
  assert summary[1]["expert_load_verdict"] == "higher (worse)"
  assert summary[1]["train_expert_load_n"] == "3"
  assert summary[0]["moe_bias_abs_mean"] == ""
  assert float(summary[1]["moe_bias_abs_mean"]) == pytest.approx(0.02)
  assert "moe_bias_abs_verdict" not in summary[0]
  md = (root / "report.md").read_text()
  table = md.split("\n\n")[2].splitlines()
  assert table[0].endswith("| bits per byte | KV cache/token (B) | experts' load, validation | "
                           "experts' load, training mean | selection bias, mean abs |")
  assert table[5].endswith(f"| 2,048 | {(1.6 + 1.8) / 2:.3f} | 1.900 | 0.02 |")
  assert "### experts' load, validation" in md and "### experts' load, training mean" in md
  assert "### selection bias" not in md
  assert "| KV cache/token |" in md and "| 2,048 B |" in md
  section = md[md.index("## Experts' load"):]
  assert f"| {runs[3].group} | {(1.7 + 1.68 + 1.7) / 3:.3f} ± " in section
  written = {name: (root / name).read_bytes() for name in ("report_summary.csv", "report.md")}
  sweep_lib.rebuild_statistics(str(root))
  assert {name: (root / name).read_bytes() for name in written} == written


def test_a_dense_report_has_no_load_columns(tmp_path):
  """Runs without router metrics: no load columns anywhere, the KV cache
  still beside the loss."""
  path = tmp_path / "s.py"
  path.write_text("def get_sweep():\n  return [{'model.num_kv_heads': 1}]\n")
  sweep = sweep_lib.load_sweep(str(path))
  root = tmp_path / "root"
  runs = sweep_lib.make_variants(sweep, TINY, ["--config.train.num_steps=4"], str(root))
  sweep_lib.write_manifest(str(root), sweep, TINY, [], runs)
  fake_moe_run(runs[0], 3.5, [], [], None)
  sweep_lib.write_report(str(root))
  header = (root / "report_summary.csv").read_text().splitlines()[0]
  assert "load" not in header and "moe_bias" not in header
  md = (root / "report.md").read_text()
  assert "load" not in md and "| 512 |" in md
