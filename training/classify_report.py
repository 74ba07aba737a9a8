"""The report of a classification run (train.objective=classify), behind eval.py.

Every example of the evaluated split is classified (batched, the padded
rows masked); the labelled ones are scored: accuracy, macro-F1 (the mean of
the per-class F1 over the run's labels), per-class precision, recall, F1 and
support, the loss, and the confusion matrix (rows: the true label, columns:
the prediction), drawn as `confusion_matrix.png`. Beside them the
majority-class baseline: the most frequent label of the evaluated examples,
the best any constant guess scores there. Each example's prediction goes to
`predictions.jsonl` (name, predicted label, its probability, the true label
when there is one).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from matplotlib.figure import Figure

from training.metrics import Progress

BATCH = 64  # examples per classification call


def predict_logits(model, rows) -> np.ndarray:
  """Float32 logits [N, num_labels] of every example of `rows` (ClassifyRows),
  the batches done shown on stderr (`training.metrics.Progress`)."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def logits(params, batch):
    return nnx.merge(graphdef, params).classify(batch["inputs"], batch["padding_mask"] > 0,
                                                batch["token_types"])

  out = []
  with Progress(-(-rows.num_examples // BATCH)) as progress:
    for start in range(0, rows.num_examples, BATCH):
      batch = [rows(i) for i in range(start, start + BATCH)]  # past the end: filler rows
      stacked = {k: jnp.asarray(np.stack([row[k] for row in batch])) for k in batch[0]}
      out.append(np.asarray(logits(params, stacked))[:min(BATCH, rows.num_examples - start)])
      progress.update()
  return np.concatenate(out)


def scores(true: np.ndarray, predicted: np.ndarray, labels: tuple[str, ...]) -> dict:
  """Accuracy, macro-F1, per-class precision/recall/F1/support and the
  confusion matrix of label ids `true` and `predicted`."""
  k = len(labels)
  confusion = np.zeros((k, k), np.int64)
  np.add.at(confusion, (true, predicted), 1)
  per_class, f1s = {}, []
  for i, name in enumerate(labels):
    hits, predicted_i, support = confusion[i, i], confusion[:, i].sum(), confusion[i].sum()
    precision = hits / predicted_i if predicted_i else 0.0
    recall = hits / support if support else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    f1s.append(f1)
    per_class[name] = {"precision": float(precision), "recall": float(recall), "f1": float(f1),
                       "support": int(support)}
  return {"accuracy": float(np.mean(true == predicted)), "macro_f1": float(np.mean(f1s)),
          "per_class": per_class, "confusion_matrix": confusion.tolist()}


def plot_confusion(confusion: np.ndarray, labels: tuple[str, ...], title: str,
                   path: str) -> None:
  """The confusion matrix as a PNG: colour the share of each true label's
  examples, each cell's count written in it."""
  k = len(labels)
  share = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
  size = max(4.0, 0.6 * k + 2.0)
  fig = Figure(figsize=(size + 1.0, size))
  ax = fig.subplots()
  image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
  fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true label")
  for i in range(k):
    for j in range(k):
      ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8,
              color="white" if share[i, j] > 0.5 else "black")
  ax.set_xticks(range(k), labels, rotation=45, ha="right", fontsize=8)
  ax.set_yticks(range(k), labels, fontsize=8)
  ax.set_xlabel("predicted")
  ax.set_ylabel("true")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _write_predictions(path: str, rows, predicted: np.ndarray, probability: np.ndarray) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for i, example in enumerate(rows.examples):
      record = {"name": example.name, "label": rows.labels[predicted[i]],
                "probability": round(float(probability[i]), 6)}
      if example.label is not None:
        record["true"] = example.label
      f.write(json.dumps(record) + "\n")
  os.replace(tmp, path)


def classify_report(model, rows, workdir: str, title: str) -> tuple[dict, list[str]]:
  """(report, files written) of the examples of `rows`, into `workdir`."""
  logits = predict_logits(model, rows)
  log_probs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  predicted = np.asarray(logits.argmax(axis=-1))
  probability = np.exp(np.asarray(log_probs.max(axis=-1)))
  files = [os.path.join(workdir, "predictions.jsonl")]
  _write_predictions(files[0], rows, predicted, probability)
  report = {"examples": rows.num_examples, "labels": list(rows.labels)}
  labelled = rows.label_ids >= 0
  if not labelled.any():
    return report, files
  true = rows.label_ids[labelled]
  counts = np.bincount(true, minlength=len(rows.labels))
  report["labelled_examples"] = int(labelled.sum())
  report["loss"] = float(-np.asarray(log_probs)[labelled, true].mean())
  report.update(scores(true, predicted[labelled], rows.labels))
  report["majority_baseline"] = {"label": rows.labels[int(counts.argmax())],
                                 "accuracy": float(counts.max() / counts.sum()),
                                 "macro_f1": scores(true, np.full_like(true, counts.argmax()),
                                                    rows.labels)["macro_f1"]}
  png = os.path.join(workdir, "confusion_matrix.png")
  plot_confusion(np.asarray(report["confusion_matrix"]), rows.labels,
                 f"{title}: accuracy {report['accuracy']:.3f}, macro-F1 "
                 f"{report['macro_f1']:.3f} (majority {report['majority_baseline']['accuracy']:.3f})",
                 png)
  files.append(png)
  return report, files
