"""Orbax checkpoints of a run: train state, Grain iterator state, metadata.

One `CheckpointManager` under `<workdir>/checkpoints`: asynchronous saves,
the newest `train.keep_checkpoints` kept, each step written to a temporary
directory and renamed when complete, so a crash at any moment leaves either
the previous checkpoint or the new one; leftover temporary directories are
ignored and cleaned up. Each checkpoint holds `state` (step, parameters,
optimizer state, RNG), `data` (the Grain iterator position, one file per
process) and `meta` (the resolved config and the tokenizer fingerprint).
"""
import os

import grain
import orbax.checkpoint as ocp

from configs.errors import UserError


class Checkpointer:

  def __init__(self, workdir: str, *, keep: int = 3, asynchronous: bool = True,
               read_only: bool = False):
    """`read_only`: for reading another run, which may be saving right now: creates
    nothing and leaves its temporary directories (saves in progress) alone."""
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=asynchronous)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_iterator, meta: dict, *, force: bool = False) -> None:
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, step: int, abstract_state, data_iterator=None):
    """(state, meta) of `step`; the iterator, if given, is moved to its position."""
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"], restored["meta"]

  def restore_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


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
