"""SIGINT and SIGTERM in the entry points (train.py, eval.py): one line on
stderr, then exit status 128 + the signal (SIGINT 130, SIGTERM 143) at once.

Never a KeyboardInterrupt: raised inside a garbage-collection callback of JAX
it is printed and ignored (the program runs on and may exit 0), and anywhere
else it ends in a traceback. `exit_on_signal(describe)` installs the handler:
it runs the current cleanup, writes `describe(signal name)` and calls
`os._exit`. What a signal says and removes changes as the program goes
(`on_signal`); `held()` is a block a signal cannot cut (outputs moved into
place): one received inside acts at its end. Once the exit status is decided,
`exit_quietly(status)`: a signal then only hurries the exit with it.

`on_signal` and `held` change nothing in a process without the handler
(library code calls them; a test's KeyboardInterrupt stays Python's).
Imports nothing but the standard library: an entry point installs the handler
before it loads JAX.
"""
import contextlib
import os
import shlex
import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_state = {"describe": None, "cleanup": None, "held": 0, "pending": None}


def exit_on_signal(describe) -> None:
  """From now on SIGINT and SIGTERM exit 128 + the signal, saying
  `describe(signal name)` (one line; `on_signal` changes it)."""
  on_signal(describe)
  for stop_signal in SIGNALS:
    signal.signal(stop_signal, _handle)


def on_signal(describe, cleanup=None) -> None:
  """What a signal does from now on: `cleanup()` (it must not raise: remove
  temporary files), then the line `describe(signal name)`."""
  _state["describe"], _state["cleanup"] = describe, cleanup


@contextlib.contextmanager
def held():
  """A block that a signal does not cut: one received inside exits at its end
  (saying what `on_signal` says by then)."""
  _state["held"] += 1
  try:
    yield
  finally:
    _state["held"] -= 1
    if not _state["held"] and _state["pending"] is not None:
      _exit(_state["pending"])


def exit_quietly(status: int) -> None:
  """The exit status is decided and everything written: SIGINT and SIGTERM
  now exit with `status` at once, saying nothing."""
  sys.stdout.flush()
  for stop_signal in SIGNALS:
    signal.signal(stop_signal, lambda *_: os._exit(status))


def _handle(signum, _frame):
  if _state["held"]:
    if _state["pending"] is None:  # the first one decides
      _state["pending"] = signum
    return
  _exit(signum)


def _exit(signum: int) -> None:
  if _state["cleanup"] is not None:
    _state["cleanup"]()
  line = _state["describe"](signal.Signals(signum).name)
  # The signal may have come inside a write to sys.stdout or sys.stderr, which
  # Python refuses to reenter: what stdout holds is kept where it can be, the
  # line is written by os.write (after a newline on a terminal, where a
  # progress bar may hold the line).
  with contextlib.suppress(RuntimeError, OSError, ValueError):
    sys.stdout.flush()
  os.write(2, (("\n" if os.isatty(2) else "") + line + "\n").encode())
  os._exit(128 + signum)


def command() -> str:
  """This process's command line, to run it again."""
  return shlex.join(["python", *sys.argv])
