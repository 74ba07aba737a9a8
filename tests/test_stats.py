"""Ablations that answer questions: a sweep's seeds, the report's statistics
(against scipy) and cost columns, and token/FLOP budgets that set num_steps."""
import csv
import json
import math
import os

from absl import flags
import jax
from ml_collections import config_flags
import numpy as np
import pytest
from scipy import stats as scipy_stats

from configs import base
from configs.cli import parse_flags
from configs.errors import UserError
from model import accounting
import sweeps as sweep_lib
from sweeps import stats
from training import loop
from training.metrics import read_metrics
from training.workdir import load_config
from tests.helpers import (ROOT, TINY, TWO_VARIANTS, assert_trees_equal, final_params,
                           small_config, small_flags, sweep_cli, write_sweep)

BASE = str(ROOT / "configs" / "base.py")
A = [3.52, 3.49, 3.55, 3.51]
B = [3.70, 3.68, 3.73]


def test_interval_and_welch_equal_scipys():
  s = stats.summarize(A)
  assert (s.n, s.mean, s.sd) == (4, pytest.approx(np.mean(A)), pytest.approx(np.std(A, ddof=1)))
  low, high = scipy_stats.t.interval(0.95, 3, loc=np.mean(A), scale=scipy_stats.sem(A))
  assert (s.low, s.high) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
  c = stats.compare(stats.summarize(B), s)
  welch = scipy_stats.ttest_ind(B, A, equal_var=False)
  ci = welch.confidence_interval(0.95)
  assert c.diff == pytest.approx(np.mean(B) - np.mean(A))
  assert c.p == pytest.approx(welch.pvalue, rel=1e-10) and c.df == pytest.approx(welch.df)
  assert (c.low, c.high) == (pytest.approx(ci.low, rel=1e-10), pytest.approx(ci.high, rel=1e-10))
  assert c.verdict == "differs"
  assert stats.compare(stats.summarize([3.50, 3.56]), s).verdict == "not distinguishable"
  assert stats.compare(s, s, is_baseline=True).verdict == "baseline"


def test_one_value_has_no_interval():
  one = stats.summarize([3.5])
  assert (one.n, one.mean, one.sd, one.low) == (1, 3.5, None, None)
  c = stats.compare(one, stats.summarize(A))
  assert c.diff == pytest.approx(3.5 - np.mean(A)) and (c.low, c.p) == (None, None)
  assert c.verdict == "no interval (n=1)"
  assert stats.summarize([]).n == 0 and stats.compare(stats.summarize([]), one).verdict == ""


def test_seeds_make_runs_named_and_seeded_per_variant(tmp_path):
  path = write_sweep(tmp_path, TWO_VARIANTS)
  runs = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY,
                                 ["--config.train.num_steps=20"], str(tmp_path / "r"), seeds=3)
  assert [v.name for v in runs] == [f"{g},seed={k}" for g in (
      "pos_emb=rope,norm_position=pre", "pos_emb=none,norm_position=post") for k in range(3)]
  run = runs[4]
  assert (run.group, run.seed, run.workdir) == ("pos_emb=none,norm_position=post", 1,
                                                str(tmp_path / "r" / run.name))
  assert run.train_command[-1] == "--config.train.seed=1" and run.config["train"]["seed"] == 1
  assert run.config["data"]["seed"] is None  # the data's seed follows train.seed
  seeded = write_sweep(tmp_path, "SEEDS = 2\n" + TWO_VARIANTS, "seeded.py")
  assert len(sweep_lib.make_variants(sweep_lib.load_sweep(seeded), TINY, [], str(tmp_path))) == 4
  with pytest.raises(UserError, match=r"train.seed is set on the command line and by the "
                     r"sweep's seeds \(2: "):
    sweep_lib.make_variants(sweep_lib.load_sweep(seeded), TINY, ["--config.train.seed=4"],
                            str(tmp_path))
  with pytest.raises(UserError, match="SEEDS=0 must be a positive integer"):
    sweep_lib.load_sweep(write_sweep(tmp_path, "SEEDS = 0\n" + TWO_VARIANTS, "bad.py"))


def test_a_root_keeps_to_seeds_or_to_none(tmp_path):
  """A root run with --seeds 3 refuses a run without seeds, and the other way
  round; more seeds extend it."""
  seeded, single = tmp_path / "seeded", tmp_path / "single"
  for root, seeds in ((seeded, 3), (single, None)):
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"seeds": seeds, "variants": []}))
  sweep_lib.check_seeds(str(seeded), 5)
  sweep_lib.check_seeds(str(single), None)
  sweep_lib.check_seeds(str(tmp_path / "new"), 3)
  with pytest.raises(UserError, match=f"--root {seeded} was run with --seeds 3; give --seeds 3 "
                     r"\(or more\) to resume or extend it, or a new --root for one run per "
                     "variant"):
    sweep_lib.check_seeds(str(seeded), None)
  with pytest.raises(UserError, match=f"--root {single} was run without seeds \\(one run per "
                     "variant\\); give a new --root for --seeds 2"):
    sweep_lib.check_seeds(str(single), 2)


def expected_steps(budget: float, d: int, d_ff: int) -> int:
  """configs/base.py's decoder (vocab 1024, 2 layers, 4 heads, SwiGLU, RMSNorm
  pre-norm, RoPE, tied embeddings, no biases) at width d: N = V d (embedding =
  head) + L (4 d^2 + 3 d d_ff + 2 d) + d (final norm); 6 N + 12 L S d FLOPs
  per token; batch 16 x seq_len 128 tokens per step."""
  vocab, layers, seq_len, batch = 1024, 2, 128, 16
  n = vocab * d + layers * (4 * d * d + 3 * d * d_ff + 2 * d) + d
  per_token = 6 * n + 12 * layers * seq_len * d
  return math.floor(budget / (per_token * batch * seq_len))


def test_a_flop_budget_sets_num_steps_by_model_size(tmp_path):
  path = write_sweep(tmp_path, """
def get_sweep():
  return [{"model.d_model": 64, "model.d_ff": 128}, {"model.d_model": 128, "model.d_ff": 384}]
""")
  small, large = sweep_lib.make_variants(sweep_lib.load_sweep(path), BASE,
                                         ["--config.train.flop_budget=1e13"], str(tmp_path))
  assert small.num_steps == expected_steps(1e13, 64, 128) == 4507
  assert large.num_steps == expected_steps(1e13, 128, 384) == 1305
  assert small.config["train"]["num_steps"] == small.num_steps
  config = base.get_config()
  config.train.token_budget = 16 * 128 * 40 + 100
  assert accounting.with_budget(config).train.num_steps == 40
  config.train.token_budget = 100
  with pytest.raises(UserError, match=r"train.token_budget=100 is less than one step \(2,048 "
                     "tokens at train.batch_size=16 x train.seq_len=128\\); raise it"):
    accounting.with_budget(config)


def test_num_steps_given_beside_a_budget_is_refused(tmp_path, capsys):
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'train.num_steps': 50}]\n")
  with pytest.raises(UserError, match="variant num_steps=50: train.num_steps=50 is given beside "
                     r"train.token_budget=1e\+06, which sets it; drop one of them"):
    sweep_lib.make_variants(sweep_lib.load_sweep(path), BASE,
                            ["--config.train.token_budget=1e6"], str(tmp_path))
  argv = ["train.py", "--config", BASE, "--config.train.num_steps=50",
          "--config.train.flop_budget=1e15"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True,
                                  sys_argv=argv)
  with pytest.raises(SystemExit) as exit_:
    parse_flags(argv, values)
  assert exit_.value.code == 2
  assert capsys.readouterr().err == ("error: train.num_steps=50 is given beside "
                                     "train.flop_budget=1e+15, which sets it; drop one of them\n")


def fake_run(run, loss: float, seconds: float) -> None:
  """A finished run's files as train.py and eval.py leave them."""
  os.makedirs(run.workdir)
  with open(os.path.join(run.workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(run.config, f)
  with open(os.path.join(run.workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for step in range(2, run.num_steps + 1, 2):
      f.write(json.dumps({"step": step, "split": "train", "loss": loss + 1,
                          "seconds": seconds / 3}) + "\n")
      f.write(json.dumps({"step": step, "split": "validation", "loss": loss + 1 / step}) + "\n")
  with open(os.path.join(run.workdir, "eval_report.json"), "w", encoding="utf-8") as f:
    json.dump({"step": run.num_steps, "loss": loss, "perplexity": math.exp(loss),
               "token_accuracy": 0.3, "bits_per_byte": loss / 2}, f)


def read_csv(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return list(csv.DictReader(f))


def test_report_aggregates_the_seeds_of_each_variant(tmp_path):
  path = write_sweep(tmp_path, TWO_VARIANTS)
  sweep = sweep_lib.load_sweep(path)
  root = tmp_path / "root"
  runs = sweep_lib.make_variants(sweep, TINY, ["--config.train.num_steps=6"], str(root), 3)
  sweep_lib.write_manifest(str(root), sweep, TINY, ["--config.train.num_steps=6"], runs, 3)
  losses = {0: A[:3], 1: B}
  for i, run in enumerate(runs):
    fake_run(run, losses[i // 3][i % 3], seconds=10.0 + i)
  with pytest.raises(UserError, match="--baseline nope: no such variant"):
    sweep_lib.write_report(str(root), "nope")
  written = sweep_lib.write_report(str(root))
  rows = read_csv(root / "report.csv")
  assert [(r["variant"], r["seed"], r["run"]) for r in rows] == [
      (run.group, str(run.seed), run.name) for run in runs]
  tokens = 6 * 16 * 128
  per_token = accounting.flops_per_token(load_config(runs[0].workdir).model, 128)
  assert rows[0]["tokens"] == str(tokens) and rows[0]["flops"] == str(tokens * per_token)
  assert float(rows[1]["wall_s"]) == pytest.approx(11.0)
  assert float(rows[1]["tokens_per_s"]) == pytest.approx(tokens / 11.0)
  summary = read_csv(root / "report_summary.csv")
  assert [r["variant"] for r in summary] == ["pos_emb=rope,norm_position=pre",
                                             "pos_emb=none,norm_position=post"]
  first, second = summary
  assert first["model.pos_emb"] == "rope" and first["runs"] == "3" and first["loss_n"] == "3"
  low, high = scipy_stats.t.interval(0.95, 2, loc=np.mean(A[:3]), scale=scipy_stats.sem(A[:3]))
  assert float(first["loss_ci_low"]) == pytest.approx(low)
  assert float(first["loss_ci_high"]) == pytest.approx(high)
  assert first["loss_verdict"] == "baseline" and second["loss_verdict"] == "differs"
  welch = scipy_stats.ttest_ind(B, A[:3], equal_var=False)
  assert float(second["loss_p"]) == pytest.approx(welch.pvalue)
  assert float(second["wall_s_mean"]) == pytest.approx(14.0)
  assert int(second["params"]) == accounting.formula_params(
      load_config(runs[3].workdir).model)["params_total"]
  md = (root / "report.md").read_text()
  assert "## Statistics over seeds" in md and "| pos_emb=none,norm_position=post | 3 |" in md
  assert "## Cost" in md and str(root / "validation_curves.png") in written
  assert "6 runs (2 variant(s) x 3 seeds)" in sweep_lib.status_lines(str(root))[0]
  sweep_lib.write_report(str(root), "pos_emb=none,norm_position=post")
  assert read_csv(root / "report_summary.csv")[0]["loss_verdict"] == "differs"


def test_a_sweep_without_seeds_reports_single_values(tmp_path):
  path = write_sweep(tmp_path, TWO_VARIANTS)
  sweep = sweep_lib.load_sweep(path)
  root = tmp_path / "root"
  runs = sweep_lib.make_variants(sweep, TINY, ["--config.train.num_steps=4"], str(root))
  sweep_lib.write_manifest(str(root), sweep, TINY, [], runs)
  fake_run(runs[0], 3.5, 5.0)
  sweep_lib.write_report(str(root))
  rows = read_csv(root / "report.csv")
  assert [(r["run"], r["seed"], r["state"]) for r in rows] == [
      (runs[0].name, "0", "done"), (runs[1].name, "0", "not started")]
  md = (root / "report.md").read_text()
  assert f"| {runs[0].name} | 1 | 3.5000 |  | no interval (n=1) |" in md
  assert f"| {runs[1].name} | 0 |" in md
  assert ": 2 variants in" in sweep_lib.status_lines(str(root))[0]


@pytest.mark.slow
def test_seeds_and_a_token_budget_end_to_end(tmp_path):
  """sweep.py run --seeds 3 with the length from a token budget: 3 runs, each
  with its train.seed, one aggregated row, run again: all done."""
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.pos_emb': 'rope'}]\n")
  root = tmp_path / "root"
  flags_ = [f for f in small_flags(tmp_path / "cache") if "num_steps" not in f]
  args = ["--config", TINY, "--sweep", path, "--root", str(root), "--seeds", "3", *flags_,
          f"--config.train.token_budget={6 * 4 * 32 + 5}"]
  result = sweep_cli("run", *args)
  assert result.returncode == 0, result.stdout + result.stderr
  for k in range(3):
    workdir = root / f"pos_emb=rope,seed={k}"
    config = load_config(str(workdir))
    assert (config.train.seed, config.data.seed, config.train.num_steps) == (k, None, 6)
    assert "seconds" in read_metrics(str(workdir))[0]
  assert "3 runs (1 variant(s) x 3 seeds)" in sweep_cli("status", "--root", str(root)).stdout
  assert "running 0 variant(s)" in sweep_cli("run", *args).stdout
  assert sweep_cli("report", "--root", str(root)).returncode == 0
  [row] = read_csv(root / "report_summary.csv")
  assert (row["loss_n"], row["num_steps"], row["tokens"]) == ("3", "6", str(6 * 4 * 32))
  assert float(row["loss_sd"]) > 0 and float(row["wall_s_mean"]) > 0


@pytest.mark.slow
def test_data_seed_moves_the_data_not_the_initialisation(tok_dir, tmp_path):
  """One step at the warm-up's learning rate 0 leaves the initial parameters:
  equal for equal train.seed whatever data.seed, whose first batch differs."""
  def run(name, train_seed, data_seed):
    c = small_config(tok_dir, str(tmp_path / "cache"))
    c.train.update(num_steps=1, seed=train_seed, eval_every=1, checkpoint_every=1, log_every=1)
    c.data.seed = data_seed
    loop.train(c, str(tmp_path / name))
    loss = read_metrics(str(tmp_path / name))[0]["loss"]
    return final_params(tmp_path / name)[1], loss, load_config(str(tmp_path / name))
  params, loss, config = run("a", 0, None)
  same_params, other_loss, other_config = run("b", 0, 5)
  new_params, _, _ = run("c", 1, 5)
  assert (config.data.seed, other_config.data.seed) == (None, 5)
  assert_trees_equal(params, same_params)
  assert any(not np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)))
  assert loss != other_loss
