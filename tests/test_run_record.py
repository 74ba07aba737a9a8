"""Runs a researcher can trust: the config record and its history on resume,
the memory pre-flight, start-up signals, the start-up summary and `step k/N`
(its ETA without compilation), eval reports per step, sweeps of a changed
config, and the one-line errors."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from configs import base, validation
from configs.errors import UserError
from training import evaluate, loop, workdir as workdir_lib
import sweeps as sweep_lib
from tests.helpers import ROOT, overrides, small_config


def _config(tok_dir, **train):
  c = small_config(tok_dir)
  c.train.update(**{"num_steps": 2, "warmup_steps": 1, "log_every": 1, "eval_steps": 1,
                    "checkpoint_every": 2, **train})
  return c


def test_resume_records_safe_changes_and_refuses_others(tok_dir, tmp_path):
  workdir = str(tmp_path / "run")
  loop.train(_config(tok_dir), workdir)
  changed = _config(tok_dir, learning_rate=1e-4)
  with pytest.raises(UserError) as e:
    loop.train(changed, workdir)
  assert str(e.value) == (
      f"{workdir} was trained with another config: train.learning_rate 0.003 -> 0.0001; use a "
      "new --workdir, or resume with these changes recorded in its config_history.jsonl: "
      "--config.train.allow_config_changes=True")
  assert workdir_lib.load_config(workdir).train.learning_rate == 3e-3
  longer = _config(tok_dir, num_steps=4)
  loop.train(longer, workdir)
  longer.train.update(num_steps=6, learning_rate=1e-4, allow_config_changes=True)
  loop.train(longer, workdir)
  history = workdir_lib.read_history(workdir)
  assert [(h["step"], h["changes"], h["forced"]) for h in history] == [
      (2, [["train.num_steps", 2, 4]], False),
      (4, [["train.allow_config_changes", False, True], ["train.learning_rate", 0.003, 0.0001],
           ["train.num_steps", 4, 6]], True)]
  saved = workdir_lib.load_config(workdir).train
  assert (saved.num_steps, saved.learning_rate) == (6, 1e-4)
  assert loop.train(longer, workdir) == {}  # complete: no work, nothing recorded
  assert len(workdir_lib.read_history(workdir)) == 2
  report = evaluate.run_eval(workdir, max_new_tokens=1, prompts=["a"])
  assert report["config_history"][1].startswith("step 4: train.allow_config_changes False")


def test_a_run_saved_with_remat_true_resumes_under_its_policy_name(tok_dir, tmp_path):
  """train.remat=True (a bool, as runs saved it before the policies had names)
  resumes as remat=full: the same policy, so no change to refuse or record."""
  workdir = str(tmp_path / "run")
  loop.train(_config(tok_dir, remat=True), workdir)
  assert workdir_lib.load_config(workdir).train.remat is True
  loop.train(_config(tok_dir, remat="full", num_steps=4), workdir)
  assert [h["changes"] for h in workdir_lib.read_history(workdir)] == [
      [["train.num_steps", 2, 4]]]


def test_a_field_set_to_the_value_its_unset_default_means_is_no_change():
  saved = {"train": {"seed": 3}, "data": {"seed": None},
           "model": {"num_heads": 4, "num_kv_heads": None}}
  same = {"train": {"seed": 3}, "data": {"seed": 3}, "model": {"num_heads": 4, "num_kv_heads": 4}}
  assert workdir_lib.config_changes(saved, same) == []
  other = {"train": {"seed": 3}, "data": {"seed": 0}, "model": {"num_heads": 4, "num_kv_heads": 2}}
  assert workdir_lib.config_changes(saved, other) == [("data.seed", None, 0),
                                                      ("model.num_kv_heads", None, 2)]


def test_absurd_batch_is_refused_before_compiling(tok_dir, tmp_path):
  c = _config(tok_dir, batch_size=1_000_000)
  start = time.monotonic()
  with pytest.raises(UserError) as e:
    loop.train(c, str(tmp_path / "run"))
  assert time.monotonic() - start < 30
  message = str(e.value)
  assert message.startswith("this run needs about ") and "per device (batch 1000000 x " in message
  assert "host RAM available" in message and "--config.train.skip_memory_check=True" in message
  assert "--config.train.grad_accum_steps" in message
  assert not (tmp_path / "run").exists()


def test_out_of_memory_is_one_line(tok_dir):
  import jax  # pylint: disable=import-outside-toplevel
  error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 68 bytes")
  assert loop.startup.is_out_of_memory(error) and not loop.startup.is_out_of_memory(ValueError())
  message = str(loop.startup.out_of_memory(_config(tok_dir), 3 * 2**30))
  assert message.startswith("out of memory: batch 4 x sequence 32 (grad_accum 1), estimated "
                            "3.0 GiB per device, did not fit; shrink it with")


def _env():
  """The environment of `make train`: no JAX_PLATFORMS, nothing that finds libtpu."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH", "PYTHONPATH")}
  return env


def test_cli_summary_progress_and_no_libtpu_noise(tok_dir, tmp_path):
  """train.py --help and a 2-step run print nothing from libtpu (no TPU here),
  a start-up block and `step k/N` lines; a finished run re-run does nothing."""
  help_run = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=120)
  assert "--workdir" in help_run.stdout
  workdir = tmp_path / "run"
  cmd = [sys.executable, "train.py", "--config", "configs/base.py", "--workdir", str(workdir),
         *overrides(_config(tok_dir))]
  run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  for stderr in (help_run.stderr, run.stderr):
    assert "tpu" not in stderr.lower() and "E0000" not in stderr, stderr
  for head in ("devices ", "parameters ", "step        4 x 32 = 128 tokens", "memory      about ",
               "data        train ", f"workdir     {workdir}",
               "restored    nothing (new run from step 0)",
               "schedule    learning rate peaks at 0.003 at step 2/2\n"):
    assert head in run.stdout, run.stdout
  lines = run.stdout.splitlines()
  step_1 = next(l for l in lines if l.startswith("step 1/2: loss="))
  step_2 = next(l for l in lines if l.startswith("step 2/2: loss="))
  assert "eta=" not in step_1  # only the compiled step so far: no pace to go by
  assert step_2.endswith(", eta=0s"), step_2
  assert "step 2/2: val1_loss=" in run.stdout
  again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert again.stdout.strip() == (
      f"{workdir} is complete: trained 2/2 steps; nothing to do (evaluate it: python eval.py "
      f"--workdir {workdir}; train longer: --config.train.num_steps=<more>)")


class FakeClock:
  """time.perf_counter for `loop.Eta`: the seconds the test says have passed."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def test_the_eta_leaves_out_compilation_and_counts_validation_apart():
  """1000 steps of 0.1 s, validated every 100 steps (5 s a pass, 20 s the first,
  which compiles); step 1 compiles for 300 s."""
  clock = FakeClock()
  eta = loop.Eta(1000, lambda at: loop.validations_from(at, 100, 1000), clock=clock)
  clock.now = 300.1  # the compiled step
  assert eta.seconds_left(1) is None
  eta.start(1)
  assert eta.seconds_left(1) is None  # no step timed yet
  clock.now += 9 * 0.1
  assert eta.seconds_left(10) == pytest.approx(990 * 0.1)  # no validation timed yet
  clock.now += 90 * 0.1
  with eta.validation():  # at step 100
    clock.now += 20.0
  clock.now += 10 * 0.1
  assert eta.seconds_left(110) == pytest.approx(890 * 0.1 + 9 * 20.0)
  clock.now += 90 * 0.1
  with eta.validation():  # at step 200
    clock.now += 5.0
  clock.now += 100 * 0.1
  # steps 201..300 and the validation at 300 ahead of the step line, 8 passes in all
  assert eta.seconds_left(300) == pytest.approx(700 * 0.1 + 8 * 5.0)


def test_the_eta_of_a_resumed_run_starts_at_its_first_step():
  clock = FakeClock()
  eta = loop.Eta(600, lambda at: 0, clock=clock)
  clock.now = 50.0
  eta.start(401)  # resumed from 400; its first step compiled
  clock.now += 19 * 0.2
  assert eta.seconds_left(420) == pytest.approx(180 * 0.2)


@pytest.mark.parametrize("step,eval_every,num_steps,passes", [
    (1, 100, 1000, 10), (100, 100, 1000, 10), (101, 100, 1000, 9), (1000, 100, 1000, 1),
    (1, 100, 1050, 11), (1001, 100, 1050, 1), (1050, 100, 1050, 1), (3, 1, 5, 3),
])
def test_validations_from(step, eval_every, num_steps, passes):
  assert loop.validations_from(step, eval_every, num_steps) == passes
  assert passes == sum(1 for s in range(step, num_steps + 1)
                       if s % eval_every == 0 or s == num_steps)


def test_sigint_during_compilation_exits_at_once(tok_dir, tmp_path):
  workdir = tmp_path / "run"
  c = _config(tok_dir)
  c.model.update(num_layers=4)
  proc = subprocess.Popen(
      [sys.executable, "train.py", "--config", "configs/base.py", "--workdir", str(workdir),
       *overrides(c)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if line.startswith("restored "):  # the last line before the first step compiles
      break
  proc.send_signal(signal.SIGINT)
  sent = time.monotonic()
  _, err = proc.communicate(timeout=60)
  assert time.monotonic() - sent < 10
  assert proc.returncode == 130, err
  assert err.strip().endswith(f"SIGINT during start-up: stopped before training, {workdir} "
                              "removed")
  assert not workdir.exists()


def test_two_evals_of_two_steps_leave_two_reports(tok_dir, tmp_path):
  workdir = tmp_path / "run"
  loop.train(_config(tok_dir, num_steps=4), str(workdir))
  newest = evaluate.run_eval(str(workdir), step=4, max_new_tokens=1, prompts=["a"])
  older = evaluate.run_eval(str(workdir), step=2, max_new_tokens=1, prompts=["a"])
  for step, report in ((4, newest), (2, older)):
    saved = json.loads((workdir / "eval" / f"step_{step}" / "eval_report.json").read_text())
    assert saved["step"] == step and saved["loss"] == report["loss"]
    assert (workdir / "eval" / f"step_{step}" / "loss_curves.png").exists()
  assert json.loads((workdir / "eval_report.json").read_text())["step"] == 4  # the newest
  out = tmp_path / "elsewhere"
  evaluate.run_eval(str(workdir), step=2, max_new_tokens=1, prompts=["a"], out=str(out))
  assert json.loads((out / "eval_report.json").read_text())["step"] == 2
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert {r["batches"] for r in records if r["split"] == "validation"} == {1}


def test_a_warmup_longer_than_the_run_is_said(tok_dir):
  c = _config(tok_dir, num_steps=40, warmup_steps=100)
  line = loop.startup.schedule_line(c, loop.learning_rate_schedule(c.train))
  assert line == ("schedule    learning rate peaks at 0.00117 at step 40/40; warning: below "
                  "train.learning_rate=0.003, since train.warmup_steps=100 >= num_steps: lower "
                  "train.warmup_steps")


def test_eval_every_gives_ten_points_unless_set(tok_dir):
  c = _config(tok_dir, num_steps=200)
  c.train.eval_every = None
  assert validation.eval_every(c.train) == 20 and validation.eval_points(c.train) == 10
  c.train.eval_every = 200
  assert validation.eval_points(c.train) == 1


def test_changed_sweep_is_refused_and_status_says_changed(tmp_path):
  sweep_file = tmp_path / "lr.py"
  sweep_file.write_text('def get_sweep():\n  return {"model.pos_emb": ["rope"]}\n')
  root = tmp_path / "root"
  flags = ["--config.train.num_steps=200", "--config.train.eval_every=200"]
  variant, = sweep_lib.make_variants(sweep_lib.load_sweep(str(sweep_file)),
                                     str(ROOT / "configs" / "tiny.py"), flags, str(root))
  assert sweep_lib.few_points([variant])[0].startswith(
      "warning: pos_emb=rope validates 1 time(s) in training (train.eval_every=200 of "
      "num_steps=200)")
  os.makedirs(variant.workdir)
  trained = json.loads(json.dumps(variant.config))
  trained["train"]["learning_rate"] = 1e-4
  with open(os.path.join(variant.workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(trained, f)
  run = subprocess.run(
      [sys.executable, "sweep.py", "run", "--sweep", str(sweep_file), "--config",
       "configs/tiny.py", "--root", str(root), *flags], cwd=ROOT, capture_output=True,
      text=True, timeout=120)
  assert run.returncode == 2
  assert run.stderr.strip().splitlines()[-1] == (
      f"error: 1 variant(s) in {root} were trained with another config than this sweep asks "
      "for (pos_emb=rope: train.learning_rate 0.0001 -> 0.003); use a new --root, or "
      "--rerun_changed to retrain them in place (old workdirs kept as <name>.replaced<N>)")
  status = sweep_lib.status_lines(str(root))
  assert status[1].split()[:2] == ["changed", "pos_emb=rope"]
  assert sweep_lib.set_aside(sweep_lib.read_manifest(str(root))[1][0]).endswith(".replaced1")
  assert sweep_lib.status_lines(str(root))[1].split()[:3] == ["not", "started", "pos_emb=rope"]


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/tiny.py", "--num_steps=100"],
     "error: --num_steps: no such flag; the config field is --config.train.num_steps=100"),
    (["--config", "configs/nope.py"],
     "error: no such config file: configs/nope.py (the presets: configs/addition.py, "),
    (["--config", "configs/tiny.py", "--config.train.allow_config_changes=yes"],
     "error: --config.train.allow_config_changes=yes: expected a bool (true or false), got 'yes'"),
])
def test_flag_mistakes_are_one_line(args, message):
  run = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
  assert run.returncode == 2 and run.stderr.startswith(message), run.stderr
  assert len(run.stderr.strip().splitlines()) == 1


def test_damaged_config_and_missing_checkpoint_are_one_line(tok_dir, tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text("{not json")
  with pytest.raises(UserError, match=r"config.json is damaged \(not valid JSON: .*line 1\); "):
    workdir_lib.load_config(str(workdir))
  (workdir / "config.json").write_text(json.dumps(workdir_lib.config_to_dict(_config(tok_dir))))
  with pytest.raises(UserError, match=r"^eval of .*: no checkpoint in .*; train first"):
    workdir_lib.load_run(str(workdir))


def test_failed_start_leaves_no_workdir(tok_dir, tmp_path):
  corpus = tmp_path / "one.txt"
  corpus.write_text("too short")
  c = _config(tok_dir)
  c.data.update(source="files", paths=str(corpus))
  with pytest.raises(UserError, match="fewer than one row"):
    loop.train(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_resume_hint_is_the_real_command(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["train.py", "--config", "configs/tiny.py",
                                    "--config.train.learning_rate=1e-3"])
  assert loop.resume_command("runs/tiny") == ("python train.py --config configs/tiny.py "
                                              "--config.train.learning_rate=1e-3 --workdir "
                                              "runs/tiny")


def test_a_classifier_run_with_labels_from_its_data_is_not_changed(tmp_path):
  """train.py saves the labels it read from the data; a sweep that left
  data.labels empty asks for exactly those, so the run is not "changed"."""
  config = base.get_config().to_dict()
  os.makedirs(tmp_path / "run")
  trained = json.loads(json.dumps(config))
  trained["data"]["labels"] = ["asyncio", "email"]
  (tmp_path / "run" / "config.json").write_text(json.dumps(trained), encoding="utf-8")

  class Variant:
    workdir = str(tmp_path / "run")

  Variant.config = config
  assert sweep_lib.changed_fields(Variant) == []
  Variant.config = {**config, "data": {**config["data"], "labels": ["email"]}}
  assert [c[0] for c in sweep_lib.changed_fields(Variant)] == ["data.labels"]
