"""Orbax checkpoints of a run: train state, Grain iterator state, metadata.

One `CheckpointManager` under `<workdir>/checkpoints`: asynchronous saves,
each step written to a temporary directory and renamed when complete, so a
crash at any moment leaves either the previous checkpoint or the new one;
leftover temporary directories are ignored and cleaned up. Each checkpoint
holds `state` (step, parameters, optimizer state, RNG), `data` (the Grain
iterator position, one file per process) and `meta` (the resolved config, the
tokenizer fingerprint and a checksum of every array of `state`, see
training/faults/integrity.py).

Damage is detected, never loaded: a checkpoint restores whole (every file
read, every checksum equal) or raises `DamagedCheckpoint`.
`restore_newest_intact` falls back to older checkpoints, moving a damaged
one aside to `<step>.damaged` (never deleting it). Only the newest
`train.keep_checkpoints` are kept, and older ones are removed only after a
newer save has been committed. A save that fails raises `SaveFailed` naming
the cause and the last good step.
"""
import logging
import os
import re
import sys

import grain
from jax.experimental import multihost_utils
import jax
import numpy as np
import orbax.checkpoint as ocp

from configs.errors import UserError
from training.faults import integrity

DAMAGED_SUFFIX = ".damaged"


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be read whole; `cause` says why in a few words."""

  def __init__(self, step: int, cause: str):
    super().__init__(f"checkpoint step {step} is damaged ({cause})")
    self.step, self.cause = step, cause


class SaveFailed(UserError):
  """A checkpoint could not be written (no space, permission, an I/O error)."""


def _cause(error: BaseException) -> str:
  """A few words on why reading or writing failed: the operating system's
  reason when there is one (TensorStore reports it as os_error_code), else the
  error's type and first line, of the innermost error behind it."""
  while error.__cause__ is not None:
    error = error.__cause__
  code = re.search(r"os_error_code='?(\d+)", str(error))
  if code:
    return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
  if isinstance(error, OSError) and error.errno:
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror} (errno {error.errno}){where}"
  first = next((l.strip() for l in str(error).splitlines() if l.strip()), "")
  first = re.sub(r' in OCDBT database at local file "[^"]*"', "", first)
  text = f"{type(error).__name__}: {first}" if first else type(error).__name__
  return text if len(text) <= 200 else text[:197] + "..."


class _DropOrbaxErrors(logging.Filter):
  """Drops Orbax's own error logs (tracebacks of a failed save or restore):
  every Orbax call here turns its failure into one line of ours."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


logging.getLogger("absl").addFilter(_DropOrbaxErrors())


def all_true(ok: bool) -> bool:
  """True when `ok` on every process (each process reads its own shards, and
  each must take the same branch after a check only some of them can fail)."""
  if jax.process_count() == 1:
    return ok
  return bool(multihost_utils.process_allgather(np.array(ok)).all())


class Checkpointer:

  def __init__(self, workdir: str, *, keep: int = 3, asynchronous: bool = True,
               read_only: bool = False):
    """`read_only`: for reading another run, which may be saving right now: creates
    nothing and leaves its temporary directories (saves in progress) alone."""
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.keep = keep
    options = ocp.CheckpointManagerOptions(
        create=not read_only, cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=asynchronous)  # old steps: removed by _prune
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self._pending = None  # the step of a save in progress

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def last_good_step(self) -> int | None:
    """The newest committed step, not counting a save in progress."""
    steps = [s for s in self.all_steps() if s != self._pending]
    return max(steps) if steps else None

  def save(self, step: int, state, data_iterator, meta: dict, *, force: bool = False) -> None:
    """Starts saving `step` (in the background); `meta` gains the state's checksums.

    The previous save is finished first; a failed one raises `SaveFailed`.
    """
    self.wait()
    meta = dict(meta, checksums=integrity.fingerprints(state))
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self._pending = step
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)

  def wait(self) -> None:
    """Finishes the save in progress; `SaveFailed` if it failed. Then removes
    the checkpoints beyond the newest `keep`."""
    if self._pending is None:
      return
    step = self._pending
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
      self.manager.reload()
      if step not in self.manager.all_steps():
        raise OSError("the checkpoint was not committed")
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)
    self._pending = None
    self._prune()

  def _failed(self, step: int, error: Exception):
    self.manager.reload()
    self._pending = None
    last = self.last_good_step()
    last_text = f"step {last} is the last good checkpoint" if last is not None else \
        "there is no earlier checkpoint"
    raise SaveFailed(f"saving checkpoint step {step} in {self.directory} failed ({_cause(error)}); "
                     f"{last_text}; fix the cause (disk space, permissions) and run the same "
                     "command to resume") from error

  def _prune(self) -> None:
    """Removes all but the newest `keep` committed checkpoints."""
    for step in self.all_steps()[:-self.keep]:
      self.manager.delete(step)

  def restore(self, step: int, abstract_state, data_iterator=None):
    """(state, meta) of `step`, checked whole; the iterator, if given, is moved
    to its position. `DamagedCheckpoint` when any part cannot be read or a
    checksum differs."""
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
      state, meta = restored["state"], restored["meta"]
      bad = None
      if "checksums" in meta:  # saved before checksums were recorded: not checked
        bad = integrity.first_mismatch(meta["checksums"], state)
      cause = None if bad is None else f"checksum mismatch in state{bad}"
    except Exception as e:  # pylint: disable=broad-except
      state = meta = None
      cause = _cause(e)
    if not all_true(cause is None):
      raise DamagedCheckpoint(step, cause or "damaged on another process")
    return state, meta

  def restore_data(self, step: int, data_iterator) -> None:
    """Moves `data_iterator` to its position at `step`; `DamagedCheckpoint`
    when that cannot be read."""
    try:
      self.manager.restore(step, args=ocp.args.Composite(
          data=grain.checkpoint.CheckpointRestore(data_iterator)))
    except Exception as e:  # pylint: disable=broad-except
      cause = _cause(e)
    else:
      cause = None
    if not all_true(cause is None):
      raise DamagedCheckpoint(step, cause or "damaged on another process")

  def restore_meta(self, step: int) -> dict:
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # pylint: disable=broad-except
      raise DamagedCheckpoint(step, _cause(e)) from None

  def restore_newest_intact(self, abstract_state, data_iterator=None, *, move_aside: bool,
                            where: str):
    """(step, state, meta) of the newest checkpoint that restores whole, or
    None when there is no checkpoint.

    Each newer damaged one is reported in one line on stderr and, with
    `move_aside`, renamed to `<step>.damaged` (by process 0). When none
    restores whole, a UserError lists them and nothing is moved.
    """
    damaged = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, abstract_state, data_iterator)
      except DamagedCheckpoint as e:
        damaged.append(e)
        continue
      for e in damaged:
        note = f"{where}: {e}"
        if move_aside:
          note += f"; moved aside to {self.move_aside(e.step)}"
        _note(f"{note}; using step {step}")
      return step, state, meta
    if damaged:
      causes = "; ".join(str(e) for e in damaged)
      raise UserError(f"{where}: no checkpoint in {self.directory} restores whole: {causes}; "
                      "nothing was moved or deleted (see docs/training.md, Faults)")
    return None

  def move_aside(self, step: int) -> str:
    """Renames checkpoint `step` to `<step>.damaged` (`.damaged.1`, ... if taken);
    returns the new path relative to the workdir."""
    target = os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}")
    n = 0
    while os.path.exists(target):
      n += 1
      target = os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}.{n}")
    if jax.process_index() == 0:
      os.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"move_aside_{step}")
    self.manager.reload()
    return os.path.join(os.path.basename(self.directory), os.path.basename(target))

  def close(self) -> None:
    self.manager.close()


def _note(message: str) -> None:
  """One line on stderr, from process 0."""
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def resolve_step(checkpointer: Checkpointer, step: int | None, where: str) -> int:
  """`step`, or the newest; a UserError when there is none to restore."""
  steps = checkpointer.all_steps()
  if not steps:
    raise UserError(f"{where}: no checkpoint in {checkpointer.directory}; "
                    "train first (python train.py --config ... --workdir ...)")
  if step is None:
    return max(steps)
  if step not in steps:
    raise UserError(f"{where}: no checkpoint at step {step}; available: "
                    f"{', '.join(map(str, sorted(steps)))}")
  return step
