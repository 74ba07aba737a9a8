"""A sweep over `train.learning_rate`: the validation loss against the learning
rate, one curve per combination of the other swept fields (such as width
and parametrization, `configs/sweeps/mup_transfer.py`), and where each
curve's optimum lies.

`loss_vs_learning_rate.png`: each variant's mean whole-split validation
loss over its seeds (the band: the lowest and highest seed, with several seeds) against the
learning rate on a log axis, one line per curve, its best point circled; with two or more other
swept fields, one panel per value of the first (the parametrization). The report's section
gives each curve's best learning rate and its place on the grid, and, for
each value of the first other swept field (the parametrization in the μP
sweep), how many grid steps the optimum moves across that value's curves: 0
or 1 is a learning rate that transfers, more is one that must be swept
again. With a second other swept field (the width), a table puts, at each of
its values, each first-field curve's best loss (mean, and the lowest and
highest seed) beside the others', and the difference from the first one's:
what each parametrization reaches at its own best learning rate.
"""
import os

from matplotlib.figure import Figure

LR = "train.learning_rate"


def _curves(summary: list[tuple[dict, list]], seed_losses: dict[str, list[float]]
            ) -> dict[tuple, dict[float, tuple]]:
  """{the other fields' values: {learning rate: (mean, lowest seed, highest
  seed) of the val loss}} over the variants with finished runs
  (`seed_losses`: each variant's finished runs' losses)."""
  curves = {}
  for row, runs in summary:
    overrides = runs[0].overrides
    if LR not in overrides or row.get("loss_mean") is None:
      continue
    key = tuple((f, v) for f, v in overrides.items() if f != LR)
    seeds = seed_losses.get(row.get("variant"))
    curves.setdefault(key, {})[float(overrides[LR])] = (
        row["loss_mean"], *((min(seeds), max(seeds)) if seeds else (None, None)))
  return _varying_only(curves)


def _varying_only(curves: dict) -> dict:
  """`curves` keyed by the fields whose value differs between curves only (a
  field every variant sets alike names no curve)."""
  fields = dict.fromkeys(f for key in curves for f, _ in key)
  varying = [f for f in fields if len({dict(key).get(f) for key in curves}) > 1]
  return {tuple((f, dict(key)[f]) for f in varying if f in dict(key)): curve
          for key, curve in curves.items()}


def _best_against_best(curves: dict, best: dict, first: str, second: str) -> list[str]:
  """At each value of `second` (the width), each `first` (parametrization)
  curve's best loss with its seeds' range, and its difference from the
  first curve's."""
  lines = ["", f"At each `{second}`, each `{first}`'s best learning rate and its loss (mean "
           "over seeds, [lowest, highest seed]), and the difference from the first "
           f"`{first}`'s best:", "",
           f"| {second.split('.')[-1]} | {first.split('.')[-1]} | best learning rate | "
           "val loss | difference |", "|---|---|---:|---:|---:|"]
  for value in dict.fromkeys(dict(key).get(second) for key in best):
    keys = [key for key in best if dict(key).get(second) == value]
    reference = curves[keys[0]][best[keys[0]]][0]
    for key in keys:
      mean, low, high = curves[key][best[key]]
      spread = f" [{low:.4f}, {high:.4f}]" if low is not None else ""
      diff = "" if key == keys[0] else f"{mean - reference:+.4f}"
      lines.append(f"| {value} | {dict(key).get(first)} | {best[key]:g} | {mean:.4f}{spread} | "
                   f"{diff} |")
  return lines


def _label(key: tuple) -> str:
  return ", ".join(f"{field.split('.')[-1]}={value}" for field, value in key) or "all"


def write_lr_section(root: str, summary: list[tuple[dict, list]], fields: list[str],
                     seed_losses: dict[str, list[float]] | None = None
                     ) -> tuple[str, list[str]]:
  """(the report's markdown section, [the PNG]) for a sweep of several
  learning rates; ("", []) otherwise. `seed_losses`: each variant's finished
  runs' val losses, for the seeds' range beside each best."""
  curves = _curves(summary, seed_losses or {})
  grid = sorted({lr for curve in curves.values() for lr in curve})
  if len(grid) < 2:
    return "", []
  best = {key: min(curve, key=lambda lr: curve[lr][0]) for key, curve in curves.items()}
  path = os.path.join(root, "loss_vs_learning_rate.png")
  named = {f for key in curves for f, _ in key}
  others = [f for f in fields if f in named]
  _plot(path, curves, best, *(others[:2] if len(others) > 1 else (None, None)))
  lines = ["", "## Loss against learning rate", "",
           f"Each curve's mean validation loss over its seeds at each `{LR}` of the grid "
           f"({', '.join(f'{lr:g}' for lr in grid)}), and its best learning rate "
           "(`loss_vs_learning_rate.png`).", "",
           "| curve | best learning rate | its val loss | place on the grid |", "|---|---:|---:|---:|"]
  for key, lr in best.items():
    lines.append(f"| {_label(key)} | {lr:g} | {curves[key][lr][0]:.4f} | "
                 f"{grid.index(lr) + 1} of {len(grid)} |")
  if len(others) > 1:
    lines += ["", f"How far the optimum moves across the curves of each `{others[0]}`, in grid "
              "steps (a factor between neighbouring learning rates):", ""]
    for value in dict.fromkeys(dict(key).get(others[0]) for key in best):
      places = [grid.index(lr) for key, lr in best.items() if dict(key).get(others[0]) == value]
      lines.append(f"- {others[0]}={value}: {max(places) - min(places)} grid step(s) over "
                   f"{len(places)} curves")
    lines += _best_against_best(curves, best, others[0], others[1])
  return "\n".join(lines) + "\n", [path]


def _plot(path: str, curves: dict, best: dict, panel_field: str | None,
          colour_field: str | None) -> None:
  """One panel per value of `panel_field` (the parametrization in the μP
  sweep; None: one panel), one line per curve in it, each curve's best point
  circled; a value of `colour_field` (the width) has one colour in every panel,
  where it tells a panel's curves apart; else the fields that do have one."""
  panels = list(dict.fromkeys(dict(key).get(panel_field) for key in curves))
  in_panels = [[k for k in curves if dict(k).get(panel_field) == v] for v in panels]
  if colour_field and any(len({dict(k).get(colour_field) for k in in_panel}) < len(in_panel)
                          for in_panel in in_panels):
    colour_field = None
  varying = {f for in_panel in in_panels for key in in_panel for f, _ in key
             if len({dict(k).get(f) for k in in_panel}) > 1}
  fig = Figure(figsize=(4.5 * len(panels) + 1.5, 4.5))
  axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
  colours: dict = {}
  for ax, value in zip(axes, panels):
    for key, curve in curves.items():
      if dict(key).get(panel_field) != value:
        continue
      rest = tuple((f, v) for f, v in key if f != panel_field)
      lrs = sorted(curve)
      colour = (dict(key).get(colour_field) if colour_field
                else tuple((f, v) for f, v in rest if f in varying))
      line, = ax.plot(lrs, [curve[lr][0] for lr in lrs], marker=".", label=_label(rest),
                      color=colours.get(colour))
      colours[colour] = line.get_color()
      if all(curve[lr][1] is not None for lr in lrs):
        ax.fill_between(lrs, [curve[lr][1] for lr in lrs], [curve[lr][2] for lr in lrs],
                        color=line.get_color(), alpha=0.15)
      ax.plot([best[key]], [curve[best[key]][0]], "o", markersize=10, fillstyle="none",
              color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learning rate")
    ax.set_title(f"{panel_field.split('.')[-1]}={value}" if panel_field else
                 "loss against learning rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0].set_ylabel("validation loss, whole split (mean over seeds)")
  fig.suptitle("loss against learning rate\n(circle: each curve's best; band: min-max over "
               "seeds)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
