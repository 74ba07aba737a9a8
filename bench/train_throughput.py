"""Training throughput: our train step beside a plain-JAX step of the same model.

Both steps run in this one process, on the same random token batch of the
config's train.batch_size x train.seq_len (segment ids all 1, positions
0..S-1, loss_mask ones), resident on the device (no data loading is timed):

- `ours`: `training.steps.jit_train_step` on the state of `init_state`,
  donated, exactly as train.py runs it (AdamW with the warm-up/cosine
  schedule, global-norm clipping, the weight-decay mask, the non-finite
  guard and the step metrics).
- `plain`: the same model written the way a user would write it:
  `graphdef, params = nnx.split(model)`, a loss that does `nnx.merge` and
  `optax.softmax_cross_entropy_with_integer_labels(...).mean()`,
  `jax.value_and_grad`, `optax.adamw` with the same learning rate, betas and
  weight decay (no clipping, no mask), `optax.apply_updates`, all under
  `jax.jit` with params and optimizer state donated. It calls the model with
  the same segment ids and positions as ours, so the two compute the same
  forward pass. `--tokens_only_row` adds `plain_tokens_only`, which calls
  `model(inputs)` alone (no segment mask), as for unpacked data;
  `--ours_only` leaves `plain` out (a second attention_impl, say).

Times are the median of `--steps` timed steps after `--warmup` warm-up steps,
each ended by `jax.block_until_ready`; the variants alternate step by step so
that a noisy machine slows them alike. Both models start from the same
parameters (same seed), so their first-step losses must agree.

FLOPs per token follow docs/benchmarks.md (the PaLM appendix):
`model.accounting.flops_per_token` = 6 N + 12 L S d_attn, N the parameters
without the position table. MFU = tokens/s x FLOPs per token / peak, the
peak from `training.loop.peak_flops` (the `training/hardware.py` table or
train.peak_tflops), or `--peak_tflops`; none is known on a CPU ("n/a").

  python -m bench.train_throughput --config configs/tiny.py
  python -m bench.train_throughput --config configs/gpt2_small.py --steps 30
"""
import datetime
import json
import pathlib
import statistics
import sys
import time

import flax
import jax
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from bench.bench_utils import command_line, git_commit
from configs.cli import parse_flags
from configs.errors import UserError
from configs.validation import head_dim
from model import accounting, build_model
from model.attention import choose_implementation
from model.layers import DTYPES
from model.resolve import resolve
from training.loop import peak_flops
from training.optim import learning_rate_schedule, make_optimizer, mup_width
from training.steps import init_state, jit_train_step

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per variant (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps per variant first (compilation).")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "bench/results/train_throughput_<config name>.json.")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "Per-device peak TFLOP/s for MFU; "
                                  "0: train.peak_tflops or the device's datasheet.")
_TOKENS_ONLY_ROW = flags.DEFINE_boolean("tokens_only_row", False, "Also time the plain step "
                                        "calling model(inputs) without segment ids/positions.")
_OURS_ONLY = flags.DEFINE_boolean("ours_only", False, "Time our step alone (another "
                                  "attention_impl, say, beside a run that timed plain).")
flags.mark_flags_as_required(["config"])


def random_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> dict:
  """A next-token batch of uniform random tokens: one segment per row, no padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.ones((batch_size, seq_len), np.int32),
           "positions": np.ascontiguousarray(positions),
           "loss_mask": np.ones((batch_size, seq_len), np.float32)}
  return jax.device_put(batch)


def make_plain_step(graphdef, train_cfg, *, tokens_only: bool):
  """The reference step, as a user would write it: (params, opt_state, batch) -> ..."""
  tx = optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                   weight_decay=train_cfg.weight_decay)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    if tokens_only:
      logits = model(batch["inputs"])
    else:
      logits = model(batch["inputs"], segment_ids=batch["segment_ids"],
                     positions=batch["positions"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, jax.jit(step, donate_argnums=(0, 1))


class Variant:
  """One step function with its donated state; `run()` does one step, blocking."""

  def __init__(self, name: str, description: str, state, step_fn, loss_of):
    self.name, self.description = name, description
    self.state, self.step_fn, self.loss_of = state, step_fn, loss_of
    self.times: list[float] = []
    self.compile_s = None
    self.first_loss = None

  def run(self, batch) -> float:
    start = time.perf_counter()
    self.state, out = self.step_fn(self.state, batch)
    jax.block_until_ready((self.state, out))
    seconds = time.perf_counter() - start
    if self.first_loss is None:
      self.compile_s = seconds
      self.first_loss = float(self.loss_of(out))
    return seconds


def build_variants(config, tokens_only_row: bool, ours_only: bool = False) -> list[Variant]:
  tc = config.train

  def make_model():
    return build_model(config.model, nnx.Rngs(tc.seed), remat=tc.remat)

  # Ours, as train.py builds it.
  graphdef, _ = nnx.split(nnx.eval_shape(make_model))
  tx, schedule = make_optimizer(tc, mup_width(config.model)), learning_rate_schedule(tc)
  state = init_state(nnx.split(make_model())[1], tx, tc.seed)
  ours_fn = jit_train_step(graphdef, tx, schedule, tc.objective, tc.grad_accum_steps)
  variants = [Variant("ours", "training.steps.jit_train_step (train.py's step, donated)",
                      state, ours_fn, lambda metrics: metrics["loss"])]
  if ours_only:
    return variants

  def plain(name, description, tokens_only):
    plain_graphdef, params = nnx.split(make_model())
    plain_tx, plain_fn = make_plain_step(plain_graphdef, tc, tokens_only=tokens_only)

    def step(st, batch):
      params, opt_state, loss = plain_fn(st[0], st[1], batch)
      return (params, opt_state), loss

    return Variant(name, description, (params, plain_tx.init(params)), step, lambda loss: loss)

  variants.append(plain("plain", "nnx.split/merge + value_and_grad + optax.adamw, jit donated; "
                        "model(inputs, segment_ids, positions)", tokens_only=False))
  if tokens_only_row:
    variants.append(plain("plain_tokens_only", "as plain, but model(inputs) alone",
                          tokens_only=True))
  return variants


def flop_formula(config) -> dict:
  """FLOPs per token and the terms of 6 N + 12 L S d_attn."""
  m, seq_len = config.model, config.train.seq_len
  params = accounting.formula_params(m)
  n = params["params_total"] - params["params_position_table"]
  d_attn = m.num_heads * head_dim(m)
  total = accounting.flops_per_token(m, seq_len, train=True)
  layers = (total - 6 * n) // (12 * seq_len * d_attn)  # attention sublayers, as accounting counts
  return {"name": "PaLM: 6N + 12 L S d_attn (model.accounting.flops_per_token, train=True)",
          "N": n, "L": layers, "S": seq_len, "d_attn": d_attn, "flops_per_token": total,
          "params_total": params["params_total"]}


def fmt(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
  lines = ["| step | ms/step | tokens/s | TFLOP/s | MFU | vs plain |",
           "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['name']} | {r['ms_per_step']:.2f} | {r['tokens_per_second']:,.0f} | "
                 f"{r['tflops']:.3f} | {fmt(r['mfu'] and 100 * r['mfu'], '.1f')}"
                 f"{'%' if r['mfu'] is not None else ''} | {fmt(r['ratio_vs_plain'], '.3f')} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  try:
    config = resolve(config)
    if config.train.objective != "next_token":
      raise UserError(f"train.objective={config.train.objective!r}: this benchmark times "
                      "next_token (decoder) models only")
    if _STEPS.value < 1 or _WARMUP.value < 1:
      raise UserError("--steps and --warmup must be at least 1")
  except (UserError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)

  config_name = pathlib.Path(flags.FLAGS["config"].config_filename).stem
  out = pathlib.Path(_OUT.value or ROOT / "bench" / "results" /
                     f"train_throughput_{config_name}.json")
  tc, m = config.train, config.model
  device = jax.devices()[0]
  flop = flop_formula(config)
  if _PEAK_TFLOPS.value > 0:
    peak = _PEAK_TFLOPS.value * 1e12 * jax.device_count()
  else:
    peak = peak_flops(config)
  attention = m.attention_impl
  if attention == "auto":
    probe = jax.ShapeDtypeStruct((1, 1, m.num_heads, head_dim(m)), DTYPES[m.dtype])
    attention = f"auto -> {choose_implementation(probe, ('score:softmax',), segments=True)}"
  tokens_per_step = tc.batch_size * tc.seq_len
  meta = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "command": command_line(), "commit": git_commit(),
      "device": device.device_kind, "backend": jax.default_backend(),
      "device_count": jax.device_count(), "jax": jax.__version__,
      "jaxlib": _jaxlib_version(),
      "flax": flax.__version__, "optax": optax.__version__,
      "config": config_name, "batch_size": tc.batch_size, "seq_len": tc.seq_len,
      "tokens_per_step": tokens_per_step, "grad_accum_steps": tc.grad_accum_steps,
      "remat": tc.remat, "dtype": m.dtype, "param_dtype": m.param_dtype,
      "attention_impl": attention, "steps": _STEPS.value, "warmup": _WARMUP.value,
      "timing": "median of per-step times, each ended by jax.block_until_ready; variants "
                "alternate step by step; one device-resident batch, no data loading",
      "flop_formula": flop, "peak_flops": peak,
  }
  print(f"# Training throughput: {config_name} on {meta['device']} ({meta['backend']} x "
        f"{meta['device_count']}), jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
  print(f"# batch {tc.batch_size} x seq {tc.seq_len} = {tokens_per_step:,} tokens/step, "
        f"dtype {m.dtype} (params {m.param_dtype}), attention {attention}, remat {tc.remat}")
  print(f"# FLOPs/token {flop['name']}: 6 x {flop['N']:,} + 12 x {flop['L']} x {flop['S']} x "
        f"{flop['d_attn']} = {flop['flops_per_token']:,}")
  print(f"# peak {fmt(peak and peak / 1e12, ',.1f')} TFLOP/s; median of {_STEPS.value} steps "
        f"after {_WARMUP.value} warm-up", flush=True)

  batch = random_batch(m.vocab_size, tc.batch_size, tc.seq_len, tc.seed)
  variants = build_variants(config, _TOKENS_ONLY_ROW.value, _OURS_ONLY.value)
  for _ in range(_WARMUP.value):
    for v in variants:
      v.run(batch)
  for _ in range(_STEPS.value):
    for v in variants:
      v.times.append(v.run(batch))

  rows = []
  for v in variants:
    seconds = statistics.median(v.times)
    tokens_per_second = tokens_per_step / seconds
    achieved = tokens_per_second * flop["flops_per_token"]
    rows.append({"name": v.name, "description": v.description, "ms_per_step": 1e3 * seconds,
                 "tokens_per_second": tokens_per_second, "tflops": achieved / 1e12,
                 "mfu": achieved / peak if peak else None,
                 "first_step_s": v.compile_s, "first_step_loss": v.first_loss,
                 "ms_min": 1e3 * min(v.times), "ms_mean": 1e3 * statistics.fmean(v.times),
                 "ms_all": [1e3 * t for t in v.times]})
  for r, v in zip(rows, variants):
    r["ratio_vs_plain"] = r["paired_ratio_vs_plain"] = None
    if len(variants) > 1:
      r["ratio_vs_plain"] = r["tokens_per_second"] / rows[1]["tokens_per_second"]
      # Steps i of two variants ran back to back, so their ratio cancels slow drifts of a
      # shared machine's load; the median of those ratios is the steadier estimate.
      r["paired_ratio_vs_plain"] = statistics.median(
          p / t for p, t in zip(variants[1].times, v.times))
  ratio = rows[0]["ratio_vs_plain"]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  meta["device_peak_bytes_in_use"] = (stats or {}).get("peak_bytes_in_use")

  table = markdown_table(rows)
  print()
  print(table)
  print()
  if ratio is not None:
    print(f"ours / plain tokens/s: {ratio:.3f} (ratio of medians); "
          f"{rows[0]['paired_ratio_vs_plain']:.3f} (median of step-by-step ratios)")
  print("first-step loss (same parameters, same batch): " +
        ", ".join(f"{r['name']} {r['first_step_loss']:.5f}" for r in rows))
  print("first step incl. compilation: " +
        ", ".join(f"{r['name']} {r['first_step_s']:.1f} s" for r in rows))
  if meta["device_peak_bytes_in_use"]:
    print(f"device peak memory (whole process): {meta['device_peak_bytes_in_use'] / 2**30:.2f} GiB")

  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({**meta, "rows": rows, "ratio_ours_over_plain": ratio,
                             "paired_ratio_ours_over_plain": rows[0]["paired_ratio_vs_plain"],
                             "table": table}, indent=2) + "\n")
  print(f"wrote {out}")


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=import-outside-toplevel
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
