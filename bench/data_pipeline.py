"""The data pipeline on corpora of about 0.1, 1 and 4 GB of real text.

  python -m bench.data_pipeline --sizes 0.1,1 --out bench/results/data_pipeline-DATE.json

Builds, under --scratch (deleted afterwards), Parquet shards of about 64 MB
of text from the Python sources and docs installed here (.py, .rst, .md,
.txt), each further copy of a file varied (a per-copy renaming of common
words, a per-copy header) so that a large corpus is not one file repeated;
trains a 1,024-id BPE tokenizer on a 4 MB sample; then per size:

- tokenisation MB/s with 1 worker (`python -m data.prepare --workers 1`, own cache)
  and with 2 (the cold training run's own summary line);
- cold: `train.py --config configs/tiny.py`, 20 steps, on an empty cache:
  seconds to the first step, peak RSS of the training process (VmHWM) and of
  its largest worker;
- warm: the same run again on the filled cache; and the data preparation
  alone (make_train_iterator + make_eval_batches, in a fresh process);
- the cache's size on disk.

MB/s are wall-clock; the CPU-seconds rate (MB per CPU-second of the workers)
is printed too, because the machine may be shared.
"""
import argparse
import json
import os
import pathlib
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq

from bench.bench_utils import ROOT, git_commit

SHARD_BYTES = 64_000_000  # at most; a corpus has at least 16 shards when it can (8 MB each)
_WORDS = ["self", "return", "import", "from", "value", "name", "data", "result", "path",
          "args", "config", "index", "count", "item", "text", "line", "file", "error",
          "the", "and", "for", "with", "this", "that", "is", "not", "none", "list", "dict",
          "key", "node", "type", "size", "start", "end", "time", "user", "test", "info", "base"]
_PATTERN = re.compile(r"\b(" + "|".join(_WORDS) + r")\b")


def source_files() -> list[pathlib.Path]:
  """Text files of the Python install and the venv, 1 KB to 1 MB, sorted."""
  roots = {pathlib.Path(sysconfig.get_paths()["stdlib"]), pathlib.Path(sysconfig.get_paths()["purelib"])}
  files = []
  for root in sorted(roots):
    for path in sorted(root.rglob("*")):
      if path.suffix in (".py", ".rst", ".md", ".txt") and path.is_file():
        size = path.stat().st_size
        if 1000 <= size <= 1_000_000:
          files.append(path)
  return files


def varied(text: str, copy: int) -> str:
  """Copy 0 as it is; a later copy with common words renamed by a per-copy permutation."""
  if copy == 0:
    return text
  rng = random.Random(copy)
  mapping = dict(zip(_WORDS, rng.sample(_WORDS, len(_WORDS))))
  suffix = f"{copy:x}"
  return f"# variant {copy}\n" + _PATTERN.sub(lambda m: mapping[m.group(1)] + suffix, text)


def build_corpus(directory: pathlib.Path, target_bytes: int) -> int:
  """Parquet shards (column `text`), 1/16 of the corpus each within [8 MB,
  SHARD_BYTES], so that workers have shards to share; the text bytes written."""
  directory.mkdir(parents=True)
  shard_target = min(SHARD_BYTES, max(8_000_000, target_bytes // 16))
  files = source_files()
  texts, shard_bytes, total, shard, copy = [], 0, 0, 0, 0
  while total < target_bytes:
    for path in files:
      text = varied(path.read_text(encoding="utf-8", errors="replace"), copy)
      size = len(text.encode("utf-8"))
      texts.append(text)
      shard_bytes += size
      total += size
      if shard_bytes >= shard_target or total >= target_bytes:
        pq.write_table(pa.table({"text": texts}), directory / f"shard-{shard:05d}.parquet",
                       row_group_size=1000)
        texts, shard_bytes, shard = [], 0, shard + 1
      if total >= target_bytes:
        break
    copy += 1
  return total


def run_watched(cmd: list[str], env: dict, first_line: str | None = None) -> dict:
  """Runs cmd; its output, wall seconds, seconds to the first line starting with
  `first_line`, peak RSS (VmHWM) of the process and of its largest child."""
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)
  peaks = {"self": 0, "children": 0}

  def watch():
    while proc.poll() is None:
      peaks["self"] = max(peaks["self"], _hwm(proc.pid))
      peaks["children"] = max([peaks["children"]] + [_hwm(c) for c in _children(proc.pid)])
      time.sleep(0.2)

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  first = None
  out = []
  for line in proc.stdout:
    out.append(line)
    if first is None and first_line and line.startswith(first_line):
      first = time.perf_counter() - start
  proc.wait()
  watcher.join()
  peak, children_peak = peaks["self"], peaks["children"]
  seconds = time.perf_counter() - start
  text = "".join(out)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
  return {"output": text, "seconds": seconds, "first": first, "peak_rss_gib": peak / 2**30,
          "worker_peak_rss_gib": children_peak / 2**30}


def _hwm(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def summary_rate(output: str) -> tuple[float, float]:
  """(MB/s, seconds) of the tokenisation summary line in `output`."""
  match = re.search(r"MB, ([\d.]+) MB/s\), .* in ([\d.]+) s", output)
  return (float(match.group(1)), float(match.group(2))) if match else (0.0, 0.0)


def ready_seconds(output: str) -> float:
  """Seconds train.py took to get its data ready (its `data: ready in` line)."""
  match = re.search(r"data: ready in ([\d.]+) s", output)
  return float(match.group(1)) if match else float("nan")


def du(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


PREP_TIMER = """
import sys, time
from configs import base
import tokenizer
from data import pipeline
import importlib.util
spec = importlib.util.spec_from_file_location("tiny", "configs/tiny.py")
tiny = importlib.util.module_from_spec(spec); spec.loader.exec_module(tiny)
config = tiny.get_config()
config.data.update(source="parquet", paths=sys.argv[1], cache_dir=sys.argv[2])
tok = tokenizer.load_tokenizer(sys.argv[3])
start = time.perf_counter()
iterator = pipeline.make_train_iterator(config, tok)
pipeline.make_eval_batches(config, tok, config.train.eval_steps)
print(f"prep_seconds {time.perf_counter() - start:.3f}")
"""


def one_worker_rate(scratch: pathlib.Path, data_flags: list[str], env: dict,
                    text_bytes: int) -> dict:
  """MB/s (wall and per CPU-second) of `data.prepare --workers 1` into a cache of its own."""
  cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
  one = run_watched([sys.executable, "-m", "data.prepare", "--config", "configs/tiny.py",
                     *data_flags, f"--config.data.cache_dir={scratch / 'cache-1'}",
                     "--workers", "1"], env)
  cpu_one = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu_before
  shutil.rmtree(scratch / "cache-1")
  return {"tokenise_1_worker_mb_s": summary_rate(one["output"])[0],
          "tokenise_1_worker_mb_per_cpu_s": text_bytes / 1e6 / cpu_one}


def bench_size(size_gb: float, scratch: pathlib.Path, tok_dir: str, one_worker: bool) -> dict:
  corpus = scratch / f"corpus-{size_gb:g}"
  start = time.perf_counter()
  text_bytes = build_corpus(corpus, int(size_gb * 1e9))
  print(f"[{size_gb:g} GB] corpus: {text_bytes / 1e9:.2f} GB of text in "
        f"{len(list(corpus.glob('*.parquet')))} shards ({time.perf_counter() - start:.0f} s)",
        flush=True)
  paths = str(corpus / "*.parquet")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  data_flags = ["--config.data.source=parquet", f"--config.data.paths={paths}",
                f"--config.tokenizer.path={tok_dir}"]
  result = {"size_gb": size_gb, "text_bytes": text_bytes}

  if one_worker:
    result.update(one_worker_rate(scratch, data_flags, env, text_bytes))
    print(f"[{size_gb:g} GB] 1 worker: {result['tokenise_1_worker_mb_s']:.2f} MB/s", flush=True)
  cache = scratch / "cache"
  train = [sys.executable, "train.py", "--config", "configs/tiny.py", *data_flags,
           f"--config.data.cache_dir={cache}", "--config.data.tokenize_workers=2",
           "--config.train.num_steps=20", "--config.train.log_every=1",
           "--config.train.eval_every=20", "--config.train.checkpoint_every=1000"]
  for run in ("cold", "warm"):
    workdir = scratch / f"run-{run}"
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    r = run_watched(train + ["--workdir", str(workdir)], env, first_line="step 1/")
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu_before
    shutil.rmtree(workdir)
    result[f"{run}_first_step_s"] = r["first"]
    result[f"{run}_peak_rss_gib"] = r["peak_rss_gib"]
    result[f"{run}_worker_peak_rss_gib"] = r["worker_peak_rss_gib"]
    if run == "cold":
      result["tokenise_2_workers_mb_s"], result["cold_data_s"] = summary_rate(r["output"])
      result["cold_cpu_s"] = cpu
      # The data work of a cold start beside tokenisation (the index, the first
      # batches), as a share of the whole start up to the first step.
      result["cold_other_data_s"] = ready_seconds(r["output"]) - result["cold_data_s"]
      result["cold_other_data_share"] = result["cold_other_data_s"] / r["first"]
      print(f"[{size_gb:g} GB] 2 workers: {result['tokenise_2_workers_mb_s']:.2f} MB/s, "
            f"{result['cold_data_s']:.0f} s of tokenisation, {result['cold_other_data_s']:.1f} s "
            f"of other data work ({100 * result['cold_other_data_share']:.1f}% of the cold "
            "start)", flush=True)
    print(f"[{size_gb:g} GB] {run}: first step {r['first']:.1f} s, peak RSS "
          f"{r['peak_rss_gib']:.2f} GiB (workers {r['worker_peak_rss_gib']:.2f})", flush=True)
  prep = subprocess.run([sys.executable, "-c", PREP_TIMER, paths, str(cache), tok_dir], cwd=ROOT,
                        env=env, capture_output=True, text=True, check=True)
  result["warm_prep_s"] = float(re.search(r"prep_seconds ([\d.]+)", prep.stdout).group(1))
  result["cache_bytes"] = du(cache)
  print(f"[{size_gb:g} GB] warm data preparation {result['warm_prep_s']:.2f} s, cache "
        f"{result['cache_bytes'] / 1e9:.2f} GB", flush=True)
  shutil.rmtree(cache)
  shutil.rmtree(corpus)
  return result


def train_tokenizer(scratch: pathlib.Path) -> str:
  sample = scratch / "tokenizer-sample"
  sample.mkdir(parents=True)
  files = source_files()
  random.Random(0).shuffle(files)
  inputs = []
  total = 0
  for i, path in enumerate(files):
    if total > 4_000_000:
      break
    target = sample / f"{i}.txt"
    shutil.copyfile(path, target)
    inputs.append(str(target))
    total += path.stat().st_size
  out = scratch / "tokenizer"
  subprocess.run([sys.executable, "-m", "tokenizer.train", "--kind", "bpe", "--vocab_size",
                  "1024", "--input", *inputs, "--out", str(out)], cwd=ROOT, check=True)
  return str(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="0.1,1,4", help="corpus sizes in GB, comma-separated")
  parser.add_argument("--scratch", default="/tmp/tlab_data_bench",
                      help="where the corpora and caches go (deleted afterwards)")
  parser.add_argument("--tokenizer", default="", help="a saved tokenizer (default: train one)")
  parser.add_argument("--out", default="", help="JSON file for the results")
  parser.add_argument("--one_worker_max_gb", type=float, default=float("inf"),
                      help="measure 1-worker tokenisation only up to this corpus size")
  args = parser.parse_args()
  scratch = pathlib.Path(args.scratch)
  if scratch.exists():
    shutil.rmtree(scratch)
  scratch.mkdir(parents=True)
  try:
    tok_dir = args.tokenizer or train_tokenizer(scratch)
    results = [bench_size(float(s), scratch, tok_dir, float(s) <= args.one_worker_max_gb)
               for s in args.sizes.split(",")]
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print("\n| corpus text | cold first step | cold peak RSS | warm first step | warm peak RSS "
        "| warm data prep | cache | tokenise 1 worker | tokenise 2 workers | other cold data "
        "work |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['text_bytes'] / 1e9:.2f} GB | {r['cold_first_step_s']:.1f} s "
          f"| {r['cold_peak_rss_gib']:.2f} GiB | {r['warm_first_step_s']:.1f} s "
          f"| {r['warm_peak_rss_gib']:.2f} GiB | {r['warm_prep_s']:.2f} s "
          f"| {r['cache_bytes'] / 1e9:.2f} GB | {r.get('tokenise_1_worker_mb_s', 0):.2f} MB/s "
          f"| {r['tokenise_2_workers_mb_s']:.2f} MB/s "
          f"| {r['cold_other_data_s']:.1f} s ({100 * r['cold_other_data_share']:.1f}%) |")
  record = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m bench.data_pipeline", *sys.argv[1:]]),
            "nproc": len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(), "results": results}
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1), encoding="utf-8")


if __name__ == "__main__":
  main()
