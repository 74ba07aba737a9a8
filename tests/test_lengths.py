"""eval.py --seq_len: loss by position at 4x the training length, RoPE
scaling set at evaluation time, the refusal past a learned table, and the
sweep report's column per evaluated length."""
import csv
import json
import os
import pathlib

import numpy as np
import pytest
from scipy import stats as scipy_stats

from configs.errors import UserError
from sweeps import lengths as sweep_lengths
from tests.helpers import small_config
from training import evaluate, lengths, loop

TRAIN_LEN = 16
TEXT = "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n" for i in range(60))


@pytest.fixture(scope="module")
def run_of(tok_dir, tmp_path_factory):
  """pos_emb -> (workdir, held-out text file) of a 1-step run trained at rows
  of 16 tokens, model.max_len 32; each trained once for the module."""
  root = tmp_path_factory.mktemp("lengths")
  data = root / "held_out.txt"
  data.write_text(TEXT)
  runs = {}

  def get(pos_emb):
    if pos_emb not in runs:
      c = small_config(tok_dir)
      c.model.update(pos_emb=pos_emb, max_len=32)
      c.train.update(num_steps=1, seq_len=TRAIN_LEN, warmup_steps=0, log_every=1,
                     eval_every=1, eval_steps=1, checkpoint_every=1)
      loop.train(c, str(root / pos_emb))
      runs[pos_emb] = (str(root / pos_emb), str(data))
    return runs[pos_emb]

  return get


@pytest.mark.parametrize("pos_emb", [pytest.param("none", marks=pytest.mark.slow),
                                     pytest.param("sinusoidal", marks=pytest.mark.slow),
                                     "rope"])
def test_eval_at_four_times_the_training_length(run_of, pos_emb):
  """Rows of 64 positions: 16 buckets of 4, whose target-weighted mean is
  the report's loss, the training length marked in the plot."""
  workdir, data = run_of(pos_emb)
  report = evaluate.run_eval(workdir, data=data, seq_len=4 * TRAIN_LEN, max_new_tokens=1,
                             prompts=["def "])
  table = report["loss_by_position"]
  assert (report["seq_len"], report["train_seq_len"], table["bucket_width"]) == (64, 16, 4)
  buckets = table["buckets"]
  assert [b["start"] for b in buckets] == list(range(0, 64, 4)) and buckets[-1]["end"] == 64
  targets = np.array([b["targets"] for b in buckets])
  assert targets.sum() == report["targets"] and (targets > 0).all()
  mean = sum(b["loss"] * b["targets"] for b in buckets) / targets.sum()
  np.testing.assert_allclose(mean, report["loss"], rtol=1e-5)
  (path,) = [f for f in report["files"] if f.endswith("eval_report.json")]
  # A folder of its own (the length and the data file): the step's own report stays.
  folder = f"step_{report['step']}_64_data-{pathlib.Path(data).name}"
  assert pathlib.Path(path).parent.name == folder
  saved = json.loads(pathlib.Path(path).read_text())
  assert saved["loss_by_position"] == table
  assert pathlib.Path(workdir, "loss_by_position_64.png").stat().st_size > 0
  assert lengths.read_lengths(workdir)["64"]["loss"] == report["loss"]


def test_rope_scaling_at_evaluation_time(run_of):
  """--rope_scaling yarn --rope_scaling_factor 4 for one evaluation: recorded
  in the report and eval_lengths.json beside the plain one, the saved config
  untouched, a different loss."""
  workdir, data = run_of("rope")
  plain = evaluate.run_eval(workdir, data=data, seq_len=64, max_new_tokens=1, prompts=["def "])
  yarn = evaluate.run_eval(workdir, data=data, seq_len=64, max_new_tokens=1, prompts=["def "],
                           rope_scaling="yarn", rope_scaling_factor=4)
  assert yarn["rope_override"] == dict(rope_scaling="yarn", rope_scaling_factor=4.0,
                                       rope_original_max_len=TRAIN_LEN)
  assert abs(yarn["loss"] - plain["loss"]) > 1e-6
  assert set(lengths.read_lengths(workdir)) == {"64", "64_yarn4"}
  assert pathlib.Path(workdir, "loss_by_position_64_yarn4.png").stat().st_size > 0
  saved = json.loads(pathlib.Path(workdir, "config.json").read_text())
  assert saved["model"]["rope_scaling"] == "none"


def test_learned_positions_refuse_past_the_table_in_one_line(run_of):
  workdir, data = run_of("learned")
  with pytest.raises(UserError, match=r"^--seq_len 64: a learned position table has no rows "
                                      r"past model.max_len=32; evaluate at most that length"):
    evaluate.run_eval(workdir, data=data, seq_len=64)
  with pytest.raises(UserError, match="--rope_scaling yarn: needs a pos_emb=rope run"):
    evaluate.run_eval(workdir, data=data, rope_scaling="yarn", rope_scaling_factor=4)


def test_sweep_report_has_a_column_per_evaluated_length(tmp_path):
  """The hook of sweeps/report.py: one column per label in any variant's
  eval_lengths.json, blank where a variant lacks it."""
  for name, entries in (("a", {"64": 3.5, "32": 3.0}), ("b", {"64_yarn4": 3.25})):
    (tmp_path / name).mkdir()
    for label, loss in entries.items():
      lengths.record(str(tmp_path / name), label, {"seq_len": int(label.split("_")[0]),
                                                   "loss": loss})
  titles, rows = sweep_lengths.length_columns(
      [lengths.read_lengths(str(tmp_path / name)) for name in ("a", "b")])
  assert titles == ["loss@32", "loss@64", "loss@64_yarn4"]
  assert rows == [[3.0, 3.5, ""], ["", "", 3.25]]


def test_sweep_report_aggregates_the_seeds_of_each_length(tmp_path):
  """With seeds, each variant's losses at a length: mean and Student-t
  interval over the seeds evaluated there, beside the runs one by one."""
  losses = {"rope,seed=0": (3.0, 3.4), "rope,seed=1": (3.2, 3.6), "rope,seed=2": (3.1, ""),
            "none,seed=0": (3.5, 3.9)}
  for name, (at_32, at_64) in losses.items():
    (tmp_path / name).mkdir()
    for label, loss in (("32", at_32), ("64", at_64)):
      if loss != "":
        table = {"bucket_width": int(label) // 2, "buckets": [
            {"start": 0, "end": int(label) // 2, "loss": loss - 0.1, "targets": 10},
            {"start": int(label) // 2, "end": int(label), "loss": loss + 0.1, "targets": 10}]}
        lengths.record(str(tmp_path / name), label, {"seq_len": int(label), "loss": loss,
                                                     "loss_by_position": table})
  names = list(losses)
  section, files = sweep_lengths.write_length_table(
      str(tmp_path), names, [str(tmp_path / n) for n in names], ["rope"] * 3 + ["none"], [16])
  assert [os.path.basename(f) for f in files] == ["report_lengths.csv",
                                                  "report_lengths_summary.csv",
                                                  "loss_by_position.png"]
  assert os.path.getsize(files[2]) > 0
  half_32 = scipy_stats.t.ppf(0.975, 2) * 0.1 / 3 ** 0.5  # sd of 3.0, 3.2, 3.1 is 0.1
  half_64 = scipy_stats.t.ppf(0.975, 1) * 0.02 ** 0.5 / 2 ** 0.5  # sd of 3.4, 3.6
  assert (f"| rope | 3.1000 [{3.1 - half_32:.4f}, {3.1 + half_32:.4f}] (n=3) | "
          f"3.5000 [{3.5 - half_64:.4f}, {3.5 + half_64:.4f}] (n=2) |") in section
  assert "| none | 3.5000 (n=1) | 3.9000 (n=1) |" in section
  assert "| rope,seed=2 | 3.1000 |  |" in section
  with open(files[1], encoding="utf-8") as f:
    rope = next(csv.DictReader(f))
  assert rope["variant"] == "rope" and rope["loss@32_n"] == "3"
  assert abs(float(rope["loss@64_ci_high"]) - (3.5 + half_64)) < 1e-9



def test_legend_labels_keep_what_differs_and_fit_their_column():
  """The loss-by-position legend drops the name fields every variant shares
  and wraps the rest to its column (long hybrid layer lists were cut off)."""
  variants = ["num_layers=4,layer_types=full_attention",
              "num_layers=4,layer_types=" + "-".join(["linear_attention"] * 3 + ["full_attention"])]
  names, ncol, lines = sweep_lengths._legend_layout(variants, width_inches=5)
  assert ncol == 2 and names[0] == "layer_types=full_attention"
  assert "num_layers" not in names[1] and names[1].replace("\n", "") == variants[1][13:]
  assert max(len(l) for n in names for l in n.splitlines()) <= 14 * 5 / 2 - 6
  assert lines == max(n.count("\n") + 1 for n in names) + 1
  assert sweep_lengths._legend_layout(["rope"], 5)[0] == ["rope"]
