"""One writer per workdir: `<workdir>/lock`, held by the run that trains in it.

The lock is an exclusive `fcntl.flock` lock on that file (Linux maps it to
POSIX locks on NFS, so it holds across machines; Lustre needs `-o flock`);
the file says
who holds it (host, PID, since when). The kernel (or the NFS server, when its
lease ends) drops the lock when its holder dies, SIGKILL and vanished nodes
included, so a lock left by a dead process never blocks a resume: the next
run takes it over and says whose it was. A run that finishes empties the file.
A second run on a workdir whose holder lives is refused in one line naming it.
"""
import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from configs.errors import UserError

LOCK_FILE = "lock"


class WorkdirLock:
  """Held from `acquire()` until `release()` (or the process's end)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None

  def acquire(self) -> None:
    """Takes the lock, or raises a UserError naming its live holder."""
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read(fd)
      os.close(fd)
      if e.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
        raise UserError(f"{os.path.dirname(self.path)} is in use by another run ({_describe(holder)})"
                        "; wait for it to end or stop it, or use another --workdir") from None
      print(f"note: cannot lock {self.path} ({e.strerror}): this file system has no "
            "locks, so nothing stops a second run on this workdir", file=sys.stderr)
      return
    previous = _read(fd)
    if previous:
      print(f"note: took over the lock of {os.path.dirname(self.path)} left by a run that "
            f"ended without releasing it ({_describe(previous)}; no longer running)",
            file=sys.stderr)
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(mine).encode(), 0)
    os.fsync(fd)
    self._fd = fd

  def release(self) -> None:
    """Empties the file (a clean end) and drops the lock."""
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)
    os.close(self._fd)  # closing drops the lock
    self._fd = None


def _read(fd: int) -> dict:
  raw = os.pread(fd, 4096, 0)
  try:
    return json.loads(raw) if raw.strip() else {}
  except ValueError:
    return {"unreadable": raw[:60]}


def _describe(holder: dict) -> str:
  if not holder or "pid" not in holder:
    return "holder unknown"
  return f"host {holder.get('host')}, PID {holder.get('pid')}, since {holder.get('since')}"
