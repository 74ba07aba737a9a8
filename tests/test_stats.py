"""Ablations that answer questions: a sweep's seeds, the report's statistics
(against scipy and by hand: Welch, paired, Holm; verdicts that follow the
printed intervals) and cost columns, and token/FLOP budgets that set num_steps."""
import csv
import json
import math
import os
import re
import tempfile

from absl import flags
from hypothesis import given, settings, strategies as st
import jax
from ml_collections import config_flags
import numpy as np
import pytest
from scipy import stats as scipy_stats

from configs import base, validation
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
  c = stats.compare(stats.summarize(B), s, lower_is_better=True)
  welch = scipy_stats.ttest_ind(B, A, equal_var=False)
  ci = welch.confidence_interval(0.95)
  assert c.diff == pytest.approx(np.mean(B) - np.mean(A))
  assert c.p == pytest.approx(welch.pvalue, rel=1e-10) and c.df == pytest.approx(welch.df)
  assert (c.low, c.high) == (pytest.approx(ci.low, rel=1e-10), pytest.approx(ci.high, rel=1e-10))
  assert c.verdict == "higher (worse)"
  assert stats.compare(stats.summarize(B), s, lower_is_better=False).verdict == "higher (better)"
  assert stats.compare(s, stats.summarize(B), lower_is_better=True).verdict == "lower (better)"
  assert stats.compare(s, stats.summarize(B), lower_is_better=False).verdict == "lower (worse)"
  same = stats.compare(stats.summarize([3.50, 3.56]), s, lower_is_better=True)
  assert same.low < 0 < same.high and same.verdict == "not distinguishable"
  assert stats.compare(s, s, True, is_baseline=True).verdict == "baseline"
  flat = stats.compare(stats.summarize([3.6, 3.6]), stats.summarize([3.5, 3.5]), True)
  assert (flat.diff, flat.low, flat.p, flat.verdict) == (
      pytest.approx(0.1), None, None, "no interval (no spread)")


def test_the_verdict_follows_the_differences_interval_not_the_overlap():
  """RoPE 0.109 below sinusoidal: the two variants' own 95% intervals overlap
  (the old rule's "not distinguishable"), the difference's interval excludes 0."""
  rope, sinusoidal = [3.475, 3.500, 3.525], [3.584, 3.609, 3.634]
  r, s = stats.summarize(rope), stats.summarize(sinusoidal)
  assert s.low < r.high  # the intervals overlap
  c = stats.compare(r, s, lower_is_better=True)
  ci = scipy_stats.ttest_ind(rope, sinusoidal, equal_var=False).confidence_interval(0.95)
  assert c.diff == pytest.approx(-0.109)
  assert (c.low, c.high) == (pytest.approx(ci.low), pytest.approx(ci.high))
  assert c.high < 0 and c.p < 0.05 and c.verdict == "lower (better)"


def test_paired_comparison_equals_scipys_ttest_rel():
  x, b = [3.61, 3.58, 3.66, 3.60], [3.52, 3.50, 3.55, 3.49]
  c = stats.compare_paired(x, b, lower_is_better=True)
  rel = scipy_stats.ttest_rel(x, b)
  ci = rel.confidence_interval(0.95)
  assert c.diff == pytest.approx(np.mean(np.subtract(x, b)))
  assert (c.p, c.df) == (pytest.approx(rel.pvalue, rel=1e-10), rel.df)
  assert (c.low, c.high) == (pytest.approx(ci.low, rel=1e-10), pytest.approx(ci.high, rel=1e-10))
  assert c.verdict == "higher (worse)"
  # The seeds move together: paired, the difference is resolved; unpaired it is not.
  x, b = [3.50, 3.60, 3.70], [3.48, 3.585, 3.675]
  assert stats.compare(stats.summarize(x), stats.summarize(b), True).verdict == (
      "not distinguishable")
  assert stats.compare_paired(x, b, True).verdict == "higher (worse)"
  assert stats.compare_paired([3.5], [3.4], True) == stats.NONE


def test_holm_adjusts_by_hand():
  """Sorted 0.005, 0.01, 0.03, 0.04 of m = 4: x4, x3, x2, x1 = 0.02, 0.03, 0.06,
  0.04, each at least the one before: 0.02, 0.03, 0.06, 0.06."""
  adjusted = stats.holm([0.01, 0.04, 0.03, None, 0.005])
  assert adjusted[3] is None
  assert [adjusted[i] for i in (0, 1, 2, 4)] == pytest.approx([0.03, 0.06, 0.06, 0.02])
  assert stats.holm([0.6, 0.7]) == [1.0, 1.0] and stats.holm([0.2]) == [0.2]
  assert stats.holm([None, None]) == [None, None]


def test_one_value_has_no_interval():
  one = stats.summarize([3.5])
  assert (one.n, one.mean, one.sd, one.low) == (1, 3.5, None, None)
  c = stats.compare(one, stats.summarize(A), True)
  assert c.diff == pytest.approx(3.5 - np.mean(A)) and (c.low, c.p) == (None, None)
  assert c.verdict == "no interval (n=1)"
  assert stats.summarize([]).n == 0 and stats.compare(stats.summarize([]), one, True).verdict == ""


def write_report_files(root: str, runs: list[tuple[str, int, float, float]]) -> None:
  """A report as `sweep.py report` leaves it, whose runs are gone: report.csv
  (variant, seed, loss, token accuracy), report_summary.csv and report.md."""
  variants = list(dict.fromkeys(v for v, _, _, _ in runs))
  with open(os.path.join(root, "report.csv"), "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["variant", "seed", "data_seed", "state", "step", "loss", "token_accuracy",
                     "run"])
    writer.writerows([v, k, k, "done", 6, loss, acc, f"{v},seed={k}"] for v, k, loss, acc in runs)
  with open(os.path.join(root, "report_summary.csv"), "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["variant", "runs", "num_steps", "params", "loss_verdict"])
    writer.writerows([v, 3, 6, 1000, "baseline" if i == 1 else "x"]
                     for i, v in enumerate(variants))
  with open(os.path.join(root, "report.md"), "w", encoding="utf-8") as f:
    f.write("# Sweep s\n\n| runs |\n\n## Statistics over seeds\n\nstale table\n\n## Cost\n\nkept\n")


def parse_tables(md: str) -> dict[str, list[dict]]:
  """{metric title: the rows of its statistics table as {column title: cell}}."""
  tables = {}
  for title, body in re.findall(r"### (.+)\n\n((?:\|.*\n)+)", md):
    lines = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in body.splitlines()]
    tables[title] = [dict(zip(lines[0], line)) for line in lines[2:]]
  return tables


def test_statistics_are_rebuilt_from_report_csv(tmp_path):
  """The statistics of a report whose runs are gone, from report.csv: the
  baseline report_summary.csv named, the rest of both files kept."""
  runs = [(v, k, loss, 0.3) for v, losses in (("a", [3.61, 3.58, 3.66]), ("b", [3.52, 3.50, 3.55]))
          for k, loss in enumerate(losses)]
  write_report_files(str(tmp_path), runs)
  written = sweep_lib.rebuild_statistics(str(tmp_path))
  assert written == [str(tmp_path / "report_summary.csv"), str(tmp_path / "report.md")]
  a, b = read_csv(tmp_path / "report_summary.csv")
  assert (a["variant"], a["params"], b["loss_verdict"]) == ("a", "1000", "baseline")
  rel = scipy_stats.ttest_rel([3.61, 3.58, 3.66], [3.52, 3.50, 3.55])
  assert float(a["loss_paired_p"]) == pytest.approx(rel.pvalue)
  assert a["loss_verdict"] == a["loss_paired_verdict"] == "higher (worse)"
  assert a["token_accuracy_verdict"] == "no interval (no spread)"
  md = (tmp_path / "report.md").read_text()
  assert md.startswith("# Sweep s\n\n| runs |\n\n## Statistics over seeds\n\nPer variant")
  assert ("| b | 3 | 3.5233 | 0.0252 | [3.4608, 3.5858] |  |  |  |  | baseline |  |  |  |  |  "
          "|\n") in md
  assert md.endswith(" |\n\n## Cost\n\nkept\n") and "stale table" not in md
  sweep_lib.rebuild_statistics(str(tmp_path), "a")
  assert read_csv(tmp_path / "report_summary.csv")[1]["loss_verdict"] == "lower (better)"
  with pytest.raises(UserError, match="--baseline c: no such variant"):
    sweep_lib.rebuild_statistics(str(tmp_path), "c")
  (tmp_path / "report.md").unlink()
  with pytest.raises(UserError, match=r"report.md is missing: --from_csv rebuilds the "
                     "statistics of a report that `sweep.py report` wrote; run that first"):
    sweep_lib.rebuild_statistics(str(tmp_path))


SAMPLES = st.lists(st.floats(-3, 3, allow_nan=False), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.lists(SAMPLES, min_size=2, max_size=4), st.lists(SAMPLES, min_size=2, max_size=4),
       st.sampled_from([1e-4, 1.0, 100.0]))
def test_no_verdict_contradicts_the_interval_printed_beside_it(losses, accuracies, scale):
  """Whatever the seeds' values: "not distinguishable" only beside a printed
  interval that contains 0, "lower"/"higher" only beside one wholly below or
  above it, p < 0.05 exactly with a difference, and "better" by the metric."""
  runs = [(f"v{i}", k, 3 + scale * x, 0.3 + scale * y)
          for i, (xs, ys) in enumerate(zip(losses, accuracies)) for k, (x, y) in enumerate(
              zip(xs, ys))]
  with tempfile.TemporaryDirectory() as root:
    write_report_files(root, runs)
    sweep_lib.rebuild_statistics(root)
    tables = parse_tables(open(os.path.join(root, "report.md"), encoding="utf-8").read())
    summary = read_csv(os.path.join(root, "report_summary.csv"))
  for title, lower_is_better in (("val loss", True), ("token accuracy", False)):
    for row, csv_row in zip(tables[title], summary):
      key = "loss" if lower_is_better else "token_accuracy"
      assert row["verdict"] == csv_row[f"{key}_verdict"]
      for prefix in ("", "paired "):
        verdict = row.get(f"{prefix}verdict", "")
        interval, p = row.get(f"95% interval of {prefix}diff", ""), row.get(f"{prefix}p", "")
        if not interval:
          assert verdict in ("", "baseline", "no interval (n=1)", "no interval (no spread)")
          continue
        low, high = map(float, interval.strip("[]").split(", "))
        if verdict == "not distinguishable":
          assert low <= 0 <= high and float(p) >= 0.05
        else:
          direction, goodness = verdict.split()
          assert (high < 0) if direction == "lower" else (low > 0)
          assert float(p) < 0.05
          assert goodness == ("(better)" if (direction == "lower") == lower_is_better
                              else "(worse)")


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


def test_warmup_fraction_warms_up_a_share_of_the_budgets_steps():
  config = base.get_config()
  config.train.token_budget, config.train.warmup_fraction = 16 * 128 * 40, 0.1
  assert accounting.with_budget(config).train.warmup_steps == 4
  config.train.token_budget, config.train.warmup_fraction = 16 * 128 * 5, 0.01
  assert accounting.with_budget(config).train.warmup_steps == 1  # a positive share: one step
  config.train.token_budget, config.train.warmup_fraction = 0, 0.25
  assert accounting.with_budget(config).train.warmup_steps == round(0.25 * config.train.num_steps)
  config.train.warmup_fraction = 1.0
  with pytest.raises(UserError, match=r"train.warmup_fraction=1.0: must be in \[0, 1\)"):
    validation.validate(config)


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
  assert first["loss_verdict"] == "baseline" and second["loss_verdict"] == "higher (worse)"
  welch = scipy_stats.ttest_ind(B, A[:3], equal_var=False)
  assert float(second["loss_p"]) == pytest.approx(welch.pvalue)
  assert float(second["loss_holm_p"]) == pytest.approx(welch.pvalue)  # a family of one
  rel = scipy_stats.ttest_rel(B, A[:3])
  assert float(second["loss_paired_p"]) == pytest.approx(rel.pvalue)
  assert float(second["loss_paired_ci_low"]) == pytest.approx(rel.confidence_interval().low)
  assert [r["data_seed"] for r in rows] == ["0", "1", "2"] * 2
  assert float(second["wall_s_mean"]) == pytest.approx(14.0)
  assert int(second["params"]) == accounting.formula_params(
      load_config(runs[3].workdir).model)["params_total"]
  md = (root / "report.md").read_text()
  assert "## Statistics over seeds" in md and "| pos_emb=none,norm_position=post | 3 |" in md
  assert "## Cost" in md and str(root / "validation_curves.png") in written
  assert "6 runs (2 variant(s) x 3 seeds)" in sweep_lib.status_lines(str(root))[0]
  sweep_lib.write_report(str(root), "pos_emb=none,norm_position=post")
  assert read_csv(root / "report_summary.csv")[0]["loss_verdict"] == "lower (better)"


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
