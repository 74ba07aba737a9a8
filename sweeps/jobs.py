"""Running one variant (`VariantJob`, the same callable locally and on SLURM)
and the local launcher.

A command's exit status decides how its run ended: 0, finished (a train.py
short of num_steps: stopped, as train.py exited 0 after saving on a signal
before it exited 128 + the signal); 130 or 143 (train.py saved on SIGINT or
SIGTERM), or killed by either signal: stopped, resumed by running the sweep
again; anything else (2: train.py's one-line user error): failed, with the
log's last line in sweep_error.json.
"""
import concurrent.futures
import datetime
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time

import submitit

from sweeps.common import REPO, Terminated
from sweeps.console import PROGRESS_EVERY_S, Console
from sweeps.state import ERROR, LOG, REPORT, TIMES, last_step, read_json, write_json
from sweeps.variants import Variant
from training import hardware

STOP_TIMEOUT_S = 60  # how long checkpoint() waits for train.py to save and exit
POLL_S = 1.0  # how often the local launcher reads its runs' logs for warnings
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a command ended by one is stopped, not failed


class VariantFailed(Exception):
  """train.py or eval.py of a variant exited with an error (see its sweep.log)."""


def _last_line(path: str) -> str:
  """The last non-empty line of a log (progress bars end their lines with \\r)."""
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - 65536))
    text = f.read().decode("utf-8", errors="replace")
  lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
  return lines[-1] if lines else ""


class VariantJob(submitit.helpers.Checkpointable):
  """Runs one variant: train.py, then eval.py once training has reached num_steps.

  The local launcher and the SLURM jobs run this same callable. On SLURM,
  submitit calls `checkpoint()` when the job is preempted or reaches its time
  limit: it stops train.py with SIGTERM (train.py saves and exits) and returns
  the same call, which submitit requeues; train.py then resumes from the
  workdir. In a multi-process job (SLURM_NTASKS > 1) every task trains and
  task 0 evaluates.
  """

  def __init__(self):
    self._child = None  # the running subprocess.Popen
    self._stop = None  # the signal stop() passed on: no command starts after it

  def __getstate__(self):
    return {"_child": None, "_stop": None}  # a process does not travel with a requeued job

  def __call__(self, variant: Variant) -> dict:
    """{"name", "state": "done", "step", "report"} or {"name", "state":
    "stopped", "step", "how"} (`train.py stopped on SIGTERM`, ...);
    VariantFailed if a command failed."""
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    os.makedirs(variant.workdir, exist_ok=True)
    error_path = os.path.join(variant.workdir, ERROR)
    if rank == 0 and os.path.exists(error_path):
      os.remove(error_path)
    log = os.path.join(variant.workdir, LOG if rank == 0 else f"sweep.rank{rank}.log")
    stopped = self._run(variant, "train.py", variant.train_command, log)
    step = last_step(variant.workdir) or 0
    if stopped is None and step >= variant.num_steps and rank == 0:
      stopped = self._run(variant, "eval.py", variant.eval_command, log)
    if stopped is None and step < variant.num_steps:  # a train.py that exits 0 when stopped
      stopped = "train.py stopped"
    if stopped is not None:
      return {"name": variant.name, "state": "stopped", "step": step, "how": stopped}
    return {"name": variant.name, "state": "done", "step": step,
            "report": read_json(os.path.join(variant.workdir, REPORT))}

  def stop(self, signum: int) -> None:
    """Passes `signum` (SIGINT, SIGTERM) on to the running command (train.py
    saves and exits) and starts no other: the call returns `stopped`."""
    self._stop = signum
    child = self._child
    if child is not None and child.returncode is None:  # not reaped: its pid is its own
      os.kill(child.pid, signum)

  def _run(self, variant: Variant, what: str, command: list[str], log_path: str) -> str | None:
    """Runs a command, its output appended to the log, its times to the
    workdir's sweep_times.jsonl (task 0). None when it finished; how it
    stopped when SIGINT or SIGTERM ended it (or stop() came first: it does
    not start); VariantFailed if it failed."""
    if self._stop is not None:
      return f"{what} not started ({signal.Signals(self._stop).name})"
    env = {**os.environ, **variant.env}
    with open(log_path, "a", encoding="utf-8") as log:
      log.write(f"$ {variant.shell(command)}\n")
      log.flush()
      # SLURM sends its time-limit signal (USR2) to every process of the job;
      # blocked in train.py, it leaves checkpoint() to stop it with SIGTERM, so
      # that it saves first.
      previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
      started, start = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
      try:
        self._child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env=env)
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
      if self._stop is not None:  # stop() came while it started
        self._child.send_signal(self._stop)
      try:
        returncode, usage = _wait(self._child)
      finally:
        self._child = None
    if os.environ.get("SLURM_PROCID", "0") == "0":
      _record_times(variant.workdir, {
          "command": what, "returncode": returncode, "started": started,
          "wall_s": round(time.monotonic() - start, 3),
          "cpu_s": None if usage is None else round(usage.ru_utime + usage.ru_stime, 3),
          "host": socket.gethostname(), "cpu_model": hardware.cpu_model(),
          "cpus": hardware.usable_cpus(), "xla_cpu_threads": hardware.xla_cpu_threads(env),
          "env": variant.env})
    if returncode - 128 in STOP_SIGNALS:  # train.py saved first (or had not started training)
      return f"{what} stopped on {signal.Signals(returncode - 128).name}"
    if -returncode in STOP_SIGNALS:
      return f"{what} killed by {signal.Signals(-returncode).name}"
    if returncode:
      how = (f"exited with status {returncode}" if returncode > 0
             else f"was killed by {signal.Signals(-returncode).name}")
      error = {"command": what, "how": how,
               "error": _last_line(log_path), "log": log_path}
      write_json(os.path.join(variant.workdir, ERROR), error)
      raise VariantFailed(f"{variant.name}: {error['command']} {how}: {error['error']}")
    return None

  def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
    """Stops train.py with SIGTERM (it saves), then resubmits this same call."""
    child = self._child
    if child is not None and child.poll() is None:
      child.terminate()
      try:
        child.wait(timeout=STOP_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        child.kill()
    return super().checkpoint(*args, **kwargs)


def _wait(child: subprocess.Popen) -> tuple[int, resource.struct_rusage | None]:
  """The child's exit status and resource usage (its user and system CPU
  time, with that of the processes it waited for, as `time` counts it).

  Polled, not wait()ed: checkpoint() runs as a signal handler in this thread
  and waits for the child itself, which a pending wait() blocks; when it has
  reaped the child, the usage is unknown (None)."""
  while True:
    try:
      pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    except ChildProcessError:  # reaped by checkpoint()'s wait()
      return child.returncode, None
    if pid:
      child.returncode = os.waitstatus_to_exitcode(status)
      return child.returncode, usage
    time.sleep(0.2)


def _record_times(workdir: str, record: dict) -> None:
  """Appends one command's times to the workdir's sweep_times.jsonl."""
  with open(os.path.join(workdir, TIMES), "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")


def _outcome(variant: Variant, result: dict) -> tuple[str, str]:
  """The state a run ended in and what its console line says after the name."""
  step = f"step {result['step']}/{variant.num_steps}"
  if result["state"] == "done":
    return "done", f"{step}, val loss {result['report']['loss']:.4f}"
  return "stopped", f"{step}, {result['how']}; run the same command to resume"


def _raise_terminated(*_):
  raise Terminated()


def run_local(variants: list[Variant], parallel: int, out=print,
              every_s: float = PROGRESS_EVERY_S) -> int:
  """Runs the variants here, `parallel` at a time, saying how they go
  (sweeps/console.py); returns how many did not end done (failed or
  stopped). Ctrl-C (KeyboardInterrupt) or SIGTERM (Terminated) is passed on to
  the running commands (train.py saves and exits) and no other starts; once
  they have ended, it is raised again."""
  console = Console(variants, parallel, out, every_s)
  jobs = {variant.name: VariantJob() for variant in variants}

  def run_one(variant: Variant) -> None:
    console.started(variant)
    try:
      result = jobs[variant.name](variant)
    except VariantFailed as e:
      console.ended(variant, "failed", str(e)[len(variant.name) + 2:])
    else:
      console.ended(variant, *_outcome(variant, result))

  def wait_for(left: set) -> None:
    """Waits for the futures of `left`, with the console's ticks meanwhile."""
    while left:
      done, _ = concurrent.futures.wait(left, timeout=POLL_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
      for future in done:
        left.remove(future)
        future.result()  # a bug's traceback
      console.tick()

  main = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel)
  futures = {pool.submit(run_one, variant): variant for variant in variants}
  left = set(futures)
  try:
    wait_for(left)
  except (KeyboardInterrupt, Terminated) as e:
    signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
    left -= {future for future in left if future.cancel()}
    console.stopping(signum.name)
    for job in jobs.values():
      job.stop(signum)
    wait_for(left)
    out(console.summary())
    raise
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
    if main:
      signal.signal(signal.SIGTERM, previous)
  out(console.summary())
  return sum(n for state, n in console.counts.items() if state != "done")
