"""μP's coordinate check: activation sizes against width, under sp and mup.

For each width d in `--widths` (heads fixed, so head_dim = d / heads, and
d_ff = `--ff_mult` x d) and each parametrization, `--config` is trained for
`--steps` steps of AdamW at a constant learning rate `--lr` on one fixed
batch of the run's training text, its bytes as tokens (the same batch at
every width), and after each step the
RMS over that batch is measured of: the embedding output, each block's
output (the residual stream) and the logits. Under the standard
parametrization they grow with width as training moves the weights (the
hidden matrices' updates add up over d inputs); under μP
(`model.parametrization=mup`, base width `--base_width`) they stay flat.
Those are the curves of Tensor Programs V's Figure 5.

  python -m bench.coord_check --config configs/tiny.py --widths 64,128,256,512,1024

Prints a table (the last step's RMS per width, and the ratio of the widest
to the narrowest), writes bench/results/coord_check-<date>.json (or `--out`)
and a PNG beside it: one panel per parametrization and measured point, RMS
against width, one line per step.
"""
import datetime
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from matplotlib.figure import Figure
from ml_collections import config_flags

from bench.bench_utils import command_line, git_commit
from configs.cli import parse_flags
from data import sources
from model import build_model
from model.resolve import resolve
from training import steps as steps_lib
from training.optim import learning_rate_schedule, model_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """The command's flags, defined when it runs (so that importing this module,
  as tests/test_mup.py does, defines none)."""
  config_flags.DEFINE_config_file("config", "configs/tiny.py", "A decoder config.",
                                  lock_config=True)
  flags.DEFINE_list("widths", ["64", "128", "256", "512", "1024"], "d_model values.")
  flags.DEFINE_integer("base_width", 64, "model.mup_base_width under mup.")
  flags.DEFINE_integer("ff_mult", 3, "d_ff = ff_mult x d_model.")
  flags.DEFINE_integer("steps", 5, "Training steps (measured after each).")
  flags.DEFINE_float("lr", 1e-2, "Constant learning rate (AdamW).")
  flags.DEFINE_integer("rows", 8, "Rows of the fixed batch.")
  flags.DEFINE_string("out", None, "JSON output; default "
                      "bench/results/coord_check-<date>.json (the PNG beside it).")


def at_width(config, width: int, parametrization: str, *, base_width: int, ff_mult: int,
             lr: float, steps: int):
  """`config` at d_model `width` (d_ff = ff_mult x width) under
  `parametrization`, trained `steps` steps at constant `lr`."""
  c = config.copy_and_resolve_references()
  c.model.update(d_model=width, d_ff=ff_mult * width, parametrization=parametrization,
                 mup_base_width=base_width if parametrization == "mup" else None)
  c.train.update(learning_rate=lr, warmup_steps=0, schedule="constant", num_steps=steps,
                 weight_decay=0.0, grad_clip=0.0, optimizer="adamw")
  return resolve(c)


def _rms(x) -> float:
  return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


def activation_rms(model, tokens_BT) -> dict[str, float]:
  """RMS of the embedding output, each block's output and the logits of a
  decoder on `tokens_BT`."""
  stack = model.decoder
  positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  x_BTM = stack.embed_tokens(tokens_BT, positions_BT)
  out = {"embedding": _rms(x_BTM)}
  for i in range(stack.num_layers):
    x_BTM, _ = stack.block(i)(x_BTM, positions_BT=positions_BT, causal=True)
    out[f"block {i}"] = _rms(x_BTM)
  if stack.final_norm is not None:
    x_BTM = stack.final_norm(x_BTM)
  out["logits"] = _rms(model.logits(stack, x_BTM))
  return out


def coordinates(config, tokens_BT) -> list[dict[str, float]]:
  """`activation_rms` after each of config.train.num_steps steps of
  next-token training on the one batch `tokens_BT`."""
  tc = config.train
  model = build_model(config.model, nnx.Rngs(tc.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = model_optimizer(config)
  step = steps_lib.jit_train_step(graphdef, tx, learning_rate_schedule(tc), "next_token", 1)
  state = steps_lib.init_state(params, tx, tc.seed)
  T = tokens_BT.shape[1]
  batch = {"inputs": tokens_BT, "targets": jnp.roll(tokens_BT, -1, axis=1),
           "segment_ids": jnp.ones_like(tokens_BT),
           "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BT.shape),
           "loss_mask": jnp.ones(tokens_BT.shape, jnp.float32)}
  out = []
  for _ in range(tc.num_steps):
    state, _ = step(state, batch)
    out.append(activation_rms(nnx.merge(graphdef, state["params"]), tokens_BT))
  return out


def text_batch(config, rows: int):
  """[rows, train.seq_len] tokens of the run's training text (data.source),
  each UTF-8 byte b as token b + 1: real text, no tokenizer to train."""
  need, data = rows * config.train.seq_len, bytearray()
  for _, text in sources.iter_documents(config.data, "train"):
    data += text.encode("utf-8")
    if len(data) >= need:
      break
  return jnp.asarray(np.frombuffer(bytes(data[:need]), np.uint8).astype(np.int32) + 1).reshape(
      rows, -1)


def run(config, widths, *, base_width, ff_mult, lr, steps, rows) -> dict:
  """{parametrization: {width: [per-step activation_rms]}} on one batch of text."""
  tokens = text_batch(config, rows)
  return {p: {w: coordinates(at_width(config, w, p, base_width=base_width, ff_mult=ff_mult,
                                      lr=lr, steps=steps), tokens)
              for w in widths}
          for p in ("sp", "mup")}


def table(results: dict) -> str:
  """The last step's RMS per width and point, and widest / narrowest."""
  lines = []
  for p, by_width in results.items():
    widths = sorted(by_width)
    points = list(by_width[widths[0]][-1])
    lines += [f"{p}: RMS after the last step", "| point | " + " | ".join(
        f"d={w}" for w in widths) + f" | d={widths[-1]} / d={widths[0]} |",
              "|---|" + "---:|" * (len(widths) + 1)]
    for point in points:
      last = [by_width[w][-1][point] for w in widths]
      lines.append(f"| {point} | " + " | ".join(f"{v:.3f}" for v in last)
                   + f" | {last[-1] / last[0]:.2f}x |")
    lines.append("")
  return "\n".join(lines)


def plot(path: pathlib.Path, results: dict) -> None:
  """One row per parametrization, one panel per point: RMS against width,
  one line per step."""
  params = list(results)
  widths = sorted(results[params[0]])
  points = list(results[params[0]][widths[0]][-1])
  fig = Figure(figsize=(3.2 * len(points), 2.8 * len(params)))
  axes = fig.subplots(len(params), len(points), squeeze=False)
  for r, p in enumerate(params):
    steps = len(results[p][widths[0]])
    for c, point in enumerate(points):
      ax = axes[r][c]
      for s in range(steps):
        ax.plot(widths, [results[p][w][s][point] for w in widths], marker=".",
                color=(s / max(steps - 1, 1), 0.2, 1 - s / max(steps - 1, 1)),
                label=f"step {s + 1}")
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(f"{p}: {point}", fontsize=9)
      ax.set_xlabel("width (d_model)", fontsize=8)
      ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("RMS")
  axes[-1][0].set_ylabel("RMS")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  widths = [int(w) for w in FLAGS.widths]
  results = run(FLAGS.config, widths, base_width=FLAGS.base_width, ff_mult=FLAGS.ff_mult,
                lr=FLAGS.lr, steps=FLAGS.steps, rows=FLAGS.rows)
  print(table(results))
  out = pathlib.Path(FLAGS.out or ROOT / "bench" / "results" /
                     f"coord_check-{datetime.date.today()}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({
      "command": command_line(), "commit": git_commit(), "device": jax.devices()[0].device_kind,
      "base_width": FLAGS.base_width, "lr": FLAGS.lr, "steps": FLAGS.steps,
      "results": {p: {str(w): v for w, v in r.items()} for p, r in results.items()}}, indent=1))
  plot(out.with_suffix(".png"), results)
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
