"""Sweeps on a real single-node SLURM cluster (scripts/local_slurm.py): a job
array that trains and evaluates, a bad variant that fails alone, a rerun that
skips what is done, a variant requeued by `scontrol requeue` and by its time
limit that ends with the parameters of an uninterrupted run, a 2-task job with
jax.distributed from SLURM's environment, the check of a request against
sinfo, and `data.prepare` as a job array. Run by `make test-slurm` (all `slow`: about 6 minutes
on 2 cores)."""
import csv
import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from data import corpora
import sweeps as sweep_lib
from tokenizer import train_tokenizer
from training.workdir import load_run
from sweeps.state import last_step
from scripts import local_slurm
from tests.helpers import ROOT, small_flags, sweep_cli, TINY, TWO_VARIANTS, write_sweep

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
FITS = ["--launcher", "slurm", "--gpus_per_node", "0", "--cpus_per_task", "1"]
BAD = {"train.restore_from": "/nonexistent/run"}  # valid config, fails in train.py


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
  """A running cluster (SLURM_CONF set for this process and its children);
  stopped afterwards, jobs included, pass or fail. TLAB_SLURM_DIR (set by
  `make test-slurm`, which stops it again even if pytest dies) names its directory."""
  directory = os.environ.get("TLAB_SLURM_DIR") or str(tmp_path_factory.mktemp("slurm"))
  previous = os.environ.get("SLURM_CONF")
  try:
    os.environ["SLURM_CONF"] = local_slurm.up(directory)
    yield directory
  finally:
    local_slurm.down(directory)
    if previous is None:
      os.environ.pop("SLURM_CONF", None)
    else:
      os.environ["SLURM_CONF"] = previous
  assert not local_slurm._processes_of(directory)  # pylint: disable=protected-access


def squeue(*args) -> str:
  return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True,
                        timeout=30).stdout.strip()


def wait_until_idle(timeout_s: float = 240) -> None:
  deadline = time.time() + timeout_s
  while squeue():
    assert time.time() < deadline, f"jobs still queued or running:\n{squeue()}"
    time.sleep(1)


def submitted(out: str) -> dict[str, str]:
  """variant name -> job id, from `sweep.py run --launcher slurm` output."""
  return {line.split()[2]: line.split()[1] for line in out.splitlines()
          if line.startswith("submitted ")}


@pytest.fixture(scope="module")
def array_sweep(slurm, tmp_path_factory):
  """Two good variants and one that restores from no run, as one job array."""
  tmp = tmp_path_factory.mktemp("array")
  path = write_sweep(tmp, TWO_VARIANTS.replace("]\n", f",\n          {BAD!r}]\n", 1))
  root = tmp / "root"
  args = ["--config", TINY, "--sweep", path, "--root", str(root), *FITS,
          *small_flags(tmp / "cache")]
  result = sweep_cli("run", *args)
  assert result.returncode == 0, result.stdout + result.stderr
  wait_until_idle()
  return root, args, result


def test_sweep_runs_a_job_array_and_reports_every_variant(array_sweep):
  root, _, result = array_sweep
  jobs = submitted(result.stdout)
  assert len(jobs) == 3 and len({job.split("_")[0] for job in jobs.values()}) == 1  # one array
  status = sweep_cli("status", "--root", str(root)).stdout.splitlines()
  assert "(2 done, 1 failed)" in status[0]
  for line, name in zip(status[1:], ["pos_emb=rope,norm_position=pre",
                                     "pos_emb=none,norm_position=post"]):
    assert line.split()[:3] == ["done", name, "step"]
  report = sweep_cli("report", "--root", str(root))
  assert report.returncode == 0, report.stderr
  with open(root / "report.csv", encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert [r["variant"] for r in rows] == list(jobs)
  assert [r["state"] for r in rows] == ["done", "done", "failed"]
  assert all(float(r["loss"]) > 0 for r in rows[:2])


def test_a_bad_variant_fails_alone_with_its_one_line_error(array_sweep):
  root, _, _ = array_sweep
  status = sweep_cli("status", "--root", str(root)).stdout.splitlines()
  [failed] = [line for line in status if line.split()[0] == "failed"]
  assert ("error: train.restore_from='/nonexistent/run': not a run directory "
          "(no config.json)") in failed
  assert "(train.py exited with status 2; log " in failed


def test_running_the_sweep_again_submits_only_what_is_not_done(array_sweep):
  root, args, _ = array_sweep
  again = sweep_cli("run", *args)
  assert again.returncode == 0, again.stderr
  assert "skip pos_emb=rope,norm_position=pre: done" in again.stdout
  assert "skip pos_emb=none,norm_position=post: done" in again.stdout
  assert list(submitted(again.stdout)) == ["restore_from=_nonexistent_run"]
  wait_until_idle()
  assert "(2 done, 1 failed)" in sweep_cli("status", "--root", str(root)).stdout


def test_a_request_that_does_not_fit_is_one_line_before_anything_is_submitted(slurm, tmp_path):
  path = write_sweep(tmp_path, TWO_VARIANTS)
  root = tmp_path / "root"
  result = sweep_cli("run", "--config", TINY, "--sweep", path, "--root", str(root),
                     "--launcher", "slurm")  # the defaults: 1 GPU, 8 CPUs
  assert result.returncode == 2 and not root.exists()
  assert result.stderr.strip().splitlines() == [
      "error: --gpus_per_node 1: partition debug has 0 GPUs per node (gres (null)); "
      "set --gpus_per_node 0"]
  result = sweep_cli("run", "--config", TINY, "--sweep", path, "--root", str(root),
                     "--launcher", "slurm", "--gpus_per_node", "0", "--cpus_per_task", "512")
  assert result.returncode == 2 and "lower --cpus_per_task" in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1 and not squeue()


def long_flags(cache_dir) -> list[str]:
  """small_flags, but training long enough (about two minutes on an idle core,
  4,096 tokens a step) to be interrupted twice: a step of 128 tokens ran
  6,000 steps in under 10 s, before SLURM's time-limit signal came."""
  dropped = ("num_steps", "_every", "batch_size", "seq_len")
  return [f for f in small_flags(cache_dir) if not any(d in f for d in dropped)] + [
      "--config.train.num_steps=6000", "--config.train.batch_size=64",
      "--config.train.seq_len=64", "--config.train.log_every=50",
      "--config.train.eval_every=6000", "--config.train.checkpoint_every=3000"]


def optimized_env() -> dict[str, str]:
  """This environment without the suite's `--xla_backend_optimization_level=0`
  (tests/conftest.py), which sbatch would pass on to the jobs: a run of
  minutes spends them stepping, not compiling, and steps about 1.8x faster
  with LLVM's optimizations (6,000 steps of long_flags: 2.2 minutes alone on a
  core, 3.1 beside another run)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_backend_optimization_level")]
  return {**os.environ, "XLA_FLAGS": " ".join(flags)}


def one_save(flags: list[str]) -> list[str]:
  """The same run validated and saved only at its end (saves of two processes are slow)."""
  return [f for f in flags if "eval_every" not in f and "checkpoint_every" not in f] + [
      "--config.train.eval_every=6", "--config.train.checkpoint_every=6"]


def params_of(workdir) -> list[np.ndarray]:
  """The parameters of the newest checkpoint of a run."""
  _, _, model, _ = load_run(str(workdir))
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def wait_for(predicate, what: str, timeout_s: float = 240) -> None:
  deadline = time.time() + timeout_s
  while not predicate():
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.5)


def set_time_limit(job: str, minutes: int) -> None:
  subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], check=True,
                 timeout=30)


@pytest.mark.timeout(1200)
def test_a_variant_timed_out_and_requeued_resumes_to_the_uninterrupted_parameters(
    slurm, tmp_path):
  """One variant twice at once: uninterrupted, and interrupted twice. First
  a time limit: the job is submitted with 2 minutes (what submitit goes by
  to call the signal a time-out), raised at once in SLURM, and cut back to
  2 minutes once the run is seen training, so SLURM sends USR2 (90 s before
  the limit) at its next check after 30 s of the job, train.py saves,
  submitit requeues the job (its limit is then raised again, so that it is
  hit once); then `scontrol requeue` once it has resumed: SLURM sends
  SIGTERM, train.py saves, SLURM requeues it. Both end at the same
  parameters. Cutting the limit when the run is seen training, rather than
  submitting with a short one, keeps the test independent of how fast the
  machine trains."""
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.pos_emb': 'rope'}]\n")
  name = "pos_emb=rope"
  jobs = {}
  for label, timeout in (("interrupted", "2"), ("reference", "30")):
    result = sweep_cli("run", "--config", TINY, "--sweep", path, "--root",
                       str(tmp_path / label), *FITS, "--timeout_min", timeout,
                       *long_flags(tmp_path / "cache"), env=optimized_env())
    assert result.returncode == 0, result.stdout + result.stderr
    jobs[label] = submitted(result.stdout)[name]
    if label == "interrupted":  # submitit keeps its 2 minutes; SLURM waits for the cut
      set_time_limit(jobs[label], 30)
  workdir = tmp_path / "interrupted" / name
  log = workdir / "sweep.log"

  def saves() -> int:
    return log.read_text().count("SIGTERM received: saved step") if log.exists() else 0

  wait_for(lambda: (last_step(str(workdir)) or 0) >= 50, "the run to train")
  set_time_limit(jobs["interrupted"], 2)
  wait_for(lambda: saves() == 1, "the time-limit signal")
  set_time_limit(jobs["interrupted"], 30)
  saved = last_step(str(workdir)) or 0
  wait_for(lambda: (last_step(str(workdir)) or 0) > saved + 100,
           "the resumed run's progress")
  subprocess.run(["scontrol", "requeue", jobs["interrupted"]], check=True, timeout=30)
  wait_until_idle(timeout_s=720)  # the rest of a run beside the reference
  text = log.read_text()
  assert saves() == 2 and text.count(", resuming to ") == 2, text
  # The commands the job recorded: the train.py that `scontrol requeue`'s
  # SIGTERM stopped (143 = 128 + 15; 0 from a train.py of before that status;
  # unrecorded if SLURM's KillWait of 5 s ended the job first), a stopped run,
  # not a failure (no sweep_error.json); then the resumed train.py and
  # eval.py. (checkpoint()'s SIGTERM ends with the job, before a record.)
  codes = [r["returncode"] for r in sweep_lib.read_times(str(workdir))]
  assert codes[-2:] == [0, 0] and all(c in (143, 0) for c in codes[:-2]), codes
  assert not (workdir / "sweep_error.json").exists()
  for label in jobs:
    state = sweep_lib.variant_state(sweep_lib.read_manifest(str(tmp_path / label))[1][0])
    assert (state.state, state.step) == ("done", 6000), state.detail
  errs = "".join(p.read_text() for p in (tmp_path / "interrupted" / "slurm").glob("*.err"))
  assert "this job is timed-out" in errs and "DUE TO JOB REQUEUE" in errs
  for got, want in zip(params_of(workdir), params_of(tmp_path / "reference" / name)):
    np.testing.assert_array_equal(got, want)


def test_a_two_task_job_trains_with_jax_distributed_and_the_one_process_losses(
    slurm, array_sweep, tmp_path):
  root, _, _ = array_sweep
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.pos_emb': 'rope', "
                     "'model.norm_position': 'pre'}]\n")
  result = sweep_cli("run", "--config", TINY, "--sweep", path, "--root", str(tmp_path / "r"),
                     *FITS, "--tasks_per_node", "2",
                     *one_save(small_flags(tmp_path / "cache")))
  assert result.returncode == 0, result.stdout + result.stderr
  wait_until_idle()
  name = "pos_emb=rope,norm_position=pre"
  state = sweep_lib.variant_state(sweep_lib.read_manifest(str(tmp_path / "r"))[1][0])
  assert state.state == "done", state.detail

  def train_losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}

  got, want = train_losses(tmp_path / "r" / name), train_losses(root / name)
  assert sorted(got) == sorted(want) and got
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                             rtol=1e-5)
  # Two train.py processes ran; only process 0 prints the steps.
  rank0 = (tmp_path / "r" / name / "sweep.log").read_text()
  rank1 = (tmp_path / "r" / name / "sweep.rank1.log").read_text()
  assert "step 6/" in rank0 and "train.py" in rank1 and "step 6/" not in rank1


def test_data_prepare_as_a_job_array_tokenises_each_shard_once(slurm, tmp_path):
  """`python -m data.prepare --launcher slurm`: two array tasks share the shards
  out, each tokenises its own, and the command's final check finds all cached."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  topics = [text for _, text in corpora.pydoc_documents()]
  for i in range(5):
    (corpus / f"t{i}.txt").write_text("\n".join(topics[i::5]), encoding="utf-8")
  tok = tmp_path / "tok"
  train_tokenizer("bpe", 300, topics[:50]).save(tok)
  folder = tmp_path / "jobs"
  result = subprocess.run(
      [sys.executable, "-m", "data.prepare", "--config", TINY, "--config.data.source=files",
       f"--config.data.paths={corpus}/*.txt", f"--config.data.cache_dir={tmp_path / 'cache'}",
       "--config.data.val_percent=20", f"--config.tokenizer.path={tok}", "--launcher", "slurm",
       "--tasks", "2", "--cpus_per_task", "1", "--timeout_min", "10", "--folder", str(folder)],
      cwd=ROOT, capture_output=True, text=True, timeout=400)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "submitted " in result.stdout and ": 2 tasks; logs in " in result.stdout
  counts = []
  for log in sorted(folder.glob("*_log.err")):
    (line,) = [l for l in log.read_text().splitlines() if l.startswith("data: process ")]
    counts.append(int(re.search(r"of 2: 5 shards: tokenised (\d+)", line).group(1)))
  assert len(counts) == 2 and sum(counts) == 5 and min(counts) > 0
  assert "data: 5 shards: tokenised 0, 5 from the cache" in result.stderr
