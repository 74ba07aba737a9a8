"""The ladder sweep (configs/sweeps/ladder.py, its cells built by
sweeps/ladder.py) and `sweep.py scaling`: five sizes per budget spaced
evenly in log N around the compute-optimal one, a budget the family cannot
take refused in one line, the dry run's commands,
the laws fitted to a ladder's finished runs (the unfinished counted out),
and a small ladder run end to end."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
from ml_collections import config_dict
import pytest

from configs import tiny_ladder
from configs.errors import UserError
from model import accounting
import sweeps as sweep_lib
from sweeps import ladder as ladder_lib
from sweeps.scaling import synthetic
from sweeps.scaling.from_sweep import BUDGET, SIZE_FIELDS
from sweeps.state import REPORT
from tests.helpers import ROOT, small_flags, sweep_cli, TINY, write_sweep

LADDER = str(ROOT / "configs" / "sweeps" / "ladder.py")


@pytest.fixture(scope="module")
def ladder():
  """The sweep file's LADDER: a declaration, no function of its own."""
  spec = importlib.util.spec_from_file_location("ladder", LADDER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert not hasattr(module, "get_sweep")
  return module.LADDER


def test_each_budget_has_five_sizes_evenly_in_log_n_around_its_optimum(ladder):
  family = ladder_lib.family(ladder, tiny_ladder.get_config())
  params = {json.dumps(overrides): n for overrides, n, _ in family}
  first = ladder["variants"][0]  # the first variant's cells
  sweep = [v for v in sweep_lib.load_sweep(LADDER).overrides
           if {f: x for f, x in v.items() if f not in SIZE_FIELDS + (BUDGET,)} == first]
  budgets = sorted(set(float(v["train.flop_budget"]) for v in sweep) - set(ladder["holdout"]))
  assert len(budgets) >= 4 and budgets[-1] / budgets[0] >= 30
  assert min(ladder["holdout"]) >= 4 * budgets[-1]
  for budget in ladder["holdout"]:  # the held-out budget: one cell, its middle size
    (cell,) = [v for v in sweep if float(v["train.flop_budget"]) == budget]
  for budget in budgets:
    cells = [v for v in sweep if float(v["train.flop_budget"]) == budget]
    n = sorted(params[json.dumps({f: v for f, v in c.items() if f in SIZE_FIELDS})]
               for c in cells)
    assert len(n) >= 5
    gaps = np.diff(np.log(n)) / math.log(ladder["spacing"])
    assert np.all((gaps > 0.5) & (gaps < 1.5)), (budget, n)
    n_opt = ladder_lib.optimal_params(ladder, budget, family)
    assert n[1] < n_opt < n[-2], (budget, n, n_opt)
    # At the optimum the budget buys TOKENS_PER_PARAM tokens a parameter.
    f = np.interp(math.log(n_opt), np.log([s[1] for s in family]), [s[2] for s in family])
    assert budget / f / n_opt == pytest.approx(ladder["tokens_per_param"], rel=0.02)


def test_a_variant_axis_runs_every_cell_under_each_variant(ladder):
  spec = dict(ladder, budgets=[1e12], holdout=(),
              variants=[{"model.pos_emb": "rope"}, {"model.pos_emb": "learned"}])
  rows = ladder_lib.ladder(spec, tiny_ladder.get_config())
  assert len(rows) == 10
  assert [r["model.pos_emb"] for r in rows] == ["rope"] * 5 + ["learned"] * 5
  assert len({sweep_lib.variant_name(r) for r in rows}) == 10


def test_a_budget_the_family_cannot_take_is_one_line_exit_2(ladder, tmp_path):
  with pytest.raises(UserError, match=r"ladder budget 1e\+09: .* takes budgets from "):
    ladder_lib.ladder(dict(ladder, budgets=[1e9], holdout=(), variants=[]),
                      tiny_ladder.get_config())
  text = open(LADDER, encoding="utf-8").read()
  assert '"budgets": (3e10, 1e11, 3e11, 1e12),' in text
  path = write_sweep(tmp_path, text.replace('"budgets": (3e10, 1e11, 3e11, 1e12),',
                                            '"budgets": (1e12, 1e17),'))
  result = sweep_cli("run", "--sweep", path, "--dry_run", "--root", str(tmp_path / "root"))
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "ladder budget 1e+17" in lines[0] and "LADDER's budgets" in lines[0]
  assert not (tmp_path / "root").exists()


def test_the_dry_run_prints_each_cells_train_and_eval_commands(tmp_path):
  result = sweep_cli("run", "--sweep", LADDER, "--dry_run", "--root", str(tmp_path))
  assert result.returncode == 0, result.stderr
  names = [line[:-1] for line in result.stdout.splitlines() if line.endswith(":")]
  assert len(names) == 63 and names[0] == "pos_emb=rope,flop_budget=3e+10,d_model=8,d_ff=24"
  assert names[20] == "pos_emb=rope,flop_budget=4e+12,d_model=76,d_ff=228"  # held out
  assert names[21] == ("pos_emb=rope,parametrization=mup,mup_base_width=32,mup_output_mult=4.0,"
                       "learning_rate=0.015625,flop_budget=3e+10,d_model=8,d_ff=24")
  train = result.stdout.splitlines()[1]
  assert ("--config.model.pos_emb=rope --config.train.flop_budget=3e+10 "
          "--config.model.d_model=8 --config.model.d_ff=24") in train
  assert "/configs/tiny_ladder.py" in train
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_scaling_fits_the_finished_runs_of_a_ladder_and_counts_the_rest(tmp_path):
  """The ladder's manifest, every run but one given an eval report whose loss
  follows a known law: `sweep.py scaling` fits the 59 others (3 held out), says
  1 is left out."""
  root = str(tmp_path / "root")
  sweep = sweep_lib.load_sweep(LADDER)
  config_path = str(ROOT / "configs" / "tiny_ladder.py")
  variants = sweep_lib.make_variants(sweep, config_path, [], root)
  sweep_lib.write_manifest(root, sweep, config_path, [], variants, None)
  rng = np.random.default_rng(0)
  law = synthetic.TRUTH
  for variant in variants[1:]:
    config = config_dict.ConfigDict(variant.config)
    n = accounting.formula_params(config.model)["params_total"]
    d = variant.num_steps * config.train.batch_size * config.train.seq_len
    loss = (law["E"] + law["A"] / n ** law["alpha"] + law["B"] / d ** law["beta"]) * float(
        np.exp(rng.normal(0, 0.005)))
    os.makedirs(variant.workdir)
    with open(os.path.join(variant.workdir, REPORT), "w", encoding="utf-8") as f:
      json.dump({"step": variant.num_steps, "loss": loss}, f)
  result = sweep_cli("scaling", "--root", root, "--resamples", "100", "--holdout",
                     "budget>=4e12", "--starts", "16")
  assert result.returncode == 0, result.stderr
  assert "left out 1 unfinished run(s)" in result.stdout
  assert "fitted 59 runs (3 held out)" in result.stdout, result.stdout
  out = json.load(open(os.path.join(root, "scaling", "scaling.json"), encoding="utf-8"))
  text = json.dumps(out)
  assert "params" in text and "base" in text
  # The budgets' own FLOP model (attention counted): above 6·N·D, and the frontier in it.
  assert out["flop_model"] == "the budget column `budget`"
  assert "C / (6·N·D): median 1." in out["compute"]
  assert {v["frontier_flop_model"] for v in out["variants"].values()} == {out["flop_model"]}
  # One RoPE cell is unfinished: the variants no longer share every cell, so unpaired.
  assert [c["paired"] for c in out["comparisons"]] == [False, False]
  wrong = sweep_cli("scaling", "--root", root, "--params", "tokens")
  assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # 12 runs of train.py and eval.py, 20-45 s each on 2 loaded cores
@pytest.mark.timeout(1200)
def test_a_small_ladder_runs_end_to_end_into_scaling_json(tmp_path):
  sizes = [{"model.d_model": d, "model.d_ff": 2 * d} for d in (16, 24, 32, 48)]
  body = ("def get_sweep():\n  return [" + ", ".join(
      repr({"train.flop_budget": f"{c:g}", **s}) for c in (2e8, 4e8, 8e8) for s in sizes) + "]\n")
  path = write_sweep(tmp_path, body)
  flags = [f for f in small_flags(tmp_path / "cache")
           if not any(field in f for field in ("num_steps", "d_model", "d_ff"))]
  root = str(tmp_path / "root")
  result = subprocess.run([sys.executable, "sweep.py", "run", "--sweep", path, "--config", TINY,
                           "--root", root, "--parallel", "2", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=1100, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  result = sweep_cli("scaling", "--root", root, "--resamples", "100")
  assert result.returncode == 0, result.stderr
  assert "fitted 12 runs" in result.stdout
  assert os.path.isfile(os.path.join(root, "scaling", "scaling.json"))


@pytest.mark.parametrize("command,flag,owner", [
    ("status", "--holdout=budget>=4e12", "`sweep.py scaling`"),
    ("report", "--resamples=200", "`sweep.py scaling`"),
    ("report", "--starts=8", "`sweep.py scaling`"),
    ("scaling", "--seeds=2", "`sweep.py run`"),
    ("run", "--baseline=x", "`sweep.py report` or `sweep.py scaling`")])
def test_a_flag_of_another_command_is_one_line_exit_2(tmp_path, command, flag, owner):
  result = sweep_cli(command, "--root", str(tmp_path / "root"), flag)
  name = flag.split("=")[0]
  assert result.returncode == 2
  assert result.stderr == (f"error: {name} is a flag of {owner}, not of {command}; "
                           "drop it\n")
  assert not (tmp_path / "root").exists()
