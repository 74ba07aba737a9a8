"""End-to-end training: loss falls, exact resume after SIGKILL, SIGTERM (exit
143), NaN, leftover temporary checkpoints, train.restore_from, and one-line
errors for bad input."""
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs.errors import UserError
import tokenizer as tokenizer_lib
from data import sources
from training import loop
from training.checkpoint import Checkpointer
from training.workdir import default_workdir
from tests.helpers import (assert_one_line_error, assert_trees_equal, final_params, ROOT,
                           run_python, small_config, snapshot, train_cmd)

def test_loss_falls_on_the_embedded_corpus(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.update(num_steps=60, eval_every=60, learning_rate=1e-2)
  last = loop.train(c, str(tmp_path / "run"))
  assert last["val2_loss"] < 5.0  # log(300) = 5.70 for a uniform guess
  records = [r for r in __import__("training.metrics", fromlist=["x"]).read_metrics(
      str(tmp_path / "run")) if r["split"] == "train"]
  assert records[-1]["loss"] < records[0]["loss"] - 0.5


def test_sigkill_then_resume_is_bit_identical(tok_dir, tmp_path):
  c = small_config(tok_dir)
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  subprocess.run(train_cmd(c, straight), cwd=ROOT, check=True, capture_output=True)
  proc = subprocess.Popen(train_cmd(c, killed), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not (killed / "checkpoints" / "10").exists() and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  subprocess.run(train_cmd(c, killed), cwd=ROOT, check=True, capture_output=True)
  step_a, params_a = final_params(straight)
  step_b, params_b = final_params(killed)
  assert step_a == step_b == 30
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_saves_exits_143_and_resumes(tok_dir, tmp_path):
  """SIGTERM (SLURM's) saves the step and exits 128 + 15, so that a stopped run
  does not look finished; the resumed run that finishes exits 0."""
  c = small_config(tok_dir)
  c.train.update(num_steps=100_000, checkpoint_every=100_000, log_every=100_000,
                 eval_every=100_000)
  workdir = tmp_path / "run"
  proc = subprocess.Popen(train_cmd(c, workdir), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not (workdir / "metrics.jsonl").exists() and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(2)  # the handler is installed right after metrics.jsonl is opened
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err
  assert "Traceback" not in err, err
  assert "SIGTERM received: saved step" in out
  assert "; exit status 143. Resume with the same command" in out
  saved = Checkpointer(str(workdir), asynchronous=False).latest_step()
  assert 0 < saved < 100_000
  c.train.num_steps = saved + 3
  result = subprocess.run(train_cmd(c, workdir), cwd=ROOT, capture_output=True, text=True,
                          check=True)
  assert f"restored    step {saved} of {workdir}, resuming to {saved + 3}" in result.stdout
  assert final_params(workdir)[0] == saved + 3


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tok_dir, tmp_path, monkeypatch):
  real = loop.jit_train_step

  def poisoned(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def step(state, batch):
      if int(state["step"]) == 12:  # the 13th step
        batch = {**batch, "loss_mask": batch["loss_mask"] * np.nan}
      return step_fn(state, batch)
    return step

  monkeypatch.setattr(loop, "jit_train_step", poisoned)
  workdir = tmp_path / "run"
  with pytest.raises(UserError, match="NaN/Inf at step 13"):
    loop.train(small_config(tok_dir), str(workdir))
  ck = Checkpointer(str(workdir), asynchronous=False)
  assert ck.latest_step() == 10
  step, params = final_params(workdir)
  assert step == 10 and all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))


def test_leftover_temporary_checkpoint_is_ignored(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.num_steps = 10
  workdir = tmp_path / "run"
  loop.train(c, str(workdir))
  junk = workdir / "checkpoints" / "15.orbax-checkpoint-tmp-1234"
  junk.mkdir()
  (junk / "half_written").write_text("x")
  c.train.num_steps = 12
  loop.train(c, str(workdir))
  assert Checkpointer(str(workdir), asynchronous=False).all_steps()[-1] == 12


@pytest.mark.parametrize("flags,fragments", [
    (["--config.model.colour=red"], ["colour"]),
    (["--config.model.pos_emb=xpos"], ["model.pos_emb='xpos'", "must be one of"]),
    (["--config.data.source=files", "--config.data.paths=/nonexistent/*.txt"],
     ["/nonexistent/*.txt", "no file matches"]),
    (["--config.model.pos_emb=learned", "--config.train.seq_len=100"],
     ["train.seq_len=100", "learned position table"]),
])
def test_bad_training_input_is_one_line(tok_dir, tmp_path, flags, fragments):
  c = small_config(tok_dir)
  result = run_python(train_cmd(c, tmp_path / "run")[1:] + flags)
  assert_one_line_error(result, *fragments)


def test_workdir_defaults_to_runs_and_the_config_file_stem(tmp_path):
  """`python train.py --config configs/gpt2_small.py` (no --workdir) runs in
  runs/gpt2_small and says so; here it stops at an invalid override, before
  anything is written, to stay fast."""
  result = subprocess.run(
      [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/gpt2_small.py"),
       "--config.train.num_steps=0"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.stdout.splitlines()[0] == "workdir: runs/gpt2_small (no --workdir given)"
  assert result.returncode == 2
  assert result.stderr.strip() == ("error: config field train.num_steps=0: must be a positive "
                                   "integer")
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("config_path,workdir", [
    ("configs/gpt2_small.py", "runs/gpt2_small"), ("/abs/dir/my.exp.py", "runs/my.exp"),
    ("tiny.py:small", "runs/tiny")])
def test_default_workdir(config_path, workdir):
  assert default_workdir(config_path) == workdir


def test_empty_data_is_one_line(tok_dir, tmp_path):
  (tmp_path / "empty.txt").write_text("   \n")
  c = small_config(tok_dir)
  result = run_python(train_cmd(c, tmp_path / "run")[1:] + [
      "--config.data.source=files", f"--config.data.paths={tmp_path}/empty.txt"])
  assert_one_line_error(result, "no non-empty documents")


def test_eval_on_empty_workdir_is_one_line(tmp_path):
  (tmp_path / "run").mkdir()
  result = run_python(["eval.py", "--workdir", str(tmp_path / "run")])
  assert_one_line_error(result, "not a run directory")


def test_eval_report_and_wrong_tokenizer(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.num_steps = 10
  workdir = tmp_path / "run"
  loop.train(c, str(workdir))
  result = run_python(["eval.py", "--workdir", str(workdir), "--max_new_tokens", "5"])
  assert result.returncode == 0, result.stderr
  import json  # pylint: disable=import-outside-toplevel
  report = json.loads((workdir / "eval_report.json").read_text())
  for key in ("step", "loss", "perplexity", "token_accuracy", "bits_per_byte", "samples"):
    assert key in report
  assert report["step"] == 10 and report["bits_per_byte"] > 0
  assert (workdir / "eval" / "step_10" / "loss_curves.png").stat().st_size > 0
  assert (workdir / "eval" / "step_10" / "attention_maps.png").stat().st_size > 0
  other = tmp_path / "other_tok"
  texts = [t for _, t in sources.iter_documents(c.data, "train")][:50]
  tokenizer_lib.train_tokenizer("bpe", 290, texts).save(other)
  result = run_python(["eval.py", "--workdir", str(workdir), "--tokenizer", str(other)])
  assert_one_line_error(result, "trained with tokenizer")


def test_resuming_with_other_shapes_is_refused(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.num_steps = 5
  loop.train(c, str(tmp_path / "run"))
  c.model.d_model = 64
  with pytest.raises(UserError, match="other shapes: model.d_model=32 \\(now 64\\)"):
    loop.train(c, str(tmp_path / "run"))


# train.restore_from: a new run starts from another workdir's newest parameters,
# with a fresh optimizer state and step 0; only a run without a checkpoint of
# its own restores (running the same command again resumes it).

@pytest.fixture(scope="module")
def source_run(tok_dir, tmp_path_factory):
  """A 3-step run to restore from (its last checkpoint is step 3)."""
  c = small_config(tok_dir)
  c.train.update(num_steps=3, eval_steps=1)
  workdir = tmp_path_factory.mktemp("source") / "run"
  loop.train(c, str(workdir))
  return workdir


def record_steps(monkeypatch) -> list:
  """(state before, state after) of every train step from now on, copied to the host."""
  real = loop.jit_train_step
  calls = []

  def recording(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def step(state, batch):
      before = jax.device_get(state)  # copied now: step_fn donates `state`
      new_state, metrics = step_fn(state, batch)
      calls.append((before, jax.device_get(new_state)))
      return new_state, metrics
    return step

  monkeypatch.setattr(loop, "jit_train_step", recording)
  return calls


def test_restore_from_starts_from_the_source_parameters_with_a_fresh_optimizer(
    tok_dir, source_run, tmp_path, monkeypatch):
  step, source_final = final_params(source_run)
  assert step == 3
  # A save of the source in progress (it may still be training): left alone.
  (source_run / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir(exist_ok=True)
  before = snapshot(source_run)
  c = small_config(tok_dir)
  c.train.update(seed=1, num_steps=1, eval_steps=1, restore_from=str(source_run))
  calls = record_steps(monkeypatch)
  loop.train(c, str(tmp_path / "run"))

  (first, _), (_, last) = calls[0], calls[-1]
  assert int(first["step"]) == 0
  assert len(jax.tree.leaves(first["params"])) == len(jax.tree.leaves(source_final))
  for x, y in zip(jax.tree.leaves(first["params"]), jax.tree.leaves(source_final)):
    np.testing.assert_array_equal(x, np.asarray(y))
  opt_leaves = jax.tree.leaves(first["opt_state"])
  assert opt_leaves and not any(np.any(x) for x in opt_leaves)  # Adam moments, counts: 0
  assert Checkpointer(str(tmp_path / "run"), asynchronous=False).latest_step() == 1
  assert snapshot(source_run) == before

  # The same command again resumes this run (step 1), not the source.
  calls.clear()
  c.train.num_steps = 2
  loop.train(c, str(tmp_path / "run"))
  assert int(calls[0][0]["step"]) == 1
  assert_trees_equal(calls[0][0]["params"], last["params"])
  assert_trees_equal(calls[0][0]["opt_state"], last["opt_state"])


@pytest.mark.parametrize("case,message", [
    ("missing", "not a run directory"),
    ("checkpoints_dir", "not a run directory"),
    ("never_saved", "it has no checkpoint"),
    ("other_d_model", "its parameters have other shapes"),
])
def test_bad_restore_from_is_one_line_and_writes_nothing(tok_dir, source_run, tmp_path, case,
                                                         message):
  (tmp_path / "never_saved").mkdir()  # a run dir without a checkpoint
  (tmp_path / "never_saved" / "config.json").write_text((source_run / "config.json").read_text())
  path = {"missing": tmp_path / "missing", "checkpoints_dir": source_run / "checkpoints",
          "never_saved": tmp_path / "never_saved", "other_d_model": source_run}[case]
  before = snapshot(source_run), snapshot(tmp_path)
  c = small_config(tok_dir)
  if case == "other_d_model":
    c.model.d_model = 64
  c.train.update(num_steps=2, restore_from=str(path))
  with pytest.raises(UserError) as error:
    loop.train(c, str(tmp_path / "new"))
  assert str(error.value).startswith(f"train.restore_from={str(path)!r}: {message}")
  assert "\n" not in str(error.value)
  assert not (tmp_path / "new").exists()
  assert (snapshot(source_run), snapshot(tmp_path)) == before


def test_restore_from_without_tokenizer_path_uses_the_source_tokenizer(source_run, tmp_path,
                                                                        monkeypatch):
  def train_tokenizer(*args, **kwargs):
    raise AssertionError("the new run trained a tokenizer of its own")
  monkeypatch.setattr(tokenizer_lib, "train_tokenizer", train_tokenizer)
  c = small_config("")  # no tokenizer.path
  c.train.update(num_steps=1, eval_steps=1, restore_from=str(source_run))
  loop.train(c, str(tmp_path / "run"))

  expected = tokenizer_lib.load_tokenizer(source_run / "tokenizer").fingerprint
  assert tokenizer_lib.load_tokenizer(tmp_path / "run" / "tokenizer").fingerprint == expected
  checkpointer = Checkpointer(str(tmp_path / "run"), asynchronous=False, read_only=True)
  assert checkpointer.restore_meta(1)["tokenizer_fingerprint"] == expected
  checkpointer.close()


@pytest.mark.parametrize("case,message", [
    ("tokenizer_path", "but tokenizer.path='.*' is [0-9a-f]{12}; leave tokenizer.path empty"),
    ("workdir_tokenizer", "new/tokenizer is another tokenizer than the one its parameters were "
                          "trained with"),
])
def test_restore_from_with_another_tokenizer_is_one_line_and_writes_nothing(
    tok_dir, source_run, tmp_path, case, message):
  texts = [t for _, t in sources.iter_documents(small_config("").data, "train")][:5]
  other = tokenizer_lib.train_tokenizer("bpe", 270, texts)
  c = small_config(tok_dir)
  if case == "tokenizer_path":
    c.tokenizer.path = str(other.save(tmp_path / "other_tok"))
  else:  # a workdir that holds another tokenizer and no checkpoint
    other.save(tmp_path / "new" / "tokenizer")
  c.train.update(num_steps=1, restore_from=str(source_run))
  before = snapshot(source_run), snapshot(tmp_path)
  with pytest.raises(UserError, match=message) as error:
    loop.train(c, str(tmp_path / "new"))
  assert "\n" not in str(error.value)
  assert (snapshot(source_run), snapshot(tmp_path)) == before


def test_eval_only_reads_the_checkpoints(source_run):
  """eval of a run that may be training: its save in progress (a temporary
  directory) stays, and nothing in checkpoints/ is created or changed."""
  from training import evaluate  # pylint: disable=import-outside-toplevel
  (source_run / "checkpoints" / "8.orbax-checkpoint-tmp-2").mkdir(exist_ok=True)
  (source_run / "checkpoints" / "8.orbax-checkpoint-tmp-2" / "part").write_text("in progress")
  before = snapshot(source_run / "checkpoints")
  report = evaluate.run_eval(str(source_run), max_new_tokens=2, prompts=["def "])
  assert report["step"] == 3
  assert snapshot(source_run / "checkpoints") == before


def test_restore_from_casts_the_parameters_to_this_runs_param_dtype(tok_dir, source_run, tmp_path,
                                                                     monkeypatch):
  _, source_final = final_params(source_run)
  c = small_config(tok_dir)
  c.model.param_dtype = "bfloat16"  # the source trained in float32
  c.train.update(num_steps=1, eval_steps=1, restore_from=str(source_run))
  calls = record_steps(monkeypatch)
  loop.train(c, str(tmp_path / "run"))

  first = jax.tree.leaves(calls[0][0]["params"])
  source = jax.tree.leaves(source_final)
  assert len(first) == len(source)
  for x, y in zip(first, source):
    assert y.dtype == np.float32 and x.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(x, np.asarray(y).astype(jax.numpy.bfloat16))
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(calls[0][1]["params"]))
