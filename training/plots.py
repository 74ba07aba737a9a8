"""Loss-curve plots (matplotlib's object API, no global figure state): the one
helper behind eval.py's loss_curves.png and a sweep's validation curves."""
from matplotlib.figure import Figure


def split_curve(records: list[dict], split: str) -> tuple[list, list]:
  """(steps, losses) of one split of metrics.jsonl records."""
  rows = [r for r in records if r["split"] == split]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def plot_curves(path: str, title: str, curves: dict) -> None:
  """A PNG with one line per label -> (steps, losses, matplotlib style keywords)."""
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  for label, (steps, losses, style) in curves.items():
    ax.plot(steps, losses, label=label, **style)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
