"""Sums an addition run was not scored on: random sums of every length and carry chains.

  python -m bench.addition_probe --workdir runs/addition [--workdir ...] [--count 2000]
      [--seed 0] [--out bench/results/addition_probe.json]

eval.py scores an addition run on its held-out pairs, drawn like the training
pairs (`data/tasks.py`). This probes the rule beyond them, with three sets
written in the run's own format (data.task_addition_format, numbers of up to
data.task_max_len digits):

- `random_test_lengths`: `--count` sums of two numbers of
  task_test_min_len..task_max_len digits (the held-out lengths), drawn with
  `--seed`;
- `random_all_lengths`: `--count` sums of 1..task_max_len digits;
- `carry_chains`: sums whose carries run the farthest: (10^k - 1) + j for
  j = 1..9, (10^k - 1) + (10^k - 1), 5..5 + 5..5, and five a + (10^k - a)
  per k, for every k up to task_max_len.

Each set goes to `<workdir>/probes/<set>.tsv` (so `eval.py --workdir W --data
W/probes/carry_chains.tsv` rescores it with beam search too) and is scored
greedily with eval.py's generation (`evaluate.predict`): exact match on the
sum, how many of its sources the run trained on, and every wrong answer.
The JSON (default `<first workdir>/probes/probe.json`) holds those per run,
with the command, commit, date and machine.
"""
import datetime
import os
import sys

from absl import app, flags, logging
import numpy as np

from bench.bench_utils import command_line, git_commit
from configs.cli import parse_flags
from configs.errors import UserError
from data import seq2seq, tasks
from training import evaluate, hardware
from training import workdir as workdir_lib

FLAGS = flags.FLAGS
SETS = ("random_test_lengths", "random_all_lengths", "carry_chains")
# The probe's random stream is (--seed, 2): the task draws its train and
# validation pairs from (data.task_seed, 0) and (data.task_seed, 1), and
# numpy seeds default_rng(s) as default_rng((s, 0)), so a stream (--seed,)
# would replay the training pairs when --seed equals data.task_seed.
STREAM = 2


def _define_flags() -> None:
  flags.DEFINE_multi_string("workdir", None, "A run trained with data.task=addition "
                            "(repeat for several: each is probed with the same sums).",
                            required=True)
  flags.DEFINE_integer("step", None, "Checkpoint step (default: each run's newest).")
  flags.DEFINE_integer("count", 2000, "Sums per random set.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seed of the random sets.")
  flags.DEFINE_string("out", None, "JSON output (default: <workdir>/probes/probe.json).")


def carry_chains(rng: np.random.Generator, max_digits: int) -> list[tuple[int, int]]:
  """Sums whose carries cross every digit of a k-digit number, k = 1..max_digits."""
  sums = []
  for k in range(1, max_digits + 1):
    nines, fives = 10 ** k - 1, int("5" * k)
    sums += [(nines, j) for j in range(1, 10)] + [(nines, nines), (fives, fives)]
    if k > 1:
      sums += [(a, 10 ** k - a) for a in rng.integers(1, 10 ** k, size=5).tolist()]
  return list(dict.fromkeys(sums))


def probe_sets(data_config, count: int, seed: int) -> dict[str, list[tasks.Pair]]:
  """The three sets' pairs, drawn and written as the run's task draws and writes its own."""
  d = data_config
  rng = np.random.default_rng((seed, STREAM))

  def draw(min_len: int) -> list[tasks.Pair]:
    return [tasks.make_example("addition", rng, min_len, d.task_max_len, d.task_addition_format)
            for _ in range(count)]

  return {"random_test_lengths": draw(d.task_test_min_len or d.task_min_len),
          "random_all_lengths": draw(1),
          "carry_chains": [tasks.addition_pair(a, b, d.task_addition_format, d.task_max_len)
                           for a, b in carry_chains(rng, d.task_max_len)]}


def write_tsv(path: str, pairs: list[tasks.Pair], src_field: str, tgt_field: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(f"{src_field}\t{tgt_field}\n")
    f.writelines(f"{src}\t{tgt}\n" for src, tgt in pairs)
  os.replace(path + ".tmp", path)


def score(model, config, tok, pairs: list[tasks.Pair], trained: set[str]) -> dict:
  """Greedy exact match of the run on `pairs`, generated as eval.py generates."""
  rows = seq2seq.pair_rows(config, tok, pairs)
  greedy = evaluate.predict(model, config, tok, rows, rows.num_pairs, beam_size=1, alpha=0.0)
  kept = list(zip(rows.src_texts, rows.tgt_texts))
  wrong = [{"source": s, "reference": t, "greedy": g} for (s, t), g in zip(kept, greedy)
           if g != t]
  return {"pairs": len(kept), "dropped": rows.num_dropped,
          "trained_sources": sum(s in trained for s, _ in kept),
          "exact_match_greedy": 1 - len(wrong) / len(kept), "wrong": wrong}


def probe(workdir: str, step: int | None, count: int, seed: int) -> dict:
  config, tok, model, step = workdir_lib.load_run(workdir, step)
  d = config.data
  if config.train.objective != "seq2seq" or d.task != "addition":
    raise UserError(f"--workdir {workdir}: a run of train.objective={config.train.objective}, "
                    f"data.task={d.task}; the probe needs a data.task=addition run")
  trained = {src for src, _ in tasks.load_pairs(d, "train")}
  results = {}
  for name, pairs in probe_sets(d, count, seed).items():
    path = os.path.join(workdir, "probes", f"{name}.tsv")
    write_tsv(path, pairs, d.src_field, d.tgt_field)
    results[name] = {"file": path, **score(model, config, tok, pairs, trained)}
  return {"workdir": workdir, "step": step, "format": d.task_addition_format,
          "max_digits": d.task_max_len, "sets": results}


def main(argv):
  logging.set_verbosity(logging.WARNING)
  try:
    if argv[1:]:
      raise UserError(f"{argv[1]}: unexpected argument")
    runs = [probe(w, FLAGS.step, FLAGS.count, FLAGS.seed) for w in FLAGS.workdir]
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  report = {"command": command_line(), "commit": git_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"cpu_model": hardware.cpu_model(), "cpus": hardware.usable_cpus(),
                        "xla_threads": hardware.xla_cpu_threads()},
            "seed": FLAGS.seed, "count": FLAGS.count, "runs": runs}
  for run in runs:
    print(f"\n{run['workdir']} at step {run['step']}:")
    print(f"{'set':<22}{'pairs':>7}{'trained on':>12}{'greedy exact match':>20}{'wrong':>7}")
    for name, s in run["sets"].items():
      print(f"{name:<22}{s['pairs']:>7,}{s['trained_sources']:>12,}"
            f"{s['exact_match_greedy']:>20.4f}{len(s['wrong']):>7}")
      for miss in s["wrong"][:5]:
        print(f"    {miss['source']} -> {miss['greedy']} (not {miss['reference']})")
  out = FLAGS.out or os.path.join(FLAGS.workdir[0], "probes", "probe.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  workdir_lib.write_json_atomic(out, report)
  print(f"wrote {out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
