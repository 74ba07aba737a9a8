"""Evaluation at another sequence length, behind `eval.py --seq_len L`.

The lesson's claims about positions, measured: a learned position table
cannot extrapolate (it has no rows past `model.max_len`, so evaluating longer
is refused), sinusoidal, RoPE and no positions at all can be run at any
length, and RoPE scaling (linear, ntk, yarn, llama3) can stretch a RoPE
model's context without retraining (`eval.py --rope_scaling yarn
--rope_scaling_factor 4`, for that evaluation only: the saved config is not
changed).

The validation split is packed into rows of L tokens (`train.seq_len` set to
L for the evaluation; positions restart at every row and document, as in
training) and the loss of every target is summed into position buckets of
equal width over [0, L), keyed by the model position of its input token
(`loss_by_position`). The report holds the table, `loss_by_position_<label>.png`
plots it with the training length marked, and `eval_lengths.json` keeps one
entry per evaluated (length, RoPE override) for the sweep report
(`sweeps/lengths.py`).
"""
import json
import math
import os

import jax
import numpy as np
from flax import nnx
from matplotlib.figure import Figure

from configs import validation
from configs.errors import UserError
from model import build_model
from model.positions import POSITIONS
from training import workdir as workdir_lib
from training.objectives import next_token_logits, token_losses

LENGTHS_FILE = "eval_lengths.json"


def apply_rope_scaling(config, scaling: str, factor: float | None) -> dict:
  """Sets `model.rope_scaling` and its factor on `config` (an evaluation's
  copy of the run's config), with `rope_original_max_len` the run's training
  length; returns the override for the report. A UserError for a run without
  RoPE, a missing factor or a bad value."""
  m = config.model
  if not POSITIONS[m.pos_emb].rotary:
    raise UserError(f"--rope_scaling {scaling}: needs a pos_emb=rope run (this run has "
                    f"model.pos_emb={m.pos_emb})")
  if factor is None:
    raise UserError(f"--rope_scaling {scaling}: give --rope_scaling_factor (how many times "
                    "the training length to stretch the context to)")
  override = dict(rope_scaling=scaling, rope_scaling_factor=float(factor),
                  rope_original_max_len=config.train.seq_len)
  m.update(**override)
  validation.validate_model(m)
  return override


def with_model_config(model, model_section):
  """`model`'s parameters in a model built from `model_section` (the same
  parameter tree: only parameter-free fields such as RoPE's may differ; its
  multi-token prediction modules, if any, kept)."""
  depth = len(getattr(model, "mtp", ()))
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: build_model(model_section, nnx.Rngs(0), mtp_depth=depth)))
  return nnx.merge(graphdef, nnx.state(model))


def apply_seq_len(config, seq_len: int) -> None:
  """Evaluates `config` (an evaluation's copy) at rows of `seq_len` tokens;
  a UserError past a learned table, or for a run that is not next_token."""
  if config.train.objective != "next_token":
    raise UserError(f"--seq_len {seq_len}: loss by position is for train.objective=next_token "
                    f"runs (this one is {config.train.objective})")
  if seq_len < 1:
    raise UserError(f"--seq_len {seq_len}: must be a positive number of tokens")
  if POSITIONS[config.model.pos_emb].bounded and seq_len > config.model.max_len:
    raise UserError(f"--seq_len {seq_len}: a learned position table has no rows past "
                    f"model.max_len={config.model.max_len}; evaluate at most that length "
                    "(the unbounded position schemes take any length)")
  config.train.seq_len = seq_len


def loss_by_position(graphdef, params, batches, *, seq_len: int, num_buckets: int) -> dict:
  """Mean loss of the targets in each of `num_buckets` position buckets of
  equal width over [0, seq_len): {"bucket_width", "buckets": [{"start",
  "end" (exclusive), "loss", "targets"}]}; a bucket without targets has loss
  None."""
  width = math.ceil(seq_len / num_buckets)
  count = math.ceil(seq_len / width)

  @jax.jit
  def losses(params, batch):
    model = nnx.merge(graphdef, params)
    return token_losses(next_token_logits(model, batch), batch["targets"])

  loss_sums, targets = np.zeros(count), np.zeros(count)
  for batch in batches:
    mask = np.asarray(batch["loss_mask"]) > 0
    bucket = np.asarray(batch["positions"])[mask] // width
    loss = np.asarray(jax.device_get(losses(params, batch)), np.float64)[mask]
    loss_sums += np.bincount(bucket, weights=loss, minlength=count)
    targets += np.bincount(bucket, minlength=count)
  buckets = [{"start": i * width, "end": min((i + 1) * width, seq_len),
              "loss": float(loss_sums[i] / targets[i]) if targets[i] else None,
              "targets": int(targets[i])} for i in range(count)]
  return {"bucket_width": width, "buckets": buckets}


def label(seq_len: int, override: dict | None) -> str:
  """The name of an evaluated length: "1024", or "1024_yarn4" with a RoPE override."""
  if not override:
    return str(seq_len)
  return f"{seq_len}_{override['rope_scaling']}{override['rope_scaling_factor']:g}"


def plot_loss_by_position(path: str, table: dict, *, train_len: int, title: str) -> None:
  """Loss against position (each bucket at its middle), the training length
  as a dashed line."""
  rows = [b for b in table["buckets"] if b["loss"] is not None]
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  ax.plot([(b["start"] + b["end"] - 1) / 2 for b in rows], [b["loss"] for b in rows],
          marker="o")
  ax.axvline(train_len, color="gray", linestyle="--", label=f"training length {train_len}")
  ax.set_xlabel("position in the row")
  ax.set_ylabel("validation loss (nats per token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def record(workdir: str, name: str, entry: dict) -> str:
  """Adds (or replaces) `name` -> `entry` in the run's eval_lengths.json,
  written whole to a temporary file and renamed; returns its path."""
  path = os.path.join(workdir, LENGTHS_FILE)
  entries = read_lengths(workdir)
  entries[name] = entry
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(entries, f, indent=2)
  os.replace(tmp, path)
  return path


def read_lengths(workdir: str) -> dict:
  """The run's eval_lengths.json ({} when no other length was evaluated)."""
  return workdir_lib.read_json(os.path.join(workdir, LENGTHS_FILE))
