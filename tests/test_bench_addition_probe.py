"""bench/addition_probe.py: the probe sets (exact sums, digit counts, carries)
and the probe of a tiny addition run end to end (files, scores, wrong answers,
the one-line error for a run of another task)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from bench import addition_probe
from configs import base
from data import tasks
from tests.helpers import ROOT, assert_one_line_error


def test_random_sets_have_the_asked_digit_counts_and_are_sums():
  data = base.get_config().data
  data.update(task="addition", task_addition_format="plain", task_min_len=1, task_max_len=4,
              task_test_min_len=2)
  sets = addition_probe.probe_sets(data, 500, seed=0)
  for name, lengths in (("random_test_lengths", {2, 3, 4}), ("random_all_lengths", {1, 2, 3, 4})):
    pairs = sets[name]
    numbers = [src.split("+") for src, _ in pairs]
    assert len(pairs) == 500 and {len(n) for pair in numbers for n in pair} == lengths
    assert all(int(tgt) == int(a) + int(b) for (_, tgt), (a, b) in zip(pairs, numbers))


def test_random_sets_are_not_the_training_pairs_at_the_tasks_own_seed():
  data = base.get_config().data
  data.update(task="addition", task_addition_format="aligned", task_min_len=1, task_max_len=8,
              task_test_min_len=6, task_size=50000, task_test_size=500, task_seed=0)
  trained = {src for src, _ in tasks.load_pairs(data, "train")}
  sets = addition_probe.probe_sets(data, 2000, seed=0)  # configs/addition.py's sizes
  # By chance about 4% (short numbers repeat); drawn from the task's stream, over 99%.
  assert sum(src in trained for src, _ in sets["random_all_lengths"]) < 200


def test_carry_chains_carry_across_every_digit():
  chains = addition_probe.carry_chains(np.random.default_rng(0), 3)
  assert len(chains) == len(set(chains))
  assert {(9, 1), (99, 1), (999, 9), (999, 999), (555, 555)} <= set(chains)
  assert all(len(str(a)) <= 3 and len(str(b)) <= 3 for a, b in chains)
  assert sum(a + b == 10 ** k for a, b in chains for k in (2, 3) if b not in range(1, 10)) == 10


def _addition_config(tmp_path):
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=260, d_model=32, num_layers=1, num_heads=2,
                 d_ff=64, max_len=64, attention_impl="xla")
  c.tokenizer.update(vocab_size=260)
  c.data.update(task="addition", task_addition_format="aligned", task_size=300,
                task_test_size=20, task_min_len=1, task_max_len=3, task_test_min_len=2,
                cache_dir=str(tmp_path / "cache"))
  c.train.update(objective="seq2seq", batch_size=4, seq_len=24, num_steps=2, warmup_steps=1,
                 log_every=1, eval_every=2, eval_steps=1, checkpoint_every=2)
  return c


def test_a_tiny_addition_run_is_probed_in_its_own_format(tmp_path):
  from training import loop  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "run")
  config = _addition_config(tmp_path)
  loop.train(config, workdir)
  report = addition_probe.probe(workdir, None, count=30, seed=1)
  assert (report["format"], report["max_digits"], report["step"]) == ("aligned", 3, 2)
  assert report["sets"]["carry_chains"]["pairs"] == len(
      addition_probe.carry_chains(np.random.default_rng(0), 3))
  assert set(report["sets"]) == set(addition_probe.SETS)
  trained = {src for src, _ in tasks.load_pairs(config.data, "train")}
  for name, result in report["sets"].items():
    lines = (tmp_path / "run" / "probes" / f"{name}.tsv").read_text().splitlines()
    assert lines[0] == "src\ttgt" and result["pairs"] + result["dropped"] == len(lines) - 1
    pairs = [line.split("\t") for line in lines[1:]]
    assert all(len(src) == 7 and int(tgt[::-1]) == sum(map(int, src.split("+")))
               for src, tgt in pairs)  # "012+005" -> "7100"
    assert result["trained_sources"] == sum(src in trained for src, _ in pairs)
    assert result["exact_match_greedy"] == 1 - len(result["wrong"]) / result["pairs"]
    assert all(w["greedy"] != w["reference"] for w in result["wrong"])
  out = tmp_path / "probe.json"
  command = subprocess.run([sys.executable, "-m", "bench.addition_probe", "--workdir", workdir,
                            "--workdir", workdir, "--count", "30", "--seed", "1", "--out",
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           check=False)
  assert command.returncode == 0, command.stderr
  saved = json.loads(out.read_text())
  assert saved["command"].startswith("python -m bench.addition_probe --workdir")
  assert saved["machine"]["cpus"] >= 1 and saved["runs"] == [report, report]


def test_a_run_of_another_task_is_one_line(tmp_path):
  from training import loop  # pylint: disable=import-outside-toplevel
  config = _addition_config(tmp_path)
  config.data.update(task="reverse", task_min_len=3, task_max_len=6, task_test_min_len=0)
  loop.train(config, str(tmp_path / "run"))
  result = subprocess.run([sys.executable, "-m", "bench.addition_probe", "--workdir",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
  assert_one_line_error(result, "data.task=reverse; the probe needs a data.task=addition run")
  assert not (tmp_path / "run" / "probes").exists()


@pytest.mark.parametrize("args,message", [
    ([], "--workdir"), (["--workdir", "nowhere"], "nowhere")])
def test_missing_or_wrong_workdir_is_one_line(args, message):
  result = subprocess.run([sys.executable, "-m", "bench.addition_probe", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
  assert_one_line_error(result, message)
