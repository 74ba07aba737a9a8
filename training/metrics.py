"""Metrics to `metrics.jsonl` and TensorBoard (tensorboardX); process 0 only."""
import json
import os

import jax
from tensorboardX import SummaryWriter


class MetricsWriter:
  """One JSON line per (step, split) and the same scalars in TensorBoard."""

  def __init__(self, workdir: str):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, split: str, scalars: dict) -> None:
    if not self.enabled:
      return
    record = {"step": step, "split": split, **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for name, value in scalars.items():
      self._tb.add_scalar(f"{split}/{name}", float(value), step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
