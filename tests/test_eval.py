"""eval.py does what it is asked: --prompt alone only completes the prompts
(nothing scored, eval_report.json untouched), --score scores as well, --out
leaves the workdir as it was, and a whole-split pass counts its batches."""
import json
import re

import pytest

from configs import base
from configs.errors import UserError
from data import pipeline
from training import evaluate, loop, metrics
from training import workdir as workdir_lib
from tests.helpers import assert_one_line_error, run_python, small_config, snapshot


@pytest.fixture(name="run")
def fixture_run(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.update(num_steps=2, eval_every=2, checkpoint_every=2)
  loop.train(c, str(tmp_path / "run"))
  return tmp_path / "run"


def _whole_split_batches(workdir) -> int:
  config, tok, _, _ = workdir_lib.load_run(str(workdir))
  return len(pipeline.make_eval_batches(config, tok, None))


def test_progress_lines_every_tenth_and_the_last(capsys):
  with metrics.Progress(25) as progress:
    for _ in range(25):
      progress.update()
  lines = capsys.readouterr().err.splitlines()  # not a terminal: lines, no bar
  assert [re.match(r"eval: (\d+)/25 batches, \d+\.\d s$", l).group(1) for l in lines] == [
      "3", "6", "9", "12", "15", "18", "21", "24", "25"]


def test_complete_prompts_scores_nothing(run, monkeypatch):
  def no_scoring(*args, **kwargs):
    raise AssertionError("scored")
  monkeypatch.setattr(pipeline, "make_eval_batches", no_scoring)
  monkeypatch.setattr(evaluate, "evaluate", no_scoring)
  result = evaluate.complete_prompts(str(run), ["def ", "x ="], max_new_tokens=3)
  assert [s["prompt"] for s in result["samples"]] == ["def ", "x ="]
  assert result["files"] == [str(run / "eval" / "step_2" / "generations.json")]
  saved = json.loads((run / "eval" / "step_2" / "generations.json").read_text())
  assert saved["samples"] == result["samples"] and saved["step"] == 2
  assert not list(run.rglob("eval_report.json"))


def test_eval_cli_prompt_alone_then_score_elsewhere(run, tmp_path):
  result = run_python(["eval.py", "--workdir", str(run), "--prompt", "def ",
                       "--max_new_tokens", "3"])
  assert result.returncode == 0, result.stderr
  assert "--- step 2, prompt 'def ':\ndef " in result.stdout
  assert " batches, " not in result.stderr  # no evaluation pass ran
  assert not list(run.rglob("eval_report.json"))
  before = snapshot(run)
  out = tmp_path / "elsewhere"
  result = run_python(["eval.py", "--workdir", str(run), "--prompt", "def ", "--max_new_tokens",
                       "3", "--score", "--out", str(out)])
  assert result.returncode == 0, result.stderr
  assert snapshot(run) == before  # no report, plot, tracker event or copy in the workdir
  report = json.loads((out / "eval_report.json").read_text())
  assert report["step"] == 2 and report["loss"] > 0
  assert [s["prompt"] for s in report["samples"]] == ["def "]
  total = _whole_split_batches(run)
  assert f"eval: {total}/{total} batches, " in result.stderr


def test_scoring_flags_without_score_are_refused(tmp_path):
  result = run_python(["eval.py", "--workdir", str(tmp_path), "--prompt", "def ",
                       "--seq_len", "64"])
  assert result.returncode == 2
  assert_one_line_error(result, "--seq_len is for scoring", "add --score")


@pytest.mark.parametrize("objective", ["mlm", "seq2seq", "classify"])
def test_prompts_of_a_run_that_does_not_complete_them_are_refused(objective):
  config = base.get_config()
  config.train.objective = objective
  with pytest.raises(UserError, match=f"--prompt: a {objective} run does not complete prompts"):
    evaluate._check_completes(config)  # pylint: disable=protected-access
