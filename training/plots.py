"""Loss-curve plots (matplotlib's object API, no global figure state): the
helpers behind eval.py's loss_curves.png and a sweep's validation curves."""
import re

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter


def split_curve(records: list[dict], split: str) -> tuple[list, list]:
  """(steps, losses) of one split of metrics.jsonl records."""
  rows = [r for r in records if r["split"] == split]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def wrapped(title: str, width: int = 75) -> str:
  """`title` in lines of at most about `width` characters, broken after a
  comma or a space (a sweep's run names are comma-separated fields), so that
  a long one is not cut at the figure's edge."""
  lines, line = [], ""
  for piece in re.split(r"(?<=[, ])", title):
    if line and len(line) + len(piece) > width:
      lines.append(line.rstrip())
      line = ""
    line += piece
  return "\n".join(lines + [line])


def plot_curves(path: str, title: str, curves: dict, *, baseline: float | None = None,
                learning_rate: tuple[list, list] | None = None) -> None:
  """A PNG with one line per label -> (steps, losses, matplotlib style keywords).

  `baseline`: the unigram loss, a horizontal line; `learning_rate`: (steps,
  rates) on a second y axis.
  """
  fig = Figure(figsize=(8, 4.5))
  ax = fig.subplots()
  for label, (steps, losses, style) in curves.items():
    ax.plot(steps, losses, label=label, **style)
  if baseline is not None:
    ax.axhline(baseline, color="grey", linestyle=":", label=f"unigram baseline {baseline:.3f}")
  handles, labels = ax.get_legend_handles_labels()
  if learning_rate is not None and learning_rate[0]:
    lr_ax = ax.twinx()
    lr_ax.plot(*learning_rate, color="tab:red", alpha=0.4, linewidth=1, label="learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:red")
    lr_ax.tick_params(axis="y", colors="tab:red")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    more = lr_ax.get_legend_handles_labels()
    handles, labels = handles + more[0], labels + more[1]
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  ax.set_title(wrapped(title))
  ax.grid(alpha=0.3)
  ax.legend(handles, labels, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_against_steps_tokens_and_flops(path: str, title: str, curves: dict) -> None:
  """Three panels, the same curves against steps, tokens seen and training
  FLOPs: label -> (steps, losses, tokens per step, FLOPs per step, band,
  matplotlib style keywords); `band` is (lows, highs) at the steps, shaded,
  or None."""
  fig = Figure(figsize=(16, 4.5))
  axes = fig.subplots(1, 3, sharey=True)
  for label, (steps, losses, tokens_per_step, flops_per_step, band, style) in curves.items():
    for ax, per_step in zip(axes, (1, tokens_per_step, flops_per_step)):
      x = [s * per_step for s in steps]
      line, = ax.plot(x, losses, label=label, **style)
      if band is not None:
        ax.fill_between(x, *band, color=line.get_color(), alpha=0.2, linewidth=0)
  for ax, what in zip(axes, ("step", "tokens seen", "training FLOPs (6N + attention)")):
    ax.set_xlabel(what)
    ax.grid(alpha=0.3)
  for ax in axes[1:]:
    ax.xaxis.set_major_formatter(EngFormatter())
  axes[0].set_ylabel("loss (nats per token)")
  axes[-1].legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
