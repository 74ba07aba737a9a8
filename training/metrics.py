"""Metrics: the loss, perplexity and accuracy of an evaluation (of each source
of a data.mixture too, with its `Progress` in batches), and their record in
`metrics.jsonl` and the run's trackers (training/trackers.py; process 0 only)."""
import json
import math
import os
import sys
import time

import jax
from tqdm import tqdm

from training import trackers


class Progress:
  """Batches done of `total` in an evaluation, on stderr, as the training loop
  shows its steps: a tqdm bar on a terminal (`disable=None`, the loop's rule),
  and where there is none (a sweep's log, CI) a line at every tenth of the
  total and at the end: `eval: 61/122 batches, 3.2 s`. A context manager."""

  def __init__(self, total: int, desc: str = "eval"):
    self.total, self.desc, self.done = total, desc, 0
    self._bar = tqdm(total=total, desc=desc, unit="batch", disable=None, file=sys.stderr)
    self._every = max(1, -(-total // 10))
    self._start = time.perf_counter()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._bar.close()

  def update(self) -> None:
    self.done += 1
    self._bar.update(1)
    if self._bar.disable and (self.done % self._every == 0 or self.done == self.total):
      print(f"{self.desc}: {self.done}/{self.total} batches, "
            f"{time.perf_counter() - self._start:.1f} s", file=sys.stderr, flush=True)


def evaluate(eval_fn, params, batches, progress: Progress | None = None) -> dict:
  """Loss, perplexity and token accuracy over `batches` (sums, then ratios),
  each batch counted in `progress` (None: none shown). With multi-token
  prediction (an eval step of train.mtp_depth > 0, whose sums go on with each
  depth's loss, count and correct count), also `mtp<k>_loss` and
  `mtp<k>_accuracy` per depth k; `loss` stays the main model's."""
  totals = None
  for batch in batches:
    sums = [float(x) for x in jax.device_get(eval_fn(params, batch))]
    totals = sums if totals is None else [t + x for t, x in zip(totals, sums)]
    if progress is not None:
      progress.update()
  loss_sum, count, correct = (totals or [0.0] * 3)[:3]
  loss = loss_sum / max(count, 1.0)
  out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
         "accuracy": correct / max(count, 1.0), "targets": count}
  for k, at in enumerate(range(4, len(totals or ()), 3), start=1):
    depth_loss, depth_count, depth_correct = totals[at:at + 3]
    out[f"mtp{k}_loss"] = depth_loss / max(depth_count, 1.0)
    out[f"mtp{k}_accuracy"] = depth_correct / max(depth_count, 1.0)
  return out


def evaluate_mixture(eval_fn, params, batches: dict[str, list], weights: dict[str, float],
                     progress: Progress | None = None) -> tuple[dict, dict]:
  """A mixture's validation: (the mixture's metrics, each source's by name).

  Each source's are `evaluate`'s over its own batches (all of them counted
  in `progress`). The mixture's loss and accuracy are the sources' weighted
  by their data.mixture weights (what a row drawn as training draws them
  scores), its perplexity exp(loss), its targets their sum; with
  multi-token prediction each depth's `mtp<k>_loss` and `mtp<k>_accuracy`
  are weighted alike.
  """
  by_source = {name: evaluate(eval_fn, params, b, progress) for name, b in batches.items()}
  total = sum(weights.values())

  def weighted(key):
    return sum(weights[name] * m[key] for name, m in by_source.items()) / total

  loss = weighted("loss")
  depths = [key for key in next(iter(by_source.values())) if key.startswith("mtp")]
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": weighted("accuracy"),
          "targets": sum(m["targets"] for m in by_source.values()),
          **{key: weighted(key) for key in depths}}, by_source


def by_name(by_source: dict[str, dict]) -> dict:
  """Each source's metrics as one record holds them: `<metric>/<source name>`."""
  return {f"{key}/{name}": value for name, metrics in by_source.items()
          for key, value in metrics.items()}


class MetricsWriter:
  """One JSON line per (step, split) in metrics.jsonl, and the same scalars as
  `<split>/<name>` to each tracker of train.trackers (opened with the config)."""

  def __init__(self, workdir: str, config):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
      self._trackers = trackers.open_run(config, workdir)

  def write(self, step: int, split: str, scalars: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, "split": split, **scalars}) + "\n")
    self._jsonl.flush()
    for tracker in self._trackers:
      tracker.log_metrics(step, {f"{split}/{k}": v for k, v in scalars.items()})

  def close(self, failed: bool = False) -> None:
    """Closes the file and the trackers; `failed`: the run ends in an error."""
    if self.enabled:
      self._jsonl.close()
      for tracker in self._trackers:
        tracker.close(failed)


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
