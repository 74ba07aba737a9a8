"""Bounded waits between the processes of a multi-host run.

A process that dies or hangs would leave the others waiting forever in a
collective (an NCCL all-reduce waits; on CPU Gloo errors out, then JAX's
shutdown barrier waits) instead of exiting so that SLURM or submitit
requeues the job. `PeerWatchdog` runs beside the train loop of every
process: a thread publishes the process's step in the coordination
service's key-value store every `timeout / 10` seconds, and watches the
others' entries (a dead process's entry stops changing). When this process
makes no step for `train.peer_timeout_s` seconds, or a collective fails, it
prints one line naming the process that stopped responding and exits with
status 1 at once (without JAX's shutdown barrier, which would wait for the
dead process).
"""
import json
import os
import socket
import sys
import threading
import time

import jax
from jax._src import distributed

EXIT_STATUS = 1
_PREFIX = "transformer_lab/alive"


class PeerWatchdog:
  """Started by `start()` (multi-process runs only); `progress(step)` after each step."""

  def __init__(self, timeout_s: float):
    self.timeout = timeout_s
    self.interval = max(timeout_s / 10, 0.2)
    self._me, self._count = jax.process_index(), jax.process_count()
    self._host = socket.gethostname()
    self._step = None
    self._last_progress = time.monotonic()
    self._seen = {}  # process -> (its entry, when it last changed, by our clock)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)

  def start(self) -> "PeerWatchdog":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def progress(self, step: int) -> None:
    self._step, self._last_progress = step, time.monotonic()

  def _watch(self) -> None:
    client = distributed.global_state.client
    while not self._stop.wait(self.interval):
      try:
        client.key_value_set(f"{_PREFIX}/{self._me}",
                             json.dumps({"step": self._step, "host": self._host,
                                         "time": time.time()}), allow_overwrite=True)
        self._read_others(client)
      except Exception as e:  # pylint: disable=broad-except
        if not self._stop.is_set():
          self.exit(f"lost contact with process 0, the coordinator ({type(e).__name__})")
      stalled = time.monotonic() - self._last_progress
      if self._step is not None and stalled > self.timeout and not self._stop.is_set():
        self.exit(f"{self._missing()}; no step for {stalled:.0f} s "
                  f"(train.peer_timeout_s={self.timeout:g})")

  def _read_others(self, client) -> None:
    now = time.monotonic()
    for process in range(self._count):
      if process == self._me:
        continue
      try:
        entry = client.key_value_try_get(f"{_PREFIX}/{process}")
      except Exception:  # pylint: disable=broad-except
        continue  # not published yet
      if self._seen.get(process, (None,))[0] != entry:
        self._seen[process] = (entry, now)

  def _missing(self) -> str:
    """Which process stopped responding: the one whose entry stopped
    changing first, else (all alive) the one at the lowest step."""
    silent = self._silent()
    if silent:
      _, process = min(silent)
      return f"process {process} stopped responding ({self._last_seen(process)})"
    behind = sorted((json.loads(entry)["step"] or -1, p) for p, (entry, _) in self._seen.items())
    if behind:
      _, process = behind[0]
      return f"process {process} hangs ({self._last_seen(process)})"
    return "another process stopped responding"

  def _last_seen(self, process: int) -> str:
    entry = json.loads(self._seen[process][0])
    return f"host {entry['host']}, last at step {entry['step']}"

  def fail(self, error: BaseException) -> None:
    """After an error in the loop: when another process went silent (waiting
    a few intervals to tell), names it and exits; else returns (the error is
    this process's own)."""
    for _ in range(6):
      if self._silent():
        self.exit(f"{self._missing()}; a collective failed ({type(error).__name__})")
      time.sleep(self.interval)

  def _silent(self) -> list[tuple[float, int]]:
    """(when its entry last changed, process) of each process gone silent."""
    now = time.monotonic()
    return [(changed, p) for p, (_, changed) in self._seen.items()
            if now - changed > 3 * self.interval]

  def exit(self, reason: str) -> None:
    """One line on stderr, then exit status 1 at once."""
    print(f"error: process {self._me} stops: {reason}; exiting with status {EXIT_STATUS} so "
          "that the scheduler requeues the job (the same command resumes it)",
          file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access
