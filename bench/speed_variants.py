"""The speed changes of GPT-2 small's train step, each timed on the card beside
the roofline's prediction for it.

A variant is configs/gpt2_small.py (32 x 1024 tokens, bf16 compute) with
a few `--config.` overrides (`VARIANTS`): the preset as it is, the step
the H200 timed on 2026-12-04 (`baseline`: scanned, remat none, the whole
batch's logits, no FP8), its layers unscanned, or scanned with the loop
unrolled (the parameters stacked, the blocks inline), the remat policies,
the head and loss in chunks or in one fused kernel, FP8 matmuls with delayed scaling, and the
same model with DeepSeek's latent attention (MLA) on our kernels. Three
commands:

  # here, without a card: the roofline's prediction of every variant
  JAX_PLATFORMS=cpu venv-cuda/bin/python -m bench.speed_variants predict \\
      --out bench/results/speed_variants_h200.json
  # on the card (bench/gpu_session.sh speed): each variant's overrides ...
  python3 -m bench.speed_variants flags fp8_delayed
  # ... timed by bench.train_throughput into DIR/speed_<variant>.json, then
  python3 -m bench.speed_variants table --measured_dir DIR

`predict --variants A B` recomputes those rows of the file and keeps the
others; each row names the commit it was compiled at. `table` prints one
row a variant, the measured step (the median of
bench.train_throughput's timed steps) beside the predicted one and their
ratio; a variant with no measurement, or no prediction, says so. Bad input
(an unknown variant, a missing predictions file): one line, exit 2.
"""
import argparse
import datetime
import json
import os
import pathlib
import sys

from configs.errors import UserError

CONFIG = "configs/gpt2_small.py"
PREDICTIONS = pathlib.Path(__file__).resolve().parent / "results" / "speed_variants_h200.json"
BASELINE = ("--config.model.scan_layers=True", "--config.model.scan_unroll=2",
            "--config.train.remat=none",
            "--config.train.loss_chunk_size=0", "--config.train.loss_impl=xla",
            "--config.model.fp8=none")
# Latent attention at GPT-2 small's width: queries and keys 96 + 32 wide, the
# width our Mosaic GPU kernels take (so `auto` runs them, values padded from 64).
MLA = ("--config.model.attention=mla", "--config.model.pos_emb=rope",
       "--config.model.kv_lora_rank=256", "--config.model.qk_nope_head_dim=96",
       "--config.model.qk_rope_head_dim=32", "--config.model.v_head_dim=64")


def _with(*overrides: str) -> tuple[str, ...]:
  """The baseline's overrides with `overrides` in place of those they name."""
  names = {o.split("=")[0] for o in overrides}
  return tuple(o for o in BASELINE if o.split("=")[0] not in names) + overrides


VARIANTS = {
    "preset": (),
    "baseline": _with(),
    "unscanned": _with("--config.model.scan_layers=False"),
    "scan_unrolled": _with("--config.model.scan_unroll=12"),
    "remat_save_dots": _with("--config.train.remat=save_dots"),
    "remat_full": _with("--config.train.remat=full"),
    "loss_chunks_4096": _with("--config.train.loss_chunk_size=4096"),
    "fused_loss": _with("--config.train.loss_impl=pallas"),
    "fp8_delayed": _with("--config.model.fp8=delayed"),
    "mla": _with(*MLA),
}


def variant_flags(name: str) -> tuple[str, ...]:
  if name not in VARIANTS:
    raise UserError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
  return VARIANTS[name]


def predict(names, target_name: str) -> dict:
  """The roofline of each variant's step on `target_name` (compiled here),
  by variant name."""
  from aot.roofline import parse_target, roofline_report  # pylint: disable=import-outside-toplevel
  from bench.bench_utils import git_commit  # pylint: disable=import-outside-toplevel
  from configs.cli import load_config  # pylint: disable=import-outside-toplevel
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  commit = git_commit()  # before the compiles: the tree they read
  target = parse_target(target_name)
  rows = {}
  for name in names:
    report = roofline_report(load_config(CONFIG, variant_flags(name)), target)
    total = report["total"]
    rows[name] = {"flags": list(variant_flags(name)), "target": target_name, "commit": commit,
                  "date": datetime.date.today().isoformat(), "kernels": total["kernels"],
                  "tflop": total["flops"] / 1e12, "gb_moved": total["bytes"] / 1e9,
                  "predicted_ms": 1e3 * total["step_seconds"], "mfu_bound": report["mfu_bound"]}
    print(f"{name}: {rows[name]['predicted_ms']:.1f} ms predicted, {total['kernels']} kernels, "
          f"{rows[name]['gb_moved']:.1f} GB", flush=True)
  return rows


def _measured(directory: pathlib.Path, name: str):
  path = directory / f"speed_{name}.json"
  if not path.is_file():
    return None
  data = json.loads(path.read_text())
  return data["rows"][0] if data.get("rows") else None


def table(measured_dir: pathlib.Path, predictions: dict) -> str:
  """Measured against predicted, one row a variant (module docstring)."""
  lines = ["GPT-2 small train step, 32 x 1024: each variant measured here beside its "
           "roofline prediction (compiled without a card at the commit named)",
           "| variant | predicted ms | MFU bound | measured ms | MFU | measured / predicted "
           "| predicted at |",
           "|---|---:|---:|---:|---:|---:|---|"]
  for name in VARIANTS:
    p = predictions.get(name)
    m = _measured(measured_dir, name)
    pred = f"{p['predicted_ms']:.1f} | {100 * p['mfu_bound']:.1f}%" if p else "n/a | n/a"
    mfu = f"{100 * m['mfu']:.1f}%" if m and m.get("mfu") else "n/a"
    meas = f"{m['ms_per_step']:.1f} | {mfu}" if m else "not measured | n/a"
    ratio = f"{m['ms_per_step'] / p['predicted_ms']:.2f}" if m and p else "n/a"
    where = f"{p['target']}, {p['commit']}" if p else "n/a"
    lines.append(f"| {name} | {pred} | {meas} | {ratio} | {where} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("predict", help="the roofline's prediction of each variant")
  p.add_argument("--target", default="gpu:h200")
  p.add_argument("--variants", nargs="*", default=list(VARIANTS))
  p.add_argument("--out", default=str(PREDICTIONS))
  f = sub.add_parser("flags", help="a variant's --config overrides")
  f.add_argument("variant")
  sub.add_parser("names", help="the variants, in order")
  t = sub.add_parser("table", help="measured steps beside the predicted ones")
  t.add_argument("--measured_dir", required=True)
  t.add_argument("--predictions", default=str(PREDICTIONS))
  args = parser.parse_args(argv)
  try:
    if args.command == "flags":
      print(" ".join(variant_flags(args.variant)))
    elif args.command == "names":
      print(" ".join(VARIANTS))
    elif args.command == "predict":
      out = pathlib.Path(args.out)
      kept = json.loads(out.read_text()) if out.is_file() else {}
      kept.update(predict(args.variants, args.target))
      out.write_text(json.dumps({n: kept[n] for n in VARIANTS if n in kept}, indent=1) + "\n")
      print(f"wrote {args.out}")
    else:
      path = pathlib.Path(args.predictions)
      if not path.is_file():
        raise UserError(f"no predictions at {path}; run `python -m bench.speed_variants "
                         f"predict` first (compile only, no card needed)")
      print(table(pathlib.Path(args.measured_dir), json.loads(path.read_text())))
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
