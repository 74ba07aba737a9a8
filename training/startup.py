"""What train.py checks and says before its first step.

`check_memory`: the pre-flight. The training-memory estimate of
`model/accounting.py` (the rule of `python -m model.summary --backend`), per
device, against what the device has: host RAM on CPU (MemAvailable), the
allocator's `bytes_limit` on a GPU or TPU. A run that cannot fit is refused
in one line before anything is compiled or written;
`train.skip_memory_check=True` runs it anyway.

`summary_lines`: the block train.py prints at start: devices and mesh,
parameters, tokens and FLOPs per step (and the budget that set num_steps),
memory, data and epochs (of each source of a data.mixture), the peak of the learning rate and what the schedule
does after it (a warning when the warm-up is longer than the run), the
workdir and what was restored.

`out_of_memory`: the one-line error for an allocation that still fails at run time.
"""
import os

import jax
import numpy as np

from configs import validation
from configs.errors import UserError
from data import mixture
from model import accounting
from training.hardware import device_memory_limit

SHRINK_FLAGS = ("--config.train.batch_size (smaller), --config.train.grad_accum_steps (more "
                "micro-batches), --config.train.seq_len, --config.train.remat=full, "
                "--config.model.dtype=bfloat16, or more devices on --config.mesh.fsdp")


def format_bytes(n: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{int(n)} B"


def _count(n: float) -> str:
  """12_345_678 -> '12.3M'."""
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:,.2f}{unit}"
  return f"{n:,.0f}"


def memory_per_device(config, mesh) -> int:
  """Training-memory estimate of one device, bytes.

  Parameters, gradients and optimizer state are split over the fsdp and
  tensor axes (routed experts over expert too, `state_split`); activations
  over every device (the batch over data x fsdp x expert, the hidden widths
  over tensor).
  """
  parts = accounting.training_memory_bytes(config, jax.default_backend())
  state = parts["parameters"] + parts["gradients"] + parts["optimizer_state"]
  return int(state / state_split(config, mesh)) + parts["activations"] // mesh.size


def state_split(config, mesh) -> float:
  """How many ways the parameters (and their gradients and optimizer state)
  split on average: fsdp x tensor, and the routed experts, a fraction f of
  them, also over expert: fsdp x tensor / (1 - f + f / expert)."""
  f = (accounting.routed_expert_params(config.model)
       / accounting.formula_params(config.model)["params_total"])
  return mesh.shape["fsdp"] * mesh.shape["tensor"] / (1 - f + f / mesh.shape["expert"])


def check_memory(config, mesh) -> tuple[int, int | None, str]:
  """(estimate per device, limit or None, what the limit is); a UserError
  when the estimate exceeds the limit, unless train.skip_memory_check."""
  estimate = memory_per_device(config, mesh)
  device = jax.local_devices()[0]
  limit, what = device_memory_limit(device)
  # CPU devices of one process share the host's RAM.
  sharing = len(jax.local_devices()) if device.platform == "cpu" else 1
  if limit is not None and estimate * sharing > limit and not config.train.skip_memory_check:
    t = config.train
    raise UserError(
        f"this run needs about {format_bytes(estimate)} per device (batch {t.batch_size} x "
        f"sequence {t.seq_len}, grad_accum {t.grad_accum_steps}), more than the "
        f"{format_bytes(limit // sharing)} of {what}; shrink it with {SHRINK_FLAGS}, or run anyway with "
        "--config.train.skip_memory_check=True")
  return estimate, limit, what


def is_out_of_memory(error: BaseException) -> bool:
  """Whether an exception is XLA's (or numpy's) failure to allocate."""
  if isinstance(error, MemoryError):
    return True
  text = str(error)
  return isinstance(error, jax.errors.JaxRuntimeError) and (
      "RESOURCE_EXHAUSTED" in text or "Out of memory" in text)


def out_of_memory(config, estimate: int) -> UserError:
  """The one-line error for an allocation that failed at run time."""
  t = config.train
  return UserError(f"out of memory: batch {t.batch_size} x sequence {t.seq_len} (grad_accum "
                   f"{t.grad_accum_steps}), estimated {format_bytes(estimate)} per device, did "
                   f"not fit; shrink it with {SHRINK_FLAGS}")


def schedule_line(config, schedule) -> str:
  """Where the learning rate peaks (steps counted from 1) and what it does
  after, or a warning when the warm-up keeps it below train.learning_rate."""
  t = config.train
  rates = np.asarray(schedule(np.arange(t.num_steps)))
  peak, at = float(rates.max()), int(rates.argmax()) + 1
  line = f"schedule    learning rate peaks at {peak:.3g} at step {at}/{t.num_steps}"
  if peak < 0.999 * t.learning_rate:
    return line + (f"; warning: below train.learning_rate={t.learning_rate:g}, since "
                   f"train.warmup_steps={t.warmup_steps} >= num_steps: lower "
                   "train.warmup_steps")
  last = f"{float(rates[-1]):.3g} at step {t.num_steps}"
  if at == t.num_steps:
    return line
  if t.schedule == "constant":
    return line + ", then constant"
  if t.schedule == "wsd":
    return line + f", held to step {validation.decay_start(t) + 1}, then a linear decay to {last}"
  how = {"cosine": "a cosine", "linear": "a linear", "inverse_sqrt": "an inverse-sqrt"}
  return line + f", then {how[t.schedule]} decay to {last}"


def _budget_lines(config, tokens: int, flops: int) -> list[str]:
  """The budget that set train.num_steps (`accounting.with_budget`), if any."""
  given = validation.budget(config.train)
  if given is None:
    return []
  field, amount = given
  per_step = f"{tokens:,} tokens" if field == "train.token_budget" else f"{_count(flops)} FLOPs"
  return [f"budget      {field}={amount:g} / {per_step} per step = {config.train.num_steps} "
          "steps (train.num_steps)"]


def mixture_lines(config, rows: dict[str, tuple[int, int]]) -> list[str]:
  """A data.mixture's sources: weight, rows of each split, and the rows and
  epochs of it that train.num_steps draw (`mixture.Draws`)."""
  mix = mixture.sources(config)
  if not mix:
    return []
  t = config.train
  drawn = mixture.Draws({source.name: source.weight for source in mix}).rows(
      t.num_steps * t.batch_size)
  total = sum(source.weight for source in mix)
  return [f"  {source.name:<10}  weight {source.weight:g} ({source.weight / total:.1%}): "
          f"train {rows[source.name][0]:,} rows, validation {rows[source.name][1]:,} rows; "
          f"draws {drawn[source.name]:,} rows = "
          f"{drawn[source.name] / max(rows[source.name][0], 1):.3g} epochs"
          for source in mix]


def summary_lines(config, mesh, *, workdir: str, restored: str, memory: tuple,
                  rows: dict[str, tuple[int, int]], schedule) -> list[str]:
  """The start-up block (see the module docstring); `rows`: the train and
  validation rows of each source (`pipeline.split_rows`)."""
  t = config.train
  train_rows = sum(train for train, _ in rows.values())
  val_rows = sum(val for _, val in rows.values())
  params = accounting.formula_params(config.model, t.mtp_depth)
  total = params["params_total"]
  tokens = t.batch_size * t.seq_len
  flops = accounting.flops_per_token(config.model, t.seq_len, train=True,
                                     mtp_depth=t.mtp_depth) * tokens
  devices = jax.devices()
  estimate, limit, what = memory
  epochs = t.num_steps * t.batch_size / max(train_rows, 1)
  mesh_shape = " x ".join(f"{name} {size}" for name, size in mesh.shape.items()
                         if name not in ("expert", "context") or size > 1)
  lines = [
      f"devices     {len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), "
      f"{jax.process_count()} process(es); mesh {mesh_shape}",
      f"parameters  {_count(total)} ({_count(total - params['params_embedding'])} "
      "non-embedding" + (f"; {_count(params['params_active'])} active per token"
                         if params["params_active"] != total else "")
      + (f"; {_count(params['params_mtp'])} in {t.mtp_depth} MTP modules" if t.mtp_depth
         else "") + ")",
      f"step        {t.batch_size} x {t.seq_len} = {tokens:,} tokens, "
      f"{_count(flops)} FLOPs (6N + attention"
      + (", N active" if params["params_active"] != total else "")
      + (f", the {t.mtp_depth} MTP modules and their head included" if t.mtp_depth else "")
      + ")",
      *_budget_lines(config, tokens, flops),
      f"memory      about {format_bytes(estimate)} per device (estimate), "
      + (f"of {format_bytes(limit)} ({what})" if limit is not None else "no limit known"),
      f"data        train {train_rows:,} rows = {_count(train_rows * t.seq_len)} tokens, "
      f"validation {val_rows:,} rows = {_count(val_rows * t.seq_len)} tokens; "
      + (f"{t.num_steps} steps cover {epochs:.3g} epochs" if not config.data.mixture else
         f"a mixture of {len(rows)} sources, each drawn by its weight:"),
      *mixture_lines(config, rows),
      schedule_line(config, schedule),
      f"workdir     {os.path.abspath(workdir)}",
      f"restored    {restored}",
  ]
  return lines
