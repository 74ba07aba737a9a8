"""bench/tasks.py: every task preset over seeds. The aggregation and the docs
rendering on synthetic reports (fast), the page's generated paragraphs
against the checked-in JSON, the one-line errors; and (slow) the command end
to end at tiny size, and the same seed at the same thread count giving the
same numbers in two processes."""
import json
import math
import pathlib
import shutil
import subprocess
import sys

import pytest

from bench import tasks
from configs.errors import UserError
import sweeps as sweep_lib
from sweeps.state import TIMES
from tests.helpers import ROOT, assert_one_line_error

DOCS = ROOT / "docs" / "tasks.md"
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results" / "tasks.json"
T_975_4 = 2.7764451051977987  # Student t quantile 0.975, 4 degrees of freedom (tables)


def test_aggregate_is_exact_on_known_numbers():
  a = tasks.aggregate([3.0, 1.0, 4.0, 2.0, 5.0])
  half = T_975_4 * math.sqrt(2.5) / math.sqrt(5)  # sd = sqrt(10 / 4)
  assert (a["n"], a["mean"], a["min"], a["max"]) == (5, 3.0, 1.0, 5.0)
  assert a["sd"] == pytest.approx(math.sqrt(2.5), rel=1e-12)
  assert (a["ci_low"], a["ci_high"]) == (pytest.approx(3 - half, rel=1e-9),
                                         pytest.approx(3 + half, rel=1e-9))
  assert tasks.aggregate([0.5]) == {"n": 1, "mean": 0.5, "min": 0.5, "max": 0.5, "sd": None,
                                    "ci_low": None, "ci_high": None}
  same = tasks.aggregate([1.0, 1.0, 1.0])
  assert (same["sd"], same["ci_low"], same["ci_high"]) == (0.0, 1.0, 1.0)


def _run(seed, threads, state="done", wall=None, cpu=None, **figures):
  run = {"run": f"PJRT_NPROC={threads},seed={seed}", "seed": seed, "threads": threads,
         "xla_threads": threads, "state": state, "step": 1200}
  if state == "done":
    run["figures"] = figures
  if wall is not None:
    run.update(train_wall_s=wall, train_cpu_s=cpu)
  return run


RUNS = [_run(0, 1, wall=180.0, cpu=330.0, exact_match_greedy=1.0, exact_match_beam=1.0,
             chrf_greedy=100.0, loss=0.01),
        _run(1, 1, wall=200.0, cpu=350.0, exact_match_greedy=0.5, exact_match_beam=0.75,
             chrf_greedy=90.0, loss=0.03),
        _run(0, 2, exact_match_greedy=0.25, exact_match_beam=0.5, chrf_greedy=80.0, loss=0.5),
        _run(1, 2, state="failed")]


def _result(runs=RUNS):
  return {"config": "configs/seq2seq_reverse.py", "threads": [1, 2], "seeds": 2,
          "num_steps": 1200, "command": "python -m bench.tasks --seeds 2",
          "commit": "abc1234", "date": "2026-12-04T10:00:00",
          "machines": [{"host": "h", "cpu_model": "AMD EPYC", "cpus": 2}], "runs": runs,
          "summary": tasks.summarize(runs, "seq2seq")}


def test_summary_is_per_thread_count_over_the_finished_runs():
  [one, two] = tasks.summarize(RUNS, "seq2seq")
  assert (one["xla_threads"], one["runs"], two["xla_threads"], two["runs"]) == (1, 2, 2, 1)
  assert one["figures"]["exact_match_greedy"]["mean"] == 0.75
  assert one["figures"]["exact_match_beam"] == tasks.aggregate([1.0, 0.75])
  assert one["figures"]["train_wall_s"]["mean"] == 190.0
  assert set(one["figures"]) == {"exact_match_greedy", "exact_match_beam", "chrf_greedy",
                                 "loss", "train_wall_s", "train_cpu_s"}
  assert "train_wall_s" not in two["figures"]  # no times recorded
  assert two["figures"]["chrf_greedy"]["n"] == 1  # the failed seed is left out


def test_a_block_renders_mean_min_max_and_n_per_thread_count():
  head, table = tasks.render_block("seq2seq_reverse", _result()).split("\n\n")
  assert " ".join(head.split()) == (
      "Over seeds: mean (min–max) of 2 runs per row, `train.seed` 0..1, 1,200 steps each; "
      "train times as `time` counts train.py (start-up included). Not finished: "
      "PJRT_NPROC=2,seed=1. `python -m bench.tasks --seeds 2` at commit abc1234, 2026-12-04, "
      "on AMD EPYC (2 CPUs usable); every run in `bench/results/tasks.json`.")
  assert max(len(line) for line in head.splitlines()) <= 92
  assert table.splitlines() == [
      "| XLA threads | seeds (n) | exact match greedy | exact match beam 4 | chrF greedy | "
      "train wall | train CPU |",
      "|---:|---:|---:|---:|---:|---:|---:|",
      "| 1 | 2 | 0.750 (0.500–1.000) | 0.875 (0.750–1.000) | 95.00 (90.00–100.00) | "
      "3 min 10 s (3 min 00 s–3 min 20 s) | 340 s (330 s–350 s) |",
      "| 2 | 1 | 0.250 | 0.500 | 80.00 | – | – |"]
  assert tasks.render_block("bert_mlm", None).startswith("Over seeds: not measured yet")


def _page(names=tuple(tasks.PRESETS), end=None) -> str:
  parts = ["# Page\n"]
  for name in names:
    parts.append(f"Text about {name}.\n\n<!-- bench.tasks:begin {name} -->\nold\n"
                 f"<!-- bench.tasks:end {end or name} -->\n")
  return "\n".join(parts)


def test_render_docs_rewrites_the_blocks_and_nothing_else():
  page = _page()
  rendered = tasks.render_docs(page, {"seq2seq_reverse": _result()})
  blocks = tasks.read_blocks(rendered)
  assert blocks["seq2seq_reverse"] == tasks.render_block("seq2seq_reverse", _result()) + "\n"
  assert blocks["addition"] == tasks.render_block("addition", None) + "\n"
  outside = lambda text: tasks.BLOCK.sub("", text)  # pylint: disable=unnecessary-lambda-assignment
  assert outside(rendered) == outside(page)
  assert tasks.render_docs(rendered, {"seq2seq_reverse": _result()}) == rendered
  for bad, message in [(_page(tuple(tasks.PRESETS)[1:]), "missing seq2seq_reverse"),
                       (_page((*tasks.PRESETS, "gpt2")), "unknown gpt2"),
                       (_page(("addition",), end="bert_mlm"), "ends as bert_mlm")]:
    with pytest.raises(UserError, match=message):
      tasks.render_docs(bad, {})


def test_a_run_record_reads_the_report_and_the_sweeps_times(tmp_path):
  workdir = tmp_path / "PJRT_NPROC=1,seed=3"
  workdir.mkdir()
  (workdir / "eval_report.json").write_text(json.dumps({
      "step": 6, "loss": 1.5, "token_accuracy": 0.25, "examples": 16,
      "greedy": {"exact_match": 0.5, "bleu": 10.0, "chrf": 20.0},
      "beam": {"beam_size": 4, "exact_match": 0.75, "bleu": 11.0, "chrf": 21.0}}))
  machine = {"host": "h", "cpu_model": "AMD EPYC", "cpus": 2}
  times = [{"command": "train.py", "wall_s": 10.0, "cpu_s": 15.0, "started": "2026-12-04T10:00",
            "xla_cpu_threads": 1, **machine},
           {"command": "train.py", "wall_s": 5.0, "cpu_s": 6.0, "started": "2026-12-04T11:00",
            "xla_cpu_threads": 1, **machine},
           {"command": "eval.py", "wall_s": 3.0, "cpu_s": 2.5, "started": "2026-12-04T11:01",
            "xla_cpu_threads": 1, **machine}]
  (workdir / TIMES).write_text(
      "".join(json.dumps(t) + "\n" for t in times) + '{"half-writ')
  variant = sweep_lib.Variant(workdir.name, {}, str(workdir), 6, [], [], seed=3,
                              env={"PJRT_NPROC": "1"})
  assert tasks.run_record(variant, "seq2seq") == {
      "run": "PJRT_NPROC=1,seed=3", "seed": 3, "threads": 1, "state": "done", "step": 6,
      "figures": {"exact_match_greedy": 0.5, "exact_match_beam": 0.75, "bleu_greedy": 10.0,
                  "bleu_beam": 11.0, "chrf_greedy": 20.0, "chrf_beam": 21.0, "loss": 1.5,
                  "token_accuracy": 0.25},
      "train_wall_s": 15.0, "train_cpu_s": 21.0, "train_invocations": 2, "eval_wall_s": 3.0,
      "eval_cpu_s": 2.5, "eval_invocations": 1, "started": "2026-12-04T10:00",
      "xla_threads": 1, "machine": machine}
  assert tasks._figures("mlm", {"masked_token_accuracy": 0.2, "loss": 4.3,  # pylint: disable=protected-access
                                "unigram_accuracy": 0.03, "masked_tokens": 9}) == {
      "masked_token_accuracy": 0.2, "loss": 4.3, "unigram_accuracy": 0.03}
  assert tasks._figures("classify", {"accuracy": 0.5, "macro_f1": 0.4, "loss": 1.0,  # pylint: disable=protected-access
                                     "majority_baseline": {"accuracy": 0.27}}) == {
      "accuracy": 0.5, "macro_f1": 0.4, "loss": 1.0}


def test_write_results_replaces_only_the_presets_run(tmp_path):
  out = str(tmp_path / "tasks.json")
  tasks.write_results(out, {"bert_mlm": {"seeds": 1}})
  tasks.write_results(out, {"seq2seq_reverse": {"seeds": 5}})
  data = tasks.write_results(out, {"bert_mlm": {"seeds": 3}})
  assert list(data["presets"]) == ["seq2seq_reverse", "bert_mlm"]  # PRESETS order
  assert json.loads(pathlib.Path(out).read_text()) == {
      "presets": {"seq2seq_reverse": {"seeds": 5}, "bert_mlm": {"seeds": 3}}}


def test_bad_input_is_one_line():
  with pytest.raises(UserError, match="--only gpt2: no such task preset; the presets: "
                     "seq2seq_reverse, seq2seq_reverse_decoder, code_summary"):
    tasks.presets(["addition,gpt2"])
  assert tasks.presets(["classify_decoder", "addition,seq2seq_reverse"]) == [
      "seq2seq_reverse", "addition", "classify_decoder"]
  for bad in (["0"], ["1", "x"]):
    with pytest.raises(UserError, match="--threads .*: positive integers"):
      tasks.thread_counts(bad)
  assert tasks.thread_counts([]) == [None] and tasks.thread_counts(["2", "1", "2"]) == [2, 1]
  result = subprocess.run([sys.executable, "-m", "bench.tasks", "--only", "gpt2", "--dry_run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2
  assert_one_line_error(result, "error: --only gpt2: no such task preset; the presets:")


def test_the_page_has_one_block_per_preset():
  assert list(tasks.read_blocks(DOCS.read_text(encoding="utf-8"))) == list(tasks.PRESETS)


def test_the_pages_blocks_are_the_rendering_of_the_checked_in_json():
  if not RESULTS.exists():
    pytest.skip("bench/results/tasks.json is not checked in yet (no seed runs measured): "
                "python -m bench.tasks --seeds 5 --write_docs writes it and the page")
  text = DOCS.read_text(encoding="utf-8")
  results = json.loads(RESULTS.read_text(encoding="utf-8"))["presets"]
  assert tasks.render_docs(text, results) == text, \
      "rerun python -m bench.tasks --docs_only (the page differs from the JSON)"


def test_the_readmes_headlines_are_the_rendering_of_the_checked_in_json():
  text = README.read_text(encoding="utf-8")
  results = json.loads(RESULTS.read_text(encoding="utf-8"))["presets"] if RESULTS.exists() else {}
  assert tasks.render_readme(text, results) == text, \
      "rerun python -m bench.tasks --docs_only (the README differs from the JSON)"


def test_a_headline_row_is_the_first_figures_mean_and_range_over_every_run():
  result = _result()
  text = tasks.render_headlines({"seq2seq_reverse": result})
  values = [r["figures"]["exact_match_greedy"] for r in result["runs"] if r["state"] == "done"]
  row = [line for line in text.splitlines() if line.startswith("| Reversing strings")]
  assert row == [
      "| Reversing strings, encoder-decoder (`configs/seq2seq_reverse.py`) | exact match greedy "
      f"{sum(values) / len(values):.3f} ({min(values):.3f}–{max(values):.3f}) | "
      f"{len(values)}: 2 seeds x 1 and 2 threads | "
      "`python -m bench.tasks --only seq2seq_reverse --threads 1,2` | abc1234 |"]
  assert "machine |" not in text and "AMD EPYC (2 CPUs usable)" in " ".join(text.split())
  assert "not measured yet" in tasks.render_headlines({})
  page = f"intro\n{tasks.BEGIN.format('headlines')}\nold\n{tasks.END.format('headlines')}\nrest\n"
  rendered = tasks.render_readme(page, {"seq2seq_reverse": result})
  assert rendered.startswith("intro\n") and rendered.endswith("rest\n") and "old" not in rendered
  with pytest.raises(UserError, match="needs one bench.tasks block"):
    tasks.render_readme("no block here", {})


def test_headlines_of_presets_from_two_machines_name_each_rows_machine():
  other = {**_result(), "machines": [{"host": "b", "cpu_model": "Xeon", "cpus": 8}]}
  text = tasks.render_headlines({"seq2seq_reverse": _result(), "addition": other})
  header, _, first, second = text.splitlines()[-4:]
  assert header.endswith("| commit | machine |")
  assert first.endswith("| AMD EPYC (2 CPUs usable) |") and second.endswith("| Xeon (8 CPUs usable) |")


# End to end at tiny size (slow: each run trains and evaluates, about 30 s).

TINY_RUN = ["--config.model.d_model=32", "--config.model.num_layers=1",
            "--config.model.num_heads=2", "--config.model.d_ff=64",
            "--config.train.num_steps=6", "--config.train.batch_size=8",
            "--config.train.warmup_steps=1", "--config.train.log_every=2",
            "--config.train.eval_every=3", "--config.train.checkpoint_every=3",
            "--config.train.eval_steps=1", "--config.data.task_size=200",
            "--config.data.task_test_size=16"]


def _bench(tmp, name: str, seeds: int, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
  out = tmp / f"{name}.json"
  result = subprocess.run(
      [sys.executable, "-m", "bench.tasks", "--only", "seq2seq_reverse", "--seeds", str(seeds),
       "--threads", "2", "--root", str(tmp / name), "--out", str(out), *extra, *TINY_RUN,
       f"--config.data.cache_dir={tmp / 'cache'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result, json.loads(out.read_text())["presets"]["seq2seq_reverse"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("bench_tasks")
  shutil.copy(DOCS, tmp / "tasks.md")
  shutil.copy(README, tmp / "README.md")
  result, preset = _bench(tmp, "a", 2, "--write_docs", "--docs", str(tmp / "tasks.md"),
                          "--readme", str(tmp / "README.md"))
  return tmp, result, preset


@pytest.mark.slow
def test_the_command_trains_evaluates_aggregates_and_writes_the_page(smoke):
  tmp, _, preset = smoke
  assert (preset["objective"], preset["seeds"], preset["threads"], preset["num_steps"]) == (
      "seq2seq", 2, [2], 6)
  assert [(r["run"], r["state"], r["xla_threads"]) for r in preset["runs"]] == [
      ("PJRT_NPROC=2,seed=0", "done", 2), ("PJRT_NPROC=2,seed=1", "done", 2)]
  for run in preset["runs"]:
    assert set(run["figures"]) == set(tasks.FIGURES["seq2seq"])
    assert run["train_wall_s"] > 0 and run["train_cpu_s"] > 0 and run["eval_wall_s"] > 0
  [group] = preset["summary"]
  assert group["xla_threads"] == 2 and group["figures"]["loss"] == tasks.aggregate(
      [r["figures"]["loss"] for r in preset["runs"]])
  blocks = tasks.read_blocks((tmp / "tasks.md").read_text())
  assert blocks["seq2seq_reverse"] == tasks.render_block("seq2seq_reverse", preset) + "\n"
  assert blocks["addition"] == tasks.render_block("addition", None) + "\n"
  assert tasks.read_blocks((tmp / "README.md").read_text())["headlines"] == (
      tasks.render_headlines({"seq2seq_reverse": preset}) + "\n")
  # Run again: both runs are done, so nothing trains and the figures are the same.
  again, preset_again = _bench(tmp, "a", 2)
  assert "skip PJRT_NPROC=2,seed=0: done" in again.stdout and "running 0 run(s)" in again.stdout
  assert preset_again["runs"] == preset["runs"]
  assert sweep_lib.status_lines(str(tmp / "a" / "seq2seq_reverse"))[0].endswith("(2 done)")


@pytest.mark.slow
def test_the_same_seed_and_thread_count_give_identical_figures(smoke):
  tmp, _, preset = smoke
  _, other = _bench(tmp, "b", 1)
  assert other["runs"][0]["figures"] == preset["runs"][0]["figures"]  # bit for bit
  losses = [[(r["step"], r["split"], r["loss"]) for r in map(json.loads, (
      tmp / root / "seq2seq_reverse" / "PJRT_NPROC=2,seed=0" / "metrics.jsonl").open())]
            for root in ("a", "b")]
  assert losses[0] == losses[1] and len(losses[0]) >= 4
