"""eval.py does what it is asked: --prompt alone only completes the prompts
(nothing scored, eval_report.json untouched), --score scores as well, --out
leaves the workdir as it was, and a whole-split pass counts its batches.
Stopped by SIGINT or SIGTERM it exits 130 or 143 with one line, its outputs
never partly written (staged, then moved into place)."""
import json
import re
import shlex
import signal
import subprocess
import sys

import pytest

from configs import base
from configs.errors import UserError
from data import pipeline
from training import evaluate, loop, metrics
from training import workdir as workdir_lib
from tests.helpers import ROOT, assert_one_line_error, run_python, small_config, snapshot

PROGRESS = re.compile(r"eval: \d+/\d+ batches, ")


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


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_eval_leaves_the_previous_outputs_as_they_were(run, tmp_path, stop):
  """SIGINT on eval.py of the workdir, SIGTERM on eval.py --out into a folder
  holding a previous evaluation and a file of the user's: exit 128 + the
  signal, one line after the progress lines and no traceback, and every file
  as it was (no report, plot or top-level copy replaced, no temporary folder
  left)."""
  out = tmp_path / "elsewhere"
  args = ["eval.py", "--workdir", str(run)] + ["--out", str(out)] * (stop == signal.SIGTERM)
  evaluate.run_eval(str(run), max_new_tokens=2, out=str(out) if "--out" in args else None)
  if "--out" in args:
    (out / "mine.txt").write_text("not eval.py's")
  before = _files(tmp_path)
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:  # until the scoring pass is under way
    lines.append(line)
    if PROGRESS.match(line):
      break
  proc.send_signal(stop)
  _, err = proc.communicate(timeout=60)
  lines += err.splitlines(True)
  assert proc.returncode == 128 + stop, "".join(lines)
  assert "Traceback" not in "".join(lines)
  last = max(i for i, line in enumerate(lines) if PROGRESS.match(line))
  kept = out if "--out" in args else run
  assert [line.rstrip("\n") for line in lines[last + 1:]] == [
      f"{stop.name} while evaluating step 2: stopped, nothing written ({kept} as it was); run "
      f"the same command again: {shlex.join(['python', *args])}"]
  assert _files(tmp_path) == before


def _files(directory) -> dict:
  """Every path under `directory`, a file's with its size and time (a folder's
  time changes as a temporary folder is made and removed in it)."""
  return {path: stat if (directory / path).is_file() else None
          for path, stat in snapshot(directory).items()}


def test_staged_outputs_replace_the_folder_whole_at_the_commit(tmp_path):
  """Nothing moves before the commit; then the folder is replaced (what the
  evaluation did not write carried over), the top-level files follow, and no
  temporary folder stays."""
  workdir = tmp_path / "run"
  folder = workdir / "eval" / "step_2"
  folder.mkdir(parents=True)
  (folder / "eval_report.json").write_text("old")
  (folder / "generations.json").write_text("kept")
  with evaluate.Staged(str(folder), str(workdir), "evaluating step 2") as staged:
    report = staged.path("eval_report.json")
    with open(report, "w", encoding="utf-8") as f:
      f.write("new")
    png = staged.top_path("loss_by_position_64.png")
    with open(png, "wb") as f:
      f.write(b"png")
    staged.later(lambda: (workdir / "eval_lengths.json").write_text("{}"))
    assert (folder / "eval_report.json").read_text() == "old"
    assert sorted(p.name for p in workdir.iterdir()) == ["eval"]
    files = staged.commit([report, png])
  assert files == [str(folder / "eval_report.json"), str(workdir / "loss_by_position_64.png")]
  assert {p.name: p.read_text() for p in folder.iterdir()} == {"eval_report.json": "new",
                                                              "generations.json": "kept"}
  assert sorted(p.name for p in workdir.iterdir()) == [
      "eval", "eval_lengths.json", "loss_by_position_64.png"]
  assert [p.name for p in (workdir / "eval").iterdir()] == ["step_2"]


def test_staged_outputs_of_a_failed_evaluation_leave_nothing(tmp_path):
  """An error before the commit removes what was staged, with the folders
  made to hold it; a file where the folder goes is refused in one line."""
  with pytest.raises(UserError, match="boom"):
    with evaluate.Staged(str(tmp_path / "a" / "b" / "out"), None, "evaluating step 2") as staged:
      with open(staged.path("eval_report.json"), "w", encoding="utf-8") as f:
        f.write("{}")
      raise UserError("boom")
  assert not list(tmp_path.iterdir())
  (tmp_path / "out").write_text("")
  with pytest.raises(UserError, match=f"^{tmp_path / 'out'} is a file, and eval.py writes a "
                                      "folder there; give --out a directory"):
    evaluate.Staged(str(tmp_path / "out"), None, "evaluating step 2")


def test_a_signal_inside_a_held_block_exits_at_its_end():
  """training.interrupts: the line and 128 + the signal at once outside
  `held`, at its end inside (the block finishes), and the quiet exit once
  the status is decided."""
  code = """
import os, signal
from training import interrupts
interrupts.exit_on_signal(lambda name: f"{name} at start-up")
interrupts.on_signal(lambda name: f"{name} while moving", lambda: print("cleaned", flush=True))
with interrupts.held():
  os.kill(os.getpid(), signal.SIGNAL)
  print("moved", flush=True)
print("not reached")
"""
  for name, status in (("INT", 130), ("TERM", 143)):
    result = subprocess.run([sys.executable, "-c", code.replace("SIGNAL", f"SIG{name}")],
                            cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (
        status, "moved\ncleaned\n", f"SIG{name} while moving\n")
  quiet = subprocess.run([sys.executable, "-c", """
import os, signal
from training import interrupts
interrupts.exit_on_signal(lambda name: "not said")
interrupts.exit_quietly(0)
os.kill(os.getpid(), signal.SIGINT)
print("not reached")
"""], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
  assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
