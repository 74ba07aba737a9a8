"""Running one variant (`VariantJob`, the same callable locally and on SLURM)
and the local launcher."""
import concurrent.futures
import datetime
import json
import os
import re
import resource
import signal
import socket
import subprocess
import time

import submitit

from sweeps.common import REPO
from sweeps.state import ERROR, LOG, REPORT, TIMES, last_step, read_json, write_json
from sweeps.variants import Variant
from training import hardware

STOP_TIMEOUT_S = 60  # how long checkpoint() waits for train.py to save and exit


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

  def __getstate__(self):
    return {"_child": None}  # a process does not travel with a requeued job

  def __call__(self, variant: Variant) -> dict:
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    os.makedirs(variant.workdir, exist_ok=True)
    error_path = os.path.join(variant.workdir, ERROR)
    if rank == 0 and os.path.exists(error_path):
      os.remove(error_path)
    log = os.path.join(variant.workdir, LOG if rank == 0 else f"sweep.rank{rank}.log")
    self._run(variant, "train.py", variant.train_command, log)
    step = last_step(variant.workdir) or 0
    if step < variant.num_steps:  # train.py was stopped (SIGTERM/SIGINT) and saved
      return {"name": variant.name, "state": "stopped", "step": step}
    if rank == 0:
      self._run(variant, "eval.py", variant.eval_command, log)
    return {"name": variant.name, "state": "done", "step": step,
            "report": read_json(os.path.join(variant.workdir, REPORT))}

  def _run(self, variant: Variant, what: str, command: list[str], log_path: str) -> None:
    """Runs a command, its output appended to the log, its times to the
    workdir's sweep_times.jsonl (task 0); VariantFailed if it fails."""
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
    if returncode:
      how = (f"exited with status {returncode}" if returncode > 0
             else f"was killed by {signal.Signals(-returncode).name}")
      error = {"command": what, "how": how,
               "error": _last_line(log_path), "log": log_path}
      write_json(os.path.join(variant.workdir, ERROR), error)
      raise VariantFailed(f"{variant.name}: {error['command']} {how}: {error['error']}")

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


def run_local(variants: list[Variant], parallel: int, out=print) -> int:
  """Runs the variants here, `parallel` at a time; returns how many failed."""
  out(f"running {len(variants)} variant(s), {parallel} at a time; each logs to "
      f"<workdir>/{LOG}")
  failures = 0
  with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = {pool.submit(VariantJob(), variant): variant for variant in variants}
    try:
      for future in concurrent.futures.as_completed(futures):
        variant = futures[future]
        try:
          result = future.result()
        except VariantFailed as e:
          failures += 1
          out(f"failed  {e}")
          continue
        detail = (f", val loss {result['report']['loss']:.4f}" if result["state"] == "done"
                  else "; run the sweep again to resume")
        out(f"{result['state']:7s} {variant.name}: step {result['step']}{detail}")
    except KeyboardInterrupt:  # train.py got the SIGINT too: it saves and stops
      for future in futures:
        future.cancel()
      raise
  return failures
