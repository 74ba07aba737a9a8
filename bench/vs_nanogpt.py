"""Our train.py against nanoGPT's own train.py on the CPU: one model, one token stream, one schedule.

  python -m bench.vs_nanogpt --nanogpt_dir ../nanoGPT           # configs/tiny_gpt2.py
  python -m bench.vs_nanogpt --nanogpt_dir ../nanoGPT --steps 30 --rounds 1   # a smoke run

nanoGPT (`git clone https://github.com/karpathy/nanoGPT`; --nanogpt_dir is
that directory) runs unmodified: `python train.py <config file>` in its
directory, the file written here by `nanogpt_settings` from our config
(its configurator executes it): device cpu, dtype float32, dropout 0,
`--nanogpt_compile` for torch.compile, one evaluation of one batch at
iteration 0 (eval_interval huge; iteration 0 is not timed) and no
checkpoint. Its model is GPT-2's: learned positions, LayerNorm pre-norm,
an exact-GELU MLP of 4 d, tied embeddings, biases in every projection and
norm (bias=True; our LayerNorm always has its bias, so use_bias=False has
no nanoGPT counterpart). A config it cannot express (RoPE, RMSNorm,
SwiGLU, GQA, packed rows...) is refused with one line naming the field
(`check_expressible`). Its data: train.bin and val.bin, uint16, the token
streams of our tokenizer's concat rows of the same corpus
(`write_token_files`), from which nanoGPT reads random windows.

Ours is train.py itself, run as a subprocess on the same config (written as
a run's config.json, read back by configs/from_run.py) with train.log_every
`--log_every` (default 1: nanoGPT logs every iteration, its default
log_interval), no trackers, validation and a checkpoint only after the last
step. Both are loop against loop: each side's time per step is what its
own loop logs, data loading, the optimizer step and logging included
(nanoGPT's "iter N: loss L, time T ms", the wall time from one iteration's
end to the next; ours, the `seconds` of each metrics.jsonl line over the
steps since the last). nanoGPT's per-iteration times are averaged in
windows of `--log_every` iterations as ours are. Both sides train
train.batch_size x train.seq_len tokens a step with AdamW (betas, epsilon
1e-8, weight decay on matrices and embeddings only, global-norm clipping)
and linear warm-up then cosine decay to learning_rate x min_lr_ratio at
`--steps`; nanoGPT's warm-up starts at lr / (warmup + 1) where ours starts
at 0. The initial parameters differ (nanoGPT's seed and its scaled init of
the output projections), so the first-step losses are close, not equal.

`--cpus N` pins the bench, and so both runs, to N of the usable CPUs
(XLA's thread pool sizes itself by the affinity, torch's by
OMP_NUM_THREADS=N): `--cpus 1` compares one thread against one, which a
busy machine disturbs less than two threads that wait for each other.
torch.compile is off by default: on this project's 2-core machine it ran
nanoGPT's step slower and compiled for minutes (docs/results.md).

Runs alternate, ours then nanoGPT's, `--rounds` times; the first `--skip`
steps of every run (compilation, warm-up) are not counted. Reported per
side: the median ms a step over all counted windows (p10, p90), tokens/s,
each run's median, the first-step loss and each run's wall time; the ratio
ours / nanoGPT of tokens/s, and its median over rounds of the two runs'
medians. The JSON also records the load average before each run, the CPU
model, the torch and XLA thread counts and both commits.
Writes bench/results/vs_nanogpt.json (or `--out`).
"""
import datetime
import json
import os
import pathlib
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from bench.bench_utils import command_line, git_commit
from configs import base
from configs.cli import parse_flags
from configs.errors import UserError
from configs.validation import remat_name
from data import pipeline
from model.accounting import formula_params
from model.config import ModelConfig
from model.resolve import resolve
from training.hardware import cpu_model
from training.workdir import config_to_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
NANOGPT_URL = "https://github.com/karpathy/nanoGPT"

# Our model fields with the values nanoGPT's GPT builds; the fields below them are
# compared by their relations (`check_expressible`); every other field keeps
# configs/base.py's default.
NANOGPT_MODEL = {"family": "decoder", "attention": "mha", "attention_score": "softmax",
                 "pos_emb": "learned", "norm": "layernorm", "norm_position": "pre",
                 "norm_eps": 1e-5, "mlp": "gelu", "use_bias": True, "tie_embeddings": True,
                 "dtype": "float32", "param_dtype": "float32"}
RELATED = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
           "d_ff", "max_len", "qkv_bias", "out_bias", "mlp_bias")
# Fields that change our initial parameters or how ours runs, not the function trained.
FREE = ("init_std", "attention_impl", "pallas_lowering", "scan_layers", "scan_unroll")
NANOGPT_TRAIN = {"objective": "next_token", "optimizer": "adamw", "schedule": "cosine",
                 "z_loss": 0.0, "mtp_depth": 0}
ITERATION_RE = re.compile(r"^iter (\d+): loss (\S+), time ([\d.]+) ?ms", re.MULTILINE)
PARAMETERS_RE = re.compile(r"number of parameters: ([\d.]+)M")


def _define_flags() -> None:
  """The command's flags, defined when it runs (importing this module, as the
  tests do, defines none)."""
  config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "tiny_gpt2.py"),
                                  "A GPT-2-style config nanoGPT can express.", lock_config=True)
  flags.DEFINE_string("nanogpt_dir", None, f"A clone of {NANOGPT_URL}.")
  flags.DEFINE_integer("steps", 200, "Steps of each run (the schedule's length).")
  flags.DEFINE_integer("rounds", 3, "Runs per side, alternating: ours, nanoGPT's, ours...")
  flags.DEFINE_integer("skip", 10, "First steps of each run not counted (compilation).")
  flags.DEFINE_integer("log_every", 1, "Our train.log_every, and the window nanoGPT's "
                       "per-iteration times are averaged over.")
  flags.DEFINE_integer("cpus", 0, "Run both sides on the first this many usable CPUs, with "
                       "OMP_NUM_THREADS set to it for torch; 0: all of them.")
  flags.DEFINE_boolean("nanogpt_compile", False, "nanoGPT's compile (torch.compile).")
  flags.DEFINE_string("out", None, "JSON output; default bench/results/vs_nanogpt.json.")
  flags.mark_flags_as_required(["nanogpt_dir"])


def _refuse(field: str, value, fix: str) -> UserError:
  """The one-line refusal of `field`'s `value`, with its `fix`."""
  return UserError(f"{field}={value!r}: nanoGPT cannot express it; {fix}")


def check_expressible(config) -> None:
  """UserError naming the first field of the resolved `config` that nanoGPT's
  train.py and GPT cannot reproduce, and the value they need."""
  m, t = config.model, config.train
  for field, value in NANOGPT_TRAIN.items():
    if t[field] != value:
      raise _refuse(f"train.{field}", t[field], f"set --config.train.{field}={value}")
  if remat_name(t.remat) != "none":
    raise _refuse("train.remat", t.remat, "nanoGPT recomputes nothing: "
                  "set --config.train.remat=none")
  for field, value in NANOGPT_MODEL.items():
    if m[field] != value:
      raise _refuse(f"model.{field}", m[field], f"its GPT-2 needs {value!r}: set "
                    f"--config.model.{field}={value}")
  defaults = base.get_config().model
  for field, value in m.items():
    if field not in (*NANOGPT_MODEL, *RELATED, *FREE) and value != defaults[field]:
      raise _refuse(f"model.{field}", value, f"keep the default {defaults[field]!r}")
  r = ModelConfig.resolve(m)
  if r.num_kv_heads != r.num_heads or r.head_dim * r.num_heads != r.d_model:
    raise _refuse("model.num_kv_heads, model.head_dim", (m.num_kv_heads, m.head_dim),
                  "its heads are num_heads of d_model / num_heads: unset both")
  for field in ("qkv_bias", "out_bias", "mlp_bias"):
    if m[field] is not None and not m[field]:
      raise _refuse(f"model.{field}", m[field], "bias=True puts a bias in every projection: "
                    "unset it")
  if m.d_ff != 4 * m.d_model:
    raise _refuse("model.d_ff", m.d_ff, f"its MLP is 4 x d_model wide: set "
                  f"--config.model.d_ff={4 * m.d_model}")
  if m.max_len != t.seq_len:
    raise _refuse("model.max_len", m.max_len, "its block_size is both the position table and "
                  f"the row length: set --config.model.max_len={t.seq_len} (train.seq_len)")
  if config.data.packing != "concat":
    raise _refuse("data.packing", config.data.packing, "it reads windows of one token "
                  "stream without document masks: set --config.data.packing=concat")
  if m.vocab_size > 2**16:
    raise _refuse("model.vocab_size", m.vocab_size, "its train.bin holds uint16 tokens: at "
                  "most 65,536 ids")


def bench_config(config, *, steps: int, log_every: int, tokenizer_dir: str):
  """`config` as both sides train it: `steps` steps (the schedule's length; no
  budget), metrics every `log_every`, validation and a checkpoint only at the
  end, no trackers, the bench's tokenizer; resolved and checked."""
  c = config.copy_and_resolve_references()
  c.train.update(num_steps=steps, token_budget=0.0, flop_budget=0.0, log_every=log_every,
                 eval_every=steps, checkpoint_every=steps, trackers="")
  c.tokenizer.path = tokenizer_dir
  c = resolve(c)
  check_expressible(c)
  return c


def nanogpt_settings(config, *, data_dir: str, compile_model: bool) -> dict:
  """nanoGPT train.py's globals (but out_dir) for the resolved, checked `config`."""
  m, t = config.model, config.train
  return {"dataset": data_dir, "init_from": "scratch", "device": "cpu",
          "dtype": "float32", "compile": compile_model, "eval_interval": 10**9,
          "eval_iters": 1, "log_interval": 1, "always_save_checkpoint": False,
          "wandb_log": False, "gradient_accumulation_steps": t.grad_accum_steps,
          "batch_size": t.batch_size // t.grad_accum_steps, "block_size": t.seq_len,
          "n_layer": m.num_layers, "n_head": m.num_heads, "n_embd": m.d_model,
          "dropout": 0.0, "bias": True, "learning_rate": t.learning_rate,
          "max_iters": t.num_steps - 1, "weight_decay": t.weight_decay, "beta1": t.b1,
          "beta2": t.b2, "grad_clip": t.grad_clip, "decay_lr": True,
          "warmup_iters": t.warmup_steps, "lr_decay_iters": t.num_steps,
          "min_lr": t.learning_rate * t.min_lr_ratio}


def settings_file(settings: dict) -> str:
  """The config file nanoGPT's configurator executes."""
  return "".join(f"{key} = {value!r}\n" for key, value in settings.items())


def token_stream(num_rows: int, row_fn) -> np.ndarray:
  """The token stream concat rows are cut from: every row's real inputs, then
  the last row's last target."""
  parts, last = [], np.zeros([0], np.int32)
  for r in range(num_rows):
    row = row_fn(r)
    n = int(row["loss_mask"].sum())
    parts.append(row["inputs"][:n])
    last = row["targets"][n - 1:n] if n else last
  return np.concatenate(parts + [last])


def write_token_files(config, tokenizer, data_dir: pathlib.Path) -> dict:
  """train.bin, val.bin (uint16 streams of our rows) and meta.pkl (the vocabulary
  size) in `data_dir`; the tokens of each."""
  sizes = {}
  for split, name in (("train", "train.bin"), ("validation", "val.bin")):
    stream = token_stream(*pipeline.rows_of_split(config, tokenizer, split, quiet=True))
    stream.astype(np.uint16).tofile(data_dir / name)
    sizes[split] = int(stream.size)
  with open(data_dir / "meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": config.model.vocab_size}, f)
  return sizes


def parse_nanogpt(log: str) -> tuple[list[float], list[float], float | None]:
  """(losses, ms) of each iteration nanoGPT logged, in order, and its
  parameter count in millions (without the position table), from its stdout."""
  rows = [(int(i), float(loss), float(ms)) for i, loss, ms in ITERATION_RE.findall(log)]
  if [i for i, _, _ in rows] != list(range(len(rows))):
    raise ValueError("nanoGPT's log skips iterations: was log_interval 1?")
  params = PARAMETERS_RE.search(log)
  return ([r[1] for r in rows], [r[2] for r in rows],
          float(params.group(1)) if params else None)


def parse_ours(metrics: list[dict]) -> tuple[list[float], list[tuple[int, float]]]:
  """(each window's mean loss, (its last step, its ms a step)) from a run's
  metrics.jsonl lines."""
  losses, windows, last = [], [], 0
  for line in metrics:
    if line["split"] == "train":
      losses.append(line["loss"])
      windows.append((line["step"], 1e3 * line["seconds"] / (line["step"] - last)))
      last = line["step"]
  return losses, windows


def windowed(ms: list[float], size: int) -> list[tuple[int, float]]:
  """Per-step times in windows of `size` steps, as ours logs them: (the window's
  last step, counting from 1, its mean ms)."""
  return [(min(i + size, len(ms)), statistics.fmean(ms[i:i + size]))
          for i in range(0, len(ms), size)]


def counted(windows: list[tuple[int, float]], skip: int, log_every: int) -> list[float]:
  """The ms of the windows whose every step is past the first `skip`."""
  return [ms for step, ms in windows if step - log_every >= skip]


def _run(cmd: list[str], cwd, env, what: str) -> tuple[str, float]:
  """Runs `cmd`; (its stdout and stderr, its wall seconds); RuntimeError with the
  tail of its output if it fails."""
  start = time.perf_counter()
  done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
  output = done.stdout + done.stderr
  if done.returncode != 0:
    tail = "\n".join(output.splitlines()[-20:])
    raise RuntimeError(f"{what} exited with status {done.returncode}:\n{tail}")
  return output, time.perf_counter() - start


def run_ours(config, tmp: pathlib.Path, k: int) -> dict:
  """Our train.py on `config` in a fresh workdir; its losses, windows, wall time."""
  config_dir, workdir = tmp / f"ours-config-{k}", tmp / f"ours-run-{k}"
  config_dir.mkdir()
  (config_dir / "config.json").write_text(json.dumps(config_to_dict(config)))
  cmd = [sys.executable, "train.py", f"--config=configs/from_run.py:{config_dir}",
         f"--workdir={workdir}"]
  _, seconds = _run(cmd, ROOT, {**os.environ, "JAX_PLATFORMS": "cpu"}, "our train.py")
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    losses, windows = parse_ours([json.loads(line) for line in f if line.strip()])
  return {"losses": losses, "windows": windows, "wall_s": seconds}


def run_nanogpt(nanogpt_dir: pathlib.Path, settings: dict, tmp: pathlib.Path, k: int,
                log_every: int) -> dict:
  """nanoGPT's train.py with `settings`; its losses, windows, wall time."""
  path = tmp / f"nanogpt-config-{k}.py"
  path.write_text(settings_file({**settings, "out_dir": str(tmp / f"nanogpt-out-{k}")}))
  log, seconds = _run([sys.executable, "train.py", str(path)], nanogpt_dir, dict(os.environ),
                      "nanoGPT's train.py")
  losses, ms, params = parse_nanogpt(log)
  return {"losses": losses, "windows": windowed(ms, log_every), "wall_s": seconds,
          "params_millions": params}


def side_report(runs: list[dict], skip: int, log_every: int, tokens_per_step: int) -> dict:
  """A side's step-time percentiles over all its counted windows, tokens/s, each
  run's median, the first-step loss (the first window's mean, one step when
  log_every is 1) and wall times."""
  per_run = [counted(r["windows"], skip, log_every) for r in runs]
  pooled = [ms for ms_list in per_run for ms in ms_list]
  median = statistics.median(pooled)
  p10, p90 = np.percentile(pooled, [10, 90])
  return {"ms_median": median, "ms_p10": float(p10), "ms_p90": float(p90),
          "tokens_per_s": 1e3 * tokens_per_step / median,
          "run_ms_medians": [statistics.median(ms) for ms in per_run],
          "first_step_loss": runs[0]["losses"][0], "final_loss": runs[0]["losses"][-1],
          "wall_s": [r["wall_s"] for r in runs], "windows_counted": len(pooled)}


def nanogpt_commit(nanogpt_dir: pathlib.Path) -> str:
  """nanoGPT's `git rev-parse --short HEAD`, +dirty if a tracked file changed."""
  def git(*args):
    return subprocess.run(["git", "-C", str(nanogpt_dir), *args], capture_output=True,
                          text=True, check=True).stdout.strip()
  try:
    return git("rev-parse", "--short", "HEAD") + (
        "+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def thread_counts() -> dict:
  """The threads each side computes with by default on this machine."""
  import torch  # pylint: disable=import-outside-toplevel  # test requirements only
  return {"cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
          "torch": torch.__version__,
          "xla_cpu_threads": "one intra-op pool of the usable CPUs (XLA's default)",
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")}


def table(report: dict) -> str:
  ours, theirs = report["ours"], report["nanogpt"]
  lines = ["| loop | ms/step p50 (p10-p90) | tokens/s | first-step loss | each run's median ms |",
           "|---|---:|---:|---:|---:|"]
  for name, s in ((f"ours: train.py, log_every {report['log_every']}", ours),
                  (f"nanoGPT: train.py, compile {report['nanogpt_compile']}", theirs)):
    lines.append(f"| {name} | {s['ms_median']:.1f} ({s['ms_p10']:.1f}-{s['ms_p90']:.1f}) | "
                 f"{s['tokens_per_s']:,.0f} | {s['first_step_loss']:.4f} | "
                 + ", ".join(f"{ms:.1f}" for ms in s["run_ms_medians"]) + " |")
  lines.append(f"\nours / nanoGPT tokens/s: {report['ratio_ours_over_nanogpt']:.3f} (pooled "
               f"medians); {report['ratio_by_round']:.3f} (median over rounds)")
  return "\n".join(lines)


def check_flags(nanogpt_dir: pathlib.Path) -> None:
  """UserError for a bad flag or a directory without nanoGPT's scripts."""
  if not all((nanogpt_dir / name).is_file() for name in ("train.py", "configurator.py",
                                                          "model.py")):
    raise UserError(f"--nanogpt_dir={nanogpt_dir}: no nanoGPT train.py, configurator.py and "
                    f"model.py there; git clone {NANOGPT_URL} and pass its directory")
  if FLAGS.rounds < 1 or FLAGS.log_every < 1 or FLAGS.skip < 1:
    raise UserError("--rounds, --log_every and --skip must be at least 1")
  usable = len(os.sched_getaffinity(0))
  if not 0 <= FLAGS.cpus <= usable:
    raise UserError(f"--cpus={FLAGS.cpus}: between 1 and the {usable} usable CPUs, or 0 (all)")
  if FLAGS.steps < FLAGS.skip + 2 * FLAGS.log_every:
    raise UserError(f"--steps={FLAGS.steps}: at least --skip + 2 x --log_every = "
                    f"{FLAGS.skip + 2 * FLAGS.log_every}, so that windows are counted")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  nanogpt_dir = pathlib.Path(FLAGS.nanogpt_dir).expanduser().resolve()
  with tempfile.TemporaryDirectory(prefix="vs_nanogpt-") as tmp:
    tmp = pathlib.Path(tmp)
    tokenizer_dir = FLAGS.config.tokenizer.path or str(tmp / "tokenizer")
    try:
      check_flags(nanogpt_dir)
      config = bench_config(FLAGS.config, steps=FLAGS.steps, log_every=FLAGS.log_every,
                            tokenizer_dir=tokenizer_dir)
      if FLAGS.cpus:  # before torch starts: both runs inherit the affinity and the count
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:FLAGS.cpus])
        os.environ["OMP_NUM_THREADS"] = str(FLAGS.cpus)  # torch counts cores, not the affinity
      # After the checks and the pinning: it imports torch and transformers.
      from bench.vs_torch import get_tokenizer  # pylint: disable=import-outside-toplevel
      tokenizer = get_tokenizer(FLAGS.config)
    except (UserError, ValueError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    if not FLAGS.config.tokenizer.path:
      tokenizer.save(tokenizer_dir)
    compare(config, tokenizer, nanogpt_dir, tmp)


def compare(config, tokenizer, nanogpt_dir: pathlib.Path, tmp: pathlib.Path) -> None:
  """The alternating runs, the report printed and written."""
  data_dir = tmp / "data"
  data_dir.mkdir()
  tokens = write_token_files(config, tokenizer, data_dir)
  settings = nanogpt_settings(config, data_dir=str(data_dir),
                              compile_model=FLAGS.nanogpt_compile)
  t = config.train
  tokens_per_step = t.batch_size * t.seq_len
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": command_line(), "commit": git_commit(),
          "nanogpt_commit": nanogpt_commit(nanogpt_dir), "cpu_model": cpu_model(),
          **thread_counts(), "batch_size": t.batch_size, "seq_len": t.seq_len,
          "tokens_per_step": tokens_per_step, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
          "skip": FLAGS.skip, "log_every": FLAGS.log_every,
          "nanogpt_compile": FLAGS.nanogpt_compile, "stream_tokens": tokens,
          "nanogpt_settings": {k: v for k, v in settings.items()
                               if k != "dataset"}}
  print(f"# ours (commit {meta['commit']}) vs nanoGPT (commit {meta['nanogpt_commit']}) on "
        f"{meta['cpu_model']}, {meta['cpus_usable']} CPUs, torch threads "
        f"{meta['torch_threads']}; batch {t.batch_size} x {t.seq_len}, {FLAGS.steps} steps a "
        f"run, {FLAGS.rounds} rounds, first {FLAGS.skip} steps not counted", flush=True)
  runs, loads = {"ours": [], "nanogpt": []}, []
  for k in range(FLAGS.rounds):
    for side in runs:
      loads.append({"round": k, "side": side, "load_1m_5m_15m": os.getloadavg()})
      run = (run_ours(config, tmp, k) if side == "ours" else
             run_nanogpt(nanogpt_dir, settings, tmp, k, FLAGS.log_every))
      runs[side].append(run)
      ms = statistics.median(counted(run["windows"], FLAGS.skip, FLAGS.log_every))
      print(f"round {k + 1} {side}: median {ms:.1f} ms a step, first loss "
            f"{run['losses'][0]:.4f}, {run['wall_s']:.0f} s in all (load "
            f"{loads[-1]['load_1m_5m_15m'][0]:.1f})", flush=True)
  report = {**meta, "loads": loads}
  for side, side_runs in runs.items():
    report[side] = side_report(side_runs, FLAGS.skip, FLAGS.log_every, tokens_per_step)
    report[side]["runs"] = side_runs
  params = formula_params(config.model)
  report["params_millions"] = {
      "ours": (params["params_total"] - params["params_position_table"]) / 1e6,
      "nanogpt": runs["nanogpt"][0]["params_millions"], "counted": "without the position table"}
  report["ratio_ours_over_nanogpt"] = (report["ours"]["tokens_per_s"] /
                                       report["nanogpt"]["tokens_per_s"])
  report["ratio_by_round"] = statistics.median(
      theirs / ours for ours, theirs in zip(report["ours"]["run_ms_medians"],
                                            report["nanogpt"]["run_ms_medians"]))
  report["table"] = table(report)
  print()
  print(report["table"])
  out = pathlib.Path(FLAGS.out or ROOT / "bench" / "results" / "vs_nanogpt.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
