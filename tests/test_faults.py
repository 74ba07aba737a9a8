"""Nothing lost under faults: damaged checkpoints are skipped and moved aside,
never loaded; eval of a damaged step is one line; a second run on a live
workdir is refused; a run stopped by SIGINT or SIGTERM saves its step and
names its exit status; runs SIGKILLed at random moments (inside saves too)
and resumed end bit-identical to an uninterrupted run."""
import json
import os
import pathlib
import random
import resource
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache
import numpy as np
import pytest

from configs.errors import UserError
from training import loop
from training import workdir as workdir_lib
from training.faults import integrity
from tests.helpers import (assert_one_line_error, assert_trees_equal, final_params, ROOT,
                           run_python, small_config, snapshot, train_cmd)


def test_checksums_see_a_flipped_bit_or_two_swapped_words_anywhere():
  rng = np.random.default_rng(0)
  tree = {"f32": jnp.asarray(rng.normal(size=(7, 33)), jnp.float32),
          "bf16": jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.bfloat16),
          "i32": jnp.arange(11, dtype=jnp.int32), "scalar": jnp.int32(-1)}
  expected = integrity.fingerprints(tree)
  assert integrity.first_mismatch(expected, tree) is None
  for name, leaf in tree.items():
    words = np.asarray(leaf).copy().reshape(-1).view(f"u{leaf.dtype.itemsize}")
    for index in {0, words.size // 2, words.size - 1}:
      for bit in (0, 8 * leaf.dtype.itemsize - 1):
        flipped = words.copy()
        flipped[index] ^= 1 << bit
        damaged = dict(tree, **{name: jnp.asarray(flipped.view(leaf.dtype).reshape(leaf.shape))})
        assert integrity.first_mismatch(expected, damaged) == f"['{name}']"
    if words.size > 1 and words[0] != words[-1]:
      swapped = words.copy()
      swapped[[0, -1]] = swapped[[-1, 0]]
      damaged = dict(tree, **{name: jnp.asarray(swapped.view(leaf.dtype).reshape(leaf.shape))})
      assert integrity.first_mismatch(expected, damaged) == f"['{name}']"
  assert integrity.first_mismatch(expected, dict(tree, extra=jnp.zeros(2))) == "['extra']"


def fault_config(tok_dir: str, num_steps: int = 6):
  """The tiny run of test_train, checkpointed every 2 steps (the newest 3 kept)."""
  c = small_config(tok_dir)
  c.train.update(num_steps=num_steps, checkpoint_every=2, log_every=1, eval_every=1000,
                 eval_steps=1, keep_checkpoints=3)
  return c


@pytest.fixture(scope="module", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for this module's runs, in this process
  and in the train.py subprocesses: each run compiles the same steps, which
  would otherwise be most of its time. Switched off afterwards."""
  directory = str(tmp_path_factory.mktemp("compilation_cache"))
  settings = {"jax_compilation_cache_dir": directory,
              "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": 0}
  previous = {name: getattr(jax.config, name) for name in settings}
  env = {name.upper(): str(value) for name, value in settings.items()}
  with pytest.MonkeyPatch.context() as patch:
    for name, value in env.items():
      patch.setenv(name, value)
    for name, value in settings.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
    yield
    for name, value in previous.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def reference(tok_dir, tmp_path_factory):
  """An uninterrupted 6-step run (checkpoints 2, 4, 6)."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  loop.train(fault_config(tok_dir), str(workdir))
  return workdir


def copy_run(workdir, tmp_path) -> pathlib.Path:
  return pathlib.Path(shutil.copytree(workdir, tmp_path / "run"))


def largest_array_file(step_dir) -> pathlib.Path:
  """The biggest array data file of a checkpoint's state."""
  files = [p for p in (pathlib.Path(step_dir) / "state").rglob("*") if p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


def overwrite_64_bytes(step_dir) -> None:
  """Overwrites 64 bytes in the middle of the largest array file (a bit flip
  that the file format does not notice)."""
  path = largest_array_file(step_dir)
  with open(path, "r+b") as f:
    f.seek(path.stat().st_size // 2)
    f.write(bytes(64))


def swap_state(step_dir, other_step_dir) -> None:
  """Puts another checkpoint's state under this one (a mixed-up copy): every
  file reads cleanly, only the recorded checksums can tell."""
  shutil.rmtree(pathlib.Path(step_dir) / "state")
  shutil.copytree(pathlib.Path(other_step_dir) / "state", pathlib.Path(step_dir) / "state")


def test_damaged_newest_checkpoints_are_moved_aside_and_the_run_ends_identical(
    tok_dir, reference, tmp_path, capsys):
  run = copy_run(reference, tmp_path)
  checkpoints = run / "checkpoints"
  swap_state(checkpoints / "6", checkpoints / "2")
  os.remove(checkpoints / "4" / "state" / "_METADATA")
  files_6 = sorted(str(p.relative_to(checkpoints / "6")) for p in (checkpoints / "6").rglob("*"))
  # The lock of a run that was SIGKILLed on a node that is gone.
  (run / "lock").write_text(json.dumps({"host": "gone-node", "pid": 4242, "since": "then"}))
  capsys.readouterr()
  loop.train(fault_config(tok_dir), str(run))

  err = capsys.readouterr().err
  assert "took over the lock" in err and "host gone-node, PID 4242, since then" in err
  lines = [l for l in err.splitlines() if "is damaged" in l]
  assert len(lines) == 2, err
  assert lines[0].startswith(f"resume of {run}: checkpoint step 6 is damaged (checksum "
                             "mismatch in state[")
  assert lines[0].endswith("; moved aside to checkpoints/6.damaged; using step 2")
  assert lines[1].startswith(f"resume of {run}: checkpoint step 4 is damaged (")
  assert lines[1].endswith("; moved aside to checkpoints/4.damaged; using step 2")
  # Moved aside whole, never deleted; steps 4 and 6 written again.
  assert sorted(str(p.relative_to(checkpoints / "6.damaged"))
                for p in (checkpoints / "6.damaged").rglob("*")) == files_6
  assert {"2", "4", "6", "4.damaged", "6.damaged"} <= set(os.listdir(checkpoints))
  assert_trees_equal(final_params(run)[1], final_params(reference)[1])
  assert json.loads((run / "lock").read_text() or "{}") == {}  # released at the end


def test_no_intact_checkpoint_is_one_line_and_moves_nothing(tok_dir, reference, tmp_path):
  run = copy_run(reference, tmp_path)
  overwrite_64_bytes(run / "checkpoints" / "6")
  os.remove(largest_array_file(run / "checkpoints" / "4"))
  (run / "checkpoints" / "2" / "data" / "process_0-of-1.json").write_text("{")
  before = snapshot(run / "checkpoints")
  with pytest.raises(UserError) as error:
    loop.train(fault_config(tok_dir), str(run))
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"resume of {run}: no checkpoint in {run / 'checkpoints'} "
                            "restores whole: checkpoint step 6 is damaged (")
  assert "step 4 is damaged (" in message and "step 2 is damaged (JSONDecodeError" in message
  assert "nothing was moved or deleted" in message and "TensorStore(" not in message
  assert snapshot(run / "checkpoints") == before


def test_eval_skips_a_damaged_newest_checkpoint_and_refuses_a_damaged_step(
    reference, tmp_path, capsys):
  run = copy_run(reference, tmp_path)
  swap_state(run / "checkpoints" / "6", run / "checkpoints" / "4")
  capsys.readouterr()
  step = workdir_lib.load_run(str(run))[3]
  assert step == 4
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"eval of {run}: checkpoint step 6 is damaged (checksum mismatch")
  assert err.endswith("; using step 4") and "\n" not in err
  assert (run / "checkpoints" / "6").is_dir()  # eval only reads
  result = run_python(["eval.py", "--workdir", str(run), "--step", "6"])
  assert result.returncode == 2
  assert_one_line_error(result, f"eval of {run}: checkpoint step 6 is damaged (checksum",
                        "evaluate another step (available: 2, 4, 6)")


@pytest.fixture
def file_size_limit():
  """`limit(n)`: files of this process cannot grow past n bytes (writes fail
  with EFBIG, "File too large", as on a full disk); lifted afterwards."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
  resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  signal.signal(signal.SIGXFSZ, previous)


def test_failed_save_names_the_cause_keeps_every_checkpoint_and_resumes(
    tok_dir, reference, tmp_path, file_size_limit):
  run = copy_run(reference, tmp_path)
  shutil.rmtree(run / "checkpoints" / "6")  # a run stopped at step 4
  before = snapshot(run / "checkpoints")
  c = fault_config(tok_dir)
  # Below the size of the checkpoint's data files (tensorstore splits its
  # ~250 KB into a few files of 40 to 160 KB), above the small metadata and
  # metrics files.
  file_size_limit(30_000)
  with pytest.raises(UserError) as error:
    loop.train(c, str(run))
  file_size_limit(resource.RLIM_INFINITY)
  assert str(error.value) == (
      f"saving checkpoint step 6 in {run / 'checkpoints'} failed (File too large (errno 27)); "
      "step 4 is the last good checkpoint; fix the cause (disk space, permissions) and run "
      "the same command to resume")
  after = snapshot(run / "checkpoints")
  assert {k: v for k, v in after.items() if not k.startswith("6.")} == before
  loop.train(c, str(run))  # the same command, once the disk has room
  assert_trees_equal(final_params(run)[1], final_params(reference)[1])


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_its_step_and_the_same_config_resumes_identical(
    tok_dir, reference, tmp_path, monkeypatch, capsys, sig, status):
  """SIGINT (Ctrl-C) or SIGTERM at step 3 saves step 3 (between the checkpoints
  of 2 and 4) and stops with 128 + the signal for train.py's exit status;
  training again ends as the uninterrupted run did."""
  write = loop.MetricsWriter.write

  def write_then_signal(self, step, split, scalars):
    write(self, step, split, scalars)
    if (step, split) == (3, "train"):
      os.kill(os.getpid(), sig)  # Python runs the handler before this returns

  monkeypatch.setattr(loop.MetricsWriter, "write", write_then_signal)
  c, run = fault_config(tok_dir), tmp_path / "run"
  with pytest.raises(loop.Stopped) as stopped:
    loop.train(c, str(run))
  assert (stopped.value.exit_status, stopped.value.step) == (status, 3)
  assert (f"{sig.name} received: saved step 3; exit status {status}. Resume with the same "
          "command: ") in capsys.readouterr().out
  assert _committed(run / "checkpoints") == [2, 3]
  monkeypatch.setattr(loop.MetricsWriter, "write", write)
  loop.train(c, str(run))
  assert_trees_equal(final_params(run)[1], final_params(reference)[1])


def test_a_process_stopped_by_anothers_signal_takes_its_exit_status(monkeypatch):
  """Of several processes, one without a signal stops with the signal of the
  lowest process that got one, at the steps where they agree (every 5)."""
  monkeypatch.setattr(loop.jax, "process_count", lambda: 3)
  gathered = []
  monkeypatch.setattr(loop.multihost_utils, "process_allgather",
                      lambda mine: gathered.append(int(mine)) or np.array([0, 15, 2]))
  stop = loop.StopRequest(5, on_startup_signal=None)
  assert not stop.should_stop(3) and not gathered  # no collective between
  assert stop.should_stop(5) and gathered == [0]
  assert (stop.signal_name, stop.exit_status) == ("SIGTERM (on another process)", 143)


@pytest.mark.slow
def test_second_run_is_refused_and_the_live_run_ends_identical(tok_dir, reference, tmp_path):
  c, run = fault_config(tok_dir), tmp_path / "run"
  live = subprocess.Popen(train_cmd(c, run), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _second_run_is_refused(c, run, live)
  _, err = live.communicate(timeout=300)
  assert live.returncode == 0, err
  assert_trees_equal(final_params(run)[1], final_params(reference)[1])


# Chaos: SIGKILLs at random moments, several inside asynchronous saves.

def _saves_in_progress(checkpoints) -> list[str]:
  if not checkpoints.is_dir():
    return []
  return [n for n in os.listdir(checkpoints) if ".orbax-checkpoint-tmp" in n]


def _lock_held(workdir) -> bool:
  lock = workdir / "lock"
  return lock.exists() and lock.stat().st_size > 0


def _second_run_is_refused(c, workdir, live) -> None:
  """A second train.py on the workdir of `live` (held still meanwhile) is
  refused in one line naming the holder."""
  deadline = time.time() + 120
  while not _lock_held(workdir) and live.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  live.send_signal(signal.SIGSTOP)
  try:
    second = run_python(train_cmd(c, workdir)[1:])
  finally:
    live.send_signal(signal.SIGCONT)
  assert_one_line_error(second, f"{workdir} is in use by another run", f"PID {live.pid},",
                        "since")


def _committed(checkpoints) -> list[int]:
  return sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit()) \
      if checkpoints.is_dir() else []


def _kill_inside_save(proc, checkpoints, step: int) -> None:
  """SIGKILLs `proc` as soon as its save of `step` is in progress."""
  while proc.poll() is None:
    if any(n.startswith(f"{step}.orbax-checkpoint-tmp") for n in _saves_in_progress(checkpoints)):
      break
    time.sleep(0.002)
  proc.send_signal(signal.SIGKILL)


def _kill_after_step(proc, step: int, delay: float) -> None:
  """SIGKILLs `proc` `delay` seconds after it logged `step` (log_every=1)."""
  for line in proc.stdout:
    if line.startswith(f"step {step}/"):
      break
  time.sleep(delay)
  proc.send_signal(signal.SIGKILL)


def chaos(c, workdir, kills: int, seed: int) -> dict:
  """Trains `c` in `workdir`, SIGKILLing it `kills` times and resuming each time.

  The kills cycle through three moments: inside a save (the second save of the
  run, so that one commits, or its last one); during training, up to 50 ms
  after a random step before its third save; at a random moment of the start-up (imports, compiling,
  restoring). After every third kill the newest checkpoint is damaged (64
  bytes overwritten, or its state's _METADATA removed) when an older one
  remains. The first start also checks that a second run on the live workdir
  is refused. Returns the counts of kills, of kills inside saves and of damages.
  """
  rng = random.Random(seed)
  checkpoints = workdir / "checkpoints"
  every, total = c.train.checkpoint_every, c.train.num_steps
  counts = {"kills": 0, "inside_saves": 0, "damaged": 0}
  startup = 5.0  # seconds to the first step; measured by the first run
  while True:
    resume = max(_committed(checkpoints), default=0)
    proc = subprocess.Popen(train_cmd(c, workdir), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    began = time.time()
    if counts["kills"] == 0:
      _second_run_is_refused(c, workdir, proc)
      began = time.time()
    saves_left = (total - resume) // every
    moment = counts["kills"] % 3
    if counts["kills"] < kills and saves_left:
      if moment == 0:
        _kill_inside_save(proc, checkpoints, resume + every * min(saves_left, 2))
        if counts["kills"] == 0:
          startup = time.time() - began
      elif moment == 1:
        _kill_after_step(proc, rng.randrange(resume + 1, min(total, resume + 3 * every)),
                         rng.uniform(0.0, 0.05))
      else:
        time.sleep(rng.uniform(0.0, 0.9 * startup))
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    if proc.returncode == 0:
      return counts
    assert proc.returncode == -signal.SIGKILL, err
    assert "Traceback" not in err, err
    counts["kills"] += 1
    counts["inside_saves"] += bool(_saves_in_progress(checkpoints))
    steps = _committed(checkpoints)
    if counts["kills"] % 3 == 0 and len(steps) > 1:
      if counts["damaged"] % 2 == 0:
        overwrite_64_bytes(checkpoints / str(steps[-1]))
      else:
        os.remove(checkpoints / str(steps[-1]) / "state" / "_METADATA")
      counts["damaged"] += 1


@pytest.mark.slow  # over a minute on 2 CPU cores: make test-slow
def test_chaos_two_kills_end_identical(tok_dir, reference, tmp_path):
  """The fast variant: one kill inside a save, one during training."""
  run = tmp_path / "run"
  counts = chaos(fault_config(tok_dir), run, kills=2, seed=0)
  assert counts["kills"] == 2 and counts["inside_saves"] >= 1, counts
  assert_trees_equal(final_params(run)[1], final_params(reference)[1])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 21 starts of train.py
def test_chaos_twenty_kills_end_identical(tok_dir, tmp_path):
  """20 kills (7 inside saves, 7 during training, 6 during start-up) and up to
  6 damaged newest checkpoints, in an 80-step run (long enough that it does
  not end before its 20th kill)."""
  c = fault_config(tok_dir, num_steps=80)
  straight = tmp_path / "straight"
  loop.train(c, str(straight))
  run = tmp_path / "run"
  counts = chaos(c, run, kills=20, seed=1)
  print(f"chaos: {counts}")  # shown by pytest -s
  assert counts["kills"] == 20 and counts["inside_saves"] >= 5 and counts["damaged"] >= 3, counts
  assert_trees_equal(final_params(run)[1], final_params(straight)[1])
