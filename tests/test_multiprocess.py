"""Two processes on one machine (coordinator on 127.0.0.1) train, checkpoint
and resume together, with the losses of a single-process run; when one is
killed, the other exits in bounded time, naming it in one line."""
import json
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from tests.helpers import ROOT, both_splits, small_config, train_cmd


from data import corpora


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train_losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _two_processes(cmd):
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out
  return outs


def _corpus_of_files(directory, val_percent: int) -> int:
  """pydoc's topics as text files, some held out and some not; how many."""
  topics = [text for _, text in corpora.pydoc_documents()]
  count = both_splits(lambda i: str(directory / f"t{i}.txt"), val_percent, 8)
  directory.mkdir()
  for i in range(count):
    (directory / f"t{i}.txt").write_text("\n".join(topics[i::count]), encoding="utf-8")
  return count


def _tokenised(out: str) -> int:
  """Shards this process tokenised, from its summary line."""
  (line,) = [line for line in out.splitlines() if line.startswith("data: process ")]
  return int(re.search(r"shards: tokenised (\d+)", line).group(1))


@pytest.mark.slow  # over a minute on 2 CPU cores: make test-slow
def test_two_processes_train_checkpoint_and_resume(tok_dir, tmp_path):
  c = small_config(tok_dir, cache_dir=str(tmp_path / "cache"))
  num_shards = _corpus_of_files(tmp_path / "corpus", 20)
  c.data.update(source="files", paths=str(tmp_path / "corpus" / "*.txt"), val_percent=20)
  c.train.update(num_steps=6, log_every=1, checkpoint_every=3, eval_every=6)
  single, multi = tmp_path / "single", tmp_path / "multi"
  subprocess.run(train_cmd(c, single), cwd=ROOT, check=True, capture_output=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
  c.train.num_steps = 4
  c.data.cache_dir = str(tmp_path / "cache-two")
  outs = _two_processes(train_cmd(c, multi))
  assert "step 4/4:" in outs[0] and "step 4/4:" not in outs[1]  # only process 0 prints
  counts = [_tokenised(out) for out in outs]
  assert sum(counts) == num_shards and min(counts) > 0  # each shard once, both took part
  c.train.num_steps = 6
  outs = _two_processes(train_cmd(c, multi))
  assert f"restored    step 4 of {multi}, resuming to 6" in outs[0]
  assert [_tokenised(out) for out in outs] == [0, 0]
  want, got = _train_losses(single), _train_losses(multi)
  assert sorted(got) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=1e-5)


@pytest.mark.slow
def test_a_killed_process_makes_the_other_exit_in_one_line(tok_dir, tmp_path):
  c = small_config(tok_dir)
  c.train.update(num_steps=100_000, log_every=1, checkpoint_every=100_000,
                 eval_every=100_000, peer_timeout_s=20.0)
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    procs.append(subprocess.Popen(train_cmd(c, tmp_path / "run"), cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  for line in procs[0].stdout:  # process 0 prints the steps
    if line.startswith("step 3/"):
      break
  procs[1].send_signal(signal.SIGKILL)
  killed_at = time.time()
  _, err = procs[0].communicate(timeout=120)
  assert procs[0].returncode == 1
  assert time.time() - killed_at < 60
  assert "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: process 0 stops: process 1 stopped responding (host "), err
  assert "exiting with status 1 so that the scheduler requeues the job" in last
  procs[1].wait()
