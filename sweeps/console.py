"""What the local launcher prints while its runs run, in plain lines (they end
up in SLURM logs and CI logs as often as on a terminal):

  running 4 run(s), 2 at a time (each logs to <workdir>/sweep.log); ETA after the first run
  start   pos_emb=rope
  pos_emb=rope: schedule    learning rate peaks at ...; warning: below ...
  [1/4] done    pos_emb=rope: step 200/200, val loss 4.1234 (2m05s); ETA 4m10s
  [1/4] running pos_emb=none: step 120/200 (1m30s); ETA 3m40s
  [2/4] failed  pos_emb=learned: train.py exited with status 2: error: ... (3s); ETA 2m05s
  [3/4] stopped pos_emb=sinusoidal: step 80/200, train.py stopped on SIGTERM; run
        the same command to resume (50s)
  4 run(s) in 6m10s: 2 done, 1 failed, 1 stopped

Every line of a run's sweep.log that holds `warning:` (train.py's own, and
Python's `UserWarning:` ...) or is an absl warning (`W0612 10:11:12.1 ...] `)
is echoed once, after the run's name. When nothing else has been said for
`every_s` seconds, a line gives each running run's last logged step.
"""
import os
import re
import threading
import time

from sweeps.state import LOG, last_step
from sweeps.variants import Variant

PROGRESS_EVERY_S = 30.0  # the longest silence before a line on the running runs

_WARNING = re.compile(r"warning:|^W\d{4} \d\d:\d\d:\d\d", re.IGNORECASE)
_ABSL_PREFIX = re.compile(r"^W\d{4} [\d:.]+ +\d+ [^\]]*\] ")  # time and thread vary


def duration(seconds: float) -> str:
  """`45s`, `2m05s`, `1h02m`."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _Warnings:
  """The warning lines a run's log gains from its size when the run started."""

  def __init__(self, path: str):
    self.path = path
    self.offset = os.path.getsize(path) if os.path.exists(path) else 0
    self.partial = ""  # a last line not ended yet
    self.seen = set()

  def new(self, final: bool = False) -> list[str]:
    """Warnings not returned before; `final`: the run has ended (its last line too)."""
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return []
    self.offset += len(data)
    lines = re.split(r"[\r\n]", self.partial + data.decode("utf-8", errors="replace"))
    self.partial = "" if final else lines.pop()
    out = []
    for line in (line.strip() for line in lines):
      key = _ABSL_PREFIX.sub("", line)
      if _WARNING.search(line) and not line.startswith("$ ") and key not in self.seen:
        self.seen.add(key)
        out.append(line)
    return out


class Console:
  """The launcher's lines: `started()` from the thread that runs a variant,
  `ended()` and `tick()` (warnings, the periodic line) from the one that
  waits for them."""

  def __init__(self, variants: list[Variant], parallel: int, out=print,
               every_s: float = PROGRESS_EVERY_S, clock=time.monotonic):
    self._total, self._parallel = len(variants), parallel
    self._out, self._every_s, self._clock = out, every_s, clock
    self._lock = threading.Lock()
    self._begin = self._last = clock()
    self._running = {}  # name -> (variant, start time, _Warnings)
    self._walls = []  # the wall times of the runs that ended done
    self._stopping = False  # no ETA once the launcher was told to stop
    self.counts = {}  # state -> how many runs ended in it
    self._say(f"running {self._total} run(s), {parallel} at a time (each logs to "
              f"<workdir>/{LOG}); ETA after the first run")

  def _say(self, line: str) -> None:
    self._out(line)
    self._last = self._clock()

  def started(self, variant: Variant) -> None:
    with self._lock:
      self._running[variant.name] = (variant, self._clock(),
                                     _Warnings(os.path.join(variant.workdir, LOG)))
      self._say(f"start   {variant.name}")

  def ended(self, variant: Variant, state: str, detail: str) -> None:
    """A run's result line: `state` done, stopped or failed; `detail` after its name."""
    with self._lock:
      entry = self._running.pop(variant.name, None)
      wall = "" if entry is None else f" ({duration(self._clock() - entry[1])})"
      if entry is not None:
        self._warn(variant.name, entry[2].new(final=True))
        if state == "done":
          self._walls.append(self._clock() - entry[1])
      self.counts[state] = self.counts.get(state, 0) + 1
      finished = sum(self.counts.values())
      eta = self._eta() if finished < self._total else ""
      self._say(f"[{finished}/{self._total}] {state:7s} {variant.name}: {detail}{wall}"
                + (f"; {eta}" if eta else ""))

  def stopping(self, signal_name: str) -> None:
    with self._lock:
      self._stopping = True
      self._say(f"{signal_name}: passed on to the {len(self._running)} running run(s), which "
                "save and stop; no other starts")

  def tick(self) -> None:
    """Echoes the running runs' new warnings; after `every_s` seconds of
    silence, a line on where each running run stands."""
    with self._lock:
      for name, (_, _, warnings) in list(self._running.items()):
        self._warn(name, warnings.new())
      now = self._clock()
      if not self._running or now - self._last < self._every_s:
        return
      runs = []
      for name, (variant, start, _) in self._running.items():
        step = last_step(variant.workdir)
        where = "starting" if step is None else f"step {step}/{variant.num_steps}"
        runs.append(f"{name}: {where} ({duration(now - start)})")
      eta = self._eta() or ("" if self._stopping else "ETA after the first run")
      self._say(f"[{sum(self.counts.values())}/{self._total}] running " + "; ".join(runs)
                + (f"; {eta}" if eta else ""))

  def summary(self) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in self.counts.items())
    return (f"{sum(self.counts.values())} run(s) in {duration(self._clock() - self._begin)}"
            + (f": {counts}" if counts else ""))

  def _warn(self, name: str, lines: list[str]) -> None:
    for line in lines:
      self._say(f"{name}: {line}")

  def _eta(self) -> str:
    """`ETA 3m10s` for the runs not ended: each as long as the mean run that
    ended done, `parallel` at a time; "" before the first, and once stopping."""
    if not self._walls or self._stopping:
      return ""
    mean, now = sum(self._walls) / len(self._walls), self._clock()
    # When each of the `parallel` slots is free, the queued runs put in the first free.
    slots = [max(mean - (now - start), 0.0) for _, start, _ in self._running.values()]
    slots += [0.0] * (self._parallel - len(slots))
    for _ in range(self._total - sum(self.counts.values()) - len(self._running)):
      slots.sort()
      slots[0] += mean
    return f"ETA {duration(max(slots))}"
